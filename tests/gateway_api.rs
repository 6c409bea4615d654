//! The Kubernetes Gateway API as gateways and sidecars receive it, decoded from raw ADS streams:
//! a Gateway's listeners and its HTTPRoutes (ordered by the API's precedence, filters, weights),
//! TLS and TCP routes, a mesh route at a client sidecar, and references across namespaces held
//! back until a ReferenceGrant allows them, with the status `/debug/configz` reports.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use envoy_types::pb::envoy::config::listener::v3::Listener;
use envoy_types::pb::envoy::config::route::v3::{
    route, route_action::ClusterSpecifier, route_match::PathSpecifier, RouteConfiguration,
};
use prost::Message;
use serde_json::Value;

use common::*;

const BOUND: Duration = Duration::from_secs(10);
const LDS: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
const RDS: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
const GATEWAY_NODE: &str = "router~10.30.0.5~web-6d4f-x1.shop~shop.svc.cluster.local";
const CLIENT_NODE: &str = "sidecar~10.30.2.2~client-1.shop~shop.svc.cluster.local";

const CLUSTER: &str = "
apiVersion: v1
kind: Service
metadata: {name: cart, namespace: shop}
spec: {clusterIP: 10.96.40.40, ports: [{name: http, port: 8080}]}
---
apiVersion: v1
kind: Service
metadata: {name: cart-v2, namespace: shop}
spec: {clusterIP: 10.96.40.41, ports: [{name: http, port: 8080}]}
---
apiVersion: v1
kind: Service
metadata: {name: reviews, namespace: books}
spec: {clusterIP: 10.96.40.42, ports: [{name: http, port: 9080}]}
---
apiVersion: v1
kind: Service
metadata: {name: db, namespace: shop}
spec: {clusterIP: 10.96.40.43, ports: [{name: tcp, port: 5432}]}
";

const CONFIG: &str = "
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {name: web, namespace: shop}
spec:
  gatewayClassName: istio
  listeners:
  - {name: http, port: 8080, protocol: HTTP, hostname: '*.example.com',
     allowedRoutes: {namespaces: {from: All}}}
  - {name: db, port: 5432, protocol: TCP}
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: cart, namespace: shop, creationTimestamp: '2026-01-01T00:00:00Z'}
spec:
  parentRefs: [{name: web, sectionName: http}]
  hostnames: [shop.example.com]
  rules:
  - matches: [{path: {type: PathPrefix, value: /cart}}]
    filters:
    - type: RequestHeaderModifier
      requestHeaderModifier: {set: [{name: X-Via, value: gateway}]}
    backendRefs: [{name: cart, port: 8080, weight: 80}, {name: cart-v2, port: 8080, weight: 20}]
  - matches: [{path: {type: Exact, value: /cart/checkout}}]
    filters:
    - type: RequestRedirect
      requestRedirect: {scheme: https, statusCode: 301}
---
# A newer route, in another namespace, for the same host; its backend is in a third namespace.
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: reviews, namespace: front, creationTimestamp: '2026-02-01T00:00:00Z'}
spec:
  parentRefs: [{name: web, namespace: shop}]
  hostnames: [shop.example.com, other.org]
  rules:
  - matches: [{path: {value: /cart/reviews}, headers: [{name: x-beta, value: 'yes'}]}]
    backendRefs: [{name: reviews, namespace: books, port: 9080}]
---
apiVersion: gateway.networking.k8s.io/v1alpha2
kind: TCPRoute
metadata: {name: db, namespace: shop}
spec:
  parentRefs: [{name: web, sectionName: db}]
  rules: [{backendRefs: [{name: db, port: 5432}]}]
---
# A mesh route: the shop's clients of cart send /beta to cart-v2.
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: cart-mesh, namespace: shop}
spec:
  parentRefs: [{group: '', kind: Service, name: cart, port: 8080}]
  rules:
  - matches: [{path: {value: /beta}}]
    backendRefs: [{name: cart-v2, port: 8080}]
  - backendRefs: [{name: cart, port: 8080}]
";

const GRANT: &str = "
apiVersion: gateway.networking.k8s.io/v1beta1
kind: ReferenceGrant
metadata: {name: front-routes, namespace: books}
spec:
  from: [{group: gateway.networking.k8s.io, kind: HTTPRoute, namespace: front}]
  to: [{group: '', kind: Service}]
";

async fn start() -> (meshpilot::app::Running, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let cluster = dir.path().join("clusters/c1");
    std::fs::create_dir_all(&cluster).unwrap();
    std::fs::create_dir_all(dir.path().join("config")).unwrap();
    std::fs::write(cluster.join("mesh.yaml"), CLUSTER).unwrap();
    std::fs::write(dir.path().join("config/gateway.yaml"), CONFIG).unwrap();
    let mp = start_meshpilot(dir.path(), &["--debounce-after", "0s"]).await;
    (mp, dir)
}

/// The resources of one type a node is sent (named ones for RDS).
async fn fetch<T: Message + Default>(
    mp: &meshpilot::app::Running,
    id: &str,
    labels: &[(&str, &str)],
    type_url: &str,
    names: &[&str],
) -> Vec<T> {
    let node = labelled_node(id, &[("CLUSTER_ID", "c1")], labels);
    common::ads::fetch(mp.xds_addr, node, type_url, names).await
}

const GATEWAY_LABELS: &[(&str, &str)] = &[("gateway.networking.k8s.io/gateway-name", "web")];

/// Each route of a virtual host: (path, action summary).
fn summary(config: &RouteConfiguration, domain: &str) -> Vec<(String, String)> {
    let host = config
        .virtual_hosts
        .iter()
        .find(|v| v.domains.iter().any(|d| d == domain))
        .unwrap_or_else(|| panic!("no virtual host {domain}: {config:?}"));
    host.routes
        .iter()
        .map(|r| {
            let path = match r.r#match.as_ref().and_then(|m| m.path_specifier.as_ref()) {
                Some(PathSpecifier::Path(p)) => format!("={p}"),
                Some(PathSpecifier::Prefix(p)) => format!("^{p}"),
                Some(PathSpecifier::PathSeparatedPrefix(p)) => p.clone(),
                other => format!("{other:?}"),
            };
            let action = match &r.action {
                Some(route::Action::Route(a)) => match &a.cluster_specifier {
                    Some(ClusterSpecifier::Cluster(c)) => c.clone(),
                    Some(ClusterSpecifier::WeightedClusters(w)) => w
                        .clusters
                        .iter()
                        .map(|c| format!("{}={}", c.name, c.weight.as_ref().map_or(0, |w| w.value)))
                        .collect::<Vec<_>>()
                        .join(","),
                    other => format!("{other:?}"),
                },
                Some(route::Action::Redirect(_)) => "redirect".into(),
                Some(route::Action::DirectResponse(d)) => format!("status {}", d.status),
                other => format!("{other:?}"),
            };
            (path, action)
        })
        .collect()
}

fn status_of(configz: &Value, kind: &str, name: &str) -> Value {
    configz
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name && o["status"] == "accepted")
        .unwrap_or_else(|| panic!("no accepted {kind} {name}: {configz}"))["gatewayApiStatus"]
        .clone()
}

fn condition(conditions: &Value, kind: &str) -> (String, String) {
    let c = conditions
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == kind)
        .unwrap_or_else(|| panic!("no {kind} in {conditions}"));
    (
        c["status"].as_str().unwrap().to_string(),
        c["reason"].as_str().unwrap().to_string(),
    )
}

#[tokio::test]
async fn gateway_listeners_and_routes_in_the_apis_precedence() {
    let (mp, dir) = start().await;
    let listeners: Vec<Listener> = fetch(&mp, GATEWAY_NODE, GATEWAY_LABELS, LDS, &[]).await;
    let names: Vec<&str> = listeners.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(names, ["0.0.0.0_5432", "0.0.0.0_8080"]);
    // A proxy of another Gateway (or none) serves none of it.
    let other: Vec<Listener> = fetch(
        &mp,
        GATEWAY_NODE,
        &[("gateway.networking.k8s.io/gateway-name", "other")],
        LDS,
        &[],
    )
    .await;
    assert!(other.is_empty(), "{other:?}");

    let routes: Vec<RouteConfiguration> =
        fetch(&mp, GATEWAY_NODE, GATEWAY_LABELS, RDS, &["http.8080"]).await;
    let cart = summary(&routes[0], "shop.example.com");
    assert_eq!(
        cart,
        [
            ("=/cart/checkout".to_string(), "redirect".to_string()),
            (
                "/cart/reviews".to_string(),
                "outbound|9080||UnknownService.shop.svc.cluster.local".to_string()
            ),
            (
                "/cart".to_string(),
                "outbound|8080||cart.shop.svc.cluster.local=80,\
                 outbound|8080||cart-v2.shop.svc.cluster.local=20"
                    .to_string()
            ),
        ],
        "the reviews route answers 500: its backend's namespace grants nothing"
    );
    // Requests for a backend the route may not use answer 500, as the API requires.
    let held_back = &routes[0].virtual_hosts[0].routes[1];
    let Some(route::Action::Route(action)) = &held_back.action else {
        panic!("{held_back:?}")
    };
    assert_eq!(action.cluster_not_found_response_code, 2, "500");
    let configz = get_json(mp.http_addr, "/debug/configz").await;
    let reviews = status_of(&configz, "HTTPRoute", "reviews");
    assert_eq!(
        condition(&reviews["parents"][0]["conditions"], "ResolvedRefs"),
        ("False".into(), "RefNotPermitted".into())
    );
    assert_eq!(
        condition(&reviews["parents"][0]["conditions"], "Accepted"),
        ("True".into(), "Accepted".into())
    );
    let web = status_of(&configz, "Gateway", "web");
    assert_eq!(web["listeners"][0]["attachedRoutes"], 2, "{web}");
    assert_eq!(condition(&web["conditions"], "Programmed").0, "True");

    // The grant lets the reviews route reach its backend; other.org is left out (the listener
    // serves *.example.com only).
    std::fs::write(dir.path().join("config/grant.yaml"), GRANT).unwrap();
    let cart = wait_for("the granted route", BOUND, || async {
        let routes: Vec<RouteConfiguration> =
            fetch(&mp, GATEWAY_NODE, GATEWAY_LABELS, RDS, &["http.8080"]).await;
        let cart = summary(&routes[0], "shop.example.com");
        (!cart[1].1.contains("UnknownService")).then_some((cart, routes))
    })
    .await;
    let (cart, routes) = cart;
    assert_eq!(cart[0].0, "=/cart/checkout");
    assert_eq!(
        cart[1],
        (
            "/cart/reviews".to_string(),
            "outbound|9080||reviews.books.svc.cluster.local".to_string()
        )
    );
    assert!(!routes[0]
        .virtual_hosts
        .iter()
        .any(|v| v.domains.iter().any(|d| d == "other.org")));
    let via = &routes[0].virtual_hosts[0].routes[2].request_headers_to_add;
    assert_eq!(via[0].header.as_ref().unwrap().key, "x-via");
    let configz = get_json(mp.http_addr, "/debug/configz").await;
    let reviews = status_of(&configz, "HTTPRoute", "reviews");
    assert_eq!(
        condition(&reviews["parents"][0]["conditions"], "ResolvedRefs").0,
        "True"
    );
}

#[tokio::test]
async fn a_mesh_route_changes_where_a_sidecars_requests_go() {
    let (mp, _dir) = start().await;
    let routes: Vec<RouteConfiguration> = fetch(&mp, CLIENT_NODE, &[], RDS, &["8080"]).await;
    let cart = summary(&routes[0], "cart.shop.svc.cluster.local");
    assert_eq!(
        cart,
        [
            (
                "/beta".to_string(),
                "outbound|8080||cart-v2.shop.svc.cluster.local".to_string()
            ),
            (
                "^/".to_string(),
                "outbound|8080||cart.shop.svc.cluster.local".to_string()
            ),
        ]
    );
    let by_name: BTreeMap<String, usize> = routes[0]
        .virtual_hosts
        .iter()
        .map(|v| (v.name.clone(), v.routes.len()))
        .collect();
    assert!(
        by_name.len() > 1,
        "other services keep their default routes"
    );
}

/// From a config cluster: the leader writes each route's and Gateway's status to its status
/// subresource (with the API's transition times), again only when it changes; and deploys the
/// Gateway (updated with it, removed with it by the garbage collector).
#[tokio::test]
async fn the_leader_writes_the_status_of_config_cluster_objects() {
    use common::config_source::{ConfigFixture, Source};
    let namespaces = ["shop", "front", "books"]
        .map(|ns| format!("apiVersion: v1\nkind: Namespace\nmetadata: {{name: {ns}}}\n"))
        .join("---\n");
    let objects = format!("{namespaces}---{CLUSTER}---{CONFIG}");
    let fixture =
        ConfigFixture::start(Source::ConfigCluster, &[("gateway.yaml", &objects)], &[]).await;
    let api = fixture.api().expect("a config cluster");
    let resolved = |api: &test_apiserver::TestApiServer| {
        let route = api.get("HTTPRoute", "front", "reviews")?;
        let conditions = &route["status"]["parents"][0]["conditions"];
        conditions.as_array()?;
        Some((
            condition(conditions, "ResolvedRefs"),
            route["status"].clone(),
        ))
    };
    let (refs, status) = wait_for("the reviews route's status", BOUND, || async {
        resolved(api)
    })
    .await;
    assert_eq!(refs, ("False".into(), "RefNotPermitted".into()));
    let parent = &status["parents"][0];
    assert_eq!(parent["controllerName"], "istio.io/gateway-controller");
    assert_eq!(parent["parentRef"]["name"], "web");
    assert!(
        parent["conditions"][0]["lastTransitionTime"].is_string(),
        "{status}"
    );

    let web = wait_for("the Gateway's status", BOUND, || async {
        let web = api.get("Gateway.gateway.networking.k8s.io", "shop", "web")?;
        web["status"]["listeners"].is_array().then_some(web)
    })
    .await;
    assert_eq!(web["status"]["listeners"][0]["attachedRoutes"], 2, "{web}");
    assert_eq!(
        web["status"]["listeners"][0]["supportedKinds"][0]["kind"],
        "HTTPRoute"
    );

    // The grant resolves the reference; the status follows, and nothing else is rewritten.
    let writes = api.request_count("patch-status:gateways");
    api.apply_yaml(GRANT);
    wait_for("the granted reference resolved", BOUND, || async {
        let (refs, _) = resolved(api)?;
        (refs.0 == "True").then_some(())
    })
    .await;
    assert_eq!(api.request_count("patch-status:gateways"), writes);

    // Automated deployment: the Gateway's ServiceAccount, Deployment and Service, owned by it.
    let uid = web["metadata"]["uid"].clone();
    let service = wait_for("the deployed Service", BOUND, || async {
        api.get("Service", "shop", "web-istio")
    })
    .await;
    assert_eq!(service["metadata"]["ownerReferences"][0]["uid"], uid);
    let ports: Vec<i64> = service["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["port"].as_i64().unwrap())
        .collect();
    assert_eq!(ports, [15021, 8080, 5432]);
    let deployment = api
        .get("Deployment", "shop", "web-istio")
        .expect("a Deployment");
    let pod = &deployment["spec"]["template"];
    assert_eq!(
        pod["metadata"]["labels"]["gateway.networking.k8s.io/gateway-name"],
        "web"
    );
    assert_eq!(pod["spec"]["serviceAccountName"], "web-istio");
    assert!(api.get("ServiceAccount", "shop", "web-istio").is_some());

    // A new listener updates the Service; deleting the Gateway takes its objects with it.
    let mut gateway = web.clone();
    gateway["spec"]["listeners"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({"name": "admin", "port": 9901, "protocol": "HTTP"}));
    gateway.as_object_mut().unwrap().remove("status");
    api.apply(gateway);
    wait_for("the Service's new port", BOUND, || async {
        let service = api.get("Service", "shop", "web-istio")?;
        let ports = service["spec"]["ports"].as_array()?.clone();
        ports.iter().any(|p| p["port"] == 9901).then_some(())
    })
    .await;
    api.delete("Gateway.gateway.networking.k8s.io", "shop", "web");
    for kind in ["Service", "Deployment", "ServiceAccount"] {
        assert!(
            api.get(kind, "shop", "web-istio").is_none(),
            "{kind} left behind"
        );
    }

    // The Gateway `istioctl waypoint apply` writes deploys a waypoint proxy named after it.
    api.apply_yaml(
        "
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {name: waypoint, namespace: shop, labels: {istio.io/waypoint-for: service}}
spec:
  gatewayClassName: istio-waypoint
  listeners: [{name: mesh, port: 15008, protocol: HBONE}]
",
    );
    let service = wait_for("the waypoint's Service", BOUND, || async {
        api.get("Service", "shop", "waypoint")
    })
    .await;
    assert_eq!(service["spec"]["type"], "ClusterIP");
    let ports: Vec<(i64, &str)> = service["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["port"].as_i64().unwrap(),
                p["appProtocol"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(ports, [(15021, "tcp"), (15008, "hbone")]);
    let deployment = api
        .get("Deployment", "shop", "waypoint")
        .expect("a Deployment");
    let proxy = &deployment["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(proxy["args"][1], "waypoint");
    let waypoint = wait_for("the waypoint's status", BOUND, || async {
        let gateway = api.get("Gateway.gateway.networking.k8s.io", "shop", "waypoint")?;
        gateway["status"]["conditions"]
            .is_array()
            .then_some(gateway)
    })
    .await;
    assert_eq!(
        condition(&waypoint["status"]["conditions"], "Programmed"),
        ("True".into(), "Programmed".into())
    );
}
