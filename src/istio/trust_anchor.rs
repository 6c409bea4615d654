//! Trust anchors as Istio's trust bundle takes them (pilot/pkg/trustbundle/trustbundle.go
//! `verifyTrustAnchor`): X.509 CA certificates, each kept as one PEM block.

use x509_parser::prelude::{FromDer, X509Certificate};

/// Every certificate of `pem`, each checked to be a CA and written as its own PEM block. Unlike
/// istiod, which checks the first block of an entry only, every block is checked, so a bundle never
/// carries a leaf that proxies would be told to trust.
pub fn ca_certificates(pem: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for (i, block) in x509_parser::pem::Pem::iter_from_buffer(pem.as_bytes()).enumerate() {
        let block = block.map_err(|e| format!("PEM block {i}: {e}"))?;
        if block.label != "CERTIFICATE" {
            return Err(format!(
                "PEM block {i} is a {}, not a CERTIFICATE",
                block.label
            ));
        }
        out.push(ca_certificate(&block.contents).map_err(|e| format!("PEM block {i}: {e}"))?);
    }
    if out.is_empty() {
        return Err("holds no PEM certificate".into());
    }
    Ok(out)
}

/// A DER certificate checked to be a CA, as PEM.
pub fn ca_certificate(der: &[u8]) -> Result<String, String> {
    let (_, cert) =
        X509Certificate::from_der(der).map_err(|e| format!("not an X.509 certificate: {e}"))?;
    if !cert.is_ca() {
        return Err(format!("{} is not a CA certificate", cert.subject()));
    }
    Ok(pem_certificate(der))
}

/// A DER certificate as a PEM block.
pub fn pem_certificate(der: &[u8]) -> String {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = String::from("-----BEGIN CERTIFICATE-----\n");
    for line in b64.as_bytes().chunks(64) {
        // Base64 is ASCII.
        out.push_str(std::str::from_utf8(line).unwrap_or_default());
        out.push('\n');
    }
    out.push_str("-----END CERTIFICATE-----\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn certificate(ca: bool) -> String {
        let mut params = rcgen::CertificateParams::new(vec!["a.example".into()]).unwrap();
        if ca {
            params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        }
        let key = rcgen::KeyPair::generate().unwrap();
        params.self_signed(&key).unwrap().pem()
    }

    #[test]
    fn each_ca_certificate_is_kept_as_its_own_block() {
        let (a, b) = (certificate(true), certificate(true));
        let both = format!("{a}\n{b}");
        let split = ca_certificates(&both).unwrap();
        assert_eq!(split.len(), 2);
        assert_eq!(
            split[0].replace(['\r', '\n'], ""),
            a.replace(['\r', '\n'], "")
        );
        assert_eq!(ca_certificates(&split.concat()).unwrap(), split);
    }

    #[test]
    fn a_leaf_a_key_or_nothing_is_refused_by_block() {
        let leaf = ca_certificates(&format!("{}{}", certificate(true), certificate(false)));
        assert!(leaf.unwrap_err().starts_with("PEM block 1: "));
        let key = rcgen::KeyPair::generate().unwrap().serialize_pem();
        assert!(ca_certificates(&key).unwrap_err().contains("PRIVATE KEY"));
        assert_eq!(
            ca_certificates("junk").unwrap_err(),
            "holds no PEM certificate"
        );
    }
}
