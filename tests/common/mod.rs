//! Helpers shared by the end-to-end tests: temp config trees, a minimal HTTP client, bounded waits,
//! and the meshpilot binary as a child process.
#![allow(dead_code)] // each test binary uses its own subset

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

pub const EXAMPLE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/multicluster/examples/two-clusters"
);

/// Polls `check` until it yields a value, failing the test after `bound`.
pub async fn wait_for<T, F, Fut>(what: &str, bound: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + bound;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {bound:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A one-shot HTTP/1.1 GET; returns status and body.
pub async fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut stream = TcpStream::connect(addr).await?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await?;
    let text = String::from_utf8_lossy(&raw).to_string();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)
    } else {
        body.to_string()
    };
    Ok((status, body))
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].trim_start_matches("\r\n");
    }
    out
}

pub async fn get_json(addr: SocketAddr, path: &str) -> Value {
    let (status, body) = http_get(addr, path).await.expect("admin server reachable");
    assert_eq!(status, 200, "GET {path}: {body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("GET {path} is not JSON ({e}): {body}"))
}

/// Endpoint addresses served for `host` from `cluster`, per /debug/endpointShardz.
pub async fn shard_addresses(admin: SocketAddr, host: &str, cluster: &str) -> Vec<String> {
    let shards = get_json(admin, "/debug/endpointShardz").await;
    let mut out: Vec<String> = shards[host]
        .as_object()
        .into_iter()
        .flat_map(|by_ns| by_ns.values())
        .filter_map(|by_cluster| by_cluster[cluster].as_array())
        .flatten()
        .filter_map(|ep| ep["address"].as_str().map(str::to_string))
        .collect();
    out.sort();
    out
}

/// The /debug/clusterz entry of one cluster.
pub async fn cluster_view(admin: SocketAddr, id: &str) -> Option<Value> {
    let clusters = get_json(admin, "/debug/clusterz").await;
    clusters.as_array()?.iter().find(|c| c["id"] == id).cloned()
}

/// Copies a directory tree (the bundled example, usually) into a fresh temp dir.
pub fn copy_tree(from: &Path) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    copy_dir(from, dir.path());
    dir
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("create dir");
    for entry in std::fs::read_dir(from).expect("read dir").flatten() {
        let target = to.join(entry.file_name());
        if entry.path().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).expect("copy file");
        }
    }
}

/// Writes a file atomically (write + rename), as editors and config tooling do.
pub fn write_atomic(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp~");
    std::fs::write(&tmp, text).expect("write temp file");
    std::fs::rename(&tmp, path).expect("rename into place");
}

/// The meshpilot binary running as a child process, with its log captured. Killed on drop.
pub struct MeshpilotProcess {
    child: Child,
    log: Arc<Mutex<String>>,
}

impl MeshpilotProcess {
    pub fn spawn(args: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_meshpilot"))
            .args(args)
            .env("MESHPILOT_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn meshpilot");
        let log = Arc::new(Mutex::new(String::new()));
        let sink = log.clone();
        let stderr = child.stderr.take().expect("stderr piped");
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let mut log = sink.lock().unwrap();
                log.push_str(&line);
                log.push('\n');
            }
        });
        Self { child, log }
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// The address a server logged as bound (`listening server="<name>" addr=...`).
    pub async fn bound_addr(&self, server: &str) -> SocketAddr {
        let needle = format!("server=\"{server}\" addr=");
        wait_for(
            &format!("{server} listening"),
            Duration::from_secs(20),
            || {
                let log = self.log();
                let needle = needle.clone();
                async move {
                    let line = log.lines().find(|l| l.contains(&needle))?;
                    let addr = line.split(&needle).nth(1)?.split_whitespace().next()?;
                    addr.parse().ok()
                }
            },
        )
        .await
    }
}

impl Drop for MeshpilotProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Root of the test peers installed by scripts/test (Envoy, grpcio).
pub fn peers_dir() -> PathBuf {
    std::env::var_os("MESHPILOT_TEST_PEERS")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join(".test-peers"))
}
