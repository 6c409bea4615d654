//! East-west gateways as istiod builds them (issue 55, item 4), on decoded xDS across three clusters
//! modelled on the corpus scenario `multinetwork-primary-remote` (what istiod 1.14.6 sent there is
//! quoted where a shape is checked): c1 on network1, c2 and c3 on network2, each with Istio's
//! east-west gateway Service; Istio's cross-network Gateway (AUTO_PASSTHROUGH on 15443, hosts
//! `*.local`) and expose-istiod Gateway (PASSTHROUGH on 15012 and 15017, `*`).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use common::ads::fetch;
use common::*;
use envoy_types::pb::envoy::config::cluster::v3::cluster::{ClusterDiscoveryType, DiscoveryType};
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::config::listener::v3::{filter, FilterChain, Listener};
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_connection_manager::RouteSpecifier, HttpConnectionManager,
};
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::{tcp_proxy, TcpProxy};
use envoy_types::pb::envoy::extensions::upstreams::http::v3::{
    http_protocol_options::{explicit_http_config::ProtocolConfig, UpstreamProtocolOptions},
    HttpProtocolOptions,
};
use prost::Message;

const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const LDS: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
const HELLOWORLD: &str = "helloworld.sample.svc.cluster.local";
const EASTWEST: &str = "istio-eastwestgateway.istio-system.svc.cluster.local";
const ISTIOD: &str = "istiod.istio-system.svc.cluster.local";
/// Istio's mTLS ALPNs (istiod's `allIstioMtlsALPNs`).
const MESH_ALPN: [&str; 5] = [
    "istio",
    "istio-peer-exchange",
    "istio-http/1.0",
    "istio-http/1.1",
    "istio-h2",
];

/// One cluster's Istio namespace (its network), a node, the east-west gateway (Service with its
/// load balancer address `lb` and VIP `vip`, its pod at `gw_ip`), and the Kubernetes API.
fn cluster_base(
    network: &str,
    region: &str,
    zone: &str,
    vip: &str,
    lb: &str,
    gw_ip: &str,
) -> String {
    format!(
        "
apiVersion: v1
kind: Namespace
metadata: {{name: istio-system, labels: {{topology.istio.io/network: {network}}}}}
---
apiVersion: v1
kind: Node
metadata: {{name: node-{zone}, labels: {{topology.kubernetes.io/region: {region}, topology.kubernetes.io/zone: {zone}}}}}
---
apiVersion: v1
kind: Service
metadata: {{name: kubernetes, namespace: default}}
spec: {{clusterIP: {kube}, ports: [{{name: https, port: 443}}]}}
---
apiVersion: v1
kind: Service
metadata:
  name: istio-eastwestgateway
  namespace: istio-system
  labels: {{istio: eastwestgateway, topology.istio.io/network: {network}}}
spec:
  type: LoadBalancer
  clusterIP: {vip}
  ports:
  - {{name: status-port, port: 15021}}
  - {{name: tls, port: 15443}}
  - {{name: tls-istiod, port: 15012}}
  - {{name: tls-webhook, port: 15017}}
status: {{loadBalancer: {{ingress: [{{ip: {lb}}}]}}}}
---
apiVersion: v1
kind: Pod
metadata: {{name: istio-eastwestgateway-0, namespace: istio-system, labels: {{istio: eastwestgateway}}}}
spec: {{serviceAccountName: istio-eastwestgateway-service-account, nodeName: node-{zone}, containers: []}}
status: {{podIP: {gw_ip}}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: istio-eastwestgateway-1, namespace: istio-system, labels: {{kubernetes.io/service-name: istio-eastwestgateway}}}}
addressType: IPv4
ports:
- {{name: status-port, port: 15021}}
- {{name: tls, port: 15443}}
- {{name: tls-istiod, port: 15012}}
- {{name: tls-webhook, port: 15017}}
endpoints:
- {{addresses: [{gw_ip}], conditions: {{ready: true}}, targetRef: {{kind: Pod, name: istio-eastwestgateway-0, namespace: istio-system}}}}
",
        kube = vip.replace(".0.40", ".0.1"),
    )
}

/// A Service of namespace `sample` (`ports` as YAML) with one pod per entry of `pods`
/// (name, address, labels as YAML) on `zone`'s node.
fn service(
    name: &str,
    cluster_ip: &str,
    ports: &str,
    zone: &str,
    pods: &[(&str, &str, &str)],
) -> String {
    let mut out = format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: sample}}\nspec: {{clusterIP: {cluster_ip}, ports: {ports}}}\n"
    );
    let mut endpoints = String::new();
    for (pod, ip, labels) in pods {
        out += &format!(
            "---\napiVersion: v1\nkind: Pod\nmetadata: {{name: {pod}, namespace: sample, labels: {labels}}}\nspec: {{serviceAccountName: {name}, nodeName: node-{zone}, containers: []}}\nstatus: {{podIP: {ip}}}\n"
        );
        endpoints += &format!(
            "- {{addresses: [{ip}], conditions: {{ready: true}}, targetRef: {{kind: Pod, name: {pod}, namespace: sample}}}}\n"
        );
    }
    out += &format!(
        "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}-1, namespace: sample, labels: {{kubernetes.io/service-name: {name}}}}}\naddressType: IPv4\nports: {ports}\nendpoints:\n{endpoints}"
    );
    out
}

/// The control plane's Service, in the primary cluster.
const ISTIOD_SERVICE: &str = "
---
apiVersion: v1
kind: Service
metadata: {name: istiod, namespace: istio-system}
spec:
  clusterIP: 10.96.0.20
  ports:
  - {name: grpc-xds, port: 15010}
  - {name: https-dns, port: 15012}
  - {name: https-webhook, port: 443, targetPort: 15017}
  - {name: http-monitoring, port: 15014}
";

const SIDECAR: &str = "{app: x, security.istio.io/tlsMode: istio}";

fn c1() -> String {
    let mut yaml = cluster_base(
        "network1",
        "us-west1",
        "us-west1-a",
        "10.96.0.40",
        "192.0.2.10",
        "10.10.9.10",
    );
    yaml += ISTIOD_SERVICE;
    yaml += &service(
        "helloworld",
        "10.96.100.1",
        "[{name: http, port: 5000}]",
        "us-west1-a",
        &[(
            "helloworld-v1",
            "10.10.1.10",
            "{app: helloworld, version: v1, security.istio.io/tlsMode: istio}",
        )],
    );
    yaml += &service(
        "sleep",
        "10.96.100.2",
        "[{name: http, port: 80}]",
        "us-west1-a",
        &[("sleep-1", "10.10.2.10", SIDECAR)],
    );
    yaml
}

fn c2() -> String {
    let mut yaml = cluster_base(
        "network2",
        "us-east1",
        "us-east1-b",
        "10.97.0.40",
        "192.0.2.20",
        "10.11.9.10",
    );
    yaml += &service(
        "helloworld",
        "10.97.100.1",
        "[{name: http, port: 5000}]",
        "us-east1-b",
        &[
            (
                "helloworld-v2-a",
                "10.11.1.10",
                "{app: helloworld, version: v2, security.istio.io/tlsMode: istio}",
            ),
            (
                "helloworld-v2-b",
                "10.11.1.11",
                "{app: helloworld, version: v2, security.istio.io/tlsMode: istio}",
            ),
        ],
    );
    yaml += &service(
        "sleep",
        "10.97.100.2",
        "[{name: http, port: 80}]",
        "us-east1-b",
        &[("sleep-2", "10.11.2.10", SIDECAR)],
    );
    // Without a sidecar: never behind an east-west gateway.
    yaml += &service(
        "plain",
        "10.97.100.3",
        "[{name: tcp, port: 9000}]",
        "us-east1-b",
        &[("plain-1", "10.11.3.10", "{app: plain}")],
    );
    // Headless: istiod gives it SNI chains and an EDS cluster all the same.
    yaml += &service(
        "db",
        "None",
        "[{name: tcp-db, port: 3306}]",
        "us-east1-b",
        &[("db-0", "10.11.4.10", SIDECAR)],
    );
    // A UDP port has no SNI chain or cluster; the TCP one has.
    yaml += &service(
        "statsd",
        "10.97.100.5",
        "[{name: udp-statsd, port: 8125, protocol: UDP}, {name: tcp-statsd, port: 8126}]",
        "us-east1-b",
        &[("statsd-1", "10.11.5.10", SIDECAR)],
    );
    yaml
}

/// A third cluster on network2 with its own gateway: its endpoints are reached through that one.
fn c3() -> String {
    let mut yaml = cluster_base(
        "network2",
        "us-east1",
        "us-east1-c",
        "10.98.0.40",
        "192.0.2.30",
        "10.12.9.10",
    );
    yaml += &service(
        "helloworld",
        "10.98.100.1",
        "[{name: http, port: 5000}]",
        "us-east1-c",
        &[(
            "helloworld-v3",
            "10.12.1.10",
            "{app: helloworld, version: v3, security.istio.io/tlsMode: istio}",
        )],
    );
    yaml
}

/// Istio's cross-network and expose-istiod Gateways (samples/multicluster), a rule for helloworld
/// and ServiceEntries outside the gateway's hosts, mesh-external, and resolved by DNS.
const CONFIG: &str = "
apiVersion: networking.istio.io/v1
kind: Gateway
metadata: {name: cross-network-gateway, namespace: istio-system}
spec:
  selector: {istio: eastwestgateway}
  servers:
  - port: {number: 15443, name: tls, protocol: TLS}
    tls: {mode: AUTO_PASSTHROUGH}
    hosts: ['*.local']
---
apiVersion: networking.istio.io/v1
kind: Gateway
metadata: {name: istiod-gateway, namespace: istio-system}
spec:
  selector: {istio: eastwestgateway}
  servers:
  - port: {name: tls-istiod, number: 15012, protocol: tls}
    tls: {mode: PASSTHROUGH}
    hosts: ['*']
  - port: {name: tls-istiodwebhook, number: 15017, protocol: tls}
    tls: {mode: PASSTHROUGH}
    hosts: ['*']
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: istiod-vs, namespace: istio-system}
spec:
  hosts: ['*']
  gateways: [istiod-gateway]
  tls:
  - match: [{port: 15012, sniHosts: ['*']}]
    route: [{destination: {host: istiod.istio-system.svc.cluster.local, port: {number: 15012}}}]
  - match: [{port: 15017, sniHosts: ['*']}]
    route: [{destination: {host: istiod.istio-system.svc.cluster.local, port: {number: 443}}}]
---
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {name: helloworld, namespace: sample}
spec:
  host: helloworld.sample.svc.cluster.local
  trafficPolicy: {connectionPool: {tcp: {maxConnections: 7}}}
  subsets:
  - {name: v1, labels: {version: v1}}
  - {name: v2, labels: {version: v2}}
---
# ISTIO_MUTUAL toward a workload without a sidecar: its endpoint is not marked for mTLS, so no
# gateway forwards to it (today's istiod: pilot/pkg/xds/endpoints/mtls_checker.go and the
# endpoint's tlsMode metadata both decide).
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {name: plain, namespace: sample}
spec:
  host: plain.sample.svc.cluster.local
  trafficPolicy: {tls: {mode: ISTIO_MUTUAL}}
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: legacy, namespace: sample}
spec:
  hosts: [legacy.shop.internal]
  location: MESH_INTERNAL
  resolution: STATIC
  ports: [{number: 8080, name: tcp, protocol: TCP}]
  endpoints:
  - {address: 10.11.6.10, network: network2, serviceAccount: legacy, labels: {security.istio.io/tlsMode: istio}}
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: payments, namespace: sample}
spec:
  hosts: [payments.external.local]
  location: MESH_EXTERNAL
  resolution: STATIC
  ports: [{number: 443, name: tls, protocol: TLS}]
  endpoints: [{address: 10.11.7.10}]
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: cache, namespace: sample}
spec:
  hosts: [cache.dns.local]
  location: MESH_INTERNAL
  resolution: DNS
  ports: [{number: 6379, name: tcp-redis, protocol: TCP}]
  endpoints: [{address: cache.internal.example}]
";

struct Mesh {
    mp: meshpilot::app::Running,
    _dir: tempfile::TempDir,
}

async fn mesh() -> Mesh {
    let dir = tempfile::tempdir().unwrap();
    for (id, yaml) in [("c1", c1()), ("c2", c2()), ("c3", c3())] {
        let path = dir.path().join("clusters").join(id);
        std::fs::create_dir_all(&path).unwrap();
        std::fs::write(path.join("mesh.yaml"), yaml).unwrap();
    }
    let config = dir.path().join("config");
    std::fs::create_dir_all(&config).unwrap();
    std::fs::write(config.join("east-west.yaml"), CONFIG).unwrap();
    let mp = start_meshpilot(Path::new(dir.path()), &[]).await;
    Mesh { mp, _dir: dir }
}

/// c2's east-west gateway, as Istio's chart deploys it (with a network view of its own), or
/// without REQUESTED_NETWORK_VIEW.
fn gateway(view: bool) -> Node {
    let mut metadata = vec![("CLUSTER_ID", "c2"), ("NETWORK", "network2")];
    if view {
        metadata.push(("REQUESTED_NETWORK_VIEW", "network2"));
    }
    labelled_node(
        "router~10.11.9.10~istio-eastwestgateway-0.istio-system~istio-system.svc.cluster.local",
        &metadata,
        &[
            ("istio", "eastwestgateway"),
            ("topology.istio.io/network", "network2"),
        ],
    )
}

fn by_name<T>(items: Vec<T>, name: impl Fn(&T) -> &str) -> BTreeMap<String, T> {
    items
        .into_iter()
        .map(|i| (name(&i).to_string(), i))
        .collect()
}

fn sni(port: u16, subset: &str, host: &str) -> String {
    format!("outbound_.{port}_.{subset}_.{host}")
}

/// The cluster a chain's last filter proxies to, or the route its connection manager asks for.
fn destination(chain: &FilterChain) -> String {
    let Some(filter::ConfigType::TypedConfig(any)) =
        chain.filters.last().and_then(|f| f.config_type.as_ref())
    else {
        return String::new();
    };
    if let Ok(hcm) = HttpConnectionManager::decode(&any.value[..]) {
        if let Some(RouteSpecifier::Rds(rds)) = hcm.route_specifier {
            return format!("rds:{}", rds.route_config_name);
        }
    }
    match TcpProxy::decode(&any.value[..])
        .ok()
        .and_then(|t| t.cluster_specifier)
    {
        Some(tcp_proxy::ClusterSpecifier::Cluster(c)) => c,
        _ => String::new(),
    }
}

/// T4.1, T4.3 (listeners): 15443 forwards only Istio's mTLS (SNI and ALPN), for every service of
/// the gateway's hosts (`*.local`, any namespace, every resolution, no UDP port, nothing
/// mesh-external); the expose-istiod ports take any connection, plaintext included.
#[tokio::test]
async fn gateway_listeners_are_istiods() {
    let mesh = mesh().await;
    let listeners: Vec<Listener> = fetch(mesh.mp.xds_addr, gateway(true), LDS, &[]).await;
    let listeners = by_name(listeners, |l| l.name.as_str());
    let names: Vec<&str> = listeners.keys().map(String::as_str).collect();
    assert_eq!(names, ["0.0.0.0_15012", "0.0.0.0_15017", "0.0.0.0_15443"]);

    let east_west = &listeners["0.0.0.0_15443"];
    let inspectors: Vec<&str> = east_west
        .listener_filters
        .iter()
        .map(|f| f.name.as_str())
        .collect();
    assert_eq!(inspectors, ["envoy.filters.listener.tls_inspector"]);
    let mut forwarded = BTreeSet::new();
    for chain in &east_west.filter_chains {
        let matched = chain.filter_chain_match.as_ref().expect("a match");
        // As the corpus's `0.0.0.0_15443`: SNI and ALPN, no transport protocol.
        assert_eq!(matched.application_protocols, MESH_ALPN, "{chain:?}");
        assert_eq!(matched.transport_protocol, "", "{chain:?}");
        assert_eq!(matched.server_names.len(), 1, "{chain:?}");
        assert_eq!(destination(chain), matched.server_names[0]);
        forwarded.insert(matched.server_names[0].clone());
    }
    assert!(east_west.default_filter_chain.is_none());
    let expected: BTreeSet<String> = [
        sni(443, "", "kubernetes.default.svc.cluster.local"),
        sni(5000, "", HELLOWORLD),
        sni(5000, "v1", HELLOWORLD),
        sni(5000, "v2", HELLOWORLD),
        sni(80, "", "sleep.sample.svc.cluster.local"),
        sni(9000, "", "plain.sample.svc.cluster.local"),
        sni(3306, "", "db.sample.svc.cluster.local"),
        sni(8126, "", "statsd.sample.svc.cluster.local"),
        sni(6379, "", "cache.dns.local"),
        sni(15010, "", ISTIOD),
        sni(15012, "", ISTIOD),
        sni(443, "", ISTIOD),
        sni(15014, "", ISTIOD),
        sni(15021, "", EASTWEST),
        sni(15443, "", EASTWEST),
        sni(15012, "", EASTWEST),
        sni(15017, "", EASTWEST),
    ]
    .into_iter()
    .collect();
    // Beyond the pods' own names (the mesh's names for each pod of a headless service).
    let forwarded: BTreeSet<String> = forwarded
        .into_iter()
        .filter(|n| !n.contains("db-0.db."))
        .collect();
    assert_eq!(
        forwarded, expected,
        "not forwarded: legacy.shop.internal (outside *.local), payments.external.local \
         (mesh-external), statsd's UDP port"
    );

    // expose-istiod: `*` leaves the chain without a match, so plaintext is taken too; the TLS
    // inspector stays (the corpus's `0.0.0.0_15012` and `0.0.0.0_15017`).
    for (listener, cluster) in [
        ("0.0.0.0_15012", format!("outbound|15012||{ISTIOD}")),
        ("0.0.0.0_15017", format!("outbound|443||{ISTIOD}")),
    ] {
        let l = &listeners[listener];
        assert_eq!(l.filter_chains.len(), 1, "{l:?}");
        assert_eq!(l.filter_chains[0].filter_chain_match, None, "{l:?}");
        assert_eq!(destination(&l.filter_chains[0]), cluster);
        assert_eq!(l.listener_filters.len(), 1, "{l:?}");
        assert_eq!(
            l.listener_filters[0].name,
            "envoy.filters.listener.tls_inspector"
        );
    }
}

/// T4.3 (clusters), T4.4: the gateway's SNI clusters are built as outbound clusters (istiod's
/// `buildOutboundSniDnatClusters`), for every service it sees but mesh-external ones, whatever the
/// server's hosts, by each service's resolution.
#[tokio::test]
async fn sni_clusters_are_outbound_clusters() {
    let mesh = mesh().await;
    let clusters: Vec<Cluster> = fetch(mesh.mp.xds_addr, gateway(true), CDS, &[]).await;
    let clusters = by_name(clusters, |c| c.name.as_str());
    let listed = |name: &str| clusters.contains_key(name);

    // As the corpus's `outbound_.15010_._.istiod…`: EDS, LEAST_REQUEST, unlimited circuit breakers,
    // the mesh's connect timeout, HTTP/2 toward a gRPC port, no TLS of its own.
    let xds = &clusters[&sni(15010, "", ISTIOD)];
    assert_eq!(
        xds.cluster_discovery_type,
        Some(ClusterDiscoveryType::Type(DiscoveryType::Eds as i32))
    );
    assert_eq!(
        xds.eds_cluster_config
            .as_ref()
            .map(|e| e.service_name.as_str()),
        Some(sni(15010, "", ISTIOD).as_str())
    );
    assert_eq!(xds.lb_policy, 1, "LEAST_REQUEST");
    let thresholds = &xds
        .circuit_breakers
        .as_ref()
        .expect("circuit breakers")
        .thresholds[0];
    for (what, value) in [
        ("max_connections", &thresholds.max_connections),
        ("max_pending_requests", &thresholds.max_pending_requests),
        ("max_requests", &thresholds.max_requests),
        ("max_retries", &thresholds.max_retries),
    ] {
        assert_eq!(value.as_ref().map(|v| v.value), Some(u32::MAX), "{what}");
    }
    assert!(thresholds.track_remaining);
    assert_eq!(xds.connect_timeout.as_ref().map(|d| d.seconds), Some(10));
    assert!(xds.transport_socket.is_none() && xds.transport_socket_matches.is_empty());
    let options = &xds.typed_extension_protocol_options
        ["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"];
    let options = HttpProtocolOptions::decode(&options.value[..]).unwrap();
    let Some(UpstreamProtocolOptions::ExplicitHttpConfig(explicit)) =
        options.upstream_protocol_options
    else {
        panic!("no explicit HTTP config: {options:?}");
    };
    assert!(matches!(
        explicit.protocol_config,
        Some(ProtocolConfig::Http2ProtocolOptions(_))
    ));

    // The rule's connection pool applies, and its subsets have clusters of their own.
    let hello = &clusters[&sni(5000, "", HELLOWORLD)];
    let max = hello.circuit_breakers.as_ref().unwrap().thresholds[0]
        .max_connections
        .as_ref()
        .map(|v| v.value);
    assert_eq!(max, Some(7));
    assert!(listed(&sni(5000, "v2", HELLOWORLD)));

    // Not host-scoped: a host outside the server's is listed; mesh-external ones and UDP ports not.
    assert!(listed(&sni(8080, "", "legacy.shop.internal")));
    assert!(!listed(&sni(443, "", "payments.external.local")));
    assert!(!listed(&sni(8125, "", "statsd.sample.svc.cluster.local")));
    assert!(listed(&sni(8126, "", "statsd.sample.svc.cluster.local")));

    // A headless service by EDS (on routers), a DNS one resolving its endpoints.
    let db = &clusters[&sni(3306, "", "db.sample.svc.cluster.local")];
    assert_eq!(
        db.cluster_discovery_type,
        Some(ClusterDiscoveryType::Type(DiscoveryType::Eds as i32))
    );
    let cache = &clusters[&sni(6379, "", "cache.dns.local")];
    assert_eq!(
        cache.cluster_discovery_type,
        Some(ClusterDiscoveryType::Type(DiscoveryType::StrictDns as i32))
    );
    assert!(format!("{:?}", cache.load_assignment).contains("cache.internal.example"));
}
