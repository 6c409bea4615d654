//! The Gateway API with real traffic: a real Envoy as the gateway of a Gateway in its own network
//! namespace, plain backends behind it. HTTPRoutes route by host, path and header, split by
//! weight (measured), redirect, rewrite and edit headers; a TCPRoute proxies a port; an HTTPS
//! listener serves its certificateRef's Secret, rotated without a restart; a TLSRoute passes TLS
//! through by SNI; a GRPCRoute routes grpcio's calls by method; an AuthorizationPolicy attached to
//! the Gateway by `targetRefs` applies at its proxy.
//!
//! Needs root (network namespaces).

mod common;

use std::time::Duration;

use common::gateway_certs::{issue, tls_secret};
use common::netns::{link, proxy_in, Netns};
use common::*;

const BOUND: Duration = Duration::from_secs(30);

/// Two plain backends: cart and its v2, each an echo server.
fn backends() -> String {
    [
        service_yaml(
            "shop",
            "cart",
            "10.96.70.1",
            ("http", 8080),
            &["10.221.1.2"],
        ),
        service_yaml(
            "shop",
            "cart-v2",
            "10.96.70.2",
            ("http", 8080),
            &["10.221.1.3"],
        ),
    ]
    .join("---\n")
}

const ROUTES: &str = "
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {name: web, namespace: shop}
spec:
  gatewayClassName: istio
  listeners:
  - {name: http, port: 8080, protocol: HTTP, hostname: '*.example.com'}
  - {name: raw, port: 9000, protocol: TCP}
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: shop, namespace: shop}
spec:
  parentRefs: [{name: web, sectionName: http}]
  hostnames: [shop.example.com]
  rules:
  - matches: [{path: {type: PathPrefix, value: /split}}]
    backendRefs: [{name: cart, port: 8080, weight: 50}, {name: cart-v2, port: 8080, weight: 50}]
  - matches: [{headers: [{name: x-version, value: v2}]}]
    backendRefs: [{name: cart-v2, port: 8080}]
  - matches: [{path: {type: Exact, value: /missing}}]
    backendRefs: [{name: no-such-service, port: 8080}]
  - matches: [{path: {type: Exact, value: /old}}]
    filters:
    - type: RequestRedirect
      requestRedirect: {hostname: new.example.com, statusCode: 301}
  - matches: [{path: {type: PathPrefix, value: /api}}]
    filters:
    - type: URLRewrite
      urlRewrite: {path: {type: ReplacePrefixMatch, replacePrefixMatch: /v2}}
    backendRefs: [{name: cart, port: 8080}]
  - filters:
    - type: RequestHeaderModifier
      requestHeaderModifier: {set: [{name: x-via, value: gateway}], remove: [x-drop]}
    - type: ResponseHeaderModifier
      responseHeaderModifier: {add: [{name: x-served-by, value: meshpilot}]}
    backendRefs: [{name: cart, port: 8080}]
---
# A policy attached to the Gateway by targetRefs: its proxies deny /admin.
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: no-admin, namespace: shop}
spec:
  targetRefs: [{group: gateway.networking.k8s.io, kind: Gateway, name: web}]
  action: DENY
  # The port keeps the rule off the TCP listener, which a DENY with HTTP-only fields would close.
  rules: [{to: [{operation: {ports: ['8080'], paths: [/admin]}}]}]
---
apiVersion: gateway.networking.k8s.io/v1alpha2
kind: TCPRoute
metadata: {name: raw, namespace: shop}
spec:
  parentRefs: [{name: web, sectionName: raw}]
  rules: [{backendRefs: [{name: cart-v2, port: 8080}]}]
";

/// curl from the host to the gateway: (HTTP status, headers, body).
fn curl(url: &str, headers: &[&str]) -> (u16, String, serde_json::Value) {
    let mut command = std::process::Command::new("curl");
    command.args(["-s", "-m", "3", "-D", "-", url]);
    for header in headers {
        command.args(["-H", header]);
    }
    let output = command.output().expect("curl runs");
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = serde_json::from_str(body).unwrap_or(serde_json::Value::Null);
    (status, head.to_ascii_lowercase(), body)
}

/// The gateway's network namespace (reached from the host at `<net>.11.2`) and the backends'
/// (`<net>.1.2` and `<net>.1.3` on the gateway's data link, `<net>.1.1`); `tag` keeps names apart.
fn lan(tag: &str, net: &str) -> (Netns, Netns) {
    let gateway_ns = Netns::create(&format!("gai{tag}"));
    let backend_ns = Netns::create(&format!("gab{tag}"));
    link(
        None,
        &format!("gai{tag}h"),
        &format!("{net}.11.1/30"),
        &gateway_ns,
        "ctl",
        &format!("{net}.11.2/30"),
    );
    link(
        Some(&gateway_ns),
        "data",
        &format!("{net}.1.1/24"),
        &backend_ns,
        "data",
        &format!("{net}.1.2/24"),
    );
    backend_ns.run(
        "ip",
        &["addr", "add", &format!("{net}.1.3/24"), "dev", "data"],
    );
    (gateway_ns, backend_ns)
}

/// A file-mode mesh of `cluster` objects and `config`, and the Gateway `web`'s Envoy in the
/// gateway namespace of [`lan`]`(_, net)`.
async fn gateway_of(
    gateway_ns: &Netns,
    net: &str,
    cluster: &[&str],
    config: &str,
) -> (meshpilot::app::Running, tempfile::TempDir, Envoy) {
    let dir = tempfile::tempdir().unwrap();
    let cluster_dir = dir.path().join("clusters/c1");
    std::fs::create_dir_all(&cluster_dir).unwrap();
    std::fs::create_dir_all(dir.path().join("config")).unwrap();
    for (i, manifest) in cluster.iter().enumerate() {
        std::fs::write(cluster_dir.join(format!("{i}.yaml")), manifest).unwrap();
    }
    std::fs::write(dir.path().join("config/routes.yaml"), config).unwrap();
    let mp = start_meshpilot(
        dir.path(),
        &["--xds-addr", "0.0.0.0:0", "--secure-xds-addr", "0.0.0.0:0"],
    )
    .await;
    let gateway = proxy_in(
        &mp,
        gateway_ns,
        &format!("router~{net}.1.1~web-7c9d-1.shop~shop.svc.cluster.local"),
        &[("gateway.networking.k8s.io/gateway-name", "web")],
        "web-istio",
        (&format!("{net}.11.2"), &format!("{net}.11.1")),
        true,
    )
    .await;
    (mp, dir, gateway)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_routes_splits_redirects_rewrites_and_edits_headers() {
    let tag = format!("{}h", std::process::id() % 100_000);
    let (gateway_ns, mut backend_ns) = lan(&tag, "10.221");
    backend_ns.serve_http_echo(8080);
    let (_mp, _dir, gateway) = gateway_of(&gateway_ns, "10.221", &[&backends()], ROUTES).await;

    let url = |path: &str| format!("http://10.221.11.2:8080{path}");
    let host = "host: shop.example.com";
    let (_, head, body) = wait_for("an answer through the gateway", BOUND, || async {
        let answer = curl(&url("/"), &[host, "x-drop: 1"]);
        (answer.0 == 200).then_some(answer)
    })
    .await;
    assert_eq!(body["server"], "10.221.1.2");
    assert_eq!(body["headers"]["x-via"], "gateway");
    assert!(body["headers"].get("x-drop").is_none(), "{body}");
    assert!(head.contains("x-served-by: meshpilot"), "{head}");

    assert_eq!(curl(&url("/admin"), &[host]).0, 403, "the targeted policy");
    // Another host of the listener's wildcard matches no route; one outside it no listener host.
    assert_eq!(curl(&url("/"), &["host: other.example.com"]).0, 404);

    let (_, _, body) = curl(&url("/"), &[host, "x-version: v2"]);
    assert_eq!(body["server"], "10.221.1.3", "the header match");

    assert_eq!(
        curl(&url("/missing"), &[host]).0,
        500,
        "a backend not found"
    );
    let (status, head, _) = curl(&url("/old"), &[host]);
    assert_eq!(status, 301);
    assert!(
        head.contains("location: http://new.example.com/old"),
        "{head}"
    );
    let (status, _, body) = curl(&url("/oldest"), &[host]);
    assert_eq!((status, body["server"].as_str()), (200, Some("10.221.1.2")));

    let (_, _, body) = curl(&url("/api/items?x=1"), &[host]);
    assert_eq!(body["path"], "/v2/items?x=1");
    let (_, _, body) = curl(&url("/apis"), &[host]);
    assert_eq!(
        body["path"], "/apis",
        "a path prefix matches whole segments"
    );

    // The weighted split, over 200 requests.
    let mut v2 = 0;
    for _ in 0..200 {
        let (status, _, body) = curl(&url("/split"), &[host]);
        assert_eq!(status, 200);
        v2 += usize::from(body["server"] == "10.221.1.3");
    }
    assert!(
        (70..=130).contains(&v2),
        "{v2} of 200 went to cart-v2 (50%)"
    );

    // The TCPRoute: the port's bytes go to cart-v2.
    let (status, _, body) = curl("http://10.221.11.2:9000/raw", &["host: anything"]);
    assert_eq!((status, body["server"].as_str()), (200, Some("10.221.1.3")));
    assert_eq!(gateway.rejected_updates().await, 0);
}

/// vault (TLS of its own) and the two versions of a gRPC echo service.
fn secure_backends() -> String {
    [
        service_yaml(
            "shop",
            "vault",
            "10.96.71.1",
            ("https", 8443),
            &["10.222.1.2"],
        ),
        service_yaml(
            "shop",
            "echo-v1",
            "10.96.71.2",
            ("grpc", 7070),
            &["10.222.1.2"],
        ),
        service_yaml(
            "shop",
            "echo-v2",
            "10.96.71.3",
            ("grpc", 7070),
            &["10.222.1.3"],
        ),
    ]
    .join("---\n")
}

const SECURE_ROUTES: &str = "
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {name: web, namespace: shop}
spec:
  gatewayClassName: istio
  listeners:
  - name: https
    port: 8443
    protocol: HTTPS
    hostname: shop.example.com
    tls: {certificateRefs: [{name: shop-cert}]}
  - name: passthrough
    port: 9443
    protocol: TLS
    tls: {mode: Passthrough}
  - {name: grpc, port: 8080, protocol: HTTP}
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: shop, namespace: shop}
spec:
  parentRefs: [{name: web, sectionName: https}]
  rules: [{backendRefs: [{name: echo-v1, port: 7070}]}]
---
apiVersion: gateway.networking.k8s.io/v1
kind: TLSRoute
metadata: {name: vault, namespace: shop}
spec:
  parentRefs: [{name: web, sectionName: passthrough}]
  hostnames: [vault.example.com]
  rules: [{backendRefs: [{name: vault, port: 8443}]}]
---
apiVersion: gateway.networking.k8s.io/v1
kind: GRPCRoute
metadata: {name: echo, namespace: shop}
spec:
  parentRefs: [{name: web, sectionName: grpc}]
  hostnames: [grpc.example.com]
  rules:
  - matches: [{method: {service: echo.Echo, method: Say}}]
    backendRefs: [{name: echo-v2, port: 7070}]
  - matches: [{method: {service: echo.Echo}}]
    backendRefs: [{name: echo-v1, port: 7070}]
";

/// A gRPC call through the gateway: the reply, or what the client said when it failed.
fn grpc_call(method: &str, authority: &str) -> Result<String, String> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/peers/grpc_echo.py");
    let output = std::process::Command::new("timeout")
        .arg("5")
        .arg(peer_python())
        .args([script, "call", "10.222.11.2:8080", "hi", method, authority])
        .output()
        .expect("python3 runs");
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).trim().to_string();
    match output.status.success() {
        true => Ok(text(&output.stdout)),
        false => Err(format!("{}: {}", output.status, text(&output.stderr))),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_certificates_rotate_tls_passes_through_and_grpc_routes_by_method() {
    let tag = format!("{}s", std::process::id() % 100_000);
    let (gateway_ns, mut backend_ns) = lan(&tag, "10.222");
    let grpc_echo = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/peers/grpc_echo.py");
    let python = peer_python();
    let python = python.to_str().unwrap();
    backend_ns.spawn(python, &[grpc_echo, "serve", "10.222.1.2:7070", "v1"]);
    backend_ns.spawn(python, &[grpc_echo, "serve", "10.222.1.3:7070", "v2"]);
    let certs = tempfile::tempdir().unwrap();
    let file = |name: &str, pem: &str| {
        let path = certs.path().join(name);
        std::fs::write(&path, pem).unwrap();
        path
    };
    // The passed-through backend terminates TLS itself, for vault.example.com.
    let vault = issue("vault.example.com");
    let (vault_ca, vault_chain, vault_key) = (
        file("vault-ca.pem", &vault.0),
        file("vault.pem", &vault.1),
        file("vault-key.pem", &vault.2),
    );
    backend_ns.serve_https_echo(8443, &vault_chain, &vault_key, &vault_ca);

    let first = issue("shop.example.com");
    let secret =
        |cert: &(String, String, String)| tls_secret("shop", "shop-cert", &cert.1, &cert.2);
    let (mp, dir, gateway) = gateway_of(
        &gateway_ns,
        "10.222",
        &[&secure_backends(), &secret(&first)],
        SECURE_ROUTES,
    )
    .await;

    // gRPC by method: Say to v2, the service's other methods to v1.
    let deadline = std::time::Instant::now() + BOUND;
    let say = loop {
        match grpc_call("/echo.Echo/Say", "grpc.example.com") {
            Ok(reply) => break reply,
            Err(e) if std::time::Instant::now() > deadline => {
                let listeners = gateway.get("/listeners").await;
                let sync = get_json(mp.http_addr, "/debug/syncz").await;
                panic!(
                    "no gRPC answer through the gateway: {e}\nlisteners: {listeners}\nsync: {sync}"
                );
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };
    assert_eq!(say, "v2:hi");
    assert_eq!(
        grpc_call("/echo.Echo/Other", "grpc.example.com").as_deref(),
        Ok("v1:hi")
    );

    // TLS passed through by SNI: the backend's own certificate answers.
    let vault_ca = vault_ca.to_str().unwrap().to_string();
    let (cert, key) = (vault_chain.to_str().unwrap(), vault_key.to_str().unwrap());
    let through = wait_for("TLS passed through to vault", BOUND, || {
        let output = std::process::Command::new("curl")
            .args([
                "-s", "-m", "3", "--cacert", &vault_ca, "--cert", cert, "--key", key,
            ])
            .args(["--resolve", "vault.example.com:9443:10.222.11.2"])
            .arg("https://vault.example.com:9443/sealed")
            .output()
            .expect("curl runs");
        let body: Option<serde_json::Value> = serde_json::from_slice(&output.stdout).ok();
        async move { body.filter(|b| b["path"] == "/sealed") }
    })
    .await;
    assert_eq!(through["server"], "10.222.1.2");

    // HTTPS with the certificateRef's Secret, then the Secret rotated under a running gateway.
    let https = |ca: &std::path::Path| {
        std::process::Command::new("curl")
            .args(["-s", "-m", "3", "-o", "/dev/null", "--cacert"])
            .arg(ca)
            .args(["--resolve", "shop.example.com:8443:10.222.11.2"])
            .arg("https://shop.example.com:8443/")
            .status()
            .expect("curl runs")
            .code()
    };
    let first_ca = file("first-ca.pem", &first.0);
    wait_for("HTTPS with the first certificate", BOUND, || async {
        (https(&first_ca) == Some(0)).then_some(())
    })
    .await;
    let second = issue("shop.example.com");
    let second_ca = file("second-ca.pem", &second.0);
    write_atomic(&dir.path().join("clusters/c1/1.yaml"), &secret(&second));
    wait_for("HTTPS with the rotated certificate", BOUND, || async {
        (https(&second_ca) == Some(0)).then_some(())
    })
    .await;
    assert_ne!(
        https(&first_ca),
        Some(0),
        "the old certificate is still served"
    );
    assert_eq!(gateway.rejected_updates().await, 0);
}
