//! CDS: one cluster per service port (`outbound|<port>||<hostname>`), plus Istio's fixed clusters and,
//! for a sidecar, one `inbound|<port>||` cluster per port of its own workload.

use std::collections::HashMap;
use std::sync::Arc;

use envoy_types::pb::envoy::config::cluster::v3::cluster::{
    ClusterDiscoveryType, DiscoveryType, DnsLookupFamily, EdsClusterConfig, LbPolicy,
};
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::core::v3::Http2ProtocolOptions;
use envoy_types::pb::envoy::config::endpoint::v3::{
    lb_endpoint, ClusterLoadAssignment, LbEndpoint, LocalityLbEndpoints,
};
use envoy_types::pb::envoy::extensions::upstreams::http::v3::http_protocol_options::{
    explicit_http_config::ProtocolConfig, ExplicitHttpConfig, UpstreamProtocolOptions,
};
use envoy_types::pb::envoy::extensions::upstreams::http::v3::HttpProtocolOptions;
use envoy_types::util::pack_any;

use super::{
    ads, outbound_cluster, outbound_target, parse_sni_cluster, seconds, socket, tls, Generation,
};
use crate::model::{Resolution, Service};
use crate::xds::protocol::ResourceType;
use crate::xds::proxy::Generator;
use crate::xds::wire::Resource;

pub const BLACKHOLE: &str = "BlackHoleCluster";
pub const PASSTHROUGH: &str = "PassthroughCluster";
pub const INBOUND_PASSTHROUGH: &str = "InboundPassthroughCluster";

const CONNECT_TIMEOUT_SECS: i64 = 10;

/// The clusters every proxy of this kind shares: one per service port (for an east-west gateway, one
/// per SNI), plus Istio's fixed clusters for sidecars. Assembled once per model version.
pub fn shared(g: &Generation<'_>) -> Arc<[Arc<Resource>]> {
    let kind = [g.is_east_west_gateway(), g.is_sidecar()];
    let stamp = [
        g.services_version(),
        g.mesh.endpoints.identities_version(),
        0,
    ];
    g.cache
        .list(ResourceType::Cluster, g.variant_of(&kind), stamp, || {
            let names: Vec<String> = if g.is_east_west_gateway() {
                g.routable_services()
                    .iter()
                    .filter(|s| s.resolution == Resolution::ClientSideLb)
                    .flat_map(|s| {
                        s.ports
                            .iter()
                            .map(|p| tls::outbound_sni(p.port, &s.hostname))
                    })
                    .collect()
            } else {
                let mut names: Vec<String> = g
                    .routable_services()
                    .iter()
                    .flat_map(|s| {
                        s.ports
                            .iter()
                            .map(|p| outbound_cluster(p.port, &s.hostname))
                    })
                    .collect();
                if g.is_sidecar() {
                    names.extend([BLACKHOLE, PASSTHROUGH, INBOUND_PASSTHROUGH].map(String::from));
                }
                names
            };
            g.build_all(ResourceType::Cluster, names)
        })
}

/// The proxy's own clusters: one `inbound|<port>||` per port of its workload.
pub fn own_names(g: &Generation<'_>) -> Vec<String> {
    if !g.is_sidecar() {
        return Vec::new();
    }
    g.inbound_ports()
        .iter()
        .map(|(port, _)| inbound_cluster(*port))
        .collect()
}

pub fn inbound_cluster(port: u16) -> String {
    format!("inbound|{port}||")
}

pub fn build(g: &Generation<'_>, name: &str) -> Option<Arc<Resource>> {
    if let Some((service, port)) = outbound_target(g, name) {
        let variant = g.variant(&[]);
        // mTLS settings name the destination's identities, which live with its endpoints.
        let shards = g.mesh.endpoints.get(&service.key()).cloned();
        let stamp = [
            g.services_version(),
            shards.as_ref().map_or(0, |s| s.version),
            0,
        ];
        return g
            .cache
            .get_or_build(ResourceType::Cluster, name, variant, stamp, || {
                let mut cluster = outbound(name, &service, port);
                if g.proxy.generator == Generator::Envoy
                    && service.resolution == Resolution::ClientSideLb
                {
                    let sans: Vec<String> = shards
                        .iter()
                        .flat_map(|s| s.service_accounts.iter().map(|sa| sa.to_string()))
                        .collect();
                    let sni = tls::outbound_sni(port, &service.hostname);
                    cluster.transport_socket_matches = tls::upstream_matches(sni, &sans);
                }
                Some(Resource::encode(name, &cluster))
            });
    }
    if let Some((port, host)) = parse_sni_cluster(name) {
        g.service(host)?.port(port)?;
        return g.cache.get_or_build(
            ResourceType::Cluster,
            name,
            0,
            [g.services_version(), 0, 0],
            || Some(Resource::encode(name, &sni_cluster(name))),
        );
    }
    let fixed = match name {
        BLACKHOLE => Some(static_cluster(name, None)),
        PASSTHROUGH | INBOUND_PASSTHROUGH => Some(original_dst(name)),
        _ => None,
    };
    if let Some(cluster) = fixed {
        return g.cache.get_or_build(
            ResourceType::Cluster,
            name,
            0,
            [g.services_version(), 0, 0],
            || Some(Resource::encode(name, &cluster)),
        );
    }
    let port: u16 = name
        .strip_prefix("inbound|")?
        .strip_suffix("||")?
        .parse()
        .ok()?;
    let (_, protocol) = g.inbound_ports().into_iter().find(|(p, _)| *p == port)?;
    let mut cluster = static_cluster(name, Some(port));
    if protocol.is_http() && protocol != crate::model::Protocol::Http {
        cluster.typed_extension_protocol_options = http2_options();
    }
    Some(Arc::new(Resource::encode(name, &cluster)))
}

fn outbound(name: &str, service: &Service, port: u16) -> Cluster {
    let mut cluster = Cluster {
        name: name.to_string(),
        connect_timeout: Some(seconds(CONNECT_TIMEOUT_SECS)),
        ..Default::default()
    };
    match service.resolution {
        Resolution::ClientSideLb => {
            cluster.cluster_discovery_type =
                Some(ClusterDiscoveryType::Type(DiscoveryType::Eds as i32));
            cluster.eds_cluster_config = Some(EdsClusterConfig {
                eds_config: Some(ads()),
                service_name: name.to_string(),
            });
            cluster.lb_policy = LbPolicy::RoundRobin as i32;
        }
        Resolution::Passthrough => {
            cluster.cluster_discovery_type = Some(ClusterDiscoveryType::Type(
                DiscoveryType::OriginalDst as i32,
            ));
            cluster.lb_policy = LbPolicy::ClusterProvided as i32;
        }
        Resolution::DnsAlias => {
            let target = service.external_name.clone().unwrap_or_default();
            cluster.cluster_discovery_type =
                Some(ClusterDiscoveryType::Type(DiscoveryType::StrictDns as i32));
            cluster.dns_lookup_family = DnsLookupFamily::V4Only as i32;
            cluster.load_assignment = Some(assignment(name, &target, port));
        }
    }
    let protocol = service.port(port).map(|p| p.protocol);
    if protocol.is_some_and(|p| p.is_http() && p != crate::model::Protocol::Http) {
        cluster.typed_extension_protocol_options = http2_options();
    }
    cluster
}

/// An east-west gateway's cluster for one SNI: EDS, plain TCP — the TLS inside is passed through.
fn sni_cluster(name: &str) -> Cluster {
    Cluster {
        name: name.to_string(),
        cluster_discovery_type: Some(ClusterDiscoveryType::Type(DiscoveryType::Eds as i32)),
        eds_cluster_config: Some(EdsClusterConfig {
            eds_config: Some(ads()),
            service_name: name.to_string(),
        }),
        connect_timeout: Some(seconds(CONNECT_TIMEOUT_SECS)),
        ..Default::default()
    }
}

/// A STATIC cluster to the local workload (or with no endpoints: the black hole).
fn static_cluster(name: &str, local_port: Option<u16>) -> Cluster {
    Cluster {
        name: name.to_string(),
        cluster_discovery_type: Some(ClusterDiscoveryType::Type(DiscoveryType::Static as i32)),
        connect_timeout: Some(seconds(CONNECT_TIMEOUT_SECS)),
        load_assignment: Some(match local_port {
            Some(port) => assignment(name, "127.0.0.1", port),
            None => ClusterLoadAssignment {
                cluster_name: name.to_string(),
                ..Default::default()
            },
        }),
        ..Default::default()
    }
}

fn original_dst(name: &str) -> Cluster {
    Cluster {
        name: name.to_string(),
        cluster_discovery_type: Some(ClusterDiscoveryType::Type(
            DiscoveryType::OriginalDst as i32,
        )),
        lb_policy: LbPolicy::ClusterProvided as i32,
        connect_timeout: Some(seconds(CONNECT_TIMEOUT_SECS)),
        ..Default::default()
    }
}

fn assignment(name: &str, host: &str, port: u16) -> ClusterLoadAssignment {
    let endpoint = LbEndpoint {
        host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(
            envoy_types::pb::envoy::config::endpoint::v3::Endpoint {
                address: Some(socket(host, port)),
                ..Default::default()
            },
        )),
        ..Default::default()
    };
    ClusterLoadAssignment {
        cluster_name: name.to_string(),
        endpoints: vec![LocalityLbEndpoints {
            lb_endpoints: vec![endpoint],
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// HTTP/2 to the upstream, for gRPC and HTTP/2 ports.
fn http2_options() -> HashMap<String, envoy_types::pb::google::protobuf::Any> {
    let options = HttpProtocolOptions {
        upstream_protocol_options: Some(UpstreamProtocolOptions::ExplicitHttpConfig(
            ExplicitHttpConfig {
                protocol_config: Some(ProtocolConfig::Http2ProtocolOptions(
                    Http2ProtocolOptions::default(),
                )),
            },
        )),
        ..Default::default()
    };
    HashMap::from([(
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions".to_string(),
        pack_any(options),
    )])
}
