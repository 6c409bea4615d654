//! Where a route attaches: the listeners of a parent Gateway that admit it (section, port, route
//! kind, namespace, a hostname in common), or a Service for a mesh route.

use std::sync::Arc;

use super::status::Refusal;
use crate::istio::gateway_api::gateway::Listener;
use crate::istio::gateway_api::ParentReference;
use crate::istio::ConfigKind;

/// One listener of a Gateway meshpilot implements.
#[derive(Debug)]
pub(super) struct Listening {
    pub gateway_namespace: Arc<str>,
    pub gateway_name: Arc<str>,
    pub listener: Listener,
    /// `<namespace>/<name>` of the Istio Gateway it compiles to.
    pub compiled: String,
    /// The route kinds it admits.
    pub kinds: Vec<&'static str>,
    /// Why its allowed kinds are not all served.
    pub kinds_refused: Option<Refusal>,
    /// Why it serves nothing: its certificate cannot be used, or its protocol is not its class's.
    pub unserved: Option<Refusal>,
    pub attached: usize,
}

impl Listening {
    pub fn serves(&self) -> bool {
        self.unserved.is_none()
    }

    pub fn passthrough(&self) -> bool {
        self.listener.tls.as_ref().is_some_and(|t| t.passthrough())
    }
}

/// The kinds a listener's protocol carries.
pub(super) fn kinds_for(listener: &Listener) -> &'static [&'static str] {
    match listener.protocol.as_str() {
        "HTTP" | "HTTPS" => &["HTTPRoute", "GRPCRoute"],
        "TLS" if listener.tls.as_ref().is_some_and(|t| t.passthrough()) => &["TLSRoute"],
        "TLS" => &["TLSRoute", "TCPRoute"],
        "TCP" => &["TCPRoute"],
        _ => &[],
    }
}

/// Where one parent reference attaches a route.
#[derive(Debug)]
pub(super) enum Attachment {
    /// A listener (by index) and the hostnames the route serves on it.
    Listener { index: usize, hosts: Vec<String> },
    /// A Service's clients (a mesh route), optionally on one port.
    Service { host: String, port: Option<u16> },
}

/// The route being attached.
pub(super) struct RouteRef<'a> {
    pub kind: ConfigKind,
    pub namespace: &'a str,
    pub hostnames: &'a [String],
}

/// Attaches a route through one parent reference; None when the parent is no Gateway of a class
/// meshpilot implements (another controller reports on it).
pub(super) fn attach(
    listeners: &mut [Listening],
    foreign_gateway: impl Fn(&str, &str) -> bool,
    qualify_service: impl Fn(&str, &str) -> String,
    route: &RouteRef<'_>,
    parent: &ParentReference,
) -> Option<Result<Vec<Attachment>, Refusal>> {
    let namespace = parent.namespace.as_deref().unwrap_or(route.namespace);
    if parent.is_service() {
        if route.kind == ConfigKind::TlsRoute {
            return Some(Err(Refusal::new(
                "UnsupportedValue",
                "TLSRoutes attach to Gateways, not to Services",
            )));
        }
        let host = qualify_service(&parent.name, namespace);
        return Some(Ok(vec![Attachment::Service {
            host,
            port: parent.port,
        }]));
    }
    let of_gateway: Vec<usize> = (0..listeners.len())
        .filter(|i| {
            let l = &listeners[*i];
            *l.gateway_namespace == *namespace && *l.gateway_name == *parent.name
        })
        .collect();
    if of_gateway.is_empty() {
        if foreign_gateway(namespace, &parent.name) {
            return None;
        }
        return Some(Err(Refusal::new(
            "NoMatchingParent",
            format!("no Gateway {namespace}/{} of an Istio class", parent.name),
        )));
    }
    let named: Vec<usize> = of_gateway
        .into_iter()
        .filter(|i| {
            let l = &listeners[*i].listener;
            parent.section_name.as_ref().is_none_or(|s| *s == l.name)
                && parent.port.is_none_or(|p| p == l.port)
        })
        .collect();
    if named.is_empty() {
        return Some(Err(Refusal::new(
            "NoMatchingParent",
            "no listener of the Gateway has the sectionName and port named",
        )));
    }
    let mut attached = Vec::new();
    let mut admitted_elsewhere = false;
    for index in named {
        let l = &mut listeners[index];
        let kind_ok = l.kinds.contains(&route.kind.name());
        let namespace_ok =
            l.listener.routes_from_all_namespaces() || *l.gateway_namespace == *route.namespace;
        if !(kind_ok && namespace_ok) {
            continue;
        }
        admitted_elsewhere = true;
        let hosts = intersect(l.listener.hostname.as_deref(), route.hostnames);
        if hosts.is_empty() {
            continue;
        }
        l.attached += 1;
        attached.push(Attachment::Listener { index, hosts });
    }
    Some(match (attached.is_empty(), admitted_elsewhere) {
        (false, _) => Ok(attached),
        (true, true) => Err(Refusal::new(
            "NoMatchingListenerHostname",
            "no hostname of the route is one of the listener's",
        )),
        (true, false) => Err(Refusal::new(
            "NotAllowedByListeners",
            format!(
                "no listener admits {}s from namespace {}",
                route.kind.name(),
                route.namespace
            ),
        )),
    })
}

/// The hostnames a route serves on a listener: those of each that the other covers.
pub(super) fn intersect(listener: Option<&str>, route: &[String]) -> Vec<String> {
    let mut hosts: Vec<String> = match (listener, route.is_empty()) {
        (None, true) => vec!["*".to_string()],
        (None, false) => route.to_vec(),
        (Some(l), true) => vec![l.to_string()],
        (Some(l), false) => route
            .iter()
            .filter_map(|r| {
                if r == l || covers(l, r) {
                    Some(r.clone())
                } else if covers(r, l) {
                    Some(l.to_string())
                } else {
                    None
                }
            })
            .collect(),
    };
    hosts.sort();
    hosts.dedup();
    hosts
}

/// Whether a wildcard hostname (`*.example.com`) covers another (one or more labels in place of
/// the `*`).
fn covers(wildcard: &str, host: &str) -> bool {
    match wildcard.strip_prefix('*') {
        Some(suffix) => host.len() > suffix.len() && host.ends_with(suffix),
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostnames_intersect_as_the_api_defines() {
        let route = |hosts: &[&str]| hosts.iter().map(|h| h.to_string()).collect::<Vec<_>>();
        assert_eq!(intersect(None, &[]), ["*"]);
        assert_eq!(intersect(Some("*.example.com"), &[]), ["*.example.com"]);
        assert_eq!(
            intersect(
                Some("*.example.com"),
                &route(&[
                    "a.example.com",
                    "a.b.example.com",
                    "example.com",
                    "other.org"
                ])
            ),
            ["a.b.example.com", "a.example.com"]
        );
        assert_eq!(
            intersect(Some("foo.example.com"), &route(&["*.example.com"])),
            ["foo.example.com"]
        );
        assert!(intersect(Some("foo.example.com"), &route(&["bar.example.com"])).is_empty());
    }
}
