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
    Service, ShardKey, PODS_CLUSTER as PODS,
};

fn shard() -> ShardKey {
    ShardKey {
        provider: Provider::Kubernetes,
        cluster: ClusterId::new(PODS),
    }
}

/// Brings the pod services in line with the headless services' endpoints; what changed goes into
/// `change` (a new or gone pod service is a full push). Costs nothing when the change touched no
/// headless service and there are no pod services (a gateway arriving lists every service).
pub fn sync(mesh: &mut MeshSnapshot, change: &mut Change) {
    let headless_touched = change.services.iter().any(|host| {
        mesh.services
            .get(host)
            .is_some_and(|s| s.resolution == Resolution::Passthrough)
    });
    if !headless_touched && !mesh.allocations.defines_any(Owner::Pods) {
        return;
    }
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
    let cluster_local = mesh.config.cluster_local_hosts();
    for headless in mesh.services.all().iter() {
        // A cluster-local service's pods are not reached from other clusters.
        if headless.resolution != Resolution::Passthrough
            || headless.hostname.starts_with('*')
            || cluster_local.is_cluster_local(&headless.hostname)
        {
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
        use_waypoint: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Health, Locality, Protocol, ServiceKey, ServicePort, TlsMode};

    fn service(name: &str, resolution: Resolution, labels: &[(&str, &str)]) -> Service {
        Service {
            hostname: format!("{name}.shop.svc.cluster.local").into(),
            name: name.into(),
            namespace: "shop".into(),
            registry: crate::model::Registry::Kubernetes,
            ports: vec![ServicePort {
                name: "tcp".into(),
                port: 5432,
                protocol: Protocol::Tcp,
                target_port: None,
            }],
            cluster_vips: BTreeMap::new(),
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            resolution,
            dns_targets: Vec::new(),
            external_addresses: Vec::new(),
            mesh_external: false,
            export_to: Vec::new(),
            subject_alt_names: Vec::new(),
            auto_addresses: Vec::new(),
            use_waypoint: None,
        }
    }

    fn pod(address: &str, hostname: &str, network: &str) -> Endpoint {
        Endpoint {
            address: address.parse().unwrap(),
            port: 5432,
            service_port_name: "tcp".into(),
            labels: Default::default(),
            service_account: "spiffe://cluster.local/ns/shop/sa/db".into(),
            network: network.into(),
            locality: Locality::default().into(),
            cluster_id: ClusterId::new("west"),
            tls_mode: TlsMode::Istio,
            health: Health::Healthy,
            workload: hostname.into(),
            weight: 1,
            hostname: Some(hostname.into()),
        }
    }

    /// A mesh whose network2 has a gateway, and a headless `db` with pods on `networks`.
    fn mesh(networks: &[&str]) -> MeshSnapshot {
        let mut mesh = MeshSnapshot::default();
        let west = ClusterId::new("west");
        let mut gateway = service(
            "eastwestgateway",
            Resolution::ClientSideLb,
            &[("topology.istio.io/network", "network2")],
        );
        gateway.external_addresses = vec!["192.0.2.1".parse().unwrap()];
        mesh.services.upsert(&west, gateway);
        mesh.refresh_gateways();
        let db = service("db", Resolution::Passthrough, &[]);
        let key = db.key();
        mesh.services.upsert(&west, db);
        let pods = networks
            .iter()
            .enumerate()
            .map(|(i, net)| pod(&format!("10.2.0.{i}"), &format!("db-{i}"), net))
            .collect();
        let shard = ShardKey {
            provider: Provider::Kubernetes,
            cluster: west,
        };
        mesh.endpoints.update(&key, &shard, canonical(pods));
        mesh
    }

    #[test]
    fn nothing_is_derived_when_no_headless_service_changed() {
        let mut mesh = mesh(&["network2"]);
        let mut change = Change::default();
        sync(&mut mesh, &mut change);
        assert!(mesh
            .services
            .get("db-0.db.shop.svc.cluster.local")
            .is_none());
        assert!(change.is_empty());
    }

    #[test]
    fn a_pod_on_a_network_with_a_gateway_is_a_service_of_its_own() {
        let mut mesh = mesh(&["network2", "network3", ""]);
        // The registry's change names the headless service whose endpoints it wrote.
        let mut change = Change::endpoints(["db.shop.svc.cluster.local".into()].into());
        sync(&mut mesh, &mut change);
        let host = "db-0.db.shop.svc.cluster.local";
        let service = mesh.services.get(host).expect("db-0's service");
        assert_eq!(service.resolution, Resolution::ClientSideLb);
        assert_eq!(service.name, "db-0.db");
        assert!(service.auto_addresses[0]
            .to_string()
            .starts_with("240.240."));
        let key = ServiceKey {
            hostname: host.into(),
            namespace: "shop".into(),
        };
        let endpoints: Vec<_> = mesh
            .endpoints
            .get(&key)
            .unwrap()
            .endpoints()
            .cloned()
            .collect();
        assert_eq!(endpoints.len(), 1);
        assert_eq!(endpoints[0].address.to_string(), "10.2.0.0");
        assert!(change.full && change.services.contains(host));
        // No gateway for network3, no network at all: nothing to reach through.
        assert!(mesh
            .services
            .get("db-1.db.shop.svc.cluster.local")
            .is_none());
        assert!(mesh
            .services
            .get("db-2.db.shop.svc.cluster.local")
            .is_none());

        // The pod goes: so does its service.
        let db = ServiceKey {
            hostname: "db.shop.svc.cluster.local".into(),
            namespace: "shop".into(),
        };
        let shard = ShardKey {
            provider: Provider::Kubernetes,
            cluster: ClusterId::new("west"),
        };
        mesh.endpoints.update(&db, &shard, canonical(Vec::new()));
        let mut change = Change::default();
        sync(&mut mesh, &mut change);
        assert!(mesh.services.get(host).is_none());
        assert!(mesh.endpoints.get(&key).is_none());
        assert!(change.full && change.services.contains(host));
    }
}
