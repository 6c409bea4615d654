//! Raw ADS clients (tonic, envoy-types) for protocol-level assertions: SotW and Delta.
//!
//! Every outcome is explicit: a test expecting a response fails on silence, on an error and on the
//! server ending the stream; a test expecting silence fails on any of those too.

use std::net::SocketAddr;
use std::time::Duration;

use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::transport::Channel;
use tonic::{Code, Status, Streaming};

/// The resources of one type `node` is sent over a new stream: the ones `names` names, or every
/// one (wildcard) when it names none; decoded.
pub async fn fetch<T: prost::Message + Default>(
    xds: SocketAddr,
    node: envoy_types::pb::envoy::config::core::v3::Node,
    type_url: &str,
    names: &[&str],
) -> Vec<T> {
    let mut ads = AdsClient::connect(xds).await.expect("ADS connects");
    ads.request(DiscoveryRequest {
        node: Some(node),
        type_url: type_url.into(),
        resource_names: names.iter().map(|n| n.to_string()).collect(),
        ..Default::default()
    });
    ads.response(Duration::from_secs(10))
        .await
        .resources
        .iter()
        .map(|a| T::decode(&a.value[..]).expect("a resource of the type asked for"))
        .collect()
}

/// One ADS stream seen from the proxy's side.
pub struct AdsStream<Req, Resp> {
    requests: UnboundedSender<Req>,
    responses: Streaming<Resp>,
}

pub type AdsClient = AdsStream<DiscoveryRequest, DiscoveryResponse>;
pub type DeltaClient = AdsStream<DeltaDiscoveryRequest, DeltaDiscoveryResponse>;

/// What the server did next.
#[derive(Debug)]
pub enum Received<T> {
    Message(T),
    Error(Status),
    /// The stream ended without an error status.
    Ended,
    /// Nothing within the bound.
    Silent,
}

async fn plaintext(xds: SocketAddr) -> Result<Channel, Status> {
    tonic::transport::Endpoint::from_shared(format!("http://{xds}"))
        .expect("endpoint")
        .connect()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))
}

impl AdsClient {
    pub async fn connect(xds: SocketAddr) -> Result<AdsClient, Status> {
        Self::over(plaintext(xds).await?).await
    }

    pub async fn over(channel: Channel) -> Result<AdsClient, Status> {
        let (tx, rx) = unbounded_channel();
        // meshpilot answers the call at once; the stream's first message is the caller's to send.
        let responses = AggregatedDiscoveryServiceClient::new(channel)
            .stream_aggregated_resources(UnboundedReceiverStream::new(rx))
            .await?
            .into_inner();
        Ok(AdsStream {
            requests: tx,
            responses,
        })
    }

    /// ACKs a response, subscribing to `names` (empty: the wildcard).
    pub fn ack(&self, r: &DiscoveryResponse, names: Vec<String>) {
        self.request(DiscoveryRequest {
            type_url: r.type_url.clone(),
            version_info: r.version_info.clone(),
            response_nonce: r.nonce.clone(),
            resource_names: names,
            ..Default::default()
        });
    }
}

impl DeltaClient {
    pub async fn connect(xds: SocketAddr) -> Result<DeltaClient, Status> {
        let (tx, rx) = unbounded_channel();
        let responses = AggregatedDiscoveryServiceClient::new(plaintext(xds).await?)
            .delta_aggregated_resources(UnboundedReceiverStream::new(rx))
            .await?
            .into_inner();
        Ok(AdsStream {
            requests: tx,
            responses,
        })
    }
}

impl<Req, Resp: prost::Message + Default + std::fmt::Debug> AdsStream<Req, Resp> {
    pub fn request(&self, request: Req) {
        assert!(
            self.requests.send(request).is_ok(),
            "the request stream is closed"
        );
    }

    /// The next event within `bound`.
    pub async fn receive(&mut self, bound: Duration) -> Received<Resp> {
        match tokio::time::timeout(bound, self.responses.message()).await {
            Ok(Ok(Some(r))) => Received::Message(r),
            Ok(Ok(None)) => Received::Ended,
            Ok(Err(status)) => Received::Error(status),
            Err(_) => Received::Silent,
        }
    }

    /// The next response, or the stream's error; the end of the stream is reported as an ABORTED
    /// error and silence for `bound` as None.
    pub async fn next(&mut self, bound: Duration) -> Option<Result<Resp, Status>> {
        match self.receive(bound).await {
            Received::Message(r) => Some(Ok(r)),
            Received::Error(status) => Some(Err(status)),
            Received::Ended => Some(Err(Status::new(
                Code::Aborted,
                "(test client) the server ended the stream",
            ))),
            Received::Silent => None,
        }
    }

    /// The next response; fails the test on anything else.
    pub async fn response(&mut self, bound: Duration) -> Resp {
        match self.receive(bound).await {
            Received::Message(r) => r,
            other => panic!("expected a response within {bound:?}, got {other:?}"),
        }
    }

    /// The error status ending the stream; fails the test on anything else.
    pub async fn error(&mut self, bound: Duration) -> Status {
        match self.receive(bound).await {
            Received::Error(status) => status,
            other => panic!("expected an error status within {bound:?}, got {other:?}"),
        }
    }

    /// Nothing arrives for `bound` and the stream stays open.
    pub async fn silence(&mut self, bound: Duration) {
        match self.receive(bound).await {
            Received::Silent => {}
            other => panic!("expected silence for {bound:?}, got {other:?}"),
        }
    }
}

/// The RDS route a chain's connection manager asks for, if its last filter is one.
pub fn rds_route(
    chain: &envoy_types::pb::envoy::config::listener::v3::FilterChain,
) -> Option<String> {
    use envoy_types::pb::envoy::config::listener::v3::filter::ConfigType;
    use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
        http_connection_manager::RouteSpecifier, HttpConnectionManager,
    };
    let Some(ConfigType::TypedConfig(any)) = chain.filters.last()?.config_type.as_ref() else {
        return None;
    };
    let hcm = <HttpConnectionManager as prost::Message>::decode(&any.value[..]).ok()?;
    match hcm.route_specifier? {
        RouteSpecifier::Rds(rds) => Some(rds.route_config_name),
        _ => None,
    }
}
