//! File-backed clusters, the embedded default: `DIR/clusters/<cluster-id>/*.yaml`.
//!
//! Each sub-directory is one cluster registry fed with the objects of its manifests. The tree is
//! watched: only the files the events name are read again, and only their differences are applied,
//! so a change costs the same however many files the directory holds. A malformed file is refused
//! with an error naming it, and the objects it held before stay served.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use thiserror::Error;
use tracing::{error, info, warn};

use super::holders::Holders;
use super::manifest;
use super::watch::{self, fingerprint, is_manifest, Batch, Recheck, Watch, EMPTIED_GRACE};
use crate::aggregate::Aggregate;
use crate::model::{ClusterId, Provider, ShardKey};
use crate::registry::objects::{Object, ObjectChange, ObjectKey};
use crate::registry::{ClusterRegistry, SyncState};

#[derive(Debug, Error)]
pub enum FileSourceError {
    #[error("config directory {0} does not exist")]
    NoConfigDir(PathBuf),
    #[error("config directory {0} has no clusters/ sub-directory (one directory of manifests per cluster)")]
    NoClustersDir(PathBuf),
    #[error("cannot watch {path}: {source}")]
    Watch {
        path: PathBuf,
        source: notify::Error,
    },
}

pub struct FileClusters {
    root: PathBuf,
    aggregate: Arc<Aggregate>,
    clusters: HashMap<ClusterId, FileCluster>,
}

struct FileCluster {
    registry: Arc<ClusterRegistry>,
    files: BTreeMap<PathBuf, FileState>,
    /// The files holding each object; when several do, the first to hold it serves it.
    holders: Holders<ObjectKey>,
    /// What this cluster currently serves: the union of every file's last good objects.
    served: HashMap<ObjectKey, Object>,
    /// Emptied files to read again once their grace has passed.
    recheck: Recheck,
    /// Objects more than one file defines: why the later copies are not served.
    duplicates: BTreeMap<ObjectKey, String>,
}

struct FileState {
    /// Hash of the content last read, good or bad: unchanged content is not parsed again.
    fingerprint: Option<u64>,
    /// The objects of the last version of the file that parsed.
    objects: HashMap<ObjectKey, Object>,
    error: Option<String>,
    /// When the file was first read as empty while it held objects.
    emptied_at: Option<Instant>,
}

/// Keeps the directory watched; dropping it stops the watch.
pub struct FileWatch {
    _watch: Watch,
}

impl FileClusters {
    /// Loads every cluster under `config_dir/clusters`.
    pub fn load(config_dir: &Path, aggregate: Arc<Aggregate>) -> Result<Self, FileSourceError> {
        // Canonical, so the paths of watch events strip to cluster ids.
        let root =
            config_dir
                .join("clusters")
                .canonicalize()
                .map_err(|_| match config_dir.is_dir() {
                    true => FileSourceError::NoClustersDir(config_dir.to_path_buf()),
                    false => FileSourceError::NoConfigDir(config_dir.to_path_buf()),
                })?;
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
        let root = self.root.clone();
        let watch_error = |source| FileSourceError::Watch {
            path: root.clone(),
            source,
        };
        let watch = watch::watch(&root.clone(), true, "file-clusters", move |batch| {
            self.apply(batch);
            let clusters = self.clusters.values_mut();
            clusters
                .flat_map(|c| std::mem::take(&mut c.recheck))
                .collect()
        })
        .map_err(watch_error)?;
        Ok(FileWatch { _watch: watch })
    }

    fn apply(&mut self, batch: Batch) {
        let paths = match batch {
            Batch::Rescan => return self.sync_all(),
            Batch::Paths(paths) => paths,
        };
        let mut clusters: BTreeSet<ClusterId> = BTreeSet::new();
        let mut files: BTreeMap<ClusterId, BTreeSet<PathBuf>> = BTreeMap::new();
        for path in paths {
            let parts: Option<Vec<&str>> = path
                .strip_prefix(&self.root)
                .ok()
                .map(|rel| rel.components().map(|c| c.as_os_str().to_str()).collect())
                .and_then(|parts: Option<Vec<&str>>| parts);
            match parts.as_deref() {
                // A cluster directory itself: created, removed or renamed.
                Some([cluster]) => {
                    clusters.insert(ClusterId::new(cluster));
                }
                Some([cluster, _file]) => {
                    files
                        .entry(ClusterId::new(cluster))
                        .or_default()
                        .insert(path.clone());
                }
                // Deeper paths are not manifests of a cluster.
                Some([_, _, _, ..]) => {}
                // The root itself, or a path we cannot place.
                _ => return self.sync_all(),
            }
        }
        for id in &clusters {
            self.sync_cluster(id);
        }
        for (id, paths) in files {
            if clusters.contains(&id) {
                continue;
            }
            match self.clusters.get_mut(&id) {
                Some(cluster) => cluster.apply_paths(paths),
                // A file in a directory not yet known: the directory is new.
                None => self.sync_cluster(&id),
            }
        }
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
                    self.clusters.insert(id.clone(), FileCluster::new(registry));
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
    fn new(registry: Arc<ClusterRegistry>) -> Self {
        Self {
            registry,
            files: BTreeMap::new(),
            holders: Holders::default(),
            served: HashMap::new(),
            recheck: Recheck::new(),
            duplicates: BTreeMap::new(),
        }
    }

    /// Brings the cluster in line with its whole directory (start, rescans, a directory event).
    fn sync(&mut self, dir: &Path) {
        let id = self.registry.id().clone();
        match manifest_paths(dir) {
            Ok(listed) => {
                let mut paths: BTreeSet<PathBuf> = self.files.keys().cloned().collect();
                paths.extend(listed);
                self.apply_paths(paths);
            }
            Err(e) => {
                let msg = format!("cannot list {}: {e}", dir.display());
                error!(cluster = %id, error = %msg, "cluster directory unreadable");
                self.registry.set_error(Some(msg));
            }
        }
    }

    /// Re-reads just these paths (present, changed, removed or renamed away) and applies the
    /// difference they make to what the cluster serves.
    fn apply_paths(&mut self, paths: BTreeSet<PathBuf>) {
        let id = self.registry.id().clone();
        let mut affected: HashSet<ObjectKey> = HashSet::new();
        for path in paths {
            let present = is_manifest(&path) && path.is_file();
            let replaced = if present {
                self.refresh_file(&id, &path)
            } else {
                self.files.remove(&path).map(|gone| gone.objects)
            };
            if let Some(old) = replaced {
                let current = self.files.get(&path).into_iter();
                let current = current.flat_map(|state| state.objects.keys());
                self.holders
                    .reindex(&path, old.into_keys(), current, &mut affected);
            }
        }

        let mut changes = Vec::new();
        for key in affected {
            match self.holders.holding(&key) {
                [first, rest @ ..] if !rest.is_empty() => {
                    let copies: Vec<String> =
                        rest.iter().map(|p| p.display().to_string()).collect();
                    let error = format!(
                        "{} {}/{} is defined in {} and again in {}: the first is served, the others are not",
                        key.kind,
                        key.namespace,
                        key.name,
                        first.display(),
                        copies.join(", ")
                    );
                    warn!(cluster = %id, %error, "object defined twice");
                    self.duplicates.insert(key.clone(), error);
                }
                _ => {
                    self.duplicates.remove(&key);
                }
            }
            let desired = self
                .holders
                .serving(&key)
                .and_then(|path| self.files.get(path)?.objects.get(&key));
            match desired {
                Some(object) if self.served.get(&key) != Some(object) => {
                    self.served.insert(key, object.clone());
                    changes.push(ObjectChange::Upsert(object.clone()));
                }
                Some(_) => {}
                None => {
                    if self.served.remove(&key).is_some() {
                        changes.push(ObjectChange::Delete(key));
                    }
                }
            }
        }
        if !changes.is_empty() {
            info!(cluster = %id, changes = changes.len(), "applying file changes");
            self.registry.apply(changes);
        }

        let errors: Vec<&str> = self
            .files
            .values()
            .filter_map(|f| f.error.as_deref())
            .chain(self.duplicates.values().map(String::as_str))
            .collect();
        self.registry
            .set_error((!errors.is_empty()).then(|| errors.join("; ")));
        self.registry.set_state(SyncState::Synced);
    }

    /// Re-reads a file if its content changed and returns the objects it held before; a file that
    /// fails keeps its previous objects (and returns None: nothing to re-index).
    fn refresh_file(
        &mut self,
        cluster: &ClusterId,
        path: &Path,
    ) -> Option<HashMap<ObjectKey, Object>> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) => {
                // Removed between the event and reading: its own event removes it.
                if e.kind() != std::io::ErrorKind::NotFound {
                    let msg = format!("{}: {e}", path.display());
                    error!(cluster = %cluster, error = %msg, "cannot read manifest");
                    self.files
                        .entry(path.to_path_buf())
                        .or_insert_with(FileState::empty)
                        .error = Some(msg);
                }
                return None;
            }
        };
        let fingerprint = fingerprint(&text);
        let state = self
            .files
            .entry(path.to_path_buf())
            .or_insert_with(FileState::empty);
        if !state.objects.is_empty() && watch::is_blank(&text) {
            if watch::hold_emptied(&mut state.emptied_at) {
                info!(cluster = %cluster, file = %path.display(), objects = state.objects.len(), "manifest emptied; its objects stay unless it is still empty in {EMPTIED_GRACE:?}");
                self.recheck.insert(path.to_path_buf());
                return None;
            }
            let removed = watch::some_of(
                state
                    .objects
                    .keys()
                    .map(|k| format!("{} {}/{}", k.kind, k.namespace, k.name)),
            );
            warn!(cluster = %cluster, file = %path.display(), %removed, "manifest stayed empty; its objects are removed");
        } else {
            state.emptied_at = None;
        }
        if state.fingerprint == Some(fingerprint) {
            return None;
        }
        state.fingerprint = Some(fingerprint);
        match manifest::parse(&text) {
            Ok(objects) => {
                state.error = None;
                // Within a file, a later document of the same key wins.
                let objects = objects.into_iter().map(|o| (o.key(), o)).collect();
                Some(std::mem::replace(&mut state.objects, objects))
            }
            Err(e) => {
                let msg = format!("{}: {e}", path.display());
                error!(cluster = %cluster, error = %msg, "manifest refused; keeping its last good objects");
                state.error = Some(msg);
                None
            }
        }
    }
}

impl FileState {
    fn empty() -> Self {
        Self {
            fingerprint: None,
            objects: HashMap::new(),
            error: None,
            emptied_at: None,
        }
    }
}

fn manifest_paths(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut paths = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if is_manifest(&path) && path.is_file() {
            paths.push(path);
        }
    }
    Ok(paths)
}
