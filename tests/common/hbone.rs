//! HBONE as ztunnel speaks it, for driving waypoints and east-west gateways: mutual TLS 1.3 with
//! a mesh workload's certificate (ALPN h2), then an HTTP/2 CONNECT to an authority; the tunnel's
//! stream carries the application's bytes (or, for double HBONE, the inner tunnel).

use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Empty;
use hyper::client::conn::http2::SendRequest;
use hyper::upgrade::Upgraded;
use hyper_util::rt::{TokioExecutor, TokioIo};
use meshpilot::security::ca::spiffe_identities;
use meshpilot::security::identity::Identity;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::sds::WorkloadCerts;

/// Verifies a server's chain to the root without a DNS name check: mesh workloads are named by
/// SPIFFE URI, not DNS (Envoy checks the URI SAN instead).
#[derive(Debug)]
pub struct SpiffeVerifier(pub Arc<rustls::RootCertStore>);

impl rustls::client::danger::ServerCertVerifier for SpiffeVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &rustls::pki_types::ServerName<'_>,
        _ocsp: &[u8],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        let verifier = rustls::server::WebPkiClientVerifier::builder(self.0.clone())
            .build()
            .map_err(|e| rustls::Error::General(e.to_string()))?;
        verifier.verify_client_cert(end_entity, intermediates, now)?;
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &provider().signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &provider().signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        provider()
            .signature_verification_algorithms
            .supported_schemes()
    }
}

pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    rustls::crypto::CryptoProvider::get_default()
        .cloned()
        .expect("provider installed")
}

/// A client as a workload with `certs`: TLS 1.3, ALPN h2, peers verified to the mesh root.
pub fn mesh_client(certs: &WorkloadCerts) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(certs.root.as_bytes()).expect("root PEM"))
        .expect("root");
    let chain: Vec<CertificateDer<'static>> =
        CertificateDer::pem_slice_iter(certs.chain.as_bytes())
            .map(|c| c.expect("chain PEM"))
            .collect();
    let key = PrivateKeyDer::from_pem_slice(certs.key.as_bytes()).expect("key PEM");
    let mut config =
        rustls::ClientConfig::builder_with_protocol_versions(&[&rustls::version::TLS13])
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(SpiffeVerifier(Arc::new(roots))))
            .with_client_auth_cert(chain, key)
            .expect("client certificate");
    config.alpn_protocols = vec![b"h2".to_vec()];
    Arc::new(config)
}

/// An open tunnel: its stream, and the HTTP/2 connection it runs in (kept while it is used).
pub struct Tunnel {
    pub stream: TokioIo<Upgraded>,
    /// Who answered the TLS handshake.
    pub peer: Vec<Identity>,
    _connection: SendRequest<Empty<Bytes>>,
}

/// mTLS over `io`, then HTTP/2 CONNECT to `authority`; Err with the status (or failure) when no
/// tunnel opens.
pub async fn open<IO>(
    io: IO,
    tls: Arc<rustls::ClientConfig>,
    authority: &str,
) -> Result<Tunnel, String>
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let name = rustls::pki_types::ServerName::try_from("hbone").expect("a name");
    let tls = tokio_rustls::TlsConnector::from(tls)
        .connect(name, io)
        .await
        .map_err(|e| format!("TLS: {e}"))?;
    let peer = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|certs| certs.first())
        .map(|cert| spiffe_identities(cert))
        .unwrap_or_default();
    let (mut sender, connection) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
            .await
            .map_err(|e| format!("HTTP/2: {e}"))?;
    tokio::spawn(connection);
    let request = hyper::Request::connect(authority)
        .body(Empty::<Bytes>::new())
        .expect("a CONNECT request");
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| format!("CONNECT: {e}"))?;
    if response.status() != hyper::StatusCode::OK {
        return Err(format!("CONNECT answered {}", response.status()));
    }
    let upgraded = hyper::upgrade::on(response)
        .await
        .map_err(|e| format!("upgrade: {e}"))?;
    Ok(Tunnel {
        stream: TokioIo::new(upgraded),
        peer,
        _connection: sender,
    })
}

/// An HTTP/1.1 GET over a stream: the status and body (read to its `content-length`, so the
/// answer does not depend on how the stream closes).
pub async fn get<IO: AsyncRead + AsyncWrite + Unpin>(
    mut io: IO,
    host: &str,
    path: &str,
) -> std::io::Result<(u16, String)> {
    let request = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n");
    io.write_all(request.as_bytes()).await?;
    let mut answer = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let read = io.read(&mut chunk).await?;
        if read == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        answer.extend_from_slice(&chunk[..read]);
        let text = String::from_utf8_lossy(&answer);
        let Some((head, body)) = text.split_once("\r\n\r\n") else {
            continue;
        };
        let length = head
            .lines()
            .find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("content-length:")
                    .map(|v| v.trim().to_string())
            })
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or(0);
        if body.len() >= length {
            let status = head
                .split(' ')
                .nth(1)
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            return Ok((status, body.to_string()));
        }
    }
}
