//! Admission webhooks, called as the real API server calls them on create and update: every
//! matching MutatingWebhookConfiguration webhook (configurations by name, webhooks in order), its
//! JSON patch applied, then every matching validating webhook. A webhook matches by its rules
//! (operation, group, version, resource), `namespaceSelector` (the namespace's labels) and
//! `objectSelector`. It is reached over HTTPS, verified with its `caBundle` as the server name
//! `<service>.<namespace>.svc` (service form, routed where a test said the Service's endpoints
//! are) or the URL's host (URL form). The AdmissionReview version is the first of
//! `admissionReviewVersions`. An unreachable or failing webhook refuses the request unless its
//! `failurePolicy` is Ignore; a denial is reported as `admission webhook "<name>" denied the
//! request: <message>`.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use base64::Engine;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};

use crate::store::{kind_by_name, Filter, ResourceKind};
use crate::{status_error, Body, Response, Shared, User};

/// Why a request was refused.
pub struct Refusal(pub Box<Response<Body>>);

/// What is being admitted.
pub struct Attempt<'a> {
    pub kind: ResourceKind,
    pub operation: &'static str,
    pub object: Value,
    pub old: Option<Value>,
    pub user: &'a User,
    pub dry_run: bool,
}

/// Runs the mutating then the validating webhooks; returns the object as mutated.
pub async fn admit(shared: &Shared, attempt: Attempt<'_>) -> Result<Value, Refusal> {
    let mut object = attempt.object.clone();
    for (hook, mutating) in [
        ("MutatingWebhookConfiguration", true),
        ("ValidatingWebhookConfiguration", false),
    ] {
        for webhook in matching(shared, hook, &attempt, &object) {
            let name = webhook["name"].as_str().unwrap_or_default().to_string();
            let fail_open = webhook["failurePolicy"] == "Ignore";
            let response = match call(shared, &webhook, &attempt, &object).await {
                Ok(response) => response,
                Err(_) if fail_open => continue,
                Err(error) => {
                    return Err(Refusal(Box::new(status_error(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "InternalError",
                        &format!(
                            "Internal error occurred: failed calling webhook \"{name}\": {error}"
                        ),
                    ))))
                }
            };
            if response["allowed"] != true {
                return Err(Refusal(Box::new(denied(&name, &response["status"]))));
            }
            if mutating && !response["patch"].is_null() {
                match apply_patch(&mut object, &response) {
                    Ok(()) => {}
                    Err(_) if fail_open => continue,
                    Err(error) => {
                        return Err(Refusal(Box::new(status_error(
                            StatusCode::INTERNAL_SERVER_ERROR,
                            "InternalError",
                            &format!("Internal error occurred: webhook \"{name}\": {error}"),
                        ))))
                    }
                }
            }
        }
    }
    Ok(object)
}

/// The webhooks of every configuration of `kind` that match the attempt, in the API server's order.
fn matching(shared: &Shared, kind: &str, attempt: &Attempt<'_>, object: &Value) -> Vec<Value> {
    let store = shared.store.lock();
    let Some(config_kind) = kind_by_name(kind) else {
        return Vec::new();
    };
    // A namespaceSelector applies to namespaced objects and to Namespaces themselves.
    let namespace_labels = match (attempt.kind.namespaced, kind_by_name("Namespace")) {
        (true, Some(namespaces)) => {
            let ns = object["metadata"]["namespace"].as_str().unwrap_or_default();
            Some(
                store
                    .get(namespaces, "", ns)
                    .map(|n| n["metadata"].clone())
                    .unwrap_or_default(),
            )
        }
        _ if attempt.kind.kind == "Namespace" => Some(object["metadata"].clone()),
        _ => None,
    };
    let selects = |selector: &Value, metadata: &Value| {
        Filter::from_label_selector(selector)
            .map(|f| f.matches(&json!({ "metadata": metadata })))
            .unwrap_or(false)
    };
    let mut out = Vec::new();
    for config in store.list(config_kind, None, &Filter::default()) {
        for webhook in config["webhooks"].as_array().into_iter().flatten() {
            let rule_matches = webhook["rules"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|rule| rule_matches(rule, attempt.kind, attempt.operation));
            let object_matches = selects(&webhook["objectSelector"], &object["metadata"])
                || attempt
                    .old
                    .as_ref()
                    .is_some_and(|old| selects(&webhook["objectSelector"], &old["metadata"]));
            if rule_matches
                && object_matches
                && namespace_labels
                    .as_ref()
                    .is_none_or(|labels| selects(&webhook["namespaceSelector"], labels))
            {
                out.push(webhook.clone());
            }
        }
    }
    out
}

fn rule_matches(rule: &Value, kind: ResourceKind, operation: &str) -> bool {
    let listed = |field: &str, value: &str| {
        rule[field]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .any(|v| v == "*" || v == "*/*" || v == value)
    };
    let version = kind.api_version.rsplit('/').next().unwrap_or_default();
    listed("operations", operation)
        && listed("apiGroups", kind.group)
        && listed("apiVersions", version)
        && listed("resources", kind.plural)
}

/// Sends the AdmissionReview; returns its `response`.
async fn call(
    shared: &Shared,
    webhook: &Value,
    attempt: &Attempt<'_>,
    object: &Value,
) -> Result<Value, String> {
    let client = &webhook["clientConfig"];
    let (addr, server_name, path) = target(shared, client)?;
    let ca = base64::engine::general_purpose::STANDARD
        .decode(client["caBundle"].as_str().unwrap_or_default())
        .map_err(|e| format!("caBundle: {e}"))?;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::pem::PemObject::pem_slice_iter(&ca) {
        let cert: rustls::pki_types::CertificateDer<'static> =
            cert.map_err(|e| format!("caBundle: {e}"))?;
        roots.add(cert).map_err(|e| format!("caBundle: {e}"))?;
    }
    let tls = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let version = webhook["admissionReviewVersions"]
        .as_array()
        .and_then(|v| {
            v.iter()
                .filter_map(Value::as_str)
                .find(|v| *v == "v1" || *v == "v1beta1")
        })
        .unwrap_or("v1");
    let uid = format!(
        "review-{}",
        shared.review_serial.fetch_add(1, Ordering::Relaxed)
    );
    let review = review(attempt, object, version, &uid);
    let timeout = Duration::from_secs(webhook["timeoutSeconds"].as_u64().unwrap_or(10));
    let exchange = async {
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("dial tcp {addr}: {e}"))?;
        let name = rustls::pki_types::ServerName::try_from(server_name.clone())
            .map_err(|e| format!("server name {server_name}: {e}"))?;
        let stream = tokio_rustls::TlsConnector::from(std::sync::Arc::new(tls))
            .connect(name, tcp)
            .await
            .map_err(|e| format!("tls: {e}"))?;
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .map_err(|e| e.to_string())?;
        tokio::spawn(connection);
        let request = Request::post(path.as_str())
            .header("host", server_name.as_str())
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(review.to_string())))
            .map_err(|e| e.to_string())?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| e.to_string())?;
        let status = response.status();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        if !status.is_success() {
            return Err(format!("HTTP {status}: {}", String::from_utf8_lossy(&body)));
        }
        serde_json::from_slice::<Value>(&body).map_err(|e| format!("response: {e}"))
    };
    let reply = tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| "context deadline exceeded".to_string())??;
    let expected = format!("admission.k8s.io/{version}");
    if reply["apiVersion"] != expected.as_str() || reply["kind"] != "AdmissionReview" {
        return Err(format!(
            "expected {expected} AdmissionReview, got {}",
            reply["apiVersion"]
        ));
    }
    let response = reply["response"].clone();
    if response["uid"] != uid.as_str() {
        return Err(format!(
            "expected response.uid={uid:?}, got {}",
            response["uid"]
        ));
    }
    Ok(response)
}

/// Where to connect, which name to verify and which path to post to.
fn target(shared: &Shared, client: &Value) -> Result<(SocketAddr, String, String), String> {
    if let Some(url) = client["url"].as_str() {
        let rest = url
            .strip_prefix("https://")
            .ok_or_else(|| format!("webhook URL {url} is not https"))?;
        let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
        let addr: SocketAddr = authority
            .parse()
            .or_else(|_| format!("{authority}:443").parse())
            .map_err(|_| format!("webhook URL {url}: tests need an IP:port host"))?;
        let path = if path.is_empty() { "/" } else { path };
        return Ok((addr, addr.ip().to_string(), path.to_string()));
    }
    let service = &client["service"];
    let namespace = service["namespace"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let name = service["name"].as_str().unwrap_or_default().to_string();
    let port = service["port"].as_u64().unwrap_or(443) as u16;
    let addr = shared
        .routes
        .lock()
        .get(&(namespace.clone(), name.clone(), port))
        .copied()
        .ok_or_else(|| {
            format!("service \"{name}\" in namespace \"{namespace}\" has no endpoints")
        })?;
    let path = service["path"].as_str().unwrap_or("/").to_string();
    Ok((addr, format!("{name}.{namespace}.svc"), path))
}

fn review(attempt: &Attempt<'_>, object: &Value, version: &str, uid: &str) -> Value {
    let kind = attempt.kind;
    let api_version = kind.api_version.rsplit('/').next().unwrap_or_default();
    let gvk = json!({"group": kind.group, "version": api_version, "kind": kind.kind});
    let gvr = json!({"group": kind.group, "version": api_version, "resource": kind.plural});
    let mut request = json!({
        "uid": uid,
        "kind": gvk, "resource": gvr, "requestKind": gvk, "requestResource": gvr,
        "name": object["metadata"]["name"],
        "operation": attempt.operation,
        "userInfo": {"username": attempt.user.username, "uid": attempt.user.uid,
                     "groups": attempt.user.groups},
        "object": object,
        "oldObject": attempt.old,
        "dryRun": attempt.dry_run,
    });
    if kind.namespaced {
        request["namespace"] = object["metadata"]["namespace"].clone();
    }
    json!({"apiVersion": format!("admission.k8s.io/{version}"), "kind": "AdmissionReview",
           "request": request})
}

fn apply_patch(object: &mut Value, response: &Value) -> Result<(), String> {
    if response["patchType"] != "JSONPatch" {
        return Err(format!("unsupported patchType {}", response["patchType"]));
    }
    let raw = base64::engine::general_purpose::STANDARD
        .decode(response["patch"].as_str().unwrap_or_default())
        .map_err(|e| format!("patch: {e}"))?;
    let patch: json_patch::Patch =
        serde_json::from_slice(&raw).map_err(|e| format!("patch: {e}"))?;
    json_patch::patch(object, &patch).map_err(|e| format!("patch: {e}"))
}

/// As the API server reports a denial: at least 400, the message prefixed with who denied it.
fn denied(name: &str, status: &Value) -> Response<Body> {
    let code = status["code"]
        .as_u64()
        .and_then(|c| StatusCode::from_u16(c as u16).ok())
        .filter(|c| c.as_u16() >= 400)
        .unwrap_or(StatusCode::BAD_REQUEST);
    let prefix = format!("admission webhook \"{name}\" denied the request");
    let message = match status["message"].as_str().or(status["reason"].as_str()) {
        Some(m) if !m.is_empty() => format!("{prefix}: {m}"),
        _ => format!("{prefix} without explanation"),
    };
    let reason = status["reason"]
        .as_str()
        .filter(|r| !r.is_empty())
        .unwrap_or("BadRequest");
    status_error(code, reason, &message)
}
