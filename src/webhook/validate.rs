//! `/validate`: an Istio object of a kind meshpilot reads is parsed and validated as the config
//! store does; an invalid one is refused with the message /debug/configz would show for it.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::Response;
use serde_json::Value;
use tracing::info;

use super::review::{self, Verdict};
use super::WebhookState;
use crate::istio::{ConfigObject, Origin};
use crate::text::clip;

pub async fn handle(State(state): State<Arc<WebhookState>>, body: Bytes) -> Response {
    respond(&state, &body)
}

/// The answer to a `/validate` request body.
pub fn respond(state: &WebhookState, body: &[u8]) -> Response {
    let review = match review::parse(body) {
        Ok(review) => review,
        Err(refused) => return *refused,
    };
    let verdict = match &review.request.object {
        // A delete carries no object: nothing to validate.
        None => Verdict::Allow,
        Some(object) => match serde_json::to_value(object) {
            Ok(value) => verdict(state, value, review.request.namespace.as_deref()),
            Err(e) => Verdict::Deny(format!("unreadable object: {}", clip(&e.to_string()))),
        },
    };
    review.answer(verdict)
}

fn verdict(state: &WebhookState, mut value: Value, namespace: Option<&str>) -> Verdict {
    // A namespaced create may leave the namespace to the request.
    if value["metadata"]["namespace"]
        .as_str()
        .is_none_or(str::is_empty)
    {
        if let Some(ns) = namespace {
            value["metadata"]["namespace"] = Value::String(ns.to_string());
        }
    }
    let origin = Origin::Kubernetes {
        cluster: state.cluster_id.clone(),
        resource_version: value["metadata"]["resourceVersion"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
    };
    match ConfigObject::from_value(&value, origin) {
        None | Some(Ok(_)) => Verdict::Allow,
        Some(Err(e)) => {
            info!(error = %e, "invalid Istio config refused");
            Verdict::Deny(e.to_string())
        }
    }
}
