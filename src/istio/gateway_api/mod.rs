//! The Kubernetes Gateway API (`gateway.networking.k8s.io`) kinds meshpilot reads: GatewayClass,
//! Gateway, HTTPRoute, GRPCRoute, TCPRoute, TLSRoute and ReferenceGrant, typed for the fields
//! meshpilot implements (the others are refused by the field check), with the API's own
//! validation where its CRDs carry it. What they mean for proxies is compiled in
//! `model/config/gateway_api`.

pub mod gateway;
pub mod reference_grant;
pub mod route;

use serde::{Deserialize, Serialize};

use super::validate::{ensure, Result};

pub use gateway::{GatewayClass, KubernetesGateway};
pub use reference_grant::ReferenceGrant;
pub use route::{BackendRef, GrpcRoute, HttpRoute, TcpRoute, TlsRoute};

pub const GROUP: &str = "gateway.networking.k8s.io";
/// The controller name of Istio's GatewayClasses, which meshpilot implements.
pub const CONTROLLER: &str = "istio.io/gateway-controller";
/// The class istiod treats as its own even before a GatewayClass object names it.
pub const BUILT_IN_CLASS: &str = "istio";
/// The label gateway pods carry, naming their Gateway (automated deployment sets it).
pub const GATEWAY_NAME_LABEL: &str = "gateway.networking.k8s.io/gateway-name";
/// The label on what Istio's gateway controllers deploy, and its values per controller (the
/// controller's name with `/` made `-`): objects without it are not the controller's.
pub const MANAGED_LABEL: &str = "gateway.istio.io/managed";
pub const MANAGED_BY_GATEWAY_CONTROLLER: &str = "istio.io-gateway-controller";
pub const MANAGED_BY_MESH_CONTROLLER: &str = "istio.io-mesh-controller";
pub const MANAGED_BY_EAST_WEST_CONTROLLER: &str = "istio.io-eastwest-controller";
/// The Gateway annotation naming what is deployed for it (else the Gateway's name, or
/// `<name>-<class>` for the `istio` class).
pub const NAME_OVERRIDE: &str = "gateway.istio.io/name-override";
/// The port and protocol of an ambient gateway's (waypoint's, east-west gateway's) listener.
pub const HBONE_PORT: u16 = 15008;
pub const HBONE_PROTOCOL: &str = "HBONE";

/// A route's parent: a Gateway (the default) or, for mesh routes, a Service.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ParentReference {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub section_name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
}

impl ParentReference {
    pub fn group(&self) -> &str {
        self.group.as_deref().unwrap_or(GROUP)
    }

    pub fn kind(&self) -> &str {
        self.kind.as_deref().unwrap_or("Gateway")
    }

    /// A Gateway of this API (the default), rather than a Service (a mesh route).
    pub fn is_gateway(&self) -> bool {
        self.group() == GROUP && self.kind() == "Gateway"
    }

    pub fn is_service(&self) -> bool {
        self.group().is_empty() && self.kind() == "Service"
    }

    fn validate(&self) -> Result {
        ensure(!self.name.is_empty(), "name", "a parent must be named")?;
        ensure(
            self.is_gateway() || self.is_service(),
            "kind",
            format!(
                "parents are Gateways ({GROUP}) or Services (core), not {}/{}",
                self.group(),
                self.kind()
            ),
        )?;
        ensure(self.port != Some(0), "port", "must be 1-65535")
    }
}

/// Runs `check` on each item, errors placed under `field[i]`.
fn each<T>(field: &str, items: &[T], check: impl Fn(&T) -> Result) -> Result {
    for (i, item) in items.iter().enumerate() {
        check(item).map_err(|e| e.under(&format!("{field}[{i}]")))?;
    }
    Ok(())
}

/// A listener or route hostname: a DNS name, optionally with a leading `*.` label; no IPs.
fn hostname(field: &str, host: &str) -> Result {
    let bare = host.strip_prefix("*.").unwrap_or(host);
    let valid = !bare.is_empty()
        && host.len() <= 253
        && bare.split('.').all(super::validate::is_dns1123_label)
        && bare.parse::<std::net::IpAddr>().is_err();
    ensure(
        valid,
        field,
        format!(
            "{} is not a hostname (a DNS name, `*.` allowed first; no IP addresses)",
            crate::text::Quoted(host)
        ),
    )
}
