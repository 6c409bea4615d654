//! Indexes derived from the accepted objects, computed at most once per published version.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use super::destination_rules::{self, NamespaceRules};
use super::gateway_api::{self, GatewayApi};
use super::ConfigStore;
use crate::istio::service_settings::ClusterLocalHosts;
use crate::istio::{ConfigKey, ConfigKind, ConfigObject, Sidecar, Spec};
use crate::model::policies::SecurityPolicies;
use crate::model::sidecar_scope::SidecarScope;

/// Indexes derived from the accepted objects.
#[derive(Debug, Default)]
pub(in crate::model) struct Derived {
    /// DestinationRules by namespace, indexed by host.
    pub(super) destination_rules: BTreeMap<Arc<str>, NamespaceRules>,
    /// VirtualServices (those the Gateway API compiles to among them) and Gateways, oldest first.
    pub(in crate::model) virtual_services: Vec<Arc<ConfigObject>>,
    pub(in crate::model) gateways: Vec<Arc<ConfigObject>>,
    /// The Gateway API, compiled: its listeners' Istio Gateways and its status.
    pub(in crate::model) gateway_api: GatewayApi,
    /// Whether some VirtualService matches on the client's labels.
    pub(in crate::model) source_labels_used: bool,
    /// Whether some VirtualService matches on the client's namespace.
    pub(in crate::model) source_namespace_used: bool,
    /// Whether some VirtualService is exported to fewer than every namespace.
    pub(in crate::model) routes_scoped: bool,
    /// The hosts whose endpoints reach only their own cluster's proxies.
    pub(in crate::model) cluster_local: ClusterLocalHosts,
    /// Security policies, indexed when first asked for.
    pub(super) security: OnceLock<SecurityPolicies>,
    /// Sidecars by namespace: those with a workload selector first, each group oldest first.
    pub(in crate::model) sidecars: BTreeMap<Arc<str>, Vec<(ConfigKey, Arc<Sidecar>)>>,
    /// Telemetries attached to workloads, by namespace, oldest first.
    pub(in crate::model) telemetries: BTreeMap<Arc<str>, Vec<Arc<ConfigObject>>>,
    /// EnvoyFilters by namespace.
    pub(in crate::model) envoy_filters: BTreeMap<Arc<str>, Vec<Arc<ConfigObject>>>,
    /// WasmPlugins by namespace, oldest first.
    pub(in crate::model) wasm_plugins: BTreeMap<Arc<str>, Vec<Arc<ConfigObject>>>,
    /// ProxyConfigs by namespace, oldest first.
    pub(in crate::model) proxy_configs: BTreeMap<Arc<str>, Vec<Arc<ConfigObject>>>,
    /// Scopes compiled so far, by Sidecar then proxy namespace (looked up without allocating).
    pub(in crate::model) sidecar_scopes: Mutex<HashMap<ConfigKey, ScopesByNamespace>>,
}

/// One Sidecar's scopes, compiled per proxy namespace.
pub(in crate::model) type ScopesByNamespace = HashMap<Arc<str>, Arc<SidecarScope>>;

impl ConfigStore {
    /// The hosts whose endpoints reach only their own cluster's proxies, as the mesh config's
    /// `serviceSettings` amend istiod's defaults (with the control plane's host from the mesh's
    /// `discoveryAddress`, istiod's default where it names none).
    pub fn cluster_local_hosts(&self) -> &ClusterLocalHosts {
        &self.derived().cluster_local
    }

    fn cluster_local_hosts_now(&self) -> ClusterLocalHosts {
        let given = &self.mesh.default_config.discovery_address;
        let discovery = match given.is_empty() {
            true => format!("istiod.{}.svc:15012", self.mesh.root_namespace),
            false => given.clone(),
        };
        ClusterLocalHosts::new(&self.mesh.service_settings, &self.domain_suffix, &discovery)
    }

    pub(in crate::model) fn derived(&self) -> &Derived {
        self.derived.get_or_init(|| {
            let destination_rules = destination_rules::index(self);
            let sorted = |kind| {
                let mut all: Vec<Arc<ConfigObject>> = self.of_kind(kind).cloned().collect();
                all.sort_by(oldest_first);
                all
            };
            let mut gateway_api = gateway_api::compile(self);
            let mut virtual_services = sorted(ConfigKind::VirtualService);
            virtual_services.append(&mut gateway_api.virtual_services);
            virtual_services.sort_by(oldest_first);
            let client_matches = |o: &Arc<ConfigObject>| -> Vec<(bool, bool)> {
                let Spec::VirtualService(vs) = &o.spec else {
                    return Vec::new();
                };
                let http = vs.http.iter().flat_map(|r| &r.matches);
                let http =
                    http.map(|m| (!m.source_labels.is_empty(), !m.source_namespace.is_empty()));
                let tcp = vs.tcp.iter().flat_map(|r| &r.matches);
                let tcp =
                    tcp.map(|m| (!m.source_labels.is_empty(), !m.source_namespace.is_empty()));
                let tls = vs.tls.iter().flat_map(|r| &r.matches);
                let tls =
                    tls.map(|m| (!m.source_labels.is_empty(), !m.source_namespace.is_empty()));
                http.chain(tcp).chain(tls).collect()
            };
            let matches: Vec<(bool, bool)> =
                virtual_services.iter().flat_map(client_matches).collect();
            let source_labels_used = matches.iter().any(|m| m.0);
            let source_namespace_used = matches.iter().any(|m| m.1);
            let routes_scoped = virtual_services.iter().any(|o| {
                let export_to = match o.export_to() {
                    [] => self.default_export_to(o.key.kind),
                    e => e,
                };
                !export_to.iter().any(|e| e == "*")
            });
            let mut sidecars: BTreeMap<Arc<str>, Vec<(ConfigKey, Arc<Sidecar>)>> = BTreeMap::new();
            let mut by_age = sorted(ConfigKind::Sidecar);
            by_age.sort_by_key(|o| match &o.spec {
                Spec::Sidecar(s) => s.workload_selector.is_none(),
                _ => true,
            });
            for object in by_age {
                if let Spec::Sidecar(sidecar) = &object.spec {
                    sidecars
                        .entry(object.key.namespace.clone())
                        .or_default()
                        .push((object.key.clone(), Arc::new((**sidecar).clone())));
                }
            }
            Derived {
                destination_rules,
                virtual_services,
                gateways: sorted(ConfigKind::Gateway),
                gateway_api,
                source_labels_used,
                source_namespace_used,
                routes_scoped,
                cluster_local: self.cluster_local_hosts_now(),
                security: OnceLock::new(),
                sidecars,
                telemetries: by_namespace(sorted(ConfigKind::Telemetry)),
                envoy_filters: by_namespace(sorted(ConfigKind::EnvoyFilter)),
                wasm_plugins: by_namespace(sorted(ConfigKind::WasmPlugin)),
                proxy_configs: by_namespace(sorted(ConfigKind::ProxyConfig)),
                sidecar_scopes: Mutex::default(),
            }
        })
    }
}

/// Objects by namespace, in the order given.
fn by_namespace(objects: Vec<Arc<ConfigObject>>) -> BTreeMap<Arc<str>, Vec<Arc<ConfigObject>>> {
    let mut out: BTreeMap<Arc<str>, Vec<Arc<ConfigObject>>> = BTreeMap::new();
    for object in objects {
        out.entry(object.key.namespace.clone())
            .or_default()
            .push(object);
    }
    out
}

/// istiod's order for merging config of one kind: by creation time, then namespace and name.
pub(super) fn oldest_first(a: &Arc<ConfigObject>, b: &Arc<ConfigObject>) -> std::cmp::Ordering {
    (a.meta.creation_timestamp.as_deref(), &a.key)
        .cmp(&(b.meta.creation_timestamp.as_deref(), &b.key))
}
