//! PeerAuthentication: which mutual-TLS mode a workload's inbound side accepts.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{selects_workloads, validate_selector, WorkloadSelector};
use crate::istio::validate::{ensure, Result, ValidationError};
use crate::text::clip;

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct PeerAuthentication {
    pub selector: Option<WorkloadSelector>,
    pub mtls: Option<MutualTls>,
    /// Per target port of the workload; only with a selector. Keys are port numbers (strings in
    /// JSON, as the API server sends them).
    pub port_level_mtls: Option<BTreeMap<String, MutualTls>>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct MutualTls {
    pub mode: MtlsMode,
}

/// A policy's mode; `Unset` inherits the parent's (workload → namespace → mesh → PERMISSIVE).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum MtlsMode {
    #[default]
    Unset,
    /// Plaintext only.
    Disable,
    /// Mutual TLS and plaintext.
    Permissive,
    /// Mutual TLS with a verified client certificate only.
    Strict,
}

impl PeerAuthentication {
    pub fn validate(&self) -> Result {
        validate_selector(&self.selector)?;
        let Some(ports) = &self.port_level_mtls else {
            return Ok(());
        };
        ensure(
            selects_workloads(&self.selector),
            "portLevelMtls",
            "mesh/namespace peer authentication cannot have port level mTLS",
        )?;
        ensure(
            !ports.is_empty(),
            "portLevelMtls",
            "port level mTLS, if defined, must have at least one element",
        )?;
        for port in ports.keys() {
            match port.parse::<u32>() {
                Ok(p) if (1..=65535).contains(&p) => {}
                _ => {
                    return Err(ValidationError::at(
                        format!("portLevelMtls[{}]", clip(port)),
                        "port must be in range 1..65535",
                    ))
                }
            }
        }
        Ok(())
    }

    /// The port-level modes with their ports as numbers (validation ensured they parse).
    pub fn ports(&self) -> impl Iterator<Item = (u16, MtlsMode)> + '_ {
        self.port_level_mtls
            .iter()
            .flatten()
            .filter_map(|(port, mtls)| Some((port.parse().ok()?, mtls.mode)))
    }

    /// Whether the policy names DISABLE anywhere (clients then stop sending mTLS to some workloads).
    pub fn mentions_disable(&self) -> bool {
        self.mtls.is_some_and(|m| m.mode == MtlsMode::Disable)
            || self.ports().any(|(_, mode)| mode == MtlsMode::Disable)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(yaml: &str) -> PeerAuthentication {
        let value: serde_json::Value = serde_yaml_ng::from_str(yaml).unwrap();
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn port_level_modes_need_a_selector_and_valid_ports() {
        let ok = parse("selector: {matchLabels: {app: a}}\nmtls: {mode: STRICT}\nportLevelMtls: {8080: {mode: DISABLE}}");
        assert!(ok.validate().is_ok());
        assert_eq!(ok.ports().collect::<Vec<_>>(), [(8080, MtlsMode::Disable)]);
        assert!(ok.mentions_disable());
        let namespace_wide = parse("portLevelMtls: {8080: {mode: DISABLE}}");
        assert_eq!(
            namespace_wide.validate().unwrap_err().field,
            "portLevelMtls"
        );
        let bad_port =
            parse("selector: {matchLabels: {app: a}}\nportLevelMtls: {70000: {mode: STRICT}}");
        assert_eq!(
            bad_port.validate().unwrap_err().field,
            "portLevelMtls[70000]"
        );
        let empty = parse("selector: {matchLabels: {app: a}}\nportLevelMtls: {}");
        assert!(empty.validate().is_err());
        assert!(!parse("mtls: {mode: STRICT}").mentions_disable());
    }
}
