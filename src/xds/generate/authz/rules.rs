//! One AuthorizationPolicy rule → one Envoy RBAC policy, as istiod translates it: a principal per
//! `from` and a permission per `to` (or one matching anything), each the AND of its conditions;
//! `when` conditions added to all of them; the values of a field ORed, `not` values negated.
//!
//! On a TCP chain, HTTP-only fields cannot match: an ALLOW rule using them is dropped (it allows
//! nothing), while a DENY (or AUDIT, or CUSTOM) rule drops just those conditions (it denies more).

use envoy_types::pb::envoy::config::core::v3::TypedExtensionConfig;
use envoy_types::pb::envoy::config::rbac::v3::{
    permission, principal, MetadataSource, Permission, Policy, Principal, SourcedMetadata,
};
use envoy_types::pb::envoy::extensions::path::r#match::uri_template::v3::UriTemplateMatchConfig;
use envoy_types::pb::envoy::r#type::matcher::v3::{
    filter_state_matcher, path_matcher, FilterStateMatcher, MetadataMatcher, PathMatcher,
};
use envoy_types::util::pack_any;

use super::matchers::{
    self, any_of, any_value, claim, claim_list, element, header, or_values, wildcard,
};
use crate::istio::security::authorization::{Rule, MATCH_ANY, MATCH_ONE};

/// How a rule is translated: for which chain and action, and for whom.
pub struct Translation<'a> {
    pub for_tcp: bool,
    /// Errors (HTTP-only fields on TCP) drop the whole rule instead of one condition.
    pub strict: bool,
    /// The policy's namespace (the default of `serviceAccounts`).
    pub namespace: &'a str,
    /// The local trust domain and its aliases; principals in any of them match all of them.
    pub trust_domains: &'a [String],
    /// Where the peer's identity is read: its TLS certificate, or (behind a waypoint's tunnel,
    /// where the connection is internal) the filter state the tunnel's end shared.
    pub peer_from_filter_state: bool,
}

/// The filter state a waypoint's tunnel end shares with what it forwards to: the peer's URI SAN.
pub const PEER_PRINCIPAL_STATE: &str = "io.istio.peer_principal";

/// Why a value cannot be a matcher on this chain.
struct HttpOnly;

/// A field of a rule: which attribute, its values and its `not` values.
struct Field<'a> {
    key: Key<'a>,
    values: &'a [String],
    not_values: &'a [String],
}

#[derive(Clone, Copy)]
enum Key<'a> {
    SourceIp,
    RemoteIp,
    Namespace,
    ServiceAccount,
    Principal,
    RequestPrincipal,
    Audiences,
    Presenter,
    RequestHeader(&'a str),
    Claims(&'a str),
    DestinationIp,
    DestinationPort,
    Sni,
    EnvoyFilter(&'a str),
    Host,
    Path,
    Method,
}

impl Key<'_> {
    /// Keys whose values are matched together by one matcher (negated as a whole).
    fn combined(self) -> bool {
        matches!(
            self,
            Key::RequestPrincipal
                | Key::Audiences
                | Key::Presenter
                | Key::Claims(_)
                | Key::EnvoyFilter(_)
        )
    }

    fn is_permission(self) -> bool {
        matches!(
            self,
            Key::DestinationIp
                | Key::DestinationPort
                | Key::Sni
                | Key::EnvoyFilter(_)
                | Key::Host
                | Key::Path
                | Key::Method
        )
    }
}

/// The rule's policy, or None when it must be dropped.
pub fn policy(rule: &Rule, t: &Translation<'_>) -> Option<Policy> {
    let mut base_principal = Vec::new();
    let mut base_permission = Vec::new();
    for when in &rule.when {
        let Some(key) = when_key(&when.key) else {
            // Validation refuses unknown keys; a stored one can only come from an older meshpilot.
            return None;
        };
        let field = Field {
            key,
            values: &when.values,
            not_values: &when.not_values,
        };
        match key.is_permission() {
            true => base_permission.push(field),
            false => base_principal.push(field),
        }
    }
    let mut principals = Vec::new();
    for from in rule.from.iter().flatten() {
        let mut fields: Vec<Field<'_>> = Vec::new();
        if let Some(s) = &from.source {
            let f = |key, values, not_values| Field {
                key,
                values,
                not_values,
            };
            fields.extend([
                f(Key::Principal, &s.principals, &s.not_principals),
                f(
                    Key::RequestPrincipal,
                    &s.request_principals,
                    &s.not_request_principals,
                ),
                f(
                    Key::ServiceAccount,
                    &s.service_accounts,
                    &s.not_service_accounts,
                ),
                f(Key::Namespace, &s.namespaces, &s.not_namespaces),
                f(Key::RemoteIp, &s.remote_ip_blocks, &s.not_remote_ip_blocks),
                f(Key::SourceIp, &s.ip_blocks, &s.not_ip_blocks),
            ]);
        }
        fields.extend(base_principal.iter().map(Field::copy));
        principals.push(principal_and(principal_parts(&fields, t)?));
    }
    if rule.from.as_ref().is_none_or(Vec::is_empty) {
        principals.push(principal_and(principal_parts(&base_principal, t)?));
    }
    let mut permissions = Vec::new();
    for to in rule.to.iter().flatten() {
        let mut fields: Vec<Field<'_>> = Vec::new();
        if let Some(o) = &to.operation {
            let f = |key, values, not_values| Field {
                key,
                values,
                not_values,
            };
            fields.extend([
                f(Key::Host, &o.hosts, &o.not_hosts),
                f(Key::Method, &o.methods, &o.not_methods),
                f(Key::Path, &o.paths, &o.not_paths),
                f(Key::DestinationPort, &o.ports, &o.not_ports),
            ]);
        }
        fields.extend(base_permission.iter().map(Field::copy));
        permissions.push(permission_and(permission_parts(&fields, t)?));
    }
    if rule.to.as_ref().is_none_or(Vec::is_empty) {
        permissions.push(permission_and(permission_parts(&base_permission, t)?));
    }
    Some(Policy {
        permissions,
        principals,
        ..Default::default()
    })
}

/// A policy that matches nothing: what an AuthorizationPolicy without rules becomes.
pub fn never() -> Policy {
    Policy {
        permissions: vec![Permission {
            rule: Some(permission::Rule::NotRule(Box::new(permission_any()))),
        }],
        principals: vec![Principal {
            identifier: Some(principal::Identifier::NotId(Box::new(principal_any()))),
        }],
        ..Default::default()
    }
}

impl Field<'_> {
    fn copy(&self) -> Self {
        Field {
            key: self.key,
            values: self.values,
            not_values: self.not_values,
        }
    }
}

fn when_key(key: &str) -> Option<Key<'_>> {
    let bracketed = |prefix: &str| {
        key.strip_prefix(prefix)
            .filter(|rest| rest.starts_with('['))
    };
    Some(match key {
        "source.ip" => Key::SourceIp,
        "remote.ip" => Key::RemoteIp,
        "source.namespace" => Key::Namespace,
        "source.serviceAccount" => Key::ServiceAccount,
        "source.principal" => Key::Principal,
        "request.auth.principal" => Key::RequestPrincipal,
        "request.auth.audiences" => Key::Audiences,
        "request.auth.presenter" => Key::Presenter,
        "destination.ip" => Key::DestinationIp,
        "destination.port" => Key::DestinationPort,
        "connection.sni" => Key::Sni,
        _ => {
            if let Some(name) = bracketed("request.headers") {
                Key::RequestHeader(name)
            } else if let Some(claims) = bracketed("request.auth.claims") {
                Key::Claims(claims)
            } else if key.starts_with("experimental.envoy.filters.") {
                Key::EnvoyFilter(key)
            } else {
                return None;
            }
        }
    })
}

/// The AND parts of one principal; None drops the rule.
fn principal_parts(fields: &[Field<'_>], t: &Translation<'_>) -> Option<Vec<Principal>> {
    let mut and = Vec::new();
    for field in fields {
        for (values, negate) in [(field.values, false), (field.not_values, true)] {
            if values.is_empty() {
                continue;
            }
            let matched: Vec<Principal> = match field.key.combined() {
                true => keep(t, combined_principal(field.key, values, t))?
                    .into_iter()
                    .collect(),
                false => {
                    let mut or = Vec::new();
                    for v in values {
                        or.extend(
                            keep(t, principal_of(field.key, v, t))?
                                .into_iter()
                                .flatten(),
                        );
                    }
                    match or.is_empty() {
                        true => Vec::new(),
                        false => vec![principal_or(or)],
                    }
                }
            };
            for p in matched {
                and.push(match negate {
                    true => Principal {
                        identifier: Some(principal::Identifier::NotId(Box::new(p))),
                    },
                    false => p,
                });
            }
        }
    }
    Some(and)
}

fn permission_parts(fields: &[Field<'_>], t: &Translation<'_>) -> Option<Vec<Permission>> {
    let mut and = Vec::new();
    for field in fields {
        for (values, negate) in [(field.values, false), (field.not_values, true)] {
            if values.is_empty() {
                continue;
            }
            let matched: Vec<Permission> = match field.key.combined() {
                true => keep(t, combined_permission(field.key, values))?
                    .into_iter()
                    .collect(),
                false => {
                    let mut or = Vec::new();
                    for v in values {
                        or.extend(
                            keep(t, permission_of(field.key, v, t))?
                                .into_iter()
                                .flatten(),
                        );
                    }
                    match or.is_empty() {
                        true => Vec::new(),
                        false => vec![permission_or(or)],
                    }
                }
            };
            for p in matched {
                and.push(match negate {
                    true => Permission {
                        rule: Some(permission::Rule::NotRule(Box::new(p))),
                    },
                    false => p,
                });
            }
        }
    }
    Some(and)
}

/// An HTTP-only field on TCP: None (drop the rule) when strict, else Some(None) (drop the field).
fn keep<T>(t: &Translation<'_>, generated: Result<T, HttpOnly>) -> Option<Option<T>> {
    match generated {
        Ok(v) => Some(Some(v)),
        Err(HttpOnly) if t.strict => None,
        Err(HttpOnly) => Some(None),
    }
}

fn http_only<T>(t: &Translation<'_>, value: T) -> Result<T, HttpOnly> {
    match t.for_tcp {
        true => Err(HttpOnly),
        false => Ok(value),
    }
}

/// The peer's identity matching `m`.
fn authenticated(
    t: &Translation<'_>,
    m: envoy_types::pb::envoy::r#type::matcher::v3::StringMatcher,
) -> Principal {
    let identifier = match t.peer_from_filter_state {
        true => principal::Identifier::FilterState(FilterStateMatcher {
            key: PEER_PRINCIPAL_STATE.into(),
            matcher: Some(filter_state_matcher::Matcher::StringMatch(m)),
        }),
        false => principal::Identifier::Authenticated(principal::Authenticated {
            principal_name: Some(m),
        }),
    };
    Principal {
        identifier: Some(identifier),
    }
}

fn dynamic_metadata(m: MetadataMatcher) -> SourcedMetadata {
    SourcedMetadata {
        metadata_matcher: Some(m),
        metadata_source: MetadataSource::Dynamic as i32,
    }
}

fn principal_metadata(m: MetadataMatcher) -> Principal {
    Principal {
        identifier: Some(principal::Identifier::SourcedMetadata(dynamic_metadata(m))),
    }
}

/// One value of a principal field; Ok(None) when the value cannot match (an invalid address).
fn principal_of(key: Key<'_>, v: &str, t: &Translation<'_>) -> Result<Option<Principal>, HttpOnly> {
    let id = |identifier| Principal {
        identifier: Some(identifier),
    };
    Ok(match key {
        Key::SourceIp => matchers::cidr(v).map(|c| id(principal::Identifier::DirectRemoteIp(c))),
        Key::RemoteIp => matchers::cidr(v).map(|c| id(principal::Identifier::RemoteIp(c))),
        Key::Namespace => Some(authenticated(
            t,
            matchers::regex(&format!(".*/ns/{}/.*", v.replace('*', ".*"))),
        )),
        Key::ServiceAccount => {
            let (ns, sa) = v.split_once('/').unwrap_or((t.namespace, v));
            Some(authenticated(
                t,
                matchers::regex(&format!("spiffe://.+/ns/{ns}/(.+/|)sa/{sa}(/.+)?")),
            ))
        }
        Key::Principal => {
            let mut or: Vec<Principal> = principal_variants(v, t.trust_domains)
                .iter()
                .map(|p| authenticated(t, wildcard(p, "spiffe://")))
                .collect();
            match or.len() {
                1 => Some(or.remove(0)),
                _ => Some(principal_or(or)),
            }
        }
        Key::RequestHeader(name) => {
            let name = name.trim_start_matches('[').trim_end_matches(']');
            Some(id(principal::Identifier::Header(http_only(
                t,
                header(name, v, false),
            )?)))
        }
        _ => None,
    })
}

/// A principal in the local trust domain or an alias, written for each of them (as istiod migrates
/// trust domains).
fn principal_variants(v: &str, trust_domains: &[String]) -> Vec<String> {
    if trust_domains.len() < 2 {
        return vec![v.to_string()];
    }
    match v.split_once("/ns/") {
        Some((domain, rest)) if trust_domains.iter().any(|d| d == domain) => trust_domains
            .iter()
            .map(|d| format!("{d}/ns/{rest}"))
            .collect(),
        _ => vec![v.to_string()],
    }
}

fn combined_principal(
    key: Key<'_>,
    values: &[String],
    t: &Translation<'_>,
) -> Result<Principal, HttpOnly> {
    http_only(t, ())?;
    Ok(match key {
        Key::RequestPrincipal => {
            let mut or: Vec<Principal> = values.iter().map(|v| request_principal(v)).collect();
            match or.len() {
                1 => or.remove(0),
                _ => principal_or(or),
            }
        }
        Key::Audiences => principal_metadata(claim_list(&["aud"], any_of(values))),
        Key::Presenter => principal_metadata(claim_list(&["azp"], any_of(values))),
        Key::Claims(path) => {
            let claims = nested_claims(path);
            let claims: Vec<&str> = claims.iter().map(String::as_str).collect();
            principal_metadata(claim_list(&claims, any_of(values)))
        }
        _ => principal_any(),
    })
}

/// `<iss>/<sub>`, split at the last `/` (issuers are often URLs), each side with wildcards.
fn request_principal(v: &str) -> Principal {
    let (iss, sub) = match v.rfind('/') {
        Some(i) => (&v[..i], Some(&v[i + 1..])),
        None => (v, None),
    };
    let (iss_m, sub_m) = if v == "*" {
        (any_value(), any_value())
    } else if v.starts_with('*') {
        match sub {
            Some(sub) => (
                match iss {
                    "*" => any_value(),
                    iss => matchers::suffix(iss.trim_start_matches('*'), false),
                },
                matchers::exact(sub, false),
            ),
            None => (
                any_value(),
                matchers::suffix(v.trim_start_matches('*'), false),
            ),
        }
    } else if v.ends_with('*') {
        match sub {
            Some(sub) => (
                matchers::exact(iss, false),
                match sub {
                    "*" => any_value(),
                    sub => matchers::prefix(sub.trim_end_matches('*'), false),
                },
            ),
            None => (
                matchers::prefix(v.trim_end_matches('*'), false),
                any_value(),
            ),
        }
    } else {
        (
            matchers::exact(iss, false),
            matchers::exact(sub.unwrap_or(""), false),
        )
    };
    principal_and(vec![
        principal_metadata(claim(&["iss"], iss_m)),
        principal_metadata(claim(&["sub"], sub_m)),
    ])
}

/// `[a][b]` → `a`, `b`; a name with brackets inside is taken whole.
fn nested_claims(path: &str) -> Vec<String> {
    let inner = path.strip_prefix('[').and_then(|p| p.strip_suffix(']'));
    match inner {
        Some(inner) if inner.contains("][") && !inner.contains("[[") => {
            inner.split("][").map(str::to_string).collect()
        }
        Some(inner) => vec![inner.to_string()],
        None => vec![path.to_string()],
    }
}

fn permission_of(
    key: Key<'_>,
    v: &str,
    t: &Translation<'_>,
) -> Result<Option<Permission>, HttpOnly> {
    let rule = |rule| Permission { rule: Some(rule) };
    Ok(match key {
        Key::DestinationIp => matchers::cidr(v).map(|c| rule(permission::Rule::DestinationIp(c))),
        Key::DestinationPort => v
            .parse::<u16>()
            .ok()
            .map(|p| rule(permission::Rule::DestinationPort(u32::from(p)))),
        Key::Sni => Some(rule(permission::Rule::RequestedServerName(wildcard(v, "")))),
        Key::Host => Some(rule(permission::Rule::Header(http_only(
            t,
            header(":authority", v, true),
        )?))),
        Key::Method => Some(rule(permission::Rule::Header(http_only(
            t,
            header(":method", v, false),
        )?))),
        Key::Path => {
            http_only(t, ())?;
            Some(rule(path(v)))
        }
        _ => None,
    })
}

/// A path, or a path template (`{*}` one segment, `{**}` the rest) for Envoy's URI template matcher.
fn path(v: &str) -> permission::Rule {
    if v.contains(MATCH_ONE) || v.contains(MATCH_ANY) {
        let template = v.replace(MATCH_ANY, "**").replace(MATCH_ONE, "*");
        return permission::Rule::UriTemplate(TypedExtensionConfig {
            name: "uri-template".into(),
            typed_config: Some(pack_any(UriTemplateMatchConfig {
                path_template: template,
            })),
        });
    }
    permission::Rule::UrlPath(PathMatcher {
        rule: Some(path_matcher::Rule::Path(wildcard(v, ""))),
    })
}

/// `experimental.envoy.filters.<filter>[<key>]`: dynamic metadata of another filter; `[v]`
/// values match an element of a list.
fn combined_permission(key: Key<'_>, values: &[String]) -> Result<Permission, HttpOnly> {
    let Key::EnvoyFilter(full) = key else {
        return Ok(permission_any());
    };
    let name = full.trim_start_matches("experimental.");
    let Some((filter, rest)) = name.split_once('[') else {
        return Ok(permission_any());
    };
    let value = or_values(
        values
            .iter()
            .map(
                |v| match v.strip_prefix('[').and_then(|v| v.strip_suffix(']')) {
                    Some(v) => element(v),
                    None => any_of(std::slice::from_ref(v)),
                },
            )
            .collect(),
    );
    let m = matchers::metadata(filter, &[rest.trim_end_matches(']')], value);
    Ok(Permission {
        rule: Some(permission::Rule::SourcedMetadata(dynamic_metadata(m))),
    })
}

fn principal_any() -> Principal {
    Principal {
        identifier: Some(principal::Identifier::Any(true)),
    }
}

fn permission_any() -> Permission {
    Permission {
        rule: Some(permission::Rule::Any(true)),
    }
}

fn principal_and(mut ids: Vec<Principal>) -> Principal {
    if ids.is_empty() {
        ids.push(principal_any());
    }
    Principal {
        identifier: Some(principal::Identifier::AndIds(principal::Set { ids })),
    }
}

fn principal_or(ids: Vec<Principal>) -> Principal {
    Principal {
        identifier: Some(principal::Identifier::OrIds(principal::Set { ids })),
    }
}

fn permission_and(mut rules: Vec<Permission>) -> Permission {
    if rules.is_empty() {
        rules.push(permission_any());
    }
    Permission {
        rule: Some(permission::Rule::AndRules(permission::Set { rules })),
    }
}

fn permission_or(rules: Vec<Permission>) -> Permission {
    Permission {
        rule: Some(permission::Rule::OrRules(permission::Set { rules })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::r#type::matcher::v3::string_matcher::MatchPattern;

    fn rule(yaml: &str) -> Rule {
        let value: serde_json::Value = serde_yaml_ng::from_str(yaml).unwrap();
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn behind_a_tunnel_the_peer_is_read_from_the_shared_filter_state() {
        let domains = ["cluster.local".to_string()];
        let t = Translation {
            for_tcp: false,
            strict: true,
            namespace: "shop",
            trust_domains: &domains,
            peer_from_filter_state: true,
        };
        let yaml = "from: [{source: {principals: [cluster.local/ns/a/sa/b], namespaces: [a]}}]";
        let text = format!("{:?}", policy(&rule(yaml), &t).unwrap());
        assert!(text.contains(PEER_PRINCIPAL_STATE), "{text}");
        assert!(!text.contains("Authenticated"), "{text}");
    }

    fn translate(yaml: &str, for_tcp: bool, strict: bool) -> Option<Policy> {
        let domains = ["cluster.local".to_string()];
        let t = Translation {
            for_tcp,
            strict,
            namespace: "shop",
            trust_domains: &domains,
            peer_from_filter_state: false,
        };
        policy(&rule(yaml), &t)
    }

    /// The AND parts of a policy's only principal.
    fn principal_parts_of(p: &Policy) -> &[Principal] {
        match &p.principals[0].identifier {
            Some(principal::Identifier::AndIds(set)) => &set.ids,
            other => panic!("not an AND: {other:?}"),
        }
    }

    fn permission_parts_of(p: &Policy) -> &[Permission] {
        match &p.permissions[0].rule {
            Some(permission::Rule::AndRules(set)) => &set.rules,
            other => panic!("not an AND: {other:?}"),
        }
    }

    fn exact_principal(p: &Principal) -> &str {
        match &p.identifier {
            Some(principal::Identifier::OrIds(set)) => exact_principal(&set.ids[0]),
            Some(principal::Identifier::Authenticated(a)) => match &a.principal_name {
                Some(m) => match &m.match_pattern {
                    Some(MatchPattern::Exact(e)) => e,
                    other => panic!("{other:?}"),
                },
                None => panic!("no name"),
            },
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn principals_and_paths_become_spiffe_and_url_matchers() {
        let p = translate(
            "{from: [{source: {principals: [cluster.local/ns/a/sa/b]}}], to: [{operation: {paths: [/x], methods: [GET]}}]}",
            false,
            true,
        )
        .unwrap();
        let principals = principal_parts_of(&p);
        assert_eq!(
            exact_principal(&principals[0]),
            "spiffe://cluster.local/ns/a/sa/b"
        );
        let permissions = permission_parts_of(&p);
        assert_eq!(permissions.len(), 2, "method and path");
        let path = permissions.iter().find_map(|p| match &p.rule {
            Some(permission::Rule::OrRules(set)) => match &set.rules[0].rule {
                Some(permission::Rule::UrlPath(m)) => Some(m.clone()),
                _ => None,
            },
            _ => None,
        });
        assert!(path.is_some(), "{permissions:?}");
    }

    #[test]
    fn http_fields_on_tcp_drop_allow_rules_and_widen_deny_rules() {
        let yaml = "{to: [{operation: {methods: [GET], ports: ['9000']}}]}";
        assert!(
            translate(yaml, true, true).is_none(),
            "ALLOW: the rule is gone"
        );
        let deny = translate(yaml, true, false).unwrap();
        let parts = permission_parts_of(&deny);
        assert_eq!(parts.len(), 1, "only the port remains: {parts:?}");
        assert!(translate(yaml, false, true).is_some());
    }

    #[test]
    fn request_principals_match_issuer_and_subject_claims() {
        let p = translate(
            "{from: [{source: {requestPrincipals: [https://issuer.example/alice]}}]}",
            false,
            true,
        )
        .unwrap();
        let text = format!("{:?}", principal_parts_of(&p));
        assert!(text.contains("\"https://issuer.example\""), "{text}");
        assert!(text.contains("\"alice\""), "{text}");
        assert!(text.contains("jwt_authn"), "{text}");
        assert!(translate("{from: [{source: {requestPrincipals: ['*']}}]}", true, true).is_none());
    }

    #[test]
    fn namespaces_not_values_and_aliases() {
        let p = translate(
            "{from: [{source: {namespaces: [front], notPrincipals: ['*']}}]}",
            false,
            true,
        )
        .unwrap();
        let text = format!("{:?}", principal_parts_of(&p));
        assert!(text.contains(".*/ns/front/.*"), "{text}");
        assert!(text.contains("NotId"), "{text}");
        let domains = ["new.td".to_string(), "old.td".to_string()];
        assert_eq!(
            principal_variants("old.td/ns/a/sa/b", &domains),
            ["new.td/ns/a/sa/b", "old.td/ns/a/sa/b"]
        );
        assert_eq!(
            principal_variants("other/ns/a/sa/b", &domains),
            ["other/ns/a/sa/b"]
        );
    }

    #[test]
    fn path_templates_use_envoys_uri_template() {
        assert!(matches!(
            path("/api/{*}/items/{**}"),
            permission::Rule::UriTemplate(_)
        ));
        assert!(matches!(path("/api/*"), permission::Rule::UrlPath(_)));
        assert_eq!(nested_claims("[a][b]"), ["a", "b"]);
        assert_eq!(nested_claims("[groups]"), ["groups"]);
    }
}
