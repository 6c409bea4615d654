//! `--mesh-config FILE`: the `mesh` key of Istio's `istio` ConfigMap, watched. A file that does not
//! parse or validate keeps the last good mesh config in force and says why (log, /debug/mesh).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;
use thiserror::Error;
use tracing::{error, info};

use super::watch::{self, Watch};
use crate::aggregate::Aggregate;
use crate::istio::{MeshConfig, ValidationError};

#[derive(Debug, Error)]
pub enum MeshConfigError {
    #[error("mesh config {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("mesh config {path}: {source}")]
    Invalid {
        path: String,
        source: ValidationError,
    },
    #[error("cannot watch mesh config {path}: {source}")]
    Watch { path: String, source: notify::Error },
}

/// Keeps the file watched; dropping it stops the watch.
pub struct MeshConfigWatch {
    _watch: Watch,
    /// Why the file is refused now, if it is.
    pub last_error: Arc<Mutex<Option<String>>>,
}

/// Reads and validates a mesh config file; absent fields take `defaults`' root namespace and trust
/// domain, Istio's defaults otherwise.
pub fn read(path: &Path, defaults: &MeshConfig) -> Result<MeshConfig, MeshConfigError> {
    let shown = || path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| MeshConfigError::Read {
        path: shown(),
        source,
    })?;
    MeshConfig::parse(&text, defaults).map_err(|source| MeshConfigError::Invalid {
        path: shown(),
        source,
    })
}

/// Watches the file (already read and applied at start) and applies each good version.
pub fn watch(
    path: &Path,
    aggregate: Arc<Aggregate>,
    defaults: MeshConfig,
) -> Result<MeshConfigWatch, MeshConfigError> {
    let last_error: Arc<Mutex<Option<String>>> = Arc::default();
    let errors = last_error.clone();
    let watched: PathBuf = path.to_path_buf();
    let watch = watch::watch_file(path, "mesh-config", move || {
        match read(&watched, &defaults) {
            Ok(mesh) => {
                *errors.lock() = None;
                if mesh.trust_domain != defaults.trust_domain {
                    error!(
                        trust_domain = mesh.trust_domain,
                        in_force = defaults.trust_domain,
                        "a new trustDomain takes effect after a restart"
                    );
                }
                if aggregate.set_mesh_config(mesh) {
                    info!(path = %watched.display(), "mesh config changed");
                }
            }
            Err(e) => {
                error!(error = %e, "mesh config refused; keeping the last good one");
                *errors.lock() = Some(e.to_string());
            }
        }
    })
    .map_err(|source| MeshConfigError::Watch {
        path: path.display().to_string(),
        source,
    })?;
    Ok(MeshConfigWatch {
        _watch: watch,
        last_error,
    })
}
