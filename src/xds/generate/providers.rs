//! Where a mesh config extension provider sends (access log services, tracers): its service's
//! outbound cluster and host, as istiod's `LookupCluster` finds them — the service
//! (`[<namespace>/]<host>`) must be in the mesh — and a gRPC service to it.

use std::collections::BTreeSet;
use std::sync::LazyLock;

use envoy_types::pb::envoy::config::core::v3::{grpc_service, GrpcService};
use parking_lot::Mutex;
use tracing::warn;

use super::names::outbound_cluster;
use crate::istio::extension_provider::split_service;
use crate::model::ServiceTable;

/// The cluster and host of a provider's `service` on `port`, or why there is none.
pub(super) fn cluster_of(
    services: &ServiceTable,
    service: &str,
    port: u32,
) -> Result<(String, String), String> {
    let (namespace, host) = split_service(service);
    let found = services
        .get(host)
        .filter(|s| namespace.is_none_or(|ns| *s.namespace == *ns))
        .ok_or_else(|| format!("service {service:?} is not in the mesh"))?;
    let port = u16::try_from(port).map_err(|_| format!("port {port} is not a port"))?;
    Ok((
        outbound_cluster(port, &found.hostname),
        found.hostname.to_string(),
    ))
}

/// Distinct reports kept before the record starts over.
const REPORTS_KEPT: usize = 256;

/// Reports a provider meshpilot cannot build, once per use, provider and reason: resources are
/// generated per proxy and push, and the same reason would otherwise be logged for each of them.
pub(super) fn report_unbuilt(used_for: &str, provider: &str, why: &str) {
    static REPORTED: LazyLock<Mutex<BTreeSet<String>>> = LazyLock::new(Mutex::default);
    let key = format!("{used_for}\n{provider}\n{why}");
    let first = {
        let mut reported = REPORTED.lock();
        if reported.len() >= REPORTS_KEPT {
            reported.clear();
        }
        reported.insert(key)
    };
    if first {
        warn!(
            provider,
            "{used_for} not configured for this provider: {why}"
        );
    }
}

/// Envoy's own gRPC client to a cluster, with the host as authority.
pub(super) fn envoy_grpc(cluster: String, authority: String) -> GrpcService {
    GrpcService {
        target_specifier: Some(grpc_service::TargetSpecifier::EnvoyGrpc(
            grpc_service::EnvoyGrpc {
                cluster_name: cluster,
                authority,
                ..Default::default()
            },
        )),
        ..Default::default()
    }
}
