//! Mesh config fields injection and the sidecar's listeners share (issue 56, item 1):
//! `enablePrometheusMerge` as the webhook applies it (merge on, off by the pod, off by the mesh,
//! re-injection), and `proxyListenPort` / `proxyInboundListenPort` as the ports of
//! `virtualOutbound` / `virtualInbound` and their guard chains, which the injected `istio-iptables`
//! redirects to. docs/mesh-config.md names istiod's sources.

mod common;

use std::path::Path;
use std::time::Duration;

use base64::Engine;
use common::ads::fetch;
use common::*;
use envoy_types::pb::envoy::config::core::v3::{address, socket_address, Address};
use envoy_types::pb::envoy::config::listener::v3::Listener;
use serde_json::{json, Value};

const LDS: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
const BOUND: Duration = Duration::from_secs(10);
const SCRAPE_ENV: &str = "ISTIO_PROMETHEUS_ANNOTATIONS";

const CLUSTER: &str = "
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  clusterIP: 10.96.0.50
  ports: [{name: http, port: 80, targetPort: 8080}]
---
apiVersion: v1
kind: Pod
metadata: {name: web-0, namespace: shop, labels: {app: web, security.istio.io/tlsMode: istio}}
spec: {serviceAccountName: web, containers: []}
status: {podIP: 10.1.0.5}
";

const MESH: &str = "proxyListenPort: 16001\nproxyInboundListenPort: 16006\n";

fn pod(annotations: Value) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "web-1", "namespace": "shop", "labels": {"app": "web"},
                     "annotations": annotations},
        "spec": {"serviceAccountName": "web",
                 "containers": [{"name": "web", "image": "web:v1"}]}
    })
}

/// The pod as the API server stores it after the webhook's patch (or the refusal's message).
async fn inject(mp: &meshpilot::app::Running, pod: &Value) -> Result<Value, String> {
    let review = json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": "uid-1", "operation": "CREATE", "namespace": "shop", "object": pod,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "userInfo": {"username": "admin"}, "dryRun": false
        }
    });
    let (status, body) = https::post(
        mp.webhook_addr.expect("the webhook served"),
        "istiod.istio-system.svc",
        mp.ca.current().root_pem(),
        "/inject",
        &review.to_string(),
    )
    .await
    .expect("webhook reachable");
    assert_eq!(status, 200, "{body}");
    let response = &serde_json::from_str::<Value>(&body).expect("JSON")["response"];
    if response["allowed"] != true {
        return Err(response["status"]["message"].to_string());
    }
    let mut pod = pod.clone();
    let Some(patch) = response["patch"].as_str() else {
        return Ok(pod);
    };
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(patch)
        .expect("base64");
    let patch: json_patch::Patch = serde_json::from_slice(&bytes).expect("a JSON patch");
    json_patch::patch(&mut pod, &patch).expect("the patch applies");
    Ok(pod)
}

fn container<'a>(pod: &'a Value, list: &str, name: &str) -> &'a Value {
    (pod["spec"][list].as_array().into_iter().flatten())
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no {list} {name} in {pod}"))
}

/// istio-proxy's variable `name`, if set.
fn proxy_env(pod: &Value, name: &str) -> Option<String> {
    let proxy = container(pod, "containers", "istio-proxy");
    (proxy["env"].as_array().into_iter().flatten())
        .find(|e| e["name"] == name)
        .map(|e| e["value"].as_str().unwrap_or_default().to_string())
}

/// The pod's `prometheus.io/*` annotations.
fn scrape_annotations(pod: &Value) -> Vec<(String, String)> {
    (pod["metadata"]["annotations"]
        .as_object()
        .into_iter()
        .flatten())
    .filter(|(k, _)| k.starts_with("prometheus"))
    .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
    .collect::<std::collections::BTreeMap<_, _>>()
    .into_iter()
    .collect()
}

fn agent_annotations(port: &str) -> Vec<(String, String)> {
    [
        ("prometheus.io/path", "/stats/prometheus"),
        ("prometheus.io/port", port),
        ("prometheus.io/scrape", "true"),
    ]
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .to_vec()
}

fn port_of(address: &Option<Address>) -> Option<u32> {
    match address.as_ref()?.address.as_ref()? {
        address::Address::SocketAddress(s) => match s.port_specifier.as_ref()? {
            socket_address::PortSpecifier::PortValue(p) => Some(*p),
            _ => None,
        },
        _ => None,
    }
}

/// The listener's port and its guard chain's (the destination port sent to BlackHoleCluster).
fn ports(listeners: &[Listener], name: &str) -> (Option<u32>, Option<u32>) {
    let listener = (listeners.iter())
        .find(|l| l.name == name)
        .unwrap_or_else(|| panic!("no {name}"));
    let guard = (listener.filter_chains.iter())
        .find(|c| c.name == format!("{name}-blackhole"))
        .unwrap_or_else(|| panic!("no guard chain on {name}"));
    let guarded = (guard.filter_chain_match.as_ref())
        .and_then(|m| m.destination_port.as_ref())
        .map(|p| p.value);
    (port_of(&listener.address), guarded)
}

/// The value after `flag` in istio-init's args.
fn iptables_arg(pod: &Value, flag: &str) -> String {
    let args = container(pod, "initContainers", "istio-init")["args"]
        .as_array()
        .expect("args")
        .clone();
    let at = args.iter().position(|a| a == flag).expect(flag);
    args[at + 1].as_str().unwrap_or_default().to_string()
}

#[tokio::test]
async fn capture_ports_and_metrics_merge_follow_the_mesh_config() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = dir.path().join("clusters/c1");
    std::fs::create_dir_all(&cluster).unwrap();
    std::fs::write(cluster.join("web.yaml"), CLUSTER).unwrap();
    let mesh_config = dir.path().join("mesh.yaml");
    std::fs::write(&mesh_config, MESH).unwrap();
    let flags = ["--mesh-config", mesh_config.to_str().unwrap()];
    let mp = start_meshpilot(Path::new(dir.path()), &flags).await;

    // The sidecar listens where the injected iptables sends its traffic, and refuses connections
    // to those ports themselves (a loop).
    let node = labelled_node(
        "sidecar~10.1.0.5~web-0.shop~shop.svc.cluster.local",
        &[("CLUSTER_ID", "c1")],
        &[("app", "web"), ("security.istio.io/tlsMode", "istio")],
    );
    let listeners: Vec<Listener> = fetch(mp.xds_addr, node, LDS, &[]).await;
    assert_eq!(
        ports(&listeners, "virtualOutbound"),
        (Some(16001), Some(16001))
    );
    assert_eq!(
        ports(&listeners, "virtualInbound"),
        (Some(16006), Some(16006))
    );

    // Merge on (the mesh's default): the application's settings go to the agent.
    let app = json!({"prometheus.io/port": "9090", "prometheus.io/path": "/metrics",
                     "prometheus-io/scrape": "true"});
    let injected = inject(&mp, &pod(app.clone())).await.unwrap();
    assert_eq!(iptables_arg(&injected, "-p"), "16001");
    assert_eq!(iptables_arg(&injected, "-z"), "16006");
    assert_eq!(scrape_annotations(&injected), agent_annotations("15020"));
    let env = proxy_env(&injected, SCRAPE_ENV).expect("the application's settings");
    assert_eq!(
        serde_json::from_str::<Value>(&env).unwrap(),
        json!({"scrape": "true", "path": "/metrics", "port": "9090"})
    );

    // Re-injection: the agent's annotations stay, and so does the variable.
    let again = inject(&mp, &injected).await.unwrap();
    assert_eq!(scrape_annotations(&again), agent_annotations("15020"));
    assert_eq!(proxy_env(&again, SCRAPE_ENV), Some(env));
    assert_eq!(
        again, injected,
        "injecting an injected pod gives the same pod"
    );

    // A pod without scrape settings is scraped at the agent, which has nothing to merge.
    let bare = inject(&mp, &pod(json!({}))).await.unwrap();
    assert_eq!(scrape_annotations(&bare), agent_annotations("15020"));
    assert_eq!(proxy_env(&bare, SCRAPE_ENV), None);

    // Merge off by the pod, or for a pod not scraped: left as they are.
    let mut opted_out = app.clone();
    opted_out["prometheus.istio.io/merge-metrics"] = json!("false");
    let injected = inject(&mp, &pod(opted_out)).await.unwrap();
    assert_eq!(scrape_annotations(&injected).len(), 4);
    assert_eq!(
        injected["metadata"]["annotations"]["prometheus.io/port"],
        "9090"
    );
    assert_eq!(proxy_env(&injected, SCRAPE_ENV), None);
    let unscraped = json!({"prometheus.io/scrape": "false", "prometheus.io/port": "9090"});
    let injected = inject(&mp, &pod(unscraped)).await.unwrap();
    assert_eq!(
        injected["metadata"]["annotations"]["prometheus.io/port"],
        "9090"
    );

    // A port the agent cannot scrape is refused by name.
    let refused = inject(&mp, &pod(json!({"prometheus.io/port": "16001"}))).await;
    let message = refused.expect_err("a capture port is no application's");
    assert!(message.contains("prometheus.io/port"), "{message}");

    // Merge off by the mesh (a changed mesh config), but on again by the pod; the agent's status
    // port moves the annotations with it.
    let off = format!("{MESH}enablePrometheusMerge: false\ndefaultConfig: {{statusPort: 15030}}\n");
    write_atomic(&mesh_config, &off);
    let injected = wait_for("the mesh config's merge off", BOUND, || {
        let (mp, pod) = (&mp, pod(app.clone()));
        async move {
            let injected = inject(mp, &pod).await.ok()?;
            (injected["metadata"]["annotations"]["prometheus.io/port"] == "9090")
                .then_some(injected)
        }
    })
    .await;
    assert_eq!(proxy_env(&injected, SCRAPE_ENV), None);
    let mut opted_in = app.clone();
    opted_in["prometheus.istio.io/merge-metrics"] = json!("true");
    let injected = inject(&mp, &pod(opted_in)).await.unwrap();
    assert_eq!(
        scrape_annotations(&injected)[..3],
        agent_annotations("15030")[..]
    );
    assert!(proxy_env(&injected, SCRAPE_ENV).is_some());
    // The agent's port is left uncaptured, as the status port is.
    let excluded = iptables_arg(&injected, "-d");
    assert!(excluded.split(',').any(|p| p == "15030"), "{excluded}");
    const REWRITE: &str = "REWRITE_PROBE_LEGACY_LOCALHOST_DESTINATION";
    assert_eq!(proxy_env(&injected, REWRITE), None);

    // Inbound traffic to localhost: the agent is told to rewrite probes there too.
    write_atomic(
        &mesh_config,
        &format!(
            "{MESH}inboundTrafficPolicy: {{mode: LOCALHOST}}
"
        ),
    );
    wait_for("the localhost rewrite", BOUND, || {
        let (mp, pod) = (&mp, pod(app.clone()));
        async move {
            let injected = inject(mp, &pod).await.ok()?;
            (proxy_env(&injected, REWRITE).as_deref() == Some("true")).then_some(())
        }
    })
    .await;
}
