//! A cluster's objects as saved across restarts (a remote cluster's last-known-good snapshot):
//! taken from the store, restored into a new registry as if listed, and forgotten kind by kind as
//! the cluster's own lists replace them — or all at once when the snapshot expires.

use std::collections::HashSet;
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use super::objects::{
    Kind, NamespaceObj, NodeObj, Object, ObjectChange, ObjectKey, PodObj, ServiceObj, SliceObj,
};
use super::{ClusterRegistry, Store, SyncState};

/// The objects endpoints and services derive from. Secrets are left out: TLS keys are not written
/// to disk, and gateways' credentials return with the cluster's first list.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SavedObjects {
    pub namespaces: Vec<NamespaceObj>,
    pub services: Vec<ServiceObj>,
    pub slices: Vec<SliceObj>,
    pub pods: Vec<PodObj>,
    pub nodes: Vec<NodeObj>,
}

/// The kinds a snapshot holds.
const SAVED_KINDS: [Kind; 5] = [
    Kind::Namespace,
    Kind::Service,
    Kind::EndpointSlice,
    Kind::Pod,
    Kind::Node,
];

impl SavedObjects {
    pub fn len(&self) -> usize {
        self.namespaces.len()
            + self.services.len()
            + self.slices.len()
            + self.pods.len()
            + self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn into_changes(self) -> impl Iterator<Item = ObjectChange> {
        let objects = (self.namespaces.into_iter().map(Object::Namespace))
            .chain(self.nodes.into_iter().map(Object::Node))
            .chain(self.pods.into_iter().map(Object::Pod))
            .chain(self.services.into_iter().map(Object::Service))
            .chain(self.slices.into_iter().map(Object::EndpointSlice));
        objects.map(ObjectChange::Upsert)
    }
}

impl ClusterRegistry {
    /// Moves with every batch applied while live: unchanged means nothing new to save.
    pub fn generation(&self) -> u64 {
        self.generation.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A copy of what a snapshot keeps, taken under the store's lock (a clone of trimmed objects,
    /// milliseconds for tens of thousands).
    pub fn saved_objects(&self) -> SavedObjects {
        let store = self.store.lock();
        SavedObjects {
            namespaces: store.namespaces.values().cloned().collect(),
            services: store.services.values().cloned().collect(),
            slices: store.slices.values().cloned().collect(),
            pods: store.pods.iter().cloned().collect(),
            nodes: store.nodes.values().cloned().collect(),
        }
    }

    /// Serves a snapshot saved at `saved_at` until the cluster's own lists replace it: the objects
    /// are applied as one batch and the cluster is marked stale (which readiness does not wait on).
    pub fn restore(&self, saved: SavedObjects, saved_at: SystemTime) {
        self.store.lock().stale_kinds = SAVED_KINDS.into_iter().collect();
        self.apply(saved.into_changes());
        let mut status = self.status.lock();
        status.state = SyncState::Stale;
        status.snapshot_saved_at = Some(saved_at);
    }

    /// Stops serving a stale snapshot (it expired): the objects of every kind not yet listed from
    /// the cluster are removed and the cluster counts as timed out. False if it was not stale.
    pub fn forget_stale(&self, reason: String) -> bool {
        // One lock throughout, so a list applied meanwhile is never removed with the snapshot.
        let mut store = self.store.lock();
        if self.status().state != SyncState::Stale {
            return false;
        }
        let kinds = std::mem::take(&mut store.stale_kinds);
        let deletes: Vec<ObjectChange> = kinds
            .into_iter()
            .flat_map(|kind| keys_of(&store, kind))
            .map(ObjectChange::Delete)
            .collect();
        self.set_state(SyncState::TimedOut);
        self.set_error(Some(reason));
        self.apply_locked(store, deletes);
        true
    }
}

pub(super) fn keys_of(store: &Store, kind: Kind) -> HashSet<ObjectKey> {
    let namespaced = |(ns, name): &(String, String)| ObjectKey {
        kind,
        namespace: ns.clone(),
        name: name.clone(),
    };
    let global = |name: &String| ObjectKey {
        kind,
        namespace: String::new(),
        name: name.clone(),
    };
    match kind {
        Kind::Namespace => store.namespaces.keys().map(global).collect(),
        Kind::Node => store.nodes.keys().map(global).collect(),
        Kind::Service => store.services.keys().map(namespaced).collect(),
        Kind::EndpointSlice => store.slices.keys().map(namespaced).collect(),
        Kind::Pod => (store.pods.iter())
            .map(|pod| ObjectKey {
                kind,
                namespace: pod.namespace.to_string(),
                name: pod.name.to_string(),
            })
            .collect(),
        Kind::Secret => store.secrets.keys().map(namespaced).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::tests::{apply, endpoints, registry, NODE, POD, SERVICE, SLICE};

    fn objects() -> String {
        [SERVICE, NODE, POD, SLICE].join("---")
    }

    #[test]
    fn a_restored_snapshot_serves_what_was_saved_and_counts_as_stale() {
        let (live, _rx) = registry();
        apply(&live, &objects());
        let saved = live.saved_objects();
        assert_eq!(saved.len(), 4);
        assert_eq!(endpoints(&live).len(), 2);

        let (restarted, _rx) = registry();
        let at = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_700_000_000);
        restarted.restore(saved, at);
        assert_eq!(endpoints(&restarted), endpoints(&live));
        assert_eq!(restarted.status().state, SyncState::Stale);
        assert_eq!(restarted.status().snapshot_saved_at, Some(at));

        restarted.set_state(SyncState::Synced);
        assert_eq!(restarted.status().snapshot_saved_at, None);
        assert!(!restarted.forget_stale("expired".into()));
        assert_eq!(endpoints(&restarted).len(), 2);
    }

    #[test]
    fn expiry_forgets_only_kinds_the_cluster_has_not_listed_yet() {
        let (live, _rx) = registry();
        apply(&live, &objects());
        let (restarted, _rx) = registry();
        restarted.restore(live.saved_objects(), SystemTime::now());
        let pod = live.saved_objects().pods.remove(0);
        restarted.apply_list(Kind::Pod, vec![ObjectChange::Upsert(Object::Pod(pod))]);
        assert!(restarted.forget_stale("snapshot expired".into()));
        assert!(endpoints(&restarted).is_empty());
        assert_eq!(keys_of(&restarted.store.lock(), Kind::Pod).len(), 1);
        assert!(keys_of(&restarted.store.lock(), Kind::Service).is_empty());
        let status = restarted.status();
        assert_eq!(status.state, SyncState::TimedOut);
        assert_eq!(status.last_error.as_deref(), Some("snapshot expired"));
    }
}
