//! The clusters to check: the config cluster (its kubeconfig, default kube config or in-cluster),
//! and every key of its `istio/multiCluster=true` Secrets, vetted and connected exactly as the
//! remote-secret controller does (`kube_client::kubeconfig`).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use kube::api::ListParams;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, ResourceExt};

use super::report::Check;
use crate::kube_client::kubeconfig::{self, InsecureOptions};
use crate::kube_error::WithCauses;
use crate::sources::remote::MULTICLUSTER_LABEL;
use crate::text::{clip, quote};

const KUBECONFIG: &str = "kubeconfig";
const CLUSTER_ID: &str = "cluster id";

/// A cluster to check, and what was found before talking to it.
pub struct Target {
    pub id: String,
    pub secret: Option<String>,
    pub checks: Vec<Check>,
    /// None when there is no usable kubeconfig.
    pub client: Option<Client>,
}

/// Bounds every connection and request the client makes. Each probe is bounded by `timeout`
/// itself (with one clear message); the client's own limits are a backstop set past it, so the
/// two never race to report the same hang in different words.
fn bounded(mut config: kube::Config, timeout: Duration) -> kube::Config {
    let backstop = timeout * 2;
    config.connect_timeout = Some(backstop);
    config.read_timeout = Some(backstop);
    config.write_timeout = Some(backstop);
    config
}

/// The config cluster: the kubeconfig given (and its context), else the default kube config,
/// else the pod's service account.
pub async fn config_cluster(
    id: &str,
    path: Option<&Path>,
    context: Option<&str>,
    timeout: Duration,
) -> Target {
    let options = KubeConfigOptions {
        context: context.map(str::to_string),
        ..Default::default()
    };
    let source = match (path, context) {
        (Some(p), Some(c)) => format!("{}, context {c}", p.display()),
        (Some(p), None) => p.display().to_string(),
        (None, Some(c)) => format!("the default kube config, context {c}"),
        (None, None) => "the default kube config or in-cluster".to_string(),
    };
    let config = match (path, context) {
        (Some(p), _) => match Kubeconfig::read_from(p) {
            Ok(k) => kube::Config::from_custom_kubeconfig(k, &options)
                .await
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        },
        (None, Some(_)) => kube::Config::from_kubeconfig(&options)
            .await
            .map_err(|e| e.to_string()),
        (None, None) => kube::Config::infer().await.map_err(|e| e.to_string()),
    };
    let (check, client) = match config {
        Ok(config) => connect(bounded(config, timeout), &source),
        Err(e) => (
            Check::fail(KUBECONFIG, format!("{source}: {}", clip(&e))),
            None,
        ),
    };
    Target {
        id: id.to_string(),
        secret: None,
        checks: vec![check],
        client,
    }
}

fn connect(config: kube::Config, source: &str) -> (Check, Option<Client>) {
    let server = clip(&config.cluster_url.to_string());
    match kubeconfig::client_for(config) {
        Ok(client) => (
            Check::ok(KUBECONFIG, format!("{source} (server {server})")),
            Some(client),
        ),
        Err(e) => (Check::fail(KUBECONFIG, format!("{source}: {e}")), None),
    }
}

/// One key of a remote secret.
pub struct Entry {
    pub id: String,
    pub secret: String,
    pub kubeconfig: Vec<u8>,
}

/// Every key of the config cluster's multicluster Secrets, in Secret then key order.
pub async fn remote_entries(
    client: &Client,
    namespace: &str,
    timeout: Duration,
) -> Result<Vec<Entry>, String> {
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let listed = tokio::time::timeout(
        timeout,
        api.list(&ListParams::default().labels(MULTICLUSTER_LABEL)),
    )
    .await;
    let mut secrets = match listed {
        Ok(Ok(list)) => list.items,
        Ok(Err(e)) => return Err(WithCauses(&e).to_string()),
        Err(_) => {
            return Err(format!(
                "no answer within {}",
                humantime::format_duration(timeout)
            ))
        }
    };
    secrets.sort_by_key(|s| s.name_any());
    Ok(secrets
        .into_iter()
        .flat_map(|secret| {
            let name = format!("{namespace}/{}", secret.name_any());
            let data: BTreeMap<_, _> = secret.data.unwrap_or_default();
            data.into_iter().map(move |(id, bytes)| Entry {
                id,
                secret: name.clone(),
                kubeconfig: bytes.0,
            })
        })
        .collect())
}

/// Whether each entry's cluster id is its own, as the controller needs: it serves a duplicate id
/// from one Secret only, and never a key named like the config cluster. Same order as `entries`.
pub fn id_checks(config_id: &str, entries: &[Entry]) -> Vec<Check> {
    entries
        .iter()
        .map(|entry| {
            let id = quote(&entry.id);
            if entry.id == config_id {
                return Check::fail(
                    CLUSTER_ID,
                    format!("{id} in Secret {} is the config cluster's id: the controller ignores this key", entry.secret),
                );
            }
            // In Secret name order, as the controller lists them at start.
            let holders: Vec<&str> = entries
                .iter()
                .filter(|other| other.id == entry.id)
                .map(|other| other.secret.as_str())
                .collect();
            match holders.as_slice() {
                [first, _, ..] => Check::fail(
                    CLUSTER_ID,
                    format!(
                        "duplicate cluster id {id}: in Secret {}; the controller serves only one (on a fresh start, Secret {first}'s)",
                        holders.join(" and Secret ")
                    ),
                ),
                _ => Check::ok(CLUSTER_ID, format!("{id} is unique")),
            }
        })
        .collect()
}

/// A remote cluster: its kubeconfig vetted and a client built as the controller would.
pub async fn remote(
    entry: &Entry,
    id_check: Check,
    insecure: &InsecureOptions,
    timeout: Duration,
) -> Target {
    let source = "parsed and allowed";
    let connected = match kubeconfig::parse_untrusted(&entry.kubeconfig, insecure) {
        Ok(parsed) => kubeconfig::client_config(parsed)
            .await
            .map(|config| connect(bounded(config, timeout), source)),
        Err(e) => Err(e),
    };
    let (check, client) =
        connected.unwrap_or_else(|e| (Check::fail(KUBECONFIG, e.to_string()), None));
    Target {
        id: entry.id.clone(),
        secret: Some(entry.secret.clone()),
        checks: vec![check, id_check],
        client,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::report::Status;

    fn entry(id: &str, secret: &str) -> Entry {
        Entry {
            id: id.into(),
            secret: secret.into(),
            kubeconfig: Vec::new(),
        }
    }

    #[test]
    fn duplicate_ids_name_both_secrets() {
        let entries = [
            entry("east", "istio-system/a"),
            entry("west", "istio-system/a"),
            entry("east", "istio-system/b"),
            entry("primary", "istio-system/c"),
        ];
        let checks = id_checks("primary", &entries);
        assert_eq!(checks[1].status, Status::Ok);
        for (i, other) in [(0, "istio-system/b"), (2, "istio-system/a")] {
            assert_eq!(checks[i].status, Status::Fail);
            assert!(
                checks[i].message.contains("duplicate cluster id \"east\"")
                    && checks[i].message.contains(other),
                "{}",
                checks[i].message
            );
        }
        assert!(checks[3].message.contains("config cluster's id"));
    }
}
