//! Which revision owns what, as istiod's tag watcher reads it (istio/istio
//! pkg/revisions/tag_watcher.go, default_watcher.go): the tags pointing at each revision
//! (webhook configurations and Services labelled `istio.io/tag`), the `default` tag's target
//! (`istio-revision-tag-default`), the default revision (`istiod-default-validator`'s label) and
//! namespaces' `istio.io/rev` labels; and which other control planes run: istiod pods
//! (`app=istiod`, `istio.io/rev`) and the Leases of the system namespace. Watched on the config
//! cluster into reflector stores, read as [`Inputs`] where a decision is made, and only once every
//! store has listed: before that, an empty store would read as "nobody else runs".

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Pod, Service};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client, Resource, ResourceExt};
use parking_lot::Mutex;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{info, warn};

use super::gateway_owners::Inputs;
use crate::istio::revision::{REVISION_LABEL, TAG_LABEL};
use crate::istio::Revision;
use crate::kube_client::retried;
use crate::leader::{GATEWAY_DEPLOYMENT, LEASE_NAME};

/// The `default` tag's webhook configuration (its name has no namespace suffix in istiod's
/// tag watcher).
pub const DEFAULT_TAG_WEBHOOK: &str = "istio-revision-tag-default";
/// The validator that names the default revision.
pub const DEFAULT_VALIDATOR: &str = "istiod-default-validator";
/// What selects istiod's pods (and meshpilot's, which carry istiod's labels).
pub const ISTIOD_PODS: &str = "app=istiod";
/// istiod's Lease duration (pilot/pkg/leaderelection/leaderelection.go), for a Lease that names
/// none.
const ISTIOD_LEASE_DURATION: Duration = Duration::from_secs(30);

/// A Lease's version as last read, and when that version was first read.
type Seen = (Option<String>, Instant);

/// The config cluster's tags, revision labels and control planes, kept current.
#[derive(Clone)]
pub struct RevisionTags {
    revision: Revision,
    webhooks: Store<MutatingWebhookConfiguration>,
    validators: Store<ValidatingWebhookConfiguration>,
    services: Store<Service>,
    namespaces: Store<Namespace>,
    pods: Store<Pod>,
    leases: Store<Lease>,
    /// Whether every store has listed.
    ready: watch::Receiver<bool>,
    /// Each Lease's last version seen, and when it was first seen: a holder is alive while its
    /// record changes within its duration, by our clock (client-go's rule; clocks differ).
    renewals: Arc<Mutex<HashMap<String, Seen>>>,
    default_tag: watch::Receiver<Option<Revision>>,
}

impl RevisionTags {
    /// Starts the watches; the tasks end when aborted.
    pub fn watch(
        client: Client,
        system_namespace: &str,
        revision: Revision,
    ) -> (Self, Vec<JoinHandle<()>>) {
        let tagged = watcher::Config::default().labels(TAG_LABEL);
        let (webhooks, webhook_writer) = reflector::store();
        let (validators, validator_writer) = reflector::store();
        let (services, service_writer) = reflector::store();
        let (namespaces, namespace_writer) = reflector::store();
        let (pods, pod_writer) = reflector::store();
        let (leases, lease_writer) = reflector::store();
        let (default_tx, default_tag) = watch::channel(None);
        let (ready_tx, ready) = watch::channel(false);
        let store = webhooks.clone();
        let webhook_api: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
        let webhook_events = retried(watcher::watcher(webhook_api, tagged.clone()))
            .reflect(webhook_writer)
            .touched_objects();
        let tags = Self {
            revision,
            webhooks,
            validators,
            services,
            namespaces,
            pods,
            leases,
            ready,
            renewals: Arc::default(),
            default_tag,
        };
        let listed = tags.clone();
        let tasks = vec![
            tokio::spawn(async move {
                let mut events = webhook_events.boxed();
                while let Some(event) = events.next().await {
                    if let Err(e) = event {
                        warn!(error = %e, "tag webhook watch error");
                    }
                    let target = default_tag_of(&store);
                    default_tx.send_if_modified(|current| {
                        let changed = *current != target;
                        if changed {
                            info!(revision = ?target, "the default tag points at a new revision");
                            *current = target;
                        }
                        changed
                    });
                }
            }),
            drain(
                Api::<ValidatingWebhookConfiguration>::all(client.clone()),
                watcher::Config::default().fields(&format!("metadata.name={DEFAULT_VALIDATOR}")),
                validator_writer,
            ),
            drain(
                Api::<Service>::namespaced(client.clone(), system_namespace),
                tagged,
                service_writer,
            ),
            drain(
                Api::<Namespace>::all(client.clone()),
                watcher::Config::default().labels(REVISION_LABEL),
                namespace_writer,
            ),
            drain(
                Api::<Pod>::namespaced(client.clone(), system_namespace),
                watcher::Config::default().labels(ISTIOD_PODS),
                pod_writer,
            ),
            drain(
                Api::<Lease>::namespaced(client, system_namespace),
                watcher::Config::default(),
                lease_writer,
            ),
            tokio::spawn(async move {
                if listed.all_listed().await {
                    ready_tx.send_replace(true);
                }
            }),
        ];
        (tags, tasks)
    }

    /// Waits until every store has listed; false if a watch ended first.
    async fn all_listed(&self) -> bool {
        let lists = tokio::join!(
            self.webhooks.wait_until_ready(),
            self.validators.wait_until_ready(),
            self.services.wait_until_ready(),
            self.namespaces.wait_until_ready(),
            self.pods.wait_until_ready(),
            self.leases.wait_until_ready(),
        );
        matches!(lists, (Ok(()), Ok(()), Ok(()), Ok(()), Ok(()), Ok(())))
    }

    /// The revision the `default` tag points at, now and as it changes (istiod's leader
    /// elections prefer it).
    pub fn default_tag(&self) -> watch::Receiver<Option<Revision>> {
        self.default_tag.clone()
    }

    /// What decides who owns what, this revision counted among the running meshpilots; None
    /// until every store has listed.
    pub fn view(&self) -> Option<Inputs> {
        if !*self.ready.borrow() {
            return None;
        }
        let tag = |labels: &BTreeMap<String, String>| {
            let revision = labels.get(REVISION_LABEL).filter(|r| !r.is_empty())?;
            Some((labels.get(TAG_LABEL)?.clone(), revision.clone()))
        };
        let revision_of = |labels: &BTreeMap<String, String>| {
            labels.get(REVISION_LABEL).cloned().unwrap_or_default()
        };
        let mut inputs = Inputs {
            tags: (self.webhooks.state().iter())
                .filter_map(|w| tag(w.labels()))
                .chain(self.services.state().iter().filter_map(|s| tag(s.labels())))
                .collect(),
            default_tag: (self
                .webhooks
                .get(&reflector::ObjectRef::new(DEFAULT_TAG_WEBHOOK)))
            .map(|w| revision_of(w.labels())),
            default_validator: (self
                .validators
                .get(&reflector::ObjectRef::new(DEFAULT_VALIDATOR)))
            .map(|v| revision_of(v.labels())),
            namespaces: (self.namespaces.state().iter())
                .map(|ns| (ns.name_any(), revision_of(ns.labels())))
                .collect(),
            ..Default::default()
        };
        let held = self.held_leases();
        inputs.meshpilots = (held.keys())
            .filter_map(|name| meshpilot_of(name))
            .chain([self.revision.to_string()])
            .collect();
        let mut istiods: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for pod in self.pods.state() {
            let phase = (pod.status.as_ref()).and_then(|s| s.phase.as_deref());
            if matches!(phase, Some("Succeeded" | "Failed")) {
                continue;
            }
            let revision = pod.labels().get(REVISION_LABEL).cloned();
            let revision = revision.unwrap_or_else(|| crate::istio::revision::DEFAULT.into());
            let why = format!("pod {}", pod.name_any());
            istiods.entry(revision).or_default().insert(why);
        }
        for (name, holder) in &held {
            if let Some(revision) = name.strip_prefix(&format!("{GATEWAY_DEPLOYMENT}-")) {
                let why = format!("Lease {name} held by {holder}");
                istiods.entry(revision.to_string()).or_default().insert(why);
            }
        }
        inputs.istiods = (istiods.into_iter())
            .filter(|(rev, _)| !inputs.meshpilots.contains(rev))
            .map(|(rev, why)| (rev, why.into_iter().collect::<Vec<_>>().join(", ")))
            .collect();
        Some(inputs)
    }

    /// The Leases whose holder is alive, by name: holder.
    fn held_leases(&self) -> BTreeMap<String, String> {
        let leases = self.leases.state();
        let mut renewals = self.renewals.lock();
        renewals.retain(|name, _| leases.iter().any(|l| l.name_any() == *name));
        let mut held = BTreeMap::new();
        for lease in leases {
            let name = lease.name_any();
            let version = lease.resource_version();
            let seen = renewals
                .entry(name.clone())
                .or_insert_with(|| (version.clone(), Instant::now()));
            if seen.0 != version {
                *seen = (version, Instant::now());
            }
            let spec = lease.spec.clone().unwrap_or_default();
            let duration = (spec.lease_duration_seconds)
                .and_then(|s| u64::try_from(s).ok())
                .map_or(ISTIOD_LEASE_DURATION, Duration::from_secs);
            let holder = spec.holder_identity.unwrap_or_default();
            if !holder.is_empty() && seen.1.elapsed() < duration {
                held.insert(name, holder);
            }
        }
        held
    }
}

/// The meshpilot revision whose leader Lease this is (`meshpilot-leader[-<revision>]`).
fn meshpilot_of(lease: &str) -> Option<String> {
    match lease.strip_prefix(LEASE_NAME)? {
        "" => Some(crate::istio::revision::DEFAULT.into()),
        rest => rest.strip_prefix('-').map(str::to_string),
    }
}

/// The `default` tag's target, from its webhook configuration.
fn default_tag_of(webhooks: &Store<MutatingWebhookConfiguration>) -> Option<Revision> {
    let key = reflector::ObjectRef::new(DEFAULT_TAG_WEBHOOK);
    let webhook = webhooks.get(&key)?;
    webhook.labels().get(REVISION_LABEL)?.parse().ok()
}

/// Keeps a store current until aborted.
fn drain<K>(
    api: Api<K>,
    config: watcher::Config,
    writer: reflector::store::Writer<K>,
) -> JoinHandle<()>
where
    K: Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    tokio::spawn(async move {
        let kind = K::kind(&());
        let mut events = retried(watcher::watcher(api, config))
            .reflect(writer)
            .boxed();
        while let Some(event) = events.next().await {
            if let Err(e) = event {
                warn!(kind = %kind, error = %e, "revision tag watch error");
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leader_leases_name_meshpilot_revisions() {
        assert_eq!(meshpilot_of("meshpilot-leader").as_deref(), Some("default"));
        assert_eq!(
            meshpilot_of("meshpilot-leader-canary").as_deref(),
            Some("canary")
        );
        assert_eq!(meshpilot_of("meshpilot-leaderx"), None);
        assert_eq!(meshpilot_of("istio-gateway-deployment-default"), None);
    }
}
