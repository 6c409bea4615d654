//! The mesh config's `discoverySelectors` for one Kubernetes cluster: which of its namespaces are
//! discovered (any selector matching the namespace's labels; no selectors: all of them). Unlike
//! istiod, which watches every namespace and filters in memory, each selector is its own
//! Namespace watch selected on the API server; objects of other namespaces are dropped as they
//! arrive and never held. A namespace entering the selection has its objects listed into the
//! registry; one leaving has them dropped. Selectors changing (a mesh config reload) restart the
//! watches.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod, Secret, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::ListParams;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tokio::sync::watch;
use tracing::{info, warn};

use crate::istio::label_selector::LabelSelector;
use crate::kube_client::WatchBackoff;
use crate::registry::objects::{self, Object, ObjectChange, TrimError};
use crate::registry::ClusterRegistry;

/// How long listing one namespace's objects may take.
const LIST_TIMEOUT: Duration = Duration::from_secs(30);

/// Keeps the registry's discovered namespaces as `selectors` say for the cluster behind `client`;
/// `listed` is called once they are first known.
pub async fn run(
    client: Client,
    registry: Arc<ClusterRegistry>,
    mut selectors: watch::Receiver<Vec<LabelSelector>>,
    listed: impl Fn(),
) {
    let mut first = true;
    loop {
        let current = selectors.borrow_and_update().clone();
        registry.update_discovery(|d| d.selectors = current.clone());
        if current.is_empty() {
            apply(&client, &registry, None).await;
            if std::mem::take(&mut first) {
                listed();
            }
            if selectors.changed().await.is_err() {
                return;
            }
            continue;
        }
        let streams = current.iter().enumerate().map(|(i, selector)| {
            let config = watcher::Config::default().labels(&selector.to_query());
            watcher::watcher(Api::<Namespace>::all(client.clone()), config)
                .backoff(WatchBackoff::default())
                .map(move |event| (i, event))
                .boxed()
        });
        let mut events = futures::stream::select_all(streams);
        let mut sets: Vec<BTreeSet<String>> = vec![BTreeSet::new(); current.len()];
        let mut lists: Vec<Option<BTreeSet<String>>> = vec![None; current.len()];
        let mut synced = vec![false; current.len()];
        loop {
            tokio::select! {
                changed = selectors.changed() => match changed {
                    Ok(()) => break,
                    Err(_) => return,
                },
                Some((i, event)) = events.next() => {
                    match event {
                        Ok(Event::Init) => lists[i] = Some(BTreeSet::new()),
                        Ok(Event::InitApply(ns)) => {
                            if let Some(list) = lists[i].as_mut() {
                                list.insert(ns.name_any());
                            }
                        }
                        Ok(Event::InitDone) => {
                            sets[i] = lists[i].take().unwrap_or_default();
                            synced[i] = true;
                        }
                        Ok(Event::Apply(ns)) => {
                            sets[i].insert(ns.name_any());
                        }
                        Ok(Event::Delete(ns)) => {
                            sets[i].remove(&ns.name_any());
                        }
                        Err(e) => {
                            warn!(cluster = %registry.id(), error = %e, "namespace watch error");
                            continue;
                        }
                    }
                    if synced.iter().all(|s| *s) {
                        let union = sets.iter().flatten().cloned().collect();
                        apply(&client, &registry, Some(union)).await;
                        if std::mem::take(&mut first) {
                            listed();
                        }
                    }
                }
            }
        }
    }
}

/// Makes `new` the selection: objects of namespaces leaving it are dropped, those of namespaces
/// entering it listed.
async fn apply(client: &Client, registry: &Arc<ClusterRegistry>, new: Option<BTreeSet<String>>) {
    let old = registry.discovered().replace(new.clone());
    if old == new {
        return;
    }
    let entering: Option<Vec<String>> = match (&old, &new) {
        (_, None) => None,
        (None, Some(_)) => Some(Vec::new()),
        (Some(old), Some(new)) => Some(new.difference(old).cloned().collect()),
    };
    if let Some(new) = &new {
        let kept = new.clone();
        let registry = registry.clone();
        let _ = tokio::task::spawn_blocking(move || registry.forget(|ns| !kept.contains(ns))).await;
    }
    info!(
        cluster = %registry.id(),
        namespaces = ?new.as_ref().map(BTreeSet::len),
        "discovered namespaces changed"
    );
    match entering {
        // Every namespace is discovered again: list everything.
        None => list_into(client, registry, None).await,
        Some(namespaces) => {
            for namespace in namespaces {
                list_into(client, registry, Some(&namespace)).await;
            }
        }
    }
}

/// Lists the discovered kinds (of one namespace, or everywhere) into the registry.
async fn list_into(client: &Client, registry: &Arc<ClusterRegistry>, namespace: Option<&str>) {
    let mut changes = Vec::new();
    changes.extend(listed::<Pod>(client, namespace, |o| objects::pod(o).map(Some)).await);
    changes.extend(listed::<Service>(client, namespace, |o| objects::service(o).map(Some)).await);
    changes.extend(listed::<EndpointSlice>(client, namespace, objects::endpoint_slice).await);
    changes.extend(listed::<Secret>(client, namespace, |o| objects::secret(o).map(Some)).await);
    let registry = registry.clone();
    let _ = tokio::task::spawn_blocking(move || registry.apply(changes)).await;
}

async fn listed<K>(
    client: &Client,
    namespace: Option<&str>,
    trim: fn(&K) -> Result<Option<Object>, TrimError>,
) -> Vec<ObjectChange>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug,
    K::DynamicType: Default,
{
    let api: Api<K> = match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    match tokio::time::timeout(LIST_TIMEOUT, api.list(&ListParams::default())).await {
        Ok(Ok(list)) => list
            .items
            .iter()
            .filter_map(|o| trim(o).ok().flatten())
            .map(ObjectChange::Upsert)
            .collect(),
        Ok(Err(e)) => {
            warn!(namespace, error = %e, "listing a discovered namespace failed");
            Vec::new()
        }
        Err(_) => {
            warn!(namespace, "listing a discovered namespace timed out");
            Vec::new()
        }
    }
}
