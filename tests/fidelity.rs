//! What meshpilot sends each proxy of a mesh, against what istiod 1.14.6 sent it
//! (tests/fixtures/fidelity, the corpus of issue 49): each scenario's objects in the test API
//! server, meshpilot reading them as a config cluster, each proxy's node asking over ADS. Every
//! difference must be one docs/fidelity.md accepts, with its reason.

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use meshpilot::compare::{compare, fetch_live, read_dump, read_node, Accepted, Difference};
use serde_json::{json, Value};

const BOUND: Duration = Duration::from_secs(20);

fn fixture(scenario: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/fidelity")
        .join(scenario)
}

fn accepted() -> Accepted {
    let doc = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/fidelity.md");
    Accepted::parse(&std::fs::read_to_string(doc).unwrap()).expect("the accepted list parses")
}

fn yaml_docs(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap();
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| serde::Deserialize::deserialize(doc).unwrap())
        .filter(|v: &Value| !v.is_null())
        .collect()
}

/// The scenario's objects as the real API server held them: Pods with the status the corpus set
/// through the status subresource, the slices its EndpointSlice controller wrote, and the
/// API server's own `default/kubernetes` Service.
fn load(api: &test_apiserver::TestApiServer, dir: &Path) {
    let status = yaml_docs(&dir.join("pods-status.yaml"));
    let status = status
        .first()
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    api.apply(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "default"}}));
    api.apply(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "kubernetes", "namespace": "default"},
        "spec": {"clusterIP": "10.96.0.1", "ports": [{"name": "https", "port": 443, "targetPort": 6443}]},
    }));
    for mut object in yaml_docs(&dir.join("mesh.yaml")) {
        if object["kind"] == "Pod" {
            let (ns, name) = (
                &object["metadata"]["namespace"],
                &object["metadata"]["name"],
            );
            if let Some(s) = status
                .iter()
                .find(|s| s["namespace"] == *ns && s["pod"] == *name)
            {
                let ready = if s["ready"] == true { "True" } else { "False" };
                object["status"] = json!({
                    "phase": "Running",
                    "podIP": s["podIP"],
                    "podIPs": [{"ip": s["podIP"]}],
                    "conditions": [
                        {"type": "Ready", "status": ready},
                        {"type": "ContainersReady", "status": ready},
                    ],
                });
            }
        }
        api.apply(object);
    }
    for slice in yaml_docs(&dir.join("endpointslices.yaml")) {
        api.apply(slice);
    }
}

/// The differences not accepted, for one proxy, once meshpilot's answer stops changing them.
async fn unaccepted(xds: SocketAddr, proxy: &Path, accepted: &Accepted) -> Vec<Difference> {
    let node = read_node(&proxy.join("node.json")).unwrap();
    let istiod = read_dump(proxy).unwrap();
    let mut last = Vec::new();
    let deadline = tokio::time::Instant::now() + BOUND;
    while tokio::time::Instant::now() < deadline {
        let ours = fetch_live(&xds.to_string(), &node).await.unwrap();
        last = compare(&istiod, &ours)
            .into_iter()
            .filter(|d| !accepted.covers(d))
            .collect();
        if last.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    last
}

async fn scenario(name: &str) {
    let dir = fixture(name);
    let api = test_apiserver::TestApiServer::start().await;
    load(&api, &dir);
    let work = tempfile::tempdir().unwrap();
    // Every object comes from the API server: no file clusters, no file config.
    std::fs::create_dir_all(work.path().join("clusters")).unwrap();
    let kubeconfig = work.path().join("kubeconfig");
    std::fs::write(&kubeconfig, api.kubeconfig(api.admin_token())).unwrap();
    let (kubeconfig, config_dir, mesh) = (
        kubeconfig.to_str().unwrap().to_string(),
        work.path().to_str().unwrap().to_string(),
        dir.join("mesh-config.yaml").to_str().unwrap().to_string(),
    );
    let mp = start_meshpilot_with(&[
        "--kubeconfig",
        &kubeconfig,
        "--cluster-id",
        "c1",
        "--config-dir",
        &config_dir,
        "--mesh-config",
        &mesh,
    ])
    .await;
    let xds = SocketAddr::from(([127, 0, 0, 1], mp.xds_addr.port()));
    let accepted = accepted();
    let mut report = String::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let proxy = entry.unwrap().path();
        if !proxy.join("node.json").is_file() {
            continue;
        }
        for d in unaccepted(xds, &proxy, &accepted).await {
            let side =
                |v: &Option<Value>| v.as_ref().map_or("<absent>".to_string(), Value::to_string);
            report.push_str(&format!(
                "{}: {} {} {}\n  istiod:    {:.300}\n  meshpilot: {:.300}\n",
                proxy.file_name().unwrap().to_string_lossy(),
                d.type_name,
                d.resource,
                d.path,
                side(&d.left),
                side(&d.right),
            ));
        }
    }
    assert!(
        report.is_empty(),
        "differences docs/fidelity.md does not accept:\n{report}"
    );
}

#[tokio::test]
async fn bookinfo_with_sidecars() {
    scenario("bookinfo-sidecar").await;
}

#[tokio::test]
async fn service_entries_beside_kubernetes_services() {
    scenario("external-services").await;
}

#[tokio::test]
async fn an_ingress_gateway() {
    scenario("ingress-gateway").await;
}

#[tokio::test]
async fn locality_outlier_detection_and_consistent_hash() {
    scenario("locality-outlier").await;
}

#[tokio::test]
async fn mutual_tls_authorization_and_jwt() {
    scenario("security").await;
}

#[tokio::test]
async fn sidecar_scoping_headless_and_multi_port_services() {
    scenario("sidecar-scope").await;
}
