//! Sidecar resources scope what proxies hear about, from files and from the config cluster alike:
//! the clusters, listeners and routes a raw ADS client receives shrink to the egress hosts (and the
//! destinations of the VirtualServices those import), a workload selector beats the namespace's
//! Sidecar, the root namespace's Sidecar is every other namespace's default, and a refused Sidecar
//! keeps the last good one.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::config_source::{ConfigFixture, Source};
use common::*;
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use prost::Message;

const BOUND: Duration = Duration::from_secs(10);
const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const RDS: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
const BOOKINFO: &str = "sidecar~10.1.1.11~reviews-v1-7f9c8d.bookinfo~bookinfo.svc.cluster.local";
const OTHER_NS: &str = "sidecar~10.5.0.5~client.other~other.svc.cluster.local";
const REVIEWS: &str = "outbound|9080||reviews.bookinfo.svc.cluster.local";
const PRODUCTPAGE: &str = "outbound|9080||productpage.bookinfo.svc.cluster.local";
const LEDGER: &str = "outbound|443||ledger.example.com";
const VAULT: &str = "outbound|8200||vault.example.com";

/// Two services of another namespace, and a VirtualService in bookinfo that sends part of the
/// reviews traffic to one of them.
const CONFIG: &str = "
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: ledger, namespace: bank}
spec:
  hosts: [ledger.example.com]
  ports: [{number: 443, name: https, protocol: HTTPS}]
  resolution: STATIC
  endpoints: [{address: 192.0.2.20}]
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: vault, namespace: bank}
spec:
  hosts: [vault.example.com]
  ports: [{number: 8200, name: tcp, protocol: TCP}]
  resolution: STATIC
  endpoints: [{address: 192.0.2.21}]
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: reviews, namespace: bookinfo}
spec:
  hosts: [reviews]
  http:
  - match: [{uri: {prefix: /audit}}]
    route: [{destination: {host: ledger.example.com, port: {number: 443}}}]
  - route: [{destination: {host: reviews}}]
";

fn sidecar(namespace: &str, name: &str, body: &str) -> String {
    format!(
        "apiVersion: networking.istio.io/v1\nkind: Sidecar\nmetadata: {{name: {name}, namespace: {namespace}}}\nspec:\n{body}"
    )
}

/// The outbound clusters of a SotW wildcard CDS response.
fn outbound(r: &DiscoveryResponse) -> BTreeSet<String> {
    assert_eq!(r.type_url, CDS);
    r.resources
        .iter()
        .map(|a| Cluster::decode(&a.value[..]).expect("a Cluster").name)
        .filter(|n| n.starts_with("outbound|"))
        .collect()
}

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|n| n.to_string()).collect()
}

/// A client on wildcard CDS, its first response ACKed.
async fn subscribe(
    f: &ConfigFixture,
    id: &str,
    labels: &[(&str, &str)],
) -> (AdsClient, BTreeSet<String>) {
    let mut ads = AdsClient::connect(f.mp.xds_addr).await.unwrap();
    ads.request(DiscoveryRequest {
        node: Some(labelled_node(id, &[("CLUSTER_ID", "cluster1")], labels)),
        type_url: CDS.into(),
        ..Default::default()
    });
    let r = ads.response(BOUND).await;
    ads.ack(&r, vec![]);
    (ads, outbound(&r))
}

/// Reads (and ACKs) CDS pushes until one holds exactly `expected`.
async fn until_clusters(ads: &mut AdsClient, what: &str, expected: &BTreeSet<String>) {
    let deadline = tokio::time::Instant::now() + BOUND;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        assert!(!left.is_zero(), "timed out waiting for {what}");
        let r = ads.response(left).await;
        ads.ack(&r, vec![]);
        if r.type_url == CDS && outbound(&r) == *expected {
            return;
        }
    }
}

/// The virtual hosts of route configuration 9080 for a bookinfo proxy with `labels`.
async fn virtual_hosts(f: &ConfigFixture, labels: &[(&str, &str)]) -> BTreeSet<String> {
    let mut ads = AdsClient::connect(f.mp.xds_addr).await.unwrap();
    ads.request(DiscoveryRequest {
        node: Some(labelled_node(
            BOOKINFO,
            &[("CLUSTER_ID", "cluster1")],
            labels,
        )),
        type_url: RDS.into(),
        resource_names: vec!["9080".into()],
        ..Default::default()
    });
    let r = ads.response(BOUND).await;
    let routes = RouteConfiguration::decode(&r.resources[0].value[..]).expect("routes");
    routes.virtual_hosts.into_iter().map(|v| v.name).collect()
}

from_both_sources!(
    a_sidecar_narrows_what_its_namespace_hears,
    scoping_from_files,
    scoping_from_the_config_cluster
);
from_both_sources!(
    a_refused_sidecar_keeps_the_last_good_one,
    refusal_from_files,
    refusal_from_the_config_cluster
);

async fn a_sidecar_narrows_what_its_namespace_hears(source: Source) {
    let f = ConfigFixture::start(
        source,
        &[("bank.yaml", CONFIG)],
        &["--debounce-after", "0s"],
    )
    .await;
    let everything = set(&[REVIEWS, PRODUCTPAGE, LEDGER, VAULT]);
    let (mut scoped, before) = subscribe(&f, BOOKINFO, &[]).await;
    assert_eq!(before, everything);
    let (mut other, _) = subscribe(&f, OTHER_NS, &[]).await;

    // `./*`: bookinfo's services, and the ledger its VirtualService routes to; not the vault.
    let own = sidecar("bookinfo", "default", "  egress: [{hosts: [./*]}]\n");
    f.apply("sidecar.yaml", &own);
    let narrowed = set(&[REVIEWS, PRODUCTPAGE, LEDGER]);
    until_clusters(&mut scoped, "bookinfo scoped to ./*", &narrowed).await;
    let hosts = virtual_hosts(&f, &[]).await;
    assert!(
        hosts.contains("reviews.bookinfo.svc.cluster.local:9080"),
        "{hosts:?}"
    );
    // Another namespace is not concerned: nothing is pushed to it.
    other.silence(Duration::from_millis(500)).await;

    // A selector beats the namespace's Sidecar for the workloads it picks.
    let picky = sidecar(
        "bookinfo",
        "picky",
        "  workloadSelector: {labels: {app: reviews}}\n  egress: [{hosts: [bank/vault.example.com]}]\n",
    );
    f.apply("picky.yaml", &picky);
    let (_, picked) = wait_for("the selector's scope", BOUND, || async {
        let (ads, names) = subscribe(&f, BOOKINFO, &[("app", "reviews")]).await;
        (names == set(&[VAULT])).then_some((ads, names))
    })
    .await;
    assert_eq!(picked, set(&[VAULT]));
    let hosts = virtual_hosts(&f, &[("app", "reviews")]).await;
    assert_eq!(
        hosts,
        set(&["allow_any"]),
        "no route to reviews for the picked workload"
    );

    // The root namespace's Sidecar is the default of namespaces without one.
    let mesh_default = sidecar(
        "istio-system",
        "default",
        "  egress: [{hosts: [./*, bank/ledger.example.com]}]\n",
    );
    f.apply("mesh-default.yaml", &mesh_default);
    until_clusters(
        &mut other,
        "the root default in another namespace",
        &set(&[LEDGER]),
    )
    .await;

    // Gone again: bookinfo hears of everything.
    f.delete("sidecar.yaml", "Sidecar", "bookinfo", "default");
    f.delete("mesh-default.yaml", "Sidecar", "istio-system", "default");
    until_clusters(&mut scoped, "the whole mesh again", &everything).await;
}

async fn a_refused_sidecar_keeps_the_last_good_one(source: Source) {
    let good = sidecar("bookinfo", "default", "  egress: [{hosts: [./*]}]\n");
    let f = ConfigFixture::start(
        source,
        &[("bank.yaml", CONFIG), ("sidecar.yaml", &good)],
        &["--debounce-after", "0s"],
    )
    .await;
    let (mut ads, scoped) = subscribe(&f, BOOKINFO, &[]).await;
    assert_eq!(scoped, set(&[REVIEWS, PRODUCTPAGE, LEDGER]));

    f.apply(
        "sidecar.yaml",
        &sidecar(
            "bookinfo",
            "default",
            "  egress: [{hosts: [vault.example.com]}]\n",
        ),
    );
    let refused = wait_for("the refusal on /debug/configz", BOUND, || async {
        let configz = get_json(f.mp.http_addr, "/debug/configz").await;
        configz
            .as_array()?
            .iter()
            .find(|c| c["status"] == "refused")
            .cloned()
    })
    .await;
    let error = refused["error"].as_str().unwrap();
    for part in [
        "Sidecar bookinfo/default",
        "egress[0].hosts[0]",
        "namespace/dnsName",
    ] {
        assert!(error.contains(part), "{part:?} not in {error}");
    }
    // The last good Sidecar still scopes the namespace.
    ads.silence(Duration::from_millis(500)).await;
    let (_, still) = subscribe(&f, BOOKINFO, &[]).await;
    assert_eq!(still, set(&[REVIEWS, PRODUCTPAGE, LEDGER]));
}

/// reviews' Sidecar declaring its own inbound ports: one to the loopback, one to the pod's address.
const INGRESS: &str = "
apiVersion: networking.istio.io/v1
kind: Sidecar
metadata: {name: reviews-ingress, namespace: bookinfo}
spec:
  workloadSelector: {labels: {app: reviews}}
  ingress:
  - port: {number: 7070, protocol: HTTP, name: http}
    defaultEndpoint: 127.0.0.1:8080
  - port: {number: 7443, protocol: TCP, name: tcp}
    defaultEndpoint: 0.0.0.0:8443
";

from_both_sources!(
    sidecar_ingress_replaces_the_services_inbound_ports,
    ingress_from_files,
    ingress_from_the_config_cluster
);

async fn sidecar_ingress_replaces_the_services_inbound_ports(source: Source) {
    use envoy_types::pb::envoy::config::core::v3::address::Address;
    use envoy_types::pb::envoy::config::endpoint::v3::lb_endpoint::HostIdentifier;
    let f = ConfigFixture::start(source, &[("ingress.yaml", INGRESS)], &[]).await;
    let mut ads = AdsClient::connect(f.mp.xds_addr).await.unwrap();
    ads.request(DiscoveryRequest {
        node: Some(labelled_node(
            BOOKINFO,
            &[("CLUSTER_ID", "cluster1")],
            &[("app", "reviews")],
        )),
        type_url: CDS.into(),
        ..Default::default()
    });
    let clusters: Vec<Cluster> = (ads.response(BOUND).await.resources.iter())
        .map(|a| Cluster::decode(&a.value[..]).unwrap())
        .collect();
    let inbound: BTreeSet<String> = (clusters.iter())
        .map(|c| c.name.clone())
        .filter(|n| n.starts_with("inbound|"))
        .collect();
    assert_eq!(
        inbound,
        set(&["inbound|7070||", "inbound|7443||"]),
        "not the service's 9080"
    );
    let endpoint = |name: &str| {
        let cluster = clusters.iter().find(|c| c.name == name).unwrap();
        let assignment = cluster.load_assignment.as_ref().unwrap();
        let Some(HostIdentifier::Endpoint(ep)) =
            &assignment.endpoints[0].lb_endpoints[0].host_identifier
        else {
            panic!("{name}: no endpoint");
        };
        match ep.address.as_ref().unwrap().address.as_ref().unwrap() {
            Address::SocketAddress(sa) => format!("{}:{:?}", sa.address, sa.port_specifier),
            other => format!("{other:?}"),
        }
    };
    assert_eq!(
        endpoint("inbound|7070||"),
        "127.0.0.1:Some(PortValue(8080))"
    );
    assert_eq!(
        endpoint("inbound|7443||"),
        "10.1.1.11:Some(PortValue(8443))"
    );
}
