//! Clusters' stat names from the mesh's `inboundClusterStatName` / `outboundClusterStatName`
//! patterns (istiod's `BuildStatPrefix`, pilot/pkg/networking/telemetry/telemetry.go): Istio's
//! dashboards read the clusters' stats under these names.

use crate::istio::mesh_traffic::{stat_name, StatNameParts};
use crate::model::{Registry, Service};

/// The service's port as the patterns read it; None where no pattern is set.
pub(super) fn of(
    pattern: &str,
    service: &Service,
    subset: &str,
    port: u16,
    target_port: u16,
) -> Option<String> {
    if pattern.is_empty() {
        return None;
    }
    let port_name = service.port(port).map_or("", |p| p.name.as_str());
    let parts = StatNameParts {
        hostname: &service.hostname,
        kubernetes: (service.registry == Registry::Kubernetes)
            .then_some((service.name.as_str(), &*service.namespace)),
        subset,
        port,
        port_name,
        target_port,
    };
    Some(stat_name(pattern, &parts))
}

/// A cluster's `alt_stat_name`: the name and istiod's delimiter (`util.DelimitedStatsPrefix`), so
/// Envoy's stat tag extraction ends the cluster name there.
pub(super) fn delimited(name: String) -> String {
    name + ";"
}
