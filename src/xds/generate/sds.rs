//! SDS over ADS: the TLS Secrets gateways name by `credentialName`, authorized as istiod's
//! `filterAuthorizedResources` (pilot/pkg/xds/sds.go) over the references `mergeGateways`
//! verifies (pilot/pkg/model/gateway.go), names parsed as pilot/pkg/model/credentials/resource.go:
//!
//! - `kubernetes://[<namespace>/]<name>` (and a `credentialName` without a prefix): a Secret of
//!   the proxy's own verified namespace, never another, whatever references it; read from the
//!   proxy's cluster, else meshpilot's. Its CA bundle (`<name>-cacert`) is public and served as
//!   is; its key only when the proxy's service account may `list secrets` in the namespace, as
//!   the API server of the *proxy's* cluster answers a SubjectAccessReview
//!   (`security/secret_access`; pilot/pkg/credentials/kube/multicluster.go: "Authorization will
//!   always use the proxy cluster"). Without any API server (clusters from files) there is no
//!   RBAC to ask and the namespace rule alone applies.
//! - `kubernetes-gateway://<namespace>/<name>`: served only to a router that a Gateway of its own
//!   namespace selects, whose server names it (its `-cacert` too for MUTUAL servers), and only
//!   when the Secret is in that namespace or a ReferenceGrant there lets Gateways of the proxy's
//!   namespace use it. Read from the config cluster (in file mode, as above).
//!
//! Only a proxy that proved its identity on the secure port gets any; anything refused is answered
//! as not existing.

use std::sync::Arc;

use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::{data_source, DataSource};
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    secret, CertificateValidationContext, Secret, TlsCertificate,
};
use tracing::warn;

use super::generation::Generation;
use crate::istio::gateway::ServerTlsMode;
use crate::model::credentials::{GATEWAY_PREFIX, KUBERNETES_PREFIX};
use crate::model::{ClusterId, CREDENTIAL_CA_SUFFIX};
use crate::security::secret_access::{SecretReview, Verdict};
use crate::xds::wire::Resource;

/// The SDS name of a `credentialName` (its CA bundle with `ca`): kept as written when it names
/// its type, else a `kubernetes://` name (istiod's `ToResourceName`).
pub fn resource_name(credential: &str, ca: bool) -> String {
    let suffix = if ca { CREDENTIAL_CA_SUFFIX } else { "" };
    if credential.starts_with(KUBERNETES_PREFIX) || credential.starts_with(GATEWAY_PREFIX) {
        return format!("{credential}{suffix}");
    }
    format!("{KUBERNETES_PREFIX}{credential}{suffix}")
}

/// A Secret an SDS name refers to.
#[derive(Debug, PartialEq, Eq)]
struct Reference<'n> {
    /// Named by a Gateway API listener (`kubernetes-gateway://`).
    gateway: bool,
    namespace: &'n str,
    name: &'n str,
}

impl Reference<'_> {
    fn ca_only(&self) -> bool {
        self.name.ends_with(CREDENTIAL_CA_SUFFIX)
    }
}

/// `kubernetes://[<namespace>/]<name>` (the namespace defaulting to the proxy's) or
/// `kubernetes-gateway://<namespace>/<name>`.
fn parse<'n>(name: &'n str, proxy_namespace: &'n str) -> Option<Reference<'n>> {
    let (gateway, namespace, secret) = match name.strip_prefix(GATEWAY_PREFIX) {
        Some(rest) => {
            let (namespace, secret) = rest.split_once('/')?;
            (true, namespace, secret)
        }
        None => {
            let rest = name.strip_prefix(KUBERNETES_PREFIX)?;
            let (namespace, secret) = rest.split_once('/').unwrap_or((proxy_namespace, rest));
            (false, namespace, secret)
        }
    };
    (!namespace.is_empty() && !secret.is_empty() && !secret.contains('/')).then_some(Reference {
        gateway,
        namespace,
        name: secret,
    })
}

impl Generation<'_> {
    /// Where a referenced Secret is looked up, in order: a Gateway API listener's in the config
    /// cluster, which holds its Gateway and grants (in file mode, as any other: there is no
    /// config cluster, the Gateway is in `config/` and its Secret in some cluster's files).
    fn secret_clusters(&self, reference: &Reference<'_>) -> Vec<&ClusterId> {
        let credentials = &self.mesh.credentials;
        let files_only = self.secret_access.is_some_and(|a| a.without_api_servers());
        match reference.gateway && !files_only {
            true => vec![credentials.local()],
            false => credentials.search_order(self.cluster()),
        }
    }

    /// The review that decides whether this proxy may read a `kubernetes://` Secret's key, where
    /// one does: a Secret of its own namespace, with a key, that exists. The proxy's cluster
    /// answers it (meshpilot's when the proxy names none), wherever the Secret is read from.
    fn secret_review(&self, reference: &Reference<'_>) -> Option<SecretReview> {
        let account = self.verified_account()?;
        if reference.gateway || reference.ca_only() || reference.namespace != self.namespace() {
            return None;
        }
        let clusters = self.secret_clusters(reference);
        let credentials = &self.mesh.credentials;
        credentials.holder(&clusters, reference.namespace, reference.name)?;
        let cluster = self.cluster().unwrap_or(credentials.local());
        Some(SecretReview {
            cluster: cluster.clone(),
            namespace: reference.namespace.to_string(),
            service_account: account.to_string(),
        })
    }

    /// The reviews to ask before these Secrets can be built: those not answered yet.
    pub fn pending_secret_reviews<'n>(
        &self,
        names: impl IntoIterator<Item = &'n String>,
    ) -> Vec<SecretReview> {
        let Some(access) = self.secret_access else {
            return Vec::new();
        };
        let mut pending: Vec<SecretReview> = names
            .into_iter()
            .filter_map(|name| parse(name, self.namespace()))
            .filter_map(|reference| self.secret_review(&reference))
            .filter(|review| access.verdict(review) == Verdict::Unknown)
            .collect();
        pending.sort_by(|a, b| a.cluster.cmp(&b.cluster));
        pending.dedup();
        pending
    }

    /// Whether a Gateway of this router's own namespace that selects it names this
    /// `kubernetes-gateway://` SDS name, its Secret in that namespace or opened to its Gateways by
    /// a ReferenceGrant (istiod's `VerifiedCertificateReferences`).
    fn verified_reference(&self, name: &str) -> bool {
        let namespace = self.namespace();
        if !self.is_router() {
            return false;
        }
        let config = &self.mesh.config;
        let bound = self.gateways();
        let own = bound
            .iter()
            .filter(|b| *b.object.key.namespace == *namespace);
        own.flat_map(|b| &b.gateway.servers)
            .filter_map(|server| server.tls.as_ref())
            .filter(|tls| !tls.credential_name.is_empty())
            .any(|tls| {
                let mutual = matches!(
                    tls.mode,
                    ServerTlsMode::Mutual | ServerTlsMode::OptionalMutual
                );
                let names = resource_name(&tls.credential_name, false) == name
                    || (mutual && resource_name(&tls.credential_name, true) == name);
                let base = resource_name(&tls.credential_name, false);
                let Some(secret) = parse(&base, namespace).filter(|_| names) else {
                    return false;
                };
                secret.namespace == namespace
                    || config.secret_granted(namespace, secret.namespace, secret.name)
            })
    }

    /// Why this proxy may not read this Secret, if it may not.
    fn secret_refusal(&self, name: &str, reference: &Reference<'_>) -> Option<&'static str> {
        if reference.gateway {
            return (!self.verified_reference(name)).then_some(
                "no Gateway of the proxy's namespace that selects it names it with the Secret in \
                 that namespace or opened to it by a ReferenceGrant",
            );
        }
        if reference.namespace != self.namespace() {
            return Some("a Secret of another namespace than the proxy's");
        }
        if reference.ca_only() {
            return None;
        }
        let Some(review) = self.secret_review(reference) else {
            return None; // Not found: reported as such.
        };
        let verdict = self
            .secret_access
            .map_or(Verdict::Unknown, |a| a.verdict(&review));
        match verdict {
            Verdict::Allowed => None,
            Verdict::Denied => Some("its service account may not list Secrets in the namespace"),
            Verdict::Unknown => Some("its service account's access has not been reviewed"),
        }
    }
}

pub fn build(g: &Generation<'_>, name: &str) -> Option<Arc<Resource>> {
    let Some(account) = g.verified_account() else {
        warn!(
            proxy = g.id(),
            resource = name,
            "gateway credential refused: only a proxy proven on the secure port may read Secrets"
        );
        return None;
    };
    let reference = parse(name, g.namespace())?;
    if let Some(why) = g.secret_refusal(name, &reference) {
        warn!(
            proxy = g.id(),
            resource = name,
            service_account = account,
            "gateway credential refused: {why}"
        );
        return None;
    }
    let credentials = &g.mesh.credentials;
    let clusters = g.secret_clusters(&reference);
    let (namespace, secret) = (reference.namespace, reference.name);
    let material = match reference.ca_only() {
        true => credentials
            .ca(&clusters, namespace, secret)
            .map(|ca| validation(name, ca)),
        false => credentials
            .certificate(&clusters, namespace, secret)
            .map(|(chain, key)| certificate(name, chain, key)),
    };
    match material {
        Ok(secret) => Some(Arc::new(Resource::encode(name, &secret))),
        Err(e) => {
            warn!(proxy = g.id(), resource = name, error = %e, "gateway credential not served");
            None
        }
    }
}

fn inline(bytes: Bytes) -> Option<DataSource> {
    Some(DataSource {
        specifier: Some(data_source::Specifier::InlineBytes(bytes.to_vec())),
        ..Default::default()
    })
}

fn certificate(name: &str, chain: Bytes, key: Bytes) -> Secret {
    Secret {
        name: name.to_string(),
        r#type: Some(secret::Type::TlsCertificate(TlsCertificate {
            certificate_chain: inline(chain),
            private_key: inline(key),
            ..Default::default()
        })),
    }
}

fn validation(name: &str, ca: Bytes) -> Secret {
    Secret {
        name: name.to_string(),
        r#type: Some(secret::Type::ValidationContext(
            CertificateValidationContext {
                trusted_ca: inline(ca),
                ..Default::default()
            },
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_default_to_the_proxy_namespace() {
        let k8s = |namespace, name| Reference {
            gateway: false,
            namespace,
            name,
        };
        assert_eq!(parse("kubernetes://cert", "gw"), Some(k8s("gw", "cert")));
        assert_eq!(
            parse("kubernetes://other/cert-cacert", "gw"),
            Some(k8s("other", "cert-cacert"))
        );
        assert_eq!(
            parse("kubernetes-gateway://shop/cert", "gw"),
            Some(Reference {
                gateway: true,
                namespace: "shop",
                name: "cert"
            })
        );
        assert_eq!(parse("kubernetes-gateway://cert", "gw"), None);
        assert_eq!(parse("default", "gw"), None);
        assert_eq!(parse("kubernetes://", "gw"), None);
        assert_eq!(parse("kubernetes://a/b/c", "gw"), None);
        assert!(parse("kubernetes://cert-cacert", "gw").unwrap().ca_only());
    }

    #[test]
    fn credential_names_keep_their_type() {
        assert_eq!(resource_name("cert", true), "kubernetes://cert-cacert");
        assert_eq!(
            resource_name("kubernetes://cert", false),
            "kubernetes://cert"
        );
        let gateway = crate::model::credentials::gateway_credential("shop", "cert");
        assert_eq!(
            resource_name(&gateway, true),
            "kubernetes-gateway://shop/cert-cacert"
        );
    }
}
