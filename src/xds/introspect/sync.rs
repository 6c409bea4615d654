//! Who is connected and how far each proxy is: `/debug/syncz`, `/debug/connections`, and the
//! `ClientConfig`s `istioctl proxy-status` reads over ADS.

use std::collections::BTreeMap;
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::status::v3::{
    client_config::GenericXdsConfig, ClientConfig, ConfigStatus,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use serde::Serialize;

use super::{Query, Viewer};
use crate::xds::protocol::{ResourceType, TypeStatus};
use crate::xds::proxy::{Generator, ProxyType};
use crate::xds::server::{Connection, XdsServer};

/// One row of `/debug/syncz`: istiod's `SyncStatus` fields (nonces sent and acknowledged per
/// type), then meshpilot's own.
#[derive(Serialize)]
struct SyncRow {
    #[serde(skip_serializing_if = "String::is_empty")]
    cluster_id: String,
    proxy: String,
    proxy_type: ProxyType,
    #[serde(skip_serializing_if = "String::is_empty")]
    istio_version: String,
    /// `cluster_sent`, `cluster_acked`, `listener_sent`, …
    #[serde(flatten)]
    nonces: BTreeMap<String, Arc<str>>,
    connection: u64,
    network: String,
    mode: &'static str,
    connected_at: String,
    types: BTreeMap<ResourceType, TypeStatus>,
}

/// istiod's name of a type in SyncStatus's keys; SDS and NDS have none.
fn sync_prefix(ty: ResourceType) -> Option<&'static str> {
    match ty {
        ResourceType::Cluster => Some("cluster"),
        ResourceType::Listener => Some("listener"),
        ResourceType::Route => Some("route"),
        ResourceType::Endpoint => Some("endpoint"),
        ResourceType::ExtensionConfig => Some("extensionconfig"),
        ResourceType::Secret
        | ResourceType::NameTable
        | ResourceType::ProxyConfig
        | ResourceType::Address
        | ResourceType::Authorization
        | ResourceType::Config(..) => None,
    }
}

/// The proxies a viewer may list: debug clients (istioctl itself) are not proxies.
fn proxies(xds: &XdsServer, viewer: &Viewer) -> Vec<Arc<Connection>> {
    xds.connections()
        .into_iter()
        .filter(|c| c.proxy.generator != Generator::Event && viewer.sees(&c.proxy.namespace))
        .collect()
}

/// `?namespace=` narrows the rows as in istiod.
pub fn syncz(xds: &XdsServer, query: &Query, viewer: &Viewer) -> Vec<impl Serialize> {
    let namespace = query.get("namespace");
    proxies(xds, viewer)
        .into_iter()
        .filter(|c| namespace.is_none_or(|ns| **ns == *c.proxy.namespace))
        .map(|c| {
            let types = c.status();
            let mut nonces = BTreeMap::new();
            for (ty, status) in &types {
                let Some(prefix) = sync_prefix(*ty) else {
                    continue;
                };
                if let Some(sent) = &status.sent_nonce {
                    nonces.insert(format!("{prefix}_sent"), sent.clone());
                }
                if let Some(acked) = &status.acked_nonce {
                    nonces.insert(format!("{prefix}_acked"), acked.clone());
                }
            }
            SyncRow {
                cluster_id: cluster_of(&c),
                proxy: c.proxy.id.clone(),
                proxy_type: c.proxy.kind,
                istio_version: c.proxy.istio_version.clone(),
                nonces,
                connection: c.id,
                network: c.proxy.network.to_string(),
                mode: if c.delta { "delta" } else { "sotw" },
                connected_at: humantime::format_rfc3339_seconds(c.connected_at).to_string(),
                types,
            }
        })
        .collect()
}

fn cluster_of(c: &Connection) -> String {
    c.proxy
        .cluster_id
        .as_ref()
        .map(|id| id.to_string())
        .unwrap_or_default()
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Connections {
    total_clients: usize,
    clients: Vec<ClientRow>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ClientRow {
    connection_id: String,
    connected_at: String,
    address: String,
}

/// `/debug/connections`: every stream, debug clients included (as istiod).
pub fn connections(xds: &XdsServer, viewer: &Viewer) -> impl Serialize {
    let clients: Vec<ClientRow> = xds
        .connections()
        .into_iter()
        .filter(|c| viewer.sees(&c.proxy.namespace))
        .map(|c| ClientRow {
            connection_id: c.connection_id(),
            connected_at: humantime::format_rfc3339_nanos(c.connected_at).to_string(),
            address: c.address.map(|a| a.to_string()).unwrap_or_default(),
        })
        .collect();
    Connections {
        total_clients: clients.len(),
        clients,
    }
}

/// `istio.io/debug/syncz`: a `ClientConfig` per proxy with the status of each xDS type, computed as
/// istiod does (not sent, acknowledged = synced, else stale).
pub fn client_configs(xds: &XdsServer, viewer: &Viewer) -> Vec<ClientConfig> {
    // istiod's order; ECDS is never served, so always NOT_SENT.
    let order = [
        Some(ResourceType::Listener),
        Some(ResourceType::Route),
        Some(ResourceType::Endpoint),
        Some(ResourceType::Cluster),
        None,
    ];
    proxies(xds, viewer)
        .into_iter()
        .map(|c| {
            let types = c.status();
            let generic_xds_configs = order
                .iter()
                .map(|ty| {
                    let status = ty.and_then(|ty| types.get(&ty));
                    let config_status = match status {
                        Some(TypeStatus {
                            sent_nonce: Some(sent),
                            acked_nonce,
                            ..
                        }) if acked_nonce.as_ref() == Some(sent) => ConfigStatus::Synced,
                        Some(TypeStatus {
                            sent_nonce: Some(_),
                            ..
                        }) => ConfigStatus::Stale,
                        _ => ConfigStatus::NotSent,
                    };
                    GenericXdsConfig {
                        type_url: match ty {
                            Some(ty) => ty.url().to_string(),
                            None => ECDS_TYPE.to_string(),
                        },
                        config_status: config_status as i32,
                        ..Default::default()
                    }
                })
                .collect();
            let metadata = [
                ("CLUSTER_ID", cluster_of(&c)),
                ("NAMESPACE", c.proxy.namespace.to_string()),
                ("ISTIO_VERSION", c.proxy.istio_version.clone()),
            ];
            ClientConfig {
                node: Some(Node {
                    id: c.proxy.id.clone(),
                    metadata: Some(Struct {
                        fields: metadata
                            .into_iter()
                            .map(|(k, v)| {
                                let value = Value {
                                    kind: Some(Kind::StringValue(v)),
                                };
                                (k.to_string(), value)
                            })
                            .collect(),
                    }),
                    ..Default::default()
                }),
                generic_xds_configs,
                ..Default::default()
            }
        })
        .collect()
}

const ECDS_TYPE: &str = "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig";
