//! What the mesh is made from: the mesh config, the config cluster (its services, its Istio config,
//! the remote clusters its Secrets onboard), mesh networks, and the config directory's clusters
//! and Istio config — each loaded into one aggregate and watched.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::sync::mpsc::UnboundedReceiver;
use tracing::warn;

use super::StartError;
use crate::aggregate::Aggregate;
use crate::config::DiscoveryArgs;
use crate::istio::mesh::{ConfigSourceSpec, SourceAddress};
use crate::metrics::Metrics;
use crate::model::{Change, ClusterId, Mesh, Provider, ShardKey};
use crate::sources::allocated::AllocatedFile;
use crate::sources::config_files::{ConfigFiles, ConfigFilesWatch};
use crate::sources::file::{FileClusters, FileWatch};
use crate::sources::gateway_names;
use crate::sources::ingress::{self, IngressScope, IngressWatch};
use crate::sources::kube::{self as kube_source, KubeWatch};
use crate::sources::kube_config::{self, ConfigScope, KubeConfigWatch, MeshConfigMapKeys};
use crate::sources::mcp::{self, NodeIdentity, SourceStatuses};
use crate::sources::mesh_config::{self, MeshConfigWatch};
use crate::sources::networks::{self, NetworksSink, NetworksWatch};
use crate::sources::remote::{RemoteController, RemoteOptions, StaleSnapshots};
use crate::sources::snapshots::SnapshotStore;
use crate::supervise::{Health, Supervisor};
use crate::xds::server::Readiness;

/// The sources feeding the mesh, and their watches (dropping them stops the watching).
pub(super) struct Inputs {
    pub(super) aggregate: Arc<Aggregate>,
    pub(super) config_cluster: Option<ConfigCluster>,
    mesh_config_watch: Option<MeshConfigWatch>,
    /// Where MeshNetworks take effect, from `--mesh-networks` or the mesh ConfigMap.
    networks: NetworksSink,
    _networks_watch: Option<NetworksWatch>,
    _file_watch: Option<FileWatch>,
    _config_files_watch: Option<ConfigFilesWatch>,
    /// The MCP sources' states.
    pub(super) config_sources: SourceStatuses,
    /// How long readiness waits for the MCP sources' first sync.
    sync_timeout: std::time::Duration,
}

/// The config cluster's watches (its services and its Istio config) and the remote clusters its
/// Secrets onboard.
pub(super) struct ConfigCluster {
    pub(super) id: ClusterId,
    pub(super) client: kube::Client,
    watch: KubeWatch,
    pub(super) config: KubeConfigWatch,
    /// Kubernetes Ingresses, served as istiod's ingress controller serves them.
    pub(super) ingress: IngressWatch,
    pub(super) remotes: RemoteController,
}

/// Loads every source given into a new aggregate and starts watching them; the mesh's changes come
/// out of the receiver.
pub(super) async fn start(
    args: &DiscoveryArgs,
    metrics: &Metrics,
    supervisor: &mut Supervisor,
) -> Result<(Inputs, UnboundedReceiver<Change>), StartError> {
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
    match args.state_dir() {
        Some(dir) => {
            let allocated = AllocatedFile::in_state_dir(&dir);
            allocated.restore_into(&mesh);
            supervisor.spawn("allocated addresses", allocated.keep(mesh.clone()));
        }
        None => warn!("no state directory (give --state-dir or set HOME): addresses allocated to ServiceEntries are not kept across restarts"),
    }
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
    let sources: Vec<ConfigSourceSpec> = aggregate
        .mesh()
        .snapshot()
        .config
        .mesh()
        .config_sources
        .clone();
    let named = |wanted: fn(&SourceAddress<'_>) -> bool| {
        sources
            .iter()
            .filter(|s| s.target().as_ref().is_ok_and(wanted))
            .cloned()
            .collect::<Vec<_>>()
    };
    let from_cluster =
        sources.is_empty() || !named(|t| *t == SourceAddress::ConfigCluster).is_empty();
    let (networks, gateway_names) = NetworksSink::new(aggregate.clone());
    supervisor.spawn(
        "gateway names",
        gateway_names::resolve(aggregate.clone(), gateway_names),
    );
    let networks_watch = match &args.mesh_networks {
        Some(path) => Some(networks::watch(path, networks.clone())?),
        None => None,
    };
    let config_cluster = match (&args.kubeconfig, args.in_cluster) {
        (None, false) if !sources.is_empty() && from_cluster => {
            return Err(StartError::ConfigSource(
                "k8s:// names the config cluster: give --kubeconfig or --in-cluster".into(),
            ))
        }
        (None, false) => None,
        (path, _) => {
            let mesh_keys = MeshConfigMapKeys {
                mesh: args.mesh_config.is_none(),
                networks: args.mesh_networks.is_none().then(|| networks.clone()),
            };
            let inputs = (&aggregate, metrics, mesh_keys);
            let cluster = config_cluster(args, path.as_deref(), inputs, from_cluster).await?;
            Some(cluster.supervised(supervisor))
        }
    };
    let (config_sources, clients) = mcp::clients(
        &named(|t| matches!(t, SourceAddress::Xds(_))),
        aggregate.clone(),
        node_identity(args),
    );
    for client in clients {
        supervisor.spawn("config source (MCP)", client);
    }
    let file_watch = match &args.config_dir {
        Some(dir) => Some(FileClusters::load(dir, aggregate.clone())?.watch()?),
        None => None,
    };
    let directory = named(|t| matches!(t, SourceAddress::Files(_)));
    let watch_failed = |dir: &std::path::Path| {
        let dir = dir.display().to_string();
        move |source| StartError::ConfigFiles { dir, source }
    };
    let config_files_watch = match (sources.is_empty(), &args.config_dir, directory.first()) {
        (true, Some(dir), _) => Some(
            ConfigFiles::watch_config_dir(dir, aggregate.clone())
                .map_err(watch_failed(&dir.join("config")))?,
        ),
        (false, _, Some(source)) => {
            let dir = std::path::PathBuf::from(source.address.trim_start_matches("fs://"));
            let files = ConfigFiles::load_tree(&dir, aggregate.clone()).ok_or_else(|| {
                StartError::ConfigSource(format!("{}: no such directory", source.address))
            })?;
            Some(files.watch().map_err(watch_failed(&dir))?)
        }
        _ => None,
    };
    let inputs = Inputs {
        aggregate,
        config_cluster,
        mesh_config_watch,
        networks,
        _networks_watch: networks_watch,
        _file_watch: file_watch,
        _config_files_watch: config_files_watch,
        config_sources,
        sync_timeout: args.remote_cluster_timeout,
    };
    Ok((inputs, changes))
}

impl Inputs {
    /// As istiod: not ready before every cluster and the Istio config are loaded; never once a
    /// critical task is gone or the process is shutting down.
    pub(super) fn readiness(&self, alive: Health, draining: Arc<AtomicBool>) -> Readiness {
        let loaded = self.aggregate.clone();
        let secrets_listed = self
            .config_cluster
            .as_ref()
            .map(|c| c.remotes.initial_sync_signal());
        let config_listed = self
            .config_cluster
            .as_ref()
            .map(|c| c.config.synced_check());
        let ingress_listed = self
            .config_cluster
            .as_ref()
            .map(|c| c.ingress.synced_check());
        // MCP sources' first sync is waited for as long as remote clusters' is.
        let sources = self.config_sources.clone();
        let give_up = std::time::Instant::now() + self.sync_timeout;
        Arc::new(move || {
            alive.ok()
                && !draining.load(Ordering::Relaxed)
                && loaded.all_loaded()
                && secrets_listed.as_ref().is_none_or(|s| *s.borrow())
                && config_listed.as_ref().is_none_or(|listed| listed())
                && ingress_listed.as_ref().is_none_or(|listed| listed())
                && (sources.lock().iter().all(|s| s.synced) || std::time::Instant::now() > give_up)
        })
    }

    /// Where the last error reading MeshNetworks (file or ConfigMap) is kept.
    pub(super) fn networks_error(&self) -> Arc<parking_lot::Mutex<Option<String>>> {
        self.networks.last_error.clone()
    }

    /// Where the last error reading the mesh config (file or ConfigMap) is kept.
    pub(super) fn mesh_config_error(&self) -> Arc<parking_lot::Mutex<Option<String>>> {
        self.mesh_config_watch
            .as_ref()
            .map(|w| w.last_error.clone())
            .or_else(|| {
                self.config_cluster
                    .as_ref()
                    .map(|c| c.config.mesh_error.clone())
            })
            .unwrap_or_default()
    }
}

impl ConfigCluster {
    fn supervised(mut self, supervisor: &mut Supervisor) -> Self {
        self.watch.supervise(supervisor, "config cluster watch");
        self.config
            .supervise(supervisor, "config cluster Istio config watch");
        self.ingress
            .supervise(supervisor, "config cluster Ingress watch");
        self.remotes.supervise(supervisor);
        self
    }
}

async fn config_cluster(
    args: &DiscoveryArgs,
    kubeconfig: Option<&std::path::Path>,
    (aggregate, metrics, mesh_keys): (&Arc<Aggregate>, &Metrics, MeshConfigMapKeys),
    istio_config: bool,
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
    let discovered = registry.discovered().clone();
    let watch =
        kube_source::watch_cluster(client.clone(), registry, aggregate.discovery_selectors());
    let ingress_scope = IngressScope {
        cluster: id.clone(),
        discovered: discovered.clone(),
        namespace: args.ingress_namespace.clone(),
        domain_suffix: args.domain_suffix.clone(),
    };
    let ingress = ingress::watch(client.clone(), ingress_scope, aggregate.clone());
    let scope = ConfigScope {
        cluster: id.clone(),
        discovered,
        revision: args.inject.revision.clone(),
        system_namespace: args.system_namespace.clone(),
    };
    let config = kube_config::watch(
        client.clone(),
        scope,
        aggregate.clone(),
        mesh_keys,
        istio_config,
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
        ingress,
        remotes,
    })
}

/// Who meshpilot says it is to its MCP sources: its pod (Kubernetes' downward API gives
/// `POD_NAME`, `POD_IP`) in the system namespace.
fn node_identity(args: &DiscoveryArgs) -> NodeIdentity {
    let env = |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.into());
    NodeIdentity {
        pod: env("POD_NAME", "meshpilot"),
        namespace: args.system_namespace.clone(),
        ip: env("POD_IP", "127.0.0.1"),
    }
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
