//! What meshpilot sends each proxy of a mesh, against what istiod 1.14.6 sent it
//! (tests/fixtures/fidelity, the corpus of issue 49): each scenario's objects in the test API
//! server, meshpilot reading them as a config cluster, each proxy's node asking over ADS. Every
//! difference must be one docs/fidelity.md accepts, with its reason; every scenario must compare
//! some proxy; and every accepted line must be needed by some difference, so the list cannot
//! outgrow what it explains.

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use meshpilot::compare::{
    compare, fetch_live, is_router, read_dump, read_node, Accepted, Difference,
};
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

/// What comparing one proxy found: the differences not accepted, once meshpilot's answer stops
/// changing them, and the accepted lines (by index) the others needed.
struct Found {
    unaccepted: Vec<Difference>,
    lines_used: Vec<usize>,
}

async fn compared(xds: SocketAddr, proxy: &Path, accepted: &Accepted) -> Found {
    let node = read_node(&proxy.join("node.json")).unwrap();
    let istiod = read_dump(proxy).unwrap();
    let deadline = tokio::time::Instant::now() + BOUND;
    loop {
        let ours = fetch_live(&xds.to_string(), &node).await.unwrap();
        let mut found = Found {
            unaccepted: Vec::new(),
            lines_used: Vec::new(),
        };
        for d in compare(&istiod, &ours, is_router(&node)) {
            match accepted.covering(&d) {
                Some(line) => found.lines_used.push(line),
                None => found.unaccepted.push(d),
            }
        }
        if found.unaccepted.is_empty() || tokio::time::Instant::now() >= deadline {
            return found;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Runs one scenario: its proxies' differences not accepted, written into `report`; the accepted
/// lines its differences needed, marked in `used`.
async fn scenario(name: &str, accepted: &Accepted, used: &mut [bool], report: &mut String) {
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
    let mut proxies = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let proxy = entry.unwrap().path();
        if !proxy.join("node.json").is_file() {
            continue;
        }
        proxies += 1;
        let found = compared(xds, &proxy, accepted).await;
        for line in found.lines_used {
            used[line] = true;
        }
        for d in found.unaccepted {
            let side =
                |v: &Option<Value>| v.as_ref().map_or("<absent>".to_string(), Value::to_string);
            report.push_str(&format!(
                "{name}/{}: {} {} {} (field {})\n  istiod:    {:.300}\n  meshpilot: {:.300}\n",
                proxy.file_name().unwrap().to_string_lossy(),
                d.type_name,
                d.kind,
                d.path,
                d.field,
                side(&d.left),
                side(&d.right),
            ));
        }
    }
    if proxies == 0 {
        report.push_str(&format!("{name}: no proxy compared\n"));
    }
}

/// The corpus's scenarios: its directories.
fn scenarios() -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/fidelity");
    let mut names: Vec<String> = std::fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("mesh.yaml").is_file())
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_corpus_proxy_against_istiod() {
    let accepted = accepted();
    let lines: Vec<(usize, &str)> = accepted.lines().collect();
    let mut used = vec![false; lines.len()];
    let mut report = String::new();
    let scenarios = scenarios();
    assert!(scenarios.len() >= 6, "the corpus: {scenarios:?}");
    for name in &scenarios {
        scenario(name, &accepted, &mut used, &mut report).await;
    }
    for ((line, text), used) in lines.iter().zip(&used) {
        if !used {
            report.push_str(&format!(
                "docs/fidelity.md:{line} accepts a difference no scenario has: {text}\n"
            ));
        }
    }
    assert!(
        report.is_empty(),
        "differences docs/fidelity.md does not accept:\n{report}"
    );
}
