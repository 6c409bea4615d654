//! Leader election as client-go's leaderelection does it, in a coordination.k8s.io Lease or (for
//! istiod's cluster-wide elections, shared with istiod's revisions) a ConfigMap lock keyed by
//! revision (`lock`): the holder renews every retry period; another replica takes over once it has
//! seen no change for the lease duration (measured on its own clock, so clock skew between
//! replicas does not matter), or at once where its revision is preferred; updates carry the
//! `resourceVersion` they read, so two replicas racing cannot both win. A leader that cannot renew
//! for half the lease duration steps down before any other replica may take over. Only the work
//! one replica must do follows leadership; every replica keeps serving xDS and the CA.

mod lock;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use kube::{Api, Client};
use thiserror::Error;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::istio::Revision;
use crate::kube_error::Readable;
use crate::supervise::{OwnedTasks, Supervisor};
use lock::{LockApi, Record};

/// meshpilot's own Lease (`meshpilot-leader-<revision>` for a named revision).
pub const LEASE_NAME: &str = "meshpilot-leader";
/// istiod's cluster-wide ConfigMap locks (pilot/pkg/leaderelection/leaderelection.go): root
/// certificate ConfigMaps, allocated ServiceEntry addresses, Ingress status.
pub const NAMESPACE_CONTROLLER: &str = "istio-namespace-controller-election";
pub const IP_AUTOALLOCATE: &str = "istio-ip-autoallocate";
/// istiod's cluster-wide lock for writing Kubernetes Ingresses' status (its legacy name).
pub const INGRESS_CONTROLLER: &str = "istio-leader";
/// istiod's per-revision Leases (named `<name>-<revision>`): Gateway deployments and status.
pub const GATEWAY_DEPLOYMENT: &str = "istio-gateway-deployment";
pub const GATEWAY_STATUS: &str = "istio-gateway-status-leader";

#[derive(Debug, Error)]
#[error("{kind} {namespace}/{name}: {verb} failed: {}", Readable(.source))]
pub struct LockError {
    kind: &'static str,
    namespace: String,
    name: String,
    verb: &'static str,
    source: kube::Error,
}

/// Who competes for which lock, and for how long a holder's silence is tolerated.
#[derive(Clone, Debug)]
pub struct LeaderConfig {
    pub namespace: String,
    pub name: String,
    pub identity: String,
    pub lease_duration: Duration,
    pub lock: LockKind,
}

/// What an election is held in.
#[derive(Clone, Debug)]
pub enum LockKind {
    /// A Lease: meshpilot's own election and istiod's per-revision ones.
    Lease,
    /// A ConfigMap keyed by revision: istiod's cluster-wide elections, in which the revision the
    /// `default` tag points at (`preferred`) takes the lock from any other at once
    /// (pilot/pkg/leaderelection/leaderelection.go LocationPrioritizedComparison).
    ConfigMap {
        revision: Revision,
        preferred: watch::Receiver<Option<Revision>>,
    },
}

impl LockKind {
    fn key(&self) -> &str {
        match self {
            Self::Lease => "",
            Self::ConfigMap { revision, .. } => revision.as_str(),
        }
    }

    /// Whether a live holder of `key` yields to us: we are the default revision and it is not,
    /// or it is our revision run remotely (`^<revision>`).
    fn takes_over_from(&self, key: &str) -> bool {
        let Self::ConfigMap {
            revision,
            preferred,
        } = self
        else {
            return false;
        };
        let (holder, remote) = match key.strip_prefix('^') {
            Some(rest) => (rest, true),
            None => (key, false),
        };
        let preferred = preferred.borrow();
        match holder == revision.as_str() {
            true => remote,
            false => preferred.as_ref() == Some(revision),
        }
    }
}

impl LeaderConfig {
    /// How often the Lease is renewed or tried.
    fn retry_period(&self) -> Duration {
        self.lease_duration / 6
    }

    /// A leader that could not renew for this long steps down.
    fn renew_deadline(&self) -> Duration {
        self.lease_duration / 2
    }
}

/// A running election; dropping it stops competing (see [`Leader::release`] to hand over at once).
pub struct Leader {
    leading: watch::Receiver<bool>,
    task: OwnedTasks,
    lease: LockClient,
}

impl Leader {
    pub fn start(client: Client, config: LeaderConfig) -> Self {
        let (tx, leading) = watch::channel(false);
        let api = match config.lock {
            LockKind::Lease => LockApi::Lease(Api::namespaced(client, &config.namespace)),
            LockKind::ConfigMap { .. } => {
                LockApi::ConfigMap(Api::namespaced(client, &config.namespace))
            }
        };
        let lease = LockClient { api, config };
        let mut task = OwnedTasks::default();
        task.push(tokio::spawn(campaign(lease.clone(), tx)));
        Self {
            leading,
            task,
            lease,
        }
    }

    /// Lets the supervisor watch the campaign (a dead campaign would keep `leading` as it was).
    pub fn supervise(&mut self, supervisor: &mut Supervisor) {
        self.task.supervise(supervisor, "leader election");
    }

    /// Whether this replica leads now; `changed()` on it wakes on every change.
    pub fn leading(&self) -> watch::Receiver<bool> {
        self.leading.clone()
    }

    /// Stops competing and, if this replica holds the Lease, empties it so another replica takes
    /// over without waiting out the lease duration.
    pub async fn release(self) {
        self.task.abort();
        if let Err(e) = self.lease.release().await {
            warn!(lock = %self.lease.config.name, error = %e, "could not release the lock");
        }
    }
}

/// Tries to acquire or renew every retry period, publishing whether this replica leads.
async fn campaign(lease: LockClient, leading: watch::Sender<bool>) {
    let config = lease.config.clone();
    let mut observer = Observer::default();
    let mut renewed: Option<Instant> = None;
    loop {
        // A leader's try may last until its renew deadline, a follower's one retry period: a hung
        // API server cannot keep this replica leading past the deadline, nor stall the campaign.
        let bound = match renewed {
            Some(at) => config.renew_deadline().saturating_sub(at.elapsed()),
            None => config.retry_period(),
        };
        let attempt = tokio::time::timeout(bound, lease.acquire_or_renew(&mut observer)).await;
        let leads = match attempt {
            Ok(Ok(true)) => {
                renewed = Some(Instant::now());
                true
            }
            Ok(Ok(false)) => false,
            Ok(Err(e)) => {
                warn!(error = %e, "leader election");
                renewed.is_some_and(|at| at.elapsed() < config.renew_deadline())
            }
            Err(_) => {
                warn!(lease = %config.name, "leader election: the API server did not answer within {bound:?}");
                renewed.is_some_and(|at| at.elapsed() < config.renew_deadline())
            }
        };
        if !leads {
            renewed = None;
        }
        if *leading.borrow() != leads {
            match leads {
                true => {
                    info!(identity = %config.identity, lease = %config.name, "became the leader")
                }
                false => {
                    warn!(identity = %config.identity, lease = %config.name, "no longer the leader")
                }
            }
            leading.send_replace(leads);
        }
        // Followers spread their tries so they do not hit the API server in step.
        let period = config.retry_period();
        let wait = match leads {
            true => period,
            false => period.mul_f64(1.0 + fastrand::f64() * 0.2),
        };
        tokio::time::sleep(wait).await;
    }
}

/// The last record seen and when it was first seen: a holder is alive while its record keeps
/// changing within the lease duration.
#[derive(Default)]
struct Observer {
    record: Option<(Record, Option<String>)>,
    since: Option<Instant>,
}

impl Observer {
    /// Notes the record; returns how long it has stayed as it is.
    fn observe(&mut self, record: &Record, version: Option<String>) -> Duration {
        let seen = (record.clone(), version);
        if self.record.as_ref() != Some(&seen) {
            self.record = Some(seen);
            self.since = Some(Instant::now());
        }
        self.since.map(|at| at.elapsed()).unwrap_or_default()
    }
}

#[derive(Clone)]
struct LockClient {
    api: LockApi,
    config: LeaderConfig,
}

impl LockClient {
    fn error(&self, verb: &'static str) -> impl FnOnce(kube::Error) -> LockError + '_ {
        move |source| LockError {
            kind: self.api.plural(),
            namespace: self.config.namespace.clone(),
            name: self.config.name.clone(),
            verb,
            source,
        }
    }

    /// This replica's record as holder.
    fn mine(&self, transitions: i32) -> Record {
        Record {
            holder: self.config.identity.clone(),
            key: self.config.lock.key().to_string(),
            duration: Some(self.config.lease_duration),
            renewed: String::new(),
            transitions,
        }
    }

    /// Whether this replica holds the lock after one try.
    async fn acquire_or_renew(&self, observer: &mut Observer) -> Result<bool, LockError> {
        let name = &self.config.name;
        let me = &self.config.identity;
        let Some((record, held)) = self.api.get(name).await.map_err(self.error("get"))? else {
            return (self.api)
                .create(name, &self.config.namespace, &self.mine(0))
                .await
                .map_err(self.error("create"));
        };
        let unchanged_for = observer.observe(&record, held.version());
        let their_duration = record.duration.unwrap_or(self.config.lease_duration);
        let held_by_other = !record.holder.is_empty() && record.holder != *me;
        if held_by_other && unchanged_for < their_duration {
            if !self.config.lock.takes_over_from(&record.key) {
                debug!(holder = %record.holder, lock = %name, "the lock is held by another replica");
                return Ok(false);
            }
            info!(holder = %record.holder, revision = %record.key, lock = %name, "taking the lock over from another revision: ours is the default");
        }
        let acquired = record.holder != *me;
        if acquired {
            info!(previous = %record.holder, lock = %name, "taking over the lock");
        }
        let transitions = record.transitions + i32::from(acquired);
        // The version read above makes this fail if anyone wrote in between.
        (self.api)
            .update(name, held, &self.mine(transitions), acquired)
            .await
            .map_err(self.error("update"))
    }

    async fn release(&self) -> Result<(), LockError> {
        let name = &self.config.name;
        let Some((record, held)) = self.api.get(name).await.map_err(self.error("get"))? else {
            return Ok(());
        };
        if record.holder != self.config.identity {
            return Ok(());
        }
        let released = Record {
            holder: String::new(),
            duration: Some(Duration::from_secs(1)),
            ..record
        };
        (self.api)
            .update(name, held, &released, false)
            .await
            .map_err(self.error("update"))?;
        info!(identity = %self.config.identity, lock = %name, "released the lock");
        Ok(())
    }
}

/// Runs the work only the leader does: started when this replica becomes the leader, stopped when
/// it stops being it. Dropping the returned handle's task stops the work too.
pub fn run_while_leading<F>(mut leading: watch::Receiver<bool>, start: F) -> JoinHandle<()>
where
    F: Fn() -> Vec<JoinHandle<()>> + Send + 'static,
{
    tokio::spawn(async move {
        let mut work = Tasks::default();
        loop {
            let leads = *leading.borrow_and_update();
            match (leads, work.0.is_empty()) {
                (true, true) => work.0 = start(),
                (false, false) => work = Tasks::default(),
                _ => {}
            }
            if leading.changed().await.is_err() {
                return;
            }
        }
    })
}

/// Work that also needs one of istiod's locks, for use inside leader work: the lock is competed
/// for while the returned task runs and the work runs while it is held; aborting the task stops
/// both (the lock then expires unless renewed by someone else). While it runs, the election is
/// in `held`, so a shutdown releases the lock at once rather than leaving it to expire.
pub fn while_holding<F>(
    client: Client,
    config: LeaderConfig,
    held: &HeldLocks,
    start: F,
) -> JoinHandle<()>
where
    F: Fn() -> Vec<JoinHandle<()>> + Send + 'static,
{
    let held = held.clone();
    tokio::spawn(async move {
        let election = Leader::start(client, config);
        let _work = Tasks(vec![run_while_leading(election.leading(), start)]);
        let _registered = held.add(election);
        std::future::pending::<()>().await;
    })
}

/// The locks of istiod's that this replica competes for (under its own leadership): what a
/// shutdown hands over at once, as istiod's `ReleaseOnCancel` does.
#[derive(Clone, Default)]
pub struct HeldLocks {
    elections: Arc<Mutex<BTreeMap<u64, Leader>>>,
    next: Arc<AtomicU64>,
}

impl HeldLocks {
    /// Keeps `election` until the returned guard is dropped (which stops it).
    fn add(&self, election: Leader) -> Registered {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.elections.lock().insert(id, election);
        Registered {
            held: self.clone(),
            id,
        }
    }

    /// Stops competing for every lock and releases those this replica holds.
    pub async fn release_all(&self) {
        let elections = std::mem::take(&mut *self.elections.lock());
        for election in elections.into_values() {
            election.release().await;
        }
    }
}

/// An election kept in [`HeldLocks`] while its work runs.
struct Registered {
    held: HeldLocks,
    id: u64,
}

impl Drop for Registered {
    fn drop(&mut self) {
        // Dropping the election stops competing; the lock expires unless renewed by another.
        self.held.elections.lock().remove(&self.id);
    }
}

/// Tasks aborted when dropped, so aborting the supervisor stops its work as well.
#[derive(Default)]
struct Tasks(Vec<JoinHandle<()>>);

impl Drop for Tasks {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}

/// This replica's identity: the pod name where there is one, else host name and process id.
pub fn default_identity() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "meshpilot".into());
    format!("{host}-{}", std::process::id())
}
