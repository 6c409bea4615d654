//! Istio's config over xDS (MCP): each kind a SotW type whose URL is its group, version and kind
//! (`networking.istio.io/v1/ServiceEntry`), each object an `istio.mcp.v1alpha1.Resource` holding
//! its metadata (`namespace/name`, labels, annotations, creation time, version) and its spec as
//! the Istio API's protobuf message (facts from istio/api; the messages are ours in proto/istio).
//! Bodies are read and written by reflection, through the same JSON form the other sources use,
//! so an MCP object is validated exactly as a file or an API server object is.

use std::collections::BTreeMap;
use std::sync::LazyLock;

use prost::Message;
use prost_reflect::{DynamicMessage, SerializeOptions};

use super::{ConfigKind, ConfigObject, Origin};
use crate::envoy_api;
use crate::text::clip;

/// The generated MCP messages (`Resource`, `Metadata`).
pub mod proto {
    #![allow(clippy::all)]
    tonic::include_proto!("istio.mcp.v1alpha1");
}

pub use proto::{Metadata, Resource};

/// The type URL of the `Any` each MCP resource is sent in.
pub const RESOURCE_TYPE_URL: &str = "type.googleapis.com/istio.mcp.v1alpha1.Resource";

/// The Istio API message of a kind's spec (its MCP body); None for kinds without one (the Gateway
/// API's are Kubernetes types, not protobuf).
pub fn spec_message(kind: ConfigKind) -> Option<&'static str> {
    Some(match kind {
        ConfigKind::ServiceEntry => "istio.networking.v1alpha3.ServiceEntry",
        ConfigKind::WorkloadEntry => "istio.networking.v1alpha3.WorkloadEntry",
        ConfigKind::WorkloadGroup => "istio.networking.v1alpha3.WorkloadGroup",
        ConfigKind::DestinationRule => "istio.networking.v1alpha3.DestinationRule",
        ConfigKind::VirtualService => "istio.networking.v1alpha3.VirtualService",
        ConfigKind::Gateway => "istio.networking.v1alpha3.Gateway",
        ConfigKind::Sidecar => "istio.networking.v1alpha3.Sidecar",
        ConfigKind::EnvoyFilter => "istio.networking.v1alpha3.EnvoyFilter",
        ConfigKind::ProxyConfig => "istio.networking.v1beta1.ProxyConfig",
        ConfigKind::PeerAuthentication => "istio.security.v1beta1.PeerAuthentication",
        ConfigKind::AuthorizationPolicy => "istio.security.v1beta1.AuthorizationPolicy",
        ConfigKind::RequestAuthentication => "istio.security.v1beta1.RequestAuthentication",
        ConfigKind::Telemetry => "istio.telemetry.v1alpha1.Telemetry",
        ConfigKind::WasmPlugin => "istio.extensions.v1alpha1.WasmPlugin",
        _ => return None,
    })
}

/// The kinds MCP carries, in istiod's Pilot collection.
pub fn kinds() -> impl Iterator<Item = ConfigKind> {
    ConfigKind::ALL
        .into_iter()
        .filter(|k| spec_message(*k).is_some())
}

/// A kind's type URL at one of its versions: `<group>/<version>/<Kind>`.
pub fn type_url(kind: ConfigKind, version: &str) -> String {
    format!("{}/{version}/{}", kind.group(), kind.name())
}

/// The type URLs of every version of every kind MCP carries, made once: what the xDS server
/// names them by.
pub fn type_urls() -> &'static BTreeMap<(ConfigKind, usize), String> {
    static URLS: LazyLock<BTreeMap<(ConfigKind, usize), String>> = LazyLock::new(|| {
        kinds()
            .flat_map(|kind| {
                kind.versions()
                    .iter()
                    .enumerate()
                    .map(move |(i, version)| ((kind, i), type_url(kind, version)))
            })
            .collect()
    });
    &URLS
}

/// The kind and version (its index among the kind's versions) a type URL names, if MCP carries it.
pub fn parse_type_url(url: &str) -> Option<(ConfigKind, usize)> {
    let mut parts = url.splitn(3, '/');
    let (group, version, kind) = (parts.next()?, parts.next()?, parts.next()?);
    let kind = ConfigKind::from_api(&format!("{group}/{version}"), kind)?;
    spec_message(kind)?;
    let index = kind.versions().iter().position(|v| *v == version)?;
    Some((kind, index))
}

/// Why an MCP resource cannot be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum McpError {
    #[error("resource name {0:?} is not <namespace>/<name>")]
    Name(String),
    #[error("{name}: body is {found:?}, not {expected}")]
    BodyType {
        name: String,
        found: String,
        expected: &'static str,
    },
    #[error("{name}: {message}")]
    Body { name: String, message: String },
}

/// An MCP resource of `kind` as a Kubernetes-shaped object (`apiVersion`, `kind`, `metadata`,
/// `spec`), for [`ConfigObject::from_value`].
pub fn to_object(kind: ConfigKind, resource: &Resource) -> Result<serde_json::Value, McpError> {
    let metadata = resource.metadata.clone().unwrap_or_default();
    let (namespace, name) = match metadata.name.split('/').collect::<Vec<_>>()[..] {
        [namespace, name] if !namespace.is_empty() && !name.is_empty() => (namespace, name),
        _ => return Err(McpError::Name(clip(&metadata.name))),
    };
    let expected = spec_message(kind).unwrap_or_default();
    let body = resource.body.clone().unwrap_or_default();
    let found = body.type_url.rsplit('/').next().unwrap_or_default();
    if found != expected {
        return Err(McpError::BodyType {
            name: clip(&metadata.name),
            found: clip(&body.type_url),
            expected,
        });
    }
    let failed = |message: String| McpError::Body {
        name: clip(&metadata.name),
        message: clip(&message),
    };
    let spec = envoy_api::unpack(&body.type_url, &body.value).map_err(|e| failed(e.to_string()))?;
    let options = SerializeOptions::new().stringify_64_bit_integers(false);
    let spec = spec
        .serialize_with_options(serde_json::value::Serializer, &options)
        .map_err(|e| failed(e.to_string()))?;
    let spec = whole_numbers(spec);
    let mut object = serde_json::json!({
        "apiVersion": format!("{}/{}", kind.group(), kind.versions()[0]),
        "kind": kind.name(),
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": metadata.labels,
            "annotations": metadata.annotations,
        },
        "spec": spec,
    });
    if let Some(created) = metadata.create_time.and_then(rfc3339) {
        object["metadata"]["creationTimestamp"] = created.into();
    }
    Ok(object)
}

/// An accepted object as an MCP resource: its spec, in the JSON form every source reads, written
/// as the kind's Istio API message.
pub fn from_object(object: &ConfigObject) -> Result<Resource, McpError> {
    let key = &object.key;
    let name = format!("{}/{}", key.namespace, key.name);
    let failed = |message: String| McpError::Body {
        name: name.clone(),
        message: clip(&message),
    };
    let message = spec_message(key.kind).ok_or_else(|| failed("not carried by MCP".into()))?;
    let spec = serde_json::to_value(&object.spec).map_err(|e| failed(e.to_string()))?;
    let spec: DynamicMessage =
        envoy_api::from_json(message, &without_nulls(spec)).map_err(|e| failed(e.to_string()))?;
    let version = match &object.meta.origin {
        Origin::Kubernetes {
            resource_version, ..
        }
        | Origin::Mcp {
            resource_version, ..
        } => resource_version.clone(),
        Origin::File { .. } | Origin::AutoRegistered { .. } | Origin::Ingress { .. } => {
            String::new()
        }
    };
    Ok(Resource {
        metadata: Some(Metadata {
            name: name.clone(),
            create_time: object
                .meta
                .creation_timestamp
                .as_deref()
                .and_then(timestamp),
            version,
            labels: object.meta.labels.clone().into_iter().collect(),
            annotations: object.meta.annotations.clone().into_iter().collect(),
        }),
        body: Some(prost_types::Any {
            type_url: format!("{}{message}", envoy_api::TYPE_URL_PREFIX),
            value: spec.encode_to_vec(),
        }),
    })
}

/// Reads an MCP resource, as an object of `origin`.
pub fn read(kind: ConfigKind, resource: &Resource, origin: Origin) -> Result<ConfigObject, String> {
    let value = to_object(kind, resource).map_err(|e| e.to_string())?;
    match ConfigObject::from_value(&value, origin) {
        Some(result) => result.map_err(|e| e.to_string()),
        None => Err(format!("{kind} is not a kind meshpilot reads")),
    }
}

/// The JSON without what the typed specs write for unset fields — `null`, `""` (an unset enum
/// too), `[]` — which protobuf JSON would read as defaults or refuse (an enum named by `""`).
fn without_nulls(value: serde_json::Value) -> serde_json::Value {
    let unset = |v: &serde_json::Value| match v {
        serde_json::Value::Null => true,
        serde_json::Value::String(s) => s.is_empty(),
        serde_json::Value::Array(items) => items.is_empty(),
        _ => false,
    };
    match value {
        serde_json::Value::Object(map) => serde_json::Value::Object(
            map.into_iter()
                .filter(|(_, v)| !unset(v))
                .map(|(k, v)| (k, without_nulls(v)))
                .collect(),
        ),
        serde_json::Value::Array(items) => {
            serde_json::Value::Array(items.into_iter().map(without_nulls).collect())
        }
        other => other,
    }
}

/// Numbers a `Struct` carries as doubles written as integers where they are whole (`1024`, not
/// `1024.0`), as they were written: free-form values (EnvoyFilter patches, plugin configs) compare
/// equal to the objects they came from, and integer fields read them.
fn whole_numbers(value: serde_json::Value) -> serde_json::Value {
    match value {
        serde_json::Value::Number(n) => match n.as_f64() {
            Some(f) if n.is_f64() && f.fract() == 0.0 && f.abs() < 9.0e15 => (f as i64).into(),
            _ => serde_json::Value::Number(n),
        },
        serde_json::Value::Array(items) => items.into_iter().map(whole_numbers).collect(),
        serde_json::Value::Object(map) => map
            .into_iter()
            .map(|(k, v)| (k, whole_numbers(v)))
            .collect(),
        other => other,
    }
}

fn rfc3339(time: prost_types::Timestamp) -> Option<String> {
    let at = time::OffsetDateTime::from_unix_timestamp(time.seconds).ok()?;
    at.format(&time::format_description::well_known::Rfc3339)
        .ok()
}

fn timestamp(text: &str) -> Option<prost_types::Timestamp> {
    let at =
        time::OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339).ok()?;
    Some(prost_types::Timestamp {
        seconds: at.unix_timestamp(),
        nanos: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One object of every kind MCP carries, as users write them.
    const OBJECTS: &str = r#"
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: api, namespace: shop, labels: {team: a}, creationTimestamp: "2024-05-01T10:00:00Z"}
spec:
  hosts: [api.example.com]
  ports: [{number: 443, name: https, protocol: TLS}]
  resolution: DNS
  location: MESH_EXTERNAL
  endpoints: [{address: 10.0.0.1, ports: {https: 8443}, labels: {v: "1"}, weight: 3}]
---
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {name: reviews, namespace: shop}
spec:
  host: reviews
  trafficPolicy:
    connectionPool: {tcp: {maxConnections: 100, connectTimeout: 30ms}, http: {http1MaxPendingRequests: 10}}
    loadBalancer: {consistentHash: {httpHeaderName: x-user, minimumRingSize: 2048}}
    outlierDetection: {consecutive5xxErrors: 5, interval: 10s, baseEjectionTime: 15m}
  subsets: [{name: v1, labels: {version: v1}}]
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: reviews, namespace: shop}
spec:
  hosts: [reviews]
  http:
  - match: [{headers: {end-user: {exact: jason}}, uri: {prefix: /a}}]
    route: [{destination: {host: reviews, subset: v2}, weight: 100}]
    timeout: 1.5s
    retries: {attempts: 3, perTryTimeout: 2s, retryOn: 5xx}
    fault: {abort: {httpStatus: 418, percentage: {value: 50}}}
---
apiVersion: networking.istio.io/v1
kind: Gateway
metadata: {name: web, namespace: shop}
spec:
  selector: {istio: ingressgateway}
  servers: [{port: {number: 443, name: https, protocol: HTTPS}, hosts: ["*"], tls: {mode: SIMPLE, credentialName: web-cert}}]
---
apiVersion: networking.istio.io/v1
kind: Sidecar
metadata: {name: default, namespace: shop}
spec:
  egress: [{hosts: ["./*", "istio-system/*"]}]
  outboundTrafficPolicy: {mode: REGISTRY_ONLY}
---
apiVersion: networking.istio.io/v1
kind: WorkloadEntry
metadata: {name: vm1, namespace: shop}
spec: {address: 10.1.1.1, labels: {app: vm}, serviceAccount: vm, network: net2}
---
apiVersion: networking.istio.io/v1
kind: WorkloadGroup
metadata: {name: vms, namespace: shop}
spec: {metadata: {labels: {app: vm}}, template: {serviceAccount: vm}}
---
apiVersion: networking.istio.io/v1alpha3
kind: EnvoyFilter
metadata: {name: buffer, namespace: shop}
spec:
  workloadSelector: {labels: {app: reviews}}
  priority: -2
  configPatches:
  - applyTo: CLUSTER
    match: {context: SIDECAR_OUTBOUND, cluster: {service: reviews.shop.svc.cluster.local}}
    patch: {operation: MERGE, value: {per_connection_buffer_limit_bytes: 1024}}
---
apiVersion: networking.istio.io/v1beta1
kind: ProxyConfig
metadata: {name: pc, namespace: shop}
spec: {concurrency: 2, environmentVariables: {A: b}, image: {imageType: debug}}
---
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: default, namespace: shop}
spec: {selector: {matchLabels: {app: reviews}}, mtls: {mode: STRICT}, portLevelMtls: {"8080": {mode: DISABLE}}}
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: deny, namespace: shop}
spec:
  action: DENY
  rules: [{from: [{source: {principals: [cluster.local/ns/x/sa/y]}}], to: [{operation: {paths: [/admin]}}]}]
---
apiVersion: security.istio.io/v1
kind: RequestAuthentication
metadata: {name: jwt, namespace: shop}
spec: {jwtRules: [{issuer: "https://issuer", jwksUri: "https://issuer/keys", forwardOriginalToken: true}]}
---
apiVersion: telemetry.istio.io/v1
kind: Telemetry
metadata: {name: logs, namespace: shop}
spec:
  accessLogging: [{providers: [{name: envoy}], filter: {expression: "response.code >= 400"}}]
  tracing: [{randomSamplingPercentage: 10.5, customTags: {t: {literal: {value: x}}}}]
---
apiVersion: extensions.istio.io/v1alpha1
kind: WasmPlugin
metadata: {name: auth, namespace: shop}
spec: {url: "oci://r/p:1", phase: AUTHN, priority: 5, pluginConfig: {a: [1, 2]}, match: [{mode: SERVER, ports: [{number: 80}]}]}
"#;

    fn objects() -> Vec<ConfigObject> {
        OBJECTS
            .split("\n---\n")
            .map(|doc| {
                let value: serde_json::Value = serde_yaml_ng::from_str(doc).unwrap();
                let origin = Origin::File {
                    path: "t.yaml".into(),
                    document: 0,
                };
                ConfigObject::from_value(&value, origin)
                    .unwrap()
                    .unwrap_or_else(|e| panic!("{e}"))
            })
            .collect()
    }

    #[test]
    fn every_kind_goes_out_and_comes_back_as_it_was() {
        let objects = objects();
        assert_eq!(objects.len(), kinds().count(), "one object of every kind");
        for object in objects {
            let resource = from_object(&object).unwrap_or_else(|e| panic!("{e}"));
            let bytes = resource.encode_to_vec();
            let back = Resource::decode(bytes.as_slice()).unwrap();
            let origin = Origin::Mcp {
                source: "xds://a:15010".into(),
                resource_version: String::new(),
            };
            let read = read(object.key.kind, &back, origin).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(read.key, object.key);
            assert_eq!(read.spec, object.spec, "{}", object.key);
            assert_eq!(read.meta.labels, object.meta.labels);
            assert_eq!(read.meta.creation_timestamp, object.meta.creation_timestamp);
        }
    }

    #[test]
    fn type_urls_name_a_kind_at_any_of_its_versions() {
        assert_eq!(
            parse_type_url("networking.istio.io/v1alpha3/VirtualService"),
            Some((ConfigKind::VirtualService, 2))
        );
        assert_eq!(
            parse_type_url("security.istio.io/v1/AuthorizationPolicy"),
            Some((ConfigKind::AuthorizationPolicy, 0))
        );
        assert_eq!(
            parse_type_url("gateway.networking.k8s.io/v1/HTTPRoute"),
            None
        );
        assert_eq!(
            parse_type_url("networking.istio.io/v9/VirtualService"),
            None
        );
        assert_eq!(
            parse_type_url("type.googleapis.com/envoy.config.cluster.v3.Cluster"),
            None
        );
    }

    #[test]
    fn a_bad_name_or_body_is_refused_naming_it() {
        let resource = Resource {
            metadata: Some(Metadata {
                name: "no-namespace".into(),
                ..Default::default()
            }),
            body: None,
        };
        let error = to_object(ConfigKind::ServiceEntry, &resource).unwrap_err();
        assert_eq!(error, McpError::Name("no-namespace".into()));
        let resource = Resource {
            metadata: Some(Metadata {
                name: "a/b".into(),
                ..Default::default()
            }),
            body: Some(prost_types::Any {
                type_url: "type.googleapis.com/istio.networking.v1alpha3.VirtualService".into(),
                value: vec![],
            }),
        };
        let error = to_object(ConfigKind::ServiceEntry, &resource).unwrap_err();
        assert!(matches!(error, McpError::BodyType { .. }), "{error}");
    }
}
