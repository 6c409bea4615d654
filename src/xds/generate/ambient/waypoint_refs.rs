//! Which waypoint a service or workload sends ztunnel to, as istiod's `fetchWaypointForTarget`
//! (pilot/pkg/serviceregistry/kube/controller/ambient/waypoints.go): the one its
//! `istio.io/use-waypoint` names (else its namespace's; `none` opts out of both), when that
//! Gateway is accepted, admits the object's namespace, serves its kind of traffic and is ready.
//!
//! Ready means its Service exists: ztunnel finds the waypoint's pods through it (the reference is
//! by hostname, as istiod's for Gateways reporting a Hostname address). istiod waits for the
//! Gateway's status addresses, which its deployment controller reports once the Service is there.

use crate::istio::gateway_api::GATEWAY_NAME_LABEL;
use crate::model::waypoints::{UseWaypoint, WaypointClass, HBONE_PORT};
use crate::model::{MeshSnapshot, Service, Waypoint, Workload};
use crate::xds::istio_protos::workload as pb;

/// The label istiod's deployment controller puts on a waypoint's Service and pods.
const MANAGED_LABEL: &str = "gateway.istio.io/managed";
const MANAGED_BY_MESH: &str = "istio.io-mesh-controller";

/// A service's waypoint; none for a waypoint's own Service (a waypoint has no waypoint).
pub(super) fn of_service(mesh: &MeshSnapshot, service: &Service) -> Option<pb::GatewayAddress> {
    if service.labels.get(MANAGED_LABEL).map(String::as_str) == Some(MANAGED_BY_MESH) {
        return None;
    }
    let waypoint = resolve(mesh, service.use_waypoint.as_ref()?, &service.namespace)?;
    waypoint
        .traffic
        .serves_services()
        .then(|| address(waypoint))
}

/// A workload's waypoint; none for a waypoint's own pods.
pub(super) fn of_workload(mesh: &MeshSnapshot, workload: &Workload) -> Option<pb::GatewayAddress> {
    let gateway_api = mesh.config.gateway_api();
    let instance = workload.labels.get(GATEWAY_NAME_LABEL);
    if instance.is_some_and(|name| gateway_api.waypoint(&workload.namespace, name).is_some()) {
        return None;
    }
    let waypoint = resolve(mesh, workload.use_waypoint.as_ref()?, &workload.namespace)?;
    waypoint
        .traffic
        .serves_workloads()
        .then(|| address(waypoint))
}

fn resolve<'m>(
    mesh: &'m MeshSnapshot,
    use_waypoint: &UseWaypoint,
    namespace: &str,
) -> Option<&'m Waypoint> {
    let UseWaypoint::Named {
        namespace: ns,
        name,
    } = use_waypoint
    else {
        return None;
    };
    let waypoint = mesh.config.gateway_api().waypoint(ns, name)?;
    let usable = waypoint.class == WaypointClass::Waypoint
        && waypoint.admits(namespace)
        && mesh.services.get(&waypoint.host).is_some();
    usable.then_some(&**waypoint)
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
