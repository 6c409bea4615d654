//! VirtualService `tls` routes on a sidecar's outbound TLS port, as istiod builds them
//! (pilot/pkg/networking/core/tls.go): Istio's egress task sends TLS for an external host through
//! the egress gateway, never straight to the host; every overlapping VirtualService counts, each
//! applying match by its SNI hosts, with weights; a match for other gateways, another port or
//! other clients does not; and `tcp` routes do not steer a TLS port.

mod common;

use std::path::Path;
use std::time::Duration;

use common::ads::fetch;
use common::*;
use envoy_types::pb::envoy::config::listener::v3::{filter, Listener};
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::{
    tcp_proxy::ClusterSpecifier, TcpProxy,
};
use prost::Message;

const LDS: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
const BOUND: Duration = Duration::from_secs(10);
const CLIENT: &str = "sidecar~10.40.0.9~sleep-1.default~default.svc.cluster.local";
const EGRESS_SUBSET: &str = "outbound|443|cnn|istio-egressgateway.istio-system.svc.cluster.local";

/// The egress gateway, its pod and a client Service, in the cluster's files.
const CLUSTER: &str = "
apiVersion: v1
kind: Service
metadata: {name: istio-egressgateway, namespace: istio-system}
spec:
  clusterIP: 10.96.0.50
  selector: {istio: egressgateway}
  ports: [{name: http2, port: 80}, {name: https, port: 443}]
---
apiVersion: v1
kind: Service
metadata: {name: secure, namespace: default}
spec:
  clusterIP: 10.96.0.60
  ports: [{name: tls-x, port: 443}]
";

/// Istio's egress task, TLS passthrough through the egress gateway (as written for kubectl apply).
const EGRESS_TASK: &str = "
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: cnn}
spec:
  hosts: [edition.cnn.com]
  ports:
  - {number: 80, name: http-port, protocol: HTTP}
  - {number: 443, name: tls, protocol: TLS}
  resolution: DNS
---
apiVersion: networking.istio.io/v1
kind: Gateway
metadata: {name: istio-egressgateway}
spec:
  selector: {istio: egressgateway}
  servers:
  - port: {number: 443, name: tls, protocol: TLS}
    hosts: [edition.cnn.com]
    tls: {mode: PASSTHROUGH}
---
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {name: egressgateway-for-cnn}
spec:
  host: istio-egressgateway.istio-system.svc.cluster.local
  subsets: [{name: cnn}]
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: direct-cnn-through-egress-gateway}
spec:
  hosts: [edition.cnn.com]
  gateways: [mesh, istio-egressgateway]
  tls:
  - match:
    - gateways: [mesh]
      port: 443
      sniHosts: [edition.cnn.com]
    route:
    - destination:
        host: istio-egressgateway.istio-system.svc.cluster.local
        subset: cnn
        port: {number: 443}
  - match:
    - gateways: [istio-egressgateway]
      port: 443
      sniHosts: [edition.cnn.com]
    route:
    - destination: {host: edition.cnn.com, port: {number: 443}}
      weight: 100
";

/// More routes for other hosts of the same port: weighted, wildcard, and matches that do not
/// apply to this client; a TCP route on a TLS port.
const MORE_ROUTES: &str = "
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: api}
spec:
  hosts: [api.example.com]
  ports: [{number: 443, name: tls, protocol: TLS}]
  resolution: DNS
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: api-split}
spec:
  hosts: [api.example.com]
  tls:
  - match: [{sniHosts: [b.example.com, api.example.com]}]
    route:
    - {destination: {host: api.example.com, port: {number: 443}}, weight: 70}
    - destination: {host: istio-egressgateway.istio-system.svc.cluster.local, subset: cnn, port: {number: 443}}
      weight: 30
  - match: [{sniHosts: [c.example.com], sourceLabels: {app: not-sleep}}]
    route: [{destination: {host: istio-egressgateway.istio-system.svc.cluster.local, port: {number: 443}}}]
  - match: [{sniHosts: [d.example.com], port: 8443}]
    route: [{destination: {host: istio-egressgateway.istio-system.svc.cluster.local, port: {number: 443}}}]
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: example-wildcard}
spec:
  hosts: ['*.example.com']
  tls:
  - match: [{sniHosts: [e.example.com]}]
    route: [{destination: {host: api.example.com, port: {number: 443}}}]
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: secure-tcp}
spec:
  hosts: [secure.default.svc.cluster.local]
  tcp:
  - route: [{destination: {host: istio-egressgateway.istio-system.svc.cluster.local, port: {number: 443}}}]
";

/// The chains of the client's 443 listener: (SNI names, addresses) → the TCP proxy's target.
fn chains(listeners: &[Listener]) -> Vec<(Vec<String>, Vec<String>, String)> {
    let listener = listeners
        .iter()
        .find(|l| l.name == "0.0.0.0_443")
        .expect("the 443 listener");
    let mut out = Vec::new();
    for chain in &listener.filter_chains {
        let m = chain.filter_chain_match.clone().unwrap_or_default();
        let mut names = m.server_names.clone();
        names.sort();
        let ranges = m
            .prefix_ranges
            .iter()
            .map(|r| r.address_prefix.clone())
            .collect();
        let target = chain
            .filters
            .iter()
            .find(|f| f.name == "envoy.filters.network.tcp_proxy")
            .and_then(|f| match &f.config_type {
                Some(filter::ConfigType::TypedConfig(any)) => TcpProxy::decode(&any.value[..]).ok(),
                _ => None,
            })
            .map(|p| match p.cluster_specifier {
                Some(ClusterSpecifier::Cluster(c)) => c,
                Some(ClusterSpecifier::WeightedClusters(w)) => w
                    .clusters
                    .iter()
                    .map(|c| format!("{}={}", c.name, c.weight))
                    .collect::<Vec<_>>()
                    .join(","),
                None => String::new(),
            })
            .unwrap_or_default();
        out.push((names, ranges, target));
    }
    out
}

async fn client_listeners(mp: &meshpilot::app::Running) -> Vec<Listener> {
    let node = || node(CLIENT, &[("CLUSTER_ID", "c1")]);
    wait_for("the routed chains", BOUND, || async {
        let got: Vec<Listener> = fetch(mp.xds_addr, node(), LDS, &[]).await;
        let routed = got.iter().any(|l| l.name == "0.0.0.0_443")
            && chains(&got).iter().any(|c| c.2.contains("api.example.com"));
        routed.then_some(got)
    })
    .await
}

fn by_sni<'c>(chains: &'c [(Vec<String>, Vec<String>, String)], sni: &str) -> Vec<&'c str> {
    chains
        .iter()
        .filter(|c| c.0.iter().any(|n| n == sni))
        .map(|c| c.2.as_str())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_routes_steer_a_sidecar_s_tls_port() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = dir.path().join("clusters/c1");
    std::fs::create_dir_all(&cluster).unwrap();
    std::fs::write(cluster.join("services.yaml"), CLUSTER).unwrap();
    let config = dir.path().join("config");
    std::fs::create_dir_all(&config).unwrap();
    std::fs::write(config.join("egress.yaml"), EGRESS_TASK).unwrap();
    std::fs::write(config.join("more.yaml"), MORE_ROUTES).unwrap();
    let mp = start_meshpilot(Path::new(dir.path()), &[]).await;
    let chains = chains(&client_listeners(&mp).await);

    // The egress task: edition.cnn.com's TLS goes to the egress gateway's subset, and no chain
    // sends it straight to the host.
    assert_eq!(
        by_sni(&chains, "edition.cnn.com"),
        [EGRESS_SUBSET],
        "{chains:?}"
    );
    assert!(
        !chains
            .iter()
            .any(|c| c.2 == "outbound|443||edition.cnn.com"),
        "{chains:?}"
    );

    // A weighted route for its SNI names; a wildcard VirtualService's route too (istiod consults
    // every overlapping one); none for matches of another client or port; no default chain.
    let weighted = format!("outbound|443||api.example.com=70,{EGRESS_SUBSET}=30");
    assert_eq!(by_sni(&chains, "api.example.com"), [weighted.as_str()]);
    assert_eq!(by_sni(&chains, "b.example.com"), [weighted.as_str()]);
    assert_eq!(
        by_sni(&chains, "e.example.com"),
        ["outbound|443||api.example.com"]
    );
    assert!(by_sni(&chains, "c.example.com").is_empty(), "{chains:?}");
    assert!(by_sni(&chains, "d.example.com").is_empty(), "{chains:?}");

    // A TCP route does not steer a TLS port: the service's own chain by its address.
    let secure: Vec<&str> = chains
        .iter()
        .filter(|c| c.1.iter().any(|r| r == "10.96.0.60"))
        .map(|c| c.2.as_str())
        .collect();
    assert_eq!(secure, ["outbound|443||secure.default.svc.cluster.local"]);
}
