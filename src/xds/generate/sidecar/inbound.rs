//! The sidecar's inbound side: `virtualInbound` on the mesh's `proxyInboundListenPort` (15006),
//! where iptables sends connections to the workload, with filter chains per port of the workload
//! as its PeerAuthentication says (the table in `inbound_chains`), each with the workload's
//! authentication and authorization filters, and one cluster per port to the workload.

use std::net::IpAddr;
use std::sync::Arc;

use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::core::v3::TrafficDirection;
use envoy_types::pb::envoy::config::listener::v3::{Filter, FilterChain, FilterChainMatch, Listener};
use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
use envoy_types::pb::envoy::extensions::filters::listener::original_dst::v3::OriginalDst;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::http_connection_manager::{
    ForwardClientCertDetails, RouteSpecifier, SetCurrentClientCertDetails,
};
use envoy_types::pb::google::protobuf::{BoolValue, UInt32Value};
use envoy_types::util::pack_any;

use crate::istio::mesh_traffic::InboundMode;
use crate::istio::sidecar::IngressEndpoint;
use crate::model::{IngressPort, Protocol, Service, ServiceKey};
use crate::xds::generate::access_log::Side;
use crate::xds::generate::clusters::{assignment_at, pipe, static_cluster, to_workload};
use crate::xds::generate::common::socket;
use crate::xds::generate::filters::{
    hcm, hcm_filter, listener_filter, tcp_proxy_filter, ISTIO_SERVER_NAME,
};
use crate::xds::generate::generation::Generation;
use crate::xds::generate::inspectors;
use crate::xds::generate::istio_stats::{tcp_chain, SideStats};
use crate::xds::generate::names::{
    inbound_cluster, parse_port, BLACKHOLE, INBOUND_PASSTHROUGH, VIRTUAL_INBOUND,
};
use crate::xds::generate::policy;
use crate::xds::generate::routes::{virtual_host, DefaultRoute};
use crate::xds::generate::security::WorkloadSecurity;
use crate::xds::generate::stat_names;
use crate::xds::generate::wasm::{ListenerClass, Phased};
use crate::xds::protocol::ResourceType;
use crate::xds::wire::Resource;

use super::inbound_chains::{options, ChainOption, Class};

/// Passthrough chains that serve HTTP (the others are named `virtualInbound`).
const PASSTHROUGH_HTTP_CHAIN: &str = "virtualInbound-catchall-http";

/// `virtualInbound`, with the workload's ports: the proxy's own listener (patched; None when an
/// EnvoyFilter removes it).
pub(super) fn virtual_inbound(g: &Generation<'_>) -> Option<Arc<Resource>> {
    g.finish(
        ResourceType::Listener,
        Resource::encode(VIRTUAL_INBOUND, &listener(g)),
    )
}

/// istiod's layout (`buildInboundListeners`, pilot/pkg/networking/core/listener_inbound.go): a
/// chain that refuses connections to the listen port itself (a loop), the chains of each declared port,
/// then passthrough chains for every other port, as the mTLS mode of each says.
fn listener(g: &Generation<'_>) -> Listener {
    let security = WorkloadSecurity::for_workload(g.mesh, g.namespace(), g.labels());
    let mut filter_chains = vec![blackhole(g)];
    let declared = ports(g);
    for (port, protocol) in &declared {
        let mode = security.mtls.for_port(*port);
        let target = Target::Port(*port, *protocol);
        chains(
            g,
            &security,
            options(Class::of(*protocol), mode),
            target,
            &mut filter_chains,
        );
    }
    // A port-level mode for a port no Service declares still decides that port's passthrough.
    for (port, mode) in &security.mtls.ports {
        if declared.iter().all(|(p, _)| p != port) {
            let target = Target::Passthrough(Some(*port));
            chains(
                g,
                &security,
                options(Class::Auto, *mode),
                target,
                &mut filter_chains,
            );
        }
    }
    let passthrough = options(Class::Auto, security.mtls.mode);
    chains(
        g,
        &security,
        passthrough,
        Target::Passthrough(None),
        &mut filter_chains,
    );
    let mut listener_filters = vec![listener_filter(
        "envoy.filters.listener.original_dst",
        pack_any(OriginalDst::default()),
    )];
    listener_filters.extend(inspectors::for_chains(&filter_chains));
    Listener {
        name: VIRTUAL_INBOUND.to_string(),
        address: Some(socket("0.0.0.0", g.mesh_config().proxy_inbound_listen_port)),
        listener_filters,
        // mesh `protocolDetectionTimeout` (0s: sniffing waits for the client's first bytes).
        listener_filters_timeout: Some(g.mesh_config().protocol_detection_timeout.to_proto()),
        continue_on_listener_filters_timeout: true,
        filter_chains,
        traffic_direction: TrafficDirection::Inbound as i32,
        access_log: g.access_logs().listener(Side::SidecarInbound),
        ..Default::default()
    }
}

/// Where a chain delivers.
#[derive(Clone, Copy)]
enum Target {
    /// A declared port of the workload: its `inbound|<port>||` cluster.
    Port(u16, Protocol),
    /// Any other port (or this one): to the address it was for, through `InboundPassthroughCluster`.
    Passthrough(Option<u16>),
}

impl Target {
    fn port(self) -> Option<u16> {
        match self {
            Target::Port(port, _) => Some(port),
            Target::Passthrough(port) => port,
        }
    }
}

/// The chains `options` ask for toward `target`: the connection manager and the TCP proxy are
/// each built once and shared by the chains that differ only in what they match.
fn chains(
    g: &Generation<'_>,
    security: &WorkloadSecurity,
    options: &[ChainOption],
    target: Target,
    out: &mut Vec<FilterChain>,
) {
    let port = target.port();
    let (cluster, protocol) = match target {
        Target::Port(port, protocol) => (inbound_cluster(port), protocol),
        Target::Passthrough(_) => (INBOUND_PASSTHROUGH.to_string(), Protocol::Http),
    };
    // Plugins and policies by port see passthrough as port 0, as istiod's do.
    let plugin_port = port
        .filter(|_| matches!(target, Target::Port(..)))
        .unwrap_or(0);
    let wasm = || {
        g.wasm_plugins()
            .network(ListenerClass::Inbound, plugin_port)
    };
    let http = std::cell::OnceCell::new();
    let tcp = std::cell::OnceCell::new();
    let trust_domains = g.trust_domains();
    for option in options {
        let filters = match option.http {
            true => http.get_or_init(|| {
                let mut filters = wasm().all();
                filters.push(http_filter(g, (plugin_port, protocol), &cluster, security));
                filters
            }),
            false => tcp.get_or_init(|| {
                let logs = g.access_logs().of(Side::SidecarInbound);
                let proxy = tcp_proxy_filter(&cluster, &cluster, logs);
                with_network(security, wasm(), g.stats(Side::SidecarInbound), proxy)
            }),
        };
        let name = match (target, option.http) {
            (Target::Port(port, _), _) => format!("0.0.0.0_{port}"),
            (Target::Passthrough(_), true) => PASSTHROUGH_HTTP_CHAIN.to_string(),
            (Target::Passthrough(_), false) => VIRTUAL_INBOUND.to_string(),
        };
        out.push(FilterChain {
            name,
            filter_chain_match: Some(option.matching(port)),
            filters: filters.clone(),
            transport_socket: option.socket(&trust_domains, &g.mesh_config().mesh_mtls),
            ..Default::default()
        });
    }
}

/// Connections to the listen port itself would loop back into this listener: refused.
fn blackhole(g: &Generation<'_>) -> FilterChain {
    FilterChain {
        name: "virtualInbound-blackhole".to_string(),
        filter_chain_match: Some(FilterChainMatch {
            destination_port: Some(UInt32Value {
                value: u32::from(g.mesh_config().proxy_inbound_listen_port),
            }),
            ..Default::default()
        }),
        filters: tcp_chain(
            g.stats(Side::SidecarInbound),
            Vec::new(),
            tcp_proxy_filter(
                BLACKHOLE,
                BLACKHOLE,
                g.access_logs().of(Side::SidecarInbound),
            ),
        ),
        ..Default::default()
    }
}

/// The workload's network filters and WasmPlugins, then `last`, with Istio's stats filters
/// around them.
fn with_network(
    security: &WorkloadSecurity,
    wasm: Phased<Filter>,
    stats: Option<&SideStats>,
    last: Filter,
) -> Vec<Filter> {
    tcp_chain(stats, security.network_filters(wasm), last)
}

fn http_filter(
    g: &Generation<'_>,
    (port, protocol): (u16, Protocol),
    cluster: &str,
    security: &WorkloadSecurity,
) -> Filter {
    let route = route_config(port, cluster, protocol);
    let mut hcm = hcm(
        &format!("inbound_0.0.0.0_{port}"),
        RouteSpecifier::RouteConfig(route),
        g.access_logs().of(Side::SidecarInbound),
    );
    g.tracing().of(Side::SidecarInbound).apply(&mut hcm);
    let wasm = g.wasm_plugins().http(ListenerClass::Inbound, port);
    hcm.http_filters.splice(0..0, security.http_filters(wasm));
    // The application learns the caller's verified identity, as with Istio (XFCC; istiod's
    // `buildSidecarInboundHTTPOpts`).
    hcm.forward_client_cert_details = ForwardClientCertDetails::AppendForward as i32;
    hcm.set_current_client_cert_details = Some(SetCurrentClientCertDetails {
        subject: Some(BoolValue { value: true }),
        uri: true,
        dns: true,
        ..Default::default()
    });
    hcm.server_name = ISTIO_SERVER_NAME.to_string();
    if matches!(protocol, Protocol::Http2 | Protocol::Grpc) {
        hcm.http2_protocol_options = Some(Default::default());
    }
    hcm_filter(hcm, g.stats(Side::SidecarInbound), g.path_normalization())
}

/// The proxy's own clusters: one `inbound|<port>||` per port of its workload.
pub(super) fn cluster_names(g: &Generation<'_>) -> Vec<String> {
    ports(g)
        .iter()
        .map(|(port, _)| inbound_cluster(*port))
        .collect()
}

/// The cluster of a port of the workload: to the address and port the connection was for, as
/// istiod delivers inbound traffic (the workload may listen on its pod address only); or where
/// its Sidecar's ingress port says.
pub(super) fn cluster(g: &Generation<'_>, name: &str) -> Option<Arc<Resource>> {
    let port = parse_port(name.strip_prefix("inbound|")?.strip_suffix("||")?)?;
    let (_, protocol) = ports(g).into_iter().find(|(p, _)| *p == port)?;
    let v6 = g.ipv6_only();
    let mut cluster = match ingress(g).iter().find(|i| i.port == port) {
        // A Sidecar's ingress port goes where its defaultEndpoint says.
        Some(ingress) => {
            let address = match &ingress.endpoint {
                IngressEndpoint::Loopback(to) => socket("127.0.0.1", *to),
                IngressEndpoint::Workload(to) => match g.addresses().first() {
                    Some(ip) => socket(&ip.to_string(), *to),
                    None => socket("127.0.0.1", *to),
                },
                IngressEndpoint::Unix(path) => pipe(path),
            };
            Cluster {
                load_assignment: Some(assignment_at(name, address)),
                circuit_breakers: Some(policy::unlimited_circuit_breakers()),
                ..static_cluster(name)
            }
        }
        // Mesh `inboundTrafficPolicy: LOCALHOST`: to the workload on localhost, a static
        // cluster without the 127.0.0.6 source (istiod's `buildInboundCluster`).
        None if g.mesh_config().inbound_traffic_policy.mode == InboundMode::Localhost => {
            let localhost = if v6 { "::1" } else { "127.0.0.1" };
            Cluster {
                load_assignment: Some(assignment_at(name, socket(localhost, port))),
                circuit_breakers: Some(policy::unlimited_circuit_breakers()),
                ..static_cluster(name)
            }
        }
        None => to_workload(name, v6),
    };
    if protocol.is_http() && protocol != Protocol::Http {
        cluster.typed_extension_protocol_options = policy::http2_only();
    }
    // A sniffed port forwards HTTP as it arrived (istiod's `setUpstreamProtocol`).
    if protocol == Protocol::Unsupported {
        cluster.typed_extension_protocol_options = policy::downstream_protocol();
    }
    policy::apply_keepalive(&mut cluster, g.mesh_config().tcp_keepalive.as_ref(), None);
    // Named after the first service the port serves, as istiod's `buildInboundCluster`.
    let pattern = &g.mesh_config().inbound_cluster_stat_name;
    let stat = service_of(g, port).and_then(|(service, service_port)| {
        stat_names::of(pattern, &service, "", service_port, port)
    });
    if let Some(stat) = stat {
        cluster.alt_stat_name = stat_names::delimited(stat);
    }
    g.finish(ResourceType::Cluster, Resource::encode(name, &cluster))
}

/// The first service (and its port) whose endpoint at the proxy's addresses is this target port.
fn service_of(g: &Generation<'_>, target_port: u16) -> Option<(Arc<Service>, u16)> {
    g.addresses().iter().find_map(|ip| {
        g.mesh
            .endpoints
            .services_at(ip)
            .into_iter()
            .find_map(|key| {
                let service = g.service(&key.hostname)?.clone();
                let shards = g.mesh.endpoints.get(&key)?;
                let port = shards
                    .endpoints()
                    .filter(|e| e.address == *ip && e.port == target_port)
                    .find_map(|e| {
                        let ports = service.ports.iter();
                        ports.clone().find(|p| *p.name == *e.service_port_name)
                    })?
                    .port;
                Some((service, port))
            })
    })
}

/// The ingress ports of the proxy's Sidecar (none without one, or one declaring none).
fn ingress<'g>(g: &'g Generation<'_>) -> &'g [IngressPort] {
    g.sidecar_scope().map_or(&[], |s| s.ingress())
}

/// The ports the proxy's own workload serves: (target port, protocol), those its Sidecar's
/// `ingress` declares, else from the endpoints at the proxy's addresses (as istiod's
/// `buildInboundChainConfigs`, pilot/pkg/networking/core/listener_inbound.go).
pub(super) fn ports(g: &Generation<'_>) -> Vec<(u16, Protocol)> {
    let ingress = ingress(g);
    if !ingress.is_empty() {
        return ingress.iter().map(|i| (i.port, i.protocol)).collect();
    }
    let mut ports: Vec<(u16, Protocol)> = Vec::new();
    for ip in g.addresses() {
        for key in g.mesh.endpoints.services_at(ip) {
            collect(g, ip, &key, &mut ports);
        }
    }
    ports.sort_by_key(|(p, _)| *p);
    ports.dedup_by_key(|(p, _)| *p);
    ports
}

fn collect(g: &Generation<'_>, ip: &IpAddr, key: &ServiceKey, ports: &mut Vec<(u16, Protocol)>) {
    let Some(service) = g.service(&key.hostname) else {
        return;
    };
    let Some(shards) = g.mesh.endpoints.get(key) else {
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

/// The route of an inbound HTTP filter chain: everything to the local workload, named after the
/// cluster as istiod names it.
fn route_config(port: u16, cluster: &str, protocol: Protocol) -> RouteConfiguration {
    RouteConfiguration {
        name: cluster.to_string(),
        virtual_hosts: vec![virtual_host(
            &format!("inbound|http|{port}"),
            vec!["*".to_string()],
            cluster,
            DefaultRoute::Inbound {
                grpc: protocol == Protocol::Grpc,
            },
        )],
        validate_clusters: Some(BoolValue { value: false }),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::istio::MeshConfig;
    use crate::model::MeshSnapshot;
    use crate::xds::generate::cache::ResourceCache;
    use crate::xds::proxy::{tests::node, Proxy};

    #[test]
    fn virtual_inbound_listens_and_guards_the_mesh_s_inbound_listen_port() {
        let mut mesh = MeshSnapshot::default();
        mesh.config.set_mesh(MeshConfig {
            proxy_inbound_listen_port: 16006,
            ..MeshConfig::default()
        });
        let cache = ResourceCache::default();
        let id = "sidecar~10.0.0.1~a-1.shop~shop.svc.cluster.local";
        let proxy = Proxy::from_node(Some(&node(id, &[]))).expect("a proxy");
        let listener = listener(&Generation::new(&mesh, &cache, &proxy));
        assert_eq!(listener.address, Some(socket("0.0.0.0", 16006)));
        let guard = &listener.filter_chains[0];
        assert_eq!(guard.name, "virtualInbound-blackhole");
        let port = (guard.filter_chain_match.as_ref()).and_then(|m| m.destination_port.as_ref());
        assert_eq!(port.map(|p| p.value), Some(16006));
    }
}
