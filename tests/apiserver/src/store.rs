//! The object store: resource versions, a bounded event history for watches, label selectors.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

use serde_json::{json, Value};
use tokio::sync::broadcast;

/// A resource the server serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResourceKind {
    pub plural: &'static str,
    /// API group ("" for the core group), as authorization errors name it.
    pub group: &'static str,
    pub kind: &'static str,
    pub api_version: &'static str,
    pub namespaced: bool,
}

pub const KINDS: &[ResourceKind] = &[
    ResourceKind {
        plural: "namespaces",
        group: "",
        kind: "Namespace",
        api_version: "v1",
        namespaced: false,
    },
    ResourceKind {
        plural: "nodes",
        group: "",
        kind: "Node",
        api_version: "v1",
        namespaced: false,
    },
    ResourceKind {
        plural: "services",
        group: "",
        kind: "Service",
        api_version: "v1",
        namespaced: true,
    },
    ResourceKind {
        plural: "pods",
        group: "",
        kind: "Pod",
        api_version: "v1",
        namespaced: true,
    },
    ResourceKind {
        plural: "secrets",
        group: "",
        kind: "Secret",
        api_version: "v1",
        namespaced: true,
    },
    ResourceKind {
        plural: "configmaps",
        group: "",
        kind: "ConfigMap",
        api_version: "v1",
        namespaced: true,
    },
    ResourceKind {
        plural: "serviceaccounts",
        group: "",
        kind: "ServiceAccount",
        api_version: "v1",
        namespaced: true,
    },
    ResourceKind {
        plural: "clusterroles",
        group: "rbac.authorization.k8s.io",
        kind: "ClusterRole",
        api_version: "rbac.authorization.k8s.io/v1",
        namespaced: false,
    },
    ResourceKind {
        plural: "roles",
        group: "rbac.authorization.k8s.io",
        kind: "Role",
        api_version: "rbac.authorization.k8s.io/v1",
        namespaced: true,
    },
    ResourceKind {
        plural: "rolebindings",
        group: "rbac.authorization.k8s.io",
        kind: "RoleBinding",
        api_version: "rbac.authorization.k8s.io/v1",
        namespaced: true,
    },
    ResourceKind {
        plural: "clusterrolebindings",
        group: "rbac.authorization.k8s.io",
        kind: "ClusterRoleBinding",
        api_version: "rbac.authorization.k8s.io/v1",
        namespaced: false,
    },
    // Istio's kinds, served at their storage version (objects applied at an older one are
    // converted, as CRD conversion does for these schema-identical versions).
    ResourceKind {
        plural: "serviceentries",
        group: "networking.istio.io",
        kind: "ServiceEntry",
        api_version: "networking.istio.io/v1",
        namespaced: true,
    },
    ResourceKind {
        plural: "workloadentries",
        group: "networking.istio.io",
        kind: "WorkloadEntry",
        api_version: "networking.istio.io/v1",
        namespaced: true,
    },
    ResourceKind {
        plural: "workloadgroups",
        group: "networking.istio.io",
        kind: "WorkloadGroup",
        api_version: "networking.istio.io/v1",
        namespaced: true,
    },
    ResourceKind {
        plural: "destinationrules",
        group: "networking.istio.io",
        kind: "DestinationRule",
        api_version: "networking.istio.io/v1",
        namespaced: true,
    },
    ResourceKind {
        plural: "virtualservices",
        group: "networking.istio.io",
        kind: "VirtualService",
        api_version: "networking.istio.io/v1",
        namespaced: true,
    },
    ResourceKind {
        plural: "gateways",
        group: "networking.istio.io",
        kind: "Gateway",
        api_version: "networking.istio.io/v1",
        namespaced: true,
    },
    ResourceKind {
        plural: "sidecars",
        group: "networking.istio.io",
        kind: "Sidecar",
        api_version: "networking.istio.io/v1",
        namespaced: true,
    },
    ResourceKind {
        plural: "peerauthentications",
        group: "security.istio.io",
        kind: "PeerAuthentication",
        api_version: "security.istio.io/v1",
        namespaced: true,
    },
    ResourceKind {
        plural: "authorizationpolicies",
        group: "security.istio.io",
        kind: "AuthorizationPolicy",
        api_version: "security.istio.io/v1",
        namespaced: true,
    },
    ResourceKind {
        plural: "requestauthentications",
        group: "security.istio.io",
        kind: "RequestAuthentication",
        api_version: "security.istio.io/v1",
        namespaced: true,
    },
    ResourceKind {
        plural: "telemetries",
        group: "telemetry.istio.io",
        kind: "Telemetry",
        api_version: "telemetry.istio.io/v1",
        namespaced: true,
    },
    ResourceKind {
        plural: "envoyfilters",
        group: "networking.istio.io",
        kind: "EnvoyFilter",
        api_version: "networking.istio.io/v1alpha3",
        namespaced: true,
    },
    ResourceKind {
        plural: "proxyconfigs",
        group: "networking.istio.io",
        kind: "ProxyConfig",
        api_version: "networking.istio.io/v1beta1",
        namespaced: true,
    },
    ResourceKind {
        plural: "wasmplugins",
        group: "extensions.istio.io",
        kind: "WasmPlugin",
        api_version: "extensions.istio.io/v1alpha1",
        namespaced: true,
    },
    ResourceKind {
        plural: "deployments",
        group: "apps",
        kind: "Deployment",
        api_version: "apps/v1",
        namespaced: true,
    },
    // The Gateway API, at the versions its users commonly have installed.
    ResourceKind {
        plural: "gatewayclasses",
        group: "gateway.networking.k8s.io",
        kind: "GatewayClass",
        api_version: "gateway.networking.k8s.io/v1",
        namespaced: false,
    },
    ResourceKind {
        plural: "gateways",
        group: "gateway.networking.k8s.io",
        kind: "Gateway",
        api_version: "gateway.networking.k8s.io/v1",
        namespaced: true,
    },
    ResourceKind {
        plural: "httproutes",
        group: "gateway.networking.k8s.io",
        kind: "HTTPRoute",
        api_version: "gateway.networking.k8s.io/v1",
        namespaced: true,
    },
    ResourceKind {
        plural: "grpcroutes",
        group: "gateway.networking.k8s.io",
        kind: "GRPCRoute",
        api_version: "gateway.networking.k8s.io/v1",
        namespaced: true,
    },
    ResourceKind {
        plural: "tcproutes",
        group: "gateway.networking.k8s.io",
        kind: "TCPRoute",
        api_version: "gateway.networking.k8s.io/v1alpha2",
        namespaced: true,
    },
    ResourceKind {
        plural: "tlsroutes",
        group: "gateway.networking.k8s.io",
        kind: "TLSRoute",
        api_version: "gateway.networking.k8s.io/v1",
        namespaced: true,
    },
    ResourceKind {
        plural: "referencegrants",
        group: "gateway.networking.k8s.io",
        kind: "ReferenceGrant",
        api_version: "gateway.networking.k8s.io/v1beta1",
        namespaced: true,
    },
    // Kubernetes Ingress, which istiod serves for its class.
    ResourceKind {
        plural: "ingresses",
        group: "networking.k8s.io",
        kind: "Ingress",
        api_version: "networking.k8s.io/v1",
        namespaced: true,
    },
    ResourceKind {
        plural: "ingressclasses",
        group: "networking.k8s.io",
        kind: "IngressClass",
        api_version: "networking.k8s.io/v1",
        namespaced: false,
    },
    ResourceKind {
        plural: "endpointslices",
        group: "discovery.k8s.io",
        kind: "EndpointSlice",
        api_version: "discovery.k8s.io/v1",
        namespaced: true,
    },
    // Leader election, and the webhook configurations the API server calls on admission.
    ResourceKind {
        plural: "leases",
        group: "coordination.k8s.io",
        kind: "Lease",
        api_version: "coordination.k8s.io/v1",
        namespaced: true,
    },
    ResourceKind {
        plural: "mutatingwebhookconfigurations",
        group: "admissionregistration.k8s.io",
        kind: "MutatingWebhookConfiguration",
        api_version: "admissionregistration.k8s.io/v1",
        namespaced: false,
    },
    ResourceKind {
        plural: "validatingwebhookconfigurations",
        group: "admissionregistration.k8s.io",
        kind: "ValidatingWebhookConfiguration",
        api_version: "admissionregistration.k8s.io/v1",
        namespaced: false,
    },
];

pub fn kind_by_plural(group_version: &str, plural: &str) -> Option<ResourceKind> {
    KINDS
        .iter()
        .copied()
        .find(|k| k.plural == plural && k.api_version == group_version)
}

/// A kind by name, the first served of that name; `<Kind>.<group>` names one of another group
/// (`Gateway.gateway.networking.k8s.io` beside Istio's Gateway).
pub fn kind_by_name(kind: &str) -> Option<ResourceKind> {
    match kind.split_once('.') {
        Some((kind, group)) => KINDS
            .iter()
            .copied()
            .find(|k| k.kind == kind && k.group == group),
        None => KINDS.iter().copied().find(|k| k.kind == kind),
    }
}

/// The kind an object's `apiVersion` and `kind` name.
pub fn kind_of(object: &serde_json::Value) -> Option<ResourceKind> {
    let kind = object["kind"].as_str().unwrap_or_default();
    let Some(api_version) = object["apiVersion"].as_str() else {
        return kind_by_name(kind);
    };
    let group = api_version.rsplit_once('/').map_or("", |(group, _)| group);
    KINDS
        .iter()
        .copied()
        .find(|k| k.kind == kind && k.group == group)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    Added,
    Modified,
    Deleted,
}

impl EventType {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Added => "ADDED",
            Self::Modified => "MODIFIED",
            Self::Deleted => "DELETED",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Event {
    pub rv: u64,
    pub plural: &'static str,
    pub kind: EventType,
    pub object: Arc<Value>,
    /// The object before a modification: a selected watch sees an object leave (or enter) it.
    pub previous: Option<Arc<Value>>,
}

/// (plural, namespace, name)
type Key = (&'static str, String, String);

const HISTORY: usize = 50_000;

pub struct Store {
    objects: BTreeMap<Key, Value>,
    rv: u64,
    history: VecDeque<Event>,
    /// Watches from a resource version at or below this one get 410 Gone.
    compacted: u64,
    uids: u64,
    live: broadcast::Sender<Event>,
}

pub enum WatchStart {
    /// Replay these, then follow `live`.
    Replay(Vec<Event>, broadcast::Receiver<Event>),
    Gone {
        requested: u64,
        oldest: u64,
    },
}

impl Default for Store {
    fn default() -> Self {
        Self {
            objects: BTreeMap::new(),
            rv: 1000,
            history: VecDeque::new(),
            compacted: 0,
            uids: 0,
            live: broadcast::channel(65_536).0,
        }
    }
}

impl ResourceKind {
    /// `plural.group`, or `plural` in the core group.
    pub fn resource(&self) -> String {
        if self.group.is_empty() {
            self.plural.to_string()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }
}

impl Store {
    pub fn resource_version(&self) -> u64 {
        self.rv
    }

    /// Creates or replaces an object; returns it as stored.
    pub fn upsert(&mut self, kind: ResourceKind, mut object: Value) -> Value {
        let name = object["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let namespace = if kind.namespaced {
            object["metadata"]["namespace"]
                .as_str()
                .unwrap_or("default")
                .to_string()
        } else {
            String::new()
        };
        let key = (kind.plural, namespace.clone(), name);
        let previous = self.objects.get(&key).cloned();
        self.rv += 1;
        let uid = match &previous {
            Some(p) => p["metadata"]["uid"].clone(),
            None => {
                self.uids += 1;
                json!(format!("00000000-0000-4000-8000-{:012}", self.uids))
            }
        };
        let event = if previous.is_some() {
            EventType::Modified
        } else {
            EventType::Added
        };
        object["apiVersion"] = json!(kind.api_version);
        object["kind"] = json!(kind.kind);
        let meta = &mut object["metadata"];
        meta["resourceVersion"] = json!(self.rv.to_string());
        meta["uid"] = uid;
        if meta["creationTimestamp"].is_null() {
            meta["creationTimestamp"] = json!("2026-01-01T00:00:00Z");
        }
        if kind.namespaced {
            meta["namespace"] = json!(namespace);
        }
        self.objects.insert(key, object.clone());
        self.record(kind.plural, event, object.clone(), previous);
        object
    }

    pub fn get(&self, kind: ResourceKind, namespace: &str, name: &str) -> Option<Value> {
        self.objects
            .get(&(kind.plural, namespace.to_string(), name.to_string()))
            .cloned()
    }

    /// Deletes an object and, as the garbage collector's background propagation, every object
    /// its `ownerReferences` tie to it.
    pub fn delete(&mut self, kind: ResourceKind, namespace: &str, name: &str) -> Option<Value> {
        let mut object =
            self.objects
                .remove(&(kind.plural, namespace.to_string(), name.to_string()))?;
        self.rv += 1;
        object["metadata"]["resourceVersion"] = json!(self.rv.to_string());
        self.record(kind.plural, EventType::Deleted, object.clone(), None);
        let uid = object["metadata"]["uid"].clone();
        let owned: Vec<(&'static str, String, String)> = self
            .objects
            .iter()
            .filter(|(_, o)| {
                o["metadata"]["ownerReferences"]
                    .as_array()
                    .is_some_and(|refs| refs.iter().any(|r| r["uid"] == uid))
            })
            .map(|(key, _)| key.clone())
            .collect();
        for (plural, ns, name) in owned {
            if let Some(dependent) = KINDS.iter().find(|k| k.plural == plural) {
                self.delete(*dependent, &ns, &name);
            }
        }
        Some(object)
    }

    fn record(
        &mut self,
        plural: &'static str,
        kind: EventType,
        object: Value,
        previous: Option<Value>,
    ) {
        let event = Event {
            rv: self.rv,
            plural,
            kind,
            object: Arc::new(object),
            previous: previous.map(Arc::new),
        };
        self.history.push_back(event.clone());
        while self.history.len() > HISTORY {
            if let Some(old) = self.history.pop_front() {
                self.compacted = old.rv;
            }
        }
        // No receiver is fine: nobody is watching.
        let _ = self.live.send(event);
    }

    /// Forgets the event history: every watch from an older resource version gets 410 Gone.
    pub fn compact(&mut self) {
        self.history.clear();
        self.compacted = self.rv;
    }

    pub fn list(&self, kind: ResourceKind, namespace: Option<&str>, filter: &Filter) -> Vec<Value> {
        self.list_page(kind, namespace, filter, 0, usize::MAX).0
    }

    /// Up to `limit` matching objects from the `offset`-th, and whether more follow. Only the page
    /// is copied.
    pub fn list_page(
        &self,
        kind: ResourceKind,
        namespace: Option<&str>,
        filter: &Filter,
        offset: usize,
        limit: usize,
    ) -> (Vec<Value>, bool) {
        let mut matching = self
            .objects
            .range((kind.plural, String::new(), String::new())..)
            .take_while(|((plural, _, _), _)| *plural == kind.plural)
            .filter(|((_, ns, _), _)| namespace.is_none_or(|n| n == ns))
            .map(|(_, o)| o)
            .filter(|o| filter.matches(o))
            .skip(offset);
        let page: Vec<Value> = matching.by_ref().take(limit).cloned().collect();
        (page, matching.next().is_some())
    }

    /// Events after `from` (exclusive) for a watch, or Gone if they were compacted away.
    pub fn watch_from(&self, from: u64) -> WatchStart {
        if from < self.compacted {
            return WatchStart::Gone {
                requested: from,
                oldest: self.compacted,
            };
        }
        let replay = self
            .history
            .iter()
            .filter(|e| e.rv > from)
            .cloned()
            .collect();
        WatchStart::Replay(replay, self.live.subscribe())
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.live.subscribe()
    }
}

/// Label and field selectors of a list or watch.
#[derive(Debug, Default, Clone)]
pub struct Filter {
    labels: Vec<Requirement>,
    fields: Vec<(String, String, bool)>,
}

#[derive(Debug, Clone)]
enum Requirement {
    Equals(String, String),
    NotEquals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

impl Filter {
    /// A Kubernetes LabelSelector object (`matchLabels`, `matchExpressions`); absent matches all.
    pub fn from_label_selector(selector: &Value) -> Result<Self, String> {
        let mut filter = Filter::default();
        for (key, value) in selector["matchLabels"].as_object().into_iter().flatten() {
            let value = value.as_str().ok_or("matchLabels values must be strings")?;
            filter
                .labels
                .push(Requirement::Equals(key.clone(), value.to_string()));
        }
        for expression in selector["matchExpressions"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let key = expression["key"].as_str().unwrap_or_default().to_string();
            let values: Vec<String> = expression["values"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect();
            filter.labels.push(match expression["operator"].as_str() {
                Some("In") => Requirement::In(key, values),
                Some("NotIn") => Requirement::NotIn(key, values),
                Some("Exists") => Requirement::Exists(key),
                Some("DoesNotExist") => Requirement::NotExists(key),
                other => return Err(format!("unknown selector operator {other:?}")),
            });
        }
        Ok(filter)
    }

    pub fn parse(
        label_selector: Option<&str>,
        field_selector: Option<&str>,
    ) -> Result<Self, String> {
        let mut filter = Filter::default();
        if let Some(sel) = label_selector.filter(|s| !s.is_empty()) {
            for term in split_terms(sel) {
                filter.labels.push(parse_requirement(term.trim())?);
            }
        }
        if let Some(sel) = field_selector.filter(|s| !s.is_empty()) {
            for term in sel.split(',') {
                let (field, value, equal) = if let Some((f, v)) = term.split_once("!=") {
                    (f, v, false)
                } else if let Some((f, v)) = term.split_once("==").or_else(|| term.split_once('='))
                {
                    (f, v, true)
                } else {
                    return Err(format!("invalid field selector {term:?}"));
                };
                filter
                    .fields
                    .push((field.trim().to_string(), value.trim().to_string(), equal));
            }
        }
        Ok(filter)
    }

    pub fn matches(&self, object: &Value) -> bool {
        let labels: HashMap<&str, &str> = object["metadata"]["labels"]
            .as_object()
            .map(|m| {
                m.iter()
                    .filter_map(|(k, v)| Some((k.as_str(), v.as_str()?)))
                    .collect()
            })
            .unwrap_or_default();
        let labels_ok = self.labels.iter().all(|r| match r {
            Requirement::Equals(k, v) => labels.get(k.as_str()) == Some(&v.as_str()),
            Requirement::NotEquals(k, v) => labels.get(k.as_str()) != Some(&v.as_str()),
            Requirement::In(k, vs) => labels
                .get(k.as_str())
                .is_some_and(|l| vs.iter().any(|v| v == l)),
            Requirement::NotIn(k, vs) => labels
                .get(k.as_str())
                .is_none_or(|l| vs.iter().all(|v| v != l)),
            Requirement::Exists(k) => labels.contains_key(k.as_str()),
            Requirement::NotExists(k) => !labels.contains_key(k.as_str()),
        });
        let fields_ok = self.fields.iter().all(|(field, value, equal)| {
            let actual = field
                .split('.')
                .try_fold(object, |v, part| v.get(part))
                .and_then(Value::as_str)
                .unwrap_or_default();
            (actual == value) == *equal
        });
        labels_ok && fields_ok
    }
}

/// Splits on commas outside parentheses (`a in (x,y),b`).
fn split_terms(sel: &str) -> Vec<&str> {
    let (mut terms, mut depth, mut start) = (Vec::new(), 0, 0);
    for (i, c) in sel.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                terms.push(&sel[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    terms.push(&sel[start..]);
    terms
}

fn parse_requirement(term: &str) -> Result<Requirement, String> {
    let set = |rest: &str| -> Result<Vec<String>, String> {
        let inner = rest
            .trim()
            .strip_prefix('(')
            .and_then(|r| r.strip_suffix(')'))
            .ok_or_else(|| format!("invalid set in {term:?}"))?;
        Ok(inner.split(',').map(|v| v.trim().to_string()).collect())
    };
    if let Some(key) = term.strip_prefix('!') {
        return Ok(Requirement::NotExists(key.trim().to_string()));
    }
    if let Some((k, v)) = term.split_once("!=") {
        return Ok(Requirement::NotEquals(k.trim().into(), v.trim().into()));
    }
    if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
        return Ok(Requirement::Equals(k.trim().into(), v.trim().into()));
    }
    if let Some((k, rest)) = term.split_once(" notin ") {
        return Ok(Requirement::NotIn(k.trim().into(), set(rest)?));
    }
    if let Some((k, rest)) = term.split_once(" in ") {
        return Ok(Requirement::In(k.trim().into(), set(rest)?));
    }
    if term.is_empty() || term.contains(' ') {
        return Err(format!("invalid label selector term {term:?}"));
    }
    Ok(Requirement::Exists(term.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_selectors() {
        let obj = json!({"metadata": {"name": "a", "labels": {"app": "web", "tier": "front"}}});
        let m = |s: &str| Filter::parse(Some(s), None).unwrap().matches(&obj);
        assert!(m("app=web"));
        assert!(m("app==web,tier"));
        assert!(!m("app!=web"));
        assert!(m("tier in (front, back)"));
        assert!(!m("tier notin (front)"));
        assert!(m("!missing"));
        assert!(!m("missing"));
        let f = Filter::parse(None, Some("metadata.name=a")).unwrap();
        assert!(f.matches(&obj));
    }

    #[test]
    fn pages_cover_the_list_once() {
        let mut store = Store::default();
        let ns = kind_by_name("Namespace").unwrap();
        for i in 0..7 {
            store.upsert(ns, json!({"metadata": {"name": format!("n{i}")}}));
        }
        let (first, more) = store.list_page(ns, None, &Filter::default(), 0, 5);
        let (rest, more_after) = store.list_page(ns, None, &Filter::default(), 5, 5);
        assert_eq!(
            (first.len(), more, rest.len(), more_after),
            (5, true, 2, false)
        );
    }

    #[test]
    fn compaction_makes_old_versions_gone() {
        let mut store = Store::default();
        let ns = kind_by_name("Namespace").unwrap();
        store.upsert(ns, json!({"metadata": {"name": "a"}}));
        let rv = store.resource_version();
        store.upsert(ns, json!({"metadata": {"name": "b"}}));
        match store.watch_from(rv) {
            WatchStart::Replay(events, _) => assert_eq!(events.len(), 1),
            WatchStart::Gone { .. } => panic!("not compacted yet"),
        }
        store.compact();
        assert!(matches!(store.watch_from(rv), WatchStart::Gone { .. }));
    }
}
