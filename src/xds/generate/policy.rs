//! A DestinationRule's traffic policy applied to an Envoy cluster: the effective policy for a
//! (subset, port), and its load balancer, circuit breakers, outlier detection, timeouts and
//! keepalive as Envoy fields.

use std::collections::HashMap;

use envoy_types::pb::envoy::config::cluster::v3::circuit_breakers::Thresholds;
use envoy_types::pb::envoy::config::cluster::v3::cluster::{
    self as cluster, CommonLbConfig, LbPolicy, MaglevLbConfig, RingHashLbConfig,
};
use envoy_types::pb::envoy::config::cluster::v3::{
    CircuitBreakers, Cluster, OutlierDetection as EnvoyOutlier, UpstreamConnectionOptions,
};
use envoy_types::pb::envoy::config::core::v3::{
    Http1ProtocolOptions, Http2ProtocolOptions, HttpProtocolOptions as CommonHttpOptions,
    RoutingPriority, TcpKeepalive,
};
use envoy_types::pb::envoy::extensions::upstreams::http::v3::http_protocol_options::{
    explicit_http_config::ProtocolConfig, ExplicitHttpConfig, UpstreamProtocolOptions,
    UseDownstreamHttpConfig,
};
use envoy_types::pb::envoy::extensions::upstreams::http::v3::HttpProtocolOptions;
use envoy_types::pb::envoy::r#type::v3::Percent;
use envoy_types::pb::google::protobuf::{Any, UInt32Value, UInt64Value};
use envoy_types::util::pack_any;

use crate::istio::destination_rule::{
    ClientTls, ConnectionPool, DestinationRule, H2UpgradePolicy, LoadBalancer, OutlierDetection,
    SimpleLb, TcpKeepalive as KeepaliveSpec, TrafficPolicy,
};
use crate::istio::duration::Duration;

/// The four parts of a traffic policy in force for one cluster.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Effective {
    pub load_balancer: Option<LoadBalancer>,
    pub connection_pool: Option<ConnectionPool>,
    pub outlier_detection: Option<OutlierDetection>,
    pub tls: Option<ClientTls>,
}

impl Effective {
    /// As istiod merges them (pilot/pkg/networking/util/util.go `MergeSubsetTrafficPolicy`,
    /// `GetPortLevelTrafficPolicy`; pilot/pkg/model/destination_rule.go `MergeTrafficPolicy`): a
    /// policy's settings for the port replace its four parts whole (a part they leave out is
    /// Envoy's default, not the policy's); a subset's policy then replaces the rule's part by part,
    /// or whole where the subset has settings for the port.
    pub fn of(rule: &DestinationRule, subset: Option<&str>, port: u16) -> Self {
        let (mut effective, _) = Self::for_port(rule.traffic_policy.as_ref(), port);
        let subset = subset.and_then(|n| rule.subsets.iter().find(|s| s.name == n));
        if let Some(policy) = subset.and_then(|s| s.traffic_policy.as_ref()) {
            let (own, whole) = Self::for_port(Some(policy), port);
            match whole {
                true => effective = own,
                false => effective.replace_set(own),
            }
        }
        effective
    }

    /// A policy's parts for `port`: its settings for the port, whole, where it has some (true).
    fn for_port(policy: Option<&TrafficPolicy>, port: u16) -> (Self, bool) {
        let Some(policy) = policy else {
            return (Self::default(), false);
        };
        let port_level = policy
            .port_level_settings
            .iter()
            .find(|p| p.port.as_ref().map(|p| p.number) == Some(u32::from(port)));
        match port_level {
            Some(p) => (
                Self {
                    load_balancer: p.load_balancer.clone(),
                    connection_pool: p.connection_pool.clone(),
                    outlier_detection: p.outlier_detection.clone(),
                    tls: p.tls.clone(),
                },
                true,
            ),
            None => (
                Self {
                    load_balancer: policy.load_balancer.clone(),
                    connection_pool: policy.connection_pool.clone(),
                    outlier_detection: policy.outlier_detection.clone(),
                    tls: policy.tls.clone(),
                },
                false,
            ),
        }
    }

    /// Replaces the parts `other` sets.
    fn replace_set(&mut self, other: Self) {
        if other.load_balancer.is_some() {
            self.load_balancer = other.load_balancer;
        }
        if other.connection_pool.is_some() {
            self.connection_pool = other.connection_pool;
        }
        if other.outlier_detection.is_some() {
            self.outlier_detection = other.outlier_detection;
        }
        if other.tls.is_some() {
            self.tls = other.tls;
        }
    }
}

/// Circuit breakers as istiod sets them on every cluster: effectively unlimited unless the policy
/// says otherwise (Envoy's own defaults, 1024, throttle busy meshes).
const UNLIMITED: u32 = u32::MAX;

/// What the mesh config sets on every cluster a traffic policy shapes.
#[derive(Clone, Copy, Debug, Default)]
pub struct MeshPolicy<'a> {
    /// `tcpKeepalive`: each field a rule's own keepalive leaves unset.
    pub tcp_keepalive: Option<&'a KeepaliveSpec>,
    /// `h2UpgradePolicy: UPGRADE`: HTTP ports upgrade unless a rule says otherwise.
    pub h2_upgrade: bool,
}

/// Applies the load balancer, connection pool and outlier detection of `policy` to `cluster`,
/// over the mesh's defaults. `http` tells whether the port carries HTTP (protocol options apply),
/// `http2` whether upstream speaks HTTP/2 already. A cluster to the original destination keeps
/// its load balancer.
pub fn apply(
    cluster: &mut Cluster,
    policy: &Effective,
    mesh: MeshPolicy<'_>,
    http: bool,
    http2: bool,
) {
    if cluster.lb_policy != LbPolicy::ClusterProvided as i32 {
        apply_load_balancer(cluster, policy.load_balancer.as_ref());
    }
    apply_connection_pool(cluster, policy.connection_pool.as_ref(), mesh, http, http2);
    if let Some(outlier) = &policy.outlier_detection {
        apply_outlier(cluster, outlier);
    }
}

/// The load balancer the rule names; LEAST_REQUEST where it names none (istiod's
/// `defaultLBAlgorithm`).
fn apply_load_balancer(cluster: &mut Cluster, lb: Option<&LoadBalancer>) {
    cluster.lb_policy = LbPolicy::LeastRequest as i32;
    let Some(lb) = lb else { return };
    if let Some(simple) = lb.simple {
        cluster.lb_policy = match simple {
            SimpleLb::Random => LbPolicy::Random,
            SimpleLb::RoundRobin => LbPolicy::RoundRobin,
            SimpleLb::Unspecified
            | SimpleLb::LeastConn
            | SimpleLb::LeastRequest
            | SimpleLb::Passthrough => LbPolicy::LeastRequest,
        } as i32;
    }
    if let Some(hash) = &lb.consistent_hash {
        match &hash.maglev {
            Some(maglev) => {
                cluster.lb_policy = LbPolicy::Maglev as i32;
                cluster.lb_config = Some(cluster::LbConfig::MaglevLbConfig(MaglevLbConfig {
                    table_size: maglev.table_size.map(|value| UInt64Value { value }),
                }));
            }
            None => {
                cluster.lb_policy = LbPolicy::RingHash as i32;
                let minimum = hash
                    .ring_hash
                    .as_ref()
                    .and_then(|r| r.minimum_ring_size)
                    .or(hash.minimum_ring_size);
                cluster.lb_config = Some(cluster::LbConfig::RingHashLbConfig(RingHashLbConfig {
                    minimum_ring_size: minimum.map(|value| UInt64Value { value }),
                    ..Default::default()
                }));
            }
        }
    }
}

fn apply_connection_pool(
    cluster: &mut Cluster,
    pool: Option<&ConnectionPool>,
    mesh: MeshPolicy<'_>,
    http: bool,
    http2: bool,
) {
    let tcp = pool.and_then(|p| p.tcp.as_ref());
    let http_settings = pool.and_then(|p| p.http.as_ref());
    cluster.circuit_breakers = Some(circuit_breakers(
        tcp.and_then(|t| t.max_connections),
        http_settings.and_then(|h| h.http1_max_pending_requests),
        http_settings.and_then(|h| h.http2_max_requests),
        http_settings.and_then(|h| h.max_retries),
    ));
    if let Some(timeout) = tcp.and_then(|t| t.connect_timeout) {
        cluster.connect_timeout = Some(timeout.to_proto());
    }
    apply_keepalive(
        cluster,
        mesh.tcp_keepalive,
        tcp.and_then(|t| t.tcp_keepalive.as_ref()),
    );
    let idle_timeout = http_settings
        .and_then(|h| h.idle_timeout)
        .or(tcp.and_then(|t| t.idle_timeout));
    let common = CommonHttpOptions {
        idle_timeout: idle_timeout.map(|d| d.to_proto()),
        max_requests_per_connection: http_settings
            .and_then(|h| h.max_requests_per_connection)
            .filter(|v| *v > 0)
            .map(|v| UInt32Value {
                value: v.unsigned_abs(),
            }),
        max_connection_duration: tcp
            .and_then(|t| t.max_connection_duration)
            .map(|d| d.to_proto()),
        ..Default::default()
    };
    // A rule's own policy first, else the mesh's for HTTP ports (istiod's `shouldH2Upgrade`).
    let upgrade = match http_settings.and_then(|h| h.h2_upgrade_policy) {
        Some(H2UpgradePolicy::Upgrade) => true,
        Some(H2UpgradePolicy::DoNotUpgrade) => false,
        Some(H2UpgradePolicy::Default) | None => mesh.h2_upgrade,
    };
    let use_client = http_settings.and_then(|h| h.use_client_protocol) == Some(true);
    let concurrent = http_settings
        .and_then(|h| h.max_concurrent_streams)
        .filter(|v| *v > 0);
    let h2 = http2 || (http && upgrade);
    let protocol = match (use_client, h2) {
        (true, _) => Some(as_downstream(http2_options(concurrent))),
        (false, true) => Some(UpstreamProtocolOptions::ExplicitHttpConfig(
            ExplicitHttpConfig {
                protocol_config: Some(ProtocolConfig::Http2ProtocolOptions(http2_options(
                    concurrent,
                ))),
            },
        )),
        (false, false) => None,
    };
    let has_common = common != CommonHttpOptions::default();
    if protocol.is_none() && !(http && has_common) {
        return;
    }
    let options = HttpProtocolOptions {
        common_http_protocol_options: (http && has_common).then_some(common),
        upstream_protocol_options: protocol.or_else(|| {
            Some(UpstreamProtocolOptions::ExplicitHttpConfig(
                ExplicitHttpConfig {
                    protocol_config: Some(ProtocolConfig::HttpProtocolOptions(
                        Http1ProtocolOptions::default(),
                    )),
                },
            ))
        }),
        ..Default::default()
    };
    cluster.typed_extension_protocol_options = protocol_options(options);
}

/// TCP keepalive on the cluster's upstream connections: the mesh's `tcpKeepalive`, each field a
/// rule's keepalive sets replacing it (istiod's `applyTCPKeepalive`,
/// pilot/pkg/networking/core/cluster.go); any keepalive at all turns SO_KEEPALIVE on.
pub fn apply_keepalive(
    cluster: &mut Cluster,
    mesh: Option<&KeepaliveSpec>,
    rule: Option<&KeepaliveSpec>,
) {
    if mesh.is_none() && rule.is_none() {
        return;
    }
    let field = |f: &dyn Fn(&KeepaliveSpec) -> Option<u32>| {
        rule.and_then(f)
            .or_else(|| mesh.and_then(f))
            .map(|value| UInt32Value { value })
    };
    let seconds = |d: &Option<Duration>| {
        d.as_ref()
            .map(|d| u32::try_from(d.as_std().as_secs()).unwrap_or(u32::MAX))
    };
    cluster.upstream_connection_options = Some(UpstreamConnectionOptions {
        tcp_keepalive: Some(TcpKeepalive {
            keepalive_probes: field(&|k| k.probes.filter(|p| *p > 0)),
            keepalive_time: field(&|k| seconds(&k.time)),
            keepalive_interval: field(&|k| seconds(&k.interval)),
        }),
        ..Default::default()
    });
}

/// Circuit breakers at these limits, each unlimited where unset (istiod's
/// `getDefaultCircuitBreakerThresholds`).
fn circuit_breakers(
    connections: Option<i32>,
    pending: Option<i32>,
    requests: Option<i32>,
    retries: Option<i32>,
) -> CircuitBreakers {
    let limit = |v: Option<i32>| {
        Some(UInt32Value {
            value: v.filter(|v| *v > 0).map_or(UNLIMITED, |v| v.unsigned_abs()),
        })
    };
    CircuitBreakers {
        thresholds: vec![Thresholds {
            priority: RoutingPriority::Default as i32,
            max_connections: limit(connections),
            max_pending_requests: limit(pending),
            max_requests: limit(requests),
            max_retries: limit(retries),
            track_remaining: true,
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// No limits: the circuit breakers istiod sets on clusters no rule shapes (passthrough, inbound).
pub fn unlimited_circuit_breakers() -> CircuitBreakers {
    circuit_breakers(None, None, None, None)
}

/// The protocol of a passthrough cluster: whatever the downstream spoke (HTTP/2 for gRPC to an
/// unknown destination), idle connections closed after five minutes (istiod's
/// `passthroughHttpProtocolOptions`, pilot/pkg/networking/core/cluster_builder.go).
pub fn downstream_protocol() -> HashMap<String, Any> {
    protocol_options(HttpProtocolOptions {
        common_http_protocol_options: Some(CommonHttpOptions {
            idle_timeout: Some(envoy_types::pb::google::protobuf::Duration {
                seconds: 300,
                nanos: 0,
            }),
            ..Default::default()
        }),
        upstream_protocol_options: Some(as_downstream(Http2ProtocolOptions::default())),
        ..Default::default()
    })
}

/// The protocol of a sidecar's cluster of a port without a declared protocol: whatever the
/// sniffed downstream spoke (istiod's `setUseDownstreamProtocol`, called from
/// `setUpstreamProtocol` for auto-detected ports, pilot/pkg/networking/core/cluster_builder.go).
pub fn sniffed_protocol() -> HashMap<String, Any> {
    protocol_options(HttpProtocolOptions {
        upstream_protocol_options: Some(as_downstream(Http2ProtocolOptions::default())),
        ..Default::default()
    })
}

/// HTTP/1.1 or HTTP/2 upstream, as the downstream spoke.
fn as_downstream(http2: Http2ProtocolOptions) -> UpstreamProtocolOptions {
    UpstreamProtocolOptions::UseDownstreamProtocolConfig(UseDownstreamHttpConfig {
        http_protocol_options: Some(Http1ProtocolOptions::default()),
        http2_protocol_options: Some(http2),
        ..Default::default()
    })
}

fn http2_options(max_concurrent_streams: Option<i32>) -> Http2ProtocolOptions {
    Http2ProtocolOptions {
        max_concurrent_streams: max_concurrent_streams.map(|v| UInt32Value {
            value: v.unsigned_abs(),
        }),
        ..Default::default()
    }
}

/// HTTP/2 to the upstream, for gRPC and HTTP/2 ports without a policy.
pub fn http2_only() -> HashMap<String, Any> {
    protocol_options(HttpProtocolOptions {
        upstream_protocol_options: Some(UpstreamProtocolOptions::ExplicitHttpConfig(
            ExplicitHttpConfig {
                protocol_config: Some(ProtocolConfig::Http2ProtocolOptions(
                    Http2ProtocolOptions::default(),
                )),
            },
        )),
        ..Default::default()
    })
}

/// HTTP/2 with CONNECT to the upstream: HBONE tunnels.
pub fn http2_tunnels() -> HashMap<String, Any> {
    protocol_options(HttpProtocolOptions {
        upstream_protocol_options: Some(UpstreamProtocolOptions::ExplicitHttpConfig(
            ExplicitHttpConfig {
                protocol_config: Some(ProtocolConfig::Http2ProtocolOptions(Http2ProtocolOptions {
                    allow_connect: true,
                    ..Default::default()
                })),
            },
        )),
        ..Default::default()
    })
}

fn protocol_options(options: HttpProtocolOptions) -> HashMap<String, Any> {
    HashMap::from([(
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions".to_string(),
        pack_any(options),
    )])
}

/// As istiod's `applyOutlierDetection` (pilot/pkg/networking/core/cluster_traffic_policy.go):
/// success-rate ejection off; the consecutive-error counts the rule names, enforced when above
/// zero (Envoy's defaults where it names none); the panic threshold at `minHealthPercent`, zero
/// unless set (Envoy's 50 % would send traffic to ejected hosts in services of few pods).
fn apply_outlier(cluster: &mut Cluster, outlier: &OutlierDetection) {
    let u32v = |value: u32| Some(UInt32Value { value });
    let enforcing = |n: u32| u32v(if n > 0 { 100 } else { 0 });
    let mut out = EnvoyOutlier {
        enforcing_success_rate: u32v(0),
        interval: outlier.interval.map(|d| d.to_proto()),
        base_ejection_time: outlier.base_ejection_time.map(|d| d.to_proto()),
        max_ejection_percent: outlier
            .max_ejection_percent
            .and_then(|v| u32::try_from(v).ok())
            .filter(|v| *v > 0)
            .and_then(u32v),
        ..Default::default()
    };
    // `consecutiveErrors`, deprecated, named the same count.
    let five_xx = outlier.consecutive_5xx_errors.or(outlier
        .consecutive_errors
        .and_then(|v| u32::try_from(v).ok()));
    if let Some(n) = five_xx {
        out.consecutive_5xx = u32v(n);
        out.enforcing_consecutive_5xx = enforcing(n);
    }
    if let Some(n) = outlier.consecutive_gateway_errors {
        out.consecutive_gateway_failure = u32v(n);
        out.enforcing_consecutive_gateway_failure = enforcing(n);
    }
    if outlier.split_external_local_origin_errors == Some(true) {
        out.split_external_local_origin_errors = true;
        if let Some(n) = outlier.consecutive_local_origin_failures.filter(|n| *n > 0) {
            out.consecutive_local_origin_failure = u32v(n);
            out.enforcing_consecutive_local_origin_failure = u32v(100);
        }
        out.enforcing_local_origin_success_rate = u32v(0);
    }
    cluster.outlier_detection = Some(out);
    let min_health = outlier.min_health_percent.unwrap_or(0);
    if min_health >= 0 {
        cluster.common_lb_config = Some(CommonLbConfig {
            healthy_panic_threshold: Some(Percent {
                value: f64::from(min_health),
            }),
            ..cluster.common_lb_config.clone().unwrap_or_default()
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(yaml: &str) -> DestinationRule {
        serde_yaml_ng::from_str(yaml).unwrap()
    }

    #[test]
    fn port_settings_replace_the_policy_whole_and_subsets_part_by_part() {
        let dr = rule(
            "
host: r
trafficPolicy:
  loadBalancer: {simple: RANDOM}
  connectionPool: {tcp: {maxConnections: 5}}
  portLevelSettings:
  - port: {number: 80}
    loadBalancer: {simple: LEAST_REQUEST}
subsets:
- name: v2
  labels: {v: '2'}
  trafficPolicy:
    outlierDetection: {consecutive5xxErrors: 3}
    portLevelSettings:
    - port: {number: 80}
      loadBalancer: {simple: ROUND_ROBIN}
",
        );
        let top = Effective::of(&dr, None, 9090);
        assert_eq!(top.load_balancer.unwrap().simple, Some(SimpleLb::Random));
        assert!(top.connection_pool.is_some());
        // The port's settings stand alone: the pool they leave out is Envoy's default.
        let port = Effective::of(&dr, None, 80);
        assert_eq!(
            port.load_balancer.unwrap().simple,
            Some(SimpleLb::LeastRequest)
        );
        assert!(port.connection_pool.is_none(), "not inherited");
        // A subset's policy replaces what it sets, keeping the rest.
        let subset = Effective::of(&dr, Some("v2"), 9090);
        assert_eq!(
            subset.load_balancer.as_ref().unwrap().simple,
            Some(SimpleLb::Random)
        );
        assert!(subset.connection_pool.is_some(), "kept from the top level");
        assert!(subset.outlier_detection.is_some());
        // Its settings for the port replace everything.
        let subset_port = Effective::of(&dr, Some("v2"), 80);
        assert_eq!(
            subset_port.load_balancer.as_ref().unwrap().simple,
            Some(SimpleLb::RoundRobin)
        );
        assert!(subset_port.connection_pool.is_none());
        assert!(subset_port.outlier_detection.is_none());
    }

    #[test]
    fn envoy_fields() {
        let dr = rule(
            "
host: r
trafficPolicy:
  loadBalancer: {consistentHash: {httpHeaderName: x-user, ringHash: {minimumRingSize: 2048}}}
  connectionPool:
    tcp: {maxConnections: 100, connectTimeout: 250ms}
    http: {http1MaxPendingRequests: 7, maxRequestsPerConnection: 3, idleTimeout: 30s}
  outlierDetection: {consecutive5xxErrors: 2, interval: 1s, baseEjectionTime: 3m, maxEjectionPercent: 50, minHealthPercent: 40}
",
        );
        let mut c = Cluster::default();
        apply(
            &mut c,
            &Effective::of(&dr, None, 80),
            MeshPolicy::default(),
            true,
            false,
        );
        assert_eq!(c.lb_policy, LbPolicy::RingHash as i32);
        let t = &c.circuit_breakers.as_ref().unwrap().thresholds[0];
        assert_eq!(t.max_connections.as_ref().unwrap().value, 100);
        assert_eq!(t.max_pending_requests.as_ref().unwrap().value, 7);
        assert_eq!(t.max_requests.as_ref().unwrap().value, UNLIMITED);
        assert_eq!(c.connect_timeout.as_ref().unwrap().nanos, 250_000_000);
        let o = c.outlier_detection.as_ref().unwrap();
        assert_eq!(o.consecutive_5xx.as_ref().unwrap().value, 2);
        assert_eq!(o.enforcing_consecutive_5xx.as_ref().unwrap().value, 100);
        assert_eq!(o.enforcing_success_rate.as_ref().unwrap().value, 0);
        assert!(
            o.enforcing_consecutive_gateway_failure.is_none(),
            "Envoy's default where the rule names no count"
        );
        assert_eq!(o.base_ejection_time.as_ref().unwrap().seconds, 180);
        let panic = &c.common_lb_config.as_ref().unwrap().healthy_panic_threshold;
        assert_eq!(panic.as_ref().unwrap().value, 40.0);
        assert!(c
            .typed_extension_protocol_options
            .contains_key("envoy.extensions.upstreams.http.v3.HttpProtocolOptions"));
    }

    #[test]
    fn the_mesh_keepalive_under_the_rules_and_its_upgrade_unless_the_rule_declines() {
        let dr = rule(
            "
host: r
trafficPolicy:
  connectionPool:
    tcp: {tcpKeepalive: {time: 10s}}
    http: {h2UpgradePolicy: DO_NOT_UPGRADE}
",
        );
        let mesh_keepalive = KeepaliveSpec {
            probes: Some(3),
            time: Some(Duration(std::time::Duration::from_secs(7200))),
            interval: None,
        };
        let mesh = MeshPolicy {
            tcp_keepalive: Some(&mesh_keepalive),
            h2_upgrade: true,
        };
        let mut c = Cluster::default();
        apply(&mut c, &Effective::of(&dr, None, 80), mesh, true, false);
        let k = c
            .upstream_connection_options
            .unwrap()
            .tcp_keepalive
            .unwrap();
        assert_eq!(k.keepalive_probes.map(|v| v.value), Some(3));
        assert_eq!(
            k.keepalive_time.map(|v| v.value),
            Some(10),
            "the rule's time"
        );
        assert_eq!(k.keepalive_interval, None);
        assert!(
            c.typed_extension_protocol_options.is_empty(),
            "not upgraded"
        );

        let mut upgraded = Cluster::default();
        apply(&mut upgraded, &Effective::default(), mesh, true, false);
        assert!(!upgraded.typed_extension_protocol_options.is_empty());
        let mut tcp = Cluster::default();
        apply(&mut tcp, &Effective::default(), mesh, false, false);
        assert!(
            tcp.typed_extension_protocol_options.is_empty(),
            "TCP ports stay"
        );
    }
}
