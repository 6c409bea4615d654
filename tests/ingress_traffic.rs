//! Kubernetes Ingress with real traffic: the config cluster is the test API server, the ingress
//! gateway a real Envoy (labelled `istio: ingressgateway`, in istio-system) in its own network
//! namespace, plain backends behind it. An Ingress of Istio's IngressClass routes by host and
//! path (Exact, Prefix by whole segments, ImplementationSpecific), sends the rest to its default
//! backend, and serves HTTPS by SNI with the certificate of the Secret it names.
//!
//! Needs root (network namespaces).

mod common;

use std::time::Duration;

use common::gateway_certs::{issue, tls_secret};
use common::netns::{link, proxy_in, Netns};
use common::*;
use test_apiserver::TestApiServer;

const BOUND: Duration = Duration::from_secs(30);

/// The gateway's Service account may read istio-system's Secrets (SDS asks the API server).
const SYSTEM: &str = "
apiVersion: v1
kind: Namespace
metadata: {name: istio-system}
---
apiVersion: v1
kind: Namespace
metadata: {name: shop}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: secret-reader, namespace: istio-system}
rules: [{apiGroups: [''], resources: [secrets], verbs: [get, watch, list]}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: gateway-reads-secrets, namespace: istio-system}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: secret-reader}
subjects: [{kind: ServiceAccount, name: istio-ingressgateway-service-account, namespace: istio-system}]
---
apiVersion: networking.k8s.io/v1
kind: IngressClass
metadata: {name: istio}
spec: {controller: istio.io/ingress-controller}
";

/// As istiod reads `secretName`: a Secret of the gateway's namespace.
const INGRESS: &str = "
apiVersion: networking.k8s.io/v1
kind: Ingress
metadata: {name: shop, namespace: shop}
spec:
  ingressClassName: istio
  defaultBackend: {service: {name: web, port: {number: 8080}}}
  tls: [{hosts: [shop.example.com], secretName: shop-cert}]
  rules:
  - host: shop.example.com
    http:
      paths:
      - {path: /api, pathType: Prefix, backend: {service: {name: api, port: {name: http}}}}
      - {path: /api/login, pathType: Exact, backend: {service: {name: web, port: {number: 8080}}}}
      - {path: /static/*, pathType: ImplementationSpecific,
         backend: {service: {name: api, port: {number: 8080}}}}
  - host: api.example.com
    http:
      paths: [{path: /, pathType: Prefix, backend: {service: {name: api, port: {number: 8080}}}}]
";

/// curl from the host: (HTTP status, the echo's answer).
fn curl(args: &[&str]) -> (u16, serde_json::Value) {
    let output = std::process::Command::new("curl")
        .args(["-s", "-m", "3", "-w", "\n%{http_code}"])
        .args(args)
        .output()
        .expect("curl runs");
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    let (body, status) = text.rsplit_once('\n').unwrap_or(("", &text));
    let body = serde_json::from_str(body).unwrap_or(serde_json::Value::Null);
    (status.trim().parse().unwrap_or(0), body)
}

/// Which backend answered `path` on port 80 for `host` (None: no 200).
fn served_by(host: &str, path: &str) -> Option<String> {
    let host = format!("host: {host}");
    let (status, body) = curl(&["-H", &host, &format!("http://10.231.11.2{path}")]);
    (status == 200).then(|| body["server"].as_str().unwrap_or_default().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ingress_routes_real_traffic_by_host_and_path_and_serves_its_tls_secret() {
    let tag = format!("{}i", std::process::id() % 100_000);
    let gateway_ns = Netns::create(&format!("igi{tag}"));
    let mut backend_ns = Netns::create(&format!("igb{tag}"));
    link(
        None,
        &format!("igi{tag}h"),
        "10.231.11.1/30",
        &gateway_ns,
        "ctl",
        "10.231.11.2/30",
    );
    link(
        Some(&gateway_ns),
        "data",
        "10.231.1.1/24",
        &backend_ns,
        "data",
        "10.231.1.2/24",
    );
    backend_ns.run("ip", &["addr", "add", "10.231.1.3/24", "dev", "data"]);
    backend_ns.serve_http_echo(8080);

    let api = TestApiServer::start().await;
    api.apply_yaml(SYSTEM);
    api.apply_yaml(&service_yaml(
        "shop",
        "web",
        "10.96.61.1",
        ("http", 8080),
        &["10.231.1.2"],
    ));
    api.apply_yaml(&service_yaml(
        "shop",
        "api",
        "10.96.61.2",
        ("http", 8080),
        &["10.231.1.3"],
    ));
    let cert = issue("shop.example.com");
    api.apply_yaml(&tls_secret("istio-system", "shop-cert", &cert.1, &cert.2));
    api.apply_yaml(INGRESS);
    let kubeconfig = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(kubeconfig.path(), api.kubeconfig(api.admin_token())).unwrap();
    let kubeconfig_path = kubeconfig.path().to_str().unwrap();
    let mp = start_meshpilot_with(&[
        "--kubeconfig",
        kubeconfig_path,
        "--cluster-id",
        "c1",
        "--xds-addr",
        "0.0.0.0:0",
        "--secure-xds-addr",
        "0.0.0.0:0",
    ])
    .await;
    let gateway = proxy_in(
        &mp,
        &gateway_ns,
        "router~10.231.1.1~istio-ingressgateway-1.istio-system~istio-system.svc.cluster.local",
        &[("istio", "ingressgateway")],
        "istio-ingressgateway-service-account",
        ("10.231.11.2", "10.231.11.1"),
        true,
    )
    .await;

    let (web, api_server) = ("10.231.1.2", "10.231.1.3");
    wait_for("an answer through the ingress gateway", BOUND, || async {
        served_by("shop.example.com", "/api/items").filter(|s| s == api_server)
    })
    .await;
    let cases = [
        ("shop.example.com", "/api", api_server, "Prefix"),
        (
            "shop.example.com",
            "/api/login",
            web,
            "Exact, before the shorter prefix",
        ),
        (
            "shop.example.com",
            "/apis",
            web,
            "a prefix matches whole segments",
        ),
        (
            "shop.example.com",
            "/static/logo.png",
            api_server,
            "ImplementationSpecific /static/*",
        ),
        (
            "shop.example.com",
            "/",
            web,
            "the default backend, on the Ingress's host",
        ),
        ("api.example.com", "/anything", api_server, "by host"),
        (
            "elsewhere.example.org",
            "/",
            web,
            "the default backend, on any host",
        ),
    ];
    for (host, path, server, why) in cases {
        assert_eq!(
            served_by(host, path).as_deref(),
            Some(server),
            "{host}{path}: {why}"
        );
    }

    // HTTPS by SNI with the Ingress's Secret: the certificate verifies against its CA.
    let ca = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(ca.path(), &cert.0).unwrap();
    let ca_path = ca.path().to_str().unwrap();
    let https = |path: &str| {
        curl(&[
            "--cacert",
            ca_path,
            "--resolve",
            "shop.example.com:443:10.231.11.2",
            &format!("https://shop.example.com{path}"),
        ])
    };
    let body = wait_for("HTTPS with the Ingress's certificate", BOUND, || async {
        let (status, body) = https("/api/orders");
        (status == 200).then_some(body)
    })
    .await;
    assert_eq!(body["server"], api_server);
    assert_eq!(https("/api/login").1["server"], web);
    assert_eq!(gateway.rejected_updates().await, 0);
}
