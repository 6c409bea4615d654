//! One ADS stream's task: identify the proxy, then alternate between its requests and the pushes
//! offered to its slot, sending through a bounded queue.
//!
//! What is bounded: each stream's output queue holds [`OUTPUT_QUEUE`] encoded response; a send waits
//! for room (under the push permit, so at most `push_concurrency` streams build or wait at once) and
//! gives up after the send timeout, closing the stream. Pushes arriving meanwhile merge into the
//! stream's single pending slot, so a proxy that stops reading costs one response in the queue, one
//! being written, the transport's window and one merged pending push — never a backlog.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use tokio::sync::mpsc;
use tonic::{Status, Streaming};
use tracing::{debug, error, warn};

use super::generate::Generation;
use super::protocol::ResourceType;
use super::proxy::Proxy;
use super::push::PushRequest;
use super::server::{Connection, NodeOf, ProxyRegistrar, Registered, XdsServer};
use super::session::{Answer, Reply, Session};
use super::wire::Encoded;
use crate::istio::ConfigKey;
use crate::model::ClusterId;
use crate::security::authn::{Authenticator, Credentials};

/// Encoded responses a stream may have queued for transmission.
pub const OUTPUT_QUEUE: usize = 1;

pub type ResponseTx = mpsc::Sender<Result<Encoded, Status>>;

/// Creates a session for a connected proxy.
pub type NewSession<Req> = fn(Arc<XdsServer>, Arc<Connection>) -> Box<dyn Session<Req>>;

/// Runs a stream's task to its end; a panic inside is logged, counted and reported to the client,
/// and the connection is unregistered as the task unwinds.
///
/// A combinator, not an `async fn`: an `async fn` keeps its future argument's storage beside the
/// future it moves it into (rust-lang/rust#62958), doubling every stream task's allocation.
pub fn run_guarded<F>(
    server: Arc<XdsServer>,
    tx: ResponseTx,
    stream: F,
) -> impl std::future::Future<Output = ()>
where
    F: std::future::Future<Output = ()>,
{
    AssertUnwindSafe(stream).catch_unwind().map(move |outcome| {
        let Err(panic) = outcome else { return };
        let message = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        error!(panic = %message, "xDS stream task panicked; closing the stream");
        server.metrics().stream_panicked();
        let _ = tx.try_send(Err(Status::internal(
            "meshpilot: internal error on this stream; reconnect",
        )));
    })
}

/// Who is on the other end of a stream, as the transport tells.
pub struct Peer {
    pub delta: bool,
    pub address: Option<std::net::SocketAddr>,
    /// On the secure port: how to check the caller's proof of identity.
    pub auth: Option<(Arc<Authenticator>, Credentials)>,
}

/// Waits for the first request, identifies and authorizes the proxy, and runs its session until the
/// stream ends.
pub async fn serve<Req: NodeOf>(
    server: Arc<XdsServer>,
    requests: Streaming<Req>,
    tx: ResponseTx,
    peer: Peer,
    new_session: NewSession<Req>,
) {
    // Boxed: the admission's futures (the wait for the first request, a TokenReview) end before
    // the session starts; inline, they would size the stream's task for its whole life.
    let Some(admitted) = Box::pin(admit(&server, requests, &tx, peer)).await else {
        return;
    };
    let Admitted {
        first,
        requests,
        registered,
        registration: _registration,
    } = admitted;
    let session = new_session(server.clone(), registered.conn().clone());
    Stream {
        server,
        registered,
        session,
        tx,
    }
    .run(first, requests)
    .await;
}

/// A stream whose proxy is identified, authorized and connected.
struct Admitted<Req> {
    first: Req,
    requests: Streaming<Req>,
    registered: Registered,
    /// Held for the stream's life.
    registration: Option<Registration>,
}

/// Admits a stream: readiness, the first request, the proxy's identity and its proof; None (the
/// client told why) if refused or gone.
async fn admit<Req: NodeOf>(
    server: &Arc<XdsServer>,
    mut requests: Streaming<Req>,
    tx: &ResponseTx,
    peer: Peer,
) -> Option<Admitted<Req>> {
    let Peer {
        delta,
        address,
        auth,
    } = peer;
    if !server.ready() {
        // As istiod: a proxy must not get a partial view while clusters are still syncing.
        let _ = tx
            .send(Err(Status::unavailable(
                "meshpilot is not ready: clusters are still syncing",
            )))
            .await;
        return None;
    }
    let wait = server.options().first_request_timeout;
    let first = match tokio::time::timeout(wait, requests.message()).await {
        Ok(Ok(Some(first))) => first,
        Ok(_) => return None,
        Err(_) => {
            debug!("no first request within {wait:?}; closing the stream");
            let _ = tx
                .send(Err(Status::deadline_exceeded(format!(
                    "no request within {wait:?} of opening the stream"
                ))))
                .await;
            return None;
        }
    };
    let mut proxy = match Proxy::from_node(first.node()) {
        Ok(proxy) => proxy,
        Err(e) => {
            warn!(error = %e, "refusing xDS stream");
            let _ = tx.send(Err(Status::invalid_argument(e.to_string()))).await;
            return None;
        }
    };
    let authenticated = auth.is_some();
    if let Some((authn, credentials)) = auth {
        match super::server::authorize(&authn, &credentials, &proxy).await {
            Ok(identity) => proxy.verified_account = Some(identity.service_account),
            Err(status) => {
                warn!(proxy = %proxy.id, %status, "refusing xDS stream");
                let _ = tx.send(Err(status)).await;
                return None;
            }
        }
        // ztunnel names its cluster in the `clusterid` header, not in its node.
        if proxy.cluster_id.is_none() {
            proxy.cluster_id = credentials.cluster_id.as_deref().map(ClusterId::new);
        }
    }
    // A WorkloadGroup member is registered before its first response, so that response has it;
    // only over the secure port, where the proxy proved who it is.
    let registration = match (server.auto_registration(), &proxy.auto_register_group) {
        (Some(registry), Some(_)) if authenticated => registry
            .connected(&proxy)
            .map(|key| Registration { registry, key }),
        (_, Some(group)) => {
            warn!(proxy = %proxy.id, group, "auto-registration needs the secure xDS port; not registered");
            None
        }
        _ => None,
    };
    let registered = server.connect(proxy, delta, address);
    Some(Admitted {
        first,
        requests,
        registered,
        registration,
    })
}

/// An auto-registered WorkloadEntry, released when the stream ends.
struct Registration {
    registry: Arc<dyn ProxyRegistrar>,
    key: ConfigKey,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.registry.clone().disconnected(self.key.clone());
    }
}

/// What wakes a stream.
enum Work<Req> {
    Request(Req),
    Push(PushRequest),
}

struct Stream<Req> {
    server: Arc<XdsServer>,
    registered: Registered,
    session: Box<dyn Session<Req>>,
    tx: ResponseTx,
}

impl<Req: NodeOf> Stream<Req> {
    async fn run(mut self, first: Req, mut requests: Streaming<Req>) {
        let conn = self.registered.conn().clone();
        let max_age = self.server.options().max_connection_age;
        let deadline =
            (!max_age.is_zero()).then(|| tokio::time::Instant::now() + jittered(max_age));
        // One timer for the stream's life: made anew in every turn of the loop, it was registered
        // and removed again for each request and push.
        let aged = sleep_until_some(deadline);
        tokio::pin!(aged);
        let mut next = Some(Work::Request(first));
        loop {
            let work = match next.take() {
                Some(work) => work,
                None => tokio::select! {
                    _ = &mut aged => {
                        debug!(proxy = %conn.proxy.id, ?max_age, "maximum connection age reached; ending the stream");
                        return;
                    }
                    message = requests.message() => match message {
                        Ok(Some(request)) => Work::Request(request),
                        Ok(None) => return,
                        Err(status) => {
                            debug!(proxy = %conn.proxy.id, %status, "stream ended");
                            return;
                        }
                    },
                    _ = conn.slot.ready() => match conn.slot.take() {
                        Some(push) => Work::Push(push),
                        None => continue,
                    },
                    _ = conn.closing.notified() => {
                        debug!(proxy = %conn.proxy.id, "shutting down; ending the stream");
                        let _ = self.tx.try_send(Err(Status::unavailable(
                            "meshpilot is shutting down; reconnect",
                        )));
                        return;
                    }
                },
            };
            let open = match work {
                Work::Request(request) => self.answer(request).await,
                Work::Push(push) => self.push(push).await,
            };
            if !open {
                return;
            }
        }
    }

    /// Handles one request; false once the stream is gone.
    async fn answer(&mut self, request: Req) -> bool {
        match self.session.on_request(request) {
            Answer::Nothing => true,
            Answer::Empty(bytes) => self.send(vec![bytes.into()]).await,
            Answer::Refuse(status) => {
                let _ = self.tx.send(Err(status)).await;
                false
            }
            Answer::Debug(request) => {
                let conn = self.registered.conn().clone();
                match super::debug::respond(&self.server, &conn, request) {
                    Ok(bytes) => self.send(vec![bytes.into()]).await,
                    Err(status) => {
                        let _ = self.tx.send(Err(status)).await;
                        false
                    }
                }
            }
            Answer::Resources(ty, scope) => {
                if ty == ResourceType::Secret {
                    self.review_secrets().await;
                }
                let server = self.server.clone();
                // The permit bounds building, not waiting for the proxy to read: a proxy that
                // stops reading must not hold up anyone else's push.
                let out = {
                    let Ok(_permit) = server.push_permit().await else {
                        return false;
                    };
                    self.build(|session, reply, out| session.respond(reply, ty, &scope, true, out))
                };
                self.send(out).await
            }
        }
    }

    /// Sends what a push means for this proxy; false once the stream is gone.
    async fn push(&mut self, push: PushRequest) -> bool {
        let server = self.server.clone();
        if let Some(queued) = push.queued_at {
            server.metrics().dequeued(queued.elapsed());
        }
        if self.session.watched().contains(&ResourceType::Secret) {
            self.review_secrets().await;
        }
        let out = {
            let Ok(_permit) = server.push_permit().await else {
                return false;
            };
            self.build(|session, reply, out| session.push(reply, &push, out))
        };
        let sent = !out.is_empty();
        let open = self.send(out).await;
        if let (true, true, Some(triggered)) = (open, sent, push.triggered_at) {
            server.metrics().converged(triggered.elapsed());
        }
        open
    }

    /// Asks the API servers what the proxy's Secret subscriptions need reviewed (whether its
    /// service account may read them), so that building finds the answers; reviews answered
    /// recently are not asked again.
    async fn review_secrets(&self) {
        let conn = self.registered.conn();
        if !conn.proxy.verified() {
            return;
        }
        let names = conn.subscribed(ResourceType::Secret);
        if names.is_empty() {
            return;
        }
        let access = self.server.secret_access();
        let pending = {
            let snapshot = self.server.mesh().snapshot();
            Generation::new(&snapshot, self.server.cache(), &conn.proxy)
                .with_secret_access(access)
                .pending_secret_reviews(names.iter())
        };
        futures::future::join_all(pending.into_iter().map(|r| access.review(r))).await;
    }

    /// Assembles responses from one snapshot of the mesh.
    fn build(
        &mut self,
        assemble: impl FnOnce(&mut dyn Session<Req>, &Reply<'_>, &mut Vec<Encoded>),
    ) -> Vec<Encoded> {
        let snapshot = self.server.mesh().snapshot();
        let conn = self.registered.conn();
        let generation = Generation::new(&snapshot, self.server.cache(), &conn.proxy)
            .with_secret_access(self.server.secret_access());
        let reply = Reply {
            generation: &generation,
            version: &snapshot.version_text,
        };
        let mut out = Vec::new();
        assemble(self.session.as_mut(), &reply, &mut out);
        out
    }

    /// Queues responses in order, waiting for room; a proxy that does not read for the send timeout
    /// loses its stream (it reconnects and gets everything afresh).
    async fn send(&self, out: Vec<Encoded>) -> bool {
        let timeout: Duration = self.server.options().send_timeout;
        let started = tokio::time::Instant::now();
        for response in out {
            // Usually there is room at once: the timer is armed only for a wait.
            let response = match self.tx.try_send(Ok(response)) {
                Ok(()) => continue,
                Err(mpsc::error::TrySendError::Closed(_)) => return false,
                Err(mpsc::error::TrySendError::Full(response)) => response,
            };
            match tokio::time::timeout(timeout, self.tx.send(response)).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return false,
                Err(_) => {
                    let proxy = &self.registered.conn().proxy.id;
                    warn!(proxy = %proxy, "proxy has not read a response for {timeout:?}; closing its stream");
                    self.server.metrics().send_timed_out();
                    return false;
                }
            }
        }
        self.server.metrics().sent(started.elapsed());
        true
    }
}

/// The age spread over ±10 % (as gRPC's MaxConnectionAge), so streams opened together do not all
/// end together.
fn jittered(age: Duration) -> Duration {
    age.mul_f64(0.9 + fastrand::f64() * 0.2)
}

/// Sleeps until the deadline; forever without one.
async fn sleep_until_some(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::XdsMetrics;
    use crate::model::Mesh;
    use crate::security::secret_access::SecretAccess;
    use crate::xds::server::XdsOptions;
    use envoy_types::pb::envoy::config::core::v3::Node;

    #[tokio::test]
    async fn a_panicking_stream_is_reported_counted_and_unregistered() {
        let metrics = XdsMetrics::default();
        let server = XdsServer::new(
            Arc::new(Mesh::default()),
            Arc::new(|| true),
            XdsOptions::default(),
            metrics.clone(),
            SecretAccess::new(Default::default()),
        );
        let (tx, mut rx) = mpsc::channel(OUTPUT_QUEUE);
        let inner = server.clone();
        run_guarded(server.clone(), tx, async move {
            let node = Node {
                id: "sidecar~10.0.0.1~pod.ns~ns.svc.cluster.local".into(),
                ..Default::default()
            };
            let _registered =
                inner.connect(Proxy::from_node(Some(&node)).expect("node"), false, None);
            assert_eq!(inner.connection_count(), 1);
            panic!("a bug in a session");
        })
        .await;
        assert_eq!(server.connection_count(), 0, "unregistered on unwind");
        assert_eq!(metrics.stream_panics(), 1);
        let status = rx
            .recv()
            .await
            .expect("the client hears of it")
            .expect_err("an error status");
        assert_eq!(status.code(), tonic::Code::Internal);
    }

    #[test]
    fn the_guard_adds_little_to_the_stream_task_it_wraps() {
        let server = XdsServer::new(
            Arc::new(Mesh::default()),
            Arc::new(|| true),
            XdsOptions::default(),
            XdsMetrics::default(),
            SecretAccess::new(Default::default()),
        );
        let (tx, _rx) = mpsc::channel(OUTPUT_QUEUE);
        let large = [0u8; 4096];
        let stream = async move {
            tokio::task::yield_now().await;
            std::hint::black_box(&large);
        };
        let inner = std::mem::size_of_val(&stream);
        let guarded = std::mem::size_of_val(&run_guarded(server, tx, stream));
        assert!(guarded < inner + 128, "{guarded} bytes around {inner}");
    }
}
