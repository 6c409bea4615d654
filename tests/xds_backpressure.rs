//! A proxy that stops reading must cost meshpilot little and hold up no one: its responses wait in
//! a bounded queue while pushes merge into one pending request, and waiting for it to read holds
//! none of the permits that bound how many pushes are built at once.

mod common;

use std::time::Duration;

use common::*;
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;

const SERVICES: usize = 1000;
const ROUNDS: usize = 30;
const BOUND: Duration = Duration::from_secs(20);
const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const LDS: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";

fn service(i: usize) -> String {
    let (a, b) = (i / 250, i % 250);
    format!(
        "
apiVersion: v1
kind: Service
metadata: {{name: svc-{i}, namespace: load}}
spec: {{clusterIP: 10.96.{a}.{b}, ports: [{{name: http, port: 8080}}, {{name: tcp-db, port: 5432}}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: svc-{i}-abc, namespace: load, labels: {{kubernetes.io/service-name: svc-{i}}}}}
addressType: IPv4
ports: [{{name: http, port: 8080}}, {{name: tcp-db, port: 5432}}]
endpoints:
- addresses: [10.10.{a}.{b}]
  conditions: {{ready: true}}
"
    )
}

/// Resident memory of a process, in bytes.
fn sidecar(pod: &str) -> envoy_types::pb::envoy::config::core::v3::Node {
    node(
        &format!("sidecar~10.20.0.1~{pod}.load~load.svc.cluster.local"),
        &[],
    )
}

#[tokio::test]
async fn a_proxy_that_stops_reading_costs_little_and_holds_up_no_one() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = dir.path().join("clusters/c1");
    std::fs::create_dir_all(&cluster).unwrap();
    let all: Vec<String> = (0..SERVICES).map(service).collect();
    std::fs::write(cluster.join("services.yaml"), all.join("---")).unwrap();
    let state = tempfile::tempdir().unwrap();
    // Freed pages go back at once (jemalloc otherwise keeps them for seconds), so RSS follows
    // what is live rather than what the allocator keeps around.
    let mp = MeshpilotProcess::spawn_with_env(
        &[
            "discovery",
            "--config-dir",
            dir.path().to_str().unwrap(),
            "--http-addr",
            "127.0.0.1:0",
            "--xds-addr",
            "127.0.0.1:0",
            "--secure-xds-addr",
            "127.0.0.1:0",
            "--ca-state-dir",
            state.path().to_str().unwrap(),
            "--debounce-after",
            "0s",
            "--xds-send-timeout",
            "300s",
        ],
        &[("_RJEM_MALLOC_CONF", "dirty_decay_ms:0,muzzy_decay_ms:0")],
    );
    let xds = mp.bound_addr("xds").await;
    let admin = mp.bound_addr("admin").await;

    // The stuck proxy asks for every cluster and listener, then never reads again.
    let stuck = AdsClient::connect(xds).await.unwrap();
    stuck.request(DiscoveryRequest {
        node: Some(sidecar("stuck")),
        type_url: CDS.into(),
        ..Default::default()
    });
    stuck.request(DiscoveryRequest {
        type_url: LDS.into(),
        ..Default::default()
    });

    let mut good = AdsClient::connect(xds).await.unwrap();
    good.request(DiscoveryRequest {
        node: Some(sidecar("good")),
        type_url: CDS.into(),
        ..Default::default()
    });
    let first = good.response(BOUND).await;
    assert!(first.resources.len() >= 2 * SERVICES);
    let cds_bytes = prost::Message::encoded_len(&first);
    good.request(DiscoveryRequest {
        type_url: CDS.into(),
        version_info: first.version_info.clone(),
        response_nonce: first.nonce.clone(),
        ..Default::default()
    });
    let before = rss(mp.pid());

    for round in 0..ROUNDS {
        let name = format!("added-{round}.yaml");
        std::fs::write(cluster.join(name), service(SERVICES + round)).unwrap();
        // The reading proxy converges on every change although the stuck one holds its queue.
        let want = format!(
            "outbound|8080||svc-{}.load.svc.cluster.local",
            SERVICES + round
        );
        let response = loop {
            let r = good.response(BOUND).await;
            good.request(DiscoveryRequest {
                type_url: CDS.into(),
                version_info: r.version_info.clone(),
                response_nonce: r.nonce.clone(),
                ..Default::default()
            });
            if r.resources.iter().any(|a| cluster_name(&a.value) == want) {
                break r;
            }
        };
        assert_eq!(response.type_url, CDS);
    }
    let grown = rss(mp.pid()).saturating_sub(before) as usize;
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    eprintln!(
        "{ROUNDS} full pushes of {SERVICES} services ({:.1} MiB of CDS each) with a stuck proxy: RSS +{:.1} MiB",
        mib(cds_bytes),
        mib(grown as usize)
    );
    // Unbounded, every push would queue a full CDS and LDS for the stuck proxy: 30 of each.
    assert!(
        grown < 12 << 20,
        "RSS grew by {:.1} MiB while a proxy did not read",
        mib(grown as usize)
    );
    let syncz = get_json(admin, "/debug/syncz").await;
    assert_eq!(
        syncz.as_array().map(Vec::len),
        Some(2),
        "both proxies still connected: {syncz}"
    );
    drop(stuck);
}

/// More streams that stop reading than there are push permits: every other proxy still converges
/// on every change (a stream waiting for room in its queue holds no permit).
#[tokio::test]
async fn streams_that_stop_reading_hold_up_no_push() {
    const PERMITS: usize = 2;
    let dir = tempfile::tempdir().unwrap();
    let cluster = dir.path().join("clusters/c1");
    std::fs::create_dir_all(&cluster).unwrap();
    let all: Vec<String> = (0..SERVICES).map(service).collect();
    std::fs::write(cluster.join("services.yaml"), all.join("---")).unwrap();
    let permits = PERMITS.to_string();
    let mp = start_meshpilot(
        dir.path(),
        &[
            "--push-concurrency",
            &permits,
            "--xds-send-timeout",
            "300s",
            "--debounce-after",
            "0s",
        ],
    )
    .await;

    // Each on its own connection, so each has its own flow-control window to exhaust.
    let mut stuck = Vec::new();
    for i in 0..2 * PERMITS {
        let ads = AdsClient::connect(mp.xds_addr).await.unwrap();
        for (n, type_url) in [CDS, LDS].into_iter().enumerate() {
            ads.request(DiscoveryRequest {
                node: (n == 0).then(|| sidecar(&format!("stuck-{i}"))),
                type_url: type_url.into(),
                ..Default::default()
            });
        }
        stuck.push(ads);
    }
    let mut good = AdsClient::connect(mp.xds_addr).await.unwrap();
    good.request(DiscoveryRequest {
        node: Some(sidecar("good")),
        type_url: CDS.into(),
        ..Default::default()
    });
    let mut last = good.response(BOUND).await;
    for round in 0..3 {
        std::fs::write(
            cluster.join(format!("added-{round}.yaml")),
            service(SERVICES + round),
        )
        .unwrap();
        let want = format!(
            "outbound|8080||svc-{}.load.svc.cluster.local",
            SERVICES + round
        );
        loop {
            good.ack(&last, vec![]);
            last = good.response(BOUND).await;
            if last
                .resources
                .iter()
                .any(|a| cluster_name(&a.value) == want)
            {
                break;
            }
        }
    }
    drop(stuck);
}

fn cluster_name(any: &[u8]) -> String {
    use prost::Message;
    envoy_types::pb::envoy::config::cluster::v3::Cluster::decode(any)
        .expect("a Cluster")
        .name
}
