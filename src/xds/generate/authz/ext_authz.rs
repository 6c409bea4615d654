//! CUSTOM authorization: the mesh config's ext_authz provider as Envoy's ext_authz filters, enabled
//! only for requests a CUSTOM rule matched (the RBAC filter before them marks those in dynamic
//! metadata, as istiod arranges it).

use envoy_types::pb::envoy::config::core::v3::{
    grpc_service, http_uri, ApiVersion, GrpcService, HeaderValue, HttpUri,
};
use envoy_types::pb::envoy::extensions::filters::http::ext_authz::v3 as http;
use envoy_types::pb::envoy::extensions::filters::network::ext_authz::v3 as network;
use envoy_types::pb::envoy::r#type::matcher::v3::{
    ListStringMatcher, MetadataMatcher, StringMatcher,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::Duration;

use super::matchers;
use crate::istio::extension_provider::{self, ExtAuthzGrpc, ExtAuthzHttp, RequestBody};
use crate::model::MeshSnapshot;
use crate::xds::generate::names::outbound_cluster;

/// Names of CUSTOM rules start with this; the ext_authz filter runs when the matched one does.
pub const MATCH_PREFIX: &str = "istio-ext-authz";
/// The RBAC shadow rules' stat prefix, which also prefixes their dynamic metadata keys.
pub const SHADOW_PREFIX: &str = "istio_ext_authz_";
pub const HTTP_RBAC: &str = "envoy.filters.http.rbac";
pub const NETWORK_RBAC: &str = "envoy.filters.network.rbac";

/// A provider as filters: always for HTTP, for TCP only over gRPC.
pub struct ExtAuthz {
    pub http: http::ExtAuthz,
    pub tcp: Option<network::ExtAuthz>,
}

/// The named provider, with its service resolved to an outbound cluster.
pub fn resolve(mesh: &MeshSnapshot, name: &str) -> Result<ExtAuthz, String> {
    let providers = &mesh.config.mesh().extension_providers;
    let provider = providers.iter().find(|p| p.name == name).ok_or_else(|| {
        let names: Vec<&str> = providers.iter().map(|p| p.name.as_str()).collect();
        format!("available providers are {names:?} but found {name:?}")
    })?;
    if let Some(config) = &provider.envoy_ext_authz_http {
        return http_provider(mesh, config);
    }
    if let Some(config) = &provider.envoy_ext_authz_grpc {
        return grpc_provider(mesh, config);
    }
    Err(format!("provider {name:?} is not an ext_authz provider"))
}

/// `outbound|<port>||<host>` of the provider's service, which must be in the registry.
fn cluster(mesh: &MeshSnapshot, service: &str, port: u32) -> Result<(String, String), String> {
    let (namespace, host) = extension_provider::split_service(service);
    let found = mesh
        .services
        .get(host)
        .filter(|s| namespace.is_none_or(|ns| *s.namespace == *ns));
    let port = u16::try_from(port).map_err(|_| format!("port {port} out of range"))?;
    match found {
        Some(s) => Ok((s.hostname.to_string(), outbound_cluster(port, &s.hostname))),
        None => Err(format!("could not find service {service:?} in the mesh")),
    }
}

fn timeout(t: Option<crate::istio::duration::Duration>) -> Duration {
    // istiod's default: 600s.
    let t = t.map_or(std::time::Duration::from_secs(600), |d| d.as_std());
    Duration {
        seconds: i64::try_from(t.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(t.subsec_nanos()).unwrap_or(0),
    }
}

fn status(text: &str) -> Result<Option<HttpStatus>, String> {
    Ok(
        extension_provider::status_code(text)?.map(|code| HttpStatus {
            code: i32::from(code),
        }),
    )
}

fn body(settings: &Option<RequestBody>) -> Option<http::BufferSettings> {
    settings.as_ref().map(|b| http::BufferSettings {
        max_request_bytes: b.max_request_bytes,
        allow_partial_message: b.allow_partial_message,
        pack_as_bytes: b.pack_as_bytes,
    })
}

/// Header patterns (ignoring case; `*` leading or trailing).
fn headers(patterns: &[String]) -> Option<ListStringMatcher> {
    if patterns.is_empty() {
        return None;
    }
    let patterns: Vec<StringMatcher> = patterns
        .iter()
        .map(|h| {
            if let Some(rest) = h.strip_prefix('*') {
                matchers::suffix(rest, true)
            } else if let Some(rest) = h.strip_suffix('*') {
                matchers::prefix(rest, true)
            } else {
                matchers::exact(h, true)
            }
        })
        .collect();
    Some(ListStringMatcher { patterns })
}

/// Runs the filter only when a CUSTOM rule matched (`filter` is the RBAC filter's name).
fn enabled_by(filter: &str) -> MetadataMatcher {
    let key = format!("{SHADOW_PREFIX}shadow_effective_policy_id");
    let matched = matchers::value(matchers::prefix(MATCH_PREFIX, false));
    matchers::metadata(filter, &[&key], matched)
}

fn http_provider(mesh: &MeshSnapshot, config: &ExtAuthzHttp) -> Result<ExtAuthz, String> {
    let (hostname, cluster) = cluster(mesh, &config.service, config.port)?;
    let allowed = match config.include_request_headers_in_check.is_empty() {
        true => headers(&config.include_headers_in_check),
        false => headers(&config.include_request_headers_in_check),
    };
    let to_add: Vec<HeaderValue> = config
        .include_additional_headers_in_check
        .iter()
        .map(|(key, value)| HeaderValue {
            key: key.clone(),
            value: value.clone(),
            ..Default::default()
        })
        .collect();
    let request = (!to_add.is_empty()).then(|| http::AuthorizationRequest {
        headers_to_add: to_add,
        ..Default::default()
    });
    let response_headers = [
        &config.headers_to_upstream_on_allow,
        &config.headers_to_downstream_on_deny,
        &config.headers_to_downstream_on_allow,
    ];
    let response =
        response_headers
            .iter()
            .any(|h| !h.is_empty())
            .then(|| http::AuthorizationResponse {
                allowed_upstream_headers: headers(&config.headers_to_upstream_on_allow),
                allowed_client_headers: headers(&config.headers_to_downstream_on_deny),
                allowed_client_headers_on_success: headers(&config.headers_to_downstream_on_allow),
                ..Default::default()
            });
    let service = http::HttpService {
        server_uri: Some(HttpUri {
            // Required, but the cluster decides where requests go.
            uri: format!("http://{hostname}"),
            timeout: Some(timeout(config.timeout)),
            http_upstream_type: Some(http_uri::HttpUpstreamType::Cluster(cluster)),
        }),
        path_prefix: config.path_prefix.clone(),
        authorization_request: request,
        authorization_response: response,
        ..Default::default()
    };
    Ok(ExtAuthz {
        http: http::ExtAuthz {
            transport_api_version: ApiVersion::V3 as i32,
            failure_mode_allow: config.fail_open,
            status_on_error: status(&config.status_on_error)?,
            with_request_body: body(&config.include_request_body_in_check),
            allowed_headers: allowed,
            filter_enabled_metadata: Some(enabled_by(HTTP_RBAC)),
            services: Some(http::ext_authz::Services::HttpService(service)),
            ..Default::default()
        },
        tcp: None,
    })
}

fn grpc_provider(mesh: &MeshSnapshot, config: &ExtAuthzGrpc) -> Result<ExtAuthz, String> {
    let (_, cluster) = cluster(mesh, &config.service, config.port)?;
    let service = GrpcService {
        target_specifier: Some(grpc_service::TargetSpecifier::EnvoyGrpc(
            grpc_service::EnvoyGrpc {
                // `|` is not valid in an authority.
                authority: cluster.replace('|', "_."),
                cluster_name: cluster,
                ..Default::default()
            },
        )),
        timeout: Some(timeout(config.timeout)),
        ..Default::default()
    };
    Ok(ExtAuthz {
        http: http::ExtAuthz {
            transport_api_version: ApiVersion::V3 as i32,
            failure_mode_allow: config.fail_open,
            status_on_error: status(&config.status_on_error)?,
            with_request_body: body(&config.include_request_body_in_check),
            filter_enabled_metadata: Some(enabled_by(HTTP_RBAC)),
            services: Some(http::ext_authz::Services::GrpcService(service.clone())),
            ..Default::default()
        },
        tcp: Some(network::ExtAuthz {
            stat_prefix: "tcp.".into(),
            grpc_service: Some(service),
            failure_mode_allow: config.fail_open,
            transport_api_version: ApiVersion::V3 as i32,
            filter_enabled_metadata: Some(enabled_by(NETWORK_RBAC)),
            ..Default::default()
        }),
    })
}
