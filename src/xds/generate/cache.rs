//! Built resources, kept for reuse: each distinct resource is built and encoded once per set of
//! versions it was read from and per proxy traits, however many proxies ask for it at once; the
//! wildcard lists made of them likewise. Bounded in entries (proxies choose their traits).

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::{Mutex, RwLock};
use prometheus::IntGauge;

use crate::xds::protocol::ResourceType;
use crate::xds::wire::{Resource, SharedList};

/// Snapshot versions an entry was built from, read from the same snapshot the entry is built from,
/// so an entry is never stamped with versions newer than its content.
/// Slots: service table, the service's shards or the identity set, gateways, config (rules and mesh).
type Stamp = [u64; 4];

struct CacheEntry<T> {
    stamp: Stamp,
    cell: Arc<Cell<T>>,
    /// When the entry was last asked for (a tick of its `Sharded`): the least recent go first.
    used: AtomicU64,
}

/// An entry's value, built once, and the value it replaces until then (for whichever thread
/// builds it).
struct Cell<T> {
    value: OnceLock<T>,
    replaced: Mutex<Option<T>>,
}

impl<T> Cell<T> {
    fn replacing(replaced: Option<T>) -> Arc<Self> {
        Arc::new(Self {
            value: OnceLock::new(),
            replaced: Mutex::new(replaced),
        })
    }
}

/// Entries by (type, proxy traits) then name, so a lookup by `&str` allocates nothing.
type ByTraits<T> = HashMap<(ResourceType, u64), HashMap<Arc<str>, CacheEntry<T>>>;

/// One lock's share of the cache, and how many entries it holds.
struct Shard<T> {
    entries: ByTraits<T>,
    len: usize,
}

impl<T> Default for Shard<T> {
    fn default() -> Self {
        Self {
            entries: HashMap::new(),
            len: 0,
        }
    }
}

/// Lock shards: concurrent misses of different resources insert under different locks.
const SHARDS: usize = 16;

/// Entries the cache keeps by default. Proxies' traits (namespace, cluster, network, locality…)
/// are theirs to choose on the plaintext port, so the variants of a resource are not bounded by the
/// mesh; the cache is: past its capacity, the least recently used eighth of a shard goes. Above
/// every mesh measured (BENCHMARKS.md).
pub const DEFAULT_CACHE_ENTRIES: usize = 1 << 19;

struct Sharded<T> {
    shards: [RwLock<Shard<T>>; SHARDS],
    /// A clock for `CacheEntry::used`.
    tick: AtomicU64,
    /// Entries per shard.
    capacity: usize,
    /// Where the entry count is published.
    size: IntGauge,
}

impl<T> Sharded<T> {
    fn with_capacity(entries: usize, size: IntGauge) -> Self {
        Self {
            shards: std::array::from_fn(|_| RwLock::default()),
            tick: AtomicU64::new(0),
            capacity: (entries / SHARDS).max(8),
            size,
        }
    }
}

impl<T: Clone> Sharded<T> {
    fn shard(&self, ty: ResourceType, variant: u64, name: &str) -> &RwLock<Shard<T>> {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (ty, variant, name).hash(&mut h);
        &self.shards[h.finish() as usize % SHARDS]
    }

    /// The entry's value for `stamp`, built at most once however many proxies ask at the same time.
    /// The build is handed the value it replaces, if any.
    fn get_or_build(
        &self,
        ty: ResourceType,
        name: &str,
        variant: u64,
        stamp: Stamp,
        build: impl FnOnce(Option<T>) -> T,
    ) -> T {
        let now = self.tick.fetch_add(1, Ordering::Relaxed);
        let shard = self.shard(ty, variant, name);
        let hit = shard
            .read()
            .entries
            .get(&(ty, variant))
            .and_then(|m| m.get(name))
            .filter(|e| e.stamp == stamp)
            .map(|e| {
                e.used.store(now, Ordering::Relaxed);
                e.cell.clone()
            });
        let cell = match hit {
            Some(cell) => cell,
            None => {
                let mut shard = shard.write();
                let known = shard
                    .entries
                    .get(&(ty, variant))
                    .is_some_and(|m| m.contains_key(name));
                if !known {
                    if shard.len >= self.capacity {
                        let evicted = evict(&mut shard, self.capacity / 8);
                        self.size.sub(evicted as i64);
                    }
                    shard.len += 1;
                    self.size.inc();
                }
                let by_name = shard.entries.entry((ty, variant)).or_default();
                let entry = by_name
                    .entry(Arc::from(name))
                    .or_insert_with(|| CacheEntry {
                        stamp,
                        cell: Cell::replacing(None),
                        used: AtomicU64::new(now),
                    });
                entry.used.store(now, Ordering::Relaxed);
                if entry.stamp != stamp {
                    let cell = &entry.cell;
                    let replaced = cell
                        .value
                        .get()
                        .cloned()
                        .or_else(|| cell.replaced.lock().take());
                    entry.stamp = stamp;
                    entry.cell = Cell::replacing(replaced);
                }
                entry.cell.clone()
            }
        };
        if let Some(value) = cell.value.get() {
            return value.clone();
        }
        // Concurrent pushes needing the same entry wait for the one build instead of repeating it.
        off_worker(|| {
            cell.value
                .get_or_init(|| {
                    // Taken before building, so no lock is held while the build runs.
                    let replaced = cell.replaced.lock().take();
                    build(replaced)
                })
                .clone()
        })
    }

    fn retain(&self, keep: impl Fn(&Stamp) -> bool) {
        for shard in &self.shards {
            let mut shard = shard.write();
            for by_name in shard.entries.values_mut() {
                by_name.retain(|_, e| keep(&e.stamp));
            }
            shard.entries.retain(|_, by_name| !by_name.is_empty());
            let now: usize = shard.entries.values().map(HashMap::len).sum();
            let before = std::mem::replace(&mut shard.len, now);
            self.size.sub((before - now) as i64);
        }
    }

    fn len(&self) -> usize {
        self.shards.iter().map(|s| s.read().len).sum()
    }
}

/// Removes the `count` least recently used entries of a shard; returns how many went.
fn evict<T>(shard: &mut Shard<T>, count: usize) -> usize {
    let mut ages: Vec<u64> = (shard.entries.values())
        .flat_map(|by_name| by_name.values().map(|e| e.used.load(Ordering::Relaxed)))
        .collect();
    let Some(cut) = count.checked_sub(1).and_then(|i| {
        let i = i.min(ages.len().checked_sub(1)?);
        Some(*ages.select_nth_unstable(i).1)
    }) else {
        return 0;
    };
    for by_name in shard.entries.values_mut() {
        by_name.retain(|_, e| e.used.load(Ordering::Relaxed) > cut);
    }
    shard.entries.retain(|_, by_name| !by_name.is_empty());
    let now: usize = shard.entries.values().map(HashMap::len).sum();
    std::mem::replace(&mut shard.len, now) - now
}

/// Runs a build that may take milliseconds, or waits for another thread's, without stalling the
/// async worker it was called on: on a multi-threaded runtime the worker's other tasks move to
/// another thread meanwhile. Cache hits never get here.
fn off_worker<R>(work: impl FnOnce() -> R) -> R {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(work)
        }
        _ => work(),
    }
}

/// Whether two encodings carry the same resource. Equal resources built twice may differ in bytes:
/// prost writes map fields (metadata, `Struct`s) in hash-map order. Reordering keeps the length,
/// so only same-length encodings are decoded and compared.
fn same_resource(ty: ResourceType, a: &Resource, b: &Resource) -> bool {
    use envoy_types::pb::envoy::config::cluster::v3::Cluster;
    use envoy_types::pb::envoy::config::core::v3::TypedExtensionConfig;
    use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
    use envoy_types::pb::envoy::config::listener::v3::Listener;
    use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::Secret;
    use envoy_types::pb::google::protobuf::Any;
    use prost::Message;

    use crate::xds::istio_protos::authorization::Authorization;
    use crate::xds::istio_protos::mesh::ProxyConfig;
    use crate::xds::istio_protos::workload::Address;

    fn equal<M: Message + Default + PartialEq>(a: &[u8], b: &[u8]) -> bool {
        let value = |any: &[u8]| {
            Any::decode(any)
                .ok()
                .and_then(|any| M::decode(&any.value[..]).ok())
        };
        matches!((value(a), value(b)), (Some(x), Some(y)) if x == y)
    }
    if a.any == b.any {
        return true;
    }
    if a.any.len() != b.any.len() || a.name != b.name {
        return false;
    }
    match ty {
        ResourceType::Cluster => equal::<Cluster>(&a.any, &b.any),
        ResourceType::Endpoint => equal::<ClusterLoadAssignment>(&a.any, &b.any),
        ResourceType::Listener => equal::<Listener>(&a.any, &b.any),
        ResourceType::Route => equal::<RouteConfiguration>(&a.any, &b.any),
        ResourceType::Secret => equal::<Secret>(&a.any, &b.any),
        ResourceType::NameTable => equal::<crate::xds::name_table::NameTable>(&a.any, &b.any),
        ResourceType::ProxyConfig => equal::<ProxyConfig>(&a.any, &b.any),
        ResourceType::ExtensionConfig => equal::<TypedExtensionConfig>(&a.any, &b.any),
        ResourceType::Config(..) => equal::<crate::istio::mcp::Resource>(&a.any, &b.any),
        ResourceType::Address => equal::<Address>(&a.any, &b.any),
        ResourceType::Authorization => equal::<Authorization>(&a.any, &b.any),
    }
}

/// Encoded resources shared by every proxy that receives them, and the wildcard lists made of them.
pub struct ResourceCache {
    entries: Sharded<Option<Arc<Resource>>>,
    lists: Sharded<Arc<SharedList>>,
    builds: AtomicU64,
}

impl Default for ResourceCache {
    fn default() -> Self {
        Self::new(
            DEFAULT_CACHE_ENTRIES,
            IntGauge::new("unused", "unused").expect("valid gauge"),
        )
    }
}

impl ResourceCache {
    /// A cache of at most about `entries` resources (and as many lists), its size kept in `size`.
    pub fn new(entries: usize, size: IntGauge) -> Self {
        Self {
            entries: Sharded::with_capacity(entries, size.clone()),
            lists: Sharded::with_capacity(entries, size),
            builds: AtomicU64::new(0),
        }
    }

    pub(super) fn get_or_build(
        &self,
        ty: ResourceType,
        name: &str,
        variant: u64,
        stamp: Stamp,
        build: impl FnOnce() -> Option<Resource>,
    ) -> Option<Arc<Resource>> {
        self.entries
            .get_or_build(ty, name, variant, stamp, |previous| {
                self.builds.fetch_add(1, Ordering::Relaxed);
                let built = build()?;
                // An unchanged resource keeps its `Arc` (and version): Delta clients holding it
                // are sent nothing, however often the inputs' versions moved.
                match previous.flatten() {
                    Some(old) if same_resource(ty, &old, &built) => Some(old),
                    _ => Some(Arc::new(built)),
                }
            })
    }

    /// The part of a wildcard subscription every proxy with these traits shares, assembled once.
    pub(super) fn list(
        &self,
        ty: ResourceType,
        variant: u64,
        stamp: Stamp,
        build: impl FnOnce() -> Vec<Arc<Resource>>,
    ) -> Arc<SharedList> {
        self.lists.get_or_build(ty, "", variant, stamp, |_| {
            Arc::new(SharedList::new(build()))
        })
    }

    /// Drops entries built from an older service table (after a full push).
    pub fn prune(&self, services_version: u64) {
        self.entries.retain(|s| s[0] == services_version);
        self.lists.retain(|s| s[0] == services_version);
    }

    /// How many resources have been built (not served from cache) so far.
    pub fn builds(&self) -> u64 {
        self.builds.load(Ordering::Relaxed)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same cluster encoded with its two metadata entries in either order.
    fn cluster_both_ways() -> (Resource, Resource) {
        use envoy_types::pb::envoy::config::cluster::v3::Cluster;
        use envoy_types::pb::envoy::config::core::v3::Metadata;
        use envoy_types::pb::google::protobuf::{Any, Struct};
        use prost::{Message, Name};
        let part = |name: &str, key: &str| Cluster {
            name: name.into(),
            metadata: Some(Metadata {
                filter_metadata: [(key.to_string(), Struct::default())].into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        let (a, b) = (
            part("c", "a").encode_to_vec(),
            part("", "b").encode_to_vec(),
        );
        let resource = |value: Vec<u8>| Resource {
            name: "c".into(),
            any: Any {
                type_url: Cluster::type_url(),
                value,
            }
            .encode_to_vec()
            .into(),
            version: "".into(),
        };
        (
            resource([&a[..], &b].concat()),
            resource([&b[..], &a].concat()),
        )
    }

    #[test]
    fn map_order_does_not_make_a_resource_new() {
        let (ab, ba) = cluster_both_ways();
        assert_ne!(ab.any, ba.any);
        assert!(same_resource(ResourceType::Cluster, &ab, &ba));
        let other = Resource::encode(
            "c",
            &envoy_types::pb::envoy::config::cluster::v3::Cluster::default(),
        );
        assert!(!same_resource(ResourceType::Cluster, &ab, &other));
    }

    #[test]
    fn a_rebuilt_resource_equal_to_the_old_one_keeps_its_arc() {
        let cache = ResourceCache::default();
        let (ab, ba) = cluster_both_ways();
        let first = cache.get_or_build(ResourceType::Cluster, "c", 0, [1, 0, 0, 0], || Some(ab));
        let again = cache.get_or_build(ResourceType::Cluster, "c", 0, [2, 0, 0, 0], || Some(ba));
        assert!(Arc::ptr_eq(&first.unwrap(), &again.unwrap()));
    }

    #[test]
    fn a_full_shard_drops_its_least_recently_used_entries() {
        let size = IntGauge::new("size", "size").unwrap();
        let cache: Sharded<u32> = Sharded::with_capacity(64 * SHARDS, size.clone());
        let get = |name: &str| cache.get_or_build(ResourceType::Cluster, name, 0, [0; 4], |_| 1);
        get("kept");
        for i in 0..10_000 {
            get(&format!("bogus-{i}"));
            if i % 8 == 0 {
                get("kept");
            }
        }
        assert!(cache.len() <= 64 * SHARDS, "{} entries", cache.len());
        assert_eq!(size.get() as usize, cache.len());
        let builds = std::cell::Cell::new(0);
        cache.get_or_build(ResourceType::Cluster, "kept", 0, [0; 4], |_| {
            builds.set(builds.get() + 1);
            1
        });
        assert_eq!(builds.get(), 0, "a resource in use stays cached");
    }
}
