//! The service table and endpoint shards: istiod's `/debug/registryz` and `/debug/endpointz`
//! shapes (Go field names where istiod marshals its structs as they are), meshpilot's
//! `/debug/endpointShardz`, and `/debug/push_status`.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::{json, Value};

use super::DebugContext;
use crate::model::{Endpoint, Health, Provider, Resolution, ServiceKey};

/// `/debug/registryz`: every service as istiod's `model.Service` marshals.
pub(super) fn registryz(ctx: &DebugContext) -> Vec<Value> {
    let snapshot = ctx.aggregate.mesh().snapshot();
    snapshot
        .services
        .all()
        .iter()
        .map(|service| {
            let key = service.key();
            let registry = match snapshot
                .endpoints
                .get(&key)
                .and_then(|e| e.shards.keys().next().map(|k| k.provider))
            {
                Some(Provider::External) => "External",
                _ => "Kubernetes",
            };
            let vips: BTreeMap<String, Vec<String>> = service
                .cluster_vips
                .iter()
                .map(|(cluster, ips)| {
                    (
                        cluster.to_string(),
                        ips.iter().map(|ip| ip.to_string()).collect(),
                    )
                })
                .collect();
            let default_address = vips
                .values()
                .flatten()
                .next()
                .cloned()
                .unwrap_or_else(|| "0.0.0.0".to_string());
            json!({
                "Attributes": {
                    "ServiceRegistry": registry,
                    "Name": service.name,
                    "Namespace": service.namespace,
                    "Labels": service.labels,
                    "ExportTo": export_to(&service.export_to),
                },
                "ports": service.ports.iter().map(|p| json!({
                    "name": p.name,
                    "port": p.port,
                    "protocol": protocol_name(p.protocol),
                })).collect::<Vec<_>>(),
                "hostname": service.hostname,
                "clusterVIPs": { "Addresses": vips },
                "defaultAddress": default_address,
                "Resolution": resolution_code(service.resolution),
                "MeshExternal": service.mesh_external,
            })
        })
        .collect()
}

/// istiod prints a set of namespaces as a map to true; null when the mesh default applies.
fn export_to(export_to: &[String]) -> Value {
    match export_to {
        [] => Value::Null,
        names => names
            .iter()
            .map(|n| (n.clone(), Value::Bool(true)))
            .collect(),
    }
}

fn protocol_name(protocol: crate::model::Protocol) -> Value {
    use crate::model::Protocol;
    match protocol {
        Protocol::Mongo => "Mongo".into(),
        Protocol::Redis => "Redis".into(),
        Protocol::Mysql => "MySQL".into(),
        Protocol::Unsupported => "UnsupportedProtocol".into(),
        other => serde_json::to_value(other).unwrap_or_default(),
    }
}

/// istiod's `Resolution` enum values.
fn resolution_code(resolution: Resolution) -> u8 {
    match resolution {
        Resolution::ClientSideLb => 0,
        Resolution::Dns { round_robin: false } => 1,
        Resolution::Passthrough => 2,
        Resolution::Dns { round_robin: true } => 3,
    }
}

/// `/debug/endpointz` (istiod's `endpointShardz` shape): hostname → namespace →
/// `{Shards: {"<provider>/<cluster>": [IstioEndpoint]}, ServiceAccounts: {identity: {}}}`.
pub(super) fn endpointz(ctx: &DebugContext) -> BTreeMap<String, BTreeMap<String, Value>> {
    let mut view: BTreeMap<String, BTreeMap<String, Value>> = BTreeMap::new();
    for (key, shards) in ctx.aggregate.mesh().snapshot().endpoints.sorted() {
        let by_shard: BTreeMap<String, Vec<Value>> = shards
            .shards
            .iter()
            .map(|(shard, endpoints)| {
                (
                    shard.to_string(),
                    endpoints.iter().map(|e| istio_endpoint(&key, e)).collect(),
                )
            })
            .collect();
        let accounts: BTreeMap<&str, Value> = shards
            .service_accounts
            .iter()
            .map(|sa| (&**sa, json!({})))
            .collect();
        view.entry(key.hostname.to_string()).or_default().insert(
            key.namespace.to_string(),
            json!({ "Shards": by_shard, "ServiceAccounts": accounts }),
        );
    }
    view
}

/// One endpoint as istiod's `IstioEndpoint` marshals.
fn istio_endpoint(key: &ServiceKey, e: &Endpoint) -> Value {
    let l = &e.locality;
    let locality = [&l.region, &l.zone, &l.subzone]
        .iter()
        .map(|part| &***part)
        .collect::<Vec<&str>>()
        .join("/");
    json!({
        "Labels": e.labels,
        "Address": e.address.to_string(),
        "ServicePortName": e.service_port_name,
        "ServiceAccount": e.service_account,
        "Network": e.network,
        "Locality": { "Label": locality.trim_end_matches('/'), "ClusterID": e.cluster_id },
        "EndpointPort": e.port,
        "LbWeight": e.weight,
        "TLSMode": e.tls_mode,
        "Namespace": key.namespace,
        "WorkloadName": e.workload,
        // A slice names an endpoint only under the service it belongs to: that is its subdomain.
        "HostName": e.hostname.as_deref().unwrap_or_default(),
        "SubDomain": match e.hostname {
            Some(_) => key.hostname.split('.').next().unwrap_or_default(),
            None => "",
        },
        "HealthStatus": match e.health {
            Health::Healthy => 1,
            Health::Unhealthy => 2,
            Health::Draining | Health::Terminating => 3,
        },
    })
}

/// hostname → namespace → cluster id → endpoints (meshpilot's own fields).
type ShardView = BTreeMap<String, BTreeMap<String, BTreeMap<String, Vec<Endpoint>>>>;

/// `/debug/endpointShardz`: meshpilot's view of the same shards, keyed by cluster.
pub(super) fn endpoint_shardz(ctx: &DebugContext) -> ShardView {
    let mut view = ShardView::new();
    for (key, shards) in ctx.aggregate.mesh().snapshot().endpoints.sorted() {
        let by_cluster = view
            .entry(key.hostname.to_string())
            .or_default()
            .entry(key.namespace.to_string())
            .or_default();
        for (shard, endpoints) in &shards.shards {
            by_cluster
                .entry(shard.cluster.to_string())
                .or_default()
                .extend(endpoints.iter().cloned());
        }
    }
    view
}

#[derive(Serialize)]
struct PushIssue {
    #[serde(skip_serializing_if = "Option::is_none")]
    proxy: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    message: Option<String>,
}

/// `/debug/push_status`: istiod's map of problem → key → detail, computed from the current
/// snapshot. `pilot_eds_no_instances`: load-balanced clusters with no endpoint anywhere.
pub(super) fn push_status(
    ctx: &DebugContext,
) -> BTreeMap<&'static str, BTreeMap<String, impl Serialize>> {
    let snapshot = ctx.aggregate.mesh().snapshot();
    let mut no_instances = BTreeMap::new();
    for service in snapshot.services.all().iter() {
        if service.resolution != Resolution::ClientSideLb {
            continue;
        }
        let endpoints = snapshot.endpoints.get(&service.key());
        for port in &service.ports {
            let served = endpoints.is_some_and(|shards| {
                shards
                    .shards
                    .values()
                    .flat_map(|eps| eps.iter())
                    .any(|e| *e.service_port_name == *port.name)
            });
            if !served {
                let cluster = format!("outbound|{}||{}", port.port, service.hostname);
                no_instances.insert(
                    cluster,
                    PushIssue {
                        proxy: None,
                        message: None,
                    },
                );
            }
        }
    }
    let mut out = BTreeMap::new();
    if !no_instances.is_empty() {
        out.insert("pilot_eds_no_instances", no_instances);
    }
    out
}
