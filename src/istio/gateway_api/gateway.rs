//! GatewayClass and Gateway: which controller owns a class, and a Gateway's listeners.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::super::validate::{ensure, Result, ValidationError};
use super::{each, hostname, GROUP};

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct GatewayClass {
    pub controller_name: String,
    pub description: String,
}

impl GatewayClass {
    pub fn validate(&self) -> Result {
        ensure(
            !self.controller_name.is_empty(),
            "controllerName",
            "a class names its controller",
        )
    }
}

/// A Gateway (`gateway.networking.k8s.io`; Istio's own Gateway is [`crate::istio::Gateway`]).
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct KubernetesGateway {
    pub gateway_class_name: String,
    pub listeners: Vec<Listener>,
    /// Where the gateway is reached; a `Hostname` naming a Service of the mesh selects the
    /// workloads behind that Service (a manually deployed gateway).
    pub addresses: Vec<GatewayAddress>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct GatewayAddress {
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub value: String,
}

impl GatewayAddress {
    /// `IPAddress` unless the address names another type.
    pub fn kind(&self) -> &str {
        self.kind.as_deref().unwrap_or("IPAddress")
    }
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Listener {
    pub name: String,
    pub hostname: Option<String>,
    pub port: u16,
    pub protocol: String,
    pub tls: Option<ListenerTls>,
    pub allowed_routes: Option<AllowedRoutes>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ListenerTls {
    /// `Terminate` (the default) or `Passthrough`.
    pub mode: Option<String>,
    pub certificate_refs: Vec<SecretReference>,
    /// Implementation-specific options; meshpilot defines none.
    pub options: BTreeMap<String, String>,
}

impl ListenerTls {
    pub fn passthrough(&self) -> bool {
        self.mode.as_deref() == Some("Passthrough")
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct SecretReference {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
}

impl SecretReference {
    pub fn is_secret(&self) -> bool {
        self.group.as_deref().unwrap_or_default().is_empty()
            && self.kind.as_deref().unwrap_or("Secret") == "Secret"
    }
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct AllowedRoutes {
    pub namespaces: Option<RouteNamespaces>,
    pub kinds: Vec<RouteGroupKind>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct RouteNamespaces {
    /// `Same` (the default) or `All`. (`Selector` needs namespace labels, which meshpilot does
    /// not keep: refused.)
    pub from: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct RouteGroupKind {
    pub group: Option<String>,
    pub kind: String,
}

impl RouteGroupKind {
    pub fn group(&self) -> &str {
        self.group.as_deref().unwrap_or(GROUP)
    }
}

/// The protocols a listener may name, and those meshpilot serves (HBONE on the ambient classes).
const SERVED_PROTOCOLS: [&str; 5] = ["HTTP", "HTTPS", "TLS", "TCP", "HBONE"];
/// The one TLS option an HBONE listener takes (Istio's east-west gateway sets it): the mesh's
/// own mutual TLS.
const TLS_TERMINATE_MODE: (&str, &str) = ("gateway.istio.io/tls-terminate-mode", "ISTIO_MUTUAL");

impl Listener {
    /// Where routes may attach from: `Same` (the Gateway's namespace) or `All`.
    pub fn routes_from_all_namespaces(&self) -> bool {
        self.allowed_routes
            .as_ref()
            .and_then(|a| a.namespaces.as_ref())
            .and_then(|n| n.from.as_deref())
            == Some("All")
    }

    fn validate(&self) -> Result {
        ensure(
            self.name.len() <= 253
                && self
                    .name
                    .split('.')
                    .all(super::super::validate::is_dns1123_label),
            "name",
            "must be a DNS subdomain (lowercase letters, digits, '-' and '.')",
        )?;
        ensure(self.port != 0, "port", "must be 1-65535")?;
        ensure(
            SERVED_PROTOCOLS.contains(&self.protocol.as_str()),
            "protocol",
            format!(
                "{} is not served; one of {}",
                crate::text::Quoted(&self.protocol),
                SERVED_PROTOCOLS.join(", ")
            ),
        )?;
        if let Some(host) = &self.hostname {
            hostname("hostname", host)?;
        }
        if self.protocol == super::HBONE_PROTOCOL {
            self.validate_hbone()?;
        } else {
            self.validate_tls()?;
        }
        self.validate_allowed_routes()
    }

    fn validate_tls(&self) -> Result {
        let tls_needed = matches!(self.protocol.as_str(), "HTTPS" | "TLS");
        ensure(
            tls_needed == self.tls.is_some(),
            "tls",
            match tls_needed {
                true => "HTTPS and TLS listeners need tls",
                false => "only HTTPS, TLS and HBONE listeners take tls",
            },
        )?;
        if let Some(tls) = &self.tls {
            let mode = tls.mode.as_deref().unwrap_or("Terminate");
            ensure(
                matches!(mode, "Terminate" | "Passthrough"),
                "tls.mode",
                "Terminate or Passthrough",
            )?;
            ensure(
                !(tls.passthrough() && self.protocol == "HTTPS"),
                "tls.mode",
                "an HTTPS listener terminates TLS; pass TLS through with protocol TLS",
            )?;
            ensure(
                tls.passthrough() || !tls.certificate_refs.is_empty(),
                "tls.certificateRefs",
                "a listener that terminates TLS names its certificate",
            )?;
            ensure(
                tls.options.is_empty(),
                "tls.options",
                "meshpilot defines no TLS options",
            )?;
        }
        Ok(())
    }

    fn validate_allowed_routes(&self) -> Result {
        if let Some(from) = self
            .allowed_routes
            .as_ref()
            .and_then(|a| a.namespaces.as_ref())
            .and_then(|n| n.from.as_deref())
        {
            ensure(
                matches!(from, "Same" | "All"),
                "allowedRoutes.namespaces.from",
                "Same or All (Selector is not implemented: meshpilot keeps no namespace labels)",
            )?;
        }
        Ok(())
    }

    /// HBONE is the mesh's own mutual TLS on port 15008: it names no certificate, and its one
    /// TLS option can only say so.
    fn validate_hbone(&self) -> Result {
        use super::HBONE_PORT;
        ensure(
            self.port == HBONE_PORT,
            "port",
            format!("an HBONE listener is on port {HBONE_PORT}"),
        )?;
        ensure(
            self.hostname.is_none(),
            "hostname",
            "an HBONE listener serves every host",
        )?;
        let Some(tls) = &self.tls else {
            return Ok(());
        };
        ensure(
            tls.mode.as_deref().unwrap_or("Terminate") == "Terminate",
            "tls.mode",
            "an HBONE listener terminates the mesh's mutual TLS",
        )?;
        ensure(
            tls.certificate_refs.is_empty(),
            "tls.certificateRefs",
            "an HBONE listener uses the mesh's certificates",
        )?;
        let (key, value) = TLS_TERMINATE_MODE;
        ensure(
            tls.options.iter().all(|(k, v)| k == key && v == value),
            "tls.options",
            format!("only {key}: {value}"),
        )
    }
}

impl KubernetesGateway {
    pub fn validate(&self) -> Result {
        ensure(
            !self.gateway_class_name.is_empty(),
            "gatewayClassName",
            "a Gateway names its class",
        )?;
        ensure(
            (1..=64).contains(&self.listeners.len()),
            "listeners",
            "1 to 64 listeners",
        )?;
        each("listeners", &self.listeners, Listener::validate)?;
        for (i, listener) in self.listeners.iter().enumerate() {
            if self.listeners[..i].iter().any(|l| l.name == listener.name) {
                return Err(ValidationError::at(
                    format!("listeners[{i}].name"),
                    "listener names are unique",
                ));
            }
        }
        each("addresses", &self.addresses, |a| {
            ensure(
                a.kind() == "Hostname",
                "type",
                "Hostname (a Service of the mesh whose workloads serve the Gateway); requesting an \
                 IP address is not implemented",
            )?;
            hostname("value", &a.value)
        })
    }
}
