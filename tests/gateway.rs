//! What meshpilot sends gateways, decoded from raw ADS streams: listeners and routes from the
//! Gateways that select a router, and gateway certificates over SDS — only to a proxy proven on
//! the secure port, only from its own namespace, pushed again when the Secret changes.

mod common;

use std::time::Duration;

use envoy_types::pb::envoy::config::listener::v3::Listener;
use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::HttpConnectionManager;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    secret, DownstreamTlsContext, Secret,
};
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use prost::Message;

use common::gateway_certs::tls_secret;
use common::*;

const BOUND: Duration = Duration::from_secs(10);
const LISTENER: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
const ROUTE: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
const SECRET: &str = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";
const GATEWAY_NODE: &str = "router~10.30.0.5~ingress-0.istio-system~istio-system.svc.cluster.local";

const CLUSTER: &str = "
apiVersion: v1
kind: Service
metadata: {name: shop, namespace: default}
spec: {clusterIP: 10.96.40.40, ports: [{name: http, port: 8080}]}
---
apiVersion: v1
kind: Pod
metadata: {name: shop-1, namespace: default, labels: {app: shop}}
spec: {serviceAccountName: shop, containers: []}
status: {podIP: 10.30.1.1}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: shop-1, namespace: default, labels: {kubernetes.io/service-name: shop}}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints:
- {addresses: [10.30.1.1], conditions: {ready: true}, targetRef: {kind: Pod, name: shop-1, namespace: default}}
";

const CONFIG: &str = "
apiVersion: networking.istio.io/v1
kind: Gateway
metadata: {name: ingress, namespace: istio-system}
spec:
  selector: {istio: ingressgateway}
  servers:
  - port: {number: 8443, name: https, protocol: HTTPS}
    hosts: [shop.example.com]
    tls: {mode: SIMPLE, credentialName: shop-cert}
  - port: {number: 8080, name: http, protocol: HTTP}
    hosts: ['*']
    tls: {httpsRedirect: true}
  - port: {number: 9443, name: tls, protocol: TLS}
    hosts: [db.example.com]
    tls: {mode: PASSTHROUGH}
  - port: {number: 15012, name: tls-istiod, protocol: TLS}
    hosts: ['*']
    tls: {mode: PASSTHROUGH}
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: shop, namespace: default}
spec:
  hosts: [shop.example.com]
  gateways: [istio-system/ingress]
  http:
  - match: [{uri: {prefix: /cart}}]
    route: [{destination: {host: shop}}]
  tls:
  - match: [{sniHosts: [db.example.com]}]
    route: [{destination: {host: shop, port: {number: 8080}}}]
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: db, namespace: default}
spec:
  hosts: [db.example.com]
  gateways: [istio-system/ingress]
  tls:
  - match: [{sniHosts: [db.example.com]}]
    route: [{destination: {host: shop, port: {number: 8080}}}]
---
# Policies select gateways as they select workloads.
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: ingress-deny, namespace: istio-system}
spec:
  selector: {matchLabels: {istio: ingressgateway}}
  action: DENY
  rules: [{to: [{operation: {paths: [/admin]}}]}]
---
# As Istio's istiod-gateway: any SNI on one port, passed through.
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: istiod-pass, namespace: istio-system}
spec:
  hosts: ['*']
  gateways: [ingress]
  tls:
  - match: [{port: 15012, sniHosts: ['*']}]
    route: [{destination: {host: shop.default.svc.cluster.local, port: {number: 8080}}}]
";

fn request(type_url: &str, names: &[&str], ack: Option<&DiscoveryResponse>) -> DiscoveryRequest {
    DiscoveryRequest {
        node: Some(node(GATEWAY_NODE, &[("CLUSTER_ID", "c1")])),
        type_url: type_url.to_string(),
        resource_names: names.iter().map(|n| n.to_string()).collect(),
        version_info: ack.map(|r| r.version_info.clone()).unwrap_or_default(),
        response_nonce: ack.map(|r| r.nonce.clone()).unwrap_or_default(),
        ..Default::default()
    }
}

fn secrets(response: &DiscoveryResponse) -> Vec<Secret> {
    response
        .resources
        .iter()
        .map(|a| Secret::decode(a.value.as_slice()).unwrap())
        .collect()
}

/// A certificate for `host`: (chain, key).
fn issue(host: &str) -> (String, String) {
    let (_, chain, key) = common::gateway_certs::issue(host);
    (chain, key)
}

fn chain_of(secret: &Secret) -> String {
    let Some(secret::Type::TlsCertificate(tls)) = &secret.r#type else {
        panic!("not a certificate: {secret:?}");
    };
    match tls
        .certificate_chain
        .as_ref()
        .and_then(|d| d.specifier.clone())
    {
        Some(envoy_types::pb::envoy::config::core::v3::data_source::Specifier::InlineBytes(b)) => {
            String::from_utf8(b).unwrap()
        }
        other => panic!("chain not inline: {other:?}"),
    }
}

struct Fixture {
    mp: meshpilot::app::Running,
    dir: tempfile::TempDir,
}

async fn start(cert: &(String, String)) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let cluster = dir.path().join("clusters/c1");
    std::fs::create_dir_all(&cluster).unwrap();
    std::fs::create_dir_all(dir.path().join("config")).unwrap();
    std::fs::write(cluster.join("mesh.yaml"), CLUSTER).unwrap();
    let secrets = [
        tls_secret("istio-system", "shop-cert", &cert.0, &cert.1),
        tls_secret("default", "other-cert", &cert.0, &cert.1),
    ];
    std::fs::write(cluster.join("secrets.yaml"), secrets.join("---\n")).unwrap();
    std::fs::write(dir.path().join("config/gateway.yaml"), CONFIG).unwrap();
    let mp = start_meshpilot(dir.path(), &[]).await;
    Fixture { mp, dir }
}

/// An ADS stream of the gateway over the secure port, proven as istio-system's ingress account.
async fn secure_gateway(mp: &meshpilot::app::Running) -> AdsClient {
    let certs = workload_certs(mp, "istio-system", "istio-ingressgateway");
    let channel = tls_channel(
        mp.secure_xds_addr,
        &certs.root,
        Some((&certs.chain, &certs.key)),
    )
    .await
    .unwrap();
    AdsClient::over(channel).await.unwrap()
}

fn labelled(mut request: DiscoveryRequest) -> DiscoveryRequest {
    use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
    let labels = Struct {
        fields: [(
            "istio".to_string(),
            Value {
                kind: Some(Kind::StringValue("ingressgateway".into())),
            },
        )]
        .into(),
    };
    if let Some(meta) = request.node.as_mut().and_then(|n| n.metadata.as_mut()) {
        meta.fields.insert(
            "LABELS".into(),
            Value {
                kind: Some(Kind::StructValue(labels)),
            },
        );
    }
    request
}

#[tokio::test]
async fn a_selected_router_gets_its_gateways_servers() {
    let fixture = start(&issue("shop.example.com")).await;
    let mut ads = AdsClient::connect(fixture.mp.xds_addr).await.unwrap();
    ads.request(labelled(request(LISTENER, &[], None)));
    let response = ads.response(BOUND).await;
    let listeners: Vec<Listener> = response
        .resources
        .iter()
        .map(|a| Listener::decode(a.value.as_slice()).unwrap())
        .collect();
    let names: Vec<&str> = listeners.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "0.0.0.0_8080",
            "0.0.0.0_8443",
            "0.0.0.0_9443",
            "0.0.0.0_15012"
        ]
    );

    // HTTPS: matched by SNI, certificate from meshpilot over ADS, routes over RDS.
    let https = &listeners[1];
    assert_eq!(https.filter_chains.len(), 1);
    let chain = &https.filter_chains[0];
    let matched = chain.filter_chain_match.as_ref().unwrap();
    assert_eq!(matched.server_names, ["shop.example.com"]);
    let socket = chain.transport_socket.as_ref().unwrap();
    let Some(envoy_types::pb::envoy::config::core::v3::transport_socket::ConfigType::TypedConfig(
        any,
    )) = &socket.config_type
    else {
        panic!("no TLS context");
    };
    let tls = DownstreamTlsContext::decode(any.value.as_slice()).unwrap();
    let sds = &tls
        .common_tls_context
        .unwrap()
        .tls_certificate_sds_secret_configs;
    assert_eq!(sds.len(), 1);
    assert_eq!(sds[0].name, "kubernetes://shop-cert");
    assert!(
        format!("{:?}", sds[0].sds_config).contains("Ads("),
        "the certificate must come over ADS: {:?}",
        sds[0].sds_config
    );
    let hcm = chain.filters[0].config_type.as_ref().unwrap();
    let envoy_types::pb::envoy::config::listener::v3::filter::ConfigType::TypedConfig(any) = hcm
    else {
        panic!("no typed HCM");
    };
    let hcm = HttpConnectionManager::decode(any.value.as_slice()).unwrap();
    let filters: Vec<&str> = hcm.http_filters.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(
        filters.first(),
        Some(&"envoy.filters.http.rbac"),
        "the gateway's AuthorizationPolicy comes first: {filters:?}"
    );
    assert_eq!(filters.last(), Some(&"envoy.filters.http.router"));
    assert!(format!("{:?}", hcm.route_specifier).contains("https.8443.https.ingress.istio-system"));

    // PASSTHROUGH: an SNI chain to the TLS route's destination, no TLS context of its own.
    let passthrough = &listeners[2];
    assert_eq!(passthrough.filter_chains.len(), 1);
    let chain = &passthrough.filter_chains[0];
    assert_eq!(
        chain.filter_chain_match.as_ref().unwrap().server_names,
        ["db.example.com"]
    );
    assert!(chain.transport_socket.is_none());
    assert!(
        !passthrough.listener_filters.is_empty(),
        "SNI needs the TLS inspector"
    );
    // `sniHosts: ['*']` matches any server name: as istiod, its chain has no match at all, so it
    // takes plaintext too (Istio's expose-istiod Gateway); db's TLS route, bound without a port,
    // applies on this server too.
    let matches: Vec<Option<(String, Vec<String>)>> = listeners[3]
        .filter_chains
        .iter()
        .map(|c| {
            let m = c.filter_chain_match.as_ref()?;
            Some((m.transport_protocol.clone(), m.server_names.clone()))
        })
        .collect();
    assert_eq!(
        matches,
        [
            Some(("tls".to_string(), vec!["db.example.com".to_string()])),
            None
        ]
    );
    assert!(
        !listeners[3].listener_filters.is_empty(),
        "SNI needs the TLS inspector"
    );

    ads.request(labelled(request(LISTENER, &[], Some(&response))));
    ads.request(labelled(request(
        ROUTE,
        &["https.8443.https.ingress.istio-system", "http.8080"],
        None,
    )));
    let routes = ads.response(BOUND).await;
    let mut configs: Vec<RouteConfiguration> = routes
        .resources
        .iter()
        .map(|a| RouteConfiguration::decode(a.value.as_slice()).unwrap())
        .collect();
    configs.sort_by(|a, b| a.name.cmp(&b.name));
    assert_eq!(configs.len(), 2);
    let (http, https) = (&configs[0], &configs[1]);
    assert_eq!(https.virtual_hosts.len(), 1);
    let vhost = &https.virtual_hosts[0];
    assert_eq!(vhost.domains, ["shop.example.com", "shop.example.com:*"]);
    let route = format!("{:?}", vhost.routes);
    assert!(
        route.contains("/cart") && route.contains("outbound|8080||shop.default.svc.cluster.local")
    );
    // The HTTP server redirects: its hosts require TLS.
    assert_eq!(http.virtual_hosts[0].require_tls, 2, "{http:?}");
}

#[tokio::test]
async fn gateway_certificates_go_only_to_proven_proxies_of_their_namespace() {
    let first = issue("shop.example.com");
    let fixture = start(&first).await;

    // Plaintext port: no identity, no Secrets.
    let mut plain = AdsClient::connect(fixture.mp.xds_addr).await.unwrap();
    plain.request(request(SECRET, &["kubernetes://shop-cert"], None));
    assert!(secrets(&plain.response(BOUND).await).is_empty());

    let mut ads = secure_gateway(&fixture.mp).await;
    ads.request(request(
        SECRET,
        &[
            "kubernetes://shop-cert",
            "kubernetes://default/other-cert",
            "kubernetes://missing",
        ],
        None,
    ));
    let response = ads.response(BOUND).await;
    let served = secrets(&response);
    assert_eq!(
        served.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(),
        ["kubernetes://shop-cert"],
        "another namespace's Secret and a missing one are not served"
    );
    assert_eq!(chain_of(&served[0]).trim(), first.0.trim());
    ads.request(request(
        SECRET,
        &[
            "kubernetes://shop-cert",
            "kubernetes://default/other-cert",
            "kubernetes://missing",
        ],
        Some(&response),
    ));

    // A rotated Secret is pushed, and only its new certificate is served.
    let second = issue("shop.example.com");
    write_atomic(
        &fixture.dir.path().join("clusters/c1/secrets.yaml"),
        &[
            tls_secret("istio-system", "shop-cert", &second.0, &second.1),
            tls_secret("default", "other-cert", &first.0, &first.1),
        ]
        .join("---\n"),
    );
    // (A push from before the rotation may still come first.)
    loop {
        let pushed = ads.response(BOUND).await;
        assert_eq!(pushed.type_url, SECRET);
        let served = secrets(&pushed);
        assert_eq!(served.len(), 1);
        if chain_of(&served[0]).trim() == second.0.trim() {
            break;
        }
        assert_eq!(chain_of(&served[0]).trim(), first.0.trim());
    }
}
