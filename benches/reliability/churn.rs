//! Churn generators: each a task acting once per pacing interval until stopped, counting its acts.
//! Endpoints flap, services come and go, remote kubeconfigs rotate, proxies reconnect, and
//! DestinationRules change.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use test_apiserver::TestApiServer;

use crate::common;
use crate::fleet::Fleet;
use crate::harness::plane::{counter, remote_secret_with_token, NS};
use crate::mesh::Mesh;

/// Services added beyond the mesh's, at most this many at a time.
const CHURNED_SERVICES: usize = 8;

const ROTATIONS: &str = "meshpilot_remote_cluster_rotations_total";

/// Running generators; `stop` ends them and reports what they did.
pub struct Churn {
    stop: tokio::sync::watch::Sender<bool>,
    tasks: Vec<(&'static str, tokio::task::JoinHandle<usize>)>,
}

impl Default for Churn {
    fn default() -> Self {
        Self {
            stop: tokio::sync::watch::Sender::new(false),
            tasks: Vec::new(),
        }
    }
}

impl Churn {
    /// Runs `act` every `every` (after it returns) until stopped.
    fn spawn<F, Fut>(&mut self, what: &'static str, every: Duration, mut act: F)
    where
        F: FnMut(usize) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send,
    {
        let mut stop = self.stop.subscribe();
        self.tasks.push((
            what,
            tokio::spawn(async move {
                let mut n = 0;
                loop {
                    act(n).await;
                    n += 1;
                    tokio::select! {
                        () = tokio::time::sleep(every) => {}
                        _ = stop.changed() => return n,
                    }
                }
            }),
        ));
    }

    /// A random stable service's slice in a random cluster gets a new set of flapping endpoints.
    pub fn flap(&mut self, every: Duration, mesh: Arc<Mesh>, servers: Vec<Arc<TestApiServer>>) {
        self.spawn("endpoint flaps", every, move |_| {
            let c = fastrand::usize(..servers.len());
            mesh.flap(&servers[c], c, fastrand::usize(..mesh.services));
            async {}
        });
    }

    /// Services `churn-<n>` are added (with an endpoint) in turn to each cluster, and the oldest
    /// removed once CHURNED_SERVICES exist.
    pub fn services(&mut self, every: Duration, servers: Vec<Arc<TestApiServer>>) {
        let mut added = 0;
        self.spawn("services added or removed", every, move |n| {
            let removed = n - added;
            if added - removed < CHURNED_SERVICES {
                let api = &servers[added % servers.len()];
                let name = format!("churn-{added}");
                api.apply(json!({"apiVersion": "v1", "kind": "Service",
                    "metadata": {"name": name, "namespace": NS},
                    "spec": {"clusterIP": format!("10.97.{}.{}", added / 250 % 250, added % 250 + 1), "ports": [{"name": "http", "port": 80}]}}));
                api.apply(json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                    "metadata": {"name": name, "namespace": NS, "labels": {"kubernetes.io/service-name": name}},
                    "addressType": "IPv4", "ports": [{"name": "http", "port": 80}],
                    "endpoints": [{"addresses": [format!("10.98.{}.{}", added / 250 % 250, added % 250 + 1)], "conditions": {"ready": true}}]}));
                added += 1;
            } else {
                let api = &servers[removed % servers.len()];
                let name = format!("churn-{removed}");
                api.delete("EndpointSlice", NS, &name);
                api.delete("Service", NS, &name);
            }
            async {}
        });
    }

    /// Each remote's Secret, in turn, gets a kubeconfig with a new token; once meshpilot has
    /// swapped to it (its rotation counter moved) the old token is revoked, as a rotation does.
    pub fn rotations(
        &mut self,
        every: Duration,
        admin: SocketAddr,
        servers: Vec<Arc<TestApiServer>>,
    ) {
        if servers.len() < 2 {
            return;
        }
        self.spawn("kubeconfig rotations", every, move |n| {
            let servers = servers.clone();
            async move {
                let c = 1 + n % (servers.len() - 1);
                let (id, generation) = (format!("c{c}"), n / (servers.len() - 1) + 1);
                let before = counter(admin, ROTATIONS).await;
                let token = format!("{id}-reader-{generation}");
                servers[0].apply(remote_secret_with_token(&servers[c], &id, &token));
                common::wait_for(
                    "meshpilot swapped to the rotated kubeconfig",
                    Duration::from_secs(60),
                    || async move { (counter(admin, ROTATIONS).await > before).then_some(()) },
                )
                .await;
                let previous = if generation == 1 {
                    format!("{id}-reader")
                } else {
                    format!("{id}-reader-{}", generation - 1)
                };
                servers[c].revoke_token(&previous);
            }
        });
    }

    /// A random proxy drops its stream and reconnects.
    pub fn reconnects(&mut self, every: Duration, fleet: Arc<Fleet>) {
        self.spawn("proxy reconnects", every, move |_| {
            fleet.reconnect(fastrand::usize(..fleet.proxies.len()));
            async {}
        });
    }

    /// A random stable service's DestinationRule changes its connection pool, or goes away.
    pub fn config(&mut self, every: Duration, services: usize, config: Arc<TestApiServer>) {
        self.spawn("DestinationRule changes", every, move |n| {
            let i = fastrand::usize(..services);
            let name = format!("svc-{i}");
            if n % 5 == 4 {
                config.delete("DestinationRule", NS, &name);
            } else {
                config.apply(json!({"apiVersion": "networking.istio.io/v1", "kind": "DestinationRule",
                    "metadata": {"name": name, "namespace": NS},
                    "spec": {"host": format!("svc-{i}.{NS}.svc.cluster.local"),
                        "trafficPolicy": {"connectionPool": {"tcp": {"maxConnections": 1 + n}},
                            "loadBalancer": {"simple": if n % 2 == 0 { "ROUND_ROBIN" } else { "LEAST_REQUEST" }}}}}));
            }
            async {}
        });
    }

    /// Stops every generator; what each did.
    pub async fn stop(self) -> Vec<(&'static str, usize)> {
        self.stop.send_replace(true);
        let mut done = Vec::new();
        for (what, task) in self.tasks {
            match task.await {
                Ok(n) => done.push((what, n)),
                Err(e) => std::panic::resume_unwind(e.into_panic()),
            }
        }
        done
    }
}
