//! WorkloadEntries as ambient mode's workloads (VMs and other workloads outside Kubernetes), as
//! istiod builds them (pilot/pkg/serviceregistry/ambient/workloads.go): every entry with an IP
//! address, under the config source it came from, healthy, its weight as capacity. Re-derived with
//! the ServiceEntry registry whenever entries change.

use std::net::IpAddr;
use std::sync::Arc;

use super::objects::ANNOTATION_REDIRECTION;
use super::service_entries::source_cluster;
use super::workload::canonical_service;
use crate::istio::{ConfigKind, Spec};
use crate::model::{entry_uid, Locality, MeshSnapshot, Workload};

/// Writes every WorkloadEntry's workload; returns whether any changed.
pub fn sync(mesh: &mut MeshSnapshot) -> bool {
    let mut workloads = Vec::new();
    for object in mesh.config.of_kind(ConfigKind::WorkloadEntry) {
        let Spec::WorkloadEntry(entry) = &object.spec else {
            continue;
        };
        // An entry named by a host name is resolved by DNS, not reached by ztunnel's address.
        let Ok(address) = entry.address.parse::<IpAddr>() else {
            continue;
        };
        let (namespace, name) = (&object.key.namespace, &object.key.name);
        let cluster = source_cluster(object);
        let network = match entry.network.as_str() {
            "" => mesh
                .networks
                .network_of_address(address)
                .unwrap_or_default(),
            network => network,
        };
        let (canonical_name, canonical_revision) = canonical_service(&entry.labels, name);
        let captured = object.meta.annotations.get(ANNOTATION_REDIRECTION);
        workloads.push(Workload {
            uid: entry_uid(&cluster, namespace, name).into(),
            name: Arc::from(&**name),
            namespace: namespace.clone(),
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
            cluster_id: cluster,
        });
    }
    mesh.workloads.set_entries(workloads)
}
