//! DestinationRule (networking.istio.io): traffic policy for a host after routing.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::duration::Duration;
use super::security::WorkloadSelector;
use super::validate::{self, ensure, Result};
use crate::text::Quoted;

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct DestinationRule {
    pub host: String,
    pub traffic_policy: Option<TrafficPolicy>,
    pub subsets: Vec<Subset>,
    pub export_to: Vec<String>,
    pub workload_selector: Option<WorkloadSelector>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Subset {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub traffic_policy: Option<TrafficPolicy>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct TrafficPolicy {
    pub load_balancer: Option<LoadBalancer>,
    pub connection_pool: Option<ConnectionPool>,
    pub outlier_detection: Option<OutlierDetection>,
    pub tls: Option<ClientTls>,
    pub port_level_settings: Vec<PortTrafficPolicy>,
}

/// A policy for one port (no nested port settings).
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct PortTrafficPolicy {
    pub port: Option<PortSelector>,
    pub load_balancer: Option<LoadBalancer>,
    pub connection_pool: Option<ConnectionPool>,
    pub outlier_detection: Option<OutlierDetection>,
    pub tls: Option<ClientTls>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default)]
pub struct PortSelector {
    pub number: u32,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct LoadBalancer {
    pub simple: Option<SimpleLb>,
    pub consistent_hash: Option<ConsistentHash>,
    pub locality_lb_setting: Option<LocalityLbSetting>,
    pub warmup_duration_secs: Option<Duration>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum SimpleLb {
    Unspecified,
    /// Deprecated alias of LEAST_REQUEST.
    LeastConn,
    Random,
    Passthrough,
    RoundRobin,
    LeastRequest,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ConsistentHash {
    pub http_header_name: Option<String>,
    pub http_cookie: Option<HttpCookie>,
    pub use_source_ip: Option<bool>,
    pub http_query_parameter_name: Option<String>,
    pub ring_hash: Option<RingHash>,
    pub maglev: Option<Maglev>,
    /// Deprecated: `ringHash.minimumRingSize`.
    pub minimum_ring_size: Option<u64>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpCookie {
    pub name: String,
    pub path: String,
    pub ttl: Option<Duration>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct RingHash {
    pub minimum_ring_size: Option<u64>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Maglev {
    pub table_size: Option<u64>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct LocalityLbSetting {
    pub distribute: Vec<LocalityDistribute>,
    pub failover: Vec<LocalityFailover>,
    pub failover_priority: Vec<String>,
    pub enabled: Option<bool>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(default)]
pub struct LocalityDistribute {
    pub from: String,
    pub to: BTreeMap<String, u32>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(default)]
pub struct LocalityFailover {
    pub from: String,
    pub to: String,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ConnectionPool {
    pub tcp: Option<TcpSettings>,
    pub http: Option<HttpSettings>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct TcpSettings {
    pub max_connections: Option<i32>,
    pub connect_timeout: Option<Duration>,
    pub tcp_keepalive: Option<TcpKeepalive>,
    pub max_connection_duration: Option<Duration>,
    pub idle_timeout: Option<Duration>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct TcpKeepalive {
    pub probes: Option<u32>,
    pub time: Option<Duration>,
    pub interval: Option<Duration>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpSettings {
    pub http1_max_pending_requests: Option<i32>,
    pub http2_max_requests: Option<i32>,
    pub max_requests_per_connection: Option<i32>,
    pub max_retries: Option<i32>,
    pub idle_timeout: Option<Duration>,
    pub h2_upgrade_policy: Option<H2UpgradePolicy>,
    pub use_client_protocol: Option<bool>,
    pub max_concurrent_streams: Option<i32>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum H2UpgradePolicy {
    Default,
    DoNotUpgrade,
    Upgrade,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct OutlierDetection {
    /// Deprecated alias of consecutive5xxErrors in older Istio.
    pub consecutive_errors: Option<i32>,
    pub split_external_local_origin_errors: Option<bool>,
    pub consecutive_local_origin_failures: Option<u32>,
    pub consecutive_gateway_errors: Option<u32>,
    #[serde(rename = "consecutive5xxErrors")]
    pub consecutive_5xx_errors: Option<u32>,
    pub interval: Option<Duration>,
    pub base_ejection_time: Option<Duration>,
    pub max_ejection_percent: Option<i32>,
    pub min_health_percent: Option<i32>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ClientTls {
    pub mode: TlsMode,
    pub client_certificate: String,
    pub private_key: String,
    pub ca_certificates: String,
    pub credential_name: String,
    pub subject_alt_names: Vec<String>,
    pub sni: String,
    pub insecure_skip_verify: Option<bool>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum TlsMode {
    #[default]
    Disable,
    Simple,
    Mutual,
    IstioMutual,
}

impl DestinationRule {
    pub fn validate(&self) -> Result {
        ensure(!self.host.is_empty(), "host", "a host is required")?;
        validate::host("host", &self.host)?;
        validate::export_to("exportTo", &self.export_to)?;
        if let Some(policy) = &self.traffic_policy {
            policy.validate().map_err(|e| e.under("trafficPolicy"))?;
        }
        for (i, subset) in self.subsets.iter().enumerate() {
            let field = format!("subsets[{i}]");
            ensure(
                !subset.name.is_empty(),
                &format!("{field}.name"),
                "a subset name is required",
            )?;
            ensure(
                !self.subsets[..i].iter().any(|s| s.name == subset.name),
                &format!("{field}.name"),
                format!("subset {} is defined twice", Quoted(&subset.name)),
            )?;
            validate::labels(&format!("{field}.labels"), &subset.labels)?;
            if let Some(policy) = &subset.traffic_policy {
                policy
                    .validate()
                    .map_err(|e| e.under(&format!("{field}.trafficPolicy")))?;
            }
        }
        if let Some(selector) = &self.workload_selector {
            validate::labels("workloadSelector.matchLabels", &selector.match_labels)?;
        }
        Ok(())
    }
}

impl TrafficPolicy {
    fn validate(&self) -> Result {
        validate_parts(
            &self.load_balancer,
            &self.connection_pool,
            &self.outlier_detection,
            &self.tls,
        )?;
        for (i, port) in self.port_level_settings.iter().enumerate() {
            let field = format!("portLevelSettings[{i}]");
            let number = port.port.as_ref().map(|p| p.number).unwrap_or_default();
            ensure(
                port.port.is_some(),
                &format!("{field}.port"),
                "a port is required",
            )?;
            validate::port(&format!("{field}.port.number"), number)?;
            ensure(
                !self.port_level_settings[..i]
                    .iter()
                    .any(|p| p.port.as_ref().map(|p| p.number) == Some(number)),
                &format!("{field}.port.number"),
                format!("port {number} has two settings"),
            )?;
            validate_parts(
                &port.load_balancer,
                &port.connection_pool,
                &port.outlier_detection,
                &port.tls,
            )
            .map_err(|e| e.under(&field))?;
        }
        Ok(())
    }
}

fn validate_parts(
    lb: &Option<LoadBalancer>,
    pool: &Option<ConnectionPool>,
    outlier: &Option<OutlierDetection>,
    tls: &Option<ClientTls>,
) -> Result {
    if let Some(lb) = lb {
        lb.validate().map_err(|e| e.under("loadBalancer"))?;
    }
    if let Some(pool) = pool {
        pool.validate().map_err(|e| e.under("connectionPool"))?;
    }
    if let Some(outlier) = outlier {
        outlier
            .validate()
            .map_err(|e| e.under("outlierDetection"))?;
    }
    if let Some(tls) = tls {
        tls.validate().map_err(|e| e.under("tls"))?;
    }
    Ok(())
}

/// Durations Envoy accepts in these settings start at 1 ms.
fn at_least_1ms(field: &str, d: &Option<Duration>) -> Result {
    match d {
        Some(d) => ensure(
            d.as_std() >= std::time::Duration::from_millis(1),
            field,
            format!("{d} is shorter than 1ms"),
        ),
        None => Ok(()),
    }
}

fn non_negative(field: &str, v: Option<i32>) -> Result {
    ensure(v.is_none_or(|v| v >= 0), field, "must not be negative")
}

impl LoadBalancer {
    fn validate(&self) -> Result {
        ensure(
            !(self.simple.is_some() && self.consistent_hash.is_some()),
            "",
            "simple and consistentHash cannot both be set",
        )?;
        if let Some(hash) = &self.consistent_hash {
            let keys = [
                hash.http_header_name.is_some(),
                hash.http_cookie.is_some(),
                hash.use_source_ip == Some(true),
                hash.http_query_parameter_name.is_some(),
            ];
            ensure(
                keys.iter().filter(|k| **k).count() == 1,
                "consistentHash",
                "exactly one of httpHeaderName, httpCookie, useSourceIp, httpQueryParameterName",
            )?;
            ensure(
                !(hash.ring_hash.is_some() && hash.maglev.is_some()),
                "consistentHash",
                "ringHash and maglev cannot both be set",
            )?;
            if let Some(cookie) = &hash.http_cookie {
                ensure(
                    !cookie.name.is_empty(),
                    "consistentHash.httpCookie.name",
                    "a cookie name is required",
                )?;
            }
        }
        if let Some(locality) = &self.locality_lb_setting {
            locality
                .validate()
                .map_err(|e| e.under("localityLbSetting"))?;
        }
        Ok(())
    }
}

impl LocalityLbSetting {
    fn validate(&self) -> Result {
        ensure(
            self.distribute.is_empty() || self.failover.is_empty(),
            "",
            "distribute and failover cannot both be set",
        )?;
        for (i, d) in self.distribute.iter().enumerate() {
            let field = format!("distribute[{i}]");
            ensure(!d.from.is_empty(), &format!("{field}.from"), "required")?;
            let total: u64 = d.to.values().map(|w| u64::from(*w)).sum();
            ensure(
                total == 100,
                &format!("{field}.to"),
                format!("weights add up to {total}, not 100"),
            )?;
        }
        for (i, f) in self.failover.iter().enumerate() {
            let field = format!("failover[{i}]");
            ensure(
                !f.from.is_empty() && !f.to.is_empty(),
                &field,
                "from and to are required",
            )?;
            ensure(
                f.from != f.to,
                &field,
                "from and to must be different regions",
            )?;
            ensure(
                !f.from.contains('/') && !f.to.contains('/'),
                &field,
                "failover is between regions (no '/')",
            )?;
        }
        Ok(())
    }
}

impl ConnectionPool {
    fn validate(&self) -> Result {
        ensure(
            self.tcp.is_some() || self.http.is_some(),
            "",
            "tcp or http settings are required",
        )?;
        if let Some(tcp) = &self.tcp {
            non_negative("tcp.maxConnections", tcp.max_connections)?;
            at_least_1ms("tcp.connectTimeout", &tcp.connect_timeout)?;
            at_least_1ms("tcp.maxConnectionDuration", &tcp.max_connection_duration)?;
            if let Some(keepalive) = &tcp.tcp_keepalive {
                at_least_1ms("tcp.tcpKeepalive.time", &keepalive.time)?;
                at_least_1ms("tcp.tcpKeepalive.interval", &keepalive.interval)?;
            }
        }
        if let Some(http) = &self.http {
            non_negative(
                "http.http1MaxPendingRequests",
                http.http1_max_pending_requests,
            )?;
            non_negative("http.http2MaxRequests", http.http2_max_requests)?;
            non_negative(
                "http.maxRequestsPerConnection",
                http.max_requests_per_connection,
            )?;
            non_negative("http.maxRetries", http.max_retries)?;
            non_negative("http.maxConcurrentStreams", http.max_concurrent_streams)?;
            at_least_1ms("http.idleTimeout", &http.idle_timeout)?;
        }
        Ok(())
    }
}

impl OutlierDetection {
    fn validate(&self) -> Result {
        non_negative("consecutiveErrors", self.consecutive_errors)?;
        at_least_1ms("interval", &self.interval)?;
        at_least_1ms("baseEjectionTime", &self.base_ejection_time)?;
        let percent = |field: &str, v: Option<i32>| {
            ensure(
                v.is_none_or(|v| (0..=100).contains(&v)),
                field,
                "must be within 0-100",
            )
        };
        percent("maxEjectionPercent", self.max_ejection_percent)?;
        percent("minHealthPercent", self.min_health_percent)
    }
}

impl ClientTls {
    fn validate(&self) -> Result {
        match self.mode {
            TlsMode::Disable | TlsMode::IstioMutual => {
                let files = [
                    &self.client_certificate,
                    &self.private_key,
                    &self.ca_certificates,
                    &self.credential_name,
                ];
                ensure(
                    files.iter().all(|f| f.is_empty()),
                    "",
                    format!(
                        "mode {:?} takes no certificates or credentialName",
                        self.mode
                    ),
                )
            }
            TlsMode::Simple => Ok(()),
            TlsMode::Mutual => {
                if !self.credential_name.is_empty() {
                    return Ok(());
                }
                ensure(
                    !self.client_certificate.is_empty() && !self.private_key.is_empty(),
                    "",
                    "mode MUTUAL needs clientCertificate and privateKey, or credentialName",
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dr(yaml: &str) -> DestinationRule {
        serde_yaml_ng::from_str(yaml).unwrap()
    }

    #[test]
    fn a_full_rule_validates() {
        let rule = dr("
host: reviews.bookinfo.svc.cluster.local
trafficPolicy:
  loadBalancer: {simple: LEAST_REQUEST}
  connectionPool:
    tcp: {maxConnections: 100, connectTimeout: 30ms, tcpKeepalive: {time: 7200s, interval: 75s}}
    http: {http1MaxPendingRequests: 10, maxRequestsPerConnection: 10}
  outlierDetection: {consecutive5xxErrors: 7, interval: 5m, baseEjectionTime: 15m}
  portLevelSettings:
  - port: {number: 9080}
    loadBalancer: {consistentHash: {httpCookie: {name: user, ttl: 0s}}}
subsets:
- {name: v1, labels: {version: v1}}
- name: v2
  labels: {version: v2}
  trafficPolicy: {loadBalancer: {simple: ROUND_ROBIN}}
");
        rule.validate().unwrap();
        let policy = rule.traffic_policy.unwrap();
        let outlier = policy.outlier_detection.unwrap();
        assert_eq!(outlier.consecutive_5xx_errors, Some(7));
        assert_eq!(outlier.interval.unwrap().as_std().as_secs(), 300);
    }

    #[test]
    fn refusals_name_the_field() {
        let e = dr("host: r\nsubsets: [{name: v1}, {name: v1}]\n")
            .validate()
            .unwrap_err();
        assert_eq!(e.field, "subsets[1].name");
        let e = dr("host: r\ntrafficPolicy: {tls: {mode: MUTUAL}}\n")
            .validate()
            .unwrap_err();
        assert_eq!(e.field, "trafficPolicy.tls");
        let e = dr("host: r\ntrafficPolicy: {portLevelSettings: [{port: {number: 0}}]}\n")
            .validate()
            .unwrap_err();
        assert_eq!(e.field, "trafficPolicy.portLevelSettings[0].port.number");
        let e = dr("host: r\ntrafficPolicy: {loadBalancer: {simple: RANDOM, consistentHash: {useSourceIp: true}}}\n")
            .validate()
            .unwrap_err();
        assert_eq!(e.field, "trafficPolicy.loadBalancer");
        let e = dr("host: r\ntrafficPolicy: {outlierDetection: {maxEjectionPercent: 120}}\n")
            .validate()
            .unwrap_err();
        assert_eq!(e.field, "trafficPolicy.outlierDetection.maxEjectionPercent");
    }

    #[test]
    fn a_bad_enum_value_is_a_parse_error() {
        let parsed: std::result::Result<DestinationRule, _> =
            serde_yaml_ng::from_str("host: r\ntrafficPolicy: {loadBalancer: {simple: FASTEST}}");
        assert!(parsed.is_err());
    }
}
