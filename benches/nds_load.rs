//! The name table's push cost: K simulated agents (half SotW, half Delta; node metadata
//! DNS_CAPTURE=true, as istio-agent) each hold their proxy's table (NDS) from meshpilot serving S
//! services of a file cluster. A round adds a service and measures, per agent, the time until it
//! holds a table naming it, and meshpilot's CPU for the push. Then the same against the naive
//! fan-out serving the table meshpilot sent (re-encoded per stream on each change).
//!
//!   cargo bench --bench nds_load -- [--proxies K] [--services S] [--rounds R]
//!
//! Without arguments it is a small smoke run (what CI runs).

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
use harness::ads::{self, contains, Raw, Subscription, NDS};
use harness::naive::{self, NaiveServer};
use harness::plane::{self, proc_stats, Plane, NS};
use parking_lot::Mutex;

struct Args {
    proxies: usize,
    services: usize,
    rounds: usize,
}

fn args() -> Args {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str, default: usize| {
        argv.iter()
            .position(|a| a == flag)
            .and_then(|i| argv.get(i + 1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    Args {
        proxies: value("--proxies", 20),
        services: value("--services", 20),
        rounds: value("--rounds", 2),
    }
}

fn round_host(r: usize) -> String {
    format!("round-{r}.{NS}.svc.cluster.local")
}

fn agent_node(index: usize) -> envoy_types::pb::envoy::config::core::v3::Node {
    common::node(
        &format!(
            "sidecar~10.250.{}.{}~agent-{index}.{NS}~{NS}.svc.cluster.local",
            index / 250,
            index % 250 + 1
        ),
        &[("CLUSTER_ID", "c0"), ("DNS_CAPTURE", "true")],
    )
}

/// Per round: each agent's latency to its first table naming the round's service.
#[derive(Default)]
struct Observed {
    rounds: Mutex<HashMap<usize, Vec<Duration>>>,
    ready: AtomicUsize,
}

/// The round in progress: when its change was made.
type Current = Arc<Mutex<Option<(usize, Instant)>>>;

async fn agent(xds: SocketAddr, index: usize, observed: Arc<Observed>, current: Current) {
    let channel = loop {
        match ads::connect(xds).await {
            Ok(c) => break c,
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    let subscription = Subscription {
        node: agent_node(index),
        delta: index % 2 == 1,
        types: vec![(NDS, vec![])],
    };
    let mut first = true;
    let on_table = |raw: &Raw| {
        if std::mem::take(&mut first) {
            observed.ready.fetch_add(1, Ordering::Relaxed);
        }
        let Some((r, started)) = *current.lock() else {
            return;
        };
        if contains(&raw.body, round_host(r).as_bytes()) {
            let mut rounds = observed.rounds.lock();
            rounds.entry(r).or_default().push(started.elapsed());
        }
    };
    let _ = ads::stream(channel, &subscription, on_table, std::future::pending()).await;
}

/// Connects the agents to `xds`, then adds a service per round through `add`; prints and returns
/// (median time until every agent held it, median server CPU-seconds).
async fn rounds(
    what: &str,
    xds: SocketAddr,
    pid: u32,
    a: &Args,
    add: impl Fn(usize),
) -> (f64, f64) {
    let observed = Arc::new(Observed::default());
    let current: Current = Arc::default();
    for i in 0..a.proxies {
        tokio::spawn(agent(xds, i, observed.clone(), current.clone()));
    }
    let obs = observed.clone();
    let expected = a.proxies;
    wait_for(
        "every agent's first table",
        Duration::from_secs(120),
        || {
            let obs = obs.clone();
            async move { (obs.ready.load(Ordering::Relaxed) >= expected).then_some(()) }
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (mut all, mut cpus) = (Vec::new(), Vec::new());
    for r in 1..=a.rounds {
        let (cpu0, _) = proc_stats(pid);
        *current.lock() = Some((r, Instant::now()));
        add(r);
        let obs = observed.clone();
        wait_for("every agent's table names the service", Duration::from_secs(120), || {
            let obs = obs.clone();
            async move { (obs.rounds.lock().get(&r).map_or(0, Vec::len) >= expected).then_some(()) }
        })
        .await;
        let mut latencies = observed.rounds.lock().remove(&r).unwrap_or_default();
        latencies.sort();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (cpu1, _) = proc_stats(pid);
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        let p50 = latencies[latencies.len() / 2];
        let max = latencies[latencies.len() - 1];
        println!(
            "  {what} round {r}: p50 {:.1} ms, all {} agents {:.1} ms; server CPU {:.3} s",
            ms(p50),
            a.proxies,
            ms(max),
            cpu1 - cpu0
        );
        all.push(ms(max));
        cpus.push(cpu1 - cpu0);
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    (median(all), median(cpus))
}

async fn names(a: &Args) {
    println!(
        "## name table push: {} agents (half SotW, half Delta), {} services, a service added per round",
        a.proxies, a.services
    );
    let plane: Plane = plane::file_plane(
        a.services,
        |i| format!("10.{}.{}.{}", 100 + i / 62500, i / 250 % 250, i % 250 + 1),
        &["--debounce-after", "0s"],
    )
    .await;
    let dir = plane.files.path().join("config/clusters/c0");
    let table = naive::capture(
        plane.xds,
        vec![naive::subscription(agent_node(0), NDS, vec![])],
    )
    .await;
    println!("### meshpilot");
    let meshpilot = rounds("meshpilot", plane.xds, plane.process.pid(), a, |r| {
        let text = plane::service_file(&format!("round-{r}"), a.services + r, "10.99.0.1");
        common::write_atomic(&dir.join(format!("round-{r}.yaml")), &text);
    })
    .await;
    println!("### naive fan-out, the same table");
    let naive = NaiveServer::start(table);
    let anchor = rounds("naive", naive.xds, naive.pid(), a, |r| {
        let i = a.services + r;
        naive.add_name(
            &round_host(r),
            &format!("10.96.{}.{}", i / 250, i % 250 + 1),
        );
    })
    .await;
    println!("| figure | meshpilot | naive | meshpilot/naive |\n|---|---|---|---|");
    println!(
        "| every agent holds the new name (median of {} rounds) | {:.1} ms | {:.1} ms | {:.2} |",
        a.rounds,
        meshpilot.0,
        anchor.0,
        meshpilot.0 / anchor.0
    );
    println!(
        "| server CPU per push | {:.3} s | {:.3} s | {:.2} |",
        meshpilot.1,
        anchor.1,
        meshpilot.1 / anchor.1.max(1e-9)
    );
}

fn main() {
    if std::env::args().nth(1).as_deref() == Some(naive::SUBCOMMAND) {
        let path = std::env::args().nth(2).expect("resources file");
        return naive::serve(&path);
    }
    let a = args();
    harness::run(names(&a));
}
