//! Prometheus metrics served on `/metrics`.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::aggregate::Aggregate;
use crate::xds::protocol::ResourceType;

type Labels = Vec<(&'static str, String)>;

pub struct Metrics {
    registry: Registry,
    clusters: Family<Labels, Gauge>,
    cluster_endpoints: Family<Labels, Gauge>,
    cluster_errors: Family<Labels, Gauge>,
    services: Gauge,
    xds: XdsMetrics,
    remote: RemoteMetrics,
}

/// Remote-cluster lifecycle metrics, updated by the secret controller.
#[derive(Clone)]
pub struct RemoteMetrics {
    pub sync_timeouts: Counter,
    pub sync_duration: Histogram,
    pub rotations: Counter,
}

impl Default for RemoteMetrics {
    fn default() -> Self {
        Self {
            sync_timeouts: Counter::default(),
            // 10 ms … ~40 s
            sync_duration: Histogram::new(exponential_buckets(0.01, 2.0, 13)),
            rotations: Counter::default(),
        }
    }
}

/// Handles the xDS server updates (cheap clones of the registered metrics).
#[derive(Clone, Default)]
pub struct XdsMetrics {
    pub connections: Gauge,
    pushes: Family<Labels, Counter>,
    nacks: Family<Labels, Counter>,
    stream_panics: Counter,
    send_timeouts: Counter,
    /// The push counter of each type, looked up once: counting a push is one atomic add.
    push_counters: Vec<Counter>,
}

impl XdsMetrics {
    fn new() -> Self {
        let pushes = Family::<Labels, Counter>::default();
        let push_counters = ResourceType::ALL
            .iter()
            .map(|ty| {
                pushes
                    .get_or_create(&vec![("type", ty.short().to_string())])
                    .clone()
            })
            .collect();
        Self {
            pushes,
            push_counters,
            ..Default::default()
        }
    }

    pub fn pushed(&self, ty: ResourceType) {
        if let Some(counter) = self.push_counters.get(ty.index()) {
            counter.inc();
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

    pub fn nacked(&self, ty: ResourceType) {
        self.nacks
            .get_or_create(&vec![("type", ty.short().to_string())])
            .inc();
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("meshpilot");
        let clusters = Family::<Labels, Gauge>::default();
        let cluster_endpoints = Family::<Labels, Gauge>::default();
        let cluster_errors = Family::<Labels, Gauge>::default();
        let services = Gauge::default();
        registry.register(
            "managed_clusters",
            "Clusters by sync state",
            clusters.clone(),
        );
        registry.register(
            "cluster_endpoints",
            "Endpoints served per cluster",
            cluster_endpoints.clone(),
        );
        registry.register(
            "cluster_errors",
            "1 while a cluster has an unresolved configuration error",
            cluster_errors.clone(),
        );
        registry.register(
            "services",
            "Services in the merged service table",
            services.clone(),
        );
        let xds = XdsMetrics::new();
        registry.register(
            "xds_connections",
            "Connected xDS streams",
            xds.connections.clone(),
        );
        registry.register(
            "xds_pushes",
            "xDS responses sent, by type",
            xds.pushes.clone(),
        );
        registry.register(
            "xds_nacks",
            "xDS responses rejected by proxies, by type",
            xds.nacks.clone(),
        );
        registry.register(
            "xds_stream_panics",
            "xDS stream tasks that panicked (their streams were closed)",
            xds.stream_panics.clone(),
        );
        registry.register(
            "xds_send_timeouts",
            "xDS streams closed because the proxy stopped reading",
            xds.send_timeouts.clone(),
        );
        let remote = RemoteMetrics::default();
        registry.register(
            "remote_cluster_sync_timeouts",
            "Remote clusters that did not sync within --remote-cluster-timeout",
            remote.sync_timeouts.clone(),
        );
        registry.register(
            "remote_cluster_sync_duration_seconds",
            "Time from a remote cluster's onboarding to its first full sync",
            remote.sync_duration.clone(),
        );
        registry.register(
            "remote_cluster_rotations",
            "Remote clusters swapped to a rotated kubeconfig without a gap",
            remote.rotations.clone(),
        );
        Self {
            remote,
            xds,
            registry,
            clusters,
            cluster_endpoints,
            cluster_errors,
            services,
        }
    }

    pub fn remote(&self) -> RemoteMetrics {
        self.remote.clone()
    }

    pub fn xds(&self) -> XdsMetrics {
        self.xds.clone()
    }

    /// Refreshes the model gauges and renders every metric in Prometheus text format.
    pub fn render(&self, aggregate: &Aggregate) -> String {
        self.clusters.clear();
        self.cluster_endpoints.clear();
        self.cluster_errors.clear();
        for cluster in aggregate.clusters() {
            let status = cluster.status();
            let state = serde_json::to_value(status.state)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default();
            self.clusters.get_or_create(&vec![("state", state)]).inc();
            let id = vec![("cluster", cluster.id().to_string())];
            self.cluster_endpoints
                .get_or_create(&id)
                .set(cluster.endpoint_count() as i64);
            self.cluster_errors
                .get_or_create(&id)
                .set(i64::from(status.last_error.is_some()));
        }
        self.services
            .set(aggregate.mesh().snapshot().services.len() as i64);
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}
