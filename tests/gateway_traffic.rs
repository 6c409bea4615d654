//! Gateways with real traffic, each proxy a real Envoy in its own network namespace:
//! - ingress: an HTTPS server whose certificate meshpilot serves over SDS from a Secret, verified
//!   by curl against the Secret's CA, routing by host to a mesh service over mTLS; a rotated Secret
//!   is picked up without a restart;
//! - egress: a captured sidecar's request for an external host goes through the egress gateway,
//!   as in Istio's egress gateway task (ServiceEntry + Gateway + VirtualService).
//!
//! Needs root (network namespaces, iptables).

mod common;

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use common::gateway_certs::{issue, tls_secret};
use common::netns::{link, Netns};
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

/// An Envoy in `ns` reaching meshpilot at `host_ip`, as `node_id` with `labels`.
#[allow(clippy::too_many_arguments)]
async fn proxy(
    mp: &meshpilot::app::Running,
    ns: &Netns,
    ctl_ip: &str,
    host_ip: &str,
    node_id: &str,
    labels: &[(&str, &str)],
    account: &str,
    secure: bool,
) -> Envoy {
    let workload = workload_certs(mp, &node_namespace(node_id), account);
    let (port, xds_tls) = match secure {
        true => (
            mp.secure_xds_addr.port(),
            Some(XdsTls {
                client: Some((workload.chain.clone(), workload.key.clone())),
                root: workload.root.clone(),
                sni: "istiod.istio-system.svc".into(),
            }),
        ),
        false => (mp.xds_addr.port(), None),
    };
    Envoy::start_with(EnvoyOptions {
        xds: SocketAddr::new(host_ip.parse().unwrap(), port),
        replicas: &[],
        node_id,
        metadata: &[("CLUSTER_ID", "c1")],
        labels,
        mode: AdsMode::Sotw,
        workload,
        xds_tls,
        netns: Some(InNetns {
            name: ns.name.clone(),
            ip: ctl_ip.parse::<IpAddr>().unwrap(),
            host_ip: host_ip.parse().unwrap(),
        }),
    })
    .await
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

#[tokio::test]
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
    let gateway = proxy(
        &mp,
        &gateway_ns,
        "10.219.11.2",
        "10.219.11.1",
        "router~10.219.1.1~istio-ingressgateway-0.istio-system~istio-system.svc.cluster.local",
        &[("istio", "ingressgateway")],
        "istio-ingressgateway-service-account",
        true,
    )
    .await;
    let backend = proxy(
        &mp,
        &backend_ns,
        "10.219.13.2",
        "10.219.13.1",
        "sidecar~10.219.1.2~echo-1.default~default.svc.cluster.local",
        &[("app", "echo")],
        "echo",
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

#[tokio::test]
async fn mesh_traffic_to_an_external_host_leaves_through_the_egress_gateway() {
    let tag = std::process::id() % 100_000;
    let client_ns = Netns::create(&format!("gec{tag}"));
    let gateway_ns = Netns::create(&format!("geg{tag}"));
    let mut external_ns = Netns::create(&format!("gex{tag}"));
    link(
        None,
        &format!("gec{tag}h"),
        "10.220.11.1/30",
        &client_ns,
        "ctl",
        "10.220.11.2/30",
    );
    link(
        None,
        &format!("geg{tag}h"),
        "10.220.12.1/30",
        &gateway_ns,
        "ctl",
        "10.220.12.2/30",
    );
    // The client reaches only the gateway; only the gateway reaches the external host.
    link(
        Some(&client_ns),
        "data",
        "10.220.1.1/24",
        &gateway_ns,
        "data",
        "10.220.1.2/24",
    );
    link(
        Some(&gateway_ns),
        "out",
        "10.220.2.1/24",
        &external_ns,
        "data",
        "10.220.2.2/24",
    );
    client_ns.run("ip", &["route", "add", "10.220.9.0/24", "dev", "data"]);
    client_ns.capture_outbound(APP_UID);
    external_ns.serve_http_echo(8000);

    let dir = mesh_dir(&[EGRESS_CLUSTER.to_string()], EGRESS_CONFIG);
    let mp = start_meshpilot(dir.path(), &["--xds-addr", "0.0.0.0:0"]).await;
    let client = proxy(
        &mp,
        &client_ns,
        "10.220.11.2",
        "10.220.11.1",
        "sidecar~10.220.1.1~client.default~default.svc.cluster.local",
        &[("app", "client")],
        "client",
        false,
    )
    .await;
    let gateway = proxy(
        &mp,
        &gateway_ns,
        "10.220.12.2",
        "10.220.12.1",
        "router~10.220.1.2~istio-egressgateway-0.istio-system~istio-system.svc.cluster.local",
        &[("istio", "egressgateway")],
        "istio-egressgateway-service-account",
        false,
    )
    .await;
    // The gateway's Service sends port 80 to 8080: its listener binds the target port.
    wait_for(
        "the egress gateway's listener on its target port",
        BOUND,
        || {
            let gateway = &gateway;
            async move {
                gateway
                    .get("/listeners")
                    .await
                    .contains("0.0.0.0_8080")
                    .then_some(())
            }
        },
    )
    .await;

    let body = wait_for("an answer from the external host", BOUND, || {
        let output = client_ns
            .command("setpriv")
            .args(["--reuid", APP_UID, "--regid", APP_UID, "--clear-groups"])
            .args([
                "curl",
                "-s",
                "-m",
                "3",
                "--resolve",
                "api.external.test:80:10.220.9.9",
            ])
            .arg("http://api.external.test/out")
            .output();
        async move {
            let body: serde_json::Value = serde_json::from_slice(&output.ok()?.stdout).ok()?;
            (body["path"] == "/out").then_some(body)
        }
    })
    .await;
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
