//! AdmissionReviews: request bodies as the API server POSTs them to `/inject` and `/validate`,
//! answered by the same functions the routes call. Every answer must be a 200 AdmissionReview
//! response or a 400 saying what is wrong; a refusal's message must be clear.

use std::sync::{Arc, LazyLock};

use axum::response::Response;
use meshpilot::inject::{InjectConfig, DEFAULT_PROXY_IMAGE};
use meshpilot::istio::MeshConfig;
use meshpilot::model::{Mesh, MeshNaming};
use meshpilot::webhook::{answer_inject, answer_validate, WebhookState};
use proptest::prelude::*;
use serde_json::{json, Value};

use crate::mutate::{mutated_bytes, mutated_json, mutated_text};
use crate::{bounded, clear_refusal, fuzz};

static STATE: LazyLock<WebhookState> = LazyLock::new(|| WebhookState {
    inject: InjectConfig {
        proxy_image: DEFAULT_PROXY_IMAGE.into(),
        cluster_id: "cluster1".into(),
        network: "net1".into(),
        mesh_id: String::new(),
        revision: Default::default(),
        system_namespace: "istio-system".into(),
        domain_suffix: "cluster.local".into(),
        mesh: Arc::new(MeshConfig::default()),
        proxy_configs: Default::default(),
    },
    mesh: Arc::new(Mesh::new(MeshNaming::default())),
    cluster_id: "cluster1".into(),
});

/// The annotations and labels injection reads.
const ANNOTATIONS: &[&str] = &[
    "sidecar.istio.io/inject",
    "sidecar.istio.io/status",
    "sidecar.istio.io/proxyCPU",
    "sidecar.istio.io/proxyCPULimit",
    "sidecar.istio.io/proxyMemory",
    "sidecar.istio.io/proxyMemoryLimit",
    "sidecar.istio.io/proxyImage",
    "sidecar.istio.io/logLevel",
    "sidecar.istio.io/componentLogLevel",
    "sidecar.istio.io/agentLogLevel",
    "sidecar.istio.io/interceptionMode",
    "status.sidecar.istio.io/port",
    "readiness.status.sidecar.istio.io/initialDelaySeconds",
    "readiness.status.sidecar.istio.io/periodSeconds",
    "readiness.status.sidecar.istio.io/failureThreshold",
    "traffic.sidecar.istio.io/includeOutboundIPRanges",
    "traffic.sidecar.istio.io/excludeOutboundIPRanges",
    "traffic.sidecar.istio.io/includeInboundPorts",
    "traffic.sidecar.istio.io/excludeInboundPorts",
    "traffic.sidecar.istio.io/includeOutboundPorts",
    "traffic.sidecar.istio.io/excludeOutboundPorts",
    "traffic.sidecar.istio.io/excludeInterfaces",
    "traffic.sidecar.istio.io/kubevirtInterfaces",
    "proxy.istio.io/config",
    "proxy.istio.io/overrides",
    "topology.istio.io/network",
    "security.istio.io/tlsMode",
];

fn pod(annotations: Value) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": "reviews-v1-7f9c8d-x1", "namespace": "shop",
            "labels": {"app": "reviews", "version": "v1", "pod-template-hash": "7f9c8d"},
            "annotations": annotations,
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                 "name": "reviews-v1-7f9c8d", "uid": "u1", "controller": true}]
        },
        "spec": {
            "serviceAccountName": "reviews",
            "initContainers": [{"name": "setup", "image": "busybox"}],
            "containers": [{"name": "reviews", "image": "reviews:v1",
                            "ports": [{"containerPort": 9080, "name": "http", "protocol": "TCP"}],
                            "readinessProbe": {"httpGet": {"path": "/ready", "port": 9080}}}]
        }
    })
}

fn review(version: &str, operation: &str, object: Option<Value>) -> Value {
    let resource = match &object {
        Some(o) if o["kind"] == "Pod" => "pods",
        _ => "destinationrules",
    };
    json!({
        "apiVersion": format!("admission.k8s.io/{version}"), "kind": "AdmissionReview",
        "request": {
            "uid": "e911857d-c318-11e8-bbad-025000000001",
            "kind": {"group": "", "version": "v1", "kind": object.as_ref().map_or(Value::Null, |o| o["kind"].clone())},
            "resource": {"group": "", "version": "v1", "resource": resource},
            "namespace": "shop",
            "operation": operation,
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
            "object": object,
            "dryRun": false
        }
    })
}

fn seeds() -> Vec<Value> {
    let annotated = pod(json!({
        "proxy.istio.io/config": "{\"proxyMetadata\": {\"ISTIO_META_DNS_CAPTURE\": \"true\"}}",
        "traffic.sidecar.istio.io/excludeInboundPorts": "9000",
        "traffic.sidecar.istio.io/includeOutboundIPRanges": "10.0.0.0/8",
        "sidecar.istio.io/proxyCPU": "250m",
        "sidecar.istio.io/interceptionMode": "REDIRECT",
        "readiness.status.sidecar.istio.io/periodSeconds": "5"
    }));
    let rule = json!({
        "apiVersion": "networking.istio.io/v1", "kind": "DestinationRule",
        "metadata": {"name": "reviews", "namespace": "shop", "resourceVersion": "17"},
        "spec": {"host": "reviews", "subsets": [{"name": "v1", "labels": {"version": "v1"}}],
                 "trafficPolicy": {"tls": {"mode": "ISTIO_MUTUAL"}}}
    });
    let virtual_service = json!({
        "apiVersion": "networking.istio.io/v1", "kind": "VirtualService",
        "metadata": {"name": "reviews"},
        "spec": {"hosts": ["reviews"], "http": [{"route": [{"destination": {"host": "reviews", "subset": "v1"}}]}]}
    });
    [
        review("v1", "CREATE", Some(annotated)),
        review("v1beta1", "CREATE", Some(pod(json!({})))),
        review("v1", "CREATE", Some(rule)),
        review("v1", "UPDATE", Some(virtual_service)),
        review("v1", "DELETE", None),
    ]
    .into()
}

fn encoded(values: &[Value]) -> Vec<Vec<u8>> {
    values
        .iter()
        .map(|v| serde_json::to_vec_pretty(v).expect("JSON"))
        .collect()
}

/// Pods with random values in the annotations injection reads.
fn annotated_pods() -> impl Strategy<Value = Vec<u8>> {
    let value = prop_oneof![
        mutated_text(
            &[
                "true",
                "false",
                "250m",
                "1Gi",
                "10.0.0.0/8,fd00::/8",
                "*",
                "9080,9000",
                "15020",
                "REDIRECT",
                "TPROXY",
                "{\"concurrency\": 2}",
                "{\"holdApplicationUntilProxyStarts\": true}",
                "debug",
                "misc:error",
                "eth1",
                "5",
                "istio"
            ],
            3,
        ),
        "\\PC{0,40}",
    ];
    let annotation = ((0..ANNOTATIONS.len()).prop_map(|i| ANNOTATIONS[i]), value);
    proptest::collection::vec(annotation, 0..6).prop_map(|pairs| {
        let annotations: serde_json::Map<String, Value> = pairs
            .into_iter()
            .map(|(k, v)| (k.to_string(), Value::String(v)))
            .collect();
        let object = pod(Value::Object(annotations));
        serde_json::to_vec(&review("v1", "CREATE", Some(object))).expect("JSON")
    })
}

/// The answer's status and body, checked: 200 with an AdmissionReview response for the request's
/// uid, or 400 naming what is wrong.
fn check_answer(answer: Response) -> Result<(), TestCaseError> {
    let status = answer.status();
    let body = futures::executor::block_on(axum::body::to_bytes(answer.into_body(), usize::MAX))
        .map_err(|e| TestCaseError::fail(format!("unreadable answer: {e}")))?;
    let text = String::from_utf8_lossy(&body);
    match status.as_u16() {
        400 => clear_refusal(
            &text,
            &[
                "not an AdmissionReview",
                "unsupported AdmissionReview",
                "AdmissionReview without",
            ],
        ),
        200 => {
            let reply: Value = serde_json::from_slice(&body)
                .map_err(|e| TestCaseError::fail(format!("answer is not JSON ({e}): {text}")))?;
            let response = &reply["response"];
            prop_assert!(response["allowed"].is_boolean(), "no verdict: {text}");
            if response["allowed"] == false {
                let message = response["status"]["message"].as_str().unwrap_or_default();
                clear_refusal(&message, &[])?;
            }
            prop_assert!(
                body.len() < (1 << 20) || response["patch"].is_string(),
                "a {}-byte answer",
                body.len()
            );
            Ok(())
        }
        other => Err(TestCaseError::fail(format!("status {other}: {text}"))),
    }
}

fn check(body: &[u8]) -> Result<(), TestCaseError> {
    let answer = bounded(body.len(), || {
        answer_inject(&STATE, "/cluster/c2/net/net--slash--2", body)
    })?;
    check_answer(answer)?;
    let answer = bounded(body.len(), || answer_validate(&STATE, body))?;
    check_answer(answer)
}

#[test]
fn admission_reviews() {
    fuzz(
        "admission reviews",
        mutated_bytes(encoded(&seeds()), 8),
        |body| check(&body),
    );
}

#[test]
fn admission_review_fields() {
    let reviews = mutated_json(seeds(), 4).prop_map(|v| serde_json::to_vec(&v).expect("JSON"));
    fuzz("admission review fields", reviews, |body| check(&body));
}

#[test]
fn admission_annotations() {
    fuzz("admission annotations", annotated_pods(), |body| {
        check(&body)
    });
}
