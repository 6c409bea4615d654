//! The containers and volumes of Istio's injection template for the proxyv2 image, built as typed
//! objects: `istio-init` (iptables capture), `istio-proxy` (pilot-agent and Envoy) and the volumes
//! the agent expects (its token for the CA, the root certificate, sockets, pod info).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMapVolumeSource, Container, ContainerPort, DownwardAPIVolumeFile,
    DownwardAPIVolumeSource, EmptyDirVolumeSource, EnvVar, EnvVarSource, ExecAction, HTTPGetAction,
    Lifecycle, LifecycleHandler, ObjectFieldSelector, PodSpec, Probe, ProjectedVolumeSource,
    ResourceRequirements, SecurityContext, ServiceAccountTokenProjection, Volume, VolumeMount,
    VolumeProjection,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::annotations::Settings;
use super::{InjectConfig, Workload};
use crate::istio::mesh_traffic::InboundMode;

pub const PROXY_CONTAINER: &str = "istio-proxy";
pub const INIT_CONTAINER: &str = "istio-init";
/// Istio's proxy user; iptables exempts its traffic from capture.
const PROXY_UID: i64 = 1337;
/// The audience of the token the agent presents to the CA.
const TOKEN_AUDIENCE: &str = "istio-ca";

/// What the sidecar adds to a pod.
pub struct Sidecar {
    pub init: Option<Container>,
    pub proxy: Container,
    pub volumes: Vec<Volume>,
}

/// Cluster and network of the pod's cluster, after URL overrides and the pod's own label.
pub struct Placement {
    pub cluster_id: String,
    pub network: String,
}

pub fn build(
    settings: &Settings,
    config: &InjectConfig,
    placement: &Placement,
    spec: &PodSpec,
    workload: &Workload,
) -> Sidecar {
    let app: Vec<&Container> = spec
        .containers
        .iter()
        .filter(|c| c.name != PROXY_CONTAINER)
        .collect();
    let ports: Vec<&ContainerPort> = app.iter().flat_map(|c| c.ports.iter().flatten()).collect();
    let names: Vec<&str> = app.iter().map(|c| c.name.as_str()).collect();
    let mut env = common_env(config, settings);
    env.extend([
        value(
            "ISTIO_META_POD_PORTS",
            &serde_json::to_string(&ports).unwrap_or_default(),
        ),
        value("ISTIO_META_APP_CONTAINERS", &names.join(",")),
        value("ISTIO_META_CLUSTER_ID", &placement.cluster_id),
        value("ISTIO_META_INTERCEPTION_MODE", &settings.interception_mode),
    ]);
    if !placement.network.is_empty() {
        env.push(value("ISTIO_META_NETWORK", &placement.network));
    }
    if !workload.name.is_empty() {
        env.push(value("ISTIO_META_WORKLOAD_NAME", &workload.name));
        env.push(value("ISTIO_META_OWNER", &workload.owner()));
    }
    env.extend(mesh_env(config));
    env.extend(metadata_env(settings));
    let tproxy = settings.interception_mode == "TPROXY";
    let mut proxy = proxy_container(
        settings,
        config,
        vec!["proxy".into(), "sidecar".into()],
        env,
    );
    proxy.security_context = Some(proxy_security(tproxy));
    if settings.status_port != 0 {
        proxy.readiness_probe = Some(readiness(settings));
    }
    if settings.hold_application {
        proxy.lifecycle = Some(Lifecycle {
            post_start: Some(LifecycleHandler {
                exec: Some(ExecAction {
                    command: Some(vec!["pilot-agent".into(), "wait".into()]),
                }),
                ..Default::default()
            }),
            ..Default::default()
        });
    }
    let init = (settings.interception_mode != "NONE").then(|| init_container(settings, config));
    Sidecar {
        init,
        proxy,
        volumes: volumes(),
    }
}

/// The istio-proxy container both a sidecar and a gateway run: image, args, ports, mounts.
fn proxy_container(
    settings: &Settings,
    config: &InjectConfig,
    mode: Vec<String>,
    env: Vec<EnvVar>,
) -> Container {
    let mut args = mode;
    args.extend([
        "--domain".into(),
        format!("$(POD_NAMESPACE).svc.{}", config.domain_suffix),
        format!("--proxyLogLevel={}", settings.log_level),
        format!("--proxyComponentLogLevel={}", settings.component_log_level),
        format!("--log_output_level={}", settings.agent_log_level),
    ]);
    Container {
        name: PROXY_CONTAINER.into(),
        image: Some(settings.proxy_image.clone()),
        args: Some(args),
        ports: Some(vec![ContainerPort {
            container_port: 15090,
            protocol: Some("TCP".into()),
            name: Some("http-envoy-prom".into()),
            ..Default::default()
        }]),
        env: Some(env),
        resources: Some(settings.resources.clone()),
        volume_mounts: Some(mounts()),
        ..Default::default()
    }
}

fn value(name: &str, value: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: Some(value.into()),
        value_from: None,
    }
}

fn field(name: &str, path: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: None,
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: path.into(),
                api_version: None,
            }),
            ..Default::default()
        }),
    }
}

/// The start of the template's environment: how the agent finds and authenticates to the CA, and
/// who it is.
fn common_env(config: &InjectConfig, settings: &Settings) -> Vec<EnvVar> {
    vec![
        value("JWT_POLICY", "third-party-jwt"),
        value("PILOT_CERT_PROVIDER", "istiod"),
        value("CA_ADDR", &config.ca_address()),
        field("POD_NAME", "metadata.name"),
        field("POD_NAMESPACE", "metadata.namespace"),
        field("INSTANCE_IP", "status.podIP"),
        field("SERVICE_ACCOUNT", "spec.serviceAccountName"),
        field("HOST_IP", "status.hostIP"),
        value(
            "PROXY_CONFIG",
            &serde_json::to_string(&settings.proxy_config).unwrap_or_default(),
        ),
    ]
}

/// Mesh id (default: the trust domain) and trust domain.
fn mesh_env(config: &InjectConfig) -> Vec<EnvVar> {
    let trust_domain = &config.mesh.trust_domain;
    let mesh_id = match config.mesh_id.as_str() {
        "" => trust_domain,
        id => id,
    };
    let mut env = vec![
        value("ISTIO_META_MESH_ID", mesh_id),
        value("TRUST_DOMAIN", trust_domain),
    ];
    // Inbound traffic goes to localhost: the agent rewrites probes of the pod's address to it too
    // (Istio's injection template, `InboundTrafficPolicyMode` in pkg/kube/inject/inject.go).
    if config.mesh.inbound_traffic_policy.mode == InboundMode::Localhost {
        env.push(value("REWRITE_PROBE_LEGACY_LOCALHOST_DESTINATION", "true"));
    }
    env
}

fn metadata_env(settings: &Settings) -> Vec<EnvVar> {
    settings
        .proxy_metadata()
        .iter()
        .map(|(k, v)| value(k, v))
        .collect()
}

fn readiness(settings: &Settings) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some("/healthz/ready".into()),
            port: IntOrString::Int(15021),
            ..Default::default()
        }),
        initial_delay_seconds: Some(settings.readiness_delay),
        period_seconds: Some(settings.readiness_period),
        timeout_seconds: Some(3),
        failure_threshold: Some(settings.readiness_failures),
        ..Default::default()
    }
}

fn proxy_security(tproxy: bool) -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        capabilities: Some(Capabilities {
            add: tproxy.then(|| vec!["NET_ADMIN".to_string()]),
            drop: Some(vec!["ALL".into()]),
        }),
        privileged: Some(false),
        read_only_root_filesystem: Some(true),
        run_as_group: Some(PROXY_UID),
        run_as_non_root: Some(!tproxy),
        run_as_user: Some(if tproxy { 0 } else { PROXY_UID }),
        ..Default::default()
    }
}

/// `istio-iptables` with the capture settings, redirecting to the mesh's listen ports (where
/// `virtualOutbound` and `virtualInbound` are); runs as root with NET_ADMIN and NET_RAW.
fn init_container(settings: &Settings, config: &InjectConfig) -> Container {
    let excluded = match settings.exclude_inbound_ports.as_str() {
        "" => "15090,15021".to_string(),
        ports => format!("15090,15021,{ports}"),
    };
    let outbound = config.mesh.proxy_listen_port.to_string();
    let inbound = config.mesh.proxy_inbound_listen_port.to_string();
    let mut args: Vec<String> = [
        "istio-iptables",
        "-p",
        &outbound,
        "-z",
        &inbound,
        "-u",
        "1337",
        "-m",
        &settings.interception_mode,
        "-i",
        &settings.include_outbound_ip_ranges,
        "-x",
        &settings.exclude_outbound_ip_ranges,
        "-b",
        &settings.include_inbound_ports,
        "-d",
        &excluded,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for (flag, value) in [
        ("-q", &settings.include_outbound_ports),
        ("-o", &settings.exclude_outbound_ports),
        ("-k", &settings.kubevirt_interfaces),
        ("-c", &settings.exclude_interfaces),
    ] {
        if let Some(value) = value {
            args.extend([flag.to_string(), value.clone()]);
        }
    }
    args.push(format!("--log_output_level={}", settings.agent_log_level));
    let metadata = metadata_env(settings);
    Container {
        name: INIT_CONTAINER.into(),
        image: Some(settings.proxy_image.clone()),
        args: Some(args),
        env: (!metadata.is_empty()).then_some(metadata),
        resources: Some(settings.resources.clone()),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            privileged: Some(false),
            capabilities: Some(Capabilities {
                add: Some(vec!["NET_ADMIN".into(), "NET_RAW".into()]),
                drop: Some(vec!["ALL".into()]),
            }),
            read_only_root_filesystem: Some(false),
            run_as_group: Some(0),
            run_as_non_root: Some(false),
            run_as_user: Some(0),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn mount(name: &str, path: &str) -> VolumeMount {
    VolumeMount {
        name: name.into(),
        mount_path: path.into(),
        ..Default::default()
    }
}

fn mounts() -> Vec<VolumeMount> {
    vec![
        mount("workload-socket", "/var/run/secrets/workload-spiffe-uds"),
        mount("credential-socket", "/var/run/secrets/credential-uds"),
        mount(
            "workload-certs",
            "/var/run/secrets/workload-spiffe-credentials",
        ),
        mount("istiod-ca-cert", "/var/run/secrets/istio"),
        mount("istio-data", "/var/lib/istio/data"),
        mount("istio-envoy", "/etc/istio/proxy"),
        mount("istio-token", "/var/run/secrets/tokens"),
        mount("istio-podinfo", "/etc/istio/pod"),
    ]
}

fn empty_dir(name: &str, medium: Option<&str>) -> Volume {
    Volume {
        name: name.into(),
        empty_dir: Some(EmptyDirVolumeSource {
            medium: medium.map(str::to_string),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The volumes the proxy's mounts name, in the template's order.
pub fn volumes() -> Vec<Volume> {
    let pod_field = |path: &str, field: &str| DownwardAPIVolumeFile {
        path: path.into(),
        field_ref: Some(ObjectFieldSelector {
            field_path: field.into(),
            api_version: None,
        }),
        ..Default::default()
    };
    vec![
        empty_dir("workload-socket", None),
        empty_dir("credential-socket", None),
        empty_dir("workload-certs", None),
        empty_dir("istio-envoy", Some("Memory")),
        empty_dir("istio-data", None),
        Volume {
            name: "istio-podinfo".into(),
            downward_api: Some(DownwardAPIVolumeSource {
                items: Some(vec![
                    pod_field("labels", "metadata.labels"),
                    pod_field("annotations", "metadata.annotations"),
                ]),
                ..Default::default()
            }),
            ..Default::default()
        },
        Volume {
            name: "istio-token".into(),
            projected: Some(ProjectedVolumeSource {
                sources: Some(vec![VolumeProjection {
                    service_account_token: Some(ServiceAccountTokenProjection {
                        audience: Some(TOKEN_AUDIENCE.into()),
                        expiration_seconds: Some(43200),
                        path: "istio-token".into(),
                        user: None,
                    }),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..Default::default()
        },
        Volume {
            name: "istiod-ca-cert".into(),
            config_map: Some(ConfigMapVolumeSource {
                name: crate::security::trust::ROOT_CONFIGMAP.into(),
                ..Default::default()
            }),
            ..Default::default()
        },
    ]
}

/// A gateway pod running Istio's proxy as `proxy_type` (`router`, or `waypoint` for ambient
/// mode's; no capture), with extra proxy environment (its network view, …) and ports.
pub fn gateway_pod_spec(
    config: &InjectConfig,
    proxy_type: &str,
    service_account: &str,
    extra_env: &[(&str, &str)],
    ports: Vec<ContainerPort>,
) -> PodSpec {
    let mut env = vec![
        value("JWT_POLICY", "third-party-jwt"),
        value("PILOT_CERT_PROVIDER", "istiod"),
        value("CA_ADDR", &config.ca_address()),
        field("POD_NAME", "metadata.name"),
        field("POD_NAMESPACE", "metadata.namespace"),
        field("INSTANCE_IP", "status.podIP"),
        field("SERVICE_ACCOUNT", "spec.serviceAccountName"),
        field("HOST_IP", "status.hostIP"),
        value("ISTIO_META_CLUSTER_ID", &config.cluster_id),
    ];
    if !config.network.is_empty() {
        env.push(value("ISTIO_META_NETWORK", &config.network));
    }
    env.extend(mesh_env(config));
    env.extend(extra_env.iter().map(|(k, v)| value(k, v)));
    let quantities = |cpu: &str, memory: &str| {
        Some(BTreeMap::from([
            ("cpu".to_string(), Quantity(cpu.into())),
            ("memory".to_string(), Quantity(memory.into())),
        ]))
    };
    let proxy = Container {
        name: PROXY_CONTAINER.into(),
        image: Some(config.proxy_image.clone()),
        args: Some(vec![
            "proxy".into(),
            proxy_type.into(),
            "--domain".into(),
            format!("$(POD_NAMESPACE).svc.{}", config.domain_suffix),
            "--proxyLogLevel=warning".into(),
            "--proxyComponentLogLevel=misc:error".into(),
            "--log_output_level=default:info".into(),
        ]),
        ports: Some(ports),
        env: Some(env),
        readiness_probe: Some(Probe {
            http_get: Some(HTTPGetAction {
                path: Some("/healthz/ready".into()),
                port: IntOrString::Int(15021),
                ..Default::default()
            }),
            period_seconds: Some(2),
            timeout_seconds: Some(1),
            failure_threshold: Some(30),
            ..Default::default()
        }),
        resources: Some(ResourceRequirements {
            requests: quantities("100m", "128Mi"),
            limits: quantities("2000m", "1024Mi"),
            ..Default::default()
        }),
        security_context: Some(proxy_security(false)),
        volume_mounts: Some(mounts()),
        ..Default::default()
    };
    PodSpec {
        service_account_name: Some(service_account.into()),
        containers: vec![proxy],
        volumes: Some(volumes()),
        ..Default::default()
    }
}
