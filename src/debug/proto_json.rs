//! Envoy messages as protobuf JSON (lowerCamelCase fields, `Any` expanded with `@type`), as
//! Envoy's admin and istiod print config dumps. Descriptors of Envoy's API are compiled in by
//! build.rs and loaded on first use.

use prost::{Message, Name};
use prost_reflect::SerializeOptions;

use crate::envoy_api;

/// Encodes `message` as protobuf JSON.
pub fn to_json<M: Message + Name>(message: &M) -> Result<Vec<u8>, String> {
    let dynamic = envoy_api::to_dynamic(message).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    let mut serializer = serde_json::Serializer::new(&mut out);
    dynamic
        .serialize_with_options(&mut serializer, &SerializeOptions::new())
        .map_err(|e| e.to_string())?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::admin::v3::{
        clusters_config_dump::DynamicCluster, ClustersConfigDump,
    };
    use envoy_types::pb::envoy::config::cluster::v3::Cluster;

    #[test]
    fn an_any_inside_a_dump_prints_with_its_type() {
        let cluster = Cluster {
            name: "outbound|80||a.ns.svc.cluster.local".into(),
            ..Default::default()
        };
        let dump = ClustersConfigDump {
            version_info: "v1".into(),
            dynamic_active_clusters: vec![DynamicCluster {
                cluster: Some(crate::xds::introspect::config_dump::pack(&cluster)),
                ..Default::default()
            }],
            ..Default::default()
        };
        let json: serde_json::Value =
            serde_json::from_slice(&to_json(&dump).expect("encodes")).expect("JSON");
        let cluster = &json["dynamicActiveClusters"][0]["cluster"];
        assert_eq!(
            cluster["@type"],
            "type.googleapis.com/envoy.config.cluster.v3.Cluster"
        );
        assert_eq!(cluster["name"], "outbound|80||a.ns.svc.cluster.local");
        assert_eq!(json["versionInfo"], "v1");
    }

    #[test]
    fn every_type_meshpilot_embeds_has_a_descriptor() {
        let pool = envoy_api::pool().expect("descriptors load");
        for name in [
            "envoy.admin.v3.ConfigDump",
            "envoy.config.cluster.v3.Cluster",
            "envoy.config.listener.v3.Listener",
            "envoy.config.route.v3.RouteConfiguration",
            "envoy.config.endpoint.v3.ClusterLoadAssignment",
            "envoy.extensions.transport_sockets.tls.v3.Secret",
            "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
            "envoy.extensions.transport_sockets.raw_buffer.v3.RawBuffer",
            "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
            "envoy.extensions.filters.network.rbac.v3.RBAC",
            "envoy.extensions.filters.network.ext_authz.v3.ExtAuthz",
            "envoy.extensions.filters.http.router.v3.Router",
            "envoy.extensions.filters.http.rbac.v3.RBAC",
            "envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication",
            "envoy.extensions.filters.http.ext_authz.v3.ExtAuthz",
            "envoy.extensions.filters.http.cors.v3.Cors",
            "envoy.extensions.filters.http.fault.v3.HTTPFault",
            "envoy.extensions.filters.listener.original_dst.v3.OriginalDst",
            "envoy.extensions.filters.listener.tls_inspector.v3.TlsInspector",
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
            "envoy.extensions.formatter.req_without_query.v3.ReqWithoutQuery",
            "envoy.extensions.request_id.uuid.v3.UuidRequestIdConfig",
            "envoy.config.trace.v3.ZipkinConfig",
            "envoy.config.trace.v3.OpenTelemetryConfig",
            "udpa.type.v1.TypedStruct",
            "stats.PluginConfig",
        ] {
            assert!(pool.get_message_by_name(name).is_some(), "{name}");
        }
    }
}
