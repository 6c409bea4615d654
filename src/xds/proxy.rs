//! Proxy identity from the Envoy Node, as Istio reads it.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use serde::Serialize;
use thiserror::Error;

use crate::model::{ClusterId, Locality};
use crate::text::Quoted;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum NodeError {
    #[error("the first request of a stream carries no node")]
    Missing,
    #[error("invalid node id {}: {problem} (expected <type>~<ip>~<pod>.<namespace>~<namespace>.svc.<domain>)", Quoted(.id))]
    Id { id: String, problem: String },
    #[error("invalid node metadata {key}: {problem}")]
    Metadata { key: &'static str, problem: String },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ProxyType {
    /// A workload's sidecar.
    Sidecar,
    /// A gateway.
    Router,
    /// Ambient mode's node proxy: asks for workloads and authorizations only.
    Ztunnel,
    /// Ambient mode's waypoint or east-west gateway (Envoy serving HBONE).
    Waypoint,
}

/// Which flavour of configuration the client understands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Generator {
    Envoy,
    /// Proxyless gRPC (metadata GENERATOR=grpc).
    Grpc,
    /// A debug client such as istioctl (GENERATOR=event): asks for `istio.io/debug/*` only and is
    /// not listed among the proxies.
    Event,
}

#[derive(Clone, Debug, Serialize)]
pub struct Proxy {
    /// The full node id.
    pub id: String,
    pub kind: ProxyType,
    pub ips: Vec<IpAddr>,
    /// `<pod>.<namespace>` part of the id.
    pub workload: String,
    pub namespace: Arc<str>,
    pub cluster_id: Option<ClusterId>,
    pub network: Arc<str>,
    pub labels: BTreeMap<String, String>,
    pub istio_version: String,
    pub service_account: Option<String>,
    pub generator: Generator,
    pub requested_network_view: Vec<String>,
    pub locality: Locality,
    /// The WorkloadGroup (in the proxy's namespace) a VM's proxy registers itself into.
    pub auto_register_group: Option<String>,
    /// The service account the stream proved over the secure port (with the proxy's namespace):
    /// what gateway credentials it may read depends on it.
    pub verified_account: Option<String>,
    /// Its agent answers the workload's DNS (`ISTIO_META_DNS_CAPTURE`): it resolves ServiceEntry
    /// hosts to their auto-allocated addresses, so its listeners match those addresses too.
    pub dns_capture: bool,
    /// The mesh it says it belongs to (`MESH_ID`), and its service cluster (the node's `cluster`):
    /// what its spans are tagged and named with.
    pub mesh_id: String,
    pub service_cluster: String,
    /// Its string-valued node metadata, which EnvoyFilters may match on.
    pub metadata: BTreeMap<String, String>,
}

impl Proxy {
    pub fn from_node(node: Option<&Node>) -> Result<Self, NodeError> {
        let node = node.ok_or(NodeError::Missing)?;
        let id_error = |problem: &str| NodeError::Id {
            id: node.id.clone(),
            problem: problem.into(),
        };
        let parts: Vec<&str> = node.id.split('~').collect();
        let [kind, ip, workload, domain] = parts[..] else {
            return Err(id_error(&format!(
                "{} parts separated by '~', not 4",
                parts.len()
            )));
        };
        let kind = match kind {
            "sidecar" => ProxyType::Sidecar,
            "router" => ProxyType::Router,
            "ztunnel" => ProxyType::Ztunnel,
            "waypoint" => ProxyType::Waypoint,
            other => return Err(id_error(&format!("unknown proxy type {}", Quoted(other)))),
        };
        let ip: IpAddr = ip
            .parse()
            .map_err(|_| id_error(&format!("{} is not an IP address", Quoted(ip))))?;
        if workload.is_empty() {
            return Err(id_error("empty workload part"));
        }
        let meta = Metadata(node.metadata.as_ref());
        let namespace = match meta.string("NAMESPACE") {
            Some(ns) => ns,
            None => domain
                .split('.')
                .next()
                .filter(|ns| !ns.is_empty())
                .ok_or_else(|| {
                    id_error("no namespace: empty domain part and no NAMESPACE metadata")
                })?
                .to_string(),
        };
        let mut ips = vec![ip];
        if let Some(list) = meta.string("INSTANCE_IPS") {
            for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                let extra: IpAddr = item.parse().map_err(|_| NodeError::Metadata {
                    key: "INSTANCE_IPS",
                    problem: format!("{} is not an IP address", Quoted(item)),
                })?;
                if !ips.contains(&extra) {
                    ips.push(extra);
                }
            }
        }
        let generator = match meta.string("GENERATOR").as_deref() {
            Some("grpc") => Generator::Grpc,
            Some("event") => Generator::Event,
            _ => Generator::Envoy,
        };
        let locality = node
            .locality
            .as_ref()
            .map(|l| Locality {
                region: l.region.as_str().into(),
                zone: l.zone.as_str().into(),
                subzone: l.sub_zone.as_str().into(),
            })
            .unwrap_or_default();
        Ok(Self {
            id: node.id.clone(),
            kind,
            ips,
            workload: workload.to_string(),
            namespace: namespace.into(),
            cluster_id: meta.string("CLUSTER_ID").map(|c| ClusterId::new(&c)),
            network: meta.string("NETWORK").unwrap_or_default().into(),
            labels: meta.labels()?,
            istio_version: meta.string("ISTIO_VERSION").unwrap_or_default(),
            service_account: meta.string("SERVICE_ACCOUNT"),
            generator,
            requested_network_view: meta
                .string("REQUESTED_NETWORK_VIEW")
                .map(|v| {
                    v.split(',')
                        .map(|s| s.trim().to_string())
                        .filter(|s| !s.is_empty())
                        .collect()
                })
                .unwrap_or_default(),
            locality,
            auto_register_group: meta.string("AUTO_REGISTER_GROUP").filter(|g| !g.is_empty()),
            verified_account: None,
            dns_capture: meta.flag("DNS_CAPTURE"),
            mesh_id: meta.string("MESH_ID").unwrap_or_default(),
            service_cluster: node.cluster.clone(),
            metadata: meta.strings(),
        })
    }
}

impl Proxy {
    /// Whether the stream proved who the proxy is.
    pub fn verified(&self) -> bool {
        self.verified_account.is_some()
    }
}

struct Metadata<'a>(Option<&'a Struct>);

impl Metadata<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.0?.fields.get(key)
    }

    fn strings(&self) -> BTreeMap<String, String> {
        let fields = self.0.iter().flat_map(|m| &m.fields);
        fields
            .filter_map(|(k, v)| match &v.kind {
                Some(Kind::StringValue(s)) => Some((k.clone(), s.clone())),
                _ => None,
            })
            .collect()
    }

    fn string(&self, key: &str) -> Option<String> {
        match &self.get(key)?.kind {
            Some(Kind::StringValue(s)) if !s.is_empty() => Some(s.clone()),
            _ => None,
        }
    }

    /// A boolean as Istio's agent writes it: a string Go's `strconv.ParseBool` reads as true, or a
    /// JSON boolean; anything else is false.
    fn flag(&self, key: &str) -> bool {
        match self.get(key).and_then(|v| v.kind.as_ref()) {
            Some(Kind::BoolValue(b)) => *b,
            Some(Kind::StringValue(s)) => {
                matches!(s.as_str(), "1" | "t" | "T" | "true" | "TRUE" | "True")
            }
            _ => false,
        }
    }

    fn labels(&self) -> Result<BTreeMap<String, String>, NodeError> {
        let Some(value) = self.get("LABELS") else {
            return Ok(BTreeMap::new());
        };
        let Some(Kind::StructValue(labels)) = &value.kind else {
            return Err(NodeError::Metadata {
                key: "LABELS",
                problem: "not a map of strings".into(),
            });
        };
        labels
            .fields
            .iter()
            .map(|(k, v)| match &v.kind {
                Some(Kind::StringValue(s)) => Ok((k.clone(), s.clone())),
                _ => Err(NodeError::Metadata {
                    key: "LABELS",
                    problem: format!("label {} is not a string", Quoted(k)),
                }),
            })
            .collect()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub fn node(id: &str, meta: &[(&str, &str)]) -> Node {
        let fields = meta
            .iter()
            .map(|(k, v)| {
                let value = Value {
                    kind: Some(Kind::StringValue(v.to_string())),
                };
                (k.to_string(), value)
            })
            .collect();
        Node {
            id: id.into(),
            metadata: Some(Struct { fields }),
            ..Default::default()
        }
    }

    #[test]
    fn parses_istio_node() {
        let n = node(
            "sidecar~10.1.1.11~reviews-v1.bookinfo~bookinfo.svc.cluster.local",
            &[
                ("CLUSTER_ID", "c1"),
                ("NETWORK", "net1"),
                ("INSTANCE_IPS", "10.1.1.11,fd00::1"),
            ],
        );
        let p = Proxy::from_node(Some(&n)).unwrap();
        assert_eq!(p.kind, ProxyType::Sidecar);
        assert_eq!(&*p.namespace, "bookinfo");
        assert_eq!(p.ips.len(), 2);
        assert_eq!(p.cluster_id.unwrap().as_str(), "c1");
        assert_eq!(&*p.network, "net1");
        assert_eq!(p.generator, Generator::Envoy);
    }

    #[test]
    fn namespace_metadata_wins_and_grpc_generator() {
        let n = node(
            "router~10.0.0.1~gw.x~x.svc.cluster.local",
            &[("NAMESPACE", "y"), ("GENERATOR", "grpc")],
        );
        let p = Proxy::from_node(Some(&n)).unwrap();
        assert_eq!(
            (p.kind, &*p.namespace, p.generator),
            (ProxyType::Router, "y", Generator::Grpc)
        );
    }

    #[test]
    fn bad_ids_name_the_problem() {
        let cases = [
            ("sidecar~10.0.0.1~pod.ns", "3 parts"),
            (
                "ingress~10.0.0.1~pod.ns~ns.svc.cluster.local",
                "unknown proxy type",
            ),
            ("sidecar~not-an-ip~pod.ns~ns.svc.cluster.local", "not an IP"),
            ("sidecar~10.0.0.1~~ns.svc", "empty workload"),
        ];
        for (id, expected) in cases {
            let err = Proxy::from_node(Some(&node(id, &[])))
                .unwrap_err()
                .to_string();
            assert!(err.contains(expected), "{id}: {err}");
        }
        assert_eq!(Proxy::from_node(None).unwrap_err(), NodeError::Missing);
        let bad_ips = node(
            "sidecar~10.0.0.1~p.ns~ns.svc",
            &[("INSTANCE_IPS", "10.0.0.1,nope")],
        );
        assert!(Proxy::from_node(Some(&bad_ips))
            .unwrap_err()
            .to_string()
            .contains("INSTANCE_IPS"));
    }
}
