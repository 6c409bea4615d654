//! One cluster's registry: its trimmed Kubernetes objects, and what they mean for the mesh.
//!
//! Sources (file directories, Kubernetes watches) feed [`ObjectChange`]s into
//! [`ClusterRegistry::apply`]; the registry works out which services they touch, converts only those,
//! writes the cluster's shard of the model and emits one [`Change`] per batch.

mod convert;
mod discovered;
pub mod entry_workloads;
mod intern;
pub mod objects;
mod pod_services;
mod pods;
mod publish;
mod saved;
mod selection;
pub mod service_entries;
mod status;
mod store;
pub mod workload;
mod workloads;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::SystemTime;

use parking_lot::Mutex;
use tokio::sync::mpsc::UnboundedSender;

use crate::model::{Change, ClusterId, Mesh, ShardKey};
pub use convert::NsName;
pub use discovered::DiscoveredNamespaces;
use objects::{Kind, ObjectChange};
use publish::Secrets;
pub use saved::SavedObjects;
use selection::Selected;
pub use status::{ClusterStatus, Discovery, SyncState};
use store::{Dirty, Mode, Store};

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
    discovered: Arc<DiscoveredNamespaces>,
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
                pending_rotation: None,
                snapshot_saved_at: None,
                discovery: None,
            }),
            discovered: Arc::default(),
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
        let mut status = self.status.lock().clone();
        if let Some(discovery) = status.discovery.as_mut() {
            discovery.namespaces = self.discovered.count();
        }
        status
    }

    /// Which of its namespaces are discovered (every one, unless a discovery watch says otherwise).
    pub fn discovered(&self) -> &Arc<DiscoveredNamespaces> {
        &self.discovered
    }

    /// Moves the cluster to `state`; leaving `Stale` means the snapshot is no longer served.
    pub fn set_state(&self, state: SyncState) {
        let mut status = self.status.lock();
        status.state = state;
        if state != SyncState::Stale {
            status.snapshot_saved_at = None;
        }
    }

    /// Updates what the status says of the discovered namespaces (Kubernetes clusters only).
    pub fn update_discovery(&self, update: impl FnOnce(&mut Discovery)) {
        let mut status = self.status.lock();
        update(status.discovery.get_or_insert_with(|| Discovery {
            from: "mesh config".into(),
            ..Default::default()
        }));
    }

    /// Records (or, with None, clears) the cluster's current error.
    pub fn set_error(&self, error: Option<String>) {
        let mut status = self.status.lock();
        status.last_error_at = error.as_ref().map(|_| SystemTime::now());
        status.last_error = error;
    }

    /// Records why a kubeconfig rotation is not through yet (None: none pending).
    pub fn set_pending_rotation(&self, why: Option<String>) {
        self.status.lock().pending_rotation = why;
    }

    pub fn service_count(&self) -> usize {
        self.store.lock().services.len()
    }

    /// Slice endpoints left out because the pod their targetRef names is not known yet
    /// (`pilot_k8s_endpoints_pending_pod`).
    pub fn pending_pod_endpoints(&self) -> usize {
        self.store.lock().pods.pending()
    }

    /// Reads one of the cluster's pods.
    pub fn with_pod<R>(
        &self,
        namespace: &str,
        name: &str,
        read: impl FnOnce(&objects::PodObj) -> R,
    ) -> Option<R> {
        self.store.lock().pods.get(namespace, name).map(read)
    }

    /// Whether a pod of `namespace` running as `service_account` is scheduled on `node`.
    pub fn runs_on_node(&self, namespace: &str, service_account: &str, node: &str) -> bool {
        let store = self.store.lock();
        let mut pods = store.pods.in_namespace(namespace);
        pods.any(|p| *p.service_account == *service_account && p.node.as_deref() == Some(node))
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
            let selected = match dirty.pods.is_empty() {
                true => Selected::None,
                false => Selected::Pods(dirty.pods),
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
            change.workloads = mesh
                .workloads
                .remove_cluster(&self.id)
                .into_iter()
                .collect();
            let removed = mesh.endpoints.delete_cluster(&self.shard);
            change
                .services
                .extend(removed.into_iter().map(|k| k.hostname));
            change
                .credentials
                .extend(mesh.credentials.remove_cluster(&self.id));
            pod_services::sync(mesh, &mut change);
            change
        });
        self.emit(change);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Health, MeshNaming, Provider, ServiceKey, TlsMode};
    use crate::sources::manifest;
    use objects::ObjectKey;
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
    fn endpoints_name_the_pods_workload() {
        let (reg, _rx) = registry();
        let pod = POD.replace(
            "metadata: {name: web-1,",
            "metadata: {ownerReferences: [{apiVersion: apps/v1, kind: ReplicaSet, name: web-5c9d, \
             uid: u1, controller: true}], name: web-5c9d-x2x,",
        )
        .replace("labels: {app: web,", "labels: {pod-template-hash: 5c9d, app: web,");
        let slice = SLICE.replace("name: web-1", "name: web-5c9d-x2x");
        apply(&reg, &[SERVICE, NODE, &pod, &slice].join("---"));
        let eps = endpoints(&reg);
        let workloads: Vec<&str> = eps.iter().map(|e| &*e.workload).collect();
        assert!(workloads.contains(&"web"), "{workloads:?}");
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
