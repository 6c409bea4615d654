//! A Kubernetes API server for meshpilot's tests.
//!
//! It speaks the real protocol over HTTPS with its own CA and bearer tokens: list and watch with
//! resource versions, ADDED/MODIFIED/DELETED/BOOKMARK events, label and field selectors, 410 Gone
//! for compacted resource versions, TokenReviews against a token table, and TokenRequests. Objects
//! live in memory. Like the real one, it refuses to create an object in a namespace that does not
//! exist, and a test can deny a user a verb on a resource (403 Forbidden). A test can stop and restart
//! it on the same port, or make it hang. Creates and updates are atomic: a create of an existing
//! object is 409 AlreadyExists, an update naming a stale `resourceVersion` is 409 Conflict (what
//! leader election relies on); `dryRun=All` admits without storing. Admission webhooks configured
//! in the store are called as the real API server calls them (`admission`); a test says where a
//! webhook's Service is reachable with [`TestApiServer::route_service`]. It answers `/version`,
//! SelfSubjectAccessReviews (consistent with the denials), and can run its clock (the `Date`
//! header) ahead or behind ([`TestApiServer::set_clock_offset`]).

mod access;
mod admission;
mod clock;
mod store;

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use bytes::Bytes;
use futures::StreamExt;
use http::{Method, Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use parking_lot::Mutex;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use store::{kind_by_name, kind_by_plural, kind_of, Filter, ResourceKind, Store, WatchStart};

type Body = BoxBody<Bytes, Infallible>;

/// Who a bearer token authenticates as.
#[derive(Debug, Clone)]
pub struct User {
    pub username: String,
    pub uid: String,
    pub groups: Vec<String>,
    /// Audiences the token is bound to; empty accepts any.
    pub audiences: Vec<String>,
    /// What the authenticator adds: a pod-bound token names its pod
    /// (`authentication.kubernetes.io/pod-name`, `…/pod-uid`).
    pub extra: BTreeMap<String, Vec<String>>,
}

impl User {
    /// A service account's identity, as the Kubernetes token authenticator reports it.
    pub fn service_account(namespace: &str, name: &str) -> Self {
        Self {
            username: format!("system:serviceaccount:{namespace}:{name}"),
            uid: format!("uid-{namespace}-{name}"),
            groups: vec![
                "system:serviceaccounts".into(),
                format!("system:serviceaccounts:{namespace}"),
                "system:authenticated".into(),
            ],
            audiences: Vec::new(),
            extra: BTreeMap::new(),
        }
    }

    /// The token is bound to a pod, as a projected service-account token is.
    pub fn of_pod(mut self, name: &str, uid: &str) -> Self {
        let key = |k: &str| format!("authentication.kubernetes.io/{k}");
        self.extra.insert(key("pod-name"), vec![name.into()]);
        self.extra.insert(key("pod-uid"), vec![uid.into()]);
        self
    }
}

/// A write that took effect.
#[derive(Clone, Debug)]
pub struct Write {
    pub at: std::time::Instant,
    pub user: String,
    pub verb: &'static str,
    pub plural: String,
    pub namespace: String,
    pub name: String,
    /// The object as written (as deleted, for a delete).
    pub object: Value,
}

struct Shared {
    store: Mutex<Store>,
    tokens: Mutex<HashMap<String, User>>,
    hang: AtomicBool,
    unhang: Notify,
    /// Lists and watches are answered 500 (`set_failing`).
    failing: AtomicBool,
    /// Bumped to end every open watch (a watch channel: no watch misses it, however busy).
    watches_end: tokio::sync::watch::Sender<u64>,
    requests: Mutex<HashMap<String, u64>>,
    bookmark_interval: Duration,
    ca_pem: String,
    tls: Arc<rustls::ServerConfig>,
    token_serial: AtomicU64,
    /// (username, verb, plural) a test denied.
    denied: Mutex<std::collections::HashSet<(String, String, String)>>,
    /// Users whose requests are authorized by the RBAC objects stored, as a real API server's
    /// RBAC authorizer does (everyone else may do anything a test did not deny).
    rbac_enforced: Mutex<std::collections::HashSet<String>>,
    /// (username, verb, plural) whose requests a test holds unanswered, and the wake-up of those
    /// waiting when it lets go.
    held: Mutex<std::collections::HashSet<(String, String, String)>>,
    let_go: Notify,
    /// Every write that took effect, in order.
    write_log: Mutex<Vec<Write>>,
    /// Where a Service (namespace, name, port) is reachable: what kube-proxy would do for webhooks.
    routes: Mutex<HashMap<(String, String, u16), SocketAddr>>,
    review_serial: AtomicU64,
    /// Serializes the check-then-store of creates and updates, so they are atomic.
    writes: Mutex<()>,
    /// Seconds the `Date` header is ahead of the real clock (negative: behind).
    clock_offset: AtomicI64,
    /// The protocol (ALPN) of every TLS connection open, by accept serial.
    connections: Mutex<std::collections::BTreeMap<u64, String>>,
    accepted: AtomicU64,
}

/// A client connection listed in [`Shared::connections`] while it lives (also when its task is
/// aborted by a stop).
struct OpenConnection {
    shared: Arc<Shared>,
    serial: u64,
}

impl OpenConnection {
    fn new(shared: &Arc<Shared>, protocol: String) -> Self {
        let serial = shared.accepted.fetch_add(1, Ordering::SeqCst);
        shared.connections.lock().insert(serial, protocol);
        Self {
            shared: shared.clone(),
            serial,
        }
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.shared.connections.lock().remove(&self.serial);
    }
}

/// One running (or stopped) test API server.
pub struct TestApiServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    admin_token: String,
    running: Mutex<Option<Running>>,
}

struct Running {
    accept: JoinHandle<()>,
    connections: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl Drop for TestApiServer {
    fn drop(&mut self) {
        if let Some(running) = self.running.lock().take() {
            running.abort();
        }
    }
}

impl Running {
    fn abort(self) {
        self.accept.abort();
        for c in self.connections.lock().drain(..) {
            c.abort();
        }
    }
}

impl TestApiServer {
    /// Starts a server on a free port of 127.0.0.1 with an admin token.
    pub async fn start() -> Self {
        Self::start_with_bookmarks(Duration::from_secs(1)).await
    }

    pub async fn start_with_bookmarks(bookmark_interval: Duration) -> Self {
        Self::start_with(bookmark_interval, &[b"h2", b"http/1.1"]).await
    }

    /// A server that offers only HTTP/1.1 (ALPN), as some proxies in front of API servers do.
    pub async fn start_http1_only() -> Self {
        Self::start_with(Duration::from_secs(1), &[b"http/1.1"]).await
    }

    async fn start_with(bookmark_interval: Duration, protocols: &[&[u8]]) -> Self {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let (ca_pem, mut tls) = tls_config();
        tls.alpn_protocols = protocols.iter().map(|p| p.to_vec()).collect();
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind test API server");
        let addr = listener.local_addr().expect("local addr");
        let admin_token = "admin-token".to_string();
        let admin = User {
            username: "admin".into(),
            uid: "admin".into(),
            groups: vec!["system:masters".into(), "system:authenticated".into()],
            audiences: Vec::new(),
            extra: BTreeMap::new(),
        };
        let shared = Arc::new(Shared {
            store: Mutex::new(Store::default()),
            tokens: Mutex::new(HashMap::from([(admin_token.clone(), admin)])),
            hang: AtomicBool::new(false),
            unhang: Notify::new(),
            failing: AtomicBool::new(false),
            watches_end: tokio::sync::watch::Sender::new(0),
            requests: Mutex::default(),
            bookmark_interval,
            ca_pem,
            tls: Arc::new(tls),
            token_serial: AtomicU64::new(0),
            denied: Mutex::default(),
            rbac_enforced: Mutex::default(),
            held: Mutex::default(),
            let_go: Notify::new(),
            write_log: Mutex::default(),
            routes: Mutex::default(),
            review_serial: AtomicU64::new(0),
            writes: Mutex::default(),
            clock_offset: AtomicI64::new(0),
            connections: Mutex::default(),
            accepted: AtomicU64::new(0),
        });
        let server = Self {
            shared,
            addr,
            admin_token,
            running: Mutex::new(None),
        };
        *server.running.lock() = Some(server.serve(listener));
        server
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn url(&self) -> String {
        format!("https://{}", self.addr)
    }

    pub fn ca_pem(&self) -> &str {
        &self.shared.ca_pem
    }

    pub fn admin_token(&self) -> &str {
        &self.admin_token
    }

    /// A kubeconfig for this server authenticating with `token`.
    pub fn kubeconfig(&self, token: &str) -> String {
        kubeconfig_for(&self.url(), &self.shared.ca_pem, token, "test")
    }

    pub fn add_token(&self, token: &str, user: User) {
        self.shared.tokens.lock().insert(token.to_string(), user);
    }

    /// From now on `username` may not `verb` (get, list, watch, create, update, delete) `plural`.
    /// From now on the requests (and SelfSubjectAccessReviews) of `username` are allowed only
    /// as the stored Roles, ClusterRoles and their bindings allow them.
    pub fn enforce_rbac(&self, username: &str) {
        self.shared.rbac_enforced.lock().insert(username.into());
    }

    pub fn deny(&self, username: &str, verb: &str, plural: &str) {
        self.shared
            .denied
            .lock()
            .insert((username.into(), verb.into(), plural.into()));
    }

    /// From now on requests of `username` to `verb` `plural` (as for `deny`; TokenReviews are
    /// `create` `tokenreviews`) wait unanswered, until `let_go`. Other requests go on.
    pub fn hold(&self, username: &str, verb: &str, plural: &str) {
        self.shared
            .held
            .lock()
            .insert((username.into(), verb.into(), plural.into()));
    }

    /// Answers the requests `hold` kept waiting, and those to come.
    pub fn let_go(&self, username: &str, verb: &str, plural: &str) {
        self.shared
            .held
            .lock()
            .remove(&(username.into(), verb.into(), plural.into()));
        self.shared.let_go.notify_waiters();
    }

    /// Every create, update and delete that took effect, in order, with who made it.
    pub fn write_log(&self) -> Vec<Write> {
        self.shared.write_log.lock().clone()
    }

    /// From now on the `Date` header of every response is `seconds` ahead of the real clock.
    pub fn set_clock_offset(&self, seconds: i64) {
        self.shared.clock_offset.store(seconds, Ordering::SeqCst);
    }

    /// Admission webhooks naming Service `namespace/name` on `port` reach `addr`.
    pub fn route_service(&self, namespace: &str, name: &str, port: u16, addr: SocketAddr) {
        self.shared
            .routes
            .lock()
            .insert((namespace.into(), name.into(), port), addr);
    }

    pub fn revoke_token(&self, token: &str) {
        self.shared.tokens.lock().remove(token);
    }

    /// Creates or replaces every object of a (multi-document) YAML manifest.
    pub fn apply_yaml(&self, yaml: &str) {
        for doc in serde_yaml_ng::Deserializer::from_str(yaml) {
            let value: Value = serde::Deserialize::deserialize(doc).expect("valid YAML");
            if !value.is_null() {
                self.apply(value);
            }
        }
    }

    pub fn apply(&self, object: Value) -> Value {
        let kind = kind_of(&object).unwrap_or_else(|| {
            panic!(
                "unsupported kind {} {}",
                object["apiVersion"], object["kind"]
            )
        });
        upsert(&self.shared, kind, object)
    }

    pub fn get(&self, kind: &str, namespace: &str, name: &str) -> Option<Value> {
        let kind = kind_by_name(kind)?;
        self.shared.store.lock().get(kind, namespace, name)
    }

    pub fn delete(&self, kind: &str, namespace: &str, name: &str) -> Option<Value> {
        let kind = kind_by_name(kind).unwrap_or_else(|| panic!("unsupported kind {kind}"));
        self.shared.store.lock().delete(kind, namespace, name)
    }

    /// Forgets the watch history: clients watching from an older resource version get 410 Gone.
    pub fn compact(&self) {
        self.shared.store.lock().compact();
    }

    /// While hung, new connections are accepted but never answered and watches stall.
    pub fn set_hang(&self, hang: bool) {
        self.shared.hang.store(hang, Ordering::SeqCst);
        if !hang {
            self.shared.unhang.notify_waiters();
        }
    }

    /// While failing, every list and watch is answered 500, as by an API server whose storage is
    /// down (they are still counted by `request_count`); other requests are served. Open watches
    /// end when it starts failing, cleanly, as an API server going down ends them.
    pub fn set_failing(&self, failing: bool) {
        self.shared.failing.store(failing, Ordering::SeqCst);
        if failing {
            self.end_watches();
        }
    }

    /// Ends every open watch, cleanly: clients watch again from where they were (or, after
    /// `compact`, relist).
    pub fn end_watches(&self) {
        self.shared.watches_end.send_modify(|n| *n += 1);
    }

    /// Closes the listener and every connection, as an API server going down.
    pub fn stop(&self) {
        if let Some(running) = self.running.lock().take() {
            running.abort();
        }
    }

    /// Listens again on the same address, keeping every object.
    pub async fn restart(&self) {
        self.stop();
        let listener = loop {
            match TcpListener::bind(self.addr).await {
                Ok(l) => break l,
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        };
        *self.running.lock() = Some(self.serve(listener));
    }

    /// How many requests of a kind were made: `list:<plural>` for unselected lists,
    /// `list:<plural>?<labelSelector>` for selected ones, `watch:<plural>` (and
    /// `watch:<plural>?<labelSelector>` for a selected watch), `tokenreview`, ….
    pub fn request_count(&self, what: &str) -> u64 {
        self.shared.requests.lock().get(what).copied().unwrap_or(0)
    }

    /// The protocol (ALPN: `h2`, `http/1.1`, or `none`) of every client connection open now.
    pub fn connections(&self) -> Vec<String> {
        self.shared.connections.lock().values().cloned().collect()
    }

    fn serve(&self, listener: TcpListener) -> Running {
        let shared = self.shared.clone();
        let connections: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let conns = connections.clone();
        let accept = tokio::spawn(async move {
            let acceptor = tokio_rustls::TlsAcceptor::from(shared.tls.clone());
            while let Ok((tcp, _)) = listener.accept().await {
                let shared = shared.clone();
                let acceptor = acceptor.clone();
                let task = tokio::spawn(async move {
                    while shared.hang.load(Ordering::SeqCst) {
                        shared.unhang.notified().await;
                    }
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let protocol = tls.get_ref().1.alpn_protocol().unwrap_or(b"none");
                    let protocol = String::from_utf8_lossy(protocol).into_owned();
                    let _open = OpenConnection::new(&shared, protocol);
                    let service = hyper::service::service_fn(move |req| {
                        let shared = shared.clone();
                        async move {
                            let offset = shared.clock_offset.load(Ordering::SeqCst);
                            let mut response = handle(shared, req).await;
                            if offset != 0 {
                                response
                                    .headers_mut()
                                    .insert(http::header::DATE, clock::date_header(offset));
                            }
                            Ok::<_, Infallible>(response)
                        }
                    });
                    let builder = hyper_util::server::conn::auto::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    );
                    let _ = builder
                        .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                        .await;
                });
                let mut conns = conns.lock();
                conns.retain(|c| !c.is_finished());
                conns.push(task);
            }
        });
        Running {
            accept,
            connections,
        }
    }
}

/// A kubeconfig document (the shape `kubectl` and istioctl write).
pub fn kubeconfig_for(server: &str, ca_pem: &str, token: &str, name: &str) -> String {
    let ca = base64::engine::general_purpose::STANDARD.encode(ca_pem);
    format!(
        "apiVersion: v1
kind: Config
clusters:
- name: {name}
  cluster:
    server: {server}
    certificate-authority-data: {ca}
contexts:
- name: {name}
  context: {{cluster: {name}, user: {name}}}
current-context: {name}
users:
- name: {name}
  user:
    token: {token}
"
    )
}

fn tls_config() -> (String, rustls::ServerConfig) {
    let ca_key = rcgen::KeyPair::generate().expect("CA key");
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "test-apiserver-ca");
    ca_params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
    ];
    let ca = ca_params.self_signed(&ca_key).expect("CA cert");
    let issuer = rcgen::Issuer::new(ca_params, ca_key);

    let key = rcgen::KeyPair::generate().expect("server key");
    let mut params =
        rcgen::CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
            .expect("params");
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "kube-apiserver");
    let cert = params.signed_by(&key, &issuer).expect("server cert");

    let key_der = rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into());
    let config = rustls::ServerConfig::builder()
        .with_no_client_auth()
        .with_single_cert(vec![cert.der().clone()], key_der)
        .expect("TLS config");
    (ca.pem(), config)
}

fn count(shared: &Shared, what: String) {
    *shared.requests.lock().entry(what).or_default() += 1;
}

fn json_response(status: StatusCode, body: &Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())).boxed())
        .expect("response")
}

fn status_error(code: StatusCode, reason: &str, message: &str) -> Response<Body> {
    json_response(
        code,
        &json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": message, "reason": reason, "code": code.as_u16()}),
    )
}

/// A parsed REST path.
struct Target {
    kind: ResourceKind,
    namespace: Option<String>,
    name: Option<String>,
    sub: Option<String>,
}

fn parse_path(path: &str) -> Option<Result<Target, &'static str>> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group_version, rest) = match parts.as_slice() {
        ["api", "v1", rest @ ..] => ("v1".to_string(), rest),
        ["apis", group, version, rest @ ..] => (format!("{group}/{version}"), rest),
        _ => return None,
    };
    let target = |plural: &str, namespace: Option<&str>, name: Option<&str>, sub: Option<&str>| {
        kind_by_plural(&group_version, plural)
            .map(|kind| Target {
                kind,
                namespace: namespace.map(str::to_string),
                name: name.map(str::to_string),
                sub: sub.map(str::to_string),
            })
            .ok_or("no such resource")
    };
    Some(match rest {
        ["tokenreviews"] => return Some(Err("tokenreviews")),
        ["selfsubjectaccessreviews"] => return Some(Err("selfsubjectaccessreviews")),
        ["subjectaccessreviews"] => return Some(Err("subjectaccessreviews")),
        ["namespaces", ns, plural] => target(plural, Some(ns), None, None),
        ["namespaces", ns, plural, name] => target(plural, Some(ns), Some(name), None),
        ["namespaces", ns, plural, name, sub] => target(plural, Some(ns), Some(name), Some(sub)),
        ["namespaces", name] => target("namespaces", None, Some(name), None),
        [plural] => target(plural, None, None, None),
        [plural, name] => target(plural, None, Some(name), None),
        _ => Err("no such path"),
    })
}

async fn handle(shared: Arc<Shared>, req: Request<Incoming>) -> Response<Body> {
    let token = req
        .headers()
        .get("authorization")
        .and_then(|h| h.to_str().ok())
        .and_then(|h| h.strip_prefix("Bearer "))
        .map(str::to_string);
    let user = token.and_then(|t| shared.tokens.lock().get(&t).cloned());
    let Some(user) = user else {
        return status_error(StatusCode::UNAUTHORIZED, "Unauthorized", "Unauthorized");
    };
    let query: HashMap<String, String> = req
        .uri()
        .query()
        .map(|q| {
            q.split('&')
                .filter_map(|kv| kv.split_once('=').or(Some((kv, ""))))
                .map(|(k, v)| (k.to_string(), percent_decode(v)))
                .collect()
        })
        .unwrap_or_default();
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => return status_error(StatusCode::BAD_REQUEST, "BadRequest", "unreadable body"),
    };
    if path == "/version" && method == Method::GET {
        return access::version();
    }
    if method == Method::POST && path.ends_with("/tokenreviews") {
        wait_while_held(&shared, &user, "create", "tokenreviews").await;
    }
    let target = match parse_path(&path) {
        Some(Ok(t)) => t,
        Some(Err("tokenreviews")) if method == Method::POST => return token_review(&shared, &body),
        Some(Err("selfsubjectaccessreviews")) if method == Method::POST => {
            return access::self_subject_access_review(&shared, &user, &body)
        }
        Some(Err("subjectaccessreviews")) if method == Method::POST => {
            return access::subject_access_review(&shared, &body)
        }
        _ => {
            return status_error(
                StatusCode::NOT_FOUND,
                "NotFound",
                &format!("{method} {path}: not found"),
            )
        }
    };
    if let Some(verb) = verb_of(&method, &target, &query) {
        wait_while_held(&shared, &user, verb, target.kind.plural).await;
    }
    if let Some(refused) = authorize(&shared, &user, &method, &target, &query) {
        return refused;
    }
    match (&method, &target.name, &target.sub) {
        (&Method::GET, None, None) => {
            let filter = match Filter::parse(
                query.get("labelSelector").map(String::as_str),
                query.get("fieldSelector").map(String::as_str),
            ) {
                Ok(f) => f,
                Err(e) => return status_error(StatusCode::BAD_REQUEST, "BadRequest", &e),
            };
            let watching = matches!(query.get("watch").map(String::as_str), Some("true" | "1"));
            match watching {
                true => {
                    count(&shared, format!("watch:{}", target.kind.plural));
                    if let Some(selector) = query.get("labelSelector") {
                        count(&shared, format!("watch:{}?{selector}", target.kind.plural));
                    }
                }
                false => match query.get("labelSelector") {
                    Some(selector) => {
                        count(&shared, format!("list:{}?{selector}", target.kind.plural))
                    }
                    None => count(&shared, format!("list:{}", target.kind.plural)),
                },
            }
            if shared.failing.load(Ordering::SeqCst) {
                return status_error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "InternalError",
                    "etcdserver: request timed out (the test API server is failing)",
                );
            }
            match watching {
                true => watch(shared, target, filter, &query),
                false => list(&shared, &target, &filter, &query),
            }
        }
        (&Method::GET, Some(name), None) => {
            let ns = target.namespace.clone().unwrap_or_default();
            match shared.store.lock().get(target.kind, &ns, name) {
                Some(obj) => json_response(StatusCode::OK, &obj),
                None => status_error(
                    StatusCode::NOT_FOUND,
                    "NotFound",
                    &format!("{} \"{name}\" not found", target.kind.resource()),
                ),
            }
        }
        (&Method::POST, None, None) | (&Method::PUT, Some(_), None) => {
            let mut object: Value = match serde_json::from_slice(&body) {
                Ok(v) => v,
                Err(e) => {
                    return status_error(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string())
                }
            };
            if let Some(ns) = &target.namespace {
                object["metadata"]["namespace"] = json!(ns);
            }
            let ns = target.namespace.clone().unwrap_or_default();
            let name = object["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            let namespaces = kind_by_name("Namespace").expect("namespaces are served");
            if target.kind.namespaced && shared.store.lock().get(namespaces, "", &ns).is_none() {
                return status_error(
                    StatusCode::NOT_FOUND,
                    "NotFound",
                    &format!("namespaces \"{ns}\" not found"),
                );
            }
            let create = method == Method::POST;
            let dry_run = query.get("dryRun").is_some_and(|v| v == "All");
            let old = match precondition(&shared, &target, &ns, &name, &object, create) {
                Ok(old) => old,
                Err(refused) => return *refused,
            };
            let attempt = admission::Attempt {
                kind: target.kind,
                operation: if create { "CREATE" } else { "UPDATE" },
                object,
                old,
                user: &user,
                dry_run,
            };
            let object = match admission::admit(&shared, attempt).await {
                Ok(object) => object,
                Err(admission::Refusal(refused)) => return *refused,
            };
            let status = if create {
                StatusCode::CREATED
            } else {
                StatusCode::OK
            };
            if dry_run {
                return json_response(status, &object);
            }
            // Checked again with writes serialized: another client may have written meanwhile.
            let _writing = shared.writes.lock();
            if let Err(refused) = precondition(&shared, &target, &ns, &name, &object, create) {
                return *refused;
            }
            let verb = if create { "create" } else { "update" };
            count(&shared, format!("{verb}:{}", target.kind.plural));
            log_write(&shared, &user, verb, &target, (&ns, &name), &object);
            json_response(status, &upsert(&shared, target.kind, object))
        }
        // The status subresource, as custom resources with `subresources.status` have it: a JSON
        // merge patch of which only `status` is kept.
        (&Method::PATCH, Some(name), Some(sub)) if sub == "status" => {
            let patch: Value = match serde_json::from_slice(&body) {
                Ok(v) => v,
                Err(e) => {
                    return status_error(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string())
                }
            };
            let ns = target.namespace.clone().unwrap_or_default();
            let _writing = shared.writes.lock();
            let Some(mut object) = shared.store.lock().get(target.kind, &ns, name) else {
                return status_error(
                    StatusCode::NOT_FOUND,
                    "NotFound",
                    &format!("{} \"{name}\" not found", target.kind.resource()),
                );
            };
            json_patch::merge(&mut object["status"], &patch["status"]);
            count(&shared, format!("patch-status:{}", target.kind.plural));
            log_write(
                &shared,
                &user,
                "patch-status",
                &target,
                (&ns, name),
                &object,
            );
            json_response(StatusCode::OK, &upsert(&shared, target.kind, object))
        }
        (&Method::DELETE, Some(name), None) => {
            let ns = target.namespace.clone().unwrap_or_default();
            let deleted = shared.store.lock().delete(target.kind, &ns, name);
            match deleted {
                Some(obj) => {
                    log_write(&shared, &user, "delete", &target, (&ns, name), &obj);
                    json_response(StatusCode::OK, &obj)
                }
                None => status_error(
                    StatusCode::NOT_FOUND,
                    "NotFound",
                    &format!("{name} not found"),
                ),
            }
        }
        (&Method::POST, Some(name), Some(sub))
            if target.kind.plural == "serviceaccounts" && sub == "token" =>
        {
            token_request(
                &shared,
                target.namespace.as_deref().unwrap_or_default(),
                name,
                &body,
            )
        }
        _ => status_error(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            "method not allowed",
        ),
    }
}

/// What a create or update requires, as the real API server words its refusals: a create needs no
/// object of that name, an update needs one, at the `resourceVersion` it names (if any). Returns the
/// current object.
fn precondition(
    shared: &Shared,
    target: &Target,
    ns: &str,
    name: &str,
    object: &Value,
    create: bool,
) -> Result<Option<Value>, Box<Response<Body>>> {
    let current = shared.store.lock().get(target.kind, ns, name);
    let resource = target.kind.resource();
    match (&current, create) {
        (Some(_), true) => Err(Box::new(status_error(
            StatusCode::CONFLICT,
            "AlreadyExists",
            &format!("{resource} \"{name}\" already exists"),
        ))),
        (None, false) => Err(Box::new(status_error(
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!("{resource} \"{name}\" not found"),
        ))),
        (Some(stored), false) => {
            let wanted = object["metadata"]["resourceVersion"]
                .as_str()
                .unwrap_or_default();
            let actual = stored["metadata"]["resourceVersion"]
                .as_str()
                .unwrap_or_default();
            if !wanted.is_empty() && wanted != actual {
                return Err(Box::new(status_error(
                    StatusCode::CONFLICT,
                    "Conflict",
                    &format!("Operation cannot be fulfilled on {resource} \"{name}\": the object has been modified; please apply your changes to the latest version and try again"),
                )));
            }
            Ok(current)
        }
        (None, true) => Ok(None),
    }
}

/// Keeps a request a test holds (`hold`) waiting until it lets go.
async fn wait_while_held(shared: &Shared, user: &User, verb: &str, plural: &str) {
    let key = (user.username.clone(), verb.to_string(), plural.to_string());
    loop {
        let let_go = shared.let_go.notified();
        if !shared.held.lock().contains(&key) {
            return;
        }
        let_go.await;
    }
}

/// The RBAC verb of a request.
fn verb_of(
    method: &Method,
    target: &Target,
    query: &HashMap<String, String>,
) -> Option<&'static str> {
    let watch = matches!(query.get("watch").map(String::as_str), Some("true" | "1"));
    Some(match (method, &target.name) {
        (&Method::GET, None) if watch => "watch",
        (&Method::GET, None) => "list",
        (&Method::GET, Some(_)) => "get",
        (&Method::POST, _) => "create",
        (&Method::PUT, _) => "update",
        (&Method::DELETE, _) => "delete",
        _ => return None,
    })
}

fn log_write(
    shared: &Shared,
    user: &User,
    verb: &'static str,
    target: &Target,
    (namespace, name): (&str, &str),
    object: &Value,
) {
    shared.write_log.lock().push(Write {
        at: std::time::Instant::now(),
        user: user.username.clone(),
        verb,
        plural: target.kind.plural.to_string(),
        namespace: namespace.to_string(),
        name: name.to_string(),
        object: object.clone(),
    });
}

/// 403 Forbidden, worded as the real API server's RBAC authorizer, if a test denied this.
fn authorize(
    shared: &Shared,
    user: &User,
    method: &Method,
    target: &Target,
    query: &HashMap<String, String>,
) -> Option<Response<Body>> {
    let verb = verb_of(method, target, query)?;
    let key = (
        user.username.clone(),
        verb.to_string(),
        target.kind.plural.to_string(),
    );
    let refused = match shared.rbac_enforced.lock().contains(&user.username) {
        true => {
            let asked = access::Asked {
                namespace: target.namespace.as_deref().unwrap_or_default(),
                verb,
                group: target.kind.group,
                resource: target.kind.plural,
                name: target.name.as_deref().unwrap_or_default(),
            };
            let groups: Vec<&str> = user.groups.iter().map(String::as_str).collect();
            !access::rbac_allows(shared, &user.username, &groups, &asked)
        }
        false => shared.denied.lock().contains(&key),
    };
    if !refused {
        return None;
    }
    let scope = match &target.namespace {
        Some(ns) => format!("in the namespace \"{ns}\""),
        None => "at the cluster scope".to_string(),
    };
    let object = match &target.name {
        Some(name) => format!("{} \"{name}\"", target.kind.resource()),
        None => target.kind.resource(),
    };
    Some(status_error(
        StatusCode::FORBIDDEN,
        "Forbidden",
        &format!(
            "{object} is forbidden: User \"{}\" cannot {verb} resource \"{}\" in API group \"{}\" {scope}",
            user.username, target.kind.plural, target.kind.group
        ),
    ))
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => match u8::from_str_radix(&s[i + 1..i + 3], 16) {
                Ok(b) => {
                    out.push(b);
                    i += 3;
                    continue;
                }
                Err(_) => out.push(b'%'),
            },
            b'+' => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).to_string()
}

/// Stores an object; a service-account token Secret is filled in as Kubernetes' token controller does.
fn upsert(shared: &Shared, kind: ResourceKind, mut object: Value) -> Value {
    object["apiVersion"] = json!(kind.api_version);
    if kind.plural == "secrets" {
        // As the real API server: stringData is merged into data, base64-encoded, and not stored.
        if let Some(strings) = object.as_object_mut().and_then(|o| o.remove("stringData")) {
            for (key, value) in strings.as_object().into_iter().flatten() {
                let encoded = base64::engine::general_purpose::STANDARD
                    .encode(value.as_str().unwrap_or_default());
                object["data"][key] = json!(encoded);
            }
        }
    }
    let is_sa_token = object["type"] == "kubernetes.io/service-account-token"
        && object["data"]["token"].is_null();
    if kind.plural == "secrets" && is_sa_token {
        let ns = object["metadata"]["namespace"]
            .as_str()
            .unwrap_or("default")
            .to_string();
        let sa = object["metadata"]["annotations"]["kubernetes.io/service-account.name"]
            .as_str()
            .unwrap_or("default")
            .to_string();
        let token = new_token(shared, &ns, &sa, Vec::new());
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        object["data"] =
            json!({"token": b64(&token), "ca.crt": b64(&shared.ca_pem), "namespace": b64(&ns)});
    }
    shared.store.lock().upsert(kind, object)
}

fn new_token(
    shared: &Shared,
    namespace: &str,
    service_account: &str,
    audiences: Vec<String>,
) -> String {
    let serial = shared.token_serial.fetch_add(1, Ordering::Relaxed) + 1;
    let token = format!("sa-{namespace}-{service_account}-{serial}");
    let mut user = User::service_account(namespace, service_account);
    user.audiences = audiences;
    shared.tokens.lock().insert(token.clone(), user);
    token
}

fn token_request(shared: &Shared, namespace: &str, name: &str, body: &[u8]) -> Response<Body> {
    let request: Value = serde_json::from_slice(body).unwrap_or_default();
    let audiences: Vec<String> = request["spec"]["audiences"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    let token = new_token(shared, namespace, name, audiences.clone());
    json_response(
        StatusCode::CREATED,
        &json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "metadata": {"name": name, "namespace": namespace},
                "spec": {"audiences": audiences},
                "status": {"token": token, "expirationTimestamp": "2099-01-01T00:00:00Z"}}),
    )
}

fn token_review(shared: &Shared, body: &[u8]) -> Response<Body> {
    count(shared, "tokenreview".into());
    let review: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => return status_error(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string()),
    };
    let token = review["spec"]["token"].as_str().unwrap_or_default();
    let wanted: Vec<String> = review["spec"]["audiences"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    let user = shared.tokens.lock().get(token).cloned();
    let status = match user {
        None => json!({"authenticated": false, "error": "invalid bearer token"}),
        Some(user) => {
            let audiences: Vec<String> = if user.audiences.is_empty() {
                wanted.clone()
            } else {
                wanted
                    .iter()
                    .filter(|a| user.audiences.contains(a))
                    .cloned()
                    .collect()
            };
            if !wanted.is_empty() && audiences.is_empty() {
                json!({"authenticated": false, "error": "token audiences do not match"})
            } else {
                json!({"authenticated": true, "audiences": audiences,
                       "user": {"username": user.username, "uid": user.uid, "groups": user.groups,
                                "extra": user.extra}})
            }
        }
    };
    json_response(
        StatusCode::CREATED,
        &json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                "metadata": {}, "spec": review["spec"], "status": status}),
    )
}

/// A list, paginated as the real API server does with `limit` and `continue` (the token carries the
/// first page's resource version and the offset).
fn list(
    shared: &Shared,
    target: &Target,
    filter: &Filter,
    query: &HashMap<String, String>,
) -> Response<Body> {
    let store = shared.store.lock();
    let (version, offset) = query
        .get("continue")
        .and_then(|c| c.split_once(':'))
        .and_then(|(rv, off)| Some((rv.parse::<u64>().ok()?, off.parse::<usize>().ok()?)))
        .unwrap_or((store.resource_version(), 0));
    let limit = query
        .get("limit")
        .and_then(|l| l.parse::<usize>().ok())
        .filter(|l| *l > 0)
        .unwrap_or(usize::MAX);
    let (page, more) = store.list_page(
        target.kind,
        target.namespace.as_deref(),
        filter,
        offset,
        limit,
    );
    let mut metadata = json!({"resourceVersion": version.to_string()});
    if more {
        metadata["continue"] = json!(format!("{version}:{}", offset + page.len()));
    }
    json_response(
        StatusCode::OK,
        &json!({"kind": format!("{}List", target.kind.kind), "apiVersion": target.kind.api_version,
                "metadata": metadata, "items": page}),
    )
}

/// An event as a selected watch sees it, as the API server's watch cache sends it: a modification
/// that takes an object out of the selection is its DELETED, one that brings it in its ADDED.
fn selected_event(event: &store::Event, in_scope: &impl Fn(&Value) -> bool) -> Option<Bytes> {
    let now = in_scope(&event.object);
    let before = event.previous.as_deref().map(in_scope);
    let kind = match (event.kind.as_str(), before, now) {
        ("MODIFIED", Some(true), false) => "DELETED",
        ("MODIFIED", Some(false), true) => "ADDED",
        (kind, _, true) => kind,
        _ => return None,
    };
    Some(watch_line(kind, &event.object))
}

fn watch_line(kind: &str, object: &Value) -> Bytes {
    let mut line = json!({"type": kind, "object": object}).to_string();
    line.push('\n');
    Bytes::from(line)
}

fn watch(
    shared: Arc<Shared>,
    target: Target,
    filter: Filter,
    query: &HashMap<String, String>,
) -> Response<Body> {
    let from: Option<u64> = query
        .get("resourceVersion")
        .filter(|v| !v.is_empty() && *v != "0")
        .and_then(|v| v.parse().ok());
    let bookmarks = query
        .get("allowWatchBookmarks")
        .is_some_and(|v| v == "true");
    let timeout = query
        .get("timeoutSeconds")
        .and_then(|v| v.parse().ok())
        .map(Duration::from_secs)
        .unwrap_or(Duration::from_secs(300));
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(1024);
    let kind = target.kind;
    let namespace = target.namespace.clone();
    let in_scope = move |object: &Value| {
        namespace
            .as_deref()
            .is_none_or(|ns| object["metadata"]["namespace"].as_str() == Some(ns))
            && filter.matches(object)
    };
    let mut ended = shared.watches_end.subscribe();
    tokio::spawn(async move {
        let (replay, mut live) = {
            let store = shared.store.lock();
            match from {
                Some(rv) => match store.watch_from(rv) {
                    WatchStart::Replay(events, live) => (
                        events
                            .into_iter()
                            .filter(|e| e.plural == kind.plural)
                            .filter_map(|e| selected_event(&e, &in_scope))
                            .collect::<Vec<_>>(),
                        live,
                    ),
                    WatchStart::Gone { requested, oldest } => {
                        let status = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                            "message": format!("too old resource version: {requested} ({oldest})"),
                            "reason": "Expired", "code": 410});
                        let _ = tx.try_send(watch_line("ERROR", &status));
                        return;
                    }
                },
                None => {
                    let current = store.list(kind, None, &Filter::default());
                    let lines = current
                        .iter()
                        .filter(|o| in_scope(o))
                        .map(|o| watch_line("ADDED", o))
                        .collect();
                    (lines, store.subscribe())
                }
            }
        };
        for line in replay {
            if tx.send(line).await.is_err() {
                return;
            }
        }
        let deadline = tokio::time::Instant::now() + timeout;
        let mut ticker = tokio::time::interval(shared.bookmark_interval);
        loop {
            let line = tokio::select! {
                event = live.recv() => match event {
                    Ok(e) if e.plural == kind.plural => match selected_event(&e, &in_scope) {
                        Some(line) => line,
                        None => continue,
                    },
                    Ok(_) => continue,
                    Err(_) => return,
                },
                _ = ticker.tick(), if bookmarks => {
                    let rv = shared.store.lock().resource_version().to_string();
                    watch_line("BOOKMARK", &json!({"kind": kind.kind, "apiVersion": kind.api_version,
                        "metadata": {"resourceVersion": rv}}))
                }
                _ = tokio::time::sleep_until(deadline) => return,
                _ = ended.changed() => return,
            };
            while shared.hang.load(Ordering::SeqCst) {
                shared.unhang.notified().await;
            }
            if tx.send(line).await.is_err() {
                return;
            }
        }
    });
    let stream = tokio_stream::wrappers::ReceiverStream::new(rx)
        .map(|b| Ok::<_, Infallible>(Frame::data(b)));
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .body(BodyExt::boxed(StreamBody::new(stream)))
        .expect("response")
}
