//! EndpointShards: per service, one shard of endpoints per (registry provider, cluster).
//!
//! Writers build a new `EndpointShards` value beside the published one and swap it in under a write
//! lock held only for the pointer swap; readers clone an `Arc` under a read lock. No lock is held while
//! endpoints are compared, built, or pushed.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;
use serde::Serialize;

use super::{ClusterId, Endpoint, ServiceKey};

/// The kind of registry a shard came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum Provider {
    Kubernetes,
    File,
}

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

#[derive(Debug, Default)]
pub struct EndpointIndex {
    services: RwLock<HashMap<ServiceKey, Arc<EndpointShards>>>,
    /// Which service shards hold an address: finds the services a proxy's own workload serves.
    by_address: RwLock<HashMap<IpAddr, BTreeSet<(ServiceKey, ShardKey)>>>,
    version: AtomicU64,
    /// Bumped when a service appears, disappears or changes identities: what cluster TLS settings
    /// (SAN checks) depend on.
    identities: AtomicU64,
}

impl EndpointIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// The published endpoints of one service.
    pub fn get(&self, key: &ServiceKey) -> Option<Arc<EndpointShards>> {
        self.services.read().get(key).cloned()
    }

    /// Every service with its shards, sorted by key.
    pub fn snapshot(&self) -> Vec<(ServiceKey, Arc<EndpointShards>)> {
        let mut all: Vec<_> = self
            .services
            .read()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }

    pub fn identities_version(&self) -> u64 {
        self.identities.load(Ordering::Acquire)
    }

    /// Services with an endpoint at `address`, in any shard.
    pub fn services_at(&self, address: &IpAddr) -> Vec<ServiceKey> {
        let by_address = self.by_address.read();
        let mut keys: Vec<ServiceKey> = by_address
            .get(address)
            .into_iter()
            .flatten()
            .map(|(k, _)| k.clone())
            .collect();
        keys.dedup();
        keys
    }

    /// Number of endpoints held in one shard key across every service.
    pub fn count_endpoints(&self, shard: &ShardKey) -> usize {
        self.services
            .read()
            .values()
            .filter_map(|s| s.shards.get(shard))
            .map(|eps| eps.len())
            .sum()
    }

    /// Replaces one shard of a service. Endpoints are deduplicated on (IP, port name), keeping the
    /// healthiest. An empty list drops the shard but keeps the service known, as Istio does.
    pub fn update(&self, key: &ServiceKey, shard: &ShardKey, endpoints: Vec<Endpoint>) -> PushNeed {
        let endpoints = canonical(endpoints);
        self.swap(key, shard, |old| match old {
            None if endpoints.is_empty() => None,
            None => {
                let next = EndpointShards::default().with_shard(shard, Some(endpoints.clone()));
                Some((Some(next), PushNeed::Full))
            }
            Some(old) => {
                let unchanged = match old.shards.get(shard) {
                    Some(current) => **current == *endpoints,
                    None => endpoints.is_empty(),
                };
                if unchanged {
                    return None;
                }
                let eps = (!endpoints.is_empty()).then(|| endpoints.clone());
                let next = old.with_shard(shard, eps);
                let need = if next.service_accounts != old.service_accounts {
                    PushNeed::Full
                } else {
                    PushNeed::Eds
                };
                Some((Some(next), need))
            }
        })
    }

    /// Removes one cluster's shard of one service (the service was deleted there). The service leaves
    /// the index once no shard is left.
    pub fn delete_service_shard(&self, key: &ServiceKey, shard: &ShardKey) -> PushNeed {
        self.swap(key, shard, |old| {
            let old = old?;
            old.shards.get(shard)?;
            let next = old.with_shard(shard, None);
            if next.shards.is_empty() {
                return Some((None, PushNeed::Full));
            }
            let need = if next.service_accounts != old.service_accounts {
                PushNeed::Full
            } else {
                PushNeed::Eds
            };
            Some((Some(next), need))
        })
    }

    /// Removes a cluster's shard from every service; returns the services that lost endpoints.
    pub fn delete_cluster(&self, shard: &ShardKey) -> Vec<ServiceKey> {
        let mut services = self.services.write();
        let touched: Vec<ServiceKey> = services
            .iter()
            .filter(|(_, s)| s.shards.contains_key(shard))
            .map(|(k, _)| k.clone())
            .collect();
        let mut dropped = Vec::new();
        for key in &touched {
            let Some(old) = services.get(key) else {
                continue;
            };
            if let Some(eps) = old.shards.get(shard) {
                dropped.push((key.clone(), eps.clone()));
            }
            let mut next = old.with_shard(shard, None);
            if next.shards.is_empty() {
                services.remove(key);
            } else {
                next.version = self.next_version();
                services.insert(key.clone(), Arc::new(next));
            }
        }
        drop(services);
        if !touched.is_empty() {
            self.identities.fetch_add(1, Ordering::AcqRel);
        }
        for (key, eps) in dropped {
            self.reindex(&key, shard, Some(&eps[..]), None);
        }
        touched
    }

    /// Copy-on-write step: `change` sees the published value and returns the replacement (None to
    /// remove) with the push it needs, or None for no change. Retries if another writer won the race.
    fn swap(
        &self,
        key: &ServiceKey,
        shard: &ShardKey,
        change: impl Fn(Option<&Arc<EndpointShards>>) -> Option<(Option<EndpointShards>, PushNeed)>,
    ) -> PushNeed {
        loop {
            let old = self.get(key);
            let Some((next, need)) = change(old.as_ref()) else {
                return PushNeed::None;
            };
            let next = next.map(|mut n| {
                n.version = self.next_version();
                Arc::new(n)
            });
            let mut services = self.services.write();
            let current = services.get(key);
            let same = match (current, &old) {
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                (None, None) => true,
                _ => false,
            };
            if !same {
                continue;
            }
            let added = next.as_ref().and_then(|n| n.shards.get(shard)).cloned();
            match next {
                Some(n) => services.insert(key.clone(), n),
                None => services.remove(key),
            };
            drop(services);
            if need == PushNeed::Full {
                self.identities.fetch_add(1, Ordering::AcqRel);
            }
            let removed = old.as_ref().and_then(|o| o.shards.get(shard)).cloned();
            self.reindex(key, shard, removed.as_deref(), added.as_deref());
            return need;
        }
    }

    /// Moves a shard's addresses in the address index from `old` to `new`.
    fn reindex(
        &self,
        key: &ServiceKey,
        shard: &ShardKey,
        old: Option<&[Endpoint]>,
        new: Option<&[Endpoint]>,
    ) {
        let addrs = |eps: Option<&[Endpoint]>| -> BTreeSet<IpAddr> {
            eps.into_iter().flatten().map(|e| e.address).collect()
        };
        let (old, new) = (addrs(old), addrs(new));
        if old == new {
            return;
        }
        let entry = (key.clone(), shard.clone());
        let mut by_address = self.by_address.write();
        for ip in old.difference(&new) {
            if let Some(set) = by_address.get_mut(ip) {
                set.remove(&entry);
                if set.is_empty() {
                    by_address.remove(ip);
                }
            }
        }
        for ip in new.difference(&old) {
            by_address.entry(*ip).or_default().insert(entry.clone());
        }
    }

    fn next_version(&self) -> u64 {
        self.version.fetch_add(1, Ordering::Relaxed) + 1
    }
}

/// Sorts by (IP, port name) and keeps the healthiest of duplicates, so equal sets compare equal.
fn canonical(mut endpoints: Vec<Endpoint>) -> Arc<[Endpoint]> {
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
            locality: Locality::default(),
            cluster_id: ClusterId::new(cluster),
            tls_mode: TlsMode::Istio,
            health: Health::Healthy,
            workload: "".into(),
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
        let index = EndpointIndex::new();
        assert_eq!(
            index.update(&key(), &shard("c1"), vec![ep("10.0.0.1", "sa1", "c1")]),
            PushNeed::Full
        );
    }

    #[test]
    fn endpoint_added_removed_or_changed_needs_eds_only() {
        let index = EndpointIndex::new();
        index.update(&key(), &shard("c1"), vec![ep("10.0.0.1", "sa1", "c1")]);
        let two = vec![ep("10.0.0.1", "sa1", "c1"), ep("10.0.0.2", "sa1", "c1")];
        assert_eq!(index.update(&key(), &shard("c1"), two), PushNeed::Eds);
        let mut changed = ep("10.0.0.2", "sa1", "c1");
        changed.health = Health::Unhealthy;
        let two = vec![ep("10.0.0.1", "sa1", "c1"), changed];
        assert_eq!(index.update(&key(), &shard("c1"), two), PushNeed::Eds);
        assert_eq!(
            index.update(&key(), &shard("c1"), vec![ep("10.0.0.1", "sa1", "c1")]),
            PushNeed::Eds
        );
    }

    #[test]
    fn same_endpoints_in_another_order_need_nothing() {
        let index = EndpointIndex::new();
        let eps = vec![ep("10.0.0.1", "sa1", "c1"), ep("10.0.0.2", "sa1", "c1")];
        index.update(&key(), &shard("c1"), eps.clone());
        let reversed: Vec<_> = eps.into_iter().rev().collect();
        assert_eq!(index.update(&key(), &shard("c1"), reversed), PushNeed::None);
    }

    #[test]
    fn service_account_change_needs_a_full_push() {
        let index = EndpointIndex::new();
        index.update(&key(), &shard("c1"), vec![ep("10.0.0.1", "sa1", "c1")]);
        let eps = vec![ep("10.0.0.1", "sa1", "c1"), ep("10.0.0.2", "sa2", "c1")];
        assert_eq!(index.update(&key(), &shard("c1"), eps), PushNeed::Full);
        // The same identity arriving from another cluster does not change the set.
        assert_eq!(
            index.update(&key(), &shard("c2"), vec![ep("10.1.0.1", "sa2", "c2")]),
            PushNeed::Eds
        );
    }

    #[test]
    fn duplicates_keep_the_healthiest() {
        let index = EndpointIndex::new();
        let mut sick = ep("10.0.0.1", "sa1", "c1");
        sick.health = Health::Unhealthy;
        index.update(
            &key(),
            &shard("c1"),
            vec![sick, ep("10.0.0.1", "sa1", "c1")],
        );
        let shards = index.get(&key()).unwrap();
        let eps: Vec<_> = shards.endpoints().collect();
        assert_eq!(eps.len(), 1);
        assert_eq!(eps[0].health, Health::Healthy);
    }

    #[test]
    fn empty_update_drops_the_shard_but_keeps_the_service() {
        let index = EndpointIndex::new();
        index.update(&key(), &shard("c1"), vec![ep("10.0.0.1", "sa1", "c1")]);
        assert_eq!(index.update(&key(), &shard("c1"), vec![]), PushNeed::Full);
        let shards = index.get(&key()).expect("service stays known");
        assert!(shards.shards.is_empty());
        // Coming back is not a new service.
        assert_eq!(
            index.update(&key(), &shard("c1"), vec![ep("10.0.0.1", "", "c1")]),
            PushNeed::Eds
        );
        // Empty endpoints of an unknown service create nothing.
        let other = ServiceKey {
            hostname: "b.ns.svc.cluster.local".into(),
            namespace: "ns".into(),
        };
        assert_eq!(index.update(&other, &shard("c1"), vec![]), PushNeed::None);
        assert!(index.get(&other).is_none());
    }

    #[test]
    fn deleting_a_service_shard_keeps_other_clusters() {
        let index = EndpointIndex::new();
        index.update(&key(), &shard("c1"), vec![ep("10.0.0.1", "sa1", "c1")]);
        index.update(&key(), &shard("c2"), vec![ep("10.1.0.1", "sa1", "c2")]);
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
        let index = EndpointIndex::new();
        let other = ServiceKey {
            hostname: "b.ns.svc.cluster.local".into(),
            namespace: "ns".into(),
        };
        index.update(&key(), &shard("c1"), vec![ep("10.0.0.1", "sa1", "c1")]);
        index.update(&key(), &shard("c2"), vec![ep("10.1.0.1", "sa1", "c2")]);
        index.update(&other, &shard("c2"), vec![ep("10.1.0.2", "sa1", "c2")]);
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

    #[test]
    fn concurrent_writers_on_one_service_lose_nothing() {
        let index = Arc::new(EndpointIndex::new());
        let threads: Vec<_> = (0..8)
            .map(|i| {
                let index = index.clone();
                std::thread::spawn(move || {
                    for n in 0..50 {
                        let ip = format!("10.{i}.0.{n}");
                        index.update(&key(), &shard(&format!("c{i}")), vec![ep(&ip, "sa", "c")]);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(index.get(&key()).unwrap().shards.len(), 8);
    }
}
