//! The admission webhook server the API server calls (port 15017, Service `istiod` port 443):
//! `/inject` (and `/inject/cluster/<id>/net/<network>` for remote clusters) injects sidecars,
//! `/validate` refuses invalid Istio config with the config store's message. TLS with the same
//! serving certificate as the secure xDS port (from meshpilot's CA, `istiod.<ns>.svc`); the
//! webhook configurations' `caBundle` is kept current by the leader (`ca_bundle`).

pub mod ca_bundle;
mod inject;
mod review;
mod validate;

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::routing::post;
use axum::Router;
use rustls::ServerConfig;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;

use crate::inject::InjectConfig;
use crate::listen::Acceptor;
use crate::model::Mesh;
use crate::security::tls::{self, SecureConn, ServingCert};

/// What the handlers need.
pub struct WebhookState {
    /// Injection settings; `mesh` is replaced per request by the current mesh config.
    pub inject: InjectConfig,
    /// The mesh, whose snapshot holds the mesh config in force.
    pub mesh: Arc<Mesh>,
    /// The cluster whose API server calls us, named in validation messages.
    pub cluster_id: String,
}

/// What the routes answer to a request body, without the HTTP server (for the fuzz tests).
pub use inject::respond as answer_inject;
pub use validate::respond as answer_validate;

pub fn router(state: Arc<WebhookState>) -> Router {
    Router::new()
        .route("/inject", post(inject::handle))
        .route("/inject/{*params}", post(inject::handle_with_params))
        .route("/validate", post(validate::handle))
        .with_state(state)
}

/// TLS for the API server: our serving certificate, no client certificates, HTTP/1.1.
pub fn tls_config(cert: Arc<ServingCert>) -> Arc<ServerConfig> {
    let mut config = ServerConfig::builder()
        .with_no_client_auth()
        .with_cert_resolver(cert);
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(config)
}

/// Serves the router on `listener` over TLS until the returned task is aborted.
pub fn serve(
    listener: Acceptor,
    tls: Arc<ServerConfig>,
    router: Router,
    handshake_timeout: Duration,
) -> io::Result<tokio::task::JoinHandle<()>> {
    let local = listener.local_addr()?;
    let incoming = tls::incoming(listener, tls, handshake_timeout);
    Ok(tokio::spawn(async move {
        let listener = TlsListener { incoming, local };
        if let Err(e) = axum::serve(listener, router).await {
            tracing::error!(error = %e, "webhook server stopped");
        }
    }))
}

/// Handshaken TLS connections as an axum listener.
struct TlsListener {
    incoming: ReceiverStream<Result<SecureConn, io::Error>>,
    local: SocketAddr,
}

impl axum::serve::Listener for TlsListener {
    type Io = SecureConn;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (SecureConn, SocketAddr) {
        loop {
            match self.incoming.next().await {
                Some(Ok(conn)) => {
                    let remote = conn.info().remote.unwrap_or(self.local);
                    return (conn, remote);
                }
                Some(Err(_)) => continue,
                // The acceptor task ended: nothing will ever come again.
                None => std::future::pending().await,
            }
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.local)
    }
}
