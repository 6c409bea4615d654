//! A simulated proxy's ADS stream: its own connection, SotW or Delta, ACKing every response as
//! Envoy does. Responses are handed over raw; the harness decodes only what it checks.

use std::collections::HashMap;
use std::net::SocketAddr;

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DiscoveryRequest};
use prost::Message;
use tokio::sync::mpsc;

pub const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
pub const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
pub const LDS: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
pub const NDS: &str = "type.googleapis.com/istio.networking.nds.v1.NameTable";
pub const ADDRESS: &str = "type.googleapis.com/istio.workload.Address";

/// What a proxy asks for on its stream.
pub struct Subscription {
    pub node: Node,
    pub delta: bool,
    /// Type URL → resource names (none: wildcard).
    pub types: Vec<(&'static str, Vec<String>)>,
}

/// A response as the harness keeps it: the few header fields, and the raw bytes.
/// The harness shares the server's two cores, so it never decodes what it does not need.
pub struct Raw {
    pub type_url: String,
    pub version: String,
    pub nonce: String,
    pub body: bytes::Bytes,
}

/// How a stream ended without an error status.
#[derive(Debug, PartialEq, Eq)]
pub enum Ended {
    /// The server closed it.
    Closed,
    /// `cancel` fired.
    Cancelled,
}

/// A new connection to the xDS port.
pub async fn connect(
    xds: SocketAddr,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    tonic::transport::Endpoint::from_shared(format!("http://{xds}"))
        .unwrap()
        .connect()
        .await
}

/// One ADS stream on `channel`: subscribes, ACKs each response, then hands it to `on_response`.
/// Ends when the server ends it (an error status is returned as such) or when `cancel` completes.
pub async fn stream(
    channel: tonic::transport::Channel,
    sub: &Subscription,
    mut on_response: impl FnMut(&Raw),
    cancel: impl std::future::Future<Output = ()>,
) -> Result<Ended, tonic::Status> {
    let mut grpc = tonic::client::Grpc::new(channel).max_decoding_message_size(64 << 20);
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let path = if sub.delta {
        "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources"
    } else {
        "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources"
    };
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(path);
    tokio::pin!(cancel);
    if sub.delta {
        let (tx, rx) = mpsc::unbounded_channel();
        for (i, (type_url, names)) in sub.types.iter().enumerate() {
            let _ = tx.send(DeltaDiscoveryRequest {
                node: (i == 0).then(|| sub.node.clone()),
                type_url: type_url.to_string(),
                resource_names_subscribe: names.clone(),
                ..Default::default()
            });
        }
        let request = tonic::Request::new(tokio_stream::wrappers::UnboundedReceiverStream::new(rx));
        let codec = RawCodec::<DeltaDiscoveryRequest>(Default::default());
        let mut responses = grpc.streaming(request, path, codec).await?.into_inner();
        loop {
            let raw = tokio::select! {
                next = responses.message() => match next? {
                    Some(raw) => raw,
                    None => return Ok(Ended::Closed),
                },
                () = &mut cancel => return Ok(Ended::Cancelled),
            };
            let _ = tx.send(DeltaDiscoveryRequest {
                type_url: raw.type_url.clone(),
                response_nonce: raw.nonce.clone(),
                ..Default::default()
            });
            on_response(&raw);
        }
    } else {
        let (tx, rx) = mpsc::unbounded_channel();
        for (i, (type_url, names)) in sub.types.iter().enumerate() {
            let _ = tx.send(DiscoveryRequest {
                node: (i == 0).then(|| sub.node.clone()),
                type_url: type_url.to_string(),
                resource_names: names.clone(),
                ..Default::default()
            });
        }
        let request = tonic::Request::new(tokio_stream::wrappers::UnboundedReceiverStream::new(rx));
        let codec = RawCodec::<DiscoveryRequest>(Default::default());
        let mut responses = grpc.streaming(request, path, codec).await?.into_inner();
        let names: HashMap<&str, &Vec<String>> = sub.types.iter().map(|(t, n)| (*t, n)).collect();
        loop {
            let raw = tokio::select! {
                next = responses.message() => match next? {
                    Some(raw) => raw,
                    None => return Ok(Ended::Closed),
                },
                () = &mut cancel => return Ok(Ended::Cancelled),
            };
            let _ = tx.send(DiscoveryRequest {
                type_url: raw.type_url.clone(),
                resource_names: names
                    .get(raw.type_url.as_str())
                    .map(|n| (*n).clone())
                    .unwrap_or_default(),
                version_info: raw.version.clone(),
                response_nonce: raw.nonce.clone(),
                ..Default::default()
            });
            on_response(&raw);
        }
    }
}

/// Requests encoded by prost; responses kept raw (DiscoveryResponse and DeltaDiscoveryResponse share
/// the field numbers read here: 1 version, 4 type_url, 5 nonce).
struct RawCodec<Req>(std::marker::PhantomData<Req>);

impl<Req: Message + Send + 'static> tonic::codec::Codec for RawCodec<Req> {
    type Encode = Req;
    type Decode = Raw;
    type Encoder = RawCodec<Req>;
    type Decoder = RawCodec<Req>;

    fn encoder(&mut self) -> Self::Encoder {
        RawCodec(std::marker::PhantomData)
    }

    fn decoder(&mut self) -> Self::Decoder {
        RawCodec(std::marker::PhantomData)
    }
}

impl<Req: Message> tonic::codec::Encoder for RawCodec<Req> {
    type Item = Req;
    type Error = tonic::Status;

    fn encode(
        &mut self,
        item: Req,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        item.encode(dst)
            .map_err(|e| tonic::Status::internal(e.to_string()))
    }
}

impl<Req> tonic::codec::Decoder for RawCodec<Req> {
    type Item = Raw;
    type Error = tonic::Status;

    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<Raw>, tonic::Status> {
        use bytes::Buf;
        use prost::encoding::{decode_key, decode_varint, WireType};
        let malformed = |e: prost::DecodeError| tonic::Status::internal(e.to_string());
        let body = src.copy_to_bytes(src.remaining());
        let (mut version, mut type_url, mut nonce) = (String::new(), String::new(), String::new());
        let mut cursor = &body[..];
        while cursor.has_remaining() {
            let (tag, wire) = decode_key(&mut cursor).map_err(malformed)?;
            let len = match wire {
                WireType::LengthDelimited => {
                    decode_varint(&mut cursor).map_err(malformed)? as usize
                }
                WireType::Varint => {
                    decode_varint(&mut cursor).map_err(malformed)?;
                    continue;
                }
                _ => return Err(tonic::Status::internal("unexpected wire type")),
            };
            let field = || String::from_utf8_lossy(&cursor[..len]).to_string();
            match tag {
                1 => version = field(),
                4 => type_url = field(),
                5 => nonce = field(),
                _ => {}
            }
            cursor.advance(len);
        }
        Ok(Some(Raw {
            type_url,
            version,
            nonce,
            body,
        }))
    }
}

/// Whether `needle` occurs in `haystack` (a SIMD search: the harness scans every response it
/// checks, megabytes per full push, on the cores meshpilot runs on).
pub fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    memchr::memmem::find(haystack, needle).is_some()
}
