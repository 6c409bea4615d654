//! The fidelity corpus (tests/fixtures/fidelity): a scenario's objects loaded into the test API
//! server as the real API server held them, and meshpilot serving them.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use test_apiserver::TestApiServer;

/// A scenario's directory.
pub fn fixture(scenario: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/fidelity")
        .join(scenario)
}

/// A scenario's proxies: its directories holding a `node.json`.
pub fn proxies(scenario: &str) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(fixture(scenario))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("node.json").is_file())
        .collect();
    dirs.sort();
    dirs
}

pub fn yaml_docs(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap();
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| serde::Deserialize::deserialize(doc).unwrap())
        .filter(|v: &Value| !v.is_null())
        .collect()
}

/// The scenario's objects as the real API server held them: Pods with the status the corpus set
/// through the status subresource, the slices its EndpointSlice controller wrote, and the
/// API server's own `default/kubernetes` Service.
pub fn load(api: &TestApiServer, dir: &Path) {
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

/// Starts meshpilot on a scenario's objects; the returned guards keep it and its API server up.
pub async fn serving(name: &str) -> (TestApiServer, tempfile::TempDir, meshpilot::app::Running) {
    let dir = fixture(name);
    let api = TestApiServer::start().await;
    load(&api, &dir);
    let work = tempfile::tempdir().unwrap();
    // Every object comes from the API server: no file clusters, no file config.
    std::fs::create_dir_all(work.path().join("clusters")).unwrap();
    let kubeconfig = work.path().join("kubeconfig");
    std::fs::write(&kubeconfig, api.kubeconfig(api.admin_token())).unwrap();
    let mesh = dir.join("mesh-config.yaml");
    let mp = super::start_meshpilot_with(&[
        "--kubeconfig",
        kubeconfig.to_str().unwrap(),
        "--cluster-id",
        "c1",
        "--config-dir",
        work.path().to_str().unwrap(),
        "--mesh-config",
        mesh.to_str().unwrap(),
    ])
    .await;
    (api, work, mp)
}
