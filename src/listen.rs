//! Listening sockets: a large backlog, and an accept loop that backs off while accepting fails.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use thiserror::Error;
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tracing::{info, warn};

#[derive(Debug, Error)]
#[error("cannot listen on {addr} ({what}): {source}")]
pub struct BindError {
    what: &'static str,
    addr: SocketAddr,
    source: io::Error,
}

/// Pending connections the kernel queues per listener: a mesh's proxies reconnect all at once after
/// a control-plane restart, far more than the default 128.
const LISTEN_BACKLOG: u32 = 4096;

/// Binds `addr` (port 0 picks one) and logs the bound address as `listening server=<what> addr=`.
pub async fn bind(what: &'static str, addr: SocketAddr) -> Result<Acceptor, BindError> {
    let error = |source| BindError { what, addr, source };
    let socket = match addr {
        SocketAddr::V4(_) => TcpSocket::new_v4(),
        SocketAddr::V6(_) => TcpSocket::new_v6(),
    }
    .map_err(error)?;
    socket.set_reuseaddr(true).map_err(error)?;
    socket.bind(addr).map_err(error)?;
    let listener = socket.listen(LISTEN_BACKLOG).map_err(error)?;
    let bound = listener.local_addr().map_err(error)?;
    info!(server = what, addr = %bound, "listening");
    Ok(Acceptor::new(listener))
}

const BACKOFF_MIN: Duration = Duration::from_millis(5);
const BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Accepts connections; while accepting fails (out of file descriptors, for one) it waits, doubling
/// the wait up to a second, instead of retrying at once and spinning a core the open connections
/// need.
pub struct Acceptor {
    listener: TcpListener,
    backoff: Duration,
    failures: Arc<AtomicU64>,
}

impl Acceptor {
    pub fn new(listener: TcpListener) -> Self {
        Self {
            listener,
            backoff: BACKOFF_MIN,
            failures: Arc::default(),
        }
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// How many accepts have failed so far.
    pub fn failures(&self) -> Arc<AtomicU64> {
        self.failures.clone()
    }

    /// The next connection, with Nagle off (xDS messages are small and latency-bound).
    pub async fn accept(&mut self) -> (TcpStream, SocketAddr) {
        loop {
            match self.listener.accept().await {
                Ok((stream, remote)) => {
                    self.backoff = BACKOFF_MIN;
                    if let Err(e) = stream.set_nodelay(true) {
                        warn!(%remote, error = %e, "cannot disable Nagle's algorithm");
                    }
                    return (stream, remote);
                }
                Err(e) => {
                    self.failures.fetch_add(1, Ordering::Relaxed);
                    warn!(error = %e, retry_in = ?self.backoff, "accept failed");
                    tokio::time::sleep(self.backoff).await;
                    self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
                }
            }
        }
    }

    /// The connections as a stream, for servers that take one (tonic's `serve_with_incoming`).
    pub fn into_stream(self) -> impl Stream<Item = io::Result<TcpStream>> {
        futures::stream::unfold(self, |mut acceptor| async move {
            let (stream, _) = acceptor.accept().await;
            Some((Ok(stream), acceptor))
        })
    }
}

impl axum::serve::Listener for Acceptor {
    type Io = TcpStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (TcpStream, SocketAddr) {
        Acceptor::accept(self).await
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        Acceptor::local_addr(self)
    }
}
