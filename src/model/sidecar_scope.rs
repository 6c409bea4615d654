//! Sidecar scoping, as istiod applies a Sidecar resource: which Sidecar a proxy gets (one selecting
//! its labels in its namespace, else its namespace's default, else the root namespace's default),
//! and what each egress listener imports — services whose namespace and hostname its hosts name,
//! the VirtualServices likewise (by their own namespace), and the services those VirtualServices
//! route to. A scope is compiled once per (Sidecar, proxy namespace) and config version.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use super::config::ConfigStore;
use super::routing::HostRoutes;
use super::{Protocol, Service};
use crate::istio::mesh::OutboundMode;
use crate::istio::sidecar::{EgressHost, HostNamespace, IngressEndpoint, Sidecar};
use crate::istio::virtual_service::{Destination, HttpMatch};
use crate::istio::{ConfigKey, ConfigObject, VirtualService};

/// What the proxies a Sidecar applies to (in one namespace) hear about.
#[derive(Debug)]
pub struct SidecarScope {
    pub key: ConfigKey,
    /// Port-specific listeners first, the catch-all (if any) last, as validation orders them.
    listeners: Vec<EgressScope>,
    outbound_mode: Option<OutboundMode>,
    /// The inbound ports the Sidecar declares, in place of the workload's services' (none: those).
    ingress: Vec<IngressPort>,
}

/// An inbound port of a Sidecar's `ingress`: what arrives there, and where it goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IngressPort {
    pub port: u16,
    pub protocol: Protocol,
    pub endpoint: IngressEndpoint,
}

/// One egress listener's imports.
#[derive(Debug)]
pub struct EgressScope {
    port: Option<u16>,
    /// (namespace, host): `None` is any namespace; `.` is already the proxy's.
    hosts: Vec<(Option<Arc<str>>, String)>,
    /// Hosts the imported VirtualServices route to → the ports they name (None: every port).
    destinations: HashMap<String, Option<BTreeSet<u16>>>,
}

impl SidecarScope {
    fn compile(store: &ConfigStore, key: &ConfigKey, sidecar: &Sidecar, proxy_ns: &str) -> Self {
        let listeners = sidecar
            .egress_listeners()
            .iter()
            .map(|listener| {
                let hosts = listener
                    .hosts
                    .iter()
                    .filter_map(|h| EgressHost::parse(h).ok())
                    .filter_map(|h| {
                        let ns = match h.namespace {
                            HostNamespace::Any => None,
                            HostNamespace::Own => Some(Arc::from(proxy_ns)),
                            HostNamespace::Named(ns) => Some(Arc::from(ns)),
                            HostNamespace::None => return None,
                        };
                        Some((ns, h.host))
                    })
                    .collect();
                let mut scope = EgressScope {
                    port: listener
                        .port
                        .as_ref()
                        .and_then(|p| u16::try_from(p.number).ok()),
                    hosts,
                    destinations: HashMap::new(),
                };
                scope.destinations = store.virtual_service_destinations(proxy_ns, &scope);
                scope
            })
            .collect();
        let ingress = (sidecar.ingress.iter())
            .filter_map(|listener| {
                let port = listener.port.as_ref()?;
                Some(IngressPort {
                    port: u16::try_from(port.number).ok()?,
                    protocol: Protocol::from_name(&port.protocol),
                    endpoint: listener.endpoint().ok()?,
                })
            })
            .collect();
        Self {
            key: key.clone(),
            listeners,
            outbound_mode: sidecar.outbound_traffic_policy.as_ref().map(|p| p.mode),
            ingress,
        }
    }

    /// The Sidecar's ingress ports; empty when it declares none.
    pub fn ingress(&self) -> &[IngressPort] {
        &self.ingress
    }

    /// The listener traffic to `port` goes through: the one naming the port, else the catch-all.
    pub fn listener(&self, port: u16) -> Option<&EgressScope> {
        self.listeners
            .iter()
            .find(|l| l.port == Some(port))
            .or_else(|| self.listeners.iter().find(|l| l.port.is_none()))
    }

    /// Whether the proxy hears of `service` on `port`.
    pub fn sees(&self, service: &Service, port: u16) -> bool {
        self.listener(port)
            .is_some_and(|l| l.imports(service, port))
    }

    /// Whether the proxy hears of `service` on any of its ports.
    pub fn sees_service(&self, service: &Service) -> bool {
        service.ports.iter().any(|p| self.sees(service, p.port))
    }

    /// The Sidecar's `outboundTrafficPolicy`, which replaces the mesh's.
    pub fn outbound_mode(&self) -> Option<OutboundMode> {
        self.outbound_mode
    }
}

impl EgressScope {
    fn imports(&self, service: &Service, port: u16) -> bool {
        self.names(&service.namespace, &service.hostname)
            || self
                .destinations
                .get(&*service.hostname)
                .is_some_and(|ports| ports.as_ref().is_none_or(|p| p.contains(&port)))
    }

    /// Whether the hosts name `host` of a service or config in `namespace`.
    fn names(&self, namespace: &str, host: &str) -> bool {
        self.hosts
            .iter()
            .any(|(ns, h)| ns.as_deref().is_none_or(|ns| ns == namespace) && hosts_overlap(h, host))
    }

    /// Whether a VirtualService in `namespace` with these (qualified) hosts is imported.
    pub fn imports_config<'h>(
        &self,
        namespace: &str,
        mut hosts: impl Iterator<Item = &'h str>,
    ) -> bool {
        hosts.any(|h| self.names(namespace, h))
    }
}

impl ConfigStore {
    /// The hosts (and ports) the VirtualServices a listener imports route proxies of `proxy_ns` to.
    fn virtual_service_destinations(
        &self,
        proxy_ns: &str,
        scope: &EgressScope,
    ) -> HashMap<String, Option<BTreeSet<u16>>> {
        // Host → the ports routed to; None: every port (a destination without one).
        let mut destinations: HashMap<String, Option<BTreeSet<u16>>> = HashMap::new();
        let mut add = |d: &Destination| {
            let ports = destinations
                .entry(d.host.clone())
                .or_insert_with(|| Some(BTreeSet::new()));
            match d.port.as_ref().and_then(|p| u16::try_from(p.number).ok()) {
                Some(port) => {
                    if let Some(ports) = ports {
                        ports.insert(port);
                    }
                }
                None => *ports = None,
            }
        };
        let from_here = |matches: &[HttpMatch]| {
            matches.is_empty()
                || matches
                    .iter()
                    .any(|m| m.source_namespace.is_empty() || m.source_namespace == proxy_ns)
        };
        for (object, vs) in self.imported_virtual_services(proxy_ns, scope) {
            let mut routes = HostRoutes::default();
            self.add_routes(&mut routes, object, vs);
            for route in routes.http.iter().filter(|r| from_here(&r.matches)) {
                route.route.iter().for_each(|d| add(&d.destination));
                route.mirror.iter().for_each(&mut add);
                route.mirrors.iter().for_each(|m| add(&m.destination));
            }
            let tcp = routes.tcp.iter().flat_map(|r| &r.route);
            let tls = routes.tls.iter().flat_map(|r| &r.route);
            tcp.chain(tls).for_each(|d| add(&d.destination));
        }
        destinations
    }

    fn imported_virtual_services<'s>(
        &'s self,
        proxy_ns: &'s str,
        scope: &'s EgressScope,
    ) -> impl Iterator<Item = (&'s Arc<ConfigObject>, &'s VirtualService)> + 's {
        self.virtual_services().filter(move |(o, vs)| {
            vs.for_mesh()
                && self.exported_to(o, proxy_ns)
                && scope.imports_config(
                    &o.key.namespace,
                    vs.hosts
                        .iter()
                        .map(|h| self.qualify(h, &o.key.namespace))
                        .collect::<Vec<_>>()
                        .iter()
                        .map(String::as_str),
                )
        })
    }

    /// The Sidecar that applies to a sidecar proxy in `proxy_ns` with `labels`, compiled for that
    /// namespace; None when none does (the proxy hears of everything exported to it).
    pub fn sidecar_scope(
        &self,
        proxy_ns: &str,
        labels: &BTreeMap<String, String>,
    ) -> Option<Arc<SidecarScope>> {
        let derived = self.derived();
        let selects = |(_, s): &&(ConfigKey, Arc<Sidecar>)| {
            s.workload_selector
                .as_ref()
                .is_none_or(|sel| sel.labels.iter().all(|(k, v)| labels.get(k) == Some(v)))
        };
        let root = self.mesh().root_namespace.as_str();
        let (key, sidecar) = derived
            .sidecars
            .get(proxy_ns)
            .and_then(|all| all.iter().find(selects))
            .or_else(|| {
                let defaults = derived.sidecars.get(root)?;
                defaults.iter().find(|(_, s)| s.workload_selector.is_none())
            })?;
        let cached = derived
            .sidecar_scopes
            .lock()
            .get(key)
            .and_then(|by_ns| by_ns.get(proxy_ns).cloned());
        if cached.is_some() {
            return cached;
        }
        // Compiled outside the lock: two proxies racing compile the same value.
        let scope = Arc::new(SidecarScope::compile(self, key, sidecar, proxy_ns));
        let mut scopes = derived.sidecar_scopes.lock();
        let by_ns = scopes.entry(key.clone()).or_default();
        Some(by_ns.entry(proxy_ns.into()).or_insert(scope).clone())
    }
}

/// Whether two hosts, either possibly a wildcard (`*`, `*.suffix`), can name the same name.
pub fn hosts_overlap(a: &str, b: &str) -> bool {
    if a == b || a == "*" || b == "*" {
        return true;
    }
    match (a.strip_prefix('*'), b.strip_prefix('*')) {
        (Some(sa), Some(sb)) => sa.ends_with(sb) || sb.ends_with(sa),
        (Some(sa), None) => b.ends_with(sa),
        (None, Some(sb)) => a.ends_with(sb),
        (None, None) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::istio::test_object;
    use crate::model::{ConfigChange, ConfigSource, Protocol, Resolution, ServicePort};

    fn object(kind: &str, ns: &str, name: &str, spec: serde_json::Value) -> ConfigChange {
        // Creation order follows the name's length.
        let created = format!("2026-01-01T00:00:{:02}Z", name.len());
        ConfigChange::Upsert(test_object(kind, ns, name, &created, spec))
    }

    fn service(name: &str, ns: &str, ports: &[u16]) -> Service {
        Service {
            hostname: format!("{name}.{ns}.svc.cluster.local").into(),
            name: name.into(),
            namespace: ns.into(),
            registry: crate::model::Registry::Kubernetes,
            ports: ports
                .iter()
                .map(|p| ServicePort {
                    name: format!("http-{p}"),
                    port: *p,
                    protocol: Protocol::Http,
                    target_port: None,
                })
                .collect(),
            cluster_vips: BTreeMap::new(),
            labels: BTreeMap::new(),
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

    fn store(changes: Vec<ConfigChange>) -> ConfigStore {
        let mut store = ConfigStore::default();
        store.apply(ConfigSource::Files, changes);
        store
    }

    #[test]
    fn selection_prefers_a_selector_then_the_namespace_then_the_root_default() {
        let s = store(vec![
            object(
                "Sidecar",
                "shop",
                "narrow",
                serde_json::json!({
                "workloadSelector": {"labels": {"app": "cart"}}, "egress": [{"hosts": ["./*"]}]}),
            ),
            object(
                "Sidecar",
                "shop",
                "default",
                serde_json::json!({"egress": [{"hosts": ["istio-system/*"]}]}),
            ),
            object(
                "Sidecar",
                "istio-system",
                "default",
                serde_json::json!({"egress": [{"hosts": ["./*"]}]}),
            ),
            object(
                "Sidecar",
                "istio-system",
                "picky",
                serde_json::json!({
                "workloadSelector": {"labels": {"app": "cart"}}, "egress": [{"hosts": ["*/*"]}]}),
            ),
        ]);
        let cart = BTreeMap::from([("app".to_string(), "cart".to_string())]);
        let other = BTreeMap::new();
        assert_eq!(&*s.sidecar_scope("shop", &cart).unwrap().key.name, "narrow");
        assert_eq!(
            &*s.sidecar_scope("shop", &other).unwrap().key.name,
            "default"
        );
        let root_default = s.sidecar_scope("bank", &cart).unwrap();
        assert_eq!(&*root_default.key.namespace, "istio-system");
        // `.` in the root default is the proxy's own namespace.
        assert!(root_default.sees_service(&service("teller", "bank", &[80])));
        assert!(!root_default.sees_service(&service("cart", "shop", &[80])));
        assert!(store(vec![]).sidecar_scope("shop", &other).is_none());
    }

    #[test]
    fn hosts_import_by_namespace_and_name_and_ports_pick_their_listener() {
        let s = store(vec![object(
            "Sidecar",
            "shop",
            "default",
            serde_json::json!({"egress": [
                {"port": {"number": 9080, "protocol": "HTTP"}, "hosts": ["bank/*"]},
                {"hosts": ["./*", "*/*.payments.svc.cluster.local", "~/*"]}
            ]}),
        )]);
        let scope = s.sidecar_scope("shop", &BTreeMap::new()).unwrap();
        assert!(scope.sees(&service("cart", "shop", &[80]), 80));
        assert!(scope.sees(&service("card", "payments", &[80]), 80));
        assert!(!scope.sees(&service("teller", "bank", &[80]), 80));
        let teller = service("teller", "bank", &[80, 9080]);
        assert!(scope.sees(&teller, 9080));
        assert!(!scope.sees(&teller, 80));
        // The port's own listener replaces the catch-all on that port.
        assert!(!scope.sees(&service("cart", "shop", &[9080]), 9080));
    }

    #[test]
    fn virtual_services_in_scope_bring_their_destinations() {
        let s = store(vec![
            object(
                "Sidecar",
                "shop",
                "default",
                serde_json::json!({"egress": [{"hosts": ["./*"]}]}),
            ),
            object(
                "VirtualService",
                "shop",
                "front",
                serde_json::json!({
                "hosts": ["front"],
                "http": [{"route": [{"destination": {"host": "ledger.bank.svc.cluster.local",
                    "port": {"number": 8080}}}]}]}),
            ),
            object(
                "VirtualService",
                "bank",
                "elsewhere",
                serde_json::json!({
                "hosts": ["vault"],
                "http": [{"route": [{"destination": {"host": "vault"}}]}]}),
            ),
        ]);
        let scope = s.sidecar_scope("shop", &BTreeMap::new()).unwrap();
        let ledger = service("ledger", "bank", &[80, 8080]);
        assert!(scope.sees(&ledger, 8080));
        assert!(!scope.sees(&ledger, 80));
        assert!(!scope.sees_service(&service("vault", "bank", &[80])));
    }

    #[test]
    fn wildcards_overlap_both_ways() {
        assert!(hosts_overlap("*", "a.b"));
        assert!(hosts_overlap("*.b.com", "a.b.com"));
        assert!(hosts_overlap("a.b.com", "*.b.com"));
        assert!(hosts_overlap("*.com", "*.b.com"));
        assert!(!hosts_overlap("*.b.com", "b.com"));
        assert!(!hosts_overlap("a.com", "b.com"));
    }
}
