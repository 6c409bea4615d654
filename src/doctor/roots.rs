//! One root of trust: the root certificate each cluster's workloads trust (ConfigMap
//! `istio-ca-root-cert`, key `root-cert.pem`) must be the mesh's, or mTLS between clusters fails
//! at the handshake.

use std::collections::BTreeSet;

use rustls::crypto::hash::{Hash, HashAlgorithm};
use rustls::crypto::CryptoProvider;
use rustls::SupportedCipherSuite;

use super::report::Check;
use crate::security::trust::{ROOT_CONFIGMAP, ROOT_KEY};
use crate::text::clip;

const NAME: &str = "root";

/// SHA-256 from the installed crypto provider (the one the Cargo feature chose).
#[derive(Clone, Copy)]
pub struct Sha256(&'static dyn Hash);

impl Sha256 {
    pub fn from_provider() -> Option<Self> {
        let provider = CryptoProvider::get_default()?;
        provider
            .cipher_suites
            .iter()
            .map(|suite| match suite {
                SupportedCipherSuite::Tls12(s) => s.common.hash_provider,
                SupportedCipherSuite::Tls13(s) => s.common.hash_provider,
            })
            .find(|h| h.algorithm() == HashAlgorithm::SHA256)
            .map(Self)
    }

    fn hex(&self, data: &[u8]) -> String {
        self.0
            .hash(data)
            .as_ref()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

/// One certificate, as reports name it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cert {
    pub subject: String,
    pub sha256: String,
}

impl std::fmt::Display for Cert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (sha256 {})", self.subject, self.sha256)
    }
}

/// The certificates of a PEM bundle and where it came from.
#[derive(Clone, Debug)]
pub struct Bundle {
    pub origin: String,
    pub certs: Vec<Cert>,
}

impl Bundle {
    pub fn parse(origin: String, pem: &str, sha: Sha256) -> Result<Self, String> {
        let mut certs = Vec::new();
        for block in x509_parser::pem::Pem::iter_from_buffer(pem.as_bytes()) {
            let block = block.map_err(|e| clip(&format!("not PEM: {e}")))?;
            if block.label != "CERTIFICATE" {
                continue;
            }
            let (_, cert) = x509_parser::parse_x509_certificate(&block.contents)
                .map_err(|e| clip(&format!("not a certificate: {e}")))?;
            certs.push(Cert {
                subject: clip(&cert.subject().to_string()),
                sha256: sha.hex(&block.contents),
            });
        }
        if certs.is_empty() {
            return Err("no PEM certificate".into());
        }
        Ok(Self { origin, certs })
    }

    /// Trusting any certificate of the reference trusts the mesh root (a bundle holds old and
    /// new roots while one is rotated).
    fn shares(&self, other: &Bundle) -> bool {
        let ours: BTreeSet<&str> = self.certs.iter().map(|c| c.sha256.as_str()).collect();
        other.certs.iter().any(|c| ours.contains(c.sha256.as_str()))
    }

    fn first(&self) -> &Cert {
        // `parse` refuses empty bundles.
        &self.certs[0]
    }
}

/// What a cluster's root ConfigMap held: its bundle's text, none, or why it could not be read.
pub type Published = Result<Option<String>, String>;

/// Whether the cluster's published root is the mesh root (`reference`).
pub fn check(
    namespace: &str,
    published: &Published,
    reference: Option<&Bundle>,
    sha: Sha256,
) -> Check {
    let object = format!("ConfigMap {namespace}/{ROOT_CONFIGMAP}");
    let pem = match published {
        Err(e) => return Check::warn(NAME, format!("cannot read {object}: {e}; root not checked")),
        Ok(None) => {
            return Check::warn(
                NAME,
                format!("no {object} (not injected yet?): workloads here trust no mesh root"),
            )
        }
        Ok(Some(pem)) => pem,
    };
    let bundle = match Bundle::parse(object.clone(), pem, sha) {
        Ok(b) => b,
        Err(e) => return Check::fail(NAME, format!("{object} key {ROOT_KEY}: {e}")),
    };
    match reference {
        None => Check::ok(NAME, format!("{object} holds {}", bundle.first())),
        Some(mesh) if bundle.shares(mesh) => {
            Check::ok(NAME, format!("trusts the mesh root {}", mesh.first()))
        }
        Some(mesh) => Check::fail(
            NAME,
            format!(
                "foreign root: {object} holds {}, not the mesh root {} from {}",
                bundle.first(),
                mesh.first(),
                mesh.origin
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::report::Status;

    fn root(name: &str) -> String {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        params.self_signed(&key).unwrap().pem()
    }

    fn sha() -> Sha256 {
        crate::security::install_crypto_provider();
        Sha256::from_provider().unwrap()
    }

    #[test]
    fn a_different_root_is_foreign_and_a_rotation_bundle_is_not() {
        let (mesh, other) = (root("mesh root"), root("other root"));
        let reference = Bundle::parse("--root-cert r.pem".into(), &mesh, sha()).unwrap();
        assert_eq!(reference.first().sha256.len(), 64);
        let same = check(
            "istio-system",
            &Ok(Some(mesh.clone())),
            Some(&reference),
            sha(),
        );
        assert_eq!(same.status, Status::Ok, "{}", same.message);
        let foreign = check(
            "istio-system",
            &Ok(Some(other.clone())),
            Some(&reference),
            sha(),
        );
        assert_eq!(foreign.status, Status::Fail);
        assert!(
            foreign.message.starts_with("foreign root: ConfigMap istio-system/istio-ca-root-cert holds CN=other root (sha256 ")
                && foreign.message.contains("not the mesh root CN=mesh root")
                && foreign.message.contains("from --root-cert r.pem"),
            "{}",
            foreign.message
        );
        let rotating = format!("{other}{mesh}");
        assert_eq!(
            check("istio-system", &Ok(Some(rotating)), Some(&reference), sha()).status,
            Status::Ok
        );
    }

    #[test]
    fn missing_or_unreadable_roots_warn_and_garbage_fails() {
        assert_eq!(check("ns", &Ok(None), None, sha()).status, Status::Warn);
        assert_eq!(
            check("ns", &Err("403".into()), None, sha()).status,
            Status::Warn
        );
        assert_eq!(
            check("ns", &Ok(Some("hello".into())), None, sha()).status,
            Status::Fail
        );
    }
}
