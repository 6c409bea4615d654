//! Services in Istio's shape.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::ClusterId;

/// A fully qualified service hostname, e.g. `reviews.bookinfo.svc.cluster.local`.
pub type Hostname = Arc<str>;

/// Key of a service in the endpoint index: Istio indexes by hostname, then namespace.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct ServiceKey {
    pub hostname: Hostname,
    pub namespace: Arc<str>,
}

/// Application protocol of a port, chosen as Istio does: `appProtocol` first, then the port-name prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Protocol {
    Http,
    Http2,
    Grpc,
    Https,
    Tls,
    Tcp,
    Udp,
    Mongo,
    Redis,
    Mysql,
    /// Not declared: treated as opaque TCP.
    Unsupported,
}

impl Protocol {
    /// `app_protocol` is the port's `appProtocol`, `l4` its `protocol` (TCP when absent).
    pub fn from_port(name: &str, app_protocol: Option<&str>, l4: Option<&str>) -> Self {
        if l4.is_some_and(|p| p.eq_ignore_ascii_case("UDP")) {
            return Self::Udp;
        }
        if let Some(p) = app_protocol.and_then(Self::parse) {
            return p;
        }
        let prefix = name.split('-').next().unwrap_or_default();
        Self::parse(prefix).unwrap_or(Self::Unsupported)
    }

    fn parse(s: &str) -> Option<Self> {
        Some(match s.to_ascii_lowercase().as_str() {
            "http" | "http1" => Self::Http,
            "http2" | "h2c" | "kubernetes.io/h2c" => Self::Http2,
            "grpc" | "grpc-web" => Self::Grpc,
            "https" => Self::Https,
            "tls" => Self::Tls,
            "tcp" => Self::Tcp,
            "udp" => Self::Udp,
            "mongo" => Self::Mongo,
            "redis" => Self::Redis,
            "mysql" => Self::Mysql,
            _ => return None,
        })
    }

    /// A ServiceEntry port's `protocol` (HTTP, HTTPS, GRPC, TLS, TCP, …).
    pub fn from_name(protocol: &str) -> Self {
        Self::parse(protocol).unwrap_or(Self::Unsupported)
    }

    /// Whether the port carries HTTP that a proxy routes by host.
    pub fn is_http(self) -> bool {
        matches!(self, Self::Http | Self::Http2 | Self::Grpc)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServicePort {
    pub name: String,
    pub port: u16,
    pub protocol: Protocol,
    /// Where the workloads listen, when the service says (a ServiceEntry's `targetPort`); for
    /// Kubernetes Services each endpoint carries its own.
    pub target_port: Option<u16>,
}

/// How a client reaches the service's endpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Resolution {
    /// Load-balanced by the proxy over EDS endpoints.
    ClientSideLb,
    /// Headless, or a ServiceEntry with resolution NONE: the proxy forwards to the original
    /// destination.
    Passthrough,
    /// The proxy resolves the service's `dns_targets` itself (an ExternalName service, a DNS
    /// ServiceEntry): every address of every target, or only the first address of one at a time.
    Dns { round_robin: bool },
}

/// Where a service is defined (Istio's provider names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Registry {
    /// A Service of a Kubernetes cluster.
    Kubernetes,
    /// A ServiceEntry.
    External,
}

impl Registry {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Kubernetes => "Kubernetes",
            Self::External => "External",
        }
    }
}

/// A name the proxy resolves, for DNS resolution.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DnsTarget {
    pub host: String,
    /// Port name → target port; a port absent here is reached on the service port's target port.
    pub ports: BTreeMap<String, u16>,
    pub weight: u32,
    pub locality: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Service {
    pub hostname: Hostname,
    pub name: String,
    pub namespace: Arc<str>,
    pub registry: Registry,
    pub ports: Vec<ServicePort>,
    /// Cluster IPs by cluster: one service merged from several clusters keeps each cluster's VIPs.
    pub cluster_vips: BTreeMap<ClusterId, Vec<IpAddr>>,
    pub labels: BTreeMap<String, String>,
    pub resolution: Resolution,
    /// What the proxy resolves when `resolution` is DNS.
    pub dns_targets: Vec<DnsTarget>,
    /// Addresses reachable from outside its cluster (LoadBalancer ingress IPs, else externalIPs):
    /// where an east-west gateway Service is reached.
    pub external_addresses: Vec<IpAddr>,
    /// Outside the mesh (a MESH_EXTERNAL ServiceEntry): no sidecars there, so no auto mTLS.
    pub mesh_external: bool,
    /// Namespaces whose proxies see the service (`.`, `*`, `~` or names); empty: the mesh default.
    pub export_to: Vec<String>,
    /// Identities to verify beyond the endpoints' own (a ServiceEntry's subjectAltNames).
    pub subject_alt_names: Vec<String>,
    /// Addresses allocated to a ServiceEntry host that declares none (IPv4, then IPv6): used only
    /// by proxies whose agent captures DNS, which resolve the host to them.
    pub auto_addresses: Vec<IpAddr>,
    /// Its `istio.io/use-waypoint` (a Kubernetes Service's, else its namespace's).
    pub use_waypoint: Option<super::UseWaypoint>,
}

impl Service {
    pub fn key(&self) -> ServiceKey {
        ServiceKey {
            hostname: self.hostname.clone(),
            namespace: self.namespace.clone(),
        }
    }

    /// A Kubernetes Service without a cluster IP: its pods are reached by their own addresses.
    pub fn is_headless_kubernetes(&self) -> bool {
        self.resolution == Resolution::Passthrough && self.registry == Registry::Kubernetes
    }

    /// Whether proxies' listeners name its endpoints: a headless Kubernetes Service with a port
    /// that is not HTTP, whose pods outbound listeners match one by one (istio/istio
    /// pilot/pkg/networking/core/listener.go); its endpoint changes are full pushes
    /// (pilot/pkg/serviceregistry/kube/controller/endpointslice.go).
    pub fn listens_per_endpoint(&self) -> bool {
        self.is_headless_kubernetes() && self.ports.iter().any(|p| !p.protocol.is_http())
    }

    pub fn port(&self, number: u16) -> Option<&ServicePort> {
        self.ports.iter().find(|p| p.port == number)
    }

    /// The port an endpoint's port name refers to.
    pub fn port_named(&self, name: &str) -> Option<&ServicePort> {
        self.ports.iter().find(|p| p.name == name)
    }

    /// Whether a proxy in `namespace` sees the service, given the mesh's default export.
    pub fn visible_to(&self, namespace: &str, default_export: &[String]) -> bool {
        let export_to = match self.export_to.as_slice() {
            [] => default_export,
            e => e,
        };
        *self.namespace == *namespace || export_to.iter().any(|e| e == "*" || e == namespace)
    }

    /// Whether some namespaces do not see the service.
    pub fn restricted(&self, default_export: &[String]) -> bool {
        let export_to = match self.export_to.as_slice() {
            [] => default_export,
            e => e,
        };
        !export_to.iter().any(|e| e == "*")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protocol_follows_istio_precedence() {
        assert_eq!(Protocol::from_port("http-web", None, None), Protocol::Http);
        assert_eq!(
            Protocol::from_port("web", Some("grpc"), None),
            Protocol::Grpc
        );
        assert_eq!(
            Protocol::from_port("grpc", Some("kubernetes.io/h2c"), None),
            Protocol::Http2
        );
        assert_eq!(Protocol::from_port("dns", None, Some("UDP")), Protocol::Udp);
        assert_eq!(
            Protocol::from_port("metrics", None, Some("TCP")),
            Protocol::Unsupported
        );
        assert_eq!(Protocol::from_port("", None, None), Protocol::Unsupported);
    }
}
