//! The status the Gateway API asks of an implementation, in the API's own shape: conditions with
//! the spec's types and reasons, per GatewayClass, per Gateway and listener, per route parent.

use serde::Serialize;

use crate::istio::gateway_api::{ParentReference, CONTROLLER};

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Condition {
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// `True` or `False`.
    pub status: &'static str,
    pub reason: &'static str,
    pub message: String,
}

impl Condition {
    pub fn yes(kind: &'static str, reason: &'static str) -> Self {
        Self {
            kind,
            status: "True",
            reason,
            message: String::new(),
        }
    }

    pub fn no(kind: &'static str, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            kind,
            status: "False",
            reason,
            message: message.into(),
        }
    }

    pub fn is_true(&self) -> bool {
        self.status == "True"
    }
}

/// What went wrong with a reference, as a condition's reason and message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub reason: &'static str,
    pub message: String,
}

impl Refusal {
    pub fn new(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            reason,
            message: message.into(),
        }
    }
}

/// A condition `kind` that holds (`ok_reason`) unless something was refused.
pub fn condition(
    kind: &'static str,
    ok_reason: &'static str,
    refusal: Option<&Refusal>,
) -> Condition {
    match refusal {
        None => Condition::yes(kind, ok_reason),
        Some(r) => Condition::no(kind, r.reason, r.message.clone()),
    }
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum ObjectStatus {
    Class(ClassStatus),
    Gateway(GatewayStatus),
    Route(RouteStatus),
}

impl ObjectStatus {
    /// A route's parents' `ResolvedRefs` turned False where a backend is no service of the mesh.
    pub fn check_backends(&mut self, exists: impl Fn(&str) -> bool) {
        if let ObjectStatus::Route(route) = self {
            for parent in &mut route.parents {
                parent.check_backends(&exists);
            }
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ClassStatus {
    pub conditions: Vec<Condition>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GatewayStatus {
    pub conditions: Vec<Condition>,
    pub listeners: Vec<ListenerStatus>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ListenerStatus {
    pub name: String,
    pub supported_kinds: Vec<RouteKind>,
    pub attached_routes: usize,
    pub conditions: Vec<Condition>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RouteKind {
    pub group: &'static str,
    pub kind: &'static str,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RouteStatus {
    pub parents: Vec<ParentStatus>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ParentStatus {
    pub parent_ref: ParentReference,
    pub controller_name: &'static str,
    pub conditions: Vec<Condition>,
    /// The backends the parent's rules send to (fully qualified hosts), checked against the
    /// service table when the status is shown.
    #[serde(skip)]
    pub backends: Vec<String>,
}

impl ParentStatus {
    pub fn new(parent_ref: ParentReference, conditions: Vec<Condition>) -> Self {
        Self {
            parent_ref,
            controller_name: CONTROLLER,
            conditions,
            backends: Vec::new(),
        }
    }

    /// `ResolvedRefs` turned False (BackendNotFound) when a backend is no service of the mesh;
    /// an earlier refusal stands.
    pub fn check_backends(&mut self, exists: impl Fn(&str) -> bool) {
        let Some(missing) = self.backends.iter().find(|b| !exists(b)) else {
            return;
        };
        let message = format!("backend {missing} is no service of the mesh");
        for c in &mut self.conditions {
            if c.kind == "ResolvedRefs" && c.is_true() {
                *c = Condition::no("ResolvedRefs", "BackendNotFound", message.clone());
            }
        }
    }
}
