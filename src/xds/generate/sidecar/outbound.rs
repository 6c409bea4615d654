//! The sidecar's outbound listeners: `virtualOutbound` on the mesh's `proxyListenPort` (15001)
//! hands connections, by original destination, to per-port listeners `0.0.0.0_<port>` that are not
//! bound themselves — HTTP, told by sniffing, via RDS route `<port>` (`<host>:<port>` for a sniffed
//! service); TCP services matched by VIP (TLS ones without an address by SNI) and proxied to their
//! cluster (or as their VirtualService's TCP routes say).

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::{CidrRange, TrafficDirection};
use envoy_types::pb::envoy::config::listener::v3::{
    Filter, FilterChain, FilterChainMatch, Listener,
};
use envoy_types::pb::google::protobuf::{BoolValue, UInt32Value};

use super::tls_routes;
use crate::model::{Protocol, Service};
use crate::xds::generate::access_log::Side;
use crate::xds::generate::common::socket;
use crate::xds::generate::filters::{
    hcm_filter, outbound_hcm, rds, tcp_proxy_filter, weighted_tcp_proxy,
};
use crate::xds::generate::generation::Generation;
use crate::xds::generate::inspectors::{self, PLAINTEXT_HTTP_ALPN};
use crate::xds::generate::istio_stats::tcp_chain;
use crate::xds::generate::names::{outbound_cluster, BLACKHOLE, VIRTUAL_OUTBOUND};
use crate::xds::generate::routes::{cluster_for, RouteContext};
use crate::xds::generate::stat_names;
use crate::xds::generate::wasm::ListenerClass;

/// Connections to addresses no listener claims go to `fallback`: PassthroughCluster with mesh
/// config `outboundTrafficPolicy: ALLOW_ANY`, BlackHoleCluster with REGISTRY_ONLY. Connections
/// to the listen port itself would loop back here: refused (istiod's `blackholeFilterChain`).
pub(super) fn virtual_outbound(g: &Generation<'_>) -> Listener {
    let logs = g.access_logs();
    let port = g.mesh_config().proxy_listen_port;
    let blackhole = FilterChain {
        name: "virtualOutbound-blackhole".to_string(),
        filter_chain_match: Some(FilterChainMatch {
            destination_port: Some(UInt32Value {
                value: u32::from(port),
            }),
            ..Default::default()
        }),
        filters: tcp_chain(
            g.stats(Side::SidecarOutbound),
            Vec::new(),
            tcp_proxy_filter(BLACKHOLE, BLACKHOLE, logs.of(Side::SidecarOutbound)),
        ),
        ..Default::default()
    };
    Listener {
        name: VIRTUAL_OUTBOUND.to_string(),
        address: Some(socket("0.0.0.0", port)),
        use_original_dst: Some(BoolValue { value: true }),
        filter_chains: vec![
            blackhole,
            FilterChain {
                name: "virtualOutbound-catchall-tcp".to_string(),
                filters: fallback_filters(g),
                ..Default::default()
            },
        ],
        traffic_direction: TrafficDirection::Outbound as i32,
        access_log: logs.listener(Side::SidecarOutbound),
        ..Default::default()
    }
}

/// Whether a service has a listener chain on a port of this protocol: every service, but headless
/// Kubernetes ones only on ports that are not HTTP, where each pod's address is matched (HTTP to
/// their pods passes through `virtualOutbound`, where istiod routes it: docs/fidelity.md, Open).
pub(super) fn claims_port(service: &Service, protocol: Protocol) -> bool {
    !service.is_headless_kubernetes() || !protocol.is_http()
}

/// Whether a service's port of this protocol is sniffed for HTTP on the client side: one declared
/// without a protocol, but on headless services (their pods are matched as TCP).
pub(super) fn sniffed(service: &Service, protocol: Protocol) -> bool {
    protocol == Protocol::Unsupported && !service.is_headless_kubernetes()
}

/// Plaintext HTTP, as the HTTP inspector recognises it.
fn http_match() -> FilterChainMatch {
    FilterChainMatch {
        transport_protocol: "raw_buffer".to_string(),
        application_protocols: PLAINTEXT_HTTP_ALPN.iter().map(|a| a.to_string()).collect(),
        ..Default::default()
    }
}

/// The pods of a headless service serving `port`, as chain matches (address, range): those on the
/// proxy's network, but the proxy itself (its traffic to itself never leaves it). Pods on other
/// networks are reached by name through their gateway (`registry/pod_services`), not by address.
fn pod_ranges<'a>(
    g: &'a Generation<'_>,
    service: &'a Service,
    port: u16,
) -> impl Iterator<Item = (IpAddr, CidrRange)> + 'a {
    let port_name = service
        .port(port)
        .map(|p| p.name.clone())
        .unwrap_or_default();
    let shards = g.mesh.endpoints.get(&service.key()).cloned();
    let own = g.pod_of_headless();
    let network = g.network().clone();
    let addresses: BTreeSet<IpAddr> = (shards.iter())
        .flat_map(|s| s.endpoints())
        .filter(|ep| *ep.service_port_name == *port_name && Some(ep.address) != own)
        .filter(|ep| g.reaches(service, ep))
        .filter(|ep| network.is_empty() || ep.network.is_empty() || ep.network == network)
        .map(|ep| ep.address)
        .collect();
    addresses.into_iter().map(|ip| (ip, full_range(ip)))
}

/// One address, as a chain matches it.
fn full_range(ip: IpAddr) -> CidrRange {
    CidrRange {
        prefix_len: Some(UInt32Value {
            value: if ip.is_ipv6() { 128 } else { 32 },
        }),
        address_prefix: ip.to_string(),
    }
}

/// The listener for one service port, reached through `virtualOutbound`'s original-destination
/// hand-off, laid out as istiod's outbound listeners (`buildSidecarOutboundListener`,
/// pilot/pkg/networking/core/listener.go): a TCP service by its addresses; one without any by
/// SNI when it speaks TLS, else for every address; HTTP services by sniffing, so bytes that are
/// not HTTP pass through instead of reaching the connection manager; anything else as
/// `virtualOutbound` would (PassthroughCluster or BlackHoleCluster).
pub(super) fn port_listener(g: &Generation<'_>, name: &str, port: u16) -> Option<Listener> {
    let services: Vec<Arc<Service>> = g
        .routable_services()
        .into_iter()
        .filter(|s| s.port(port).is_some_and(|p| claims_port(s, p.protocol)))
        .filter(|s| g.sees(s, port))
        .collect();
    if services.is_empty() {
        return None;
    }
    // The port's HTTP chain serves services declared HTTP, and sniffed ones without an address;
    // a sniffed service with addresses has a chain (and a route) of its own, the rest of its
    // bytes proxied as TCP (istiod's `buildSidecarOutboundListener` for protocol auto-detection).
    let has_http = services.iter().any(|s| {
        s.port(port).is_some_and(|p| {
            p.protocol.is_http() || (sniffed(s, p.protocol) && g.service_addresses(s).is_empty())
        })
    });
    let http_filters = |stat_prefix: &str, route: &str| {
        let mut filters = g
            .wasm_plugins()
            .network(ListenerClass::Outbound, port)
            .all();
        filters.push(http_filter(g, stat_prefix, port, route));
        filters
    };
    let mut pods = 0;
    let mut seen_vips = BTreeSet::new();
    let mut seen_sni = BTreeSet::new();
    let mut seen_routes = BTreeSet::new();
    let mut filter_chains = Vec::new();
    let mut match_all = None;
    for service in &services {
        let Some(protocol) = service.port(port).map(|p| p.protocol) else {
            continue;
        };
        if protocol.is_http() {
            continue;
        }
        let cluster = outbound_cluster(port, &service.hostname);
        if matches!(protocol, Protocol::Tls | Protocol::Https) && !service.is_headless_kubernetes()
        {
            let addresses = g.service_addresses(service);
            let routed = tls_routes::chains(g, service, port, &addresses);
            if !routed.is_empty() {
                for chain in routed {
                    let key = format!("{:?}", chain.matched);
                    if !seen_routes.insert(key) {
                        continue;
                    }
                    let matched = chain.matched;
                    let filters = tcp_chain(
                        g.stats(Side::SidecarOutbound),
                        g.wasm_plugins()
                            .network(ListenerClass::Outbound, port)
                            .all(),
                        chain.proxy,
                    );
                    let chain = FilterChain {
                        name: format!("{cluster}-tls-{}", filter_chains.len()),
                        filter_chain_match: Some(matched.clone()),
                        filters,
                        ..Default::default()
                    };
                    match matched == FilterChainMatch::default() {
                        true if match_all.is_none() => match_all = Some(chain),
                        true => {}
                        false => filter_chains.push(chain),
                    }
                }
                // Other server names to its addresses go where unknown destinations go, as on
                // istiod's listener of the address (not to another service's catch-all).
                for vip in addresses.iter().filter(|vip| seen_vips.insert(**vip)) {
                    filter_chains.push(FilterChain {
                        name: format!("{cluster}-unrouted-{vip}"),
                        filter_chain_match: Some(FilterChainMatch {
                            prefix_ranges: vec![full_range(*vip)],
                            ..Default::default()
                        }),
                        filters: fallback_filters(g),
                        ..Default::default()
                    });
                }
                continue;
            }
        }
        if service.is_headless_kubernetes() {
            for pod in pod_ranges(g, service, port).filter(|r| seen_vips.insert(r.0)) {
                pods += 1;
                filter_chains.push(FilterChain {
                    name: cluster.clone(),
                    filter_chain_match: Some(FilterChainMatch {
                        prefix_ranges: vec![pod.1],
                        ..Default::default()
                    }),
                    filters: tcp_filters(g, service, port, &cluster),
                    ..Default::default()
                });
            }
            continue;
        }
        let addresses = g.service_addresses(service);
        let vips: Vec<CidrRange> = addresses
            .iter()
            .filter(|vip| seen_vips.insert(**vip))
            .map(|vip| full_range(*vip))
            .collect();
        let filter_chain_match = match (addresses.is_empty(), protocol) {
            (false, _) if vips.is_empty() => continue,
            (false, _) => FilterChainMatch {
                prefix_ranges: vips,
                ..Default::default()
            },
            (true, Protocol::Tls | Protocol::Https) => {
                if !seen_sni.insert(service.hostname.to_string()) {
                    continue;
                }
                FilterChainMatch {
                    server_names: vec![service.hostname.to_string()],
                    ..Default::default()
                }
            }
            // The first address-less TCP service takes every other connection on the port.
            (true, _) => {
                if match_all.is_none() {
                    match_all = Some(FilterChain {
                        name: cluster.clone(),
                        filters: tcp_filters(g, service, port, &cluster),
                        ..Default::default()
                    });
                }
                continue;
            }
        };
        // Its addresses' HTTP, by sniffing, routed by the service's own route `<host>:<port>`
        // whatever the Host header says; stats named as istiod's listener of its address.
        if sniffed(service, protocol) && !filter_chain_match.prefix_ranges.is_empty() {
            let prefix_ranges = filter_chain_match.prefix_ranges.clone();
            let stat_prefix = format!("{}_{port}", prefix_ranges[0].address_prefix);
            let route = format!("{}:{port}", service.hostname);
            filter_chains.push(FilterChain {
                name: format!("{cluster}-http"),
                filter_chain_match: Some(FilterChainMatch {
                    prefix_ranges: prefix_ranges.clone(),
                    ..http_match()
                }),
                filters: http_filters(&stat_prefix, &route),
                ..Default::default()
            });
            // Envoy narrows a connection down level by level and never goes back: once the HTTP
            // chain's `raw_buffer` has claimed the address's plaintext, other plaintext bytes
            // must find the TCP proxy in that same branch, or they fall to the port's default.
            filter_chains.push(FilterChain {
                name: format!("{cluster}-tcp"),
                filter_chain_match: Some(FilterChainMatch {
                    prefix_ranges,
                    transport_protocol: "raw_buffer".to_string(),
                    ..Default::default()
                }),
                filters: tcp_filters(g, service, port, &cluster),
                ..Default::default()
            });
        }
        filter_chains.push(FilterChain {
            name: cluster.clone(),
            filter_chain_match: Some(filter_chain_match),
            filters: tcp_filters(g, service, port, &cluster),
            ..Default::default()
        });
    }
    if has_http {
        filter_chains.push(FilterChain {
            name: format!("{name}-http"),
            filter_chain_match: Some(http_match()),
            filters: http_filters(name, &port.to_string()),
            ..Default::default()
        });
    }
    // As istiod: a headless service without pods (and nothing else on the port) has no listener.
    let only_headless = services.iter().all(|s| s.is_headless_kubernetes());
    if only_headless && pods == 0 && !has_http {
        return None;
    }
    let default_chain = match_all.unwrap_or_else(|| FilterChain {
        name: "PassthroughFilterChain".to_string(),
        filters: fallback_filters(g),
        ..Default::default()
    });
    let listener_filters = inspectors::for_chains(&filter_chains);
    let detection = g.mesh_config().protocol_detection_timeout;
    Some(Listener {
        name: name.to_string(),
        address: Some(socket("0.0.0.0", port)),
        bind_to_port: Some(BoolValue { value: false }),
        // mesh `protocolDetectionTimeout` (0s: sniffing waits for the client's first bytes).
        listener_filters_timeout: Some(inspectors::outbound_timeout(&listener_filters, detection)),
        listener_filters,
        continue_on_listener_filters_timeout: true,
        filter_chains,
        default_filter_chain: Some(default_chain),
        traffic_direction: TrafficDirection::Outbound as i32,
        ..Default::default()
    })
}

/// Where `virtualOutbound` sends what no listener claims.
fn fallback_filters(g: &Generation<'_>) -> Vec<Filter> {
    let fallback = g.outbound_fallback();
    tcp_chain(
        g.stats(Side::SidecarOutbound),
        Vec::new(),
        tcp_proxy_filter(
            fallback,
            fallback,
            g.access_logs().of(Side::SidecarOutbound),
        ),
    )
}

/// A TCP service's chain: plugins and stats around its proxying.
fn tcp_filters(g: &Generation<'_>, service: &Service, port: u16, cluster: &str) -> Vec<Filter> {
    tcp_chain(
        g.stats(Side::SidecarOutbound),
        g.wasm_plugins()
            .network(ListenerClass::Outbound, port)
            .all(),
        tcp_route(g, service, port, cluster),
    )
}

/// The connection manager of HTTP services, routed by RDS `route` (`<port>`, or `<host>:<port>`
/// for one sniffed service), its stats prefixed `outbound_<stat_prefix>`.
fn http_filter(g: &Generation<'_>, stat_prefix: &str, port: u16, route: &str) -> Filter {
    let side = Side::SidecarOutbound;
    let mut hcm = outbound_hcm(
        &format!("outbound_{stat_prefix}"),
        rds(route),
        g.access_logs().of(side),
    );
    g.tracing().of(side).apply(&mut hcm);
    let wasm = g.wasm_plugins().http(ListenerClass::Outbound, port).all();
    hcm.http_filters.splice(0..0, wasm);
    hcm_filter(hcm, g.stats(side), g.path_normalization())
}

/// A TCP service's proxying: the first VirtualService TCP route that applies on this port (its
/// destinations weighted), else the service's own cluster.
fn tcp_route(g: &Generation<'_>, service: &Service, port: u16, cluster: &str) -> Filter {
    let logs = g.access_logs().of(Side::SidecarOutbound);
    // On a TLS port only `tls` routes count (`tls_routes`), as in istiod.
    let tls = service
        .port(port)
        .is_some_and(|p| matches!(p.protocol, Protocol::Tls | Protocol::Https));
    // Stats under the mesh's `outboundClusterStatName`, else the cluster's name (istiod's
    // `buildOutboundNetworkFiltersWithSingleDestination`, pilot/pkg/networking/core/networkfilter.go).
    let pattern = &g.mesh_config().outbound_cluster_stat_name;
    let stat_prefix = stat_names::of(pattern, service, "", port, 0);
    let stat_prefix = stat_prefix.as_deref().unwrap_or(cluster);
    if tls {
        return tcp_proxy_filter(stat_prefix, cluster, logs);
    }
    let routes = g.mesh_routes(&service.hostname, g.egress_scope(port));
    let route = routes.as_ref().and_then(|r| {
        r.tcp.iter().find(|route| {
            route.matches.is_empty()
                || route.matches.iter().any(|m| {
                    m.port.is_none_or(|p| p == u32::from(port))
                        && m.source_labels
                            .iter()
                            .all(|(k, v)| g.source_labels().get(k) == Some(v))
                        && (m.source_namespace.is_empty()
                            || m.source_namespace == g.source_namespace())
                        && (m.gateways.is_empty() || m.gateways.iter().any(|gw| gw == "mesh"))
                })
        })
    });
    let Some(route) = route else {
        return tcp_proxy_filter(stat_prefix, cluster, logs);
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
    weighted_tcp_proxy(cluster, &targets, logs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::istio::MeshConfig;
    use crate::model::MeshSnapshot;
    use crate::xds::generate::cache::ResourceCache;
    use crate::xds::proxy::{tests::node, Proxy};

    #[test]
    fn virtual_outbound_listens_and_guards_the_mesh_s_listen_port() {
        let mut mesh = MeshSnapshot::default();
        mesh.config.set_mesh(MeshConfig {
            proxy_listen_port: 16001,
            ..MeshConfig::default()
        });
        let cache = ResourceCache::default();
        let id = "sidecar~10.0.0.1~a-1.shop~shop.svc.cluster.local";
        let proxy = Proxy::from_node(Some(&node(id, &[]))).expect("a proxy");
        let listener = virtual_outbound(&Generation::new(&mesh, &cache, &proxy));
        assert_eq!(listener.address, Some(socket("0.0.0.0", 16001)));
        let guard = listener.filter_chains[0].filter_chain_match.as_ref();
        let port = guard.and_then(|m| m.destination_port.as_ref());
        assert_eq!(port.map(|p| p.value), Some(16001));
    }
}
