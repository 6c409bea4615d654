//! Security policy in the decoded xDS a raw client receives, with config from files and from the
//! config cluster's API server alike: the inbound listener's chains per PeerAuthentication mode,
//! RBAC and jwt_authn filters (names, policies, inline keys), mesh-wide root-namespace policies,
//! auto mTLS's endpoint metadata following DISABLE, refusal of an invalid policy (the last good one
//! stays), and pushes that reach the namespaces a policy concerns, within a second.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use common::config_source::{ConfigFixture, Source};
use common::jwt::{jwks, SigningKey};
use common::*;
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::config::listener::v3::{filter, FilterChain, Listener};
use envoy_types::pb::envoy::config::rbac::v3::rbac::Action;
use envoy_types::pb::envoy::extensions::filters::http::jwt_authn::v3::{
    jwt_provider, JwtAuthentication,
};
use envoy_types::pb::envoy::extensions::filters::http::rbac::v3::Rbac as HttpRbac;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_filter, HttpConnectionManager,
};
use envoy_types::pb::envoy::extensions::filters::network::rbac::v3::Rbac as NetworkRbac;
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use envoy_types::pb::google::protobuf::Any;
use prost::Message;

const BOUND: Duration = Duration::from_secs(10);
/// Quiet this long after connecting: no push of the start is still on its way.
const SETTLE: Duration = Duration::from_millis(400);
const LDS: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
const REVIEWS: &str = "sidecar~10.1.1.11~reviews-v1-7f9c8d.bookinfo~bookinfo.svc.cluster.local";
const PRODUCTPAGE: &str =
    "sidecar~10.1.1.30~productpage-v1-6b746f.bookinfo~bookinfo.svc.cluster.local";
const OTHER: &str = "sidecar~10.5.0.5~client.other~other.svc.cluster.local";
const REVIEWS_EDS: &str = "outbound|9080||reviews.bookinfo.svc.cluster.local";

fn policies(jwks: &str) -> String {
    format!(
        "
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {{name: default, namespace: bookinfo}}
spec: {{mtls: {{mode: STRICT}}}}
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {{name: reviews, namespace: bookinfo}}
spec:
  selector: {{matchLabels: {{app: reviews}}}}
  rules:
  - from: [{{source: {{principals: [cluster.local/ns/bookinfo/sa/productpage]}}}}]
    to: [{{operation: {{methods: [GET]}}}}]
---
apiVersion: security.istio.io/v1
kind: RequestAuthentication
metadata: {{name: reviews, namespace: bookinfo}}
spec:
  selector: {{matchLabels: {{app: reviews}}}}
  jwtRules: [{{issuer: https://issuer.test, jwks: '{jwks}', forwardOriginalToken: true}}]
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {{name: deny-9999, namespace: istio-system}}
spec:
  action: DENY
  rules: [{{to: [{{operation: {{ports: ['9999']}}}}]}}]
"
    )
}

const PORT_DISABLE: &str = "
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: reviews, namespace: bookinfo}
spec:
  selector: {matchLabels: {app: reviews}}
  portLevelMtls: {9080: {mode: DISABLE}}
";

/// A sidecar's node: its cluster and its workload's labels.
fn sidecar(id: &str, labels: &[(&str, &str)]) -> envoy_types::pb::envoy::config::core::v3::Node {
    labelled_node(id, &[("CLUSTER_ID", "cluster1")], labels)
}

/// Connects a sidecar and returns its (ACKed) wildcard LDS.
async fn connect(
    mp: &meshpilot::app::Running,
    id: &str,
    labels: &[(&str, &str)],
) -> (AdsClient, BTreeMap<String, Listener>) {
    let mut ads = AdsClient::connect(mp.xds_addr).await.unwrap();
    ads.request(DiscoveryRequest {
        node: Some(sidecar(id, labels)),
        type_url: LDS.into(),
        ..Default::default()
    });
    let r = ads.response(BOUND).await;
    ads.ack(&r, vec![]);
    let mut listeners = decode_listeners(&r);
    // Pushes of the start (debounced) may still come: the last one is what the proxy holds.
    while let Some(Ok(r)) = ads.next(SETTLE).await {
        ads.ack(&r, vec![]);
        listeners = decode_listeners(&r);
    }
    (ads, listeners)
}

fn decode_listeners(r: &DiscoveryResponse) -> BTreeMap<String, Listener> {
    assert_eq!(r.type_url, LDS);
    r.resources
        .iter()
        .map(|a| Listener::decode(&a.value[..]).expect("a Listener"))
        .map(|l| (l.name.clone(), l))
        .collect()
}

/// Reads (and ACKs) LDS pushes until `check` finds what it wants in one, within the bound.
async fn next_listeners<T>(
    ads: &mut AdsClient,
    what: &str,
    mut check: impl FnMut(&BTreeMap<String, Listener>) -> Option<T>,
) -> T {
    let deadline = tokio::time::Instant::now() + BOUND;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        assert!(!left.is_zero(), "timed out waiting for {what}");
        let r = ads.response(left).await;
        ads.ack(&r, vec![]);
        if r.type_url != LDS {
            continue;
        }
        if let Some(found) = check(&decode_listeners(&r)) {
            return found;
        }
    }
}

/// The chains of `virtualInbound` named `name`: `0.0.0.0_<port>` for a declared port,
/// `virtualInbound` and `virtualInbound-catchall-http` for passthrough (istiod's names).
fn chains<'a>(listeners: &'a BTreeMap<String, Listener>, name: &str) -> Vec<&'a FilterChain> {
    listeners["virtualInbound"]
        .filter_chains
        .iter()
        .filter(|c| c.name == name)
        .collect()
}

fn typed(filter: &envoy_types::pb::envoy::config::listener::v3::Filter) -> &Any {
    match &filter.config_type {
        Some(filter::ConfigType::TypedConfig(any)) => any,
        other => panic!("{} has no typed config: {other:?}", filter.name),
    }
}

/// The HTTP filters of a chain's connection manager: (name, config).
fn http_filters(chain: &FilterChain) -> Vec<(String, Any)> {
    let hcm = chain
        .filters
        .iter()
        .find(|f| f.name == "envoy.filters.network.http_connection_manager")
        .map(|f| HttpConnectionManager::decode(&typed(f).value[..]).expect("an HCM"))
        .unwrap_or_else(|| panic!("{} has no HCM", chain.name));
    hcm.http_filters
        .into_iter()
        .map(|f| match f.config_type {
            Some(http_filter::ConfigType::TypedConfig(any)) => (f.name, any),
            other => panic!("{} has no typed config: {other:?}", f.name),
        })
        .collect()
}

/// An RBAC filter's action and policy names.
fn rbac_of(
    rules: Option<envoy_types::pb::envoy::config::rbac::v3::Rbac>,
) -> (i32, BTreeSet<String>) {
    let rules = rules.expect("enforced rules");
    (rules.action, rules.policies.into_keys().collect())
}

from_both_sources!(
    policies_shape_the_inbound_listener_and_client_endpoints,
    inbound_from_files,
    inbound_from_the_config_cluster
);
from_both_sources!(
    an_invalid_policy_is_refused_and_the_last_good_one_stays,
    refusal_from_files,
    refusal_from_the_config_cluster
);
from_both_sources!(
    a_policy_change_reaches_the_proxies_it_concerns_within_a_second,
    scoped_push_from_files,
    scoped_push_from_the_config_cluster
);

async fn policies_shape_the_inbound_listener_and_client_endpoints(source: Source) {
    let key = SigningKey::generate("k1");
    let keys = jwks(&[&key]);
    let f = ConfigFixture::start(source, &[("policies.yaml", &policies(&keys))], &[]).await;
    let (mut reviews, listeners) =
        connect(&f.mp, REVIEWS, &[("app", "reviews"), ("version", "v1")]).await;

    // STRICT: mutual TLS only, on the service port and on ports no service declares (HTTP and
    // TCP alike).
    let port = chains(&listeners, "0.0.0.0_9080");
    let passthrough = [
        chains(&listeners, "virtualInbound-catchall-http"),
        chains(&listeners, "virtualInbound"),
    ];
    for chain in port.iter().chain(passthrough.iter().flatten()) {
        let transport = chain
            .filter_chain_match
            .as_ref()
            .map(|m| m.transport_protocol.as_str());
        assert_eq!(transport, Some("tls"), "{}", chain.name);
        assert!(
            chain.transport_socket.is_some(),
            "STRICT terminates mTLS: {}",
            chain.name
        );
    }
    assert_eq!(
        (port.len(), passthrough[0].len(), passthrough[1].len()),
        (1, 1, 1)
    );
    let catchall = passthrough[1][0];

    // istiod's order: authentication, then DENY (the mesh-wide root-namespace policy), then ALLOW.
    let filters = http_filters(chains(&listeners, "0.0.0.0_9080")[0]);
    let names: Vec<&str> = filters.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "envoy.filters.http.jwt_authn",
            "envoy.filters.http.rbac",
            "envoy.filters.http.rbac",
            "envoy.filters.http.router"
        ]
    );
    let jwt = JwtAuthentication::decode(&filters[0].1.value[..]).unwrap();
    let provider = &jwt.providers["origins-0"];
    assert_eq!(provider.issuer, "https://issuer.test");
    assert!(provider.forward);
    assert_eq!(provider.payload_in_metadata, "payload");
    match &provider.jwks_source_specifier {
        Some(jwt_provider::JwksSourceSpecifier::LocalJwks(data)) => {
            let inline = format!("{:?}", data.specifier);
            assert!(
                inline.contains(&key.jwk()["x"].as_str().unwrap().to_string()),
                "{inline}"
            );
        }
        other => panic!("keys not inline: {other:?}"),
    }
    let deny = rbac_of(HttpRbac::decode(&filters[1].1.value[..]).unwrap().rules);
    assert_eq!(
        deny,
        (
            Action::Deny as i32,
            BTreeSet::from(["ns[istio-system]-policy[deny-9999]-rule[0]".to_string()])
        )
    );
    let allow = rbac_of(HttpRbac::decode(&filters[2].1.value[..]).unwrap().rules);
    assert_eq!(
        allow,
        (
            Action::Allow as i32,
            BTreeSet::from(["ns[bookinfo]-policy[reviews]-rule[0]".to_string()])
        )
    );

    // On TCP (the passthrough chain) the ALLOW rule's method cannot match: it allows nothing.
    let network: Vec<&str> = catchall.filters.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(
        network,
        [
            "envoy.filters.network.rbac",
            "envoy.filters.network.rbac",
            "envoy.filters.network.tcp_proxy"
        ]
    );
    let tcp_allow = NetworkRbac::decode(&typed(&catchall.filters[1]).value[..]).unwrap();
    assert_eq!(
        rbac_of(tcp_allow.rules),
        (Action::Allow as i32, BTreeSet::new())
    );

    // A client's endpoints of reviews: mTLS while the workloads accept it.
    let (mut client, _) = connect(&f.mp, PRODUCTPAGE, &[("app", "productpage")]).await;
    let tls_endpoints = |cla: &ClusterLoadAssignment| -> usize {
        cla.endpoints
            .iter()
            .flat_map(|l| &l.lb_endpoints)
            .filter(|e| {
                e.metadata.as_ref().is_some_and(|m| {
                    m.filter_metadata
                        .contains_key("envoy.transport_socket_match")
                })
            })
            .count()
    };
    client.request(DiscoveryRequest {
        type_url: EDS.into(),
        resource_names: vec![REVIEWS_EDS.into()],
        ..Default::default()
    });
    let r = client.response(BOUND).await;
    client.ack(&r, vec![REVIEWS_EDS.into()]);
    let cla = ClusterLoadAssignment::decode(&r.resources[0].value[..]).unwrap();
    assert!(
        tls_endpoints(&cla) >= 2,
        "reviews' pods have sidecars: {cla:?}"
    );

    // Port-level DISABLE on reviews: plaintext chains there, and clients stop sending mTLS.
    f.apply("reviews-mtls.yaml", PORT_DISABLE);
    next_listeners(&mut reviews, "9080 in plaintext", |l| {
        let port = chains(l, "0.0.0.0_9080");
        (port.len() == 1 && port[0].transport_socket.is_none()).then_some(())
    })
    .await;
    let deadline = tokio::time::Instant::now() + BOUND;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        assert!(!left.is_zero(), "timed out waiting for plaintext endpoints");
        let r = client.response(left).await;
        let names = match r.type_url == EDS {
            true => vec![REVIEWS_EDS.to_string()],
            false => vec![],
        };
        client.ack(&r, names);
        if r.type_url == EDS && !r.resources.is_empty() {
            let cla = ClusterLoadAssignment::decode(&r.resources[0].value[..]).unwrap();
            if tls_endpoints(&cla) == 0 {
                break;
            }
        }
    }
}

async fn an_invalid_policy_is_refused_and_the_last_good_one_stays(source: Source) {
    let good = "
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: reviews, namespace: bookinfo}
spec:
  selector: {matchLabels: {app: reviews}}
  rules: [{from: [{source: {ipBlocks: [10.0.0.0/8]}}]}]
";
    let f = ConfigFixture::start(source, &[("authz.yaml", good)], &[]).await;
    let (mut reviews, _) = connect(&f.mp, REVIEWS, &[("app", "reviews")]).await;
    f.apply("authz.yaml", &good.replace("10.0.0.0/8", "10.0.0.0/33"));
    let refusal = wait_for("the refusal on /debug/configz", BOUND, || async {
        let configz = get_json(f.mp.http_addr, "/debug/configz").await;
        configz
            .as_array()?
            .iter()
            .find(|c| c["status"] == "refused" && c["kind"] == "AuthorizationPolicy")
            .cloned()
    })
    .await;
    let error = refusal["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("AuthorizationPolicy bookinfo/reviews")
            && error.contains("rules[0].from[0].source.ipBlocks[0]"),
        "{error}"
    );
    let configz = get_json(f.mp.http_addr, "/debug/configz").await;
    let served = configz
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["status"] == "accepted" && c["kind"] == "AuthorizationPolicy")
        .expect("the last good version is still accepted");
    assert_eq!(
        served["spec"]["rules"][0]["from"][0]["source"]["ipBlocks"][0],
        "10.0.0.0/8"
    );
    // Nothing changed for the proxy: no push.
    reviews.silence(Duration::from_millis(500)).await;
}

async fn a_policy_change_reaches_the_proxies_it_concerns_within_a_second(source: Source) {
    let f = ConfigFixture::start(source, &[], &[]).await;
    let (mut reviews, _) = connect(&f.mp, REVIEWS, &[("app", "reviews")]).await;
    let (mut other, _) = connect(&f.mp, OTHER, &[("app", "client")]).await;
    let has_rbac = |l: &BTreeMap<String, Listener>| {
        chains(l, "0.0.0.0_9080")
            .first()
            .is_some_and(|c| {
                http_filters(c)
                    .iter()
                    .any(|(n, _)| n == "envoy.filters.http.rbac")
            })
            .then_some(())
    };

    let applied = Instant::now();
    f.apply(
        "bookinfo.yaml",
        "
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: reviews, namespace: bookinfo}
spec:
  selector: {matchLabels: {app: reviews}}
  rules: [{to: [{operation: {paths: [/ok]}}]}]
",
    );
    next_listeners(&mut reviews, "the policy in bookinfo", has_rbac).await;
    eprintln!("the policy reached its proxy after {:?}", applied.elapsed());
    other.silence(Duration::from_millis(500)).await;

    // A mesh-wide policy (root namespace) concerns everyone.
    f.apply(
        "mesh.yaml",
        "
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: deny-debug, namespace: istio-system}
spec:
  action: DENY
  rules: [{to: [{operation: {paths: [/debug*]}}]}]
",
    );
    next_listeners(&mut other, "the mesh-wide policy", |_| Some(())).await;
    next_listeners(&mut reviews, "the mesh-wide policy", |_| Some(())).await;

    f.delete(
        "bookinfo.yaml",
        "AuthorizationPolicy",
        "bookinfo",
        "reviews",
    );
    next_listeners(&mut reviews, "the policy gone", |l| {
        let filters = http_filters(chains(l, "0.0.0.0_9080")[0]);
        let rbac = filters
            .iter()
            .filter(|(n, _)| n == "envoy.filters.http.rbac")
            .count();
        (rbac == 1).then_some(())
    })
    .await;
    other.silence(Duration::from_millis(500)).await;
}
