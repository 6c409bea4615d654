//! Which files hold each object, for sources reading objects from many files. When several files
//! hold one key, the first to hold it serves it (istiod orders conflicting config oldest first;
//! a file's objects carry no creation time, so holding first stands for it); at start files
//! arrive in path order. The others are duplicates, reported by the source.

use std::collections::{HashMap, HashSet};
use std::hash::Hash;
use std::path::{Path, PathBuf};

pub struct Holders<K> {
    /// Holders of each key, in the order they came to hold it.
    by_key: HashMap<K, Vec<PathBuf>>,
}

impl<K> Default for Holders<K> {
    fn default() -> Self {
        Self {
            by_key: HashMap::new(),
        }
    }
}

impl<K: Hash + Eq + Clone> Holders<K> {
    /// Moves `path` from holding the `old` keys to holding the `current` ones; every key either
    /// names is affected. A key `path` holds in both keeps its place.
    pub fn reindex<'k>(
        &mut self,
        path: &Path,
        old: impl IntoIterator<Item = K>,
        current: impl IntoIterator<Item = &'k K>,
        affected: &mut HashSet<K>,
    ) where
        K: 'k,
    {
        let current: HashSet<&K> = current.into_iter().collect();
        for key in old {
            if current.contains(&key) {
                affected.insert(key);
                continue;
            }
            if let Some(paths) = self.by_key.get_mut(&key) {
                paths.retain(|p| p != path);
                if paths.is_empty() {
                    self.by_key.remove(&key);
                }
            }
            affected.insert(key);
        }
        for key in current {
            let paths = self.by_key.entry(key.clone()).or_default();
            if !paths.iter().any(|p| p == path) {
                paths.push(path.to_path_buf());
            }
            affected.insert(key.clone());
        }
    }

    /// The file whose version of `key` is served.
    pub fn serving(&self, key: &K) -> Option<&Path> {
        self.by_key.get(key)?.first().map(PathBuf::as_path)
    }

    /// Every file holding `key`, the serving one first.
    pub fn holding(&self, key: &K) -> &[PathBuf] {
        self.by_key.get(key).map_or(&[], Vec::as_slice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_holder_serves_and_emptied_keys_go() {
        let mut holders = Holders::default();
        let mut affected = HashSet::new();
        holders.reindex(Path::new("b.yaml"), [], [&"x"], &mut affected);
        holders.reindex(Path::new("a.yaml"), [], [&"x"], &mut affected);
        assert_eq!(holders.serving(&"x"), Some(Path::new("b.yaml")));
        // Editing the serving file keeps its place.
        holders.reindex(Path::new("b.yaml"), ["x"], [&"x"], &mut affected);
        assert_eq!(holders.serving(&"x"), Some(Path::new("b.yaml")));
        assert_eq!(holders.holding(&"x").len(), 2);
        affected.clear();
        holders.reindex(Path::new("b.yaml"), ["x"], [], &mut affected);
        assert_eq!(holders.serving(&"x"), Some(Path::new("a.yaml")));
        holders.reindex(Path::new("a.yaml"), ["x"], [], &mut affected);
        assert_eq!(holders.serving(&"x"), None);
        assert_eq!(affected, HashSet::from(["x"]));
    }
}
