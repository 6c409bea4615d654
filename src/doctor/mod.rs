//! `meshpilot doctor`: the multicluster preflight. For the config cluster and every cluster its
//! remote Secrets onboard, it checks what the control plane will need — a usable kubeconfig, an
//! API server that answers, permissions, unique ids, consistent networks, reachable gateways, one
//! root of trust and clocks in step — and reports each finding naming the cluster.

mod access;
mod clock;
mod gateways;
mod networks;
mod probe;
mod report;
mod roots;
mod targets;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};
use futures::future::join_all;
use thiserror::Error;

use crate::model::{MeshNetworks, NetworksError};
use crate::sources::kubeconfig::InsecureOptions;
use crate::text::clip;
use gateways::{ClusterServices, GatewayService};
use networks::SystemNamespace;
use probe::{Ask, Details, ServerInfo};
pub use report::{Check, ClusterReport, Report, Status};
use roots::{Bundle, Sha256};
use targets::Target;

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

    /// Kubeconfig options remote Secrets may use (as `discovery --insecure-kubeconfig-options`).
    #[arg(long, default_value = "")]
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

/// One cluster after probing: the target, and the answers of its API server.
struct Probed {
    target: Target,
    server: Option<Result<ServerInfo, String>>,
    details: Option<Details>,
}

impl Probed {
    fn network_label(&self) -> Option<&str> {
        match self.details.as_ref()?.system.as_ref().ok()? {
            SystemNamespace::Present { network } => network.as_deref(),
            SystemNamespace::Missing => None,
        }
    }

    fn services(&self) -> Option<&[GatewayService]> {
        self.details
            .as_ref()?
            .services
            .as_ref()
            .ok()
            .map(Vec::as_slice)
    }
}

/// Runs every check; the report says what failed.
pub async fn run(args: &DoctorArgs) -> Result<Report, DoctorError> {
    crate::app::install_crypto_provider();
    let sha = Sha256::from_provider().ok_or(DoctorError::NoSha256)?;
    let networks = read_networks(args)?;
    let root_file = read_root(args, sha)?;
    let named = gateways::named_services(networks.as_ref());
    let ns = args.namespace.as_str();
    let t = args.timeout;

    let config_needed = access::needed(true, ns);
    let remote_needed = access::needed(false, ns);
    let ask = |config_cluster: bool| Ask {
        namespace: ns,
        timeout: t,
        needed: if config_cluster {
            &config_needed
        } else {
            &remote_needed
        },
        who: if config_cluster {
            "control plane"
        } else {
            "reader"
        },
        named_services: &named,
        config_cluster,
    };

    // The config cluster first: the remote clusters are found through it.
    let mut config = targets::config_cluster(
        &args.cluster_id,
        args.kubeconfig.as_deref(),
        args.context.as_deref(),
        t,
    )
    .await;
    let config_server = match &config.client {
        Some(client) => Some(probe::version(client, t).await),
        None => None,
    };
    let mut entries = Vec::new();
    if let (Some(client), Some(Ok(_))) = (&config.client, &config_server) {
        match targets::remote_entries(client, ns, t).await {
            Ok(found) => {
                config.checks.push(Check::ok(
                    "remote secrets",
                    format!(
                        "{} cluster(s) in Secrets labelled istio/multiCluster=true in {ns}",
                        found.len()
                    ),
                ));
                entries = found;
            }
            Err(e) => config.checks.push(Check::fail(
                "remote secrets",
                format!("cannot list Secrets labelled istio/multiCluster=true in {ns}: {e}"),
            )),
        }
    }
    let id_checks = targets::id_checks(&args.cluster_id, &entries);

    // Every cluster at once, each bounded, so an unreachable one delays no other.
    let config_probe = async {
        let details = match (&config.client, &config_server) {
            (Some(client), Some(Ok(_))) => Some(probe::details(client, &ask(true)).await),
            _ => None,
        };
        (config_server, details)
    };
    let remotes = join_all(entries.iter().zip(id_checks).map(|(entry, id_check)| {
        let ask = ask(false);
        async move {
            let target =
                targets::remote(entry, id_check, &args.insecure_kubeconfig_options, t).await;
            let (server, details) = match &target.client {
                None => (None, None),
                Some(client) => match probe::version(client, t).await {
                    Ok(info) => (Some(Ok(info)), Some(probe::details(client, &ask).await)),
                    Err(e) => (Some(Err(e)), None),
                },
            };
            Probed {
                target,
                server,
                details,
            }
        }
    }));
    let ((server, details), remotes) = tokio::join!(config_probe, remotes);
    let mut clusters = vec![Probed {
        target: config,
        server,
        details,
    }];
    clusters.extend(remotes);

    let reference = reference_root(root_file, &clusters, ns, sha);
    let verdicts = gateway_verdicts(networks.as_ref(), &clusters, t).await;
    let mut report = Report::default();
    for (i, probed) in clusters.into_iter().enumerate() {
        let id = probed.target.id.clone();
        let mut checks = probed.target.checks.clone();
        checks.extend(server_checks(&probed, args.max_clock_skew));
        if let Some(details) = &probed.details {
            checks.extend(details.access.iter().cloned());
            checks.push(match &details.system {
                Ok(system) => networks::consistency(&id, ns, system, networks.as_ref()),
                Err(e) => Check::warn("network", format!("{e}; network not checked")),
            });
            let network = networks::network_of(&id, probed.network_label(), networks.as_ref());
            checks.extend(verdicts.for_cluster(network.as_deref(), i == 0));
            checks.push(roots::check(ns, &details.root, reference.as_ref(), sha));
        }
        report.clusters.push(ClusterReport {
            id,
            secret: probed.target.secret,
            checks,
        });
    }
    Ok(report)
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

/// The mesh root: `--root-cert`, else the config cluster's CA Secret, else the first root
/// ConfigMap found (the config cluster's before the remotes').
fn reference_root(
    file: Option<Bundle>,
    clusters: &[Probed],
    ns: &str,
    sha: Sha256,
) -> Option<Bundle> {
    if file.is_some() {
        return file;
    }
    let details = || {
        clusters
            .iter()
            .filter_map(|c| Some((c, c.details.as_ref()?)))
    };
    let secret = details().find_map(|(_, d)| d.ca_root.as_ref());
    if let Some((origin, pem)) = secret {
        if let Ok(bundle) = Bundle::parse(origin.clone(), pem, sha) {
            return Some(bundle);
        }
    }
    details().find_map(|(c, d)| {
        let pem = d.root.as_ref().ok()?.as_ref()?;
        let origin = format!(
            "cluster {}'s ConfigMap {ns}/{}",
            c.target.id,
            crate::security::trust::ROOT_CONFIGMAP
        );
        Bundle::parse(origin, pem, sha).ok()
    })
}

fn server_checks(probed: &Probed, max_skew: Duration) -> Vec<Check> {
    match &probed.server {
        None => Vec::new(),
        Some(Err(e)) => vec![Check::fail("api server", format!("unreachable: {e}"))],
        Some(Ok(info)) => vec![
            Check::ok(
                "api server",
                format!(
                    "answered in {} ms ({})",
                    info.took.as_millis(),
                    info.version
                ),
            ),
            clock::check(info.date.as_deref(), info.received, max_skew),
        ],
    }
}

/// Gateway checks per network, decided once and shown on each cluster of the network.
struct GatewayVerdicts {
    by_network: BTreeMap<String, Check>,
    /// Networks no checked cluster is on (VMs by `fromCidr`, say): shown on the config cluster.
    unattached: Vec<Check>,
    /// Networks in use; gateways matter only with more than one.
    networks: BTreeSet<String>,
}

impl GatewayVerdicts {
    fn for_cluster(&self, network: Option<&str>, config_cluster: bool) -> Vec<Check> {
        let mut checks = Vec::new();
        if self.networks.len() > 1 {
            checks.push(match network.and_then(|n| self.by_network.get(n)) {
                Some(check) => check.clone(),
                None => Check::warn(
                    "gateways",
                    format!(
                        "this cluster is on no network while the mesh has {}: its endpoints are taken as directly reachable from every network",
                        self.networks.iter().cloned().collect::<Vec<_>>().join(", ")
                    ),
                ),
            });
        } else {
            let which = network
                .map(|n| format!(" ({})", clip(n)))
                .unwrap_or_default();
            checks.push(Check::ok(
                "gateways",
                format!("one network{which}: no gateway needed"),
            ));
        }
        if config_cluster {
            checks.extend(self.unattached.iter().cloned());
        }
        checks
    }
}

async fn gateway_verdicts(
    networks: Option<&MeshNetworks>,
    clusters: &[Probed],
    timeout: Duration,
) -> GatewayVerdicts {
    let of_clusters: BTreeSet<String> = clusters
        .iter()
        .filter_map(|c| networks::network_of(&c.target.id, c.network_label(), networks))
        .collect();
    let mut in_use = of_clusters.clone();
    in_use.extend(
        networks
            .iter()
            .flat_map(|n| &n.networks)
            .filter(|(_, spec)| !spec.endpoints.is_empty())
            .map(|(name, _)| name.clone()),
    );
    let services: Vec<ClusterServices<'_>> = clusters
        .iter()
        .map(|c| ClusterServices {
            id: &c.target.id,
            services: c.services(),
        })
        .collect();
    let found = gateways::collect(networks, &services);
    let mut verdicts = GatewayVerdicts {
        by_network: BTreeMap::new(),
        unattached: Vec::new(),
        networks: in_use.clone(),
    };
    if in_use.len() < 2 {
        return verdicts;
    }
    let empty = gateways::NetworkGateways::default();
    let checked = join_all(in_use.iter().map(|network| {
        let gws = found.get(network).unwrap_or(&empty);
        let others: Vec<String> = in_use.iter().filter(|n| *n != network).cloned().collect();
        async move {
            let reached = gateways::reach(&gws.candidates, timeout).await;
            (
                network.clone(),
                gateways::verdict(network, gws, &reached, &others),
            )
        }
    }))
    .await;
    for (network, check) in checked {
        if of_clusters.contains(&network) {
            verdicts.by_network.insert(network, check);
        } else {
            verdicts.unattached.push(check);
        }
    }
    verdicts
}
