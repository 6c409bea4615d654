//! The xDS load harness: K simulated proxies, each a real ADS stream on its own connection (half SotW,
//! half Delta; sidecars and proxyless gRPC clients), ACKing like Envoy, against the meshpilot binary
//! serving S services × E endpoints spread over C clusters held by test API servers (the config
//! cluster and C-1 remotes onboarded by Secret). meshpilot's CPU and RSS are read from /proc.
//!
//!   cargo bench --bench xds_load -- [scenario] [--proxies K] [--services S] [--endpoints E]
//!       [--clusters C] [--rounds R] [--debounce 0s] [--eds-per-proxy N] [--cds-every M]
//!       [--sidecar-hosts K] [--unselected N]
//!
//! Scenarios: `convergence` (EDS convergence, full push, memory per proxy, CPU per message),
//! `endpoints` (memory per endpoint and per service), `onboarding` (remote-cluster sync time and memory),
//! `single` (one change among S services reaching one subscribed proxy: file clusters, where each
//! round renames one file into a directory of S, and the same through the Kubernetes path),
//! `remotes` (C remote clusters of S services × E endpoints onboarded at once), `config` (S
//! DestinationRules and VirtualServices, one rule changed per round), `stalled` (EDS and full-push
//! convergence of the fleet with and without 64 streams that stopped reading), `relist` (C remotes
//! onboarded, then every watch of every remote relisting at once: meshpilot's peak memory), `all`.
//! Without arguments it is a small smoke run of every scenario (what CI runs).
//!
//! Every convergence and memory scenario runs twice in the same run: against meshpilot, then
//! against the naive fan-out (`harness::naive`) serving the resources meshpilot served, and prints
//! meshpilot/naive ratios.

#[path = "../tests/common/mod.rs"]
#[allow(unused_imports)]
mod common;
#[allow(dead_code)] // each harness uses its own subset
mod harness;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::wait_for;
use envoy_types::pb::google::protobuf::Any;
use harness::ads::{self, contains, Raw, Subscription, CDS, EDS, LDS};
use harness::naive::{self, NaiveServer};
use harness::plane::{
    self, peak_rss, proc_stats, remote_secret, reset_peak_rss, settled_rss, Plane, DECAY_QUIET, NS,
};
use parking_lot::Mutex;
use serde_json::json;
use test_apiserver::TestApiServer;
use tokio::task::JoinHandle;

#[derive(Clone, Debug)]
struct Args {
    scenario: String,
    proxies: usize,
    services: usize,
    endpoints: usize,
    clusters: usize,
    rounds: usize,
    debounce: String,
    eds_per_proxy: usize,
    /// One sidecar in this many watches every cluster (wildcard CDS); the rest EDS only.
    cds_every: usize,
    /// `config`: a Sidecar scopes the proxies' namespace to this many services (0: none).
    sidecar_hosts: usize,
    /// `remotes`: unselected namespaces of the same objects in each remote (0: no selectors).
    unselected: usize,
}

impl Args {
    /// How long memory must stop falling to count as settled: past the allocator's decay when
    /// measuring; the smoke run only exercises the code.
    fn quiet(&self) -> Duration {
        match self.scenario.as_str() {
            "smoke" => Duration::from_millis(500),
            _ => DECAY_QUIET,
        }
    }
}

fn args() -> Args {
    let raw: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let mut a = Args {
        scenario: "smoke".into(),
        proxies: 40,
        services: 20,
        endpoints: 6,
        clusters: 3,
        rounds: 3,
        debounce: "0s".into(),
        eds_per_proxy: 5,
        cds_every: 1,
        sidecar_hosts: 0,
        unselected: 0,
    };
    let mut it = raw.into_iter();
    while let Some(arg) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{arg} needs a value"));
        match arg.as_str() {
            "--proxies" => a.proxies = value().parse().expect("--proxies"),
            "--services" => a.services = value().parse().expect("--services"),
            "--endpoints" => a.endpoints = value().parse().expect("--endpoints"),
            "--clusters" => a.clusters = value().parse().expect("--clusters"),
            "--rounds" => a.rounds = value().parse().expect("--rounds"),
            "--debounce" => a.debounce = value(),
            "--eds-per-proxy" => a.eds_per_proxy = value().parse().expect("--eds-per-proxy"),
            "--cds-every" => a.cds_every = value().parse::<usize>().expect("--cds-every").max(1),
            "--sidecar-hosts" => a.sidecar_hosts = value().parse().expect("--sidecar-hosts"),
            "--unselected" => a.unselected = value().parse().expect("--unselected"),
            s if !s.starts_with('-') => a.scenario = s.to_string(),
            other => panic!("unknown argument {other}"),
        }
    }
    a
}

fn host(i: usize) -> String {
    format!("svc-{i}.{NS}.svc.cluster.local")
}

fn cluster_name(i: usize) -> String {
    format!("outbound|80||{}", host(i))
}

/// The address a round's change gives the hot service's endpoint.
fn mark(round: usize) -> String {
    format!("10.99.{}.{}", round / 250, round % 250 + 1)
}

fn ip(cluster: usize, n: usize) -> String {
    format!("10.{}.{}.{}", 100 + cluster, n / 250, n % 250 + 1)
}

/// The label of the bench's namespace, which the mesh config selects in `remotes --unselected`.
const SELECTED: (&str, &str) = ("istio-discovery", "enabled");

/// Nodes of each cluster: its pods are spread over them, and they give the pods' localities.
const NODES: usize = 100;

/// Services `range` with their pods and slices in namespace `ns`, as cluster `c` holds them: the
/// endpoints `j` with `j % clusters == c % clusters`, at addresses of their own per `c`, on the
/// cluster's nodes. The bench's namespace is labelled as `--unselected` runs select it.
fn populate(
    api: &TestApiServer,
    (ns, c): (&str, usize),
    clusters: usize,
    services: std::ops::Range<usize>,
    endpoints: usize,
) {
    let labels = match ns == NS {
        true => json!({SELECTED.0: SELECTED.1}),
        false => json!({}),
    };
    api.apply(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": labels}}));
    for node in 0..NODES {
        api.apply(json!({"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": format!("node-{node}"), "labels": {
                "topology.kubernetes.io/region": "region-1",
                "topology.kubernetes.io/zone": format!("zone-{}", node % 3)}}}));
    }
    for i in services {
        api.apply(json!({"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": format!("svc-{i}"), "namespace": ns},
            "spec": {"clusterIP": format!("10.96.{}.{}", i / 250, i % 250 + 1), "ports": [{"name": "http", "port": 80}]}}));
        let mut eps = Vec::new();
        for j in (0..endpoints).filter(|j| j % clusters == c % clusters) {
            let n = i * endpoints + j;
            let (pod, address) = (format!("p-{i}-{j}"), ip(c, n));
            api.apply(json!({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod, "namespace": ns, "labels": {"app": format!("svc-{i}"), "security.istio.io/tlsMode": "istio"}},
                "spec": {"serviceAccountName": format!("sa-{i}"), "nodeName": format!("node-{}", n % NODES), "containers": []},
                "status": {"podIP": address}}));
            eps.push(
                json!({"addresses": [address], "conditions": {"ready": true},
                "targetRef": {"kind": "Pod", "name": pod, "namespace": ns}}),
            );
        }
        api.apply(json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": format!("svc-{i}-c{c}"), "namespace": ns, "labels": {"kubernetes.io/service-name": format!("svc-{i}")}},
            "addressType": "IPv4", "ports": [{"name": "http", "port": 80}], "endpoints": eps}));
    }
}

async fn start_plane(a: &Args, services: usize, endpoints: usize, clusters: usize) -> Plane {
    start_plane_with(a, (services, endpoints, clusters), &[]).await
}

async fn start_plane_with(
    a: &Args,
    (services, endpoints, clusters): (usize, usize, usize),
    flags: &[&str],
) -> Plane {
    let mut servers = Vec::new();
    for c in 0..clusters {
        let api = TestApiServer::start_with_bookmarks(Duration::from_secs(30)).await;
        api.apply_yaml("apiVersion: v1\nkind: Namespace\nmetadata: {name: istio-system}\n");
        populate(&api, (NS, c), clusters, 0..services, endpoints);
        servers.push(api);
    }
    for c in 1..clusters {
        let secret = remote_secret(&servers[c], &format!("c{c}"));
        servers[0].apply(secret);
    }
    let mut all = vec!["--debounce-after", &a.debounce];
    all.extend_from_slice(flags);
    Plane::kube(servers, &all).await
}

/// meshpilot serving one file cluster `c0` of `services` files, one service each.
async fn start_file_plane(a: &Args, services: usize) -> Plane {
    plane::file_plane(services, |i| ip(0, i), &["--debounce-after", &a.debounce]).await
}

/// What the simulated proxies report back.
#[derive(Default)]
struct Observed {
    /// Round → latency of each proxy's first assignment showing that round's endpoint.
    eds: Mutex<HashMap<usize, Vec<Duration>>>,
    /// Round → latency of each proxy's first CDS response naming that round's new service.
    full: Mutex<HashMap<usize, Vec<Duration>>>,
    /// Round → latency of each proxy's first CDS response with that round's subset (a
    /// DestinationRule change).
    subset: Mutex<HashMap<usize, Vec<Duration>>>,
    ready: AtomicUsize,
    /// Since when sessions coming into sync are timed (a storm's connect, a replica's death).
    since: Mutex<Option<Instant>>,
    /// The time from `since` of each session that came into sync after it.
    resynced: Mutex<Vec<Duration>>,
    messages: AtomicUsize,
    /// Responses to proxies without a CDS watch: a DestinationRule change concerns them only if
    /// they watch its service.
    unconcerned: AtomicUsize,
}

/// The marks a round's change carries: the hot service's endpoint address, or a new service's name.
struct Round {
    started: Instant,
    id: usize,
}

#[derive(Clone)]
struct ProxySpec {
    index: usize,
    delta: bool,
    grpc: bool,
    /// A sidecar that also watches every cluster (wildcard CDS).
    cds: bool,
    names: Vec<String>,
}

/// One simulated proxy: subscribes, ACKs every response, records when marks arrive.
async fn proxy(
    xds: SocketAddr,
    spec: ProxySpec,
    observed: Arc<Observed>,
    round: Arc<Mutex<Option<Round>>>,
) {
    // A proxy whose stream fails before it is in sync starts over, as Envoy reconnects.
    while !session(xds, &spec, &observed, &round).await {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One ADS session; false if it ended before the proxy was in sync.
async fn session(
    xds: SocketAddr,
    spec: &ProxySpec,
    observed: &Arc<Observed>,
    round: &Arc<Mutex<Option<Round>>>,
) -> bool {
    let channel = loop {
        match ads::connect(xds).await {
            Ok(c) => break c,
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    let id = format!(
        "sidecar~10.250.{}.{}~load-{}.{NS}~{NS}.svc.cluster.local",
        spec.index / 250,
        spec.index % 250 + 1,
        spec.index
    );
    let mut metadata = vec![("CLUSTER_ID", "c0")];
    if spec.grpc {
        metadata.push(("GENERATOR", "grpc"));
    }
    // Sidecars watch every cluster (wildcard CDS); proxyless clients only their listeners' names.
    let types: Vec<(&str, Vec<String>)> = if spec.grpc {
        let listeners = spec
            .names
            .iter()
            .map(|n| format!("{}:80", n.trim_start_matches("outbound|80||")))
            .collect();
        vec![(LDS, listeners), (EDS, spec.names.clone())]
    } else if spec.cds {
        vec![(CDS, vec![]), (EDS, spec.names.clone())]
    } else {
        vec![(EDS, spec.names.clone())]
    };
    let subscription = Subscription {
        node: common::node(&id, &metadata),
        delta: spec.delta,
        types,
    };
    let record = |raw: &Raw| {
        observed.messages.fetch_add(1, Ordering::Relaxed);
        if !spec.cds || spec.grpc {
            observed.unconcerned.fetch_add(1, Ordering::Relaxed);
        }
        let guard = round.lock();
        let Some(r) = guard.as_ref() else { return };
        let latency = r.started.elapsed();
        if raw.type_url == EDS {
            let ip = mark(r.id);
            // SocketAddress.address (field 2): tag, length, the address itself.
            let needle: Vec<u8> = [0x12, ip.len() as u8]
                .into_iter()
                .chain(ip.bytes())
                .collect();
            if contains(&raw.body, &needle) {
                observed.eds.lock().entry(r.id).or_default().push(latency);
            }
        } else if raw.type_url == CDS {
            if contains(&raw.body, format!("||round-{}.", r.id).as_bytes()) {
                observed.full.lock().entry(r.id).or_default().push(latency);
            }
            if contains(&raw.body, format!("|round-{}|svc-", r.id).as_bytes()) {
                observed
                    .subset
                    .lock()
                    .entry(r.id)
                    .or_default()
                    .push(latency);
            }
        }
    };
    let wanted = subscription.types.len();
    let mut ready_types = 0;
    let arrived = |raw: &Raw| {
        record(raw);
        ready_types += 1;
        if ready_types == wanted {
            observed.ready.fetch_add(1, Ordering::Relaxed);
            if let Some(since) = *observed.since.lock() {
                observed.resynced.lock().push(since.elapsed());
            }
        }
    };
    let _ = ads::stream(channel, &subscription, arrived, std::future::pending()).await;
    ready_types >= wanted
}

fn percentiles(mut v: Vec<Duration>) -> (f64, f64, f64) {
    v.sort();
    let at = |q: f64| {
        v.get(((v.len() as f64 - 1.0) * q).round() as usize)
            .map_or(0.0, |d| d.as_secs_f64() * 1e3)
    };
    (at(0.5), at(0.99), at(1.0))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// The services proxy `index` watches the EDS of: the hot one and a spread of others.
fn watched_services(a: &Args, index: usize) -> impl Iterator<Item = usize> + '_ {
    std::iter::once(0).chain(
        (1..a.eds_per_proxy).map(move |k| 1 + (index * 7 + k * 13) % (a.services - 1).max(1)),
    )
}

/// Whether proxy `index` is a sidecar on wildcard CDS.
fn watches_cds(a: &Args, index: usize) -> bool {
    index % 4 != 3 && index.is_multiple_of(a.cds_every)
}

/// Proxy `index` of the fleet: half SotW, half Delta, one in four proxyless gRPC.
fn proxy_spec(a: &Args, index: usize) -> ProxySpec {
    ProxySpec {
        index,
        delta: index % 2 == 1,
        grpc: index % 4 == 3,
        cds: watches_cds(a, index),
        names: watched_services(a, index).map(cluster_name).collect(),
    }
}

/// Connects `count` more proxies in waves of 500, each wave in sync before the next; returns
/// their tasks (aborting one drops its connection).
async fn connect_proxies(
    xds: SocketAddr,
    a: &Args,
    count: usize,
    observed: &Arc<Observed>,
    round: &Arc<Mutex<Option<Round>>>,
) -> Vec<JoinHandle<()>> {
    let start = observed.ready.load(Ordering::Relaxed);
    let mut tasks = Vec::with_capacity(count);
    for wave in (0..count).collect::<Vec<_>>().chunks(500) {
        for &index in wave {
            let spec = proxy_spec(a, start + index);
            tasks.push(tokio::spawn(proxy(
                xds,
                spec,
                observed.clone(),
                round.clone(),
            )));
        }
        let target = start + wave.last().map_or(0, |i| i + 1);
        let observed = observed.clone();
        wait_for("proxies in sync", Duration::from_secs(600), || {
            let observed = observed.clone();
            async move { (observed.ready.load(Ordering::Relaxed) >= target).then_some(()) }
        })
        .await;
    }
    tasks
}

/// The connection storm after a control-plane restart: every proxy's stream is dropped at once and
/// every proxy connects again at once, with no rate limit. Returns the new fleet and p50, p99 and
/// max (ms) of each proxy's time from its connect to holding every type it subscribes to.
async fn storm(
    xds: SocketAddr,
    a: &Args,
    fleet: Vec<JoinHandle<()>>,
    observed: &Arc<Observed>,
    round: &Arc<Mutex<Option<Round>>>,
) -> (Vec<JoinHandle<()>>, (f64, f64, f64)) {
    for task in &fleet {
        task.abort();
    }
    for task in fleet {
        let _ = task.await;
    }
    *round.lock() = None;
    // The server notices the dropped streams and closes them before the fleet is back.
    tokio::time::sleep(Duration::from_secs(1)).await;
    *observed.since.lock() = Some(Instant::now());
    let fleet: Vec<_> = (0..a.proxies)
        .map(|index| {
            let spec = proxy_spec(a, index);
            tokio::spawn(proxy(xds, spec, observed.clone(), round.clone()))
        })
        .collect();
    let resynced = wait_resynced(observed, a.proxies).await;
    (fleet, resynced)
}

/// Waits for `count` sessions in sync since [`Observed::since`]; their p50, p99 and max (ms).
async fn wait_resynced(observed: &Arc<Observed>, count: usize) -> (f64, f64, f64) {
    wait_for(
        "every proxy in sync again",
        Duration::from_secs(600),
        || {
            let observed = observed.clone();
            async move { (observed.resynced.lock().len() >= count).then_some(()) }
        },
    )
    .await;
    *observed.since.lock() = None;
    percentiles(std::mem::take(&mut *observed.resynced.lock()))
}

/// What the proxies converge on: meshpilot, or the naive anchor serving what meshpilot served.
enum Server {
    Meshpilot(Plane),
    Naive(NaiveServer),
}

impl Server {
    fn xds(&self) -> SocketAddr {
        match self {
            Server::Meshpilot(plane) => plane.xds,
            Server::Naive(naive) => naive.xds,
        }
    }

    fn pid(&self) -> u32 {
        match self {
            Server::Meshpilot(plane) => plane.process.pid(),
            Server::Naive(naive) => naive.pid(),
        }
    }

    /// The hot service's endpoint moves to round `r`'s mark.
    fn move_endpoint(&self, r: usize) {
        match self {
            Server::Meshpilot(plane) => {
                plane.servers[0].apply(json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                    "metadata": {"name": "svc-0-c0", "namespace": NS, "labels": {"kubernetes.io/service-name": "svc-0"}},
                    "addressType": "IPv4", "ports": [{"name": "http", "port": 80}],
                    "endpoints": [{"addresses": [mark(r)], "conditions": {"ready": true}}]}));
            }
            Server::Naive(naive) => naive.move_endpoint(&cluster_name(0), &mark(r)),
        }
    }

    /// A service `round-<r>` is added.
    fn add_service(&self, r: usize) {
        match self {
            Server::Meshpilot(plane) => {
                plane.servers[0].apply(json!({"apiVersion": "v1", "kind": "Service",
                    "metadata": {"name": format!("round-{r}"), "namespace": NS},
                    "spec": {"clusterIP": format!("10.97.{}.{}", r / 250, r % 250 + 1), "ports": [{"name": "http", "port": 80}]}}));
            }
            Server::Naive(naive) => {
                naive.add_cluster(&format!("outbound|80||round-{r}.{NS}.svc.cluster.local"))
            }
        }
    }
}

/// Everything meshpilot serves the harness's proxies for `services` services: every cluster and
/// assignment, and the listeners proxyless clients ask for.
async fn served(xds: SocketAddr, services: usize) -> Vec<Any> {
    let names: Vec<String> = (0..services).map(cluster_name).collect();
    let listeners = (0..services).map(|i| format!("{}:80", host(i))).collect();
    let sidecar = || {
        common::node(
            &format!("sidecar~10.250.255.1~capture.{NS}~{NS}.svc.cluster.local"),
            &[("CLUSTER_ID", "c0")],
        )
    };
    let grpc = common::node(
        &format!("sidecar~10.250.255.2~capture-grpc.{NS}~{NS}.svc.cluster.local"),
        &[("CLUSTER_ID", "c0"), ("GENERATOR", "grpc")],
    );
    naive::capture(
        xds,
        vec![
            naive::subscription(sidecar(), CDS, vec![]),
            naive::subscription(sidecar(), EDS, names),
            naive::subscription(grpc, LDS, listeners),
        ],
    )
    .await
}

/// The figures of one convergence run.
#[derive(Default)]
struct Figures {
    initial_sync_s: f64,
    kib_per_proxy: f64,
    eds_first: f64,
    eds_p50: f64,
    eds_p99: f64,
    eds_max: f64,
    us_per_message: f64,
    full_push_ms: f64,
    full_push_cpu_s: f64,
    storm_p50: f64,
    storm_p99: f64,
    storm_max: f64,
    storm_cpu_s: f64,
}

impl Figures {
    /// (figure, value, unit), in the order they are printed.
    fn rows(&self) -> [(&'static str, f64, &'static str); 13] {
        [
            ("initial sync of every proxy", self.initial_sync_s, "s"),
            ("memory per proxy (slope)", self.kib_per_proxy, "KiB"),
            ("EDS change to the first proxy served", self.eds_first, "ms"),
            ("EDS convergence p50", self.eds_p50, "ms"),
            ("EDS convergence p99", self.eds_p99, "ms"),
            ("EDS convergence max", self.eds_max, "ms"),
            ("server CPU per proxy message", self.us_per_message, "µs"),
            ("full push, all converged", self.full_push_ms, "ms"),
            ("full push, server CPU", self.full_push_cpu_s, "s"),
            ("connection storm p50", self.storm_p50, "ms"),
            ("connection storm p99", self.storm_p99, "ms"),
            ("connection storm max", self.storm_max, "ms"),
            ("connection storm, server CPU", self.storm_cpu_s, "s"),
        ]
    }
}

async fn convergence(a: &Args) {
    println!(
        "## convergence: {} proxies, {} services × {} endpoints over {} clusters, debounce {}",
        a.proxies, a.services, a.endpoints, a.clusters, a.debounce
    );
    let plane = start_plane(a, a.services, a.endpoints, a.clusters).await;
    let resources = served(plane.xds, a.services).await;
    println!("### meshpilot");
    let meshpilot = converge(&Server::Meshpilot(plane), a).await;
    println!("### naive fan-out, the same {} resources", resources.len());
    let naive = converge(&Server::Naive(NaiveServer::start(resources)), a).await;
    println!("| figure | meshpilot | naive | meshpilot/naive |\n|---|---|---|---|");
    for ((what, m, unit), (_, n, _)) in meshpilot.rows().into_iter().zip(naive.rows()) {
        println!("| {what} | {m:.2} {unit} | {n:.2} {unit} | {:.2} |", m / n);
    }
}

/// Connects the proxies to `server`, then measures EDS convergence and full pushes.
async fn converge(server: &Server, a: &Args) -> Figures {
    let mut figures = Figures::default();
    let pid = server.pid();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (_, rss_idle) = proc_stats(pid);
    let observed = Arc::new(Observed::default());
    let round: Arc<Mutex<Option<Round>>> = Arc::default();
    let connect = Instant::now();
    let half = a.proxies / 2;
    let mut fleet = connect_proxies(server.xds(), a, half, &observed, &round).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (_, rss_half) = proc_stats(pid);
    fleet.extend(connect_proxies(server.xds(), a, a.proxies - half, &observed, &round).await);
    figures.initial_sync_s = connect.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (_, rss_full) = proc_stats(pid);
    figures.kib_per_proxy =
        (rss_full as f64 - rss_half as f64) / (a.proxies - half).max(1) as f64 / 1024.0;
    println!(
        "initial sync of {} proxies: {:.1}s; RSS idle {:.1} MiB, +{} proxies {:.1} MiB, +{} {:.1} MiB → {:.1} KiB per proxy (slope)",
        a.proxies,
        figures.initial_sync_s,
        rss_idle as f64 / 1048576.0,
        half,
        rss_half as f64 / 1048576.0,
        a.proxies,
        rss_full as f64 / 1048576.0,
        figures.kib_per_proxy
    );

    // EDS convergence: one endpoint of the hot service (every proxy watches it) changes.
    let (mut p50s, mut p99s, mut maxs, mut cpu_per_msg) = (vec![], vec![], vec![], vec![]);
    let mut firsts = vec![];
    for r in 1..=a.rounds {
        let (cpu0, _) = proc_stats(pid);
        let messages0 = observed.messages.load(Ordering::Relaxed);
        let latencies = eds_round(server, (&observed, &round), r, a.proxies).await;
        // The fixed cost of a change (noticing, parsing, deciding) before the fan-out starts.
        let first = latencies
            .iter()
            .min()
            .map_or(0.0, |d| d.as_secs_f64() * 1e3);
        firsts.push(first);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let (cpu1, _) = proc_stats(pid);
        // Each proxy got one response and sent one ACK.
        let messages = (observed.messages.load(Ordering::Relaxed) - messages0) * 2;
        cpu_per_msg.push((cpu1 - cpu0) * 1e6 / messages.max(1) as f64);
        let (p50, p99, max) = percentiles(latencies);
        println!("  EDS round {r}: first {first:.1} ms, p50 {p50:.1} ms, p99 {p99:.1} ms, max {max:.1} ms; server CPU {:.1} µs per message", cpu_per_msg.last().unwrap());
        p50s.push(p50);
        p99s.push(p99);
        maxs.push(max);
    }
    (figures.eds_p50, figures.eds_p99, figures.eds_max) =
        (median(p50s), median(p99s), median(maxs));
    figures.eds_first = median(firsts);
    figures.us_per_message = median(cpu_per_msg);
    println!(
        "EDS convergence (median of {} rounds): p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms; server CPU {:.1} µs per proxy message",
        a.rounds, figures.eds_p50, figures.eds_p99, figures.eds_max, figures.us_per_message
    );

    // Full push: a service is added; every sidecar must see the new cluster.
    let sidecars = (0..a.proxies).filter(|&i| watches_cds(a, i)).count();
    let (mut fulls, mut cpus) = (vec![], vec![]);
    for r in 1..=a.rounds.min(3) {
        let (cpu0, _) = proc_stats(pid);
        let (_, _, max) = percentiles(full_round(server, (&observed, &round), r, sidecars).await);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (cpu1, _) = proc_stats(pid);
        println!("  full push round {r}: all {sidecars} sidecars converged in {max:.1} ms; server CPU {:.2} s", cpu1 - cpu0);
        fulls.push(max);
        cpus.push(cpu1 - cpu0);
    }
    (figures.full_push_ms, figures.full_push_cpu_s) = (median(fulls), median(cpus));
    println!(
        "full push after a service add (median): {:.1} ms to converge {sidecars} sidecars, {:.2} CPU-seconds",
        figures.full_push_ms, figures.full_push_cpu_s
    );

    // Connection storms: the whole fleet drops its streams and connects again at once.
    let (mut p50s, mut p99s, mut maxs, mut cpus) = (vec![], vec![], vec![], vec![]);
    for r in 1..=a.rounds.min(3) {
        let (cpu0, _) = proc_stats(pid);
        let (next, (p50, p99, max)) = storm(server.xds(), a, fleet, &observed, &round).await;
        fleet = next;
        let (cpu1, _) = proc_stats(pid);
        println!("  connection storm {r}: p50 {p50:.1} ms, p99 {p99:.1} ms, max {max:.1} ms; server CPU {:.2} s", cpu1 - cpu0);
        p50s.push(p50);
        p99s.push(p99);
        maxs.push(max);
        cpus.push(cpu1 - cpu0);
    }
    for task in fleet {
        task.abort();
    }
    (
        figures.storm_p50,
        figures.storm_p99,
        figures.storm_max,
        figures.storm_cpu_s,
    ) = (median(p50s), median(p99s), median(maxs), median(cpus));
    println!(
        "connection storm, all {} proxies at once (median): p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms from connect to in sync; server CPU {:.2} s",
        a.proxies, figures.storm_p50, figures.storm_p99, figures.storm_max, figures.storm_cpu_s
    );
    figures
}

/// Round `r` of EDS convergence: the hot service's endpoint moves, and every one of `expected`
/// proxies must hold it; each one's latency.
async fn eds_round(
    server: &Server,
    (observed, round): (&Arc<Observed>, &Arc<Mutex<Option<Round>>>),
    r: usize,
    expected: usize,
) -> Vec<Duration> {
    *round.lock() = Some(Round {
        started: Instant::now(),
        id: r,
    });
    server.move_endpoint(r);
    wait_for("EDS convergence", Duration::from_secs(120), || {
        let observed = observed.clone();
        async move { (observed.eds.lock().get(&r).map_or(0, Vec::len) >= expected).then_some(()) }
    })
    .await;
    observed.eds.lock().remove(&r).unwrap_or_default()
}

/// Round `r` of full-push convergence: service `round-<r>` is added, and every one of `sidecars`
/// must see its cluster; each one's latency.
async fn full_round(
    server: &Server,
    (observed, round): (&Arc<Observed>, &Arc<Mutex<Option<Round>>>),
    r: usize,
    sidecars: usize,
) -> Vec<Duration> {
    *round.lock() = Some(Round {
        started: Instant::now(),
        id: r,
    });
    server.add_service(r);
    wait_for("full-push convergence", Duration::from_secs(300), || {
        let observed = observed.clone();
        async move { (observed.full.lock().get(&r).map_or(0, Vec::len) >= sidecars).then_some(()) }
    })
    .await;
    observed.full.lock().remove(&r).unwrap_or_default()
}

/// Streams that stop reading in `stalled`: as many as meshpilot's push permits by default, which
/// until issue 48 each held while waiting for its proxy to read.
const STALLED: usize = 64;

/// The fleet's convergence with and without `STALLED` streams that stopped reading, meshpilot
/// beside the naive anchor. Their sends wait 600 s (`--xds-send-timeout`), so they stay stalled
/// throughout.
async fn stalled(a: &Args) {
    println!(
        "## {} proxies, {} services × {} endpoints over {} clusters; {STALLED} streams that stop reading",
        a.proxies, a.services, a.endpoints, a.clusters
    );
    let plane = start_plane_with(
        a,
        (a.services, a.endpoints, a.clusters),
        &["--xds-send-timeout", "600s"],
    )
    .await;
    let resources = served(plane.xds, a.services).await;
    println!("### meshpilot");
    let meshpilot = stall_rounds(&Server::Meshpilot(plane), a).await;
    println!("### naive fan-out, the same {} resources", resources.len());
    let naive = stall_rounds(&Server::Naive(NaiveServer::start(resources)), a).await;
    println!("| median of rounds, ms | meshpilot | naive |\n|---|---|---|");
    let rows = ["EDS p50", "EDS p99", "full push, all sidecars"];
    for (phase, (m, n)) in ["", &format!(" with {STALLED} stalled")]
        .iter()
        .zip(meshpilot.iter().zip(naive.iter()))
    {
        for (i, what) in rows.iter().enumerate() {
            println!("| {what}{phase} | {:.1} | {:.1} |", m[i], n[i]);
        }
    }
}

/// [EDS p50, EDS p99, full-push max] (medians of rounds, ms) of the fleet, then the same once
/// `STALLED` streams asked for every cluster and listener and stopped reading.
async fn stall_rounds(server: &Server, a: &Args) -> [[f64; 3]; 2] {
    let observed = Arc::new(Observed::default());
    let round: Arc<Mutex<Option<Round>>> = Arc::default();
    let fleet = connect_proxies(server.xds(), a, a.proxies, &observed, &round).await;
    let sidecars = (0..a.proxies).filter(|&i| watches_cds(a, i)).count();
    let mut phases = [[0.0; 3]; 2];
    let mut stalled = Vec::new();
    for (phase, figures) in phases.iter_mut().enumerate() {
        if phase == 1 {
            stalled = stop_reading(server.xds(), STALLED).await;
        }
        let first = phase * (a.rounds + 1);
        let (mut p50s, mut p99s, mut fulls) = (vec![], vec![], vec![]);
        for r in first + 1..=first + a.rounds {
            let (p50, p99, _) =
                percentiles(eds_round(server, (&observed, &round), r, a.proxies).await);
            p50s.push(p50);
            p99s.push(p99);
            let (_, _, max) =
                percentiles(full_round(server, (&observed, &round), r, sidecars).await);
            fulls.push(max);
        }
        *figures = [median(p50s), median(p99s), median(fulls)];
        println!(
            "{}: EDS p50 {:.1} ms, p99 {:.1} ms; full push {:.1} ms",
            if phase == 0 {
                "alone"
            } else {
                "with stalled streams"
            },
            figures[0],
            figures[1],
            figures[2]
        );
    }
    for task in fleet {
        task.abort();
    }
    drop(stalled);
    phases
}

/// `count` streams, each on its own connection (its own flow-control window), that ask for every
/// cluster and listener as a sidecar and never read a response.
async fn stop_reading(xds: SocketAddr, count: usize) -> Vec<common::AdsClient> {
    let mut streams = Vec::with_capacity(count);
    for i in 0..count {
        let stream = common::AdsClient::connect(xds).await.expect("ADS connects");
        let node = common::node(
            &format!(
                "sidecar~10.251.0.{}~stalled-{i}.{NS}~{NS}.svc.cluster.local",
                i + 1
            ),
            &[("CLUSTER_ID", "c0")],
        );
        for (n, type_url) in [CDS, LDS].into_iter().enumerate() {
            stream.request(
                envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest {
                    node: (n == 0).then(|| node.clone()),
                    type_url: type_url.into(),
                    ..Default::default()
                },
            );
        }
        streams.push(stream);
    }
    streams
}

/// C remotes onboarded, then every watch of every remote relists at once (their API servers lose
/// their watch history and end the watches, as after an outage): meshpilot's peak memory over the
/// relist, beside its settled memory and the naive anchor holding what meshpilot served.
async fn relist(a: &Args) {
    let per_remote = a.services * a.endpoints;
    println!(
        "## relist of {} remotes × {per_remote} endpoints ({} services each) at once",
        a.clusters, a.services
    );
    let plane = start_plane_with(a, (1, 1, 1), &[]).await;
    let mut servers = Vec::new();
    for c in 1..=a.clusters {
        let api = TestApiServer::start_with_bookmarks(Duration::from_secs(30)).await;
        populate(&api, (NS, c), 1, 0..a.services, a.endpoints);
        plane.servers[0].apply(remote_secret(&api, &format!("r{c}")));
        servers.push(api);
    }
    let admin = plane.admin;
    let remotes = a.clusters;
    let onboarded_all = || async move {
        let synced = onboarded(admin, |id| id.starts_with('r'), per_remote).await;
        (synced == remotes).then_some(())
    };
    wait_for(
        "every remote onboarded",
        Duration::from_secs(600),
        onboarded_all,
    )
    .await;
    let pid = plane.process.pid();
    let settled = settled_rss(pid, a.quiet()).await;
    let lists = |api: &TestApiServer| api.request_count("list:pods");
    let before: Vec<u64> = servers.iter().map(lists).collect();
    reset_peak_rss(pid);
    let started = Instant::now();
    for api in &servers {
        // Past every version a watch has seen, then forgotten: each watch is told 410 and relists.
        api.apply_yaml(&format!(
            "apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: relist, namespace: {NS}}}\n"
        ));
        api.compact();
        api.end_watches();
    }
    wait_for("every remote relisted", Duration::from_secs(600), || {
        let relisted = servers.iter().zip(&before).all(|(api, b)| lists(api) > *b);
        async move { relisted.then_some(()) }
    })
    .await;
    wait_for(
        "every remote served again",
        Duration::from_secs(600),
        onboarded_all,
    )
    .await;
    let took = started.elapsed();
    let peak = peak_rss(pid);
    let resources = served(plane.xds, a.services).await;
    drop(plane);
    let anchor = naive_rss(resources).await;
    let mib = |b: u64| b as f64 / 1048576.0;
    println!(
        "settled before: {:.1} MiB; relist of every remote at once: peak {:.1} MiB (+{:.1} MiB), {:.0} ms until every remote was served again; the naive anchor holding what meshpilot served: {:.1} MiB",
        mib(settled),
        mib(peak),
        mib(peak.saturating_sub(settled)),
        took.as_secs_f64() * 1e3,
        mib(anchor)
    );
}

/// Two replicas behind one address: each proxy knows both, connects to one (half the fleet to each)
/// and, when its stream ends, to the other. With the fleet in sync on a round's endpoint and service,
/// the first replica is killed (SIGKILL). Per moved proxy: the time from the kill to holding every
/// type again on the other, and whether what it gets there lacks the round's endpoint or service
/// (a config regression). The naive anchor runs as two replicas the same way.
async fn failover(a: &Args) {
    println!(
        "## failover: {} proxies over two replicas, {} services × {} endpoints over {} clusters",
        a.proxies, a.services, a.endpoints, a.clusters
    );
    let first = start_plane(a, a.services, a.endpoints, a.clusters).await;
    let second = first.replica().await;
    let resources = served(first.xds, a.services).await;
    println!("### meshpilot");
    let meshpilot = fail_over([Server::Meshpilot(first), Server::Meshpilot(second)], a).await;
    println!(
        "### naive fan-out, two replicas of the same {} resources",
        resources.len()
    );
    let naive = fail_over(
        [
            Server::Naive(NaiveServer::start(resources.clone())),
            Server::Naive(NaiveServer::start(resources)),
        ],
        a,
    )
    .await;
    println!("| figure | meshpilot | naive |\n|---|---|---|");
    let rows = [
        (
            "moved proxies in sync again, p50 (ms)",
            meshpilot.0,
            naive.0,
        ),
        ("p99 (ms)", meshpilot.1, naive.1),
        ("max (ms)", meshpilot.2, naive.2),
        ("moved proxies served an older config", meshpilot.3, naive.3),
    ];
    for (what, m, n) in rows {
        println!("| {what} | {m:.1} | {n:.1} |");
    }
}

/// One failover over `replicas`: (p50, p99, max) ms of the moved proxies' resync, and how many of
/// them were served less than they held before.
async fn fail_over(mut replicas: [Server; 2], a: &Args) -> (f64, f64, f64, f64) {
    let observed = Arc::new(Observed::default());
    let round: Arc<Mutex<Option<Round>>> = Arc::default();
    let addrs = [replicas[0].xds(), replicas[1].xds()];
    let fleet: Vec<_> = (0..a.proxies)
        .map(|index| {
            let spec = proxy_spec(a, index);
            tokio::spawn(replicated_proxy(
                addrs,
                spec,
                observed.clone(),
                round.clone(),
            ))
        })
        .collect();
    let all = a.proxies;
    wait_for("the fleet in sync", Duration::from_secs(600), || {
        let observed = observed.clone();
        async move { (observed.ready.load(Ordering::Relaxed) >= all).then_some(()) }
    })
    .await;

    // A round's endpoint and service, held by every proxy before the kill.
    let r = 1;
    *round.lock() = Some(Round {
        started: Instant::now(),
        id: r,
    });
    match &replicas[0] {
        // Both replicas read the same API servers.
        Server::Meshpilot(_) => {
            replicas[0].move_endpoint(r);
            replicas[0].add_service(r);
        }
        Server::Naive(_) => {
            for replica in &replicas {
                replica.move_endpoint(r);
                replica.add_service(r);
            }
        }
    }
    let sidecars = (0..a.proxies).filter(|&i| watches_cds(a, i)).count();
    wait_for("the round everywhere", Duration::from_secs(300), || {
        let observed = observed.clone();
        async move {
            let eds = observed.eds.lock().get(&r).map_or(0, Vec::len);
            let cds = observed.full.lock().get(&r).map_or(0, Vec::len);
            (eds >= all && cds >= sidecars).then_some(())
        }
    })
    .await;
    observed.eds.lock().clear();
    observed.full.lock().clear();

    let moved = (0..a.proxies).filter(|i| i % 2 == 0).count();
    let moved_sidecars = (0..a.proxies)
        .filter(|&i| i % 2 == 0 && watches_cds(a, i))
        .count();
    *observed.since.lock() = Some(Instant::now());
    match &mut replicas[0] {
        Server::Meshpilot(plane) => plane.process.kill_9(),
        Server::Naive(naive) => naive.kill(),
    }
    let (p50, p99, max) = wait_resynced(&observed, moved).await;
    // Every moved proxy's first responses on the other replica carry the round's marks.
    let eds = observed.eds.lock().get(&r).map_or(0, Vec::len);
    let cds = observed.full.lock().get(&r).map_or(0, Vec::len);
    let older = moved.saturating_sub(eds) + moved_sidecars.saturating_sub(cds);
    println!(
        "{moved} proxies moved: in sync again p50 {p50:.1} ms, p99 {p99:.1} ms, max {max:.1} ms after the kill; {older} served an older config ({eds} of {moved} with the round's endpoint, {cds} of {moved_sidecars} sidecars with its service)"
    );
    for task in fleet {
        task.abort();
    }
    (p50, p99, max, older as f64)
}

/// A proxy of two replicas behind one address: it connects to `replicas[index % 2]` and, each time
/// its stream ends, to the other (after the pause [`proxy`] takes).
async fn replicated_proxy(
    replicas: [SocketAddr; 2],
    spec: ProxySpec,
    observed: Arc<Observed>,
    round: Arc<Mutex<Option<Round>>>,
) {
    let mut at = spec.index % 2;
    loop {
        session(replicas[at], &spec, &observed, &round).await;
        at = 1 - at;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Memory per endpoint and per service, each a slope from a base mesh (S services × E endpoints):
/// ten times the endpoints per service (S × 10E), and ten times the services (10S × E). Growing only
/// one of the two keeps the other's cost out of the figure.
async fn endpoints_memory(a: &Args) {
    println!("## memory per endpoint and per service (no proxies); the naive anchor holds what meshpilot serves");
    let (s, e) = (a.services, a.endpoints);
    let sizes = [(s, e), (s, e * 10), (s * 10, e)];
    let (mut meshpilot, mut naive) = (Vec::new(), Vec::new());
    for (services, endpoints) in sizes {
        let plane = start_plane(a, services, endpoints, 1).await;
        let rss = settled_rss(plane.process.pid(), a.quiet()).await;
        let resources = served(plane.xds, services).await;
        drop(plane);
        let anchor_rss = naive_rss(resources).await;
        println!(
            "  {services} services × {endpoints} endpoints: RSS meshpilot {:.1} MiB, naive {:.1} MiB",
            rss as f64 / 1048576.0,
            anchor_rss as f64 / 1048576.0
        );
        meshpilot.push(rss as f64);
        naive.push(anchor_rss as f64);
    }
    let added_endpoints = (s * e * 9) as f64;
    let (m, n) = (
        (meshpilot[1] - meshpilot[0]) / added_endpoints,
        (naive[1] - naive[0]) / added_endpoints,
    );
    println!(
        "memory per endpoint (slope, {s} services): meshpilot {m:.0} bytes, naive {n:.0} bytes, meshpilot/naive {:.2}",
        m / n
    );
    let added_services = (s * 9) as f64;
    let (m, n) = (
        (meshpilot[2] - meshpilot[0]) / added_services,
        (naive[2] - naive[0]) / added_services,
    );
    println!(
        "memory per service with its {e} endpoints (slope): meshpilot {:.1} KiB, naive {:.1} KiB, meshpilot/naive {:.2}",
        m / 1024.0,
        n / 1024.0,
        m / n
    );
}

async fn onboarding(a: &Args) {
    let sizes = if a.scenario == "smoke" {
        vec![(a.services, a.services * a.endpoints)]
    } else {
        vec![(300, 4000), (3000, 40000)]
    };
    for (services, endpoints) in sizes {
        println!("## onboarding a remote cluster of {services} services / {endpoints} endpoints");
        let plane = start_plane(a, 1, 1, 1).await;
        let remote = TestApiServer::start_with_bookmarks(Duration::from_secs(30)).await;
        let per_service = endpoints / services;
        populate(&remote, (NS, 0), 1, 0..services, per_service);
        let served_before = served(plane.xds, services).await;
        let rss0 = settled_rss(plane.process.pid(), a.quiet()).await;
        let started = Instant::now();
        plane.servers[0].apply(remote_secret(&remote, "remote"));
        let admin = plane.admin;
        let expected = services * per_service;
        wait_for(
            "remote onboarded",
            Duration::from_secs(600),
            || async move { (onboarded(admin, |id| id == "remote", expected).await == 1).then_some(()) },
        )
        .await;
        let took = started.elapsed();
        let rss1 = settled_rss(plane.process.pid(), a.quiet()).await;
        let served_after = served(plane.xds, services).await;
        drop(plane);
        let grown = rss1 as f64 - rss0 as f64;
        let anchor_grown =
            naive_rss(served_after).await as f64 - naive_rss(served_before).await as f64;
        println!(
            "onboarding {services} services / {expected} endpoints: {:.0} ms from Secret to served; +{:.1} MiB RSS; the naive anchor holding what meshpilot then served +{:.1} MiB, meshpilot/naive {:.2}",
            took.as_secs_f64() * 1e3,
            grown / 1048576.0,
            anchor_grown / 1048576.0,
            grown / anchor_grown
        );
    }
}

/// RSS of the naive anchor holding `resources` (what meshpilot served), once it has loaded them.
async fn naive_rss(resources: Vec<Any>) -> u64 {
    let anchor = NaiveServer::start(resources);
    tokio::time::sleep(Duration::from_millis(500)).await;
    proc_stats(anchor.pid()).1
}

/// How many clusters whose id passes `id` are synced with at least `endpoints` endpoints.
async fn onboarded(admin: SocketAddr, id: impl Fn(&str) -> bool, endpoints: usize) -> usize {
    let clusters = common::get_json(admin, "/debug/clusterz").await;
    let rows = clusters.as_array().cloned().unwrap_or_default();
    rows.iter()
        .filter(|c| c["id"].as_str().is_some_and(&id))
        .filter(|c| c["state"] == "synced")
        .filter(|c| {
            c["endpoints"]
                .as_u64()
                .is_some_and(|n| n as usize >= endpoints)
        })
        .count()
}

/// Many remotes at once: `a.clusters` remote API servers, each holding the same `a.services`
/// services with `a.endpoints` endpoints apiece, onboarded by Secrets applied together. With
/// `--unselected N`, twice in the run under discoverySelectors selecting the bench's namespace:
/// first the remotes holding only it, then each also holding N unselected namespaces of the same
/// objects, whose cost should be their Namespace objects alone.
async fn remotes(a: &Args) {
    match a.unselected {
        0 => remotes_once(a, None).await,
        n => {
            remotes_once(a, Some(0)).await;
            remotes_once(a, Some(n)).await;
        }
    }
}

async fn remotes_once(a: &Args, unselected: Option<usize>) {
    let per_remote = a.services * a.endpoints;
    let scope = match unselected {
        None => String::new(),
        Some(n) => format!(", discoverySelectors, {n} unselected namespaces of the same in each"),
    };
    println!(
        "## onboarding {} remotes × {per_remote} endpoints ({} services each{scope})",
        a.clusters, a.services
    );
    let mesh = tempfile::NamedTempFile::new().expect("temp file");
    let selectors = format!(
        "discoverySelectors: [{{matchLabels: {{{}: {}}}}}]\n",
        SELECTED.0, SELECTED.1
    );
    std::fs::write(mesh.path(), selectors).expect("write the mesh config");
    let mesh_path = mesh.path().to_str().expect("utf-8 path");
    let flags: &[&str] = match unselected {
        None => &[],
        Some(_) => &["--mesh-config", mesh_path],
    };
    let plane = start_plane_with(a, (1, 1, 1), flags).await;
    let mut servers = Vec::new();
    for c in 1..=a.clusters {
        let api = TestApiServer::start_with_bookmarks(Duration::from_secs(30)).await;
        // Every endpoint of the range lands in cluster `c`, at addresses of its own (10.<100+c>.…).
        populate(&api, (NS, c), 1, 0..a.services, a.endpoints);
        for k in 1..=unselected.unwrap_or(0) {
            populate(
                &api,
                (&format!("other-{k}"), c),
                1,
                0..a.services,
                a.endpoints,
            );
        }
        servers.push(api);
    }
    let rss0 = settled_rss(plane.process.pid(), a.quiet()).await;
    let (cpu0, _) = proc_stats(plane.process.pid());
    let started = Instant::now();
    for (c, api) in servers.iter().enumerate() {
        plane.servers[0].apply(remote_secret(api, &format!("r{}", c + 1)));
    }
    let admin = plane.admin;
    let remotes = a.clusters;
    wait_for(
        "every remote onboarded",
        Duration::from_secs(600),
        || async move {
            let synced = onboarded(admin, |id| id.starts_with('r'), per_remote).await;
            (synced == remotes).then_some(())
        },
    )
    .await;
    let took = started.elapsed();
    let (cpu1, _) = proc_stats(plane.process.pid());
    let rss1 = settled_rss(plane.process.pid(), a.quiet()).await;
    let grown = rss1 as f64 - rss0 as f64;
    let resources = served(plane.xds, a.services).await;
    drop(plane);
    let anchor_rss = naive_rss(resources).await;
    println!(
        "{remotes} remotes × {per_remote} endpoints: {:.0} ms from Secrets to every remote served, {:.2} CPU-s; +{:.1} MiB RSS ({:.0} KiB per remote, {:.0} bytes per endpoint); the naive anchor holding what meshpilot then served: {:.1} MiB",
        took.as_secs_f64() * 1e3,
        cpu1 - cpu0,
        grown / 1048576.0,
        grown / remotes as f64 / 1024.0,
        grown / (remotes * per_remote) as f64,
        anchor_rss as f64 / 1048576.0
    );
}

/// Config at scale: every service has a DestinationRule (a subset) and a VirtualService (routing
/// to it); each round the DestinationRule of a service no proxy watches the EDS of gains a subset
/// `round-<r>`, and every sidecar on wildcard CDS must see its cluster. The other proxies are not
/// concerned and should receive nothing. With `--sidecar-hosts K`, a Sidecar scopes the proxies'
/// namespace to K services and the changed one.
async fn config_at_scale(a: &Args) {
    let scope = match a.sidecar_hosts {
        0 => "no Sidecar".to_string(),
        k => format!("a Sidecar scoping them to {} services", k + 1),
    };
    println!(
        "## config at scale: {} DestinationRules + {} VirtualServices, {} proxies (1 sidecar in {} on wildcard CDS), {scope}",
        a.services, a.services, a.proxies, a.cds_every
    );
    // One service more than the proxies pick EDS names from: only wildcard-CDS sidecars see it.
    let plane = start_plane(a, a.services + 1, a.endpoints, a.clusters).await;
    for i in 0..=a.services {
        plane.servers[0].apply(destination_rule(i, &["v1"]));
        plane.servers[0].apply(
            json!({"apiVersion": "networking.istio.io/v1", "kind": "VirtualService",
            "metadata": {"name": format!("svc-{i}"), "namespace": NS},
            "spec": {"hosts": [host(i)], "http": [{"timeout": "5s",
                "route": [{"destination": {"host": host(i), "subset": "v1"}}]}]}}),
        );
    }
    let changed = a.services;
    if a.sidecar_hosts > 0 {
        let hosts: Vec<String> = (0..a.sidecar_hosts)
            .chain([changed])
            .map(|i| format!("./{}", host(i)))
            .collect();
        plane.servers[0].apply(
            json!({"apiVersion": "networking.istio.io/v1", "kind": "Sidecar",
            "metadata": {"name": "default", "namespace": NS},
            "spec": {"egress": [{"hosts": hosts}]}}),
        );
    }
    // Config is in once the last rule's subset is served.
    let last = format!("outbound|80|v1|{}", host(a.services));
    let xds = plane.xds;
    wait_for("every rule served", Duration::from_secs(120), || {
        let last = last.clone();
        async move {
            let clusters = served(xds, 1).await;
            clusters
                .iter()
                .any(|c| contains(&c.value, last.as_bytes()))
                .then_some(())
        }
    })
    .await;
    let capture = common::node(
        &format!("sidecar~10.250.255.1~capture.{NS}~{NS}.svc.cluster.local"),
        &[("CLUSTER_ID", "c0")],
    );
    let clusters = naive::capture(xds, vec![naive::subscription(capture, CDS, vec![])]).await;
    let cds_bytes: usize = clusters.iter().map(|c| c.value.len()).sum();
    let (_, rss0) = proc_stats(plane.process.pid());
    let observed = Arc::new(Observed::default());
    let round: Arc<Mutex<Option<Round>>> = Arc::default();
    connect_proxies(plane.xds, a, a.proxies, &observed, &round).await;
    let (_, rss1) = proc_stats(plane.process.pid());
    let sidecars = (0..a.proxies).filter(|&i| watches_cds(a, i)).count();
    println!(
        "a sidecar's wildcard CDS: {} clusters, {:.1} KiB; {:.1} KiB RSS per proxy connected",
        clusters.len(),
        cds_bytes as f64 / 1024.0,
        (rss1 as f64 - rss0 as f64) / a.proxies as f64 / 1024.0
    );
    let subset = |r: usize| format!("outbound|80|round-{r}|{}", host(changed));
    let meshpilot = subset_rounds(a, &observed, &round, sidecars, |r| {
        plane.servers[0].apply(destination_rule(changed, &["v1", &format!("round-{r}")]));
    })
    .await;
    // What meshpilot serves, less the rounds' subsets (the anchor adds them again).
    let mut resources = served(plane.xds, a.services + 1).await;
    resources.retain(|r| !contains(&r.value, b"|round-"));
    drop(plane);
    println!(
        "### naive fan-out, the same {} resources, a subset's cluster added per round",
        resources.len()
    );
    let naive = NaiveServer::start(resources);
    let observed = Arc::new(Observed::default());
    connect_proxies(naive.xds, a, a.proxies, &observed, &round).await;
    let anchor = subset_rounds(a, &observed, &round, sidecars, |r| {
        naive.add_cluster(&subset(r))
    })
    .await;
    println!(
        "the DestinationRule of svc-{changed} changed among {} (median of {} rounds), at {sidecars} sidecars:",
        a.services, a.rounds
    );
    println!("| figure | meshpilot | naive | meshpilot/naive |\n|---|---|---|---|");
    let figures = ["p50", "p99", "max"]
        .into_iter()
        .zip(meshpilot.iter().zip(anchor.iter()));
    for (what, (m, n)) in figures {
        println!(
            "| convergence {what} | {m:.1} ms | {n:.1} ms | {:.2} |",
            m / n
        );
    }
    println!(
        "| responses to the {} unconcerned proxies | {:.0} | {:.0} | |",
        a.proxies - sidecars,
        meshpilot[3],
        anchor[3]
    );
}

/// Rounds of one change each (`change(r)` makes round `r`'s subset appear) until every sidecar
/// holds the subset's cluster: the medians of p50, p99 and max latency, and of the responses to
/// proxies the change does not concern.
async fn subset_rounds(
    a: &Args,
    observed: &Arc<Observed>,
    round: &Arc<Mutex<Option<Round>>>,
    sidecars: usize,
    change: impl Fn(usize),
) -> [f64; 4] {
    let (mut p50s, mut p99s, mut maxs, mut unconcerned) = (vec![], vec![], vec![], vec![]);
    for r in 1..=a.rounds {
        let before = observed.unconcerned.load(Ordering::Relaxed);
        *round.lock() = Some(Round {
            started: Instant::now(),
            id: r,
        });
        change(r);
        let obs = observed.clone();
        wait_for("subset at every sidecar", Duration::from_secs(120), || {
            let obs = obs.clone();
            async move { (obs.subset.lock().get(&r).map_or(0, Vec::len) >= sidecars).then_some(()) }
        })
        .await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let (p50, p99, max) = percentiles(observed.subset.lock().remove(&r).unwrap_or_default());
        let others = observed.unconcerned.load(Ordering::Relaxed) - before;
        println!("  round {r}: {sidecars} sidecars p50 {p50:.1} ms, p99 {p99:.1} ms, max {max:.1} ms; {others} responses to unconcerned proxies");
        p50s.push(p50);
        p99s.push(p99);
        maxs.push(max);
        unconcerned.push(others as f64);
    }
    [
        median(p50s),
        median(p99s),
        median(maxs),
        median(unconcerned),
    ]
}

/// Service `i`'s rule with `subsets` (each selecting `version: <name>`).
fn destination_rule(i: usize, subsets: &[&str]) -> serde_json::Value {
    let subsets: Vec<_> = subsets
        .iter()
        .map(|s| json!({"name": s, "labels": {"version": s}}))
        .collect();
    json!({"apiVersion": "networking.istio.io/v1", "kind": "DestinationRule",
        "metadata": {"name": format!("svc-{i}"), "namespace": NS},
        "spec": {"host": host(i), "subsets": subsets}})
}

/// What one round of the `single` scenario changes.
#[derive(Clone, Copy)]
enum Change {
    /// The hot service's endpoint moves to the round's mark: an EDS push.
    Endpoint,
    /// A service `round-<r>` is added: a full (CDS) push.
    Service,
}

/// One change among `a.services` services reaching a single subscribed proxy (wildcard CDS and EDS
/// of a few clusters), through file clusters and through the Kubernetes path.
async fn single_change(a: &Args) {
    println!(
        "## one change among {} services → one subscribed proxy, debounce {}, {} rounds",
        a.services, a.debounce, a.rounds
    );
    let files = start_file_plane(a, a.services).await;
    let dir = files.files.path().join("config/clusters/c0");
    single_rounds(
        "file clusters (one file renamed in per round)",
        files.xds,
        a,
        |r, change| {
            let (file, text) = match change {
                Change::Endpoint => (
                    "svc-0.yaml".to_string(),
                    plane::service_file("svc-0", 0, &mark(r)),
                ),
                Change::Service => (
                    format!("round-{r}.yaml"),
                    plane::service_file(&format!("round-{r}"), a.services + r, &mark(r)),
                ),
            };
            common::write_atomic(&dir.join(file), &text);
        },
    )
    .await;
    drop(files);

    let kube = start_plane(a, a.services, 1, 1).await;
    single_rounds("Kubernetes (one object applied per round)", kube.xds, a, |r, change| {
        let object = match change {
            Change::Endpoint => json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": "svc-0-c0", "namespace": NS, "labels": {"kubernetes.io/service-name": "svc-0"}},
                "addressType": "IPv4", "ports": [{"name": "http", "port": 80}],
                "endpoints": [{"addresses": [mark(r)], "conditions": {"ready": true}}]}),
            Change::Service => json!({"apiVersion": "v1", "kind": "Service",
                "metadata": {"name": format!("round-{r}"), "namespace": NS},
                "spec": {"clusterIP": format!("10.97.{}.{}", r / 250, r % 250 + 1), "ports": [{"name": "http", "port": 80}]}}),
        };
        kube.servers[0].apply(object);
    })
    .await;
    let resources = served(kube.xds, a.services).await;
    drop(kube);
    let naive = Server::Naive(NaiveServer::start(resources));
    single_rounds(
        "naive fan-out (the same resources, changed in memory)",
        naive.xds(),
        a,
        |r, change| match change {
            Change::Endpoint => naive.move_endpoint(r),
            Change::Service => naive.add_service(r),
        },
    )
    .await;
}

async fn single_rounds(what: &str, xds: SocketAddr, a: &Args, change: impl Fn(usize, Change)) {
    let observed = Arc::new(Observed::default());
    let round: Arc<Mutex<Option<Round>>> = Arc::default();
    let one = Args {
        cds_every: 1,
        ..a.clone()
    };
    connect_proxies(xds, &one, 1, &observed, &round).await;
    let (mut eds, mut cds) = (Vec::new(), Vec::new());
    for r in 1..=a.rounds {
        for kind in [Change::Endpoint, Change::Service] {
            *round.lock() = Some(Round {
                started: Instant::now(),
                id: r,
            });
            change(r, kind);
            let obs = observed.clone();
            wait_for("the change at the proxy", Duration::from_secs(30), || {
                let obs = obs.clone();
                async move {
                    match kind {
                        Change::Endpoint => obs.eds.lock().get(&r).map(|_| ()),
                        Change::Service => obs.full.lock().get(&r).map(|_| ()),
                    }
                }
            })
            .await;
            *round.lock() = None;
            let latency = match kind {
                Change::Endpoint => observed.eds.lock().remove(&r),
                Change::Service => observed.full.lock().remove(&r),
            };
            let first = latency.and_then(|v| v.first().copied()).unwrap_or_default();
            match kind {
                Change::Endpoint => eds.push(first),
                Change::Service => cds.push(first),
            }
        }
    }
    let (p50, p99, max) = percentiles(eds);
    println!("{what}: endpoint change (EDS) p50 {p50:.1} ms, p99 {p99:.1} ms, max {max:.1} ms");
    let (p50, p99, max) = percentiles(cds);
    println!("{what}: service added (CDS) p50 {p50:.1} ms, p99 {p99:.1} ms, max {max:.1} ms");
}

fn main() {
    if harness::ran_as_naive_anchor() {
        return;
    }
    let a = args();
    harness::run(async {
        match a.scenario.as_str() {
            "convergence" => convergence(&a).await,
            "endpoints" => endpoints_memory(&a).await,
            "onboarding" => onboarding(&a).await,
            "single" => single_change(&a).await,
            "remotes" => remotes(&a).await,
            "config" => config_at_scale(&a).await,
            "failover" => failover(&a).await,
            "stalled" => stalled(&a).await,
            "relist" => relist(&a).await,
            "all" | "smoke" => {
                convergence(&a).await;
                endpoints_memory(&a).await;
                onboarding(&a).await;
                single_change(&a).await;
                remotes(&Args {
                    unselected: 1,
                    ..a.clone()
                })
                .await;
                config_at_scale(&a).await;
                let scoped = Args {
                    sidecar_hosts: 3,
                    ..a.clone()
                };
                config_at_scale(&scoped).await;
                failover(&a).await;
                stalled(&a).await;
                relist(&a).await;
            }
            other => panic!("unknown scenario {other}"),
        }
    });
}
