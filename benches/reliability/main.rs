//! Reliability scenarios (issue #18) against the meshpilot binary, its clusters held by test API
//! servers (the config cluster c0 and remotes onboarded by Secret):
//!
//!   cargo bench --bench reliability -- [soak|crash] [--proxies K] [--services S] [--clusters C]
//!       [--eds-per-proxy N] [--seconds T | --minutes T] [--warm-up D] [--crashes N] [--debounce 10ms]
//!       [--flap-every D] [--service-every D] [--rotate-every D] [--reconnect-every D] [--config-every D]
//!
//! `soak`: churn of every kind while K proxies stay connected (see soak.rs); `crash`: kill -9 and
//! restart under load (see crash.rs). Without arguments both run at a small size for a few seconds
//! each: what `cargo test` runs in CI.

#[path = "../../tests/common/mod.rs"]
#[allow(unused_imports)]
mod common;
#[allow(dead_code)] // each harness uses its own subset
#[path = "../harness/mod.rs"]
mod harness;

mod ca;
mod churn;
mod crash;
mod fleet;
mod mesh;
mod soak;

use std::sync::Arc;
use std::time::Duration;

use harness::plane::{remote_secret, Plane};
use mesh::Mesh;
use test_apiserver::TestApiServer;

/// Pacing of the churn generators: one act of each kind per interval.
#[derive(Clone, Debug)]
pub struct Every {
    pub flap: Duration,
    pub service: Duration,
    pub rotation: Duration,
    pub reconnect: Duration,
    pub config: Duration,
}

#[derive(Clone, Debug)]
pub struct Args {
    pub scenario: String,
    pub proxies: usize,
    pub services: usize,
    pub clusters: usize,
    pub eds_per_proxy: usize,
    /// How long the soak churns.
    pub duration: Duration,
    /// The soak's RSS is held flat after this much of it (default: a fifth).
    pub warm_up: Option<Duration>,
    pub crashes: usize,
    /// meshpilot's quiet period before a push: short, so that churn every few tens of
    /// milliseconds is pushed rather than held until the longest wait (10 s).
    pub debounce: String,
    pub every: Every,
}

fn args() -> Args {
    let mut a = Args {
        scenario: "smoke".into(),
        proxies: 40,
        services: 20,
        clusters: 3,
        eds_per_proxy: 5,
        duration: Duration::from_secs(6),
        warm_up: None,
        crashes: 2,
        debounce: "10ms".into(),
        every: Every {
            flap: Duration::from_millis(20),
            service: Duration::from_millis(300),
            rotation: Duration::from_secs(1),
            reconnect: Duration::from_millis(100),
            config: Duration::from_millis(300),
        },
    };
    let mut it = std::env::args().skip(1).filter(|a| a != "--bench");
    while let Some(arg) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{arg} needs a value"));
        let duration =
            |v: String| humantime::parse_duration(&v).unwrap_or_else(|e| panic!("{v}: {e}"));
        match arg.as_str() {
            "--proxies" => a.proxies = value().parse().expect("--proxies"),
            "--services" => a.services = value().parse().expect("--services"),
            "--clusters" => a.clusters = value().parse::<usize>().expect("--clusters").max(1),
            "--eds-per-proxy" => a.eds_per_proxy = value().parse().expect("--eds-per-proxy"),
            "--seconds" => a.duration = Duration::from_secs(value().parse().expect("--seconds")),
            "--minutes" => {
                a.duration = Duration::from_secs(60 * value().parse::<u64>().expect("--minutes"))
            }
            "--warm-up" => a.warm_up = Some(duration(value())),
            "--crashes" => a.crashes = value().parse().expect("--crashes"),
            "--debounce" => a.debounce = value(),
            "--flap-every" => a.every.flap = duration(value()),
            "--service-every" => a.every.service = duration(value()),
            "--rotate-every" => a.every.rotation = duration(value()),
            "--reconnect-every" => a.every.reconnect = duration(value()),
            "--config-every" => a.every.config = duration(value()),
            s if !s.starts_with('-') => a.scenario = s.to_string(),
            other => panic!("unknown argument {other}"),
        }
    }
    a
}

/// The mesh on C test API servers, and meshpilot serving it, ready.
pub async fn start(a: &Args) -> (Plane, Arc<Mesh>) {
    let mesh = Arc::new(Mesh::new(a.services, a.clusters));
    let mut servers = Vec::new();
    for c in 0..a.clusters {
        let api = TestApiServer::start_with_bookmarks(Duration::from_secs(30)).await;
        mesh.populate(&api, c);
        servers.push(api);
    }
    for c in 1..a.clusters {
        let secret = remote_secret(&servers[c], &format!("c{c}"));
        servers[0].apply(secret);
    }
    let plane = Plane::kube(servers, &["--debounce-after", &a.debounce]).await;
    (plane, mesh)
}

fn main() {
    let a = args();
    harness::run(async {
        match a.scenario.as_str() {
            "soak" => soak::run(&a).await,
            "crash" => crash::run(&a).await,
            "smoke" => {
                soak::run(&a).await;
                crash::run(&a).await;
            }
            other => panic!("unknown scenario {other}"),
        }
    });
}
