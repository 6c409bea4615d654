//! Waypoints: the proxies that serve a service's (or workload's) traffic in ambient mode, and the
//! east-west gateways that take a network's HBONE traffic in. Both are Gateway API Gateways of
//! Istio's ambient classes (compiled in `model/config/gateway_api/waypoints`); services and
//! workloads name theirs with `istio.io/use-waypoint`, read here.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::{MeshSnapshot, Service, Workload};
use crate::istio::gateway_api::{GATEWAY_NAME_LABEL, MANAGED_BY_MESH_CONTROLLER, MANAGED_LABEL};

/// The label naming the waypoint of an object (or, on a Namespace, of its objects).
pub const USE_WAYPOINT_LABEL: &str = "istio.io/use-waypoint";
/// The namespace of the waypoint `istio.io/use-waypoint` names; the object's own by default.
pub const USE_WAYPOINT_NAMESPACE_LABEL: &str = "istio.io/use-waypoint-namespace";
/// On a waypoint Gateway (or its class): which traffic it serves.
pub const WAYPOINT_FOR_LABEL: &str = "istio.io/waypoint-for";
/// The class of waypoints, and of east-west gateways (Istio's built-in names).
pub const WAYPOINT_CLASS: &str = "istio-waypoint";
pub const EAST_WEST_CLASS: &str = "istio-east-west";
/// The controllers of those classes, for GatewayClasses of other names.
pub const WAYPOINT_CONTROLLER: &str = "istio.io/mesh-controller";
pub const EAST_WEST_CONTROLLER: &str = "istio.io/eastwest-controller";
pub use crate::istio::gateway_api::{HBONE_PORT, HBONE_PROTOCOL};

/// What an object's `istio.io/use-waypoint` says.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum UseWaypoint {
    /// `none`: no waypoint, not even its namespace's.
    OptedOut,
    Named {
        namespace: Arc<str>,
        name: Arc<str>,
    },
}

impl UseWaypoint {
    /// Read from an object's labels; the waypoint is in `namespace` (the object's) unless
    /// `istio.io/use-waypoint-namespace` names another.
    pub fn from_labels(labels: &BTreeMap<String, String>, namespace: &str) -> Option<Self> {
        let name = labels.get(USE_WAYPOINT_LABEL)?;
        if name == "none" {
            return Some(UseWaypoint::OptedOut);
        }
        let namespace = labels
            .get(USE_WAYPOINT_NAMESPACE_LABEL)
            .map_or(namespace, String::as_str);
        Some(UseWaypoint::Named {
            namespace: namespace.into(),
            name: name.as_str().into(),
        })
    }
}

/// Which traffic a waypoint serves (`istio.io/waypoint-for`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrafficType {
    Service,
    Workload,
    All,
    None,
}

impl TrafficType {
    pub fn parse(value: &str) -> Option<Self> {
        match value {
            "service" => Some(Self::Service),
            "workload" => Some(Self::Workload),
            "all" => Some(Self::All),
            "none" => Some(Self::None),
            _ => None,
        }
    }

    pub fn serves_services(self) -> bool {
        matches!(self, Self::Service | Self::All)
    }

    pub fn serves_workloads(self) -> bool {
        matches!(self, Self::Workload | Self::All)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaypointClass {
    /// Serves the services and workloads that name it.
    Waypoint,
    /// Takes other networks' double-HBONE traffic to its network's services.
    EastWest,
}

/// A Gateway of an ambient class, accepted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Waypoint {
    pub namespace: Arc<str>,
    pub name: Arc<str>,
    pub class: WaypointClass,
    pub traffic: TrafficType,
    /// Its HBONE listener admits objects of every namespace (`allowedRoutes.namespaces.from:
    /// All`), not only its own.
    pub from_all_namespaces: bool,
    /// Its `topology.istio.io/network` label: the network an east-west gateway takes traffic
    /// into, and whose endpoints a waypoint reaches (else its proxy's network).
    pub network: Option<String>,
    /// The hostname of its Service, `<name>.<namespace>.svc.<domain>`: its deployment is named
    /// after it, as istiod's deployment controller names it.
    pub host: String,
}

impl Waypoint {
    /// Whether an object of `namespace` may use it.
    pub fn admits(&self, namespace: &str) -> bool {
        self.from_all_namespaces || *self.namespace == *namespace
    }
}

/// Which waypoint serves a service or workload, as istiod's `fetchWaypointForTarget`
/// (pilot/pkg/serviceregistry/kube/controller/ambient/waypoints.go): the one its
/// `istio.io/use-waypoint` names (else its namespace's; `none` opts out of both), when that
/// Gateway is accepted, admits the object's namespace, serves its kind of traffic and is ready.
///
/// Ready means its Service exists: ztunnel finds the waypoint's pods through it. istiod waits for
/// the Gateway's status addresses, which its deployment controller reports once the Service is
/// there.
impl MeshSnapshot {
    /// A service's waypoint; none for a waypoint's own Service (a waypoint has no waypoint).
    pub fn service_waypoint(&self, service: &Service) -> Option<&Arc<Waypoint>> {
        let managed = service.labels.get(MANAGED_LABEL).map(String::as_str);
        if managed == Some(MANAGED_BY_MESH_CONTROLLER) {
            return None;
        }
        let waypoint = self.usable_waypoint(service.use_waypoint.as_ref()?, &service.namespace)?;
        waypoint.traffic.serves_services().then_some(waypoint)
    }

    /// A workload's waypoint; none for a waypoint's own pods.
    pub fn workload_waypoint(&self, workload: &Workload) -> Option<&Arc<Waypoint>> {
        let gateway_api = self.config.gateway_api();
        let instance = workload.labels.get(GATEWAY_NAME_LABEL);
        if instance.is_some_and(|name| gateway_api.waypoint(&workload.namespace, name).is_some()) {
            return None;
        }
        let use_waypoint = workload.use_waypoint.as_ref()?;
        let waypoint = self.usable_waypoint(use_waypoint, &workload.namespace)?;
        waypoint.traffic.serves_workloads().then_some(waypoint)
    }

    fn usable_waypoint(
        &self,
        use_waypoint: &UseWaypoint,
        namespace: &str,
    ) -> Option<&Arc<Waypoint>> {
        let UseWaypoint::Named {
            namespace: ns,
            name,
        } = use_waypoint
        else {
            return None;
        };
        let waypoint = self.config.gateway_api().waypoint(ns, name)?;
        let usable = waypoint.class == WaypointClass::Waypoint
            && waypoint.admits(namespace)
            && self.services.get(&waypoint.host).is_some();
        usable.then_some(waypoint)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn use_waypoint_names_a_waypoint_of_its_namespace_or_another_or_none() {
        assert_eq!(UseWaypoint::from_labels(&labels(&[]), "shop"), None);
        assert_eq!(
            UseWaypoint::from_labels(&labels(&[(USE_WAYPOINT_LABEL, "wp")]), "shop"),
            Some(UseWaypoint::Named {
                namespace: "shop".into(),
                name: "wp".into()
            })
        );
        let elsewhere = labels(&[
            (USE_WAYPOINT_LABEL, "wp"),
            (USE_WAYPOINT_NAMESPACE_LABEL, "infra"),
        ]);
        assert_eq!(
            UseWaypoint::from_labels(&elsewhere, "shop"),
            Some(UseWaypoint::Named {
                namespace: "infra".into(),
                name: "wp".into()
            })
        );
        assert_eq!(
            UseWaypoint::from_labels(&labels(&[(USE_WAYPOINT_LABEL, "none")]), "shop"),
            Some(UseWaypoint::OptedOut)
        );
    }

    #[test]
    fn traffic_types_gate_services_and_workloads() {
        let serves = |t: &str| {
            let t = TrafficType::parse(t).unwrap();
            (t.serves_services(), t.serves_workloads())
        };
        assert_eq!(serves("service"), (true, false));
        assert_eq!(serves("workload"), (false, true));
        assert_eq!(serves("all"), (true, true));
        assert_eq!(serves("none"), (false, false));
        assert_eq!(TrafficType::parse("Service"), None);
    }
}
