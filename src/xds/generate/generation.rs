//! What resources are built from: one proxy's traits (its kind, namespace, labels, cluster, the
//! Sidecar that applies) over one mesh snapshot, and the services, rules and cache variants that
//! follow from them.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::net::IpAddr;
use std::sync::{Arc, OnceLock};

use super::access_log::{ProxyLogs, Side};
use super::cache::ResourceCache;
use super::envoy_filter::ProxyPatches;
use super::istio_stats::{default_plan, IstioStats, SideStats, DEFAULT_ISTIO_STATS};
use super::names::{self, ClusterName};
use super::providers::report_unbuilt;
use super::tracer::{ProxyTracing, TracingInputs};
use super::wasm::ProxyPlugins;
use crate::istio::destination_rule::Subset;
use crate::istio::mesh::OutboundMode;
use crate::istio::{ConfigKey, MeshConfig};
use crate::model::{
    AppliedRule, AppliedTelemetry, BoundGateway, EgressScope, Locality, MeshSnapshot, Service,
    SidecarScope,
};
use crate::security::secret_access::SecretAccess;
use crate::xds::protocol::ResourceType;
use crate::xds::proxy::{Generator, Proxy, ProxyType};
use crate::xds::wire::{Resource, SharedList};

/// The generators, one per kind of proxy.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum ProxyKind {
    Sidecar,
    Router,
    ProxylessGrpc,
    Waypoint,
}

/// Builds resources for one proxy from one mesh snapshot.
pub struct Generation<'a> {
    pub(super) mesh: &'a MeshSnapshot,
    pub(super) cache: &'a ResourceCache,
    pub(super) proxy: &'a Proxy,
    /// Who may read which Secrets, as reviewed so far; without it nothing that needs a review is
    /// served.
    pub(super) secret_access: Option<&'a SecretAccess>,
    locality: OnceLock<Option<Locality>>,
    scope: OnceLock<Option<Arc<SidecarScope>>>,
    telemetry: OnceLock<AppliedTelemetry>,
    logs: OnceLock<ProxyLogs>,
    traces: OnceLock<ProxyTracing>,
    istio_stats: OnceLock<Option<Cow<'static, IstioStats>>>,
    envoy_filters: OnceLock<ProxyPatches>,
    wasm_plugins: OnceLock<ProxyPlugins>,
}

impl<'a> Generation<'a> {
    pub fn new(mesh: &'a MeshSnapshot, cache: &'a ResourceCache, proxy: &'a Proxy) -> Self {
        Self {
            mesh,
            cache,
            proxy,
            secret_access: None,
            locality: OnceLock::new(),
            scope: OnceLock::new(),
            telemetry: OnceLock::new(),
            logs: OnceLock::new(),
            traces: OnceLock::new(),
            istio_stats: OnceLock::new(),
            envoy_filters: OnceLock::new(),
            wasm_plugins: OnceLock::new(),
        }
    }
}

impl<'a> Generation<'a> {
    /// Serves Secrets as these reviews allow.
    pub fn with_secret_access(mut self, access: &'a SecretAccess) -> Self {
        self.secret_access = Some(access);
        self
    }
}

impl Generation<'_> {
    /// Where the proxy runs: its node's locality, else that of its own workload's endpoints.
    pub(super) fn proxy_locality(&self) -> Option<Locality> {
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

    /// The Gateways selecting this proxy (as a router), with their bound VirtualServices.
    pub(super) fn gateways(&self) -> Vec<BoundGateway> {
        let serves = |host: &str| {
            self.proxy.ips.iter().any(|ip| {
                self.mesh
                    .endpoints
                    .services_at(ip)
                    .iter()
                    .any(|key| *key.hostname == *host)
            })
        };
        self.mesh
            .config
            .gateways_for(&self.proxy.labels, &self.proxy.namespace, &serves)
    }

    pub(super) fn services_version(&self) -> u64 {
        self.mesh.services.version()
    }

    /// Every service the proxy sees (exportTo, and its Sidecar on some port), sorted by hostname.
    pub(super) fn routable_services(&self) -> Vec<Arc<Service>> {
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

    /// The addresses the proxy knows a service by: its own cluster's VIPs when the service has some
    /// there, else every cluster's; a ServiceEntry host that declares none by its allocated
    /// addresses (of the proxy's IP families) when the proxy's agent captures DNS, as it resolves
    /// the host to them (istiod's rule). Listeners match and the name table resolves these.
    pub(super) fn service_addresses(&self, service: &Service) -> Vec<IpAddr> {
        let own = self
            .proxy
            .cluster_id
            .as_ref()
            .and_then(|c| service.cluster_vips.get(c))
            .filter(|vips| !vips.is_empty());
        let mut vips: Vec<IpAddr> = match own {
            Some(v) => v.clone(),
            None => service.cluster_vips.values().flatten().copied().collect(),
        };
        vips.retain(|ip| !ip.is_unspecified());
        if vips.is_empty() && self.proxy.dns_capture {
            let families = |ip: &IpAddr| self.proxy.ips.iter().any(|p| p.is_ipv4() == ip.is_ipv4());
            vips.extend(service.auto_addresses.iter().filter(|ip| families(ip)));
        }
        vips
    }

    /// What of the proxy decides which allocated addresses it uses (see `service_addresses`): its
    /// IP families, when its agent captures DNS and some host has allocated addresses.
    pub(super) fn allocated_view(&self) -> Option<(bool, bool)> {
        let uses = self.proxy.dns_capture && !self.mesh.allocations.is_empty();
        uses.then(|| {
            let v4 = self.proxy.ips.iter().any(|ip| ip.is_ipv4());
            (v4, self.proxy.ips.iter().any(|ip| ip.is_ipv6()))
        })
    }

    /// The Sidecar resource that applies to a sidecar proxy (Envoy or proxyless), if any.
    pub(super) fn sidecar_scope(&self) -> Option<&Arc<SidecarScope>> {
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
    pub(super) fn sees(&self, service: &Service, port: u16) -> bool {
        self.sidecar_scope().is_none_or(|s| s.sees(service, port))
    }

    /// The egress listener of the proxy's Sidecar for `port`: the VirtualServices it imports apply.
    pub(super) fn egress_scope(&self, port: u16) -> Option<&EgressScope> {
        self.sidecar_scope().and_then(|s| s.listener(port))
    }

    /// A service by hostname, if the proxy sees it.
    pub(super) fn service(&self, host: &str) -> Option<&Arc<Service>> {
        let default = &self.mesh_config().default_service_export_to;
        self.mesh
            .services
            .get(host)
            .filter(|s| s.visible_to(&self.proxy.namespace, default))
    }

    pub(super) fn mesh_config(&self) -> &MeshConfig {
        self.mesh.config.mesh()
    }

    /// The trust domains whose workloads this proxy accepts as peers: the mesh's and its aliases
    /// (istiod's `TrustDomainsForValidation`).
    pub(super) fn trust_domains(&self) -> Vec<String> {
        let mesh = self.mesh_config();
        std::iter::once(&mesh.trust_domain)
            .chain(&mesh.trust_domain_aliases)
            .cloned()
            .collect()
    }

    /// The proxy's `outboundTrafficPolicy`: its Sidecar's, else the mesh's.
    pub(super) fn outbound_mode(&self) -> OutboundMode {
        self.sidecar_scope()
            .and_then(|s| s.outbound_mode())
            .unwrap_or(self.mesh_config().outbound_traffic_policy.mode)
    }

    /// Where outbound traffic to unknown destinations goes.
    pub(super) fn outbound_fallback(&self) -> &'static str {
        match self.outbound_mode() {
            OutboundMode::AllowAny => names::PASSTHROUGH,
            OutboundMode::RegistryOnly => names::BLACKHOLE,
        }
    }

    /// The DestinationRule that applies to a service for this proxy.
    pub(super) fn destination_rule(&self, service: &Service) -> Option<Arc<AppliedRule>> {
        self.mesh.config.destination_rule(
            &self.proxy.namespace,
            &self.proxy.labels,
            &service.hostname,
            &service.namespace,
        )
    }

    /// The proxy's labels where its DestinationRules depend on them (a rule of its namespace has a
    /// `workloadSelector`): resources built with rules vary by them then.
    pub(super) fn rule_labels(&self) -> Option<&BTreeMap<String, String>> {
        let selecting = self.mesh.config.rules_select_in(&self.proxy.namespace);
        selecting.then_some(&self.proxy.labels)
    }

    /// What of the config resources depend on: the rules and the mesh config.
    pub(super) fn config_version(&self) -> u64 {
        self.mesh.config.rules_version()
    }

    /// Traits of a wildcard list: the proxy's namespace matters once rules, export limits or a
    /// Sidecar do, and the Sidecar that applies.
    pub(super) fn list_scope(&self) -> ListScope<'_> {
        let sidecar = self.sidecar_scope().map(|s| &s.key);
        let by_namespace = self.mesh.config.has_destination_rules() || self.sees_by_namespace();
        ListScope {
            namespace: match by_namespace {
                true => &self.proxy.namespace,
                false => "",
            },
            sidecar,
            labels: self.rule_labels(),
        }
    }

    /// Whether which services the proxy sees depends on its namespace: some service limits its
    /// export, the mesh's default does, or a Sidecar applies.
    pub(super) fn sees_by_namespace(&self) -> bool {
        let default_export = &self.mesh_config().default_service_export_to;
        self.mesh.services.explicit_exports() > 0
            || !default_export.iter().any(|e| e == "*")
            || self.sidecar_scope().is_some()
    }

    /// The cache variant of listeners shared by proxies of one kind: its cluster (which VIPs),
    /// list scope, the allocated addresses it matches and the Telemetries that apply.
    pub(super) fn listener_variant(&self) -> u64 {
        self.variant_of(&(
            self.cluster_id(),
            self.list_scope(),
            self.allocated_view(),
            self.telemetry(),
            self.istio_stats().is_some(),
            self.tracing_variant(),
            self.wasm_plugins(),
        ))
    }

    /// The proxy's tracing (from its Telemetries, else the mesh config).
    pub(super) fn tracing(&self) -> &ProxyTracing {
        self.traces.get_or_init(|| {
            ProxyTracing::build(&TracingInputs {
                mesh: self.mesh_config(),
                telemetry: self.telemetry(),
                proxy: self.proxy,
                services: &self.mesh.services,
            })
        })
    }

    /// What of the proxy its spans carry (Istio's tags, its service cluster), when it traces.
    pub(super) fn tracing_variant(&self) -> Option<impl Hash + '_> {
        self.tracing().configured().then(|| {
            let label = |key: &str| self.proxy.labels.get(key);
            (
                &*self.proxy.namespace,
                label("service.istio.io/canonical-name"),
                label("service.istio.io/canonical-revision"),
                &self.proxy.mesh_id,
                &self.proxy.service_cluster,
                self.proxy.istio_version.is_empty(),
            )
        })
    }

    /// Istio's stats filters, when the proxy is Istio's (it names an ISTIO_VERSION; upstream Envoy
    /// cannot load them) and a Prometheus metrics provider is in effect (Istio's default), shaped
    /// by its Telemetries' metrics overrides.
    pub(super) fn istio_stats(&self) -> Option<&IstioStats> {
        let stats = self.istio_stats.get_or_init(|| {
            let istio_proxy =
                !self.proxy.istio_version.is_empty() && self.proxy.generator == Generator::Envoy;
            if !istio_proxy {
                return None;
            }
            let mesh = self.mesh_config();
            let prometheus =
                |name: &str| mesh.provider(name).is_some_and(|p| p.prometheus.is_some());
            let defaults = &mesh.default_providers.metrics;
            let Some(plan) = self.telemetry().metrics(defaults, prometheus) else {
                let named = self.telemetry().metrics_providers(defaults);
                if !named.is_empty() {
                    let why =
                        "none of them is a Prometheus provider (the only metrics meshpilot builds)";
                    report_unbuilt("Istio's metrics", &named.join(", "), why);
                }
                return None;
            };
            Some(match plan == default_plan() {
                true => Cow::Borrowed(&*DEFAULT_ISTIO_STATS),
                false => Cow::Owned(IstioStats::build(&plan)),
            })
        });
        stats.as_deref()
    }

    /// Istio's stats filters of one side of the proxy's traffic, if it gets them.
    pub(super) fn stats(&self, side: Side) -> Option<&SideStats> {
        self.istio_stats().map(|s| s.of(side))
    }

    /// The Telemetry objects that apply to the proxy.
    pub(super) fn telemetry(&self) -> &AppliedTelemetry {
        self.telemetry.get_or_init(|| {
            self.mesh
                .config
                .telemetry_for(&self.proxy.namespace, &self.proxy.labels)
        })
    }

    /// The EnvoyFilter patches that apply to the proxy.
    pub(super) fn envoy_filters(&self) -> &ProxyPatches {
        self.envoy_filters
            .get_or_init(|| ProxyPatches::for_proxy(self.mesh, self.proxy))
    }

    /// A listener, route configuration or cluster from the cache, built and patched on a miss
    /// (under a variant of its own where the proxy's EnvoyFilters change it).
    pub(super) fn cached(
        &self,
        ty: ResourceType,
        name: &str,
        variant: u64,
        stamp: [u64; 4],
        build: impl FnOnce() -> Option<Resource>,
    ) -> Option<Arc<Resource>> {
        let patches = self.envoy_filters();
        let variant = patches.variant(ty, variant);
        self.cache.get_or_build(ty, name, variant, stamp, || {
            patches.apply(ty, build()?, (self.mesh, self.proxy))
        })
    }

    /// A list shared by proxies with these traits (and EnvoyFilters where they change it).
    pub(super) fn cached_list(
        &self,
        ty: ResourceType,
        variant: u64,
        stamp: [u64; 4],
        build: impl FnOnce() -> Vec<Arc<Resource>>,
    ) -> Arc<SharedList> {
        let variant = self.envoy_filters().variant(ty, variant);
        self.cache.list(ty, variant, stamp, build)
    }

    /// A resource built for this proxy alone, patched.
    pub(super) fn finish(&self, ty: ResourceType, resource: Resource) -> Option<Arc<Resource>> {
        let patched = self
            .envoy_filters()
            .apply(ty, resource, (self.mesh, self.proxy));
        patched.map(Arc::new)
    }

    /// The WasmPlugins that apply to the proxy.
    pub(super) fn wasm_plugins(&self) -> &ProxyPlugins {
        self.wasm_plugins
            .get_or_init(|| ProxyPlugins::for_proxy(&self.mesh.config, self.proxy))
    }

    /// The proxy's access logs (from its Telemetries, else the mesh config).
    pub(super) fn access_logs(&self) -> &ProxyLogs {
        self.logs.get_or_init(|| {
            ProxyLogs::build(self.mesh_config(), self.telemetry(), &self.mesh.services)
        })
    }

    /// Which generator builds the proxy's configuration; None for a client that is no proxy (a
    /// debug client).
    pub(super) fn kind(&self) -> Option<ProxyKind> {
        match (self.proxy.generator, self.proxy.kind) {
            (Generator::Grpc, _) => Some(ProxyKind::ProxylessGrpc),
            (Generator::Envoy, ProxyType::Sidecar) => Some(ProxyKind::Sidecar),
            (Generator::Envoy, ProxyType::Router) => Some(ProxyKind::Router),
            (Generator::Envoy, ProxyType::Waypoint) => Some(ProxyKind::Waypoint),
            // Served by the ambient generator alone.
            (Generator::Envoy, ProxyType::Ztunnel) | (Generator::Event, _) => None,
        }
    }

    /// The network of a node proxy (ztunnel, waypoint): as its node says (ztunnel sends no
    /// NETWORK, its proxy metadata may), else that of its own pod, else its cluster's.
    pub(super) fn node_network(&self) -> String {
        let proxy = self.proxy;
        if !proxy.network.is_empty() {
            return proxy.network.to_string();
        }
        let Some(cluster) = &proxy.cluster_id else {
            let mut workloads = self.mesh.workloads.iter();
            let own = workloads.find(|w| w.addresses.iter().any(|ip| proxy.ips.contains(ip)));
            return own.map(|pod| pod.network.to_string()).unwrap_or_default();
        };
        let suffix = format!(".{}", proxy.namespace);
        let pod = proxy
            .workload
            .strip_suffix(&suffix)
            .unwrap_or(&proxy.workload);
        let uid = crate::model::pod_uid(cluster, &proxy.namespace, pod);
        match self.mesh.workloads.get(&uid) {
            Some(own) => own.network.to_string(),
            None => self.mesh.cluster_network(cluster),
        }
    }

    pub(super) fn is_router(&self) -> bool {
        self.kind() == Some(ProxyKind::Router)
    }

    /// The cluster the proxy runs in, empty when it does not say.
    pub(super) fn cluster_id(&self) -> &str {
        self.proxy
            .cluster_id
            .as_ref()
            .map(|c| c.as_str())
            .unwrap_or_default()
    }

    /// The listeners every proxy of this kind, cluster and list scope shares, assembled by `build`
    /// once per snapshot version.
    pub(super) fn shared_listeners(
        &self,
        build: impl FnOnce() -> Vec<Arc<Resource>>,
    ) -> Arc<SharedList> {
        let stamp = [
            self.services_version(),
            self.mesh.pods_version,
            0,
            self.config_version(),
        ];
        self.cached_list(
            ResourceType::Listener,
            self.listener_variant(),
            stamp,
            build,
        )
    }

    /// Traits hash for cache entries that depend on where the proxy sits.
    pub(super) fn variant_of(&self, traits: &impl Hash) -> u64 {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        traits.hash(&mut h);
        self.proxy.generator.hash(&mut h);
        h.finish()
    }
}

/// What a shared list (and a per-port listener) depends on beyond the proxy's kind.
#[derive(Hash)]
pub(super) struct ListScope<'a> {
    namespace: &'a str,
    sidecar: Option<&'a ConfigKey>,
    /// Where a DestinationRule of the proxy's namespace selects workloads: the proxy's labels.
    labels: Option<&'a BTreeMap<String, String>>,
}

/// What a cluster name points at for a proxy: the service, its port, the subset (which must exist
/// in the DestinationRule that applies) and that rule.
pub(super) struct Target {
    pub(super) service: Arc<Service>,
    pub(super) port: u16,
    pub(super) subset: Option<Subset>,
    pub(super) rule: Option<Arc<AppliedRule>>,
}

impl Generation<'_> {
    pub(super) fn target(&self, name: &ClusterName<'_>) -> Option<Target> {
        let service = self.service(name.host)?.clone();
        service.port(name.port)?;
        let rule = self.destination_rule(&service);
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
}
