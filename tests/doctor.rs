//! End to end: `meshpilot doctor` against a config cluster and two remote clusters (test API
//! servers onboarded by `istio/multiCluster` Secrets), east-west gateways as real listeners.

use std::time::Duration;

use serde_json::{json, Value};
use test_apiserver::{TestApiServer, User};
use tokio::net::TcpListener;

const BOUND: Duration = Duration::from_secs(30);
const READER: &str = "system:serviceaccount:istio-system:istio-reader-service-account";
const EASTWEST: &str = "istio-eastwestgateway";

/// A self-signed root certificate (PEM).
fn root(name: &str) -> String {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, name);
    params.self_signed(&key).unwrap().pem()
}

/// The system namespace on `network`, and the root ConfigMap.
fn system(api: &TestApiServer, network: &str, root_pem: &str) {
    api.apply(json!({"apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": "istio-system", "labels": {"topology.istio.io/network": network}}}));
    publish_root(api, root_pem);
}

fn publish_root(api: &TestApiServer, root_pem: &str) {
    api.apply(json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "istio-ca-root-cert", "namespace": "istio-system"},
        "data": {"root-cert.pem": root_pem}}));
}

/// An `istio/multiCluster` Secret holding one (cluster id, kubeconfig) entry.
fn remote_secret(api: &TestApiServer, name: &str, id: &str, kubeconfig: &str) {
    api.apply(json!({"apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": name, "namespace": "istio-system", "labels": {"istio/multiCluster": "true"}},
        "stringData": {id: kubeconfig}}));
}

/// A reader kubeconfig for a remote cluster, as `meshpilot remote-secret` would make.
fn reader_kubeconfig(api: &TestApiServer, token: &str) -> String {
    api.add_token(
        token,
        User::service_account("istio-system", "istio-reader-service-account"),
    );
    api.kubeconfig(token)
}

/// A healthy mesh: `primary` (config cluster) and `east` on net1, whose gateway is an address in
/// meshNetworks; `west` on net2, whose gateway is its LoadBalancer Service; one root everywhere.
struct Mesh {
    config: TestApiServer,
    east: TestApiServer,
    west: TestApiServer,
    dir: tempfile::TempDir,
    _gateways: [TcpListener; 2],
}

impl Mesh {
    async fn new() -> Self {
        let (config, east, west) = (
            TestApiServer::start().await,
            TestApiServer::start().await,
            TestApiServer::start().await,
        );
        let mesh_root = root("mesh root");
        system(&config, "net1", &mesh_root);
        config.apply(json!({"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": "istio-ca-secret", "namespace": "istio-system"},
            "stringData": {"ca-cert.pem": mesh_root}}));
        system(&east, "net1", &mesh_root);
        system(&west, "net2", &mesh_root);
        let east_kubeconfig = reader_kubeconfig(&east, "east-reader");
        remote_secret(&config, "remote-east", "east", &east_kubeconfig);
        remote_secret(
            &config,
            "remote-west",
            "west",
            &reader_kubeconfig(&west, "west-reader"),
        );
        let gw1 = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let gw2 = TcpListener::bind("127.0.0.1:0").await.unwrap();
        west.apply(json!({"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": EASTWEST, "namespace": "istio-system"},
            "spec": {"type": "LoadBalancer", "ports": [{"name": "tls", "port": 15443}]},
            "status": {"loadBalancer": {"ingress": [{"ip": "127.0.0.1"}]}}}));
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("kubeconfig"),
            config.kubeconfig(config.admin_token()),
        )
        .unwrap();
        std::fs::write(
            dir.path().join("networks.yaml"),
            format!(
                "networks:
  net1:
    endpoints: [{{fromRegistry: primary}}, {{fromRegistry: east}}]
    gateways: [{{address: 127.0.0.1, port: {}}}]
  net2:
    endpoints: [{{fromRegistry: west}}]
    gateways: [{{registryServiceName: {EASTWEST}.istio-system.svc.cluster.local, port: {}}}]
",
                gw1.local_addr().unwrap().port(),
                gw2.local_addr().unwrap().port()
            ),
        )
        .unwrap();
        Self {
            config,
            east,
            west,
            dir,
            _gateways: [gw1, gw2],
        }
    }

    /// Runs `meshpilot doctor` on this mesh; (success, stdout, stderr).
    async fn doctor(&self, extra: &[&str]) -> (bool, String, String) {
        let run = tokio::process::Command::new(env!("CARGO_BIN_EXE_meshpilot"))
            .arg("doctor")
            .arg("--kubeconfig")
            .arg(self.dir.path().join("kubeconfig"))
            .arg("--mesh-networks")
            .arg(self.dir.path().join("networks.yaml"))
            .args(["--cluster-id", "primary", "--timeout", "2s"])
            .args(extra)
            .kill_on_drop(true)
            .output();
        let out = tokio::time::timeout(BOUND, run)
            .await
            .expect("doctor finished")
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    }

    async fn doctor_json(&self) -> (bool, Value) {
        let (success, stdout, stderr) = self.doctor(&["-o", "json"]).await;
        let report = serde_json::from_str(&stdout)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}\n{stderr}"));
        (success, report)
    }
}

/// The checks of the cluster with this id (and secret, when two share the id).
fn checks<'a>(report: &'a Value, id: &str) -> Vec<&'a Value> {
    report["clusters"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["id"] == id)
        .flat_map(|c| c["checks"].as_array().unwrap())
        .collect()
}

fn with_status<'a>(report: &'a Value, id: &str, status: &str) -> Vec<&'a Value> {
    checks(report, id)
        .into_iter()
        .filter(|c| c["status"] == status)
        .collect()
}

#[tokio::test]
async fn a_healthy_mesh_passes_every_check() {
    let mesh = Mesh::new().await;
    let (success, report) = mesh.doctor_json().await;
    assert!(success, "{report:#}");
    assert_eq!(report["failures"], 0, "{report:#}");
    assert_eq!(report["warnings"], 0, "{report:#}");
    let clusters = report["clusters"].as_array().unwrap();
    let ids: Vec<(&str, &Value)> = clusters
        .iter()
        .map(|c| (c["id"].as_str().unwrap(), &c["secret"]))
        .collect();
    assert_eq!(
        ids,
        [
            ("primary", &Value::Null),
            ("east", &json!("istio-system/remote-east")),
            ("west", &json!("istio-system/remote-west")),
        ]
    );
    for id in ["primary", "east", "west"] {
        let names: Vec<&str> = checks(&report, id)
            .iter()
            .map(|c| c["name"].as_str().unwrap())
            .collect();
        for name in [
            "kubeconfig",
            "api server",
            "clock",
            "access",
            "network",
            "gateways",
            "root",
        ] {
            assert!(names.contains(&name), "{id} lacks {name}: {report:#}");
        }
    }
    let gateway = |id: &str| {
        checks(&report, id)
            .into_iter()
            .find(|c| c["name"] == "gateways")
            .unwrap()["message"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert!(
        gateway("east").starts_with("network net1: gateway 127.0.0.1:"),
        "{report:#}"
    );
    assert!(gateway("west").contains("in cluster west"), "{report:#}");
    let root = checks(&report, "west")
        .into_iter()
        .find(|c| c["name"] == "root")
        .unwrap()["message"]
        .clone();
    assert!(root.as_str().unwrap().contains("CN=mesh root"), "{root}");
}

#[tokio::test]
async fn a_reader_denied_watch_on_endpointslices_is_named() {
    let mesh = Mesh::new().await;
    mesh.east.deny(READER, "watch", "endpointslices");
    let (success, text, stderr) = mesh.doctor(&[]).await;
    assert!(!success, "{text}\n{stderr}");
    let failures: Vec<&str> = text.lines().filter(|l| l.starts_with("FAIL")).collect();
    assert_eq!(
        failures,
        ["FAIL  cluster east (secret istio-system/remote-east): access: reader cannot watch endpointslices.discovery.k8s.io (cluster-wide): denied by the test API server: system:serviceaccount:istio-system:istio-reader-service-account may not watch endpointslices"],
        "{text}"
    );
    assert_eq!(
        text.lines().last(),
        Some("summary: 3 clusters checked, 1 failure, 0 warnings, 23 ok"),
        "{text}"
    );
}

#[tokio::test]
async fn an_unreachable_remote_is_named_and_the_others_still_checked() {
    let mesh = Mesh::new().await;
    mesh.west.stop();
    let (success, report) = mesh.doctor_json().await;
    assert!(!success);
    let failed = with_status(&report, "west", "fail");
    assert_eq!(failed.len(), 1, "{report:#}");
    assert_eq!(failed[0]["name"], "api server");
    assert!(
        failed[0]["message"]
            .as_str()
            .unwrap()
            .starts_with("unreachable: "),
        "{report:#}"
    );
    for id in ["primary", "east"] {
        assert!(with_status(&report, id, "fail").is_empty(), "{report:#}");
        assert!(with_status(&report, id, "warn").is_empty(), "{report:#}");
        assert!(checks(&report, id).iter().any(|c| c["name"] == "access"));
    }
    assert_eq!(report["failures"], 1);
}

#[tokio::test]
async fn a_hung_remote_times_out_without_delaying_the_rest() {
    let mesh = Mesh::new().await;
    mesh.east.set_hang(true);
    // Every request is bounded by --timeout 2s (the failure says so); the rest ran meanwhile.
    let (success, report) = mesh.doctor_json().await;
    assert!(!success);
    let failed = with_status(&report, "east", "fail");
    assert_eq!(failed.len(), 1, "{report:#}");
    assert_eq!(
        failed[0]["message"], "unreachable: no answer within 2s",
        "{report:#}"
    );
    assert!(
        with_status(&report, "west", "fail").is_empty(),
        "{report:#}"
    );
    assert!(
        with_status(&report, "primary", "fail").is_empty(),
        "{report:#}"
    );
    mesh.east.set_hang(false);
}

#[tokio::test]
async fn a_duplicate_cluster_id_names_both_secrets() {
    let mesh = Mesh::new().await;
    remote_secret(
        &mesh.config,
        "remote-east-again",
        "east",
        &reader_kubeconfig(&mesh.east, "east-reader-2"),
    );
    let (success, report) = mesh.doctor_json().await;
    assert!(!success);
    let failed = with_status(&report, "east", "fail");
    assert_eq!(failed.len(), 2, "{report:#}");
    for check in failed {
        let message = check["message"].as_str().unwrap();
        assert_eq!(check["name"], "cluster id");
        assert!(
            message.contains("duplicate cluster id \"east\"")
                && message.contains(
                    "in Secret istio-system/remote-east and Secret istio-system/remote-east-again;"
                )
                && message.ends_with("on a fresh start, Secret istio-system/remote-east's)"),
            "{message}"
        );
    }
    assert!(
        with_status(&report, "west", "fail").is_empty(),
        "{report:#}"
    );
}

#[tokio::test]
async fn a_cluster_trusting_another_root_is_foreign() {
    let mesh = Mesh::new().await;
    publish_root(&mesh.west, &root("west's own root"));
    let (success, text, _) = mesh.doctor(&[]).await;
    assert!(!success);
    let failures: Vec<&str> = text.lines().filter(|l| l.starts_with("FAIL")).collect();
    assert_eq!(failures.len(), 1, "{text}");
    assert!(
        failures[0].starts_with("FAIL  cluster west (secret istio-system/remote-west): root: foreign root: ConfigMap istio-system/istio-ca-root-cert holds CN=west's own root (sha256 ")
            && failures[0].contains("not the mesh root CN=mesh root")
            && failures[0].contains("from Secret istio-system/istio-ca-secret"),
        "{text}"
    );
}

#[tokio::test]
async fn a_clock_far_ahead_fails_and_a_missing_root_only_warns() {
    let mesh = Mesh::new().await;
    mesh.east.set_clock_offset(600);
    mesh.west
        .delete("ConfigMap", "istio-system", "istio-ca-root-cert");
    let (success, report) = mesh.doctor_json().await;
    assert!(!success);
    let failed = with_status(&report, "east", "fail");
    assert_eq!(failed.len(), 1, "{report:#}");
    assert_eq!(failed[0]["name"], "clock");
    assert!(
        failed[0]["message"]
            .as_str()
            .unwrap()
            .contains("ahead of this machine's"),
        "{report:#}"
    );
    let warned = with_status(&report, "west", "warn");
    assert_eq!(warned.len(), 1, "{report:#}");
    assert_eq!(warned[0]["name"], "root");
    assert!(
        with_status(&report, "west", "fail").is_empty(),
        "{report:#}"
    );
}

#[tokio::test]
async fn a_refused_kubeconfig_gives_the_controllers_reason() {
    let mesh = Mesh::new().await;
    let exec = mesh.east.kubeconfig("unused").replace(
        "token: unused",
        "exec: {command: /bin/sh, apiVersion: client.authentication.k8s.io/v1}",
    );
    remote_secret(&mesh.config, "remote-north", "north", &exec);
    let (success, report) = mesh.doctor_json().await;
    assert!(!success);
    let failed = with_status(&report, "north", "fail");
    assert_eq!(failed.len(), 1, "{report:#}");
    assert_eq!(failed[0]["name"], "kubeconfig");
    assert!(
        failed[0]["message"]
            .as_str()
            .unwrap()
            .contains("uses an exec plugin, which is not allowed"),
        "{report:#}"
    );
    assert!(
        with_status(&report, "east", "fail").is_empty(),
        "{report:#}"
    );
}

#[tokio::test]
async fn an_unreachable_config_cluster_is_reported() {
    let mesh = Mesh::new().await;
    mesh.config.stop();
    let (success, report) = mesh.doctor_json().await;
    assert!(!success);
    let clusters = report["clusters"].as_array().unwrap();
    assert_eq!(clusters.len(), 1, "{report:#}");
    let failed = with_status(&report, "primary", "fail");
    assert_eq!(failed.len(), 1, "{report:#}");
    assert_eq!(failed[0]["name"], "api server");
}

/// The remotes enforce RBAC for the reader, which holds only the role meshpilot renders for it:
/// every check still runs, the published root included.
#[tokio::test]
async fn the_reader_s_own_rbac_is_enough_for_every_check() {
    use meshpilot::install::rbac::{reader_binding, reader_role, READER_ACCOUNT};
    let mesh = Mesh::new().await;
    for remote in [&mesh.east, &mesh.west] {
        remote.enforce_rbac(READER);
        remote.apply(serde_json::to_value(reader_role()).unwrap());
        remote.apply(serde_json::to_value(reader_binding("istio-system", READER_ACCOUNT)).unwrap());
    }
    let (success, report) = mesh.doctor_json().await;
    assert!(success, "{report:#}");
    assert_eq!(report["warnings"], 0, "{report:#}");
    for id in ["east", "west"] {
        let root = checks(&report, id)
            .into_iter()
            .find(|c| c["name"] == "root")
            .unwrap()["message"]
            .clone();
        assert!(
            root.as_str().unwrap().contains("CN=mesh root"),
            "{id}: {root}"
        );
    }
}
