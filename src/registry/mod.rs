//! One cluster's registry: its trimmed Kubernetes objects, and what they mean for the mesh.
//!
//! Sources (file directories, Kubernetes watches) feed [`ObjectChange`]s into
//! [`ClusterRegistry::apply`]; the registry works out which services they touch, converts only those,
//! writes the cluster's shard of the model and emits one [`Change`] per batch.

mod convert;
mod intern;
pub mod objects;
mod pods;
mod saved;
pub mod service_entries;

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::hash::Hash;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::SystemTime;

use parking_lot::Mutex;
use serde::Serialize;
use tokio::sync::mpsc::UnboundedSender;
use tracing::{debug, warn};

use self::pods::PodIndex;
use crate::istio::service_entry::Resolution as EntryResolution;
use crate::istio::{ConfigKind, Spec};
use crate::model::{
    canonical, Change, ClusterId, CredentialKey, Endpoint, Hostname, Mesh, MeshNaming,
    MeshNetworks, MeshSnapshot, PushNeed, SecretMaterial, Service, ServiceKey, ShardKey,
};
use convert::EndpointContext;
pub use convert::NsName;
use objects::{
    Kind, NamespaceObj, NodeObj, Object, ObjectChange, ObjectKey, PodObj, ServiceObj, SliceObj,
};
pub use saved::SavedObjects;

/// Where a cluster is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum SyncState {
    Syncing,
    Synced,
    TimedOut,
    Failed,
    /// Serving the last-known-good snapshot saved before a restart; still trying to sync.
    Stale,
}

impl SyncState {
    pub fn name(self) -> &'static str {
        match self {
            Self::Syncing => "syncing",
            Self::Synced => "synced",
            Self::TimedOut => "timed-out",
            Self::Failed => "failed",
            Self::Stale => "stale",
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct ClusterStatus {
    pub state: SyncState,
    pub last_error: Option<String>,
    #[serde(with = "rfc3339")]
    pub last_error_at: Option<SystemTime>,
    /// While stale: when the snapshot being served was saved.
    #[serde(with = "rfc3339")]
    pub snapshot_saved_at: Option<SystemTime>,
}

mod rfc3339 {
    use std::time::SystemTime;

    pub fn serialize<S: serde::Serializer>(
        t: &Option<SystemTime>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        match t {
            Some(t) => s.serialize_str(&humantime::format_rfc3339_seconds(*t).to_string()),
            None => s.serialize_none(),
        }
    }
}

/// How a remote cluster's source reads: this, then the Secret's name.
pub const SECRET_SOURCE: &str = "secret ";

pub struct ClusterRegistry {
    id: ClusterId,
    shard: ShardKey,
    /// Where the cluster came from, for operators (a directory, a kubeconfig, a Secret).
    source: String,
    mesh: Arc<Mesh>,
    changes: UnboundedSender<Change>,
    store: Mutex<Store>,
    status: Mutex<ClusterStatus>,
    /// Counts the batches applied while live: a saver compares it to what it last saved.
    generation: AtomicU64,
}

impl std::fmt::Debug for ClusterRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterRegistry")
            .field("shard", &self.shard)
            .finish_non_exhaustive()
    }
}

impl ClusterRegistry {
    /// A registry that publishes (`live`) or only collects until it goes live (see [`Self::go_live`]).
    pub(crate) fn new(
        shard: ShardKey,
        source: String,
        mesh: Arc<Mesh>,
        changes: UnboundedSender<Change>,
        live: bool,
    ) -> Self {
        let store = Store {
            mode: if live { Mode::Live } else { Mode::Staging },
            ..Default::default()
        };
        Self {
            id: shard.cluster.clone(),
            shard,
            source,
            mesh,
            changes,
            store: Mutex::new(store),
            status: Mutex::new(ClusterStatus {
                state: SyncState::Syncing,
                last_error: None,
                last_error_at: None,
                snapshot_saved_at: None,
            }),
            generation: AtomicU64::new(0),
        }
    }

    pub fn id(&self) -> &ClusterId {
        &self.id
    }

    pub fn shard(&self) -> &ShardKey {
        &self.shard
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// The Secret that onboarded the cluster, for a remote one.
    pub fn remote_secret(&self) -> Option<&str> {
        self.source.strip_prefix(SECRET_SOURCE)
    }

    pub fn status(&self) -> ClusterStatus {
        self.status.lock().clone()
    }

    /// Moves the cluster to `state`; leaving `Stale` means the snapshot is no longer served.
    pub fn set_state(&self, state: SyncState) {
        let mut status = self.status.lock();
        status.state = state;
        if state != SyncState::Stale {
            status.snapshot_saved_at = None;
        }
    }

    /// Records (or, with None, clears) the cluster's current error.
    pub fn set_error(&self, error: Option<String>) {
        let mut status = self.status.lock();
        status.last_error_at = error.as_ref().map(|_| SystemTime::now());
        status.last_error = error;
    }

    pub fn service_count(&self) -> usize {
        self.store.lock().services.len()
    }

    /// Slice endpoints left out because the pod their targetRef names is not known yet
    /// (`pilot_k8s_endpoints_pending_pod`).
    pub fn pending_pod_endpoints(&self) -> usize {
        self.store.lock().pods.pending()
    }

    pub fn endpoint_count(&self) -> usize {
        self.mesh.snapshot().endpoints.count_endpoints(&self.shard)
    }

    /// Applies a batch of object changes and publishes what they mean for the mesh.
    pub fn apply(&self, changes: impl IntoIterator<Item = ObjectChange>) {
        self.apply_locked(self.store.lock(), changes);
    }

    /// Applies the cluster's whole list of one kind, a change per listed object: the objects of
    /// that kind held and not listed (gone meanwhile, or restored from a saved snapshot) go.
    pub fn apply_list(&self, kind: Kind, listed: Vec<ObjectChange>) {
        let mut store = self.store.lock();
        store.stale_kinds.remove(&kind);
        let mut gone = saved::keys_of(&store, kind);
        for change in &listed {
            gone.remove(&change.key());
        }
        let deletes = gone.into_iter().map(ObjectChange::Delete);
        self.apply_locked(store, listed.into_iter().chain(deletes));
    }

    fn apply_locked(
        &self,
        mut store: parking_lot::MutexGuard<'_, Store>,
        changes: impl IntoIterator<Item = ObjectChange>,
    ) {
        if store.mode == Mode::Retired {
            return;
        }
        let mut dirty = Dirty::default();
        for change in changes {
            store.apply(change, &self.mesh.naming.system_namespace, &mut dirty);
        }
        if store.mode == Mode::Staging {
            return;
        }
        self.generation.fetch_add(1, Ordering::Relaxed);
        let gateways = dirty.definitions || dirty.all;
        let secrets = Secrets::Named(std::mem::take(&mut dirty.secrets));
        let (services, selected): (Vec<NsName>, Selected) = if dirty.all {
            (store.service_names(), Selected::All)
        } else {
            let selected = match dirty.pod_namespaces.is_empty() {
                true => Selected::None,
                false => Selected::Namespaces(dirty.pod_namespaces),
            };
            (dirty.services.into_iter().collect(), selected)
        };
        self.publish(store, services, gateways, selected, secrets);
    }

    /// Re-derives the endpoints of pods that ServiceEntries select (the entries changed).
    pub fn resync_selected(&self) {
        let store = self.store.lock();
        if store.mode == Mode::Live {
            self.publish(store, Vec::new(), false, Selected::All, Secrets::none());
        }
    }

    /// Re-derives every endpoint (the mesh networks changed).
    pub fn resync(&self) {
        let store = self.store.lock();
        if store.mode == Mode::Live {
            let services = store.service_names();
            self.publish(store, services, true, Selected::All, Secrets::none());
        }
    }

    /// Writes these services to the mesh as one snapshot and emits what changed. Conversion happens
    /// first, outside the mesh's writer lock; the store stays locked throughout so the registry's
    /// writes keep their order.
    fn publish(
        &self,
        mut store: parking_lot::MutexGuard<'_, Store>,
        services: impl IntoIterator<Item = NsName>,
        definitions_changed: bool,
        selected: Selected,
        secrets: Secrets,
    ) {
        let snapshot = self.mesh.snapshot();
        let networks = snapshot.networks.clone();
        let updates: Vec<ServiceUpdate> = services
            .into_iter()
            .map(|(namespace, name)| self.service_update(&store, &networks, &namespace, &name))
            .collect();
        let selected = self.selected_updates(&mut store, &snapshot, &networks, &selected);
        let change = self.mesh.write(|mesh| {
            let mut change = Change::default();
            for update in updates {
                update.apply(&self.id, &self.shard, mesh, &mut change);
            }
            for (key, endpoints) in selected {
                let need = match endpoints {
                    Some(eps) => mesh.endpoints.update(&key, &self.shard, eps),
                    None => mesh.endpoints.delete_service_shard(&key, &self.shard),
                };
                if need != PushNeed::None {
                    change.full |= need == PushNeed::Full;
                    change.services.insert(key.hostname);
                }
            }
            // A Service labelled as a network's gateway may have come, moved or gone.
            if definitions_changed && mesh.refresh_gateways() {
                change.services.extend(mesh.endpoints.hostnames().cloned());
            }
            self.write_secrets(&store, &secrets, mesh, &mut change);
            change
        });
        drop(store);
        self.emit(change);
    }

    /// Writes the cluster's Secrets in `scope` to the mesh's credentials, noting those that changed.
    fn write_secrets(
        &self,
        store: &Store,
        scope: &Secrets,
        mesh: &mut MeshSnapshot,
        change: &mut Change,
    ) {
        let key = |(namespace, name): &NsName| CredentialKey {
            cluster: self.id.clone(),
            namespace: namespace.as_str().into(),
            name: name.as_str().into(),
        };
        let names: Vec<NsName> = match scope {
            Secrets::Named(names) => names.iter().cloned().collect(),
            Secrets::All => {
                // Those the predecessor served and this store lacks go too.
                let held = mesh.credentials.of_cluster(&self.id).into_iter();
                let gone = held.map(|k| (k.namespace.to_string(), k.name.to_string()));
                let mut all: BTreeSet<NsName> = store.secrets.keys().cloned().collect();
                all.extend(gone);
                all.into_iter().collect()
            }
        };
        for name in names {
            let material = store.secrets.get(&name).cloned();
            let key = key(&name);
            if mesh.credentials.set(key.clone(), material) {
                change.credentials.insert(key);
            }
        }
    }

    /// The endpoints of this cluster's pods that ServiceEntries with a `workloadSelector` select, for
    /// the entries in `scope`: per entry host, the new shard (None: none any more). Hosts this
    /// cluster defines a Service for keep that Service's endpoints.
    fn selected_updates(
        &self,
        store: &mut Store,
        snapshot: &MeshSnapshot,
        networks: &MeshNetworks,
        scope: &Selected,
    ) -> Vec<(ServiceKey, Option<Arc<[Endpoint]>>)> {
        if matches!(scope, Selected::None) {
            return Vec::new();
        }
        let naming = &self.mesh.naming;
        let config = &snapshot.config;
        let ctx = store.endpoint_context(&self.id, naming, networks);
        let mut wanted: BTreeMap<ServiceKey, Vec<Endpoint>> = BTreeMap::new();
        for object in config.of_kind(ConfigKind::ServiceEntry) {
            let Spec::ServiceEntry(entry) = &object.spec else {
                continue;
            };
            let namespace = &object.key.namespace;
            let Some(selector) = &entry.workload_selector else {
                continue;
            };
            if entry.resolution != EntryResolution::Static || !scope.covers(namespace) {
                continue;
            }
            let ports: Vec<(Arc<str>, u16)> = entry
                .ports
                .iter()
                .filter_map(|p| {
                    let port = u16::try_from(p.target_port.unwrap_or(p.number)).ok()?;
                    Some((Arc::from(p.name.as_str()), port))
                })
                .collect();
            let mut endpoints = Vec::new();
            let selects = |pod: &&PodObj| {
                *pod.namespace == **namespace
                    && selector
                        .labels
                        .iter()
                        .all(|(k, v)| pod.labels.get(k) == Some(v))
            };
            for pod in store.pods.iter().filter(selects) {
                ctx.pod_endpoints(pod, &ports, &mut endpoints);
            }
            for host in &entry.hosts {
                let hostname: Hostname = config.qualify(host, namespace).into();
                let own_service = hostname
                    .strip_suffix(&format!(".{namespace}.svc.{}", naming.domain_suffix))
                    .is_some_and(|name| {
                        store
                            .services
                            .contains_key(&(namespace.to_string(), name.to_string()))
                    });
                if own_service {
                    continue;
                }
                let key = ServiceKey {
                    hostname,
                    namespace: namespace.clone(),
                };
                wanted
                    .entry(key)
                    .or_default()
                    .extend(endpoints.iter().cloned());
            }
        }
        let gone: Vec<ServiceKey> = store
            .selected
            .iter()
            .filter(|k| scope.covers(&k.namespace) && !wanted.contains_key(*k))
            .cloned()
            .collect();
        for key in &gone {
            store.selected.remove(key);
        }
        store.selected.extend(wanted.keys().cloned());
        gone.into_iter()
            .map(|k| (k, None))
            .chain(wanted.into_iter().map(|(k, eps)| (k, Some(canonical(eps)))))
            .collect()
    }

    /// What one of this cluster's services now is: its definition and its shard of endpoints.
    fn service_update(
        &self,
        store: &Store,
        networks: &MeshNetworks,
        namespace: &str,
        name: &str,
    ) -> ServiceUpdate {
        let naming = &self.mesh.naming;
        let ns_name = (namespace.to_string(), name.to_string());
        let key = ServiceKey {
            hostname: naming.hostname(name, namespace),
            namespace: Arc::from(namespace),
        };
        let definition = store
            .services
            .get(&ns_name)
            .map(|obj| convert::service(obj, &self.id, naming));
        let endpoints = match store.slices_by_service.get(&ns_name) {
            Some(slices) if !slices.is_empty() => {
                let mut endpoints = Vec::new();
                let ctx = store.endpoint_context(&self.id, naming, networks);
                for slice in slices
                    .iter()
                    .filter_map(|s| store.slices.get(&(namespace.to_string(), s.clone())))
                {
                    ctx.slice_endpoints(slice, &mut endpoints);
                }
                Some(canonical(endpoints))
            }
            _ if definition.is_some() => Some(canonical(Vec::new())),
            _ => None,
        };
        ServiceUpdate {
            key,
            definition,
            endpoints,
        }
    }

    /// Stops this registry from ever writing the mesh again.
    pub(crate) fn retire(&self) {
        self.store.lock().mode = Mode::Retired;
    }

    /// Publishes a staged registry in place of a retired one of the same cluster. It reconciles
    /// against what the mesh holds for the cluster — every definition, shard and credential, whoever
    /// wrote it — never against a predecessor's memory: what it knows is written over, the rest is
    /// removed. Proxies see the difference between the two, never a gap.
    pub(crate) fn go_live(&self) {
        let mut store = self.store.lock();
        store.mode = Mode::Live;
        self.generation.fetch_add(1, Ordering::Relaxed);
        let snapshot = self.mesh.snapshot();
        let naming = &self.mesh.naming;
        let mut services: BTreeSet<NsName> = store.service_names().into_iter().collect();
        let held_shards = snapshot.endpoints.keys_in(&self.shard);
        for key in held_shards {
            let service = naming.split_service_host(&key.hostname);
            match service.filter(|(_, namespace)| **namespace == *key.namespace) {
                Some((name, namespace)) => services.insert((namespace.into(), name.into())),
                // A ServiceEntry's shard of selected pods: re-derived, or removed, with the rest.
                None => store.selected.insert(key),
            };
        }
        for host in snapshot.services.hosts_of(&self.id) {
            if let Some((name, namespace)) = naming.split_service_host(&host) {
                services.insert((namespace.to_string(), name.to_string()));
            }
        }
        self.publish(store, services, true, Selected::All, Secrets::All);
    }

    /// Removes everything this cluster contributed to the mesh (the cluster left).
    pub fn clear(&self) {
        *self.store.lock() = Store {
            mode: Mode::Retired,
            ..Default::default()
        };
        let change = self.mesh.write(|mesh| {
            let mut change = Change::full();
            change
                .services
                .extend(mesh.services.remove_cluster(&self.id));
            let removed = mesh.endpoints.delete_cluster(&self.shard);
            change
                .services
                .extend(removed.into_iter().map(|k| k.hostname));
            change
                .credentials
                .extend(mesh.credentials.remove_cluster(&self.id));
            change
        });
        self.emit(change);
    }

    fn emit(&self, change: Change) {
        if change.is_empty() {
            return;
        }
        debug!(cluster = %self.id, full = change.full, services = change.services.len(), "registry change");
        if self.changes.send(change).is_err() {
            warn!(cluster = %self.id, "change stream closed; change dropped");
        }
    }
}

/// One service of a cluster as the registry now sees it, ready to be written to the mesh.
struct ServiceUpdate {
    key: ServiceKey,
    /// The cluster's definition; None when the cluster has no Service object for it.
    definition: Option<Service>,
    /// The cluster's shard (possibly empty while the Service exists); None removes the shard.
    endpoints: Option<Arc<[Endpoint]>>,
}

impl ServiceUpdate {
    fn apply(
        self,
        cluster: &ClusterId,
        shard: &ShardKey,
        mesh: &mut MeshSnapshot,
        change: &mut Change,
    ) {
        let defined = match self.definition {
            Some(svc) => mesh.services.upsert(cluster, svc),
            None => mesh.services.remove(cluster, &self.key.hostname),
        };
        let need = match self.endpoints {
            Some(eps) => mesh.endpoints.update(&self.key, shard, eps),
            None => mesh.endpoints.delete_service_shard(&self.key, shard),
        };
        if defined || need == PushNeed::Full {
            change.full = true;
        }
        if defined || need != PushNeed::None {
            change.services.insert(self.key.hostname);
        }
    }
}

/// Which Secrets a publish writes.
enum Secrets {
    Named(BTreeSet<NsName>),
    /// Every one of the cluster's, replacing what the mesh holds for it.
    All,
}

impl Secrets {
    fn none() -> Self {
        Secrets::Named(BTreeSet::new())
    }
}

/// Which ServiceEntries with a `workloadSelector` a publish re-derives.
enum Selected {
    None,
    /// Those of these namespaces (pods changed there).
    Namespaces(BTreeSet<String>),
    All,
}

impl Selected {
    fn covers(&self, namespace: &str) -> bool {
        match self {
            Selected::None => false,
            Selected::Namespaces(set) => set.contains(namespace),
            Selected::All => true,
        }
    }
}

/// Services a batch touched.
#[derive(Default)]
struct Dirty {
    /// Namespaces whose pods came, changed or went (ServiceEntries may select them).
    pod_namespaces: BTreeSet<String>,
    services: BTreeSet<NsName>,
    /// The cluster's network changed: every endpoint is re-derived.
    all: bool,
    /// A Service object changed: it may be (or have been) a network's gateway.
    definitions: bool,
    /// Secrets whose TLS material came, changed or went.
    secrets: BTreeSet<NsName>,
}

/// Whether a registry writes the mesh.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Mode {
    /// Building beside the registry it will replace: keeps objects, publishes nothing.
    Staging,
    #[default]
    Live,
    /// Replaced: ignores every change, so it can never touch the shard it handed over.
    Retired,
}

/// A cluster's objects and the reverse indexes that find the services an object change touches.
#[derive(Default)]
struct Store {
    mode: Mode,
    namespaces: HashMap<String, NamespaceObj>,
    services: HashMap<NsName, ServiceObj>,
    slices: HashMap<NsName, SliceObj>,
    slices_by_service: HashMap<NsName, BTreeSet<String>>,
    pods: PodIndex,
    nodes: HashMap<String, NodeObj>,
    /// Slices holding an address without a targetRef (the pods' index holds those naming a pod):
    /// nearly always one, so a small list rather than a set.
    slices_by_ip: HashMap<(String, IpAddr), Vec<Arc<str>>>,
    /// Services whose ServiceEntry selects pods here, with a shard written for them.
    selected: BTreeSet<ServiceKey>,
    /// TLS material of Secrets, for gateway credentials.
    secrets: HashMap<NsName, Arc<SecretMaterial>>,
    /// Kinds whose objects came from a saved snapshot and not yet from the cluster's own list.
    stale_kinds: HashSet<Kind>,
}

impl Store {
    fn apply(&mut self, change: ObjectChange, system_namespace: &str, dirty: &mut Dirty) {
        match change {
            ObjectChange::Upsert(object) => self.upsert(object, system_namespace, dirty),
            ObjectChange::Delete(key) => self.delete(key, system_namespace, dirty),
        }
    }

    fn upsert(&mut self, object: Object, system_namespace: &str, dirty: &mut Dirty) {
        match object {
            Object::Namespace(ns) => {
                let name = ns.name.clone();
                let old = self.namespaces.insert(name.clone(), ns);
                let network_changed =
                    old.map(|o| o.network) != Some(self.namespaces[&name].network.clone());
                dirty.all |= name == system_namespace && network_changed;
            }
            Object::Service(svc) => {
                let key = (svc.namespace.clone(), svc.name.clone());
                if self.services.get(&key) != Some(&svc) {
                    self.services.insert(key.clone(), svc);
                    dirty.services.insert(key);
                    dirty.definitions = true;
                }
            }
            Object::EndpointSlice(mut slice) => {
                let key = (slice.namespace.clone(), slice.name.clone());
                if self.slices.get(&key) == Some(&slice) {
                    return;
                }
                self.remove_slice(&key, dirty);
                self.index_slice(&mut slice, true);
                dirty
                    .services
                    .insert((slice.namespace.clone(), slice.service.clone()));
                self.slices_by_service
                    .entry((slice.namespace.clone(), slice.service.clone()))
                    .or_default()
                    .insert(slice.name.clone());
                self.slices.insert(key, slice);
            }
            Object::Pod(pod) => {
                if self.pods.get(&pod.namespace, &pod.name) == Some(&pod) {
                    return;
                }
                let (namespace, name) = (pod.namespace.clone(), pod.name.clone());
                if let Some(old) = self.pods.insert(pod) {
                    self.mark_pod_ips(&old.namespace, &old.ips, dirty);
                }
                dirty.pod_namespaces.insert(namespace.to_string());
                self.mark_pod(&namespace, &name, dirty);
            }
            Object::Node(node) => {
                let name = node.name.clone();
                if self.nodes.get(&name) == Some(&node) {
                    return;
                }
                self.nodes.insert(name.clone(), node);
                self.mark_node(&name, dirty);
            }
            Object::Secret(secret) => {
                let key = (secret.namespace, secret.name);
                let changed = match secret.material {
                    Some(m) => self.secrets.insert(key.clone(), m.clone()) != Some(m),
                    None => self.secrets.remove(&key).is_some(),
                };
                if changed {
                    dirty.secrets.insert(key);
                }
            }
        }
    }

    fn delete(&mut self, key: ObjectKey, system_namespace: &str, dirty: &mut Dirty) {
        let ns_name = (key.namespace, key.name);
        match key.kind {
            Kind::Namespace => {
                let old = self.namespaces.remove(&ns_name.1);
                dirty.all |=
                    ns_name.1 == system_namespace && old.is_some_and(|o| o.network.is_some());
            }
            Kind::Service => {
                if self.services.remove(&ns_name).is_some() {
                    dirty.definitions = true;
                    dirty.services.insert(ns_name);
                }
            }
            Kind::EndpointSlice => self.remove_slice(&ns_name, dirty),
            Kind::Pod => self.remove_pod(&ns_name.0, &ns_name.1, dirty),
            Kind::Node => {
                if self.nodes.remove(&ns_name.1).is_some() {
                    self.mark_node(&ns_name.1, dirty);
                }
            }
            Kind::Secret => {
                if self.secrets.remove(&ns_name).is_some() {
                    dirty.secrets.insert(ns_name);
                }
            }
        }
    }

    fn remove_slice(&mut self, key: &NsName, dirty: &mut Dirty) {
        let Some(mut old) = self.slices.remove(key) else {
            return;
        };
        self.index_slice(&mut old, false);
        let service = (old.namespace.clone(), old.service.clone());
        if let Some(names) = self.slices_by_service.get_mut(&service) {
            names.remove(&old.name);
            if names.is_empty() {
                self.slices_by_service.remove(&service);
            }
        }
        dirty.services.insert(service);
    }

    /// Adds (or removes) a slice's references to pods, by targetRef or by address. Added
    /// references share the pod's name.
    fn index_slice(&mut self, slice: &mut SliceObj, add: bool) {
        let ns = &slice.namespace;
        let name: Arc<str> = Arc::from(slice.name.as_str());
        for ep in &mut slice.endpoints {
            match &mut ep.pod {
                Some(pod) if add => *pod = self.pods.link(ns, pod, &name),
                Some(pod) => self.pods.unlink(ns, pod, &name),
                None => {
                    for ip in &ep.addresses {
                        toggle(&mut self.slices_by_ip, (ns.clone(), *ip), &name, add);
                    }
                }
            }
        }
    }

    fn remove_pod(&mut self, namespace: &str, name: &str, dirty: &mut Dirty) {
        let Some(old) = self.pods.remove(namespace, name) else {
            return;
        };
        dirty.pod_namespaces.insert(old.namespace.to_string());
        self.mark_pod_ips(&old.namespace, &old.ips, dirty);
        self.mark_pod(namespace, name, dirty);
    }

    /// Marks the services whose slices reference a pod.
    fn mark_pod(&self, namespace: &str, name: &str, dirty: &mut Dirty) {
        if let Some(pod) = self.pods.get(namespace, name) {
            self.mark_pod_ips(namespace, &pod.ips, dirty);
        }
        for slice in self.pods.slices_naming(namespace, name) {
            self.mark_slice(namespace, slice, dirty);
        }
    }

    fn mark_pod_ips(&self, namespace: &str, ips: &[IpAddr], dirty: &mut Dirty) {
        for ip in ips {
            for slice in self
                .slices_by_ip
                .get(&(namespace.to_string(), *ip))
                .into_iter()
                .flatten()
            {
                self.mark_slice(namespace, slice, dirty);
            }
        }
    }

    fn mark_slice(&self, namespace: &str, slice: &str, dirty: &mut Dirty) {
        if let Some(s) = self.slices.get(&(namespace.to_string(), slice.to_string())) {
            dirty
                .services
                .insert((s.namespace.clone(), s.service.clone()));
        }
    }

    fn mark_node(&self, node: &str, dirty: &mut Dirty) {
        for pod in self.pods.on_node(node) {
            dirty.pod_namespaces.insert(pod.namespace.to_string());
            self.mark_pod(&pod.namespace, &pod.name, dirty);
        }
    }

    /// Every service this cluster knows of, by definition or by slices.
    fn service_names(&self) -> Vec<NsName> {
        let all: BTreeSet<NsName> = self
            .services
            .keys()
            .chain(self.slices_by_service.keys())
            .cloned()
            .collect();
        all.into_iter().collect()
    }

    fn endpoint_context<'a>(
        &'a self,
        cluster: &'a ClusterId,
        naming: &'a MeshNaming,
        networks: &'a MeshNetworks,
    ) -> EndpointContext<'a> {
        let labelled = self
            .namespaces
            .get(&naming.system_namespace)
            .and_then(|ns| ns.network.as_deref());
        EndpointContext {
            cluster,
            naming,
            pods: &self.pods,
            nodes: &self.nodes,
            cluster_network: labelled.or_else(|| networks.network_of_registry(cluster.as_str())),
            networks,
            shared: Default::default(),
        }
    }
}

/// Adds `name` to, or removes it from, the set under `key`; empty sets are dropped.
fn toggle<K: Hash + Eq>(map: &mut HashMap<K, Vec<Arc<str>>>, key: K, name: &Arc<str>, add: bool) {
    if add {
        set_member(map.entry(key).or_default(), name, true);
    } else if let Entry::Occupied(mut names) = map.entry(key) {
        set_member(names.get_mut(), name, false);
        if names.get().is_empty() {
            names.remove();
        }
    }
}

/// Adds `name` to, or removes it from, a small list used as a set.
fn set_member(names: &mut Vec<Arc<str>>, name: &Arc<str>, add: bool) {
    if !add {
        names.retain(|n| n != name);
    } else if !names.contains(name) {
        // Sized for the one name nearly every list has (a first push would reserve four).
        names.reserve_exact(1);
        names.push(name.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Health, MeshNaming, Provider, TlsMode};
    use crate::sources::manifest;
    use tokio::sync::mpsc::UnboundedReceiver;

    const HOST: &str = "web.shop.svc.cluster.local";

    pub(super) fn registry() -> (ClusterRegistry, UnboundedReceiver<Change>) {
        let mesh = Arc::new(Mesh::new(MeshNaming::default()));
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let shard = ShardKey {
            provider: Provider::Kubernetes,
            cluster: ClusterId::new("c1"),
        };
        (
            ClusterRegistry::new(shard, "test".into(), mesh, tx, true),
            rx,
        )
    }

    /// A registry staged to replace `old` (a kubeconfig rotation), and its change stream.
    fn staged_beside(old: &ClusterRegistry) -> (ClusterRegistry, UnboundedReceiver<Change>) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let shard = old.shard.clone();
        let staged = ClusterRegistry::new(shard, "rotated".into(), old.mesh.clone(), tx, false);
        (staged, rx)
    }

    pub(super) fn apply(reg: &ClusterRegistry, yaml: &str) {
        reg.apply(
            manifest::parse(yaml)
                .unwrap()
                .into_iter()
                .map(ObjectChange::Upsert),
        );
    }

    pub(super) fn endpoints(reg: &ClusterRegistry) -> Vec<Endpoint> {
        let key = ServiceKey {
            hostname: HOST.into(),
            namespace: "shop".into(),
        };
        reg.mesh
            .snapshot()
            .endpoints
            .get(&key)
            .map(|s| s.endpoints().cloned().collect())
            .unwrap_or_default()
    }

    use crate::model::Endpoint;

    pub(super) const SERVICE: &str = "
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec: {clusterIP: 10.0.0.10, ports: [{name: http, port: 80}]}
";
    pub(super) const NODE: &str = "
apiVersion: v1
kind: Node
metadata:
  name: n1
  labels: {topology.kubernetes.io/region: r1, topology.kubernetes.io/zone: z1, topology.istio.io/subzone: s1}
";
    pub(super) const POD: &str = "
apiVersion: v1
kind: Pod
metadata: {name: web-1, namespace: shop, labels: {app: web, security.istio.io/tlsMode: istio}}
spec: {serviceAccountName: web-sa, nodeName: n1, containers: []}
status: {podIP: 10.1.0.1}
";
    pub(super) const SLICE: &str = "
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-abc, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints:
- addresses: [10.1.0.1]
  conditions: {ready: true}
  targetRef: {kind: Pod, name: web-1, namespace: shop}
- addresses: [10.1.0.2]
  conditions: {ready: false}
";

    #[test]
    fn slice_pod_and_node_become_endpoints() {
        let (reg, _rx) = registry();
        apply(&reg, &[SERVICE, NODE, POD, SLICE].join("---"));
        let eps = endpoints(&reg);
        assert_eq!(eps.len(), 2);
        let ready = &eps[0];
        assert_eq!(ready.address.to_string(), "10.1.0.1");
        assert_eq!(ready.port, 8080);
        assert_eq!(&*ready.service_port_name, "http");
        assert_eq!(
            &*ready.service_account,
            "spiffe://cluster.local/ns/shop/sa/web-sa"
        );
        assert_eq!(ready.tls_mode, TlsMode::Istio);
        assert_eq!(ready.health, Health::Healthy);
        assert_eq!(
            (
                &*ready.locality.region,
                &*ready.locality.zone,
                &*ready.locality.subzone
            ),
            ("r1", "z1", "s1")
        );
        assert_eq!(ready.labels.get("app").map(String::as_str), Some("web"));
        assert_eq!(ready.cluster_id.as_str(), "c1");
        // No targetRef and no pod with that IP: served without workload details.
        let unready = &eps[1];
        assert_eq!(unready.health, Health::Unhealthy);
        assert_eq!(unready.tls_mode, TlsMode::Disabled);
        assert!(unready.service_account.is_empty());
        let svc = reg.mesh.snapshot().services.get(HOST).cloned().unwrap();
        assert_eq!(
            svc.cluster_vips[&ClusterId::new("c1")][0].to_string(),
            "10.0.0.10"
        );
    }

    #[test]
    fn endpoint_waits_for_its_pod() {
        let (reg, mut rx) = registry();
        apply(&reg, &[SERVICE, NODE, SLICE].join("---"));
        assert_eq!(
            endpoints(&reg).len(),
            1,
            "the targetRef'd endpoint waits for its pod"
        );
        assert_eq!(reg.pending_pod_endpoints(), 1);
        while rx.try_recv().is_ok() {}
        apply(&reg, POD);
        assert_eq!(endpoints(&reg).len(), 2);
        assert_eq!(reg.pending_pod_endpoints(), 0);
        let change = rx.try_recv().unwrap();
        assert!(change.services.contains(HOST));

        // The pod leaves before its slice: the endpoint waits again, and goes with the slice.
        let pod = manifest::parse(POD).unwrap().remove(0).key();
        reg.apply([ObjectChange::Delete(pod)]);
        assert_eq!(endpoints(&reg).len(), 1);
        assert_eq!(reg.pending_pod_endpoints(), 1);
        let slice = manifest::parse(SLICE).unwrap().remove(0).key();
        reg.apply([ObjectChange::Delete(slice)]);
        assert_eq!(reg.pending_pod_endpoints(), 0);
        assert!(
            reg.store.lock().pods.is_empty(),
            "no slot outlives pod and slice"
        );
    }

    #[test]
    fn a_list_removes_what_it_no_longer_holds() {
        let (reg, _rx) = registry();
        apply(&reg, &[SERVICE, NODE, POD, SLICE].join("---"));
        assert_eq!(endpoints(&reg).len(), 2);
        // The slice is listed again, without the pod: the pod is gone, its endpoint waits for it.
        let listed = manifest::parse(SLICE).unwrap().remove(0);
        reg.apply_list(Kind::EndpointSlice, vec![ObjectChange::Upsert(listed)]);
        assert_eq!(endpoints(&reg).len(), 2, "other kinds are not the list's");
        reg.apply_list(Kind::Pod, Vec::new());
        assert_eq!(endpoints(&reg).len(), 1);
        assert_eq!(reg.pending_pod_endpoints(), 1);
    }

    #[test]
    fn pod_label_locality_and_network_win() {
        let (reg, _rx) = registry();
        let pod = POD.replace(
            "labels: {app: web,",
            "labels: {istio-locality: ra.za, topology.istio.io/network: pod-net, app: web,",
        );
        let system_ns = "\napiVersion: v1\nkind: Namespace\nmetadata: {name: istio-system, labels: {topology.istio.io/network: ns-net}}\n";
        apply(&reg, &[SERVICE, NODE, &pod, SLICE, system_ns].join("---"));
        let eps = endpoints(&reg);
        assert_eq!(
            (&*eps[0].locality.region, &*eps[0].locality.zone),
            ("ra", "za")
        );
        assert_eq!(&*eps[0].network, "pod-net");
        assert_eq!(
            &*eps[1].network, "ns-net",
            "the system namespace labels the cluster's network"
        );
    }

    #[test]
    fn changes_are_classified_full_eds_or_nothing() {
        let (reg, mut rx) = registry();
        apply(&reg, &[SERVICE, NODE, POD, SLICE].join("---"));
        assert!(rx.try_recv().unwrap().full, "a new service is a full push");
        // Node moved zones: endpoints re-derived, EDS only.
        apply(&reg, &NODE.replace("z1", "z2"));
        let change = rx.try_recv().unwrap();
        assert!(!change.full && change.services.contains(HOST));
        assert_eq!(&*endpoints(&reg)[0].locality.zone, "z2");
        // Re-applying identical objects changes nothing.
        apply(&reg, &[SERVICE, POD, SLICE].join("---"));
        assert!(rx.try_recv().is_err());
        // A port change redefines the service: full.
        apply(&reg, &SERVICE.replace("port: 80", "port: 81"));
        assert!(rx.try_recv().unwrap().full);
    }

    #[test]
    fn deletes_remove_endpoints_and_services() {
        let (reg, _rx) = registry();
        apply(&reg, &[SERVICE, NODE, POD, SLICE].join("---"));
        let slice_key = ObjectKey {
            kind: Kind::EndpointSlice,
            namespace: "shop".into(),
            name: "web-abc".into(),
        };
        reg.apply([ObjectChange::Delete(slice_key)]);
        assert!(endpoints(&reg).is_empty());
        assert!(reg.mesh.snapshot().services.get(HOST).cloned().is_some());
        let svc_key = ObjectKey {
            kind: Kind::Service,
            namespace: "shop".into(),
            name: "web".into(),
        };
        reg.apply([ObjectChange::Delete(svc_key)]);
        assert!(reg.mesh.snapshot().services.get(HOST).cloned().is_none());
        assert_eq!(reg.service_count(), 0);
    }

    #[test]
    fn mcs_slices_are_ignored() {
        let (reg, _rx) = registry();
        let mcs = SLICE.replace(
            "kubernetes.io/service-name: web}",
            "kubernetes.io/service-name: web, multicluster.kubernetes.io/service-name: web}",
        );
        apply(&reg, &[SERVICE, NODE, POD, &mcs].join("---"));
        assert!(endpoints(&reg).is_empty());
    }

    #[test]
    fn staged_registry_takes_over_without_a_gap() {
        let (old, mut rx) = registry();
        apply(&old, &[SERVICE, NODE, POD, SLICE].join("---"));
        let other = "\napiVersion: v1\nkind: Service\nmetadata: {name: gone, namespace: shop}\nspec: {clusterIP: 10.0.0.11}\n";
        apply(&old, other);
        while rx.try_recv().is_ok() {}
        let (new, mut new_rx) = staged_beside(&old);
        // The new registry sees the same cluster minus one service, plus one moved endpoint.
        apply(
            &new,
            &[
                SERVICE,
                NODE,
                &POD.replace("10.1.0.1", "10.1.0.9"),
                &SLICE.replace("10.1.0.1", "10.1.0.9"),
            ]
            .join("---"),
        );
        assert_eq!(
            endpoints(&old)[0].address.to_string(),
            "10.1.0.1",
            "staging publishes nothing"
        );
        assert_eq!(new.service_count(), 1, "but keeps what it saw");
        assert!(new_rx.try_recv().is_err());

        old.retire();
        apply(&old, &SERVICE.replace("port: 80", "port: 99"));
        assert_eq!(
            old.mesh
                .snapshot()
                .services
                .get(HOST)
                .cloned()
                .unwrap()
                .ports[0]
                .port,
            80,
            "retired registries write nothing"
        );
        new.go_live();
        let addrs: Vec<String> = endpoints(&new)
            .iter()
            .map(|e| e.address.to_string())
            .collect();
        assert_eq!(addrs, ["10.1.0.2", "10.1.0.9"]);
        assert!(new
            .mesh
            .snapshot()
            .services
            .get("gone.shop.svc.cluster.local")
            .is_none());
        let change = new_rx.try_recv().unwrap();
        assert!(
            change.services.contains(HOST)
                && change.services.contains("gone.shop.svc.cluster.local")
        );
    }

    #[test]
    fn a_registry_going_live_removes_what_the_mesh_holds_that_it_does_not_know() {
        use crate::istio::test_object;
        use crate::model::{ConfigChange, ConfigSource};
        let (old, _rx) = registry();
        apply(&old, &[SERVICE, NODE, POD, SLICE].join("---"));
        let entry = test_object(
            "ServiceEntry",
            "shop",
            "web-entry",
            "2024-01-01T00:00:00Z",
            serde_json::json!({
                "hosts": ["web.shop.global"], "resolution": "STATIC",
                "ports": [{"number": 80, "name": "http", "protocol": "HTTP"}],
                "workloadSelector": {"labels": {"app": "web"}}
            }),
        );
        let set_config = |change: ConfigChange| {
            old.mesh
                .write(|mesh| mesh.config.apply(ConfigSource::ConfigCluster, vec![change]));
        };
        set_config(ConfigChange::Upsert(entry.clone()));
        old.resync_selected();
        let selected = ServiceKey {
            hostname: "web.shop.global".into(),
            namespace: "shop".into(),
        };
        let held = |reg: &ClusterRegistry| reg.mesh.snapshot().endpoints.get(&selected).is_some();
        assert!(held(&old));

        let (new, _new_rx) = staged_beside(&old);
        apply(&new, &[SERVICE, NODE, POD, SLICE].join("---"));
        // The entry goes while the registries swap: neither re-derives it (one is retired, the
        // other staged), so only the mesh remembers its shard.
        old.retire();
        set_config(ConfigChange::Delete(entry.key.clone()));
        new.go_live();
        assert!(!held(&new), "the shard of a gone entry outlived the swap");
        assert_eq!(endpoints(&new).len(), 2);
    }

    #[test]
    fn clear_removes_everything_the_cluster_served() {
        let (reg, mut rx) = registry();
        apply(&reg, &[SERVICE, NODE, POD, SLICE].join("---"));
        while rx.try_recv().is_ok() {}
        reg.clear();
        assert!(endpoints(&reg).is_empty());
        assert!(reg.mesh.snapshot().services.get(HOST).cloned().is_none());
        let change = rx.try_recv().unwrap();
        assert!(change.full && change.services.contains(HOST));
    }
}
