//! Watches that retry with backoff, reset by progress only.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use futures::{Stream, StreamExt};
use kube::runtime::utils::Backoff;
use kube::runtime::watcher::{self, Event};

/// Retry delays of a broken watch: from 100 ms, doubling to 5 s, each stretched by up to itself at
/// random (so the many watches of many clusters do not relist in step after an API server comes
/// back), reset by the next event that shows progress (`retried`). Quicker than kube-runtime's default (800 ms to 30 s), so a
/// restarted API server is caught up within seconds.
pub struct WatchBackoff {
    delays: backon::ExponentialBackoff,
}

fn delays() -> backon::ExponentialBackoff {
    ExponentialBuilder::new()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(5))
        .with_factor(2.0)
        .with_jitter()
        .without_max_times()
        .build()
}

impl Default for WatchBackoff {
    fn default() -> Self {
        Self { delays: delays() }
    }
}

impl Iterator for WatchBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        self.delays.next()
    }
}

impl Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.delays = delays();
    }
}

/// A watcher's events, retried after [`WatchBackoff`]'s delays when it fails. kube-runtime's
/// `StreamBackoff` resets its delays on any `Ok`, and the watcher yields `Ok(Event::Init)` before
/// every list attempt: while an API server is down each watch retried every 100–200 ms. Here only
/// what a list or watch delivered (an object, the end of a list) resets them.
pub fn retried<K, S>(events: S) -> impl Stream<Item = watcher::Result<Event<K>>> + Send
where
    K: Send + 'static,
    S: Stream<Item = watcher::Result<Event<K>>> + Send + 'static,
{
    let state = (events.boxed(), WatchBackoff::default(), None::<Duration>);
    futures::stream::unfold(state, |(mut events, mut backoff, pause)| async move {
        if let Some(pause) = pause {
            tokio::time::sleep(pause).await;
        }
        let event = events.next().await?;
        let pause = match &event {
            Err(_) => backoff.next(),
            Ok(Event::Init) => None,
            Ok(_) => {
                backoff.reset();
                None
            }
        };
        Some((event, (events, backoff, pause)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::stream;

    #[test]
    fn watch_retries_double_with_jitter_up_to_their_bound_forever() {
        let first: Vec<Duration> = WatchBackoff::default().take(12).collect();
        let second: Vec<Duration> = WatchBackoff::default().take(12).collect();
        assert_ne!(first, second, "jittered: two watches do not retry in step");
        for (i, delay) in first.iter().enumerate() {
            let base = Duration::from_millis(100 * (1 << i.min(6))).min(Duration::from_secs(5));
            assert!(*delay >= base && *delay <= base * 2, "{i}: {delay:?}");
        }
        let mut backoff = WatchBackoff::default();
        backoff.by_ref().take(100).for_each(drop);
        backoff.reset();
        assert!(backoff.next().unwrap() < Duration::from_millis(200));
    }

    /// How long after the previous event each event of `events` arrives, in virtual time.
    async fn gaps(events: Vec<watcher::Result<Event<()>>>) -> Vec<Duration> {
        let mut retried = Box::pin(retried(stream::iter(events)));
        let mut last = tokio::time::Instant::now();
        let mut gaps = Vec::new();
        while retried.next().await.is_some() {
            gaps.push(last.elapsed());
            last = tokio::time::Instant::now();
        }
        gaps
    }

    #[tokio::test(start_paused = true)]
    async fn a_list_attempt_does_not_reset_the_delays_what_it_delivers_does() {
        let failed = || Err(watcher::Error::NoResourceVersion);
        let mut events = Vec::new();
        for _ in 0..4 {
            events.extend([Ok(Event::Init), failed()]);
        }
        events.extend([
            Ok(Event::Init),
            Ok(Event::InitApply(())),
            failed(),
            Ok(Event::Init),
        ]);
        let gaps = gaps(events).await;
        // After each failure the next attempt waits longer, although each began with Init.
        let after_failures = [gaps[2], gaps[4], gaps[6], gaps[8]];
        for (i, gap) in after_failures.iter().enumerate() {
            let base = Duration::from_millis(100 << i);
            assert!(*gap >= base && *gap <= base * 2, "retry {i}: {gap:?}");
        }
        // An object delivered resets them.
        assert!(gaps[11] >= Duration::from_millis(100) && gaps[11] <= Duration::from_millis(200));
    }
}
