//! A primary with a config cluster (reviewing tokens) and one remote, `east`, onboarded by Secret.

use std::path::Path;
use std::time::Duration;

use test_apiserver::{TestApiServer, User};

use super::{peer_python, start_meshpilot_with};

const BOUND: Duration = Duration::from_secs(20);

pub struct Primary {
    pub config: TestApiServer,
    pub east: TestApiServer,
    _kubeconfig: tempfile::NamedTempFile,
    pub mp: meshpilot::app::Running,
}

/// Starts meshpilot as cluster `primary` with `extra` flags; `east` may still be syncing.
pub async fn primary_with_remote(extra: &[&str]) -> Primary {
    primary_with_prepared_remote(extra, |_| {}).await
}

/// As [`primary_with_remote`], with `east` prepared by `prepare` before meshpilot starts.
pub async fn primary_with_prepared_remote(
    extra: &[&str],
    prepare: impl FnOnce(&TestApiServer),
) -> Primary {
    let config = TestApiServer::start().await;
    config.apply_yaml("apiVersion: v1\nkind: Namespace\nmetadata: {name: istio-system}\n");
    let east = TestApiServer::start().await;
    prepare(&east);
    east.add_token(
        "east-reader",
        User::service_account("istio-system", "istio-reader-service-account"),
    );
    config.apply(serde_json::json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "istio-remote-secret-east", "namespace": "istio-system",
                     "labels": {"istio/multiCluster": "true"}},
        "stringData": {"east": east.kubeconfig("east-reader")}
    }));
    let kubeconfig = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(kubeconfig.path(), config.kubeconfig(config.admin_token())).expect("write");
    let path = kubeconfig.path().to_str().expect("utf-8 path").to_string();
    let mut flags = vec!["--kubeconfig", &path, "--cluster-id", "primary"];
    flags.extend_from_slice(extra);
    let mp = start_meshpilot_with(&flags).await;
    Primary {
        config,
        east,
        _kubeconfig: kubeconfig,
        mp,
    }
}

pub fn csr_file(dir: &Path) -> std::path::PathBuf {
    let key = rcgen::KeyPair::generate().unwrap();
    let params = rcgen::CertificateParams::new(vec!["ignored.example".to_string()]).unwrap();
    let path = dir.join("csr.pem");
    std::fs::write(
        &path,
        params.serialize_request(&key).unwrap().pem().unwrap(),
    )
    .unwrap();
    path
}

/// Istio's CA API called by grpcio (tests/peers/ca_client.py) with a bearer token.
pub async fn grpcio_create_certificate(
    mp: &meshpilot::app::Running,
    dir: &Path,
    token: &str,
    cluster: &str,
) -> serde_json::Value {
    grpcio_certificate_for(mp, dir, (token, cluster), None).await
}

/// As [`grpcio_create_certificate`], asking for `impersonate` as a node proxy does.
pub async fn grpcio_certificate_for(
    mp: &meshpilot::app::Running,
    dir: &Path,
    (token, cluster): (&str, &str),
    impersonate: Option<&str>,
) -> serde_json::Value {
    let root = dir.join("root.pem");
    std::fs::write(&root, mp.ca.current().root_pem()).unwrap();
    let csr = csr_file(dir);
    let output = tokio::process::Command::new(peer_python())
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/peers/ca_client.py"
        ))
        .arg(mp.secure_xds_addr.to_string())
        .args([&root, &csr])
        .args([token, cluster])
        .args(impersonate.map(|id| ["0", id]).into_iter().flatten())
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(BOUND, output)
        .await
        .expect("CA call finished")
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("{e}: {stdout}\n{}", String::from_utf8_lossy(&output.stderr)))
}
