//! Clusters of the mesh's services for any proxy: one per visible service port
//! (`outbound|<port>||<hostname>`) and one per subset of the DestinationRule that applies
//! (`outbound|<port>|<subset>|<hostname>`), with the rule's traffic policy and TLS; by SNI for
//! east-west gateways; Istio's fixed clusters; and the static clusters to a local workload.

use std::collections::BTreeMap;
use std::sync::Arc;

use envoy_types::pb::envoy::config::cluster::v3::cluster::{
    common_lb_config::LocalityConfigSpecifier, ClusterDiscoveryType, DiscoveryType,
    DnsLookupFamily, EdsClusterConfig, LbPolicy,
};
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::config::core::v3::{
    address, socket_address, Address, BindConfig, Locality as EnvoyLocality, Pipe, SocketAddress,
};
use envoy_types::pb::envoy::config::endpoint::v3::{
    lb_endpoint, ClusterLoadAssignment, LbEndpoint, LocalityLbEndpoints,
};
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, UInt32Value, Value};

use super::common::{ads_awaited, seconds, socket};
use super::gateway_tls;
use super::generation::{Generation, ProxyKind, Target};
use super::locality;
use super::names::{
    outbound_sni, parse_outbound, parse_sni_cluster, subset_cluster, BLACKHOLE,
    INBOUND_PASSTHROUGH, PASSTHROUGH,
};
use super::policy::{self, Effective};
use super::stat_names;
use super::tls;
use super::traits::{Trait, Traits};
use crate::istio::destination_rule::TlsMode as ClientTlsMode;
use crate::istio::security::peer::MtlsMode;
use crate::model::{Locality, Protocol, Resolution, Service, TlsMode};
use crate::xds::protocol::ResourceType;
use crate::xds::proxy::Generator;
use crate::xds::wire::{Resource, SharedList};

const CONNECT_TIMEOUT_SECS: i64 = 10;

/// Which clusters of the mesh's services a proxy lists: the mesh SNI ones (an east-west gateway
/// passes mesh mTLS through by SNI) and the `outbound|…` ones (it routes to services itself).
pub(super) struct ClusterNeeds {
    pub(super) sni: bool,
    pub(super) outbound: bool,
    /// Istio's fixed clusters (black hole, passthrough) a sidecar's listeners name.
    pub(super) fixed: bool,
}

/// The clusters every proxy with the same needs (and, once rules or export limits exist,
/// namespace) shares: one per visible service port and subset, by `outbound|…` name or by SNI,
/// and the fixed ones. Assembled once per snapshot version.
pub(super) fn list(g: &Generation<'_>, needs: &ClusterNeeds) -> Arc<SharedList> {
    // Its clusters name their services' identities, and headless services' clusters originate
    // mTLS as their pods' sidecars allow: both stamp it.
    let stamp = [
        g.services_version(),
        g.mesh.endpoints.identities_version(),
        g.mesh.pods_version,
        g.config_version(),
    ];
    let needs_key = [needs.sni, needs.outbound, needs.fixed];
    g.cached_list(
        ResourceType::Cluster,
        (LIST_READS, &needs_key),
        stamp,
        || {
            let mut names = Vec::new();
            for service in g.routable_services() {
                if needs.outbound {
                    names.extend(names_of(g, &service, false));
                }
                if needs.sni {
                    names.extend(sni_names(g, &service));
                }
            }
            if needs.fixed {
                names.extend([BLACKHOLE, PASSTHROUGH, INBOUND_PASSTHROUGH].map(String::from));
            }
            names.iter().filter_map(|n| build(g, n)).collect()
        },
    )
}

/// What a service's cluster reads of the proxy (beyond the rule that applies, which keys it):
/// which generator reads it, whether it is a router (a rule's credentialName) or Istio's proxy
/// (metadata exchange).
const CLUSTER_READS: Traits = Traits::of(&[Trait::Kind, Trait::Telemetry]);

/// What the fixed clusters read: the proxy's kind and IP families (the inbound passthrough's
/// source address).
const FIXED_READS: Traits = Traits::of(&[Trait::Kind, Trait::Telemetry, Trait::Families]);

/// What a list of clusters reads: the services the proxy sees and the rules that apply to them,
/// and what each cluster reads.
const LIST_READS: Traits = Traits::of(&[Trait::Scope, Trait::Rules])
    .with(CLUSTER_READS)
    .with(FIXED_READS);

/// An east-west gateway's clusters of a service, by SNI: as istiod's
/// `buildOutboundSniDnatClusters` (pilot/pkg/networking/core/cluster.go), none for a mesh-external
/// service and none for UDP ports, whatever the service's resolution.
pub(super) fn sni_names(g: &Generation<'_>, service: &Service) -> Vec<String> {
    match service.mesh_external {
        true => Vec::new(),
        false => names_of(g, service, true),
    }
}

/// A service's clusters for this proxy: one per port and subset of the rule that applies, named
/// `outbound|…` or, for an east-west gateway, by SNI (no UDP port).
fn names_of(g: &Generation<'_>, service: &Service, sni: bool) -> Vec<String> {
    let subsets: Vec<String> = g
        .destination_rule(service)
        .map(|r| r.rule.subsets.iter().map(|s| s.name.clone()).collect())
        .unwrap_or_default();
    let host = &service.hostname;
    let name = |port: u16, subset: &str| match sni {
        true => outbound_sni(port, subset, host),
        false => subset_cluster(port, subset, host),
    };
    service
        .ports
        .iter()
        .filter(|p| g.sees(service, p.port))
        .filter(|p| !sni || p.protocol != Protocol::Udp)
        .flat_map(|p| {
            std::iter::once("")
                .chain(subsets.iter().map(String::as_str))
                .map(move |s| (p.port, s))
        })
        .map(|(port, subset)| name(port, subset))
        .collect()
}

/// A cluster of the mesh's services (by `outbound|…` name or SNI) or a fixed one, by name.
pub(super) fn build(g: &Generation<'_>, name: &str) -> Option<Arc<Resource>> {
    if let Some(parsed) = parse_outbound(name) {
        let target = g.target(&parsed)?;
        let keys = target.rule.as_ref().map(|r| r.keys.clone());
        // mTLS settings name the destination's identities, which live with its endpoints.
        let shards = g.mesh.endpoints.get(&target.service.key()).cloned();
        let stamp = [
            g.services_version(),
            shards.as_ref().map_or(0, |s| s.version),
            0,
            g.config_version(),
        ];
        return g.cached(
            ResourceType::Cluster,
            name,
            (CLUSTER_READS, &keys),
            stamp,
            || {
                let sans: Vec<String> = shards
                    .iter()
                    .flat_map(|s| s.service_accounts.iter().map(|sa| sa.to_string()))
                    .chain(target.service.subject_alt_names.iter().cloned())
                    .collect();
                Some(Resource::encode(name, &outbound(g, name, &target, &sans)))
            },
        );
    }
    if let Some(parsed) = parse_sni_cluster(name) {
        let target = g.target(&parsed)?;
        let udp = target.service.port(target.port)?.protocol == Protocol::Udp;
        if target.service.mesh_external || udp {
            return None;
        }
        let keys = target.rule.as_ref().map(|r| r.keys.clone());
        // Built from the service and the rule alone: nothing of the proxy.
        return g.cached(
            ResourceType::Cluster,
            name,
            (Traits::NONE, &keys),
            [g.services_version(), 0, 0, g.config_version()],
            || Some(Resource::encode(name, &sni_cluster(g, name, &target))),
        );
    }
    if ![BLACKHOLE, PASSTHROUGH, INBOUND_PASSTHROUGH].contains(&name) {
        return None;
    }
    g.cached(
        ResourceType::Cluster,
        name,
        (FIXED_READS, &()),
        // The mesh's keepalive applies to them too.
        [g.services_version(), 0, 0, g.config_version()],
        || Some(Resource::encode(name, &fixed(g, name)?)),
    )
}

/// Istio's fixed clusters: the black hole, and the passthroughs out and in.
fn fixed(g: &Generation<'_>, name: &str) -> Option<Cluster> {
    let mut cluster = match name {
        // No endpoints at all (istiod's `buildBlackHoleCluster`).
        BLACKHOLE => Cluster {
            load_assignment: None,
            ..static_cluster(name)
        },
        PASSTHROUGH => passthrough(name),
        INBOUND_PASSTHROUGH => Cluster {
            upstream_bind_config: Some(inbound_bind(g.ipv6_only())),
            ..passthrough(name)
        },
        _ => return None,
    };
    if name != BLACKHOLE {
        policy::apply_keepalive(&mut cluster, g.mesh_config().tcp_keepalive.as_ref(), None);
    }
    // As istiod: the passthrough to other destinations exchanges metadata, the inbound one not.
    let exchange = g.istio_stats().filter(|_| name == PASSTHROUGH);
    if let Some(stats) = exchange {
        cluster.filters.push(stats.cluster_filter());
    }
    Some(cluster)
}

/// To destinations no service claims, as the downstream spoke to them, without limits.
fn passthrough(name: &str) -> Cluster {
    Cluster {
        circuit_breakers: Some(policy::unlimited_circuit_breakers()),
        typed_extension_protocol_options: policy::downstream_protocol(),
        ..original_dst(name)
    }
}

/// Where the proxy's connections to its own workload come from: 127.0.0.6 (`::6`), which Istio's
/// iptables rules let through to the workload rather than back to the proxy (a connection from
/// the proxy to the pod's own address would otherwise be captured again).
pub(super) fn inbound_bind(v6: bool) -> BindConfig {
    BindConfig {
        source_address: Some(SocketAddress {
            address: if v6 { "::6" } else { "127.0.0.6" }.to_string(),
            port_specifier: Some(socket_address::PortSpecifier::PortValue(0)),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// To the workload at the address and port the connection was for (its pod address, as the
/// workload listens on it), from [`inbound_bind`]: istiod's inbound cluster for the default
/// inbound traffic policy (`PASSTHROUGH`), whose original destinations it never cleans up.
pub(super) fn to_workload(name: &str, v6: bool) -> Cluster {
    Cluster {
        upstream_bind_config: Some(inbound_bind(v6)),
        cleanup_interval: Some(seconds(NEVER_CLEANED_SECS)),
        circuit_breakers: Some(policy::unlimited_circuit_breakers()),
        ..original_dst(name)
    }
}

/// The longest interval Envoy takes (istiod's `maxSecondsValue`).
const NEVER_CLEANED_SECS: i64 = 9_223_372_035;

/// An outbound cluster: its discovery by resolution, the rule's policy, then TLS.
fn outbound(g: &Generation<'_>, name: &str, target: &Target, sans: &[String]) -> Cluster {
    let service = &target.service;
    let (mut cluster, effective) = service_cluster(g, name, target, false);
    let http2 = speaks_http2(service, target.port);
    // Sidecars and waypoints sniff a port without a protocol, so its upstream speaks as the
    // client did; routers do not sniff (istiod's `setUpstreamProtocol`).
    let sniffing = matches!(g.kind(), Some(ProxyKind::Sidecar | ProxyKind::Waypoint));
    let auto = service
        .port(target.port)
        .is_some_and(|p| p.protocol == Protocol::Unsupported);
    if sniffing && auto && cluster.typed_extension_protocol_options.is_empty() {
        cluster.typed_extension_protocol_options = policy::sniffed_protocol();
    }
    let subset = target.subset.as_ref().map_or("", |s| s.name.as_str());
    let pattern = &g.mesh_config().outbound_cluster_stat_name;
    if let Some(stat) = stat_names::of(pattern, service, subset, target.port, 0) {
        cluster.alt_stat_name = stat_names::delimited(stat);
    }
    // Proxyless gRPC balances round robin (or by a rule's hash); it refuses Envoy's default.
    if g.generator() == Generator::Grpc && cluster.lb_policy == LbPolicy::LeastRequest as i32 {
        cluster.lb_policy = LbPolicy::RoundRobin as i32;
    }
    // Only Istio's stats read these: plain proxies are not sent the bytes.
    if let Some(stats) = g.istio_stats() {
        cluster.metadata = Some(telemetry_metadata(service));
        cluster.filters.push(stats.cluster_filter());
    }
    if g.generator() == Generator::Envoy {
        let tls_defaults = &g.mesh_config().tls_defaults;
        let sni = outbound_sni(target.port, subset, &service.hostname);
        match &effective.tls {
            Some(t) if t.mode == ClientTlsMode::Disable => {}
            Some(t) if t.mode == ClientTlsMode::IstioMutual => {
                let sans = match t.subject_alt_names.is_empty() {
                    true => sans.to_vec(),
                    false => t.subject_alt_names.clone(),
                };
                cluster.transport_socket = Some(tls::upstream_istio(
                    if t.sni.is_empty() { sni } else { t.sni.clone() },
                    &sans,
                    http2,
                ));
            }
            // As istiod (pilot/pkg/networking/core/cluster_tls.go): a Secret named by a rule
            // originates TLS at gateways, which read it over SDS; sidecars, which may not read
            // it, get no TLS from it.
            Some(t) if !t.credential_name.is_empty() && g.is_router() => {
                cluster.transport_socket = Some(gateway_tls::origination_socket(
                    t,
                    &service.hostname,
                    tls_defaults,
                ));
            }
            Some(t) if !t.credential_name.is_empty() => {}
            Some(t) => {
                cluster.transport_socket =
                    Some(tls::upstream_files(t, &service.hostname, tls_defaults));
            }
            None => match auto_mtls(g, service, target.port) {
                AutoMtls::Istio => {
                    cluster.transport_socket = Some(tls::upstream_istio(sni, sans, http2));
                }
                AutoMtls::ByEndpoint => {
                    cluster.transport_socket_matches = tls::upstream_matches(sni, sans, http2);
                }
                AutoMtls::Off => {}
            },
        }
    }
    cluster
}

/// What an outbound cluster and an east-west gateway's SNI cluster share (istiod's `buildCluster`
/// and `applyTrafficPolicy`, pilot/pkg/networking/core/cluster_builder.go and
/// cluster_traffic_policy.go): discovery by the service's resolution (`eds_passthrough`: a
/// service without a resolution by EDS, as istiod's `convertResolution` does for routers), the
/// mesh's connect timeout, the rule's load balancer, connection pool and outlier detection,
/// locality weighting and HTTP/2 toward HTTP/2 and gRPC ports. Its TLS is the caller's.
fn service_cluster(
    g: &Generation<'_>,
    name: &str,
    target: &Target,
    eds_passthrough: bool,
) -> (Cluster, Effective) {
    let service = &target.service;
    let mesh = g.mesh_config();
    let mut cluster = Cluster {
        name: name.to_string(),
        connect_timeout: Some(mesh.connect_timeout.to_proto()),
        ..Default::default()
    };
    let resolution = match service.resolution {
        Resolution::Passthrough if eds_passthrough => Resolution::ClientSideLb,
        resolution => resolution,
    };
    match resolution {
        Resolution::ClientSideLb => {
            cluster.cluster_discovery_type =
                Some(ClusterDiscoveryType::Type(DiscoveryType::Eds as i32));
            cluster.eds_cluster_config = Some(EdsClusterConfig {
                eds_config: Some(ads_awaited()),
                service_name: name.to_string(),
            });
        }
        Resolution::Passthrough => {
            cluster.cluster_discovery_type = Some(ClusterDiscoveryType::Type(
                DiscoveryType::OriginalDst as i32,
            ));
            cluster.lb_policy = LbPolicy::ClusterProvided as i32;
        }
        Resolution::Dns { round_robin } => {
            let kind = match round_robin {
                true => DiscoveryType::LogicalDns,
                false => DiscoveryType::StrictDns,
            };
            cluster.cluster_discovery_type = Some(ClusterDiscoveryType::Type(kind as i32));
            cluster.dns_lookup_family = DnsLookupFamily::V4Only as i32;
            // As istiod: the mesh's refresh rate, bounded by the records' own TTL (fields Envoy
            // deprecated for its DNS cluster extension, which istiod does not use either).
            #[allow(deprecated)]
            {
                cluster.dns_refresh_rate = Some(mesh.dns_refresh_rate.to_proto());
                cluster.respect_dns_ttl = true;
            }
            cluster.load_assignment = Some(dns_assignment(name, service, target.port));
        }
    }
    let http = service
        .port(target.port)
        .is_some_and(|p| p.protocol.is_http());
    let http2 = speaks_http2(service, target.port);
    let effective = match &target.rule {
        Some(rule) => Effective::of(
            &rule.rule,
            target.subset.as_ref().map(|s| s.name.as_str()),
            target.port,
        ),
        None => Effective::default(),
    };
    policy::apply(&mut cluster, &effective, g.mesh_policy(), http, http2);
    let locality = locality::setting(
        effective.load_balancer.as_ref(),
        mesh.locality_lb_setting.as_ref(),
    );
    if locality::weights_localities(locality, effective.outlier_detection.is_some()) {
        let common = cluster
            .common_lb_config
            .get_or_insert_with(Default::default);
        common.locality_config_specifier = Some(LocalityConfigSpecifier::LocalityWeightedLbConfig(
            Default::default(),
        ));
    }
    if cluster.typed_extension_protocol_options.is_empty() && http2 {
        cluster.typed_extension_protocol_options = policy::http2_only();
    }
    (cluster, effective)
}

/// Whether the service's port is HTTP/2 (HTTP2 or gRPC): its clusters speak it upstream.
fn speaks_http2(service: &Service, port: u16) -> bool {
    service
        .port(port)
        .is_some_and(|p| p.protocol.is_http() && p.protocol != Protocol::Http)
}

/// What Istio's stats read of the destination (istiod's `addTelemetryMetadata`, which sets it for
/// every proxy): the service's host, name and namespace under `istio.services`.
fn telemetry_metadata(service: &Service) -> Metadata {
    let text = |s: &str| Value {
        kind: Some(Kind::StringValue(s.to_string())),
    };
    let entry = Struct {
        fields: [
            ("host".to_string(), text(&service.hostname)),
            ("name".to_string(), text(&service.name)),
            ("namespace".to_string(), text(&service.namespace)),
        ]
        .into(),
    };
    let services = Value {
        kind: Some(Kind::ListValue(ListValue {
            values: vec![Value {
                kind: Some(Kind::StructValue(entry)),
            }],
        })),
    };
    let istio = Struct {
        fields: [("services".to_string(), services)].into(),
    };
    Metadata {
        filter_metadata: [("istio".to_string(), istio)].into(),
        ..Default::default()
    }
}

/// What auto mTLS gives a cluster without a TLS setting of its rule.
enum AutoMtls {
    /// Istio's mTLS to every endpoint: a cluster to the original destination, whose pods all
    /// have sidecars.
    Istio,
    /// mTLS to endpoints labelled `tlsMode: istio`, plaintext to others (their assignment says).
    ByEndpoint,
    Off,
}

/// Auto mTLS as istiod infers it for a service (pilot/pkg/model/push_context.go
/// `BestEffortInferServiceMTLSMode`, pilot/pkg/networking/core/cluster_tls.go
/// `buildAutoMtlsSettings`): off for mesh-external services and when the mesh turns it off; off
/// when the service's namespace-wide PeerAuthentication (else the mesh-wide one) is DISABLE, as
/// workload and port-level policies are not consulted; a cluster to the original destination
/// originates it only when every endpoint on the port carries Istio's sidecar label.
fn auto_mtls(g: &Generation<'_>, service: &Service, port: u16) -> AutoMtls {
    if !g.mesh_config().enable_auto_mtls || service.mesh_external {
        return AutoMtls::Off;
    }
    let security = g.mesh.config.security();
    if security.service_mtls(&service.namespace) == MtlsMode::Disable {
        return AutoMtls::Off;
    }
    if service.resolution != Resolution::Passthrough {
        return AutoMtls::ByEndpoint;
    }
    let port_name = service
        .port(port)
        .map(|p| p.name.as_str())
        .unwrap_or_default();
    let shards = g.mesh.endpoints.get(&service.key());
    let mut on_port = (shards.iter().flat_map(|s| s.endpoints()))
        .filter(|ep| *ep.service_port_name == *port_name)
        .peekable();
    let sidecars = on_port.peek().is_some() && on_port.all(|ep| ep.tls_mode == TlsMode::Istio);
    match sidecars {
        true => AutoMtls::Istio,
        false => AutoMtls::Off,
    }
}

/// The addresses a DNS cluster resolves: each target (the service's hosts, or a ServiceEntry's
/// endpoints) on the port its workloads listen on.
fn dns_assignment(name: &str, service: &Service, port: u16) -> ClusterLoadAssignment {
    let service_port = service.port(port);
    let port_name = service_port.map(|p| p.name.as_str()).unwrap_or_default();
    let default_port = service_port.and_then(|p| p.target_port).unwrap_or(port);
    let mut by_locality: BTreeMap<Locality, Vec<LbEndpoint>> = BTreeMap::new();
    for target in &service.dns_targets {
        let target_port = target.ports.get(port_name).copied().unwrap_or(default_port);
        let locality = target
            .locality
            .as_deref()
            .map(Locality::parse)
            .unwrap_or_default();
        by_locality.entry(locality).or_default().push(LbEndpoint {
            host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(
                envoy_types::pb::envoy::config::endpoint::v3::Endpoint {
                    address: Some(socket(&target.host, target_port)),
                    ..Default::default()
                },
            )),
            load_balancing_weight: Some(UInt32Value {
                value: target.weight.max(1),
            }),
            ..Default::default()
        });
    }
    ClusterLoadAssignment {
        cluster_name: name.to_string(),
        endpoints: by_locality
            .into_iter()
            .map(|(locality, lb_endpoints)| LocalityLbEndpoints {
                locality: Some(EnvoyLocality {
                    region: locality.region.to_string(),
                    zone: locality.zone.to_string(),
                    sub_zone: locality.subzone.to_string(),
                }),
                lb_endpoints,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

/// An east-west gateway's cluster for one SNI: built as an outbound cluster, the rule's policy
/// but its TLS applied (istiod's `SniDnatClusterMode`), plain TCP: the TLS inside is passed
/// through. A service without a resolution is reached by EDS, as on any router.
fn sni_cluster(g: &Generation<'_>, name: &str, target: &Target) -> Cluster {
    service_cluster(g, name, target, true).0
}

/// A STATIC cluster without endpoints (the black hole, or one given its address after).
pub(super) fn static_cluster(name: &str) -> Cluster {
    Cluster {
        name: name.to_string(),
        cluster_discovery_type: Some(ClusterDiscoveryType::Type(DiscoveryType::Static as i32)),
        connect_timeout: Some(seconds(CONNECT_TIMEOUT_SECS)),
        load_assignment: Some(ClusterLoadAssignment {
            cluster_name: name.to_string(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// To the destination the connection was restored to.
pub(super) fn original_dst(name: &str) -> Cluster {
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

/// A Unix domain socket's address.
pub(super) fn pipe(path: &str) -> Address {
    Address {
        address: Some(address::Address::Pipe(Pipe {
            path: path.to_string(),
            mode: 0,
        })),
    }
}

pub(super) fn assignment_at(name: &str, address: Address) -> ClusterLoadAssignment {
    let endpoint = LbEndpoint {
        host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(
            envoy_types::pb::envoy::config::endpoint::v3::Endpoint {
                address: Some(address),
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
