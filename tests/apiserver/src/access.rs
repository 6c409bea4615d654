//! What a client asks before it acts: the server's version, and whether it may do something
//! (SelfSubjectAccessReview), answered consistently with the denials a test made; and whether
//! someone else may (SubjectAccessReview), answered from the RBAC objects stored, as Kubernetes'
//! RBAC authorizer does.

use http::{Response, StatusCode};
use serde_json::{json, Value};

use crate::store::{kind_by_name, Filter};
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
    let denied = match shared.rbac_enforced.lock().contains(&user.username) {
        true => {
            let groups: Vec<&str> = user.groups.iter().map(String::as_str).collect();
            !rbac_allows(shared, &user.username, &groups, &Asked::of(attributes))
        }
        false => shared.denied.lock().contains(&key),
    };
    let status = if denied {
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

/// `POST /apis/authorization.k8s.io/v1/subjectaccessreviews`: allowed when a ClusterRoleBinding,
/// or a RoleBinding of the namespace asked about, binds the user (by name, as a service account,
/// or by one of its groups) to a Role or ClusterRole with a rule for the verb and resource.
pub(crate) fn subject_access_review(shared: &Shared, body: &[u8]) -> Response<Body> {
    count(shared, "subjectaccessreview".into());
    let review: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => return status_error(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string()),
    };
    let spec = &review["spec"];
    let user = spec["user"].as_str().unwrap_or_default();
    let groups: Vec<&str> = spec["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    let asked = Asked::of(&spec["resourceAttributes"]);
    let allowed = rbac_allows(shared, user, &groups, &asked);
    let reason = match allowed {
        true => "allowed by a role binding".to_string(),
        false => format!(
            "no binding lets {user} {} {} in {:?}",
            asked.verb, asked.resource, asked.namespace
        ),
    };
    json_response(
        StatusCode::CREATED,
        &json!({"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
                "metadata": {}, "spec": spec, "status": {"allowed": allowed, "reason": reason}}),
    )
}

/// What a request or review asks to do.
pub(crate) struct Asked<'a> {
    pub(crate) namespace: &'a str,
    pub(crate) verb: &'a str,
    pub(crate) group: &'a str,
    pub(crate) resource: &'a str,
    /// The object's name, where one is named.
    pub(crate) name: &'a str,
}

impl<'a> Asked<'a> {
    fn of(attributes: &'a Value) -> Self {
        let field = |name: &str| attributes[name].as_str().unwrap_or_default();
        Asked {
            namespace: field("namespace"),
            verb: field("verb"),
            group: field("group"),
            resource: field("resource"),
            name: field("name"),
        }
    }
}

pub(crate) fn rbac_allows(shared: &Shared, user: &str, groups: &[&str], asked: &Asked<'_>) -> bool {
    let store = shared.store.lock();
    let list = |kind: &str, namespace: Option<&str>| {
        let kind = kind_by_name(kind).expect("RBAC kinds are served");
        store.list(kind, namespace, &Filter::default())
    };
    let binds = |binding: &Value| {
        binding["subjects"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|subject| {
                let name = subject["name"].as_str().unwrap_or_default();
                match subject["kind"].as_str() {
                    Some("ServiceAccount") => {
                        let namespace = subject["namespace"].as_str().unwrap_or_default();
                        user == format!("system:serviceaccount:{namespace}:{name}")
                    }
                    Some("User") => user == name,
                    Some("Group") => groups.contains(&name),
                    _ => false,
                }
            })
    };
    let role_allows = |binding: &Value, binding_namespace: Option<&str>| {
        let role_ref = &binding["roleRef"];
        let name = role_ref["name"].as_str().unwrap_or_default();
        let role = match (role_ref["kind"].as_str(), binding_namespace) {
            (Some("ClusterRole"), _) => {
                store.get(kind_by_name("ClusterRole").expect("served"), "", name)
            }
            (Some("Role"), Some(ns)) => store.get(kind_by_name("Role").expect("served"), ns, name),
            _ => None,
        };
        role.is_some_and(|role| {
            role["rules"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|rule| rule_allows(rule, asked))
        })
    };
    let cluster_wide = list("ClusterRoleBinding", None)
        .iter()
        .any(|b| binds(b) && role_allows(b, None));
    cluster_wide
        || (!asked.namespace.is_empty()
            && list("RoleBinding", Some(asked.namespace))
                .iter()
                .any(|b| binds(b) && role_allows(b, Some(asked.namespace))))
}

fn rule_allows(rule: &Value, asked: &Asked<'_>) -> bool {
    let has = |field: &str, wanted: &str| {
        rule[field]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .any(|v| v == "*" || v == wanted)
    };
    // A rule naming objects allows only those, asked by name.
    let names: Vec<&str> = (rule["resourceNames"].as_array().into_iter().flatten())
        .filter_map(Value::as_str)
        .collect();
    let named = names.is_empty() || (!asked.name.is_empty() && names.contains(&asked.name));
    has("apiGroups", asked.group)
        && has("resources", asked.resource)
        && has("verbs", asked.verb)
        && named
}
