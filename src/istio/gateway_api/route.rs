//! HTTPRoute, GRPCRoute, TCPRoute and TLSRoute: parents, hostnames, and rules of matches,
//! filters and weighted backends.

use serde::{Deserialize, Serialize};

use super::super::duration::Duration;
use super::super::validate::{ensure, Result};
use super::{each, hostname, ParentReference};
use crate::text::Quoted;

/// Where a route sends traffic: a Service (the default) of the route's namespace or, where a
/// ReferenceGrant allows it, another's. HTTP and gRPC backends may carry their own filters.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct BackendRef {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// Relative share of the rule's traffic (default 1).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weight: Option<u32>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub filters: Vec<Filter>,
}

impl BackendRef {
    pub fn group(&self) -> &str {
        self.group.as_deref().unwrap_or_default()
    }

    pub fn kind(&self) -> &str {
        self.kind.as_deref().unwrap_or("Service")
    }

    pub fn weight(&self) -> u32 {
        self.weight.unwrap_or(1)
    }

    pub fn is_service(&self) -> bool {
        self.group().is_empty() && self.kind() == "Service"
    }

    fn validate(&self) -> Result {
        ensure(!self.name.is_empty(), "name", "a backend must be named")?;
        ensure(
            self.weight.is_none_or(|w| w <= 1_000_000),
            "weight",
            "must be 0-1000000",
        )?;
        // The API's CEL rule: a Service backend names its port.
        ensure(
            !self.is_service() || self.port.is_some(),
            "port",
            "must be specified when the backend is a Service",
        )?;
        ensure(self.port != Some(0), "port", "must be 1-65535")?;
        each("filters", &self.filters, |f| {
            ensure(
                matches!(
                    f.kind.as_str(),
                    "RequestHeaderModifier" | "ResponseHeaderModifier"
                ),
                "type",
                "a backend's filters modify headers (RequestHeaderModifier, ResponseHeaderModifier)",
            )?;
            f.validate()
        })
    }
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpRoute {
    pub parent_refs: Vec<ParentReference>,
    pub hostnames: Vec<String>,
    pub rules: Vec<HttpRule>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpRule {
    pub name: Option<String>,
    pub matches: Vec<HttpMatch>,
    pub filters: Vec<Filter>,
    pub backend_refs: Vec<BackendRef>,
    pub timeouts: Option<Timeouts>,
    pub retry: Option<Retry>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpMatch {
    pub path: Option<PathMatch>,
    pub headers: Vec<ValueMatch>,
    pub query_params: Vec<ValueMatch>,
    pub method: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct PathMatch {
    /// `Exact`, `PathPrefix` (the default) or `RegularExpression`.
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub value: Option<String>,
}

impl PathMatch {
    pub fn kind(&self) -> &str {
        self.kind.as_deref().unwrap_or("PathPrefix")
    }

    pub fn value(&self) -> &str {
        self.value.as_deref().unwrap_or("/")
    }
}

/// A header or query parameter match.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ValueMatch {
    /// `Exact` (the default) or `RegularExpression`.
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub name: String,
    pub value: String,
}

impl ValueMatch {
    pub fn is_regex(&self) -> bool {
        self.kind.as_deref() == Some("RegularExpression")
    }

    fn validate(&self) -> Result {
        ensure(!self.name.is_empty(), "name", "must be set")?;
        ensure(
            matches!(
                self.kind.as_deref(),
                None | Some("Exact" | "RegularExpression")
            ),
            "type",
            "Exact or RegularExpression",
        )
    }
}

/// One filter; `type` names which of its fields is set.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Filter {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_header_modifier: Option<HeaderModifier>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub response_header_modifier: Option<HeaderModifier>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_redirect: Option<Redirect>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url_rewrite: Option<UrlRewrite>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_mirror: Option<Mirror>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HeaderModifier {
    pub set: Vec<Header>,
    pub add: Vec<Header>,
    pub remove: Vec<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Header {
    pub name: String,
    pub value: String,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Redirect {
    pub scheme: Option<String>,
    pub hostname: Option<String>,
    pub path: Option<PathModifier>,
    pub port: Option<u16>,
    /// 302 unless set.
    pub status_code: Option<u32>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct UrlRewrite {
    pub hostname: Option<String>,
    pub path: Option<PathModifier>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct PathModifier {
    /// `ReplaceFullPath` or `ReplacePrefixMatch`.
    #[serde(rename = "type")]
    pub kind: String,
    pub replace_full_path: Option<String>,
    pub replace_prefix_match: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Mirror {
    pub backend_ref: BackendRef,
    pub percent: Option<u32>,
    pub fraction: Option<Fraction>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Fraction {
    pub numerator: u32,
    /// 100 unless set.
    pub denominator: Option<u32>,
}

impl Mirror {
    /// The share of requests mirrored, in percent; all unless limited.
    pub fn percent(&self) -> Option<f64> {
        match (&self.percent, &self.fraction) {
            (Some(p), _) => Some(f64::from(*p)),
            (None, Some(f)) => Some(
                100.0 * f64::from(f.numerator) / f64::from(f.denominator.unwrap_or(100).max(1)),
            ),
            (None, None) => None,
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Timeouts {
    /// The whole request, retries included.
    pub request: Option<Duration>,
    /// Each try to a backend.
    pub backend_request: Option<Duration>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Retry {
    /// Response codes retried (and, as the API defines, only those).
    pub codes: Vec<u32>,
    pub attempts: Option<u32>,
}

impl Filter {
    fn validate(&self) -> Result {
        let set = [
            (
                "RequestHeaderModifier",
                self.request_header_modifier.is_some(),
            ),
            (
                "ResponseHeaderModifier",
                self.response_header_modifier.is_some(),
            ),
            ("RequestRedirect", self.request_redirect.is_some()),
            ("URLRewrite", self.url_rewrite.is_some()),
            ("RequestMirror", self.request_mirror.is_some()),
        ];
        let Some((_, present)) = set.iter().find(|(kind, _)| *kind == self.kind) else {
            return Err(super::super::validate::ValidationError::at(
                "type",
                format!(
                    "{} is not implemented; one of {}",
                    Quoted(&self.kind),
                    set.map(|(k, _)| k).join(", ")
                ),
            ));
        };
        ensure(
            *present && set.iter().filter(|(_, p)| *p).count() == 1,
            "type",
            format!("a {} filter sets that field alone", self.kind),
        )?;
        for (field, modifier) in [
            ("requestHeaderModifier", &self.request_header_modifier),
            ("responseHeaderModifier", &self.response_header_modifier),
        ] {
            if let Some(m) = modifier {
                let names = m.set.iter().chain(&m.add).map(|h| &h.name).chain(&m.remove);
                for name in names {
                    ensure(
                        !name.is_empty() && !name.starts_with(':'),
                        field,
                        format!("{} is not a header a filter may change", Quoted(name)),
                    )?;
                }
            }
        }
        if let Some(r) = &self.request_redirect {
            ensure(
                r.status_code
                    .is_none_or(|c| matches!(c, 301 | 302 | 303 | 307 | 308)),
                "requestRedirect.statusCode",
                "301, 302, 303, 307 or 308",
            )?;
            ensure(
                matches!(r.scheme.as_deref(), None | Some("http" | "https")),
                "requestRedirect.scheme",
                "http or https",
            )?;
            if let Some(p) = &r.path {
                p.validate().map_err(|e| e.under("requestRedirect.path"))?;
            }
        }
        if let Some(p) = self.url_rewrite.as_ref().and_then(|u| u.path.as_ref()) {
            p.validate().map_err(|e| e.under("urlRewrite.path"))?;
        }
        if let Some(m) = &self.request_mirror {
            ensure(
                m.percent.is_none() || m.fraction.is_none(),
                "requestMirror",
                "percent or fraction, not both",
            )?;
            ensure(
                m.percent.is_none_or(|p| p <= 100),
                "requestMirror.percent",
                "0-100",
            )?;
            if let Some(f) = &m.fraction {
                ensure(
                    f.denominator != Some(0) && f.numerator <= f.denominator.unwrap_or(100),
                    "requestMirror.fraction",
                    "numerator at most the (non-zero) denominator",
                )?;
            }
            ensure(
                m.backend_ref.weight.is_none() && m.backend_ref.filters.is_empty(),
                "requestMirror.backendRef",
                "a mirror's backend has no weight or filters",
            )?;
            m.backend_ref
                .validate()
                .map_err(|e| e.under("requestMirror.backendRef"))?;
        }
        Ok(())
    }
}

impl PathModifier {
    pub fn is_prefix(&self) -> bool {
        self.kind == "ReplacePrefixMatch"
    }

    /// The replacement: the full path, or what replaces the matched prefix.
    pub fn value(&self) -> &str {
        match self.is_prefix() {
            true => self.replace_prefix_match.as_deref(),
            false => self.replace_full_path.as_deref(),
        }
        .unwrap_or("/")
    }

    fn validate(&self) -> Result {
        let (wanted, other) = match self.kind.as_str() {
            "ReplaceFullPath" => (&self.replace_full_path, &self.replace_prefix_match),
            "ReplacePrefixMatch" => (&self.replace_prefix_match, &self.replace_full_path),
            other => {
                return Err(super::super::validate::ValidationError::at(
                    "type",
                    format!(
                        "{} is not ReplaceFullPath or ReplacePrefixMatch",
                        Quoted(other)
                    ),
                ))
            }
        };
        ensure(
            wanted.is_some() && other.is_none(),
            "type",
            format!("{} sets its own field alone", self.kind),
        )?;
        ensure(
            wanted.as_deref().is_some_and(|v| v.starts_with('/')),
            "type",
            "the path starts with '/'",
        )
    }
}

fn parents_and_hostnames(parents: &[ParentReference], hostnames: &[String]) -> Result {
    ensure(parents.len() <= 32, "parentRefs", "at most 32 parents")?;
    each("parentRefs", parents, ParentReference::validate)?;
    for (i, host) in hostnames.iter().enumerate() {
        hostname(&format!("hostnames[{i}]"), host)?;
    }
    Ok(())
}

/// The rules of a rule-set that modify the request target: a redirect excludes a rewrite.
fn filters(filters: &[Filter]) -> Result {
    each("filters", filters, Filter::validate)?;
    let has = |kind: &str| filters.iter().filter(|f| f.kind == kind).count();
    ensure(
        has("RequestRedirect") == 0 || has("URLRewrite") == 0,
        "filters",
        "RequestRedirect and URLRewrite exclude each other",
    )?;
    for kind in [
        "RequestHeaderModifier",
        "ResponseHeaderModifier",
        "RequestRedirect",
        "URLRewrite",
    ] {
        ensure(
            has(kind) <= 1,
            "filters",
            format!("at most one {kind} filter"),
        )?;
    }
    Ok(())
}

impl HttpRoute {
    pub fn validate(&self) -> Result {
        parents_and_hostnames(&self.parent_refs, &self.hostnames)?;
        each("rules", &self.rules, |rule| {
            each("matches", &rule.matches, |m| {
                if let Some(path) = &m.path {
                    ensure(
                        matches!(path.kind(), "Exact" | "PathPrefix" | "RegularExpression"),
                        "path.type",
                        "Exact, PathPrefix or RegularExpression",
                    )?;
                    ensure(
                        path.kind() == "RegularExpression" || path.value().starts_with('/'),
                        "path.value",
                        "a path starts with '/'",
                    )?;
                }
                each("headers", &m.headers, ValueMatch::validate)?;
                each("queryParams", &m.query_params, ValueMatch::validate)
            })?;
            filters(&rule.filters)?;
            let prefix_rewrite = rule.filters.iter().any(|f| {
                let path = f
                    .url_rewrite
                    .as_ref()
                    .and_then(|u| u.path.as_ref())
                    .or(f.request_redirect.as_ref().and_then(|r| r.path.as_ref()));
                path.is_some_and(PathModifier::is_prefix)
            });
            // The API's CEL rule: the prefix replaced is the one matched.
            ensure(
                !prefix_rewrite
                    || rule
                        .matches
                        .iter()
                        .all(|m| m.path.as_ref().is_none_or(|p| p.kind() == "PathPrefix")),
                "filters",
                "ReplacePrefixMatch needs PathPrefix matches",
            )?;
            ensure(
                rule.retry
                    .as_ref()
                    .is_none_or(|r| r.codes.iter().all(|c| (400..600).contains(c))),
                "retry.codes",
                "400-599",
            )?;
            each("backendRefs", &rule.backend_refs, BackendRef::validate)
        })
    }
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct GrpcRoute {
    pub parent_refs: Vec<ParentReference>,
    pub hostnames: Vec<String>,
    pub rules: Vec<GrpcRule>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct GrpcRule {
    pub name: Option<String>,
    pub matches: Vec<GrpcMatch>,
    pub filters: Vec<Filter>,
    pub backend_refs: Vec<BackendRef>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct GrpcMatch {
    pub method: Option<MethodMatch>,
    pub headers: Vec<ValueMatch>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct MethodMatch {
    /// `Exact` (the default) or `RegularExpression`.
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub service: Option<String>,
    pub method: Option<String>,
}

impl GrpcRoute {
    pub fn validate(&self) -> Result {
        parents_and_hostnames(&self.parent_refs, &self.hostnames)?;
        each("rules", &self.rules, |rule| {
            each("matches", &rule.matches, |m| {
                if let Some(method) = &m.method {
                    ensure(
                        method.service.is_some() || method.method.is_some(),
                        "method",
                        "names a service, a method or both",
                    )?;
                    ensure(
                        matches!(
                            method.kind.as_deref(),
                            None | Some("Exact" | "RegularExpression")
                        ),
                        "method.type",
                        "Exact or RegularExpression",
                    )?;
                }
                each("headers", &m.headers, ValueMatch::validate)
            })?;
            filters(&rule.filters)?;
            each("backendRefs", &rule.backend_refs, BackendRef::validate)
        })
    }
}

/// A TCPRoute or TLSRoute rule: weighted backends.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct L4Rule {
    pub name: Option<String>,
    pub backend_refs: Vec<BackendRef>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct TcpRoute {
    pub parent_refs: Vec<ParentReference>,
    pub rules: Vec<L4Rule>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct TlsRoute {
    pub parent_refs: Vec<ParentReference>,
    pub hostnames: Vec<String>,
    pub rules: Vec<L4Rule>,
}

fn l4_rules(rules: &[L4Rule]) -> Result {
    ensure(!rules.is_empty(), "rules", "at least one rule")?;
    each("rules", rules, |rule| {
        each("backendRefs", &rule.backend_refs, BackendRef::validate)
    })
}

impl TcpRoute {
    pub fn validate(&self) -> Result {
        parents_and_hostnames(&self.parent_refs, &[])?;
        l4_rules(&self.rules)
    }
}

impl TlsRoute {
    pub fn validate(&self) -> Result {
        parents_and_hostnames(&self.parent_refs, &self.hostnames)?;
        l4_rules(&self.rules)
    }
}
