//! The admin HTTP server: readiness, metrics and debug views.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::Serialize;

use crate::aggregate::Aggregate;
use crate::metrics::Metrics;
use crate::model::{Endpoint, Provider};
use crate::registry::ClusterStatus;
use crate::xds::server::{Readiness, SyncView, XdsServer};

pub struct AdminState {
    pub ready: Readiness,
    /// Why the mesh networks file is currently refused, if it is.
    pub networks_error: Arc<parking_lot::Mutex<Option<String>>>,
    /// Why the mesh config is currently refused, if it is.
    pub mesh_config_error: Arc<parking_lot::Mutex<Option<String>>>,
    pub aggregate: Arc<Aggregate>,
    pub metrics: Arc<Metrics>,
    pub xds: Arc<XdsServer>,
}

pub fn router(state: Arc<AdminState>) -> Router {
    Router::new()
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .route("/debug/clusterz", get(clusterz))
        .route("/debug/endpointShardz", get(endpoint_shardz))
        .route("/debug/syncz", get(syncz))
        .route("/debug/networkz", get(networkz))
        .route("/debug/configz", get(configz))
        .route("/debug/mesh", get(mesh_config))
        .route("/debug/pushz", get(pushz))
        .route("/debug/jwksz", get(jwksz))
        .with_state(state)
}

async fn ready(State(state): State<Arc<AdminState>>) -> Response {
    let waiting: Vec<String> = state
        .aggregate
        .clusters()
        .iter()
        .filter(|c| c.status().state == crate::registry::SyncState::Syncing)
        .map(|c| c.id().to_string())
        .collect();
    if (state.ready)() {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        let body = match waiting.is_empty() {
            true => "not ready: remote-cluster secrets not processed yet\n".to_string(),
            false => format!("not ready: waiting for clusters {}\n", waiting.join(", ")),
        };
        (StatusCode::SERVICE_UNAVAILABLE, body).into_response()
    }
}

async fn metrics(State(state): State<Arc<AdminState>>) -> Response {
    let body = state.metrics.render(&state.aggregate);
    let content_type = "application/openmetrics-text; version=1.0.0; charset=utf-8";
    ([(header::CONTENT_TYPE, content_type)], body).into_response()
}

#[derive(Serialize)]
struct ClusterView {
    id: String,
    provider: Provider,
    source: String,
    services: usize,
    endpoints: usize,
    #[serde(flatten)]
    status: ClusterStatus,
}

async fn clusterz(State(state): State<Arc<AdminState>>) -> Json<Vec<ClusterView>> {
    let views = state
        .aggregate
        .clusters()
        .iter()
        .map(|c| ClusterView {
            id: c.id().to_string(),
            provider: c.shard().provider,
            source: c.source().to_string(),
            services: c.service_count(),
            endpoints: c.endpoint_count(),
            status: c.status(),
        })
        .collect();
    Json(views)
}

/// hostname → namespace → cluster id → endpoints.
type ShardView = BTreeMap<String, BTreeMap<String, BTreeMap<String, Vec<Endpoint>>>>;

async fn endpoint_shardz(State(state): State<Arc<AdminState>>) -> Json<ShardView> {
    let mut view = ShardView::new();
    for (key, shards) in state.aggregate.mesh().snapshot().endpoints.sorted() {
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
    Json(view)
}

async fn syncz(State(state): State<Arc<AdminState>>) -> Json<Vec<SyncView>> {
    Json(state.xds.syncz())
}

/// MeshNetworks in force, the gateways of every network, and the file's current error.
async fn networkz(State(state): State<Arc<AdminState>>) -> Json<serde_json::Value> {
    let mesh = state.aggregate.mesh().snapshot();
    Json(serde_json::json!({
        "meshNetworks": *mesh.networks,
        "gateways": *mesh.gateways,
        "last_error": *state.networks_error.lock(),
    }))
}

/// Every Istio config object: the accepted ones as Kubernetes objects with where they came from, and
/// every refusal standing (a newer version of an object that failed validation shows beside the
/// last good one still served).
async fn configz(State(state): State<Arc<AdminState>>) -> Json<Vec<serde_json::Value>> {
    let snapshot = state.aggregate.mesh().snapshot();
    let config = &snapshot.config;
    let mut out: Vec<serde_json::Value> = config
        .accepted()
        .map(|object| {
            let key = &object.key;
            serde_json::json!({
                "kind": key.kind,
                "apiVersion": format!("{}/{}", key.kind.group(), key.kind.versions()[0]),
                "metadata": {
                    "name": key.name,
                    "namespace": key.namespace,
                    "labels": object.meta.labels,
                    "annotations": object.meta.annotations,
                    "creationTimestamp": object.meta.creation_timestamp,
                },
                "spec": object.spec,
                "source": object.meta.origin,
                "status": "accepted",
            })
        })
        .collect();
    out.extend(config.refusals().map(|(source, refusal)| {
        serde_json::json!({
            "kind": refusal.key.as_ref().map(|k| k.kind),
            "metadata": {
                "name": refusal.key.as_ref().map(|k| &k.name),
                "namespace": refusal.key.as_ref().map(|k| &k.namespace),
            },
            "source": refusal.origin,
            "configSource": source,
            "status": "refused",
            "error": refusal.error,
        })
    }));
    Json(out)
}

/// The mesh config in force and why a newer one is refused, if it is.
async fn mesh_config(State(state): State<Arc<AdminState>>) -> Json<serde_json::Value> {
    let snapshot = state.aggregate.mesh().snapshot();
    Json(serde_json::json!({
        "meshConfig": **snapshot.config.mesh(),
        "last_error": *state.mesh_config_error.lock(),
    }))
}

/// Every JWT key source RequestAuthentications name: who uses it, where the keys came from, when,
/// and why the last fetch failed. Sources with inline keys are not listed.
async fn jwksz(State(state): State<Arc<AdminState>>) -> Json<Vec<serde_json::Value>> {
    let snapshot = state.aggregate.mesh().snapshot();
    let views = snapshot
        .config
        .security()
        .jwks_sources()
        .into_iter()
        .map(|(source, used)| {
            let entry = snapshot
                .jwks
                .get(&source)
                .map(|e| (**e).clone())
                .unwrap_or_default();
            let status = match (&entry.keys, &entry.error) {
                (Some(_), None) => "fetched",
                (Some(_), Some(_)) => "stale",
                (None, Some(_)) => "failed",
                (None, None) => "pending",
            };
            serde_json::json!({
                "source": source,
                "usedBy": used.policies.iter().map(|k| k.to_string()).collect::<Vec<_>>(),
                "status": status,
                "uri": entry.uri,
                "fetchedAt": entry.fetched_at,
                "error": entry.error,
            })
        })
        .collect();
    Json(views)
}

/// The last pushes: when, why (the configs behind them), to whom.
async fn pushz(State(state): State<Arc<AdminState>>) -> Json<Vec<crate::xds::server::PushRecord>> {
    Json(state.xds.push_log())
}
