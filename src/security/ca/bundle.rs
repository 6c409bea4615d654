//! The CA's keys in Istio's cacerts layout: read and written as files or a Secret's data, a
//! self-signed root made and renewed (same key), intermediates for clusters.

use std::path::Path;
use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use x509_parser::prelude::{FromDer, X509Certificate};

use super::pem::{certs, invalid, serial, set_validity, single_cert, to_pem, unix_seconds};
use super::CaError;
use crate::security::ca_key;

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
        let mut bundle = Self {
            ca_key: need(CA_KEY)?,
            cert_chain: get(CERT_CHAIN)
                .filter(|c| !c.trim().is_empty())
                .unwrap_or_else(|| ca_cert.clone()),
            root_cert: get(ROOT_CERT)
                .filter(|c| !c.trim().is_empty())
                .unwrap_or_else(|| ca_cert.clone()),
            ca_cert,
        };
        // istiod's root rotator rewrites only ca-cert.pem and ca-key.pem of istio-ca-secret
        // (security/pkg/pki/ca/selfsignedcarootcertrotator.go): a self-signed signing root is
        // trusted whatever root-cert.pem still says, and what it says stays trusted beside it
        // until it expires.
        if !bundle.root_cert.contains(bundle.ca_cert.trim()) && bundle.is_self_signed_root()? {
            bundle.root_cert = format!("{}\n{}", bundle.ca_cert.trim_end(), bundle.root_cert);
        }
        Ok(bundle)
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

pub(super) fn parse_key(pem: &str) -> Result<KeyPair, CaError> {
    ca_key::parse(pem).map_err(|source| CaError::Key {
        file: CA_KEY,
        source,
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_root_rotated_by_istiod_is_trusted_beside_the_stale_root_cert_file() {
        let old = CaBundle::self_signed_root("td", ROOT_LIFETIME).unwrap();
        let new = CaBundle::self_signed_root("td", ROOT_LIFETIME).unwrap();
        // As istiod leaves istio-ca-secret after a rotation: new signing root, old root-cert.pem.
        let secret = |file: &str| match file {
            CA_CERT => Some(new.ca_cert.clone()),
            CA_KEY => Some(new.ca_key.clone()),
            ROOT_CERT => Some(old.ca_cert.clone()),
            _ => Some(String::new()),
        };
        let bundle = CaBundle::from_files(secret).unwrap();
        assert!(bundle.root_cert.starts_with(new.ca_cert.trim()));
        assert!(bundle.root_cert.contains(old.ca_cert.trim()));
        assert_eq!(bundle.cert_chain, new.ca_cert);
        // As istiod creates it: one root, named twice.
        let created = |file: &str| match file {
            CA_CERT | ROOT_CERT => Some(old.ca_cert.clone()),
            CA_KEY => Some(old.ca_key.clone()),
            _ => Some(String::new()),
        };
        assert_eq!(
            CaBundle::from_files(created).unwrap().root_cert,
            old.ca_cert
        );
    }
}
