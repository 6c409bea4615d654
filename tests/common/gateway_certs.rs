//! Certificates for gateway servers and the Kubernetes Secrets that carry them.

/// A CA and a certificate for `host` it signed: (CA, chain, key) in PEM.
pub fn issue(host: &str) -> (String, String, String) {
    let ca_key = rcgen::KeyPair::generate().expect("CA key");
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "gateway test CA");
    let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key).expect("CA");
    let key = rcgen::KeyPair::generate().expect("key");
    let leaf = rcgen::CertificateParams::new(vec![host.to_string()])
        .expect("params")
        .signed_by(&key, &ca)
        .expect("certificate");
    (ca.pem(), leaf.pem(), key.serialize_pem())
}

/// A `kubernetes.io/tls` Secret as written in a manifest (`stringData`).
pub fn tls_secret(namespace: &str, name: &str, chain: &str, key: &str) -> String {
    secret(namespace, name, &[("tls.crt", chain), ("tls.key", key)])
}

/// The same with the CA its holder verifies peers against (`ca.crt`).
pub fn tls_secret_with_ca(namespace: &str, name: &str, chain: &str, key: &str, ca: &str) -> String {
    secret(
        namespace,
        name,
        &[("tls.crt", chain), ("tls.key", key), ("ca.crt", ca)],
    )
}

fn secret(namespace: &str, name: &str, entries: &[(&str, &str)]) -> String {
    let indent = |pem: &str| pem.trim_end().replace('\n', "\n    ");
    let data: String = entries
        .iter()
        .map(|(key, pem)| format!("  {key}: |\n    {}\n", indent(pem)))
        .collect();
    format!(
        "apiVersion: v1
kind: Secret
metadata: {{name: {name}, namespace: {namespace}}}
type: kubernetes.io/tls
stringData:
{data}"
    )
}
