//! The remote-cluster secret controller: Secrets labelled `istio/multiCluster=true` in the system
//! namespace of the config cluster onboard remote clusters, one per data key (cluster id → kubeconfig).
//!
//! It is the one owner of each remote cluster's lifecycle: add, zero-gap rotation, removal. A changed
//! kubeconfig is synced in a staged registry beside the serving one and swapped in only once synced;
//! if it never syncs, the old one keeps serving and the error is reported.
//!
//! With a state directory it also keeps each synced remote's last-known-good snapshot (saved every
//! few seconds while it changes): after a restart, a remote whose API server cannot be reached is
//! served from it, marked stale, until it syncs or the snapshot passes its maximum age.

mod selectors;
mod stale;

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use kube::config::Kubeconfig;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client, ResourceExt};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tracing::{error, info, warn};

use self::selectors::ClusterSelectors;
use super::kube::{watch_cluster, KubeWatch};
use crate::aggregate::Aggregate;
use crate::istio::label_selector::LabelSelector;
use crate::kube_client::kubeconfig::{self, InsecureOptions};
use crate::kube_client::{retried, RemoteClients};
use crate::metrics::RemoteMetrics;
use crate::model::{ClusterId, Provider, ShardKey};
use crate::registry::{ClusterRegistry, SyncState, SECRET_SOURCE};
use crate::supervise::{OwnedTasks, Supervisor};
pub use stale::StaleSnapshots;
use stale::SAVE_CHECK;

pub const MULTICLUSTER_LABEL: &str = "istio/multiCluster=true";

#[derive(Clone, Debug)]
pub struct RemoteOptions {
    pub system_namespace: String,
    pub config_cluster: ClusterId,
    /// How long readiness waits for a remote cluster; zero waits forever.
    pub sync_timeout: Duration,
    pub insecure: InsecureOptions,
    pub snapshots: Option<StaleSnapshots>,
}

/// The running controller; dropping it stops every remote cluster's watches.
pub struct RemoteController {
    task: OwnedTasks,
    initial: watch::Receiver<bool>,
    clients: RemoteClients,
    notes: mpsc::UnboundedSender<Note>,
}

impl RemoteController {
    pub fn start(
        config: Client,
        aggregate: Arc<Aggregate>,
        options: RemoteOptions,
        metrics: RemoteMetrics,
    ) -> Self {
        let (initial_tx, initial) = watch::channel(false);
        let clients = RemoteClients::default();
        let (notes, notes_rx) = mpsc::unbounded_channel();
        let secrets: Api<Secret> = Api::namespaced(config, &options.system_namespace);
        let controller = Controller {
            aggregate,
            options,
            metrics,
            clients: clients.clone(),
            secrets: HashMap::new(),
            clusters: HashMap::new(),
            notes: notes.clone(),
            initial: initial_tx,
        };
        let mut task = OwnedTasks::default();
        task.push(tokio::spawn(controller.run(secrets, notes_rx)));
        Self {
            task,
            initial,
            clients,
            notes,
        }
    }

    /// Saves every synced remote that changed since its last save, now (at shutdown), and
    /// resolves once the files are written.
    pub async fn flush_snapshots(&self) {
        let (done, flushed) = oneshot::channel();
        if self.notes.send(Note::Flush(done)).is_ok() {
            let _ = flushed.await;
        }
    }

    /// Lets the supervisor watch the controller.
    pub fn supervise(&mut self, supervisor: &mut Supervisor) {
        self.task.supervise(supervisor, "remote secret controller");
    }

    /// Becomes true once the Secrets present at start are processed (readiness needs it, as istiod's).
    pub fn initial_sync_signal(&self) -> watch::Receiver<bool> {
        self.initial.clone()
    }

    pub fn clients(&self) -> RemoteClients {
        self.clients.clone()
    }
}

/// What a rotation or sync-timing task reports back to the controller.
enum Note {
    /// A remote's first sync completed: its snapshot is saved at once.
    Synced { id: ClusterId },
    Rotated {
        id: ClusterId,
        hash: u64,
        staged: Arc<ClusterRegistry>,
        watch: KubeWatch,
        client: Client,
        server: String,
        ca: String,
    },
    /// A rotation is not through yet (its kubeconfig does not connect, or has not synced within
    /// the timeout): it goes on, and the previous kubeconfig keeps serving.
    RotationPending {
        id: ClusterId,
        hash: u64,
        error: String,
    },
    /// Save every changed remote now; answer once written.
    Flush(oneshot::Sender<()>),
}

struct RemoteCluster {
    secret: String,
    hash: u64,
    registry: Arc<ClusterRegistry>,
    /// Its discovery selectors: its Secret's own, else the mesh config's.
    selectors: ClusterSelectors,
    /// None when the kubeconfig was refused: nothing to keep serving.
    watch: Option<KubeWatch>,
    /// The API server the kubeconfig reaches and a fingerprint of the CA it trusts there: the
    /// cluster a snapshot is saved for.
    server: String,
    ca: String,
    sync_timer: Option<JoinHandle<()>>,
    rotation: Option<(u64, JoinHandle<()>)>,
    /// Ends serving a restored snapshot once it is too old.
    stale_timer: Option<JoinHandle<()>>,
    /// The registry generation last saved and when, and the write in flight.
    saved: Option<(u64, Instant)>,
    saving: Option<JoinHandle<()>>,
}

impl Drop for RemoteCluster {
    fn drop(&mut self) {
        let timers = [&self.sync_timer, &self.stale_timer];
        for t in timers.into_iter().flatten() {
            t.abort();
        }
        if let Some((_, t)) = &self.rotation {
            t.abort();
        }
    }
}

struct Controller {
    aggregate: Arc<Aggregate>,
    options: RemoteOptions,
    metrics: RemoteMetrics,
    clients: RemoteClients,
    /// Secret (namespace/name) → the cluster ids it holds.
    secrets: HashMap<String, Vec<ClusterId>>,
    clusters: HashMap<ClusterId, RemoteCluster>,
    notes: mpsc::UnboundedSender<Note>,
    initial: watch::Sender<bool>,
}

impl Controller {
    async fn run(mut self, secrets: Api<Secret>, mut notes: mpsc::UnboundedReceiver<Note>) {
        let config = watcher::Config::default().labels(MULTICLUSTER_LABEL);
        let mut events = retried(watcher::watcher(secrets, config)).boxed();
        let mut listing: Option<Vec<Secret>> = None;
        let mut save = tokio::time::interval(SAVE_CHECK);
        save.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                event = events.next() => match event {
                    Some(Ok(Event::Init)) => listing = Some(Vec::new()),
                    Some(Ok(Event::InitApply(secret))) => listing.get_or_insert_with(Vec::new).push(secret),
                    Some(Ok(Event::InitDone)) => {
                        let listed = listing.take().unwrap_or_default();
                        let names: Vec<String> = listed.iter().map(secret_name).collect();
                        let gone: Vec<String> = self.secrets.keys().filter(|k| !names.contains(k)).cloned().collect();
                        for name in gone {
                            self.secret_deleted(&name);
                        }
                        for secret in &listed {
                            self.secret_changed(secret).await;
                        }
                        self.initial.send_replace(true);
                    }
                    Some(Ok(Event::Apply(secret))) => self.secret_changed(&secret).await,
                    Some(Ok(Event::Delete(secret))) => self.secret_deleted(&secret_name(&secret)),
                    Some(Err(e)) => warn!(error = %e, "remote secret watch error"),
                    None => return,
                },
                Some(note) = notes.recv() => self.on_note(note),
                _ = save.tick(), if self.options.snapshots.is_some() => self.save_snapshots(),
            }
        }
    }

    async fn secret_changed(&mut self, secret: &Secret) {
        let name = secret_name(secret);
        // Unreadable selectors are reported: a cluster already watched keeps the ones it had, a
        // new one is refused until they read (following the mesh's instead could widen it).
        let own = selectors::annotated(secret);
        if let Err(e) = &own {
            warn!(secret = name, error = %e, "remote secret's discovery selectors refused");
        }
        let data: BTreeMap<String, Vec<u8>> = secret
            .data
            .iter()
            .flatten()
            .map(|(k, v)| (k.clone(), v.0.clone()))
            .collect();
        let previous = self.secrets.remove(&name).unwrap_or_default();
        for id in previous.iter().filter(|id| !data.contains_key(id.as_str())) {
            self.remove(id, Leaving::Mesh);
        }
        let mut owned = Vec::new();
        for (key, kubeconfig) in data {
            let id = ClusterId::new(&key);
            if id == self.options.config_cluster {
                warn!(cluster = %id, secret = name, "ignoring remote secret key: it would overwrite the config cluster");
                continue;
            }
            if let Some(existing) = self.clusters.get(&id).filter(|c| c.secret != name) {
                warn!(cluster = %id, secret = name, registered_by = existing.secret, "ignoring remote secret key: cluster already registered by another secret");
                continue;
            }
            owned.push(id.clone());
            let hash = fingerprint(&kubeconfig);
            if let Some(cluster) = self.clusters.get(&id) {
                match &own {
                    Ok(own) => cluster.selectors.set_own(own.clone()),
                    Err(e) => cluster.registry.set_error(Some(e.clone())),
                }
            }
            match self.clusters.get(&id) {
                None => self.add(&id, &name, &kubeconfig, hash, own.clone()).await,
                Some(c) if c.hash == hash => self.keep_served(&id),
                Some(c) if c.rotation.as_ref().is_some_and(|(h, _)| *h == hash) => {}
                Some(c) if c.watch.is_none() => {
                    // Never connected: nothing to keep serving, start over.
                    self.remove(&id, Leaving::ForNewKubeconfig);
                    self.add(&id, &name, &kubeconfig, hash, own.clone()).await;
                }
                Some(_) => self.rotate(&id, &kubeconfig, hash),
            }
        }
        self.secrets.insert(name, owned);
    }

    fn secret_deleted(&mut self, name: &str) {
        for id in self.secrets.remove(name).unwrap_or_default() {
            self.remove(&id, Leaving::Mesh);
        }
    }

    async fn add(
        &mut self,
        id: &ClusterId,
        secret: &str,
        kubeconfig: &[u8],
        hash: u64,
        own_selectors: Result<Option<Vec<LabelSelector>>, String>,
    ) {
        let shard = ShardKey {
            provider: Provider::Kubernetes,
            cluster: id.clone(),
        };
        let registry =
            match self
                .aggregate
                .add_cluster(shard, format!("{SECRET_SOURCE}{secret}"), false)
            {
                Ok(r) => r,
                Err(e) => {
                    warn!(cluster = %id, secret, error = %e, "remote cluster not added");
                    return;
                }
            };
        let selectors = ClusterSelectors::start(
            self.aggregate.discovery_selectors(),
            own_selectors.clone().unwrap_or_default(),
            registry.clone(),
        );
        let mut cluster = RemoteCluster {
            secret: secret.to_string(),
            hash,
            registry: registry.clone(),
            selectors,
            watch: None,
            server: String::new(),
            ca: String::new(),
            sync_timer: None,
            rotation: None,
            stale_timer: None,
            saved: None,
            saving: None,
        };
        let connected = match own_selectors.and_then(|_| {
            kubeconfig::parse_untrusted(kubeconfig, &self.options.insecure)
                .map_err(|e| e.to_string())
        }) {
            Ok(config) => connect(config).await.map_err(|e| e.to_string()),
            Err(e) => Err(e),
        };
        match connected {
            Ok((client, server, ca)) => {
                // Before the watches start, so their first lists reconcile against it.
                cluster.stale_timer = self.serve_snapshot(id, &registry, (&server, &ca));
                cluster.server = server;
                cluster.ca = ca;
                let watch = watch_cluster(
                    client.clone(),
                    registry.clone(),
                    cluster.selectors.effective.clone(),
                );
                cluster.sync_timer = Some(self.time_sync(registry, &watch));
                cluster.watch = Some(watch);
                self.clients.set(id, Some(client));
                info!(cluster = %id, secret, "remote cluster onboarding");
            }
            Err(e) => {
                error!(cluster = %id, secret, error = %e, "remote cluster refused");
                registry.set_state(SyncState::Failed);
                registry.set_error(Some(e));
            }
        }
        self.clusters.insert(id.clone(), cluster);
    }

    /// Marks the cluster timed out if it has not synced within the timeout (readiness stops
    /// waiting for it; it keeps trying), and records how long syncing took.
    fn time_sync(&self, registry: Arc<ClusterRegistry>, watch: &KubeWatch) -> JoinHandle<()> {
        let mut synced = watch.synced_signal();
        let (timeout, metrics) = (self.options.sync_timeout, self.metrics.clone());
        let (notes, id) = (self.notes.clone(), registry.id().clone());
        tokio::spawn(async move {
            let started = Instant::now();
            let wait = synced.wait_for(|s| *s);
            let outcome = if timeout.is_zero() {
                Ok(wait.await.is_ok())
            } else {
                tokio::time::timeout(timeout, wait).await.map(|r| r.is_ok())
            };
            match outcome {
                Ok(true) => {
                    metrics
                        .sync_duration
                        .observe(started.elapsed().as_secs_f64());
                    // The controller is gone only at shutdown.
                    let _ = notes.send(Note::Synced { id });
                }
                Ok(false) => {}
                Err(_) => {
                    if registry.status().state == SyncState::Syncing {
                        registry.set_state(SyncState::TimedOut);
                        let error = format!(
                            "not synced within {}; still trying",
                            humantime::format_duration(timeout)
                        );
                        warn!(cluster = %registry.id(), error, "remote cluster sync timed out");
                        if registry.status().last_error.is_none() {
                            registry.set_error(Some(error));
                        }
                        metrics.sync_timeouts.inc();
                    }
                }
            }
        })
    }

    /// The Secret holds the kubeconfig being served again: a rotation to another one, pending or
    /// refused, is dropped with its retries.
    fn keep_served(&mut self, id: &ClusterId) {
        let Some(cluster) = self.clusters.get_mut(id) else {
            return;
        };
        let rotating = cluster
            .rotation
            .take()
            .map(|(_, task)| task.abort())
            .is_some();
        let pending = cluster.registry.status().pending_rotation.is_some();
        if rotating || pending {
            cluster.registry.set_pending_rotation(None);
            info!(cluster = %id, "remote cluster kubeconfig back to the one served; the rotation to another is dropped");
        }
    }

    fn rotate(&mut self, id: &ClusterId, kubeconfig: &[u8], hash: u64) {
        let Some(cluster) = self.clusters.get_mut(id) else {
            return;
        };
        if let Some((_, task)) = cluster.rotation.take() {
            task.abort();
        }
        let config = match kubeconfig::parse_untrusted(kubeconfig, &self.options.insecure) {
            Ok(c) => c,
            Err(e) => {
                let msg =
                    format!("updated kubeconfig refused, still serving the previous one: {e}");
                error!(cluster = %id, error = msg, "remote cluster rotation refused");
                cluster.registry.set_pending_rotation(Some(msg));
                return;
            }
        };
        info!(cluster = %id, "remote cluster kubeconfig changed; syncing the new one beside the old");
        let staged = self.aggregate.stage_cluster(
            cluster.registry.shard().clone(),
            cluster.registry.source().to_string(),
        );
        let (notes, timeout, id) = (self.notes.clone(), self.options.sync_timeout, id.clone());
        let selectors = cluster.selectors.effective.clone();
        let task = tokio::spawn(async move {
            // Until it syncs or the Secret changes again (which aborts this task): a new
            // kubeconfig is usually there because the old credentials are being revoked.
            let pending = |error: String| {
                let _ = notes.send(Note::RotationPending {
                    id: id.clone(),
                    hash,
                    error,
                });
            };
            let mut delays = connect_delays();
            let (client, server, ca) = loop {
                match connect(config.clone()).await {
                    Ok(connected) => break connected,
                    Err(e) => {
                        let delay = delays.next().unwrap_or(CONNECT_RETRY_MAX);
                        pending(format!(
                            "{e}; retrying in {}",
                            humantime::format_duration(delay)
                        ));
                        tokio::time::sleep(delay).await;
                    }
                }
            };
            let watch = watch_cluster(client.clone(), staged.clone(), selectors);
            let in_time =
                timeout.is_zero() || tokio::time::timeout(timeout, watch.synced()).await.is_ok();
            if !in_time {
                pending(format!(
                    "the new kubeconfig did not sync within {}; still trying",
                    humantime::format_duration(timeout)
                ));
                watch.synced().await;
            }
            // The controller is gone only at shutdown.
            let _ = notes.send(Note::Rotated {
                id,
                hash,
                staged,
                watch,
                client,
                server,
                ca,
            });
        });
        cluster.rotation = Some((hash, task));
    }

    fn on_note(&mut self, note: Note) {
        match note {
            Note::Synced { id } => self.save_snapshot(&id, true),
            Note::Flush(done) => {
                let ids: Vec<ClusterId> = self.clusters.keys().cloned().collect();
                for id in &ids {
                    self.save_snapshot(id, true);
                }
                let writes: Vec<JoinHandle<()>> = (self.clusters.values_mut())
                    .filter_map(|c| c.saving.take())
                    .collect();
                tokio::spawn(async move {
                    for write in writes {
                        let _ = write.await;
                    }
                    let _ = done.send(());
                });
            }
            Note::Rotated {
                id,
                hash,
                staged,
                watch,
                client,
                server,
                ca,
            } => {
                let Some(cluster) = self.clusters.get_mut(&id) else {
                    return;
                };
                if cluster.rotation.as_ref().map(|(h, _)| *h) != Some(hash) {
                    return;
                }
                self.aggregate.promote(staged.clone());
                cluster.registry = staged;
                cluster.watch = Some(watch);
                cluster.server = server;
                cluster.ca = ca;
                cluster.saved = None;
                // The retired registry may have been serving a snapshot; the new one is synced.
                if let Some(timer) = cluster.stale_timer.take() {
                    timer.abort();
                }
                cluster.hash = hash;
                cluster.rotation = None;
                self.clients.set(&id, Some(client));
                self.metrics.rotations.inc();
                info!(cluster = %id, "remote cluster now served through its new kubeconfig");
            }
            Note::RotationPending { id, hash, error } => {
                let Some(cluster) = self.clusters.get(&id) else {
                    return;
                };
                if cluster.rotation.as_ref().map(|(h, _)| *h) != Some(hash) {
                    return;
                }
                let msg =
                    format!("kubeconfig rotation pending, still serving the previous one: {error}");
                error!(cluster = %id, error = msg, "remote cluster rotation not through");
                cluster.registry.set_pending_rotation(Some(msg));
            }
        }
    }

    fn remove(&mut self, id: &ClusterId, leaving: Leaving) {
        // Dropping the cluster stops its watches before the aggregate clears its shards.
        if self.clusters.remove(id).is_some() {
            self.aggregate.remove_cluster(id);
            self.clients.set(id, None);
        }
        if let (Leaving::Mesh, Some(snapshots)) = (leaving, &self.options.snapshots) {
            if let Err(e) = snapshots.store.remove(id) {
                warn!(cluster = %id, error = %e, "snapshot of a removed remote cluster not deleted");
            }
        }
    }
}

/// Why a remote cluster is removed: only one that leaves the mesh loses its snapshot.
#[derive(Clone, Copy)]
enum Leaving {
    Mesh,
    ForNewKubeconfig,
}

/// The longest wait between attempts to connect with a rotated kubeconfig.
const CONNECT_RETRY_MAX: Duration = Duration::from_secs(60);

/// Waits between attempts to connect with a rotated kubeconfig: 1 s doubling to a minute,
/// jittered.
fn connect_delays() -> impl Iterator<Item = Duration> {
    use backon::BackoffBuilder;
    backon::ExponentialBuilder::new()
        .with_min_delay(Duration::from_secs(1))
        .with_max_delay(CONNECT_RETRY_MAX)
        .with_jitter()
        .without_max_times()
        .build()
}

/// A client for a vetted kubeconfig, the API server it reaches, and a fingerprint of the CA it
/// trusts there (which tells a new cluster at an old address from the old one).
async fn connect(
    config: Kubeconfig,
) -> Result<(Client, String, String), kubeconfig::KubeconfigError> {
    let config = kubeconfig::client_config(config).await?;
    let server = config.cluster_url.to_string();
    let mut h = std::collections::hash_map::DefaultHasher::new();
    config.root_cert.hash(&mut h);
    let ca = format!("{:016x}", h.finish());
    Ok((kubeconfig::client_for(config)?, server, ca))
}

fn secret_name(secret: &Secret) -> String {
    format!(
        "{}/{}",
        secret.namespace().unwrap_or_default(),
        secret.name_any()
    )
}

fn fingerprint(bytes: &[u8]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut h);
    h.finish()
}
