//! The admin HTTP server: readiness, metrics and istiod's debug API (`debug`).

use std::sync::Arc;

use axum::extract::{Path, RawQuery, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

use crate::aggregate::Aggregate;
use crate::debug::{parse_request, DebugContext, Viewer};
use crate::metrics::{self, Metrics};
use crate::xds::server::Readiness;

pub struct AdminState {
    pub ready: Readiness,
    pub aggregate: Arc<Aggregate>,
    pub metrics: Arc<Metrics>,
    pub debug: Arc<DebugContext>,
}

pub fn router(state: Arc<AdminState>) -> Router {
    Router::new()
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .route("/debug/{*path}", get(debug))
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
    ([(header::CONTENT_TYPE, metrics::CONTENT_TYPE)], body).into_response()
}

/// `/debug/<path>[?query]`. The admin port is the operator's (as istiod's 15014 from localhost):
/// it sees every namespace.
async fn debug(
    State(state): State<Arc<AdminState>>,
    Path(path): Path<String>,
    RawQuery(query): RawQuery,
) -> Response {
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
