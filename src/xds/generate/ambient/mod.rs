//! Ambient mode's generator: what ztunnel asks for, over Delta xDS only. Its workloads and services
//! (`istio.workload.Address`) and its AuthorizationPolicies (`istio.security.Authorization`) are
//! the same for every ztunnel of a network, so each list is built once per snapshot and network
//! and shared. docs/ambient.md.

mod addresses;
mod authorization;

use std::collections::BTreeSet;
use std::sync::Arc;

use super::generation::Generation;
use crate::xds::protocol::ResourceType;
use crate::xds::proxy::ProxyType;
use crate::xds::wire::{Listing, Resource};

/// Every resource of the type for a wildcard subscription; nothing for proxies that are not ztunnel.
pub(super) fn all(g: &Generation<'_>, ty: ResourceType) -> Listing {
    match shared(g, ty) {
        Some(list) => Listing::shared(list),
        None => Listing::default(),
    }
}

/// The resources answering names a ztunnel looked up on demand: an address's uid, `<network>/<ip>`
/// (the workload holding the address, else the service whose VIP it is) or `<namespace>/<hostname>`
/// (the service and the workloads behind it), as istiod resolves them. Each resource once.
pub(super) fn named<'n>(
    g: &Generation<'_>,
    ty: ResourceType,
    names: impl IntoIterator<Item = &'n String>,
) -> Vec<Arc<Resource>> {
    let Some(list) = shared(g, ty) else {
        return Vec::new();
    };
    let mut seen = BTreeSet::new();
    let mut found = Vec::new();
    for name in names {
        let matches: Vec<&Arc<Resource>> = match ty {
            ResourceType::Address => addresses::lookup(g, &list.resources, name),
            _ => list
                .resources
                .iter()
                .filter(|r| *r.name == **name)
                .collect(),
        };
        for resource in matches {
            if seen.insert(resource.name.clone()) {
                found.push(resource.clone());
            }
        }
    }
    found
}

fn shared(g: &Generation<'_>, ty: ResourceType) -> Option<Arc<crate::xds::wire::SharedList>> {
    if g.proxy.kind != ProxyType::Ztunnel {
        return None;
    }
    let network = network(g);
    let stamp = [g.mesh.version, 0, 0, 0];
    let build = || match ty {
        ResourceType::Address => addresses::build(g.mesh, &network),
        _ => authorization::build(g.mesh),
    };
    match ty {
        ResourceType::Address => Some(g.cache.list(ty, g.variant_of(&network), stamp, build)),
        ResourceType::Authorization => Some(g.cache.list(ty, 0, stamp, build)),
        _ => None,
    }
}

/// The ztunnel's network: as its node says (ztunnel sends no NETWORK, its proxy metadata may),
/// else that of its own pod (by address), else its cluster's.
fn network(g: &Generation<'_>) -> String {
    if !g.proxy.network.is_empty() {
        return g.proxy.network.to_string();
    }
    let own = g.mesh.workloads.iter().find(|w| {
        g.proxy
            .cluster_id
            .as_ref()
            .is_none_or(|c| *c == w.cluster_id)
            && w.addresses.iter().any(|ip| g.proxy.ips.contains(ip))
    });
    match (own, &g.proxy.cluster_id) {
        (Some(pod), _) => pod.network.to_string(),
        (None, Some(cluster)) => addresses::cluster_networks(g.mesh).of(cluster.as_str()),
        (None, None) => String::new(),
    }
}
