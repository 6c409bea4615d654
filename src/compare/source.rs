//! Where a side of a comparison comes from: a dump directory as the fidelity corpus lays it out
//! (`cds.json`, `eds.json`, `lds.json`, `rds.json`: lists of DiscoveryResponses as protobuf JSON,
//! `node.json`: the node), or a live server asked over ADS as that node would ask — every
//! cluster and listener, then the endpoints and routes they name.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use envoy_types::pb::google::protobuf::Any;
use serde_json::{json, Value};
use thiserror::Error;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::json;
use crate::envoy_api;
use crate::text::clip;

/// The resource types compared, in order, with each resource's name field and type URL.
pub const TYPES: [&str; 4] = ["cds", "eds", "lds", "rds"];
const NAME_FIELD: [&str; 4] = ["name", "cluster_name", "name", "name"];
const TYPE_URLS: [&str; 4] = [
    "type.googleapis.com/envoy.config.cluster.v3.Cluster",
    "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
    "type.googleapis.com/envoy.config.listener.v3.Listener",
    "type.googleapis.com/envoy.config.route.v3.RouteConfiguration",
];
/// How long a live server may take for each answer.
const ANSWER_DEADLINE: Duration = Duration::from_secs(10);

/// What one proxy was sent: per type (in `TYPES` order), resources by name as JSON.
pub type State = [BTreeMap<String, Value>; 4];

#[derive(Debug, Error)]
pub enum SourceError {
    #[error("{path}: {message}")]
    Dump { path: String, message: String },
    #[error("{address}: {message}")]
    Live { address: String, message: String },
    #[error("the node: {0}")]
    Node(String),
}

/// A dump directory: the last CDS and LDS response, EDS and RDS resources merged by name (as the
/// proxy holds them).
pub fn read_dump(dir: &Path) -> Result<State, SourceError> {
    let mut state = State::default();
    for (i, ty) in TYPES.iter().enumerate() {
        let path = dir.join(format!("{ty}.json"));
        let failed = |message: String| SourceError::Dump {
            path: path.display().to_string(),
            message: clip(&message).to_string(),
        };
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(failed(e.to_string())),
        };
        let responses: Vec<Value> =
            serde_json::from_str(&text).map_err(|e| failed(e.to_string()))?;
        let responses = match i {
            0 | 2 => responses.last().into_iter().collect::<Vec<_>>(),
            _ => responses.iter().collect(),
        };
        for response in responses {
            for resource in response["resources"].as_array().into_iter().flatten() {
                let name = resource[NAME_FIELD[i]]
                    .as_str()
                    .ok_or_else(|| failed(format!("a resource without {}", NAME_FIELD[i])))?;
                state[i].insert(name.to_string(), resource.clone());
            }
        }
    }
    Ok(state)
}

/// Writes `state` as a dump directory `read_dump` reads back (one response per type).
pub fn write_dump(dir: &Path, state: &State, node: &Node) -> Result<(), SourceError> {
    let failed = |e: std::io::Error| SourceError::Dump {
        path: dir.display().to_string(),
        message: e.to_string(),
    };
    std::fs::create_dir_all(dir).map_err(failed)?;
    for (i, ty) in TYPES.iter().enumerate() {
        let resources: Vec<&Value> = state[i].values().collect();
        let responses = json!([{"type_url": TYPE_URLS[i], "resources": resources}]);
        let text = serde_json::to_string_pretty(&responses).unwrap_or_default();
        std::fs::write(dir.join(format!("{ty}.json")), text).map_err(failed)?;
    }
    let node = envoy_api::to_dynamic(node).map_err(|e| SourceError::Node(e.to_string()))?;
    let text = serde_json::to_string_pretty(&json::message(&node)).unwrap_or_default();
    std::fs::write(dir.join("node.json"), text).map_err(failed)
}

/// The node a dump was taken for (`node.json`), if it has one.
pub fn read_node(path: &Path) -> Result<Node, SourceError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| SourceError::Node(format!("{}: {e}", path.display())))?;
    let value: Value = serde_json::from_str(&text)
        .map_err(|e| SourceError::Node(format!("{}: {e}", path.display())))?;
    let message = envoy_api::from_json("envoy.config.core.v3.Node", &value)
        .map_err(|e| SourceError::Node(format!("{}: {e}", path.display())))?;
    envoy_api::to_typed(&message).map_err(|e| SourceError::Node(e.to_string()))
}

/// What a live server sends `node`: CDS and LDS (wildcard), then the EDS and RDS they name.
pub async fn fetch_live(address: &str, node: &Node) -> Result<State, SourceError> {
    let failed = |message: String| SourceError::Live {
        address: address.to_string(),
        message: clip(&message).to_string(),
    };
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{address}"))
        .map_err(|e| failed(e.to_string()))?
        .connect_timeout(ANSWER_DEADLINE);
    let channel = tokio::time::timeout(ANSWER_DEADLINE, endpoint.connect())
        .await
        .map_err(|_| failed("no connection".to_string()))?
        .map_err(|e| failed(e.to_string()))?;
    let (requests, outgoing) = mpsc::channel(4);
    let mut client = AggregatedDiscoveryServiceClient::new(channel);
    let call = client.stream_aggregated_resources(ReceiverStream::new(outgoing));
    let mut responses = tokio::time::timeout(ANSWER_DEADLINE, call)
        .await
        .map_err(|_| failed("no stream".to_string()))?
        .map_err(|e| failed(e.to_string()))?
        .into_inner();
    let mut state = State::default();
    for i in [0, 2, 1, 3] {
        let names: Vec<String> = match i {
            1 => eds_names(&state[0]),
            3 => route_names(&state[2]),
            _ => Vec::new(),
        };
        if i % 2 == 1 && names.is_empty() {
            continue;
        }
        let request = DiscoveryRequest {
            node: Some(node.clone()),
            type_url: TYPE_URLS[i].to_string(),
            resource_names: names,
            ..Default::default()
        };
        requests
            .send(request)
            .await
            .map_err(|_| failed("the stream closed".to_string()))?;
        let response: DiscoveryResponse = loop {
            let next = tokio::time::timeout(ANSWER_DEADLINE, responses.message())
                .await
                .map_err(|_| failed(format!("no {} answer", TYPES[i])))?
                .map_err(|e| failed(e.to_string()))?
                .ok_or_else(|| failed("the stream ended".to_string()))?;
            if next.type_url == TYPE_URLS[i] {
                break next;
            }
        };
        for any in &response.resources {
            let (name, value) = named_json(any, i).map_err(|e| failed(e.to_string()))?;
            state[i].insert(name, value);
        }
    }
    Ok(state)
}

/// A resource of type `TYPES[type_index]` as a dump writes it (its type beside its fields), and
/// its name.
pub(super) fn named_json(
    any: &Any,
    type_index: usize,
) -> Result<(String, Value), envoy_api::ApiError> {
    let message = envoy_api::unpack(&any.type_url, &any.value)?;
    let mut value = json::message(&message);
    if let Some(fields) = value.as_object_mut() {
        fields.insert("@type".to_string(), json!(any.type_url));
    }
    let name = value[NAME_FIELD[type_index]]
        .as_str()
        .unwrap_or_default()
        .to_string();
    Ok((name, value))
}

/// The EDS names of the clusters that take endpoints over EDS.
fn eds_names(clusters: &BTreeMap<String, Value>) -> Vec<String> {
    clusters
        .iter()
        .filter(|(_, c)| c["type"] == "EDS")
        .map(|(name, c)| {
            c.pointer("/eds_cluster_config/service_name")
                .and_then(Value::as_str)
                .unwrap_or(name)
                .to_string()
        })
        .collect()
}

/// Every route configuration the listeners name over RDS.
fn route_names(listeners: &BTreeMap<String, Value>) -> Vec<String> {
    fn collect(v: &Value, out: &mut BTreeSet<String>) {
        match v {
            Value::Object(map) => {
                if let Some(Value::String(name)) = map.get("route_config_name") {
                    out.insert(name.clone());
                }
                map.values().for_each(|v| collect(v, out));
            }
            Value::Array(items) => items.iter().for_each(|v| collect(v, out)),
            _ => {}
        }
    }
    let mut out = BTreeSet::new();
    listeners.values().for_each(|l| collect(l, &mut out));
    out.into_iter().collect()
}
