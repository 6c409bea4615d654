//! Which VirtualServices and Gateways apply, as istiod selects them: for a sidecar, the
//! VirtualServices bound to `mesh` and exported to its namespace whose hosts cover a service (the
//! most specific host wins; several for one host merge, oldest first; delegates expanded); for a
//! gateway proxy, the Gateways whose selector its labels satisfy and the VirtualServices bound to
//! them.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::config::ConfigStore;
use super::sidecar_scope::EgressScope;
use crate::istio::virtual_service::{
    Destination, HttpMatch, HttpRoute, StringMatch, TcpRoute, TlsRoute, INGRESS_SEMANTICS,
    ROUTE_SEMANTICS,
};
use crate::istio::{ConfigKey, ConfigKind, ConfigObject, Gateway, Spec, VirtualService};

/// The routes one host has for a proxy, destinations fully qualified.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HostRoutes {
    /// The VirtualServices they come from, oldest first.
    pub keys: Vec<ConfigKey>,
    pub http: Vec<HttpRoute>,
    pub tcp: Vec<TcpRoute>,
    pub tls: Vec<TlsRoute>,
}

/// A Gateway that selects a proxy, and the VirtualServices bound to it.
#[derive(Clone, Debug)]
pub struct BoundGateway {
    pub object: Arc<ConfigObject>,
    pub gateway: Arc<Gateway>,
    pub virtual_services: Vec<(Arc<ConfigObject>, Arc<VirtualService>)>,
}

impl ConfigStore {
    pub(super) fn virtual_services(
        &self,
    ) -> impl Iterator<Item = (&Arc<ConfigObject>, &VirtualService)> {
        self.derived()
            .virtual_services
            .iter()
            .filter_map(|o| match &o.spec {
                Spec::VirtualService(vs) => Some((o, &**vs)),
                _ => None,
            })
    }

    /// Whether some VirtualService routes by the client's labels (routes then depend on them).
    pub fn routes_use_source_labels(&self) -> bool {
        self.derived().source_labels_used
    }

    /// Whether some VirtualService route matches on the client's namespace.
    pub fn routes_use_source_namespace(&self) -> bool {
        self.derived().source_namespace_used
    }

    /// Whether which VirtualServices a sidecar gets depends on its namespace: some is exported to
    /// fewer than every namespace.
    pub fn routes_vary_by_namespace(&self) -> bool {
        self.derived().routes_scoped
    }

    /// The VirtualService routes sidecars in `proxy_ns` apply to `host`; with a Sidecar, only
    /// those its egress listener for the port imports.
    pub fn mesh_routes(
        &self,
        proxy_ns: &str,
        host: &str,
        scope: Option<&EgressScope>,
    ) -> Option<HostRoutes> {
        let candidates: Vec<(&Arc<ConfigObject>, &VirtualService, usize)> = self
            .virtual_services()
            .filter(|(o, vs)| {
                vs.for_mesh() && !vs.hosts.is_empty() && self.exported_to(o, proxy_ns)
            })
            .filter_map(|(o, vs)| {
                let hosts: Vec<String> = vs
                    .hosts
                    .iter()
                    .map(|h| self.qualify(h, &o.key.namespace))
                    .collect();
                if let Some(scope) = scope {
                    let imported =
                        scope.imports_config(&o.key.namespace, hosts.iter().map(String::as_str));
                    if !imported {
                        return None;
                    }
                }
                let best = hosts.iter().filter_map(|h| host_match(h, host)).max()?;
                Some((o, vs, best))
            })
            .collect();
        let best = candidates.iter().map(|(_, _, m)| *m).max()?;
        let mut routes = HostRoutes::default();
        for (object, vs, _) in candidates.into_iter().filter(|(_, _, m)| *m == best) {
            self.add_routes(&mut routes, object, vs);
        }
        Some(routes)
    }

    /// Every mesh VirtualService exported to sidecars in `proxy_ns` (with a Sidecar, imported by
    /// its egress listener) whose hosts overlap `host` either way, oldest first: what istiod's
    /// TCP and TLS routes on a sidecar's outbound listener consult (`getConfigsForHost`,
    /// pilot/pkg/networking/core/tls.go), unlike HTTP, where the most specific host wins.
    pub fn mesh_l4_routes(
        &self,
        proxy_ns: &str,
        host: &str,
        scope: Option<&EgressScope>,
    ) -> Vec<(Arc<ConfigObject>, Arc<VirtualService>)> {
        self.virtual_services()
            .filter(|(o, vs)| {
                vs.for_mesh() && !vs.hosts.is_empty() && self.exported_to(o, proxy_ns)
            })
            .filter_map(|(o, vs)| {
                let ns = &o.key.namespace;
                let hosts: Vec<String> = vs.hosts.iter().map(|h| self.qualify(h, ns)).collect();
                let imported = scope
                    .is_none_or(|scope| scope.imports_config(ns, hosts.iter().map(String::as_str)));
                let overlaps = hosts
                    .iter()
                    .any(|h| host_match(h, host).is_some() || host_match(host, h).is_some());
                (imported && overlaps).then(|| {
                    let mut qualified = vs.clone();
                    for route in &mut qualified.tls {
                        for d in &mut route.route {
                            self.qualify_destination(&mut d.destination, ns);
                        }
                    }
                    (o.clone(), Arc::new(qualified))
                })
            })
            .collect()
    }

    /// Appends a VirtualService's routes (delegates expanded, hosts qualified).
    pub(super) fn add_routes(
        &self,
        routes: &mut HostRoutes,
        object: &ConfigObject,
        vs: &VirtualService,
    ) {
        let ns = &object.key.namespace;
        routes.keys.push(object.key.clone());
        for route in &vs.http {
            match &route.delegate {
                None => routes
                    .http
                    .push(self.qualified(with_semantics(object, route), ns)),
                Some(delegate) => {
                    let key = ConfigKey {
                        kind: ConfigKind::VirtualService,
                        namespace: match delegate.namespace.as_str() {
                            "" => ns.clone(),
                            other => other.into(),
                        },
                        name: delegate.name.as_str().into(),
                    };
                    let Some(Spec::VirtualService(child)) = self.get(&key).map(|o| &o.spec) else {
                        continue;
                    };
                    routes.keys.push(key.clone());
                    for child_route in &child.http {
                        let mut merged = child_route.clone();
                        merged.matches = merge_matches(&route.matches, &child_route.matches);
                        routes.http.push(self.qualified(merged, &key.namespace));
                    }
                }
            }
        }
        routes.tcp.extend(vs.tcp.iter().map(|r| {
            let mut r = r.clone();
            for d in &mut r.route {
                self.qualify_destination(&mut d.destination, ns);
            }
            r
        }));
        routes.tls.extend(vs.tls.iter().map(|r| {
            let mut r = r.clone();
            for d in &mut r.route {
                self.qualify_destination(&mut d.destination, ns);
            }
            r
        }));
    }

    fn qualified(&self, mut route: HttpRoute, namespace: &str) -> HttpRoute {
        for d in &mut route.route {
            self.qualify_destination(&mut d.destination, namespace);
        }
        if let Some(mirror) = &mut route.mirror {
            self.qualify_destination(mirror, namespace);
        }
        for mirror in &mut route.mirrors {
            self.qualify_destination(&mut mirror.destination, namespace);
        }
        route
    }

    fn qualify_destination(&self, destination: &mut Destination, namespace: &str) {
        destination.host = self.qualify(&destination.host, namespace);
    }

    /// Every Gateway selecting a proxy with `labels` (in any namespace, as istiod by default), and
    /// every Gateway API listener it serves (by the Gateway's name label in the proxy's
    /// `namespace`, or as a workload of the Service the Gateway names: `serves`), with the
    /// VirtualServices bound to it (`<namespace>/<name>`, or `<name>` in the VirtualService's
    /// namespace).
    pub fn gateways_for(
        &self,
        labels: &BTreeMap<String, String>,
        namespace: &str,
        serves: &dyn Fn(&str) -> bool,
    ) -> Vec<BoundGateway> {
        let derived = self.derived();
        let selected = derived.gateways.iter().filter(|o| match &o.spec {
            Spec::Gateway(gw) => {
                !gw.selector.is_empty() && gw.selector.iter().all(|(k, v)| labels.get(k) == Some(v))
            }
            _ => false,
        });
        let compiled = derived
            .gateway_api
            .gateways
            .iter()
            .filter(|c| c.selects(labels, namespace, serves))
            .map(|c| &c.object);
        selected
            .chain(compiled)
            .filter_map(|o| match &o.spec {
                Spec::Gateway(gw) => Some((o, gw)),
                _ => None,
            })
            .map(|(object, gateway)| {
                let full = format!("{}/{}", object.key.namespace, object.key.name);
                let virtual_services = self
                    .virtual_services()
                    .filter(|(vs_object, vs)| {
                        vs.gateways.iter().any(|g| {
                            *g == full
                                || (*g == *object.key.name
                                    && vs_object.key.namespace == object.key.namespace)
                        })
                    })
                    .map(|(o, vs)| {
                        let mut qualified = vs.clone();
                        let ns = &o.key.namespace;
                        qualified.hosts = vs.hosts.iter().map(|h| self.qualify(h, ns)).collect();
                        qualified.http = vs
                            .http
                            .iter()
                            .map(|r| self.qualified(with_semantics(o, r), ns))
                            .collect();
                        for route in &mut qualified.tcp {
                            for d in &mut route.route {
                                self.qualify_destination(&mut d.destination, ns);
                            }
                        }
                        for route in &mut qualified.tls {
                            for d in &mut route.route {
                                self.qualify_destination(&mut d.destination, ns);
                            }
                        }
                        (o.clone(), Arc::new(qualified))
                    })
                    .collect();
                BoundGateway {
                    object: object.clone(),
                    gateway: Arc::new((**gateway).clone()),
                    virtual_services,
                }
            })
            .collect()
    }
}

/// A route as its VirtualService's route semantics read it: one made from an Ingress matches a
/// prefix (but `/`) by whole path segments, trailing slashes aside.
fn with_semantics(object: &ConfigObject, route: &HttpRoute) -> HttpRoute {
    let mut route = route.clone();
    let semantics = object.meta.annotations.get(ROUTE_SEMANTICS);
    if semantics.map(String::as_str) != Some(INGRESS_SEMANTICS) {
        return route;
    }
    for m in &mut route.matches {
        if let Some(StringMatch::Prefix(prefix)) = &m.uri {
            let segments = prefix.trim_end_matches('/');
            if !segments.is_empty() {
                m.uri = Some(StringMatch::PathSeparatedPrefix(segments.to_string()));
            }
        }
    }
    route
}

/// A delegate's matches within its root route's: each pair combined, the delegate's conditions
/// added to (and on the same field replacing) the root's.
fn merge_matches(root: &[HttpMatch], child: &[HttpMatch]) -> Vec<HttpMatch> {
    match (root.is_empty(), child.is_empty()) {
        (true, _) => child.to_vec(),
        (false, true) => root.to_vec(),
        (false, false) => root
            .iter()
            .flat_map(|r| {
                child.iter().map(move |c| {
                    let mut m = r.clone();
                    m.uri = c.uri.clone().or(m.uri);
                    m.method = c.method.clone().or(m.method);
                    m.authority = c.authority.clone().or(m.authority);
                    m.scheme = c.scheme.clone().or(m.scheme);
                    m.headers.extend(c.headers.clone());
                    m.query_params.extend(c.query_params.clone());
                    m.without_headers.extend(c.without_headers.clone());
                    m
                })
            })
            .collect(),
    }
}

/// How specifically a route's host covers a service host: exact beats any wildcard, longer
/// wildcards beat shorter ones.
pub fn host_match(route_host: &str, host: &str) -> Option<usize> {
    if route_host == host {
        return Some(usize::MAX);
    }
    if route_host == "*" {
        return Some(0);
    }
    let suffix = route_host.strip_prefix('*')?;
    host.ends_with(suffix).then_some(suffix.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::istio::test_object;
    use crate::model::{ConfigChange, ConfigSource};

    fn object(
        kind: &str,
        ns: &str,
        name: &str,
        spec: serde_json::Value,
        created: &str,
    ) -> Arc<ConfigObject> {
        test_object(kind, ns, name, created, spec)
    }

    fn store(objects: Vec<Arc<ConfigObject>>) -> ConfigStore {
        let mut store = ConfigStore::default();
        store.apply(
            ConfigSource::Files,
            objects.into_iter().map(ConfigChange::Upsert).collect(),
        );
        store
    }

    const HOST: &str = "reviews.shop.svc.cluster.local";

    #[test]
    fn routes_for_one_host_merge_oldest_first_and_exact_beats_wildcard() {
        let route = |dest: &str| serde_json::json!({"http": [{"route": [{"destination": {"host": dest}}]}]});
        let mut a = route("reviews");
        a["hosts"] = serde_json::json!(["reviews"]);
        let mut b = route("reviews-b");
        b["hosts"] = serde_json::json!([HOST]);
        let mut wild = route("other");
        wild["hosts"] = serde_json::json!(["*.svc.cluster.local"]);
        let s = store(vec![
            object("VirtualService", "shop", "b", b, "2"),
            object("VirtualService", "shop", "a", a, "1"),
            object("VirtualService", "shop", "wild", wild, "0"),
        ]);
        let routes = s.mesh_routes("shop", HOST, None).unwrap();
        let dests: Vec<&str> = routes
            .http
            .iter()
            .map(|r| r.route[0].destination.host.as_str())
            .collect();
        assert_eq!(dests, [HOST, "reviews-b.shop.svc.cluster.local"]);
        assert!(
            s.mesh_routes("shop", "x.svc.cluster.local", None).is_some(),
            "the wildcard"
        );
    }

    #[test]
    fn delegates_are_expanded_with_merged_matches() {
        let root = serde_json::json!({
            "hosts": ["reviews"],
            "http": [{"match": [{"uri": {"prefix": "/api"}}], "delegate": {"name": "child"}}]
        });
        let child = serde_json::json!({
            "http": [{"match": [{"headers": {"x": {"exact": "1"}}}], "route": [{"destination": {"host": "v2"}}]}]
        });
        let s = store(vec![
            object("VirtualService", "shop", "root", root, "1"),
            object("VirtualService", "shop", "child", child, "1"),
        ]);
        let routes = s.mesh_routes("shop", HOST, None).unwrap();
        assert_eq!(routes.keys.len(), 2);
        let m = &routes.http[0].matches[0];
        assert!(m.uri.is_some() && m.headers.contains_key("x"));
        assert_eq!(
            routes.http[0].route[0].destination.host,
            "v2.shop.svc.cluster.local"
        );
    }

    #[test]
    fn gateways_select_by_labels_and_bind_virtual_services() {
        let gw = serde_json::json!({"selector": {"istio": "ingressgateway"}, "servers": [{"port": {"number": 80, "name": "http", "protocol": "HTTP"}, "hosts": ["*"]}]});
        let vs = serde_json::json!({"hosts": ["bookinfo.example.com"], "gateways": ["istio-system/ingress"], "http": [{"route": [{"destination": {"host": "productpage.shop.svc.cluster.local"}}]}]});
        let s = store(vec![
            object("Gateway", "istio-system", "ingress", gw, "1"),
            object("VirtualService", "shop", "front", vs, "1"),
        ]);
        let labels = BTreeMap::from([("istio".to_string(), "ingressgateway".to_string())]);
        let bound = s.gateways_for(&labels, "ingress", &|_| false);
        assert_eq!(bound.len(), 1);
        assert_eq!(bound[0].virtual_services.len(), 1);
        assert!(s
            .gateways_for(&BTreeMap::new(), "ingress", &|_| false)
            .is_empty());
    }
}
