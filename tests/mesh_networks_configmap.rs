//! MeshNetworks from the `meshNetworks` key of the revision's mesh ConfigMap, as istiod reads it
//! when no file is given (pilot/pkg/bootstrap/mesh.go `getConfigurationSources`): a primary and
//! a remote whose namespaces carry no network label, networks named by registry in the
//! ConfigMap alone. Checked on the decoded EDS of a proxy of the primary's network: the remote's
//! endpoints come through its gateway, follow edits (pushed on an open stream), survive a bad
//! value (reported on /debug/networkz) and go direct once the key is gone. A revision reads its
//! own ConfigMap, a mesh config file does not stop it, a MeshNetworks file wins, and a gateway
//! address may be a DNS name.

mod common;

use std::time::Duration;

use common::ads::{fetch, AdsClient};
use common::primary::{primary_with_prepared_remote, Primary};
use common::*;
use envoy_types::pb::envoy::config::endpoint::v3::{lb_endpoint, ClusterLoadAssignment};
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use serde_json::json;
use test_apiserver::TestApiServer;

const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
const HELLOWORLD: &str = "outbound|5000||helloworld.sample.svc.cluster.local";
const BOUND: Duration = Duration::from_secs(15);

/// helloworld in `sample` with one mesh pod at `ip`.
fn helloworld(ip: &str) -> String {
    format!(
        "
apiVersion: v1
kind: Namespace
metadata: {{name: sample}}
---
apiVersion: v1
kind: Service
metadata: {{name: helloworld, namespace: sample}}
spec: {{clusterIP: 10.96.0.30, ports: [{{name: http, port: 5000}}]}}
---
apiVersion: v1
kind: Pod
metadata: {{name: helloworld-1, namespace: sample, labels: {{app: helloworld, security.istio.io/tlsMode: istio}}}}
spec: {{serviceAccountName: helloworld, containers: [{{name: helloworld, image: helloworld}}]}}
status: {{podIP: {ip}}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: helloworld-1, namespace: sample, labels: {{kubernetes.io/service-name: helloworld}}}}
addressType: IPv4
ports: [{{name: http, port: 5000}}]
endpoints:
- addresses: [{ip}]
  conditions: {{ready: true}}
  targetRef: {{kind: Pod, name: helloworld-1, namespace: sample}}
"
    )
}

/// MeshNetworks with the primary on network1 and the remote `east` on network2 behind `gateway`.
fn networks(gateway: &str) -> String {
    format!(
        "networks:\n  network1:\n    endpoints: [{{fromRegistry: primary}}]\n    gateways: [{{address: 192.0.2.10, port: 15443}}]\n  network2:\n    endpoints: [{{fromRegistry: east}}]\n    gateways: [{{address: {gateway}, port: 15443}}]\n"
    )
}

/// The mesh ConfigMap `name` of istio-system with `data`.
fn mesh_configmap(api: &TestApiServer, name: &str, data: serde_json::Value) {
    api.apply(json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": "istio-system"}, "data": data}));
}

/// A primary and the remote `east`, each with one helloworld pod, meshpilot started with `flags`.
async fn mesh(flags: &[&str], prepare_config: impl FnOnce(&TestApiServer)) -> Primary {
    let primary = primary_with_prepared_remote(flags, |east| {
        east.apply_yaml(&helloworld("10.2.1.10"));
    })
    .await;
    primary.config.apply_yaml(&helloworld("10.1.1.10"));
    prepare_config(&primary.config);
    primary
}

fn sleep_node() -> envoy_types::pb::envoy::config::core::v3::Node {
    node(
        "sidecar~10.1.2.10~sleep-1.sample~sample.svc.cluster.local",
        &[("CLUSTER_ID", "primary"), ("NETWORK", "network1")],
    )
}

/// helloworld's endpoints as `address:port`, sorted.
fn endpoints(cla: &ClusterLoadAssignment) -> Vec<String> {
    use envoy_types::pb::envoy::config::core::v3::{address, socket_address};
    let mut out: Vec<String> = (cla.endpoints.iter().flat_map(|l| &l.lb_endpoints))
        .filter_map(|e| match &e.host_identifier {
            Some(lb_endpoint::HostIdentifier::Endpoint(ep)) => {
                match ep.address.as_ref()?.address.as_ref()? {
                    address::Address::SocketAddress(s) => match s.port_specifier {
                        Some(socket_address::PortSpecifier::PortValue(port)) => {
                            Some(format!("{}:{port}", s.address))
                        }
                        _ => None,
                    },
                    _ => None,
                }
            }
            _ => None,
        })
        .collect();
    out.sort();
    out
}

async fn helloworld_endpoints(mp: &meshpilot::app::Running) -> Vec<String> {
    let got: Vec<ClusterLoadAssignment> =
        fetch(mp.xds_addr, sleep_node(), EDS, &[HELLOWORLD]).await;
    got.first().map(endpoints).unwrap_or_default()
}

/// Waits until the proxy's helloworld endpoints are `want`.
async fn until_endpoints(mp: &meshpilot::app::Running, what: &str, want: &[&str]) {
    wait_for(what, BOUND, || async {
        (helloworld_endpoints(mp).await == want).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn networks_follow_the_mesh_configmap() {
    let p = mesh(&["--debounce-after", "0s"], |api| {
        mesh_configmap(
            api,
            "istio",
            json!({"mesh": "", "meshNetworks": networks("192.0.2.20")}),
        );
    })
    .await;
    let mp = &p.mp;
    until_endpoints(
        mp,
        "east behind its gateway",
        &["10.1.1.10:5000", "192.0.2.20:15443"],
    )
    .await;

    // An edit reaches an open stream.
    let mut ads = AdsClient::connect(mp.xds_addr).await.unwrap();
    ads.request(DiscoveryRequest {
        node: Some(sleep_node()),
        type_url: EDS.into(),
        resource_names: vec![HELLOWORLD.into()],
        ..Default::default()
    });
    let first = ads.response(BOUND).await;
    ads.ack(&first, vec![HELLOWORLD.into()]);
    mesh_configmap(
        &p.config,
        "istio",
        json!({"mesh": "", "meshNetworks": networks("192.0.2.21")}),
    );
    let deadline = tokio::time::Instant::now() + BOUND;
    loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no push of the move"
        );
        let response = ads.response(BOUND).await;
        ads.ack(&response, vec![HELLOWORLD.into()]);
        let Some(any) = response.resources.first() else {
            continue;
        };
        let cla: ClusterLoadAssignment = prost::Message::decode(&any.value[..]).unwrap();
        if endpoints(&cla) == ["10.1.1.10:5000", "192.0.2.21:15443"] {
            break;
        }
    }

    // A bad value is refused by ConfigMap and key; the last good networks stay.
    let bad = "networks: {network2: {endpoints: [{fromCidr: 10.0.0.0/99}]}}";
    mesh_configmap(&p.config, "istio", json!({"mesh": "", "meshNetworks": bad}));
    let error = wait_for("the refusal", BOUND, || async {
        let view = get_json(mp.http_addr, "/debug/networkz").await;
        view["last_error"].as_str().map(str::to_string)
    })
    .await;
    assert!(
        error.contains("ConfigMap istio-system/istio, key meshNetworks"),
        "{error}"
    );
    assert_eq!(
        helloworld_endpoints(mp).await,
        ["10.1.1.10:5000", "192.0.2.21:15443"]
    );
    // The mesh config beside it is still read (istiod reads the keys independently).
    mesh_configmap(
        &p.config,
        "istio",
        json!({"mesh": "connectTimeout: 7s", "meshNetworks": bad}),
    );
    wait_for("the mesh config beside it", BOUND, || async {
        let view = get_json(mp.http_addr, "/debug/mesh").await;
        (view["meshConfig"]["connectTimeout"] == "7s").then_some(())
    })
    .await;

    // A gateway address may be a DNS name: resolved.
    let named = networks("localhost");
    mesh_configmap(
        &p.config,
        "istio",
        json!({"mesh": "", "meshNetworks": named}),
    );
    wait_for("the named gateway resolved", BOUND, || async {
        let got = helloworld_endpoints(mp).await;
        got.contains(&"127.0.0.1:15443".to_string()).then_some(())
    })
    .await;
    assert!(get_json(mp.http_addr, "/debug/networkz").await["last_error"].is_null());

    // No key, no networks: east's pod is reached directly.
    mesh_configmap(&p.config, "istio", json!({"mesh": ""}));
    until_endpoints(mp, "east directly", &["10.1.1.10:5000", "10.2.1.10:5000"]).await;
}

/// A revision reads `istio-<revision>`, not `istio`, even with a mesh config file given.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revision_reads_its_own_configmap_beside_a_mesh_config_file() {
    let dir = tempfile::tempdir().unwrap();
    let mesh_file = dir.path().join("mesh.yaml");
    std::fs::write(&mesh_file, "connectTimeout: 5s\n").unwrap();
    let flags = [
        "--revision",
        "canary",
        "--mesh-config",
        mesh_file.to_str().unwrap(),
        "--debounce-after",
        "0s",
    ];
    let p = mesh(&flags, |api| {
        mesh_configmap(
            api,
            "istio",
            json!({"mesh": "", "meshNetworks": networks("192.0.2.10")}),
        );
        mesh_configmap(
            api,
            "istio-canary",
            json!({"mesh": "", "meshNetworks": networks("192.0.2.30")}),
        );
    })
    .await;
    until_endpoints(
        &p.mp,
        "canary's networks",
        &["10.1.1.10:5000", "192.0.2.30:15443"],
    )
    .await;
}

/// `--mesh-networks FILE` wins over the ConfigMap, whose edits are not read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mesh_networks_file_wins_over_the_configmap() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("networks.yaml");
    std::fs::write(&file, networks("192.0.2.40")).unwrap();
    let flags = [
        "--mesh-networks",
        file.to_str().unwrap(),
        "--debounce-after",
        "0s",
    ];
    let p = mesh(&flags, |api| {
        mesh_configmap(
            api,
            "istio",
            json!({"mesh": "", "meshNetworks": networks("192.0.2.20")}),
        );
    })
    .await;
    until_endpoints(
        &p.mp,
        "the file's gateway",
        &["10.1.1.10:5000", "192.0.2.40:15443"],
    )
    .await;
    mesh_configmap(
        &p.config,
        "istio",
        json!({"mesh": "", "meshNetworks": networks("192.0.2.22")}),
    );
    write_atomic(&file, &networks("192.0.2.41"));
    until_endpoints(
        &p.mp,
        "the file's edit",
        &["10.1.1.10:5000", "192.0.2.41:15443"],
    )
    .await;
}
