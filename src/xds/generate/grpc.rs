//! Proxyless gRPC clients (`GENERATOR=grpc`): an API listener and a route configuration per
//! service port they see, both named `<hostname>:<port>` (the target they dial), over the
//! services' outbound clusters.

use std::sync::Arc;

use envoy_types::pb::envoy::config::listener::v3::{ApiListener, Listener};
use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
use envoy_types::util::pack_any;

use super::clusters::{self, ClusterNeeds};
use super::filters::{hcm, rds};
use super::generation::Generation;
use super::names::{grpc_route_name, outbound_cluster, parse_port};
use super::routes::{virtual_host, DefaultRoute};
use super::traits::{Trait, Traits};
use crate::xds::protocol::ResourceType;
use crate::xds::wire::{Listing, Resource};

const NEEDS: ClusterNeeds = ClusterNeeds {
    sni: false,
    outbound: true,
    fixed: false,
};

/// What the list of a client's listeners reads: the services it sees.
const LISTENER_READS: Traits = Traits::of(&[Trait::Scope]);

/// Every cluster or listener, shared by clients with the same traits.
pub(super) fn all(g: &Generation<'_>, ty: ResourceType) -> Listing {
    match ty {
        ResourceType::Cluster => Listing::shared(clusters::list(g, &NEEDS)),
        ResourceType::Listener => Listing::shared(g.shared_listeners(LISTENER_READS, || {
            g.routable_services()
                .iter()
                .flat_map(|s| {
                    s.ports
                        .iter()
                        .filter(|p| g.sees(s, p.port))
                        .map(|p| grpc_route_name(&s.hostname, p.port))
                })
                .filter_map(|n| listener(g, &n))
                .collect()
        })),
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
        ResourceType::Cluster => clusters::build(g, name),
        ResourceType::Listener => listener(g, name),
        ResourceType::Route => {
            let (host, port) = target(g, name)?;
            g.cached(
                ResourceType::Route,
                name,
                (Traits::NONE, &()),
                [g.services_version(), 0, 0, 0],
                || Some(Resource::encode(name, &route_config(name, host, port))),
            )
        }
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

fn listener(g: &Generation<'_>, name: &str) -> Option<Arc<Resource>> {
    target(g, name)?;
    g.cached(
        ResourceType::Listener,
        name,
        (Traits::NONE, &()),
        [g.services_version(), 0, 0, 0],
        || Some(Resource::encode(name, &api_listener(name))),
    )
}

/// `<hostname>:<port>`, the name a client gives its listener and route, when that service port
/// exists.
fn target<'n>(g: &Generation<'_>, name: &'n str) -> Option<(&'n str, u16)> {
    let (host, port) = name.rsplit_once(':')?;
    let port = parse_port(port)?;
    g.service(host)?.port(port)?;
    Some((host, port))
}

/// An API listener whose routes come over RDS.
fn api_listener(name: &str) -> Listener {
    Listener {
        name: name.to_string(),
        api_listener: Some(ApiListener {
            // A gRPC library writes no Envoy access log.
            api_listener: Some(pack_any(hcm(name, rds(name), &[]))),
        }),
        ..Default::default()
    }
}

fn route_config(name: &str, host: &str, port: u16) -> RouteConfiguration {
    let domains = vec![name.to_string(), host.to_string()];
    RouteConfiguration {
        name: name.to_string(),
        virtual_hosts: vec![virtual_host(
            name,
            domains,
            &outbound_cluster(port, host),
            // Istio's default retries, as before; gRPC libraries apply only their own.
            DefaultRoute::Outbound(None),
        )],
        ..Default::default()
    }
}
