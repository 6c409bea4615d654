//! The waypoint a service or workload sends ztunnel to (the model decides which,
//! `MeshSnapshot::service_waypoint`), referenced by its Service's hostname on HBONE's port, as
//! istiod references waypoints whose Gateway reports a Hostname address.

use crate::model::waypoints::HBONE_PORT;
use crate::model::{MeshSnapshot, Service, Waypoint, Workload};
use crate::xds::istio_protos::workload as pb;

pub(super) fn of_service(mesh: &MeshSnapshot, service: &Service) -> Option<pb::GatewayAddress> {
    mesh.service_waypoint(service).map(|w| address(w))
}

pub(super) fn of_workload(mesh: &MeshSnapshot, workload: &Workload) -> Option<pb::GatewayAddress> {
    mesh.workload_waypoint(workload).map(|w| address(w))
}

fn address(waypoint: &Waypoint) -> pb::GatewayAddress {
    pb::GatewayAddress {
        destination: Some(pb::gateway_address::Destination::Hostname(
            pb::NamespacedHostname {
                namespace: waypoint.namespace.to_string(),
                hostname: waypoint.host.clone(),
            },
        )),
        hbone_mtls_port: u32::from(HBONE_PORT),
    }
}
