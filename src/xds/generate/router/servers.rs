//! The servers of the Gateways that select a router, by the port they listen on in its pod, and
//! what each admits: its route name, TLS mode, hosts, SNI names and bound VirtualServices.

use std::collections::BTreeMap;

use crate::istio::gateway::{Server, ServerTlsMode};
use crate::istio::virtual_service::VirtualService;
use crate::model::{host_match, BoundGateway};
use crate::xds::generate::gateway_tls;
use crate::xds::generate::generation::Generation;

pub(super) fn labelled_east_west(g: &Generation<'_>) -> bool {
    g.labels().get("istio").map(String::as_str) == Some("eastwestgateway")
}

/// One server of a Gateway that selects the proxy.
pub(super) struct PortServer<'a> {
    bound: &'a BoundGateway,
    pub(super) server: &'a Server,
    /// `<namespace>/<name>` of its Gateway.
    pub(super) gateway: String,
    /// The port it listens on in the gateway's pod.
    listen: u16,
}

impl PortServer<'_> {
    pub(super) fn number(&self) -> u16 {
        u16::try_from(self.server.port.number).unwrap_or_default()
    }

    pub(super) fn mode(&self) -> Option<ServerTlsMode> {
        self.server.tls.as_ref().map(|t| t.mode)
    }

    pub(super) fn is_plain_http(&self) -> bool {
        let http = matches!(
            self.server.protocol().as_str(),
            "HTTP" | "HTTP2" | "GRPC" | "GRPC-WEB"
        );
        http && self.mode().is_none_or(|_| self.redirects_to_https())
    }

    pub(super) fn redirects_to_https(&self) -> bool {
        self.server.tls.as_ref().is_some_and(|t| t.https_redirect)
    }

    /// The RDS route of an HTTP server (istiod's names, `gatewayRDSRouteName` in
    /// pilot/pkg/model/gateway.go: plain HTTP by the port listened on, HTTPS by the server's).
    pub(super) fn route_name(&self) -> Option<String> {
        if self.is_plain_http() {
            return Some(format!("http.{}", self.listen));
        }
        let terminated_https =
            self.server.protocol() == "HTTPS" && self.mode().is_some_and(gateway_tls::terminates);
        terminated_https.then(|| {
            let (ns, name) = self.gateway.split_once('/').unwrap_or_default();
            let port_name = &self.server.port.name;
            format!("https.{}.{port_name}.{name}.{ns}", self.number())
        })
    }

    /// The server's hosts a VirtualService may use: `<ns>/<host>` admits only that namespace's
    /// VirtualServices (`.` the Gateway's, `*` or nothing any).
    pub(super) fn admits(&self, vs_namespace: &str, vs_host: &str) -> Option<String> {
        let gateway_ns = self.gateway.split('/').next().unwrap_or_default();
        self.server.hosts.iter().find_map(|entry| {
            let (ns, host) = entry.split_once('/').unwrap_or(("*", entry));
            let ns_ok =
                ns == "*" || ns == vs_namespace || (ns == "." && vs_namespace == gateway_ns);
            if !ns_ok {
                return None;
            }
            // The more specific of the two names is the one served.
            if host_match(host, vs_host).is_some() {
                Some(vs_host.to_string())
            } else {
                host_match(vs_host, host).map(|_| host.to_string())
            }
        })
    }

    /// SNI names the server answers for; empty for `*` (any).
    pub(super) fn server_names(&self) -> Vec<String> {
        let hosts = self.server.hosts.iter();
        let names: Vec<String> = hosts
            .map(|h| h.split_once('/').map_or(h.as_str(), |(_, host)| host))
            .map(str::to_string)
            .collect();
        match names.iter().any(|h| h == "*") {
            true => Vec::new(),
            false => names,
        }
    }

    /// The hosts an AUTO_PASSTHROUGH server forwards, in any namespace (istiod's
    /// `GetSNIHostsForServer`, pilot/pkg/model/gateway.go, drops the `<ns>/`).
    pub(super) fn sni_hosts(&self) -> Vec<&str> {
        let hosts = self.server.hosts.iter();
        hosts
            .map(|h| h.split_once('/').map_or(h.as_str(), |(_, host)| host))
            .collect()
    }

    /// The bound VirtualServices with a host this server admits.
    pub(super) fn virtual_services(&self) -> impl Iterator<Item = (&str, &VirtualService)> {
        self.bound
            .virtual_services
            .iter()
            .filter_map(|(object, vs)| {
                let ns = &*object.key.namespace;
                vs.hosts
                    .iter()
                    .any(|h| self.admits(ns, h).is_some())
                    .then_some((ns, &**vs))
            })
    }

    pub(super) fn applies(&self, gateways: &[String]) -> bool {
        gateways.is_empty()
            || gateways
                .iter()
                .any(|g| *g == self.gateway || self.gateway.rsplit('/').next() == Some(g.as_str()))
    }
}

/// The port a server listens on in the gateway's pod: the target port of its Service's port with
/// the server's number, else that number.
fn listen_port(g: &Generation<'_>, number: u16) -> u16 {
    for ip in g.addresses() {
        for key in g.mesh.endpoints.services_at(ip) {
            let port = g.mesh.services.get(&key.hostname).and_then(|s| {
                let port = s.port(number)?;
                let shards = g.mesh.endpoints.get(&key)?;
                let ep = shards
                    .endpoints()
                    .find(|e| e.address == *ip && *e.service_port_name == *port.name)?;
                Some(ep.port)
            });
            if let Some(port) = port {
                return port;
            }
        }
    }
    number
}

pub(super) fn servers<'a>(
    g: &Generation<'_>,
    bound: &'a [BoundGateway],
) -> BTreeMap<u16, Vec<PortServer<'a>>> {
    let mut by_port: BTreeMap<u16, Vec<PortServer<'a>>> = BTreeMap::new();
    for b in bound {
        let gateway = format!("{}/{}", b.object.key.namespace, b.object.key.name);
        for server in &b.gateway.servers {
            let number = u16::try_from(server.port.number).unwrap_or_default();
            let listen = listen_port(g, number);
            by_port.entry(listen).or_default().push(PortServer {
                bound: b,
                server,
                gateway: gateway.clone(),
                listen,
            });
        }
    }
    by_port
}
