//! istiod's side of a cluster-wide election, stood in: istiod of one revision competing for one
//! of its ConfigMap locks as istio's fork of client-go does (istio/istio
//! pilot/pkg/leaderelection/k8sleaderelection/leaderelection.go `tryAcquireOrRenew`, and
//! k8sresourcelock/configmaplock.go): the record is JSON in the ConfigMap's annotation
//! `control-plane.alpha.kubernetes.io/leader` (`holderIdentity`, `holderKey` = its revision,
//! `leaseDurationSeconds`, `acquireTime`, `renewTime`, `leaderTransitions`); a held record is
//! live while it changes within the lease duration, as observed on the competitor's own clock; a
//! live holder is taken over only when `LocationPrioritizedComparison`
//! (pilot/pkg/leaderelection/leaderelection.go) says so: we are the revision the `default` tag
//! points at (`istio-revision-tag-default`'s `istio.io/rev`, pkg/revisions/default_watcher.go) and
//! the holder is not. Tries every quarter of the lease duration (`RetryPeriod: ttl / 4`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::PostParams;
use kube::{Api, ResourceExt};
use serde_json::{json, Value};
use test_apiserver::{TestApiServer, User};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::istiod_gateways::client_as;

const NAMESPACE: &str = "istio-system";
const RECORD: &str = "control-plane.alpha.kubernetes.io/leader";
/// The most one try may take.
const TRY_DEADLINE: Duration = Duration::from_secs(5);

/// istiod's election for one ConfigMap lock, running until stopped.
pub struct IstiodLock {
    leading: watch::Receiver<bool>,
    /// Successful renewals while leading.
    renewals: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl IstiodLock {
    /// istiod `revision` in pod `pod` competing for lock `name` with lease `ttl`.
    pub async fn start(
        api: &TestApiServer,
        revision: &str,
        pod: &str,
        name: &str,
        ttl: Duration,
    ) -> Self {
        let user = User::service_account(NAMESPACE, "istiod");
        let client = client_as(api, &format!("token-lock-{pod}"), user).await;
        let (tx, leading) = watch::channel(false);
        let renewals = Arc::new(AtomicUsize::new(0));
        let mut elector = Elector {
            maps: Api::namespaced(client.clone(), NAMESPACE),
            webhooks: Api::all(client),
            name: name.into(),
            identity: pod.into(),
            revision: revision.into(),
            ttl,
            observed: None,
        };
        let counted = renewals.clone();
        let task = tokio::spawn(async move {
            loop {
                let try_once = tokio::time::timeout(TRY_DEADLINE, elector.try_acquire_or_renew());
                let leads = matches!(try_once.await, Ok(true));
                if leads {
                    counted.fetch_add(1, Ordering::SeqCst);
                }
                tx.send_replace(leads);
                tokio::time::sleep(ttl / 4).await;
            }
        });
        Self {
            leading,
            renewals,
            task,
        }
    }

    /// Waits until it leads.
    pub async fn led(&self) {
        let mut leading = self.leading.clone();
        tokio::time::timeout(Duration::from_secs(10), leading.wait_for(|l| *l))
            .await
            .expect("istiod takes its lock")
            .unwrap();
    }

    pub fn leading(&self) -> bool {
        *self.leading.borrow()
    }

    /// How many times it has written its record as leader.
    pub fn renewals(&self) -> usize {
        self.renewals.load(Ordering::SeqCst)
    }

    pub fn stop(self) {
        self.task.abort();
    }
}

struct Elector {
    maps: Api<ConfigMap>,
    webhooks: Api<MutatingWebhookConfiguration>,
    name: String,
    identity: String,
    revision: String,
    ttl: Duration,
    /// The raw record last read, the record it held, and when it was first read (our clock).
    observed: Option<(String, Value, Instant)>,
}

impl Elector {
    fn record(&self, now: &str, acquired: &str, transitions: i64) -> String {
        json!({
            "holderIdentity": self.identity, "holderKey": self.revision,
            "leaseDurationSeconds": self.ttl.as_secs(),
            "acquireTime": acquired, "renewTime": now, "leaderTransitions": transitions,
        })
        .to_string()
    }

    fn is_leader(&self) -> bool {
        (self.observed.as_ref()).is_some_and(|(_, r, _)| r["holderIdentity"] == *self.identity)
    }

    /// `LocationPrioritizedComparison` for a local istiod: take over a live holder only as the
    /// default tag's revision, from another revision.
    async fn takes_over_from(&self, holder_key: &str) -> bool {
        let tag = self.webhooks.get_opt("istio-revision-tag-default").await;
        let default_revision = (tag.ok().flatten())
            .and_then(|w| w.labels().get("istio.io/rev").cloned())
            .unwrap_or_default();
        let holder = holder_key.trim_start_matches('^');
        (self.revision != holder
            && !default_revision.is_empty()
            && default_revision == self.revision)
            || (self.revision == holder && holder_key.starts_with('^'))
    }

    async fn try_acquire_or_renew(&mut self) -> bool {
        let now = humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string();
        let Ok(current) = self.maps.get_opt(&self.name).await else {
            return false;
        };
        let Some(mut map) = current else {
            let record = self.record(&now, &now, 0);
            let map: ConfigMap = serde_json::from_value(json!({
                "metadata": {"name": self.name, "namespace": NAMESPACE,
                             "annotations": {RECORD: record}},
            }))
            .unwrap();
            let created = self.maps.create(&PostParams::default(), &map).await.is_ok();
            if created {
                let held = serde_json::from_str(&record).unwrap();
                self.observed = Some((record, held, Instant::now()));
            }
            return created;
        };
        let raw = (map.annotations().get(RECORD).cloned()).unwrap_or_default();
        let old: Value = serde_json::from_str(&raw).unwrap_or_else(|_| json!({}));
        if self
            .observed
            .as_ref()
            .is_none_or(|(seen, _, _)| *seen != raw)
        {
            self.observed = Some((raw.clone(), old.clone(), Instant::now()));
        }
        let observed_at = self.observed.as_ref().map(|(_, _, at)| *at);
        let holder = old["holderIdentity"].as_str().unwrap_or_default();
        let live = observed_at.is_some_and(|at| at.elapsed() < self.ttl);
        if !holder.is_empty() && live && !self.is_leader() {
            let key = old["holderKey"].as_str().unwrap_or_default();
            if !self.takes_over_from(key).await {
                return false;
            }
        }
        let transitions = old["leaderTransitions"].as_i64().unwrap_or(0);
        let record = match self.is_leader() {
            true => {
                let acquired = old["acquireTime"].as_str().unwrap_or(&now).to_string();
                self.record(&now, &acquired, transitions)
            }
            false => self.record(&now, &now, transitions + 1),
        };
        map.annotations_mut().insert(RECORD.into(), record.clone());
        let updated = self
            .maps
            .replace(&self.name, &PostParams::default(), &map)
            .await;
        if updated.is_err() {
            return false;
        }
        let held = serde_json::from_str(&record).unwrap();
        self.observed = Some((record, held, Instant::now()));
        true
    }
}
