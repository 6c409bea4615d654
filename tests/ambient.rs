//! Ambient mode: what a ztunnel of each of two clusters on two networks is sent over Delta xDS
//! (`istio.workload.Address`, `istio.security.Authorization`), decoded from raw streams speaking
//! as ztunnel does — its own network's pods, every service's VIPs, the other network's endpoints
//! behind that network's gateway, policies in L4 form — and how pod, cluster and on-demand changes
//! move it.

mod common;

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

use common::*;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse,
};
use meshpilot::xds::istio_protos::authorization::{self as authz, Authorization};
use meshpilot::xds::istio_protos::workload::{self as wl, address, Address};
use prost::Message;

const BOUND: Duration = Duration::from_secs(10);
const ADDRESS: &str = "type.googleapis.com/istio.workload.Address";
const AUTHORIZATION: &str = "type.googleapis.com/istio.security.Authorization";
const REVIEWS: &str = "bookinfo/reviews.bookinfo.svc.cluster.local";
const NETWORK1_GATEWAY: &str = "NetworkGateway/network1/192.0.2.1/15008";
const NETWORK2_GATEWAY: &str = "NetworkGateway/network2/192.0.2.2/15008";

/// One cluster on `network`: its east-west gateway at `gateway` (its pod at `gateway_pod`),
/// `reviews` at `vip` with two ambient pods (`ips`, listening on 8080 for the service's 9080) and,
/// in c1, a pod no service selects and one not captured.
fn cluster(
    network: &str,
    (gateway, gateway_pod): (&str, &str),
    vip: &str,
    pods: &[(&str, &str, bool)],
) -> String {
    let mut yaml = format!(
        "
apiVersion: v1
kind: Namespace
metadata: {{name: istio-system, labels: {{topology.istio.io/network: {network}}}}}
---
apiVersion: v1
kind: Node
metadata:
  name: node-{network}
  labels: {{topology.kubernetes.io/region: r-{network}, topology.kubernetes.io/zone: z1}}
---
apiVersion: v1
kind: Service
metadata:
  name: istio-eastwestgateway
  namespace: istio-system
  labels: {{topology.istio.io/network: {network}}}
spec: {{type: LoadBalancer, clusterIP: 10.99.0.1, ports: [{{name: tls, port: 15443}}]}}
status: {{loadBalancer: {{ingress: [{{ip: {gateway}}}]}}}}
---
apiVersion: v1
kind: Pod
metadata: {{name: eastwest, namespace: istio-system, labels: {{app: eastwest}}}}
spec: {{serviceAccountName: istio-eastwestgateway, nodeName: node-{network}, containers: []}}
status: {{podIP: {gateway_pod}, conditions: [{{type: Ready, status: 'True'}}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: eastwest, namespace: istio-system, labels: {{kubernetes.io/service-name: istio-eastwestgateway}}}}
addressType: IPv4
ports: [{{name: tls, port: 15443}}]
endpoints: [{{addresses: [{gateway_pod}], conditions: {{ready: true}}, targetRef: {{kind: Pod, name: eastwest, namespace: istio-system}}}}]
---
apiVersion: v1
kind: Service
metadata: {{name: reviews, namespace: bookinfo}}
spec: {{clusterIP: {vip}, selector: {{app: reviews}}, ports: [{{name: http, port: 9080, targetPort: 8080}}]}}
"
    );
    let mut endpoints = String::new();
    for (name, ip, captured) in pods {
        let annotation = match captured {
            true => "annotations: {ambient.istio.io/redirection: enabled}",
            false => "annotations: {}",
        };
        let app = if name.starts_with("reviews") {
            "reviews"
        } else {
            "sleep"
        };
        yaml.push_str(&format!(
            "---
apiVersion: v1
kind: Pod
metadata:
  name: {name}
  namespace: bookinfo
  labels: {{app: {app}}}
  {annotation}
spec: {{serviceAccountName: bookinfo-{app}, nodeName: node-{network}, containers: []}}
status: {{podIP: {ip}, conditions: [{{type: Ready, status: 'True'}}]}}
"
        ));
        if app == "reviews" {
            endpoints.push_str(&format!(
                "  - {{addresses: [{ip}], conditions: {{ready: true}}, targetRef: {{kind: Pod, name: {name}, namespace: bookinfo}}}}\n"
            ));
        }
    }
    yaml.push_str(&format!(
        "---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: reviews-{network}, namespace: bookinfo, labels: {{kubernetes.io/service-name: reviews}}}}
addressType: IPv4
ports: [{{name: http, port: 8080}}]
endpoints:
{endpoints}"
    ));
    yaml
}

fn c1(with_second: bool) -> String {
    let mut pods = vec![
        ("reviews-a", "10.10.1.11", true),
        ("sleep", "10.10.1.30", true),
        ("legacy", "10.10.1.40", false),
    ];
    if with_second {
        pods.insert(1, ("reviews-b", "10.10.1.12", true));
    }
    cluster("network1", ("192.0.2.1", "10.10.1.99"), "10.96.1.20", &pods)
}

fn c2() -> String {
    cluster(
        "network2",
        ("192.0.2.2", "10.20.1.99"),
        "10.96.2.20",
        &[
            ("reviews-a", "10.20.1.11", true),
            ("reviews-b", "10.20.1.12", true),
        ],
    )
}

const POLICIES: &str = "
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: allow-frontend, namespace: bookinfo}
spec:
  selector: {matchLabels: {app: reviews}}
  rules:
  - from: [{source: {principals: [cluster.local/ns/bookinfo/sa/frontend]}}, {source: {serviceAccounts: [sleep]}}]
    to: [{operation: {ports: ['8080']}}]
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: deny-posts, namespace: bookinfo}
spec:
  action: DENY
  rules:
  - to: [{operation: {methods: [POST], ports: ['9080']}}]
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: allow-gets, namespace: bookinfo}
spec:
  rules:
  - to: [{operation: {methods: [GET]}}]
  - from: [{source: {namespaces: ['prod-*']}}]
    when: [{key: source.ip, values: [203.0.113.0/24]}]
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: audit-all, namespace: bookinfo}
spec:
  action: AUDIT
  rules: [{}]
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: deny-blocked, namespace: istio-system}
spec:
  action: DENY
  rules:
  - from: [{source: {ipBlocks: [198.51.100.7]}}]
---
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: strict, namespace: bookinfo}
spec:
  mtls: {mode: STRICT}
";

/// A VM's WorkloadEntry on network1, captured, weighted, selected by a ServiceEntry; a database
/// outside Kubernetes as a ServiceEntry's inline endpoint.
const VM: &str = "
apiVersion: networking.istio.io/v1
kind: WorkloadEntry
metadata: {name: vm-1, namespace: bookinfo, annotations: {ambient.istio.io/redirection: enabled}}
spec: {address: 10.10.9.1, labels: {app: ratings}, serviceAccount: ratings, network: network1, weight: 3}
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: ratings-vm, namespace: bookinfo}
spec:
  hosts: [ratings.vm.internal]
  addresses: [10.99.9.9]
  location: MESH_INTERNAL
  resolution: STATIC
  ports: [{name: http, number: 9080, targetPort: 8080}]
  workloadSelector: {labels: {app: ratings}}
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: legacy-db, namespace: bookinfo}
spec:
  hosts: [db.legacy.internal]
  location: MESH_INTERNAL
  resolution: STATIC
  ports: [{name: tcp, number: 5432, protocol: TCP}]
  endpoints: [{address: 10.10.9.2, network: network1}]
";
const VM_UID: &str = "config-files/networking.istio.io/WorkloadEntry/bookinfo/vm-1";
const RATINGS: &str = "bookinfo/ratings.vm.internal";

fn write_tree(root: &Path) {
    for (id, yaml) in [("c1", c1(true)), ("c2", c2())] {
        let dir = root.join("clusters").join(id);
        std::fs::create_dir_all(&dir).unwrap();
        write_atomic(&dir.join("mesh.yaml"), &yaml);
    }
    std::fs::create_dir_all(root.join("config")).unwrap();
    write_atomic(&root.join("config/policies.yaml"), POLICIES);
    write_atomic(&root.join("config/vm.yaml"), VM);
}

/// A ztunnel's stream: its node as ztunnel sends it (no NETWORK; its cluster), subscribed to both
/// types as ztunnel does by default (empty lists: the wildcard).
async fn ztunnel(xds: std::net::SocketAddr, ip: &str, cluster: &str) -> DeltaClient {
    let client = DeltaClient::connect(xds).await.expect("connects");
    let id = format!("ztunnel~{ip}~ztunnel-x.istio-system~istio-system.svc.cluster.local");
    let meta = [
        ("NAMESPACE", "istio-system"),
        ("NAME", "ztunnel-x"),
        ("NODE_NAME", "node-x"),
        ("CLUSTER_ID", cluster),
    ];
    for type_url in [ADDRESS, AUTHORIZATION] {
        client.request(DeltaDiscoveryRequest {
            node: Some(node(&id, &meta)),
            type_url: type_url.into(),
            ..Default::default()
        });
    }
    client
}

/// What a ztunnel holds, from the responses it was sent and ACKed.
#[derive(Default)]
struct Held {
    addresses: BTreeMap<String, address::Type>,
    policies: BTreeMap<String, Authorization>,
}

impl Held {
    async fn receive(&mut self, client: &mut DeltaClient) -> DeltaDiscoveryResponse {
        let response = client.response(BOUND).await;
        client.request(DeltaDiscoveryRequest {
            type_url: response.type_url.clone(),
            response_nonce: response.nonce.clone(),
            ..Default::default()
        });
        for resource in &response.resources {
            let any = resource.resource.as_ref().expect("a resource body");
            assert_eq!(any.type_url, response.type_url, "{}", resource.name);
            match response.type_url.as_str() {
                ADDRESS => {
                    let kind = Address::decode(&any.value[..]).unwrap().r#type.unwrap();
                    self.addresses.insert(resource.name.clone(), kind);
                }
                AUTHORIZATION => {
                    let policy = Authorization::decode(&any.value[..]).unwrap();
                    self.policies.insert(resource.name.clone(), policy);
                }
                other => panic!("unexpected type {other}"),
            }
        }
        for name in &response.removed_resources {
            self.addresses.remove(name);
            self.policies.remove(name);
        }
        response
    }

    /// What a new stream holds once both types have been answered.
    async fn first_of_both(client: &mut DeltaClient) -> Held {
        let mut held = Held::default();
        held.until(client, "the first of both types", |h| {
            !h.addresses.is_empty() && !h.policies.is_empty()
        })
        .await;
        held
    }

    /// Receives until `done` holds.
    async fn until(&mut self, client: &mut DeltaClient, what: &str, done: impl Fn(&Held) -> bool) {
        let deadline = tokio::time::Instant::now() + BOUND;
        while !done(self) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{what}: not within {BOUND:?}"
            );
            self.receive(client).await;
        }
    }

    fn workload(&self, name: &str) -> &wl::Workload {
        match self.addresses.get(name) {
            Some(address::Type::Workload(w)) => w,
            other => panic!("{name}: expected a workload, got {other:?}"),
        }
    }

    fn service(&self, name: &str) -> &wl::Service {
        match self.addresses.get(name) {
            Some(address::Type::Service(s)) => s,
            other => panic!("{name}: expected a service, got {other:?}"),
        }
    }

    fn workload_names(&self) -> Vec<&str> {
        let names = self.addresses.iter().filter_map(|(name, kind)| match kind {
            address::Type::Workload(_) => Some(name.as_str()),
            address::Type::Service(_) => None,
        });
        names.collect()
    }
}

/// (service port, target port) of each port.
fn pairs(ports: &[wl::Port]) -> Vec<(u32, u32)> {
    ports
        .iter()
        .map(|p| (p.service_port, p.target_port))
        .collect()
}

fn ip(bytes: &[u8]) -> IpAddr {
    match bytes.len() {
        4 => IpAddr::from(<[u8; 4]>::try_from(bytes).unwrap()),
        _ => IpAddr::from(<[u8; 16]>::try_from(bytes).unwrap()),
    }
}

fn split_horizon(network: &str, gateway: &str) -> String {
    format!("{network}/SplitHorizonWorkload/{gateway}/{REVIEWS}")
}

#[tokio::test]
async fn each_network_gets_its_pods_every_vip_and_the_other_network_behind_its_gateway() {
    let dir = tempfile::tempdir().unwrap();
    write_tree(dir.path());
    let mp = start_meshpilot(dir.path(), &[]).await;

    let mut east = ztunnel(mp.xds_addr, "10.10.1.5", "c1").await;
    let mut held = Held::first_of_both(&mut east).await;

    // Every running pod of its network, captured or not, with or without a service.
    assert_eq!(
        held.workload_names(),
        vec![
            NETWORK1_GATEWAY,
            NETWORK2_GATEWAY,
            "c1//Pod/bookinfo/legacy",
            "c1//Pod/bookinfo/reviews-a",
            "c1//Pod/bookinfo/reviews-b",
            "c1//Pod/bookinfo/sleep",
            "c1//Pod/istio-system/eastwest",
            "config-files/networking.istio.io/ServiceEntry/bookinfo/legacy-db/10.10.9.2",
            VM_UID,
            split_horizon("network2", "192.0.2.2").as_str(),
        ]
    );
    // The VM: under the config source it came from, its weight as capacity, the entry's ports.
    let vm = held.workload(VM_UID);
    assert_eq!(
        (vm.name.as_str(), vm.network.as_str()),
        ("vm-1", "network1")
    );
    assert_eq!(
        vm.addresses.iter().map(|b| ip(b)).collect::<Vec<_>>(),
        vec!["10.10.9.1".parse::<IpAddr>().unwrap()]
    );
    assert_eq!(
        (vm.service_account.as_str(), vm.capacity),
        ("ratings", Some(3))
    );
    assert_eq!(vm.tunnel_protocol, wl::TunnelProtocol::Hbone as i32);
    let ports = &vm.services.get(RATINGS).expect("the entry's ports").ports;
    assert_eq!(pairs(ports), vec![(9080, 8080)]);
    let db =
        held.workload("config-files/networking.istio.io/ServiceEntry/bookinfo/legacy-db/10.10.9.2");
    let ports = &db
        .services
        .get("bookinfo/db.legacy.internal")
        .expect("the entry's ports")
        .ports;
    assert_eq!(pairs(ports), vec![(5432, 5432)]);
    let ratings = held.service(RATINGS);
    assert_eq!(
        ratings
            .addresses
            .iter()
            .map(|a| ip(&a.address))
            .collect::<Vec<_>>(),
        vec!["10.99.9.9".parse::<IpAddr>().unwrap()]
    );
    assert_eq!(pairs(&ratings.ports), vec![(9080, 8080)]);
    let a = held.workload("c1//Pod/bookinfo/reviews-a");
    assert_eq!(
        a.addresses.iter().map(|b| ip(b)).collect::<Vec<_>>(),
        vec!["10.10.1.11".parse::<IpAddr>().unwrap()]
    );
    assert_eq!(
        (a.name.as_str(), a.namespace.as_str()),
        ("reviews-a", "bookinfo")
    );
    assert_eq!(
        (a.network.as_str(), a.cluster_id.as_str()),
        ("network1", "c1")
    );
    assert_eq!(a.service_account, "bookinfo-reviews");
    assert_eq!(a.tunnel_protocol, wl::TunnelProtocol::Hbone as i32);
    assert_eq!(a.trust_domain, "", "cluster.local is sent as empty");
    assert_eq!(
        (a.canonical_name.as_str(), a.canonical_revision.as_str()),
        ("reviews", "latest")
    );
    assert_eq!(a.node, "node-network1");
    assert_eq!(a.status, wl::WorkloadStatus::Healthy as i32);
    let locality = a.locality.as_ref().expect("locality from the node");
    assert_eq!(
        (locality.region.as_str(), locality.zone.as_str()),
        ("r-network1", "z1")
    );
    let ports = &a.services.get(REVIEWS).expect("reviews' ports").ports;
    assert_eq!(pairs(ports), vec![(9080, 8080)]);
    // Selector-scoped policies that select it, then the STRICT mode's DENY.
    assert_eq!(
        a.authorization_policies,
        vec![
            "bookinfo/allow-frontend",
            "istio-system/istio_converted_static_strict"
        ]
    );
    let legacy = held.workload("c1//Pod/bookinfo/legacy");
    assert_eq!(
        legacy.tunnel_protocol,
        wl::TunnelProtocol::None as i32,
        "not captured"
    );
    assert!(held.workload("c1//Pod/bookinfo/sleep").services.is_empty());
    assert_eq!(
        held.workload("c1//Pod/bookinfo/sleep")
            .authorization_policies,
        vec!["istio-system/istio_converted_static_strict"]
    );

    // network2's two endpoints, as one workload behind its gateway's HBONE port.
    let remote = held.workload(&split_horizon("network2", "192.0.2.2"));
    assert!(remote.addresses.is_empty());
    assert_eq!(remote.network, "network2");
    assert_eq!(remote.capacity, Some(2));
    assert_eq!(remote.tunnel_protocol, wl::TunnelProtocol::Hbone as i32);
    let gateway = remote.network_gateway.as_ref().expect("the gateway");
    assert_eq!(gateway.hbone_mtls_port, 15008);
    match &gateway.destination {
        Some(wl::gateway_address::Destination::Address(a)) => {
            assert_eq!(
                (a.network.as_str(), ip(&a.address)),
                ("network2", "192.0.2.2".parse().unwrap())
            );
        }
        other => panic!("gateway by address expected, got {other:?}"),
    }
    let ports = &remote.services.get(REVIEWS).expect("reviews' ports").ports;
    assert_eq!(pairs(ports), vec![(9080, 8080)]);

    // The other network's gateway as a workload: whom to expect at its HBONE port.
    let gateway = held.workload(NETWORK2_GATEWAY);
    assert_eq!(
        (gateway.namespace.as_str(), gateway.service_account.as_str()),
        ("istio-system", "istio-eastwestgateway")
    );
    assert_eq!(gateway.network, "network2");
    assert_eq!(
        gateway.addresses.iter().map(|b| ip(b)).collect::<Vec<_>>(),
        vec!["192.0.2.2".parse::<IpAddr>().unwrap()]
    );

    // The service with both clusters' VIPs, each on its network.
    let reviews = held.service(REVIEWS);
    assert_eq!(reviews.hostname, "reviews.bookinfo.svc.cluster.local");
    let vips: Vec<(String, IpAddr)> = reviews
        .addresses
        .iter()
        .map(|a| (a.network.clone(), ip(&a.address)))
        .collect();
    assert_eq!(
        vips,
        vec![
            ("network1".to_string(), "10.96.1.20".parse().unwrap()),
            ("network2".to_string(), "10.96.2.20".parse().unwrap())
        ]
    );
    assert_eq!(
        reviews
            .ports
            .iter()
            .map(|p| p.service_port)
            .collect::<Vec<_>>(),
        vec![9080]
    );
    assert_eq!(reviews.ip_families, wl::IpFamilies::Ipv4Only as i32);

    // The other ztunnel, on network2, gets the mirror image.
    let mut west = ztunnel(mp.xds_addr, "10.20.1.5", "c2").await;
    let mut west_held = Held::first_of_both(&mut west).await;
    assert_eq!(
        west_held.workload_names(),
        vec![
            NETWORK1_GATEWAY,
            NETWORK2_GATEWAY,
            "c2//Pod/bookinfo/reviews-a",
            "c2//Pod/bookinfo/reviews-b",
            "c2//Pod/istio-system/eastwest",
            "network1/SplitHorizonWorkload/192.0.2.1/bookinfo/db.legacy.internal",
            "network1/SplitHorizonWorkload/192.0.2.1/bookinfo/ratings.vm.internal",
            split_horizon("network1", "192.0.2.1").as_str(),
        ]
    );
    assert_eq!(
        west_held
            .workload(&split_horizon("network1", "192.0.2.1"))
            .capacity,
        Some(2)
    );

    // A pod goes: east is told it is removed, west that network1 now stands for one endpoint.
    write_atomic(&dir.path().join("clusters/c1/mesh.yaml"), &c1(false));
    held.until(&mut east, "reviews-b removed", |h| {
        !h.addresses.contains_key("c1//Pod/bookinfo/reviews-b")
    })
    .await;
    west_held
        .until(&mut west, "network1's capacity 1", |h| {
            h.workload(&split_horizon("network1", "192.0.2.1")).capacity == Some(1)
        })
        .await;

    // A slice alone drops a pod (which stays): its Address no longer lists the service.
    let dropped: Vec<String> = c1(false)
        .lines()
        .filter(|l| !l.contains("targetRef: {kind: Pod, name: reviews-a,"))
        .map(str::to_string)
        .collect();
    write_atomic(
        &dir.path().join("clusters/c1/mesh.yaml"),
        &dropped.join("\n"),
    );
    held.until(&mut east, "reviews-a without reviews", |h| {
        !h.workload("c1//Pod/bookinfo/reviews-a")
            .services
            .contains_key(REVIEWS)
    })
    .await;

    // A cluster goes: its network's workload and its VIP go with it.
    std::fs::remove_dir_all(dir.path().join("clusters/c2")).unwrap();
    held.until(&mut east, "network2 gone", |h| {
        !h.addresses
            .contains_key(&split_horizon("network2", "192.0.2.2"))
            && h.service(REVIEWS).addresses.len() == 1
    })
    .await;
}

#[tokio::test]
async fn policies_are_sent_in_l4_form_and_what_ztunnel_cannot_enforce_never_allows_more() {
    let dir = tempfile::tempdir().unwrap();
    write_tree(dir.path());
    let mp = start_meshpilot(dir.path(), &[]).await;
    let mut stream = ztunnel(mp.xds_addr, "10.10.1.5", "c1").await;
    let mut held = Held::default();
    held.until(&mut stream, "policies", |h| h.policies.len() >= 4)
        .await;
    assert_eq!(
        held.policies.keys().map(String::as_str).collect::<Vec<_>>(),
        vec![
            "bookinfo/allow-frontend",
            "bookinfo/allow-gets",
            "bookinfo/deny-posts",
            "istio-system/deny-blocked",
            "istio-system/istio_converted_static_strict",
        ],
        "AUDIT is not sent"
    );
    let exact = |v: &str| authz::StringMatch {
        match_type: Some(authz::string_match::MatchType::Exact(v.into())),
    };

    let allow = &held.policies["bookinfo/allow-frontend"];
    assert_eq!(allow.scope, authz::Scope::WorkloadSelector as i32);
    assert_eq!(allow.action, authz::Action::Allow as i32);
    let clauses = &allow.rules[0].clauses;
    assert_eq!(clauses[0].matches[0].destination_ports, vec![8080]);
    assert_eq!(
        clauses[1].matches[0].principals,
        vec![exact("cluster.local/ns/bookinfo/sa/frontend")]
    );
    assert_eq!(
        clauses[1].matches[1].service_accounts,
        vec![authz::ServiceAccountMatch {
            namespace: "bookinfo".into(),
            service_account: "sleep".into()
        }],
        "a bare service account is the policy's namespace's"
    );

    // ALLOW: the rule naming a method is dropped, the L4 one kept (prefix namespaces, a CIDR).
    let gets = &held.policies["bookinfo/allow-gets"];
    assert_eq!(gets.scope, authz::Scope::Namespace as i32);
    assert_eq!(gets.rules.len(), 1);
    let from = &gets.rules[0].clauses[0].matches[0];
    assert_eq!(
        from.namespaces,
        vec![authz::StringMatch {
            match_type: Some(authz::string_match::MatchType::Prefix("prod-".into()))
        }]
    );
    let when = &gets.rules[0].clauses[1].matches[0];
    assert_eq!(
        when.source_ips,
        vec![authz::Address {
            address: vec![203, 0, 113, 0],
            length: 24
        }]
    );

    // DENY: the method goes, the port stays (it denies more, never less).
    let deny = &held.policies["bookinfo/deny-posts"];
    assert_eq!(deny.action, authz::Action::Deny as i32);
    assert_eq!(
        deny.rules[0].clauses[0].matches[0].destination_ports,
        vec![9080]
    );

    let global = &held.policies["istio-system/deny-blocked"];
    assert_eq!(global.scope, authz::Scope::Global as i32);
    assert_eq!(
        global.rules[0].clauses[0].matches[0].source_ips,
        vec![authz::Address {
            address: vec![198, 51, 100, 7],
            length: 32
        }]
    );

    let strict = &held.policies["istio-system/istio_converted_static_strict"];
    assert_eq!(strict.action, authz::Action::Deny as i32);
    let plaintext = &strict.rules[0].clauses[0].matches[0].not_principals;
    assert_eq!(
        plaintext,
        &vec![authz::StringMatch {
            match_type: Some(authz::string_match::MatchType::Presence(()))
        }]
    );

    // Port-level exceptions are a policy of their own, which the workload references instead.
    let exception = "
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: reviews-metrics, namespace: bookinfo}
spec:
  selector: {matchLabels: {app: reviews}}
  portLevelMtls: {'15020': {mode: PERMISSIVE}}
";
    write_atomic(&dir.path().join("config/exception.yaml"), exception);
    let name = "istio-system/istio_converted_static_strict_except_15020";
    held.until(&mut stream, "the exception's policy", |h| {
        h.policies.contains_key(name)
    })
    .await;
    assert_eq!(
        held.policies[name].rules[0].clauses[0].matches[0].not_destination_ports,
        vec![15020]
    );
    held.until(&mut stream, "reviews referencing it", |h| {
        h.workload("c1//Pod/bookinfo/reviews-a")
            .authorization_policies
            .last()
            .map(String::as_str)
            == Some(name)
    })
    .await;
}

#[tokio::test]
async fn on_demand_lookups_are_answered_by_address_and_by_service() {
    let dir = tempfile::tempdir().unwrap();
    write_tree(dir.path());
    let mp = start_meshpilot(dir.path(), &[]).await;
    let mut client = DeltaClient::connect(mp.xds_addr).await.unwrap();
    let id = "ztunnel~10.10.1.5~ztunnel-x.istio-system~istio-system.svc.cluster.local";
    // ztunnel with XDS_ON_DEMAND: subscribed to nothing, then one name per lookup.
    client.request(DeltaDiscoveryRequest {
        node: Some(node(id, &[("CLUSTER_ID", "c1")])),
        type_url: ADDRESS.into(),
        resource_names_subscribe: vec!["*".into()],
        resource_names_unsubscribe: vec!["*".into()],
        ..Default::default()
    });
    let mut held = Held::default();
    let first = held.receive(&mut client).await;
    assert!(first.resources.is_empty(), "nothing asked for yet");

    client.request(DeltaDiscoveryRequest {
        type_url: ADDRESS.into(),
        resource_names_subscribe: vec!["network1/10.10.1.30".into()],
        ..Default::default()
    });
    let found = held.receive(&mut client).await;
    let names: Vec<&str> = found.resources.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, vec!["c1//Pod/bookinfo/sleep"]);
    assert_eq!(
        found.removed_resources,
        vec!["network1/10.10.1.30"],
        "the name looked up is answered"
    );

    client.request(DeltaDiscoveryRequest {
        type_url: ADDRESS.into(),
        resource_names_subscribe: vec![REVIEWS.into(), "network1/10.0.0.99".into()],
        ..Default::default()
    });
    let found = held.receive(&mut client).await;
    let mut names: Vec<&str> = found.resources.iter().map(|r| r.name.as_str()).collect();
    names.sort();
    assert_eq!(
        names,
        vec![
            REVIEWS,
            "c1//Pod/bookinfo/reviews-a",
            "c1//Pod/bookinfo/reviews-b",
            split_horizon("network2", "192.0.2.2").as_str(),
        ]
    );
    assert!(
        found
            .removed_resources
            .contains(&"network1/10.0.0.99".to_string()),
        "an unknown address is reported absent"
    );
}

/// Waypoints (Gateways of class istio-waypoint): `waypoint` for bookinfo's services (the
/// namespace's label), `shared` in `infra` for every namespace's (`ratings` names it), and
/// `pod-waypoint` for workloads (`notifier` names it).
const WAYPOINTS: &str = "
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {name: waypoint, namespace: bookinfo}
spec:
  gatewayClassName: istio-waypoint
  listeners: [{name: mesh, port: 15008, protocol: HBONE}]
---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {name: pod-waypoint, namespace: bookinfo, labels: {istio.io/waypoint-for: workload}}
spec:
  gatewayClassName: istio-waypoint
  listeners: [{name: mesh, port: 15008, protocol: HBONE}]
---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {name: shared, namespace: infra, labels: {istio.io/waypoint-for: all}}
spec:
  gatewayClassName: istio-waypoint
  listeners: [{name: mesh, port: 15008, protocol: HBONE, allowedRoutes: {namespaces: {from: All}}}]
";

/// c1's additions: bookinfo labelled with its waypoint, a service opting out, one naming the
/// shared waypoint, a pod naming the workload waypoint, and (when `ready`) the waypoints' own
/// Services.
fn c1_with_waypoints(ready: bool) -> String {
    let mut yaml = c1(true);
    yaml.push_str(
        "---
apiVersion: v1
kind: Namespace
metadata: {name: bookinfo, labels: {istio.io/use-waypoint: waypoint}}
---
apiVersion: v1
kind: Service
metadata: {name: details, namespace: bookinfo, labels: {istio.io/use-waypoint: none}}
spec: {clusterIP: 10.96.1.21, selector: {app: details}, ports: [{name: http, port: 9080}]}
---
apiVersion: v1
kind: Service
metadata:
  name: ratings
  namespace: bookinfo
  labels: {istio.io/use-waypoint: shared, istio.io/use-waypoint-namespace: infra}
spec: {clusterIP: 10.96.1.22, selector: {app: ratings}, ports: [{name: http, port: 9080}]}
---
apiVersion: v1
kind: Pod
metadata: {name: notifier, namespace: bookinfo, labels: {app: notifier, istio.io/use-waypoint: pod-waypoint}}
spec: {serviceAccountName: notifier, nodeName: node-network1, containers: []}
status: {podIP: 10.10.1.50, conditions: [{type: Ready, status: 'True'}]}
",
    );
    if ready {
        let own = [
            ("waypoint", "bookinfo", "10.96.1.30"),
            ("pod-waypoint", "bookinfo", "10.96.1.31"),
            ("shared", "infra", "10.96.1.32"),
        ];
        for (name, namespace, vip) in own {
            yaml.push_str(&format!(
                "---
apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: {namespace}, labels: {{gateway.istio.io/managed: istio.io-mesh-controller}}}}
spec: {{clusterIP: {vip}, selector: {{gateway.networking.k8s.io/gateway-name: {name}}}, ports: [{{name: mesh, port: 15008}}]}}
"
            ));
        }
    }
    yaml
}

fn waypoint_host(waypoint: Option<&wl::GatewayAddress>) -> Option<(String, String, u32)> {
    let waypoint = waypoint?;
    match waypoint.destination.as_ref()? {
        wl::gateway_address::Destination::Hostname(h) => Some((
            h.namespace.clone(),
            h.hostname.clone(),
            waypoint.hbone_mtls_port,
        )),
        other => panic!("a waypoint is referenced by hostname, not {other:?}"),
    }
}

#[tokio::test]
async fn services_and_workloads_name_their_ready_waypoint() {
    let dir = tempfile::tempdir().unwrap();
    write_tree(dir.path());
    let c1_file = dir.path().join("clusters/c1/mesh.yaml");
    write_atomic(&c1_file, &c1_with_waypoints(false));
    write_atomic(&dir.path().join("config/waypoints.yaml"), WAYPOINTS);
    let mp = start_meshpilot(dir.path(), &[]).await;
    let mut client = ztunnel(mp.xds_addr, "10.10.1.5", "c1").await;
    let mut held = Held::first_of_both(&mut client).await;
    held.until(&mut client, "the waypoints' namespace", |h| {
        h.addresses.contains_key("c1//Pod/bookinfo/notifier")
    })
    .await;
    // Their Services do not exist yet: not ready, so nothing names them.
    assert_eq!(waypoint_host(held.service(REVIEWS).waypoint.as_ref()), None);
    let notifier = held.workload("c1//Pod/bookinfo/notifier");
    assert_eq!(waypoint_host(notifier.waypoint.as_ref()), None);

    write_atomic(&c1_file, &c1_with_waypoints(true));
    let waypoint = |name: &str| {
        Some((
            "bookinfo".to_string(),
            format!("{name}.bookinfo.svc.cluster.local"),
            15008,
        ))
    };
    held.until(&mut client, "the services' waypoint", |h| {
        waypoint_host(h.service(REVIEWS).waypoint.as_ref()) == waypoint("waypoint")
    })
    .await;
    // Another namespace's waypoint, admitting every namespace.
    let ratings = held.service("bookinfo/ratings.bookinfo.svc.cluster.local");
    assert_eq!(
        waypoint_host(ratings.waypoint.as_ref()),
        Some((
            "infra".to_string(),
            "shared.infra.svc.cluster.local".to_string(),
            15008
        ))
    );
    held.until(&mut client, "the workload's waypoint", |h| {
        let notifier = h.workload("c1//Pod/bookinfo/notifier");
        waypoint_host(notifier.waypoint.as_ref()) == waypoint("pod-waypoint")
    })
    .await;
    // The namespace's waypoint serves services only (the default `istio.io/waypoint-for`).
    let pod = held.workload("c1//Pod/bookinfo/reviews-a");
    assert_eq!(waypoint_host(pod.waypoint.as_ref()), None);
    let details = held.service("bookinfo/details.bookinfo.svc.cluster.local");
    assert_eq!(waypoint_host(details.waypoint.as_ref()), None, "opted out");
    // A waypoint's own Service has none, and its Service is sent for ztunnel to resolve it by.
    let own = held.service("bookinfo/waypoint.bookinfo.svc.cluster.local");
    assert_eq!(waypoint_host(own.waypoint.as_ref()), None);
    // A service of the other cluster (network2's reviews is the same service) keeps the reference.
    assert_eq!(
        waypoint_host(held.service(REVIEWS).waypoint.as_ref()),
        waypoint("waypoint")
    );

    // The waypoint Gateway goes: the services no longer name it.
    write_atomic(
        &dir.path().join("config/waypoints.yaml"),
        &WAYPOINTS.replace("name: waypoint,", "name: other,"),
    );
    held.until(&mut client, "the waypoint gone", |h| {
        h.service(REVIEWS).waypoint.is_none()
    })
    .await;
    let ratings = held.service("bookinfo/ratings.bookinfo.svc.cluster.local");
    assert!(ratings.waypoint.is_some(), "the other waypoint stays");
    let notifier = held.workload("c1//Pod/bookinfo/notifier");
    assert_eq!(
        waypoint_host(notifier.waypoint.as_ref()),
        waypoint("pod-waypoint")
    );
}
