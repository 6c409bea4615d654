//! `meshpilot remote-secret`: the Secret that onboards a remote cluster, as `istioctl
//! create-remote-secret` writes it — a kubeconfig with the remote API server's CA and the bearer token
//! of a reader service account, created on the remote cluster when missing.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use base64::Engine;
use clap::Args;
use k8s_openapi::api::core::v1::{Secret, ServiceAccount};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::PostParams;
use kube::config::Kubeconfig;
use kube::{Api, Client};
use thiserror::Error;

#[derive(Debug, Clone, Args)]
pub struct RemoteSecretArgs {
    /// Kubeconfig of the remote cluster (its current context is used).
    #[arg(long, env = "MESHPILOT_REMOTE_KUBECONFIG")]
    pub kubeconfig: PathBuf,

    /// Cluster id the remote will have in the mesh (a DNS-1123 label).
    #[arg(long)]
    pub cluster_id: String,

    /// Namespace of the control plane, on both clusters.
    #[arg(long, default_value = "istio-system")]
    pub namespace: String,

    /// Service account on the remote whose token the Secret carries.
    #[arg(long, default_value = "istio-reader-service-account")]
    pub service_account: String,

    /// API server address to put in the Secret, when the primary reaches the remote differently.
    #[arg(long)]
    pub server: Option<String>,
}

#[derive(Debug, Error)]
pub enum RemoteSecretError {
    #[error(
        "cluster id {0:?} is not a DNS-1123 label (lowercase letters, digits and '-', at most 63)"
    )]
    ClusterId(String),
    #[error("cannot read kubeconfig {path}: {message}")]
    Kubeconfig { path: String, message: String },
    #[error("the kubeconfig's current context names no cluster with a server")]
    NoServer,
    #[error("remote cluster: {0}")]
    Kube(#[from] kube::Error),
    #[error("the token Secret {0} was not populated within 30s: is the token controller running?")]
    TokenTimeout(String),
}

/// Creates what is missing on the remote cluster and returns the Secret's YAML.
pub async fn generate(args: &RemoteSecretArgs) -> Result<String, RemoteSecretError> {
    if !is_dns_label(&args.cluster_id) {
        return Err(RemoteSecretError::ClusterId(args.cluster_id.clone()));
    }
    let read_error = |message: String| RemoteSecretError::Kubeconfig {
        path: args.kubeconfig.display().to_string(),
        message,
    };
    let kubeconfig =
        Kubeconfig::read_from(&args.kubeconfig).map_err(|e| read_error(e.to_string()))?;
    let (server, tls_server_name) =
        current_server(&kubeconfig).ok_or(RemoteSecretError::NoServer)?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .map_err(|e| read_error(e.to_string()))?;
    let client = Client::try_from(config)?;

    ensure_service_account(&client, &args.namespace, &args.service_account).await?;
    let (token, ca) =
        service_account_token(&client, &args.namespace, &args.service_account).await?;
    let server = args.server.clone().unwrap_or(server);
    Ok(secret_yaml(
        &args.cluster_id,
        &args.namespace,
        &server,
        tls_server_name.as_deref(),
        &ca,
        &token,
    ))
}

fn is_dns_label(s: &str) -> bool {
    let ok_char = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-';
    !s.is_empty()
        && s.len() <= 63
        && s.chars().all(ok_char)
        && !s.starts_with('-')
        && !s.ends_with('-')
}

fn current_server(kubeconfig: &Kubeconfig) -> Option<(String, Option<String>)> {
    let context_name = kubeconfig.current_context.as_ref()?;
    let context = kubeconfig
        .contexts
        .iter()
        .find(|c| &c.name == context_name)?
        .context
        .as_ref()?;
    let cluster = kubeconfig
        .clusters
        .iter()
        .find(|c| c.name == context.cluster)?
        .cluster
        .as_ref()?;
    Some((cluster.server.clone()?, cluster.tls_server_name.clone()))
}

async fn ensure_service_account(
    client: &Client,
    namespace: &str,
    name: &str,
) -> Result<(), RemoteSecretError> {
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
    if accounts.get_opt(name).await?.is_none() {
        let account = ServiceAccount {
            metadata: ObjectMeta {
                name: Some(name.to_string()),
                namespace: Some(namespace.to_string()),
                ..Default::default()
            },
            ..Default::default()
        };
        accounts.create(&PostParams::default(), &account).await?;
    }
    Ok(())
}

/// The token and CA of a long-lived service-account token Secret (`<sa>-istio-remote-secret-token`,
/// as istioctl names it on Kubernetes ≥ 1.24), created when missing.
async fn service_account_token(
    client: &Client,
    namespace: &str,
    account: &str,
) -> Result<(String, String), RemoteSecretError> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let name = format!("{account}-istio-remote-secret-token");
    if secrets.get_opt(&name).await?.is_none() {
        let secret = Secret {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                namespace: Some(namespace.to_string()),
                annotations: Some(BTreeMap::from([(
                    "kubernetes.io/service-account.name".to_string(),
                    account.to_string(),
                )])),
                ..Default::default()
            },
            type_: Some("kubernetes.io/service-account-token".to_string()),
            ..Default::default()
        };
        secrets.create(&PostParams::default(), &secret).await?;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let data = secrets.get(&name).await?.data.unwrap_or_default();
        let field = |k: &str| {
            data.get(k)
                .map(|v| String::from_utf8_lossy(&v.0).to_string())
        };
        if let (Some(token), Some(ca)) = (field("token"), field("ca.crt")) {
            return Ok((token, ca));
        }
        if tokio::time::Instant::now() > deadline {
            return Err(RemoteSecretError::TokenTimeout(format!(
                "{namespace}/{name}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn secret_yaml(
    id: &str,
    namespace: &str,
    server: &str,
    tls_server_name: Option<&str>,
    ca_pem: &str,
    token: &str,
) -> String {
    let ca = base64::engine::general_purpose::STANDARD.encode(ca_pem);
    let tls_server_name = tls_server_name
        .map(|n| format!("\n            tls-server-name: {n}"))
        .unwrap_or_default();
    format!(
        "# This file is autogenerated, do not edit.
apiVersion: v1
kind: Secret
metadata:
  annotations:
    networking.istio.io/cluster: {id}
  labels:
    istio/multiCluster: \"true\"
  name: istio-remote-secret-{id}
  namespace: {namespace}
stringData:
  {id}: |
    apiVersion: v1
    clusters:
    - cluster:
        certificate-authority-data: {ca}
        server: {server}{tls_server_name}
      name: {id}
    contexts:
    - context:
        cluster: {id}
        user: {id}
      name: {id}
    current-context: {id}
    kind: Config
    preferences: {{}}
    users:
    - name: {id}
      user:
        token: {token}
---
"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_ids_must_be_dns_labels() {
        assert!(is_dns_label("cluster-2"));
        assert!(!is_dns_label("Cluster2"));
        assert!(!is_dns_label("-x"));
        assert!(!is_dns_label(&"a".repeat(64)));
    }

    #[test]
    fn secret_carries_a_usable_kubeconfig() {
        let yaml = secret_yaml(
            "east",
            "istio-system",
            "https://10.0.0.1:6443",
            None,
            "PEM",
            "tok",
        );
        let secret: serde_json::Value =
            serde_yaml_ng::from_str(yaml.trim_end_matches("---\n")).unwrap();
        assert_eq!(secret["metadata"]["labels"]["istio/multiCluster"], "true");
        assert_eq!(
            secret["metadata"]["annotations"]["networking.istio.io/cluster"],
            "east"
        );
        let kubeconfig = secret["stringData"]["east"].as_str().unwrap();
        let parsed = Kubeconfig::from_yaml(kubeconfig).unwrap();
        assert_eq!(current_server(&parsed).unwrap().0, "https://10.0.0.1:6443");
    }
}
