//! Istio's configuration API: the kinds meshpilot reads, their typed specs (serde structs for the
//! fields meshpilot supports; unknown fields are tolerated, as the API server does), and Istio's
//! validation rules for them. No I/O: sources parse objects with [`ConfigObject::from_value`] and
//! the config store keeps what validates.

pub mod destination_rule;
pub mod duration;
pub mod envoy_filter;
pub mod extension_provider;
mod fields;
pub mod gateway;
pub mod gateway_api;
pub mod label_selector;
pub mod mcp;
pub mod mesh;
pub mod mesh_fields;
pub mod mesh_traffic;
pub mod proxy_config;
pub mod revision;
pub mod security;
pub mod service_entry;
pub mod service_settings;
pub mod sidecar;
pub mod telemetry;
pub mod tls_names;
pub mod trust_anchor;
mod validate;
pub mod virtual_service;
pub mod wasm_plugin;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::Serialize;
use thiserror::Error;

use crate::text::clip;

pub use destination_rule::DestinationRule;
pub use envoy_filter::EnvoyFilter;
pub use gateway::Gateway;
pub use gateway_api::{
    GatewayClass, GrpcRoute, HttpRoute, KubernetesGateway, ReferenceGrant, TcpRoute, TlsRoute,
};
pub use mesh::MeshConfig;
pub use proxy_config::ProxyConfig;
pub use revision::Revision;
pub use security::authorization::AuthorizationPolicy;
pub use security::peer::PeerAuthentication;
pub use security::request::RequestAuthentication;
pub use service_entry::{ServiceEntry, WorkloadEntry, WorkloadGroup};
pub use sidecar::Sidecar;
pub use telemetry::Telemetry;
pub use validate::ValidationError;
pub use validate::{is_dns1123_label, is_fqdn};
pub use virtual_service::VirtualService;
pub use wasm_plugin::WasmPlugin;

/// A resource kind meshpilot stores: Istio's, and the Gateway API's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ConfigKind {
    ServiceEntry,
    WorkloadEntry,
    WorkloadGroup,
    DestinationRule,
    VirtualService,
    Gateway,
    Sidecar,
    PeerAuthentication,
    AuthorizationPolicy,
    RequestAuthentication,
    Telemetry,
    EnvoyFilter,
    WasmPlugin,
    ProxyConfig,
    GatewayClass,
    /// The Gateway API's Gateway (`gateway.networking.k8s.io`), beside Istio's.
    KubernetesGateway,
    HttpRoute,
    GrpcRoute,
    TcpRoute,
    TlsRoute,
    ReferenceGrant,
}

pub const NETWORKING_GROUP: &str = "networking.istio.io";

/// Where `kubectl apply` puts an object that names no namespace; file manifests are written for it.
pub const DEFAULT_NAMESPACE: &str = "default";
/// Kubernetes' own namespaces, which istiod neither injects into nor (but for `kube-system`, where
/// ztunnel may run) publishes its root certificate in (pkg/kube/inject `IgnoredNamespaces`).
pub const KUBE_SYSTEM_NAMESPACES: [&str; 4] = [
    "kube-system",
    "kube-public",
    "kube-node-lease",
    "local-path-storage",
];
pub const SECURITY_GROUP: &str = "security.istio.io";
pub const TELEMETRY_GROUP: &str = "telemetry.istio.io";
pub const EXTENSIONS_GROUP: &str = "extensions.istio.io";
/// The API groups of Istio's own kinds (whose CRDs meshpilot installs and whose objects its
/// webhook validates).
pub const ISTIO_GROUPS: [&str; 4] = [
    NETWORKING_GROUP,
    SECURITY_GROUP,
    TELEMETRY_GROUP,
    EXTENSIONS_GROUP,
];
/// Every API group of the kinds meshpilot reads: Istio's and the Gateway API.
pub const GROUPS: [&str; 5] = [
    NETWORKING_GROUP,
    SECURITY_GROUP,
    TELEMETRY_GROUP,
    EXTENSIONS_GROUP,
    gateway_api::GROUP,
];

impl ConfigKind {
    pub const ALL: [ConfigKind; 21] = [
        Self::ServiceEntry,
        Self::WorkloadEntry,
        Self::WorkloadGroup,
        Self::DestinationRule,
        Self::VirtualService,
        Self::Gateway,
        Self::Sidecar,
        Self::PeerAuthentication,
        Self::AuthorizationPolicy,
        Self::RequestAuthentication,
        Self::Telemetry,
        Self::EnvoyFilter,
        Self::WasmPlugin,
        Self::ProxyConfig,
        Self::GatewayClass,
        Self::KubernetesGateway,
        Self::HttpRoute,
        Self::GrpcRoute,
        Self::TcpRoute,
        Self::TlsRoute,
        Self::ReferenceGrant,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::ServiceEntry => "ServiceEntry",
            Self::WorkloadEntry => "WorkloadEntry",
            Self::WorkloadGroup => "WorkloadGroup",
            Self::DestinationRule => "DestinationRule",
            Self::VirtualService => "VirtualService",
            Self::Gateway => "Gateway",
            Self::Sidecar => "Sidecar",
            Self::PeerAuthentication => "PeerAuthentication",
            Self::AuthorizationPolicy => "AuthorizationPolicy",
            Self::RequestAuthentication => "RequestAuthentication",
            Self::Telemetry => "Telemetry",
            Self::EnvoyFilter => "EnvoyFilter",
            Self::WasmPlugin => "WasmPlugin",
            Self::ProxyConfig => "ProxyConfig",
            Self::GatewayClass => "GatewayClass",
            Self::KubernetesGateway => "Gateway",
            Self::HttpRoute => "HTTPRoute",
            Self::GrpcRoute => "GRPCRoute",
            Self::TcpRoute => "TCPRoute",
            Self::TlsRoute => "TLSRoute",
            Self::ReferenceGrant => "ReferenceGrant",
        }
    }

    /// The resource's plural, as in its REST path.
    pub fn plural(self) -> &'static str {
        match self {
            Self::ServiceEntry => "serviceentries",
            Self::WorkloadEntry => "workloadentries",
            Self::WorkloadGroup => "workloadgroups",
            Self::DestinationRule => "destinationrules",
            Self::VirtualService => "virtualservices",
            Self::Gateway => "gateways",
            Self::Sidecar => "sidecars",
            Self::PeerAuthentication => "peerauthentications",
            Self::AuthorizationPolicy => "authorizationpolicies",
            Self::RequestAuthentication => "requestauthentications",
            Self::Telemetry => "telemetries",
            Self::EnvoyFilter => "envoyfilters",
            Self::WasmPlugin => "wasmplugins",
            Self::ProxyConfig => "proxyconfigs",
            Self::GatewayClass => "gatewayclasses",
            Self::KubernetesGateway => "gateways",
            Self::HttpRoute => "httproutes",
            Self::GrpcRoute => "grpcroutes",
            Self::TcpRoute => "tcproutes",
            Self::TlsRoute => "tlsroutes",
            Self::ReferenceGrant => "referencegrants",
        }
    }

    pub fn group(self) -> &'static str {
        match self {
            Self::PeerAuthentication | Self::AuthorizationPolicy | Self::RequestAuthentication => {
                SECURITY_GROUP
            }
            Self::Telemetry => TELEMETRY_GROUP,
            Self::WasmPlugin => EXTENSIONS_GROUP,
            k if k.is_gateway_api() => gateway_api::GROUP,
            _ => NETWORKING_GROUP,
        }
    }

    /// A kind of the Kubernetes Gateway API rather than Istio's own.
    pub fn is_gateway_api(self) -> bool {
        self >= Self::GatewayClass
    }

    /// Cluster-scoped rather than namespaced.
    pub fn is_cluster_scoped(self) -> bool {
        self == Self::GatewayClass
    }

    /// The API versions users have, newest first: the first is the one meshpilot watches.
    pub fn versions(self) -> &'static [&'static str] {
        match self {
            Self::GatewayClass | Self::KubernetesGateway | Self::HttpRoute => {
                return &["v1", "v1beta1"]
            }
            Self::GrpcRoute => return &["v1", "v1alpha2"],
            Self::TcpRoute => return &["v1alpha2"],
            Self::TlsRoute => return &["v1", "v1alpha3", "v1alpha2"],
            Self::ReferenceGrant => return &["v1", "v1beta1", "v1alpha2"],
            Self::EnvoyFilter => return &["v1alpha3"],
            Self::ProxyConfig => return &["v1beta1"],
            Self::WasmPlugin => return &["v1alpha1"],
            _ => {}
        }
        match self.group() {
            SECURITY_GROUP => &["v1", "v1beta1"],
            TELEMETRY_GROUP => &["v1", "v1alpha1"],
            _ => &["v1", "v1beta1", "v1alpha3"],
        }
    }

    /// Position in [`Self::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// The kind an `apiVersion` and `kind` name, when meshpilot reads it.
    pub fn from_api(api_version: &str, kind: &str) -> Option<Self> {
        let (group, version) = api_version.split_once('/')?;
        Self::ALL
            .into_iter()
            .find(|k| k.name() == kind && k.group() == group && k.versions().contains(&version))
    }

    /// Whether the kind names an Istio resource meshpilot does not read (a newer kind, say).
    pub fn is_istio_group(api_version: &str) -> bool {
        api_version
            .split_once('/')
            .is_some_and(|(g, _)| g.ends_with(".istio.io"))
    }
}

/// As the API names it (`kind:`); its group tells the two Gateways apart.
impl Serialize for ConfigKind {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.name())
    }
}

impl fmt::Display for ConfigKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            // Told apart from Istio's Gateway, as kubectl names it.
            Self::KubernetesGateway => write!(f, "Gateway.{}", gateway_api::GROUP),
            _ => f.write_str(self.name()),
        }
    }
}

/// Identifies one config object.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct ConfigKey {
    pub kind: ConfigKind,
    pub namespace: Arc<str>,
    pub name: Arc<str>,
}

impl fmt::Display for ConfigKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}/{}", self.kind, self.namespace, self.name)
    }
}

/// Where an object came from, for operators.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase", tag = "type")]
pub enum Origin {
    File {
        path: String,
        document: usize,
    },
    Kubernetes {
        cluster: String,
        resource_version: String,
    },
    /// A WorkloadEntry meshpilot made for a proxy that registered into a WorkloadGroup.
    AutoRegistered {
        proxy: String,
    },
    /// An MCP config source (`xds://<address>`), at the version it gave the object.
    Mcp {
        source: String,
        resource_version: String,
    },
    /// Made from Kubernetes Ingresses of a cluster (`<namespace>/<name>`, oldest first), as
    /// istiod's ingress controller makes its Gateways and VirtualServices.
    Ingress {
        cluster: String,
        ingresses: Vec<String>,
    },
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::File { path, document } => write!(f, "{path}, document {document}"),
            Origin::Kubernetes {
                cluster,
                resource_version,
            } => write!(f, "cluster {cluster}, resourceVersion {resource_version}"),
            Origin::AutoRegistered { proxy } => write!(f, "registered by proxy {proxy}"),
            Origin::Mcp {
                source,
                resource_version,
            } => write!(f, "{source}, version {resource_version}"),
            Origin::Ingress { cluster, ingresses } => {
                write!(f, "cluster {cluster}, Ingress {}", ingresses.join(", "))
            }
        }
    }
}

/// What of an object's metadata meshpilot uses.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ConfigMeta {
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    /// RFC 3339; orders objects the way istiod does (oldest first), then by namespace and name.
    pub creation_timestamp: Option<String>,
    /// The API server's id of the object (owner references name it); None in files.
    pub uid: Option<String>,
    pub origin: Origin,
}

/// A typed spec.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Spec {
    ServiceEntry(ServiceEntry),
    WorkloadEntry(WorkloadEntry),
    WorkloadGroup(WorkloadGroup),
    DestinationRule(Box<DestinationRule>),
    VirtualService(Box<VirtualService>),
    Gateway(Box<Gateway>),
    Sidecar(Box<Sidecar>),
    PeerAuthentication(PeerAuthentication),
    AuthorizationPolicy(AuthorizationPolicy),
    RequestAuthentication(RequestAuthentication),
    Telemetry(Telemetry),
    EnvoyFilter(Box<EnvoyFilter>),
    WasmPlugin(Box<WasmPlugin>),
    ProxyConfig(ProxyConfig),
    GatewayClass(GatewayClass),
    KubernetesGateway(Box<KubernetesGateway>),
    HttpRoute(Box<HttpRoute>),
    GrpcRoute(Box<GrpcRoute>),
    TcpRoute(TcpRoute),
    TlsRoute(TlsRoute),
    ReferenceGrant(ReferenceGrant),
}

/// One validated config object.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ConfigObject {
    pub key: ConfigKey,
    pub meta: ConfigMeta,
    pub spec: Spec,
}

/// Why an object is refused; names the object and, where known, the field.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ConfigError {
    /// The object of this kind cannot even be named (no `metadata.name`).
    #[error("{0} without metadata.name")]
    Unnamed(ConfigKind),
    #[error("{}: {error}", clip(&.key.to_string()))]
    Invalid {
        key: ConfigKey,
        error: ValidationError,
    },
}

impl ConfigObject {
    /// Parses and validates one object (`apiVersion`, `kind`, `metadata`, `spec`) of a known kind.
    /// Returns None for objects that are not a kind meshpilot reads.
    pub fn from_value(
        value: &serde_json::Value,
        origin: Origin,
    ) -> Option<Result<Self, ConfigError>> {
        let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_string();
        let kind = ConfigKind::from_api(&text(&value["apiVersion"]), &text(&value["kind"]))?;
        Some(Self::parse(kind, value, origin))
    }

    fn parse(
        kind: ConfigKind,
        value: &serde_json::Value,
        origin: Origin,
    ) -> Result<Self, ConfigError> {
        let metadata = &value["metadata"];
        let name = metadata["name"].as_str().unwrap_or_default();
        if name.is_empty() {
            return Err(ConfigError::Unnamed(kind));
        }
        // As `kubectl apply` without `-n`: Istio's samples name no namespace.
        let namespace = match metadata["namespace"].as_str() {
            _ if kind.is_cluster_scoped() => "",
            Some(ns) if !ns.is_empty() => ns,
            _ => DEFAULT_NAMESPACE,
        };
        let key = ConfigKey {
            kind,
            namespace: namespace.into(),
            name: name.into(),
        };
        let invalid = |error: ValidationError| ConfigError::Invalid {
            key: key.clone(),
            error,
        };
        fields::undeclared_around_spec(value).map_err(invalid)?;
        let strings = |v: &serde_json::Value| -> Result<BTreeMap<String, String>, ConfigError> {
            match v {
                serde_json::Value::Null => Ok(BTreeMap::new()),
                v => serde_json::from_value(v.clone())
                    .map_err(|e| invalid(ValidationError::at("metadata", clip(&e.to_string())))),
            }
        };
        let meta = ConfigMeta {
            labels: strings(&metadata["labels"])?,
            annotations: strings(&metadata["annotations"])?,
            creation_timestamp: metadata["creationTimestamp"].as_str().map(str::to_string),
            uid: metadata["uid"].as_str().map(str::to_string),
            origin,
        };
        let spec_value = match &value["spec"] {
            serde_json::Value::Null => serde_json::Value::Object(Default::default()),
            v @ serde_json::Value::Object(_) => v.clone(),
            _ => return Err(invalid(ValidationError::at("spec", "must be an object"))),
        };
        let spec = match kind {
            ConfigKind::ServiceEntry => {
                let mut entry: ServiceEntry = typed(kind, spec_value).map_err(invalid)?;
                entry.status_addresses = service_entry::StatusAddress::read(&value["status"]);
                Spec::ServiceEntry(entry)
            }
            ConfigKind::WorkloadEntry => {
                Spec::WorkloadEntry(typed(kind, spec_value).map_err(invalid)?)
            }
            ConfigKind::WorkloadGroup => {
                Spec::WorkloadGroup(typed(kind, spec_value).map_err(invalid)?)
            }
            ConfigKind::DestinationRule => {
                Spec::DestinationRule(Box::new(typed(kind, spec_value).map_err(invalid)?))
            }
            ConfigKind::VirtualService => {
                Spec::VirtualService(Box::new(typed(kind, spec_value).map_err(invalid)?))
            }
            ConfigKind::Gateway => {
                Spec::Gateway(Box::new(typed(kind, spec_value).map_err(invalid)?))
            }
            ConfigKind::Sidecar => {
                Spec::Sidecar(Box::new(typed(kind, spec_value).map_err(invalid)?))
            }
            ConfigKind::PeerAuthentication => {
                Spec::PeerAuthentication(typed(kind, spec_value).map_err(invalid)?)
            }
            ConfigKind::AuthorizationPolicy => {
                Spec::AuthorizationPolicy(typed(kind, spec_value).map_err(invalid)?)
            }
            ConfigKind::RequestAuthentication => {
                Spec::RequestAuthentication(typed(kind, spec_value).map_err(invalid)?)
            }
            ConfigKind::Telemetry => Spec::Telemetry(typed(kind, spec_value).map_err(invalid)?),
            ConfigKind::EnvoyFilter => {
                let mut filter: EnvoyFilter = typed(kind, spec_value).map_err(invalid)?;
                filter.compile().map_err(invalid)?;
                Spec::EnvoyFilter(Box::new(filter))
            }
            ConfigKind::WasmPlugin => {
                Spec::WasmPlugin(Box::new(typed(kind, spec_value).map_err(invalid)?))
            }
            ConfigKind::ProxyConfig => Spec::ProxyConfig(typed(kind, spec_value).map_err(invalid)?),
            ConfigKind::GatewayClass => {
                Spec::GatewayClass(typed(kind, spec_value).map_err(invalid)?)
            }
            ConfigKind::KubernetesGateway => {
                Spec::KubernetesGateway(Box::new(typed(kind, spec_value).map_err(invalid)?))
            }
            ConfigKind::HttpRoute => {
                Spec::HttpRoute(Box::new(typed(kind, spec_value).map_err(invalid)?))
            }
            ConfigKind::GrpcRoute => {
                Spec::GrpcRoute(Box::new(typed(kind, spec_value).map_err(invalid)?))
            }
            ConfigKind::TcpRoute => Spec::TcpRoute(typed(kind, spec_value).map_err(invalid)?),
            ConfigKind::TlsRoute => Spec::TlsRoute(typed(kind, spec_value).map_err(invalid)?),
            ConfigKind::ReferenceGrant => {
                Spec::ReferenceGrant(typed(kind, spec_value).map_err(invalid)?)
            }
        };
        let object = Self {
            key: key.clone(),
            meta,
            spec,
        };
        object.validate().map_err(invalid)?;
        Ok(object)
    }

    fn validate(&self) -> Result<(), ValidationError> {
        match &self.spec {
            Spec::ServiceEntry(se) => se.validate(),
            Spec::WorkloadEntry(we) => we.validate_standalone(),
            Spec::WorkloadGroup(wg) => wg.validate(),
            Spec::DestinationRule(dr) => dr.validate(),
            Spec::VirtualService(vs) => vs.validate(),
            Spec::Gateway(gw) => gw.validate(),
            Spec::Sidecar(sc) => sc.validate(),
            Spec::PeerAuthentication(pa) => pa.validate(),
            Spec::AuthorizationPolicy(ap) => ap.validate(),
            Spec::RequestAuthentication(ra) => ra.validate(),
            Spec::Telemetry(t) => t.validate(),
            // Validated as its patches were read.
            Spec::EnvoyFilter(_) => Ok(()),
            Spec::WasmPlugin(p) => p.validate(),
            Spec::ProxyConfig(p) => p.validate(),
            Spec::GatewayClass(c) => c.validate(),
            Spec::KubernetesGateway(g) => g.validate(),
            Spec::HttpRoute(r) => r.validate(),
            Spec::GrpcRoute(r) => r.validate(),
            Spec::TcpRoute(r) => r.validate(),
            Spec::TlsRoute(r) => r.validate(),
            Spec::ReferenceGrant(g) => g.validate(),
        }
    }

    /// Whether two versions say the same (where they came from aside: a new resourceVersion
    /// with the same spec changes nothing for proxies).
    pub fn same_content(&self, other: &ConfigObject) -> bool {
        self.key == other.key
            && self.spec == other.spec
            && self.meta.labels == other.meta.labels
            && self.meta.annotations == other.meta.annotations
            && self.meta.creation_timestamp == other.meta.creation_timestamp
    }

    /// `exportTo` of kinds that have it; empty means the mesh default.
    pub fn export_to(&self) -> &[String] {
        match &self.spec {
            Spec::ServiceEntry(se) => &se.export_to,
            Spec::DestinationRule(dr) => &dr.export_to,
            Spec::VirtualService(vs) => &vs.export_to,
            _ => &[],
        }
    }
}

/// Deserializes a spec of `kind`; the error names the field path serde stopped at, a field Istio's
/// schema does not declare, or one meshpilot's typed spec does not read.
fn typed<T: DeserializeOwned>(
    kind: ConfigKind,
    value: serde_json::Value,
) -> Result<T, ValidationError> {
    fields::undeclared(kind, &value)?;
    let mut unread: Option<Vec<fields::Step>> = None;
    let mut note = |path: serde_ignored::Path| {
        unread.get_or_insert_with(|| steps(&path));
    };
    let ignoring = serde_ignored::Deserializer::new(value, &mut note);
    let spec = serde_path_to_error::deserialize(ignoring).map_err(|e| {
        let path = e.path().to_string();
        ValidationError::at(
            if path == "." {
                "spec".into()
            } else {
                clip(&path)
            },
            clip(&e.into_inner().to_string()),
        )
    })?;
    match unread {
        Some(steps) => Err(fields::not_implemented(kind, &steps)),
        None => Ok(spec),
    }
}

/// The steps from the spec to an ignored field.
pub(super) fn steps(path: &serde_ignored::Path) -> Vec<fields::Step> {
    use serde_ignored::Path;
    let (parent, step) = match path {
        Path::Root => return Vec::new(),
        Path::Seq { parent, index } => (parent, Some(fields::Step::Index(*index))),
        Path::Map { parent, key } => (parent, Some(fields::Step::Key(key.clone()))),
        Path::Some { parent }
        | Path::NewtypeStruct { parent }
        | Path::NewtypeVariant { parent } => (parent, None),
    };
    let mut steps = steps(parent);
    steps.extend(step);
    steps
}

/// A valid object of the kind named `kind` (at its first served version) for unit tests.
#[cfg(test)]
pub(crate) fn test_object(
    kind: &str,
    namespace: &str,
    name: &str,
    created: &str,
    spec: serde_json::Value,
) -> Arc<ConfigObject> {
    let known = ConfigKind::ALL.into_iter().find(|k| k.name() == kind);
    let known = known.unwrap_or_else(|| panic!("{kind} is not a kind meshpilot reads"));
    let value = serde_json::json!({
        "apiVersion": format!("{}/{}", known.group(), known.versions()[0]),
        "kind": kind,
        "metadata": {"name": name, "namespace": namespace, "creationTimestamp": created},
        "spec": spec,
    });
    let origin = Origin::File {
        path: "test.yaml".into(),
        document: 1,
    };
    match ConfigObject::from_value(&value, origin) {
        Some(Ok(object)) => Arc::new(object),
        other => panic!("{kind} {namespace}/{name} is not valid: {other:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn origin() -> Origin {
        Origin::File {
            path: "dr.yaml".into(),
            document: 1,
        }
    }

    #[test]
    fn kinds_follow_their_api_versions() {
        assert_eq!(
            ConfigKind::from_api("networking.istio.io/v1alpha3", "DestinationRule"),
            Some(ConfigKind::DestinationRule)
        );
        assert_eq!(
            ConfigKind::from_api("security.istio.io/v1beta1", "PeerAuthentication"),
            Some(ConfigKind::PeerAuthentication)
        );
        assert_eq!(
            ConfigKind::from_api("security.istio.io/v1alpha3", "PeerAuthentication"),
            None
        );
        assert_eq!(ConfigKind::from_api("v1", "Service"), None);
    }

    #[test]
    fn a_field_of_the_wrong_type_is_named() {
        let value = serde_json::json!({
            "apiVersion": "networking.istio.io/v1",
            "kind": "DestinationRule",
            "metadata": {"name": "r", "namespace": "shop"},
            "spec": {"host": "r", "trafficPolicy": {"connectionPool": {"tcp": {"maxConnections": "many"}}}}
        });
        let err = ConfigObject::from_value(&value, origin())
            .unwrap()
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("DestinationRule shop/r: "), "{err}");
        assert!(
            err.contains("trafficPolicy.connectionPool.tcp.maxConnections"),
            "{err}"
        );
    }

    #[test]
    fn other_kinds_are_skipped() {
        let other = serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap"});
        assert!(ConfigObject::from_value(&other, origin()).is_none());
    }

    fn refusal(value: serde_json::Value) -> String {
        ConfigObject::from_value(&value, origin())
            .expect("a kind meshpilot reads")
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn fields_istio_does_not_declare_are_refused() {
        let dr = |spec: serde_json::Value| {
            serde_json::json!({
                "apiVersion": "networking.istio.io/v1beta1", "kind": "DestinationRule",
                "metadata": {"name": "r", "namespace": "shop", "uid": "x"}, "spec": spec
            })
        };
        assert_eq!(
            refusal(dr(
                serde_json::json!({"host": "r", "somethingNew": {"a": 1}})
            )),
            "DestinationRule shop/r: somethingNew: unknown field \"somethingNew\""
        );
        let mut misplaced = dr(serde_json::json!({"host": "r"}));
        misplaced["metadata"]["namspace"] = "prod".into();
        assert_eq!(
            refusal(misplaced),
            "DestinationRule shop/r: metadata.namspace: unknown field \"namspace\" (did you mean namespace?)"
        );
        let mut misspelt = dr(serde_json::json!(null));
        misspelt["sepc"] = serde_json::json!({"host": "r"});
        assert!(refusal(misspelt).ends_with("sepc: unknown field \"sepc\" (did you mean spec?)"));
    }

    #[test]
    fn istio_fields_meshpilot_does_not_read_are_refused() {
        let value = serde_json::json!({
            "apiVersion": "networking.istio.io/v1", "kind": "VirtualService",
            "metadata": {"name": "v", "namespace": "shop"},
            "spec": {"hosts": ["a"], "http": [{"route": [{"destination": {"host": "a"}}],
                "retries": {"attempts": 2, "backoff": "1s"}}]}
        });
        assert_eq!(
            refusal(value),
            "VirtualService shop/v: http[0].retries.backoff: is an Istio field meshpilot does not \
             implement; remove it (the object would be applied without it)"
        );
    }

    #[test]
    fn both_spellings_istio_declares_are_read() {
        let value = serde_json::json!({
            "apiVersion": "security.istio.io/v1", "kind": "RequestAuthentication",
            "metadata": {"name": "r", "namespace": "shop"},
            "spec": {"jwtRules": [{"issuer": "i", "jwks_uri": "https://i.example/keys"}]}
        });
        let object = ConfigObject::from_value(&value, origin()).unwrap().unwrap();
        let Spec::RequestAuthentication(ra) = object.spec else {
            panic!("{object:?}")
        };
        assert_eq!(ra.jwt_rules[0].jwks_uri, "https://i.example/keys");
    }

    #[test]
    fn refusals_quote_a_bounded_excerpt_of_the_object() {
        let long = "x".repeat(10_000);
        let objects = [
            serde_json::json!({"apiVersion": "networking.istio.io/v1", "kind": "DestinationRule",
                "metadata": {"name": "r", "namespace": "shop"}, "spec": {"host": long}}),
            serde_json::json!({"apiVersion": "networking.istio.io/v1", "kind": "DestinationRule",
                "metadata": {"name": long, "namespace": "shop"}, "spec": {}}),
            serde_json::json!({"apiVersion": "networking.istio.io/v1", "kind": "DestinationRule",
                "metadata": {"name": long}, "spec": {}}),
            serde_json::json!({"apiVersion": "networking.istio.io/v1", "kind": "DestinationRule",
                "metadata": {"name": "r", "namespace": "shop"},
                "spec": {"host": "r", "trafficPolicy": {"tls": {"mode": long}}}}),
            serde_json::json!({"apiVersion": "networking.istio.io/v1", "kind": "DestinationRule",
                "metadata": {"name": "r", "namespace": "shop", "labels": long}, "spec": {}}),
            serde_json::json!({"apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
                "metadata": {"name": "r", "namespace": "shop"},
                "spec": {"rules": [{"from": [{"source": {"ipBlocks": [long]}}]}]}}),
        ];
        for value in objects {
            let error = ConfigObject::from_value(&value, origin())
                .expect("a kind meshpilot reads")
                .unwrap_err()
                .to_string();
            let kind = value["kind"].as_str().unwrap_or_default();
            assert!(error.starts_with(kind), "{error}");
            assert!(error.len() < 1000, "{} bytes: {error}", error.len());
        }
    }
}
