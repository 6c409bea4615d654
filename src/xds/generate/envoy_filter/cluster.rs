//! Patches to a cluster (pilot/pkg/networking/core/envoyfilter/cluster_patch.go): matched by name,
//! or by the port, subset and service its Istio name (`<direction>|<port>|<subset>|<host>`)
//! carries; merged into or removed. ADDed clusters are listed beside the generated ones.

use envoy_types::pb::envoy::config::cluster::v3::Cluster;

use super::ops::merge_into;
use super::{PatchRef, Patched, ProxyPatches};
use crate::istio::envoy_filter::{ApplyTo, Operation, PatchContext};
use crate::xds::generate::names::parse_port;

/// Applies the proxy's patches to `cluster`; false when a patch removes it.
pub(super) fn patch(
    target: &Patched<'_>,
    patches: &ProxyPatches,
    context: PatchContext,
    cluster: &mut Cluster,
) -> bool {
    let name = cluster.name.clone();
    let parts = Parts::of(&name);
    for p in patches.of(ApplyTo::Cluster) {
        if !p.in_context(context) || !matches(target, &p, &name, &parts) {
            continue;
        }
        match p.operation() {
            Operation::Remove => return false,
            op if op.merges() => {
                merge_into(&p, cluster, &name);
            }
            _ => {}
        }
    }
    true
}

/// What an Istio cluster name says: its direction, port, subset and host (empty for inbound
/// clusters and Istio's fixed ones).
struct Parts<'a> {
    inbound: bool,
    port: u32,
    subset: &'a str,
    host: &'a str,
}

impl<'a> Parts<'a> {
    fn of(name: &'a str) -> Self {
        let fields: Vec<&str> = name.split('|').collect();
        match fields[..] {
            [direction, port, subset, host] => Parts {
                inbound: direction == "inbound",
                port: parse_port(port).map_or(0, u32::from),
                subset,
                host,
            },
            _ => Parts {
                inbound: false,
                port: 0,
                subset: "",
                host: "",
            },
        }
    }
}

/// istiod's `clusterMatch`: a name decides alone; else the port, subset and service must be the
/// cluster's (an inbound cluster's service is one of the proxy's own workload's).
fn matches(target: &Patched<'_>, p: &PatchRef<'_>, name: &str, parts: &Parts<'_>) -> bool {
    let Some(m) = p.patch.matches.as_ref().and_then(|m| m.cluster.as_ref()) else {
        return true;
    };
    if !m.name.is_empty() {
        return m.name == name;
    }
    let service = m.service.is_empty()
        || match parts.inbound {
            false => parts.host == m.service,
            true => (target.own_addresses)().iter().any(|ip| {
                target
                    .mesh
                    .endpoints
                    .services_at(ip)
                    .iter()
                    .any(|key| *key.hostname == *m.service)
            }),
        };
    service
        && (m.port_number == 0 || m.port_number == parts.port)
        && (m.subset.is_empty() || m.subset == parts.subset)
}
