//! End to end: a primary on a config cluster onboards remote clusters from `istio/multiCluster`
//! Secrets — three test API servers, real HTTPS list/watch, a real Envoy.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::*;
use test_apiserver::{kubeconfig_for, TestApiServer, User};

const WEB: &str = "web.shop.svc.cluster.local";
const WEB_CLUSTER: &str = "outbound|80||web.shop.svc.cluster.local";
const BOUND: Duration = Duration::from_secs(20);
const SECRET: &str = "istio-remote-secret-test";

/// A remote cluster serving `web` from one pod at `ip`.
async fn remote(ip: &str) -> TestApiServer {
    let api = TestApiServer::start().await;
    serve_web(&api, ip);
    api
}

/// `web` served from one pod at `ip`.
fn serve_web(api: &TestApiServer, ip: &str) {
    api.apply_yaml(&format!(
        "
apiVersion: v1
kind: Namespace
metadata: {{name: istio-system}}
---
apiVersion: v1
kind: Service
metadata: {{name: web, namespace: shop}}
spec: {{clusterIP: 10.96.0.80, ports: [{{name: http, port: 80}}]}}
---
apiVersion: v1
kind: Pod
metadata: {{name: web-1, namespace: shop, labels: {{app: web}}}}
spec: {{serviceAccountName: web, containers: []}}
status: {{podIP: {ip}}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: web-1, namespace: shop, labels: {{kubernetes.io/service-name: web}}}}
addressType: IPv4
ports: [{{name: http, port: 80}}]
endpoints:
- addresses: [{ip}]
  conditions: {{ready: true}}
  targetRef: {{kind: Pod, name: web-1, namespace: shop}}
"
    ));
}

/// A reader token for a remote cluster.
fn reader_token(api: &TestApiServer, token: &str) -> String {
    api.add_token(
        token,
        User::service_account("istio-system", "istio-reader-service-account"),
    );
    api.kubeconfig(token)
}

/// An `istio/multiCluster` Secret holding these (cluster id, kubeconfig) entries.
fn remote_secret(entries: &[(&str, &str)]) -> serde_json::Value {
    let data: serde_json::Map<String, serde_json::Value> = entries
        .iter()
        .map(|(id, kubeconfig)| {
            (
                id.to_string(),
                serde_json::Value::String(kubeconfig.to_string()),
            )
        })
        .collect();
    serde_json::json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": SECRET, "namespace": "istio-system", "labels": {"istio/multiCluster": "true"}},
        "stringData": data
    })
}

struct Primary {
    config: TestApiServer,
    _kubeconfig: tempfile::NamedTempFile,
    flags: Vec<String>,
}

impl Primary {
    async fn new() -> Self {
        let config = TestApiServer::start().await;
        config.apply_yaml("apiVersion: v1\nkind: Namespace\nmetadata: {name: istio-system}\n");
        let kubeconfig = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(kubeconfig.path(), config.kubeconfig(config.admin_token())).unwrap();
        let flags = vec![
            "--kubeconfig".to_string(),
            kubeconfig.path().display().to_string(),
            "--cluster-id".to_string(),
            "primary".to_string(),
            "--debounce-after".to_string(),
            "10ms".to_string(),
        ];
        Self {
            config,
            _kubeconfig: kubeconfig,
            flags,
        }
    }

    fn flags<'a>(&'a self, extra: &[&'a str]) -> Vec<&'a str> {
        let mut flags: Vec<&str> = self.flags.iter().map(String::as_str).collect();
        flags.extend_from_slice(extra);
        flags
    }
}

/// A client sidecar of the primary, once it holds `expected` as web's endpoints.
async fn client_envoy(mp: &meshpilot::app::Running, mode: AdsMode, expected: &[&str]) -> Envoy {
    let envoy = Envoy::start(
        mp,
        "sidecar~10.0.9.9~client.shop~shop.svc.cluster.local",
        &[("CLUSTER_ID", "primary")],
        mode,
    )
    .await;
    wait_for("web's endpoints in Envoy", BOUND, || {
        let envoy = &envoy;
        async move { (envoy.endpoints(WEB_CLUSTER).await == expected).then_some(()) }
    })
    .await;
    envoy
}

async fn served(admin: SocketAddr, cluster: &str) -> Vec<String> {
    shard_addresses(admin, WEB, cluster).await
}

#[tokio::test]
async fn secret_onboards_remotes_and_removing_a_key_removes_them() {
    let _ports = sidecar_ports().await;
    // West's API server offers only HTTP/1.1.
    let (east, west) = (
        remote("10.20.0.1").await,
        TestApiServer::start_http1_only().await,
    );
    serve_web(&west, "10.30.0.1");
    let primary = Primary::new().await;
    let mp = start_meshpilot_with(&primary.flags(&[])).await;
    let admin = mp.http_addr;

    let (east_cfg, west_cfg) = (
        reader_token(&east, "east-reader"),
        reader_token(&west, "west-reader"),
    );
    primary
        .config
        .apply(remote_secret(&[("east", &east_cfg), ("west", &west_cfg)]));
    wait_for("both remotes served", BOUND, || async move {
        let both = served(admin, "east").await == ["10.20.0.1"]
            && served(admin, "west").await == ["10.30.0.1"];
        both.then_some(())
    })
    .await;
    let view = cluster_view(admin, "east").await.unwrap();
    assert_eq!(view["source"], format!("secret istio-system/{SECRET}"));
    assert_eq!(view["state"], "synced");
    // A remote's watches and calls share one HTTP/2 connection, as client-go's do; over HTTP/1.1
    // they take a connection each.
    let east = &east;
    wait_for(
        "one connection to east's API server",
        BOUND,
        || async move { (east.connections() == ["h2"]).then_some(()) },
    )
    .await;
    let west_connections = west.connections();
    assert!(
        west_connections.len() > 1 && west_connections.iter().all(|p| p == "http/1.1"),
        "{west_connections:?}"
    );

    let envoy = client_envoy(&mp, AdsMode::Sotw, &["10.20.0.1:80", "10.30.0.1:80"]).await;

    primary.config.apply(remote_secret(&[("east", &east_cfg)]));
    wait_for("west gone from Envoy", BOUND, || {
        let envoy = &envoy;
        async move { (envoy.endpoints(WEB_CLUSTER).await == ["10.20.0.1:80"]).then_some(()) }
    })
    .await;
    assert!(cluster_view(admin, "west").await.is_none());
    assert_eq!(envoy.rejected_updates().await, 0);

    primary.config.delete("Secret", "istio-system", SECRET);
    wait_for(
        "east gone once the Secret is deleted",
        BOUND,
        || async move { served(admin, "east").await.is_empty().then_some(()) },
    )
    .await;
}

/// Polls Envoy's endpoints in a tight loop until stopped, counting any moment `expected` was missing.
fn eds_poller(envoy_admin: SocketAddr, expected: &'static str) -> Poller {
    let prefix = format!("{WEB_CLUSTER}::{expected}::health_flags::healthy");
    Poller::start(move || {
        let prefix = prefix.clone();
        async move {
            let (status, body) = http_get(envoy_admin, "/clusters")
                .await
                .expect("Envoy admin reachable");
            assert_eq!(status, 200, "Envoy /clusters: {body}");
            body.contains(&prefix)
        }
    })
}

#[tokio::test]
async fn rotated_kubeconfig_swaps_without_a_gap() {
    let _ports = sidecar_ports().await;
    let east = remote("10.20.0.1").await;
    let primary = Primary::new().await;
    let first = reader_token(&east, "east-v1");
    primary.config.apply(remote_secret(&[("east", &first)]));
    let mp = start_meshpilot_with(&primary.flags(&["--remote-cluster-timeout", "3s"])).await;
    let admin = mp.http_addr;
    let envoy = client_envoy(&mp, AdsMode::Delta, &["10.20.0.1:80"]).await;

    let poller = eds_poller(envoy.admin, "10.20.0.1:80");
    let started = Instant::now();
    let second = reader_token(&east, "east-v2");
    primary.config.apply(remote_secret(&[("east", &second)]));
    wait_for("rotation completed", BOUND, || async move {
        let (_, metrics) = http_get(admin, "/metrics").await.ok()?;
        metrics
            .contains("meshpilot_remote_cluster_rotations_total 1")
            .then_some(())
    })
    .await;
    eprintln!("rotation swapped after {:?}", started.elapsed());
    east.revoke_token("east-v1");

    // The new registry is live: a change on the remote arrives through it.
    east.apply_yaml(
        "
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-2, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 80}]
endpoints:
- addresses: [10.20.0.2]
  conditions: {ready: true}
",
    );
    wait_for("change after rotation in Envoy", BOUND, || {
        let envoy = &envoy;
        async move {
            (envoy.endpoints(WEB_CLUSTER).await == ["10.20.0.1:80", "10.20.0.2:80"]).then_some(())
        }
    })
    .await;
    let gaps = poller.stop(10).await;
    assert_eq!(
        gaps, 0,
        "east's endpoint was missing from Envoy's EDS during the rotation"
    );
    assert!(cluster_view(admin, "east").await.unwrap()["last_error"].is_null());

    // A rotation to a kubeconfig that never syncs keeps the current one serving, with the error shown.
    let dead = kubeconfig_for("https://127.0.0.1:1", east.ca_pem(), "east-v3", "dead");
    primary.config.apply(remote_secret(&[("east", &dead)]));
    let error = wait_for("pending rotation reported", BOUND, || async move {
        let view = cluster_view(admin, "east").await?;
        view["pending_rotation"]
            .as_str()
            .filter(|e| e.contains("rotation pending"))
            .map(str::to_string)
    })
    .await;
    assert!(error.contains("did not sync"), "{error}");
    assert_eq!(served(admin, "east").await, ["10.20.0.1", "10.20.0.2"]);
}

/// A rotation that cannot sync within the timeout (the remote is down) goes on until it does:
/// the old token, revoked meanwhile, is not left serving a registry that can no longer list.
#[tokio::test]
async fn a_rotation_that_cannot_sync_in_time_completes_once_the_remote_is_back() {
    let east = remote("10.20.0.1").await;
    let primary = Primary::new().await;
    primary
        .config
        .apply(remote_secret(&[("east", &reader_token(&east, "east-v1"))]));
    let mp = start_meshpilot_with(&primary.flags(&["--remote-cluster-timeout", "1s"])).await;
    let admin = mp.http_addr;
    wait_for("east served", BOUND, || async move {
        (served(admin, "east").await == ["10.20.0.1"]).then_some(())
    })
    .await;

    east.set_failing(true);
    primary
        .config
        .apply(remote_secret(&[("east", &reader_token(&east, "east-v2"))]));
    wait_for("the rotation reported pending", BOUND, || async move {
        let view = cluster_view(admin, "east").await?;
        let why = view["pending_rotation"].as_str()?;
        why.contains("did not sync within 1s; still trying")
            .then_some(())
    })
    .await;
    east.revoke_token("east-v1");
    east.set_failing(false);

    east.apply_yaml(
        "
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-2, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 80}]
endpoints:
- addresses: [10.20.0.2]
  conditions: {ready: true}
",
    );
    wait_for(
        "a change served through the new kubeconfig",
        BOUND,
        || async move { (served(admin, "east").await == ["10.20.0.1", "10.20.0.2"]).then_some(()) },
    )
    .await;
    let (_, metrics) = http_get(admin, "/metrics").await.unwrap();
    assert!(metrics.contains("meshpilot_remote_cluster_rotations_total 1"));
}

/// Going back to the kubeconfig being served ends a rotation that could not go through, and
/// one that was refused: nothing is left pending, nothing retried.
#[tokio::test]
async fn going_back_to_the_served_kubeconfig_ends_a_pending_rotation() {
    let east = remote("10.20.0.1").await;
    let primary = Primary::new().await;
    let served_secret = remote_secret(&[("east", &reader_token(&east, "east-v1"))]);
    primary.config.apply(served_secret.clone());
    let mp = start_meshpilot_with(&primary.flags(&["--remote-cluster-timeout", "1s"])).await;
    let admin = mp.http_addr;
    wait_for("east served", BOUND, || async move {
        (served(admin, "east").await == ["10.20.0.1"]).then_some(())
    })
    .await;
    let pending = || async move {
        let view = cluster_view(admin, "east").await?;
        Some(view["pending_rotation"].as_str().map(str::to_string))
    };

    let dead = kubeconfig_for("https://127.0.0.1:1", east.ca_pem(), "east-v2", "dead");
    for rotation in [dead.as_str(), "not a kubeconfig"] {
        primary.config.apply(remote_secret(&[("east", rotation)]));
        wait_for("the rotation reported pending", BOUND, || async move {
            pending().await?.map(|_| ())
        })
        .await;
        primary.config.apply(served_secret.clone());
        wait_for("the pending rotation dropped", BOUND, || async move {
            pending().await?.is_none().then_some(())
        })
        .await;
    }
    assert_eq!(served(admin, "east").await, ["10.20.0.1"]);
    let (_, metrics) = http_get(admin, "/metrics").await.unwrap();
    assert!(metrics.contains("meshpilot_remote_cluster_rotations_total 0"));
}

#[tokio::test]
async fn hanging_remote_delays_neither_others_nor_readiness_past_the_timeout() {
    let (east, west) = (remote("10.20.0.1").await, remote("10.30.0.1").await);
    east.set_hang(true);
    let primary = Primary::new().await;
    let (east_cfg, west_cfg) = (
        reader_token(&east, "east-reader"),
        reader_token(&west, "west-reader"),
    );
    primary
        .config
        .apply(remote_secret(&[("east", &east_cfg), ("west", &west_cfg)]));

    let started = Instant::now();
    let mp = start_meshpilot_unready(&primary.flags(&["--remote-cluster-timeout", "2s"])).await;
    let admin = mp.http_addr;
    // While east still syncs (seen before and after the probe), readiness must say no.
    let (status, body) = wait_for("readiness probed while east syncs", BOUND, || async move {
        let syncing = || async move {
            cluster_view(admin, "east")
                .await
                .is_some_and(|v| v["state"] == "syncing")
        };
        if !syncing().await {
            return None;
        }
        let probe = http_get(admin, "/ready").await.ok()?;
        syncing().await.then_some(probe)
    })
    .await;
    assert_eq!(status, 503, "ready while a cluster syncs: {body}");
    assert!(body.contains("east"), "{body}");
    let east_then = wait_for("west served", BOUND, || async move {
        (served(admin, "west").await == ["10.30.0.1"]).then_some(())?;
        cluster_view(admin, "east")
            .await
            .map(|v| v["state"].clone())
    })
    .await;
    let west_after = started.elapsed();
    assert_eq!(
        east_then, "syncing",
        "west was served only after east's timeout ({west_after:?})"
    );
    wait_for("ready after the timeout", BOUND, || async move {
        let (status, _) = http_get(admin, "/ready").await.ok()?;
        (status == 200).then_some(())
    })
    .await;
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "ready came before the timeout"
    );
    let view = cluster_view(admin, "east").await.unwrap();
    assert_eq!(view["state"], "timed-out");
    let (_, metrics) = http_get(admin, "/metrics").await.unwrap();
    assert!(
        metrics.contains("remote_cluster_sync_timeouts_total 1"),
        "{metrics}"
    );
    eprintln!("west served after {west_after:?}; east timed out as configured");

    // Once it answers, the timed-out cluster catches up.
    east.set_hang(false);
    wait_for("east served once it answers", BOUND, || async move {
        (served(admin, "east").await == ["10.20.0.1"]).then_some(())
    })
    .await;
}

#[tokio::test]
async fn bad_kubeconfigs_are_reported_and_isolated() {
    let west = remote("10.30.0.1").await;
    let primary = Primary::new().await;
    let west_cfg = reader_token(&west, "west-reader");
    let exec = west_cfg.replace(
        "token: west-reader",
        "exec: {apiVersion: client.authentication.k8s.io/v1, command: /bin/true}",
    );
    let dead = kubeconfig_for("https://127.0.0.1:1", west.ca_pem(), "t", "dead");
    primary.config.apply(remote_secret(&[
        ("west", &west_cfg),
        ("exec-cluster", &exec),
        ("broken", "clusters: [ {"),
        ("dead", &dead),
        ("primary", &west_cfg),
    ]));
    let mp = start_meshpilot_with(&primary.flags(&["--remote-cluster-timeout", "1s"])).await;
    let admin = mp.http_addr;
    assert_eq!(served(admin, "west").await, ["10.30.0.1"]);

    let exec_view = cluster_view(admin, "exec-cluster").await.unwrap();
    assert_eq!(exec_view["state"], "failed");
    assert!(
        exec_view["last_error"]
            .as_str()
            .unwrap()
            .contains("exec plugin"),
        "{exec_view}"
    );
    let broken = cluster_view(admin, "broken").await.unwrap();
    assert_eq!(broken["state"], "failed");
    assert!(
        broken["last_error"]
            .as_str()
            .unwrap()
            .contains("does not parse"),
        "{broken}"
    );
    let dead_view = wait_for("dead cluster reported", BOUND, || async move {
        let view = cluster_view(admin, "dead").await?;
        (view["state"] == "timed-out" && view["last_error"].is_string()).then_some(view)
    })
    .await;
    eprintln!("dead cluster: {}", dead_view["last_error"]);
    // The config cluster's own id in a Secret is ignored: still the kubeconfig cluster, no duplicate.
    let clusters = get_json(admin, "/debug/clusterz").await;
    let primaries: Vec<_> = clusters
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["id"] == "primary")
        .collect();
    assert_eq!(primaries.len(), 1);
    assert!(primaries[0]["source"]
        .as_str()
        .unwrap()
        .starts_with("kubeconfig:"));

    // A fix to one bad entry onboards it; the others are unaffected.
    let fixed = reader_token(&west, "west-reader-2");
    primary.config.apply(remote_secret(&[
        ("west", &west_cfg),
        ("exec-cluster", &fixed),
        ("broken", "clusters: [ {"),
        ("dead", &dead),
    ]));
    wait_for("fixed cluster served", BOUND, || async move {
        (served(admin, "exec-cluster").await == ["10.30.0.1"]).then_some(())
    })
    .await;
    assert_eq!(served(admin, "west").await, ["10.30.0.1"]);
}

#[tokio::test]
async fn remote_secret_command_output_onboards_the_remote() {
    let west = remote("10.30.0.1").await;
    let admin_kubeconfig = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(admin_kubeconfig.path(), west.kubeconfig(west.admin_token())).unwrap();
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_meshpilot"))
        .args(["remote-secret", "--cluster-id", "west", "--kubeconfig"])
        .arg(admin_kubeconfig.path())
        .output()
        .await
        .unwrap();
    let yaml = String::from_utf8(output.stdout).unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(yaml.contains("istio/multiCluster: \"true\""), "{yaml}");
    assert!(west
        .get(
            "ServiceAccount",
            "istio-system",
            "istio-reader-service-account"
        )
        .is_some());
    assert!(
        !yaml.contains(west.admin_token()),
        "the Secret must carry the reader's token, not the caller's"
    );

    let primary = Primary::new().await;
    let mp = start_meshpilot_with(&primary.flags(&[])).await;
    primary.config.apply_yaml(&yaml);
    let admin = mp.http_addr;
    wait_for(
        "remote onboarded from the generated Secret",
        BOUND,
        || async move { (served(admin, "west").await == ["10.30.0.1"]).then_some(()) },
    )
    .await;
}

/// A second `web` pod at `ip` in a remote cluster.
const WEB_2: &str = "
apiVersion: v1
kind: Pod
metadata: {name: web-2, namespace: shop, labels: {app: web}}
spec: {serviceAccountName: web, containers: []}
status: {podIP: 10.20.0.2}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-2, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 80}]
endpoints:
- addresses: [10.20.0.2]
  conditions: {ready: true}
  targetRef: {kind: Pod, name: web-2, namespace: shop}
";

/// `web`'s endpoints in the assignment meshpilot sends a sidecar (decoded from a raw ADS stream);
/// none when it sends no assignment.
async fn sent_endpoints(xds: SocketAddr) -> Vec<String> {
    use envoy_types::pb::envoy::config::core::v3::address::Address;
    use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
    use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
    use prost::Message;
    let mut ads = AdsClient::connect(xds).await.unwrap();
    ads.request(DiscoveryRequest {
        node: Some(node(
            "sidecar~10.0.9.8~raw.shop~shop.svc.cluster.local",
            &[],
        )),
        type_url: "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment".into(),
        resource_names: vec![WEB_CLUSTER.into()],
        ..Default::default()
    });
    let response = ads.response(BOUND).await;
    // No assignment at all once the service is gone.
    let Some(assignment) = response.resources.first() else {
        return Vec::new();
    };
    let cla = ClusterLoadAssignment::decode(&assignment.value[..]).unwrap();
    let mut out: Vec<String> = (cla.endpoints.iter())
        .flat_map(|l| &l.lb_endpoints)
        .filter_map(|e| match &e.host_identifier {
            Some(
                envoy_types::pb::envoy::config::endpoint::v3::lb_endpoint::HostIdentifier::Endpoint(
                    ep,
                ),
            ) => match ep.address.as_ref()?.address.as_ref()? {
                Address::SocketAddress(sa) => Some(sa.address.clone()),
                _ => None,
            },
            _ => None,
        })
        .collect();
    out.sort();
    out
}

#[tokio::test]
async fn a_restart_while_a_remote_is_down_serves_its_last_known_good_snapshot_until_it_syncs() {
    use meshpilot::model::ClusterId;
    use meshpilot::sources::snapshots::SnapshotStore;
    let _ports = sidecar_ports().await;
    let east = remote("10.20.0.1").await;
    let primary = Primary::new().await;
    primary.config.apply(remote_secret(&[(
        "east",
        &reader_token(&east, "east-reader"),
    )]));
    let state = tempfile::tempdir().unwrap();
    let state_dir = state.path().to_str().unwrap();
    let flags = primary.flags(&["--state-dir", state_dir, "--stale-remote-max-age", "1h"]);
    let store = SnapshotStore::new(state.path().join("remotes"));
    let saved_slices = || {
        let snapshot = store.load(&ClusterId::new("east")).ok().flatten();
        snapshot.map_or(0, |s| s.objects.slices.len())
    };

    // Run 1: east syncs, is saved, changes, and is saved again.
    let mp = start_meshpilot_with(&flags).await;
    wait_for("east saved", BOUND, || async {
        (saved_slices() == 1).then_some(())
    })
    .await;
    east.apply_yaml(WEB_2);
    wait_for("east's change saved", BOUND, || async {
        (saved_slices() == 2).then_some(())
    })
    .await;
    drop(mp);

    // Run 2, east's API server down: ready at once, east's endpoints served from the snapshot.
    east.stop();
    let mp = start_meshpilot_with(&flags).await;
    let admin = mp.http_addr;
    let view = cluster_view(admin, "east").await.unwrap();
    assert_eq!(view["syncStatus"], "stale", "{view}");
    assert!(view["snapshot_saved_at"].is_string(), "{view}");
    assert_eq!(served(admin, "east").await, ["10.20.0.1", "10.20.0.2"]);
    assert_eq!(
        sent_endpoints(mp.xds_addr).await,
        ["10.20.0.1", "10.20.0.2"]
    );
    let envoy = client_envoy(&mp, AdsMode::Sotw, &["10.20.0.1:80", "10.20.0.2:80"]).await;
    let (_, metrics) = http_get(admin, "/metrics").await.unwrap();
    assert!(
        metrics.contains("meshpilot_remote_cluster_stale_seconds{cluster=\"east\"}"),
        "{metrics}"
    );
    assert!(metrics.contains("meshpilot_managed_clusters{state=\"stale\"} 1"));
    drop(envoy);
    drop(mp);

    // Run 3: a snapshot older than --stale-remote-max-age stops being served.
    let saved_at = store
        .load(&ClusterId::new("east"))
        .unwrap()
        .unwrap()
        .saved_at;
    let age = saved_at.elapsed().unwrap_or_default() + Duration::from_secs(2);
    let max_age = format!("{}ms", age.as_millis());
    let mp = start_meshpilot_with(&primary.flags(&[
        "--state-dir",
        state_dir,
        "--stale-remote-max-age",
        &max_age,
    ]))
    .await;
    let admin = mp.http_addr;
    assert_eq!(served(admin, "east").await, ["10.20.0.1", "10.20.0.2"]);
    wait_for(
        "the expired snapshot no longer served",
        BOUND,
        || async move { served(admin, "east").await.is_empty().then_some(()) },
    )
    .await;
    assert!(sent_endpoints(mp.xds_addr).await.is_empty());
    let view = cluster_view(admin, "east").await.unwrap();
    // (Its last error is the expiry's, until the next failing watch attempt reports its own.)
    assert_eq!(view["syncStatus"], "timeout", "{view}");
    assert!(view["snapshot_saved_at"].is_null(), "{view}");
    drop(mp);

    // Run 4: east comes back having lost web-2; its first lists replace the snapshot.
    east.delete("EndpointSlice", "shop", "web-2");
    east.delete("Pod", "shop", "web-2");
    east.restart().await;
    let mp = start_meshpilot_with(&flags).await;
    let admin = mp.http_addr;
    wait_for("east synced without web-2", BOUND, || async move {
        let view = cluster_view(admin, "east").await?;
        let synced = view["syncStatus"] == "synced" && view["snapshot_saved_at"].is_null();
        (synced && served(admin, "east").await == ["10.20.0.1"]).then_some(())
    })
    .await;
    assert_eq!(sent_endpoints(mp.xds_addr).await, ["10.20.0.1"]);
    wait_for("the snapshot follows", BOUND, || async {
        (saved_slices() == 1).then_some(())
    })
    .await;

    // The remote leaves the mesh: its snapshot goes with it.
    primary.config.delete("Secret", "istio-system", SECRET);
    wait_for("snapshot deleted", BOUND, || async {
        store
            .load(&ClusterId::new("east"))
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
}

/// How long a change may take to reach Envoy: a push takes milliseconds, the rest absorbs a
/// loaded CI machine. The defects these tests guard against left Envoy stale indefinitely.
const PUSHED: Duration = Duration::from_secs(5);

/// Waits until Envoy holds exactly `expected` as the cluster's healthy endpoints.
async fn envoy_holds(envoy: &Envoy, cluster: &str, expected: &[&str], what: &str) {
    let started = Instant::now();
    wait_for(what, PUSHED, || async {
        (envoy.endpoints(cluster).await == expected).then_some(())
    })
    .await;
    eprintln!("{what}: {:?}", started.elapsed());
}

/// `web-<n>`'s pod in a remote at `10.20.0.<n>` on node `node-<n>`, ready or not.
fn web_pod(n: u8, ready: bool) -> String {
    let status = if ready { "True" } else { "False" };
    format!(
        "
apiVersion: v1
kind: Pod
metadata: {{name: web-{n}, namespace: shop, labels: {{app: web}}}}
spec: {{serviceAccountName: web, nodeName: node-{n}, containers: []}}
status: {{podIP: 10.20.0.{n}, conditions: [{{type: Ready, status: '{status}'}}]}}
"
    )
}

/// `web-<n>`'s EndpointSlice in a remote, ready or not.
fn web_slice(n: u8, ready: bool) -> String {
    format!(
        "
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: web-{n}, namespace: shop, labels: {{kubernetes.io/service-name: web}}}}
addressType: IPv4
ports: [{{name: http, port: 80}}]
endpoints:
- addresses: [10.20.0.{n}]
  conditions: {{ready: {ready}}}
  nodeName: node-{n}
  targetRef: {{kind: Pod, name: web-{n}, namespace: shop}}
"
    )
}

/// A pod of `web` becoming ready or not, as the kubelet and the EndpointSlice controller report it.
fn web_readiness(api: &TestApiServer, n: u8, ready: bool) {
    api.apply_yaml(&web_pod(n, ready));
    api.apply_yaml(&web_slice(n, ready));
}

/// A remote serving `web` from two ready pods, each on a node of its own zone.
async fn remote_of_two_zones() -> TestApiServer {
    let east = remote("10.20.0.1").await;
    for n in 1..=2u8 {
        east.apply_yaml(&format!(
            "apiVersion: v1\nkind: Node\nmetadata: {{name: node-{n}, labels: \
             {{topology.kubernetes.io/region: east, topology.kubernetes.io/zone: east-{n}}}}}\n"
        ));
        web_readiness(&east, n, true);
    }
    east
}

/// `web` in the config cluster too, at 10.10.0.1.
const WEB_IN_PRIMARY: &str = "
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec: {clusterIP: 10.96.0.80, ports: [{name: http, port: 80}]}
---
apiVersion: v1
kind: Pod
metadata: {name: web-p, namespace: shop, labels: {app: web}}
spec: {serviceAccountName: web, containers: []}
status: {podIP: 10.10.0.1}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-p, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 80}]
endpoints:
- addresses: [10.10.0.1]
  conditions: {ready: true}
  targetRef: {kind: Pod, name: web-p, namespace: shop}
";

/// Waits until east's snapshot in `state` holds both of its slices.
async fn east_saved(state: &std::path::Path) {
    let store = meshpilot::sources::snapshots::SnapshotStore::new(state.join("remotes"));
    wait_for("east saved", BOUND, || async {
        let snapshot = store
            .load(&meshpilot::model::ClusterId::new("east"))
            .ok()??;
        (snapshot.objects.slices.len() == 2).then_some(())
    })
    .await;
}

/// A snapshot serves only the cluster it was taken of: a new cluster at the old address (its CA
/// differs) is not served the old one's objects, while the old one still is.
#[tokio::test]
async fn a_snapshot_is_served_only_to_the_cluster_it_was_taken_of() {
    use meshpilot::model::ClusterId;
    use meshpilot::sources::snapshots::SnapshotStore;
    let east = remote("10.20.0.1").await;
    let primary = Primary::new().await;
    let served_secret = remote_secret(&[("east", &reader_token(&east, "east-reader"))]);
    primary.config.apply(served_secret.clone());
    let state = tempfile::tempdir().unwrap();
    let state_dir = state.path().to_str().unwrap();
    let flags = primary.flags(&[
        "--state-dir",
        state_dir,
        "--stale-remote-max-age",
        "1h",
        "--remote-cluster-timeout",
        "1s",
    ]);
    let store = SnapshotStore::new(state.path().join("remotes"));
    let mp = start_meshpilot_with(&flags).await;
    wait_for("east saved", BOUND, || async {
        let saved = store.load(&ClusterId::new("east")).ok().flatten();
        saved.is_some().then_some(())
    })
    .await;
    drop(mp);
    east.stop();

    // The Secret now names another cluster at east's address: a CA of its own.
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let other_ca = params.self_signed(&key).unwrap().pem();
    let elsewhere = kubeconfig_for(&east.url(), &other_ca, "east-reader", "east");
    primary.config.apply(remote_secret(&[("east", &elsewhere)]));
    let mp = start_meshpilot_with(&flags).await;
    let admin = mp.http_addr;
    let view = cluster_view(admin, "east").await.unwrap();
    assert_ne!(view["syncStatus"], "stale", "{view}");
    assert!(view["snapshot_saved_at"].is_null(), "{view}");
    assert!(served(admin, "east").await.is_empty());
    drop(mp);

    // The cluster it was taken of, still down: served from it.
    primary.config.apply(served_secret);
    let mp = start_meshpilot_with(&flags).await;
    let view = cluster_view(mp.http_addr, "east").await.unwrap();
    assert_eq!(view["syncStatus"], "stale", "{view}");
    assert_eq!(served(mp.http_addr, "east").await, ["10.20.0.1"]);
}

#[tokio::test]
async fn a_remote_served_from_its_snapshot_after_a_crash_pushes_its_changes() {
    let _ports = sidecar_ports().await;
    let east = remote_of_two_zones().await;
    let primary = Primary::new().await;
    primary.config.apply_yaml(WEB_IN_PRIMARY);
    primary.config.apply(remote_secret(&[(
        "east",
        &reader_token(&east, "east-reader"),
    )]));
    let dir = tempfile::tempdir().unwrap();
    let (state, ca) = (dir.path().join("state"), dir.path().join("ca"));
    // The same xDS address across the crash, so the Envoy reconnects as a sidecar would.
    let xds = free_port();
    let xds_flag = xds.to_string();
    let flags = primary.flags(&[
        "--state-dir",
        state.to_str().unwrap(),
        "--ca-state-dir",
        ca.to_str().unwrap(),
        "--stale-remote-max-age",
        "1h",
        "--xds-addr",
        &xds_flag,
    ]);
    let mut mp = MeshpilotProcess::discovery(&flags, &[]);
    east_saved(&state).await;
    let envoy = Envoy::start_with(EnvoyOptions {
        xds,
        replicas: &[],
        node_id: "sidecar~10.0.9.9~client.shop~shop.svc.cluster.local",
        metadata: &[("CLUSTER_ID", "primary")],
        labels: &[],
        mode: AdsMode::Sotw,
        workload: WorkloadCerts::placeholder(),
        xds_tls: None,
        netns: None,
    })
    .await;
    let all = ["10.10.0.1:80", "10.20.0.1:80", "10.20.0.2:80"];
    wait_for("every web endpoint in Envoy", BOUND, || async {
        (envoy.endpoints(WEB_CLUSTER).await == all).then_some(())
    })
    .await;

    // east goes down, meshpilot crashes and comes back serving east from its snapshot.
    east.stop();
    mp.kill_9();
    let mp = MeshpilotProcess::discovery(&flags, &[]);
    let admin = mp.bound_addr("admin").await;
    wait_for("the Envoy back on a stale east", BOUND, || async move {
        let stale = cluster_view(admin, "east").await?["syncStatus"] == "stale";
        let syncz = get_json(admin, "/debug/syncz").await;
        let eds = &syncz.as_array()?.first()?["types"]["eds"];
        let acked = eds["sent_nonce"].is_string() && eds["acked_nonce"] == eds["sent_nonce"];
        (stale && acked).then_some(())
    })
    .await;
    assert_eq!(
        sent_endpoints(xds).await,
        ["10.10.0.1", "10.20.0.1", "10.20.0.2"]
    );

    // A pod changed while east was down arrives with its lists.
    web_readiness(&east, 1, false);
    east.restart().await;
    envoy_holds(
        &envoy,
        WEB_CLUSTER,
        &["10.10.0.1:80", "10.20.0.2:80"],
        "relisted change in Envoy",
    )
    .await;
    assert_eq!(sent_endpoints(xds).await, ["10.10.0.1", "10.20.0.2"]);
    wait_for("east synced", BOUND, || async move {
        (cluster_view(admin, "east").await?["syncStatus"] == "synced").then_some(())
    })
    .await;

    // And so does one made once it is synced.
    web_readiness(&east, 1, true);
    web_readiness(&east, 2, false);
    envoy_holds(
        &envoy,
        WEB_CLUSTER,
        &["10.10.0.1:80", "10.20.0.1:80"],
        "live change in Envoy",
    )
    .await;
    assert_eq!(sent_endpoints(xds).await, ["10.10.0.1", "10.20.0.1"]);
    assert_eq!(envoy.rejected_updates().await, 0);
}

#[tokio::test]
async fn a_kubeconfig_rotated_while_a_snapshot_is_served_pushes_its_changes() {
    let _ports = sidecar_ports().await;
    let east = remote_of_two_zones().await;
    let primary = Primary::new().await;
    primary
        .config
        .apply(remote_secret(&[("east", &reader_token(&east, "east-v1"))]));
    let state = tempfile::tempdir().unwrap();
    let state_dir = state.path().to_str().unwrap();
    let flags = primary.flags(&["--state-dir", state_dir, "--stale-remote-max-age", "1h"]);
    let mp = start_meshpilot_with(&flags).await;
    east_saved(state.path()).await;
    drop(mp);

    east.stop();
    let mp = start_meshpilot_with(&flags).await;
    let admin = mp.http_addr;
    assert_eq!(
        cluster_view(admin, "east").await.unwrap()["syncStatus"],
        "stale"
    );
    let envoy = client_envoy(&mp, AdsMode::Delta, &["10.20.0.1:80", "10.20.0.2:80"]).await;

    // The Secret is rotated while east is down (the old token no longer works); a pod changes.
    east.revoke_token("east-v1");
    primary
        .config
        .apply(remote_secret(&[("east", &reader_token(&east, "east-v2"))]));
    web_readiness(&east, 1, false);
    east.restart().await;
    envoy_holds(
        &envoy,
        WEB_CLUSTER,
        &["10.20.0.2:80"],
        "the rotated registry's list in Envoy",
    )
    .await;
    web_readiness(&east, 1, true);
    envoy_holds(
        &envoy,
        WEB_CLUSTER,
        &["10.20.0.1:80", "10.20.0.2:80"],
        "a change after the rotation",
    )
    .await;
    assert_eq!(
        sent_endpoints(mp.xds_addr).await,
        ["10.20.0.1", "10.20.0.2"]
    );
    let view = cluster_view(admin, "east").await.unwrap();
    assert_eq!(view["syncStatus"], "synced", "{view}");
    let (_, metrics) = http_get(admin, "/metrics").await.unwrap();
    assert!(metrics.contains("meshpilot_remote_cluster_rotations_total 1"));
}

/// A ServiceEntry of the config cluster selecting `app: web` pods of every cluster.
const WEB_ENTRY: &str = "
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: web-entry, namespace: shop}
spec:
  hosts: [web.shop.global]
  addresses: [240.0.0.80]
  ports: [{number: 80, name: http, protocol: HTTP}]
  location: MESH_INTERNAL
  resolution: STATIC
  workloadSelector: {labels: {app: web}}
";
const WEB_ENTRY_CLUSTER: &str = "outbound|80||web.shop.global";

#[tokio::test]
async fn a_rotated_kubeconfig_drops_what_only_the_old_registry_served() {
    let _ports = sidecar_ports().await;
    let east = remote_of_two_zones().await;
    let primary = Primary::new().await;
    primary.config.apply_yaml(WEB_ENTRY);
    primary
        .config
        .apply(remote_secret(&[("east", &reader_token(&east, "east-v1"))]));
    let mp = start_meshpilot_with(&primary.flags(&[])).await;
    let admin = mp.http_addr;
    let both = ["10.20.0.1:80", "10.20.0.2:80"];
    let envoy = client_envoy(&mp, AdsMode::Delta, &both).await;
    envoy_holds(
        &envoy,
        WEB_ENTRY_CLUSTER,
        &both,
        "the entry's selected pods in Envoy",
    )
    .await;

    // web-1 goes while east is unreachable and its kubeconfig rotates: the old registry never
    // hears of it, the new one never saw it.
    east.stop();
    east.delete("EndpointSlice", "shop", "web-1");
    east.delete("Pod", "shop", "web-1");
    east.revoke_token("east-v1");
    primary
        .config
        .apply(remote_secret(&[("east", &reader_token(&east, "east-v2"))]));
    east.restart().await;
    envoy_holds(
        &envoy,
        WEB_CLUSTER,
        &["10.20.0.2:80"],
        "web-1 gone from the Service",
    )
    .await;
    envoy_holds(
        &envoy,
        WEB_ENTRY_CLUSTER,
        &["10.20.0.2:80"],
        "web-1 gone from the entry",
    )
    .await;
    assert_eq!(
        shard_addresses(admin, "web.shop.global", "east").await,
        ["10.20.0.2"]
    );
    let (_, metrics) = http_get(admin, "/metrics").await.unwrap();
    assert!(metrics.contains("meshpilot_remote_cluster_rotations_total 1"));
}

#[tokio::test]
async fn a_remote_secret_deleted_and_added_again_pushes_its_changes() {
    let _ports = sidecar_ports().await;
    let east = remote_of_two_zones().await;
    let primary = Primary::new().await;
    let secret = remote_secret(&[("east", &reader_token(&east, "east-reader"))]);
    primary.config.apply(secret.clone());
    let mp = start_meshpilot_with(&primary.flags(&[])).await;
    let both = ["10.20.0.1:80", "10.20.0.2:80"];
    let envoy = client_envoy(&mp, AdsMode::Sotw, &both).await;

    primary.config.delete("Secret", "istio-system", SECRET);
    envoy_holds(&envoy, WEB_CLUSTER, &[], "east gone").await;
    primary.config.apply(secret);
    envoy_holds(&envoy, WEB_CLUSTER, &both, "east back").await;
    web_readiness(&east, 2, false);
    envoy_holds(
        &envoy,
        WEB_CLUSTER,
        &["10.20.0.1:80"],
        "a change after its return",
    )
    .await;
    assert_eq!(sent_endpoints(mp.xds_addr).await, ["10.20.0.1"]);
}

#[tokio::test]
async fn a_restarted_config_cluster_pushes_its_changes() {
    let _ports = sidecar_ports().await;
    let primary = Primary::new().await;
    primary.config.apply_yaml(WEB_IN_PRIMARY);
    let mp = start_meshpilot_with(&primary.flags(&[])).await;
    let envoy = client_envoy(&mp, AdsMode::Delta, &["10.10.0.1:80"]).await;

    primary.config.stop();
    primary
        .config
        .apply_yaml(&WEB_IN_PRIMARY.replace("10.10.0.1", "10.10.0.2"));
    primary.config.restart().await;
    envoy_holds(
        &envoy,
        WEB_CLUSTER,
        &["10.10.0.2:80"],
        "the relisted change",
    )
    .await;
    primary
        .config
        .apply_yaml(&WEB_IN_PRIMARY.replace("10.10.0.1", "10.10.0.3"));
    envoy_holds(
        &envoy,
        WEB_CLUSTER,
        &["10.10.0.3:80"],
        "a change after the restart",
    )
    .await;
    assert_eq!(sent_endpoints(mp.xds_addr).await, ["10.10.0.3"]);
}

#[tokio::test]
async fn sigterm_writes_what_a_remote_changed_since_its_last_snapshot() {
    let east = remote("10.20.0.1").await;
    let primary = Primary::new().await;
    primary.config.apply(remote_secret(&[(
        "east",
        &reader_token(&east, "east-reader"),
    )]));
    let dir = tempfile::tempdir().unwrap();
    let (state, ca) = (dir.path().join("state"), dir.path().join("ca"));
    let flags = primary.flags(&[
        "--state-dir",
        state.to_str().unwrap(),
        "--ca-state-dir",
        ca.to_str().unwrap(),
        "--stale-remote-max-age",
        "1h",
    ]);
    let mut mp = MeshpilotProcess::discovery(&flags, &[]);
    let admin = mp.bound_addr("admin").await;
    let store = meshpilot::sources::snapshots::SnapshotStore::new(state.join("remotes"));
    let saved_slices = || {
        let snapshot = store
            .load(&meshpilot::model::ClusterId::new("east"))
            .ok()
            .flatten();
        snapshot.map_or(0, |s| s.objects.slices.len())
    };
    wait_for("east saved", BOUND, || async {
        (saved_slices() == 1).then_some(())
    })
    .await;
    // A change inside the save interval, then SIGTERM before it would be saved.
    east.apply_yaml(WEB_2);
    wait_for("the change served", BOUND, || async move {
        (served(admin, "east").await == ["10.20.0.1", "10.20.0.2"]).then_some(())
    })
    .await;
    assert_eq!(
        saved_slices(),
        1,
        "saved already: the test would prove nothing"
    );
    mp.terminate();
    let status = mp.exited(BOUND).await;
    assert!(status.success(), "{status}: {}", mp.log());
    assert_eq!(saved_slices(), 2, "the change written at shutdown");
}

/// A remote whose lists fail from the start (its storage down): each of its watches retries its
/// list, waiting longer after each failure (100 ms doubling to 5 s, jittered) although the watcher
/// begins every attempt anew; once the remote recovers, it syncs.
#[tokio::test]
async fn a_remote_whose_lists_fail_is_retried_ever_more_slowly_until_it_recovers() {
    let mesh = common::primary::primary_with_prepared_remote(
        &["--remote-cluster-timeout", "1s"],
        |east| {
            serve_web(east, "10.20.0.1");
            east.set_failing(true);
        },
    )
    .await;
    let started = Instant::now();
    let before = mesh.east.request_count("list:services");
    wait_for(
        "six more failed lists of Services",
        Duration::from_secs(60),
        || {
            let east = &mesh.east;
            async move { (east.request_count("list:services") >= before + 5).then_some(()) }
        },
    )
    .await;
    let elapsed = started.elapsed();
    eprintln!(
        "5 lists of one watch while they fail: {:.1} s, {:.2} lists per second",
        elapsed.as_secs_f64(),
        5.0 / elapsed.as_secs_f64()
    );
    // Four delays at least lie before the fifth list, never shorter than the last: at least
    // 0.1 + 0.2 + 0.4 + 0.8 s, however far they had grown by then; a busy machine only adds.
    assert!(
        elapsed >= Duration::from_millis(1_500),
        "five lists in {elapsed:?}: retries did not back off"
    );

    mesh.east.set_failing(false);
    let admin = mesh.mp.http_addr;
    wait_for(
        "the remote's endpoints once it recovers",
        BOUND,
        || async move { (served(admin, "east").await == ["10.20.0.1"]).then_some(()) },
    )
    .await;
}
