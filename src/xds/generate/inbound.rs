//! The sidecar's inbound side: `virtualInbound` on 15006, where iptables sends connections to the
//! workload, with filter chains per port of the workload as its PeerAuthentication says (STRICT:
//! mutual TLS only; PERMISSIVE: mutual TLS and plaintext, told apart by the TLS inspector;
//! DISABLE: plaintext), each with the workload's authentication and authorization filters.

use envoy_types::pb::envoy::config::core::v3::TransportSocket;
use envoy_types::pb::envoy::config::core::v3::TrafficDirection;
use envoy_types::pb::envoy::config::listener::v3::{
    listener_filter, Filter, FilterChain, FilterChainMatch, Listener, ListenerFilter,
};
use envoy_types::pb::envoy::extensions::filters::listener::original_dst::v3::OriginalDst;
use envoy_types::pb::envoy::extensions::filters::listener::tls_inspector::v3::TlsInspector;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::http_connection_manager::{
    ForwardClientCertDetails, RouteSpecifier, SetCurrentClientCertDetails,
};
use envoy_types::pb::google::protobuf::UInt32Value;
use envoy_types::util::pack_any;

use super::lds::{hcm, network_filter, tcp_proxy_filter};
use super::names::{inbound_cluster, INBOUND_PASSTHROUGH, VIRTUAL_INBOUND};
use super::rds::inbound_route;
use super::security::WorkloadSecurity;
use super::{socket, tls, Generation};
use crate::istio::security::peer::MtlsMode;

const INBOUND_PORT: u16 = 15006;

/// How a chain receives connections.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Transport {
    /// Mutual TLS terminated here (a verified client certificate required).
    Mtls,
    /// Plaintext, told from TLS by the inspector.
    Plaintext,
    /// Whatever arrives, passed on as it is.
    Any,
}

/// The chains a mode asks for.
fn transports(mode: MtlsMode) -> &'static [Transport] {
    match mode {
        MtlsMode::Strict => &[Transport::Mtls],
        MtlsMode::Permissive | MtlsMode::Unset => &[Transport::Mtls, Transport::Plaintext],
        MtlsMode::Disable => &[Transport::Any],
    }
}

impl Transport {
    fn name(self) -> &'static str {
        match self {
            Transport::Mtls => "-mtls",
            Transport::Plaintext => "-plaintext",
            Transport::Any => "",
        }
    }

    fn protocol(self) -> &'static str {
        match self {
            Transport::Mtls => "tls",
            Transport::Plaintext => "raw_buffer",
            Transport::Any => "",
        }
    }

    fn socket(self) -> Option<TransportSocket> {
        (self == Transport::Mtls).then(tls::inbound_socket)
    }
}

pub fn virtual_inbound(g: &Generation<'_>) -> Listener {
    let security = WorkloadSecurity::for_workload(g.mesh, &g.proxy.namespace, &g.proxy.labels);
    let mut filter_chains: Vec<FilterChain> = Vec::new();
    for (port, protocol) in g.inbound_ports() {
        let cluster = inbound_cluster(port);
        for transport in transports(security.mtls.for_port(port)) {
            let filters = match protocol.is_http() {
                true => vec![http_filter(port, &cluster, &security)],
                false => with_network(&security, tcp_proxy_filter(&cluster, &cluster)),
            };
            filter_chains.push(FilterChain {
                name: format!("{cluster}{}", transport.name()),
                filter_chain_match: Some(FilterChainMatch {
                    destination_port: Some(UInt32Value {
                        value: u32::from(port),
                    }),
                    transport_protocol: transport.protocol().to_string(),
                    ..Default::default()
                }),
                filters,
                transport_socket: transport.socket(),
                ..Default::default()
            });
        }
    }
    // Ports no service declares: mutual TLS only under STRICT, else passed through as they come.
    let passthrough = match security.mtls.mode {
        MtlsMode::Strict => Transport::Mtls,
        _ => Transport::Any,
    };
    filter_chains.push(FilterChain {
        name: "virtualInbound-catchall-tcp".to_string(),
        filter_chain_match: (passthrough == Transport::Mtls).then(|| FilterChainMatch {
            transport_protocol: passthrough.protocol().to_string(),
            ..Default::default()
        }),
        filters: with_network(
            &security,
            tcp_proxy_filter(INBOUND_PASSTHROUGH, INBOUND_PASSTHROUGH),
        ),
        transport_socket: passthrough.socket(),
        ..Default::default()
    });
    let listener_filter = |name: &str, config| ListenerFilter {
        name: name.to_string(),
        config_type: Some(listener_filter::ConfigType::TypedConfig(config)),
        ..Default::default()
    };
    Listener {
        name: VIRTUAL_INBOUND.to_string(),
        address: Some(socket("0.0.0.0", INBOUND_PORT)),
        listener_filters: vec![
            listener_filter(
                "envoy.filters.listener.original_dst",
                pack_any(OriginalDst::default()),
            ),
            listener_filter(
                "envoy.filters.listener.tls_inspector",
                pack_any(TlsInspector::default()),
            ),
        ],
        filter_chains,
        traffic_direction: TrafficDirection::Inbound as i32,
        ..Default::default()
    }
}

/// The workload's network filters, then `last`.
fn with_network(security: &WorkloadSecurity, last: Filter) -> Vec<Filter> {
    let mut filters = security.network_filters().to_vec();
    filters.push(last);
    filters
}

fn http_filter(port: u16, cluster: &str, security: &WorkloadSecurity) -> Filter {
    let route = inbound_route(port, cluster);
    let mut hcm = hcm(
        &format!("inbound_0.0.0.0_{port}"),
        RouteSpecifier::RouteConfig(route),
    );
    hcm.http_filters
        .splice(0..0, security.http_filters().iter().cloned());
    // The application learns the caller's verified identity, as with Istio (XFCC).
    hcm.forward_client_cert_details = ForwardClientCertDetails::AppendForward as i32;
    hcm.set_current_client_cert_details = Some(SetCurrentClientCertDetails {
        uri: true,
        ..Default::default()
    });
    network_filter(
        "envoy.filters.network.http_connection_manager",
        pack_any(hcm),
    )
}
