//! Gateways with real traffic, each proxy a real Envoy in its own network namespace:
//! - ingress: an HTTPS server whose certificate meshpilot serves over SDS from a Secret, verified
//!   by curl against the Secret's CA, routing by host to a mesh service over mTLS; a rotated Secret
//!   is picked up without a restart;
//! - egress: a captured sidecar's request for an external host goes through the egress gateway,
//!   as in Istio's egress gateway task (ServiceEntry + Gateway + VirtualService).
//!
//! Needs root (network namespaces, iptables).

mod common;

use std::time::Duration;

use common::gateway_certs::{issue, tls_secret, tls_secret_with_ca};
use common::netns::{link, proxy_in, Netns};
use common::*;

const BOUND: Duration = Duration::from_secs(30);
const APP_UID: &str = "1000";

/// A file-mode mesh with one cluster `c1` and the given Istio config.
fn mesh_dir(cluster: &[String], config: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("clusters/c1");
    std::fs::create_dir_all(&path).unwrap();
    for (i, manifest) in cluster.iter().enumerate() {
        std::fs::write(path.join(format!("{i}.yaml")), manifest).unwrap();
    }
    std::fs::create_dir_all(dir.path().join("config")).unwrap();
    std::fs::write(dir.path().join("config/gateway.yaml"), config).unwrap();
    dir
}

/// curl from the host: (exit code, body).
fn curl(args: &[&str]) -> (i32, String) {
    let output = std::process::Command::new("curl")
        .args(["-s", "-m", "3"])
        .args(args)
        .output()
        .expect("curl runs");
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
    )
}

const INGRESS_CONFIG: &str = "
apiVersion: networking.istio.io/v1
kind: Gateway
metadata: {name: ingress, namespace: istio-system}
spec:
  selector: {istio: ingressgateway}
  servers:
  - port: {number: 8443, name: https, protocol: HTTPS}
    hosts: [shop.example.com]
    tls: {mode: SIMPLE, credentialName: shop-cert}
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: shop, namespace: default}
spec:
  hosts: [shop.example.com]
  gateways: [istio-system/ingress]
  http:
  - route: [{destination: {host: echo, port: {number: 8080}}}]
";

const ECHO: &str = "
apiVersion: v1
kind: Service
metadata: {name: echo, namespace: default}
spec: {clusterIP: 10.96.66.66, ports: [{name: http, port: 8080}]}
---
apiVersion: v1
kind: Pod
metadata: {name: echo-1, namespace: default, labels: {app: echo, security.istio.io/tlsMode: istio}}
spec: {serviceAccountName: echo, containers: []}
status: {podIP: 10.219.1.2}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: echo-1, namespace: default, labels: {kubernetes.io/service-name: echo}}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints:
- {addresses: [10.219.1.2], conditions: {ready: true}, targetRef: {kind: Pod, name: echo-1, namespace: default}}
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingress_serves_a_secrets_certificate_and_routes_to_the_mesh_over_mtls() {
    let tag = std::process::id() % 100_000;
    let gateway_ns = Netns::create(&format!("gwi{tag}"));
    let mut backend_ns = Netns::create(&format!("gwb{tag}"));
    link(
        None,
        &format!("gwi{tag}h"),
        "10.219.11.1/30",
        &gateway_ns,
        "ctl",
        "10.219.11.2/30",
    );
    link(
        None,
        &format!("gwb{tag}h"),
        "10.219.13.1/30",
        &backend_ns,
        "ctl",
        "10.219.13.2/30",
    );
    link(
        Some(&gateway_ns),
        "data",
        "10.219.1.1/24",
        &backend_ns,
        "data",
        "10.219.1.2/24",
    );
    backend_ns.capture_inbound("data");
    backend_ns.serve_http_echo(8080);

    let first = issue("shop.example.com");
    let dir = mesh_dir(
        &[
            ECHO.to_string(),
            tls_secret("istio-system", "shop-cert", &first.1, &first.2),
        ],
        INGRESS_CONFIG,
    );
    let mp = start_meshpilot(
        dir.path(),
        &["--xds-addr", "0.0.0.0:0", "--secure-xds-addr", "0.0.0.0:0"],
    )
    .await;
    let gateway = proxy_in(
        &mp,
        &gateway_ns,
        "router~10.219.1.1~istio-ingressgateway-0.istio-system~istio-system.svc.cluster.local",
        &[("istio", "ingressgateway")],
        "istio-ingressgateway-service-account",
        ("10.219.11.2", "10.219.11.1"),
        true,
    )
    .await;
    let backend = proxy_in(
        &mp,
        &backend_ns,
        "sidecar~10.219.1.2~echo-1.default~default.svc.cluster.local",
        &[("app", "echo")],
        "echo",
        ("10.219.13.2", "10.219.13.1"),
        false,
    )
    .await;
    wait_for("the backend's inbound listener", BOUND, || {
        let backend = &backend;
        async move {
            backend
                .get("/listeners")
                .await
                .contains("virtualInbound")
                .then_some(())
        }
    })
    .await;

    let certs = tempfile::tempdir().unwrap();
    let ca_file = |name: &str, pem: &str| {
        let path = certs.path().join(name);
        std::fs::write(&path, pem).unwrap();
        path.to_str().unwrap().to_string()
    };
    let first_ca = ca_file("first.pem", &first.0);
    let resolve = "shop.example.com:8443:10.219.11.2";
    let url = "https://shop.example.com:8443/in";
    let body = wait_for("an HTTPS answer through the ingress gateway", BOUND, || {
        let (code, body) = curl(&["--cacert", &first_ca, "--resolve", resolve, url]);
        async move {
            let body: serde_json::Value = serde_json::from_str(&body).ok()?;
            (code == 0 && body["path"] == "/in").then_some(body)
        }
    })
    .await;
    let xfcc = body["headers"]["x-forwarded-client-cert"]
        .as_str()
        .unwrap_or_default();
    assert!(
        xfcc.contains(
            "URI=spiffe://cluster.local/ns/istio-system/sa/istio-ingressgateway-service-account"
        ),
        "the gateway did not reach the backend over mTLS: {body}"
    );
    assert!(gateway.counter("listener.0.0.0.0_8443.ssl.handshake").await >= 1);

    // Rotation: a certificate from another CA replaces the first, without a restart.
    let second = issue("shop.example.com");
    let second_ca = ca_file("second.pem", &second.0);
    write_atomic(
        &dir.path().join("clusters/c1/1.yaml"),
        &tls_secret("istio-system", "shop-cert", &second.1, &second.2),
    );
    wait_for("the rotated certificate served", BOUND, || {
        let (code, _) = curl(&["--cacert", &second_ca, "--resolve", resolve, url]);
        async move { (code == 0).then_some(()) }
    })
    .await;
    let (code, _) = curl(&["--cacert", &first_ca, "--resolve", resolve, url]);
    // 60: the peer's certificate did not verify; 35: the handshake failed (curl builds differ).
    assert!(
        code == 60 || code == 35,
        "the old certificate is still served (curl exit {code})"
    );
    assert_eq!(
        gateway.rejected_updates().await + backend.rejected_updates().await,
        0
    );
}

const EGRESS_CLUSTER: &str = "
apiVersion: v1
kind: Service
metadata: {name: istio-egressgateway, namespace: istio-system}
spec: {clusterIP: 10.96.0.80, ports: [{name: http, port: 80, targetPort: 8080}]}
---
apiVersion: v1
kind: Pod
metadata: {name: istio-egressgateway-0, namespace: istio-system, labels: {istio: egressgateway}}
spec: {serviceAccountName: istio-egressgateway-service-account, containers: []}
status: {podIP: 10.220.1.2}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: istio-egressgateway-1, namespace: istio-system, labels: {kubernetes.io/service-name: istio-egressgateway}}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints:
- {addresses: [10.220.1.2], conditions: {ready: true}, targetRef: {kind: Pod, name: istio-egressgateway-0, namespace: istio-system}}
";

/// Istio's egress gateway task, with a STATIC entry for a host only the gateway can reach.
const EGRESS_CONFIG: &str = "
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: external-api, namespace: default}
spec:
  hosts: [api.external.test]
  ports: [{number: 80, name: http, protocol: HTTP}]
  location: MESH_EXTERNAL
  resolution: STATIC
  endpoints: [{address: 10.220.2.2, ports: {http: 8000}}]
---
apiVersion: networking.istio.io/v1
kind: Gateway
metadata: {name: istio-egressgateway, namespace: istio-system}
spec:
  selector: {istio: egressgateway}
  servers:
  - port: {number: 80, name: http, protocol: HTTP}
    hosts: [api.external.test]
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: direct-through-egress-gateway, namespace: default}
spec:
  hosts: [api.external.test]
  gateways: [istio-system/istio-egressgateway, mesh]
  http:
  - match: [{gateways: [mesh], port: 80}]
    route: [{destination: {host: istio-egressgateway.istio-system.svc.cluster.local, port: {number: 80}}}]
  - match: [{gateways: [istio-system/istio-egressgateway], port: 80}]
    route: [{destination: {host: api.external.test, port: {number: 80}}}]
";

/// Istio's egress layout on three hosts of their own: a captured client that reaches only the
/// egress gateway, which alone reaches the external host. `prefix` names the namespaces, `net` the
/// subnets (10.<net>.x); the config above is written for 220 and moved to `net`.
struct EgressHosts {
    client: Netns,
    gateway: Netns,
    external: Netns,
    net: u8,
}

impl EgressHosts {
    fn new(prefix: &str, net: u8) -> Self {
        let tag = std::process::id() % 100_000;
        let ns = |role: char| Netns::create(&format!("{prefix}{role}{tag}"));
        let (client, gateway, external) = (ns('c'), ns('g'), ns('x'));
        let ip = |rest: &str| format!("10.{net}.{rest}");
        link(
            None,
            &format!("{prefix}c{tag}h"),
            &ip("11.1/30"),
            &client,
            "ctl",
            &ip("11.2/30"),
        );
        link(
            None,
            &format!("{prefix}g{tag}h"),
            &ip("12.1/30"),
            &gateway,
            "ctl",
            &ip("12.2/30"),
        );
        link(
            Some(&client),
            "data",
            &ip("1.1/24"),
            &gateway,
            "data",
            &ip("1.2/24"),
        );
        link(
            Some(&gateway),
            "out",
            &ip("2.1/24"),
            &external,
            "data",
            &ip("2.2/24"),
        );
        client.run("ip", &["route", "add", &ip("9.0/24"), "dev", "data"]);
        client.capture_outbound(APP_UID);
        Self {
            client,
            gateway,
            external,
            net,
        }
    }

    /// The layout's addresses in a manifest written for net 220.
    fn moved(&self, manifest: &str) -> String {
        manifest.replace("10.220.", &format!("10.{}.", self.net))
    }

    fn ip(&self, rest: &str) -> String {
        format!("10.{}.{rest}", self.net)
    }

    /// The client sidecar (plaintext xDS) and the egress gateway (secure xDS when `secure`), once
    /// the gateway listens on its Service's target port.
    async fn proxies(&self, mp: &meshpilot::app::Running, secure: bool) -> (Envoy, Envoy) {
        let client = proxy_in(
            mp,
            &self.client,
            &format!(
                "sidecar~{}~client.default~default.svc.cluster.local",
                self.ip("1.1")
            ),
            &[("app", "client")],
            "client",
            (&self.ip("11.2"), &self.ip("11.1")),
            false,
        )
        .await;
        let gateway = proxy_in(
            mp,
            &self.gateway,
            &format!(
                "router~{}~istio-egressgateway-0.istio-system~istio-system.svc.cluster.local",
                self.ip("1.2")
            ),
            &[("istio", "egressgateway")],
            "istio-egressgateway-service-account",
            (&self.ip("12.2"), &self.ip("12.1")),
            secure,
        )
        .await;
        // The gateway's Service sends port 80 to 8080: its listener binds the target port.
        wait_for("the egress gateway's listener", BOUND, || {
            let gateway = &gateway;
            async move {
                let listeners = gateway.get("/listeners").await;
                listeners.contains("0.0.0.0_8080").then_some(())
            }
        })
        .await;
        (client, gateway)
    }

    /// The external host's echo as the client application asks for `http://api.external.test<path>`.
    async fn ask_external(&self, path: &str) -> serde_json::Value {
        let resolve = format!("api.external.test:80:{}", self.ip("9.9"));
        let url = format!("http://api.external.test{path}");
        wait_for("an answer from the external host", BOUND, || {
            let output = self
                .client
                .command("setpriv")
                .args(["--reuid", APP_UID, "--regid", APP_UID, "--clear-groups"])
                .args(["curl", "-s", "-m", "3", "--resolve", &resolve, &url])
                .output();
            async move {
                let body: serde_json::Value = serde_json::from_slice(&output.ok()?.stdout).ok()?;
                (body["path"] == path).then_some(body)
            }
        })
        .await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mesh_traffic_to_an_external_host_leaves_through_the_egress_gateway() {
    let mut hosts = EgressHosts::new("ge", 220);
    hosts.external.serve_http_echo(8000);
    let dir = mesh_dir(&[EGRESS_CLUSTER.to_string()], EGRESS_CONFIG);
    let mp = start_meshpilot(dir.path(), &["--xds-addr", "0.0.0.0:0"]).await;
    let (client, gateway) = hosts.proxies(&mp, false).await;

    let body = hosts.ask_external("/out").await;
    assert_eq!(body["server"], "10.220.2.2", "{body}");
    assert!(
        client
            .counter("cluster.outbound|80||istio-egressgateway.istio-system.svc.cluster.local.upstream_rq_total")
            .await
            >= 1,
        "the sidecar did not send the request to the egress gateway"
    );
    assert!(
        gateway
            .counter("cluster.outbound|80||api.external.test.upstream_rq_total")
            .await
            >= 1,
        "the egress gateway did not forward the request"
    );
    assert_eq!(
        client.rejected_updates().await + gateway.rejected_updates().await,
        0
    );
}

/// Istio's "mutual TLS origination with an egress gateway" task: the gateway sends the client's
/// plain request on over TLS, presenting the certificate of the Secret the rule names.
const ORIGINATION_CONFIG: &str = "
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: external-api, namespace: default}
spec:
  hosts: [api.external.test]
  ports:
  - {number: 80, name: http, protocol: HTTP}
  - {number: 443, name: https, protocol: HTTPS}
  location: MESH_EXTERNAL
  resolution: STATIC
  endpoints: [{address: 10.220.2.2, ports: {http: 8000, https: 8443}}]
---
apiVersion: networking.istio.io/v1
kind: Gateway
metadata: {name: istio-egressgateway, namespace: istio-system}
spec:
  selector: {istio: egressgateway}
  servers:
  - port: {number: 80, name: http, protocol: HTTP}
    hosts: [api.external.test]
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: direct-through-egress-gateway, namespace: default}
spec:
  hosts: [api.external.test]
  gateways: [istio-system/istio-egressgateway, mesh]
  http:
  - match: [{gateways: [mesh], port: 80}]
    route: [{destination: {host: istio-egressgateway.istio-system.svc.cluster.local, port: {number: 80}}}]
  - match: [{gateways: [istio-system/istio-egressgateway], port: 80}]
    route: [{destination: {host: api.external.test, port: {number: 443}}}]
---
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {name: originate-mtls-for-api, namespace: istio-system}
spec:
  host: api.external.test
  trafficPolicy:
    portLevelSettings:
    - port: {number: 443}
      tls: {mode: MUTUAL, credentialName: client-credential, sni: api.external.test}
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_egress_gateway_originates_mutual_tls_with_a_rules_credential() {
    let mut hosts = EgressHosts::new("gm", 221);
    // The external server's certificate, and the client certificate it requires.
    let (server_ca, server_chain, server_key) = issue("api.external.test");
    let (client_ca, client_chain, client_key) = issue("egress.client.test");
    let pem = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let path = pem.path().join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    hosts.external.serve_https_echo(
        8443,
        &write("server.pem", &server_chain),
        &write("server.key", &server_key),
        &write("client-ca.pem", &client_ca),
    );
    let credential = tls_secret_with_ca(
        "istio-system",
        "client-credential",
        &client_chain,
        &client_key,
        &server_ca,
    );
    let dir = mesh_dir(
        &[hosts.moved(EGRESS_CLUSTER), credential],
        &hosts.moved(ORIGINATION_CONFIG),
    );
    let mp = start_meshpilot(
        dir.path(),
        &["--xds-addr", "0.0.0.0:0", "--secure-xds-addr", "0.0.0.0:0"],
    )
    .await;
    let (client, gateway) = hosts.proxies(&mp, true).await;

    let body = hosts.ask_external("/over-mtls").await;
    assert_eq!(body["server"], hosts.ip("2.2"), "{body}");
    assert_eq!(
        body["client_sans"],
        serde_json::json!(["egress.client.test"]),
        "the gateway presented the Secret's certificate: {body}"
    );
    assert!(
        gateway
            .counter("cluster.outbound|443||api.external.test.ssl.handshake")
            .await
            >= 1,
        "the egress gateway did not originate TLS"
    );
    assert_eq!(
        client.rejected_updates().await + gateway.rejected_updates().await,
        0
    );
}
