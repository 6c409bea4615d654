//! The leader's report on served Ingresses (istiod: pilot/pkg/config/kube/ingress/ingress.go
//! `SupportedIngresses` and `runningAddresses` through its status manager; 1.14's
//! ingressv1/status.go): each served Ingress this revision owns (istiod's `IsMine`) carries
//! `status.loadBalancer.ingress` = the addresses, each an `ip` where it parses as one, else a
//! `hostname`, sorted by (hostname, ip), written when it differs from what the Ingress holds.
//! The addresses are the ingress Service's (`ingressService` in the ingress namespace: an
//! ExternalName's name, else its load balancer's, then `spec.externalIPs`; none when it is not
//! found, as istiod's HEAD); without one, the external addresses of the node of the first
//! running gateway pod (by name) labelled `istio: <label>`, looked up every pass and every
//! minute, since nothing announces a node's addresses changing.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::networking::v1::Ingress as KubeIngress;
use kube::api::{ListParams, Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, warn};

use super::api::Address;
use super::held::{Addresses, Served};
use crate::istio::Revision;
use crate::kube_error::Readable;
use crate::sources::gateway_owners::Claim;
use crate::sources::revision_tags::RevisionTags;

/// How often the writer compares: one cheap check when nothing changed.
const CHECK_EVERY: Duration = Duration::from_secs(1);
/// How often the gateway pods' node addresses are looked up again.
const RESYNC: Duration = Duration::from_secs(60);
/// After a pass that could not write everything.
const RETRY_AFTER: Duration = Duration::from_secs(10);
/// How long one call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Keeps served Ingresses' status current while this replica holds istiod's ingress lock.
pub fn keep(
    client: Client,
    served: watch::Receiver<Arc<Served>>,
    revision: Revision,
    tags: RevisionTags,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        // What was written, and what the Ingress held then: not written again before the
        // Ingress is read anew.
        let mut written: HashMap<(String, String), (Vec<Address>, Vec<Address>)> = HashMap::new();
        let mut last: Option<(Arc<Served>, u64)> = None;
        let mut resync = Instant::now() + RESYNC;
        loop {
            tokio::time::sleep(CHECK_EVERY).await;
            let Some(owners) = tags.view() else { continue };
            let now = served.borrow().clone();
            let digest = owners.digest();
            let due = Instant::now() >= resync && matches!(now.addresses, Addresses::Pods { .. });
            let same = |(s, d): &(Arc<Served>, u64)| Arc::ptr_eq(s, &now) && *d == digest;
            if !due && last.as_ref().is_some_and(same) {
                continue;
            }
            resync = Instant::now() + RESYNC;
            let addresses = match &now.addresses {
                Addresses::Service(addresses) => addresses.clone(),
                Addresses::Pods { namespace, label } => {
                    match node_addresses(&client, namespace, label).await {
                        Ok(addresses) => addresses,
                        Err(e) => {
                            warn!(error = %e, "cannot find the ingress gateways' node addresses; retrying");
                            tokio::time::sleep(RETRY_AFTER).await;
                            continue;
                        }
                    }
                }
                Addresses::Nothing => Vec::new(),
            };
            let wanted = status_of(addresses);
            let mut all = true;
            written.retain(|(ns, name), _| {
                (now.ingresses.iter()).any(|i| i.namespace == *ns && i.name == *name)
            });
            for ingress in &now.ingresses {
                let claim = owners.claim(revision.as_str(), &ingress.labels, &ingress.namespace);
                let key = (ingress.namespace.clone(), ingress.name.clone());
                if claim != Claim::Mine || ingress.status == wanted {
                    written.remove(&key);
                    continue;
                }
                let pending = (wanted.clone(), ingress.status.clone());
                if written.get(&key) == Some(&pending) {
                    continue;
                }
                let api: Api<KubeIngress> = Api::namespaced(client.clone(), &ingress.namespace);
                let patch = Patch::Merge(json!({"status": {"loadBalancer": {"ingress": wanted}}}));
                let params = PatchParams::default();
                let write = api.patch_status(&ingress.name, &params, &patch);
                match tokio::time::timeout(CALL_TIMEOUT, write).await {
                    Ok(Ok(_)) => {
                        debug!(namespace = %key.0, ingress = %key.1, "Ingress status written");
                        written.insert(key, pending);
                    }
                    // Deleted since it was read: the next read no longer has it.
                    Ok(Err(kube::Error::Api(e))) if e.code == 404 => {}
                    Ok(Err(e)) => {
                        warn!(namespace = %key.0, ingress = %key.1, error = %Readable(&e), "cannot write the Ingress status; retrying");
                        all = false;
                    }
                    Err(_) => {
                        warn!(namespace = %key.0, ingress = %key.1, "writing the Ingress status timed out; retrying");
                        all = false;
                    }
                }
            }
            match all {
                true => last = Some((now, digest)),
                false => tokio::time::sleep(RETRY_AFTER).await,
            }
        }
    })
}

/// The status entries of these addresses: an IP where one parses, else a host name; sorted by
/// (hostname, ip).
pub fn status_of(addresses: Vec<String>) -> Vec<Address> {
    let mut out: Vec<Address> = (addresses.into_iter())
        .map(|a| match a.parse::<IpAddr>() {
            Ok(_) => Address {
                hostname: String::new(),
                ip: a,
            },
            Err(_) => Address {
                hostname: a,
                ip: String::new(),
            },
        })
        .collect();
    out.sort();
    out
}

/// The external addresses of the node of the first running gateway pod (by name) whose node is
/// known.
async fn node_addresses(
    client: &Client,
    namespace: &str,
    label: &str,
) -> Result<Vec<String>, String> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let params = ListParams::default().labels(&format!("istio={label}"));
    let listed = tokio::time::timeout(CALL_TIMEOUT, pods.list(&params)).await;
    let mut pods = match listed {
        Ok(Ok(list)) => list.items,
        Ok(Err(e)) => return Err(Readable(&e).to_string()),
        Err(_) => return Err("listing the gateway pods timed out".into()),
    };
    pods.sort_by_key(|p| p.name_any());
    let nodes: Api<Node> = Api::all(client.clone());
    for pod in pods {
        let status = pod.status.unwrap_or_default();
        let node = pod.spec.and_then(|s| s.node_name);
        let (Some("Running"), Some(node)) = (status.phase.as_deref(), node) else {
            continue;
        };
        let node = match tokio::time::timeout(CALL_TIMEOUT, nodes.get_opt(&node)).await {
            Ok(Ok(Some(node))) => node,
            Ok(Ok(None)) => continue,
            Ok(Err(e)) => return Err(Readable(&e).to_string()),
            Err(_) => return Err("reading a gateway pod's node timed out".into()),
        };
        let mut out: Vec<String> = Vec::new();
        let listed = node.status.and_then(|s| s.addresses).unwrap_or_default();
        for address in listed.into_iter().filter(|a| a.type_ == "ExternalIP") {
            if !address.address.is_empty() && !out.contains(&address.address) {
                out.push(address.address);
            }
        }
        return Ok(out);
    }
    Ok(Vec::new())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_become_ips_or_host_names_in_istiod_s_order() {
        let status = status_of(vec![
            "lb.example.com".into(),
            "192.0.2.10".into(),
            "2001:db8::1".into(),
            "a.example.com".into(),
        ]);
        let text = serde_json::to_string(&status).unwrap();
        assert_eq!(
            text,
            r#"[{"ip":"192.0.2.10"},{"ip":"2001:db8::1"},{"hostname":"a.example.com"},{"hostname":"lb.example.com"}]"#
        );
    }
}
