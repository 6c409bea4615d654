//! The simulated proxies of the reliability scenarios: each its own connection and ADS stream (half
//! SotW, half Delta; three in four sidecars with wildcard CDS, one in four proxyless gRPC with LDS),
//! subscribed to the EDS of a few stable services. Every EDS response is decoded and checked: an
//! assignment without all of a service's stable endpoints is a lost-endpoint failure, a session whose
//! first response lacks a subscribed service (or, for CDS, a stable cluster) saw a partial view.
//! A stream that ends unasked is a stream error, except while a crash is under way. Proxies come
//! back after a failure with a short jittered backoff, as Envoy does.

use std::collections::{BTreeSet, HashMap};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::{address, Address};
use envoy_types::pb::envoy::config::endpoint::v3::{lb_endpoint, ClusterLoadAssignment};
use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryResponse, DiscoveryResponse};
use parking_lot::Mutex;
use prost::Message;
use tokio::sync::Notify;

use crate::common;
use crate::harness::ads::{self, Ended, Raw, Subscription, CDS, EDS, LDS};
use crate::harness::plane::NS;
use crate::mesh::{cluster_name, service_of, Mesh};

/// The first failures are kept in full; the rest only counted.
const KEPT_FAILURES: usize = 20;

#[derive(Default)]
pub struct Stats {
    pub responses: AtomicUsize,
    pub sessions: AtomicUsize,
    /// Streams (or connections) that ended unasked outside a crash.
    pub stream_errors: AtomicUsize,
    /// The same while a crash is under way: expected.
    pub crash_errors: AtomicUsize,
    /// Assignments of a stable service without all its stable endpoints (or removing it).
    pub lost: AtomicUsize,
    /// Sessions whose first response of a type lacked something subscribed.
    pub partial: AtomicUsize,
    /// Set while meshpilot is being killed and restarted.
    pub crashing: AtomicBool,
    failures: Mutex<Vec<String>>,
}

impl Stats {
    fn fail(&self, counter: &AtomicUsize, what: String) {
        counter.fetch_add(1, Ordering::Relaxed);
        let mut failures = self.failures.lock();
        if failures.len() < KEPT_FAILURES {
            failures.push(what);
        }
    }

    /// The failures kept, one a line.
    pub fn failures(&self) -> String {
        self.failures
            .lock()
            .iter()
            .fold(String::new(), |mut out, f| {
                let _ = writeln!(out, "  {f}");
                out
            })
    }

    /// Fails the run if any proxy saw a stream error (outside a crash), a lost stable endpoint or
    /// a partial first response, listing the failures kept.
    pub fn assert_clean(&self) {
        let failures = self.failures();
        for (counter, what) in [
            (&self.stream_errors, "stream errors"),
            (&self.lost, "assignments that lost stable endpoints"),
            (&self.partial, "partial first responses"),
        ] {
            let count = counter.load(Ordering::Relaxed);
            assert_eq!(count, 0, "{count} {what}:\n{failures}");
        }
    }

    pub fn summary(&self) -> String {
        format!(
            "{} responses over {} sessions; stream errors {}, lost-endpoint assignments {}, partial first responses {}",
            self.responses.load(Ordering::Relaxed),
            self.sessions.load(Ordering::Relaxed),
            self.stream_errors.load(Ordering::Relaxed),
            self.lost.load(Ordering::Relaxed),
            self.partial.load(Ordering::Relaxed),
        )
    }
}

pub struct Proxy {
    index: usize,
    delta: bool,
    grpc: bool,
    services: Vec<usize>,
    /// Ends the current session; the proxy reconnects at once.
    reconnect: Notify,
    state: Mutex<Held>,
}

#[derive(Default)]
struct Held {
    /// When the current session first held every subscribed resource.
    synced_at: Option<Instant>,
    /// Service → the endpoint addresses of its last assignment.
    endpoints: HashMap<usize, BTreeSet<String>>,
}

impl Proxy {
    fn describe(&self) -> String {
        format!(
            "proxy {} ({}, {})",
            self.index,
            if self.delta { "Delta" } else { "SotW" },
            if self.grpc {
                "proxyless gRPC"
            } else {
                "sidecar"
            }
        )
    }

    fn subscription(&self) -> Subscription {
        let id = format!(
            "sidecar~10.250.{}.{}~soak-{}.{NS}~{NS}.svc.cluster.local",
            self.index / 250,
            self.index % 250 + 1,
            self.index
        );
        let mut metadata = vec![("CLUSTER_ID", "c0")];
        if self.grpc {
            metadata.push(("GENERATOR", "grpc"));
        }
        let names: Vec<String> = self.services.iter().map(|&i| cluster_name(i)).collect();
        let types = if self.grpc {
            let listeners = self
                .services
                .iter()
                .map(|i| format!("svc-{i}.{NS}.svc.cluster.local:80"))
                .collect();
            vec![(LDS, listeners), (EDS, names)]
        } else {
            vec![(CDS, vec![]), (EDS, names)]
        };
        Subscription {
            node: common::node(&id, &metadata),
            delta: self.delta,
            types,
        }
    }
}

pub struct Fleet {
    pub proxies: Vec<Arc<Proxy>>,
    pub stats: Arc<Stats>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Fleet {
    /// Starts `count` proxies, each subscribed to `per_proxy` stable services (the first service
    /// by all, as a hot one).
    pub fn start(xds: SocketAddr, mesh: Arc<Mesh>, count: usize, per_proxy: usize) -> Fleet {
        let stats = Arc::new(Stats::default());
        let mut proxies = Vec::new();
        let mut tasks = Vec::new();
        for index in 0..count {
            let mut services: Vec<usize> = std::iter::once(0)
                .chain(
                    (1..per_proxy).map(|k| 1 + (index * 7 + k * 13) % (mesh.services - 1).max(1)),
                )
                .collect();
            services.sort();
            services.dedup();
            let proxy = Arc::new(Proxy {
                index,
                delta: index % 2 == 1,
                grpc: index % 4 == 3,
                services,
                reconnect: Notify::new(),
                state: Mutex::default(),
            });
            tasks.push(tokio::spawn(run(
                xds,
                proxy.clone(),
                mesh.clone(),
                stats.clone(),
            )));
            proxies.push(proxy);
        }
        Fleet {
            proxies,
            stats,
            tasks,
        }
    }

    /// How many proxies have held everything they subscribed to since `since`, in their current
    /// session.
    pub fn synced_since(&self, since: Instant) -> usize {
        self.proxies
            .iter()
            .filter(|p| p.state.lock().synced_at.is_some_and(|t| t >= since))
            .count()
    }

    /// Waits until every proxy's current session has held everything since `since`.
    pub async fn wait_synced(&self, since: Instant, bound: Duration) -> Duration {
        common::wait_for("every proxy in sync", bound, || async {
            (self.synced_since(since) == self.proxies.len()).then_some(())
        })
        .await;
        since.elapsed()
    }

    /// Ends one proxy's stream; it reconnects at once.
    pub fn reconnect(&self, index: usize) {
        self.proxies[index].reconnect.notify_one();
    }

    /// Proxies whose last assignment of a service differs from the service's current endpoints,
    /// with the first difference.
    pub fn stale(&self, mesh: &Mesh) -> (usize, Option<String>) {
        let mut stale = 0;
        let mut first = None;
        for proxy in &self.proxies {
            let held = proxy.state.lock();
            for &i in &proxy.services {
                let want = mesh.current(i);
                let has = held.endpoints.get(&i);
                if has != Some(&want) {
                    stale += 1;
                    first.get_or_insert_with(|| {
                        format!(
                            "{} svc-{i}: holds {has:?}, the mesh has {want:?}",
                            proxy.describe()
                        )
                    });
                    break;
                }
            }
        }
        (stale, first)
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// A proxy's life: sessions one after the other, a jittered backoff after a failure.
async fn run(xds: SocketAddr, proxy: Arc<Proxy>, mesh: Arc<Mesh>, stats: Arc<Stats>) {
    let subscription = proxy.subscription();
    let mut backoff = Duration::from_millis(100);
    loop {
        let result = match ads::connect(xds).await {
            Ok(channel) => {
                stats.sessions.fetch_add(1, Ordering::Relaxed);
                let mut session = Session::new(&proxy, &mesh, &stats);
                let ended = ads::stream(
                    channel,
                    &subscription,
                    |raw| session.on_response(raw),
                    proxy.reconnect.notified(),
                )
                .await;
                if session.responses > 0 {
                    backoff = Duration::from_millis(100);
                }
                ended.map_err(|status| format!("{}: {}", status.code(), status.message()))
            }
            Err(e) => Err(format!("connect: {e}")),
        };
        proxy.state.lock().synced_at = None;
        match result {
            Ok(Ended::Cancelled) => continue,
            Ok(Ended::Closed) => stream_error(&stats, &proxy, "closed by the server".into()),
            Err(e) => stream_error(&stats, &proxy, e),
        }
        // Envoy's retry: jittered, doubling up to a cap.
        tokio::time::sleep(backoff.mul_f64(0.5 + fastrand::f64())).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

fn stream_error(stats: &Stats, proxy: &Proxy, what: String) {
    if stats.crashing.load(Ordering::Relaxed) {
        stats.crash_errors.fetch_add(1, Ordering::Relaxed);
    } else {
        stats.fail(
            &stats.stream_errors,
            format!("{}: stream error: {what}", proxy.describe()),
        );
    }
}

/// One stream's bookkeeping and checks.
struct Session<'a> {
    proxy: &'a Proxy,
    mesh: &'a Mesh,
    stats: &'a Stats,
    responses: usize,
    /// Types that have had their first response.
    arrived: Vec<String>,
    /// Subscribed services that have had an assignment.
    assigned: BTreeSet<usize>,
}

impl<'a> Session<'a> {
    fn new(proxy: &'a Proxy, mesh: &'a Mesh, stats: &'a Stats) -> Self {
        Self {
            proxy,
            mesh,
            stats,
            responses: 0,
            arrived: Vec::new(),
            assigned: BTreeSet::new(),
        }
    }

    fn on_response(&mut self, raw: &Raw) {
        self.responses += 1;
        self.stats.responses.fetch_add(1, Ordering::Relaxed);
        let first = !self.arrived.contains(&raw.type_url);
        if first {
            self.arrived.push(raw.type_url.clone());
        }
        if raw.type_url == EDS {
            self.check_eds(raw, first);
        } else if raw.type_url == CDS && first {
            // Every sidecar sees every stable service's cluster in its first CDS response.
            let names = cluster_names(raw, self.proxy.delta);
            let missing: Vec<usize> = (0..self.mesh.services)
                .filter(|&i| !names.contains(&cluster_name(i)))
                .collect();
            if !missing.is_empty() {
                self.stats.fail(
                    &self.stats.partial,
                    format!(
                        "{}: first CDS response (version {}) lacks the clusters of services {missing:?}",
                        self.proxy.describe(),
                        raw.version
                    ),
                );
            }
        }
        let mut held = self.proxy.state.lock();
        if held.synced_at.is_none()
            && self.arrived.len() == 2
            && self.assigned.len() == self.proxy.services.len()
        {
            held.synced_at = Some(Instant::now());
        }
    }

    fn check_eds(&mut self, raw: &Raw, first: bool) {
        let (assignments, removed) = decode_eds(raw, self.proxy.delta);
        let describe = || {
            format!(
                "{}: EDS response version {} nonce {}",
                self.proxy.describe(),
                raw.version,
                raw.nonce
            )
        };
        for name in removed {
            if let Some(i) = service_of(&name).filter(|i| self.proxy.services.contains(i)) {
                self.stats
                    .fail(&self.stats.lost, format!("{} removes svc-{i}", describe()));
            }
        }
        let mut held = self.proxy.state.lock();
        for assignment in &assignments {
            let Some(i) = service_of(&assignment.cluster_name) else {
                continue;
            };
            let addresses = addresses(assignment);
            let missing: Vec<String> = self
                .mesh
                .stable(i)
                .difference(&addresses)
                .cloned()
                .collect();
            if !missing.is_empty() {
                self.stats.fail(
                    &self.stats.lost,
                    format!("{} has svc-{i} without its stable endpoints {missing:?} (holds {addresses:?})", describe()),
                );
            }
            self.assigned.insert(i);
            held.endpoints.insert(i, addresses);
        }
        if first {
            let missing: Vec<usize> = self
                .proxy
                .services
                .iter()
                .copied()
                .filter(|i| !self.assigned.contains(i))
                .collect();
            if !missing.is_empty() {
                self.stats.fail(
                    &self.stats.partial,
                    format!(
                        "{} is the session's first and lacks services {missing:?}",
                        describe()
                    ),
                );
            }
        }
    }
}

/// A Cluster's name, and nothing else of it decoded.
#[derive(Clone, PartialEq, prost::Message)]
struct ClusterName {
    #[prost(string, tag = "1")]
    name: String,
}

/// The names of the clusters a CDS response carries.
fn cluster_names(raw: &Raw, delta: bool) -> BTreeSet<String> {
    let clusters = if delta {
        let response =
            DeltaDiscoveryResponse::decode(raw.body.clone()).expect("a DeltaDiscoveryResponse");
        response
            .resources
            .into_iter()
            .filter_map(|r| r.resource)
            .collect()
    } else {
        DiscoveryResponse::decode(raw.body.clone())
            .expect("a DiscoveryResponse")
            .resources
    };
    clusters
        .iter()
        .map(|any| {
            ClusterName::decode(any.value.as_slice())
                .expect("a Cluster")
                .name
        })
        .collect()
}

/// The assignments of an EDS response, and (Delta) the names it removes.
fn decode_eds(raw: &Raw, delta: bool) -> (Vec<ClusterLoadAssignment>, Vec<String>) {
    let (resources, removed) = if delta {
        let response =
            DeltaDiscoveryResponse::decode(raw.body.clone()).expect("a DeltaDiscoveryResponse");
        let resources = response
            .resources
            .into_iter()
            .filter_map(|r| r.resource)
            .collect();
        (resources, response.removed_resources)
    } else {
        let response = DiscoveryResponse::decode(raw.body.clone()).expect("a DiscoveryResponse");
        (response.resources, Vec::new())
    };
    let assignments = resources
        .iter()
        .map(|any| {
            ClusterLoadAssignment::decode(any.value.as_slice()).expect("a ClusterLoadAssignment")
        })
        .collect();
    (assignments, removed)
}

fn addresses(assignment: &ClusterLoadAssignment) -> BTreeSet<String> {
    assignment
        .endpoints
        .iter()
        .flat_map(|locality| &locality.lb_endpoints)
        .filter_map(|lb| match &lb.host_identifier {
            Some(lb_endpoint::HostIdentifier::Endpoint(endpoint)) => endpoint.address.as_ref(),
            _ => None,
        })
        .filter_map(|a: &Address| match &a.address {
            Some(address::Address::SocketAddress(s)) => Some(s.address.clone()),
            _ => None,
        })
        .collect()
}
