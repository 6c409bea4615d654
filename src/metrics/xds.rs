//! The push path's metrics: istiod's `pilot_*` names for connections, pushes, times and rejects.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use prometheus::{Histogram, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

use super::{histogram, opts, registered, CONVERGENCE_BUCKETS, PUSH_BUCKETS};
use crate::text::clip;

/// The xDS types the metrics count, by their short names, in the order of their indexes
/// ([`XdsType::index`]).
pub const XDS_TYPES: [&str; 11] = [
    "cds", "eds", "lds", "rds", "sds", "nds", "ecds", "wds", "wads", "pcds", "mcp",
];

/// An xDS type as the metrics know it: its place in [`XDS_TYPES`].
pub trait XdsType: Copy {
    fn index(self) -> usize;
}

/// Handles the xDS server updates (cheap clones of the registered metrics).
#[derive(Clone)]
pub struct XdsMetrics {
    by_version: IntGaugeVec,
    /// Connected proxies per version label: the label goes when its last proxy does, so clients
    /// cannot grow the label set beyond the connections they hold.
    versions: Arc<Mutex<HashMap<String, usize>>>,
    /// Per type (index of [`XDS_TYPES`]): looked up once, counting is one atomic add.
    pushes: Vec<IntCounter>,
    push_time: Vec<Histogram>,
    send_time: Histogram,
    convergence: Histogram,
    queue: Histogram,
    rejects: Vec<Option<IntGaugeVec>>,
    total_rejects: Vec<IntCounter>,
    stream_panics: IntCounter,
    send_timeouts: IntCounter,
    cache_entries: IntGauge,
}

impl Default for XdsMetrics {
    /// Metrics registered nowhere (for tests and tools that do not serve /metrics).
    fn default() -> Self {
        Self::new(&Registry::new())
    }
}

impl XdsMetrics {
    pub(super) fn new(registry: &Registry) -> Self {
        let counter_vec = |name: &str, help: &str| {
            registered(
                registry,
                IntCounterVec::new(opts(name, help), &["type"]).expect("valid counter"),
            )
        };
        let counter = |name: &str, help: &str| {
            registered(
                registry,
                IntCounter::with_opts(opts(name, help)).expect("valid counter"),
            )
        };
        let pushes = counter_vec("pilot_xds_pushes", "xDS responses sent, by type");
        let total_rejects = counter_vec(
            "pilot_total_xds_rejects",
            "xDS responses rejected by proxies, by type",
        );
        let push_time = registered(
            registry,
            prometheus::HistogramVec::new(
                prometheus::HistogramOpts::new(
                    "pilot_xds_push_time",
                    "Seconds to build one xDS response, by type",
                )
                .buckets(PUSH_BUCKETS.to_vec()),
                &["type"],
            )
            .expect("valid histogram"),
        );
        let rejects = XDS_TYPES
            .iter()
            .map(|ty| {
                // istiod has no reject gauge for SDS, NDS, ECDS, PCDS or its config (MCP) types.
                if matches!(*ty, "sds" | "nds" | "ecds" | "pcds" | "mcp") {
                    return None;
                }
                let name = format!("pilot_xds_{ty}_reject");
                let help = format!("1 per proxy and error code while it rejects {ty}");
                Some(registered(
                    registry,
                    IntGaugeVec::new(Opts::new(name, help), &["node", "err"]).expect("valid gauge"),
                ))
            })
            .collect();
        Self {
            by_version: registered(
                registry,
                IntGaugeVec::new(
                    opts("pilot_xds", "Connected xDS streams, by proxy version"),
                    &["version"],
                )
                .expect("valid gauge"),
            ),
            versions: Arc::default(),
            pushes: XDS_TYPES
                .iter()
                .map(|ty| pushes.with_label_values(&[ty]))
                .collect(),
            push_time: XDS_TYPES
                .iter()
                .map(|ty| push_time.with_label_values(&[ty]))
                .collect(),
            total_rejects: XDS_TYPES
                .iter()
                .map(|ty| total_rejects.with_label_values(&[ty]))
                .collect(),
            send_time: histogram(
                registry,
                "pilot_xds_send_time",
                "Seconds to hand a push's responses to the stream (waiting for a slow reader included)",
                &PUSH_BUCKETS,
            ),
            convergence: histogram(
                registry,
                "pilot_proxy_convergence_time",
                "Seconds from the first change behind a push to its last response queued for the proxy",
                &CONVERGENCE_BUCKETS,
            ),
            queue: histogram(
                registry,
                "pilot_proxy_queue_time",
                "Seconds a push waited in its proxy's slot before the stream took it",
                &CONVERGENCE_BUCKETS,
            ),
            rejects,
            stream_panics: counter(
                "meshpilot_xds_stream_panics_total",
                "xDS stream tasks that panicked (their streams were closed)",
            ),
            send_timeouts: counter(
                "meshpilot_xds_send_timeouts_total",
                "xDS streams closed because the proxy stopped reading",
            ),
            cache_entries: registered(
                registry,
                IntGauge::with_opts(opts(
                    "meshpilot_xds_cache_entries",
                    "Resources and lists the xDS cache holds (bounded by --xds-cache-max-entries)",
                ))
                .expect("valid gauge"),
            ),
        }
    }

    /// The gauge the resource cache keeps its size in.
    pub fn cache_entries(&self) -> IntGauge {
        self.cache_entries.clone()
    }

    pub fn connected(&self, version: &str) {
        let label = version_label(version);
        let mut versions = self.versions.lock();
        *versions.entry(label.clone()).or_default() += 1;
        self.by_version.with_label_values(&[&label]).inc();
    }

    pub fn disconnected(&self, version: &str) {
        let label = version_label(version);
        let mut versions = self.versions.lock();
        let Some(count) = versions.get_mut(&label) else {
            return;
        };
        *count -= 1;
        if *count == 0 {
            versions.remove(&label);
            let _ = self.by_version.remove_label_values(&[&label]);
        } else {
            self.by_version.with_label_values(&[&label]).dec();
        }
    }

    /// One response of this type was built (in `took`) and queued.
    pub fn pushed(&self, ty: impl XdsType, took: Duration) {
        self.pushes[ty.index()].inc();
        self.push_time[ty.index()].observe(took.as_secs_f64());
    }

    pub fn sent(&self, took: Duration) {
        self.send_time.observe(took.as_secs_f64());
    }

    /// A push reached its proxy `took` after the change that caused it.
    pub fn converged(&self, took: Duration) {
        self.convergence.observe(took.as_secs_f64());
    }

    /// A push waited `took` in its proxy's slot before the stream took it.
    pub fn dequeued(&self, took: Duration) {
        self.queue.observe(took.as_secs_f64());
    }

    /// A proxy rejected a response; `err` is the gRPC code name of its error detail (as istiod).
    pub fn nacked(&self, ty: impl XdsType, node: &str, err: &str) {
        self.total_rejects[ty.index()].inc();
        if let Some(gauge) = &self.rejects[ty.index()] {
            gauge.with_label_values(&[node, err]).set(1);
        }
    }

    /// Drops a departed proxy's reject gauges.
    pub fn forget_rejects<'a, T: XdsType + 'a>(
        &self,
        node: &str,
        rejected: impl Iterator<Item = &'a (T, String)>,
    ) {
        for (ty, err) in rejected {
            if let Some(gauge) = &self.rejects[ty.index()] {
                let _ = gauge.remove_label_values(&[node, err]);
            }
        }
    }

    pub fn stream_panicked(&self) {
        self.stream_panics.inc();
    }

    #[cfg(test)]
    pub fn stream_panics(&self) -> u64 {
        self.stream_panics.get()
    }

    pub fn send_timed_out(&self) {
        self.send_timeouts.inc();
    }
}

fn version_label(version: &str) -> String {
    match version {
        "" => "unknown".to_string(),
        // Clients choose it: bounded like any quoted input.
        v => clip(v),
    }
}

/// The debouncer's metrics: why pushes happen and how long changes wait to be merged.
#[derive(Clone)]
pub struct PushMetrics {
    triggers: IntCounterVec,
    debounce_time: Histogram,
}

impl PushMetrics {
    pub(super) fn new(registry: &Registry) -> Self {
        Self {
            triggers: registered(
                registry,
                IntCounterVec::new(
                    opts(
                        "pilot_push_triggers",
                        "Changes that caused pushes, by reason",
                    ),
                    &["type"],
                )
                .expect("valid counter"),
            ),
            debounce_time: histogram(
                registry,
                "pilot_debounce_time",
                "Seconds from the first change of a burst to its merged push",
                &PUSH_BUCKETS,
            ),
        }
    }

    /// A merged push left the debouncer `waited` after its first change; `triggers` counts its
    /// changes by reason.
    pub fn debounced(&self, triggers: &BTreeMap<&'static str, u64>, waited: Duration) {
        for (reason, count) in triggers {
            self.triggers.with_label_values(&[*reason]).inc_by(*count);
        }
        self.debounce_time.observe(waited.as_secs_f64());
    }
}
