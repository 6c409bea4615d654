//! Wiring: builds the model, starts the sources and servers of `meshpilot discovery`.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;

use crate::admin::{self, AdminState, DebugAccess};
use crate::aggregate::Aggregate;
use crate::config::DiscoveryArgs;
use crate::debug::DebugContext;
use crate::inject::InjectConfig;
use crate::istio::ConfigKind;
use crate::kube_client::RemoteClients;
use crate::leader::{self, Leader, LeaderConfig};
use crate::listen::{self, Acceptor, BindError};
use crate::metrics::Metrics;
use crate::model::Mesh;
use crate::model::{ClusterId, Provider, ShardKey};
use crate::security::authn::Authenticator;
use crate::security::ca::{CertificateAuthority, TtlPolicy};
use crate::security::keys::{self, KeySource};
use crate::security::rotation::{self, SharedCa};
use crate::security::service::CaService;
use crate::security::tls::{self, ServingCert};
use crate::security::trust;
use crate::sources::auto_registration::AutoRegistration;
use crate::sources::config_files::{ConfigFiles, ConfigFilesWatch};
use crate::sources::file::{FileClusters, FileSourceError, FileWatch};
use crate::sources::jwks::{JwksOptions, JwksResolver};
use crate::sources::kube::{self as kube_source, KubeSourceError, KubeWatch};
use crate::sources::kube_config::{self, KubeConfigWatch};
use crate::sources::mesh_config::{self, MeshConfigWatch};
use crate::sources::networks::{self, NetworksWatch};
use crate::sources::remote::{RemoteController, RemoteOptions, StaleSnapshots};
use crate::sources::snapshots::SnapshotStore;
use crate::supervise::{Supervisor, TaskEnded};
use crate::webhook::{self, ca_bundle, WebhookState};
use crate::xds::introspect::DebugViews;
use crate::xds::push::{debounce, DebounceConfig};
use crate::xds::server::{Readiness, XdsServer};
use tracing::{error, info, warn};

#[derive(Debug, Error)]
pub enum StartError {
    #[error("nothing to serve: give --config-dir, --kubeconfig or --in-cluster")]
    NoSources,
    #[error(transparent)]
    KubeSource(#[from] KubeSourceError),
    #[error(transparent)]
    Aggregate(#[from] crate::aggregate::AggregateError),
    #[error(transparent)]
    FileSource(#[from] FileSourceError),
    #[error(transparent)]
    Networks(#[from] crate::sources::networks::NetworksSourceError),
    #[error("xDS server: {0}")]
    Grpc(#[from] tonic::transport::Error),
    #[error("CA: {0}")]
    Keys(#[from] crate::security::keys::KeysError),
    #[error("CA from {origin}: {source}")]
    Ca {
        origin: String,
        source: crate::security::ca::CaError,
    },
    #[error("CA: no state directory for the self-signed root: give --ca-state-dir (or set HOME)")]
    NoStateDir,
    #[error("secure xDS: {0}")]
    Tls(#[from] crate::security::tls::TlsError),
    #[error(transparent)]
    Bind(#[from] BindError),
    #[error(transparent)]
    MeshConfig(#[from] crate::sources::mesh_config::MeshConfigError),
    #[error("cannot watch the Istio config in {dir}/config: {source}")]
    ConfigFiles { dir: String, source: notify::Error },
    #[error("webhook server: {0}")]
    Webhook(std::io::Error),
    #[error("cannot read the bound address of {what}: {source}")]
    LocalAddr {
        what: &'static str,
        source: std::io::Error,
    },
}

/// A TLS client that has not finished its handshake by then is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A running control plane. Dropping it stops its servers and watches.
pub struct Running {
    pub http_addr: SocketAddr,
    pub xds_addr: SocketAddr,
    pub secure_xds_addr: SocketAddr,
    pub webhook_addr: SocketAddr,
    pub ca: Arc<SharedCa>,
    pub xds: Arc<XdsServer>,
    pub aggregate: Arc<Aggregate>,
    supervisor: Supervisor,
    /// Set at shutdown: readiness goes false and new xDS streams are refused.
    draining: Arc<AtomicBool>,
    drain_duration: Duration,
    _file_watch: Option<FileWatch>,
    _networks_watch: Option<NetworksWatch>,
    _config_files_watch: Option<ConfigFilesWatch>,
    _mesh_config_watch: Option<MeshConfigWatch>,
    config_cluster: Option<ConfigCluster>,
    /// With a Kubernetes config cluster: the election deciding who does the one-replica work.
    leader: Option<Leader>,
}

/// The config cluster's watches (its services and its Istio config) and the remote clusters its
/// Secrets onboard.
struct ConfigCluster {
    id: ClusterId,
    client: kube::Client,
    watch: KubeWatch,
    config: KubeConfigWatch,
    remotes: RemoteController,
}

impl Running {
    /// Clients of the remote clusters onboarded from Secrets (none without a Kubernetes config cluster).
    pub fn remote_clients(&self) -> Option<RemoteClients> {
        self.config_cluster.as_ref().map(|c| c.remotes.clients())
    }

    /// Serves until `stop` resolves, then shuts down gracefully (`shutdown`); or until a
    /// supervised task ends, which is returned: the process should exit non-zero.
    pub async fn serve_until(mut self, stop: impl Future<Output = ()>) -> Result<(), TaskEnded> {
        tokio::select! {
            () = stop => {
                self.shutdown().await;
                Ok(())
            }
            ended = self.supervisor.ended() => {
                error!(task = ended.task, cause = %ended.cause, "a critical task ended; stopping");
                Err(ended)
            }
        }
    }

    /// Stops gracefully: readiness goes false and new streams are refused, connected proxies are
    /// asked to reconnect (their streams closed spread over the drain period), remote snapshots are
    /// written, and leadership is handed over at once rather than after the lease duration.
    pub async fn shutdown(mut self) {
        self.draining.store(true, Ordering::Relaxed);
        info!(drain = ?self.drain_duration, "shutting down");
        self.xds.close_streams(self.drain_duration).await;
        if let Some(c) = &self.config_cluster {
            let flushed = tokio::time::timeout(SHUTDOWN_STEP, c.remotes.flush_snapshots()).await;
            if flushed.is_err() {
                warn!("remote cluster snapshots not written within {SHUTDOWN_STEP:?}");
            }
        }
        if let Some(leader) = self.leader.take() {
            if tokio::time::timeout(SHUTDOWN_STEP, leader.release())
                .await
                .is_err()
            {
                warn!("leader Lease not released within {SHUTDOWN_STEP:?}");
            }
        }
        self.supervisor.abort_all();
        info!("stopped");
    }
}

/// The most any one step after the drain may take at shutdown (writing snapshots, releasing the
/// Lease), so the process exits within its grace period.
const SHUTDOWN_STEP: Duration = Duration::from_secs(5);

pub async fn start(args: DiscoveryArgs) -> Result<Running, StartError> {
    crate::security::install_crypto_provider();
    // The mesh config's trust domain, when it names one, is the installation's.
    let mut naming = args.naming();
    let mesh_config = match &args.mesh_config {
        Some(path) => {
            let config = mesh_config::read(path, &naming.mesh_defaults())?;
            naming.trust_domain = config.trust_domain.clone();
            Some(config)
        }
        None => None,
    };
    let mesh = Arc::new(Mesh::new(naming.clone()));
    let (aggregate, changes) = Aggregate::new(mesh);
    let mesh_config_watch = match (&args.mesh_config, mesh_config) {
        (Some(path), Some(config)) => {
            aggregate.set_mesh_config(config);
            let defaults = naming.mesh_defaults();
            Some(mesh_config::watch(path, aggregate.clone(), defaults)?)
        }
        _ => None,
    };

    if args.config_dir.is_none() && args.kubeconfig.is_none() && !args.in_cluster {
        return Err(StartError::NoSources);
    }
    let metrics = Arc::new(Metrics::new(ClusterId::new(&args.cluster_id)));
    let mut config_cluster = match (&args.kubeconfig, args.in_cluster) {
        (None, false) => None,
        (path, _) => {
            Some(start_config_cluster(&args, path.as_deref(), &aggregate, &metrics).await?)
        }
    };
    let networks_watch = match &args.mesh_networks {
        Some(path) => Some(networks::watch(path, aggregate.clone())?),
        None => None,
    };
    let networks_error = networks_watch
        .as_ref()
        .map(|w| w.last_error.clone())
        .unwrap_or_default();
    let file_watch = match &args.config_dir {
        Some(dir) => Some(FileClusters::load(dir, aggregate.clone())?.watch()?),
        None => None,
    };
    let config_files_watch = match &args.config_dir {
        Some(dir) => match ConfigFiles::load(dir, aggregate.clone()) {
            Some(files) => Some(files.watch().map_err(|source| StartError::ConfigFiles {
                dir: dir.display().to_string(),
                source,
            })?),
            None => None,
        },
        None => None,
    };

    let mut supervisor = Supervisor::default();
    if let Some(c) = config_cluster.as_mut() {
        c.watch.supervise(&mut supervisor, "config cluster watch");
        c.config
            .supervise(&mut supervisor, "config cluster Istio config watch");
        c.remotes.supervise(&mut supervisor);
    }
    let health = supervisor.health();
    let draining = Arc::new(AtomicBool::new(false));
    let loaded = aggregate.clone();
    let secrets_listed = config_cluster
        .as_ref()
        .map(|c| c.remotes.initial_sync_signal());
    let config_listed = config_cluster.as_ref().map(|c| c.config.synced_check());
    // As istiod: not ready before every cluster and the Istio config are loaded; never once a
    // critical task is gone or the process is shutting down.
    let (alive, stopping) = (health.clone(), draining.clone());
    let ready: Readiness = Arc::new(move || {
        alive.ok()
            && !stopping.load(Ordering::Relaxed)
            && loaded.all_loaded()
            && secrets_listed.as_ref().is_none_or(|s| *s.borrow())
            && config_listed.as_ref().is_none_or(|listed| listed())
    });
    let xds = XdsServer::new(
        aggregate.mesh().clone(),
        ready.clone(),
        args.xds_options(),
        metrics.xds(),
    );
    xds.set_auto_registration(AutoRegistration::new(
        aggregate.clone(),
        args.workload_entry_grace_period,
    ));
    let grpc = listen::bind("xds", args.xds_addr).await?;
    let xds_addr = local_addr("xds", &grpc)?;
    let router = grpc_server().add_service(xds.service());
    supervisor.spawn("xds server", async move {
        let incoming = grpc.into_stream();
        if let Err(e) = router.serve_with_incoming(incoming).await {
            tracing::error!(error = %e, "xDS server stopped");
        }
    });

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

    let mut leader = config_cluster.as_ref().map(|c| {
        Leader::start(
            c.client.clone(),
            LeaderConfig {
                namespace: args.system_namespace.clone(),
                name: leader::LEASE_NAME.into(),
                identity: args
                    .leader_identity
                    .clone()
                    .unwrap_or_else(leader::default_identity),
                lease_duration: args.leader_election_lease_duration,
            },
        )
    });
    if let Some(leader) = leader.as_mut() {
        leader.supervise(&mut supervisor);
    }
    let key_source = match (&args.ca_dir, &config_cluster) {
        (Some(dir), _) => KeySource::Dir(dir.clone()),
        (None, Some(c)) => KeySource::Kubernetes {
            client: c.client.clone(),
            namespace: args.system_namespace.clone(),
            leading: leader.as_ref().map(Leader::leading),
        },
        (None, None) => {
            let dir = args.ca_state_dir().ok_or(StartError::NoStateDir)?;
            info!(dir = %dir.display(), "CA state directory");
            KeySource::StateDir(dir)
        }
    };
    let loaded = keys::load(key_source, &args.trust_domain, args.self_signed_root_ttl).await?;
    let ttl = TtlPolicy {
        default: args.workload_cert_ttl,
        max: args.max_workload_cert_ttl,
    };
    let ca = CertificateAuthority::new(&loaded.bundle, ttl).map_err(|source| StartError::Ca {
        origin: loaded.origin,
        source,
    })?;
    let ca = SharedCa::new(ca);
    if let Some(store) = loaded.self_signed {
        supervisor.adopt(
            "root rotation",
            rotation::keep_rotated(
                ca.clone(),
                store,
                loaded.bundle,
                args.root_rotation(),
                metrics.ca(),
            ),
        );
    }
    let authn = Arc::new(Authenticator::new(
        &args.trust_domain,
        config_cluster
            .as_ref()
            .map(|c| (c.id.clone(), c.client.clone())),
        config_cluster.as_ref().map(|c| c.remotes.clients()),
    ));
    let names = args.serving_names();
    let serving = ServingCert::issue(&ca.current(), &names, args.serving_cert_ttl)?;
    supervisor.adopt(
        "serving certificate renewal",
        serving.keep_renewed(ca.clone(), names, args.serving_cert_ttl),
    );
    let tls = tls::server_config(serving.clone(), ca.clone())?;
    let secure = listen::bind("secure-xds", args.secure_xds_addr).await?;
    let secure_xds_addr = local_addr("secure-xds", &secure)?;
    let router = grpc_server()
        .add_service(xds.secure_service(authn.clone()))
        .add_service(CaService::server(ca.clone(), authn.clone(), metrics.ca()));
    supervisor.spawn("secure xds server", async move {
        let incoming = tls::incoming(secure, tls, HANDSHAKE_TIMEOUT);
        if let Err(e) = router.serve_with_incoming(incoming).await {
            tracing::error!(error = %e, "secure xDS server stopped");
        }
    });
    if let (Some(c), Some(leader)) = (&config_cluster, &leader) {
        let (client, id, remotes) = (c.client.clone(), c.id.clone(), c.remotes.clients());
        let namespace = args.system_namespace.clone();
        let roots = ca.roots();
        supervisor.adopt(
            "leader work",
            leader::run_while_leading(leader.leading(), move || {
                let mut work = trust::publish_root(
                    client.clone(),
                    id.clone(),
                    remotes.clone(),
                    namespace.clone(),
                    roots.clone(),
                );
                work.extend(ca_bundle::keep_current(
                    client.clone(),
                    id.clone(),
                    remotes.clone(),
                    namespace.clone(),
                    roots.clone(),
                ));
                work
            }),
        );
    }

    let webhook_state = Arc::new(WebhookState {
        inject: InjectConfig {
            proxy_image: args.inject.proxy_image.clone(),
            cluster_id: args.cluster_id.clone(),
            network: args.inject.network.clone(),
            mesh_id: args.inject.mesh_id.clone(),
            system_namespace: args.system_namespace.clone(),
            domain_suffix: args.domain_suffix.clone(),
            mesh: aggregate.mesh().snapshot().config.mesh().clone(),
        },
        mesh: aggregate.mesh().clone(),
        cluster_id: args.cluster_id.clone(),
    });
    let hooks = listen::bind("webhook", args.webhook_addr).await?;
    let webhook_addr = local_addr("webhook", &hooks)?;
    supervisor.adopt(
        "webhook server",
        webhook::serve(
            hooks,
            webhook::tls_config(serving),
            webhook::router(webhook_state),
            HANDSHAKE_TIMEOUT,
        )
        .map_err(StartError::Webhook)?,
    );

    let http = listen::bind("admin", args.http_addr).await?;
    let http_addr = local_addr("admin", &http)?;
    let debug = Arc::new(DebugContext {
        aggregate: aggregate.clone(),
        xds: xds.clone(),
        networks_error,
        mesh_config_error: mesh_config_watch
            .as_ref()
            .map(|w| w.last_error.clone())
            .or_else(|| config_cluster.as_ref().map(|c| c.config.mesh_error.clone()))
            .unwrap_or_default(),
    });
    let views: std::sync::Weak<dyn DebugViews> = Arc::downgrade(&debug) as _;
    xds.set_debug_views(views);
    let mut debug_namespaces = vec![args.system_namespace.clone()];
    debug_namespaces.extend(args.debug_namespaces.iter().cloned());
    let router = admin::router(Arc::new(AdminState {
        ready: ready.clone(),
        aggregate: aggregate.clone(),
        metrics,
        debug,
        health: health.clone(),
        debug_access: DebugAccess {
            open: args.insecure_open_debug,
            authn: config_cluster.as_ref().map(|_| authn),
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

    Ok(Running {
        http_addr,
        xds_addr,
        secure_xds_addr,
        webhook_addr,
        ca,
        xds,
        aggregate,
        supervisor,
        draining,
        drain_duration: args.drain_duration,
        _file_watch: file_watch,
        _networks_watch: networks_watch,
        _config_files_watch: config_files_watch,
        _mesh_config_watch: mesh_config_watch,
        config_cluster,
        leader,
    })
}

/// Streams one client connection may hold open at once: a proxy needs one ADS stream (and its
/// agent a few CSRs); a client opening thousands on one connection is held to this.
const STREAMS_PER_CONNECTION: u32 = 32;

fn grpc_server() -> tonic::transport::Server {
    tonic::transport::Server::builder().max_concurrent_streams(Some(STREAMS_PER_CONNECTION))
}

fn local_addr(what: &'static str, acceptor: &Acceptor) -> Result<SocketAddr, StartError> {
    acceptor
        .local_addr()
        .map_err(|source| StartError::LocalAddr { what, source })
}

async fn start_config_cluster(
    args: &DiscoveryArgs,
    kubeconfig: Option<&std::path::Path>,
    aggregate: &Arc<Aggregate>,
    metrics: &Metrics,
) -> Result<ConfigCluster, StartError> {
    let client = kube_source::client(kubeconfig).await?;
    let source = match kubeconfig {
        Some(p) => format!("kubeconfig:{}", p.display()),
        None => "in-cluster".to_string(),
    };
    let id = ClusterId::new(&args.cluster_id);
    let shard = ShardKey {
        provider: Provider::Kubernetes,
        cluster: id.clone(),
    };
    let registry = aggregate.add_cluster(shard, source, true)?;
    let watch = kube_source::watch_cluster(client.clone(), registry, &args.system_namespace);
    let config = kube_config::watch(
        client.clone(),
        id.clone(),
        aggregate.clone(),
        &args.system_namespace,
        args.mesh_config.is_none(),
    );
    let options = RemoteOptions {
        system_namespace: args.system_namespace.clone(),
        config_cluster: id.clone(),
        sync_timeout: args.remote_cluster_timeout,
        insecure: args.insecure_kubeconfig_options.clone(),
        snapshots: stale_snapshots(args),
    };
    let remotes =
        RemoteController::start(client.clone(), aggregate.clone(), options, metrics.remote());
    Ok(ConfigCluster {
        id,
        client,
        watch,
        config,
        remotes,
    })
}

/// Where remote clusters' last-known-good snapshots are kept, unless there is no state directory
/// or `--stale-remote-max-age` is zero.
fn stale_snapshots(args: &DiscoveryArgs) -> Option<StaleSnapshots> {
    if args.stale_remote_max_age.is_zero() {
        return None;
    }
    let Some(dir) = args.state_dir() else {
        warn!("no state directory (give --state-dir or set HOME): remote clusters' last-known-good snapshots are not kept");
        return None;
    };
    Some(StaleSnapshots {
        store: SnapshotStore::new(dir.join("remotes")),
        max_age: args.stale_remote_max_age,
    })
}
