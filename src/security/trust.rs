//! Trust distribution: the root certificate as ConfigMap `istio-ca-root-cert` (key `root-cert.pem`)
//! in every discovered namespace of the config cluster, and of remote clusters whose system
//! namespace opts in with the annotation `topology.istio.io/controlPlaneClusters` (this cluster's
//! id, or `*`). As istiod's namespace controller
//! (pilot/pkg/serviceregistry/kube/controller/namespacecontroller.go): namespaces the
//! discoverySelectors leave out, and Kubernetes' own but `kube-system`, get none.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::PostParams;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client, ResourceExt};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use crate::istio::KUBE_SYSTEM_NAMESPACES;
use crate::kube_client::retried;
use crate::kube_client::RemoteClients;
use crate::model::ClusterId;
use crate::registry::DiscoveredNamespaces;

pub const ROOT_CONFIGMAP: &str = "istio-ca-root-cert";
pub const ROOT_KEY: &str = "root-cert.pem";
const CONTROL_PLANE_ANNOTATION: &str = "topology.istio.io/controlPlaneClusters";
/// How often opted-in remote clusters are reconciled.
const REMOTE_RESYNC: Duration = Duration::from_secs(10);

/// A cluster's discovered namespaces, by its id (None: not known yet).
pub type DiscoveredOf = Arc<dyn Fn(&ClusterId) -> Option<Arc<DiscoveredNamespaces>> + Send + Sync>;

/// Keeps the root ConfigMap (the trust bundle `roots` holds now) in every discovered namespace of
/// the config cluster (watching namespaces) and of opted-in remote clusters; stops when the
/// returned tasks are aborted.
pub fn publish_root(
    (config, config_cluster): (Client, ClusterId),
    remotes: RemoteClients,
    discovered_of: DiscoveredOf,
    system_namespace: String,
    roots: watch::Receiver<String>,
) -> Vec<JoinHandle<()>> {
    let mut local_roots = roots.clone();
    let local_discovered = discovered_of(&config_cluster).unwrap_or_default();
    let mut selection = local_discovered.changes();
    let local = tokio::spawn(async move {
        // A new bundle or selection restarts the watch, whose initial list visits every namespace
        // again.
        loop {
            let root_pem = local_roots.borrow_and_update().clone();
            selection.borrow_and_update();
            let namespaces: Api<Namespace> = Api::all(config.clone());
            let mut events =
                retried(watcher::watcher(namespaces, watcher::Config::default())).boxed();
            loop {
                let event = tokio::select! {
                    event = events.next() => event,
                    changed = local_roots.changed() => match changed {
                        Ok(()) => break,
                        Err(_) => return,
                    },
                    changed = selection.changed() => match changed {
                        Ok(()) => break,
                        Err(_) => return,
                    },
                };
                let namespace = match event {
                    Some(Ok(Event::Apply(ns) | Event::InitApply(ns))) => ns.name_any(),
                    Some(Ok(_)) => continue,
                    Some(Err(e)) => {
                        warn!(error = %e, "namespace watch error (root certificate publishing)");
                        continue;
                    }
                    None => return,
                };
                if publishes(&local_discovered, &namespace) {
                    ensure(&config, &namespace, &root_pem).await;
                }
            }
        }
    });
    let remote = tokio::spawn(async move {
        loop {
            let root_pem = roots.borrow().clone();
            for (id, client) in remotes.all() {
                let Some(discovered) = discovered_of(&id) else {
                    continue;
                };
                if opted_in(&client, &system_namespace, &config_cluster).await {
                    let namespaces: Api<Namespace> = Api::all(client.clone());
                    match namespaces.list(&Default::default()).await {
                        Ok(list) => {
                            for ns in list {
                                let namespace = ns.name_any();
                                if publishes(&discovered, &namespace) {
                                    ensure(&client, &namespace, &root_pem).await;
                                }
                            }
                        }
                        Err(e) => debug!(cluster = %id, error = %e, "cannot list namespaces"),
                    }
                }
            }
            tokio::time::sleep(REMOTE_RESYNC).await;
        }
    });
    vec![local, remote]
}

fn publishes(discovered: &DiscoveredNamespaces, namespace: &str) -> bool {
    let kubernetes_own = namespace != "kube-system" && KUBE_SYSTEM_NAMESPACES.contains(&namespace);
    !kubernetes_own && discovered.admits(namespace)
}

/// Whether a remote cluster's system namespace names this control plane's cluster (or `*`).
pub(crate) async fn opted_in(
    client: &Client,
    system_namespace: &str,
    config_cluster: &ClusterId,
) -> bool {
    let Ok(Some(ns)) = Api::<Namespace>::all(client.clone())
        .get_opt(system_namespace)
        .await
    else {
        return false;
    };
    ns.annotations()
        .get(CONTROL_PLANE_ANNOTATION)
        .is_some_and(|v| {
            v.split(',')
                .map(str::trim)
                .any(|c| c == "*" || c == config_cluster.as_str())
        })
}

/// Creates or corrects the root ConfigMap in one namespace.
async fn ensure(client: &Client, namespace: &str, root_pem: &str) {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let data = BTreeMap::from([(ROOT_KEY.to_string(), root_pem.to_string())]);
    let result = match api.get_opt(ROOT_CONFIGMAP).await {
        Ok(Some(existing)) if existing.data.as_ref() == Some(&data) => return,
        Ok(Some(mut existing)) => {
            existing.data = Some(data);
            api.replace(ROOT_CONFIGMAP, &PostParams::default(), &existing)
                .await
                .map(|_| ())
        }
        Ok(None) => {
            let configmap = ConfigMap {
                metadata: ObjectMeta {
                    name: Some(ROOT_CONFIGMAP.to_string()),
                    namespace: Some(namespace.to_string()),
                    labels: Some(BTreeMap::from([(
                        "istio.io/config".to_string(),
                        "true".to_string(),
                    )])),
                    ..Default::default()
                },
                data: Some(data),
                ..Default::default()
            };
            api.create(&PostParams::default(), &configmap)
                .await
                .map(|_| ())
        }
        Err(e) => Err(e),
    };
    if let Err(e) = result {
        warn!(namespace, error = %e, "cannot publish the root certificate");
    }
}
