//! Which revision owns what, as istiod's tag watcher reads it (istio/istio
//! pkg/revisions/tag_watcher.go, default_watcher.go): the tags pointing at each revision
//! (webhook configurations and Services labelled `istio.io/tag`), the `default` tag's target
//! (`istio-revision-tag-default`), the default revision (`istiod-default-validator`'s label) and
//! namespaces' `istio.io/rev` labels. Watched on the config cluster into reflector stores, read
//! where a decision is made.

use std::collections::BTreeMap;
use std::collections::BTreeSet;

use futures::StreamExt;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::core::v1::{Namespace, Service};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client, Resource, ResourceExt};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::istio::revision::{DEFAULT, REVISION_LABEL, TAG_LABEL};
use crate::istio::Revision;
use crate::kube_client::retried;

/// The `default` tag's webhook configuration (its name has no namespace suffix in istiod's
/// tag watcher).
pub const DEFAULT_TAG_WEBHOOK: &str = "istio-revision-tag-default";
/// The validator that names the default revision.
pub const DEFAULT_VALIDATOR: &str = "istiod-default-validator";

/// The config cluster's tags and revision labels, kept current.
#[derive(Clone)]
pub struct RevisionTags {
    revision: Revision,
    webhooks: Store<MutatingWebhookConfiguration>,
    validators: Store<ValidatingWebhookConfiguration>,
    services: Store<Service>,
    namespaces: Store<Namespace>,
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
        let (default_tx, default_tag) = watch::channel(None);
        let store = webhooks.clone();
        let webhook_api: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
        let webhook_events = retried(watcher::watcher(webhook_api, tagged.clone()))
            .reflect(webhook_writer)
            .touched_objects();
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
                Api::<Namespace>::all(client),
                watcher::Config::default().labels(REVISION_LABEL),
                namespace_writer,
            ),
        ];
        let tags = Self {
            revision,
            webhooks,
            validators,
            services,
            namespaces,
            default_tag,
        };
        (tags, tasks)
    }

    /// The revision the `default` tag points at, now and as it changes (istiod's leader
    /// elections prefer it).
    pub fn default_tag(&self) -> watch::Receiver<Option<Revision>> {
        self.default_tag.clone()
    }

    /// Our revision's name and every tag pointing at it.
    pub fn my_tags(&self) -> BTreeSet<String> {
        let ours = |labels: &BTreeMap<String, String>| {
            (labels.get(REVISION_LABEL).map(String::as_str) == Some(self.revision.as_str()))
                .then(|| labels.get(TAG_LABEL).cloned())
                .flatten()
        };
        let mut tags: BTreeSet<String> = (self.webhooks.state().iter())
            .filter_map(|w| ours(w.labels()))
            .chain(
                self.services
                    .state()
                    .iter()
                    .filter_map(|s| ours(s.labels())),
            )
            .collect();
        tags.insert(self.revision.to_string());
        tags
    }

    /// Whether an object (a Gateway API object) is this revision's to act on, as istiod's
    /// `IsMine`: the revision or tag named on the object, else on its namespace. An object naming
    /// none (or `default`) belongs to the revision the `default` tag points at, else to the
    /// default revision — one owner, where istiod lets both the unrevisioned istiod and the tag's
    /// target claim it (istio/istio issue 54280). A cluster-scoped object naming none is
    /// everyone's, as in istiod (no namespace to ask).
    pub fn owns(&self, labels: &BTreeMap<String, String>, namespace: &str) -> bool {
        let selected = match labels.get(REVISION_LABEL) {
            Some(rev) => rev.clone(),
            None if namespace.is_empty() => return true,
            None => self.namespace_revision(namespace),
        };
        match selected.is_empty() || selected == DEFAULT {
            true => match default_tag_of(&self.webhooks) {
                Some(target) => target == self.revision,
                None => self.is_default_revision(),
            },
            false => self.my_tags().contains(&selected),
        }
    }

    /// A digest of everything [`Self::owns`] reads: work done per owned object is redone when
    /// it changes (a tag moved, a namespace relabelled), not only when config does.
    pub fn fingerprint(&self) -> u64 {
        let namespaces: BTreeMap<String, String> = (self.namespaces.state().iter())
            .map(|ns| (ns.name_any(), self.namespace_revision(&ns.name_any())))
            .collect();
        let state = format!(
            "{:?}{:?}{}{namespaces:?}",
            self.my_tags(),
            default_tag_of(&self.webhooks),
            self.is_default_revision()
        );
        crate::text::stable_hash(&state)
    }

    fn namespace_revision(&self, namespace: &str) -> String {
        let key = reflector::ObjectRef::new(namespace);
        (self.namespaces.get(&key))
            .and_then(|ns| ns.labels().get(REVISION_LABEL).cloned())
            .unwrap_or_default()
    }

    /// Whether `istiod-default-validator` names this revision. Without one (meshpilot's own
    /// installs render none), the `default` revision is the default, as an unrevisioned
    /// istiod's installation would make it.
    fn is_default_revision(&self) -> bool {
        let key = reflector::ObjectRef::new(DEFAULT_VALIDATOR);
        match self.validators.get(&key) {
            Some(validator) => {
                validator.labels().get(REVISION_LABEL).map(String::as_str)
                    == Some(self.revision.as_str())
            }
            None => self.revision.is_default(),
        }
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
