//! Addresses allocated to ServiceEntry hosts, kept across restarts in the state directory
//! (`<state-dir>/allocated-addresses.json`: host → IPv4 address), so a host keeps its address
//! while proxies and applications may still hold it.
//!
//! The file is read once at start, before any config, and written (atomically) whenever the
//! allocations change. An unreadable file is set aside as `<file>.refused` with a clear error and
//! allocation starts afresh: every host still gets its preferred (hash-chosen) address unless two
//! collide.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;
use tracing::{info, warn};

use crate::model::allocation::{slot_addresses, slot_of};
use crate::model::{Allocations, Hostname, Mesh};

/// How often the keeper looks for new allocations: config changes are rare, a check is one load.
const CHECK_EVERY: Duration = Duration::from_millis(200);

/// After a failed write (a full or read-only disk), once a log line.
const RETRY_AFTER: Duration = Duration::from_secs(10);

#[derive(Debug, Error)]
pub enum AllocatedError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is not a map of host to 240.240.0.0/16 address: {problem}")]
    Format { path: String, problem: String },
}

pub struct AllocatedFile {
    path: PathBuf,
}

impl AllocatedFile {
    pub fn in_state_dir(dir: &Path) -> Self {
        Self {
            path: dir.join("allocated-addresses.json"),
        }
    }

    /// What was allocated before; a missing file is none.
    pub fn read(&self) -> Result<Allocations, AllocatedError> {
        let path = self.path.display().to_string();
        let text = match std::fs::read_to_string(&self.path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Allocations::default()),
            Err(source) => return Err(AllocatedError::Read { path, source }),
        };
        let map: BTreeMap<String, std::net::IpAddr> =
            serde_json::from_str(&text).map_err(|e| AllocatedError::Format {
                path: path.clone(),
                problem: crate::text::clip(&e.to_string()).to_string(),
            })?;
        let mut entries = Vec::with_capacity(map.len());
        for (host, address) in map {
            let slot = slot_of(address).ok_or_else(|| AllocatedError::Format {
                path: path.clone(),
                problem: format!("{address} (for {host}) is outside 240.240.0.0/16"),
            })?;
            entries.push((Hostname::from(host), slot));
        }
        Ok(Allocations::restore(entries))
    }

    /// Reads the file into the mesh before config arrives; a bad file is set aside, not lost.
    pub fn restore_into(&self, mesh: &Mesh) {
        match self.read() {
            Ok(allocations) => {
                let held = allocations.entries().count();
                if held > 0 {
                    info!(path = %self.path.display(), hosts = held, "allocated addresses restored");
                }
                mesh.write(|m| m.allocations = allocations);
            }
            Err(e) => {
                let aside = self.path.with_extension("json.refused");
                let moved = std::fs::rename(&self.path, &aside);
                warn!(error = %e, set_aside = %aside.display(), moved = moved.is_ok(), "allocated addresses not restored; allocating afresh");
            }
        }
    }

    async fn write(&self, allocations: &Allocations) -> std::io::Result<()> {
        let map: BTreeMap<&str, String> = allocations
            .entries()
            .map(|(host, slot)| (&**host, slot_addresses(slot)[0].to_string()))
            .collect();
        let text = serde_json::to_string_pretty(&map).unwrap_or_default();
        if let Some(dir) = self.path.parent() {
            tokio::fs::create_dir_all(dir).await?;
        }
        // Written whole and synced before it replaces the last: a crash leaves one or the other.
        let tmp = self.path.with_extension("json.tmp");
        let mut file = tokio::fs::File::create(&tmp).await?;
        tokio::io::AsyncWriteExt::write_all(&mut file, text.as_bytes()).await?;
        file.sync_all().await?;
        tokio::fs::rename(&tmp, &self.path).await
    }

    /// Writes the allocations whenever they change (what was restored is on disk already); runs
    /// until the process stops.
    pub async fn keep(self, mesh: Arc<Mesh>) {
        let mut written = 0;
        loop {
            tokio::time::sleep(CHECK_EVERY).await;
            let snapshot = mesh.snapshot();
            let allocations = &snapshot.allocations;
            if allocations.version() == written {
                continue;
            }
            match self.write(allocations).await {
                Ok(()) => written = allocations.version(),
                Err(e) => {
                    warn!(path = %self.path.display(), error = %e, "cannot write allocated addresses; retrying in {RETRY_AFTER:?}");
                    tokio::time::sleep(RETRY_AFTER).await;
                }
            }
        }
    }
}
