//! The east-west gateway of a network: Istio's proxyv2 as a router labelled
//! `istio: eastwestgateway` (how meshpilot recognises it), its LoadBalancer Service labelled with
//! the network (how meshpilot finds its address), and Istio's Gateways for it — AUTO_PASSTHROUGH on
//! 15443 and the control plane's 15012/15017 passed through (istiod's samples), so a mesh mixing
//! meshpilot and istiod configures it alike.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{
    ContainerPort, PodTemplateSpec, Service, ServicePort, ServiceSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::istio_objects::{
    Destination, Gateway, GatewaySpec, Port, PortSelector, RouteDestination, Server, ServerTls,
    TlsMatch, TlsRoute, VirtualService, VirtualServiceSpec, NETWORKING_V1,
};
use super::{labels, meta, meta_labelled, Values};
use crate::inject::{default_mesh, gateway_pod_spec, InjectConfig};

const NAME: &str = "istio-eastwestgateway";

fn selector() -> BTreeMap<String, String> {
    labels(&[("istio", "eastwestgateway"), ("app", NAME)])
}

/// (name, port): status, the cross-network mTLS port, the control plane's two.
const PORTS: [(&str, i32); 4] = [
    ("status-port", 15021),
    ("tls", 15443),
    ("tls-istiod", 15012),
    ("tls-webhook", 15017),
];

pub fn service_account(values: &Values) -> k8s_openapi::api::core::v1::ServiceAccount {
    super::rbac::service_account(NAME, &values.namespace)
}

pub fn deployment(values: &Values) -> Deployment {
    let config = InjectConfig {
        proxy_image: values.proxy_image.clone(),
        cluster_id: values.cluster_id.clone(),
        network: values.network.clone(),
        mesh_id: values.mesh_id.clone(),
        revision: values.revision.clone(),
        system_namespace: values.namespace.clone(),
        domain_suffix: "cluster.local".into(),
        mesh: Arc::new(default_mesh(&values.trust_domain, &values.namespace)),
        proxy_configs: Default::default(),
    };
    let proxy_config =
        serde_json::json!({"discoveryAddress": values.discovery_address()}).to_string();
    let mut ports: Vec<ContainerPort> = PORTS
        .iter()
        .map(|(name, port)| ContainerPort {
            name: Some(name.to_string()),
            container_port: *port,
            protocol: Some("TCP".into()),
            ..Default::default()
        })
        .collect();
    ports.push(ContainerPort {
        name: Some("http-envoy-prom".into()),
        container_port: 15090,
        protocol: Some("TCP".into()),
        ..Default::default()
    });
    let spec = gateway_pod_spec(
        &config,
        "router",
        NAME,
        &[
            ("PROXY_CONFIG", &proxy_config),
            ("ISTIO_META_REQUESTED_NETWORK_VIEW", &values.network),
            ("ISTIO_META_ROUTER_MODE", "sni-dnat"),
        ],
        ports,
    );
    let mut pod_labels = selector();
    pod_labels.extend(labels(&[
        ("topology.istio.io/network", values.network.as_str()),
        ("sidecar.istio.io/inject", "false"),
    ]));
    let mut template_meta = meta_labelled("", None, pod_labels);
    template_meta.name = None;
    Deployment {
        metadata: meta_labelled(NAME, Some(&values.namespace), selector()),
        spec: DeploymentSpec {
            replicas: Some(1),
            selector: LabelSelector {
                match_labels: Some(selector()),
                match_expressions: None,
            },
            template: PodTemplateSpec {
                metadata: Some(template_meta),
                spec: Some(spec),
            },
            ..Default::default()
        },
        status: None,
    }
}

pub fn service(values: &Values) -> Service {
    let mut service_labels = selector();
    service_labels.insert("topology.istio.io/network".into(), values.network.clone());
    Service {
        metadata: meta_labelled(NAME, Some(&values.namespace), service_labels),
        spec: Some(ServiceSpec {
            type_: Some("LoadBalancer".into()),
            selector: Some(selector()),
            ports: Some(
                PORTS
                    .iter()
                    .map(|(name, port)| ServicePort {
                        name: Some(name.to_string()),
                        port: *port,
                        target_port: Some(IntOrString::Int(*port)),
                        protocol: Some("TCP".into()),
                        ..Default::default()
                    })
                    .collect(),
            ),
            ..Default::default()
        }),
        status: None,
    }
}

fn server(number: u32, name: &str, mode: &str, host: &str) -> Server {
    Server {
        port: Port {
            number,
            name: name.into(),
            protocol: "TLS".into(),
        },
        tls: ServerTls { mode: mode.into() },
        hosts: vec![host.into()],
    }
}

fn gateway(values: &Values, name: &str, servers: Vec<Server>) -> Gateway {
    Gateway {
        api_version: NETWORKING_V1.into(),
        kind: "Gateway".into(),
        metadata: meta(name, Some(&values.namespace)),
        spec: GatewaySpec {
            selector: labels(&[("istio", "eastwestgateway")]),
            servers,
        },
    }
}

/// Every `*.local` service reachable through 15443 by SNI, mTLS untouched.
pub fn cross_network_gateway(values: &Values) -> Gateway {
    gateway(
        values,
        "cross-network-gateway",
        vec![server(15443, "tls", "AUTO_PASSTHROUGH", "*.local")],
    )
}

/// The control plane's secure xDS and webhook ports through the gateway, for remote clusters.
pub fn istiod_gateway(values: &Values) -> Gateway {
    gateway(
        values,
        "istiod-gateway",
        vec![
            server(15012, "tls-istiod", "PASSTHROUGH", "*"),
            server(15017, "tls-istiodwebhook", "PASSTHROUGH", "*"),
        ],
    )
}

pub fn istiod_virtual_service(values: &Values) -> VirtualService {
    let host = format!(
        "{}.cluster.local",
        values.revision.service_host(&values.namespace)
    );
    let route = |port: u32, target: u32| TlsRoute {
        matches: vec![TlsMatch {
            port,
            sni_hosts: vec!["*".into()],
        }],
        route: vec![RouteDestination {
            destination: Destination {
                host: host.clone(),
                port: PortSelector { number: target },
            },
        }],
    };
    VirtualService {
        api_version: NETWORKING_V1.into(),
        kind: "VirtualService".into(),
        metadata: meta("istiod-vs", Some(&values.namespace)),
        spec: VirtualServiceSpec {
            hosts: vec!["*".into()],
            gateways: vec!["istiod-gateway".into()],
            tls: vec![route(15012, 15012), route(15017, 443)],
        },
    }
}
