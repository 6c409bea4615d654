//! EDS: a ClusterLoadAssignment per outbound cluster, the endpoints of every cluster grouped by
//! locality; endpoints that are not ready are left out.

use std::collections::BTreeMap;
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::{HealthStatus, Locality, Metadata};
use envoy_types::pb::envoy::config::endpoint::v3::{
    lb_endpoint, ClusterLoadAssignment, Endpoint as EnvoyEndpoint, LbEndpoint, LocalityLbEndpoints,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, UInt32Value, Value};

use super::{outbound_target, socket, Generation};
use crate::model::{Endpoint, EndpointShards, Health, Locality as ModelLocality, Service, TlsMode};
use crate::xds::protocol::ResourceType;
use crate::xds::wire::Resource;

pub fn build(g: &Generation<'_>, name: &str) -> Option<Arc<Resource>> {
    let (service, port) = outbound_target(g, name)?;
    let shards = g.mesh.endpoints.get(&service.key());
    let stamp = (
        g.services_version(),
        shards.as_ref().map_or(0, |s| s.version),
    );
    g.cache
        .get_or_build(ResourceType::Endpoint, name, 0, stamp, || {
            Some(Resource::encode(
                name,
                &assignment(name, &service, port, shards.as_deref()),
            ))
        })
}

fn assignment(
    name: &str,
    service: &Service,
    port: u16,
    shards: Option<&EndpointShards>,
) -> ClusterLoadAssignment {
    let port_name = service
        .port(port)
        .map(|p| p.name.as_str())
        .unwrap_or_default();
    let mut by_locality: BTreeMap<&ModelLocality, Vec<LbEndpoint>> = BTreeMap::new();
    for ep in shards.into_iter().flat_map(|s| s.endpoints()) {
        if ep.health == Health::Healthy && *ep.service_port_name == *port_name {
            by_locality
                .entry(&ep.locality)
                .or_default()
                .push(lb_endpoint(ep));
        }
    }
    ClusterLoadAssignment {
        cluster_name: name.to_string(),
        endpoints: by_locality
            .into_iter()
            .map(|(locality, lb_endpoints)| LocalityLbEndpoints {
                locality: Some(Locality {
                    region: locality.region.to_string(),
                    zone: locality.zone.to_string(),
                    sub_zone: locality.subzone.to_string(),
                }),
                load_balancing_weight: Some(UInt32Value {
                    value: lb_endpoints.len() as u32,
                }),
                lb_endpoints,
                priority: 0,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

fn lb_endpoint(ep: &Endpoint) -> LbEndpoint {
    let mut filter_metadata = std::collections::HashMap::new();
    if ep.tls_mode == TlsMode::Istio {
        // Selects the ISTIO_MUTUAL transport socket of the cluster's transport-socket matches.
        filter_metadata.insert(
            "envoy.transport_socket_match".to_string(),
            strings(&[("tlsMode", "istio")]),
        );
    }
    filter_metadata.insert(
        "istio".to_string(),
        strings(&[
            ("workload", &ep.workload),
            ("cluster", ep.cluster_id.as_str()),
            ("network", &ep.network),
        ]),
    );
    LbEndpoint {
        host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(EnvoyEndpoint {
            address: Some(socket(&ep.address.to_string(), ep.port)),
            ..Default::default()
        })),
        health_status: HealthStatus::Healthy as i32,
        metadata: Some(Metadata {
            filter_metadata,
            ..Default::default()
        }),
        load_balancing_weight: Some(UInt32Value { value: 1 }),
    }
}

fn strings(pairs: &[(&str, &str)]) -> Struct {
    Struct {
        fields: pairs
            .iter()
            .map(|(k, v)| {
                let value = Value {
                    kind: Some(Kind::StringValue(v.to_string())),
                };
                (k.to_string(), value)
            })
            .collect(),
    }
}
