//! Which EnvoyFilters apply to a proxy, in the order istiod applies them (`EnvoyFilters`,
//! pilot/pkg/model/push_context.go): the root namespace's and the proxy namespace's that attach to
//! it (by workload selector, none meaning every workload, or by targetRefs to its Gateway), sorted
//! by priority, then the root namespace's first, then the oldest, then by name.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::config::ConfigStore;
use crate::istio::{ConfigObject, EnvoyFilter, Spec};

impl ConfigStore {
    /// The EnvoyFilters of a proxy of `namespace` with `labels`, in application order.
    pub fn envoy_filters_for(
        &self,
        namespace: &str,
        labels: &BTreeMap<String, String>,
    ) -> Vec<Arc<ConfigObject>> {
        let index = &self.derived().envoy_filters;
        if index.is_empty() {
            return Vec::new();
        }
        let root = self.mesh().root_namespace.as_str();
        let namespaces = [Some(root), (namespace != root).then_some(namespace)];
        let mut applied: Vec<(bool, &Arc<ConfigObject>)> = namespaces
            .into_iter()
            .flatten()
            .flat_map(|ns| {
                let in_root = ns == root;
                index
                    .get(ns)
                    .into_iter()
                    .flatten()
                    .filter(move |o| {
                        envoy_filter(o)
                            .is_some_and(|f| f.attachment().applies(ns, namespace, labels))
                    })
                    .map(move |o| (in_root, o))
            })
            .collect();
        applied.sort_by(|(a_root, a), (b_root, b)| {
            let priority = |o: &ConfigObject| envoy_filter(o).map_or(0, |f| f.priority);
            let name = |o: &ConfigObject| format!("{}.{}", o.key.name, o.key.namespace);
            (priority(a), !a_root, a.meta.creation_timestamp.as_deref())
                .cmp(&(priority(b), !b_root, b.meta.creation_timestamp.as_deref()))
                .then_with(|| name(a).cmp(&name(b)))
        });
        applied.into_iter().map(|(_, o)| o.clone()).collect()
    }
}

/// The EnvoyFilter spec of an object, if it is one.
pub fn envoy_filter(object: &ConfigObject) -> Option<&EnvoyFilter> {
    match &object.spec {
        Spec::EnvoyFilter(f) => Some(f),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::istio::MeshConfig;
    use crate::model::config::fixtures;
    use crate::model::{ConfigChange, ConfigSource};

    fn filter(ns: &str, name: &str, created: &str, spec: &str) -> ConfigChange {
        fixtures::object(
            ("networking.istio.io/v1alpha3", "EnvoyFilter"),
            (ns, name),
            created,
            spec,
        )
    }

    #[test]
    fn priority_then_root_namespace_then_age_then_name() {
        let mut store = ConfigStore::new("cluster.local", MeshConfig::default());
        let t1 = "2024-01-01T00:00:00Z";
        let t2 = "2024-02-01T00:00:00Z";
        store.apply(
            ConfigSource::Files,
            vec![
                filter("shop", "late", t2, "{}"),
                filter("shop", "early", t1, "{}"),
                filter("istio-system", "root", t2, "{}"),
                filter("shop", "urgent", t2, "{priority: -5}"),
                filter("shop", "b-same", t1, "{}"),
                filter(
                    "shop",
                    "other-app",
                    t1,
                    "{workloadSelector: {labels: {app: other}}}",
                ),
                filter("books", "elsewhere", t1, "{}"),
                filter(
                    "istio-system",
                    "mine",
                    t1,
                    "{workloadSelector: {labels: {app: cart}}}",
                ),
            ],
        );
        let labels = BTreeMap::from([("app".to_string(), "cart".to_string())]);
        let names: Vec<String> = store
            .envoy_filters_for("shop", &labels)
            .iter()
            .map(|o| o.key.name.to_string())
            .collect();
        assert_eq!(names, ["urgent", "mine", "root", "b-same", "early", "late"]);
    }
}
