//! The ADS protocol at message level, against meshpilot serving the bundled two-cluster example:
//! Delta subscriptions and NACKs, SotW NACKs, types meshpilot does not serve, silent streams — with
//! raw clients, and a NACK from a real Envoy.

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::google::rpc::Status as RpcStatus;

const REVIEWS: &str = "outbound|9080||reviews.bookinfo.svc.cluster.local";
const PRODUCTPAGE: &str = "outbound|9080||productpage.bookinfo.svc.cluster.local";
const GHOST: &str = "outbound|9080||ghost.bookinfo.svc.cluster.local";
const SIDECAR: &str = "sidecar~10.1.1.11~reviews-v1-7f9c8d.bookinfo~bookinfo.svc.cluster.local";
const BOUND: Duration = Duration::from_secs(10);
const QUIET: Duration = Duration::from_millis(400);
const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
/// Extension configs (ECDS), which meshpilot does not serve yet.
const ECDS: &str = "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig";

async fn meshpilot(dir: &Path) -> meshpilot::app::Running {
    start_meshpilot(
        dir,
        &[
            "--debounce-after",
            "0s",
            "--xds-first-request-timeout",
            "1s",
        ],
    )
    .await
}

fn delta(ty: &str, subscribe: &[&str], unsubscribe: &[&str], nonce: &str) -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        type_url: ty.into(),
        resource_names_subscribe: subscribe.iter().map(|s| s.to_string()).collect(),
        resource_names_unsubscribe: unsubscribe.iter().map(|s| s.to_string()).collect(),
        response_nonce: nonce.into(),
        ..Default::default()
    }
}

fn nack(message: &str) -> Option<RpcStatus> {
    Some(RpcStatus {
        code: tonic::Code::InvalidArgument as i32,
        message: message.into(),
        ..Default::default()
    })
}

/// The /debug/syncz status of one type of the only connected proxy.
async fn sync_status(mp: &meshpilot::app::Running, ty: &str) -> serde_json::Value {
    connected_status(mp, ty).await.expect("one proxy connected")
}

/// The status of one type of the only connected proxy, once there is one.
async fn connected_status(mp: &meshpilot::app::Running, ty: &str) -> Option<serde_json::Value> {
    let syncz = get_json(mp.http_addr, "/debug/syncz").await;
    let proxies = syncz.as_array().expect("syncz is an array");
    assert!(proxies.len() <= 1, "one proxy at most: {syncz}");
    proxies.first().map(|p| p["types"][ty].clone())
}

#[tokio::test]
async fn delta_subscriptions_at_message_level() {
    let dir = copy_tree(Path::new(EXAMPLE));
    let mp = meshpilot(dir.path()).await;
    let mut ads = DeltaClient::connect(mp.xds_addr).await.unwrap();

    // A name that does not exist is answered as removed, beside the one that does.
    let mut first = delta(EDS, &[REVIEWS, GHOST], &[], "");
    first.node = Some(node(SIDECAR, &[("CLUSTER_ID", "cluster1")]));
    ads.request(first);
    let r = ads.response(BOUND).await;
    let names: Vec<&str> = r.resources.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, [REVIEWS]);
    assert_eq!(r.removed_resources, [GHOST]);
    let reviews_version = r.resources[0].version.clone();
    ads.request(delta(EDS, &[], &[], &r.nonce));
    ads.silence(QUIET).await;

    // Asking again for a name the client holds sends it again, unchanged.
    ads.request(delta(EDS, &[REVIEWS], &[], &r.nonce));
    let again = ads.response(BOUND).await;
    assert_eq!(again.resources.len(), 1);
    assert_eq!(again.resources[0].name, REVIEWS);
    assert_eq!(again.resources[0].version, reviews_version);

    // A NACK carrying subscription changes: they are applied, the new name is answered.
    let mut rejected = delta(EDS, &[PRODUCTPAGE], &[REVIEWS], &again.nonce);
    rejected.error_detail = nack("reviews assignment rejected");
    ads.request(rejected);
    let r = ads.response(BOUND).await;
    let names: Vec<&str> = r.resources.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, [PRODUCTPAGE]);
    let status = sync_status(&mp, "eds").await;
    assert_eq!(
        status["last_nack"], "reviews assignment rejected",
        "{status}"
    );
    ads.request(delta(EDS, &[], &[], &r.nonce));
    ads.silence(QUIET).await;

    // `*` is a wildcard only for types that have one: for EDS it is a name like any other.
    ads.request(delta(EDS, &["*"], &[], &r.nonce));
    let r = ads.response(BOUND).await;
    assert!(r.resources.is_empty());
    assert_eq!(r.removed_resources, ["*"]);

    // The unsubscribed name is no longer pushed; the subscribed one is.
    write_atomic(
        &dir.path().join("clusters/cluster1/more.yaml"),
        &extra_endpoint("reviews", "10.1.1.99"),
    );
    ads.silence(QUIET).await;
    write_atomic(
        &dir.path().join("clusters/cluster1/more.yaml"),
        &extra_endpoint("productpage", "10.1.1.98"),
    );
    let push = ads.response(BOUND).await;
    assert_eq!(push.resources[0].name, PRODUCTPAGE);
}

/// A ready endpoint added to a service's endpoints in cluster1 (no pod: served without workload).
fn extra_endpoint(service: &str, ip: &str) -> String {
    format!(
        "
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: {service}-more, namespace: bookinfo, labels: {{kubernetes.io/service-name: {service}}}}}
addressType: IPv4
ports: [{{name: http, port: 9080}}]
endpoints:
- addresses: [{ip}]
  conditions: {{ready: true}}
"
    )
}

#[tokio::test]
async fn sotw_nack_is_recorded_not_answered_and_resent_on_change() {
    let dir = copy_tree(Path::new(EXAMPLE));
    let mp = meshpilot(dir.path()).await;
    let mut ads = AdsClient::connect(mp.xds_addr).await.unwrap();
    ads.request(DiscoveryRequest {
        node: Some(node(SIDECAR, &[("CLUSTER_ID", "cluster1")])),
        type_url: EDS.into(),
        resource_names: vec![REVIEWS.into()],
        ..Default::default()
    });
    let r = ads.response(BOUND).await;
    ads.request(DiscoveryRequest {
        type_url: EDS.into(),
        resource_names: vec![REVIEWS.into()],
        response_nonce: r.nonce.clone(),
        error_detail: nack("no thanks"),
        ..Default::default()
    });
    // No retry storm: the proxy keeps its previous config until something changes.
    ads.silence(QUIET).await;
    let status = sync_status(&mp, "eds").await;
    assert_eq!(status["last_nack"], "no thanks", "{status}");
    assert!(status["acked_version"].is_null(), "{status}");
    let (_, metrics) = http_get(mp.http_addr, "/metrics").await.unwrap();
    assert!(
        metrics.contains("pilot_total_xds_rejects{type=\"eds\"} 1"),
        "{metrics}"
    );

    write_atomic(
        &dir.path().join("clusters/cluster1/more.yaml"),
        &extra_endpoint("reviews", "10.1.1.99"),
    );
    let push = ads.response(BOUND).await;
    assert_eq!(push.type_url, EDS);
    assert_ne!(push.version_info, r.version_info);
    ads.request(DiscoveryRequest {
        type_url: EDS.into(),
        resource_names: vec![REVIEWS.into()],
        version_info: push.version_info.clone(),
        response_nonce: push.nonce.clone(),
        ..Default::default()
    });
    wait_for("the NACK cleared by an ACK", BOUND, || async {
        let status = sync_status(&mp, "eds").await;
        status["last_nack"].is_null().then_some(())
    })
    .await;
}

#[tokio::test]
async fn a_type_meshpilot_does_not_serve_is_answered_empty() {
    let dir = copy_tree(Path::new(EXAMPLE));
    let mp = meshpilot(dir.path()).await;

    let mut sotw = AdsClient::connect(mp.xds_addr).await.unwrap();
    sotw.request(DiscoveryRequest {
        node: Some(node(SIDECAR, &[])),
        type_url: ECDS.into(),
        ..Default::default()
    });
    let r: DiscoveryResponse = sotw.response(Duration::from_secs(1)).await;
    assert_eq!(r.type_url, ECDS);
    assert!(r.resources.is_empty());
    sotw.request(DiscoveryRequest {
        type_url: ECDS.into(),
        response_nonce: r.nonce,
        ..Default::default()
    });
    sotw.silence(QUIET).await;
    // The stream still serves what meshpilot knows.
    sotw.request(DiscoveryRequest {
        type_url: CDS.into(),
        ..Default::default()
    });
    assert_eq!(sotw.response(BOUND).await.type_url, CDS);

    let mut delta_ads = DeltaClient::connect(mp.xds_addr).await.unwrap();
    let mut first = delta(ECDS, &[], &[], "");
    first.node = Some(node(SIDECAR, &[]));
    delta_ads.request(first);
    let r = delta_ads.response(Duration::from_secs(1)).await;
    assert_eq!(r.type_url, ECDS);
    assert!(r.resources.is_empty() && r.removed_resources.is_empty());
}

#[tokio::test]
async fn a_stream_without_a_first_request_is_closed() {
    let dir = copy_tree(Path::new(EXAMPLE));
    let mp = meshpilot(dir.path()).await;
    let mut silent = AdsClient::connect(mp.xds_addr).await.unwrap();
    let status = silent.error(BOUND).await;
    assert_eq!(status.code(), tonic::Code::DeadlineExceeded, "{status:?}");
    assert_eq!(mp.xds.connection_count(), 0);
}

/// A real Envoy rejects listeners on a port someone else holds: meshpilot records the NACK (log,
/// /debug/syncz, metric) without resending, and the next change brings the listeners again, then
/// accepted.
#[tokio::test]
async fn envoy_nack_is_recorded_and_healed_by_the_next_change() {
    for mode in [AdsMode::Sotw, AdsMode::Delta] {
        let _ports = sidecar_ports().await;
        let dir = copy_tree(Path::new(EXAMPLE));
        let mp = meshpilot(dir.path()).await;
        let squatter = std::net::TcpListener::bind("0.0.0.0:15001").expect("bind 15001");
        let envoy = Envoy::start(&mp, SIDECAR, &[("CLUSTER_ID", "cluster1")], mode).await;
        let nack = wait_for("Envoy's LDS NACK in /debug/syncz", BOUND, || async {
            let status = connected_status(&mp, "lds").await?;
            status["last_nack"].as_str().map(str::to_string)
        })
        .await;
        assert!(nack.contains("15001"), "{nack}");
        assert!(envoy.rejected_updates().await > 0);
        let sent = lds_sent(&mp).await;
        tokio::time::sleep(QUIET).await;
        assert_eq!(lds_sent(&mp).await, sent, "a NACK is not answered");

        drop(squatter);
        // A new service: a full push brings the listeners again, and Envoy takes them.
        write_atomic(
            &dir.path().join("clusters/cluster1/new.yaml"),
            "apiVersion: v1\nkind: Service\nmetadata: {name: details, namespace: bookinfo}\nspec: {clusterIP: 10.96.9.9, ports: [{name: http, port: 9080}]}\n",
        );
        wait_for("LDS accepted after the change", BOUND, || async {
            let status = sync_status(&mp, "lds").await;
            let healed =
                status["last_nack"].is_null() && status["acked_version"] == status["sent_version"];
            healed.then_some(())
        })
        .await;
    }
}

async fn lds_sent(mp: &meshpilot::app::Running) -> String {
    sync_status(mp, "lds").await["sent_nonce"].to_string()
}
