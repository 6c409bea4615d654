//! Real traffic: an HTTP request from a client goes through its own Envoy sidecar (captured by
//! iptables, as Istio's init container sets up), over mutual TLS with meshpilot-issued certificates,
//! to the server's Envoy sidecar and its application — each workload in its own network namespace.
//! Needs root (network namespaces, iptables).

mod common;

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use common::netns::{link, Netns};
use common::*;

const BOUND: Duration = Duration::from_secs(30);
const ECHO_CLUSTER: &str = "outbound|8080||echo.default.svc.cluster.local";
/// The client application's uid: only its traffic is captured (Envoy's own is not).
const APP_UID: &str = "1000";

fn manifests(client_ip: &str, server_ip: &str) -> String {
    format!(
        "
apiVersion: v1
kind: Service
metadata: {{name: echo, namespace: default}}
spec: {{clusterIP: 10.96.77.77, ports: [{{name: http, port: 8080}}]}}
---
apiVersion: v1
kind: Pod
metadata: {{name: server, namespace: default, labels: {{app: echo, security.istio.io/tlsMode: istio}}}}
spec: {{serviceAccountName: server, containers: []}}
status: {{podIP: {server_ip}}}
---
apiVersion: v1
kind: Pod
metadata: {{name: client, namespace: default, labels: {{app: client, security.istio.io/tlsMode: istio}}}}
spec: {{serviceAccountName: client, containers: []}}
status: {{podIP: {client_ip}}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: echo-1, namespace: default, labels: {{kubernetes.io/service-name: echo}}}}
addressType: IPv4
ports: [{{name: http, port: 8080}}]
endpoints:
- addresses: [{server_ip}]
  conditions: {{ready: true}}
  targetRef: {{kind: Pod, name: server, namespace: default}}
"
    )
}

/// A client and a server workload, each in its own network namespace with Istio-style capture,
/// on subnets `10.<net>.1-3.*`, and meshpilot serving them (with `extra` flags).
struct Workloads {
    client_ns: Netns,
    server_ns: Netns,
    mp: meshpilot::app::Running,
    net: u8,
    _dir: tempfile::TempDir,
}

const CLIENT_NODE: &str = "sidecar~{ip}~client.default~default.svc.cluster.local";
const SERVER_NODE: &str = "sidecar~{ip}~server.default~default.svc.cluster.local";

impl Workloads {
    async fn start(name: &str, net: u8, extra: &[&str]) -> Workloads {
        let tag = std::process::id() % 100_000;
        let client_ns = Netns::create(&format!("mpc{tag}{name}"));
        let mut server_ns = Netns::create(&format!("mps{tag}{name}"));
        // Control links to the host (xDS, SDS, admin) and one data link between the workloads.
        let cidr = |sub: u8, host: u8, len: u8| format!("10.{net}.{sub}.{host}/{len}");
        link(
            None,
            &format!("mpc{tag}{name}h"),
            &cidr(1, 1, 30),
            &client_ns,
            "ctl",
            &cidr(1, 2, 30),
        );
        link(
            None,
            &format!("mps{tag}{name}h"),
            &cidr(2, 1, 30),
            &server_ns,
            "ctl",
            &cidr(2, 2, 30),
        );
        link(
            Some(&client_ns),
            "data",
            &cidr(3, 1, 24),
            &server_ns,
            "data",
            &cidr(3, 2, 24),
        );
        client_ns.run("ip", &["route", "add", "10.96.0.0/16", "dev", "data"]);
        // Istio-style capture: the client app's outbound TCP to 15001, the server's inbound to 15006.
        client_ns.capture_outbound(APP_UID);
        server_ns.capture_inbound("data");
        server_ns.serve_http_echo(8080);

        let dir = tempfile::tempdir().unwrap();
        let cluster = dir.path().join("clusters/c1");
        std::fs::create_dir_all(&cluster).unwrap();
        std::fs::write(
            cluster.join("echo.yaml"),
            manifests(&format!("10.{net}.3.1"), &format!("10.{net}.3.2")),
        )
        .unwrap();
        let mut flags = vec!["--xds-addr", "0.0.0.0:0"];
        flags.extend_from_slice(extra);
        let mp = start_meshpilot(dir.path(), &flags).await;
        Workloads {
            client_ns,
            server_ns,
            mp,
            net,
            _dir: dir,
        }
    }

    /// The client's sidecar, holding `certs`.
    async fn client_sidecar(&self, certs: WorkloadCerts) -> Envoy {
        self.sidecar(&self.client_ns, 1, CLIENT_NODE, certs).await
    }

    /// The server's sidecar, holding `certs`.
    async fn server_sidecar(&self, certs: WorkloadCerts) -> Envoy {
        let envoy = self.sidecar(&self.server_ns, 2, SERVER_NODE, certs).await;
        wait_for("server sidecar has its inbound listener", BOUND, || {
            let envoy = &envoy;
            async move {
                envoy
                    .get("/listeners")
                    .await
                    .contains("virtualInbound")
                    .then_some(())
            }
        })
        .await;
        envoy
    }

    async fn sidecar(&self, ns: &Netns, sub: u8, node: &str, certs: WorkloadCerts) -> Envoy {
        let net = self.net;
        let workload_ip = format!("10.{net}.3.{sub}");
        let node_id: &'static str = Box::leak(node.replace("{ip}", &workload_ip).into_boxed_str());
        let host_ip: IpAddr = format!("10.{net}.{sub}.1").parse().unwrap();
        let envoy = Envoy::start_with(EnvoyOptions {
            xds: SocketAddr::new(host_ip, self.mp.xds_addr.port()),
            replicas: &[],
            node_id,
            metadata: &[("CLUSTER_ID", "c1")],
            labels: &[],
            mode: AdsMode::Sotw,
            workload: certs,
            xds_tls: None,
            netns: Some(InNetns {
                name: ns.name.clone(),
                ip: format!("10.{net}.{sub}.2").parse().unwrap(),
                host_ip,
            }),
        })
        .await;
        if sub == 1 {
            let server = format!("10.{net}.3.2:8080");
            wait_for("client sidecar knows the server", BOUND, || {
                let (envoy, server) = (&envoy, &server);
                async move { (envoy.endpoints(ECHO_CLUSTER).await == [server.as_str()]).then_some(()) }
            })
            .await;
        }
        envoy
    }

    /// The echo server's answer to the client application calling the service by name and VIP,
    /// as a Kubernetes client would.
    async fn call(&self) -> serde_json::Value {
        wait_for("a response through both sidecars", BOUND, || {
            let output = self
                .client_ns
                .command("setpriv")
                .args([
                    "--reuid",
                    APP_UID,
                    "--regid",
                    APP_UID,
                    "--clear-groups",
                    "curl",
                    "-s",
                    "-m",
                    "3",
                ])
                .args([
                    "-H",
                    "Host: echo.default.svc.cluster.local:8080",
                    "http://10.96.77.77:8080/hello",
                ])
                .output();
            async move {
                let output = output.ok()?;
                let body: serde_json::Value = serde_json::from_slice(&output.stdout).ok()?;
                (body["path"] == "/hello").then_some(body)
            }
        })
        .await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_between_two_sidecars_travels_over_mutual_tls() {
    let mesh = Workloads::start("", 213, &[]).await;
    let client_envoy = mesh
        .client_sidecar(workload_certs(&mesh.mp, "default", "client"))
        .await;
    let server_envoy = mesh
        .server_sidecar(workload_certs(&mesh.mp, "default", "server"))
        .await;
    let response = mesh.call().await;

    let xfcc = response["headers"]["x-forwarded-client-cert"]
        .as_str()
        .unwrap_or_default();
    assert!(
        xfcc.contains("URI=spiffe://cluster.local/ns/default/sa/client"),
        "the server's sidecar did not see the client's certificate: {response}"
    );
    let handshakes = server_envoy
        .counter("listener.0.0.0.0_15006.ssl.handshake")
        .await;
    assert!(
        handshakes >= 1,
        "no TLS handshake on the server's inbound listener"
    );
    assert_eq!(
        server_envoy
            .counter("listener.0.0.0.0_15006.ssl.no_certificate")
            .await,
        0
    );
    assert!(
        client_envoy
            .counter(&format!("cluster.{ECHO_CLUSTER}.ssl.handshake"))
            .await
            >= 1,
        "the client's sidecar did not originate TLS"
    );
    assert_eq!(
        client_envoy.rejected_updates().await + server_envoy.rejected_updates().await,
        0
    );
}

/// When a certificate expires (Unix seconds).
fn not_after(pem: &str) -> i64 {
    use x509_parser::prelude::{FromDer, X509Certificate};
    let der = rustls::pki_types::pem::PemObject::from_pem_slice(pem.as_bytes())
        .map(|d: rustls::pki_types::CertificateDer<'static>| d)
        .unwrap();
    let (_, cert) = X509Certificate::from_der(&der).unwrap();
    cert.validity().not_after.timestamp()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traffic_keeps_flowing_across_a_self_signed_root_rotation() {
    // A 12 s root renewed with half its life left: the first rotation comes ~5 s after start.
    let rotating = [
        "--self-signed-root-ttl",
        "12s",
        "--self-signed-root-grace-percent",
        "50",
        "--self-signed-root-check-interval",
        "200ms",
    ];
    let mesh = Workloads::start("r", 214, &rotating).await;
    let first_root = mesh.mp.ca.current().root_pem().to_string();
    assert_eq!(first_root.matches("BEGIN CERTIFICATE").count(), 1);
    // Before: certificates of the first root, each side trusting that root alone (as a proxy
    // that has not seen the rotation yet).
    let old_certs = |account: &str| WorkloadCerts {
        root: first_root.clone(),
        ..workload_certs(&mesh.mp, "default", account)
    };
    let (client_old, server_old) = (old_certs("client"), old_certs("server"));
    let client_envoy = mesh.client_sidecar(client_old).await;
    let server_envoy = mesh.server_sidecar(server_old).await;
    mesh.call().await;

    // The rotation: a new root first in the bundle, the old one still trusted.
    let bundle = wait_for("the root renewed", BOUND, || async {
        let bundle = mesh.mp.ca.current().root_pem().to_string();
        (bundle.matches("BEGIN CERTIFICATE").count() >= 2).then_some(bundle)
    })
    .await;
    assert!(!bundle.starts_with(&first_root) && bundle.contains(&first_root));
    let (chain, _) = mesh
        .mp
        .ca
        .current()
        .issue_workload(
            &meshpilot::security::identity::Identity::new("cluster.local", "default", "x"),
            Duration::from_secs(60),
        )
        .unwrap();
    assert_eq!(
        chain.last(),
        Some(&bundle),
        "responses end with every trusted root"
    );

    // During: the server moves to a certificate of the new root and trusts both; the client
    // still holds the old root's certificate and trusts only the old root.
    drop(server_envoy);
    let server_envoy = mesh
        .server_sidecar(workload_certs(&mesh.mp, "default", "server"))
        .await;
    mesh.call().await;

    // After: the first root has expired; the client moves too, and traffic flows.
    let expiry = not_after(&first_root);
    wait_for("the first root expired", BOUND, || async {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64;
        (now > expiry).then_some(())
    })
    .await;
    drop(client_envoy);
    let client_envoy = mesh
        .client_sidecar(workload_certs(&mesh.mp, "default", "client"))
        .await;
    let response = mesh.call().await;
    assert!(response["headers"]["x-forwarded-client-cert"]
        .as_str()
        .unwrap_or_default()
        .contains("sa/client"));
    assert_eq!(
        client_envoy.rejected_updates().await + server_envoy.rejected_updates().await,
        0
    );
}
