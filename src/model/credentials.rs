//! Gateway credentials: the TLS material of Secrets, per cluster, that gateways name by
//! `credentialName` and receive over SDS (`kubernetes://<name>`, `kubernetes://<name>-cacert`);
//! and the registry credentials (`kubernetes.io/dockerconfigjson`) WasmPlugins pull modules with.
//!
//! Lookups follow istiod: the proxy's own cluster first, then the cluster meshpilot runs in; a CA
//! comes from a `<name>-cacert` Secret, else from the `<name>` Secret's CA key.

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;

use super::ClusterId;

/// The suffix of SDS names (and Secrets) that carry only a CA bundle.
pub const CA_SUFFIX: &str = "-cacert";

/// The prefix of SDS names of Secrets in the proxy's namespace (istiod's `kubernetes://`).
pub const KUBERNETES_PREFIX: &str = "kubernetes://";
/// The prefix of SDS names of Secrets Gateway API listeners reference (istiod's
/// `kubernetes-gateway://<namespace>/<name>`).
pub const GATEWAY_PREFIX: &str = "kubernetes-gateway://";

/// The `credentialName` a compiled Gateway API listener gives its Secret, as istiod's
/// `ToKubernetesGatewayResource`.
pub fn gateway_credential(namespace: &str, name: &str) -> String {
    format!("{GATEWAY_PREFIX}{namespace}/{name}")
}

/// What one Secret holds for TLS, in the keys istiod reads.
#[derive(Clone, PartialEq, Eq)]
pub struct SecretMaterial {
    /// Certificate chain and private key: generic `cert`/`key`, else `tls.crt`/`tls.key`.
    pub certificate: Option<(Bytes, Bytes)>,
    /// CA bundle: generic `cacert`, else `ca.crt`.
    pub ca: Option<Bytes>,
    /// A `kubernetes.io/dockerconfigjson` Secret's `.dockerconfigjson`.
    pub docker_config: Option<Bytes>,
}

impl fmt::Debug for SecretMaterial {
    /// Never prints key material.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SecretMaterial")
            .field("certificate", &self.certificate.is_some())
            .field("ca", &self.ca.is_some())
            .field("docker_config", &self.docker_config.is_some())
            .finish()
    }
}

/// One Secret of one cluster.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CredentialKey {
    pub cluster: ClusterId,
    pub namespace: Arc<str>,
    pub name: Arc<str>,
}

/// Every cluster's TLS Secrets.
#[derive(Clone, Default)]
pub struct Credentials {
    secrets: imbl::HashMap<CredentialKey, Arc<SecretMaterial>>,
    /// The cluster meshpilot runs in, searched after the proxy's own.
    local: ClusterId,
}

/// Why a credential cannot be served, for the logs.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum CredentialError {
    #[error("secret {namespace}/{name} not found")]
    NotFound { namespace: String, name: String },
    #[error("secret {namespace}/{name} has no certificate and key (cert/key or tls.crt/tls.key)")]
    NoCertificate { namespace: String, name: String },
    #[error("secret {namespace}/{name} has no CA certificate (cacert or ca.crt)")]
    NoCa { namespace: String, name: String },
}

impl fmt::Debug for Credentials {
    /// Names only: never key material.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("secrets", &self.secrets.len())
            .field("local", &self.local)
            .finish()
    }
}

impl Credentials {
    pub fn new(local: ClusterId) -> Self {
        Self {
            secrets: imbl::HashMap::new(),
            local,
        }
    }

    /// Where a proxy's credentials are looked up, in order: its own cluster, then meshpilot's.
    pub fn search_order<'a>(&'a self, proxy_cluster: Option<&'a ClusterId>) -> Vec<&'a ClusterId> {
        let mut order: Vec<&ClusterId> = proxy_cluster.into_iter().collect();
        if proxy_cluster != Some(&self.local) {
            order.push(&self.local);
        }
        order
    }

    /// Sets (or with None removes) one Secret; returns whether anything changed.
    pub fn set(&mut self, key: CredentialKey, material: Option<Arc<SecretMaterial>>) -> bool {
        match material {
            Some(m) => self
                .secrets
                .insert(key, m.clone())
                .is_none_or(|old| old != m),
            None => self.secrets.remove(&key).is_some(),
        }
    }

    /// Removes a cluster's Secrets; returns their keys.
    pub fn remove_cluster(&mut self, cluster: &ClusterId) -> Vec<CredentialKey> {
        let gone: Vec<CredentialKey> = self
            .secrets
            .keys()
            .filter(|k| k.cluster == *cluster)
            .cloned()
            .collect();
        for key in &gone {
            self.secrets.remove(key);
        }
        gone
    }

    /// The Secrets of a cluster, for /debug output and replacement on re-sync.
    pub fn of_cluster(&self, cluster: &ClusterId) -> Vec<CredentialKey> {
        self.secrets
            .keys()
            .filter(|k| k.cluster == *cluster)
            .cloned()
            .collect()
    }

    /// The cluster meshpilot runs in (istiod's config cluster).
    pub fn local(&self) -> &ClusterId {
        &self.local
    }

    /// The first of `clusters` that holds Secret `name`: where it is read from.
    pub fn holder<'c>(
        &self,
        clusters: &[&'c ClusterId],
        namespace: &str,
        name: &str,
    ) -> Option<&'c ClusterId> {
        self.find_in(clusters, namespace, name).map(|(c, _)| c)
    }

    fn find(
        &self,
        clusters: &[&ClusterId],
        namespace: &str,
        name: &str,
    ) -> Option<&SecretMaterial> {
        self.find_in(clusters, namespace, name).map(|(_, m)| m)
    }

    fn find_in<'c>(
        &self,
        clusters: &[&'c ClusterId],
        namespace: &str,
        name: &str,
    ) -> Option<(&'c ClusterId, &SecretMaterial)> {
        clusters.iter().find_map(|cluster| {
            let key = CredentialKey {
                cluster: (*cluster).clone(),
                namespace: namespace.into(),
                name: name.into(),
            };
            self.secrets.get(&key).map(|m| (*cluster, &**m))
        })
    }

    /// Certificate chain and key of Secret `name`, searched in `clusters` in order.
    pub fn certificate(
        &self,
        clusters: &[&ClusterId],
        namespace: &str,
        name: &str,
    ) -> Result<(Bytes, Bytes), CredentialError> {
        let material =
            self.find(clusters, namespace, name)
                .ok_or_else(|| CredentialError::NotFound {
                    namespace: namespace.into(),
                    name: name.into(),
                })?;
        material
            .certificate
            .clone()
            .ok_or_else(|| CredentialError::NoCertificate {
                namespace: namespace.into(),
                name: name.into(),
            })
    }

    /// The registry credentials of Secret `name` (a `kubernetes.io/dockerconfigjson` one), searched
    /// in `clusters` in order.
    pub fn docker_config(
        &self,
        clusters: &[&ClusterId],
        namespace: &str,
        name: &str,
    ) -> Option<Bytes> {
        self.find(clusters, namespace, name)?.docker_config.clone()
    }

    /// The CA bundle for SDS name `<base>-cacert`: Secret `<base>-cacert`, else Secret `<base>`.
    pub fn ca(
        &self,
        clusters: &[&ClusterId],
        namespace: &str,
        ca_name: &str,
    ) -> Result<Bytes, CredentialError> {
        let base = ca_name.strip_suffix(CA_SUFFIX).unwrap_or(ca_name);
        let (name, material) = match self.find(clusters, namespace, ca_name) {
            Some(m) => (ca_name, m),
            None => (
                base,
                self.find(clusters, namespace, base)
                    .ok_or_else(|| CredentialError::NotFound {
                        namespace: namespace.into(),
                        name: base.into(),
                    })?,
            ),
        };
        material.ca.clone().ok_or_else(|| CredentialError::NoCa {
            namespace: namespace.into(),
            name: name.into(),
        })
    }

    pub fn len(&self) -> usize {
        self.secrets.len()
    }

    pub fn is_empty(&self) -> bool {
        self.secrets.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(cluster: &str, name: &str) -> CredentialKey {
        CredentialKey {
            cluster: ClusterId::new(cluster),
            namespace: "gw".into(),
            name: name.into(),
        }
    }

    fn material(cert: Option<&str>, ca: Option<&str>) -> Option<Arc<SecretMaterial>> {
        Some(Arc::new(SecretMaterial {
            certificate: cert.map(|c| (Bytes::from(c.to_string()), Bytes::from("key"))),
            ca: ca.map(|c| Bytes::from(c.to_string())),
            docker_config: None,
        }))
    }

    #[test]
    fn the_proxy_cluster_comes_before_the_local_one() {
        let mut creds = Credentials::default();
        creds.set(key("local", "tls"), material(Some("local"), None));
        creds.set(key("remote", "tls"), material(Some("remote"), None));
        let (remote, local) = (ClusterId::new("remote"), ClusterId::new("local"));
        let (chain, _) = creds.certificate(&[&remote, &local], "gw", "tls").unwrap();
        assert_eq!(chain, "remote");
        let other = ClusterId::new("other");
        let (chain, _) = creds.certificate(&[&other, &local], "gw", "tls").unwrap();
        assert_eq!(chain, "local");
        assert!(matches!(
            creds.certificate(&[&other], "gw", "tls"),
            Err(CredentialError::NotFound { .. })
        ));
    }

    #[test]
    fn a_ca_comes_from_its_own_secret_else_the_certificate_secret() {
        let mut creds = Credentials::default();
        let c = ClusterId::new("c");
        creds.set(key("c", "tls"), material(Some("cert"), Some("inline-ca")));
        assert_eq!(creds.ca(&[&c], "gw", "tls-cacert").unwrap(), "inline-ca");
        creds.set(key("c", "tls-cacert"), material(None, Some("separate-ca")));
        assert_eq!(creds.ca(&[&c], "gw", "tls-cacert").unwrap(), "separate-ca");
        creds.set(key("c", "plain"), material(Some("cert"), None));
        assert_eq!(
            creds
                .ca(&[&c], "gw", "plain-cacert")
                .unwrap_err()
                .to_string(),
            "secret gw/plain has no CA certificate (cacert or ca.crt)"
        );
    }

    #[test]
    fn set_reports_changes_only() {
        let mut creds = Credentials::default();
        assert!(creds.set(key("c", "a"), material(Some("x"), None)));
        assert!(!creds.set(key("c", "a"), material(Some("x"), None)));
        assert!(creds.set(key("c", "a"), material(Some("y"), None)));
        assert!(creds.set(key("c", "a"), None));
        assert!(!creds.set(key("c", "a"), None));
        creds.set(key("c", "a"), material(Some("x"), None));
        creds.set(key("d", "a"), material(Some("x"), None));
        assert_eq!(creds.remove_cluster(&ClusterId::new("c")).len(), 1);
        assert_eq!(creds.len(), 1);
    }
}
