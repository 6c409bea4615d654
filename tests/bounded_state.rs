//! End to end: nothing a client sends — resource names, subscriptions, node metadata — grows the
//! server's memory past a fixed budget, and real proxies are served meanwhile.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use common::*;
use envoy_types::pb::envoy::config::core::v3::{Locality, Node};
use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DiscoveryRequest};

const BOUND: Duration = Duration::from_secs(30);
const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
const RDS: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
const REVIEWS: &str = "outbound|9080||reviews.bookinfo.svc.cluster.local";
const CACHE_ENTRIES: usize = 2048;
const MIB: f64 = 1048576.0;

/// A sidecar's node with self-declared traits that each vary the resources built for it.
fn variant_node(i: usize) -> Node {
    let mut node = node(
        &format!(
            "sidecar~10.1.{}.{}~v{i}.bookinfo~bookinfo.svc.cluster.local",
            i / 250,
            i % 250
        ),
        &[
            ("CLUSTER_ID", &format!("cluster-{i}")),
            ("NETWORK", &format!("network-{i}")),
            ("REQUESTED_NETWORK_VIEW", &format!("network-{i}")),
        ],
    );
    node.locality = Some(Locality {
        region: format!("region-{i}"),
        zone: format!("zone-{i}"),
        sub_zone: String::new(),
    });
    node
}

async fn metric(admin: SocketAddr, name: &str) -> f64 {
    let (_, text) = http_get(admin, "/metrics").await.unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("{name} on /metrics"))
}

/// Resident memory once it has stopped falling (jemalloc returns freed pages at once here).
async fn settled_rss(pid: u32) -> u64 {
    let mut last = rss(pid);
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = rss(pid);
        if now >= last {
            return now;
        }
        last = now;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bogus_names_and_metadata_variants_leave_memory_bounded() {
    let _ports = sidecar_ports().await;
    let dir = copy_tree(Path::new(EXAMPLE));
    let xds = free_port();
    let (xds_flag, entries) = (xds.to_string(), CACHE_ENTRIES.to_string());
    let ca = dir.path().join(".ca");
    let process = MeshpilotProcess::discovery(
        &[
            "--config-dir",
            dir.path().to_str().unwrap(),
            "--ca-state-dir",
            ca.to_str().unwrap(),
            "--xds-addr",
            &xds_flag,
            "--xds-cache-max-entries",
            &entries,
        ],
        &[("_RJEM_MALLOC_CONF", "dirty_decay_ms:0,muzzy_decay_ms:0")],
    );
    let admin = process.bound_addr("admin").await;
    let envoy = Envoy::start_with(EnvoyOptions {
        xds,
        replicas: &[],
        node_id: "sidecar~10.1.9.9~client.bookinfo~bookinfo.svc.cluster.local",
        metadata: &[("CLUSTER_ID", "cluster1")],
        labels: &[],
        mode: AdsMode::Delta,
        workload: WorkloadCerts::placeholder(),
        xds_tls: None,
        netns: None,
    })
    .await;
    wait_for("reviews in the real Envoy", BOUND, || async {
        (!envoy.endpoints(REVIEWS).await.is_empty()).then_some(())
    })
    .await;
    let pid = process.pid();
    let before = settled_rss(pid).await;

    // 100,000 distinct bogus names from four Delta clients, which keep their streams open.
    let mut holders = Vec::new();
    for client in 0..4 {
        let mut delta = DeltaClient::connect(xds).await.unwrap();
        for batch in 0..5 {
            let names: Vec<String> = (0..5_000)
                .map(|i| {
                    format!(
                        "outbound|{}||bogus-{client}-{batch}-{i}.example.com",
                        1 + i % 9
                    )
                })
                .collect();
            delta.request(DeltaDiscoveryRequest {
                node: Some(node(
                    "sidecar~10.1.8.8~bogus.bookinfo~bookinfo.svc.cluster.local",
                    &[],
                )),
                type_url: EDS.into(),
                resource_names_subscribe: names,
                ..Default::default()
            });
            delta.response(BOUND).await;
        }
        holders.push(delta);
    }
    // A stream naming more than its budget is refused, and forgotten.
    let mut greedy = DeltaClient::connect(xds).await.unwrap();
    let long = "x".repeat(180);
    let mut batch = 0;
    let refused = loop {
        batch += 1;
        let names: Vec<String> = (0..15_000).map(|i| format!("{long}-{batch}-{i}")).collect();
        greedy.request(DeltaDiscoveryRequest {
            node: Some(node(
                "sidecar~10.1.6.6~greedy.bookinfo~bookinfo.svc.cluster.local",
                &[],
            )),
            type_url: EDS.into(),
            resource_names_subscribe: names,
            ..Default::default()
        });
        match greedy.next(BOUND).await {
            Some(Ok(_)) => assert!(batch < 10, "never refused"),
            Some(Err(status)) => break status,
            None => panic!("no answer"),
        }
    };
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    assert!(
        refused.message().contains("at most 16777216"),
        "{refused:?}"
    );
    // Short names cost more to hold than their bytes: 120,000 announced 6-byte names (one
    // request, under gRPC's 4 MiB) hold some 19 MiB, and are refused.
    let mut announcer = DeltaClient::connect(xds).await.unwrap();
    announcer.request(DeltaDiscoveryRequest {
        node: Some(node(
            "sidecar~10.1.5.5~short.bookinfo~bookinfo.svc.cluster.local",
            &[],
        )),
        type_url: CDS.into(),
        initial_resource_versions: (0..120_000)
            .map(|i| (format!("{i:06}"), format!("{i:016x}")))
            .collect(),
        ..Default::default()
    });
    let refused = announcer.error(BOUND).await;
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    // Ports padded with zeros: no further name for a route or a listener that exists.
    let mut sotw = AdsClient::connect(xds).await.unwrap();
    let padded: Vec<String> = (1..=1_000)
        .map(|z| format!("{}9080", "0".repeat(z % 40)))
        .collect();
    sotw.request(DiscoveryRequest {
        node: Some(node(
            "sidecar~10.1.7.7~padded.bookinfo~bookinfo.svc.cluster.local",
            &[],
        )),
        type_url: RDS.into(),
        resource_names: padded,
        ..Default::default()
    });
    sotw.response(BOUND).await;
    let with_names = settled_rss(pid).await;

    // 1,000 proxies, each declaring its own cluster, network and locality.
    for i in 0..1_000 {
        let mut ads = AdsClient::connect(xds).await.unwrap();
        for (ty, names) in [
            (CDS, vec![]),
            (EDS, vec![REVIEWS.to_string()]),
            (RDS, vec!["9080".to_string()]),
        ] {
            ads.request(DiscoveryRequest {
                node: Some(variant_node(i)),
                type_url: ty.into(),
                resource_names: names,
                ..Default::default()
            });
            ads.response(BOUND).await;
        }
    }
    let cached = metric(admin, "meshpilot_xds_cache_entries").await;
    let with_variants = settled_rss(pid).await;

    // Real proxies are served meanwhile: an edit reaches the Envoy.
    let file = dir.path().join("clusters/cluster2/reviews.yaml");
    let text = std::fs::read_to_string(&file).unwrap();
    write_atomic(&file, &text.replace("10.2.3.13", "10.2.3.99"));
    wait_for("the edit in the real Envoy", BOUND, || async {
        let held = envoy.endpoints(REVIEWS).await;
        held.contains(&"10.2.3.99:9080".to_string()).then_some(())
    })
    .await;
    drop(holders);
    drop(sotw);
    let after = settled_rss(pid).await;

    let growth = |rss: u64| (rss as f64 - before as f64) / MIB;
    eprintln!(
        "RSS {:.1} MiB; +{:.1} MiB holding 100,000 bogus names; +{:.1} MiB after 1,000 variants \
         ({cached} cache entries); +{:.1} MiB once the name holders left",
        before as f64 / MIB,
        growth(with_names),
        growth(with_variants),
        growth(after)
    );
    // Entries and lists each at most the capacity (rounded to shards).
    assert!(
        cached <= (2 * CACHE_ENTRIES) as f64,
        "{cached} cache entries"
    );
    assert!(
        growth(with_names) < 48.0,
        "bogus names cost {:.1} MiB",
        growth(with_names)
    );
    assert!(
        growth(with_variants) < 64.0,
        "variants cost {:.1} MiB",
        growth(with_variants)
    );
    assert!(
        growth(after) < 32.0,
        "{:.1} MiB kept after the clients left",
        growth(after)
    );
}
