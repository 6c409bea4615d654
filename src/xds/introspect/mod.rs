//! What the xDS server can tell of its connections, for istioctl and operators: the sync status of
//! each proxy (`syncz`, istioctl's proxy-status), its connections, and the configuration it would
//! be sent (`config_dump`). The admin port's debug views (`debug`) show them beside the model's;
//! the `istio.io/debug` xDS types (`xds/debug`) answer with them, and with any other debug view
//! through [`DebugViews`].

pub mod config_dump;
pub mod names;
pub mod sync;

use std::collections::BTreeMap;
use std::sync::Arc;

use thiserror::Error;

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

/// The debug views beyond the xDS server's own (registries, config, networks…), which the
/// `istio.io/debug` xDS type serves by path. The server holds them weakly: they hold the server.
pub trait DebugViews: Send + Sync {
    /// `/debug/<path>` as JSON, for `viewer`.
    fn render(&self, path: &str, query: &Query, viewer: &Viewer) -> Result<Vec<u8>, DebugError>;
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
