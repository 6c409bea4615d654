//! Istio config from the config cluster's API server: a kube-runtime watcher per kind (the first of
//! its versions the cluster serves), relists reconciled without a gap, every object validated as the
//! file source does; and the mesh config and MeshNetworks from the `istio` ConfigMap of the
//! system namespace.
//! Objects of namespaces the cluster's discoverySelectors leave out are not read (istiod's
//! `ENABLE_ENHANCED_RESOURCE_SCOPING`, on by default): each kind starts once the discovered
//! namespaces are known and relists when they change.
//! Remote clusters' Istio config is not read (as istiod: config comes from the config cluster).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, ListParams};
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client, ResourceExt};
use parking_lot::Mutex;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{error, info, warn};

use super::discovery::scoped_watch;
use super::networks::NetworksSink;
use crate::aggregate::Aggregate;
use crate::istio::mesh::{MESH_CONFIGMAP, MESH_KEY, MESH_NETWORKS_KEY};
use crate::istio::{
    ConfigError, ConfigKey, ConfigKind, ConfigObject, MeshConfig, Origin, Revision,
};
use crate::kube_client::retried;
use crate::model::{ClusterId, ConfigChange, ConfigSource, MeshNetworks, Refusal};
use crate::registry::DiscoveredNamespaces;
use crate::supervise::{OwnedTasks, Supervisor};

/// How often a kind whose CRD is not installed is looked for again.
const CRD_RETRY: Duration = Duration::from_secs(10);

/// The running watches; dropping it stops them.
pub struct KubeConfigWatch {
    tasks: OwnedTasks,
    synced: watch::Receiver<usize>,
    kinds: usize,
    /// Why the `istio` ConfigMap's mesh config is refused now, if it is.
    pub mesh_error: Arc<Mutex<Option<String>>>,
}

impl KubeConfigWatch {
    /// Lets the supervisor watch the watches.
    pub fn supervise(&mut self, supervisor: &mut Supervisor, name: &'static str) {
        self.tasks.supervise(supervisor, name);
    }

    /// Tells whether every kind has been listed once (or found not installed).
    pub fn synced_check(&self) -> impl Fn() -> bool + Send + Sync + 'static {
        let (synced, kinds) = (self.synced.clone(), self.kinds);
        move || *synced.borrow() >= kinds
    }
}

/// What the config cluster's Istio config is read as.
pub struct ConfigScope {
    pub cluster: ClusterId,
    pub discovered: Arc<DiscoveredNamespaces>,
    /// Objects labelled for another revision are not this control plane's.
    pub revision: Revision,
    pub system_namespace: String,
}

/// Starts watching every Istio kind, and the revision's mesh ConfigMap (`istio`,
/// `istio-<revision>`) for the keys no file gives.
pub fn watch(
    client: Client,
    scope: ConfigScope,
    aggregate: Arc<Aggregate>,
    mesh_keys: MeshConfigMapKeys,
    istio_config: bool,
) -> KubeConfigWatch {
    let ConfigScope {
        cluster,
        discovered,
        revision,
        system_namespace,
    } = scope;
    let (listed, synced) = watch::channel(0usize);
    let listed = Arc::new(listed);
    // Where the mesh config names config sources without k8s://, the cluster's are not read.
    let kinds: &[ConfigKind] = match istio_config {
        true => &ConfigKind::ALL,
        false => &[],
    };
    let mut tasks: Vec<JoinHandle<()>> = kinds
        .iter()
        .map(|kind| {
            tokio::spawn(watch_kind(
                client.clone(),
                *kind,
                (cluster.clone(), discovered.clone(), revision.clone()),
                aggregate.clone(),
                listed.clone(),
            ))
        })
        .collect();
    let mesh_error: Arc<Mutex<Option<String>>> = Arc::default();
    if mesh_keys.any() {
        let map = MeshConfigMap {
            namespace: system_namespace,
            name: revision.suffixed(MESH_CONFIGMAP),
            aggregate,
            keys: mesh_keys,
            mesh_error: mesh_error.clone(),
        };
        tasks.push(tokio::spawn(map.watch(client)));
    }
    let mut owned = OwnedTasks::default();
    for task in tasks {
        owned.push(task);
    }
    KubeConfigWatch {
        tasks: owned,
        synced,
        kinds: kinds.len(),
        mesh_error,
    }
}

/// The first version of `kind` the cluster serves; None while its CRD is not installed.
pub(super) async fn served_version(client: &Client, kind: ConfigKind) -> Option<ApiResource> {
    for version in kind.versions() {
        let gvk = GroupVersionKind::gvk(kind.group(), version, kind.name());
        let resource = ApiResource::from_gvk_with_plural(&gvk, kind.plural());
        let api: Api<DynamicObject> = Api::all_with(client.clone(), &resource);
        match api.list(&ListParams::default().limit(1)).await {
            Ok(_) => return Some(resource),
            Err(kube::Error::Api(e)) if e.code == 404 => continue,
            Err(e) => {
                warn!(kind = %kind, error = %crate::kube_error::Readable(&e), "cannot list Istio config");
                return None;
            }
        }
    }
    None
}

async fn watch_kind(
    client: Client,
    kind: ConfigKind,
    (cluster, discovered, revision): (ClusterId, Arc<DiscoveredNamespaces>, Revision),
    aggregate: Arc<Aggregate>,
    listed: Arc<watch::Sender<usize>>,
) {
    let mut counted = false;
    let resource = loop {
        match served_version(&client, kind).await {
            Some(resource) => break resource,
            None => {
                if !std::mem::replace(&mut counted, true) {
                    info!(kind = %kind, "Istio kind not served by the config cluster (CRD not installed?); looking again every 10s");
                    listed.send_modify(|n| *n += 1);
                }
                tokio::time::sleep(CRD_RETRY).await;
            }
        }
    };
    let api: Api<DynamicObject> = Api::all_with(client, &resource);
    let mut events = scoped_watch(api, watcher::Config::default(), &discovered);
    let mut held = Held {
        kind,
        cluster,
        keys: BTreeSet::new(),
        relist: None,
        discovered,
        revision,
        aggregate,
    };
    while let Some(event) = events.next().await {
        match event {
            Ok(event) => {
                if held.on(event) && !std::mem::replace(&mut counted, true) {
                    listed.send_modify(|n| *n += 1);
                }
            }
            Err(e) => warn!(kind = %kind, error = %e, "Istio config watch error"),
        }
    }
}

/// One kind's objects as the config cluster serves them.
struct Held {
    kind: ConfigKind,
    cluster: ClusterId,
    keys: BTreeSet<ConfigKey>,
    relist: Option<BTreeMap<ConfigKey, Converted>>,
    discovered: Arc<DiscoveredNamespaces>,
    revision: Revision,
    aggregate: Arc<Aggregate>,
}

impl Held {
    /// Applies one watch event; true when it completed a list.
    fn on(&mut self, event: Event<DynamicObject>) -> bool {
        match event {
            Event::Init => self.relist = Some(BTreeMap::new()),
            Event::InitApply(object) => {
                let converted = self.convert(&object);
                if let (Some(batch), Some((key, converted))) = (self.relist.as_mut(), converted) {
                    batch.insert(key, converted);
                }
            }
            Event::InitDone => {
                let batch = self.relist.take().unwrap_or_default();
                let gone: Vec<ConfigKey> = self
                    .keys
                    .iter()
                    .filter(|k| !batch.contains_key(*k))
                    .cloned()
                    .collect();
                let mut changes: Vec<ConfigChange> =
                    gone.iter().cloned().map(ConfigChange::Delete).collect();
                let mut refusals: Vec<(String, Vec<Refusal>)> =
                    gone.iter().map(|k| (k.to_string(), Vec::new())).collect();
                self.keys = batch.keys().cloned().collect();
                for (key, converted) in batch {
                    apply_converted(key, converted, &mut changes, &mut refusals);
                }
                self.aggregate
                    .apply_config(ConfigSource::ConfigCluster, changes, refusals);
                return true;
            }
            Event::Apply(object) => match self.convert(&object) {
                Some((key, converted)) => {
                    self.keys.insert(key.clone());
                    let (mut changes, mut refusals) = (Vec::new(), Vec::new());
                    apply_converted(key, converted, &mut changes, &mut refusals);
                    self.aggregate
                        .apply_config(ConfigSource::ConfigCluster, changes, refusals);
                }
                // Relabelled for another revision: no longer ours.
                None => {
                    self.on(Event::Delete(object));
                }
            },
            Event::Delete(object) => {
                if let Some(key) = key_of(self.kind, &object).filter(|k| self.keys.remove(k)) {
                    let refusals = vec![(key.to_string(), Vec::new())];
                    self.aggregate.apply_config(
                        ConfigSource::ConfigCluster,
                        vec![ConfigChange::Delete(key)],
                        refusals,
                    );
                }
            }
        }
        false
    }

    /// The object validated, unless its namespace is not discovered or it belongs to another
    /// revision (istiod's `LabelsInRevision`).
    fn convert(&self, object: &DynamicObject) -> Option<(ConfigKey, Converted)> {
        let namespace = object.namespace().unwrap_or_default();
        if !self.discovered.admits(&namespace) || !self.revision.reads(Some(object.labels())) {
            return None;
        }
        convert(&self.cluster, object)
    }
}

/// An object, validated, or why it was refused.
type Converted = Result<Arc<ConfigObject>, Refusal>;

fn convert(cluster: &ClusterId, object: &DynamicObject) -> Option<(ConfigKey, Converted)> {
    let origin = Origin::Kubernetes {
        cluster: cluster.to_string(),
        resource_version: object.resource_version().unwrap_or_default(),
    };
    let value = serde_json::to_value(object).ok()?;
    match ConfigObject::from_value(&value, origin.clone())? {
        Ok(config) => Some((config.key.clone(), Ok(Arc::new(config)))),
        Err(e) => {
            let key = match &e {
                ConfigError::Invalid { key, .. } => key.clone(),
                ConfigError::Unnamed(_) => return None,
            };
            error!(error = %e, %origin, "config object refused; keeping its last good version");
            let refusal = Refusal {
                kind: Some(key.kind),
                subject: None,
                key: Some(key.clone()),
                origin,
                error: e.to_string(),
            };
            Some((key, Err(refusal)))
        }
    }
}

/// A good object replaces the served one and clears its refusal; a refused one leaves the last good
/// version served and shows why.
fn apply_converted(
    key: ConfigKey,
    converted: Converted,
    changes: &mut Vec<ConfigChange>,
    refusals: &mut Vec<(String, Vec<Refusal>)>,
) {
    match converted {
        Ok(object) => {
            refusals.push((key.to_string(), Vec::new()));
            changes.push(ConfigChange::Upsert(object));
        }
        Err(refusal) => refusals.push((key.to_string(), vec![refusal])),
    }
}

fn key_of(kind: ConfigKind, object: &DynamicObject) -> Option<ConfigKey> {
    Some(ConfigKey {
        kind,
        namespace: object.namespace()?.into(),
        name: object.name_any().into(),
    })
}

/// What the revision's mesh ConfigMap (`istio`, `istio-<revision>`) is read for, as istiod reads
/// it when no file is mounted (pilot/pkg/bootstrap/mesh.go `getConfigurationSources`): its
/// `mesh` key unless `--mesh-config` is given, its `meshNetworks` key unless `--mesh-networks`
/// is — each independently of the other.
pub struct MeshConfigMapKeys {
    pub mesh: bool,
    pub networks: Option<NetworksSink>,
}

impl MeshConfigMapKeys {
    fn any(&self) -> bool {
        self.mesh || self.networks.is_some()
    }
}

/// Reads the revision's mesh ConfigMap on every change, its deletion included.
struct MeshConfigMap {
    namespace: String,
    name: String,
    aggregate: Arc<Aggregate>,
    keys: MeshConfigMapKeys,
    mesh_error: Arc<Mutex<Option<String>>>,
}

impl MeshConfigMap {
    async fn watch(self, client: Client) {
        let api: Api<ConfigMap> = Api::namespaced(client, &self.namespace);
        let config = watcher::Config::default().fields(&format!("metadata.name={}", self.name));
        let mut events = retried(watcher::watcher(api, config)).boxed();
        // A relist's answer: the ConfigMap, or None when it is gone.
        let mut listed: Option<ConfigMap> = None;
        while let Some(event) = events.next().await {
            match event {
                Ok(Event::Init) => listed = None,
                Ok(Event::InitApply(map)) => listed = Some(map),
                Ok(Event::InitDone) => self.read(listed.take().as_ref()),
                Ok(Event::Apply(map)) => self.read(Some(&map)),
                Ok(Event::Delete(_)) => self.read(None),
                Err(e) => warn!(error = %e, configmap = %self.name, "mesh ConfigMap watch error"),
            }
        }
    }

    /// Applies each key read; a refused one keeps what is in force and is reported.
    fn read(&self, map: Option<&ConfigMap>) {
        let (namespace, name) = (&self.namespace, &self.name);
        let value = |key: &str| map.and_then(|m| m.data.as_ref()).and_then(|d| d.get(key));
        if self.keys.mesh {
            let defaults = self.aggregate.mesh().naming.mesh_defaults();
            let text = value(MESH_KEY).map(String::as_str).unwrap_or_default();
            match MeshConfig::parse(text, &defaults) {
                Ok(mesh) => {
                    *self.mesh_error.lock() = None;
                    if self.aggregate.set_mesh_config(mesh) {
                        info!(namespace, configmap = name, "mesh config changed");
                    }
                }
                Err(e) => {
                    let message = format!("ConfigMap {namespace}/{name}, key {MESH_KEY}: {e}");
                    error!(error = %message, "mesh config refused; keeping the last good one");
                    *self.mesh_error.lock() = Some(message);
                }
            }
        }
        if let Some(sink) = &self.keys.networks {
            let origin = format!("ConfigMap {namespace}/{name}, key {MESH_NETWORKS_KEY}");
            // No ConfigMap or no key means no networks, as istiod's `NewNetworksCollection`.
            let text = value(MESH_NETWORKS_KEY)
                .map(String::as_str)
                .unwrap_or_default();
            match MeshNetworks::parse(text) {
                Ok(networks) => sink.accept(networks, &origin),
                Err(e) => sink.refuse(format!("{origin}: {e}")),
            }
        }
    }
}
