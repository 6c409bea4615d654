//! The xDS protocol per stream, as pure state machines: request in → what to do out.
//!
//! No gRPC here: versions, nonces, ACK/NACK and subscriptions for SotW and Delta are tested
//! without a server. The server only moves messages.

use std::borrow::Borrow;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use serde::Serialize;

use super::wire::Resource;

pub use super::resource_type::{
    ResourceType, ADDRESS_TYPE, AUTHORIZATION_TYPE, CLUSTER_TYPE, ENDPOINT_TYPE,
    EXTENSION_CONFIG_TYPE, LISTENER_TYPE, NAME_TABLE_TYPE, PROXY_CONFIG_TYPE, ROUTE_TYPE,
    SECRET_TYPE,
};

/// What the server must do with one request.
#[derive(Debug, PartialEq, Eq)]
pub enum Action {
    /// Send the type's resources within this scope (for Delta, the names newly asked for).
    Respond(Scope),
    /// The client accepted our last response.
    Ack,
    /// The client rejected our last response and keeps its previous config; the rejected resources
    /// are sent again when they next change. `then`: names the same request newly asked for, which
    /// are answered all the same.
    Nack {
        message: String,
        then: Option<Scope>,
    },
    /// Nothing to do (stale nonce, unsubscribe, ACK without new names).
    Ignore,
}

/// Per-type bookkeeping shared by both variants, shown on /debug/syncz.
#[derive(Clone, Debug, Default, Serialize)]
pub struct TypeStatus {
    pub sent_version: Option<Arc<str>>,
    pub sent_nonce: Option<Arc<str>>,
    pub acked_version: Option<Arc<str>>,
    /// The nonce of the response last acknowledged (istioctl compares it with `sent_nonce`).
    pub acked_nonce: Option<Arc<str>>,
    pub last_nack: Option<Arc<str>>,
    pub resources: usize,
}

/// Which resources of a type a push should (re)send.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Everything the client watches.
    All,
    /// Only these names (those a change touched), where the client watches them.
    Names(BTreeSet<String>),
}

impl Scope {
    pub fn contains(&self, name: &str) -> bool {
        match self {
            Scope::All => true,
            Scope::Names(names) => names.contains(name),
        }
    }

    /// The names of `held` within the scope, in order: found from the smaller side, so a change
    /// to one name costs a lookup, not a pass over everything a wildcard client holds.
    pub fn within<'a>(&'a self, held: &'a BTreeSet<String>) -> Vec<&'a String> {
        match self {
            Scope::All => held.iter().collect(),
            Scope::Names(names) if names.len() < held.len() => {
                names.iter().filter(|n| held.contains(*n)).collect()
            }
            Scope::Names(names) => held.iter().filter(|n| names.contains(*n)).collect(),
        }
    }
}

/// What the server holds for one name a client makes it remember, beyond the name's bytes
/// (measured with jemalloc in tests/held_names.rs): a subscribed name is a `String` (24 B) in a
/// B-tree whose nodes insertions in order leave half empty; an announced resource (Delta
/// `initial_resource_versions`) is a `Held`, an `Arc<Resource>` of 80 B with its name and version
/// as `Arc<str>` (16 B of counts each), in a hash-set slot.
const SUBSCRIBED_FIXED: usize = 72;
const ANNOUNCED_FIXED: usize = 144;

/// The bytes a string of `len` takes: allocations come in size classes up to a quarter apart.
fn stored(len: usize) -> usize {
    len + len / 4
}

/// What holding a subscribed name costs.
fn subscribed_cost(name: &str) -> usize {
    SUBSCRIBED_FIXED + stored(name.len())
}

/// What holding an announced resource costs.
fn announced_cost(name: &str, version: &str) -> usize {
    ANNOUNCED_FIXED + stored(name.len() + version.len())
}

/// State of one type on a SotW stream.
#[derive(Debug, Default)]
pub struct SotwWatch {
    pub wildcard: bool,
    pub names: BTreeSet<String>,
    /// Bumped whenever `names` changes, so readers recompute what depends on it only then.
    pub generation: u64,
    /// What the names asked for cost to hold: what the client makes us remember.
    pub held_bytes: usize,
    pub status: TypeStatus,
}

impl SotwWatch {
    /// Replaces the names asked for; returns whether any is new.
    /// Every ACK repeats the names, so the usual case (the same ones) is one ordered comparison,
    /// with no set built.
    fn set_names(&mut self, names: impl IntoIterator<Item = String>) -> bool {
        let mut names: Vec<String> = names.into_iter().collect();
        names.sort_unstable();
        names.dedup();
        if names.iter().eq(self.names.iter()) {
            return false;
        }
        let grew = names.iter().any(|n| !self.names.contains(n));
        self.held_bytes = names.iter().map(|n| subscribed_cost(n)).sum();
        self.names = names.into_iter().collect();
        self.generation += 1;
        grew
    }
}

impl SotwWatch {
    /// Whether `name` is one this watch asked for.
    pub fn wants(&self, name: &str) -> bool {
        self.wildcard || self.names.contains(name)
    }
}

#[derive(Debug, Default)]
pub struct SotwStream {
    pub watches: BTreeMap<ResourceType, SotwWatch>,
}

impl SotwStream {
    /// Istio's rules: a first request or one without nonce is answered; a stale nonce is ignored; an
    /// ACK is answered only when it asks for names not asked for before. A NACK is recorded, and the
    /// names it carries still count: new ones are answered.
    pub fn on_request(
        &mut self,
        ty: ResourceType,
        names: Vec<String>,
        nonce: &str,
        version: &str,
        error: Option<String>,
    ) -> Action {
        let watch = self.watches.entry(ty).or_default();
        let first = watch.status.sent_nonce.is_none();
        let current = nonce.is_empty() || watch.status.sent_nonce.as_deref() == Some(nonce);
        if let Some(message) = error {
            if !current {
                return Action::Ignore;
            }
            watch.status.last_nack = Some(Arc::from(message.as_str()));
            let grew = !watch.wildcard && watch.set_names(names);
            return Action::Nack {
                message,
                then: grew.then_some(Scope::All),
            };
        }
        if first || nonce.is_empty() {
            watch.wildcard =
                ty.wildcard_capable() && (names.is_empty() || names.iter().any(|n| n == "*"));
            let wildcard = watch.wildcard;
            watch.set_names(names.into_iter().filter(|n| !(wildcard && n == "*")));
            return Action::Respond(Scope::All);
        }
        if !current {
            return Action::Ignore;
        }
        watch.status.acked_version = Some(Arc::from(version));
        watch.status.acked_nonce = watch.status.sent_nonce.clone();
        watch.status.last_nack = None;
        if !watch.wildcard && watch.set_names(names) {
            Action::Respond(Scope::All)
        } else {
            Action::Ack
        }
    }

    /// Records a response sent for `ty`.
    pub fn sent(
        &mut self,
        ty: ResourceType,
        version: &Arc<str>,
        nonce: &Arc<str>,
        resources: usize,
    ) {
        let status = &mut self.watches.entry(ty).or_default().status;
        status.sent_version = Some(version.clone());
        status.sent_nonce = Some(nonce.clone());
        status.resources = resources;
    }
}

/// State of one type on a Delta stream.
#[derive(Debug, Default)]
pub struct DeltaWatch {
    pub wildcard: bool,
    pub subscribed: BTreeSet<String>,
    /// Bumped whenever `subscribed` changes.
    pub generation: u64,
    /// What the names subscribed and announced cost to hold: what the client makes us remember.
    pub held_bytes: usize,
    /// What the client holds: the cached resources themselves, looked up by name. One pointer
    /// per resource (a wildcard CDS client holds thousands); unchanged is a pointer match.
    pub known: HashSet<Held>,
    /// Responses not yet acknowledged: nonce → the names they carried, oldest first. A NACK makes
    /// their versions unknown again, so the next push of the type sends them anew.
    unacked: VecDeque<(Arc<str>, Vec<Arc<str>>)>,
    pub status: TypeStatus,
}

/// A resource a Delta client holds, keyed by its name.
#[derive(Debug, Clone)]
pub struct Held(pub Arc<Resource>);

impl Held {
    /// A resource the client says it holds (`initial_resource_versions`), known only by version.
    fn announced(name: String, version: String) -> Self {
        Held(Arc::new(Resource {
            name: name.into(),
            any: Default::default(),
            version: version.into(),
        }))
    }

    fn is(&self, current: &Arc<Resource>) -> bool {
        Arc::ptr_eq(&self.0, current) || self.0.version == current.version
    }
}

impl PartialEq for Held {
    fn eq(&self, other: &Self) -> bool {
        self.0.name == other.0.name
    }
}

impl Eq for Held {}

impl Hash for Held {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // As `str` hashes, so lookups by `&str` find it.
        (*self.0.name).hash(state);
    }
}

impl Borrow<str> for Held {
    fn borrow(&self) -> &str {
        &self.0.name
    }
}

/// Unacknowledged responses remembered per type: a client answers each in order, so a handful
/// covers any pipelining; older ones are forgotten.
const UNACKED_KEPT: usize = 8;

impl DeltaWatch {
    pub fn wants(&self, name: &str) -> bool {
        self.wildcard || self.subscribed.contains(name)
    }

    /// The client answered the response with `nonce` (and, in order, every earlier one).
    fn answered(&mut self, nonce: &str, rejected: bool) {
        let Some(pos) = self.unacked.iter().position(|(n, _)| **n == *nonce) else {
            return;
        };
        let answered: Vec<_> = self.unacked.drain(..=pos).collect();
        if rejected {
            if let Some((_, names)) = answered.last() {
                for name in names {
                    self.known.remove(&**name);
                }
            }
        }
    }

    /// Given the current resources within `scope`, returns what to send (changed or new to the
    /// client) and which names the client holds that no longer exist; updates what the client holds.
    /// With `announce_absent`, names of the scope that do not exist are reported removed even if the
    /// client never held them: the answer to a subscription of a name that does not exist.
    pub fn diff(
        &mut self,
        scope: &Scope,
        current: Vec<Arc<Resource>>,
        announce_absent: bool,
    ) -> (Vec<Arc<Resource>>, Vec<String>) {
        // One pass: what changed, and how many known names are still present. The client's
        // versions are the cached resources' own `Arc`s, so an unchanged resource is a pointer match.
        let mut still_known = 0;
        let mut changed: Vec<Arc<Resource>> = Vec::new();
        for r in current.iter() {
            match self.known.get(&*r.name) {
                Some(held) => {
                    still_known += 1;
                    if !held.is(r) {
                        changed.push(r.clone());
                    }
                }
                None => changed.push(r.clone()),
            }
        }
        // The names the client holds within the scope may have gone; usually every one is still
        // present: then nothing is removed and no set is built.
        let known_in_scope = |names| held_among(&self.known, names);
        let held_in_scope = match scope {
            Scope::All => self.known.len(),
            Scope::Names(names) => known_in_scope(names).count(),
        };
        let mut removed: Vec<String> = Vec::new();
        if still_known < held_in_scope {
            let present: BTreeSet<&str> = current.iter().map(|r| &*r.name).collect();
            let candidates: Vec<&str> = match scope {
                Scope::All => self.known.iter().map(|held| &*held.0.name).collect(),
                Scope::Names(names) => known_in_scope(names).collect(),
            };
            removed = (candidates.into_iter())
                .filter(|n| !present.contains(n))
                .map(str::to_string)
                .collect();
            removed.sort();
            for name in &removed {
                self.known.remove(name.as_str());
            }
            // A set that held a removed cluster's thousands keeps its table otherwise.
            if self.known.len() < self.known.capacity() / 4 {
                self.known.shrink_to_fit();
            }
        }
        for r in &changed {
            self.known.replace(Held(r.clone()));
        }
        if let (true, Scope::Names(names)) = (announce_absent, scope) {
            let present: BTreeSet<&str> = current.iter().map(|r| &*r.name).collect();
            let absent: Vec<String> = names
                .iter()
                .filter(|n| !present.contains(n.as_str()) && !removed.contains(n))
                .cloned()
                .collect();
            removed.extend(absent);
            removed.sort();
        }
        (changed, removed)
    }
}

/// The names of `names` the client holds.
fn held_among<'a>(
    known: &'a HashSet<Held>,
    names: &'a BTreeSet<String>,
) -> impl Iterator<Item = &'a str> + 'a {
    (names.iter().map(String::as_str)).filter(|n| known.contains(*n))
}

#[derive(Debug, Default)]
pub struct DeltaStream {
    pub watches: BTreeMap<ResourceType, DeltaWatch>,
}

/// One Delta request, reduced to what the state machine reads.
pub struct DeltaRequest<'a> {
    pub ty: ResourceType,
    pub subscribe: Vec<String>,
    pub unsubscribe: Vec<String>,
    pub initial_versions: HashMap<String, String>,
    pub nonce: &'a str,
    pub error: Option<String>,
}

impl DeltaStream {
    /// Applies the request's subscription changes (NACK or not), then decides: everything on a first
    /// request, else the names asked for. A name asked for again is sent again, `"*"` is the wildcard
    /// only for types that have one (elsewhere it is just a name).
    pub fn on_request(&mut self, req: DeltaRequest<'_>) -> Action {
        let first = !self.watches.contains_key(&req.ty);
        let wildcard_capable = req.ty.wildcard_capable();
        let watch = self.watches.entry(req.ty).or_default();
        if first {
            watch.wildcard = wildcard_capable && req.subscribe.is_empty();
            watch.held_bytes = (req.initial_versions.iter())
                .map(|(name, version)| announced_cost(name, version))
                .sum();
            watch.known = req
                .initial_versions
                .into_iter()
                .map(|(name, version)| Held::announced(name, version))
                .collect();
        }
        let mut requested = BTreeSet::new();
        for name in req.subscribe {
            if name == "*" && wildcard_capable {
                watch.wildcard = true;
                continue;
            }
            if watch.subscribed.insert(name.clone()) {
                watch.generation += 1;
                watch.held_bytes += subscribed_cost(&name);
            }
            if !first {
                // The client asks again for what it may hold: it expects it resent.
                watch.known.remove(name.as_str());
            }
            requested.insert(name);
        }
        for name in req.unsubscribe {
            if name == "*" && wildcard_capable {
                watch.wildcard = false;
            }
            if watch.subscribed.remove(&name) {
                watch.generation += 1;
                watch.held_bytes -= subscribed_cost(&name);
            }
            // The client drops what it unsubscribes from; re-subscribing must resend it.
            watch.known.remove(name.as_str());
        }
        let requested = (!requested.is_empty()).then_some(Scope::Names(requested));
        if let Some(message) = req.error {
            watch.answered(req.nonce, true);
            watch.status.last_nack = Some(Arc::from(message.as_str()));
            return Action::Nack {
                message,
                then: if first { Some(Scope::All) } else { requested },
            };
        }
        if first {
            return Action::Respond(Scope::All);
        }
        let acked = !req.nonce.is_empty() && watch.status.sent_nonce.as_deref() == Some(req.nonce);
        if acked {
            watch.status.acked_version = watch.status.sent_version.clone();
            watch.status.acked_nonce = watch.status.sent_nonce.clone();
            watch.status.last_nack = None;
        }
        watch.answered(req.nonce, false);
        match (requested, acked) {
            (Some(scope), _) => Action::Respond(scope),
            (None, true) => Action::Ack,
            (None, false) => Action::Ignore,
        }
    }

    /// Records a response sent for `ty`, carrying `names`.
    pub fn sent(
        &mut self,
        ty: ResourceType,
        version: &Arc<str>,
        nonce: &Arc<str>,
        names: Vec<Arc<str>>,
    ) {
        let watch = self.watches.entry(ty).or_default();
        watch.status.sent_version = Some(version.clone());
        watch.status.sent_nonce = Some(nonce.clone());
        watch.status.resources = watch.known.len();
        if watch.unacked.len() == UNACKED_KEPT {
            watch.unacked.pop_front();
        }
        watch.unacked.push_back((nonce.clone(), names));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::istio::ConfigKind;

    #[test]
    fn the_metrics_count_types_in_this_order() {
        let mut shorts: Vec<&str> = ResourceType::ALL.iter().map(|t| t.short()).collect();
        shorts.push(ResourceType::Config(ConfigKind::ServiceEntry, 0).short());
        assert_eq!(shorts, crate::metrics::XDS_TYPES);
    }
    use ResourceType::*;

    fn names(n: &[&str]) -> Vec<String> {
        n.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn sotw_first_request_then_ack_then_stale() {
        let mut s = SotwStream::default();
        assert_eq!(
            s.on_request(Cluster, vec![], "", "", None),
            Action::Respond(Scope::All)
        );
        assert!(s.watches[&Cluster].wildcard);
        s.sent(Cluster, &"v1".into(), &"n1".into(), 3);
        assert_eq!(s.on_request(Cluster, vec![], "n1", "v1", None), Action::Ack);
        assert_eq!(
            s.watches[&Cluster].status.acked_version.as_deref(),
            Some("v1")
        );
        s.sent(Cluster, &"v2".into(), &"n2".into(), 3);
        assert_eq!(
            s.on_request(Cluster, vec![], "n1", "v1", None),
            Action::Ignore,
            "stale nonce"
        );
    }

    #[test]
    fn sotw_nack_is_recorded_and_not_answered() {
        let mut s = SotwStream::default();
        s.on_request(Endpoint, names(&["a"]), "", "", None);
        s.sent(Endpoint, &"v1".into(), &"n1".into(), 1);
        let action = s.on_request(
            Endpoint,
            names(&["a"]),
            "n1",
            "",
            Some("bad cluster".into()),
        );
        assert_eq!(
            action,
            Action::Nack {
                message: "bad cluster".into(),
                then: None
            }
        );
        assert_eq!(
            s.watches[&Endpoint].status.last_nack.as_deref(),
            Some("bad cluster")
        );
        assert_eq!(s.watches[&Endpoint].status.acked_version, None);
        // The next ACK clears it.
        s.sent(Endpoint, &"v2".into(), &"n2".into(), 1);
        assert_eq!(
            s.on_request(Endpoint, names(&["a"]), "n2", "v2", None),
            Action::Ack
        );
        assert!(s.watches[&Endpoint].status.last_nack.is_none());
    }

    #[test]
    fn sotw_ack_with_new_names_is_answered() {
        let mut s = SotwStream::default();
        s.on_request(Endpoint, names(&["a"]), "", "", None);
        s.sent(Endpoint, &"v1".into(), &"n1".into(), 1);
        assert_eq!(
            s.on_request(Endpoint, names(&["a", "b"]), "n1", "v1", None),
            Action::Respond(Scope::All)
        );
        s.sent(Endpoint, &"v1".into(), &"n2".into(), 2);
        assert_eq!(
            s.on_request(Endpoint, names(&["b"]), "n2", "v1", None),
            Action::Ack,
            "shrinking needs no answer"
        );
        assert!(!s.watches[&Endpoint].wants("a"));
    }

    #[test]
    fn subscription_generation_moves_only_with_the_names() {
        let mut s = SotwStream::default();
        s.on_request(Endpoint, names(&["a"]), "", "", None);
        let first = s.watches[&Endpoint].generation;
        s.sent(Endpoint, &"v1".into(), &"n1".into(), 1);
        s.on_request(Endpoint, names(&["a"]), "n1", "v1", None);
        assert_eq!(
            s.watches[&Endpoint].generation, first,
            "a plain ACK changes nothing"
        );
        s.sent(Endpoint, &"v2".into(), &"n2".into(), 1);
        s.on_request(Endpoint, names(&["a", "b"]), "n2", "v2", None);
        assert_eq!(s.watches[&Endpoint].generation, first + 1);
    }

    #[test]
    fn sotw_named_listener_request_is_not_wildcard() {
        let mut s = SotwStream::default();
        s.on_request(
            Listener,
            names(&["svc.ns.svc.cluster.local:80"]),
            "",
            "",
            None,
        );
        assert!(!s.watches[&Listener].wildcard);
        assert!(s.watches[&Listener].wants("svc.ns.svc.cluster.local:80"));
    }

    fn delta<'a>(
        ty: ResourceType,
        sub: &[&str],
        unsub: &[&str],
        nonce: &'a str,
    ) -> DeltaRequest<'a> {
        DeltaRequest {
            ty,
            subscribe: names(sub),
            unsubscribe: names(unsub),
            initial_versions: HashMap::new(),
            nonce,
            error: None,
        }
    }

    fn res(name: &str, version: &str) -> Arc<Resource> {
        Arc::new(Resource {
            name: name.into(),
            any: Default::default(),
            version: version.into(),
        })
    }

    #[test]
    fn delta_sends_only_changes_and_removals() {
        let mut s = DeltaStream::default();
        assert_eq!(
            s.on_request(delta(Cluster, &[], &[], "")),
            Action::Respond(Scope::All)
        );
        let w = s.watches.get_mut(&Cluster).unwrap();
        assert!(w.wildcard);
        let (send, removed) = w.diff(&Scope::All, vec![res("a", "1"), res("b", "1")], false);
        assert_eq!((send.len(), removed.len()), (2, 0));
        let (send, removed) = w.diff(&Scope::All, vec![res("a", "1"), res("b", "2")], false);
        assert_eq!(send.iter().map(|r| &*r.name).collect::<Vec<_>>(), ["b"]);
        assert!(removed.is_empty());
        let (send, removed) = w.diff(&Scope::All, vec![res("b", "2")], false);
        assert!(send.is_empty());
        assert_eq!(removed, ["a"]);
    }

    #[test]
    fn delta_scoped_diff_leaves_other_names_alone() {
        let mut s = DeltaStream::default();
        s.on_request(delta(Endpoint, &["a", "b"], &[], ""));
        let w = s.watches.get_mut(&Endpoint).unwrap();
        w.diff(&Scope::All, vec![res("a", "1"), res("b", "1")], false);
        let scope = Scope::Names(["a".to_string()].into());
        let (send, removed) = w.diff(&scope, vec![res("a", "2")], false);
        assert_eq!(
            (send.len(), removed.len()),
            (1, 0),
            "b is out of scope, not removed"
        );
        let (send, removed) = w.diff(&scope, vec![], false);
        assert!(send.is_empty());
        assert_eq!(removed, ["a"], "a went, within the scope");
        assert!(w.known.contains("b") && !w.known.contains("a"));
    }

    #[test]
    fn a_scope_picks_the_same_names_from_either_side() {
        let held: BTreeSet<String> = names(&["a", "b", "c", "d"]).into_iter().collect();
        assert_eq!(Scope::All.within(&held).len(), 4);
        let few = names_scope(&["b", "x"]);
        assert_eq!(few.within(&held), ["b"]);
        let many = names_scope(&["a", "c", "d", "e", "f", "g"]);
        assert_eq!(many.within(&held), ["a", "c", "d"]);
    }

    #[test]
    fn sotw_ack_naming_the_same_set_in_another_order_is_a_plain_ack() {
        let mut s = SotwStream::default();
        s.on_request(Endpoint, names(&["a", "b"]), "", "", None);
        let first = s.watches[&Endpoint].generation;
        s.sent(Endpoint, &"v1".into(), &"n1".into(), 2);
        let again = names(&["b", "a", "b"]);
        assert_eq!(s.on_request(Endpoint, again, "n1", "v1", None), Action::Ack);
        assert_eq!(s.watches[&Endpoint].generation, first);
    }

    fn names_scope(n: &[&str]) -> Scope {
        Scope::Names(n.iter().map(|s| s.to_string()).collect())
    }

    #[test]
    fn delta_subscribe_ack_unsubscribe() {
        let mut s = DeltaStream::default();
        s.on_request(delta(Endpoint, &["a"], &[], ""));
        s.watches
            .get_mut(&Endpoint)
            .unwrap()
            .diff(&Scope::All, vec![res("a", "1")], false);
        s.sent(Endpoint, &"v1".into(), &"n1".into(), vec!["a".into()]);
        assert_eq!(s.on_request(delta(Endpoint, &[], &[], "n1")), Action::Ack);
        assert_eq!(
            s.on_request(delta(Endpoint, &["b"], &[], "n1")),
            Action::Respond(names_scope(&["b"]))
        );
        assert_eq!(
            s.on_request(delta(Endpoint, &[], &["a"], "")),
            Action::Ignore
        );
        let w = &s.watches[&Endpoint];
        assert!(!w.wants("a") && w.wants("b") && !w.known.contains("a"));
    }

    #[test]
    fn delta_initial_versions_avoid_resending() {
        let mut s = DeltaStream::default();
        let mut req = delta(Cluster, &[], &[], "");
        req.initial_versions.insert("a".into(), "1".into());
        s.on_request(req);
        let (send, removed) = s.watches.get_mut(&Cluster).unwrap().diff(
            &Scope::All,
            vec![res("a", "1"), res("b", "1")],
            false,
        );
        assert_eq!(send.iter().map(|r| &*r.name).collect::<Vec<_>>(), ["b"]);
        assert!(removed.is_empty());
    }

    #[test]
    fn delta_nack_is_recorded() {
        let mut s = DeltaStream::default();
        s.on_request(delta(Cluster, &[], &[], ""));
        s.sent(Cluster, &"v1".into(), &"n1".into(), vec![]);
        let mut req = delta(Cluster, &[], &[], "n1");
        req.error = Some("boom".into());
        assert_eq!(
            s.on_request(req),
            Action::Nack {
                message: "boom".into(),
                then: None
            }
        );
        assert_eq!(
            s.watches[&Cluster].status.last_nack.as_deref(),
            Some("boom")
        );
        assert_eq!(s.watches[&Cluster].status.acked_version, None);
    }

    #[test]
    fn delta_nack_keeps_the_subscription_changes_it_carries() {
        let mut s = DeltaStream::default();
        s.on_request(delta(Endpoint, &["a", "b"], &[], ""));
        let w = s.watches.get_mut(&Endpoint).unwrap();
        w.diff(&Scope::All, vec![res("a", "1"), res("b", "1")], false);
        s.sent(
            Endpoint,
            &"v1".into(),
            &"n1".into(),
            vec!["a".into(), "b".into()],
        );
        let mut req = delta(Endpoint, &["c"], &["b"], "n1");
        req.error = Some("rejected a".into());
        assert_eq!(
            s.on_request(req),
            Action::Nack {
                message: "rejected a".into(),
                then: Some(names_scope(&["c"]))
            },
            "the newly subscribed name is answered despite the NACK"
        );
        let w = s.watches.get_mut(&Endpoint).unwrap();
        assert!(w.wants("a") && !w.wants("b") && w.wants("c"));
        // What the rejected response carried is unknown to the client again: the next push of the
        // type sends it, changed or not.
        let (send, _) = w.diff(&Scope::All, vec![res("a", "1"), res("c", "1")], false);
        let names: Vec<&str> = send.iter().map(|r| &*r.name).collect();
        assert_eq!(names, ["a", "c"]);
    }

    #[test]
    fn delta_ack_settles_what_earlier_responses_carried() {
        let mut s = DeltaStream::default();
        s.on_request(delta(Endpoint, &["a", "b"], &[], ""));
        let w = s.watches.get_mut(&Endpoint).unwrap();
        w.diff(&Scope::All, vec![res("a", "1"), res("b", "1")], false);
        s.sent(Endpoint, &"v1".into(), &"n1".into(), vec!["a".into()]);
        s.sent(Endpoint, &"v2".into(), &"n2".into(), vec!["b".into()]);
        assert_eq!(
            s.on_request(delta(Endpoint, &[], &[], "n1")),
            Action::Ignore
        );
        let mut req = delta(Endpoint, &[], &[], "n2");
        req.error = Some("b is bad".into());
        s.on_request(req);
        let w = s.watches.get_mut(&Endpoint).unwrap();
        let (send, _) = w.diff(&Scope::All, vec![res("a", "1"), res("b", "1")], false);
        let names: Vec<&str> = send.iter().map(|r| &*r.name).collect();
        assert_eq!(
            names,
            ["b"],
            "only the rejected response's resources are resent"
        );
    }

    #[test]
    fn delta_star_is_a_wildcard_only_where_the_type_has_one() {
        let mut s = DeltaStream::default();
        s.on_request(delta(Cluster, &["*", "x"], &[], ""));
        assert!(s.watches[&Cluster].wildcard);
        assert!(!s.watches[&Cluster].subscribed.contains("*"));
        s.on_request(delta(Endpoint, &["*"], &[], ""));
        let eds = &s.watches[&Endpoint];
        assert!(!eds.wildcard, "EDS has no wildcard");
        assert!(eds.subscribed.contains("*"), "it is an ordinary name there");
    }

    #[test]
    fn delta_subscription_of_a_missing_name_is_answered_as_removed() {
        let mut s = DeltaStream::default();
        assert_eq!(
            s.on_request(delta(Endpoint, &["a", "ghost"], &[], "")),
            Action::Respond(Scope::All)
        );
        let w = s.watches.get_mut(&Endpoint).unwrap();
        let (send, removed) = w.diff(&names_scope(&["a", "ghost"]), vec![res("a", "1")], true);
        assert_eq!(send.len(), 1);
        assert_eq!(removed, ["ghost"]);
        // A push (not a request) does not repeat it.
        let (_, removed) = w.diff(&names_scope(&["a", "ghost"]), vec![res("a", "2")], false);
        assert!(removed.is_empty());
    }

    #[test]
    fn delta_resubscribing_to_a_held_name_resends_it() {
        let mut s = DeltaStream::default();
        s.on_request(delta(Endpoint, &["a"], &[], ""));
        let w = s.watches.get_mut(&Endpoint).unwrap();
        w.diff(&Scope::All, vec![res("a", "1")], false);
        s.sent(Endpoint, &"v1".into(), &"n1".into(), vec!["a".into()]);
        assert_eq!(
            s.on_request(delta(Endpoint, &["a"], &[], "n1")),
            Action::Respond(names_scope(&["a"]))
        );
        let w = s.watches.get_mut(&Endpoint).unwrap();
        let (send, _) = w.diff(&names_scope(&["a"]), vec![res("a", "1")], true);
        assert_eq!(send.len(), 1, "same version, sent again");
    }

    #[test]
    fn sotw_nack_still_takes_new_names() {
        let mut s = SotwStream::default();
        s.on_request(Endpoint, names(&["a"]), "", "", None);
        s.sent(Endpoint, &"v1".into(), &"n1".into(), 1);
        let action = s.on_request(Endpoint, names(&["a", "b"]), "n1", "", Some("bad".into()));
        assert_eq!(
            action,
            Action::Nack {
                message: "bad".into(),
                then: Some(Scope::All)
            }
        );
        assert!(s.watches[&Endpoint].wants("b"));
        // A stale NACK changes nothing.
        s.sent(Endpoint, &"v2".into(), &"n2".into(), 2);
        let stale = s.on_request(Endpoint, names(&["c"]), "n1", "", Some("old".into()));
        assert_eq!(stale, Action::Ignore);
        assert!(!s.watches[&Endpoint].wants("c"));
    }
}
