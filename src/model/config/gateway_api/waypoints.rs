//! Gateways of Istio's ambient classes: `istio-waypoint` (controller `istio.io/mesh-controller`)
//! and `istio-east-west` (`istio.io/eastwest-controller`), as istiod reads them
//! (pilot/pkg/serviceregistry/kube/controller/ambient/waypoints.go; the one listener rule of
//! pilot/pkg/config/kube/gateway/conversion.go). Each accepted one is a [`Waypoint`]; its status
//! says why when it is not.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::status::{ClassStatus, Condition, GatewayStatus, ListenerStatus, ObjectStatus};
use super::{GatewayApi, UNSUPPORTED_PROTOCOL};
use crate::istio::gateway_api::gateway::Listener;
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
        let hbone = gateway.listeners.iter().find(|l| serves(*class, l));
        let refusal = match (hbone, traffic) {
            (None, _) => Some(format!(
                "an ambient gateway needs {}",
                expected_listener(*class)
            )),
            (_, None) => Some(format!(
                "label {WAYPOINT_FOR_LABEL} is service, workload, all or none"
            )),
            _ => None,
        };
        out.status.insert(
            object.key.clone(),
            ObjectStatus::Gateway(status(*class, gateway, refusal.as_deref())),
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
            // The Service its address names (a manual deployment), else the one it is deployed
            // behind, named as the deployment: the override, else the Gateway's name.
            host: store.qualify(
                gateway
                    .addresses
                    .first()
                    .map(|a| a.value.as_str())
                    .or(object
                        .meta
                        .annotations
                        .get(NAME_OVERRIDE)
                        .map(String::as_str))
                    .unwrap_or(&object.key.name),
                &object.key.namespace,
            ),
        }));
    }
    out.waypoints
        .sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
}

/// Whether a listener is the one a Gateway of this class serves: HBONE on 15008, terminating TLS
/// on an east-west gateway (istiod's `unexpectedWaypointListener` and
/// `unexpectedEastWestWaypointListener`, pilot/pkg/config/kube/gateway/conversion.go).
fn serves(class: WaypointClass, listener: &Listener) -> bool {
    let hbone = listener.protocol == HBONE_PROTOCOL && listener.port == HBONE_PORT;
    let terminates = listener.tls.as_ref().is_some_and(|t| !t.passthrough());
    hbone && (class == WaypointClass::Waypoint || terminates)
}

fn expected_listener(class: WaypointClass) -> String {
    let tls = match class {
        WaypointClass::Waypoint => "",
        WaypointClass::EastWest => " and tls.mode Terminate",
    };
    format!("a listener on port {HBONE_PORT} with protocol {HBONE_PROTOCOL}{tls}")
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

/// Accepted and programmed unless `refusal`; each listener other than the one its class serves is
/// not accepted (istiod's rule: one listener).
fn status(
    class: WaypointClass,
    gateway: &KubernetesGateway,
    refusal: Option<&str>,
) -> GatewayStatus {
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
            conditions: match serves(class, l) {
                true => vec![
                    Condition::yes("Accepted", "Accepted"),
                    Condition::yes("Programmed", "Programmed"),
                ],
                false => vec![Condition::no(
                    "Accepted",
                    UNSUPPORTED_PROTOCOL,
                    format!(
                        "an ambient gateway serves one listener: {}",
                        expected_listener(class)
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

#[cfg(test)]
mod tests {
    use crate::istio::ConfigKey;
    use crate::model::config::fixtures::object;
    use crate::model::{ConfigSource, ConfigStore};

    const API: (&str, &str) = ("gateway.networking.k8s.io/v1", "Gateway");

    fn store(gateways: &[(&str, &str)]) -> ConfigStore {
        let mut store = ConfigStore::default();
        let changes = gateways
            .iter()
            .map(|(name, spec)| object(API, ("shop", name), "1", spec))
            .collect();
        store.apply(ConfigSource::Files, changes);
        store
    }

    fn key(name: &str) -> ConfigKey {
        ConfigKey {
            kind: crate::istio::ConfigKind::KubernetesGateway,
            namespace: "shop".into(),
            name: name.into(),
        }
    }

    #[test]
    fn an_east_west_gateway_terminates_tls_and_an_address_names_the_service() {
        let hbone = "{name: mesh, port: 15008, protocol: HBONE}";
        let terminating = "{name: mesh, port: 15008, protocol: HBONE, tls: {mode: Terminate}}";
        let store = store(&[
            (
                "plain-ew",
                &format!("{{gatewayClassName: istio-east-west, listeners: [{hbone}]}}"),
            ),
            (
                "ew",
                &format!("{{gatewayClassName: istio-east-west, listeners: [{terminating}]}}"),
            ),
            (
                "manual",
                &format!(
                    "{{gatewayClassName: istio-waypoint, listeners: [{hbone}], \
                     addresses: [{{type: Hostname, value: wp.infra.svc.cluster.local}}]}}"
                ),
            ),
        ]);
        let api = store.gateway_api();
        assert!(api.waypoint("shop", "plain-ew").is_none());
        assert!(api.ambient_refused.contains(&key("plain-ew")));
        assert!(api.waypoint("shop", "ew").is_some());
        let manual = api.waypoint("shop", "manual").unwrap();
        assert_eq!(manual.host, "wp.infra.svc.cluster.local");
    }
}
