//! The sidecar's inbound side: `virtualInbound` on 15006, where iptables sends connections to the
//! workload, with a filter chain per port of the workload.

use envoy_types::pb::envoy::config::core::v3::TrafficDirection;
use envoy_types::pb::envoy::config::listener::v3::{
    listener_filter, FilterChain, FilterChainMatch, Listener, ListenerFilter,
};
use envoy_types::pb::envoy::extensions::filters::listener::original_dst::v3::OriginalDst;
use envoy_types::pb::envoy::extensions::filters::listener::tls_inspector::v3::TlsInspector;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::http_connection_manager::{
    ForwardClientCertDetails, RouteSpecifier, SetCurrentClientCertDetails,
};
use envoy_types::pb::google::protobuf::UInt32Value;
use envoy_types::util::pack_any;

use super::cds::{inbound_cluster, INBOUND_PASSTHROUGH};
use super::lds::{hcm, network_filter, tcp_proxy_filter, VIRTUAL_INBOUND};
use super::rds::inbound_route;
use super::{socket, tls, Generation};

const INBOUND_PORT: u16 = 15006;

pub fn virtual_inbound(g: &Generation<'_>) -> Listener {
    // PERMISSIVE, as Istio's default: per port one chain for mTLS (client certificate required) and
    // one for plaintext, told apart by the TLS inspector.
    let mut filter_chains: Vec<FilterChain> = Vec::new();
    for (port, protocol) in g.inbound_ports() {
        let cluster = inbound_cluster(port);
        for mtls in [true, false] {
            let filter = if protocol.is_http() {
                let route = inbound_route(port, &cluster);
                let mut hcm = hcm(
                    &format!("inbound_0.0.0.0_{port}"),
                    RouteSpecifier::RouteConfig(route),
                );
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
            } else {
                tcp_proxy_filter(&cluster, &cluster)
            };
            filter_chains.push(FilterChain {
                name: format!("{cluster}{}", if mtls { "-mtls" } else { "-plaintext" }),
                filter_chain_match: Some(FilterChainMatch {
                    destination_port: Some(UInt32Value {
                        value: u32::from(port),
                    }),
                    transport_protocol: if mtls { "tls" } else { "raw_buffer" }.to_string(),
                    ..Default::default()
                }),
                filters: vec![filter],
                transport_socket: mtls.then(tls::inbound_socket),
                ..Default::default()
            });
        }
    }
    filter_chains.push(FilterChain {
        name: "virtualInbound-catchall-tcp".to_string(),
        filters: vec![tcp_proxy_filter(INBOUND_PASSTHROUGH, INBOUND_PASSTHROUGH)],
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
