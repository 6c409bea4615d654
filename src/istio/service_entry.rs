//! ServiceEntry, WorkloadEntry and WorkloadGroup (networking.istio.io).

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use super::validate::{self, ensure, Result};
use crate::text::{clip, Quoted};

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ServiceEntry {
    pub hosts: Vec<String>,
    /// Virtual IPs or CIDRs of the service.
    pub addresses: Vec<String>,
    pub ports: Vec<ServicePort>,
    pub location: Location,
    pub resolution: Resolution,
    pub endpoints: Vec<WorkloadEntry>,
    pub workload_selector: Option<WorkloadSelector>,
    pub export_to: Vec<String>,
    pub subject_alt_names: Vec<String>,
    /// Addresses allocated to its hosts, as the object's `status.addresses` records them (written
    /// by the leader of a config cluster, or by istiod 1.25+); not part of the spec.
    #[serde(skip)]
    pub status_addresses: Vec<StatusAddress>,
}

/// One `status.addresses` entry: an allocated address of one host.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StatusAddress {
    pub host: String,
    pub value: IpAddr,
}

impl StatusAddress {
    /// The entries of a ServiceEntry's `status` that name a host and an IP address; others are
    /// not ours to judge (status is written by controllers, not users) and are passed over.
    pub fn read(status: &serde_json::Value) -> Vec<StatusAddress> {
        let Some(list) = status["addresses"].as_array() else {
            return Vec::new();
        };
        list.iter()
            .filter_map(|a| {
                Some(StatusAddress {
                    host: a["host"].as_str()?.to_string(),
                    value: a["value"].as_str()?.parse().ok()?,
                })
            })
            .collect()
    }
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ServicePort {
    pub number: u32,
    pub protocol: String,
    pub name: String,
    pub target_port: Option<u32>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Location {
    /// Outside the mesh: no sidecar, no mutual TLS (Istio's default).
    #[default]
    MeshExternal,
    MeshInternal,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Resolution {
    /// Forward to the address the client asked for.
    #[default]
    None,
    Static,
    Dns,
    DnsRoundRobin,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct WorkloadSelector {
    pub labels: BTreeMap<String, String>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct WorkloadEntry {
    /// An IP (or, for DNS resolution, a host name).
    pub address: String,
    /// Port name → the workload's port for it.
    pub ports: BTreeMap<String, u32>,
    pub labels: BTreeMap<String, String>,
    pub network: String,
    /// `region/zone/subzone`.
    pub locality: String,
    pub weight: u32,
    pub service_account: String,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct WorkloadGroup {
    pub metadata: GroupMetadata,
    pub template: WorkloadEntry,
    /// The VM's readiness probe: istiod only validates it (pilot/pkg/autoregistration copies
    /// template and metadata); `istioctl x workload entry configure` writes it into the agent's
    /// mesh config, and the agent reports health from it. Kept as written, for those tools.
    pub probe: Option<serde_json::Value>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct GroupMetadata {
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
}

/// Application protocols Istio accepts on a port (case-insensitive).
pub const PORT_PROTOCOLS: &[&str] = &[
    "HTTP", "HTTPS", "GRPC", "GRPC-WEB", "HTTP2", "MONGO", "REDIS", "MYSQL", "TCP", "TLS", "UDP",
];

impl ServiceEntry {
    pub fn validate(&self) -> Result {
        ensure(
            !self.hosts.is_empty(),
            "hosts",
            "at least one host is required",
        )?;
        for (i, host) in self.hosts.iter().enumerate() {
            let field = format!("hosts[{i}]");
            ensure(
                host != "*",
                &field,
                "'*' is not allowed as a ServiceEntry host",
            )?;
            validate::host(&field, host)?;
            let wildcard = host.starts_with('*');
            ensure(
                !(wildcard
                    && matches!(self.resolution, Resolution::Dns | Resolution::DnsRoundRobin)
                    && self.endpoints.is_empty()),
                &field,
                "a wildcard host needs endpoints when resolution is DNS",
            )?;
        }
        for (i, address) in self.addresses.iter().enumerate() {
            let ok = address.parse::<IpAddr>().is_ok() || address.parse::<IpNet>().is_ok();
            ensure(
                ok,
                &format!("addresses[{i}]"),
                format!("{} is not an IP address or CIDR", Quoted(address)),
            )?;
        }
        self.validate_ports()?;
        validate::export_to("exportTo", &self.export_to)?;
        ensure(
            self.workload_selector.is_none() || self.endpoints.is_empty(),
            "workloadSelector",
            "workloadSelector and endpoints cannot both be set",
        )?;
        if let Some(selector) = &self.workload_selector {
            validate::labels("workloadSelector.labels", &selector.labels)?;
        }
        match self.resolution {
            Resolution::None => ensure(
                self.endpoints.is_empty(),
                "endpoints",
                "endpoints need resolution STATIC, DNS or DNS_ROUND_ROBIN, not NONE",
            )?,
            Resolution::Static => {
                for (i, ep) in self.endpoints.iter().enumerate() {
                    let field = format!("endpoints[{i}]");
                    ep.validate().map_err(|e| e.under(&field))?;
                    ensure(
                        ep.address.parse::<IpAddr>().is_ok() || ep.address.starts_with("unix://"),
                        &format!("{field}.address"),
                        format!(
                            "{} is not an IP address (resolution STATIC)",
                            Quoted(&ep.address)
                        ),
                    )?;
                }
            }
            Resolution::Dns | Resolution::DnsRoundRobin => {
                ensure(
                    self.resolution != Resolution::DnsRoundRobin || self.endpoints.len() <= 1,
                    "endpoints",
                    "resolution DNS_ROUND_ROBIN allows at most one endpoint",
                )?;
                for (i, ep) in self.endpoints.iter().enumerate() {
                    let field = format!("endpoints[{i}]");
                    ep.validate().map_err(|e| e.under(&field))?;
                }
            }
        }
        for (i, san) in self.subject_alt_names.iter().enumerate() {
            ensure(!san.is_empty(), &format!("subjectAltNames[{i}]"), "empty")?;
        }
        Ok(())
    }

    fn validate_ports(&self) -> Result {
        for (i, port) in self.ports.iter().enumerate() {
            let field = format!("ports[{i}]");
            validate::port(&format!("{field}.number"), port.number)?;
            if let Some(target) = port.target_port {
                validate::port(&format!("{field}.targetPort"), target)?;
            }
            ensure(
                !port.name.is_empty(),
                &format!("{field}.name"),
                "a port name is required",
            )?;
            ensure(
                port.protocol.is_empty()
                    || PORT_PROTOCOLS
                        .iter()
                        .any(|p| p.eq_ignore_ascii_case(&port.protocol)),
                &format!("{field}.protocol"),
                format!("unknown protocol {}", Quoted(&port.protocol)),
            )?;
            let earlier = &self.ports[..i];
            ensure(
                !earlier.iter().any(|p| p.number == port.number),
                &format!("{field}.number"),
                format!("port {} is listed twice", port.number),
            )?;
            ensure(
                !earlier.iter().any(|p| p.name == port.name),
                &format!("{field}.name"),
                format!("port name {} is listed twice", Quoted(&port.name)),
            )?;
        }
        Ok(())
    }
}

impl WorkloadEntry {
    pub fn validate(&self) -> Result {
        for (name, port) in &self.ports {
            validate::port(&format!("ports.{}", clip(name)), *port)?;
        }
        validate::labels("labels", &self.labels)?;
        if !self.address.is_empty() && self.address.parse::<IpAddr>().is_err() {
            if let Some(path) = self.address.strip_prefix("unix://") {
                ensure(!path.is_empty(), "address", "an empty unix socket path")?;
            } else {
                validate::host("address", &self.address)?;
            }
        }
        ensure(
            self.locality.split('/').count() <= 3,
            "locality",
            format!("{} is not region/zone/subzone", Quoted(&self.locality)),
        )
    }

    /// A WorkloadEntry object (not an entry inlined in a ServiceEntry) needs its address.
    pub fn validate_standalone(&self) -> Result {
        ensure(
            !self.address.is_empty(),
            "address",
            "an address is required",
        )?;
        self.validate()
    }
}

impl WorkloadGroup {
    pub fn validate(&self) -> Result {
        validate::labels("metadata.labels", &self.metadata.labels)?;
        self.template.validate().map_err(|e| e.under("template"))?;
        ensure(
            self.template.address.is_empty(),
            "template.address",
            "a WorkloadGroup template may not set an address",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn se(yaml: &str) -> ServiceEntry {
        serde_yaml_ng::from_str(yaml).unwrap()
    }

    #[test]
    fn a_static_entry_validates() {
        let entry = se("
hosts: [api.example.com]
addresses: [192.0.2.10]
ports: [{number: 443, name: https, protocol: TLS}]
location: MESH_EXTERNAL
resolution: STATIC
endpoints: [{address: 192.0.2.11}, {address: 192.0.2.12, ports: {https: 8443}}]
");
        assert!(entry.validate().is_ok());
        assert_eq!(entry.endpoints[1].ports["https"], 8443);
    }

    #[test]
    fn refusals_name_the_field() {
        let e = se(
            "hosts: [a.example.com]\nports: [{number: 80, name: http}, {number: 80, name: web}]\n",
        )
        .validate()
        .unwrap_err();
        assert_eq!(e.field, "ports[1].number");
        let e =
            se("hosts: [a.example.com]\nresolution: STATIC\nendpoints: [{address: not-an-ip}]\n")
                .validate()
                .unwrap_err();
        assert_eq!(e.field, "endpoints[0].address");
        let e = se("hosts: [a.example.com]\nworkloadSelector: {labels: {app: a}}\nendpoints: [{address: 1.2.3.4}]\nresolution: STATIC\n")
            .validate()
            .unwrap_err();
        assert_eq!(e.field, "workloadSelector");
        assert!(se("hosts: []").validate().is_err());
    }

    #[test]
    fn workload_entries_need_an_address() {
        let we: WorkloadEntry = serde_yaml_ng::from_str("labels: {app: vm}").unwrap();
        assert_eq!(we.validate_standalone().unwrap_err().field, "address");
    }
}
