//! What a sidecar reaches, with real traffic: an application behind an Istio-style captured sidecar
//! calls hosts outside the mesh and mesh services. Mesh config `outboundTrafficPolicy` ALLOW_ANY
//! passes unknown hosts through; after the mesh config file changes to REGISTRY_ONLY, the same calls
//! end in the black hole (502 on an HTTP port the mesh uses, a reset elsewhere). A Sidecar resource
//! scoping the client's namespace makes the services outside its egress hosts unknown too, under
//! its own policy. Needs root (network namespaces, iptables).

mod common;

use std::time::Duration;

use common::netns::{client_sidecar, link, Netns};
use common::*;

const BOUND: Duration = Duration::from_secs(30);
const APP_UID: &str = "1000";
const OUTSIDE: &str = "10.216.3.2";

/// A mesh service on port 8080 (so that port has an HTTP listener) and the client's own pod.
const MESH: &str = "
apiVersion: v1
kind: Service
metadata: {name: echo, namespace: default}
spec: {clusterIP: 10.96.66.66, ports: [{name: http, port: 8080}]}
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: default, labels: {app: client}}
spec: {serviceAccountName: client, containers: []}
status: {podIP: 10.216.3.1}
";

/// The application's `curl` to `url` (as its own user, so the sidecar captures it): the HTTP status,
/// or 0 when the connection failed.
fn curl(client: &Netns, url: &str) -> u16 {
    client.curl(Some(APP_UID), &[url])
}

/// The client's and the outside world's namespaces (`10.<net>.…`), the application's traffic
/// captured; meshpilot on `cluster` (a file cluster `c1`), with `mesh.yaml` in its directory as
/// `--mesh-config` when a mesh config is given; the client's Envoy.
struct Setup {
    client: Netns,
    outside: Netns,
    dir: tempfile::TempDir,
    mp: meshpilot::app::Running,
    envoy: Envoy,
}

impl Setup {
    async fn start(prefix: &str, net: u8, cluster: &str, mesh: Option<&str>) -> Self {
        let tag = std::process::id() % 100_000;
        let client = Netns::create(&format!("{prefix}c{tag}"));
        let mut outside = Netns::create(&format!("{prefix}o{tag}"));
        let host_ip = format!("10.{net}.1.1");
        let client_ip = format!("10.{net}.1.2");
        link(
            None,
            &format!("{prefix}c{tag}h"),
            &format!("{host_ip}/30"),
            &client,
            "ctl",
            &format!("{client_ip}/30"),
        );
        link(
            Some(&client),
            "data",
            &format!("10.{net}.3.1/24"),
            &outside,
            "data",
            &format!("10.{net}.3.2/24"),
        );
        client.capture_outbound(APP_UID);
        outside.serve_http_echo(8080);
        outside.serve_http_echo(9999);

        let dir = tempfile::tempdir().unwrap();
        let cluster_dir = dir.path().join("clusters/c1");
        std::fs::create_dir_all(&cluster_dir).unwrap();
        std::fs::create_dir_all(dir.path().join("config")).unwrap();
        std::fs::write(cluster_dir.join("mesh.yaml"), cluster).unwrap();
        let mesh_config = dir.path().join("mesh.yaml");
        let mut args = vec!["--xds-addr", "0.0.0.0:0", "--debounce-after", "0s"];
        if let Some(mesh) = mesh {
            std::fs::write(&mesh_config, mesh).unwrap();
            args.extend(["--mesh-config", mesh_config.to_str().unwrap()]);
        }
        let mp = start_meshpilot(dir.path(), &args).await;
        let workload_ip = format!("10.{net}.3.1");
        let envoy = client_sidecar(&mp, &client, &workload_ip, &client_ip, &host_ip).await;
        Self {
            client,
            outside,
            dir,
            mp,
            envoy,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_destinations_follow_the_outbound_traffic_policy() {
    let _ports = sidecar_ports().await;
    let allow_any = "outboundTrafficPolicy: {mode: ALLOW_ANY}\n";
    let setup = Setup::start("mpo", 216, MESH, Some(allow_any)).await;
    let (client, mp, envoy) = (&setup.client, &setup.mp, &setup.envoy);
    let mesh_config = setup.dir.path().join("mesh.yaml");

    let http_port = format!("http://{OUTSIDE}:8080/");
    let other_port = format!("http://{OUTSIDE}:9999/");
    wait_for("ALLOW_ANY: both ports pass through", BOUND, || {
        let ok = curl(client, &http_port) == 200 && curl(client, &other_port) == 200;
        async move { ok.then_some(()) }
    })
    .await;
    let passed = envoy
        .counter("cluster.PassthroughCluster.upstream_cx_total")
        .await;
    assert!(
        passed >= 2,
        "{passed} connections through PassthroughCluster"
    );

    write_atomic(
        &mesh_config,
        "outboundTrafficPolicy: {mode: REGISTRY_ONLY}\n",
    );
    wait_for("REGISTRY_ONLY: 502 on the mesh's HTTP port", BOUND, || {
        let status = curl(client, &http_port);
        async move { (status == 502).then_some(()) }
    })
    .await;
    wait_for("REGISTRY_ONLY: no connection elsewhere", BOUND, || {
        let status = curl(client, &other_port);
        async move { (status == 0).then_some(()) }
    })
    .await;
    assert!(
        envoy
            .counter("cluster.BlackHoleCluster.upstream_cx_none_healthy")
            .await
            >= 1,
        "the reset came from the black hole"
    );
    assert_eq!(envoy.rejected_updates().await, 0);
    let mesh = get_json(mp.http_addr, "/debug/mesh").await;
    assert_eq!(
        mesh["meshConfig"]["outboundTrafficPolicy"]["mode"],
        "REGISTRY_ONLY"
    );
}

/// Two mesh services answering on port 8080: `echo` in the client's namespace, `ledger` in `bank`.
const SERVICES: &str = "
apiVersion: v1
kind: Service
metadata: {name: echo, namespace: default}
spec: {clusterIP: 10.96.66.66, ports: [{name: http, port: 8080}]}
---
apiVersion: v1
kind: Service
metadata: {name: ledger, namespace: bank}
spec: {clusterIP: 10.96.77.77, ports: [{name: http, port: 8080}]}
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: default, labels: {app: client}}
spec: {serviceAccountName: client, containers: []}
status: {podIP: 10.218.3.1}
---
apiVersion: v1
kind: Pod
metadata: {name: echo, namespace: default, labels: {app: echo}}
spec: {serviceAccountName: echo, containers: []}
status: {podIP: 10.218.3.2}
---
apiVersion: v1
kind: Pod
metadata: {name: ledger, namespace: bank, labels: {app: ledger}}
spec: {serviceAccountName: ledger, containers: []}
status: {podIP: 10.218.3.3}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: echo-1, namespace: default, labels: {kubernetes.io/service-name: echo}}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints:
- {addresses: [10.218.3.2], conditions: {ready: true}, targetRef: {kind: Pod, name: echo, namespace: default}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: ledger-1, namespace: bank, labels: {kubernetes.io/service-name: ledger}}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints:
- {addresses: [10.218.3.3], conditions: {ready: true}, targetRef: {kind: Pod, name: ledger, namespace: bank}}
";

const ECHO: &str = "outbound|8080||echo.default.svc.cluster.local";
const LEDGER: &str = "outbound|8080||ledger.bank.svc.cluster.local";

const SCOPED: &str = "
apiVersion: networking.istio.io/v1
kind: Sidecar
metadata: {name: default, namespace: default}
spec:
  egress: [{hosts: [./*]}]
  outboundTrafficPolicy: {mode: REGISTRY_ONLY}
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidecar_resource_scopes_what_the_namespace_reaches() {
    let _ports = sidecar_ports().await;
    let setup = Setup::start("mps", 218, SERVICES, None).await;
    let (client, envoy) = (&setup.client, &setup.envoy);
    setup
        .outside
        .run("ip", &["addr", "add", "10.218.3.3/24", "dev", "data"]);
    // The VIPs are routed to the link, so the application's connections get as far as the capture.
    client.run("ip", &["route", "add", "10.96.0.0/16", "dev", "data"]);
    let echo = "http://10.96.66.66:8080/";
    let ledger = "http://10.96.77.77:8080/";
    wait_for("both services in the sidecar", BOUND, || async {
        let ready = envoy.endpoints(ECHO).await == ["10.218.3.2:8080"]
            && envoy.endpoints(LEDGER).await == ["10.218.3.3:8080"];
        ready.then_some(())
    })
    .await;
    wait_for("both services answer", BOUND, || {
        let ok = curl(client, echo) == 200 && curl(client, ledger) == 200;
        async move { ok.then_some(()) }
    })
    .await;
    assert!(envoy
        .stat(&format!("cluster.{LEDGER}.upstream_cx_total"))
        .await
        .is_some());

    // Scoped to its own namespace, under REGISTRY_ONLY: the ledger is an unknown host now.
    let sidecar = setup.dir.path().join("config/sidecar.yaml");
    write_atomic(&sidecar, SCOPED);
    wait_for("the ledger blocked (502)", BOUND, || {
        let status = curl(client, ledger);
        async move { (status == 502).then_some(()) }
    })
    .await;
    assert_eq!(
        curl(client, echo),
        200,
        "the namespace's own service still answers"
    );
    wait_for("the ledger's cluster gone from Envoy", BOUND, || {
        let envoy = &envoy;
        async move {
            let gone = envoy
                .stat(&format!("cluster.{LEDGER}.upstream_cx_total"))
                .await
                .is_none();
            gone.then_some(())
        }
    })
    .await;

    // Without the Sidecar the whole mesh is back.
    std::fs::remove_file(&sidecar).unwrap();
    wait_for("the ledger answers again", BOUND, || {
        let status = curl(client, ledger);
        async move { (status == 200).then_some(()) }
    })
    .await;
    assert_eq!(envoy.rejected_updates().await, 0);
}
