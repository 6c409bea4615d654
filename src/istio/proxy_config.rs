//! ProxyConfig (networking.istio.io/v1beta1): settings of the proxies injected into the workloads
//! it selects — Envoy's concurrency, the proxy image's type, environment variables — read at
//! injection. Validation as istiod's `ValidateProxyConfig`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::security::{validate_selector, WorkloadSelector};
use super::validate::{ensure, Result};

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ProxyConfig {
    pub selector: Option<WorkloadSelector>,
    /// Envoy's worker threads; 0 sizes them to the CPUs (unset: Istio's default of 2).
    pub concurrency: Option<i32>,
    pub environment_variables: BTreeMap<String, String>,
    pub image: Option<ProxyImage>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ProxyImage {
    /// `default`, `debug`, `distroless`, or another published variant's suffix.
    pub image_type: String,
}

impl ProxyConfig {
    pub fn validate(&self) -> Result {
        validate_selector(&self.selector)?;
        ensure(
            self.concurrency.is_none_or(|c| c >= 0),
            "concurrency",
            "must be greater than or equal to 0",
        )?;
        for name in self.environment_variables.keys() {
            ensure(
                !name.is_empty() && !name.contains('='),
                "environmentVariables",
                "a variable's name is not empty and has no '='",
            )?;
        }
        Ok(())
    }
}
