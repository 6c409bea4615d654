//! Ambient mode's generator: what ztunnel asks for, over Delta xDS only. Its workloads and services
//! (`istio.workload.Address`) and its AuthorizationPolicies (`istio.security.Authorization`) are
//! the same for every ztunnel of a network, so each whole list is built once per snapshot and
//! network and shared; a change that names what it touched rebuilds only that. docs/ambient.md.

mod addresses;
mod authorization;
mod waypoint_refs;

use std::collections::BTreeSet;
use std::sync::Arc;

use super::generation::Generation;
use super::traits::Traits;
use crate::istio::ConfigKind;
use crate::model::{Change, MeshSnapshot};
use crate::xds::protocol::{ResourceType, Scope};
use crate::xds::proxy::ProxyType;
use crate::xds::wire::{Listing, Resource, SharedList};
use addresses::{network_gateway_uid, service_name, split_horizon_uid, Addresses};

/// Every resource of the type for a wildcard subscription; nothing for proxies that are not ztunnel.
pub(super) fn all(g: &Generation<'_>, ty: ResourceType) -> Listing {
    if g.proxy_type() != ProxyType::Ztunnel {
        return Listing::default();
    }
    let network = g.node_network();
    let stamp = [g.mesh.version, 0, 0, 0];
    let list = match ty {
        ResourceType::Address => g.cached_list(ty, (Traits::NONE, &network), stamp, || {
            Addresses::new(g.mesh, &network).all()
        }),
        ResourceType::Authorization => g.cached_list(ty, (Traits::NONE, &()), stamp, || {
            authorization::build(g.mesh)
        }),
        _ => Arc::new(SharedList::default()),
    };
    Listing::shared(list)
}

/// The Addresses of these exact names that exist for the ztunnel (what a change touched).
pub(super) fn changed<'n>(
    g: &Generation<'_>,
    names: impl IntoIterator<Item = &'n String>,
) -> Vec<Arc<Resource>> {
    if g.proxy_type() != ProxyType::Ztunnel {
        return Vec::new();
    }
    let network = g.node_network();
    let addresses = Addresses::new(g.mesh, &network);
    names.into_iter().filter_map(|n| addresses.one(n)).collect()
}

/// The resources answering names a ztunnel asked for: Authorizations by name; Addresses looked up
/// on demand by an address's uid, `<network>/<ip>` (the workload holding the address, else the
/// service whose VIP it is) or `<namespace>/<hostname>` (the service and the workloads behind it),
/// as istiod resolves them. Each resource once.
pub(super) fn named<'n>(
    g: &Generation<'_>,
    ty: ResourceType,
    names: impl IntoIterator<Item = &'n String>,
) -> Vec<Arc<Resource>> {
    if ty == ResourceType::Authorization {
        let names: BTreeSet<&str> = names.into_iter().map(String::as_str).collect();
        let listed = all(g, ty)
            .shared
            .into_iter()
            .flat_map(|l| l.resources.clone());
        return listed.filter(|r| names.contains(&*r.name)).collect();
    }
    if g.proxy_type() != ProxyType::Ztunnel {
        return Vec::new();
    }
    let network = g.node_network();
    let addresses = Addresses::new(g.mesh, &network);
    let mut seen = BTreeSet::new();
    let found = names.into_iter().flat_map(|name| addresses.lookup(name));
    found.filter(|r| seen.insert(r.name.clone())).collect()
}

/// The kinds of config an Address reads: policies name the workloads they select, entries are
/// workloads and services, Gateways of the ambient classes are waypoints.
const ADDRESS_KINDS: [ConfigKind; 6] = [
    ConfigKind::AuthorizationPolicy,
    ConfigKind::GatewayClass,
    ConfigKind::KubernetesGateway,
    ConfigKind::PeerAuthentication,
    ConfigKind::ServiceEntry,
    ConfigKind::WorkloadEntry,
];

/// Which Addresses a change may have moved, for every ztunnel: all of them after a full change
/// (but one of config no Address reads); else the workloads it names, and the services whose
/// endpoints moved with their split-horizon workloads (under every gateway; a ztunnel of that
/// network has none, which removes it).
pub fn address_scope(mesh: &MeshSnapshot, change: &Change) -> Option<Scope> {
    let other_config = !change.configs.is_empty()
        && !change
            .configs
            .iter()
            .any(|k| ADDRESS_KINDS.contains(&k.kind));
    if change.full && !other_config {
        return Some(Scope::All);
    }
    let mut names: BTreeSet<String> = change.workloads.iter().map(|u| u.to_string()).collect();
    for host in &change.services {
        let Some(service) = mesh.services.get(host) else {
            continue;
        };
        names.insert(service_name(service));
        let key = service.key();
        for (network, gateways) in &mesh.gateways.by_network {
            for gateway in gateways {
                names.insert(split_horizon_uid(network, &gateway.address, &key));
                // A gateway's own pods (its identity) are its Service's endpoints.
                if gateway.service.as_ref() == Some(host) {
                    names.insert(network_gateway_uid(gateway));
                }
            }
        }
    }
    (!names.is_empty()).then_some(Scope::Names(names))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::istio::ConfigKey;

    fn config_change(kind: ConfigKind) -> Change {
        let key = ConfigKey {
            kind,
            namespace: "shop".into(),
            name: "x".into(),
        };
        Change {
            configs: [key].into(),
            ..Change::full()
        }
    }

    #[test]
    fn a_change_moves_what_it_names_and_config_only_what_addresses_read() {
        let mesh = MeshSnapshot::default();
        assert_eq!(address_scope(&mesh, &Change::full()), Some(Scope::All));
        let routing = config_change(ConfigKind::VirtualService);
        assert_eq!(
            address_scope(&mesh, &routing),
            None,
            "routing is for waypoints"
        );
        let policy = config_change(ConfigKind::AuthorizationPolicy);
        assert_eq!(address_scope(&mesh, &policy), Some(Scope::All));
        let pod = Change {
            workloads: [Arc::from("c1//Pod/shop/web-1")].into(),
            ..Change::default()
        };
        let names = BTreeSet::from(["c1//Pod/shop/web-1".to_string()]);
        assert_eq!(address_scope(&mesh, &pod), Some(Scope::Names(names)));
        assert_eq!(address_scope(&mesh, &Change::default()), None);
    }
}
