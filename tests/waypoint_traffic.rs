//! Real HBONE through real Envoys configured by meshpilot as ambient mode's waypoint and east-west
//! gateway, each in its own network namespace, with a backend in a third. The test speaks as a
//! ztunnel would (mutual TLS 1.3 with a workload certificate from meshpilot's CA, then HTTP/2
//! CONNECT): to the waypoint by the service's VIP, and across networks by double HBONE — an outer
//! tunnel to the east-west gateway named by the service's hostname, an inner one inside it to the
//! service's waypoint, which the gateway must not let the tunnel past. The waypoint applies the
//! service's HTTPRoute and the AuthorizationPolicies targeting it to what the tunnels carry, and
//! takes traffic addressed to the pod, which uses it too.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::hbone::{get, mesh_client, open};
use common::netns::{link, proxy_in, Netns};
use common::*;
use envoy_types::pb::envoy::config::listener::v3::{filter, Listener};
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_connection_manager::RouteSpecifier, HttpConnectionManager,
};
use meshpilot::security::identity::Identity;
use prost::Message;

const BOUND: Duration = Duration::from_secs(30);
const WEB: &str = "web.shop.svc.cluster.local";
const WEB_VIP: &str = "10.96.5.5";
const BACKEND: &str = "10.215.1.2";
/// The waypoint's pod: the backend's network side, and the east-west gateway's.
const WAYPOINT_POD: &str = "10.215.2.2";
const WAYPOINT_CTL: &str = "10.215.11.2";
const EAST_WEST_CTL: &str = "10.215.12.2";
const WAYPOINT_NODE: &str = "waypoint~10.215.2.2~waypoint-0.shop~shop.svc.cluster.local";
const EAST_WEST_NODE: &str =
    "waypoint~10.215.12.2~eastwest-0.istio-system~istio-system.svc.cluster.local";

/// c1 on network net1: `web` (one plain pod, not captured) in `shop`, whose namespace names the
/// waypoint `waypoint`, and the waypoint's own Service and pod.
fn manifests() -> String {
    format!(
        "
apiVersion: v1
kind: Namespace
metadata: {{name: istio-system, labels: {{topology.istio.io/network: net1}}}}
---
apiVersion: v1
kind: Namespace
metadata: {{name: shop, labels: {{istio.io/use-waypoint: waypoint}}}}
---
apiVersion: v1
kind: Service
metadata: {{name: web, namespace: shop}}
spec: {{clusterIP: {WEB_VIP}, selector: {{app: web}}, ports: [{{name: http, port: 80, targetPort: 8080}}]}}
---
apiVersion: v1
kind: Pod
metadata: {{name: web-0, namespace: shop, labels: {{app: web, istio.io/use-waypoint: waypoint}}}}
spec: {{serviceAccountName: web, containers: []}}
status: {{podIP: {BACKEND}, conditions: [{{type: Ready, status: 'True'}}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: web-1, namespace: shop, labels: {{kubernetes.io/service-name: web}}}}
addressType: IPv4
ports: [{{name: http, port: 8080}}]
endpoints: [{{addresses: [{BACKEND}], conditions: {{ready: true}}, targetRef: {{kind: Pod, name: web-0, namespace: shop}}}}]
---
apiVersion: v1
kind: Service
metadata: {{name: waypoint, namespace: shop, labels: {{gateway.istio.io/managed: istio.io-mesh-controller}}}}
spec: {{clusterIP: 10.96.5.6, selector: {{gateway.networking.k8s.io/gateway-name: waypoint}}, ports: [{{name: mesh, port: 15008}}]}}
---
apiVersion: v1
kind: Pod
metadata: {{name: waypoint-0, namespace: shop, labels: {{gateway.networking.k8s.io/gateway-name: waypoint}}}}
spec: {{serviceAccountName: waypoint, containers: []}}
status: {{podIP: {WAYPOINT_POD}, conditions: [{{type: Ready, status: 'True'}}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: waypoint-1, namespace: shop, labels: {{kubernetes.io/service-name: waypoint}}}}
addressType: IPv4
ports: [{{name: mesh, port: 15008}}]
endpoints: [{{addresses: [{WAYPOINT_POD}], conditions: {{ready: true}}, targetRef: {{kind: Pod, name: waypoint-0, namespace: shop}}}}]
"
    )
}

/// Policies on the waypoint (by targetRefs, as Istio's ambient guides write them): only
/// frontend's `sleep` may call, and never `/forbidden` on the service's port (TCP to the pod
/// has no path: a DENY naming only a path would cut all of it, as istiod's).
const POLICIES: &str = "
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: only-sleep, namespace: shop}
spec:
  targetRefs: [{kind: Gateway, group: gateway.networking.k8s.io, name: waypoint}]
  action: ALLOW
  rules: [{from: [{source: {principals: [cluster.local/ns/frontend/sa/sleep]}}]}]
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: no-forbidden, namespace: shop}
spec:
  targetRefs: [{kind: Gateway, group: gateway.networking.k8s.io, name: waypoint}]
  action: DENY
  rules: [{to: [{operation: {paths: [/forbidden], ports: ['80']}}]}]
";

/// The waypoint, and the east-west gateway as Istio's multicluster guide writes it.
const GATEWAYS: &str = "
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {name: waypoint, namespace: shop, labels: {istio.io/waypoint-for: all}}
spec:
  gatewayClassName: istio-waypoint
  listeners: [{name: mesh, port: 15008, protocol: HBONE}]
---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata:
  name: eastwest
  namespace: istio-system
  labels: {topology.istio.io/network: net1}
spec:
  gatewayClassName: istio-east-west
  listeners:
  - name: mesh
    port: 15008
    protocol: HBONE
    tls:
      mode: Terminate
      options: {gateway.istio.io/tls-terminate-mode: ISTIO_MUTUAL}
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: web, namespace: shop}
spec:
  parentRefs: [{group: '', kind: Service, name: web, port: 80}]
  rules:
  - filters:
    - type: RequestHeaderModifier
      requestHeaderModifier: {add: [{name: x-waypoint, value: processed}]}
    backendRefs: [{name: web, port: 80}]
---
apiVersion: networking.istio.io/v1alpha3
kind: EnvoyFilter
metadata: {name: waypoint-buffers, namespace: shop}
spec:
  workloadSelector: {labels: {gateway.networking.k8s.io/gateway-name: waypoint}}
  configPatches:
  - applyTo: LISTENER
    match: {context: SIDECAR_INBOUND, listener: {name: connect_terminate}}
    patch: {operation: MERGE, value: {per_connection_buffer_limit_bytes: 65536}}
---
apiVersion: telemetry.istio.io/v1
kind: Telemetry
metadata: {name: waypoint-logs, namespace: shop}
spec:
  targetRefs: [{kind: Gateway, group: gateway.networking.k8s.io, name: waypoint}]
  accessLogging: [{providers: [{name: envoy}]}]
";

/// A GET in one tunnel to the waypoint, named `authority`: the waypoint's identity as the
/// tunnel's peer, the status and body (None when no tunnel opens or it is cut).
async fn via_waypoint(
    client: Arc<rustls::ClientConfig>,
    authority: &str,
    path: &str,
) -> Option<(Vec<Identity>, u16, String)> {
    let tcp = tokio::net::TcpStream::connect((WAYPOINT_CTL, 15008))
        .await
        .ok()?;
    let tunnel = open(tcp, client, authority).await.ok()?;
    let peer = tunnel.peer.clone();
    let (status, body) = get(tunnel.stream, WEB, path).await.ok()?;
    Some((peer, status, body))
}

/// A listener's connection manager (its first chain's first filter).
fn manager_of(listener: &Listener) -> HttpConnectionManager {
    match &listener.filter_chains[0].filters[0].config_type {
        Some(filter::ConfigType::TypedConfig(any)) => {
            HttpConnectionManager::decode(&any.value[..]).unwrap()
        }
        other => panic!("{}: no connection manager: {other:?}", listener.name),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hbone_reaches_the_service_through_its_waypoint_also_across_networks() {
    let tag = std::process::id() % 100_000;
    let waypoint_ns = Netns::create(&format!("wpw{tag}"));
    let east_west_ns = Netns::create(&format!("wpe{tag}"));
    let mut backend_ns = Netns::create(&format!("wpb{tag}"));
    link(
        None,
        &format!("wpw{tag}h"),
        "10.215.11.1/24",
        &waypoint_ns,
        "ctl",
        "10.215.11.2/24",
    );
    link(
        None,
        &format!("wpe{tag}h"),
        "10.215.12.1/24",
        &east_west_ns,
        "ctl",
        "10.215.12.2/24",
    );
    link(
        Some(&waypoint_ns),
        "pods",
        "10.215.1.1/24",
        &backend_ns,
        "data",
        "10.215.1.2/24",
    );
    link(
        Some(&east_west_ns),
        "pods",
        "10.215.2.1/24",
        &waypoint_ns,
        "eastwest",
        "10.215.2.2/24",
    );
    backend_ns.serve_http_echo(8080);

    let dir = tempfile::tempdir().unwrap();
    let c1 = dir.path().join("clusters/c1");
    std::fs::create_dir_all(&c1).unwrap();
    write_atomic(&c1.join("mesh.yaml"), &manifests());
    std::fs::create_dir_all(dir.path().join("config")).unwrap();
    write_atomic(&dir.path().join("config/gateways.yaml"), GATEWAYS);
    let mp = start_meshpilot(dir.path(), &["--xds-addr", "0.0.0.0:0"]).await;

    // What meshpilot sends the waypoint, decoded: its tunnel listener routes the VIP and the
    // hostname authorities of web's port to web's cluster.
    let listeners: Vec<Listener> = ads::fetch(
        mp.xds_addr,
        labelled_node(
            WAYPOINT_NODE,
            &[("CLUSTER_ID", "c1")],
            &[("gateway.networking.k8s.io/gateway-name", "waypoint")],
        ),
        "type.googleapis.com/envoy.config.listener.v3.Listener",
        &[],
    )
    .await;
    let names: Vec<&str> = listeners.iter().map(|l| l.name.as_str()).collect();
    let http = format!("main_internal|80|{WEB}");
    assert_eq!(
        names,
        [
            "connect_terminate",
            "connect_originate",
            &http,
            "direct-tcp"
        ]
    );
    assert_eq!(
        listeners[0]
            .per_connection_buffer_limit_bytes
            .map(|v| v.value),
        Some(65536),
        "the EnvoyFilter selecting the waypoint"
    );
    let processing = manager_of(&listeners[2]);
    assert_eq!(
        processing.access_log.len(),
        1,
        "the Telemetry targeting the waypoint"
    );
    let manager = manager_of(&listeners[0]);
    let Some(RouteSpecifier::RouteConfig(routes)) = manager.route_specifier else {
        panic!("routes inline");
    };
    let hosts: Vec<(&str, Vec<&str>)> = routes
        .virtual_hosts
        .iter()
        .map(|v| {
            (
                v.name.as_str(),
                v.domains.iter().map(String::as_str).collect(),
            )
        })
        .collect();
    let (vip, host) = (format!("{WEB_VIP}:80"), format!("{WEB}:80"));
    let pod = format!("{BACKEND}:*");
    assert_eq!(
        hosts,
        [
            (http.as_str(), vec![host.as_str(), vip.as_str()]),
            ("direct-tcp", vec![pod.as_str()])
        ]
    );
    let cluster = format!("inbound-vip|80|http|{WEB}");
    let passed_on = format!("inbound-vip|80|tcp|{WEB}");

    let waypoint = proxy_in(
        &mp,
        &waypoint_ns,
        WAYPOINT_NODE,
        &[("gateway.networking.k8s.io/gateway-name", "waypoint")],
        "waypoint",
        (WAYPOINT_CTL, "10.215.11.1"),
        false,
    )
    .await;
    let east_west = proxy_in(
        &mp,
        &east_west_ns,
        EAST_WEST_NODE,
        &[("gateway.networking.k8s.io/gateway-name", "eastwest")],
        "eastwest",
        (EAST_WEST_CTL, "10.215.12.1"),
        false,
    )
    .await;
    wait_for("the waypoint's endpoints of web", BOUND, || {
        let (waypoint, cluster) = (&waypoint, cluster.clone());
        async move { (waypoint.endpoints(&cluster).await == [format!("{BACKEND}:8080")]).then_some(()) }
    })
    .await;
    wait_for("the gateway's route to web's waypoint", BOUND, || {
        let (east_west, cluster) = (&east_west, passed_on.clone());
        async move {
            let endpoints = east_west.endpoints(&cluster).await;
            // The waypoint's pod, on HBONE's port, through the internal listener.
            let via = format!("envoy://forward_inner_connect/{WAYPOINT_POD}:15008");
            (endpoints == [via]).then_some(())
        }
    })
    .await;

    let client = mesh_client(&workload_certs(&mp, "frontend", "sleep"));
    let waypoint_identity = Identity::new("cluster.local", "shop", "waypoint");

    // A ztunnel of the waypoint's network: one tunnel to the waypoint, named by web's VIP.
    let vip = format!("{WEB_VIP}:80");
    let (peer, status, body) = wait_for("a request through the waypoint", BOUND, || {
        via_waypoint(client.clone(), &vip, "/through-waypoint")
    })
    .await;
    assert_eq!(peer, std::slice::from_ref(&waypoint_identity));
    assert_eq!(status, 200, "{body}");
    let answer: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer["path"], "/through-waypoint");
    assert_eq!(answer["server"], BACKEND);
    assert_eq!(
        answer["headers"]["x-waypoint"], "processed",
        "the route's filter"
    );

    // Traffic addressed to the pod itself (it uses the waypoint for that too): `<pod IP>:<port>`.
    let pod = format!("{BACKEND}:8080");
    let (_, status, body) = wait_for("a request to the pod through the waypoint", BOUND, || {
        via_waypoint(client.clone(), &pod, "/to-the-pod")
    })
    .await;
    assert_eq!(status, 200, "{body}");
    let answer: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer["path"], "/to-the-pod");
    assert_eq!(answer["server"], BACKEND);

    // An authority the waypoint does not serve opens no tunnel.
    let tcp = tokio::net::TcpStream::connect((WAYPOINT_CTL, 15008))
        .await
        .unwrap();
    let refused = open(tcp, client.clone(), "10.96.99.99:80").await.err();
    assert_eq!(refused.as_deref(), Some("CONNECT answered 404 Not Found"));

    // Another network's ztunnel: double HBONE. The outer tunnel ends at the east-west gateway
    // (named by web's hostname); the inner one, inside it, at web's waypoint.
    let (status, body) = wait_for("a request across networks", BOUND, || {
        let (client, waypoint_identity) = (client.clone(), waypoint_identity.clone());
        async move {
            let tcp = tokio::net::TcpStream::connect((EAST_WEST_CTL, 15008))
                .await
                .ok()?;
            let outer = open(tcp, client.clone(), &format!("{WEB}:80")).await.ok()?;
            assert_eq!(
                outer.peer,
                [Identity::new("cluster.local", "istio-system", "eastwest")]
            );
            let inner = open(outer.stream, client, &format!("{WEB}:80"))
                .await
                .ok()?;
            assert_eq!(
                inner.peer,
                std::slice::from_ref(&waypoint_identity),
                "past the waypoint"
            );
            get(inner.stream, WEB, "/across-networks").await.ok()
        }
    })
    .await;
    assert_eq!(status, 200, "{body}");
    let answer: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer["path"], "/across-networks");
    assert_eq!(answer["server"], BACKEND);
    assert_eq!(answer["headers"]["x-waypoint"], "processed");
    assert!(
        east_west
            .counter(&format!("cluster.{passed_on}.upstream_cx_total"))
            .await
            >= 1
    );
    assert!(
        waypoint
            .counter(&format!("cluster.{cluster}.upstream_rq_total"))
            .await
            >= 2,
        "both requests through the waypoint's HTTP processing"
    );

    // Policies targeting the waypoint are enforced on what the tunnels carry, on the identity
    // of the tunnel's peer (the client workload's).
    write_atomic(&dir.path().join("config/policies.yaml"), POLICIES);
    let intruder = mesh_client(&workload_certs(&mp, "frontend", "intruder"));
    let status_of = |client: &Arc<rustls::ClientConfig>, authority: &str, path: &str| {
        let (client, authority, path) = (client.clone(), authority.to_string(), path.to_string());
        async move {
            let answer = via_waypoint(client, &authority, &path).await;
            answer.map(|(_, status, _)| status)
        }
    };
    wait_for("the waypoint's DENY", BOUND, || async {
        (status_of(&client, &vip, "/forbidden").await? == 403).then_some(())
    })
    .await;
    assert_eq!(status_of(&client, &vip, "/allowed").await, Some(200));
    assert_eq!(
        status_of(&intruder, &vip, "/allowed").await,
        Some(403),
        "only sleep is allowed"
    );
    // To the pod itself, too: its TCP is cut for another identity.
    assert_eq!(status_of(&client, &pod, "/pod").await, Some(200));
    assert_eq!(
        status_of(&intruder, &pod, "/pod").await,
        None,
        "only sleep reaches the pod"
    );

    // The waypoint's pod moves: the gateway follows it (its endpoints are named after web).
    let moved = "10.215.2.9";
    write_atomic(
        &c1.join("mesh.yaml"),
        &manifests().replace(WAYPOINT_POD, moved),
    );
    wait_for("the gateway following the waypoint's pod", BOUND, || {
        let (east_west, cluster) = (&east_west, passed_on.clone());
        let via = format!("envoy://forward_inner_connect/{moved}:15008");
        async move { (east_west.endpoints(&cluster).await == [via]).then_some(()) }
    })
    .await;
}
