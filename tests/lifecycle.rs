//! End to end: the process's life — a critical task that dies takes the process down (non-zero),
//! and SIGTERM drains: proxies move to another replica and the process exits 0 within its drain.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;

const BOUND: Duration = Duration::from_secs(20);
const REVIEWS: &str = "outbound|9080||reviews.bookinfo.svc.cluster.local";

/// `meshpilot discovery` on a config dir, plaintext xDS on `xds`.
fn discovery(
    config_dir: &Path,
    xds: SocketAddr,
    extra: &[&str],
    env: &[(&str, &str)],
) -> MeshpilotProcess {
    let state = config_dir.join(format!(".ca-{}", xds.port()));
    let xds = xds.to_string();
    let mut flags = vec![
        "--config-dir",
        config_dir.to_str().expect("utf-8 path"),
        "--ca-state-dir",
        state.to_str().expect("utf-8 path"),
        "--xds-addr",
        &xds,
        "--debounce-after",
        "10ms",
    ];
    flags.extend_from_slice(extra);
    MeshpilotProcess::discovery(&flags, env)
}

async fn ready(process: &MeshpilotProcess) -> SocketAddr {
    let admin = process.bound_addr("admin").await;
    wait_for("ready", BOUND, || async move {
        let (status, _) = http_get(admin, "/ready").await.ok()?;
        (status == 200).then_some(())
    })
    .await;
    admin
}

#[tokio::test]
async fn a_critical_task_that_dies_takes_the_process_down() {
    let dir = copy_tree(Path::new(EXAMPLE));
    // The push loop panics at its first push: the one loading the clusters makes.
    let mut process = discovery(
        dir.path(),
        free_port(),
        &[],
        &[("FAILPOINTS", "push-loop=panic(injected fault)")],
    );
    let status = process.exited(BOUND).await;
    assert!(!status.success(), "{status}");
    let log = process.log();
    assert!(
        log.contains("critical task push loop ended: panicked: injected fault"),
        "{log}"
    );
}

#[tokio::test]
async fn sigterm_moves_proxies_to_another_replica_and_exits_within_the_drain() {
    let _ports = sidecar_ports().await;
    let dir = copy_tree(Path::new(EXAMPLE));
    let (first_xds, second_xds) = (free_port(), free_port());
    let drain = Duration::from_secs(2);
    let mut first = discovery(dir.path(), first_xds, &["--drain-duration", "2s"], &[]);
    let first_admin = ready(&first).await;
    // Envoys know both replicas; only the first runs yet, so they all connect to it.
    let mut envoys = Vec::new();
    for i in 1..=3 {
        let node = format!("sidecar~10.1.9.{i}~client-{i}.bookinfo~bookinfo.svc.cluster.local");
        envoys.push(
            Envoy::start_with(EnvoyOptions {
                xds: first_xds,
                replicas: &[second_xds],
                node_id: &node,
                metadata: &[("CLUSTER_ID", "cluster1")],
                labels: &[],
                mode: AdsMode::Sotw,
                workload: WorkloadCerts::placeholder(),
                xds_tls: None,
                netns: None,
            })
            .await,
        );
    }
    let connected = |admin: SocketAddr| async move {
        let syncz = get_json(admin, "/debug/syncz").await;
        syncz.as_array().map_or(0, Vec::len)
    };
    wait_for("every Envoy on the first replica", BOUND, || async move {
        (connected(first_admin).await == 3).then_some(())
    })
    .await;
    let second = discovery(dir.path(), second_xds, &[], &[]);
    let second_admin = ready(&second).await;

    let terminated = Instant::now();
    first.terminate();
    // The signal is handled asynchronously: readiness goes once it is.
    wait_for("not ready once draining", BOUND, || async move {
        let (status, _) = http_get(first_admin, "/ready").await.ok()?;
        (status == 503).then_some(())
    })
    .await;
    let status = first.exited(drain + Duration::from_secs(10)).await;
    let took = terminated.elapsed();
    assert!(status.success(), "{status}: {}", first.log());
    eprintln!("first replica exited after {took:?}");
    wait_for("every Envoy on the second replica", BOUND, || async move {
        (connected(second_admin).await == 3).then_some(())
    })
    .await;

    // The second replica serves them: an edit reaches every Envoy through it.
    let file = dir.path().join("clusters/cluster2/reviews.yaml");
    let text = std::fs::read_to_string(&file).unwrap();
    write_atomic(&file, &text.replace("10.2.3.13", "10.2.3.99"));
    for envoy in &envoys {
        wait_for("the edit in Envoy", BOUND, || async {
            let held = envoy.endpoints(REVIEWS).await;
            held.contains(&"10.2.3.99:9080".to_string()).then_some(())
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_server_frees_what_it_held() {
    let dir = copy_tree(Path::new(EXAMPLE));
    let mp = start_meshpilot(dir.path(), &[]).await;
    // A proxy came and went: its stream held the server too.
    let mut ads = AdsClient::connect(mp.xds_addr).await.unwrap();
    ads.request(
        envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest {
            node: Some(node(
                "sidecar~10.1.9.9~client.bookinfo~bookinfo.svc.cluster.local",
                &[],
            )),
            type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".into(),
            ..Default::default()
        },
    );
    ads.response(BOUND).await;
    drop(ads);
    let (xds, aggregate) = (
        std::sync::Arc::downgrade(&mp.xds),
        std::sync::Arc::downgrade(&mp.aggregate),
    );
    drop(mp);
    wait_for("the server and the model freed", BOUND, || {
        let freed = xds.upgrade().is_none() && aggregate.upgrade().is_none();
        async move { freed.then_some(()) }
    })
    .await;
}
