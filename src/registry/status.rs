//! Where a cluster is in its life, for operators (`/debug/clusterz`, doctor).

use std::time::SystemTime;

use serde::Serialize;

use crate::istio::label_selector::LabelSelector;

/// Where a cluster is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum SyncState {
    Syncing,
    Synced,
    TimedOut,
    Failed,
    /// Serving the last-known-good snapshot saved before a restart; still trying to sync.
    Stale,
}

impl SyncState {
    pub fn name(self) -> &'static str {
        match self {
            Self::Syncing => "syncing",
            Self::Synced => "synced",
            Self::TimedOut => "timed-out",
            Self::Failed => "failed",
            Self::Stale => "stale",
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct ClusterStatus {
    pub state: SyncState,
    pub last_error: Option<String>,
    #[serde(with = "rfc3339")]
    pub last_error_at: Option<SystemTime>,
    /// A kubeconfig rotation not through yet, and why (the previous kubeconfig serves meanwhile):
    /// kept apart from `last_error`, which the watches' own errors overwrite.
    pub pending_rotation: Option<String>,
    /// While stale: when the snapshot being served was saved.
    #[serde(with = "rfc3339")]
    pub snapshot_saved_at: Option<SystemTime>,
    /// Which of its namespaces are discovered; None where discoverySelectors do not apply.
    pub discovery: Option<Discovery>,
}

/// A cluster's discovery selectors, where they come from, and how many namespaces they select.
#[derive(Clone, Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Discovery {
    pub selectors: Vec<LabelSelector>,
    /// `mesh config`, or the remote Secret's annotation.
    pub from: String,
    /// None: every namespace.
    pub namespaces: Option<usize>,
}

mod rfc3339 {
    use std::time::SystemTime;

    pub fn serialize<S: serde::Serializer>(
        t: &Option<SystemTime>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        match t {
            Some(t) => s.serialize_str(&humantime::format_rfc3339_seconds(*t).to_string()),
            None => s.serialize_none(),
        }
    }
}
