//! The mesh's trust bundle over PCDS (`--multiroot-mesh`, istiod's `ISTIO_MULTIROOT_MESH`), as
//! Istio's agent asks for it: the CA's roots (Istio's sample plug-in certs), the mesh config's
//! `caCertificates` PEM (Istio's `root-cert-alt.pem`, as its ca_custom_root test uses it) and the
//! roots a SPIFFE bundle endpoint serves over HTTPS; each source followed as it changes, a bad
//! one refused or kept at its last good state. Asserted on decoded SotW and Delta responses.

mod common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine;
use common::ads::{AdsClient, DeltaClient};
use common::{get_json, node, wait_for, MeshpilotProcess};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DiscoveryRequest, DiscoveryResponse,
};
use meshpilot::xds::istio_protos::mesh::ProxyConfig;
use prost::Message;
use rustls::pki_types::pem::PemObject;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const PCDS: &str = "type.googleapis.com/istio.mesh.v1alpha1.ProxyConfig";
const BOUND: Duration = Duration::from_secs(20);

fn samples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/istio-samples-certs")
}

fn sample(file: &str) -> String {
    std::fs::read_to_string(samples().join(file)).unwrap()
}

/// A PEM's certificates as DER: what two encodings of the same roots share.
fn ders(pems: &[String]) -> BTreeSet<Vec<u8>> {
    use rustls::pki_types::CertificateDer;
    pems.iter()
        .flat_map(|pem| CertificateDer::pem_slice_iter(pem.as_bytes()))
        .map(|der| der.unwrap().to_vec())
        .collect()
}

fn ca(name: &str) -> (rcgen::Certificate, rcgen::KeyPair) {
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, name);
    let key = rcgen::KeyPair::generate().unwrap();
    (params.self_signed(&key).unwrap(), key)
}

/// A SPIFFE bundle (RFC 7517 key set) holding `root` as its X.509 authority.
fn bundle_document(root: &rcgen::Certificate) -> String {
    let x5c = base64::engine::general_purpose::STANDARD.encode(root.der());
    serde_json::json!({
        "spiffe_sequence": 1,
        "keys": [{"use": "x509-svid", "kty": "EC", "crv": "P-256", "x5c": [x5c]}],
    })
    .to_string()
}

/// An HTTPS server on 127.0.0.1 answering every request with the current body and status; its
/// certificate is signed by a web CA the test gives meshpilot as its system roots.
struct BundleServer {
    addr: SocketAddr,
    answer: Arc<Mutex<(u16, String)>>,
    web_ca: tempfile::NamedTempFile,
    task: tokio::task::JoinHandle<()>,
}

impl BundleServer {
    async fn start(body: String) -> Self {
        let (web_root, chain, key) = common::gateway_certs::issue("127.0.0.1");
        let config = rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(
                vec![rustls::pki_types::CertificateDer::from_pem_slice(chain.as_bytes()).unwrap()],
                rustls::pki_types::PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap(),
            )
            .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let answer = Arc::new(Mutex::new((200, body)));
        let served = answer.clone();
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let (acceptor, served) = (acceptor.clone(), served.clone());
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let mut head = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match tls.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    let (status, body) = served.lock().unwrap().clone();
                    let response = format!(
                        "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = tls.write_all(response.as_bytes()).await;
                    let _ = tls.shutdown().await;
                });
            }
        });
        let mut web_ca = tempfile::NamedTempFile::new().unwrap();
        std::io::Write::write_all(&mut web_ca, web_root.as_bytes()).unwrap();
        BundleServer {
            addr,
            answer,
            web_ca,
            task,
        }
    }

    fn serve(&self, status: u16, body: String) {
        *self.answer.lock().unwrap() = (status, body);
    }
}

impl Drop for BundleServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn mesh_yaml(pem: Option<&str>, bundle_url: &str) -> String {
    let mut yaml = String::from("trustDomain: cluster.local\ncaCertificates:\n");
    if let Some(pem) = pem {
        yaml.push_str("- pem: |\n");
        for line in pem.lines() {
            yaml.push_str(&format!("    {line}\n"));
        }
    }
    // No scheme: https:// is implied, as istiod reads it.
    yaml.push_str(&format!("- spiffeBundleUrl: {bundle_url}\n"));
    yaml
}

fn sidecar() -> envoy_types::pb::envoy::config::core::v3::Node {
    node("sidecar~10.1.0.5~web-0.shop~shop.svc.cluster.local", &[])
}

/// The roots of a PCDS response: its one unnamed ProxyConfig's `caCertificatesPem`.
fn roots(response: &DiscoveryResponse) -> Vec<String> {
    assert_eq!(response.type_url, PCDS);
    let [any] = response.resources.as_slice() else {
        panic!("one ProxyConfig, got {}", response.resources.len());
    };
    assert_eq!(any.type_url, PCDS);
    ProxyConfig::decode(&any.value[..])
        .unwrap()
        .ca_certificates_pem
}

/// Reads (and ACKs) PCDS responses until one carries exactly `expected` roots.
async fn until_roots(ads: &mut AdsClient, expected: &BTreeSet<Vec<u8>>, what: &str) {
    let deadline = tokio::time::Instant::now() + BOUND;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let response = ads.response(left).await;
        ads.ack(&response, Vec::new());
        if response.resources.is_empty() {
            continue;
        }
        let got = roots(&response);
        assert!(
            got.windows(2).all(|w| w[0] < w[1]),
            "roots sorted, once each: {got:?}"
        );
        if ders(&got) == *expected {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: never sent; last {} roots",
            got.len()
        );
    }
}

#[tokio::test]
async fn proxies_are_sent_the_ca_mesh_and_spiffe_roots_as_each_changes() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("clusters/c1")).unwrap();
    let (spiffe_a, _) = ca("spiffe a");
    let server = BundleServer::start(bundle_document(&spiffe_a)).await;
    let url = format!("{}/bundle", server.addr);
    let alt = sample("root-cert-alt.pem");
    let mesh_config = dir.path().join("mesh.yaml");
    std::fs::write(&mesh_config, mesh_yaml(Some(&alt), &url)).unwrap();
    let process = MeshpilotProcess::discovery(
        &[
            "--config-dir",
            dir.path().to_str().unwrap(),
            "--mesh-config",
            mesh_config.to_str().unwrap(),
            "--ca-dir",
            samples().to_str().unwrap(),
            "--multiroot-mesh",
            "--spiffe-bundle-refresh-interval",
            "1s",
        ],
        &[("SSL_CERT_FILE", server.web_ca.path().to_str().unwrap())],
    );
    let xds = process.bound_addr("xds").await;
    let admin = process.bound_addr("admin").await;
    let istio_root = sample("root-cert.pem");

    let mut ads = AdsClient::connect(xds).await.unwrap();
    ads.request(DiscoveryRequest {
        node: Some(sidecar()),
        type_url: PCDS.into(),
        ..Default::default()
    });
    let all = ders(&[istio_root.clone(), alt.clone(), spiffe_a.pem()]);
    until_roots(&mut ads, &all, "CA, mesh and SPIFFE roots").await;

    // Delta: one unnamed resource with the same roots.
    let mut delta = DeltaClient::connect(xds).await.unwrap();
    delta.request(DeltaDiscoveryRequest {
        node: Some(sidecar()),
        type_url: PCDS.into(),
        ..Default::default()
    });
    let response = delta.response(BOUND).await;
    let [resource] = response.resources.as_slice() else {
        panic!("one resource: {response:?}");
    };
    assert_eq!(resource.name, "");
    let any = resource.resource.as_ref().unwrap();
    let config = ProxyConfig::decode(&any.value[..]).unwrap();
    assert_eq!(ders(&config.ca_certificates_pem), all);

    // The endpoint serves another root: fetched on the next refresh and pushed.
    let (spiffe_b, _) = ca("spiffe b");
    server.serve(200, bundle_document(&spiffe_b));
    let rotated = ders(&[istio_root.clone(), alt.clone(), spiffe_b.pem()]);
    until_roots(&mut ads, &rotated, "the endpoint's new root").await;

    // The endpoint fails: its last good root is kept, the error shown.
    server.serve(503, "down".into());
    wait_for("the fetch error on /debug/mesh", BOUND, || async {
        let mesh = get_json(admin, "/debug/mesh").await;
        let error = mesh["trustBundle"]["spiffe"][format!("https://{url}")]["error"].clone();
        error
            .as_str()
            .filter(|e| e.contains("503"))
            .map(str::to_string)
    })
    .await;
    let fresh = common::ads::fetch::<ProxyConfig>(xds, sidecar(), PCDS, &[]).await;
    assert_eq!(ders(&fresh[0].ca_certificates_pem), rotated);

    // A leaf in caCertificates is refused by name; the last good mesh config and bundle stay.
    let leaf = rcgen::generate_simple_self_signed(vec!["leaf.example".into()])
        .unwrap()
        .cert
        .pem();
    std::fs::write(&mesh_config, mesh_yaml(Some(&leaf), &url)).unwrap();
    let error = wait_for("the leaf refused", BOUND, || async {
        let mesh = get_json(admin, "/debug/mesh").await;
        mesh["last_error"].as_str().map(str::to_string)
    })
    .await;
    assert!(
        error.contains("caCertificates[0].pem") && error.contains("not a CA certificate"),
        "{error}"
    );
    let kept = common::ads::fetch::<ProxyConfig>(xds, sidecar(), PCDS, &[]).await;
    assert_eq!(ders(&kept[0].ca_certificates_pem), rotated);

    // The PEM goes from the mesh config: pushed without it.
    server.serve(200, bundle_document(&spiffe_b));
    std::fs::write(&mesh_config, mesh_yaml(None, &url)).unwrap();
    let without = ders(&[istio_root, spiffe_b.pem()]);
    until_roots(
        &mut ads,
        &without,
        "the bundle without the mesh config's PEM",
    )
    .await;
}

#[tokio::test]
async fn without_multiroot_no_root_is_sent_and_the_roots_are_reported_not_applied() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("clusters/c1")).unwrap();
    let mesh_config = dir.path().join("mesh.yaml");
    let mesh = mesh_yaml(Some(&sample("root-cert-alt.pem")), "127.0.0.1:1/bundle");
    std::fs::write(&mesh_config, mesh).unwrap();
    let mp = common::start_meshpilot(
        dir.path(),
        &["--mesh-config", mesh_config.to_str().unwrap()],
    )
    .await;
    let sent = common::ads::fetch::<ProxyConfig>(mp.xds_addr, sidecar(), PCDS, &[]).await;
    assert!(sent.is_empty(), "{sent:?}");
    let mesh = get_json(mp.http_addr, "/debug/mesh").await;
    let fields: Vec<&str> = mesh["notApplied"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|n| n["field"].as_str())
        .collect();
    assert!(
        fields.contains(&"caCertificates[0].root") && fields.contains(&"caCertificates[1].root"),
        "{fields:?}"
    );
    assert!(mesh["trustBundle"].is_null(), "{mesh}");
}
