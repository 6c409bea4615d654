//! End to end: `meshpilot remote-secret` against a fresh test API server (no system namespace), and
//! its output Secret onboarding that cluster into a running meshpilot.

mod common;

use std::time::Duration;

use common::*;
use test_apiserver::TestApiServer;

const BOUND: Duration = Duration::from_secs(20);

struct Output {
    success: bool,
    stdout: String,
    stderr: String,
}

/// Runs `meshpilot remote-secret` with the admin kubeconfig of `api`.
async fn remote_secret(api: &TestApiServer, cluster: &str, extra: &[&str]) -> Output {
    let kubeconfig = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(kubeconfig.path(), api.kubeconfig(api.admin_token())).unwrap();
    let run = tokio::process::Command::new(env!("CARGO_BIN_EXE_meshpilot"))
        .arg("remote-secret")
        .arg("--kubeconfig")
        .arg(kubeconfig.path())
        .args(["--cluster-id", cluster])
        .args(extra)
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(BOUND, run)
        .await
        .expect("remote-secret finished")
        .unwrap();
    Output {
        success: output.status.success(),
        stdout: String::from_utf8_lossy(&output.stdout).to_string(),
        stderr: String::from_utf8_lossy(&output.stderr).to_string(),
    }
}

/// The error as the command prints it: one line, the last (progress notes may precede it).
fn one_line(out: &Output) -> &str {
    assert!(!out.success, "expected a failure: {}", out.stdout);
    let errors: Vec<&str> = out
        .stderr
        .lines()
        .filter(|l| l.starts_with("error:"))
        .collect();
    assert_eq!(errors.len(), 1, "{}", out.stderr);
    assert_eq!(out.stderr.trim().lines().last(), Some(errors[0]));
    assert!(!out.stderr.contains("Status {"), "{}", out.stderr);
    errors[0]
}

#[tokio::test]
async fn a_fresh_cluster_is_provisioned_and_its_secret_onboards_it() {
    let east = TestApiServer::start().await;
    east.apply_yaml(
        "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: shop}\nspec: {clusterIP: 10.0.0.9, ports: [{name: http, port: 80}]}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-1, namespace: shop, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{name: http, port: 80}]\nendpoints: [{addresses: [10.5.0.1], conditions: {ready: true}}]\n",
    );
    let first = remote_secret(&east, "east", &[]).await;
    assert!(first.success, "{}", first.stderr);
    assert!(
        first
            .stderr
            .contains("cluster east: created Namespace istio-system"),
        "{}",
        first.stderr
    );
    let account = "istio-reader-service-account";
    assert!(east
        .get("ServiceAccount", "istio-system", account)
        .is_some());
    let binding = east
        .get("ClusterRoleBinding", "", "meshpilot-reader")
        .unwrap();
    assert_eq!(binding["subjects"][0]["name"], account);
    let role = east.get("ClusterRole", "", "meshpilot-reader").unwrap();
    assert!(role["rules"].as_array().is_some_and(|r| !r.is_empty()));

    // Again: nothing to create, the same account's token.
    let second = remote_secret(&east, "east", &[]).await;
    assert!(second.success, "{}", second.stderr);
    assert!(!second.stderr.contains("created"), "{}", second.stderr);
    assert_eq!(second.stdout, first.stdout);

    // The Secret onboards east into a primary.
    let primary = TestApiServer::start().await;
    primary.apply_yaml("apiVersion: v1\nkind: Namespace\nmetadata: {name: istio-system}\n");
    primary.apply_yaml(&first.stdout);
    let kubeconfig = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(kubeconfig.path(), primary.kubeconfig(primary.admin_token())).unwrap();
    let mp = start_meshpilot_with(&[
        "--kubeconfig",
        kubeconfig.path().to_str().unwrap(),
        "--cluster-id",
        "primary",
    ])
    .await;
    let admin = mp.http_addr;
    wait_for("east onboarded", BOUND, || async move {
        let synced = cluster_view(admin, "east").await?["state"] == "synced";
        let served = shard_addresses(admin, "web.shop.svc.cluster.local", "east").await;
        (synced && served == ["10.5.0.1"]).then_some(())
    })
    .await;
}

#[tokio::test]
async fn errors_name_the_cluster_the_object_and_the_verb() {
    // Only reading: the account must exist already.
    let bare = TestApiServer::start().await;
    let out = remote_secret(&bare, "west", &["--create-service-account=false"]).await;
    let line = one_line(&out);
    assert!(
        line.contains("cluster west")
            && line.contains("ServiceAccount istio-system/istio-reader-service-account"),
        "{line}"
    );
    assert!(bare.get("Namespace", "", "istio-system").is_none());

    // A missing permission names the verb and the resource.
    let locked = TestApiServer::start().await;
    locked.deny("admin", "create", "clusterroles");
    let out = remote_secret(&locked, "north", &[]).await;
    let line = one_line(&out);
    assert!(
        line.contains("cluster north (https://127.0.0.1:")
            && line.contains("): create ClusterRole meshpilot-reader failed")
            && line.contains("cannot create resource \"clusterroles\""),
        "{line}"
    );
}
