//! End to end: what istioctl, dashboards and operators read — istiod's metric names after real
//! pushes, rejects and CSRs; istiod-shaped JSON on every debug path; the xDS debug types over
//! grpcio on both ports, the secure one only within the caller's rights.

mod common;

use std::path::Path;
use std::time::Duration;

use base64::Engine;
use common::*;
use envoy_types::pb::envoy::admin::v3::ClustersConfigDump;
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use envoy_types::pb::envoy::service::status::v3::{ClientConfig, ConfigStatus};
use envoy_types::pb::google::rpc::Status as RpcStatus;
use prost::Message;
use serde_json::Value;
use test_apiserver::User;

const BOUND: Duration = Duration::from_secs(20);
const PEER_BOUND: Duration = Duration::from_secs(60);
const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
const REVIEWS: &str = "outbound|9080||reviews.bookinfo.svc.cluster.local";
const BOOKINFO_PROXY: &str = "sidecar~10.1.1.50~productpage-x.bookinfo~bookinfo.svc.cluster.local";
const SHOP_PROXY: &str = "sidecar~10.9.0.5~web-1.shop~shop.svc.cluster.local";
const ISTIOCTL_NODE: &str = "sidecar~0.0.0.0~test-1.istio-system~istio-system.svc.cluster.local";

/// meshpilot with the bundled file clusters beside a config cluster reviewing tokens and a remote
/// onboarded by Secret.
struct Mesh {
    primary: primary::Primary,
    dir: tempfile::TempDir,
}

async fn mesh() -> Mesh {
    mesh_with(&[]).await
}

async fn mesh_with(extra: &[&str]) -> Mesh {
    let dir = copy_tree(Path::new(EXAMPLE));
    let config_dir = dir.path().to_str().unwrap().to_string();
    let mut flags = vec!["--config-dir", &config_dir, "--debounce-after", "0s"];
    flags.extend_from_slice(extra);
    let primary = primary::primary_with_remote(&flags).await;
    primary
        .config
        .add_token("istioctl", User::service_account("istio-system", "default"));
    primary
        .config
        .add_token("shop-web", User::service_account("shop", "default"));
    let admin = primary.mp.http_addr;
    wait_for("east synced", BOUND, || async move {
        (cluster_view(admin, "east").await?["state"] == "synced").then_some(())
    })
    .await;
    Mesh { primary, dir }
}

fn request(node_id: &str, type_url: &str, names: &[&str], nonce: &str) -> DiscoveryRequest {
    DiscoveryRequest {
        node: Some(node(node_id, &[("ISTIO_VERSION", "1.24.0")])),
        type_url: type_url.into(),
        resource_names: names.iter().map(|n| n.to_string()).collect(),
        response_nonce: nonce.into(),
        ..Default::default()
    }
}

/// A plaintext proxy that took and acknowledged its clusters.
async fn synced_proxy(mp: &meshpilot::app::Running, id: &str) -> AdsClient {
    let mut ads = AdsClient::connect(mp.xds_addr).await.unwrap();
    ads.request(request(id, CDS, &[], ""));
    let cds = ads.response(BOUND).await;
    ads.request(DiscoveryRequest {
        version_info: cds.version_info,
        ..request(id, CDS, &[], &cds.nonce)
    });
    ads
}

/// The value of one series (`name` with these labels, in any order) on /metrics.
fn series(metrics: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    metrics.lines().find_map(|line| {
        let (key, value) = line.rsplit_once(' ')?;
        let (metric, rest) = key.split_once('{').unwrap_or((key, "}"));
        let wanted = metric == name
            && labels
                .iter()
                .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")));
        wanted.then(|| value.parse().ok()).flatten()
    })
}

#[tokio::test]
async fn metrics_carry_istiods_names_after_pushes_rejects_and_csrs() {
    let mesh = mesh().await;
    let mp = &mesh.primary.mp;
    let mut ads = synced_proxy(mp, BOOKINFO_PROXY).await;
    ads.request(request(BOOKINFO_PROXY, EDS, &[REVIEWS], ""));
    let eds = ads.response(BOUND).await;
    ads.request(DiscoveryRequest {
        error_detail: Some(RpcStatus {
            code: tonic::Code::InvalidArgument as i32,
            message: "rejected on purpose".into(),
            ..Default::default()
        }),
        ..request(BOOKINFO_PROXY, EDS, &[REVIEWS], &eds.nonce)
    });
    // A change the proxy watches: an endpoint push measured from change to delivery.
    let dir = mesh.dir.path();
    let reviews = dir.join("clusters/cluster1/reviews.yaml");
    let text = std::fs::read_to_string(&reviews).unwrap();
    write_atomic(&reviews, &text.replace("10.1.1.11", "10.1.1.77"));
    ads.response(BOUND).await;

    let certs = tempfile::tempdir().unwrap();
    let reply = primary::grpcio_create_certificate(mp, certs.path(), "shop-web", "primary").await;
    assert!(reply["chain"].is_array(), "{reply}");

    let admin = mp.http_addr;
    let metrics = wait_for("the reject on /metrics", BOUND, || async move {
        let (_, metrics) = http_get(admin, "/metrics").await.ok()?;
        series(&metrics, "pilot_total_xds_rejects", &[("type", "eds")])
            .is_some_and(|v| v == 1.0)
            .then_some(metrics)
    })
    .await;
    let value = |name: &str, labels: &[(&str, &str)]| {
        series(&metrics, name, labels).unwrap_or_else(|| panic!("{name} {labels:?} in\n{metrics}"))
    };
    assert!(
        metrics.contains("# TYPE pilot_xds_pushes counter"),
        "{metrics}"
    );
    assert_eq!(value("pilot_xds", &[("version", "1.24.0")]), 1.0);
    assert!(value("pilot_xds_pushes", &[("type", "cds")]) >= 1.0);
    assert!(value("pilot_xds_pushes", &[("type", "eds")]) >= 2.0);
    assert!(value("pilot_xds_push_time_count", &[("type", "cds")]) >= 1.0);
    assert_eq!(
        value(
            "pilot_xds_push_time_bucket",
            &[("type", "cds"), ("le", "30")]
        ),
        value("pilot_xds_push_time_count", &[("type", "cds")])
    );
    assert_eq!(
        value(
            "pilot_xds_eds_reject",
            &[("node", BOOKINFO_PROXY), ("err", "InvalidArgument")]
        ),
        1.0
    );
    assert!(value("pilot_proxy_convergence_time_count", &[]) >= 1.0);
    assert!(value("pilot_proxy_queue_time_count", &[]) >= 1.0);
    assert!(value("pilot_xds_send_time_count", &[]) >= 1.0);
    assert!(value("pilot_debounce_time_count", &[]) >= 1.0);
    assert!(value("pilot_push_triggers", &[("type", "endpoint")]) >= 1.0);
    assert!(value("pilot_services", &[]) >= 2.0);
    assert_eq!(value("pilot_k8s_endpoints_pending_pod", &[]), 0.0);
    assert_eq!(
        value("istiod_managed_clusters", &[("cluster_type", "local")]),
        1.0
    );
    // cluster1 and cluster2 from files, east from its Secret.
    assert_eq!(
        value("istiod_managed_clusters", &[("cluster_type", "remote")]),
        3.0
    );
    assert_eq!(value("remote_cluster_sync_timeouts_total", &[]), 0.0);
    assert_eq!(value("citadel_server_csr_count", &[]), 1.0);
    assert_eq!(
        value("citadel_server_success_cert_issuance_count", &[]),
        1.0
    );
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(value("citadel_server_root_cert_expiry_timestamp", &[]) > now);

    // The shipped dashboard reads only metrics that exist.
    let dashboard = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/grafana/meshpilot-control-plane.json"
    ))
    .unwrap();
    let dashboard: Value = serde_json::from_str(&dashboard).unwrap();
    let exprs = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().unwrap().clone())
        .map(|t| t["expr"].as_str().unwrap().to_string());
    for expr in exprs {
        let names = expr
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .filter(|w| {
                ["pilot_", "citadel_", "istiod_", "remote_", "meshpilot_"]
                    .iter()
                    .any(|p| w.starts_with(p))
            });
        for name in names {
            // Reject gauges are listed only while a proxy rejects that type (EDS here).
            if name.ends_with("_reject") && name != "pilot_xds_eds_reject" {
                continue;
            }
            assert!(
                metrics.contains(&format!("# TYPE {name} "))
                    || metrics.contains(&format!("\n{name}")),
                "{name} (in {expr}) is not on /metrics"
            );
        }
    }

    // A departed proxy's reject gauge goes with it.
    drop(ads);
    wait_for("the reject gauge dropped", BOUND, || async move {
        let (_, metrics) = http_get(admin, "/metrics").await.ok()?;
        (!metrics.contains("pilot_xds_eds_reject{")).then_some(())
    })
    .await;
}

#[tokio::test]
async fn debug_paths_answer_in_istiods_shapes() {
    let mesh = mesh().await;
    let mp = &mesh.primary.mp;
    let admin = mp.http_addr;
    let _proxy = synced_proxy(mp, BOOKINFO_PROXY).await;

    let syncz = wait_for("the proxy synced on /debug/syncz", BOUND, || async move {
        let rows = get_json(admin, "/debug/syncz").await;
        let row = rows
            .as_array()?
            .iter()
            .find(|r| r["proxy"] == BOOKINFO_PROXY)?
            .clone();
        (row["cluster_acked"].is_string() && row["cluster_acked"] == row["cluster_sent"])
            .then_some(row)
    })
    .await;
    assert_eq!(syncz["proxy_type"], "sidecar");
    assert_eq!(syncz["istio_version"], "1.24.0");
    assert!(
        syncz.get("endpoint_sent").is_none(),
        "EDS never asked: {syncz}"
    );

    let connections = get_json(admin, "/debug/connections").await;
    assert_eq!(connections["totalClients"], 1, "{connections}");
    let client = &connections["clients"][0];
    assert!(
        client["connectionId"]
            .as_str()
            .unwrap()
            .starts_with(&format!("{BOOKINFO_PROXY}-")),
        "{connections}"
    );
    assert!(client["address"]
        .as_str()
        .unwrap()
        .starts_with("127.0.0.1:"));

    let clusterz = get_json(admin, "/debug/clusterz").await;
    let clusters = clusterz.as_array().unwrap();
    assert_eq!(
        clusters[0]["id"], "primary",
        "config cluster first: {clusterz}"
    );
    assert_eq!(clusters[0]["secretName"], "");
    assert_eq!(clusters[0]["syncStatus"], "synced");
    let east = clusters.iter().find(|c| c["id"] == "east").unwrap();
    assert_eq!(east["secretName"], "istio-system/istio-remote-secret-east");
    assert_eq!(east["syncStatus"], "synced");

    // A Service with no endpoints anywhere, for push_status.
    mesh.primary.config.apply_yaml(
        "apiVersion: v1\nkind: Service\nmetadata: {name: lonely, namespace: shop}\n\
         spec: {clusterIP: 10.96.0.77, ports: [{name: http, port: 80}]}\n",
    );
    let lonely = "lonely.shop.svc.cluster.local";
    let registry = wait_for(
        "the new Service on /debug/registryz",
        BOUND,
        || async move {
            let services = get_json(admin, "/debug/registryz").await;
            let found = services.as_array()?.iter().any(|s| s["hostname"] == lonely);
            found.then_some(services)
        },
    )
    .await;
    let reviews = registry
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["hostname"] == "reviews.bookinfo.svc.cluster.local")
        .unwrap();
    assert_eq!(reviews["Attributes"]["Namespace"], "bookinfo");
    assert_eq!(reviews["Attributes"]["ServiceRegistry"], "Kubernetes");
    assert_eq!(reviews["ports"][0]["port"], 9080);
    assert_eq!(reviews["ports"][0]["protocol"], "HTTP");
    assert_eq!(reviews["Resolution"], 0);
    assert!(reviews["clusterVIPs"]["Addresses"].is_object(), "{reviews}");

    let endpointz = get_json(admin, "/debug/endpointz").await;
    let shard = &endpointz["reviews.bookinfo.svc.cluster.local"]["bookinfo"];
    let cluster1 = shard["Shards"]["File/cluster1"].as_array().unwrap();
    let ep = cluster1
        .iter()
        .find(|e| e["Address"] == "10.1.1.11")
        .unwrap();
    assert_eq!(ep["ServicePortName"], "http");
    assert_eq!(ep["HealthStatus"], 1);
    assert_eq!(ep["Locality"]["ClusterID"], "cluster1");
    assert!(shard["ServiceAccounts"]
        .as_object()
        .unwrap()
        .contains_key("spiffe://cluster.local/ns/bookinfo/sa/bookinfo-reviews"));

    let status = get_json(admin, "/debug/push_status").await;
    assert!(
        status["pilot_eds_no_instances"]
            .as_object()
            .is_some_and(|m| m.contains_key(&format!("outbound|80||{lonely}"))),
        "{status}"
    );
    assert!(
        !status["pilot_eds_no_instances"]
            .as_object()
            .unwrap()
            .contains_key(REVIEWS),
        "{status}"
    );

    let dump = get_json(admin, "/debug/config_dump?proxyID=productpage-x.bookinfo").await;
    let configs = dump["configs"].as_array().unwrap();
    let types: Vec<&str> = configs
        .iter()
        .map(|c| c["@type"].as_str().unwrap())
        .collect();
    assert_eq!(
        types,
        [
            "type.googleapis.com/envoy.admin.v3.BootstrapConfigDump",
            "type.googleapis.com/envoy.admin.v3.ClustersConfigDump",
            "type.googleapis.com/envoy.admin.v3.ListenersConfigDump",
            "type.googleapis.com/envoy.admin.v3.RoutesConfigDump",
            "type.googleapis.com/envoy.admin.v3.SecretsConfigDump",
        ]
    );
    let clusters = configs[1]["dynamicActiveClusters"].as_array().unwrap();
    assert!(
        clusters.iter().any(|c| c["cluster"]["name"] == REVIEWS),
        "{dump}"
    );
    assert!(configs[2]["dynamicListeners"]
        .as_array()
        .is_some_and(|l| !l.is_empty()));
    let (missing, _) = http_get(admin, "/debug/config_dump").await.unwrap();
    assert_eq!(missing, 400);
    let (unknown, _) = http_get(admin, "/debug/config_dump?proxyID=nobody.nowhere")
        .await
        .unwrap();
    assert_eq!(unknown, 404);
    assert!(get_json(admin, "/debug/configz").await.is_array());
    let list = get_json(admin, "/debug/list").await;
    assert!(list.as_array().unwrap().iter().any(|p| p == "syncz"));
}

/// Runs the grpcio debug client; Ok(response) or Err((code, details)).
async fn grpcio_debug(
    target: std::net::SocketAddr,
    type_url: &str,
    node: &str,
    name: &str,
    secure: Option<(&Path, &str)>,
) -> Result<DiscoveryResponse, (String, String)> {
    let namespace = node_namespace(node);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/peers/ads_debug.py");
    let mut command = tokio::process::Command::new(peer_python());
    command
        .arg(script)
        .args([&target.to_string(), type_url, node, &namespace, name]);
    if let Some((root, token)) = secure {
        command.arg(root).arg(token);
    }
    // A hang guard only: starting Python and importing grpcio alone can take seconds on a busy
    // machine, and the call itself has a 30 s deadline.
    let output = tokio::time::timeout(PEER_BOUND, command.kill_on_drop(true).output())
        .await
        .expect("debug call finished")
        .unwrap();
    let reply: Value = serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&output.stderr)));
    match reply["response"].as_str() {
        Some(b64) => {
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(b64)
                .unwrap();
            Ok(DiscoveryResponse::decode(bytes.as_slice()).unwrap())
        }
        None => Err((
            reply["code"].as_str().unwrap_or_default().to_string(),
            reply["details"].as_str().unwrap_or_default().to_string(),
        )),
    }
}

fn client_configs(response: &DiscoveryResponse) -> Vec<ClientConfig> {
    response
        .resources
        .iter()
        .map(|any| {
            assert_eq!(
                any.type_url,
                "type.googleapis.com/envoy.service.status.v3.ClientConfig"
            );
            ClientConfig::decode(any.value.as_slice()).unwrap()
        })
        .collect()
}

fn listed(response: &DiscoveryResponse) -> Vec<String> {
    let mut ids: Vec<String> = client_configs(response)
        .into_iter()
        .map(|c| c.node.unwrap().id)
        .collect();
    ids.sort();
    ids
}

#[tokio::test]
async fn xds_debug_types_over_grpcio_on_both_ports() {
    let mesh = mesh().await;
    let mp = &mesh.primary.mp;
    let _bookinfo = synced_proxy(mp, BOOKINFO_PROXY).await;
    let _shop = synced_proxy(mp, SHOP_PROXY).await;
    let admin = mp.http_addr;
    wait_for("both proxies acknowledged", BOUND, || async move {
        let rows = get_json(admin, "/debug/syncz").await;
        let acked = rows
            .as_array()?
            .iter()
            .filter(|r| r["cluster_acked"].is_string())
            .count();
        (acked == 2).then_some(())
    })
    .await;

    // Plaintext: no identity, no debug views (as istiod: "authentication required").
    for (type_url, name) in [
        ("istio.io/debug/syncz", "-"),
        ("istio.io/debug/config_dump", "productpage-x.bookinfo"),
        ("istio.io/debug", "clusterz"),
    ] {
        let refused = grpcio_debug(mp.xds_addr, type_url, ISTIOCTL_NODE, name, None)
            .await
            .unwrap_err();
        assert_eq!(refused.0, "UNAUTHENTICATED", "{type_url}: {refused:?}");
        assert!(refused.1.contains("authentication required"), "{refused:?}");
    }

    // Secure port: the system namespace sees every proxy, istioctl itself not listed.
    let certs = tempfile::tempdir().unwrap();
    let root = certs.path().join("root.pem");
    std::fs::write(&root, mp.ca.current().root_pem()).unwrap();
    let secure = mp.secure_xds_addr;
    let istioctl = Some((root.as_path(), "istioctl"));
    let syncz = grpcio_debug(secure, "istio.io/debug/syncz", ISTIOCTL_NODE, "-", istioctl)
        .await
        .unwrap();
    assert_eq!(syncz.type_url, "istio.io/debug/syncz");
    let identity: Value =
        serde_json::from_str(&syncz.control_plane.as_ref().unwrap().identifier).unwrap();
    assert_eq!(identity["Component"], "istiod");
    assert_eq!(listed(&syncz), [BOOKINFO_PROXY, SHOP_PROXY]);
    let config = client_configs(&syncz)
        .into_iter()
        .find(|c| c.node.as_ref().unwrap().id == BOOKINFO_PROXY)
        .unwrap();
    let status_of = |url: &str| {
        config
            .generic_xds_configs
            .iter()
            .find(|g| g.type_url == url)
            .map(|g| g.config_status)
    };
    assert_eq!(status_of(CDS), Some(ConfigStatus::Synced as i32));
    assert_eq!(status_of(EDS), Some(ConfigStatus::NotSent as i32));
    let metadata = &config
        .node
        .as_ref()
        .unwrap()
        .metadata
        .as_ref()
        .unwrap()
        .fields;
    assert!(metadata.contains_key("ISTIO_VERSION") && metadata.contains_key("CLUSTER_ID"));

    let dump = grpcio_debug(
        secure,
        "istio.io/debug/config_dump",
        ISTIOCTL_NODE,
        "productpage-x.bookinfo",
        istioctl,
    )
    .await
    .unwrap();
    let clusters = dump
        .resources
        .iter()
        .find(|a| a.type_url == "type.googleapis.com/envoy.admin.v3.ClustersConfigDump")
        .map(|a| ClustersConfigDump::decode(a.value.as_slice()).unwrap())
        .expect("a clusters dump");
    assert!(!clusters.dynamic_active_clusters.is_empty());

    let clusterz = grpcio_debug(
        secure,
        "istio.io/debug",
        ISTIOCTL_NODE,
        "clusterz",
        istioctl,
    )
    .await
    .unwrap();
    assert_eq!(clusterz.resources[0].type_url, "istio.io/debug");
    let body: Value = serde_json::from_slice(&clusterz.resources[0].value).unwrap();
    assert_eq!(body[0]["id"], "primary");

    // Another namespace sees only its own proxies.
    let shop_node = "sidecar~10.9.0.9~debug.shop~shop.svc.cluster.local";
    let own = grpcio_debug(
        secure,
        "istio.io/debug/syncz",
        shop_node,
        "-",
        Some((&root, "shop-web")),
    )
    .await
    .unwrap();
    assert_eq!(listed(&own), [SHOP_PROXY], "only its namespace");
    let foreign = grpcio_debug(
        secure,
        "istio.io/debug/config_dump",
        shop_node,
        "productpage-x.bookinfo",
        Some((&root, "shop-web")),
    )
    .await
    .unwrap();
    assert!(
        foreign.resources.is_empty(),
        "no dump of another namespace's proxy"
    );
    let refused = grpcio_debug(
        secure,
        "istio.io/debug",
        shop_node,
        "clusterz",
        Some((&root, "shop-web")),
    )
    .await
    .unwrap_err();
    assert_eq!(refused.0, "PERMISSION_DENIED", "{refused:?}");
    let anonymous = grpcio_debug(
        secure,
        "istio.io/debug/syncz",
        ISTIOCTL_NODE,
        "-",
        Some((&root, "no-such-token")),
    )
    .await
    .unwrap_err();
    assert!(
        ["UNAUTHENTICATED", "PERMISSION_DENIED"].contains(&anonymous.0.as_str()),
        "{anonymous:?}"
    );
}

/// `curl` from a network namespace of its own (a caller on another host): the status code.
async fn curl_from(ns: &netns::Netns, url: &str, token: Option<&str>) -> String {
    let mut command = tokio::process::Command::new("ip");
    command.args(["netns", "exec", &ns.name, "curl", "-sS", "-o", "/dev/null"]);
    command.args(["-w", "%{http_code}", "--max-time", "10"]);
    if let Some(token) = token {
        command.args(["-H", &format!("Authorization: Bearer {token}")]);
    }
    let out = command.arg(url).output().await.expect("curl runs");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test]
async fn admin_debug_views_need_loopback_or_a_system_namespace_token() {
    let mesh = mesh_with(&["--http-addr", "0.0.0.0:0", "--debug-namespaces", "ops"]).await;
    let config = &mesh.primary.config;
    config.add_token("ops-reader", User::service_account("ops", "reader"));
    let port = mesh.primary.mp.http_addr.port();
    let tag = std::process::id() % 100_000;
    let caller = netns::Netns::create(&format!("dbg{tag}"));
    netns::link(
        None,
        &format!("dbg{tag}h"),
        "10.223.0.1/30",
        &caller,
        "eth0",
        "10.223.0.2/30",
    );
    let url = |path: &str| format!("http://10.223.0.1:{port}{path}");

    // From another host: open paths answer, debug views want a proven system-namespace account.
    for open in ["/healthz", "/ready", "/metrics"] {
        assert_eq!(curl_from(&caller, &url(open), None).await, "200", "{open}");
    }
    let clusterz = url("/debug/clusterz");
    assert_eq!(curl_from(&caller, &clusterz, None).await, "401");
    assert_eq!(
        curl_from(&caller, &clusterz, Some("no-such-token")).await,
        "401"
    );
    assert_eq!(curl_from(&caller, &clusterz, Some("shop-web")).await, "403");
    assert_eq!(curl_from(&caller, &clusterz, Some("istioctl")).await, "200");
    assert_eq!(
        curl_from(&caller, &clusterz, Some("ops-reader")).await,
        "200"
    );
    // The same server from loopback: no token needed.
    let local = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let (status, body) = http_get(local, "/debug/clusterz").await.unwrap();
    assert_eq!(status, 200, "{body}");
}

#[tokio::test]
async fn a_hung_token_review_fails_the_stream_within_its_deadline() {
    let mesh = mesh().await;
    let mp = &mesh.primary.mp;
    let certs = tempfile::tempdir().unwrap();
    let root = certs.path().join("root.pem");
    std::fs::write(&root, mp.ca.current().root_pem()).unwrap();
    // meshpilot reviews tokens on the config cluster as its admin user: those reviews now hang.
    mesh.primary.config.hold("admin", "create", "tokenreviews");
    let started = std::time::Instant::now();
    let refused = grpcio_debug(
        mp.secure_xds_addr,
        "istio.io/debug/syncz",
        ISTIOCTL_NODE,
        "-",
        Some((&root, "istioctl")),
    )
    .await
    .unwrap_err();
    let took = started.elapsed();
    assert_eq!(refused.0, "UNAUTHENTICATED", "{refused:?}");
    assert!(
        refused
            .1
            .contains("token review on cluster primary failed: no answer within 10s"),
        "{refused:?}"
    );
    let deadline = meshpilot::security::authn::REVIEW_DEADLINE;
    assert!(
        took >= deadline,
        "refused after {took:?}, before the deadline"
    );
    mesh.primary
        .config
        .let_go("admin", "create", "tokenreviews");
}
