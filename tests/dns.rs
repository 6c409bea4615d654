//! DNS proxying: the name table (NDS) Istio's agent asks for, decoded from what meshpilot sends to
//! a grpcio client speaking as istio-agent does (SotW and Delta), for sidecars of two clusters —
//! a service only the other cluster has, headless pods of both clusters on one network, ServiceEntry
//! hosts with allocated addresses that also name LDS filter chains and survive a restart — and which
//! changes move the table.

mod common;

use std::path::Path;
use std::time::Duration;

use common::config_source::{ConfigFixture, Source};
use common::nds::{ips, NdsAgent, Protocol};
use common::*;
use envoy_types::pb::envoy::config::listener::v3::Listener;
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use prost::Message;
use serde_json::Value;

const BOUND: Duration = Duration::from_secs(10);
const LDS: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
const EAST_PROXY: &str = "sidecar~10.20.0.5~api-1.shop~shop.svc.cluster.local";
const WEST_PROXY: &str = "sidecar~10.21.0.9~web-1.shop~shop.svc.cluster.local";

/// `api` in both clusters, `web` only in west; headless `db` with a StatefulSet pod in each cluster
/// and one more in west on another network.
const EAST: &str = "
apiVersion: v1
kind: Service
metadata: {name: api, namespace: shop}
spec: {clusterIP: 10.10.0.20, ports: [{name: http, port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: db, namespace: shop}
spec: {clusterIP: None, ports: [{name: tcp-postgres, port: 5432}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: db-east, namespace: shop, labels: {kubernetes.io/service-name: db}}
addressType: IPv4
ports: [{name: tcp-postgres, port: 5432}]
endpoints: [{addresses: [10.20.0.7], hostname: db-0, conditions: {ready: true}}]
";

const WEST: &str = "
apiVersion: v1
kind: Service
metadata: {name: api, namespace: shop}
spec: {clusterIP: 10.11.0.20, ports: [{name: http, port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec: {clusterIP: 10.11.0.30, ports: [{name: http, port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: db, namespace: shop}
spec: {clusterIP: None, ports: [{name: tcp-postgres, port: 5432}]}
---
apiVersion: v1
kind: Pod
metadata: {name: db-2, namespace: shop, labels: {topology.istio.io/network: net2}}
spec: {hostname: db-2, subdomain: db}
status: {podIP: 10.21.0.10, podIPs: [{ip: 10.21.0.10}], conditions: [{type: Ready, status: 'True'}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: db-west, namespace: shop, labels: {kubernetes.io/service-name: db}}
addressType: IPv4
ports: [{name: tcp-postgres, port: 5432}]
endpoints:
- {addresses: [10.21.0.8], hostname: db-1, conditions: {ready: true}}
- {addresses: [10.21.0.10], hostname: db-2, conditions: {ready: true}, targetRef: {kind: Pod, name: db-2, namespace: shop}}
";

/// Two external TCP services on one port without addresses (`a`, `b`), a wildcard, one with an
/// address, and one naming a Kubernetes service's host (the Kubernetes service wins).
fn entries() -> String {
    let others = "
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: api-decorator, namespace: shop}
spec:
  hosts: [api.shop.svc.cluster.local]
  addresses: [192.0.2.99]
  ports: [{number: 80, name: http, protocol: HTTP}]
  resolution: STATIC
  endpoints: [{address: 192.0.2.98}]
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: wild, namespace: shop}
spec:
  hosts: ['*.wild.example.com']
  ports: [{number: 443, name: tls, protocol: TLS}]
  resolution: NONE
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: c, namespace: shop}
spec:
  hosts: [c.example.com]
  addresses: [192.0.2.50]
  ports: [{number: 9000, name: tcp, protocol: TCP}]
  resolution: STATIC
  endpoints: [{address: 192.0.2.51}]
";
    format!(
        "{}---\n{}---\n{others}",
        entry("a", "a.example.com"),
        entry("b", "b.example.com")
    )
}

fn mesh_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (cluster, text) in [("east", EAST), ("west", WEST)] {
        let path = dir.path().join("clusters").join(cluster);
        std::fs::create_dir_all(&path).unwrap();
        std::fs::write(path.join("shop.yaml"), text).unwrap();
    }
    std::fs::create_dir_all(dir.path().join("config")).unwrap();
    std::fs::write(dir.path().join("config/entries.yaml"), entries()).unwrap();
    dir
}

/// meshpilot on the two clusters and their entries, with an agent for a sidecar of east.
async fn east_agent(protocol: Protocol) -> (tempfile::TempDir, meshpilot::app::Running, NdsAgent) {
    let dir = mesh_dir();
    let mp = start_meshpilot(dir.path(), &[]).await;
    let agent = NdsAgent::start(mp.xds_addr, EAST_PROXY, ("east", "net1"), protocol, None);
    (dir, mp, agent)
}

/// A ServiceEntry of `shop` for an external TCP service on port 9000 without addresses.
fn entry(name: &str, host: &str) -> String {
    entry_in(name, "shop", host)
}

fn entry_in(name: &str, namespace: &str, host: &str) -> String {
    format!(
        "apiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {{name: {name}, namespace: {namespace}}}\nspec:\n  hosts: [{host}]\n  ports: [{{number: 9000, name: tcp, protocol: TCP}}]\n  resolution: DNS\n"
    )
}

fn allocated(table: &Value, host: &str) -> String {
    let ips = ips(table, host);
    assert_eq!(
        ips.len(),
        1,
        "{host}: one IPv4 address for an IPv4 proxy: {ips:?}"
    );
    assert!(ips[0].starts_with("240.240."), "{host}: {ips:?}");
    ips[0].clone()
}

#[tokio::test]
async fn sidecars_of_two_clusters_resolve_the_whole_mesh() {
    let dir = mesh_dir();
    let mp = start_meshpilot(dir.path(), &[]).await;
    let mut east = NdsAgent::start(
        mp.xds_addr,
        EAST_PROXY,
        ("east", "net1"),
        Protocol::Sotw,
        None,
    );
    let mut west = NdsAgent::start(
        mp.xds_addr,
        WEST_PROXY,
        ("west", "net1"),
        Protocol::Delta,
        None,
    );
    let table = east.next_table(BOUND).await;

    // A service only the other cluster has resolves to that cluster's address.
    assert_eq!(ips(&table, "web.shop.svc.cluster.local"), ["10.11.0.30"]);
    let web = &table["web.shop.svc.cluster.local"];
    assert_eq!(web["registry"], "Kubernetes");
    assert_eq!(web["shortname"], "web");
    assert_eq!(web["namespace"], "shop");
    // A service of both clusters resolves to the proxy's own cluster's address, and a ServiceEntry
    // of the same host does not displace the Kubernetes service.
    assert_eq!(ips(&table, "api.shop.svc.cluster.local"), ["10.10.0.20"]);
    assert_eq!(
        table["api.shop.svc.cluster.local"]["registry"],
        "Kubernetes"
    );
    let west_table = west.next_table(BOUND).await;
    assert_eq!(
        ips(&west_table, "api.shop.svc.cluster.local"),
        ["10.11.0.20"]
    );

    // Headless: the ready pods of both clusters on the proxy's network, each also by its own name.
    assert_eq!(
        ips(&table, "db.shop.svc.cluster.local"),
        ["10.20.0.7", "10.21.0.8"]
    );
    assert_eq!(ips(&table, "db-0.db.shop.svc.cluster.local"), ["10.20.0.7"]);
    assert_eq!(ips(&table, "db-1.db.shop.svc.cluster.local"), ["10.21.0.8"]);
    assert_eq!(
        table["db-1.db.shop.svc.cluster.local"]["shortname"],
        "db-1.db"
    );
    assert!(
        table.get("db-2.db.shop.svc.cluster.local").is_none(),
        "a pod of another network is not reachable by its address: {table}"
    );

    // ServiceEntries: allocated addresses (distinct), declared ones, no wildcard.
    let a = allocated(&table, "a.example.com");
    let b = allocated(&table, "b.example.com");
    assert_ne!(a, b);
    assert_eq!(table["a.example.com"]["registry"], "External");
    assert_eq!(
        table["a.example.com"].get("shortname"),
        Some(&Value::from(""))
    );
    assert_eq!(ips(&table, "c.example.com"), ["192.0.2.50"]);
    let hosts: Vec<&String> = table.as_object().unwrap().keys().collect();
    assert!(!hosts.iter().any(|h| h.contains('*')), "{hosts:?}");
    // Every proxy sees the same allocation.
    assert_eq!(allocated(&west_table, "a.example.com"), a);

    // /debug/ndsz shows what the proxy is sent.
    let ndsz = get_json(mp.http_addr, "/debug/ndsz?proxyID=api-1.shop").await;
    assert_eq!(
        ndsz["table"]["a.example.com"]["ips"][0],
        Value::from(a.clone())
    );
    assert_eq!(
        ndsz["table"]["web.shop.svc.cluster.local"]["shortname"],
        "web"
    );
}

/// The LDS of a proxy whose agent captures DNS matches each allocated address, so two external TCP
/// services on one port reach their own clusters; a proxy without capture gets none of them.
#[tokio::test]
async fn allocated_addresses_name_listener_chains_only_for_dns_capture() {
    let (_dir, mp, mut agent) = east_agent(Protocol::Sotw).await;
    let table = agent.next_table(BOUND).await;
    let (a, b) = (
        allocated(&table, "a.example.com"),
        allocated(&table, "b.example.com"),
    );

    let chains = |capture: bool| async move {
        let mut meta = vec![("CLUSTER_ID", "east"), ("NAMESPACE", "shop")];
        if capture {
            meta.push(("DNS_CAPTURE", "true"));
        }
        let mut ads = AdsClient::connect(mp.xds_addr).await.unwrap();
        ads.request(DiscoveryRequest {
            node: Some(node(EAST_PROXY, &meta)),
            type_url: LDS.into(),
            ..Default::default()
        });
        let response = ads.response(BOUND).await;
        let listener = response
            .resources
            .iter()
            .map(|any| Listener::decode(&any.value[..]).unwrap())
            .find(|l| l.name == "0.0.0.0_9000")
            .expect("the port 9000 listener");
        listener
            .filter_chains
            .iter()
            .map(|c| {
                let prefixes: Vec<String> = c
                    .filter_chain_match
                    .iter()
                    .flat_map(|m| &m.prefix_ranges)
                    .map(|r| r.address_prefix.clone())
                    .collect();
                (c.name.clone(), prefixes)
            })
            .collect::<Vec<_>>()
    };
    let captured = chains(true).await;
    for (host, address) in [("a.example.com", &a), ("b.example.com", &b)] {
        let name = format!("outbound|9000||{host}");
        assert!(
            captured.contains(&(name.clone(), vec![address.clone()])),
            "{name} on {address}: {captured:?}"
        );
    }
    let plain = chains(false).await;
    assert!(
        plain
            .iter()
            .all(|(_, prefixes)| prefixes.iter().all(|p| !p.starts_with("240.240."))),
        "{plain:?}"
    );
}

/// A ServiceEntry added is in the next table; a VirtualService changes no table; a Sidecar that
/// narrows what the namespace sees narrows its table.
#[tokio::test]
async fn the_table_follows_services_and_scope_not_routing() {
    let (dir, mp, mut agent) = east_agent(Protocol::Delta).await;
    agent.next_table(BOUND).await;

    // Routing moves LDS/RDS but not names: watch a listener client hear the push.
    let mut ads = AdsClient::connect(mp.xds_addr).await.unwrap();
    ads.request(DiscoveryRequest {
        node: Some(node(EAST_PROXY, &[("CLUSTER_ID", "east")])),
        type_url: LDS.into(),
        ..Default::default()
    });
    let first = ads.response(BOUND).await;
    ads.ack(&first, vec![]);
    write_atomic(
        &dir.path().join("config/route.yaml"),
        "apiVersion: networking.istio.io/v1\nkind: VirtualService\nmetadata: {name: api, namespace: shop}\nspec:\n  hosts: [api]\n  http: [{timeout: 3s, route: [{destination: {host: api}}]}]\n",
    );
    // (A push from before the change may still arrive first.)
    loop {
        let pushed = ads.response(BOUND).await;
        ads.ack(&pushed, vec![]);
        if pushed.version_info != first.version_info {
            break;
        }
    }
    agent
        .silent(Duration::from_millis(500), "for a VirtualService change")
        .await;

    write_atomic(
        &dir.path().join("config/d.yaml"),
        &entry("d", "d.example.com"),
    );
    let table = agent.next_table(BOUND).await;
    allocated(&table, "d.example.com");

    write_atomic(
        &dir.path().join("config/sidecar.yaml"),
        "apiVersion: networking.istio.io/v1\nkind: Sidecar\nmetadata: {name: default, namespace: shop}\nspec:\n  egress: [{hosts: ['shop/web.shop.svc.cluster.local']}]\n",
    );
    let table = agent
        .table_where("narrowed by the Sidecar", BOUND, |t| {
            t.get("a.example.com").is_none()
        })
        .await;
    let hosts: Vec<&String> = table.as_object().unwrap().keys().collect();
    assert_eq!(hosts, ["web.shop.svc.cluster.local"]);
}

/// A headless pod that stops being ready leaves the table: endpoint changes of headless services
/// move names.
#[tokio::test]
async fn headless_pods_follow_readiness() {
    let (dir, _mp, mut agent) = east_agent(Protocol::Sotw).await;
    agent.next_table(BOUND).await;
    let east = dir.path().join("clusters/east/shop.yaml");
    write_atomic(&east, &EAST.replace("ready: true", "ready: false"));
    let table = agent
        .table_where("without db-0", BOUND, |t| {
            t.get("db-0.db.shop.svc.cluster.local").is_none()
        })
        .await;
    assert_eq!(ips(&table, "db.shop.svc.cluster.local"), ["10.21.0.8"]);
}

/// The allocator's first choice of slot for a host: its stable hash modulo 65,534, plus one.
fn preferred_slot(host: &str) -> u64 {
    meshpilot::text::stable_hash(host) % 65534 + 1
}

/// Two hosts that want the same slot, the first sorting before the second.
fn colliding_hosts() -> (String, String) {
    let mut seen = std::collections::HashMap::new();
    for i in 0.. {
        let host = format!("h{i}.example.com");
        if let Some(other) = seen.insert(preferred_slot(&host), host.clone()) {
            let mut pair = [other, host];
            pair.sort();
            let [first, second] = pair;
            return (first, second);
        }
    }
    unreachable!()
}

/// An address once given stays with its host across a restart, even when a host that would take
/// it if allocation started afresh (it sorts first and wants the same slot) arrives meanwhile.
#[tokio::test]
async fn allocated_addresses_survive_a_restart() {
    let (first, second) = colliding_hosts();
    let dir = mesh_dir();
    let config = dir.path().join("config");
    std::fs::write(config.join("second.yaml"), entry("second", &second)).unwrap();
    let mp = start_meshpilot(dir.path(), &[]).await;
    let mut agent = NdsAgent::start(
        mp.xds_addr,
        EAST_PROXY,
        ("east", "net1"),
        Protocol::Sotw,
        None,
    );
    let held = allocated(&agent.next_table(BOUND).await, &second);
    let saved = dir.path().join(".state/allocated-addresses.json");
    wait_for("the allocation saved", BOUND, || {
        let saved = saved.clone();
        let second = second.clone();
        async move {
            let text = std::fs::read_to_string(saved).ok()?;
            text.contains(&second).then_some(())
        }
    })
    .await;
    drop(agent);
    mp.shutdown().await;

    std::fs::write(config.join("first.yaml"), entry("first", &first)).unwrap();
    let mp = start_meshpilot(dir.path(), &[]).await;
    let mut agent = NdsAgent::start(
        mp.xds_addr,
        EAST_PROXY,
        ("east", "net1"),
        Protocol::Sotw,
        None,
    );
    let table = agent.next_table(BOUND).await;
    assert_eq!(allocated(&table, &second), held, "kept across the restart");
    assert_ne!(allocated(&table, &first), held);
    assert!(Path::new(&saved).exists());
}

/// A proxy whose agent does not ask gets no name table with its other types.
#[tokio::test]
async fn no_table_for_proxies_that_do_not_ask() {
    let dir = mesh_dir();
    let mp = start_meshpilot(dir.path(), &[]).await;
    let mut ads = AdsClient::connect(mp.xds_addr).await.unwrap();
    ads.request(DiscoveryRequest {
        node: Some(node(
            EAST_PROXY,
            &[("CLUSTER_ID", "east"), ("DNS_CAPTURE", "true")],
        )),
        type_url: LDS.into(),
        ..Default::default()
    });
    let first = ads.response(BOUND).await;
    assert_eq!(first.type_url, LDS);
    ads.ack(&first, vec![]);
    write_atomic(
        &dir.path().join("config/d.yaml"),
        &entry("d", "d.example.com"),
    );
    let pushed = ads.response(BOUND).await;
    assert_eq!(pushed.type_url, LDS, "only what it asked for");
    ads.ack(&pushed, vec![]);
    ads.silence(Duration::from_millis(300)).await;
}

/// On a config cluster the leader records each entry's allocated addresses in its
/// `status.addresses`, as istiod 1.25+; addresses an entry's status already records (istiod wrote
/// them before the mesh moved) are the ones served.
#[tokio::test]
async fn allocated_addresses_live_in_the_entries_status_on_a_config_cluster() {
    let migrated = "status:
  addresses:
  - {value: 240.240.9.9, host: migrated.example.com}
  - {value: '2001:2::909', host: migrated.example.com}
";
    let entries = format!(
        "{}---\n{}{migrated}",
        entry_in("fresh", "default", "fresh.example.com"),
        entry_in("migrated", "default", "migrated.example.com")
    );
    let fixture =
        ConfigFixture::start(Source::ConfigCluster, &[("entries.yaml", &entries)], &[]).await;
    let node = "sidecar~10.1.1.11~client.default~default.svc.cluster.local";
    let mut agent = NdsAgent::start(
        fixture.mp.xds_addr,
        node,
        ("cluster1", ""),
        Protocol::Sotw,
        None,
    );
    let table = agent.next_table(BOUND).await;
    assert_eq!(ips(&table, "migrated.example.com"), ["240.240.9.9"]);
    let fresh = allocated(&table, "fresh.example.com");

    let api = fixture.api().expect("a config cluster");
    let recorded = wait_for("fresh's addresses in its status", BOUND, || {
        let status = api
            .get("ServiceEntry", "default", "fresh")
            .map(|o| o["status"].clone());
        async move {
            let addresses = status?["addresses"].as_array()?.clone();
            (!addresses.is_empty()).then_some(addresses)
        }
    })
    .await;
    let values: Vec<&str> = recorded
        .iter()
        .filter_map(|a| a["value"].as_str())
        .collect();
    assert_eq!(values.len(), 2, "IPv4 and IPv6: {recorded:?}");
    assert_eq!(values[0], fresh);
    assert!(values[1].starts_with("2001:2::"), "{recorded:?}");
    assert!(recorded.iter().all(|a| a["host"] == "fresh.example.com"));
    let migrated = api.get("ServiceEntry", "default", "migrated").unwrap();
    assert_eq!(
        migrated["status"]["addresses"][0]["value"], "240.240.9.9",
        "a recorded address is kept"
    );
}
