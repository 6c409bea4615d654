//! A headless Kubernetes Service with a TCP port, as istiod serves it to a sidecar
//! (pilot/pkg/networking/core/listener.go, cluster_tls.go): the port's outbound listener matches
//! each pod's address (not the proxy's own) to the service's ORIGINAL_DST cluster, which
//! originates mTLS when every endpoint has a sidecar; a pod joining is pushed to the proxies'
//! listeners, and one without a sidecar turns mTLS off.

mod common;

use std::time::Duration;

use common::ads::{fetch, AdsClient};
use common::*;
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::listener::v3::Listener;
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;

const BOUND: Duration = Duration::from_secs(10);
const LDS: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const CLUSTER: &str = "outbound|27017||db.shop.svc.cluster.local";
const PROXY: &str = "sidecar~10.30.0.10~db-0.shop~shop.svc.cluster.local";

const SERVICE: &str = "
apiVersion: v1
kind: Service
metadata: {name: db, namespace: shop}
spec: {clusterIP: None, ports: [{name: tcp-mongo, port: 27017}]}
";

/// The db pods (the proxy is db-0) and the service's EndpointSlice, `sidecars` saying which
/// pods carry Istio's `security.istio.io/tlsMode` label.
fn pods(ips: &[(&str, bool)]) -> String {
    let mut yaml = String::new();
    let mut endpoints = String::new();
    for (i, (ip, sidecar)) in ips.iter().enumerate() {
        let tls = match sidecar {
            true => ", security.istio.io/tlsMode: istio",
            false => "",
        };
        yaml.push_str(&format!(
            "---\napiVersion: v1\nkind: Pod\nmetadata: {{name: db-{i}, namespace: shop, labels: {{app: db{tls}}}}}\nspec: {{serviceAccountName: db}}\nstatus: {{podIP: {ip}}}\n"
        ));
        endpoints.push_str(&format!(
            "- {{addresses: [{ip}], conditions: {{ready: true}}, targetRef: {{kind: Pod, name: db-{i}, namespace: shop}}}}\n"
        ));
    }
    yaml.push_str(&format!(
        "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: db-1, namespace: shop, labels: {{kubernetes.io/service-name: db}}}}\naddressType: IPv4\nports: [{{name: tcp-mongo, port: 27017}}]\nendpoints:\n{endpoints}"
    ));
    yaml
}

/// The pod addresses the port's listener matches, each to the service's cluster.
fn matched(listeners: &[Listener]) -> Vec<String> {
    let Some(listener) = listeners.iter().find(|l| l.name == "0.0.0.0_27017") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for chain in &listener.filter_chains {
        assert_eq!(chain.name, CLUSTER, "{chain:?}");
        let ranges = &chain.filter_chain_match.as_ref().unwrap().prefix_ranges;
        out.extend(ranges.iter().map(|r| {
            assert_eq!(r.prefix_len.as_ref().unwrap().value, 32);
            r.address_prefix.clone()
        }));
    }
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_headless_tcp_port_matches_each_pod_and_follows_them() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = dir.path().join("clusters/c1");
    std::fs::create_dir_all(&cluster).unwrap();
    std::fs::write(cluster.join("db.yaml"), SERVICE).unwrap();
    let write_pods = |ips: &[(&str, bool)]| {
        std::fs::write(cluster.join("pods.yaml"), pods(ips)).unwrap();
    };
    write_pods(&[("10.30.0.10", true), ("10.30.0.11", true)]);
    let mp = start_meshpilot(dir.path(), &[]).await;
    let proxy = || node(PROXY, &[("NAMESPACE", "shop"), ("CLUSTER_ID", "c1")]);

    // The proxy's own address is not matched: its traffic to itself never leaves it.
    let listeners: Vec<Listener> = fetch(mp.xds_addr, proxy(), LDS, &[]).await;
    assert_eq!(matched(&listeners), ["10.30.0.11"]);
    let clusters: Vec<Cluster> = fetch(mp.xds_addr, proxy(), CDS, &[CLUSTER]).await;
    let tls = clusters[0]
        .transport_socket
        .as_ref()
        .expect("mTLS: every pod has a sidecar");
    assert_eq!(tls.name, "envoy.transport_sockets.tls");
    assert!(clusters[0].transport_socket_matches.is_empty());

    // A pod joins: the connected proxy is pushed its listener again.
    let mut ads = AdsClient::connect(mp.xds_addr).await.unwrap();
    ads.request(DiscoveryRequest {
        node: Some(proxy()),
        type_url: LDS.into(),
        ..Default::default()
    });
    let first = ads.response(BOUND).await;
    ads.ack(&first, Vec::new());
    write_pods(&[
        ("10.30.0.10", true),
        ("10.30.0.11", true),
        ("10.30.0.12", true),
    ]);
    let deadline = tokio::time::Instant::now() + BOUND * 3;
    let pushed = loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the new pod's chain was not pushed"
        );
        let response = ads.response(BOUND).await;
        ads.ack(&response, Vec::new());
        let listeners: Vec<Listener> = response
            .resources
            .iter()
            .map(|a| prost::Message::decode(&a.value[..]).unwrap())
            .collect();
        let matched = matched(&listeners);
        if matched.len() == 2 {
            break matched;
        }
    };
    assert_eq!(pushed, ["10.30.0.11", "10.30.0.12"]);

    // A pod without a sidecar: plaintext to all, as istiod cannot tell them apart.
    write_pods(&[
        ("10.30.0.10", true),
        ("10.30.0.11", true),
        ("10.30.0.12", false),
    ]);
    wait_for("mTLS off", BOUND * 3, || async {
        let clusters: Vec<Cluster> = fetch(mp.xds_addr, proxy(), CDS, &[CLUSTER]).await;
        clusters[0].transport_socket.is_none().then_some(())
    })
    .await;
}
