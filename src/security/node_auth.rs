//! Certificates for node proxies: a ztunnel asks for the certificates of the pods on its node by
//! naming the identity it wants (`ImpersonatedIdentity`). Allowed, as istiod's node authorizer
//! (security/pkg/server/ca/node_auth.go), only for callers whose service account is a trusted node
//! account (`CA_TRUSTED_NODE_ACCOUNTS`), whose token is bound to a pod that still exists as that
//! account, and for an identity some pod on that pod's node runs as. Unlike istiod, the identity
//! must be of the mesh's trust domain, and a refusal says why (to an authenticated caller).

use std::collections::BTreeSet;
use std::sync::Arc;

use thiserror::Error;

use super::authn::Caller;
use super::identity::Identity;
use crate::text::Quoted;

/// The metadata key of a certificate request naming the identity wanted.
pub const IMPERSONATED_IDENTITY: &str = "ImpersonatedIdentity";

/// What the CA needs to know of a cluster's pods.
pub trait PodDirectory: Send + Sync {
    /// The pod, if the cluster has it.
    fn pod(&self, cluster: &str, namespace: &str, name: &str) -> Option<PodFacts>;
    /// Whether some pod of `namespace` running as `service_account` is scheduled on `node`.
    fn runs_on_node(
        &self,
        cluster: &str,
        namespace: &str,
        service_account: &str,
        node: &str,
    ) -> bool;
}

/// What a pod's existence proves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodFacts {
    /// The API server's uid (None: unknown, as in file clusters).
    pub uid: Option<String>,
    pub service_account: String,
    pub node: Option<String>,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum ImpersonationError {
    #[error("no node accounts are trusted to ask for other identities (CA_TRUSTED_NODE_ACCOUNTS)")]
    NotConfigured,
    #[error("{caller} is not a trusted node account")]
    Untrusted { caller: String },
    #[error("the impersonated identity {} is not a SPIFFE identity of trust domain {}", Quoted(.requested), Quoted(.trust_domain))]
    BadIdentity {
        requested: String,
        trust_domain: String,
    },
    #[error("the caller's token is not bound to a pod")]
    NoPod,
    #[error("the caller's pod {namespace}/{name} is not known in cluster {}", Quoted(.cluster))]
    PodUnknown {
        cluster: String,
        namespace: String,
        name: String,
    },
    #[error("the caller's pod {namespace}/{name} is not the one its token was issued to")]
    PodReplaced { namespace: String, name: String },
    #[error("the caller's pod {namespace}/{name} does not run as its token's service account")]
    AccountMismatch { namespace: String, name: String },
    #[error("the caller's pod {namespace}/{name} is on no node")]
    NoNode { namespace: String, name: String },
    #[error("no pod of {namespace}/{service_account} is on node {}", Quoted(.node))]
    NotOnNode {
        namespace: String,
        service_account: String,
        node: String,
    },
}

/// `namespace/serviceaccount` entries of `CA_TRUSTED_NODE_ACCOUNTS`, as istiod reads them.
pub fn parse_trusted_accounts(text: &str) -> Result<BTreeSet<(String, String)>, String> {
    let entries = text.split(',').map(str::trim).filter(|e| !e.is_empty());
    entries
        .map(|entry| match entry.split_once('/') {
            Some((ns, sa)) if !ns.is_empty() && !sa.is_empty() && !sa.contains('/') => {
                Ok((ns.to_string(), sa.to_string()))
            }
            _ => Err(format!(
                "{} is not <namespace>/<serviceaccount>",
                Quoted(entry)
            )),
        })
        .collect()
}

pub struct NodeAuthorizer {
    trusted: BTreeSet<(String, String)>,
    pods: Arc<dyn PodDirectory>,
    trust_domain: String,
}

impl NodeAuthorizer {
    pub fn new(
        trusted: BTreeSet<(String, String)>,
        pods: Arc<dyn PodDirectory>,
        trust_domain: &str,
    ) -> Self {
        Self {
            trusted,
            pods,
            trust_domain: trust_domain.to_string(),
        }
    }

    /// The identity the caller may have a certificate for, in istiod's order of checks.
    pub fn authorize(
        &self,
        caller: &Caller,
        requested: &str,
    ) -> Result<Identity, ImpersonationError> {
        let me = &caller.identity;
        if self.trusted.is_empty() {
            return Err(ImpersonationError::NotConfigured);
        }
        if !self
            .trusted
            .contains(&(me.namespace.clone(), me.service_account.clone()))
        {
            return Err(ImpersonationError::Untrusted {
                caller: format!("{}/{}", me.namespace, me.service_account),
            });
        }
        let wanted = Identity::parse(requested)
            .filter(|id| id.trust_domain == self.trust_domain)
            .ok_or_else(|| ImpersonationError::BadIdentity {
                requested: crate::text::clip(requested).to_string(),
                trust_domain: self.trust_domain.clone(),
            })?;
        let pod = caller.pod.as_ref().ok_or(ImpersonationError::NoPod)?;
        let names = || (me.namespace.clone(), pod.name.clone());
        let facts = self
            .pods
            .pod(&pod.cluster, &me.namespace, &pod.name)
            .ok_or_else(|| {
                let (namespace, name) = names();
                ImpersonationError::PodUnknown {
                    cluster: pod.cluster.clone(),
                    namespace,
                    name,
                }
            })?;
        if facts.uid.as_deref() != Some(pod.uid.as_str()) {
            let (namespace, name) = names();
            return Err(ImpersonationError::PodReplaced { namespace, name });
        }
        if facts.service_account != me.service_account {
            let (namespace, name) = names();
            return Err(ImpersonationError::AccountMismatch { namespace, name });
        }
        let node = facts.node.ok_or_else(|| {
            let (namespace, name) = names();
            ImpersonationError::NoNode { namespace, name }
        })?;
        if !self.pods.runs_on_node(
            &pod.cluster,
            &wanted.namespace,
            &wanted.service_account,
            &node,
        ) {
            return Err(ImpersonationError::NotOnNode {
                namespace: wanted.namespace,
                service_account: wanted.service_account,
                node,
            });
        }
        Ok(wanted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::security::authn::CallerPod;

    struct Pods;

    impl PodDirectory for Pods {
        fn pod(&self, cluster: &str, namespace: &str, name: &str) -> Option<PodFacts> {
            (cluster, namespace, name)
                .eq(&("c1", "istio-system", "ztunnel-1"))
                .then(|| PodFacts {
                    uid: Some("u1".into()),
                    service_account: "ztunnel".into(),
                    node: Some("n1".into()),
                })
        }

        fn runs_on_node(&self, cluster: &str, ns: &str, sa: &str, node: &str) -> bool {
            (cluster, ns, sa, node) == ("c1", "shop", "web", "n1")
        }
    }

    fn caller(sa: &str, pod: Option<(&str, &str)>) -> Caller {
        Caller {
            identity: Identity::new("cluster.local", "istio-system", sa),
            pod: pod.map(|(name, uid)| CallerPod {
                cluster: "c1".into(),
                name: name.into(),
                uid: uid.into(),
            }),
        }
    }

    #[test]
    fn a_trusted_node_account_gets_identities_of_its_node_only() {
        let trusted = parse_trusted_accounts("istio-system/ztunnel, ,").unwrap();
        let auth = NodeAuthorizer::new(trusted, Arc::new(Pods), "cluster.local");
        let web = "spiffe://cluster.local/ns/shop/sa/web";
        let ztunnel = caller("ztunnel", Some(("ztunnel-1", "u1")));
        assert_eq!(
            auth.authorize(&ztunnel, web),
            Ok(Identity::new("cluster.local", "shop", "web"))
        );
        let elsewhere = auth.authorize(&ztunnel, "spiffe://cluster.local/ns/shop/sa/db");
        assert!(matches!(
            elsewhere,
            Err(ImpersonationError::NotOnNode { .. })
        ));
        let foreign = auth.authorize(&ztunnel, "spiffe://other.td/ns/shop/sa/web");
        assert!(matches!(
            foreign,
            Err(ImpersonationError::BadIdentity { .. })
        ));
        let untrusted = auth.authorize(&caller("web", Some(("ztunnel-1", "u1"))), web);
        assert!(matches!(
            untrusted,
            Err(ImpersonationError::Untrusted { .. })
        ));
        let replaced = auth.authorize(&caller("ztunnel", Some(("ztunnel-1", "u0"))), web);
        assert!(matches!(
            replaced,
            Err(ImpersonationError::PodReplaced { .. })
        ));
        let unbound = auth.authorize(&caller("ztunnel", None), web);
        assert_eq!(unbound, Err(ImpersonationError::NoPod));
        let gone = auth.authorize(&caller("ztunnel", Some(("ztunnel-2", "u1"))), web);
        assert!(matches!(gone, Err(ImpersonationError::PodUnknown { .. })));
        let none = NodeAuthorizer::new(BTreeSet::new(), Arc::new(Pods), "cluster.local");
        assert_eq!(
            none.authorize(&ztunnel, web),
            Err(ImpersonationError::NotConfigured)
        );
    }

    #[test]
    fn trusted_accounts_are_namespace_slash_account() {
        assert!(parse_trusted_accounts("").unwrap().is_empty());
        assert!(parse_trusted_accounts("ztunnel").is_err());
        assert!(parse_trusted_accounts("a/b/c").is_err());
        assert_eq!(parse_trusted_accounts("a/b,c/d").unwrap().len(), 2);
    }
}
