//! What a new user meets first, as they would meet it: Istio's samples written for `kubectl apply`
//! (no namespace), the certificate tool run twice, a mesh config file edited next to a log file.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use prost::Message;

const BOUND: Duration = Duration::from_secs(10);
const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";

/// Istio's bookinfo `reviews` Service and its DestinationRule, as the samples have them (no
/// namespace anywhere).
const REVIEWS: &str = "
apiVersion: v1
kind: Service
metadata:
  name: reviews
  labels: {app: reviews, service: reviews}
spec:
  clusterIP: 10.96.0.30
  ports: [{port: 9080, name: http}]
  selector: {app: reviews}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: reviews-1, labels: {kubernetes.io/service-name: reviews}}
addressType: IPv4
ports: [{name: http, port: 9080}]
endpoints: [{addresses: [10.1.0.30], conditions: {ready: true}}]
";

const REVIEWS_RULE: &str = "
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata:
  name: reviews
spec:
  host: reviews
  subsets:
  - name: v1
    labels:
      version: v1
  - name: v2
    labels:
      version: v2
";

/// A config dir whose cluster c1 has bookinfo's `reviews` (and an empty `config/`).
fn reviews_config_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("clusters/c1")).unwrap();
    std::fs::create_dir_all(dir.path().join("config")).unwrap();
    std::fs::write(dir.path().join("clusters/c1/reviews.yaml"), REVIEWS).unwrap();
    dir
}

/// A sidecar of `default` in c1 (bookinfo's productpage) subscribed to every cluster.
async fn productpage_clusters(mp: &meshpilot::app::Running) -> AdsClient {
    let ads = AdsClient::connect(mp.xds_addr).await.unwrap();
    ads.request(DiscoveryRequest {
        node: Some(node(
            "sidecar~10.1.0.9~productpage.default~default.svc.cluster.local",
            &[("CLUSTER_ID", "c1")],
        )),
        type_url: CDS.into(),
        ..Default::default()
    });
    ads
}

#[tokio::test]
async fn samples_without_a_namespace_land_in_default_as_with_kubectl() {
    let dir = reviews_config_dir();
    std::fs::write(dir.path().join("config/reviews.yaml"), REVIEWS_RULE).unwrap();
    // And one a user forgot to name: refused, its kind still shown.
    std::fs::write(
        dir.path().join("config/nameless.yaml"),
        REVIEWS_RULE.replace("  name: reviews\n", ""),
    )
    .unwrap();
    let mp = start_meshpilot(dir.path(), &[]).await;

    let configz = get_json(mp.http_addr, "/debug/configz").await;
    let rule_with = |status: &str| {
        configz
            .as_array()
            .unwrap()
            .iter()
            .find(|o| o["kind"] == "DestinationRule" && o["status"] == status)
            .unwrap_or_else(|| panic!("no {status} DestinationRule: {configz}"))
            .clone()
    };
    let nameless = rule_with("refused");
    let error = nameless["error"].as_str().unwrap();
    assert!(error.contains("without metadata.name"), "{nameless}");
    let rule = rule_with("accepted");
    assert_eq!(rule["metadata"]["namespace"], "default");

    let mut ads = productpage_clusters(&mp).await;
    let clusters = cluster_names(&ads.response(BOUND).await);
    for subset in ["v1", "v2"] {
        let name = format!("outbound|9080|{subset}|reviews.default.svc.cluster.local");
        assert!(clusters.contains(&name), "{name} in {clusters:?}");
    }
}

fn certs(args: &[&str]) -> (bool, String) {
    run(&[&["certs"], args].concat())
}

#[test]
fn certs_never_overwrite_a_key_unless_forced() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let root_arg = root.to_str().unwrap();
    assert!(certs(&["root", "--out", root_arg]).0);
    let key = std::fs::read_to_string(root.join("root-key.pem")).unwrap();

    let (ok, stderr) = certs(&["root", "--out", root_arg]);
    assert!(!ok, "a second root over the first must fail");
    assert!(
        stderr.contains("root-key.pem") && stderr.contains("--force"),
        "{stderr}"
    );
    assert_eq!(
        std::fs::read_to_string(root.join("root-key.pem")).unwrap(),
        key
    );

    let east = dir.path().join("east");
    let intermediate = |extra: &[&str]| {
        let mut args = vec!["intermediate", "--root", root_arg, "--name", "east"];
        args.extend(["--out", east.to_str().unwrap()]);
        args.extend_from_slice(extra);
        certs(&args)
    };
    assert!(intermediate(&[]).0);
    let (ok, stderr) = intermediate(&[]);
    assert!(!ok && stderr.contains("ca-key.pem"), "{stderr}");

    assert!(certs(&["root", "--out", root_arg, "--force"]).0);
    assert_ne!(
        std::fs::read_to_string(root.join("root-key.pem")).unwrap(),
        key
    );
    assert!(Path::new(&root).join("root-cert.pem").exists());
}

/// Two meshpilots on one machine, each with its own example and default flags but for ports of
/// their own: neither serves the admission webhook (no API server could call it), so neither
/// contends for its port 15017.
#[tokio::test]
async fn two_file_mode_meshpilots_run_side_by_side() {
    let dirs = [reviews_config_dir(), reviews_config_dir()];
    let processes: Vec<MeshpilotProcess> = dirs
        .iter()
        .map(|dir| {
            let state = dir.path().join("state");
            MeshpilotProcess::discovery(
                &[
                    "--config-dir",
                    dir.path().to_str().unwrap(),
                    "--state-dir",
                    state.to_str().unwrap(),
                ],
                &[],
            )
        })
        .collect();
    for process in &processes {
        let admin = process.bound_addr("admin").await;
        wait_for("ready", BOUND, || async move {
            let (status, _) = http_get(admin, "/ready").await.ok()?;
            (status == 200).then_some(())
        })
        .await;
        assert!(!process.log().contains("webhook"), "{}", process.log());
    }
}

/// A refused mesh config in a directory that also holds a log: writing the log must not reload the
/// mesh config (before, each refusal's log line reloaded it: a storm of ~50 lines a second).
#[tokio::test]
async fn a_file_written_beside_the_mesh_config_does_not_reload_it() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("clusters/c1")).unwrap();
    let mesh = dir.path().join("etc/mesh.yaml");
    std::fs::create_dir_all(mesh.parent().unwrap()).unwrap();
    std::fs::write(&mesh, "defaultServiceExportTo: ['*']\n").unwrap();
    let state = dir.path().join("state");
    let mp = MeshpilotProcess::discovery(
        &[
            "--config-dir",
            dir.path().to_str().unwrap(),
            "--mesh-config",
            mesh.to_str().unwrap(),
            "--state-dir",
            state.to_str().unwrap(),
        ],
        &[],
    );
    mp.bound_addr("admin").await;
    let refusals = |log: &str| log.matches("mesh config refused").count();
    write_atomic(&mesh, "defaultServiceExportTo: [unclosed\n");
    wait_for("the bad mesh config refused", BOUND, || {
        let n = refusals(&mp.log());
        async move { (n == 1).then_some(()) }
    })
    .await;

    let log = dir.path().join("etc/meshpilot.log");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
    let mut i = 0;
    while tokio::time::Instant::now() < deadline {
        i += 1;
        std::fs::write(&log, format!("line {i}\n")).unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(
            refusals(&mp.log()),
            1,
            "reloaded by a write to {}",
            log.display()
        );
    }

    // The file's own change is still seen.
    write_atomic(&mesh, "defaultServiceExportTo: ['.']\n");
    wait_for("the good mesh config applied", BOUND, || {
        let applied = mp.log().contains("mesh config changed");
        async move { applied.then_some(()) }
    })
    .await;
}

/// The names of the clusters a CDS response carries.
fn cluster_names(
    response: &envoy_types::pb::envoy::service::discovery::v3::DiscoveryResponse,
) -> Vec<String> {
    response
        .resources
        .iter()
        .map(|a| Cluster::decode(&a.value[..]).unwrap().name)
        .collect()
}

/// A file emptied in place (an editor truncating before it writes, a copy in progress) keeps its
/// objects through the rewrite; one that stays empty loses them after the grace, config files and
/// cluster manifests alike.
#[tokio::test]
async fn an_emptied_file_keeps_its_objects_until_it_stays_empty() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("clusters/c1")).unwrap();
    std::fs::create_dir_all(dir.path().join("config")).unwrap();
    let manifest = dir.path().join("clusters/c1/reviews.yaml");
    let rule = dir.path().join("config/reviews.yaml");
    std::fs::write(&manifest, REVIEWS).unwrap();
    std::fs::write(&rule, REVIEWS_RULE).unwrap();
    let mp = start_meshpilot(dir.path(), &["--debounce-after", "0s"]).await;
    let mut ads = productpage_clusters(&mp).await;
    let first = ads.response(BOUND).await;
    ads.ack(&first, vec![]);
    let v1 = "outbound|9080|v1|reviews.default.svc.cluster.local";
    assert!(cluster_names(&first).contains(&v1.to_string()));

    // Truncated, then written again a moment later: nothing changes, so nothing is pushed.
    for file in [&rule, &manifest] {
        let text = std::fs::read_to_string(file).unwrap();
        std::fs::write(file, "").unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        std::fs::write(file, text).unwrap();
    }
    ads.silence(Duration::from_millis(1500)).await;

    // Left empty: the rule goes after the grace.
    std::fs::write(&rule, "").unwrap();
    let pushed = ads.response(BOUND).await;
    ads.ack(&pushed, vec![]);
    let names = cluster_names(&pushed);
    assert!(!names.contains(&v1.to_string()), "{names:?}");
    assert!(names.contains(&"outbound|9080||reviews.default.svc.cluster.local".to_string()));
}

/// One DestinationRule in two files: the first read (by path at start) is served, the other is
/// refused naming it, and stays refused when edited; once the first goes, the other serves.
#[tokio::test]
async fn an_object_defined_twice_keeps_the_first_and_says_so() {
    let dir = reviews_config_dir();
    // The same Service again in a second file of the cluster, with another address.
    std::fs::write(
        dir.path().join("clusters/c1/reviews-copy.yaml"),
        REVIEWS.replace("10.96.0.30", "10.96.0.99"),
    )
    .unwrap();
    let (first, second) = (
        dir.path().join("config/a.yaml"),
        dir.path().join("config/b.yaml"),
    );
    std::fs::write(
        &first,
        REVIEWS_RULE.replace("- name: v2", "- name: only-in-a"),
    )
    .unwrap();
    std::fs::write(
        &second,
        REVIEWS_RULE.replace("- name: v2", "- name: only-in-b"),
    )
    .unwrap();
    let mp = start_meshpilot(dir.path(), &[]).await;
    let admin = mp.http_addr;

    let rule_status = || async move {
        let configz = get_json(admin, "/debug/configz").await;
        let entries = configz.as_array().unwrap().clone();
        let of_rule = |status: &str| {
            entries
                .iter()
                .filter(|o| o["metadata"]["name"] == "reviews" && o["status"] == status)
                .cloned()
                .collect::<Vec<_>>()
        };
        (of_rule("accepted"), of_rule("refused"))
    };
    let (accepted, refused) = rule_status().await;
    assert_eq!(accepted.len(), 1);
    assert!(
        accepted[0]["spec"].to_string().contains("only-in-a"),
        "{accepted:?}"
    );
    assert_eq!(refused.len(), 1, "{refused:?}");
    let error = refused[0]["error"].as_str().unwrap();
    assert!(
        error.contains("b.yaml") && error.contains("a.yaml") && error.contains("served"),
        "{error}"
    );

    // Editing the second copy does not make it win.
    write_atomic(
        &second,
        &REVIEWS_RULE.replace("- name: v2", "- name: edited-in-b"),
    );
    wait_for("the edited copy refused", BOUND, || async {
        let (accepted, refused) = rule_status().await;
        let edited = refused
            .iter()
            .any(|r| r["error"].as_str().unwrap_or("").contains("b.yaml"));
        (edited && accepted[0]["spec"].to_string().contains("only-in-a")).then_some(())
    })
    .await;

    // The first goes: the second serves, and nothing is refused any more.
    std::fs::remove_file(&first).unwrap();
    wait_for("the second copy served", BOUND, || async {
        let (accepted, refused) = rule_status().await;
        let served = accepted
            .first()
            .is_some_and(|a| a["spec"].to_string().contains("edited-in-b"));
        (served && refused.is_empty()).then_some(())
    })
    .await;

    // The cluster directory says which Service file is not served.
    let clusterz = get_json(admin, "/debug/clusterz").await;
    let text = clusterz.to_string();
    assert!(
        text.contains("reviews-copy.yaml") && text.contains("defined in"),
        "{clusterz}"
    );
    assert_eq!(
        shard_addresses(admin, "reviews.default.svc.cluster.local", "c1").await,
        ["10.1.0.30"]
    );
}

/// A misspelt field is refused as Istio's own schema would refuse it at `kubectl apply`, with the
/// field it meant; the rule's last good version keeps serving.
#[tokio::test]
async fn a_misspelt_field_is_refused_and_the_last_good_version_kept() {
    let dir = reviews_config_dir();
    let rule = dir.path().join("config/reviews.yaml");
    std::fs::write(&rule, REVIEWS_RULE).unwrap();
    let mp = start_meshpilot(dir.path(), &[]).await;
    let admin = mp.http_addr;

    let typo = "  trafficPolicy:\n    loadBalancr:\n      simple: RANDOM\n";
    write_atomic(&rule, &format!("{REVIEWS_RULE}{typo}"));
    let refused = wait_for("the misspelt rule refused", BOUND, || async {
        let configz = get_json(admin, "/debug/configz").await;
        configz
            .as_array()
            .unwrap()
            .iter()
            .find(|o| o["kind"] == "DestinationRule" && o["status"] == "refused")
            .cloned()
    })
    .await;
    let error = refused["error"].as_str().unwrap();
    for part in [
        "reviews.yaml",
        "trafficPolicy.loadBalancr",
        "unknown field",
        "did you mean loadBalancer?",
    ] {
        assert!(error.contains(part), "{part} in {error}");
    }

    // The version before the typo still serves its subsets.
    let mut ads = productpage_clusters(&mp).await;
    let clusters = cluster_names(&ads.response(BOUND).await);
    let v2 = "outbound|9080|v2|reviews.default.svc.cluster.local".to_string();
    assert!(clusters.contains(&v2), "{clusters:?}");
}

/// The README's first command keeps its state (the CA's private key among it) in the user's state
/// directory, not in the example's tree.
#[tokio::test]
async fn state_stays_out_of_the_config_tree() {
    let config = copy_tree(Path::new(EXAMPLE));
    let home = tempfile::tempdir().unwrap();
    let mp = MeshpilotProcess::spawn_with_env(
        &[
            "discovery",
            "--config-dir",
            config.path().to_str().unwrap(),
            "--http-addr",
            "127.0.0.1:0",
            "--xds-addr",
            "127.0.0.1:0",
            "--secure-xds-addr",
            "127.0.0.1:0",
        ],
        &[
            ("HOME", home.path().to_str().unwrap()),
            ("XDG_STATE_HOME", ""),
        ],
    );
    mp.bound_addr("admin").await;
    let state = home.path().join(".local/state/meshpilot");
    let key = wait_for("the CA's key in the user's state directory", BOUND, || {
        let found = std::fs::read_dir(&state).ok().and_then(|mut dirs| {
            let dir = dirs.next()?.ok()?.path();
            let key = dir.join("ca/ca-key.pem");
            key.exists().then_some(key)
        });
        async move { found }
    })
    .await;
    let name = key.parent().unwrap().parent().unwrap().file_name().unwrap();
    let tree = config
        .path()
        .file_name()
        .unwrap()
        .to_string_lossy()
        .to_string();
    // Named after the config dir (characters other than letters, digits, - and _ replaced).
    assert!(
        name.to_string_lossy()
            .contains(tree.trim_start_matches('.')),
        "{name:?}"
    );
    assert!(
        !config.path().join(".meshpilot").exists(),
        "nothing written into the config tree"
    );
}

/// Runs the binary to completion: (success, stderr).
fn run(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_meshpilot"))
        .args(args)
        .env_remove("MESHPILOT_LOG")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

/// Errors a user can act on: one line each, naming what failed, where and why, said once.
#[test]
fn start_errors_say_what_where_and_why_once() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-dir");
    let (ok, stderr) = run(&["discovery", "--config-dir", missing.to_str().unwrap()]);
    assert!(!ok);
    assert!(
        stderr.contains("no-such-dir does not exist") && !stderr.contains("clusters/"),
        "{stderr}"
    );

    let (ok, stderr) = run(&["discovery", "--kubeconfig", "c1.kubeconfig"]);
    assert!(!ok);
    assert!(
        stderr.contains("cannot read kubeconfig c1.kubeconfig: No such file"),
        "{stderr}"
    );
    assert!(!stderr.contains("'\""), "the path quoted twice: {stderr}");

    std::fs::create_dir_all(dir.path().join("clusters")).unwrap();
    let ca = dir.path().join("cacerts");
    std::fs::create_dir_all(&ca).unwrap();
    let (ok, stderr) = run(&[
        "discovery",
        "--config-dir",
        dir.path().to_str().unwrap(),
        "--ca-dir",
        ca.to_str().unwrap(),
        "--http-addr",
        "127.0.0.1:0",
        "--xds-addr",
        "127.0.0.1:0",
        "--secure-xds-addr",
        "127.0.0.1:0",
        "--state-dir",
        dir.path().join(".state").to_str().unwrap(),
    ]);
    assert!(!ok);
    let errors: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("ca-cert.pem"))
        .collect();
    assert_eq!(errors.len(), 1, "{stderr}");
    assert_eq!(
        errors[0].matches("ca-cert.pem is missing").count(),
        1,
        "{stderr}"
    );
    assert!(!stderr.contains("Caused by"), "{stderr}");
}

/// `remote-secret` against a server that refuses: one line naming the cluster, the server and the
/// cause, and none of the client library's own log lines.
#[test]
fn an_unreachable_remote_is_named_with_its_server_and_cause() {
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("west.kubeconfig");
    std::fs::write(
        &kubeconfig,
        "apiVersion: v1
kind: Config
clusters: [{name: west, cluster: {server: 'https://127.0.0.1:1', insecure-skip-tls-verify: true}}]
users: [{name: admin, user: {token: t}}]
contexts: [{name: west, context: {cluster: west, user: admin}}]
current-context: west
",
    )
    .unwrap();
    let (ok, stderr) = run(&[
        "remote-secret",
        "--kubeconfig",
        kubeconfig.to_str().unwrap(),
        "--cluster-id",
        "west",
    ]);
    assert!(!ok);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(
        lines[0].contains("west")
            && lines[0].contains("127.0.0.1:1")
            && lines[0].contains("refused"),
        "{stderr}"
    );
}
