//! Kubernetes Ingress, as istiod's ingress controller serves it (pilot/pkg/config/kube/ingress/,
//! wired in pilot/pkg/bootstrap/configcontroller.go): the config cluster's Ingresses and Services
//! (of discovered namespaces) and IngressClasses are watched; the Ingresses the mesh config's
//! class settings select (`class`) are made into Istio Gateways and VirtualServices (`convert`)
//! and applied as their own config source, what of them cannot be served shown as refusals on
//! /debug/configz and logged; the leader writes their status (`status`).
//!
//! Unlike istiod, which reads `ingressControllerMode: OFF` at start only, the mode is followed
//! live: OFF stops the watches and withdraws what they made.

mod api;
mod class;
mod convert;
mod held;
mod paths;
pub mod status;

use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Service;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::watcher;
use kube::{Api, Client};
use tokio::sync::watch;
use tracing::{info, warn};

use self::held::Held;
use super::discovery::scoped_watch;
use crate::aggregate::Aggregate;
use crate::istio::mesh::IngressControllerMode;
use crate::kube_client::retried;
use crate::model::ClusterId;
use crate::registry::DiscoveredNamespaces;
use crate::supervise::{OwnedTasks, Supervisor};

pub use self::api::Address;
pub use self::held::{Addresses, Served, ServedIngress};

/// Where Ingresses are read and what they are made into.
pub struct IngressScope {
    pub cluster: ClusterId,
    pub discovered: Arc<DiscoveredNamespaces>,
    /// Where the Gateways made from Ingresses live, and the ingress Service (istiod's
    /// `K8S_INGRESS_NS`).
    pub namespace: String,
    pub domain_suffix: String,
}

/// The running watch; dropping it stops it.
pub struct IngressWatch {
    tasks: OwnedTasks,
    synced: watch::Receiver<bool>,
    served: watch::Receiver<Arc<Served>>,
}

impl IngressWatch {
    pub fn supervise(&mut self, supervisor: &mut Supervisor, name: &'static str) {
        self.tasks.supervise(supervisor, name);
    }

    /// Tells whether every kind has been listed once (or the mode is OFF).
    pub fn synced_check(&self) -> impl Fn() -> bool + Send + Sync + 'static {
        let synced = self.synced.clone();
        move || *synced.borrow()
    }

    /// The served Ingresses and their addresses, for the status writer.
    pub fn served(&self) -> watch::Receiver<Arc<Served>> {
        self.served.clone()
    }
}

/// Starts watching the config cluster's Ingresses.
pub fn watch(client: Client, scope: IngressScope, aggregate: Arc<Aggregate>) -> IngressWatch {
    let (synced_tx, synced) = watch::channel(false);
    let (served_tx, served) = watch::channel(Arc::default());
    let task = tokio::spawn(run(client, scope, aggregate, (synced_tx, served_tx)));
    let mut tasks = OwnedTasks::default();
    tasks.push(task);
    IngressWatch {
        tasks,
        synced,
        served,
    }
}

fn resource(kind: &str, plural: &str) -> ApiResource {
    let gvk = GroupVersionKind::gvk(api::GROUP, api::VERSION, kind);
    ApiResource::from_gvk_with_plural(&gvk, plural)
}

async fn run(
    client: Client,
    scope: IngressScope,
    aggregate: Arc<Aggregate>,
    (synced, served): (watch::Sender<bool>, watch::Sender<Arc<Served>>),
) {
    let mut mesh = aggregate.mesh_config();
    let discovered = scope.discovered.clone();
    let mut held = Held::new(scope, aggregate, served);
    loop {
        let settings = held.settings_from(&mesh.borrow_and_update());
        if !settings.enabled() {
            info!("ingressControllerMode OFF: Kubernetes Ingresses are not served");
            held.withdraw();
            synced.send_replace(true);
            if mesh.changed().await.is_err() {
                return;
            }
            continue;
        }
        if settings.mode == IngressControllerMode::Unspecified {
            warn!("ingressControllerMode UNSPECIFIED: only Ingresses of an istio.io/ingress-controller IngressClass are served");
        }
        held.restart(settings);
        let all = watcher::Config::default();
        let ingresses =
            Api::<DynamicObject>::all_with(client.clone(), &resource("Ingress", "ingresses"));
        let mut ingresses = scoped_watch(ingresses, all.clone(), &discovered);
        let classes = Api::<DynamicObject>::all_with(
            client.clone(),
            &resource("IngressClass", "ingressclasses"),
        );
        let mut classes = retried(watcher::watcher(classes, all.clone())).boxed();
        let mut services = scoped_watch(Api::<Service>::all(client.clone()), all, &discovered);
        loop {
            let changed = tokio::select! {
                changed = mesh.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    let settings = held.settings_from(&mesh.borrow_and_update());
                    if !settings.enabled() {
                        break;
                    }
                    held.set_settings(settings)
                }
                Some(event) = ingresses.next() => held.on_ingress(event),
                Some(event) = classes.next() => held.on_class(event),
                Some(event) = services.next() => held.on_service(event),
                else => return,
            };
            if changed && held.listed() {
                held.publish();
                synced.send_replace(true);
            }
        }
    }
}
