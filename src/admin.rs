//! The admin HTTP server: liveness, readiness, metrics and istiod's debug API (`debug`).
//!
//! `/healthz`, `/ready` and `/metrics` are open. `/debug/*` shows every proxy's configuration, so
//! as istiod (pilot/pkg/xds/debug.go, `allowAuthenticatedOrLocalhost`) it answers loopback callers,
//! and others only with a bearer token — here one the config cluster's TokenReview proves to be a
//! service account of the system namespace or of a namespace `--debug-namespaces` lists (istiod
//! accepts any authenticated identity).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::SystemTime;

use axum::extract::connect_info::Connected;
use axum::extract::{ConnectInfo, Path, RawQuery, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

use crate::aggregate::Aggregate;
use crate::debug::{parse_request, DebugContext, Viewer};
use crate::listen::Acceptor;
use crate::metrics::{self, ClusterGauges, ConfigGauges, Metrics};
use crate::security::authn::{Authenticator, Credentials};
use crate::supervise::Health;
use crate::xds::server::Readiness;

pub struct AdminState {
    pub ready: Readiness,
    pub aggregate: Arc<Aggregate>,
    pub metrics: Arc<Metrics>,
    pub debug: Arc<DebugContext>,
    pub health: Health,
    pub debug_access: DebugAccess,
}

/// Who may read `/debug/*` from another host.
pub struct DebugAccess {
    /// `--insecure-open-debug`: anyone.
    pub open: bool,
    /// Reviews bearer tokens (None without a config cluster: only loopback callers get in).
    pub authn: Option<Arc<Authenticator>>,
    /// The system namespace and `--debug-namespaces`.
    pub namespaces: Vec<String>,
}

/// The address a connection came from.
#[derive(Clone, Copy, Debug)]
pub struct Peer(pub SocketAddr);

impl Connected<axum::serve::IncomingStream<'_, Acceptor>> for Peer {
    fn connect_info(stream: axum::serve::IncomingStream<'_, Acceptor>) -> Self {
        Peer(*stream.remote_addr())
    }
}

pub fn router(state: Arc<AdminState>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .route("/debug/{*path}", get(debug))
        .with_state(state)
}

/// Serves the admin router, with each caller's address known to the debug handler.
pub async fn serve(listener: Acceptor, router: Router) -> std::io::Result<()> {
    axum::serve(
        listener,
        router.into_make_service_with_connect_info::<Peer>(),
    )
    .await
}

/// Alive while every supervised task runs (the process exits soon after one ends).
async fn healthz(State(state): State<Arc<AdminState>>) -> Response {
    match state.health.failure() {
        None => (StatusCode::OK, "ok\n").into_response(),
        Some(ended) => (StatusCode::SERVICE_UNAVAILABLE, format!("{ended}\n")).into_response(),
    }
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
    let clusters: Vec<ClusterGauges> = (state.aggregate.clusters().iter())
        .map(|cluster| {
            let status = cluster.status();
            ClusterGauges {
                id: cluster.id().clone(),
                state: status.state.name(),
                endpoints: cluster.endpoint_count(),
                failing: status.last_error.is_some(),
                stale_for: status
                    .snapshot_saved_at
                    .map(|at| SystemTime::now().duration_since(at).unwrap_or_default()),
                pending_pod_endpoints: cluster.pending_pod_endpoints(),
            }
        })
        .collect();
    let snapshot = state.aggregate.mesh().snapshot();
    let config = ConfigGauges {
        services: snapshot.services.len(),
        failing_patches: crate::xds::generate::envoy_filter_failures(&snapshot.config)
            .into_iter()
            .map(|f| {
                let key = &f.filter;
                (format!("{}/{}", key.namespace, key.name), f.target)
            })
            .collect(),
        sources: (state.debug.config_sources.lock().iter())
            .map(|s| (s.address.clone(), s.synced, s.last_error.is_some()))
            .collect(),
    };
    let body = state.metrics.render(&clusters, &config);
    ([(header::CONTENT_TYPE, metrics::CONTENT_TYPE)], body).into_response()
}

/// `/debug/<path>[?query]` for a caller `DebugAccess` lets in; it sees every namespace.
async fn debug(
    State(state): State<Arc<AdminState>>,
    ConnectInfo(Peer(peer)): ConnectInfo<Peer>,
    headers: HeaderMap,
    Path(path): Path<String>,
    RawQuery(query): RawQuery,
) -> Response {
    if let Err((status, why)) = state.debug_access.admit(peer, &headers).await {
        tracing::warn!(%peer, reason = why, "debug request refused");
        return (status, format!("{why}\n")).into_response();
    }
    let request = match query {
        Some(q) => format!("{path}?{q}"),
        None => path,
    };
    let (path, query) = parse_request(&request);
    match state.debug.render(path, &query, &Viewer::All) {
        Ok(body) => ([(header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(e) => {
            let status = StatusCode::from_u16(e.http_status()).unwrap_or(StatusCode::BAD_REQUEST);
            (status, format!("{e}\n")).into_response()
        }
    }
}

impl DebugAccess {
    /// Lets in loopback callers, and others proving a service account of an allowed namespace.
    async fn admit(
        &self,
        peer: SocketAddr,
        headers: &HeaderMap,
    ) -> Result<(), (StatusCode, String)> {
        if self.open || peer.ip().to_canonical().is_loopback() {
            return Ok(());
        }
        let unauthorized = |why: String| (StatusCode::UNAUTHORIZED, why);
        let token = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(|t| t.trim().to_string());
        let (Some(token), Some(authn)) = (token, &self.authn) else {
            return Err(unauthorized(
                "debug views need a loopback caller or a service-account bearer token".into(),
            ));
        };
        let credentials = Credentials {
            token: Some(token),
            ..Default::default()
        };
        let identity = authn
            .authenticate(&credentials)
            .await
            .map_err(|e| unauthorized(e.to_string()))?;
        if !self.namespaces.contains(&identity.namespace) {
            return Err((
                StatusCode::FORBIDDEN,
                format!(
                    "{identity} may not read debug views: only service accounts of namespaces {} may",
                    self.namespaces.join(", ")
                ),
            ));
        }
        Ok(())
    }
}
