//! The aggregate controller: every cluster's registry under one roof.
//!
//! It owns the set and order of registries (the config cluster first), keeps the merged service
//! table's order in step, and fans every registry's changes into one stream for the push pipeline.

use std::sync::Arc;

use parking_lot::RwLock;
use thiserror::Error;
use tokio::sync::mpsc::{self, UnboundedReceiver, UnboundedSender};
use tracing::{info, warn};

use crate::istio::label_selector::LabelSelector;
use crate::istio::{ConfigKey, ConfigKind, MeshConfig};
use crate::model::{
    Audience, Change, ClusterId, ConfigChange, ConfigSource, JwksTable, Mesh, Refusal, ShardKey,
    TrustBundle,
};
use crate::registry::{entry_workloads, service_entries, ClusterRegistry, SyncState};

/// Kinds whose changes may move proxies' name tables: what services exist or a proxy sees (istiod's
/// nds.go skips the others). WorkloadEntries move names through the services they change.
const NAMING_KINDS: &[ConfigKind] = &[ConfigKind::ServiceEntry, ConfigKind::Sidecar];

/// Config kinds whose changes proxies hear about, besides the Gateway API's (a WorkloadGroup
/// reaches them through the WorkloadEntries registered into it).
const PUSHED_KINDS: &[ConfigKind] = &[
    ConfigKind::ServiceEntry,
    ConfigKind::WorkloadEntry,
    ConfigKind::DestinationRule,
    ConfigKind::VirtualService,
    ConfigKind::Gateway,
    ConfigKind::Sidecar,
    ConfigKind::PeerAuthentication,
    ConfigKind::AuthorizationPolicy,
    ConfigKind::RequestAuthentication,
    ConfigKind::Telemetry,
    ConfigKind::EnvoyFilter,
    ConfigKind::WasmPlugin,
];

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
    /// The mesh config's `discoverySelectors`, for every Kubernetes cluster's watches.
    discovery_selectors: tokio::sync::watch::Sender<Vec<LabelSelector>>,
    /// The mesh config in force, for sources that derive config from it.
    mesh_config: tokio::sync::watch::Sender<Arc<MeshConfig>>,
}

impl Aggregate {
    /// Returns the controller and the single stream of changes from all its registries.
    pub fn new(mesh: Arc<Mesh>) -> (Arc<Self>, UnboundedReceiver<Change>) {
        let (changes, rx) = mpsc::unbounded_channel();
        let mesh_config = mesh.snapshot().config.mesh().clone();
        let selectors = mesh_config.discovery_selectors.clone();
        let aggregate = Self {
            mesh,
            clusters: RwLock::default(),
            changes,
            discovery_selectors: tokio::sync::watch::Sender::new(selectors),
            mesh_config: tokio::sync::watch::Sender::new(mesh_config),
        };
        (Arc::new(aggregate), rx)
    }

    /// The discovery selectors in force, and each change of them.
    pub fn discovery_selectors(&self) -> tokio::sync::watch::Receiver<Vec<LabelSelector>> {
        self.discovery_selectors.subscribe()
    }

    /// The mesh config in force, and each change of it.
    pub fn mesh_config(&self) -> tokio::sync::watch::Receiver<Arc<MeshConfig>> {
        self.mesh_config.subscribe()
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
        old.retire();
        staged.go_live();
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
        self.refresh_gateways();
    }

    /// Re-derives the gateways (from MeshNetworks, their resolved names and the Services labelled
    /// as gateways) and pushes every service's endpoints when they moved.
    pub fn refresh_gateways(&self) {
        let gateways_moved = self.mesh.write(|mesh| {
            mesh.refresh_gateways()
                .then(|| mesh.endpoints.hostnames().cloned().collect())
        });
        if let Some(services) = gateways_moved {
            // The receiver lives as long as the server; a send error only happens at shutdown.
            let _ = self.changes.send(Change::endpoints(services));
        }
    }

    /// Applies one config source's changes, and what it refused, as one snapshot; re-derives the
    /// ServiceEntry registry when its kinds changed. Pushes go to the proxies that can see the
    /// changed objects.
    pub fn apply_config(
        &self,
        source: ConfigSource,
        changes: Vec<ConfigChange>,
        refusals: Vec<(String, Vec<Refusal>)>,
    ) {
        let naming = &self.mesh.naming;
        let change = self.mesh.write(|mesh| {
            let delta = mesh.config.apply(source, changes);
            for (unit, refused) in refusals {
                mesh.config.set_refusals(source, &unit, refused);
            }
            // Every change reaches the config's own clients (MCP); proxies hear of pushed kinds.
            let mut change = Change {
                configs: delta.changed.clone(),
                ..Default::default()
            };
            let pushed = |k: &ConfigKey| PUSHED_KINDS.contains(&k.kind) || k.kind.is_gateway_api();
            if !delta.changed.iter().any(pushed) {
                return change;
            }
            let entries_changed =
                delta.touches(&[ConfigKind::ServiceEntry, ConfigKind::WorkloadEntry]);
            change.full = true;
            change.names_kept = !delta.touches(NAMING_KINDS);
            change.audience = match delta.audience {
                None => Audience::Everyone,
                Some(namespaces) => Audience::Namespaces(namespaces),
            };
            if entries_changed {
                let mut services = Change::default();
                service_entries::sync(mesh, naming, &mut services);
                change.workloads.extend(entry_workloads::sync(mesh));
                if !services.is_empty() {
                    // Services are seen mesh-wide.
                    change.audience = Audience::Everyone;
                    change.names_kept = false;
                    change.services.extend(services.services);
                }
            }
            change
        });
        let entries_changed = change
            .configs
            .iter()
            .any(|k| k.kind == ConfigKind::ServiceEntry);
        self.emit(change);
        if entries_changed {
            // Entries select pods of every cluster: each registry re-derives its share.
            for cluster in self.clusters() {
                cluster.resync_selected();
            }
        }
    }

    /// Replaces the mesh config; a change is a full push. Returns whether it changed.
    pub fn set_mesh_config(&self, mesh_config: MeshConfig) -> bool {
        let notes = mesh_config.not_applied.clone();
        let selectors = mesh_config.discovery_selectors.clone();
        self.discovery_selectors.send_if_modified(|current| {
            let changed = *current != selectors;
            *current = selectors;
            changed
        });
        let changed = self.mesh.write(|mesh| {
            let changed = mesh.config.set_mesh(mesh_config);
            if changed {
                // Export defaults may have changed what ServiceEntries mean.
                service_entries::sync(mesh, &self.mesh.naming, &mut Change::default());
            }
            changed
        });
        if changed {
            for note in &notes {
                warn!("mesh config field {}: {}", note.field, note.why);
            }
            let current = self.mesh.snapshot().config.mesh().clone();
            self.mesh_config.send_replace(current);
            self.emit(Change::full());
        }
        changed
    }

    /// Publishes fetched JWT keys; proxies in `audience` (those whose policies use them) are
    /// pushed.
    pub fn set_jwks(&self, jwks: JwksTable, audience: Audience) {
        self.mesh.write(|mesh| mesh.jwks = jwks);
        if audience != Audience::Namespaces(Default::default()) {
            self.emit(Change {
                full: true,
                audience,
                names_kept: true,
                ..Change::default()
            });
        }
    }

    /// Publishes the trust bundle; the proxies that watch it are sent it. Returns whether it
    /// changed.
    pub fn set_trust_bundle(&self, bundle: TrustBundle) -> bool {
        let changed = self.mesh.write(|mesh| {
            if mesh.trust_bundle.as_deref() == Some(&bundle) {
                return false;
            }
            mesh.trust_bundle = Some(Arc::new(bundle));
            mesh.trust_bundle_version += 1;
            true
        });
        if changed {
            self.emit(Change {
                trust_bundle: true,
                ..Change::default()
            });
        }
        changed
    }

    fn emit(&self, change: Change) {
        if !change.is_empty() {
            // The receiver lives as long as the server; a send error only happens at shutdown.
            let _ = self.changes.send(change);
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
                services: changed.into_iter().collect(),
                ..Change::full()
            };
            // The receiver lives as long as the server; a send error only happens at shutdown.
            let _ = self.changes.send(change);
        }
    }
}
