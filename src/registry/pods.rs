//! A cluster's pods, found by name and address, and the slices whose targetRefs name them.
//!
//! Sized for 100,000s of pods: a pod's name is allocated once and shared by its slot, its address
//! entries, the slices naming it and its endpoints; namespaces, service accounts, node
//! names and label sets are interned.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::Arc;

use super::intern::Interner;
use super::objects::PodObj;
use super::store::set_member;

#[derive(Default)]
pub(super) struct PodIndex {
    namespaces: HashMap<Arc<str>, NamespacePods>,
    /// Namespaces, service accounts and node names, each held once.
    names: Interner<str>,
    labels: Interner<BTreeMap<String, String>>,
}

#[derive(Default)]
struct NamespacePods {
    slots: HashMap<Arc<str>, PodSlot>,
    /// The pod holding each address (the latest, should two claim one).
    by_ip: HashMap<IpAddr, Arc<str>>,
}

/// A pod name's slot: the pod once it is known, and the slices whose targetRef names it, which may
/// come first (Istio's pending pods). One map for both, as nearly every pod is in both.
#[derive(Default)]
struct PodSlot {
    pod: Option<PodObj>,
    /// Nearly always one, so a small list rather than a set.
    slices: Vec<Arc<str>>,
}

impl PodIndex {
    pub fn get(&self, namespace: &str, name: &str) -> Option<&PodObj> {
        self.namespaces
            .get(namespace)?
            .slots
            .get(name)?
            .pod
            .as_ref()
    }

    /// The pod holding an address in a namespace.
    pub fn at(&self, namespace: &str, ip: IpAddr) -> Option<&PodObj> {
        let pods = self.namespaces.get(namespace)?;
        pods.slots.get(pods.by_ip.get(&ip)?)?.pod.as_ref()
    }

    /// The pod holding an address, whatever its namespace.
    pub fn anywhere_at(&self, ip: IpAddr) -> Option<&PodObj> {
        self.namespaces.values().find_map(|pods| {
            let name = pods.by_ip.get(&ip)?;
            pods.slots.get(name)?.pod.as_ref()
        })
    }

    pub fn in_namespace<'a>(&'a self, namespace: &str) -> impl Iterator<Item = &'a PodObj> {
        let slots = self.namespaces.get(namespace).into_iter();
        slots.flat_map(|ns| ns.slots.values().filter_map(|slot| slot.pod.as_ref()))
    }

    /// The namespaces pods are known in.
    pub fn namespaces(&self) -> impl Iterator<Item = &Arc<str>> {
        self.namespaces.keys()
    }

    pub fn iter(&self) -> impl Iterator<Item = &PodObj> {
        let slots = self.namespaces.values().flat_map(|ns| ns.slots.values());
        slots.filter_map(|slot| slot.pod.as_ref())
    }

    /// The slices whose targetRef names a pod, known or not.
    pub fn slices_naming(&self, namespace: &str, name: &str) -> &[Arc<str>] {
        let slot = self
            .namespaces
            .get(namespace)
            .and_then(|ns| ns.slots.get(name));
        slot.map_or(&[], |slot| &slot.slices)
    }

    /// Slice endpoints naming pods not known yet (`pilot_k8s_endpoints_pending_pod`).
    pub fn pending(&self) -> usize {
        let slots = self.namespaces.values().flat_map(|ns| ns.slots.values());
        slots
            .filter(|slot| slot.pod.is_none())
            .map(|slot| slot.slices.len())
            .sum()
    }

    /// The pods on a node. A scan rather than an index: a node's locality seldom changes, while
    /// an index would cost every pod 60 bytes.
    pub fn on_node<'a>(&'a self, node: &'a str) -> impl Iterator<Item = &'a PodObj> {
        self.iter()
            .filter(move |pod| pod.node.as_deref() == Some(node))
    }

    /// Adds a pod in place of any of its name, which it returns; its strings join the shared ones.
    pub fn insert(&mut self, mut pod: PodObj) -> Option<PodObj> {
        let replaced = self.remove(&pod.namespace, &pod.name);
        pod.service_account = self.names.intern(pod.service_account);
        pod.workload = self.names.intern(pod.workload);
        pod.node = pod.node.map(|node| self.names.intern(node));
        pod.labels = self.labels.intern(pod.labels);
        let (namespace, pods) = self.namespace_mut(&pod.namespace);
        let name = shared_key(&pods.slots, &pod.name, || pod.name.clone());
        for ip in &pod.ips {
            pods.by_ip.insert(*ip, name.clone());
        }
        pod.namespace = namespace;
        pod.name = name.clone();
        pods.slots.entry(name).or_default().pod = Some(pod);
        replaced
    }

    /// Removes a pod; the slices naming it keep its slot.
    pub fn remove(&mut self, namespace: &str, name: &str) -> Option<PodObj> {
        let pods = self.namespaces.get_mut(namespace)?;
        let slot = pods.slots.get_mut(name)?;
        let old = slot.pod.take()?;
        if slot.slices.is_empty() {
            pods.slots.remove(name);
        }
        for ip in &old.ips {
            if pods
                .by_ip
                .get(ip)
                .is_some_and(|holder| **holder == *old.name)
            {
                pods.by_ip.remove(ip);
            }
        }
        self.drop_if_empty(namespace);
        Some(old)
    }

    /// Notes that a slice names a pod in a targetRef. Returns the pod's shared name.
    pub fn link(&mut self, namespace: &str, pod: &str, slice: &Arc<str>) -> Arc<str> {
        let (_, pods) = self.namespace_mut(namespace);
        let name = shared_key(&pods.slots, pod, || Arc::from(pod));
        let slot = pods.slots.entry(name.clone()).or_default();
        set_member(&mut slot.slices, slice, true);
        name
    }

    /// Forgets that a slice names a pod; a slot holding neither goes.
    pub fn unlink(&mut self, namespace: &str, pod: &str, slice: &Arc<str>) {
        let Some(pods) = self.namespaces.get_mut(namespace) else {
            return;
        };
        if let Some(slot) = pods.slots.get_mut(pod) {
            set_member(&mut slot.slices, slice, false);
            if slot.pod.is_none() && slot.slices.is_empty() {
                pods.slots.remove(pod);
            }
        }
        self.drop_if_empty(namespace);
    }

    /// Neither a pod nor a slice naming one is held.
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.namespaces.is_empty()
    }

    /// The shared name of a namespace and its pods, which it joins when new.
    fn namespace_mut(&mut self, namespace: &str) -> (Arc<str>, &mut NamespacePods) {
        let key = match self.namespaces.get_key_value(namespace) {
            Some((key, _)) => key.clone(),
            None => self.names.intern(Arc::from(namespace)),
        };
        (key.clone(), self.namespaces.entry(key).or_default())
    }

    fn drop_if_empty(&mut self, namespace: &str) {
        let empty = self
            .namespaces
            .get(namespace)
            .is_some_and(|pods| pods.slots.is_empty() && pods.by_ip.is_empty());
        if empty {
            self.namespaces.remove(namespace);
        }
    }
}

/// The key a map already holds for `name`, else a new one (`make`): one allocation per pod name.
fn shared_key<V>(
    map: &HashMap<Arc<str>, V>,
    name: &str,
    make: impl FnOnce() -> Arc<str>,
) -> Arc<str> {
    match map.get_key_value(name) {
        Some((key, _)) => key.clone(),
        None => make(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(namespace: &str, name: &str, ip: [u8; 4], node: &str) -> PodObj {
        PodObj {
            name: name.into(),
            namespace: namespace.into(),
            workload: name.into(),
            labels: Arc::new(BTreeMap::from([("app".into(), "web".into())])),
            service_account: "default".into(),
            node: Some(node.into()),
            ips: vec![IpAddr::from(ip)],
            ready: true,
            captured: false,
            host_network: false,
            terminal: false,
            uid: None,
        }
    }

    #[test]
    fn a_pod_is_found_by_name_address_and_node_and_shares_its_strings() {
        let mut index = PodIndex::default();
        let slice: Arc<str> = "web-abc".into();
        let linked = index.link("shop", "web-1", &slice);
        index.insert(pod("shop", "web-1", [10, 0, 0, 1], "n1"));
        index.insert(pod("shop", "web-2", [10, 0, 0, 2], "n1"));
        let web1 = index.get("shop", "web-1").expect("web-1");
        let web2 = index.get("shop", "web-2").expect("web-2");
        assert!(
            Arc::ptr_eq(&web1.name, &linked),
            "the slot's name is the pod's"
        );
        assert!(Arc::ptr_eq(&web1.namespace, &web2.namespace));
        assert!(Arc::ptr_eq(&web1.service_account, &web2.service_account));
        assert!(Arc::ptr_eq(&web1.labels, &web2.labels));
        let nodes = [&web1.node, &web2.node].map(|n| n.clone().expect("node"));
        assert!(Arc::ptr_eq(&nodes[0], &nodes[1]));
        let at = index.at("shop", IpAddr::from([10, 0, 0, 2]));
        assert_eq!(at.map(|p| &*p.name), Some("web-2"));
        assert_eq!(index.on_node("n1").count(), 2);
        assert_eq!(index.slices_naming("shop", "web-1"), &[slice]);
        assert_eq!(index.pending(), 0);
    }

    #[test]
    fn a_slot_lasts_while_its_pod_or_a_slice_naming_it_does() {
        let mut index = PodIndex::default();
        let slice: Arc<str> = "web-abc".into();
        index.insert(pod("shop", "web-1", [10, 0, 0, 1], "n1"));
        index.link("shop", "web-1", &slice);
        let old = index.remove("shop", "web-1").expect("removed");
        assert_eq!(&*old.name, "web-1");
        assert_eq!(
            index.pending(),
            1,
            "the slice's endpoint waits for the pod again"
        );
        assert!(index.at("shop", IpAddr::from([10, 0, 0, 1])).is_none());
        assert_eq!(index.on_node("n1").count(), 0);
        index.unlink("shop", "web-1", &slice);
        assert!(index.is_empty(), "nothing is left once both are gone");
    }

    #[test]
    fn a_pod_replaced_is_returned_and_its_old_address_forgotten() {
        let mut index = PodIndex::default();
        assert!(index
            .insert(pod("shop", "web-1", [10, 0, 0, 1], "n1"))
            .is_none());
        let replaced = index.insert(pod("shop", "web-1", [10, 0, 0, 9], "n1"));
        assert_eq!(
            replaced.map(|p| p.ips),
            Some(vec![IpAddr::from([10, 0, 0, 1])])
        );
        assert!(index.at("shop", IpAddr::from([10, 0, 0, 1])).is_none());
        let at = index.at("shop", IpAddr::from([10, 0, 0, 9]));
        assert_eq!(at.map(|p| &*p.name), Some("web-1"));
    }

    #[test]
    fn an_address_moved_to_another_pod_stays_with_it() {
        let mut index = PodIndex::default();
        index.insert(pod("shop", "old", [10, 0, 0, 1], "n1"));
        index.insert(pod("shop", "new", [10, 0, 0, 1], "n2"));
        index.remove("shop", "old");
        let at = index.at("shop", IpAddr::from([10, 0, 0, 1]));
        assert_eq!(at.map(|p| &*p.name), Some("new"));
    }
}
