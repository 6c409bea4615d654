//! The TLS side of the secure xDS port: a serving certificate from our own CA, renewed before it
//! expires; client certificates verified against our root when given (as istiod's
//! VerifyClientCertIfGiven); every handshake in its own task under a timeout, so a slow or failing
//! client never holds up the listener or other connections.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use parking_lot::RwLock;
use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, RootCertStore, ServerConfig, SignatureScheme};
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch, Semaphore};
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;
use tracing::{debug, info, warn};

use super::ca::{spiffe_identities, CaError, CertificateAuthority};
use super::identity::Identity;
use super::rotation::SharedCa;
use crate::listen::Acceptor;

#[derive(Debug, Error)]
pub enum TlsError {
    #[error("serving certificate: {0}")]
    Ca(#[from] CaError),
    #[error("TLS configuration: {0}")]
    Config(String),
}

/// What the xDS and CA services learn about a secure connection.
#[derive(Clone, Debug)]
pub struct SecureConnInfo {
    pub remote: Option<SocketAddr>,
    /// The SPIFFE identity of a verified client certificate.
    pub peer: Option<Identity>,
}

/// The serving certificate, swapped in place when renewed: new handshakes get the new one, open
/// connections keep going.
#[derive(Debug)]
pub struct ServingCert {
    current: RwLock<Arc<CertifiedKey>>,
}

impl ResolvesServerCert for ServingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.read().clone())
    }
}

impl ServingCert {
    pub fn issue(
        ca: &CertificateAuthority,
        dns_names: &[String],
        ttl: Duration,
    ) -> Result<Arc<Self>, TlsError> {
        Ok(Arc::new(Self {
            current: RwLock::new(certified(ca, dns_names, ttl)?),
        }))
    }

    /// Renews at half the lifetime and whenever the root rotates, until the returned task is
    /// aborted. A failed renewal is retried with backoff until it succeeds, long before the
    /// current certificate expires.
    pub fn keep_renewed(
        self: &Arc<Self>,
        ca: Arc<SharedCa>,
        dns_names: Vec<String>,
        ttl: Duration,
    ) -> tokio::task::JoinHandle<()> {
        self.renew_with(ttl, Some(ca.roots()), move || {
            let key = certified(&ca.current(), &dns_names, ttl)?;
            info!(names = ?dns_names, "serving certificate renewed");
            Ok(key)
        })
    }

    fn renew_with(
        self: &Arc<Self>,
        ttl: Duration,
        mut roots: Option<watch::Receiver<String>>,
        issue: impl Fn() -> Result<Arc<CertifiedKey>, TlsError> + Send + 'static,
    ) -> tokio::task::JoinHandle<()> {
        let this = self.clone();
        // Retries back off up to a twentieth of the lifetime: at least ten tries before expiry.
        let max_delay = (ttl / 20).clamp(Duration::from_millis(10), Duration::from_secs(60));
        tokio::spawn(async move {
            loop {
                let rotated = async {
                    let changed = match roots.as_mut() {
                        Some(roots) => roots.changed().await.is_ok(),
                        None => false,
                    };
                    if !changed {
                        std::future::pending::<()>().await;
                    }
                };
                tokio::select! {
                    _ = tokio::time::sleep(ttl / 2) => {}
                    _ = rotated => {}
                }
                let mut delay = Duration::from_secs(1).min(max_delay);
                loop {
                    match issue() {
                        Ok(key) => {
                            *this.current.write() = key;
                            break;
                        }
                        // Keep serving the current one meanwhile.
                        Err(e) => {
                            warn!(error = %e, retry_in = ?delay, "serving certificate renewal failed");
                            tokio::time::sleep(delay).await;
                            delay = (delay * 2).min(max_delay);
                        }
                    }
                }
            }
        })
    }
}

fn certified(
    ca: &CertificateAuthority,
    dns_names: &[String],
    ttl: Duration,
) -> Result<Arc<CertifiedKey>, TlsError> {
    let (chain, key) = ca.issue_server(dns_names, ttl)?;
    let provider = rustls::crypto::CryptoProvider::get_default()
        .ok_or_else(|| TlsError::Config("no crypto provider installed".into()))?;
    let signing = provider
        .key_provider
        .load_private_key(key)
        .map_err(|e| TlsError::Config(e.to_string()))?;
    Ok(Arc::new(CertifiedKey::new(chain, signing)))
}

/// Server config: our serving certificate; client certificates optional but verified against the
/// CA's current trust bundle.
pub fn server_config(
    cert: Arc<ServingCert>,
    ca: Arc<SharedCa>,
) -> Result<Arc<ServerConfig>, TlsError> {
    let current = ca.current();
    let verifier = verifier_for(current.root_pem())?;
    let verifier = Arc::new(CurrentRootsVerifier {
        ca,
        cached: RwLock::new((current, verifier)),
    });
    let mut config = ServerConfig::builder()
        .with_client_cert_verifier(verifier)
        .with_cert_resolver(cert);
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}

fn verifier_for(root_pem: &str) -> Result<Arc<dyn ClientCertVerifier>, TlsError> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = RootCertStore::empty();
    for der in CertificateDer::pem_slice_iter(root_pem.as_bytes()) {
        let der = der.map_err(|e| TlsError::Config(e.to_string()))?;
        roots
            .add(der)
            .map_err(|e| TlsError::Config(e.to_string()))?;
    }
    WebPkiClientVerifier::builder(Arc::new(roots))
        .allow_unauthenticated()
        .build()
        .map_err(|e| TlsError::Config(e.to_string()))
}

/// Verifies client certificates against the roots the CA trusts now: rebuilt when a root rotation
/// swaps the CA, so connections made after it are checked against the new bundle.
struct CurrentRootsVerifier {
    ca: Arc<SharedCa>,
    cached: RwLock<(Arc<CertificateAuthority>, Arc<dyn ClientCertVerifier>)>,
}

impl std::fmt::Debug for CurrentRootsVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CurrentRootsVerifier")
            .finish_non_exhaustive()
    }
}

impl CurrentRootsVerifier {
    fn current(&self) -> Arc<dyn ClientCertVerifier> {
        let ca = self.ca.current();
        {
            let cached = self.cached.read();
            if Arc::ptr_eq(&cached.0, &ca) {
                return cached.1.clone();
            }
        }
        match verifier_for(ca.root_pem()) {
            Ok(verifier) => {
                *self.cached.write() = (ca, verifier.clone());
                verifier
            }
            // The CA loaded this bundle already; keep the previous roots if rustls cannot.
            Err(e) => {
                warn!(error = %e, "rotated roots unusable for client verification");
                self.cached.read().1.clone()
            }
        }
    }
}

impl ClientCertVerifier for CurrentRootsVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        false
    }

    fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
        // Hints are optional; clients send their certificate without them.
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.current()
            .verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.current().verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.current().verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.current().supported_verify_schemes()
    }
}

/// Accepts TCP connections and yields the ones whose handshake completed in time.
/// TLS handshakes run at once: each costs a task and rustls state, and a client that opens
/// connections and never finishes them should not make that unbounded (each also times out).
const HANDSHAKES_IN_FLIGHT: usize = 256;

pub fn incoming(
    mut listener: Acceptor,
    config: Arc<ServerConfig>,
    handshake_timeout: Duration,
) -> ReceiverStream<Result<SecureConn, io::Error>> {
    let (tx, rx) = mpsc::channel(128);
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    let handshakes = Arc::new(Semaphore::new(HANDSHAKES_IN_FLIGHT));
    // Ends (closing the listener) once the server reading the connections is gone.
    tokio::spawn(async move {
        loop {
            // Past the handshakes in flight, connections wait in the listen backlog.
            let Ok(permit) = handshakes.clone().acquire_owned().await else {
                return;
            };
            let (tcp, remote) = tokio::select! {
                accepted = listener.accept() => accepted,
                () = tx.closed() => return,
            };
            let (acceptor, tx) = (acceptor.clone(), tx.clone());
            tokio::spawn(async move {
                let _permit = permit;
                match tokio::time::timeout(handshake_timeout, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let peer = stream
                            .get_ref()
                            .1
                            .peer_certificates()
                            .and_then(|certs| certs.first())
                            .and_then(|leaf| spiffe_identities(leaf).into_iter().next());
                        let info = SecureConnInfo {
                            remote: Some(remote),
                            peer,
                        };
                        let _ = tx.send(Ok(SecureConn { stream, info })).await;
                    }
                    Ok(Err(e)) => debug!(%remote, error = %e, "TLS handshake failed"),
                    Err(_) => debug!(%remote, "TLS handshake timed out"),
                }
            });
        }
    });
    ReceiverStream::new(rx)
}

/// A TLS connection and what was learnt from its handshake.
pub struct SecureConn {
    stream: TlsStream<TcpStream>,
    info: SecureConnInfo,
}

impl SecureConn {
    pub fn info(&self) -> &SecureConnInfo {
        &self.info
    }
}

impl tonic::transport::server::Connected for SecureConn {
    type ConnectInfo = SecureConnInfo;

    fn connect_info(&self) -> SecureConnInfo {
        self.info.clone()
    }
}

impl AsyncRead for SecureConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for SecureConn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::security::ca::{CaBundle, TtlPolicy};

    #[tokio::test(start_paused = true)]
    async fn a_failed_renewal_is_retried_well_before_expiry() {
        crate::security::install_crypto_provider();
        let ttl = Duration::from_secs(100);
        let policy = TtlPolicy {
            default: ttl,
            max: ttl,
        };
        let ca = CertificateAuthority::new(
            &CaBundle::self_signed_root("td", crate::security::ca::ROOT_LIFETIME).unwrap(),
            policy,
        )
        .unwrap();
        let names = vec!["istiod.istio-system.svc".to_string()];
        let serving = ServingCert::issue(&ca, &names, ttl).unwrap();
        let first = serving.current.read().clone();
        let attempts = Arc::new(AtomicUsize::new(0));
        let counter = attempts.clone();
        let started = tokio::time::Instant::now();
        let task = serving.renew_with(ttl, None, move || {
            // The CA is unavailable for the first five attempts.
            if counter.fetch_add(1, Ordering::SeqCst) < 5 {
                return Err(TlsError::Config("CA unavailable".into()));
            }
            certified(&ca, &names, ttl)
        });
        while Arc::ptr_eq(&serving.current.read(), &first) {
            assert!(started.elapsed() < ttl, "not renewed before expiry");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        task.abort();
        assert_eq!(attempts.load(Ordering::SeqCst), 6);
        assert!(
            started.elapsed() < ttl * 3 / 4,
            "renewed only after {:?}",
            started.elapsed()
        );
    }
}
