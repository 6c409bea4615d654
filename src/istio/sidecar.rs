//! Sidecar (networking.istio.io): which services and config a namespace's (or selected workloads')
//! sidecars hear about, through egress listeners naming `<namespace>/<dnsName>` hosts.

use serde::{Deserialize, Serialize};

use super::mesh::OutboundMode;
use super::service_entry::{WorkloadSelector, PORT_PROTOCOLS};
use super::validate::{self, ensure, Result};
use crate::text::Quoted;

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Sidecar {
    pub workload_selector: Option<WorkloadSelector>,
    /// The inbound ports, in place of those of the workload's services.
    pub ingress: Vec<IngressListener>,
    pub egress: Vec<EgressListener>,
    pub outbound_traffic_policy: Option<SidecarOutboundPolicy>,
    /// Read so that a Sidecar naming it is refused with the field named: meshpilot does not apply
    /// it, and a setting silently dropped would be worse than a refusal.
    pub inbound_connection_pool: Option<serde_json::Value>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct EgressListener {
    /// Absent: the catch-all listener, for every port no other listener names.
    pub port: Option<SidecarPort>,
    pub bind: String,
    pub capture_mode: String,
    pub hosts: Vec<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct IngressListener {
    pub port: Option<SidecarPort>,
    pub bind: String,
    pub capture_mode: String,
    pub default_endpoint: String,
    /// Read to be refused (see `inbound_connection_pool`).
    pub tls: Option<serde_json::Value>,
    pub connection_pool: Option<serde_json::Value>,
}

/// Where an ingress listener's traffic goes (its `defaultEndpoint`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum IngressEndpoint {
    /// `127.0.0.1:<port>` (and, absent, the listener's own port there).
    Loopback(u16),
    /// `0.0.0.0:<port>`: the workload listening on every address, reached at its own.
    Workload(u16),
    /// `unix://<path>`.
    Unix(String),
}

impl IngressListener {
    /// The listener's `defaultEndpoint`, read; its port when it names none.
    pub fn endpoint(&self) -> std::result::Result<IngressEndpoint, String> {
        let own = self.port.as_ref().map_or(0, |p| p.number);
        let own = u16::try_from(own).map_err(|_| format!("port {own} is out of range"))?;
        let endpoint = self.default_endpoint.as_str();
        if endpoint.is_empty() {
            return Ok(IngressEndpoint::Loopback(own));
        }
        if let Some(path) = endpoint.strip_prefix("unix://") {
            return match path.starts_with('/') {
                true => Ok(IngressEndpoint::Unix(path.to_string())),
                false => Err(format!(
                    "{} is not an absolute socket path",
                    Quoted(endpoint)
                )),
            };
        }
        let port = |text: &str| text.parse::<u16>().ok().filter(|p| *p > 0);
        match endpoint.rsplit_once(':') {
            Some(("127.0.0.1", p)) if port(p).is_some() => {
                Ok(IngressEndpoint::Loopback(port(p).unwrap_or(own)))
            }
            Some(("0.0.0.0", p)) if port(p).is_some() => {
                Ok(IngressEndpoint::Workload(port(p).unwrap_or(own)))
            }
            _ => Err(format!(
                "{} is none of 127.0.0.1:<port>, 0.0.0.0:<port> or unix://<path>",
                Quoted(endpoint)
            )),
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct SidecarPort {
    pub number: u32,
    pub protocol: String,
    pub name: String,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct SidecarOutboundPolicy {
    /// Unset means REGISTRY_ONLY, the API's zero value, as istiod reads a Sidecar (unlike the mesh
    /// config, whose default sets ALLOW_ANY).
    #[serde(default = "registry_only")]
    pub mode: OutboundMode,
    pub egress_proxy: Option<serde_json::Value>,
}

fn registry_only() -> OutboundMode {
    OutboundMode::RegistryOnly
}

/// The namespace part of an egress host.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum HostNamespace {
    /// `*`: any namespace.
    Any,
    /// `.`: the namespace of the proxy the Sidecar applies to.
    Own,
    /// `~`: no namespace (imports nothing; with `~/*` a listener hears of no service).
    None,
    Named(String),
}

/// One `<namespace>/<dnsName>` egress host.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct EgressHost {
    pub namespace: HostNamespace,
    /// A FQDN, `*`, or `*.` followed by a domain.
    pub host: String,
}

impl EgressHost {
    /// Parses `<namespace>/<dnsName>`; the error says what is wrong with it.
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        let Some((ns, host)) = text.split_once('/') else {
            return Err(format!(
                "host {} must be of the form namespace/dnsName",
                Quoted(text)
            ));
        };
        if host.contains('/') {
            return Err(format!("host {} has more than one '/'", Quoted(text)));
        }
        validate::host("", host).map_err(|e| e.message)?;
        let namespace = match ns {
            "*" => HostNamespace::Any,
            "." => HostNamespace::Own,
            "~" => HostNamespace::None,
            "" => return Err(format!("host {} has no namespace", Quoted(text))),
            name if validate::is_dns1123_label(name) => HostNamespace::Named(name.to_string()),
            _ => {
                return Err(format!(
                    "namespace of {} is not '*', '.', '~' or a namespace name",
                    Quoted(text)
                ))
            }
        };
        Ok(Self {
            namespace,
            host: host.to_string(),
        })
    }
}

/// Why a field meshpilot cannot honour is refused rather than ignored.
const UNSUPPORTED: &str =
    "is not supported by meshpilot; remove it (a Sidecar with it would be applied without it)";

/// A listener served through the captured port of its direction: bound nowhere else, captured as
/// the pod's iptables set up (`DEFAULT`).
fn captured_only(bind: &str, capture_mode: &str, field: &str) -> Result {
    ensure(bind.is_empty(), &format!("{field}.bind"), UNSUPPORTED)?;
    ensure(
        matches!(capture_mode, "" | "DEFAULT"),
        &format!("{field}.captureMode"),
        UNSUPPORTED,
    )
}

impl Sidecar {
    pub fn validate(&self) -> Result {
        ensure(
            !self.egress.is_empty()
                || !self.ingress.is_empty()
                || self.outbound_traffic_policy.is_some()
                || self.inbound_connection_pool.is_some(),
            "spec",
            "empty configuration: no egress, ingress, outboundTrafficPolicy or inboundConnectionPool",
        )?;
        if let Some(selector) = &self.workload_selector {
            validate::labels("workloadSelector.labels", &selector.labels)?;
        }
        ensure(
            self.inbound_connection_pool.is_none(),
            "inboundConnectionPool",
            UNSUPPORTED,
        )?;
        let mut ingress_ports = Vec::new();
        for (i, listener) in self.ingress.iter().enumerate() {
            let field = format!("ingress[{i}]");
            let port = listener
                .port
                .as_ref()
                .ok_or_else(|| validate::ValidationError::at(&field, "a port is required"))?;
            port.validate()
                .map_err(|e| e.under(&format!("{field}.port")))?;
            ensure(
                !ingress_ports.contains(&port.number),
                &format!("{field}.port.number"),
                format!("port {} is listed twice", port.number),
            )?;
            ingress_ports.push(port.number);
            listener.endpoint().map_err(|m| {
                validate::ValidationError::at(format!("{field}.defaultEndpoint"), m)
            })?;
            // Inbound traffic reaches the captured 15006; no listener binds elsewhere.
            captured_only(&listener.bind, &listener.capture_mode, &field)?;
            ensure(listener.tls.is_none(), &format!("{field}.tls"), UNSUPPORTED)?;
            ensure(
                listener.connection_pool.is_none(),
                &format!("{field}.connectionPool"),
                UNSUPPORTED,
            )?;
        }
        let mut egress_ports = Vec::new();
        for (i, listener) in self.egress.iter().enumerate() {
            let field = format!("egress[{i}]");
            match &listener.port {
                None => ensure(
                    i + 1 == self.egress.len(),
                    &field,
                    "the listener without a port must be the last (and only one may have none)",
                )?,
                Some(port) => {
                    port.validate()
                        .map_err(|e| e.under(&format!("{field}.port")))?;
                    ensure(
                        !egress_ports.contains(&port.number),
                        &format!("{field}.port.number"),
                        format!("port {} is listed twice", port.number),
                    )?;
                    egress_ports.push(port.number);
                }
            }
            ensure(
                !listener.hosts.is_empty(),
                &format!("{field}.hosts"),
                "at least one host is required",
            )?;
            // Every egress port is served through the captured 15001, bound nowhere else.
            captured_only(&listener.bind, &listener.capture_mode, &field)?;
            for (j, host) in listener.hosts.iter().enumerate() {
                EgressHost::parse(host)
                    .map_err(|m| validate::ValidationError::at(format!("{field}.hosts[{j}]"), m))?;
            }
        }
        if let Some(policy) = &self.outbound_traffic_policy {
            ensure(
                policy.egress_proxy.is_none() || policy.mode == OutboundMode::AllowAny,
                "outboundTrafficPolicy.egressProxy",
                "is allowed only with mode ALLOW_ANY",
            )?;
            ensure(
                policy.egress_proxy.is_none(),
                "outboundTrafficPolicy.egressProxy",
                UNSUPPORTED,
            )?;
        }
        Ok(())
    }

    /// The egress listeners, a catch-all `*/*` one when none is given (as istiod reads them).
    pub fn egress_listeners(&self) -> Vec<EgressListener> {
        match self.egress.is_empty() {
            false => self.egress.clone(),
            true => vec![EgressListener {
                hosts: vec!["*/*".into()],
                ..Default::default()
            }],
        }
    }
}

impl SidecarPort {
    fn validate(&self) -> Result {
        // Port 0 is a Unix domain socket bind, which meshpilot's captured layout has no use for.
        validate::port("number", self.number)?;
        ensure(
            PORT_PROTOCOLS
                .iter()
                .any(|p| p.eq_ignore_ascii_case(&self.protocol)),
            "protocol",
            format!("unknown protocol {}", Quoted(&self.protocol)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sidecar(spec: serde_json::Value) -> Sidecar {
        serde_json::from_value(spec).unwrap()
    }

    fn error(spec: serde_json::Value) -> String {
        sidecar(spec).validate().unwrap_err().to_string()
    }

    #[test]
    fn istio_docs_forms_validate() {
        let s = sidecar(serde_json::json!({
            "egress": [
                {"port": {"number": 9080, "protocol": "HTTP", "name": "egresshttp"},
                 "hosts": ["prod-us1/*"]},
                {"hosts": ["./*", "istio-system/*", "*/*.example.com", "~/*"]}
            ],
            "outboundTrafficPolicy": {"mode": "REGISTRY_ONLY"},
            "workloadSelector": {"labels": {"app": "ratings"}}
        }));
        s.validate().unwrap();
        assert_eq!(
            EgressHost::parse("./*").unwrap(),
            EgressHost {
                namespace: HostNamespace::Own,
                host: "*".into()
            }
        );
    }

    #[test]
    fn refusals_name_the_field() {
        assert!(error(serde_json::json!({})).contains("empty configuration"));
        let e = error(serde_json::json!({"egress": [{"hosts": ["reviews"]}]}));
        assert!(e.starts_with("egress[0].hosts[0]: "), "{e}");
        assert!(e.contains("namespace/dnsName"), "{e}");
        let e = error(serde_json::json!({"egress": [{"hosts": ["Bad_NS/*"]}]}));
        assert!(e.contains("not '*', '.', '~'"), "{e}");
        let e = error(serde_json::json!({"egress": [{"hosts": []}]}));
        assert_eq!(e, "egress[0].hosts: at least one host is required");
        let e = error(serde_json::json!({"egress": [{"hosts": ["./*"]}, {"hosts": ["*/*"]}]}));
        assert!(
            e.starts_with("egress[0]: the listener without a port"),
            "{e}"
        );
        let e = error(serde_json::json!({"egress": [
            {"port": {"number": 80, "protocol": "HTTP"}, "hosts": ["./*"]},
            {"port": {"number": 80, "protocol": "TCP"}, "hosts": ["./*"]}]}));
        assert!(e.starts_with("egress[1].port.number: "), "{e}");
        let e = error(serde_json::json!({"egress": [
            {"port": {"number": 80, "protocol": "SMTP"}, "hosts": ["./*"]}]}));
        assert!(e.starts_with("egress[0].port.protocol: "), "{e}");
        for (spec, field) in [
            (
                serde_json::json!({"ingress": [{"port": {"number": 9080, "protocol": "HTTP"}, "bind": "0.0.0.0"}]}),
                "ingress[0].bind",
            ),
            (
                serde_json::json!({"ingress": [{"port": {"number": 9080, "protocol": "HTTP"}, "captureMode": "NONE"}]}),
                "ingress[0].captureMode",
            ),
            (
                serde_json::json!({"inboundConnectionPool": {"http": {}}}),
                "inboundConnectionPool",
            ),
            (
                serde_json::json!({"egress": [{"hosts": ["./*"], "bind": "127.0.0.1"}]}),
                "egress[0].bind",
            ),
            (
                serde_json::json!({"egress": [{"hosts": ["./*"], "captureMode": "NONE"}]}),
                "egress[0].captureMode",
            ),
            (
                serde_json::json!({"outboundTrafficPolicy": {"mode": "ALLOW_ANY", "egressProxy": {"host": "p"}}}),
                "outboundTrafficPolicy.egressProxy",
            ),
        ] {
            let e = error(spec);
            assert_eq!(e, format!("{field}: {UNSUPPORTED}"));
        }
        let e = error(serde_json::json!({"ingress": [{"bind": "0.0.0.0"}]}));
        assert_eq!(e, "ingress[0]: a port is required");
        let e = error(
            serde_json::json!({"ingress": [{"port": {"number": 9080, "protocol": "HTTP"},
            "defaultEndpoint": "10.0.0.1:8080"}]}),
        );
        assert!(e.starts_with("ingress[0].defaultEndpoint: "), "{e}");
        let e = error(serde_json::json!({"outboundTrafficPolicy": {
            "mode": "REGISTRY_ONLY", "egressProxy": {"host": "proxy"}}}));
        assert!(e.starts_with("outboundTrafficPolicy.egressProxy"), "{e}");
    }

    #[test]
    fn ingress_endpoints_read_as_istio_writes_them() {
        let listener = |endpoint: &str| IngressListener {
            port: Some(SidecarPort {
                number: 9080,
                protocol: "HTTP".into(),
                name: "http".into(),
            }),
            default_endpoint: endpoint.into(),
            ..Default::default()
        };
        assert_eq!(listener("").endpoint(), Ok(IngressEndpoint::Loopback(9080)));
        assert_eq!(
            listener("127.0.0.1:8080").endpoint(),
            Ok(IngressEndpoint::Loopback(8080))
        );
        assert_eq!(
            listener("0.0.0.0:8080").endpoint(),
            Ok(IngressEndpoint::Workload(8080))
        );
        assert_eq!(
            listener("unix:///var/run/app.sock").endpoint(),
            Ok(IngressEndpoint::Unix("/var/run/app.sock".into()))
        );
        for bad in ["unix://app.sock", "127.0.0.1:0", "localhost:80", "0.0.0.0"] {
            assert!(listener(bad).endpoint().is_err(), "{bad}");
        }
    }

    #[test]
    fn no_egress_means_everything() {
        let s = sidecar(serde_json::json!({"outboundTrafficPolicy": {"mode": "REGISTRY_ONLY"}}));
        s.validate().unwrap();
        assert_eq!(s.egress_listeners()[0].hosts, ["*/*"]);
    }
}
