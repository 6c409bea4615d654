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

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::wait_for;
use harness::ads::{self, contains, Raw, Subscription, NDS};
use harness::naive::{self, NaiveServer};
use harness::plane::{self, Plane, NS};
use harness::rounds::{flag, Rounds};

struct Args {
    proxies: usize,
    services: usize,
    rounds: usize,
}

fn args() -> Args {
    Args {
        proxies: flag("--proxies", 20),
        services: flag("--services", 20),
        rounds: flag("--rounds", 2),
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

/// How many agents hold their first table, and each round's times.
#[derive(Default)]
struct Observed {
    ready: AtomicUsize,
    rounds: Rounds,
}

async fn agent(xds: SocketAddr, index: usize, observed: Arc<Observed>) {
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
        let names = |r| contains(&raw.body, round_host(r).as_bytes());
        observed.rounds.observe(names);
    };
    let _ = ads::stream(channel, &subscription, on_table, std::future::pending()).await;
}

/// Connects the agents to `xds`, then adds a service per round through `add`; returns (median
/// time until every agent held it, median server CPU-seconds).
async fn rounds(
    what: &str,
    xds: SocketAddr,
    pid: u32,
    a: &Args,
    add: impl Fn(usize),
) -> (f64, f64) {
    let observed = Arc::new(Observed::default());
    for i in 0..a.proxies {
        tokio::spawn(agent(xds, i, observed.clone()));
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
    observed
        .rounds
        .run(what, (pid, a.proxies), a.rounds, add)
        .await
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
    let held = format!(
        "every agent holds the new name (median of {} rounds)",
        a.rounds
    );
    harness::print_row(&held, (meshpilot.0, anchor.0), "ms");
    harness::print_row("server CPU per push", (meshpilot.1, anchor.1), "s");
}

fn main() {
    if harness::ran_as_naive_anchor() {
        return;
    }
    let a = args();
    harness::run(names(&a));
}
