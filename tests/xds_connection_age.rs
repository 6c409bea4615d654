//! xDS streams have a maximum age (istiod: 30 min with jitter): once reached, the stream ends
//! cleanly (no error status) so the proxy reconnects, possibly to another replica.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;

const SIDECAR: &str = "sidecar~10.1.1.11~reviews-v1-7f9c8d.bookinfo~bookinfo.svc.cluster.local";
const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";

fn cds_request() -> DiscoveryRequest {
    DiscoveryRequest {
        node: Some(node(SIDECAR, &[("CLUSTER_ID", "cluster1")])),
        type_url: CDS.into(),
        ..Default::default()
    }
}

#[tokio::test]
async fn a_stream_ends_cleanly_at_its_maximum_age_and_the_proxy_reconnects() {
    let dir = copy_tree(Path::new(EXAMPLE));
    let mp = start_meshpilot(dir.path(), &["--xds-max-connection-age", "2s"]).await;

    let mut ads = AdsClient::connect(mp.xds_addr).await.expect("connect");
    let opened = Instant::now();
    ads.request(cds_request());
    ads.response(Duration::from_secs(5)).await;
    // Pushes may still arrive; the stream must end without an error status.
    let age = loop {
        match ads.receive(Duration::from_secs(4)).await {
            Received::Message(_) => continue,
            Received::Ended => break opened.elapsed(),
            other => panic!("expected the stream to end cleanly, got {other:?}"),
        }
    };
    // Not before its age, less the jitter (a busy machine may only end it later).
    assert!(
        age >= Duration::from_millis(1800),
        "ended after {age:?}, before 2s - 10 %"
    );
    wait_for(
        "the connection unregistered",
        Duration::from_secs(5),
        || {
            let xds = mp.xds.clone();
            async move { (xds.connection_count() == 0).then_some(()) }
        },
    )
    .await;

    // A reconnecting proxy is served as usual.
    let mut again = AdsClient::connect(mp.xds_addr).await.expect("reconnect");
    again.request(cds_request());
    let response = again.response(Duration::from_secs(5)).await;
    assert!(!response.resources.is_empty());
}

#[tokio::test]
async fn a_zero_age_keeps_streams_open() {
    let dir = copy_tree(Path::new(EXAMPLE));
    let mp = start_meshpilot(dir.path(), &["--xds-max-connection-age", "0s"]).await;
    let mut ads = AdsClient::connect(mp.xds_addr).await.expect("connect");
    ads.request(cds_request());
    ads.response(Duration::from_secs(5)).await;
    let deadline = Instant::now() + Duration::from_secs(3);
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        match ads.receive(left).await {
            Received::Message(_) => continue,
            Received::Silent => break,
            other => panic!("the stream must stay open, got {other:?}"),
        }
    }
}
