//! A waypoint proxy's listeners: `connect_terminate` on 15008, where tunnels end and are routed
//! by authority, `main_internal|<port>|<host>` per served HTTP port, and the internal listener its
//! clusters reach endpoints through —
//! `connect_originate` (a new tunnel to a captured endpoint's ztunnel) on a waypoint,
//! `forward_inner_connect` (the inner tunnel, passed on as bytes) on an east-west gateway.

use std::net::SocketAddr;
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::Http2ProtocolOptions;
use envoy_types::pb::envoy::config::core::v3::TrafficDirection;
use envoy_types::pb::envoy::config::listener::v3::{
    listener::{InternalListenerConfig, ListenerSpecifier},
    FilterChain, Listener,
};
use envoy_types::pb::envoy::config::route::v3::{
    route::Action,
    route_action,
    route_action::upgrade_config::ConnectConfig,
    route_match::{ConnectMatcher, PathSpecifier},
    Route, RouteAction, RouteConfiguration, RouteMatch, VirtualHost,
};
use envoy_types::pb::envoy::extensions::filters::listener::original_dst::v3::OriginalDst;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_connection_manager::{RouteSpecifier, UpgradeConfig},
    HttpConnectionManager,
};
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::{
    tcp_proxy::{ClusterSpecifier, TunnelingConfig},
    TcpProxy,
};
use envoy_types::pb::google::protobuf::BoolValue;
use envoy_types::util::pack_any;

use super::clusters::{main_internal, CONNECT_ORIGINATE, FORWARD_INNER_CONNECT};
use super::Served;
use crate::model::waypoints::HBONE_PORT;
use crate::model::Service;
use crate::xds::generate::common::{seconds, socket};
use crate::xds::generate::filters::{
    hcm, hcm_filter, listener_filter, network_filter, outbound_hcm,
};
use crate::xds::generate::generation::Generation;
use crate::xds::generate::names::inbound_vip_cluster;
use crate::xds::generate::tls::hbone_downstream;
use crate::xds::wire::Resource;

pub(super) const CONNECT_TERMINATE: &str = "connect_terminate";
const CONNECT: &str = "CONNECT";

pub(super) fn all(g: &Generation<'_>, served: &Served) -> Vec<Arc<Resource>> {
    let trust_domains = vec![g.mesh_config().trust_domain.clone()];
    let inner = match served.east_west() {
        true => internal(FORWARD_INNER_CONNECT, FORWARD_INNER_CONNECT, None),
        // The endpoint's address, as the tunnel's authority (istiod's `%DOWNSTREAM_LOCAL_ADDRESS%`).
        false => internal(
            CONNECT_ORIGINATE,
            CONNECT_ORIGINATE,
            Some("%DOWNSTREAM_LOCAL_ADDRESS%"),
        ),
    };
    let mut listeners = vec![connect_terminate(served, &trust_domains), inner];
    for (service, ports) in &served.services {
        for port in ports.iter().filter(|p| served.http(p)) {
            listeners.push(http_processing(g, served, service, port.port));
        }
    }
    listeners
        .iter()
        .map(|l| Arc::new(Resource::encode(l.name.as_str(), l)))
        .collect()
}

/// `main_internal|<port>|<host>`: the tunnels of a served HTTP port, processed as HTTP by the
/// host's routes.
fn http_processing(g: &Generation<'_>, served: &Served, service: &Service, port: u16) -> Listener {
    let name = main_internal(port, &service.hostname);
    let routes = RouteConfiguration {
        name: name.clone(),
        virtual_hosts: vec![VirtualHost {
            name: format!("inbound|http|{port}"),
            domains: vec!["*".into()],
            routes: super::http_routes(g, served, service, port),
            ..Default::default()
        }],
        validate_clusters: Some(BoolValue { value: false }),
        ..Default::default()
    };
    let manager = outbound_hcm(&name, RouteSpecifier::RouteConfig(routes), &[]);
    Listener {
        name: name.clone(),
        listener_specifier: Some(ListenerSpecifier::InternalListener(
            InternalListenerConfig {},
        )),
        filter_chains: vec![FilterChain {
            name,
            filters: vec![hcm_filter(manager, None)],
            ..Default::default()
        }],
        traffic_direction: TrafficDirection::Inbound as i32,
        ..Default::default()
    }
}

/// Ends mTLS and HTTP/2 CONNECT on 15008; each tunnel's payload goes to the cluster its authority
/// names. An authority no served service port has gets a 404 and no tunnel.
fn connect_terminate(served: &Served, trust_domains: &[String]) -> Listener {
    let mut virtual_hosts = Vec::new();
    for (service, ports) in &served.services {
        for service_port in ports {
            let port = &service_port.port;
            let cluster = match served.http(service_port) {
                true => main_internal(*port, &service.hostname),
                false => inbound_vip_cluster(*port, "tcp", &service.hostname),
            };
            // ztunnel names a VIP as `<VIP>:<port>` (through an east-west gateway, the hostname).
            let mut domains = vec![format!("{}:{port}", service.hostname)];
            let vips = service.cluster_vips.values().flatten();
            domains.extend(
                vips.filter(|ip| !ip.is_unspecified())
                    .map(|ip| SocketAddr::new(*ip, *port).to_string()),
            );
            domains.sort();
            domains.dedup();
            virtual_hosts.push(VirtualHost {
                name: cluster.clone(),
                domains,
                routes: vec![tunnel_to(&cluster)],
                ..Default::default()
            });
        }
    }
    let mut manager: HttpConnectionManager = hcm(
        CONNECT_TERMINATE,
        RouteSpecifier::RouteConfig(RouteConfiguration {
            name: "default".into(),
            virtual_hosts,
            ..Default::default()
        }),
        &[],
    );
    manager.upgrade_configs = vec![UpgradeConfig {
        upgrade_type: CONNECT.into(),
        ..Default::default()
    }];
    manager.http2_protocol_options = Some(Http2ProtocolOptions {
        allow_connect: true,
        ..Default::default()
    });
    // A tunnel lives as long as its connection: no idle timeout of its stream.
    manager.stream_idle_timeout = Some(seconds(0));
    manager.use_remote_address = Some(BoolValue { value: false });
    Listener {
        name: CONNECT_TERMINATE.into(),
        address: Some(socket("0.0.0.0", HBONE_PORT)),
        filter_chains: vec![FilterChain {
            name: "default".into(),
            filters: vec![hcm_filter(manager, None)],
            transport_socket: Some(hbone_downstream(trust_domains)),
            ..Default::default()
        }],
        traffic_direction: TrafficDirection::Inbound as i32,
        ..Default::default()
    }
}

/// A route ending CONNECT: the tunnel's payload is a TCP stream to `cluster`.
fn tunnel_to(cluster: &str) -> Route {
    Route {
        r#match: Some(RouteMatch {
            path_specifier: Some(PathSpecifier::ConnectMatcher(ConnectMatcher {})),
            ..Default::default()
        }),
        action: Some(Action::Route(RouteAction {
            cluster_specifier: Some(route_action::ClusterSpecifier::Cluster(cluster.into())),
            upgrade_configs: vec![route_action::UpgradeConfig {
                upgrade_type: CONNECT.into(),
                connect_config: Some(ConnectConfig::default()),
                ..Default::default()
            }],
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// An internal listener restoring the endpoint address its cluster passed on (the `local`
/// metadata of `envoy.filters.listener.original_dst`), proxying to `cluster` — in a new tunnel
/// with that authority, or as bytes.
fn internal(name: &str, cluster: &str, tunnel_authority: Option<&str>) -> Listener {
    let proxy = TcpProxy {
        stat_prefix: name.into(),
        cluster_specifier: Some(ClusterSpecifier::Cluster(cluster.into())),
        tunneling_config: tunnel_authority.map(|hostname| TunnelingConfig {
            hostname: hostname.into(),
            ..Default::default()
        }),
        ..Default::default()
    };
    Listener {
        name: name.into(),
        listener_specifier: Some(ListenerSpecifier::InternalListener(
            InternalListenerConfig {},
        )),
        listener_filters: vec![listener_filter(
            "envoy.filters.listener.original_dst",
            pack_any(OriginalDst::default()),
        )],
        filter_chains: vec![FilterChain {
            name: name.into(),
            filters: vec![network_filter(
                "envoy.filters.network.tcp_proxy",
                pack_any(proxy),
            )],
            ..Default::default()
        }],
        traffic_direction: TrafficDirection::Outbound as i32,
        ..Default::default()
    }
}
