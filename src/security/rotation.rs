//! The CA in use, and the self-signed root's rotation as istiod's root rotator does it: checked
//! periodically, renewed (same key and subject, new validity) once less than a grace share of its
//! lifetime is left, kept where it was kept (state directory or `istio-ca-secret`), and swapped in
//! whole. Unlike istiod, the previous root stays in the trust bundle until it expires, so proxies
//! trust both during the transition (root ConfigMaps, webhooks and every signing response's
//! roots follow the swap).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::ByteString;
use kube::api::PostParams;
use kube::Api;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use super::ca::{CaBundle, CaError, CertificateAuthority};
use super::keys::SELF_SIGNED_SECRET;
use crate::kube_error::Readable;
use crate::metrics::CaMetrics;

/// The current CA, read per use; `roots` announces each new trust bundle to its publishers.
pub struct SharedCa {
    current: ArcSwap<CertificateAuthority>,
    roots: watch::Sender<String>,
}

impl SharedCa {
    pub fn new(ca: CertificateAuthority) -> Arc<Self> {
        let (roots, _) = watch::channel(ca.root_pem().to_string());
        Arc::new(Self {
            current: ArcSwap::from_pointee(ca),
            roots,
        })
    }

    pub fn current(&self) -> Arc<CertificateAuthority> {
        self.current.load_full()
    }

    /// The trust bundle now and whenever it changes.
    pub fn roots(&self) -> watch::Receiver<String> {
        self.roots.subscribe()
    }

    fn replace(&self, ca: CertificateAuthority) {
        let roots = ca.root_pem().to_string();
        self.current.store(Arc::new(ca));
        self.roots.send_replace(roots);
    }
}

/// When the self-signed root is renewed (istiod's `CITADEL_SELF_SIGNED_ROOT_CERT_CHECK_INTERVAL`,
/// `…_GRACE_PERIOD_PERCENTILE`, `CITADEL_SELF_SIGNED_CA_CERT_TTL`).
#[derive(Clone, Copy, Debug)]
pub struct RotationPolicy {
    pub check_interval: Duration,
    pub grace_percent: u32,
    pub root_ttl: Duration,
}

/// Where the self-signed root is kept.
#[derive(Clone)]
pub enum RootStore {
    StateDir(PathBuf),
    /// `istio-ca-secret`; only the leader (or, without election, every replica) renews it, the
    /// others load what it wrote.
    Secret {
        secrets: Box<Api<Secret>>,
        leading: Option<watch::Receiver<bool>>,
    },
}

/// Checks the root every interval until the task is aborted.
pub fn keep_rotated(
    ca: Arc<SharedCa>,
    store: RootStore,
    bundle: CaBundle,
    policy: RotationPolicy,
    metrics: CaMetrics,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut rotator = Rotator {
            ca,
            store,
            bundle,
            policy,
            metrics,
        };
        let mut ticks = tokio::time::interval(policy.check_interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            if let Err(e) = rotator.check(SystemTime::now()).await {
                warn!(error = %e, "root certificate check failed; retrying at the next check");
            }
        }
    })
}

#[derive(Debug, thiserror::Error)]
enum RotationError {
    #[error(transparent)]
    Ca(#[from] CaError),
    #[error("Secret {SELF_SIGNED_SECRET}: {verb} failed: {}", Readable(.source))]
    Secret {
        verb: &'static str,
        source: kube::Error,
    },
}

struct Rotator {
    ca: Arc<SharedCa>,
    store: RootStore,
    bundle: CaBundle,
    policy: RotationPolicy,
    metrics: CaMetrics,
}

impl Rotator {
    async fn check(&mut self, now: SystemTime) -> Result<(), RotationError> {
        let stored = self.read_stored().await?;
        if let Some((bundle, _)) = stored.as_ref().filter(|(b, _)| *b != self.bundle) {
            info!("root certificate renewed by another replica; loading it");
            self.adopt(bundle.clone())?;
        }
        // A CA put into the self-signed store that is not a root is its owner's to rotate.
        if !self.may_renew() || !self.bundle.is_self_signed_root()? {
            return Ok(());
        }
        let renewed = match self.bundle.renewal_due(now, self.policy.grace_percent)? {
            true => self.bundle.renewed_root(self.policy.root_ttl, now)?,
            false => match self.bundle.without_expired_roots(now)? {
                Some(pruned) => pruned,
                None => return Ok(()),
            },
        };
        self.write(&renewed, stored.map(|(_, secret)| secret))
            .await?;
        let renewal = renewed.ca_cert != self.bundle.ca_cert;
        self.adopt(renewed)?;
        match renewal {
            true => info!("self-signed root certificate renewed; the previous root stays trusted until it expires"),
            false => info!("expired root removed from the trust bundle"),
        }
        Ok(())
    }

    fn may_renew(&self) -> bool {
        match &self.store {
            RootStore::StateDir(_) => true,
            RootStore::Secret { leading, .. } => leading.as_ref().is_none_or(|l| *l.borrow()),
        }
    }

    fn adopt(&mut self, bundle: CaBundle) -> Result<(), CaError> {
        let ca = CertificateAuthority::new(&bundle, self.ca.current().ttl())?;
        self.metrics.set_root_expiry(ca.root_not_after());
        self.ca.replace(ca);
        self.bundle = bundle;
        Ok(())
    }

    /// What the Secret holds now (the state directory has no other writer).
    async fn read_stored(&self) -> Result<Option<(CaBundle, Secret)>, RotationError> {
        let RootStore::Secret { secrets, .. } = &self.store else {
            return Ok(None);
        };
        let secret =
            secrets
                .get(SELF_SIGNED_SECRET)
                .await
                .map_err(|source| RotationError::Secret {
                    verb: "get",
                    source,
                })?;
        let bundle = super::keys::bundle_of(&secret)?;
        Ok(Some((bundle, secret)))
    }

    /// Keeps the bundle where it came from; a Secret is replaced at the version read, so a
    /// concurrent writer makes this round fail rather than be overwritten.
    async fn write(&self, bundle: &CaBundle, read: Option<Secret>) -> Result<(), RotationError> {
        match (&self.store, read) {
            (RootStore::StateDir(dir), _) => Ok(bundle.write_dir(dir)?),
            (RootStore::Secret { secrets, .. }, Some(mut secret)) => {
                let data = secret.data.get_or_insert_with(Default::default);
                for (file, text) in bundle.files() {
                    data.insert(file.to_string(), ByteString(text.as_bytes().to_vec()));
                }
                secrets
                    .replace(SELF_SIGNED_SECRET, &PostParams::default(), &secret)
                    .await
                    .map_err(|source| RotationError::Secret {
                        verb: "update",
                        source,
                    })?;
                Ok(())
            }
            (RootStore::Secret { .. }, None) => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::security::ca::TtlPolicy;

    const TTL: TtlPolicy = TtlPolicy {
        default: Duration::from_secs(3600),
        max: Duration::from_secs(7200),
    };

    #[tokio::test]
    async fn a_root_near_expiry_is_renewed_and_both_are_trusted_until_the_old_one_expires() {
        let dir = tempfile::tempdir().unwrap();
        let start = SystemTime::now();
        let old = CaBundle::self_signed_root("td", Duration::from_secs(100)).unwrap();
        let shared = SharedCa::new(CertificateAuthority::new(&old, TTL).unwrap());
        let mut roots = shared.roots();
        let policy = RotationPolicy {
            check_interval: Duration::from_secs(1),
            grace_percent: 20,
            root_ttl: Duration::from_secs(1000),
        };
        let mut rotator = Rotator {
            ca: shared.clone(),
            store: RootStore::StateDir(dir.path().to_path_buf()),
            bundle: old.clone(),
            policy,
            metrics: CaMetrics::default(),
        };
        rotator
            .check(start + Duration::from_secs(50))
            .await
            .unwrap();
        assert!(
            !roots.has_changed().unwrap(),
            "renewed with half its life left"
        );

        rotator
            .check(start + Duration::from_secs(90))
            .await
            .unwrap();
        assert!(roots.has_changed().unwrap());
        let bundle = roots.borrow_and_update().clone();
        let renewed = CaBundle::read_dir(dir.path()).unwrap();
        assert_eq!(renewed.root_cert, bundle);
        assert_eq!(renewed.ca_key, old.ca_key);
        assert_eq!(bundle.matches("BEGIN CERTIFICATE").count(), 2);
        assert!(bundle.starts_with(&renewed.ca_cert));
        assert!(bundle.ends_with(&old.ca_cert));
        assert!(
            shared.current().root_not_after()
                > CertificateAuthority::new(&old, TTL)
                    .unwrap()
                    .root_not_after()
        );

        // Once the old root has expired it leaves the bundle.
        rotator
            .check(start + Duration::from_secs(200))
            .await
            .unwrap();
        assert_eq!(roots.borrow_and_update().as_str(), renewed.ca_cert);
    }
}
