//! Documents fetched over HTTP(S) for the snapshot (JWT key sets, SPIFFE trust bundles): servers
//! verified against the system's roots, as istiod's Go client does; every request under a deadline
//! and a size bound.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// Largest document accepted.
const MAX_DOCUMENT: usize = 1 << 20;

pub type HttpClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, Empty<Bytes>>;

/// A client trusting the system's roots (`SSL_CERT_FILE` and `SSL_CERT_DIR` name others); a
/// missing bundle only makes HTTPS sources fail.
pub fn http_client() -> HttpClient {
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_native_certs::load_native_certs().certs {
        let _ = roots.add(cert);
    }
    let tls = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .build();
    Client::builder(TokioExecutor::new()).build(connector)
}

/// GETs a JSON document; errors name the URI and the cause, bounded in size.
pub async fn get(client: &HttpClient, uri: &str, timeout: Duration) -> Result<String, String> {
    let request = http::Request::get(uri)
        .header(http::header::ACCEPT, "application/json")
        .body(Empty::new())
        .map_err(|e| format!("{uri}: {e}"))?;
    let exchange = async {
        let response = client
            .request(request)
            .await
            .map_err(|e| format!("GET {uri}: {}", error_chain(&e)))?;
        let status = response.status();
        if !status.is_success() {
            return Err(format!("GET {uri}: {status}"));
        }
        let body = Limited::new(response.into_body(), MAX_DOCUMENT)
            .collect()
            .await
            .map_err(|e| format!("GET {uri}: {e}"))?
            .to_bytes();
        String::from_utf8(body.to_vec()).map_err(|_| format!("GET {uri}: not UTF-8"))
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| format!("GET {uri}: no answer within {timeout:?}"))?
}

/// First retry of a failed fetch; doubled each time, up to the refresh interval.
const FIRST_RETRY: Duration = Duration::from_secs(1);

/// When to retry after `failures` failed fetches in a row (at least one).
pub fn retry_after(failures: u32, refresh: Duration) -> Duration {
    FIRST_RETRY
        .saturating_mul(1 << failures.saturating_sub(1).min(16))
        .min(refresh)
}

/// Sleeps until `at`; forever without one.
pub async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// An error with its causes ("connection refused" sits a few levels down).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    crate::text::clip(&text)
}
