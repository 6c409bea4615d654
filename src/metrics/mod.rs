//! Prometheus metrics on `/metrics`, in the text format istiod serves: istiod's names, labels and
//! buckets wherever istiod has the metric (so its dashboards and alerts work unchanged), and
//! `meshpilot_*` only for what istiod does not measure.

mod ca;
mod xds;

use prometheus::core::Collector;
use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntGauge, IntGaugeVec, Opts, Registry,
    TextEncoder,
};

pub use ca::CaMetrics;

/// What the config gauges show, read when rendered.
pub struct ConfigGauges {
    /// Services in the merged table.
    pub services: usize,
    /// EnvoyFilter patches failing: `<namespace>/<name>` and the patch's target.
    pub failing_patches: Vec<(String, String)>,
    /// MCP config sources: address, synced, failing.
    pub sources: Vec<(String, bool, bool)>,
}

/// What the cluster gauges show of one cluster, read from its registry when rendered.
pub struct ClusterGauges {
    pub id: ClusterId,
    /// Its sync state's name (`synced`, `stale`, …).
    pub state: &'static str,
    pub endpoints: usize,
    /// Whether it has a current error.
    pub failing: bool,
    /// While served from a snapshot: the snapshot's age.
    pub stale_for: Option<std::time::Duration>,
    pub pending_pod_endpoints: usize,
}
pub use xds::{PushMetrics, XdsMetrics, XdsType, XDS_TYPES};

use crate::model::ClusterId;

/// What `/metrics` answers with: Prometheus' text format, as istiod's endpoint.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// istiod's buckets for push and debounce times (seconds).
const PUSH_BUCKETS: [f64; 8] = [0.01, 0.1, 1.0, 3.0, 5.0, 10.0, 20.0, 30.0];
/// istiod's buckets for convergence and queue times (seconds).
const CONVERGENCE_BUCKETS: [f64; 8] = [0.1, 0.5, 1.0, 3.0, 5.0, 10.0, 20.0, 30.0];

/// Registers a metric and hands back a handle to it. Names are constants of this module, so a
/// refusal is a programming error caught by the unit tests.
fn registered<M: Collector + Clone + 'static>(registry: &Registry, metric: M) -> M {
    registry
        .register(Box::new(metric.clone()))
        .expect("metric names are unique and valid");
    metric
}

fn opts(name: &str, help: &str) -> Opts {
    Opts::new(name, help)
}

fn histogram(registry: &Registry, name: &str, help: &str, buckets: &[f64]) -> Histogram {
    let opts = HistogramOpts::new(name, help).buckets(buckets.to_vec());
    registered(
        registry,
        Histogram::with_opts(opts).expect("valid histogram"),
    )
}

pub struct Metrics {
    registry: Registry,
    local_cluster: ClusterId,
    managed_clusters: IntGaugeVec,
    services: IntGauge,
    pending_pods: IntGauge,
    clusters_by_state: IntGaugeVec,
    cluster_endpoints: IntGaugeVec,
    cluster_errors: IntGaugeVec,
    stale_age: IntGaugeVec,
    envoy_filter_status: IntGaugeVec,
    config_source_synced: IntGaugeVec,
    config_source_errors: IntGaugeVec,
    xds: XdsMetrics,
    push: PushMetrics,
    ca: CaMetrics,
    remote: RemoteMetrics,
}

/// Remote-cluster lifecycle metrics, updated by the secret controller.
#[derive(Clone)]
pub struct RemoteMetrics {
    pub sync_timeouts: IntCounter,
    pub sync_duration: Histogram,
    pub rotations: IntCounter,
}

impl RemoteMetrics {
    fn new(registry: &Registry) -> Self {
        let counter = |name: &str, help: &str| {
            registered(
                registry,
                IntCounter::with_opts(opts(name, help)).expect("valid counter"),
            )
        };
        // 10 ms … ~40 s
        let buckets = prometheus::exponential_buckets(0.01, 2.0, 13).expect("valid buckets");
        Self {
            sync_timeouts: counter(
                "remote_cluster_sync_timeouts_total",
                "Remote clusters that did not sync within --remote-cluster-timeout",
            ),
            sync_duration: histogram(
                registry,
                "meshpilot_remote_cluster_sync_duration_seconds",
                "Time from a remote cluster's onboarding to its first full sync",
                &buckets,
            ),
            rotations: counter(
                "meshpilot_remote_cluster_rotations_total",
                "Remote clusters swapped to a rotated kubeconfig without a gap",
            ),
        }
    }
}

impl Metrics {
    /// `local_cluster`: meshpilot's own cluster (`istiod_managed_clusters{cluster_type="local"}`).
    pub fn new(local_cluster: ClusterId) -> Self {
        let registry = Registry::new();
        let gauge_vec = |name: &str, help: &str, labels: &[&str]| {
            registered(
                &registry,
                IntGaugeVec::new(opts(name, help), labels).expect("valid gauge"),
            )
        };
        let gauge = |name: &str, help: &str| {
            registered(
                &registry,
                IntGauge::with_opts(opts(name, help)).expect("valid gauge"),
            )
        };
        Self {
            managed_clusters: gauge_vec(
                "istiod_managed_clusters",
                "Clusters in the mesh, local or remote",
                &["cluster_type"],
            ),
            services: gauge("pilot_services", "Services in the merged service table"),
            pending_pods: gauge(
                "pilot_k8s_endpoints_pending_pod",
                "EndpointSlice endpoints waiting for the pod their targetRef names",
            ),
            clusters_by_state: gauge_vec(
                "meshpilot_managed_clusters",
                "Clusters by sync state",
                &["state"],
            ),
            cluster_endpoints: gauge_vec(
                "meshpilot_cluster_endpoints",
                "Endpoints served per cluster",
                &["cluster"],
            ),
            cluster_errors: gauge_vec(
                "meshpilot_cluster_errors",
                "1 while a cluster has an unresolved configuration error",
                &["cluster"],
            ),
            stale_age: gauge_vec(
                "meshpilot_remote_cluster_stale_seconds",
                "Age of the last-known-good snapshot a remote cluster is served from until it syncs",
                &["cluster"],
            ),
            envoy_filter_status: gauge_vec(
                "pilot_envoy_filter_status",
                "1 for each EnvoyFilter patch that failed to apply (result=error)",
                &["name", "patch", "result"],
            ),
            config_source_synced: gauge_vec(
                "meshpilot_config_source_synced",
                "1 once an MCP config source has answered for every kind it serves",
                &["source"],
            ),
            config_source_errors: gauge_vec(
                "meshpilot_config_source_errors",
                "1 while an MCP config source's connection is failing",
                &["source"],
            ),
            xds: XdsMetrics::new(&registry),
            push: PushMetrics::new(&registry),
            ca: CaMetrics::new(&registry),
            remote: RemoteMetrics::new(&registry),
            local_cluster,
            registry,
        }
    }

    pub fn remote(&self) -> RemoteMetrics {
        self.remote.clone()
    }

    pub fn xds(&self) -> XdsMetrics {
        self.xds.clone()
    }

    pub fn push(&self) -> PushMetrics {
        self.push.clone()
    }

    pub fn ca(&self) -> CaMetrics {
        self.ca.clone()
    }

    /// Refreshes the model gauges from `clusters` and `config`, and renders every metric in
    /// Prometheus' text format.
    pub fn render(&self, clusters: &[ClusterGauges], config: &ConfigGauges) -> String {
        self.envoy_filter_status.reset();
        for (name, target) in &config.failing_patches {
            self.envoy_filter_status
                .with_label_values(&[name.as_str(), target.as_str(), "error"])
                .set(1);
        }
        self.config_source_synced.reset();
        self.config_source_errors.reset();
        for (source, synced, failing) in &config.sources {
            self.config_source_synced
                .with_label_values(&[source.as_str()])
                .set(i64::from(*synced));
            self.config_source_errors
                .with_label_values(&[source.as_str()])
                .set(i64::from(*failing));
        }
        let services = config.services;
        self.clusters_by_state.reset();
        self.cluster_endpoints.reset();
        self.cluster_errors.reset();
        self.stale_age.reset();
        self.managed_clusters.reset();
        let mut pending = 0;
        for cluster in clusters {
            let kind = match cluster.id == self.local_cluster {
                true => "local",
                false => "remote",
            };
            self.managed_clusters.with_label_values(&[kind]).inc();
            self.clusters_by_state
                .with_label_values(&[cluster.state])
                .inc();
            let id = cluster.id.to_string();
            self.cluster_endpoints
                .with_label_values(&[&id])
                .set(cluster.endpoints as i64);
            self.cluster_errors
                .with_label_values(&[&id])
                .set(i64::from(cluster.failing));
            if let Some(age) = cluster.stale_for {
                self.stale_age
                    .with_label_values(&[&id])
                    .set(age.as_secs() as i64);
            }
            pending += cluster.pending_pod_endpoints;
        }
        self.pending_pods.set(pending as i64);
        self.services.set(services as i64);
        let mut out = Vec::new();
        // Encoding into memory fails only on invalid metric data, which the types rule out.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8_lossy(&out).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_registers_under_its_istiod_name() {
        let metrics = Metrics::new(ClusterId::new("local"));
        #[derive(Clone, Copy)]
        struct Clusters;
        impl XdsType for Clusters {
            fn index(self) -> usize {
                0
            }
        }
        metrics.xds().pushed(Clusters, std::time::Duration::ZERO);
        let names: Vec<String> = metrics
            .registry
            .gather()
            .iter()
            .map(|f| f.name().to_string())
            .collect();
        for name in [
            "pilot_xds_pushes",
            "pilot_services",
            "citadel_server_csr_count",
        ] {
            assert!(names.iter().any(|n| n == name), "{name} in {names:?}");
        }
    }
}
