//! DNS proxying with real traffic: an application behind an Istio-style captured sidecar (its TCP to
//! 15001, its DNS to the agent's 15053) resolves names with the system resolver (curl, glibc) from
//! the name table meshpilot sends, and reaches a service that exists only in the other cluster, and
//! two external TCP services on one port told apart by their allocated addresses. Needs root
//! (network namespaces, iptables).

mod common;

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use common::nds::{NdsAgent, Protocol};
use common::netns::{link, Netns, ResolvConf};
use common::*;
use serde_json::Value;

const BOUND: Duration = Duration::from_secs(30);
const APP_UID: &str = "1000";
const V1: &str = "10.219.3.2";
const V2: &str = "10.219.3.3";
const NODE: &str = "sidecar~10.219.3.1~client-1.shop~shop.svc.cluster.local";
/// Where the application's resolver sends queries (a cluster DNS address); captured to 15053.
const CLUSTER_DNS: &str = "10.96.0.10";

/// `web` exists only in west; its pod is on the flat network the client reaches.
const WEST: &str = "
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec: {clusterIP: 10.11.0.30, ports: [{name: http, port: 80, targetPort: 8080}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints: [{addresses: [10.219.3.2], conditions: {ready: true}}]
";

const EAST: &str = "
apiVersion: v1
kind: Service
metadata: {name: client, namespace: shop}
spec: {clusterIP: 10.10.0.40, ports: [{name: http, port: 80}]}
";

/// Two external TCP services on one port, without addresses.
const ENTRIES: &str = "
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: a, namespace: shop}
spec:
  hosts: [a.example.com]
  ports: [{number: 9000, name: tcp, protocol: TCP, targetPort: 8080}]
  resolution: DNS
  endpoints: [{address: 10.219.3.2}]
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: b, namespace: shop}
spec:
  hosts: [b.example.com]
  ports: [{number: 9000, name: tcp, protocol: TCP, targetPort: 8080}]
  resolution: DNS
  endpoints: [{address: 10.219.3.3}]
";

/// The application's GET by name (as its own user: its DNS and TCP are captured): the echo's
/// answer, or None when the request failed.
fn get(client: &Netns, url: &str) -> Option<Value> {
    let output = client
        .command("setpriv")
        .args(["--reuid", APP_UID, "--regid", APP_UID, "--clear-groups"])
        .args(["curl", "-s", "-m", "3", url])
        .output()
        .expect("curl runs");
    serde_json::from_slice(&output.stdout).ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_application_reaches_a_remote_only_service_by_name() {
    let _ports = sidecar_ports().await;
    let tag = std::process::id() % 100_000;
    let client = Netns::create(&format!("mpdc{tag}"));
    let mut backend = Netns::create(&format!("mpdb{tag}"));
    let _resolv = ResolvConf::write(&client.name, CLUSTER_DNS, "shop");
    link(
        None,
        &format!("mpdc{tag}h"),
        "10.219.1.1/30",
        &client,
        "ctl",
        "10.219.1.2/30",
    );
    link(
        Some(&client),
        "data",
        "10.219.3.1/24",
        &backend,
        "data",
        &format!("{V1}/24"),
    );
    backend.run("ip", &["addr", "add", &format!("{V2}/24"), "dev", "data"]);
    for range in ["10.0.0.0/8", "240.240.0.0/16"] {
        client.run("ip", &["route", "add", range, "dev", "data"]);
    }
    client.capture_outbound(APP_UID);
    client.capture_dns(APP_UID);
    backend.serve_http_echo(8080);

    let dir = tempfile::tempdir().unwrap();
    for (cluster, text) in [("east", EAST), ("west", WEST)] {
        std::fs::create_dir_all(dir.path().join("clusters").join(cluster)).unwrap();
        std::fs::write(
            dir.path().join("clusters").join(cluster).join("shop.yaml"),
            text,
        )
        .unwrap();
    }
    std::fs::create_dir_all(dir.path().join("config")).unwrap();
    std::fs::write(dir.path().join("config/entries.yaml"), ENTRIES).unwrap();
    let mp = start_meshpilot(dir.path(), &["--xds-addr", "0.0.0.0:0"]).await;
    let xds = SocketAddr::new("10.219.1.1".parse().unwrap(), mp.xds_addr.port());
    // The agent and Envoy share the node's metadata, DNS_CAPTURE included.
    let metadata = [("CLUSTER_ID", "east"), ("DNS_CAPTURE", "true")];
    let mut agent = NdsAgent::start(
        xds,
        NODE,
        ("east", ""),
        Protocol::Sotw,
        Some((&client.name, "127.0.0.1:15053")),
    );
    agent.dns_address(BOUND).await;
    agent
        .table_where("with web", BOUND, |t| {
            t.get("web.shop.svc.cluster.local").is_some()
        })
        .await;
    let envoy = Envoy::start_with(EnvoyOptions {
        xds,
        replicas: &[],
        node_id: NODE,
        metadata: &metadata,
        labels: &[],
        mode: AdsMode::Sotw,
        workload: workload_certs(&mp, "shop", "client"),
        xds_tls: None,
        netns: Some(InNetns {
            name: client.name.clone(),
            ip: "10.219.1.2".parse::<IpAddr>().unwrap(),
            host_ip: "10.219.1.1".parse().unwrap(),
        }),
    })
    .await;
    wait_for("web's endpoint in the sidecar", BOUND, || {
        let envoy = &envoy;
        async move {
            let eps = envoy
                .endpoints("outbound|80||web.shop.svc.cluster.local")
                .await;
            (eps == [format!("{V1}:8080")]).then_some(())
        }
    })
    .await;

    // By its full name and by the short name the search path completes.
    for url in [
        "http://web.shop.svc.cluster.local/hello",
        "http://web/hello",
    ] {
        let answer = wait_for(url, BOUND, || {
            let answer = get(&client, url);
            async move { answer }
        })
        .await;
        assert_eq!(answer["server"], V1, "{url}: {answer}");
    }

    // One port, two external services: each name reaches its own backend.
    for (host, server) in [("a.example.com", V1), ("b.example.com", V2)] {
        let url = format!("http://{host}:9000/ext");
        let answer = wait_for(&url, BOUND, || {
            let answer = get(&client, &url);
            async move { answer }
        })
        .await;
        assert_eq!(answer["server"], server, "{url}: {answer}");
    }
    assert_eq!(envoy.rejected_updates().await, 0);
}
