//! The admission webhooks on their TLS port, called as the API server calls them: a pod's
//! AdmissionReview gets a JSON patch that, applied, gives Istio's sidecar; opt-out and
//! re-injection behave as istiod's; `meshpilot inject` gives the same pod; an invalid Istio object
//! is refused with the config store's message.

mod common;

use std::path::Path;
use std::process::Command;

use base64::Engine;
use common::*;
use meshpilot::istio::{ConfigObject, Origin};
use serde_json::{json, Value};

const POD: &str = r#"{
  "apiVersion": "v1", "kind": "Pod",
  "metadata": {
    "name": "reviews-v1-7f9c8d-x1", "namespace": "shop",
    "labels": {"app": "reviews", "version": "v1", "pod-template-hash": "7f9c8d"},
    "annotations": {
      "proxy.istio.io/config": "{\"proxyMetadata\": {\"ISTIO_META_DNS_CAPTURE\": \"true\"}}",
      "traffic.sidecar.istio.io/excludeInboundPorts": "9000",
      "traffic.sidecar.istio.io/includeOutboundIPRanges": "10.0.0.0/8",
      "sidecar.istio.io/proxyCPU": "250m"
    },
    "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "reviews-v1-7f9c8d",
                         "uid": "u1", "controller": true}]
  },
  "spec": {
    "serviceAccountName": "reviews",
    "containers": [{"name": "reviews", "image": "reviews:v1",
                    "ports": [{"containerPort": 9080, "name": "http", "protocol": "TCP"}]}]
  }
}"#;

const FLAGS: &[&str] = &["--cluster-id", "cluster-a", "--network", "net-a"];

struct Webhook {
    mp: meshpilot::app::Running,
    _dir: tempfile::TempDir,
}

impl Webhook {
    async fn start() -> Self {
        Self::start_with_config("").await
    }

    /// With `config` (Istio objects) among the config files.
    async fn start_with_config(config: &str) -> Self {
        let dir = copy_tree(Path::new(EXAMPLE));
        if !config.is_empty() {
            std::fs::create_dir_all(dir.path().join("config")).unwrap();
            std::fs::write(dir.path().join("config/injection.yaml"), config).unwrap();
        }
        let mp = start_meshpilot(dir.path(), FLAGS).await;
        Self { mp, _dir: dir }
    }

    /// POSTs an AdmissionReview for `object`; returns the `response`.
    async fn review(&self, path: &str, version: &str, object: &Value) -> Value {
        let review = json!({
            "apiVersion": format!("admission.k8s.io/{version}"), "kind": "AdmissionReview",
            "request": {
                "uid": "uid-1",
                "kind": {"group": "", "version": "v1", "kind": object["kind"]},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "namespace": object["metadata"]["namespace"],
                "operation": "CREATE",
                "userInfo": {"username": "admin"},
                "object": object,
                "dryRun": false
            }
        });
        let (status, body) = https::post(
            self.mp.webhook_addr.expect("the webhook served"),
            "istiod.istio-system.svc",
            self.mp.ca.current().root_pem(),
            path,
            &review.to_string(),
        )
        .await
        .expect("webhook reachable over TLS as istiod.istio-system.svc");
        assert_eq!(status, 200, "{body}");
        let reply: Value = serde_json::from_str(&body).expect("JSON");
        assert_eq!(reply["apiVersion"], format!("admission.k8s.io/{version}"));
        assert_eq!(reply["response"]["uid"], "uid-1");
        reply["response"].clone()
    }

    /// The pod as the API server would store it after the webhook's patch.
    async fn inject(&self, path: &str, pod: &Value) -> Value {
        let response = self.review(path, "v1", pod).await;
        assert_eq!(response["allowed"], true, "{response}");
        apply(pod, &response)
    }
}

fn apply(object: &Value, response: &Value) -> Value {
    let mut object = object.clone();
    if response["patch"].is_null() {
        return object;
    }
    assert_eq!(response["patchType"], "JSONPatch");
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(response["patch"].as_str().expect("base64 patch"))
        .expect("base64");
    let patch: json_patch::Patch = serde_json::from_slice(&bytes).expect("a JSON patch");
    json_patch::patch(&mut object, &patch).expect("the patch applies");
    object
}

fn container<'a>(pod: &'a Value, list: &str, name: &str) -> &'a Value {
    pod["spec"][list]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["name"] == name))
        .unwrap_or_else(|| panic!("no {list} {name} in {pod}"))
}

fn env(container: &Value, name: &str) -> Value {
    container["env"]
        .as_array()
        .and_then(|e| e.iter().find(|e| e["name"] == name))
        .map(|e| e["value"].clone())
        .unwrap_or_else(|| panic!("no env {name}"))
}

fn names(pod: &Value, list: &str) -> Vec<String> {
    pod["spec"][list]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| c["name"].as_str().unwrap_or_default().to_string())
        .collect()
}

#[tokio::test]
async fn a_pod_gets_istios_sidecar() {
    let hook = Webhook::start().await;
    let pod: Value = serde_json::from_str(POD).unwrap();
    let injected = hook.inject("/inject", &pod).await;

    assert_eq!(names(&injected, "containers"), ["reviews", "istio-proxy"]);
    assert_eq!(names(&injected, "initContainers"), ["istio-init"]);
    let init = container(&injected, "initContainers", "istio-init");
    let args: Vec<&str> = init["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(&args[..3], ["istio-iptables", "-p", "15001"]);
    let arg = |flag: &str| args[args.iter().position(|a| *a == flag).unwrap() + 1];
    assert_eq!(arg("-d"), "15090,15021,9000,15020");
    assert_eq!(arg("-i"), "10.0.0.0/8");
    assert_eq!(arg("-m"), "REDIRECT");
    assert_eq!(
        init["securityContext"]["capabilities"]["add"],
        json!(["NET_ADMIN", "NET_RAW"])
    );

    let proxy = container(&injected, "containers", "istio-proxy");
    assert_eq!(proxy["image"], "docker.io/istio/proxyv2:1.27.0");
    assert_eq!(
        proxy["args"].as_array().unwrap()[..4],
        [
            json!("proxy"),
            json!("sidecar"),
            json!("--domain"),
            json!("$(POD_NAMESPACE).svc.cluster.local")
        ]
    );
    assert_eq!(env(proxy, "CA_ADDR"), "istiod.istio-system.svc:15012");
    assert_eq!(env(proxy, "PILOT_CERT_PROVIDER"), "istiod");
    assert_eq!(env(proxy, "ISTIO_META_CLUSTER_ID"), "cluster-a");
    assert_eq!(env(proxy, "ISTIO_META_NETWORK"), "net-a");
    assert_eq!(env(proxy, "ISTIO_META_MESH_ID"), "cluster.local");
    assert_eq!(env(proxy, "TRUST_DOMAIN"), "cluster.local");
    assert_eq!(env(proxy, "ISTIO_META_WORKLOAD_NAME"), "reviews-v1");
    assert_eq!(
        env(proxy, "ISTIO_META_OWNER"),
        "kubernetes://apis/apps/v1/namespaces/shop/deployments/reviews-v1"
    );
    assert_eq!(env(proxy, "ISTIO_META_APP_CONTAINERS"), "reviews");
    assert_eq!(env(proxy, "ISTIO_META_DNS_CAPTURE"), "true");
    let ports: Value =
        serde_json::from_str(env(proxy, "ISTIO_META_POD_PORTS").as_str().unwrap()).unwrap();
    assert_eq!(ports[0]["containerPort"], 9080);
    let proxy_config: Value =
        serde_json::from_str(env(proxy, "PROXY_CONFIG").as_str().unwrap()).unwrap();
    assert_eq!(
        proxy_config["discoveryAddress"],
        "istiod.istio-system.svc:15012"
    );
    assert_eq!(
        proxy_config["proxyMetadata"]["ISTIO_META_DNS_CAPTURE"],
        "true"
    );
    assert_eq!(proxy["resources"]["requests"]["cpu"], "250m");
    assert_eq!(proxy["readinessProbe"]["httpGet"]["port"], 15021);
    assert_eq!(proxy["securityContext"]["runAsUser"], 1337);

    let volumes = &injected["spec"]["volumes"];
    let volume = |name: &str| {
        volumes
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("no volume {name}"))
            .clone()
    };
    let token = &volume("istio-token")["projected"]["sources"][0]["serviceAccountToken"];
    assert_eq!(token["audience"], "istio-ca");
    assert_eq!(
        volume("istiod-ca-cert")["configMap"]["name"],
        "istio-ca-root-cert"
    );
    assert_eq!(volume("istio-envoy")["emptyDir"]["medium"], "Memory");

    let meta = &injected["metadata"];
    assert_eq!(meta["labels"]["security.istio.io/tlsMode"], "istio");
    assert_eq!(meta["labels"]["service.istio.io/canonical-name"], "reviews");
    assert_eq!(meta["labels"]["topology.istio.io/network"], "net-a");
    assert_eq!(
        meta["annotations"]["kubectl.kubernetes.io/default-container"],
        "reviews"
    );
    let status: Value = serde_json::from_str(
        meta["annotations"]["sidecar.istio.io/status"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(status["containers"], json!(["istio-proxy"]));
    assert_eq!(status["initContainers"], json!(["istio-init"]));
    assert_eq!(status["revision"], "default");

    // Re-injecting the injected pod changes nothing (the API server may call twice).
    assert_eq!(hook.inject("/inject", &injected).await, injected);
}

#[tokio::test]
async fn opt_outs_are_left_alone_and_bad_annotations_refused() {
    let hook = Webhook::start().await;
    let base: Value = serde_json::from_str(POD).unwrap();

    let mut opted_out = base.clone();
    opted_out["metadata"]["labels"]["sidecar.istio.io/inject"] = json!("false");
    let response = hook.review("/inject", "v1", &opted_out).await;
    assert_eq!(response["allowed"], true);
    assert!(response["patch"].is_null(), "{response}");

    let mut host = base.clone();
    host["spec"]["hostNetwork"] = json!(true);
    assert!(hook.review("/inject", "v1", &host).await["patch"].is_null());

    let mut bad = base.clone();
    bad["metadata"]["annotations"]["traffic.sidecar.istio.io/excludeInboundPorts"] =
        json!("9000,http");
    let response = hook.review("/inject", "v1", &bad).await;
    assert_eq!(response["allowed"], false);
    let message = response["status"]["message"].as_str().unwrap();
    assert!(
        message.contains("shop/reviews-v1-7f9c8d-x1")
            && message.contains("traffic.sidecar.istio.io/excludeInboundPorts")
            && message.contains("\"http\" is not a port"),
        "{message}"
    );
}

#[tokio::test]
async fn a_remote_clusters_path_names_its_cluster_and_network() {
    let hook = Webhook::start().await;
    let pod: Value = serde_json::from_str(POD).unwrap();
    // v1beta1, the first version Istio's webhook configurations list.
    let response = hook
        .review("/inject/cluster/west/net/net-b", "v1beta1", &pod)
        .await;
    let injected = apply(&pod, &response);
    let proxy = container(&injected, "containers", "istio-proxy");
    assert_eq!(env(proxy, "ISTIO_META_CLUSTER_ID"), "west");
    assert_eq!(env(proxy, "ISTIO_META_NETWORK"), "net-b");
    assert_eq!(
        injected["metadata"]["labels"]["topology.istio.io/network"],
        "net-b"
    );
}

#[tokio::test]
async fn meshpilot_inject_gives_the_webhooks_pod() {
    let hook = Webhook::start().await;
    let pod: Value = serde_json::from_str(POD).unwrap();
    let from_webhook = hook.inject("/inject", &pod).await;

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("pod.yaml");
    std::fs::write(&file, serde_yaml_ng::to_string(&pod).unwrap()).unwrap();
    let mut args = vec!["inject", "-f", file.to_str().unwrap()];
    args.extend_from_slice(FLAGS);
    let out = Command::new(env!("CARGO_BIN_EXE_meshpilot"))
        .args(&args)
        .output()
        .expect("run meshpilot inject");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let offline: Value = serde_yaml_ng::from_slice(&out.stdout).expect("YAML");
    assert_eq!(offline, from_webhook);

    // A Deployment's pod template is injected too; the workload is the Deployment.
    let deployment = json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "ratings", "namespace": "shop"},
        "spec": {"selector": {"matchLabels": {"app": "ratings"}},
                 "template": {"metadata": {"labels": {"app": "ratings"}},
                              "spec": {"containers": [{"name": "ratings", "image": "ratings:v1"}]}}}
    });
    std::fs::write(&file, serde_yaml_ng::to_string(&deployment).unwrap()).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_meshpilot"))
        .args(&args)
        .output()
        .unwrap();
    let injected: Value = serde_yaml_ng::from_slice(&out.stdout).expect("YAML");
    let template = &injected["spec"]["template"];
    assert_eq!(names(template, "containers"), ["ratings", "istio-proxy"]);
    assert_eq!(
        env(
            container(template, "containers", "istio-proxy"),
            "ISTIO_META_OWNER"
        ),
        "kubernetes://apis/apps/v1/namespaces/shop/deployments/ratings"
    );

    // Bad input: an error naming the file and document.
    std::fs::write(&file, "kind: Pod\nmetadata: [\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_meshpilot"))
        .args(&args)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("pod.yaml, document 1"),
        "{stderr}"
    );
}

#[tokio::test]
async fn an_invalid_istio_object_is_refused_with_the_stores_message() {
    let hook = Webhook::start().await;
    let invalid = json!({
        "apiVersion": "networking.istio.io/v1", "kind": "DestinationRule",
        "metadata": {"name": "reviews", "namespace": "shop"},
        "spec": {"host": "reviews", "trafficPolicy": {"connectionPool": {"tcp": {"maxConnections": "many"}}}}
    });
    let response = hook.review("/validate", "v1", &invalid).await;
    assert_eq!(response["allowed"], false);
    let origin = Origin::Kubernetes {
        cluster: "cluster-a".into(),
        resource_version: String::new(),
    };
    let expected = ConfigObject::from_value(&invalid, origin)
        .expect("a kind the store reads")
        .expect_err("invalid")
        .to_string();
    assert_eq!(response["status"]["message"], expected);

    let valid = json!({
        "apiVersion": "networking.istio.io/v1", "kind": "DestinationRule",
        "metadata": {"name": "reviews", "namespace": "shop"},
        "spec": {"host": "reviews"}
    });
    assert_eq!(
        hook.review("/validate", "v1", &valid).await["allowed"],
        true
    );
    // A kind meshpilot does not read (a newer Istio's) is not its to refuse.
    let other = json!({"apiVersion": "extensions.istio.io/v1alpha1", "kind": "TrafficExtension",
                       "metadata": {"name": "t", "namespace": "shop"}, "spec": {"x": 1}});
    assert_eq!(
        hook.review("/validate", "v1", &other).await["allowed"],
        true
    );
    // An EnvoyFilter whose patch value Envoy's API does not have is refused, naming the field.
    let filter = json!({"apiVersion": "networking.istio.io/v1alpha3", "kind": "EnvoyFilter",
                        "metadata": {"name": "t", "namespace": "shop"},
                        "spec": {"configPatches": [{"applyTo": "CLUSTER",
                                 "patch": {"operation": "MERGE", "value": {"conect_timeout": "1s"}}}]}});
    let response = hook.review("/validate", "v1", &filter).await;
    assert_eq!(response["allowed"], false);
    let message = response["status"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("conect_timeout"), "{message}");
    // A misspelt field is refused as Istio's schema refuses it.
    let misspelt = json!({"apiVersion": "telemetry.istio.io/v1", "kind": "Telemetry",
                          "metadata": {"name": "t", "namespace": "shop"},
                          "spec": {"accesLogging": [{"disabled": true}]}});
    let response = hook.review("/validate", "v1", &misspelt).await;
    assert_eq!(response["allowed"], false);
    let message = response["status"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("did you mean accessLogging?"), "{message}");
}

/// ProxyConfigs of the root namespace, a namespace and a workload, with a pod's
/// `proxy.istio.io/config` between the namespace's and the workload's (istiod's precedence).
const PROXY_CONFIGS: &str = "
apiVersion: networking.istio.io/v1beta1
kind: ProxyConfig
metadata: {name: mesh, namespace: istio-system}
spec: {concurrency: 1, environmentVariables: {LEVEL: root, ROOT_ONLY: 'yes'}}
---
apiVersion: networking.istio.io/v1beta1
kind: ProxyConfig
metadata: {name: shop, namespace: shop}
spec: {concurrency: 2, environmentVariables: {LEVEL: namespace}, image: {imageType: debug}}
---
apiVersion: networking.istio.io/v1beta1
kind: ProxyConfig
metadata: {name: reviews, namespace: shop}
spec:
  selector: {matchLabels: {app: reviews}}
  concurrency: 4
  image: {imageType: distroless}
";

#[tokio::test]
async fn proxy_configs_apply_in_istiods_precedence() {
    let hook = Webhook::start_with_config(PROXY_CONFIGS).await;
    let proxy_config = |pod: &Value| -> Value {
        let proxy = container(pod, "containers", "istio-proxy");
        serde_json::from_str(env(proxy, "PROXY_CONFIG").as_str().unwrap()).unwrap()
    };
    let image = |pod: &Value| {
        container(pod, "containers", "istio-proxy")["image"]
            .as_str()
            .unwrap()
            .to_string()
    };

    // The workload's ProxyConfig outranks the pod's annotation, which outranks the namespace's;
    // environment variables merge by name.
    let reviews: Value = serde_json::from_str(POD).unwrap();
    let injected = hook.inject("/inject", &reviews).await;
    let config = proxy_config(&injected);
    assert_eq!(config["concurrency"], 4, "{config}");
    let metadata = &config["proxyMetadata"];
    assert_eq!(metadata["LEVEL"], "namespace", "{config}");
    assert_eq!(metadata["ROOT_ONLY"], "yes", "{config}");
    assert_eq!(metadata["ISTIO_META_DNS_CAPTURE"], "true", "{config}");
    let proxy = container(&injected, "containers", "istio-proxy");
    assert_eq!(env(proxy, "LEVEL"), "namespace");
    assert!(
        image(&injected).ends_with("-distroless"),
        "{}",
        image(&injected)
    );

    // Another workload of the namespace: its annotation over the namespace's.
    let mut ratings = reviews.clone();
    ratings["metadata"]["name"] = json!("ratings-v1-5b4c-x1");
    ratings["metadata"]["labels"] = json!({"app": "ratings"});
    ratings["metadata"]["annotations"] = json!({"proxy.istio.io/config": "concurrency: 3"});
    let injected = hook.inject("/inject", &ratings).await;
    assert_eq!(proxy_config(&injected)["concurrency"], 3);
    assert!(image(&injected).ends_with("-debug"), "{}", image(&injected));

    // Another namespace: the root namespace's alone; the plain image.
    let mut books = ratings.clone();
    books["metadata"]["namespace"] = json!("books");
    books["metadata"]["annotations"] = json!({});
    let injected = hook.inject("/inject", &books).await;
    let config = proxy_config(&injected);
    assert_eq!(config["concurrency"], 1, "{config}");
    assert_eq!(config["proxyMetadata"]["LEVEL"], "root", "{config}");
    assert!(!image(&injected).contains("-debug") && !image(&injected).contains("-distroless"));
}
