//! A Kubernetes cluster as a registry: list-watches Services, EndpointSlices, Pods, Nodes and
//! Namespaces with kube-runtime's watcher, trims each object on arrival and feeds it to the
//! cluster's registry. A relist (after a 410 Gone or a restart) is reconciled against what the
//! registry holds, so nothing is ever served empty in between and an unchanged relist pushes nothing.

use std::fmt::Debug;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Secret, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use thiserror::Error;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use super::discovery;
use crate::istio::label_selector::LabelSelector;
use crate::kube_client::retried;
use crate::registry::objects::{self, Kind, Object, ObjectChange, ObjectKey, TrimError};
use crate::registry::{ClusterRegistry, SyncState};
use crate::supervise::{OwnedTasks, Supervisor};

#[derive(Debug, Error)]
pub enum KubeSourceError {
    #[error("cannot read kubeconfig {path}: {reason}")]
    Kubeconfig { path: String, reason: String },
    #[error("in-cluster configuration unavailable: {0}")]
    InCluster(#[from] kube::config::InClusterError),
    #[error("cannot build a Kubernetes client: {0}")]
    Client(#[from] kube::Error),
}

/// A client for the config cluster, from a kubeconfig file or the pod's service account.
pub async fn client(kubeconfig: Option<&std::path::Path>) -> Result<Client, KubeSourceError> {
    let config = match kubeconfig {
        Some(path) => {
            let error = |source: kube::config::KubeconfigError| KubeSourceError::Kubeconfig {
                path: path.display().to_string(),
                reason: crate::kube_client::kubeconfig::reason(&source),
            };
            let kubeconfig = kube::config::Kubeconfig::read_from(path).map_err(error)?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
                .await
                .map_err(error)?
        }
        None => kube::Config::incluster()?,
    };
    Ok(crate::kube_client::build(config)?)
}

/// Objects per list page, as client-go's 500: a page is parsed whole before its objects are
/// trimmed, and every kind of every remote relists at once after an outage, so a page of 5,000
/// pods (tens of MB of JSON) per watch made the relist's peak memory, not the registries'.
const LIST_PAGE: u32 = 500;

/// The running watches of one cluster; dropping it stops them.
pub struct KubeWatch {
    tasks: OwnedTasks,
    synced: watch::Receiver<bool>,
}

impl KubeWatch {
    /// Lets the supervisor watch the watches (a watch that ends freezes its cluster).
    pub fn supervise(&mut self, supervisor: &mut Supervisor, name: &'static str) {
        self.tasks.supervise(supervisor, name);
    }

    /// Becomes true once every kind has been listed for the first time.
    pub fn synced_signal(&self) -> watch::Receiver<bool> {
        self.synced.clone()
    }

    /// Resolves once every kind has been listed for the first time.
    pub async fn synced(&self) {
        let mut synced = self.synced.clone();
        // Only fails if every watch task is gone, which `self` prevents.
        let _ = synced.wait_for(|s| *s).await;
    }
}

/// Counts kinds through their first list; marks the registry synced when all are.
struct SyncGate {
    remaining: AtomicUsize,
    registry: Arc<ClusterRegistry>,
    done: watch::Sender<bool>,
}

impl SyncGate {
    fn kind_listed(&self) {
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.registry.set_state(SyncState::Synced);
            info!(cluster = %self.registry.id(), "cluster synced");
            self.done.send_replace(true);
        }
    }
}

/// Starts watching a cluster into `registry`, its namespaces discovered as `selectors` say.
pub fn watch_cluster(
    client: Client,
    registry: Arc<ClusterRegistry>,
    selectors: watch::Receiver<Vec<LabelSelector>>,
) -> KubeWatch {
    let (done, synced) = watch::channel(false);
    // The six kinds, and the discovered namespaces.
    let gate = Arc::new(SyncGate {
        remaining: AtomicUsize::new(7),
        registry: registry.clone(),
        done,
    });
    registry
        .discovered()
        .restart(!selectors.borrow().is_empty());
    let discovered = {
        let gate = gate.clone();
        let (client, registry) = (client.clone(), registry.clone());
        tokio::spawn(async move {
            discovery::run(client, registry, selectors, || gate.kind_listed()).await
        })
    };
    let all = watcher::Config::default().page_size(LIST_PAGE);
    let handles = vec![
        // Every Namespace: the system one names the cluster's network, any may name a waypoint.
        spawn::<Namespace>(
            Api::all(client.clone()),
            all.clone(),
            Kind::Namespace,
            (&gate, false),
            |o| objects::namespace(o).map(Some),
        ),
        spawn::<Node>(
            Api::all(client.clone()),
            all.clone(),
            Kind::Node,
            (&gate, false),
            |o| objects::node(o).map(Some),
        ),
        discovered,
        spawn::<Pod>(
            Api::all(client.clone()),
            all.clone(),
            Kind::Pod,
            (&gate, true),
            |o| objects::pod(o).map(Some),
        ),
        spawn::<Service>(
            Api::all(client.clone()),
            all.clone(),
            Kind::Service,
            (&gate, true),
            |o| objects::service(o).map(Some),
        ),
        spawn::<EndpointSlice>(
            Api::all(client.clone()),
            all.clone(),
            Kind::EndpointSlice,
            (&gate, true),
            objects::endpoint_slice,
        ),
        spawn::<Secret>(
            Api::all(client),
            all.fields(&secret_fields()),
            Kind::Secret,
            (&gate, true),
            |o| objects::secret(o).map(Some),
        ),
    ];
    let mut tasks = OwnedTasks::default();
    for handle in handles {
        tasks.push(handle);
    }
    KubeWatch { tasks, synced }
}

/// Leaves out the numerous Secret kinds that never hold TLS material, as istiod's secret watch.
fn secret_fields() -> String {
    objects::UNWATCHED_SECRET_TYPES
        .iter()
        .map(|t| format!("type!={t}"))
        .collect::<Vec<_>>()
        .join(",")
}

type Trim<K> = fn(&K) -> Result<Option<Object>, TrimError>;

/// A watch of one kind into the registry; when `per_namespace`, objects of namespaces that are not
/// discovered are dropped on arrival.
fn spawn<K>(
    api: Api<K>,
    config: watcher::Config,
    kind: Kind,
    (gate, per_namespace): (&Arc<SyncGate>, bool),
    trim: Trim<K>,
) -> JoinHandle<()>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    let gate = gate.clone();
    let discovered = gate.registry.discovered().clone();
    let mut events = match per_namespace {
        true => discovery::scoped_watch(api, config, &discovered),
        false => retried(watcher::watcher(api, config)).boxed(),
    };
    let admitted = move |object: &K| {
        !per_namespace || discovered.admits(object.namespace().as_deref().unwrap_or_default())
    };
    tokio::spawn(async move {
        let registry = gate.registry.clone();
        let mut relist: Option<Vec<ObjectChange>> = None;
        let mut listed_once = false;
        let mut failing = false;
        while let Some(event) = events.next().await {
            let event = match event {
                Ok(event) => event,
                Err(e) => {
                    // The watcher re-establishes itself with backoff; a single error ends nothing.
                    warn!(cluster = %registry.id(), kind = %kind, error = %e, "watch error");
                    registry.set_error(Some(format!("{kind} watch: {e}")));
                    failing = true;
                    continue;
                }
            };
            if std::mem::take(&mut failing) {
                registry.set_error(None);
            }
            match event {
                Event::Init => relist = Some(Default::default()),
                Event::InitApply(object) => {
                    if let Some(changes) = relist.as_mut().filter(|_| admitted(&object)) {
                        changes.push(convert(&registry, kind, &object, trim));
                    }
                }
                Event::InitDone => {
                    // The registry removes what it holds and the list lacks.
                    let changes = relist.take().unwrap_or_default();
                    apply_off_worker(&registry, Some(kind), changes).await;
                    if !listed_once {
                        listed_once = true;
                        gate.kind_listed();
                    }
                }
                Event::Apply(object) if admitted(&object) => {
                    let change = convert(&registry, kind, &object, trim);
                    apply_off_worker(&registry, None, vec![change]).await;
                }
                Event::Apply(_) => {}
                Event::Delete(object) => {
                    let key = key_of(kind, &object);
                    apply_off_worker(&registry, None, vec![ObjectChange::Delete(key)]).await;
                }
            }
        }
    })
}

/// Applies a batch (`listed`: a whole list of that kind) on the blocking pool: a relist of thousands
/// of objects takes milliseconds that the async workers serving proxies should not spend. Awaited,
/// so a kind's events stay in order.
async fn apply_off_worker(
    registry: &Arc<ClusterRegistry>,
    listed: Option<Kind>,
    changes: Vec<ObjectChange>,
) {
    let registry = registry.clone();
    let apply = move || match listed {
        Some(kind) => registry.apply_list(kind, changes),
        None => registry.apply(changes),
    };
    if let Err(e) = tokio::task::spawn_blocking(apply).await {
        // Only a panic inside apply gets here; surface it rather than lose it silently.
        warn!(error = %e, "registry apply failed");
    }
}

fn key_of<K: Resource>(kind: Kind, object: &K) -> ObjectKey {
    ObjectKey {
        kind,
        namespace: object.namespace().unwrap_or_default(),
        name: object.name_any(),
    }
}

/// The registry change for one object: an upsert, or a delete for objects Istio ignores (so one
/// that becomes ignored stops being served).
fn convert<K: Resource>(
    registry: &ClusterRegistry,
    kind: Kind,
    object: &K,
    trim: Trim<K>,
) -> ObjectChange {
    match trim(object) {
        Ok(Some(trimmed)) => ObjectChange::Upsert(trimmed),
        Ok(None) => ObjectChange::Delete(key_of(kind, object)),
        Err(e) => {
            warn!(cluster = %registry.id(), error = %e, "object skipped");
            ObjectChange::Delete(key_of(kind, object))
        }
    }
}
