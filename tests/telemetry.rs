//! Telemetry as proxies receive it, decoded from raw ADS responses: the Telemetry API's access
//! logging (the root namespace's, the namespace's and the workload's Telemetry in Istio's
//! precedence, each side of the traffic on its own listeners, from files and from the config
//! cluster), and Istio's stats and peer metadata filters for Istio's proxies, compared with what
//! istiod sends.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::config_source::{ConfigFixture, Source};
use common::*;
use envoy_types::pb::envoy::config::accesslog::v3::{access_log, AccessLog};
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::core::v3::address::Address::SocketAddress;
use envoy_types::pb::envoy::config::core::v3::grpc_service;
use envoy_types::pb::envoy::config::endpoint::v3::lb_endpoint::HostIdentifier;
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::config::listener::v3::{filter, Filter, Listener};
use envoy_types::pb::envoy::config::trace::v3::tracing::http as tracer_http;
use envoy_types::pb::envoy::config::trace::v3::OpenTelemetryConfig;
use envoy_types::pb::envoy::extensions::access_loggers::file::v3::FileAccessLog;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_filter, HttpConnectionManager,
};
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::TcpProxy;
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use envoy_types::pb::google::protobuf::value::Kind::StringValue;
use envoy_types::pb::google::protobuf::Any;
use meshpilot::xds::istio_protos::stats::PluginConfig;
use meshpilot::xds::istio_protos::udpa::TypedStruct;
use prost::Message;

const BOUND: Duration = Duration::from_secs(10);
const LDS: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
const REVIEWS_ID: &str = "sidecar~10.1.1.11~reviews-v1-7f9c8d.bookinfo~bookinfo.svc.cluster.local";

const MESH: &str = "
extensionProviders:
- name: json-errors
  envoyFileAccessLog:
    path: /var/log/errors.json
    logFormat: {labels: {code: '%RESPONSE_CODE%'}}
";

/// Root: the built-in `envoy` provider for everyone. Workloads `app: productpage`: only errors,
/// to the JSON provider.
const TELEMETRY: &str = "
apiVersion: telemetry.istio.io/v1
kind: Telemetry
metadata: {name: mesh-default, namespace: istio-system}
spec:
  accessLogging: [{providers: [{name: envoy}]}]
---
apiVersion: telemetry.istio.io/v1
kind: Telemetry
metadata: {name: errors-only, namespace: bookinfo}
spec:
  selector: {matchLabels: {app: productpage}}
  accessLogging:
  - providers: [{name: json-errors}]
    filter: {expression: 'response.code >= 400'}
";

/// Namespace `bookinfo`: no server-side logs.
const NO_INBOUND: &str = "
apiVersion: telemetry.istio.io/v1alpha1
kind: Telemetry
metadata: {name: no-inbound, namespace: bookinfo}
spec:
  accessLogging: [{match: {mode: SERVER}, disabled: true}]
";

/// Where one filter's access logs write, and whether a filter guards them.
type Logs = Vec<(String, bool)>;

fn file_logs(logs: &[AccessLog]) -> Logs {
    logs.iter()
        .map(|log| {
            let Some(access_log::ConfigType::TypedConfig(any)) = &log.config_type else {
                panic!("{log:?}")
            };
            let file = FileAccessLog::decode(&any.value[..]).expect("a file access log");
            (file.path, log.filter.is_some())
        })
        .collect()
}

/// The access logs of every connection manager and TCP proxy of a listener, and of the listener.
fn listener_logs(listener: &Listener) -> (Vec<Logs>, Logs) {
    let chains = listener
        .filter_chains
        .iter()
        .chain(listener.default_filter_chain.iter());
    let filters: Vec<&Filter> = chains.flat_map(|c| &c.filters).collect();
    let of_filter = |f: &&Filter| {
        let Some(filter::ConfigType::TypedConfig(any)) = &f.config_type else {
            return None;
        };
        match f.name.as_str() {
            "envoy.filters.network.http_connection_manager" => {
                let hcm = HttpConnectionManager::decode(&any.value[..]).expect("an HCM");
                Some(file_logs(&hcm.access_log))
            }
            "envoy.filters.network.tcp_proxy" => {
                let proxy = TcpProxy::decode(&any.value[..]).expect("a TCP proxy");
                let to_black_hole = format!("{:?}", proxy.cluster_specifier).contains("BlackHole");
                (!to_black_hole).then(|| file_logs(&proxy.access_log))
            }
            _ => None,
        }
    };
    (
        filters.iter().filter_map(of_filter).collect(),
        file_logs(&listener.access_log),
    )
}

/// A sidecar's listeners by name.
async fn listeners(f: &ConfigFixture, id: &str, app: &str) -> BTreeMap<String, Listener> {
    resources(f, id, app, &[], LDS).await
}

/// A proxy's resources of one type by name; `metadata` beside its cluster.
async fn resources<T: Message + Default + Named>(
    f: &ConfigFixture,
    id: &str,
    app: &str,
    metadata: &[(&str, &str)],
    type_url: &str,
) -> BTreeMap<String, T> {
    let mut meta = vec![("CLUSTER_ID", "cluster1")];
    meta.extend_from_slice(metadata);
    let node = labelled_node(id, &meta, &[("app", app)]);
    let all: Vec<T> = common::ads::fetch(f.mp.xds_addr, node, type_url, &[]).await;
    all.into_iter().map(|r| (r.name().to_string(), r)).collect()
}

/// Resources by their names.
trait Named {
    fn name(&self) -> &str;
}

impl Named for Listener {
    fn name(&self) -> &str {
        &self.name
    }
}

impl Named for Cluster {
    fn name(&self) -> &str {
        &self.name
    }
}

fn stdout() -> Logs {
    vec![("/dev/stdout".into(), false)]
}

async fn telemetry_precedence_reaches_each_side(source: Source) {
    let mesh = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(mesh.path(), MESH).unwrap();
    let flags = [
        "--debounce-after",
        "0s",
        "--mesh-config",
        mesh.path().to_str().unwrap(),
    ];
    let config = [
        ("telemetry.yaml", TELEMETRY),
        ("telemetry-ns.yaml", NO_INBOUND),
    ];
    let f = ConfigFixture::start(source, &config, &flags).await;

    // reviews in bookinfo: the root's provider outbound, nothing inbound (its namespace's
    // Telemetry), and the listener's own log only of connections no chain matched.
    let reviews = listeners(&f, REVIEWS_ID, "reviews").await;
    let (outbound, own) = listener_logs(&reviews["virtualOutbound"]);
    assert_eq!(outbound, [stdout()]);
    assert_eq!(own, [("/dev/stdout".to_string(), true)]);
    let (port, own) = listener_logs(&reviews["0.0.0.0_9080"]);
    assert!(
        !port.is_empty() && port.iter().all(|l| *l == stdout()),
        "{port:?}"
    );
    assert!(
        own.is_empty(),
        "per-port listeners log only through their filters"
    );
    let (inbound, own) = listener_logs(&reviews["virtualInbound"]);
    assert!(inbound.iter().all(Vec::is_empty), "{inbound:?}");
    assert!(own.is_empty());

    // productpage: its own Telemetry's provider on both sides, behind its filter.
    let productpage = listeners(
        &f,
        "sidecar~10.1.1.12~productpage-v1-5d9b.bookinfo~bookinfo.svc.cluster.local",
        "productpage",
    )
    .await;
    let errors = vec![("/var/log/errors.json".to_string(), true)];
    for name in ["virtualOutbound", "virtualInbound"] {
        let (filters, _) = listener_logs(&productpage[name]);
        assert!(filters.iter().all(|l| *l == errors), "{name}: {filters:?}");
    }

    // Another namespace: the root's provider on both sides.
    let other = listeners(
        &f,
        "sidecar~10.5.0.5~client.other~other.svc.cluster.local",
        "client",
    )
    .await;
    for name in ["virtualOutbound", "virtualInbound"] {
        let (filters, _) = listener_logs(&other[name]);
        assert!(
            filters.iter().all(|l| *l == stdout()),
            "{name}: {filters:?}"
        );
    }

    // The namespace's Telemetry goes: reviews logs inbound again.
    f.delete("telemetry-ns.yaml", "Telemetry", "bookinfo", "no-inbound");
    wait_for("inbound logs back", BOUND, || async {
        let reviews = listeners(&f, REVIEWS_ID, "reviews").await;
        let (inbound, _) = listener_logs(&reviews["virtualInbound"]);
        inbound.iter().all(|l| *l == stdout()).then_some(())
    })
    .await;
}

from_both_sources!(
    telemetry_precedence_reaches_each_side,
    precedence_from_files,
    precedence_from_the_config_cluster
);

const ISTIO_PROXY: &[(&str, &str)] = &[("ISTIO_VERSION", "1.28.0")];

fn typed(any: &Any, type_url: &str) -> Vec<u8> {
    assert_eq!(any.type_url, type_url);
    any.value.clone()
}

/// A TypedStruct's inner type URL and value, as JSON.
fn typed_struct(any: &Any) -> (String, serde_json::Value) {
    let bytes = typed(any, "type.googleapis.com/udpa.type.v1.TypedStruct");
    let typed = TypedStruct::decode(&bytes[..]).unwrap();
    let value = typed.value.unwrap_or_default();
    (typed.type_url, struct_json(&value))
}

fn struct_json(s: &prost_types::Struct) -> serde_json::Value {
    use prost_types::value::Kind;
    fn value(v: &prost_types::Value) -> serde_json::Value {
        match &v.kind {
            Some(Kind::StringValue(s)) => s.clone().into(),
            Some(Kind::BoolValue(b)) => (*b).into(),
            Some(Kind::NumberValue(n)) => (*n).into(),
            Some(Kind::StructValue(s)) => struct_json(s),
            Some(Kind::ListValue(l)) => l.values.iter().map(value).collect(),
            _ => serde_json::Value::Null,
        }
    }
    s.fields
        .iter()
        .map(|(k, v)| (k.clone(), value(v)))
        .collect()
}

/// An HCM's HTTP filters of a listener's first chain that has one: (name, config).
fn http_filters(listener: &Listener) -> Vec<(String, Any)> {
    hcm_of(listener)
        .http_filters
        .into_iter()
        .map(|f| match f.config_type {
            Some(http_filter::ConfigType::TypedConfig(any)) => (f.name, any),
            other => panic!("{}: {other:?}", f.name),
        })
        .collect()
}

/// What istiod's `SidecarInboundMetadataFilter` / `SidecarOutboundMetadataFilter` carry
/// (pilot/pkg/xds/filters/filters.go).
fn peer_metadata(direction: &str) -> serde_json::Value {
    serde_json::json!({
        format!("{direction}_discovery"): [{"istio_headers": {}}, {"workload_discovery": {}}],
        format!("{direction}_propagation"): [{"istio_headers": {}}],
    })
}

/// Istio's proxies get Istio's stats and metadata exchange where istiod puts them, with istiod's
/// configs; a plain Envoy (no ISTIO_VERSION) gets nothing it could not load.
#[tokio::test]
async fn istio_proxies_get_istios_stats_and_plain_envoy_none() {
    let f = ConfigFixture::start(Source::Files, &[], &["--debounce-after", "0s"]).await;
    let listeners: BTreeMap<String, Listener> =
        resources(&f, REVIEWS_ID, "reviews", ISTIO_PROXY, LDS).await;

    // Inbound HTTP: the exchange first, the stats just before the router, istiod's configs.
    let inbound = http_filters(&listeners["virtualInbound"]);
    let names: Vec<&str> = inbound.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.first(), Some(&"istio.metadata_exchange"), "{names:?}");
    assert_eq!(
        names[names.len() - 2..],
        ["istio.stats", "envoy.filters.http.router"]
    );
    let (inner, config) = typed_struct(&inbound[0].1);
    assert_eq!(
        inner,
        "type.googleapis.com/io.istio.http.peer_metadata.Config"
    );
    assert_eq!(config, peer_metadata("downstream"));
    let stats = typed(
        &inbound[names.len() - 2].1,
        "type.googleapis.com/stats.PluginConfig",
    );
    // istiod's own test decodes `MAE=`: disable_host_header_fallback (field 6) only.
    assert_eq!(stats, [0x30, 0x01]);
    let decoded = PluginConfig::decode(&stats[..]).unwrap();
    assert!(decoded.disable_host_header_fallback && decoded.metrics.is_empty());

    // Outbound HTTP: the upstream exchange, an empty stats config.
    let outbound = http_filters(&listeners["0.0.0.0_9080"]);
    let names: Vec<&str> = outbound.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.first(), Some(&"istio.metadata_exchange"), "{names:?}");
    assert_eq!(typed_struct(&outbound[0].1).1, peer_metadata("upstream"));
    let stats = &outbound[names.len() - 2];
    assert_eq!(stats.0, "istio.stats");
    assert!(typed(&stats.1, "type.googleapis.com/stats.PluginConfig").is_empty());

    // Inbound TCP: the exchange first, the stats just before the TCP proxy.
    let catch_all = listeners["virtualInbound"]
        .filter_chains
        .iter()
        .find(|c| c.name == "virtualInbound")
        .expect("the inbound catch-all");
    let names: Vec<&str> = catch_all.filters.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(names.first(), Some(&"istio.metadata_exchange"));
    assert_eq!(
        names[names.len() - 2..],
        ["istio.stats", "envoy.filters.network.tcp_proxy"]
    );
    let Some(filter::ConfigType::TypedConfig(exchange)) = &catch_all.filters[0].config_type else {
        panic!()
    };
    let tcp_exchange = (
        "type.googleapis.com/envoy.tcp.metadataexchange.config.MetadataExchange".to_string(),
        serde_json::json!({"protocol": "istio-peer-exchange", "enable_discovery": true}),
    );
    assert_eq!(typed_struct(exchange), tcp_exchange);

    // Outbound clusters exchange upstream and name their service for the stats.
    let clusters: BTreeMap<String, Cluster> =
        resources(&f, REVIEWS_ID, "reviews", ISTIO_PROXY, CDS).await;
    let reviews = &clusters["outbound|9080||reviews.bookinfo.svc.cluster.local"];
    assert_eq!(reviews.filters.len(), 1);
    assert_eq!(reviews.filters[0].name, "istio.metadata_exchange");
    assert_eq!(
        typed_struct(reviews.filters[0].typed_config.as_ref().unwrap()),
        tcp_exchange
    );
    let istio = &reviews.metadata.as_ref().unwrap().filter_metadata["istio"];
    let istio = struct_json(&prost_types::Struct {
        fields: istio
            .fields
            .iter()
            .map(|(k, v)| {
                (
                    k.clone(),
                    prost_types::Value::decode(&v.encode_to_vec()[..]).unwrap(),
                )
            })
            .collect(),
    });
    assert_eq!(
        istio,
        serde_json::json!({"services": [{"host": "reviews.bookinfo.svc.cluster.local",
                                          "name": "reviews", "namespace": "bookinfo"}]})
    );
    assert_eq!(clusters["PassthroughCluster"].filters.len(), 1);
    assert!(clusters["InboundPassthroughCluster"].filters.is_empty());

    // Each endpoint names its workload for the stats, in istiod's compressed form.
    let mut ads = AdsClient::connect(f.mp.xds_addr).await.unwrap();
    ads.request(DiscoveryRequest {
        node: Some(labelled_node(
            REVIEWS_ID,
            &[("CLUSTER_ID", "cluster1")],
            &[],
        )),
        type_url: EDS.into(),
        resource_names: vec!["outbound|9080||reviews.bookinfo.svc.cluster.local".into()],
        ..Default::default()
    });
    let assignment =
        ClusterLoadAssignment::decode(&ads.response(BOUND).await.resources[0].value[..])
            .expect("an assignment");
    let workloads: BTreeMap<String, String> = assignment
        .endpoints
        .iter()
        .flat_map(|group| &group.lb_endpoints)
        .map(|lb| {
            let Some(HostIdentifier::Endpoint(ep)) = &lb.host_identifier else {
                panic!("an endpoint address")
            };
            let Some(SocketAddress(socket)) = ep.address.as_ref().unwrap().address.as_ref() else {
                panic!("a socket address")
            };
            let istio = &lb.metadata.as_ref().unwrap().filter_metadata["istio"];
            let Some(StringValue(workload)) = &istio.fields["workload"].kind else {
                panic!("a string")
            };
            (socket.address.clone(), workload.clone())
        })
        .collect();
    assert_eq!(
        workloads.get("10.1.1.11").map(String::as_str),
        Some("reviews-v1-7f9c8d;bookinfo;reviews;v1;cluster1"),
        "{workloads:?}"
    );

    // A plain Envoy: none of Istio's own extensions anywhere.
    let plain: BTreeMap<String, Listener> = resources(&f, REVIEWS_ID, "reviews", &[], LDS).await;
    let plain_clusters: BTreeMap<String, Cluster> =
        resources(&f, REVIEWS_ID, "reviews", &[], CDS).await;
    let text = format!(
        "{plain:?}{:?}",
        plain_clusters
            .values()
            .map(|c| &c.filters)
            .collect::<Vec<_>>()
    );
    assert!(!text.contains("istio.stats") && !text.contains("istio.metadata_exchange"));
}

/// The connection manager of a listener's HTTP chain.
fn hcm_of(listener: &Listener) -> HttpConnectionManager {
    let chains = listener
        .filter_chains
        .iter()
        .chain(listener.default_filter_chain.iter());
    chains
        .flat_map(|c| &c.filters)
        .find(|f| f.name == "envoy.filters.network.http_connection_manager")
        .map(|f| match &f.config_type {
            Some(filter::ConfigType::TypedConfig(any)) => {
                HttpConnectionManager::decode(&any.value[..]).unwrap()
            }
            other => panic!("{other:?}"),
        })
        .unwrap_or_else(|| panic!("{} has no HCM", listener.name))
}

/// Without a Telemetry, Istio's proxies trace through their agent's tracer at the mesh config's
/// sampling with Istio's tags (a plain Envoy has no agent: nothing); a Telemetry naming an
/// OpenTelemetry provider sends spans over gRPC to the provider's service, named by the proxy's
/// service cluster.
#[tokio::test]
async fn tracing_from_the_mesh_config_and_a_telemetry() {
    let mesh = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        mesh.path(),
        "defaultConfig: {tracing: {sampling: 5}}\nextensionProviders:\n- name: otel\n  opentelemetry: {service: bookinfo/reviews.bookinfo.svc.cluster.local, port: 9080}\n",
    )
    .unwrap();
    let flags = [
        "--debounce-after",
        "0s",
        "--mesh-config",
        mesh.path().to_str().unwrap(),
    ];
    let f = ConfigFixture::start(Source::Files, &[], &flags).await;
    let istio: BTreeMap<String, Listener> =
        resources(&f, REVIEWS_ID, "reviews", ISTIO_PROXY, LDS).await;
    let tracing = hcm_of(&istio["0.0.0.0_9080"]).tracing.expect("tracing");
    assert_eq!(tracing.random_sampling.map(|p| p.value), Some(5.0));
    assert_eq!(tracing.client_sampling.map(|p| p.value), Some(100.0));
    assert!(tracing.provider.is_none(), "the agent's tracer");
    let tags: Vec<&str> = tracing.custom_tags.iter().map(|t| t.tag.as_str()).collect();
    assert_eq!(
        tags,
        [
            "istio.canonical_revision",
            "istio.canonical_service",
            "istio.cluster_id",
            "istio.mesh_id",
            "istio.namespace"
        ]
    );
    let plain: BTreeMap<String, Listener> = resources(&f, REVIEWS_ID, "reviews", &[], LDS).await;
    assert!(hcm_of(&plain["0.0.0.0_9080"]).tracing.is_none());

    f.apply(
        "tracing.yaml",
        "apiVersion: telemetry.istio.io/v1\nkind: Telemetry\nmetadata: {name: otel, namespace: bookinfo}\nspec:\n  tracing: [{providers: [{name: otel}], randomSamplingPercentage: 50}]\n",
    );
    let tracing = wait_for("the provider in the sidecar", BOUND, || async {
        let listeners: BTreeMap<String, Listener> =
            resources(&f, REVIEWS_ID, "reviews", &[], LDS).await;
        hcm_of(&listeners["0.0.0.0_9080"])
            .tracing
            .filter(|t| t.provider.is_some())
    })
    .await;
    assert_eq!(tracing.random_sampling.map(|p| p.value), Some(50.0));
    let provider = tracing.provider.unwrap();
    assert_eq!(provider.name, "envoy.tracers.opentelemetry");
    let Some(tracer_http::ConfigType::TypedConfig(any)) = &provider.config_type else {
        panic!("{provider:?}")
    };
    let otel = OpenTelemetryConfig::decode(&any.value[..]).unwrap();
    let Some(grpc_service::TargetSpecifier::EnvoyGrpc(grpc)) =
        otel.grpc_service.and_then(|g| g.target_specifier)
    else {
        panic!("a gRPC exporter")
    };
    assert_eq!(
        grpc.cluster_name,
        "outbound|9080||reviews.bookinfo.svc.cluster.local"
    );
    assert_eq!(grpc.authority, "reviews.bookinfo.svc.cluster.local");
}

/// The Telemetry API's metrics overrides shape Istio's stats config as istiod's
/// `generateStatsConfig`: tags set and removed per metric, the TCP reporting interval, and no
/// stats filter on a side whose metrics are all disabled.
#[tokio::test]
async fn metrics_overrides_shape_the_stats_filter() {
    let telemetry = "
apiVersion: telemetry.istio.io/v1
kind: Telemetry
metadata: {name: mesh-default, namespace: istio-system}
spec:
  metrics:
  - providers: [{name: prometheus}]
    reportingInterval: 30s
    overrides:
    - match: {metric: REQUEST_COUNT, mode: CLIENT}
      tagOverrides:
        request_protocol: {operation: REMOVE}
        team: {value: \"'payments'\"}
---
apiVersion: telemetry.istio.io/v1
kind: Telemetry
metadata: {name: quiet-inbound, namespace: bookinfo}
spec:
  selector: {matchLabels: {app: reviews}}
  metrics: [{overrides: [{match: {metric: ALL_METRICS, mode: SERVER}, disabled: true}]}]
";
    let flags = ["--debounce-after", "0s"];
    let f = ConfigFixture::start(Source::Files, &[("metrics.yaml", telemetry)], &flags).await;
    let listeners: BTreeMap<String, Listener> =
        resources(&f, REVIEWS_ID, "reviews", ISTIO_PROXY, LDS).await;
    let outbound = http_filters(&listeners["0.0.0.0_9080"]);
    let (_, stats) = outbound
        .iter()
        .find(|(name, _)| name == "istio.stats")
        .expect("outbound stats");
    let config =
        PluginConfig::decode(&typed(stats, "type.googleapis.com/stats.PluginConfig")[..]).unwrap();
    assert_eq!(config.tcp_reporting_duration.map(|d| d.seconds), Some(30));
    assert_eq!(config.metrics.len(), 1, "{config:?}");
    let count = &config.metrics[0];
    assert_eq!(count.name, "requests_total");
    assert_eq!(count.tags_to_remove, ["request_protocol"]);
    assert_eq!(
        count.dimensions.get("team").map(String::as_str),
        Some("'payments'")
    );
    assert!(!count.drop);

    let inbound = http_filters(&listeners["virtualInbound"]);
    let names: Vec<&str> = inbound.iter().map(|(n, _)| n.as_str()).collect();
    assert!(!names.contains(&"istio.stats"), "{names:?}");
    assert_eq!(names.first(), Some(&"istio.metadata_exchange"));
}

/// Access log services and the other tracers as istiod builds them: OpenTelemetry's log service
/// and Envoy's gRPC one (their log names, peer state, the provider's cluster), a Datadog tracer.
#[tokio::test]
async fn log_services_and_datadog_as_istiod_builds_them() {
    use envoy_types::pb::envoy::config::accesslog::v3::access_log;
    use envoy_types::pb::envoy::config::trace::v3::DatadogConfig;
    use envoy_types::pb::envoy::extensions::access_loggers::grpc::v3::HttpGrpcAccessLogConfig;
    use envoy_types::pb::envoy::extensions::access_loggers::open_telemetry::v3::OpenTelemetryAccessLogConfig;

    let mesh = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        mesh.path(),
        "extensionProviders:
- name: otel-als
  envoyOtelAls: {service: reviews.bookinfo.svc.cluster.local, port: 9080, logFormat: {labels: {code: '%RESPONSE_CODE%'}}}
- name: http-als
  envoyHttpAls: {service: reviews.bookinfo.svc.cluster.local, port: 9080, additionalRequestHeadersToLog: [x-user]}
- name: dd
  datadog: {service: reviews.bookinfo.svc.cluster.local, port: 9080}
- name: sw
  skywalking: {service: reviews.bookinfo.svc.cluster.local, port: 9080}
",
    )
    .unwrap();
    let telemetry = "
apiVersion: telemetry.istio.io/v1
kind: Telemetry
metadata: {name: mesh-default, namespace: istio-system}
spec:
  accessLogging: [{providers: [{name: otel-als}, {name: http-als}]}]
  tracing: [{providers: [{name: dd}]}]
---
apiVersion: telemetry.istio.io/v1
kind: Telemetry
metadata: {name: skywalking, namespace: other}
spec:
  tracing: [{providers: [{name: sw}]}]
";
    let flags = [
        "--debounce-after",
        "0s",
        "--mesh-config",
        mesh.path().to_str().unwrap(),
    ];
    let f = ConfigFixture::start(Source::Files, &[("t.yaml", telemetry)], &flags).await;
    let reviews = listeners(&f, REVIEWS_ID, "reviews").await;
    let hcm = hcm_of(&reviews["0.0.0.0_9080"]);
    let names: Vec<&str> = hcm.access_log.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "envoy.access_loggers.http_grpc",
            "envoy.access_loggers.open_telemetry"
        ]
    );
    let config = |i: usize| match &hcm.access_log[i].config_type {
        Some(access_log::ConfigType::TypedConfig(any)) => any.value.clone(),
        other => panic!("{other:?}"),
    };
    let cluster = "outbound|9080||reviews.bookinfo.svc.cluster.local";
    let http = HttpGrpcAccessLogConfig::decode(&config(0)[..]).unwrap();
    let common = http.common_config.unwrap();
    assert_eq!(common.log_name, "http_envoy_accesslog");
    assert_eq!(
        common.filter_state_objects_to_log,
        ["upstream_peer", "downstream_peer"]
    );
    assert!(format!("{:?}", common.grpc_service).contains(cluster));
    assert_eq!(http.additional_request_headers_to_log, ["x-user"]);
    let otel = OpenTelemetryAccessLogConfig::decode(&config(1)[..]).unwrap();
    // What istiod sends: the common gRPC config Envoy has since deprecated.
    #[allow(deprecated)]
    let common = otel.common_config.unwrap();
    assert_eq!(common.log_name, "otel_envoy_accesslog");
    assert_eq!(common.filter_state_objects_to_log.len(), 6);
    assert!(otel.disable_builtin_labels);
    assert!(format!("{:?}", otel.body).contains("%START_TIME%"));
    assert_eq!(otel.attributes.unwrap().values[0].key, "code");

    let provider = hcm.tracing.and_then(|t| t.provider).expect("a tracer");
    assert_eq!(provider.name, "envoy.tracers.datadog");
    let Some(tracer_http::ConfigType::TypedConfig(any)) = &provider.config_type else {
        panic!()
    };
    let datadog = DatadogConfig::decode(&any.value[..]).unwrap();
    assert_eq!(datadog.collector_cluster, cluster);
    assert_eq!(
        datadog.collector_hostname,
        "reviews.bookinfo.svc.cluster.local"
    );

    // Another namespace's Telemetry: SkyWalking, which alone gets the upstream span.
    let other = listeners(
        &f,
        "sidecar~10.5.0.5~client.other~other.svc.cluster.local",
        "client",
    )
    .await;
    let tracing = hcm_of(&other["0.0.0.0_9080"]).tracing.expect("tracing");
    assert_eq!(
        tracing.provider.map(|p| p.name).as_deref(),
        Some("envoy.tracers.skywalking")
    );
    assert_eq!(tracing.spawn_upstream_span.map(|b| b.value), Some(true));
}
