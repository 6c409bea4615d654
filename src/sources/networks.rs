//! `--mesh-networks FILE`: Istio's MeshNetworks, watched. A malformed file keeps the last good
//! networks in force and says why (log, /debug/networkz); a good one re-derives every endpoint's
//! network and the gateways, and pushes what changed.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use notify::{RecommendedWatcher, RecursiveMode, Watcher};
use parking_lot::Mutex;
use thiserror::Error;
use tracing::{error, info};

use crate::aggregate::Aggregate;
use crate::model::{MeshNetworks, NetworksError};

#[derive(Debug, Error)]
pub enum NetworksSourceError {
    #[error("mesh networks {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("mesh networks {path}: {source}")]
    Invalid { path: String, source: NetworksError },
    #[error("cannot watch {path}: {source}")]
    Watch { path: String, source: notify::Error },
}

/// Keeps the file watched; dropping it stops the watch.
pub struct NetworksWatch {
    _watcher: RecommendedWatcher,
    pub last_error: Arc<Mutex<Option<String>>>,
}

fn read(path: &Path) -> Result<MeshNetworks, NetworksSourceError> {
    let text = std::fs::read_to_string(path).map_err(|source| NetworksSourceError::Read {
        path: path.display().to_string(),
        source,
    })?;
    MeshNetworks::parse(&text).map_err(|source| NetworksSourceError::Invalid {
        path: path.display().to_string(),
        source,
    })
}

/// Loads the file (refusing to start on a bad one) and watches it.
pub fn watch(path: &Path, aggregate: Arc<Aggregate>) -> Result<NetworksWatch, NetworksSourceError> {
    let path: PathBuf = path.to_path_buf();
    let initial = read(&path)?;
    aggregate
        .mesh()
        .write(|mesh| mesh.set_mesh_networks(initial));
    aggregate.resync_all();
    let shown = path.display().to_string();
    let watch_error = |source| NetworksSourceError::Watch {
        path: shown.clone(),
        source,
    };
    // Watch the directory: editors and ConfigMap mounts replace the file rather than write it.
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
        .to_path_buf();
    let (tx, rx) = mpsc::channel();
    let mut watcher = notify::recommended_watcher(move |event| {
        let _ = tx.send(event);
    })
    .map_err(watch_error)?;
    watcher
        .watch(&dir, RecursiveMode::NonRecursive)
        .map_err(watch_error)?;
    let last_error: Arc<Mutex<Option<String>>> = Arc::default();
    let errors = last_error.clone();
    std::thread::Builder::new()
        .name("mesh-networks".into())
        .spawn(move || {
            while rx.recv().is_ok() {
                // Let a burst of events settle before reading.
                while rx.recv_timeout(Duration::from_millis(20)).is_ok() {}
                match read(&path) {
                    Ok(networks) => {
                        *errors.lock() = None;
                        if aggregate
                            .mesh()
                            .write(|mesh| mesh.set_mesh_networks(networks))
                        {
                            info!(path = %path.display(), "mesh networks changed");
                            aggregate.resync_all();
                        }
                    }
                    Err(e) => {
                        error!(error = %e, "mesh networks refused; keeping the last good ones");
                        *errors.lock() = Some(e.to_string());
                    }
                }
            }
        })
        .map_err(|e| watch_error(notify::Error::io(e)))?;
    Ok(NetworksWatch {
        _watcher: watcher,
        last_error,
    })
}
