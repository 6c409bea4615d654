//! ServiceEntries with a `workloadSelector` select this cluster's pods: their shards of
//! endpoints, re-derived when pods or entries change.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::convert::NsName;
use super::objects::PodObj;
use super::store::Store;
use super::ClusterRegistry;
use crate::istio::service_entry::Resolution as EntryResolution;
use crate::istio::{ConfigKind, Spec};
use crate::model::{canonical, Endpoint, Hostname, MeshNetworks, MeshSnapshot, ServiceKey};

impl ClusterRegistry {
    /// The endpoints of this cluster's pods that ServiceEntries with a `workloadSelector` select, for
    /// the entries in `scope`: per entry host, the new shard (None: none any more). Hosts this
    /// cluster defines a Service for keep that Service's endpoints.
    pub(super) fn selected_updates(
        &self,
        store: &mut Store,
        snapshot: &MeshSnapshot,
        networks: &MeshNetworks,
        scope: &Selected,
    ) -> Vec<(ServiceKey, Option<Arc<[Endpoint]>>)> {
        if matches!(scope, Selected::None) {
            return Vec::new();
        }
        let naming = &self.mesh.naming;
        let config = &snapshot.config;
        let ctx = store.endpoint_context(&self.id, naming, networks);
        let mut wanted: BTreeMap<ServiceKey, Vec<Endpoint>> = BTreeMap::new();
        for object in config.of_kind(ConfigKind::ServiceEntry) {
            let Spec::ServiceEntry(entry) = &object.spec else {
                continue;
            };
            let namespace = &object.key.namespace;
            let Some(selector) = &entry.workload_selector else {
                continue;
            };
            if entry.resolution != EntryResolution::Static || !scope.covers(namespace) {
                continue;
            }
            let ports: Vec<(Arc<str>, u16)> = entry
                .ports
                .iter()
                .filter_map(|p| {
                    let port = u16::try_from(p.target_port.unwrap_or(p.number)).ok()?;
                    Some((Arc::from(p.name.as_str()), port))
                })
                .collect();
            let mut endpoints = Vec::new();
            let selects = |pod: &&PodObj| {
                *pod.namespace == **namespace
                    && selector
                        .labels
                        .iter()
                        .all(|(k, v)| pod.labels.get(k) == Some(v))
            };
            for pod in store.pods.iter().filter(selects) {
                ctx.pod_endpoints(pod, &ports, &mut endpoints);
            }
            for host in &entry.hosts {
                let hostname: Hostname = config.qualify(host, namespace).into();
                let own_service = hostname
                    .strip_suffix(&format!(".{namespace}.svc.{}", naming.domain_suffix))
                    .is_some_and(|name| {
                        store
                            .services
                            .contains_key(&(namespace.to_string(), name.to_string()))
                    });
                if own_service {
                    continue;
                }
                let key = ServiceKey {
                    hostname,
                    namespace: namespace.clone(),
                };
                wanted
                    .entry(key)
                    .or_default()
                    .extend(endpoints.iter().cloned());
            }
        }
        let gone: Vec<ServiceKey> = store
            .selected
            .iter()
            .filter(|k| scope.covers(&k.namespace) && !wanted.contains_key(*k))
            .cloned()
            .collect();
        for key in &gone {
            store.selected.remove(key);
        }
        store.selected.extend(wanted.keys().cloned());
        gone.into_iter()
            .map(|k| (k, None))
            .chain(wanted.into_iter().map(|(k, eps)| (k, Some(canonical(eps)))))
            .collect()
    }
}

/// Which ServiceEntries with a `workloadSelector` a publish re-derives.
pub(super) enum Selected {
    None,
    /// Those of the namespaces of these pods (they changed).
    Pods(BTreeSet<NsName>),
    All,
}

impl Selected {
    fn covers(&self, namespace: &str) -> bool {
        match self {
            Selected::None => false,
            Selected::Pods(pods) => {
                let from = (namespace.to_string(), String::new());
                pods.range(from..)
                    .next()
                    .is_some_and(|(ns, _)| ns == namespace)
            }
            Selected::All => true,
        }
    }
}
