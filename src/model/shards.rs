//! EndpointShards: per service, one shard of endpoints per (registry provider, cluster).
//!
//! Each service's shards are an immutable `EndpointShards` replaced whole on change, so a published
//! snapshot never sees a half-applied update.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use serde::Serialize;

use super::{ClusterId, Endpoint, Hostname, ServiceKey, TlsMode};

/// The kind of registry a shard came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum Provider {
    Kubernetes,
    File,
    /// ServiceEntries and WorkloadEntries (Istio's name for that registry).
    External,
}

/// The pseudo cluster of pods of headless services served as services of their own
/// (`registry/pod_services`); their endpoints keep their real cluster (ids of real clusters cannot
/// start with '~').
pub const PODS_CLUSTER: &str = "~pods";

/// Which registry owns a shard. Printed as Istio does: `provider/cluster`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ShardKey {
    pub provider: Provider,
    pub cluster: ClusterId,
}

impl fmt::Display for ShardKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}/{}", self.provider, self.cluster)
    }
}

/// What a change to the index requires of the proxies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum PushNeed {
    /// Nothing observable changed.
    None,
    /// Only endpoint assignments changed: an EDS push for this service.
    Eds,
    /// The service is new or its service-account set changed (it appears in cluster TLS settings).
    Full,
}

/// All endpoints of one service, by shard. Immutable once published.
#[derive(Clone, Debug, Default)]
pub struct EndpointShards {
    pub shards: BTreeMap<ShardKey, Arc<[Endpoint]>>,
    /// SPIFFE identities of every endpoint in every shard.
    pub service_accounts: BTreeSet<Arc<str>>,
    /// Index-wide version of the last change to this service; keys caches of generated resources.
    pub version: u64,
}

impl EndpointShards {
    /// The merged endpoints of every shard, in shard order.
    pub fn endpoints(&self) -> impl Iterator<Item = &Endpoint> {
        self.shards.values().flat_map(|eps| eps.iter())
    }

    /// Each port's TLS modes: whether clients can originate mTLS to a port's pods themselves
    /// (an ORIGINAL_DST cluster) follows them.
    pub fn port_tls_modes(&self) -> BTreeSet<(&str, TlsMode)> {
        self.endpoints()
            .map(|ep| (&*ep.service_port_name, ep.tls_mode))
            .collect()
    }

    fn with_shard(&self, shard: &ShardKey, endpoints: Option<Arc<[Endpoint]>>) -> Self {
        let mut shards = self.shards.clone();
        match endpoints {
            Some(eps) => shards.insert(shard.clone(), eps),
            None => shards.remove(shard),
        };
        let service_accounts = shards
            .values()
            .flat_map(|eps| eps.iter())
            .filter(|ep| !ep.service_account.is_empty())
            .map(|ep| ep.service_account.clone())
            .collect();
        Self {
            shards,
            service_accounts,
            version: self.version,
        }
    }
}

/// Every service's endpoint shards, and which services hold an address. A value type published in
/// mesh snapshots; persistent maps make each copy cost O(1) and each write O(log n).
#[derive(Clone, Debug, Default)]
pub struct EndpointIndex {
    services: imbl::HashMap<ServiceKey, Arc<EndpointShards>>,
    /// Which service shards hold an address: finds the services a proxy's own workload serves.
    /// Sorted; nearly always one entry, which a tree set would keep in a node of eleven. A B-tree
    /// rather than a hash trie: its nodes stay full, where the trie's deep leaves held a few entries
    /// each (170 bytes per address at 100,000 addresses).
    by_address: imbl::OrdMap<IpAddr, Arc<[(ServiceKey, ShardKey)]>>,
    /// Source of `EndpointShards::version`: never repeats, so it can key caches.
    last_version: u64,
    /// Bumped when a service appears, disappears or changes identities: what cluster TLS settings
    /// (SAN checks) depend on.
    identities: u64,
}

impl EndpointIndex {
    /// The published endpoints of one service.
    pub fn get(&self, key: &ServiceKey) -> Option<&Arc<EndpointShards>> {
        self.services.get(key)
    }

    /// Every service with its shards, sorted by key.
    pub fn sorted(&self) -> Vec<(ServiceKey, Arc<EndpointShards>)> {
        let mut all: Vec<_> = self
            .services
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }

    /// Hostnames of every service with endpoints.
    pub fn hostnames(&self) -> impl Iterator<Item = &Hostname> {
        self.services.keys().map(|k| &k.hostname)
    }

    /// Moves with every change to any endpoint.
    pub fn version(&self) -> u64 {
        self.last_version
    }

    pub fn identities_version(&self) -> u64 {
        self.identities
    }

    /// Services with an endpoint at `address`, in any shard.
    pub fn services_at(&self, address: &IpAddr) -> Vec<ServiceKey> {
        let mut keys: Vec<ServiceKey> = self
            .by_address
            .get(address)
            .into_iter()
            .flat_map(|set| set.iter())
            .map(|(k, _)| k.clone())
            .collect();
        keys.dedup();
        keys
    }

    /// Whether one of `hosts` has an endpoint at `address`.
    pub fn serves_at(&self, address: &IpAddr, hosts: &BTreeSet<Hostname>) -> bool {
        let held = self.by_address.get(address);
        held.is_some_and(|held| held.iter().any(|(k, _)| hosts.contains(&k.hostname)))
    }

    /// Every shard key of a provider in use.
    pub fn shards_of(&self, provider: Provider) -> Vec<ShardKey> {
        let keys: BTreeSet<ShardKey> = self
            .services
            .values()
            .flat_map(|s| s.shards.keys())
            .filter(|k| k.provider == provider)
            .cloned()
            .collect();
        keys.into_iter().collect()
    }

    /// The services holding a shard of this key.
    pub fn keys_in(&self, shard: &ShardKey) -> Vec<ServiceKey> {
        self.services
            .iter()
            .filter(|(_, s)| s.shards.contains_key(shard))
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// Number of endpoints held in one shard key across every service.
    pub fn count_endpoints(&self, shard: &ShardKey) -> usize {
        self.services
            .values()
            .filter_map(|s| s.shards.get(shard))
            .map(|eps| eps.len())
            .sum()
    }

    /// Replaces one shard of a service with endpoints made [`canonical`]. An empty list drops the
    /// shard but keeps the service known, as Istio does.
    pub fn update(
        &mut self,
        key: &ServiceKey,
        shard: &ShardKey,
        endpoints: Arc<[Endpoint]>,
    ) -> PushNeed {
        let old = self.services.get(key).cloned();
        let (next, need) = match &old {
            None if endpoints.is_empty() => return PushNeed::None,
            None => (
                EndpointShards::default().with_shard(shard, Some(endpoints)),
                PushNeed::Full,
            ),
            Some(old) => {
                let unchanged = match old.shards.get(shard) {
                    Some(current) => **current == *endpoints,
                    None => endpoints.is_empty(),
                };
                if unchanged {
                    return PushNeed::None;
                }
                let eps = (!endpoints.is_empty()).then_some(endpoints);
                let next = old.with_shard(shard, eps);
                let need = identity_need(old, &next);
                (next, need)
            }
        };
        self.replace(key, shard, old.as_deref(), Some(next), need);
        need
    }

    /// Removes one cluster's shard of one service (the service was deleted there). The service leaves
    /// the index once no shard is left.
    pub fn delete_service_shard(&mut self, key: &ServiceKey, shard: &ShardKey) -> PushNeed {
        let Some(old) = self.services.get(key).cloned() else {
            return PushNeed::None;
        };
        if !old.shards.contains_key(shard) {
            return PushNeed::None;
        }
        let next = old.with_shard(shard, None);
        let (next, need) = match next.shards.is_empty() {
            true => (None, PushNeed::Full),
            false => {
                let need = identity_need(&old, &next);
                (Some(next), need)
            }
        };
        self.replace(key, shard, Some(&old), next, need);
        need
    }

    /// Removes a cluster's shard from every service; returns the services that lost endpoints.
    pub fn delete_cluster(&mut self, shard: &ShardKey) -> Vec<ServiceKey> {
        let touched: Vec<ServiceKey> = self
            .services
            .iter()
            .filter(|(_, s)| s.shards.contains_key(shard))
            .map(|(k, _)| k.clone())
            .collect();
        for key in &touched {
            self.delete_service_shard(key, shard);
        }
        touched
    }

    /// Publishes `next` for a service (None removes it) and moves the shard's addresses in the
    /// address index.
    fn replace(
        &mut self,
        key: &ServiceKey,
        shard: &ShardKey,
        old: Option<&EndpointShards>,
        next: Option<EndpointShards>,
        need: PushNeed,
    ) {
        let added = next.as_ref().and_then(|n| n.shards.get(shard)).cloned();
        self.last_version += 1;
        match next {
            Some(mut n) => {
                n.version = self.last_version;
                self.services.insert(key.clone(), Arc::new(n));
            }
            None => {
                self.services.remove(key);
            }
        }
        if need == PushNeed::Full {
            self.identities += 1;
        }
        let removed = old.and_then(|o| o.shards.get(shard)).cloned();
        self.reindex(key, shard, removed.as_deref(), added.as_deref());
    }

    fn reindex(
        &mut self,
        key: &ServiceKey,
        shard: &ShardKey,
        old: Option<&[Endpoint]>,
        new: Option<&[Endpoint]>,
    ) {
        let addrs = |eps: Option<&[Endpoint]>| -> BTreeSet<IpAddr> {
            eps.into_iter().flatten().map(|e| e.address).collect()
        };
        let (old, new) = (addrs(old), addrs(new));
        let entry = (key.clone(), shard.clone());
        for ip in old.difference(&new) {
            if let Some(held) = self.by_address.get(ip) {
                let rest: Vec<_> = held.iter().filter(|e| **e != entry).cloned().collect();
                match rest.is_empty() {
                    true => self.by_address.remove(ip),
                    false => self.by_address.insert(*ip, rest.into()),
                };
            }
        }
        // Nearly every address holds only this entry: those share one list.
        let alone: Arc<[(ServiceKey, ShardKey)]> = Arc::from([entry.clone()]);
        for ip in new.difference(&old) {
            let held = match self.by_address.get(ip) {
                None => alone.clone(),
                Some(held) => {
                    let mut held = held.to_vec();
                    if let Err(at) = held.binary_search(&entry) {
                        held.insert(at, entry.clone());
                    }
                    held.into()
                }
            };
            self.by_address.insert(*ip, held);
        }
    }
}

/// A service whose set of identities changed needs a full push (they appear in cluster TLS settings).
fn identity_need(old: &EndpointShards, next: &EndpointShards) -> PushNeed {
    if next.service_accounts != old.service_accounts {
        PushNeed::Full
    } else {
        PushNeed::Eds
    }
}

/// Sorts by (IP, port name) and keeps the healthiest of duplicates, so equal sets compare equal.
/// Registries call it before taking the mesh's writer lock.
pub fn canonical(mut endpoints: Vec<Endpoint>) -> Arc<[Endpoint]> {
    endpoints.sort_by(|a, b| a.key().cmp(&b.key()).then(a.health.cmp(&b.health)));
    endpoints.dedup_by(|later, first| later.key() == first.key());
    endpoints.into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Health, Locality, TlsMode};

    fn ep(ip: &str, sa: &str, cluster: &str) -> Endpoint {
        Endpoint {
            address: ip.parse().unwrap(),
            port: 8080,
            service_port_name: "http".into(),
            labels: Default::default(),
            service_account: sa.into(),
            network: "".into(),
            locality: Locality::default().into(),
            cluster_id: ClusterId::new(cluster),
            tls_mode: TlsMode::Istio,
            health: Health::Healthy,
            workload: "".into(),
            weight: 1,
            hostname: None,
        }
    }

    fn key() -> ServiceKey {
        ServiceKey {
            hostname: "a.ns.svc.cluster.local".into(),
            namespace: "ns".into(),
        }
    }

    fn shard(cluster: &str) -> ShardKey {
        ShardKey {
            provider: Provider::Kubernetes,
            cluster: ClusterId::new(cluster),
        }
    }

    #[test]
    fn first_endpoints_of_a_service_need_a_full_push() {
        let mut index = EndpointIndex::default();
        assert_eq!(
            index.update(
                &key(),
                &shard("c1"),
                canonical(vec![ep("10.0.0.1", "sa1", "c1")])
            ),
            PushNeed::Full
        );
    }

    #[test]
    fn endpoint_added_removed_or_changed_needs_eds_only() {
        let mut index = EndpointIndex::default();
        index.update(
            &key(),
            &shard("c1"),
            canonical(vec![ep("10.0.0.1", "sa1", "c1")]),
        );
        let two = vec![ep("10.0.0.1", "sa1", "c1"), ep("10.0.0.2", "sa1", "c1")];
        assert_eq!(
            index.update(&key(), &shard("c1"), canonical(two)),
            PushNeed::Eds
        );
        let mut changed = ep("10.0.0.2", "sa1", "c1");
        changed.health = Health::Unhealthy;
        let two = vec![ep("10.0.0.1", "sa1", "c1"), changed];
        assert_eq!(
            index.update(&key(), &shard("c1"), canonical(two)),
            PushNeed::Eds
        );
        assert_eq!(
            index.update(
                &key(),
                &shard("c1"),
                canonical(vec![ep("10.0.0.1", "sa1", "c1")])
            ),
            PushNeed::Eds
        );
    }

    #[test]
    fn same_endpoints_in_another_order_need_nothing() {
        let mut index = EndpointIndex::default();
        let eps = vec![ep("10.0.0.1", "sa1", "c1"), ep("10.0.0.2", "sa1", "c1")];
        index.update(&key(), &shard("c1"), canonical(eps.clone()));
        let reversed: Vec<_> = eps.into_iter().rev().collect();
        assert_eq!(
            index.update(&key(), &shard("c1"), canonical(reversed)),
            PushNeed::None
        );
    }

    #[test]
    fn service_account_change_needs_a_full_push() {
        let mut index = EndpointIndex::default();
        index.update(
            &key(),
            &shard("c1"),
            canonical(vec![ep("10.0.0.1", "sa1", "c1")]),
        );
        let eps = vec![ep("10.0.0.1", "sa1", "c1"), ep("10.0.0.2", "sa2", "c1")];
        assert_eq!(
            index.update(&key(), &shard("c1"), canonical(eps)),
            PushNeed::Full
        );
        // The same identity arriving from another cluster does not change the set.
        assert_eq!(
            index.update(
                &key(),
                &shard("c2"),
                canonical(vec![ep("10.1.0.1", "sa2", "c2")])
            ),
            PushNeed::Eds
        );
    }

    #[test]
    fn duplicates_keep_the_healthiest() {
        let mut index = EndpointIndex::default();
        let mut sick = ep("10.0.0.1", "sa1", "c1");
        sick.health = Health::Unhealthy;
        index.update(
            &key(),
            &shard("c1"),
            canonical(vec![sick, ep("10.0.0.1", "sa1", "c1")]),
        );
        let shards = index.get(&key()).unwrap();
        let eps: Vec<_> = shards.endpoints().collect();
        assert_eq!(eps.len(), 1);
        assert_eq!(eps[0].health, Health::Healthy);
    }

    #[test]
    fn empty_update_drops_the_shard_but_keeps_the_service() {
        let mut index = EndpointIndex::default();
        index.update(
            &key(),
            &shard("c1"),
            canonical(vec![ep("10.0.0.1", "sa1", "c1")]),
        );
        assert_eq!(
            index.update(&key(), &shard("c1"), canonical(vec![])),
            PushNeed::Full
        );
        let shards = index.get(&key()).expect("service stays known");
        assert!(shards.shards.is_empty());
        // Coming back is not a new service.
        assert_eq!(
            index.update(
                &key(),
                &shard("c1"),
                canonical(vec![ep("10.0.0.1", "", "c1")])
            ),
            PushNeed::Eds
        );
        // Empty endpoints of an unknown service create nothing.
        let other = ServiceKey {
            hostname: "b.ns.svc.cluster.local".into(),
            namespace: "ns".into(),
        };
        assert_eq!(
            index.update(&other, &shard("c1"), canonical(vec![])),
            PushNeed::None
        );
        assert!(index.get(&other).is_none());
    }

    #[test]
    fn deleting_a_service_shard_keeps_other_clusters() {
        let mut index = EndpointIndex::default();
        index.update(
            &key(),
            &shard("c1"),
            canonical(vec![ep("10.0.0.1", "sa1", "c1")]),
        );
        index.update(
            &key(),
            &shard("c2"),
            canonical(vec![ep("10.1.0.1", "sa1", "c2")]),
        );
        assert_eq!(
            index.delete_service_shard(&key(), &shard("c1")),
            PushNeed::Eds
        );
        assert_eq!(
            index.delete_service_shard(&key(), &shard("c1")),
            PushNeed::None
        );
        assert_eq!(index.get(&key()).unwrap().endpoints().count(), 1);
        assert_eq!(
            index.delete_service_shard(&key(), &shard("c2")),
            PushNeed::Full
        );
        assert!(index.get(&key()).is_none());
    }

    #[test]
    fn deleting_a_cluster_removes_its_shards_everywhere() {
        let mut index = EndpointIndex::default();
        let other = ServiceKey {
            hostname: "b.ns.svc.cluster.local".into(),
            namespace: "ns".into(),
        };
        index.update(
            &key(),
            &shard("c1"),
            canonical(vec![ep("10.0.0.1", "sa1", "c1")]),
        );
        index.update(
            &key(),
            &shard("c2"),
            canonical(vec![ep("10.1.0.1", "sa1", "c2")]),
        );
        index.update(
            &other,
            &shard("c2"),
            canonical(vec![ep("10.1.0.2", "sa1", "c2")]),
        );
        let v_before = index.get(&key()).unwrap().version;
        let mut touched = index.delete_cluster(&shard("c2"));
        touched.sort();
        assert_eq!(touched, vec![key(), other.clone()]);
        assert!(index.get(&other).is_none());
        let remaining = index.get(&key()).unwrap();
        assert!(remaining.version > v_before);
        assert!(remaining.endpoints().all(|e| e.cluster_id.as_str() == "c1"));
        assert_eq!(index.count_endpoints(&shard("c2")), 0);
        assert!(index.services_at(&"10.1.0.2".parse().unwrap()).is_empty());
        assert_eq!(index.services_at(&"10.0.0.1".parse().unwrap()), vec![key()]);
        assert_eq!(index.count_endpoints(&shard("c1")), 1);
    }
}
