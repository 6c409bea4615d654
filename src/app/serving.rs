//! The servers: plaintext xDS and the push loop feeding it, secure xDS with the CA service, the
//! webhooks, and the admin server (health, readiness, metrics, debug views).

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::sync::mpsc::UnboundedReceiver;
use tracing::warn;

use super::inputs::Inputs;
use super::{StartError, HANDSHAKE_TIMEOUT};
use crate::admin::{self, AdminState, DebugAccess};
use crate::aggregate::Aggregate;
use crate::config::DiscoveryArgs;
use crate::debug::DebugContext;
use crate::istio::ConfigKind;
use crate::listen::{self, Acceptor};
use crate::metrics::Metrics;
use crate::model::Change;
use crate::security::authn::Authenticator;
use crate::security::node_auth::NodeAuthorizer;
use crate::security::rotation::SharedCa;
use crate::security::secret_access::SecretAccess;
use crate::security::service::CaService;
use crate::security::tls::{self, ServingCert};
use crate::sources::auto_registration::AutoRegistration;
use crate::sources::jwks::{JwksOptions, JwksResolver};
use crate::supervise::Supervisor;
use crate::webhook::{self, WebhookState};
use crate::xds::introspect::DebugViews;
use crate::xds::push::{debounce, DebounceConfig};
use crate::xds::server::{Readiness, XdsServer};

/// Streams one client connection may hold open at once: a proxy needs one ADS stream (and its
/// agent a few CSRs); a client opening thousands on one connection is held to this.
const STREAMS_PER_CONNECTION: u32 = 32;

/// The xDS server and its plaintext port.
pub(super) async fn xds(
    args: &DiscoveryArgs,
    aggregate: &Arc<Aggregate>,
    (ready, secret_access): (Readiness, SecretAccess),
    metrics: &Metrics,
    supervisor: &mut Supervisor,
) -> Result<(Arc<XdsServer>, SocketAddr), StartError> {
    let xds = XdsServer::new(
        aggregate.mesh().clone(),
        ready,
        args.xds_options(),
        metrics.xds(),
        secret_access,
    );
    xds.set_auto_registration(AutoRegistration::new(
        aggregate.clone(),
        args.workload_entry_grace_period,
    ));
    let grpc = listen::bind("xds", args.xds_addr).await?;
    let addr = local_addr("xds", &grpc)?;
    let router = grpc_server().add_service(xds.service());
    supervisor.spawn("xds server", async move {
        let incoming = grpc.into_stream();
        if let Err(e) = router.serve_with_incoming(incoming).await {
            tracing::error!(error = %e, "xDS server stopped");
        }
    });
    Ok((xds, addr))
}

/// Changes debounced into pushes; the JWT key resolver woken when RequestAuthentications change.
pub(super) fn push_loop(
    args: &DiscoveryArgs,
    aggregate: &Arc<Aggregate>,
    changes: UnboundedReceiver<Change>,
    xds: &Arc<XdsServer>,
    metrics: &Metrics,
    supervisor: &mut Supervisor,
) {
    let config = DebounceConfig {
        after: args.debounce_after,
        max: args.debounce_max,
    };
    let jwks_options = JwksOptions {
        refresh: args.jwks_refresh_interval,
        timeout: args.jwks_fetch_timeout,
    };
    let (jwks, jwks_task) = JwksResolver::start(aggregate.clone(), jwks_options);
    supervisor.adopt("jwks resolver", jwks_task);
    let pusher = xds.clone();
    let push_metrics = metrics.push();
    supervisor.spawn(
        "push loop",
        debounce(changes, config, move |debounced| {
            fail::fail_point!("push-loop");
            push_metrics.debounced(&debounced.triggers, debounced.first_at.elapsed());
            let change = debounced.change;
            // RequestAuthentications may name keys to fetch (or no longer need some).
            if change
                .configs
                .iter()
                .any(|k| k.kind == ConfigKind::RequestAuthentication)
            {
                jwks.wake();
            }
            pusher.push(change, debounced.first_at)
        }),
    );
}

/// Secure xDS and the CA service on one mTLS port.
pub(super) async fn secure_xds(
    args: &DiscoveryArgs,
    xds: &Arc<XdsServer>,
    ca: &Arc<SharedCa>,
    (authn, nodes): (&Arc<Authenticator>, NodeAuthorizer),
    serving: Arc<ServingCert>,
    metrics: &Metrics,
    supervisor: &mut Supervisor,
) -> Result<SocketAddr, StartError> {
    let tls = tls::server_config(serving, ca.clone())?;
    let secure = listen::bind("secure-xds", args.secure_xds_addr).await?;
    let addr = local_addr("secure-xds", &secure)?;
    let router = grpc_server()
        .add_service(xds.secure_service(authn.clone()))
        .add_service(CaService::server(
            ca.clone(),
            authn.clone(),
            nodes,
            metrics.ca(),
        ));
    supervisor.spawn("secure xds server", async move {
        let incoming = tls::incoming(secure, tls, HANDSHAKE_TIMEOUT);
        if let Err(e) = router.serve_with_incoming(incoming).await {
            tracing::error!(error = %e, "secure xDS server stopped");
        }
    });
    Ok(addr)
}

/// The injection and validation webhooks, where an API server can call them (or `--webhook-addr`
/// asks); the address they listen on.
pub(super) async fn webhook(
    args: &DiscoveryArgs,
    aggregate: &Aggregate,
    serving: Arc<ServingCert>,
    supervisor: &mut Supervisor,
) -> Result<Option<SocketAddr>, StartError> {
    let Some(webhook_addr) = args.webhook_addr() else {
        return Ok(None);
    };
    let state = Arc::new(WebhookState {
        inject: args.inject.config(
            &args.cluster_id,
            &args.system_namespace,
            &args.domain_suffix,
            aggregate.mesh().snapshot().config.mesh().clone(),
        ),
        mesh: aggregate.mesh().clone(),
        cluster_id: args.cluster_id.clone(),
    });
    let hooks = listen::bind("webhook", webhook_addr).await?;
    let addr = local_addr("webhook", &hooks)?;
    supervisor.adopt(
        "webhook server",
        webhook::serve(
            hooks,
            webhook::tls_config(serving),
            webhook::router(state),
            HANDSHAKE_TIMEOUT,
        )
        .map_err(StartError::Webhook)?,
    );
    Ok(Some(addr))
}

/// The admin server; the debug views it serves are also the xDS server's.
pub(super) async fn admin(
    args: &DiscoveryArgs,
    inputs: &Inputs,
    xds: &Arc<XdsServer>,
    ready: Readiness,
    metrics: Arc<Metrics>,
    authn: Arc<Authenticator>,
    supervisor: &mut Supervisor,
) -> Result<SocketAddr, StartError> {
    let http = listen::bind("admin", args.http_addr).await?;
    let addr = local_addr("admin", &http)?;
    let debug = Arc::new(DebugContext {
        aggregate: inputs.aggregate.clone(),
        xds: xds.clone(),
        networks_error: inputs.networks_error(),
        mesh_config_error: inputs.mesh_config_error(),
        config_sources: inputs.config_sources.clone(),
    });
    let views: std::sync::Weak<dyn DebugViews> = Arc::downgrade(&debug) as _;
    xds.set_debug_views(views);
    let mut debug_namespaces = vec![args.system_namespace.clone()];
    debug_namespaces.extend(args.debug_namespaces.iter().cloned());
    let router = admin::router(Arc::new(AdminState {
        ready,
        aggregate: inputs.aggregate.clone(),
        metrics,
        debug,
        health: supervisor.health(),
        debug_access: DebugAccess {
            open: args.insecure_open_debug,
            authn: inputs.config_cluster.as_ref().map(|_| authn),
            namespaces: debug_namespaces,
        },
    }));
    if args.insecure_open_debug {
        warn!("--insecure-open-debug: every caller may read the debug views and debug xDS types");
    }
    supervisor.spawn("admin server", async move {
        if let Err(e) = admin::serve(http, router).await {
            tracing::error!(error = %e, "admin server stopped");
        }
    });
    Ok(addr)
}

fn grpc_server() -> tonic::transport::Server {
    tonic::transport::Server::builder().max_concurrent_streams(Some(STREAMS_PER_CONNECTION))
}

fn local_addr(what: &'static str, acceptor: &Acceptor) -> Result<SocketAddr, StartError> {
    acceptor
        .local_addr()
        .map_err(|source| StartError::LocalAddr { what, source })
}
