//! End to end: two networks of two clusters each (the bundled multi-network example) — split-horizon
//! EDS, gateway weights, locality priorities and mesh-networks reloads, seen by raw ADS streams.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use common::*;
use envoy_types::pb::envoy::config::core::v3::{Locality, Node};
use envoy_types::pb::envoy::config::endpoint::v3::{
    lb_endpoint::HostIdentifier, ClusterLoadAssignment,
};
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use prost::Message;

const EXAMPLE_MN: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/multicluster/examples/multi-network"
);
const REVIEWS: &str = "outbound|9080||reviews.bookinfo.svc.cluster.local";
const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
const BOUND: Duration = Duration::from_secs(15);

/// address → (weight, priority) of one assignment.
fn endpoints(cla: &ClusterLoadAssignment) -> BTreeMap<String, (u32, u32)> {
    let mut out = BTreeMap::new();
    for group in &cla.endpoints {
        for ep in &group.lb_endpoints {
            let Some(HostIdentifier::Endpoint(e)) = &ep.host_identifier else {
                continue;
            };
            let Some(envoy_types::pb::envoy::config::core::v3::address::Address::SocketAddress(sa)) =
                e.address.as_ref().and_then(|a| a.address.as_ref())
            else {
                continue;
            };
            let Some(
                envoy_types::pb::envoy::config::core::v3::socket_address::PortSpecifier::PortValue(
                    port,
                ),
            ) = sa.port_specifier
            else {
                continue;
            };
            let weight = ep.load_balancing_weight.as_ref().map_or(1, |w| w.value);
            let entry = out
                .entry(format!("{}:{port}", sa.address))
                .or_insert((0, group.priority));
            entry.0 += weight;
        }
    }
    out
}

/// A proxy on `network` in `zone` of `region`, subscribed to reviews' EDS.
async fn eds_stream(
    mp: &meshpilot::app::Running,
    network: &str,
    region: &str,
    zone: &str,
) -> (AdsClient, ClusterLoadAssignment) {
    let mut node = node(
        "sidecar~10.99.0.1~client.bookinfo~bookinfo.svc.cluster.local",
        &[("NETWORK", network)],
    );
    node.locality = Some(Locality {
        region: region.into(),
        zone: zone.into(),
        ..Default::default()
    });
    reviews_eds(mp, node).await
}

/// `node` subscribed to reviews' EDS: the stream, past its first response (acknowledged).
async fn reviews_eds(
    mp: &meshpilot::app::Running,
    node: Node,
) -> (AdsClient, ClusterLoadAssignment) {
    let mut ads = AdsClient::connect(mp.xds_addr).await.unwrap();
    ads.request(DiscoveryRequest {
        node: Some(node),
        type_url: EDS.into(),
        resource_names: vec![REVIEWS.into()],
        ..Default::default()
    });
    let response = ads.next(BOUND).await.unwrap().unwrap();
    ads.request(DiscoveryRequest {
        type_url: EDS.into(),
        resource_names: vec![REVIEWS.into()],
        version_info: response.version_info.clone(),
        response_nonce: response.nonce.clone(),
        ..Default::default()
    });
    let cla = ClusterLoadAssignment::decode(&response.resources[0].value[..]).unwrap();
    (ads, cla)
}

#[tokio::test]
async fn each_network_sees_its_own_endpoints_and_the_others_gateway() {
    let dir = copy_tree(Path::new(EXAMPLE_MN));
    let mp = start_meshpilot(dir.path(), &["--debounce-after", "0s"]).await;

    // Network 1, in us-east1-a: its own four endpoints, zone-local first; network 2 behind its gateway.
    let (_ads, cla) = eds_stream(&mp, "network1", "us-east1", "us-east1-a").await;
    let seen = endpoints(&cla);
    let expected: BTreeMap<String, (u32, u32)> = [
        ("10.10.1.11:9080", (1, 0)),
        ("10.10.1.12:9080", (1, 0)),
        ("10.10.2.11:9080", (1, 1)),
        ("10.10.2.12:9080", (1, 1)),
        // west1: 2 mTLS endpoints, west2: 1 (its plaintext one cannot cross networks); two locality
        // groups, both priority 2 (another region), weights 2 + 1 = 3 in all.
        ("198.51.100.1:15443", (3, 2)),
    ]
    .into_iter()
    .map(|(a, w)| (a.to_string(), w))
    .collect();
    assert_eq!(seen, expected, "{cla:#?}");
    assert!(
        !seen.contains_key("10.20.2.12:9080"),
        "a plaintext endpoint of another network leaked"
    );

    // The mirror image from network 2, in europe-west1-b: the plaintext endpoint is local there.
    let (_ads2, cla) = eds_stream(&mp, "network2", "europe-west1", "europe-west1-b").await;
    let seen = endpoints(&cla);
    let expected: BTreeMap<String, (u32, u32)> = [
        ("10.20.2.11:9080", (1, 0)),
        ("10.20.2.12:9080", (1, 0)),
        ("10.20.1.11:9080", (1, 1)),
        ("10.20.1.12:9080", (1, 1)),
        ("192.0.2.1:15443", (4, 2)),
    ]
    .into_iter()
    .map(|(a, w)| (a.to_string(), w))
    .collect();
    assert_eq!(seen, expected, "{cla:#?}");
}

#[tokio::test]
async fn a_moved_gateway_is_pushed() {
    let dir = copy_tree(Path::new(EXAMPLE_MN));
    let mp = start_meshpilot(dir.path(), &["--debounce-after", "0s"]).await;
    let (mut ads, cla) = eds_stream(&mp, "network1", "us-east1", "us-east1-a").await;
    assert!(endpoints(&cla).contains_key("198.51.100.1:15443"));

    let file = dir.path().join("clusters/west1/mesh.yaml");
    let moved = std::fs::read_to_string(&file)
        .unwrap()
        .replace("198.51.100.1", "198.51.100.7");
    write_atomic(&file, &moved);
    let push = ads.next(BOUND).await.expect("an EDS push").unwrap();
    let cla = ClusterLoadAssignment::decode(&push.resources[0].value[..]).unwrap();
    let seen = endpoints(&cla);
    assert!(
        seen.contains_key("198.51.100.7:15443") && !seen.contains_key("198.51.100.1:15443"),
        "{seen:?}"
    );
}

#[tokio::test]
async fn mesh_networks_file_names_networks_and_refuses_bad_edits() {
    let dir = copy_tree(Path::new(EXAMPLE_MN));
    // Drop the namespace labels: networks come from the MeshNetworks file alone.
    for cluster in ["east1", "east2", "west1", "west2"] {
        let file = dir.path().join(format!("clusters/{cluster}/mesh.yaml"));
        let text = std::fs::read_to_string(&file).unwrap();
        let unlabelled = text
            .replace(
                "labels: {topology.istio.io/network: network1}",
                "labels: {}",
            )
            .replace(
                "labels: {topology.istio.io/network: network2}",
                "labels: {}",
            );
        std::fs::write(&file, unlabelled).unwrap();
    }
    let networks = dir.path().join("networks.yaml");
    std::fs::write(
        &networks,
        "networks:\n  network1: {endpoints: [{fromRegistry: east1}, {fromRegistry: east2}]}\n  network2: {endpoints: [{fromCidr: 10.20.0.0/16}]}\n",
    )
    .unwrap();
    let mp = start_meshpilot(
        dir.path(),
        &[
            "--mesh-networks",
            networks.to_str().unwrap(),
            "--debounce-after",
            "0s",
        ],
    )
    .await;
    let admin = mp.http_addr;
    let network_of = |ip: &'static str| async move {
        let shards = get_json(admin, "/debug/endpointShardz").await;
        shards["reviews.bookinfo.svc.cluster.local"]["bookinfo"]
            .as_object()?
            .values()
            .flat_map(|eps| eps.as_array().cloned().unwrap_or_default())
            .find(|ep| ep["address"] == ip)
            .and_then(|ep| ep["network"].as_str().map(str::to_string))
    };
    assert_eq!(
        network_of("10.10.2.11").await.as_deref(),
        Some("network1"),
        "fromRegistry"
    );
    assert_eq!(
        network_of("10.20.1.11").await.as_deref(),
        Some("network2"),
        "fromCidr"
    );

    // A malformed edit is refused and reported; the last good networks stay.
    write_atomic(
        &networks,
        "networks:\n  network1: {endpoints: [{fromCidr: 10.0.0.0/99}]}\n",
    );
    let error = wait_for("error reported", BOUND, || async move {
        let view = get_json(admin, "/debug/networkz").await;
        view["last_error"].as_str().map(str::to_string)
    })
    .await;
    assert!(error.contains("networks.yaml"), "{error}");
    assert_eq!(network_of("10.20.1.11").await.as_deref(), Some("network2"));

    // A good edit re-derives the networks of existing endpoints.
    write_atomic(
        &networks,
        "networks:\n  network1: {endpoints: [{fromRegistry: east1}, {fromRegistry: east2}]}\n  network3: {endpoints: [{fromCidr: 10.20.0.0/16}]}\n",
    );
    wait_for("endpoints moved to network3", BOUND, || async move {
        (network_of("10.20.1.11").await.as_deref() == Some("network3")).then_some(())
    })
    .await;
    assert!(get_json(admin, "/debug/networkz").await["last_error"].is_null());
}

/// A DestinationRule subset holds only the labelled endpoints, on this network and behind the other
/// network's gateway (which then stands for the labelled remote endpoints alone).
#[tokio::test]
async fn subsets_hold_only_labelled_endpoints_across_networks() {
    let dir = copy_tree(Path::new(EXAMPLE_MN));
    // One pod of each network becomes version v2.
    for (cluster, pod) in [("east1", "reviews-east1-b"), ("west1", "reviews-west1-a")] {
        let file = dir.path().join(format!("clusters/{cluster}/mesh.yaml"));
        let text = std::fs::read_to_string(&file).unwrap();
        let labelled = text.replacen(
            &format!("name: {pod}\n  namespace: bookinfo\n  labels: {{app: reviews,"),
            &format!("name: {pod}\n  namespace: bookinfo\n  labels: {{version: v2, app: reviews,"),
            1,
        );
        assert_ne!(labelled, text, "{pod} not found in {cluster}");
        std::fs::write(&file, labelled).unwrap();
    }
    std::fs::create_dir_all(dir.path().join("config")).unwrap();
    std::fs::write(
        dir.path().join("config/reviews.yaml"),
        "apiVersion: networking.istio.io/v1\nkind: DestinationRule\nmetadata: {name: reviews, namespace: bookinfo}\nspec:\n  host: reviews.bookinfo.svc.cluster.local\n  trafficPolicy: {outlierDetection: {consecutive5xxErrors: 5}}\n  subsets: [{name: v2, labels: {version: v2}}]\n",
    )
    .unwrap();
    let mp = start_meshpilot(dir.path(), &["--debounce-after", "0s"]).await;
    let subset = "outbound|9080|v2|reviews.bookinfo.svc.cluster.local";
    for (network, region, zone, expected) in [
        (
            "network1",
            "us-east1",
            "us-east1-a",
            [("10.10.1.12:9080", (1, 0)), ("198.51.100.1:15443", (1, 1))],
        ),
        (
            "network2",
            "europe-west1",
            "europe-west1-a",
            [("10.20.1.11:9080", (1, 0)), ("192.0.2.1:15443", (1, 1))],
        ),
    ] {
        let mut ads = AdsClient::connect(mp.xds_addr).await.unwrap();
        let mut node = node(
            "sidecar~10.99.0.1~client.bookinfo~bookinfo.svc.cluster.local",
            &[("NETWORK", network)],
        );
        node.locality = Some(Locality {
            region: region.into(),
            zone: zone.into(),
            ..Default::default()
        });
        ads.request(DiscoveryRequest {
            node: Some(node),
            type_url: EDS.into(),
            resource_names: vec![subset.into()],
            ..Default::default()
        });
        let response = ads.response(BOUND).await;
        let cla = ClusterLoadAssignment::decode(&response.resources[0].value[..]).unwrap();
        let expected: BTreeMap<String, (u32, u32)> = expected
            .into_iter()
            .map(|(a, w)| (a.to_string(), w))
            .collect();
        assert_eq!(endpoints(&cla), expected, "from {network}: {cla:#?}");
    }
}

/// A rule's `localityLbSetting`: `distribute` sends all of us-east1's traffic to zone b (other
/// localities dropped, no priorities); `enabled: false` turns locality priorities off.
#[tokio::test]
async fn locality_settings_shape_the_assignment() {
    let dir = copy_tree(Path::new(EXAMPLE_MN));
    let config = dir.path().join("config");
    std::fs::create_dir_all(&config).unwrap();
    let rule = |setting: &str| {
        format!("apiVersion: networking.istio.io/v1\nkind: DestinationRule\nmetadata: {{name: reviews, namespace: bookinfo}}\nspec:\n  host: reviews.bookinfo.svc.cluster.local\n  trafficPolicy:\n    loadBalancer:\n      localityLbSetting: {setting}\n")
    };
    std::fs::write(
        config.join("reviews.yaml"),
        rule("{distribute: [{from: 'us-east1/*', to: {'us-east1/us-east1-b/*': 100}}]}"),
    )
    .unwrap();
    let mp = start_meshpilot(dir.path(), &["--debounce-after", "0s"]).await;
    let (mut ads, cla) = eds_stream(&mp, "network1", "us-east1", "us-east1-a").await;
    let groups: Vec<(String, u32, u32)> = cla
        .endpoints
        .iter()
        .map(|g| {
            let zone = g
                .locality
                .as_ref()
                .map(|l| l.zone.clone())
                .unwrap_or_default();
            (
                zone,
                g.load_balancing_weight.as_ref().map_or(0, |w| w.value),
                g.priority,
            )
        })
        .collect();
    assert_eq!(groups, [("us-east1-b".to_string(), 100, 0)], "{cla:#?}");

    write_atomic(&config.join("reviews.yaml"), &rule("{enabled: false}"));
    let push = ads.response(BOUND).await;
    let cla = ClusterLoadAssignment::decode(&push.resources[0].value[..]).unwrap();
    assert_eq!(cla.endpoints.len(), 4, "{cla:#?}");
    assert!(cla.endpoints.iter().all(|g| g.priority == 0), "{cla:#?}");
}

#[tokio::test]
async fn a_proxy_without_a_locality_takes_its_own_endpoints_once_they_come() {
    let dir = copy_tree(Path::new(EXAMPLE_MN));
    let mp = start_meshpilot(dir.path(), &["--debounce-after", "0s"]).await;
    // The node says no locality: the proxy's own pod tells it, once the pod is an endpoint.
    let node = node(
        "sidecar~10.10.1.50~client.bookinfo~bookinfo.svc.cluster.local",
        &[("NETWORK", "network1")],
    );
    let (mut ads, cla) = reviews_eds(&mp, node).await;
    assert!(cla.endpoints.iter().all(|g| g.priority == 0), "{cla:#?}");

    // The proxy's own service comes (a full push naming only it): in us-east1-a, like east1-node.
    let client = "apiVersion: v1\nkind: Service\nmetadata: {name: client, namespace: bookinfo}\nspec: {clusterIP: 10.96.1.50, ports: [{name: http, port: 8080}]}\n---\napiVersion: v1\nkind: Pod\nmetadata: {name: client-0, namespace: bookinfo, labels: {app: client}}\nspec: {nodeName: east1-node, containers: []}\nstatus: {podIP: 10.10.1.50}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: client-east1, namespace: bookinfo, labels: {kubernetes.io/service-name: client}}\naddressType: IPv4\nports: [{name: http, port: 8080}]\nendpoints: [{addresses: [10.10.1.50], conditions: {ready: true}, targetRef: {kind: Pod, name: client-0, namespace: bookinfo}}]\n";
    write_atomic(&dir.path().join("clusters/east1/client.yaml"), client);
    let push = ads.response(BOUND).await;
    let cla = ClusterLoadAssignment::decode(&push.resources[0].value[..]).unwrap();
    let seen = endpoints(&cla);
    assert_eq!(seen["10.10.1.11:9080"].1, 0, "same zone first: {cla:#?}");
    assert_eq!(seen["10.10.2.11:9080"].1, 1, "then the region: {cla:#?}");
    assert_eq!(seen["198.51.100.1:15443"].1, 2, "then the rest: {cla:#?}");
}
