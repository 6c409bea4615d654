//! The anchor every xDS figure is set beside: the simplest fair server that could serve the
//! harness's proxies, as a careful first implementation would write it. Plain tonic and prost, a
//! fixed set of resources (captured from meshpilot, so both send the same bytes), each encoded once
//! as a `google.protobuf.Any` when it is loaded or changed, its bytes shared by every stream. When
//! one resource changes every stream watching it is sent that type again: SotW the whole subscribed
//! list, Delta the changed resource. Each stream has one task and a bounded channel, and writes
//! each response as its small envelope (version, type URL, nonce; for Delta each resource's name
//! and version) around the shared bytes (`naive_codec`); no resource is encoded per stream. No
//! registry, no model, no lists or responses shared between streams: the cost a control plane's
//! own work sits on.
//!
//! It runs as a child process (the bench binary started again as `naive-serve <file>`), so its CPU
//! and memory are read from /proc like meshpilot's. Changes arrive as lines on its stdin.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::convert::Infallible;
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::core::v3::{address, socket_address, Node};
use envoy_types::pb::envoy::config::endpoint::v3::{lb_endpoint, ClusterLoadAssignment};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::google::protobuf::Any;
use parking_lot::{Mutex, RwLock};
use prost::Message;
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::codegen::{http, Body, BoxFuture, Service, StdError};
use tonic::server::{Grpc, NamedService};
use tonic::{Request, Response, Status, Streaming};

use super::ads::{self, Subscription, ADDRESS, CDS, EDS, NDS};
use super::naive_codec::{AdsCodec, DeltaResource, Envelope};

/// The subcommand the bench binary runs the anchor under.
pub const SUBCOMMAND: &str = "naive-serve";

/// The anchor as a child process.
pub struct NaiveServer {
    child: Child,
    stdin: Mutex<ChildStdin>,
    pub xds: SocketAddr,
    _resources: tempfile::NamedTempFile,
}

impl NaiveServer {
    /// Starts the anchor serving `resources`; returns once it listens.
    pub fn start(resources: Vec<Any>) -> NaiveServer {
        let mut file = tempfile::NamedTempFile::new().expect("temp file");
        let all = DiscoveryResponse {
            resources,
            ..Default::default()
        };
        file.write_all(&all.encode_to_vec())
            .expect("write resources");
        let mut child = Command::new(std::env::current_exe().expect("bench binary"))
            .arg(SUBCOMMAND)
            .arg(file.path())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the naive server");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("naive server address");
        let xds = line
            .trim()
            .strip_prefix("xds ")
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("naive server did not start: {line:?}"));
        let stdin = Mutex::new(child.stdin.take().expect("stdin"));
        NaiveServer {
            child,
            stdin,
            xds,
            _resources: file,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kills the anchor at once (SIGKILL), as a replica dies.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The first endpoint of `cluster`'s assignment moves to `address`.
    pub fn move_endpoint(&self, cluster: &str, address: &str) {
        self.command(&format!("endpoint {cluster} {address}"));
    }

    /// A cluster `name` is added, a copy of the first one.
    pub fn add_cluster(&self, name: &str) {
        self.command(&format!("cluster {name}"));
    }

    /// The workload `uid` (ambient's Address) turns healthy.
    pub fn workload_ready(&self, uid: &str) {
        self.command(&format!("workload-ready {uid}"));
    }

    /// The name table gains `host` (a Kubernetes service `<name>.<namespace>…`) at `address`.
    pub fn add_name(&self, host: &str, address: &str) {
        self.command(&format!("name {host} {address}"));
    }

    fn command(&self, line: &str) {
        let mut stdin = self.stdin.lock();
        writeln!(stdin, "{line}").expect("naive server alive");
        stdin.flush().expect("naive server alive");
    }
}

impl Drop for NaiveServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What `server` sends for each subscription, as the anchor's fixed resources.
pub async fn capture(server: SocketAddr, subscriptions: Vec<Subscription>) -> Vec<Any> {
    let mut all = Vec::new();
    for sub in subscriptions {
        let channel = ads::connect(server).await.expect("connect to capture");
        let (done, finished) = tokio::sync::oneshot::channel::<()>();
        let mut done = Some(done);
        let mut pending: BTreeSet<&str> = sub.types.iter().map(|(t, _)| *t).collect();
        let mut got = Vec::new();
        let cancel = async {
            let _ = finished.await;
        };
        ads::stream(
            channel,
            &sub,
            |raw| {
                let response = DiscoveryResponse::decode(raw.body.clone()).expect("a response");
                got.extend(response.resources);
                pending.remove(raw.type_url.as_str());
                if pending.is_empty() {
                    done.take().map(|d| d.send(()));
                }
            },
            cancel,
        )
        .await
        .expect("capture stream");
        all.append(&mut got);
    }
    all
}

/// A SotW subscription of `node` to one type.
pub fn subscription(node: Node, type_url: &'static str, names: Vec<String>) -> Subscription {
    Subscription {
        node,
        delta: false,
        types: vec![(type_url, names)],
    }
}

/// The child process: serves the resources in `path` on 127.0.0.1:0, prints `xds <addr>`, and
/// applies the changes read from stdin until it closes.
pub fn serve(path: &str) {
    let bytes = std::fs::read(path).expect("resources file");
    let state = Arc::new(State::new(
        DiscoveryResponse::decode(&bytes[..])
            .expect("resources")
            .resources,
    ));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        // The same accept backlog as meshpilot's, for thousands of proxies connecting at once.
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket
            .bind("127.0.0.1:0".parse().expect("address"))
            .expect("bind");
        let listener = socket.listen(4096).expect("listen");
        println!("xds {}", listener.local_addr().expect("address"));
        let commands = state.clone();
        std::thread::spawn(move || {
            for line in std::io::stdin().lock().lines() {
                let Ok(line) = line else { break };
                commands.apply(&line);
            }
            std::process::exit(0);
        });
        let incoming =
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
        tonic::transport::Server::builder()
            .add_service(Naive(state))
            .serve_with_incoming(incoming)
            .await
            .expect("serve");
    });
}

/// One resource as the anchor holds it: its version and its `google.protobuf.Any`, encoded once
/// when loaded or changed; every stream sent it shares these bytes.
#[derive(Clone)]
struct Shared {
    version: u64,
    any: Bytes,
}

impl Shared {
    fn new(version: u64, any: &Any) -> Shared {
        Shared {
            version,
            any: any.encode_to_vec().into(),
        }
    }

    fn decode(&self) -> Any {
        Any::decode(&self.any[..]).expect("an Any")
    }
}

/// Type URL → name → resource.
type ByType = HashMap<String, BTreeMap<Arc<str>, Shared>>;

/// The resources by type and name, each with a version, and the changes as they happen.
struct State {
    resources: RwLock<ByType>,
    changes: broadcast::Sender<(String, String)>,
}

impl State {
    fn new(resources: Vec<Any>) -> State {
        let mut by_type = ByType::new();
        for any in resources {
            let name = resource_name(&any);
            by_type
                .entry(any.type_url.clone())
                .or_default()
                .insert(name.into(), Shared::new(1, &any));
        }
        State {
            resources: RwLock::new(by_type),
            // The harness changes one resource at a time; a stream this far behind is ended.
            changes: broadcast::channel(4096).0,
        }
    }

    /// One stdin command: `endpoint <cluster> <address>`, `cluster <name>`, `name <host> <address>`
    /// or `workload-ready <uid>`.
    fn apply(&self, line: &str) {
        let words: Vec<&str> = line.split_whitespace().collect();
        let changed = match words[..] {
            ["endpoint", cluster, address] => self.update(EDS, cluster, |any| {
                let mut cla = ClusterLoadAssignment::decode(&any.value[..]).expect("assignment");
                let first = cla
                    .endpoints
                    .iter_mut()
                    .flat_map(|l| l.lb_endpoints.iter_mut())
                    .next()
                    .expect("an endpoint");
                if let Some(lb_endpoint::HostIdentifier::Endpoint(e)) = &mut first.host_identifier {
                    if let Some(address::Address::SocketAddress(s)) =
                        e.address.as_mut().and_then(|a| a.address.as_mut())
                    {
                        s.address = address.to_string();
                        s.port_specifier = Some(socket_address::PortSpecifier::PortValue(80));
                    }
                }
                any.value = cla.encode_to_vec();
            }),
            ["cluster", name] => {
                let mut resources = self.resources.write();
                let clusters = resources.get_mut(CDS).expect("clusters");
                let first = clusters.values().next().expect("a cluster").decode();
                let mut cluster = Cluster::decode(&first.value[..]).expect("cluster");
                cluster.name = name.to_string();
                if let Some(eds) = cluster.eds_cluster_config.as_mut() {
                    eds.service_name = name.to_string();
                }
                let any = Any {
                    type_url: CDS.to_string(),
                    value: cluster.encode_to_vec(),
                };
                clusters.insert(name.into(), Shared::new(1, &any));
                Some((CDS, name))
            }
            ["name", host, address] => self.update(NDS, "", |any| {
                use meshpilot::xds::name_table::{name_table::NameInfo, NameTable};
                let mut table = NameTable::decode(&any.value[..]).expect("name table");
                let mut parts = host.split('.');
                let (name, namespace) = (parts.next(), parts.next());
                table.table.insert(
                    host.to_string(),
                    NameInfo {
                        ips: vec![address.to_string()],
                        registry: "Kubernetes".into(),
                        shortname: name.unwrap_or_default().into(),
                        namespace: namespace.unwrap_or_default().into(),
                        ..Default::default()
                    },
                );
                any.value = table.encode_to_vec();
            }),
            ["workload-ready", uid] => self.update(ADDRESS, uid, |any| {
                use meshpilot::xds::istio_protos::workload::{address, Address, WorkloadStatus};
                let mut message = Address::decode(&any.value[..]).expect("an address");
                if let Some(address::Type::Workload(w)) = message.r#type.as_mut() {
                    w.status = WorkloadStatus::Healthy as i32;
                }
                any.value = message.encode_to_vec();
            }),
            _ => panic!("unknown command {line:?}"),
        };
        if let Some((type_url, name)) = changed {
            let _ = self.changes.send((type_url.to_string(), name.to_string()));
        }
    }

    fn update<'a>(
        &self,
        type_url: &'static str,
        name: &'a str,
        change: impl FnOnce(&mut Any),
    ) -> Option<(&'static str, &'a str)> {
        let mut resources = self.resources.write();
        let shared = resources.get_mut(type_url)?.get_mut(name)?;
        let mut any = shared.decode();
        change(&mut any);
        *shared = Shared::new(shared.version + 1, &any);
        Some((type_url, name))
    }

    /// The resources of `type_url` named in `names` (all of them for none): their names and
    /// versions, and their shared bytes (not copied).
    fn select(&self, type_url: &str, names: &BTreeSet<String>) -> Vec<(Arc<str>, Shared)> {
        let resources = self.resources.read();
        let Some(of_type) = resources.get(type_url) else {
            return Vec::new();
        };
        of_type
            .iter()
            .filter(|(name, _)| names.is_empty() || names.contains(&name[..]))
            .map(|(name, shared)| (name.clone(), shared.clone()))
            .collect()
    }
}

fn resource_name(any: &Any) -> String {
    use envoy_types::pb::envoy::config::listener::v3::Listener;
    match any.type_url.as_str() {
        CDS => Cluster::decode(&any.value[..]).map(|c| c.name),
        EDS => ClusterLoadAssignment::decode(&any.value[..]).map(|c| c.cluster_name),
        // One unnamed table.
        NDS => return String::new(),
        ADDRESS => {
            use meshpilot::xds::istio_protos::workload::{address, Address};
            let message = Address::decode(&any.value[..]).expect("an address");
            return match message.r#type {
                Some(address::Type::Workload(w)) => w.uid,
                Some(address::Type::Service(s)) => format!("{}/{}", s.namespace, s.hostname),
                None => String::new(),
            };
        }
        _ => Listener::decode(&any.value[..]).map(|l| l.name),
    }
    .expect("a resource the harness knows")
}

/// Type URL → the names a stream watches (none: all of them).
type Watched = HashMap<String, BTreeSet<String>>;

/// What a type and names to answer with: (type URL, names; none for all).
type Answer = (String, BTreeSet<String>);

/// What SotW and Delta streams differ in.
trait Variant: Send + 'static {
    type Request: Message + Default + Send + 'static;
    /// Updates what the stream watches; what to answer, if anything.
    fn on_request(watched: &mut Watched, request: Self::Request) -> Option<Answer>;
    /// What to send the stream when `name` of `type_url` changed, if it watches it.
    fn on_change(watched: &Watched, type_url: String, name: String) -> Option<Answer>;
    fn response(state: &State, answer: &Answer, nonce: u64) -> Envelope;
}

struct Sotw;

impl Variant for Sotw {
    type Request = DiscoveryRequest;

    fn on_request(watched: &mut Watched, request: DiscoveryRequest) -> Option<Answer> {
        let names: BTreeSet<String> = request.resource_names.into_iter().collect();
        // An ACK of what the stream already watches needs no answer.
        if !request.response_nonce.is_empty() && watched.get(&request.type_url) == Some(&names) {
            return None;
        }
        watched.insert(request.type_url.clone(), names.clone());
        Some((request.type_url, names))
    }

    fn on_change(watched: &Watched, type_url: String, name: String) -> Option<Answer> {
        let names = watched.get(&type_url)?;
        (names.is_empty() || names.contains(&name)).then(|| (type_url, names.clone()))
    }

    fn response(state: &State, (type_url, names): &Answer, nonce: u64) -> Envelope {
        let resources = state.select(type_url, names);
        Envelope::Sotw {
            version_info: resources
                .iter()
                .map(|(_, r)| r.version)
                .sum::<u64>()
                .to_string(),
            resources: resources.into_iter().map(|(_, r)| r.any).collect(),
            type_url: type_url.clone(),
            nonce: nonce.to_string(),
        }
    }
}

struct Delta;

impl Variant for Delta {
    type Request = DeltaDiscoveryRequest;

    fn on_request(watched: &mut Watched, request: DeltaDiscoveryRequest) -> Option<Answer> {
        if request.resource_names_subscribe.is_empty() && !request.response_nonce.is_empty() {
            return None;
        }
        let new: BTreeSet<String> = request.resource_names_subscribe.into_iter().collect();
        watched
            .entry(request.type_url.clone())
            .or_default()
            .extend(new.iter().cloned());
        Some((request.type_url, new))
    }

    fn on_change(watched: &Watched, type_url: String, name: String) -> Option<Answer> {
        let names = watched.get(&type_url)?;
        (names.is_empty() || names.contains(&name)).then(|| (type_url, BTreeSet::from([name])))
    }

    fn response(state: &State, (type_url, names): &Answer, nonce: u64) -> Envelope {
        Envelope::Delta {
            resources: state
                .select(type_url, names)
                .into_iter()
                .map(|(name, r)| DeltaResource {
                    name,
                    version: r.version.to_string(),
                    any: r.any,
                })
                .collect(),
            type_url: type_url.clone(),
            nonce: nonce.to_string(),
        }
    }
}

/// One stream's task: answers requests and changes until either side ends.
fn open<V: Variant>(
    state: Arc<State>,
    mut requests: Streaming<V::Request>,
) -> ReceiverStream<Result<Envelope, Status>> {
    let (tx, rx) = mpsc::channel(16);
    let mut changes = state.changes.subscribe();
    tokio::spawn(async move {
        let mut watched = Watched::new();
        let mut nonce = 0u64;
        loop {
            let answer = tokio::select! {
                request = requests.message() => match request {
                    Ok(Some(request)) => V::on_request(&mut watched, request),
                    _ => break,
                },
                change = changes.recv() => match change {
                    Ok((type_url, name)) => V::on_change(&watched, type_url, name),
                    Err(_) => break,
                },
            };
            let Some(answer) = answer else { continue };
            nonce += 1;
            if tx
                .send(Ok(V::response(&state, &answer, nonce)))
                .await
                .is_err()
            {
                break;
            }
        }
    });
    ReceiverStream::new(rx)
}

const SOTW_PATH: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources";
const DELTA_PATH: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources";

/// The ADS service, mounted by hand: the generated server is tied to prost's codec, which would
/// encode every response whole, resources included, per stream.
#[derive(Clone)]
struct Naive(Arc<State>);

impl NamedService for Naive {
    const NAME: &'static str = "envoy.service.discovery.v3.AggregatedDiscoveryService";
}

impl<B> Service<http::Request<B>> for Naive
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
        let state = self.0.clone();
        match request.uri().path() {
            SOTW_PATH => Box::pin(method::<Sotw, B>(state, request)),
            DELTA_PATH => Box::pin(method::<Delta, B>(state, request)),
            _ => Box::pin(async { Ok(Status::unimplemented("no such method").into_http()) }),
        }
    }
}

/// One bidirectional ADS call: requests decoded with prost, responses written by `AdsCodec`.
async fn method<V: Variant, B>(
    state: Arc<State>,
    request: http::Request<B>,
) -> Result<http::Response<tonic::body::Body>, Infallible>
where
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    let call = tower::service_fn(move |request: Request<Streaming<V::Request>>| {
        let stream = open::<V>(state.clone(), request.into_inner());
        std::future::ready(Ok::<_, Status>(Response::new(stream)))
    });
    Ok(Grpc::new(AdsCodec::<V::Request>::default())
        .streaming(call, request)
        .await)
}
