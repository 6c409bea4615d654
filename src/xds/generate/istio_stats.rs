//! Istio's standard metrics for Istio's own proxies (the node names an ISTIO_VERSION), as istiod
//! sends them with a `prometheus` metrics provider and the Telemetry API's overrides
//! (pilot/pkg/model/telemetry.go `generateStatsConfig`, pilot/pkg/xds/filters/filters.go,
//! pilot/pkg/networking/core/listener_builder.go and networkfilter.go): peer metadata exchange
//! first in every connection manager and inbound TCP chain, `istio.stats` just before the router
//! or TCP proxy, and the upstream exchange on outbound clusters. Upstream Envoy has none of these
//! extensions, so a proxy that does not say it is Istio's never gets them.

use std::sync::LazyLock;

use envoy_types::pb::envoy::config::cluster::v3::Filter as ClusterFilter;
use envoy_types::pb::envoy::config::listener::v3::{filter, Filter};
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_filter, HttpConnectionManager, HttpFilter,
};
use envoy_types::pb::google::protobuf::Any;
use prost::Message;
use prost_types::{value::Kind, ListValue, Struct, Value};

use super::access_log::Side;
use crate::model::{MetricOverride, MetricsPlan};
use crate::xds::istio_protos::stats::{MetricConfig, PluginConfig};
use crate::xds::istio_protos::udpa::TypedStruct;

const STATS: &str = "istio.stats";
const METADATA_EXCHANGE: &str = "istio.metadata_exchange";
const STATS_CONFIG: &str = "type.googleapis.com/stats.PluginConfig";
const TYPED_STRUCT: &str = "type.googleapis.com/udpa.type.v1.TypedStruct";
const HTTP_PEER_METADATA: &str = "type.googleapis.com/io.istio.http.peer_metadata.Config";
const TCP_METADATA_EXCHANGE: &str =
    "type.googleapis.com/envoy.tcp.metadataexchange.config.MetadataExchange";
/// The ALPN the TCP exchange negotiates (`istio-peer-exchange`).
const PEER_EXCHANGE: &str = "istio-peer-exchange";

/// The filters of one side of the traffic.
#[derive(Clone, Debug)]
pub(super) struct SideStats {
    http_exchange: HttpFilter,
    /// None where every metric is disabled for this side.
    http_stats: Option<HttpFilter>,
    tcp_exchange: Option<Filter>,
    tcp_stats: Option<Filter>,
}

/// Every side's filters and the clusters' exchange.
#[derive(Clone, Debug)]
pub(super) struct IstioStats {
    outbound: SideStats,
    inbound: SideStats,
    gateway: SideStats,
    cluster_exchange: ClusterFilter,
}

/// What every Istio proxy gets while no Telemetry shapes its metrics.
pub(super) static DEFAULT_ISTIO_STATS: LazyLock<IstioStats> =
    LazyLock::new(|| IstioStats::build(&default_plan()));

/// No overrides, both sides reporting.
pub(super) fn default_plan() -> MetricsPlan {
    MetricsPlan {
        client: Some(Vec::new()),
        server: Some(Vec::new()),
        reporting_interval: None,
    }
}

impl IstioStats {
    pub(super) fn build(plan: &MetricsPlan) -> Self {
        Self {
            outbound: side(Side::SidecarOutbound, plan),
            inbound: side(Side::SidecarInbound, plan),
            gateway: side(Side::Gateway, plan),
            cluster_exchange: ClusterFilter {
                name: METADATA_EXCHANGE.into(),
                typed_config: Some(tcp_exchange_config()),
                ..Default::default()
            },
        }
    }

    pub(super) fn of(&self, side: Side) -> &SideStats {
        match side {
            Side::SidecarOutbound => &self.outbound,
            Side::SidecarInbound => &self.inbound,
            Side::Gateway => &self.gateway,
        }
    }

    /// The upstream exchange of an outbound cluster (and the passthrough one).
    pub(super) fn cluster_filter(&self) -> ClusterFilter {
        self.cluster_exchange.clone()
    }
}

fn side(side: Side, plan: &MetricsPlan) -> SideStats {
    let inbound = side == Side::SidecarInbound;
    let overrides = match inbound {
        true => plan.server.as_ref(),
        false => plan.client.as_ref(),
    };
    let stats = overrides.map(|overrides| {
        typed_any(
            STATS_CONFIG,
            &PluginConfig {
                // The destination service is never taken from the Host header where the proxy
                // serves it.
                disable_host_header_fallback: side != Side::SidecarOutbound,
                tcp_reporting_duration: plan.reporting_interval.and_then(|d| d.try_into().ok()),
                metrics: overrides.iter().map(metric_config).collect(),
                ..Default::default()
            },
        )
    });
    let (discovery, propagation) = match inbound {
        true => ("downstream_discovery", "downstream_propagation"),
        false => ("upstream_discovery", "upstream_propagation"),
    };
    let istio_headers = || object(&[("istio_headers", object(&[]))]);
    let peer_metadata = Struct {
        fields: [
            (
                discovery.to_string(),
                list(vec![
                    istio_headers(),
                    object(&[("workload_discovery", object(&[]))]),
                ]),
            ),
            (propagation.to_string(), list(vec![istio_headers()])),
        ]
        .into(),
    };
    SideStats {
        http_exchange: http(
            METADATA_EXCHANGE,
            typed_struct(HTTP_PEER_METADATA, peer_metadata),
        ),
        http_stats: stats.clone().map(|s| http(STATS, s)),
        tcp_exchange: inbound.then(|| network(METADATA_EXCHANGE, tcp_exchange_config())),
        tcp_stats: stats.map(|s| network(STATS, s)),
    }
}

/// A metric's override: dropped, tags set (CEL values) or removed.
fn metric_config(o: &MetricOverride) -> MetricConfig {
    MetricConfig {
        name: o.name.clone(),
        drop: o.drop,
        dimensions: o
            .tags
            .iter()
            .filter_map(|(tag, value)| Some((tag.clone(), value.clone()?)))
            .collect(),
        tags_to_remove: o
            .tags
            .iter()
            .filter(|(_, value)| value.is_none())
            .map(|(tag, _)| tag.clone())
            .collect(),
        ..Default::default()
    }
}

/// A TCP chain with the side's stats filters, if any: `filters`, then `proxy`.
pub(super) fn tcp_chain(
    stats: Option<&SideStats>,
    filters: Vec<Filter>,
    proxy: Filter,
) -> Vec<Filter> {
    match stats {
        Some(stats) => stats.tcp_chain(filters, proxy),
        None => filters.into_iter().chain([proxy]).collect(),
    }
}

impl SideStats {
    /// The exchange first (before the security filters), the stats just before the router.
    pub(super) fn add_to(&self, hcm: &mut HttpConnectionManager) {
        let router = hcm.http_filters.len().saturating_sub(1);
        if let Some(stats) = &self.http_stats {
            hcm.http_filters.insert(router, stats.clone());
        }
        hcm.http_filters.insert(0, self.http_exchange.clone());
    }

    /// A TCP chain: the exchange (inbound), the chain's own filters, the stats, the proxy.
    pub(super) fn tcp_chain(&self, mut filters: Vec<Filter>, proxy: Filter) -> Vec<Filter> {
        if let Some(exchange) = &self.tcp_exchange {
            filters.insert(0, exchange.clone());
        }
        filters.extend(self.tcp_stats.clone());
        filters.push(proxy);
        filters
    }
}

fn tcp_exchange_config() -> Any {
    let config = Struct {
        fields: [
            ("protocol".to_string(), string(PEER_EXCHANGE)),
            (
                "enable_discovery".to_string(),
                Value {
                    kind: Some(Kind::BoolValue(true)),
                },
            ),
        ]
        .into(),
    };
    typed_struct(TCP_METADATA_EXCHANGE, config)
}

fn typed_struct(type_url: &str, value: Struct) -> Any {
    typed_any(
        TYPED_STRUCT,
        &TypedStruct {
            type_url: type_url.to_string(),
            value: Some(value),
        },
    )
}

fn typed_any(type_url: &str, message: &impl Message) -> Any {
    Any {
        type_url: type_url.to_string(),
        value: message.encode_to_vec(),
    }
}

fn http(name: &str, config: Any) -> HttpFilter {
    HttpFilter {
        name: name.to_string(),
        config_type: Some(http_filter::ConfigType::TypedConfig(config)),
        ..Default::default()
    }
}

fn network(name: &str, config: Any) -> Filter {
    Filter {
        name: name.to_string(),
        config_type: Some(filter::ConfigType::TypedConfig(config)),
    }
}

fn string(text: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(text.to_string())),
    }
}

fn object(fields: &[(&str, Value)]) -> Value {
    Value {
        kind: Some(Kind::StructValue(Struct {
            fields: fields
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
        })),
    }
}

fn list(values: Vec<Value>) -> Value {
    Value {
        kind: Some(Kind::ListValue(ListValue { values })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plugin(filter: &Option<HttpFilter>) -> PluginConfig {
        let filter = filter.as_ref().expect("a stats filter");
        let Some(http_filter::ConfigType::TypedConfig(any)) = &filter.config_type else {
            panic!("{filter:?}")
        };
        assert_eq!(any.type_url, STATS_CONFIG);
        PluginConfig::decode(&any.value[..]).unwrap()
    }

    #[test]
    fn the_stats_config_is_istiods_per_side() {
        let stats = &*DEFAULT_ISTIO_STATS;
        // istiod's own tests decode these: empty outbound, `MAE=` (field 6 true) elsewhere.
        let outbound = stats.of(Side::SidecarOutbound);
        assert!(plugin(&outbound.http_stats).encode_to_vec().is_empty());
        for side in [Side::SidecarInbound, Side::Gateway] {
            assert_eq!(
                plugin(&stats.of(side).http_stats).encode_to_vec(),
                [0x30, 0x01]
            );
        }
        assert!(outbound.tcp_exchange.is_none());
        assert!(stats.of(Side::SidecarInbound).tcp_exchange.is_some());
    }

    #[test]
    fn filters_take_istiods_places() {
        let stats = &*DEFAULT_ISTIO_STATS;
        let mut hcm = HttpConnectionManager {
            http_filters: ["envoy.filters.http.rbac", "envoy.filters.http.router"]
                .map(|name| HttpFilter {
                    name: name.into(),
                    ..Default::default()
                })
                .into(),
            ..Default::default()
        };
        stats.of(Side::SidecarInbound).add_to(&mut hcm);
        let names: Vec<&str> = hcm.http_filters.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(
            names,
            [
                METADATA_EXCHANGE,
                "envoy.filters.http.rbac",
                STATS,
                "envoy.filters.http.router"
            ]
        );
        let rbac = network("envoy.filters.network.rbac", Any::default());
        let proxy = network("envoy.filters.network.tcp_proxy", Any::default());
        let chain = stats.of(Side::SidecarInbound).tcp_chain(vec![rbac], proxy);
        let names: Vec<&str> = chain.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(
            names,
            [
                METADATA_EXCHANGE,
                "envoy.filters.network.rbac",
                STATS,
                "envoy.filters.network.tcp_proxy"
            ]
        );
    }
}
