//! Small Envoy values every generator uses: the ADS config source, socket addresses, durations.

use envoy_types::pb::envoy::config::core::v3::{
    address, config_source, socket_address, Address, AggregatedConfigSource, ApiVersion,
    ConfigSource, SocketAddress,
};
use envoy_types::pb::google::protobuf::Duration;

/// Resources referenced by name arrive over the same ADS stream.
pub(super) fn ads() -> ConfigSource {
    ConfigSource {
        config_source_specifier: Some(config_source::ConfigSourceSpecifier::Ads(
            AggregatedConfigSource {},
        )),
        resource_api_version: ApiVersion::V3 as i32,
        ..Default::default()
    }
}

/// Resources a cluster or listener cannot work without (EDS, RDS): waited for however long they
/// take, not given up on after Envoy's default 15 s (istiod's `initial_fetch_timeout: 0s`,
/// `maybeApplyEdsConfig` in cluster_builder.go). Secrets are not: a missing credential must not
/// hold up its listener.
pub(super) fn ads_awaited() -> ConfigSource {
    ConfigSource {
        initial_fetch_timeout: Some(Duration::default()),
        ..ads()
    }
}

pub(super) fn socket(ip: &str, port: u16) -> Address {
    Address {
        address: Some(address::Address::SocketAddress(SocketAddress {
            address: ip.to_string(),
            port_specifier: Some(socket_address::PortSpecifier::PortValue(u32::from(port))),
            ..Default::default()
        })),
    }
}

pub(super) fn seconds(s: i64) -> Duration {
    Duration {
        seconds: s,
        nanos: 0,
    }
}
