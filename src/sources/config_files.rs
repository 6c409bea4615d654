//! Istio config from files, the embedded default: `<config-dir>/config/**/*.yaml`, multi-document,
//! watched. Only the files events name are read again. A file that does not parse is refused whole
//! and its last good objects stay; an object that does not validate is refused alone, and its last
//! good version from that file stays. Every refusal names the file, the document, the object and
//! the field (/debug/configz and the log).

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use serde::Deserialize;
use tracing::{error, info, warn};

use super::holders::Holders;
use super::watch::{self, fingerprint, is_manifest, Batch, Recheck, Watch, EMPTIED_GRACE};
use crate::aggregate::Aggregate;
use crate::istio::{ConfigError, ConfigKey, ConfigObject, Origin};
use crate::model::{ConfigChange, ConfigSource, Refusal};
use crate::text::clip;

/// Keeps the tree watched; dropping it stops the watch.
pub struct ConfigFilesWatch {
    _watch: Watch,
}

pub struct ConfigFiles {
    root: PathBuf,
    aggregate: Arc<Aggregate>,
    files: BTreeMap<PathBuf, FileState>,
    /// Which files hold each key; when several do, the first to hold it serves it.
    holders: Holders<ConfigKey>,
    served: BTreeMap<ConfigKey, Arc<ConfigObject>>,
    /// Emptied files to read again once their grace has passed.
    recheck: Recheck,
}

#[derive(Default)]
struct FileState {
    fingerprint: Option<u64>,
    /// The last good version of each object of the file.
    objects: BTreeMap<ConfigKey, Arc<ConfigObject>>,
    /// When the file was first read as empty while it held objects.
    emptied_at: Option<Instant>,
    /// Why its last read, or objects of it, were refused.
    refused: Vec<Refusal>,
}

impl ConfigFiles {
    /// Loads and watches `<config_dir>/config`. Config is optional: where there is none yet, the
    /// config dir is watched for it to appear, and it is then read as one present at start.
    pub fn watch_config_dir(
        config_dir: &Path,
        aggregate: Arc<Aggregate>,
    ) -> Result<ConfigFilesWatch, notify::Error> {
        let root = config_dir.join("config");
        if let Some(files) = Self::load_tree(&root, aggregate.clone()) {
            return files.watch();
        }
        let mut started: Option<ConfigFilesWatch> = None;
        let watch = watch::watch(config_dir, false, "config-dir", move |_| {
            if started.is_none() && root.is_dir() {
                if let Some(files) = ConfigFiles::load_tree(&root, aggregate.clone()) {
                    info!(dir = %root.display(), "config directory created; watching it");
                    match files.watch() {
                        Ok(w) => started = Some(w),
                        Err(error) => {
                            error!(dir = %root.display(), %error, "config directory not watched")
                        }
                    }
                }
            }
            Recheck::new()
        })?;
        Ok(ConfigFilesWatch { _watch: watch })
    }

    /// The Istio config under `root` itself (an `fs://` config source).
    pub fn load_tree(root: &Path, aggregate: Arc<Aggregate>) -> Option<Self> {
        let root = root.canonicalize().ok()?;
        let mut this = Self {
            root,
            aggregate,
            files: BTreeMap::new(),
            holders: Holders::default(),
            served: BTreeMap::new(),
            recheck: Recheck::new(),
        };
        this.rescan();
        info!(dir = %this.root.display(), objects = this.served.len(), "Istio config loaded from files");
        Some(this)
    }

    /// Watches the tree and applies changes until the returned handle is dropped.
    pub fn watch(mut self) -> Result<ConfigFilesWatch, notify::Error> {
        let root = self.root.clone();
        let watch = watch::watch(&root, true, "config-files", move |batch| {
            match batch {
                Batch::Rescan => self.rescan(),
                Batch::Paths(paths) => self.apply_paths(paths),
            }
            std::mem::take(&mut self.recheck)
        })?;
        Ok(ConfigFilesWatch { _watch: watch })
    }

    fn rescan(&mut self) {
        let mut paths: BTreeSet<PathBuf> = self.files.keys().cloned().collect();
        collect_manifests(&self.root, &mut paths);
        self.apply_paths(paths);
    }

    /// Re-reads these paths (files or directories: created, changed, removed, renamed) and applies
    /// the difference to the config store.
    fn apply_paths(&mut self, paths: BTreeSet<PathBuf>) {
        let mut files = BTreeSet::new();
        for path in paths {
            if path.is_dir() {
                collect_manifests(&path, &mut files);
            } else {
                // A directory that went away takes the files below it.
                files.extend(self.files.keys().filter(|f| f.starts_with(&path)).cloned());
                files.insert(path);
            }
        }
        let mut affected = HashSet::new();
        // Files whose refusals are reported again: those read, and those holding a key that moved.
        let mut reported = BTreeSet::new();
        for path in files {
            let present = is_manifest(&path) && path.is_file();
            reported.insert(path.clone());
            let old = match present {
                true => self.refresh(&path),
                false => self.files.remove(&path).map(|gone| gone.objects),
            };
            if let Some(old) = old {
                let current = self.files.get(&path).into_iter();
                let current = current.flat_map(|state| state.objects.keys());
                self.holders
                    .reindex(&path, old.into_keys(), current, &mut affected);
            }
        }
        for key in &affected {
            reported.extend(self.holders.holding(key).iter().cloned());
        }
        let refusals: Vec<(String, Vec<Refusal>)> = reported
            .iter()
            .map(|path| (path.display().to_string(), self.refusals_of(path)))
            .collect();
        let mut changes = Vec::new();
        for key in affected {
            let desired = self
                .holders
                .serving(&key)
                .and_then(|path| self.files.get(path)?.objects.get(&key))
                .cloned();
            match desired {
                Some(object) if self.served.get(&key) != Some(&object) => {
                    self.served.insert(key, object.clone());
                    changes.push(ConfigChange::Upsert(object));
                }
                Some(_) => {}
                None => {
                    if self.served.remove(&key).is_some() {
                        changes.push(ConfigChange::Delete(key));
                    }
                }
            }
        }
        if !changes.is_empty() || !reported.is_empty() {
            if !changes.is_empty() {
                info!(changes = changes.len(), "applying Istio config from files");
            }
            self.aggregate
                .apply_config(ConfigSource::Files, changes, refusals);
        }
    }

    /// A file's refusals as they stand: its own, and a duplicate refusal for each object another
    /// file held first (reported on both files: the log names the served one too).
    fn refusals_of(&self, path: &Path) -> Vec<Refusal> {
        let Some(state) = self.files.get(path) else {
            return Vec::new();
        };
        let unit = path.display().to_string();
        let mut out = state.refused.clone();
        for (key, object) in &state.objects {
            let Some(first) = self.holders.serving(key).filter(|p| *p != path) else {
                continue;
            };
            let error = format!(
                "{unit}: {key} is also defined in {}, which was read first and is served; this copy is not",
                first.display()
            );
            warn!(%error, "config object defined twice");
            let document = match &object.meta.origin {
                Origin::File { document, .. } => *document,
                _ => 0,
            };
            out.push(refusal(Some(key.clone()), &unit, document, error));
        }
        out
    }

    /// Re-reads a file whose content changed; returns the objects it held before (None: nothing
    /// to re-index). Its refusals (none when all is well) are kept with it.
    fn refresh(&mut self, path: &Path) -> Option<BTreeMap<ConfigKey, Arc<ConfigObject>>> {
        let unit = path.display().to_string();
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            // Removed between the event and reading: its own event removes it.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
            Err(e) => {
                let error = format!("cannot read {unit}: {e}");
                error!(%error, "config file unreadable; keeping its last good objects");
                let state = self.files.entry(path.to_path_buf()).or_default();
                state.refused = vec![refusal(None, &unit, 0, error)];
                return None;
            }
        };
        let fingerprint = fingerprint(&text);
        let state = self.files.entry(path.to_path_buf()).or_default();
        if !state.objects.is_empty() && watch::is_blank(&text) {
            if watch::hold_emptied(&mut state.emptied_at) {
                info!(file = %unit, objects = state.objects.len(), "config file emptied; its objects stay unless it is still empty in {EMPTIED_GRACE:?}");
                self.recheck.insert(path.to_path_buf());
                return None;
            }
            let removed = watch::some_of(state.objects.keys().map(|k| k.to_string()));
            warn!(file = %unit, %removed, "config file stayed empty; its objects are removed");
        } else {
            state.emptied_at = None;
        }
        if state.fingerprint == Some(fingerprint) {
            return None;
        }
        state.fingerprint = Some(fingerprint);
        let documents = match documents(&text) {
            Ok(docs) => docs,
            Err((document, message)) => {
                let error = format!("{unit}: document {document}: {message}");
                error!(%error, "config file refused; keeping its last good objects");
                state.refused = vec![refusal(None, &unit, document, error)];
                return None;
            }
        };
        let mut objects = BTreeMap::new();
        let mut refused = Vec::new();
        for (i, value) in documents.into_iter().enumerate() {
            let document = i + 1;
            let origin = Origin::File {
                path: unit.clone(),
                document,
            };
            match ConfigObject::from_value(&value, origin) {
                None => {}
                Some(Ok(object)) => {
                    // Within a file, a later document of the same key wins.
                    objects.insert(object.key.clone(), Arc::new(object));
                }
                Some(Err(e)) => {
                    let (key, kind) = match &e {
                        ConfigError::Invalid { key, .. } => (Some(key.clone()), Some(key.kind)),
                        ConfigError::Unnamed(kind) => (None, Some(*kind)),
                    };
                    let error = format!("{unit}: document {document}: {e}");
                    error!(%error, "config object refused; keeping its last good version");
                    if let Some(last_good) = key.as_ref().and_then(|k| state.objects.get(k)) {
                        objects.insert(last_good.key.clone(), last_good.clone());
                    }
                    refused.push(Refusal {
                        kind,
                        ..refusal(key, &unit, document, error)
                    });
                }
            }
        }
        state.refused = refused;
        Some(std::mem::replace(&mut state.objects, objects))
    }
}

fn refusal(key: Option<ConfigKey>, path: &str, document: usize, error: String) -> Refusal {
    Refusal {
        kind: key.as_ref().map(|k| k.kind),
        subject: None,
        key,
        origin: Origin::File {
            path: path.to_string(),
            document,
        },
        error,
    }
}

/// The documents of a YAML stream as JSON values (empty documents skipped); on a syntax error, the
/// document number and the message (which quotes a bounded excerpt of the text). Public for the fuzz tests, which feed it as the watch does.
pub fn documents(text: &str) -> Result<Vec<serde_json::Value>, (usize, String)> {
    crate::yaml::check_aliases(text).map_err(|e| (e.document, e.to_string()))?;
    let mut out = Vec::new();
    for (i, document) in serde_yaml_ng::Deserializer::from_str(text).enumerate() {
        let value =
            serde_json::Value::deserialize(document).map_err(|e| (i + 1, clip(&e.to_string())))?;
        if !value.is_null() {
            out.push(value);
        }
    }
    Ok(out)
}

/// Every manifest below `dir`, hidden directories skipped.
fn collect_manifests(dir: &Path, out: &mut BTreeSet<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let hidden = entry.file_name().to_string_lossy().starts_with('.');
        if path.is_dir() && !hidden {
            collect_manifests(&path, out);
        } else if is_manifest(&path) && path.is_file() {
            out.insert(path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_keep_their_numbers_and_name_syntax_errors() {
        let docs = documents("a: 1\n---\n---\nb: 2\n").unwrap();
        assert_eq!(docs.len(), 2);
        let (document, message) = documents("a: 1\n---\nb: [unclosed\n").unwrap_err();
        assert_eq!(document, 2);
        assert!(!message.is_empty());
        // An explicit key is as long as it likes, and the error's path quotes it.
        let long_keys = format!("a: 1\n? {}\n: {{? [a] : 1}}\n", "k ".repeat(5_000));
        let (document, message) = documents(&long_keys).unwrap_err();
        assert_eq!(document, 1);
        assert!(message.len() < 1000, "{} bytes", message.len());
    }
}
