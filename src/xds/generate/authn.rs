//! RequestAuthentication → Envoy's jwt_authn filter, as istiod builds it: one provider per JWT rule
//! (`origins-<i>`, by issuer) with its keys inlined, a token that is present must verify with one
//! of them, an absent one passes (an AuthorizationPolicy may then require a request principal).
//! The verified payload goes to dynamic metadata (`payload`) where RBAC reads claims.

use std::collections::{BTreeSet, HashMap};

use envoy_types::pb::envoy::config::core::v3::{data_source, DataSource};
use envoy_types::pb::envoy::config::route::v3::{route_match, RouteMatch};
use envoy_types::pb::envoy::extensions::filters::http::jwt_authn::v3::{
    jwt_provider, jwt_requirement, requirement_rule, JwtAuthentication, JwtClaimToHeader,
    JwtHeader, JwtProvider, JwtRequirement, JwtRequirementAndList, JwtRequirementOrList,
    RequirementRule,
};
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_filter, HttpFilter,
};
use envoy_types::util::pack_any;

use super::authz::{JWT_FILTER, JWT_PAYLOAD};
use crate::istio::security::request::JwtRule;
use crate::model::JwksTable;

/// Claims whose space-separated values RBAC sees as lists, besides those a rule names.
const SPACE_DELIMITED: [&str; 2] = ["permission", "scope"];

/// The jwt_authn filter for these rules (sorted by issuer), None without rules.
pub fn jwt_filter(rules: &[&JwtRule], jwks: &JwksTable) -> Option<HttpFilter> {
    if rules.is_empty() {
        return None;
    }
    let mut providers = HashMap::new();
    let mut each_valid_if_present = Vec::new();
    let mut any_provider = Vec::new();
    for (i, rule) in rules.iter().enumerate() {
        let name = format!("origins-{i}");
        providers.insert(name.clone(), provider(rule, jwks));
        let by_name = requirement(jwt_requirement::RequiresType::ProviderName(name));
        each_valid_if_present.push(requirement(jwt_requirement::RequiresType::RequiresAny(
            JwtRequirementOrList {
                requirements: vec![
                    by_name.clone(),
                    requirement(jwt_requirement::RequiresType::AllowMissing(
                        Default::default(),
                    )),
                ],
            },
        )));
        any_provider.push(by_name);
    }
    let requires = match each_valid_if_present.len() {
        1 => each_valid_if_present.remove(0),
        // Any one provider verifying, or every provider's token valid where present: the first
        // covers providers reading the same header (each other's tokens fail them).
        _ => {
            any_provider.push(requirement(jwt_requirement::RequiresType::RequiresAll(
                JwtRequirementAndList {
                    requirements: each_valid_if_present,
                },
            )));
            requirement(jwt_requirement::RequiresType::RequiresAny(
                JwtRequirementOrList {
                    requirements: any_provider,
                },
            ))
        }
    };
    let config = JwtAuthentication {
        providers,
        rules: vec![RequirementRule {
            r#match: Some(RouteMatch {
                path_specifier: Some(route_match::PathSpecifier::Prefix("/".into())),
                ..Default::default()
            }),
            requirement_type: Some(requirement_rule::RequirementType::Requires(requires)),
        }],
        bypass_cors_preflight: true,
        ..Default::default()
    };
    Some(HttpFilter {
        name: JWT_FILTER.into(),
        config_type: Some(http_filter::ConfigType::TypedConfig(pack_any(config))),
        ..Default::default()
    })
}

fn requirement(requires: jwt_requirement::RequiresType) -> JwtRequirement {
    JwtRequirement {
        requires_type: Some(requires),
    }
}

fn provider(rule: &JwtRule, jwks: &JwksTable) -> JwtProvider {
    let space_delimited: BTreeSet<&str> = SPACE_DELIMITED
        .into_iter()
        .chain(rule.space_delimited_claims.iter().map(String::as_str))
        .collect();
    JwtProvider {
        issuer: rule.issuer.clone(),
        audiences: rule.audiences.clone(),
        forward: rule.forward_original_token,
        forward_payload_header: rule.output_payload_to_header.clone(),
        payload_in_metadata: JWT_PAYLOAD.into(),
        normalize_payload_in_metadata: Some(jwt_provider::NormalizePayload {
            space_delimited_claims: space_delimited.into_iter().map(str::to_string).collect(),
        }),
        claim_to_headers: rule
            .output_claim_to_headers
            .iter()
            .map(|c| JwtClaimToHeader {
                header_name: c.header.clone(),
                claim_name: c.claim.clone(),
                ..Default::default()
            })
            .collect(),
        from_headers: rule
            .from_headers
            .iter()
            .map(|h| JwtHeader {
                name: h.name.clone(),
                value_prefix: h.prefix.clone(),
            })
            .collect(),
        from_params: rule.from_params.clone(),
        from_cookies: rule.from_cookies.clone(),
        jwks_source_specifier: Some(jwt_provider::JwksSourceSpecifier::LocalJwks(DataSource {
            specifier: Some(data_source::Specifier::InlineString(
                jwks.keys_for(rule).to_string(),
            )),
            ..Default::default()
        })),
        ..Default::default()
    }
}
