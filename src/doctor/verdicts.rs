//! Verdicts across clusters — the mesh root, each network's gateways — and every cluster's checks
//! put together into the report.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use futures::future::join_all;

use super::clock;
use super::gateways::{self, ClusterServices};
use super::networks;
use super::report::{Check, ClusterReport, Report};
use super::roots::{self, Bundle, Sha256};
use super::survey::Probed;
use crate::model::MeshNetworks;
use crate::security::trust::ROOT_CONFIGMAP;
use crate::text::clip;

/// What the verdicts are measured against.
pub struct Inputs<'a> {
    pub namespace: &'a str,
    pub networks: Option<&'a MeshNetworks>,
    /// `--root-cert`, when given.
    pub root: Option<Bundle>,
    pub sha: Sha256,
    pub timeout: Duration,
    pub max_clock_skew: Duration,
}

/// Every cluster's checks, in survey order.
pub async fn assemble(inputs: &Inputs<'_>, clusters: Vec<Probed>) -> Report {
    let (ns, networks) = (inputs.namespace, inputs.networks);
    let reference = reference_root(inputs, &clusters);
    let verdicts = gateway_verdicts(networks, &clusters, inputs.timeout).await;
    let mut report = Report::default();
    for probed in clusters {
        let id = probed.target.id.clone();
        let mut checks = probed.target.checks.clone();
        checks.extend(server_checks(&probed, inputs.max_clock_skew));
        if let Some(details) = &probed.details {
            checks.extend(details.access.iter().cloned());
            checks.push(match &details.system {
                Ok(system) => networks::consistency(&id, ns, system, networks),
                Err(e) => Check::warn("network", format!("{e}; network not checked")),
            });
            if let Err(e) = &details.services {
                checks.push(Check::warn(
                    "gateways",
                    format!("{e}; this cluster's gateway Services not checked"),
                ));
            }
            let network = networks::network_of(&id, probed.network_label(), networks);
            let config_cluster = probed.target.secret.is_none();
            checks.extend(verdicts.for_cluster(network.as_deref(), config_cluster));
            checks.push(roots::check(
                ns,
                &details.root,
                reference.as_ref(),
                inputs.sha,
            ));
            checks.extend(details.revisions.iter().cloned());
            checks.extend(details.gateway_owners.iter().cloned());
        }
        report.clusters.push(ClusterReport {
            id,
            secret: probed.target.secret,
            checks,
        });
    }
    report
}

/// The mesh root: `--root-cert`, else the config cluster's CA Secret, else the first root
/// ConfigMap found (the config cluster's before the remotes').
fn reference_root(inputs: &Inputs<'_>, clusters: &[Probed]) -> Option<Bundle> {
    if inputs.root.is_some() {
        return inputs.root.clone();
    }
    let (ns, sha) = (inputs.namespace, inputs.sha);
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
        let origin = format!("cluster {}'s ConfigMap {ns}/{ROOT_CONFIGMAP}", c.target.id);
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
