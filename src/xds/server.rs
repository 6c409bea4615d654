//! The ADS gRPC service (SotW and Delta): the connected proxies, the push fan-out, and the gRPC
//! plumbing that hands each stream to its task (`xds/stream`).
//!
//! Each stream is one task owning its session; a push merges into the stream's `PushSlot`. Work for
//! a response runs under a global permit (the push concurrency limit); responses are assembled from
//! cached encoded resources of one mesh snapshot and sent through a bounded queue.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DiscoveryRequest};
use parking_lot::{Mutex, RwLock};
use serde::Serialize;
use tokio::sync::{mpsc, AcquireError, Notify, Semaphore, SemaphorePermit};
use tonic::codegen::{http, Body, BoxFuture, Service, StdError};
use tonic::server::NamedService;
use tonic::{Status, Streaming};
use tracing::{debug, info};

use super::generate::{address_scope, cluster_host, ResourceCache};
use super::grpc;
use super::introspect::DebugViews;
use super::protocol::{ResourceType, TypeStatus};
use super::proxy::{Proxy, ProxyType};
use super::push::{moves_names, PushRequest, PushSlot};
use super::session::{DeltaSession, SotwSession};
use super::stream::{self, NewSession, OUTPUT_QUEUE};
use crate::istio::gateway_api::GATEWAY_NAME_LABEL;
use crate::istio::ConfigKey;
use crate::istio::ConfigKind;
use crate::metrics::XdsMetrics;
use crate::model::gateway_api::GatewayApi;
use crate::model::waypoints::WaypointClass;
use crate::model::{Audience, Change, Hostname, Mesh, MeshSnapshot};
use crate::security::authn::{Authenticator, Credentials};
use crate::security::identity::Identity;
use crate::security::secret_access::SecretAccess;

const SOTW_PATH: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources";
const DELTA_PATH: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources";

/// Whether the model is complete enough to serve (every cluster loaded or given up on).
pub type Readiness = Arc<dyn Fn() -> bool + Send + Sync>;

/// Limits of the xDS server.
#[derive(Clone, Copy, Debug)]
pub struct XdsOptions {
    /// Streams building or sending a response at once.
    pub push_concurrency: usize,
    /// How long a response may wait for a proxy to read before its stream is closed.
    pub send_timeout: Duration,
    /// How long a new stream may stay silent before it is closed.
    pub first_request_timeout: Duration,
    /// A stream older than this (±10 % jitter) is ended cleanly so proxies reconnect and spread
    /// over replicas after a scale-up; zero keeps streams forever.
    pub max_connection_age: Duration,
    /// Debug types answered to unauthenticated callers too (`--insecure-open-debug`).
    pub open_debug: bool,
    /// Istio config (MCP) served to unauthenticated callers too (`--insecure-open-config`).
    pub open_config: bool,
    /// Resources the cache keeps at most (least recently used go first).
    pub cache_entries: usize,
}

impl Default for XdsOptions {
    fn default() -> Self {
        Self {
            push_concurrency: 64,
            send_timeout: Duration::from_secs(30),
            first_request_timeout: Duration::from_secs(30),
            max_connection_age: Duration::from_secs(30 * 60),
            open_debug: false,
            open_config: false,
            cache_entries: crate::xds::generate::DEFAULT_CACHE_ENTRIES,
        }
    }
}

/// Registers proxies that ask to join a WorkloadGroup (`AUTO_REGISTER_GROUP`): the sources'
/// auto-registration, handed to the server at start.
pub trait ProxyRegistrar: Send + Sync {
    /// Registers the proxy if it asks to be; the entry to release when its stream ends.
    fn connected(&self, proxy: &Proxy) -> Option<ConfigKey>;
    /// The stream of a registered proxy ended.
    fn disconnected(self: Arc<Self>, key: ConfigKey);
}

pub struct XdsServer {
    mesh: Arc<Mesh>,
    /// Which proxies may read which Secrets over SDS (reviews asked and their verdicts).
    secret_access: SecretAccess,
    auto_registration: std::sync::OnceLock<Arc<dyn ProxyRegistrar>>,
    /// The debug views besides the server's own, held weakly: they hold the server.
    debug_views: std::sync::OnceLock<Weak<dyn DebugViews>>,
    push_log: PushLog,
    ready: Readiness,
    cache: ResourceCache,
    connections: RwLock<HashMap<u64, Arc<Connection>>>,
    push_permits: Semaphore,
    options: XdsOptions,
    next_id: AtomicU64,
    nonces: AtomicU64,
    metrics: XdsMetrics,
    /// What the resource names all streams subscribed to or announced cost to hold
    /// (`MAX_SERVER_HELD_BYTES`).
    held_bytes: AtomicUsize,
}

/// What the resource names all streams together make the server hold may cost.
pub const MAX_SERVER_HELD_BYTES: usize = 1 << 30;

/// One connected proxy, as the push fan-out and /debug/syncz see it.
pub struct Connection {
    pub id: u64,
    pub proxy: Proxy,
    pub delta: bool,
    pub connected_at: SystemTime,
    /// The peer's address, when the transport knows it.
    pub address: Option<std::net::SocketAddr>,
    pub(super) slot: PushSlot,
    /// Hostnames behind the proxy's EDS subscriptions: an endpoint change wakes only these proxies.
    eds_hosts: RwLock<BTreeSet<Hostname>>,
    /// The subscription generation `eds_hosts` was derived from.
    pub(super) eds_generation: AtomicU64,
    status: Mutex<BTreeMap<ResourceType, TypeStatus>>,
    /// Route and secret names the proxy subscribes to (few), for the debug config dump; its
    /// cluster, listener and endpoint names follow from the snapshot.
    named: Mutex<BTreeMap<ResourceType, Arc<[String]>>>,
    /// Notified when the server shuts down: the stream ends and the proxy reconnects elsewhere.
    pub(super) closing: Notify,
}

impl Connection {
    /// Whether the proxy takes its locality from its own endpoints (its node did not say) and one
    /// of these services has such an endpoint: the priorities of all its assignments may move.
    fn locality_follows(&self, services: &BTreeSet<Hostname>, mesh: &MeshSnapshot) -> bool {
        let own = &self.proxy;
        own.locality.region.is_empty()
            && !services.is_empty()
            && (own.ips.iter()).any(|ip| mesh.endpoints.serves_at(ip, services))
    }

    fn wants_eds_of(&self, services: &BTreeSet<Hostname>) -> bool {
        let hosts = self.eds_hosts.read();
        services.iter().any(|s| hosts.contains(s))
    }

    /// Whether the proxy (its agent, for the name table and the trust bundle) watches `ty`.
    fn watches(&self, ty: ResourceType) -> bool {
        self.status.lock().contains_key(&ty)
    }

    /// Whether it is a client of the config itself (MCP), whatever its namespace.
    fn watches_config(&self) -> bool {
        self.status
            .lock()
            .keys()
            .any(|t| matches!(t, ResourceType::Config(..)))
    }

    pub(super) fn set_eds_names<'a>(&self, names: impl Iterator<Item = &'a String>) {
        *self.eds_hosts.write() = names
            .filter_map(|n| cluster_host(n))
            .map(Hostname::from)
            .collect();
    }

    /// Makes a type's protocol status visible to /debug/syncz.
    pub(super) fn publish_status(&self, ty: ResourceType, status: TypeStatus) {
        self.status.lock().insert(ty, status);
    }

    /// Records the subscribed names of a type the debug config dump cannot derive.
    pub(super) fn publish_names(&self, ty: ResourceType, names: &BTreeSet<String>) {
        if !matches!(ty, ResourceType::Route | ResourceType::Secret) {
            return;
        }
        let mut named = self.named.lock();
        if named
            .get(&ty)
            .is_none_or(|old| !old.iter().eq(names.iter()))
        {
            named.insert(ty, names.iter().cloned().collect());
        }
    }

    /// The route or secret names the proxy subscribes to.
    pub fn subscribed(&self, ty: ResourceType) -> Arc<[String]> {
        self.named
            .lock()
            .get(&ty)
            .cloned()
            .unwrap_or_else(|| Arc::new([]))
    }

    /// Each watched type's protocol status.
    pub fn status(&self) -> BTreeMap<ResourceType, TypeStatus> {
        self.status.lock().clone()
    }

    /// istiod's connection id: the node id and a per-server counter.
    pub fn connection_id(&self) -> String {
        format!("{}-{}", self.proxy.id, self.id)
    }
}

/// A connection while it is registered with the server: dropping it (the stream ended, or its task
/// unwound from a panic) unregisters it.
pub struct Registered {
    server: Arc<XdsServer>,
    conn: Arc<Connection>,
}

impl Registered {
    pub fn conn(&self) -> &Arc<Connection> {
        &self.conn
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.server.connections.write().remove(&self.conn.id);
        self.server
            .metrics
            .disconnected(&self.conn.proxy.istio_version);
        info!(proxy = %self.conn.proxy.id, connection = self.conn.id, "proxy disconnected");
    }
}

impl XdsServer {
    pub fn new(
        mesh: Arc<Mesh>,
        ready: Readiness,
        options: XdsOptions,
        metrics: XdsMetrics,
        secret_access: SecretAccess,
    ) -> Arc<Self> {
        Arc::new(Self {
            mesh,
            secret_access,
            auto_registration: Default::default(),
            debug_views: Default::default(),
            push_log: PushLog::default(),
            ready,
            cache: ResourceCache::new(options.cache_entries, metrics.cache_entries()),
            connections: RwLock::default(),
            push_permits: Semaphore::new(options.push_concurrency.max(1)),
            options,
            next_id: AtomicU64::new(1),
            nonces: AtomicU64::new(0),
            metrics,
            held_bytes: AtomicUsize::new(0),
        })
    }

    pub fn cache(&self) -> &ResourceCache {
        &self.cache
    }

    /// Turns on WorkloadGroup auto-registration for proxies on the secure port (once).
    pub fn set_auto_registration(&self, registration: Arc<dyn ProxyRegistrar>) {
        let _ = self.auto_registration.set(registration);
    }

    pub(super) fn auto_registration(&self) -> Option<Arc<dyn ProxyRegistrar>> {
        self.auto_registration.get().cloned()
    }

    /// Serves `istio.io/debug` requests for other paths from these views (once).
    pub fn set_debug_views(&self, views: Weak<dyn DebugViews>) {
        let _ = self.debug_views.set(views);
    }

    pub(super) fn debug_views(&self) -> Option<Arc<dyn DebugViews>> {
        self.debug_views.get().and_then(Weak::upgrade)
    }

    pub fn secret_access(&self) -> &SecretAccess {
        &self.secret_access
    }

    pub fn mesh(&self) -> &Arc<Mesh> {
        &self.mesh
    }

    pub fn options(&self) -> &XdsOptions {
        &self.options
    }

    /// Whether a client may read the config itself (MCP): one proven on the secure port to be of
    /// the root namespace (another control plane), as istiod's api generator requires; anyone where
    /// `--insecure-open-config` says so.
    pub(super) fn serves_config_to(&self, proxy: &Proxy) -> bool {
        let root = self.mesh.snapshot().config.mesh().root_namespace.clone();
        self.options.open_config || (proxy.verified() && *proxy.namespace == *root)
    }

    pub(super) fn metrics(&self) -> &XdsMetrics {
        &self.metrics
    }

    pub(super) fn ready(&self) -> bool {
        (self.ready)()
    }

    pub(super) async fn push_permit(&self) -> Result<SemaphorePermit<'_>, AcquireError> {
        self.push_permits.acquire().await
    }

    /// Moves a stream's share of the name budget from `from` to `to` bytes; false (and nothing
    /// moved) when the server's budget cannot take the growth.
    pub(super) fn reserve_held_bytes(&self, from: usize, to: usize) -> bool {
        if to <= from {
            self.held_bytes.fetch_sub(from - to, Ordering::Relaxed);
            return true;
        }
        let grow = to - from;
        let before = self.held_bytes.fetch_add(grow, Ordering::Relaxed);
        if before + grow > MAX_SERVER_HELD_BYTES {
            self.held_bytes.fetch_sub(grow, Ordering::Relaxed);
            return false;
        }
        true
    }

    pub(super) fn release_held_bytes(&self, bytes: usize) {
        self.held_bytes.fetch_sub(bytes, Ordering::Relaxed);
    }

    pub fn connection_count(&self) -> usize {
        self.connections.read().len()
    }

    /// Ends every stream, spread evenly over `over` so the proxies do not all reconnect at once
    /// (to another replica: the caller has made readiness false, so this one refuses them). Returns
    /// once every stream has ended, or `over` and a second after it have passed.
    pub async fn close_streams(&self, over: Duration) {
        let started = tokio::time::Instant::now();
        let connections: Vec<Arc<Connection>> = self.connections.read().values().cloned().collect();
        let count = connections.len().max(1) as u32;
        info!(streams = connections.len(), over = ?over, "closing xDS streams");
        for (i, conn) in connections.iter().enumerate() {
            tokio::time::sleep_until(started + over * i as u32 / count).await;
            conn.closing.notify_one();
        }
        let deadline = started + over + Duration::from_secs(1);
        while self.connection_count() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Fans a debounced change out to the proxies it concerns: the full part to its audience, the
    /// endpoint part to proxies watching those services.
    /// `triggered_at`: when the first change behind it happened (for convergence times).
    pub fn push(&self, change: Change, triggered_at: tokio::time::Instant) {
        let snapshot = self.mesh.snapshot();
        let queued_at = tokio::time::Instant::now();
        if change.full {
            self.cache.prune(snapshot.services.version());
        }
        let mut woken = 0;
        let services = Arc::new(change.services.clone());
        let everywhere = change.touches_all_endpoints();
        let (names_if_full, names_everywhere) = moves_names(&change, &snapshot);
        let kinds: BTreeSet<ConfigKind> = change.configs.iter().map(|k| k.kind).collect();
        // Worked out at the first ztunnel: most meshes have none.
        let addresses = std::cell::OnceCell::new();
        let gateway_api = snapshot.config.gateway_api();
        let waypoint_pods_moved = (change.services.iter()).any(|h| gateway_api.is_waypoint_host(h));
        for conn in self.connections.read().values() {
            // A ztunnel serves every namespace: its policies follow config anywhere, its addresses
            // every pod and endpoint.
            let ztunnel = conn.proxy.kind == ProxyType::Ztunnel;
            let waypoint =
                WaypointMoves::of(&conn.proxy, gateway_api, &change, waypoint_pods_moved);
            let full = (change.full && (ztunnel || change.audience.admits(&conn.proxy.namespace)))
                || waypoint.listeners;
            let addresses = match ztunnel {
                true => addresses
                    .get_or_init(|| address_scope(&snapshot, &change))
                    .clone(),
                false => None,
            };
            let all_endpoints = (full && everywhere)
                || conn.locality_follows(&change.services, &snapshot)
                || waypoint.endpoints;
            // Only proxies that may read a changed Secret hear of it: verified, of its namespace,
            // or routers (a Gateway API listener may name another namespace's).
            let secrets = conn.proxy.verified()
                && change.credentials.iter().any(|k| {
                    *k.namespace == *conn.proxy.namespace || conn.proxy.kind == ProxyType::Router
                });
            let names = (full && names_if_full)
                || (names_everywhere && conn.watches(ResourceType::NameTable));
            let trust_bundle = change.trust_bundle && conn.watches(ResourceType::ProxyConfig);
            let configs = match !kinds.is_empty() && conn.watches_config() {
                true => kinds.clone(),
                false => BTreeSet::new(),
            };
            let wanted = full
                || secrets
                || all_endpoints
                || names
                || trust_bundle
                || addresses.is_some()
                || !configs.is_empty();
            if wanted || conn.wants_eds_of(&change.services) {
                conn.slot.offer(PushRequest {
                    full,
                    addresses,
                    all_endpoints,
                    services: services.clone(),
                    secrets,
                    names,
                    trust_bundle,
                    configs,
                    triggered_at: Some(triggered_at),
                    queued_at: Some(queued_at),
                });
                woken += 1;
            }
        }
        debug!(
            full = change.full,
            services = change.services.len(),
            configs = change.configs.len(),
            proxies = woken,
            "push"
        );
        self.push_log.record(PushRecord {
            at: humantime::format_rfc3339_millis(SystemTime::now()).to_string(),
            version: snapshot.version,
            full: change.full,
            audience: change.audience,
            services: change.services.len(),
            configs: change
                .configs
                .iter()
                .take(PUSH_LOG_CONFIGS)
                .map(|k| k.to_string())
                .collect(),
            proxies: woken,
        });
    }

    /// The most recent pushes, newest last.
    pub fn push_log(&self) -> Vec<PushRecord> {
        self.push_log.recent()
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

    /// The connected streams, oldest first.
    pub fn connections(&self) -> Vec<Arc<Connection>> {
        let mut all: Vec<Arc<Connection>> = self.connections.read().values().cloned().collect();
        all.sort_by_key(|c| c.id);
        all
    }

    pub(super) fn connect(
        self: &Arc<Self>,
        proxy: Proxy,
        delta: bool,
        address: Option<std::net::SocketAddr>,
    ) -> Registered {
        let conn = Arc::new(Connection {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            proxy,
            delta,
            connected_at: SystemTime::now(),
            address,
            slot: PushSlot::default(),
            eds_hosts: RwLock::default(),
            eds_generation: AtomicU64::new(0),
            status: Mutex::default(),
            named: Mutex::default(),
            closing: Notify::new(),
        });
        self.connections.write().insert(conn.id, conn.clone());
        self.metrics.connected(&conn.proxy.istio_version);
        info!(proxy = %conn.proxy.id, connection = conn.id, delta, "proxy connected");
        Registered {
            server: self.clone(),
            conn,
        }
    }

    pub(super) fn next_nonce(&self) -> Arc<str> {
        format!("{:x}", self.nonces.fetch_add(1, Ordering::Relaxed) + 1).into()
    }
}

/// Pushes kept for /debug/pushz, and config keys shown per push.
const PUSH_LOG_LEN: usize = 100;
const PUSH_LOG_CONFIGS: usize = 20;

/// One push, as /debug/pushz shows it: why it happened and whom it reached.
#[derive(Clone, Debug, Serialize)]
pub struct PushRecord {
    pub at: String,
    pub version: u64,
    pub full: bool,
    pub audience: Audience,
    pub services: usize,
    pub configs: Vec<String>,
    pub proxies: usize,
}

#[derive(Default)]
struct PushLog(Mutex<std::collections::VecDeque<PushRecord>>);

impl PushLog {
    fn record(&self, record: PushRecord) {
        let mut log = self.0.lock();
        if log.len() == PUSH_LOG_LEN {
            log.pop_front();
        }
        log.push_back(record);
    }

    fn recent(&self) -> Vec<PushRecord> {
        self.0.lock().iter().cloned().collect()
    }
}

/// The caller's proven identity must be the proxy's: same namespace, and same service account when
/// the node names one (Istio's XDS identity check).
pub(super) async fn authorize(
    authn: &Authenticator,
    credentials: &Credentials,
    proxy: &Proxy,
) -> Result<Identity, Status> {
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
    Ok(identity)
}

pub trait NodeOf: Send + 'static {
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

/// `envoy.service.discovery.v3.AggregatedDiscoveryService`, hand-mounted so responses are framed
/// by `xds/grpc` from pre-encoded segments.
#[derive(Clone)]
pub struct AdsService {
    server: Arc<XdsServer>,
    authn: Option<Arc<Authenticator>>,
}

impl NamedService for AdsService {
    const NAME: &'static str = "envoy.service.discovery.v3.AggregatedDiscoveryService";
}

impl AdsService {
    /// Starts the stream's task; the response carries what it sends.
    fn open<Req: NodeOf + prost::Message + Default>(
        &self,
        request: tonic::Request<Streaming<Req>>,
        delta: bool,
        new_session: NewSession<Req>,
    ) -> http::Response<tonic::body::Body> {
        let (tx, rx) = mpsc::channel(OUTPUT_QUEUE);
        let server = self.server.clone();
        let auth = self
            .authn
            .clone()
            .map(|a| (a, Credentials::from_request(&request)));
        let peer = request.remote_addr();
        let stream = stream::serve(
            server.clone(),
            request.into_inner(),
            tx.clone(),
            stream::Peer {
                delta,
                address: peer,
                auth,
            },
            new_session,
        );
        tokio::spawn(stream::run_guarded(server, tx, stream));
        grpc::response(rx)
    }
}

/// What a change moves of a waypoint proxy beyond the services it names. Its endpoints are named
/// after the services it serves but read more: a waypoint tunnels to the pods ztunnel captures,
/// an east-west gateway forwards to waypoints' pods. A waypoint's listeners name the workloads
/// using it.
#[derive(Default)]
struct WaypointMoves {
    listeners: bool,
    endpoints: bool,
}

impl WaypointMoves {
    fn of(proxy: &Proxy, gateway_api: &GatewayApi, change: &Change, waypoint_pods: bool) -> Self {
        if proxy.kind != ProxyType::Waypoint {
            return Self::default();
        }
        let name = proxy.labels.get(GATEWAY_NAME_LABEL);
        let Some(gateway) = name.and_then(|n| gateway_api.waypoint(&proxy.namespace, n)) else {
            return Self::default();
        };
        let workloads = !change.workloads.is_empty();
        match gateway.class {
            WaypointClass::Waypoint => Self {
                listeners: workloads && gateway.traffic.serves_workloads(),
                endpoints: workloads,
            },
            WaypointClass::EastWest => Self {
                listeners: false,
                endpoints: waypoint_pods,
            },
        }
    }
}

fn sotw_session(
    server: Arc<XdsServer>,
    conn: Arc<Connection>,
) -> Box<dyn super::session::Session<DiscoveryRequest>> {
    Box::new(SotwSession::new(server, conn))
}

fn delta_session(
    server: Arc<XdsServer>,
    conn: Arc<Connection>,
) -> Box<dyn super::session::Session<DeltaDiscoveryRequest>> {
    Box::new(DeltaSession::new(server, conn))
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
        let response = match request.uri().path() {
            SOTW_PATH => self.open(grpc::request(request), false, sotw_session),
            DELTA_PATH => self.open(grpc::request(request), true, delta_session),
            _ => Status::unimplemented("no such method").into_http(),
        };
        Box::pin(async move { Ok(response) })
    }
}
