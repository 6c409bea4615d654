//! Two workloads for real traffic: a client and a server, each in its own network namespace with
//! Istio-style capture (the client application's outbound TCP to 15001, the server's inbound to
//! 15006), Envoy sidecars fed by a meshpilot serving a file cluster with Service `echo`
//! (10.96.77.77:8080 → the server's HTTP echo on 8080) and, as in every cluster, `kubernetes`
//! (10.96.0.1:443, no endpoints). Needs root.

use std::net::{IpAddr, SocketAddr};
use std::process::Output;
use std::time::Duration;

use super::netns::{link, Netns};
use super::*;

const BOUND: Duration = Duration::from_secs(30);
pub const ECHO_CLUSTER: &str = "outbound|8080||echo.default.svc.cluster.local";
/// The client application's uid: only its traffic is captured (Envoy's own is not).
pub const APP_UID: &str = "1000";

fn manifests(client_ip: &str, server_ip: &str) -> String {
    format!(
        "
apiVersion: v1
kind: Service
metadata: {{name: kubernetes, namespace: default}}
spec: {{clusterIP: 10.96.0.1, ports: [{{name: https, port: 443}}]}}
---
apiVersion: v1
kind: Service
metadata: {{name: echo, namespace: default}}
spec: {{clusterIP: 10.96.77.77, ports: [{{name: http, port: 8080}}]}}
---
apiVersion: v1
kind: Pod
metadata: {{name: server, namespace: default, labels: {{app: echo, security.istio.io/tlsMode: istio}}}}
spec: {{serviceAccountName: server, containers: []}}
status: {{podIP: {server_ip}}}
---
apiVersion: v1
kind: Pod
metadata: {{name: client, namespace: default, labels: {{app: client, security.istio.io/tlsMode: istio}}}}
spec: {{serviceAccountName: client, containers: []}}
status: {{podIP: {client_ip}}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: echo-1, namespace: default, labels: {{kubernetes.io/service-name: echo}}}}
addressType: IPv4
ports: [{{name: http, port: 8080}}]
endpoints:
- addresses: [{server_ip}]
  conditions: {{ready: true}}
  targetRef: {{kind: Pod, name: server, namespace: default}}
"
    )
}

/// The pair, on subnets `10.<net>.1-3.*`: the client at `10.<net>.3.1`, the server at
/// `10.<net>.3.2`, the host at `10.<net>.1.1` (from the client) and `10.<net>.2.1`.
pub struct Workloads {
    pub client_ns: Netns,
    pub server_ns: Netns,
    pub mp: meshpilot::app::Running,
    pub net: u8,
    _dir: tempfile::TempDir,
}

const CLIENT_NODE: &str = "sidecar~{ip}~client.default~default.svc.cluster.local";
const SERVER_NODE: &str = "sidecar~{ip}~server.default~default.svc.cluster.local";

impl Workloads {
    /// Starts meshpilot with `extra` flags and `more` manifests beside the echo service (`{net}`
    /// in them stands for `net`); the server's application is not started (see `serve_echo`).
    pub async fn start_bare(name: &str, net: u8, extra: &[&str], more: &str) -> Workloads {
        let tag = std::process::id() % 100_000;
        let client_ns = Netns::create(&format!("mpc{tag}{name}"));
        let server_ns = Netns::create(&format!("mps{tag}{name}"));
        // Control links to the host (xDS, SDS, admin) and one data link between the workloads.
        let cidr = |sub: u8, host: u8, len: u8| format!("10.{net}.{sub}.{host}/{len}");
        link(
            None,
            &format!("mpc{tag}{name}h"),
            &cidr(1, 1, 30),
            &client_ns,
            "ctl",
            &cidr(1, 2, 30),
        );
        link(
            None,
            &format!("mps{tag}{name}h"),
            &cidr(2, 1, 30),
            &server_ns,
            "ctl",
            &cidr(2, 2, 30),
        );
        link(
            Some(&client_ns),
            "data",
            &cidr(3, 1, 24),
            &server_ns,
            "data",
            &cidr(3, 2, 24),
        );
        client_ns.run("ip", &["route", "add", "10.96.0.0/16", "dev", "data"]);
        client_ns.capture_outbound(APP_UID);
        server_ns.capture_inbound("data");

        let dir = tempfile::tempdir().unwrap();
        let cluster = dir.path().join("clusters/c1");
        std::fs::create_dir_all(&cluster).unwrap();
        let yaml = manifests(&format!("10.{net}.3.1"), &format!("10.{net}.3.2"));
        std::fs::write(cluster.join("echo.yaml"), yaml).unwrap();
        if !more.is_empty() {
            let config = dir.path().join("config");
            std::fs::create_dir_all(&config).unwrap();
            let more = more.replace("{net}", &net.to_string());
            std::fs::write(config.join("more.yaml"), more).unwrap();
        }
        let mut flags = vec!["--xds-addr", "0.0.0.0:0"];
        flags.extend_from_slice(extra);
        let mp = start_meshpilot(dir.path(), &flags).await;
        Workloads {
            client_ns,
            server_ns,
            mp,
            net,
            _dir: dir,
        }
    }

    /// `start_bare` with the server's HTTP echo on every address, port 8080.
    pub async fn start(name: &str, net: u8, extra: &[&str], more: &str) -> Workloads {
        let mut pair = Self::start_bare(name, net, extra, more).await;
        pair.server_ns.serve_http_echo(8080);
        pair
    }

    /// The server's address on the data link.
    pub fn server_ip(&self) -> String {
        format!("10.{}.3.2", self.net)
    }

    /// The directory the pair's meshpilot serves (another control plane may serve it too).
    pub fn config_dir(&self) -> &std::path::Path {
        self._dir.path()
    }

    /// The client's sidecar, holding `certs`, once it knows the echo server.
    pub async fn client_sidecar(&self, certs: WorkloadCerts) -> Envoy {
        self.client_sidecar_fed_by(&self.mp, certs).await
    }

    /// The client's sidecar as a proxy of cluster `cluster` (`CLUSTER_ID`), not waiting for
    /// anything.
    pub async fn client_sidecar_in(&self, cluster: &str, certs: WorkloadCerts) -> Envoy {
        let port = self.mp.xds_addr.port();
        let at = (&self.client_ns, 1, cluster);
        self.sidecar(at, CLIENT_NODE, certs, port).await
    }

    /// The client's sidecar, fed by the control plane `mp` (listening on every address).
    pub async fn client_sidecar_fed_by(
        &self,
        mp: &meshpilot::app::Running,
        certs: WorkloadCerts,
    ) -> Envoy {
        let port = mp.xds_addr.port();
        let envoy = self
            .sidecar((&self.client_ns, 1, "c1"), CLIENT_NODE, certs, port)
            .await;
        let server = format!("{}:8080", self.server_ip());
        wait_for("client sidecar knows the server", BOUND, || {
            let (envoy, server) = (&envoy, &server);
            async move { (envoy.endpoints(ECHO_CLUSTER).await == [server.as_str()]).then_some(()) }
        })
        .await;
        envoy
    }

    /// The server's sidecar, holding `certs`, once it has its inbound listener.
    pub async fn server_sidecar(&self, certs: WorkloadCerts) -> Envoy {
        self.server_sidecar_fed_by(&self.mp, certs).await
    }

    /// The server's sidecar, fed by the control plane `mp` (listening on every address).
    pub async fn server_sidecar_fed_by(
        &self,
        mp: &meshpilot::app::Running,
        certs: WorkloadCerts,
    ) -> Envoy {
        let port = mp.xds_addr.port();
        let envoy = self
            .sidecar((&self.server_ns, 2, "c1"), SERVER_NODE, certs, port)
            .await;
        wait_for("server sidecar has its inbound listener", BOUND, || {
            let envoy = &envoy;
            async move {
                envoy
                    .get("/listeners")
                    .await
                    .contains("virtualInbound")
                    .then_some(())
            }
        })
        .await;
        envoy
    }

    async fn sidecar(
        &self,
        (ns, sub, cluster): (&Netns, u8, &str),
        node: &str,
        certs: WorkloadCerts,
        xds_port: u16,
    ) -> Envoy {
        let net = self.net;
        let workload_ip = format!("10.{net}.3.{sub}");
        let node_id: &'static str = Box::leak(node.replace("{ip}", &workload_ip).into_boxed_str());
        let host_ip: IpAddr = format!("10.{net}.{sub}.1").parse().unwrap();
        Envoy::start_with(EnvoyOptions {
            xds: SocketAddr::new(host_ip, xds_port),
            replicas: &[],
            node_id,
            metadata: &[("CLUSTER_ID", cluster)],
            labels: &[],
            mode: AdsMode::Sotw,
            workload: certs,
            xds_tls: None,
            netns: Some(InNetns {
                name: ns.name.clone(),
                ip: format!("10.{net}.{sub}.2").parse().unwrap(),
                host_ip,
            }),
        })
        .await
    }

    /// Runs `program` in the client's namespace as its application (captured).
    pub fn as_client_app(&self, program: &str, args: &[&str]) -> Output {
        self.client_ns
            .command("setpriv")
            .args(["--reuid", APP_UID, "--regid", APP_UID, "--clear-groups"])
            .arg(program)
            .args(args)
            .output()
            .expect("the client application runs")
    }

    /// The echo server's answer to the client application calling the service by name and VIP,
    /// as a Kubernetes client would.
    pub async fn call(&self) -> serde_json::Value {
        let host = "Host: echo.default.svc.cluster.local:8080";
        self.curl_echo(&["-H", host, "http://10.96.77.77:8080/hello"], "/hello")
            .await
    }

    /// The echo's answer to the client application's curl with `args`, once one reports `path`.
    pub async fn curl_echo(&self, args: &[&str], path: &str) -> serde_json::Value {
        wait_for(&format!("an answer for {path}"), BOUND, || {
            let output = self.as_client_app("curl", &[&["-s", "-m", "3"], args].concat());
            async move {
                let body: serde_json::Value = serde_json::from_slice(&output.stdout).ok()?;
                (body["path"] == path).then_some(body)
            }
        })
        .await
    }
}
