//! A cluster's pods as ambient mode's workloads: re-derived for the pods a batch touched (or every
//! one), and written to the mesh's workload table with the batch.

use std::collections::BTreeSet;
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
            let (old, new) = (
                old.map_or(&[][..], |o| &o[..]),
                new.map_or(&[][..], |n| &n[..]),
            );
            if old == new {
                continue;
            }
            for ip in moved_addresses(old, new) {
                if let Some(pod) = store.pods.anywhere_at(ip) {
                    pods.insert(pod_uid(&self.id, &pod.namespace, &pod.name).into());
                }
            }
        }
        pods
    }
}

/// The addresses whose (port name, port) pairs differ between two shards. Both are canonical
/// (sorted by address and port name, one entry each), so one walk finds them.
fn moved_addresses(old: &[Endpoint], new: &[Endpoint]) -> BTreeSet<IpAddr> {
    let (mut old, mut new) = (old.iter().peekable(), new.iter().peekable());
    let mut moved = BTreeSet::new();
    loop {
        let gone = match (old.peek(), new.peek()) {
            (None, None) => return moved,
            (Some(a), Some(b)) if a.key() == b.key() => {
                if a.port != b.port {
                    moved.insert(a.address);
                }
                old.next();
                new.next();
                continue;
            }
            (Some(a), Some(b)) => a.key() < b.key(),
            (Some(_), None) => true,
            (None, Some(_)) => false,
        };
        let side = if gone { old.next() } else { new.next() };
        moved.extend(side.map(|e| e.address));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{canonical, ClusterId, Health, TlsMode};

    fn ep(ip: &str, name: &str, port: u16) -> Endpoint {
        Endpoint {
            address: ip.parse().unwrap(),
            port,
            service_port_name: name.into(),
            labels: Default::default(),
            service_account: "".into(),
            network: "".into(),
            locality: Default::default(),
            cluster_id: ClusterId::new("c1"),
            tls_mode: TlsMode::Disabled,
            health: Health::Healthy,
            workload: "".into(),
            weight: 1,
            hostname: None,
        }
    }

    #[test]
    fn an_address_moved_when_its_ports_came_changed_or_went() {
        let old = canonical(vec![
            ep("10.0.0.1", "http", 80),
            ep("10.0.0.2", "http", 80),
            ep("10.0.0.3", "http", 80),
        ]);
        let new = canonical(vec![
            ep("10.0.0.1", "http", 80),
            ep("10.0.0.2", "http", 8080),
            ep("10.0.0.4", "http", 80),
            ep("10.0.0.1", "grpc", 90),
        ]);
        let moved: Vec<String> = moved_addresses(&old, &new)
            .iter()
            .map(IpAddr::to_string)
            .collect();
        assert_eq!(moved, ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"]);
        assert!(moved_addresses(&old, &old).is_empty());
    }
}
