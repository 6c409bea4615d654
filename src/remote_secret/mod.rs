//! `meshpilot remote-secret`: the Secret that onboards a remote cluster, as `istioctl
//! create-remote-secret` writes it — a kubeconfig with the remote API server's CA and the bearer token
//! of a reader service account, created on the remote cluster (with its namespace and RBAC) when
//! missing.

mod reader;

use std::path::PathBuf;

use base64::Engine;
use clap::{ArgAction, Args};
use kube::config::Kubeconfig;
use thiserror::Error;

use crate::kube_error::WithCauses;
use crate::text::{clip, quote};
use reader::Remote;

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

    /// Create the system namespace, the service account, its token Secret and the reader RBAC
    /// (the reader RBAC of the manifests) where missing; `false` only reads an existing account's token.
    #[arg(long, default_value_t = true, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub create_service_account: bool,
}

#[derive(Debug, Error)]
pub enum RemoteSecretError {
    #[error(
        "cluster id {} is not a DNS-1123 label (lowercase letters, digits and '-', at most 63)",
        quote(.0)
    )]
    ClusterId(String),
    #[error("cannot read kubeconfig {path}: {message}")]
    Kubeconfig { path: String, message: String },
    #[error("kubeconfig {0}: its current context names no cluster with a server")]
    NoServer(String),
    #[error("cluster {cluster} ({server}): {verb} {object} failed: {}", WithCauses(.source.as_ref()))]
    Api {
        cluster: String,
        server: String,
        verb: &'static str,
        object: String,
        source: Box<kube::Error>,
    },
    #[error("cluster {cluster}: {object} does not exist (run without --create-service-account=false to create it)")]
    Missing { cluster: String, object: String },
    #[error("cluster {cluster}: the token Secret {object} was not populated within 30s: is the token controller running?")]
    TokenTimeout { cluster: String, object: String },
}

/// Creates what is missing on the remote cluster and returns the Secret's YAML.
pub async fn generate(args: &RemoteSecretArgs) -> Result<String, RemoteSecretError> {
    if !is_dns_label(&args.cluster_id) {
        return Err(RemoteSecretError::ClusterId(args.cluster_id.clone()));
    }
    let path = args.kubeconfig.display().to_string();
    let read_error = |message: String| RemoteSecretError::Kubeconfig {
        path: path.clone(),
        message: clip(&message),
    };
    let kubeconfig = Kubeconfig::read_from(&args.kubeconfig)
        .map_err(|e| read_error(crate::kube_client::kubeconfig::reason(&e)))?;
    let (server, tls_server_name) =
        current_server(&kubeconfig).ok_or_else(|| RemoteSecretError::NoServer(path.clone()))?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .map_err(|e| read_error(e.to_string()))?;
    let client = crate::kube_client::build(config).map_err(|e| read_error(e.to_string()))?;
    let remote = Remote {
        client,
        server: server.clone(),
        cluster: args.cluster_id.clone(),
        namespace: args.namespace.clone(),
        account: args.service_account.clone(),
    };
    if args.create_service_account {
        remote.provision().await?;
    } else {
        remote.require_account().await?;
    }
    let (token, ca) = remote.token().await?;
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
