//! Wiring: builds the model, starts the sources and servers of `meshpilot discovery`.

use std::net::SocketAddr;
use std::sync::Arc;

use thiserror::Error;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tracing::{debug, info};

use crate::admin::{self, AdminState};
use crate::aggregate::Aggregate;
use crate::config::DiscoveryArgs;
use crate::metrics::Metrics;
use crate::model::Mesh;
use crate::sources::file::{FileClusters, FileSourceError, FileWatch};

#[derive(Debug, Error)]
pub enum StartError {
    #[error("nothing to serve: give --config-dir")]
    NoSources,
    #[error(transparent)]
    FileSource(#[from] FileSourceError),
    #[error("cannot listen on {addr} ({what}): {source}")]
    Bind {
        what: &'static str,
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// A running control plane. Dropping it stops its servers and watches.
pub struct Running {
    pub http_addr: SocketAddr,
    pub aggregate: Arc<Aggregate>,
    tasks: Vec<JoinHandle<()>>,
    _file_watch: Option<FileWatch>,
}

impl Drop for Running {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

async fn bind(what: &'static str, addr: SocketAddr) -> Result<TcpListener, StartError> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| StartError::Bind { what, addr, source })?;
    let bound = listener
        .local_addr()
        .map_err(|source| StartError::Bind { what, addr, source })?;
    info!(server = what, addr = %bound, "listening");
    Ok(listener)
}

pub async fn start(args: DiscoveryArgs) -> Result<Running, StartError> {
    let mesh = Arc::new(Mesh::new(args.naming()));
    let (aggregate, mut changes) = Aggregate::new(mesh);

    let Some(config_dir) = &args.config_dir else {
        return Err(StartError::NoSources);
    };
    let file_watch = FileClusters::load(config_dir, aggregate.clone())?.watch()?;

    let metrics = Arc::new(Metrics::new());
    let http = bind("admin", args.http_addr).await?;
    let http_addr = http.local_addr().map_err(|source| StartError::Bind {
        what: "admin",
        addr: args.http_addr,
        source,
    })?;
    let router = admin::router(Arc::new(AdminState {
        aggregate: aggregate.clone(),
        metrics,
    }));
    let mut tasks = vec![tokio::spawn(async move {
        if let Err(e) = axum::serve(http, router).await {
            tracing::error!(error = %e, "admin server stopped");
        }
    })];
    tasks.push(tokio::spawn(async move {
        while let Some(change) = changes.recv().await {
            debug!(
                full = change.full,
                services = change.services.len(),
                "mesh changed"
            );
        }
    }));

    Ok(Running {
        http_addr,
        aggregate,
        tasks,
        _file_watch: Some(file_watch),
    })
}
