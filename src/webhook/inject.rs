//! `/inject`: the pod of an AdmissionReview, injected, answered as a JSON patch computed between
//! the pod as read and as injected (both as typed objects, so fields this version does not know
//! are left alone). A pod that opts out is allowed unchanged; one with an invalid annotation is
//! refused with the reason.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::response::Response;
use k8s_openapi::api::core::v1::Pod;
use kube::core::admission::AdmissionRequest;
use kube::core::DynamicObject;
use tracing::{debug, info, warn};

use super::review::{self, Verdict};
use super::WebhookState;
use crate::inject::{inject, InjectConfig, Outcome, Overrides, Workload};
use crate::text::clip;

pub async fn handle(State(state): State<Arc<WebhookState>>, body: Bytes) -> Response {
    respond(&state, "", &body)
}

pub async fn handle_with_params(
    State(state): State<Arc<WebhookState>>,
    Path(params): Path<String>,
    body: Bytes,
) -> Response {
    respond(&state, &params, &body)
}

/// The answer to an `/inject` request body; `params` is the path after `/inject`.
pub fn respond(state: &WebhookState, params: &str, body: &[u8]) -> Response {
    let review = match review::parse(body) {
        Ok(review) => review,
        Err(refused) => return *refused,
    };
    let verdict = match injected(state, params, &review.request) {
        Ok(Some(patch)) => Verdict::Patch(patch),
        Ok(None) => Verdict::Allow,
        Err(message) => {
            warn!(error = %message, "sidecar injection refused");
            Verdict::Deny(message)
        }
    };
    review.answer(verdict)
}

/// The patch injecting the request's pod; None when the pod is left as it is.
fn injected(
    state: &WebhookState,
    params: &str,
    request: &AdmissionRequest<DynamicObject>,
) -> Result<Option<json_patch::Patch>, String> {
    let Some(object) = &request.object else {
        return Ok(None);
    };
    let value =
        serde_json::to_value(object).map_err(|e| format!("pod: {}", clip(&e.to_string())))?;
    let mut pod: Pod = serde_json::from_value(value)
        .map_err(|e| format!("not a Pod: {}", clip(&e.to_string())))?;
    // Large and irrelevant to injection; left out of the comparison.
    pod.metadata.managed_fields = None;
    let namespace = match pod.metadata.namespace.clone().filter(|ns| !ns.is_empty()) {
        Some(ns) => ns,
        None => {
            let ns = request.namespace.clone().unwrap_or_default();
            pod.metadata.namespace = Some(ns.clone());
            ns
        }
    };
    let name = pod
        .metadata
        .name
        .clone()
        .or_else(|| pod.metadata.generate_name.clone())
        .unwrap_or_default();
    let original = serde_json::to_value(&pod).map_err(|e| e.to_string())?;
    let workload = Workload::of_pod(&pod.metadata, &namespace);
    let snapshot = state.mesh.snapshot();
    let config = InjectConfig {
        mesh: snapshot.config.mesh().clone(),
        proxy_configs: snapshot.config.proxy_configs(),
        ..state.inject.clone()
    };
    let overrides = Overrides::from_path(params);
    let Pod { metadata, spec, .. } = &mut pod;
    let spec = spec.get_or_insert_with(Default::default);
    let outcome = inject(metadata, spec, &namespace, &workload, &config, &overrides)
        .map_err(|e| format!("pod {}/{}: {e}", clip(&namespace), clip(&name)))?;
    if outcome == Outcome::Skipped {
        debug!(pod = %format!("{namespace}/{name}"), "injection skipped by policy");
        return Ok(None);
    }
    let patched = serde_json::to_value(&pod).map_err(|e| e.to_string())?;
    info!(pod = %format!("{namespace}/{name}"), workload = %workload.name, "sidecar injected");
    Ok(Some(json_patch::diff(&original, &patched)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::istio::MeshConfig;
    use crate::model::{Mesh, MeshNaming};

    fn state() -> WebhookState {
        WebhookState {
            inject: InjectConfig {
                proxy_image: "proxyv2".into(),
                cluster_id: "c1".into(),
                network: String::new(),
                mesh_id: String::new(),
                revision: Default::default(),
                system_namespace: "istio-system".into(),
                domain_suffix: "cluster.local".into(),
                mesh: Arc::new(MeshConfig::default()),
                proxy_configs: Default::default(),
            },
            mesh: Arc::new(Mesh::new(MeshNaming::default())),
            cluster_id: "c1".into(),
        }
    }

    #[test]
    fn a_refusal_quotes_a_bounded_excerpt_of_the_pod() {
        let long = "x".repeat(10_000);
        let review = serde_json::json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {
                "uid": "u", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "operation": "CREATE", "userInfo": {},
                "object": {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
                           "spec": {"containers": long}}
            }
        });
        let answer = respond(&state(), "", review.to_string().as_bytes());
        let body = futures::executor::block_on(axum::body::to_bytes(answer.into_body(), 1 << 20));
        let reply: serde_json::Value = serde_json::from_slice(&body.expect("body")).expect("JSON");
        let message = reply["response"]["status"]["message"]
            .as_str()
            .expect("denied");
        assert!(message.starts_with("not a Pod: "), "{message}");
        assert!(message.len() < 1000, "{} bytes", message.len());
    }
}
