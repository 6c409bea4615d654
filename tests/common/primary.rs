//! A primary with a config cluster (reviewing tokens) and one remote, `east`, onboarded by Secret.

use test_apiserver::{TestApiServer, User};

use super::start_meshpilot_with;

pub struct Primary {
    pub config: TestApiServer,
    pub east: TestApiServer,
    _kubeconfig: tempfile::NamedTempFile,
    pub mp: meshpilot::app::Running,
}

/// Starts meshpilot as cluster `primary` with `extra` flags; `east` may still be syncing.
pub async fn primary_with_remote(extra: &[&str]) -> Primary {
    let config = TestApiServer::start().await;
    config.apply_yaml("apiVersion: v1\nkind: Namespace\nmetadata: {name: istio-system}\n");
    let east = TestApiServer::start().await;
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
