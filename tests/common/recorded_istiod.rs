//! istiod's debug answers replayed from what a real istiod sent (tests/fixtures/fidelity), over
//! its secure port as istiod serves `istioctl` (istio/istio pilot/pkg/xds/statusgen.go): an ADS
//! stream over TLS, the caller's bearer token reviewed by the API server for audience `istio-ca`,
//! - `istio.io/debug/syncz`: one `ClientConfig` per connected proxy, its node carrying only its id
//!   and `CLUSTER_ID`, `NAMESPACE`, `ISTIO_VERSION` (`debugSyncz`), one generic xDS config per type
//!   it watches, sorted by type URL;
//! - `istio.io/debug/config_dump` naming one proxy id: its config dump's sections in istiod's order
//!   (pilot/pkg/xds/debug.go `connectionConfigDump`, endpoints left out): bootstrap (empty),
//!   clusters (`dynamic_active_clusters`), listeners (`dynamic_listeners[].active_state`), scoped
//!   routes (empty), routes (`dynamic_route_configs`), secrets and extension configs (none).
//!
//! The recorded resources are protobuf JSON; they are encoded back with Envoy's descriptors and
//! those of Istio's two filter configs the corpus carries, whose fields are as istio/api defines
//! them (envoy/config/filter/http/alpn/v2alpha1/config.proto,
//! envoy/config/filter/network/metadata_exchange/metadata_exchange.proto).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;

use envoy_types::pb::envoy::admin::v3::{
    clusters_config_dump::DynamicCluster, listeners_config_dump::DynamicListener,
    listeners_config_dump::DynamicListenerState, routes_config_dump::DynamicRouteConfig,
    BootstrapConfigDump, ClustersConfigDump, EcdsConfigDump, ListenersConfigDump, RoutesConfigDump,
    ScopedRoutesConfigDump, SecretsConfigDump,
};
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::envoy::service::status::v3::{
    client_config::GenericXdsConfig, ClientConfig, ConfigStatus,
};
use envoy_types::pb::google::protobuf::{value::Kind, Any, Struct, Value};
use futures::Stream;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use kube::api::PostParams;
use kube::{Api, Client};
use prost::{Message, Name};
use prost_reflect::{DescriptorPool, DeserializeOptions, DynamicMessage};
use prost_types::field_descriptor_proto::{Label, Type};
use prost_types::{
    DescriptorProto, EnumDescriptorProto, EnumValueDescriptorProto, FieldDescriptorProto,
    FileDescriptorProto,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

const SYNCZ: &str = "istio.io/debug/syncz";
const CONFIG_DUMP: &str = "istio.io/debug/config_dump";
/// The types a sidecar watches, as syncz lists them.
const WATCHED: [&str; 4] = [
    "type.googleapis.com/envoy.config.cluster.v3.Cluster",
    "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
    "type.googleapis.com/envoy.config.listener.v3.Listener",
    "type.googleapis.com/envoy.config.route.v3.RouteConfiguration",
];

/// A recorded istiod serving its debug types; stops when dropped.
pub struct RecordedIstiod {
    pub addr: SocketAddr,
    /// The CA its certificate chains to (PEM).
    pub root: String,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for RecordedIstiod {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One proxy as istiod holds it: its node and its config dump's sections.
struct Connected {
    node: Node,
    dump: Vec<Any>,
}

impl RecordedIstiod {
    /// Serves the proxies of these corpus directories as connected; `client` reviews tokens.
    pub async fn serve(client: Client, proxies: &[PathBuf]) -> Self {
        let pool = pool();
        let connected = proxies.iter().map(|dir| connected(&pool, dir)).collect();
        let (root, chain, key) = super::gateway_certs::issue("istiod.istio-system.svc");
        let tls = tonic::transport::ServerTlsConfig::new()
            .identity(tonic::transport::Identity::from_pem(chain, key));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let service = Debug {
            proxies: Arc::new(connected),
            client,
        };
        let server = tonic::transport::Server::builder()
            .tls_config(tls)
            .unwrap()
            .add_service(AggregatedDiscoveryServiceServer::new(service));
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
        let task = tokio::spawn(async move {
            let _ = server.serve_with_incoming(incoming).await;
        });
        Self { addr, root, task }
    }
}

fn string(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.into())),
    }
}

/// A proxy's node as syncz shows it, and its dump from the recorded responses.
fn connected(pool: &DescriptorPool, dir: &std::path::Path) -> Connected {
    let recorded = meshpilot::compare::read_node(&dir.join("node.json")).unwrap();
    let field = |key: &str| {
        let fields = &recorded.metadata.as_ref().unwrap().fields;
        match &fields.get(key)?.kind {
            Some(Kind::StringValue(s)) => Some(s.clone()),
            _ => None,
        }
    };
    let metadata = ["CLUSTER_ID", "NAMESPACE", "ISTIO_VERSION"]
        .into_iter()
        .filter_map(|key| Some((key.to_string(), string(&field(key)?))))
        .collect();
    let node = Node {
        id: recorded.id.clone(),
        metadata: Some(Struct { fields: metadata }),
        ..Default::default()
    };
    let state = meshpilot::compare::read_dump(dir).unwrap();
    let encode = |resource: &serde_json::Value| -> Any {
        let any = pool.get_message_by_name("google.protobuf.Any").unwrap();
        let options = DeserializeOptions::new().deny_unknown_fields(true);
        let message = DynamicMessage::deserialize_with_options(any, resource, &options)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        Any::decode(message.encode_to_vec().as_slice()).unwrap()
    };
    let version = "2026-01-01T00:00:00Z/1".to_string();
    let clusters = ClustersConfigDump {
        version_info: version.clone(),
        dynamic_active_clusters: (state[0].values())
            .map(|c| DynamicCluster {
                cluster: Some(encode(c)),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    };
    let listeners = ListenersConfigDump {
        version_info: version.clone(),
        dynamic_listeners: (state[2].iter())
            .map(|(name, l)| DynamicListener {
                name: name.clone(),
                active_state: Some(DynamicListenerState {
                    listener: Some(encode(l)),
                    version_info: version.clone(),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    };
    let routes = RoutesConfigDump {
        dynamic_route_configs: (state[3].values())
            .map(|r| DynamicRouteConfig {
                version_info: version.clone(),
                route_config: Some(encode(r)),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    };
    let dump = vec![
        pack(&BootstrapConfigDump::default()),
        pack(&clusters),
        pack(&listeners),
        pack(&ScopedRoutesConfigDump::default()),
        pack(&routes),
        pack(&SecretsConfigDump::default()),
        pack(&EcdsConfigDump::default()),
    ];
    Connected { node, dump }
}

fn pack<M: Message + Name>(message: &M) -> Any {
    Any {
        type_url: M::type_url(),
        value: message.encode_to_vec(),
    }
}

/// Envoy's descriptors (meshpilot's) and Istio's two filter configs.
fn pool() -> DescriptorPool {
    let mut pool = meshpilot::envoy_api::pool().unwrap().clone();
    let field = |name: &str, number: i32, label: Label, ty: Type, type_name: Option<&str>| {
        FieldDescriptorProto {
            name: Some(name.into()),
            number: Some(number),
            label: Some(label as i32),
            r#type: Some(ty as i32),
            type_name: type_name.map(str::to_string),
            ..Default::default()
        }
    };
    let alpn = "istio.envoy.config.filter.http.alpn.v2alpha1";
    let files = [
        FileDescriptorProto {
            name: Some("istio/alpn.proto".into()),
            package: Some(alpn.into()),
            syntax: Some("proto3".into()),
            message_type: vec![DescriptorProto {
                name: Some("FilterConfig".into()),
                field: vec![field(
                    "alpn_override",
                    1,
                    Label::Repeated,
                    Type::Message,
                    Some(&format!(".{alpn}.FilterConfig.AlpnOverride")),
                )],
                nested_type: vec![DescriptorProto {
                    name: Some("AlpnOverride".into()),
                    field: vec![
                        field(
                            "upstream_protocol",
                            1,
                            Label::Optional,
                            Type::Enum,
                            Some(&format!(".{alpn}.FilterConfig.Protocol")),
                        ),
                        field("alpn_override", 2, Label::Repeated, Type::String, None),
                    ],
                    ..Default::default()
                }],
                enum_type: vec![EnumDescriptorProto {
                    name: Some("Protocol".into()),
                    value: ["HTTP10", "HTTP11", "HTTP2"]
                        .iter()
                        .zip(0..)
                        .map(|(name, number)| EnumValueDescriptorProto {
                            name: Some(name.to_string()),
                            number: Some(number),
                            ..Default::default()
                        })
                        .collect(),
                    ..Default::default()
                }],
                ..Default::default()
            }],
            ..Default::default()
        },
        FileDescriptorProto {
            name: Some("istio/metadata_exchange.proto".into()),
            package: Some("envoy.tcp.metadataexchange.config".into()),
            syntax: Some("proto3".into()),
            message_type: vec![DescriptorProto {
                name: Some("MetadataExchange".into()),
                field: vec![
                    field("protocol", 1, Label::Optional, Type::String, None),
                    field("enable_discovery", 2, Label::Optional, Type::Bool, None),
                ],
                ..Default::default()
            }],
            ..Default::default()
        },
    ];
    for file in files {
        let message = format!("{}.", file.package());
        let known = (file.message_type.first())
            .and_then(|m| pool.get_message_by_name(&(message + m.name())));
        if known.is_none() {
            pool.add_file_descriptor_proto(file).unwrap();
        }
    }
    pool
}

struct Debug {
    proxies: Arc<Vec<Connected>>,
    client: Client,
}

impl Debug {
    /// Whether the API server authenticates the token for audience `istio-ca`, as istiod's
    /// Kubernetes JWT authenticator asks it.
    async fn authenticated(&self, token: &str) -> bool {
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: token.into(),
                audiences: Some(vec!["istio-ca".into()]),
            },
            ..Default::default()
        };
        let reviews: Api<TokenReview> = Api::all(self.client.clone());
        let answer = reviews.create(&PostParams::default(), &review).await;
        answer.ok().and_then(|r| r.status?.authenticated) == Some(true)
    }

    fn answer(&self, request: &DiscoveryRequest) -> Vec<Any> {
        match request.type_url.as_str() {
            SYNCZ => (self.proxies.iter())
                .map(|p| pack(&syncz(&p.node)))
                .collect(),
            CONFIG_DUMP => match request.resource_names.as_slice() {
                [id] => (self.proxies.iter())
                    .find(|p| p.node.id == *id)
                    .map(|p| p.dump.clone())
                    .unwrap_or_default(),
                _ => Vec::new(),
            },
            _ => Vec::new(),
        }
    }
}

fn syncz(node: &Node) -> ClientConfig {
    #[allow(deprecated)]
    ClientConfig {
        node: Some(node.clone()),
        generic_xds_configs: WATCHED
            .iter()
            .map(|url| GenericXdsConfig {
                type_url: url.to_string(),
                config_status: ConfigStatus::Synced as i32,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

type Responses = Pin<Box<dyn Stream<Item = Result<DiscoveryResponse, Status>> + Send>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for Debug {
    type StreamAggregatedResourcesStream = Responses;
    type DeltaAggregatedResourcesStream =
        Pin<Box<dyn Stream<Item = Result<DeltaDiscoveryResponse, Status>> + Send>>;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Responses>, Status> {
        let token = (request.metadata().get("authorization"))
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or_default()
            .to_string();
        if !self.authenticated(&token).await {
            return Err(Status::unauthenticated("authentication required"));
        }
        let mut requests = request.into_inner();
        let (tx, rx) = mpsc::channel(4);
        let this = Debug {
            proxies: self.proxies.clone(),
            client: self.client.clone(),
        };
        tokio::spawn(async move {
            let mut nonce = 0;
            while let Ok(Some(request)) = requests.message().await {
                // An ACK asks for nothing.
                if !request.response_nonce.is_empty() {
                    continue;
                }
                nonce += 1;
                let response = DiscoveryResponse {
                    type_url: request.type_url.clone(),
                    resources: this.answer(&request),
                    nonce: nonce.to_string(),
                    ..Default::default()
                };
                if tx.send(Ok(response)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn delta_aggregated_resources(
        &self,
        _request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        Err(Status::unimplemented(
            "istiod's debug types are asked over SotW",
        ))
    }
}
