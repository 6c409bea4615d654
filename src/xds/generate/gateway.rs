//! Gateway proxies (routers): listeners and routes from the Gateways whose `selector` matches the
//! proxy's labels (in any namespace, istiod's default) and the VirtualServices bound to them.
//!
//! One listener `0.0.0.0_<port>` per port, bound where the gateway's Service sends the server's
//! port (the workload's target port), else on the server's port itself:
//! - plain HTTP servers share one connection manager, routes over RDS `http.<port>`;
//! - HTTPS servers that terminate TLS get a chain each, matched by SNI, with RDS
//!   `https.<port>.<port name>.<gateway>.<namespace>` (istiod's names);
//! - TLS servers that terminate TLS, and TCP servers, proxy to their bound TCP routes;
//! - PASSTHROUGH servers route by SNI per bound TLS route; AUTO_PASSTHROUGH servers by the mesh's
//!   own SNI (`outbound_.<port>_.<subset>_.<host>`): an east-west gateway.
//!
//! A router no Gateway selects but labelled `istio: eastwestgateway` gets the AUTO_PASSTHROUGH
//! listener on 15443 (a fallback for meshes that never applied the cross-network Gateway).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use envoy_types::pb::envoy::config::listener::v3::{
    listener_filter, Filter, FilterChain, FilterChainMatch, Listener, ListenerFilter,
};
use envoy_types::pb::envoy::config::route::v3::{
    virtual_host::TlsRequirementType, RouteConfiguration, VirtualHost,
};
use envoy_types::pb::envoy::extensions::filters::listener::tls_inspector::v3::TlsInspector;
use envoy_types::pb::google::protobuf::BoolValue;
use envoy_types::util::pack_any;
use tracing::debug;

use super::routes::{cluster_for, http_routes, RouteContext};
use super::security::WorkloadSecurity;
use super::{cds, gateway_tls, lds, parse_port, rds, socket, Generation};
use crate::istio::gateway::{Server, ServerTlsMode};
use crate::istio::virtual_service::{RouteDestination, VirtualService};
use crate::model::{host_match, BoundGateway, Resolution};
use crate::xds::proxy::{Generator, ProxyType};
use crate::xds::wire::Resource;

/// The port of Istio's cross-network (AUTO_PASSTHROUGH) server.
const EAST_WEST_PORT: u16 = 15443;
const HTTP_ALPN: [&str; 2] = ["h2", "http/1.1"];

/// A router fed by this module (Envoy gateways; proxyless clients have their own generator).
pub fn is_router(g: &Generation<'_>) -> bool {
    g.proxy.kind == ProxyType::Router && g.proxy.generator == Generator::Envoy
}

/// The Gateways selecting this router, with their bound VirtualServices.
fn bound(g: &Generation<'_>) -> Vec<BoundGateway> {
    match is_router(g) {
        true => g.mesh.config.gateways_for(&g.proxy.labels),
        false => Vec::new(),
    }
}

fn labelled_east_west(g: &Generation<'_>) -> bool {
    g.proxy.labels.get("istio").map(String::as_str) == Some("eastwestgateway")
}

/// Which clusters a router needs: the mesh SNI ones (it passes mesh mTLS through by SNI) and the
/// `outbound|…` ones (it routes to services itself).
pub struct ClusterNeeds {
    pub sni: bool,
    pub outbound: bool,
}

pub fn cluster_needs(g: &Generation<'_>) -> ClusterNeeds {
    if !is_router(g) {
        return ClusterNeeds {
            sni: false,
            outbound: true,
        };
    }
    let bound = bound(g);
    if bound.is_empty() {
        let east_west = labelled_east_west(g);
        return ClusterNeeds {
            sni: east_west,
            outbound: !east_west,
        };
    }
    let modes = bound
        .iter()
        .flat_map(|b| &b.gateway.servers)
        .map(|s| s.tls.as_ref().map(|t| t.mode));
    let (auto, other): (Vec<_>, Vec<_>) =
        modes.partition(|m| *m == Some(ServerTlsMode::AutoPassthrough));
    ClusterNeeds {
        sni: !auto.is_empty(),
        outbound: !other.is_empty(),
    }
}

/// One server of a Gateway that selects the proxy.
struct PortServer<'a> {
    bound: &'a BoundGateway,
    server: &'a Server,
    /// `<namespace>/<name>` of its Gateway.
    gateway: String,
}

impl PortServer<'_> {
    fn number(&self) -> u16 {
        u16::try_from(self.server.port.number).unwrap_or_default()
    }

    fn mode(&self) -> Option<ServerTlsMode> {
        self.server.tls.as_ref().map(|t| t.mode)
    }

    fn is_plain_http(&self) -> bool {
        let http = matches!(
            self.server.protocol().as_str(),
            "HTTP" | "HTTP2" | "GRPC" | "GRPC-WEB"
        );
        http && self.mode().is_none_or(|_| self.redirects_to_https())
    }

    fn redirects_to_https(&self) -> bool {
        self.server.tls.as_ref().is_some_and(|t| t.https_redirect)
    }

    /// The RDS route of an HTTP server (istiod's names).
    fn route_name(&self) -> Option<String> {
        if self.is_plain_http() {
            return Some(format!("http.{}", self.number()));
        }
        let terminated_https =
            self.server.protocol() == "HTTPS" && self.mode().is_some_and(gateway_tls::terminates);
        terminated_https.then(|| {
            let (ns, name) = self.gateway.split_once('/').unwrap_or_default();
            let port_name = &self.server.port.name;
            format!("https.{}.{port_name}.{name}.{ns}", self.number())
        })
    }

    /// The server's hosts a VirtualService may use: `<ns>/<host>` admits only that namespace's
    /// VirtualServices (`.` the Gateway's, `*` or nothing any).
    fn admits(&self, vs_namespace: &str, vs_host: &str) -> Option<String> {
        let gateway_ns = self.gateway.split('/').next().unwrap_or_default();
        self.server.hosts.iter().find_map(|entry| {
            let (ns, host) = entry.split_once('/').unwrap_or(("*", entry));
            let ns_ok =
                ns == "*" || ns == vs_namespace || (ns == "." && vs_namespace == gateway_ns);
            if !ns_ok {
                return None;
            }
            // The more specific of the two names is the one served.
            if host_match(host, vs_host).is_some() {
                Some(vs_host.to_string())
            } else {
                host_match(vs_host, host).map(|_| host.to_string())
            }
        })
    }

    /// SNI names the server answers for; empty for `*` (any).
    fn server_names(&self) -> Vec<String> {
        let hosts = self.server.hosts.iter();
        let names: Vec<String> = hosts
            .map(|h| h.split_once('/').map_or(h.as_str(), |(_, host)| host))
            .map(str::to_string)
            .collect();
        match names.iter().any(|h| h == "*") {
            true => Vec::new(),
            false => names,
        }
    }

    /// The bound VirtualServices with a host this server admits.
    fn virtual_services(&self) -> impl Iterator<Item = (&str, &VirtualService)> {
        self.bound
            .virtual_services
            .iter()
            .filter_map(|(object, vs)| {
                let ns = &*object.key.namespace;
                vs.hosts
                    .iter()
                    .any(|h| self.admits(ns, h).is_some())
                    .then_some((ns, &**vs))
            })
    }

    fn applies(&self, gateways: &[String]) -> bool {
        gateways.is_empty()
            || gateways
                .iter()
                .any(|g| *g == self.gateway || self.gateway.rsplit('/').next() == Some(g.as_str()))
    }
}

/// The port a server listens on in the gateway's pod: the target port of its Service's port with
/// the server's number, else that number.
fn listen_port(g: &Generation<'_>, number: u16) -> u16 {
    for ip in &g.proxy.ips {
        for key in g.mesh.endpoints.services_at(ip) {
            let port = g.mesh.services.get(&key.hostname).and_then(|s| {
                let port = s.port(number)?;
                let shards = g.mesh.endpoints.get(&key)?;
                let ep = shards
                    .endpoints()
                    .find(|e| e.address == *ip && *e.service_port_name == *port.name)?;
                Some(ep.port)
            });
            if let Some(port) = port {
                return port;
            }
        }
    }
    number
}

fn servers<'a>(
    g: &Generation<'_>,
    bound: &'a [BoundGateway],
) -> BTreeMap<u16, Vec<PortServer<'a>>> {
    let mut by_port: BTreeMap<u16, Vec<PortServer<'a>>> = BTreeMap::new();
    for b in bound {
        let gateway = format!("{}/{}", b.object.key.namespace, b.object.key.name);
        for server in &b.gateway.servers {
            let ps = PortServer {
                bound: b,
                server,
                gateway: gateway.clone(),
            };
            by_port
                .entry(listen_port(g, ps.number()))
                .or_default()
                .push(ps);
        }
    }
    by_port
}

fn listener_name(port: u16) -> String {
    format!("0.0.0.0_{port}")
}

/// Every listener of a router.
pub fn listeners(g: &Generation<'_>) -> Vec<Arc<Resource>> {
    let bound = bound(g);
    let by_port = servers(g, &bound);
    let ports: Vec<u16> = match bound.is_empty() {
        true if labelled_east_west(g) => vec![EAST_WEST_PORT],
        true => Vec::new(),
        false => by_port.keys().copied().collect(),
    };
    ports
        .into_iter()
        .filter_map(|p| listener(g, p, &by_port))
        .collect()
}

/// A router's listener by name.
pub fn build_listener(g: &Generation<'_>, name: &str) -> Option<Arc<Resource>> {
    let port = parse_port(name.strip_prefix("0.0.0.0_")?)?;
    let bound = bound(g);
    listener(g, port, &servers(g, &bound))
}

/// The listener on `port`, from the servers of the Gateways selecting the router (none: the
/// labelled east-west fallback).
fn listener(
    g: &Generation<'_>,
    port: u16,
    by_port: &BTreeMap<u16, Vec<PortServer<'_>>>,
) -> Option<Arc<Resource>> {
    let name = listener_name(port);
    let chains = if by_port.is_empty() {
        (port == EAST_WEST_PORT && labelled_east_west(g)).then(|| auto_passthrough_chains(g))?
    } else {
        port_chains(g, &name, by_port.get(&port)?)
    };
    let inspect = chains.iter().any(|c| {
        c.filter_chain_match
            .as_ref()
            .is_some_and(|m| !m.transport_protocol.is_empty() || !m.server_names.is_empty())
    });
    let listener = Listener {
        name: name.clone(),
        address: Some(socket("0.0.0.0", port)),
        listener_filters: match inspect {
            true => vec![tls_inspector()],
            false => Vec::new(),
        },
        filter_chains: chains,
        ..Default::default()
    };
    Some(Arc::new(Resource::encode(name, &listener)))
}

/// Filter chains whose matches Envoy would reject as duplicates are left out (logged): the first
/// server to claim an SNI name, or the plaintext default, keeps it.
#[derive(Default)]
struct Chains {
    chains: Vec<FilterChain>,
    sni_taken: BTreeSet<String>,
    any_sni_taken: bool,
    plaintext_taken: bool,
}

impl Chains {
    fn tls(&mut self, names: Vec<String>, mut chain: FilterChain) {
        let wanted = names.len();
        let names: Vec<String> = names
            .into_iter()
            .filter(|n| self.sni_taken.insert(n.clone()))
            .collect();
        let conflict = match wanted {
            0 => std::mem::replace(&mut self.any_sni_taken, true),
            _ => names.is_empty(),
        };
        if conflict {
            debug!(
                chain = chain.name,
                "gateway server conflicts with an earlier one on its port"
            );
            return;
        }
        chain.filter_chain_match = Some(FilterChainMatch {
            server_names: names,
            transport_protocol: "tls".to_string(),
            ..Default::default()
        });
        self.chains.push(chain);
    }

    fn plaintext(&mut self, chain: FilterChain) {
        if std::mem::replace(&mut self.plaintext_taken, true) {
            debug!(
                chain = chain.name,
                "gateway server conflicts with an earlier one on its port"
            );
            return;
        }
        self.chains.push(chain);
    }
}

fn port_chains(g: &Generation<'_>, listener: &str, servers: &[PortServer<'_>]) -> Vec<FilterChain> {
    let security = WorkloadSecurity::for_workload(g.mesh, &g.proxy.namespace, &g.proxy.labels);
    let mut chains = Chains::default();
    for ps in servers {
        let name = format!("{listener}-{}", ps.server.port.name);
        let mode = ps.mode();
        if let Some(route) = ps.route_name() {
            let chain = FilterChain {
                name,
                filters: vec![http_filter(&route, &security)],
                ..Default::default()
            };
            match ps.is_plain_http() {
                true => chains.plaintext(chain),
                false => {
                    let socket = ps
                        .server
                        .tls
                        .as_ref()
                        .map(|t| gateway_tls::server_socket(t, &HTTP_ALPN));
                    chains.tls(
                        ps.server_names(),
                        FilterChain {
                            transport_socket: socket,
                            ..chain
                        },
                    );
                }
            }
            continue;
        }
        match mode {
            Some(ServerTlsMode::AutoPassthrough) => {
                for chain in auto_passthrough_chains(g) {
                    let names = chain
                        .filter_chain_match
                        .clone()
                        .unwrap_or_default()
                        .server_names;
                    chains.tls(names, chain);
                }
            }
            Some(ServerTlsMode::Passthrough) => {
                for (names, filter) in passthrough_routes(g, ps) {
                    let chain = FilterChain {
                        name: format!("{name}-{}", names.join(",")),
                        filters: vec![filter],
                        ..Default::default()
                    };
                    chains.tls(names, chain);
                }
            }
            Some(_) => {
                let Some(mut filters) = tcp_route(g, ps) else {
                    continue;
                };
                filters.splice(0..0, security.network_filters().iter().cloned());
                let socket = ps
                    .server
                    .tls
                    .as_ref()
                    .map(|t| gateway_tls::server_socket(t, &[]));
                let chain = FilterChain {
                    name,
                    filters,
                    transport_socket: socket,
                    ..Default::default()
                };
                chains.tls(ps.server_names(), chain);
            }
            None => {
                let Some(mut filters) = tcp_route(g, ps) else {
                    continue;
                };
                filters.splice(0..0, security.network_filters().iter().cloned());
                chains.plaintext(FilterChain {
                    name,
                    filters,
                    ..Default::default()
                });
            }
        }
    }
    chains.chains
}

/// The connection manager of an HTTP server: the workload's security filters, then the
/// VirtualService filters and the router.
fn http_filter(route: &str, security: &WorkloadSecurity) -> Filter {
    let mut hcm = lds::outbound_hcm(route, lds::rds(route));
    hcm.http_filters
        .splice(0..0, security.http_filters().iter().cloned());
    lds::network_filter(
        "envoy.filters.network.http_connection_manager",
        pack_any(hcm),
    )
}

fn targets(
    g: &Generation<'_>,
    ps: &PortServer<'_>,
    route: &[RouteDestination],
) -> Vec<(String, u32)> {
    let ctx = RouteContext {
        g,
        port: ps.number(),
        gateway: Some(&ps.gateway),
    };
    route
        .iter()
        .map(|d| (cluster_for(&ctx, &d.destination), d.weight.unwrap_or(0)))
        .collect()
}

/// A TCP (or terminated TLS) server's proxying: the first bound TCP route that applies.
fn tcp_route(g: &Generation<'_>, ps: &PortServer<'_>) -> Option<Vec<Filter>> {
    let number = u32::from(ps.number());
    let route = ps.virtual_services().find_map(|(_, vs)| {
        vs.tcp.iter().find(|r| {
            r.matches.is_empty()
                || r.matches
                    .iter()
                    .any(|m| m.port.is_none_or(|p| p == number) && ps.applies(&m.gateways))
        })
    })?;
    let targets = targets(g, ps, &route.route);
    Some(vec![lds::weighted_tcp_proxy(&ps.gateway, &targets)])
}

/// A PASSTHROUGH server's chains: per bound TLS route, the SNI names it matches (within the
/// server's hosts) and the TCP proxy to its destinations.
fn passthrough_routes(g: &Generation<'_>, ps: &PortServer<'_>) -> Vec<(Vec<String>, Filter)> {
    let number = u32::from(ps.number());
    let mut out = Vec::new();
    for (ns, vs) in ps.virtual_services() {
        for (i, route) in vs.tls.iter().enumerate() {
            let names: Vec<String> = route
                .matches
                .iter()
                .filter(|m| m.port.is_none_or(|p| p == number) && ps.applies(&m.gateways))
                .flat_map(|m| m.sni_hosts.iter())
                .filter_map(|sni| ps.admits(ns, sni))
                .collect();
            if names.is_empty() {
                continue;
            }
            // `*` is any SNI: no server name to match (Envoy takes no bare `*`).
            let names = match names.iter().any(|n| n == "*") {
                true => Vec::new(),
                false => names,
            };
            let targets = targets(g, ps, &route.route);
            let stat = format!("{}_tls_{i}", ps.gateway);
            out.push((names, lds::weighted_tcp_proxy(&stat, &targets)));
        }
    }
    out
}

/// Mesh mTLS arriving from other networks, routed by its SNI to the service's endpoints here and
/// never terminated.
fn auto_passthrough_chains(g: &Generation<'_>) -> Vec<FilterChain> {
    g.routable_services()
        .iter()
        .filter(|s| s.resolution == Resolution::ClientSideLb)
        .flat_map(|s| cds::cluster_names(g, s, true))
        .map(|sni| FilterChain {
            name: sni.clone(),
            filter_chain_match: Some(FilterChainMatch {
                server_names: vec![sni.clone()],
                ..Default::default()
            }),
            filters: vec![lds::tcp_proxy_filter(&sni, &sni)],
            ..Default::default()
        })
        .collect()
}

fn tls_inspector() -> ListenerFilter {
    ListenerFilter {
        name: "envoy.filters.listener.tls_inspector".to_string(),
        config_type: Some(listener_filter::ConfigType::TypedConfig(pack_any(
            TlsInspector::default(),
        ))),
        ..Default::default()
    }
}

/// A router's route configuration by name: a virtual host per host its servers of that route
/// admit from bound VirtualServices (the oldest VirtualService claiming a host serves it).
pub fn build_routes(g: &Generation<'_>, name: &str) -> Option<Arc<Resource>> {
    let bound = bound(g);
    let by_port = servers(g, &bound);
    let servers: Vec<&PortServer<'_>> = by_port
        .values()
        .flatten()
        .filter(|ps| ps.route_name().as_deref() == Some(name))
        .collect();
    let first = servers.first()?;
    let mut hosts: BTreeMap<String, VirtualHost> = BTreeMap::new();
    for ps in &servers {
        let ctx = RouteContext {
            g,
            port: ps.number(),
            gateway: Some(&ps.gateway),
        };
        for (ns, vs) in ps.virtual_services() {
            let routes = http_routes(&ctx, &vs.http);
            if routes.is_empty() {
                continue;
            }
            for host in vs.hosts.iter().filter_map(|h| ps.admits(ns, h)) {
                hosts.entry(host.clone()).or_insert_with(|| VirtualHost {
                    name: format!("{host}:{}", ps.number()),
                    domains: domains(&host),
                    routes: routes.clone(),
                    require_tls: match ps.redirects_to_https() {
                        true => TlsRequirementType::All as i32,
                        false => TlsRequirementType::None as i32,
                    },
                    ..Default::default()
                });
            }
        }
    }
    let mut virtual_hosts: Vec<VirtualHost> = hosts.into_values().collect();
    if virtual_hosts.is_empty() {
        virtual_hosts.push(not_found(first.number()));
    }
    let config = RouteConfiguration {
        name: name.to_string(),
        virtual_hosts,
        validate_clusters: Some(BoolValue { value: false }),
        ..Default::default()
    };
    Some(Arc::new(Resource::encode(name, &config)))
}

/// A host with and without a port in the Host header (wildcards as they are: Envoy allows one `*`).
fn domains(host: &str) -> Vec<String> {
    match host.contains('*') {
        true => vec![host.to_string()],
        false => vec![host.to_string(), format!("{host}:*")],
    }
}

/// What a gateway answers for hosts nothing routes (istiod's `blackhole:<port>`).
fn not_found(port: u16) -> VirtualHost {
    rds::answering_all(&format!("blackhole:{port}"), "default", 404)
}
