//! PEM and X.509 plumbing of the CA: certificates read and written, chains verified, validity,
//! serial numbers, the SPIFFE identities a certificate carries.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use rcgen::{CertificateParams, SerialNumber};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use time::OffsetDateTime;
use x509_parser::prelude::{FromDer, X509Certificate};

use super::CaError;
use crate::security::identity::Identity;
use crate::text::clip;

/// `e` may quote the file (a PEM parser's error lists the bytes it stopped at): bounded.
pub(super) fn invalid(file: &'static str, e: impl std::fmt::Display) -> CaError {
    CaError::Invalid {
        file,
        problem: clip(&e.to_string()),
    }
}

pub(super) fn set_validity(params: &mut CertificateParams, lifetime: Duration) {
    let now = OffsetDateTime::now_utc();
    // Tolerate clock skew between the CA and its clients: five minutes, less for short lifetimes
    // so that the share of a lifetime left (root renewal) stays close to what was asked for.
    let skew = (lifetime / 10).min(Duration::from_secs(300));
    params.not_before = now - skew;
    params.not_after = now + lifetime;
}

pub(super) fn unix_seconds(t: SystemTime) -> i64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

pub(super) fn serial() -> SerialNumber {
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

pub(super) fn certs(
    pem: &str,
    file: &'static str,
) -> Result<Vec<CertificateDer<'static>>, CaError> {
    let certs: Vec<_> = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<_, _>>()
        .map_err(|e| invalid(file, e))?;
    if certs.is_empty() {
        return Err(invalid(file, "no certificate in it"));
    }
    Ok(certs)
}

pub(super) fn single_cert(
    pem: &str,
    file: &'static str,
) -> Result<CertificateDer<'static>, CaError> {
    Ok(certs(pem, file)?.remove(0))
}

/// Each certificate is signed by the next; the last (the root) by itself.
pub(super) fn verify_chain(chain: &[CertificateDer<'_>]) -> Result<(), CaError> {
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
    crate::istio::trust_anchor::pem_certificate(der)
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
