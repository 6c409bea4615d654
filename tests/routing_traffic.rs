//! A real sidecar's routing with real traffic: an application behind an Istio-style captured
//! sidecar calls a service with two versions; the sidecar splits 90/10 across subsets, routes a
//! header to v2, injects faults, retries, and times out, as the VirtualService says; writes access
//! logs and spans as Telemetry says; follows a mesh HTTPRoute; runs the Lua filters EnvoyFilters
//! add. Needs root (network namespaces, iptables).

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::netns::{client_sidecar, link, Netns};
use common::*;

const BOUND: Duration = Duration::from_secs(30);
const APP_UID: &str = "1000";
const V1: &str = "10.217.3.2";
const V2: &str = "10.217.3.3";
const VIP: &str = "10.96.55.55:8080";
const HOST: &str = "reviews.default.svc.cluster.local";

fn cluster() -> String {
    format!(
        "
apiVersion: v1
kind: Service
metadata: {{name: reviews, namespace: default}}
spec: {{clusterIP: 10.96.55.55, ports: [{{name: http, port: 8080}}]}}
---
apiVersion: v1
kind: Pod
metadata: {{name: reviews-v1, namespace: default, labels: {{app: reviews, version: v1}}}}
spec: {{serviceAccountName: reviews, containers: []}}
status: {{podIP: {V1}}}
---
apiVersion: v1
kind: Pod
metadata: {{name: reviews-v2, namespace: default, labels: {{app: reviews, version: v2}}}}
spec: {{serviceAccountName: reviews, containers: []}}
status: {{podIP: {V2}}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: reviews-1, namespace: default, labels: {{kubernetes.io/service-name: reviews}}}}
addressType: IPv4
ports: [{{name: http, port: 8080}}]
endpoints:
- {{addresses: [{V1}], conditions: {{ready: true}}, targetRef: {{kind: Pod, name: reviews-v1, namespace: default}}}}
- {{addresses: [{V2}], conditions: {{ready: true}}, targetRef: {{kind: Pod, name: reviews-v2, namespace: default}}}}
---
apiVersion: v1
kind: Service
metadata: {{name: zipkin, namespace: istio-system}}
spec: {{clusterIP: 10.96.9.11, ports: [{{name: http-zipkin, port: 9411}}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: zipkin-1, namespace: istio-system, labels: {{kubernetes.io/service-name: zipkin}}}}
addressType: IPv4
ports: [{{name: http-zipkin, port: 9411}}]
endpoints: [{{addresses: [{V1}], conditions: {{ready: true}}}}]
"
    )
}

const CONFIG: &str = "
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {name: reviews, namespace: default}
spec:
  host: reviews
  subsets:
  - {name: v1, labels: {version: v1}}
  - {name: v2, labels: {version: v2}}
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: reviews, namespace: default}
spec:
  hosts: [reviews]
  http:
  - match: [{headers: {end-user: {exact: jason}}}]
    route: [{destination: {host: reviews, subset: v2}}]
  - match: [{uri: {prefix: /fault}}]
    fault: {abort: {httpStatus: 418, percentage: {value: 50}}}
    route: [{destination: {host: reviews, subset: v1}}]
  - match: [{uri: {prefix: /retry}}]
    retries: {attempts: 3, retryOn: 5xx}
    route: [{destination: {host: reviews, subset: v1}}]
  - match: [{uri: {prefix: /old/}}]
    rewrite: {uriRegexRewrite: {match: '^/old/(.*)$', rewrite: '/new/\\1'}}
    route: [{destination: {host: reviews, subset: v1}}]
  - match: [{uri: {prefix: /mirrored}}]
    mirrors: [{destination: {host: reviews, subset: v2}}]
    route: [{destination: {host: reviews, subset: v1}}]
  - match: [{uri: {prefix: /slow}}]
    timeout: 300ms
    route: [{destination: {host: reviews, subset: v1}}]
  - route:
    - {destination: {host: reviews, subset: v1}, weight: 90}
    - {destination: {host: reviews, subset: v2}, weight: 10}
";

/// One response as the load client reports it.
#[derive(serde::Deserialize)]
struct Answer {
    status: u16,
    path: Option<String>,
    server: Option<String>,
    /// The request headers the backend saw.
    seen: BTreeMap<String, String>,
    /// The response's headers.
    headers: BTreeMap<String, String>,
}

/// The application's requests (as its own user, so the sidecar captures them).
fn requests(client: &Netns, path: &str, count: usize, headers: &[&str]) -> Vec<Answer> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/peers/http_load.py");
    let output = client
        .command("setpriv")
        .args(["--reuid", APP_UID, "--regid", APP_UID, "--clear-groups"])
        // A Python the application's user may run (the peers' venv lives under root's home).
        .args([
            "/usr/bin/python3",
            script,
            VIP,
            HOST,
            path,
            &count.to_string(),
        ])
        .args(headers)
        .output()
        .expect("the load client runs");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let answers: Vec<Answer> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert_eq!(answers.len(), count);
    answers
}

fn by_server(answers: &[Answer]) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for a in answers {
        *out.entry(
            a.server
                .clone()
                .unwrap_or_else(|| format!("status {}", a.status)),
        )
        .or_default() += 1;
    }
    out
}

/// A client application behind its captured sidecar (in `default` of cluster c1) and the two
/// versions of `reviews`, with `config` as the Istio config and `mesh` as the mesh config file.
/// Fields drop in order: the sidecar, meshpilot, then the namespaces.
struct Routed {
    envoy: Envoy,
    mp: meshpilot::app::Running,
    dir: tempfile::TempDir,
    backend: Netns,
    client: Netns,
    _ports: tokio::sync::MutexGuard<'static, ()>,
}

impl Routed {
    async fn start(tag: &str, config: &str, mesh: &str) -> Routed {
        let ports = sidecar_ports().await;
        let tag = format!("{tag}{}", std::process::id() % 100_000);
        let client = Netns::create(&format!("{tag}c"));
        let mut backend = Netns::create(&format!("{tag}b"));
        link(
            None,
            &format!("{tag}h"),
            "10.217.1.1/30",
            &client,
            "ctl",
            "10.217.1.2/30",
        );
        link(
            Some(&client),
            "data",
            "10.217.3.1/24",
            &backend,
            "data",
            &format!("{V1}/24"),
        );
        backend.run("ip", &["addr", "add", &format!("{V2}/24"), "dev", "data"]);
        client.run("ip", &["route", "add", "10.96.0.0/16", "dev", "data"]);
        client.capture_outbound(APP_UID);
        backend.serve_http_echo(8080);

        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("clusters/c1")).unwrap();
        std::fs::create_dir_all(dir.path().join("config")).unwrap();
        std::fs::write(dir.path().join("clusters/c1/reviews.yaml"), cluster()).unwrap();
        std::fs::write(dir.path().join("config/reviews.yaml"), config).unwrap();
        let mesh_file = dir.path().join("mesh.yaml");
        std::fs::write(&mesh_file, mesh).unwrap();
        let flags = [
            "--xds-addr",
            "0.0.0.0:0",
            "--mesh-config",
            mesh_file.to_str().unwrap(),
        ];
        let mp = start_meshpilot(dir.path(), &flags).await;
        let envoy = client_sidecar(&mp, &client, "10.217.3.1", "10.217.1.2", "10.217.1.1").await;
        wait_for("both subsets in the sidecar", BOUND, || {
            let envoy = &envoy;
            async move {
                let v1 = envoy.endpoints(&format!("outbound|8080|v1|{HOST}")).await;
                let v2 = envoy.endpoints(&format!("outbound|8080|v2|{HOST}")).await;
                (v1 == [format!("{V1}:8080")] && v2 == [format!("{V2}:8080")]).then_some(())
            }
        })
        .await;
        let routed = Routed {
            envoy,
            mp,
            dir,
            backend,
            client,
            _ports: ports,
        };
        wait_for("the routes in the sidecar", BOUND, || {
            let ok = requests(&routed.client, "/", 1, &[])[0].status == 200;
            async move { ok.then_some(()) }
        })
        .await;
        routed
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn virtual_service_routes_real_traffic() {
    let routed = Routed::start("mpr", CONFIG, "").await;
    let (client, envoy) = (&routed.client, &routed.envoy);

    // 90/10 over 1,000 requests: v2's share within ±5 points of 10 %.
    let split = by_server(&requests(client, "/", 1000, &[]));
    let v2_share = *split.get(V2).unwrap_or(&0) as f64 / 10.0;
    assert!(
        (5.0..=15.0).contains(&v2_share)
            && split.get(V1).copied().unwrap_or(0) + split.get(V2).copied().unwrap_or(0) == 1000,
        "split {split:?}"
    );

    // The header sends everything to v2.
    let jason = by_server(&requests(client, "/", 50, &["end-user:jason"]));
    assert_eq!(jason, BTreeMap::from([(V2.to_string(), 50)]), "{jason:?}");

    // A 50 % abort answers about half with the configured status.
    let faults = requests(client, "/fault", 400, &[]);
    let aborted = faults.iter().filter(|a| a.status == 418).count();
    let served = faults.iter().filter(|a| a.status == 200).count();
    assert_eq!(aborted + served, 400);
    assert!((140..=260).contains(&aborted), "{aborted} of 400 aborted");

    // Retries: one request that keeps failing reaches the backend 1 + 3 times.
    let retried = requests(client, "/retry?status=503", 1, &[]);
    assert_eq!(retried[0].status, 503);
    let counts = requests_counts(client);
    assert_eq!(counts.get("/retry"), Some(&4), "{counts:?}");

    // The timeout fires: a 2 s backend answer is cut (Envoy answers 504 for its route timeout).
    let slow = requests(client, "/slow?delay=2", 1, &[]);
    assert_eq!(slow[0].status, 504);

    // A regex rewrite reaches the backend as the new path.
    let rewritten = requests(client, "/old/page", 1, &[]);
    assert_eq!(rewritten[0].path.as_deref(), Some("/new/page"));

    // Every mirrored request reaches the backend twice: served by v1, copied to v2.
    requests(client, "/mirrored", 3, &[]);
    wait_for("the mirrored copies", BOUND, || {
        let counts = requests_counts(client);
        async move { (counts.get("/mirrored") == Some(&6)).then_some(()) }
    })
    .await;

    assert_eq!(envoy.rejected_updates().await, 0);
}

/// The backend's request counts per path, read directly (not through the sidecar).
fn requests_counts(client: &Netns) -> BTreeMap<String, u64> {
    let output = client
        .command("curl")
        .args(["-s", &format!("http://{V1}:8080/_counts")])
        .output()
        .expect("curl runs");
    serde_json::from_slice(&output.stdout).expect("counts JSON")
}

/// Access logs as Istio users configure them, written by the real sidecar: the mesh config's file
/// in Istio's text format, then its JSON format; a Telemetry for the namespace sending errors
/// only to a provider's file; one disabling logging; its removal bringing the mesh config's back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_logs_follow_the_mesh_config_and_telemetry() {
    let logs = tempfile::tempdir().unwrap();
    let (text_log, errors_log) = (
        logs.path().join("access.log"),
        logs.path().join("errors.log"),
    );
    let mesh = |encoding: &str| {
        format!(
            "accessLogFile: {}\naccessLogEncoding: {encoding}\nextensionProviders:\n- name: errors\n  envoyFileAccessLog:\n    path: {}\n    logFormat: {{labels: {{path: '%REQ(:PATH)%', code: '%RESPONSE_CODE%'}}}}\n",
            text_log.display(),
            errors_log.display()
        )
    };
    let routed = Routed::start("mpl", CONFIG, &mesh("TEXT")).await;
    let client = &routed.client;
    let lines = |path: &std::path::Path| -> Vec<String> {
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    };
    let logged = |path: &std::path::Path, what: &str| {
        let path = path.to_path_buf();
        let what = what.to_string();
        move || {
            let line = lines(&path).into_iter().find(|l| l.contains(&what));
            async move { line }
        }
    };

    // Istio's default text format.
    requests(client, "/one", 1, &[]);
    let line = wait_for("the text line", BOUND, logged(&text_log, "/one")).await;
    assert!(line.starts_with('['), "{line}");
    for part in [
        "\"GET /one HTTP/1.1\" 200 - via_upstream",
        "\"10.217.3.",
        ":8080\" outbound|8080|v",
        &format!("\"{HOST}\""),
    ] {
        assert!(line.contains(part), "{part} in {line}");
    }

    // The mesh config turns to JSON: Istio's keys.
    let mesh_file = routed.dir.path().join("mesh.yaml");
    write_atomic(&mesh_file, &mesh("JSON"));
    let line = wait_for("a JSON line", BOUND, || {
        requests(client, "/two", 1, &[]);
        let line = lines(&text_log)
            .into_iter()
            .find(|l| l.contains("\"/two\""));
        async move { line }
    })
    .await;
    let entry: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(entry["response_code"], 200, "{entry}");
    let cluster = entry["upstream_cluster"].as_str().unwrap_or_default();
    assert!(
        cluster.starts_with("outbound|8080|v") && cluster.ends_with(HOST),
        "{entry}"
    );
    assert_eq!(entry.as_object().unwrap().len(), 24, "{entry}");

    // A Telemetry for the namespace: errors only, to the provider's own file and format.
    let telemetry = routed.dir.path().join("config/telemetry.yaml");
    write_atomic(
        &telemetry,
        "apiVersion: telemetry.istio.io/v1\nkind: Telemetry\nmetadata: {name: errors, namespace: default}\nspec:\n  accessLogging:\n  - providers: [{name: errors}]\n    filter: {expression: 'response.code >= 500'}\n",
    );
    let line = wait_for("the error logged by the provider", BOUND, || {
        requests(client, "/ok", 1, &[]);
        requests(client, "/bad?status=503", 1, &[]);
        let line = lines(&errors_log).into_iter().find(|l| l.contains("/bad"));
        async move { line }
    })
    .await;
    let entry: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(entry["code"], 503, "{entry}");
    // Same file, written in order: the successful request before it was filtered out.
    assert!(!lines(&errors_log).iter().any(|l| l.contains("/ok")));

    // Disabled for the namespace: nothing is logged, until the Telemetry goes.
    write_atomic(
        &telemetry,
        "apiVersion: telemetry.istio.io/v1\nkind: Telemetry\nmetadata: {name: errors, namespace: default}\nspec:\n  accessLogging: [{disabled: true}]\n",
    );
    wait_for("no access log in the sidecar", BOUND, || {
        let envoy = &routed.envoy;
        async move {
            // Listeners being replaced drain with their old config: only the active ones count.
            let dump: serde_json::Value =
                serde_json::from_str(&envoy.get("/config_dump").await).unwrap();
            let active: Vec<String> = dump["configs"]
                .as_array()
                .into_iter()
                .flatten()
                .flat_map(|c| {
                    c["dynamic_listeners"]
                        .as_array()
                        .cloned()
                        .unwrap_or_default()
                })
                .map(|l| l["active_state"].to_string())
                .collect();
            let logging = active
                .iter()
                .any(|l| l.contains("envoy.access_loggers.file"));
            (!active.is_empty() && !logging).then_some(())
        }
    })
    .await;
    requests(client, "/quiet", 1, &[]);
    std::fs::remove_file(&telemetry).unwrap();
    wait_for("the mesh config's log back", BOUND, || {
        requests(client, "/back", 1, &[]);
        let back = lines(&text_log).iter().any(|l| l.contains("\"/back\""));
        async move { back.then_some(()) }
    })
    .await;
    assert!(!lines(&text_log).iter().any(|l| l.contains("/quiet")));
    assert!(!lines(&errors_log).iter().any(|l| l.contains("/quiet")));
    assert_eq!(routed.envoy.rejected_updates().await, 0);
    drop(routed.mp);
}

/// Spans as Istio users ask for them, sent by the real sidecar to a Zipkin collector of the mesh:
/// the root namespace's Telemetry names the mesh config's `zipkin` provider, samples everything
/// and adds tags; each span carries them and Istio's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_the_telemetry_s_zipkin_provider() {
    let mesh = "extensionProviders:\n- name: zipkin\n  zipkin: {service: zipkin.istio-system.svc.cluster.local, port: 9411}\n";
    let telemetry = "
apiVersion: telemetry.istio.io/v1
kind: Telemetry
metadata: {name: mesh-default, namespace: istio-system}
spec:
  tracing:
  - providers: [{name: zipkin}]
    randomSamplingPercentage: 100
    customTags:
      team: {literal: {value: payments}}
      user: {header: {name: x-user, defaultValue: nobody}}
";
    let mut routed = Routed::start("mpt", &format!("{CONFIG}---{telemetry}"), mesh).await;
    routed.backend.serve_zipkin(9411);
    let client = &routed.client;
    let span = wait_for("a span at the collector", BOUND, || {
        requests(client, "/traced", 1, &["x-user:alice"]);
        let output = client
            .command("curl")
            .args(["-s", &format!("http://{V1}:9411/spans")])
            .output()
            .expect("curl runs");
        let spans: Vec<serde_json::Value> =
            serde_json::from_slice(&output.stdout).unwrap_or_default();
        let span = spans.into_iter().find(|s| {
            s["tags"]["http.url"]
                .as_str()
                .is_some_and(|u| u.contains("/traced"))
        });
        async move { span }
    })
    .await;
    let tags = &span["tags"];
    assert_eq!(tags["team"], "payments", "{span}");
    assert_eq!(tags["user"], "alice", "{span}");
    assert_eq!(tags["istio.namespace"], "default", "{span}");
    assert_eq!(tags["istio.cluster_id"], "c1", "{span}");
    assert_eq!(tags["istio.canonical_service"], "unknown", "{span}");
    assert_eq!(span["kind"], "CLIENT", "{span}");
    assert_eq!(routed.envoy.rejected_updates().await, 0);
}

/// OpenTelemetry as Istio users set it up: the namespace's Telemetry names the mesh config's
/// `opentelemetry` provider; the real sidecar exports its spans over OTLP/gRPC to a collector
/// speaking the collector's own protos, with the sampling, custom tags and service name asked for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_the_telemetry_s_opentelemetry_collector() {
    let mesh = "extensionProviders:\n- name: otel\n  opentelemetry: {service: otel-collector.istio-system.svc.cluster.local, port: 4317}\n";
    let telemetry = "
apiVersion: telemetry.istio.io/v1
kind: Telemetry
metadata: {name: traced, namespace: default}
spec:
  tracing:
  - providers: [{name: otel}]
    randomSamplingPercentage: 100
    customTags:
      tier: {literal: {value: gold}}
      user: {header: {name: x-user, defaultValue: nobody}}
";
    let mut routed = Routed::start("mpo", &format!("{CONFIG}---{telemetry}"), mesh).await;
    let spans = routed.dir.path().join("spans.jsonl");
    routed.backend.serve_otel(4317, &spans);
    let collector = service_yaml(
        "istio-system",
        "otel-collector",
        "10.96.9.12",
        ("grpc-otlp", 4317),
        &[V1],
    );
    write_atomic(&routed.dir.path().join("clusters/c1/otel.yaml"), &collector);
    let client = &routed.client;
    let span = wait_for("a span at the collector", BOUND, || {
        requests(client, "/exported", 1, &["x-user:bob"]);
        let text = std::fs::read_to_string(&spans).unwrap_or_default();
        let span = text
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|s| {
                s["attributes"]["http.url"]
                    .as_str()
                    .is_some_and(|u| u.contains("/exported"))
            });
        async move { span }
    })
    .await;
    let tags = &span["attributes"];
    assert_eq!(tags["tier"], "gold", "{span}");
    assert_eq!(tags["user"], "bob", "{span}");
    assert_eq!(tags["istio.namespace"], "default", "{span}");
    assert_eq!(tags["istio.cluster_id"], "c1", "{span}");
    // The proxy's service cluster names the service (the node's `cluster`), as istiod sets it.
    assert_eq!(span["service"], "test", "{span}");
    assert_eq!(span["kind"], 3, "a client span: {span}");
    assert_eq!(routed.envoy.rejected_updates().await, 0);
}

/// An EnvoyFilter adding a Lua filter before the router of every outbound connection manager:
/// it appends `letter` to the request's `x-order` header and marks the response `x-lua-<letter>`.
fn lua_filter(namespace: &str, name: &str, priority: i32, letter: &str) -> String {
    format!(
        r#"
apiVersion: networking.istio.io/v1alpha3
kind: EnvoyFilter
metadata: {{name: {name}, namespace: {namespace}}}
spec:
  priority: {priority}
  configPatches:
  - applyTo: HTTP_FILTER
    match:
      context: SIDECAR_OUTBOUND
      listener:
        filterChain:
          filter:
            name: envoy.filters.network.http_connection_manager
            subFilter: {{name: envoy.filters.http.router}}
    patch:
      operation: INSERT_BEFORE
      value: {value}
"#,
        value = lua_value(name, letter)
    )
}

/// A Lua HTTP filter named `name` (the value of a patch), as JSON.
fn lua_value(name: &str, letter: &str) -> String {
    let code = format!(
        "function envoy_on_request(h) local v = h:headers():get('x-order') or ''; h:headers():replace('x-order', v .. '{letter}') end\n\
         function envoy_on_response(h) h:headers():add('x-lua-{letter}', '1') end"
    );
    serde_json::json!({
        "name": name,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
            "defaultSourceCode": {"inlineString": code},
        }
    })
    .to_string()
}

/// `x-order` as the backend saw it on one request, once it has `len` letters.
async fn order(client: &Netns, len: usize) -> String {
    wait_for(&format!("{len} Lua filters on the request"), BOUND, || {
        let answer = requests(client, "/lua", 1, &[]).remove(0);
        let order = answer.seen.get("x-order").cloned().unwrap_or_default();
        async move { (order.len() == len).then_some(order) }
    })
    .await
}

/// EnvoyFilters on a real sidecar: Lua filters inserted in priority order change real requests
/// and responses; a REMOVE and a REPLACE of them; a cluster MERGE changing connection settings
/// (Envoy's config dump); an invalid new version refused while the proxy keeps its last good
/// config.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_filters_patch_a_real_sidecar() {
    let routed = Routed::start("mpe", CONFIG, "").await;
    let (client, envoy) = (&routed.client, &routed.envoy);
    let config = routed.dir.path().join("config");

    // The namespace's filter (priority -1) is placed before the root namespace's (0).
    let filters = [
        lua_filter("istio-system", "root-lua", 0, "r"),
        lua_filter("default", "ns-lua", -1, "n"),
    ];
    write_atomic(&config.join("lua.yaml"), &filters.join("---"));
    assert_eq!(order(client, 2).await, "nr");
    let answer = requests(client, "/lua", 1, &[]).remove(0);
    assert_eq!(answer.headers.get("x-lua-r").map(String::as_str), Some("1"));
    assert_eq!(answer.status, 200);

    // A later EnvoyFilter removes the namespace's Lua filter and replaces the root's.
    let edits = format!(
        r#"
apiVersion: networking.istio.io/v1alpha3
kind: EnvoyFilter
metadata: {{name: edits, namespace: default}}
spec:
  priority: 10
  configPatches:
  - applyTo: HTTP_FILTER
    match:
      context: SIDECAR_OUTBOUND
      listener: {{filterChain: {{filter: {{name: envoy.filters.network.http_connection_manager, subFilter: {{name: ns-lua}}}}}}}}
    patch: {{operation: REMOVE}}
  - applyTo: HTTP_FILTER
    match:
      context: SIDECAR_OUTBOUND
      listener: {{filterChain: {{filter: {{name: envoy.filters.network.http_connection_manager, subFilter: {{name: root-lua}}}}}}}}
    patch: {{operation: REPLACE, value: {replacement}}}
  - applyTo: CLUSTER
    match: {{context: SIDECAR_OUTBOUND, cluster: {{service: {HOST}, portNumber: 8080, subset: v1}}}}
    patch:
      operation: MERGE
      value: {{per_connection_buffer_limit_bytes: 32768, circuit_breakers: {{thresholds: [{{max_connections: 7}}]}}}}
"#,
        replacement = lua_value("root-lua", "z")
    );
    write_atomic(&config.join("edits.yaml"), &edits);
    assert_eq!(order(client, 1).await, "z");

    let v1 = format!("outbound|8080|v1|{HOST}");
    let cluster = wait_for("the merged cluster in Envoy", BOUND, || async {
        let dump: serde_json::Value = serde_json::from_str(
            &envoy
                .get("/config_dump?resource=dynamic_active_clusters")
                .await,
        )
        .ok()?;
        let cluster = dump["configs"]
            .as_array()?
            .iter()
            .map(|c| &c["cluster"])
            .find(|c| c["name"] == v1.as_str())?
            .clone();
        (cluster["per_connection_buffer_limit_bytes"] == 32768).then_some(cluster)
    })
    .await;
    let thresholds = cluster["circuit_breakers"]["thresholds"]
        .as_array()
        .unwrap();
    assert!(
        thresholds.iter().any(|t| t["max_connections"] == 7),
        "{cluster}"
    );

    // A misspelt field in a new version is refused: the last good version stays in force.
    write_atomic(
        &config.join("edits.yaml"),
        &edits.replace(
            "per_connection_buffer_limit_bytes",
            "per_connection_buffer_limits",
        ),
    );
    wait_for("the refusal", BOUND, || async {
        let configz = get_json(routed.mp.http_addr, "/debug/configz").await;
        configz.as_array()?.iter().find_map(|o| {
            let refused = o["status"] == "refused"
                && o["error"]
                    .as_str()?
                    .contains("per_connection_buffer_limits");
            refused.then_some(())
        })
    })
    .await;
    assert_eq!(requests(client, "/lua", 1, &[])[0].seen["x-order"], "z");
    assert_eq!(envoy.rejected_updates().await, 0);
}

/// A proxy-wasm filter (ABI 0.2.1): marks each request and response `x-wasm: ran`.
const HEADERS_WAT: &str = r#"
(module
  (import "env" "proxy_add_header_map_value"
    (func $add (param i32 i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 2)
  (data (i32.const 16) "x-wasm")
  (data (i32.const 32) "ran")
  (global $heap (mut i32) (i32.const 1024))
  (func (export "proxy_abi_version_0_2_1"))
  (func (export "proxy_on_memory_allocate") (param $size i32) (result i32)
    (local $at i32)
    (local.set $at (global.get $heap))
    (global.set $heap (i32.add (global.get $heap) (local.get $size)))
    (local.get $at))
  (func (export "proxy_on_context_create") (param i32 i32))
  (func (export "proxy_on_vm_start") (param i32 i32) (result i32) (i32.const 1))
  (func (export "proxy_on_configure") (param i32 i32) (result i32) (i32.const 1))
  ;; Header maps: 0 the request's, 2 the response's; 0 is Continue.
  (func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32)
    (drop (call $add (i32.const 0) (i32.const 16) (i32.const 6) (i32.const 32) (i32.const 3)))
    (i32.const 0))
  (func (export "proxy_on_response_headers") (param i32 i32 i32) (result i32)
    (drop (call $add (i32.const 2) (i32.const 16) (i32.const 6) (i32.const 32) (i32.const 3)))
    (i32.const 0))
  (func (export "proxy_on_done") (param i32) (result i32) (i32.const 1))
  (func (export "proxy_on_log") (param i32))
  (func (export "proxy_on_delete") (param i32)))
"#;

/// A WasmPlugin run by a real sidecar: its filter's config discovered over ECDS, its module (a
/// local file, which Envoy loads without Istio's agent) changing real requests and responses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wasm_plugin_runs_in_a_real_sidecar() {
    let routed = Routed::start("mpw", CONFIG, "").await;
    let module = routed.dir.path().join("headers.wasm");
    std::fs::write(
        &module,
        wat::parse_str(HEADERS_WAT).expect("the module assembles"),
    )
    .unwrap();
    let plugin = format!(
        "
apiVersion: extensions.istio.io/v1alpha1
kind: WasmPlugin
metadata: {{name: headers, namespace: default}}
spec:
  url: file://{}
  match: [{{mode: CLIENT}}]
",
        module.display()
    );
    write_atomic(&routed.dir.path().join("config/plugin.yaml"), &plugin);
    let client = &routed.client;
    let answer = wait_for("the plugin on a request", BOUND, || {
        let answer = requests(client, "/wasm", 1, &[]).remove(0);
        async move { answer.headers.contains_key("x-wasm").then_some(answer) }
    })
    .await;
    assert_eq!(answer.headers["x-wasm"], "ran");
    assert_eq!(answer.seen.get("x-wasm").map(String::as_str), Some("ran"));
    assert_eq!(answer.status, 200);
    assert_eq!(routed.envoy.rejected_updates().await, 0);
}

/// GAMMA: an HTTPRoute whose parent is the reviews Service, applied at the client's sidecar.
const MESH_ROUTE: &str = "
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {name: reviews, namespace: default}
spec:
  host: reviews
  subsets:
  - {name: v1, labels: {version: v1}}
  - {name: v2, labels: {version: v2}}
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: reviews, namespace: default}
spec:
  parentRefs: [{group: '', kind: Service, name: reviews, port: 8080}]
  rules:
  - matches: [{headers: [{name: end-user, value: tester}]}]
    backendRefs: [{name: reviews-canary, port: 8080}]
  - backendRefs: [{name: reviews, port: 8080}]
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mesh_http_route_changes_where_the_sidecars_requests_go() {
    let routed = Routed::start("mpg", MESH_ROUTE, "").await;
    // The canary: a Service of reviews' v2 address alone.
    let canary = service_yaml(
        "default",
        "reviews-canary",
        "10.96.55.56",
        ("http", 8080),
        &[V2],
    );
    write_atomic(&routed.dir.path().join("clusters/c1/canary.yaml"), &canary);
    let client = &routed.client;
    wait_for("the tester's requests at the canary", BOUND, || {
        let canary = by_server(&requests(client, "/", 20, &["end-user:tester"]));
        async move { (canary == BTreeMap::from([(V2.to_string(), 20)])).then_some(()) }
    })
    .await;
    // Everyone else still reaches both versions through the route's default rule.
    let others = by_server(&requests(client, "/", 100, &[]));
    assert!(
        others.get(V1).is_some_and(|n| *n > 10) && others.get(V2).is_some_and(|n| *n > 10),
        "{others:?}"
    );
    assert_eq!(routed.envoy.rejected_updates().await, 0);
}
