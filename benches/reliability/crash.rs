//! Crash and restart: with the fleet connected and endpoints flapping, meshpilot is killed with
//! SIGKILL and started again on the same ports. Measured: time from the restart to ready, and to
//! every proxy holding everything it subscribed to again. Checked: the CA root is the same, and no
//! proxy's first response after reconnecting is a partial view (every crash but the first also holds
//! a remote's API server hung for a while, so clusters are still syncing when proxies are back).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::fleet::Fleet;
use crate::{ca, start, Args};

/// How long a hung remote keeps meshpilot syncing after a restart.
const HANG: Duration = Duration::from_secs(1);

/// The target for 1,000 proxies on 2 cores, held in release builds only.
const RECONVERGENCE_TARGET: Duration = Duration::from_secs(2);

pub async fn run(a: &Args) {
    println!(
        "## crash: {} proxies, {} services over {} clusters, {} kill -9 and restart",
        a.proxies, a.services, a.clusters, a.crashes
    );
    let (mut plane, mesh) = start(a).await;
    let fleet = Fleet::start(plane.xds, mesh.clone(), a.proxies, a.eds_per_proxy);
    let connected = fleet
        .wait_synced(Instant::now(), Duration::from_secs(300))
        .await;
    println!(
        "{} proxies in sync after {:.1}s",
        a.proxies,
        connected.as_secs_f64()
    );
    let root = ca::published_root(&plane.servers[0]).await;
    assert_eq!(
        ca::signing_root(&plane, &root).await.as_deref(),
        Ok(root.as_str()),
        "the CA signs with the root it published"
    );

    let mut churn = crate::churn::Churn::default();
    churn.flap(a.every.flap, mesh.clone(), plane.servers.clone());
    let mut reconvergence = Vec::new();
    for round in 1..=a.crashes {
        let hung = (round % 2 == 0 && plane.servers.len() > 1).then(|| plane.servers[1].clone());
        fleet.stats.crashing.store(true, Ordering::Relaxed);
        if let Some(remote) = &hung {
            remote.set_hang(true);
        }
        let restarted = plane.kill_and_restart();
        if let Some(remote) = hung.clone() {
            tokio::spawn(async move {
                tokio::time::sleep(HANG).await;
                remote.set_hang(false);
            });
        }
        plane.ready(Duration::from_secs(60)).await;
        let ready = restarted.elapsed();
        let synced = fleet.wait_synced(restarted, Duration::from_secs(120)).await;
        fleet.stats.crashing.store(false, Ordering::Relaxed);
        let same_root = ca::signing_root(&plane, &root).await;
        println!(
            "  crash {round}{}: ready {:.0} ms after the restart, all {} proxies back in sync after {:.0} ms; {}",
            if hung.is_some() { " (a remote hung for 1s)" } else { "" },
            ready.as_secs_f64() * 1e3,
            a.proxies,
            synced.as_secs_f64() * 1e3,
            fleet.stats.summary()
        );
        assert_eq!(
            same_root.as_deref(),
            Ok(root.as_str()),
            "the CA root after the restart"
        );
        if hung.is_none() {
            reconvergence.push(synced);
        }
    }
    let done = churn.stop().await;
    println!(
        "{} endpoint flaps during the crashes; {} stream errors while meshpilot was down or starting (expected)",
        done[0].1,
        fleet.stats.crash_errors.load(Ordering::Relaxed)
    );
    let worst = reconvergence.iter().max().copied().unwrap_or_default();
    println!(
        "reconvergence after kill -9 (no hung remote): worst {:.0} ms over {} crashes; CA root unchanged",
        worst.as_secs_f64() * 1e3,
        reconvergence.len()
    );
    fleet.stats.assert_clean();
    // Timings of a debug build on shared cores mean little: the target holds for release builds.
    if !cfg!(debug_assertions) {
        assert!(
            worst <= RECONVERGENCE_TARGET,
            "reconvergence took {worst:?}"
        );
    }
}
