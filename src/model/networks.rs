//! Networks: Istio's MeshNetworks configuration and the east-west gateways of each network.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::{ClusterId, Hostname, Locality, Service};
use crate::istio::{is_dns1123_label, is_fqdn};
use crate::text::{clip, Quoted};

pub const LABEL_GATEWAY_PORT: &str = "networking.istio.io/gatewayPort";
pub const LABEL_NETWORK: &str = "topology.istio.io/network";
/// Port of east-west gateways when the Service does not say (Istio's).
pub const DEFAULT_GATEWAY_PORT: u16 = 15443;

#[derive(Debug, Error)]
pub enum NetworksError {
    #[error("mesh networks do not parse: {0}")]
    Parse(String),
    #[error("network {network}: endpoint entry {index} must have exactly one of fromCidr and fromRegistry")]
    Endpoint { network: String, index: usize },
    #[error("network {network}: endpoint entry {index}: fromRegistry {} is not a cluster ID (a DNS-1123 label)", Quoted(.registry))]
    Registry {
        network: String,
        index: usize,
        registry: String,
    },
    #[error("network {network}: gateway {index} must have exactly one of address and registryServiceName")]
    Gateway { network: String, index: usize },
    #[error("network {network}: gateway {index} address {} is not an IP address or a DNS name", Quoted(.address))]
    GatewayAddress {
        network: String,
        index: usize,
        address: String,
    },
    #[error("network {network}: gateway {index} registryServiceName {} is not a DNS name", Quoted(.name))]
    GatewayService {
        network: String,
        index: usize,
        name: String,
    },
    #[error("network {network}: gateway {index} needs a port (1-65535)")]
    GatewayPort { network: String, index: usize },
}

/// `meshNetworks` (istio.io/api mesh/v1alpha1/network.proto).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
pub struct MeshNetworks {
    #[serde(default)]
    pub networks: BTreeMap<String, NetworkSpec>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkSpec {
    #[serde(default)]
    pub endpoints: Vec<NetworkEndpoints>,
    #[serde(default)]
    pub gateways: Vec<GatewaySpec>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkEndpoints {
    pub from_cidr: Option<IpNet>,
    pub from_registry: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GatewaySpec {
    pub address: Option<String>,
    pub registry_service_name: Option<String>,
    #[serde(default)]
    pub port: u16,
    pub locality: Option<String>,
}

impl MeshNetworks {
    /// Parses and validates a MeshNetworks document as istiod's `ValidateMeshNetworks`
    /// (pkg/config/validation/agent/validation.go): a gateway's address may be a DNS name, which
    /// is resolved (istiod's `RESOLVE_HOSTNAME_GATEWAYS`, on by default).
    pub fn parse(yaml: &str) -> Result<Self, NetworksError> {
        if yaml.trim().is_empty() {
            return Ok(Self::default());
        }
        crate::yaml::check_aliases(yaml).map_err(|e| NetworksError::Parse(e.to_string()))?;
        let parsed: MeshNetworks = serde_yaml_ng::from_str(yaml)
            .map_err(|e| NetworksError::Parse(clip(&e.to_string())))?;
        for (network, spec) in &parsed.networks {
            let network = || clip(network);
            for (index, ep) in spec.endpoints.iter().enumerate() {
                if ep.from_cidr.is_some() == ep.from_registry.is_some() {
                    let network = network();
                    return Err(NetworksError::Endpoint { network, index });
                }
                if let Some(registry) = ep.from_registry.as_ref().filter(|r| !is_dns1123_label(r)) {
                    let (network, registry) = (network(), clip(registry));
                    return Err(NetworksError::Registry {
                        network,
                        index,
                        registry,
                    });
                }
            }
            for (index, gw) in spec.gateways.iter().enumerate() {
                let network = network();
                if gw.address.is_some() == gw.registry_service_name.is_some() {
                    return Err(NetworksError::Gateway { network, index });
                }
                if let Some(address) = gw
                    .address
                    .as_ref()
                    .filter(|a| a.parse::<IpAddr>().is_err() && !is_fqdn(a))
                {
                    let address = clip(address);
                    return Err(NetworksError::GatewayAddress {
                        network,
                        index,
                        address,
                    });
                }
                if let Some(name) = gw.registry_service_name.as_ref().filter(|n| !is_fqdn(n)) {
                    let name = clip(name);
                    return Err(NetworksError::GatewayService {
                        network,
                        index,
                        name,
                    });
                }
                if gw.port == 0 {
                    return Err(NetworksError::GatewayPort { network, index });
                }
            }
        }
        Ok(parsed)
    }

    /// Gateway addresses given as DNS names, to be resolved.
    pub fn gateway_hostnames(&self) -> BTreeSet<String> {
        (self.networks.values())
            .flat_map(|n| &n.gateways)
            .filter_map(|g| g.address.as_ref())
            .filter(|a| a.parse::<IpAddr>().is_err())
            .cloned()
            .collect()
    }

    /// The network whose endpoints come `fromRegistry` this cluster.
    pub fn network_of_registry(&self, cluster: &str) -> Option<&str> {
        self.networks
            .iter()
            .find(|(_, spec)| {
                spec.endpoints
                    .iter()
                    .any(|e| e.from_registry.as_deref() == Some(cluster))
            })
            .map(|(name, _)| name.as_str())
    }

    /// The first network with a `fromCidr` containing the address.
    pub fn network_of_address(&self, address: IpAddr) -> Option<&str> {
        self.networks
            .iter()
            .find(|(_, spec)| {
                spec.endpoints
                    .iter()
                    .any(|e| e.from_cidr.is_some_and(|c| c.contains(&address)))
            })
            .map(|(name, _)| name.as_str())
    }
}

/// One east-west gateway: where traffic for a network's mTLS endpoints enters it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct Gateway {
    pub network: Arc<str>,
    pub address: IpAddr,
    pub port: u16,
    pub cluster: Option<ClusterId>,
    pub locality: Option<Locality>,
    /// The Service of `cluster` it is reached through, when a Service names it: its endpoints are
    /// the gateway's own pods (whose identity ambient mode's clients verify).
    #[serde(skip)]
    pub service: Option<Hostname>,
}

/// The addresses that gateways' DNS names resolved to, by name.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct GatewayNames(pub BTreeMap<String, Vec<IpAddr>>);

impl GatewayNames {
    fn of(&self, name: &str) -> Vec<IpAddr> {
        self.0.get(name).cloned().unwrap_or_default()
    }
}

/// Every known gateway, by network. Immutable once built.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Gateways {
    pub by_network: BTreeMap<Arc<str>, Vec<Gateway>>,
}

impl Gateways {
    /// Builds the set from MeshNetworks (addresses, and registry services resolved through their
    /// clusters' external addresses) and from Services labelled `topology.istio.io/network`.
    pub fn build(
        config: &MeshNetworks,
        resolved: &GatewayNames,
        services: &[(ClusterId, Arc<Service>)],
    ) -> Self {
        let mut all: Vec<Gateway> = Vec::new();
        for (network, spec) in &config.networks {
            let network: Arc<str> = network.as_str().into();
            for gw in &spec.gateways {
                let locality = gw
                    .locality
                    .as_deref()
                    .map(|l| Locality::parse(&l.replace('.', "/")));
                let addresses = match gw.address.as_ref().map(|a| a.parse::<IpAddr>()) {
                    Some(Ok(address)) => vec![address],
                    Some(Err(_)) => resolved.of(gw.address.as_deref().unwrap_or_default()),
                    None => Vec::new(),
                };
                for address in addresses {
                    all.push(Gateway {
                        network: network.clone(),
                        address,
                        port: gw.port,
                        cluster: None,
                        locality: locality.clone(),
                        service: None,
                    });
                }
                let Some(host) = &gw.registry_service_name else {
                    continue;
                };
                let registries: Vec<&str> = spec
                    .endpoints
                    .iter()
                    .filter_map(|e| e.from_registry.as_deref())
                    .collect();
                for (cluster, svc) in services
                    .iter()
                    .filter(|(c, s)| *s.hostname == **host && registries.contains(&c.as_str()))
                {
                    for address in &svc.external_addresses {
                        all.push(Gateway {
                            network: network.clone(),
                            address: *address,
                            port: gw.port,
                            cluster: Some(cluster.clone()),
                            locality: locality.clone(),
                            service: Some(svc.hostname.clone()),
                        });
                    }
                }
            }
        }
        for (cluster, svc) in services {
            let Some(network) = svc.labels.get(LABEL_NETWORK) else {
                continue;
            };
            let port = svc
                .labels
                .get(LABEL_GATEWAY_PORT)
                .and_then(|p| p.parse().ok())
                .unwrap_or(DEFAULT_GATEWAY_PORT);
            for address in &svc.external_addresses {
                all.push(Gateway {
                    network: network.as_str().into(),
                    address: *address,
                    port,
                    cluster: Some(cluster.clone()),
                    locality: None,
                    service: Some(svc.hostname.clone()),
                });
            }
        }
        all.sort();
        all.dedup_by(|a, b| a.network == b.network && a.address == b.address && a.port == b.port);
        let mut by_network: BTreeMap<Arc<str>, Vec<Gateway>> = BTreeMap::new();
        for gw in all {
            by_network.entry(gw.network.clone()).or_default().push(gw);
        }
        Self { by_network }
    }

    pub fn of(&self, network: &str) -> &[Gateway] {
        self.by_network
            .get(network)
            .map(Vec::as_slice)
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: &str = "
networks:
  network1:
    endpoints: [{fromRegistry: east}, {fromCidr: 10.10.0.0/16}]
    gateways: [{address: 192.0.2.10, port: 15443}]
  network2:
    endpoints: [{fromRegistry: west}]
    gateways: [{registryServiceName: istio-eastwestgateway.istio-system.svc.cluster.local, port: 15443}]
";

    #[test]
    fn networks_by_registry_and_cidr() {
        let n = MeshNetworks::parse(CONFIG).unwrap();
        assert_eq!(n.network_of_registry("west"), Some("network2"));
        assert_eq!(
            n.network_of_address("10.10.3.4".parse().unwrap()),
            Some("network1")
        );
        assert_eq!(n.network_of_address("10.11.3.4".parse().unwrap()), None);
    }

    #[test]
    fn malformed_config_names_the_problem() {
        let both = "networks: {n: {endpoints: [{fromCidr: 10.0.0.0/8, fromRegistry: x}]}}";
        assert!(MeshNetworks::parse(both)
            .unwrap_err()
            .to_string()
            .contains("network n: endpoint entry 0"));
        let bad_cidr = "networks: {n: {endpoints: [{fromCidr: 10.0.0.0/99}]}}";
        assert!(MeshNetworks::parse(bad_cidr).is_err());
        let refused = |yaml: &str| MeshNetworks::parse(yaml).unwrap_err().to_string();
        let bad_addr = "networks: {n: {gateways: [{address: 'gw_1!', port: 15443}]}}";
        assert!(refused(bad_addr).contains("not an IP address or a DNS name"));
        let no_port = "networks: {n: {gateways: [{address: 192.0.2.1}]}}";
        assert!(refused(no_port).contains("gateway 0 needs a port"));
        let registry = "networks: {n: {endpoints: [{fromRegistry: East_1}]}}";
        assert!(refused(registry).contains("\"East_1\" is not a cluster ID"));
        let service = "networks: {n: {gateways: [{registryServiceName: 'a..b', port: 1}]}}";
        assert!(refused(service).contains("registryServiceName"));
    }

    #[test]
    fn gateway_names_are_resolved_addresses() {
        let n = MeshNetworks::parse(
            "networks: {n: {gateways: [{address: gw.example.com, port: 15443}, {address: 192.0.2.1, port: 15443}]}}",
        )
        .unwrap();
        assert_eq!(
            n.gateway_hostnames(),
            BTreeSet::from(["gw.example.com".to_string()])
        );
        let resolved = GatewayNames(BTreeMap::from([(
            "gw.example.com".to_string(),
            vec!["192.0.2.7".parse().unwrap(), "192.0.2.8".parse().unwrap()],
        )]));
        let gateways = Gateways::build(&n, &resolved, &[]);
        let addresses: Vec<String> = gateways
            .of("n")
            .iter()
            .map(|g| g.address.to_string())
            .collect();
        assert_eq!(addresses, ["192.0.2.1", "192.0.2.7", "192.0.2.8"]);
        assert!(
            Gateways::build(&n, &GatewayNames::default(), &[])
                .of("n")
                .len()
                == 1
        );
        assert_eq!(
            MeshNetworks::parse("  \n").unwrap(),
            MeshNetworks::default()
        );
    }

    #[test]
    fn errors_quote_a_bounded_excerpt_of_the_input() {
        let long = "x".repeat(10_000);
        let cases = [
            format!("networks: {{n: {{endpoints: [{long}]}}}}"),
            format!("networks: {{{long}: {{endpoints: [{{}}]}}}}"),
            format!("networks: {{n: {{gateways: [{{address: {long}, port: 1}}]}}}}"),
        ];
        for yaml in cases {
            let err = MeshNetworks::parse(&yaml).unwrap_err().to_string();
            assert!(err.len() < 1000, "{} bytes: {err}", err.len());
        }
    }
}
