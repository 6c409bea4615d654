//! `meshpilot compare --istiod <address> --namespace <ns> <meshpilot>`: before a namespace moves,
//! what the running istiod sends each of its connected proxies there against what meshpilot sends
//! the same nodes. istiod is asked as istioctl asks it (istio/istio istioctl/pkg/multixds): over
//! its secure port, with a token for meshpilot's own system-namespace service account (audience
//! `istio-ca`), `istio.io/debug/syncz` for the connected proxies, then `istio.io/debug/config_dump`
//! per proxy (clusters, listeners, routes; istiod leaves endpoints out). Unlike istioctl, istiod's
//! certificate is verified (against the mesh root). meshpilot is asked over ADS as each node,
//! described as its agent would: the pod's labels and service account from the cluster.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use envoy_types::pb::envoy::admin::v3::{
    ClustersConfigDump, ListenersConfigDump, RoutesConfigDump,
};
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use envoy_types::pb::envoy::service::status::v3::ClientConfig;
use envoy_types::pb::google::protobuf::{value::Kind, Any, Struct, Value};
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{ConfigMap, Pod, ServiceAccount};
use kube::api::PostParams;
use kube::{Api, Client};
use prost::{Message, Name};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::source::{self, State};
use super::{diff, Accepted, CompareError, Report};
use crate::text::clip;

const SYNCZ: &str = "istio.io/debug/syncz";
const CONFIG_DUMP: &str = "istio.io/debug/config_dump";
/// How long istiod and the API server may take for each answer.
const DEADLINE: Duration = Duration::from_secs(10);

/// Where istiod is and how to prove ourselves to it.
pub struct IstiodSide {
    pub address: String,
    pub namespace: String,
    pub system_namespace: String,
    pub service_account: String,
    pub kubeconfig: Option<PathBuf>,
    /// The PEM istiod's certificate is checked against; else the mesh root ConfigMap.
    pub root: Option<PathBuf>,
    /// The name istiod's certificate must carry; else `istiod.<system namespace>.svc`.
    pub server_name: Option<String>,
}

fn failed(what: impl std::fmt::Display) -> CompareError {
    CompareError::Istiod(clip(&what.to_string()).to_string())
}

/// Every connected proxy of the namespace: istiod's answer against meshpilot's.
pub async fn compare_namespace(
    side: &IstiodSide,
    meshpilot: &str,
    accepted: &Accepted,
) -> Result<Report, CompareError> {
    let client = kube_client(side).await?;
    let token = token(&client, side).await?;
    let root = match &side.root {
        Some(path) => {
            std::fs::read_to_string(path).map_err(|e| failed(format!("{}: {e}", path.display())))?
        }
        None => mesh_root(&client, &side.system_namespace).await?,
    };
    let mut istiod = DebugClient::connect(side, &root, &token).await?;
    let proxies: Vec<ClientConfig> = istiod
        .ask(SYNCZ, Vec::new())
        .await?
        .iter()
        .filter_map(|any| ClientConfig::decode(any.value.as_slice()).ok())
        .filter(|c| {
            c.node
                .as_ref()
                .is_some_and(|n| namespace_of(n) == side.namespace)
        })
        .collect();
    let mut report = Report {
        differences: Vec::new(),
        accepted: 0,
        proxies: Vec::new(),
        nothing_compared: None,
    };
    for config in proxies {
        let Some(node) = config.node else { continue };
        let sent = istiod.ask(CONFIG_DUMP, vec![node.id.clone()]).await?;
        let left = state_of(&sent)?;
        let node = describe(&client, node).await;
        let mut right = source::fetch_live(meshpilot, &node).await?;
        // istiod's dump holds no endpoints: compared are clusters, listeners and routes.
        right[1].clear();
        let router = super::is_router(&node);
        let (kept, differences): (Vec<_>, Vec<_>) = diff::compare(&left, &right, router)
            .into_iter()
            .partition(|d| accepted.covers(d));
        report.accepted += kept.len();
        report
            .differences
            .extend(differences.into_iter().map(|mut d| {
                d.proxy = Some(node.id.clone());
                d
            }));
        report.proxies.push(node.id);
    }
    if report.proxies.is_empty() {
        report.nothing_compared = Some(format!(
            "no proxy of namespace {} is connected to istiod at {}",
            side.namespace, side.address
        ));
    }
    Ok(report)
}

async fn kube_client(side: &IstiodSide) -> Result<Client, CompareError> {
    let config = match &side.kubeconfig {
        Some(path) => {
            let at = |e: &dyn std::fmt::Display| failed(format!("{}: {e}", path.display()));
            let kubeconfig = kube::config::Kubeconfig::read_from(path).map_err(|e| at(&e))?;
            (kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await)
                .map_err(|e| at(&e))?
        }
        None => (kube::Config::infer().await).map_err(|e| {
            failed(format!(
                "no cluster to ask for a token (give --kubeconfig): {e}"
            ))
        })?,
    };
    // The project's client: its deadlines on every call, HTTP/2 where offered.
    crate::kube_client::build(config).map_err(|e| failed(format!("the cluster's client: {e}")))
}

/// A token for our service account that istiod reviews (audience `istio-ca`), as istioctl's.
async fn token(client: &Client, side: &IstiodSide) -> Result<String, CompareError> {
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), &side.system_namespace);
    let params = PostParams::default();
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            audiences: Some(vec!["istio-ca".into()]),
            expiration_seconds: Some(600),
            ..Default::default()
        }),
        ..Default::default()
    };
    let call = accounts.create_token_request(&side.service_account, &params, &request);
    let what = format!(
        "a token for service account {}/{}",
        side.system_namespace, side.service_account
    );
    let answer = tokio::time::timeout(DEADLINE, call)
        .await
        .map_err(|_| failed(format!("{what}: no answer within {DEADLINE:?}")))?
        .map_err(|e| failed(format!("{what}: {}", crate::kube_error::Readable(&e))))?;
    answer
        .status
        .and_then(|s| s.token)
        .filter(|t| !t.is_empty())
        .ok_or_else(|| failed(format!("{what}: the API server returned none")))
}

/// The mesh root, as every namespace's `istio-ca-root-cert` holds it.
async fn mesh_root(client: &Client, namespace: &str) -> Result<String, CompareError> {
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let what = format!("ConfigMap {namespace}/istio-ca-root-cert");
    let map = tokio::time::timeout(DEADLINE, maps.get_opt("istio-ca-root-cert"))
        .await
        .map_err(|_| failed(format!("{what}: no answer within {DEADLINE:?}")))?
        .map_err(|e| failed(format!("{what}: {}", crate::kube_error::Readable(&e))))?;
    map.and_then(|m| m.data?.remove("root-cert.pem"))
        .ok_or_else(|| failed(format!("{what}: no root-cert.pem (give --istiod-root)")))
}

/// A proxy's namespace: its node's `NAMESPACE`, else the id's `<pod>.<namespace>`.
fn namespace_of(node: &Node) -> String {
    let field = metadata_string(node, "NAMESPACE");
    field.unwrap_or_else(|| {
        let workload = node.id.split('~').nth(2).unwrap_or_default();
        workload
            .rsplit_once('.')
            .map(|(_, ns)| ns.to_string())
            .unwrap_or_default()
    })
}

fn metadata_string(node: &Node, key: &str) -> Option<String> {
    match &node.metadata.as_ref()?.fields.get(key)?.kind {
        Some(Kind::StringValue(s)) if !s.is_empty() => Some(s.clone()),
        _ => None,
    }
}

fn string(s: impl Into<String>) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.into())),
    }
}

/// The node as its agent describes it: istiod's syncz names only its id, cluster, namespace and
/// version; the pod adds labels, service account and addresses.
async fn describe(client: &Client, mut node: Node) -> Node {
    let mut fields = node.metadata.take().unwrap_or_default().fields;
    let mut parts = node.id.split('~');
    let (_, ip, workload) = (parts.next(), parts.next(), parts.next());
    if let Some(ip) = ip {
        fields.insert("INSTANCE_IPS".into(), string(ip));
    }
    let pod_name = workload
        .and_then(|w| w.rsplit_once('.'))
        .map(|(pod, ns)| (pod.to_string(), ns.to_string()));
    if let Some((pod, namespace)) = pod_name {
        let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
        if let Ok(Ok(Some(pod))) = tokio::time::timeout(DEADLINE, pods.get_opt(&pod)).await {
            let labels: BTreeMap<String, Value> = (pod.metadata.labels.unwrap_or_default())
                .into_iter()
                .map(|(k, v)| (k, string(v)))
                .collect();
            fields.insert(
                "LABELS".into(),
                Value {
                    kind: Some(Kind::StructValue(Struct {
                        fields: labels.into_iter().collect(),
                    })),
                },
            );
            if let Some(account) = pod.spec.and_then(|s| s.service_account_name) {
                fields.insert("SERVICE_ACCOUNT".into(), string(account));
            }
            fields.insert("NAME".into(), string(pod.metadata.name.unwrap_or_default()));
        }
        fields
            .entry("NAMESPACE".into())
            .or_insert_with(|| string(namespace));
    }
    node.metadata = Some(Struct { fields });
    node
}

/// istiod's config dump sections as a compared state.
fn state_of(sections: &[Any]) -> Result<State, CompareError> {
    let mut state = State::default();
    let mut add = |i: usize, any: Option<&Any>| -> Result<(), CompareError> {
        if let Some(any) = any {
            let (name, value) = source::named_json(any, i).map_err(failed)?;
            state[i].insert(name, value);
        }
        Ok(())
    };
    for section in sections {
        let bytes = section.value.as_slice();
        match section.type_url.as_str() {
            url if url == ClustersConfigDump::type_url() => {
                let dump = ClustersConfigDump::decode(bytes).map_err(failed)?;
                for c in dump
                    .dynamic_active_clusters
                    .iter()
                    .chain(&dump.dynamic_warming_clusters)
                {
                    add(0, c.cluster.as_ref())?;
                }
            }
            url if url == ListenersConfigDump::type_url() => {
                let dump = ListenersConfigDump::decode(bytes).map_err(failed)?;
                for l in &dump.dynamic_listeners {
                    add(2, l.active_state.as_ref().and_then(|s| s.listener.as_ref()))?;
                }
            }
            url if url == RoutesConfigDump::type_url() => {
                let dump = RoutesConfigDump::decode(bytes).map_err(failed)?;
                for r in &dump.dynamic_route_configs {
                    add(3, r.route_config.as_ref())?;
                }
            }
            _ => {}
        }
    }
    Ok(state)
}

/// An ADS stream to istiod's secure port, asking debug types.
struct DebugClient {
    requests: mpsc::Sender<DiscoveryRequest>,
    responses: tonic::Streaming<DiscoveryResponse>,
    node: Option<Node>,
    address: String,
}

impl DebugClient {
    async fn connect(side: &IstiodSide, root: &str, token: &str) -> Result<Self, CompareError> {
        use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};
        let address = &side.address;
        let at = |e: &dyn std::fmt::Display| failed(format!("{address}: {e}"));
        let name = (side.server_name.clone())
            .unwrap_or_else(|| format!("istiod.{}.svc", side.system_namespace));
        let tls = ClientTlsConfig::new()
            .domain_name(name)
            .ca_certificate(Certificate::from_pem(root));
        let endpoint = Endpoint::from_shared(format!("https://{address}"))
            .map_err(|e| at(&e))?
            .connect_timeout(DEADLINE)
            .tls_config(tls)
            .map_err(|e| at(&e))?;
        let channel = tokio::time::timeout(DEADLINE, endpoint.connect())
            .await
            .map_err(|_| at(&"no connection"))?
            .map_err(|e| at(&format!("{e:?}")))?;
        let bearer: tonic::metadata::MetadataValue<_> = format!("Bearer {token}")
            .parse()
            .map_err(|_| failed("the token is not a header value"))?;
        let mut client = AggregatedDiscoveryServiceClient::with_interceptor(
            channel,
            move |mut request: tonic::Request<()>| {
                request
                    .metadata_mut()
                    .insert("authorization", bearer.clone());
                Ok(request)
            },
        );
        let (requests, outgoing) = mpsc::channel(4);
        let call = client.stream_aggregated_resources(ReceiverStream::new(outgoing));
        let responses = tokio::time::timeout(DEADLINE, call)
            .await
            .map_err(|_| at(&"no stream"))?
            .map_err(|e| at(&e.message()))?
            .into_inner();
        // Who we are, as istioctl's debug client introduces itself (pkg/adsc).
        let metadata = [
            ("GENERATOR", "event".to_string()),
            ("NAMESPACE", side.system_namespace.clone()),
            ("SERVICE_ACCOUNT", side.service_account.clone()),
        ];
        let node = Node {
            id: format!(
                "sidecar~127.0.0.1~meshpilot-compare.{0}~{0}.svc.cluster.local",
                side.system_namespace
            ),
            metadata: Some(Struct {
                fields: metadata
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), string(v)))
                    .collect(),
            }),
            ..Default::default()
        };
        Ok(Self {
            requests,
            responses,
            node: Some(node),
            address: address.clone(),
        })
    }

    /// One debug request and its answer's resources.
    async fn ask(&mut self, type_url: &str, names: Vec<String>) -> Result<Vec<Any>, CompareError> {
        let at = |e: String| failed(format!("{}: {type_url}: {e}", self.address));
        let request = DiscoveryRequest {
            node: self.node.take(),
            type_url: type_url.to_string(),
            resource_names: names,
            ..Default::default()
        };
        self.requests
            .send(request)
            .await
            .map_err(|_| at("the stream closed".into()))?;
        loop {
            let next = tokio::time::timeout(DEADLINE, self.responses.message())
                .await
                .map_err(|_| at(format!("no answer within {DEADLINE:?}")))?
                .map_err(|e| at(e.message().to_string()))?
                .ok_or_else(|| at("the stream ended".into()))?;
            if next.type_url == type_url {
                return Ok(next.resources);
            }
        }
    }
}
