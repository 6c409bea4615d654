//! Patches that could not apply to what was generated: logged once per patch and reason, shown on
//! `/debug/configz` and as istiod's `pilot_envoy_filter_status{result="error"}` for as long as the
//! EnvoyFilter that failed is the one in force (a new version starts clean).

use std::collections::BTreeMap;
use std::sync::{Arc, LazyLock, Weak};

use parking_lot::Mutex;
use serde::Serialize;
use tracing::warn;

use super::PatchRef;
use crate::istio::{ConfigKey, ConfigObject};
use crate::model::ConfigStore;
use crate::text::clip;

/// Failures kept at most; the oldest entries make room.
const KEPT: usize = 1024;

/// One patch that failed, most recently on `resource`.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PatchFailure {
    #[serde(skip)]
    pub filter: ConfigKey,
    /// Its position in `configPatches`.
    pub patch: usize,
    /// Its `applyTo`, as istiod's metric labels it (`listener`, `cluster`, …).
    pub target: String,
    pub resource: String,
    pub error: String,
}

struct Entry {
    failure: PatchFailure,
    /// The EnvoyFilter object it failed in.
    object: Weak<ConfigObject>,
    order: u64,
}

#[derive(Default)]
struct Table {
    entries: BTreeMap<(ConfigKey, usize), Entry>,
    next: u64,
}

static TABLE: LazyLock<Mutex<Table>> = LazyLock::new(Mutex::default);

pub(super) fn record(p: &PatchRef<'_>, resource: &str, error: &str) {
    let key = (p.owner.key.clone(), p.index);
    let failure = PatchFailure {
        filter: p.owner.key.clone(),
        patch: p.index,
        target: p.target_name().to_ascii_lowercase().replace('_', ""),
        resource: clip(resource),
        error: clip(error),
    };
    let first = {
        let mut table = TABLE.lock();
        table.next += 1;
        let order = table.next;
        let same = table.entries.get(&key).is_some_and(|e| {
            e.failure.error == failure.error && e.object.as_ptr() == Arc::as_ptr(p.owner)
        });
        if table.entries.len() >= KEPT && !table.entries.contains_key(&key) {
            let oldest = table
                .entries
                .iter()
                .min_by_key(|(_, e)| e.order)
                .map(|(k, _)| k.clone());
            if let Some(oldest) = oldest {
                table.entries.remove(&oldest);
            }
        }
        table.entries.insert(
            key,
            Entry {
                failure: failure.clone(),
                object: Arc::downgrade(p.owner),
                order,
            },
        );
        !same
    };
    if first {
        warn!(
            envoy_filter = %failure.filter,
            patch = failure.patch,
            resource = %failure.resource,
            "EnvoyFilter patch not applied: {}",
            failure.error
        );
    }
}

/// The failures of the EnvoyFilters `store` holds now.
pub fn failures(store: &ConfigStore) -> Vec<PatchFailure> {
    let mut table = TABLE.lock();
    table.entries.retain(|(key, _), e| {
        store
            .get(key)
            .is_some_and(|current| e.object.as_ptr() == Arc::as_ptr(current))
    });
    table.entries.values().map(|e| e.failure.clone()).collect()
}
