//! EnvoyFilters as proxies receive them, decoded from raw ADS responses: patches of every target
//! (listeners, listener and network and HTTP filters, route configurations, virtual hosts,
//! routes, clusters) in istiod's order (priority, then the root namespace's), selected by
//! workload labels and proxy version; refused when invalid, with the last good version still
//! applied; a patch that cannot apply reported on `/debug/configz` and `/metrics`.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::config_source::{ConfigFixture, Source};
use common::*;
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::listener::v3::{filter, Listener};
use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::HttpConnectionManager;
use prost::Message;

const BOUND: Duration = Duration::from_secs(10);
const LDS: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const RDS: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
const REVIEWS_ID: &str = "sidecar~10.1.1.11~reviews-v1-7f9c8d.bookinfo~bookinfo.svc.cluster.local";
const PRODUCTPAGE_ID: &str =
    "sidecar~10.1.1.30~productpage-v1-6b746f.bookinfo~bookinfo.svc.cluster.local";
const PRODUCTPAGE_CLUSTER: &str = "outbound|9080||productpage.bookinfo.svc.cluster.local";
const REVIEWS_CLUSTER: &str = "outbound|9080||reviews.bookinfo.svc.cluster.local";

fn lua(name: &str) -> String {
    format!(
        "{{name: {name}, typed_config: {{'@type': type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua, defaultSourceCode: {{inlineString: 'function envoy_on_request(h) end'}}}}}}"
    )
}

/// The root namespace's: for every proxy.
fn root_filter() -> String {
    format!(
        "
apiVersion: networking.istio.io/v1alpha3
kind: EnvoyFilter
metadata: {{name: mesh-wide, namespace: istio-system}}
spec:
  configPatches:
  - applyTo: CLUSTER
    match: {{context: SIDECAR_OUTBOUND, cluster: {{service: reviews.bookinfo.svc.cluster.local, portNumber: 9080}}}}
    patch:
      operation: MERGE
      value: {{per_connection_buffer_limit_bytes: 1024, circuit_breakers: {{thresholds: [{{max_connections: 77}}]}}}}
  - applyTo: CLUSTER
    patch:
      operation: ADD
      value:
        name: extra-cluster
        type: STATIC
        connect_timeout: 1s
        load_assignment:
          cluster_name: extra-cluster
          endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: 10.9.9.9, port_value: 80}}}}}}}}]}}]
  - applyTo: LISTENER
    match: {{context: SIDECAR_OUTBOUND}}
    patch:
      operation: ADD
      value:
        name: extra-listener
        address: {{socket_address: {{address: 0.0.0.0, port_value: 19000}}}}
        filter_chains:
        - filters:
          - name: envoy.filters.network.tcp_proxy
            typed_config: {{'@type': type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy, stat_prefix: extra, cluster: extra-cluster}}
  - applyTo: HTTP_FILTER
    match:
      context: SIDECAR_INBOUND
      listener: {{filterChain: {{filter: {{name: envoy.filters.network.http_connection_manager, subFilter: {{name: envoy.filters.http.router}}}}}}}}
    patch: {{operation: INSERT_BEFORE, value: {root}}}
",
        root = lua("lua-root")
    )
}

/// reviews' own, applied before the root's (a lower priority).
fn reviews_filter() -> String {
    format!(
        "
apiVersion: networking.istio.io/v1alpha3
kind: EnvoyFilter
metadata: {{name: reviews, namespace: bookinfo}}
spec:
  workloadSelector: {{labels: {{app: reviews}}}}
  priority: -1
  configPatches:
  - applyTo: HTTP_FILTER
    match:
      context: SIDECAR_INBOUND
      listener: {{filterChain: {{filter: {{name: envoy.filters.network.http_connection_manager, subFilter: {{name: envoy.filters.http.router}}}}}}}}
    patch: {{operation: INSERT_BEFORE, value: {own}}}
  - applyTo: NETWORK_FILTER
    match: {{context: SIDECAR_OUTBOUND, listener: {{portNumber: 9080}}}}
    patch:
      operation: INSERT_FIRST
      value:
        name: envoy.filters.network.local_ratelimit
        typed_config:
          '@type': type.googleapis.com/envoy.extensions.filters.network.local_ratelimit.v3.LocalRateLimit
          stat_prefix: reviews
          token_bucket: {{max_tokens: 100, fill_interval: 1s}}
  - applyTo: ROUTE_CONFIGURATION
    match: {{context: SIDECAR_OUTBOUND, routeConfiguration: {{portNumber: 9080}}}}
    patch: {{operation: MERGE, value: {{request_headers_to_add: [{{header: {{key: x-patched, value: 'yes'}}}}]}}}}
  - applyTo: VIRTUAL_HOST
    match: {{context: SIDECAR_OUTBOUND, routeConfiguration: {{portNumber: 9080}}}}
    patch:
      operation: ADD
      value: {{name: extra-vhost, domains: [extra.example.com], routes: [{{match: {{prefix: /}}, direct_response: {{status: 200}}}}]}}
  - applyTo: HTTP_ROUTE
    match:
      context: SIDECAR_OUTBOUND
      routeConfiguration: {{portNumber: 9080, vhost: {{name: 'reviews.bookinfo.svc.cluster.local:9080'}}}}
    patch:
      operation: INSERT_FIRST
      value: {{name: health, match: {{path: /healthz}}, direct_response: {{status: 204}}}}
",
        own = lua("lua-reviews")
    )
}

/// Only for Istio 1.24 and later proxies: productpage's cluster goes; only for proxies whose
/// metadata says `TIER: canary`, the black hole goes too.
const BY_PROXY: &str = "
apiVersion: networking.istio.io/v1alpha3
kind: EnvoyFilter
metadata: {name: by-proxy, namespace: bookinfo}
spec:
  priority: 10
  configPatches:
  - applyTo: CLUSTER
    match:
      proxy: {proxyVersion: '^1\\.(2[4-9]|[3-9][0-9])'}
      cluster: {name: 'outbound|9080||productpage.bookinfo.svc.cluster.local'}
    patch: {operation: REMOVE}
  - applyTo: CLUSTER
    match:
      proxy: {metadata: {TIER: canary}}
      cluster: {name: BlackHoleCluster}
    patch: {operation: REMOVE}
";

/// The resources of one type a bookinfo proxy is sent, by name.
async fn fetch<T: Message + Default>(
    f: &ConfigFixture,
    id: &str,
    app: &str,
    version: &str,
    type_url: &str,
    names: &[&str],
    name: impl Fn(&T) -> String,
) -> BTreeMap<String, T> {
    fetch_with(
        f,
        id,
        app,
        &[("ISTIO_VERSION", version)],
        type_url,
        names,
        name,
    )
    .await
}

/// As `fetch`, with this node metadata (an empty value leaves the key out).
async fn fetch_with<T: Message + Default>(
    f: &ConfigFixture,
    id: &str,
    app: &str,
    metadata: &[(&str, &str)],
    type_url: &str,
    names: &[&str],
    name: impl Fn(&T) -> String,
) -> BTreeMap<String, T> {
    let mut meta = vec![("CLUSTER_ID", "cluster1")];
    meta.extend(metadata.iter().filter(|(_, v)| !v.is_empty()));
    let node = labelled_node(id, &meta, &[("app", app)]);
    let all: Vec<T> = common::ads::fetch(f.mp.xds_addr, node, type_url, names).await;
    all.into_iter().map(|r| (name(&r), r)).collect()
}

async fn clusters(
    f: &ConfigFixture,
    id: &str,
    app: &str,
    version: &str,
) -> BTreeMap<String, Cluster> {
    fetch(f, id, app, version, CDS, &[], |c: &Cluster| c.name.clone()).await
}

async fn listeners(f: &ConfigFixture, id: &str, app: &str) -> BTreeMap<String, Listener> {
    fetch(f, id, app, "1.26.0", LDS, &[], |l: &Listener| {
        l.name.clone()
    })
    .await
}

/// The connection managers of a listener.
fn managers(listener: &Listener) -> Vec<HttpConnectionManager> {
    listener
        .filter_chains
        .iter()
        .flat_map(|c| &c.filters)
        .filter_map(|f| match &f.config_type {
            Some(filter::ConfigType::TypedConfig(any))
                if f.name == "envoy.filters.network.http_connection_manager" =>
            {
                Some(HttpConnectionManager::decode(&any.value[..]).expect("an HCM"))
            }
            _ => None,
        })
        .collect()
}

fn http_filter_names(hcm: &HttpConnectionManager) -> Vec<String> {
    hcm.http_filters.iter().map(|f| f.name.clone()).collect()
}

async fn every_target_patched_in_order(source: Source) {
    let config = [
        ("root.yaml", root_filter()),
        ("reviews.yaml", reviews_filter()),
        ("by-proxy.yaml", BY_PROXY.to_string()),
    ];
    let config: Vec<(&str, &str)> = config.iter().map(|(n, t)| (*n, t.as_str())).collect();
    let f = ConfigFixture::start(source, &config, &["--debounce-after", "0s"]).await;

    // Clusters: merged (the list appended to), added, removed for a matching proxy version.
    let reviews = clusters(&f, REVIEWS_ID, "reviews", "1.26.0").await;
    let merged = &reviews[REVIEWS_CLUSTER];
    assert_eq!(
        merged
            .per_connection_buffer_limit_bytes
            .as_ref()
            .map(|v| v.value),
        Some(1024)
    );
    let thresholds = &merged.circuit_breakers.as_ref().unwrap().thresholds;
    assert_eq!(
        thresholds
            .last()
            .and_then(|t| t.max_connections.as_ref())
            .map(|v| v.value),
        Some(77),
        "{thresholds:?}"
    );
    assert!(reviews.contains_key("extra-cluster"));
    assert!(
        !reviews.contains_key(PRODUCTPAGE_CLUSTER),
        "removed for 1.26"
    );
    for old in ["1.23.2", ""] {
        let older = clusters(&f, REVIEWS_ID, "reviews", old).await;
        assert!(older.contains_key(PRODUCTPAGE_CLUSTER), "kept for {old:?}");
    }
    let canary: BTreeMap<String, Cluster> = fetch_with(
        &f,
        REVIEWS_ID,
        "reviews",
        &[("TIER", "canary")],
        CDS,
        &[],
        |c: &Cluster| c.name.clone(),
    )
    .await;
    assert!(
        !canary.contains_key("BlackHoleCluster"),
        "removed by metadata"
    );
    assert!(reviews.contains_key("BlackHoleCluster"));
    // productpage has the root's patches only; the unpatched cluster of another proxy is not
    // shared with the patched one.
    let productpage = clusters(&f, PRODUCTPAGE_ID, "productpage", "").await;
    assert!(productpage.contains_key("extra-cluster"));
    assert_eq!(
        productpage[REVIEWS_CLUSTER]
            .per_connection_buffer_limit_bytes
            .as_ref()
            .map(|v| v.value),
        Some(1024)
    );

    // Listeners: one added; HTTP filters in priority order, the namespace's (-1) before the
    // root's; a network filter first on the 9080 listener.
    let reviews = listeners(&f, REVIEWS_ID, "reviews").await;
    assert!(reviews.contains_key("extra-listener"));
    let inbound = managers(&reviews["virtualInbound"]);
    assert!(!inbound.is_empty());
    for hcm in &inbound {
        let names = http_filter_names(hcm);
        assert_eq!(
            names[names.len() - 3..],
            ["lua-reviews", "lua-root", "envoy.filters.http.router"],
            "{names:?}"
        );
    }
    let port = &reviews["0.0.0.0_9080"];
    for chain in &port.filter_chains {
        assert_eq!(
            chain.filters[0].name, "envoy.filters.network.local_ratelimit",
            "{chain:?}"
        );
    }
    let productpage = listeners(&f, PRODUCTPAGE_ID, "productpage").await;
    for hcm in managers(&productpage["virtualInbound"]) {
        let names = http_filter_names(&hcm);
        assert!(!names.contains(&"lua-reviews".to_string()), "{names:?}");
        assert!(names.contains(&"lua-root".to_string()), "{names:?}");
    }

    // Routes: merged, a virtual host added, a route inserted first.
    let routes: BTreeMap<String, RouteConfiguration> = fetch(
        &f,
        REVIEWS_ID,
        "reviews",
        "1.26.0",
        RDS,
        &["9080"],
        |r: &RouteConfiguration| r.name.clone(),
    )
    .await;
    let config = &routes["9080"];
    assert!(config
        .request_headers_to_add
        .iter()
        .any(|h| h.header.as_ref().is_some_and(|h| h.key == "x-patched")));
    assert!(config.virtual_hosts.iter().any(|h| h.name == "extra-vhost"));
    let host = config
        .virtual_hosts
        .iter()
        .find(|h| h.name == "reviews.bookinfo.svc.cluster.local:9080")
        .expect("reviews' virtual host");
    assert_eq!(host.routes[0].name, "health");

    // An invalid new version is refused, naming the field; the last good one still applies.
    f.apply(
        "root.yaml",
        &root_filter().replace(
            "per_connection_buffer_limit_bytes",
            "per_connection_buffer_limit",
        ),
    );
    let refusal = wait_for("the refusal", BOUND, || async {
        let configz = get_json(f.mp.http_addr, "/debug/configz").await;
        configz.as_array()?.iter().find_map(|o| {
            (o["status"] == "refused" && o["kind"] == "EnvoyFilter").then(|| o["error"].clone())
        })
    })
    .await;
    let error = refusal.as_str().unwrap_or_default();
    assert!(
        error.contains("configPatches[0].patch.value")
            && error.contains("per_connection_buffer_limit"),
        "{error}"
    );
    let reviews = clusters(&f, REVIEWS_ID, "reviews", "1.26.0").await;
    assert!(
        reviews.contains_key("extra-cluster"),
        "last good version applies"
    );
}

from_both_sources!(
    every_target_patched_in_order,
    every_target_patched_in_order_from_files,
    every_target_patched_in_order_from_the_config_cluster
);

/// A patch that cannot apply to what was generated (a config of another type merged into the
/// router) is skipped and reported; the proxy keeps everything else.
#[tokio::test]
async fn a_patch_that_cannot_apply_is_reported() {
    let mismatched = format!(
        "
apiVersion: networking.istio.io/v1alpha3
kind: EnvoyFilter
metadata: {{name: mismatched, namespace: bookinfo}}
spec:
  configPatches:
  - applyTo: HTTP_FILTER
    match:
      context: SIDECAR_INBOUND
      listener: {{filterChain: {{filter: {{name: envoy.filters.network.http_connection_manager, subFilter: {{name: envoy.filters.http.router}}}}}}}}
    patch: {{operation: MERGE, value: {lua}}}
  - applyTo: CLUSTER
    patch: {{operation: ADD, value: {{name: still-added, type: STATIC, connect_timeout: 1s}}}}
",
        lua = lua("envoy.filters.http.router")
    );
    let f = ConfigFixture::start(
        Source::Files,
        &[("mismatched.yaml", &mismatched)],
        &["--debounce-after", "0s"],
    )
    .await;
    let reviews = listeners(&f, REVIEWS_ID, "reviews").await;
    for hcm in managers(&reviews["virtualInbound"]) {
        assert_eq!(
            http_filter_names(&hcm).last().map(String::as_str),
            Some("envoy.filters.http.router")
        );
    }
    let clusters = clusters(&f, REVIEWS_ID, "reviews", "").await;
    assert!(clusters.contains_key("still-added"));

    let configz = get_json(f.mp.http_addr, "/debug/configz").await;
    let object = configz
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["kind"] == "EnvoyFilter" && o["metadata"]["name"] == "mismatched")
        .expect("the EnvoyFilter")
        .clone();
    let failure = &object["patchFailures"][0];
    assert_eq!(failure["patch"], 0, "{object}");
    assert_eq!(failure["resource"], "virtualInbound", "{object}");
    assert!(
        failure["error"].as_str().unwrap().contains("cannot merge"),
        "{object}"
    );
    let (_, metrics) = http_get(f.mp.http_addr, "/metrics").await.unwrap();
    assert!(
        metrics.contains(
            "pilot_envoy_filter_status{name=\"bookinfo/mismatched\",patch=\"httpfilter\",result=\"error\"} 1"
        ),
        "{metrics}"
    );
}
