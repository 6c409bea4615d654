//! `--mesh-networks FILE`: Istio's MeshNetworks, watched. A malformed file keeps the last good
//! networks in force and says why (log, /debug/networkz); a good one re-derives every endpoint's
//! network and the gateways, and pushes what changed.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;
use thiserror::Error;
use tracing::{error, info};

use super::watch::{self, Watch};
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
    _watch: Watch,
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
    let last_error: Arc<Mutex<Option<String>>> = Arc::default();
    let errors = last_error.clone();
    let watched = path.clone();
    let watch = watch::watch_file(&path, "mesh-networks", move || match read(&watched) {
        Ok(networks) => {
            *errors.lock() = None;
            if aggregate
                .mesh()
                .write(|mesh| mesh.set_mesh_networks(networks))
            {
                info!(path = %watched.display(), "mesh networks changed");
                aggregate.resync_all();
            }
        }
        Err(e) => {
            error!(error = %e, "mesh networks refused; keeping the last good ones");
            *errors.lock() = Some(e.to_string());
        }
    })
    .map_err(|source| NetworksSourceError::Watch {
        path: path.display().to_string(),
        source,
    })?;
    Ok(NetworksWatch {
        _watch: watch,
        last_error,
    })
}
