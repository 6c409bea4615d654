//! End to end: plug-in CA keys in every PEM form Istio accepts (PKCS#1 RSA, SEC1 EC, PKCS#8), made by
//! openssl, loaded from a directory and from the `cacerts` Secret; each signs CSRs whose chains
//! verify (x509-parser and `openssl verify`), and a real Envoy connects with a certificate it issued.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;
use meshpilot::security::identity::Identity;
use test_apiserver::TestApiServer;
use x509_parser::prelude::{FromDer, X509Certificate};

const BOUND: Duration = Duration::from_secs(20);
const SIDECAR: &str = "sidecar~10.1.1.11~reviews-v1-7f9c8d.bookinfo~bookinfo.svc.cluster.local";
const REVIEWS_CLUSTER: &str = "outbound|9080||reviews.bookinfo.svc.cluster.local";
const SHA256_WITH_RSA: &str = "1.2.840.113549.1.1.11";
const ECDSA_SHA256: &str = "1.2.840.10045.4.3.2";
const ECDSA_SHA384: &str = "1.2.840.10045.4.3.3";
const RSA_KEY: &str = "1.2.840.113549.1.1.1";
const EC_KEY: &str = "1.2.840.10045.2.1";

/// A CA key form: the openssl command that writes it, its PEM label, and the signature algorithm
/// the CA must sign with.
struct Form {
    name: &'static str,
    genkey: &'static [&'static str],
    label: &'static str,
    signature: &'static str,
}

const FORMS: &[Form] = &[
    Form {
        name: "PKCS#1 RSA 2048",
        genkey: &["genrsa", "-traditional", "-out", "ca-key.pem", "2048"],
        label: "BEGIN RSA PRIVATE KEY",
        signature: SHA256_WITH_RSA,
    },
    Form {
        name: "SEC1 EC P-256",
        genkey: &[
            "ecparam",
            "-name",
            "prime256v1",
            "-genkey",
            "-noout",
            "-out",
            "ca-key.pem",
        ],
        label: "BEGIN EC PRIVATE KEY",
        signature: ECDSA_SHA256,
    },
    Form {
        name: "SEC1 EC P-384",
        genkey: &[
            "ecparam",
            "-name",
            "secp384r1",
            "-genkey",
            "-noout",
            "-out",
            "ca-key.pem",
        ],
        label: "BEGIN EC PRIVATE KEY",
        signature: ECDSA_SHA384,
    },
    Form {
        name: "PKCS#8 RSA 4096",
        genkey: &[
            "genpkey",
            "-algorithm",
            "RSA",
            "-pkeyopt",
            "rsa_keygen_bits:4096",
            "-out",
            "ca-key.pem",
        ],
        label: "BEGIN PRIVATE KEY",
        signature: SHA256_WITH_RSA,
    },
    Form {
        name: "PKCS#8 EC P-384",
        genkey: &[
            "genpkey",
            "-algorithm",
            "EC",
            "-pkeyopt",
            "ec_paramgen_curve:P-384",
            "-out",
            "ca-key.pem",
        ],
        label: "BEGIN PRIVATE KEY",
        signature: ECDSA_SHA384,
    },
];

fn openssl(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl runs");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// A self-signed root CA in Istio's cacerts layout, its key written by `genkey`.
fn cacerts(dir: &Path, genkey: &[&str]) {
    openssl(dir, genkey);
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-new",
            "-key",
            "ca-key.pem",
            "-subj",
            "/O=cluster.local/CN=plug-in root",
            "-days",
            "3650",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
            "-out",
            "ca-cert.pem",
        ],
    );
    for copy in ["cert-chain.pem", "root-cert.pem"] {
        std::fs::copy(dir.join("ca-cert.pem"), dir.join(copy)).unwrap();
    }
}

fn der(pem: &str) -> Vec<u8> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::from_pem_slice(pem.as_bytes())
        .unwrap()
        .to_vec()
}

/// Signs an openssl CSR (RSA or EC, `newkey`) with the running CA and checks the chain.
fn sign_and_verify(mp: &meshpilot::app::Running, dir: &Path, form: &Form, newkey: &[&str]) {
    let mut args = vec![
        "req",
        "-new",
        "-nodes",
        "-keyout",
        "leaf-key.pem",
        "-subj",
        "/CN=ignored",
    ];
    args.extend_from_slice(newkey);
    args.extend(["-out", "leaf.csr"]);
    openssl(dir, &args);
    let csr = std::fs::read_to_string(dir.join("leaf.csr")).unwrap();
    let identity = Identity::new("cluster.local", "shop", "web");
    let chain = mp.ca.current().sign_csr(&csr, &identity, None).unwrap();
    assert_eq!(chain.len(), 2, "{}: leaf and root", form.name);

    let (leaf_der, root_der) = (der(&chain[0]), der(&chain[1]));
    let (_, leaf) = X509Certificate::from_der(&leaf_der).unwrap();
    let (_, root) = X509Certificate::from_der(&root_der).unwrap();
    leaf.verify_signature(Some(root.public_key()))
        .unwrap_or_else(|e| panic!("{}: leaf not signed by the CA: {e}", form.name));
    assert_eq!(
        leaf.signature_algorithm.algorithm.to_id_string(),
        form.signature,
        "{}: signature algorithm",
        form.name
    );
    let leaf_key = if newkey.contains(&"rsa:2048") {
        RSA_KEY
    } else {
        EC_KEY
    };
    assert_eq!(
        leaf.public_key().algorithm.algorithm.to_id_string(),
        leaf_key,
        "{}: the leaf key follows the CSR",
        form.name
    );

    std::fs::write(dir.join("leaf.pem"), &chain[0]).unwrap();
    std::fs::write(dir.join("root.pem"), &chain[1]).unwrap();
    let verified = openssl(dir, &["verify", "-CAfile", "root.pem", "leaf.pem"]);
    assert!(
        verified.contains("leaf.pem: OK"),
        "{}: {verified}",
        form.name
    );
}

/// A real Envoy on the secure port, with a certificate this CA issued, gets its config.
async fn envoy_connects(mp: &meshpilot::app::Running, form: &Form) {
    let certs = workload_certs(mp, "bookinfo", "bookinfo-reviews");
    let envoy = Envoy::start_with(EnvoyOptions {
        xds: mp.secure_xds_addr,
        replicas: &[],
        node_id: SIDECAR,
        metadata: &[("CLUSTER_ID", "cluster1")],
        labels: &[],
        mode: AdsMode::Sotw,
        workload: certs.clone(),
        xds_tls: Some(XdsTls {
            client: Some((certs.chain.clone(), certs.key.clone())),
            root: certs.root.clone(),
            sni: "istiod.istio-system.svc".into(),
        }),
        netns: None,
    })
    .await;
    wait_for(
        &format!("{}: Envoy config over mTLS", form.name),
        BOUND,
        || {
            let envoy = &envoy;
            async move { (!envoy.endpoints(REVIEWS_CLUSTER).await.is_empty()).then_some(()) }
        },
    )
    .await;
    assert_eq!(envoy.rejected_updates().await, 0);
}

#[tokio::test]
async fn every_key_form_starts_the_ca_and_signs() {
    let _ports = sidecar_ports().await;
    let config = copy_tree(Path::new(EXAMPLE));
    for form in FORMS {
        let dir = tempfile::tempdir().unwrap();
        cacerts(dir.path(), form.genkey);
        let key = std::fs::read_to_string(dir.path().join("ca-key.pem")).unwrap();
        assert!(
            key.contains(form.label),
            "{}: openssl wrote {key}",
            form.name
        );

        let ca_dir = dir.path().to_str().unwrap();
        let mp = start_meshpilot(config.path(), &["--ca-dir", ca_dir]).await;
        assert_eq!(
            der(mp.ca.current().root_pem()),
            der(&std::fs::read_to_string(dir.path().join("ca-cert.pem")).unwrap())
        );
        sign_and_verify(
            &mp,
            dir.path(),
            form,
            &["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"],
        );
        sign_and_verify(&mp, dir.path(), form, &["-newkey", "rsa:2048"]);
        envoy_connects(&mp, form).await;
    }
}

#[tokio::test]
async fn the_cacerts_secret_takes_every_form_too() {
    let api = TestApiServer::start().await;
    api.apply_yaml("apiVersion: v1\nkind: Namespace\nmetadata: {name: istio-system}\n");
    let kubeconfig = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(kubeconfig.path(), api.kubeconfig(api.admin_token())).unwrap();
    for form in FORMS.iter().filter(|f| !f.name.contains("4096")) {
        let dir = tempfile::tempdir().unwrap();
        cacerts(dir.path(), form.genkey);
        let file = |f: &str| std::fs::read_to_string(dir.path().join(f)).unwrap();
        api.apply(serde_json::json!({
            "apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": "cacerts", "namespace": "istio-system"},
            "stringData": {"ca-cert.pem": file("ca-cert.pem"), "ca-key.pem": file("ca-key.pem"),
                           "cert-chain.pem": file("cert-chain.pem"), "root-cert.pem": file("root-cert.pem")}
        }));
        let mp = start_meshpilot_with(&[
            "--kubeconfig",
            kubeconfig.path().to_str().unwrap(),
            "--cluster-id",
            "primary",
        ])
        .await;
        assert_eq!(
            der(mp.ca.current().root_pem()),
            der(&file("ca-cert.pem")),
            "{}",
            form.name
        );
        sign_and_verify(
            &mp,
            dir.path(),
            form,
            &["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"],
        );
    }
}

#[tokio::test]
async fn encrypted_and_unsupported_keys_are_refused_naming_the_file() {
    let config = copy_tree(Path::new(EXAMPLE));
    let cases: [(&str, &[&str], &str); 3] = [
        (
            "encrypted PKCS#1",
            &[
                "genrsa",
                "-traditional",
                "-aes256",
                "-passout",
                "pass:secret",
                "-out",
                "ca-key.pem",
                "2048",
            ],
            "encrypted",
        ),
        (
            "encrypted PKCS#8",
            &[
                "genpkey",
                "-algorithm",
                "EC",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-aes256",
                "-pass",
                "pass:secret",
                "-out",
                "ca-key.pem",
            ],
            "encrypted",
        ),
        (
            "Ed25519",
            &["genpkey", "-algorithm", "ed25519", "-out", "ca-key.pem"],
            "algorithm 1.3.101.112",
        ),
    ];
    for (what, genkey, problem) in cases {
        let dir = tempfile::tempdir().unwrap();
        // The certificate needs a usable key: make it with a plain one, then swap the key in.
        cacerts(
            dir.path(),
            &[
                "ecparam",
                "-name",
                "prime256v1",
                "-genkey",
                "-noout",
                "-out",
                "ca-key.pem",
            ],
        );
        std::fs::remove_file(dir.path().join("ca-key.pem")).unwrap();
        openssl(dir.path(), genkey);
        let ca_dir = dir.path().to_str().unwrap();
        let flags = [
            "--config-dir",
            config.path().to_str().unwrap(),
            "--ca-dir",
            ca_dir,
        ];
        let error = match try_start_meshpilot(&flags).await {
            Ok(_) => panic!("{what}: started"),
            Err(e) => e.to_string(),
        };
        assert!(
            error.contains(ca_dir) && error.contains("ca-key.pem") && error.contains(problem),
            "{what}: {error}"
        );
        assert!(
            error.contains("BEGIN RSA PRIVATE KEY")
                && error.contains("BEGIN EC PRIVATE KEY")
                && error.contains("BEGIN PRIVATE KEY"),
            "{what}: the accepted forms are named: {error}"
        );
    }
}
