//! The listener filters that read what a connection starts with, so filter chains can match on
//! it: the TLS inspector (transport `tls`, SNI, ALPN) and the HTTP inspector (`http/1.1`,
//! `h2c`). As istiod (`populateListenerFilters`, pilot/pkg/networking/core/listener_inbound.go),
//! each runs only where a chain needs it: an inspector waits for the client's first bytes, which
//! a server-first protocol never sends, so ports whose chains do not match on them are left out
//! by a destination-port predicate.

use std::collections::BTreeMap;

use envoy_types::pb::envoy::config::listener::v3::listener_filter_chain_match_predicate::{
    MatchSet, Rule,
};
use envoy_types::pb::envoy::config::listener::v3::{
    FilterChain, ListenerFilter, ListenerFilterChainMatchPredicate,
};
use envoy_types::pb::envoy::extensions::filters::listener::http_inspector::v3::HttpInspector;
use envoy_types::pb::envoy::extensions::filters::listener::tls_inspector::v3::TlsInspector;
use envoy_types::pb::envoy::r#type::v3::Int32Range;
use envoy_types::pb::google::protobuf::UInt32Value;
use envoy_types::util::pack_any;

use super::filters::listener_filter;

const TLS_INSPECTOR: &str = "envoy.filters.listener.tls_inspector";
const HTTP_INSPECTOR: &str = "envoy.filters.listener.http_inspector";

/// The ALPN the HTTP inspector reports for plaintext HTTP/1.1 and HTTP/2 (istiod's
/// `plaintextHTTPALPNs`; HTTP/1.0 is not matched, so it passes through as TCP).
pub(super) const PLAINTEXT_HTTP_ALPN: &[&str] = &["http/1.1", "h2c"];

/// Every ALPN Istio's clients offer over mTLS (istiod's `allIstioMtlsALPNs`,
/// pilot/pkg/networking/core/listener.go): a declared inbound port and an east-west gateway's
/// passthrough chains serve any of them.
pub(super) const ALL_MTLS_ALPN: &[&str] = &[
    "istio",
    "istio-peer-exchange",
    "istio-http/1.0",
    "istio-http/1.1",
    "istio-h2",
];

/// Reads SNI and the transport protocol for filter chain matches, everywhere on the listener.
pub(super) fn tls_inspector() -> ListenerFilter {
    listener_filter(
        TLS_INSPECTOR,
        pack_any(TlsInspector {
            // istiod's; Envoy's default reads 64 KiB before giving up on a ClientHello.
            initial_read_buffer_size: Some(UInt32Value { value: 512 }),
            ..Default::default()
        }),
    )
}

/// What the chains on one destination port (0: chains for any port) ask of the inspectors.
#[derive(Clone, Copy, Default)]
struct Needs {
    tls: bool,
    http: bool,
}

/// The inspectors `chains` need, each disabled on the ports that do not need it.
pub(super) fn for_chains<'c>(
    chains: impl IntoIterator<Item = &'c FilterChain>,
) -> Vec<ListenerFilter> {
    let mut ports: BTreeMap<i32, Needs> = BTreeMap::new();
    for chain in chains {
        let Some(m) = chain.filter_chain_match.as_ref() else {
            ports.entry(0).or_default();
            continue;
        };
        let port = m.destination_port.map_or(0, |p| p.value as i32);
        let needs = ports.entry(port).or_default();
        needs.tls |= m.transport_protocol == "tls" || !m.server_names.is_empty();
        needs.http |= m
            .application_protocols
            .iter()
            .any(|a| PLAINTEXT_HTTP_ALPN.contains(&a.as_str()));
    }
    let mut filters = Vec::new();
    if ports.values().any(|n| n.tls) {
        filters.push(ListenerFilter {
            filter_disabled: disabled_on(&ports, |n| n.tls),
            ..tls_inspector()
        });
    }
    if ports.values().any(|n| n.http) {
        filters.push(ListenerFilter {
            filter_disabled: disabled_on(&ports, |n| n.http),
            ..listener_filter(HTTP_INSPECTOR, pack_any(HttpInspector::default()))
        });
    }
    filters
}

/// How long an outbound listener waits for its inspectors: the mesh's `protocolDetectionTimeout`
/// where the HTTP inspector sniffs, no limit otherwise (istiod's `buildListenerFromEntry`,
/// pilot/pkg/networking/core/listener.go).
pub(super) fn outbound_timeout(
    filters: &[ListenerFilter],
    detection: crate::istio::duration::Duration,
) -> envoy_types::pb::google::protobuf::Duration {
    match filters.iter().any(|f| f.name == HTTP_INSPECTOR) {
        true => detection.to_proto(),
        false => Default::default(),
    }
}

/// Where an inspector must not run. Chains for any port (0) decide the default: when they need
/// it, it is off on the ports that do not; when they do not, it runs only on the ports that do.
fn disabled_on(
    ports: &BTreeMap<i32, Needs>,
    needed: impl Fn(&Needs) -> bool,
) -> Option<ListenerFilterChainMatchPredicate> {
    let default_on = ports.get(&0).is_some_and(&needed);
    let listed: Vec<i32> = ports
        .iter()
        .filter(|(port, needs)| **port != 0 && needed(needs) != default_on)
        .map(|(port, _)| *port)
        .collect();
    let any_of = match listed.as_slice() {
        [] => return None,
        [port] => port_rule(*port),
        _ => Rule::OrMatch(MatchSet {
            rules: listed
                .iter()
                .map(|p| ListenerFilterChainMatchPredicate {
                    rule: Some(port_rule(*p)),
                })
                .collect(),
        }),
    };
    let any_of = ListenerFilterChainMatchPredicate { rule: Some(any_of) };
    Some(match default_on {
        true => any_of,
        false => ListenerFilterChainMatchPredicate {
            rule: Some(Rule::NotMatch(Box::new(any_of))),
        },
    })
}

/// One destination port, as a `[port, port + 1)` range.
fn port_rule(port: i32) -> Rule {
    Rule::DestinationPortRange(Int32Range {
        start: port,
        end: port + 1,
    })
}

#[cfg(test)]
mod tests {
    use envoy_types::pb::envoy::config::listener::v3::FilterChainMatch;

    use super::*;

    fn chain(port: u32, transport: &str, alpn: &[&str]) -> FilterChain {
        FilterChain {
            filter_chain_match: Some(FilterChainMatch {
                destination_port: (port != 0).then_some(UInt32Value { value: port }),
                transport_protocol: transport.to_string(),
                application_protocols: alpn.iter().map(|a| a.to_string()).collect(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn ports_of(p: &ListenerFilterChainMatchPredicate) -> (bool, Vec<i32>) {
        match p.rule.as_ref().unwrap() {
            Rule::NotMatch(inner) => (false, ports_of(inner).1),
            Rule::DestinationPortRange(r) => (true, vec![r.start]),
            Rule::OrMatch(set) => (true, set.rules.iter().flat_map(|r| ports_of(r).1).collect()),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn inspectors_run_only_where_chains_match_on_them() {
        // Passthrough for any port sniffs both; 3306 (plaintext TCP) needs neither, 9080 (a
        // PERMISSIVE HTTP port) only TLS.
        let chains = [
            chain(0, "tls", &["istio-http/1.1"]),
            chain(0, "raw_buffer", PLAINTEXT_HTTP_ALPN),
            chain(3306, "raw_buffer", &[]),
            chain(9080, "tls", &["istio"]),
            chain(9080, "raw_buffer", &[]),
        ];
        let filters = for_chains(&chains);
        let names: Vec<&str> = filters.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, [TLS_INSPECTOR, HTTP_INSPECTOR]);
        assert_eq!(
            ports_of(filters[0].filter_disabled.as_ref().unwrap()),
            (true, vec![3306])
        );
        assert_eq!(
            ports_of(filters[1].filter_disabled.as_ref().unwrap()),
            (true, vec![3306, 9080])
        );
    }

    #[test]
    fn without_a_catch_all_an_inspector_runs_only_on_its_ports() {
        let chains = [chain(0, "raw_buffer", &[]), chain(8443, "tls", &[])];
        let filters = for_chains(&chains);
        assert_eq!(filters.len(), 1);
        assert_eq!(
            ports_of(filters[0].filter_disabled.as_ref().unwrap()),
            (false, vec![8443])
        );
        assert!(for_chains(&[chain(0, "", &[])]).is_empty());
    }
}
