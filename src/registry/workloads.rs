//! A cluster's pods as ambient mode's workloads: re-derived for the pods a batch touched (or every
//! one), and written to the mesh's workload table with the batch.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use super::selection::Selected;
use super::store::Store;
use super::ClusterRegistry;
use crate::model::{
    pod_uid, Endpoint, MeshNetworks, MeshSnapshot, ServiceKey, Workload, WorkloadTable,
};

/// What a batch does to the cluster's workloads.
pub(super) enum WorkloadUpdate {
    /// Each pod's workload by uid; None: it has none any more.
    Pods(Vec<(String, Option<Workload>)>),
    /// Every pod of these namespaces.
    Namespaces(Vec<(Arc<str>, Vec<Workload>)>),
}

impl WorkloadUpdate {
    /// Writes the update; returns the uids that changed.
    pub(super) fn apply(
        self,
        cluster: &crate::model::ClusterId,
        table: &mut WorkloadTable,
    ) -> BTreeSet<Arc<str>> {
        let mut changed = BTreeSet::new();
        match self {
            WorkloadUpdate::Pods(pods) => {
                for (uid, workload) in pods {
                    if table.set(&uid, workload) {
                        changed.insert(uid.into());
                    }
                }
            }
            WorkloadUpdate::Namespaces(namespaces) => {
                for (namespace, workloads) in namespaces {
                    changed.extend(table.replace_namespace(cluster, &namespace, workloads));
                }
            }
        }
        changed
    }
}

impl ClusterRegistry {
    /// The workloads of the pods in `scope`; for `Selected::All`, of every namespace the store has
    /// pods in or the mesh holds workloads of.
    pub(super) fn workload_updates(
        &self,
        store: &Store,
        snapshot: &MeshSnapshot,
        networks: &MeshNetworks,
        scope: &Selected,
    ) -> WorkloadUpdate {
        let ctx = store.endpoint_context(&self.id, &self.mesh.naming, networks);
        match scope {
            Selected::None => WorkloadUpdate::Pods(Vec::new()),
            Selected::Pods(pods) => WorkloadUpdate::Pods(
                pods.iter()
                    .map(|(namespace, name)| {
                        let pod = store.pods.get(namespace, name);
                        let uid = pod_uid(&self.id, namespace, name);
                        (uid, pod.and_then(|pod| ctx.workload(pod)))
                    })
                    .collect(),
            ),
            Selected::All => {
                let held = snapshot.workloads.namespaces_of(&self.id).into_iter();
                let namespaces: BTreeSet<Arc<str>> =
                    held.chain(store.pods.namespaces().cloned()).collect();
                let workloads = namespaces.into_iter().map(|namespace| {
                    let pods = store.pods.in_namespace(&namespace);
                    let workloads = pods.filter_map(|pod| ctx.workload(pod)).collect();
                    (namespace, workloads)
                });
                WorkloadUpdate::Namespaces(workloads.collect())
            }
        }
    }

    /// The pods whose endpoints in these shards of the cluster (new, None: gone) differ from what
    /// the mesh holds: each lists the services it backs, with their ports, in its Address.
    pub(super) fn pods_with_moved_endpoints<'a>(
        &self,
        store: &Store,
        snapshot: &MeshSnapshot,
        shards: impl Iterator<Item = (&'a ServiceKey, Option<&'a Arc<[Endpoint]>>)>,
    ) -> BTreeSet<Arc<str>> {
        let mut pods = BTreeSet::new();
        for (key, new) in shards {
            let old = snapshot
                .endpoints
                .get(key)
                .and_then(|s| s.shards.get(&self.shard));
            if old.map(|o| &**o) == new.map(|n| &**n) {
                continue;
            }
            let (old, new) = (ports_by_address(old), ports_by_address(new));
            let moved = old
                .keys()
                .chain(new.keys())
                .filter(|ip| old.get(*ip) != new.get(*ip));
            for ip in moved {
                if let Some(pod) = store.pods.anywhere_at(*ip) {
                    pods.insert(pod_uid(&self.id, &pod.namespace, &pod.name).into());
                }
            }
        }
        pods
    }
}

/// Each address of a shard with the (port name, port) pairs it serves.
fn ports_by_address(endpoints: Option<&Arc<[Endpoint]>>) -> BTreeMap<IpAddr, Vec<(&str, u16)>> {
    let mut ports: BTreeMap<IpAddr, Vec<(&str, u16)>> = BTreeMap::new();
    for endpoint in endpoints.into_iter().flat_map(|e| e.iter()) {
        let entry = ports.entry(endpoint.address).or_default();
        entry.push((&endpoint.service_port_name, endpoint.port));
    }
    ports
}
