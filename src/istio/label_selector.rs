//! Kubernetes' LabelSelector (`matchLabels` and `matchExpressions`, ANDed), as the mesh config's
//! `discoverySelectors` use it (ORed), with the label selector query syntax the API server reads, so
//! a watch can select on the server.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::validate::{ensure, Result};
use crate::text::Quoted;

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct LabelSelector {
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub match_labels: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub match_expressions: Vec<Requirement>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(default)]
pub struct Requirement {
    pub key: String,
    pub operator: String,
    pub values: Vec<String>,
}

impl LabelSelector {
    /// Whether labels satisfy every requirement (an empty selector: any labels).
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.match_labels
            .iter()
            .all(|(k, v)| labels.get(k) == Some(v))
            && self.match_expressions.iter().all(|r| {
                let value = labels.get(&r.key);
                match r.operator.as_str() {
                    "In" => value.is_some_and(|v| r.values.contains(v)),
                    "NotIn" => value.is_none_or(|v| !r.values.contains(v)),
                    "Exists" => value.is_some(),
                    "DoesNotExist" => value.is_none(),
                    _ => false,
                }
            })
    }

    /// The selector in the API server's `labelSelector` syntax (`a=b,c in (d,e),!f`).
    pub fn to_query(&self) -> String {
        let labels = self.match_labels.iter().map(|(k, v)| format!("{k}={v}"));
        let expressions = self.match_expressions.iter().map(|r| {
            let values = r.values.join(",");
            match r.operator.as_str() {
                "In" => format!("{} in ({values})", r.key),
                "NotIn" => format!("{} notin ({values})", r.key),
                "Exists" => r.key.clone(),
                _ => format!("!{}", r.key),
            }
        });
        labels.chain(expressions).collect::<Vec<_>>().join(",")
    }

    /// Kubernetes' rules: known operators, values exactly where they need them.
    pub fn validate(&self) -> Result {
        for (i, r) in self.match_expressions.iter().enumerate() {
            let field = format!("matchExpressions[{i}]");
            ensure(!r.key.is_empty(), &field, "a requirement names its key")?;
            match r.operator.as_str() {
                "In" | "NotIn" => ensure(
                    !r.values.is_empty(),
                    &field,
                    format!("{} needs values", r.operator),
                )?,
                "Exists" | "DoesNotExist" => ensure(
                    r.values.is_empty(),
                    &field,
                    format!("{} takes no values", r.operator),
                )?,
                other => {
                    return Err(super::ValidationError::at(
                        &field,
                        format!(
                            "operator {} is not In, NotIn, Exists or DoesNotExist",
                            Quoted(other)
                        ),
                    ))
                }
            }
        }
        Ok(())
    }
}

/// Whether any of `selectors` matches (istiod's discovery selectors: none means every namespace).
pub fn any_matches(selectors: &[LabelSelector], labels: &BTreeMap<String, String>) -> bool {
    selectors.is_empty() || selectors.iter().any(|s| s.matches(labels))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn selector(yaml: &str) -> LabelSelector {
        serde_yaml_ng::from_str(yaml).unwrap()
    }

    #[test]
    fn requirements_and_together_selectors_or() {
        let team = selector("{matchLabels: {team: a}, matchExpressions: [{key: env, operator: In, values: [prod, stage]}]}");
        let labels = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        assert!(team.matches(&labels(&[("team", "a"), ("env", "prod")])));
        assert!(!team.matches(&labels(&[("team", "a"), ("env", "dev")])));
        let mesh = selector("{matchExpressions: [{key: istio-discovery, operator: Exists}]}");
        let selectors = [team.clone(), mesh.clone()];
        assert!(any_matches(&selectors, &labels(&[("istio-discovery", "")])));
        assert!(!any_matches(&selectors, &labels(&[("team", "b")])));
        assert!(any_matches(&[], &labels(&[])));
        assert!(any_matches(&[LabelSelector::default()], &labels(&[])));
        assert_eq!(team.to_query(), "team=a,env in (prod,stage)");
        assert_eq!(mesh.to_query(), "istio-discovery");
        let bad = selector("{matchExpressions: [{key: a, operator: Has}]}");
        assert_eq!(bad.validate().unwrap_err().field, "matchExpressions[0]");
    }
}
