//! Ambient mode's workload discovery at scale: K simulated ztunnels (Delta, wildcard
//! `istio.workload.Address`, as ztunnel subscribes by default) against meshpilot serving C file
//! clusters of S services × E pods each.
//!
//! - onboarding: the clusters' directories written → every ztunnel holds every pod;
//! - a pod change per round (a pod of the first cluster turns Ready) → every ztunnel holds its new
//!   version: time and meshpilot's CPU, beside the naive fan-out holding the same Address
//!   resources and sending the changed one to each stream;
//! - removal: every cluster's directory removed → no ztunnel holds any of their pods, and what
//!   meshpilot's settled RSS keeps over its RSS before the clusters came.
//!
//! ```text
//! cargo bench --bench wds_load -- [--proxies K] [--clusters C] [--services S] [--endpoints E] [--rounds R]
//! ```
//!
//! Without arguments it is a small smoke run.

#[path = "../tests/common/mod.rs"]
#[allow(unused_imports)]
mod common;
#[allow(dead_code)] // each harness uses its own subset
mod harness;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::wait_for;
use envoy_types::pb::envoy::service::discovery::v3::DeltaDiscoveryResponse;
use harness::ads::{self, Raw, Subscription, ADDRESS};
use harness::naive::{self, NaiveServer};
use harness::plane::{self, proc_stats, settled_rss, Plane, DECAY_QUIET, NS};
use harness::rounds::{flag, Rounds};
use parking_lot::Mutex;
use prost::Message;

struct Args {
    proxies: usize,
    clusters: usize,
    services: usize,
    endpoints: usize,
    rounds: usize,
    /// How long RSS must stop falling to count as settled.
    quiet: Duration,
}

fn args() -> Args {
    let smoke = std::env::args().skip(1).all(|a| a == "--bench");
    Args {
        proxies: flag("--proxies", 4),
        clusters: flag("--clusters", 2),
        services: flag("--services", 5),
        endpoints: flag("--endpoints", 4),
        rounds: flag("--rounds", 2),
        quiet: if smoke {
            Duration::from_millis(500)
        } else {
            DECAY_QUIET
        },
    }
}

fn ztunnel_node(index: usize) -> envoy_types::pb::envoy::config::core::v3::Node {
    let ip = format!("10.250.{}.{}", index / 250, index % 250 + 1);
    common::node(
        &format!("ztunnel~{ip}~ztunnel-{index}.istio-system~istio-system.svc.cluster.local"),
        // A real ztunnel names its cluster in the secure port's `clusterid` header.
        &[
            ("NAMESPACE", "istio-system"),
            ("NODE_NAME", "node-0"),
            ("CLUSTER_ID", "c1"),
        ],
    )
}

/// The pod a round changes: the first pod of service `r` of the first cluster.
fn round_uid(r: usize) -> String {
    format!("c1//Pod/{NS}/p-{r}-0")
}

/// Service `i` of cluster `c`: the Service, its E pods (Ready when `ready` names them) and slice.
fn service_file(c: usize, i: usize, endpoints: usize, ready: Option<usize>) -> String {
    let mut text = format!(
        "apiVersion: v1
kind: Service
metadata: {{name: svc-{i}, namespace: {NS}}}
spec: {{clusterIP: 10.96.{}.{}, selector: {{app: svc-{i}}}, ports: [{{name: http, port: 80, targetPort: 8080}}]}}
",
        i / 250,
        i % 250 + 1
    );
    let mut slice = String::new();
    for j in 0..endpoints {
        let n = i * endpoints + j;
        let ip = format!("10.{}.{}.{}", 100 + c, n / 250, n % 250 + 1);
        let condition = match ready == Some(j) {
            true => ", conditions: [{type: Ready, status: 'True'}]",
            false => "",
        };
        text.push_str(&format!(
            "---
apiVersion: v1
kind: Pod
metadata: {{name: p-{i}-{j}, namespace: {NS}, labels: {{app: svc-{i}}}, annotations: {{ambient.istio.io/redirection: enabled}}}}
spec: {{serviceAccountName: sa-{i}, nodeName: node-{}, containers: []}}
status: {{podIP: {ip}{condition}}}
",
            n % 100
        ));
        slice.push_str(&format!(
            "  - {{addresses: [{ip}], conditions: {{ready: true}}, targetRef: {{kind: Pod, name: p-{i}-{j}, namespace: {NS}}}}}\n"
        ));
    }
    text.push_str(&format!(
        "---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: svc-{i}-c{c}, namespace: {NS}, labels: {{kubernetes.io/service-name: svc-{i}}}}}
addressType: IPv4
ports: [{{name: http, port: 8080}}]
endpoints:
{slice}"
    ));
    text
}

/// What each ztunnel holds, and per round how long each took to hold the round's pod anew.
#[derive(Default)]
struct Observed {
    held: Vec<Mutex<HashSet<String>>>,
    ready: AtomicUsize,
    rounds: Rounds,
}

impl Observed {
    fn new(proxies: usize) -> Self {
        Self {
            held: (0..proxies).map(|_| Mutex::default()).collect(),
            ..Default::default()
        }
    }

    /// How many ztunnels hold at least `count` pods.
    fn holding(&self, count: usize) -> usize {
        let pods = self
            .held
            .iter()
            .map(|h| h.lock().iter().filter(|n| is_pod(n)).count());
        pods.filter(|n| *n >= count).count()
    }

    /// How many ztunnels hold no pod.
    fn without_pods(&self) -> usize {
        let held = self.held.iter();
        held.filter(|h| !h.lock().iter().any(|n| is_pod(n))).count()
    }
}

fn is_pod(uid: &str) -> bool {
    uid.contains("//Pod/")
}

async fn ztunnel(xds: SocketAddr, index: usize, observed: Arc<Observed>) {
    let channel = loop {
        match ads::connect(xds).await {
            Ok(c) => break c,
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    let subscription = Subscription {
        node: ztunnel_node(index),
        delta: true,
        types: vec![(ADDRESS, vec![])],
    };
    let mut first = true;
    let on_response = |raw: &Raw| {
        let response = DeltaDiscoveryResponse::decode(raw.body.clone()).expect("a response");
        let mut held = observed.held[index].lock();
        for name in &response.removed_resources {
            held.remove(name);
        }
        for resource in &response.resources {
            held.insert(resource.name.clone());
        }
        drop(held);
        if std::mem::take(&mut first) {
            observed.ready.fetch_add(1, Ordering::Relaxed);
        }
        let changed = |r| {
            response
                .resources
                .iter()
                .any(|res| res.name == round_uid(r))
        };
        observed.rounds.observe(changed);
    };
    let _ = ads::stream(channel, &subscription, on_response, std::future::pending()).await;
}

/// Connects the ztunnels to `xds`; returns once each has its first response.
async fn connect(xds: SocketAddr, a: &Args) -> Arc<Observed> {
    let observed = Arc::new(Observed::new(a.proxies));
    for i in 0..a.proxies {
        tokio::spawn(ztunnel(xds, i, observed.clone()));
    }
    let (obs, expected) = (observed.clone(), a.proxies);
    wait_for(
        "every ztunnel's first response",
        Duration::from_secs(120),
        || {
            let obs = obs.clone();
            async move { (obs.ready.load(Ordering::Relaxed) >= expected).then_some(()) }
        },
    )
    .await;
    observed
}

fn write_cluster(root: &Path, c: usize, a: &Args) {
    let dir = root.join(format!("c{c}"));
    std::fs::create_dir_all(&dir).unwrap();
    for i in 0..a.services {
        std::fs::write(
            dir.join(format!("svc-{i}.yaml")),
            service_file(c, i, a.endpoints, None),
        )
        .unwrap();
    }
}

/// Writes every cluster; returns once every ztunnel holds every pod: how long that took, and the
/// settled RSS then.
async fn onboard(clusters: &Path, observed: &Arc<Observed>, pid: u32, a: &Args) -> (Duration, u64) {
    let started = Instant::now();
    for c in 1..=a.clusters {
        write_cluster(clusters, c, a);
    }
    let (obs, expected) = (observed.clone(), a.proxies);
    let every_pod = a.clusters * a.services * a.endpoints;
    wait_for(
        "every ztunnel holds every pod",
        Duration::from_secs(600),
        || {
            let obs = obs.clone();
            async move { (obs.holding(every_pod) >= expected).then_some(()) }
        },
    )
    .await;
    let took = started.elapsed();
    (took, settled_rss(pid, a.quiet).await)
}

/// Removes every cluster; returns once no ztunnel holds a pod: how long that took, and the settled
/// RSS then.
async fn remove(clusters: &Path, observed: &Arc<Observed>, pid: u32, a: &Args) -> (Duration, u64) {
    let started = Instant::now();
    for c in 1..=a.clusters {
        std::fs::remove_dir_all(clusters.join(format!("c{c}"))).unwrap();
    }
    let (obs, expected) = (observed.clone(), a.proxies);
    wait_for(
        "no ztunnel holds a removed pod",
        Duration::from_secs(600),
        || {
            let obs = obs.clone();
            async move { (obs.without_pods() >= expected).then_some(()) }
        },
    )
    .await;
    let took = started.elapsed();
    (took, settled_rss(pid, a.quiet).await)
}

async fn workloads(a: &Args) {
    let per_cluster = a.services * a.endpoints;
    println!(
        "## workload discovery: {} ztunnels, {} clusters × {per_cluster} pods ({} services × {} pods)",
        a.proxies, a.clusters, a.services, a.endpoints
    );
    let plane: Plane = plane::file_plane(0, |_| String::new(), &["--debounce-after", "0s"]).await;
    let pid = plane.process.pid();
    let clusters = plane.files.path().join("config/clusters");
    let observed = connect(plane.xds, a).await;
    let rss0 = settled_rss(pid, a.quiet).await;

    println!("### meshpilot");
    let (cpu0, _) = proc_stats(pid);
    let (onboarded, rss1) = onboard(&clusters, &observed, pid, a).await;
    let (cpu1, _) = proc_stats(pid);
    let every_pod = a.clusters * per_cluster;
    println!(
        "onboarding: every ztunnel holds all {every_pod} pods {:.0} ms after the clusters were written, {:.2} CPU-s; +{:.1} MiB RSS ({:.0} bytes per pod)",
        onboarded.as_secs_f64() * 1e3,
        cpu1 - cpu0,
        (rss1 as f64 - rss0 as f64) / 1048576.0,
        (rss1 as f64 - rss0 as f64) / every_pod as f64
    );
    let first = clusters.join("c1");
    let rounds = &observed.rounds;
    let meshpilot = rounds
        .run("meshpilot", (pid, a.proxies), a.rounds, |r| {
            let text = service_file(1, r, a.endpoints, Some(0));
            common::write_atomic(&first.join(format!("svc-{r}.yaml")), &text);
        })
        .await;
    let resources = naive::capture(
        plane.xds,
        vec![naive::subscription(ztunnel_node(0), ADDRESS, vec![])],
    )
    .await;
    // The clusters go, come back and go again: what a leak keeps grows with each cycle.
    for cycle in 1..=2 {
        if cycle > 1 {
            onboard(&clusters, &observed, pid, a).await;
        }
        let (removed, rss2) = remove(&clusters, &observed, pid, a).await;
        println!(
            "removal {cycle}: no ztunnel holds any of the {every_pod} pods {:.0} ms after the clusters were removed; RSS {:.1} MiB before the clusters, {:.1} MiB with them, {:.1} MiB after: {:+.0} KiB kept",
            removed.as_secs_f64() * 1e3,
            rss0 as f64 / 1048576.0,
            rss1 as f64 / 1048576.0,
            rss2 as f64 / 1048576.0,
            (rss2 as f64 - rss0 as f64) / 1024.0
        );
    }
    drop(plane);

    println!(
        "### naive fan-out, the same {} Address resources",
        resources.len()
    );
    let naive = NaiveServer::start(resources);
    let anchor_ztunnels = connect(naive.xds, a).await;
    let rounds = &anchor_ztunnels.rounds;
    let anchor = rounds
        .run("naive", (naive.pid(), a.proxies), a.rounds, |r| {
            naive.workload_ready(&round_uid(r));
        })
        .await;
    println!("| figure | meshpilot | naive | meshpilot/naive |\n|---|---|---|---|");
    let held = format!(
        "a pod's change held by every ztunnel (median of {} rounds)",
        a.rounds
    );
    harness::print_row(&held, (meshpilot.0, anchor.0), "ms");
    harness::print_row("server CPU per change", (meshpilot.1, anchor.1), "s");
}

fn main() {
    if harness::ran_as_naive_anchor() {
        return;
    }
    let a = args();
    harness::run(workloads(&a));
}
