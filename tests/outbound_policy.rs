//! Mesh config `outboundTrafficPolicy` with real traffic: an application behind an Istio-style
//! captured sidecar calls a host outside the mesh. ALLOW_ANY passes it through; after the mesh
//! config file changes to REGISTRY_ONLY, the same calls end in the black hole (502 on an HTTP port
//! the mesh uses, a reset elsewhere). Needs root (network namespaces, iptables).

mod common;

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use common::netns::{link, Netns};
use common::*;

const BOUND: Duration = Duration::from_secs(30);
const APP_UID: &str = "1000";
const OUTSIDE: &str = "10.216.3.2";

/// A mesh service on port 8080 (so that port has an HTTP listener) and the client's own pod.
const MESH: &str = "
apiVersion: v1
kind: Service
metadata: {name: echo, namespace: default}
spec: {clusterIP: 10.96.66.66, ports: [{name: http, port: 8080}]}
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: default, labels: {app: client}}
spec: {serviceAccountName: client, containers: []}
status: {podIP: 10.216.3.1}
";

/// The application's `curl` to `url` (as its own user, so the sidecar captures it): the HTTP status,
/// or 0 when the connection failed.
fn curl(client: &Netns, url: &str) -> u16 {
    client.curl(Some(APP_UID), &[url])
}

#[tokio::test]
async fn unknown_destinations_follow_the_outbound_traffic_policy() {
    let _ports = sidecar_ports().await;
    let tag = std::process::id() % 100_000;
    let client = Netns::create(&format!("mpoc{tag}"));
    let mut outside = Netns::create(&format!("mpoo{tag}"));
    link(
        None,
        &format!("mpoc{tag}h"),
        "10.216.1.1/30",
        &client,
        "ctl",
        "10.216.1.2/30",
    );
    link(
        Some(&client),
        "data",
        "10.216.3.1/24",
        &outside,
        "data",
        &format!("{OUTSIDE}/24"),
    );
    client.capture_outbound(APP_UID);
    outside.serve_http_echo(8080);
    outside.serve_http_echo(9999);

    let dir = tempfile::tempdir().unwrap();
    let cluster = dir.path().join("clusters/c1");
    std::fs::create_dir_all(&cluster).unwrap();
    std::fs::write(cluster.join("mesh.yaml"), MESH).unwrap();
    let mesh_config = dir.path().join("mesh.yaml");
    std::fs::write(&mesh_config, "outboundTrafficPolicy: {mode: ALLOW_ANY}\n").unwrap();
    let mp = start_meshpilot(
        dir.path(),
        &[
            "--xds-addr",
            "0.0.0.0:0",
            "--mesh-config",
            mesh_config.to_str().unwrap(),
            "--debounce-after",
            "0s",
        ],
    )
    .await;
    let envoy = Envoy::start_with(EnvoyOptions {
        xds: SocketAddr::new("10.216.1.1".parse().unwrap(), mp.xds_addr.port()),
        node_id: "sidecar~10.216.3.1~client.default~default.svc.cluster.local",
        metadata: &[("CLUSTER_ID", "c1")],
        labels: &[],
        mode: AdsMode::Sotw,
        workload: workload_certs(&mp, "default", "client"),
        xds_tls: None,
        netns: Some(InNetns {
            name: client.name.clone(),
            ip: "10.216.1.2".parse::<IpAddr>().unwrap(),
            host_ip: "10.216.1.1".parse().unwrap(),
        }),
    })
    .await;

    let http_port = format!("http://{OUTSIDE}:8080/");
    let other_port = format!("http://{OUTSIDE}:9999/");
    wait_for("ALLOW_ANY: both ports pass through", BOUND, || {
        let ok = curl(&client, &http_port) == 200 && curl(&client, &other_port) == 200;
        async move { ok.then_some(()) }
    })
    .await;
    let passed = envoy
        .counter("cluster.PassthroughCluster.upstream_cx_total")
        .await;
    assert!(
        passed >= 2,
        "{passed} connections through PassthroughCluster"
    );

    write_atomic(
        &mesh_config,
        "outboundTrafficPolicy: {mode: REGISTRY_ONLY}\n",
    );
    wait_for("REGISTRY_ONLY: 502 on the mesh's HTTP port", BOUND, || {
        let status = curl(&client, &http_port);
        async move { (status == 502).then_some(()) }
    })
    .await;
    wait_for("REGISTRY_ONLY: no connection elsewhere", BOUND, || {
        let status = curl(&client, &other_port);
        async move { (status == 0).then_some(()) }
    })
    .await;
    assert!(
        envoy
            .counter("cluster.BlackHoleCluster.upstream_cx_none_healthy")
            .await
            >= 1,
        "the reset came from the black hole"
    );
    assert_eq!(envoy.rejected_updates().await, 0);
    let mesh = get_json(mp.http_addr, "/debug/mesh").await;
    assert_eq!(
        mesh["meshConfig"]["outboundTrafficPolicy"]["mode"],
        "REGISTRY_ONLY"
    );
}
