//! Istio's topology labels on endpoints and proxies (istiod's `AugmentLabels`): Istio's
//! multicluster traffic-management docs keep traffic in its cluster with a DestinationRule subset
//! per `topology.istio.io/cluster` and VirtualService `sourceLabels` on it; `failoverPriority`
//! ranks by it; a Sidecar's workload selector sees it. Checked on decoded RDS, EDS and CDS, and
//! with real traffic from clients of two clusters.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use common::ads::fetch;
use common::pair::Workloads;
use common::*;
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::core::v3::address::Address;
use envoy_types::pb::envoy::config::endpoint::v3::{lb_endpoint, ClusterLoadAssignment};
use envoy_types::pb::envoy::config::route::v3::{route::Action, route_action, RouteConfiguration};

const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
const RDS: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
const BOUND: Duration = Duration::from_secs(10);
const HOST: &str = "helloworld.sample.svc.cluster.local";

/// helloworld in one cluster: its Service (`vip`) and a slice of `ips` on `port`.
fn helloworld(vip: &str, port: u16, ips: &[&str]) -> String {
    let endpoints: String = ips
        .iter()
        .map(|ip| format!("- {{addresses: [{ip}], conditions: {{ready: true}}}}\n"))
        .collect();
    format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{name: helloworld, namespace: sample}}\nspec: {{clusterIP: {vip}, ports: [{{name: http, port: 5000, targetPort: {port}}}]}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: helloworld-1, namespace: sample, labels: {{kubernetes.io/service-name: helloworld}}}}\naddressType: IPv4\nports: [{{name: http, port: {port}}}]\nendpoints:\n{endpoints}"
    )
}

/// The docs' per-cluster routing: a subset per cluster, each cluster's clients to their own.
const PER_CLUSTER: &str = "
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {name: helloworld, namespace: sample}
spec:
  host: helloworld.sample.svc.cluster.local
  subsets:
  - {name: c1, labels: {topology.istio.io/cluster: c1}}
  - {name: c2, labels: {topology.istio.io/cluster: c2}}
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: helloworld, namespace: sample}
spec:
  hosts: [helloworld.sample.svc.cluster.local]
  http:
  - match: [{sourceLabels: {topology.istio.io/cluster: c1}}]
    route: [{destination: {host: helloworld.sample.svc.cluster.local, subset: c1}}]
  - match: [{sourceLabels: {topology.istio.io/cluster: c2}}]
    route: [{destination: {host: helloworld.sample.svc.cluster.local, subset: c2}}]
";

/// Failover by cluster.
const FAILOVER: &str = "
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {name: other, namespace: sample}
spec:
  host: other.sample.svc.cluster.local
  trafficPolicy:
    outlierDetection: {consecutive5xxErrors: 1}
    loadBalancer:
      localityLbSetting: {enabled: true, failoverPriority: [topology.istio.io/cluster]}
";

/// A Sidecar for c2's workloads only.
const C2_SIDECAR: &str = "
apiVersion: networking.istio.io/v1
kind: Sidecar
metadata: {name: c2-only, namespace: sample}
spec:
  workloadSelector: {labels: {topology.istio.io/cluster: c2}}
  egress: [{hosts: [./other.sample.svc.cluster.local]}]
";

fn node_in(cluster: &str) -> envoy_types::pb::envoy::config::core::v3::Node {
    node(
        "sidecar~10.9.9.9~sleep-1.sample~sample.svc.cluster.local",
        &[("CLUSTER_ID", cluster)],
    )
}

fn ip_of(e: &envoy_types::pb::envoy::config::endpoint::v3::LbEndpoint) -> String {
    let Some(lb_endpoint::HostIdentifier::Endpoint(ep)) = &e.host_identifier else {
        return String::new();
    };
    match ep.address.as_ref().and_then(|a| a.address.as_ref()) {
        Some(Address::SocketAddress(s)) => s.address.clone(),
        _ => String::new(),
    }
}

/// Each endpoint's address and priority.
fn by_priority(cla: &ClusterLoadAssignment) -> BTreeMap<String, u32> {
    cla.endpoints
        .iter()
        .flat_map(|l| l.lb_endpoints.iter().map(move |e| (ip_of(e), l.priority)))
        .collect()
}

/// The cluster the route of helloworld's virtual host sends this proxy to.
fn routed(configs: &[RouteConfiguration]) -> Option<String> {
    let vhost = configs
        .iter()
        .flat_map(|c| &c.virtual_hosts)
        .find(|v| v.domains.iter().any(|d| d == HOST))?;
    let action = vhost.routes.first()?.action.as_ref()?;
    let Action::Route(route) = action else {
        return None;
    };
    match route.cluster_specifier.as_ref()? {
        route_action::ClusterSpecifier::Cluster(c) => Some(c.clone()),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subsets_source_labels_failover_and_selectors_see_the_cluster() {
    let dir = tempfile::tempdir().unwrap();
    for (id, vip, ips) in [
        ("c1", "10.96.0.50", ["10.11.1.10", "10.11.1.11"]),
        ("c2", "10.97.0.50", ["10.12.1.10", "10.12.1.11"]),
    ] {
        let path = dir.path().join("clusters").join(id);
        std::fs::create_dir_all(&path).unwrap();
        std::fs::write(path.join("helloworld.yaml"), helloworld(vip, 5000, &ips)).unwrap();
        let other = helloworld(vip, 5000, &ips[..1]).replace("helloworld", "other");
        let other = other.replace(
            vip,
            if id == "c1" {
                "10.96.0.51"
            } else {
                "10.97.0.51"
            },
        );
        std::fs::write(path.join("other.yaml"), other).unwrap();
    }
    let config = dir.path().join("config");
    std::fs::create_dir_all(&config).unwrap();
    std::fs::write(
        config.join("routing.yaml"),
        format!("{PER_CLUSTER}---{FAILOVER}"),
    )
    .unwrap();
    let mp = start_meshpilot(Path::new(dir.path()), &[]).await;

    // sourceLabels: each cluster's clients are routed to their cluster's subset.
    for id in ["c1", "c2"] {
        let got = wait_for("the routes", BOUND, || async {
            let configs: Vec<RouteConfiguration> =
                fetch(mp.xds_addr, node_in(id), RDS, &["5000"]).await;
            routed(&configs)
        })
        .await;
        assert_eq!(got, format!("outbound|5000|{id}|{HOST}"));
    }

    // Subsets: a cluster's subset holds its endpoints.
    let subsets = [
        format!("outbound|5000|c1|{HOST}"),
        format!("outbound|5000|c2|{HOST}"),
    ];
    let names: Vec<&str> = subsets.iter().map(String::as_str).collect();
    let got: Vec<ClusterLoadAssignment> = fetch(mp.xds_addr, node_in("c1"), EDS, &names).await;
    let got: BTreeMap<&str, Vec<String>> = got
        .iter()
        .map(|c| {
            (
                c.cluster_name.as_str(),
                by_priority(c).into_keys().collect(),
            )
        })
        .collect();
    assert_eq!(got[names[0]], ["10.11.1.10", "10.11.1.11"]);
    assert_eq!(got[names[1]], ["10.12.1.10", "10.12.1.11"]);

    // failoverPriority: the proxy's own cluster first.
    let other = "outbound|5000||other.sample.svc.cluster.local";
    let got: Vec<ClusterLoadAssignment> = fetch(mp.xds_addr, node_in("c1"), EDS, &[other]).await;
    assert_eq!(
        by_priority(&got[0]),
        BTreeMap::from([("10.11.1.10".to_string(), 0), ("10.12.1.10".to_string(), 1)])
    );

    // A Sidecar selecting c2's workloads scopes c2's proxies only.
    write_atomic(&config.join("sidecar.yaml"), C2_SIDECAR);
    let hello = format!("outbound|5000||{HOST}");
    let sees = |id: &'static str| {
        let hello = hello.clone();
        let mp = &mp;
        async move {
            let clusters: Vec<Cluster> = fetch(mp.xds_addr, node_in(id), CDS, &[]).await;
            clusters.iter().any(|c| c.name == hello)
        }
    };
    wait_for("c2 scoped", BOUND, || async {
        (!sees("c2").await).then_some(())
    })
    .await;
    assert!(sees("c1").await);
}

/// Real traffic, the docs' per-cluster routing: helloworld has a backend in each cluster (two
/// addresses of the server's namespace); a client in c1, then one in c2, sends 50 requests each,
/// and every answer comes from its own cluster's backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_cluster_s_clients_reach_their_own_cluster_s_backend() {
    let net = 250;
    let more = PER_CLUSTER;
    let pair = Workloads::start("tl", net, &[], more).await;
    let (c1_backend, c2_backend) = (format!("10.{net}.3.2"), format!("10.{net}.3.3"));
    pair.server_ns.run(
        "ip",
        &["addr", "add", &format!("{c2_backend}/24"), "dev", "data"],
    );
    let c1 = pair.config_dir().join("clusters/c1");
    write_atomic(
        &c1.join("helloworld.yaml"),
        &helloworld("10.96.0.50", 8080, &[&c1_backend]),
    );
    let c2 = pair.config_dir().join("clusters/c2");
    std::fs::create_dir_all(&c2).unwrap();
    write_atomic(
        &c2.join("helloworld.yaml"),
        &helloworld("10.97.0.50", 8080, &[&c2_backend]),
    );
    let _server = pair
        .server_sidecar(workload_certs(&pair.mp, "default", "server"))
        .await;
    pair.client_ns
        .run("ip", &["route", "add", "10.97.0.0/16", "dev", "data"]);
    // Each client calls the VIP of its own cluster's Service.
    for (cluster, backend, vip) in [
        ("c1", &c1_backend, "10.96.0.50"),
        ("c2", &c2_backend, "10.97.0.50"),
    ] {
        let client = pair
            .client_sidecar_in(cluster, workload_certs(&pair.mp, "default", "client"))
            .await;
        let subset = format!("outbound|5000|{cluster}|{HOST}");
        wait_for("the client's subset", BOUND, || {
            let (client, subset, want) = (&client, &subset, format!("{backend}:8080"));
            async move { (client.endpoints(subset).await == [want]).then_some(()) }
        })
        .await;
        let mut answered = BTreeMap::new();
        for i in 0..50 {
            let (host, url) = (
                format!("Host: {HOST}:5000"),
                format!("http://{vip}:5000/call-{i}"),
            );
            let output = pair.as_client_app("curl", &["-s", "-m", "3", "-H", &host, &url]);
            let body: serde_json::Value = serde_json::from_slice(&output.stdout)
                .unwrap_or_else(|e| panic!("{cluster} call {i}: {e}: {output:?}"));
            let server = body["server"].as_str().unwrap_or_default().to_string();
            *answered.entry(server).or_insert(0) += 1;
        }
        assert_eq!(
            answered,
            BTreeMap::from([(backend.clone(), 50)]),
            "{cluster}"
        );
        drop(client);
    }
}
