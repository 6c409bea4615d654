//! SDS over ADS: the TLS Secrets gateways name by `credentialName`, as istiod serves them
//! (`kubernetes://<name>` or `kubernetes://<namespace>/<name>`; `<name>-cacert` for the CA bundle).
//!
//! Only a proxy that proved its identity on the secure port gets them, and only from its own
//! namespace (istiod's default authorization); anything else is answered as not existing.

use std::sync::Arc;

use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::{data_source, DataSource};
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    secret, CertificateValidationContext, Secret, TlsCertificate,
};
use tracing::warn;

use super::generation::Generation;
use crate::model::CREDENTIAL_CA_SUFFIX;
use crate::xds::wire::Resource;

/// The prefix of SDS names istiod reads from Kubernetes Secrets.
pub const KUBERNETES_PREFIX: &str = "kubernetes://";

/// The SDS name of a `credentialName` (its CA bundle with `ca`).
pub fn resource_name(credential: &str, ca: bool) -> String {
    let suffix = if ca { CREDENTIAL_CA_SUFFIX } else { "" };
    format!("{KUBERNETES_PREFIX}{credential}{suffix}")
}

/// `kubernetes://[<namespace>/]<name>` → (namespace, name), the namespace defaulting to the proxy's.
fn parse<'n>(name: &'n str, proxy_namespace: &'n str) -> Option<(&'n str, &'n str)> {
    let rest = name.strip_prefix(KUBERNETES_PREFIX)?;
    let (namespace, secret) = rest.split_once('/').unwrap_or((proxy_namespace, rest));
    (!namespace.is_empty() && !secret.is_empty() && !secret.contains('/'))
        .then_some((namespace, secret))
}

pub fn build(g: &Generation<'_>, name: &str) -> Option<Arc<Resource>> {
    let proxy = g.proxy;
    let (namespace, secret) = parse(name, &proxy.namespace)?;
    if !proxy.verified || namespace != &*proxy.namespace {
        warn!(proxy = %proxy.id, resource = name, verified = proxy.verified, "gateway credential refused: only a proxy proven on the secure port may read Secrets of its own namespace");
        return None;
    }
    let credentials = &g.mesh.credentials;
    let clusters = credentials.search_order(proxy.cluster_id.as_ref());
    let material = match secret.strip_suffix(CREDENTIAL_CA_SUFFIX) {
        Some(_) => credentials
            .ca(&clusters, namespace, secret)
            .map(|ca| validation(name, ca)),
        None => credentials
            .certificate(&clusters, namespace, secret)
            .map(|(chain, key)| certificate(name, chain, key)),
    };
    match material {
        Ok(secret) => Some(Arc::new(Resource::encode(name, &secret))),
        Err(e) => {
            warn!(proxy = %proxy.id, resource = name, error = %e, "gateway credential not served");
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
        assert_eq!(parse("kubernetes://cert", "gw"), Some(("gw", "cert")));
        assert_eq!(
            parse("kubernetes://other/cert-cacert", "gw"),
            Some(("other", "cert-cacert"))
        );
        assert_eq!(parse("default", "gw"), None);
        assert_eq!(parse("kubernetes://", "gw"), None);
        assert_eq!(parse("kubernetes://a/b/c", "gw"), None);
        assert_eq!(resource_name("cert", true), "kubernetes://cert-cacert");
    }
}
