//! What resources are built from: one proxy's traits (its kind, namespace, labels, cluster, the
//! Sidecar that applies…) over one mesh snapshot, and the services and rules that follow from
//! them. Generators read the proxy only through the accessors here, each naming its `Trait`; a
//! cached build names the traits it reads and is keyed by the proxy's values of them
//! (`traits`), so a resource is never served to a proxy that differs in something it read.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};

use super::access_log::{ProxyLogs, Side};
use super::cache::ResourceCache;
use super::envoy_filter::{Patched, ProxyPatches};
use super::istio_stats::{default_plan, IstioStats, SideStats, DEFAULT_ISTIO_STATS};
use super::names::{self, ClusterName};
use super::policy::MeshPolicy;
use super::providers::report_unbuilt;
use super::tracer::{ProxyTracing, TracingInputs};
use super::traits::{Trait, Traits};
use super::wasm::ProxyPlugins;
use crate::istio::destination_rule::{H2UpgradePolicy, Subset};
use crate::istio::mesh::OutboundMode;
use crate::istio::mesh_traffic::Normalization;
use crate::istio::{ConfigObject, MeshConfig, VirtualService};
use crate::model::topology::{self, Topology};
use crate::model::{
    AppliedRule, AppliedTelemetry, BoundGateway, ClusterId, EgressScope, Endpoint, HostRoutes,
    Locality, MeshSnapshot, Registry, Service, SidecarScope,
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
    cache: &'a ResourceCache,
    /// The proxy, read by generators only through the accessors below, each naming its trait.
    node: &'a Proxy,
    /// What the cached build under way may read of the proxy (`Traits::ALL` outside one).
    readable: AtomicU32,
    /// Who may read which Secrets, as reviewed so far; without it nothing that needs a review is
    /// served.
    pub(super) secret_access: Option<&'a SecretAccess>,
    locality: OnceLock<Option<Locality>>,
    /// Its labels as istiod sees them: its own, with its topology.
    workload_labels: OnceLock<BTreeMap<String, String>>,
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
            node: proxy,
            readable: AtomicU32::new(Traits::ALL.bits()),
            secret_access: None,
            locality: OnceLock::new(),
            workload_labels: OnceLock::new(),
            scope: OnceLock::new(),
            telemetry: OnceLock::new(),
            logs: OnceLock::new(),
            traces: OnceLock::new(),
            istio_stats: OnceLock::new(),
            envoy_filters: OnceLock::new(),
            wasm_plugins: OnceLock::new(),
        }
    }

    /// Serves Secrets as these reviews allow.
    pub fn with_secret_access(mut self, access: &'a SecretAccess) -> Self {
        self.secret_access = Some(access);
        self
    }
}

/// Reading the proxy: every accessor names what it reads.
impl Generation<'_> {
    /// Marks `t` read; in debug builds, a read the cached build under way did not name panics.
    fn read(&self, t: Trait) {
        let readable = Traits::from_bits(self.readable.load(Ordering::Relaxed));
        debug_assert!(
            readable.contains(t),
            "a cached build read the proxy's {t:?}, which its cache key does not hold \
             (it holds {readable:?}): name the trait where the build is cached"
        );
    }

    /// Runs `f` with only `traits` readable, restoring what was readable after (also when it
    /// panics).
    fn reading<T>(&self, traits: Traits, f: impl FnOnce() -> T) -> T {
        struct Restore<'r>(&'r AtomicU32, u32);
        impl Drop for Restore<'_> {
            fn drop(&mut self) {
                self.0.store(self.1, Ordering::Relaxed);
            }
        }
        let before = self.readable.swap(traits.bits(), Ordering::Relaxed);
        let _restore = Restore(&self.readable, before);
        f()
    }

    /// The node id, for logs only (never part of what is built).
    pub(super) fn id(&self) -> &str {
        &self.node.id
    }

    pub(super) fn proxy_type(&self) -> ProxyType {
        self.read(Trait::Kind);
        self.node.kind
    }

    pub(super) fn generator(&self) -> Generator {
        self.read(Trait::Kind);
        self.node.generator
    }

    pub(super) fn namespace(&self) -> &str {
        self.read(Trait::Namespace);
        &self.node.namespace
    }

    /// Its labels as istiod sees them (pilot/pkg/xds/ads.go `setTopologyLabels`): its pod's, with
    /// its cluster, locality, node (`NODE_NAME`) and network as topology labels.
    pub(super) fn labels(&self) -> &BTreeMap<String, String> {
        self.read(Trait::Labels);
        self.workload_labels()
    }

    fn workload_labels(&self) -> &BTreeMap<String, String> {
        self.workload_labels.get_or_init(|| {
            let proxy = self.node;
            let locality = self.own_locality().unwrap_or_default();
            let at = Topology {
                cluster: proxy.cluster_id.as_ref().map_or("", |c| c.as_str()),
                locality: &locality,
                node: proxy.metadata.get("NODE_NAME").map_or("", String::as_str),
                network: &proxy.network,
            };
            topology::augment(&proxy.labels, &at)
        })
    }

    /// The cluster the proxy runs in, if it says.
    pub(super) fn cluster(&self) -> Option<&ClusterId> {
        self.read(Trait::Cluster);
        self.node.cluster_id.as_ref()
    }

    /// The cluster the proxy runs in, empty when it does not say.
    pub(super) fn cluster_id(&self) -> &str {
        self.cluster().map(|c| c.as_str()).unwrap_or_default()
    }

    pub(super) fn network(&self) -> &Arc<str> {
        self.read(Trait::Network);
        &self.node.network
    }

    /// The networks whose endpoints it asks to see (REQUESTED_NETWORK_VIEW).
    pub(super) fn requested_networks(&self) -> &[String] {
        self.read(Trait::Network);
        &self.node.requested_network_view
    }

    pub(super) fn addresses(&self) -> &[IpAddr] {
        self.read(Trait::Addresses);
        &self.node.ips
    }

    /// Whether all its addresses are IPv6.
    pub(super) fn ipv6_only(&self) -> bool {
        self.read(Trait::Families);
        self.node.ips.iter().all(IpAddr::is_ipv6)
    }

    /// ISTIO_VERSION, empty for a proxy that is not Istio's.
    pub(super) fn istio_version(&self) -> &str {
        self.read(Trait::Version);
        &self.node.istio_version
    }

    /// The service account it proved on the secure port.
    pub(super) fn verified_account(&self) -> Option<&str> {
        self.read(Trait::Identity);
        self.node.verified_account.as_deref()
    }

    /// Its labels, for a VirtualService's `sourceLabels`.
    pub(super) fn source_labels(&self) -> &BTreeMap<String, String> {
        self.read(Trait::SourceLabels);
        self.workload_labels()
    }

    /// Its namespace, for a VirtualService's `sourceNamespace`.
    pub(super) fn source_namespace(&self) -> &str {
        self.read(Trait::SourceLabels);
        &self.node.namespace
    }

    /// Its own address when it is a pod of a service whose listeners match each pod's address
    /// (a headless service's TCP port): that chain is left out of its own listeners.
    pub(super) fn pod_of_headless(&self) -> Option<IpAddr> {
        self.read(Trait::PodOfHeadless);
        let ip = self.node.ips.first()?;
        let endpoints = &self.mesh.endpoints;
        let services = &self.mesh.services;
        endpoints
            .services_at(ip)
            .iter()
            .any(|key| {
                services
                    .get(&key.hostname)
                    .is_some_and(|s| s.listens_per_endpoint())
            })
            .then_some(*ip)
    }

    /// Which generator builds the proxy's configuration; None for a client that is no proxy (a
    /// debug client).
    pub(super) fn kind(&self) -> Option<ProxyKind> {
        match (self.generator(), self.proxy_type()) {
            (Generator::Grpc, _) => Some(ProxyKind::ProxylessGrpc),
            (Generator::Envoy, ProxyType::Sidecar) => Some(ProxyKind::Sidecar),
            (Generator::Envoy, ProxyType::Router) => Some(ProxyKind::Router),
            (Generator::Envoy, ProxyType::Waypoint) => Some(ProxyKind::Waypoint),
            // Served by the ambient generator alone.
            (Generator::Envoy, ProxyType::Ztunnel) | (Generator::Event, _) => None,
        }
    }

    pub(super) fn is_router(&self) -> bool {
        self.kind() == Some(ProxyKind::Router)
    }
}

/// What follows from the proxy over the snapshot.
impl Generation<'_> {
    /// Where the proxy runs: its node's locality, else that of its own workload's endpoints.
    pub(super) fn proxy_locality(&self) -> Option<Locality> {
        self.read(Trait::Locality);
        self.own_locality()
    }

    fn own_locality(&self) -> Option<Locality> {
        self.locality
            .get_or_init(|| {
                let proxy = self.node;
                if !proxy.locality.region.is_empty() {
                    return Some(proxy.locality.clone());
                }
                proxy.ips.iter().find_map(|ip| {
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
        self.read(Trait::Gateways);
        let proxy = self.node;
        let serves = |host: &str| {
            proxy.ips.iter().any(|ip| {
                self.mesh
                    .endpoints
                    .services_at(ip)
                    .iter()
                    .any(|key| *key.hostname == *host)
            })
        };
        self.mesh
            .config
            .gateways_for(self.workload_labels(), &proxy.namespace, &serves)
    }

    pub(super) fn services_version(&self) -> u64 {
        self.mesh.services.version()
    }

    /// Every service the proxy sees (exportTo, and its Sidecar on some port), sorted by hostname.
    pub(super) fn routable_services(&self) -> Vec<Arc<Service>> {
        self.read(Trait::Scope);
        let ns = &*self.node.namespace;
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
    /// there, else one other cluster's (as istiod); a ServiceEntry host that declares none by its allocated
    /// addresses (of the proxy's IP families) when the proxy's agent captures DNS, as it resolves
    /// the host to them (istiod's rule). Listeners match and the name table resolves these.
    pub(super) fn service_addresses(&self, service: &Service) -> Vec<IpAddr> {
        let own = self
            .cluster()
            .and_then(|c| service.cluster_vips.get(c))
            .filter(|vips| !vips.is_empty());
        // Else istiod's `DefaultAddress`: the address of the registry that listed the service
        // first, the config cluster's before remotes' (pilot/pkg/model/service.go
        // `GetAddressForProxy`, pilot/pkg/serviceregistry/aggregate/controller.go `Services`).
        let default = || {
            let local = self.mesh.credentials.local();
            (service.cluster_vips.get(local).into_iter())
                .chain(service.cluster_vips.values())
                .find(|vips| !vips.is_empty())
                .cloned()
                .unwrap_or_default()
        };
        let mut vips: Vec<IpAddr> = own.cloned().unwrap_or_else(default);
        vips.retain(|ip| !ip.is_unspecified());
        if let Some((v4, v6)) = self.allocated_view().filter(|_| vips.is_empty()) {
            let families = |ip: &IpAddr| if ip.is_ipv4() { v4 } else { v6 };
            vips.extend(service.auto_addresses.iter().filter(|ip| families(ip)));
        }
        vips
    }

    /// Whether a service's endpoints reach only its own cluster's proxies (mesh config
    /// `serviceSettings`, istiod's defaults).
    pub(super) fn cluster_local(&self, service: &Service) -> bool {
        let hosts = self.mesh.config.cluster_local_hosts();
        hosts.is_cluster_local(&service.hostname)
    }

    /// Whether an endpoint of `service` reaches this proxy: any, but a cluster-local service's
    /// only from the proxy's own cluster (a ServiceEntry's are of the cluster meshpilot runs in,
    /// as istiod's are of its own).
    pub(super) fn reaches(&self, service: &Service, endpoint: &Endpoint) -> bool {
        if !self.cluster_local(service) {
            return true;
        }
        let of = match service.registry {
            Registry::External => self.mesh.credentials.local(),
            Registry::Kubernetes => &endpoint.cluster_id,
        };
        self.cluster() == Some(of)
    }

    /// What of the proxy decides which allocated addresses it uses (see `service_addresses`): its
    /// IP families, when its agent captures DNS and some host has allocated addresses.
    pub(super) fn allocated_view(&self) -> Option<(bool, bool)> {
        self.read(Trait::Allocated);
        let proxy = self.node;
        let uses = proxy.dns_capture && !self.mesh.allocations.is_empty();
        uses.then(|| {
            let v4 = proxy.ips.iter().any(|ip| ip.is_ipv4());
            (v4, proxy.ips.iter().any(|ip| ip.is_ipv6()))
        })
    }

    /// The Sidecar resource that applies to a sidecar proxy (Envoy or proxyless), if any.
    pub(super) fn sidecar_scope(&self) -> Option<&Arc<SidecarScope>> {
        self.read(Trait::Scope);
        self.scope
            .get_or_init(|| match self.node.kind {
                ProxyType::Sidecar => self
                    .mesh
                    .config
                    .sidecar_scope(&self.node.namespace, self.workload_labels()),
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
        self.read(Trait::Scope);
        let default = &self.mesh_config().default_service_export_to;
        self.mesh
            .services
            .get(host)
            .filter(|s| s.visible_to(&self.node.namespace, default))
    }

    /// The VirtualService routes for `host` exported to the proxy (with a Sidecar, those its
    /// egress listener imports).
    pub(super) fn mesh_routes(
        &self,
        host: &str,
        scope: Option<&EgressScope>,
    ) -> Option<HostRoutes> {
        self.read(Trait::Routes);
        self.mesh
            .config
            .mesh_routes(&self.node.namespace, host, scope)
    }

    /// Every VirtualService for `host` exported to the proxy whose routes a TCP or TLS listener
    /// consults (with a Sidecar, those its egress listener imports).
    pub(super) fn l4_routes(
        &self,
        host: &str,
        scope: Option<&EgressScope>,
    ) -> Vec<(Arc<ConfigObject>, Arc<VirtualService>)> {
        self.read(Trait::Routes);
        self.mesh
            .config
            .mesh_l4_routes(&self.node.namespace, host, scope)
    }

    pub(super) fn mesh_config(&self) -> &MeshConfig {
        self.mesh.config.mesh()
    }

    /// What the mesh sets on every cluster a traffic policy shapes.
    pub(super) fn mesh_policy(&self) -> MeshPolicy<'_> {
        let mesh = self.mesh_config();
        MeshPolicy {
            tcp_keepalive: mesh.tcp_keepalive.as_ref(),
            h2_upgrade: mesh.h2_upgrade_policy == H2UpgradePolicy::Upgrade,
        }
    }

    /// How the mesh normalises request paths on every connection manager.
    pub(super) fn path_normalization(&self) -> Normalization {
        self.mesh_config().path_normalization.normalization
    }

    /// The trust domains whose workloads this proxy accepts as peers: the mesh's, its aliases and
    /// those of `caCertificates` (istiod's `TrustDomainsForValidation`,
    /// pilot/pkg/networking/plugin/authn/util.go).
    pub(super) fn trust_domains(&self) -> Vec<String> {
        let mesh = self.mesh_config();
        let extra = mesh.ca_certificates.iter().flat_map(|c| &c.trust_domains);
        let mut domains: Vec<String> = Vec::new();
        for domain in std::iter::once(&mesh.trust_domain)
            .chain(&mesh.trust_domain_aliases)
            .chain(extra)
        {
            if !domains.contains(domain) {
                domains.push(domain.clone());
            }
        }
        domains
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
        self.read(Trait::Rules);
        self.mesh.config.destination_rule(
            &self.node.namespace,
            || self.workload_labels(),
            &service.hostname,
            &service.namespace,
        )
    }

    /// What of the config resources depend on: the rules and the mesh config.
    pub(super) fn config_version(&self) -> u64 {
        self.mesh.config.rules_version()
    }

    /// Whether which services the proxy sees depends on its namespace: some service limits its
    /// export, the mesh's default does, or a Sidecar applies.
    fn sees_by_namespace(&self) -> bool {
        let default_export = &self.mesh_config().default_service_export_to;
        self.mesh.services.explicit_exports() > 0
            || !default_export.iter().any(|e| e == "*")
            || self.sidecar_scope().is_some()
    }

    /// The proxy's tracing (from its Telemetries, else the mesh config).
    pub(super) fn tracing(&self) -> &ProxyTracing {
        self.read(Trait::Tracing);
        self.traces.get_or_init(|| {
            ProxyTracing::build(&TracingInputs {
                mesh: self.mesh_config(),
                telemetry: self.reading(Traits::ALL, || self.telemetry()),
                proxy: self.node,
                services: &self.mesh.services,
            })
        })
    }

    /// Istio's stats filters, when the proxy is Istio's (it names an ISTIO_VERSION; upstream Envoy
    /// cannot load them) and a Prometheus metrics provider is in effect (Istio's default), shaped
    /// by its Telemetries' metrics overrides.
    pub(super) fn istio_stats(&self) -> Option<&IstioStats> {
        self.read(Trait::Telemetry);
        let stats = self.istio_stats.get_or_init(|| {
            if !self.istio_proxy() {
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

    /// Whether it is Istio's Envoy (it names an ISTIO_VERSION), which loads Istio's filters.
    fn istio_proxy(&self) -> bool {
        !self.node.istio_version.is_empty() && self.node.generator == Generator::Envoy
    }

    /// Istio's stats filters of one side of the proxy's traffic, if it gets them.
    pub(super) fn stats(&self, side: Side) -> Option<&SideStats> {
        self.istio_stats().map(|s| s.of(side))
    }

    /// The Telemetry objects that apply to the proxy.
    pub(super) fn telemetry(&self) -> &AppliedTelemetry {
        self.read(Trait::Telemetry);
        self.telemetry.get_or_init(|| {
            self.mesh
                .config
                .telemetry_for(&self.node.namespace, self.workload_labels())
        })
    }

    /// The EnvoyFilter patches that apply to the proxy.
    pub(super) fn envoy_filters(&self) -> &ProxyPatches {
        self.envoy_filters
            .get_or_init(|| ProxyPatches::for_proxy(self.mesh, self.node, self.workload_labels()))
    }

    /// The WasmPlugins that apply to the proxy.
    pub(super) fn wasm_plugins(&self) -> &ProxyPlugins {
        self.read(Trait::Plugins);
        self.wasm_plugins.get_or_init(|| {
            ProxyPlugins::for_proxy(&self.mesh.config, self.node, self.workload_labels())
        })
    }

    /// The proxy's access logs (from its Telemetries, else the mesh config).
    pub(super) fn access_logs(&self) -> &ProxyLogs {
        self.read(Trait::Telemetry);
        self.logs.get_or_init(|| {
            ProxyLogs::build(self.mesh_config(), self.telemetry(), &self.mesh.services)
        })
    }

    /// The network of a node proxy (ztunnel, waypoint): as its node says (ztunnel sends no
    /// NETWORK, its proxy metadata may), else that of its own pod, else its cluster's.
    pub(super) fn node_network(&self) -> String {
        self.read(Trait::NodeNetwork);
        let proxy = self.node;
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
}

/// The cache, keyed by what a build reads.
impl Generation<'_> {
    /// The cache key of a build that reads `traits` of the proxy and was handed `extra` (what it
    /// captured that follows from the proxy, such as the rule it applies): the proxy's value of
    /// each trait. Computing it reads those traits, so a build nested in another must read no
    /// more than the outer one.
    fn key(&self, traits: Traits, extra: &impl Hash) -> u64 {
        for t in traits.iter() {
            self.read(t);
        }
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.reading(Traits::ALL, || {
            for t in traits.iter() {
                (t as u8).hash(&mut h);
                self.hash_trait(t, &mut h);
            }
        });
        extra.hash(&mut h);
        h.finish()
    }

    /// The proxy's value of one trait: what builds reading it vary by.
    fn hash_trait(&self, t: Trait, h: &mut impl Hasher) {
        let proxy = self.node;
        match t {
            Trait::Kind => (proxy.kind, proxy.generator).hash(h),
            Trait::Namespace => proxy.namespace.hash(h),
            Trait::Labels => self.workload_labels().hash(h),
            Trait::Cluster => proxy.cluster_id.hash(h),
            Trait::Network => (&proxy.network, &proxy.requested_network_view).hash(h),
            Trait::Addresses => proxy.ips.hash(h),
            Trait::Families => self.ipv6_only().hash(h),
            Trait::Locality => self.proxy_locality().hash(h),
            Trait::Version => proxy.istio_version.hash(h),
            Trait::Scope => {
                let by_namespace = self.sees_by_namespace();
                by_namespace.then_some(&proxy.namespace).hash(h);
                self.sidecar_scope().map(|s| &s.key).hash(h);
            }
            Trait::Rules => {
                let config = &self.mesh.config;
                let by_namespace = config.has_destination_rules();
                by_namespace.then_some(&proxy.namespace).hash(h);
                let selecting = config.rules_select_in(&proxy.namespace);
                selecting.then(|| self.workload_labels()).hash(h);
            }
            Trait::Routes => {
                let by_namespace = self.mesh.config.routes_vary_by_namespace();
                by_namespace.then_some(&proxy.namespace).hash(h);
            }
            Trait::SourceLabels => {
                let config = &self.mesh.config;
                let labels = config.routes_use_source_labels();
                labels.then(|| self.workload_labels()).hash(h);
                let namespace = config.routes_use_source_namespace();
                namespace.then_some(&proxy.namespace).hash(h);
            }
            Trait::Telemetry => (self.telemetry(), self.istio_proxy()).hash(h),
            Trait::Tracing => {
                let tracing = self.tracing().configured().then(|| {
                    let label = |key: &str| proxy.labels.get(key);
                    (
                        &proxy.namespace,
                        label("service.istio.io/canonical-name"),
                        label("service.istio.io/canonical-revision"),
                        &proxy.mesh_id,
                        &proxy.service_cluster,
                        &proxy.cluster_id,
                        proxy.istio_version.is_empty(),
                    )
                });
                tracing.hash(h);
            }
            Trait::Plugins => self.wasm_plugins().hash(h),
            Trait::Allocated => self.allocated_view().hash(h),
            Trait::PodOfHeadless => self.pod_of_headless().hash(h),
            Trait::Gateways => {
                for bound in self.gateways() {
                    bound.object.key.hash(h);
                }
            }
            Trait::NodeNetwork => self.node_network().hash(h),
            Trait::Identity => proxy.verified_account.hash(h),
        }
    }

    /// A resource from the cache, built on a miss with only `traits` of the proxy readable; no
    /// EnvoyFilter patches it (an assignment, a name table).
    pub(super) fn keyed(
        &self,
        ty: ResourceType,
        name: &str,
        (traits, extra): (Traits, &impl Hash),
        stamp: [u64; 4],
        build: impl FnOnce() -> Option<Resource>,
    ) -> Option<Arc<Resource>> {
        let key = self.key(traits, extra);
        self.cache
            .get_or_build(ty, name, key, stamp, || self.reading(traits, build))
    }

    /// A listener, route configuration or cluster from the cache, built and patched on a miss
    /// (under a variant of its own where the proxy's EnvoyFilters change it; their contexts
    /// follow the proxy's kind).
    pub(super) fn cached(
        &self,
        ty: ResourceType,
        name: &str,
        (traits, extra): (Traits, &impl Hash),
        stamp: [u64; 4],
        build: impl FnOnce() -> Option<Resource>,
    ) -> Option<Arc<Resource>> {
        let patches = self.envoy_filters();
        let traits = match patches.touches(ty) {
            true => traits.with(Traits::of(&[Trait::Kind])),
            false => traits,
        };
        let key = patches.variant(ty, self.key(traits, extra));
        self.cache.get_or_build(ty, name, key, stamp, || {
            self.reading(traits, || self.patch(patches, ty, build()?))
        })
    }

    /// A list shared by proxies with these traits (and EnvoyFilters where they change it).
    pub(super) fn cached_list(
        &self,
        ty: ResourceType,
        (traits, extra): (Traits, &impl Hash),
        stamp: [u64; 4],
        build: impl FnOnce() -> Vec<Arc<Resource>>,
    ) -> Arc<SharedList> {
        let patches = self.envoy_filters();
        let traits = match patches.touches(ty) {
            true => traits.with(Traits::of(&[Trait::Kind])),
            false => traits,
        };
        let key = patches.variant(ty, self.key(traits, extra));
        self.cache
            .list(ty, key, stamp, || self.reading(traits, build))
    }

    /// A resource built for this proxy alone, patched.
    pub(super) fn finish(&self, ty: ResourceType, resource: Resource) -> Option<Arc<Resource>> {
        self.patch(self.envoy_filters(), ty, resource).map(Arc::new)
    }

    /// `resource` with the proxy's EnvoyFilter patches applied, where they change its type; the
    /// patches read the proxy through its accessors.
    fn patch(
        &self,
        patches: &ProxyPatches,
        ty: ResourceType,
        resource: Resource,
    ) -> Option<Resource> {
        if !patches.touches(ty) {
            return Some(resource);
        }
        let target = Patched {
            kind: self.proxy_type(),
            mesh: self.mesh,
            own_addresses: Box::new(|| self.addresses().to_vec()),
        };
        patches.apply(ty, resource, &target)
    }

    /// The listeners every proxy with these traits shares, assembled by `build` once per
    /// snapshot version (they match headless services' pods: their endpoints stamp it).
    pub(super) fn shared_listeners(
        &self,
        traits: Traits,
        build: impl FnOnce() -> Vec<Arc<Resource>>,
    ) -> Arc<SharedList> {
        let stamp = [
            self.services_version(),
            self.mesh.pods_version,
            0,
            self.config_version(),
        ];
        self.cached_list(ResourceType::Listener, (traits, &()), stamp, build)
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::xds::proxy::tests::node;
    use envoy_types::pb::envoy::config::cluster::v3::Cluster;

    fn proxy(id: &str) -> Proxy {
        Proxy::from_node(Some(&node(id, &[("CLUSTER_ID", "c1")]))).expect("a proxy")
    }

    fn built(g: &Generation<'_>, name: &str, reads: Traits, read: impl FnOnce()) {
        g.cached(
            ResourceType::Cluster,
            name,
            (reads, &()),
            [1, 0, 0, 0],
            || {
                read();
                Some(Resource::encode(name, &Cluster::default()))
            },
        );
    }

    #[test]
    fn a_build_reads_what_its_key_holds() {
        let (mesh, cache) = (MeshSnapshot::default(), ResourceCache::default());
        let p = proxy("sidecar~10.0.0.1~a-1.shop~shop.svc.cluster.local");
        let g = Generation::new(&mesh, &cache, &p);
        let reads = Traits::of(&[Trait::Namespace, Trait::Cluster]);
        built(&g, "ok", reads, || {
            g.namespace();
            g.cluster_id();
        });
        // Outside any build, the proxy's own resources read anything.
        g.labels();
    }

    #[test]
    fn proxies_differing_in_a_trait_read_get_their_own_entry() {
        let (mesh, cache) = (MeshSnapshot::default(), ResourceCache::default());
        let one = proxy("sidecar~10.0.0.1~a-1.shop~shop.svc.cluster.local");
        let two = proxy("sidecar~10.0.0.2~a-2.shop~shop.svc.cluster.local");
        let other = proxy("sidecar~10.0.0.3~a-1.bank~bank.svc.cluster.local");
        let reads = Traits::of(&[Trait::Namespace]);
        let name = |p: &Proxy| {
            let g = Generation::new(&mesh, &cache, p);
            let built = g.cached(
                ResourceType::Cluster,
                "c",
                (reads, &()),
                [1, 0, 0, 0],
                || Some(Resource::encode(g.namespace(), &Cluster::default())),
            );
            built.expect("built").name.to_string()
        };
        assert_eq!(name(&one), "shop");
        assert_eq!(name(&two), "shop", "the same namespace shares");
        assert_eq!(name(&other), "bank");
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "read the proxy's Addresses")]
    fn a_build_reading_a_trait_its_key_lacks_fails() {
        let (mesh, cache) = (MeshSnapshot::default(), ResourceCache::default());
        let p = proxy("sidecar~10.0.0.1~a-1.shop~shop.svc.cluster.local");
        let g = Generation::new(&mesh, &cache, &p);
        built(&g, "leaky", Traits::of(&[Trait::Namespace]), || {
            g.addresses();
        });
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "read the proxy's Network")]
    fn a_build_nested_in_another_reads_no_more_than_it() {
        let (mesh, cache) = (MeshSnapshot::default(), ResourceCache::default());
        let p = proxy("sidecar~10.0.0.1~a-1.shop~shop.svc.cluster.local");
        let g = Generation::new(&mesh, &cache, &p);
        built(&g, "outer", Traits::of(&[Trait::Namespace]), || {
            built(&g, "inner", Traits::of(&[Trait::Network]), || {});
        });
    }
}
