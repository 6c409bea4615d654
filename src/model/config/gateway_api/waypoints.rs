//! Gateways of Istio's ambient classes: `istio-waypoint` (controller `istio.io/mesh-controller`)
//! and `istio-east-west` (`istio.io/eastwest-controller`), as istiod reads them
//! (pilot/pkg/serviceregistry/kube/controller/ambient/waypoints.go; the one listener rule of
//! pilot/pkg/config/kube/gateway/conversion.go). Each accepted one is a [`Waypoint`]; its status
//! says why when it is not.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::status::{ClassStatus, Condition, GatewayStatus, ListenerStatus, ObjectStatus};
use super::{GatewayApi, UNSUPPORTED_PROTOCOL};
use crate::istio::gateway_api::{KubernetesGateway, HBONE_PORT, HBONE_PROTOCOL, NAME_OVERRIDE};
use crate::istio::{ConfigKind, Spec};
use crate::model::config::ConfigStore;
use crate::model::waypoints::{
    TrafficType, Waypoint, WaypointClass, EAST_WEST_CLASS, EAST_WEST_CONTROLLER, WAYPOINT_CLASS,
    WAYPOINT_CONTROLLER, WAYPOINT_FOR_LABEL,
};
use crate::model::LABEL_NETWORK;

/// Compiles every Gateway of an ambient class into `out.waypoints`, with its status.
pub(super) fn compile(store: &ConfigStore, out: &mut GatewayApi) {
    let classes = ambient_classes(store, out);
    for object in store.of_kind(ConfigKind::KubernetesGateway) {
        let Spec::KubernetesGateway(gateway) = &object.spec else {
            continue;
        };
        let Some((class, class_labels)) = classes.get(gateway.gateway_class_name.as_str()) else {
            continue;
        };
        let traffic = object
            .meta
            .labels
            .get(WAYPOINT_FOR_LABEL)
            .or_else(|| class_labels.get(WAYPOINT_FOR_LABEL))
            .map_or(Some(TrafficType::Service), |v| TrafficType::parse(v));
        let hbone = gateway.listeners.iter().find(|l| is_hbone(l));
        let refusal = match (hbone, traffic) {
            (None, _) => Some(format!(
                "an ambient gateway needs a listener on port {HBONE_PORT} with protocol \
                 {HBONE_PROTOCOL}"
            )),
            (_, None) => Some(format!(
                "label {WAYPOINT_FOR_LABEL} is service, workload, all or none"
            )),
            _ => None,
        };
        out.status.insert(
            object.key.clone(),
            ObjectStatus::Gateway(status(gateway, refusal.as_deref())),
        );
        if refusal.is_some() {
            out.ambient_refused.insert(object.key.clone());
        }
        let (Some(hbone), Some(traffic), None) = (hbone, traffic, refusal) else {
            continue;
        };
        out.waypoints.push(Arc::new(Waypoint {
            namespace: object.key.namespace.clone(),
            name: object.key.name.clone(),
            class: *class,
            traffic,
            from_all_namespaces: hbone.routes_from_all_namespaces(),
            network: object.meta.labels.get(LABEL_NETWORK).cloned(),
            // Its Service is named as its deployment: the override, else the Gateway's name.
            host: store.qualify(
                object
                    .meta
                    .annotations
                    .get(NAME_OVERRIDE)
                    .map_or(&*object.key.name, String::as_str),
                &object.key.namespace,
            ),
        }));
    }
    out.waypoints
        .sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
}

fn is_hbone(listener: &crate::istio::gateway_api::gateway::Listener) -> bool {
    listener.protocol == HBONE_PROTOCOL && listener.port == HBONE_PORT
}

/// The ambient classes by name, with their labels (a class may set `istio.io/waypoint-for`):
/// the GatewayClasses naming an ambient controller, and the built-in names unless a class of that
/// name names another controller.
fn ambient_classes<'a>(
    store: &'a ConfigStore,
    out: &mut GatewayApi,
) -> BTreeMap<&'a str, (WaypointClass, BTreeMap<String, String>)> {
    let mut classes = BTreeMap::from([
        (WAYPOINT_CLASS, (WaypointClass::Waypoint, BTreeMap::new())),
        (EAST_WEST_CLASS, (WaypointClass::EastWest, BTreeMap::new())),
    ]);
    for object in store.of_kind(ConfigKind::GatewayClass) {
        let Spec::GatewayClass(class) = &object.spec else {
            continue;
        };
        let kind = match class.controller_name.as_str() {
            WAYPOINT_CONTROLLER => WaypointClass::Waypoint,
            EAST_WEST_CONTROLLER => WaypointClass::EastWest,
            _ => {
                classes.remove(&*object.key.name);
                continue;
            }
        };
        classes.insert(&object.key.name, (kind, object.meta.labels.clone()));
        out.status.insert(
            object.key.clone(),
            ObjectStatus::Class(ClassStatus {
                conditions: vec![Condition::yes("Accepted", "Accepted")],
            }),
        );
    }
    classes
}

/// Accepted and programmed unless `refusal`; each listener other than HBONE on 15008 is not
/// accepted (istiod's rule: one listener, HBONE on 15008).
fn status(gateway: &KubernetesGateway, refusal: Option<&str>) -> GatewayStatus {
    let gateway_conditions = match refusal {
        None => vec![
            Condition::yes("Accepted", "Accepted"),
            Condition::yes("Programmed", "Programmed"),
        ],
        Some(why) => vec![
            Condition::no("Accepted", "Invalid", why),
            Condition::no("Programmed", "Invalid", why),
        ],
    };
    let listeners = gateway
        .listeners
        .iter()
        .map(|l| ListenerStatus {
            name: l.name.clone(),
            supported_kinds: Vec::new(),
            attached_routes: 0,
            conditions: match is_hbone(l) {
                true => vec![
                    Condition::yes("Accepted", "Accepted"),
                    Condition::yes("Programmed", "Programmed"),
                ],
                false => vec![Condition::no(
                    "Accepted",
                    UNSUPPORTED_PROTOCOL,
                    format!(
                        "an ambient gateway serves one listener, on port {HBONE_PORT} with \
                         protocol {HBONE_PROTOCOL}"
                    ),
                )],
            },
        })
        .collect();
    GatewayStatus {
        conditions: gateway_conditions,
        listeners,
    }
}
