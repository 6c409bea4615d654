//! Consistency under concurrent change: writers apply random registry batches while SotW and Delta
//! proxies follow over real streams (CDS, then EDS for every cluster it names, as Envoy does). Once
//! the writers stop, every proxy must hold exactly what a fresh build of the final snapshot gives.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use envoy_types::pb::envoy::config::cluster::v3::cluster::{ClusterDiscoveryType, DiscoveryType};
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DiscoveryRequest};
use meshpilot::model::{ClusterId, Provider, ShardKey};
use meshpilot::registry::objects::{Kind, ObjectChange, ObjectKey};
use meshpilot::registry::{ClusterRegistry, SyncState};
use meshpilot::xds::generate::{Generation, ResourceCache};
use meshpilot::xds::protocol::ResourceType;
use meshpilot::xds::proxy::Proxy;
use prost::Message;

const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
const SERVICES: u64 = 12;
const WRITERS: u64 = 3;
const WRITE_FOR: Duration = Duration::from_secs(3);
const SETTLE_BOUND: Duration = Duration::from_secs(20);

/// What a proxy holds: clusters and assignments by name.
#[derive(Default, Debug, PartialEq)]
struct Held {
    clusters: BTreeMap<String, Cluster>,
    assignments: BTreeMap<String, ClusterLoadAssignment>,
}

fn eds_names(clusters: &BTreeMap<String, Cluster>) -> Vec<String> {
    clusters
        .values()
        .filter(|c| {
            c.cluster_discovery_type == Some(ClusterDiscoveryType::Type(DiscoveryType::Eds as i32))
        })
        .map(|c| c.name.clone())
        .collect()
}

fn node_id(i: usize) -> String {
    format!("sidecar~10.30.0.{i}~p{i}.stress~stress.svc.cluster.local")
}

fn node(i: usize) -> envoy_types::pb::envoy::config::core::v3::Node {
    common::node(&node_id(i), &[("CLUSTER_ID", "stress")])
}

/// A SotW proxy: wildcard CDS, then EDS for every EDS cluster, ACKing everything.
async fn sotw_proxy(xds: std::net::SocketAddr, i: usize, held: Arc<Mutex<Held>>) {
    let mut ads = AdsClient::connect(xds).await.expect("connect");
    ads.request(DiscoveryRequest {
        node: Some(node(i)),
        type_url: CDS.into(),
        ..Default::default()
    });
    let mut eds_nonce = String::new();
    let mut subscribed: Vec<String> = Vec::new();
    loop {
        let Some(Ok(r)) = ads.next(Duration::from_secs(3600)).await else {
            return;
        };
        let mut held = held.lock().unwrap();
        if r.type_url == CDS {
            held.clusters = r
                .resources
                .iter()
                .map(|a| Cluster::decode(&a.value[..]).expect("Cluster"))
                .map(|c| (c.name.clone(), c))
                .collect();
            ads.request(ack(CDS, &r, subscribed.clone()));
            let names = eds_names(&held.clusters);
            if names != subscribed {
                held.assignments.retain(|n, _| names.contains(n));
                subscribed = names;
                ads.request(DiscoveryRequest {
                    type_url: EDS.into(),
                    resource_names: subscribed.clone(),
                    response_nonce: eds_nonce.clone(),
                    ..Default::default()
                });
            }
        } else {
            for a in &r.resources {
                let cla = ClusterLoadAssignment::decode(&a.value[..]).expect("assignment");
                held.assignments.insert(cla.cluster_name.clone(), cla);
            }
            eds_nonce = r.nonce.clone();
            ads.request(ack(EDS, &r, subscribed.clone()));
        }
    }
}

fn ack(
    ty: &str,
    r: &envoy_types::pb::envoy::service::discovery::v3::DiscoveryResponse,
    names: Vec<String>,
) -> DiscoveryRequest {
    DiscoveryRequest {
        type_url: ty.into(),
        version_info: r.version_info.clone(),
        response_nonce: r.nonce.clone(),
        resource_names: if ty == CDS { Vec::new() } else { names },
        ..Default::default()
    }
}

/// A Delta proxy: wildcard CDS, then EDS subscriptions following the clusters.
async fn delta_proxy(xds: std::net::SocketAddr, i: usize, held: Arc<Mutex<Held>>) {
    let mut ads = DeltaClient::connect(xds).await.expect("connect");
    ads.request(DeltaDiscoveryRequest {
        node: Some(node(i)),
        type_url: CDS.into(),
        ..Default::default()
    });
    let mut subscribed: Vec<String> = Vec::new();
    loop {
        let Some(Ok(r)) = ads.next(Duration::from_secs(3600)).await else {
            return;
        };
        let mut held = held.lock().unwrap();
        let ack = DeltaDiscoveryRequest {
            type_url: r.type_url.clone(),
            response_nonce: r.nonce.clone(),
            ..Default::default()
        };
        if r.type_url == CDS {
            for res in &r.resources {
                let any = res.resource.as_ref().expect("resource body");
                let c = Cluster::decode(&any.value[..]).expect("Cluster");
                held.clusters.insert(c.name.clone(), c);
            }
            for name in &r.removed_resources {
                held.clusters.remove(name);
            }
            ads.request(ack);
            let names = eds_names(&held.clusters);
            let new: Vec<String> = names
                .iter()
                .filter(|n| !subscribed.contains(n))
                .cloned()
                .collect();
            let gone: Vec<String> = subscribed
                .iter()
                .filter(|n| !names.contains(n))
                .cloned()
                .collect();
            if !new.is_empty() || !gone.is_empty() {
                held.assignments.retain(|n, _| names.contains(n));
                subscribed = names;
                ads.request(DeltaDiscoveryRequest {
                    type_url: EDS.into(),
                    resource_names_subscribe: new,
                    resource_names_unsubscribe: gone,
                    ..Default::default()
                });
            }
        } else {
            for res in &r.resources {
                let any = res.resource.as_ref().expect("resource body");
                let cla = ClusterLoadAssignment::decode(&any.value[..]).expect("assignment");
                held.assignments.insert(res.name.clone(), cla);
            }
            for name in &r.removed_resources {
                held.assignments.remove(name);
            }
            ads.request(ack);
        }
    }
}

/// A small deterministic generator (xorshift), so a failure can be replayed from its seed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// A random registry change; with `endpoints_only`, one that needs an EDS push at most.
fn random_change(rng: &mut Rng, endpoints_only: bool) -> Vec<ObjectChange> {
    let svc = rng.below(SERVICES);
    // Mostly endpoint churn, as in a real mesh: long runs of EDS-only pushes between full ones.
    let op = match endpoints_only {
        true => 6,
        false => [0, 1, 2, 3, 3, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5, 5][rng.below(16) as usize],
    };
    let yaml = match op {
        0 => {
            return vec![ObjectChange::Delete(ObjectKey {
                kind: Kind::Service,
                namespace: "stress".into(),
                name: format!("s{svc}"),
            })]
        }
        4 => {
            return vec![ObjectChange::Delete(ObjectKey {
                kind: Kind::EndpointSlice,
                namespace: "stress".into(),
                name: format!("s{svc}-slice"),
            })]
        }
        1 => {
            let port = 8000 + rng.below(3);
            format!("apiVersion: v1\nkind: Service\nmetadata: {{name: s{svc}, namespace: stress}}\nspec: {{clusterIP: 10.96.0.{svc}, ports: [{{name: http, port: {port}}}, {{name: tcp, port: 9000}}]}}\n")
        }
        2 | 3 => {
            // A pod whose service account moves: the service's identities change (a full push).
            let ip = rng.below(4);
            let sa = rng.below(2);
            format!("apiVersion: v1\nkind: Pod\nmetadata: {{name: p{svc}-{ip}, namespace: stress, labels: {{security.istio.io/tlsMode: istio}}}}\nspec: {{serviceAccountName: sa{sa}, containers: []}}\nstatus: {{podIP: 10.40.{svc}.{ip}}}\n")
        }
        6 => {
            // Every pod's endpoint, some not ready: the identities stay, the assignment changes.
            let endpoints: Vec<String> = (0..4)
                .map(|ip| {
                    let ready = rng.below(2) == 0;
                    format!("- addresses: [10.40.{svc}.{ip}]\n  conditions: {{ready: {ready}}}\n  targetRef: {{kind: Pod, name: p{svc}-{ip}, namespace: stress}}\n")
                })
                .collect();
            format!("apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: s{svc}-slice, namespace: stress, labels: {{kubernetes.io/service-name: s{svc}}}}}\naddressType: IPv4\nports: [{{name: http, port: 8080}}, {{name: tcp, port: 9000}}]\nendpoints:\n{}", endpoints.concat())
        }
        _ => {
            let endpoints: Vec<String> = (0..4)
                .filter(|_| rng.below(2) == 0)
                .map(|ip| {
                    format!("- addresses: [10.40.{svc}.{ip}]\n  conditions: {{ready: true}}\n  targetRef: {{kind: Pod, name: p{svc}-{ip}, namespace: stress}}\n")
                })
                .collect();
            format!("apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: s{svc}-slice, namespace: stress, labels: {{kubernetes.io/service-name: s{svc}}}}}\naddressType: IPv4\nports: [{{name: http, port: 8080}}, {{name: tcp, port: 9000}}]\nendpoints:{}", if endpoints.is_empty() { " []\n".to_string() } else { format!("\n{}", endpoints.concat()) })
        }
    };
    meshpilot::sources::manifest::parse(&yaml)
        .expect("generated manifest parses")
        .into_iter()
        .map(ObjectChange::Upsert)
        .collect()
}

/// Random batches for a while, then endpoint changes only: the final state then differs from the
/// last full push in assignments alone, which only correct cache keys get right.
fn writer(registry: Arc<ClusterRegistry>, seed: u64) {
    let mut rng = Rng(seed);
    let until = Instant::now() + WRITE_FOR;
    let batch = |rng: &mut Rng, endpoints_only: bool| {
        let changes: Vec<ObjectChange> = (0..=rng.below(3))
            .flat_map(|_| random_change(rng, endpoints_only))
            .collect();
        registry.apply(changes);
        std::thread::sleep(Duration::from_millis(rng.below(4)));
    };
    while Instant::now() < until {
        batch(&mut rng, false);
    }
    for _ in 0..30 {
        batch(&mut rng, true);
    }
}

/// What a proxy should hold: a fresh build (new cache) of the final snapshot.
fn expected(mp: &meshpilot::app::Running, i: usize) -> Held {
    let snapshot = mp.aggregate.mesh().snapshot();
    let cache = ResourceCache::default();
    let proxy = Proxy::from_node(Some(&node(i))).expect("node");
    let g = Generation::new(&snapshot, &cache, &proxy);
    let clusters: BTreeMap<String, Cluster> = g
        .all(ResourceType::Cluster)
        .iter()
        .map(|r| decode_any::<Cluster>(&r.any))
        .map(|c| (c.name.clone(), c))
        .collect();
    let names = eds_names(&clusters);
    let assignments = g
        .named(ResourceType::Endpoint, names.iter())
        .iter()
        .map(|r| decode_any::<ClusterLoadAssignment>(&r.any))
        .map(|c| (c.cluster_name.clone(), c))
        .collect();
    Held {
        clusters,
        assignments,
    }
}

/// A message from an encoded `google.protobuf.Any`.
fn decode_any<M: Message + Default>(any: &[u8]) -> M {
    let any = envoy_types::pb::google::protobuf::Any::decode(any).expect("Any");
    M::decode(&any.value[..]).expect("message")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_concurrent_changes_every_proxy_holds_a_fresh_build_of_the_final_state() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("clusters")).unwrap();
    // No debounce: every batch is pushed while the next is being written.
    let mp = start_meshpilot(dir.path(), &["--debounce-after", "0s"]).await;
    let shard = ShardKey {
        provider: Provider::Kubernetes,
        cluster: ClusterId::new("stress"),
    };
    let registry = mp
        .aggregate
        .add_cluster(shard, "stress test".into(), false)
        .expect("cluster added");
    registry.set_state(SyncState::Synced);

    let proxies: Vec<(usize, Arc<Mutex<Held>>)> = (0..6).map(|i| (i, Arc::default())).collect();
    let tasks: Vec<_> = proxies
        .iter()
        .map(|(i, held)| {
            let (i, held, xds) = (*i, held.clone(), mp.xds_addr);
            match i % 2 {
                0 => tokio::spawn(sotw_proxy(xds, i, held)),
                _ => tokio::spawn(delta_proxy(xds, i, held)),
            }
        })
        .collect();

    let writers: Vec<_> = (1..=WRITERS)
        .map(|seed| {
            let registry = registry.clone();
            std::thread::spawn(move || writer(registry, seed * 7919))
        })
        .collect();
    for w in writers {
        w.join().expect("writer thread");
    }

    for (i, held) in &proxies {
        let want = expected(&mp, *i);
        assert!(
            !want.clusters.is_empty(),
            "the final state has services to check against"
        );
        let deadline = Instant::now() + SETTLE_BOUND;
        loop {
            if *held.lock().unwrap() == want {
                break;
            }
            if Instant::now() > deadline {
                let have = held.lock().unwrap();
                let names = |h: &Held| -> (Vec<String>, Vec<String>) {
                    (
                        h.clusters.keys().cloned().collect(),
                        h.assignments.keys().cloned().collect(),
                    )
                };
                let differing: Vec<&String> = want
                    .assignments
                    .iter()
                    .filter(|(n, a)| have.assignments.get(*n) != Some(*a))
                    .map(|(n, _)| n)
                    .collect();
                panic!(
                    "proxy {i} did not converge on the final state\nheld: {:?}\nwant: {:?}\nassignments differing: {differing:?}",
                    names(&have),
                    names(&want)
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    for task in tasks {
        assert!(!task.is_finished(), "a proxy's stream ended early");
        task.abort();
    }
}
