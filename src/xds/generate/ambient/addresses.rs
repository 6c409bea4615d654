//! `istio.workload.Address` resources: every pod as a Workload, every service as a Service, named
//! as istiod names them (pilot/pkg/serviceregistry/ambient/{workloads,services,multicluster}.go).
//!
//! A ztunnel reaches pods of its own network directly; those of another network only through that
//! network's gateway. So a ztunnel is sent its own network's pods one by one, and for each service
//! with endpoints on another network one split-horizon workload per gateway of that network: no
//! address, the service's ports, as many endpoints as it stands for (`capacity`), and the gateway
//! to tunnel through (double HBONE on the gateway's 15008).
//!
//! Each resource is built on its own, so a change rebuilds only the resources it names.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use prost::Message;

use crate::model::{Gateway, Health, MeshSnapshot, Service, ServiceKey, Workload};
use crate::security::identity::Identity;
use crate::xds::istio_protos::workload as pb;
use crate::xds::protocol::ADDRESS_TYPE;
use crate::xds::wire::Resource;

/// The port a network's gateway takes HBONE on (istiod's default when its Gateway names none).
pub const HBONE_PORT: u32 = 15008;

/// What the resources of one ztunnel's network are built from.
pub(super) struct Addresses<'a> {
    mesh: &'a MeshSnapshot,
    network: &'a str,
    trust_domain: &'a str,
}

impl<'a> Addresses<'a> {
    pub(super) fn new(mesh: &'a MeshSnapshot, network: &'a str) -> Self {
        let trust_domain = match mesh.config.mesh().trust_domain.as_str() {
            "cluster.local" => "",
            other => other,
        };
        Self {
            mesh,
            network,
            trust_domain,
        }
    }

    /// Every Address: workloads, split-horizon workloads, then services.
    pub(super) fn all(&self) -> Vec<Arc<Resource>> {
        let workloads = self.mesh.workloads.iter();
        let own = workloads.filter(|w| *w.network == *self.network);
        let mut out: Vec<Arc<Resource>> = own.map(|w| self.workload(w)).collect();
        for (key, _) in self.mesh.endpoints.sorted() {
            out.extend(self.split_horizon(&key));
        }
        let gateways = self.mesh.gateways.by_network.values().flatten();
        out.extend(gateways.filter_map(|g| self.network_gateway(g)));
        let mut services: Vec<Arc<Resource>> = (self.mesh.services.all().iter())
            .map(|s| service_resource(self.mesh, s))
            .collect();
        services.sort_by(|a, b| a.name.cmp(&b.name));
        out.extend(services);
        out
    }

    /// The resource of this exact name, if it exists for this network.
    pub(super) fn one(&self, name: &str) -> Option<Arc<Resource>> {
        if let Some(workload) = self.mesh.workloads.get(name) {
            return (*workload.network == *self.network).then(|| self.workload(workload));
        }
        if name.starts_with(NETWORK_GATEWAY) {
            let mut gateways = self.mesh.gateways.by_network.values().flatten();
            let gateway = gateways.find(|g| network_gateway_uid(g) == name)?;
            return self.network_gateway(gateway);
        }
        if let Some((_, rest)) = name.split_once(SPLIT_HORIZON) {
            let (_, service) = rest.split_once('/')?;
            let (namespace, host) = service.split_once('/')?;
            let key = ServiceKey {
                hostname: host.into(),
                namespace: namespace.into(),
            };
            return self
                .split_horizon(&key)
                .into_iter()
                .find(|r| *r.name == *name);
        }
        let (namespace, host) = name.split_once('/')?;
        let service = self.mesh.services.get(host)?;
        (*service.namespace == *namespace).then(|| service_resource(self.mesh, service))
    }

    /// What a name a ztunnel looked up resolves to: the resource of that name (a service's with
    /// the workloads behind it), else the workload holding `<network>/<ip>`, else the service
    /// whose VIP it is with the workloads behind it.
    pub(super) fn lookup(&self, name: &str) -> Vec<Arc<Resource>> {
        let service_named = |found: Arc<Resource>| match self.mesh.services.get(host_of(name)) {
            Some(service) if is_service_name(name, service) => {
                let mut out = vec![found];
                out.extend(self.behind(service));
                out
            }
            _ => vec![found],
        };
        if let Some(found) = self.one(name) {
            return service_named(found);
        }
        let Some((network, ip)) = name
            .split_once('/')
            .and_then(|(network, ip)| Some((network, ip.parse::<IpAddr>().ok()?)))
        else {
            return Vec::new();
        };
        if let Some(workload) = self.mesh.workloads.at(network, ip) {
            return self.one(&workload.uid).into_iter().collect();
        }
        let vip = |s: &&Arc<Service>| s.cluster_vips.values().flatten().any(|v| *v == ip);
        let all = self.mesh.services.all();
        let Some(service) = all.iter().find(vip) else {
            return Vec::new();
        };
        let mut out = vec![service_resource(self.mesh, service)];
        out.extend(self.behind(service));
        out
    }

    /// The workloads behind a service for this network: its own network's pods with endpoints of
    /// it, and its split-horizon workloads.
    fn behind(&self, service: &Service) -> Vec<Arc<Resource>> {
        let key = service.key();
        let mut at: BTreeSet<(&str, IpAddr)> = BTreeSet::new();
        if let Some(shards) = self.mesh.endpoints.get(&key) {
            at.extend(
                shards
                    .endpoints()
                    .map(|e| (e.cluster_id.as_str(), e.address)),
            );
        }
        let workloads = self.mesh.workloads.iter().filter(|w| {
            *w.network == *self.network
                && w.addresses
                    .iter()
                    .any(|ip| at.contains(&(w.cluster_id.as_str(), *ip)))
        });
        let mut out: Vec<Arc<Resource>> = workloads.map(|w| self.workload(w)).collect();
        out.extend(self.split_horizon(&key));
        out
    }

    fn workload(&self, w: &Workload) -> Arc<Resource> {
        let locality = (!w.locality.region.is_empty()).then(|| pb::Locality {
            region: w.locality.region.to_string(),
            zone: w.locality.zone.to_string(),
            subzone: w.locality.subzone.to_string(),
        });
        let message = pb::Workload {
            uid: w.uid.to_string(),
            name: w.name.to_string(),
            namespace: w.namespace.to_string(),
            addresses: w.addresses.iter().map(ip_bytes).collect(),
            network: w.network.to_string(),
            tunnel_protocol: match w.captured {
                true => pb::TunnelProtocol::Hbone as i32,
                false => pb::TunnelProtocol::None as i32,
            },
            trust_domain: self.trust_domain.to_string(),
            service_account: w.service_account.to_string(),
            node: w.node.as_deref().unwrap_or_default().to_string(),
            canonical_name: w.canonical_name.to_string(),
            canonical_revision: w.canonical_revision.to_string(),
            workload_type: pb::WorkloadType::Pod as i32,
            workload_name: w.workload_name.to_string(),
            services: self.ports_of(w),
            waypoint: super::waypoint_refs::of_workload(self.mesh, w),
            authorization_policies: super::authorization::workload_policies(self.mesh, w),
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
        };
        address(&w.uid, pb::address::Type::Workload(message))
    }

    /// The services a workload backs, each with its port and the port the workload's endpoint
    /// listens on (read from the endpoints, which resolved named target ports).
    fn ports_of(&self, w: &Workload) -> BTreeMap<String, pb::PortList> {
        let mut out: BTreeMap<String, pb::PortList> = BTreeMap::new();
        for ip in &w.addresses {
            for key in self.mesh.endpoints.services_at(ip) {
                let (Some(service), Some(shards)) = (
                    self.mesh.services.get(&key.hostname),
                    self.mesh.endpoints.get(&key),
                ) else {
                    continue;
                };
                // Shards are sorted by address: the workload's entries are found, not scanned for.
                let of_cluster = shards
                    .shards
                    .iter()
                    .filter(|(k, _)| k.cluster == w.cluster_id);
                let mine = of_cluster.flat_map(|(_, eps)| {
                    let from = eps.partition_point(|e| e.address < *ip);
                    eps[from..].iter().take_while(|e| e.address == *ip)
                });
                for endpoint in mine {
                    let Some(port) = service.port_named(&endpoint.service_port_name) else {
                        continue;
                    };
                    let name = format!("{}/{}", key.namespace, key.hostname);
                    add_port(
                        &mut out.entry(name).or_default().ports,
                        port.port,
                        endpoint.port,
                    );
                }
            }
        }
        out
    }

    /// A service's split-horizon workloads for this network: one per gateway of each other network
    /// with healthy endpoints of it; none for a network without a gateway (unreachable from here),
    /// nor for a gateway's own Service.
    fn split_horizon(&self, key: &ServiceKey) -> Vec<Arc<Resource>> {
        // A gateway's own Service is how other networks enter its network, not a destination.
        let mut gateways = self.mesh.gateways.by_network.values().flatten();
        if gateways.any(|g| g.service.as_ref() == Some(&key.hostname)) {
            return Vec::new();
        }
        let (Some(service), Some(shards)) = (
            self.mesh.services.get(&key.hostname),
            self.mesh.endpoints.get(key),
        ) else {
            return Vec::new();
        };
        // Per remote network: healthy endpoints (one per address) and the ports they listen on.
        let mut remote: BTreeMap<&str, (BTreeSet<IpAddr>, Vec<pb::Port>)> = BTreeMap::new();
        for endpoint in shards.endpoints() {
            if *endpoint.network == *self.network || endpoint.health != Health::Healthy {
                continue;
            }
            let Some(port) = service.port_named(&endpoint.service_port_name) else {
                continue;
            };
            let (addresses, ports) = remote.entry(&endpoint.network).or_default();
            addresses.insert(endpoint.address);
            add_port(ports, port.port, endpoint.port);
        }
        let mut out = Vec::new();
        for (network, (addresses, ports)) in remote {
            for gateway in self.mesh.gateways.of(network) {
                let capacity = addresses.len();
                out.push(self.split_horizon_workload(key, network, gateway, capacity, &ports));
            }
        }
        out
    }

    fn split_horizon_workload(
        &self,
        service: &ServiceKey,
        network: &str,
        gateway: &Gateway,
        capacity: usize,
        ports: &[pb::Port],
    ) -> Arc<Resource> {
        let uid = split_horizon_uid(network, &gateway.address, service);
        let message = pb::Workload {
            uid: uid.clone(),
            name: uid.clone(),
            namespace: service.namespace.to_string(),
            network: network.to_string(),
            tunnel_protocol: pb::TunnelProtocol::Hbone as i32,
            trust_domain: self.trust_domain.to_string(),
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
                format!("{}/{}", service.namespace, service.hostname),
                pb::PortList {
                    ports: ports.to_vec(),
                },
            )]),
            cluster_id: gateway
                .cluster
                .as_ref()
                .map(|c| c.to_string())
                .unwrap_or_default(),
            capacity: Some(u32::try_from(capacity).unwrap_or(u32::MAX)),
            ..Default::default()
        };
        address(&uid, pb::address::Type::Workload(message))
    }
}

/// A network's gateway as a workload, so that ztunnels tunnelling through it know whom to expect
/// (istiod's `convertGateway`): its address, network and the identity of the pods behind its
/// Service. None for a gateway known only by address (MeshNetworks), or whose Service has no
/// endpoints yet.
impl Addresses<'_> {
    fn network_gateway(&self, gateway: &Gateway) -> Option<Arc<Resource>> {
        let (cluster, host) = (gateway.cluster.as_ref()?, gateway.service.as_ref()?);
        let service = self.mesh.services.get(host)?;
        let shards = self.mesh.endpoints.get(&service.key())?;
        let mut identities = shards.endpoints().filter(|e| e.cluster_id == *cluster);
        let identity = identities.find_map(|e| Identity::parse(&e.service_account))?;
        let uid = network_gateway_uid(gateway);
        let message = pb::Workload {
            uid: uid.clone(),
            name: uid.clone(),
            namespace: identity.namespace,
            addresses: vec![ip_bytes(&gateway.address)],
            network: gateway.network.to_string(),
            tunnel_protocol: pb::TunnelProtocol::Hbone as i32,
            trust_domain: self.trust_domain.to_string(),
            service_account: identity.service_account,
            workload_type: pb::WorkloadType::Pod as i32,
            cluster_id: cluster.to_string(),
            ..Default::default()
        };
        Some(address(&uid, pb::address::Type::Workload(message)))
    }
}

/// What starts a network gateway's uid: `NetworkGateway/<network>/<address>/<HBONE port>`.
const NETWORK_GATEWAY: &str = "NetworkGateway/";

pub(super) fn network_gateway_uid(gateway: &Gateway) -> String {
    format!(
        "{NETWORK_GATEWAY}{}/{}/{HBONE_PORT}",
        gateway.network, gateway.address
    )
}

/// What marks a split-horizon workload's uid: `<network>/SplitHorizonWorkload/<gateway>/<ns>/<host>`.
const SPLIT_HORIZON: &str = "/SplitHorizonWorkload/";

pub(super) fn split_horizon_uid(network: &str, gateway: &IpAddr, service: &ServiceKey) -> String {
    format!(
        "{network}{SPLIT_HORIZON}{gateway}/{}/{}",
        service.namespace, service.hostname
    )
}

/// `<namespace>/<hostname>`: a service's resource name and its key in a workload's `services`.
pub(super) fn service_name(service: &Service) -> String {
    format!("{}/{}", service.namespace, service.hostname)
}

fn host_of(name: &str) -> &str {
    name.split_once('/').map_or("", |(_, host)| host)
}

fn is_service_name(name: &str, service: &Service) -> bool {
    name.split_once('/')
        .is_some_and(|(ns, host)| *service.namespace == *ns && *service.hostname == *host)
}

fn add_port(ports: &mut Vec<pb::Port>, service_port: u16, target_port: u16) {
    let entry = pb::Port {
        service_port: u32::from(service_port),
        target_port: u32::from(target_port),
        app_protocol: 0,
    };
    if !ports.contains(&entry) {
        ports.push(entry);
    }
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

/// A service with the VIPs of every cluster that defines it, each on that cluster's network.
fn service_resource(mesh: &MeshSnapshot, s: &Service) -> Arc<Resource> {
    let mut addresses: Vec<pb::NetworkAddress> = s
        .cluster_vips
        .iter()
        .flat_map(|(cluster, vips)| {
            let network = mesh.cluster_network(cluster);
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
    let message = pb::Service {
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
        waypoint: super::waypoint_refs::of_service(mesh, s),
        ip_families: match (v4, v6) {
            (true, true) => pb::IpFamilies::Dual as i32,
            (true, false) => pb::IpFamilies::Ipv4Only as i32,
            (false, true) => pb::IpFamilies::Ipv6Only as i32,
            (false, false) => pb::IpFamilies::Automatic as i32,
        },
        canonical: true,
        ..Default::default()
    };
    address(&service_name(s), pb::address::Type::Service(message))
}
