//! Kubernetes' LabelSelector (`matchLabels` and `matchExpressions`, ANDed), as the mesh config's
//! `discoverySelectors` use it (ORed), with the label selector query syntax the API server reads, so
//! a watch can select on the server.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::validate::{ensure, Result};
use crate::text::Quoted;

// Unknown fields refused: a misspelt `matchLabels` would otherwise leave an empty selector, which
// selects every namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default, deny_unknown_fields)]
pub struct LabelSelector {
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub match_labels: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub match_expressions: Vec<Requirement>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
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

    /// Kubernetes' rules: label keys and values of its syntax (which also keeps the query sent to
    /// the API server meaning what the selector says), known operators, values exactly where they
    /// need them.
    pub fn validate(&self) -> Result {
        for (key, value) in &self.match_labels {
            let field = format!("matchLabels.{key}");
            check_key(key, &field)?;
            check_value(value, &field)?;
        }
        for (i, r) in self.match_expressions.iter().enumerate() {
            let field = format!("matchExpressions[{i}]");
            check_key(&r.key, &field)?;
            for value in &r.values {
                check_value(value, &field)?;
            }
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

/// A label key: an optional DNS subdomain prefix and `/`, then a name.
fn check_key(key: &str, field: &str) -> Result {
    let (prefix, name) = match key.split_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    let prefix_ok = prefix.is_none_or(|p| {
        p.len() <= 253
            && p.split('.').all(|part| {
                !part.is_empty()
                    && part
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                    && !part.starts_with('-')
                    && !part.ends_with('-')
            })
    });
    ensure(
        prefix_ok && !name.is_empty() && is_label_text(name),
        field,
        format!("label key {} is not a Kubernetes label key", Quoted(key)),
    )
}

fn check_value(value: &str, field: &str) -> Result {
    ensure(
        value.is_empty() || is_label_text(value),
        field,
        format!(
            "label value {} is not a Kubernetes label value",
            Quoted(value)
        ),
    )
}

/// At most 63 characters of `[A-Za-z0-9._-]`, alphanumeric at both ends.
fn is_label_text(text: &str) -> bool {
    let alnum = |c: char| c.is_ascii_alphanumeric();
    text.len() <= 63
        && text.starts_with(alnum)
        && text.ends_with(alnum)
        && text
            .chars()
            .all(|c| alnum(c) || matches!(c, '-' | '_' | '.'))
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

    #[test]
    fn keys_and_values_follow_kubernetes_syntax() {
        for good in [
            "{matchLabels: {istio.io/rev: canary, app.kubernetes.io/part-of: shop_1.2}}",
            "{matchLabels: {team: ''}}",
            "{matchExpressions: [{key: a-b, operator: In, values: [x, Y-2]}]}",
        ] {
            assert_eq!(selector(good).validate(), Ok(()), "{good}");
        }
        // A comma or a parenthesis would change what the query sent to the API server selects.
        for (bad, field) in [
            ("{matchLabels: {mesh: 'on,team'}}", "matchLabels.mesh"),
            ("{matchLabels: {'a b': x}}", "matchLabels.a b"),
            (
                "{matchLabels: {Example.com/a: x}}",
                "matchLabels.Example.com/a",
            ),
            ("{matchLabels: {a/: x}}", "matchLabels.a/"),
            (
                "{matchExpressions: [{key: a, operator: In, values: ['x)']}]}",
                "matchExpressions[0]",
            ),
            (
                "{matchExpressions: [{key: '', operator: Exists}]}",
                "matchExpressions[0]",
            ),
        ] {
            assert_eq!(selector(bad).validate().unwrap_err().field, field, "{bad}");
        }
        let long = format!("{{matchLabels: {{a: {}}}}}", "x".repeat(64));
        assert!(selector(&long).validate().is_err());
    }

    #[test]
    fn a_misspelt_field_is_refused_rather_than_selecting_everything() {
        for typo in [
            "{matchLabel: {mesh: 'on'}}",
            "{matchExpressions: [{key: a, operator: In, value: [x]}]}",
        ] {
            let e = serde_yaml_ng::from_str::<LabelSelector>(typo).unwrap_err();
            assert!(e.to_string().contains("unknown field"), "{typo}: {e}");
        }
    }
}
