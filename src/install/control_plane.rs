//! The control plane of a primary: the `istio` mesh ConfigMap, the Deployment (non-root,
//! read-only, probes on /ready, spread over nodes and zones), its PodDisruptionBudget, and the
//! `istiod` Service Istio's proxies and the API server find it by.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{
    Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment,
};
use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMap, Container, ContainerPort, EmptyDirVolumeSource, EnvVar, EnvVarSource,
    HTTPGetAction, ObjectFieldSelector, PodSecurityContext, PodSpec, PodTemplateSpec, Probe,
    ResourceRequirements, SeccompProfile, SecurityContext, Service, ServicePort, ServiceSpec,
    TopologySpreadConstraint, Volume, VolumeMount,
};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde_json::json;

use super::rbac::control_plane_account;
use super::{labels, meta, meta_labelled, Values};
use crate::istio::mesh::{MESH_CONFIGMAP, MESH_KEY, MESH_NETWORKS_KEY};
use crate::istio::revision::REVISION_LABEL;

/// What selects the revision's pods (Deployment, PodDisruptionBudget, Service): `istio=pilot` for
/// the default revision, the revision label for another, so neither Service picks the other's
/// pods (Istio's chart, manifests/charts/istio-control/istio-discovery/templates/service.yaml).
fn selector(values: &Values) -> BTreeMap<String, String> {
    match values.revision.is_default() {
        true => labels(&[("app", "istiod"), ("istio", "pilot")]),
        false => labels(&[
            ("app", "istiod"),
            (REVISION_LABEL, values.revision.as_str()),
        ]),
    }
}

/// Istio's labels of istiod pods, which its tools select on (`app=istiod`, `istio.io/rev`).
fn pod_labels(values: &Values) -> BTreeMap<String, String> {
    let mut pod = selector(values);
    pod.insert(REVISION_LABEL.into(), values.revision.to_string());
    if !values.revision.is_default() {
        pod.insert("istio".into(), "istiod".into());
    }
    pod
}

/// The labels of the Deployment, budget and Service: a named revision's objects all carry it.
fn object_labels(values: &Values) -> BTreeMap<String, String> {
    match values.revision.is_default() {
        true => selector(values),
        false => pod_labels(values),
    }
}

/// The revision's control-plane objects' name: `istiod`, `istiod-<revision>`.
pub fn name(values: &Values) -> String {
    values.revision.suffixed("istiod")
}

/// The `istio` ConfigMap: mesh config with the trust domain, root namespace, the proxies'
/// discovery address and the mesh settings given (`meshConfig.*`), and MeshNetworks.
pub fn mesh_config(values: &Values) -> Result<ConfigMap, serde_yaml_ng::Error> {
    let mut mesh = json!({
        "trustDomain": values.trust_domain,
        "rootNamespace": values.namespace,
        "defaultConfig": {"discoveryAddress": values.discovery_address()},
    });
    for (field, value) in &values.mesh {
        mesh[field] = json!(value);
    }
    Ok(ConfigMap {
        metadata: meta_labelled(
            &values.revision.suffixed(MESH_CONFIGMAP),
            Some(&values.namespace),
            labels(&[(REVISION_LABEL, values.revision.as_str())]),
        ),
        // MeshNetworks go beside the mesh config, empty until edited, as Istio's chart renders it.
        data: Some(BTreeMap::from([
            (MESH_KEY.to_string(), serde_yaml_ng::to_string(&mesh)?),
            (MESH_NETWORKS_KEY.to_string(), "networks: {}\n".to_string()),
        ])),
        ..Default::default()
    })
}

fn env(name: &str, value: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: Some(value.into()),
        value_from: None,
    }
}

fn port(name: &str, number: i32) -> ContainerPort {
    ContainerPort {
        name: Some(name.into()),
        container_port: number,
        protocol: Some("TCP".into()),
        ..Default::default()
    }
}

/// Remote clusters' last-known-good snapshots: an emptyDir outlives a crashed or OOM-killed
/// container (the kubelet restarts it in the same pod), not the pod.
const STATE_DIR: &str = "/var/lib/meshpilot";

pub fn deployment(values: &Values) -> Deployment {
    let revision = match values.revision.is_default() {
        true => String::new(),
        false => values.revision.to_string(),
    };
    let mut variables = vec![
        env("MESHPILOT_IN_CLUSTER", "true"),
        env("MESHPILOT_CLUSTER_ID", &values.cluster_id),
        env("MESHPILOT_SYSTEM_NAMESPACE", &values.namespace),
        env("MESHPILOT_TRUST_DOMAIN", &values.trust_domain),
        env("MESHPILOT_HTTP_ADDR", "0.0.0.0:15014"),
        env("MESHPILOT_XDS_ADDR", "0.0.0.0:15010"),
        env("MESHPILOT_SECURE_XDS_ADDR", "0.0.0.0:15012"),
        env("MESHPILOT_WEBHOOK_ADDR", "0.0.0.0:15017"),
        env("MESHPILOT_PROXY_IMAGE", &values.proxy_image),
        env("MESHPILOT_STATE_DIR", STATE_DIR),
        EnvVar {
            name: "MESHPILOT_LEADER_IDENTITY".into(),
            value: None,
            value_from: Some(EnvVarSource {
                field_ref: Some(ObjectFieldSelector {
                    field_path: "metadata.name".into(),
                    api_version: None,
                }),
                ..Default::default()
            }),
        },
    ];
    for (name, value) in [
        ("MESHPILOT_NETWORK", &values.network),
        ("MESHPILOT_MESH_ID", &values.mesh_id),
        ("MESHPILOT_REVISION", &revision),
        // Remote API servers call the webhook at this address: the certificate must name it.
        ("MESHPILOT_XDS_DNS_NAMES", &values.remote_pilot_address),
    ] {
        if !value.is_empty() {
            variables.push(env(name, value));
        }
    }
    let quantity = |q: &str| Quantity(q.into());
    let container = Container {
        name: "discovery".into(),
        image: Some(values.image.clone()),
        image_pull_policy: Some("IfNotPresent".into()),
        args: Some(vec!["discovery".into()]),
        env: Some(variables),
        ports: Some(vec![
            port("grpc-xds", 15010),
            port("tls-xds", 15012),
            port("http-monitoring", 15014),
            port("https-webhook", 15017),
        ]),
        readiness_probe: Some(Probe {
            http_get: Some(HTTPGetAction {
                path: Some("/ready".into()),
                port: IntOrString::Int(15014),
                ..Default::default()
            }),
            initial_delay_seconds: Some(1),
            period_seconds: Some(3),
            timeout_seconds: Some(5),
            ..Default::default()
        }),
        resources: Some(ResourceRequirements {
            requests: Some(BTreeMap::from([
                ("cpu".to_string(), quantity("200m")),
                ("memory".to_string(), quantity("256Mi")),
            ])),
            limits: Some(BTreeMap::from([("memory".to_string(), quantity("2Gi"))])),
            ..Default::default()
        }),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            read_only_root_filesystem: Some(true),
            run_as_non_root: Some(true),
            run_as_user: Some(1337),
            run_as_group: Some(1337),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".into()]),
                add: None,
            }),
            ..Default::default()
        }),
        volume_mounts: Some(vec![VolumeMount {
            name: "state".into(),
            mount_path: STATE_DIR.into(),
            ..Default::default()
        }]),
        ..Default::default()
    };
    let spread = |key: &str| TopologySpreadConstraint {
        max_skew: 1,
        topology_key: key.into(),
        when_unsatisfiable: "ScheduleAnyway".into(),
        label_selector: Some(LabelSelector {
            match_labels: Some(selector(values)),
            match_expressions: None,
        }),
        ..Default::default()
    };
    let mut template_labels = pod_labels(values);
    template_labels.insert("sidecar.istio.io/inject".into(), "false".into());
    let mut template_meta = meta_labelled("", None, template_labels);
    template_meta.name = None;
    template_meta.annotations = Some(labels(&[
        ("prometheus.io/port", "15014"),
        ("prometheus.io/path", "/metrics"),
        ("prometheus.io/scrape", "true"),
    ]));
    Deployment {
        metadata: meta_labelled(
            &name(values),
            Some(&values.namespace),
            object_labels(values),
        ),
        spec: DeploymentSpec {
            replicas: Some(values.replicas),
            selector: LabelSelector {
                match_labels: Some(selector(values)),
                match_expressions: None,
            },
            strategy: Some(DeploymentStrategy {
                type_: Some("RollingUpdate".into()),
                rolling_update: Some(RollingUpdateDeployment {
                    max_surge: Some(IntOrString::String("100%".into())),
                    max_unavailable: Some(IntOrString::String("25%".into())),
                }),
            }),
            template: PodTemplateSpec {
                metadata: Some(template_meta),
                spec: Some(PodSpec {
                    service_account_name: Some(control_plane_account(&values.revision)),
                    security_context: Some(PodSecurityContext {
                        run_as_non_root: Some(true),
                        run_as_user: Some(1337),
                        run_as_group: Some(1337),
                        fs_group: Some(1337),
                        seccomp_profile: Some(SeccompProfile {
                            type_: "RuntimeDefault".into(),
                            localhost_profile: None,
                        }),
                        ..Default::default()
                    }),
                    topology_spread_constraints: Some(vec![
                        spread("kubernetes.io/hostname"),
                        spread("topology.kubernetes.io/zone"),
                    ]),
                    containers: vec![container],
                    volumes: Some(vec![Volume {
                        name: "state".into(),
                        empty_dir: Some(EmptyDirVolumeSource::default()),
                        ..Default::default()
                    }]),
                    ..Default::default()
                }),
            },
            ..Default::default()
        },
        status: None,
    }
}

/// Voluntary evictions (node drains) take at most one replica at a time.
pub fn disruption_budget(values: &Values) -> PodDisruptionBudget {
    PodDisruptionBudget {
        metadata: meta_labelled(
            &name(values),
            Some(&values.namespace),
            object_labels(values),
        ),
        spec: Some(PodDisruptionBudgetSpec {
            max_unavailable: Some(IntOrString::Int(1)),
            selector: Some(LabelSelector {
                match_labels: Some(selector(values)),
                match_expressions: None,
            }),
            ..Default::default()
        }),
        status: None,
    }
}

fn service_port(name: &str, port: i32, target: i32) -> ServicePort {
    ServicePort {
        name: Some(name.into()),
        port,
        target_port: Some(IntOrString::Int(target)),
        protocol: Some("TCP".into()),
        ..Default::default()
    }
}

/// Service `istiod` (`istiod-<revision>`), with Istio's port names: what proxies (CA_ADDR,
/// discovery address) and the webhook configurations name.
pub fn service(values: &Values) -> Service {
    Service {
        metadata: meta_labelled(
            &name(values),
            Some(&values.namespace),
            object_labels(values),
        ),
        spec: Some(ServiceSpec {
            selector: Some(selector(values)),
            ports: Some(vec![
                service_port("grpc-xds", 15010, 15010),
                service_port("https-dns", 15012, 15012),
                service_port("https-webhook", 443, 15017),
                service_port("http-monitoring", 15014, 15014),
            ]),
            ..Default::default()
        }),
        status: None,
    }
}

/// `exposeControlPlane`: the secure xDS/CA port and the webhook port on a load balancer, for
/// remote clusters' proxies and API servers (`remotePilotAddress` is its address).
pub fn external_service(values: &Values) -> Service {
    Service {
        metadata: ObjectMeta {
            labels: (!values.revision.is_default()).then(|| object_labels(values)),
            ..meta(
                &values.revision.suffixed("istiod-external"),
                Some(&values.namespace),
            )
        },
        spec: Some(ServiceSpec {
            type_: Some("LoadBalancer".into()),
            selector: Some(selector(values)),
            ports: Some(vec![
                service_port("tls-xds", 15012, 15012),
                service_port("tls-webhook", 15017, 15017),
            ]),
            ..Default::default()
        }),
        status: None,
    }
}

/// ConfigMap `istio-sidecar-injector-<revision>`, as Istio's chart names it: the injection
/// settings tools read (`values`: the revision, its namespace, proxy image, network, mesh id;
/// `config`: the policy). meshpilot's templates are built in, so there are none here.
pub fn injector_config(values: &Values) -> ConfigMap {
    let settings = json!({
        "revision": values.revision.as_str(),
        "global": {
            "istioNamespace": values.namespace,
            "network": values.network,
            "meshID": values.mesh_id,
            "proxy": {"image": values.proxy_image},
        },
    });
    let config = json!({"policy": "enabled", "defaultTemplates": ["sidecar"]});
    ConfigMap {
        metadata: meta_labelled(
            &values.revision.suffixed("istio-sidecar-injector"),
            Some(&values.namespace),
            labels(&[(REVISION_LABEL, values.revision.as_str())]),
        ),
        data: Some(BTreeMap::from([
            ("values".to_string(), settings.to_string()),
            ("config".to_string(), config.to_string()),
        ])),
        ..Default::default()
    }
}
