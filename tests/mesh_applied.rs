//! Mesh config fields istiod applies to what proxies receive (issue 56, item 1), decoded from what
//! a raw ADS client is sent: `pathNormalization`, `tcpKeepalive`, `protocolDetectionTimeout`,
//! `h2UpgradePolicy`, `defaultHttpRetryPolicy`, `meshMTLS` and the cluster stat names, each as
//! istiod sends it (docs/mesh-config.md names the sources), and a change of the mesh config pushed.

mod common;

use std::path::Path;
use std::time::Duration;

use common::ads::fetch;
use common::*;
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::core::v3::transport_socket;
use envoy_types::pb::envoy::config::core::v3::{Node, TcpKeepalive};
use envoy_types::pb::envoy::config::listener::v3::{filter, FilterChain, Listener};
use envoy_types::pb::envoy::config::route::v3::{route, RouteConfiguration};
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_connection_manager::PathWithEscapedSlashesAction, HttpConnectionManager,
};
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::TcpProxy;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    common_tls_context::ValidationContextType, tls_parameters::TlsProtocol, DownstreamTlsContext,
    TlsParameters, UpstreamTlsContext,
};
use envoy_types::pb::envoy::extensions::upstreams::http::v3::{
    http_protocol_options::UpstreamProtocolOptions, HttpProtocolOptions,
};
use envoy_types::pb::google::protobuf::UInt32Value;
use prost::Message;

const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const LDS: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
const RDS: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
const BOUND: Duration = Duration::from_secs(10);
const WEB_HTTP: &str = "outbound|80||web.shop.svc.cluster.local";
const WEB_DB: &str = "outbound|5432||web.shop.svc.cluster.local";
const HTTP_OPTIONS: &str = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions";

/// `web` in `shop`: HTTP on 80 (to 8080) and TCP on 5432, one pod with a sidecar.
const CLUSTER: &str = "
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  clusterIP: 10.96.0.50
  ports: [{name: http, port: 80, targetPort: 8080}, {name: tcp-db, port: 5432}]
---
apiVersion: v1
kind: Pod
metadata: {name: web-0, namespace: shop, labels: {app: web, security.istio.io/tlsMode: istio}}
spec: {serviceAccountName: web, containers: []}
status: {podIP: 10.1.0.5}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080}, {name: tcp-db, port: 5432}]
endpoints:
- {addresses: [10.1.0.5], conditions: {ready: true}, targetRef: {kind: Pod, name: web-0, namespace: shop}}
";

const MESH: &str = r#"
pathNormalization: {normalization: MERGE_SLASHES}
tcpKeepalive: {probes: 3, time: 30s, interval: 5s}
protocolDetectionTimeout: 2s
h2UpgradePolicy: UPGRADE
defaultHttpRetryPolicy: {attempts: 4, retryOn: "5xx,429"}
meshMTLS: {minProtocolVersion: TLSV1_3}
outboundClusterStatName: "%SERVICE%_%SERVICE_PORT_NAME%_%SERVICE_PORT%"
inboundClusterStatName: "in_%SERVICE_FQDN%_%SERVICE_PORT%"
"#;

struct Mesh {
    mp: meshpilot::app::Running,
    mesh_config: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

async fn mesh(config: &str) -> Mesh {
    let dir = tempfile::tempdir().unwrap();
    let cluster = dir.path().join("clusters/c1");
    std::fs::create_dir_all(&cluster).unwrap();
    std::fs::write(cluster.join("mesh.yaml"), CLUSTER).unwrap();
    let mesh_config = dir.path().join("mesh.yaml");
    std::fs::write(&mesh_config, config).unwrap();
    let mp = start_meshpilot(
        Path::new(dir.path()),
        &["--mesh-config", mesh_config.to_str().unwrap()],
    )
    .await;
    Mesh {
        mp,
        mesh_config,
        _dir: dir,
    }
}

/// web-0's sidecar.
fn sidecar() -> Node {
    labelled_node(
        "sidecar~10.1.0.5~web-0.shop~shop.svc.cluster.local",
        &[("CLUSTER_ID", "c1")],
        &[("app", "web"), ("security.istio.io/tlsMode", "istio")],
    )
}

fn named<'a, T>(items: &'a [T], name: &str, of: impl Fn(&T) -> &str) -> &'a T {
    items
        .iter()
        .find(|i| of(i) == name)
        .unwrap_or_else(|| panic!("no {name}"))
}

fn typed<T: Message + Default>(chain: &FilterChain, filter_name: &str) -> Option<T> {
    let f = chain.filters.iter().find(|f| f.name == filter_name)?;
    match f.config_type.as_ref()? {
        filter::ConfigType::TypedConfig(any) => T::decode(&any.value[..]).ok(),
        _ => None,
    }
}

fn connection_managers(listener: &Listener) -> Vec<HttpConnectionManager> {
    let chains = listener.filter_chains.iter();
    chains
        .filter_map(|c| typed(c, "envoy.filters.network.http_connection_manager"))
        .collect()
}

fn keepalive(cluster: &Cluster) -> Option<TcpKeepalive> {
    cluster.upstream_connection_options?.tcp_keepalive
}

fn upgraded(cluster: &Cluster) -> bool {
    let Some(any) = cluster.typed_extension_protocol_options.get(HTTP_OPTIONS) else {
        return false;
    };
    let options = HttpProtocolOptions::decode(&any.value[..]).unwrap();
    matches!(
        options.upstream_protocol_options,
        Some(UpstreamProtocolOptions::ExplicitHttpConfig(e)) if matches!(
            e.protocol_config,
            Some(envoy_types::pb::envoy::extensions::upstreams::http::v3::http_protocol_options::explicit_http_config::ProtocolConfig::Http2ProtocolOptions(_))
        )
    )
}

#[tokio::test]
async fn mesh_fields_reach_what_proxies_are_sent() {
    let mesh = mesh(MESH).await;
    let xds = mesh.mp.xds_addr;

    // pathNormalization MERGE_SLASHES: normalised and merged, escaped slashes kept, on every
    // connection manager (pilot/pkg/networking/core/listener_builder.go).
    let listeners: Vec<Listener> = fetch(xds, sidecar(), LDS, &[]).await;
    let port = named(&listeners, "0.0.0.0_80", |l| &l.name);
    let inbound = named(&listeners, "virtualInbound", |l| &l.name);
    let managers: Vec<HttpConnectionManager> = [port, inbound]
        .into_iter()
        .flat_map(connection_managers)
        .collect();
    assert!(managers.len() >= 2);
    for hcm in &managers {
        assert_eq!(hcm.normalize_path.as_ref().map(|v| v.value), Some(true));
        assert!(hcm.merge_slashes, "{}", hcm.stat_prefix);
        assert_eq!(
            hcm.path_with_escaped_slashes_action,
            PathWithEscapedSlashesAction::KeepUnchanged as i32
        );
    }

    // protocolDetectionTimeout: listeners that sniff wait this long for the first bytes.
    for listener in [port, inbound] {
        let timeout = listener
            .listener_filters_timeout
            .as_ref()
            .map(|d| d.seconds);
        assert_eq!(timeout, Some(2), "{}", listener.name);
        assert!(listener.continue_on_listener_filters_timeout);
    }

    // meshMTLS minProtocolVersion TLSV1_3: inbound mTLS at TLS 1.3 only.
    let mut mtls = 0;
    for chain in &inbound.filter_chains {
        let Some(socket) = &chain.transport_socket else {
            continue;
        };
        let Some(
            envoy_types::pb::envoy::config::core::v3::transport_socket::ConfigType::TypedConfig(
                any,
            ),
        ) = &socket.config_type
        else {
            continue;
        };
        let Ok(tls) = DownstreamTlsContext::decode(&any.value[..]) else {
            continue;
        };
        let params = tls.common_tls_context.unwrap().tls_params.unwrap();
        assert_eq!(
            params.tls_minimum_protocol_version,
            TlsProtocol::TlSv13 as i32
        );
        mtls += 1;
    }
    assert!(mtls > 0, "no inbound mTLS chain");

    // Outbound TCP chains report their stats under the outbound stat name.
    let db = named(&listeners, "0.0.0.0_5432", |l| &l.name);
    let proxy: TcpProxy = (db.filter_chains.iter())
        .find_map(|c| typed(c, "envoy.filters.network.tcp_proxy"))
        .expect("the TCP chain");
    assert_eq!(proxy.stat_prefix, "web.shop_tcp-db_5432");
    // So do an east-west gateway's AUTO_PASSTHROUGH chains (istiod's gateway.go).
    let east_west = labelled_node(
        "router~10.1.0.8~ew-0.istio-system~istio-system.svc.cluster.local",
        &[("CLUSTER_ID", "c1")],
        &[("istio", "eastwestgateway")],
    );
    let gateway: Vec<Listener> = fetch(xds, east_west, LDS, &[]).await;
    let passthrough = named(&gateway, "0.0.0.0_15443", |l| &l.name);
    let chain = named(
        &passthrough.filter_chains,
        "outbound_.80_._.web.shop.svc.cluster.local",
        |c| &c.name,
    );
    let proxy: TcpProxy = typed(chain, "envoy.filters.network.tcp_proxy").expect("a TCP proxy");
    assert_eq!(proxy.stat_prefix, "web.shop_http_80");

    let clusters: Vec<Cluster> = fetch(xds, sidecar(), CDS, &[]).await;
    let http = named(&clusters, WEB_HTTP, |c| &c.name);
    let db = named(&clusters, WEB_DB, |c| &c.name);
    let passthrough = named(&clusters, "PassthroughCluster", |c| &c.name);
    let inbound = clusters
        .iter()
        .find(|c| c.name.starts_with("inbound|8080|"))
        .expect("the inbound cluster");

    // tcpKeepalive: every cluster but the black hole (cluster.go applyTCPKeepalive).
    let expected = TcpKeepalive {
        keepalive_probes: Some(UInt32Value { value: 3 }),
        keepalive_time: Some(UInt32Value { value: 30 }),
        keepalive_interval: Some(UInt32Value { value: 5 }),
    };
    for cluster in [http, db, passthrough, inbound] {
        assert_eq!(keepalive(cluster), Some(expected), "{}", cluster.name);
    }

    // h2UpgradePolicy UPGRADE: HTTP ports' clusters speak HTTP/2 upstream, TCP ports' not.
    assert!(upgraded(http));
    assert!(!upgraded(db));

    // Stat names, with istiod's `;` delimiter (util.DelimitedStatsPrefix).
    assert_eq!(http.alt_stat_name, "web.shop_http_80;");
    assert_eq!(inbound.alt_stat_name, "in_web.shop.svc.cluster.local_80;");

    // defaultHttpRetryPolicy: the default route's retries, status codes apart.
    let routes: Vec<RouteConfiguration> = fetch(xds, sidecar(), RDS, &["80"]).await;
    let vhost = routes[0]
        .virtual_hosts
        .iter()
        .find(|v| v.name == "web.shop.svc.cluster.local:80")
        .expect("web's virtual host");
    let Some(route::Action::Route(action)) = &vhost.routes[0].action else {
        panic!("not a route: {vhost:?}");
    };
    let retry = action.retry_policy.as_ref().expect("retries");
    assert_eq!(retry.num_retries.as_ref().map(|n| n.value), Some(4));
    assert_eq!(retry.retry_on, "5xx,retriable-status-codes");
    assert_eq!(retry.retriable_status_codes, [429]);
}

/// A changed mesh config is pushed: back to Istio's defaults, each field's effect goes.
#[tokio::test]
async fn a_changed_mesh_config_is_pushed() {
    let mesh = mesh(MESH).await;
    let xds = mesh.mp.xds_addr;
    write_atomic(
        &mesh.mesh_config,
        "pathNormalization: {normalization: NONE}\n",
    );
    let clusters = wait_for("the default keepalive", BOUND, || async move {
        let clusters: Vec<Cluster> = fetch(xds, sidecar(), CDS, &[]).await;
        let http = named(&clusters, WEB_HTTP, |c| &c.name);
        keepalive(http).is_none().then_some(clusters)
    })
    .await;
    let http = named(&clusters, WEB_HTTP, |c| &c.name);
    assert!(!upgraded(http));
    assert_eq!(http.alt_stat_name, "");
    let listeners: Vec<Listener> = fetch(xds, sidecar(), LDS, &[]).await;
    let port = named(&listeners, "0.0.0.0_80", |l| &l.name);
    for hcm in connection_managers(port) {
        assert_eq!(hcm.normalize_path.as_ref().map(|v| v.value), Some(false));
        assert!(!hcm.merge_slashes);
    }
    assert_eq!(
        port.listener_filters_timeout.as_ref().map(|d| d.seconds),
        Some(0)
    );
    let routes: Vec<RouteConfiguration> = fetch(xds, sidecar(), RDS, &["80"]).await;
    let Some(route::Action::Route(action)) = &routes[0].virtual_hosts[0].routes[0].action else {
        panic!("not a route");
    };
    let retry = action
        .retry_policy
        .as_ref()
        .expect("Istio's default retries");
    assert_eq!(retry.num_retries.as_ref().map(|n| n.value), Some(2));
}

/// A client and a server with Envoy sidecars in network namespaces, fed by a meshpilot reading
/// `mesh` as its mesh config; the echo serves on every address, or at `echo_at` only.
struct Sidecars {
    pair: common::pair::Workloads,
    server: Envoy,
    _client: Envoy,
    _mesh_config: tempfile::NamedTempFile,
}

impl Sidecars {
    async fn start(name: &str, net: u8, mesh: &str, echo_at: Option<&str>) -> Sidecars {
        let mesh_config = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(mesh_config.path(), mesh).unwrap();
        let flags = ["--mesh-config", mesh_config.path().to_str().unwrap()];
        let mut pair = common::pair::Workloads::start_bare(name, net, &flags, "").await;
        match echo_at {
            Some(address) => pair.server_ns.serve_http_echo_at(address),
            None => pair.server_ns.serve_http_echo(8080),
        }
        let client = pair
            .client_sidecar(workload_certs(&pair.mp, "default", "client"))
            .await;
        let server = pair
            .server_sidecar(workload_certs(&pair.mp, "default", "server"))
            .await;
        Sidecars {
            pair,
            server,
            _client: client,
            _mesh_config: mesh_config,
        }
    }
}

/// Real traffic between two Envoy sidecars (network namespaces, Istio's capture): merged slashes
/// reach the application as one, and the server's inbound mTLS refuses TLS 1.2 under
/// `meshMTLS.minProtocolVersion: TLSV1_3` while the mesh's own clients (TLS 1.3) get through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merged_slashes_and_tls_1_3_in_real_traffic() {
    let mesh = "pathNormalization: {normalization: MERGE_SLASHES}\nmeshMTLS: {minProtocolVersion: TLSV1_3}\n";
    let sidecars = Sidecars::start("ma", 248, mesh, None).await;
    let (pair, server) = (&sidecars.pair, &sidecars.server);

    // Only an answer for the merged path is waited for: the unmerged one would never come.
    pair.curl_echo(&["http://10.96.77.77:8080//merged//path"], "/merged/path")
        .await;
    assert!(
        server
            .counter("listener.0.0.0.0_15006.ssl.versions.TLSv1.3")
            .await
            >= 1
    );

    // A TLS 1.2 client offering Istio's mTLS ALPN, straight at the server's pod address (root's
    // traffic is not captured on the client's side): refused on the protocol version.
    let target = format!("{}:8080", pair.server_ip());
    let refused = pair
        .client_ns
        .command("timeout")
        .args(["10", "openssl", "s_client", "-connect", &target, "-tls1_2"])
        .args(["-alpn", "istio-peer-exchange,istio"])
        .stdin(std::process::Stdio::null())
        .output()
        .expect("openssl runs");
    let said = String::from_utf8_lossy(&refused.stderr).to_string()
        + &String::from_utf8_lossy(&refused.stdout);
    assert!(said.contains("protocol version"), "{said}");
}

/// A gateway with two TLS servers, one naming its own ciphers, and a DestinationRule originating
/// TLS to web's database port.
const TLS_CONFIG: &str = "
apiVersion: networking.istio.io/v1
kind: Gateway
metadata: {name: web, namespace: shop}
spec:
  selector: {istio: ingressgateway}
  servers:
  - port: {number: 443, name: https, protocol: HTTPS}
    hosts: ['*']
    tls: {mode: SIMPLE, serverCertificate: /etc/certs/cert.pem, privateKey: /etc/certs/key.pem, cipherSuites: [ECDHE-RSA-AES256-GCM-SHA384, RC4-MD5]}
  - port: {number: 8443, name: https-b, protocol: HTTPS}
    hosts: ['*']
    tls: {mode: SIMPLE, serverCertificate: /etc/certs/cert.pem, privateKey: /etc/certs/key.pem}
---
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {name: web, namespace: shop}
spec:
  host: web.shop.svc.cluster.local
  trafficPolicy:
    portLevelSettings:
    - port: {number: 5432}
      tls: {mode: SIMPLE, caCertificates: /etc/ca.pem}
";

const TLS_MESH: &str = "
tlsDefaults: {ecdhCurves: [P-256], cipherSuites: [ECDHE-ECDSA-AES128-GCM-SHA256], minProtocolVersion: TLSV1_3}
inboundTrafficPolicy: {mode: LOCALHOST}
caCertificates: [{pem: '', trustDomains: [partner.example]}]
";

fn downstream_params(chain: &FilterChain) -> Option<TlsParameters> {
    let socket = chain.transport_socket.as_ref()?;
    let Some(transport_socket::ConfigType::TypedConfig(any)) = &socket.config_type else {
        return None;
    };
    DownstreamTlsContext::decode(&any.value[..])
        .ok()?
        .common_tls_context?
        .tls_params
}

/// `tlsDefaults` under gateways' servers and DestinationRule TLS, `inboundTrafficPolicy:
/// LOCALHOST`, and the trust domains of `caCertificates` accepted on inbound mTLS.
#[tokio::test]
async fn tls_defaults_localhost_delivery_and_extra_trust_domains() {
    let mesh = mesh(TLS_MESH).await;
    let config = mesh._dir.path().join("config");
    std::fs::create_dir_all(&config).unwrap();
    write_atomic(&config.join("tls.yaml"), TLS_CONFIG);
    let xds = mesh.mp.xds_addr;
    let router = labelled_node(
        "router~10.1.0.9~gw-0.shop~shop.svc.cluster.local",
        &[("CLUSTER_ID", "c1")],
        &[("istio", "ingressgateway")],
    );
    let listeners = wait_for("the gateway's two servers", BOUND, || {
        let router = router.clone();
        async move {
            let listeners: Vec<Listener> = fetch(xds, router, LDS, &[]).await;
            (listeners.len() == 2).then_some(listeners)
        }
    })
    .await;
    let params = |name: &str| {
        let listener = named(&listeners, name, |l| &l.name);
        downstream_params(&listener.filter_chains[0]).expect("TLS parameters")
    };
    let own = params("0.0.0.0_443");
    assert_eq!(
        own.cipher_suites,
        ["ECDHE-RSA-AES256-GCM-SHA384"],
        "the server's own, but the one Envoy does not know (istiod's FilterCipherSuites)"
    );
    assert_eq!(own.ecdh_curves, ["P-256"]);
    assert_eq!(own.tls_minimum_protocol_version, TlsProtocol::TlSv13 as i32);
    let defaulted = params("0.0.0.0_8443");
    assert_eq!(defaulted.cipher_suites, ["ECDHE-ECDSA-AES128-GCM-SHA256"]);
    assert_eq!(
        defaulted.tls_minimum_protocol_version,
        TlsProtocol::TlSv13 as i32
    );

    let clusters: Vec<Cluster> = fetch(xds, sidecar(), CDS, &[]).await;
    let db = named(&clusters, WEB_DB, |c| &c.name);
    let Some(transport_socket::ConfigType::TypedConfig(any)) = db
        .transport_socket
        .as_ref()
        .and_then(|s| s.config_type.clone())
    else {
        panic!("no TLS toward the database: {db:?}");
    };
    let upstream = UpstreamTlsContext::decode(&any.value[..]).unwrap();
    let params = upstream.common_tls_context.unwrap().tls_params.unwrap();
    assert_eq!(params.ecdh_curves, ["P-256"]);
    assert_eq!(params.cipher_suites, ["ECDHE-ECDSA-AES128-GCM-SHA256"]);
    assert_eq!(
        params.tls_minimum_protocol_version,
        TlsProtocol::TlSv12 as i32,
        "the minimum is not applied upstream"
    );

    // LOCALHOST: the inbound cluster is the workload on 127.0.0.1, not the pod's address.
    let inbound = clusters
        .iter()
        .find(|c| c.name.starts_with("inbound|8080|"))
        .expect("the inbound cluster");
    assert!(inbound.upstream_bind_config.is_none());
    let assignment = format!("{:?}", inbound.load_assignment);
    assert!(
        assignment.contains("127.0.0.1") && assignment.contains("8080"),
        "{assignment}"
    );

    let listeners: Vec<Listener> = fetch(xds, sidecar(), LDS, &[]).await;
    let inbound = named(&listeners, "virtualInbound", |l| &l.name);
    let accepted: Vec<String> = inbound
        .filter_chains
        .iter()
        .filter_map(|c| {
            let socket = c.transport_socket.as_ref()?;
            let Some(transport_socket::ConfigType::TypedConfig(any)) = &socket.config_type else {
                return None;
            };
            let context = DownstreamTlsContext::decode(&any.value[..]).ok()?;
            let validation = context.common_tls_context?.validation_context_type?;
            let ValidationContextType::CombinedValidationContext(combined) = validation else {
                return None;
            };
            Some(format!(
                "{:?}",
                combined
                    .default_validation_context?
                    .match_typed_subject_alt_names
            ))
        })
        .collect();
    assert!(!accepted.is_empty(), "no inbound mTLS chain");
    for sans in &accepted {
        assert!(sans.contains("spiffe://partner.example/"), "{sans}");
        assert!(sans.contains("spiffe://cluster.local/"), "{sans}");
    }

    let view = get_json(mesh.mp.http_addr, "/debug/mesh").await;
    let reported = view["notApplied"].to_string();
    assert!(
        !reported.contains("caCertificates[0]"),
        "no root given: {reported}"
    );
}

/// Real traffic under `inboundTrafficPolicy: LOCALHOST`: an application listening on localhost
/// only is reached through its sidecar (under PASSTHROUGH the pod's address is, and it is not).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn localhost_delivery_reaches_an_application_on_localhost() {
    let mesh = "inboundTrafficPolicy: {mode: LOCALHOST}\n";
    let sidecars = Sidecars::start("lh", 249, mesh, Some("127.0.0.1:8080")).await;
    let (pair, server) = (&sidecars.pair, &sidecars.server);
    pair.curl_echo(&["http://10.96.77.77:8080/lh"], "/lh").await;
    assert!(
        server
            .counter("cluster.inbound|8080||.upstream_cx_total")
            .await
            >= 1
    );
}
