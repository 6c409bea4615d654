//! Trimmed Kubernetes objects → model Services and Endpoints, with Istio's rules.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::Arc;

use super::objects::{
    NamespaceObj, NodeObj, PodObj, ServiceObj, SliceObj, LABEL_LOCALITY, LABEL_NETWORK,
    LABEL_TLS_MODE,
};
use super::pods::PodIndex;
use super::workload::canonical_service;
use crate::model::{
    pod_uid, ClusterId, DnsTarget, Endpoint, Health, Locality, MeshNaming, MeshNetworks, Registry,
    Resolution, Service, TlsMode, UseWaypoint, Workload,
};

/// `(namespace, name)` of a namespaced object.
pub type NsName = (String, String);

/// A Service's definition; `namespace` is its Namespace, when the cluster has it.
pub fn service(
    obj: &ServiceObj,
    namespace: Option<&NamespaceObj>,
    cluster: &ClusterId,
    naming: &MeshNaming,
) -> Service {
    let resolution = if obj.external_name.is_some() {
        Resolution::Dns { round_robin: false }
    } else if obj.headless {
        Resolution::Passthrough
    } else {
        Resolution::ClientSideLb
    };
    let dns_targets = obj
        .external_name
        .iter()
        .map(|host| DnsTarget {
            host: host.clone(),
            ports: BTreeMap::new(),
            weight: 1,
            locality: None,
        })
        .collect();
    Service {
        hostname: naming.hostname(&obj.name, &obj.namespace),
        name: obj.name.clone(),
        namespace: Arc::from(obj.namespace.as_str()),
        registry: Registry::Kubernetes,
        ports: obj.ports.clone(),
        cluster_vips: BTreeMap::from([(cluster.clone(), obj.cluster_ips.clone())]),
        labels: obj.labels.clone(),
        resolution,
        dns_targets,
        external_addresses: obj.external_addresses.clone(),
        mesh_external: false,
        export_to: obj.export_to.clone(),
        subject_alt_names: Vec::new(),
        auto_addresses: Vec::new(),
        use_waypoint: UseWaypoint::from_labels(&obj.labels, &obj.namespace)
            .or_else(|| namespace.and_then(|ns| ns.use_waypoint.clone())),
    }
}

/// What endpoint conversion reads from the rest of the cluster.
pub struct EndpointContext<'a> {
    pub cluster: &'a ClusterId,
    pub naming: &'a MeshNaming,
    pub pods: &'a PodIndex,
    pub nodes: &'a HashMap<String, NodeObj>,
    pub namespaces: &'a HashMap<String, NamespaceObj>,
    /// The cluster's network: its system namespace's label, else MeshNetworks `fromRegistry`.
    pub cluster_network: Option<&'a str>,
    /// MeshNetworks, for `fromCidr` when nothing else names an endpoint's network.
    pub networks: &'a MeshNetworks,
    pub shared: SharedParts<'a>,
}

/// What the endpoints of one conversion hold once between them instead of once per pod: the pods of
/// a workload share an identity, and most share a network and a locality (often none).
#[derive(Default)]
pub struct SharedParts<'a> {
    /// Identities by (namespace, service account).
    identities: RefCell<HashMap<(&'a str, &'a str), Arc<str>>>,
    /// Networks (and the empty string) by name.
    names: RefCell<HashMap<&'a str, Arc<str>>>,
    /// Localities by their label's text (`""`: none).
    localities: RefCell<HashMap<&'a str, Arc<Locality>>>,
}

impl<'a> SharedParts<'a> {
    fn identity(&self, naming: &MeshNaming, pod: &'a PodObj) -> Arc<str> {
        let key = (&*pod.namespace, &*pod.service_account);
        self.identities
            .borrow_mut()
            .entry(key)
            .or_insert_with(|| Arc::from(naming.spiffe_id(key.0, key.1)))
            .clone()
    }

    fn name(&self, name: &'a str) -> Arc<str> {
        self.names
            .borrow_mut()
            .entry(name)
            .or_insert_with(|| Arc::from(name))
            .clone()
    }

    /// The locality an `istio-locality` label (`region.zone.subzone`) names.
    fn locality(&self, label: &'a str) -> Arc<Locality> {
        if let Some(known) = self.localities.borrow().get(label) {
            return known.clone();
        }
        let locality = Arc::new(match label {
            "" => Locality {
                region: self.name(""),
                zone: self.name(""),
                subzone: self.name(""),
            },
            _ => Locality::parse(&label.replace('.', "/")),
        });
        self.localities.borrow_mut().insert(label, locality.clone());
        locality
    }
}

impl<'a> EndpointContext<'a> {
    /// Appends the endpoints of one slice. An endpoint whose `targetRef` pod is not known yet is
    /// left out: it is added when the pod arrives (Istio's pending-pod rule).
    pub fn slice_endpoints(&self, slice: &'a SliceObj, out: &mut Vec<Endpoint>) {
        // One allocation per port name, shared by every endpoint of the slice.
        let port_names: Vec<Arc<str>> = slice
            .ports
            .iter()
            .map(|(name, _)| Arc::from(name.as_str()))
            .collect();
        for ep in &slice.endpoints {
            let pod = match &ep.pod {
                Some(name) => match self.pods.get(&slice.namespace, name) {
                    Some(pod) => Some(pod),
                    None => continue,
                },
                None => (ep.addresses.first()).and_then(|ip| self.pods.at(&slice.namespace, *ip)),
            };
            let mut template = self.template(
                pod,
                Health::from_conditions(ep.ready, ep.serving, ep.terminating),
            );
            template.hostname = ep.hostname.clone();
            for address in &ep.addresses {
                let network = match &*template.network {
                    "" => self.networks.network_of_address(*address).map(Arc::from),
                    _ => None,
                };
                for ((_, port), port_name) in slice.ports.iter().zip(&port_names) {
                    out.push(Endpoint {
                        address: *address,
                        port: *port,
                        service_port_name: port_name.clone(),
                        network: network.clone().unwrap_or_else(|| template.network.clone()),
                        ..template.clone()
                    });
                }
            }
        }
    }

    /// The endpoints of a pod a ServiceEntry selects: each of its addresses on each port of the entry
    /// (`(port name, the workload's port)`), healthy while the pod is ready.
    pub fn pod_endpoints(
        &self,
        pod: &'a PodObj,
        ports: &[(Arc<str>, u16)],
        out: &mut Vec<Endpoint>,
    ) {
        let health = match pod.ready {
            true => Health::Healthy,
            false => Health::Unhealthy,
        };
        let template = self.template(Some(pod), health);
        for address in &pod.ips {
            let network = match &*template.network {
                "" => self.networks.network_of_address(*address).map(Arc::from),
                _ => None,
            };
            for (port_name, port) in ports {
                out.push(Endpoint {
                    address: *address,
                    port: *port,
                    service_port_name: port_name.clone(),
                    network: network.clone().unwrap_or_else(|| template.network.clone()),
                    ..template.clone()
                });
            }
        }
    }

    /// A running pod with an address as ambient mode's workload, its network and locality read as
    /// its endpoints' are.
    pub fn workload(&self, pod: &'a PodObj) -> Option<Workload> {
        let first = *pod.ips.first()?;
        if pod.terminal {
            return None;
        }
        let template = self.template(Some(pod), Health::Healthy);
        let network = match &*template.network {
            "" => self.networks.network_of_address(first).map(Arc::from),
            _ => None,
        };
        let (canonical_name, canonical_revision): (Arc<str>, Arc<str>) = {
            let (name, revision) = canonical_service(&pod.labels, &template.workload);
            (name.into(), revision.into())
        };
        Some(Workload {
            uid: pod_uid(self.cluster, &pod.namespace, &pod.name).into(),
            canonical_name,
            canonical_revision,
            name: pod.name.clone(),
            namespace: pod.namespace.clone(),
            cluster_id: self.cluster.clone(),
            addresses: pod.ips.clone(),
            network: network.unwrap_or(template.network),
            service_account: pod.service_account.clone(),
            node: pod.node.clone(),
            labels: pod.labels.clone(),
            workload_name: template.workload,
            locality: template.locality,
            healthy: pod.ready,
            capacity: None,
            captured: pod.captured,
            host_network: pod.host_network,
            use_waypoint: UseWaypoint::from_labels(&pod.labels, &pod.namespace).or_else(|| {
                let namespace = self.namespaces.get(&*pod.namespace)?;
                namespace.use_waypoint.clone()
            }),
        })
    }

    /// The per-workload part of an endpoint, shared by each of its addresses and ports.
    fn template(&self, pod: Option<&'a PodObj>, health: Health) -> Endpoint {
        let label = |key: &str| pod.and_then(|p| p.labels.get(key)).map(String::as_str);
        let network = label(LABEL_NETWORK)
            .or(self.cluster_network)
            .unwrap_or_default();
        let shared = &self.shared;
        let locality = match label(LABEL_LOCALITY) {
            Some(l) => shared.locality(l),
            None => pod
                .and_then(|p| p.node.as_ref())
                .and_then(|n| self.nodes.get(&**n))
                .map(|n| n.locality.clone())
                .unwrap_or_else(|| shared.locality("")),
        };
        Endpoint {
            address: IpAddr::from([0, 0, 0, 0]),
            port: 0,
            service_port_name: shared.name(""),
            labels: pod.map(|p| p.labels.clone()).unwrap_or_default(),
            service_account: match pod {
                Some(p) => shared.identity(self.naming, p),
                None => shared.name(""),
            },
            network: shared.name(network),
            locality,
            cluster_id: self.cluster.clone(),
            tls_mode: if label(LABEL_TLS_MODE) == Some("istio") {
                TlsMode::Istio
            } else {
                TlsMode::Disabled
            },
            health,
            workload: match pod {
                Some(p) if p.workload.is_empty() => p.name.clone(),
                Some(p) => p.workload.clone(),
                None => shared.name(""),
            },
            weight: 1,
            hostname: None,
        }
    }
}
