//! The mesh config injection uses: the `mesh` key of ConfigMap `istio` in the system namespace,
//! watched (a config that does not parse is logged and the last good one kept), or a fixed one.

use std::sync::Arc;

use arc_swap::ArcSwap;
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::istio::MeshConfig;
use crate::sources::kube::WatchBackoff;

pub const MESH_CONFIGMAP: &str = "istio";
pub const MESH_KEY: &str = "mesh";

/// The current mesh config.
#[derive(Clone)]
pub struct MeshSource(Arc<ArcSwap<MeshConfig>>);

impl MeshSource {
    pub fn fixed(mesh: MeshConfig) -> Self {
        Self(Arc::new(ArcSwap::from_pointee(mesh)))
    }

    pub fn current(&self) -> Arc<MeshConfig> {
        self.0.load_full()
    }

    /// Follows ConfigMap `istio` in `namespace`; `fallback` while it is absent.
    pub fn watch(
        client: Client,
        namespace: String,
        fallback: MeshConfig,
    ) -> (Self, JoinHandle<()>) {
        let source = Self::fixed(fallback.clone());
        let current = source.0.clone();
        let task = tokio::spawn(async move {
            let api: Api<ConfigMap> = Api::namespaced(client, &namespace);
            let config =
                watcher::Config::default().fields(&format!("metadata.name={MESH_CONFIGMAP}"));
            let mut events = watcher::watcher(api, config)
                .backoff(WatchBackoff::default())
                .boxed();
            while let Some(event) = events.next().await {
                match event {
                    Ok(Event::Apply(cm) | Event::InitApply(cm)) => {
                        let text = cm
                            .data
                            .as_ref()
                            .and_then(|d| d.get(MESH_KEY))
                            .cloned()
                            .unwrap_or_default();
                        match MeshConfig::parse(&text, &namespace) {
                            Ok(mesh) => {
                                info!(namespace, "mesh config for injection updated");
                                current.store(Arc::new(mesh));
                            }
                            Err(e) => warn!(
                                namespace,
                                error = %e,
                                "ConfigMap istio: mesh config refused; injection keeps the last good one"
                            ),
                        }
                    }
                    Ok(Event::Delete(_)) => current.store(Arc::new(fallback.clone())),
                    Ok(_) => {}
                    Err(e) => warn!(error = %e, "ConfigMap istio watch error"),
                }
            }
        });
        (source, task)
    }
}
