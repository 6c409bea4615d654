//! Which of a Kubernetes cluster's namespaces are discovered (discoverySelectors): kept by the
//! cluster's discovery watch, read by everything that works per namespace of that cluster — its
//! object watches, the config cluster's Istio config, root certificate publishing.

use std::collections::BTreeSet;

use parking_lot::RwLock;
use tokio::sync::watch;

#[derive(Debug)]
pub struct DiscoveredNamespaces {
    /// None: every namespace (no selectors).
    selected: RwLock<Option<BTreeSet<String>>>,
    /// Counts the changes of the selection; 0 until it is first known.
    changes: watch::Sender<u64>,
}

impl Default for DiscoveredNamespaces {
    fn default() -> Self {
        Self {
            selected: RwLock::new(None),
            changes: watch::Sender::new(0),
        }
    }
}

impl DiscoveredNamespaces {
    /// Starts over for a new discovery watch: with selectors, nothing is admitted until the
    /// selected namespaces are known.
    pub fn restart(&self, has_selectors: bool) {
        *self.selected.write() = has_selectors.then(BTreeSet::new);
    }

    pub fn admits(&self, namespace: &str) -> bool {
        self.selected
            .read()
            .as_ref()
            .is_none_or(|s| s.contains(namespace))
    }

    /// How many namespaces are selected (None: every one).
    pub fn count(&self) -> Option<usize> {
        self.selected.read().as_ref().map(BTreeSet::len)
    }

    /// Makes `new` the selection; true if it differs from the one it replaces.
    pub fn replace(&self, new: Option<BTreeSet<String>>) -> bool {
        let changed = {
            let mut selected = self.selected.write();
            let changed = *selected != new;
            *selected = new;
            changed
        };
        self.changes.send_if_modified(|n| {
            let tick = *n == 0 || changed;
            if tick {
                *n += 1;
            }
            tick
        });
        changed
    }

    /// Ticks each time the selection changes; holds 0 until it is first known.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_once_replaced_and_ticking_only_on_change() {
        let discovered = DiscoveredNamespaces::default();
        let changes = discovered.changes();
        discovered.restart(true);
        assert!(!discovered.admits("a"));
        assert_eq!(*changes.borrow(), 0);
        let only_a = Some(BTreeSet::from(["a".to_string()]));
        discovered.replace(only_a.clone());
        assert!(discovered.admits("a") && !discovered.admits("b"));
        assert_eq!(*changes.borrow(), 1);
        discovered.replace(only_a);
        assert_eq!(*changes.borrow(), 1);
        discovered.replace(None);
        assert!(discovered.admits("b"));
        assert_eq!((*changes.borrow(), discovered.count()), (2, None));
    }
}
