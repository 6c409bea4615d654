//! Istio's MeshNetworks, from `--mesh-networks FILE` or else the `meshNetworks` key of the
//! revision's mesh ConfigMap (`sources/kube_config`), as istiod's `getConfigurationSources`
//! (pilot/pkg/bootstrap/mesh.go). Either way a malformed value keeps the last good networks in
//! force and says why (log, /debug/networkz); a good one re-derives every endpoint's network and
//! the gateways, and pushes what changed.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;
use thiserror::Error;
use tokio::sync::watch;
use tracing::{error, info};

use super::watch::{self as file_watch, Watch};
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

/// Where MeshNetworks take effect, whichever source they come from: the mesh, the resolver of
/// gateways' DNS names, and the source's standing error.
#[derive(Clone)]
pub struct NetworksSink {
    aggregate: Arc<Aggregate>,
    hostnames: Arc<watch::Sender<BTreeSet<String>>>,
    /// Why the source's current value is refused, if it is.
    pub last_error: Arc<Mutex<Option<String>>>,
}

impl NetworksSink {
    /// The sink, and what its gateways' DNS names are, for `gateway_names::resolve`.
    pub fn new(aggregate: Arc<Aggregate>) -> (Self, watch::Receiver<BTreeSet<String>>) {
        let (hostnames, names) = watch::channel(BTreeSet::new());
        let sink = Self {
            aggregate,
            hostnames: Arc::new(hostnames),
            last_error: Arc::default(),
        };
        (sink, names)
    }

    /// Puts `networks` in force (`origin` says where they came from, for the log).
    pub fn accept(&self, networks: MeshNetworks, origin: &str) {
        *self.last_error.lock() = None;
        let hostnames = networks.gateway_hostnames();
        let changed = (self.aggregate.mesh()).write(|mesh| mesh.set_mesh_networks(networks));
        self.hostnames.send_if_modified(|names| {
            let modified = *names != hostnames;
            *names = hostnames;
            modified
        });
        if changed {
            info!(origin, "mesh networks changed");
            self.aggregate.resync_all();
        }
    }

    /// Keeps the networks in force and reports why the new value was refused.
    pub fn refuse(&self, message: String) {
        error!(error = %message, "mesh networks refused; keeping the last good ones");
        *self.last_error.lock() = Some(message);
    }
}

/// Keeps the file watched; dropping it stops the watch.
pub struct NetworksWatch {
    _watch: Watch,
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
pub fn watch(path: &Path, sink: NetworksSink) -> Result<NetworksWatch, NetworksSourceError> {
    let path: PathBuf = path.to_path_buf();
    let origin = path.display().to_string();
    sink.accept(read(&path)?, &origin);
    let watched = path.clone();
    let watch = file_watch::watch_file(&path, "mesh-networks", move || match read(&watched) {
        Ok(networks) => sink.accept(networks, &origin),
        Err(e) => sink.refuse(e.to_string()),
    })
    .map_err(|source| NetworksSourceError::Watch {
        path: path.display().to_string(),
        source,
    })?;
    Ok(NetworksWatch { _watch: watch })
}
