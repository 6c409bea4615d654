//! istiod's debug API (`/debug/<path>`): the same paths and JSON shapes istioctl and operators
//! read, plus meshpilot's own views beside them. Served on the admin port and, for
//! `istio.io/debug` requests, over ADS (`xds/debug`).

mod clusters;
mod config;
pub mod config_dump;
mod proto_json;
mod registry;
mod sync;

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::Serialize;
use thiserror::Error;

pub use sync::client_configs;

use crate::aggregate::Aggregate;
use crate::xds::server::XdsServer;

/// What the views read: the model, the connected proxies, and the sources' standing errors.
pub struct DebugContext {
    pub aggregate: Arc<Aggregate>,
    pub xds: Arc<XdsServer>,
    /// Why the mesh networks file is currently refused, if it is.
    pub networks_error: Arc<parking_lot::Mutex<Option<String>>>,
    /// Why the mesh config is currently refused, if it is.
    pub mesh_config_error: Arc<parking_lot::Mutex<Option<String>>>,
}

/// Who asks: the admin port sees everything; an xDS caller proven outside the system namespace
/// sees only its own namespace's proxies (Istio's fix for CVE-2026-31838).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Viewer {
    All,
    Namespace(Arc<str>),
}

impl Viewer {
    pub fn sees(&self, namespace: &str) -> bool {
        match self {
            Viewer::All => true,
            Viewer::Namespace(own) => **own == *namespace,
        }
    }
}

/// Paths a namespace-scoped viewer may ask for (istiod's allowlist); each filters to its proxies.
const SCOPED_PATHS: [&str; 3] = ["config_dump", "syncz", "connections"];

#[derive(Debug, Error, PartialEq, Eq)]
pub enum DebugError {
    #[error("no debug path {0}")]
    NotFound(String),
    #[error("{0}")]
    BadRequest(String),
    #[error(
        "Proxy not connected to this meshpilot instance. It may be connected to another instance."
    )]
    ProxyNotFound,
    #[error("the debug path {path} is not available to callers from namespace {namespace}")]
    Forbidden { path: String, namespace: String },
    #[error("cannot print the config dump: {0}")]
    Encoding(String),
}

impl DebugError {
    pub fn http_status(&self) -> u16 {
        match self {
            DebugError::NotFound(_) | DebugError::ProxyNotFound => 404,
            DebugError::BadRequest(_) => 400,
            DebugError::Forbidden { .. } => 403,
            DebugError::Encoding(_) => 500,
        }
    }
}

pub type Query = BTreeMap<String, String>;

/// Every path, in `/debug/list`'s order.
const PATHS: [&str; 14] = [
    "clusterz",
    "config_dump",
    "configz",
    "connections",
    "endpointShardz",
    "endpointz",
    "jwksz",
    "mesh",
    "networkz",
    "push_status",
    "pushz",
    "registryz",
    "syncz",
    "list",
];

impl DebugContext {
    /// Renders `/debug/<path>` as JSON.
    pub fn render(
        &self,
        path: &str,
        query: &Query,
        viewer: &Viewer,
    ) -> Result<Vec<u8>, DebugError> {
        if let Viewer::Namespace(namespace) = viewer {
            if !SCOPED_PATHS.contains(&path) {
                return Err(DebugError::Forbidden {
                    path: crate::text::quote(path),
                    namespace: namespace.to_string(),
                });
            }
        }
        let value = match path {
            "syncz" => json(sync::syncz(self, query, viewer)),
            "connections" => json(sync::connections(self, viewer)),
            "clusterz" => json(clusters::clusterz(self)),
            "registryz" => json(registry::registryz(self)),
            "endpointz" => json(registry::endpointz(self)),
            "endpointShardz" => json(registry::endpoint_shardz(self)),
            "push_status" => json(registry::push_status(self)),
            "config_dump" => return config_dump::json(self, query, viewer),
            "configz" => config::configz(self),
            "mesh" => config::mesh(self),
            "networkz" => config::networkz(self),
            "jwksz" => config::jwksz(self),
            "pushz" => json(self.xds.push_log()),
            "list" => json(&PATHS[..PATHS.len() - 1]),
            other => return Err(DebugError::NotFound(crate::text::quote(other))),
        };
        // Serializing a JSON value into memory cannot fail.
        Ok(serde_json::to_vec(&value).unwrap_or_default())
    }
}

fn json<T: Serialize>(value: T) -> serde_json::Value {
    serde_json::to_value(value).unwrap_or_default()
}

/// Splits `path?a=b&c` into the path and its parameters (a bare key maps to "").
pub fn parse_request(request: &str) -> (&str, Query) {
    let (path, query) = request.split_once('?').unwrap_or((request, ""));
    let query = query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (k.to_string(), v.to_string())
        })
        .collect();
    (path.trim_start_matches('/'), query)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_split_into_path_and_parameters() {
        let (path, query) = parse_request("config_dump?proxyID=a.ns&include_eds");
        assert_eq!(path, "config_dump");
        assert_eq!(query["proxyID"], "a.ns");
        assert_eq!(query["include_eds"], "");
    }

    #[test]
    fn a_namespace_viewer_sees_only_its_namespace() {
        let viewer = Viewer::Namespace("shop".into());
        assert!(viewer.sees("shop"));
        assert!(!viewer.sees("istio-system"));
        assert!(Viewer::All.sees("anything"));
    }
}
