//! Istio's security kinds (security.istio.io/v1): PeerAuthentication, AuthorizationPolicy and
//! RequestAuthentication, and what they share: the workload selector and Istio's validation of it.

pub mod authorization;
pub mod jwks;
pub mod peer;
pub mod request;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::validate::{self, ensure, Result};
use crate::text::clip;

/// `selector`: the workloads (by pod labels) a policy applies to; none or no labels means every
/// workload of the policy's namespace (of the mesh, in the root namespace).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct WorkloadSelector {
    pub match_labels: BTreeMap<String, String>,
}

impl WorkloadSelector {
    /// Whether a workload with these labels is selected.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.match_labels
            .iter()
            .all(|(k, v)| labels.get(k) == Some(v))
    }
}

/// Whether a policy's selector picks workloads (rather than the whole namespace).
pub fn selects_workloads(selector: &Option<WorkloadSelector>) -> bool {
    selector
        .as_ref()
        .is_some_and(|s| !s.match_labels.is_empty())
}

/// Whether a policy with this selector applies to a workload with these labels.
pub fn applies_to(selector: &Option<WorkloadSelector>, labels: &BTreeMap<String, String>) -> bool {
    selector.as_ref().is_none_or(|s| s.matches(labels))
}

/// Istio's selector rules: valid label keys and values, no wildcards; `targetRef(s)` (Gateway API
/// attachment) not together with a selector.
pub(crate) fn validate_selector(
    selector: &Option<WorkloadSelector>,
    target_ref: &Option<serde_json::Value>,
    target_refs: &[serde_json::Value],
) -> Result {
    let attached = [
        selector.is_some(),
        target_ref.is_some(),
        !target_refs.is_empty(),
    ];
    ensure(
        attached.iter().filter(|set| **set).count() <= 1,
        "selector",
        "only one of targetRefs or selector can be set",
    )?;
    let Some(selector) = selector else {
        return Ok(());
    };
    for (key, value) in &selector.match_labels {
        ensure(
            !key.contains('*') && !value.contains('*'),
            "selector.matchLabels",
            format!(
                "wildcard is not supported in selector: \"{}={}\"",
                clip(key),
                clip(value)
            ),
        )?;
    }
    validate::labels("selector.matchLabels", &selector.match_labels)
}

/// `values` has no empty entry.
fn non_empty_values(field: &str, values: &[String]) -> Result {
    match values.iter().position(String::is_empty) {
        Some(i) => Err(validate::ValidationError::at(
            format!("{field}[{i}]"),
            "empty value not allowed",
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectors_match_by_labels() {
        let labels = BTreeMap::from([("app".to_string(), "echo".to_string())]);
        let selector = |k: &str, v: &str| {
            Some(WorkloadSelector {
                match_labels: BTreeMap::from([(k.to_string(), v.to_string())]),
            })
        };
        assert!(applies_to(&None, &labels));
        assert!(applies_to(&selector("app", "echo"), &labels));
        assert!(!applies_to(&selector("app", "other"), &labels));
        assert!(!selects_workloads(&Some(WorkloadSelector::default())));
        assert!(validate_selector(&selector("app", "*"), &None, &[]).is_err());
        let target = Some(serde_json::json!({"kind": "Gateway", "name": "g"}));
        assert_eq!(
            validate_selector(&selector("app", "echo"), &target, &[])
                .unwrap_err()
                .field,
            "selector"
        );
    }
}
