//! Sessions: one per stream, the protocol state machine plus response assembly. Synchronous: they
//! turn a request or a push into encoded responses, and the stream task (`xds/stream`) moves bytes.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DiscoveryRequest};
use tracing::{debug, warn};

use super::generate::Generation;
use super::protocol::{Action, DeltaRequest, DeltaStream, ResourceType, Scope, SotwStream};
use super::push::{plan, PushRequest};
use super::server::{Connection, XdsServer};
use super::wire::{self, Encoded, Listing};
use crate::text::clip;

/// Unknown types a stream may ask for before it is refused: bounds what a client makes us remember.
const MAX_UNKNOWN_TYPES: usize = 16;

/// What the resource names one stream subscribes to or announces may cost the server to hold, all
/// types together (`protocol`'s per-name costs): a sidecar of a mesh of 20,000 services names
/// about 3 MiB.
pub const MAX_STREAM_HELD_BYTES: usize = 16 << 20;

/// What a request asks of the stream.
#[derive(Debug)]
pub enum Answer {
    Nothing,
    /// Build and send this type's resources within the scope (a client request: names it asked
    /// for that do not exist are reported as such).
    Resources(ResourceType, Scope),
    /// An empty response for a type meshpilot does not serve (extension configs, for one):
    /// the client learns there is nothing rather than waiting.
    Empty(Bytes),
    /// The client is misbehaving; the stream ends with this.
    Refuse(tonic::Status),
    /// An `istio.io/debug*` request (istioctl): answered from the debug views, never watched.
    Debug(DebugRequest),
}

#[derive(Debug)]
pub struct DebugRequest {
    pub type_url: String,
    pub names: Vec<String>,
    pub nonce: Arc<str>,
}

/// What every response needs besides its resources.
pub struct Reply<'a> {
    pub generation: &'a Generation<'a>,
    pub version: &'a Arc<str>,
}

/// A protocol variant's session.
pub trait Session<Req>: Send + Sync {
    fn on_request(&mut self, request: Req) -> Answer;
    /// Appends the response for one type to `out` (Delta sends nothing when nothing changed).
    /// `requested`: the client asked (rather than a change being pushed).
    fn respond(
        &mut self,
        reply: &Reply<'_>,
        ty: ResourceType,
        scope: &Scope,
        requested: bool,
        out: &mut Vec<Encoded>,
    );
    fn watched(&self) -> Vec<ResourceType>;
    /// The EDS resources the proxy subscribes to.
    fn eds_names(&self) -> Box<dyn Iterator<Item = &str> + '_>;

    /// Appends what a push request means for this stream.
    fn push(&mut self, reply: &Reply<'_>, request: &PushRequest, out: &mut Vec<Encoded>) {
        let planned = plan(request, &self.watched(), self.eds_names());
        for (ty, scope) in planned {
            self.respond(reply, ty, &scope, false, out);
        }
    }
}

/// State both variants share: the server, the connection and the unknown types answered so far.
struct Common {
    server: Arc<XdsServer>,
    conn: Arc<Connection>,
    /// Type URL → nonce of the empty response sent for it.
    unknown: HashMap<String, Arc<str>>,
    /// (type, error code) of the proxy's rejects, whose gauges go when it does.
    rejected: BTreeSet<(ResourceType, String)>,
    /// The name bytes this stream counts against the server's budget.
    held_bytes: usize,
}

impl Drop for Common {
    fn drop(&mut self) {
        let metrics = self.server.metrics();
        metrics.forget_rejects(&self.conn.proxy.id, self.rejected.iter());
        self.server.release_held_bytes(self.held_bytes);
    }
}

impl Common {
    /// Counts what the stream's names cost to hold (`total` bytes) against its budget and the
    /// server's; a stream over either is refused (and its names forgotten with it).
    fn account(&mut self, total: usize) -> Option<Answer> {
        let exhausted =
            |what: String| Some(Answer::Refuse(tonic::Status::resource_exhausted(what)));
        if total > MAX_STREAM_HELD_BYTES {
            return exhausted(format!(
                "the stream's resource names take {total} bytes to hold; at most {MAX_STREAM_HELD_BYTES} are kept per stream"
            ));
        }
        let accounted = std::mem::replace(&mut self.held_bytes, total);
        if !self.server.reserve_held_bytes(accounted, total) {
            self.held_bytes = accounted;
            return exhausted("the server keeps no more resource names; retry later".into());
        }
        None
    }

    /// Istio config itself (MCP) is for other control planes only: a refusal for any other client.
    fn config_access(&self, ty: ResourceType) -> Option<Answer> {
        if !matches!(ty, ResourceType::Config(..)) || self.server.serves_config_to(&self.conn.proxy)
        {
            return None;
        }
        Some(Answer::Refuse(tonic::Status::permission_denied(
            "Istio config over xDS is served to clients proven in the root namespace on the secure port",
        )))
    }

    /// Types answered per request rather than watched (unserved and debug types): the nonce for a
    /// new answer, None for an acknowledgement of ours (not a request), or a refusal once a client
    /// has asked for too many distinct ones (what it makes us remember is bounded).
    fn answer_once(&mut self, type_url: &str, nonce: &str) -> Result<Option<Arc<str>>, Answer> {
        match self.unknown.get(type_url) {
            Some(sent) if **sent == *nonce => return Ok(None),
            None if self.unknown.len() >= MAX_UNKNOWN_TYPES => {
                return Err(Answer::Refuse(tonic::Status::invalid_argument(format!(
                    "more than {MAX_UNKNOWN_TYPES} resource types meshpilot does not serve"
                ))))
            }
            _ => {}
        }
        let fresh = self.server.next_nonce();
        self.unknown.insert(type_url.to_string(), fresh.clone());
        Ok(Some(fresh))
    }

    /// An unknown type's request: answered with an empty response.
    fn unknown_type(
        &mut self,
        type_url: String,
        nonce: &str,
        encode: impl FnOnce(&str, &str) -> Bytes,
    ) -> Answer {
        match self.answer_once(&type_url, nonce) {
            Ok(Some(nonce)) => {
                debug!(proxy = %self.conn.proxy.id, type_url = %clip(&type_url), "answering an unserved type with nothing");
                Answer::Empty(encode(&type_url, &nonce))
            }
            Ok(None) => Answer::Nothing,
            Err(refusal) => refusal,
        }
    }

    /// A debug request (istioctl): answered each time it is made.
    fn debug(&mut self, type_url: String, names: Vec<String>, nonce: &str) -> Answer {
        match self.answer_once(&type_url, nonce) {
            Ok(Some(nonce)) => Answer::Debug(DebugRequest {
                type_url,
                names,
                nonce,
            }),
            Ok(None) => Answer::Nothing,
            Err(refusal) => refusal,
        }
    }

    /// Turns the protocol's decision into an answer; records NACKs and the EDS subscription.
    /// `code`: the gRPC status code of the request's error detail, if any.
    fn conclude(
        &mut self,
        ty: ResourceType,
        action: Action,
        code: i32,
        eds_generation: u64,
        eds: &dyn Fn() -> Vec<String>,
    ) -> Answer {
        if ty == ResourceType::Endpoint
            && self
                .conn
                .eds_generation
                .swap(eds_generation, Ordering::Relaxed)
                != eds_generation
        {
            self.conn.set_eds_names(eds().iter());
        }
        match action {
            Action::Respond(scope) => Answer::Resources(ty, scope),
            Action::Nack { message, then } => {
                let err = format!("{:?}", tonic::Code::from_i32(code));
                self.server.metrics().nacked(ty, &self.conn.proxy.id, &err);
                self.rejected.insert((ty, err));
                warn!(proxy = %self.conn.proxy.id, r#type = ty.short(), error = %clip(&message), "NACK");
                match then {
                    Some(scope) => Answer::Resources(ty, scope),
                    None => Answer::Nothing,
                }
            }
            Action::Ack | Action::Ignore => Answer::Nothing,
        }
    }
}

pub struct SotwSession {
    common: Common,
    stream: SotwStream,
}

impl SotwSession {
    pub fn new(server: Arc<XdsServer>, conn: Arc<Connection>) -> Self {
        Self {
            common: Common {
                server,
                conn,
                unknown: HashMap::new(),
                rejected: BTreeSet::new(),
                held_bytes: 0,
            },
            stream: SotwStream::default(),
        }
    }

    fn publish_status(&self, ty: ResourceType) {
        if let Some(w) = self.stream.watches.get(&ty) {
            self.common.conn.publish_status(ty, w.status.clone());
            self.common.conn.publish_names(ty, &w.names);
        }
    }
}

impl Session<DiscoveryRequest> for SotwSession {
    fn on_request(&mut self, request: DiscoveryRequest) -> Answer {
        if request.type_url.starts_with(super::debug::DEBUG_TYPE) {
            return self.common.debug(
                request.type_url,
                request.resource_names,
                &request.response_nonce,
            );
        }
        let Some(ty) = ResourceType::from_url(&request.type_url) else {
            return self.common.unknown_type(
                request.type_url,
                &request.response_nonce,
                |url, nonce| wire::sotw_response(url, "", nonce, &Listing::default()).to_bytes(),
            );
        };
        if let Some(refusal) = self.common.config_access(ty) {
            return refusal;
        }
        let code = request.error_detail.as_ref().map_or(0, |e| e.code);
        let error = request.error_detail.map(|e| e.message);
        let action = self.stream.on_request(
            ty,
            request.resource_names,
            &request.response_nonce,
            &request.version_info,
            error,
        );
        let names = self.stream.watches.values().map(|w| w.held_bytes).sum();
        if let Some(refusal) = self.common.account(names) {
            return refusal;
        }
        let generation = self
            .stream
            .watches
            .get(&ResourceType::Endpoint)
            .map_or(0, |w| w.generation);
        let stream = &self.stream;
        let answer = self.common.conclude(ty, action, code, generation, &|| {
            sotw_eds_names(stream).map(str::to_string).collect()
        });
        self.publish_status(ty);
        answer
    }

    fn respond(
        &mut self,
        reply: &Reply<'_>,
        ty: ResourceType,
        scope: &Scope,
        _requested: bool,
        out: &mut Vec<Encoded>,
    ) {
        let Some(watch) = self.stream.watches.get(&ty) else {
            return;
        };
        let started = Instant::now();
        let g = reply.generation;
        let resources = if watch.wildcard {
            g.all(ty)
        } else {
            Listing::own(g.named(ty, scope.within(&watch.names)))
        };
        let nonce = self.common.server.next_nonce();
        out.push(wire::sotw_response(
            ty.url(),
            reply.version,
            &nonce,
            &resources,
        ));
        self.stream.sent(ty, reply.version, &nonce, resources.len());
        self.publish_status(ty);
        self.common.server.metrics().pushed(ty, started.elapsed());
        debug!(proxy = %self.common.conn.proxy.id, r#type = ty.short(), version = &**reply.version, resources = resources.len(), "sent");
    }

    fn watched(&self) -> Vec<ResourceType> {
        self.stream.watches.keys().copied().collect()
    }

    fn eds_names(&self) -> Box<dyn Iterator<Item = &str> + '_> {
        Box::new(sotw_eds_names(&self.stream))
    }
}

pub struct DeltaSession {
    common: Common,
    stream: DeltaStream,
}

impl DeltaSession {
    pub fn new(server: Arc<XdsServer>, conn: Arc<Connection>) -> Self {
        Self {
            common: Common {
                server,
                conn,
                unknown: HashMap::new(),
                rejected: BTreeSet::new(),
                held_bytes: 0,
            },
            stream: DeltaStream::default(),
        }
    }

    fn publish_status(&self, ty: ResourceType) {
        if let Some(w) = self.stream.watches.get(&ty) {
            self.common.conn.publish_status(ty, w.status.clone());
            self.common.conn.publish_names(ty, &w.subscribed);
        }
    }
}

impl Session<DeltaDiscoveryRequest> for DeltaSession {
    fn on_request(&mut self, request: DeltaDiscoveryRequest) -> Answer {
        let Some(ty) = ResourceType::from_url(&request.type_url) else {
            return self.common.unknown_type(
                request.type_url,
                &request.response_nonce,
                |url, nonce| wire::delta_response(url, "", nonce, &[], &[]),
            );
        };
        if let Some(refusal) = self.common.config_access(ty) {
            return refusal;
        }
        let code = request.error_detail.as_ref().map_or(0, |e| e.code);
        let action = self.stream.on_request(DeltaRequest {
            ty,
            subscribe: request.resource_names_subscribe,
            unsubscribe: request.resource_names_unsubscribe,
            initial_versions: request.initial_resource_versions,
            nonce: &request.response_nonce,
            error: request.error_detail.map(|e| e.message),
        });
        let names = self.stream.watches.values().map(|w| w.held_bytes).sum();
        if let Some(refusal) = self.common.account(names) {
            return refusal;
        }
        let generation = self
            .stream
            .watches
            .get(&ResourceType::Endpoint)
            .map_or(0, |w| w.generation);
        let stream = &self.stream;
        let answer = self.common.conclude(ty, action, code, generation, &|| {
            delta_eds_names(stream).map(str::to_string).collect()
        });
        self.publish_status(ty);
        answer
    }

    fn respond(
        &mut self,
        reply: &Reply<'_>,
        ty: ResourceType,
        scope: &Scope,
        requested: bool,
        out: &mut Vec<Encoded>,
    ) {
        let started = Instant::now();
        let g = reply.generation;
        let Some(watch) = self.stream.watches.get_mut(&ty) else {
            return;
        };
        let first = watch.status.sent_nonce.is_none();
        let (current, considered) = if watch.wildcard && *scope == Scope::All {
            (g.all(ty).iter().cloned().collect(), Scope::All)
        } else if let (true, Scope::Names(names)) = (watch.wildcard, scope) {
            // A change to some of what a wildcard subscription holds.
            (g.changed(ty, names), scope.clone())
        } else {
            let names: BTreeSet<String> = scope
                .within(&watch.subscribed)
                .into_iter()
                .cloned()
                .collect();
            (g.named(ty, names.iter()), Scope::Names(names))
        };
        let (changed, removed) = watch.diff(&considered, current, requested);
        if changed.is_empty() && removed.is_empty() && !first {
            return;
        }
        let nonce = self.common.server.next_nonce();
        out.push(wire::delta_response(ty.url(), reply.version, &nonce, &changed, &removed).into());
        let names = changed.iter().map(|r| r.name.clone()).collect();
        self.stream.sent(ty, reply.version, &nonce, names);
        self.publish_status(ty);
        self.common.server.metrics().pushed(ty, started.elapsed());
        debug!(proxy = %self.common.conn.proxy.id, r#type = ty.short(), version = &**reply.version, changed = changed.len(), removed = removed.len(), "sent");
    }

    fn watched(&self) -> Vec<ResourceType> {
        self.stream.watches.keys().copied().collect()
    }

    fn eds_names(&self) -> Box<dyn Iterator<Item = &str> + '_> {
        Box::new(delta_eds_names(&self.stream))
    }
}

fn sotw_eds_names(stream: &SotwStream) -> impl Iterator<Item = &str> {
    let watch = stream.watches.get(&ResourceType::Endpoint);
    watch
        .into_iter()
        .flat_map(|w| w.names.iter().map(String::as_str))
}

fn delta_eds_names(stream: &DeltaStream) -> impl Iterator<Item = &str> {
    let watch = stream.watches.get(&ResourceType::Endpoint);
    watch
        .into_iter()
        .flat_map(|w| w.subscribed.iter().map(String::as_str))
}
