//! File-backed clusters, the embedded default: `DIR/clusters/<cluster-id>/*.yaml`.
//!
//! Each sub-directory is one cluster registry fed with the objects of its manifests. The tree is
//! watched: a changed file is re-read and only its differences are applied; a malformed file is
//! refused with an error naming it, and the objects it held before stay served.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use notify::{RecommendedWatcher, RecursiveMode, Watcher};
use thiserror::Error;
use tracing::{error, info, warn};

use super::manifest;
use crate::aggregate::Aggregate;
use crate::model::{ClusterId, Provider, ShardKey};
use crate::registry::objects::{Object, ObjectChange, ObjectKey};
use crate::registry::{ClusterRegistry, SyncState};

#[derive(Debug, Error)]
pub enum FileSourceError {
    #[error("config directory {0} has no clusters/ sub-directory")]
    NoClustersDir(PathBuf),
    #[error("cannot watch {path}: {source}")]
    Watch {
        path: PathBuf,
        source: notify::Error,
    },
}

/// Events arriving within this window of the first are handled together (editors write in bursts).
const SETTLE: Duration = Duration::from_millis(20);

pub struct FileClusters {
    root: PathBuf,
    aggregate: Arc<Aggregate>,
    clusters: HashMap<ClusterId, FileCluster>,
}

struct FileCluster {
    registry: Arc<ClusterRegistry>,
    files: BTreeMap<PathBuf, FileState>,
    /// What this cluster currently serves: the union of every file's last good objects.
    served: HashMap<ObjectKey, Object>,
}

struct FileState {
    /// Hash of the content last read, good or bad: unchanged content is not parsed again.
    fingerprint: Option<u64>,
    /// The objects of the last version of the file that parsed.
    objects: Vec<Object>,
    error: Option<String>,
}

/// Keeps the directory watched; dropping it stops the watch.
pub struct FileWatch {
    _watcher: RecommendedWatcher,
}

impl FileClusters {
    /// Loads every cluster under `config_dir/clusters`.
    pub fn load(config_dir: &Path, aggregate: Arc<Aggregate>) -> Result<Self, FileSourceError> {
        // Canonical, so the paths of watch events strip to cluster ids.
        let root = config_dir
            .join("clusters")
            .canonicalize()
            .map_err(|_| FileSourceError::NoClustersDir(config_dir.to_path_buf()))?;
        let mut this = Self {
            root,
            aggregate,
            clusters: HashMap::new(),
        };
        this.sync_all();
        Ok(this)
    }

    /// Watches the tree and applies changes until the returned handle is dropped.
    pub fn watch(mut self) -> Result<FileWatch, FileSourceError> {
        let (tx, rx) = mpsc::channel::<notify::Result<notify::Event>>();
        let mut watcher = notify::recommended_watcher(move |event| {
            // The receiver is gone only once the watch is being dropped.
            let _ = tx.send(event);
        })
        .map_err(|source| self.watch_error(source))?;
        watcher
            .watch(&self.root, RecursiveMode::Recursive)
            .map_err(|source| self.watch_error(source))?;
        // Catch what changed between the first load and the watch starting.
        self.sync_all();
        std::thread::Builder::new()
            .name("file-clusters".into())
            .spawn(move || self.run(rx))
            .map_err(|e| FileSourceError::Watch {
                path: PathBuf::new(),
                source: notify::Error::io(e),
            })?;
        Ok(FileWatch { _watcher: watcher })
    }

    fn watch_error(&self, source: notify::Error) -> FileSourceError {
        FileSourceError::Watch {
            path: self.root.clone(),
            source,
        }
    }

    fn run(mut self, rx: mpsc::Receiver<notify::Result<notify::Event>>) {
        while let Ok(first) = rx.recv() {
            let mut events = vec![first];
            while let Ok(more) = rx.recv_timeout(SETTLE) {
                events.push(more);
            }
            let mut rescan_all = false;
            let mut touched = std::collections::BTreeSet::new();
            for event in events {
                match event {
                    Ok(event) if !event.need_rescan() => {
                        for path in &event.paths {
                            match self.cluster_of(path) {
                                Some(id) => {
                                    touched.insert(id);
                                }
                                None => rescan_all = true,
                            }
                        }
                    }
                    Ok(_) => rescan_all = true,
                    Err(e) => {
                        warn!(error = %e, "file watch error; rescanning");
                        rescan_all = true;
                    }
                }
            }
            if rescan_all {
                self.sync_all();
            } else {
                for id in touched {
                    self.sync_cluster(&id);
                }
            }
        }
    }

    /// The cluster a path belongs to: the first component below the root.
    fn cluster_of(&self, path: &Path) -> Option<ClusterId> {
        let rel = path.strip_prefix(&self.root).ok()?;
        let first = rel.components().next()?;
        Some(ClusterId::new(first.as_os_str().to_str()?))
    }

    fn sync_all(&mut self) {
        let mut ids: Vec<ClusterId> = self.clusters.keys().cloned().collect();
        match std::fs::read_dir(&self.root) {
            Ok(entries) => {
                for entry in entries.flatten() {
                    let name = entry.file_name();
                    let Some(name) = name.to_str() else { continue };
                    if entry.path().is_dir() && !name.starts_with('.') {
                        ids.push(ClusterId::new(name));
                    }
                }
            }
            Err(e) => {
                error!(path = %self.root.display(), error = %e, "cannot list cluster directories")
            }
        }
        ids.sort();
        ids.dedup();
        for id in ids {
            self.sync_cluster(&id);
        }
    }

    /// Brings one cluster in line with its directory.
    fn sync_cluster(&mut self, id: &ClusterId) {
        let dir = self.root.join(id.as_str());
        if !dir.is_dir() || id.as_str().starts_with('.') {
            if self.clusters.remove(id).is_some() {
                self.aggregate.remove_cluster(id);
            }
            return;
        }
        if !self.clusters.contains_key(id) {
            let shard = ShardKey {
                provider: Provider::File,
                cluster: id.clone(),
            };
            match self
                .aggregate
                .add_cluster(shard, format!("file:{}", dir.display()), false)
            {
                Ok(registry) => {
                    let cluster = FileCluster {
                        registry,
                        files: BTreeMap::new(),
                        served: HashMap::new(),
                    };
                    self.clusters.insert(id.clone(), cluster);
                }
                Err(e) => {
                    error!(cluster = %id, error = %e, "cluster directory not loaded");
                    return;
                }
            }
        }
        if let Some(cluster) = self.clusters.get_mut(id) {
            cluster.sync(&dir);
        }
    }
}

impl FileCluster {
    fn sync(&mut self, dir: &Path) {
        let id = self.registry.id().clone();
        let paths = match manifest_paths(dir) {
            Ok(p) => p,
            Err(e) => {
                let msg = format!("cannot list {}: {e}", dir.display());
                error!(cluster = %id, error = %msg, "cluster directory unreadable");
                self.registry.set_error(Some(msg));
                return;
            }
        };
        self.files.retain(|path, _| paths.contains(path));
        for path in paths {
            self.refresh_file(&id, path);
        }

        let mut desired: HashMap<ObjectKey, Object> = HashMap::new();
        for state in self.files.values() {
            for object in &state.objects {
                desired.insert(object.key(), object.clone());
            }
        }
        let mut changes: Vec<ObjectChange> = self
            .served
            .keys()
            .filter(|k| !desired.contains_key(*k))
            .map(|k| ObjectChange::Delete(k.clone()))
            .collect();
        changes.extend(
            desired
                .iter()
                .filter(|(k, o)| self.served.get(*k) != Some(*o))
                .map(|(_, o)| ObjectChange::Upsert(o.clone())),
        );
        if !changes.is_empty() {
            info!(cluster = %id, changes = changes.len(), "applying file changes");
            self.registry.apply(changes);
        }
        self.served = desired;

        let errors: Vec<&str> = self
            .files
            .values()
            .filter_map(|f| f.error.as_deref())
            .collect();
        self.registry
            .set_error((!errors.is_empty()).then(|| errors.join("; ")));
        self.registry.set_state(SyncState::Synced);
    }

    /// Re-reads a file if its content changed; a file that fails keeps its previous objects.
    fn refresh_file(&mut self, cluster: &ClusterId, path: PathBuf) {
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) => {
                // Removed between listing and reading: the next event removes it.
                if e.kind() != std::io::ErrorKind::NotFound {
                    let msg = format!("{}: {e}", path.display());
                    error!(cluster = %cluster, error = %msg, "cannot read manifest");
                    self.files
                        .entry(path)
                        .or_insert_with(FileState::empty)
                        .error = Some(msg);
                }
                return;
            }
        };
        let fingerprint = fingerprint(&text);
        let state = self
            .files
            .entry(path.clone())
            .or_insert_with(FileState::empty);
        if state.fingerprint == Some(fingerprint) {
            return;
        }
        state.fingerprint = Some(fingerprint);
        match manifest::parse(&text) {
            Ok(objects) => {
                state.objects = objects;
                state.error = None;
            }
            Err(e) => {
                let msg = format!("{}: {e}", path.display());
                error!(cluster = %cluster, error = %msg, "manifest refused; keeping its last good objects");
                state.error = Some(msg);
            }
        }
    }
}

impl FileState {
    fn empty() -> Self {
        Self {
            fingerprint: None,
            objects: Vec::new(),
            error: None,
        }
    }
}

fn manifest_paths(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut paths = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        let is_manifest = name.ends_with(".yaml") || name.ends_with(".yml");
        if is_manifest && !name.starts_with('.') && path.is_file() {
            paths.push(path);
        }
    }
    paths.sort();
    Ok(paths)
}

fn fingerprint(text: &str) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    text.hash(&mut h);
    h.finish()
}
