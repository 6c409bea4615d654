//! The publish path: a batch's touched services converted outside the mesh's writer lock, then
//! written as one snapshot with the cluster's Secrets, and one `Change` emitted.

use std::collections::BTreeSet;
use std::sync::Arc;

use tracing::{debug, warn};

use super::convert::{self, NsName};
use super::selection::Selected;
use super::store::Store;
use super::ClusterRegistry;
use crate::model::{
    canonical, Change, ClusterId, CredentialKey, Endpoint, MeshNetworks, MeshSnapshot, PushNeed,
    Service, ServiceKey, ShardKey,
};

impl ClusterRegistry {
    /// Writes these services to the mesh as one snapshot and emits what changed. Conversion happens
    /// first, outside the mesh's writer lock; the store stays locked throughout so the registry's
    /// writes keep their order.
    pub(super) fn publish(
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
        let workloads = self.workload_updates(&store, &snapshot, &networks, &selected);
        let selected = self.selected_updates(&mut store, &snapshot, &networks, &selected);
        let shards = updates.iter().map(|u| (&u.key, u.endpoints.as_ref()));
        let shards = shards.chain(selected.iter().map(|(key, eps)| (key, eps.as_ref())));
        let moved = self.pods_with_moved_endpoints(&store, &snapshot, shards);
        let change = self.mesh.write(|mesh| {
            let mut change = Change {
                workloads: workloads.apply(&self.id, &mut mesh.workloads),
                ..Change::default()
            };
            change.workloads.extend(moved);
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
            super::pod_services::sync(mesh, &mut change);
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
            .map(|obj| convert::service(obj, store.namespaces.get(namespace), &self.id, naming));
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

    pub(super) fn emit(&self, change: Change) {
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
        let service = mesh.services.get(&self.key.hostname);
        let headless = service.is_some_and(|s| s.is_headless_kubernetes());
        let listens = service.is_some_and(|s| s.listens_per_endpoint());
        let modes = |mesh: &MeshSnapshot| {
            let shards = mesh.endpoints.get(&self.key)?;
            let modes = shards.port_tls_modes();
            Some(
                modes
                    .into_iter()
                    .map(|(p, m)| (p.to_string(), m))
                    .collect::<Vec<_>>(),
            )
        };
        let modes_before = headless.then(|| modes(mesh)).flatten();
        let need = match self.endpoints {
            Some(eps) => mesh.endpoints.update(&self.key, shard, eps),
            None => mesh.endpoints.delete_service_shard(&self.key, shard),
        };
        // Listeners that match a headless service's pods follow its endpoints (a full push, as
        // istiod's), and so does its ORIGINAL_DST cluster, which originates mTLS only where every
        // pod of a port has a sidecar.
        let modes_changed = headless && need != PushNeed::None && modes(mesh) != modes_before;
        let per_endpoint = need != PushNeed::None && (listens || modes_changed);
        if per_endpoint {
            mesh.pods_version += 1;
        }
        if defined || need == PushNeed::Full || per_endpoint {
            change.full = true;
        }
        if defined || need != PushNeed::None {
            change.services.insert(self.key.hostname);
        }
    }
}

/// Which Secrets a publish writes.
pub(super) enum Secrets {
    Named(BTreeSet<NsName>),
    /// Every one of the cluster's, replacing what the mesh holds for it.
    All,
}

impl Secrets {
    pub(super) fn none() -> Self {
        Secrets::Named(BTreeSet::new())
    }
}
