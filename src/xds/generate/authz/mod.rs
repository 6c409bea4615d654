//! AuthorizationPolicy → Envoy's RBAC filters (and ext_authz for CUSTOM), as istiod builds them, for
//! any HTTP connection manager or TCP filter chain of a workload: the sidecar's inbound listener
//! today, gateways' listeners when they come.
//!
//! Order (istiod's): CUSTOM (RBAC marking matched requests, then ext_authz), then — after JWT
//! authentication — AUDIT, DENY and ALLOW. RBAC policies are named `ns[<ns>]-policy[<name>]-rule[<i>]`.

mod ext_authz;
mod matchers;
mod rules;

use std::collections::{BTreeMap, BTreeSet};

use envoy_types::pb::envoy::config::listener::v3::Filter;
use envoy_types::pb::envoy::config::rbac::v3::{rbac, Rbac};
use envoy_types::pb::envoy::extensions::filters::http::rbac::v3::Rbac as HttpRbac;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_filter, HttpFilter,
};
use envoy_types::pb::envoy::extensions::filters::network::rbac::v3::Rbac as NetworkRbac;
use envoy_types::util::pack_any;
use tracing::warn;

use self::ext_authz::{HTTP_RBAC, MATCH_PREFIX, NETWORK_RBAC, SHADOW_PREFIX};
use self::rules::Translation;
pub use self::rules::PEER_PRINCIPAL_STATE;
use super::filters::network_filter;
use crate::model::policies::{Selected, SelectedAuthorization};
use crate::model::MeshSnapshot;

pub use self::matchers::{JWT_FILTER, JWT_PAYLOAD};

/// `istio.io/dry-run: "true"`: the policy is evaluated and counted, never enforced.
const DRY_RUN: &str = "istio.io/dry-run";
/// What the policies of a CUSTOM action become when the provider cannot be used: deny.
const BAD_CUSTOM_SUFFIX: &str = "-deny-due-to-bad-CUSTOM-action";

/// A workload's authorization policies, ready to become filters.
pub struct Authorization<'a> {
    mesh: &'a MeshSnapshot,
    selected: SelectedAuthorization<'a>,
    trust_domains: Vec<String>,
    /// Behind a waypoint's tunnel: the peer is read from the filter state its end shared.
    peer_from_filter_state: bool,
}

/// Enforced rules and dry-run (shadow) rules of one action.
struct Built {
    enforce: Option<Rbac>,
    shadow: Option<Rbac>,
}

impl<'a> Authorization<'a> {
    pub fn for_workload(
        mesh: &'a MeshSnapshot,
        namespace: &str,
        labels: &BTreeMap<String, String>,
    ) -> Self {
        let selected = mesh.config.security().authorization(namespace, labels);
        Self::new(mesh, selected, false)
    }

    /// A waypoint's: the policies targeting its Gateway, enforced on what its tunnels carry.
    pub fn for_waypoint(
        mesh: &'a MeshSnapshot,
        namespace: &str,
        labels: &BTreeMap<String, String>,
    ) -> Self {
        let policies = mesh.config.security();
        let selected = policies.waypoint_authorization(namespace, labels);
        Self::new(mesh, selected, true)
    }

    fn new(
        mesh: &'a MeshSnapshot,
        selected: SelectedAuthorization<'a>,
        peer_from_filter_state: bool,
    ) -> Self {
        let config = mesh.config.mesh();
        let mut trust_domains = vec![config.trust_domain.clone()];
        trust_domains.extend(
            config
                .trust_domain_aliases
                .iter()
                .filter(|a| **a != config.trust_domain)
                .cloned(),
        );
        Self {
            mesh,
            selected,
            trust_domains,
            peer_from_filter_state,
        }
    }

    /// CUSTOM filters for an HTTP connection manager (they go before authentication).
    pub fn custom_http_filters(&self) -> Vec<HttpFilter> {
        let Some(custom) = self.custom(false) else {
            return Vec::new();
        };
        match custom {
            Custom::Deny(rules) => vec![http_rbac(Some(rules), None, "")],
            Custom::Provider { rules, ext_authz } => vec![
                // Shadow rules mark the requests a CUSTOM rule matches; ext_authz runs on those.
                http_rbac(None, Some(rules), SHADOW_PREFIX),
                http_filter("envoy.filters.http.ext_authz", pack_any(ext_authz.http)),
            ],
        }
    }

    /// CUSTOM filters for a TCP chain: over gRPC only (an HTTP provider cannot check TCP).
    pub fn custom_network_filters(&self) -> Vec<Filter> {
        let Some(custom) = self.custom(true) else {
            return Vec::new();
        };
        match custom {
            Custom::Deny(rules) => vec![network_rbac(Some(rules), None, "")],
            Custom::Provider { rules, ext_authz } => match ext_authz.tcp {
                Some(tcp) => vec![
                    network_rbac(None, Some(rules), SHADOW_PREFIX),
                    network_filter("envoy.filters.network.ext_authz", pack_any(tcp)),
                ],
                None => Vec::new(),
            },
        }
    }

    /// AUDIT, DENY and ALLOW filters for an HTTP connection manager (after authentication).
    pub fn http_filters(&self) -> Vec<HttpFilter> {
        self.actions(false)
            .into_iter()
            .map(|(built, prefix)| http_rbac(built.enforce, built.shadow, prefix))
            .collect()
    }

    /// AUDIT, DENY and ALLOW filters for a TCP chain.
    pub fn network_filters(&self) -> Vec<Filter> {
        self.actions(true)
            .into_iter()
            .map(|(built, prefix)| network_rbac(built.enforce, built.shadow, prefix))
            .collect()
    }

    /// The non-CUSTOM actions in filter order, with their dry-run stat prefix.
    fn actions(&self, for_tcp: bool) -> Vec<(Built, &'static str)> {
        [
            (&self.selected.audit, rbac::Action::Log, ""),
            (
                &self.selected.deny,
                rbac::Action::Deny,
                "istio_dry_run_deny_",
            ),
            (
                &self.selected.allow,
                rbac::Action::Allow,
                "istio_dry_run_allow_",
            ),
        ]
        .into_iter()
        .filter_map(|(policies, action, prefix)| {
            Some((self.build(policies, action, for_tcp, "")?, prefix))
        })
        .collect()
    }

    fn build(
        &self,
        policies: &[Selected<'_>],
        action: rbac::Action,
        for_tcp: bool,
        name_prefix: &str,
    ) -> Option<Built> {
        if policies.is_empty() {
            return None;
        }
        let empty = || Rbac {
            action: action as i32,
            ..Default::default()
        };
        let mut built = Built {
            enforce: None,
            shadow: None,
        };
        for (object, policy) in policies {
            let target = match object.meta.annotations.get(DRY_RUN).map(String::as_str) {
                Some("true") => built.shadow.get_or_insert_with(empty),
                _ => built.enforce.get_or_insert_with(empty),
            };
            let key = &object.key;
            let name = |i: usize| {
                format!(
                    "{name_prefix}ns[{}]-policy[{}]-rule[{i}]",
                    key.namespace, key.name
                )
            };
            let translation = Translation {
                for_tcp,
                strict: action == rbac::Action::Allow,
                namespace: &key.namespace,
                trust_domains: &self.trust_domains,
                peer_from_filter_state: self.peer_from_filter_state,
            };
            for (i, rule) in policy.rules().iter().enumerate() {
                if let Some(generated) = rules::policy(rule, &translation) {
                    target.policies.insert(name(i), generated);
                }
            }
            if policy.rules().is_empty() {
                target.policies.insert(name(0), rules::never());
            }
        }
        Some(built)
    }

    /// The CUSTOM policies with their provider, or deny rules when it cannot be used. Dry-run
    /// CUSTOM policies never call the provider.
    fn custom(&self, for_tcp: bool) -> Option<Custom> {
        let policies = &self.selected.custom;
        let prefix = format!("{MATCH_PREFIX}-");
        let rules = self
            .build(policies, rbac::Action::Deny, for_tcp, &prefix)?
            .enforce?;
        let providers: BTreeSet<&str> = policies
            .iter()
            .filter_map(|(_, p)| p.provider.as_ref().map(|p| p.name.as_str()))
            .collect();
        let resolved = match providers.first() {
            Some(name) if providers.len() == 1 => ext_authz::resolve(self.mesh, name),
            _ => Err(format!(
                "only 1 provider can be used per workload, found {providers:?}"
            )),
        };
        Some(match resolved {
            Ok(ext_authz) => Custom::Provider {
                rules,
                ext_authz: Box::new(ext_authz),
            },
            Err(error) => {
                let names: Vec<String> = policies.iter().map(|(o, _)| o.key.to_string()).collect();
                warn!(policies = ?names, %error, "CUSTOM authorization cannot use its provider: denying what it matches");
                Custom::Deny(Rbac {
                    action: rbac::Action::Deny as i32,
                    policies: rules
                        .policies
                        .into_iter()
                        .map(|(name, policy)| (format!("{name}{BAD_CUSTOM_SUFFIX}"), policy))
                        .collect(),
                    ..Default::default()
                })
            }
        })
    }
}

enum Custom {
    Deny(Rbac),
    Provider {
        rules: Rbac,
        ext_authz: Box<ext_authz::ExtAuthz>,
    },
}

fn http_filter(name: &str, config: envoy_types::pb::google::protobuf::Any) -> HttpFilter {
    HttpFilter {
        name: name.into(),
        config_type: Some(http_filter::ConfigType::TypedConfig(config)),
        ..Default::default()
    }
}

fn http_rbac(rules: Option<Rbac>, shadow: Option<Rbac>, shadow_prefix: &str) -> HttpFilter {
    let prefix = match shadow {
        Some(_) => shadow_prefix.to_string(),
        None => String::new(),
    };
    http_filter(
        HTTP_RBAC,
        pack_any(HttpRbac {
            rules,
            shadow_rules: shadow,
            shadow_rules_stat_prefix: prefix,
            ..Default::default()
        }),
    )
}

fn network_rbac(rules: Option<Rbac>, shadow: Option<Rbac>, shadow_prefix: &str) -> Filter {
    let prefix = match shadow {
        Some(_) => shadow_prefix.to_string(),
        None => String::new(),
    };
    network_filter(
        NETWORK_RBAC,
        pack_any(NetworkRbac {
            rules,
            stat_prefix: "tcp.".into(),
            shadow_rules: shadow,
            shadow_rules_stat_prefix: prefix,
            ..Default::default()
        }),
    )
}
