//! A sidecar's configuration, laid out as Istio's so iptables-captured traffic works:
//! - outbound: `virtualOutbound` on the mesh's `proxyListenPort` (15001) hands connections, by
//!   original destination, to per-port listeners `0.0.0.0_<port>` that are not bound themselves —
//!   HTTP by sniffing via RDS route `<port>`, TCP services matched by VIP or SNI — over the
//!   clusters of the services it sees and Istio's fixed ones;
//! - inbound: `virtualInbound` on the mesh's `proxyInboundListenPort` (15006), filter chains per
//!   port of the proxy's own workload, to one `inbound|<port>||` cluster each, and passthrough
//!   chains for every other port.

mod inbound;
mod inbound_chains;
mod outbound;
mod route_config;
mod tls_routes;

use std::collections::BTreeSet;
use std::sync::Arc;

use super::clusters::{self, ClusterNeeds};
use super::generation::Generation;
use super::names::{parse_port, port_listener_name, VIRTUAL_INBOUND, VIRTUAL_OUTBOUND};
use super::traits::{Trait, Traits};
use crate::xds::protocol::ResourceType;
use crate::xds::wire::{Listing, Resource, SharedList};

const NEEDS: ClusterNeeds = ClusterNeeds {
    sni: false,
    outbound: true,
    fixed: true,
};

/// Every cluster or listener: those shared by sidecars with the same traits, then the proxy's own
/// (its inbound clusters, `virtualInbound`).
pub(super) fn all(g: &Generation<'_>, ty: ResourceType) -> Listing {
    match ty {
        ResourceType::Cluster => Listing {
            shared: Some(clusters::list(g, &NEEDS)),
            own: inbound::cluster_names(g)
                .iter()
                .filter_map(|n| inbound::cluster(g, n))
                .collect(),
        },
        ResourceType::Listener => Listing {
            shared: Some(listeners(g)),
            own: inbound::virtual_inbound(g).into_iter().collect(),
        },
        ResourceType::Endpoint
        | ResourceType::Route
        | ResourceType::Secret
        | ResourceType::NameTable
        | ResourceType::ProxyConfig
        | ResourceType::ExtensionConfig
        | ResourceType::Address
        | ResourceType::Authorization
        | ResourceType::Config(..) => Listing::default(),
    }
}

pub(super) fn build(g: &Generation<'_>, ty: ResourceType, name: &str) -> Option<Arc<Resource>> {
    match ty {
        ResourceType::Cluster => clusters::build(g, name).or_else(|| inbound::cluster(g, name)),
        ResourceType::Listener => listener(g, name),
        ResourceType::Route => route_config::build(g, name),
        ResourceType::Endpoint
        | ResourceType::Secret
        | ResourceType::NameTable
        | ResourceType::ProxyConfig
        | ResourceType::ExtensionConfig
        | ResourceType::Address
        | ResourceType::Authorization
        | ResourceType::Config(..) => None,
    }
}

/// What `virtualOutbound` reads of the proxy.
const VIRTUAL_OUTBOUND_READS: Traits =
    Traits::of(&[Trait::Kind, Trait::Scope, Trait::Telemetry, Trait::Tracing]);

/// What a port's outbound listener reads of the proxy: the services it sees, by the addresses of
/// its cluster (or allocated ones), the rules and routes that apply, a headless service's pods
/// on its network but itself, its telemetry and plugins.
const PORT_LISTENER_READS: Traits = Traits::of(&[
    Trait::Kind,
    Trait::Cluster,
    Trait::Network,
    Trait::Scope,
    Trait::Rules,
    Trait::Routes,
    Trait::SourceLabels,
    Trait::Allocated,
    Trait::PodOfHeadless,
    Trait::Telemetry,
    Trait::Tracing,
    Trait::Plugins,
]);

/// The listeners every sidecar with the same traits (and cluster) shares: `virtualOutbound` and
/// one per port of the services it sees. Assembled once per snapshot version.
fn listeners(g: &Generation<'_>) -> Arc<SharedList> {
    let reads = VIRTUAL_OUTBOUND_READS.with(PORT_LISTENER_READS);
    g.shared_listeners(reads, || {
        let ports: BTreeSet<u16> = g
            .routable_services()
            .iter()
            .flat_map(|s| {
                (s.ports.iter())
                    .filter(|p| outbound::claims_port(s, p.protocol) && g.sees(s, p.port))
                    .map(|p| p.port)
            })
            .collect();
        std::iter::once(VIRTUAL_OUTBOUND.to_string())
            .chain(ports.iter().map(|p| port_listener_name(*p)))
            .filter_map(|n| listener(g, &n))
            .collect()
    })
}

fn listener(g: &Generation<'_>, name: &str) -> Option<Arc<Resource>> {
    match name {
        VIRTUAL_OUTBOUND => g.cached(
            ResourceType::Listener,
            name,
            (VIRTUAL_OUTBOUND_READS, &()),
            // Its logs may name a log service's cluster, which follows the services.
            [g.services_version(), 0, 0, g.config_version()],
            || {
                let listener = outbound::virtual_outbound(g);
                Some(Resource::encode(name, &listener))
            },
        ),
        VIRTUAL_INBOUND => inbound::virtual_inbound(g),
        _ => {
            let port = parse_port(name.strip_prefix("0.0.0.0_")?)?;
            // Headless services' pods are matched by address: their endpoints stamp it.
            g.cached(
                ResourceType::Listener,
                name,
                (PORT_LISTENER_READS, &()),
                [
                    g.services_version(),
                    g.mesh.pods_version,
                    0,
                    g.config_version(),
                ],
                || outbound::port_listener(g, name, port).map(|l| Resource::encode(name, &l)),
            )
        }
    }
}

/// Whether the proxy has the listener that names route `<port>`.
fn has_port_listener(g: &Generation<'_>, port: u16) -> bool {
    let listener = port_listener_name(port);
    listeners(g).resources.iter().any(|l| *l.name == *listener)
}
