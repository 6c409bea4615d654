//! A cluster's objects, and the reverse indexes that find the services an object change touches.

use std::collections::hash_map::Entry;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::hash::Hash;
use std::net::IpAddr;
use std::sync::Arc;

use super::convert::{EndpointContext, NsName};
use super::objects::{
    Kind, NamespaceObj, NodeObj, Object, ObjectChange, ObjectKey, ServiceObj, SliceObj,
};
use super::pods::PodIndex;
use crate::model::{ClusterId, MeshNaming, MeshNetworks, SecretMaterial, ServiceKey};

/// Services a batch touched.
#[derive(Default)]
pub(super) struct Dirty {
    /// Pods that came, changed or went (or whose node did): ambient mode's workloads, and
    /// ServiceEntries may select them.
    pub(super) pods: BTreeSet<NsName>,
    pub(super) services: BTreeSet<NsName>,
    /// The cluster's network changed: every endpoint is re-derived.
    pub(super) all: bool,
    /// A Service object changed: it may be (or have been) a network's gateway.
    pub(super) definitions: bool,
    /// Secrets whose TLS material came, changed or went.
    pub(super) secrets: BTreeSet<NsName>,
}

/// Whether a registry writes the mesh.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) enum Mode {
    /// Building beside the registry it will replace: keeps objects, publishes nothing.
    Staging,
    #[default]
    Live,
    /// Replaced: ignores every change, so it can never touch the shard it handed over.
    Retired,
}

/// A cluster's objects and the reverse indexes that find the services an object change touches.
#[derive(Default)]
pub(super) struct Store {
    pub(super) mode: Mode,
    pub(super) namespaces: HashMap<String, NamespaceObj>,
    pub(super) services: HashMap<NsName, ServiceObj>,
    pub(super) slices: HashMap<NsName, SliceObj>,
    pub(super) slices_by_service: HashMap<NsName, BTreeSet<String>>,
    pub(super) pods: PodIndex,
    pub(super) nodes: HashMap<String, NodeObj>,
    /// Slices holding an address without a targetRef (the pods' index holds those naming a pod):
    /// nearly always one, so a small list rather than a set.
    pub(super) slices_by_ip: HashMap<(String, IpAddr), Vec<Arc<str>>>,
    /// Services whose ServiceEntry selects pods here, with a shard written for them.
    pub(super) selected: BTreeSet<ServiceKey>,
    /// TLS material of Secrets, for gateway credentials.
    pub(super) secrets: HashMap<NsName, Arc<SecretMaterial>>,
    /// Kinds whose objects came from a saved snapshot and not yet from the cluster's own list.
    pub(super) stale_kinds: HashSet<Kind>,
}

impl Store {
    pub(super) fn apply(
        &mut self,
        change: ObjectChange,
        system_namespace: &str,
        dirty: &mut Dirty,
    ) {
        match change {
            ObjectChange::Upsert(object) => self.upsert(object, system_namespace, dirty),
            ObjectChange::Delete(key) => self.delete(key, system_namespace, dirty),
        }
    }

    pub(super) fn upsert(&mut self, object: Object, system_namespace: &str, dirty: &mut Dirty) {
        match object {
            Object::Namespace(ns) => {
                let name = ns.name.clone();
                let old = self.namespaces.insert(name.clone(), ns);
                let new = &self.namespaces[&name];
                let network_changed = old.as_ref().map(|o| &o.network) != Some(&new.network);
                // A namespace's waypoint is that of its services and pods naming none: rare, so
                // the cluster is re-derived whole.
                let waypoint_changed =
                    old.as_ref().and_then(|o| o.use_waypoint.as_ref()) != new.use_waypoint.as_ref();
                dirty.all |= (name == system_namespace && network_changed) || waypoint_changed;
            }
            Object::Service(svc) => {
                let key = (svc.namespace.clone(), svc.name.clone());
                if self.services.get(&key) != Some(&svc) {
                    self.services.insert(key.clone(), svc);
                    dirty.services.insert(key);
                    dirty.definitions = true;
                }
            }
            Object::EndpointSlice(mut slice) => {
                let key = (slice.namespace.clone(), slice.name.clone());
                if self.slices.get(&key) == Some(&slice) {
                    return;
                }
                self.remove_slice(&key, dirty);
                self.index_slice(&mut slice, true);
                dirty
                    .services
                    .insert((slice.namespace.clone(), slice.service.clone()));
                self.slices_by_service
                    .entry((slice.namespace.clone(), slice.service.clone()))
                    .or_default()
                    .insert(slice.name.clone());
                self.slices.insert(key, slice);
            }
            Object::Pod(pod) => {
                if self.pods.get(&pod.namespace, &pod.name) == Some(&pod) {
                    return;
                }
                let (namespace, name) = (pod.namespace.clone(), pod.name.clone());
                if let Some(old) = self.pods.insert(pod) {
                    self.mark_pod_ips(&old.namespace, &old.ips, dirty);
                }
                dirty.pods.insert((namespace.to_string(), name.to_string()));
                self.mark_pod(&namespace, &name, dirty);
            }
            Object::Node(node) => {
                let name = node.name.clone();
                if self.nodes.get(&name) == Some(&node) {
                    return;
                }
                self.nodes.insert(name.clone(), node);
                self.mark_node(&name, dirty);
            }
            Object::Secret(secret) => {
                let key = (secret.namespace, secret.name);
                let changed = match secret.material {
                    Some(m) => self.secrets.insert(key.clone(), m.clone()) != Some(m),
                    None => self.secrets.remove(&key).is_some(),
                };
                if changed {
                    dirty.secrets.insert(key);
                }
            }
        }
    }

    pub(super) fn delete(&mut self, key: ObjectKey, system_namespace: &str, dirty: &mut Dirty) {
        let ns_name = (key.namespace, key.name);
        match key.kind {
            Kind::Namespace => {
                let old = self.namespaces.remove(&ns_name.1);
                dirty.all |= old.is_some_and(|o| {
                    (ns_name.1 == system_namespace && o.network.is_some())
                        || o.use_waypoint.is_some()
                });
            }
            Kind::Service => {
                if self.services.remove(&ns_name).is_some() {
                    dirty.definitions = true;
                    dirty.services.insert(ns_name);
                }
            }
            Kind::EndpointSlice => self.remove_slice(&ns_name, dirty),
            Kind::Pod => self.remove_pod(&ns_name.0, &ns_name.1, dirty),
            Kind::Node => {
                if self.nodes.remove(&ns_name.1).is_some() {
                    self.mark_node(&ns_name.1, dirty);
                }
            }
            Kind::Secret => {
                if self.secrets.remove(&ns_name).is_some() {
                    dirty.secrets.insert(ns_name);
                }
            }
        }
    }

    pub(super) fn remove_slice(&mut self, key: &NsName, dirty: &mut Dirty) {
        let Some(mut old) = self.slices.remove(key) else {
            return;
        };
        self.index_slice(&mut old, false);
        let service = (old.namespace.clone(), old.service.clone());
        if let Some(names) = self.slices_by_service.get_mut(&service) {
            names.remove(&old.name);
            if names.is_empty() {
                self.slices_by_service.remove(&service);
            }
        }
        dirty.services.insert(service);
    }

    /// Adds (or removes) a slice's references to pods, by targetRef or by address. Added
    /// references share the pod's name.
    pub(super) fn index_slice(&mut self, slice: &mut SliceObj, add: bool) {
        let ns = &slice.namespace;
        let name: Arc<str> = Arc::from(slice.name.as_str());
        for ep in &mut slice.endpoints {
            match &mut ep.pod {
                Some(pod) if add => *pod = self.pods.link(ns, pod, &name),
                Some(pod) => self.pods.unlink(ns, pod, &name),
                None => {
                    for ip in &ep.addresses {
                        toggle(&mut self.slices_by_ip, (ns.clone(), *ip), &name, add);
                    }
                }
            }
        }
    }

    pub(super) fn remove_pod(&mut self, namespace: &str, name: &str, dirty: &mut Dirty) {
        let Some(old) = self.pods.remove(namespace, name) else {
            return;
        };
        dirty.pods.insert((namespace.to_string(), name.to_string()));
        self.mark_pod_ips(&old.namespace, &old.ips, dirty);
        self.mark_pod(namespace, name, dirty);
    }

    /// Marks the services whose slices reference a pod.
    pub(super) fn mark_pod(&self, namespace: &str, name: &str, dirty: &mut Dirty) {
        if let Some(pod) = self.pods.get(namespace, name) {
            self.mark_pod_ips(namespace, &pod.ips, dirty);
        }
        for slice in self.pods.slices_naming(namespace, name) {
            self.mark_slice(namespace, slice, dirty);
        }
    }

    pub(super) fn mark_pod_ips(&self, namespace: &str, ips: &[IpAddr], dirty: &mut Dirty) {
        for ip in ips {
            for slice in self
                .slices_by_ip
                .get(&(namespace.to_string(), *ip))
                .into_iter()
                .flatten()
            {
                self.mark_slice(namespace, slice, dirty);
            }
        }
    }

    pub(super) fn mark_slice(&self, namespace: &str, slice: &str, dirty: &mut Dirty) {
        if let Some(s) = self.slices.get(&(namespace.to_string(), slice.to_string())) {
            dirty
                .services
                .insert((s.namespace.clone(), s.service.clone()));
        }
    }

    pub(super) fn mark_node(&self, node: &str, dirty: &mut Dirty) {
        for pod in self.pods.on_node(node) {
            dirty
                .pods
                .insert((pod.namespace.to_string(), pod.name.to_string()));
            self.mark_pod(&pod.namespace, &pod.name, dirty);
        }
    }

    /// Every service this cluster knows of, by definition or by slices.
    pub(super) fn service_names(&self) -> Vec<NsName> {
        let all: BTreeSet<NsName> = self
            .services
            .keys()
            .chain(self.slices_by_service.keys())
            .cloned()
            .collect();
        all.into_iter().collect()
    }

    pub(super) fn endpoint_context<'a>(
        &'a self,
        cluster: &'a ClusterId,
        naming: &'a MeshNaming,
        networks: &'a MeshNetworks,
    ) -> EndpointContext<'a> {
        let labelled = self
            .namespaces
            .get(&naming.system_namespace)
            .and_then(|ns| ns.network.as_deref());
        EndpointContext {
            cluster,
            naming,
            pods: &self.pods,
            nodes: &self.nodes,
            namespaces: &self.namespaces,
            cluster_network: labelled.or_else(|| networks.network_of_registry(cluster.as_str())),
            networks,
            shared: Default::default(),
        }
    }
}

/// Adds `name` to, or removes it from, the set under `key`; empty sets are dropped.
fn toggle<K: Hash + Eq>(map: &mut HashMap<K, Vec<Arc<str>>>, key: K, name: &Arc<str>, add: bool) {
    if add {
        set_member(map.entry(key).or_default(), name, true);
    } else if let Entry::Occupied(mut names) = map.entry(key) {
        set_member(names.get_mut(), name, false);
        if names.get().is_empty() {
            names.remove();
        }
    }
}

/// Adds `name` to, or removes it from, a small list used as a set.
pub(super) fn set_member(names: &mut Vec<Arc<str>>, name: &Arc<str>, add: bool) {
    if !add {
        names.retain(|n| n != name);
    } else if !names.contains(name) {
        // Sized for the one name nearly every list has (a first push would reserve four).
        names.reserve_exact(1);
        names.push(name.clone());
    }
}
