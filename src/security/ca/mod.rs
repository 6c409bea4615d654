//! The certificate authority: keys in Istio's cacerts layout (plug-in, or a self-signed root kept
//! across restarts; `bundle`), CSR signing for a proven identity, and serving certificates.

mod bundle;
mod pem;

use std::time::Duration;

use rcgen::{
    CertificateParams, CertificateSigningRequestParams, DistinguishedName, ExtendedKeyUsagePurpose,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use thiserror::Error;
use x509_parser::prelude::{FromDer, X509Certificate};

use self::bundle::parse_key;
use self::pem::{certs, invalid, serial, set_validity, single_cert, verify_chain};
use super::ca_key::KeyFormError;
use super::identity::Identity;
use crate::text::clip;

pub(crate) use self::bundle::write_private;
pub use self::bundle::{CaBundle, CA_CERT, CA_KEY, CERT_CHAIN, ROOT_CERT, ROOT_LIFETIME};
pub use self::pem::{spiffe_identities, to_pem};

#[derive(Debug, Error)]
pub enum CaError {
    #[error("CA bundle: cannot read {file}: {source}")]
    Read {
        file: String,
        source: std::io::Error,
    },
    #[error("CA bundle: {file} is missing")]
    Missing { file: &'static str },
    #[error("CA bundle: {file}: {problem}")]
    Invalid { file: &'static str, problem: String },
    #[error("CA bundle: {file}: {source}")]
    Key {
        file: &'static str,
        source: KeyFormError,
    },
    #[error("CA bundle: ca-key.pem does not match ca-cert.pem")]
    KeyMismatch,
    #[error("CA bundle: the chain does not end at root-cert.pem: {0}")]
    Chain(String),
    #[error("CSR: {0}")]
    Csr(String),
    #[error("requested lifetime {requested:?} exceeds the maximum {max:?}")]
    TtlTooLong { requested: Duration, max: Duration },
    #[error("signing failed: {0}")]
    Sign(#[from] rcgen::Error),
    #[error("cannot write CA state to {dir}: {source}")]
    Write { dir: String, source: std::io::Error },
    #[error("{path} exists: a key is never overwritten (certificates signed with it would stop chaining); give --force to replace it, or another --out")]
    KeyExists { path: String },
}

/// Lifetime rules for issued workload certificates.
#[derive(Clone, Copy, Debug)]
pub struct TtlPolicy {
    pub default: Duration,
    pub max: Duration,
}

pub struct CertificateAuthority {
    issuer: Issuer<'static, KeyPair>,
    /// What follows a leaf in a response: the CA, its issuers, and last (as istiod's responses)
    /// every trusted root in one entry.
    chain_tail: Vec<String>,
    /// The trust bundle: one root, or after a rotation the new root and the old.
    root_pem: String,
    /// When the root expires (Unix seconds), for `citadel_server_root_cert_expiry_timestamp`.
    root_not_after: i64,
    ttl: TtlPolicy,
}

impl CertificateAuthority {
    /// Loads a bundle, refusing one whose key does not match or whose chain does not reach the root.
    pub fn new(bundle: &CaBundle, ttl: TtlPolicy) -> Result<Self, CaError> {
        let key = parse_key(&bundle.ca_key)?;
        let ca_der = single_cert(&bundle.ca_cert, CA_CERT)?;
        let (_, ca) = X509Certificate::from_der(&ca_der).map_err(|e| invalid(CA_CERT, e))?;
        if !ca.is_ca() {
            return Err(invalid(
                CA_CERT,
                "not a CA certificate (basicConstraints CA:FALSE)",
            ));
        }
        if ca.public_key().subject_public_key.data.as_ref() != key.public_key_raw() {
            return Err(CaError::KeyMismatch);
        }
        let roots = certs(&bundle.root_cert, ROOT_CERT)?;
        let mut chain = certs(&bundle.cert_chain, CERT_CHAIN)?;
        if chain.first() != Some(&ca_der) {
            chain.insert(0, ca_der.clone());
        }
        // The chain ends at a trusted root; without one, at the bundle's first.
        if !chain.last().is_some_and(|top| roots.contains(top)) {
            chain.push(roots[0].clone());
        }
        verify_chain(&chain)?;
        let root_der = chain.pop().unwrap_or_else(|| roots[0].clone());
        let (_, root) = X509Certificate::from_der(&root_der).map_err(|e| invalid(ROOT_CERT, e))?;
        let root_not_after = root.validity().not_after.timestamp();
        // The signing root first, then the other trusted roots.
        let root_pem: String = std::iter::once(&root_der)
            .chain(roots.iter().filter(|r| **r != root_der))
            .map(|der| to_pem(der))
            .collect();
        let mut chain_tail: Vec<String> = chain.iter().map(|der| to_pem(der)).collect();
        chain_tail.push(root_pem.clone());
        let issuer = Issuer::from_ca_cert_der(&ca_der, key).map_err(|e| invalid(CA_CERT, e))?;
        Ok(Self {
            issuer,
            chain_tail,
            root_pem,
            root_not_after,
            ttl,
        })
    }

    /// Every trusted root (PEM), the signing chain's first.
    pub fn root_pem(&self) -> &str {
        &self.root_pem
    }

    pub fn ttl(&self) -> TtlPolicy {
        self.ttl
    }

    /// When the signing chain's root expires, in Unix seconds.
    pub fn root_not_after(&self) -> i64 {
        self.root_not_after
    }

    /// Signs a CSR for `identity`; the CSR's own subject and SANs are ignored. Returns the chain:
    /// leaf first, root last.
    pub fn sign_csr(
        &self,
        csr_pem: &str,
        identity: &Identity,
        requested: Option<Duration>,
    ) -> Result<Vec<String>, CaError> {
        let ttl = self.lifetime(requested)?;
        let csr = CertificateSigningRequestParams::from_pem(csr_pem)
            .map_err(|e| CaError::Csr(clip(&e.to_string())))?;
        let request = CertificateSigningRequestParams {
            params: workload_params(&[identity.to_string()], &[], ttl)?,
            public_key: csr.public_key,
        };
        let leaf = request.signed_by(&self.issuer)?;
        Ok(self.chain_with(leaf.pem()))
    }

    /// A new key and certificate for `identity` (tools and tests; workloads send CSRs).
    pub fn issue_workload(
        &self,
        identity: &Identity,
        ttl: Duration,
    ) -> Result<(Vec<String>, String), CaError> {
        let key = KeyPair::generate()?;
        let cert =
            workload_params(&[identity.to_string()], &[], ttl)?.signed_by(&key, &self.issuer)?;
        Ok((self.chain_with(cert.pem()), key.serialize_pem()))
    }

    /// A serving certificate for DNS names (the secure xDS server).
    pub fn issue_server(
        &self,
        dns_names: &[String],
        ttl: Duration,
    ) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), CaError> {
        let key = KeyPair::generate()?;
        let cert = workload_params(&[], dns_names, ttl)?.signed_by(&key, &self.issuer)?;
        let mut chain = vec![cert.der().clone()];
        for pem in &self.chain_tail[..self.chain_tail.len().saturating_sub(1)] {
            chain.extend(CertificateDer::pem_slice_iter(pem.as_bytes()).flatten());
        }
        Ok((chain, PrivateKeyDer::Pkcs8(key.serialize_der().into())))
    }

    fn lifetime(&self, requested: Option<Duration>) -> Result<Duration, CaError> {
        match requested.filter(|d| !d.is_zero()) {
            None => Ok(self.ttl.default),
            Some(d) if d > self.ttl.max => Err(CaError::TtlTooLong {
                requested: d,
                max: self.ttl.max,
            }),
            Some(d) => Ok(d),
        }
    }

    fn chain_with(&self, leaf: String) -> Vec<String> {
        std::iter::once(leaf)
            .chain(self.chain_tail.iter().cloned())
            .collect()
    }
}

fn workload_params(
    uris: &[String],
    dns: &[String],
    ttl: Duration,
) -> Result<CertificateParams, CaError> {
    let mut params = CertificateParams::new(dns.to_vec())?;
    for uri in uris {
        params
            .subject_alt_names
            .push(SanType::URI(uri.as_str().try_into()?));
    }
    params.distinguished_name = DistinguishedName::new();
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    params.use_authority_key_identifier_extension = true;
    params.serial_number = Some(serial());
    set_validity(&mut params, ttl);
    Ok(params)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: TtlPolicy = TtlPolicy {
        default: Duration::from_secs(24 * 3600),
        max: Duration::from_secs(90 * 24 * 3600),
    };

    fn csr() -> (String, KeyPair) {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(vec!["claimed.example".to_string()]).unwrap();
        params.subject_alt_names.push(SanType::URI(
            "spiffe://evil/ns/kube-system/sa/admin".try_into().unwrap(),
        ));
        (params.serialize_request(&key).unwrap().pem().unwrap(), key)
    }

    #[test]
    fn signs_for_the_proven_identity_only() {
        let root = CaBundle::self_signed_root("cluster.local", ROOT_LIFETIME).unwrap();
        let ca = CertificateAuthority::new(&root, TTL).unwrap();
        let (csr, _) = csr();
        let id = Identity::new("cluster.local", "shop", "web");
        let chain = ca.sign_csr(&csr, &id, None).unwrap();
        assert_eq!(chain.len(), 2);
        assert_eq!(chain.last().unwrap(), ca.root_pem());
        let leaf = single_cert(&chain[0], "leaf").unwrap();
        assert_eq!(spiffe_identities(&leaf), vec![id]);
        let (_, parsed) = X509Certificate::from_der(&leaf).unwrap();
        let root_der = single_cert(ca.root_pem(), "root").unwrap();
        let (_, root_cert) = X509Certificate::from_der(&root_der).unwrap();
        parsed
            .verify_signature(Some(root_cert.public_key()))
            .unwrap();
        assert!(!chain[0].contains("claimed"), "CSR SANs must not be copied");
    }

    #[test]
    fn lifetime_is_capped() {
        let ca = CertificateAuthority::new(
            &CaBundle::self_signed_root("td", ROOT_LIFETIME).unwrap(),
            TTL,
        )
        .unwrap();
        let (csr, _) = csr();
        let id = Identity::new("td", "a", "b");
        let too_long = Duration::from_secs(91 * 24 * 3600);
        assert!(matches!(
            ca.sign_csr(&csr, &id, Some(too_long)),
            Err(CaError::TtlTooLong { .. })
        ));
        assert!(ca
            .sign_csr(&csr, &id, Some(Duration::from_secs(3600)))
            .is_ok());
        assert!(matches!(
            ca.sign_csr("not a csr", &id, None),
            Err(CaError::Csr(_))
        ));
    }

    #[test]
    fn intermediates_chain_to_the_shared_root() {
        let root = CaBundle::self_signed_root("td", ROOT_LIFETIME).unwrap();
        let east = root
            .intermediate("td", "east", Duration::from_secs(3600))
            .unwrap();
        let ca = CertificateAuthority::new(&east, TTL).unwrap();
        let (chain, _) = ca
            .issue_workload(&Identity::new("td", "a", "b"), Duration::from_secs(60))
            .unwrap();
        assert_eq!(chain.len(), 3, "leaf, intermediate, root");
        assert_eq!(
            chain[2],
            to_pem(&single_cert(&root.root_cert, "root").unwrap())
        );
    }

    #[test]
    fn broken_bundles_are_refused() {
        let a = CaBundle::self_signed_root("td", ROOT_LIFETIME).unwrap();
        let b = CaBundle::self_signed_root("td", ROOT_LIFETIME).unwrap();
        let mismatched = CaBundle {
            ca_key: b.ca_key.clone(),
            ..a.clone()
        };
        assert!(matches!(
            CertificateAuthority::new(&mismatched, TTL),
            Err(CaError::KeyMismatch)
        ));
        let wrong_root = CaBundle {
            root_cert: b.root_cert.clone(),
            cert_chain: a.ca_cert.clone(),
            ..a.intermediate("td", "x", Duration::from_secs(60)).unwrap()
        };
        assert!(matches!(
            CertificateAuthority::new(&wrong_root, TTL),
            Err(CaError::Chain(_))
        ));
        let garbage = CaBundle {
            ca_cert: "nope".into(),
            ..a.clone()
        };
        assert!(matches!(
            CertificateAuthority::new(&garbage, TTL),
            Err(CaError::Invalid { .. })
        ));
        let unterminated = CaBundle {
            cert_chain: format!("-----BEGIN CERTIFICATE-----\n{}", "d".repeat(10_000)),
            ..a
        };
        let error = CertificateAuthority::new(&unterminated, TTL)
            .err()
            .expect("refused")
            .to_string();
        assert!(error.starts_with("CA bundle: cert-chain.pem: "), "{error}");
        assert!(error.len() < 1000, "{} bytes", error.len());
    }
}
