//! VirtualService HTTP routes → Envoy routes, as istiod translates them: each match its own route
//! (in order), weighted destinations, redirects, direct responses, rewrites, timeouts, retries,
//! faults, mirrors, CORS and header edits. Shared by sidecars and gateways.

use std::collections::{BTreeMap, HashMap};

use envoy_types::pb::envoy::config::core::v3::{data_source, DataSource};
use envoy_types::pb::envoy::config::core::v3::{
    header_value_option::HeaderAppendAction, HeaderValue, HeaderValueOption,
    RuntimeFractionalPercent,
};
use envoy_types::pb::envoy::config::route::v3::redirect_action::{
    PathRewriteSpecifier, RedirectResponseCode, SchemeRewriteSpecifier,
};
use envoy_types::pb::envoy::config::route::v3::retry_policy::RetryHostPredicate;
use envoy_types::pb::envoy::config::route::v3::route_action::RequestMirrorPolicy;
use envoy_types::pb::envoy::config::route::v3::weighted_cluster::ClusterWeight;
use envoy_types::pb::envoy::config::route::v3::{
    header_matcher, query_parameter_matcher, retry_policy, route, route_action, route_match,
    DirectResponseAction, HeaderMatcher, QueryParameterMatcher, RedirectAction, RetryPolicy, Route,
    RouteAction, RouteMatch, VirtualHost, WeightedCluster,
};
use envoy_types::pb::envoy::extensions::filters::common::fault::v3::{
    fault_delay::FaultDelaySecifier, FaultDelay,
};
use envoy_types::pb::envoy::extensions::filters::http::cors::v3::CorsPolicy as EnvoyCors;
use envoy_types::pb::envoy::extensions::filters::http::fault::v3::{
    fault_abort::ErrorType, FaultAbort, HttpFault,
};
use envoy_types::pb::envoy::extensions::retry::host::previous_hosts::v3::PreviousHostsPredicate;
use envoy_types::pb::envoy::r#type::matcher::v3::{
    string_matcher::MatchPattern, RegexMatchAndSubstitute, RegexMatcher, StringMatcher,
};
use envoy_types::pb::envoy::r#type::v3::{fractional_percent::DenominatorType, FractionalPercent};
use envoy_types::pb::google::protobuf::{Any, BoolValue, Duration, UInt32Value};
use envoy_types::util::pack_any;

use super::filters::{CORS_FILTER, FAULT_FILTER};
use super::generation::Generation;
use super::names::subset_cluster;
use crate::istio::virtual_service::{
    Destination, HeaderOperations, Headers, HttpMatch, HttpRetry, HttpRoute, Percent, StringMatch,
    UnmatchedPreflights,
};

/// Where the routes are served: which port's traffic they see, and (at a gateway) which gateway.
pub struct RouteContext<'a, 'g> {
    pub g: &'a Generation<'g>,
    pub port: u16,
    /// `<namespace>/<name>` of the gateway, or None on a sidecar (`mesh`).
    pub gateway: Option<&'a str>,
}

/// Envoy routes for a host's VirtualService HTTP routes.
pub fn http_routes(ctx: &RouteContext<'_, '_>, routes: &[HttpRoute]) -> Vec<Route> {
    let mut out = Vec::new();
    for route in routes {
        let action = action(ctx, route);
        let per_filter = per_filter_config(route);
        let (request_add, request_remove) = header_edits(route.headers.as_ref(), true);
        let (response_add, response_remove) = header_edits(route.headers.as_ref(), false);
        let make = |matched: RouteMatch, name: String| Route {
            name,
            r#match: Some(matched),
            action: Some(action.clone()),
            typed_per_filter_config: per_filter.clone(),
            request_headers_to_add: request_add.clone(),
            request_headers_to_remove: request_remove.clone(),
            response_headers_to_add: response_add.clone(),
            response_headers_to_remove: response_remove.clone(),
            ..Default::default()
        };
        if route.matches.is_empty() {
            out.push(make(catch_all_match(), route.name.clone()));
            continue;
        }
        for m in &route.matches {
            if let Some(matched) = route_match(ctx, m) {
                let name = match (route.name.is_empty(), m.name.is_empty()) {
                    (_, false) => format!("{}.{}", route.name, m.name),
                    _ => route.name.clone(),
                };
                out.push(make(matched, name));
            }
        }
    }
    out
}

/// Which of istiod's default routes a virtual host gets (pilot/pkg/networking/core/route/route.go).
#[derive(Clone, Copy, PartialEq)]
pub(super) enum DefaultRoute<'a> {
    /// To a service (`BuildDefaultHTTPOutboundRoute`): the mesh's `defaultHttpRetryPolicy` (else
    /// Istio's default retries), no timeout, and the client's `grpc-timeout` honoured.
    Outbound(Option<&'a HttpRetry>),
    /// To the passthrough cluster (`allow_any`, `buildCatchAllVirtualHost`): no retries, no
    /// timeout.
    Passthrough,
    /// To the local workload (`BuildDefaultHTTPInboundRoute`): retried only when reset before
    /// the request reached it (never on gRPC ports, whose streams that breaks), no timeout, the
    /// `grpc-timeout` header honoured without a bound.
    Inbound { grpc: bool },
}

/// A virtual host with one of Istio's default routes: everything to `cluster`.
pub(super) fn virtual_host(
    name: &str,
    domains: Vec<String>,
    cluster: &str,
    kind: DefaultRoute<'_>,
) -> VirtualHost {
    let mut action = RouteAction {
        cluster_specifier: Some(route_action::ClusterSpecifier::Cluster(cluster.to_string())),
        // No timeout: long streams must not be cut.
        timeout: Some(proto_duration(0, 0)),
        ..Default::default()
    };
    match kind {
        DefaultRoute::Outbound(mesh_retries) => {
            action.retry_policy = retry_policy(&HttpRoute::default(), mesh_retries);
            set_grpc_timeout(&mut action);
        }
        DefaultRoute::Passthrough => set_grpc_timeout(&mut action),
        DefaultRoute::Inbound { grpc } => {
            action.max_stream_duration = Some(route_action::MaxStreamDuration {
                max_stream_duration: Some(proto_duration(0, 0)),
                grpc_timeout_header_max: Some(proto_duration(0, 0)),
                ..Default::default()
            });
            action.retry_policy = (!grpc).then(|| RetryPolicy {
                retry_on: INBOUND_RETRY_ON.to_string(),
                num_retries: Some(UInt32Value { value: 2 }),
                ..Default::default()
            });
        }
    }
    VirtualHost {
        name: name.to_string(),
        domains,
        // Applications see `x-envoy-attempt-count` from the client's sidecar (istiod's
        // `proxyHeaders` default; not on inbound routes).
        include_request_attempt_count: !matches!(kind, DefaultRoute::Inbound { .. }),
        routes: vec![Route {
            name: "default".to_string(),
            r#match: Some(RouteMatch {
                path_specifier: Some(route_match::PathSpecifier::Prefix("/".to_string())),
                ..Default::default()
            }),
            action: Some(route::Action::Route(action)),
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// Envoy applies a gRPC client's `grpc-timeout` header, bounded by the route's timeout (istiod's
/// `setTimeout`: `max_grpc_timeout` is the timeout, zero when there is none).
fn set_grpc_timeout(action: &mut RouteAction) {
    #[allow(deprecated)]
    {
        action.max_grpc_timeout = action.timeout;
    }
}

/// A virtual host answering every request for any host with `status` itself.
pub(super) fn answering_all(name: &str, route_name: &str, status: u32) -> VirtualHost {
    VirtualHost {
        name: name.to_string(),
        domains: vec!["*".to_string()],
        routes: vec![Route {
            name: route_name.to_string(),
            r#match: Some(RouteMatch {
                path_specifier: Some(route_match::PathSpecifier::Prefix("/".to_string())),
                ..Default::default()
            }),
            action: Some(route::Action::DirectResponse(DirectResponseAction {
                status,
                ..Default::default()
            })),
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn catch_all_match() -> RouteMatch {
    RouteMatch {
        path_specifier: Some(route_match::PathSpecifier::Prefix("/".to_string())),
        ..Default::default()
    }
}

/// A VirtualService match as an Envoy route match; None when it cannot apply here (another
/// port, another client, another gateway).
fn route_match(ctx: &RouteContext<'_, '_>, m: &HttpMatch) -> Option<RouteMatch> {
    if m.port.is_some_and(|p| p != u32::from(ctx.port)) {
        return None;
    }
    let g = ctx.g;
    if !m
        .source_labels
        .iter()
        .all(|(k, v)| g.source_labels().get(k) == Some(v))
    {
        return None;
    }
    if !m.source_namespace.is_empty() && *m.source_namespace != *g.source_namespace() {
        return None;
    }
    if !m.gateways.is_empty() {
        let here = ctx.gateway.unwrap_or("mesh");
        let applies = m.gateways.iter().any(|g| {
            g == here
                || ctx
                    .gateway
                    .is_some_and(|gw| gw.rsplit('/').next() == Some(g.as_str()))
        });
        if !applies {
            return None;
        }
    }
    let case_sensitive = Some(BoolValue {
        value: !m.ignore_uri_case,
    });
    let path_specifier = Some(match &m.uri {
        None => route_match::PathSpecifier::Prefix("/".to_string()),
        Some(StringMatch::Exact(path)) => route_match::PathSpecifier::Path(path.clone()),
        Some(StringMatch::Prefix(prefix)) => route_match::PathSpecifier::Prefix(prefix.clone()),
        Some(StringMatch::Regex(re)) => route_match::PathSpecifier::SafeRegex(regex(re)),
        Some(StringMatch::PathSeparatedPrefix(prefix)) => {
            route_match::PathSpecifier::PathSeparatedPrefix(prefix.clone())
        }
    });
    let mut headers: Vec<HeaderMatcher> = Vec::new();
    for (name, value) in [
        (":method", &m.method),
        (":authority", &m.authority),
        (":scheme", &m.scheme),
    ] {
        if let Some(value) = value {
            headers.push(header_matcher(name, value, false));
        }
    }
    headers.extend(m.headers.iter().map(|(n, v)| header_matcher(n, v, false)));
    headers.extend(
        m.without_headers
            .iter()
            .map(|(n, v)| header_matcher(n, v, true)),
    );
    let query_parameters = m
        .query_params
        .iter()
        .map(|(name, value)| QueryParameterMatcher {
            name: name.clone(),
            query_parameter_match_specifier: Some(
                query_parameter_matcher::QueryParameterMatchSpecifier::StringMatch(string_matcher(
                    value,
                )),
            ),
        })
        .collect();
    Some(RouteMatch {
        path_specifier,
        case_sensitive,
        headers,
        query_parameters,
        ..Default::default()
    })
}

fn header_matcher(name: &str, value: &StringMatch, invert: bool) -> HeaderMatcher {
    HeaderMatcher {
        name: name.to_string(),
        invert_match: invert,
        header_match_specifier: Some(header_matcher::HeaderMatchSpecifier::StringMatch(
            string_matcher(value),
        )),
        ..Default::default()
    }
}

fn string_matcher(value: &StringMatch) -> StringMatcher {
    StringMatcher {
        match_pattern: Some(match value {
            StringMatch::Exact(v) => MatchPattern::Exact(v.clone()),
            StringMatch::Prefix(v) | StringMatch::PathSeparatedPrefix(v) => {
                MatchPattern::Prefix(v.clone())
            }
            StringMatch::Regex(v) => MatchPattern::SafeRegex(regex(v)),
        }),
        ..Default::default()
    }
}

fn regex(pattern: &str) -> RegexMatcher {
    RegexMatcher {
        regex: pattern.to_string(),
        ..Default::default()
    }
}

/// What the route does: forward (weighted), redirect or answer.
fn action(ctx: &RouteContext<'_, '_>, route: &HttpRoute) -> route::Action {
    if let Some(redirect) = &route.redirect {
        return route::Action::Redirect(RedirectAction {
            host_redirect: redirect.authority.clone(),
            port_redirect: redirect.port.unwrap_or(0),
            path_rewrite_specifier: (!redirect.uri.is_empty()).then(|| {
                match redirect.uri_replaces_prefix {
                    true => PathRewriteSpecifier::PrefixRewrite(redirect.uri.clone()),
                    false => PathRewriteSpecifier::PathRedirect(redirect.uri.clone()),
                }
            }),
            scheme_rewrite_specifier: (!redirect.scheme.is_empty())
                .then(|| SchemeRewriteSpecifier::SchemeRedirect(redirect.scheme.clone())),
            response_code: match redirect.redirect_code.unwrap_or(301) {
                302 => RedirectResponseCode::Found,
                303 => RedirectResponseCode::SeeOther,
                307 => RedirectResponseCode::TemporaryRedirect,
                308 => RedirectResponseCode::PermanentRedirect,
                _ => RedirectResponseCode::MovedPermanently,
            } as i32,
            ..Default::default()
        });
    }
    if let Some(direct) = &route.direct_response {
        return route::Action::DirectResponse(DirectResponseAction {
            status: direct.status,
            body: direct
                .body
                .as_ref()
                .and_then(|b| b.string.clone())
                .map(|text| DataSource {
                    specifier: Some(data_source::Specifier::InlineString(text)),
                    ..Default::default()
                }),
            ..Default::default()
        });
    }
    let cluster_specifier = match route.route.as_slice() {
        [single] => route_action::ClusterSpecifier::Cluster(cluster_for(ctx, &single.destination)),
        several => route_action::ClusterSpecifier::WeightedClusters(WeightedCluster {
            clusters: several
                .iter()
                .filter(|d| d.weight.unwrap_or(0) > 0)
                .map(|d| {
                    let (request_add, request_remove) = header_edits(d.headers.as_ref(), true);
                    let (response_add, response_remove) = header_edits(d.headers.as_ref(), false);
                    ClusterWeight {
                        name: cluster_for(ctx, &d.destination),
                        weight: Some(UInt32Value {
                            value: d.weight.unwrap_or(0),
                        }),
                        request_headers_to_add: request_add,
                        request_headers_to_remove: request_remove,
                        response_headers_to_add: response_add,
                        response_headers_to_remove: response_remove,
                        ..Default::default()
                    }
                })
                .collect(),
            ..Default::default()
        }),
    };
    let rewrite = route.rewrite.as_ref();
    let mut action = RouteAction {
        cluster_specifier: Some(cluster_specifier),
        // No timeout unless the route names one, as Istio: long streams must not be cut.
        timeout: Some(route.timeout.map_or(proto_duration(0, 0), |t| t.to_proto())),
        retry_policy: retry_policy(
            route,
            ctx.g.mesh_config().default_http_retry_policy.as_ref(),
        ),
        prefix_rewrite: rewrite
            .filter(|r| r.uri_regex_rewrite.is_none())
            .map(|r| r.uri.clone())
            .unwrap_or_default(),
        regex_rewrite: rewrite.and_then(|r| r.uri_regex_rewrite.as_ref()).map(|r| {
            RegexMatchAndSubstitute {
                pattern: Some(RegexMatcher {
                    regex: r.pattern.clone(),
                    ..Default::default()
                }),
                substitution: r.rewrite.clone(),
            }
        }),
        request_mirror_policies: route
            .mirror_policies()
            .into_iter()
            .map(|(mirror, share)| RequestMirrorPolicy {
                cluster: cluster_for(ctx, mirror),
                runtime_fraction: share.map(|p| RuntimeFractionalPercent {
                    default_value: Some(fraction(p)),
                    ..Default::default()
                }),
                trace_sampled: Some(BoolValue { value: false }),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    };
    set_grpc_timeout(&mut action);
    if route.gateway_semantics {
        action.cluster_not_found_response_code =
            route_action::ClusterNotFoundResponseCode::InternalServerError as i32;
    }
    if let Some(authority) = rewrite
        .map(|r| r.authority.as_str())
        .filter(|a| !a.is_empty())
    {
        action.host_rewrite_specifier = Some(
            route_action::HostRewriteSpecifier::HostRewriteLiteral(authority.to_string()),
        );
    }
    route::Action::Route(action)
}

/// The outbound cluster a destination names: its port, else the service's only port, else the
/// port the request came in on.
pub fn cluster_for(ctx: &RouteContext<'_, '_>, destination: &Destination) -> String {
    let port = destination
        .port
        .as_ref()
        .and_then(|p| u16::try_from(p.number).ok())
        .or_else(|| {
            let service = ctx.g.service(&destination.host)?;
            match service.ports.as_slice() {
                [only] => Some(only.port),
                _ => None,
            }
        })
        .unwrap_or(ctx.port);
    subset_cluster(port, &destination.subset, &destination.host)
}

/// The route's retries, else Istio's default (2 attempts on connection failures and refused or
/// cancelled streams, each to another host); none for `attempts: 0`. As istiod's `ConvertPolicy`
/// (pilot/pkg/networking/core/route/retry/retry.go), which since 1.24 no longer retries 503s by
/// default: an application's 503 may have had effects.
pub fn retry_policy(route: &HttpRoute, mesh_retries: Option<&HttpRetry>) -> Option<RetryPolicy> {
    // The route's own, else the mesh's `defaultHttpRetryPolicy`, else Istio's default.
    let retries = route.retries.as_ref().or(mesh_retries);
    if retries.is_some_and(|r| r.attempts <= 0) {
        return None;
    }
    let retry_on = retries
        .map(|r| r.retry_on.as_str())
        .filter(|r| !r.is_empty())
        .unwrap_or(DEFAULT_RETRY_ON);
    let codes: Vec<u32> = retry_on
        .split(',')
        .filter_map(|c| c.trim().parse().ok())
        .collect();
    let conditions: Vec<&str> = retry_on
        .split(',')
        .map(str::trim)
        .filter(|c| c.parse::<u32>().is_err())
        .collect();
    let mut retry_on = conditions.join(",");
    if !codes.is_empty() && !conditions.contains(&"retriable-status-codes") {
        retry_on.push_str(",retriable-status-codes");
    }
    Some(RetryPolicy {
        retry_on,
        num_retries: Some(UInt32Value {
            value: retries.map_or(2, |r| r.attempts.unsigned_abs()),
        }),
        per_try_timeout: retries
            .and_then(|r| r.per_try_timeout)
            .map(|d| d.to_proto()),
        retriable_status_codes: codes,
        host_selection_retry_max_attempts: 5,
        retry_host_predicate: vec![previous_hosts()],
        ..Default::default()
    })
}

/// A retry goes to another host than the one that failed.
fn previous_hosts() -> RetryHostPredicate {
    RetryHostPredicate {
        name: "envoy.retry_host_predicates.previous_hosts".to_string(),
        config_type: Some(retry_policy::retry_host_predicate::ConfigType::TypedConfig(
            pack_any(PreviousHostsPredicate::default()),
        )),
    }
}

const DEFAULT_RETRY_ON: &str =
    "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes";
/// A request reset before it reached the application was never processed: retrying it is safe
/// for any method.
const INBOUND_RETRY_ON: &str = "reset-before-request";

/// The fault and CORS settings of a route, for the HTTP filters of those names.
fn per_filter_config(route: &HttpRoute) -> HashMap<String, Any> {
    let mut out = HashMap::new();
    if let Some(fault) = &route.fault {
        let delay = fault.delay.as_ref().and_then(|d| {
            Some(FaultDelay {
                fault_delay_secifier: Some(FaultDelaySecifier::FixedDelay(
                    d.fixed_delay?.to_proto(),
                )),
                percentage: Some(match (d.percentage, d.percent) {
                    (Some(p), _) => fraction(p),
                    (None, Some(p)) => fraction(Percent {
                        value: f64::from(p),
                    }),
                    (None, None) => fraction(Percent { value: 100.0 }),
                }),
            })
        });
        let abort = fault.abort.as_ref().and_then(|a| {
            let error = match (a.http_status, &a.grpc_status) {
                (Some(status), _) => ErrorType::HttpStatus(status),
                (None, Some(grpc)) => ErrorType::GrpcStatus(grpc_code(grpc)),
                (None, None) => return None,
            };
            Some(FaultAbort {
                error_type: Some(error),
                percentage: Some(fraction(a.percentage.unwrap_or(Percent { value: 100.0 }))),
                ..Default::default()
            })
        });
        out.insert(
            FAULT_FILTER.to_string(),
            pack_any(HttpFault {
                delay,
                abort,
                ..Default::default()
            }),
        );
    }
    if let Some(cors) = &route.cors_policy {
        out.insert(
            CORS_FILTER.to_string(),
            pack_any(EnvoyCors {
                allow_origin_string_match: match cors.allow_origins.is_empty() {
                    false => cors.allow_origins.iter().map(string_matcher).collect(),
                    true => cors
                        .allow_origin
                        .iter()
                        .map(|origin| string_matcher(&StringMatch::Exact(origin.clone())))
                        .collect(),
                },
                forward_not_matching_preflights: Some(BoolValue {
                    value: cors.unmatched_preflights != UnmatchedPreflights::Ignore,
                }),
                allow_methods: cors.allow_methods.join(","),
                allow_headers: cors.allow_headers.join(","),
                expose_headers: cors.expose_headers.join(","),
                max_age: cors
                    .max_age
                    .map(|d| d.as_std().as_secs().to_string())
                    .unwrap_or_default(),
                allow_credentials: cors.allow_credentials.map(|value| BoolValue { value }),
                ..Default::default()
            }),
        );
    }
    out
}

/// gRPC status names (or numbers) as codes.
fn grpc_code(name: &str) -> u32 {
    const NAMES: [&str; 17] = [
        "OK",
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
    ];
    name.parse()
        .ok()
        .or_else(|| {
            NAMES
                .iter()
                .position(|n| n.eq_ignore_ascii_case(name))
                .map(|i| i as u32)
        })
        .unwrap_or(2)
}

/// A percentage as Envoy's fraction of a million (Istio's precision).
fn fraction(p: Percent) -> FractionalPercent {
    FractionalPercent {
        numerator: (p.value.clamp(0.0, 100.0) * 10_000.0).round() as u32,
        denominator: DenominatorType::Million as i32,
    }
}

/// `set` overwrites, `add` appends, `remove` drops; for requests or responses.
fn header_edits(headers: Option<&Headers>, request: bool) -> (Vec<HeaderValueOption>, Vec<String>) {
    let ops: Option<&HeaderOperations> = headers.and_then(|h| match request {
        true => h.request.as_ref(),
        false => h.response.as_ref(),
    });
    let Some(ops) = ops else {
        return (Vec::new(), Vec::new());
    };
    let option =
        |(name, value): (&String, &String), action: HeaderAppendAction| HeaderValueOption {
            header: Some(HeaderValue {
                key: name.clone(),
                value: value.clone(),
                ..Default::default()
            }),
            append_action: action as i32,
            ..Default::default()
        };
    let mut add: Vec<HeaderValueOption> = sorted(&ops.set)
        .map(|kv| option(kv, HeaderAppendAction::OverwriteIfExistsOrAdd))
        .collect();
    add.extend(sorted(&ops.add).map(|kv| option(kv, HeaderAppendAction::AppendIfExistsOrAdd)));
    (add, ops.remove.clone())
}

fn sorted(map: &BTreeMap<String, String>) -> impl Iterator<Item = (&String, &String)> {
    map.iter()
}

fn proto_duration(seconds: i64, nanos: i32) -> Duration {
    Duration { seconds, nanos }
}
