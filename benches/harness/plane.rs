//! meshpilot as a child process, its clusters held by test API servers (the config cluster and
//! remotes onboarded by Secret) or by a config directory; its CPU and memory read from /proc.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use test_apiserver::{TestApiServer, User};

use crate::common::{self, wait_for, MeshpilotProcess};

/// The namespace every harness object lives in.
pub const NS: &str = "load";

/// The `istio/multiCluster` Secret onboarding `api` as remote `id`, with a reader token `token`.
pub fn remote_secret_with_token(api: &TestApiServer, id: &str, token: &str) -> serde_json::Value {
    api.add_token(
        token,
        User::service_account("istio-system", "istio-reader-service-account"),
    );
    json!({"apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": format!("istio-remote-secret-{id}"), "namespace": "istio-system", "labels": {"istio/multiCluster": "true"}},
        "stringData": {id: api.kubeconfig(token)}})
}

pub fn remote_secret(api: &TestApiServer, id: &str) -> serde_json::Value {
    remote_secret_with_token(api, id, &format!("{id}-reader"))
}

/// /proc figures of a process: CPU seconds (user + system) and resident memory in bytes.
pub fn proc_stats(pid: u32) -> (f64, u64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    let ticks: f64 = fields.get(11).and_then(|v| v.parse().ok()).unwrap_or(0.0)
        + fields.get(12).and_then(|v| v.parse().ok()).unwrap_or(0.0);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let rss_kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    (ticks / 100.0, rss_kb * 1024)
}

/// The process's peak resident memory (VmHWM) since it started or [`reset_peak_rss`], in bytes.
pub fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    kb * 1024
}

/// Starts [`peak_rss`] afresh from the current resident memory (clear_refs 5).
pub fn reset_peak_rss(pid: u32) {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").expect("reset the peak RSS");
}

/// Resident memory once it stops falling: the allocator returns the pages freed after a burst (an
/// initial list decoded, tables grown) over its decay time (jemalloc: 10 s, starting slowly), so a
/// figure read at once would count garbage. Settled when no sample within `quiet` fell; at most 60 s.
/// A measuring run passes [`DECAY_QUIET`].
pub async fn settled_rss(pid: u32, quiet: Duration) -> u64 {
    const BOUND: Duration = Duration::from_secs(60);
    let started = Instant::now();
    let (mut lowest, mut since) = (proc_stats(pid).1, Instant::now());
    while since.elapsed() < quiet && started.elapsed() < BOUND {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let rss = proc_stats(pid).1;
        // A fall under 0.5 % is noise, not pages being returned.
        if rss < lowest - lowest / 200 {
            since = Instant::now();
        }
        lowest = lowest.min(rss);
    }
    lowest
}

/// Longer than jemalloc's decay time: pages freed before the window are returned within it.
pub const DECAY_QUIET: Duration = Duration::from_secs(11);

/// A running meshpilot with its config cluster (and remotes) served by test API servers, or its
/// clusters in a config directory (`files/config`).
pub struct Plane {
    /// Shared with the tasks that change them while meshpilot runs.
    pub servers: Vec<Arc<TestApiServer>>,
    pub process: MeshpilotProcess,
    pub xds: SocketAddr,
    pub secure: SocketAddr,
    pub admin: SocketAddr,
    pub files: tempfile::TempDir,
    /// The flags after the listen addresses, kept for a restart.
    flags: Vec<String>,
}

impl Plane {
    /// meshpilot on the config cluster `servers[0]`, whose remotes are onboarded by Secrets there;
    /// `flags` are extra discovery flags. Returns once ready.
    pub async fn kube(servers: Vec<TestApiServer>, flags: &[&str]) -> Plane {
        let files = tempfile::tempdir().unwrap();
        let kubeconfig = files.path().join("kubeconfig");
        std::fs::write(&kubeconfig, servers[0].kubeconfig(servers[0].admin_token())).unwrap();
        let mut all = vec![
            "--kubeconfig".to_string(),
            kubeconfig.to_str().unwrap().to_string(),
            "--cluster-id".to_string(),
            "c0".to_string(),
        ];
        all.extend(flags.iter().map(|f| f.to_string()));
        Self::spawn(servers.into_iter().map(Arc::new).collect(), files, all).await
    }

    /// meshpilot on the config directory `files/config`. Returns once ready.
    pub async fn files(files: tempfile::TempDir, flags: &[&str]) -> Plane {
        let config = files.path().join("config");
        let mut all = vec![
            "--config-dir".to_string(),
            config.to_str().unwrap().to_string(),
        ];
        all.extend(flags.iter().map(|f| f.to_string()));
        Self::spawn(Vec::new(), files, all).await
    }

    async fn spawn(
        servers: Vec<Arc<TestApiServer>>,
        files: tempfile::TempDir,
        mut flags: Vec<String>,
    ) -> Plane {
        // The CA's root and remote snapshots outlive a restart within the run, not the run.
        let state = files.path().join("state");
        flags.extend([
            "--state-dir".to_string(),
            state.to_str().unwrap().to_string(),
        ]);
        let any = "127.0.0.1:0".parse().unwrap();
        let process = start(&flags, [any; 3]);
        let admin = process.bound_addr("admin").await;
        let xds = process.bound_addr("xds").await;
        let secure = process.bound_addr("secure-xds").await;
        let plane = Plane {
            servers,
            process,
            xds,
            secure,
            admin,
            files,
            flags,
        };
        plane.ready(Duration::from_secs(300)).await;
        plane
    }

    /// Kills meshpilot with SIGKILL (no shutdown of any kind) and starts it again with the same
    /// flags on the same ports. Returns the time of the new start, without waiting for readiness.
    pub fn kill_and_restart(&mut self) -> Instant {
        self.process.kill_9();
        let started = Instant::now();
        self.process = start(&self.flags, [self.admin, self.xds, self.secure]);
        started
    }

    /// A second replica: meshpilot with the same flags on the same API servers, on ports and a
    /// state directory of its own. Returns once ready.
    pub async fn replica(&self) -> Plane {
        let files = tempfile::tempdir().unwrap();
        let mut flags = self.flags.clone();
        // `spawn` appends its own state directory.
        if let Some(at) = flags.iter().position(|f| f == "--state-dir") {
            flags.drain(at..at + 2);
        }
        Self::spawn(self.servers.clone(), files, flags).await
    }

    /// Waits until meshpilot reports ready.
    pub async fn ready(&self, bound: Duration) {
        let admin = self.admin;
        wait_for("meshpilot ready", bound, || async move {
            let (status, _) = common::http_get(admin, "/ready").await.ok()?;
            (status == 200).then_some(())
        })
        .await;
    }
}

/// meshpilot discovery on these addresses (admin, xds, secure-xds).
fn start(flags: &[String], [admin, xds, secure]: [SocketAddr; 3]) -> MeshpilotProcess {
    let addrs = [admin, xds, secure].map(|a| a.to_string());
    let mut args = vec![
        "--log",
        "warn,meshpilot::app=info,meshpilot::listen=info",
        "discovery",
        "--http-addr",
        &addrs[0],
        "--xds-addr",
        &addrs[1],
        "--secure-xds-addr",
        &addrs[2],
    ];
    args.extend(flags.iter().map(String::as_str));
    MeshpilotProcess::spawn(&args)
}

/// A service `name` of file cluster `c0` as a manifest: the Service (cluster IP `10.96.0.0/16`
/// numbered `i`) and its one endpoint at `address`.
pub fn service_file(name: &str, i: usize, address: &str) -> String {
    format!(
        "apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: {NS}}}
spec: {{clusterIP: 10.96.{}.{}, ports: [{{name: http, port: 80}}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: {name}-c0, namespace: {NS}, labels: {{kubernetes.io/service-name: {name}}}}}
addressType: IPv4
ports: [{{name: http, port: 80}}]
endpoints: [{{addresses: [\"{address}\"], conditions: {{ready: true}}}}]
",
        i / 250,
        i % 250 + 1
    )
}

/// meshpilot serving one file cluster `c0` of `services` files (`svc-<i>`, endpoint `ip(i)`).
pub async fn file_plane(services: usize, ip: impl Fn(usize) -> String, flags: &[&str]) -> Plane {
    let files = tempfile::tempdir().unwrap();
    let cluster = files.path().join("config/clusters/c0");
    std::fs::create_dir_all(&cluster).unwrap();
    for i in 0..services {
        let text = service_file(&format!("svc-{i}"), i, &ip(i));
        std::fs::write(cluster.join(format!("svc-{i}.yaml")), text).unwrap();
    }
    Plane::files(files, flags).await
}

/// A counter of meshpilot's /metrics (without labels), 0 while it has none.
pub async fn counter(admin: SocketAddr, name: &str) -> u64 {
    let (_, metrics) = common::http_get(admin, "/metrics")
        .await
        .expect("admin server reachable");
    let prefix = format!("{name} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&prefix)?.trim().parse().ok())
        .unwrap_or(0)
}
