//! discoverySelectors on a real list/watch API server: the selected namespaces are watched with
//! the selector sent to the API server; objects of other namespaces are never held; a namespace
//! relabelled in or out brings or drops its services live, and so does a change of the selectors.

mod common;

use std::time::Duration;

use serde_json::{json, Value};

use common::*;
use test_apiserver::TestApiServer;

const BOUND: Duration = Duration::from_secs(15);

fn namespace(name: &str, labels: &str) -> String {
    format!("apiVersion: v1\nkind: Namespace\nmetadata: {{name: {name}, labels: {{{labels}}}}}\n")
}

fn service(namespace: &str, ip: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: {namespace}}}\nspec: {{clusterIP: {ip}, ports: [{{name: http, port: 80}}]}}\n"
    )
}

/// Which of the namespaces' `web` services meshpilot serves.
fn served(mp: &meshpilot::app::Running) -> Vec<String> {
    let snapshot = mp.aggregate.mesh().snapshot();
    ["in", "out", "istio-system", "team-b"]
        .into_iter()
        .filter(|ns| {
            let host = format!("web.{ns}.svc.cluster.local");
            snapshot.services.get(&host).is_some()
        })
        .map(str::to_string)
        .collect()
}

async fn serving(mp: &meshpilot::app::Running, expected: &[&str]) {
    wait_for(&format!("serving {expected:?}"), BOUND, || async {
        (served(mp) == expected).then_some(())
    })
    .await;
}

/// meshpilot with `api` as its primary cluster and a mesh config file of discoverySelectors.
struct LocalPrimary {
    mp: meshpilot::app::Running,
    mesh: tempfile::NamedTempFile,
    _kubeconfig: tempfile::NamedTempFile,
}

impl LocalPrimary {
    async fn on(api: &TestApiServer, selectors: &str) -> LocalPrimary {
        let kubeconfig = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(kubeconfig.path(), api.kubeconfig(api.admin_token())).unwrap();
        let mesh = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(mesh.path(), format!("discoverySelectors: {selectors}\n")).unwrap();
        let mp = start_meshpilot_with(&[
            "--kubeconfig",
            kubeconfig.path().to_str().unwrap(),
            "--cluster-id",
            "primary",
            "--mesh-config",
            mesh.path().to_str().unwrap(),
        ])
        .await;
        LocalPrimary {
            mp,
            mesh,
            _kubeconfig: kubeconfig,
        }
    }

    /// Replaces the mesh config's discoverySelectors, as an operator's edit.
    fn select(&self, selectors: &str) {
        write_atomic(
            self.mesh.path(),
            &format!("discoverySelectors: {selectors}\n"),
        );
    }
}

#[tokio::test]
async fn selected_namespaces_follow_their_labels_and_the_selectors() {
    let api = TestApiServer::start().await;
    for manifest in [
        namespace("istio-system", ""),
        namespace("in", "mesh: 'on'"),
        namespace("out", "team: x"),
        service("in", "10.96.1.1"),
        service("out", "10.96.1.2"),
        service("istio-system", "10.96.1.3"),
    ] {
        api.apply_yaml(&manifest);
    }
    let primary = LocalPrimary::on(
        &api,
        "[{matchLabels: {mesh: 'on'}}, {matchExpressions: [{key: team, operator: In, values: [y]}]}]",
    )
    .await;
    let (mp, selectors) = (&primary.mp, |yaml: &str| primary.select(yaml));
    serving(mp, &["in"]).await;
    // Each selector is a Namespace watch selected on the API server.
    assert!(api.request_count("watch:namespaces?mesh=on") >= 1);
    assert!(api.request_count("watch:namespaces?team in (y)") >= 1);

    // A namespace relabelled into a selector: its service comes; out of every one: it goes.
    api.apply_yaml(&namespace("out", "team: y"));
    serving(mp, &["in", "out"]).await;
    api.apply_yaml(&namespace("in", "mesh: 'off'"));
    serving(mp, &["out"]).await;

    // The selectors change with the mesh config: none means every namespace.
    selectors("[]");
    serving(mp, &["in", "out", "istio-system"]).await;
    selectors("[{matchLabels: {mesh: 'off'}}]");
    serving(mp, &["in"]).await;
}

/// The remote Secret onboarding `east`, with `annotations`.
fn east_secret(p: &primary::Primary, annotations: Value) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "istio-remote-secret-east", "namespace": "istio-system",
                     "labels": {"istio/multiCluster": "true"}, "annotations": annotations},
        "stringData": {"east": p.east.kubeconfig("east-reader")}
    })
}

async fn east_discovery(p: &primary::Primary, check: impl Fn(&Value) -> bool) -> Value {
    let admin = p.mp.http_addr;
    wait_for("east's discovery status", BOUND, || async {
        let view = cluster_view(admin, "east").await?;
        check(&view).then_some(view)
    })
    .await
}

#[tokio::test]
async fn a_remote_secret_annotation_gives_its_cluster_its_own_selectors() {
    let mesh = tempfile::NamedTempFile::new().unwrap();
    write_atomic(
        mesh.path(),
        "discoverySelectors: [{matchLabels: {mesh: 'on'}}]\n",
    );
    let p = primary::primary_with_remote(&["--mesh-config", mesh.path().to_str().unwrap()]).await;
    for manifest in [
        namespace("in", "mesh: 'on'"),
        namespace("team-b", "team: b"),
        service("in", "10.96.2.1"),
        service("team-b", "10.96.2.2"),
    ] {
        p.east.apply_yaml(&manifest);
    }
    serving(&p.mp, &["in"]).await;
    let view = east_discovery(&p, |v| v["discovery"]["namespaces"] == 1).await;
    assert_eq!(view["discovery"]["from"], "mesh config", "{view}");

    // The annotation replaces the mesh's selectors for this cluster only.
    let own = "[{matchLabels: {team: b}}]";
    p.config.apply(east_secret(&p, json!({ANNOTATION: own})));
    serving(&p.mp, &["team-b"]).await;
    let view = east_discovery(&p, |v| v["discovery"]["from"] != "mesh config").await;
    assert_eq!(
        view["discovery"]["selectors"],
        json!([{"matchLabels": {"team": "b"}}])
    );
    assert!(p.east.request_count("watch:namespaces?team=b") >= 1);

    // Unreadable: refused with a message naming it; the selectors in force stay.
    p.config
        .apply(east_secret(&p, json!({ANNOTATION: "[{matchLabels: [x]}]"})));
    let view = east_discovery(&p, |v| !v["last_error"].is_null()).await;
    let error = view["last_error"].as_str().unwrap();
    assert!(error.contains(ANNOTATION), "{error}");
    assert_eq!(served(&p.mp), ["team-b"]);

    // Without it, the cluster follows the mesh config again.
    p.config.apply(east_secret(&p, json!({})));
    serving(&p.mp, &["in"]).await;
    east_discovery(&p, |v| v["discovery"]["from"] == "mesh config").await;
}

const ANNOTATION: &str = "meshpilot.io/discovery-selectors";

fn service_entry(namespace: &str) -> String {
    format!(
        "apiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {{name: api, namespace: {namespace}}}\nspec: {{hosts: [api.{namespace}.example.com], ports: [{{number: 80, name: http, protocol: HTTP}}], location: MESH_EXTERNAL, resolution: DNS}}\n"
    )
}

/// The namespaces of the ServiceEntries meshpilot serves.
async fn entries_served(admin: std::net::SocketAddr) -> Vec<String> {
    let configz = get_json(admin, "/debug/configz").await;
    let mut namespaces: Vec<String> = configz
        .as_array()
        .into_iter()
        .flatten()
        .filter(|o| o["kind"] == "ServiceEntry" && o["status"] == "accepted")
        .filter_map(|o| o["metadata"]["namespace"].as_str().map(str::to_string))
        .collect();
    namespaces.sort();
    namespaces
}

#[tokio::test]
async fn istio_config_and_the_root_certificate_stay_in_the_discovered_namespaces() {
    let api = TestApiServer::start().await;
    for manifest in [
        namespace("istio-system", "mesh: 'on'"),
        namespace("in", "mesh: 'on'"),
        namespace("out", "team: x"),
        namespace("kube-public", "mesh: 'on'"),
        service_entry("in"),
        service_entry("out"),
    ] {
        api.apply_yaml(&manifest);
    }
    let primary = LocalPrimary::on(&api, "[{matchLabels: {mesh: 'on'}}]").await;
    let admin = primary.mp.http_addr;
    entries(admin, &["in"]).await;
    rooted(&api, "in").await;
    rooted(&api, "istio-system").await;
    // Not in an undiscovered namespace, nor in one of Kubernetes' own.
    assert!(!root(&api, "out") && !root(&api, "kube-public"));

    // A namespace entering the selection brings its config and gets the root; leaving, its
    // config goes.
    api.apply_yaml(&namespace("out", "mesh: 'on'"));
    entries(admin, &["in", "out"]).await;
    rooted(&api, "out").await;
    api.apply_yaml(&namespace("in", "team: x"));
    entries(admin, &["out"]).await;
}

async fn entries(admin: std::net::SocketAddr, expected: &[&str]) {
    wait_for(
        &format!("ServiceEntries of {expected:?}"),
        BOUND,
        || async { (entries_served(admin).await == expected).then_some(()) },
    )
    .await;
}

fn root(api: &TestApiServer, namespace: &str) -> bool {
    api.get("ConfigMap", namespace, "istio-ca-root-cert")
        .is_some()
}

async fn rooted(api: &TestApiServer, namespace: &str) {
    wait_for(
        &format!("the root published in {namespace}"),
        BOUND,
        || async { root(api, namespace).then_some(()) },
    )
    .await;
}
