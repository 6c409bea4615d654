//! End to end: real Envoys (SotW and Delta), a real proxyless gRPC client, and raw ADS streams
//! against meshpilot serving the bundled two-cluster example.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;

const REVIEWS_CLUSTER: &str = "outbound|9080||reviews.bookinfo.svc.cluster.local";
const SIDECAR: &str = "sidecar~10.1.1.11~reviews-v1-7f9c8d.bookinfo~bookinfo.svc.cluster.local";
const BOUND: Duration = Duration::from_secs(15);
const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";

/// A second ready reviews pod in cluster2, as a new manifest file.
const EXTRA_REVIEWS: &str = "
apiVersion: v1
kind: Pod
metadata:
  name: reviews-v3-extra
  namespace: bookinfo
  labels: {app: reviews, version: v3}
spec: {serviceAccountName: bookinfo-reviews, nodeName: node-b1, containers: []}
status: {podIP: 10.2.3.50}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: reviews-extra
  namespace: bookinfo
  labels: {kubernetes.io/service-name: reviews}
addressType: IPv4
ports: [{name: http, port: 9080}]
endpoints:
- addresses: [10.2.3.50]
  conditions: {ready: true}
  targetRef: {kind: Pod, name: reviews-v3-extra, namespace: bookinfo}
";

async fn envoy_sees_both_clusters(mode: AdsMode) {
    let _ports = sidecar_ports().await;
    let dir = copy_tree(Path::new(EXAMPLE));
    let mp = start_meshpilot(dir.path(), &[]).await;
    let envoy = Envoy::start(&mp, SIDECAR, &[("CLUSTER_ID", "cluster1")], mode).await;

    let expected = ["10.1.1.11:9080", "10.2.3.13:9080"];
    wait_for("both clusters' endpoints in Envoy", BOUND, || {
        let envoy = &envoy;
        async move { (envoy.endpoints(REVIEWS_CLUSTER).await == expected).then_some(()) }
    })
    .await;

    let started = Instant::now();
    write_atomic(
        &dir.path().join("clusters/cluster2/extra.yaml"),
        EXTRA_REVIEWS,
    );
    let expected = ["10.1.1.11:9080", "10.2.3.13:9080", "10.2.3.50:9080"];
    wait_for("added endpoint in Envoy", BOUND, || {
        let envoy = &envoy;
        async move { (envoy.endpoints(REVIEWS_CLUSTER).await == expected).then_some(()) }
    })
    .await;
    eprintln!("new endpoint in Envoy after {:?}", started.elapsed());

    assert_eq!(
        envoy.rejected_updates().await,
        0,
        "Envoy rejected an update"
    );
    let syncz = get_json(mp.http_addr, "/debug/syncz").await;
    let proxy = &syncz.as_array().expect("syncz array")[0];
    assert_eq!(proxy["proxy"], SIDECAR);
    assert_eq!(proxy["cluster_id"], "cluster1");
    for ty in ["cds", "eds", "lds", "rds"] {
        let status = &proxy["types"][ty];
        assert!(status["last_nack"].is_null(), "{ty} NACKed: {status}");
        assert_eq!(
            status["acked_version"], status["sent_version"],
            "{ty} not ACKed: {status}"
        );
    }
}

#[tokio::test]
async fn envoy_sotw_sees_both_clusters() {
    envoy_sees_both_clusters(AdsMode::Sotw).await;
}

#[tokio::test]
async fn envoy_delta_sees_both_clusters() {
    envoy_sees_both_clusters(AdsMode::Delta).await;
}

/// grpcio's own xDS client resolves `xds:///<host>:<port>` through meshpilot and calls a real server.
#[tokio::test]
async fn proxyless_grpc_client_calls_through_xds() {
    let mut server = Command::new(peer_python())
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/peers/grpc_echo.py"
        ))
        .arg("serve")
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the gRPC echo server (run ./scripts/test to install grpcio)");
    let mut port_line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(server.stdout.take().expect("stdout")),
        &mut port_line,
    )
    .expect("read the server's port");
    let port: u16 = port_line
        .trim()
        .strip_prefix("PORT ")
        .and_then(|p| p.parse().ok())
        .expect("PORT line");

    let dir = tempfile::tempdir().unwrap();
    let cluster = dir.path().join("clusters/grpc-cluster");
    std::fs::create_dir_all(&cluster).unwrap();
    std::fs::write(cluster.join("echo.yaml"), echo_manifest(port)).unwrap();
    let mp = start_meshpilot(dir.path(), &[]).await;

    let bootstrap = serde_json::json!({
        "xds_servers": [{
            "server_uri": mp.xds_addr.to_string(),
            "channel_creds": [{"type": "insecure"}],
            "server_features": ["xds_v3"]
        }],
        "node": {
            "id": "sidecar~127.0.0.1~client-1.default~default.svc.cluster.local",
            "metadata": {"GENERATOR": "grpc", "CLUSTER_ID": "grpc-cluster", "NAMESPACE": "default"}
        }
    });
    let bootstrap_path = dir.path().join("grpc-bootstrap.json");
    std::fs::write(&bootstrap_path, bootstrap.to_string()).unwrap();

    let client = tokio::process::Command::new(peer_python())
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/peers/grpc_echo.py"
        ))
        .args([
            "call",
            "xds:///echo.default.svc.cluster.local:7070",
            "hello",
        ])
        .env("GRPC_XDS_BOOTSTRAP", &bootstrap_path)
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(BOUND, client)
        .await
        .expect("gRPC call finished")
        .unwrap();
    let _ = server.kill();
    let _ = server.wait();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && stdout.trim() == "echo:hello",
        "stdout: {stdout}\nstderr: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    // The client is gone (and with it its /debug/syncz row); the counters remain.
    let (_, metrics) = http_get(mp.http_addr, "/metrics").await.unwrap();
    let nonzero = |series: &str| {
        metrics
            .lines()
            .any(|l| l.starts_with(series) && !l.ends_with(" 0"))
    };
    assert!(
        !nonzero("pilot_total_xds_rejects{"),
        "a NACK was counted:\n{metrics}"
    );
    for ty in ["lds", "rds", "cds", "eds"] {
        assert!(
            nonzero(&format!("pilot_xds_pushes{{type=\"{ty}\"}}")),
            "no {ty} sent:\n{metrics}"
        );
    }
}

fn echo_manifest(port: u16) -> String {
    format!(
        "
apiVersion: v1
kind: Service
metadata: {{name: echo, namespace: default}}
spec: {{clusterIP: 10.96.0.70, ports: [{{name: grpc, port: 7070, targetPort: {port}}}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: echo-1, namespace: default, labels: {{kubernetes.io/service-name: echo}}}}
addressType: IPv4
ports: [{{name: grpc, port: {port}}}]
endpoints:
- addresses: [127.0.0.1]
  conditions: {{ready: true}}
"
    )
}

#[tokio::test]
async fn malformed_node_id_is_refused_alone() {
    let dir = copy_tree(Path::new(EXAMPLE));
    let mp = start_meshpilot(dir.path(), &[]).await;

    let mut good = AdsClient::connect(mp.xds_addr).await.unwrap();
    good.request(DiscoveryRequest {
        node: Some(node(SIDECAR, &[])),
        type_url: CDS.into(),
        ..Default::default()
    });
    assert!(good.next(BOUND).await.unwrap().is_ok());

    let mut bad = AdsClient::connect(mp.xds_addr).await.unwrap();
    bad.request(DiscoveryRequest {
        node: Some(node("sidecar~10.0.0.1~only-three-parts", &[])),
        type_url: CDS.into(),
        ..Default::default()
    });
    let status = bad
        .next(BOUND)
        .await
        .expect("an answer")
        .expect_err("refused");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(
        status.message().contains("invalid node id"),
        "{}",
        status.message()
    );

    // The good stream is untouched and still receives pushes.
    good.request(DiscoveryRequest {
        type_url: EDS.into(),
        resource_names: vec![REVIEWS_CLUSTER.into()],
        ..Default::default()
    });
    let eds = good.next(BOUND).await.unwrap().unwrap();
    assert_eq!(eds.type_url, EDS);
    assert_eq!(eds.resources.len(), 1);
}

/// An endpoint change pushes EDS only; a reconnecting proxy gets the full state.
#[tokio::test]
async fn endpoint_change_pushes_only_eds() {
    let dir = copy_tree(Path::new(EXAMPLE));
    let mp = start_meshpilot(dir.path(), &["--debounce-after", "0s"]).await;
    let mut ads = AdsClient::connect(mp.xds_addr).await.unwrap();
    ads.request(DiscoveryRequest {
        node: Some(node(SIDECAR, &[("CLUSTER_ID", "cluster1")])),
        type_url: CDS.into(),
        ..Default::default()
    });
    let cds = ads.next(BOUND).await.unwrap().unwrap();
    assert!(cds.resources.len() >= 2);
    ads.request(DiscoveryRequest {
        type_url: CDS.into(),
        version_info: cds.version_info.clone(),
        response_nonce: cds.nonce.clone(),
        ..Default::default()
    });
    ads.request(DiscoveryRequest {
        type_url: EDS.into(),
        resource_names: vec![REVIEWS_CLUSTER.into()],
        ..Default::default()
    });
    let eds = ads.next(BOUND).await.unwrap().unwrap();
    ads.request(DiscoveryRequest {
        type_url: EDS.into(),
        resource_names: vec![REVIEWS_CLUSTER.into()],
        version_info: eds.version_info.clone(),
        response_nonce: eds.nonce.clone(),
        ..Default::default()
    });

    write_atomic(
        &dir.path().join("clusters/cluster2/extra.yaml"),
        EXTRA_REVIEWS,
    );
    let push = ads.next(BOUND).await.expect("a push").unwrap();
    assert_eq!(
        push.type_url, EDS,
        "an endpoint change must push EDS, not {}",
        push.type_url
    );
    assert_eq!(push.resources.len(), 1);
    // Nothing but EDS is pushed.
    ads.silence(Duration::from_millis(300)).await;

    // A reconnecting proxy gets everything at once, the new endpoint included.
    drop(ads);
    let mut again = AdsClient::connect(mp.xds_addr).await.unwrap();
    again.request(DiscoveryRequest {
        node: Some(node(SIDECAR, &[("CLUSTER_ID", "cluster1")])),
        type_url: EDS.into(),
        resource_names: vec![REVIEWS_CLUSTER.into()],
        ..Default::default()
    });
    let eds = again.next(BOUND).await.unwrap().unwrap();
    let cla = <envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment as prost::Message>::decode(
        &eds.resources[0].value[..],
    )
    .unwrap();
    let count: usize = cla.endpoints.iter().map(|l| l.lb_endpoints.len()).sum();
    assert_eq!(
        count, 3,
        "ready endpoints of both clusters, the new one included"
    );
}

#[tokio::test]
async fn a_huge_node_id_is_refused_with_a_short_message() {
    let dir = copy_tree(Path::new(EXAMPLE));
    let mp = start_meshpilot(dir.path(), &[]).await;
    let mut client = AdsClient::connect(mp.xds_addr).await.unwrap();
    let id = format!("sidecar~{}~x.y~y.svc.cluster.local", "9".repeat(10 * 1024));
    client.request(DiscoveryRequest {
        node: Some(node(&id, &[])),
        type_url: CDS.into(),
        ..Default::default()
    });
    let status = client
        .next(BOUND)
        .await
        .expect("an answer")
        .expect_err("refused");
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    let message = status.message();
    assert!(message.contains("is not an IP address"), "{message}");
    assert!(message.len() <= 700, "{} bytes: {message}", message.len());
}
