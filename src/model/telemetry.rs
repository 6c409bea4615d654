//! Which Telemetry objects apply to a proxy, and which access log providers follow from them, as
//! istiod computes them (pilot/pkg/model/telemetry.go): the root namespace's Telemetry without a
//! selector, then the proxy namespace's without one, then the oldest one of its namespace whose
//! selector picks the proxy; each level's providers replace the ones before, entries for the
//! other side of the connection (`match.mode`) aside.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::config::ConfigStore;
use crate::istio::security::{applies_to, selects_workloads};
use crate::istio::telemetry::{AccessLogging, CustomTag, TagOperation, WorkloadMode};
use crate::istio::{ConfigObject, Spec, Telemetry};

/// The Telemetry objects that apply to one proxy, least specific first.
#[derive(Clone, Debug, Default)]
pub struct AppliedTelemetry {
    levels: Vec<Arc<ConfigObject>>,
}

/// By the objects that applied: proxies with the same ones (and mesh config) get the same
/// telemetry.
impl std::hash::Hash for AppliedTelemetry {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        for object in &self.levels {
            object.key.hash(state);
        }
    }
}

/// How a proxy logs one side of its traffic.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LogDecision {
    /// No Telemetry says anything of access logs and no default provider is set: the mesh
    /// config's `accessLogFile` decides.
    MeshConfig,
    /// The providers in effect, by name; none (every one disabled) means no log.
    Providers(Vec<ActiveLog>),
}

/// How a proxy traces one side of its traffic (istiod's `Tracing`).
#[derive(Clone, Debug, PartialEq)]
pub enum TraceDecision {
    /// No Telemetry traces and no default provider is set: mesh config `enableTracing` decides,
    /// with the tracer the proxy's own agent configures.
    MeshConfig,
    /// Not traced (span reporting disabled, or no provider).
    Off,
    On(TraceSpec),
}

/// The provider and settings in effect for one side.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceSpec {
    pub provider: String,
    /// None: the mesh config's `defaultConfig.tracing.sampling`, else Istio's 1 %.
    pub sampling: Option<f64>,
    pub custom_tags: BTreeMap<String, CustomTag>,
    pub use_request_id_for_trace_sampling: bool,
    pub istio_tags: bool,
}

/// How Istio's proxies report Istio's metrics, once the Telemetries are merged.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct MetricsPlan {
    /// Per side (client, server): the metric overrides, sorted by metric; None when every metric
    /// is disabled there (no stats filter at all).
    pub client: Option<Vec<MetricOverride>>,
    pub server: Option<Vec<MetricOverride>>,
    /// The last `reportingInterval` given.
    pub reporting_interval: Option<std::time::Duration>,
}

/// One metric's override: dropped, or its tags added, replaced or removed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct MetricOverride {
    pub name: String,
    pub drop: bool,
    /// Tag → Some(CEL value) to set, None to remove; sorted by tag.
    pub tags: BTreeMap<String, Option<String>>,
}

/// A provider in effect and the filter of the entry that named it last.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ActiveLog {
    pub provider: String,
    pub filter: Option<String>,
}

impl ConfigStore {
    /// The Telemetry objects that apply to a proxy of `namespace` with `labels`.
    pub fn telemetry_for(
        &self,
        namespace: &str,
        labels: &BTreeMap<String, String>,
    ) -> AppliedTelemetry {
        let in_namespace = |ns: &str| {
            self.derived()
                .telemetries
                .get(ns)
                .map(Vec::as_slice)
                .unwrap_or_default()
        };
        // An empty selector selects no workload: the Telemetry is namespace-wide, as istiod's
        // `namespaceWideTelemetryConfig` counts it.
        let without_selector = |ns: &str| {
            in_namespace(ns).iter().find(|o| {
                telemetry(o)
                    .is_some_and(|t| !selects_workloads(&t.selector) && !t.attachment().by_target())
            })
        };
        let root = self.mesh().root_namespace.as_str();
        // A workload's own: by selector, or as the proxy of a Gateway it targets.
        let selecting = in_namespace(namespace).iter().find(|o| {
            telemetry(o).is_some_and(|t| {
                let attached = t.attachment();
                match attached.by_target() {
                    true => attached.applies(&o.key.namespace, namespace, labels),
                    false => selects_workloads(&t.selector) && applies_to(&t.selector, labels),
                }
            })
        });
        let levels = [
            without_selector(root),
            without_selector(namespace).filter(|_| namespace != root),
            selecting,
        ];
        AppliedTelemetry {
            levels: levels.into_iter().flatten().cloned().collect(),
        }
    }
}

/// The Telemetry spec of an object, if it is one.
fn telemetry(object: &ConfigObject) -> Option<&Telemetry> {
    match &object.spec {
        Spec::Telemetry(t) => Some(t),
        _ => None,
    }
}

impl AppliedTelemetry {
    /// Istio's metrics as istiod's `mergeMetrics` makes them, for the first provider in scope that
    /// `reports` (Prometheus): the last level naming providers sets which are in scope (the
    /// defaults first); each entry's overrides apply in order to the metrics and sides they
    /// select. None when no provider in scope reports.
    pub fn metrics(
        &self,
        defaults: &[String],
        reports: impl Fn(&str) -> bool,
    ) -> Option<MetricsPlan> {
        let entries = self.metrics_entries();
        let provider = *self
            .metrics_providers(defaults)
            .iter()
            .find(|p| reports(p))?;
        let mut plan = MetricsPlan::default();
        type Overrides = BTreeMap<String, MetricOverride>;
        let (mut client, mut server): (Overrides, Overrides) = Default::default();
        let (mut client_off, mut server_off) = (false, false);
        let mut parent: Vec<&str> = defaults.iter().map(String::as_str).collect();
        for entry in entries {
            let names: Vec<&str> = match entry.providers.is_empty() {
                true => parent.clone(),
                false => entry.providers.iter().map(|p| p.name.as_str()).collect(),
            };
            parent = names.clone();
            if let Some(interval) = entry.reporting_interval {
                plan.reporting_interval = Some(interval.as_std());
            }
            if !names.contains(&provider) {
                continue;
            }
            for o in &entry.overrides {
                let selector = o.matches.clone().unwrap_or_default();
                let sides = [
                    (WorkloadMode::Client, &mut client, &mut client_off),
                    (WorkloadMode::Server, &mut server, &mut server_off),
                ];
                for (mode, overrides, off) in sides {
                    if !matches!(selector.mode, WorkloadMode::ClientAndServer)
                        && selector.mode != mode
                    {
                        continue;
                    }
                    // Every metric disabled drops the filter; anything later brings it back.
                    if selector.is_all() && o.disabled == Some(true) {
                        *off = true;
                        continue;
                    }
                    *off = false;
                    for name in selector.metric_names() {
                        let entry =
                            overrides
                                .entry(name.clone())
                                .or_insert_with(|| MetricOverride {
                                    name,
                                    ..Default::default()
                                });
                        if let Some(disabled) = o.disabled {
                            entry.drop = disabled;
                        }
                        for (tag, edit) in &o.tag_overrides {
                            let value = (edit.operation == TagOperation::Upsert)
                                .then(|| edit.value.clone());
                            entry.tags.insert(tag.clone(), value);
                        }
                    }
                }
            }
        }
        plan.client = (!client_off).then(|| client.into_values().collect());
        plan.server = (!server_off).then(|| server.into_values().collect());
        Some(plan)
    }

    /// The metrics providers in scope: the last level naming some, else the defaults.
    pub fn metrics_providers<'a>(&'a self, defaults: &'a [String]) -> Vec<&'a str> {
        let named = self
            .metrics_entries()
            .into_iter()
            .rev()
            .find(|e| !e.providers.is_empty());
        match named {
            Some(entry) => entry.providers.iter().map(|p| p.name.as_str()).collect(),
            None => defaults.iter().map(String::as_str).collect(),
        }
    }

    fn metrics_entries(&self) -> Vec<&crate::istio::telemetry::Metrics> {
        self.levels
            .iter()
            .filter_map(|o| telemetry(o))
            .flat_map(|t| &t.metrics)
            .collect()
    }

    /// The tracing in effect for traffic of `mode`: the first default provider, then each
    /// Telemetry entry for this side in order (root, namespace, workload) replacing what it sets —
    /// the first provider it names, span reporting, tags, sampling.
    pub fn tracing(&self, defaults: &[String], mode: WorkloadMode) -> TraceDecision {
        let entries: Vec<_> = self
            .levels
            .iter()
            .filter_map(|o| telemetry(o))
            .flat_map(|t| &t.tracing)
            .collect();
        if entries.is_empty() && defaults.is_empty() {
            return TraceDecision::MeshConfig;
        }
        let mut provider = defaults.first().cloned();
        let mut disabled = false;
        let mut spec = TraceSpec {
            provider: String::new(),
            sampling: None,
            custom_tags: BTreeMap::new(),
            use_request_id_for_trace_sampling: true,
            istio_tags: true,
        };
        for entry in entries.into_iter().filter(|e| e.matches(mode)) {
            if let Some(first) = entry.providers.first() {
                provider = Some(first.name.clone());
            }
            if let Some(off) = entry.disable_span_reporting {
                disabled = off;
            }
            if !entry.custom_tags.is_empty() {
                spec.custom_tags = entry.custom_tags.clone();
            }
            if let Some(sampling) = entry.random_sampling_percentage {
                spec.sampling = Some(sampling);
            }
            if let Some(by_id) = entry.use_request_id_for_trace_sampling {
                spec.use_request_id_for_trace_sampling = by_id;
            }
            if let Some(tags) = entry.enable_istio_tags {
                spec.istio_tags = tags;
            }
        }
        match provider {
            Some(provider) if !disabled => TraceDecision::On(TraceSpec { provider, ..spec }),
            _ => TraceDecision::Off,
        }
    }

    /// The access log providers in effect for traffic of `mode`, given the mesh's default ones.
    pub fn access_logging(&self, defaults: &[String], mode: WorkloadMode) -> LogDecision {
        let levels: Vec<&[AccessLogging]> = self
            .levels
            .iter()
            .filter_map(|o| telemetry(o))
            .map(|t| t.access_logging.as_slice())
            .filter(|entries| !entries.is_empty())
            .collect();
        if levels.is_empty() {
            return match defaults.is_empty() {
                true => LogDecision::MeshConfig,
                false => LogDecision::Providers(
                    defaults
                        .iter()
                        .map(|p| ActiveLog {
                            provider: p.clone(),
                            filter: None,
                        })
                        .collect(),
                ),
            };
        }
        // Which providers are in scope: each level that names some for this side replaces them;
        // the filter of a provider is that of the last entry naming it.
        let mut in_scope: BTreeSet<&str> = defaults.iter().map(String::as_str).collect();
        let mut filters: BTreeMap<&str, Option<&str>> = BTreeMap::new();
        for entries in &levels {
            let mut named = BTreeSet::new();
            for entry in entries.iter().filter(|e| e.matches(mode)) {
                for provider in entry.provider_names() {
                    named.insert(provider);
                    let filter = entry.filter.as_ref().map(|f| f.expression.as_str());
                    filters.insert(provider, filter);
                }
            }
            if !named.is_empty() {
                in_scope = named;
            }
        }
        // What each entry says of them, in order: an entry naming no provider speaks for those
        // the entry before it named (the defaults for the first).
        let mut decided: BTreeMap<&str, Option<ActiveLog>> = BTreeMap::new();
        let mut parent: Vec<&str> = defaults.iter().map(String::as_str).collect();
        for entry in levels.iter().flat_map(|entries| entries.iter()) {
            let names = match entry.provider_names() {
                names if names.is_empty() => parent.clone(),
                names => names,
            };
            parent = names.clone();
            if !entry.matches(mode) {
                continue;
            }
            for name in names.into_iter().filter(|n| in_scope.contains(n)) {
                let active = (entry.disabled != Some(true)).then(|| ActiveLog {
                    provider: name.to_string(),
                    filter: filters.get(name).copied().flatten().map(str::to_string),
                });
                decided.insert(name, active);
            }
        }
        // Some Telemetry spoke: what it left (perhaps nothing) is final, the mesh config aside.
        LogDecision::Providers(decided.into_values().flatten().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::istio::{test_object, MeshConfig};
    use crate::model::{ConfigChange, ConfigSource};
    use serde_json::json;

    fn store(objects: &[(&str, &str, serde_json::Value)]) -> ConfigStore {
        let mut store = ConfigStore::new("cluster.local", MeshConfig::default());
        let changes = objects
            .iter()
            .enumerate()
            .map(|(i, (ns, name, spec))| {
                let created = format!("2024-01-01T00:00:{i:02}Z");
                ConfigChange::Upsert(test_object("Telemetry", ns, name, &created, spec.clone()))
            })
            .collect();
        store.apply(ConfigSource::Files, changes);
        store
    }

    fn labels(app: &str) -> BTreeMap<String, String> {
        BTreeMap::from([("app".to_string(), app.to_string())])
    }

    fn providers(decision: LogDecision) -> Vec<(String, Option<String>)> {
        match decision {
            LogDecision::Providers(list) => {
                list.into_iter().map(|l| (l.provider, l.filter)).collect()
            }
            LogDecision::MeshConfig => panic!("fell back to the mesh config"),
        }
    }

    #[test]
    fn without_telemetry_the_defaults_or_the_mesh_config_decide() {
        let store = store(&[]);
        let applied = store.telemetry_for("shop", &labels("web"));
        assert_eq!(
            applied.access_logging(&[], WorkloadMode::Client),
            LogDecision::MeshConfig
        );
        assert_eq!(
            providers(applied.access_logging(&["otel".into()], WorkloadMode::Client)),
            [("otel".to_string(), None)]
        );
    }

    #[test]
    fn a_namespace_disables_what_the_root_turned_on() {
        let store = store(&[
            (
                "istio-system",
                "mesh",
                json!({"accessLogging": [{"providers": [{"name": "envoy"}]}]}),
            ),
            (
                "shop",
                "quiet",
                json!({"accessLogging": [{"disabled": true}]}),
            ),
        ]);
        let shop = store.telemetry_for("shop", &labels("web"));
        assert_eq!(shop.levels.len(), 2);
        assert_eq!(
            shop.access_logging(&[], WorkloadMode::Client),
            LogDecision::Providers(vec![])
        );
        let other = store.telemetry_for("other", &labels("web"));
        assert_eq!(
            providers(other.access_logging(&[], WorkloadMode::Server)),
            [("envoy".to_string(), None)]
        );
    }

    #[test]
    fn disabling_without_providers_turns_the_mesh_config_log_off() {
        let store = store(&[(
            "shop",
            "quiet",
            json!({"accessLogging": [{"disabled": true}]}),
        )]);
        let shop = store.telemetry_for("shop", &labels("web"));
        assert_eq!(
            shop.access_logging(&[], WorkloadMode::Client),
            LogDecision::Providers(vec![])
        );
    }

    #[test]
    fn tracing_follows_the_entries_for_its_side() {
        let store = store(&[
            (
                "istio-system",
                "mesh",
                json!({"tracing": [{
                    "providers": [{"name": "zipkin"}], "randomSamplingPercentage": 10.0
                }]}),
            ),
            (
                "shop",
                "web",
                json!({
                    "selector": {"matchLabels": {"app": "web"}},
                    "tracing": [{"match": {"mode": "SERVER"}, "disableSpanReporting": true},
                                {"match": {"mode": "CLIENT"}, "randomSamplingPercentage": 100.0,
                                 "customTags": {"team": {"literal": {"value": "a"}}}}]
                }),
            ),
        ]);
        let web = store.telemetry_for("shop", &labels("web"));
        assert_eq!(web.tracing(&[], WorkloadMode::Server), TraceDecision::Off);
        let TraceDecision::On(client) = web.tracing(&[], WorkloadMode::Client) else {
            panic!()
        };
        assert_eq!(
            (client.provider.as_str(), client.sampling),
            ("zipkin", Some(100.0))
        );
        assert!(client.custom_tags.contains_key("team"));
        let none = store.telemetry_for("other", &labels("web"));
        let TraceDecision::On(other) = none.tracing(&[], WorkloadMode::Server) else {
            panic!()
        };
        assert_eq!(other.sampling, Some(10.0));
        assert_eq!(
            ConfigStore::new("cluster.local", MeshConfig::default())
                .telemetry_for("shop", &labels("web"))
                .tracing(&[], WorkloadMode::Client),
            TraceDecision::MeshConfig
        );
    }

    #[test]
    fn metric_overrides_merge_per_side() {
        let store = store(&[
            (
                "istio-system",
                "mesh",
                json!({"metrics": [{"overrides": [
                    {"match": {"metric": "REQUEST_COUNT"}, "tagOverrides": {"request_protocol": {"operation": "REMOVE"}}}
                ]}]}),
            ),
            (
                "shop",
                "web",
                json!({
                    "selector": {"matchLabels": {"app": "web"}},
                    "metrics": [{"reportingInterval": "30s", "overrides": [
                        {"match": {"metric": "ALL_METRICS", "mode": "SERVER"}, "disabled": true},
                        {"match": {"metric": "REQUEST_COUNT", "mode": "CLIENT"},
                         "tagOverrides": {"team": {"value": "'payments'"}}}
                    ]}]
                }),
            ),
        ]);
        let prometheus = |p: &str| p == "prometheus";
        let defaults = ["prometheus".to_string()];
        let web = store.telemetry_for("shop", &labels("web"));
        let plan = web
            .metrics(&defaults, prometheus)
            .expect("prometheus in scope");
        assert_eq!(plan.server, None);
        let client = plan.client.expect("client metrics");
        assert_eq!(client.len(), 1);
        assert_eq!(client[0].name, "requests_total");
        assert_eq!(client[0].tags["request_protocol"], None);
        assert_eq!(client[0].tags["team"].as_deref(), Some("'payments'"));
        assert_eq!(
            plan.reporting_interval,
            Some(std::time::Duration::from_secs(30))
        );
        assert!(store
            .telemetry_for("shop", &labels("web"))
            .metrics(&[], prometheus)
            .is_none());
    }

    #[test]
    fn a_workload_replaces_providers_for_its_side_only() {
        let store = store(&[
            (
                "istio-system",
                "mesh",
                json!({"accessLogging": [{"providers": [{"name": "envoy"}]}]}),
            ),
            (
                "shop",
                "web",
                json!({
                    "selector": {"matchLabels": {"app": "web"}},
                    "accessLogging": [{
                        "match": {"mode": "SERVER"},
                        "providers": [{"name": "json-file"}],
                        "filter": {"expression": "response.code >= 400"}
                    }]
                }),
            ),
        ]);
        let web = store.telemetry_for("shop", &labels("web"));
        assert_eq!(
            providers(web.access_logging(&[], WorkloadMode::Server)),
            [(
                "json-file".to_string(),
                Some("response.code >= 400".to_string())
            )]
        );
        assert_eq!(
            providers(web.access_logging(&[], WorkloadMode::Client)),
            [("envoy".to_string(), None)]
        );
        let api = store.telemetry_for("shop", &labels("api"));
        assert_eq!(api.levels.len(), 1);
    }
}
