//! The fidelity corpus (tests/fixtures/fidelity): a scenario's objects loaded into test API
//! servers as the real API servers held them — one per cluster of a multicluster scenario
//! (`multicluster.yaml`), its remotes onboarded by the corpus's own Secrets — and meshpilot
//! serving them as istiod did: the primary's config cluster, its mesh config and networks.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use test_apiserver::{TestApiServer, User};

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
    let Ok(text) = std::fs::read_to_string(path) else {
        return Vec::new();
    };
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| serde::Deserialize::deserialize(doc).unwrap())
        .filter(|v: &Value| !v.is_null())
        .collect()
}

/// The first document of a status file (a list), or nothing.
fn status_list(path: &Path) -> Vec<Value> {
    (yaml_docs(path).first())
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
}

/// The API server's own `default/kubernetes` Service is at the first address of its Service
/// CIDR: the corpus's are /16s, so the /16 of the cluster's first Service VIP.
fn kubernetes_vip(objects: &[Value]) -> String {
    let vip = (objects.iter())
        .filter(|o| o["kind"] == "Service")
        .find_map(|o| o["spec"]["clusterIP"].as_str()?.parse::<Ipv4Addr>().ok())
        .unwrap_or(Ipv4Addr::new(10, 96, 0, 1));
    let [a, b, ..] = vip.octets();
    Ipv4Addr::new(a, b, 0, 1).to_string()
}

/// One cluster's objects as its real API server held them: Pods and Services with the status
/// the corpus set through the status subresource, the slices its EndpointSlice controller
/// wrote, and the API server's own `default/kubernetes` Service.
pub fn load(api: &TestApiServer, dir: &Path) {
    let pods = status_list(&dir.join("pods-status.yaml"));
    let services = status_list(&dir.join("services-status.yaml"));
    let objects = yaml_docs(&dir.join("mesh.yaml"));
    api.apply(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "default"}}));
    api.apply(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "kubernetes", "namespace": "default"},
        "spec": {"clusterIP": kubernetes_vip(&objects), "ports": [{"name": "https", "port": 443, "targetPort": 6443}]},
    }));
    for mut object in objects {
        let (ns, name) = (
            object["metadata"]["namespace"].clone(),
            object["metadata"]["name"].clone(),
        );
        if object["kind"] == "Pod" {
            if let Some(s) = (pods.iter()).find(|s| s["namespace"] == ns && s["pod"] == name) {
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
        if object["kind"] == "Service" {
            if let Some(s) =
                (services.iter()).find(|s| s["namespace"] == ns && s["service"] == name)
            {
                object["status"] =
                    json!({"loadBalancer": {"ingress": [{"ip": s["loadBalancerIngressIP"]}]}});
            }
        }
        api.apply(object);
    }
    for slice in yaml_docs(&dir.join("endpointslices.yaml")) {
        api.apply(slice);
    }
}

/// A scenario served: every cluster's API server (the primary's first) and meshpilot.
pub struct Serving {
    /// The primary's (config cluster's) API server.
    pub api: TestApiServer,
    /// The remote clusters' API servers, kept up while meshpilot reads them.
    pub remotes: Vec<TestApiServer>,
    pub work: tempfile::TempDir,
    pub mp: meshpilot::app::Running,
}

/// Starts meshpilot on a scenario's objects, as the primary of its first cluster (`c1` for a
/// single-cluster scenario).
pub async fn serving(name: &str) -> Serving {
    let dir = fixture(name);
    let topology = yaml_docs(&dir.join("multicluster.yaml"))
        .into_iter()
        .next()
        .unwrap_or(Value::Null);
    let primary = topology["primary"].as_str().unwrap_or("c1").to_string();
    let api = TestApiServer::start().await;
    load(&api, &dir);
    let mut remotes = Vec::new();
    let clusters = topology["clusters"].as_array().cloned().unwrap_or_default();
    for cluster in clusters.iter().filter(|c| c["id"] != primary.as_str()) {
        let id = cluster["id"].as_str().unwrap();
        let remote = TestApiServer::start().await;
        load(&remote, &dir.join(cluster["objects"].as_str().unwrap()));
        let reader = format!("{id}-reader");
        remote.add_token(
            &reader,
            User::service_account("istio-system", "istio-reader-service-account"),
        );
        // The corpus's remote Secret as applied, its kubeconfig pointed at this replay's server.
        let mut secret = (topology["remoteSecrets"].as_array().into_iter().flatten())
            .find(|s| s["stringData"].get(id).is_some())
            .unwrap_or_else(|| panic!("{name}: no remote Secret for {id}"))
            .clone();
        secret["stringData"][id] = json!(remote.kubeconfig(&reader));
        api.apply(secret);
        remotes.push(remote);
    }
    let work = tempfile::tempdir().unwrap();
    // Every object comes from the API servers: no file clusters, no file config.
    std::fs::create_dir_all(work.path().join("clusters")).unwrap();
    let kubeconfig = work.path().join("kubeconfig");
    std::fs::write(&kubeconfig, api.kubeconfig(api.admin_token())).unwrap();
    let mesh = dir.join("mesh-config.yaml");
    let networks = dir.join("mesh-networks.yaml");
    let mut flags = vec![
        "--kubeconfig".to_string(),
        kubeconfig.display().to_string(),
        "--cluster-id".into(),
        primary,
        "--config-dir".into(),
        work.path().display().to_string(),
        "--mesh-config".into(),
        mesh.display().to_string(),
    ];
    if networks.is_file() {
        flags.extend(["--mesh-networks".into(), networks.display().to_string()]);
    }
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let mp = super::start_meshpilot_with(&flags).await;
    Serving {
        api,
        remotes,
        work,
        mp,
    }
}
