//! Ambient mode's Envoy proxies (node type `waypoint`), named as istiod names theirs
//! (pilot/pkg/networking/core/{listener_waypoint,cluster_waypoint,waypoint}.go):
//! - a **waypoint** takes the HBONE tunnels ztunnel opens to the services and workloads that use
//!   it (`istio.io/use-waypoint`) and proxies each to the service's endpoints (or the workload):
//!   directly, or through `connect_originate` (HBONE again, to the endpoint's ztunnel) for pods
//!   ztunnel captures;
//! - an **east-west gateway** takes other networks' double-HBONE tunnels to its network's services
//!   and forwards the inner tunnel untouched through `forward_inner_connect` to an endpoint's
//!   ztunnel, or to the service's waypoint, on 15008.
//!
//! Both terminate mTLS and HTTP/2 CONNECT on `connect_terminate` (15008). A tunnel is routed by its
//! `:authority`: `<VIP>:<port>` as ztunnel sends it to a waypoint, `<hostname>:<port>` as it sends
//! it through an east-west gateway. At an east-west gateway it goes to the port's
//! `inbound-vip|<port>|tcp|<host>`. At a waypoint it goes to the internal listener
//! `main_internal|<port>|<host>`, which enforces the AuthorizationPolicies targeting the waypoint
//! (the peer's identity shared from the tunnel's end) and, for an HTTP port, applies the host's
//! routes, sending to `inbound-vip|<port>|<tcp|http>|<host>` (the endpoints) or a route's other
//! destinations. istiod passes every tunnel
//! through one internal listener (`main_internal`) matching the destination restored from the
//! authority; routing by authority in `connect_terminate` serves the same names without restoring
//! addresses, and hostname authorities (double HBONE) alike.

mod clusters;
mod listeners;

use std::net::IpAddr;
use std::sync::Arc;

use envoy_types::pb::envoy::config::route::v3::{route, route_action, Route};

use super::generation::Generation;
use super::names::{inbound_vip_cluster, parse_outbound};
use super::routes::{self, virtual_host, DefaultRoute, RouteContext};
use crate::istio::gateway_api::GATEWAY_NAME_LABEL;
use crate::model::waypoints::WaypointClass;
use crate::model::{Health, Protocol, Service, ServicePort, Waypoint};
use crate::xds::protocol::ResourceType;
use crate::xds::wire::{Listing, Resource};

pub(super) use clusters::endpoints;

/// What one waypoint proxy serves.
struct Served {
    waypoint: Arc<Waypoint>,
    /// The services it takes tunnels to, sorted by hostname; each with its ports (not UDP).
    services: Vec<(Arc<Service>, Vec<ServicePort>)>,
    /// The network whose endpoints it reaches.
    network: Arc<str>,
    /// A waypoint's workloads (those using it for traffic addressed to them), by address, and
    /// whether ztunnel captures them.
    workloads: Vec<(IpAddr, bool)>,
}

impl Served {
    fn east_west(&self) -> bool {
        self.waypoint.class == WaypointClass::EastWest
    }

    /// Whether a port's tunnels are processed as HTTP (else as TCP) behind an internal listener:
    /// a waypoint's HTTP ports. An east-west gateway passes every tunnel on as it is.
    fn http(&self, port: &ServicePort) -> bool {
        !self.east_west() && port.protocol.is_http()
    }

    /// Whether it processes HTTP for this port of this host (its `inbound-vip|…|http|…` exists).
    fn serves_http(&self, host: &str, port: u16) -> bool {
        let mut ports = self.services.iter().filter(|(s, _)| *s.hostname == *host);
        ports.any(|(_, ports)| ports.iter().any(|p| p.port == port && self.http(p)))
    }
}

/// A served HTTP port's routes: the VirtualServices (and HTTPRoutes) of its host as the waypoint's
/// namespace sees them, else everything to the service; a destination the waypoint serves is
/// reached at its endpoints (`inbound-vip|<port>|http|<host>`), any other through its outbound
/// cluster, as istiod's `getWaypointDestinationCluster`.
fn http_routes(g: &Generation<'_>, served: &Served, service: &Service, port: u16) -> Vec<Route> {
    let own = inbound_vip_cluster(port, "http", &service.hostname);
    let mut routes = virtual_host(
        "default",
        Vec::new(),
        &own,
        DefaultRoute::Outbound(g.mesh_config().default_http_retry_policy.as_ref()),
    )
    .routes;
    let ctx = RouteContext {
        g,
        port,
        gateway: None,
    };
    if let Some(host_routes) = g.mesh_routes(&service.hostname, None) {
        let built = routes::http_routes(&ctx, &host_routes.http);
        if !built.is_empty() {
            routes = built;
        }
    }
    for route in &mut routes {
        for cluster in destinations(route) {
            let parsed = parse_outbound(cluster).filter(|c| c.subset.is_empty());
            if let Some(c) = parsed.filter(|c| served.serves_http(c.host, c.port)) {
                *cluster = inbound_vip_cluster(c.port, "http", c.host);
            }
        }
    }
    routes
}

/// The clusters a route sends to.
fn destinations(route: &mut Route) -> Vec<&mut String> {
    let Some(route::Action::Route(action)) = &mut route.action else {
        return Vec::new();
    };
    match &mut action.cluster_specifier {
        Some(route_action::ClusterSpecifier::Cluster(name)) => vec![name],
        Some(route_action::ClusterSpecifier::WeightedClusters(weighted)) => {
            weighted.clusters.iter_mut().map(|c| &mut c.name).collect()
        }
        _ => Vec::new(),
    }
}

pub(super) fn all(g: &Generation<'_>, ty: ResourceType) -> Listing {
    let Some(served) = served(g) else {
        return Listing::default();
    };
    match ty {
        ResourceType::Cluster => Listing::own(clusters::all(g, &served)),
        ResourceType::Listener => Listing::own(listeners::all(g, &served)),
        _ => Listing::default(),
    }
}

/// One listener or cluster (a waypoint has few: they are built together).
pub(super) fn build(g: &Generation<'_>, ty: ResourceType, name: &str) -> Option<Arc<Resource>> {
    let listing = all(g, ty);
    listing.own.into_iter().find(|r| *r.name == *name)
}

/// The proxy's Gateway (its pod's `gateway.networking.k8s.io/gateway-name`, in its namespace) and
/// what it serves; none when that Gateway is no accepted ambient one.
fn served(g: &Generation<'_>) -> Option<Served> {
    let mut served = gateway(g)?;
    let all = g.mesh.services.all();
    let services = all.iter().filter(|s| served.takes(g, s));
    served.services = services.map(|s| (s.clone(), ports(s))).collect();
    if served.waypoint.class == WaypointClass::Waypoint {
        let mut workloads: Vec<(IpAddr, bool)> = (g.mesh.workloads.iter())
            .filter(|w| *w.network == *served.network)
            .filter(|w| {
                let waypoint = g.mesh.workload_waypoint(w);
                waypoint.is_some_and(|wp| Arc::ptr_eq(wp, &served.waypoint))
            })
            .flat_map(|w| w.addresses.iter().map(|ip| (*ip, w.captured)))
            .collect();
        workloads.sort();
        workloads.dedup_by_key(|(ip, _)| *ip);
        served.workloads = workloads;
    }
    Some(served)
}

/// The proxy's Gateway and network, serving nothing yet.
fn gateway(g: &Generation<'_>) -> Option<Served> {
    let name = g.labels().get(GATEWAY_NAME_LABEL)?;
    let gateway_api = g.mesh.config.gateway_api();
    let waypoint = gateway_api.waypoint(g.namespace(), name)?.clone();
    let network: Arc<str> = match &waypoint.network {
        Some(network) => network.as_str().into(),
        None => g.node_network().into(),
    };
    Some(Served {
        waypoint,
        services: Vec::new(),
        network,
        workloads: Vec::new(),
    })
}

/// A service's ports tunnels carry (not UDP).
fn ports(service: &Service) -> Vec<ServicePort> {
    let ports = service.ports.iter().filter(|p| p.protocol != Protocol::Udp);
    ports.cloned().collect()
}

impl Served {
    /// Whether it takes tunnels to `service`: a waypoint, those of the services using it; an
    /// east-west gateway, those of its network's.
    fn takes(&self, g: &Generation<'_>, service: &Service) -> bool {
        match self.waypoint.class {
            WaypointClass::Waypoint => g
                .mesh
                .service_waypoint(service)
                .is_some_and(|w| Arc::ptr_eq(w, &self.waypoint)),
            WaypointClass::EastWest => reached_through(g, service, &self.network),
        }
    }
}

/// Whether an east-west gateway of `network` takes tunnels to a service: it has healthy endpoints
/// there and is no gateway's or waypoint's own (those are how traffic enters, not destinations).
fn reached_through(g: &Generation<'_>, service: &Service, network: &str) -> bool {
    let gateways = g.mesh.gateways.by_network.values().flatten();
    if gateways
        .clone()
        .any(|gw| gw.service.as_ref() == Some(&service.hostname))
    {
        return false;
    }
    if g.mesh
        .config
        .gateway_api()
        .is_waypoint_host(&service.hostname)
    {
        return false;
    }
    let Some(shards) = g.mesh.endpoints.get(&service.key()) else {
        return false;
    };
    let mut endpoints = shards.endpoints();
    endpoints.any(|e| *e.network == *network && e.health == Health::Healthy)
}
