//! The sidecar's route configurations: `<port>`, a virtual host per HTTP service on that port, with
//! the names Kubernetes clients use, routed as the VirtualServices for the host say, and a catch-all
//! as the outbound traffic policy says; and `<host>:<port>`, the one virtual host of a service whose
//! port is sniffed, for any name, as its addresses' HTTP chain asks (istiod's
//! `buildSidecarOutboundHTTPRouteConfig` and `getVirtualHostsForSniffedServicePort`,
//! pilot/pkg/networking/core/httproute.go).

use std::collections::HashSet;
use std::sync::Arc;

use envoy_types::pb::envoy::config::route::v3::route_action::{hash_policy, HashPolicy};
use envoy_types::pb::envoy::config::route::v3::{route, RouteConfiguration, VirtualHost};
use envoy_types::pb::google::protobuf::BoolValue;

use crate::istio::mesh::OutboundMode;
use crate::model::{Protocol, Service};
use crate::xds::generate::generation::Generation;
use crate::xds::generate::names::{outbound_cluster, parse_port, PASSTHROUGH};
use crate::xds::generate::policy::Effective;
use crate::xds::generate::routes::{
    answering_all, http_routes, virtual_host, DefaultRoute, RouteContext,
};
use crate::xds::generate::traits::{Trait, Traits};
use crate::xds::protocol::ResourceType;
use crate::xds::wire::Resource;

pub(super) fn build(g: &Generation<'_>, name: &str) -> Option<Arc<Resource>> {
    let (host, port) = match name.rsplit_once(':') {
        Some((host, port)) => (Some(host), parse_port(port)?),
        None => (None, parse_port(name)?),
    };
    // A host's route is its sniffed service's, found once.
    let service = host.map(|h| sniffed_service(g, h, port));
    let routes = || match &service {
        Some(service) => sniffed_routes(g, name, port, service.as_deref()),
        None => port_routes(g, name, port),
    };
    // The route of a port the proxy has no listener for, or of a host it has no sniffed service
    // of (a name it made up, or one its listener has just gone from), is answered as istiod does,
    // but not cached: such names are unbounded.
    let known = super::has_port_listener(g, port) && service.as_ref().is_none_or(Option::is_some);
    if !known {
        return g.finish(ResourceType::Route, Resource::encode(name, &routes()));
    }
    g.cached(
        ResourceType::Route,
        name,
        (ROUTE_READS, &()),
        [g.services_version(), 0, 0, g.config_version()],
        || Some(Resource::encode(name, &routes())),
    )
}

/// The service of this host whose port the proxy sniffs (and sees).
fn sniffed_service(g: &Generation<'_>, host: &str, port: u16) -> Option<Arc<Service>> {
    g.routable_services().into_iter().find(|s| {
        *s.hostname == *host
            && s.port(port)
                .is_some_and(|p| super::outbound::sniffed(s, p.protocol))
            && g.sees(s, port)
    })
}

/// What a sidecar's route configuration reads of the proxy: the services it sees (their short
/// names from its namespace, their addresses in its cluster or allocated ones), the rules and
/// routes that apply to it and the client matches of those routes.
const ROUTE_READS: Traits = Traits::of(&[
    Trait::Kind,
    Trait::Namespace,
    Trait::Cluster,
    Trait::Scope,
    Trait::Rules,
    Trait::Routes,
    Trait::SourceLabels,
    Trait::Allocated,
]);

fn port_routes(g: &Generation<'_>, name: &str, port: u16) -> RouteConfiguration {
    let mut virtual_hosts = virtual_hosts(g, port);
    virtual_hosts.push(catch_all(g.outbound_mode()));
    route_configuration(name, virtual_hosts)
}

/// The sniffed service's virtual host, for any name (the connection was for the service's
/// address, whatever its Host header says); no catch-all. istiod selects it among the port's
/// virtual hosts (`getVirtualHostsForSniffedServicePort`); only its own is built here.
fn sniffed_routes(
    g: &Generation<'_>,
    name: &str,
    port: u16,
    service: Option<&Service>,
) -> RouteConfiguration {
    let virtual_hosts = service.map(|s| service_vhost(g, s, port, vec!["*".to_string()]));
    route_configuration(name, virtual_hosts.into_iter().collect())
}

fn route_configuration(name: &str, virtual_hosts: Vec<VirtualHost>) -> RouteConfiguration {
    RouteConfiguration {
        name: name.to_string(),
        virtual_hosts,
        validate_clusters: Some(BoolValue { value: false }),
        ..Default::default()
    }
}

/// A virtual host per HTTP (or sniffed) service the proxy sees on the port.
fn virtual_hosts(g: &Generation<'_>, port: u16) -> Vec<VirtualHost> {
    let mut taken = HashSet::new();
    g.routable_services()
        .iter()
        .filter(|s| {
            let http = s
                .port(port)
                .is_some_and(|p| p.protocol.is_http() || super::outbound::sniffed(s, p.protocol));
            http && super::outbound::claims_port(s, Protocol::Http) && g.sees(s, port)
        })
        .filter_map(|s| {
            // Envoy rejects a domain listed twice; the first service keeps it.
            let domains: Vec<String> = domains(g, s, port)
                .into_iter()
                .filter(|d| taken.insert(d.clone()))
                .collect();
            (!domains.is_empty()).then(|| service_vhost(g, s, port, domains))
        })
        .collect()
}

/// A service's virtual host on the port: its default route, or its VirtualService's routes.
fn service_vhost(
    g: &Generation<'_>,
    service: &Service,
    port: u16,
    domains: Vec<String>,
) -> VirtualHost {
    let mut vhost = virtual_host(
        &format!("{}:{port}", service.hostname),
        domains,
        &outbound_cluster(port, &service.hostname),
        DefaultRoute::Outbound(g.mesh_config().default_http_retry_policy.as_ref()),
    );
    let ctx = RouteContext {
        g,
        port,
        gateway: None,
    };
    let mut routed = false;
    if let Some(routes) = g.mesh_routes(&service.hostname, g.egress_scope(port)) {
        let routes = http_routes(&ctx, &routes.http);
        if !routes.is_empty() {
            vhost.routes = routes;
            routed = true;
        }
    }
    set_hash_policy(g, service, port, &mut vhost, routed);
    vhost
}

/// The host names a client in the proxy's namespace may use: the FQDN, the short forms Kubernetes DNS
/// resolves (`name` only from the same namespace), and the VIPs, each with and without the port.
fn domains(g: &Generation<'_>, service: &Service, port: u16) -> Vec<String> {
    let host = service.hostname.to_string();
    let ns = &*service.namespace;
    let mut names = vec![host.clone()];
    if let Some(svc_prefix) = host.find(".svc.").map(|i| &host[..i + 4]) {
        names.push(format!("{}.{ns}", service.name));
        names.push(svc_prefix.to_string());
        if g.namespace() == ns {
            names.push(service.name.clone());
        }
    }
    names.extend(g.service_addresses(service).iter().map(|ip| ip.to_string()));
    names
        .iter()
        .flat_map(|n| [n.clone(), format!("{n}:{port}")])
        .collect()
}

/// Requests for hosts no virtual host claims: passed through (ALLOW_ANY, `allow_any`) or answered
/// 502 (REGISTRY_ONLY, `block_all`), as istiod.
fn catch_all(mode: OutboundMode) -> VirtualHost {
    match mode {
        OutboundMode::AllowAny => virtual_host(
            "allow_any",
            vec!["*".to_string()],
            PASSTHROUGH,
            DefaultRoute::Passthrough,
        ),
        OutboundMode::RegistryOnly => VirtualHost {
            include_request_attempt_count: true,
            ..answering_all("block_all", "block_all", 502)
        },
    }
}

/// A DestinationRule's consistent hash needs the route to say what to hash (istiod sets it on the
/// route to the cluster the rule applies to). A VirtualService's retries then stay on the hashed
/// host; the default route keeps istiod's default policy, host predicate included
/// (`ConvertPolicy`, pilot/pkg/networking/core/route/retry/retry.go).
fn set_hash_policy(
    g: &Generation<'_>,
    service: &Service,
    port: u16,
    vhost: &mut VirtualHost,
    from_virtual_service: bool,
) {
    let Some(rule) = g.destination_rule(service) else {
        return;
    };
    let Some(hash) = Effective::of(&rule.rule, None, port)
        .load_balancer
        .and_then(|lb| lb.consistent_hash)
    else {
        return;
    };
    let policy = if let Some(header) = &hash.http_header_name {
        hash_policy::PolicySpecifier::Header(hash_policy::Header {
            header_name: header.clone(),
            ..Default::default()
        })
    } else if let Some(cookie) = &hash.http_cookie {
        hash_policy::PolicySpecifier::Cookie(hash_policy::Cookie {
            name: cookie.name.clone(),
            path: cookie.path.clone(),
            ttl: cookie.ttl.map(|d| d.to_proto()),
            ..Default::default()
        })
    } else if let Some(parameter) = &hash.http_query_parameter_name {
        hash_policy::PolicySpecifier::QueryParameter(hash_policy::QueryParameter {
            name: parameter.clone(),
        })
    } else {
        hash_policy::PolicySpecifier::ConnectionProperties(hash_policy::ConnectionProperties {
            source_ip: true,
        })
    };
    for route in &mut vhost.routes {
        if let Some(route::Action::Route(action)) = &mut route.action {
            action.hash_policy = vec![HashPolicy {
                policy_specifier: Some(policy.clone()),
                ..Default::default()
            }];
            if let Some(retry) = action
                .retry_policy
                .as_mut()
                .filter(|_| from_virtual_service)
            {
                retry.retry_host_predicate.clear();
            }
        }
    }
}
