//! `meshpilot compare` on what real servers send: two live meshpilots with different config, a
//! dump saved from one of them, and dumps edited by hand — the binary's exit code and report.

mod common;

use std::path::Path;
use std::process::Output;

use common::*;

const NODE: &str = r#"{
  "id": "sidecar~10.1.0.9~client.bookinfo~bookinfo.svc.cluster.local",
  "metadata": {"CLUSTER_ID": "cluster1", "NAMESPACE": "bookinfo"}
}"#;
const REVIEWS: &str = "outbound|9080||reviews.bookinfo.svc.cluster.local";
const ROUND_ROBIN: &str = "
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {name: reviews, namespace: bookinfo}
spec:
  host: reviews.bookinfo.svc.cluster.local
  trafficPolicy: {loadBalancer: {simple: ROUND_ROBIN}}
";

async fn compare(args: &[&str]) -> Output {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_meshpilot"))
        .arg("compare")
        .args(args)
        .kill_on_drop(true)
        .output()
        .await
        .expect("meshpilot runs")
}

fn text(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).to_string() + &String::from_utf8_lossy(&output.stderr)
}

fn xds(mp: &meshpilot::app::Running) -> String {
    format!("127.0.0.1:{}", mp.xds_addr.port())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_live_servers_a_saved_dump_and_an_edited_one() {
    let plain = copy_tree(Path::new(EXAMPLE));
    let tuned = copy_tree(Path::new(EXAMPLE));
    std::fs::create_dir_all(tuned.path().join("config")).unwrap();
    std::fs::write(tuned.path().join("config/reviews.yaml"), ROUND_ROBIN).unwrap();
    let a = start_meshpilot(plain.path(), &[]).await;
    let b = start_meshpilot(tuned.path(), &[]).await;
    let work = tempfile::tempdir().unwrap();
    let node = work.path().join("node.json");
    std::fs::write(&node, NODE).unwrap();
    let node = node.to_str().unwrap();
    let saved = work.path().join("a");
    let saved_dir = saved.to_str().unwrap();

    // The same server twice: nothing differs; what it sent is saved as a dump.
    let same = compare(&[&xds(&a), &xds(&a), "--node", node, "--save-left", saved_dir]).await;
    assert_eq!(same.status.code(), Some(0), "{}", text(&same));
    assert!(saved.join("cds.json").is_file() && saved.join("node.json").is_file());

    // A DestinationRule's load balancer on one side: that cluster's policy, and nothing else.
    let differ = compare(&[&xds(&a), &xds(&b), "--node", node, "-o", "json"]).await;
    assert_eq!(differ.status.code(), Some(1), "{}", text(&differ));
    let report: serde_json::Value = serde_json::from_slice(&differ.stdout).unwrap();
    let found: Vec<(&str, &str)> = report["differences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| (d["resource"].as_str().unwrap(), d["path"].as_str().unwrap()))
        .collect();
    assert_eq!(found, [(REVIEWS, "lb_policy")], "{report:#}");
    assert!(!report["normalised"].as_array().unwrap().is_empty());

    // The saved dump against both live servers (its node.json names the node).
    let dump_a = compare(&[saved_dir, &xds(&a)]).await;
    assert_eq!(dump_a.status.code(), Some(0), "{}", text(&dump_a));
    let dump_b = compare(&[saved_dir, &xds(&b)]).await;
    assert_eq!(dump_b.status.code(), Some(1), "{}", text(&dump_b));
    assert!(
        text(&dump_b).contains(&format!("cds {REVIEWS} lb_policy")),
        "{}",
        text(&dump_b)
    );

    // Two dumps: an edited connect timeout is found; a statistics prefix is not a difference.
    let edited = work.path().join("edited");
    std::fs::create_dir_all(&edited).unwrap();
    for file in ["cds.json", "eds.json", "lds.json", "rds.json", "node.json"] {
        std::fs::copy(saved.join(file), edited.join(file)).unwrap();
    }
    let cds = std::fs::read_to_string(edited.join("cds.json")).unwrap();
    let mut responses: serde_json::Value = serde_json::from_str(&cds).unwrap();
    for cluster in responses[0]["resources"].as_array_mut().unwrap() {
        if cluster["name"] == REVIEWS {
            cluster["connect_timeout"] = "3s".into();
            cluster["alt_stat_name"] = "renamed".into();
        }
    }
    std::fs::write(edited.join("cds.json"), responses.to_string()).unwrap();
    let two = compare(&[saved_dir, edited.to_str().unwrap()]).await;
    assert_eq!(two.status.code(), Some(1), "{}", text(&two));
    let report = text(&two);
    assert!(
        report.contains(&format!("cds {REVIEWS} connect_timeout")),
        "{report}"
    );
    assert!(report.contains("1 difference(s)"), "{report}");

    // A dump that is not JSON: refused, naming the file; not a difference.
    std::fs::write(edited.join("lds.json"), "[{").unwrap();
    let broken = compare(&[saved_dir, edited.to_str().unwrap()]).await;
    assert_eq!(broken.status.code(), Some(2), "{}", text(&broken));
    assert!(text(&broken).contains("lds.json"), "{}", text(&broken));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_compared_is_no_pass_and_output_can_be_cut_short() {
    let work = tempfile::tempdir().unwrap();
    // Two dumps without any resource: nothing was compared, which is said and is no pass.
    let empty = work.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    for file in ["cds.json", "eds.json", "lds.json", "rds.json"] {
        std::fs::write(empty.join(file), "[]").unwrap();
    }
    std::fs::write(empty.join("node.json"), NODE).unwrap();
    let empty = empty.to_str().unwrap();
    let nothing = compare(&[empty, empty]).await;
    assert_eq!(nothing.status.code(), Some(3), "{}", text(&nothing));
    assert!(
        text(&nothing).contains("nothing compared"),
        "{}",
        text(&nothing)
    );

    // A dump directory that is not there is named as such.
    let missing = work.path().join("no-such-dump");
    let missing = compare(&[missing.to_str().unwrap(), empty]).await;
    assert_eq!(missing.status.code(), Some(2), "{}", text(&missing));
    assert!(
        text(&missing).contains("no-such-dump: no such dump directory"),
        "{}",
        text(&missing)
    );

    // A reader that stops reading (`| head`): the output ends quietly, no panic.
    let a = start_meshpilot(Path::new(EXAMPLE), &[]).await;
    let node = work.path().join("node.json");
    std::fs::write(&node, NODE).unwrap();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_meshpilot"))
        .args(["compare", &xds(&a), empty, "--node", node.to_str().unwrap()])
        .args(["-o", "json"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("meshpilot runs");
    drop(child.stdout.take());
    let output = tokio::time::timeout(std::time::Duration::from_secs(20), child.wait_with_output())
        .await
        .expect("compare ends")
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(output.status.code(), Some(1), "{stderr}");
}
