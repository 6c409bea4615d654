//! Cluster-local services as istiod keeps them (pilot/pkg/model/cluster_local.go): by default
//! `*.kube-system`, `kubernetes.default` and the control plane's own host reach only their own
//! cluster's proxies; mesh config `serviceSettings` adds hosts and takes defaults back, pushed as
//! the mesh config changes. Checked on the decoded EDS of proxies in two clusters, and with real
//! traffic: a sidecar calling the Kubernetes API's VIP reaches only its own cluster's API server.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use common::ads::{fetch, AdsClient};
use common::pair::Workloads;
use common::*;
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;

const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
const BOUND: Duration = Duration::from_secs(10);

const KUBE_DNS: &str = "outbound|53||kube-dns.kube-system.svc.cluster.local";
const KUBERNETES: &str = "outbound|443||kubernetes.default.svc.cluster.local";
const ISTIOD: &str = "outbound|15012||istiod.istio-system.svc.cluster.local";
const HELLOWORLD: &str = "outbound|5000||helloworld.sample.svc.cluster.local";

/// A Service and its one endpoint, as a cluster's files hold them.
fn service(ns: &str, name: &str, vip: &str, port: (&str, u16), endpoint: (&str, u16)) -> String {
    let (port_name, number) = port;
    let (ip, target) = endpoint;
    format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: {ns}}}\nspec: {{clusterIP: {vip}, ports: [{{name: {port_name}, port: {number}, targetPort: {target}}}]}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}-1, namespace: {ns}, labels: {{kubernetes.io/service-name: {name}}}}}\naddressType: IPv4\nports: [{{name: {port_name}, port: {target}}}]\nendpoints: [{{addresses: [{ip}], conditions: {{ready: true}}}}]\n"
    )
}

/// Cluster `id`'s API server, DNS, control plane and an application, at its own addresses.
fn cluster(id: u8) -> String {
    let vip = |last: u8| format!("10.9{}.0.{last}", id + 5);
    [
        service(
            "kube-system",
            "kube-dns",
            &vip(10),
            ("dns-tcp", 53),
            (&format!("10.1{id}.0.53"), 53),
        ),
        service(
            "default",
            "kubernetes",
            &vip(1),
            ("https", 443),
            (&format!("172.18.0.{id}"), 6443),
        ),
        service(
            "istio-system",
            "istiod",
            &vip(20),
            ("https-dns", 15012),
            (&format!("10.2{id}.99.10"), 15012),
        ),
        service(
            "sample",
            "helloworld",
            &vip(30),
            ("http", 5000),
            (&format!("10.1{id}.1.10"), 5000),
        ),
    ]
    .concat()
}

/// Each assignment's endpoint addresses, for a proxy of cluster `id`.
async fn assignments(mp: &meshpilot::app::Running, id: &str) -> BTreeMap<String, Vec<String>> {
    let node = node(
        &format!("sidecar~10.{id}.2.10~sleep-1.sample~sample.svc.cluster.local"),
        &[("CLUSTER_ID", id)],
    );
    let names = [KUBE_DNS, KUBERNETES, ISTIOD, HELLOWORLD];
    let got: Vec<ClusterLoadAssignment> = fetch(mp.xds_addr, node, EDS, &names).await;
    got.iter()
        .map(|a| (a.cluster_name.clone(), addresses(a)))
        .collect()
}

fn addresses(cla: &ClusterLoadAssignment) -> Vec<String> {
    let mut out: Vec<String> = cla
        .endpoints
        .iter()
        .flat_map(|l| &l.lb_endpoints)
        .filter_map(|e| match &e.host_identifier {
            Some(
                envoy_types::pb::envoy::config::endpoint::v3::lb_endpoint::HostIdentifier::Endpoint(
                    ep,
                ),
            ) => {
                let socket = match ep.address.as_ref()?.address.as_ref()? {
                    envoy_types::pb::envoy::config::core::v3::address::Address::SocketAddress(
                        s,
                    ) => s,
                    _ => return None,
                };
                Some(socket.address.clone())
            }
            _ => None,
        })
        .collect();
    out.sort();
    out
}

const MESH: &str = "defaultConfig: {discoveryAddress: istiod.istio-system.svc:15012}\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_local_hosts_stay_in_their_cluster() {
    let dir = tempfile::tempdir().unwrap();
    for id in [1u8, 2] {
        let path = dir.path().join(format!("clusters/{id}"));
        std::fs::create_dir_all(&path).unwrap();
        std::fs::write(path.join("mesh.yaml"), cluster(id)).unwrap();
    }
    let mesh = dir.path().join("mesh.yaml");
    std::fs::write(&mesh, MESH).unwrap();
    let flags = [
        "--mesh-config",
        mesh.to_str().unwrap(),
        "--debounce-after",
        "0s",
    ];
    let mp = start_meshpilot(Path::new(dir.path()), &flags).await;

    // istiod's defaults: the API server, DNS and the control plane are each cluster's own; an
    // application is everyone's.
    let both = vec!["10.11.1.10".to_string(), "10.12.1.10".to_string()];
    let one = wait_for("cluster 1's view", BOUND, || async {
        let got = assignments(&mp, "1").await;
        (got.len() == 4).then_some(got)
    })
    .await;
    assert_eq!(one[KUBE_DNS], ["10.11.0.53"]);
    assert_eq!(one[KUBERNETES], ["172.18.0.1"]);
    assert_eq!(one[ISTIOD], ["10.21.99.10"]);
    assert_eq!(one[HELLOWORLD], both);
    let two = assignments(&mp, "2").await;
    assert_eq!(two[KUBE_DNS], ["10.12.0.53"]);
    assert_eq!(two[KUBERNETES], ["172.18.0.2"]);
    assert_eq!(two[ISTIOD], ["10.22.99.10"]);

    // serviceSettings make the sample namespace cluster-local: pushed to a connected proxy.
    let mut ads = AdsClient::connect(mp.xds_addr).await.unwrap();
    ads.request(DiscoveryRequest {
        node: Some(node(
            "sidecar~10.1.2.10~sleep-1.sample~sample.svc.cluster.local",
            &[("CLUSTER_ID", "1")],
        )),
        type_url: EDS.into(),
        resource_names: vec![HELLOWORLD.into()],
        ..Default::default()
    });
    let first = ads.response(BOUND).await;
    ads.ack(&first, vec![HELLOWORLD.into()]);
    write_atomic(
        &mesh,
        &format!("{MESH}serviceSettings:\n- settings: {{clusterLocal: true}}\n  hosts: ['*.sample.svc.cluster.local']\n"),
    );
    let deadline = tokio::time::Instant::now() + BOUND;
    let pushed = loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no push of the mesh config"
        );
        let response = ads.response(BOUND).await;
        ads.ack(&response, vec![HELLOWORLD.into()]);
        let Some(any) = response.resources.first() else {
            continue;
        };
        let cla: ClusterLoadAssignment = prost::Message::decode(&any.value[..]).unwrap();
        let got = addresses(&cla);
        if got.len() == 1 {
            break got;
        }
    };
    assert_eq!(pushed, ["10.11.1.10"]);

    // Taking one host and a default back; the most specific entry decides.
    write_atomic(
        &mesh,
        &format!("{MESH}serviceSettings:\n- settings: {{clusterLocal: true}}\n  hosts: ['*.sample.svc.cluster.local']\n- settings: {{clusterLocal: false}}\n  hosts: [helloworld.sample.svc.cluster.local, kubernetes.default.svc.cluster.local]\n"),
    );
    let one = wait_for("the amended view", BOUND, || async {
        let got = assignments(&mp, "1").await;
        (got[HELLOWORLD] == both).then_some(got)
    })
    .await;
    assert_eq!(one[KUBERNETES], ["172.18.0.1", "172.18.0.2"]);
    assert_eq!(one[KUBE_DNS], ["10.11.0.53"]);

    // A host that is no host name is refused by name; the last good settings stay.
    write_atomic(
        &mesh,
        &format!("{MESH}serviceSettings:\n- hosts: ['bad_host!']\n"),
    );
    let error = wait_for("the refusal", BOUND, || async {
        let view = get_json(mp.http_addr, "/debug/mesh").await;
        view["last_error"].as_str().map(str::to_string)
    })
    .await;
    assert!(error.contains("serviceSettings[0].hosts[0]"), "{error}");
    assert_eq!(assignments(&mp, "1").await[HELLOWORLD], both);
}

/// Real traffic: a client sidecar in cluster c1 calls the Kubernetes API's VIP many times; the
/// service is also in c2, at another backend; every connection reaches c1's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidecar_reaches_only_its_own_cluster_s_api_server() {
    let net = 249;
    let (c1_backend, c2_backend) = (format!("10.{net}.3.2"), format!("10.{net}.3.3"));
    let kubernetes = |backend: &str, vip: &str| {
        service(
            "default",
            "kubernetes",
            vip,
            ("https", 443),
            (backend, 7443),
        )
    };
    let mut pair = Workloads::start_bare("cl", net, &[], "").await;
    pair.server_ns.run(
        "ip",
        &["addr", "add", &format!("{c2_backend}/24"), "dev", "data"],
    );
    pair.server_ns.serve_http_echo(7443);
    let c1 = pair.config_dir().join("clusters/c1");
    write_atomic(
        &c1.join("kubernetes.yaml"),
        &kubernetes(&c1_backend, "10.96.0.1"),
    );
    let c2 = pair.config_dir().join("clusters/c2");
    std::fs::create_dir_all(&c2).unwrap();
    write_atomic(
        &c2.join("kubernetes.yaml"),
        &kubernetes(&c2_backend, "10.97.0.1"),
    );
    let client = pair
        .client_sidecar(workload_certs(&pair.mp, "default", "client"))
        .await;
    let _server = pair
        .server_sidecar(workload_certs(&pair.mp, "default", "server"))
        .await;
    wait_for("the client knows c1's API server", BOUND, || {
        let client = &client;
        let c1 = format!("{c1_backend}:7443");
        async move { (client.endpoints(KUBERNETES).await == [c1]).then_some(()) }
    })
    .await;

    let mut reached = BTreeMap::new();
    for i in 0..50 {
        let output = pair.as_client_app(
            "curl",
            &["-s", "-m", "3", &format!("http://10.96.0.1:443/call-{i}")],
        );
        let body: serde_json::Value = serde_json::from_slice(&output.stdout)
            .unwrap_or_else(|e| panic!("call {i}: {e}: {output:?}"));
        *reached
            .entry(body["server"].as_str().unwrap_or_default().to_string())
            .or_insert(0) += 1;
    }
    assert_eq!(reached, BTreeMap::from([(c1_backend, 50)]));
}
