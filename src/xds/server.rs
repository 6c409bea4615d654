//! The ADS gRPC service (SotW and Delta) and the per-connection sessions it runs.
//!
//! Each stream is one task owning its protocol state; it answers requests and takes pushes from its
//! `PushSlot`. Work for a push runs under a global permit (the push concurrency limit); responses are
//! assembled from cached encoded resources and queued on the stream in the order they were built.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::SystemTime;

use bytes::Bytes;
use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DiscoveryRequest};
use parking_lot::{Mutex, RwLock};
use serde::Serialize;
use tokio::sync::mpsc::{self, UnboundedSender};
use tokio::sync::Semaphore;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::codegen::{http, Body, BoxFuture, Service, StdError};
use tonic::server::{Grpc, NamedService, StreamingService};
use tonic::{Status, Streaming};
use tracing::{debug, info, warn};

use super::generate::{cluster_host, Generation, ResourceCache};
use super::protocol::{
    Action, DeltaRequest, DeltaStream, ResourceType, Scope, SotwStream, TypeStatus,
};
use super::proxy::Proxy;
use super::push::{plan, PushRequest, PushSlot};
use super::wire::{self, AdsCodec};
use crate::metrics::XdsMetrics;
use crate::model::{Change, Hostname, Mesh};
use crate::security::authn::{Authenticator, Credentials};

const SOTW_PATH: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources";
const DELTA_PATH: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources";

/// Shared state of the xDS server.
/// Whether the model is complete enough to serve (every cluster loaded or given up on).
pub type Readiness = Arc<dyn Fn() -> bool + Send + Sync>;

pub struct XdsServer {
    mesh: Arc<Mesh>,
    ready: Readiness,
    cache: ResourceCache,
    connections: RwLock<HashMap<u64, Arc<Connection>>>,
    push_permits: Semaphore,
    next_id: AtomicU64,
    /// Bumped on every debounced push; SotW `version_info` and Delta `system_version_info`.
    version: AtomicU64,
    version_text: RwLock<(u64, Arc<str>)>,
    nonces: AtomicU64,
    metrics: XdsMetrics,
}

/// One connected proxy, as the push fan-out and /debug/syncz see it.
pub struct Connection {
    pub id: u64,
    pub proxy: Proxy,
    pub delta: bool,
    pub connected_at: SystemTime,
    slot: PushSlot,
    /// Hostnames behind the proxy's EDS subscriptions: an endpoint change wakes only these proxies.
    eds_hosts: RwLock<BTreeSet<Hostname>>,
    /// The subscription generation `eds_hosts` was derived from.
    eds_generation: AtomicU64,
    status: Mutex<BTreeMap<ResourceType, TypeStatus>>,
}

impl Connection {
    fn wants_eds_of(&self, services: &BTreeSet<Hostname>) -> bool {
        let hosts = self.eds_hosts.read();
        services.iter().any(|s| hosts.contains(s))
    }

    fn set_eds_names<'a>(&self, names: impl Iterator<Item = &'a String>) {
        *self.eds_hosts.write() = names
            .filter_map(|n| cluster_host(n))
            .map(Hostname::from)
            .collect();
    }
}

impl XdsServer {
    pub fn new(
        mesh: Arc<Mesh>,
        ready: Readiness,
        push_concurrency: usize,
        metrics: XdsMetrics,
    ) -> Arc<Self> {
        Arc::new(Self {
            mesh,
            ready,
            cache: ResourceCache::default(),
            connections: RwLock::default(),
            push_permits: Semaphore::new(push_concurrency.max(1)),
            next_id: AtomicU64::new(1),
            version: AtomicU64::new(1),
            version_text: RwLock::new((1, Arc::from("1"))),
            nonces: AtomicU64::new(0),
            metrics,
        })
    }

    pub fn cache(&self) -> &ResourceCache {
        &self.cache
    }

    pub fn connection_count(&self) -> usize {
        self.connections.read().len()
    }

    /// Fans a debounced change out to the proxies it concerns.
    pub fn push(&self, change: Change) {
        let version = self.version.fetch_add(1, Ordering::AcqRel) + 1;
        if change.full {
            self.cache.prune(self.mesh.services.version());
        }
        let request = PushRequest::from(change);
        let mut woken = 0;
        for conn in self.connections.read().values() {
            if request.full || conn.wants_eds_of(&request.services) {
                conn.slot.offer(request.clone());
                woken += 1;
            }
        }
        debug!(
            version,
            full = request.full,
            services = request.services.len(),
            proxies = woken,
            "push"
        );
    }

    /// The gRPC service for the plaintext port: callers are not authenticated (as istiod's 15010).
    pub fn service(self: &Arc<Self>) -> AdsService {
        AdsService {
            server: self.clone(),
            authn: None,
        }
    }

    /// The gRPC service for the TLS port: every stream proves an identity that must match its node.
    pub fn secure_service(self: &Arc<Self>, authn: Arc<Authenticator>) -> AdsService {
        AdsService {
            server: self.clone(),
            authn: Some(authn),
        }
    }

    pub fn syncz(&self) -> Vec<SyncView> {
        let mut views: Vec<SyncView> = self
            .connections
            .read()
            .values()
            .map(|c| SyncView {
                connection: c.id,
                proxy: c.proxy.id.clone(),
                cluster: c.proxy.cluster_id.as_ref().map(|c| c.to_string()),
                network: c.proxy.network.to_string(),
                mode: if c.delta { "delta" } else { "sotw" },
                connected_at: humantime::format_rfc3339_seconds(c.connected_at).to_string(),
                types: c.status.lock().clone(),
            })
            .collect();
        views.sort_by_key(|v| v.connection);
        views
    }

    fn connect(&self, proxy: Proxy, delta: bool) -> Arc<Connection> {
        let conn = Arc::new(Connection {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            proxy,
            delta,
            connected_at: SystemTime::now(),
            slot: PushSlot::default(),
            eds_hosts: RwLock::default(),
            eds_generation: AtomicU64::new(0),
            status: Mutex::default(),
        });
        self.connections.write().insert(conn.id, conn.clone());
        self.metrics.connections.inc();
        info!(proxy = %conn.proxy.id, connection = conn.id, delta, "proxy connected");
        conn
    }

    fn disconnect(&self, conn: &Connection) {
        self.connections.write().remove(&conn.id);
        self.metrics.connections.dec();
        info!(proxy = %conn.proxy.id, connection = conn.id, "proxy disconnected");
    }

    fn next_nonce(&self) -> Arc<str> {
        format!("{:x}", self.nonces.fetch_add(1, Ordering::Relaxed) + 1).into()
    }

    /// The current push version, formatted once per push rather than once per response.
    fn current_version(&self) -> Arc<str> {
        let version = self.version.load(Ordering::Acquire);
        let cached = self.version_text.read().clone();
        if cached.0 == version {
            return cached.1;
        }
        let text: Arc<str> = version.to_string().into();
        *self.version_text.write() = (version, text.clone());
        text
    }

    fn generation<'a>(&'a self, proxy: &'a Proxy) -> Generation<'a> {
        Generation::new(&self.mesh, &self.cache, proxy)
    }
}

/// One row of /debug/syncz.
#[derive(Serialize)]
pub struct SyncView {
    pub connection: u64,
    pub proxy: String,
    pub cluster: Option<String>,
    pub network: String,
    pub mode: &'static str,
    pub connected_at: String,
    pub types: BTreeMap<ResourceType, TypeStatus>,
}

type ResponseTx = UnboundedSender<Result<Bytes, Status>>;

/// Waits for the first request, identifies the proxy, and runs its session until the stream ends.
async fn serve<Req, S>(
    server: Arc<XdsServer>,
    mut requests: Streaming<Req>,
    tx: ResponseTx,
    delta: bool,
    auth: Option<(Arc<Authenticator>, Credentials)>,
    new_session: S,
) where
    S: FnOnce(Arc<XdsServer>, Arc<Connection>, ResponseTx) -> Box<dyn Session<Req>>,
    Req: NodeOf,
{
    if !(server.ready)() {
        // As istiod: a proxy must not get a partial view while clusters are still syncing.
        let _ = tx.send(Err(Status::unavailable(
            "meshpilot is not ready: clusters are still syncing",
        )));
        return;
    }
    let first = match requests.message().await {
        Ok(Some(first)) => first,
        _ => return,
    };
    let proxy = match Proxy::from_node(first.node()) {
        Ok(proxy) => proxy,
        Err(e) => {
            warn!(error = %e, "refusing xDS stream");
            let _ = tx.send(Err(Status::invalid_argument(e.to_string())));
            return;
        }
    };
    if let Some((authn, credentials)) = auth {
        if let Err(status) = authorize(&authn, &credentials, &proxy).await {
            warn!(proxy = %proxy.id, %status, "refusing xDS stream");
            let _ = tx.send(Err(status));
            return;
        }
    }
    let conn = server.connect(proxy, delta);
    let mut session = new_session(server.clone(), conn.clone(), tx);
    let mut open = session.on_request(first);
    while open {
        tokio::select! {
            message = requests.message() => match message {
                Ok(Some(request)) => open = session.on_request(request),
                Ok(None) => break,
                Err(status) => {
                    debug!(proxy = %conn.proxy.id, %status, "stream ended");
                    break;
                }
            },
            _ = conn.slot.ready() => {
                if let Some(request) = conn.slot.take() {
                    let Ok(_permit) = server.push_permits.acquire().await else { break };
                    open = session.push(request);
                }
            }
        }
    }
    server.disconnect(&conn);
}

/// The caller's proven identity must be the proxy's: same namespace, and same service account when
/// the node names one (Istio's XDS identity check).
async fn authorize(
    authn: &Authenticator,
    credentials: &Credentials,
    proxy: &Proxy,
) -> Result<(), Status> {
    let identity = authn.authenticate(credentials).await?;
    let account_ok = proxy
        .service_account
        .as_ref()
        .is_none_or(|sa| *sa == identity.service_account);
    if identity.namespace != *proxy.namespace || !account_ok {
        return Err(Status::permission_denied(format!(
            "identity {identity} may not act as proxy {} in namespace {}",
            proxy.id, proxy.namespace
        )));
    }
    Ok(())
}

trait NodeOf: Send + 'static {
    fn node(&self) -> Option<&envoy_types::pb::envoy::config::core::v3::Node>;
}

impl NodeOf for DiscoveryRequest {
    fn node(&self) -> Option<&envoy_types::pb::envoy::config::core::v3::Node> {
        self.node.as_ref()
    }
}

impl NodeOf for DeltaDiscoveryRequest {
    fn node(&self) -> Option<&envoy_types::pb::envoy::config::core::v3::Node> {
        self.node.as_ref()
    }
}

/// A protocol variant's session; each method returns false once the stream is gone.
trait Session<Req>: Send {
    fn on_request(&mut self, request: Req) -> bool;
    fn respond(&mut self, ty: ResourceType, scope: &Scope) -> bool;
    fn watched(&self) -> Vec<ResourceType>;
    /// The EDS resources the proxy subscribes to, and the generation of that subscription.
    fn eds_names(&self) -> Vec<String>;
    fn eds_generation(&self) -> u64;
    fn status_of(&self, ty: ResourceType) -> Option<TypeStatus>;
    fn handles(&self) -> (Arc<XdsServer>, Arc<Connection>);

    /// Makes a type's protocol status visible to /debug/syncz.
    fn publish_status(&self, ty: ResourceType) {
        if let Some(status) = self.status_of(ty) {
            self.handles().1.status.lock().insert(ty, status);
        }
    }

    /// What follows every request: the push fan-out's view of the EDS subscription (recomputed only
    /// when the subscription changed, not on every ACK), the action, the status.
    fn conclude(&mut self, ty: ResourceType, action: Action, scope: &Scope) -> bool {
        let (server, conn) = self.handles();
        let generation = self.eds_generation();
        if ty == ResourceType::Endpoint
            && conn.eds_generation.swap(generation, Ordering::Relaxed) != generation
        {
            conn.set_eds_names(self.eds_names().iter());
        }
        let open = self.act(&server, &conn.proxy.id, ty, action, scope);
        self.publish_status(ty);
        open
    }

    /// Sends what a push request means for this stream.
    fn push(&mut self, request: PushRequest) -> bool {
        let (watched, eds) = (self.watched(), self.eds_names());
        plan(&request, &watched, eds.into_iter())
            .into_iter()
            .all(|(ty, scope)| self.respond(ty, &scope))
    }

    /// Carries out what the protocol decided for one request.
    fn act(
        &mut self,
        server: &XdsServer,
        proxy: &str,
        ty: ResourceType,
        action: Action,
        scope: &Scope,
    ) -> bool {
        match action {
            Action::Respond => self.respond(ty, scope),
            Action::Nack(message) => {
                server.metrics.nacked(ty);
                warn!(proxy, r#type = ty.short(), error = message, "NACK");
                true
            }
            Action::Ack | Action::Ignore => true,
        }
    }
}

struct SotwSession {
    server: Arc<XdsServer>,
    conn: Arc<Connection>,
    stream: SotwStream,
    tx: ResponseTx,
}

impl SotwSession {
    /// Builds and queues this type's response.
    fn send(&mut self, ty: ResourceType, scope: &Scope) -> bool {
        let Some(watch) = self.stream.watches.get(&ty) else {
            return true;
        };
        let generation = self.server.generation(&self.conn.proxy);
        let resources = if watch.wildcard {
            generation.all(ty)
        } else {
            generation.named(ty, watch.names.iter().filter(|n| scope.contains(n)))
        };
        let (version, nonce) = (self.server.current_version(), self.server.next_nonce());
        let bytes = wire::sotw_response(ty.url(), &version, &nonce, &resources);
        self.stream.sent(ty, &version, &nonce, resources.len());
        self.publish_status(ty);
        self.server.metrics.pushed(ty);
        debug!(proxy = %self.conn.proxy.id, r#type = ty.short(), version = &*version, resources = resources.len(), "sent");
        self.tx.send(Ok(bytes)).is_ok()
    }
}

impl Session<DiscoveryRequest> for SotwSession {
    fn on_request(&mut self, request: DiscoveryRequest) -> bool {
        let Some(ty) = ResourceType::from_url(&request.type_url) else {
            debug!(proxy = %self.conn.proxy.id, type_url = request.type_url, "ignoring unsupported type");
            return true;
        };
        let error = request.error_detail.map(|e| e.message);
        let action = self.stream.on_request(
            ty,
            request.resource_names,
            &request.response_nonce,
            &request.version_info,
            error,
        );
        self.conclude(ty, action, &Scope::All)
    }

    fn respond(&mut self, ty: ResourceType, scope: &Scope) -> bool {
        self.send(ty, scope)
    }

    fn watched(&self) -> Vec<ResourceType> {
        self.stream.watches.keys().copied().collect()
    }

    fn eds_names(&self) -> Vec<String> {
        let watch = self.stream.watches.get(&ResourceType::Endpoint);
        watch
            .map(|w| w.names.iter().cloned().collect())
            .unwrap_or_default()
    }

    fn eds_generation(&self) -> u64 {
        self.stream
            .watches
            .get(&ResourceType::Endpoint)
            .map_or(0, |w| w.generation)
    }

    fn status_of(&self, ty: ResourceType) -> Option<TypeStatus> {
        self.stream.watches.get(&ty).map(|w| w.status.clone())
    }

    fn handles(&self) -> (Arc<XdsServer>, Arc<Connection>) {
        (self.server.clone(), self.conn.clone())
    }
}

struct DeltaSession {
    server: Arc<XdsServer>,
    conn: Arc<Connection>,
    stream: DeltaStream,
    tx: ResponseTx,
}

impl DeltaSession {
    /// Builds and queues this type's changes, if there are any (always on its first response).
    fn send(&mut self, ty: ResourceType, scope: &Scope) -> bool {
        let server = self.server.clone();
        let generation = server.generation(&self.conn.proxy);
        let Some(watch) = self.stream.watches.get_mut(&ty) else {
            return true;
        };
        let first = watch.status.sent_nonce.is_none();
        let (current, considered) = if watch.wildcard && *scope == Scope::All {
            (generation.all(ty), Scope::All)
        } else {
            let names: BTreeSet<String> = watch
                .subscribed
                .iter()
                .filter(|n| scope.contains(n))
                .cloned()
                .collect();
            (generation.named(ty, names.iter()), Scope::Names(names))
        };
        let (changed, removed) = watch.diff(&considered, current);
        if changed.is_empty() && removed.is_empty() && !first {
            return true;
        }
        let (version, nonce) = (server.current_version(), server.next_nonce());
        let bytes = wire::delta_response(ty.url(), &version, &nonce, &changed, &removed);
        self.stream.sent(ty, &version, &nonce);
        self.publish_status(ty);
        server.metrics.pushed(ty);
        debug!(proxy = %self.conn.proxy.id, r#type = ty.short(), version = &*version, changed = changed.len(), removed = removed.len(), "sent");
        self.tx.send(Ok(bytes)).is_ok()
    }
}

impl Session<DeltaDiscoveryRequest> for DeltaSession {
    fn on_request(&mut self, request: DeltaDiscoveryRequest) -> bool {
        let Some(ty) = ResourceType::from_url(&request.type_url) else {
            debug!(proxy = %self.conn.proxy.id, type_url = request.type_url, "ignoring unsupported type");
            return true;
        };
        let (action, scope) = self.stream.on_request(DeltaRequest {
            ty,
            subscribe: request.resource_names_subscribe,
            unsubscribe: request.resource_names_unsubscribe,
            initial_versions: request.initial_resource_versions,
            nonce: &request.response_nonce,
            error: request.error_detail.map(|e| e.message),
        });
        self.conclude(ty, action, &scope)
    }

    fn respond(&mut self, ty: ResourceType, scope: &Scope) -> bool {
        self.send(ty, scope)
    }

    fn watched(&self) -> Vec<ResourceType> {
        self.stream.watches.keys().copied().collect()
    }

    fn eds_names(&self) -> Vec<String> {
        let watch = self.stream.watches.get(&ResourceType::Endpoint);
        watch
            .map(|w| w.subscribed.iter().cloned().collect())
            .unwrap_or_default()
    }

    fn eds_generation(&self) -> u64 {
        self.stream
            .watches
            .get(&ResourceType::Endpoint)
            .map_or(0, |w| w.generation)
    }

    fn status_of(&self, ty: ResourceType) -> Option<TypeStatus> {
        self.stream.watches.get(&ty).map(|w| w.status.clone())
    }

    fn handles(&self) -> (Arc<XdsServer>, Arc<Connection>) {
        (self.server.clone(), self.conn.clone())
    }
}

/// `envoy.service.discovery.v3.AggregatedDiscoveryService`, hand-mounted so responses use the
/// pre-encoded codec.
#[derive(Clone)]
pub struct AdsService {
    server: Arc<XdsServer>,
    authn: Option<Arc<Authenticator>>,
}

impl NamedService for AdsService {
    const NAME: &'static str = "envoy.service.discovery.v3.AggregatedDiscoveryService";
}

struct Method<Req> {
    server: Arc<XdsServer>,
    authn: Option<Arc<Authenticator>>,
    _req: std::marker::PhantomData<fn(Req)>,
}

impl StreamingService<DiscoveryRequest> for Method<DiscoveryRequest> {
    type Response = Bytes;
    type ResponseStream = UnboundedReceiverStream<Result<Bytes, Status>>;
    type Future = BoxFuture<tonic::Response<Self::ResponseStream>, Status>;

    fn call(&mut self, request: tonic::Request<Streaming<DiscoveryRequest>>) -> Self::Future {
        let (tx, rx) = mpsc::unbounded_channel();
        let server = self.server.clone();
        let auth = self
            .authn
            .clone()
            .map(|a| (a, Credentials::from_request(&request)));
        tokio::spawn(serve(
            server,
            request.into_inner(),
            tx,
            false,
            auth,
            |server, conn, tx| {
                Box::new(SotwSession {
                    server,
                    conn,
                    stream: SotwStream::default(),
                    tx,
                })
            },
        ));
        Box::pin(async move { Ok(tonic::Response::new(UnboundedReceiverStream::new(rx))) })
    }
}

impl StreamingService<DeltaDiscoveryRequest> for Method<DeltaDiscoveryRequest> {
    type Response = Bytes;
    type ResponseStream = UnboundedReceiverStream<Result<Bytes, Status>>;
    type Future = BoxFuture<tonic::Response<Self::ResponseStream>, Status>;

    fn call(&mut self, request: tonic::Request<Streaming<DeltaDiscoveryRequest>>) -> Self::Future {
        let (tx, rx) = mpsc::unbounded_channel();
        let server = self.server.clone();
        let auth = self
            .authn
            .clone()
            .map(|a| (a, Credentials::from_request(&request)));
        tokio::spawn(serve(
            server,
            request.into_inner(),
            tx,
            true,
            auth,
            |server, conn, tx| {
                Box::new(DeltaSession {
                    server,
                    conn,
                    stream: DeltaStream::default(),
                    tx,
                })
            },
        ));
        Box::pin(async move { Ok(tonic::Response::new(UnboundedReceiverStream::new(rx))) })
    }
}

impl<B> Service<http::Request<B>> for AdsService
where
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let (server, authn) = (self.server.clone(), self.authn.clone());
        match request.uri().path() {
            SOTW_PATH => Box::pin(async move {
                let method = Method::<DiscoveryRequest> {
                    server,
                    authn,
                    _req: Default::default(),
                };
                Ok(Grpc::new(AdsCodec::<DiscoveryRequest>::default())
                    .streaming(method, request)
                    .await)
            }),
            DELTA_PATH => Box::pin(async move {
                let method = Method::<DeltaDiscoveryRequest> {
                    server,
                    authn,
                    _req: Default::default(),
                };
                Ok(Grpc::new(AdsCodec::<DeltaDiscoveryRequest>::default())
                    .streaming(method, request)
                    .await)
            }),
            _ => Box::pin(async move { Ok(Status::unimplemented("no such method").into_http()) }),
        }
    }
}
