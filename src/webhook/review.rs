//! AdmissionReview in and out, v1 and v1beta1 alike (the API server sends the first version the
//! webhook configuration lists; the answer carries the same one).

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use kube::core::admission::{AdmissionRequest, AdmissionReview};
use kube::core::DynamicObject;
use serde_json::{json, Value};

use crate::text::{clip, Quoted};

/// A request as read, with the version to answer in.
pub struct Review {
    pub api_version: String,
    pub request: AdmissionRequest<DynamicObject>,
}

/// The verdict on one request.
pub enum Verdict {
    Allow,
    Patch(json_patch::Patch),
    Deny(String),
}

/// Reads an AdmissionReview body; an error is the 400 answer naming what is wrong.
pub fn parse(body: &[u8]) -> Result<Review, Box<Response>> {
    let bad = |message: String| Box::new((StatusCode::BAD_REQUEST, message).into_response());
    let review: AdmissionReview<DynamicObject> = serde_json::from_slice(body)
        .map_err(|e| bad(format!("not an AdmissionReview: {}", clip(&e.to_string()))))?;
    let api_version = review.types.api_version.clone();
    if !matches!(
        api_version.as_str(),
        "admission.k8s.io/v1" | "admission.k8s.io/v1beta1"
    ) {
        return Err(bad(format!(
            "unsupported AdmissionReview version {}",
            Quoted(&api_version)
        )));
    }
    let request = review
        .try_into()
        .map_err(|_| bad("AdmissionReview without a request".into()))?;
    Ok(Review {
        api_version,
        request,
    })
}

impl Review {
    /// The answer, in the request's version.
    pub fn answer(&self, verdict: Verdict) -> Response {
        let mut response = json!({"uid": self.request.uid, "allowed": true});
        match verdict {
            Verdict::Allow => {}
            Verdict::Patch(patch) => {
                let bytes = serde_json::to_vec(&patch).unwrap_or_default();
                response["patchType"] = json!("JSONPatch");
                response["patch"] = json!(base64::engine::general_purpose::STANDARD.encode(bytes));
            }
            Verdict::Deny(message) => {
                response["allowed"] = json!(false);
                response["status"] = json!({"status": "Failure", "message": message, "code": 400});
            }
        }
        let body: Value = json!({
            "apiVersion": self.api_version,
            "kind": "AdmissionReview",
            "response": response,
        });
        (
            [(header::CONTENT_TYPE, "application/json")],
            body.to_string(),
        )
            .into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(body: &str) -> String {
        let answer = parse(body.as_bytes()).err().expect("refused");
        assert_eq!(answer.status(), StatusCode::BAD_REQUEST);
        let bytes = futures::executor::block_on(axum::body::to_bytes(answer.into_body(), 1 << 20));
        String::from_utf8(bytes.expect("body").to_vec()).expect("UTF-8")
    }

    #[test]
    fn refusals_quote_a_bounded_excerpt_of_the_body() {
        let long = "x".repeat(10_000);
        let version = format!(r#"{{"apiVersion": "{long}", "kind": "AdmissionReview"}}"#);
        let message = refusal(&version);
        assert!(message.starts_with("unsupported AdmissionReview version"));
        assert!(message.len() < 1000, "{} bytes", message.len());
        let operation = format!(
            r#"{{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {{"operation": "{long}"}}}}"#
        );
        let message = refusal(&operation);
        assert!(message.starts_with("not an AdmissionReview"));
        assert!(message.len() < 1000, "{} bytes", message.len());
    }
}
