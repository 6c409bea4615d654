//! The leader's report on the Gateway API objects of the config cluster: the status each
//! GatewayClass, Gateway and route of a class meshpilot implements should carry (the conditions
//! `model::config::gateway_api` derives, backends checked against the service table), written to
//! its status subresource when it differs from what was last written.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::discovery::ApiResource;
use kube::Client;
use serde_json::{json, Value};
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use super::gateway_owners::{Ended, Handover, Scope, Turn};
use super::revision_tags::RevisionTags;
use crate::istio::{ConfigKey, ConfigKind, Origin, Revision};
use crate::model::gateway_api::status::ObjectStatus;
use crate::model::{ClusterId, Mesh, MeshSnapshot};

/// How often the leader compares: one snapshot load when nothing changed.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// After a pass that could not write everything (no permission, the API server away).
const RETRY_AFTER: Duration = Duration::from_secs(30);

/// How long one status write may take.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// Keeps the status of the config cluster's Gateway API objects this revision owns current
/// while this replica leads (istiod's status writer asks `IsMine` too), taking one over from
/// another control plane only after `handover` (see `gateway_owners`).
pub fn keep(
    client: Client,
    cluster: ClusterId,
    mesh: Arc<Mesh>,
    revision: Revision,
    (tags, handover): (RevisionTags, Duration),
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut resources: HashMap<ConfigKind, ApiResource> = HashMap::new();
        // What was written, without transition times: rewritten only when it changes.
        let mut written: HashMap<ConfigKey, Value> = HashMap::new();
        let mut handover = Handover::new(handover);
        let mut last: Option<(Arc<MeshSnapshot>, u64)> = None;
        loop {
            tokio::time::sleep(CHECK_EVERY).await;
            // Until every store has listed, nothing is known to be ours.
            let Some(owners) = tags.view() else { continue };
            let snapshot = mesh.snapshot();
            let digest = owners.digest();
            if (last.as_ref()).is_some_and(|(l, o)| Arc::ptr_eq(l, &snapshot) && *o == digest) {
                continue;
            }
            let scope = Scope {
                cluster: &cluster,
                owners: &owners,
                revision: revision.as_str(),
            };
            let pass = Pass {
                resources: &mut resources,
                written: &mut written,
                handover: &mut handover,
            };
            match write_changed(&client, &scope, &snapshot, pass).await {
                Ended::Done => last = Some((snapshot, digest)),
                // A handover is due: looked at again next tick.
                Ended::Waiting => last = None,
                Ended::Failed => tokio::time::sleep(RETRY_AFTER).await,
            }
        }
    })
}

/// What a pass keeps between passes.
struct Pass<'a> {
    resources: &'a mut HashMap<ConfigKind, ApiResource>,
    written: &'a mut HashMap<ConfigKey, Value>,
    handover: &'a mut Handover,
}

/// Writes every status of ours that differs from the one last written.
async fn write_changed(
    client: &Client,
    scope: &Scope<'_>,
    snapshot: &MeshSnapshot,
    pass: Pass<'_>,
) -> Ended {
    let Pass {
        resources,
        written,
        handover,
    } = pass;
    let (mut all, mut waiting) = (true, false);
    let statuses = &snapshot.config.gateway_api().status;
    written.retain(|key, _| statuses.contains_key(key));
    handover.retain(|key| statuses.contains_key(key));
    for (key, status) in statuses {
        let Some(object) = snapshot.config.get(key) else {
            continue;
        };
        let from_cluster = matches!(&object.meta.origin, Origin::Kubernetes { cluster: c, .. } if c.as_str() == scope.cluster.as_str());
        if !from_cluster {
            continue;
        }
        let claim = (scope.owners).claim(scope.revision, &object.meta.labels, &key.namespace);
        match handover.turn(key, claim) {
            Turn::Write => {}
            turn => {
                // Another may write it now: once ours again, it is written anew.
                written.remove(key);
                waiting |= turn == Turn::Wait;
                continue;
            }
        }
        let mut status: ObjectStatus = status.clone();
        status.check_backends(|host| snapshot.services.get(host).is_some());
        let wanted = json!(status);
        if written.get(key) == Some(&wanted) {
            continue;
        }
        let resource = match resources.get(&key.kind) {
            Some(r) => r.clone(),
            None => match super::kube_config::served_version(client, key.kind).await {
                Some(r) => resources.entry(key.kind).or_insert(r).clone(),
                None => {
                    all = false;
                    continue;
                }
            },
        };
        let api: Api<DynamicObject> = match key.kind.is_cluster_scoped() {
            true => Api::all_with(client.clone(), &resource),
            false => Api::namespaced_with(client.clone(), &key.namespace, &resource),
        };
        let patch = Patch::Merge(json!({"status": stamped(&wanted)}));
        let params = PatchParams::default();
        let write = api.patch_status(&key.name, &params, &patch);
        match tokio::time::timeout(WRITE_TIMEOUT, write).await {
            Ok(Ok(_)) => {
                debug!(object = %key, "Gateway API status written");
                written.insert(key.clone(), wanted);
            }
            // Deleted since this snapshot: the next one no longer has it.
            Ok(Err(kube::Error::Api(e))) if e.code == 404 => {
                debug!(object = %key, "Gateway API object gone before its status was written");
            }
            Ok(Err(e)) => {
                warn!(object = %key, error = %crate::kube_error::Readable(&e), "cannot write the Gateway API status; retrying");
                all = false;
            }
            Err(_) => {
                warn!(object = %key, "writing the Gateway API status timed out; retrying");
                all = false;
            }
        }
    }
    Ended::of(all, waiting)
}

/// The status with every condition's `lastTransitionTime` (which the API requires) set to now:
/// written only when a condition changed.
fn stamped(status: &Value) -> Value {
    let now = humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string();
    let mut status = status.clone();
    stamp(&mut status, &now);
    status
}

fn stamp(value: &mut Value, now: &str) {
    match value {
        Value::Object(map) => {
            if let Some(Value::Array(conditions)) = map.get_mut("conditions") {
                for c in conditions.iter_mut() {
                    c["lastTransitionTime"] = json!(now);
                }
            }
            for (_, v) in map.iter_mut() {
                stamp(v, now);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|v| stamp(v, now)),
        _ => {}
    }
}
