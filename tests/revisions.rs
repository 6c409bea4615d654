//! Two control-plane revisions in one cluster, against a test API server, as a mesh moves from one
//! to the other: one root (istiod's `istio-ca-secret`, written beforehand, is used by both), each
//! revision patches only its own webhook configurations, the API server's admission calls reach
//! the revision a namespace names, config labelled for a revision is read by it alone, Gateways
//! are deployed by their owner only, and moving the `default` tag moves unlabelled Gateways between
//! meshpilot revisions and back. Against istiod's side stood in as istiod behaves: each Gateway
//! has one manager through docs/migrate.md; istiod's cluster-wide lock stays with the `default`
//! holder until the tag moves; `compare --istiod` reads a real istiod's recorded answers.

mod common;

use std::time::Duration;

use common::*;
use k8s_openapi::api::core::v1::Pod;
use kube::api::PostParams;
use kube::{Api, Client};
use meshpilot::install::{render, Object, Profile, Values};
use meshpilot::istio::{ConfigKey, ConfigKind};
use meshpilot::security::ca::CaBundle;
use serde_json::{json, Value};
use test_apiserver::{TestApiServer, User};

const BOUND: Duration = Duration::from_secs(30);

/// The webhook configurations `meshpilot manifest` renders for a revision.
fn webhook_configs(revision: &str) -> Vec<Value> {
    let values = Values {
        revision: revision.parse().unwrap(),
        ..Values::default()
    };
    render(Profile::Primary, &values)
        .unwrap()
        .into_iter()
        .filter(|o| o.kind().ends_with("WebhookConfiguration"))
        .map(|o: Object| serde_json::to_value(o).unwrap())
        .collect()
}

fn user(revision: &str) -> String {
    format!("system:serviceaccount:istio-system:istiod-{revision}")
}

/// A kubeconfig file whose token the API server knows as the revision's service account.
fn kubeconfig(api: &TestApiServer, revision: &str) -> tempfile::NamedTempFile {
    let token = format!("token-{revision}");
    api.add_token(
        &token,
        User::service_account("istio-system", &format!("istiod-{revision}")),
    );
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), api.kubeconfig(&token)).unwrap();
    file
}

async fn start(kubeconfig: &tempfile::NamedTempFile, revision: &str) -> meshpilot::app::Running {
    start_meshpilot_with(&[
        "--kubeconfig",
        kubeconfig.path().to_str().unwrap(),
        "--revision",
        revision,
        "--webhook-addr",
        "127.0.0.1:0",
        "--leader-identity",
        &format!("meshpilot-{revision}"),
        "--leader-election-lease-duration",
        "2s",
        "--gateway-handover-delay",
        "1s",
    ])
    .await
}

fn ca_bundles(api: &TestApiServer, kind: &str, name: &str) -> Option<Vec<String>> {
    let config = api.get(kind, "", name)?;
    config["webhooks"]
        .as_array()?
        .iter()
        .map(|h| h["clientConfig"]["caBundle"].as_str().map(str::to_string))
        .collect()
}

fn gateway(namespace: &str, name: &str) -> Value {
    json!({
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"gatewayClassName": "istio", "listeners": [{"name": "http", "port": 80, "protocol": "HTTP"}]}
    })
}

/// Who created the Deployment of a Gateway, once one exists.
fn deployed_by(api: &TestApiServer, namespace: &str, gateway: &str) -> Option<String> {
    let name = format!("{gateway}-istio");
    api.get("Deployment", namespace, &name)?;
    api.write_log()
        .into_iter()
        .find(|w| w.plural == "deployments" && w.namespace == namespace && w.name == name)
        .map(|w| w.user)
}

/// `istioctl tag set default --revision <revision>`, as istioctl/pkg/tag/generate.go renders it:
/// the default entries (istio-injection=enabled among them) calling the revision's Service, with
/// the caBundle copied from its injector, labelled with the tag and its target; the old
/// injector's selectors set to never match. Returns the old injector as it was.
fn tag_default(api: &TestApiServer, revision: &str) -> Value {
    let injector = format!("istio-sidecar-injector-{revision}");
    let bundle = api
        .get("MutatingWebhookConfiguration", "", &injector)
        .unwrap()["webhooks"][0]["clientConfig"]["caBundle"]
        .clone();
    let mut tag = webhook_configs("default")
        .into_iter()
        .find(|c| c["kind"] == "MutatingWebhookConfiguration")
        .unwrap();
    tag["metadata"]["name"] = json!("istio-revision-tag-default");
    tag["metadata"]["labels"]["istio.io/tag"] = json!("default");
    tag["metadata"]["labels"]["istio.io/rev"] = json!(revision);
    for hook in tag["webhooks"].as_array_mut().unwrap() {
        hook["clientConfig"]["service"]["name"] = json!(format!("istiod-{revision}"));
        hook["clientConfig"]["caBundle"] = bundle.clone();
    }
    let old_injector = api
        .get("MutatingWebhookConfiguration", "", "istio-sidecar-injector")
        .unwrap();
    let mut deactivated = old_injector.clone();
    let never = json!({"matchLabels": {"istio.io/deactivated": "never-match"}});
    for hook in deactivated["webhooks"].as_array_mut().unwrap() {
        hook["namespaceSelector"] = never.clone();
        hook["objectSelector"] = never.clone();
    }
    api.apply(tag);
    api.apply(deactivated);
    old_injector
}

fn holds(running: &meshpilot::app::Running, kind: ConfigKind, namespace: &str, name: &str) -> bool {
    let key = ConfigKey {
        kind,
        namespace: namespace.into(),
        name: name.into(),
    };
    running
        .aggregate
        .mesh()
        .snapshot()
        .config
        .get(&key)
        .is_some()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_revisions_share_the_root_and_each_keeps_to_its_own() {
    let api = TestApiServer::start().await;
    for ns in [
        json!({"name": "istio-system"}),
        json!({"name": "legacy", "labels": {"istio-injection": "enabled"}}),
        json!({"name": "moved", "labels": {"istio.io/rev": "canary"}}),
        json!({"name": "plain"}),
    ] {
        api.apply(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": ns}));
    }
    // istiod's self-signed root, as istiod 1.2x writes it.
    let root = CaBundle::self_signed_root("cluster.local", Duration::from_secs(86400)).unwrap();
    let b64 = |text: &str| base64::Engine::encode(&base64::engine::general_purpose::STANDARD, text);
    api.apply(json!({
        "apiVersion": "v1", "kind": "Secret", "type": "istio.io/ca-root",
        "metadata": {"name": "istio-ca-secret", "namespace": "istio-system"},
        "data": {
            "ca-cert.pem": b64(&root.ca_cert), "ca-key.pem": b64(&root.ca_key),
            "root-cert.pem": b64(&root.ca_cert), "cert-chain.pem": "", "key.pem": "",
        }
    }));
    for config in webhook_configs("default")
        .into_iter()
        .chain(webhook_configs("canary"))
    {
        api.apply(config);
    }
    let (default_config, canary_config) = (kubeconfig(&api, "default"), kubeconfig(&api, "canary"));
    let default = start(&default_config, "default").await;
    let canary = start(&canary_config, "canary").await;
    api.route_service("istio-system", "istiod", 443, default.webhook_addr.unwrap());
    api.route_service(
        "istio-system",
        "istiod-canary",
        443,
        canary.webhook_addr.unwrap(),
    );

    // One root: both sign with istiod's, and each webhook trusts it.
    for running in [&default, &canary] {
        assert_eq!(running.ca.current().root_pem().trim(), root.ca_cert.trim());
    }
    for (kind, name) in [
        ("MutatingWebhookConfiguration", "istio-sidecar-injector"),
        (
            "MutatingWebhookConfiguration",
            "istio-sidecar-injector-canary",
        ),
        (
            "ValidatingWebhookConfiguration",
            "istio-validator-istio-system",
        ),
        (
            "ValidatingWebhookConfiguration",
            "istio-validator-canary-istio-system",
        ),
    ] {
        wait_for(&format!("{name}'s caBundle"), BOUND, || {
            let bundles = ca_bundles(&api, kind, name);
            let root = root.ca_cert.clone();
            async move {
                let bundles = bundles?;
                let decoded = |b: &String| {
                    base64::Engine::decode(&base64::engine::general_purpose::STANDARD, b).ok()
                };
                bundles
                    .iter()
                    .all(|b| {
                        decoded(b)
                            .is_some_and(|pem| String::from_utf8_lossy(&pem).trim() == root.trim())
                    })
                    .then_some(())
            }
        })
        .await;
    }
    let secrets: Vec<String> = api
        .write_log()
        .into_iter()
        .filter(|w| w.plural == "secrets")
        .map(|w| format!("{} {}", w.user, w.name))
        .collect();
    assert!(secrets.is_empty(), "no second root: {secrets:?}");

    // The admission calls reach the revision the namespace names.
    let client = Client::try_from(
        kube::Config::from_custom_kubeconfig(
            kube::config::Kubeconfig::from_yaml(&api.kubeconfig(api.admin_token())).unwrap(),
            &Default::default(),
        )
        .await
        .unwrap(),
    )
    .unwrap();
    let create_pod = |namespace: &'static str| {
        let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
        async move {
            let pod: Pod = serde_json::from_value(json!({
                "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web"},
                "spec": {"containers": [{"name": "app", "image": "app:v1"}]}
            }))
            .unwrap();
            pods.create(&PostParams::default(), &pod)
                .await
                .expect("pod created")
        }
    };
    let ca_addr = |pod: &Pod| -> Option<String> {
        let proxy = pod
            .spec
            .as_ref()?
            .containers
            .iter()
            .find(|c| c.name == "istio-proxy")?;
        let env = proxy.env.as_ref()?.iter().find(|e| e.name == "CA_ADDR")?;
        env.value.clone()
    };
    let legacy = create_pod("legacy").await;
    assert_eq!(
        ca_addr(&legacy).as_deref(),
        Some("istiod.istio-system.svc:15012")
    );
    let moved = create_pod("moved").await;
    assert_eq!(
        ca_addr(&moved).as_deref(),
        Some("istiod-canary.istio-system.svc:15012")
    );
    assert_eq!(
        moved.metadata.annotations.unwrap()["istio.io/rev"],
        "canary"
    );
    assert_eq!(
        ca_addr(&create_pod("plain").await),
        None,
        "no revision named, none injects"
    );

    // Config labelled for a revision is read by it alone; unlabelled config by both.
    let rule = |name: &str, labels: Value| {
        json!({"apiVersion": "networking.istio.io/v1", "kind": "DestinationRule",
               "metadata": {"name": name, "namespace": "plain", "labels": labels},
               "spec": {"host": format!("{name}.plain.svc.cluster.local")}})
    };
    api.apply(rule("shared", json!({})));
    api.apply(rule("trial", json!({"istio.io/rev": "canary"})));
    let dr = ConfigKind::DestinationRule;
    wait_for("both read the shared rule, canary the trial", BOUND, || {
        let ready = holds(&default, dr, "plain", "shared")
            && holds(&canary, dr, "plain", "shared")
            && holds(&canary, dr, "plain", "trial");
        async move { ready.then_some(()) }
    })
    .await;
    assert!(
        !holds(&default, dr, "plain", "trial"),
        "default read canary's rule"
    );
    // Relabelled for the other revision: it moves.
    api.apply(rule("trial", json!({"istio.io/rev": "default"})));
    wait_for("the relabelled rule moves", BOUND, || {
        let moved = holds(&default, dr, "plain", "trial") && !holds(&canary, dr, "plain", "trial");
        async move { moved.then_some(()) }
    })
    .await;

    // Gateways: the namespace's revision, else the default revision, deploys them.
    api.apply(gateway("moved", "edge"));
    api.apply(gateway("plain", "front"));
    let owner = |namespace: &'static str, name: &'static str| {
        let api = &api;
        async move {
            wait_for(&format!("{namespace}/{name} deployed"), BOUND, || {
                let by = deployed_by(api, namespace, name);
                async move { by }
            })
            .await
        }
    };
    assert_eq!(owner("moved", "edge").await, user("canary"));
    assert_eq!(owner("plain", "front").await, user("default"));

    let old_injector = tag_default(&api, "canary");
    api.apply(gateway("plain", "after-tag"));
    assert_eq!(owner("plain", "after-tag").await, user("canary"));
    api.delete("Pod", "legacy", "web");
    let tagged = create_pod("legacy").await;
    assert_eq!(
        ca_addr(&tagged).as_deref(),
        Some("istiod-canary.istio-system.svc:15012"),
        "istio-injection=enabled follows the default tag"
    );
    // doctor sees the install as it now is.
    let doctor = tokio::process::Command::new(env!("CARGO_BIN_EXE_meshpilot"))
        .args([
            "doctor",
            "--kubeconfig",
            canary_config.path().to_str().unwrap(),
        ])
        .args(["--timeout", "5s"])
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    let report = String::from_utf8_lossy(&doctor.stdout).to_string();
    for line in [
        "revision canary (injector istio-sidecar-injector-canary; tags default): serves legacy, moved",
        "revision default (injector istio-sidecar-injector): serves no namespace",
    ] {
        assert!(report.contains(line), "{report}");
    }
    assert!(
        !report
            .lines()
            .any(|l| l.contains("FAIL") && l.contains("revisions")),
        "{report}"
    );

    // And back: the tag removed and the old injector restored, unlabelled Gateways and
    // istio-injection=enabled are the default revision's again.
    api.delete(
        "MutatingWebhookConfiguration",
        "",
        "istio-revision-tag-default",
    );
    let mut restored = old_injector;
    (restored["metadata"].as_object_mut().unwrap()).remove("resourceVersion");
    api.apply(restored);
    api.apply(gateway("plain", "after-rollback"));
    assert_eq!(owner("plain", "after-rollback").await, user("default"));
    api.delete("Pod", "legacy", "web");
    let back = create_pod("legacy").await;
    assert_eq!(
        ca_addr(&back).as_deref(),
        Some("istiod.istio-system.svc:15012")
    );

    // Neither touched the other's webhook configurations.
    for write in api.write_log() {
        if !write.plural.ends_with("webhookconfigurations") {
            continue;
        }
        let rev = write.object["metadata"]["labels"]["istio.io/rev"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        if write.user == user("default") || write.user == user("canary") {
            assert_eq!(
                write.user,
                user(&rev),
                "{} wrote {}",
                write.user,
                write.name
            );
        }
    }
}

/// The Deployment a Gateway of class `istio` is deployed as.
fn deployment_of(gateway: &str) -> String {
    format!("{gateway}-istio")
}

/// Who wrote a Gateway's Deployment since `mark`, in order, repeats merged: none or one name is
/// one writer; two names are a handover; three (A, B, A) are a fight.
fn deployment_writers(api: &TestApiServer, (namespace, gateway): Gw, mark: usize) -> Vec<String> {
    let name = deployment_of(gateway);
    let mut writers: Vec<String> = Vec::new();
    for w in &api.write_log()[mark..] {
        let ours = w.plural == "deployments" && w.namespace == namespace && w.name == name;
        if ours && writers.last() != Some(&w.user) {
            writers.push(w.user.clone());
        }
    }
    writers
}

/// What `user` wrote since `mark` of the Gateways' own objects (Deployment, Service,
/// ServiceAccount) or status.
fn touched_by(api: &TestApiServer, user: &str, gateways: &[Gw], mark: usize) -> Vec<String> {
    let ours = |w: &test_apiserver::Write| {
        gateways.iter().any(|(ns, gw)| {
            w.namespace == *ns
                && match w.plural.as_str() {
                    "gateways" => w.name == *gw,
                    "deployments" | "services" | "serviceaccounts" => w.name == deployment_of(gw),
                    _ => false,
                }
        })
    };
    api.write_log()[mark..]
        .iter()
        .filter(|w| w.user == user && ours(w))
        .map(|w| format!("{} {} {}/{}", w.verb, w.plural, w.namespace, w.name))
        .collect()
}

/// The revision that rendered a Gateway's Deployment (its pod template's `istio.io/rev`).
fn rendered_by(api: &TestApiServer, (namespace, gateway): Gw) -> Option<String> {
    let deployment = api.get("Deployment", namespace, &deployment_of(gateway))?;
    let annotations = &deployment["spec"]["template"]["metadata"]["annotations"];
    annotations["istio.io/rev"].as_str().map(str::to_string)
}

async fn wait_rendered(api: &TestApiServer, gateways: &[Gw], revision: &str) {
    for gateway in gateways {
        wait_for(
            &format!("{gateway:?} rendered by {revision}"),
            BOUND,
            || {
                let by = rendered_by(api, *gateway);
                async move { (by.as_deref() == Some(revision)).then_some(()) }
            },
        )
        .await;
    }
}

/// Waits while canary's gateway loop runs on: until it has renewed its
/// `istio-gateway-deployment-canary` Lease ten more times (every third of a second: its lease is
/// 2 s), past its handover delay (1 s) and two of its passes (one a second).
async fn quiet(api: &TestApiServer) {
    let renewals = || {
        (api.write_log().iter())
            .filter(|w| w.user == user("canary") && w.name == "istio-gateway-deployment-canary")
            .count()
    };
    let start = renewals();
    wait_for("canary's gateway loop to run on", BOUND, || {
        let done = renewals() >= start + 10;
        async move { done.then_some(()) }
    })
    .await;
}

async fn doctor(kubeconfig: &tempfile::NamedTempFile) -> String {
    let doctor = tokio::process::Command::new(env!("CARGO_BIN_EXE_meshpilot"))
        .args([
            "doctor",
            "--kubeconfig",
            kubeconfig.path().to_str().unwrap(),
        ])
        .args(["--timeout", "5s"])
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    String::from_utf8_lossy(&doctor.stdout).to_string()
}

/// A Gateway: (namespace, name).
type Gw = (&'static str, &'static str);

/// docs/migrate.md walked through against istiod's side stood in as istiod behaves
/// (tests/common/istiod_gateways.rs: istiod's own `IsMine`, its identity, its Lease, and foreign
/// writes to its Deployments reverted): at every step, each Gateway's Deployment is written by
/// one control plane only — istiod `default` keeps every unlabelled Gateway (and those of a
/// namespace labelled `default`) while it runs, even once the default tag points at canary;
/// canary takes what names it, and the rest once istiod is gone; nothing in canary's first moments
/// before its stores have listed; and gives everything back the moment istiod is reinstalled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_gateway_has_one_manager_through_the_migration() {
    use common::istiod_gateways::{istiod_user, IstiodGateways};

    let api = TestApiServer::start().await;
    for ns in [
        json!({"name": "istio-system"}),
        json!({"name": "legacy", "labels": {"istio-injection": "enabled"}}),
        json!({"name": "shop"}),
        json!({"name": "plain"}),
        json!({"name": "pinned", "labels": {"istio.io/rev": "default"}}),
    ] {
        api.apply(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": ns}));
    }
    for config in webhook_configs("default")
        .into_iter()
        .chain(webhook_configs("canary"))
    {
        api.apply(config);
    }
    // The default revision, as Istio's base chart names it
    // (manifests/charts/base/templates/defaultrevision-validatingwebhookconfiguration.yaml).
    let validator = |revision: &str| {
        json!({"apiVersion": "admissionregistration.k8s.io/v1",
               "kind": "ValidatingWebhookConfiguration",
               "metadata": {"name": "istiod-default-validator",
                            "labels": {"istio.io/rev": revision}},
               "webhooks": []})
    };
    api.apply(validator("default"));
    let (web, front, old, fixed, trial) = (
        ("shop", "web"),
        ("plain", "front"),
        ("legacy", "old"),
        ("pinned", "fixed"),
        ("plain", "trial"),
    );
    for (ns, name) in [web, front, old, fixed] {
        api.apply(gateway(ns, name));
    }
    let mut labelled = gateway(trial.0, trial.1);
    labelled["metadata"]["labels"] = json!({"istio.io/rev": "canary"});
    api.apply(labelled);
    let (istiod, canary) = (istiod_user("default"), user("canary"));
    let one_writer = |step: &str, gateway: Gw, mark: usize, expected: &[&String]| {
        let writers = deployment_writers(&api, gateway, mark);
        let expected: Vec<String> = expected.iter().map(|u| u.to_string()).collect();
        assert_eq!(
            writers, expected,
            "{step}: who wrote {gateway:?}'s Deployment"
        );
    };

    // 0. istiod `default` alone deploys every Gateway but the one labelled for canary.
    let running = IstiodGateways::start(&api, "default", "istiod-1").await;
    wait_rendered(&api, &[web, front, old, fixed], "default").await;
    assert_eq!(rendered_by(&api, trial), None);

    // 1. Install canary: it takes what names it, nothing istiod claims.
    let mark = api.write_log().len();
    let canary_config = kubeconfig(&api, "canary");
    let mut mp = start(&canary_config, "canary").await;
    wait_rendered(&api, &[trial], "canary").await;
    quiet(&api).await;
    let istiods = [web, front, old, fixed];
    assert_eq!(
        touched_by(&api, &canary, &istiods, mark),
        Vec::<String>::new()
    );
    for gw in istiods {
        one_writer("install", gw, mark, &[]);
    }
    one_writer("install", trial, mark, &[&canary]);

    // 2. doctor names each Gateway's manager.
    let report = doctor(&canary_config).await;
    for line in [
        "plain/front: istiod default manages it — no istio.io/rev on it or its namespace plain",
        "pinned/fixed: istiod default manages it — namespace pinned is labelled istio.io/rev=default",
        "plain/trial: meshpilot canary manages it — labelled istio.io/rev=canary. Deployment trial-istio rendered by canary",
    ] {
        assert!(report.contains(line), "{line}\n{report}");
    }

    // 3. Move one namespace, back, and again: it changes hands each time, once.
    let relabel = |labels: Value| {
        api.apply(json!({"apiVersion": "v1", "kind": "Namespace",
                         "metadata": {"name": "shop", "labels": labels}}));
    };
    for (labels, to) in [
        (json!({"istio.io/rev": "canary"}), (&canary, "canary")),
        (json!({}), (&istiod, "default")),
        (json!({"istio.io/rev": "canary"}), (&canary, "canary")),
    ] {
        let mark = api.write_log().len();
        relabel(labels);
        wait_rendered(&api, &[web], to.1).await;
        quiet(&api).await;
        one_writer("move shop", web, mark, &[to.0]);
        for gw in [front, old, fixed, trial] {
            one_writer("move shop", gw, mark, &[]);
        }
    }

    // 4. Move the default tag: istiod `default` keeps the unlabelled Gateways, old and new, and
    // those of `pinned`; canary writes none of them, nor their status.
    let mark = api.write_log().len();
    tag_default(&api, "canary");
    api.apply(validator("canary"));
    let after_tag = ("plain", "after-tag");
    api.apply(gateway(after_tag.0, after_tag.1));
    wait_rendered(&api, &[after_tag], "default").await;
    quiet(&api).await;
    let istiods = [front, old, fixed, after_tag];
    assert_eq!(
        touched_by(&api, &canary, &istiods, mark),
        Vec::<String>::new()
    );
    for gw in [front, old, fixed] {
        one_writer("tag moved", gw, mark, &[]);
    }
    one_writer("tag moved", after_tag, mark, &[&istiod]);
    let report = doctor(&canary_config).await;
    let line = "plain/front: istiod default manages it — no istio.io/rev on it or its namespace plain, which istiod default claims while it runs (pod istiod-1, Lease istio-gateway-deployment-default held by istiod-1); meshpilot canary takes it once istiod default is gone";
    assert!(report.contains(line), "{report}");

    // 4b. canary restarted meanwhile: before its stores have listed it knows of no istiod, and
    // must claim nothing.
    let mark = api.write_log().len();
    mp.shutdown().await;
    let held = ["namespaces", "pods", "leases"];
    for plural in held {
        api.hold(&canary, "list", plural);
    }
    let config = canary_config.path().to_str().unwrap().to_string();
    mp = start_meshpilot_unready(&[
        "--kubeconfig",
        &config,
        "--revision",
        "canary",
        "--leader-identity",
        "meshpilot-canary",
        "--leader-election-lease-duration",
        "2s",
        "--gateway-handover-delay",
        "1s",
    ])
    .await;
    quiet(&api).await;
    assert_eq!(
        touched_by(&api, &canary, &istiods, mark),
        Vec::<String>::new()
    );
    for plural in held {
        api.let_go(&canary, "list", plural);
    }
    quiet(&api).await;
    assert_eq!(
        touched_by(&api, &canary, &istiods, mark),
        Vec::<String>::new()
    );
    for gw in istiods {
        one_writer("canary restarted", gw, mark, &[]);
    }

    // 5. Remove istiod: canary takes the rest, each once, after istiod stopped.
    let mark = api.write_log().len();
    running.stop(&api).await;
    wait_rendered(&api, &istiods, "canary").await;
    quiet(&api).await;
    for gw in istiods {
        one_writer("istiod removed", gw, mark, &[&canary]);
    }
    let status = touched_by(&api, &canary, &[front], mark);
    assert!(
        status.contains(&"patch-status gateways plain/front".to_string()),
        "{status:?}"
    );
    let report = doctor(&canary_config).await;
    for line in [
        "plain/front: meshpilot canary manages it — no istio.io/rev on it or its namespace plain. Deployment front-istio rendered by canary",
        "pinned/fixed: meshpilot canary manages it — namespace pinned is labelled istio.io/rev=default",
    ] {
        assert!(report.contains(line), "{line}\n{report}");
    }

    // 6. Roll back: reinstall istiod `default`. Its pod exists before its process runs; canary
    // lets go then, even of a Gateway that changes meanwhile.
    let mark = api.write_log().len();
    IstiodGateways::schedule(&api, "default", "istiod-2");
    let mut changed = gateway(front.0, front.1);
    changed["spec"]["listeners"][0]["port"] = json!(8080);
    api.apply(changed.clone());
    quiet(&api).await;
    assert_eq!(
        touched_by(&api, &canary, &istiods, mark),
        Vec::<String>::new()
    );
    let running = IstiodGateways::start(&api, "default", "istiod-2").await;
    wait_rendered(&api, &istiods, "default").await;
    quiet(&api).await;
    for gw in istiods {
        one_writer("istiod reinstalled", gw, mark, &[&istiod]);
    }
    for gw in [web, trial] {
        one_writer("istiod reinstalled", gw, mark, &[]);
    }

    // 7. istiod moved out of the cluster (an external control plane: no pod here, only its
    // Lease): canary still keeps off.
    let mark = api.write_log().len();
    running.stop(&api).await;
    let remote = IstiodGateways::start_remote(&api, "default", "istiod-external").await;
    changed["spec"]["listeners"][0]["port"] = json!(8081);
    api.apply(changed);
    quiet(&api).await;
    assert_eq!(
        touched_by(&api, &canary, &istiods, mark),
        Vec::<String>::new()
    );

    remote.stop(&api).await;
    mp.shutdown().await;
}

/// istiod's cluster-wide lock for the root ConfigMaps (`istio-namespace-controller-election`),
/// held by istiod `default` in istiod's own record and renewed every half second on a 2 s lease
/// (tests/common/istiod_lock.rs): canary, whose revision the `default` tag does not name, never
/// takes it while it is renewed, nor publishes a root; once the tag names canary it takes it at
/// once (istiod's `LocationPrioritizedComparison`), and istiod, no longer the tag's revision, keeps
/// off it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istiods_lock_stays_with_the_default_revision_until_the_tag_moves() {
    use common::istiod_lock::IstiodLock;

    let api = TestApiServer::start().await;
    for ns in ["istio-system", "shop"] {
        api.apply(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}));
    }
    for config in webhook_configs("default")
        .into_iter()
        .chain(webhook_configs("canary"))
    {
        api.apply(config);
    }
    let lock = "istio-namespace-controller-election";
    let istiod = IstiodLock::start(&api, "default", "istiod-1", lock, Duration::from_secs(2)).await;
    istiod.led().await;
    let holder = || {
        let map = api.get("ConfigMap", "istio-system", lock)?;
        let text = map["metadata"]["annotations"]["control-plane.alpha.kubernetes.io/leader"]
            .as_str()?
            .to_string();
        let record: Value = serde_json::from_str(&text).ok()?;
        Some(format!("{} {}", record["holderIdentity"], record["holderKey"]).replace('"', ""))
    };
    let canary_wrote =
        |name: &str| (api.write_log().iter()).any(|w| w.user == user("canary") && w.name == name);
    let mp = start(&kubeconfig(&api, "canary"), "canary").await;
    wait_for("canary leads its revision", BOUND, || {
        let lease = api.get("Lease", "istio-system", "meshpilot-leader-canary");
        let leads = lease.is_some_and(|l| l["spec"]["holderIdentity"] == "meshpilot-canary");
        async move { leads.then_some(()) }
    })
    .await;
    // Three of istiod's lease durations: canary tries a dozen times meanwhile.
    let renewed = istiod.renewals();
    wait_for("istiod to renew twelve times", BOUND, || {
        assert_eq!(holder().as_deref(), Some("istiod-1 default"), "the holder");
        let done = istiod.renewals() >= renewed + 12;
        async move { done.then_some(()) }
    })
    .await;
    assert!(!canary_wrote(lock), "canary wrote istiod's lock");
    assert!(
        !canary_wrote("istio-ca-root-cert"),
        "canary published a root"
    );

    tag_default(&api, "canary");
    wait_for("canary takes the lock", BOUND, || {
        let taken = holder().as_deref() == Some("meshpilot-canary canary");
        async move { taken.then_some(()) }
    })
    .await;
    wait_for("canary publishes the root", BOUND, || {
        let published = canary_wrote("istio-ca-root-cert");
        async move { published.then_some(()) }
    })
    .await;
    let renewed = istiod.renewals();
    let tries = api.write_log().len();
    wait_for("istiod to try on", BOUND, || {
        assert_eq!(holder().as_deref(), Some("meshpilot-canary canary"));
        let canary_renewed = (api.write_log()[tries..].iter())
            .filter(|w| w.user == user("canary") && w.name == lock)
            .count();
        async move { (canary_renewed >= 12).then_some(()) }
    })
    .await;
    assert_eq!(istiod.renewals(), renewed, "istiod took the lock back");
    assert!(!istiod.leading());
    istiod.stop();
    mp.shutdown().await;
}

/// `meshpilot compare --istiod` against what a real istiod answered, in istiod's own debug
/// formats: istiod's side replays the fidelity corpus's recorded xDS of `bookinfo-sidecar` (two
/// proxies in `shop`, and one of another namespace, which is left out) as `syncz` and
/// `config_dump` answers (tests/common/recorded_istiod.rs); meshpilot serves the same scenario.
/// Every difference is one docs/fidelity.md accepts, as tests/fidelity.rs finds comparing the
/// corpus's files; a load balancer then given to meshpilot only is named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compare_istiod_reads_what_a_real_istiod_answered() {
    use common::fidelity_corpus::{fixture, proxies, serving, yaml_docs, Serving};
    use common::istiod_gateways::client_as;
    use common::recorded_istiod::RecordedIstiod;

    let Serving { api, work, mp, .. } = serving("bookinfo-sidecar").await;
    api.apply(json!({"apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"name": "meshpilot", "namespace": "istio-system"}}));
    let reviewer = User::service_account("istio-system", "istiod");
    let client = client_as(&api, "token-istiod", reviewer).await;
    let mut connected = proxies("bookinfo-sidecar");
    connected.extend(proxies("external-services"));
    let istiod = RecordedIstiod::serve(client, &connected).await;
    let root = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(root.path(), &istiod.root).unwrap();
    let kubeconfig = work.path().join("kubeconfig");
    let compare = || {
        tokio::process::Command::new(env!("CARGO_BIN_EXE_meshpilot"))
            .args(["compare", &format!("127.0.0.1:{}", mp.xds_addr.port())])
            .args(["--istiod", &istiod.addr.to_string()])
            .args(["--namespace", "shop"])
            .args(["--kubeconfig", kubeconfig.to_str().unwrap()])
            .args(["--istiod-root", root.path().to_str().unwrap()])
            .args([
                "--accept",
                concat!(env!("CARGO_MANIFEST_DIR"), "/docs/fidelity.md"),
            ])
            .kill_on_drop(true)
            .output()
    };
    let output = compare().await.unwrap();
    let text = String::from_utf8_lossy(&output.stdout).to_string()
        + &String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{text}");
    assert!(text.contains("2 proxies compared"), "{text}");

    // The scenario's own rule for reviews, given a load balancer.
    let mut rule = (yaml_docs(&fixture("bookinfo-sidecar").join("mesh.yaml")).into_iter())
        .find(|o| o["kind"] == "DestinationRule" && o["metadata"]["name"] == "reviews")
        .unwrap();
    rule["spec"]["trafficPolicy"]["loadBalancer"] = json!({"simple": "RANDOM"});
    api.apply(rule);
    let productpage = "sidecar~10.20.0.5~productpage-v1-d199d.shop~shop.svc.cluster.local";
    let difference =
        format!("{productpage}: cds outbound|9080||reviews.shop.svc.cluster.local lb_policy");
    let text = wait_for("meshpilot sends the new load balancer", BOUND, || async {
        let output = compare().await.unwrap();
        let text = String::from_utf8_lossy(&output.stdout).to_string();
        (output.status.code() == Some(1) && text.contains(&difference)).then_some(text)
    })
    .await;
    assert!(text.contains("2 proxies compared"), "{text}");
}

/// istiod rotates its self-signed root (writing only `ca-cert.pem` and `ca-key.pem` of
/// `istio-ca-secret`): a meshpilot revision follows, trusting the new root beside the old.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_root_rotated_by_istiod_is_followed() {
    let api = TestApiServer::start().await;
    api.apply(
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "istio-system"}}),
    );
    let b64 = |text: &str| base64::Engine::encode(&base64::engine::general_purpose::STANDARD, text);
    let secret = |ca: &CaBundle, root: &CaBundle| {
        json!({
            "apiVersion": "v1", "kind": "Secret", "type": "istio.io/ca-root",
            "metadata": {"name": "istio-ca-secret", "namespace": "istio-system"},
            "data": {
                "ca-cert.pem": b64(&ca.ca_cert), "ca-key.pem": b64(&ca.ca_key),
                "root-cert.pem": b64(&root.ca_cert), "cert-chain.pem": "", "key.pem": "",
            }
        })
    };
    let lifetime = Duration::from_secs(86400);
    let old = CaBundle::self_signed_root("cluster.local", lifetime).unwrap();
    api.apply(secret(&old, &old));
    let config = kubeconfig(&api, "canary");
    let canary = start_meshpilot_with(&[
        "--kubeconfig",
        config.path().to_str().unwrap(),
        "--revision",
        "canary",
        "--webhook-addr",
        "127.0.0.1:0",
        "--self-signed-root-check-interval",
        "1s",
    ])
    .await;
    assert_eq!(canary.ca.current().root_pem().trim(), old.ca_cert.trim());

    let new = CaBundle::self_signed_root("cluster.local", lifetime).unwrap();
    api.apply(secret(&new, &old));
    wait_for("the rotated root followed", BOUND, || {
        let roots = canary.ca.current().root_pem().to_string();
        let old = old.ca_cert.clone();
        let new = new.ca_cert.clone();
        async move { (roots.starts_with(new.trim()) && roots.contains(old.trim())).then_some(()) }
    })
    .await;
    let (chain, _) = canary
        .ca
        .current()
        .issue_workload(
            &meshpilot::security::identity::Identity::new("cluster.local", "shop", "web"),
            Duration::from_secs(3600),
        )
        .unwrap();
    assert!(
        chain.concat().contains(new.ca_cert.trim()),
        "workloads are signed by the new root"
    );
}
