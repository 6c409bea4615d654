//! Gateway (networking.istio.io): the listeners of gateway proxies its selector picks.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::validate::{self, ensure, Result};
use crate::text::Quoted;

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Gateway {
    pub selector: BTreeMap<String, String>,
    pub servers: Vec<Server>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Server {
    pub port: ServerPort,
    pub bind: String,
    pub hosts: Vec<String>,
    pub tls: Option<ServerTls>,
    pub name: String,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ServerPort {
    pub number: u32,
    pub protocol: String,
    pub name: String,
    pub target_port: Option<u32>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ServerTls {
    pub https_redirect: bool,
    pub mode: ServerTlsMode,
    pub server_certificate: String,
    pub private_key: String,
    pub ca_certificates: String,
    pub credential_name: String,
    pub subject_alt_names: Vec<String>,
    pub min_protocol_version: String,
    pub max_protocol_version: String,
    pub cipher_suites: Vec<String>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ServerTlsMode {
    Passthrough,
    #[default]
    Simple,
    Mutual,
    AutoPassthrough,
    IstioMutual,
    OptionalMutual,
}

/// The protocols a server port may name (case-insensitive).
const PROTOCOLS: &[&str] = &[
    "HTTP", "HTTPS", "GRPC", "GRPC-WEB", "HTTP2", "MONGO", "REDIS", "MYSQL", "TCP", "TLS",
];

impl Gateway {
    pub fn validate(&self) -> Result {
        ensure(
            !self.servers.is_empty(),
            "servers",
            "at least one server is required",
        )?;
        validate::labels("selector", &self.selector)?;
        for (i, server) in self.servers.iter().enumerate() {
            server
                .validate()
                .map_err(|e| e.under(&format!("servers[{i}]")))?;
        }
        Ok(())
    }
}

impl Server {
    pub fn protocol(&self) -> String {
        self.port.protocol.to_ascii_uppercase()
    }

    fn validate(&self) -> Result {
        validate::port("port.number", self.port.number)?;
        let protocol = self.protocol();
        ensure(
            PROTOCOLS.contains(&protocol.as_str()),
            "port.protocol",
            format!("unknown protocol {}", Quoted(&self.port.protocol)),
        )?;
        ensure(
            !self.hosts.is_empty(),
            "hosts",
            "at least one host is required",
        )?;
        for (i, host) in self.hosts.iter().enumerate() {
            // `<namespace>/<host>`: the namespace part is `*`, `.` or a name.
            let dns = host.rsplit_once('/').map_or(host.as_str(), |(_, h)| h);
            validate::host(&format!("hosts[{i}]"), dns)?;
        }
        let tls_protocol = matches!(protocol.as_str(), "HTTPS" | "TLS");
        match &self.tls {
            None => ensure(
                !tls_protocol,
                "tls",
                format!("a {protocol} server needs tls settings"),
            ),
            Some(tls) if tls.https_redirect && !tls_protocol => Ok(()),
            Some(tls) => {
                let terminates = matches!(
                    tls.mode,
                    ServerTlsMode::Simple | ServerTlsMode::Mutual | ServerTlsMode::OptionalMutual
                );
                if terminates {
                    let files = !tls.server_certificate.is_empty() && !tls.private_key.is_empty();
                    ensure(
                        files || !tls.credential_name.is_empty(),
                        "tls",
                        format!(
                            "mode {:?} needs credentialName, or serverCertificate and privateKey",
                            tls.mode
                        ),
                    )?;
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gw(yaml: &str) -> Gateway {
        serde_yaml_ng::from_str(yaml).unwrap()
    }

    #[test]
    fn istio_samples_validate() {
        // samples/multicluster/expose-services.yaml
        gw("
selector: {istio: eastwestgateway}
servers:
- port: {number: 15443, name: tls, protocol: TLS}
  tls: {mode: AUTO_PASSTHROUGH}
  hosts: ['*.local']
")
        .validate()
        .unwrap();
        gw("
selector: {istio: ingressgateway}
servers:
- port: {number: 443, name: https, protocol: HTTPS}
  tls: {mode: SIMPLE, credentialName: bookinfo-cert}
  hosts: [bookinfo.example.com]
- port: {number: 80, name: http, protocol: HTTP}
  hosts: ['*']
  tls: {httpsRedirect: true}
")
        .validate()
        .unwrap();
    }

    #[test]
    fn refusals_name_the_field() {
        let e =
            gw("servers: [{port: {number: 443, name: https, protocol: HTTPS}, hosts: [a.com]}]")
                .validate()
                .unwrap_err();
        assert_eq!(e.field, "servers[0].tls");
        let e = gw("servers: [{port: {number: 443, name: x, protocol: HTTPS}, hosts: [a.com], tls: {mode: SIMPLE}}]")
            .validate()
            .unwrap_err();
        assert_eq!(e.field, "servers[0].tls");
        let e = gw("servers: [{port: {number: 80, name: x, protocol: HTTP}, hosts: []}]")
            .validate()
            .unwrap_err();
        assert_eq!(e.field, "servers[0].hosts");
    }
}
