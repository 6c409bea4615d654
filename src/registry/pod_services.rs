//! Pods of headless services on a network with a gateway, each as a service of its own: a StatefulSet
//! pod `db-1` of headless `db` on network2 becomes `db-1.db.<ns>.svc.<domain>`, with an allocated
//! address and that one pod as its endpoint. A client on another network cannot reach the pod's
//! own address; through this service it can, by the machinery every service has: its name
//! resolves to the allocated address (NDS), the client's listeners match it, split-horizon EDS
//! sends the connection to the pod's network gateway with SNI naming the pod's service, and the
//! gateway's AUTO_PASSTHROUGH cluster of that name holds just the pod (docs/dns.md).
//!
//! Re-derived from the headless services' shards whenever a registry writes, so it follows pods,
//! readiness and networks as they change.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use crate::model::allocation::Owner;
use crate::model::{
    canonical, Change, ClusterId, Endpoint, Hostname, MeshSnapshot, Provider, PushNeed, Resolution,
    Service, ShardKey,
};

/// Where pod services are defined in the service table (ids of real clusters cannot start with '~').
const PODS: &str = "~pods";

fn shard() -> ShardKey {
    ShardKey {
        provider: Provider::Kubernetes,
        cluster: ClusterId::new(PODS),
    }
}

/// Brings the pod services in line with the headless services' endpoints; what changed goes into
/// `change` (a new or gone pod service is a full push).
pub fn sync(mesh: &mut MeshSnapshot, change: &mut Change) {
    let desired = desired(mesh);
    let hosts: BTreeSet<Hostname> = desired.keys().cloned().collect();
    mesh.allocations.define(Owner::Pods, &hosts);
    let definitions = ClusterId::new(PODS);
    let shard = shard();
    for host in mesh.services.hosts_of(&definitions) {
        if hosts.contains(&host) {
            continue;
        }
        let key = mesh.services.get(&host).map(|s| s.key());
        if mesh.services.remove(&definitions, &host) {
            change.full = true;
            change.services.insert(host.clone());
        }
        if let Some(key) = key {
            mesh.endpoints.delete_service_shard(&key, &shard);
        }
    }
    for (host, (mut service, endpoints)) in desired {
        if let Some(addresses) = mesh.allocations.addresses(&host) {
            service.auto_addresses = addresses.to_vec();
        }
        let key = service.key();
        if mesh.services.upsert(&definitions, service) {
            change.full = true;
            change.services.insert(host.clone());
        }
        match mesh.endpoints.update(&key, &shard, canonical(endpoints)) {
            PushNeed::None => {}
            need => {
                change.full |= need == PushNeed::Full;
                change.services.insert(host);
            }
        }
    }
}

/// Each pod service: its definition and its endpoints (the pod's, in every cluster that has it).
fn desired(mesh: &MeshSnapshot) -> BTreeMap<Hostname, (Service, Vec<Endpoint>)> {
    let mut out: BTreeMap<Hostname, (Service, Vec<Endpoint>)> = BTreeMap::new();
    for headless in mesh.services.all().iter() {
        if headless.resolution != Resolution::Passthrough || headless.hostname.starts_with('*') {
            continue;
        }
        let Some(shards) = mesh.endpoints.get(&headless.key()) else {
            continue;
        };
        for ep in shards.endpoints() {
            let Some(label) = ep.hostname.as_deref() else {
                continue;
            };
            // Only a network with a gateway can be reached from another.
            if ep.network.is_empty() || mesh.gateways.of(&ep.network).is_empty() {
                continue;
            }
            let host: Hostname = format!("{label}.{}", headless.hostname).into();
            let (_, endpoints) = out
                .entry(host.clone())
                .or_insert_with(|| (pod_service(headless, label, host), Vec::new()));
            endpoints.push(ep.clone());
        }
    }
    out
}

fn pod_service(headless: &Service, label: &str, hostname: Hostname) -> Service {
    Service {
        hostname,
        name: format!("{label}.{}", headless.name),
        namespace: Arc::clone(&headless.namespace),
        registry: headless.registry,
        ports: headless.ports.clone(),
        cluster_vips: BTreeMap::from([(ClusterId::new(PODS), Vec::new())]),
        labels: BTreeMap::new(),
        resolution: Resolution::ClientSideLb,
        dns_targets: Vec::new(),
        external_addresses: Vec::new(),
        mesh_external: false,
        export_to: headless.export_to.clone(),
        subject_alt_names: Vec::new(),
        auto_addresses: Vec::new(),
    }
}
