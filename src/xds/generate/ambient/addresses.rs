//! `istio.workload.Address` resources: every pod as a Workload, every service as a Service, named
//! as istiod names them (pilot/pkg/serviceregistry/ambient/{workloads,services,multicluster}.go).
//!
//! A ztunnel reaches pods of its own network directly; those of another network only through that
//! network's gateway. So a ztunnel is sent its own network's pods one by one, and for each service
//! with endpoints on another network one split-horizon workload per gateway of that network: no
//! address, the service's ports, as many endpoints as it stands for (`capacity`), and the gateway
//! to tunnel through (double HBONE on the gateway's 15008).

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::Arc;

use prost::Message;

use crate::model::{Health, MeshSnapshot, Service, ServiceKey, Workload};
use crate::xds::generate::generation::Generation;
use crate::xds::istio_protos::workload as pb;
use crate::xds::protocol::ADDRESS_TYPE;
use crate::xds::wire::Resource;

/// The port a network's gateway takes HBONE on (istiod's default when its Gateway names none).
pub const HBONE_PORT: u32 = 15008;

/// Every Address a ztunnel on `network` is sent, workloads then services, each sorted by name.
pub(super) fn build(mesh: &MeshSnapshot, network: &str) -> Vec<Arc<Resource>> {
    let trust_domain = match mesh.config.mesh().trust_domain.as_str() {
        "cluster.local" => "",
        other => other,
    };
    let ports = service_ports_by_workload(mesh);
    let mut out: Vec<Arc<Resource>> = Vec::new();
    for workload in mesh.workloads.iter() {
        if *workload.network != *network {
            continue;
        }
        let services = ports.get(&*workload.uid).cloned().unwrap_or_default();
        let mut message = workload_message(workload, services, trust_domain);
        message.authorization_policies = super::authorization::workload_policies(mesh, workload);
        out.push(address(&workload.uid, pb::address::Type::Workload(message)));
    }
    out.extend(split_horizon(mesh, network, trust_domain));
    let networks = cluster_networks(mesh);
    let mut services: Vec<Arc<Resource>> = mesh
        .services
        .all()
        .iter()
        .map(|s| {
            address(
                &service_name(s),
                pb::address::Type::Service(service(&networks, s)),
            )
        })
        .collect();
    services.sort_by(|a, b| a.name.cmp(&b.name));
    out.extend(services);
    out
}

/// What a name a ztunnel looked up resolves to within `all`.
pub(super) fn lookup<'a>(
    g: &Generation<'_>,
    all: &'a [Arc<Resource>],
    name: &str,
) -> Vec<&'a Arc<Resource>> {
    if let Some(found) = all.iter().find(|r| *r.name == *name) {
        // A service's name also brings the workloads behind it.
        let mut found = vec![found];
        if let Some(service) = g
            .mesh
            .services
            .get(name.split_once('/').map_or("", |(_, h)| h))
        {
            found.extend(behind(all, &service_name(service)));
        }
        return found;
    }
    let Some((_, ip)) = name.split_once('/') else {
        return Vec::new();
    };
    let Ok(ip) = ip.parse::<IpAddr>() else {
        return Vec::new();
    };
    if let Some(workload) = g.mesh.workloads.iter().find(|w| w.addresses.contains(&ip)) {
        return all.iter().filter(|r| r.name == workload.uid).collect();
    }
    let vip = |s: &&Arc<Service>| s.cluster_vips.values().flatten().any(|v| *v == ip);
    match g.mesh.services.all().iter().find(vip) {
        Some(service) => {
            let name = service_name(service);
            let own = all.iter().filter(|r| *r.name == *name);
            own.chain(behind(all, &name)).collect()
        }
        None => Vec::new(),
    }
}

/// The workloads whose `services` name `service`.
fn behind<'a>(all: &'a [Arc<Resource>], service: &str) -> Vec<&'a Arc<Resource>> {
    all.iter()
        .filter(|r| {
            let Ok(any) = prost_types::Any::decode(&r.any[..]) else {
                return false;
            };
            let decoded = pb::Address::decode(&any.value[..]).ok();
            matches!(decoded.and_then(|a| a.r#type), Some(pb::address::Type::Workload(w)) if w.services.contains_key(service))
        })
        .collect()
}

/// `<namespace>/<hostname>`: a service's resource name and its key in a workload's `services`.
fn service_name(service: &Service) -> String {
    format!("{}/{}", service.namespace, service.hostname)
}

fn address(name: &str, address: pb::address::Type) -> Arc<Resource> {
    let message = pb::Address {
        r#type: Some(address),
    };
    Arc::new(Resource::from_encoded(
        name,
        ADDRESS_TYPE,
        message.encode_to_vec(),
    ))
}

fn ip_bytes(ip: &IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(v4) => v4.octets().to_vec(),
        IpAddr::V6(v6) => v6.octets().to_vec(),
    }
}

/// For each pod (by uid), the ports of each service it backs: the service's port and the port its
/// endpoint listens on, read from the endpoints (which resolved named target ports).
fn service_ports_by_workload(mesh: &MeshSnapshot) -> HashMap<&str, BTreeMap<String, pb::PortList>> {
    let mut uid_at: HashMap<(&str, IpAddr), &str> = HashMap::new();
    for workload in mesh.workloads.iter() {
        for ip in &workload.addresses {
            uid_at.insert((workload.cluster_id.as_str(), *ip), &workload.uid);
        }
    }
    let mut ports: HashMap<&str, BTreeMap<String, pb::PortList>> = HashMap::new();
    for (key, shards) in mesh.endpoints.sorted() {
        let Some(service) = mesh.services.get(&key.hostname) else {
            continue;
        };
        let name = format!("{}/{}", key.namespace, key.hostname);
        for endpoint in shards.endpoints() {
            let at = (endpoint.cluster_id.as_str(), endpoint.address);
            let Some(uid) = uid_at.get(&at) else {
                continue;
            };
            let Some(port) = service
                .ports
                .iter()
                .find(|p| *p.name == *endpoint.service_port_name)
            else {
                continue;
            };
            let list = ports
                .entry(uid)
                .or_default()
                .entry(name.clone())
                .or_default();
            let entry = pb::Port {
                service_port: u32::from(port.port),
                target_port: u32::from(endpoint.port),
                app_protocol: 0,
            };
            if !list.ports.contains(&entry) {
                list.ports.push(entry);
            }
        }
    }
    ports
}

fn workload_message(
    w: &Workload,
    services: BTreeMap<String, pb::PortList>,
    trust_domain: &str,
) -> pb::Workload {
    let locality = (!w.locality.region.is_empty()).then(|| pb::Locality {
        region: w.locality.region.to_string(),
        zone: w.locality.zone.to_string(),
        subzone: w.locality.subzone.to_string(),
    });
    pb::Workload {
        uid: w.uid.to_string(),
        name: w.name.to_string(),
        namespace: w.namespace.to_string(),
        addresses: w.addresses.iter().map(ip_bytes).collect(),
        network: w.network.to_string(),
        tunnel_protocol: match w.captured {
            true => pb::TunnelProtocol::Hbone as i32,
            false => pb::TunnelProtocol::None as i32,
        },
        trust_domain: trust_domain.to_string(),
        service_account: w.service_account.to_string(),
        node: w.node.as_deref().unwrap_or_default().to_string(),
        canonical_name: w.canonical_name.to_string(),
        canonical_revision: w.canonical_revision.to_string(),
        workload_type: pb::WorkloadType::Pod as i32,
        workload_name: w.workload_name.to_string(),
        services,
        status: match w.healthy {
            true => pb::WorkloadStatus::Healthy as i32,
            false => pb::WorkloadStatus::Unhealthy as i32,
        },
        cluster_id: w.cluster_id.to_string(),
        capacity: w.capacity,
        locality,
        network_mode: match w.host_network {
            true => pb::NetworkMode::HostNetwork as i32,
            false => pb::NetworkMode::Standard as i32,
        },
        ..Default::default()
    }
}

/// One workload per (service, other network, gateway of that network) standing for the service's
/// healthy endpoints there; none for a network without a gateway (unreachable from here).
fn split_horizon(mesh: &MeshSnapshot, network: &str, trust_domain: &str) -> Vec<Arc<Resource>> {
    let mut out = Vec::new();
    for (key, shards) in mesh.endpoints.sorted() {
        let Some(service) = mesh.services.get(&key.hostname) else {
            continue;
        };
        // Per remote network: healthy endpoints (one per address) and the ports they listen on.
        let mut remote: BTreeMap<&str, (BTreeMap<IpAddr, ()>, Vec<pb::Port>)> = BTreeMap::new();
        for endpoint in shards.endpoints() {
            if *endpoint.network == *network || endpoint.health != Health::Healthy {
                continue;
            }
            let Some(port) = service
                .ports
                .iter()
                .find(|p| *p.name == *endpoint.service_port_name)
            else {
                continue;
            };
            let (addresses, ports) = remote.entry(&endpoint.network).or_default();
            addresses.insert(endpoint.address, ());
            let entry = pb::Port {
                service_port: u32::from(port.port),
                target_port: u32::from(endpoint.port),
                app_protocol: 0,
            };
            if !ports.contains(&entry) {
                ports.push(entry);
            }
        }
        for (remote_network, (addresses, ports)) in remote {
            for gateway in mesh.gateways.of(remote_network) {
                out.push(split_horizon_workload(
                    &key,
                    remote_network,
                    gateway,
                    addresses.len(),
                    &ports,
                    trust_domain,
                ));
            }
        }
    }
    out
}

fn split_horizon_workload(
    service: &ServiceKey,
    network: &str,
    gateway: &crate::model::Gateway,
    capacity: usize,
    ports: &[pb::Port],
    trust_domain: &str,
) -> Arc<Resource> {
    let gateway_cluster = gateway.cluster.as_ref().map(|c| c.to_string());
    let uid = format!(
        "{network}/SplitHorizonWorkload/{}/{}/{}",
        gateway.address, service.namespace, service.hostname
    );
    let service_key = format!("{}/{}", service.namespace, service.hostname);
    let message = pb::Workload {
        uid: uid.clone(),
        name: uid.clone(),
        namespace: service.namespace.to_string(),
        network: network.to_string(),
        tunnel_protocol: pb::TunnelProtocol::Hbone as i32,
        trust_domain: trust_domain.to_string(),
        network_gateway: Some(pb::GatewayAddress {
            destination: Some(pb::gateway_address::Destination::Address(
                pb::NetworkAddress {
                    network: network.to_string(),
                    address: ip_bytes(&gateway.address),
                },
            )),
            hbone_mtls_port: HBONE_PORT,
        }),
        workload_type: pb::WorkloadType::Pod as i32,
        services: BTreeMap::from([(
            service_key,
            pb::PortList {
                ports: ports.to_vec(),
            },
        )]),
        cluster_id: gateway_cluster.unwrap_or_default(),
        capacity: Some(u32::try_from(capacity).unwrap_or(u32::MAX)),
        ..Default::default()
    };
    address(&uid, pb::address::Type::Workload(message))
}

/// A service with the VIPs of every cluster that defines it, each on that cluster's network.
fn service(networks: &ClusterNetworks<'_>, s: &Service) -> pb::Service {
    let mut addresses: Vec<pb::NetworkAddress> = s
        .cluster_vips
        .iter()
        .flat_map(|(cluster, vips)| {
            let network = networks.of(cluster.as_str());
            vips.iter()
                .filter(|ip| !ip.is_unspecified())
                .map(move |ip| pb::NetworkAddress {
                    network: network.clone(),
                    address: ip_bytes(ip),
                })
        })
        .collect();
    addresses.sort_by(|a, b| (&a.network, &a.address).cmp(&(&b.network, &b.address)));
    addresses.dedup();
    let v4 = addresses.iter().any(|a| a.address.len() == 4);
    let v6 = addresses.iter().any(|a| a.address.len() == 16);
    pb::Service {
        name: s.name.clone(),
        namespace: s.namespace.to_string(),
        hostname: s.hostname.to_string(),
        addresses,
        ports: s
            .ports
            .iter()
            .map(|p| pb::Port {
                service_port: u32::from(p.port),
                target_port: p.target_port.map_or(0, u32::from),
                app_protocol: 0,
            })
            .collect(),
        subject_alt_names: s.subject_alt_names.clone(),
        ip_families: match (v4, v6) {
            (true, true) => pb::IpFamilies::Dual as i32,
            (true, false) => pb::IpFamilies::Ipv4Only as i32,
            (false, true) => pb::IpFamilies::Ipv6Only as i32,
            (false, false) => pb::IpFamilies::Automatic as i32,
        },
        canonical: true,
        ..Default::default()
    }
}

/// Each cluster's network: that of its pods (the registry reads it from the system namespace's
/// label or MeshNetworks), else MeshNetworks' `fromRegistry`.
pub(super) struct ClusterNetworks<'a> {
    of_pods: HashMap<&'a str, &'a str>,
    mesh: &'a MeshSnapshot,
}

pub(super) fn cluster_networks(mesh: &MeshSnapshot) -> ClusterNetworks<'_> {
    let mut of_pods = HashMap::new();
    for workload in mesh.workloads.iter() {
        of_pods
            .entry(workload.cluster_id.as_str())
            .or_insert(&*workload.network);
    }
    ClusterNetworks { of_pods, mesh }
}

impl ClusterNetworks<'_> {
    pub(super) fn of(&self, cluster: &str) -> String {
        let known = self.of_pods.get(cluster).copied();
        known
            .or_else(|| self.mesh.networks.network_of_registry(cluster))
            .unwrap_or_default()
            .to_string()
    }
}
