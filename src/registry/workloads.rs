//! A cluster's pods as ambient mode's workloads: re-derived for the pods a batch touched (or every
//! one), and written to the mesh's workload table with the batch.

use std::collections::BTreeSet;
use std::sync::Arc;

use super::selection::Selected;
use super::store::Store;
use super::ClusterRegistry;
use crate::model::{pod_uid, MeshNetworks, MeshSnapshot, Workload, WorkloadTable};

/// What a batch does to the cluster's workloads.
pub(super) enum WorkloadUpdate {
    /// Each pod's workload by uid; None: it has none any more.
    Pods(Vec<(String, Option<Workload>)>),
    /// Every pod of these namespaces.
    Namespaces(Vec<(Arc<str>, Vec<Workload>)>),
}

impl WorkloadUpdate {
    /// Writes the update; returns whether the table changed.
    pub(super) fn apply(
        self,
        cluster: &crate::model::ClusterId,
        table: &mut WorkloadTable,
    ) -> bool {
        let mut changed = false;
        match self {
            WorkloadUpdate::Pods(pods) => {
                for (uid, workload) in pods {
                    changed |= table.set(&uid, workload);
                }
            }
            WorkloadUpdate::Namespaces(namespaces) => {
                for (namespace, workloads) in namespaces {
                    changed |= table.replace_namespace(cluster, &namespace, workloads);
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
}
