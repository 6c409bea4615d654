//! The CA's private key in every PEM form Istio's plug-in CA accepts: PKCS#1 RSA (`BEGIN RSA
//! PRIVATE KEY`), SEC1 EC (`BEGIN EC PRIVATE KEY`) and PKCS#8 (`BEGIN PRIVATE KEY`). rcgen's ring
//! provider reads only PKCS#8 v1 whose EC key holds its public key and no curve parameters, so every
//! form is re-wrapped into exactly that.

use pkcs8::der::asn1::{BitStringRef, Null, OctetStringRef};
use pkcs8::der::Encode;
use pkcs8::spki::AlgorithmIdentifier;
use pkcs8::{ObjectIdentifier, PrivateKeyInfo, PrivateKeyInfoRef};
use rcgen::KeyPair;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::PrivateKeyDer;
use sec1::{EcParameters, EcPrivateKey};
use thiserror::Error;

use crate::text::Quoted;

/// What the errors tell the operator to give instead.
const ACCEPTED: &str = "accepted: unencrypted PEM as PKCS#1 RSA (BEGIN RSA PRIVATE KEY), \
     SEC1 EC (BEGIN EC PRIVATE KEY) or PKCS#8 (BEGIN PRIVATE KEY); RSA of 2048 to 8192 bits, \
     ECDSA P-256 or P-384";

const P256: ObjectIdentifier = ObjectIdentifier::new_unwrap("1.2.840.10045.3.1.7");
const P384: ObjectIdentifier = ObjectIdentifier::new_unwrap("1.3.132.0.34");
const RSA_BITS: std::ops::RangeInclusive<usize> = 2048..=8192;

#[derive(Debug, Error)]
pub enum KeyFormError {
    #[error("the private key is encrypted ({ACCEPTED})")]
    Encrypted,
    #[error("no private key in it, found {0} ({ACCEPTED})")]
    NotAKey(String),
    #[error("{0} ({ACCEPTED})")]
    Unsupported(String),
    #[error("malformed {form}: {problem}")]
    Malformed { form: &'static str, problem: String },
    #[error(
        "the EC key does not carry its public key; re-export it with `openssl ec` ({ACCEPTED})"
    )]
    NoPublicKey,
}

/// Parses a CA key in any accepted form.
pub fn parse(pem: &str) -> Result<KeyPair, KeyFormError> {
    if pem.contains("BEGIN ENCRYPTED PRIVATE KEY") || pem.contains("Proc-Type: 4,ENCRYPTED") {
        return Err(KeyFormError::Encrypted);
    }
    let der = PrivateKeyDer::from_pem_slice(pem.as_bytes())
        .map_err(|_| KeyFormError::NotAKey(first_label(pem)))?;
    let pkcs8 = match &der {
        PrivateKeyDer::Pkcs1(key) => rsa_pkcs8(key.secret_pkcs1_der())?,
        PrivateKeyDer::Sec1(key) => ec_pkcs8(key.secret_sec1_der(), None)?,
        PrivateKeyDer::Pkcs8(key) => normalize_pkcs8(key.secret_pkcs8_der())?,
        _ => return Err(KeyFormError::NotAKey(first_label(pem))),
    };
    KeyPair::try_from(pkcs8.as_slice()).map_err(|e| KeyFormError::Malformed {
        form: "key",
        problem: e.to_string(),
    })
}

/// The first PEM label, for saying what was found instead of a key.
fn first_label(pem: &str) -> String {
    pem.lines()
        .find_map(|l| l.trim().strip_prefix("-----BEGIN ")?.strip_suffix("-----"))
        .map_or_else(
            || "no PEM block".to_string(),
            |label| format!("a {} block", Quoted(label)),
        )
}

fn malformed(form: &'static str) -> impl Fn(pkcs8::der::Error) -> KeyFormError {
    move |e| KeyFormError::Malformed {
        form,
        problem: e.to_string(),
    }
}

/// PKCS#1 RSAPrivateKey → PKCS#8 with rsaEncryption, once its size is checked.
fn rsa_pkcs8(pkcs1_der: &[u8]) -> Result<Vec<u8>, KeyFormError> {
    let key =
        pkcs1::RsaPrivateKeyRef::try_from(pkcs1_der).map_err(|e| KeyFormError::Malformed {
            form: "PKCS#1 RSA key",
            problem: e.to_string(),
        })?;
    let modulus = key.modulus.as_bytes();
    let bits = modulus.len() * 8 - modulus.first().map_or(8, |b| b.leading_zeros() as usize);
    if !RSA_BITS.contains(&bits) {
        return Err(KeyFormError::Unsupported(format!(
            "an RSA key of {bits} bits"
        )));
    }
    let info: PrivateKeyInfo<Null, &OctetStringRef, BitStringRef<'_>> = PrivateKeyInfo::new(
        AlgorithmIdentifier {
            oid: pkcs1::ALGORITHM_OID,
            parameters: Some(Null),
        },
        OctetStringRef::new(pkcs1_der).map_err(malformed("PKCS#1 RSA key"))?,
    );
    info.to_der().map_err(malformed("PKCS#8 key"))
}

/// SEC1 ECPrivateKey → PKCS#8 with id-ecPublicKey and the named curve; the inner key keeps its
/// public key and drops its curve parameters (`curve` is the PKCS#8 one, when re-wrapping).
fn ec_pkcs8(sec1_der: &[u8], curve: Option<ObjectIdentifier>) -> Result<Vec<u8>, KeyFormError> {
    let key = EcPrivateKey::try_from(sec1_der).map_err(|e| KeyFormError::Malformed {
        form: "SEC1 EC key",
        problem: e.to_string(),
    })?;
    let inner = key.parameters.and_then(EcParameters::named_curve);
    let curve = curve
        .or(inner)
        .ok_or_else(|| KeyFormError::Unsupported("an EC key that names no curve".to_string()))?;
    if curve != P256 && curve != P384 {
        return Err(KeyFormError::Unsupported(format!(
            "an EC key on curve {curve}"
        )));
    }
    if key.public_key.is_none() {
        return Err(KeyFormError::NoPublicKey);
    }
    let bare = EcPrivateKey {
        parameters: None,
        ..key
    }
    .to_der()
    .map_err(malformed("SEC1 EC key"))?;
    let info: PrivateKeyInfo<ObjectIdentifier, &OctetStringRef, BitStringRef<'_>> =
        PrivateKeyInfo::new(
            AlgorithmIdentifier {
                oid: sec1::ALGORITHM_OID,
                parameters: Some(curve),
            },
            OctetStringRef::new(&bare).map_err(malformed("SEC1 EC key"))?,
        );
    info.to_der().map_err(malformed("PKCS#8 key"))
}

/// PKCS#8 of RSA or EC, re-wrapped into the shape ring reads.
fn normalize_pkcs8(der: &[u8]) -> Result<Vec<u8>, KeyFormError> {
    let info = PrivateKeyInfoRef::try_from(der).map_err(|e| KeyFormError::Malformed {
        form: "PKCS#8 key",
        problem: e.to_string(),
    })?;
    let inner = info.private_key.as_bytes();
    match info.algorithm.oid {
        pkcs1::ALGORITHM_OID => rsa_pkcs8(inner),
        sec1::ALGORITHM_OID => {
            let curve = info
                .algorithm
                .parameters
                .and_then(|p| p.decode_as::<ObjectIdentifier>().ok());
            ec_pkcs8(inner, curve)
        }
        other => Err(KeyFormError::Unsupported(format!(
            "a key of algorithm {other}"
        ))),
    }
}
