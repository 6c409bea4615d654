//! istiod's debug API (`/debug/<path>`): the same paths and JSON shapes istioctl and operators
//! read, plus meshpilot's own views beside them. Served on the admin port and, for
//! `istio.io/debug` requests, over ADS (`xds/debug`).

mod clusters;
mod config;
mod proto_json;
mod registry;

use std::sync::Arc;

use envoy_types::pb::envoy::admin::v3::ConfigDump;
use serde::Serialize;

pub use crate::xds::introspect::{parse_request, DebugError, Query, Viewer};

use crate::aggregate::Aggregate;
use crate::xds::introspect::config_dump::{find_proxy, sections};
use crate::xds::introspect::{names, sync, DebugViews};
use crate::xds::server::XdsServer;

/// What the views read: the model, the connected proxies, and the sources' standing errors.
pub struct DebugContext {
    pub aggregate: Arc<Aggregate>,
    pub xds: Arc<XdsServer>,
    /// Why the mesh networks file is currently refused, if it is.
    pub networks_error: Arc<parking_lot::Mutex<Option<String>>>,
    /// Why the mesh config is currently refused, if it is.
    pub mesh_config_error: Arc<parking_lot::Mutex<Option<String>>>,
    /// The MCP config sources' states.
    pub config_sources: crate::sources::mcp::SourceStatuses,
}

/// Paths a namespace-scoped viewer may ask for (istiod's allowlist); each filters to its proxies.
const SCOPED_PATHS: [&str; 3] = ["config_dump", "syncz", "connections"];

/// Every path, in `/debug/list`'s order.
const PATHS: [&str; 15] = [
    "clusterz",
    "config_dump",
    "configz",
    "connections",
    "endpointShardz",
    "endpointz",
    "jwksz",
    "mesh",
    "ndsz",
    "networkz",
    "push_status",
    "pushz",
    "registryz",
    "syncz",
    "list",
];

impl DebugViews for DebugContext {
    fn render(&self, path: &str, query: &Query, viewer: &Viewer) -> Result<Vec<u8>, DebugError> {
        DebugContext::render(self, path, query, viewer)
    }
}

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
            "syncz" => json(sync::syncz(&self.xds, query, viewer)),
            "connections" => json(sync::connections(&self.xds, viewer)),
            "clusterz" => json(clusters::clusterz(self)),
            "registryz" => json(registry::registryz(self)),
            "endpointz" => json(registry::endpointz(self)),
            "endpointShardz" => json(registry::endpoint_shardz(self)),
            "push_status" => json(registry::push_status(self)),
            "config_dump" => return config_dump_json(self, query, viewer),
            "configz" => config::configz(self),
            "mesh" => config::mesh(self),
            "networkz" => config::networkz(self),
            "jwksz" => config::jwksz(self),
            "pushz" => json(self.xds.push_log()),
            "ndsz" => {
                let proxy_id = query.get("proxyID").map(String::as_str).unwrap_or_default();
                names::ndsz(&self.xds, proxy_id, viewer)?
            }
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

/// `/debug/config_dump?proxyID=<id>[&include_eds]`: the dump as protobuf JSON.
fn config_dump_json(
    ctx: &DebugContext,
    query: &Query,
    viewer: &Viewer,
) -> Result<Vec<u8>, DebugError> {
    let proxy_id = query.get("proxyID").map(String::as_str).unwrap_or_default();
    let conn = find_proxy(&ctx.xds, proxy_id, viewer)?;
    let dump = ConfigDump {
        configs: sections(&ctx.xds, &conn, query.contains_key("include_eds")),
    };
    proto_json::to_json(&dump).map_err(DebugError::Encoding)
}
