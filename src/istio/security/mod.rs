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

/// `targetRef(s)`: a Gateway API Gateway of the policy's namespace whose proxies a policy (or a
/// Telemetry) applies to, instead of workloads by selector. Other targets (Services and
/// GatewayClasses, for ambient waypoints) are refused as not implemented.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct PolicyTargetRef {
    pub group: String,
    pub kind: String,
    pub name: String,
    pub namespace: Option<String>,
}

impl PolicyTargetRef {
    fn validate(&self) -> Result {
        ensure(
            self.group == super::gateway_api::GROUP && self.kind == "Gateway",
            "kind",
            format!(
                "targets other than Gateway API Gateways ({}/{}) are not implemented",
                clip(&self.group),
                clip(&self.kind)
            ),
        )?;
        ensure(!self.name.is_empty(), "name", "a target is named")
    }

    /// Whether a proxy of `proxy_ns` with `labels` is one of the targeted Gateway's, for a policy
    /// of `policy_ns` (a target is in the policy's namespace).
    fn targets(&self, policy_ns: &str, proxy_ns: &str, labels: &BTreeMap<String, String>) -> bool {
        self.namespace.as_deref().is_none_or(|ns| ns == policy_ns)
            && policy_ns == proxy_ns
            && labels.get(super::gateway_api::GATEWAY_NAME_LABEL) == Some(&self.name)
    }
}

/// How a policy attaches: by selector (none: the whole namespace) or by target.
pub struct Attachment<'a> {
    pub selector: &'a Option<WorkloadSelector>,
    pub target_ref: &'a Option<PolicyTargetRef>,
    pub target_refs: &'a [PolicyTargetRef],
}

impl Attachment<'_> {
    fn targets(&self) -> impl Iterator<Item = &PolicyTargetRef> {
        self.target_ref.iter().chain(self.target_refs)
    }

    /// Whether it attaches by target rather than by selector.
    pub fn by_target(&self) -> bool {
        self.targets().next().is_some()
    }

    /// Whether a policy of `policy_ns` attached so applies to a proxy of `proxy_ns` with `labels`:
    /// its targeted Gateway's proxies, else the workloads its selector picks.
    pub fn applies(
        &self,
        policy_ns: &str,
        proxy_ns: &str,
        labels: &BTreeMap<String, String>,
    ) -> bool {
        match self.by_target() {
            true => self
                .targets()
                .any(|t| t.targets(policy_ns, proxy_ns, labels)),
            false => applies_to(self.selector, labels),
        }
    }

    /// Istio's rules: a selector or targets, not both; each target one meshpilot serves.
    pub fn validate(&self) -> Result {
        ensure(
            [
                self.selector.is_some(),
                self.target_ref.is_some(),
                !self.target_refs.is_empty(),
            ]
            .into_iter()
            .filter(|set| *set)
            .count()
                <= 1,
            "selector",
            "only one of targetRefs or selector can be set",
        )?;
        if let Some(target) = self.target_ref {
            target.validate().map_err(|e| e.under("targetRef"))?;
        }
        for (i, target) in self.target_refs.iter().enumerate() {
            target
                .validate()
                .map_err(|e| e.under(&format!("targetRefs[{i}]")))?;
        }
        validate_selector(self.selector)
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

/// Istio's selector rules: valid label keys and values, no wildcards.
pub(crate) fn validate_selector(selector: &Option<WorkloadSelector>) -> Result {
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
        assert!(validate_selector(&selector("app", "*")).is_err());
    }

    #[test]
    fn targets_are_gateways_of_the_policys_namespace() {
        let gateway = |kind: &str| PolicyTargetRef {
            group: "gateway.networking.k8s.io".into(),
            kind: kind.into(),
            name: "web".into(),
            namespace: None,
        };
        let refs = [gateway("Gateway")];
        let attached = Attachment {
            selector: &None,
            target_ref: &None,
            target_refs: &refs,
        };
        let web = BTreeMap::from([(
            "gateway.networking.k8s.io/gateway-name".to_string(),
            "web".to_string(),
        )]);
        assert!(attached.applies("shop", "shop", &web));
        assert!(
            !attached.applies("shop", "other", &web),
            "another namespace's"
        );
        assert!(
            !attached.applies("shop", "shop", &BTreeMap::new()),
            "a sidecar"
        );
        let selector = Some(WorkloadSelector::default());
        let both = Attachment {
            selector: &selector,
            ..attached
        };
        assert_eq!(both.validate().unwrap_err().field, "selector");
        let service = [gateway("Service")];
        let waypoint = Attachment {
            selector: &None,
            target_ref: &None,
            target_refs: &service,
        };
        assert_eq!(waypoint.validate().unwrap_err().field, "targetRefs[0].kind");
    }
}
