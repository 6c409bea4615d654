//! istioctl's debug types over ADS: `istio.io/debug/syncz` (proxy-status), `istio.io/debug/
//! config_dump` (proxy-status <pod>) and `istio.io/debug` (any debug path, its JSON as the one
//! resource). Answered per request, never watched.

use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::ControlPlane;
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryResponse;
use envoy_types::pb::google::protobuf::Any;
use prost::Message;
use tonic::Status;
use tracing::debug;

use super::introspect::config_dump::{find_proxy, pack, sections};
use super::introspect::sync::client_configs;
use super::introspect::{parse_request, DebugError, Viewer};
use super::server::{Connection, XdsServer};
use super::session::DebugRequest;
use crate::text::quote;

/// Every debug type URL starts so.
pub const DEBUG_TYPE: &str = "istio.io/debug";
const SYNCZ_TYPE: &str = "istio.io/debug/syncz";
const CONFIG_DUMP_TYPE: &str = "istio.io/debug/config_dump";

/// What the caller may see, as istiod's debug generator decides (pilot/pkg/xds/debuggen.go): a
/// caller without a verified identity (the plaintext port) nothing, the system namespace
/// everything, any other namespace its own proxies only. `--insecure-open-debug` shows all to all.
fn viewer(server: &XdsServer, conn: &Connection) -> Result<Viewer, Status> {
    let proxy = &conn.proxy;
    if server.options().open_debug {
        return Ok(Viewer::All);
    }
    if !proxy.verified() {
        return Err(Status::unauthenticated(
            "authentication required: debug types are served on the secure xDS port to a \
             verified identity",
        ));
    }
    Ok(
        match *proxy.namespace == *server.mesh().naming.system_namespace {
            true => Viewer::All,
            false => Viewer::Namespace(proxy.namespace.clone()),
        },
    )
}

pub fn respond(
    server: &XdsServer,
    conn: &Connection,
    request: DebugRequest,
) -> Result<Bytes, Status> {
    let viewer = viewer(server, conn)?;
    let resources = match request.type_url.as_str() {
        SYNCZ_TYPE => client_configs(server, &viewer).iter().map(pack).collect(),
        CONFIG_DUMP_TYPE => match request.names.as_slice() {
            // As istiod: anything but one known proxy is answered with nothing.
            [proxy_id] => match find_proxy(server, proxy_id, &viewer) {
                Ok(target) => sections(server, &target, false),
                Err(e) => {
                    debug!(proxy = %quote(proxy_id), error = %e, "config dump of an unknown proxy");
                    Vec::new()
                }
            },
            _ => Vec::new(),
        },
        url => {
            let path = match url.strip_prefix(DEBUG_TYPE) {
                Some("") => match request.names.as_slice() {
                    [name] => name.clone(),
                    [] => return Err(Status::invalid_argument("debug type is required")),
                    _ => {
                        return Err(Status::invalid_argument(
                            "only one debug request is allowed",
                        ))
                    }
                },
                Some(rest) => rest.trim_start_matches('/').to_string(),
                None => return Err(Status::invalid_argument("not a debug type")),
            };
            let (path, query) = parse_request(&path);
            let views = server
                .debug_views()
                .ok_or_else(|| Status::unavailable("debug views are not served by this server"))?;
            let body = views.render(path, &query, &viewer).map_err(status)?;
            vec![Any {
                type_url: DEBUG_TYPE.to_string(),
                value: body,
            }]
        }
    };
    let response = DiscoveryResponse {
        version_info: server.mesh().snapshot().version_text.to_string(),
        resources,
        type_url: request.type_url,
        nonce: request.nonce.to_string(),
        control_plane: Some(ControlPlane {
            identifier: control_plane_identifier().to_string(),
        }),
        ..Default::default()
    };
    Ok(Bytes::from(response.encode_to_vec()))
}

fn status(e: DebugError) -> Status {
    match e {
        DebugError::Forbidden { .. } => Status::permission_denied(e.to_string()),
        DebugError::NotFound(_) | DebugError::ProxyNotFound => Status::not_found(e.to_string()),
        DebugError::BadRequest(_) => Status::invalid_argument(e.to_string()),
        DebugError::Encoding(_) => Status::internal(e.to_string()),
    }
}

/// istiod's control-plane identity (`istioctl proxy-status` shows `ID` as the ISTIOD column): the
/// pod name where there is one.
fn control_plane_identifier() -> &'static Arc<str> {
    static ID: OnceLock<Arc<str>> = OnceLock::new();
    ID.get_or_init(|| {
        let id = std::env::var("POD_NAME")
            .or_else(|_| std::env::var("HOSTNAME"))
            .unwrap_or_else(|_| "meshpilot".to_string());
        let identity = serde_json::json!({
            "Component": "istiod",
            "ID": id,
            "Info": { "version": env!("CARGO_PKG_VERSION"), "status": "Clean", "tag": env!("CARGO_PKG_VERSION") },
        });
        Arc::from(identity.to_string())
    })
}
