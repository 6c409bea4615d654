//! The aggregate controller: every cluster's registry under one roof.
//!
//! It owns the set and order of registries (the config cluster first), keeps the merged service
//! table's order in step, and fans every registry's changes into one stream for the push pipeline.

use std::sync::Arc;

use parking_lot::RwLock;
use thiserror::Error;
use tokio::sync::mpsc::{self, UnboundedReceiver, UnboundedSender};
use tracing::info;

use crate::model::{Change, ClusterId, Mesh, ShardKey};
use crate::registry::{ClusterRegistry, SyncState};

#[derive(Debug, Error)]
pub enum AggregateError {
    #[error(
        "cluster {id} is already registered from {source_desc}; ignoring the one from {rejected}"
    )]
    Duplicate {
        id: ClusterId,
        source_desc: String,
        rejected: String,
    },
}

pub struct Aggregate {
    mesh: Arc<Mesh>,
    clusters: RwLock<Vec<Arc<ClusterRegistry>>>,
    changes: UnboundedSender<Change>,
}

impl Aggregate {
    /// Returns the controller and the single stream of changes from all its registries.
    pub fn new(mesh: Arc<Mesh>) -> (Arc<Self>, UnboundedReceiver<Change>) {
        let (changes, rx) = mpsc::unbounded_channel();
        let aggregate = Self {
            mesh,
            clusters: RwLock::default(),
            changes,
        };
        (Arc::new(aggregate), rx)
    }

    pub fn mesh(&self) -> &Arc<Mesh> {
        &self.mesh
    }

    /// Registers a cluster. The config cluster goes first; others keep insertion order.
    pub fn add_cluster(
        &self,
        shard: ShardKey,
        source: String,
        config_cluster: bool,
    ) -> Result<Arc<ClusterRegistry>, AggregateError> {
        let registry = {
            let mut clusters = self.clusters.write();
            if let Some(existing) = clusters.iter().find(|c| *c.id() == shard.cluster) {
                return Err(AggregateError::Duplicate {
                    id: shard.cluster,
                    source_desc: existing.source().to_string(),
                    rejected: source,
                });
            }
            let registry = Arc::new(ClusterRegistry::new(
                shard,
                source,
                self.mesh.clone(),
                self.changes.clone(),
                true,
            ));
            if config_cluster {
                clusters.insert(0, registry.clone());
            } else {
                clusters.push(registry.clone());
            }
            registry
        };
        info!(cluster = %registry.id(), source = registry.source(), "cluster added");
        self.reorder();
        Ok(registry)
    }

    /// A registry for a cluster that is already registered, built beside it: it collects the
    /// cluster's objects but publishes nothing until [`Self::promote`] swaps it in.
    pub fn stage_cluster(&self, shard: ShardKey, source: String) -> Arc<ClusterRegistry> {
        Arc::new(ClusterRegistry::new(
            shard,
            source,
            self.mesh.clone(),
            self.changes.clone(),
            false,
        ))
    }

    /// Swaps a staged registry in for the registered one of the same cluster (same position, same
    /// shard key). The old one is retired first, so it can never write or delete the shard again;
    /// proxies see only the difference. Returns the retired registry.
    pub fn promote(&self, staged: Arc<ClusterRegistry>) -> Option<Arc<ClusterRegistry>> {
        let old = {
            let mut clusters = self.clusters.write();
            let pos = clusters.iter().position(|c| c.id() == staged.id())?;
            std::mem::replace(&mut clusters[pos], staged.clone())
        };
        let served = old.retire();
        staged.go_live(served);
        info!(cluster = %staged.id(), source = staged.source(), "cluster registry swapped");
        Some(old)
    }

    /// Unregisters a cluster and removes everything it contributed.
    pub fn remove_cluster(&self, id: &ClusterId) -> Option<Arc<ClusterRegistry>> {
        let removed = {
            let mut clusters = self.clusters.write();
            let pos = clusters.iter().position(|c| c.id() == id)?;
            clusters.remove(pos)
        };
        removed.clear();
        self.reorder();
        info!(cluster = %id, "cluster removed");
        Some(removed)
    }

    pub fn cluster(&self, id: &ClusterId) -> Option<Arc<ClusterRegistry>> {
        self.clusters.read().iter().find(|c| c.id() == id).cloned()
    }

    /// Every registry, in order.
    pub fn clusters(&self) -> Vec<Arc<ClusterRegistry>> {
        self.clusters.read().clone()
    }

    /// Whether every cluster has finished its initial load (synced, timed out or failed).
    pub fn all_loaded(&self) -> bool {
        self.clusters
            .read()
            .iter()
            .all(|c| c.status().state != SyncState::Syncing)
    }

    /// Re-derives every cluster's endpoints (the mesh networks changed) and pushes what changed,
    /// gateways included.
    pub fn resync_all(&self) {
        for cluster in self.clusters() {
            cluster.resync();
        }
        let gateways_moved = self.mesh.write(|mesh| {
            mesh.refresh_gateways()
                .then(|| mesh.endpoints.hostnames().cloned().collect())
        });
        if let Some(services) = gateways_moved {
            // The receiver lives as long as the server; a send error only happens at shutdown.
            let _ = self.changes.send(Change {
                full: false,
                services,
            });
        }
    }

    fn reorder(&self) {
        let order = self
            .clusters
            .read()
            .iter()
            .map(|c| c.id().clone())
            .collect();
        let changed = self.mesh.write(|mesh| mesh.services.set_order(order));
        if !changed.is_empty() {
            let change = Change {
                full: true,
                services: changed.into_iter().collect(),
            };
            // The receiver lives as long as the server; a send error only happens at shutdown.
            let _ = self.changes.send(change);
        }
    }
}
