//! The mesh config's `discoverySelectors` for one Kubernetes cluster: which of its namespaces are
//! discovered (any selector matching the namespace's labels; no selectors: all of them). Unlike
//! istiod, which watches every namespace and filters in memory, each selector is its own
//! Namespace watch selected on the API server. The watches of per-namespace objects
//! ([`scoped_watch`]) read against the selection: they start once it is known and relist when it
//! changes, so a namespace entering it is listed, one leaving it dropped, and no list mixes two
//! selections.

use std::collections::BTreeSet;
use std::fmt::Debug;
use std::sync::Arc;

use futures::stream::BoxStream;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Namespace;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tokio::sync::watch;
use tracing::{info, warn};

use crate::istio::label_selector::LabelSelector;
use crate::kube_client::retried;
use crate::registry::{ClusterRegistry, DiscoveredNamespaces};

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
            select(&registry, None);
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
            retried(watcher::watcher(
                Api::<Namespace>::all(client.clone()),
                config,
            ))
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
                        select(&registry, Some(sets.iter().flatten().cloned().collect()));
                        if std::mem::take(&mut first) {
                            listed();
                        }
                    }
                }
            }
        }
    }
}

/// Makes `new` the selection; the scoped watches relist against it.
fn select(registry: &ClusterRegistry, new: Option<BTreeSet<String>>) {
    let namespaces = new.as_ref().map(BTreeSet::len);
    if registry.discovered().replace(new) {
        info!(cluster = %registry.id(), ?namespaces, "discovered namespaces changed");
    }
}

/// A watch of `api`'s objects read against a cluster's discovered namespaces: it starts once they
/// are known and starts over (a relist, which the reader reconciles) each time they change. Ends
/// when the owner of the discovered namespaces is gone.
pub fn scoped_watch<K>(
    api: Api<K>,
    config: watcher::Config,
    discovered: &DiscoveredNamespaces,
) -> BoxStream<'static, watcher::Result<Event<K>>>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    let start = (discovered.changes(), None);
    futures::stream::unfold(start, move |(mut selection, mut events)| {
        let (api, config) = (api.clone(), config.clone());
        async move {
            loop {
                let current: &mut BoxStream<'static, _> = match &mut events {
                    Some(events) => events,
                    None => {
                        selection.wait_for(|n| *n > 0).await.ok()?;
                        selection.borrow_and_update();
                        let watch = retried(watcher::watcher(api.clone(), config.clone())).boxed();
                        events.insert(watch)
                    }
                };
                // None: the stream ends; Some(None): the selection changed, start over.
                let next = tokio::select! {
                    changed = selection.changed() => changed.ok().map(|()| None),
                    event = current.next() => event.map(Some),
                };
                match next? {
                    Some(event) => return Some((event, (selection, events))),
                    None => events = None,
                }
            }
        }
    })
    .boxed()
}
