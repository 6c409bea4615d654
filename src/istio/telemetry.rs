//! Telemetry (telemetry.istio.io): which access log and tracing providers a workload's proxy uses,
//! and for which traffic. Metrics overrides are not implemented yet, so a Telemetry naming them is
//! refused (by the field check every kind has) rather than applied without them.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::security::WorkloadSelector;
use super::validate::{ensure, Result};

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Telemetry {
    pub selector: Option<WorkloadSelector>,
    /// Gateway API attachment (a Gateway or a waypoint): meshpilot serves neither yet, so such a
    /// Telemetry applies to no proxy, as AuthorizationPolicies attached that way.
    pub target_ref: Option<serde_json::Value>,
    pub target_refs: Vec<serde_json::Value>,
    pub access_logging: Vec<AccessLogging>,
    pub tracing: Vec<Tracing>,
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
    #[default]
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
    /// Whether it applies to workloads by selector or namespace (not by a Gateway API target).
    pub fn attaches_to_workloads(&self) -> bool {
        self.target_ref.is_none() && self.target_refs.is_empty()
    }

    pub fn validate(&self) -> Result {
        super::security::validate_selector(&self.selector, &self.target_ref, &self.target_refs)?;
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
    fn selectors_and_targets_are_exclusive() {
        let t = telemetry(
            "selector: {matchLabels: {app: a}}\ntargetRefs: [{kind: Gateway, name: g}]\n",
        );
        assert_eq!(t.validate().unwrap_err().field, "selector");
        let t = telemetry("accessLogging: [{filter: {expression: ' '}}]");
        assert_eq!(
            t.validate().unwrap_err().field,
            "accessLogging[0].filter.expression"
        );
    }
}
