//! VirtualService (networking.istio.io): how requests for a host are routed.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::duration::Duration;
use super::validate::{self, ensure, Result};
use crate::text::Quoted;

/// istiod's annotation giving a VirtualService the route semantics of the API it was made from
/// (pkg/config/constants `InternalRouteSemantics`), and the value for Kubernetes Ingresses: a
/// prefix then matches whole path segments (pilot/pkg/networking/core/route/route.go
/// `translateRouteMatch`).
pub const ROUTE_SEMANTICS: &str = "internal.istio.io/route-semantics";
pub const INGRESS_SEMANTICS: &str = "ingress";

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct VirtualService {
    pub hosts: Vec<String>,
    /// `mesh` (sidecars; the default when empty) and/or gateways as `<namespace>/<name>` or `<name>`.
    pub gateways: Vec<String>,
    pub http: Vec<HttpRoute>,
    pub tls: Vec<TlsRoute>,
    pub tcp: Vec<TcpRoute>,
    pub export_to: Vec<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpRoute {
    pub name: String,
    #[serde(rename = "match")]
    pub matches: Vec<HttpMatch>,
    pub route: Vec<HttpRouteDestination>,
    pub redirect: Option<HttpRedirect>,
    pub direct_response: Option<DirectResponse>,
    pub delegate: Option<Delegate>,
    pub rewrite: Option<HttpRewrite>,
    pub timeout: Option<Duration>,
    pub retries: Option<HttpRetry>,
    pub fault: Option<HttpFault>,
    pub mirror: Option<Destination>,
    pub mirror_percentage: Option<Percent>,
    /// Deprecated integer form of `mirrorPercentage`; Istio's schema spells it both ways.
    #[serde(alias = "mirror_percent")]
    pub mirror_percent: Option<u32>,
    pub mirrors: Vec<HttpMirrorPolicy>,
    pub cors_policy: Option<CorsPolicy>,
    pub headers: Option<Headers>,
    /// The Gateway API's semantics: a backend with no cluster (not found, or a reference refused)
    /// answers 500 rather than Envoy's 503. Never written in a VirtualService.
    #[serde(skip)]
    pub gateway_semantics: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpMatch {
    pub name: String,
    pub uri: Option<StringMatch>,
    pub scheme: Option<StringMatch>,
    pub method: Option<StringMatch>,
    pub authority: Option<StringMatch>,
    pub headers: BTreeMap<String, StringMatch>,
    pub port: Option<u32>,
    pub source_labels: BTreeMap<String, String>,
    pub gateways: Vec<String>,
    pub query_params: BTreeMap<String, StringMatch>,
    pub ignore_uri_case: bool,
    pub without_headers: BTreeMap<String, StringMatch>,
    pub source_namespace: String,
}

/// One of exact, prefix or regex (RE2 syntax).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", try_from = "StringMatchFields")]
pub enum StringMatch {
    Exact(String),
    Prefix(String),
    Regex(String),
    /// A path prefix of whole segments (`/a` matches `/a` and `/a/b`, not `/ab`): the Gateway
    /// API's `PathPrefix`, never written in a VirtualService.
    PathSeparatedPrefix(String),
}

/// The protobuf `oneof` as it is written: a map with one of the keys.
#[derive(Deserialize)]
struct StringMatchFields {
    exact: Option<String>,
    prefix: Option<String>,
    regex: Option<String>,
}

impl TryFrom<StringMatchFields> for StringMatch {
    type Error = &'static str;

    fn try_from(f: StringMatchFields) -> std::result::Result<Self, Self::Error> {
        match (f.exact, f.prefix, f.regex) {
            (Some(e), None, None) => Ok(Self::Exact(e)),
            (None, Some(p), None) => Ok(Self::Prefix(p)),
            (None, None, Some(r)) => Ok(Self::Regex(r)),
            _ => Err("exactly one of exact, prefix, regex"),
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpRouteDestination {
    pub destination: Destination,
    pub weight: Option<u32>,
    pub headers: Option<Headers>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Destination {
    pub host: String,
    pub subset: String,
    pub port: Option<PortSelector>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(default)]
pub struct PortSelector {
    pub number: u32,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpRedirect {
    pub uri: String,
    /// `uri` replaces the prefix the route matched rather than the whole path (the Gateway API's
    /// `ReplacePrefixMatch`; a VirtualService cannot say it).
    #[serde(skip)]
    pub uri_replaces_prefix: bool,
    pub authority: String,
    pub port: Option<u32>,
    pub scheme: String,
    pub redirect_code: Option<u32>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(default)]
pub struct DirectResponse {
    pub status: u32,
    pub body: Option<HttpBody>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(default)]
pub struct HttpBody {
    pub string: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(default)]
pub struct Delegate {
    pub name: String,
    pub namespace: String,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpMirrorPolicy {
    pub destination: Destination,
    pub percentage: Option<Percent>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpRewrite {
    pub uri: String,
    pub authority: String,
    pub uri_regex_rewrite: Option<RegexRewrite>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(default)]
pub struct RegexRewrite {
    /// An RE2 pattern over the path.
    #[serde(rename = "match")]
    pub pattern: String,
    pub rewrite: String,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpRetry {
    pub attempts: i32,
    pub per_try_timeout: Option<Duration>,
    pub retry_on: String,
    pub retry_remote_localities: Option<bool>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpFault {
    pub delay: Option<FaultDelay>,
    pub abort: Option<FaultAbort>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct FaultDelay {
    pub fixed_delay: Option<Duration>,
    pub percentage: Option<Percent>,
    /// Deprecated integer percentage.
    pub percent: Option<u32>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct FaultAbort {
    pub http_status: Option<u32>,
    pub grpc_status: Option<String>,
    pub percentage: Option<Percent>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(default)]
pub struct Percent {
    pub value: f64,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct CorsPolicy {
    pub allow_origins: Vec<StringMatch>,
    /// Deprecated exact origins, read when `allowOrigins` is empty (as istiod).
    pub allow_origin: Vec<String>,
    /// `IGNORE` answers preflights no origin matches; anything else forwards them upstream.
    pub unmatched_preflights: UnmatchedPreflights,
    pub allow_methods: Vec<String>,
    pub allow_headers: Vec<String>,
    pub expose_headers: Vec<String>,
    pub max_age: Option<Duration>,
    pub allow_credentials: Option<bool>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum UnmatchedPreflights {
    #[default]
    Unspecified,
    Forward,
    Ignore,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Headers {
    pub request: Option<HeaderOperations>,
    pub response: Option<HeaderOperations>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(default)]
pub struct HeaderOperations {
    pub set: BTreeMap<String, String>,
    pub add: BTreeMap<String, String>,
    pub remove: Vec<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct TlsRoute {
    #[serde(rename = "match")]
    pub matches: Vec<TlsMatch>,
    pub route: Vec<RouteDestination>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct TlsMatch {
    pub sni_hosts: Vec<String>,
    pub destination_subnets: Vec<String>,
    pub port: Option<u32>,
    pub source_labels: BTreeMap<String, String>,
    pub gateways: Vec<String>,
    pub source_namespace: String,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct TcpRoute {
    #[serde(rename = "match")]
    pub matches: Vec<L4Match>,
    pub route: Vec<RouteDestination>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct L4Match {
    pub destination_subnets: Vec<String>,
    pub port: Option<u32>,
    pub source_labels: BTreeMap<String, String>,
    pub gateways: Vec<String>,
    pub source_namespace: String,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(default)]
pub struct RouteDestination {
    pub destination: Destination,
    pub weight: Option<u32>,
}

impl VirtualService {
    pub fn validate(&self) -> Result {
        let delegate = self.hosts.is_empty();
        for (i, host) in self.hosts.iter().enumerate() {
            let field = format!("hosts[{i}]");
            validate::host(&field, host)?;
        }
        validate::export_to("exportTo", &self.export_to)?;
        for (i, gateway) in self.gateways.iter().enumerate() {
            ensure(
                !gateway.is_empty() && gateway.matches('/').count() <= 1,
                &format!("gateways[{i}]"),
                format!(
                    "{} is not `mesh`, `<name>` or `<namespace>/<name>`",
                    Quoted(gateway)
                ),
            )?;
        }
        ensure(
            !self.http.is_empty() || !self.tls.is_empty() || !self.tcp.is_empty(),
            "",
            "http, tls or tcp routes are required",
        )?;
        for (i, route) in self.http.iter().enumerate() {
            route
                .validate(delegate)
                .map_err(|e| e.under(&format!("http[{i}]")))?;
        }
        for (i, route) in self.tls.iter().enumerate() {
            let field = format!("tls[{i}]");
            ensure(
                !route.matches.is_empty(),
                &format!("{field}.match"),
                "a TLS route needs a match (sniHosts)",
            )?;
            for (j, m) in route.matches.iter().enumerate() {
                ensure(
                    !m.sni_hosts.is_empty(),
                    &format!("{field}.match[{j}].sniHosts"),
                    "required",
                )?;
                if let Some(port) = m.port {
                    validate::port(&format!("{field}.match[{j}].port"), port)?;
                }
            }
            validate_destinations(&route.route, &format!("{field}.route"))?;
        }
        for (i, route) in self.tcp.iter().enumerate() {
            let field = format!("tcp[{i}]");
            for (j, m) in route.matches.iter().enumerate() {
                if let Some(port) = m.port {
                    validate::port(&format!("{field}.match[{j}].port"), port)?;
                }
            }
            validate_destinations(&route.route, &format!("{field}.route"))?;
        }
        Ok(())
    }

    /// Whether sidecars apply it (no gateways named, or `mesh` among them).
    pub fn for_mesh(&self) -> bool {
        self.gateways.is_empty() || self.gateways.iter().any(|g| g == "mesh")
    }
}

fn validate_destinations(route: &[RouteDestination], field: &str) -> Result {
    ensure(
        !route.is_empty(),
        field,
        "at least one destination is required",
    )?;
    for (i, d) in route.iter().enumerate() {
        validate_destination(&d.destination, &format!("{field}[{i}].destination"))?;
    }
    Ok(())
}

fn validate_destination(destination: &Destination, field: &str) -> Result {
    validate::host(&format!("{field}.host"), &destination.host)?;
    if let Some(port) = &destination.port {
        validate::port(&format!("{field}.port.number"), port.number)?;
    }
    Ok(())
}

impl HttpRoute {
    fn validate(&self, delegate: bool) -> Result {
        let actions = [
            !self.route.is_empty(),
            self.redirect.is_some(),
            self.direct_response.is_some(),
            self.delegate.is_some(),
        ];
        ensure(
            actions.iter().filter(|a| **a).count() == 1,
            "",
            "exactly one of route, redirect, directResponse, delegate",
        )?;
        ensure(
            !(delegate && self.delegate.is_some()),
            "delegate",
            "a delegate VirtualService cannot delegate again",
        )?;
        for (i, d) in self.route.iter().enumerate() {
            validate_destination(&d.destination, &format!("route[{i}].destination"))?;
        }
        if self.route.len() > 1 {
            ensure(
                self.route.iter().any(|d| d.weight.unwrap_or(0) > 0),
                "route",
                "weights are required when there are several destinations",
            )?;
        }
        for (i, m) in self.matches.iter().enumerate() {
            if let Some(port) = m.port {
                validate::port(&format!("match[{i}].port"), port)?;
            }
            for (field, value) in [
                ("uri", &m.uri),
                ("method", &m.method),
                ("authority", &m.authority),
            ] {
                if let Some(StringMatch::Regex(re)) = value {
                    ensure(
                        regex_ok(re),
                        &format!("match[{i}].{field}.regex"),
                        format!("{} is not a valid regular expression", Quoted(re)),
                    )?;
                }
            }
        }
        if let Some(retries) = &self.retries {
            ensure(
                retries.attempts >= 0,
                "retries.attempts",
                "must not be negative",
            )?;
        }
        if let Some(fault) = &self.fault {
            if let Some(abort) = &fault.abort {
                ensure(
                    abort.http_status.is_none_or(|s| (200..600).contains(&s))
                        || abort.grpc_status.is_some(),
                    "fault.abort.httpStatus",
                    "must be an HTTP status (200-599)",
                )?;
            }
            for (field, percentage) in [
                (
                    "fault.delay.percentage",
                    fault.delay.as_ref().and_then(|d| d.percentage),
                ),
                (
                    "fault.abort.percentage",
                    fault.abort.as_ref().and_then(|a| a.percentage),
                ),
            ] {
                ensure(
                    percentage.is_none_or(|p| (0.0..=100.0).contains(&p.value)),
                    field,
                    "must be within 0-100",
                )?;
            }
        }
        if let Some(mirror) = &self.mirror {
            validate_destination(mirror, "mirror")?;
        }
        // pkg/config/validation/virtualservice.go (validateHTTPRouteConflict, validateHTTPMirrors).
        ensure(
            self.mirror.is_none() || self.mirrors.is_empty(),
            "mirrors",
            "HTTP route cannot contain both mirror and mirrors",
        )?;
        ensure(
            self.mirror_percent.is_none_or(|p| p <= 100),
            "mirrorPercent",
            "must be within 0-100",
        )?;
        let percentages = self
            .mirrors
            .iter()
            .enumerate()
            .map(|(i, m)| (format!("mirrors[{i}].percentage"), m.percentage));
        for (field, percentage) in [("mirrorPercentage".to_string(), self.mirror_percentage)]
            .into_iter()
            .chain(percentages)
        {
            ensure(
                percentage.is_none_or(|p| (0.0..=100.0).contains(&p.value)),
                &field,
                "must be within 0-100",
            )?;
        }
        for (i, m) in self.mirrors.iter().enumerate() {
            validate_destination(&m.destination, &format!("mirrors[{i}].destination"))?;
        }
        if let Some(rewrite) = &self.rewrite {
            rewrite.validate().map_err(|e| e.under("rewrite"))?;
        }
        Ok(())
    }
}

impl HttpRoute {
    /// What the route mirrors and how much of it (None: all), as istiod orders them: `mirror`
    /// first (`mirrorPercentage`, else the deprecated `mirrorPercent`), then `mirrors`; a share of
    /// zero or less mirrors nothing.
    pub fn mirror_policies(&self) -> Vec<(&Destination, Option<Percent>)> {
        let legacy = self.mirror_percent.map(|p| Percent {
            value: f64::from(p),
        });
        let first = self
            .mirror
            .as_ref()
            .map(|d| (d, self.mirror_percentage.or(legacy)));
        let rest = self.mirrors.iter().map(|m| (&m.destination, m.percentage));
        first
            .into_iter()
            .chain(rest)
            .filter(|(_, share)| share.is_none_or(|p| p.value > 0.0))
            .collect()
    }
}

impl HttpRewrite {
    /// pkg/config/validation/virtualservice.go (validateHTTPRewrite).
    fn validate(&self) -> Result {
        ensure(
            !self.uri.is_empty() || !self.authority.is_empty() || self.uri_regex_rewrite.is_some(),
            "",
            "rewrite must specify uri, uriRegexRewrite, or authority",
        )?;
        let Some(regex) = &self.uri_regex_rewrite else {
            return Ok(());
        };
        ensure(
            self.uri.is_empty(),
            "uriRegexRewrite",
            "uri and uriRegexRewrite cannot be used together",
        )?;
        ensure(
            !regex.pattern.is_empty(),
            "uriRegexRewrite.match",
            "a pattern is required",
        )?;
        ensure(
            !regex.rewrite.is_empty(),
            "uriRegexRewrite.rewrite",
            "a rewrite is required",
        )?;
        ensure(
            regex.pattern.len() <= 1024 && regex_ok(&regex.pattern),
            "uriRegexRewrite.match",
            format!(
                "{} is not a valid regular expression",
                Quoted(&regex.pattern)
            ),
        )
    }
}

/// Envoy compiles RE2; a pattern the `regex` crate's syntax refuses is almost surely wrong there too.
fn regex_ok(pattern: &str) -> bool {
    regex_syntax::Parser::new().parse(pattern).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vs(yaml: &str) -> VirtualService {
        serde_yaml_ng::from_str(yaml).unwrap()
    }

    #[test]
    fn a_canary_with_every_feature_validates() {
        let canary = vs("
hosts: [reviews]
http:
- match: [{headers: {end-user: {exact: jason}}, uri: {prefix: /api}}]
  route: [{destination: {host: reviews, subset: v2}}]
- route:
  - {destination: {host: reviews, subset: v1}, weight: 90}
  - {destination: {host: reviews, subset: v2}, weight: 10}
  timeout: 2s
  retries: {attempts: 3, perTryTimeout: 500ms, retryOn: 5xx}
  fault: {abort: {httpStatus: 503, percentage: {value: 50}}}
  mirror: {host: reviews, subset: v3}
  mirrorPercentage: {value: 5}
");
        canary.validate().unwrap();
        assert!(canary.for_mesh());
        assert_eq!(canary.http[1].route[0].weight, Some(90));
    }

    #[test]
    fn refusals_name_the_field() {
        let e =
            vs("hosts: [r]\nhttp: [{route: [{destination: {host: r}}, {destination: {host: r}}]}]")
                .validate()
                .unwrap_err();
        assert_eq!(e.field, "http[0].route");
        let e = vs("hosts: [r]\nhttp: [{match: [{uri: {regex: '(unclosed'}}], route: [{destination: {host: r}}]}]")
            .validate()
            .unwrap_err();
        assert_eq!(e.field, "http[0].match[0].uri.regex");
        let e = vs("hosts: [r]\nhttp: [{route: [{destination: {host: r}}], redirect: {uri: /x}}]")
            .validate()
            .unwrap_err();
        assert_eq!(e.field, "http[0]");
        assert!(vs("hosts: [r]").validate().is_err(), "no routes");
    }
}
