//! Resource generators, with Istio's names, and the cache that builds each distinct resource once.
//!
//! A resource depends on the mesh snapshot and on a few proxy traits (its generator, namespace,
//! cluster). The cache keys entries by (type, name, traits) and stamps them with the versions of the
//! snapshot they were built from; every proxy with the same traits gets the same encoded bytes.

mod authn;
pub mod authz;
mod cds;
mod eds;
mod gateway;
mod gateway_tls;
mod inbound;
mod lds;
mod locality;
mod policy;
mod rds;
mod routes;
mod sds;
pub mod security;
pub mod tls;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::{Hash, Hasher};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use prometheus::IntGauge;

use envoy_types::pb::envoy::config::core::v3::{
    address, config_source, socket_address, Address, AggregatedConfigSource, ApiVersion,
    ConfigSource, SocketAddress,
};
use envoy_types::pb::google::protobuf::Duration;
use parking_lot::{Mutex, RwLock};

use super::protocol::ResourceType;
use super::proxy::{Generator, Proxy, ProxyType};
use super::wire::{Listing, Resource, SharedList};
use crate::istio::destination_rule::Subset;
use crate::istio::mesh::OutboundMode;
use crate::istio::{ConfigKey, MeshConfig};
use crate::model::{
    AppliedRule, EgressScope, Hostname, IngressPort, Locality, MeshSnapshot, Protocol, Service,
    ServiceKey, SidecarScope,
};

/// Builds resources for one proxy from one mesh snapshot.
pub struct Generation<'a> {
    mesh: &'a MeshSnapshot,
    cache: &'a ResourceCache,
    proxy: &'a Proxy,
    locality: OnceLock<Option<Locality>>,
    scope: OnceLock<Option<Arc<SidecarScope>>>,
}

impl<'a> Generation<'a> {
    pub fn new(mesh: &'a MeshSnapshot, cache: &'a ResourceCache, proxy: &'a Proxy) -> Self {
        Self {
            mesh,
            cache,
            proxy,
            locality: OnceLock::new(),
            scope: OnceLock::new(),
        }
    }
}

impl Generation<'_> {
    /// Where the proxy runs: its node's locality, else that of its own workload's endpoints.
    fn proxy_locality(&self) -> Option<Locality> {
        self.locality
            .get_or_init(|| {
                if !self.proxy.locality.region.is_empty() {
                    return Some(self.proxy.locality.clone());
                }
                self.proxy.ips.iter().find_map(|ip| {
                    self.mesh.endpoints.services_at(ip).iter().find_map(|key| {
                        let shards = self.mesh.endpoints.get(key)?;
                        let ep = shards.endpoints().find(|e| e.address == *ip)?;
                        (!ep.locality.region.is_empty()).then(|| Locality::clone(&ep.locality))
                    })
                })
            })
            .clone()
    }

    /// Every resource of a wildcard subscription: the list shared by proxies with the same traits,
    /// then the proxy's own.
    pub fn all(&self, ty: ResourceType) -> Listing {
        let (shared, own) = match ty {
            ResourceType::Cluster => (cds::shared(self), cds::own_names(self)),
            ResourceType::Listener => (lds::shared(self), lds::own_names(self)),
            ResourceType::Endpoint | ResourceType::Route | ResourceType::Secret => {
                return Listing::default()
            }
        };
        Listing {
            shared: Some(shared),
            own: self.build_all(ty, own),
        }
    }

    /// Builds (through the per-resource cache) every resource of `names`.
    fn build_all(&self, ty: ResourceType, names: Vec<String>) -> Vec<Arc<Resource>> {
        names.iter().filter_map(|n| self.build(ty, n)).collect()
    }

    /// The named resources that exist, in the order given.
    pub fn named<'n>(
        &self,
        ty: ResourceType,
        names: impl IntoIterator<Item = &'n String>,
    ) -> Vec<Arc<Resource>> {
        names
            .into_iter()
            .filter_map(|n| self.build(ty, n))
            .collect()
    }

    fn build(&self, ty: ResourceType, name: &str) -> Option<Arc<Resource>> {
        match ty {
            ResourceType::Cluster => cds::build(self, name),
            ResourceType::Endpoint => eds::build(self, name),
            ResourceType::Listener => lds::build(self, name),
            ResourceType::Route => rds::build(self, name),
            ResourceType::Secret => sds::build(self, name),
        }
    }

    fn services_version(&self) -> u64 {
        self.mesh.services.version()
    }

    /// Every service the proxy sees (exportTo, and its Sidecar on some port), sorted by hostname.
    fn routable_services(&self) -> Vec<Arc<Service>> {
        let ns = &*self.proxy.namespace;
        let default = &self.mesh_config().default_service_export_to;
        let scope = self.sidecar_scope();
        self.mesh
            .services
            .all()
            .iter()
            .filter(|s| s.visible_to(ns, default))
            .filter(|s| scope.is_none_or(|scope| scope.sees_service(s)))
            .cloned()
            .collect()
    }

    /// The Sidecar resource that applies to a sidecar proxy (Envoy or proxyless), if any.
    fn sidecar_scope(&self) -> Option<&Arc<SidecarScope>> {
        self.scope
            .get_or_init(|| match self.proxy.kind {
                ProxyType::Sidecar => self
                    .mesh
                    .config
                    .sidecar_scope(&self.proxy.namespace, &self.proxy.labels),
                _ => None,
            })
            .as_ref()
    }

    /// Whether the proxy hears of `service` on `port` (its Sidecar's egress listener for the port).
    fn sees(&self, service: &Service, port: u16) -> bool {
        self.sidecar_scope().is_none_or(|s| s.sees(service, port))
    }

    /// The egress listener of the proxy's Sidecar for `port`: the VirtualServices it imports apply.
    fn egress_scope(&self, port: u16) -> Option<&EgressScope> {
        self.sidecar_scope().and_then(|s| s.listener(port))
    }

    /// A service by hostname, if the proxy sees it.
    fn service(&self, host: &str) -> Option<&Arc<Service>> {
        let default = &self.mesh_config().default_service_export_to;
        self.mesh
            .services
            .get(host)
            .filter(|s| s.visible_to(&self.proxy.namespace, default))
    }

    fn mesh_config(&self) -> &MeshConfig {
        self.mesh.config.mesh()
    }

    /// The proxy's `outboundTrafficPolicy`: its Sidecar's, else the mesh's.
    fn outbound_mode(&self) -> OutboundMode {
        self.sidecar_scope()
            .and_then(|s| s.outbound_mode())
            .unwrap_or(self.mesh_config().outbound_traffic_policy.mode)
    }

    /// Where outbound traffic to unknown destinations goes.
    fn outbound_fallback(&self) -> &'static str {
        match self.outbound_mode() {
            OutboundMode::AllowAny => cds::PASSTHROUGH,
            OutboundMode::RegistryOnly => cds::BLACKHOLE,
        }
    }

    /// The DestinationRule that applies to a service for this proxy.
    fn destination_rule(&self, service: &Service) -> Option<Arc<AppliedRule>> {
        self.mesh.config.destination_rule(
            &self.proxy.namespace,
            &self.proxy.labels,
            &service.hostname,
            &service.namespace,
        )
    }

    /// The proxy's labels where its DestinationRules depend on them (a rule of its namespace has a
    /// `workloadSelector`): resources built with rules vary by them then.
    fn rule_labels(&self) -> Option<&BTreeMap<String, String>> {
        let selecting = self.mesh.config.rules_select_in(&self.proxy.namespace);
        selecting.then_some(&self.proxy.labels)
    }

    /// What of the config resources depend on: the rules and the mesh config.
    fn config_version(&self) -> u64 {
        self.mesh.config.rules_version()
    }

    /// Traits of a wildcard list: the proxy's namespace matters once rules, export limits or a
    /// Sidecar do, and the Sidecar that applies.
    fn list_scope(&self) -> ListScope<'_> {
        let config = &self.mesh.config;
        let sidecar = self.sidecar_scope().map(|s| &s.key);
        let exports_limited = self.mesh.services.explicit_exports() > 0
            || !config
                .mesh()
                .default_service_export_to
                .iter()
                .any(|e| e == "*");
        let by_namespace = config.has_destination_rules() || exports_limited || sidecar.is_some();
        ListScope {
            namespace: match by_namespace {
                true => &self.proxy.namespace,
                false => "",
            },
            sidecar,
            labels: self.rule_labels(),
        }
    }

    /// The ingress ports of the proxy's Sidecar (none without one, or one declaring none).
    fn ingress(&self) -> &[IngressPort] {
        self.sidecar_scope().map_or(&[], |s| s.ingress())
    }

    /// The ports the proxy's own workload serves: (target port, protocol), those its Sidecar's
    /// `ingress` declares, else from the endpoints at the proxy's addresses (as istiod's
    /// `buildInboundChainConfigs`, pilot/pkg/networking/core/listener_inbound.go).
    fn inbound_ports(&self) -> Vec<(u16, Protocol)> {
        if !self.ingress().is_empty() {
            return self
                .ingress()
                .iter()
                .map(|i| (i.port, i.protocol))
                .collect();
        }
        let mut ports: Vec<(u16, Protocol)> = Vec::new();
        for ip in &self.proxy.ips {
            for key in self.mesh.endpoints.services_at(ip) {
                self.collect_inbound(ip, &key, &mut ports);
            }
        }
        ports.sort_by_key(|(p, _)| *p);
        ports.dedup_by_key(|(p, _)| *p);
        ports
    }

    fn collect_inbound(&self, ip: &IpAddr, key: &ServiceKey, ports: &mut Vec<(u16, Protocol)>) {
        let Some(service) = self.service(&key.hostname) else {
            return;
        };
        let Some(shards) = self.mesh.endpoints.get(key) else {
            return;
        };
        for ep in shards.endpoints().filter(|e| e.address == *ip) {
            if let Some(port) = service
                .ports
                .iter()
                .find(|p| *p.name == *ep.service_port_name)
            {
                ports.push((ep.port, port.protocol));
            }
        }
    }

    fn is_sidecar(&self) -> bool {
        self.proxy.kind == ProxyType::Sidecar && self.proxy.generator == Generator::Envoy
    }

    /// Traits hash for cache entries that depend on where the proxy sits.
    fn variant(&self, parts: &[&str]) -> u64 {
        self.variant_of(&parts)
    }

    fn variant_of(&self, traits: &impl Hash) -> u64 {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        traits.hash(&mut h);
        self.proxy.generator.hash(&mut h);
        h.finish()
    }
}

/// What a shared list (and a per-port listener) depends on beyond the proxy's kind.
#[derive(Hash)]
struct ListScope<'a> {
    namespace: &'a str,
    sidecar: Option<&'a ConfigKey>,
    /// Where a DestinationRule of the proxy's namespace selects workloads: the proxy's labels.
    labels: Option<&'a BTreeMap<String, String>>,
}

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
    use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
    use envoy_types::pb::envoy::config::listener::v3::Listener;
    use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::Secret;
    use envoy_types::pb::google::protobuf::Any;
    use prost::Message;

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

    fn get_or_build(
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
    fn list(
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

/// `outbound|<port>||<hostname>`
pub fn outbound_cluster(port: u16, host: &str) -> String {
    subset_cluster(port, "", host)
}

/// `outbound|<port>|<subset>|<hostname>`
pub fn subset_cluster(port: u16, subset: &str, host: &str) -> String {
    format!("outbound|{port}|{subset}|{host}")
}

/// A cluster name's parts: `outbound|<port>|<subset>|<host>`, or an east-west gateway's SNI
/// cluster `outbound_.<port>_.<subset>_.<host>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClusterName<'a> {
    pub port: u16,
    pub subset: &'a str,
    pub host: &'a str,
}

/// A port as it appears in a resource name: canonical decimal only, so that `080` and `+80` are not
/// further names for port 80 (each would be built and cached again).
pub fn parse_port(text: &str) -> Option<u16> {
    let port: u16 = text.parse().ok()?;
    (text.len() == 1 || !text.starts_with(['0', '+'])).then_some(port)
}

pub fn parse_outbound(name: &str) -> Option<ClusterName<'_>> {
    let mut parts = name.splitn(4, '|');
    let (dir, port, subset, host) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    (dir == "outbound" && !host.is_empty()).then_some(())?;
    Some(ClusterName {
        port: parse_port(port)?,
        subset,
        host,
    })
}

/// `outbound_.<port>_.<subset>_.<hostname>`: an east-west gateway's cluster, named by the SNI it
/// serves.
pub fn parse_sni_cluster(name: &str) -> Option<ClusterName<'_>> {
    let rest = name.strip_prefix("outbound_.")?;
    let (port, rest) = rest.split_once("_.")?;
    let (subset, host) = rest.split_once("_.")?;
    (!host.is_empty()).then_some(())?;
    Some(ClusterName {
        port: parse_port(port)?,
        subset,
        host,
    })
}

/// The service host an EDS cluster name is for, in either naming (`outbound|…` or SNI).
pub fn cluster_host(name: &str) -> Option<&str> {
    parse_outbound(name)
        .or_else(|| parse_sni_cluster(name))
        .map(|c| c.host)
}

/// `<hostname>:<port>`, the name a proxyless gRPC client gives its listener and route, when that
/// service port exists.
fn grpc_target<'n>(generation: &Generation<'_>, name: &'n str) -> Option<(&'n str, u16)> {
    let (host, port) = name.rsplit_once(':')?;
    let port = parse_port(port)?;
    generation.service(host)?.port(port)?;
    Some((host, port))
}

/// What a cluster name points at for a proxy: the service, its port, the subset (which must exist
/// in the DestinationRule that applies) and that rule.
struct Target {
    service: Arc<Service>,
    port: u16,
    subset: Option<Subset>,
    rule: Option<Arc<AppliedRule>>,
}

fn target(g: &Generation<'_>, name: &ClusterName<'_>) -> Option<Target> {
    let service = g.service(name.host)?.clone();
    service.port(name.port)?;
    let rule = g.destination_rule(&service);
    let subset = match name.subset {
        "" => None,
        subset => Some(
            rule.as_ref()?
                .rule
                .subsets
                .iter()
                .find(|s| s.name == subset)?
                .clone(),
        ),
    };
    Some(Target {
        service,
        port: name.port,
        subset,
        rule,
    })
}

fn ads() -> ConfigSource {
    ConfigSource {
        config_source_specifier: Some(config_source::ConfigSourceSpecifier::Ads(
            AggregatedConfigSource {},
        )),
        resource_api_version: ApiVersion::V3 as i32,
        ..Default::default()
    }
}

fn socket(ip: &str, port: u16) -> Address {
    Address {
        address: Some(address::Address::SocketAddress(SocketAddress {
            address: ip.to_string(),
            port_specifier: Some(socket_address::PortSpecifier::PortValue(u32::from(port))),
            ..Default::default()
        })),
    }
}

fn seconds(s: i64) -> Duration {
    Duration {
        seconds: s,
        nanos: 0,
    }
}

/// Hostnames a change touched → the outbound cluster names (EDS resources) they back.
pub fn eds_names_for(
    hosts: &BTreeSet<Hostname>,
    subscribed: impl Iterator<Item = String>,
) -> BTreeSet<String> {
    subscribed
        .filter(|name| cluster_host(name).is_some_and(|host| hosts.contains(host)))
        .collect()
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

    #[test]
    fn ports_in_names_are_canonical() {
        assert_eq!(parse_port("80"), Some(80));
        assert_eq!(parse_port("0"), Some(0));
        for other in ["080", "+80", "00", "", "65536", "8o"] {
            assert_eq!(parse_port(other), None, "{other}");
        }
        assert_eq!(
            parse_outbound("outbound|080||web.shop.svc.cluster.local"),
            None
        );
    }

    #[test]
    fn cluster_names_round_trip() {
        let host = "reviews.bookinfo.svc.cluster.local";
        let name = outbound_cluster(9080, host);
        assert_eq!(name, "outbound|9080||reviews.bookinfo.svc.cluster.local");
        let parsed = |port, subset| Some(ClusterName { port, subset, host });
        assert_eq!(parse_outbound(&name), parsed(9080, ""));
        assert_eq!(
            parse_outbound(&subset_cluster(80, "v1", host)),
            parsed(80, "v1")
        );
        assert_eq!(parse_outbound("inbound|9080||"), None);
        assert_eq!(parse_outbound("outbound|x||h"), None);
        assert_eq!(
            tls::outbound_sni(80, "", host),
            "outbound_.80_._.reviews.bookinfo.svc.cluster.local"
        );
        assert_eq!(
            parse_sni_cluster(&tls::outbound_sni(80, "", host)),
            parsed(80, "")
        );
        assert_eq!(
            parse_sni_cluster(&tls::outbound_sni(80, "v2", host)),
            parsed(80, "v2")
        );
    }
}
