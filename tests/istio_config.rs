//! Istio config, from files and from the config cluster's API server alike: DestinationRules
//! (subsets, traffic policy), ServiceEntries and the WorkloadEntries they select, checked in the
//! decoded xDS a raw client receives; refusal of invalid objects; pushes scoped to the proxies that
//! can see a change.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use common::config_source::{ConfigFixture, Source};
use common::*;
use envoy_types::pb::envoy::config::cluster::v3::cluster::LbPolicy;
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::core::v3::{address, socket_address};
use envoy_types::pb::envoy::config::endpoint::v3::{lb_endpoint, ClusterLoadAssignment};
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use prost::Message;

const BOUND: Duration = Duration::from_secs(10);
const QUIET: Duration = Duration::from_millis(500);
const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
const REVIEWS: &str = "reviews.bookinfo.svc.cluster.local";
const SIDECAR: &str = "sidecar~10.1.1.11~reviews-v1-7f9c8d.bookinfo~bookinfo.svc.cluster.local";
const OTHER_NS: &str = "sidecar~10.5.0.5~client.other~other.svc.cluster.local";

const DESTINATION_RULE: &str = "
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {name: reviews, namespace: bookinfo}
spec:
  host: reviews
  exportTo: [.]
  trafficPolicy:
    loadBalancer: {simple: LEAST_REQUEST}
    connectionPool: {tcp: {maxConnections: 100}, http: {http1MaxPendingRequests: 10}}
    outlierDetection: {consecutive5xxErrors: 5, interval: 10s, baseEjectionTime: 30s}
  subsets:
  - {name: v1, labels: {version: v1}}
  - name: v3
    labels: {version: v3}
    trafficPolicy: {loadBalancer: {simple: RANDOM}}
";

const SERVICE_ENTRIES: &str = "
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: external-api, namespace: bookinfo}
spec:
  hosts: [api.example.com]
  addresses: [192.0.2.10]
  ports: [{number: 8443, name: tcp-api, protocol: TCP}]
  location: MESH_EXTERNAL
  resolution: STATIC
  endpoints: [{address: 192.0.2.11}, {address: 192.0.2.12, ports: {tcp-api: 9443}}]
---
apiVersion: networking.istio.io/v1beta1
kind: ServiceEntry
metadata: {name: legacy, namespace: bookinfo}
spec:
  hosts: [legacy]
  ports: [{number: 8080, name: http, protocol: HTTP}]
  location: MESH_INTERNAL
  resolution: STATIC
  workloadSelector: {labels: {app: legacy}}
---
apiVersion: networking.istio.io/v1alpha3
kind: WorkloadEntry
metadata: {name: vm-1, namespace: bookinfo}
spec:
  address: 10.9.0.1
  labels: {app: legacy, security.istio.io/tlsMode: istio}
  serviceAccount: legacy
  locality: us-east/zone-1
";

/// meshpilot's flags in every scenario here.
const FLAGS: &[&str] = &["--debounce-after", "0s"];

/// A SotW client's wildcard CDS, decoded by name (ACKed).
async fn clusters(
    ads: &mut AdsClient,
    node_id: &str,
) -> (DiscoveryResponse, BTreeMap<String, Cluster>) {
    ads.request(DiscoveryRequest {
        node: Some(node(node_id, &[("CLUSTER_ID", "cluster1")])),
        type_url: CDS.into(),
        ..Default::default()
    });
    let r = ads.response(BOUND).await;
    ads.ack(&r, vec![]);
    let decoded = decode_clusters(&r);
    (r, decoded)
}

fn decode_clusters(r: &DiscoveryResponse) -> BTreeMap<String, Cluster> {
    assert_eq!(r.type_url, CDS);
    r.resources
        .iter()
        .map(|a| Cluster::decode(&a.value[..]).expect("a Cluster"))
        .map(|c| (c.name.clone(), c))
        .collect()
}

/// Reads (and ACKs) pushes until `check` finds what it looks for, within the bound.
async fn next_push<T>(
    ads: &mut AdsClient,
    what: &str,
    mut check: impl FnMut(&DiscoveryResponse) -> Option<T>,
) -> T {
    let deadline = tokio::time::Instant::now() + BOUND;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        assert!(!left.is_zero(), "timed out waiting for {what}");
        let r = ads.response(left).await;
        let names = match r.type_url == EDS {
            true => r
                .resources
                .iter()
                .map(|a| {
                    ClusterLoadAssignment::decode(&a.value[..])
                        .unwrap()
                        .cluster_name
                })
                .collect(),
            false => vec![],
        };
        ads.ack(&r, names);
        if let Some(found) = check(&r) {
            return found;
        }
    }
}

/// The endpoints (ip:port) of each named assignment.
async fn assignments(ads: &mut AdsClient, names: &[&str]) -> BTreeMap<String, Vec<String>> {
    let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    ads.request(DiscoveryRequest {
        type_url: EDS.into(),
        resource_names: names.clone(),
        ..Default::default()
    });
    let r = ads.response(BOUND).await;
    ads.ack(&r, names);
    r.resources
        .iter()
        .map(|a| ClusterLoadAssignment::decode(&a.value[..]).expect("an assignment"))
        .map(|cla| (cla.cluster_name.clone(), addresses(&cla)))
        .collect()
}

fn addresses(cla: &ClusterLoadAssignment) -> Vec<String> {
    let mut out: Vec<String> = cla
        .endpoints
        .iter()
        .flat_map(|l| l.lb_endpoints.iter())
        .filter_map(|e| match &e.host_identifier {
            Some(lb_endpoint::HostIdentifier::Endpoint(ep)) => {
                match ep.address.as_ref()?.address.as_ref()? {
                    address::Address::SocketAddress(sa) => {
                        let port = match sa.port_specifier {
                            Some(socket_address::PortSpecifier::PortValue(p)) => p,
                            _ => 0,
                        };
                        Some(format!("{}:{port}", sa.address))
                    }
                    _ => None,
                }
            }
            _ => None,
        })
        .collect();
    out.sort();
    out
}

from_both_sources!(
    destination_rule_subsets_and_policy_reach_the_proxy,
    rule_from_files,
    rule_from_the_config_cluster
);
from_both_sources!(
    service_entries_and_selected_workload_entries,
    entries_from_files,
    entries_from_the_config_cluster
);
from_both_sources!(
    an_invalid_rule_is_refused_and_the_last_good_one_stays,
    refusal_from_files,
    refusal_from_the_config_cluster
);
from_both_sources!(
    a_rule_change_pushes_only_to_proxies_that_see_it,
    scoped_push_from_files,
    scoped_push_from_the_config_cluster
);

async fn destination_rule_subsets_and_policy_reach_the_proxy(source: Source) {
    let f = ConfigFixture::start(
        source,
        &[("nested/reviews-dr.yaml", DESTINATION_RULE)],
        FLAGS,
    )
    .await;
    let mp = &f.mp;
    let mut ads = AdsClient::connect(mp.xds_addr).await.unwrap();
    let (_, clusters) = clusters(&mut ads, SIDECAR).await;

    let v1 = format!("outbound|9080|v1|{REVIEWS}");
    let v3 = format!("outbound|9080|v3|{REVIEWS}");
    let all = format!("outbound|9080||{REVIEWS}");
    for name in [&v1, &v3, &all] {
        assert!(
            clusters.contains_key(name),
            "{name} missing: {:?}",
            clusters.keys()
        );
    }
    let base = &clusters[&all];
    assert_eq!(base.lb_policy, LbPolicy::LeastRequest as i32);
    let limits = &base.circuit_breakers.as_ref().unwrap().thresholds[0];
    assert_eq!(limits.max_connections.as_ref().unwrap().value, 100);
    assert_eq!(limits.max_pending_requests.as_ref().unwrap().value, 10);
    let outlier = base.outlier_detection.as_ref().unwrap();
    assert_eq!(outlier.consecutive_5xx.as_ref().unwrap().value, 5);
    assert_eq!(outlier.interval.as_ref().unwrap().seconds, 10);
    assert_eq!(
        clusters[&v3].lb_policy,
        LbPolicy::Random as i32,
        "the subset's own policy"
    );
    assert_eq!(
        clusters[&v1].lb_policy,
        LbPolicy::LeastRequest as i32,
        "the top-level policy"
    );
    assert!(
        !clusters[&v1].transport_socket_matches.is_empty(),
        "auto mTLS stays on without a TLS setting"
    );

    let eds = assignments(&mut ads, &[&v1, &v3, &all]).await;
    assert_eq!(
        eds[&v1],
        ["10.1.1.11:9080"],
        "v1: the labelled endpoint only"
    );
    assert_eq!(
        eds[&v3],
        ["10.2.3.13:9080"],
        "v3 lives in the other cluster"
    );
    assert_eq!(eds[&all], ["10.1.1.11:9080", "10.2.3.13:9080"]);
}

/// A ready pod in cluster2 that the `legacy` entry selects.
const LEGACY_POD: &str = "
apiVersion: v1
kind: Pod
metadata: {name: legacy-pod, namespace: bookinfo, labels: {app: legacy}}
spec: {serviceAccountName: legacy, nodeName: node-b1, containers: []}
status:
  podIP: 10.2.9.9
  conditions: [{type: Ready, status: 'True'}]
";

async fn service_entries_and_selected_workload_entries(source: Source) {
    let f = ConfigFixture::start(source, &[("entries.yaml", SERVICE_ENTRIES)], FLAGS).await;
    std::fs::write(
        f.dir.path().join("clusters/cluster2/legacy-pod.yaml"),
        LEGACY_POD,
    )
    .unwrap();
    let mp = &f.mp;
    let legacy = "outbound|8080||legacy.bookinfo.svc.cluster.local";
    wait_for(
        "the selected pod among the entry's endpoints",
        BOUND,
        || async {
            let shards = get_json(mp.http_addr, "/debug/endpointShardz").await;
            let text = shards["legacy.bookinfo.svc.cluster.local"].to_string();
            (text.contains("10.2.9.9") && text.contains("10.9.0.1")).then_some(())
        },
    )
    .await;
    let mut ads = AdsClient::connect(mp.xds_addr).await.unwrap();
    let (_, clusters) = clusters(&mut ads, SIDECAR).await;
    let api = "outbound|8443||api.example.com";
    assert!(
        clusters[api].transport_socket_matches.is_empty(),
        "no mTLS to a MESH_EXTERNAL entry"
    );
    assert!(!clusters[legacy].transport_socket_matches.is_empty());
    let eds = assignments(&mut ads, &[api, legacy]).await;
    assert_eq!(eds[api], ["192.0.2.11:8443", "192.0.2.12:9443"]);
    assert_eq!(eds[legacy], ["10.2.9.9:8080", "10.9.0.1:8080"]);

    // Another WorkloadEntry joins the selection: an endpoint push.
    f.apply(
        "vm-2.yaml",
        "apiVersion: networking.istio.io/v1\nkind: WorkloadEntry\nmetadata: {name: vm-2, namespace: bookinfo}\nspec: {address: 10.9.0.2, labels: {app: legacy}}\n",
    );
    let legacy_now = next_push(&mut ads, "the second VM in EDS", |r| {
        (r.type_url == EDS)
            .then(|| {
                r.resources
                    .iter()
                    .map(|a| ClusterLoadAssignment::decode(&a.value[..]).unwrap())
                    .find(|c| c.cluster_name == legacy)
                    .map(|c| addresses(&c))
            })
            .flatten()
    })
    .await;
    assert_eq!(
        legacy_now,
        ["10.2.9.9:8080", "10.9.0.1:8080", "10.9.0.2:8080"]
    );
}

async fn an_invalid_rule_is_refused_and_the_last_good_one_stays(source: Source) {
    let f = ConfigFixture::start(source, &[("dr.yaml", DESTINATION_RULE)], FLAGS).await;
    let mp = &f.mp;
    let broken = DESTINATION_RULE.replace("maxConnections: 100", "maxConnections: lots");
    f.apply("dr.yaml", &broken);
    let refused = wait_for("the refusal on /debug/configz", BOUND, || async {
        let configz = get_json(mp.http_addr, "/debug/configz").await;
        configz
            .as_array()?
            .iter()
            .find(|c| c["status"] == "refused")
            .cloned()
    })
    .await;
    let error = refused["error"].as_str().unwrap();
    let mut parts = vec![
        "DestinationRule bookinfo/reviews",
        "trafficPolicy.connectionPool.tcp.maxConnections",
    ];
    if let Source::Files = source {
        parts.extend(["dr.yaml", "document 1"]);
    }
    for part in parts {
        assert!(error.contains(part), "{part:?} not in {error}");
    }
    // The previous version is still served.
    let mut ads = AdsClient::connect(mp.xds_addr).await.unwrap();
    let (_, clusters) = clusters(&mut ads, SIDECAR).await;
    let base = &clusters[&format!("outbound|9080||{REVIEWS}")];
    let limits = &base.circuit_breakers.as_ref().unwrap().thresholds[0];
    assert_eq!(limits.max_connections.as_ref().unwrap().value, 100);
    // Fixed, it is accepted and the refusal is gone.
    f.apply(
        "dr.yaml",
        &DESTINATION_RULE.replace("maxConnections: 100", "maxConnections: 50"),
    );
    next_push(&mut ads, "the fixed rule served", |r| {
        let clusters = decode_clusters(r);
        let c = clusters.get(&format!("outbound|9080||{REVIEWS}"))?;
        let max = c.circuit_breakers.as_ref()?.thresholds[0]
            .max_connections
            .as_ref()?
            .value;
        (max == 50).then_some(())
    })
    .await;
    let configz = get_json(mp.http_addr, "/debug/configz").await;
    assert!(
        configz
            .as_array()
            .unwrap()
            .iter()
            .all(|c| c["status"] == "accepted"),
        "{configz}"
    );
}

async fn a_rule_change_pushes_only_to_proxies_that_see_it(source: Source) {
    let f = ConfigFixture::start(source, &[("dr.yaml", DESTINATION_RULE)], FLAGS).await;
    let mp = &f.mp;
    let mut inside = AdsClient::connect(mp.xds_addr).await.unwrap();
    let mut outside = AdsClient::connect(mp.xds_addr).await.unwrap();
    let (_, seen) = clusters(&mut inside, SIDECAR).await;
    let (_, unseen) = clusters(&mut outside, OTHER_NS).await;
    let v1 = format!("outbound|9080|v1|{REVIEWS}");
    assert!(seen.contains_key(&v1));
    assert!(
        !unseen.contains_key(&v1),
        "a rule exported to its own namespace only"
    );
    f.apply(
        "dr.yaml",
        &DESTINATION_RULE.replace("maxConnections: 100", "maxConnections: 7"),
    );
    let pushed = decode_clusters(&inside.response(BOUND).await);
    let limits = &pushed[&v1].circuit_breakers.as_ref().unwrap().thresholds[0];
    assert_eq!(limits.max_connections.as_ref().unwrap().value, 7);
    outside.silence(QUIET).await;
    let pushes = get_json(mp.http_addr, "/debug/pushz").await;
    let last = pushes.as_array().unwrap().last().unwrap().clone();
    assert_eq!(
        last["configs"][0], "DestinationRule bookinfo/reviews",
        "{last}"
    );
    assert_eq!(last["proxies"], 1, "{last}");
}

/// A real Envoy sidecar takes the rules and entries without rejecting anything: subset clusters
/// holding exactly the labelled endpoints of both clusters, the rule's policy in its clusters, the
/// entries' endpoints.
#[tokio::test]
async fn envoy_takes_rules_and_entries() {
    let _ports = sidecar_ports().await;
    let f = ConfigFixture::start(
        Source::Files,
        &[
            ("dr.yaml", DESTINATION_RULE),
            ("entries.yaml", SERVICE_ENTRIES),
        ],
        FLAGS,
    )
    .await;
    let envoy = Envoy::start(
        &f.mp,
        SIDECAR,
        &[("CLUSTER_ID", "cluster1")],
        AdsMode::Delta,
    )
    .await;
    let v1 = format!("outbound|9080|v1|{REVIEWS}");
    let v3 = format!("outbound|9080|v3|{REVIEWS}");
    for (cluster, expected) in [
        (v1.as_str(), vec!["10.1.1.11:9080"]),
        (v3.as_str(), vec!["10.2.3.13:9080"]),
        (
            "outbound|8443||api.example.com",
            vec!["192.0.2.11:8443", "192.0.2.12:9443"],
        ),
        (
            "outbound|8080||legacy.bookinfo.svc.cluster.local",
            vec!["10.9.0.1:8080"],
        ),
    ] {
        wait_for(&format!("{cluster} in Envoy"), BOUND, || {
            let envoy = &envoy;
            let expected = expected.clone();
            async move { (envoy.endpoints(cluster).await == expected).then_some(()) }
        })
        .await;
    }
    let dump: serde_json::Value = serde_json::from_str(
        &envoy
            .get("/config_dump?resource=dynamic_active_clusters")
            .await,
    )
    .expect("config dump is JSON");
    let cluster = |name: &str| -> serde_json::Value {
        dump["configs"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| &c["cluster"])
            .find(|c| c["name"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("{name} not in Envoy's clusters"))
    };
    let v1_cluster = cluster(&v1);
    assert_eq!(v1_cluster["lb_policy"], "LEAST_REQUEST", "{v1_cluster}");
    let limits = &v1_cluster["circuit_breakers"]["thresholds"][0];
    assert_eq!(limits["max_connections"], 100, "{limits}");
    assert_eq!(limits["max_pending_requests"], 10, "{limits}");
    assert_eq!(v1_cluster["outlier_detection"]["consecutive_5xx"], 5);
    assert_eq!(v1_cluster["outlier_detection"]["interval"], "10s");
    assert_eq!(cluster(&v3)["lb_policy"], "RANDOM");
    assert_eq!(
        envoy.rejected_updates().await,
        0,
        "Envoy rejected an update"
    );
}

/// A consistent hash needs both halves: the cluster's ring hash and the route's hash policy.
#[tokio::test]
async fn consistent_hash_sets_the_cluster_and_the_route() {
    let rule = "
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {name: productpage, namespace: bookinfo}
spec:
  host: productpage.bookinfo.svc.cluster.local
  trafficPolicy:
    loadBalancer: {consistentHash: {httpHeaderName: x-user, maglev: {tableSize: 65537}}}
";
    let f = ConfigFixture::start(Source::Files, &[("hash.yaml", rule)], FLAGS).await;
    let mut ads = AdsClient::connect(f.mp.xds_addr).await.unwrap();
    let (_, clusters) = clusters(&mut ads, SIDECAR).await;
    let cluster = &clusters["outbound|9080||productpage.bookinfo.svc.cluster.local"];
    assert_eq!(cluster.lb_policy, LbPolicy::Maglev as i32);
    ads.request(DiscoveryRequest {
        type_url: "type.googleapis.com/envoy.config.route.v3.RouteConfiguration".into(),
        resource_names: vec!["9080".into()],
        ..Default::default()
    });
    let r = ads.response(BOUND).await;
    let routes = envoy_types::pb::envoy::config::route::v3::RouteConfiguration::decode(
        &r.resources[0].value[..],
    )
    .unwrap();
    let vhost = routes
        .virtual_hosts
        .iter()
        .find(|v| v.name == "productpage.bookinfo.svc.cluster.local:9080")
        .expect("productpage's virtual host");
    let Some(envoy_types::pb::envoy::config::route::v3::route::Action::Route(action)) =
        &vhost.routes[0].action
    else {
        panic!("a route action")
    };
    assert_eq!(action.hash_policy.len(), 1, "{action:?}");
    let text = format!("{:?}", action.hash_policy[0]);
    assert!(text.contains("x-user"), "{text}");
}

/// Route features Istio users write that are easy to drop: `mirrors` (in order, a zero share
/// skipped), the deprecated `mirrorPercent`, `uriRegexRewrite`, the deprecated CORS `allowOrigin`
/// and `unmatchedPreflights`, each as istiod translates them.
#[tokio::test]
async fn mirrors_regex_rewrites_and_legacy_cors_reach_the_route() {
    let routes = "
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: productpage, namespace: bookinfo}
spec:
  hosts: [productpage]
  http:
  - match: [{uri: {prefix: /old/}}]
    rewrite: {uriRegexRewrite: {match: '^/old/(.*)$', rewrite: '/new/\\1'}}
    route: [{destination: {host: productpage}}]
  - match: [{uri: {prefix: /legacy}}]
    mirror: {host: reviews}
    mirror_percent: 30
    corsPolicy: {allowOrigin: [https://a.example], unmatchedPreflights: IGNORE}
    route: [{destination: {host: productpage}}]
  - mirrors:
    - {destination: {host: reviews, subset: v1}, percentage: {value: 25}}
    - {destination: {host: reviews, subset: v3}, percentage: {value: 0}}
    - {destination: {host: reviews}}
    route: [{destination: {host: productpage}}]
";
    let files = [("rules.yaml", DESTINATION_RULE), ("routes.yaml", routes)];
    let f = ConfigFixture::start(Source::Files, &files, FLAGS).await;
    let mut ads = AdsClient::connect(f.mp.xds_addr).await.unwrap();
    clusters(&mut ads, SIDECAR).await;
    ads.request(DiscoveryRequest {
        type_url: "type.googleapis.com/envoy.config.route.v3.RouteConfiguration".into(),
        resource_names: vec!["9080".into()],
        ..Default::default()
    });
    let r = ads.response(BOUND).await;
    let config = envoy_types::pb::envoy::config::route::v3::RouteConfiguration::decode(
        &r.resources[0].value[..],
    )
    .unwrap();
    let vhost = config
        .virtual_hosts
        .iter()
        .find(|v| v.name == "productpage.bookinfo.svc.cluster.local:9080")
        .expect("productpage's virtual host");
    let action = |i: usize| match &vhost.routes[i].action {
        Some(envoy_types::pb::envoy::config::route::v3::route::Action::Route(action)) => {
            action.clone()
        }
        other => panic!("route {i} is {other:?}"),
    };
    let mirrors = |i: usize| -> Vec<(String, Option<u32>)> {
        action(i)
            .request_mirror_policies
            .iter()
            .map(|m| {
                let share = m.runtime_fraction.as_ref().and_then(|f| f.default_value);
                (m.cluster.clone(), share.map(|p| p.numerator))
            })
            .collect()
    };

    let rewrite = action(0).regex_rewrite.expect("a regex rewrite");
    assert_eq!(rewrite.pattern.unwrap().regex, "^/old/(.*)$");
    assert_eq!(rewrite.substitution, "/new/\\1");
    assert_eq!(action(0).prefix_rewrite, "");

    assert_eq!(
        mirrors(1),
        [(format!("outbound|9080||{REVIEWS}"), Some(300_000))]
    );
    let cors = &vhost.routes[1].typed_per_filter_config["envoy.filters.http.cors"];
    let cors = envoy_types::pb::envoy::extensions::filters::http::cors::v3::CorsPolicy::decode(
        &cors.value[..],
    )
    .unwrap();
    let origins = format!("{:?}", cors.allow_origin_string_match);
    assert!(
        origins.contains("Exact(\"https://a.example\")"),
        "{origins}"
    );
    assert_eq!(
        cors.forward_not_matching_preflights.map(|b| b.value),
        Some(false)
    );

    assert_eq!(
        mirrors(2),
        [
            (format!("outbound|9080|v1|{REVIEWS}"), Some(250_000)),
            (format!("outbound|9080||{REVIEWS}"), None),
        ]
    );
}

const VM_GROUP: &str = "
apiVersion: networking.istio.io/v1
kind: WorkloadGroup
metadata: {name: vms, namespace: bookinfo}
spec:
  metadata: {labels: {app: legacy}}
  template: {serviceAccount: legacy, ports: {http: 8081}}
";

/// A VM's proxy registers into its WorkloadGroup over the secure port: its WorkloadEntry appears
/// (the `legacy` entry selects the group's labels) and goes once the proxy is gone past the grace.
#[tokio::test]
async fn a_vm_registers_into_its_workload_group() {
    let dir = copy_tree(Path::new(EXAMPLE));
    std::fs::create_dir_all(dir.path().join("config")).unwrap();
    std::fs::write(dir.path().join("config/entries.yaml"), SERVICE_ENTRIES).unwrap();
    std::fs::write(dir.path().join("config/group.yaml"), VM_GROUP).unwrap();
    let mp = start_meshpilot(
        dir.path(),
        &[
            "--debounce-after",
            "0s",
            "--workload-entry-grace-period",
            "200ms",
        ],
    )
    .await;
    let legacy = "outbound|8080||legacy.bookinfo.svc.cluster.local";
    let mut watcher = AdsClient::connect(mp.xds_addr).await.unwrap();
    clusters(&mut watcher, SIDECAR).await;
    assert_eq!(
        assignments(&mut watcher, &[legacy]).await[legacy],
        ["10.9.0.1:8080"]
    );

    let (chain, key) = mp
        .ca
        .current()
        .issue_workload(
            &meshpilot::security::identity::Identity::new("cluster.local", "bookinfo", "legacy"),
            Duration::from_secs(600),
        )
        .unwrap();
    let channel = tls_channel(
        mp.secure_xds_addr,
        mp.ca.current().root_pem(),
        Some((&chain.concat(), &key)),
    )
    .await
    .unwrap();
    let mut vm = AdsClient::over(channel).await.unwrap();
    vm.request(DiscoveryRequest {
        node: Some(node(
            "sidecar~10.60.0.5~vm-1.bookinfo~bookinfo.svc.cluster.local",
            &[
                ("AUTO_REGISTER_GROUP", "vms"),
                ("SERVICE_ACCOUNT", "legacy"),
            ],
        )),
        type_url: CDS.into(),
        ..Default::default()
    });
    vm.response(BOUND).await;
    let with_vm = next_push(&mut watcher, "the VM in the entry's endpoints", |r| {
        if r.type_url != EDS {
            return None;
        }
        let cla = r
            .resources
            .iter()
            .map(|a| ClusterLoadAssignment::decode(&a.value[..]).unwrap())
            .find(|c| c.cluster_name == legacy)?;
        let seen = addresses(&cla);
        (seen.len() == 2).then_some(seen)
    })
    .await;
    assert_eq!(with_vm, ["10.60.0.5:8081", "10.9.0.1:8080"]);
    let configz = get_json(mp.http_addr, "/debug/configz").await;
    assert!(
        configz.to_string().contains("vms-10-60-0-5"),
        "the registered WorkloadEntry is listed: {configz}"
    );

    drop(vm);
    let without = next_push(&mut watcher, "the VM gone after the grace period", |r| {
        if r.type_url != EDS {
            return None;
        }
        let cla = r
            .resources
            .iter()
            .map(|a| ClusterLoadAssignment::decode(&a.value[..]).unwrap())
            .find(|c| c.cluster_name == legacy)?;
        let seen = addresses(&cla);
        (seen.len() == 1).then_some(seen)
    })
    .await;
    assert_eq!(without, ["10.9.0.1:8080"]);
}

/// Without `--mesh-config`, the config cluster's `istio` ConfigMap is the mesh config: a change of
/// its `mesh` key reaches proxies, a broken one is refused and the last good one kept.
#[tokio::test]
async fn mesh_config_from_the_istio_configmap() {
    let configmap = |mesh: &str| {
        format!("apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: istio, namespace: istio-system}}\ndata:\n  mesh: |\n    {mesh}\n")
    };
    let f = ConfigFixture::start(Source::ConfigCluster, &[], FLAGS).await;
    f.apply(
        "",
        "apiVersion: v1\nkind: Namespace\nmetadata: {name: istio-system}\n",
    );
    f.apply(
        "",
        &configmap("outboundTrafficPolicy: {mode: REGISTRY_ONLY}"),
    );
    let admin = f.mp.http_addr;
    wait_for("REGISTRY_ONLY from the ConfigMap", BOUND, || async move {
        let mesh = get_json(admin, "/debug/mesh").await;
        (mesh["meshConfig"]["outboundTrafficPolicy"]["mode"] == "REGISTRY_ONLY").then_some(())
    })
    .await;
    let mut ads = AdsClient::connect(f.mp.xds_addr).await.unwrap();
    ads.request(DiscoveryRequest {
        node: Some(node(SIDECAR, &[("CLUSTER_ID", "cluster1")])),
        type_url: "type.googleapis.com/envoy.config.route.v3.RouteConfiguration".into(),
        resource_names: vec!["9080".into()],
        ..Default::default()
    });
    let r = ads.response(BOUND).await;
    let routes = envoy_types::pb::envoy::config::route::v3::RouteConfiguration::decode(
        &r.resources[0].value[..],
    )
    .unwrap();
    assert_eq!(routes.virtual_hosts.last().unwrap().name, "block_all");

    f.apply("", &configmap("connectTimeout: never"));
    let error = wait_for("the broken mesh config refused", BOUND, || async move {
        let mesh = get_json(admin, "/debug/mesh").await;
        mesh["last_error"].as_str().map(str::to_string)
    })
    .await;
    assert!(error.contains("connectTimeout"), "{error}");
    let mesh = get_json(admin, "/debug/mesh").await;
    assert_eq!(
        mesh["meshConfig"]["outboundTrafficPolicy"]["mode"], "REGISTRY_ONLY",
        "the last good one stays"
    );
}

/// A VirtualService TCP route splits a TCP service's connections by weight (on the listener of its
/// port, in the filter chain of its VIP).
#[tokio::test]
async fn tcp_routes_weight_the_service_chain() {
    let routes = "
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: db, namespace: bookinfo}
spec:
  hosts: [db]
  tcp:
  - route:
    - {destination: {host: db, subset: a}, weight: 70}
    - {destination: {host: db, subset: b}, weight: 30}
";
    let f = ConfigFixture::start(Source::Files, &[("db.yaml", routes)], FLAGS).await;
    std::fs::write(
        f.dir.path().join("clusters/cluster1/db.yaml"),
        "apiVersion: v1\nkind: Service\nmetadata: {name: db, namespace: bookinfo}\nspec: {clusterIP: 10.96.30.30, ports: [{name: tcp-db, port: 5432}]}\n",
    )
    .unwrap();
    let mut ads = AdsClient::connect(f.mp.xds_addr).await.unwrap();
    ads.request(DiscoveryRequest {
        node: Some(node(SIDECAR, &[("CLUSTER_ID", "cluster1")])),
        type_url: "type.googleapis.com/envoy.config.listener.v3.Listener".into(),
        ..Default::default()
    });
    let listener = next_push(&mut ads, "the db listener", |r| {
        r.resources
            .iter()
            .map(|a| {
                envoy_types::pb::envoy::config::listener::v3::Listener::decode(&a.value[..])
                    .unwrap()
            })
            .find(|l| l.name == "0.0.0.0_5432")
    })
    .await;
    let chain = listener
        .filter_chains
        .iter()
        .find(|c| c.name == "outbound|5432||db.bookinfo.svc.cluster.local")
        .expect("the db chain");
    let Some(envoy_types::pb::envoy::config::listener::v3::filter::ConfigType::TypedConfig(any)) =
        &chain.filters[0].config_type
    else {
        panic!("a typed filter")
    };
    let proxy =
        envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::TcpProxy::decode(
            &any.value[..],
        )
        .unwrap();
    let text = format!("{:?}", proxy.cluster_specifier);
    for part in [
        "outbound|5432|a|db.bookinfo.svc.cluster.local",
        "weight: 70",
        "outbound|5432|b|db.bookinfo.svc.cluster.local",
        "weight: 30",
    ] {
        assert!(text.contains(part), "{part} not in {text}");
    }
}

/// A rule for every proxy of bookinfo, and one for productpage's alone.
const SELECTING_RULES: &str = "
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {name: reviews, namespace: bookinfo}
spec:
  host: reviews
  trafficPolicy: {loadBalancer: {simple: LEAST_REQUEST}}
---
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {name: reviews-for-productpage, namespace: bookinfo}
spec:
  host: reviews
  workloadSelector: {matchLabels: {app: productpage}}
  trafficPolicy: {loadBalancer: {simple: RANDOM}}
  subsets: [{name: v9, labels: {version: v9}}]
";

from_both_sources!(
    a_selecting_rule_reaches_only_the_workloads_it_selects,
    selecting_rule_from_files,
    selecting_rule_from_the_config_cluster
);

async fn a_selecting_rule_reaches_only_the_workloads_it_selects(source: Source) {
    let f = ConfigFixture::start(source, &[("rules.yaml", SELECTING_RULES)], FLAGS).await;
    let all = format!("outbound|9080||{REVIEWS}");
    let v9 = format!("outbound|9080|v9|{REVIEWS}");
    let cds_for = |labels: &'static [(&'static str, &'static str)]| {
        let xds = f.mp.xds_addr;
        async move {
            let mut ads = AdsClient::connect(xds).await.unwrap();
            ads.request(DiscoveryRequest {
                node: Some(labelled_node(
                    SIDECAR,
                    &[("CLUSTER_ID", "cluster1")],
                    labels,
                )),
                type_url: CDS.into(),
                ..Default::default()
            });
            decode_clusters(&ads.response(BOUND).await)
        }
    };
    let selected = cds_for(&[("app", "productpage")]).await;
    assert_eq!(selected[&all].lb_policy, LbPolicy::Random as i32);
    assert!(selected.contains_key(&v9), "{:?}", selected.keys());
    let others = cds_for(&[("app", "ratings")]).await;
    assert_eq!(others[&all].lb_policy, LbPolicy::LeastRequest as i32);
    assert!(!others.contains_key(&v9), "{:?}", others.keys());
}
