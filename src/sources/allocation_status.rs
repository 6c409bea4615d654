//! The leader's record of allocated addresses on the config cluster: every ServiceEntry read from
//! it carries its hosts' allocated addresses (IPv4 and IPv6) in `status.addresses`, as istiod 1.25+
//! writes them. Every replica reads them back with the entry and claims the same slots, so all
//! serve the same addresses — and a mesh moving between istiod and meshpilot keeps them.

use std::sync::Arc;
use std::time::Duration;

use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::discovery::ApiResource;
use kube::Client;
use serde_json::json;
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use crate::istio::service_entry::StatusAddress;
use crate::istio::{ConfigKind, ConfigObject, Origin, Spec};
use crate::model::{ClusterId, Mesh, MeshSnapshot};
use crate::registry::service_entries;

/// How often the leader compares what entries record with what is allocated: one snapshot load.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// After a pass that could not write everything (no permission, the API server away): its errors
/// are logged once a pass, so passes are spaced out.
const RETRY_AFTER: Duration = Duration::from_secs(30);

/// Keeps the config cluster's ServiceEntries' `status.addresses` current while this replica leads.
pub fn keep(client: Client, cluster: ClusterId, mesh: Arc<Mesh>) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut resource: Option<ApiResource> = None;
        // (allocations, ServiceEntries) versions of the last pass that wrote everything it wanted.
        let mut done = None;
        loop {
            tokio::time::sleep(CHECK_EVERY).await;
            let snapshot = mesh.snapshot();
            let versions = (
                snapshot.allocations.version(),
                snapshot.config.version(ConfigKind::ServiceEntry),
            );
            if done == Some(versions) {
                continue;
            }
            if resource.is_none() {
                resource =
                    super::kube_config::served_version(&client, ConfigKind::ServiceEntry).await;
            }
            let written = match &resource {
                Some(resource) => write_all(&client, resource, &cluster, &snapshot).await,
                None => false,
            };
            match written {
                true => done = Some(versions),
                false => tokio::time::sleep(RETRY_AFTER).await,
            }
        }
    })
}

/// Writes the status of every entry of `cluster` whose recorded addresses differ from the
/// allocated ones; whether every write succeeded (the others are tried again next pass).
async fn write_all(
    client: &Client,
    resource: &ApiResource,
    cluster: &ClusterId,
    snapshot: &MeshSnapshot,
) -> bool {
    let mut all = true;
    for object in snapshot.config.of_kind(ConfigKind::ServiceEntry) {
        let from_cluster = matches!(&object.meta.origin, Origin::Kubernetes { cluster: c, .. } if c.as_str() == cluster.as_str());
        let Some(wanted) = from_cluster.then(|| wanted(object, snapshot)).flatten() else {
            continue;
        };
        let api: Api<DynamicObject> =
            Api::namespaced_with(client.clone(), &object.key.namespace, resource);
        let addresses: Vec<_> = wanted
            .iter()
            .map(|a| json!({"value": a.value.to_string(), "host": a.host}))
            .collect();
        let patch = json!({"status": {"addresses": addresses}});
        match api
            .patch_status(
                &object.key.name,
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
        {
            Ok(_) => debug!(entry = %object.key, "allocated addresses recorded in status"),
            Err(e) => {
                warn!(entry = %object.key, error = %crate::kube_error::Readable(&e), "cannot record allocated addresses in the ServiceEntry's status; retrying");
                all = false;
            }
        }
    }
    all
}

/// The addresses an entry's status should record, when they differ from what it records: those
/// of its hosts, when the entry asks for allocation at all.
fn wanted(object: &ConfigObject, snapshot: &MeshSnapshot) -> Option<Vec<StatusAddress>> {
    let Spec::ServiceEntry(entry) = &object.spec else {
        return None;
    };
    let wanted: Vec<StatusAddress> = entry
        .hosts
        .iter()
        .filter(|host| service_entries::wants_addresses(object, entry, host))
        .flat_map(|host| {
            let qualified = snapshot.config.qualify(host, &object.key.namespace);
            let addresses = snapshot.allocations.addresses(&qualified);
            addresses.into_iter().flatten().map(|value| StatusAddress {
                host: host.clone(),
                value,
            })
        })
        .collect();
    let recorded = &entry.status_addresses;
    let same = wanted.len() == recorded.len() && wanted.iter().all(|w| recorded.contains(w));
    (!same).then_some(wanted)
}
