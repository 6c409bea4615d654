//! The certificate authority: keys in Istio's cacerts layout (plug-in, or a self-signed root kept
//! across restarts), CSR signing for a proven identity, and serving certificates.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DistinguishedName,
    DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType, SerialNumber,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use thiserror::Error;
use time::OffsetDateTime;
use x509_parser::prelude::{FromDer, X509Certificate};

use super::ca_key::{self, KeyFormError};
use super::identity::Identity;
use crate::text::clip;

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
}

/// PEM files of Istio's cacerts layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CaBundle {
    pub ca_cert: String,
    pub ca_key: String,
    /// The CA's certificate followed by its issuers (Istio: ca-cert + intermediates + root).
    pub cert_chain: String,
    /// The roots workloads trust: the signing chain's root first; after a root rotation, the
    /// previous root until it expires.
    pub root_cert: String,
}

pub const CA_CERT: &str = "ca-cert.pem";
pub const CA_KEY: &str = "ca-key.pem";
pub const CERT_CHAIN: &str = "cert-chain.pem";
pub const ROOT_CERT: &str = "root-cert.pem";

/// A self-signed root's lifetime unless configured (istiod's `CITADEL_SELF_SIGNED_CA_CERT_TTL`).
pub const ROOT_LIFETIME: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

impl CaBundle {
    /// Reads a cacerts directory; every file must be there.
    pub fn read_dir(dir: &Path) -> Result<Self, CaError> {
        let read = |file: &'static str| -> Result<String, CaError> {
            let path = dir.join(file);
            match std::fs::read_to_string(&path) {
                Ok(text) => Ok(text),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    Err(CaError::Missing { file })
                }
                Err(source) => Err(CaError::Read {
                    file: path.display().to_string(),
                    source,
                }),
            }
        };
        Ok(Self {
            ca_cert: read(CA_CERT)?,
            ca_key: read(CA_KEY)?,
            cert_chain: read(CERT_CHAIN)?,
            root_cert: read(ROOT_CERT)?,
        })
    }

    pub fn write_dir(&self, dir: &Path) -> Result<(), CaError> {
        let error = |source| CaError::Write {
            dir: dir.display().to_string(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(error)?;
        for (file, text) in self.files() {
            let path = dir.join(file);
            if file == CA_KEY {
                write_private(&path, text)
            } else {
                std::fs::write(path, text)
            }
            .map_err(error)?;
        }
        Ok(())
    }

    pub fn files(&self) -> [(&'static str, &str); 4] {
        [
            (CA_CERT, &self.ca_cert),
            (CA_KEY, &self.ca_key),
            (CERT_CHAIN, &self.cert_chain),
            (ROOT_CERT, &self.root_cert),
        ]
    }

    /// From a Secret's data (`cacerts` or `istio-ca-secret`).
    pub fn from_files(get: impl Fn(&str) -> Option<String>) -> Result<Self, CaError> {
        let need = |file: &'static str| get(file).ok_or(CaError::Missing { file });
        let ca_cert = need(CA_CERT)?;
        Ok(Self {
            ca_key: need(CA_KEY)?,
            cert_chain: get(CERT_CHAIN)
                .filter(|c| !c.trim().is_empty())
                .unwrap_or_else(|| ca_cert.clone()),
            root_cert: get(ROOT_CERT)
                .filter(|c| !c.trim().is_empty())
                .unwrap_or_else(|| ca_cert.clone()),
            ca_cert,
        })
    }

    /// A new self-signed root (ECDSA P-256) that is its own signing CA.
    pub fn self_signed_root(organization: &str, lifetime: Duration) -> Result<Self, CaError> {
        let key = KeyPair::generate()?;
        let params = ca_params(organization, "meshpilot root CA", lifetime)?;
        let cert = params.self_signed(&key)?.pem();
        Ok(Self {
            ca_cert: cert.clone(),
            ca_key: key.serialize_pem(),
            cert_chain: cert.clone(),
            root_cert: cert,
        })
    }

    /// Whether the CA is a self-signed root (not a plug-in chain): only such a root is rotated.
    pub fn is_self_signed_root(&self) -> Result<bool, CaError> {
        let der = single_cert(&self.ca_cert, CA_CERT)?;
        let (_, cert) = X509Certificate::from_der(&der).map_err(|e| invalid(CA_CERT, e))?;
        Ok(cert.subject() == cert.issuer() && cert.verify_signature(None).is_ok())
    }

    /// Whether the CA's certificate has less than `grace_percent` of its lifetime left at `now`,
    /// as istiod's root rotator decides (`CITADEL_SELF_SIGNED_ROOT_CERT_GRACE_PERIOD_PERCENTILE`).
    pub fn renewal_due(&self, now: SystemTime, grace_percent: u32) -> Result<bool, CaError> {
        let der = single_cert(&self.ca_cert, CA_CERT)?;
        let (_, cert) = X509Certificate::from_der(&der).map_err(|e| invalid(CA_CERT, e))?;
        let validity = cert.validity();
        let (from, to) = (
            validity.not_before.timestamp() as i128,
            validity.not_after.timestamp() as i128,
        );
        let now = unix_seconds(now) as i128;
        Ok((to - now) * 100 < (to - from) * i128::from(grace_percent))
    }

    /// A self-signed root renewed as istiod's rotator does: the same key and subject, a new
    /// validity of `lifetime`, so certificates the old root signed still verify under the new
    /// one. The old root stays in `root_cert` (trusted beside the new) until it expires.
    pub fn renewed_root(&self, lifetime: Duration, now: SystemTime) -> Result<Self, CaError> {
        let key = parse_key(&self.ca_key)?;
        let der = single_cert(&self.ca_cert, CA_CERT)?;
        let (_, old) = X509Certificate::from_der(&der).map_err(|e| invalid(CA_CERT, e))?;
        let mut params = ca_params("", "", lifetime)?;
        params.distinguished_name = subject_of(&old);
        let cert = to_pem(params.self_signed(&key)?.der());
        let now = unix_seconds(now);
        let mut roots = cert.clone();
        for der in certs(&self.root_cert, ROOT_CERT)? {
            let (_, old) = X509Certificate::from_der(&der).map_err(|e| invalid(ROOT_CERT, e))?;
            if old.validity().not_after.timestamp() > now {
                roots.push_str(&to_pem(&der));
            }
        }
        Ok(Self {
            ca_cert: cert.clone(),
            ca_key: self.ca_key.clone(),
            cert_chain: cert,
            root_cert: roots,
        })
    }

    /// The bundle without the roots expired at `now`, if it held any (the signing root is kept).
    pub fn without_expired_roots(&self, now: SystemTime) -> Result<Option<Self>, CaError> {
        let now = unix_seconds(now);
        let signing = single_cert(&self.ca_cert, CA_CERT)?;
        let roots = certs(&self.root_cert, ROOT_CERT)?;
        let mut kept = String::new();
        for der in &roots {
            let (_, root) = X509Certificate::from_der(der).map_err(|e| invalid(ROOT_CERT, e))?;
            if root.validity().not_after.timestamp() > now || *der == signing {
                kept.push_str(&to_pem(der));
            }
        }
        let pruned = kept.matches("BEGIN CERTIFICATE").count() < roots.len();
        Ok(pruned.then(|| Self {
            root_cert: kept,
            ..self.clone()
        }))
    }

    /// An intermediate CA for one cluster, signed by this bundle's CA (`meshpilot certs`).
    pub fn intermediate(
        &self,
        organization: &str,
        name: &str,
        lifetime: Duration,
    ) -> Result<Self, CaError> {
        let parent_key = parse_key(&self.ca_key)?;
        let issuer =
            Issuer::from_ca_cert_pem(&self.ca_cert, parent_key).map_err(|e| invalid(CA_CERT, e))?;
        let key = KeyPair::generate()?;
        let params = ca_params(
            organization,
            &format!("meshpilot intermediate CA {name}"),
            lifetime,
        )?;
        let cert = params.signed_by(&key, &issuer)?.pem();
        Ok(Self {
            cert_chain: format!("{cert}{}", self.cert_chain),
            ca_cert: cert,
            ca_key: key.serialize_pem(),
            root_cert: self.root_cert.clone(),
        })
    }
}

/// Writes a private key readable by its owner only: the file is created with mode 0600, so the key
/// is never readable by others, not even between writing and a chmod. A file already there is
/// replaced, not reused with its old mode.
pub(crate) fn write_private(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    options.open(path)?.write_all(text.as_bytes())
}

fn parse_key(pem: &str) -> Result<KeyPair, CaError> {
    ca_key::parse(pem).map_err(|source| CaError::Key {
        file: CA_KEY,
        source,
    })
}

/// `e` may quote the file (a PEM parser's error lists the bytes it stopped at): bounded.
fn invalid(file: &'static str, e: impl std::fmt::Display) -> CaError {
    CaError::Invalid {
        file,
        problem: clip(&e.to_string()),
    }
}

fn ca_params(
    organization: &str,
    common_name: &str,
    lifetime: Duration,
) -> Result<CertificateParams, CaError> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.distinguished_name = DistinguishedName::new();
    params
        .distinguished_name
        .push(DnType::OrganizationName, organization);
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    set_validity(&mut params, lifetime);
    params.serial_number = Some(serial());
    Ok(params)
}

/// A certificate's subject as rcgen builds it (its string attributes, in order).
fn subject_of(cert: &X509Certificate<'_>) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    for attr in cert.subject().iter_attributes() {
        let (Some(oid), Ok(value)) = (attr.attr_type().iter(), attr.as_str()) else {
            continue;
        };
        dn.push(DnType::from_oid(&oid.collect::<Vec<u64>>()), value);
    }
    dn
}

fn set_validity(params: &mut CertificateParams, lifetime: Duration) {
    let now = OffsetDateTime::now_utc();
    // Tolerate clock skew between the CA and its clients: five minutes, less for short lifetimes
    // so that the share of a lifetime left (root renewal) stays close to what was asked for.
    let skew = (lifetime / 10).min(Duration::from_secs(300));
    params.not_before = now - skew;
    params.not_after = now + lifetime;
}

fn unix_seconds(t: SystemTime) -> i64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

fn serial() -> SerialNumber {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as u64;
    let mut bytes = Vec::with_capacity(17);
    // A leading zero byte keeps the serial positive.
    bytes.push(0);
    bytes.extend_from_slice(&nanos.to_be_bytes());
    bytes.extend_from_slice(&COUNTER.fetch_add(1, Ordering::Relaxed).to_be_bytes());
    SerialNumber::from(bytes)
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

fn certs(pem: &str, file: &'static str) -> Result<Vec<CertificateDer<'static>>, CaError> {
    let certs: Vec<_> = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<_, _>>()
        .map_err(|e| invalid(file, e))?;
    if certs.is_empty() {
        return Err(invalid(file, "no certificate in it"));
    }
    Ok(certs)
}

fn single_cert(pem: &str, file: &'static str) -> Result<CertificateDer<'static>, CaError> {
    Ok(certs(pem, file)?.remove(0))
}

/// Each certificate is signed by the next; the last (the root) by itself.
fn verify_chain(chain: &[CertificateDer<'_>]) -> Result<(), CaError> {
    let parsed: Vec<X509Certificate<'_>> = chain
        .iter()
        .map(|der| X509Certificate::from_der(der).map(|(_, c)| c))
        .collect::<Result<_, _>>()
        .map_err(|e| CaError::Chain(e.to_string()))?;
    for (i, cert) in parsed.iter().enumerate() {
        let issuer = parsed.get(i + 1).unwrap_or(cert);
        cert.verify_signature(Some(issuer.public_key()))
            .map_err(|e| {
                CaError::Chain(format!(
                    "{} is not signed by {} ({e})",
                    cert.subject(),
                    issuer.subject()
                ))
            })?;
    }
    Ok(())
}

pub fn to_pem(der: &CertificateDer<'_>) -> String {
    pem_encode("CERTIFICATE", der)
}

fn pem_encode(label: &str, der: &[u8]) -> String {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = format!("-----BEGIN {label}-----\n");
    for line in b64.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(line).unwrap_or_default());
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

/// The identities (SPIFFE URIs) a certificate carries.
pub fn spiffe_identities(der: &[u8]) -> Vec<Identity> {
    let Ok((_, cert)) = X509Certificate::from_der(der) else {
        return Vec::new();
    };
    let Ok(Some(san)) = cert.subject_alternative_name() else {
        return Vec::new();
    };
    san.value
        .general_names
        .iter()
        .filter_map(|name| match name {
            x509_parser::extensions::GeneralName::URI(uri) => Identity::parse(uri),
            _ => None,
        })
        .collect()
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
