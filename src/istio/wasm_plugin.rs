//! WasmPlugin (extensions.istio.io/v1alpha1): a Wasm module Istio's agent fetches and Envoy runs as
//! an HTTP or network filter of the workloads it selects, served to them over ECDS. Validation as
//! istiod's `ValidateWasmPlugin` (pkg/config/validation/validation.go).

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use super::security::{validate_selector, Attachment, PolicyTargetRef, WorkloadSelector};
use super::telemetry::WorkloadMode;
use super::validate::{ensure, port, Result};
use crate::text::Quoted;

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct WasmPlugin {
    pub selector: Option<WorkloadSelector>,
    pub target_ref: Option<PolicyTargetRef>,
    pub target_refs: Vec<PolicyTargetRef>,
    /// `oci://`, `http(s)://` or `file://`; without a scheme, an OCI image.
    pub url: String,
    pub sha256: String,
    pub image_pull_policy: PullPolicy,
    /// A `kubernetes.io/dockerconfigjson` Secret of the plugin's namespace.
    pub image_pull_secret: String,
    pub verification_key: String,
    pub plugin_config: Option<serde_json::Map<String, serde_json::Value>>,
    /// The root id of the module's VM (used to be `rootID`).
    pub plugin_name: String,
    pub phase: PluginPhase,
    /// Higher first within a phase; unset after every set one (as istiod sorts it).
    pub priority: Option<i32>,
    pub vm_config: Option<VmConfig>,
    #[serde(rename = "match")]
    pub matches: Vec<TrafficSelector>,
    pub fail_strategy: FailStrategy,
    #[serde(rename = "type")]
    pub plugin_type: PluginType,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
pub enum PullPolicy {
    #[default]
    #[serde(rename = "UNSPECIFIED_POLICY")]
    Unspecified,
    IfNotPresent,
    Always,
}

/// Where among Istio's own filters the plugin runs.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize, Serialize,
)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum PluginPhase {
    #[default]
    UnspecifiedPhase,
    Authn,
    Authz,
    Stats,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum FailStrategy {
    #[default]
    FailClose,
    FailOpen,
    FailReload,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum PluginType {
    /// HTTP, as istiod reads it.
    #[default]
    UnspecifiedPluginType,
    Http,
    Network,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(default)]
pub struct VmConfig {
    pub env: Vec<EnvVar>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct EnvVar {
    pub name: String,
    pub value_from: EnvValueSource,
    pub value: String,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum EnvValueSource {
    #[default]
    Inline,
    Host,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(default)]
pub struct TrafficSelector {
    pub mode: WorkloadMode,
    pub ports: Vec<PortSelector>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(default)]
pub struct PortSelector {
    pub number: u32,
}

impl WasmPlugin {
    pub fn attachment(&self) -> Attachment<'_> {
        Attachment {
            selector: &self.selector,
            target_ref: &self.target_ref,
            target_refs: &self.target_refs,
        }
    }

    /// The network filter form rather than the HTTP one.
    pub fn is_network(&self) -> bool {
        self.plugin_type == PluginType::Network
    }

    pub fn validate(&self) -> Result {
        self.attachment().validate()?;
        validate_selector(&self.selector)?;
        ensure(!self.url.is_empty(), "url", "url field needs to be set")?;
        let scheme = self.url.split_once("://").map(|(s, _)| s);
        ensure(
            matches!(scheme, None | Some("oci" | "http" | "https" | "file")),
            "url",
            format!(
                "unsupported scheme {} (oci, http, https or file)",
                Quoted(scheme.unwrap_or_default())
            ),
        )?;
        ensure(
            self.url
                .split_once("://")
                .is_none_or(|(_, rest)| !rest.is_empty()),
            "url",
            "names nothing after its scheme",
        )?;
        ensure(
            self.sha256.is_empty()
                || (self.sha256.len() == 64
                    && self
                        .sha256
                        .chars()
                        .all(|c| matches!(c, '0'..='9' | 'a'..='f'))),
            "sha256",
            "must be 64 lowercase hexadecimal characters",
        )?;
        ensure(
            self.image_pull_secret.len() <= 253,
            "imagePullSecret",
            "must be at most 253 characters",
        )?;
        ensure(
            self.plugin_name.len() <= 256,
            "pluginName",
            "must be at most 256 characters",
        )?;
        ensure(
            self.verification_key.is_empty(),
            "verificationKey",
            "is an Istio field Istio itself does not implement",
        )?;
        let mut names = BTreeSet::new();
        for (i, env) in self.vm_config.iter().flat_map(|v| &v.env).enumerate() {
            let field = format!("vmConfig.env[{i}]");
            ensure(
                !env.name.is_empty() && env.name.len() <= 256,
                &field,
                "an environment variable has a name of at most 256 characters",
            )?;
            ensure(
                names.insert(env.name.as_str()),
                &field,
                format!("duplicate env {}", Quoted(&env.name)),
            )?;
            ensure(
                env.value_from == EnvValueSource::Inline || env.value.is_empty(),
                &field,
                "value may only be set when valueFrom is INLINE",
            )?;
        }
        for (i, selector) in self.matches.iter().enumerate() {
            for (j, p) in selector.ports.iter().enumerate() {
                port(&format!("match[{i}].ports[{j}].number"), p.number)?;
            }
        }
        Ok(())
    }
}
