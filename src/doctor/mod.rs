//! `meshpilot doctor`: the multicluster preflight. For the config cluster and every cluster its
//! remote Secrets onboard, it checks what the control plane will need — a usable kubeconfig, an
//! API server that answers, permissions, unique ids, consistent networks, reachable gateways, one
//! root of trust and clocks in step — and reports each finding naming the cluster.

mod access;
mod clock;
mod gateway_owners;
mod gateways;
mod networks;
mod probe;
mod report;
mod revisions;
mod roots;
mod survey;
mod targets;
mod verdicts;

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};
use thiserror::Error;

use crate::kube_client::kubeconfig::InsecureOptions;
use crate::model::{MeshNetworks, NetworksError};
pub use report::{Check, ClusterReport, Report, Status};
use roots::{Bundle, Sha256};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, Args)]
pub struct DoctorArgs {
    /// Kubeconfig of the config cluster (default: $KUBECONFIG or ~/.kube/config, else in-cluster).
    #[arg(long, env = "MESHPILOT_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

    /// Context of the kubeconfig to use (default: its current context).
    #[arg(long)]
    pub context: Option<String>,

    /// The control plane's namespace, on every cluster.
    #[arg(long, default_value = "istio-system")]
    pub namespace: String,

    /// Cluster id of the config cluster (as `discovery --cluster-id`).
    #[arg(long, env = "MESHPILOT_CLUSTER_ID", default_value = "Kubernetes")]
    pub cluster_id: String,

    /// Istio's MeshNetworks, as `discovery --mesh-networks` reads it.
    #[arg(long)]
    pub mesh_networks: Option<PathBuf>,

    /// The mesh's root certificate (PEM); default: the CA Secret of the config cluster, else its
    /// istio-ca-root-cert ConfigMap.
    #[arg(long)]
    pub root_cert: Option<PathBuf>,

    /// Bound on each request and connection attempt.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,

    /// Largest difference allowed between an API server's clock and this machine's.
    #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
    pub max_clock_skew: Duration,

    /// Kubeconfig options remote Secrets may use (as `discovery --insecure-kubeconfig-options`):
    /// comma-separated among exec, authProvider, tokenFile, clientCertificate, clientKey,
    /// certificateAuthority.
    #[arg(
        long,
        env = "MESHPILOT_INSECURE_KUBECONFIG_OPTIONS",
        default_value = ""
    )]
    pub insecure_kubeconfig_options: InsecureOptions,

    /// Report format.
    #[arg(short = 'o', long = "output", value_enum, default_value = "text")]
    pub output: OutputFormat,
}

#[derive(Debug, Error)]
pub enum DoctorError {
    #[error("--mesh-networks {path}: {message}")]
    MeshNetworks { path: String, message: String },
    #[error("--mesh-networks {path}: {source}")]
    InvalidNetworks { path: String, source: NetworksError },
    #[error("--root-cert {path}: {message}")]
    RootCert { path: String, message: String },
    #[error("no crypto provider with SHA-256 is installed")]
    NoSha256,
}

/// Runs every check; the report says what failed.
pub async fn run(args: &DoctorArgs) -> Result<Report, DoctorError> {
    crate::security::install_crypto_provider();
    let sha = Sha256::from_provider().ok_or(DoctorError::NoSha256)?;
    let networks = read_networks(args)?;
    let root = read_root(args, sha)?;
    let clusters = survey::survey(args, networks.as_ref()).await;
    let inputs = verdicts::Inputs {
        namespace: &args.namespace,
        networks: networks.as_ref(),
        root,
        sha,
        timeout: args.timeout,
        max_clock_skew: args.max_clock_skew,
    };
    Ok(verdicts::assemble(&inputs, clusters).await)
}

fn read_networks(args: &DoctorArgs) -> Result<Option<MeshNetworks>, DoctorError> {
    let Some(path) = &args.mesh_networks else {
        return Ok(None);
    };
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| DoctorError::MeshNetworks {
        path: shown.clone(),
        message: e.to_string(),
    })?;
    MeshNetworks::parse(&text)
        .map(Some)
        .map_err(|source| DoctorError::InvalidNetworks {
            path: shown,
            source,
        })
}

fn read_root(args: &DoctorArgs, sha: Sha256) -> Result<Option<Bundle>, DoctorError> {
    let Some(path) = &args.root_cert else {
        return Ok(None);
    };
    let shown = path.display().to_string();
    let error = |message: String| DoctorError::RootCert {
        path: shown.clone(),
        message,
    };
    let pem = std::fs::read_to_string(path).map_err(|e| error(e.to_string()))?;
    Bundle::parse(format!("--root-cert {shown}"), &pem, sha)
        .map(Some)
        .map_err(error)
}
