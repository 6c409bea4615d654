//! Kubernetes' Ingress API (networking.k8s.io/v1) as the ingress source reads it: the fields
//! istiod's ingress controller reads, trimmed on arrival. Every field is optional here, so an
//! object the API server would not have accepted (an old one, a test server's) is refused by name
//! rather than stopping the watch of every other.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Service;
use kube::api::DynamicObject;
use kube::ResourceExt;
use serde::{Deserialize, Serialize};

/// The annotation naming an Ingress's class before `spec.ingressClassName` (still read first).
pub const CLASS_ANNOTATION: &str = "kubernetes.io/ingress.class";
/// The controller of IngressClasses istiod serves.
pub const CONTROLLER: &str = "istio.io/ingress-controller";
/// What marks an IngressClass the cluster's default; istiod does not read it.
pub const DEFAULT_CLASS_ANNOTATION: &str = "ingressclass.kubernetes.io/is-default-class";

pub const GROUP: &str = "networking.k8s.io";
pub const VERSION: &str = "v1";

/// One Ingress, as far as serving it and writing its status need.
#[derive(Clone, Debug, PartialEq)]
pub struct Ingress {
    pub namespace: String,
    pub name: String,
    pub labels: BTreeMap<String, String>,
    /// `kubernetes.io/ingress.class`, when annotated.
    pub class_annotation: Option<String>,
    /// RFC 3339; orders Ingresses the way istiod merges them (oldest first).
    pub created: Option<String>,
    /// The spec, or why it could not be read.
    pub spec: Result<IngressSpec, String>,
    /// `status.loadBalancer.ingress` as the API server holds it.
    pub status: Vec<Address>,
}

impl Ingress {
    pub fn read(object: &DynamicObject) -> Self {
        let spec = object.data.get("spec").cloned().unwrap_or_default();
        let spec = match spec {
            serde_json::Value::Null => Ok(IngressSpec::default()),
            spec => serde_path_to_error::deserialize(spec).map_err(|e| {
                let path = e.path().to_string();
                format!("spec.{path}: {}", e.into_inner())
            }),
        };
        let status = object.data["status"]["loadBalancer"]["ingress"].clone();
        Self {
            namespace: object.namespace().unwrap_or_default(),
            name: object.name_any(),
            labels: object.labels().clone(),
            class_annotation: object.annotations().get(CLASS_ANNOTATION).cloned(),
            created: serde_json::to_value(&object.metadata.creation_timestamp)
                .ok()
                .and_then(|t| t.as_str().map(str::to_string)),
            spec,
            status: serde_json::from_value(status).unwrap_or_default(),
        }
    }

    /// `<namespace>/<name>`.
    pub fn id(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct IngressSpec {
    pub ingress_class_name: Option<String>,
    pub default_backend: Option<Backend>,
    pub tls: Vec<Tls>,
    pub rules: Vec<Rule>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Tls {
    pub hosts: Vec<String>,
    pub secret_name: String,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Rule {
    pub host: String,
    pub http: Option<HttpRule>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpRule {
    pub paths: Vec<HttpPath>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpPath {
    pub path: String,
    pub path_type: Option<String>,
    pub backend: Backend,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Backend {
    pub service: Option<ServiceBackend>,
    pub resource: Option<ResourceBackend>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ServiceBackend {
    pub name: String,
    pub port: Option<ServicePort>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ServicePort {
    pub name: Option<String>,
    pub number: Option<i32>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ResourceBackend {
    pub api_group: Option<String>,
    pub kind: String,
    pub name: String,
}

/// One of `status.loadBalancer.ingress`: an IP or a host name (its ports are not read).
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Deserialize, Serialize)]
#[serde(default)]
pub struct Address {
    #[serde(skip_serializing_if = "String::is_empty")]
    pub hostname: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub ip: String,
}

/// One IngressClass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IngressClass {
    pub name: String,
    pub controller: String,
    /// Whether it names `spec.parameters` (which istiod does not read).
    pub parameters: bool,
    /// Whether it is annotated the cluster's default class.
    pub default_class: bool,
}

impl IngressClass {
    pub fn read(object: &DynamicObject) -> Self {
        let spec = &object.data["spec"];
        let annotation = object.annotations().get(DEFAULT_CLASS_ANNOTATION);
        Self {
            name: object.name_any(),
            controller: spec["controller"].as_str().unwrap_or_default().to_string(),
            parameters: !spec["parameters"].is_null(),
            default_class: annotation.is_some_and(|v| v == "true"),
        }
    }
}

/// What of a Service the ingress source reads: its ports by name (an Ingress backend may name
/// one) and, in the ingress namespace, the addresses istiod writes into Ingresses' status
/// (`runningAddresses`: an ExternalName's name, else the load balancer's IPs or host names, then
/// `spec.externalIPs`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceFacts {
    pub ports: Vec<(String, i32)>,
    pub addresses: Vec<String>,
}

impl ServiceFacts {
    pub fn read(service: &Service, addresses_wanted: bool) -> Self {
        let spec = service.spec.clone().unwrap_or_default();
        let ports = (spec.ports.iter().flatten())
            .map(|p| (p.name.clone().unwrap_or_default(), p.port))
            .collect();
        let mut addresses = Vec::new();
        if addresses_wanted {
            match spec.type_.as_deref() {
                Some("ExternalName") => addresses.extend(spec.external_name.clone()),
                _ => {
                    let balancer = service
                        .status
                        .as_ref()
                        .and_then(|s| s.load_balancer.as_ref());
                    for entry in balancer
                        .and_then(|lb| lb.ingress.as_ref())
                        .into_iter()
                        .flatten()
                    {
                        match entry.ip.as_deref().filter(|ip| !ip.is_empty()) {
                            Some(ip) => addresses.push(ip.to_string()),
                            None => addresses.extend(entry.hostname.clone()),
                        }
                    }
                    addresses.extend(spec.external_ips.iter().flatten().cloned());
                }
            }
        }
        Self { ports, addresses }
    }
}
