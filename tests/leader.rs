//! Leader election and the work only the leader does, against a test API server: two replicas race
//! safely (one leader, the CA secret created once), the leader's death hands over within the lease
//! duration, and the leader keeps the webhook configurations trusting our CA — after which the API
//! server's own admission calls inject pods and refuse invalid config.

mod common;

use std::time::{Duration, Instant};

use common::*;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ApiResource, DynamicObject, PostParams};
use kube::core::GroupVersionKind;
use kube::{Api, Client};
use meshpilot::install::{render, Object, Profile, Values};
use serde_json::{json, Value};
use test_apiserver::TestApiServer;

const LEASE: Duration = Duration::from_secs(3);
/// How long a takeover may take however busy the machine: a bound, not a measurement.
const TAKEOVER_BOUND: Duration = Duration::from_secs(30);

fn holder(api: &TestApiServer) -> Option<String> {
    api.get("Lease", "istio-system", "meshpilot-leader")?["spec"]["holderIdentity"]
        .as_str()
        .map(str::to_string)
}

fn replica(kubeconfig: &std::path::Path, identity: &str) -> MeshpilotProcess {
    MeshpilotProcess::spawn(&[
        "discovery",
        "--kubeconfig",
        kubeconfig.to_str().unwrap(),
        "--http-addr",
        "127.0.0.1:0",
        "--xds-addr",
        "127.0.0.1:0",
        "--secure-xds-addr",
        "127.0.0.1:0",
        "--leader-election-lease-duration",
        "3s",
        "--leader-identity",
        identity,
    ])
}

async fn ready(process: &MeshpilotProcess) {
    let admin = process.bound_addr("admin").await;
    wait_for("replica ready", Duration::from_secs(20), || async move {
        let (status, _) = http_get(admin, "/ready").await.ok()?;
        (status == 200).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_leader_creates_the_ca_once_and_hands_over_when_it_dies() {
    let api = TestApiServer::start().await;
    api.apply(
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "istio-system"}}),
    );
    let kubeconfig = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(kubeconfig.path(), api.kubeconfig(api.admin_token())).unwrap();

    let mut replicas = vec![
        ("a", replica(kubeconfig.path(), "a")),
        ("b", replica(kubeconfig.path(), "b")),
    ];
    for (_, process) in &replicas {
        ready(process).await;
    }
    let leader = wait_for("a leader", Duration::from_secs(10), || {
        let holder = holder(&api);
        async move { holder }
    })
    .await;
    assert_eq!(
        api.request_count("create:secrets"),
        1,
        "only the leader creates istio-ca-secret"
    );
    assert!(api
        .get("Secret", "istio-system", "istio-ca-secret")
        .is_some());

    // The leader dies without releasing the Lease; the other takes over once it has expired.
    let index = replicas.iter().position(|(id, _)| *id == leader).unwrap();
    let (_, dead) = replicas.remove(index);
    drop(dead);
    let killed = Instant::now();
    let (survivor, process) = &replicas[0];
    wait_for("the survivor leads", LEASE * 3, || {
        let holder = holder(&api);
        async move { (holder.as_deref() == Some(*survivor)).then_some(()) }
    })
    .await;
    eprintln!("handed over after {:?}", killed.elapsed());
    ready(process).await;
    assert_eq!(
        api.request_count("create:secrets"),
        1,
        "the CA secret is created once"
    );
}

fn webhook_configs() -> Vec<Value> {
    render(Profile::Primary, &Values::default())
        .unwrap()
        .into_iter()
        .filter(|o| o.kind().ends_with("WebhookConfiguration"))
        .map(|o: Object| serde_json::to_value(o).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_makes_the_api_server_call_our_webhooks() {
    let api = TestApiServer::start().await;
    for ns in [
        json!({"name": "istio-system"}),
        json!({"name": "shop", "labels": {"istio-injection": "enabled"}}),
        json!({"name": "plain"}),
    ] {
        api.apply(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": ns}));
    }
    for config in webhook_configs() {
        api.apply(config);
    }
    let kubeconfig = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(kubeconfig.path(), api.kubeconfig(api.admin_token())).unwrap();
    let mp = start_meshpilot_with(&[
        "--kubeconfig",
        kubeconfig.path().to_str().unwrap(),
        "--leader-election-lease-duration",
        "2s",
        "--cluster-id",
        "cluster-a",
    ])
    .await;
    api.route_service(
        "istio-system",
        "istiod",
        443,
        mp.webhook_addr.expect("the webhook served"),
    );

    // The leader sets our root as caBundle, then proves validation works and fails closed.
    wait_for(
        "caBundles set and validation failing closed",
        Duration::from_secs(20),
        || {
            let injector = api.get("MutatingWebhookConfiguration", "", "istio-sidecar-injector");
            let validator = api.get(
                "ValidatingWebhookConfiguration",
                "",
                "istio-validator-istio-system",
            );
            async move {
                let injector = injector?;
                let validator = validator?;
                let bundles = injector["webhooks"]
                    .as_array()?
                    .iter()
                    .all(|h| !h["clientConfig"]["caBundle"].is_null());
                let closed = validator["webhooks"]
                    .as_array()?
                    .iter()
                    .all(|h| h["failurePolicy"] == "Fail");
                (bundles && closed).then_some(())
            }
        },
    )
    .await;

    let config = kube::Config::from_custom_kubeconfig(
        kube::config::Kubeconfig::from_yaml(&api.kubeconfig(api.admin_token())).unwrap(),
        &Default::default(),
    )
    .await
    .unwrap();
    let client = Client::try_from(config).unwrap();
    let pod = |name: &str| -> Pod {
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [{"name": "app", "image": "app:v1"}]}
        }))
        .unwrap()
    };
    let created = Api::<Pod>::namespaced(client.clone(), "shop")
        .create(&PostParams::default(), &pod("web"))
        .await
        .expect("pod created");
    let containers: Vec<String> = created
        .spec
        .unwrap()
        .containers
        .into_iter()
        .map(|c| c.name)
        .collect();
    assert_eq!(
        containers,
        ["app", "istio-proxy"],
        "injected in an opted-in namespace"
    );
    let plain = Api::<Pod>::namespaced(client.clone(), "plain")
        .create(&PostParams::default(), &pod("web"))
        .await
        .expect("pod created");
    assert_eq!(
        plain.spec.unwrap().containers.len(),
        1,
        "not injected elsewhere"
    );

    let resource = ApiResource::from_gvk(&GroupVersionKind::gvk(
        "networking.istio.io",
        "v1",
        "DestinationRule",
    ));
    let rules: Api<DynamicObject> = Api::namespaced_with(client, "shop", &resource);
    let mut rule = DynamicObject::new("reviews", &resource);
    rule.data = json!({"spec": {"trafficPolicy": {"tls": {"mode": "SIMPLE"}}}});
    let error = rules
        .create(&PostParams::default(), &rule)
        .await
        .expect_err("refused");
    let message = match error {
        kube::Error::Api(status) => status.message,
        other => panic!("expected a refusal, got {other}"),
    };
    assert!(
        message.starts_with("admission webhook \"validation.istio.io\" denied the request: DestinationRule shop/reviews: "),
        "{message}"
    );
    rule.data = json!({"spec": {"host": "reviews"}});
    rules
        .create(&PostParams::default(), &rule)
        .await
        .expect("a valid rule is stored");
}

#[tokio::test]
async fn a_stale_lease_update_is_a_conflict() {
    use k8s_openapi::api::coordination::v1::Lease;
    let api = TestApiServer::start().await;
    api.apply(
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "istio-system"}}),
    );
    let config = kube::Config::from_custom_kubeconfig(
        kube::config::Kubeconfig::from_yaml(&api.kubeconfig(api.admin_token())).unwrap(),
        &Default::default(),
    )
    .await
    .unwrap();
    let leases: Api<Lease> = Api::namespaced(Client::try_from(config).unwrap(), "istio-system");
    let lease: Lease = serde_json::from_value(json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "l"}, "spec": {"holderIdentity": "a"}
    }))
    .unwrap();
    let read = leases.create(&PostParams::default(), &lease).await.unwrap();
    let second = leases.create(&PostParams::default(), &lease).await;
    assert!(
        matches!(second, Err(kube::Error::Api(s)) if s.code == 409),
        "already exists"
    );
    leases
        .replace("l", &PostParams::default(), &read)
        .await
        .expect("current version");
    let stale = leases.replace("l", &PostParams::default(), &read).await;
    assert!(
        matches!(&stale, Err(kube::Error::Api(s)) if s.code == 409 && s.message.contains("the object has been modified")),
        "{stale:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_renewals_hang_stops_its_work_before_another_takes_over() {
    use test_apiserver::User;
    let api = TestApiServer::start().await;
    let namespace =
        |name: &str| json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}});
    api.apply(namespace("istio-system"));
    // Each replica its own account, so the API server's write log says who wrote what.
    let kubeconfigs: Vec<tempfile::NamedTempFile> = ["a", "b"]
        .iter()
        .map(|r| {
            let token = format!("token-{r}");
            api.add_token(
                &token,
                User::service_account("istio-system", &format!("meshpilot-{r}")),
            );
            let file = tempfile::NamedTempFile::new().unwrap();
            std::fs::write(file.path(), api.kubeconfig(&token)).unwrap();
            file
        })
        .collect();
    let user = |r: &str| format!("system:serviceaccount:istio-system:meshpilot-{r}");
    let a = replica(kubeconfigs[0].path(), "a");
    ready(&a).await;
    wait_for("a leads", LEASE * 3, || {
        let holder = holder(&api);
        async move { (holder.as_deref() == Some("a")).then_some(()) }
    })
    .await;
    let b = replica(kubeconfigs[1].path(), "b");
    ready(&b).await;

    // a's Lease renewals hang from now on, while namespaces keep coming: the leader publishes the
    // root into each.
    api.hold(&user("a"), "update", "leases");
    let held = Instant::now();
    let mut created = 0;
    let mut pace = tokio::time::interval(Duration::from_millis(100));
    while holder(&api).as_deref() != Some("b") {
        assert!(held.elapsed() < TAKEOVER_BOUND, "b never took over");
        pace.tick().await;
        created += 1;
        api.apply(namespace(&format!("team-{created}")));
    }
    let last = format!("team-{}", created + 1);
    api.apply(namespace(&last));
    wait_for("the new leader publishes the root", LEASE * 3, || {
        let published = api.get("ConfigMap", &last, "istio-ca-root-cert").is_some();
        async move { published.then_some(()) }
    })
    .await;
    api.let_go(&user("a"), "update", "leases");

    let log = api.write_log();
    let takeover = log
        .iter()
        .find(|w| w.user == user("b") && w.plural == "leases")
        .expect("b's write of the Lease")
        .at;
    let late: Vec<_> = log
        .iter()
        .filter(|w| w.user == user("a") && w.at >= takeover)
        .collect();
    assert!(late.is_empty(), "a wrote after b took over: {late:?}");
    let early: Vec<_> = log
        .iter()
        .filter(|w| w.user == user("b") && w.plural != "leases" && w.at < takeover)
        .collect();
    assert!(
        early.is_empty(),
        "b did the leader's work before leading: {early:?}"
    );
    assert!(
        log.iter()
            .any(|w| w.user == user("a") && w.plural == "configmaps"),
        "a did leader work before"
    );
    eprintln!(
        "b took over {:?} after a's renewals hung; {created} namespaces meanwhile",
        takeover - held
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_leader_hands_over_at_once() {
    let api = TestApiServer::start().await;
    api.apply(
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "istio-system"}}),
    );
    let kubeconfig = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(kubeconfig.path(), api.kubeconfig(api.admin_token())).unwrap();
    let mut a = replica(kubeconfig.path(), "a");
    ready(&a).await;
    wait_for("a leads", LEASE * 3, || {
        let holder = holder(&api);
        async move { (holder.as_deref() == Some("a")).then_some(()) }
    })
    .await;
    // istiod's locks, competed for under meshpilot's own leadership: a takes every one.
    wait_for("a holds istiod's locks", TAKEOVER_BOUND, || {
        let held = istiod_locks(&api)
            .iter()
            .all(|(_, holder)| holder.as_deref() == Some("a"));
        async move { held.then_some(()) }
    })
    .await;
    let b = replica(kubeconfig.path(), "b");
    ready(&b).await;

    let terminated = Instant::now();
    a.terminate();
    let status = a.exited(Duration::from_secs(20)).await;
    assert!(status.success(), "{status}: {}", a.log());
    wait_for("b leads", LEASE * 3, || {
        let holder = holder(&api);
        async move { (holder.as_deref() == Some("b")).then_some(()) }
    })
    .await;
    eprintln!("handed over {:?} after SIGTERM", terminated.elapsed());
    // Released, not expired: a's last word on the Lease gave it up (no holder, a lease of a
    // second, as client-go releases), and b's acquisition came after it.
    let log = api.write_log();
    let lease_writes: Vec<_> = log.iter().filter(|w| w.plural == "leases").collect();
    let released = lease_writes
        .iter()
        .rposition(|w| {
            w.object["spec"]["holderIdentity"]
                .as_str()
                .unwrap_or_default()
                .is_empty()
        })
        .expect("a released the Lease");
    let spec = &lease_writes[released].object["spec"];
    assert_eq!(spec["leaseDurationSeconds"], 1, "{spec}");
    let taken = lease_writes
        .iter()
        .position(|w| w.object["spec"]["holderIdentity"] == "b")
        .expect("b took the Lease");
    assert!(taken > released, "b took the Lease before a released it");
    // a's shutdown gave up istiod's locks too (b, still running, never writes an empty holder).
    for (lock, holder) in istiod_locks(&api) {
        let released = (log.iter())
            .any(|w| w.name == lock && lock_holder(&w.object).is_some_and(|h| h.is_empty()));
        assert!(
            released,
            "a did not release {lock} (now held by {holder:?})"
        );
    }
}

/// istiod's locks of the default revision (pilot/pkg/leaderelection/leaderelection.go) with
/// their holders: ConfigMaps keep client-go's record in an annotation, Leases in their spec.
fn istiod_locks(api: &TestApiServer) -> Vec<(&'static str, Option<String>)> {
    let config_maps = [
        "istio-namespace-controller-election",
        "istio-ip-autoallocate",
        "istio-leader",
    ];
    let leases = [
        "istio-gateway-deployment-default",
        "istio-gateway-status-leader-default",
    ];
    let of_maps = config_maps.map(|name| {
        let object = api.get("ConfigMap", "istio-system", name);
        (name, object.as_ref().and_then(lock_holder))
    });
    let of_leases = leases.map(|name| {
        let object = api.get("Lease", "istio-system", name);
        (name, object.as_ref().and_then(lock_holder))
    });
    of_maps.into_iter().chain(of_leases).collect()
}

/// A lock object's holder identity: the ConfigMap annotation's record or the Lease's spec.
fn lock_holder(object: &Value) -> Option<String> {
    let annotation = &object["metadata"]["annotations"]["control-plane.alpha.kubernetes.io/leader"];
    let record: Value = match annotation.as_str() {
        Some(text) => serde_json::from_str(text).ok()?,
        None => object["spec"].clone(),
    };
    record["holderIdentity"]
        .as_str()
        .map(str::to_string)
        .or_else(|| record.is_object().then(String::new))
}
