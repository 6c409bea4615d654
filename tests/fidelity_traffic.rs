//! Real traffic where following istiod's layout changes what happens (issue 49): each test sends
//! through Envoy sidecars in network namespaces with Istio-style capture, and checks what
//! meshpilot sent over a raw ADS stream too. Needs root.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use common::pair::Workloads;
use common::*;
use envoy_types::pb::envoy::config::cluster::v3::{cluster::DiscoveryType, Cluster};
use envoy_types::pb::envoy::config::listener::v3::Listener;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const BOUND: Duration = Duration::from_secs(30);
const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const LDS: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";

/// What meshpilot sends the pair's `role` (client or server) over a fresh ADS stream.
async fn fetch_as<T: prost::Message + Default>(
    pair: &Workloads,
    role: &str,
    type_url: &str,
) -> Vec<T> {
    let sub = if role == "client" { 1 } else { 2 };
    let id = format!(
        "sidecar~10.{}.3.{sub}~{role}.default~default.svc.cluster.local",
        pair.net
    );
    let xds = SocketAddr::from(([127, 0, 0, 1], pair.mp.xds_addr.port()));
    common::ads::fetch(xds, node(&id, &[("CLUSTER_ID", "c1")]), type_url, &[]).await
}

fn listener<'l>(listeners: &'l [Listener], name: &str) -> &'l Listener {
    listeners
        .iter()
        .find(|l| l.name == name)
        .unwrap_or_else(|| panic!("no listener {name}"))
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_string()
}

/// An EndpointSlice of `service` naming the pair's server on its port `port_yaml` (`{name, port}`).
fn server_slice(pair: &Workloads, service: &str, port_yaml: &str) -> String {
    let ip = pair.server_ip();
    format!(
        "
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: {service}-1, namespace: default, labels: {{kubernetes.io/service-name: {service}}}}}
addressType: IPv4
ports: [{port_yaml}]
endpoints:
- addresses: [{ip}]
  conditions: {{ready: true}}
  targetRef: {{kind: Pod, name: server, namespace: default}}
"
    )
}

/// istiod delivers inbound traffic to the address it was sent to, from 127.0.0.6; an application
/// that listens on its pod IP only (not on localhost) is reached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_application_listening_only_on_its_pod_ip_is_reached() {
    let mut pair = Workloads::start_bare("ip", 241, &[], "").await;
    let server_ip = pair.server_ip();
    pair.server_ns
        .serve_http_echo_at(&format!("{server_ip}:8080"));

    let clusters: Vec<Cluster> = fetch_as(&pair, "server", CDS).await;
    let inbound = clusters
        .iter()
        .find(|c| c.name == "inbound|8080||")
        .expect("the inbound cluster");
    assert_eq!(
        inbound.cluster_discovery_type,
        Some(
            envoy_types::pb::envoy::config::cluster::v3::cluster::ClusterDiscoveryType::Type(
                DiscoveryType::OriginalDst as i32
            )
        )
    );
    let bind = inbound
        .upstream_bind_config
        .as_ref()
        .and_then(|b| b.source_address.as_ref())
        .map(|a| a.address.as_str());
    assert_eq!(bind, Some("127.0.0.6"));

    let _client = pair
        .client_sidecar(workload_certs(&pair.mp, "default", "client"))
        .await;
    let _server = pair
        .server_sidecar(workload_certs(&pair.mp, "default", "server"))
        .await;
    let response = pair.call().await;
    assert_eq!(response["server"], server_ip.as_str(), "{response}");
}

/// Istio's mTLS to a port no Service declares is terminated by the server's sidecar and the
/// application gets plaintext, whether the client speaks HTTP (`istio-http/1.1`: the caller's
/// identity in XFCC) or TCP (`istio`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_to_a_port_no_service_declares_is_terminated() {
    let mut pair = Workloads::start("mt", 242, &[], "").await;
    let server_ip = pair.server_ip();
    pair.server_ns.serve_http_echo(9999);
    let _server = pair
        .server_sidecar(workload_certs(&pair.mp, "default", "server"))
        .await;

    let certs = workload_certs(&pair.mp, "default", "client");
    let dir = tempfile::tempdir().unwrap();
    let cert = write(dir.path(), "cert.pem", &certs.chain);
    let key = write(dir.path(), "key.pem", &certs.key);
    let root = write(dir.path(), "root.pem", &certs.root);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/peers/mtls_call.py");
    for alpn in ["istio-http/1.1", "istio"] {
        let body = wait_for("an answer over mTLS", BOUND, || {
            let output = pair
                .client_ns
                .command("python3")
                .args([
                    script,
                    &server_ip,
                    "9999",
                    &cert,
                    &key,
                    &root,
                    alpn,
                    "/undeclared",
                ])
                .output()
                .expect("python runs");
            async move {
                let body: serde_json::Value = serde_json::from_slice(&output.stdout).ok()?;
                (body["path"] == "/undeclared").then_some(body)
            }
        })
        .await;
        let xfcc = body["headers"]["x-forwarded-client-cert"].as_str();
        match alpn {
            "istio-http/1.1" => assert!(
                xfcc.is_some_and(|x| x.contains("spiffe://cluster.local/ns/default/sa/client")),
                "{body}"
            ),
            _ => assert_eq!(xfcc, None, "TCP passthrough adds no header: {body}"),
        }
    }
}

/// HTTPS to a TLS ServiceEntry without addresses on 443 reaches its endpoints by SNI, beside the
/// Kubernetes API service's own address on the same port; before, it passed through to whatever
/// address the name resolved to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_to_a_tls_service_entry_on_443_goes_to_its_endpoints() {
    let entry = "
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: api, namespace: default}
spec:
  hosts: [api.example.com]
  ports: [{number: 443, name: tls, protocol: TLS}]
  resolution: STATIC
  location: MESH_EXTERNAL
  endpoints: [{address: 10.{net}.3.2}]
";
    let mut pair = Workloads::start("sni", 243, &[], entry).await;
    let (ca, chain, key) = gateway_certs::issue("api.example.com");
    let dir = tempfile::tempdir().unwrap();
    let ca = write(dir.path(), "ca.pem", &ca);
    let chain = write(dir.path(), "chain.pem", &chain);
    let key = write(dir.path(), "key.pem", &key);
    pair.server_ns
        .serve_https_echo(443, Path::new(&chain), Path::new(&key), Path::new(&ca));

    let listeners: Vec<Listener> = fetch_as(&pair, "client", LDS).await;
    let https = listener(&listeners, "0.0.0.0_443");
    let matches: Vec<_> = https
        .filter_chains
        .iter()
        .filter_map(|c| c.filter_chain_match.as_ref())
        .collect();
    assert!(
        matches
            .iter()
            .any(|m| m.server_names == ["api.example.com"]),
        "{matches:?}"
    );
    assert!(
        matches.iter().any(|m| m
            .prefix_ranges
            .iter()
            .any(|r| r.address_prefix == "10.96.0.1")),
        "the Kubernetes API service keeps its address: {matches:?}"
    );
    let filters: Vec<&str> = https
        .listener_filters
        .iter()
        .map(|f| f.name.as_str())
        .collect();
    assert_eq!(filters, ["envoy.filters.listener.tls_inspector"]);

    let client = pair
        .client_sidecar(workload_certs(&pair.mp, "default", "client"))
        .await;
    let _server = pair
        .server_sidecar(workload_certs(&pair.mp, "default", "server"))
        .await;
    // The name resolves to an address nothing serves: only SNI can find the endpoint.
    let resolve = "api.example.com:443:10.96.99.99";
    let args = [
        "--resolve",
        resolve,
        "--cacert",
        &ca,
        "--cert",
        &chain,
        "--key",
        &key,
        "https://api.example.com/by-sni",
    ];
    let body = pair.curl_echo(&args, "/by-sni").await;
    assert_eq!(body["server"], pair.server_ip().as_str());
    let via = client
        .counter("cluster.outbound|443||api.example.com.upstream_cx_total")
        .await;
    assert!(via >= 1, "not through the ServiceEntry's cluster");
}

/// Bytes that are not HTTP, sent to a port where the mesh has an HTTP service, pass through to
/// where they were going (istiod sniffs the protocol); before, the HTTP connection manager got
/// them and closed the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_that_are_not_http_on_an_http_port_pass_through() {
    let pair = Workloads::start("sn", 244, &[], "").await;
    let listeners: Vec<Listener> = fetch_as(&pair, "client", LDS).await;
    let port = listener(&listeners, "0.0.0.0_8080");
    let http = port
        .filter_chains
        .iter()
        .filter_map(|c| c.filter_chain_match.as_ref())
        .find(|m| !m.application_protocols.is_empty())
        .expect("an HTTP chain matched by sniffing");
    assert_eq!(http.application_protocols, ["http/1.1", "h2c"]);
    assert_eq!(
        port.default_filter_chain.as_ref().map(|c| c.name.as_str()),
        Some("PassthroughFilterChain")
    );
    let filters: Vec<&str> = port
        .listener_filters
        .iter()
        .map(|f| f.name.as_str())
        .collect();
    assert_eq!(filters, ["envoy.filters.listener.http_inspector"]);

    // A line protocol's server outside the mesh, on the host's end of the client's link.
    let host = format!("10.{}.1.1", pair.net);
    let server = tokio::net::TcpListener::bind((host.as_str(), 8080))
        .await
        .unwrap();
    let echo = tokio::spawn(async move {
        loop {
            let Ok((mut socket, _)) = server.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut line = [0u8; 64];
                if let Ok(n) = socket.read(&mut line).await {
                    let _ = socket.write_all(&line[..n]).await;
                }
            });
        }
    });
    let client = pair
        .client_sidecar(workload_certs(&pair.mp, "default", "client"))
        .await;
    let send = "import socket,sys\n\
                s=socket.create_connection((sys.argv[1],8080),3)\n\
                s.sendall(b'PING not-http\\r\\n')\n\
                print(s.recv(64).decode())";
    wait_for("the line echoed back", BOUND, || {
        let output = pair.as_client_app("/usr/bin/python3", &["-c", send, &host]);
        async move {
            String::from_utf8_lossy(&output.stdout)
                .contains("PING not-http")
                .then_some(())
        }
    })
    .await;
    assert!(
        client
            .counter("cluster.PassthroughCluster.upstream_cx_total")
            .await
            >= 1,
        "not through PassthroughCluster"
    );
    echo.abort();
}

/// TCP to a pod of a headless service, under a STRICT PeerAuthentication, as istiod carries it: the
/// port's listener matches the pod's address and the service's ORIGINAL_DST cluster originates
/// mTLS (every endpoint has a sidecar). Passed through, it would reach the server in plaintext and
/// be refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_to_a_headless_services_pod_is_mutual_tls() {
    let strict = "
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: default, namespace: default}
spec: {mtls: {mode: STRICT}}
";
    let mut pair = Workloads::start("hl", 246, &[], strict).await;
    let server_ip = pair.server_ip();
    pair.server_ns.serve_http_echo(7000);
    let headless = format!(
        "
apiVersion: v1
kind: Service
metadata: {{name: db, namespace: default}}
spec: {{clusterIP: None, ports: [{{name: tcp-db, port: 7000}}]}}
---{}",
        server_slice(&pair, "db", "{name: tcp-db, port: 7000}")
    );
    write(&pair.config_dir().join("clusters/c1"), "db.yaml", &headless);
    let _client = pair
        .client_sidecar(workload_certs(&pair.mp, "default", "client"))
        .await;
    let _server = pair
        .server_sidecar(workload_certs(&pair.mp, "default", "server"))
        .await;
    // What the client is sent: a chain for the pod's address on the service port.
    let listeners = wait_for("the pod's chain", BOUND, || async {
        let listeners: Vec<Listener> = fetch_as(&pair, "client", LDS).await;
        listeners
            .iter()
            .any(|l| l.name == "0.0.0.0_7000")
            .then_some(listeners)
    })
    .await;
    let chain = &listener(&listeners, "0.0.0.0_7000").filter_chains[0];
    let ranges = &chain.filter_chain_match.as_ref().unwrap().prefix_ranges;
    assert_eq!(ranges[0].address_prefix, server_ip);

    let url = format!("http://{server_ip}:7000/headless");
    let body = pair.curl_echo(&[&url], "/headless").await;
    assert_eq!(body["server"], server_ip.as_str(), "{body}");
}

/// A Service port declared without a protocol is sniffed on the client side as istiod does: HTTP
/// to it is routed (its VirtualService applies), other bytes still reach the application as TCP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_on_a_port_without_a_protocol_is_routed() {
    let routes = "
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: plain, namespace: default}
spec:
  hosts: [plain.default.svc.cluster.local]
  http:
  - headers: {request: {set: {x-routed: by-virtual-service}}}
    route: [{destination: {host: plain.default.svc.cluster.local}}]
";
    let mut pair = Workloads::start("np", 247, &[], routes).await;
    // The application also listens on 9090, a port only this service declares (and without a
    // protocol): its sidecar sniffs it too.
    let server_ip = pair.server_ip();
    pair.server_ns
        .serve_http_echo_at(&format!("{server_ip}:9090"));
    let plain = format!(
        "
apiVersion: v1
kind: Service
metadata: {{name: plain, namespace: default}}
spec: {{clusterIP: 10.96.88.88, ports: [{{port: 8080, targetPort: 9090}}]}}
---{}",
        server_slice(&pair, "plain", "{port: 9090}")
    );
    write(&pair.config_dir().join("clusters/c1"), "plain.yaml", &plain);
    let _client = pair
        .client_sidecar(workload_certs(&pair.mp, "default", "client"))
        .await;
    let _server = pair
        .server_sidecar(workload_certs(&pair.mp, "default", "server"))
        .await;
    // What the client is sent: HTTP to the VIP, by sniffing, beside its TCP chain.
    let listeners = wait_for("the VIP's chains", BOUND, || async {
        let listeners: Vec<Listener> = fetch_as(&pair, "client", LDS).await;
        let vip = |l: &Listener| {
            l.filter_chains.iter().any(|c| {
                c.filter_chain_match.as_ref().is_some_and(|m| {
                    m.prefix_ranges
                        .iter()
                        .any(|r| r.address_prefix == "10.96.88.88")
                })
            })
        };
        listeners.iter().any(vip).then_some(listeners)
    })
    .await;
    let port = listener(&listeners, "0.0.0.0_8080");
    let sniffed = port.filter_chains.iter().any(|c| {
        c.filter_chain_match.as_ref().is_some_and(|m| {
            m.prefix_ranges
                .iter()
                .any(|r| r.address_prefix == "10.96.88.88")
                && m.application_protocols.iter().any(|a| a == "http/1.1")
        })
    });
    assert!(sniffed, "no HTTP chain for the VIP: {port:?}");
    let tcp = port.filter_chains.iter().any(|c| {
        c.filter_chain_match.as_ref().is_some_and(|m| {
            m.prefix_ranges
                .iter()
                .any(|r| r.address_prefix == "10.96.88.88")
                && m.application_protocols.is_empty()
        })
    });
    assert!(tcp, "no TCP chain for the VIP's other bytes: {port:?}");

    let host = "Host: plain.default.svc.cluster.local:8080";
    let body = pair
        .curl_echo(&["-H", host, "http://10.96.88.88:8080/plain"], "/plain")
        .await;
    assert_eq!(body["headers"]["x-routed"], "by-virtual-service", "{body}");
    // The VIP's HTTP has a route of its own, `<host>:<port>`, as istiod's: any Host header sent
    // to the address reaches the service (the port's shared route would pass an unknown name
    // through to the VIP itself).
    let route = port
        .filter_chains
        .iter()
        .find(|c| {
            c.filter_chain_match
                .as_ref()
                .is_some_and(|m| m.application_protocols.iter().any(|a| a == "http/1.1"))
        })
        .and_then(common::ads::rds_route);
    assert_eq!(
        route.as_deref(),
        Some("plain.default.svc.cluster.local:8080")
    );
    let body = pair
        .curl_echo(
            &[
                "-H",
                "Host: elsewhere.example",
                "http://10.96.88.88:8080/any",
            ],
            "/any",
        )
        .await;
    assert_eq!(body["headers"]["x-routed"], "by-virtual-service", "{body}");

    // Bytes that are not HTTP reach the application as they were sent: its own HTTP server
    // answers them, quoting them (a connection manager on either side would have refused them).
    let raw = "import socket\n\
        s = socket.create_connection(('10.96.88.88', 8080), timeout=3)\n\
        s.sendall(b'NOT-HTTP-7f3a\\r\\n\\r\\n')\n\
        print(s.recv(4096).decode(errors='replace'))\n";
    let answer = wait_for("the application's answer to raw bytes", BOUND, || {
        let output = pair.as_client_app("/usr/bin/python3", &["-c", raw]);
        async move {
            let text = String::from_utf8_lossy(&output.stdout).to_string();
            text.contains("NOT-HTTP-7f3a").then_some(text)
        }
    })
    .await;
    assert!(!answer.contains("istio-envoy"), "{answer}");
}
