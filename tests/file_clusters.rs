//! End to end: file-backed clusters served through the admin server, watched for changes.

mod common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use meshpilot::app::Running;
use notify::event::AccessKind;
use notify::{EventKind, RecursiveMode, Watcher};

const REVIEWS: &str = "reviews.bookinfo.svc.cluster.local";
const REVIEWS_CLUSTER: &str = "outbound|9080||reviews.bookinfo.svc.cluster.local";
const BOUND: Duration = Duration::from_secs(10);

async fn start(dir: &std::path::Path) -> Running {
    start_meshpilot(dir, &[]).await
}

async fn admin(running: &Running) -> SocketAddr {
    running.http_addr
}

#[tokio::test]
async fn example_is_sharded_by_cluster() {
    let dir = copy_tree(std::path::Path::new(EXAMPLE));
    let running = start(dir.path()).await;
    let admin = admin(&running).await;

    assert_eq!(
        shard_addresses(admin, REVIEWS, "cluster1").await,
        ["10.1.1.11", "10.1.2.12"]
    );
    assert_eq!(
        shard_addresses(admin, REVIEWS, "cluster2").await,
        ["10.2.3.13"]
    );

    let shards = get_json(admin, "/debug/endpointShardz").await;
    let c1 = shards[REVIEWS]["bookinfo"]["cluster1"].as_array().unwrap();
    let ready = c1.iter().find(|e| e["address"] == "10.1.1.11").unwrap();
    assert_eq!(ready["health"], "healthy");
    assert_eq!(ready["tls_mode"], "istio");
    assert_eq!(
        ready["service_account"],
        "spiffe://cluster.local/ns/bookinfo/sa/bookinfo-reviews"
    );
    assert_eq!(ready["locality"]["zone"], "us-east1-b");
    let starting = c1.iter().find(|e| e["address"] == "10.1.2.12").unwrap();
    assert_eq!(starting["health"], "unhealthy");
    assert_eq!(starting["locality"]["subzone"], "rack-7");

    let c1_view = cluster_view(admin, "cluster1").await.unwrap();
    assert_eq!(c1_view["state"], "synced");
    assert_eq!(c1_view["services"], 2);
    assert_eq!(c1_view["endpoints"], 3);
    assert!(c1_view["last_error"].is_null());

    let (status, metrics) = http_get(admin, "/metrics").await.unwrap();
    assert_eq!(status, 200);
    assert!(
        metrics.contains("meshpilot_cluster_endpoints{cluster=\"cluster2\"} 1"),
        "{metrics}"
    );
}

#[tokio::test]
async fn edited_file_is_applied_incrementally() {
    let dir = copy_tree(std::path::Path::new(EXAMPLE));
    let running = start(dir.path()).await;
    let admin = admin(&running).await;

    let file = dir.path().join("clusters/cluster2/reviews.yaml");
    let text = std::fs::read_to_string(&file).unwrap();
    let edited = text.replace("10.2.3.13", "10.2.3.99");
    let started = Instant::now();
    write_atomic(&file, &edited);
    wait_for("edited endpoint served", BOUND, || async move {
        (shard_addresses(admin, REVIEWS, "cluster2").await == ["10.2.3.99"]).then_some(())
    })
    .await;
    eprintln!("edit reflected after {:?}", started.elapsed());
    // The other cluster is untouched.
    assert_eq!(
        shard_addresses(admin, REVIEWS, "cluster1").await,
        ["10.1.1.11", "10.1.2.12"]
    );
}

#[tokio::test]
async fn clusters_come_and_go_with_their_directories() {
    let dir = copy_tree(std::path::Path::new(EXAMPLE));
    let running = start(dir.path()).await;
    let admin = admin(&running).await;

    std::fs::remove_dir_all(dir.path().join("clusters/cluster2")).unwrap();
    wait_for("cluster2 removed", BOUND, || async move {
        cluster_view(admin, "cluster2")
            .await
            .is_none()
            .then_some(())
    })
    .await;
    assert!(shard_addresses(admin, REVIEWS, "cluster2").await.is_empty());
    assert_eq!(shard_addresses(admin, REVIEWS, "cluster1").await.len(), 2);

    // A new directory is a new cluster.
    let cluster3 = dir.path().join("clusters/cluster3");
    std::fs::create_dir(&cluster3).unwrap();
    let reviews =
        std::fs::read_to_string(format!("{EXAMPLE}/clusters/cluster2/reviews.yaml")).unwrap();
    write_atomic(
        &cluster3.join("reviews.yaml"),
        &reviews.replace("10.2.3.13", "10.3.0.7"),
    );
    // cluster3 has no node for its pod, so no locality, but the endpoint is there and synced (the
    // state follows the endpoints' publication by a moment).
    wait_for("cluster3 endpoints, synced", BOUND, || async move {
        let served = shard_addresses(admin, REVIEWS, "cluster3").await == ["10.3.0.7"];
        let synced = cluster_view(admin, "cluster3").await?["state"] == "synced";
        (served && synced).then_some(())
    })
    .await;
}

#[tokio::test]
async fn malformed_file_keeps_the_last_good_state() {
    let dir = copy_tree(std::path::Path::new(EXAMPLE));
    let running = start(dir.path()).await;
    let admin = admin(&running).await;

    let file = dir.path().join("clusters/cluster2/reviews.yaml");
    let good = std::fs::read_to_string(&file).unwrap();
    write_atomic(
        &file,
        &good.replace("addresses: [10.2.3.13]", "addresses: [10.2.3.14\n  bad: {"),
    );
    let error = wait_for("error reported", BOUND, || async move {
        let view = cluster_view(admin, "cluster2").await?;
        view["last_error"].as_str().map(str::to_string)
    })
    .await;
    assert!(
        error.contains("reviews.yaml") && error.contains("line"),
        "{error}"
    );
    assert_eq!(
        shard_addresses(admin, REVIEWS, "cluster2").await,
        ["10.2.3.13"]
    );
    assert_eq!(
        cluster_view(admin, "cluster2").await.unwrap()["state"],
        "synced"
    );

    // A well-formed YAML object of the wrong shape is refused too, naming the object.
    write_atomic(&file, &good.replace("port: 9080", "port: ninety"));
    wait_for("type error reported", BOUND, || async move {
        let view = cluster_view(admin, "cluster2").await?;
        let err = view["last_error"].as_str()?.to_string();
        err.contains("Service reviews").then_some(())
    })
    .await;
    assert_eq!(
        shard_addresses(admin, REVIEWS, "cluster2").await,
        ["10.2.3.13"]
    );

    // Fixing the file clears the error and applies the fix.
    write_atomic(&file, &good.replace("10.2.3.13", "10.2.3.15"));
    wait_for("fixed file applied", BOUND, || async move {
        let view = cluster_view(admin, "cluster2").await?;
        let fixed = shard_addresses(admin, REVIEWS, "cluster2").await == ["10.2.3.15"];
        (view["last_error"].is_null() && fixed).then_some(())
    })
    .await;
}

#[tokio::test]
async fn binary_runs_the_example_and_logs_errors() {
    let dir = copy_tree(std::path::Path::new(EXAMPLE));
    let config_dir = dir.path().to_str().unwrap();
    let state = dir.path().join("ca-state");
    let process = MeshpilotProcess::spawn(&[
        "discovery",
        "--config-dir",
        config_dir,
        "--http-addr",
        "127.0.0.1:0",
        "--xds-addr",
        "127.0.0.1:0",
        "--secure-xds-addr",
        "127.0.0.1:0",
        "--ca-state-dir",
        state.to_str().unwrap(),
        "--state-dir",
        dir.path().join(".state").to_str().unwrap(),
    ]);
    let admin = process.bound_addr("admin").await;
    // Every server takes port 0 and says where it listens.
    assert_ne!(process.bound_addr("xds").await.port(), 0);
    assert_ne!(process.bound_addr("secure-xds").await.port(), 0);
    wait_for("ready", BOUND, || async move {
        let (status, _) = http_get(admin, "/ready").await.ok()?;
        (status == 200).then_some(())
    })
    .await;
    assert_eq!(
        shard_addresses(admin, REVIEWS, "cluster2").await,
        ["10.2.3.13"]
    );

    std::fs::write(
        dir.path().join("clusters/cluster1/broken.yaml"),
        "kind: [unclosed\n",
    )
    .unwrap();
    wait_for("error logged", BOUND, || {
        let log = process.log();
        async move { (log.contains("broken.yaml") && log.contains("ERROR")).then_some(()) }
    })
    .await;
    assert_eq!(
        shard_addresses(admin, REVIEWS, "cluster1").await.len(),
        2,
        "still serving"
    );
}

/// A Service with one endpoint, as a file cluster's manifest.
fn service_manifest(name: &str, ip: &str) -> String {
    format!(
        "apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: many}}
spec: {{clusterIP: 10.96.0.1, ports: [{{name: http, port: 80}}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: {name}-1, namespace: many, labels: {{kubernetes.io/service-name: {name}}}}}
addressType: IPv4
ports: [{{name: http, port: 80}}]
endpoints: [{{addresses: [{ip}], conditions: {{ready: true}}}}]
"
    )
}

#[tokio::test]
async fn files_among_many_are_applied_one_by_one() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = dir.path().join("clusters/big");
    std::fs::create_dir_all(&cluster).unwrap();
    for i in 0..300 {
        std::fs::write(
            cluster.join(format!("svc-{i}.yaml")),
            service_manifest(
                &format!("svc-{i}"),
                &format!("10.0.{}.{}", i / 250, i % 250 + 1),
            ),
        )
        .unwrap();
    }
    let running = start(dir.path()).await;
    let admin = admin(&running).await;
    let host = |name: &str| format!("{name}.many.svc.cluster.local");
    assert_eq!(
        shard_addresses(admin, &host("svc-299"), "big").await,
        ["10.0.1.50"]
    );

    // Renamed in, as editors and tooling write; meanwhile every file opened is recorded.
    let opened = Arc::new(Mutex::new(BTreeSet::new()));
    let sink = opened.clone();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        if let Ok(event) = event {
            if matches!(event.kind, EventKind::Access(AccessKind::Open(_))) {
                // The test's own write opens only the temporary file.
                let manifests = event
                    .paths
                    .into_iter()
                    .filter(|p| p.extension() == Some("yaml".as_ref()));
                sink.lock().unwrap().extend(manifests);
            }
        }
    })
    .unwrap();
    watcher
        .watch(&cluster, RecursiveMode::NonRecursive)
        .unwrap();
    write_atomic(
        &cluster.join("new.yaml"),
        &service_manifest("new", "10.9.0.1"),
    );
    let new_host = host("new");
    wait_for("renamed-in file served", BOUND, || {
        let new_host = new_host.clone();
        async move { (shard_addresses(admin, &new_host, "big").await == ["10.9.0.1"]).then_some(()) }
    })
    .await;
    // Only the file the events named was read: not the other 300, and not over and over (the
    // watcher once took its own reads for changes and rescanned forever).
    drop(watcher);
    let opened: Vec<_> = opened.lock().unwrap().iter().cloned().collect();
    assert_eq!(opened, [cluster.join("new.yaml")]);

    // The same objects in a second file: the first keeps serving and the copy is reported;
    // removing the first lets the copy serve.
    write_atomic(
        &cluster.join("svc-7b.yaml"),
        &service_manifest("svc-7", "10.9.0.7"),
    );
    let svc7 = host("svc-7");
    let served = |want: &'static str| {
        let svc7 = svc7.clone();
        async move { (shard_addresses(admin, &svc7, "big").await == [want]).then_some(()) }
    };
    wait_for("the copy reported", BOUND, || async move {
        let view = cluster_view(admin, "big").await?;
        view.to_string().contains("svc-7b.yaml").then_some(())
    })
    .await;
    wait_for("the first file still served", BOUND, || served("10.0.0.8")).await;
    std::fs::remove_file(cluster.join("svc-7.yaml")).unwrap();
    wait_for("the copy served once the first is gone", BOUND, || {
        served("10.9.0.7")
    })
    .await;

    // A deleted file takes its objects along; the rest stay.
    std::fs::remove_file(cluster.join("svc-3.yaml")).unwrap();
    let svc3 = host("svc-3");
    wait_for("deleted file's service gone", BOUND, || {
        let svc3 = svc3.clone();
        async move {
            shard_addresses(admin, &svc3, "big")
                .await
                .is_empty()
                .then_some(())
        }
    })
    .await;
    let view = cluster_view(admin, "big").await.unwrap();
    assert_eq!(view["services"], 300, "{view}");
    assert!(view["last_error"].is_null(), "{view}");
}

#[tokio::test]
async fn a_renamed_cluster_directory_keeps_pushing_its_changes() {
    let _ports = sidecar_ports().await;
    let dir = copy_tree(std::path::Path::new(EXAMPLE));
    let running = start(dir.path()).await;
    let envoy = Envoy::start(
        &running,
        "sidecar~10.1.9.9~client.bookinfo~bookinfo.svc.cluster.local",
        &[("CLUSTER_ID", "cluster1")],
        AdsMode::Delta,
    )
    .await;
    let holds = |expected: &'static [&'static str], what: &'static str| {
        let envoy = &envoy;
        async move {
            wait_for(what, BOUND, || async move {
                let held = envoy.endpoints(REVIEWS_CLUSTER).await;
                (held == expected).then_some(())
            })
            .await
        }
    };
    holds(&["10.1.1.11:9080", "10.2.3.13:9080"], "reviews in Envoy").await;

    let clusters = dir.path().join("clusters");
    let file = |cluster: &str| clusters.join(cluster).join("reviews.yaml");
    let text = std::fs::read_to_string(file("cluster2")).unwrap();
    std::fs::rename(clusters.join("cluster2"), clusters.join("cluster9")).unwrap();
    write_atomic(&file("cluster9"), &text.replace("10.2.3.13", "10.2.3.99"));
    holds(
        &["10.1.1.11:9080", "10.2.3.99:9080"],
        "an edit in the renamed directory",
    )
    .await;
    let admin = admin(&running).await;
    assert!(cluster_view(admin, "cluster2").await.is_none());

    std::fs::rename(clusters.join("cluster9"), clusters.join("cluster2")).unwrap();
    write_atomic(&file("cluster2"), &text.replace("10.2.3.13", "10.2.3.77"));
    holds(
        &["10.1.1.11:9080", "10.2.3.77:9080"],
        "an edit once renamed back",
    )
    .await;
    assert!(cluster_view(admin, "cluster9").await.is_none());
    assert_eq!(
        shard_addresses(admin, REVIEWS, "cluster2").await,
        ["10.2.3.77"]
    );
}

/// The bundled example has no `config/`: one created while meshpilot runs is read, and followed.
#[tokio::test]
async fn a_config_directory_created_after_start_is_read() {
    let dir = copy_tree(std::path::Path::new(EXAMPLE));
    assert!(!dir.path().join("config").exists());
    let running = start(dir.path()).await;
    let admin = admin(&running).await;
    let names = || async move {
        let configz = get_json(admin, "/debug/configz").await;
        let names: Vec<String> = configz
            .as_array()?
            .iter()
            .filter_map(|o| o["metadata"]["name"].as_str().map(str::to_string))
            .collect();
        Some(names)
    };
    let config = dir.path().join("config");
    std::fs::create_dir(&config).unwrap();
    write_atomic(
        &config.join("dr.yaml"),
        "apiVersion: networking.istio.io/v1\nkind: DestinationRule\nmetadata: {name: reviews, namespace: bookinfo}\nspec: {host: reviews.bookinfo.svc.cluster.local}\n",
    );
    wait_for("the new config read", BOUND, || async move {
        names()
            .await?
            .contains(&"reviews".to_string())
            .then_some(())
    })
    .await;
    // And followed: a second file.
    write_atomic(
        &config.join("more.yaml"),
        "apiVersion: networking.istio.io/v1\nkind: DestinationRule\nmetadata: {name: ratings, namespace: bookinfo}\nspec: {host: ratings.bookinfo.svc.cluster.local}\n",
    );
    wait_for("a later file read", BOUND, || async move {
        names()
            .await?
            .contains(&"ratings".to_string())
            .then_some(())
    })
    .await;
}

/// An operator removing a cluster directory reads that the cluster was removed, and no noise
/// about file watches the directory took with it.
#[tokio::test]
async fn removing_a_cluster_directory_logs_only_its_removal() {
    use tokio::io::{AsyncBufReadExt, BufReader};
    let dir = copy_tree(std::path::Path::new(EXAMPLE));
    let state = tempfile::tempdir().unwrap();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_meshpilot"))
        .args(["discovery", "--config-dir", dir.path().to_str().unwrap()])
        .args(["--state-dir", state.path().to_str().unwrap()])
        .args(["--http-addr", "127.0.0.1:0", "--xds-addr", "127.0.0.1:0"])
        .args(["--secure-xds-addr", "127.0.0.1:0"])
        .env("NO_COLOR", "1")
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("meshpilot runs");
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut log = Vec::new();
    let mut until = async |wanted: &str, log: &mut Vec<String>| {
        let found = tokio::time::timeout(BOUND, async {
            while let Ok(Some(line)) = lines.next_line().await {
                let done = line.contains(wanted);
                log.push(line);
                if done {
                    return true;
                }
            }
            false
        });
        assert!(
            found.await.unwrap_or(false),
            "no {wanted:?} in:\n{}",
            log.join("\n")
        );
    };
    until("listening server=\"admin\"", &mut log).await;
    std::fs::remove_dir_all(dir.path().join("clusters/cluster2")).unwrap();
    until("cluster removed cluster=cluster2", &mut log).await;
    // SIGTERM, then everything it logged until it stopped.
    unsafe { libc::kill(child.id().unwrap() as i32, libc::SIGTERM) };
    until("stopped", &mut log).await;
    let noise: Vec<&String> = log
        .iter()
        .filter(|l| l.contains("Invalid argument"))
        .collect();
    assert!(noise.is_empty(), "{noise:?}");
}
