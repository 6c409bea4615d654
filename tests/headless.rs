//! A headless Kubernetes Service with a TCP port, as istiod serves it to a sidecar
//! (pilot/pkg/networking/core/listener.go, cluster_tls.go): the port's outbound listener matches
//! each pod's address (not the proxy's own) to the service's ORIGINAL_DST cluster, which
//! originates mTLS when every endpoint has a sidecar; a pod joining is pushed to the proxies'
//! listeners, and one without a sidecar turns mTLS off. Each proxy gets its own matches: a pod
//! of the service is never sent a listener built for another pod, nor a client one built for a
//! pod, on one network or across two; and the cluster's mTLS follows the pods' sidecars in a
//! wildcard CDS answer too.

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
    pods_named(ips, |i| format!("db-{i}"))
}

/// As [`pods`], with the pods named by `name`.
fn pods_named(ips: &[(&str, bool)], name: impl Fn(usize) -> String) -> String {
    let mut yaml = String::new();
    let mut endpoints = String::new();
    for (i, (ip, sidecar)) in ips.iter().enumerate() {
        let tls = match sidecar {
            true => ", security.istio.io/tlsMode: istio",
            false => "",
        };
        yaml.push_str(&format!(
            "---\napiVersion: v1\nkind: Pod\nmetadata: {{name: {pod}, namespace: shop, labels: {{app: db{tls}}}}}\nspec: {{serviceAccountName: db}}\nstatus: {{podIP: {ip}}}\n",
            pod = name(i)
        ));
        endpoints.push_str(&format!(
            "- {{addresses: [{ip}], conditions: {{ready: true}}, targetRef: {{kind: Pod, name: {pod}, namespace: shop}}}}\n",
            pod = name(i)
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

/// The addresses each of these proxies' (cluster, network, node id) port listeners match, asked
/// for over wildcard LDS in this order (so that each finds what the ones before it built).
async fn matched_by(
    mp: &meshpilot::app::Running,
    proxies: &[(&str, &str, &str)],
) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for (cluster, network, id) in proxies {
        let meta = [
            ("NAMESPACE", "shop"),
            ("CLUSTER_ID", *cluster),
            ("NETWORK", *network),
        ];
        let listeners: Vec<Listener> = fetch(mp.xds_addr, node(id, &meta), LDS, &[]).await;
        out.push(matched(&listeners));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_pod_and_client_gets_its_own_matches() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = dir.path().join("clusters/c1");
    std::fs::create_dir_all(&cluster).unwrap();
    std::fs::write(cluster.join("db.yaml"), SERVICE).unwrap();
    let three = [
        ("10.30.0.10", true),
        ("10.30.0.11", true),
        ("10.30.0.12", true),
    ];
    std::fs::write(cluster.join("pods.yaml"), pods(&three)).unwrap();
    let mp = start_meshpilot(dir.path(), &[]).await;

    let pod = |i: u8| format!("sidecar~10.30.0.1{i}~db-{i}.shop~shop.svc.cluster.local");
    let client = "sidecar~10.30.0.50~web-1.shop~shop.svc.cluster.local";
    let (db0, db1, db2) = (pod(0), pod(1), pod(2));
    let proxies = [
        ("c1", "", db0.as_str()),
        ("c1", "", db1.as_str()),
        ("c1", "", client),
        ("c1", "", db2.as_str()),
    ];
    let got = matched_by(&mp, &proxies).await;
    assert_eq!(
        got,
        [
            vec!["10.30.0.11", "10.30.0.12"],
            vec!["10.30.0.10", "10.30.0.12"],
            vec!["10.30.0.10", "10.30.0.11", "10.30.0.12"],
            vec!["10.30.0.10", "10.30.0.11"],
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_pod_and_client_gets_its_own_network_s_pods() {
    let dir = tempfile::tempdir().unwrap();
    let cluster_network = |network: &str| {
        format!("apiVersion: v1\nkind: Namespace\nmetadata: {{name: istio-system, labels: {{topology.istio.io/network: {network}}}}}\n")
    };
    for (name, network, ips, prefix) in [
        (
            "c1",
            "n1",
            [("10.30.0.10", true), ("10.30.0.11", true)],
            "db",
        ),
        (
            "c2",
            "n2",
            [("10.31.0.10", true), ("10.31.0.11", true)],
            "db-east",
        ),
    ] {
        let cluster = dir.path().join("clusters").join(name);
        std::fs::create_dir_all(&cluster).unwrap();
        std::fs::write(cluster.join("ns.yaml"), cluster_network(network)).unwrap();
        std::fs::write(cluster.join("db.yaml"), SERVICE).unwrap();
        let named = pods_named(&ips, |i| format!("{prefix}-{i}"));
        std::fs::write(cluster.join("pods.yaml"), named).unwrap();
    }
    let mp = start_meshpilot(dir.path(), &[]).await;

    let proxies = [
        (
            "c1",
            "n1",
            "sidecar~10.30.0.10~db-0.shop~shop.svc.cluster.local",
        ),
        (
            "c2",
            "n2",
            "sidecar~10.31.0.11~db-east-1.shop~shop.svc.cluster.local",
        ),
        (
            "c1",
            "n1",
            "sidecar~10.30.0.50~web-1.shop~shop.svc.cluster.local",
        ),
        (
            "c2",
            "n2",
            "sidecar~10.31.0.50~web-2.shop~shop.svc.cluster.local",
        ),
        (
            "c1",
            "n1",
            "sidecar~10.30.0.11~db-1.shop~shop.svc.cluster.local",
        ),
    ];
    let got = matched_by(&mp, &proxies).await;
    assert_eq!(
        got,
        [
            vec!["10.30.0.11"],
            vec!["10.31.0.10"],
            vec!["10.30.0.10", "10.30.0.11"],
            vec!["10.31.0.10", "10.31.0.11"],
            vec!["10.30.0.10"],
        ]
    );
}

/// The ORIGINAL_DST cluster among the others of a wildcard CDS answer.
fn db_cluster(clusters: &[Cluster]) -> &Cluster {
    clusters
        .iter()
        .find(|c| c.name == CLUSTER)
        .expect("the headless service's cluster")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wildcard_cluster_list_follows_the_pods_sidecars() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = dir.path().join("clusters/c1");
    std::fs::create_dir_all(&cluster).unwrap();
    std::fs::write(cluster.join("db.yaml"), SERVICE).unwrap();
    let write_pods = |ips: &[(&str, bool)]| {
        std::fs::write(cluster.join("pods.yaml"), pods(ips)).unwrap();
    };
    write_pods(&[("10.30.0.10", false), ("10.30.0.11", false)]);
    let mp = start_meshpilot(dir.path(), &[]).await;
    let client = || {
        node(
            "sidecar~10.30.0.50~web-1.shop~shop.svc.cluster.local",
            &[("NAMESPACE", "shop"), ("CLUSTER_ID", "c1")],
        )
    };

    let clusters: Vec<Cluster> = fetch(mp.xds_addr, client(), CDS, &[]).await;
    assert!(
        db_cluster(&clusters).transport_socket.is_none(),
        "no sidecars: plaintext"
    );

    // A connected proxy is pushed the change as the pods roll their sidecars in (the same pods,
    // the same identities), and a new one asking for every cluster gets it too.
    let mut ads = AdsClient::connect(mp.xds_addr).await.unwrap();
    ads.request(DiscoveryRequest {
        node: Some(client()),
        type_url: CDS.into(),
        ..Default::default()
    });
    let first = ads.response(BOUND).await;
    ads.ack(&first, Vec::new());
    write_pods(&[("10.30.0.10", true), ("10.30.0.11", true)]);
    let deadline = tokio::time::Instant::now() + BOUND * 3;
    loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "mTLS was not pushed"
        );
        let response = ads.response(BOUND).await;
        ads.ack(&response, Vec::new());
        let clusters: Vec<Cluster> = response
            .resources
            .iter()
            .map(|a| prost::Message::decode(&a.value[..]).unwrap())
            .collect();
        if db_cluster(&clusters).transport_socket.is_some() {
            break;
        }
    }
    let clusters: Vec<Cluster> = fetch(mp.xds_addr, client(), CDS, &[]).await;
    assert!(
        db_cluster(&clusters).transport_socket.is_some(),
        "every pod has a sidecar: mTLS"
    );

    // And back when one loses it.
    write_pods(&[("10.30.0.10", true), ("10.30.0.11", false)]);
    wait_for("mTLS off in the wildcard list", BOUND * 3, || async {
        let clusters: Vec<Cluster> = fetch(mp.xds_addr, client(), CDS, &[]).await;
        db_cluster(&clusters)
            .transport_socket
            .is_none()
            .then_some(())
    })
    .await;
}
