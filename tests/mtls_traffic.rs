//! Real traffic: an HTTP request from a client goes through its own Envoy sidecar (captured by
//! iptables, as Istio's init container sets up), over mutual TLS with meshpilot-issued certificates,
//! to the server's Envoy sidecar and its application — each workload in its own network namespace.
//! Needs root (network namespaces, iptables).

mod common;

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use common::netns::{link, Netns};
use common::*;

const BOUND: Duration = Duration::from_secs(30);
const ECHO_CLUSTER: &str = "outbound|8080||echo.default.svc.cluster.local";
/// The client application's uid: only its traffic is captured (Envoy's own is not).
const APP_UID: &str = "1000";

fn manifests(client_ip: &str, server_ip: &str) -> String {
    format!(
        "
apiVersion: v1
kind: Service
metadata: {{name: echo, namespace: default}}
spec: {{clusterIP: 10.96.77.77, ports: [{{name: http, port: 8080}}]}}
---
apiVersion: v1
kind: Pod
metadata: {{name: server, namespace: default, labels: {{app: echo, security.istio.io/tlsMode: istio}}}}
spec: {{serviceAccountName: server, containers: []}}
status: {{podIP: {server_ip}}}
---
apiVersion: v1
kind: Pod
metadata: {{name: client, namespace: default, labels: {{app: client, security.istio.io/tlsMode: istio}}}}
spec: {{serviceAccountName: client, containers: []}}
status: {{podIP: {client_ip}}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: echo-1, namespace: default, labels: {{kubernetes.io/service-name: echo}}}}
addressType: IPv4
ports: [{{name: http, port: 8080}}]
endpoints:
- addresses: [{server_ip}]
  conditions: {{ready: true}}
  targetRef: {{kind: Pod, name: server, namespace: default}}
"
    )
}

#[tokio::test]
async fn http_between_two_sidecars_travels_over_mutual_tls() {
    let tag = std::process::id() % 100_000;
    let client_ns = Netns::create(&format!("mpc{tag}"));
    let mut server_ns = Netns::create(&format!("mps{tag}"));
    // Control links to the host (xDS, SDS, admin) and one data link between the two workloads.
    link(
        None,
        &format!("mpc{tag}h"),
        "10.213.1.1/30",
        &client_ns,
        "ctl",
        "10.213.1.2/30",
    );
    link(
        None,
        &format!("mps{tag}h"),
        "10.213.2.1/30",
        &server_ns,
        "ctl",
        "10.213.2.2/30",
    );
    link(
        Some(&client_ns),
        "data",
        "10.213.3.1/24",
        &server_ns,
        "data",
        "10.213.3.2/24",
    );
    client_ns.run("ip", &["route", "add", "10.96.0.0/16", "dev", "data"]);
    // Istio-style capture: the client app's outbound TCP to 15001, the server's inbound to 15006.
    client_ns.capture_outbound(APP_UID);
    server_ns.capture_inbound("data");
    server_ns.serve_http_echo(8080);

    let dir = tempfile::tempdir().unwrap();
    let cluster = dir.path().join("clusters/c1");
    std::fs::create_dir_all(&cluster).unwrap();
    std::fs::write(
        cluster.join("echo.yaml"),
        manifests("10.213.3.1", "10.213.3.2"),
    )
    .unwrap();
    let mp = start_meshpilot(dir.path(), &["--xds-addr", "0.0.0.0:0"]).await;

    let sidecar = |ns: &Netns, ns_ip: &str, host_ip: &str, node_id: &'static str, account: &str| {
        EnvoyOptions {
            xds: SocketAddr::new(host_ip.parse().unwrap(), mp.xds_addr.port()),
            node_id,
            metadata: &[("CLUSTER_ID", "c1")],
            labels: &[],
            mode: AdsMode::Sotw,
            workload: workload_certs(&mp, "default", account),
            xds_tls: None,
            netns: Some(InNetns {
                name: ns.name.clone(),
                ip: ns_ip.parse::<IpAddr>().unwrap(),
                host_ip: host_ip.parse().unwrap(),
            }),
        }
    };
    let client_envoy = Envoy::start_with(sidecar(
        &client_ns,
        "10.213.1.2",
        "10.213.1.1",
        "sidecar~10.213.3.1~client.default~default.svc.cluster.local",
        "client",
    ))
    .await;
    let server_envoy = Envoy::start_with(sidecar(
        &server_ns,
        "10.213.2.2",
        "10.213.2.1",
        "sidecar~10.213.3.2~server.default~default.svc.cluster.local",
        "server",
    ))
    .await;
    wait_for("client sidecar knows the server", BOUND, || {
        let envoy = &client_envoy;
        async move { (envoy.endpoints(ECHO_CLUSTER).await == ["10.213.3.2:8080"]).then_some(()) }
    })
    .await;
    wait_for("server sidecar has its inbound listener", BOUND, || {
        let envoy = &server_envoy;
        async move {
            envoy
                .get("/listeners")
                .await
                .contains("virtualInbound")
                .then_some(())
        }
    })
    .await;

    // The client application calls the service by name and VIP, as a Kubernetes client would.
    let response = wait_for("a response through both sidecars", BOUND, || {
        let output = client_ns
            .command("setpriv")
            .args([
                "--reuid",
                APP_UID,
                "--regid",
                APP_UID,
                "--clear-groups",
                "curl",
                "-s",
                "-m",
                "3",
            ])
            .args([
                "-H",
                "Host: echo.default.svc.cluster.local:8080",
                "http://10.96.77.77:8080/hello",
            ])
            .output();
        async move {
            let output = output.ok()?;
            let body: serde_json::Value = serde_json::from_slice(&output.stdout).ok()?;
            (body["path"] == "/hello").then_some(body)
        }
    })
    .await;

    let xfcc = response["headers"]["x-forwarded-client-cert"]
        .as_str()
        .unwrap_or_default();
    assert!(
        xfcc.contains("URI=spiffe://cluster.local/ns/default/sa/client"),
        "the server's sidecar did not see the client's certificate: {response}"
    );
    let handshakes = server_envoy
        .counter("listener.0.0.0.0_15006.ssl.handshake")
        .await;
    assert!(
        handshakes >= 1,
        "no TLS handshake on the server's inbound listener"
    );
    assert_eq!(
        server_envoy
            .counter("listener.0.0.0.0_15006.ssl.no_certificate")
            .await,
        0
    );
    assert!(
        client_envoy
            .counter(&format!("cluster.{ECHO_CLUSTER}.ssl.handshake"))
            .await
            >= 1,
        "the client's sidecar did not originate TLS"
    );
    assert_eq!(
        client_envoy.rejected_updates().await + server_envoy.rejected_updates().await,
        0
    );
}
