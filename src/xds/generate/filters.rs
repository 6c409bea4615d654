//! Envoy filters the generators assemble listeners from: HTTP connection managers (routes over RDS
//! or inline), TCP proxies to one cluster or several by weight, listener filters. Connection
//! managers and TCP proxies write the access logs they are given.

use envoy_types::pb::envoy::config::accesslog::v3::AccessLog;
use envoy_types::pb::envoy::config::listener::v3::{
    filter, listener_filter, Filter, ListenerFilter,
};
use envoy_types::pb::envoy::extensions::filters::http::cors::v3::Cors;
use envoy_types::pb::envoy::extensions::filters::http::fault::v3::HttpFault;
use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_connection_manager::{PathWithEscapedSlashesAction, RouteSpecifier, UpgradeConfig},
    http_filter, HttpConnectionManager, HttpFilter, Rds,
};
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::{tcp_proxy, TcpProxy};
use envoy_types::pb::google::protobuf::{Any, BoolValue, Duration};
use envoy_types::util::pack_any;

use super::common::ads_awaited;
use super::istio_stats::SideStats;
use super::names::BLACKHOLE;
use crate::istio::mesh_traffic::Normalization;

pub const FAULT_FILTER: &str = "envoy.filters.http.fault";
/// The `server` header Istio's proxies answer with (istiod's default `proxyHeaders`).
pub const ISTIO_SERVER_NAME: &str = "istio-envoy";
pub const CORS_FILTER: &str = "envoy.filters.http.cors";
const HTTP_CONNECTION_MANAGER: &str = "envoy.filters.network.http_connection_manager";
const TCP_PROXY: &str = "envoy.filters.network.tcp_proxy";

/// Routes named `route_name`, fetched over ADS.
pub(super) fn rds(route_name: &str) -> RouteSpecifier {
    RouteSpecifier::Rds(Rds {
        config_source: Some(ads_awaited()),
        route_config_name: route_name.to_string(),
    })
}

/// A connection manager with the router as its only HTTP filter, and the settings istiod gives
/// every one (`buildHTTPConnectionManager`, pilot/pkg/networking/core/listener_builder.go): paths
/// normalised as the mesh says once it is a filter ([`hcm_filter`]); no idle timeout on streams (long polls and gRPC streams stay); WebSocket upgrades; a
/// `100-continue` answered by the upstream.
pub(super) fn hcm(
    stat_prefix: &str,
    routes: RouteSpecifier,
    logs: &[AccessLog],
) -> HttpConnectionManager {
    HttpConnectionManager {
        stat_prefix: stat_prefix.to_string(),
        route_specifier: Some(routes),
        access_log: logs.to_vec(),
        // Said outright, as istiod does; routers set it.
        use_remote_address: Some(BoolValue { value: false }),
        stream_idle_timeout: Some(Duration {
            seconds: 0,
            nanos: 0,
        }),
        upgrade_configs: vec![UpgradeConfig {
            upgrade_type: "websocket".to_string(),
            ..Default::default()
        }],
        proxy_100_continue: true,
        http_filters: vec![HttpFilter {
            name: "envoy.filters.http.router".to_string(),
            config_type: Some(http_filter::ConfigType::TypedConfig(pack_any(
                Router::default(),
            ))),
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// The HTTP connection manager of outbound and gateway listeners: VirtualService faults and CORS
/// are per-route settings of these filters, so they come before the router (with nothing to do
/// where no route configures them).
pub(super) fn outbound_hcm(
    stat_prefix: &str,
    routes: RouteSpecifier,
    logs: &[AccessLog],
) -> HttpConnectionManager {
    let mut hcm = hcm(stat_prefix, routes, logs);
    let filter = |name: &str, config| HttpFilter {
        name: name.to_string(),
        config_type: Some(http_filter::ConfigType::TypedConfig(config)),
        ..Default::default()
    };
    hcm.http_filters.splice(
        0..0,
        [
            filter(FAULT_FILTER, pack_any(HttpFault::default())),
            filter(CORS_FILTER, pack_any(Cors::default())),
        ],
    );
    hcm
}

/// A connection manager as a listener's network filter, its paths normalised as the mesh says,
/// with Istio's stats filters when the proxy gets them.
pub(super) fn hcm_filter(
    mut hcm: HttpConnectionManager,
    stats: Option<&SideStats>,
    paths: Normalization,
) -> Filter {
    normalize_paths(&mut hcm, paths);
    if let Some(stats) = stats {
        stats.add_to(&mut hcm);
    }
    network_filter(HTTP_CONNECTION_MANAGER, pack_any(hcm))
}

/// Mesh `pathNormalization` (istiod's `buildHTTPConnectionManager`,
/// pilot/pkg/networking/core/listener_builder.go): BASE normalises (RFC 3986), MERGE_SLASHES also
/// merges `//`, DECODE_AND_MERGE_SLASHES also decodes escaped slashes; NONE leaves paths be.
fn normalize_paths(hcm: &mut HttpConnectionManager, paths: Normalization) {
    let (normalize, merge, escaped) = match paths {
        Normalization::None => (false, false, PathWithEscapedSlashesAction::KeepUnchanged),
        Normalization::Default | Normalization::Base => {
            (true, false, PathWithEscapedSlashesAction::KeepUnchanged)
        }
        Normalization::MergeSlashes => (true, true, PathWithEscapedSlashesAction::KeepUnchanged),
        Normalization::DecodeAndMergeSlashes => {
            (true, true, PathWithEscapedSlashesAction::UnescapeAndForward)
        }
    };
    hcm.normalize_path = Some(BoolValue { value: normalize });
    hcm.merge_slashes = merge;
    hcm.path_with_escaped_slashes_action = escaped as i32;
}

pub(super) fn network_filter(name: &str, config: Any) -> Filter {
    Filter {
        name: name.to_string(),
        config_type: Some(filter::ConfigType::TypedConfig(config)),
    }
}

/// A TCP proxy to one cluster; nothing to the black hole is logged, as istiod.
pub(super) fn tcp_proxy_filter(stat_prefix: &str, cluster: &str, logs: &[AccessLog]) -> Filter {
    let proxy = TcpProxy {
        stat_prefix: stat_prefix.to_string(),
        cluster_specifier: Some(tcp_proxy::ClusterSpecifier::Cluster(cluster.to_string())),
        access_log: match cluster {
            BLACKHOLE => Vec::new(),
            _ => logs.to_vec(),
        },
        ..Default::default()
    };
    network_filter(TCP_PROXY, pack_any(proxy))
}

/// A TCP proxy to one cluster, or spread over several by weight.
pub(super) fn weighted_tcp_proxy(
    stat_prefix: &str,
    targets: &[(String, u32)],
    logs: &[AccessLog],
) -> Filter {
    if let [(single, _)] = targets {
        return tcp_proxy_filter(stat_prefix, single, logs);
    }
    let proxy = TcpProxy {
        stat_prefix: stat_prefix.to_string(),
        access_log: logs.to_vec(),
        cluster_specifier: Some(tcp_proxy::ClusterSpecifier::WeightedClusters(
            tcp_proxy::WeightedCluster {
                clusters: targets
                    .iter()
                    .filter(|(_, w)| *w > 0)
                    .map(
                        |(name, weight)| tcp_proxy::weighted_cluster::ClusterWeight {
                            name: name.clone(),
                            weight: *weight,
                            ..Default::default()
                        },
                    )
                    .collect(),
            },
        )),
        ..Default::default()
    };
    network_filter(TCP_PROXY, pack_any(proxy))
}

pub(super) fn listener_filter(name: &str, config: Any) -> ListenerFilter {
    ListenerFilter {
        name: name.to_string(),
        config_type: Some(listener_filter::ConfigType::TypedConfig(config)),
        ..Default::default()
    }
}
