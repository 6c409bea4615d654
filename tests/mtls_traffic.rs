//! Real traffic: an HTTP request from a client goes through its own Envoy sidecar (captured by
//! iptables, as Istio's init container sets up), over mutual TLS with meshpilot-issued certificates,
//! to the server's Envoy sidecar and its application — each workload in its own network namespace.
//! Needs root (network namespaces, iptables).

mod common;

use std::time::Duration;

use common::pair::Workloads;
use common::*;

const BOUND: Duration = Duration::from_secs(30);
const ECHO_CLUSTER: &str = "outbound|8080||echo.default.svc.cluster.local";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_between_two_sidecars_travels_over_mutual_tls() {
    let mesh = Workloads::start("", 213, &[], "").await;
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
    let mesh = Workloads::start("r", 214, &rotating, "").await;
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

/// The server's namespace disables mTLS, and the client's rule for the service sets mTLS but
/// its settings for the port replace that (istiod's merge): as istiod's, the client sends
/// plaintext, which the server's sidecar (plaintext only) serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_reaches_a_server_whose_namespace_disables_mtls() {
    let config = "
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: default, namespace: default}
spec: {mtls: {mode: DISABLE}}
---
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {name: echo, namespace: default}
spec:
  host: echo.default.svc.cluster.local
  trafficPolicy:
    tls: {mode: ISTIO_MUTUAL}
    portLevelSettings:
    - port: {number: 8080}
      connectionPool: {http: {http1MaxPendingRequests: 100}}
  subsets: [{name: v1, labels: {app: echo}}]
";
    let mesh = Workloads::start("dis", 248, &[], config).await;
    let client_envoy = mesh
        .client_sidecar(workload_certs(&mesh.mp, "default", "client"))
        .await;
    let server_envoy = mesh
        .server_sidecar(workload_certs(&mesh.mp, "default", "server"))
        .await;
    let response = mesh.call().await;
    assert!(
        response["headers"].get("x-forwarded-client-cert").is_none(),
        "plaintext: no client certificate to forward: {response}"
    );
    let handshakes = client_envoy
        .stat(&format!("cluster.{ECHO_CLUSTER}.ssl.handshake"))
        .await;
    assert_eq!(
        handshakes.unwrap_or(0),
        0,
        "the client's sidecar originated TLS"
    );
    assert_eq!(
        client_envoy.rejected_updates().await + server_envoy.rejected_updates().await,
        0
    );
}
