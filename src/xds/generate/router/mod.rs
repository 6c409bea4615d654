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
//! listener on 15443 for hosts `*.local` (a fallback for meshes that never applied Istio's
//! cross-network Gateway, whose hosts these are).

mod servers;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::TrafficDirection;
use envoy_types::pb::envoy::config::listener::v3::{
    Filter, FilterChain, FilterChainMatch, Listener,
};
use envoy_types::pb::envoy::config::route::v3::{
    virtual_host::TlsRequirementType, RouteConfiguration, VirtualHost,
};
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::http_connection_manager::{
    ForwardClientCertDetails, SetCurrentClientCertDetails,
};
use envoy_types::pb::google::protobuf::BoolValue;
use tracing::debug;

use self::servers::{labelled_east_west, servers, PortServer};
use super::access_log::Side;
use super::clusters::{self, ClusterNeeds};
use super::common::socket;
use super::filters::{
    hcm_filter, outbound_hcm, rds, tcp_proxy_filter, weighted_tcp_proxy, ISTIO_SERVER_NAME,
};
use super::gateway_tls;
use super::generation::Generation;
use super::inspectors::{tls_inspector, ALL_MTLS_ALPN};
use super::istio_stats::tcp_chain;
use super::names::{parse_port, parse_sni_cluster, port_listener_name};
use super::routes::{answering_all, cluster_for, http_routes, RouteContext};
use super::security::WorkloadSecurity;
use super::stat_names;
use super::wasm::ListenerClass;
use crate::istio::gateway::ServerTlsMode;
use crate::istio::virtual_service::RouteDestination;
use crate::model::host_match;
use crate::xds::protocol::ResourceType;
use crate::xds::wire::{Listing, Resource, SharedList};

/// The port of Istio's cross-network (AUTO_PASSTHROUGH) server.
const EAST_WEST_PORT: u16 = 15443;
/// The hosts the labelled fallback forwards: those of Istio's cross-network Gateway
/// (samples/multicluster/expose-services.yaml).
const EAST_WEST_HOSTS: &[&str] = &["*.local"];
const HTTP_ALPN: [&str; 2] = ["h2", "http/1.1"];

/// Every cluster or listener. A router's listeners are its own (built through the per-resource
/// cache); its clusters are shared with routers that need the same.
pub(super) fn all(g: &Generation<'_>, ty: ResourceType) -> Listing {
    match ty {
        ResourceType::Cluster => Listing::shared(clusters::list(g, &cluster_needs(g))),
        ResourceType::Listener => Listing::shared(Arc::new(SharedList::new(listeners(g)))),
        ResourceType::Endpoint
        | ResourceType::Route
        | ResourceType::Secret
        | ResourceType::NameTable
        | ResourceType::ProxyConfig
        | ResourceType::ExtensionConfig
        | ResourceType::Address
        | ResourceType::Authorization
        | ResourceType::Config(..) => Listing::default(),
    }
}

pub(super) fn build(g: &Generation<'_>, ty: ResourceType, name: &str) -> Option<Arc<Resource>> {
    match ty {
        ResourceType::Cluster => clusters::build(g, name),
        ResourceType::Listener => build_listener(g, name),
        ResourceType::Route => build_routes(g, name),
        ResourceType::Endpoint
        | ResourceType::Secret
        | ResourceType::NameTable
        | ResourceType::ProxyConfig
        | ResourceType::ExtensionConfig
        | ResourceType::Address
        | ResourceType::Authorization
        | ResourceType::Config(..) => None,
    }
}

/// Which clusters a router lists: the mesh SNI ones where it passes mesh mTLS through by SNI
/// (AUTO_PASSTHROUGH), the `outbound|…` ones where it routes to services itself.
fn cluster_needs(g: &Generation<'_>) -> ClusterNeeds {
    let bound = g.gateways();
    if bound.is_empty() {
        let east_west = labelled_east_west(g);
        return ClusterNeeds {
            sni: east_west,
            outbound: !east_west,
            fixed: false,
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
        fixed: false,
    }
}

/// Every listener of a router.
fn listeners(g: &Generation<'_>) -> Vec<Arc<Resource>> {
    let bound = g.gateways();
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
fn build_listener(g: &Generation<'_>, name: &str) -> Option<Arc<Resource>> {
    let port = parse_port(name.strip_prefix("0.0.0.0_")?)?;
    let bound = g.gateways();
    listener(g, port, &servers(g, &bound))
}

/// The listener on `port`, from the servers of the Gateways selecting the router (none: the
/// labelled east-west fallback).
fn listener(
    g: &Generation<'_>,
    port: u16,
    by_port: &BTreeMap<u16, Vec<PortServer<'_>>>,
) -> Option<Arc<Resource>> {
    let name = port_listener_name(port);
    let chains = if by_port.is_empty() {
        (port == EAST_WEST_PORT && labelled_east_west(g)).then(|| {
            let mut chains = Chains::default();
            chains.auto_passthrough(auto_passthrough_chains(g, EAST_WEST_HOSTS));
            chains
        })?
    } else {
        port_chains(g, &name, by_port.get(&port)?)
    };
    let listener = Listener {
        name: name.clone(),
        address: Some(socket("0.0.0.0", port)),
        listener_filters: match chains.inspect {
            true => vec![tls_inspector()],
            false => Vec::new(),
        },
        filter_chains: chains.chains,
        // As istiod marks a gateway's listeners.
        traffic_direction: TrafficDirection::Outbound as i32,
        access_log: g.access_logs().listener(Side::Gateway),
        ..Default::default()
    };
    g.finish(ResourceType::Listener, Resource::encode(name, &listener))
}

/// Filter chains whose matches Envoy would reject as duplicates are left out (logged): the first
/// server to claim an SNI name, or to take every connection, keeps it.
#[derive(Default)]
struct Chains {
    chains: Vec<FilterChain>,
    sni_taken: BTreeSet<String>,
    /// A chain without a match (plaintext, or TLS for any server name) takes every connection.
    all_taken: bool,
    /// A server is matched by what a TLS ClientHello says: the TLS inspector reads it (istiod adds
    /// it for any server with SNI hosts, `*` included: `buildGatewayListener`).
    inspect: bool,
}

impl Chains {
    /// A TLS server's chain for its SNI names; none (`*`) matches nothing in particular, so, as
    /// istiod's `toFilterChainMatch` leaves it without a match, it takes plaintext too.
    fn tls(&mut self, names: Vec<String>, mut chain: FilterChain) {
        self.inspect = true;
        if names.is_empty() {
            self.match_all(chain);
            return;
        }
        let names: Vec<String> = names
            .into_iter()
            .filter(|n| self.sni_taken.insert(n.clone()))
            .collect();
        if names.is_empty() {
            conflict(&chain);
            return;
        }
        chain.filter_chain_match = Some(FilterChainMatch {
            server_names: names,
            transport_protocol: "tls".to_string(),
            ..Default::default()
        });
        self.chains.push(chain);
    }

    /// AUTO_PASSTHROUGH chains, their matches as built: one SNI name each.
    fn auto_passthrough(&mut self, chains: Vec<FilterChain>) {
        self.inspect = true;
        for chain in chains {
            let names = chain
                .filter_chain_match
                .as_ref()
                .map(|m| m.server_names.as_slice())
                .unwrap_or_default();
            match names.iter().all(|n| self.sni_taken.insert(n.clone())) {
                true => self.chains.push(chain),
                false => conflict(&chain),
            }
        }
    }

    fn match_all(&mut self, chain: FilterChain) {
        match std::mem::replace(&mut self.all_taken, true) {
            true => conflict(&chain),
            false => self.chains.push(chain),
        }
    }
}

fn conflict(chain: &FilterChain) {
    debug!(
        chain = chain.name,
        "gateway server conflicts with an earlier one on its port"
    );
}

fn port_chains(g: &Generation<'_>, listener: &str, servers: &[PortServer<'_>]) -> Chains {
    let security = WorkloadSecurity::for_workload(g.mesh, g.namespace(), g.labels());
    let mut chains = Chains::default();
    let plugins = g.wasm_plugins();
    for ps in servers {
        let name = format!("{listener}-{}", ps.server.port.name);
        let mode = ps.mode();
        let port = ps.number();
        if let Some(route) = ps.route_name() {
            let mut filters = plugins.network(ListenerClass::Gateway, port).all();
            filters.push(http_filter(g, &route, port, &security));
            let chain = FilterChain {
                name,
                filters,
                ..Default::default()
            };
            match ps.is_plain_http() {
                true => chains.match_all(chain),
                false => {
                    let socket = ps.server.tls.as_ref().map(|t| {
                        let defaults = &g.mesh_config().tls_defaults;
                        gateway_tls::server_socket(t, &HTTP_ALPN, &g.trust_domains(), defaults)
                    });
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
                chains.auto_passthrough(auto_passthrough_chains(g, &ps.sni_hosts()));
            }
            Some(ServerTlsMode::Passthrough) => {
                for (names, filter) in passthrough_routes(g, ps) {
                    let chain = FilterChain {
                        name: format!("{name}-{}", names.join(",")),
                        filters: tcp_chain(g.stats(Side::Gateway), Vec::new(), filter),
                        ..Default::default()
                    };
                    chains.tls(names, chain);
                }
            }
            Some(_) => {
                let Some(mut filters) = tcp_route(g, ps) else {
                    continue;
                };
                let wasm = plugins.network(ListenerClass::Gateway, port);
                filters.splice(0..0, security.network_filters(wasm));
                let socket = ps.server.tls.as_ref().map(|t| {
                    let defaults = &g.mesh_config().tls_defaults;
                    gateway_tls::server_socket(t, &[], &g.trust_domains(), defaults)
                });
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
                let wasm = plugins.network(ListenerClass::Gateway, port);
                filters.splice(0..0, security.network_filters(wasm));
                chains.match_all(FilterChain {
                    name,
                    filters,
                    ..Default::default()
                });
            }
        }
    }
    chains
}

/// The connection manager of an HTTP server: the workload's security filters and WasmPlugins,
/// then the VirtualService filters and the router.
fn http_filter(g: &Generation<'_>, route: &str, port: u16, security: &WorkloadSecurity) -> Filter {
    let mut hcm = outbound_hcm(route, rds(route), g.access_logs().of(Side::Gateway));
    // As istiod's `buildGatewayConnectionManager`: the client's address is the peer's (appended
    // to x-forwarded-for, trusted for internal/external), a client certificate's details replace
    // any the client sent.
    hcm.use_remote_address = Some(BoolValue { value: true });
    hcm.forward_client_cert_details = ForwardClientCertDetails::SanitizeSet as i32;
    hcm.set_current_client_cert_details = Some(SetCurrentClientCertDetails {
        subject: Some(BoolValue { value: true }),
        cert: true,
        uri: true,
        dns: true,
        ..Default::default()
    });
    hcm.server_name = ISTIO_SERVER_NAME.to_string();
    hcm.http_protocol_options = Some(Default::default());
    g.tracing().of(Side::Gateway).apply(&mut hcm);
    let wasm = g.wasm_plugins().http(ListenerClass::Gateway, port);
    hcm.http_filters.splice(0..0, security.http_filters(wasm));
    hcm_filter(hcm, g.stats(Side::Gateway), g.path_normalization())
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
    let logs = g.access_logs().of(Side::Gateway);
    let proxy = weighted_tcp_proxy(&ps.gateway, &targets, logs);
    Some(tcp_chain(g.stats(Side::Gateway), Vec::new(), proxy))
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
            let logs = g.access_logs().of(Side::Gateway);
            out.push((names, weighted_tcp_proxy(&stat, &targets, logs)));
        }
    }
    out
}

/// Mesh mTLS arriving from other networks, routed by its SNI to the service's endpoints here and
/// never terminated (istiod's `builtAutoPassthroughFilterChains`,
/// pilot/pkg/networking/core/gateway.go): a chain per SNI cluster of each service whose host the
/// server's `hosts` cover (namespaces ignored), matched by the SNI and Istio's mTLS ALPN alone, so
/// a TLS client that is no mesh proxy finds no chain and is closed.
fn auto_passthrough_chains<H: AsRef<str>>(g: &Generation<'_>, hosts: &[H]) -> Vec<FilterChain> {
    g.routable_services()
        .iter()
        .filter(|s| (hosts.iter()).any(|h| host_match(h.as_ref(), &s.hostname).is_some()))
        .flat_map(|s| {
            clusters::sni_names(g, s)
                .into_iter()
                .map(move |sni| (s, sni))
        })
        .map(|(service, sni)| {
            // Stats under the mesh's `outboundClusterStatName`, else the cluster's name.
            let pattern = &g.mesh_config().outbound_cluster_stat_name;
            let stat_prefix = parse_sni_cluster(&sni)
                .and_then(|c| stat_names::of(pattern, service, c.subset, c.port, 0))
                .unwrap_or_else(|| sni.clone());
            FilterChain {
                name: sni.clone(),
                filter_chain_match: Some(FilterChainMatch {
                    server_names: vec![sni.clone()],
                    application_protocols: ALL_MTLS_ALPN.iter().map(|a| a.to_string()).collect(),
                    ..Default::default()
                }),
                filters: tcp_chain(
                    g.stats(Side::Gateway),
                    Vec::new(),
                    tcp_proxy_filter(&stat_prefix, &sni, g.access_logs().of(Side::Gateway)),
                ),
                ..Default::default()
            }
        })
        .collect()
}

/// A router's route configuration by name: a virtual host per host its servers of that route
/// admit from bound VirtualServices (the oldest VirtualService claiming a host serves it).
fn build_routes(g: &Generation<'_>, name: &str) -> Option<Arc<Resource>> {
    let bound = g.gateways();
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
                    include_request_attempt_count: true,
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
    g.finish(ResourceType::Route, Resource::encode(name, &config))
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
    answering_all(&format!("blackhole:{port}"), "default", 404)
}
