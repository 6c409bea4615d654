//! Holds each distinct value once: the pods of one workload carry equal label sets, and a cluster
//! of 100,000 pods would otherwise keep 100,000 copies of a few thousand maps.

use std::collections::HashSet;
use std::hash::Hash;
use std::sync::Arc;

/// Below this many values the pool is never swept.
const MIN_SWEEP: usize = 1024;

#[derive(Debug)]
pub struct Interner<T: Eq + Hash + ?Sized> {
    pool: HashSet<Arc<T>>,
    /// The pool's size after its last sweep: it is swept again once it has doubled.
    swept_at: usize,
}

impl<T: Eq + Hash + ?Sized> Default for Interner<T> {
    fn default() -> Self {
        Self {
            pool: HashSet::new(),
            swept_at: 0,
        }
    }
}

impl<T: Eq + Hash + ?Sized> Interner<T> {
    /// The pooled value equal to `value`, which joins the pool when there is none.
    pub fn intern(&mut self, value: Arc<T>) -> Arc<T> {
        if let Some(pooled) = self.pool.get(&*value) {
            return pooled.clone();
        }
        self.pool.insert(value.clone());
        if self.pool.len() > MIN_SWEEP.max(2 * self.swept_at) {
            self.sweep();
        }
        value
    }

    /// Drops the values nothing but the pool holds any more; amortised over the insertions that
    /// doubled the pool, so interning stays O(1).
    fn sweep(&mut self) {
        self.pool.retain(|v| Arc::strong_count(v) > 1);
        self.swept_at = self.pool.len();
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.pool.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_values_share_one_allocation() {
        let mut pool = Interner::default();
        let a = pool.intern(Arc::new(String::from("app=web")));
        let b = pool.intern(Arc::new(String::from("app=web")));
        let c = pool.intern(Arc::new(String::from("app=db")));
        assert!(Arc::ptr_eq(&a, &b));
        assert!(!Arc::ptr_eq(&a, &c));
        assert_eq!(pool.len(), 2);
    }

    #[test]
    fn values_no_one_holds_are_swept_as_the_pool_grows() {
        let mut pool = Interner::default();
        let kept: Vec<Arc<usize>> = (0..10).map(|i| pool.intern(Arc::new(i))).collect();
        for i in 10..=MIN_SWEEP {
            pool.intern(Arc::new(i));
        }
        // The insertion past MIN_SWEEP swept every value but the ten held here and itself.
        assert_eq!(pool.len(), kept.len() + 1);
        assert!(Arc::ptr_eq(&kept[3], &pool.intern(Arc::new(3))));
    }
}
