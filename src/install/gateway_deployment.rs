//! Automated deployment of Gateway API Gateways, as istiod's deployment controller
//! (pilot/pkg/config/kube/gateway/deploymentcontroller.go, with its kube-gateway.yaml and
//! waypoint.yaml templates): for every Gateway of a class meshpilot implements that names no
//! address of its own, the leader keeps a ServiceAccount, a Deployment of Istio's proxy and a
//! Service in the Gateway's namespace, labelled with the Gateway's name, and owned by the Gateway,
//! so that the API server's garbage collector removes them with it. An object of that name that
//! meshpilot did not make (no `gateway.istio.io/managed` label) is left alone.
//!
//! The `istio` class deploys a router named `<gateway>-<class>` behind a LoadBalancer; the ambient
//! classes a `waypoint` proxy named `<gateway>`, outside ambient capture, behind a ClusterIP
//! Service (a waypoint) or a LoadBalancer carrying the Gateway's network label (an east-west
//! gateway, which is how other networks find it).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{
    ContainerPort, PodTemplateSpec, Service, ServiceAccount, ServicePort, ServiceSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use kube::api::{Api, DynamicObject, PostParams};
use kube::discovery::ApiResource;
use kube::Client;
use serde_json::Value;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::inject::{gateway_pod_spec, InjectConfig};
use crate::istio::gateway_api::{
    KubernetesGateway, GATEWAY_NAME_LABEL, GROUP, MANAGED_BY_EAST_WEST_CONTROLLER,
    MANAGED_BY_GATEWAY_CONTROLLER, MANAGED_BY_MESH_CONTROLLER, MANAGED_LABEL, NAME_OVERRIDE,
};
use crate::istio::revision::REVISION_LABEL;
use crate::istio::{ConfigKey, ConfigObject, Origin, Spec};
use crate::model::gateway_api::status::ObjectStatus;
use crate::model::waypoints::WaypointClass;
use crate::model::{ClusterId, Mesh, MeshSnapshot, LABEL_NETWORK};
use crate::sources::gateway_owners::{Ended, Handover, Scope, Turn};
use crate::sources::revision_tags::RevisionTags;

/// The Gateway's annotations istiod reads to name what it deploys, and the Service's type.
const SERVICE_ACCOUNT: &str = "gateway.istio.io/service-account";
const SERVICE_TYPE: &str = "networking.istio.io/service-type";
const STATUS_PORT: i32 = 15021;

const CHECK_EVERY: Duration = Duration::from_secs(1);
const RETRY_AFTER: Duration = Duration::from_secs(30);
/// How long one call to the API server may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// What one Gateway deploys.
#[derive(Clone, Debug, PartialEq)]
pub struct Manifests {
    pub service_account: ServiceAccount,
    pub deployment: Deployment,
    pub service: Service,
}

/// The objects a managed Gateway deploys (`ambient`: the Gateway's ambient class, if it has
/// one); None for a Gateway that names its own address (a manual deployment) or has no API server
/// id to be owned by.
pub fn manifests(
    object: &ConfigObject,
    config: &InjectConfig,
    ambient: Option<WaypointClass>,
) -> Option<Manifests> {
    let Spec::KubernetesGateway(gateway) = &object.spec else {
        return None;
    };
    if !gateway.addresses.is_empty() {
        return None;
    }
    let uid = object.meta.uid.clone()?;
    let annotation = |key: &str| object.meta.annotations.get(key).cloned();
    let name = annotation(NAME_OVERRIDE).unwrap_or_else(|| match ambient {
        Some(_) => object.key.name.to_string(),
        None => format!("{}-{}", object.key.name, gateway.gateway_class_name),
    });
    let kind = Kind::of(ambient, object.meta.labels.get(LABEL_NETWORK));
    let account = annotation(SERVICE_ACCOUNT).unwrap_or_else(|| name.clone());
    let namespace = object.key.namespace.to_string();
    let selector = BTreeMap::from([(GATEWAY_NAME_LABEL.to_string(), object.key.name.to_string())]);
    let mut labels = selector.clone();
    labels.insert(MANAGED_LABEL.into(), kind.managed.into());
    let meta = |name: &str| ObjectMeta {
        name: Some(name.to_string()),
        namespace: Some(namespace.clone()),
        labels: Some(labels.clone()),
        owner_references: Some(vec![OwnerReference {
            api_version: format!("{GROUP}/v1beta1"),
            kind: "Gateway".into(),
            name: object.key.name.to_string(),
            uid: uid.clone(),
            ..Default::default()
        }]),
        ..Default::default()
    };
    Some(Manifests {
        service_account: ServiceAccount {
            metadata: meta(&account),
            ..Default::default()
        },
        deployment: deployment(
            meta(&name),
            &name,
            &account,
            &selector,
            gateway,
            config,
            &kind,
        ),
        service: service(
            ObjectMeta {
                labels: Some(
                    labels
                        .clone()
                        .into_iter()
                        .chain(kind.service_labels())
                        .collect(),
                ),
                ..meta(&name)
            },
            &selector,
            gateway,
            annotation(SERVICE_TYPE).unwrap_or_else(|| kind.service_type.into()),
        ),
    })
}

/// How a class's Gateways deploy.
struct Kind<'a> {
    /// The value of `gateway.istio.io/managed` (istiod's controller name, `/` made `-`).
    managed: &'static str,
    /// The proxy's node type.
    proxy: &'static str,
    service_type: &'static str,
    /// An east-west gateway's network: its Service and proxy carry it.
    network: Option<&'a String>,
    /// Its pods stay out of ambient capture (waypoints and east-west gateways are the data path).
    uncaptured: bool,
}

impl<'a> Kind<'a> {
    fn of(ambient: Option<WaypointClass>, network: Option<&'a String>) -> Self {
        let ambient_kind = |managed, service_type, network| Kind {
            managed,
            proxy: "waypoint",
            service_type,
            network,
            uncaptured: true,
        };
        match ambient {
            None => Kind {
                managed: MANAGED_BY_GATEWAY_CONTROLLER,
                proxy: "router",
                service_type: "LoadBalancer",
                network: None,
                uncaptured: false,
            },
            Some(WaypointClass::Waypoint) => {
                ambient_kind(MANAGED_BY_MESH_CONTROLLER, "ClusterIP", None)
            }
            Some(WaypointClass::EastWest) => {
                ambient_kind(MANAGED_BY_EAST_WEST_CONTROLLER, "LoadBalancer", network)
            }
        }
    }

    fn service_labels(&self) -> impl Iterator<Item = (String, String)> + '_ {
        let network = self.network.iter();
        network.map(|n| (LABEL_NETWORK.to_string(), n.to_string()))
    }
}

fn deployment(
    metadata: ObjectMeta,
    name: &str,
    account: &str,
    selector: &BTreeMap<String, String>,
    gateway: &KubernetesGateway,
    config: &InjectConfig,
    kind: &Kind<'_>,
) -> Deployment {
    let proxy_config = serde_json::json!({ "discoveryAddress": config.ca_address() }).to_string();
    let mut ports = vec![
        container_port("status-port", STATUS_PORT),
        container_port("http-envoy-prom", 15090),
    ];
    ports.extend(unique_ports(gateway).map(|(name, port, _)| container_port(&name, port)));
    let mut env = vec![("PROXY_CONFIG", proxy_config.as_str())];
    if let Some(network) = kind.network {
        env.push(("ISTIO_META_REQUESTED_NETWORK_VIEW", network));
    }
    let spec = gateway_pod_spec(config, kind.proxy, account, &env, ports);
    let mut pod_labels = selector.clone();
    if kind.uncaptured {
        pod_labels.insert("istio.io/dataplane-mode".into(), "none".into());
    }
    pod_labels.extend([
        (MANAGED_LABEL.to_string(), kind.managed.to_string()),
        ("sidecar.istio.io/inject".to_string(), "false".to_string()),
        (
            "service.istio.io/canonical-name".to_string(),
            name.to_string(),
        ),
        (
            "service.istio.io/canonical-revision".to_string(),
            "latest".to_string(),
        ),
    ]);
    // Which revision rendered it, as istiod's kube-gateway.yaml says (`doctor` reads it).
    let pod_annotations = BTreeMap::from([
        (REVISION_LABEL.to_string(), config.revision.to_string()),
        (
            "prometheus.io/path".to_string(),
            "/stats/prometheus".to_string(),
        ),
        ("prometheus.io/port".to_string(), "15020".to_string()),
        ("prometheus.io/scrape".to_string(), "true".to_string()),
    ]);
    Deployment {
        metadata,
        spec: DeploymentSpec {
            replicas: Some(1),
            selector: LabelSelector {
                match_labels: Some(selector.clone()),
                match_expressions: None,
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(pod_labels),
                    annotations: Some(pod_annotations),
                    ..Default::default()
                }),
                spec: Some(spec),
            },
            ..Default::default()
        },
        status: None,
    }
}

/// The gateway's Service, as istiod's: the status port first, then one port per listener port
/// (named after its first listener, its protocol as the app protocol).
fn service(
    metadata: ObjectMeta,
    selector: &BTreeMap<String, String>,
    gateway: &KubernetesGateway,
    type_: String,
) -> Service {
    let port = |name: String, number: i32, app: String| ServicePort {
        name: Some(name),
        port: number,
        protocol: Some("TCP".into()),
        app_protocol: Some(app),
        ..Default::default()
    };
    let mut ports = vec![port("status-port".into(), STATUS_PORT, "tcp".into())];
    ports.extend(unique_ports(gateway).map(|(name, number, app)| port(name, number, app)));
    Service {
        metadata,
        spec: Some(ServiceSpec {
            type_: Some(type_),
            ip_family_policy: Some("PreferDualStack".into()),
            selector: Some(selector.clone()),
            ports: Some(ports),
            ..Default::default()
        }),
        status: None,
    }
}

/// Each listener port once: (name, port, lower-case protocol).
fn unique_ports(gateway: &KubernetesGateway) -> impl Iterator<Item = (String, i32, String)> + '_ {
    let mut seen = Vec::new();
    gateway.listeners.iter().filter_map(move |l| {
        if seen.contains(&l.port) {
            return None;
        }
        seen.push(l.port);
        let mut name = l.name.replace('.', "-");
        name.truncate(63);
        Some((name, i32::from(l.port), l.protocol.to_ascii_lowercase()))
    })
}

fn container_port(name: &str, port: i32) -> ContainerPort {
    ContainerPort {
        name: Some(name.to_string()),
        container_port: port,
        protocol: Some("TCP".into()),
        ..Default::default()
    }
}

/// What was last applied for a Gateway, by (plural, name): applied again only when it changes.
type Applied = HashMap<(&'static str, String), Value>;

/// Keeps the deployments of the config cluster's managed Gateways this revision owns while this
/// replica leads, taking one over from another control plane only after `handover` (see
/// `sources::gateway_owners`).
pub fn keep(
    client: Client,
    cluster: ClusterId,
    mesh: Arc<Mesh>,
    config: InjectConfig,
    (tags, handover): (RevisionTags, Duration),
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut applied: HashMap<ConfigKey, Applied> = HashMap::new();
        let mut handover = Handover::new(handover);
        let mut last: Option<(Arc<MeshSnapshot>, u64)> = None;
        loop {
            tokio::time::sleep(CHECK_EVERY).await;
            // Until every store has listed, nothing is known to be ours.
            let Some(owners) = tags.view() else { continue };
            let snapshot = mesh.snapshot();
            let digest = owners.digest();
            if (last.as_ref()).is_some_and(|(l, o)| Arc::ptr_eq(l, &snapshot) && *o == digest) {
                continue;
            }
            let config = InjectConfig {
                mesh: snapshot.config.mesh().clone(),
                ..config.clone()
            };
            let scope = Scope {
                cluster: &cluster,
                owners: &owners,
                revision: config.revision.as_str(),
            };
            let pass = apply_all(
                &client,
                &scope,
                &snapshot,
                &config,
                &mut handover,
                &mut applied,
            );
            match pass.await {
                Ended::Done => last = Some((snapshot, digest)),
                // A handover is due: looked at again next tick.
                Ended::Waiting => last = None,
                Ended::Failed => tokio::time::sleep(RETRY_AFTER).await,
            }
        }
    })
}

/// Applies what every managed Gateway this revision owns deploys.
async fn apply_all(
    client: &Client,
    scope: &Scope<'_>,
    snapshot: &MeshSnapshot,
    config: &InjectConfig,
    handover: &mut Handover,
    applied: &mut HashMap<ConfigKey, Applied>,
) -> Ended {
    let (mut all, mut waiting) = (true, false);
    let ours = &snapshot.config.gateway_api().status;
    applied.retain(|key, _| ours.contains_key(key));
    handover.retain(|key| ours.contains_key(key));
    for (key, status) in ours {
        let Some(object) = snapshot.config.get(key) else {
            continue;
        };
        let from_cluster = matches!(&object.meta.origin, Origin::Kubernetes { cluster: c, .. } if c.as_str() == scope.cluster.as_str());
        let refused = snapshot.config.gateway_api().ambient_refused.contains(key);
        if !from_cluster || refused || !matches!(status, ObjectStatus::Gateway(_)) {
            continue;
        }
        let claim = (scope.owners).claim(scope.revision, &object.meta.labels, &key.namespace);
        match handover.turn(key, claim) {
            Turn::Write => {}
            turn => {
                // Another may write it now: once ours again, everything is written anew.
                applied.remove(key);
                waiting |= turn == Turn::Wait;
                continue;
            }
        }
        let waypoint = snapshot
            .config
            .gateway_api()
            .waypoint(&key.namespace, &key.name);
        let Some(manifests) = manifests(object, config, waypoint.map(|w| w.class)) else {
            continue;
        };
        let objects = [
            (
                resource("", "v1", "ServiceAccount", "serviceaccounts"),
                json(&manifests.service_account),
            ),
            (
                resource("apps", "v1", "Deployment", "deployments"),
                json(&manifests.deployment),
            ),
            (
                resource("", "v1", "Service", "services"),
                json(&manifests.service),
            ),
        ];
        let applied = applied.entry(key.clone()).or_default();
        for ((plural, resource), wanted) in objects {
            let Some(wanted) = wanted else { continue };
            let name = wanted["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            let slot = (plural, name.clone());
            if applied.get(&slot) == Some(&wanted) {
                continue;
            }
            let api: Api<DynamicObject> =
                Api::namespaced_with(client.clone(), &key.namespace, &resource);
            match apply(&api, &name, &wanted).await {
                Ok(()) => {
                    info!(gateway = %key, object = %format!("{plural}/{name}"), "gateway deployment applied");
                    applied.insert(slot, wanted);
                }
                Err(e) => {
                    warn!(gateway = %key, object = %format!("{plural}/{name}"), error = %e, "cannot apply the gateway's deployment; retrying");
                    all = false;
                }
            }
        }
    }
    Ended::of(all, waiting)
}

fn resource(
    group: &str,
    version: &str,
    kind: &str,
    plural: &'static str,
) -> (&'static str, ApiResource) {
    let gvk = kube::api::GroupVersionKind::gvk(group, version, kind);
    (plural, ApiResource::from_gvk_with_plural(&gvk, plural))
}

fn json<T: serde::Serialize>(object: &T) -> Option<Value> {
    serde_json::to_value(object).ok()
}

/// Creates the object, or replaces it when meshpilot made it; refuses to touch another's.
async fn apply(api: &Api<DynamicObject>, name: &str, wanted: &Value) -> Result<(), String> {
    let readable = |e: kube::Error| crate::kube_error::Readable(&e).to_string();
    let bounded = |what: &str| format!("{what} timed out after {CALL_TIMEOUT:?}");
    let existing = tokio::time::timeout(CALL_TIMEOUT, api.get_opt(name))
        .await
        .map_err(|_| bounded("get"))?
        .map_err(readable)?;
    let mut object: DynamicObject =
        serde_json::from_value(wanted.clone()).map_err(|e| e.to_string())?;
    let params = PostParams::default();
    match existing {
        None => {
            tokio::time::timeout(CALL_TIMEOUT, api.create(&params, &object))
                .await
                .map_err(|_| bounded("create"))?
                .map_err(readable)?;
        }
        Some(current) => {
            let managed = current
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(MANAGED_LABEL))
                .is_some();
            if !managed {
                return Err(format!(
                    "{name} exists and is not meshpilot's ({MANAGED_LABEL} unset)"
                ));
            }
            object.metadata.resource_version = current.metadata.resource_version;
            tokio::time::timeout(CALL_TIMEOUT, api.replace(name, &params, &object))
                .await
                .map_err(|_| bounded("replace"))?
                .map_err(readable)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::istio::Origin;

    fn gateway(addresses: &str) -> ConfigObject {
        let value: Value = serde_yaml_ng::from_str(&format!(
            "apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {{name: web, namespace: shop, uid: u-1}}
spec:
  gatewayClassName: istio
  listeners:
  - {{name: http, port: 80, protocol: HTTP}}
  - {{name: http.alt, port: 80, protocol: HTTP, hostname: a.example.com}}
  - {{name: tls, port: 443, protocol: TLS, tls: {{mode: Passthrough}}}}
{addresses}"
        ))
        .unwrap();
        let origin = Origin::File {
            path: "gw.yaml".into(),
            document: 1,
        };
        ConfigObject::from_value(&value, origin).unwrap().unwrap()
    }

    fn config() -> InjectConfig {
        InjectConfig {
            proxy_image: "proxyv2".into(),
            cluster_id: "c1".into(),
            network: String::new(),
            mesh_id: String::new(),
            revision: Default::default(),
            system_namespace: "istio-system".into(),
            domain_suffix: "cluster.local".into(),
            mesh: Arc::new(crate::istio::MeshConfig::default()),
            proxy_configs: Default::default(),
        }
    }

    #[test]
    fn a_managed_gateway_deploys_as_istiod_names_and_labels_it() {
        let m = manifests(&gateway(""), &config(), None).expect("managed");
        let service = m.service.spec.unwrap();
        let ports: Vec<(String, i32, String)> = service
            .ports
            .unwrap()
            .into_iter()
            .map(|p| (p.name.unwrap(), p.port, p.app_protocol.unwrap()))
            .collect();
        assert_eq!(
            ports,
            [
                ("status-port".to_string(), 15021, "tcp".to_string()),
                ("http".to_string(), 80, "http".to_string()),
                ("tls".to_string(), 443, "tls".to_string()),
            ]
        );
        assert_eq!(service.type_.as_deref(), Some("LoadBalancer"));
        assert_eq!(m.deployment.metadata.name.as_deref(), Some("web-istio"));
        let owner = &m.deployment.metadata.owner_references.unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str()),
            ("Gateway", "u-1")
        );
        let pod = m.deployment.spec.template;
        let labels = pod.metadata.unwrap().labels.unwrap();
        assert_eq!(labels[GATEWAY_NAME_LABEL], "web");
        assert_eq!(labels["sidecar.istio.io/inject"], "false");
        assert_eq!(
            pod.spec.unwrap().service_account_name.as_deref(),
            Some("web-istio")
        );
        let manual = "  addresses: [{type: Hostname, value: ingress.shop.svc.cluster.local}]";
        assert!(manifests(&gateway(manual), &config(), None).is_none());
    }

    #[test]
    fn ambient_gateways_deploy_a_waypoint_proxy_named_as_the_gateway() {
        let mut object = gateway("");
        object
            .meta
            .labels
            .insert(LABEL_NETWORK.into(), "net2".into());
        let waypoint = manifests(&object, &config(), Some(WaypointClass::Waypoint)).unwrap();
        assert_eq!(waypoint.deployment.metadata.name.as_deref(), Some("web"));
        let service = waypoint.service.spec.as_ref().unwrap();
        assert_eq!(service.type_.as_deref(), Some("ClusterIP"));
        let labels = waypoint.service.metadata.labels.as_ref().unwrap();
        assert_eq!(labels[MANAGED_LABEL], "istio.io-mesh-controller");
        assert!(!labels.contains_key(LABEL_NETWORK));
        let pod = waypoint.deployment.spec.template;
        assert_eq!(
            pod.metadata.unwrap().labels.unwrap()["istio.io/dataplane-mode"],
            "none"
        );
        let proxy = &pod.spec.unwrap().containers[0];
        assert_eq!(proxy.args.as_ref().unwrap()[1], "waypoint");

        let east_west = manifests(&object, &config(), Some(WaypointClass::EastWest)).unwrap();
        let labels = east_west.service.metadata.labels.unwrap();
        assert_eq!(
            labels[LABEL_NETWORK], "net2",
            "other networks find it by its label"
        );
        assert_eq!(labels[MANAGED_LABEL], "istio.io-eastwest-controller");
        assert_eq!(
            east_west.service.spec.unwrap().type_.as_deref(),
            Some("LoadBalancer")
        );
        let proxy = &east_west.deployment.spec.template.spec.unwrap().containers[0];
        let env = proxy.env.as_ref().unwrap();
        let view = env
            .iter()
            .find(|e| e.name == "ISTIO_META_REQUESTED_NETWORK_VIEW");
        assert_eq!(view.and_then(|e| e.value.as_deref()), Some("net2"));
    }
}
