//! A TLS service port's VirtualService `tls` routes as outbound filter chains, as istiod builds
//! them (`buildSidecarOutboundTLSFilterChainOpts`, pilot/pkg/networking/core/tls.go): every mesh
//! VirtualService whose hosts overlap the service's, oldest first; each match that applies to this
//! proxy and port becomes a chain matched by its SNI hosts (and the service's addresses, or the
//! match's subnets where the service has none), proxied to the route's destinations. Where any
//! applies, the service's own chain is not built: its TLS goes where the routes say (through an
//! egress gateway in Istio's egress task), not straight to the service.

use std::collections::BTreeSet;
use std::net::IpAddr;

use envoy_types::pb::envoy::config::core::v3::CidrRange;
use envoy_types::pb::envoy::config::listener::v3::{Filter, FilterChainMatch};
use envoy_types::pb::google::protobuf::UInt32Value;

use crate::istio::virtual_service::{TlsMatch, TlsRoute};
use crate::model::Service;
use crate::xds::generate::access_log::Side;
use crate::xds::generate::filters::weighted_tcp_proxy;
use crate::xds::generate::generation::Generation;
use crate::xds::generate::routes::{cluster_for, RouteContext};

/// One chain of a TLS route: its match, and the TCP proxy to the route's destinations.
pub(super) struct TlsChain {
    pub(super) matched: FilterChainMatch,
    pub(super) proxy: Filter,
}

/// The chains of the VirtualService `tls` routes that apply to `service` on `port` for this
/// proxy (`addresses`: the service's, by which its chains are matched), without repeating a
/// match.
pub(super) fn chains(
    g: &Generation<'_>,
    service: &Service,
    port: u16,
    addresses: &[IpAddr],
) -> Vec<TlsChain> {
    let routes = g.l4_routes(&service.hostname, g.egress_scope(port));
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for (object, vs) in &routes {
        for route in vs.tls.iter().filter(|r| !r.route.is_empty()) {
            for m in route.matches.iter().filter(|m| applies(g, m, port)) {
                let key = (m.sni_hosts.join(","), m.destination_subnets.join(","));
                if !seen.insert(key) {
                    continue;
                }
                let Some(prefix_ranges) = prefixes(addresses, &m.destination_subnets) else {
                    continue;
                };
                let mut server_names = m.sni_hosts.clone();
                server_names.sort();
                if server_names.iter().any(|h| h == "*") {
                    server_names.clear();
                }
                let stat_prefix = format!("{}.{}", object.key.name, object.key.namespace);
                out.push(TlsChain {
                    matched: FilterChainMatch {
                        prefix_ranges,
                        server_names,
                        ..Default::default()
                    },
                    proxy: proxy(g, route, port, &stat_prefix),
                });
            }
        }
    }
    out
}

/// istiod's `matchTLS`: for sidecars (no gateways, or `mesh`), this port, this client.
fn applies(g: &Generation<'_>, m: &TlsMatch, port: u16) -> bool {
    (m.gateways.is_empty() || m.gateways.iter().any(|gw| gw == "mesh"))
        && m.port.is_none_or(|p| p == u32::from(port))
        && (m.source_labels.iter()).all(|(k, v)| g.source_labels().get(k) == Some(v))
        && (m.source_namespace.is_empty() || m.source_namespace == g.source_namespace())
}

/// The addresses a chain matches: the service's (its subnets must hold one of them, where it
/// names some), else the match's subnets; None when the match cannot reach the service.
fn prefixes(addresses: &[IpAddr], subnets: &[String]) -> Option<Vec<CidrRange>> {
    let nets: Vec<ipnet::IpNet> = subnets.iter().filter_map(|s| parse_net(s)).collect();
    if addresses.is_empty() {
        return Some(
            nets.iter()
                .map(|n| range(n.addr(), n.prefix_len()))
                .collect(),
        );
    }
    let reached: Vec<&IpAddr> = addresses
        .iter()
        .filter(|ip| nets.is_empty() || nets.iter().any(|n| n.contains(*ip)))
        .collect();
    let full = |ip: &IpAddr| if ip.is_ipv6() { 128 } else { 32 };
    (!reached.is_empty()).then(|| reached.into_iter().map(|ip| range(*ip, full(ip))).collect())
}

/// A subnet as written (`10.0.0.0/8`) or a bare address.
fn parse_net(text: &str) -> Option<ipnet::IpNet> {
    text.parse()
        .ok()
        .or_else(|| text.parse::<IpAddr>().ok().map(ipnet::IpNet::from))
}

fn range(ip: IpAddr, prefix_len: u8) -> CidrRange {
    CidrRange {
        address_prefix: ip.to_string(),
        prefix_len: Some(UInt32Value {
            value: u32::from(prefix_len),
        }),
    }
}

/// The route's destinations, weighted (those of weight 0 left out, as istiod).
fn proxy(g: &Generation<'_>, route: &TlsRoute, port: u16, stat_prefix: &str) -> Filter {
    let ctx = RouteContext {
        g,
        port,
        gateway: None,
    };
    let targets: Vec<(String, u32)> = match &route.route[..] {
        [single] => vec![(cluster_for(&ctx, &single.destination), 0)],
        many => many
            .iter()
            .filter(|d| d.weight.unwrap_or(0) > 0)
            .map(|d| (cluster_for(&ctx, &d.destination), d.weight.unwrap_or(0)))
            .collect(),
    };
    weighted_tcp_proxy(
        stat_prefix,
        &targets,
        g.access_logs().of(Side::SidecarOutbound),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chains_match_the_service_s_addresses_within_the_subnets() {
        let vip: IpAddr = "10.96.0.50".parse().unwrap();
        let all = prefixes(&[vip], &[]).unwrap();
        assert_eq!(all[0].address_prefix, "10.96.0.50");
        assert!(prefixes(&[vip], &["10.96.0.0/16".into()]).is_some());
        assert!(prefixes(&[vip], &["192.168.0.0/16".into()]).is_none());
        let none = prefixes(&[], &["192.168.1.7".into()]).unwrap();
        assert_eq!(none[0].prefix_len.as_ref().unwrap().value, 32);
        assert!(prefixes(&[], &[]).unwrap().is_empty());
    }
}
