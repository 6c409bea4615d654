//! What meshpilot would send one connected proxy, as Envoy's admin `ConfigDump`: the
//! `istio.io/debug/config_dump` resources `istioctl proxy-status <pod>` diffs against the proxy's
//! own dump, and `/debug/config_dump?proxyID=` as protobuf JSON.

use std::sync::Arc;

use envoy_types::pb::envoy::admin::v3::endpoints_config_dump::DynamicEndpointConfig;
use envoy_types::pb::envoy::admin::v3::{
    clusters_config_dump::DynamicCluster, listeners_config_dump::DynamicListener,
    listeners_config_dump::DynamicListenerState, routes_config_dump::DynamicRouteConfig,
    secrets_config_dump::DynamicSecret, BootstrapConfigDump, ClustersConfigDump,
    EndpointsConfigDump, ListenersConfigDump, RoutesConfigDump, SecretsConfigDump,
};
use envoy_types::pb::envoy::config::core::v3::{data_source::Specifier, DataSource};
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{secret, Secret};
use envoy_types::pb::google::protobuf::Any;
use prost::{Message, Name};

use super::{DebugError, Viewer};
use crate::xds::generate::Generation;
use crate::xds::protocol::ResourceType;
use crate::xds::server::{Connection, XdsServer};
use crate::xds::wire::Resource;

/// The connection a `proxyID` names: istiod matches it as a substring of the connection id, so
/// `pod.namespace` is enough.
pub fn find_proxy(
    xds: &XdsServer,
    proxy_id: &str,
    viewer: &Viewer,
) -> Result<Arc<Connection>, DebugError> {
    if proxy_id.is_empty() {
        return Err(DebugError::BadRequest(
            "You must provide a proxyID in the query string".into(),
        ));
    }
    xds.connections()
        .into_iter()
        .find(|c| c.connection_id().contains(proxy_id) && viewer.sees(&c.proxy.namespace))
        .ok_or(DebugError::ProxyNotFound)
}

/// The dump's sections, each an `Any` of an admin `*ConfigDump`, in istiod's order.
pub fn sections(xds: &XdsServer, conn: &Connection, include_eds: bool) -> Vec<Any> {
    let snapshot = xds.mesh().snapshot();
    let g = Generation::new(&snapshot, xds.cache(), &conn.proxy)
        .with_secret_access(xds.secret_access());
    let version = snapshot.version_text.to_string();
    let clusters = g.all(ResourceType::Cluster);
    let listeners = g.all(ResourceType::Listener);
    let routes = g.named(
        ResourceType::Route,
        conn.subscribed(ResourceType::Route).iter(),
    );
    let secrets = g.named(
        ResourceType::Secret,
        conn.subscribed(ResourceType::Secret).iter(),
    );

    let mut out = vec![pack(&BootstrapConfigDump::default())];
    out.push(pack(&ClustersConfigDump {
        version_info: version.clone(),
        dynamic_active_clusters: clusters
            .iter()
            .map(|r| DynamicCluster {
                version_info: version.clone(),
                cluster: any_of(r),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }));
    if include_eds {
        let names: Vec<String> = clusters.iter().map(|r| r.name.to_string()).collect();
        out.push(pack(&EndpointsConfigDump {
            dynamic_endpoint_configs: g
                .named(ResourceType::Endpoint, names.iter())
                .iter()
                .map(|r| DynamicEndpointConfig {
                    version_info: version.clone(),
                    endpoint_config: any_of(r),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }));
    }
    out.push(pack(&ListenersConfigDump {
        version_info: version.clone(),
        dynamic_listeners: listeners
            .iter()
            .map(|r| DynamicListener {
                name: r.name.to_string(),
                active_state: Some(DynamicListenerState {
                    version_info: version.clone(),
                    listener: any_of(r),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }));
    out.push(pack(&RoutesConfigDump {
        dynamic_route_configs: routes
            .iter()
            .map(|r| DynamicRouteConfig {
                version_info: version.clone(),
                route_config: any_of(r),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }));
    out.push(pack(&SecretsConfigDump {
        dynamic_active_secrets: secrets
            .iter()
            .map(|r| DynamicSecret {
                name: r.name.to_string(),
                version_info: version.clone(),
                secret: any_of(r).map(redacted),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }));
    out
}

pub fn pack<M: Message + Name>(message: &M) -> Any {
    Any {
        type_url: M::type_url(),
        value: message.encode_to_vec(),
    }
}

fn any_of(resource: &Resource) -> Option<Any> {
    Any::decode(resource.any.clone()).ok()
}

/// A secret as istiod dumps it: private keys replaced.
fn redacted(any: Any) -> Any {
    let Ok(mut secret) = Secret::decode(any.value.as_slice()) else {
        return any;
    };
    if let Some(secret::Type::TlsCertificate(cert)) = &mut secret.r#type {
        if cert.private_key.is_some() {
            cert.private_key = Some(DataSource {
                specifier: Some(Specifier::InlineBytes(b"[redacted]".to_vec())),
                ..Default::default()
            });
        }
    }
    pack(&secret)
}
