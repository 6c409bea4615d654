//! Patches to a route configuration (RDS, or inline in an inbound connection manager), in istiod's
//! stages (pilot/pkg/networking/core/envoyfilter/rc_patch.go): the configuration, its virtual
//! hosts, then the routes of each virtual host it generated.

use envoy_types::pb::envoy::config::route::v3::{route, Route, RouteConfiguration, VirtualHost};

use super::ops::{merge_into, ListPatch};
use super::{PatchRef, ProxyPatches};
use crate::istio::envoy_filter::{
    ApplyTo, Operation, PatchContext, RouteAction, RouteConfigurationMatch,
};
use crate::xds::generate::names::parse_port;

/// What a route configuration's name says of it: sidecars' are their port (`8080`, or
/// `inbound|8080||` inline), gateways' `http.<port>` or `https.<port>.<port name>.<gateway>.<ns>`.
pub(super) struct Names {
    name: String,
    port: u32,
    port_name: String,
    /// `<namespace>/<name>` of the Gateway of an HTTPS server's routes.
    gateway: String,
}

impl Names {
    pub(super) fn of(name: &str) -> Self {
        let mut out = Names {
            name: name.to_string(),
            port: 0,
            port_name: String::new(),
            gateway: String::new(),
        };
        let parts: Vec<&str> = name.split('.').collect();
        let port = |text: &str| parse_port(text).map_or(0, u32::from);
        if let Some(rest) = name.strip_prefix("inbound|") {
            out.port = port(rest.split('|').next().unwrap_or_default());
        } else if let ["http", p] = parts[..] {
            out.port = port(p);
        } else if let ["https", p, port_name, gateway, namespace] = parts[..] {
            out.port = port(p);
            out.port_name = port_name.to_string();
            out.gateway = format!("{namespace}/{gateway}");
        } else {
            out.port = port(name);
        }
        out
    }
}

/// Applies the proxy's patches to `config`. Route configurations cannot be removed (istiod only
/// merges them): always true.
pub(super) fn patch(
    patches: &ProxyPatches,
    context: PatchContext,
    config: &mut RouteConfiguration,
    names: &Names,
) -> bool {
    let applies = |target| {
        patches
            .of(target)
            .filter(move |p| p.in_context(context) && config_matches(p, names))
    };
    for p in applies(ApplyTo::RouteConfiguration).filter(|p| p.operation().merges()) {
        merge_into(&p, config, &names.name);
    }
    let host_patches: Vec<PatchRef<'_>> = applies(ApplyTo::VirtualHost).collect();
    let route_patches: Vec<PatchRef<'_>> = applies(ApplyTo::HttpRoute).collect();
    let mut kept = Vec::with_capacity(config.virtual_hosts.len());
    'hosts: for mut host in std::mem::take(&mut config.virtual_hosts) {
        for p in &host_patches {
            if !host_matches(p, &host) {
                continue;
            }
            match p.operation() {
                Operation::Remove => continue 'hosts,
                Operation::Replace => {
                    if let Some(replacement) = p.typed::<VirtualHost>() {
                        host = replacement;
                    }
                }
                op if op.merges() => {
                    merge_into(p, &mut host, &names.name);
                }
                _ => {}
            }
        }
        let routes: Vec<PatchRef<'_>> = route_patches
            .iter()
            .filter(|p| host_matches(p, &host))
            .copied()
            .collect();
        patch_routes(&routes, &mut host.routes, &names.name);
        kept.push(host);
    }
    for p in host_patches
        .iter()
        .filter(|p| p.operation() == Operation::Add)
    {
        kept.extend(p.typed::<VirtualHost>());
    }
    config.virtual_hosts = kept;
    true
}

/// A virtual host's routes: each route's MERGE and REMOVE, then the placed ones.
fn patch_routes(patches: &[PatchRef<'_>], routes: &mut Vec<Route>, resource: &str) {
    routes.retain_mut(|route| {
        for p in patches {
            if !route_matches(p, route) {
                continue;
            }
            match p.operation() {
                Operation::Remove => return false,
                op if op.merges() => {
                    merge_into(p, route, resource);
                }
                _ => {}
            }
        }
        true
    });
    for p in patches
        .iter()
        .filter(|p| !p.operation().merges() && p.operation() != Operation::Remove)
    {
        let named = route_match(p).is_some();
        let selects = |r: &Route| route_matches(p, r);
        ListPatch {
            patch: *p,
            selects: named.then_some(&selects as &dyn Fn(&Route) -> bool),
            terminal: &|_| false,
        }
        .apply(routes);
    }
}

fn config_match<'a>(p: &PatchRef<'a>) -> Option<&'a RouteConfigurationMatch> {
    p.patch.matches.as_ref()?.route_configuration.as_ref()
}

fn config_matches(p: &PatchRef<'_>, names: &Names) -> bool {
    let Some(m) = config_match(p) else {
        return true;
    };
    (m.name.is_empty() || m.name == names.name)
        && (m.port_number == 0 || m.port_number == names.port)
        && (m.port_name.is_empty() || m.port_name == names.port_name)
        && (m.gateway.is_empty() || m.gateway == names.gateway)
}

fn host_matches(p: &PatchRef<'_>, host: &VirtualHost) -> bool {
    let Some(m) = config_match(p).and_then(|m| m.vhost.as_ref()) else {
        return true;
    };
    (m.name.is_empty() || m.name == host.name)
        && (m.domain_name.is_empty() || host.domains.contains(&m.domain_name))
}

fn route_match<'a>(p: &PatchRef<'a>) -> Option<&'a crate::istio::envoy_filter::RouteMatch> {
    config_match(p)?.vhost.as_ref()?.route.as_ref()
}

fn route_matches(p: &PatchRef<'_>, route: &Route) -> bool {
    let Some(m) = route_match(p) else {
        return true;
    };
    let action = match (&m.action, &route.action) {
        (RouteAction::Any, _) => true,
        (RouteAction::Route, Some(route::Action::Route(_))) => true,
        (RouteAction::Redirect, Some(route::Action::Redirect(_))) => true,
        (RouteAction::DirectResponse, Some(route::Action::DirectResponse(_))) => true,
        // Other actions (filter and non-forwarding ones) match any, as in istiod.
        (_, Some(route::Action::FilterAction(_) | route::Action::NonForwardingAction(_))) => true,
        _ => false,
    };
    action && (m.name.is_empty() || m.name == route.name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_of_sidecar_inbound_and_gateway_routes() {
        let sidecar = Names::of("8080");
        assert_eq!(sidecar.port, 8080);
        assert_eq!(Names::of("inbound|9080||").port, 9080);
        assert_eq!(Names::of("http.80").port, 80);
        let https = Names::of("https.443.https-web.web-gateway.shop");
        assert_eq!(
            (https.port, https.port_name.as_str(), https.gateway.as_str()),
            (443, "https-web", "shop/web-gateway")
        );
        assert_eq!(Names::of("reviews.default.svc.cluster.local:9080").port, 0);
    }
}
