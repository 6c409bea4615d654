//! Which files hold each object, for sources reading objects from many files: when several files
//! hold one key, the last by path serves it.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::hash::Hash;
use std::path::{Path, PathBuf};

pub struct Holders<K> {
    by_key: HashMap<K, BTreeSet<PathBuf>>,
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
    /// names is affected.
    pub fn reindex<'k>(
        &mut self,
        path: &Path,
        old: impl IntoIterator<Item = K>,
        current: impl IntoIterator<Item = &'k K>,
        affected: &mut HashSet<K>,
    ) where
        K: 'k,
    {
        for key in old {
            if let Some(paths) = self.by_key.get_mut(&key) {
                paths.remove(path);
                if paths.is_empty() {
                    self.by_key.remove(&key);
                }
            }
            affected.insert(key);
        }
        for key in current {
            self.by_key
                .entry(key.clone())
                .or_default()
                .insert(path.to_path_buf());
            affected.insert(key.clone());
        }
    }

    /// The file whose version of `key` is served.
    pub fn serving(&self, key: &K) -> Option<&Path> {
        self.by_key.get(key)?.last().map(PathBuf::as_path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_path_serves_and_emptied_keys_go() {
        let mut holders = Holders::default();
        let mut affected = HashSet::new();
        holders.reindex(Path::new("b.yaml"), [], [&"x"], &mut affected);
        holders.reindex(Path::new("a.yaml"), [], [&"x"], &mut affected);
        assert_eq!(holders.serving(&"x"), Some(Path::new("b.yaml")));
        affected.clear();
        holders.reindex(Path::new("b.yaml"), ["x"], [], &mut affected);
        assert_eq!(holders.serving(&"x"), Some(Path::new("a.yaml")));
        holders.reindex(Path::new("a.yaml"), ["x"], [], &mut affected);
        assert_eq!(holders.serving(&"x"), None);
        assert_eq!(affected, HashSet::from(["x"]));
    }
}
