//! HTTPRoute and GRPCRoute rules as VirtualService HTTP routes: one route per match (so routes of
//! many HTTPRoutes can be ordered by the API's precedence), filters as header edits, redirects,
//! rewrites and mirrors, backends as weighted destinations; a rule with no usable backend answers
//! 500, as the API requires.

use std::cmp::Reverse;
use std::collections::BTreeMap;

use super::status::Refusal;
use super::RouteCtx;
use crate::istio::gateway_api::route::{
    BackendRef, Filter, GrpcMatch, GrpcRule, HeaderModifier, HttpMatch as ApiMatch, HttpRule,
    PathModifier, ValueMatch,
};
use crate::istio::virtual_service::{
    Destination, DirectResponse, HeaderOperations, Headers, HttpMatch, HttpMirrorPolicy,
    HttpRedirect, HttpRetry, HttpRewrite, HttpRoute, HttpRouteDestination, Percent, PortSelector,
    RegexRewrite, StringMatch,
};

/// The host of a backend that cannot be used: no cluster has it, so its requests answer 500.
const UNKNOWN_SERVICE: &str = "UnknownService";

/// The API's precedence among routes for one host: exact paths, then longer prefixes, then
/// regular expressions; a method; more headers; more query parameters; then the older route (by
/// creation, then namespace and name) and the rule's and match's order within it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Rank {
    path_kind: u8,
    path_len: Reverse<usize>,
    no_method: bool,
    headers: Reverse<usize>,
    query: Reverse<usize>,
    order: (Option<String>, String, String, usize, usize),
}

/// One route of a host's VirtualService, with its rank.
pub(super) type Ranked = (Rank, HttpRoute);

/// What a rule compiles to: its routes, why a reference was refused, and the backends it uses.
#[derive(Default)]
pub(super) struct Compiled {
    pub routes: Vec<Ranked>,
    pub refusal: Option<Refusal>,
    pub backends: Vec<String>,
}

pub(super) fn http_rule(ctx: &RouteCtx<'_>, index: usize, rule: &HttpRule) -> Compiled {
    let mut out = Compiled::default();
    let mut base = common(ctx, index, &rule.filters, &rule.backend_refs, &mut out);
    // As istiod: without `retry` the mesh's default retries stay; `retry` retries connection
    // failures and its codes; `backendRequest` bounds each try when retrying, else the request.
    if let Some(retry) = &rule.retry {
        let codes = retry.codes.iter().map(|c| format!(",{c}"));
        base.retries = Some(HttpRetry {
            attempts: retry
                .attempts
                .map_or(2, |a| i32::try_from(a).unwrap_or(i32::MAX)),
            retry_on: std::iter::once(GATEWAY_RETRY_ON.to_string())
                .chain(codes)
                .collect(),
            ..Default::default()
        });
    }
    if let Some(t) = &rule.timeouts {
        base.timeout = t.request.filter(|d| !d.0.is_zero());
        match (&mut base.retries, t.backend_request) {
            (Some(retries), Some(per_try)) => retries.per_try_timeout = Some(per_try),
            (None, Some(per_try)) => base.timeout = Some(per_try),
            (_, None) => {}
        }
    }
    let implied = [ApiMatch::default()];
    let matches = match rule.matches.is_empty() {
        true => &implied[..],
        false => &rule.matches[..],
    };
    for (m_index, m) in matches.iter().enumerate() {
        let path = m.path.as_ref();
        let (kind, value) = path.map_or(("PathPrefix", "/"), |p| (p.kind(), p.value()));
        let uri = match kind {
            "Exact" => StringMatch::Exact(value.to_string()),
            "RegularExpression" => StringMatch::Regex(value.to_string()),
            _ if value == "/" => StringMatch::Prefix("/".into()),
            _ => StringMatch::PathSeparatedPrefix(value.trim_end_matches('/').to_string()),
        };
        let matched = HttpMatch {
            uri: Some(uri),
            headers: values(&m.headers),
            query_params: m
                .query_params
                .iter()
                .map(|q| (q.name.clone(), value_match(q)))
                .collect(),
            method: m.method.clone().map(StringMatch::Exact),
            ..Default::default()
        };
        let mut route = base.clone();
        route.matches = vec![matched];
        path_edits(&mut route, &rule.filters, kind, value);
        let rank = Rank {
            path_kind: match kind {
                "Exact" => 0,
                "PathPrefix" => 1,
                _ => 2,
            },
            path_len: Reverse(value.len()),
            no_method: m.method.is_none(),
            headers: Reverse(m.headers.len()),
            query: Reverse(m.query_params.len()),
            order: ctx.order(index, m_index),
        };
        out.routes.push((rank, route));
    }
    out
}

pub(super) fn grpc_rule(ctx: &RouteCtx<'_>, index: usize, rule: &GrpcRule) -> Compiled {
    let mut out = Compiled::default();
    let base = common(ctx, index, &rule.filters, &rule.backend_refs, &mut out);
    let implied = [GrpcMatch::default()];
    let matches = match rule.matches.is_empty() {
        true => &implied[..],
        false => &rule.matches[..],
    };
    for (m_index, m) in matches.iter().enumerate() {
        let uri = m.method.as_ref().map(|method| {
            let (service, name) = (method.service.as_deref(), method.method.as_deref());
            match (
                method.kind.as_deref() == Some("RegularExpression"),
                service,
                name,
            ) {
                (false, Some(s), Some(n)) => StringMatch::Exact(format!("/{s}/{n}")),
                (false, Some(s), None) => StringMatch::Prefix(format!("/{s}/")),
                (false, None, Some(n)) => StringMatch::Regex(format!("/[^/]+/{}", escape(n))),
                (_, s, n) => StringMatch::Regex(format!(
                    "/{}/{}",
                    s.unwrap_or("[^/]+"),
                    n.unwrap_or("[^/]+")
                )),
            }
        });
        let exact = matches!(uri, Some(StringMatch::Exact(_)));
        let mut route = base.clone();
        route.matches = vec![HttpMatch {
            uri,
            headers: values(&m.headers),
            ..Default::default()
        }];
        let rank = Rank {
            path_kind: if exact { 0 } else { 1 },
            path_len: Reverse(0),
            no_method: m.method.is_none(),
            headers: Reverse(m.headers.len()),
            query: Reverse(0),
            order: ctx.order(index, m_index),
        };
        out.routes.push((rank, route));
    }
    out
}

/// What every match of a rule shares: header edits, mirrors, the redirect's target and the
/// weighted backends (else a 500).
fn common(
    ctx: &RouteCtx<'_>,
    index: usize,
    filters: &[Filter],
    backends: &[BackendRef],
    out: &mut Compiled,
) -> HttpRoute {
    let mut route = HttpRoute {
        name: format!("{}.{}.{index}", ctx.namespace, ctx.name),
        gateway_semantics: true,
        ..Default::default()
    };
    let mut headers = Headers::default();
    for filter in filters {
        if let Some(m) = &filter.request_header_modifier {
            headers.request = Some(operations(m));
        }
        if let Some(m) = &filter.response_header_modifier {
            headers.response = Some(operations(m));
        }
        if let Some(r) = &filter.request_redirect {
            route.redirect = Some(HttpRedirect {
                authority: r.hostname.clone().unwrap_or_default(),
                port: r.port.map(u32::from),
                scheme: r.scheme.clone().unwrap_or_default(),
                redirect_code: Some(r.status_code.unwrap_or(302)),
                ..Default::default()
            });
        }
        if let Some(mirror) = &filter.request_mirror {
            match ctx.backend(&mirror.backend_ref) {
                Ok(destination) => route.mirrors.push(HttpMirrorPolicy {
                    destination,
                    percentage: mirror.percent().map(|value| Percent { value }),
                }),
                Err(refusal) => out.refusal = out.refusal.take().or(Some(refusal)),
            }
        }
    }
    if headers.request.is_some() || headers.response.is_some() {
        route.headers = Some(headers);
    }
    if route.redirect.is_some() {
        return route;
    }
    for backend in backends {
        match ctx.backend(backend) {
            Ok(destination) => {
                out.backends.push(destination.host.clone());
                let mut edits = Headers::default();
                for f in &backend.filters {
                    if let Some(m) = &f.request_header_modifier {
                        edits.request = Some(operations(m));
                    }
                    if let Some(m) = &f.response_header_modifier {
                        edits.response = Some(operations(m));
                    }
                }
                route.route.push(HttpRouteDestination {
                    destination,
                    weight: Some(backend.weight()),
                    headers: (edits.request.is_some() || edits.response.is_some()).then_some(edits),
                });
            }
            // Its share of the requests answers 500, as the API requires (istiod's cluster).
            Err(refusal) => {
                out.refusal = out.refusal.take().or(Some(refusal));
                route.route.push(HttpRouteDestination {
                    destination: Destination {
                        host: UNKNOWN_SERVICE.into(),
                        port: backend.port.map(|number| PortSelector {
                            number: u32::from(number),
                        }),
                        ..Default::default()
                    },
                    weight: Some(backend.weight()),
                    headers: None,
                });
            }
        }
    }
    if route.route.iter().all(|d| d.weight == Some(0)) {
        route.route.clear();
        route.direct_response = Some(DirectResponse {
            status: 500,
            body: None,
        });
    }
    route
}

/// What a Gateway API `retry` retries besides its codes (istiod's `convertHTTPRoute`).
const GATEWAY_RETRY_ON: &str = "connect-failure,refused-stream,unavailable,cancelled";

/// The redirect's or rewrite's path, which depends on the prefix a match matched.
fn path_edits(route: &mut HttpRoute, filters: &[Filter], kind: &str, matched: &str) {
    for filter in filters {
        if let (Some(redirect), Some(path)) = (
            route.redirect.as_mut(),
            filter
                .request_redirect
                .as_ref()
                .and_then(|r| r.path.as_ref()),
        ) {
            redirect.uri = path.value().to_string();
            redirect.uri_replaces_prefix = path.is_prefix() && kind == "PathPrefix";
        }
        if let Some(rewrite) = &filter.url_rewrite {
            route.rewrite = Some(HttpRewrite {
                authority: rewrite.hostname.clone().unwrap_or_default(),
                ..rewrite
                    .path
                    .as_ref()
                    .map(|p| path_rewrite(p, matched))
                    .unwrap_or_default()
            });
        }
    }
}

/// A path rewrite: the whole path, or the matched prefix (a lone `/` replacement keeps the rest
/// of the path rooted rather than doubling its slash).
fn path_rewrite(path: &PathModifier, matched: &str) -> HttpRewrite {
    let prefix = matched.trim_end_matches('/');
    let regex = |pattern: String| HttpRewrite {
        uri_regex_rewrite: Some(RegexRewrite {
            pattern,
            rewrite: path.value().to_string(),
        }),
        ..Default::default()
    };
    match path.is_prefix() {
        false => regex("^/.*$".into()),
        true if path.value() == "/" && !prefix.is_empty() => {
            regex(format!("^{}/*", escape(prefix)))
        }
        true => HttpRewrite {
            uri: path.value().to_string(),
            ..Default::default()
        },
    }
}

fn operations(m: &HeaderModifier) -> HeaderOperations {
    let pairs = |headers: &[crate::istio::gateway_api::route::Header]| {
        headers
            .iter()
            .map(|h| (h.name.to_ascii_lowercase(), h.value.clone()))
            .collect()
    };
    HeaderOperations {
        set: pairs(&m.set),
        add: pairs(&m.add),
        remove: m.remove.iter().map(|h| h.to_ascii_lowercase()).collect(),
    }
}

/// Header matches by lower-case name; the first match of a name wins, as the API says.
fn values(matches: &[ValueMatch]) -> BTreeMap<String, StringMatch> {
    let mut out = BTreeMap::new();
    for m in matches {
        out.entry(m.name.to_ascii_lowercase())
            .or_insert_with(|| value_match(m));
    }
    out
}

fn value_match(m: &ValueMatch) -> StringMatch {
    match m.is_regex() {
        true => StringMatch::Regex(m.value.clone()),
        false => StringMatch::Exact(m.value.clone()),
    }
}

/// RE2's escaping of a literal.
fn escape(literal: &str) -> String {
    let mut out = String::with_capacity(literal.len());
    for c in literal.chars() {
        if "\\.+*?()|[]{}^$".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn modifier(kind: &str, value: &str) -> PathModifier {
        PathModifier {
            kind: kind.into(),
            replace_full_path: (kind == "ReplaceFullPath").then(|| value.into()),
            replace_prefix_match: (kind == "ReplacePrefixMatch").then(|| value.into()),
        }
    }

    #[test]
    fn path_rewrites_replace_the_prefix_or_the_path() {
        let full = path_rewrite(&modifier("ReplaceFullPath", "/new"), "/old");
        assert_eq!(full.uri_regex_rewrite.unwrap().pattern, "^/.*$");
        let prefix = path_rewrite(&modifier("ReplacePrefixMatch", "/v2"), "/v1");
        assert_eq!(prefix.uri, "/v2");
        let root = path_rewrite(&modifier("ReplacePrefixMatch", "/"), "/api.v1/");
        let regex = root.uri_regex_rewrite.unwrap();
        assert_eq!(
            (regex.pattern.as_str(), regex.rewrite.as_str()),
            ("^/api\\.v1/*", "/")
        );
    }
}
