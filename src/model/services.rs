//! The merged service table: one Service per hostname across every cluster.
//!
//! Istio's aggregate rule: the definition of the first cluster (in registry order) wins, and every
//! cluster's VIPs are kept under its cluster id. A value type: the mesh writer changes its copy and
//! publishes it in a snapshot; persistent maps make each copy cost O(1).

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use super::{ClusterId, Hostname, Service};

#[derive(Clone, Debug, Default)]
pub struct ServiceTable {
    /// Registry order: the config cluster first.
    order: Arc<[ClusterId]>,
    hosts: imbl::HashMap<Hostname, Arc<HostEntry>>,
    version: u64,
    /// Merged services with their own `exportTo`.
    explicit_exports: usize,
    /// Every merged service sorted by hostname, computed at most once per version.
    sorted: Arc<OnceLock<Arc<[Arc<Service>]>>>,
}

#[derive(Debug)]
struct HostEntry {
    per_cluster: BTreeMap<ClusterId, Arc<Service>>,
    merged: Arc<Service>,
}

impl ServiceTable {
    fn rank(&self, cluster: &ClusterId) -> usize {
        self.order
            .iter()
            .position(|c| c == cluster)
            .unwrap_or(usize::MAX)
    }

    fn merge(&self, per_cluster: &BTreeMap<ClusterId, Arc<Service>>) -> Option<Service> {
        let (_, first) = per_cluster.iter().min_by_key(|(c, _)| self.rank(c))?;
        let mut merged = Service::clone(first);
        merged.cluster_vips = per_cluster
            .values()
            .flat_map(|s| s.cluster_vips.iter())
            .map(|(c, vips)| (c.clone(), vips.clone()))
            .collect();
        Some(merged)
    }

    /// Recomputes a host's merged service; returns whether the published one changed.
    fn remerge(&mut self, host: &Hostname, per_cluster: BTreeMap<ClusterId, Arc<Service>>) -> bool {
        let current = self.hosts.get(host).map(|e| e.merged.clone());
        if current.as_ref().is_some_and(|c| !c.export_to.is_empty()) {
            self.explicit_exports -= 1;
        }
        let Some(merged) = self.merge(&per_cluster) else {
            let removed = self.hosts.remove(host).is_some();
            self.bump(removed);
            return removed;
        };
        if !merged.export_to.is_empty() {
            self.explicit_exports += 1;
        }
        let changed = current.as_ref().is_none_or(|c| **c != merged);
        let merged = match current {
            Some(c) if !changed => c,
            _ => Arc::new(merged),
        };
        self.hosts.insert(
            host.clone(),
            Arc::new(HostEntry {
                per_cluster,
                merged,
            }),
        );
        self.bump(changed);
        changed
    }

    fn bump(&mut self, changed: bool) {
        if changed {
            self.version += 1;
            self.sorted = Arc::default();
        }
    }

    /// Sets the registry order used to pick each host's definition; re-merges every host.
    pub fn set_order(&mut self, order: Vec<ClusterId>) -> Vec<Hostname> {
        self.order = order.into();
        let hosts: Vec<_> = self
            .hosts
            .iter()
            .map(|(h, e)| (h.clone(), e.per_cluster.clone()))
            .collect();
        hosts
            .into_iter()
            .filter_map(|(h, per)| self.remerge(&h, per).then_some(h))
            .collect()
    }

    /// Sets one cluster's definition of a service; returns whether the merged service changed.
    pub fn upsert(&mut self, cluster: &ClusterId, service: Service) -> bool {
        let host = service.hostname.clone();
        let mut per = self
            .hosts
            .get(&host)
            .map(|e| e.per_cluster.clone())
            .unwrap_or_default();
        if per.get(cluster).is_some_and(|s| **s == service) {
            return false;
        }
        per.insert(cluster.clone(), Arc::new(service));
        self.remerge(&host, per)
    }

    /// Removes one cluster's definition of a service; returns whether the merged service changed.
    pub fn remove(&mut self, cluster: &ClusterId, host: &Hostname) -> bool {
        let Some(entry) = self.hosts.get(host) else {
            return false;
        };
        if !entry.per_cluster.contains_key(cluster) {
            return false;
        }
        let mut per = entry.per_cluster.clone();
        per.remove(cluster);
        self.remerge(host, per)
    }

    /// Removes every definition a cluster contributed; returns the hosts whose merged service changed.
    pub fn remove_cluster(&mut self, cluster: &ClusterId) -> Vec<Hostname> {
        let hosts: Vec<_> = self
            .hosts
            .iter()
            .filter(|(_, e)| e.per_cluster.contains_key(cluster))
            .map(|(h, e)| {
                let mut per = e.per_cluster.clone();
                per.remove(cluster);
                (h.clone(), per)
            })
            .collect();
        hosts
            .into_iter()
            .filter_map(|(h, per)| self.remerge(&h, per).then_some(h))
            .collect()
    }

    pub fn get(&self, host: &str) -> Option<&Arc<Service>> {
        self.hosts.get(host).map(|e| &e.merged)
    }

    /// Every merged service, sorted by hostname.
    pub fn all(&self) -> Arc<[Arc<Service>]> {
        self.sorted
            .get_or_init(|| {
                let mut all: Vec<_> = self.hosts.values().map(|e| e.merged.clone()).collect();
                all.sort_by(|a, b| a.hostname.cmp(&b.hostname));
                all.into()
            })
            .clone()
    }

    pub fn len(&self) -> usize {
        self.hosts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.hosts.is_empty()
    }

    /// Every cluster's own definition of the services `wanted` picks.
    pub fn definitions(&self, wanted: impl Fn(&Service) -> bool) -> Vec<(ClusterId, Arc<Service>)> {
        self.hosts
            .values()
            .flat_map(|e| e.per_cluster.iter())
            .filter(|(_, s)| wanted(s))
            .map(|(c, s)| (c.clone(), s.clone()))
            .collect()
    }

    /// How many services limit who sees them (`exportTo`).
    pub fn explicit_exports(&self) -> usize {
        self.explicit_exports
    }

    /// Hosts this cluster defines.
    pub fn hosts_of(&self, cluster: &ClusterId) -> Vec<Hostname> {
        self.hosts
            .iter()
            .filter(|(_, e)| e.per_cluster.contains_key(cluster))
            .map(|(h, _)| h.clone())
            .collect()
    }

    /// Bumped on every change of any merged service.
    pub fn version(&self) -> u64 {
        self.version
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Protocol, Resolution, ServicePort};

    fn svc(cluster: &str, vip: &str, port: u16) -> Service {
        Service {
            hostname: "web.shop.svc.cluster.local".into(),
            name: "web".into(),
            namespace: "shop".into(),
            registry: crate::model::Registry::Kubernetes,
            ports: vec![ServicePort {
                name: "http".into(),
                port,
                protocol: Protocol::Http,
                target_port: None,
            }],
            cluster_vips: BTreeMap::from([(ClusterId::new(cluster), vec![vip.parse().unwrap()])]),
            labels: Default::default(),
            resolution: Resolution::ClientSideLb,
            dns_targets: vec![],
            external_addresses: vec![],
            mesh_external: false,
            export_to: vec![],
            subject_alt_names: vec![],
            auto_addresses: Vec::new(),
            use_waypoint: None,
        }
    }

    #[test]
    fn first_cluster_definition_wins_and_every_vip_is_kept() {
        let mut table = ServiceTable::default();
        table.set_order(vec![ClusterId::new("primary"), ClusterId::new("remote")]);
        assert!(table.upsert(&ClusterId::new("remote"), svc("remote", "10.2.0.1", 9090)));
        assert!(table.upsert(&ClusterId::new("primary"), svc("primary", "10.1.0.1", 80)));
        let merged = table.get("web.shop.svc.cluster.local").unwrap();
        assert_eq!(
            merged.ports[0].port, 80,
            "the config cluster's definition wins"
        );
        assert_eq!(merged.cluster_vips.len(), 2);
        assert_eq!(
            merged.cluster_vips[&ClusterId::new("remote")][0].to_string(),
            "10.2.0.1"
        );
    }

    #[test]
    fn removing_a_cluster_falls_back_to_the_next_definition() {
        let mut table = ServiceTable::default();
        table.set_order(vec![ClusterId::new("a"), ClusterId::new("b")]);
        table.upsert(&ClusterId::new("a"), svc("a", "10.1.0.1", 80));
        table.upsert(&ClusterId::new("b"), svc("b", "10.2.0.1", 8080));
        let v = table.version();
        assert_eq!(table.remove_cluster(&ClusterId::new("a")).len(), 1);
        assert!(table.version() > v);
        let merged = table.get("web.shop.svc.cluster.local").unwrap().clone();
        assert_eq!(merged.ports[0].port, 8080);
        assert_eq!(merged.cluster_vips.len(), 1);
        assert!(table.remove(&ClusterId::new("b"), &merged.hostname));
        assert!(table.get("web.shop.svc.cluster.local").is_none());
        assert!(table.all().is_empty());
    }

    #[test]
    fn unchanged_definition_is_not_a_change() {
        let mut table = ServiceTable::default();
        table.set_order(vec![ClusterId::new("a")]);
        assert!(table.upsert(&ClusterId::new("a"), svc("a", "10.1.0.1", 80)));
        let v = table.version();
        assert!(!table.upsert(&ClusterId::new("a"), svc("a", "10.1.0.1", 80)));
        assert_eq!(table.version(), v);
    }

    #[test]
    fn a_copy_is_unaffected_by_later_writes() {
        let mut table = ServiceTable::default();
        table.upsert(&ClusterId::new("a"), svc("a", "10.1.0.1", 80));
        let published = table.clone();
        assert_eq!(published.all().len(), 1);
        table.upsert(&ClusterId::new("a"), svc("a", "10.1.0.1", 81));
        assert_eq!(published.all()[0].ports[0].port, 80);
        assert_eq!(table.all()[0].ports[0].port, 81);
        assert!(table.version() > published.version());
    }
}
