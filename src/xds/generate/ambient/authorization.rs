//! AuthorizationPolicies and mutual-TLS modes in the L4 form ztunnel enforces
//! (`istio.security.Authorization`), as istiod converts them
//! (pilot/pkg/serviceregistry/ambient/authorization.go, policies.go).
//!
//! ztunnel enforces connections, not requests: a rule naming HTTP attributes cannot be enforced.
//! In an ALLOW policy such a rule is dropped (the policy allows less, never more); in a DENY policy
//! only its HTTP parts are (it denies more, never less). Policies attached to waypoints by
//! `targetRef(s)`, and the CUSTOM and AUDIT actions, are not sent. A STRICT workload references a
//! DENY of every connection without a peer identity; port-level modes become one such policy per
//! distinct set of ports.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;

use prost::Message;

use crate::istio::security::authorization::{Action, AuthorizationPolicy, Condition, Rule};
use crate::istio::security::peer::MtlsMode;
use crate::istio::{ConfigKind, ConfigObject, Spec};
use crate::model::{MeshSnapshot, Workload};
use crate::xds::istio_protos::authorization as pb;
use crate::xds::protocol::AUTHORIZATION_TYPE;
use crate::xds::wire::Resource;

/// istiod's name for the DENY that STRICT workloads reference (in the root namespace).
const STATIC_STRICT: &str = "istio_converted_static_strict";

/// Every policy ztunnel is sent, sorted by name.
pub(super) fn build(mesh: &MeshSnapshot) -> Vec<Arc<Resource>> {
    let root = &mesh.config.mesh().root_namespace;
    let mut out: Vec<(String, pb::Authorization)> = mesh
        .config
        .of_kind(ConfigKind::AuthorizationPolicy)
        .filter_map(|object| convert(object, root))
        .collect();
    for mtls in mtls_policies(mesh) {
        out.push(mtls);
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out.dedup_by(|a, b| a.0 == b.0);
    out.into_iter()
        .map(|(name, policy)| {
            Arc::new(Resource::from_encoded(
                name,
                AUTHORIZATION_TYPE,
                policy.encode_to_vec(),
            ))
        })
        .collect()
}

/// The selector-scoped policies that apply to a workload (`<namespace>/<name>`, sorted): the
/// AuthorizationPolicies of its namespace and the root namespace selecting it, then the mutual-TLS
/// policy of its mode.
pub(super) fn workload_policies(mesh: &MeshSnapshot, workload: &Workload) -> Vec<String> {
    let selected = mesh
        .config
        .security()
        .authorization(&workload.namespace, &workload.labels);
    let applying = selected.allow.iter().chain(&selected.deny);
    let mut names: Vec<String> = applying
        .filter(|(object, policy)| policy.selector.is_some() && sendable(object).is_some())
        .map(|(object, _)| format!("{}/{}", object.key.namespace, object.key.name))
        .collect();
    names.sort();
    if let Some(name) = mtls_policy_name(mesh, workload) {
        names.push(name);
    }
    names
}

/// The policy as ztunnel gets it, if it gets it at all.
fn sendable(object: &ConfigObject) -> Option<&AuthorizationPolicy> {
    let Spec::AuthorizationPolicy(policy) = &object.spec else {
        return None;
    };
    let waypoint = policy.target_ref.is_some() || !policy.target_refs.is_empty();
    let enforceable = matches!(policy.action, Action::Allow | Action::Deny);
    let dry_run = object
        .meta
        .annotations
        .get("istio.io/dry-run")
        .is_some_and(|v| v == "true");
    (!waypoint && enforceable && !dry_run).then_some(policy)
}

fn convert(object: &ConfigObject, root: &str) -> Option<(String, pb::Authorization)> {
    let policy = sendable(object)?;
    let namespace = &*object.key.namespace;
    let scope = match (&policy.selector, namespace == root) {
        (Some(_), _) => pb::Scope::WorkloadSelector,
        (None, true) => pb::Scope::Global,
        (None, false) => pb::Scope::Namespace,
    };
    let action = match policy.action {
        Action::Deny => pb::Action::Deny,
        _ => pb::Action::Allow,
    };
    let rules = policy
        .rules
        .iter()
        .flatten()
        .filter_map(|rule| convert_rule(rule, namespace, policy.action))
        .collect();
    let message = pb::Authorization {
        name: object.key.name.to_string(),
        namespace: namespace.to_string(),
        scope: scope as i32,
        action: action as i32,
        rules,
        ..Default::default()
    };
    Some((format!("{namespace}/{}", object.key.name), message))
}

/// One rule: a clause for its `to`, one for its `from`, one per `when`. None for an ALLOW rule
/// with HTTP attributes (unenforceable: dropped); a DENY rule keeps its L4 parts.
fn convert_rule(rule: &Rule, namespace: &str, action: Action) -> Option<pb::Rule> {
    let mut l7 = false;
    let mut clauses = Vec::new();
    if let Some(to) = rule.to.as_ref().filter(|to| !to.is_empty()) {
        let matches = to
            .iter()
            .map(|to| {
                let op = to.operation.clone().unwrap_or_default();
                l7 |= [
                    &op.hosts,
                    &op.not_hosts,
                    &op.methods,
                    &op.not_methods,
                    &op.paths,
                    &op.not_paths,
                ]
                .iter()
                .any(|v| !v.is_empty());
                pb::Match {
                    destination_ports: ports(&op.ports),
                    not_destination_ports: ports(&op.not_ports),
                    ..Default::default()
                }
            })
            .collect();
        clauses.push(pb::Clause { matches });
    }
    if let Some(from) = rule.from.as_ref().filter(|from| !from.is_empty()) {
        let matches = from
            .iter()
            .map(|from| {
                let source = from.source.clone().unwrap_or_default();
                l7 |= [
                    &source.request_principals,
                    &source.not_request_principals,
                    &source.remote_ip_blocks,
                    &source.not_remote_ip_blocks,
                ]
                .iter()
                .any(|v| !v.is_empty());
                pb::Match {
                    source_ips: cidrs(&source.ip_blocks),
                    not_source_ips: cidrs(&source.not_ip_blocks),
                    namespaces: strings(&source.namespaces),
                    not_namespaces: strings(&source.not_namespaces),
                    service_accounts: accounts(&source.service_accounts, namespace),
                    not_service_accounts: accounts(&source.not_service_accounts, namespace),
                    principals: strings(&source.principals),
                    not_principals: strings(&source.not_principals),
                    ..Default::default()
                }
            })
            .collect();
        clauses.push(pb::Clause { matches });
    }
    for condition in &rule.when {
        match condition_match(condition) {
            Some(m) => clauses.push(pb::Clause { matches: vec![m] }),
            None => l7 = true,
        }
    }
    match (l7, action) {
        (true, Action::Allow) => None,
        _ => Some(pb::Rule { clauses }),
    }
}

/// A `when` on an L4 attribute; None for any other key.
fn condition_match(condition: &Condition) -> Option<pb::Match> {
    let (values, not) = (&condition.values, &condition.not_values);
    let m = match condition.key.as_str() {
        "source.namespace" => pb::Match {
            namespaces: strings(values),
            not_namespaces: strings(not),
            ..Default::default()
        },
        "source.principal" => pb::Match {
            principals: strings(values),
            not_principals: strings(not),
            ..Default::default()
        },
        "source.ip" => pb::Match {
            source_ips: cidrs(values),
            not_source_ips: cidrs(not),
            ..Default::default()
        },
        "destination.ip" => pb::Match {
            destination_ips: cidrs(values),
            not_destination_ips: cidrs(not),
            ..Default::default()
        },
        "destination.port" => pb::Match {
            destination_ports: ports(values),
            not_destination_ports: ports(not),
            ..Default::default()
        },
        _ => return None,
    };
    Some(m)
}

/// Istio's string forms: `*` any non-empty value, `*suffix`, `prefix*`, else exact.
fn strings(values: &[String]) -> Vec<pb::StringMatch> {
    use pb::string_match::MatchType;
    values
        .iter()
        .map(|v| {
            let kind = if v == "*" {
                MatchType::Presence(())
            } else if let Some(suffix) = v.strip_prefix('*') {
                MatchType::Suffix(suffix.to_string())
            } else if let Some(prefix) = v.strip_suffix('*') {
                MatchType::Prefix(prefix.to_string())
            } else {
                MatchType::Exact(v.clone())
            };
            pb::StringMatch {
                match_type: Some(kind),
            }
        })
        .collect()
}

/// `ns/sa`, or a bare `sa` of the policy's namespace. Validation has refused other forms.
fn accounts(values: &[String], namespace: &str) -> Vec<pb::ServiceAccountMatch> {
    values
        .iter()
        .map(|v| {
            let (ns, sa) = v.split_once('/').unwrap_or((namespace, v));
            pb::ServiceAccountMatch {
                namespace: ns.to_string(),
                service_account: sa.to_string(),
            }
        })
        .collect()
}

/// Addresses and CIDRs (validated on acceptance).
fn cidrs(values: &[String]) -> Vec<pb::Address> {
    values
        .iter()
        .filter_map(|v| {
            let (ip, len) = match v.split_once('/') {
                Some((ip, len)) => (ip.parse::<IpAddr>().ok()?, len.parse::<u32>().ok()?),
                None => {
                    let ip = v.parse::<IpAddr>().ok()?;
                    (ip, if ip.is_ipv4() { 32 } else { 128 })
                }
            };
            let address = match ip {
                IpAddr::V4(v4) => v4.octets().to_vec(),
                IpAddr::V6(v6) => v6.octets().to_vec(),
            };
            Some(pb::Address {
                address,
                length: len,
            })
        })
        .collect()
}

/// Port numbers (validated on acceptance).
fn ports(values: &[String]) -> Vec<u32> {
    values
        .iter()
        .filter_map(|p| p.parse::<u16>().ok().map(u32::from))
        .collect()
}

/// The DENY a workload's mutual-TLS settings call for, by name: none when plaintext is allowed
/// on every port; the static STRICT policy; or one that denies plaintext on some ports only.
fn mtls_policy_name(mesh: &MeshSnapshot, workload: &Workload) -> Option<String> {
    let root = &mesh.config.mesh().root_namespace;
    let (strict_ports, open_ports) = mtls_ports(mesh, workload)?;
    Some(match (strict_ports.is_empty(), open_ports.is_empty()) {
        (true, true) => format!("{root}/{STATIC_STRICT}"),
        (true, false) => format!("{root}/{STATIC_STRICT}_except_{}", joined(&open_ports)),
        (false, _) => format!("{root}/{STATIC_STRICT}_ports_{}", joined(&strict_ports)),
    })
}

/// A workload's STRICT exceptions: None when nothing is STRICT; else the ports STRICT where the
/// workload mode is not (empty when it is), and the ports open where it is.
fn mtls_ports(mesh: &MeshSnapshot, workload: &Workload) -> Option<(Vec<u16>, Vec<u16>)> {
    let settings = mesh
        .config
        .security()
        .mtls(&workload.namespace, &workload.labels);
    let strict = settings.mode == MtlsMode::Strict;
    let exceptions: Vec<u16> = settings
        .ports
        .iter()
        .filter(|(_, mode)| (**mode == MtlsMode::Strict) != strict)
        .map(|(port, _)| *port)
        .collect();
    match (strict, exceptions.is_empty()) {
        (true, _) => Some((Vec::new(), exceptions)),
        (false, true) => None,
        (false, false) => Some((exceptions, Vec::new())),
    }
}

fn joined(ports: &[u16]) -> String {
    let ports: Vec<String> = ports.iter().map(u16::to_string).collect();
    ports.join("_")
}

/// The mutual-TLS DENYs the mesh's workloads reference.
fn mtls_policies(mesh: &MeshSnapshot) -> Vec<(String, pb::Authorization)> {
    let root = &mesh.config.mesh().root_namespace;
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for workload in mesh.workloads.iter() {
        let Some((strict_ports, open_ports)) = mtls_ports(mesh, workload) else {
            continue;
        };
        let Some(name) = mtls_policy_name(mesh, workload) else {
            continue;
        };
        if !seen.insert(name.clone()) {
            continue;
        }
        let plaintext = pb::Match {
            not_principals: strings(&["*".to_string()]),
            destination_ports: strict_ports.iter().map(|p| u32::from(*p)).collect(),
            not_destination_ports: open_ports.iter().map(|p| u32::from(*p)).collect(),
            ..Default::default()
        };
        let local_name = name.rsplit_once('/').map_or(name.as_str(), |(_, n)| n);
        let policy = pb::Authorization {
            name: local_name.to_string(),
            namespace: root.clone(),
            scope: pb::Scope::WorkloadSelector as i32,
            action: pb::Action::Deny as i32,
            rules: vec![pb::Rule {
                clauses: vec![pb::Clause {
                    matches: vec![plaintext],
                }],
            }],
            ..Default::default()
        };
        out.push((name, policy));
    }
    out
}
