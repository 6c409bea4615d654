//! Auto mTLS as istiod infers it (pilot/pkg/model/push_context.go
//! `BestEffortInferServiceMTLSMode`, pilot/pkg/networking/core/cluster_tls.go,
//! pilot/pkg/xds/endpoints/mtls_checker.go), checked on the decoded CDS and EDS: a namespace whose
//! PeerAuthentication disables mTLS gets plaintext clusters, subsets and connection pools
//! notwithstanding, even where a workload of it asks for STRICT; a rule's settings for a port
//! replace its TLS too, leaving the port to auto mTLS (mTLS only to endpoints with sidecars).

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::ads::fetch;
use common::*;
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;

const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
const BOUND: Duration = Duration::from_secs(10);
const CLIENT: &str = "sidecar~10.40.0.9~sleep-1.apps~apps.svc.cluster.local";

/// A pod, labelled `extra`, as one endpoint of `service` (port `port_name`).
fn pod(ns: &str, name: &str, ip: &str, extra: &str) -> String {
    format!(
        "---\napiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: {ns}, labels: {{{extra}}}}}\nspec: {{serviceAccountName: {name}}}\nstatus: {{podIP: {ip}}}\n"
    )
}

fn slice(ns: &str, service: &str, port: &str, pods: &[(&str, &str)]) -> String {
    let endpoints: String = pods
        .iter()
        .map(|(name, ip)| {
            format!("- {{addresses: [{ip}], conditions: {{ready: true}}, targetRef: {{kind: Pod, name: {name}, namespace: {ns}}}}}\n")
        })
        .collect();
    format!("---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {service}-1, namespace: {ns}, labels: {{kubernetes.io/service-name: {service}}}}}\naddressType: IPv4\nports: [{port}]\nendpoints:\n{endpoints}")
}

fn cluster_files() -> String {
    let sidecar = "security.istio.io/tlsMode: istio";
    [
        "apiVersion: v1\nkind: Service\nmetadata: {name: db, namespace: legacy}\nspec: {clusterIP: 10.96.5.5, ports: [{name: tcp-db, port: 5432}]}\n".to_string(),
        pod("legacy", "db-v1", "10.30.5.1", &format!("app: db, version: v1, {sidecar}")),
        slice("legacy", "db", "{name: tcp-db, port: 5432}", &[("db-v1", "10.30.5.1")]),
        "---\napiVersion: v1\nkind: Service\nmetadata: {name: reviews, namespace: shop}\nspec: {clusterIP: 10.96.6.6, ports: [{name: http, port: 9080}]}\n".to_string(),
        pod("shop", "reviews-v1", "10.30.6.1", &format!("app: reviews, version: v1, {sidecar}")),
        pod("shop", "reviews-v2", "10.30.6.2", "app: reviews, version: v2"),
        slice(
            "shop",
            "reviews",
            "{name: http, port: 9080}",
            &[("reviews-v1", "10.30.6.1"), ("reviews-v2", "10.30.6.2")],
        ),
    ]
    .concat()
}

const CONFIG: &str = "
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: default, namespace: legacy}
spec: {mtls: {mode: DISABLE}}
---
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: db-strict, namespace: legacy}
spec:
  selector: {matchLabels: {app: db}}
  mtls: {mode: STRICT}
---
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {name: db, namespace: legacy}
spec:
  host: db.legacy.svc.cluster.local
  subsets:
  - name: v1
    labels: {version: v1}
    trafficPolicy: {connectionPool: {tcp: {maxConnections: 100}}}
---
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {name: reviews, namespace: shop}
spec:
  host: reviews.shop.svc.cluster.local
  trafficPolicy:
    tls: {mode: ISTIO_MUTUAL}
    portLevelSettings:
    - port: {number: 9080}
      connectionPool: {http: {http1MaxPendingRequests: 10}}
  subsets:
  - {name: v1, labels: {version: v1}}
  - {name: v2, labels: {version: v2}}
";

/// Each endpoint's address and whether it is marked for Istio's mTLS.
fn marked(cla: &ClusterLoadAssignment) -> BTreeMap<String, bool> {
    cla.endpoints
        .iter()
        .flat_map(|l| &l.lb_endpoints)
        .map(|e| {
            let address = format!("{:?}", e.host_identifier);
            let ip = address
                .split("address: \"")
                .nth(1)
                .and_then(|rest| rest.split('"').next())
                .unwrap_or_default()
                .to_string();
            let tls = e.metadata.as_ref().is_some_and(|m| {
                format!(
                    "{:?}",
                    m.filter_metadata.get("envoy.transport_socket_match")
                )
                .contains("istio")
            });
            (ip, tls)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_mtls_follows_the_namespace_and_the_port_s_own_settings() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = dir.path().join("clusters/c1");
    std::fs::create_dir_all(&cluster).unwrap();
    std::fs::write(cluster.join("mesh.yaml"), cluster_files()).unwrap();
    let config = dir.path().join("config");
    std::fs::create_dir_all(&config).unwrap();
    std::fs::write(config.join("rules.yaml"), CONFIG).unwrap();
    let mp = start_meshpilot(dir.path(), &[]).await;
    let client = || node(CLIENT, &[("CLUSTER_ID", "c1")]);

    let names = [
        "outbound|5432||db.legacy.svc.cluster.local",
        "outbound|5432|v1|db.legacy.svc.cluster.local",
        "outbound|9080||reviews.shop.svc.cluster.local",
        "outbound|9080|v1|reviews.shop.svc.cluster.local",
        "outbound|9080|v2|reviews.shop.svc.cluster.local",
    ];
    let clusters: BTreeMap<String, Cluster> = wait_for("the clusters", BOUND, || async {
        let got: Vec<Cluster> = fetch(mp.xds_addr, client(), CDS, &names).await;
        let got: BTreeMap<String, Cluster> = got.into_iter().map(|c| (c.name.clone(), c)).collect();
        (got.len() == names.len()).then_some(got)
    })
    .await;

    // The DISABLE namespace: plaintext from clients, the subset's pool kept, the workload's own
    // STRICT not consulted (istiod infers a service's mode from its namespace).
    for name in &names[..2] {
        let c = &clusters[*name];
        assert!(c.transport_socket.is_none(), "{name}: {c:?}");
        assert!(c.transport_socket_matches.is_empty(), "{name}: {c:?}");
    }
    let pool = format!("{:?}", clusters[names[1]].circuit_breakers);
    assert!(pool.contains("value: 100"), "{pool}");

    // reviews: the port's settings replace the rule's TLS, so auto mTLS applies: mTLS only to
    // endpoints marked as having a sidecar, on every subset.
    for name in &names[2..] {
        let c = &clusters[*name];
        assert!(c.transport_socket.is_none(), "{name}: {c:?}");
        assert_eq!(c.transport_socket_matches.len(), 2, "{name}: {c:?}");
    }
    let pending = format!("{:?}", clusters[names[2]].circuit_breakers);
    assert!(pending.contains("value: 10 "), "{pending}");

    let assignments: Vec<ClusterLoadAssignment> =
        fetch(mp.xds_addr, client(), EDS, &[names[0], names[2]]).await;
    let by_name: BTreeMap<&str, &ClusterLoadAssignment> = assignments
        .iter()
        .map(|a| (a.cluster_name.as_str(), a))
        .collect();
    assert_eq!(
        marked(by_name[names[0]]),
        BTreeMap::from([("10.30.5.1".to_string(), true)]),
        "the workload's STRICT keeps its endpoint marked; the cluster has no TLS to offer"
    );
    assert_eq!(
        marked(by_name[names[2]]),
        BTreeMap::from([
            ("10.30.6.1".to_string(), true),
            ("10.30.6.2".to_string(), false)
        ])
    );
}
