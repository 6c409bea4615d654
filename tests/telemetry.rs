//! The Telemetry API's access logging as proxies receive it, decoded from raw ADS responses: the
//! root namespace's, the namespace's and the workload's Telemetry in Istio's precedence, each
//! side of the traffic (`match.mode`) on its own listeners, from files and from the config cluster.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::config_source::{ConfigFixture, Source};
use common::*;
use envoy_types::pb::envoy::config::accesslog::v3::{access_log, AccessLog};
use envoy_types::pb::envoy::config::listener::v3::{filter, Filter, Listener};
use envoy_types::pb::envoy::extensions::access_loggers::file::v3::FileAccessLog;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::HttpConnectionManager;
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::TcpProxy;
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use prost::Message;

const BOUND: Duration = Duration::from_secs(10);
const LDS: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";

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
    let mut ads = AdsClient::connect(f.mp.xds_addr).await.unwrap();
    ads.request(DiscoveryRequest {
        node: Some(labelled_node(
            id,
            &[("CLUSTER_ID", "cluster1")],
            &[("app", app)],
        )),
        type_url: LDS.into(),
        ..Default::default()
    });
    ads.response(BOUND)
        .await
        .resources
        .iter()
        .map(|a| Listener::decode(&a.value[..]).expect("a listener"))
        .map(|l| (l.name.clone(), l))
        .collect()
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
    let reviews = listeners(
        &f,
        "sidecar~10.1.1.11~reviews-v1-7f9c8d.bookinfo~bookinfo.svc.cluster.local",
        "reviews",
    )
    .await;
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
        let reviews = listeners(
            &f,
            "sidecar~10.1.1.11~reviews-v1-7f9c8d.bookinfo~bookinfo.svc.cluster.local",
            "reviews",
        )
        .await;
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
