//! What a client asks before it acts: the server's version, and whether it may do something
//! (SelfSubjectAccessReview), answered consistently with the denials a test made.

use http::{Response, StatusCode};
use serde_json::{json, Value};

use crate::{count, json_response, status_error, Body, Shared, User};

/// `GET /version`, as a recent Kubernetes answers it.
pub(crate) fn version() -> Response<Body> {
    json_response(
        StatusCode::OK,
        &json!({"major": "1", "minor": "33", "gitVersion": "v1.33.0-test-apiserver",
                "gitCommit": "0000000", "gitTreeState": "clean", "buildDate": "2025-01-01T00:00:00Z",
                "goVersion": "go1.24", "compiler": "gc", "platform": "linux/amd64"}),
    )
}

/// `POST .../selfsubjectaccessreviews`: allowed unless a test denied the caller this verb on this
/// resource (any namespace, any group, as denials are keyed).
pub(crate) fn self_subject_access_review(
    shared: &Shared,
    user: &User,
    body: &[u8],
) -> Response<Body> {
    count(shared, "selfsubjectaccessreview".into());
    let review: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => return status_error(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string()),
    };
    let attributes = &review["spec"]["resourceAttributes"];
    let verb = attributes["verb"].as_str().unwrap_or_default();
    let resource = attributes["resource"].as_str().unwrap_or_default();
    let key = (
        user.username.clone(),
        verb.to_string(),
        resource.to_string(),
    );
    let status = if shared.denied.lock().contains(&key) {
        json!({"allowed": false, "reason": format!(
            "denied by the test API server: {} may not {verb} {resource}", user.username)})
    } else {
        json!({"allowed": true, "reason": "allowed by the test API server"})
    };
    json_response(
        StatusCode::CREATED,
        &json!({"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                "metadata": {}, "spec": review["spec"], "status": status}),
    )
}
