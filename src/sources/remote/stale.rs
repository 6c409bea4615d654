//! Remote clusters' last-known-good snapshots: saved while a synced remote changes, served after a
//! restart while its API server cannot be reached (marked stale), until it syncs or the snapshot
//! passes its maximum age.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use super::Controller;
use crate::model::ClusterId;
use crate::registry::{ClusterRegistry, SyncState};
use crate::sources::snapshots::{Snapshot, SnapshotStore};

/// Last-known-good snapshots: where they are kept, and how old one may be and still be served.
#[derive(Clone, Debug)]
pub struct StaleSnapshots {
    pub store: SnapshotStore,
    pub max_age: Duration,
}

/// How often a changed remote is saved at most: a crash loses at most this much of its changes,
/// which come back with the remote's first list. A remote's first sync is saved within a second.
const SAVE_INTERVAL: Duration = Duration::from_secs(5);
pub(super) const SAVE_CHECK: Duration = Duration::from_secs(1);

impl Controller {
    /// Serves the cluster's last-known-good snapshot until it syncs, if one was saved from the
    /// same cluster (API server and CA) within the maximum age; returns the task that ends it when
    /// it gets too old.
    pub(super) fn serve_snapshot(
        &self,
        id: &ClusterId,
        registry: &Arc<ClusterRegistry>,
        (server, ca): (&str, &str),
    ) -> Option<JoinHandle<()>> {
        let snapshots = self.options.snapshots.as_ref()?;
        let snapshot = match snapshots.store.load(id) {
            Ok(snapshot) => snapshot?,
            Err(e) => {
                warn!(cluster = %id, error = %e, "remote cluster snapshot not used");
                return None;
            }
        };
        if snapshot.server != server {
            info!(cluster = %id, saved_from = snapshot.server, server, "remote cluster snapshot is of another API server; not used");
            return None;
        }
        if snapshot.ca.as_deref().is_some_and(|saved| saved != ca) {
            info!(cluster = %id, server, "remote cluster snapshot is of another cluster at that address (its CA differs); not used");
            return None;
        }
        let age = SystemTime::now()
            .duration_since(snapshot.saved_at)
            .unwrap_or_default();
        let max_age = snapshots.max_age;
        let Some(left) = max_age.checked_sub(age) else {
            info!(cluster = %id, age = %humantime::format_duration(age), "remote cluster snapshot too old; not used");
            return None;
        };
        let objects = snapshot.objects.len();
        registry.restore(snapshot.objects, snapshot.saved_at);
        warn!(cluster = %id, objects, age = %humantime::format_duration(age), "serving the remote cluster's last-known-good snapshot until it syncs");
        let registry = registry.clone();
        Some(tokio::spawn(async move {
            tokio::time::sleep(left).await;
            let reason = format!(
                "last-known-good snapshot older than --stale-remote-max-age ({}); no longer served, still trying",
                humantime::format_duration(max_age)
            );
            if registry.forget_stale(reason) {
                warn!(cluster = %registry.id(), "remote cluster snapshot expired before the cluster synced");
            }
        }))
    }

    /// Saves every synced remote that changed since its last save, off the async workers.
    pub(super) fn save_snapshots(&mut self) {
        let ids: Vec<ClusterId> = self.clusters.keys().cloned().collect();
        for id in ids {
            self.save_snapshot(&id, false);
        }
    }

    /// Saves a synced remote if it changed since its last save, at most every [`SAVE_INTERVAL`]
    /// unless `now`.
    pub(super) fn save_snapshot(&mut self, id: &ClusterId, now: bool) {
        let (Some(snapshots), Some(cluster)) = (&self.options.snapshots, self.clusters.get_mut(id))
        else {
            return;
        };
        let generation = cluster.registry.generation();
        let busy = cluster.saving.as_ref().is_some_and(|t| !t.is_finished());
        let due = match cluster.saved {
            None => true,
            Some((saved, at)) => saved != generation && (now || at.elapsed() >= SAVE_INTERVAL),
        };
        if busy || !due || cluster.registry.status().state != SyncState::Synced {
            return;
        }
        cluster.saved = Some((generation, Instant::now()));
        let (store, registry, server, ca, id) = (
            snapshots.store.clone(),
            cluster.registry.clone(),
            cluster.server.clone(),
            cluster.ca.clone(),
            id.clone(),
        );
        cluster.saving = Some(tokio::task::spawn_blocking(move || {
            let snapshot = Snapshot {
                cluster: id.to_string(),
                server,
                ca: Some(ca),
                saved_at: SystemTime::now(),
                objects: registry.saved_objects(),
            };
            match store.save(&snapshot) {
                Ok(bytes) => debug!(cluster = %id, bytes, "remote cluster snapshot saved"),
                Err(e) => warn!(cluster = %id, error = %e, "remote cluster snapshot not saved"),
            }
        }));
    }
}
