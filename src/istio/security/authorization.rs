//! AuthorizationPolicy: which requests and connections a workload accepts.

use serde::{Deserialize, Serialize};

use super::{non_empty_values, Attachment, PolicyTargetRef, WorkloadSelector};
use crate::istio::validate::{ensure, Result, ValidationError};
use crate::text::{clip, Quoted};

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct AuthorizationPolicy {
    pub selector: Option<WorkloadSelector>,
    /// Gateway API attachment: such policies apply to the targeted Gateway's proxies, never to
    /// sidecars.
    pub target_ref: Option<PolicyTargetRef>,
    pub target_refs: Vec<PolicyTargetRef>,
    /// None and empty alike: no rules (an ALLOW policy then allows nothing).
    pub rules: Option<Vec<Rule>>,
    pub action: Action,
    /// The ext_authz provider (mesh config `extensionProviders`) of a CUSTOM policy.
    pub provider: Option<Provider>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Action {
    #[default]
    Allow,
    Deny,
    Audit,
    Custom,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default)]
pub struct Provider {
    pub name: String,
}

/// Matches when every present part matches: any of `from`, any of `to`, all of `when`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default)]
pub struct Rule {
    pub from: Option<Vec<From>>,
    pub to: Option<Vec<To>>,
    pub when: Vec<Condition>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default)]
pub struct From {
    pub source: Option<Source>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Source {
    pub principals: Vec<String>,
    pub not_principals: Vec<String>,
    pub request_principals: Vec<String>,
    pub not_request_principals: Vec<String>,
    pub namespaces: Vec<String>,
    pub not_namespaces: Vec<String>,
    pub service_accounts: Vec<String>,
    pub not_service_accounts: Vec<String>,
    pub ip_blocks: Vec<String>,
    pub not_ip_blocks: Vec<String>,
    pub remote_ip_blocks: Vec<String>,
    pub not_remote_ip_blocks: Vec<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default)]
pub struct To {
    pub operation: Option<Operation>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Operation {
    pub hosts: Vec<String>,
    pub not_hosts: Vec<String>,
    /// Port numbers as strings, as in Istio's API.
    pub ports: Vec<String>,
    pub not_ports: Vec<String>,
    pub methods: Vec<String>,
    pub not_methods: Vec<String>,
    pub paths: Vec<String>,
    pub not_paths: Vec<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Condition {
    pub key: String,
    pub values: Vec<String>,
    pub not_values: Vec<String>,
}

/// Path template operators: one segment, and any number of trailing segments.
pub const MATCH_ONE: &str = "{*}";
pub const MATCH_ANY: &str = "{**}";

impl AuthorizationPolicy {
    /// The rules, empty when there are none.
    pub fn rules(&self) -> &[Rule] {
        self.rules.as_deref().unwrap_or_default()
    }

    /// How it attaches: by selector (or namespace) or by Gateway API target.
    pub fn attachment(&self) -> Attachment<'_> {
        Attachment {
            selector: &self.selector,
            target_ref: &self.target_ref,
            target_refs: &self.target_refs,
        }
    }

    pub fn validate(&self) -> Result {
        self.attachment().validate()?;
        let no_rules = self.rules().is_empty();
        match self.action {
            Action::Custom => {
                ensure(
                    !no_rules,
                    "rules",
                    "CUSTOM action without `rules` is meaningless as it will never be triggered, \
                     add an empty rule `{}` if you want it be triggered for every request",
                )?;
                ensure(
                    self.provider.as_ref().is_some_and(|p| !p.name.is_empty()),
                    "provider.name",
                    "must not be empty",
                )?;
                for (i, rule) in self.rules().iter().enumerate() {
                    rule.check_custom()
                        .map_err(|e| e.under(&format!("rules[{i}]")))?;
                }
            }
            action => {
                ensure(
                    self.provider.is_none(),
                    "provider",
                    format!("must not be with non CUSTOM action, found {action:?}"),
                )?;
                ensure(
                    !(action == Action::Deny && no_rules),
                    "rules",
                    "DENY action without `rules` is meaningless as it will never be triggered, \
                     add an empty rule `{}` if you want it be triggered for every request",
                )?;
            }
        }
        for (i, rule) in self.rules().iter().enumerate() {
            rule.validate()
                .map_err(|e| e.under(&format!("rules[{i}]")))?;
        }
        Ok(())
    }
}

impl Rule {
    fn validate(&self) -> Result {
        if let Some(from) = &self.from {
            ensure(!from.is_empty(), "from", "must not be empty")?;
            for (i, from) in from.iter().enumerate() {
                let at = format!("from[{i}].source");
                let source = from
                    .source
                    .as_ref()
                    .ok_or_else(|| ValidationError::at(&at, "must not be nil"))?;
                source.validate().map_err(|e| e.under(&at))?;
            }
        }
        if let Some(to) = &self.to {
            ensure(!to.is_empty(), "to", "must not be empty")?;
            for (i, to) in to.iter().enumerate() {
                let at = format!("to[{i}].operation");
                let operation = to
                    .operation
                    .as_ref()
                    .ok_or_else(|| ValidationError::at(&at, "must not be nil"))?;
                operation.validate().map_err(|e| e.under(&at))?;
            }
        }
        for (i, condition) in self.when.iter().enumerate() {
            condition
                .validate()
                .map_err(|e| e.under(&format!("when[{i}]")))?;
        }
        Ok(())
    }

    /// CUSTOM rules are evaluated before authentication: no identities in them.
    fn check_custom(&self) -> Result {
        for (i, from) in self.from.iter().flatten().enumerate() {
            let Some(s) = &from.source else { continue };
            let identities = [
                ("namespaces", &s.namespaces),
                ("notNamespaces", &s.not_namespaces),
                ("serviceAccounts", &s.service_accounts),
                ("notServiceAccounts", &s.not_service_accounts),
                ("principals", &s.principals),
                ("notPrincipals", &s.not_principals),
                ("requestPrincipals", &s.request_principals),
                ("notRequestPrincipals", &s.not_request_principals),
            ];
            for (name, values) in identities {
                ensure(
                    values.is_empty(),
                    &format!("from[{i}].source.{name}"),
                    "is currently not supported with CUSTOM action",
                )?;
            }
        }
        for (i, when) in self.when.iter().enumerate() {
            let identity = matches!(
                when.key.as_str(),
                "source.namespace" | "source.serviceAccount" | "source.principal"
            ) || when.key.starts_with("request.auth.");
            ensure(
                !identity,
                &format!("when[{i}].key"),
                format!(
                    "{} is currently not supported with CUSTOM action",
                    clip(&when.key)
                ),
            )?;
        }
        Ok(())
    }
}

impl Source {
    fn validate(&self) -> Result {
        let identities = self.principals.len()
            + self.not_principals.len()
            + self.namespaces.len()
            + self.not_namespaces.len();
        let accounts = self.service_accounts.len() + self.not_service_accounts.len();
        ensure(
            identities == 0 || accounts == 0,
            "serviceAccounts",
            "cannot set serviceAccounts with namespaces or principals",
        )?;
        let fields = [
            ("principals", &self.principals),
            ("notPrincipals", &self.not_principals),
            ("requestPrincipals", &self.request_principals),
            ("notRequestPrincipals", &self.not_request_principals),
            ("namespaces", &self.namespaces),
            ("notNamespaces", &self.not_namespaces),
            ("serviceAccounts", &self.service_accounts),
            ("notServiceAccounts", &self.not_service_accounts),
            ("ipBlocks", &self.ip_blocks),
            ("notIpBlocks", &self.not_ip_blocks),
            ("remoteIpBlocks", &self.remote_ip_blocks),
            ("notRemoteIpBlocks", &self.not_remote_ip_blocks),
        ];
        ensure(
            fields.iter().any(|(_, v)| !v.is_empty()),
            "",
            "must not be empty",
        )?;
        for (name, values) in fields {
            non_empty_values(name, values)?;
        }
        for (name, values) in [
            ("ipBlocks", &self.ip_blocks),
            ("notIpBlocks", &self.not_ip_blocks),
            ("remoteIpBlocks", &self.remote_ip_blocks),
            ("notRemoteIpBlocks", &self.not_remote_ip_blocks),
        ] {
            validate_ips(name, values)?;
        }
        validate_service_accounts("serviceAccounts", &self.service_accounts)?;
        validate_service_accounts("notServiceAccounts", &self.not_service_accounts)
    }
}

impl Operation {
    fn validate(&self) -> Result {
        let fields = [
            ("hosts", &self.hosts),
            ("notHosts", &self.not_hosts),
            ("ports", &self.ports),
            ("notPorts", &self.not_ports),
            ("methods", &self.methods),
            ("notMethods", &self.not_methods),
            ("paths", &self.paths),
            ("notPaths", &self.not_paths),
        ];
        ensure(
            fields.iter().any(|(_, v)| !v.is_empty()),
            "",
            "must not be empty",
        )?;
        for (name, values) in fields {
            non_empty_values(name, values)?;
        }
        validate_ports("ports", &self.ports)?;
        validate_ports("notPorts", &self.not_ports)?;
        validate_path_templates("paths", &self.paths)?;
        validate_path_templates("notPaths", &self.not_paths)
    }
}

impl Condition {
    fn validate(&self) -> Result {
        ensure(!self.key.is_empty(), "key", "must not be empty")?;
        ensure(
            !(self.values.is_empty() && self.not_values.is_empty()),
            "values",
            format!(
                "at least one of `values` or `notValues` must be set for key {}",
                clip(&self.key)
            ),
        )?;
        for (field, values) in [("values", &self.values), ("notValues", &self.not_values)] {
            non_empty_values(field, values)?;
            validate_attribute(&self.key, values).map_err(|e| e.under(field))?;
        }
        Ok(())
    }
}

/// The `when` keys Istio knows, with their value rules.
fn validate_attribute(key: &str, values: &[String]) -> Result {
    let map_key = |prefix: &str| -> Result {
        let rest = &key[prefix.len()..];
        let ok = rest.len() > 2 && rest.starts_with('[') && rest.ends_with(']');
        ensure(
            ok,
            "",
            format!("bad key ({}): should have format a[b]", clip(key)),
        )
    };
    match key {
        "source.ip" | "remote.ip" | "destination.ip" => validate_ips("", values),
        "destination.port" => validate_ports("", values),
        "source.serviceAccount" => validate_service_accounts("", values),
        "source.namespace"
        | "source.principal"
        | "request.auth.principal"
        | "request.auth.audiences"
        | "request.auth.presenter"
        | "connection.sni" => Ok(()),
        k if k.starts_with("request.headers") => map_key("request.headers"),
        k if k.starts_with("request.auth.claims") => map_key("request.auth.claims"),
        k if k.starts_with("experimental.envoy.filters.") => map_key("experimental.envoy.filters."),
        "destination.namespace" => Err(ValidationError::at(
            "",
            format!("attribute {key} is replaced by the metadata.namespace"),
        )),
        k if k.starts_with("destination.labels") => Err(ValidationError::at(
            "",
            format!(
                "attribute {} is replaced by the workload selector",
                clip(key)
            ),
        )),
        _ => Err(ValidationError::at(
            "",
            format!("unknown attribute: {}", clip(key)),
        )),
    }
}

fn validate_ips(field: &str, values: &[String]) -> Result {
    for (i, v) in values.iter().enumerate() {
        let ok = match v.contains('/') {
            true => v.parse::<ipnet::IpNet>().is_ok(),
            false => v.parse::<std::net::IpAddr>().is_ok(),
        };
        ensure(
            ok,
            &format!("{field}[{i}]"),
            format!("bad IP address or CIDR range ({})", clip(v)),
        )?;
    }
    Ok(())
}

fn validate_ports(field: &str, values: &[String]) -> Result {
    for (i, v) in values.iter().enumerate() {
        ensure(
            v.parse::<u16>().is_ok(),
            &format!("{field}[{i}]"),
            format!("bad port ({})", clip(v)),
        )?;
    }
    Ok(())
}

/// `serviceAccount` or `namespace/serviceAccount`, no wildcards, at most 16.
fn validate_service_accounts(field: &str, values: &[String]) -> Result {
    ensure(
        values.len() <= 16,
        field,
        "may not have more than 16 values",
    )?;
    for (i, v) in values.iter().enumerate() {
        let at = format!("{field}[{i}]");
        ensure(!v.contains('*'), &at, "wildcard not allowed")?;
        ensure(v.len() <= 320, &at, "value cannot exceed 320 characters")?;
        let parts: Vec<&str> = v.split('/').collect();
        ensure(
            parts.len() <= 2 && parts.iter().all(|p| !p.is_empty()),
            &at,
            format!(
                "expected format 'serviceAccount' or 'namespace/serviceAccount', found {}",
                Quoted(v)
            ),
        )?;
    }
    Ok(())
}

/// `{*}` and `{**}` stand for whole segments, `{**}` last; other segments of a template are plain
/// path characters.
fn validate_path_templates(field: &str, paths: &[String]) -> Result {
    for (i, path) in paths.iter().enumerate() {
        let template = path.contains(MATCH_ONE) || path.contains(MATCH_ANY);
        let mut seen_any = false;
        for segment in path.trim_matches('/').split('/') {
            let bad = |why: &str| {
                Err(ValidationError::at(
                    format!("{field}[{i}]"),
                    format!("invalid or unsupported path {}: {why}", clip(path)),
                ))
            };
            if segment == MATCH_ONE || segment == MATCH_ANY {
                if seen_any {
                    return bad("{**} is not the last operator");
                }
                seen_any = segment == MATCH_ANY;
                continue;
            }
            if segment.contains(['{', '}']) {
                return bad("contains '{' or '}' beyond a supported path template");
            }
            let literal = !segment.is_empty()
                && segment
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-._~%!$&'()+,;:@=".contains(c));
            if template && !literal {
                return bad(&format!(
                    "contains segment {} with invalid string literal",
                    clip(segment)
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(yaml: &str) -> AuthorizationPolicy {
        let value: serde_json::Value = serde_yaml_ng::from_str(yaml).unwrap();
        serde_json::from_value(value).unwrap()
    }

    fn error(yaml: &str) -> ValidationError {
        parse(yaml).validate().unwrap_err()
    }

    #[test]
    fn empty_policies_follow_istio() {
        assert!(parse("{}").validate().is_ok(), "ALLOW nothing");
        assert_eq!(error("action: DENY").field, "rules");
        assert!(
            parse("action: DENY\nrules: [{}]").validate().is_ok(),
            "DENY all"
        );
        assert_eq!(error("action: CUSTOM\nrules: [{}]").field, "provider.name");
        assert_eq!(
            error("action: AUDIT\nprovider: {name: x}\nrules: [{}]").field,
            "provider"
        );
    }

    #[test]
    fn errors_name_the_field() {
        let e = error("rules: [{from: [{source: {ipBlocks: [10.0.0.0/33]}}]}]");
        assert_eq!(e.field, "rules[0].from[0].source.ipBlocks[0]");
        let e = error("rules: [{to: [{operation: {ports: [http]}}]}]");
        assert_eq!(e.field, "rules[0].to[0].operation.ports[0]");
        let e = error("rules: [{from: [{source: {}}]}]");
        assert_eq!(e.field, "rules[0].from[0].source");
        let e = error("rules: [{when: [{key: 'destination.labels[app]', values: [a]}]}]");
        assert_eq!(e.field, "rules[0].when[0].values");
        let e = error("rules: [{when: [{key: request.headers, values: [a]}]}]");
        assert!(e.message.contains("a[b]"), "{e}");
        let e = error("rules: [{to: [{operation: {paths: ['/a/{**}/b/{*}']}}]}]");
        assert_eq!(e.field, "rules[0].to[0].operation.paths[0]");
        let e = error(
            "action: CUSTOM\nprovider: {name: x}\nrules: [{from: [{source: {principals: [a]}}]}]",
        );
        assert_eq!(e.field, "rules[0].from[0].source.principals");
        let e = error("rules: [{from: [{source: {namespaces: [a], serviceAccounts: [b]}}]}]");
        assert_eq!(e.field, "rules[0].from[0].source.serviceAccounts");
    }

    #[test]
    fn full_rules_validate() {
        let policy = parse(
            "
action: ALLOW
rules:
- from: [{source: {principals: [cluster.local/ns/a/sa/b], notNamespaces: [x], ipBlocks: [10.0.0.1, 10.1.0.0/16]}}]
  to: [{operation: {methods: [GET], paths: ['/api/{*}/items', /static*], ports: ['8080']}}]
  when:
  - {key: 'request.auth.claims[groups]', values: [admin]}
  - {key: source.ip, notValues: [10.0.0.9]}
  - {key: destination.port, values: ['8080']}
",
        );
        assert!(policy.validate().is_ok(), "{:?}", policy.validate());
    }
}
