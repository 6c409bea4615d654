//! The mesh the scenarios serve: S services, each in every one of C clusters with one stable
//! endpoint per cluster (it never changes) beside up to FLAPPING endpoints that come and go. The
//! harness keeps what it wrote, to know what every proxy must hold.

use std::collections::BTreeSet;

use parking_lot::Mutex;
use serde_json::json;
use test_apiserver::TestApiServer;

use crate::harness::plane::NS;

/// Flapping endpoints a service may have per cluster.
pub const FLAPPING: u32 = 3;

pub struct Mesh {
    pub services: usize,
    pub clusters: usize,
    /// [service][cluster] → which flapping endpoints are in the slice (bit k: endpoint k).
    flapping: Mutex<Vec<Vec<u8>>>,
}

pub fn cluster_name(service: usize) -> String {
    format!("outbound|80||svc-{service}.{NS}.svc.cluster.local")
}

/// The service a cluster name is for, if it is one of the mesh's stable services.
pub fn service_of(cluster_name: &str) -> Option<usize> {
    cluster_name
        .strip_prefix("outbound|80||svc-")?
        .strip_suffix(&format!(".{NS}.svc.cluster.local"))?
        .parse()
        .ok()
}

fn stable_ip(cluster: usize, service: usize) -> String {
    format!(
        "10.{}.{}.{}",
        100 + cluster,
        service / 250,
        service % 250 + 1
    )
}

fn flapping_ip(cluster: usize, service: usize, k: u32) -> String {
    let n = service * FLAPPING as usize + k as usize;
    format!("10.{}.{}.{}", 150 + cluster, n / 250, n % 250 + 1)
}

impl Mesh {
    pub fn new(services: usize, clusters: usize) -> Self {
        Self {
            services,
            clusters,
            flapping: Mutex::new(vec![vec![0; clusters]; services]),
        }
    }

    /// Writes cluster `c`'s share of the mesh: every Service, a pod per stable endpoint, one slice.
    pub fn populate(&self, api: &TestApiServer, c: usize) {
        api.apply_yaml("apiVersion: v1\nkind: Namespace\nmetadata: {name: istio-system}\n");
        for i in 0..self.services {
            api.apply(json!({"apiVersion": "v1", "kind": "Service",
                "metadata": {"name": format!("svc-{i}"), "namespace": NS},
                "spec": {"clusterIP": format!("10.96.{}.{}", i / 250, i % 250 + 1), "ports": [{"name": "http", "port": 80}]}}));
            api.apply(json!({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": format!("p-{i}"), "namespace": NS, "labels": {"app": format!("svc-{i}"), "security.istio.io/tlsMode": "istio"}},
                "spec": {"serviceAccountName": format!("sa-{i}"), "containers": []},
                "status": {"podIP": stable_ip(c, i)}}));
            api.apply(self.slice(c, i, 0));
        }
    }

    /// The endpoints every proxy must always find in service `i`'s assignment: its stable ones.
    pub fn stable(&self, i: usize) -> BTreeSet<String> {
        (0..self.clusters).map(|c| stable_ip(c, i)).collect()
    }

    /// Every endpoint service `i` has now, as the harness last wrote them.
    pub fn current(&self, i: usize) -> BTreeSet<String> {
        let flapping = self.flapping.lock();
        let mut all = self.stable(i);
        for (c, mask) in flapping[i].iter().enumerate() {
            all.extend(
                (0..FLAPPING)
                    .filter(|k| mask & (1 << k) != 0)
                    .map(|k| flapping_ip(c, i, k)),
            );
        }
        all
    }

    /// Rewrites service `i`'s slice in cluster `c` with a new random set of flapping endpoints
    /// (the stable one always in it), as a rollout or a failing readiness probe would.
    pub fn flap(&self, api: &TestApiServer, c: usize, i: usize) {
        let mask = {
            let mut flapping = self.flapping.lock();
            let old = flapping[i][c];
            let mask = loop {
                let mask = fastrand::u8(0..1 << FLAPPING);
                if mask != old {
                    break mask;
                }
            };
            flapping[i][c] = mask;
            mask
        };
        api.apply(self.slice(c, i, mask));
    }

    fn slice(&self, c: usize, i: usize, mask: u8) -> serde_json::Value {
        let mut endpoints = vec![
            json!({"addresses": [stable_ip(c, i)], "conditions": {"ready": true},
            "targetRef": {"kind": "Pod", "name": format!("p-{i}"), "namespace": NS}}),
        ];
        endpoints.extend(
            (0..FLAPPING).filter(|k| mask & (1 << k) != 0).map(
                |k| json!({"addresses": [flapping_ip(c, i, k)], "conditions": {"ready": true}}),
            ),
        );
        json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": format!("svc-{i}-c{c}"), "namespace": NS, "labels": {"kubernetes.io/service-name": format!("svc-{i}")}},
            "addressType": "IPv4", "ports": [{"name": "http", "port": 80}], "endpoints": endpoints})
    }
}
