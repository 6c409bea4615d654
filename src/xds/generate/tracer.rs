//! Tracing on the HTTP connection managers, as istiod configures it
//! (pilot/pkg/networking/core/tracing.go): the Telemetry API's provider and settings for each side
//! of the traffic, else — for Istio's proxies, whose agent sets the tracer up from
//! `defaultConfig.tracing` — mesh config `enableTracing` with no provider. Sampling: the
//! Telemetry's percentage, else `defaultConfig.tracing.sampling`, else Istio's 1 %; client and
//! overall sampling 100 %; Istio's span tags unless turned off; the UUID request id decides
//! sampling unless told otherwise.

use std::collections::BTreeMap;

use envoy_types::pb::envoy::config::trace::v3::tracing::{http as tracer_http, Http as Tracer};
use envoy_types::pb::envoy::config::trace::v3::{
    zipkin_config::CollectorEndpointVersion, DatadogConfig, OpenTelemetryConfig, SkyWalkingConfig,
    ZipkinConfig,
};
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_connection_manager, HttpConnectionManager, RequestIdExtension,
};
use envoy_types::pb::envoy::extensions::request_id::uuid::v3::UuidRequestIdConfig;
use envoy_types::pb::envoy::r#type::tracing::v3::{custom_tag, CustomTag};
use envoy_types::pb::envoy::r#type::v3::Percent;
use envoy_types::pb::google::protobuf::{BoolValue, UInt32Value};
use envoy_types::util::pack_any;

use super::access_log::Side;
use super::providers::{cluster_of, envoy_grpc, report_unbuilt};
use crate::istio::extension_provider::TracingService;
use crate::istio::telemetry::{self, WorkloadMode};
use crate::istio::MeshConfig;
use crate::model::{AppliedTelemetry, ServiceTable, TraceDecision, TraceSpec};
use crate::xds::proxy::Proxy;

const ZIPKIN: &str = "envoy.tracers.zipkin";
const OPENTELEMETRY: &str = "envoy.tracers.opentelemetry";
const DATADOG: &str = "envoy.tracers.datadog";
const SKYWALKING: &str = "envoy.tracers.skywalking";
const ZIPKIN_PATH: &str = "/api/v2/spans";
/// `PILOT_TRACE_SAMPLING`'s default.
const DEFAULT_SAMPLING: f64 = 1.0;

/// What one side's connection managers get.
#[derive(Debug, Default)]
pub(super) struct SideTracing {
    tracing: Option<http_connection_manager::Tracing>,
    request_id: Option<RequestIdExtension>,
}

impl SideTracing {
    pub(super) fn apply(&self, hcm: &mut HttpConnectionManager) {
        hcm.tracing = self.tracing.clone();
        hcm.request_id_extension = self.request_id.clone();
    }
}

/// Both sides of one proxy, built once per generation.
#[derive(Debug, Default)]
pub(super) struct ProxyTracing {
    client: SideTracing,
    server: SideTracing,
}

/// What a proxy's tracing is built from.
pub(super) struct TracingInputs<'a> {
    pub(super) mesh: &'a MeshConfig,
    pub(super) telemetry: &'a AppliedTelemetry,
    pub(super) proxy: &'a Proxy,
    pub(super) services: &'a ServiceTable,
}

impl ProxyTracing {
    pub(super) fn build(inputs: &TracingInputs<'_>) -> Self {
        let side = |mode| {
            let defaults = &inputs.mesh.default_providers.tracing;
            side(inputs, &inputs.telemetry.tracing(defaults, mode))
        };
        Self {
            client: side(WorkloadMode::Client),
            server: side(WorkloadMode::Server),
        }
    }

    pub(super) fn of(&self, side: Side) -> &SideTracing {
        match side {
            Side::SidecarInbound => &self.server,
            Side::SidecarOutbound | Side::Gateway => &self.client,
        }
    }

    /// Whether connection managers trace: their spans then carry the proxy's own tags and name,
    /// so its listeners vary by them.
    pub(super) fn configured(&self) -> bool {
        self.client.tracing.is_some() || self.server.tracing.is_some()
    }
}

fn side(inputs: &TracingInputs<'_>, decision: &TraceDecision) -> SideTracing {
    let istio_proxy = !inputs.proxy.istio_version.is_empty();
    let spec = match decision {
        // A plain Envoy has no agent setting a tracer up: nothing to configure.
        TraceDecision::MeshConfig if !istio_proxy || !inputs.mesh.enable_tracing => {
            return SideTracing::default()
        }
        TraceDecision::MeshConfig => None,
        TraceDecision::Off if istio_proxy => return request_id_only(true),
        TraceDecision::Off => return SideTracing::default(),
        TraceDecision::On(spec) => Some(spec),
    };
    let provider = match spec {
        None => None,
        Some(spec) => match provider(inputs, &spec.provider) {
            Ok(provider) => Some(provider),
            Err(why) => {
                report_unbuilt("tracing", &spec.provider, &why);
                return request_id_only(true);
            }
        },
    };
    let default_config = &inputs.mesh.default_config;
    let sampling =
        spec.and_then(|s| s.sampling)
            .unwrap_or_else(|| match default_config.trace_sampling() {
                Some(s) if (0.0..=100.0).contains(&s) => s,
                _ => DEFAULT_SAMPLING,
            });
    let max_tag_length = provider
        .as_ref()
        .map(|(_, service)| service.max_tag_length)
        .filter(|l| *l != 0)
        .or_else(|| default_config.max_path_tag_length());
    let percent = |value| Some(Percent { value });
    // SkyWalking needs the upstream span (istiod sets it for that tracer alone).
    let upstream_span = provider
        .as_ref()
        .is_some_and(|(http, _)| http.name == SKYWALKING);
    let tracing = http_connection_manager::Tracing {
        spawn_upstream_span: upstream_span.then_some(BoolValue { value: true }),
        client_sampling: percent(100.0),
        random_sampling: percent(sampling),
        overall_sampling: percent(100.0),
        max_path_tag_length: max_tag_length.map(|value| UInt32Value { value }),
        custom_tags: custom_tags(inputs.proxy, spec),
        provider: provider.map(|(http, _)| http),
        ..Default::default()
    };
    let by_request_id = spec.is_none_or(|s| s.use_request_id_for_trace_sampling);
    SideTracing {
        tracing: Some(tracing),
        ..request_id_only(by_request_id)
    }
}

fn request_id_only(by_request_id: bool) -> SideTracing {
    SideTracing {
        tracing: None,
        request_id: Some(RequestIdExtension {
            typed_config: Some(pack_any(UuidRequestIdConfig {
                use_request_id_for_trace_sampling: Some(BoolValue {
                    value: by_request_id,
                }),
                ..Default::default()
            })),
        }),
    }
}

/// The tracer of a provider, and the provider's settings.
fn provider<'m>(
    inputs: &TracingInputs<'m>,
    name: &str,
) -> Result<(Tracer, &'m TracingService), String> {
    let mesh = inputs.mesh;
    let defined = mesh
        .extension_providers
        .iter()
        .find(|p| p.name.eq_ignore_ascii_case(name))
        .ok_or_else(|| format!("no extension provider named {name:?}"))?;
    let (tracer, service, config) = if let Some(zipkin) = &defined.zipkin {
        let (cluster, host) = collector(inputs, zipkin)?;
        let config = pack_any(ZipkinConfig {
            collector_cluster: cluster,
            collector_endpoint: match zipkin.path.as_str() {
                "" => ZIPKIN_PATH.to_string(),
                path => path.to_string(),
            },
            trace_id_128bit: !zipkin.enable64bit_trace_id,
            shared_span_context: Some(BoolValue { value: false }),
            collector_endpoint_version: CollectorEndpointVersion::HttpJson as i32,
            collector_hostname: host,
            ..Default::default()
        });
        (ZIPKIN, zipkin, config)
    } else if let Some(otel) = &defined.opentelemetry {
        let (cluster, host) = collector(inputs, otel)?;
        let config = pack_any(OpenTelemetryConfig {
            grpc_service: Some(envoy_grpc(cluster, host)),
            service_name: inputs.proxy.service_cluster.clone(),
            ..Default::default()
        });
        (OPENTELEMETRY, otel, config)
    } else if let Some(datadog) = &defined.datadog {
        let (cluster, host) = collector(inputs, datadog)?;
        let config = pack_any(DatadogConfig {
            collector_cluster: cluster,
            service_name: inputs.proxy.service_cluster.clone(),
            collector_hostname: host,
            ..Default::default()
        });
        (DATADOG, datadog, config)
    } else if let Some(skywalking) = &defined.skywalking {
        let (cluster, host) = collector(inputs, skywalking)?;
        let config = pack_any(SkyWalkingConfig {
            grpc_service: Some(envoy_grpc(cluster, host)),
            ..Default::default()
        });
        (SKYWALKING, skywalking, config)
    } else {
        return Err(format!(
            "extension provider {name:?} is not a tracer meshpilot builds (zipkin, opentelemetry, datadog, skywalking)"
        ));
    };
    let http = Tracer {
        name: tracer.to_string(),
        config_type: Some(tracer_http::ConfigType::TypedConfig(config)),
    };
    Ok((http, service))
}

/// The cluster and host of a tracer's service.
fn collector(
    inputs: &TracingInputs<'_>,
    provider: &TracingService,
) -> Result<(String, String), String> {
    cluster_of(inputs.services, &provider.service, provider.port)
}

/// Istio's tags from the proxy (unless turned off), then the Telemetry's, sorted by name.
fn custom_tags(proxy: &Proxy, spec: Option<&TraceSpec>) -> Vec<CustomTag> {
    let mut tags: BTreeMap<String, custom_tag::Type> = BTreeMap::new();
    if spec.is_none_or(|s| s.istio_tags) {
        let label = |key: &str, default: &str| {
            proxy
                .labels
                .get(key)
                .cloned()
                .unwrap_or_else(|| default.to_string())
        };
        let or = |value: &str, default: &str| match value {
            "" => default.to_string(),
            v => v.to_string(),
        };
        let cluster = proxy.cluster_id.as_ref().map_or("", |c| c.as_str());
        for (tag, value) in [
            (
                "istio.canonical_revision",
                label("service.istio.io/canonical-revision", "latest"),
            ),
            (
                "istio.canonical_service",
                label("service.istio.io/canonical-name", "unknown"),
            ),
            ("istio.mesh_id", or(&proxy.mesh_id, "unknown")),
            ("istio.namespace", or(&proxy.namespace, "default")),
            ("istio.cluster_id", or(cluster, "unknown")),
        ] {
            tags.insert(
                tag.to_string(),
                custom_tag::Type::Literal(custom_tag::Literal { value }),
            );
        }
    }
    for (name, tag) in spec.map(|s| &s.custom_tags).into_iter().flatten() {
        tags.insert(name.clone(), user_tag(tag));
    }
    tags.into_iter()
        .map(|(tag, kind)| CustomTag {
            tag,
            r#type: Some(kind),
        })
        .collect()
}

fn user_tag(tag: &telemetry::CustomTag) -> custom_tag::Type {
    if let Some(env) = &tag.environment {
        return custom_tag::Type::Environment(custom_tag::Environment {
            name: env.name.clone(),
            default_value: env.default_value.clone(),
        });
    }
    if let Some(header) = &tag.header {
        return custom_tag::Type::RequestHeader(custom_tag::Header {
            name: header.name.clone(),
            default_value: header.default_value.clone(),
        });
    }
    custom_tag::Type::Literal(custom_tag::Literal {
        value: tag
            .literal
            .as_ref()
            .map(|l| l.value.clone())
            .unwrap_or_default(),
    })
}
