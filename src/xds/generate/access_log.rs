//! Access logs as istiod writes them (pilot/pkg/networking/core/accesslog.go,
//! pilot/pkg/model/telemetry_logging.go): the Telemetry API's providers for the proxy and the side
//! of the traffic, else the mesh config's `accessLogFile`, in Istio's default text or JSON format
//! unless one is given. Every HTTP connection manager and TCP proxy gets them (not those to the
//! black hole); `virtualOutbound`, `virtualInbound` and gateway listeners also log connections no
//! filter chain matched (response flag NR).

use envoy_types::pb::envoy::config::accesslog::v3::{
    access_log, access_log_filter::FilterSpecifier, extension_filter, AccessLog, AccessLogFilter,
    AndFilter, ExtensionFilter, ResponseFlagFilter,
};
use envoy_types::pb::envoy::config::core::v3::{
    data_source, substitution_format_string::Format, ApiVersion, DataSource, GrpcService,
    JsonFormatOptions, SubstitutionFormatString, TypedExtensionConfig,
};
use envoy_types::pb::envoy::extensions::access_loggers::file::v3::{
    file_access_log::AccessLogFormat, FileAccessLog,
};
use envoy_types::pb::envoy::extensions::access_loggers::filters::cel::v3::ExpressionFilter;
use envoy_types::pb::envoy::extensions::access_loggers::grpc::v3::{
    CommonGrpcAccessLogConfig, HttpGrpcAccessLogConfig, TcpGrpcAccessLogConfig,
};
use envoy_types::pb::envoy::extensions::access_loggers::open_telemetry::v3::OpenTelemetryAccessLogConfig;
use envoy_types::pb::envoy::extensions::formatter::req_without_query::v3::ReqWithoutQuery;
use envoy_types::pb::google::protobuf::{value, Struct, Value};
use envoy_types::pb::opentelemetry::proto::common::v1::{
    any_value, AnyValue, KeyValue, KeyValueList,
};
use envoy_types::util::pack_any;

use super::providers::{cluster_of, envoy_grpc, report_unbuilt};
use crate::istio::extension_provider::{
    self, FileAccessLog as FileProvider, GrpcAccessLogService, OtelAccessLogService,
};
use crate::istio::mesh::AccessLogEncoding;
use crate::istio::telemetry::WorkloadMode;
use crate::istio::MeshConfig;
use crate::model::{ActiveLog, AppliedTelemetry, LogDecision, ServiceTable};

const FILE_LOGGER: &str = "envoy.access_loggers.file";
const OTEL_LOGGER: &str = "envoy.access_loggers.open_telemetry";
const GRPC_HTTP_LOGGER: &str = "envoy.access_loggers.http_grpc";
const GRPC_TCP_LOGGER: &str = "envoy.tcp_grpc_access_log";
const OTEL_LOG_NAME: &str = "otel_envoy_accesslog";
const HTTP_LOG_NAME: &str = "http_envoy_accesslog";
const TCP_LOG_NAME: &str = "tcp_envoy_accesslog";
/// The peers' metadata the gRPC services log (istiod's `envoyStateToLog`), and with the older
/// Wasm keys for OpenTelemetry (`envoyWasmStateToLog`).
const PEER_STATE: [&str; 2] = ["upstream_peer", "downstream_peer"];
const ALL_PEER_STATE: [&str; 6] = [
    "upstream_peer",
    "downstream_peer",
    "wasm.upstream_peer",
    "wasm.upstream_peer_id",
    "wasm.downstream_peer",
    "wasm.downstream_peer_id",
];
const CEL_FILTER: &str = "envoy.access_loggers.extension_filters.cel";
const REQ_WITHOUT_QUERY: &str = "envoy.formatter.req_without_query";
const REQ_WITHOUT_QUERY_OPERATOR: &str = "%REQ_WITHOUT_QUERY";
const STDOUT: &str = "/dev/stdout";

/// Istio's default text format (`EnvoyTextLogFormat`).
pub const DEFAULT_TEXT_FORMAT: &str = "[%START_TIME%] \"%REQ(:METHOD)% %REQ(X-ENVOY-ORIGINAL-PATH?:PATH)% %PROTOCOL%\" %RESPONSE_CODE% %RESPONSE_FLAGS% %RESPONSE_CODE_DETAILS% %CONNECTION_TERMINATION_DETAILS% \"%UPSTREAM_TRANSPORT_FAILURE_REASON%\" %BYTES_RECEIVED% %BYTES_SENT% %DURATION% %RESP(X-ENVOY-UPSTREAM-SERVICE-TIME)% \"%REQ(X-FORWARDED-FOR)%\" \"%REQ(USER-AGENT)%\" \"%REQ(X-REQUEST-ID)%\" \"%REQ(:AUTHORITY)%\" \"%UPSTREAM_HOST%\" %UPSTREAM_CLUSTER_RAW% %UPSTREAM_LOCAL_ADDRESS% %DOWNSTREAM_LOCAL_ADDRESS% %DOWNSTREAM_REMOTE_ADDRESS% %REQUESTED_SERVER_NAME% %ROUTE_NAME%\n";

/// Istio's default JSON format (`EnvoyJSONLogFormatIstio`): keys and their command operators.
pub const DEFAULT_JSON_FORMAT: [(&str, &str); 24] = [
    ("start_time", "%START_TIME%"),
    ("route_name", "%ROUTE_NAME%"),
    ("method", "%REQ(:METHOD)%"),
    ("path", "%REQ(X-ENVOY-ORIGINAL-PATH?:PATH)%"),
    ("protocol", "%PROTOCOL%"),
    ("response_code", "%RESPONSE_CODE%"),
    ("response_flags", "%RESPONSE_FLAGS%"),
    ("response_code_details", "%RESPONSE_CODE_DETAILS%"),
    (
        "connection_termination_details",
        "%CONNECTION_TERMINATION_DETAILS%",
    ),
    ("bytes_received", "%BYTES_RECEIVED%"),
    ("bytes_sent", "%BYTES_SENT%"),
    ("duration", "%DURATION%"),
    (
        "upstream_service_time",
        "%RESP(X-ENVOY-UPSTREAM-SERVICE-TIME)%",
    ),
    ("x_forwarded_for", "%REQ(X-FORWARDED-FOR)%"),
    ("user_agent", "%REQ(USER-AGENT)%"),
    ("request_id", "%REQ(X-REQUEST-ID)%"),
    ("authority", "%REQ(:AUTHORITY)%"),
    ("upstream_host", "%UPSTREAM_HOST%"),
    ("upstream_cluster", "%UPSTREAM_CLUSTER_RAW%"),
    ("upstream_local_address", "%UPSTREAM_LOCAL_ADDRESS%"),
    ("downstream_local_address", "%DOWNSTREAM_LOCAL_ADDRESS%"),
    ("downstream_remote_address", "%DOWNSTREAM_REMOTE_ADDRESS%"),
    ("requested_server_name", "%REQUESTED_SERVER_NAME%"),
    (
        "upstream_transport_failure_reason",
        "%UPSTREAM_TRANSPORT_FAILURE_REASON%",
    ),
];

/// Which listeners a log is for (istiod's listener classes): what a Telemetry's `match.mode`
/// picks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Side {
    SidecarOutbound,
    SidecarInbound,
    Gateway,
}

impl Side {
    fn mode(self) -> WorkloadMode {
        match self {
            Side::SidecarInbound => WorkloadMode::Server,
            Side::SidecarOutbound | Side::Gateway => WorkloadMode::Client,
        }
    }
}

/// The access logs of one proxy, per side, built once per generation.
#[derive(Debug, Default)]
pub(super) struct ProxyLogs {
    client: Vec<AccessLog>,
    server: Vec<AccessLog>,
    listener_client: Vec<AccessLog>,
    listener_server: Vec<AccessLog>,
}

impl ProxyLogs {
    pub(super) fn build(
        mesh: &MeshConfig,
        applied: &AppliedTelemetry,
        services: &ServiceTable,
    ) -> Self {
        let defaults = &mesh.default_providers.access_logging;
        let side = |mode| logs(mesh, services, &applied.access_logging(defaults, mode));
        let (client, server) = (side(WorkloadMode::Client), side(WorkloadMode::Server));
        let listener = |logs: &[AccessLog]| match mesh.disable_envoy_listener_log {
            true => Vec::new(),
            false => logs.iter().cloned().map(unmatched_only).collect(),
        };
        Self {
            listener_client: listener(&client),
            listener_server: listener(&server),
            client,
            server,
        }
    }

    /// For the HTTP connection managers and TCP proxies of `side`.
    pub(super) fn of(&self, side: Side) -> &[AccessLog] {
        match side.mode() {
            WorkloadMode::Server => &self.server,
            _ => &self.client,
        }
    }

    /// For a listener of `side` itself: connections no filter chain matched.
    pub(super) fn listener(&self, side: Side) -> Vec<AccessLog> {
        match side.mode() {
            WorkloadMode::Server => self.listener_server.clone(),
            _ => self.listener_client.clone(),
        }
    }
}

fn logs(mesh: &MeshConfig, services: &ServiceTable, decision: &LogDecision) -> Vec<AccessLog> {
    match decision {
        LogDecision::MeshConfig if mesh.access_log_file.is_empty() => Vec::new(),
        LogDecision::MeshConfig => vec![file_log(&mesh.access_log_file, mesh_format(mesh), None)],
        LogDecision::Providers(active) => active
            .iter()
            .filter_map(|a| match provider_log(mesh, services, a) {
                Ok(log) => Some(log),
                Err(why) => {
                    report_unbuilt("access logging", &a.provider, &why);
                    None
                }
            })
            .collect(),
    }
}

/// The log of a provider in effect, or why meshpilot cannot build it.
fn provider_log(
    mesh: &MeshConfig,
    services: &ServiceTable,
    active: &ActiveLog,
) -> Result<AccessLog, String> {
    let provider = mesh
        .provider(&active.provider)
        .ok_or("the mesh config defines no such extension provider")?;
    let filter = active.filter.as_deref();
    if let Some(otel) = &provider.envoy_otel_als {
        let (cluster, host) = cluster_of(services, &otel.service, otel.port)?;
        return Ok(otel_log(otel, envoy_grpc(cluster, host), filter));
    }
    for (logger, als) in [
        (GRPC_HTTP_LOGGER, &provider.envoy_http_als),
        (GRPC_TCP_LOGGER, &provider.envoy_tcp_als),
    ] {
        if let Some(als) = als {
            let (cluster, host) = cluster_of(services, &als.service, als.port)?;
            return Ok(grpc_log(logger, als, envoy_grpc(cluster, host), filter));
        }
    }
    let Some(file) = provider.envoy_file_access_log.as_ref() else {
        return Err("not an access log provider meshpilot builds (envoyFileAccessLog, envoyOtelAls, envoyHttpAls, envoyTcpAls)".into());
    };
    let format = match file {
        // The built-in provider, as given: the mesh config's format at the provider's path.
        FileProvider {
            log_format: None,
            omit_empty_values: false,
            ..
        } if provider
            .name
            .eq_ignore_ascii_case(extension_provider::BUILT_IN_ENVOY) =>
        {
            mesh_format(mesh)
        }
        FileProvider { log_format, .. } => {
            provider_format(log_format.as_ref(), file.omit_empty_values)
        }
    };
    let path = match file.path.as_str() {
        "" => STDOUT,
        path => path,
    };
    Ok(file_log(path, format, filter))
}

/// `envoyOtelAls`: istiod's body (the text format, Istio's by default), attributes (the labels),
/// log name and the peer state it logs.
fn otel_log(otel: &OtelAccessLogService, service: GrpcService, filter: Option<&str>) -> AccessLog {
    let format = otel.log_format.as_ref();
    let text = format
        .map(|f| f.text.as_str())
        .filter(|t| !t.is_empty())
        .unwrap_or(DEFAULT_TEXT_FORMAT);
    let labels = format
        .and_then(|f| f.labels.as_ref())
        .filter(|l| !l.is_empty());
    let any_string = |s: &str| AnyValue {
        value: Some(any_value::Value::StringValue(s.to_string())),
    };
    let attributes = labels.map(|labels| KeyValueList {
        values: labels
            .iter()
            .map(|(key, value)| KeyValue {
                key: key.clone(),
                value: Some(any_string(value.as_str().unwrap_or_default())),
                ..Default::default()
            })
            .collect(),
    });
    let uses_operator = text.contains(REQ_WITHOUT_QUERY_OPERATOR)
        || labels.is_some_and(|l| {
            l.values()
                .any(|v| v.to_string().contains(REQ_WITHOUT_QUERY_OPERATOR))
        });
    // istiod sends the (since deprecated) common gRPC config; Envoy still reads it.
    #[allow(deprecated)]
    let config = OpenTelemetryAccessLogConfig {
        common_config: Some(common_grpc(
            &otel.log_name,
            OTEL_LOG_NAME,
            service,
            &ALL_PEER_STATE,
        )),
        disable_builtin_labels: true,
        body: Some(any_string(text)),
        attributes,
        formatters: formatters(uses_operator),
        ..Default::default()
    };
    AccessLog {
        name: OTEL_LOGGER.into(),
        filter: filter.map(cel_filter),
        config_type: Some(access_log::ConfigType::TypedConfig(pack_any(config))),
    }
}

/// `envoyHttpAls` / `envoyTcpAls`: Envoy's gRPC access log service (both kinds go on every
/// connection manager and TCP proxy, as istiod puts them).
fn grpc_log(
    logger: &str,
    als: &GrpcAccessLogService,
    service: GrpcService,
    filter: Option<&str>,
) -> AccessLog {
    let state: Vec<&str> = match als.filter_state_objects_to_log.is_empty() {
        true => PEER_STATE.to_vec(),
        false => als
            .filter_state_objects_to_log
            .iter()
            .map(String::as_str)
            .collect(),
    };
    let config = match logger {
        GRPC_HTTP_LOGGER => pack_any(HttpGrpcAccessLogConfig {
            common_config: Some(common_grpc(&als.log_name, HTTP_LOG_NAME, service, &state)),
            additional_request_headers_to_log: als.additional_request_headers_to_log.clone(),
            additional_response_headers_to_log: als.additional_response_headers_to_log.clone(),
            additional_response_trailers_to_log: als.additional_response_trailers_to_log.clone(),
        }),
        _ => pack_any(TcpGrpcAccessLogConfig {
            common_config: Some(common_grpc(&als.log_name, TCP_LOG_NAME, service, &state)),
        }),
    };
    AccessLog {
        name: logger.to_string(),
        filter: filter.map(cel_filter),
        config_type: Some(access_log::ConfigType::TypedConfig(config)),
    }
}

fn common_grpc(
    log_name: &str,
    default_name: &str,
    service: GrpcService,
    state: &[&str],
) -> CommonGrpcAccessLogConfig {
    CommonGrpcAccessLogConfig {
        log_name: match log_name {
            "" => default_name.to_string(),
            name => name.to_string(),
        },
        grpc_service: Some(service),
        transport_api_version: ApiVersion::V3 as i32,
        filter_state_objects_to_log: state.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

fn mesh_format(mesh: &MeshConfig) -> SubstitutionFormatString {
    let custom = mesh.access_log_format.as_str();
    match mesh.access_log_encoding {
        AccessLogEncoding::Text => text_format(custom, false),
        // Validated as a JSON object when the mesh config was read.
        AccessLogEncoding::Json => {
            let labels = serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(custom);
            json_format(labels.ok().filter(|l| !l.is_empty()).as_ref(), false)
        }
    }
}

fn provider_format(
    format: Option<&extension_provider::LogFormat>,
    omit_empty_values: bool,
) -> SubstitutionFormatString {
    match format {
        Some(f) if f.labels.as_ref().is_some_and(|l| !l.is_empty()) => {
            json_format(f.labels.as_ref(), omit_empty_values)
        }
        Some(f) => text_format(&f.text, omit_empty_values),
        None => text_format("", omit_empty_values),
    }
}

/// A text format (Istio's default when empty), ending in a newline as istiod makes it.
fn text_format(custom: &str, omit_empty_values: bool) -> SubstitutionFormatString {
    let text = match custom {
        "" => DEFAULT_TEXT_FORMAT.to_string(),
        t if t.ends_with('\n') => t.to_string(),
        t => format!("{t}\n"),
    };
    SubstitutionFormatString {
        formatters: formatters(text.contains(REQ_WITHOUT_QUERY_OPERATOR)),
        omit_empty_values,
        format: Some(Format::TextFormatSource(DataSource {
            specifier: Some(data_source::Specifier::InlineString(text)),
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// A JSON format of these labels (Istio's default when None).
fn json_format(
    labels: Option<&serde_json::Map<String, serde_json::Value>>,
    omit_empty_values: bool,
) -> SubstitutionFormatString {
    let fields = match labels {
        Some(labels) => labels
            .iter()
            .map(|(k, v)| (k.clone(), proto_value(v)))
            .collect(),
        None => DEFAULT_JSON_FORMAT
            .iter()
            .map(|(k, v)| (k.to_string(), string_value(v)))
            .collect(),
    };
    let uses_operator = labels.is_some_and(|l| {
        l.values()
            .any(|v| v.to_string().contains(REQ_WITHOUT_QUERY_OPERATOR))
    });
    SubstitutionFormatString {
        formatters: formatters(uses_operator),
        omit_empty_values,
        // Present and empty, as istiod sends it (properties unsorted: Envoy's default).
        json_format_options: Some(JsonFormatOptions::default()),
        format: Some(Format::JsonFormat(Struct { fields })),
        ..Default::default()
    }
}

/// `%REQ_WITHOUT_QUERY(...)%` needs its formatter extension, as istiod adds it.
fn formatters(uses_req_without_query: bool) -> Vec<TypedExtensionConfig> {
    match uses_req_without_query {
        true => vec![TypedExtensionConfig {
            name: REQ_WITHOUT_QUERY.into(),
            typed_config: Some(pack_any(ReqWithoutQuery::default())),
        }],
        false => Vec::new(),
    }
}

fn string_value(text: &str) -> Value {
    Value {
        kind: Some(value::Kind::StringValue(text.to_string())),
    }
}

fn proto_value(value: &serde_json::Value) -> Value {
    let kind = match value {
        serde_json::Value::Null => value::Kind::NullValue(0),
        serde_json::Value::Bool(b) => value::Kind::BoolValue(*b),
        serde_json::Value::Number(n) => value::Kind::NumberValue(n.as_f64().unwrap_or_default()),
        serde_json::Value::String(s) => value::Kind::StringValue(s.clone()),
        serde_json::Value::Array(items) => {
            value::Kind::ListValue(envoy_types::pb::google::protobuf::ListValue {
                values: items.iter().map(proto_value).collect(),
            })
        }
        serde_json::Value::Object(map) => value::Kind::StructValue(Struct {
            fields: map
                .iter()
                .map(|(k, v)| (k.clone(), proto_value(v)))
                .collect(),
        }),
    };
    Value { kind: Some(kind) }
}

fn file_log(path: &str, format: SubstitutionFormatString, filter: Option<&str>) -> AccessLog {
    AccessLog {
        name: FILE_LOGGER.into(),
        filter: filter.map(cel_filter),
        config_type: Some(access_log::ConfigType::TypedConfig(pack_any(
            FileAccessLog {
                path: path.to_string(),
                access_log_format: Some(AccessLogFormat::LogFormat(format)),
            },
        ))),
    }
}

fn cel_filter(expression: &str) -> AccessLogFilter {
    AccessLogFilter {
        filter_specifier: Some(FilterSpecifier::ExtensionFilter(ExtensionFilter {
            name: CEL_FILTER.into(),
            config_type: Some(extension_filter::ConfigType::TypedConfig(pack_any(
                ExpressionFilter {
                    expression: expression.to_string(),
                    ..Default::default()
                },
            ))),
        })),
    }
}

/// The same log for a listener: only connections no filter chain matched, and of those only what
/// the Telemetry's filter lets through.
fn unmatched_only(mut log: AccessLog) -> AccessLog {
    let no_route = AccessLogFilter {
        filter_specifier: Some(FilterSpecifier::ResponseFlagFilter(ResponseFlagFilter {
            flags: vec!["NR".into()],
        })),
    };
    log.filter = Some(match log.filter.take() {
        None => no_route,
        Some(telemetry) => AccessLogFilter {
            filter_specifier: Some(FilterSpecifier::AndFilter(AndFilter {
                filters: vec![no_route, telemetry],
            })),
        },
    });
    log
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    fn file_config(log: &AccessLog) -> FileAccessLog {
        let Some(access_log::ConfigType::TypedConfig(any)) = &log.config_type else {
            panic!("{log:?}")
        };
        FileAccessLog::decode(&any.value[..]).unwrap()
    }

    fn format(log: &AccessLog) -> SubstitutionFormatString {
        match file_config(log).access_log_format {
            Some(AccessLogFormat::LogFormat(f)) => f,
            other => panic!("{other:?}"),
        }
    }

    fn logs_of(mesh: &MeshConfig, decision: &LogDecision) -> Vec<AccessLog> {
        logs(mesh, &ServiceTable::default(), decision)
    }

    fn mesh(yaml: &str) -> MeshConfig {
        MeshConfig::parse(yaml, &MeshConfig::default()).unwrap()
    }

    #[test]
    fn the_mesh_config_file_in_istio_formats() {
        assert!(logs_of(&mesh(""), &LogDecision::MeshConfig).is_empty());
        let text = logs_of(
            &mesh("accessLogFile: /dev/stdout"),
            &LogDecision::MeshConfig,
        );
        assert_eq!(file_config(&text[0]).path, "/dev/stdout");
        let Some(Format::TextFormatSource(source)) = format(&text[0]).format else {
            panic!()
        };
        assert_eq!(
            source.specifier,
            Some(data_source::Specifier::InlineString(
                DEFAULT_TEXT_FORMAT.into()
            ))
        );
        let json = logs_of(
            &mesh("accessLogFile: /tmp/a.log\naccessLogEncoding: JSON"),
            &LogDecision::MeshConfig,
        );
        let Some(Format::JsonFormat(fields)) = format(&json[0]).format else {
            panic!()
        };
        assert_eq!(fields.fields.len(), 24);
        assert_eq!(
            fields.fields["upstream_cluster"],
            string_value("%UPSTREAM_CLUSTER_RAW%")
        );
    }

    #[test]
    fn a_custom_text_format_ends_its_line_and_gets_its_formatter() {
        let text = logs_of(
            &mesh("accessLogFile: /dev/stdout\naccessLogFormat: '%REQ_WITHOUT_QUERY(:PATH)% %RESPONSE_CODE%'"),
            &LogDecision::MeshConfig,
        );
        let format = format(&text[0]);
        assert_eq!(format.formatters[0].name, REQ_WITHOUT_QUERY);
        let Some(Format::TextFormatSource(source)) = format.format else {
            panic!()
        };
        assert_eq!(
            source.specifier,
            Some(data_source::Specifier::InlineString(
                "%REQ_WITHOUT_QUERY(:PATH)% %RESPONSE_CODE%\n".into()
            ))
        );
    }

    #[test]
    fn providers_resolve_by_name_with_their_filters() {
        let mesh = mesh(
            "accessLogFile: /dev/stdout\naccessLogEncoding: JSON\nextensionProviders:\n- name: errors\n  envoyFileAccessLog:\n    path: /var/log/errors\n    logFormat: {labels: {code: '%RESPONSE_CODE%'}}\n",
        );
        let active = |provider: &str, filter: Option<&str>| ActiveLog {
            provider: provider.into(),
            filter: filter.map(str::to_string),
        };
        let built = logs_of(
            &mesh,
            &LogDecision::Providers(vec![
                active("Envoy", None),
                active("errors", Some("response.code >= 500")),
                active("nowhere", None),
            ]),
        );
        assert_eq!(built.len(), 2);
        // The built-in provider keeps the mesh's JSON format at its own path.
        assert_eq!(file_config(&built[0]).path, STDOUT);
        assert!(
            matches!(format(&built[0]).format, Some(Format::JsonFormat(f)) if f.fields.len() == 24)
        );
        assert_eq!(file_config(&built[1]).path, "/var/log/errors");
        let filter = format!("{:?}", built[1].filter);
        assert!(filter.contains(CEL_FILTER), "{filter}");
        let listener = unmatched_only(built[1].clone());
        assert!(format!("{:?}", listener.filter).contains("AndFilter"));
    }
}
