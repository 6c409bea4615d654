//! LDS, laid out as Istio does so iptables-captured traffic works:
//! - `virtualOutbound` on 15001 hands connections, by original destination, to per-port listeners
//!   `0.0.0.0_<port>` that are not bound themselves: HTTP via RDS route `<port>`, TCP services matched
//!   by VIP and proxied to their cluster;
//! - `virtualInbound` on 15006 has a filter chain per port of the proxy's own workload;
//! - proxyless gRPC clients get API listeners named `<hostname>:<port>`;
//! - gateways get theirs from `gateway`.

use std::collections::BTreeSet;
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::{CidrRange, TrafficDirection};
use envoy_types::pb::envoy::config::listener::v3::{
    filter, ApiListener, Filter, FilterChain, FilterChainMatch, Listener,
};
use envoy_types::pb::envoy::extensions::filters::http::cors::v3::Cors;
use envoy_types::pb::envoy::extensions::filters::http::fault::v3::HttpFault;
use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_connection_manager::RouteSpecifier, http_filter, HttpConnectionManager, HttpFilter, Rds,
};
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::{tcp_proxy, TcpProxy};
use envoy_types::pb::google::protobuf::{BoolValue, UInt32Value};
use envoy_types::util::pack_any;

use super::gateway;
use super::inbound;
use super::names::{
    grpc_route_name, outbound_cluster, parse_port, port_listener_name, VIRTUAL_INBOUND,
    VIRTUAL_OUTBOUND,
};
use super::routes::{cluster_for, RouteContext, CORS_FILTER, FAULT_FILTER};
use super::{ads, grpc_target, socket, Generation};
use crate::model::{Resolution, Service};
use crate::xds::protocol::ResourceType;
use crate::xds::proxy::Generator;
use crate::xds::wire::{Resource, SharedList};

const OUTBOUND_PORT: u16 = 15001;

/// The listeners every proxy of this kind (and cluster) shares, assembled once per model version.
pub fn shared(g: &Generation<'_>) -> Arc<SharedList> {
    if gateway::is_router(g) {
        // A router's listeners are its own (built through the per-resource cache).
        return Arc::new(SharedList::new(gateway::listeners(g)));
    }
    let cluster = g
        .proxy
        .cluster_id
        .as_ref()
        .map(|c| c.as_str())
        .unwrap_or_default();
    let variant = g.variant_of(&(g.is_sidecar(), cluster, g.list_scope()));
    g.cache.list(
        ResourceType::Listener,
        variant,
        [g.services_version(), 0, 0, g.config_version()],
        || {
            let names: Vec<String> = if g.proxy.generator == Generator::Grpc {
                g.routable_services()
                    .iter()
                    .flat_map(|s| {
                        s.ports
                            .iter()
                            .filter(|p| g.sees(s, p.port))
                            .map(|p| grpc_route_name(&s.hostname, p.port))
                    })
                    .collect()
            } else if g.is_sidecar() {
                let ports: BTreeSet<u16> = g
                    .routable_services()
                    .iter()
                    .filter(|s| s.resolution != Resolution::Passthrough)
                    .flat_map(|s| s.ports.iter().map(|p| p.port).filter(|p| g.sees(s, *p)))
                    .collect();
                std::iter::once(VIRTUAL_OUTBOUND.to_string())
                    .chain(ports.iter().map(|p| port_listener_name(*p)))
                    .collect()
            } else {
                Vec::new()
            };
            g.build_all(ResourceType::Listener, names)
        },
    )
}

/// The proxy's own listener: `virtualInbound`, with its workload's ports.
pub fn own_names(g: &Generation<'_>) -> Vec<String> {
    match g.is_sidecar() {
        true => vec![VIRTUAL_INBOUND.to_string()],
        false => Vec::new(),
    }
}

pub fn build(g: &Generation<'_>, name: &str) -> Option<Arc<Resource>> {
    if g.proxy.generator == Generator::Grpc {
        grpc_target(g, name)?;
        return g.cache.get_or_build(
            ResourceType::Listener,
            name,
            g.variant(&[]),
            [g.services_version(), 0, 0, 0],
            || Some(Resource::encode(name, &api_listener(name))),
        );
    }
    if gateway::is_router(g) {
        return gateway::build_listener(g, name);
    }
    match name {
        VIRTUAL_OUTBOUND => g.cache.get_or_build(
            ResourceType::Listener,
            name,
            g.variant_of(&g.outbound_fallback()),
            [0, 0, 0, g.config_version()],
            || {
                Some(Resource::encode(
                    name,
                    &virtual_outbound(g.outbound_fallback()),
                ))
            },
        ),
        VIRTUAL_INBOUND => Some(Arc::new(Resource::encode(
            name,
            &inbound::virtual_inbound(g),
        ))),
        _ => {
            let port = parse_port(name.strip_prefix("0.0.0.0_")?)?;
            let cluster = g
                .proxy
                .cluster_id
                .as_ref()
                .map(|c| c.as_str())
                .unwrap_or_default();
            let variant = g.variant_of(&(cluster, g.list_scope()));
            g.cache.get_or_build(
                ResourceType::Listener,
                name,
                variant,
                [g.services_version(), 0, 0, g.config_version()],
                || port_listener(g, name, port).map(|l| Resource::encode(name, &l)),
            )
        }
    }
}

/// Connections to addresses no listener claims go to `fallback`: PassthroughCluster with mesh
/// config `outboundTrafficPolicy: ALLOW_ANY`, BlackHoleCluster with REGISTRY_ONLY.
fn virtual_outbound(fallback: &str) -> Listener {
    Listener {
        name: VIRTUAL_OUTBOUND.to_string(),
        address: Some(socket("0.0.0.0", OUTBOUND_PORT)),
        use_original_dst: Some(BoolValue { value: true }),
        filter_chains: vec![FilterChain {
            name: "virtualOutbound-catchall-tcp".to_string(),
            filters: vec![tcp_proxy_filter(fallback, fallback)],
            ..Default::default()
        }],
        traffic_direction: TrafficDirection::Outbound as i32,
        ..Default::default()
    }
}

/// The listener for one service port, reached through `virtualOutbound`'s original-destination hand-off.
fn port_listener(g: &Generation<'_>, name: &str, port: u16) -> Option<Listener> {
    let services: Vec<Arc<Service>> = g
        .routable_services()
        .into_iter()
        .filter(|s| s.resolution != Resolution::Passthrough && s.port(port).is_some())
        .filter(|s| g.sees(s, port))
        .collect();
    if services.is_empty() {
        return None;
    }
    let has_http = services
        .iter()
        .any(|s| s.port(port).is_some_and(|p| p.protocol.is_http()));
    let mut seen_vips = BTreeSet::new();
    let mut filter_chains = Vec::new();
    for service in services
        .iter()
        .filter(|s| s.port(port).is_some_and(|p| !p.protocol.is_http()))
    {
        let vips: Vec<CidrRange> = vips_for(g, service)
            .into_iter()
            .filter(|vip| seen_vips.insert(vip.clone()))
            .map(|vip| CidrRange {
                prefix_len: Some(UInt32Value {
                    value: if vip.contains(':') { 128 } else { 32 },
                }),
                address_prefix: vip,
            })
            .collect();
        if vips.is_empty() {
            continue;
        }
        let cluster = outbound_cluster(port, &service.hostname);
        filter_chains.push(FilterChain {
            name: cluster.clone(),
            filter_chain_match: Some(FilterChainMatch {
                prefix_ranges: vips,
                ..Default::default()
            }),
            filters: vec![tcp_route(g, service, port, &cluster)],
            ..Default::default()
        });
    }
    let default_chain = if has_http {
        FilterChain {
            name: format!("{name}-http"),
            filters: vec![hcm_filter(
                &format!("outbound_{name}"),
                rds(&port.to_string()),
            )],
            ..Default::default()
        }
    } else {
        let fallback = g.outbound_fallback();
        FilterChain {
            name: format!("{name}-fallback"),
            filters: vec![tcp_proxy_filter(fallback, fallback)],
            ..Default::default()
        }
    };
    Some(Listener {
        name: name.to_string(),
        address: Some(socket("0.0.0.0", port)),
        bind_to_port: Some(BoolValue { value: false }),
        filter_chains,
        default_filter_chain: Some(default_chain),
        traffic_direction: TrafficDirection::Outbound as i32,
        ..Default::default()
    })
}

/// A TCP service's proxying: the first VirtualService TCP route that applies on this port (its
/// destinations weighted), else the service's own cluster.
fn tcp_route(g: &Generation<'_>, service: &Service, port: u16, cluster: &str) -> Filter {
    let routes =
        g.mesh
            .config
            .mesh_routes(&g.proxy.namespace, &service.hostname, g.egress_scope(port));
    let route = routes.as_ref().and_then(|r| {
        r.tcp.iter().find(|route| {
            route.matches.is_empty()
                || route.matches.iter().any(|m| {
                    m.port.is_none_or(|p| p == u32::from(port))
                        && m.source_labels
                            .iter()
                            .all(|(k, v)| g.proxy.labels.get(k) == Some(v))
                        && (m.gateways.is_empty() || m.gateways.iter().any(|gw| gw == "mesh"))
                })
        })
    });
    let Some(route) = route else {
        return tcp_proxy_filter(cluster, cluster);
    };
    let ctx = RouteContext {
        g,
        port,
        gateway: None,
    };
    let targets: Vec<(String, u32)> = route
        .route
        .iter()
        .map(|d| (cluster_for(&ctx, &d.destination), d.weight.unwrap_or(0)))
        .collect();
    weighted_tcp_proxy(cluster, &targets)
}

/// A TCP proxy to one cluster, or spread over several by weight.
pub(super) fn weighted_tcp_proxy(stat_prefix: &str, targets: &[(String, u32)]) -> Filter {
    if let [(single, _)] = targets {
        return tcp_proxy_filter(stat_prefix, single);
    }
    let proxy = TcpProxy {
        stat_prefix: stat_prefix.to_string(),
        cluster_specifier: Some(tcp_proxy::ClusterSpecifier::WeightedClusters(
            tcp_proxy::WeightedCluster {
                clusters: targets
                    .iter()
                    .filter(|(_, w)| *w > 0)
                    .map(
                        |(name, weight)| tcp_proxy::weighted_cluster::ClusterWeight {
                            name: name.clone(),
                            weight: *weight,
                            ..Default::default()
                        },
                    )
                    .collect(),
            },
        )),
        ..Default::default()
    };
    network_filter("envoy.filters.network.tcp_proxy", pack_any(proxy))
}

/// The VIPs a proxy uses for a service: those of its own cluster when it says which, else all.
pub(super) fn vips_for(g: &Generation<'_>, service: &Service) -> Vec<String> {
    let own = g
        .proxy
        .cluster_id
        .as_ref()
        .and_then(|c| service.cluster_vips.get(c));
    let vips: Vec<_> = match own {
        Some(v) => v.iter().collect(),
        None => service.cluster_vips.values().flatten().collect(),
    };
    vips.into_iter()
        .filter(|ip| !ip.is_unspecified())
        .map(|ip| ip.to_string())
        .collect()
}

/// A proxyless gRPC client's listener: an API listener whose routes come over RDS.
fn api_listener(name: &str) -> Listener {
    let hcm = hcm(name, rds(name));
    Listener {
        name: name.to_string(),
        api_listener: Some(ApiListener {
            api_listener: Some(pack_any(hcm)),
        }),
        ..Default::default()
    }
}

pub(super) fn rds(route_name: &str) -> RouteSpecifier {
    RouteSpecifier::Rds(Rds {
        config_source: Some(ads()),
        route_config_name: route_name.to_string(),
    })
}

pub(super) fn hcm(stat_prefix: &str, routes: RouteSpecifier) -> HttpConnectionManager {
    HttpConnectionManager {
        stat_prefix: stat_prefix.to_string(),
        route_specifier: Some(routes),
        http_filters: vec![HttpFilter {
            name: "envoy.filters.http.router".to_string(),
            config_type: Some(http_filter::ConfigType::TypedConfig(pack_any(
                Router::default(),
            ))),
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// The HTTP connection manager of outbound and gateway listeners: VirtualService faults and CORS
/// are per-route settings of these filters, so they come before the router (with nothing to do
/// where no route configures them).
pub(super) fn outbound_hcm(stat_prefix: &str, routes: RouteSpecifier) -> HttpConnectionManager {
    let mut hcm = hcm(stat_prefix, routes);
    let filter = |name: &str, config| HttpFilter {
        name: name.to_string(),
        config_type: Some(http_filter::ConfigType::TypedConfig(config)),
        ..Default::default()
    };
    hcm.http_filters.splice(
        0..0,
        [
            filter(FAULT_FILTER, pack_any(HttpFault::default())),
            filter(CORS_FILTER, pack_any(Cors::default())),
        ],
    );
    hcm
}

fn hcm_filter(stat_prefix: &str, routes: RouteSpecifier) -> Filter {
    network_filter(
        "envoy.filters.network.http_connection_manager",
        pack_any(outbound_hcm(stat_prefix, routes)),
    )
}

pub(super) fn network_filter(name: &str, config: envoy_types::pb::google::protobuf::Any) -> Filter {
    Filter {
        name: name.to_string(),
        config_type: Some(filter::ConfigType::TypedConfig(config)),
    }
}

pub(super) fn tcp_proxy_filter(stat_prefix: &str, cluster: &str) -> Filter {
    let proxy = TcpProxy {
        stat_prefix: stat_prefix.to_string(),
        cluster_specifier: Some(tcp_proxy::ClusterSpecifier::Cluster(cluster.to_string())),
        ..Default::default()
    };
    network_filter("envoy.filters.network.tcp_proxy", pack_any(proxy))
}
