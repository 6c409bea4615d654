//! Which WasmPlugins apply to a proxy, in the order istiod places them (`WasmPluginsByListenerInfo`,
//! pilot/pkg/model/push_context.go): those of the proxy's namespace and of the root namespace that
//! attach to it, by phase, then priority (higher first; unset after every set one, as istiod
//! sorts it), then the proxy's namespace before the root's, then the oldest.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::config::ConfigStore;
use crate::istio::{ConfigObject, Spec, WasmPlugin};

impl ConfigStore {
    /// The WasmPlugins of a proxy of `namespace` with `labels`, in placement order.
    pub fn wasm_plugins_for(
        &self,
        namespace: &str,
        labels: &BTreeMap<String, String>,
    ) -> Vec<Arc<ConfigObject>> {
        let index = &self.derived().wasm_plugins;
        if index.is_empty() {
            return Vec::new();
        }
        let root = self.mesh().root_namespace.as_str();
        let namespaces = [Some(namespace), (namespace != root).then_some(root)];
        let mut applied: Vec<&Arc<ConfigObject>> = namespaces
            .into_iter()
            .flatten()
            .flat_map(|ns| {
                index.get(ns).into_iter().flatten().filter(move |o| {
                    wasm_plugin(o).is_some_and(|p| p.attachment().applies(ns, namespace, labels))
                })
            })
            .collect();
        // Stable: the namespace order and age within a (phase, priority) stay.
        applied.sort_by_key(|o| {
            let plugin = wasm_plugin(o);
            let phase = plugin.map(|p| p.phase).unwrap_or_default();
            let priority = plugin.and_then(|p| p.priority).unwrap_or(i32::MIN);
            (phase, std::cmp::Reverse(priority))
        });
        applied.into_iter().cloned().collect()
    }

    /// The WasmPlugin `<namespace>/<name>`.
    pub fn wasm_plugin(&self, namespace: &str, name: &str) -> Option<&Arc<ConfigObject>> {
        self.derived()
            .wasm_plugins
            .get(namespace)?
            .iter()
            .find(|o| *o.key.name == *name)
    }
}

/// The WasmPlugin spec of an object, if it is one.
pub fn wasm_plugin(object: &ConfigObject) -> Option<&WasmPlugin> {
    match &object.spec {
        Spec::WasmPlugin(p) => Some(p),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::istio::MeshConfig;
    use crate::model::config::fixtures;
    use crate::model::{ConfigChange, ConfigSource};

    fn plugin(ns: &str, name: &str, created: &str, spec: &str) -> ConfigChange {
        fixtures::object(
            ("extensions.istio.io/v1alpha1", "WasmPlugin"),
            (ns, name),
            created,
            spec,
        )
    }

    #[test]
    fn phase_then_priority_then_namespace_then_age() {
        let mut store = ConfigStore::new("cluster.local", MeshConfig::default());
        let (t1, t2) = ("2024-01-01T00:00:00Z", "2024-02-01T00:00:00Z");
        let url = "url: oci://registry/p:1";
        store.apply(
            ConfigSource::Files,
            vec![
                plugin("shop", "stats", t1, &format!("{{{url}, phase: STATS}}")),
                plugin("shop", "unset", t1, &format!("{{{url}}}")),
                plugin("shop", "low", t1, &format!("{{{url}, priority: -5}}")),
                plugin("shop", "high", t2, &format!("{{{url}, priority: 10}}")),
                plugin(
                    "istio-system",
                    "root-high",
                    t1,
                    &format!("{{{url}, priority: 10}}"),
                ),
                plugin("shop", "authn", t2, &format!("{{{url}, phase: AUTHN}}")),
                plugin(
                    "shop",
                    "other",
                    t1,
                    &format!("{{{url}, selector: {{matchLabels: {{app: x}}}}}}"),
                ),
                plugin("books", "elsewhere", t1, &format!("{{{url}}}")),
            ],
        );
        let labels = BTreeMap::from([("app".to_string(), "cart".to_string())]);
        let names: Vec<String> = store
            .wasm_plugins_for("shop", &labels)
            .iter()
            .map(|o| o.key.name.to_string())
            .collect();
        assert_eq!(
            names,
            ["high", "root-high", "low", "unset", "authn", "stats"]
        );
    }
}
