//! Security policy with real traffic: Envoy sidecars in network namespaces (Istio-style iptables
//! capture, meshpilot-issued certificates) on one switched network, and clients without a sidecar.
//! PeerAuthentication modes (STRICT, PERMISSIVE, port-level DISABLE with auto mTLS following it),
//! AuthorizationPolicy (DENY by principal, ALLOW by path, a TCP port, a namespace rule across
//! clusters), RequestAuthentication with keys meshpilot fetches (late, rotated), and CUSTOM
//! authorization through an ext_authz provider. Policies change by file while traffic is checked.
//! Needs root (network namespaces, iptables).

mod common;

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use common::jwt::{jwks, JwksServer, SigningKey};
use common::netns::{link, plug, Netns};
use common::*;

const BOUND: Duration = Duration::from_secs(30);
/// The applications' uid: only their traffic is captured (Envoy's own is not).
const APP_UID: &str = "1000";
const WEB: &str = "web.shop.svc.cluster.local";

/// A switched network of workloads, each in its own namespace with a control link to the host
/// (xDS, SDS, Envoy's admin) and a data link to the switch at `10.<net>.100.<n>`.
struct Lab {
    net: u8,
    tag: String,
    lan: Netns,
    next: u8,
}

/// One workload's namespace and addresses.
struct Host {
    ns: Netns,
    /// On the switch.
    ip: String,
    /// The namespace's end of its control link, and the host's.
    ctl: IpAddr,
    host: IpAddr,
}

impl Lab {
    fn new(name: &str, net: u8) -> Lab {
        let tag = format!("{name}{}", std::process::id() % 10_000);
        let lan = Netns::create(&format!("{tag}l"));
        lan.bridge("br0");
        Lab {
            net,
            tag,
            lan,
            next: 1,
        }
    }

    fn host(&mut self, capture: bool) -> Host {
        let n = self.next;
        self.next += 1;
        let ns = Netns::create(&format!("{}w{n}", self.tag));
        let (host, ctl) = (
            format!("10.{}.{n}.1", self.net),
            format!("10.{}.{n}.2", self.net),
        );
        link(
            None,
            &format!("{}h{n}", self.tag),
            &format!("{host}/30"),
            &ns,
            "ctl",
            &format!("{ctl}/30"),
        );
        let ip = format!("10.{}.100.{n}", self.net);
        plug(&self.lan, "br0", &ns, "data", &format!("{ip}/24"));
        ns.run("ip", &["route", "add", "10.96.0.0/16", "dev", "data"]);
        if capture {
            ns.capture_outbound(APP_UID);
            ns.capture_inbound("data");
        }
        Host {
            ns,
            ip,
            ctl: ctl.parse().expect("an address"),
            host: host.parse().expect("an address"),
        }
    }
}

/// A sidecar for `host` as pod `<pod>.<namespace>` with `account` and `labels`, in `cluster`.
async fn sidecar(
    mp: &meshpilot::app::Running,
    host: &Host,
    pod: &str,
    namespace: &str,
    account: &str,
    cluster: &str,
    labels: &[(&str, &str)],
) -> Envoy {
    let node_id = format!(
        "sidecar~{}~{pod}.{namespace}~{namespace}.svc.cluster.local",
        host.ip
    );
    let metadata = [("CLUSTER_ID", cluster)];
    let envoy = Envoy::start_with(EnvoyOptions {
        xds: SocketAddr::new(host.host, mp.xds_addr.port()),
        replicas: &[],
        node_id: &node_id,
        metadata: &metadata,
        labels,
        mode: AdsMode::Sotw,
        workload: workload_certs(mp, namespace, account),
        xds_tls: None,
        netns: Some(InNetns {
            name: host.ns.name.clone(),
            ip: host.ctl,
            host_ip: host.host,
        }),
    })
    .await;
    wait_for("the sidecar's listeners", BOUND, || {
        let envoy = &envoy;
        async move {
            let listeners = envoy.get("/listeners").await;
            listeners.contains("virtualInbound").then_some(())
        }
    })
    .await;
    envoy
}

/// The web service (HTTP on 8080 and 9090, TCP on 9000) and its pod at `ip`.
fn web(ip: &str, with_pod: bool) -> String {
    let service = "
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  clusterIP: 10.96.50.50
  ports: [{name: http, port: 8080}, {name: http-alt, port: 9090}, {name: tcp-echo, port: 9000}]
";
    if !with_pod {
        return service.to_string();
    }
    format!(
        "{service}---
apiVersion: v1
kind: Pod
metadata: {{name: web, namespace: shop, labels: {{app: web, security.istio.io/tlsMode: istio}}}}
spec: {{serviceAccountName: web, containers: []}}
status: {{podIP: {ip}}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: web-1, namespace: shop, labels: {{kubernetes.io/service-name: web}}}}
addressType: IPv4
ports: [{{name: http, port: 8080}}, {{name: http-alt, port: 9090}}, {{name: tcp-echo, port: 9000}}]
endpoints:
- addresses: [{ip}]
  conditions: {{ready: true}}
  targetRef: {{kind: Pod, name: web, namespace: shop}}
"
    )
}

fn pod(name: &str, namespace: &str, ip: &str) -> String {
    format!(
        "
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {namespace}, labels: {{app: {name}, security.istio.io/tlsMode: istio}}}}
spec: {{serviceAccountName: {name}, containers: []}}
status: {{podIP: {ip}}}
"
    )
}

/// Writes `yaml` as the config file `name` (replacing what it said before).
fn apply(dir: &Path, name: &str, yaml: &str) {
    let config = dir.join("config");
    std::fs::create_dir_all(&config).expect("config dir");
    write_atomic(&config.join(name), yaml);
}

/// Writes a cluster's manifests (and makes the watched config directory, empty).
fn write_cluster(dir: &Path, cluster: &str, yaml: &str) {
    std::fs::create_dir_all(dir.join("config")).expect("config dir");
    let path = dir.join("clusters").join(cluster);
    std::fs::create_dir_all(&path).expect("cluster dir");
    std::fs::write(path.join("workloads.yaml"), yaml).expect("write manifests");
}

/// Waits until `curl` from `from` (as the application when `captured`) gets `want`.
async fn expect(from: &Host, captured: bool, args: &[&str], want: u16, what: &str) {
    let uid = captured.then_some(APP_UID);
    let mut last = 0;
    let found = tokio::time::timeout(BOUND, async {
        loop {
            last = from.ns.curl(uid, args);
            if last == want {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    assert!(found.is_ok(), "{what}: wanted {want}, last got {last}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_authentication_modes_with_a_sidecar_and_a_plain_client() {
    let mut lab = Lab::new("mpa", 221);
    let mut server = lab.host(true);
    let client = lab.host(true);
    let plain = lab.host(false);
    server.ns.serve_http_echo(8080);
    server.ns.serve_http_echo(9090);

    let dir = tempfile::tempdir().unwrap();
    write_cluster(
        dir.path(),
        "c1",
        &format!(
            "{}---{}",
            web(&server.ip, true),
            pod("client", "shop", &client.ip)
        ),
    );
    let mp = start_meshpilot(dir.path(), &["--xds-addr", "0.0.0.0:0"]).await;
    let server_envoy = sidecar(&mp, &server, "web", "shop", "web", "c1", &[("app", "web")]).await;
    let client_envoy = sidecar(
        &mp,
        &client,
        "client",
        "shop",
        "client",
        "c1",
        &[("app", "client")],
    )
    .await;

    let via_sidecar = |port: u16| format!("http://10.96.50.50:{port}/");
    let direct = |port: u16| format!("http://{}:{port}/", server.ip);
    let (s8080, s9090) = (via_sidecar(8080), via_sidecar(9090));
    let (d8080, d9090) = (direct(8080), direct(9090));

    // No policy: PERMISSIVE, as Istio's default.
    expect(
        &client,
        true,
        &[&s8080],
        200,
        "PERMISSIVE: the sidecar client",
    )
    .await;
    expect(
        &plain,
        false,
        &[&d8080],
        200,
        "PERMISSIVE: the plain client",
    )
    .await;

    apply(
        dir.path(),
        "mtls.yaml",
        "
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: default, namespace: shop}
spec: {mtls: {mode: STRICT}}
",
    );
    expect(
        &plain,
        false,
        &[&d8080],
        0,
        "STRICT: the plain client is refused",
    )
    .await;
    expect(&client, true, &[&s8080], 200, "STRICT: the sidecar client").await;
    assert_eq!(plain.ns.curl(None, &[&d9090]), 0, "STRICT on every port");

    // A workload policy: STRICT, but plaintext on 9090 only.
    apply(
        dir.path(),
        "web-mtls.yaml",
        "
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: web, namespace: shop}
spec:
  selector: {matchLabels: {app: web}}
  mtls: {mode: UNSET}
  portLevelMtls: {9090: {mode: DISABLE}}
",
    );
    expect(
        &plain,
        false,
        &[&d9090],
        200,
        "port-level DISABLE lets plaintext through",
    )
    .await;
    assert_eq!(plain.ns.curl(None, &[&d8080]), 0, "8080 inherits STRICT");
    // The sidecar client follows: plaintext to 9090 (no TLS handshake), mTLS to 8080.
    expect(
        &client,
        true,
        &[&s9090],
        200,
        "the sidecar client on the DISABLE port",
    )
    .await;
    expect(
        &client,
        true,
        &[&s8080],
        200,
        "the sidecar client on the STRICT port",
    )
    .await;
    let tls_to_9090 = client_envoy
        .stat(&format!("cluster.outbound|9090||{WEB}.ssl.handshake"))
        .await
        .unwrap_or(0);
    let tls_to_8080 = client_envoy
        .counter(&format!("cluster.outbound|8080||{WEB}.ssl.handshake"))
        .await;
    assert!(tls_to_8080 >= 1, "mTLS to the STRICT port");
    let plain_9090 = client_envoy
        .counter(&format!("cluster.outbound|9090||{WEB}.upstream_cx_total"))
        .await;
    assert!(
        plain_9090 >= 1 && tls_to_9090 < plain_9090,
        "plaintext to the DISABLE port: {tls_to_9090} handshakes, {plain_9090} connections"
    );

    std::fs::remove_file(dir.path().join("config/mtls.yaml")).unwrap();
    std::fs::remove_file(dir.path().join("config/web-mtls.yaml")).unwrap();
    expect(&plain, false, &[&d8080], 200, "back to PERMISSIVE").await;
    assert_eq!(
        client_envoy.rejected_updates().await + server_envoy.rejected_updates().await,
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authorization_policies_deny_allow_tcp_and_namespaces_across_clusters() {
    let mut lab = Lab::new("mpz", 222);
    let mut server = lab.host(true);
    let a = lab.host(true);
    let b = lab.host(true);
    server.ns.serve_http_echo(8080);
    server.ns.serve_http_echo(9000);

    let dir = tempfile::tempdir().unwrap();
    // The service lives in both clusters; `b` is a pod of the second one, in another namespace.
    write_cluster(
        dir.path(),
        "c1",
        &format!("{}---{}", web(&server.ip, true), pod("a", "shop", &a.ip)),
    );
    write_cluster(
        dir.path(),
        "c2",
        &format!("{}---{}", web("", false), pod("b", "front", &b.ip)),
    );
    let mp = start_meshpilot(
        dir.path(),
        &["--xds-addr", "0.0.0.0:0", "--debounce-after", "20ms"],
    )
    .await;
    let server_envoy = sidecar(&mp, &server, "web", "shop", "web", "c1", &[("app", "web")]).await;
    let a_envoy = sidecar(&mp, &a, "a", "shop", "a", "c1", &[("app", "a")]).await;
    let b_envoy = sidecar(&mp, &b, "b", "front", "b", "c2", &[("app", "b")]).await;

    let http = |path: &str| format!("http://10.96.50.50:8080{path}");
    let tcp = "http://10.96.50.50:9000/".to_string();
    let (root, allowed, other) = (http("/"), http("/allowed"), http("/other"));
    expect(&a, true, &[&root], 200, "no policy: a").await;
    expect(
        &b,
        true,
        &[&root],
        200,
        "no policy: b from the other cluster",
    )
    .await;
    expect(&a, true, &[&tcp], 200, "no policy: TCP").await;

    let policy = |spec: &str| {
        format!(
            "
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {{name: web, namespace: shop}}
spec:
  selector: {{matchLabels: {{app: web}}}}
{spec}"
        )
    };
    apply(
        dir.path(),
        "authz.yaml",
        &policy("  action: DENY\n  rules: [{from: [{source: {principals: [cluster.local/ns/shop/sa/a]}}]}]\n"),
    );
    expect(&a, true, &[&root], 403, "DENY a's principal").await;
    assert_eq!(b.ns.curl(Some(APP_UID), &[&root]), 200, "b is not denied");

    apply(
        dir.path(),
        "authz.yaml",
        &policy("  action: DENY\n  rules: [{to: [{operation: {ports: ['9000']}}]}]\n"),
    );
    expect(&a, true, &[&root], 200, "a TCP port policy leaves HTTP").await;
    assert_eq!(
        a.ns.curl(Some(APP_UID), &[&tcp]),
        0,
        "and closes the connection"
    );
    let denied = server_envoy.counter("tcp.rbac.denied").await;
    assert!(denied >= 1, "the network RBAC filter denied it");

    apply(
        dir.path(),
        "authz.yaml",
        &policy("  rules: [{to: [{operation: {paths: [/allowed]}}]}]\n"),
    );
    expect(&a, true, &[&other], 403, "ALLOW on a path denies the rest").await;
    assert_eq!(
        a.ns.curl(Some(APP_UID), &[&allowed]),
        200,
        "and allows the path"
    );
    assert_eq!(b.ns.curl(Some(APP_UID), &[&allowed]), 200, "to anyone");

    apply(
        dir.path(),
        "authz.yaml",
        &policy("  rules: [{from: [{source: {namespaces: [front]}}]}]\n"),
    );
    // b is in the other cluster: its namespace comes from its certificate.
    expect(&b, true, &[&root], 200, "a namespace rule allows front's b").await;
    assert_eq!(a.ns.curl(Some(APP_UID), &[&root]), 403, "shop is not front");
    let rejected = server_envoy.rejected_updates().await
        + a_envoy.rejected_updates().await
        + b_envoy.rejected_updates().await;
    assert_eq!(rejected, 0);
}

/// An ext_authz HTTP service: allows requests carrying `x-ext-authz: allow`, denies the others.
async fn ext_authz_server(ip: IpAddr) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind((ip, 0))
        .await
        .expect("bind ext_authz");
    let addr = listener.local_addr().expect("bound address");
    let app = axum::Router::new().fallback(|headers: axum::http::HeaderMap| async move {
        match headers.get("x-ext-authz").map(|v| v.as_bytes()) {
            Some(b"allow") => axum::http::StatusCode::OK,
            _ => axum::http::StatusCode::FORBIDDEN,
        }
    });
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (addr, task)
}

// Several threads: the key and ext_authz servers answer while a test thread waits for curl.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jwt_from_fetched_keys_and_custom_authorization() {
    let mut lab = Lab::new("mpj", 223);
    let mut server = lab.host(true);
    let plain = lab.host(false);
    server.ns.serve_http_echo(8080);
    let (authz_addr, authz_task) = ext_authz_server(server.host).await;

    let dir = tempfile::tempdir().unwrap();
    let ext_authz = format!(
        "
apiVersion: v1
kind: Service
metadata: {{name: ext-authz, namespace: shop}}
spec: {{clusterIP: 10.96.50.60, ports: [{{name: http, port: 8000}}]}}
---
apiVersion: v1
kind: Pod
metadata: {{name: ext-authz, namespace: shop, labels: {{app: ext-authz}}}}
spec: {{serviceAccountName: ext-authz, containers: []}}
status: {{podIP: {ip}}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: ext-authz-1, namespace: shop, labels: {{kubernetes.io/service-name: ext-authz}}}}
addressType: IPv4
ports: [{{name: http, port: {port}}}]
endpoints:
- addresses: [{ip}]
  conditions: {{ready: true}}
  targetRef: {{kind: Pod, name: ext-authz, namespace: shop}}
",
        ip = authz_addr.ip(),
        port = authz_addr.port()
    );
    write_cluster(
        dir.path(),
        "c1",
        &format!("{}---{ext_authz}", web(&server.ip, true)),
    );
    let mesh = dir.path().join("mesh.yaml");
    std::fs::write(
        &mesh,
        "extensionProviders:\n- name: ext\n  envoyExtAuthzHttp:\n    service: ext-authz.shop.svc.cluster.local\n    port: 8000\n    includeRequestHeadersInCheck: [x-ext-authz]\n",
    )
    .unwrap();
    // The key server's port is chosen now, but it starts only later: the keys are unreachable first.
    let keys_addr = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap()
    };
    let uri = format!("http://{keys_addr}/keys.json");
    let issuer = "https://issuer.test";
    apply(
        dir.path(),
        "jwt.yaml",
        &format!(
            "
apiVersion: security.istio.io/v1
kind: RequestAuthentication
metadata: {{name: web, namespace: shop}}
spec:
  selector: {{matchLabels: {{app: web}}}}
  jwtRules: [{{issuer: '{issuer}', jwksUri: '{uri}'}}]
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {{name: require-jwt, namespace: shop}}
spec:
  selector: {{matchLabels: {{app: web}}}}
  rules: [{{from: [{{source: {{requestPrincipals: ['{issuer}/alice']}}}}]}}]
"
        ),
    );
    let mp = start_meshpilot(
        dir.path(),
        &[
            "--xds-addr",
            "0.0.0.0:0",
            "--mesh-config",
            mesh.to_str().unwrap(),
            "--jwks-refresh-interval",
            "2s",
        ],
    )
    .await;
    let server_envoy = sidecar(&mp, &server, "web", "shop", "web", "c1", &[("app", "web")]).await;

    let key = SigningKey::generate("k1");
    let wrong = SigningKey::generate("k1");
    let url = format!("http://{}:8080/", server.ip);
    let bearer = |token: String| format!("Authorization: Bearer {token}");
    let (alice, forged) = (
        bearer(key.token(issuer, "alice")),
        bearer(wrong.token(issuer, "alice")),
    );

    // Unreachable keys: a clear status, a listener that loads, every token refused.
    let status = wait_for(
        "the key source's failure on /debug/jwksz",
        BOUND,
        || async {
            let view = get_json(mp.http_addr, "/debug/jwksz").await;
            let entry = view.as_array()?.first()?.clone();
            (entry["status"] == "failed").then_some(entry)
        },
    )
    .await;
    assert!(
        status["error"].as_str().unwrap_or_default().contains(&uri),
        "{status}"
    );
    expect(
        &plain,
        false,
        &["-H", &alice, &url],
        401,
        "no keys yet: the token fails",
    )
    .await;

    let jwks_server = JwksServer::start(keys_addr, jwks(&[&key])).await;
    expect(
        &plain,
        false,
        &["-H", &alice, &url],
        200,
        "the keys arrive: a valid token",
    )
    .await;
    assert_eq!(
        plain.ns.curl(None, &["-H", &forged, &url]),
        401,
        "a token signed by another key"
    );
    assert_eq!(
        plain.ns.curl(None, &[&url]),
        403,
        "no token: authentication passes, the policy requiring a principal denies (Istio's 403)"
    );
    let bob = bearer(key.token(issuer, "bob"));
    assert_eq!(
        plain.ns.curl(None, &["-H", &bob, &url]),
        403,
        "another principal"
    );

    // Rotation: the server's new key is fetched on refresh.
    let rotated = SigningKey::generate("k2");
    jwks_server.set(jwks(&[&rotated]));
    let fresh = bearer(rotated.token(issuer, "alice"));
    expect(
        &plain,
        false,
        &["-H", &fresh, &url],
        200,
        "the rotated key after a refresh",
    )
    .await;
    assert!(jwks_server.hits() >= 2);

    // CUSTOM: the provider decides the paths its rule names.
    std::fs::remove_file(dir.path().join("config/jwt.yaml")).unwrap();
    apply(
        dir.path(),
        "custom.yaml",
        "
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: ext, namespace: shop}
spec:
  selector: {matchLabels: {app: web}}
  action: CUSTOM
  provider: {name: ext}
  rules: [{to: [{operation: {paths: ['/ext/*']}}]}]
",
    );
    let checked = format!("http://{}:8080/ext/a", server.ip);
    expect(
        &plain,
        false,
        &[&url],
        200,
        "paths CUSTOM does not name pass",
    )
    .await;
    assert_eq!(plain.ns.curl(None, &[&checked]), 403, "the provider denies");
    let allow = ["-H", "x-ext-authz: allow", &checked];
    assert_eq!(plain.ns.curl(None, &allow), 200, "the provider allows");
    assert_eq!(server_envoy.rejected_updates().await, 0);
    authz_task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidecar_ingress_port_reaches_the_app_where_its_default_endpoint_says() {
    let mut lab = Lab::new("mpi", 224);
    let mut server = lab.host(true);
    let client = lab.host(true);
    // The application listens on 8081; the service says 8080.
    server.ns.serve_http_echo(8081);
    let dir = tempfile::tempdir().unwrap();
    write_cluster(
        dir.path(),
        "c1",
        &format!(
            "{}---{}",
            web(&server.ip, true),
            pod("client", "shop", &client.ip)
        ),
    );
    let mp = start_meshpilot(dir.path(), &["--xds-addr", "0.0.0.0:0"]).await;
    let _server = sidecar(&mp, &server, "web", "shop", "web", "c1", &[("app", "web")]).await;
    let _client = sidecar(
        &mp,
        &client,
        "client",
        "shop",
        "client",
        "c1",
        &[("app", "client")],
    )
    .await;
    let url = "http://10.96.50.50:8080/";
    expect(
        &client,
        true,
        &[url],
        503,
        "the service's port, nothing listening",
    )
    .await;

    apply(
        dir.path(),
        "ingress.yaml",
        "
apiVersion: networking.istio.io/v1
kind: Sidecar
metadata: {name: web, namespace: shop}
spec:
  workloadSelector: {labels: {app: web}}
  ingress:
  - port: {number: 8080, protocol: HTTP, name: http}
    defaultEndpoint: 127.0.0.1:8081
",
    );
    expect(
        &client,
        true,
        &[url],
        200,
        "through the Sidecar's ingress port",
    )
    .await;
}
