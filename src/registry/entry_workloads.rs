//! WorkloadEntries and ServiceEntries' inline endpoints as ambient mode's workloads (VMs and other
//! workloads outside Kubernetes), as istiod builds them (pilot/pkg/serviceregistry/ambient/
//! workloads.go): every one with an IP address, under the config source it came from, healthy, its
//! weight as capacity. Re-derived with the ServiceEntry registry whenever entries change.

use std::net::IpAddr;
use std::sync::Arc;

use super::objects::ANNOTATION_REDIRECTION;
use super::service_entries::source_cluster;
use super::workload::canonical_service;
use crate::istio::service_entry::WorkloadEntry;
use crate::istio::{ConfigKind, ConfigObject, Spec};
use crate::model::{entry_uid, Locality, MeshNetworks, MeshSnapshot, UseWaypoint, Workload};

/// Writes every entry's workload; returns the uids that changed.
pub fn sync(mesh: &mut MeshSnapshot) -> Vec<Arc<str>> {
    let networks = &mesh.networks;
    let entries = mesh.config.of_kind(ConfigKind::WorkloadEntry);
    let mut workloads: Vec<Workload> = entries
        .filter_map(|object| match &object.spec {
            Spec::WorkloadEntry(entry) => {
                let uid = entry_uid(
                    &source_cluster(object),
                    &object.key.namespace,
                    &object.key.name,
                );
                workload(object, entry, uid, networks)
            }
            _ => None,
        })
        .collect();
    for object in mesh.config.of_kind(ConfigKind::ServiceEntry) {
        let Spec::ServiceEntry(service_entry) = &object.spec else {
            continue;
        };
        for endpoint in &service_entry.endpoints {
            // istiod's uid of an inline endpoint: the entry's, then the endpoint's address.
            let uid = format!(
                "{}/networking.istio.io/ServiceEntry/{}/{}/{}",
                source_cluster(object),
                object.key.namespace,
                object.key.name,
                endpoint.address
            );
            workloads.extend(workload(object, endpoint, uid, networks));
        }
    }
    mesh.workloads.set_entries(workloads)
}

/// The workload of an entry (a WorkloadEntry, or an endpoint of the ServiceEntry `object`).
fn workload(
    object: &ConfigObject,
    entry: &WorkloadEntry,
    uid: String,
    networks: &MeshNetworks,
) -> Option<Workload> {
    // An entry named by a host name is resolved by DNS, not reached by ztunnel's address.
    let address = entry.address.parse::<IpAddr>().ok()?;
    let (namespace, name) = (&object.key.namespace, &object.key.name);
    let network = match entry.network.as_str() {
        "" => networks.network_of_address(address).unwrap_or_default(),
        network => network,
    };
    let (canonical_name, canonical_revision) = canonical_service(&entry.labels, name);
    let captured = object.meta.annotations.get(ANNOTATION_REDIRECTION);
    Some(Workload {
        uid: uid.into(),
        name: Arc::from(&**name),
        namespace: namespace.clone(),
        cluster_id: source_cluster(object),
        addresses: vec![address],
        network: network.into(),
        service_account: match entry.service_account.as_str() {
            "" => "default".into(),
            sa => sa.into(),
        },
        node: None,
        labels: Arc::new(entry.labels.clone()),
        workload_name: Arc::from(&**name),
        canonical_name: canonical_name.into(),
        canonical_revision: canonical_revision.into(),
        locality: Arc::new(Locality::parse(&entry.locality)),
        healthy: true,
        capacity: (entry.weight > 0).then_some(entry.weight),
        captured: captured.is_some_and(|v| v == "enabled"),
        host_network: false,
        // As istiod: a WorkloadEntry's own labels, a ServiceEntry endpoint's labels.
        use_waypoint: UseWaypoint::from_labels(
            match object.key.kind {
                ConfigKind::WorkloadEntry => &object.meta.labels,
                _ => &entry.labels,
            },
            namespace,
        ),
    })
}
