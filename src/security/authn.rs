//! Who is calling: a verified client certificate (SPIFFE identity), or a Kubernetes service-account
//! token reviewed by the API server of the cluster the caller names in `clusterid` metadata.

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use kube::api::PostParams;
use kube::{Api, Client};
use thiserror::Error;

use super::identity::Identity;
use super::tls::SecureConnInfo;
use crate::kube_client::ClusterClients;
use crate::model::ClusterId;
use crate::text::{clip, Quoted};

/// Audience Istio's agents request for CA tokens.
pub const CA_AUDIENCE: &str = "istio-ca";

/// How long a TokenReview may take: a proxy connecting or asking for a certificate is answered
/// (refused) by then even when the cluster's API server hangs.
pub const REVIEW_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

#[derive(Debug, Error)]
pub enum AuthnError {
    #[error("no credentials: present a client certificate or a service-account token")]
    NoCredentials,
    #[error("client certificate carries no SPIFFE identity")]
    NoIdentity,
    #[error("client claims to be in cluster {}, which meshpilot does not know", Quoted(.0))]
    UnknownCluster(String),
    #[error("token review on cluster {cluster} failed: {}", clip(.reason))]
    Review { cluster: String, reason: String },
    #[error("token rejected by cluster {cluster}: {}", clip(.reason))]
    Rejected { cluster: String, reason: String },
    #[error("token of {} is not a service account's (not in group system:serviceaccounts)", Quoted(.user))]
    NotServiceAccount { user: String },
}

impl From<AuthnError> for tonic::Status {
    fn from(e: AuthnError) -> Self {
        tonic::Status::unauthenticated(e.to_string())
    }
}

/// What a caller presented, taken from a request.
#[derive(Clone, Debug, Default)]
pub struct Credentials {
    /// The connection was TLS and the client certificate verified against our root.
    pub secure: Option<SecureConnInfo>,
    pub token: Option<String>,
    pub cluster_id: Option<String>,
}

impl Credentials {
    pub fn from_request<T>(request: &tonic::Request<T>) -> Self {
        let metadata = request.metadata();
        let text = |key: &str| {
            metadata
                .get(key)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        Self {
            secure: request.extensions().get::<SecureConnInfo>().cloned(),
            token: text("authorization")
                .and_then(|v| v.strip_prefix("Bearer ").map(|t| t.trim().to_string())),
            cluster_id: text("clusterid").filter(|c| !c.is_empty()),
        }
    }
}

/// Who called: an identity, and for a pod-bound token its pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    pub identity: Identity,
    pub pod: Option<CallerPod>,
}

/// The pod a token was issued to, as the API server that reviewed it says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallerPod {
    /// The cluster whose API server reviewed the token.
    pub cluster: String,
    pub name: String,
    pub uid: String,
}

/// The `extra` keys a pod-bound service-account token carries.
const EXTRA_POD_NAME: &str = "authentication.kubernetes.io/pod-name";
const EXTRA_POD_UID: &str = "authentication.kubernetes.io/pod-uid";

pub struct Authenticator {
    trust_domain: String,
    /// The config cluster reviews tokens that name no cluster, or name it.
    clusters: ClusterClients,
}

impl Authenticator {
    pub fn new(trust_domain: &str, clusters: ClusterClients) -> Self {
        Self {
            trust_domain: trust_domain.to_string(),
            clusters,
        }
    }

    /// Istio's order: an existing client certificate first, then a service-account token.
    pub async fn authenticate(&self, credentials: &Credentials) -> Result<Identity, AuthnError> {
        Ok(self.caller(credentials).await?.identity)
    }

    /// As [`Self::authenticate`], with the pod a token is bound to.
    pub async fn caller(&self, credentials: &Credentials) -> Result<Caller, AuthnError> {
        if let Some(peer) = credentials.secure.as_ref().and_then(|s| s.peer.clone()) {
            return Ok(Caller {
                identity: peer,
                pod: None,
            });
        }
        let Some(token) = &credentials.token else {
            return Err(AuthnError::NoCredentials);
        };
        let (cluster, client) = self.client_for(credentials.cluster_id.as_deref())?;
        self.review(&cluster, client, token).await
    }

    fn client_for(&self, cluster_id: Option<&str>) -> Result<(String, Client), AuthnError> {
        let id = match cluster_id {
            Some(c) => ClusterId::new(c),
            None => self.clusters.config_cluster().cloned().unwrap_or_default(),
        };
        self.clusters
            .get(&id)
            .map(|client| (id.to_string(), client))
            .ok_or_else(|| AuthnError::UnknownCluster(cluster_id.unwrap_or_default().to_string()))
    }

    async fn review(
        &self,
        cluster: &str,
        client: Client,
        token: &str,
    ) -> Result<Caller, AuthnError> {
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: token.to_string(),
                audiences: Some(vec![CA_AUDIENCE.to_string()]),
            },
            ..Default::default()
        };
        let failed = |reason: String| AuthnError::Review {
            cluster: cluster.to_string(),
            reason,
        };
        let reviews = Api::<TokenReview>::all(client);
        let reviewed = tokio::time::timeout(
            REVIEW_DEADLINE,
            reviews.create(&PostParams::default(), &review),
        )
        .await
        .map_err(|_| failed(format!("no answer within {REVIEW_DEADLINE:?}")))?
        .map_err(|e| failed(e.to_string()))?;
        let status = reviewed.status.unwrap_or_default();
        let rejected = |reason: String| AuthnError::Rejected {
            cluster: cluster.to_string(),
            reason,
        };
        if status.authenticated != Some(true) {
            return Err(rejected(
                status.error.unwrap_or_else(|| "not authenticated".into()),
            ));
        }
        if status
            .audiences
            .as_ref()
            .is_some_and(|a| !a.is_empty() && !a.iter().any(|a| a == CA_AUDIENCE))
        {
            return Err(rejected(format!("token is not for audience {CA_AUDIENCE}")));
        }
        let user = status.user.unwrap_or_default();
        let username = user.username.unwrap_or_default();
        let groups = user.groups.unwrap_or_default();
        if !groups.iter().any(|g| g == "system:serviceaccounts") {
            return Err(AuthnError::NotServiceAccount { user: username });
        }
        let parts: Vec<&str> = username.split(':').collect();
        let identity = match parts[..] {
            ["system", "serviceaccount", namespace, account] => {
                Identity::new(&self.trust_domain, namespace, account)
            }
            _ => return Err(AuthnError::NotServiceAccount { user: username }),
        };
        let extra = user.extra.unwrap_or_default();
        let single = |key: &str| match extra.get(key).map(Vec::as_slice) {
            Some([value]) if !value.is_empty() => Some(value.clone()),
            _ => None,
        };
        let pod = match (single(EXTRA_POD_NAME), single(EXTRA_POD_UID)) {
            (Some(name), Some(uid)) => Some(CallerPod {
                cluster: cluster.to_string(),
                name,
                uid,
            }),
            _ => None,
        };
        Ok(Caller { identity, pod })
    }
}
