//! `/debug/clusterz`: istiod's remote-cluster list (`istioctl remote-clusters` reads `id`,
//! `secretName`, `syncStatus`), the config cluster first, with meshpilot's detail beside it.

use serde::Serialize;

use super::DebugContext;
use crate::model::Provider;
use crate::registry::{ClusterStatus, SyncState};

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ClusterRow {
    id: String,
    /// `<namespace>/<name>` of the Secret that onboarded it; empty for others.
    secret_name: String,
    sync_status: &'static str,
    provider: Provider,
    source: String,
    services: usize,
    endpoints: usize,
    #[serde(flatten)]
    status: ClusterStatus,
}

/// istiod's four values; a cluster whose kubeconfig was refused has stopped trying until its
/// Secret changes, which istiod calls closed. `stale` is meshpilot's own: a remote served from its
/// last-known-good snapshot after a restart, not synced yet.
fn sync_status(state: SyncState) -> &'static str {
    match state {
        SyncState::Syncing => "syncing",
        SyncState::Synced => "synced",
        SyncState::TimedOut => "timeout",
        SyncState::Failed => "closed",
        SyncState::Stale => "stale",
    }
}

pub(super) fn clusterz(ctx: &DebugContext) -> Vec<impl Serialize> {
    ctx.aggregate
        .clusters()
        .iter()
        .map(|c| {
            let status = c.status();
            ClusterRow {
                id: c.id().to_string(),
                secret_name: c.remote_secret().unwrap_or_default().to_string(),
                sync_status: sync_status(status.state),
                provider: c.shard().provider,
                source: c.source().to_string(),
                services: c.service_count(),
                endpoints: c.endpoint_count(),
                status,
            }
        })
        .collect()
}
