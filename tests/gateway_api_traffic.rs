//! The Gateway API with real traffic: a real Envoy as the gateway of a Gateway in its own network
//! namespace, plain backends behind it. HTTPRoutes route by host, path and header, split by
//! weight (measured), redirect, rewrite and edit headers; a TCPRoute proxies a port.
//!
//! Needs root (network namespaces).

mod common;

use std::time::Duration;

use common::netns::{link, proxy_in, Netns};
use common::*;

const BOUND: Duration = Duration::from_secs(30);

const BACKENDS: &str = "
apiVersion: v1
kind: Service
metadata: {name: cart, namespace: shop}
spec: {clusterIP: 10.96.70.1, ports: [{name: http, port: 8080}]}
---
apiVersion: v1
kind: Service
metadata: {name: cart-v2, namespace: shop}
spec: {clusterIP: 10.96.70.2, ports: [{name: http, port: 8080}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: cart-1, namespace: shop, labels: {kubernetes.io/service-name: cart}}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints: [{addresses: [10.221.1.2], conditions: {ready: true}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: cart-v2-1, namespace: shop, labels: {kubernetes.io/service-name: cart-v2}}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints: [{addresses: [10.221.1.3], conditions: {ready: true}}]
";

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

#[tokio::test]
async fn a_gateway_routes_splits_redirects_rewrites_and_edits_headers() {
    let tag = std::process::id() % 100_000;
    let gateway_ns = Netns::create(&format!("gai{tag}"));
    let mut backend_ns = Netns::create(&format!("gab{tag}"));
    link(
        None,
        &format!("gai{tag}h"),
        "10.221.11.1/30",
        &gateway_ns,
        "ctl",
        "10.221.11.2/30",
    );
    link(
        Some(&gateway_ns),
        "data",
        "10.221.1.1/24",
        &backend_ns,
        "data",
        "10.221.1.2/24",
    );
    backend_ns.run("ip", &["addr", "add", "10.221.1.3/24", "dev", "data"]);
    backend_ns.serve_http_echo(8080);

    let dir = tempfile::tempdir().unwrap();
    let cluster = dir.path().join("clusters/c1");
    std::fs::create_dir_all(&cluster).unwrap();
    std::fs::create_dir_all(dir.path().join("config")).unwrap();
    std::fs::write(cluster.join("backends.yaml"), BACKENDS).unwrap();
    std::fs::write(dir.path().join("config/routes.yaml"), ROUTES).unwrap();
    let mp = start_meshpilot(dir.path(), &["--xds-addr", "0.0.0.0:0"]).await;
    let gateway = proxy_in(
        &mp,
        &gateway_ns,
        "router~10.221.1.1~web-7c9d-1.shop~shop.svc.cluster.local",
        &[("gateway.networking.k8s.io/gateway-name", "web")],
        "web-istio",
        ("10.221.11.2", "10.221.11.1"),
    )
    .await;

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

    // Another host of the listener's wildcard matches no route; one outside it no listener host.
    assert_eq!(curl(&url("/"), &["host: other.example.com"]).0, 404);

    let (_, _, body) = curl(&url("/"), &[host, "x-version: v2"]);
    assert_eq!(body["server"], "10.221.1.3", "the header match");

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
