//! PKI inputs: CSRs (the CA service), CA bundles (`cacerts` Secret or `--ca-dir`) and CA keys in
//! every accepted form, through the CA's own entry points.

use std::sync::LazyLock;
use std::time::Duration;

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use meshpilot::security::ca::{CaBundle, CertificateAuthority, TtlPolicy};
use meshpilot::security::ca_key;
use meshpilot::security::identity::Identity;
use proptest::prelude::*;
use rcgen::{CertificateParams, KeyPair, SignatureAlgorithm};

use crate::mutate::{mutated_bytes, mutated_text};
use crate::{bounded, clear_refusal, fuzz};

const TTL: TtlPolicy = TtlPolicy {
    default: Duration::from_secs(24 * 3600),
    max: Duration::from_secs(90 * 24 * 3600),
};

const RSA_KEY: &str = include_str!("corpus/rsa-2048.pem");
const RSA_KEY_PKCS8: &str = include_str!("corpus/rsa-2048-pkcs8.pem");
const RSA_CSR: &str = include_str!("corpus/rsa-2048.csr");
const RSA_ROOT: &str = include_str!("corpus/rsa-root.pem");
const EC_P384_SEC1: &str = include_str!("corpus/ec-p384.pem");

/// Self-signed roots, an intermediate below one, and a plug-in RSA root.
static BUNDLES: LazyLock<Vec<CaBundle>> = LazyLock::new(|| {
    let root = CaBundle::self_signed_root("fuzz", meshpilot::security::ca::ROOT_LIFETIME)
        .expect("self-signed root");
    let intermediate = root
        .intermediate("fuzz", "cluster1", Duration::from_secs(3600))
        .expect("intermediate");
    let rsa = CaBundle {
        ca_cert: RSA_ROOT.into(),
        ca_key: RSA_KEY.into(),
        cert_chain: RSA_ROOT.into(),
        root_cert: RSA_ROOT.into(),
    };
    vec![root, intermediate, rsa]
});

static CA: LazyLock<CertificateAuthority> =
    LazyLock::new(|| CertificateAuthority::new(&BUNDLES[1], TTL).expect("the seed bundle loads"));

fn csr(alg: &'static SignatureAlgorithm) -> String {
    let key = KeyPair::generate_for(alg).expect("key");
    let params = CertificateParams::new(vec!["reviews.bookinfo.svc".to_string()]).expect("params");
    let request = params.serialize_request(&key).expect("CSR");
    request.pem().expect("PEM")
}

fn csr_seeds() -> Vec<String> {
    vec![
        csr(&rcgen::PKCS_ECDSA_P256_SHA256),
        csr(&rcgen::PKCS_ECDSA_P384_SHA384),
        csr(&rcgen::PKCS_ED25519),
        RSA_CSR.to_string(),
    ]
}

fn key_seeds() -> Vec<String> {
    vec![
        KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)
            .expect("key")
            .serialize_pem(),
        KeyPair::generate_for(&rcgen::PKCS_ED25519)
            .expect("key")
            .serialize_pem(),
        EC_P384_SEC1.to_string(),
        RSA_KEY.to_string(),
        RSA_KEY_PKCS8.to_string(),
    ]
}

fn as_strs(seeds: &[String]) -> Vec<&str> {
    seeds.iter().map(String::as_str).collect()
}

/// The label and DER of every PEM block of `texts`.
fn blocks(texts: &[String]) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for text in texts {
        let mut rest = text.as_str();
        while let Some(start) = rest.find("-----BEGIN ") {
            let after = &rest[start + 11..];
            let Some(label_end) = after.find("-----") else {
                break;
            };
            let label = &after[..label_end];
            let end_marker = format!("-----END {label}-----");
            let Some(end) = after.find(&end_marker) else {
                break;
            };
            let body: String = after[label_end + 5..end].split_whitespace().collect();
            let der = STANDARD.decode(body).expect("seed PEM is base64");
            out.push((label.to_string(), der));
            rest = &after[end + end_marker.len()..];
        }
    }
    out
}

fn pem(label: &str, der: &[u8]) -> String {
    let b64 = STANDARD.encode(der);
    let lines: Vec<&str> = b64
        .as_bytes()
        .chunks(64)
        .map(|c| std::str::from_utf8(c).expect("base64 is ASCII"))
        .collect();
    format!(
        "-----BEGIN {label}-----\n{}\n-----END {label}-----\n",
        lines.join("\n")
    )
}

/// Well-formed PEM around mutated DER: past the base64, into the ASN.1 parsers.
fn der_mutated(seeds: &[String]) -> impl Strategy<Value = String> {
    let blocks = blocks(seeds);
    let labels: Vec<String> = blocks.iter().map(|(label, _)| label.clone()).collect();
    let ders = blocks.into_iter().map(|(_, der)| der).collect();
    (mutated_bytes(ders, 4), 0..labels.len()).prop_map(move |(der, l)| pem(&labels[l], &der))
}

/// PEM text mutated as text, or around mutated DER.
fn pki_inputs(seeds: &[String]) -> impl Strategy<Value = String> {
    prop_oneof![mutated_text(&as_strs(seeds), 6), der_mutated(seeds)]
}

#[test]
fn csrs() {
    let seeds = csr_seeds();
    let identity = (
        prop_oneof![Just("bookinfo".to_string()), "\\PC{0,64}"],
        prop_oneof![Just("reviews".to_string()), "\\PC{0,64}"],
    );
    // Seconds as the CA service passes them on: absent, zero, or any positive count.
    let requested = proptest::option::of(prop_oneof![0..200 * 24 * 3600u64, any::<u64>()]);
    let inputs = (pki_inputs(&seeds), identity, requested);
    fuzz("csrs", inputs, |(pem, (namespace, account), requested)| {
        let identity = Identity::new("cluster.local", &namespace, &account);
        let requested = requested.map(Duration::from_secs);
        let signed = bounded(pem.len(), || CA.sign_csr(&pem, &identity, requested))?;
        match signed {
            Ok(chain) => prop_assert!(chain.len() >= 2, "a chain of {}", chain.len()),
            Err(e) => clear_refusal(&e, &["CSR: ", "requested lifetime", "signing failed"])?,
        }
        Ok(())
    });
}

/// Which of the four files a case replaces, or leaves out.
const FILES: [&str; 4] = [
    "ca-cert.pem",
    "ca-key.pem",
    "cert-chain.pem",
    "root-cert.pem",
];

#[test]
fn ca_bundles() {
    let mut pems: Vec<String> = BUNDLES
        .iter()
        .flat_map(|b| b.files().map(|(_, text)| text.to_string()))
        .collect();
    pems.extend(key_seeds());
    let inputs = (
        0..BUNDLES.len(),
        0..FILES.len(),
        prop_oneof![
            9 => pki_inputs(&pems).prop_map(Some),
            1 => Just(None),
        ],
    );
    fuzz("ca bundles", inputs, |(bundle, replaced, text)| {
        let seed = BUNDLES[bundle].files();
        let size =
            seed.iter().map(|(_, t)| t.len()).sum::<usize>() + text.as_ref().map_or(0, String::len);
        let get = |file: &str| match file == FILES[replaced] {
            true => text.clone(),
            false => seed
                .iter()
                .find(|(f, _)| *f == file)
                .map(|(_, t)| t.to_string()),
        };
        let loaded = bounded(size, || {
            CaBundle::from_files(get).and_then(|b| CertificateAuthority::new(&b, TTL))
        })?;
        if let Err(e) = loaded {
            clear_refusal(&e, &["CA bundle: "])?;
        }
        Ok(())
    });
}

#[test]
fn ca_keys() {
    let seeds = key_seeds();
    fuzz("ca keys", pki_inputs(&seeds), |pem| {
        if let Err(e) = bounded(pem.len(), || ca_key::parse(&pem))? {
            clear_refusal(&e, &[])?;
            prop_assert!(e.to_string().contains("key"), "says nothing of a key: {e}");
        }
        Ok(())
    });
}
