//! Asking every cluster: the config cluster first (the remote clusters are found through its
//! Secrets), then every cluster at once, each bounded, so an unreachable one delays no other.

use futures::future::join_all;

use super::access;
use super::gateways::{self, GatewayService};
use super::networks::SystemNamespace;
use super::probe::{self, Ask, Details, ServerInfo};
use super::report::Check;
use super::targets::{self, Entry, Target};
use super::DoctorArgs;
use crate::model::MeshNetworks;
use crate::sources::remote::MULTICLUSTER_LABEL;

/// One cluster after probing: the target, and the answers of its API server.
pub struct Probed {
    pub target: Target,
    pub server: Option<Result<ServerInfo, String>>,
    pub details: Option<Details>,
}

impl Probed {
    pub fn network_label(&self) -> Option<&str> {
        match self.details.as_ref()?.system.as_ref().ok()? {
            SystemNamespace::Present { network } => network.as_deref(),
            SystemNamespace::Missing => None,
        }
    }

    pub fn services(&self) -> Option<&[GatewayService]> {
        self.details
            .as_ref()?
            .services
            .as_ref()
            .ok()
            .map(Vec::as_slice)
    }
}

/// Every cluster, the config cluster first, then the remote Secrets' keys in order.
pub async fn survey(args: &DoctorArgs, networks: Option<&MeshNetworks>) -> Vec<Probed> {
    let (ns, t) = (args.namespace.as_str(), args.timeout);
    let named = gateways::named_services(networks);
    let (config_needed, remote_needed) = (access::needed(true, ns), access::needed(false, ns));
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
    let entries = match (&config.client, &config_server) {
        (Some(client), Some(Ok(_))) => remote_entries(&mut config.checks, client, ns, t).await,
        _ => Vec::new(),
    };
    let id_checks = targets::id_checks(&args.cluster_id, &entries);

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
    clusters
}

/// The remote Secrets' keys; the outcome is a check of the config cluster.
async fn remote_entries(
    checks: &mut Vec<Check>,
    client: &kube::Client,
    ns: &str,
    t: std::time::Duration,
) -> Vec<Entry> {
    let secrets = format!("Secrets labelled {MULTICLUSTER_LABEL} in {ns}");
    match targets::remote_entries(client, ns, t).await {
        Ok(found) => {
            checks.push(Check::ok(
                "remote secrets",
                format!("{} cluster(s) in {secrets}", found.len()),
            ));
            found
        }
        Err(e) => {
            checks.push(Check::fail(
                "remote secrets",
                format!("cannot list {secrets}: {e}"),
            ));
            Vec::new()
        }
    }
}
