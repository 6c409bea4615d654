//! End to end: a Kubernetes cluster (the test API server, real HTTPS list/watch) as meshpilot's
//! config cluster, through kube-rs, into the endpoint index and a real Envoy.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::*;
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use test_apiserver::TestApiServer;

const WEB: &str = "web.shop.svc.cluster.local";
const WEB_CLUSTER: &str = "outbound|80||web.shop.svc.cluster.local";
const BOUND: Duration = Duration::from_secs(15);

const BASE: &str = "
apiVersion: v1
kind: Namespace
metadata: {name: istio-system}
---
apiVersion: v1
kind: Namespace
metadata: {name: shop}
---
apiVersion: v1
kind: Node
metadata: {name: node-1, labels: {topology.kubernetes.io/region: eu, topology.kubernetes.io/zone: eu-a}}
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec: {clusterIP: 10.96.0.80, ports: [{name: http, port: 80, targetPort: 8080}]}
";

fn pod(name: &str, ip: &str) -> String {
    format!(
        "
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: shop, labels: {{app: web, security.istio.io/tlsMode: istio}}}}
spec: {{serviceAccountName: web, nodeName: node-1, containers: [{{name: web, image: web}}]}}
status: {{podIP: {ip}}}
"
    )
}

/// An EndpointSlice for `web` with (pod, ip, ready) entries.
fn slice(name: &str, endpoints: &[(&str, &str, bool)]) -> String {
    let eps: String = endpoints
        .iter()
        .map(|(pod, ip, ready)| {
            format!(
                "- addresses: [{ip}]\n  conditions: {{ready: {ready}}}\n  targetRef: {{kind: Pod, name: {pod}, namespace: shop}}\n"
            )
        })
        .collect();
    format!(
        "
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: {name}, namespace: shop, labels: {{kubernetes.io/service-name: web}}}}
addressType: IPv4
ports: [{{name: http, port: 8080}}]
endpoints:
{eps}"
    )
}

struct Cluster {
    api: TestApiServer,
    _kubeconfig: tempfile::NamedTempFile,
    mp: meshpilot::app::Running,
}

async fn start_cluster(manifests: &[&str], extra: &[&str]) -> Cluster {
    let api = TestApiServer::start().await;
    for m in manifests {
        api.apply_yaml(m);
    }
    let kubeconfig = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(kubeconfig.path(), api.kubeconfig(api.admin_token())).unwrap();
    let mut flags = vec![
        "--kubeconfig",
        kubeconfig.path().to_str().unwrap(),
        "--cluster-id",
        "primary",
    ];
    flags.extend_from_slice(extra);
    let mp = start_meshpilot_with(&flags).await;
    Cluster {
        api,
        _kubeconfig: kubeconfig,
        mp,
    }
}

async fn addresses(admin: SocketAddr) -> Vec<String> {
    shard_addresses(admin, WEB, "primary").await
}

#[tokio::test]
async fn cluster_is_served_to_envoy_and_not_ready_pods_leave_eds() {
    let _ports = sidecar_ports().await;
    let both = slice(
        "web-1",
        &[("web-a", "10.10.0.1", true), ("web-b", "10.10.0.2", true)],
    );
    let c = start_cluster(
        &[
            BASE,
            &pod("web-a", "10.10.0.1"),
            &pod("web-b", "10.10.0.2"),
            &both,
        ],
        &[],
    )
    .await;
    let admin = c.mp.http_addr;
    assert_eq!(addresses(admin).await, ["10.10.0.1", "10.10.0.2"]);
    let view = cluster_view(admin, "primary").await.unwrap();
    assert_eq!(view["state"], "synced");
    assert_eq!(view["provider"], "Kubernetes");
    let shards = get_json(admin, "/debug/endpointShardz").await;
    let ep = &shards[WEB]["shop"]["primary"][0];
    assert_eq!(
        ep["service_account"],
        "spiffe://cluster.local/ns/shop/sa/web"
    );
    assert_eq!(ep["locality"]["zone"], "eu-a");

    let envoy = Envoy::start(
        &c.mp,
        "sidecar~10.10.9.9~client.shop~shop.svc.cluster.local",
        &[("CLUSTER_ID", "primary")],
        AdsMode::Sotw,
    )
    .await;
    let expected = ["10.10.0.1:8080", "10.10.0.2:8080"];
    wait_for("endpoints in Envoy", BOUND, || {
        let envoy = &envoy;
        async move { (envoy.endpoints(WEB_CLUSTER).await == expected).then_some(()) }
    })
    .await;

    let started = Instant::now();
    c.api.apply_yaml(&slice(
        "web-1",
        &[("web-a", "10.10.0.1", true), ("web-b", "10.10.0.2", false)],
    ));
    wait_for("not-ready endpoint gone from Envoy", BOUND, || {
        let envoy = &envoy;
        async move { (envoy.endpoints(WEB_CLUSTER).await == ["10.10.0.1:8080"]).then_some(()) }
    })
    .await;
    eprintln!(
        "not-ready pod left Envoy's EDS after {:?}",
        started.elapsed()
    );
    assert_eq!(envoy.rejected_updates().await, 0);
}

#[tokio::test]
async fn endpoint_waits_for_a_pod_that_arrives_after_its_slice() {
    let c = start_cluster(
        &[BASE, &slice("web-1", &[("web-late", "10.10.0.7", true)])],
        &[],
    )
    .await;
    let admin = c.mp.http_addr;
    assert!(addresses(admin).await.is_empty(), "no pod yet, no endpoint");
    c.api.apply_yaml(&pod("web-late", "10.10.0.7"));
    wait_for("endpoint once its pod arrived", BOUND, || async move {
        (addresses(admin).await == ["10.10.0.7"]).then_some(())
    })
    .await;
}

/// Polls the served endpoints until stopped, counting the moments they were empty.
fn gap_watch(admin: SocketAddr) -> Poller {
    Poller::start(move || async move { !addresses(admin).await.is_empty() })
}

#[tokio::test]
async fn api_server_restart_recovers_without_a_gap() {
    let c = start_cluster(
        &[
            BASE,
            &pod("web-a", "10.10.0.1"),
            &slice("web-1", &[("web-a", "10.10.0.1", true)]),
        ],
        &[],
    )
    .await;
    let admin = c.mp.http_addr;
    let watches_before = c.api.request_count("watch:endpointslices");
    let gaps = gap_watch(admin);

    c.api.stop();
    c.api.restart().await;
    c.api.apply_yaml(&pod("web-b", "10.10.0.2"));
    c.api.apply_yaml(&slice(
        "web-1",
        &[("web-a", "10.10.0.1", true), ("web-b", "10.10.0.2", true)],
    ));
    wait_for("change after restart served", BOUND, || async move {
        (addresses(admin).await == ["10.10.0.1", "10.10.0.2"]).then_some(())
    })
    .await;
    assert_eq!(
        gaps.stop(10).await,
        0,
        "endpoints were served empty during the restart"
    );
    assert!(
        c.api.request_count("watch:endpointslices") > watches_before,
        "the watch was re-established"
    );
}

#[tokio::test]
async fn gone_resource_version_relists_and_reconciles() {
    let c = start_cluster(
        &[
            BASE,
            &pod("web-a", "10.10.0.1"),
            &pod("web-b", "10.10.0.2"),
            &slice("web-1", &[("web-a", "10.10.0.1", true)]),
        ],
        &["--debounce-after", "0s"],
    )
    .await;
    let admin = c.mp.http_addr;

    // A proxy watching EDS: a relist that changes nothing must push nothing.
    let mut ads = AdsClient::connect(c.mp.xds_addr).await.unwrap();
    ads.request(DiscoveryRequest {
        node: Some(node(
            "sidecar~10.10.9.9~client.shop~shop.svc.cluster.local",
            &[],
        )),
        type_url: "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment".into(),
        resource_names: vec![WEB_CLUSTER.into()],
        ..Default::default()
    });
    let first = ads.next(BOUND).await.unwrap().unwrap();
    ads.request(DiscoveryRequest {
        type_url: first.type_url.clone(),
        resource_names: vec![WEB_CLUSTER.into()],
        version_info: first.version_info.clone(),
        response_nonce: first.nonce.clone(),
        ..Default::default()
    });

    let lists_before = c.api.request_count("list:endpointslices");
    c.api.stop();
    // Something unrelated moves the resource version past what meshpilot has seen; then the history
    // that would let it resume is gone.
    c.api.apply_yaml(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: unrelated, namespace: shop}\n",
    );
    c.api.compact();
    c.api.restart().await;
    let api = &c.api;
    wait_for("relist after 410 Gone", BOUND, || async move {
        (api.request_count("list:endpointslices") > lists_before).then_some(())
    })
    .await;
    // An unchanged relist pushes nothing.
    ads.silence(Duration::from_millis(500)).await;

    // A change made while the watch history is gone arrives through the next relist.
    let gaps = gap_watch(admin);
    c.api.stop();
    c.api.apply_yaml(&slice(
        "web-1",
        &[("web-a", "10.10.0.1", true), ("web-b", "10.10.0.2", true)],
    ));
    c.api.compact();
    c.api.restart().await;
    wait_for("change reconciled by relist", BOUND, || async move {
        (addresses(admin).await == ["10.10.0.1", "10.10.0.2"]).then_some(())
    })
    .await;
    assert_eq!(
        gaps.stop(10).await,
        0,
        "endpoints were served empty during the relist"
    );
    let push = ads.next(BOUND).await.expect("EDS push").unwrap();
    assert_eq!(push.resources.len(), 1);
}

/// Lists come in pages of 500 objects, as client-go's: a page is parsed whole before its objects
/// are trimmed, so its size bounds the memory of every relist.
#[tokio::test]
async fn lists_are_paged_as_client_go_pages_them() {
    let pods: Vec<String> = (0..1_200)
        .map(|i| {
            pod(
                &format!("web-{i}"),
                &format!("10.11.{}.{}", i / 250, i % 250),
            )
        })
        .collect();
    let mut manifests = vec![BASE];
    manifests.extend(pods.iter().map(String::as_str));
    let c = start_cluster(&manifests, &[]).await;
    assert_eq!(
        c.api.request_count("list:pods"),
        3,
        "1,200 pods in pages of 500"
    );
}

/// The mesh config's `localityLbSetting` changed in the same debounce window as another
/// service's endpoints: every assignment is recomputed, not only that service's.
#[tokio::test]
async fn a_mesh_locality_setting_changed_amid_endpoint_churn_reaches_every_assignment() {
    use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
    use prost::Message;
    let zones = "
apiVersion: v1
kind: Node
metadata: {name: node-2, labels: {topology.kubernetes.io/region: eu, topology.kubernetes.io/zone: eu-b}}
---
apiVersion: v1
kind: Service
metadata: {name: api, namespace: shop}
spec: {clusterIP: 10.96.0.90, ports: [{name: http, port: 80, targetPort: 8080}]}
";
    let web_b = pod("web-b", "10.10.0.2").replace("node-1", "node-2");
    let api_slice = |ip: &str| {
        format!(
            "
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: api-1, namespace: shop, labels: {{kubernetes.io/service-name: api}}}}
addressType: IPv4
ports: [{{name: http, port: 8080}}]
endpoints: [{{addresses: [{ip}], conditions: {{ready: true}}}}]
"
        )
    };
    let mesh = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(mesh.path(), "{}\n").unwrap();
    let c = start_cluster(
        &[
            BASE,
            zones,
            &pod("web-a", "10.10.0.1"),
            &web_b,
            &slice(
                "web-1",
                &[("web-a", "10.10.0.1", true), ("web-b", "10.10.0.2", true)],
            ),
            &api_slice("10.10.0.9"),
        ],
        &[
            "--mesh-config",
            mesh.path().to_str().unwrap(),
            "--debounce-after",
            "1s",
        ],
    )
    .await;
    let mut node = node(
        "sidecar~10.10.9.9~client.shop~shop.svc.cluster.local",
        &[("CLUSTER_ID", "primary")],
    );
    node.locality = Some(envoy_types::pb::envoy::config::core::v3::Locality {
        region: "eu".into(),
        zone: "eu-a".into(),
        ..Default::default()
    });
    let mut ads = AdsClient::connect(c.mp.xds_addr).await.unwrap();
    ads.request(DiscoveryRequest {
        node: Some(node),
        type_url: "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment".into(),
        resource_names: vec![WEB_CLUSTER.into()],
        ..Default::default()
    });
    let first = ads.response(BOUND).await;
    ads.ack(&first, vec![WEB_CLUSTER.into()]);
    let zones_of =
        |response: &envoy_types::pb::envoy::service::discovery::v3::DiscoveryResponse| {
            let cla = ClusterLoadAssignment::decode(&response.resources[0].value[..]).unwrap();
            let mut zones: Vec<(String, u32)> = cla
                .endpoints
                .iter()
                .map(|g| {
                    let zone = g.locality.as_ref().map(|l| l.zone.clone());
                    let weight = g.load_balancing_weight.as_ref().map_or(0, |w| w.value);
                    (zone.unwrap_or_default(), weight)
                })
                .collect();
            zones.sort();
            zones
        };
    assert_eq!(zones_of(&first).len(), 2, "{first:?}");
    // The start's own changes are pushed first (alone in their window).
    let admin = c.mp.http_addr;
    wait_for("the start's push", BOUND, || async move {
        let log = get_json(admin, "/debug/pushz").await;
        (!log.as_array()?.is_empty()).then_some(())
    })
    .await;

    // In one debounce window: a mesh-wide setting, and another service's endpoint.
    std::fs::write(
        mesh.path(),
        "localityLbSetting: {distribute: [{from: 'eu/*', to: {'eu/eu-b/*': 100}}]}\n",
    )
    .unwrap();
    c.api.apply_yaml(&api_slice("10.10.0.10"));
    // The start's push may still be on its way; then comes the setting's.
    let distributed = [("eu-b".to_string(), 100)];
    loop {
        let pushed = ads.response(BOUND).await;
        ads.ack(&pushed, vec![WEB_CLUSTER.into()]);
        if zones_of(&pushed) == distributed {
            break;
        }
    }
}
