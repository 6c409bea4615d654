//! What meshpilot sends each proxy of a mesh, against what istiod 1.14.6 sent it
//! (tests/fixtures/fidelity, the corpus of issue 49): each scenario's objects in the test API
//! server, meshpilot reading them as a config cluster, each proxy's node asking over ADS. Every
//! difference must be one docs/fidelity.md accepts, with its reason; every scenario must compare
//! some proxy; and every accepted line must be needed by some difference, so the list cannot
//! outgrow what it explains.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use common::fidelity_corpus::{fixture, serving};
use meshpilot::compare::{
    compare, fetch_live, is_router, read_dump, read_node, Accepted, Difference,
};
use serde_json::{json, Value};

const BOUND: Duration = Duration::from_secs(20);

fn accepted() -> Accepted {
    let doc = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/fidelity.md");
    Accepted::parse(&std::fs::read_to_string(doc).unwrap()).expect("the accepted list parses")
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
    let served = serving(name).await;
    let xds = SocketAddr::from(([127, 0, 0, 1], served.mp.xds_addr.port()));
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

/// istiod's dump of a proxy with one resource of `file` edited by `edit`, in a directory of its
/// own.
fn edited_dump(
    scenario: &str,
    proxy: &str,
    file: &str,
    resource: &str,
    edit: impl Fn(&mut Value),
) -> tempfile::TempDir {
    let from = fixture(scenario).join(proxy);
    let to = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&from).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, to.path().join(path.file_name().unwrap())).unwrap();
    }
    let path = to.path().join(file);
    let mut responses: Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let mut found = false;
    for response in responses.as_array_mut().unwrap() {
        for r in response["resources"].as_array_mut().unwrap() {
            if r["name"] == resource || r["cluster_name"] == resource {
                edit(r);
                found = true;
            }
        }
    }
    assert!(found, "{scenario}/{proxy}: no {resource} in {file}");
    std::fs::write(&path, responses.to_string()).unwrap();
    to
}

/// `meshpilot compare --accept docs/fidelity.md` of an edited istiod dump against meshpilot: the
/// differences it reports.
async fn reported(dump: &Path, mp: &meshpilot::app::Running) -> Value {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_meshpilot"))
        .args(["compare", dump.to_str().unwrap()])
        .arg(format!("127.0.0.1:{}", mp.xds_addr.port()))
        .args([
            "--accept",
            concat!(env!("CARGO_MANIFEST_DIR"), "/docs/fidelity.md"),
        ])
        .args(["-o", "json"])
        .kill_on_drop(true)
        .output()
        .await
        .expect("meshpilot compare runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(1), "a difference: {stdout}");
    serde_json::from_str(&stdout).unwrap()
}

fn paths(report: &Value) -> Vec<String> {
    report["differences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| format!("{} {} {}", d["type"], d["resource"], d["path"]))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_accepted_list_explains_does_not_hide_other_changes() {
    // A gateway's TLS listener without its TLS inspector (it routes by SNI).
    let served = serving("ingress-gateway").await;
    let proxy = "istio-ingressgateway-46fc5";
    let dump = edited_dump("ingress-gateway", proxy, "lds.json", "0.0.0.0_8443", |l| {
        l.as_object_mut().unwrap().remove("listener_filters");
    });
    let report = reported(dump.path(), &served.mp).await;
    let found = paths(&report);
    assert!(
        found
            .iter()
            .any(|p| p.contains("0.0.0.0_8443") && p.contains("listener_filters")),
        "{found:?}"
    );

    // An inbound mTLS chain at TLS 1.3 only.
    let served = serving("security").await;
    let dump = edited_dump(
        "security",
        "ledger-v1-7a178",
        "lds.json",
        "virtualInbound",
        |l| {
            let chains = l["filter_chains"].as_array_mut().unwrap();
            let chain = chains
                .iter_mut()
                .find(|c| c.get("transport_socket").is_some())
                .unwrap();
            chain["transport_socket"]["typed_config"]["common_tls_context"]["tls_params"] =
                json!({"tls_minimum_protocol_version": "TLSv1_3"});
        },
    );
    let found = paths(&reported(dump.path(), &served.mp).await);
    assert!(
        found
            .iter()
            .any(|p| p.contains("virtualInbound") && p.contains("tls_minimum_protocol_version")),
        "{found:?}"
    );

    // Another panic threshold for an outlier-detecting cluster.
    let served = serving("locality-outlier").await;
    let proxy = std::fs::read_dir(fixture("locality-outlier"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.join("cds.json").is_file())
        .unwrap();
    let cds: Value =
        serde_json::from_str(&std::fs::read_to_string(proxy.join("cds.json")).unwrap()).unwrap();
    let cluster = cds
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r["resources"].as_array().unwrap())
        .find(|c| {
            c["common_lb_config"]
                .get("healthy_panic_threshold")
                .is_some()
        })
        .expect("a cluster with a panic threshold")["name"]
        .as_str()
        .unwrap()
        .to_string();
    let proxy = proxy.file_name().unwrap().to_str().unwrap().to_string();
    let dump = edited_dump("locality-outlier", &proxy, "cds.json", &cluster, |c| {
        c["common_lb_config"]["healthy_panic_threshold"] = json!({"value": 50});
    });
    let found = paths(&reported(dump.path(), &served.mp).await);
    assert!(
        found
            .iter()
            .any(|p| p.contains(&cluster) && p.contains("healthy_panic_threshold")),
        "{found:?}"
    );
}
