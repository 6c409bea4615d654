//! Config in force: Istio objects (`/debug/configz`, istiod's Kubernetes-object shape), mesh
//! config, mesh networks and JWT key sources.

use serde_json::{json, Value};

use super::DebugContext;

/// MeshNetworks in force, the gateways of every network, and the file's current error.
pub(super) fn networkz(state: &DebugContext) -> Value {
    let mesh = state.aggregate.mesh().snapshot();
    serde_json::json!({
        "meshNetworks": *mesh.networks,
        "gateways": *mesh.gateways,
        "last_error": *state.networks_error.lock(),
    })
}

/// Every Istio config object: the accepted ones as Kubernetes objects with where they came from, and
/// every refusal standing (a newer version of an object that failed validation shows beside the
/// last good one still served).
pub(super) fn configz(state: &DebugContext) -> Value {
    let snapshot = state.aggregate.mesh().snapshot();
    let config = &snapshot.config;
    let gateway_api = config.gateway_api();
    let patch_failures = crate::xds::generate::envoy_filter_failures(config);
    let mut out: Vec<serde_json::Value> = config
        .accepted()
        .map(|object| {
            let key = &object.key;
            let mut entry = serde_json::json!({
                "kind": key.kind,
                "apiVersion": format!("{}/{}", key.kind.group(), key.kind.versions()[0]),
                "metadata": {
                    "name": key.name,
                    "namespace": key.namespace,
                    "labels": object.meta.labels,
                    "annotations": object.meta.annotations,
                    "creationTimestamp": object.meta.creation_timestamp,
                },
                "spec": object.spec,
                "source": object.meta.origin,
                "status": "accepted",
            });
            // What the Gateway API's status subresource would say (written there by the leader
            // when the object comes from the config cluster).
            if let Some(status) = gateway_api.status.get(key) {
                let mut status = status.clone();
                status.check_backends(|host| snapshot.services.get(host).is_some());
                entry["gatewayApiStatus"] = serde_json::json!(status);
            }
            // EnvoyFilter patches that could not apply to what meshpilot generated.
            let failed: Vec<_> = patch_failures.iter().filter(|f| f.filter == *key).collect();
            if !failed.is_empty() {
                entry["patchFailures"] = serde_json::json!(failed);
            }
            entry
        })
        .collect();
    // Each MCP config source: its sync state and last error.
    out.extend(state.config_sources.lock().iter().map(|source| {
        serde_json::json!({
            "kind": "ConfigSource",
            "address": source.address,
            "status": match (source.connected, source.synced) {
                (_, true) => "synced",
                (true, false) => "syncing",
                (false, false) => "disconnected",
            },
            "connected": source.connected,
            "objects": source.objects,
            "lastError": source.last_error,
        })
    }));
    out.extend(config.refusals().map(|(source, refusal)| {
        let (kind, namespace, name) = match (&refusal.key, &refusal.subject) {
            (Some(k), _) => (json!(k.kind), json!(k.namespace), json!(k.name)),
            (None, Some(s)) => (json!(s.kind), json!(s.namespace), json!(s.name)),
            (None, None) => (json!(refusal.kind), Value::Null, Value::Null),
        };
        serde_json::json!({
            "kind": kind,
            "metadata": {"name": name, "namespace": namespace},
            "source": refusal.origin,
            "configSource": source,
            "status": "refused",
            "error": refusal.error,
        })
    }));
    Value::Array(out)
}

/// The mesh config in force and why a newer one is refused, if it is; the trust bundle sent to
/// proxies (with `--multiroot-mesh`) by source, with each SPIFFE endpoint's last fetch.
pub(super) fn mesh(state: &DebugContext) -> Value {
    let snapshot = state.aggregate.mesh().snapshot();
    serde_json::json!({
        "meshConfig": **snapshot.config.mesh(),
        "notApplied": snapshot.config.mesh().not_applied,
        "trustBundle": snapshot.trust_bundle,
        "clusterLocalHosts": snapshot.config.cluster_local_hosts().hosts(),
        "last_error": *state.mesh_config_error.lock(),
    })
}

/// Every JWT key source RequestAuthentications name: who uses it, where the keys came from, when,
/// and why the last fetch failed. Sources with inline keys are not listed.
pub(super) fn jwksz(state: &DebugContext) -> Value {
    let snapshot = state.aggregate.mesh().snapshot();
    let views = snapshot
        .config
        .security()
        .jwks_sources()
        .into_iter()
        .map(|(source, used)| {
            let entry = snapshot
                .jwks
                .get(&source)
                .map(|e| (**e).clone())
                .unwrap_or_default();
            let status = match (&entry.keys, &entry.error) {
                (Some(_), None) => "fetched",
                (Some(_), Some(_)) => "stale",
                (None, Some(_)) => "failed",
                (None, None) => "pending",
            };
            serde_json::json!({
                "source": source,
                "usedBy": used.policies.iter().map(|k| k.to_string()).collect::<Vec<_>>(),
                "status": status,
                "uri": entry.uri,
                "fetchedAt": entry.fetched_at,
                "error": entry.error,
            })
        })
        .collect();
    Value::Array(views)
}
