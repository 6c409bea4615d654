//! The config store: accepted Istio config, as part of every mesh snapshot.
//!
//! Sources (config files, the config cluster's API server) are layers: each holds what it accepted;
//! readers see the merge, where the config cluster wins on a key both define. Refusals (objects that
//! did not validate, files that did not parse) are kept beside, for /debug/configz. Derived indexes
//! (`derived`) are computed at most once per published version; DestinationRules are looked up
//! through theirs (`destination_rules`).

mod derived;
mod destination_rules;
pub mod gateway_api;

use std::collections::BTreeSet;
use std::sync::{Arc, OnceLock};

use serde::Serialize;

use super::policies::{self, SecurityPolicies};
use crate::istio::{ConfigKey, ConfigKind, ConfigObject, MeshConfig, Origin};
use derived::Derived;
pub use destination_rules::AppliedRule;

/// Where accepted config came from, in rising precedence.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ConfigSource {
    /// Gateways and VirtualServices made from the config cluster's Kubernetes Ingresses: any
    /// object of another source with the same name wins.
    Ingress,
    /// WorkloadEntries of proxies registered into WorkloadGroups.
    AutoRegistration,
    Files,
    /// MCP sources (`xds://` in the mesh config's `configSources`).
    Mcp,
    ConfigCluster,
}

impl ConfigSource {
    const ALL: [ConfigSource; 5] = [
        Self::Ingress,
        Self::AutoRegistration,
        Self::Files,
        Self::Mcp,
        Self::ConfigCluster,
    ];

    fn index(self) -> usize {
        self as usize
    }
}

/// A change a source makes to what it holds.
#[derive(Clone, Debug)]
pub enum ConfigChange {
    Upsert(Arc<ConfigObject>),
    Delete(ConfigKey),
}

/// Something a source refused, shown until the unit it came from (a file, an object) is good again.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Refusal {
    /// The object, when it got far enough to be named.
    pub key: Option<ConfigKey>,
    /// Its kind, also when it could not be named.
    pub kind: Option<ConfigKind>,
    /// A Kubernetes object that is no Istio config (an Ingress, an IngressClass), when it is one.
    pub subject: Option<Subject>,
    pub origin: Origin,
    pub error: String,
}

/// A Kubernetes object a source reads beside Istio's config.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Subject {
    pub kind: &'static str,
    /// Empty for a cluster-scoped object.
    pub namespace: String,
    pub name: String,
}

#[derive(Clone, Debug)]
pub struct ConfigStore {
    /// Completes short hosts (`reviews` in namespace `shop` → `reviews.shop.svc.<suffix>`).
    domain_suffix: Arc<str>,
    layers: [imbl::OrdMap<ConfigKey, Arc<ConfigObject>>; ConfigSource::ALL.len()],
    merged: imbl::OrdMap<ConfigKey, Arc<ConfigObject>>,
    /// Per source, per unit (a file path, or an object's key): what was refused.
    refusals: imbl::OrdMap<(ConfigSource, String), Arc<[Refusal]>>,
    /// Per kind: bumped whenever an object of the kind changes.
    versions: [u64; ConfigKind::ALL.len()],
    mesh: Arc<MeshConfig>,
    mesh_version: u64,
    derived: Arc<OnceLock<Derived>>,
}

/// What applying changes did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConfigDelta {
    /// Keys whose accepted object changed (appeared, changed or went).
    pub changed: BTreeSet<ConfigKey>,
    /// Namespaces whose proxies may see the changed objects; None: every namespace.
    pub audience: Option<BTreeSet<Arc<str>>>,
}

impl ConfigDelta {
    pub fn is_empty(&self) -> bool {
        self.changed.is_empty()
    }

    pub fn touches(&self, kinds: &[ConfigKind]) -> bool {
        self.changed.iter().any(|k| kinds.contains(&k.kind))
    }
}

impl Default for ConfigStore {
    fn default() -> Self {
        Self::new("cluster.local", MeshConfig::default())
    }
}

impl ConfigStore {
    pub fn new(domain_suffix: &str, mesh: MeshConfig) -> Self {
        Self {
            domain_suffix: domain_suffix.into(),
            layers: Default::default(),
            merged: Default::default(),
            refusals: Default::default(),
            versions: Default::default(),
            mesh: Arc::new(mesh),
            mesh_version: 0,
            derived: Arc::default(),
        }
    }

    /// A host as written in config, made fully qualified: short names are services of `namespace`.
    pub fn qualify(&self, host: &str, namespace: &str) -> String {
        match host.contains('.') || host.starts_with('*') {
            true => host.to_string(),
            false => format!("{host}.{namespace}.svc.{}", self.domain_suffix),
        }
    }

    /// Applies one source's changes; returns which keys changed in the merged view and who sees
    /// them.
    pub fn apply(&mut self, source: ConfigSource, changes: Vec<ConfigChange>) -> ConfigDelta {
        let mut delta = ConfigDelta {
            audience: Some(BTreeSet::new()),
            ..Default::default()
        };
        for change in changes {
            let key = match change {
                ConfigChange::Upsert(object) => {
                    let key = object.key.clone();
                    if self.layers[source.index()].get(&key) == Some(&object) {
                        continue;
                    }
                    self.layers[source.index()].insert(key.clone(), object);
                    key
                }
                ConfigChange::Delete(key) => {
                    if self.layers[source.index()].remove(&key).is_none() {
                        continue;
                    }
                    key
                }
            };
            let before = self.merged.get(&key).cloned();
            let after = ConfigSource::ALL
                .iter()
                .rev()
                .find_map(|s| self.layers[s.index()].get(&key).cloned());
            let same = match (&before, &after) {
                (Some(b), Some(a)) => b.same_content(a),
                (None, None) => true,
                _ => false,
            };
            if same {
                // Keep the newest origin for operators; nothing changes for proxies.
                if let Some(after) = after {
                    self.merged.insert(key, after);
                }
                continue;
            }
            for object in before.iter().chain(after.iter()) {
                self.widen_audience(&mut delta, object);
            }
            match after {
                Some(object) => self.merged.insert(key.clone(), object),
                None => self.merged.remove(&key),
            };
            self.versions[key.kind.index()] += 1;
            delta.changed.insert(key);
        }
        if !delta.changed.is_empty() {
            self.derived = Arc::default();
        }
        delta
    }

    /// Who may see an object: its own namespace and where it is exported; mesh-wide config (the
    /// root namespace) and services are seen by everyone.
    fn widen_audience(&self, delta: &mut ConfigDelta, object: &ConfigObject) {
        let Some(audience) = delta.audience.as_mut() else {
            return;
        };
        let key = &object.key;
        let mesh_wide = *key.namespace == *self.mesh.root_namespace
            || matches!(
                key.kind,
                ConfigKind::ServiceEntry
                    | ConfigKind::WorkloadEntry
                    | ConfigKind::WorkloadGroup
                    | ConfigKind::Gateway
            )
            // Routes attach across namespaces, and mesh routes reach other namespaces' clients.
            || key.kind.is_gateway_api()
            || (key.kind == ConfigKind::PeerAuthentication
                && policies::reaches_clients(self, object));
        let export_to = match object.export_to() {
            [] => self.default_export_to(key.kind),
            e => e,
        };
        if mesh_wide || export_to.iter().any(|e| e == "*") {
            delta.audience = None;
            return;
        }
        audience.insert(key.namespace.clone());
        audience.extend(
            export_to
                .iter()
                .filter(|e| !matches!(e.as_str(), "." | "~"))
                .map(|e| Arc::from(e.as_str())),
        );
    }

    fn default_export_to(&self, kind: ConfigKind) -> &[String] {
        match kind {
            ConfigKind::DestinationRule => &self.mesh.default_destination_rule_export_to,
            ConfigKind::VirtualService => &self.mesh.default_virtual_service_export_to,
            ConfigKind::ServiceEntry => &self.mesh.default_service_export_to,
            _ => &[],
        }
    }

    /// Replaces what one unit of a source has refused (empty: it is all good now).
    pub fn set_refusals(&mut self, source: ConfigSource, unit: &str, refusals: Vec<Refusal>) {
        let key = (source, unit.to_string());
        match refusals.is_empty() {
            true => self.refusals.remove(&key),
            false => self.refusals.insert(key, refusals.into()),
        };
    }

    /// Replaces the mesh config; returns whether it changed.
    pub fn set_mesh(&mut self, mesh: MeshConfig) -> bool {
        if *self.mesh == mesh {
            return false;
        }
        self.mesh = Arc::new(mesh);
        self.mesh_version += 1;
        self.derived = Arc::default();
        true
    }

    pub fn mesh(&self) -> &Arc<MeshConfig> {
        &self.mesh
    }

    /// Bumped whenever the mesh config changes.
    pub fn mesh_version(&self) -> u64 {
        self.mesh_version
    }

    /// Moves whenever a DestinationRule, VirtualService, Gateway, PeerAuthentication (auto mTLS
    /// follows DISABLE), Sidecar, Telemetry, EnvoyFilter, WasmPlugin, an object of the Gateway API
    /// or the mesh config changes: what clusters, routes, listeners and assignments depend on beyond the services.
    pub fn rules_version(&self) -> u64 {
        let kinds = [
            ConfigKind::DestinationRule,
            ConfigKind::VirtualService,
            ConfigKind::Gateway,
            ConfigKind::PeerAuthentication,
            ConfigKind::Sidecar,
            ConfigKind::Telemetry,
            ConfigKind::EnvoyFilter,
            ConfigKind::WasmPlugin,
        ];
        let gateway_api = ConfigKind::ALL.iter().filter(|k| k.is_gateway_api());
        kinds
            .iter()
            .chain(gateway_api)
            .map(|k| self.versions[k.index()])
            .sum::<u64>()
            + self.mesh_version
    }

    /// The Gateway API, compiled (its status included).
    pub fn gateway_api(&self) -> &gateway_api::GatewayApi {
        &self.derived().gateway_api
    }

    /// Moves whenever what decides an endpoint's TLS mode for clients changes: PeerAuthentications
    /// (DISABLE) and the mesh config (its root namespace). Endpoint assignments depend on nothing
    /// else of the config beyond what their cache variant already carries (subset labels, locality
    /// settings), so a DestinationRule or VirtualService change leaves them cached.
    pub fn endpoint_tls_version(&self) -> u64 {
        self.versions[ConfigKind::PeerAuthentication.index()] + self.mesh_version
    }

    /// Bumped whenever an object of `kind` changes.
    pub fn version(&self, kind: ConfigKind) -> u64 {
        self.versions[kind.index()]
    }

    pub fn get(&self, key: &ConfigKey) -> Option<&Arc<ConfigObject>> {
        self.merged.get(key)
    }

    /// Every accepted object of a kind, by namespace and name.
    pub fn of_kind(&self, kind: ConfigKind) -> impl Iterator<Item = &Arc<ConfigObject>> {
        self.merged
            .iter()
            .filter(move |(k, _)| k.kind == kind)
            .map(|(_, o)| o)
    }

    /// Every accepted object, with the source it is served from.
    pub fn accepted(&self) -> impl Iterator<Item = &Arc<ConfigObject>> {
        self.merged.values()
    }

    /// Every refusal currently standing.
    pub fn refusals(&self) -> impl Iterator<Item = (ConfigSource, &Refusal)> {
        self.refusals
            .iter()
            .flat_map(|((source, _), list)| list.iter().map(move |r| (*source, r)))
    }

    /// The security policies, indexed by namespace.
    pub fn security(&self) -> &SecurityPolicies {
        self.derived()
            .security
            .get_or_init(|| SecurityPolicies::build(self))
    }

    pub(super) fn exported_to(&self, object: &ConfigObject, proxy_ns: &str) -> bool {
        if *object.key.namespace == *proxy_ns {
            return true;
        }
        let export_to = match object.export_to() {
            [] => self.default_export_to(object.key.kind),
            e => e,
        };
        export_to.iter().any(|e| e == "*" || *e == *proxy_ns)
    }
}

/// Config objects for the model's unit tests.
#[cfg(test)]
pub(crate) mod fixtures {
    use std::sync::Arc;

    use super::ConfigChange;
    use crate::istio::{ConfigObject, Origin};

    /// An upsert of `kind` (`apiVersion` `api`) `namespace/name`, created at `created`, with the
    /// spec written as YAML.
    pub fn object(
        (api, kind): (&str, &str),
        (namespace, name): (&str, &str),
        created: &str,
        spec: &str,
    ) -> ConfigChange {
        let value: serde_json::Value = serde_yaml_ng::from_str(&format!(
            "apiVersion: {api}
kind: {kind}
metadata: {{name: {name}, namespace: {namespace}, creationTimestamp: '{created}'}}
spec: {spec}
"
        ))
        .expect("YAML");
        let origin = Origin::File {
            path: "test.yaml".into(),
            document: 0,
        };
        let object = ConfigObject::from_value(&value, origin)
            .expect("a kind the store reads")
            .expect("valid");
        ConfigChange::Upsert(Arc::new(object))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::istio::test_object;
    use std::collections::BTreeMap;

    fn dr(ns: &str, name: &str, spec: serde_json::Value, created: &str) -> Arc<ConfigObject> {
        test_object("DestinationRule", ns, name, created, spec)
    }

    const HOST: &str = "reviews.shop.svc.cluster.local";
    static NO_LABELS: BTreeMap<String, String> = BTreeMap::new();

    #[test]
    fn a_selecting_rule_applies_only_to_the_workloads_of_its_namespace_it_selects() {
        let mut store = ConfigStore::default();
        let selector = |labels: serde_json::Value| serde_json::json!({"host": HOST, "workloadSelector": {"matchLabels": labels}});
        store.apply(
            ConfigSource::Files,
            vec![
                ConfigChange::Upsert(dr(
                    "shop",
                    "all",
                    serde_json::json!({"host": HOST}),
                    "2024-01-01T00:00:00Z",
                )),
                ConfigChange::Upsert(dr(
                    "shop",
                    "canary",
                    selector(serde_json::json!({"track": "canary"})),
                    "2024-01-03T00:00:00Z",
                )),
                ConfigChange::Upsert(dr(
                    "shop",
                    "web",
                    selector(serde_json::json!({"app": "web"})),
                    "2024-01-02T00:00:00Z",
                )),
                ConfigChange::Upsert(dr(
                    "other",
                    "foreign",
                    selector(serde_json::json!({"app": "web"})),
                    "2024-01-01T00:00:00Z",
                )),
            ],
        );
        let applied = |ns: &str, labels: &[(&str, &str)]| {
            let labels = labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            let rule = store
                .destination_rule(ns, || &labels, HOST, "shop")
                .unwrap();
            rule.keys
                .iter()
                .map(|k| k.name.to_string())
                .collect::<Vec<_>>()
        };
        assert_eq!(applied("shop", &[]), ["all"]);
        assert_eq!(applied("shop", &[("app", "web")]), ["web"]);
        assert_eq!(
            applied("shop", &[("app", "web"), ("track", "canary")]),
            ["web"],
            "the oldest selecting rule, alone"
        );
        assert_eq!(applied("other", &[("app", "web")]), ["foreign"]);
        assert_eq!(
            applied("elsewhere", &[("app", "web")]),
            ["all"],
            "selecting rules apply to proxies of their own namespace only"
        );
        assert!(store.rules_select_in("shop") && !store.rules_select_in("elsewhere"));
    }

    #[test]
    fn endpoint_tls_moves_with_peer_authentication_and_mesh_only() {
        let mut store = ConfigStore::default();
        let tls = store.endpoint_tls_version();
        let rule = dr("shop", "r", serde_json::json!({"host": HOST}), "1");
        store.apply(ConfigSource::Files, vec![ConfigChange::Upsert(rule)]);
        assert_eq!(
            store.endpoint_tls_version(),
            tls,
            "rules leave assignments cached"
        );
        let peer = test_object(
            "PeerAuthentication",
            "shop",
            "default",
            "1",
            serde_json::json!({"mtls": {"mode": "DISABLE"}}),
        );
        store.apply(ConfigSource::Files, vec![ConfigChange::Upsert(peer)]);
        let tls = store.endpoint_tls_version();
        assert_ne!(tls, 0);
        let mesh = MeshConfig {
            root_namespace: "mesh-root".into(),
            ..MeshConfig::default()
        };
        assert!(store.set_mesh(mesh));
        assert_ne!(store.endpoint_tls_version(), tls);
    }

    #[test]
    fn lookup_order_proxy_then_service_then_root_namespace() {
        let mut store = ConfigStore::default();
        store.apply(
            ConfigSource::Files,
            vec![
                ConfigChange::Upsert(dr(
                    "istio-system",
                    "root",
                    serde_json::json!({"host": "*.svc.cluster.local"}),
                    "1",
                )),
                ConfigChange::Upsert(dr(
                    "shop",
                    "svc",
                    serde_json::json!({"host": "reviews"}),
                    "1",
                )),
                ConfigChange::Upsert(dr(
                    "client",
                    "own",
                    serde_json::json!({"host": HOST, "exportTo": ["."]}),
                    "1",
                )),
                ConfigChange::Upsert(dr(
                    "other",
                    "private",
                    serde_json::json!({"host": HOST, "exportTo": ["."]}),
                    "1",
                )),
            ],
        );
        let applied = |ns: &str| {
            store
                .destination_rule(ns, || &NO_LABELS, HOST, "shop")
                .unwrap()
                .keys[0]
                .to_string()
        };
        assert_eq!(applied("client"), "DestinationRule client/own");
        assert_eq!(applied("shop"), "DestinationRule shop/svc");
        assert_eq!(
            applied("elsewhere"),
            "DestinationRule shop/svc",
            "not other's private rule"
        );
        assert_eq!(
            store
                .destination_rule("x", || &NO_LABELS, "details.x.svc.cluster.local", "x")
                .unwrap()
                .keys[0]
                .to_string(),
            "DestinationRule istio-system/root"
        );
    }

    #[test]
    fn rules_for_one_host_merge_oldest_first() {
        let mut store = ConfigStore::default();
        store.apply(
            ConfigSource::Files,
            vec![
                ConfigChange::Upsert(dr("shop", "b", serde_json::json!({"host": HOST, "subsets": [{"name": "v1", "labels": {"v": "new"}}, {"name": "v2", "labels": {"v": "2"}}]}), "2024-02-01T00:00:00Z")),
                ConfigChange::Upsert(dr("shop", "a", serde_json::json!({"host": HOST, "trafficPolicy": {"loadBalancer": {"simple": "RANDOM"}}, "subsets": [{"name": "v1", "labels": {"v": "old"}}]}), "2024-01-01T00:00:00Z")),
            ],
        );
        let applied = store
            .destination_rule("shop", || &NO_LABELS, HOST, "shop")
            .unwrap();
        let names: Vec<_> = applied
            .rule
            .subsets
            .iter()
            .map(|s| (s.name.as_str(), s.labels["v"].as_str()))
            .collect();
        assert_eq!(names, [("v1", "old"), ("v2", "2")]);
        assert!(applied.rule.traffic_policy.is_some());
    }

    #[test]
    fn the_config_cluster_wins_over_files_and_deltas_name_their_audience() {
        let mut store = ConfigStore::default();
        let file = dr(
            "shop",
            "r",
            serde_json::json!({"host": HOST, "exportTo": ["."]}),
            "1",
        );
        let cluster = dr(
            "shop",
            "r",
            serde_json::json!({"host": HOST, "exportTo": [".", "front"]}),
            "1",
        );
        let delta = store.apply(
            ConfigSource::Files,
            vec![ConfigChange::Upsert(file.clone())],
        );
        assert_eq!(delta.audience, Some(BTreeSet::from([Arc::from("shop")])));
        let delta = store.apply(
            ConfigSource::ConfigCluster,
            vec![ConfigChange::Upsert(cluster.clone())],
        );
        assert_eq!(delta.changed.len(), 1);
        assert_eq!(store.get(&cluster.key), Some(&cluster));
        assert_eq!(
            delta.audience,
            Some(BTreeSet::from([Arc::from("front"), Arc::from("shop")]))
        );
        let delta = store.apply(
            ConfigSource::ConfigCluster,
            vec![ConfigChange::Delete(cluster.key.clone())],
        );
        assert_eq!(
            store.get(&cluster.key),
            Some(&file),
            "the file's version shows again"
        );
        assert!(!delta.is_empty());
        let v = store.version(ConfigKind::DestinationRule);
        let delta = store.apply(ConfigSource::Files, vec![ConfigChange::Upsert(file)]);
        assert!(delta.is_empty());
        assert_eq!(store.version(ConfigKind::DestinationRule), v);
    }
}
