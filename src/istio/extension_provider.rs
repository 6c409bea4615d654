//! Mesh config `extensionProviders` meshpilot serves: Envoy's external authorization over HTTP or
//! gRPC, for CUSTOM AuthorizationPolicies. Other providers (tracing, access logs) are kept as given.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::duration::Duration;
use super::validate::{ensure, Result, ValidationError};
use crate::text::{clip, Quoted};

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ExtensionProvider {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub envoy_ext_authz_http: Option<ExtAuthzHttp>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub envoy_ext_authz_grpc: Option<ExtAuthzGrpc>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub envoy_file_access_log: Option<FileAccessLog>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub zipkin: Option<TracingService>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub opentelemetry: Option<TracingService>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub datadog: Option<TracingService>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skywalking: Option<TracingService>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub envoy_otel_als: Option<OtelAccessLogService>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub envoy_http_als: Option<GrpcAccessLogService>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub envoy_tcp_als: Option<GrpcAccessLogService>,
    /// Istio's stats, scraped by Prometheus (no settings).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prometheus: Option<serde_json::Map<String, serde_json::Value>>,
    /// The other provider kinds, untouched.
    #[serde(flatten)]
    pub other: serde_json::Map<String, serde_json::Value>,
}

/// The providers Istio's default mesh config defines: a file access log to standard output in the
/// mesh config's format, and Istio's metrics for Prometheus.
pub const BUILT_IN_ENVOY: &str = "envoy";
pub const BUILT_IN_PROMETHEUS: &str = "prometheus";

/// `zipkin`, `opentelemetry`, `datadog` or `skywalking`: where spans go, a service of the mesh
/// (`[<namespace>/]<host>`). Fields of these providers meshpilot does not build (headers, timeouts,
/// an HTTP exporter, resource detectors, samplers, access tokens) are reported as not applied.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct TracingService {
    pub service: String,
    pub port: u32,
    pub max_tag_length: u32,
    /// Zipkin: 64-bit trace ids rather than 128.
    pub enable64bit_trace_id: bool,
    /// Zipkin: the collector's path (`/api/v2/spans`).
    pub path: String,
}

/// `envoyOtelAls`: access logs over OpenTelemetry's log service, to a service of the mesh.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct OtelAccessLogService {
    pub service: String,
    pub port: u32,
    pub log_name: String,
    pub log_format: Option<LogFormat>,
}

/// `envoyHttpAls` / `envoyTcpAls`: Envoy's gRPC access log service.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct GrpcAccessLogService {
    pub service: String,
    pub port: u32,
    pub log_name: String,
    pub filter_state_objects_to_log: Vec<String>,
    pub additional_request_headers_to_log: Vec<String>,
    pub additional_response_headers_to_log: Vec<String>,
    pub additional_response_trailers_to_log: Vec<String>,
}

/// `envoyFileAccessLog`: Envoy's file access log.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct FileAccessLog {
    /// Empty: /dev/stdout.
    pub path: String,
    pub log_format: Option<LogFormat>,
    pub omit_empty_values: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(default)]
pub struct LogFormat {
    pub text: String,
    /// JSON keys and their command operators.
    pub labels: Option<serde_json::Map<String, serde_json::Value>>,
}

impl ExtensionProvider {
    /// One of the providers Istio's default mesh config defines, by name (any case).
    pub fn built_in(name: &str) -> Option<Self> {
        if name.eq_ignore_ascii_case(BUILT_IN_ENVOY) {
            return Some(Self {
                name: BUILT_IN_ENVOY.into(),
                envoy_file_access_log: Some(FileAccessLog {
                    path: "/dev/stdout".into(),
                    ..Default::default()
                }),
                ..Default::default()
            });
        }
        name.eq_ignore_ascii_case(BUILT_IN_PROMETHEUS)
            .then(|| Self {
                name: BUILT_IN_PROMETHEUS.into(),
                prometheus: Some(Default::default()),
                ..Default::default()
            })
    }
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ExtAuthzHttp {
    /// `[<namespace>/]<hostname>` of a service in the mesh.
    pub service: String,
    pub port: u32,
    pub timeout: Option<Duration>,
    pub path_prefix: String,
    pub fail_open: bool,
    pub status_on_error: String,
    pub include_request_headers_in_check: Vec<String>,
    /// Deprecated form of `includeRequestHeadersInCheck`.
    pub include_headers_in_check: Vec<String>,
    pub include_additional_headers_in_check: BTreeMap<String, String>,
    pub include_request_body_in_check: Option<RequestBody>,
    pub headers_to_upstream_on_allow: Vec<String>,
    pub headers_to_downstream_on_deny: Vec<String>,
    pub headers_to_downstream_on_allow: Vec<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ExtAuthzGrpc {
    pub service: String,
    pub port: u32,
    pub timeout: Option<Duration>,
    pub fail_open: bool,
    pub status_on_error: String,
    pub include_request_body_in_check: Option<RequestBody>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct RequestBody {
    pub max_request_bytes: u32,
    pub allow_partial_message: bool,
    pub pack_as_bytes: bool,
}

/// Names unique and present; ext_authz providers with a service, a port, a known status and no
/// lone `*` header patterns.
pub fn validate(providers: &[ExtensionProvider]) -> Result {
    for (i, provider) in providers.iter().enumerate() {
        let at = format!("extensionProviders[{i}]");
        ensure(
            !provider.name.is_empty(),
            &format!("{at}.name"),
            "must not be empty",
        )?;
        ensure(
            !providers[..i].iter().any(|p| p.name == provider.name),
            &format!("{at}.name"),
            format!("must be unique, found duplicate: {}", clip(&provider.name)),
        )?;
        if let Some(http) = &provider.envoy_ext_authz_http {
            http.validate()
                .map_err(|e| e.under(&format!("{at}.envoyExtAuthzHttp")))?;
        }
        let services = [
            (
                "zipkin",
                provider.zipkin.as_ref().map(|t| (&t.service, t.port)),
            ),
            (
                "opentelemetry",
                provider
                    .opentelemetry
                    .as_ref()
                    .map(|t| (&t.service, t.port)),
            ),
            (
                "datadog",
                provider.datadog.as_ref().map(|t| (&t.service, t.port)),
            ),
            (
                "skywalking",
                provider.skywalking.as_ref().map(|t| (&t.service, t.port)),
            ),
            (
                "envoyOtelAls",
                provider
                    .envoy_otel_als
                    .as_ref()
                    .map(|a| (&a.service, a.port)),
            ),
            (
                "envoyHttpAls",
                provider
                    .envoy_http_als
                    .as_ref()
                    .map(|a| (&a.service, a.port)),
            ),
            (
                "envoyTcpAls",
                provider
                    .envoy_tcp_als
                    .as_ref()
                    .map(|a| (&a.service, a.port)),
            ),
        ];
        for (kind, service) in services {
            if let Some((service, port)) = service {
                service_and_port(service, port, "")
                    .map_err(|e| e.under(&format!("{at}.{kind}")))?;
            }
        }
        if let Some(grpc) = &provider.envoy_ext_authz_grpc {
            service_and_port(&grpc.service, grpc.port, &grpc.status_on_error)
                .map_err(|e| e.under(&format!("{at}.envoyExtAuthzGrpc")))?;
        }
    }
    Ok(())
}

impl ExtAuthzHttp {
    fn validate(&self) -> Result {
        service_and_port(&self.service, self.port, &self.status_on_error)?;
        ensure(
            self.path_prefix.is_empty() || self.path_prefix.starts_with('/'),
            "pathPrefix",
            format!("must begin with `/`, found: {}", Quoted(&self.path_prefix)),
        )?;
        for (field, values) in [
            (
                "includeRequestHeadersInCheck",
                &self.include_request_headers_in_check,
            ),
            ("includeHeadersInCheck", &self.include_headers_in_check),
            (
                "headersToUpstreamOnAllow",
                &self.headers_to_upstream_on_allow,
            ),
            (
                "headersToDownstreamOnDeny",
                &self.headers_to_downstream_on_deny,
            ),
            (
                "headersToDownstreamOnAllow",
                &self.headers_to_downstream_on_allow,
            ),
        ] {
            ensure(
                !values.iter().any(|v| v == "*"),
                field,
                "a single wildcard (\"*\") is not supported, change it to either prefix or suffix match",
            )?;
        }
        Ok(())
    }
}

fn service_and_port(service: &str, port: u32, status_on_error: &str) -> Result {
    ensure(!service.is_empty(), "service", "must not be empty")?;
    ensure(
        (1..=65535).contains(&port),
        "port",
        format!("port must be in the range [1, 65535], found: {port}"),
    )?;
    status_code(status_on_error)
        .map(|_| ())
        .map_err(|e| ValidationError::at("statusOnError", e))
}

/// `statusOnError`: empty, or an HTTP status code Envoy knows (100–599).
pub fn status_code(text: &str) -> std::result::Result<Option<u16>, String> {
    if text.is_empty() {
        return Ok(None);
    }
    match text.parse::<u16>() {
        Ok(code) if (100..=599).contains(&code) => Ok(Some(code)),
        _ => Err(format!("unsupported statusOnError {}", clip(text))),
    }
}

/// `[<namespace>/]<hostname>`.
pub fn split_service(service: &str) -> (Option<&str>, &str) {
    match service.split_once('/') {
        Some((ns, host)) => (Some(ns), host),
        None => (None, service),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn providers_parse_and_validate() {
        let providers: Vec<ExtensionProvider> = serde_json::from_value(serde_json::json!([
            {"name": "authz", "envoyExtAuthzHttp": {"service": "ext.foo.svc.cluster.local", "port": 8000, "includeRequestHeadersInCheck": ["x-ext-authz"]}},
            {"name": "otel", "opentelemetry": {"service": "otel", "port": 4317}},
            {"name": "sd", "stackdriver": {}}
        ]))
        .unwrap();
        assert!(validate(&providers).is_ok());
        assert_eq!(
            providers[1].opentelemetry.as_ref().map(|o| o.port),
            Some(4317)
        );
        assert!(providers[2].other.contains_key("stackdriver"));
        let mut dup = providers.clone();
        dup[1].name = "authz".into();
        assert_eq!(
            validate(&dup).unwrap_err().field,
            "extensionProviders[1].name"
        );
        let mut bad = providers;
        if let Some(http) = bad[0].envoy_ext_authz_http.as_mut() {
            http.port = 0;
        }
        assert_eq!(
            validate(&bad).unwrap_err().field,
            "extensionProviders[0].envoyExtAuthzHttp.port"
        );
        assert_eq!(
            split_service("foo/ext.foo.svc"),
            (Some("foo"), "ext.foo.svc")
        );
    }
}
