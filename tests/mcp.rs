//! Istio config over xDS (MCP) between two meshpilots: B takes A as its `xds://` config source
//! over mutual TLS (a client certificate of A's root namespace); A's VirtualService and
//! ServiceEntry reach B's real Envoy; an object A refuses is never served; B keeps its last good
//! config while A is down and resyncs when it returns. A's config is not served to a client that
//! has not proven itself. A registry speaking MCP (grpcio, its messages generated from the
//! project's protos) feeds 10,000 ServiceEntries, then shrinks to a few.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use common::*;
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use serde_json::Value;

const BOUND: Duration = Duration::from_secs(30);

const CONFIG: &str = "
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: payments, namespace: shop}
spec:
  hosts: [payments.example.com]
  ports: [{number: 80, name: http, protocol: HTTP}]
  resolution: STATIC
  location: MESH_EXTERNAL
  endpoints: [{address: 10.77.0.1}, {address: 10.77.0.2}]
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: payments, namespace: shop}
spec:
  hosts: [payments.example.com]
  http:
  - match: [{uri: {prefix: /v2}}]
    fault: {abort: {httpStatus: 418, percentage: {value: 100}}}
    route: [{destination: {host: payments.example.com}}]
  - route: [{destination: {host: payments.example.com}}]
";

/// Refused by A (a misspelt field): B must never see it.
const REFUSED: &str = "
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {name: broken, namespace: shop}
spec: {host: payments.example.com, trafficPolicy: {loadBalancr: {simple: ROUND_ROBIN}}}
";

/// meshpilot A: the bundled clusters and its config files in `dir`, its CA's root kept in `ca`
/// (as across a real restart), its secure xDS port at `secure` — retried while the port of the
/// run before is still being released.
async fn start_a(dir: &Path, ca: &Path, secure: SocketAddr) -> meshpilot::app::Running {
    let (dir, ca, secure) = (
        dir.to_str().unwrap(),
        ca.to_str().unwrap(),
        secure.to_string(),
    );
    let flags = [
        "--config-dir",
        dir,
        "--ca-state-dir",
        ca,
        "--secure-xds-addr",
        &secure,
        "--debounce-after",
        "0s",
        "--drain-duration",
        "0s",
    ];
    let running = wait_for("meshpilot A started", BOUND, || async {
        try_start_meshpilot(&flags).await.ok()
    })
    .await;
    let admin = running.http_addr;
    wait_for("meshpilot A ready", BOUND, || async move {
        let (status, _) = http_get(admin, "/ready").await.ok()?;
        (status == 200).then_some(())
    })
    .await;
    running
}

/// The config objects B holds from its MCP source, by kind and name.
async fn mcp_objects(b: &meshpilot::app::Running) -> Vec<(String, String)> {
    let configz = get_json(b.http_addr, "/debug/configz").await;
    configz
        .as_array()
        .into_iter()
        .flatten()
        .filter(|o| o["status"] == "accepted" && o["source"]["type"] == "mcp")
        .map(|o| {
            (
                o["kind"].as_str().unwrap_or_default().to_string(),
                o["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            )
        })
        .collect()
}

fn source_status(configz: &Value) -> Value {
    configz
        .as_array()
        .and_then(|a| a.iter().find(|o| o["kind"] == "ConfigSource"))
        .cloned()
        .unwrap_or_default()
}

#[tokio::test]
async fn a_second_meshpilot_takes_the_first_as_its_config_source() {
    let dir_a = copy_tree(Path::new(EXAMPLE));
    std::fs::create_dir_all(dir_a.path().join("config")).unwrap();
    std::fs::write(dir_a.path().join("config/payments.yaml"), CONFIG).unwrap();
    std::fs::write(dir_a.path().join("config/refused.yaml"), REFUSED).unwrap();
    let secure = free_port();
    let ca = tempfile::tempdir().unwrap();
    let a = start_a(dir_a.path(), ca.path(), secure).await;

    // B reaches A as A's root namespace, with a certificate A's CA issued.
    let certs = workload_certs(&a, "istio-system", "istiod");
    let b_dir = tempfile::tempdir().unwrap();
    let file = |name: &str, text: &str| {
        let path = b_dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    };
    let mesh = format!(
        "configSources:
- address: xds://{secure}
  tlsSettings:
    mode: MUTUAL
    clientCertificate: {}
    privateKey: {}
    caCertificates: {}
    sni: istiod.istio-system.svc
",
        file("chain.pem", &certs.chain),
        file("key.pem", &certs.key),
        file("root.pem", &certs.root),
    );
    let mesh_file = file("mesh.yaml", &mesh);
    let clusters = copy_tree(Path::new(EXAMPLE));
    let b = start_meshpilot(
        clusters.path(),
        &["--mesh-config", &mesh_file, "--debounce-after", "0s"],
    )
    .await;

    // A's accepted objects reach B; the refused one does not; B's own files are not read.
    let objects = wait_for("A's config in B", BOUND, || async {
        let objects = mcp_objects(&b).await;
        (objects.len() >= 2).then_some(objects)
    })
    .await;
    assert!(
        objects.contains(&("ServiceEntry".into(), "payments".into())),
        "{objects:?}"
    );
    assert!(
        objects.contains(&("VirtualService".into(), "payments".into())),
        "{objects:?}"
    );
    assert!(
        !objects.iter().any(|(_, name)| name == "broken"),
        "{objects:?}"
    );
    let configz = get_json(b.http_addr, "/debug/configz").await;
    assert_eq!(source_status(&configz)["status"], "synced", "{configz}");

    // B's real Envoy gets the entry's endpoints and the route with its fault.
    let envoy = Envoy::start(
        &b,
        "sidecar~10.1.1.50~client.shop~shop.svc.cluster.local",
        &[("CLUSTER_ID", "cluster1")],
        AdsMode::Sotw,
    )
    .await;
    let cluster = "outbound|80||payments.example.com";
    wait_for("the entry's endpoints in B's Envoy", BOUND, || async {
        let endpoints = envoy.endpoints(cluster).await;
        (endpoints == ["10.77.0.1:80", "10.77.0.2:80"]).then_some(())
    })
    .await;
    wait_for("A's route in B's Envoy", BOUND, || async {
        let dump = envoy.get("/config_dump").await;
        (dump.contains("payments.example.com") && dump.contains("418")).then_some(())
    })
    .await;

    // A goes: B keeps serving what it had, and says its source is down.
    a.shutdown().await;
    wait_for("the source reported down", BOUND, || async {
        let configz = get_json(b.http_addr, "/debug/configz").await;
        let status = source_status(&configz);
        (status["connected"] == false && status["lastError"].is_string()).then_some(())
    })
    .await;
    assert_eq!(mcp_objects(&b).await.len(), 2);
    assert_eq!(
        envoy.endpoints(cluster).await,
        ["10.77.0.1:80", "10.77.0.2:80"]
    );

    // A returns on the same address without the VirtualService: B resyncs and drops it.
    std::fs::write(
        dir_a.path().join("config/payments.yaml"),
        CONFIG.split("---").next().unwrap(),
    )
    .unwrap();
    let a = start_a(dir_a.path(), ca.path(), secure).await;
    wait_for("B resynced from A", Duration::from_secs(90), || async {
        let objects = mcp_objects(&b).await;
        (objects == [("ServiceEntry".to_string(), "payments".to_string())]).then_some(())
    })
    .await;
    let (_, metrics) = http_get(b.http_addr, "/metrics").await.unwrap();
    assert!(
        metrics.contains(&format!(
            "meshpilot_config_source_synced{{source=\"xds://{secure}\"}} 1"
        )),
        "{metrics}"
    );
    assert_eq!(envoy.rejected_updates().await, 0);

    // A client that has not proven itself gets nothing of A's config.
    let mut plain = AdsClient::connect(a.xds_addr).await.unwrap();
    plain.request(DiscoveryRequest {
        node: Some(node(
            "sidecar~10.1.1.9~x.istio-system~istio-system.svc.cluster.local",
            &[("GENERATOR", "api")],
        )),
        type_url: "networking.istio.io/v1/ServiceEntry".into(),
        ..Default::default()
    });
    let refused = plain.error(BOUND).await;
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
}

/// The merged services meshpilot reports (`pilot_services`).
async fn services(mp: &meshpilot::app::Running) -> usize {
    let (_, metrics) = http_get(mp.http_addr, "/metrics").await.unwrap();
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("pilot_services "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn a_registry_feeds_ten_thousand_service_entries() {
    const ENTRIES: usize = 10_000;
    let port = free_port();
    let control = tempfile::NamedTempFile::new().unwrap();
    let _registry = Peer::start(
        "mcp_registry.py",
        &[
            &port.port().to_string(),
            &ENTRIES.to_string(),
            control.path().to_str().unwrap(),
        ],
    );
    let mesh = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        mesh.path(),
        format!(
            "configSources:\n- address: xds://{port}\n  subscribedResources: [SERVICE_REGISTRY]\n"
        ),
    )
    .unwrap();
    let clusters = copy_tree(Path::new(EXAMPLE));
    let started = std::time::Instant::now();
    // Readiness waits for the source's first sync.
    let mp = start_meshpilot_unready(&[
        "--config-dir",
        clusters.path().to_str().unwrap(),
        "--mesh-config",
        mesh.path().to_str().unwrap(),
    ])
    .await;
    // One response holds the whole set: past ENTRIES services, every entry is in.
    let total = wait_for(
        "every entry a service",
        Duration::from_secs(120),
        || async {
            let total = services(&mp).await;
            (total >= ENTRIES).then_some(total)
        },
    )
    .await;
    let own = total - ENTRIES;
    eprintln!(
        "{ENTRIES} ServiceEntries from an MCP registry served in {:?}",
        started.elapsed()
    );
    let endpoints = get_json(mp.http_addr, "/debug/endpointShardz").await;
    let last = &endpoints["svc-9999.registry.example"];
    assert!(last.to_string().contains("10.100.39.15"), "{last}");

    // The registry's set shrinks: what it no longer holds goes.
    std::fs::write(control.path(), "10").unwrap();
    wait_for("the set shrunk", BOUND, || async {
        (services(&mp).await == 10 + own).then_some(())
    })
    .await;
    let configz = get_json(mp.http_addr, "/debug/configz").await;
    assert_eq!(source_status(&configz)["objects"], 10, "{configz}");
}

/// A registry that knows ServiceEntries at `v1alpha3` only (as Nacos and istiod before 1.22),
/// answering the other versions empty: its entries are read.
#[tokio::test]
async fn a_registry_knowing_only_v1alpha3_is_read() {
    let port = free_port();
    let _registry = Peer::start(
        "mcp_registry.py",
        &[&port.port().to_string(), "3", "", "v1alpha3"],
    );
    let mesh = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        mesh.path(),
        format!(
            "configSources:\n- address: xds://{port}\n  subscribedResources: [SERVICE_REGISTRY]\n"
        ),
    )
    .unwrap();
    let clusters = copy_tree(Path::new(EXAMPLE));
    let mp = start_meshpilot_unready(&[
        "--config-dir",
        clusters.path().to_str().unwrap(),
        "--mesh-config",
        mesh.path().to_str().unwrap(),
    ])
    .await;
    let configz = wait_for("the registry's entries", BOUND, || async {
        let configz = get_json(mp.http_addr, "/debug/configz").await;
        (source_status(&configz)["objects"] == 3).then_some(configz)
    })
    .await;
    assert_eq!(source_status(&configz)["status"], "synced", "{configz}");
    let endpoints = get_json(mp.http_addr, "/debug/endpointShardz").await;
    let entry = &endpoints["svc-2.registry.example"];
    assert!(entry.to_string().contains("10.100.0.2"), "{entry}");
}

/// `fs://` names the one directory config is read from (the config directory's own files are not
/// read then); an address of another form, or `k8s://` without a config cluster, is refused at
/// start, naming it.
#[tokio::test]
async fn config_sources_name_where_config_comes_from() {
    let clusters = copy_tree(Path::new(EXAMPLE));
    let own = clusters.path().join("config");
    std::fs::create_dir_all(&own).unwrap();
    std::fs::write(own.join("own.yaml"), CONFIG.replace("payments", "own")).unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    std::fs::write(elsewhere.path().join("listed.yaml"), CONFIG).unwrap();
    let mesh = tempfile::NamedTempFile::new().unwrap();
    let write_mesh = |address: &str| {
        std::fs::write(
            mesh.path(),
            format!("configSources:\n- address: {address}\n"),
        )
        .unwrap();
    };
    write_mesh(&format!("fs://{}", elsewhere.path().display()));
    let flags = ["--mesh-config", mesh.path().to_str().unwrap()];
    let mp = start_meshpilot(clusters.path(), &flags).await;
    let configz = get_json(mp.http_addr, "/debug/configz").await;
    let names: Vec<&str> = configz
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|o| o["metadata"]["name"].as_str())
        .collect();
    assert!(names.contains(&"payments"), "{names:?}");
    assert!(!names.contains(&"own"), "{names:?}");
    drop(mp);

    let dir = clusters.path().to_str().unwrap();
    for (address, expected) in [
        ("http://registry:15010", "a config source is xds://"),
        ("k8s://", "give --kubeconfig or --in-cluster"),
    ] {
        write_mesh(address);
        let error = try_start_meshpilot(&["--config-dir", dir, flags[0], flags[1]])
            .await
            .err()
            .expect("refused");
        assert!(error.to_string().contains(expected), "{address}: {error}");
    }
}
