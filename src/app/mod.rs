//! Wiring: builds the model, starts the sources and servers of `meshpilot discovery`, one
//! function per subsystem (`inputs`, `serving`, `trust`) called in order by `start`.

mod inputs;
mod serving;
mod trust;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;
use tracing::{error, info, warn};

use self::inputs::Inputs;
use crate::aggregate::Aggregate;
use crate::config::DiscoveryArgs;
use crate::kube_client::RemoteClients;
use crate::leader::{HeldLocks, Leader};
use crate::listen::BindError;
use crate::metrics::Metrics;
use crate::model::ClusterId;
use crate::security::rotation::SharedCa;
use crate::security::secret_access::SecretAccess;
use crate::sources::file::FileSourceError;
use crate::sources::kube::KubeSourceError;
use crate::supervise::{Supervisor, TaskEnded};
use crate::xds::server::XdsServer;

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
    #[error("cannot watch the Istio config in {dir}: {source}")]
    ConfigFiles { dir: String, source: notify::Error },
    #[error("mesh config configSources: {0}")]
    ConfigSource(String),
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
    /// None where no webhook is served (file mode without `--webhook-addr`).
    pub webhook_addr: Option<SocketAddr>,
    pub ca: Arc<SharedCa>,
    pub xds: Arc<XdsServer>,
    pub aggregate: Arc<Aggregate>,
    supervisor: Supervisor,
    /// Set at shutdown: readiness goes false and new xDS streams are refused.
    draining: Arc<AtomicBool>,
    drain_duration: Duration,
    /// The sources and their watches.
    inputs: Inputs,
    /// With a Kubernetes config cluster: the election deciding who does the one-replica work.
    leader: Option<Leader>,
    /// istiod's locks competed for under that leadership, released at shutdown.
    held_locks: HeldLocks,
}

impl Running {
    /// Clients of the remote clusters onboarded from Secrets (none without a Kubernetes config cluster).
    pub fn remote_clients(&self) -> Option<RemoteClients> {
        self.inputs
            .config_cluster
            .as_ref()
            .map(|c| c.remotes.clients())
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
        if let Some(c) = &self.inputs.config_cluster {
            let flushed = tokio::time::timeout(SHUTDOWN_STEP, c.remotes.flush_snapshots()).await;
            if flushed.is_err() {
                warn!("remote cluster snapshots not written within {SHUTDOWN_STEP:?}");
            }
        }
        // istiod's locks first: whoever takes them next does not wait for them to expire.
        if tokio::time::timeout(SHUTDOWN_STEP, self.held_locks.release_all())
            .await
            .is_err()
        {
            warn!("istiod's locks not released within {SHUTDOWN_STEP:?}");
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

/// Starts every subsystem of `meshpilot discovery`, in the order their dependencies need.
pub async fn start(args: DiscoveryArgs) -> Result<Running, StartError> {
    crate::security::install_crypto_provider();
    let metrics = Arc::new(Metrics::new(ClusterId::new(&args.cluster_id)));
    let mut supervisor = Supervisor::default();
    let (inputs, changes) = inputs::start(&args, &metrics, &mut supervisor).await?;
    let draining = Arc::new(AtomicBool::new(false));
    let ready = inputs.readiness(supervisor.health(), draining.clone());
    let aggregate = &inputs.aggregate;
    let config_cluster = inputs.config_cluster.as_ref();
    let secret_access = SecretAccess::new(trust::cluster_clients(config_cluster));
    let (xds, xds_addr) = serving::xds(
        &args,
        aggregate,
        (ready.clone(), secret_access),
        &metrics,
        &mut supervisor,
    )
    .await?;
    serving::push_loop(&args, aggregate, changes, &xds, &metrics, &mut supervisor);

    let leader = trust::leader(&args, config_cluster, &mut supervisor);
    let ca = trust::ca(
        &args,
        config_cluster,
        leader.as_ref(),
        &metrics,
        &mut supervisor,
    )
    .await?;
    trust::trust_bundle(&args, aggregate, &ca, &mut supervisor);
    let authn = trust::authenticator(&args, config_cluster);
    let serving_cert = trust::serving_cert(&args, &ca, &mut supervisor)?;
    let nodes = trust::node_authorizer(&args, aggregate);
    let secure_xds_addr = serving::secure_xds(
        &args,
        &xds,
        &ca,
        (&authn, nodes),
        serving_cert.clone(),
        &metrics,
        &mut supervisor,
    )
    .await?;
    let held_locks = HeldLocks::default();
    trust::leader_work(
        &args,
        config_cluster,
        leader.as_ref(),
        &ca,
        aggregate,
        (&held_locks, &mut supervisor),
    );
    let webhook_addr = serving::webhook(&args, aggregate, serving_cert, &mut supervisor).await?;
    let http_addr =
        serving::admin(&args, &inputs, &xds, ready, metrics, authn, &mut supervisor).await?;

    Ok(Running {
        http_addr,
        xds_addr,
        secure_xds_addr,
        webhook_addr,
        ca,
        xds,
        aggregate: aggregate.clone(),
        supervisor,
        draining,
        drain_duration: args.drain_duration,
        inputs,
        leader,
        held_locks,
    })
}
