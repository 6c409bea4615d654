//! A waypoint proxy's clusters and their endpoints: `inbound-vip|<port>|<tcp|http>|<host>` per
//! served service port (EDS), a waypoint's `main_internal|<port>|<host>` to each port's internal
//! listener and the outbound clusters its routes send to, and the cluster behind the internal
//! listener its endpoints are reached through.
//!
//! A waypoint's endpoints are the service's healthy endpoints on its network: a pod ztunnel
//! captures is reached through `connect_originate` (its address passed on as the tunnel's
//! destination; HBONE to its ztunnel on 15008), any other directly. An east-west gateway's are
//! reached through `forward_inner_connect`, which passes the inner tunnel to 15008 of the service's
//! endpoints — or of its waypoint's pods, so that traffic from another network is not let past the
//! waypoint (Istio's open issue).

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use envoy_types::pb::envoy::config::cluster::v3::cluster::{
    ClusterDiscoveryType, DiscoveryType, EdsClusterConfig, LbConfig, OriginalDstLbConfig,
    TransportSocketMatch,
};
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::core::v3::{
    address, envoy_internal_address::AddressNameSpecifier, transport_socket, Address,
    EnvoyInternalAddress, Metadata, TransportSocket,
};
use envoy_types::pb::envoy::config::endpoint::v3::{
    lb_endpoint, ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints,
};
use envoy_types::pb::envoy::extensions::transport_sockets::internal_upstream::v3::{
    internal_upstream_transport::MetadataValueSource, InternalUpstreamTransport,
};
use envoy_types::pb::envoy::r#type::metadata::v3::{metadata_kind, MetadataKind};
use envoy_types::pb::google::protobuf::UInt32Value;
use envoy_types::util::pack_any;

use super::{gateway, ports, Served};
use crate::model::waypoints::HBONE_PORT;
use crate::model::{Health, Protocol, Service};
use crate::xds::generate::clusters as shared_clusters;
use crate::xds::generate::common::{ads_awaited, seconds, socket};
use crate::xds::generate::eds::strings;
use crate::xds::generate::generation::Generation;
use crate::xds::generate::names::{inbound_vip_cluster, parse_inbound_vip, parse_outbound};
use crate::xds::generate::policy::{http2_only, http2_tunnels};
use crate::xds::generate::tls::{hbone_upstream, plaintext};
use crate::xds::protocol::ResourceType;
use crate::xds::wire::Resource;

pub(super) const CONNECT_ORIGINATE: &str = "connect_originate";
/// A waypoint's internal listeners (and the clusters reaching them) for traffic addressed to its
/// workloads, and the cluster sending it on to the workload as it is.
pub(super) const DIRECT_HBONE: &str = "direct-hbone";
pub(super) const DIRECT_TCP: &str = "direct-tcp";
pub(super) const DIRECT_PASSTHROUGH: &str = "direct-passthrough";
pub(super) const FORWARD_INNER_CONNECT: &str = "forward_inner_connect";
/// Where a cluster's endpoint passes its address to the internal listener it reaches.
const ORIGINAL_DST: &str = "envoy.filters.listener.original_dst";
/// Endpoint metadata choosing a transport socket, and the value of tunnelled endpoints.
const SOCKET_MATCH: &str = "envoy.transport_socket_match";
const TUNNEL: (&str, &str) = ("tunnel", "hbone");
const CONNECT_TIMEOUT_SECS: i64 = 10;

/// The internal listener (and the cluster reaching it) processing a waypoint's served port.
pub(super) fn main_internal(port: u16, host: &str) -> String {
    format!("main_internal|{port}|{host}")
}

pub(super) fn all(g: &Generation<'_>, served: &Served) -> Vec<Arc<Resource>> {
    let mut clusters: Vec<Cluster> = Vec::new();
    // Other services' outbound clusters that HTTP routes send to.
    let mut outbound: BTreeSet<String> = BTreeSet::new();
    for (service, ports) in &served.services {
        for port in ports {
            let host = &service.hostname;
            if !served.east_west() {
                clusters.push(to_internal_listener(&main_internal(port.port, host)));
            }
            if !served.http(port) {
                let name = inbound_vip_cluster(port.port, "tcp", host);
                clusters.push(inbound_vip(name, served.east_west()));
                continue;
            }
            let mut cluster = inbound_vip(inbound_vip_cluster(port.port, "http", host), false);
            if matches!(port.protocol, Protocol::Http2 | Protocol::Grpc) {
                cluster.typed_extension_protocol_options = http2_only();
            }
            clusters.push(cluster);
            let mut routes = super::http_routes(g, served, service, port.port);
            let sent_to = routes.iter_mut().flat_map(super::destinations);
            outbound.extend(
                sent_to
                    .filter(|c| parse_outbound(c).is_some())
                    .map(|c| c.clone()),
            );
        }
    }
    for (captured, name) in [(true, DIRECT_HBONE), (false, DIRECT_TCP)] {
        if served.workloads.iter().any(|(_, c)| *c == captured) {
            clusters.push(to_internal_listener(name));
        }
    }
    if served.workloads.iter().any(|(_, captured)| !captured) {
        clusters.push(shared_clusters::original_dst(DIRECT_PASSTHROUGH));
    }
    let trust_domains = vec![g.mesh_config().trust_domain.clone()];
    clusters.push(match served.east_west() {
        true => original_dst(FORWARD_INNER_CONNECT),
        false => Cluster {
            transport_socket: Some(hbone_upstream(&trust_domains)),
            typed_extension_protocol_options: http2_tunnels(),
            ..original_dst(CONNECT_ORIGINATE)
        },
    });
    let encoded = clusters
        .iter()
        .map(|c| Resource::encode(c.name.as_str(), c));
    let mut resources: Vec<Arc<Resource>> = encoded
        .filter_map(|c| g.finish(ResourceType::Cluster, c))
        .collect();
    resources.extend(
        outbound
            .iter()
            .filter_map(|name| shared_clusters::build(g, name)),
    );
    resources
}

/// A cluster of one endpoint: the internal listener of that name, given the filter state the
/// tunnel's end shared (the internal upstream transport passes it).
fn to_internal_listener(name: &str) -> Cluster {
    let endpoint = LbEndpoint {
        host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
            address: Some(internal_address(name, String::new())),
            ..Default::default()
        })),
        ..Default::default()
    };
    Cluster {
        name: name.into(),
        cluster_discovery_type: Some(ClusterDiscoveryType::Type(DiscoveryType::Static as i32)),
        connect_timeout: Some(seconds(CONNECT_TIMEOUT_SECS)),
        transport_socket: Some(internal_upstream()),
        load_assignment: Some(ClusterLoadAssignment {
            cluster_name: name.into(),
            endpoints: vec![LocalityLbEndpoints {
                lb_endpoints: vec![endpoint],
                ..Default::default()
            }],
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn internal_address(listener: &str, endpoint_id: String) -> Address {
    Address {
        address: Some(address::Address::EnvoyInternalAddress(
            EnvoyInternalAddress {
                address_name_specifier: Some(AddressNameSpecifier::ServerListenerName(
                    listener.into(),
                )),
                endpoint_id,
            },
        )),
    }
}

/// A service port's cluster: endpoints over EDS, internal ones given their address to pass on.
fn inbound_vip(name: String, east_west: bool) -> Cluster {
    let mut cluster = Cluster {
        cluster_discovery_type: Some(ClusterDiscoveryType::Type(DiscoveryType::Eds as i32)),
        eds_cluster_config: Some(EdsClusterConfig {
            eds_config: Some(ads_awaited()),
            service_name: name.clone(),
        }),
        connect_timeout: Some(seconds(CONNECT_TIMEOUT_SECS)),
        name,
        ..Default::default()
    };
    match east_west {
        true => cluster.transport_socket = Some(internal_upstream()),
        false => {
            cluster.transport_socket_matches = vec![TransportSocketMatch {
                name: "hbone".into(),
                r#match: Some(strings(&[TUNNEL])),
                transport_socket: Some(internal_upstream()),
            }];
            cluster.transport_socket = Some(plaintext());
        }
    }
    cluster
}

/// To the address the connection was restored to, on HBONE's port.
fn original_dst(name: &str) -> Cluster {
    Cluster {
        lb_config: Some(LbConfig::OriginalDstLbConfig(OriginalDstLbConfig {
            upstream_port_override: Some(UInt32Value {
                value: u32::from(HBONE_PORT),
            }),
            ..Default::default()
        })),
        ..shared_clusters::original_dst(name)
    }
}

/// The endpoints of an `inbound-vip|…` cluster of this proxy.
pub(crate) fn endpoints(g: &Generation<'_>, name: &str) -> Option<Arc<Resource>> {
    let parsed = parse_inbound_vip(name)?;
    // One service looked up, not every one the proxy serves (one request per cluster).
    let served = gateway(g)?;
    let service = &g.mesh.services.get(parsed.host)?;
    let served_port = ports(service).into_iter().any(|p| p.port == parsed.port);
    (served_port && served.takes(g, service)).then_some(())?;
    let targets = match served.east_west() {
        true => east_west_targets(g, &served, service, parsed.port),
        false => targets(g, &served.network, service, parsed.port),
    };
    let lb_endpoints = targets
        .into_iter()
        .map(|(address, weight, tunnel)| {
            let endpoint = match (served.east_west(), tunnel) {
                (true, _) => internal(FORWARD_INNER_CONNECT, address, false),
                (false, true) => internal(CONNECT_ORIGINATE, address, true),
                (false, false) => LbEndpoint {
                    host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
                        address: Some(socket(&address.ip().to_string(), address.port())),
                        ..Default::default()
                    })),
                    ..Default::default()
                },
            };
            LbEndpoint {
                load_balancing_weight: Some(UInt32Value { value: weight }),
                ..endpoint
            }
        })
        .collect();
    let assignment = ClusterLoadAssignment {
        cluster_name: name.into(),
        endpoints: vec![LocalityLbEndpoints {
            lb_endpoints,
            ..Default::default()
        }],
        ..Default::default()
    };
    Some(Arc::new(Resource::encode(name, &assignment)))
}

/// A service port's healthy endpoints on `network`: address, weight, and whether ztunnel captures
/// the workload (reached by HBONE).
fn targets(
    g: &Generation<'_>,
    network: &str,
    service: &Service,
    port: u16,
) -> Vec<(SocketAddr, u32, bool)> {
    let Some(port_name) = service.port(port).map(|p| p.name.as_str()) else {
        return Vec::new();
    };
    let Some(shards) = g.mesh.endpoints.get(&service.key()) else {
        return Vec::new();
    };
    let usable = shards.endpoints().filter(|e| {
        *e.network == *network && e.health == Health::Healthy && *e.service_port_name == *port_name
    });
    usable
        .map(|e| {
            let workload = g.mesh.workloads.at(network, e.address);
            let captured = workload.is_some_and(|w| w.captured);
            (SocketAddr::new(e.address, e.port), e.weight, captured)
        })
        .collect()
}

/// Where an east-west gateway forwards a service's inner tunnels: its waypoint's pods when it has
/// one, else its endpoints; each on 15008, where their HBONE is taken.
fn east_west_targets(
    g: &Generation<'_>,
    served: &Served,
    service: &Service,
    port: u16,
) -> Vec<(SocketAddr, u32, bool)> {
    let on_hbone = |targets: Vec<(SocketAddr, u32, bool)>| {
        let mut addresses: Vec<(IpAddr, u32)> =
            targets.into_iter().map(|(a, w, _)| (a.ip(), w)).collect();
        addresses.sort();
        addresses.dedup_by_key(|(ip, _)| *ip);
        let on = addresses.into_iter();
        on.map(|(ip, w)| (SocketAddr::new(ip, HBONE_PORT), w, true))
            .collect()
    };
    let Some(waypoint) = g.mesh.service_waypoint(service) else {
        return on_hbone(targets(g, &served.network, service, port));
    };
    let Some(own) = g.mesh.services.get(&waypoint.host) else {
        return Vec::new();
    };
    on_hbone(targets(g, &served.network, own, HBONE_PORT))
}

/// An endpoint reached through an internal listener, which is given its address.
fn internal(listener: &str, address: SocketAddr, tunnel: bool) -> LbEndpoint {
    let target = address.to_string();
    let mut filter_metadata = std::collections::HashMap::from([(
        ORIGINAL_DST.to_string(),
        strings(&[("local", &target)]),
    )]);
    if tunnel {
        filter_metadata.insert(SOCKET_MATCH.into(), strings(&[TUNNEL]));
    }
    LbEndpoint {
        host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
            address: Some(internal_address(listener, target)),
            ..Default::default()
        })),
        metadata: Some(Metadata {
            filter_metadata,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Passes an endpoint's original-destination metadata to the internal listener it reaches.
fn internal_upstream() -> TransportSocket {
    let config = InternalUpstreamTransport {
        passthrough_metadata: vec![MetadataValueSource {
            kind: Some(MetadataKind {
                kind: Some(metadata_kind::Kind::Host(metadata_kind::Host {})),
            }),
            name: ORIGINAL_DST.into(),
        }],
        transport_socket: Some(plaintext()),
    };
    TransportSocket {
        name: "envoy.transport_sockets.internal_upstream".into(),
        config_type: Some(transport_socket::ConfigType::TypedConfig(pack_any(config))),
    }
}
