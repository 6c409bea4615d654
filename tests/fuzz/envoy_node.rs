//! Envoy nodes: the first request of an xDS stream, as the bytes gRPC hands over (decoded as the
//! server does) and as generated nodes with arbitrary ids and metadata, through `Proxy::from_node`.

use std::collections::HashMap;

use envoy_types::pb::envoy::config::core::v3::{Locality, Node};
use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DiscoveryRequest};
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};
use meshpilot::xds::proxy::Proxy;
use proptest::prelude::*;
use prost::Message;

use crate::mutate::mutated_bytes;
use crate::{bounded, clear_refusal, fuzz};

/// Every node error starts by saying what of the node it refuses.
const NODE_ERRORS: &[&str] = &["invalid node", "the first request"];

/// The metadata keys meshpilot reads, and one it does not.
const KEYS: &[&str] = &[
    "NAMESPACE",
    "INSTANCE_IPS",
    "GENERATOR",
    "CLUSTER_ID",
    "NETWORK",
    "LABELS",
    "ISTIO_VERSION",
    "SERVICE_ACCOUNT",
    "REQUESTED_NETWORK_VIEW",
    "AUTO_REGISTER_GROUP",
    "PROXY_CONFIG",
];

fn string(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_string())),
    }
}

fn sidecar() -> Node {
    let labels = Struct {
        fields: HashMap::from([
            ("app".to_string(), string("reviews")),
            ("version".to_string(), string("v1")),
        ]),
    };
    let fields = HashMap::from([
        ("NAMESPACE".to_string(), string("bookinfo")),
        ("INSTANCE_IPS".to_string(), string("10.1.1.11,fd00::11")),
        ("CLUSTER_ID".to_string(), string("cluster1")),
        ("NETWORK".to_string(), string("net1")),
        ("ISTIO_VERSION".to_string(), string("1.27.0")),
        ("REQUESTED_NETWORK_VIEW".to_string(), string("net1,net2")),
        (
            "LABELS".to_string(),
            Value {
                kind: Some(Kind::StructValue(labels)),
            },
        ),
    ]);
    Node {
        id: "sidecar~10.1.1.11~reviews-v1-7f9c8d.bookinfo~bookinfo.svc.cluster.local".into(),
        cluster: "reviews.bookinfo".into(),
        metadata: Some(Struct { fields }),
        locality: Some(Locality {
            region: "us-east".into(),
            zone: "us-east-1a".into(),
            sub_zone: "rack1".into(),
        }),
        ..Default::default()
    }
}

fn grpc_router() -> Node {
    let fields = HashMap::from([
        ("GENERATOR".to_string(), string("grpc")),
        ("AUTO_REGISTER_GROUP".to_string(), string("ratings")),
    ]);
    Node {
        id: "router~fd00::1~gw-5d8f.istio-system~istio-system.svc.cluster.local".into(),
        metadata: Some(Struct { fields }),
        ..Default::default()
    }
}

/// The first requests of a SotW and a Delta stream, encoded.
fn encoded_seeds() -> Vec<Vec<u8>> {
    let sotw = DiscoveryRequest {
        node: Some(sidecar()),
        type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".into(),
        resource_names: vec!["outbound|9080||reviews.bookinfo.svc.cluster.local".into()],
        ..Default::default()
    };
    let delta = DeltaDiscoveryRequest {
        node: Some(grpc_router()),
        type_url: "type.googleapis.com/envoy.config.listener.v3.Listener".into(),
        resource_names_subscribe: vec!["reviews.bookinfo.svc.cluster.local:9080".into()],
        ..Default::default()
    };
    vec![sotw.encode_to_vec(), delta.encode_to_vec()]
}

fn value(depth: u32) -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        "\\PC{0,24}".prop_map(Kind::StringValue),
        "( ?([0-9a-f:.]{1,40}|[a-z]{1,8}),?){0,6}".prop_map(Kind::StringValue),
        any::<f64>().prop_map(Kind::NumberValue),
        any::<bool>().prop_map(Kind::BoolValue),
        Just(Kind::NullValue(0)),
    ];
    leaf.prop_map(|kind| Value { kind: Some(kind) })
        .prop_recursive(depth, 32, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..8)
                    .prop_map(|values| Kind::ListValue(ListValue { values })),
                proptest::collection::hash_map("\\PC{0,12}", inner, 0..8)
                    .prop_map(|fields| Kind::StructValue(Struct { fields })),
            ]
            .prop_map(|kind| Value { kind: Some(kind) })
        })
}

fn metadata() -> impl Strategy<Value = Struct> {
    let key = prop_oneof![
        4 => (0..KEYS.len()).prop_map(|k| KEYS[k].to_string()),
        1 => "\\PC{0,16}",
    ];
    proptest::collection::hash_map(key, value(2), 0..10).prop_map(|fields| Struct { fields })
}

/// Ids of four (or some other number of) `~`-separated parts, each plausible or not.
fn node_id() -> impl Strategy<Value = String> {
    let part = prop_oneof![
        Just("sidecar".to_string()),
        Just("router".to_string()),
        "[0-9]{1,3}\\.[0-9]{1,3}\\.[0-9]{1,3}\\.[0-9]{1,3}",
        "[0-9a-f:]{0,40}",
        "[a-z0-9-]{0,20}\\.[a-z0-9-]{0,20}",
        "[a-z0-9-]{0,12}\\.svc\\.cluster\\.local",
        "\\PC{0,30}",
    ];
    proptest::collection::vec(part, 0..7).prop_map(|parts| parts.join("~"))
}

fn node() -> impl Strategy<Value = Node> {
    let locality = proptest::option::of(("\\PC{0,10}", "\\PC{0,10}", "\\PC{0,10}")).prop_map(|l| {
        l.map(|(region, zone, sub_zone)| Locality {
            region,
            zone,
            sub_zone,
        })
    });
    (node_id(), proptest::option::of(metadata()), locality).prop_map(|(id, metadata, locality)| {
        Node {
            id,
            metadata,
            locality,
            ..Default::default()
        }
    })
}

fn check(node: Option<&Node>, size: usize) -> Result<(), TestCaseError> {
    if let Err(e) = bounded(size, || Proxy::from_node(node))? {
        clear_refusal(&e, NODE_ERRORS)?;
    }
    Ok(())
}

#[test]
fn envoy_node_bytes() {
    fuzz(
        "envoy node bytes",
        mutated_bytes(encoded_seeds(), 8),
        |bytes| {
            // What the gRPC codec would hand over; bytes that do not decode never reach the node.
            let decoded = bounded(bytes.len(), || DiscoveryRequest::decode(bytes.as_slice()))?;
            if let Ok(request) = decoded {
                check(request.node.as_ref(), bytes.len())?;
            }
            let decoded = bounded(bytes.len(), || {
                DeltaDiscoveryRequest::decode(bytes.as_slice())
            })?;
            if let Ok(request) = decoded {
                check(request.node.as_ref(), bytes.len())?;
            }
            Ok(())
        },
    );
}

#[test]
fn envoy_node_metadata() {
    let nodes = prop_oneof![
        node(),
        // A real id with generated metadata reaches past the id checks.
        (
            metadata(),
            prop_oneof![Just(sidecar()), Just(grpc_router())]
        )
            .prop_map(|(metadata, mut node)| {
                node.metadata = Some(metadata);
                node
            }),
    ];
    fuzz("envoy node metadata", nodes, |node| {
        check(Some(&node), node.encoded_len())
    });
}
