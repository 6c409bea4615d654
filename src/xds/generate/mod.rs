//! Resource generators, with Istio's names, and the cache that builds each distinct resource once.
//!
//! A resource depends on the mesh snapshot and on a few proxy traits (its generator, namespace,
//! cluster). The cache keys entries by (type, name, traits) and stamps them with the versions of the
//! snapshot they were built from; every proxy with the same traits gets the same encoded bytes.

mod authn;
pub mod authz;
mod cache;
mod cds;
mod eds;
mod gateway;
mod gateway_tls;
mod inbound;
mod lds;
mod locality;
pub mod names;
mod policy;
mod rds;
mod routes;
mod sds;
pub mod security;
pub mod tls;

use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::net::IpAddr;
use std::sync::{Arc, OnceLock};

use envoy_types::pb::envoy::config::core::v3::{
    address, config_source, socket_address, Address, AggregatedConfigSource, ApiVersion,
    ConfigSource, SocketAddress,
};
use envoy_types::pb::google::protobuf::Duration;

pub use cache::{ResourceCache, DEFAULT_CACHE_ENTRIES};
pub use names::{cluster_host, eds_names_for};

use super::protocol::ResourceType;
use super::proxy::{Generator, Proxy, ProxyType};
use super::wire::{Listing, Resource};
use crate::istio::destination_rule::Subset;
use crate::istio::mesh::OutboundMode;
use crate::istio::{ConfigKey, MeshConfig};
use crate::model::{
    AppliedRule, EgressScope, IngressPort, Locality, MeshSnapshot, Protocol, Service, ServiceKey,
    SidecarScope,
};
use names::{parse_port, ClusterName};

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
            OutboundMode::AllowAny => names::PASSTHROUGH,
            OutboundMode::RegistryOnly => names::BLACKHOLE,
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
