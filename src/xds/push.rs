//! The push pipeline: registry changes → debounce → one merged request per proxy → what to send.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::generate::eds_names_for;
use super::protocol::{ResourceType, Scope};
use crate::istio::ConfigKind;
use crate::model::{Change, Hostname, MeshSnapshot, Resolution};

/// What a proxy must be brought up to date with.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PushRequest {
    /// Every watched type is recomputed; otherwise only EDS of `services`.
    pub full: bool,
    /// The Addresses (ambient mode's workloads and services) a change may have moved.
    pub addresses: Option<Scope>,
    /// Shared by every proxy a push reaches; copied only when requests merge.
    pub services: Arc<BTreeSet<Hostname>>,
    /// Every assignment may have changed, not only those of `services` (config or a mesh-wide
    /// setting, or the proxy's own locality). Without it a full push sends the assignments of
    /// `services` alone, as istiod's partial full push does for service changes.
    pub all_endpoints: bool,
    /// Secrets the proxy may hold over SDS changed: its SDS resources are sent again.
    pub secrets: bool,
    /// Its name table (NDS) may have changed.
    pub names: bool,
    /// The trust bundle (PCDS) changed.
    pub trust_bundle: bool,
    /// Kinds of Istio config that changed, for clients of the config itself (MCP).
    pub configs: BTreeSet<ConfigKind>,
    /// When the earliest change behind this request happened, and when it was offered to the
    /// proxy (the earliest, once merged): convergence and queue times are measured from these.
    pub triggered_at: Option<Instant>,
    pub queued_at: Option<Instant>,
}

impl PushRequest {
    pub fn merge(&mut self, other: PushRequest) {
        self.full |= other.full;
        self.addresses = match (self.addresses.take(), other.addresses) {
            (Some(Scope::Names(mut a)), Some(Scope::Names(b))) => {
                a.extend(b);
                Some(Scope::Names(a))
            }
            (Some(_), Some(_)) => Some(Scope::All),
            (a, b) => a.or(b),
        };
        if !other.services.is_subset(&self.services) {
            Arc::make_mut(&mut self.services).extend(other.services.iter().cloned());
        }
        self.all_endpoints |= other.all_endpoints;
        self.secrets |= other.secrets;
        self.names |= other.names;
        self.trust_bundle |= other.trust_bundle;
        self.configs.extend(other.configs);
        self.triggered_at = earliest(self.triggered_at, other.triggered_at);
        self.queued_at = earliest(self.queued_at, other.queued_at);
    }
}

fn earliest(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// A burst of changes merged into one push.
pub struct Debounced {
    pub change: Change,
    /// When the burst's first change arrived.
    pub first_at: Instant,
    /// The burst's changes counted by reason (istiod's `pilot_push_triggers` types).
    pub triggers: BTreeMap<&'static str, u64>,
}

impl Debounced {
    fn start(change: Change) -> Self {
        let mut triggers = BTreeMap::new();
        *triggers.entry(change.trigger()).or_default() += 1;
        Self {
            change,
            first_at: Instant::now(),
            triggers,
        }
    }

    fn merge(&mut self, change: Change) {
        *self.triggers.entry(change.trigger()).or_default() += 1;
        self.change.merge(change);
    }
}

#[derive(Clone, Copy, Debug)]
pub struct DebounceConfig {
    /// Quiet period: a push waits until no change arrived for this long. Zero disables debouncing.
    pub after: Duration,
    /// A push never waits longer than this after the first change it carries.
    pub max: Duration,
}

/// Merges bursts of changes: emits once the stream has been quiet for `after`, or `max` after the
/// first change of the burst, whichever comes first. Returns when the change stream closes.
pub async fn debounce(
    mut changes: UnboundedReceiver<Change>,
    config: DebounceConfig,
    mut emit: impl FnMut(Debounced),
) {
    while let Some(first) = changes.recv().await {
        let mut merged = Debounced::start(first);
        if config.after.is_zero() {
            while let Ok(more) = changes.try_recv() {
                merged.merge(more);
            }
            emit(merged);
            continue;
        }
        let start = merged.first_at;
        let mut last = start;
        loop {
            let deadline = (last + config.after).min(start + config.max);
            tokio::select! {
                next = changes.recv() => match next {
                    Some(change) => {
                        merged.merge(change);
                        last = Instant::now();
                    }
                    None => {
                        emit(merged);
                        return;
                    }
                },
                _ = tokio::time::sleep_until(deadline) => {
                    emit(merged);
                    break;
                }
            }
        }
    }
}

/// A proxy's place in the push queue: at most one pending request. Offering a request to a proxy
/// that already has one pending (or is being pushed) merges it, so a slow proxy never accumulates a
/// backlog and always gets the union of what changed.
#[derive(Debug, Default)]
pub struct PushSlot {
    pending: Mutex<Option<PushRequest>>,
    notify: Notify,
}

impl PushSlot {
    pub fn offer(&self, request: PushRequest) {
        let mut pending = self.pending.lock();
        match pending.as_mut() {
            Some(existing) => existing.merge(request),
            None => *pending = Some(request),
        }
        drop(pending);
        self.notify.notify_one();
    }

    /// Waits until a request may be pending.
    pub async fn ready(&self) {
        self.notify.notified().await;
    }

    pub fn take(&self) -> Option<PushRequest> {
        self.pending.lock().take()
    }
}

/// Whether a change may move name tables: (for the proxies its full part concerns, for every
/// proxy). Service definitions and the config that names hosts do (`Change::names_kept` says when
/// not); so do the endpoints of a headless service, whose ready pods are its addresses.
pub fn moves_names(change: &Change, mesh: &MeshSnapshot) -> (bool, bool) {
    let headless = change.services.iter().any(|host| {
        mesh.services
            .get(host)
            .is_some_and(|s| s.resolution == Resolution::Passthrough)
    });
    (change.full && !change.names_kept, headless)
}

/// Which types to send, and which of their resources, for a push to a proxy watching `watched`.
/// `eds_names` are the EDS resources the proxy subscribes to, read only when the push concerns some
/// of them and only the concerned ones copied (a wildcard sidecar subscribes to thousands).
pub fn plan<'n>(
    request: &PushRequest,
    watched: &[ResourceType],
    eds_names: impl Iterator<Item = &'n str>,
) -> Vec<(ResourceType, Scope)> {
    // SDS depends on Secrets alone: a full push for other reasons leaves it be (as istiod).
    let secrets = (request.secrets && watched.contains(&ResourceType::Secret))
        .then_some((ResourceType::Secret, Scope::All));
    let mut eds = Some(eds_names);
    let mut endpoints = || {
        let names = eds.take()?;
        if request.all_endpoints {
            return Some(Scope::All);
        }
        let names = eds_names_for(&request.services, names);
        (!names.is_empty()).then_some(Scope::Names(names))
    };
    // Istio's order, so Envoy warms clusters before listeners reference them.
    let order = [
        ResourceType::Cluster,
        ResourceType::Endpoint,
        ResourceType::Listener,
        ResourceType::Route,
    ];
    let types = order.into_iter().filter(|t| watched.contains(t));
    let planned = types.filter_map(|t| match t {
        ResourceType::Endpoint => Some((t, endpoints()?)),
        _ => request.full.then_some((t, Scope::All)),
    });
    // The agent asks for NDS alone (Envoy never does); it follows the listeners.
    let names = (request.names && watched.contains(&ResourceType::NameTable))
        .then_some((ResourceType::NameTable, Scope::All));
    // The trust bundle when it changed (istiod sends it on every forced push).
    let bundle = (request.trust_bundle && watched.contains(&ResourceType::ProxyConfig))
        .then_some((ResourceType::ProxyConfig, Scope::All));
    // Istio config goes to its clients (MCP) when objects of its kind changed.
    let config = watched.iter().filter_map(|t| match t {
        ResourceType::Config(kind, _) if request.configs.contains(kind) => Some((*t, Scope::All)),
        _ => None,
    });
    // ztunnel's addresses follow pods and endpoints; its policies, config.
    let addresses = request.addresses.clone();
    let ambient = [
        (ResourceType::Address, addresses),
        (
            ResourceType::Authorization,
            request.full.then_some(Scope::All),
        ),
    ]
    .into_iter()
    .filter_map(|(t, scope)| Some((t, scope?)))
    .filter(|(t, _)| watched.contains(t));
    // Extension configs follow the config (and a Wasm module's pull secret), after the listeners
    // that name them.
    let extensions = ((request.full || request.secrets)
        && watched.contains(&ResourceType::ExtensionConfig))
    .then_some((ResourceType::ExtensionConfig, Scope::All));
    planned
        .chain(ambient)
        .chain(extensions)
        .chain(names)
        .chain(bundle)
        .chain(secrets)
        .chain(config)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    impl From<Change> for PushRequest {
        fn from(change: Change) -> Self {
            Self {
                full: change.full,
                all_endpoints: change.touches_all_endpoints(),
                services: Arc::new(change.services),
                secrets: !change.credentials.is_empty(),
                names: change.full && !change.names_kept,
                ..Default::default()
            }
        }
    }

    fn change(full: bool, hosts: &[&str]) -> Change {
        Change {
            full,
            services: hosts.iter().map(|h| Hostname::from(*h)).collect(),
            ..Default::default()
        }
    }

    /// A running debouncer (`after`, `max` in ms): its input, what it emitted, and its task.
    fn debouncer(
        after: u64,
        max: u64,
    ) -> (
        tokio::sync::mpsc::UnboundedSender<Change>,
        Arc<Mutex<Vec<Debounced>>>,
        tokio::task::JoinHandle<()>,
    ) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let out = Arc::new(Mutex::new(Vec::new()));
        let sink = out.clone();
        let config = DebounceConfig {
            after: Duration::from_millis(after),
            max: Duration::from_millis(max),
        };
        let task = tokio::spawn(debounce(rx, config, move |d| sink.lock().push(d)));
        (tx, out, task)
    }

    fn changes(out: &Mutex<Vec<Debounced>>) -> Vec<Change> {
        out.lock().iter().map(|d| d.change.clone()).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn debounce_merges_a_burst_into_one_push() {
        let (tx, out, task) = debouncer(100, 10000);
        tx.send(change(false, &["a"])).unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        tx.send(change(true, &["b"])).unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(out.lock().is_empty(), "still within the quiet period");
        tokio::time::sleep(Duration::from_millis(120)).await;
        assert_eq!(changes(&out), vec![change(true, &["a", "b"])]);
        drop(tx);
        task.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn debounce_counts_a_burst_by_trigger_reason() {
        let (tx, out, task) = debouncer(100, 10000);
        tx.send(change(false, &["a"])).unwrap();
        tx.send(change(false, &["b"])).unwrap();
        tx.send(change(true, &["c"])).unwrap();
        drop(tx);
        task.await.unwrap();
        let expected = BTreeMap::from([("endpoint", 2), ("service", 1)]);
        let triggers: Vec<_> = out.lock().iter().map(|d| d.triggers.clone()).collect();
        assert_eq!(triggers, vec![expected]);
    }

    #[tokio::test(start_paused = true)]
    async fn debounce_max_delay_bounds_a_steady_stream() {
        let (tx, out, _task) = debouncer(100, 300);
        for _ in 0..5 {
            tx.send(change(false, &["a"])).unwrap();
            tokio::time::sleep(Duration::from_millis(80)).await;
        }
        assert_eq!(
            out.lock().len(),
            1,
            "max delay forced a push although changes kept coming"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn zero_debounce_pushes_at_once() {
        let (tx, out, _task) = debouncer(0, 10000);
        tx.send(change(false, &["a"])).unwrap();
        tokio::task::yield_now().await;
        tokio::task::yield_now().await;
        assert_eq!(out.lock().len(), 1);
    }

    #[test]
    fn a_queued_proxy_has_its_requests_merged() {
        let slot = PushSlot::default();
        slot.offer(PushRequest::from(change(false, &["a"])));
        slot.offer(PushRequest::from(change(false, &["b"])));
        slot.offer(PushRequest::from(change(true, &[])));
        let merged = PushRequest {
            // The mesh-wide full push may change every assignment.
            all_endpoints: true,
            ..PushRequest::from(change(true, &["a", "b"]))
        };
        assert_eq!(slot.take(), Some(merged));
        assert_eq!(slot.take(), None);
    }

    #[test]
    fn endpoint_change_pushes_eds_only_for_subscribed_clusters() {
        let watched = [
            ResourceType::Cluster,
            ResourceType::Endpoint,
            ResourceType::Listener,
            ResourceType::Route,
        ];
        let subscribed = || {
            [
                "outbound|80||a.ns.svc.cluster.local",
                "outbound|81||a.ns.svc.cluster.local",
                "outbound|80||b.ns.svc.cluster.local",
            ]
            .into_iter()
        };
        let eds_only = PushRequest::from(change(false, &["a.ns.svc.cluster.local"]));
        let plan_eds = plan(&eds_only, &watched, subscribed());
        assert_eq!(plan_eds.len(), 1);
        let (ty, scope) = &plan_eds[0];
        assert_eq!(*ty, ResourceType::Endpoint);
        assert_eq!(
            *scope,
            Scope::Names(
                [
                    "outbound|80||a.ns.svc.cluster.local",
                    "outbound|81||a.ns.svc.cluster.local"
                ]
                .map(String::from)
                .into()
            )
        );
        let unrelated = PushRequest::from(change(false, &["c.ns.svc.cluster.local"]));
        assert!(plan(&unrelated, &watched, subscribed()).is_empty());
        let full = PushRequest::from(change(true, &[]));
        let types: Vec<_> = plan(&full, &watched, subscribed())
            .into_iter()
            .map(|(t, _)| t)
            .collect();
        assert_eq!(types, watched.to_vec());
    }

    #[test]
    fn a_full_push_from_services_alone_sends_only_their_assignments() {
        let watched = [ResourceType::Cluster, ResourceType::Endpoint];
        let subscribed = || {
            [
                "outbound|80||a.ns.svc.cluster.local",
                "outbound|80||b.ns.svc.cluster.local",
            ]
            .into_iter()
        };
        let added = PushRequest::from(change(true, &["c.ns.svc.cluster.local"]));
        assert_eq!(
            plan(&added, &watched, subscribed()),
            vec![(ResourceType::Cluster, Scope::All)],
            "no assignment of a or b changes when c comes"
        );
        let redefined = PushRequest::from(change(true, &["a.ns.svc.cluster.local"]));
        let a = ["outbound|80||a.ns.svc.cluster.local".to_string()];
        assert_eq!(
            plan(&redefined, &watched, subscribed()),
            vec![
                (ResourceType::Cluster, Scope::All),
                (ResourceType::Endpoint, Scope::Names(a.into()))
            ]
        );
        let mut config = change(true, &["c.ns.svc.cluster.local"]);
        config.configs.insert(crate::istio::ConfigKey {
            kind: crate::istio::ConfigKind::DestinationRule,
            namespace: "ns".into(),
            name: "a".into(),
        });
        let config = PushRequest::from(config);
        assert_eq!(
            plan(&config, &watched, subscribed()),
            vec![
                (ResourceType::Cluster, Scope::All),
                (ResourceType::Endpoint, Scope::All)
            ],
            "config may change every assignment"
        );
    }

    #[test]
    fn the_trust_bundle_goes_alone_and_only_when_it_changed() {
        let watched = [
            ResourceType::Cluster,
            ResourceType::Endpoint,
            ResourceType::ProxyConfig,
        ];
        let bundle = PushRequest {
            trust_bundle: true,
            ..Default::default()
        };
        let none = std::iter::empty();
        assert_eq!(
            plan(&bundle, &watched, none),
            vec![(ResourceType::ProxyConfig, Scope::All)]
        );
        let full = PushRequest::from(Change::full());
        let planned = plan(&full, &watched, std::iter::empty());
        assert!(!planned.iter().any(|(t, _)| *t == ResourceType::ProxyConfig));
        assert!(plan(&bundle, &watched[..2], std::iter::empty()).is_empty());
    }
}
