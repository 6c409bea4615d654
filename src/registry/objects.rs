//! Kubernetes objects trimmed on arrival to the fields conversion reads.
//!
//! Both the file-backed and the Kubernetes sources turn their objects into these, so the two can
//! never disagree, and a cluster's cache holds kilobytes where full objects would hold megabytes.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use bytes::Bytes;
use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::discovery::v1 as discovery;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::workload::Workload;
use crate::model::{Labels, Locality, Protocol, SecretMaterial, ServicePort, UseWaypoint};

pub const LABEL_NETWORK: &str = "topology.istio.io/network";
pub const LABEL_TLS_MODE: &str = "security.istio.io/tlsMode";
pub const LABEL_LOCALITY: &str = "istio-locality";
pub const LABEL_SUBZONE: &str = "topology.istio.io/subzone";
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";
pub const LABEL_MCS_SERVICE_NAME: &str = "multicluster.kubernetes.io/service-name";
const LABEL_REGION: [&str; 2] = [
    "topology.kubernetes.io/region",
    "failure-domain.beta.kubernetes.io/region",
];
const LABEL_ZONE: [&str; 2] = [
    "topology.kubernetes.io/zone",
    "failure-domain.beta.kubernetes.io/zone",
];

#[derive(Debug, Error, PartialEq, Eq)]
pub enum TrimError {
    #[error("{kind} has no metadata.name")]
    NoName { kind: Kind },
    #[error("{kind} {namespace}/{name}: {detail}")]
    Invalid {
        kind: Kind,
        namespace: String,
        name: String,
        detail: String,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum Kind {
    Namespace,
    Service,
    EndpointSlice,
    Pod,
    Node,
    Secret,
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self, f)
    }
}

/// Identity of an object within one cluster. Cluster-scoped kinds have an empty namespace.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjectKey {
    pub kind: Kind,
    pub namespace: String,
    pub name: String,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Object {
    Namespace(NamespaceObj),
    Service(ServiceObj),
    EndpointSlice(SliceObj),
    Pod(PodObj),
    Node(NodeObj),
    Secret(SecretObj),
}

/// One change to a cluster's objects, from a watch event or a file diff.
#[derive(Clone, Debug, PartialEq)]
pub enum ObjectChange {
    Upsert(Object),
    Delete(ObjectKey),
}

impl ObjectChange {
    /// The object changed.
    pub fn key(&self) -> ObjectKey {
        match self {
            ObjectChange::Upsert(object) => object.key(),
            ObjectChange::Delete(key) => key.clone(),
        }
    }
}

impl Object {
    pub fn key(&self) -> ObjectKey {
        let (kind, namespace, name) = match self {
            Object::Namespace(o) => (Kind::Namespace, "", o.name.as_str()),
            Object::Service(o) => (Kind::Service, o.namespace.as_str(), o.name.as_str()),
            Object::EndpointSlice(o) => {
                (Kind::EndpointSlice, o.namespace.as_str(), o.name.as_str())
            }
            Object::Pod(o) => (Kind::Pod, &*o.namespace, &*o.name),
            Object::Node(o) => (Kind::Node, "", o.name.as_str()),
            Object::Secret(o) => (Kind::Secret, o.namespace.as_str(), o.name.as_str()),
        };
        ObjectKey {
            kind,
            namespace: namespace.to_string(),
            name: name.to_string(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NamespaceObj {
    pub name: String,
    /// `topology.istio.io/network`: the network of a cluster when set on its system namespace.
    pub network: Option<String>,
    /// `istio.io/use-waypoint`: the waypoint of its services and pods that name none.
    #[serde(default)]
    pub use_waypoint: Option<UseWaypoint>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ServiceObj {
    pub name: String,
    pub namespace: String,
    pub labels: BTreeMap<String, String>,
    pub cluster_ips: Vec<IpAddr>,
    pub headless: bool,
    pub external_name: Option<String>,
    pub ports: Vec<ServicePort>,
    /// LoadBalancer ingress IPs, else externalIPs.
    pub external_addresses: Vec<IpAddr>,
    /// The `networking.istio.io/exportTo` annotation, split at commas.
    pub export_to: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SliceObj {
    pub name: String,
    pub namespace: String,
    /// Name of the Service the slice belongs to.
    pub service: String,
    /// (port name, port number) pairs; endpoints expose each.
    pub ports: Vec<(String, u16)>,
    pub endpoints: Vec<SliceEndpoint>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SliceEndpoint {
    pub addresses: Vec<IpAddr>,
    pub ready: Option<bool>,
    pub serving: Option<bool>,
    pub terminating: Option<bool>,
    /// Name of the pod in `targetRef`, when the reference is to a pod (shared with the pod's slot).
    pub pod: Option<Arc<str>>,
    /// The endpoint's DNS label under a headless service (set for StatefulSet pods); shares the
    /// pod's name when equal to it.
    #[serde(default)]
    pub hostname: Option<Arc<str>>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PodObj {
    /// The strings are shared: with the registry's indexes, other pods and the pod's endpoints.
    pub name: Arc<str>,
    pub namespace: Arc<str>,
    /// The workload the pod belongs to (its Deployment, …), as istiod names endpoints' workloads;
    /// empty in snapshots saved before it was kept, which stands for the pod's own name.
    #[serde(default)]
    pub workload: Arc<str>,
    pub labels: Labels,
    pub service_account: Arc<str>,
    pub node: Option<Arc<str>>,
    pub ips: Vec<IpAddr>,
    /// The Ready condition: what a ServiceEntry selecting the pod serves it by (no slice says).
    pub ready: bool,
    /// Captured by ztunnel (istio-cni's `ambient.istio.io/redirection: enabled`).
    #[serde(default)]
    pub captured: bool,
    #[serde(default)]
    pub host_network: bool,
    /// Succeeded or Failed: no longer a workload.
    #[serde(default)]
    pub terminal: bool,
    /// The API server's uid: a node proxy's token names its pod by it.
    #[serde(default)]
    pub uid: Option<Arc<str>>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeObj {
    pub name: String,
    pub locality: Arc<Locality>,
}

/// A Secret, reduced to the TLS material gateways may use; other Secrets hold nothing here.
#[derive(Clone, Debug, PartialEq)]
pub struct SecretObj {
    pub name: String,
    pub namespace: String,
    pub material: Option<Arc<SecretMaterial>>,
}

fn name_of(kind: Kind, meta: &ObjectMeta) -> Result<String, TrimError> {
    meta.name.clone().ok_or(TrimError::NoName { kind })
}

/// An object without a namespace is in `default`, as `kubectl apply` puts it (manifests in file
/// clusters are written for kubectl; the API server always names one).
fn namespaced(kind: Kind, meta: &ObjectMeta) -> Result<(String, String), TrimError> {
    let name = name_of(kind, meta)?;
    let namespace = meta.namespace.as_deref().filter(|ns| !ns.is_empty());
    Ok((
        namespace
            .unwrap_or(crate::istio::DEFAULT_NAMESPACE)
            .to_string(),
        name,
    ))
}

fn invalid(kind: Kind, namespace: &str, name: &str, detail: impl Into<String>) -> TrimError {
    TrimError::Invalid {
        kind,
        namespace: namespace.into(),
        name: name.into(),
        detail: detail.into(),
    }
}

fn port_number(kind: Kind, ns: &str, name: &str, port: i32) -> Result<u16, TrimError> {
    u16::try_from(port)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| invalid(kind, ns, name, format!("port {port} is out of range")))
}

/// Addresses that do not parse as IPs are skipped: Kubernetes validates them, and one bad entry must
/// not cost the rest of the object.
/// The addresses that parse, in a list of exactly their size: one per pod and per slice endpoint,
/// where a collected list would reserve four.
fn ips<'a>(addrs: impl IntoIterator<Item = &'a String>) -> Vec<IpAddr> {
    let mut ips: Vec<IpAddr> = addrs.into_iter().filter_map(|a| a.parse().ok()).collect();
    ips.shrink_to_fit();
    ips
}

pub fn namespace(ns: &core::Namespace) -> Result<Object, TrimError> {
    let name = name_of(Kind::Namespace, &ns.metadata)?;
    let labels = ns.metadata.labels.clone().unwrap_or_default();
    Ok(Object::Namespace(NamespaceObj {
        network: labels.get(LABEL_NETWORK).cloned(),
        use_waypoint: UseWaypoint::from_labels(&labels, &name),
        name,
    }))
}

/// Which namespaces see a Service (Istio's annotation).
pub const ANNOTATION_EXPORT_TO: &str = "networking.istio.io/exportTo";

pub fn service(svc: &core::Service) -> Result<Object, TrimError> {
    let (namespace, name) = namespaced(Kind::Service, &svc.metadata)?;
    let spec = svc.spec.clone().unwrap_or_default();
    let mut ports = Vec::new();
    for p in spec.ports.iter().flatten() {
        let port_name = p.name.clone().unwrap_or_default();
        ports.push(ServicePort {
            protocol: Protocol::from_port(
                &port_name,
                p.app_protocol.as_deref(),
                p.protocol.as_deref(),
            ),
            port: port_number(Kind::Service, &namespace, &name, p.port)?,
            name: port_name,
            target_port: None,
        });
    }
    let headless = spec.cluster_ip.as_deref() == Some("None");
    let cluster_ips = match &spec.cluster_ips {
        Some(list) if !list.is_empty() => ips(list),
        _ => ips(spec.cluster_ip.iter()),
    };
    let external_name = (spec.type_.as_deref() == Some("ExternalName"))
        .then(|| spec.external_name.clone())
        .flatten();
    let ingress: Vec<IpAddr> = svc
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref())
        .map(|ingress| ips(ingress.iter().filter_map(|i| i.ip.as_ref())))
        .unwrap_or_default();
    let external_addresses = if ingress.is_empty() {
        ips(spec.external_ips.iter().flatten())
    } else {
        ingress
    };
    let export_to = svc
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANNOTATION_EXPORT_TO))
        .map(|v| {
            v.split(',')
                .map(str::trim)
                .filter(|e| !e.is_empty())
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default();
    Ok(Object::Service(ServiceObj {
        external_addresses,
        export_to,
        labels: svc.metadata.labels.clone().unwrap_or_default(),
        name,
        namespace,
        cluster_ips,
        headless,
        external_name,
        ports,
    }))
}

/// Returns None for slices Istio ignores: MCS-managed, FQDN-addressed, or not owned by a Service.
pub fn endpoint_slice(slice: &discovery::EndpointSlice) -> Result<Option<Object>, TrimError> {
    let (namespace, name) = namespaced(Kind::EndpointSlice, &slice.metadata)?;
    let labels = slice.metadata.labels.as_ref();
    let service = labels.and_then(|l| l.get(LABEL_SERVICE_NAME));
    let mcs = labels.is_some_and(|l| l.contains_key(LABEL_MCS_SERVICE_NAME));
    let Some(service) = service.filter(|_| !mcs && slice.address_type != "FQDN") else {
        return Ok(None);
    };
    let mut ports = Vec::new();
    for p in slice.ports.iter().flatten() {
        let Some(number) = p.port else { continue };
        ports.push((
            p.name.clone().unwrap_or_default(),
            port_number(Kind::EndpointSlice, &namespace, &name, number)?,
        ));
    }
    let endpoints = slice
        .endpoints
        .iter()
        .flatten()
        .map(|ep| {
            let conditions = ep.conditions.clone().unwrap_or_default();
            let pod: Option<Arc<str>> = ep
                .target_ref
                .as_ref()
                .filter(|r| r.kind.as_deref() == Some("Pod"))
                .and_then(|r| r.name.as_deref())
                .map(Arc::from);
            let hostname = ep.hostname.as_deref().map(|h| match &pod {
                Some(name) if **name == *h => name.clone(),
                _ => Arc::from(h),
            });
            SliceEndpoint {
                addresses: ips(&ep.addresses),
                ready: conditions.ready,
                serving: conditions.serving,
                terminating: conditions.terminating,
                pod,
                hostname,
            }
        })
        .collect();
    Ok(Some(Object::EndpointSlice(SliceObj {
        service: service.clone(),
        name,
        namespace,
        ports,
        endpoints,
    })))
}

/// Set by istio-cni on the pods it has redirected to ztunnel.
pub const ANNOTATION_REDIRECTION: &str = "ambient.istio.io/redirection";

pub fn pod(pod: &core::Pod) -> Result<Object, TrimError> {
    let (namespace, name) = namespaced(Kind::Pod, &pod.metadata)?;
    let spec = pod.spec.as_ref();
    let status = pod.status.as_ref();
    let mut addrs: Vec<IpAddr> = status
        .map(|s| ips(s.pod_ips.iter().flatten().map(|p| &p.ip)))
        .unwrap_or_default();
    if addrs.is_empty() {
        addrs = status.map(|s| ips(s.pod_ip.iter())).unwrap_or_default();
    }
    Ok(Object::Pod(PodObj {
        workload: Workload::of_pod(&pod.metadata, &namespace).name.into(),
        labels: Arc::new(pod.metadata.labels.clone().unwrap_or_default()),
        service_account: spec
            .and_then(|s| s.service_account_name.as_deref())
            .unwrap_or("default")
            .into(),
        node: spec.and_then(|s| s.node_name.as_deref()).map(Arc::from),
        ips: addrs,
        ready: status
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True")),
        captured: pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(ANNOTATION_REDIRECTION))
            .is_some_and(|v| v == "enabled"),
        host_network: spec.and_then(|s| s.host_network).unwrap_or(false),
        uid: pod.metadata.uid.as_deref().map(Arc::from),
        terminal: status
            .and_then(|s| s.phase.as_deref())
            .is_some_and(|p| p == "Succeeded" || p == "Failed"),
        name: name.into(),
        namespace: namespace.into(),
    }))
}

pub fn node(node: &core::Node) -> Result<Object, TrimError> {
    let name = name_of(Kind::Node, &node.metadata)?;
    let empty = BTreeMap::new();
    let labels = node.metadata.labels.as_ref().unwrap_or(&empty);
    let first = |keys: &[&str]| -> Arc<str> {
        keys.iter()
            .find_map(|k| labels.get(*k))
            .map(|v| Arc::from(v.as_str()))
            .unwrap_or_else(|| Arc::from(""))
    };
    Ok(Object::Node(NodeObj {
        locality: Arc::new(Locality {
            region: first(&LABEL_REGION),
            zone: first(&LABEL_ZONE),
            subzone: first(&[LABEL_SUBZONE]),
        }),
        name,
    }))
}

/// Secret types that never carry TLS material and are numerous: not watched (as istiod).
pub const UNWATCHED_SECRET_TYPES: [&str; 2] =
    ["helm.sh/release.v1", "kubernetes.io/service-account-token"];

/// The Secret type of registry credentials (WasmPlugin `imagePullSecret`).
const DOCKER_CONFIG_TYPE: &str = "kubernetes.io/dockerconfigjson";

/// Keeps only the keys istiod serves to gateways (and WasmPlugins' registry credentials) (`stringData`, as written in files, overrides
/// `data`, as the API server merges them).
pub fn secret(secret: &core::Secret) -> Result<Object, TrimError> {
    let (namespace, name) = namespaced(Kind::Secret, &secret.metadata)?;
    let value = |key: &str| -> Option<Bytes> {
        let text = secret.string_data.as_ref().and_then(|d| d.get(key));
        let bytes = match text {
            Some(t) => Bytes::from(t.clone().into_bytes()),
            None => Bytes::from(secret.data.as_ref()?.get(key)?.0.clone()),
        };
        (!bytes.is_empty()).then_some(bytes)
    };
    let pair = |cert: &str, key: &str| Some((value(cert)?, value(key)?));
    let docker = secret.type_.as_deref() == Some(DOCKER_CONFIG_TYPE);
    let material = SecretMaterial {
        certificate: pair("cert", "key").or_else(|| pair("tls.crt", "tls.key")),
        ca: value("cacert").or_else(|| value("ca.crt")),
        docker_config: docker.then(|| value(".dockerconfigjson")).flatten(),
    };
    let useful =
        material.certificate.is_some() || material.ca.is_some() || material.docker_config.is_some();
    Ok(Object::Secret(SecretObj {
        name,
        namespace,
        material: useful.then(|| Arc::new(material)),
    }))
}
