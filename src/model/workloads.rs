//! The mesh's workloads as ambient mode sees them: every running pod of every cluster, whether or
//! not a service selects it (ztunnel routes and authorizes by pod address). Each cluster's registry
//! writes its own; the table is a persistent map, so a snapshot copy shares it.

use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::Arc;

use super::{ClusterId, Labels, Locality, MeshSnapshot};

/// One pod, in the terms ztunnel's `istio.workload.Workload` needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Workload {
    /// istiod's uid of a pod: `<cluster>//Pod/<namespace>/<name>`.
    pub uid: Arc<str>,
    pub name: Arc<str>,
    pub namespace: Arc<str>,
    pub cluster_id: ClusterId,
    pub addresses: Vec<IpAddr>,
    pub network: Arc<str>,
    /// The service account's name (not the SPIFFE identity).
    pub service_account: Arc<str>,
    pub node: Option<Arc<str>>,
    pub labels: Labels,
    /// The workload the pod belongs to (its Deployment, …).
    pub workload_name: Arc<str>,
    /// Its canonical service and revision (Istio's labels, else the workload's name and `latest`).
    pub canonical_name: Arc<str>,
    pub canonical_revision: Arc<str>,
    pub locality: Arc<Locality>,
    pub healthy: bool,
    /// The share of traffic it takes (a WorkloadEntry's weight); None: one.
    pub capacity: Option<u32>,
    /// Captured by ztunnel: istio-cni marked the pod `ambient.istio.io/redirection: enabled`.
    pub captured: bool,
    pub host_network: bool,
    /// Its `istio.io/use-waypoint`, else its namespace's.
    pub use_waypoint: Option<super::UseWaypoint>,
}

/// istiod's uid of a pod (pilot/pkg/serviceregistry/ambient/helpers.go: the group is empty).
pub fn pod_uid(cluster: &ClusterId, namespace: &str, name: &str) -> String {
    format!("{cluster}//Pod/{namespace}/{name}")
}

/// istiod's uid of a WorkloadEntry, under the cluster (config source) it came from.
pub fn entry_uid(cluster: &ClusterId, namespace: &str, name: &str) -> String {
    format!("{cluster}/networking.istio.io/WorkloadEntry/{namespace}/{name}")
}

/// Every cluster's pods by uid, and the WorkloadEntries of the config; both by address.
#[derive(Clone, Debug, Default)]
pub struct WorkloadTable {
    by_uid: imbl::OrdMap<Arc<str>, Arc<Workload>>,
    entries: imbl::OrdMap<Arc<str>, Arc<Workload>>,
    /// Network → (address, uid): how ztunnel looks workloads up, and how a waypoint tells a
    /// captured endpoint. Several workloads may hold one address (host-network pods).
    by_address: imbl::OrdMap<Arc<str>, imbl::OrdSet<(IpAddr, Arc<str>)>>,
}

/// The least uid: where a range of one address's holders starts.
static NO_UID: std::sync::LazyLock<Arc<str>> = std::sync::LazyLock::new(|| Arc::from(""));

impl WorkloadTable {
    /// Replaces the pods of one namespace of a cluster with `workloads`; returns the uids that
    /// changed (came, changed or went).
    pub fn replace_namespace(
        &mut self,
        cluster: &ClusterId,
        namespace: &str,
        workloads: Vec<Workload>,
    ) -> Vec<Arc<str>> {
        let prefix = pod_uid(cluster, namespace, "");
        let kept: HashSet<&str> = workloads.iter().map(|w| &*w.uid).collect();
        let gone: Vec<Arc<str>> = self
            .under(&prefix)
            .filter(|w| !kept.contains(&*w.uid))
            .map(|w| w.uid.clone())
            .collect();
        for uid in &gone {
            self.set(uid, None);
        }
        let mut changed = gone;
        for workload in workloads {
            let uid = workload.uid.clone();
            if self.set(&uid, Some(workload)) {
                changed.push(uid);
            }
        }
        changed
    }

    /// Sets (None: removes) one workload; returns whether anything changed.
    pub fn set(&mut self, uid: &str, workload: Option<Workload>) -> bool {
        if let Some(w) = &workload {
            if self.by_uid.get(uid).map(|held| &**held) == Some(w) {
                return false;
            }
        }
        let Some(old) = self.by_uid.remove(uid) else {
            return workload.map(|w| self.insert(w)).is_some();
        };
        // Unindexed first: the new one may hold the same addresses.
        self.index(&old, false);
        if let Some(w) = workload {
            self.insert(w);
        }
        true
    }

    fn insert(&mut self, w: Workload) {
        let w = Arc::new(w);
        self.index(&w, true);
        self.by_uid.insert(w.uid.clone(), w);
    }

    /// Adds a workload's addresses to the index, or removes them.
    fn index(&mut self, w: &Workload, add: bool) {
        let held = self.by_address.entry(w.network.clone()).or_default();
        for ip in &w.addresses {
            match add {
                true => held.insert((*ip, w.uid.clone())),
                false => held.remove(&(*ip, w.uid.clone())),
            };
        }
        if held.is_empty() {
            self.by_address.remove(&w.network);
        }
    }

    /// A workload holding an address on a network (the least uid where several do).
    pub fn at(&self, network: &str, ip: IpAddr) -> Option<&Arc<Workload>> {
        let held = self.by_address.get(network)?;
        let (found, uid) = held.range((ip, NO_UID.clone())..).next()?;
        (*found == ip).then_some(())?;
        self.get(uid)
    }

    /// Removes every pod of a cluster (it left); returns their uids.
    pub fn remove_cluster(&mut self, cluster: &ClusterId) -> Vec<Arc<str>> {
        let prefix = format!("{cluster}//Pod/");
        let held: Vec<Arc<str>> = self.under(&prefix).map(|w| w.uid.clone()).collect();
        for uid in &held {
            self.set(uid, None);
        }
        held
    }

    /// A cluster's first pod (by uid), if it has any.
    pub fn first_pod_of(&self, cluster: &ClusterId) -> Option<&Arc<Workload>> {
        let prefix = format!("{cluster}//Pod/");
        self.under(&prefix).next()
    }

    /// The namespaces a cluster has pods in.
    pub fn namespaces_of(&self, cluster: &ClusterId) -> Vec<Arc<str>> {
        let prefix = format!("{cluster}//Pod/");
        let mut namespaces: Vec<Arc<str>> = Vec::new();
        for workload in self.under(&prefix) {
            if namespaces.last() != Some(&workload.namespace) {
                namespaces.push(workload.namespace.clone());
            }
        }
        namespaces
    }

    /// Replaces every WorkloadEntry's workload; returns the uids that changed.
    pub fn set_entries(&mut self, workloads: Vec<Workload>) -> Vec<Arc<str>> {
        let entries: imbl::OrdMap<Arc<str>, Arc<Workload>> = workloads
            .into_iter()
            .map(|w| (w.uid.clone(), Arc::new(w)))
            .collect();
        let mut changed: Vec<Arc<str>> = entries
            .iter()
            .filter(|(uid, w)| self.entries.get(*uid).map(|held| &**held) != Some(&***w))
            .map(|(uid, _)| uid.clone())
            .collect();
        let gone = self
            .entries
            .keys()
            .filter(|uid| !entries.contains_key(*uid));
        changed.extend(gone.cloned());
        for uid in &changed {
            if let Some(old) = self.entries.get(uid).cloned() {
                self.index(&old, false);
            }
            if let Some(new) = entries.get(uid).cloned() {
                self.index(&new, true);
            }
        }
        self.entries = entries;
        changed
    }

    /// Pods, then WorkloadEntries.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<Workload>> {
        self.by_uid.values().chain(self.entries.values())
    }

    pub fn get(&self, uid: &str) -> Option<&Arc<Workload>> {
        self.by_uid.get(uid).or_else(|| self.entries.get(uid))
    }

    pub fn len(&self) -> usize {
        self.by_uid.len() + self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn under(&self, prefix: &str) -> impl Iterator<Item = &Arc<Workload>> + '_ {
        let prefix: Arc<str> = Arc::from(prefix);
        self.by_uid
            .range(prefix.clone()..)
            .take_while(move |(uid, _)| uid.starts_with(&*prefix))
            .map(|(_, w)| w)
    }
}

impl MeshSnapshot {
    /// A cluster's network: that of its pods (the registry reads it from the system namespace's
    /// label or MeshNetworks), else MeshNetworks' `fromRegistry`.
    pub fn cluster_network(&self, cluster: &ClusterId) -> String {
        let of_pods = self.workloads.first_pod_of(cluster).map(|w| &*w.network);
        of_pods
            .or_else(|| self.networks.network_of_registry(cluster.as_str()))
            .unwrap_or_default()
            .to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(cluster: &str, namespace: &str, name: &str, ip: [u8; 4]) -> Workload {
        let cluster_id = ClusterId::new(cluster);
        Workload {
            uid: pod_uid(&cluster_id, namespace, name).into(),
            name: name.into(),
            namespace: namespace.into(),
            cluster_id,
            addresses: vec![IpAddr::from(ip)],
            network: "".into(),
            service_account: "default".into(),
            node: None,
            labels: Labels::default(),
            workload_name: name.into(),
            canonical_name: name.into(),
            canonical_revision: "latest".into(),
            locality: Arc::default(),
            healthy: true,
            capacity: None,
            captured: true,
            host_network: false,
            use_waypoint: None,
        }
    }

    #[test]
    fn a_namespace_is_replaced_alone_and_a_cluster_removed_whole() {
        let mut table = WorkloadTable::default();
        let c1 = ClusterId::new("c1");
        let x: Arc<str> = "c1//Pod/a/x".into();
        let changed = table.replace_namespace(&c1, "a", vec![pod("c1", "a", "x", [10, 0, 0, 1])]);
        assert_eq!(changed, vec![x.clone()]);
        let changed = table.replace_namespace(&c1, "ab", vec![pod("c1", "ab", "y", [10, 0, 0, 2])]);
        assert_eq!(changed.len(), 1);
        let c2 = ClusterId::new("c2");
        let changed = table.replace_namespace(&c2, "a", vec![pod("c2", "a", "x", [10, 0, 0, 3])]);
        assert_eq!(changed.len(), 1);
        // The same pods again change nothing; namespace "a" does not cover "ab".
        let same = table.replace_namespace(&c1, "a", vec![pod("c1", "a", "x", [10, 0, 0, 1])]);
        assert!(same.is_empty());
        assert_eq!(table.replace_namespace(&c1, "a", Vec::new()), vec![x]);
        assert_eq!(table.len(), 2);
        assert!(table.get("c1//Pod/ab/y").is_some());
        assert_eq!(table.namespaces_of(&c1), vec![Arc::<str>::from("ab")]);
        assert_eq!(table.remove_cluster(&c1).len(), 1);
        assert!(table.remove_cluster(&c1).is_empty());
        assert_eq!(table.len(), 1);
        assert!(table.get("c2//Pod/a/x").is_some());
    }

    #[test]
    fn a_pod_is_set_and_removed_alone() {
        let mut table = WorkloadTable::default();
        let x = pod("c1", "a", "x", [10, 0, 0, 1]);
        assert!(table.set("c1//Pod/a/x", Some(x.clone())));
        assert!(!table.set("c1//Pod/a/x", Some(x.clone())), "unchanged");
        let moved = Workload {
            healthy: false,
            ..x
        };
        assert!(table.set("c1//Pod/a/x", Some(moved)));
        assert!(!table.get("c1//Pod/a/x").unwrap().healthy);
        let ip = IpAddr::from([10, 0, 0, 1]);
        assert_eq!(&*table.at("", ip).unwrap().uid, "c1//Pod/a/x");
        assert!(table.at("other", ip).is_none());
        assert!(table.set("c1//Pod/a/x", None));
        assert!(!table.set("c1//Pod/a/x", None), "already gone");
        assert!(table.is_empty());
        assert!(table.at("", ip).is_none(), "its address is free again");

        // Host-network pods share their node's address: each is indexed until it goes.
        let (a, b) = (
            pod("c1", "a", "a", [10, 0, 0, 9]),
            pod("c1", "a", "b", [10, 0, 0, 9]),
        );
        table.set("c1//Pod/a/a", Some(a));
        table.set("c1//Pod/a/b", Some(b));
        let shared = IpAddr::from([10, 0, 0, 9]);
        assert_eq!(&*table.at("", shared).unwrap().uid, "c1//Pod/a/a");
        table.set("c1//Pod/a/a", None);
        assert_eq!(&*table.at("", shared).unwrap().uid, "c1//Pod/a/b");
    }
}
