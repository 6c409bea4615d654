//! May a workload read its namespace's Secrets? Before istiod serves a gateway credential over SDS
//! it asks the API server of the proxy's cluster: a SubjectAccessReview of `list secrets` in the
//! namespace for the proxy's verified service account (pilot/pkg/credentials/kube/secrets.go,
//! `Authorize`), cached a minute, an allowance five. As istiod, the proxy's cluster answers
//! wherever the Secret is read from (pilot/pkg/credentials/kube/multicluster.go).
//!
//! Reviews are asked by the stream before it builds (`review`); building only reads the cached
//! verdicts (`verdict`), so generators never call an API server.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::PostParams;
use kube::Api;
use parking_lot::Mutex;
use tracing::warn;

use crate::kube_client::ClusterClients;
use crate::model::ClusterId;

/// How long an API server may take to answer a review.
pub const REVIEW_DEADLINE: Duration = Duration::from_secs(10);
/// How long a denial is believed (istiod's `cacheTTL`).
const DENIED_TTL: Duration = Duration::from_secs(60);
/// How long an allowance is believed (istiod: five times a denial; access need not be revoked
/// quickly).
const ALLOWED_TTL: Duration = Duration::from_secs(300);
/// How long a failed review (no answer, an error) counts as a denial before it is asked again.
/// istiod keeps it a minute; a gateway then waits a minute for its certificate after a blip.
const FAILED_TTL: Duration = Duration::from_secs(5);
/// Verdicts kept at most; a full cache drops its expired entries, then everything. Keys are
/// verified identities, so only workloads that proved who they are can fill it.
const MAX_VERDICTS: usize = 65_536;

/// Who asks about what where.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SecretReview {
    /// The cluster whose API server answers: the proxy's.
    pub cluster: ClusterId,
    pub namespace: String,
    pub service_account: String,
}

/// What is known of a review.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Allowed,
    Denied,
    /// Not asked yet, or expired: ask before building.
    Unknown,
}

/// The reviews asked, with their answers while they hold.
pub struct SecretAccess {
    clients: ClusterClients,
    /// No API server at all: clusters come from files.
    files_only: bool,
    verdicts: Mutex<HashMap<SecretReview, (bool, Instant)>>,
}

impl SecretAccess {
    pub fn new(clients: ClusterClients) -> Self {
        Self {
            files_only: clients.is_empty(),
            clients,
            verdicts: Mutex::new(HashMap::new()),
        }
    }

    /// Without any API server (clusters from files) there is no RBAC to ask: a verified proxy
    /// reads the Secrets of its own namespace, which the caller checks.
    pub fn without_api_servers(&self) -> bool {
        self.files_only
    }

    pub fn verdict(&self, review: &SecretReview) -> Verdict {
        if self.without_api_servers() {
            return Verdict::Allowed;
        }
        match self.verdicts.lock().get(review) {
            Some((allowed, until)) if *until > Instant::now() => match allowed {
                true => Verdict::Allowed,
                false => Verdict::Denied,
            },
            _ => Verdict::Unknown,
        }
    }

    /// Asks the cluster's API server (under a deadline) and remembers the answer. A cluster
    /// meshpilot has no client for denies.
    pub async fn review(&self, review: SecretReview) {
        let (allowed, ttl) = match self.ask(&review).await {
            Ok(true) => (true, ALLOWED_TTL),
            Ok(false) => (false, DENIED_TTL),
            Err(reason) => {
                warn!(cluster = %review.cluster, namespace = review.namespace, service_account = review.service_account, reason, "secret access review failed; denied for now");
                (false, FAILED_TTL)
            }
        };
        let now = Instant::now();
        let mut verdicts = self.verdicts.lock();
        if verdicts.len() >= MAX_VERDICTS {
            verdicts.retain(|_, (_, until)| *until > now);
            if verdicts.len() >= MAX_VERDICTS {
                verdicts.clear();
            }
        }
        verdicts.insert(review, (allowed, now + ttl));
    }

    async fn ask(&self, review: &SecretReview) -> Result<bool, String> {
        let client = self
            .clients
            .get(&review.cluster)
            .ok_or_else(|| format!("no API server for cluster {}", review.cluster))?;
        let request = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: Some(format!(
                    "system:serviceaccount:{}:{}",
                    review.namespace, review.service_account
                )),
                resource_attributes: Some(ResourceAttributes {
                    namespace: Some(review.namespace.clone()),
                    verb: Some("list".into()),
                    resource: Some("secrets".into()),
                    ..Default::default()
                }),
                ..Default::default()
            },
            ..Default::default()
        };
        let reviews = Api::<SubjectAccessReview>::all(client);
        let answered = tokio::time::timeout(
            REVIEW_DEADLINE,
            reviews.create(&PostParams::default(), &request),
        )
        .await
        .map_err(|_| format!("no answer within {REVIEW_DEADLINE:?}"))?
        .map_err(|e| crate::text::clip(&e.to_string()))?;
        Ok(answered.status.is_some_and(|s| s.allowed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn review(account: &str) -> SecretReview {
        SecretReview {
            cluster: ClusterId::new("c1"),
            namespace: "shop".into(),
            service_account: account.into(),
        }
    }

    #[test]
    fn without_api_servers_the_namespace_rule_applies() {
        let access = SecretAccess::new(ClusterClients::default());
        assert_eq!(access.verdict(&review("web")), Verdict::Allowed);
    }

    #[test]
    fn verdicts_hold_until_they_expire() {
        let access = SecretAccess {
            clients: ClusterClients::default(),
            files_only: false,
            verdicts: Mutex::new(HashMap::new()),
        };
        assert_eq!(access.verdict(&review("gw")), Verdict::Unknown);
        let now = Instant::now();
        let later = now + Duration::from_secs(60);
        access.verdicts.lock().insert(review("gw"), (true, later));
        access.verdicts.lock().insert(review("web"), (false, later));
        access.verdicts.lock().insert(review("old"), (true, now));
        assert_eq!(access.verdict(&review("gw")), Verdict::Allowed);
        assert_eq!(access.verdict(&review("web")), Verdict::Denied);
        assert_eq!(access.verdict(&review("old")), Verdict::Unknown);
    }

    #[tokio::test]
    async fn a_cluster_without_a_client_denies_for_a_moment() {
        let access = SecretAccess {
            clients: ClusterClients::default(),
            files_only: false,
            verdicts: Mutex::new(HashMap::new()),
        };
        access.review(review("gw")).await;
        assert_eq!(access.verdict(&review("gw")), Verdict::Denied);
        let until = access.verdicts.lock()[&review("gw")].1;
        assert!(until <= Instant::now() + FAILED_TTL);
    }
}
