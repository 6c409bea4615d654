//! Churn soak: the fleet connected while endpoints flap, services come and go, remote kubeconfigs
//! rotate, proxies reconnect and DestinationRules change. Passes with no stream error, no assignment
//! without a service's stable endpoints, every proxy converged on the final state once churn stops,
//! and (long form) meshpilot's RSS after warm-up within ±5 % of the first post-warm-up window.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::fleet::Fleet;
use crate::harness::plane::proc_stats;
use crate::{start, Args};

/// RSS is sampled this often; windows of samples are averaged.
const SAMPLE: Duration = Duration::from_secs(1);

pub async fn run(a: &Args) {
    println!(
        "## soak: {} proxies, {} services over {} clusters, {:?}",
        a.proxies, a.services, a.clusters, a.duration
    );
    let (plane, mesh) = start(a).await;
    let fleet = Arc::new(Fleet::start(
        plane.xds,
        mesh.clone(),
        a.proxies,
        a.eds_per_proxy,
    ));
    let connected = fleet
        .wait_synced(Instant::now(), Duration::from_secs(300))
        .await;
    println!(
        "{} proxies in sync after {:.1}s",
        a.proxies,
        connected.as_secs_f64()
    );

    let mut churn = crate::churn::Churn::default();
    churn.flap(a.every.flap, mesh.clone(), plane.servers.clone());
    churn.services(a.every.service, plane.servers.clone());
    churn.rotations(a.every.rotation, plane.admin, plane.servers.clone());
    churn.reconnects(a.every.reconnect, fleet.clone());
    churn.config(a.every.config, a.services, plane.servers[0].clone());

    let pid = plane.process.pid();
    let started = Instant::now();
    let mut samples = Vec::new();
    let report_every = (a.duration / 10).max(SAMPLE);
    let mut reported = Instant::now();
    while started.elapsed() < a.duration {
        tokio::time::sleep(SAMPLE).await;
        samples.push(proc_stats(pid).1 as f64 / 1048576.0);
        if reported.elapsed() >= report_every {
            reported = Instant::now();
            println!(
                "  {:>4.0}s: RSS {:.1} MiB; {}",
                started.elapsed().as_secs_f64(),
                samples.last().unwrap(),
                fleet.stats.summary()
            );
        }
    }
    let done = churn.stop().await;
    let (cpu, _) = proc_stats(pid);
    println!(
        "churn over {:.0}s: {}; meshpilot CPU {cpu:.1}s",
        started.elapsed().as_secs_f64(),
        done.iter()
            .map(|(what, n)| format!("{n} {what}"))
            .collect::<Vec<_>>()
            .join(", ")
    );

    // Once churn stops, every proxy holds every service's current endpoints.
    let settled = Instant::now();
    let mut last = None;
    let converged = eventually(Duration::from_secs(60), || {
        let (stale, first) = fleet.stale(&mesh);
        last = first;
        stale == 0
    })
    .await;
    assert!(
        converged,
        "proxies still stale 60s after churn stopped, e.g. {last:?}"
    );
    println!(
        "converged on the final state {:.0} ms after churn stopped",
        settled.elapsed().as_secs_f64() * 1e3
    );

    let stats = &fleet.stats;
    println!("{}", stats.summary());
    let warm_up = a.warm_up.unwrap_or(a.duration / 5);
    let flat = rss_flatness(&samples, a.duration, warm_up);
    if let Some((baseline, worst, last)) = flat {
        println!(
            "RSS after a warm-up of {warm_up:?}: baseline {baseline:.1} MiB; windows within {worst:+.1} % of it at worst; last window {last:+.1} %"
        );
    }
    stats.assert_clean();
    // Memory flatness needs minutes: the long form holds it to ±5 %, the smoke only prints it.
    if a.duration >= Duration::from_secs(60) {
        let (_, worst, _) = flat.expect("RSS samples");
        assert!(worst.abs() <= 5.0, "RSS moved {worst:+.1} % after warm-up");
    }
    drop(plane);
}

/// Polls `check` until true or `bound` passes; whether it became true.
async fn eventually(bound: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + bound;
    while Instant::now() < deadline {
        if check() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    check()
}

/// After the warm-up, the mean RSS of each tenth of the run against the first such window:
/// (baseline MiB, largest deviation %, last window's deviation %).
fn rss_flatness(samples: &[f64], duration: Duration, warm_up: Duration) -> Option<(f64, f64, f64)> {
    let per_window = ((duration.as_secs_f64() / 10.0 / SAMPLE.as_secs_f64()) as usize).max(1);
    let warm = (warm_up.as_secs_f64() / SAMPLE.as_secs_f64()) as usize;
    let windows: Vec<f64> = samples
        .get(warm..)?
        .chunks(per_window)
        .filter(|w| w.len() == per_window)
        .map(|w| w.iter().sum::<f64>() / w.len() as f64)
        .collect();
    let baseline = *windows.first()?;
    let deviation = |w: f64| (w - baseline) / baseline * 100.0;
    let worst = windows
        .iter()
        .map(|&w| deviation(w))
        .fold(0.0, |a: f64, d| if d.abs() > a.abs() { d } else { a });
    Some((baseline, worst, deviation(*windows.last()?)))
}
