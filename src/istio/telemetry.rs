//! Telemetry (telemetry.istio.io): which access log, tracing and metrics providers a workload's
//! proxy uses, for which traffic, and how Istio's metrics are shaped.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::duration::Duration;
use super::security::{Attachment, PolicyTargetRef, WorkloadSelector};
use super::validate::{ensure, Result};

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Telemetry {
    pub selector: Option<WorkloadSelector>,
    /// A Gateway API Gateway whose proxies it applies to (at the workload level), instead of a
    /// selector.
    pub target_ref: Option<PolicyTargetRef>,
    pub target_refs: Vec<PolicyTargetRef>,
    pub access_logging: Vec<AccessLogging>,
    pub tracing: Vec<Tracing>,
    pub metrics: Vec<Metrics>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Metrics {
    pub providers: Vec<ProviderRef>,
    pub overrides: Vec<MetricsOverride>,
    /// How often long TCP connections report (the stats filter's `tcp_reporting_duration`).
    pub reporting_interval: Option<Duration>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct MetricsOverride {
    #[serde(rename = "match")]
    pub matches: Option<MetricSelector>,
    pub disabled: Option<bool>,
    pub tag_overrides: BTreeMap<String, TagOverride>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct MetricSelector {
    /// One of Istio's metrics (`REQUEST_COUNT` …, `ALL_METRICS`); none with `customMetric`: all.
    pub metric: Option<String>,
    pub custom_metric: Option<String>,
    pub mode: WorkloadMode,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default)]
pub struct TagOverride {
    pub operation: TagOperation,
    /// A CEL expression for the tag's value (UPSERT).
    pub value: String,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum TagOperation {
    #[default]
    Upsert,
    Remove,
}

/// Istio's metrics, as the Telemetry API names them and Istio's proxy reports them
/// (pilot/pkg/model/telemetry.go `metricToPrometheusMetric`).
pub const ISTIO_METRICS: [(&str, &str); 10] = [
    ("REQUEST_COUNT", "requests_total"),
    ("REQUEST_DURATION", "request_duration_milliseconds"),
    ("REQUEST_SIZE", "request_bytes"),
    ("RESPONSE_SIZE", "response_bytes"),
    ("TCP_OPENED_CONNECTIONS", "tcp_connections_opened_total"),
    ("TCP_CLOSED_CONNECTIONS", "tcp_connections_closed_total"),
    ("TCP_SENT_BYTES", "tcp_sent_bytes_total"),
    ("TCP_RECEIVED_BYTES", "tcp_received_bytes_total"),
    ("GRPC_REQUEST_MESSAGES", "request_messages_total"),
    ("GRPC_RESPONSE_MESSAGES", "response_messages_total"),
];
pub const ALL_METRICS: &str = "ALL_METRICS";

impl MetricSelector {
    /// Whether it selects every metric.
    pub fn is_all(&self) -> bool {
        self.custom_metric.is_none() && self.metric.as_deref() == Some(ALL_METRICS)
    }

    /// The metrics it selects, by the names the proxy reports.
    pub fn metric_names(&self) -> Vec<String> {
        if let Some(custom) = &self.custom_metric {
            return vec![custom.clone()];
        }
        match self.metric.as_deref() {
            Some(metric) if metric != ALL_METRICS => vec![ISTIO_METRICS
                .iter()
                .find(|(enum_name, _)| *enum_name == metric)
                .map_or(metric, |(_, name)| name)
                .to_string()],
            _ => ISTIO_METRICS
                .iter()
                .map(|(_, name)| name.to_string())
                .collect(),
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Tracing {
    #[serde(rename = "match")]
    pub matches: Option<WorkloadMatch>,
    pub providers: Vec<ProviderRef>,
    pub random_sampling_percentage: Option<f64>,
    pub disable_span_reporting: Option<bool>,
    pub custom_tags: BTreeMap<String, CustomTag>,
    pub use_request_id_for_trace_sampling: Option<bool>,
    pub enable_istio_tags: Option<bool>,
}

/// A span tag: a literal, an environment variable of the proxy, or a request header.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct CustomTag {
    pub literal: Option<Literal>,
    pub environment: Option<FromSource>,
    pub header: Option<FromSource>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(default)]
pub struct Literal {
    pub value: String,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct FromSource {
    pub name: String,
    pub default_value: String,
}

impl Tracing {
    /// Whether the entry is for traffic of `mode` (no `match`: both).
    pub fn matches(&self, mode: WorkloadMode) -> bool {
        mode_matches(self.matches.as_ref(), mode)
    }
}

fn mode_matches(selector: Option<&WorkloadMatch>, mode: WorkloadMode) -> bool {
    match selector.map_or(WorkloadMode::ClientAndServer, |m| m.mode) {
        WorkloadMode::ClientAndServer => true,
        wanted => wanted == mode,
    }
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct AccessLogging {
    #[serde(rename = "match")]
    pub matches: Option<WorkloadMatch>,
    pub providers: Vec<ProviderRef>,
    pub disabled: Option<bool>,
    pub filter: Option<LogFilter>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default)]
pub struct WorkloadMatch {
    pub mode: WorkloadMode,
}

/// Which side of a connection the proxy is on: sidecar outbound and gateways are clients,
/// sidecar inbound the server.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum WorkloadMode {
    /// UNDEFINED matches both sides, as istiod reads it.
    #[default]
    #[serde(alias = "UNDEFINED")]
    ClientAndServer,
    Client,
    Server,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default)]
pub struct ProviderRef {
    pub name: String,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default)]
pub struct LogFilter {
    /// A CEL expression over Envoy's attributes; only matching requests are logged.
    pub expression: String,
}

impl AccessLogging {
    /// Whether the entry is for traffic of `mode` (no `match`: both).
    pub fn matches(&self, mode: WorkloadMode) -> bool {
        mode_matches(self.matches.as_ref(), mode)
    }

    /// Provider names in the order given.
    pub fn provider_names(&self) -> Vec<&str> {
        self.providers.iter().map(|p| p.name.as_str()).collect()
    }
}

impl Telemetry {
    /// How it attaches: by selector or by target.
    pub fn attachment(&self) -> Attachment<'_> {
        Attachment {
            selector: &self.selector,
            target_ref: &self.target_ref,
            target_refs: &self.target_refs,
        }
    }

    pub fn validate(&self) -> Result {
        self.attachment().validate()?;
        for (i, logging) in self.access_logging.iter().enumerate() {
            for (j, provider) in logging.providers.iter().enumerate() {
                ensure(
                    !provider.name.is_empty(),
                    &format!("accessLogging[{i}].providers[{j}].name"),
                    "a provider name is required",
                )?;
            }
            if let Some(filter) = &logging.filter {
                ensure(
                    !filter.expression.trim().is_empty(),
                    &format!("accessLogging[{i}].filter.expression"),
                    "an expression is required",
                )?;
            }
        }
        for (i, metrics) in self.metrics.iter().enumerate() {
            for (j, o) in metrics.overrides.iter().enumerate() {
                let at = format!("metrics[{i}].overrides[{j}]");
                if let Some(selector) = &o.matches {
                    let known = selector.metric.as_deref().is_none_or(|m| {
                        m == ALL_METRICS || ISTIO_METRICS.iter().any(|(name, _)| *name == m)
                    });
                    ensure(
                        known,
                        &format!("{at}.match.metric"),
                        format!(
                            "unknown metric {:?}; Istio's are ALL_METRICS, {}",
                            selector.metric.as_deref().unwrap_or_default(),
                            ISTIO_METRICS.map(|(name, _)| name).join(", ")
                        ),
                    )?;
                    ensure(
                        !(selector.metric.is_some() && selector.custom_metric.is_some()),
                        &format!("{at}.match"),
                        "only one of metric or customMetric",
                    )?;
                }
                for (tag, edit) in &o.tag_overrides {
                    ensure(
                        edit.operation == TagOperation::Remove || !edit.value.is_empty(),
                        &format!("{at}.tagOverrides.{tag}.value"),
                        "must be set with operation UPSERT",
                    )?;
                }
            }
        }
        for (i, tracing) in self.tracing.iter().enumerate() {
            let at = format!("tracing[{i}]");
            ensure(
                tracing
                    .random_sampling_percentage
                    .is_none_or(|p| (0.0..=100.0).contains(&p)),
                &format!("{at}.randomSamplingPercentage"),
                "must be in range [0.0, 100.0]",
            )?;
            for (name, tag) in &tracing.custom_tags {
                let kinds = [
                    tag.literal.is_some(),
                    tag.environment.is_some(),
                    tag.header.is_some(),
                ];
                ensure(
                    kinds.iter().filter(|k| **k).count() == 1,
                    &format!("{at}.customTags.{name}"),
                    "exactly one of literal, environment or header",
                )?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn telemetry(yaml: &str) -> Telemetry {
        serde_yaml_ng::from_str(yaml).unwrap()
    }

    #[test]
    fn entries_match_their_mode() {
        let t = telemetry(
            "accessLogging:\n- match: {mode: SERVER}\n  providers: [{name: envoy}]\n- disabled: true\n",
        );
        assert!(t.access_logging[0].matches(WorkloadMode::Server));
        assert!(!t.access_logging[0].matches(WorkloadMode::Client));
        assert!(t.access_logging[1].matches(WorkloadMode::Client));
        assert!(t.validate().is_ok());
    }

    #[test]
    fn selectors_and_filters_are_checked() {
        let t = telemetry("selector: {matchLabels: {app: '*'}}");
        assert_eq!(t.validate().unwrap_err().field, "selector.matchLabels");
        let t = telemetry("accessLogging: [{filter: {expression: ' '}}]");
        assert_eq!(
            t.validate().unwrap_err().field,
            "accessLogging[0].filter.expression"
        );
    }
}
