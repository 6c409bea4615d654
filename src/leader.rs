//! Leader election with a coordination.k8s.io Lease, as client-go's leaderelection does it: the
//! holder renews the Lease every retry period; another replica takes it over once it has seen no
//! change to it for the lease duration (measured on its own clock, so clock skew between replicas
//! does not matter); updates carry the `resourceVersion` they read, so two replicas racing for it
//! cannot both win. A leader that cannot renew for half the lease duration steps down before any
//! other replica may take over. Only the work one replica must do follows leadership
//! ([`LeaderWork`]); every replica keeps serving xDS and the CA.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::PostParams;
use kube::{Api, Client};
use thiserror::Error;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::kube_error::Readable;
use crate::supervise::{OwnedTasks, Supervisor};

pub const LEASE_NAME: &str = "meshpilot-leader";

#[derive(Debug, Error)]
#[error("Lease {namespace}/{name}: {verb} failed: {}", Readable(.source))]
pub struct LeaseError {
    namespace: String,
    name: String,
    verb: &'static str,
    source: kube::Error,
}

/// Who competes for which Lease, and for how long a holder's silence is tolerated.
#[derive(Clone, Debug)]
pub struct LeaderConfig {
    pub namespace: String,
    pub name: String,
    pub identity: String,
    pub lease_duration: Duration,
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
    lease: LeaseClient,
}

impl Leader {
    pub fn start(client: Client, config: LeaderConfig) -> Self {
        let (tx, leading) = watch::channel(false);
        let lease = LeaseClient {
            api: Api::namespaced(client, &config.namespace),
            config,
        };
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
            warn!(error = %e, "could not release the leader Lease");
        }
    }
}

/// Tries to acquire or renew every retry period, publishing whether this replica leads.
async fn campaign(lease: LeaseClient, leading: watch::Sender<bool>) {
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

/// The last Lease record seen and when it was first seen: a holder is alive while its record keeps
/// changing within the lease duration.
#[derive(Default)]
struct Observer {
    record: Option<(String, Option<MicroTime>, Option<String>)>,
    since: Option<Instant>,
}

impl Observer {
    /// Notes the record; returns how long it has stayed as it is.
    fn observe(&mut self, lease: &Lease) -> Duration {
        let spec = lease.spec.clone().unwrap_or_default();
        let record = (
            spec.holder_identity.unwrap_or_default(),
            spec.renew_time,
            lease.metadata.resource_version.clone(),
        );
        if self.record.as_ref() != Some(&record) {
            self.record = Some(record);
            self.since = Some(Instant::now());
        }
        self.since.map(|at| at.elapsed()).unwrap_or_default()
    }
}

#[derive(Clone)]
struct LeaseClient {
    api: Api<Lease>,
    config: LeaderConfig,
}

impl LeaseClient {
    fn error(&self, verb: &'static str) -> impl FnOnce(kube::Error) -> LeaseError + '_ {
        move |source| LeaseError {
            namespace: self.config.namespace.clone(),
            name: self.config.name.clone(),
            verb,
            source,
        }
    }

    /// Whether this replica holds the Lease after one try.
    async fn acquire_or_renew(&self, observer: &mut Observer) -> Result<bool, LeaseError> {
        let me = &self.config.identity;
        let now = MicroTime(Timestamp::now());
        let seconds =
            i32::try_from(self.config.lease_duration.as_secs().max(1)).unwrap_or(i32::MAX);
        let Some(mut lease) = self
            .api
            .get_opt(&self.config.name)
            .await
            .map_err(self.error("get"))?
        else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.config.name.clone()),
                    namespace: Some(self.config.namespace.clone()),
                    ..Default::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(me.clone()),
                    lease_duration_seconds: Some(seconds),
                    acquire_time: Some(now.clone()),
                    renew_time: Some(now),
                    lease_transitions: Some(0),
                    ..Default::default()
                }),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(status)) if status.is_already_exists() => Ok(false),
                Err(e) => Err(self.error("create")(e)),
            };
        };
        let unchanged_for = observer.observe(&lease);
        let mut spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().unwrap_or_default();
        let their_duration = spec
            .lease_duration_seconds
            .and_then(|s| u64::try_from(s).ok())
            .map(Duration::from_secs)
            .unwrap_or(self.config.lease_duration);
        if !holder.is_empty() && holder != *me && unchanged_for < their_duration {
            debug!(%holder, "the Lease is held by another replica");
            return Ok(false);
        }
        if holder != *me {
            info!(previous = %holder, "taking over the leader Lease");
            spec.acquire_time = Some(now.clone());
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        }
        spec.holder_identity = Some(me.clone());
        spec.lease_duration_seconds = Some(seconds);
        spec.renew_time = Some(now);
        lease.spec = Some(spec);
        // The resourceVersion read above makes this fail if anyone wrote in between.
        match self
            .api
            .replace(&self.config.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
            Err(e) => Err(self.error("update")(e)),
        }
    }

    async fn release(&self) -> Result<(), LeaseError> {
        let Some(mut lease) = self
            .api
            .get_opt(&self.config.name)
            .await
            .map_err(self.error("get"))?
        else {
            return Ok(());
        };
        let mut spec = lease.spec.clone().unwrap_or_default();
        if spec.holder_identity.as_deref() != Some(self.config.identity.as_str()) {
            return Ok(());
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(MicroTime(Timestamp::now()));
        lease.spec = Some(spec);
        self.api
            .replace(&self.config.name, &PostParams::default(), &lease)
            .await
            .map_err(self.error("update"))?;
        info!(identity = %self.config.identity, "released the leader Lease");
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
