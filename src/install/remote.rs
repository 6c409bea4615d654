//! A remote cluster of a primary-remote mesh: no control plane of its own, but Service `istiod`
//! pointing at the primary's exposed address (so injected proxies' `istiod.<ns>.svc:15012` reaches
//! it), the injection webhook calling the primary by URL with this cluster's id and network, the
//! system namespace opting in to the primary (root certificates, webhook caBundle), and the reader
//! account the primary reads the cluster with.

use std::net::IpAddr;

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::{labels, meta, meta_labelled, Values};

fn port(name: &str, port: i32, target: Option<i32>) -> ServicePort {
    ServicePort {
        name: Some(name.into()),
        port,
        target_port: target.map(IntOrString::Int),
        protocol: Some("TCP".into()),
        ..Default::default()
    }
}

/// Service `istiod` without a selector: an EndpointSlice holds the primary's address (an IP), or
/// the Service is an ExternalName (a DNS name).
pub fn service(values: &Values) -> Service {
    let external = values.remote_pilot_address.parse::<IpAddr>().is_err();
    Service {
        metadata: meta(&values.revision.suffixed("istiod"), Some(&values.namespace)),
        spec: Some(ServiceSpec {
            ports: Some(vec![
                port("tcp-istiod", 15012, None),
                port("tcp-webhook", 443, Some(15017)),
            ]),
            type_: external.then(|| "ExternalName".into()),
            external_name: external.then(|| values.remote_pilot_address.clone()),
            ..Default::default()
        }),
        status: None,
    }
}

/// The primary's address behind Service `istiod`, when it is an IP.
pub fn endpoints(values: &Values) -> Option<EndpointSlice> {
    let ip = values.remote_pilot_address.parse::<IpAddr>().ok()?;
    let port = |name: &str, number: i32| EndpointPort {
        name: Some(name.into()),
        port: Some(number),
        protocol: Some("TCP".into()),
        app_protocol: None,
    };
    let service = values.revision.suffixed("istiod");
    Some(EndpointSlice {
        metadata: meta_labelled(
            &values.revision.suffixed("istiod-remote"),
            Some(&values.namespace),
            labels(&[
                ("kubernetes.io/service-name", service.as_str()),
                ("endpointslice.kubernetes.io/managed-by", "meshpilot"),
            ]),
        ),
        address_type: if ip.is_ipv4() { "IPv4" } else { "IPv6" }.into(),
        endpoints: Some(vec![Endpoint {
            addresses: vec![ip.to_string()],
            ..Default::default()
        }]),
        ports: Some(vec![port("tcp-istiod", 15012), port("tcp-webhook", 15017)]),
    })
}

/// Where this cluster's API server calls the primary's injector: its id and network in the path,
/// as istiod reads them.
pub fn injection_path(values: &Values) -> String {
    let network = match values.network.as_str() {
        "" => String::new(),
        net => format!("/net/{}", net.replace('/', "--slash--")),
    };
    format!(
        "/inject/cluster/{}{network}",
        values.cluster_id.replace('/', "--slash--")
    )
}

pub fn webhook_base(values: &Values) -> String {
    match values.remote_pilot_address.parse::<IpAddr>() {
        Ok(IpAddr::V6(ip)) => format!("https://[{ip}]:15017"),
        _ => format!("https://{}:15017", values.remote_pilot_address),
    }
}
