//! The ProxyConfigs in force for injection, as istiod's `EffectiveProxyConfig`
//! (pilot/pkg/model/proxy_config.go) picks them: the root namespace's first one without a selector,
//! then the pod namespace's, then the first of the pod namespace whose selector matches the pod
//! (oldest first at each level); a later level's fields win.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::config::ConfigStore;
use crate::istio::security::{applies_to, selects_workloads};
use crate::istio::{ConfigObject, ProxyConfig, Spec};

/// Every ProxyConfig of one config version, by namespace, oldest first.
#[derive(Clone, Debug, Default)]
pub struct ProxyConfigs {
    root_namespace: String,
    by_namespace: BTreeMap<Arc<str>, Vec<Arc<ConfigObject>>>,
}

/// The ProxyConfigs that apply to one pod, by level.
#[derive(Debug, Default)]
pub struct AppliedProxyConfigs<'a> {
    /// The root namespace's and the pod namespace's (without selectors), in that order.
    pub namespaces: Vec<&'a ProxyConfig>,
    /// The workload's own, which also outranks the pod's `proxy.istio.io/config` annotation.
    pub workload: Option<&'a ProxyConfig>,
}

impl ConfigStore {
    /// The ProxyConfigs of this config version, for injection.
    pub fn proxy_configs(&self) -> ProxyConfigs {
        ProxyConfigs {
            root_namespace: self.mesh().root_namespace.clone(),
            by_namespace: self.derived().proxy_configs.clone(),
        }
    }
}

impl ProxyConfigs {
    /// Those applying to a pod of `namespace` with `labels`.
    pub fn applied(
        &self,
        namespace: &str,
        labels: &BTreeMap<String, String>,
    ) -> AppliedProxyConfigs<'_> {
        let in_namespace = |ns: &str| {
            self.by_namespace
                .get(ns)
                .into_iter()
                .flatten()
                .filter_map(|o| match &o.spec {
                    Spec::ProxyConfig(c) => Some(c),
                    _ => None,
                })
        };
        let namespace_wide = |ns: &str| in_namespace(ns).find(|c| !selects_workloads(&c.selector));
        let root = self.root_namespace.as_str();
        let namespaces = [
            namespace_wide(root),
            (namespace != root)
                .then(|| namespace_wide(namespace))
                .flatten(),
        ];
        AppliedProxyConfigs {
            namespaces: namespaces.into_iter().flatten().collect(),
            workload: in_namespace(namespace)
                .find(|c| selects_workloads(&c.selector) && applies_to(&c.selector, labels)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::istio::MeshConfig;
    use crate::model::config::fixtures;
    use crate::model::{ConfigChange, ConfigSource};

    fn config(ns: &str, name: &str, created: &str, spec: &str) -> ConfigChange {
        fixtures::object(
            ("networking.istio.io/v1beta1", "ProxyConfig"),
            (ns, name),
            created,
            spec,
        )
    }

    #[test]
    fn root_then_namespace_then_the_oldest_selecting_one() {
        let mut store = ConfigStore::new("cluster.local", MeshConfig::default());
        let (t1, t2) = ("2024-01-01T00:00:00Z", "2024-02-01T00:00:00Z");
        store.apply(
            ConfigSource::Files,
            vec![
                config("istio-system", "root", t1, "{concurrency: 1}"),
                config("shop", "newer", t2, "{concurrency: 3}"),
                config("shop", "older", t1, "{concurrency: 2}"),
                config(
                    "shop",
                    "cart",
                    t2,
                    "{selector: {matchLabels: {app: cart}}, concurrency: 5}",
                ),
                config(
                    "shop",
                    "cart-old",
                    t1,
                    "{selector: {matchLabels: {app: cart}}, concurrency: 4}",
                ),
                config(
                    "shop",
                    "other",
                    t1,
                    "{selector: {matchLabels: {app: x}}, concurrency: 9}",
                ),
            ],
        );
        let configs = store.proxy_configs();
        let labels = BTreeMap::from([("app".to_string(), "cart".to_string())]);
        let applied = configs.applied("shop", &labels);
        let levels: Vec<Option<i32>> = applied.namespaces.iter().map(|c| c.concurrency).collect();
        assert_eq!(levels, [Some(1), Some(2)]);
        assert_eq!(applied.workload.and_then(|c| c.concurrency), Some(4));
        assert!(configs
            .applied("books", &BTreeMap::new())
            .workload
            .is_none());
    }
}
