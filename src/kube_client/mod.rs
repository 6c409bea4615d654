//! Kubernetes clients as meshpilot builds them: every request has a deadline, and every retried
//! watch backs off with jitter; kubeconfigs from Secrets are vetted before a client is built from
//! them (`kubeconfig`).

pub mod kubeconfig;
mod watch;

pub use watch::retried;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use kube::client::retry::RetryPolicy;
use kube::client::ConfigExt;
use kube::Client;
use parking_lot::RwLock;
use tower::{BoxError, ServiceBuilder};

use crate::model::ClusterId;

/// How long any request may wait for the API server's answer (its response headers; a watch's
/// events stream on after them). Far above a healthy server's slowest list page, short enough that
/// a hung one fails a call rather than stalling its caller for good.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(30);

/// A client for `config` whose every request fails after [`REQUEST_DEADLINE`] without an answer.
///
/// It speaks HTTP/2 where the API server offers it (ALPN), as client-go does: all of a cluster's
/// watches and calls share one connection instead of one TLS connection each (kube's own builder
/// is HTTP/1.1 only), which is most of a remote cluster's fixed cost. Otherwise kube's stack:
/// base URI, its retry of 429/503/504, authentication (tokens, client certificates, exec plugins
/// refreshed as they expire), extra headers. A proxy URL in the kubeconfig is refused, as before.
pub fn build(config: kube::Config) -> Result<Client, kube::Error> {
    if let Some(proxy_url) = &config.proxy_url {
        return Err(kube::Error::ProxyProtocolUnsupported {
            proxy_url: Box::new(proxy_url.clone()),
        });
    }
    let mut tcp = HttpConnector::new();
    tcp.enforce_http(false);
    tcp.set_connect_timeout(config.connect_timeout);
    let tls = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config.rustls_client_config()?)
        .https_or_http();
    let tls = match &config.tls_server_name {
        Some(name) => {
            let name = name.clone().try_into().map_err(|e| {
                kube::Error::RustlsTls(kube::client::RustlsTlsError::InvalidServerName(e))
            })?;
            tls.with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(name))
        }
        None => tls,
    };
    let connector = tls.enable_http1().enable_http2().wrap_connector(tcp);
    let http = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .timer(TokioTimer::new())
        // A dead peer of a long-lived watch connection is noticed without waiting for TCP.
        .http2_keep_alive_interval(KEEP_ALIVE)
        .http2_keep_alive_while_idle(true)
        .build(connector);
    let retry = config
        .default_retry
        .then(|| tower::retry::RetryLayer::new(RetryPolicy::server_retry()));
    let service = ServiceBuilder::new()
        .layer(tower::timeout::TimeoutLayer::new(REQUEST_DEADLINE))
        .layer(config.base_uri_layer())
        .option_layer(retry)
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(BoxError::from)
        .service(http);
    Ok(Client::new(service, config.default_namespace))
}

/// HTTP/2 PING interval on API server connections, which carry long-lived watches.
const KEEP_ALIVE: Duration = Duration::from_secs(30);

/// Kubernetes clients of the remote clusters, for components that must call them (TokenReview).
#[derive(Clone, Default)]
pub struct RemoteClients(Arc<RwLock<HashMap<ClusterId, Client>>>);

impl RemoteClients {
    pub fn get(&self, id: &ClusterId) -> Option<Client> {
        self.0.read().get(id).cloned()
    }

    pub fn all(&self) -> Vec<(ClusterId, Client)> {
        self.0
            .read()
            .iter()
            .map(|(id, c)| (id.clone(), c.clone()))
            .collect()
    }

    /// Sets (or, with None, forgets) a remote cluster's client: the remote Secret controller's job.
    pub fn set(&self, id: &ClusterId, client: Option<Client>) {
        let mut clients = self.0.write();
        match client {
            Some(c) => clients.insert(id.clone(), c),
            None => clients.remove(id),
        };
    }
}

/// The API servers meshpilot can call, by cluster: the config cluster's and the remotes'. Empty
/// when meshpilot reads only files.
#[derive(Clone, Default)]
pub struct ClusterClients {
    config: Option<(ClusterId, Client)>,
    remotes: Option<RemoteClients>,
}

impl ClusterClients {
    pub fn new(config: Option<(ClusterId, Client)>, remotes: Option<RemoteClients>) -> Self {
        Self { config, remotes }
    }

    /// No API server at all: clusters come from files.
    pub fn is_empty(&self) -> bool {
        self.config.is_none()
    }

    pub fn config_cluster(&self) -> Option<&ClusterId> {
        self.config.as_ref().map(|(id, _)| id)
    }

    /// The client of a cluster, the config cluster's or a remote's.
    pub fn get(&self, id: &ClusterId) -> Option<Client> {
        match &self.config {
            Some((config, client)) if config == id => Some(client.clone()),
            _ => self.remotes.as_ref().and_then(|r| r.get(id)),
        }
    }
}
