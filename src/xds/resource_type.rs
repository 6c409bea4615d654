//! The resource types meshpilot serves over xDS and ADS: their type URLs, the order a push sends
//! them in, and their names in metrics.

use serde::Serialize;

use crate::istio::mcp;
use crate::istio::ConfigKind;

pub const CLUSTER_TYPE: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
pub const ENDPOINT_TYPE: &str =
    "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
pub const LISTENER_TYPE: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
pub const ROUTE_TYPE: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
pub const SECRET_TYPE: &str =
    "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";
/// Istio's DNS name table, asked for by agents that capture DNS.
pub const NAME_TABLE_TYPE: &str = "type.googleapis.com/istio.networking.nds.v1.NameTable";
/// The mesh's trust bundle as Istio's agent asks for it (PCDS; istiod's pkg/model/xds.go
/// `ProxyConfigType`).
pub const PROXY_CONFIG_TYPE: &str = "type.googleapis.com/istio.mesh.v1alpha1.ProxyConfig";
/// Extension configs (ECDS): the filter configs listeners discover by name (WasmPlugins).
pub const EXTENSION_CONFIG_TYPE: &str =
    "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig";
/// Ambient mode's workloads and services, for ztunnel (Delta only).
pub const ADDRESS_TYPE: &str = "type.googleapis.com/istio.workload.Address";
/// AuthorizationPolicies in ztunnel's L4 form.
pub const AUTHORIZATION_TYPE: &str = "type.googleapis.com/istio.security.Authorization";

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ResourceType {
    Cluster,
    Endpoint,
    Listener,
    Route,
    Secret,
    NameTable,
    ExtensionConfig,
    ProxyConfig,
    Address,
    Authorization,
    /// Istio config over MCP: a kind, at one of its versions (its index among the kind's).
    Config(ConfigKind, usize),
}

/// Shown by its short name (`cds`), Istio config by its type URL.
impl Serialize for ResourceType {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Config(..) => serializer.serialize_str(self.url()),
            _ => serializer.serialize_str(self.short()),
        }
    }
}

impl ResourceType {
    pub const ALL: [ResourceType; 10] = [
        Self::Cluster,
        Self::Endpoint,
        Self::Listener,
        Self::Route,
        Self::Secret,
        Self::NameTable,
        Self::ExtensionConfig,
        Self::Address,
        Self::Authorization,
        Self::ProxyConfig,
    ];

    pub fn from_url(url: &str) -> Option<Self> {
        Some(match url {
            CLUSTER_TYPE => Self::Cluster,
            ENDPOINT_TYPE => Self::Endpoint,
            LISTENER_TYPE => Self::Listener,
            ROUTE_TYPE => Self::Route,
            SECRET_TYPE => Self::Secret,
            NAME_TABLE_TYPE => Self::NameTable,
            EXTENSION_CONFIG_TYPE => Self::ExtensionConfig,
            ADDRESS_TYPE => Self::Address,
            AUTHORIZATION_TYPE => Self::Authorization,
            PROXY_CONFIG_TYPE => Self::ProxyConfig,
            url => {
                let (kind, version) = mcp::parse_type_url(url)?;
                Self::Config(kind, version)
            }
        })
    }

    pub fn url(self) -> &'static str {
        match self {
            Self::Cluster => CLUSTER_TYPE,
            Self::Endpoint => ENDPOINT_TYPE,
            Self::Listener => LISTENER_TYPE,
            Self::Route => ROUTE_TYPE,
            Self::Secret => SECRET_TYPE,
            Self::NameTable => NAME_TABLE_TYPE,
            Self::ExtensionConfig => EXTENSION_CONFIG_TYPE,
            Self::Address => ADDRESS_TYPE,
            Self::Authorization => AUTHORIZATION_TYPE,
            Self::ProxyConfig => PROXY_CONFIG_TYPE,
            Self::Config(kind, version) => mcp::type_urls()
                .get(&(kind, version))
                .map_or("", String::as_str),
        }
    }

    /// Position in [`Self::ALL`]; Istio config types share the one after them.
    pub fn index(self) -> usize {
        match self {
            Self::Cluster => 0,
            Self::Endpoint => 1,
            Self::Listener => 2,
            Self::Route => 3,
            Self::Secret => 4,
            Self::NameTable => 5,
            Self::ExtensionConfig => 6,
            Self::Address => 7,
            Self::Authorization => 8,
            Self::ProxyConfig => 9,
            Self::Config(..) => Self::ALL.len(),
        }
    }

    pub fn short(self) -> &'static str {
        match self {
            Self::Cluster => "cds",
            Self::Endpoint => "eds",
            Self::Listener => "lds",
            Self::Route => "rds",
            Self::Secret => "sds",
            Self::NameTable => "nds",
            Self::ExtensionConfig => "ecds",
            // istiod's short names (pilot/pkg/xds/v3/model.go).
            Self::Address => "wds",
            Self::Authorization => "wads",
            Self::ProxyConfig => "pcds",
            Self::Config(..) => "mcp",
        }
    }

    /// CDS, LDS, NDS, PCDS, ztunnel's types and Istio config subscribe to everything when no names are
    /// given.
    pub(super) fn wildcard_capable(self) -> bool {
        matches!(
            self,
            Self::Cluster
                | Self::Listener
                | Self::NameTable
                | Self::Address
                | Self::Authorization
                | Self::ProxyConfig
                | Self::Config(..)
        )
    }
}

impl crate::metrics::XdsType for ResourceType {
    fn index(self) -> usize {
        ResourceType::index(self)
    }
}
