//! Rounds of one change each, timed at every client: per round, how long until each client held
//! the change, and the server's CPU for it.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::plane::proc_stats;
use crate::common::wait_for;

#[derive(Default)]
pub struct Rounds {
    /// Per round, each client's time from the change to holding it.
    latencies: Mutex<HashMap<usize, Vec<Duration>>>,
    /// The round in progress and when its change was made.
    current: Mutex<Option<(usize, Instant)>>,
}

impl Rounds {
    /// A client received something: if `holds` says it carries the current round's change, the
    /// client's time is recorded.
    pub fn observe(&self, holds: impl FnOnce(usize) -> bool) {
        let Some((r, started)) = *self.current.lock() else {
            return;
        };
        if holds(r) {
            self.latencies
                .lock()
                .entry(r)
                .or_default()
                .push(started.elapsed());
        }
    }

    /// Makes each round's change with `change` and waits until all `clients` held it; prints each
    /// round and returns the medians of (time until the last client held it in ms, the server's
    /// CPU-seconds).
    pub async fn run(
        &self,
        what: &str,
        (pid, clients): (u32, usize),
        rounds: usize,
        change: impl Fn(usize),
    ) -> (f64, f64) {
        let (mut all, mut cpus) = (Vec::new(), Vec::new());
        for r in 1..=rounds {
            let (cpu0, _) = proc_stats(pid);
            *self.current.lock() = Some((r, Instant::now()));
            change(r);
            wait_for(
                "every client holds the change",
                Duration::from_secs(120),
                || async move {
                    let held = self.latencies.lock().get(&r).map_or(0, Vec::len);
                    (held >= clients).then_some(())
                },
            )
            .await;
            let mut latencies = self.latencies.lock().remove(&r).unwrap_or_default();
            latencies.sort();
            tokio::time::sleep(Duration::from_millis(300)).await;
            let (cpu1, _) = proc_stats(pid);
            let ms = |d: Duration| d.as_secs_f64() * 1000.0;
            println!(
                "  {what} round {r}: p50 {:.1} ms, all {clients} clients {:.1} ms; server CPU {:.3} s",
                ms(latencies[latencies.len() / 2]),
                ms(latencies[latencies.len() - 1]),
                cpu1 - cpu0
            );
            all.push(ms(latencies[latencies.len() - 1]));
            cpus.push(cpu1 - cpu0);
        }
        (median(all), median(cpus))
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// A numeric command-line flag's value (`--flag N`), else `default`.
pub fn flag(flag: &str, default: usize) -> usize {
    let argv: Vec<String> = std::env::args().collect();
    argv.iter()
        .position(|a| a == flag)
        .and_then(|i| argv.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}
