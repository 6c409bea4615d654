//! Network namespaces and veth links as separate test hosts (needs root, iproute2 and iptables).
//!
//! The helpers here block on subprocesses (curl, clients in a namespace). Tests calling them while
//! meshpilot runs in-process use a multi-thread runtime: on a current-thread one a blocking call
//! stalls the control plane too, and a proxy's TLS handshake to it can outlast its connect timeout.

use std::path::Path;
use std::process::{Child, Command, Stdio};

/// Runs a command to completion, failing the test with its output if it fails.
pub fn run(program: &str, args: &[&str]) {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A network namespace, deleted (with its links and processes' sockets) on drop.
pub struct Netns {
    pub name: String,
    children: Vec<Child>,
}

impl Netns {
    pub fn create(name: &str) -> Netns {
        let _ = Command::new("ip")
            .args(["netns", "del", name])
            .stderr(Stdio::null())
            .status();
        run("ip", &["netns", "add", name]);
        let ns = Netns {
            name: name.to_string(),
            children: Vec::new(),
        };
        ns.run("ip", &["link", "set", "lo", "up"]);
        ns
    }

    /// Runs a command inside the namespace to completion.
    pub fn run(&self, program: &str, args: &[&str]) {
        let mut full = vec!["netns", "exec", &self.name, program];
        full.extend_from_slice(args);
        run("ip", &full);
    }

    /// A command inside the namespace.
    pub fn command(&self, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name, program]);
        c
    }

    /// Starts a long-running process inside the namespace, killed on drop.
    pub fn spawn(&mut self, program: &str, args: &[&str]) {
        let child = self
            .command(program)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{program}: {e}"));
        self.children.push(child);
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

/// A veth link: `a_if` with `a_cidr` in `a` (None = the host) and `b_if` with `b_cidr` in `b`.
/// Both ends are created under unique names in the host and renamed once inside their namespace.
pub fn link(a: Option<&Netns>, a_if: &str, a_cidr: &str, b: &Netns, b_if: &str, b_cidr: &str) {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = |side: char| format!("mpv{}{side}{n}", std::process::id() % 10_000);
    let (tmp_a, tmp_b) = (a.map_or(a_if.to_string(), |_| tmp('a')), tmp('b'));
    run(
        "ip",
        &[
            "link", "add", &tmp_a, "type", "veth", "peer", "name", &tmp_b,
        ],
    );
    let place = |ns: Option<&Netns>, tmp: &str, name: &str, cidr: &str| match ns {
        Some(ns) => {
            run("ip", &["link", "set", tmp, "netns", &ns.name]);
            ns.run("ip", &["link", "set", tmp, "name", name]);
            ns.run("ip", &["addr", "add", cidr, "dev", name]);
            ns.run("ip", &["link", "set", name, "up"]);
        }
        None => {
            run("ip", &["addr", "add", cidr, "dev", name]);
            run("ip", &["link", "set", name, "up"]);
        }
    };
    place(Some(b), &tmp_b, b_if, b_cidr);
    place(a, &tmp_a, a_if, a_cidr);
}

impl Netns {
    /// Istio-style outbound capture: TCP the application (running as `uid`) opens goes to the
    /// sidecar's 15001. Envoy runs as another user, so its own traffic is not captured.
    pub fn capture_outbound(&self, uid: &str) {
        let rule = [
            "-t",
            "nat",
            "-A",
            "OUTPUT",
            "-p",
            "tcp",
            "-m",
            "owner",
            "--uid-owner",
            uid,
        ];
        self.run(
            "iptables",
            &[&rule[..], &["-j", "REDIRECT", "--to-ports", "15001"]].concat(),
        );
    }

    /// Istio-style inbound capture: TCP arriving on `interface` goes to the sidecar's 15006.
    pub fn capture_inbound(&self, interface: &str) {
        let rule = [
            "-t",
            "nat",
            "-A",
            "PREROUTING",
            "-i",
            interface,
            "-p",
            "tcp",
        ];
        self.run(
            "iptables",
            &[&rule[..], &["-j", "REDIRECT", "--to-ports", "15006"]].concat(),
        );
    }

    /// The HTTP echo peer on `port`, for as long as the namespace lives.
    pub fn serve_http_echo(&mut self, port: u16) {
        self.serve_http_echo_at(&port.to_string());
    }

    /// The HTTP echo peer listening on `address` (`ip:port`) only.
    pub fn serve_http_echo_at(&mut self, address: &str) {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/peers/http_echo.py");
        self.spawn("python3", &[script, address]);
    }

    /// A Zipkin collector on `port` (`GET /spans` lists what it received).
    pub fn serve_zipkin(&mut self, port: u16) {
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/peers/zipkin_collector.py"
        );
        self.spawn("python3", &[script, &port.to_string()]);
    }

    /// An OpenTelemetry trace collector (OTLP over gRPC) on `port`, writing what it receives to
    /// `spans` as JSON lines.
    pub fn serve_otel(&mut self, port: u16, spans: &Path) {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/peers/otel_collector.py");
        let python = super::peer_python();
        let spans = spans.to_str().expect("utf-8 path");
        self.spawn(
            python.to_str().expect("utf-8 path"),
            &[script, &port.to_string(), spans],
        );
    }

    /// The echo over HTTPS with these PEM files, requiring a client certificate `client_ca` signed.
    pub fn serve_https_echo(&mut self, port: u16, cert: &Path, key: &Path, client_ca: &Path) {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/peers/http_echo.py");
        let path = |p: &Path| p.to_str().expect("utf-8 path").to_string();
        let port = port.to_string();
        self.spawn(
            "python3",
            &[script, &port, &path(cert), &path(key), &path(client_ca)],
        );
    }
}

impl Netns {
    /// A bridge `name` in this namespace: a switch the workloads' data links plug into.
    pub fn bridge(&self, name: &str) {
        self.run("ip", &["link", "add", name, "type", "bridge"]);
        self.run("ip", &["link", "set", name, "up"]);
    }

    /// An HTTP request from inside the namespace (as user `uid`, so an outbound capture takes it,
    /// when given): the status, or 0 when no response came (refused, reset, closed).
    pub fn curl(&self, uid: Option<&str>, args: &[&str]) -> u16 {
        let mut command = self.command("setpriv");
        if let Some(uid) = uid {
            command.args(["--reuid", uid, "--regid", uid]);
        }
        let output = command
            .args(["--clear-groups", "curl", "-s", "-o", "/dev/null"])
            .args(["-w", "%{http_code}", "-m", "3"])
            .args(args)
            .output()
            .expect("curl runs");
        // A hang is not a refusal: a request that times out fails the test.
        assert_ne!(
            output.status.code(),
            Some(28),
            "curl {args:?} timed out in {}",
            self.name
        );
        String::from_utf8_lossy(&output.stdout)
            .trim()
            .parse()
            .unwrap_or(0)
    }
}

/// Plugs `ns` into the bridge `bridge` of `lan` with an interface `ifname` holding `cidr`.
pub fn plug(lan: &Netns, bridge: &str, ns: &Netns, ifname: &str, cidr: &str) {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let (port, peer) = (
        format!("mpb{}p{n}", std::process::id() % 10_000),
        format!("mpb{}w{n}", std::process::id() % 10_000),
    );
    run(
        "ip",
        &["link", "add", &port, "type", "veth", "peer", "name", &peer],
    );
    run("ip", &["link", "set", &port, "netns", &lan.name]);
    lan.run("ip", &["link", "set", &port, "master", bridge]);
    lan.run("ip", &["link", "set", &port, "up"]);
    run("ip", &["link", "set", &peer, "netns", &ns.name]);
    ns.run("ip", &["link", "set", &peer, "name", ifname]);
    ns.run("ip", &["addr", "add", cidr, "dev", ifname]);
    ns.run("ip", &["link", "set", ifname, "up"]);
}

/// `/etc/netns/<name>/resolv.conf`, which `ip netns exec` shows the namespace's programs as
/// /etc/resolv.conf (a pod's: the cluster DNS address, its namespace's search path); removed on
/// drop.
pub struct ResolvConf(std::path::PathBuf);

impl ResolvConf {
    pub fn write(netns: &str, nameserver: &str, namespace: &str) -> Self {
        let dir = std::path::PathBuf::from("/etc/netns").join(netns);
        std::fs::create_dir_all(&dir).expect("/etc/netns/<name>");
        std::fs::write(
            dir.join("resolv.conf"),
            format!(
                "nameserver {nameserver}\nsearch {namespace}.svc.cluster.local svc.cluster.local cluster.local\noptions ndots:5\n"
            ),
        )
        .expect("resolv.conf");
        Self(dir)
    }
}

impl Drop for ResolvConf {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Netns {
    /// Istio's DNS capture: the application's (`uid`'s) queries to port 53 go to the agent's 15053.
    pub fn capture_dns(&self, uid: &str) {
        self.run(
            "iptables",
            &[
                "-t",
                "nat",
                "-A",
                "OUTPUT",
                "-p",
                "udp",
                "--dport",
                "53",
                "-m",
                "owner",
                "--uid-owner",
                uid,
                "-j",
                "REDIRECT",
                "--to-ports",
                "15053",
            ],
        );
    }
}

/// The captured sidecar of `client` (namespace `default`, cluster c1) in `netns`: its workload
/// address `workload_ip` names it, it reaches meshpilot's xDS from `ip` through `host_ip`.
pub async fn client_sidecar(
    mp: &meshpilot::app::Running,
    netns: &Netns,
    workload_ip: &str,
    ip: &str,
    host_ip: &str,
) -> super::Envoy {
    let node_id = format!("sidecar~{workload_ip}~client.default~default.svc.cluster.local");
    proxy_in(mp, netns, &node_id, &[], "client", (ip, host_ip), false).await
}

/// An Envoy in `netns` as `node_id` (cluster c1) with `labels` and the certificate of `account`
/// in the node's namespace, reaching meshpilot's xDS from `ip` through `host_ip`: plaintext, or
/// `secure` with that certificate (as gateways must, to be served Secrets).
pub async fn proxy_in(
    mp: &meshpilot::app::Running,
    netns: &Netns,
    node_id: &str,
    labels: &[(&str, &str)],
    account: &str,
    (ip, host_ip): (&str, &str),
    secure: bool,
) -> super::Envoy {
    let host: std::net::IpAddr = host_ip.parse().expect("an IP");
    let workload = super::workload_certs(mp, &super::node_namespace(node_id), account);
    let (port, xds_tls) = match secure {
        true => (
            mp.secure_xds_addr.port(),
            Some(super::XdsTls {
                client: Some((workload.chain.clone(), workload.key.clone())),
                root: workload.root.clone(),
                sni: "istiod.istio-system.svc".into(),
            }),
        ),
        false => (mp.xds_addr.port(), None),
    };
    super::Envoy::start_with(super::EnvoyOptions {
        xds: std::net::SocketAddr::new(host, port),
        replicas: &[],
        node_id,
        metadata: &[("CLUSTER_ID", "c1")],
        labels,
        mode: super::AdsMode::Sotw,
        workload,
        xds_tls,
        netns: Some(super::InNetns {
            name: netns.name.clone(),
            ip: ip.parse().expect("an IP"),
            host_ip: host,
        }),
    })
    .await
}
