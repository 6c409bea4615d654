//! A waypoint proxy's listeners: `connect_terminate` on 15008, where tunnels end and are routed
//! by authority, a waypoint's `main_internal|<port>|<host>` per served port, and the internal
//! listener its clusters reach endpoints through —
//! `connect_originate` (a new tunnel to a captured endpoint's ztunnel) on a waypoint,
//! `forward_inner_connect` (the inner tunnel, passed on as bytes) on an east-west gateway.

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::Http2ProtocolOptions;
use envoy_types::pb::envoy::config::core::v3::TrafficDirection;
use envoy_types::pb::envoy::config::core::v3::{
    data_source, substitution_format_string, DataSource, SubstitutionFormatString,
};
use envoy_types::pb::envoy::config::listener::v3::{
    listener::{InternalListenerConfig, ListenerSpecifier},
    Filter, FilterChain, Listener, ListenerFilter,
};
use envoy_types::pb::envoy::config::route::v3::{
    route::Action,
    route_action,
    route_action::upgrade_config::ConnectConfig,
    route_match::{ConnectMatcher, PathSpecifier},
    Route, RouteAction, RouteConfiguration, RouteMatch, VirtualHost,
};
use envoy_types::pb::envoy::extensions::filters::common::set_filter_state::v3::{
    filter_state_value, FilterStateValue,
};
use envoy_types::pb::envoy::extensions::filters::http::set_filter_state::v3::Config as SetFilterState;
use envoy_types::pb::envoy::extensions::filters::listener::original_dst::v3::OriginalDst;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_connection_manager::{RouteSpecifier, UpgradeConfig},
    http_filter, HttpConnectionManager, HttpFilter,
};
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::{
    tcp_proxy::{ClusterSpecifier, TunnelingConfig},
    TcpProxy,
};
use envoy_types::pb::google::protobuf::BoolValue;
use envoy_types::util::pack_any;

use super::clusters::{
    main_internal, CONNECT_ORIGINATE, DIRECT_HBONE, DIRECT_PASSTHROUGH, DIRECT_TCP,
    FORWARD_INNER_CONNECT,
};
use super::Served;
use crate::istio::mesh_traffic::Normalization;
use crate::model::waypoints::HBONE_PORT;
use crate::model::Service;
use crate::xds::generate::access_log::Side;
use crate::xds::generate::authz::{Authorization, PEER_PRINCIPAL_STATE};
use crate::xds::generate::common::{seconds, socket};
use crate::xds::generate::filters::{
    hcm, hcm_filter, listener_filter, network_filter, outbound_hcm, tcp_proxy_filter,
};
use crate::xds::generate::generation::Generation;
use crate::xds::generate::names::inbound_vip_cluster;
use crate::xds::generate::tls::hbone_downstream;
use crate::xds::generate::wasm::ListenerClass;
use crate::xds::protocol::ResourceType;
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
    if !served.east_west() {
        let authz = Authorization::for_waypoint(g.mesh, g.namespace(), g.labels());
        for (service, ports) in &served.services {
            for port in ports {
                listeners.push(match served.http(port) {
                    true => http_processing(g, served, service, port.port, &authz),
                    false => tcp_processing(g, service, port.port, &authz),
                });
            }
        }
        for (captured, name) in [(true, DIRECT_HBONE), (false, DIRECT_TCP)] {
            if served.workloads.iter().any(|(_, c)| *c == captured) {
                listeners.push(direct(name, captured, &authz));
            }
        }
    }
    let encoded = listeners
        .iter()
        .map(|l| Resource::encode(l.name.as_str(), l));
    encoded
        .filter_map(|l| g.finish(ResourceType::Listener, l))
        .collect()
}

/// `main_internal|<port>|<host>` of a served TCP port: the policies and WasmPlugins, then the
/// endpoints.
fn tcp_processing(
    g: &Generation<'_>,
    service: &Service,
    port: u16,
    authz: &Authorization<'_>,
) -> Listener {
    let name = main_internal(port, &service.hostname);
    let cluster = inbound_vip_cluster(port, "tcp", &service.hostname);
    let wasm = g.wasm_plugins().network(ListenerClass::Inbound, port);
    let mut filters = authz.custom_network_filters();
    filters.extend(wasm.authn);
    filters.extend(wasm.authz);
    filters.extend(authz.network_filters());
    filters.extend(wasm.rest);
    filters.push(tcp_proxy_filter(
        &cluster,
        &cluster,
        g.access_logs().of(Side::SidecarInbound),
    ));
    processing(name, filters)
}

/// Traffic addressed to a workload (`<pod IP>:<port>`, istiod's `direct-*` chains): the
/// policies, then to that address — in a new tunnel to its ztunnel when ztunnel captures it.
fn direct(name: &str, captured: bool, authz: &Authorization<'_>) -> Listener {
    let mut filters = authz.custom_network_filters();
    filters.extend(authz.network_filters());
    let proxy = match captured {
        true => tunnel_proxy(name, CONNECT_ORIGINATE, Some("%DOWNSTREAM_LOCAL_ADDRESS%")),
        false => tunnel_proxy(name, DIRECT_PASSTHROUGH, None),
    };
    filters.push(proxy);
    processing(name.into(), filters)
}

/// An internal listener processing tunnels: the destination and source restored from the state
/// the tunnel's end shared (what policies match on), then `filters`.
fn processing(name: String, filters: Vec<Filter>) -> Listener {
    Listener {
        name: name.clone(),
        listener_specifier: Some(ListenerSpecifier::InternalListener(
            InternalListenerConfig {},
        )),
        listener_filters: vec![original_dst()],
        filter_chains: vec![FilterChain {
            name,
            filters,
            ..Default::default()
        }],
        traffic_direction: TrafficDirection::Inbound as i32,
        ..Default::default()
    }
}

fn original_dst() -> ListenerFilter {
    listener_filter(
        "envoy.filters.listener.original_dst",
        pack_any(OriginalDst::default()),
    )
}

/// `main_internal|<port>|<host>` of a served HTTP port: the policies and WasmPlugins, then the
/// host's routes.
fn http_processing(
    g: &Generation<'_>,
    served: &Served,
    service: &Service,
    port: u16,
    authz: &Authorization<'_>,
) -> Listener {
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
    // Telemetry as at a workload's inbound side: what the waypoint serves is the service's.
    let logs = g.access_logs().of(Side::SidecarInbound);
    let mut manager = outbound_hcm(&name, RouteSpecifier::RouteConfig(routes), logs);
    g.tracing().of(Side::SidecarInbound).apply(&mut manager);
    // istiod's order: CUSTOM, WasmPlugins of the AUTHN and AUTHZ phases, the policies, the rest.
    let wasm = g.wasm_plugins().http(ListenerClass::Inbound, port);
    let mut before_router = authz.custom_http_filters();
    before_router.extend(wasm.authn);
    before_router.extend(wasm.authz);
    before_router.extend(authz.http_filters());
    before_router.extend(wasm.rest);
    manager.http_filters.splice(0..0, before_router);
    let stats = g.stats(Side::SidecarInbound);
    processing(
        name,
        vec![hcm_filter(manager, stats, g.path_normalization())],
    )
}

/// Ends mTLS and HTTP/2 CONNECT on 15008; each tunnel's payload goes to the cluster its authority
/// names. An authority no served service port has gets a 404 and no tunnel.
fn connect_terminate(served: &Served, trust_domains: &[String]) -> Listener {
    let mut virtual_hosts = Vec::new();
    let mut taken: HashSet<String> = HashSet::new();
    for (service, ports) in &served.services {
        for service_port in ports {
            let port = &service_port.port;
            let cluster = match served.east_west() {
                true => inbound_vip_cluster(*port, "tcp", &service.hostname),
                false => main_internal(*port, &service.hostname),
            };
            // ztunnel names a VIP as `<VIP>:<port>`, and the service by hostname through an
            // east-west gateway (all an east-west gateway is sent).
            let mut domains = vec![format!("{}:{port}", service.hostname)];
            if !served.east_west() {
                let vips = service.cluster_vips.values().flatten();
                domains.extend(
                    vips.filter(|ip| !ip.is_unspecified())
                        .map(|ip| SocketAddr::new(*ip, *port).to_string()),
                );
            }
            // Envoy refuses a domain listed twice (two clusters' services may share a VIP): the
            // first service keeps it.
            domains.retain(|d| taken.insert(d.clone()));
            if domains.is_empty() {
                continue;
            }
            virtual_hosts.push(VirtualHost {
                name: cluster.clone(),
                domains,
                routes: vec![tunnel_to(&cluster)],
                ..Default::default()
            });
        }
    }
    // ztunnel names a workload as `<pod IP>:<port>`, whatever the port.
    for (captured, name) in [(true, DIRECT_HBONE), (false, DIRECT_TCP)] {
        let addresses = served.workloads.iter().filter(|(_, c)| *c == captured);
        let mut domains: Vec<String> = addresses
            .map(|(ip, _)| match ip {
                IpAddr::V4(v4) => format!("{v4}:*"),
                IpAddr::V6(v6) => format!("[{v6}]:*"),
            })
            .collect();
        domains.retain(|d| taken.insert(d.clone()));
        if !domains.is_empty() {
            virtual_hosts.push(VirtualHost {
                name: name.into(),
                domains,
                routes: vec![tunnel_to(name)],
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
    if !served.east_west() {
        manager.http_filters.insert(0, share_peer());
    }
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
            // A tunnel carries no request paths of its own.
            filters: vec![hcm_filter(manager, None, Normalization::Default)],
            transport_socket: Some(hbone_downstream(trust_domains)),
            ..Default::default()
        }],
        traffic_direction: TrafficDirection::Inbound as i32,
        ..Default::default()
    }
}

/// A TCP proxy to `cluster`, in a new tunnel with that authority or as bytes.
fn tunnel_proxy(stat_prefix: &str, cluster: &str, tunnel_authority: Option<&str>) -> Filter {
    let proxy = TcpProxy {
        stat_prefix: stat_prefix.into(),
        cluster_specifier: Some(ClusterSpecifier::Cluster(cluster.into())),
        tunneling_config: tunnel_authority.map(|hostname| TunnelingConfig {
            hostname: hostname.into(),
            ..Default::default()
        }),
        ..Default::default()
    };
    network_filter("envoy.filters.network.tcp_proxy", pack_any(proxy))
}

/// Shares with the internal listener a tunnel goes to what its connection no longer shows: the
/// peer's identity, its address, and the destination the authority names (istiod's
/// `connect_authority` filter; an authority naming a host leaves the destination unset).
fn share_peer() -> HttpFilter {
    let state = |key: &str, factory: &str, format: &str| FilterStateValue {
        key: Some(filter_state_value::Key::ObjectKey(key.into())),
        factory_key: factory.into(),
        value: Some(filter_state_value::Value::FormatString(
            SubstitutionFormatString {
                format: Some(substitution_format_string::Format::TextFormatSource(
                    DataSource {
                        specifier: Some(data_source::Specifier::InlineString(format.into())),
                        ..Default::default()
                    },
                )),
                ..Default::default()
            },
        )),
        shared_with_upstream: filter_state_value::SharedWithUpstream::Once as i32,
        ..Default::default()
    };
    let config = SetFilterState {
        on_request_headers: vec![
            state(
                PEER_PRINCIPAL_STATE,
                "envoy.string",
                "%DOWNSTREAM_PEER_URI_SAN%",
            ),
            state(
                REMOTE_IP_STATE,
                REMOTE_IP_STATE,
                "%DOWNSTREAM_REMOTE_ADDRESS%",
            ),
            state(LOCAL_IP_STATE, LOCAL_IP_STATE, "%REQ(:AUTHORITY)%"),
        ],
        ..Default::default()
    };
    HttpFilter {
        name: "envoy.filters.http.set_filter_state".into(),
        config_type: Some(http_filter::ConfigType::TypedConfig(pack_any(config))),
        ..Default::default()
    }
}

/// The filter state the original-destination listener filter restores an internal connection's
/// addresses from.
const LOCAL_IP_STATE: &str = "envoy.filters.listener.original_dst.local_ip";
const REMOTE_IP_STATE: &str = "envoy.filters.listener.original_dst.remote_ip";

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
    Listener {
        name: name.into(),
        listener_specifier: Some(ListenerSpecifier::InternalListener(
            InternalListenerConfig {},
        )),
        listener_filters: vec![original_dst()],
        filter_chains: vec![FilterChain {
            name: name.into(),
            filters: vec![tunnel_proxy(name, cluster, tunnel_authority)],
            ..Default::default()
        }],
        traffic_direction: TrafficDirection::Outbound as i32,
        ..Default::default()
    }
}
