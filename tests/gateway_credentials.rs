//! Who gets a gateway credential's private key over SDS on a cluster with RBAC, as istiod decides
//! (pilot/pkg/xds/sds.go): a `kubernetes://` Secret of the proxy's namespace only when the API
//! server the Secret is read from says the proxy's service account may list Secrets there (the
//! test API server answers SubjectAccessReviews from the Roles and bindings stored, as Kubernetes'
//! RBAC authorizer does); its CA bundle to any proven proxy of the namespace; a Gateway API
//! listener's `kubernetes-gateway://` Secret only to the proxies of the Gateway naming it.

mod common;

use std::time::Duration;

use envoy_types::pb::envoy::config::listener::v3::Listener;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    DownstreamTlsContext, Secret,
};
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use prost::Message;

use common::gateway_certs::{issue, tls_secret_with_ca};
use common::primary::primary_with_remote;
use common::*;

const BOUND: Duration = Duration::from_secs(20);
const SECRET: &str = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";
const LISTENER: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";

/// Service accounts of `shop`: `gateway` may list its Secrets (a Role), `edge` too (a
/// ClusterRole bound in the namespace), `web` has no RBAC at all.
const SHOP_RBAC: &str = "
apiVersion: v1
kind: Namespace
metadata: {name: shop}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: secret-reader, namespace: shop}
rules: [{apiGroups: [''], resources: [secrets], verbs: [get, watch, list]}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: gateway-reads-secrets, namespace: shop}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: secret-reader}
subjects: [{kind: ServiceAccount, name: gateway, namespace: shop}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: any-secret-reader}
rules: [{apiGroups: [''], resources: [secrets], verbs: ['*']}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: edge-reads-secrets, namespace: shop}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: any-secret-reader}
subjects: [{kind: ServiceAccount, name: edge, namespace: shop}]
";

/// The names of the Secrets served to a proxy of `shop` proven as `account` (by a client
/// certificate of meshpilot's CA) that asks for `names` with this node kind and CLUSTER_ID.
async fn served(
    mp: &meshpilot::app::Running,
    (account, kind, cluster): (&str, &str, &str),
    labels: &[(&str, &str)],
    names: &[&str],
) -> Vec<String> {
    let certs = workload_certs(mp, "shop", account);
    let channel = tls_channel(
        mp.secure_xds_addr,
        &certs.root,
        Some((&certs.chain, &certs.key)),
    )
    .await
    .expect("secure channel");
    let mut ads = AdsClient::over(channel).await.expect("ADS stream");
    let id = format!("{kind}~10.40.0.7~{account}-1.shop~shop.svc.cluster.local");
    ads.request(DiscoveryRequest {
        node: Some(labelled_node(&id, &[("CLUSTER_ID", cluster)], labels)),
        type_url: SECRET.into(),
        resource_names: names.iter().map(|n| n.to_string()).collect(),
        ..Default::default()
    });
    let response = ads.response(BOUND).await;
    let mut names: Vec<String> = response
        .resources
        .iter()
        .map(|a| Secret::decode(&a.value[..]).expect("a Secret").name)
        .collect();
    names.sort();
    names
}

#[tokio::test]
async fn a_gateway_key_needs_the_right_to_list_secrets_where_it_is_read_from() {
    let mesh = primary_with_remote(&[]).await;
    let (ca, chain, key) = issue("shop.example.com");
    mesh.config.apply_yaml(SHOP_RBAC);
    mesh.config
        .apply_yaml(&tls_secret_with_ca("shop", "shop-cert", &chain, &key, &ca));
    // A Secret only the remote cluster holds; there only `edge` may list shop's Secrets.
    mesh.east.apply_yaml(&SHOP_RBAC.replace(
        "subjects: [{kind: ServiceAccount, name: gateway, namespace: shop}]",
        "subjects: []",
    ));
    mesh.east
        .apply_yaml(&tls_secret_with_ca("shop", "east-cert", &chain, &key, &ca));

    let key_names = ["kubernetes://shop-cert"];
    for account in ["gateway", "edge"] {
        let got = wait_for("the key served to a reader", BOUND, || async {
            let got = served(&mesh.mp, (account, "router", "primary"), &[], &key_names).await;
            (!got.is_empty()).then_some(got)
        })
        .await;
        assert_eq!(got, key_names, "{account}");
    }
    let reviews = mesh.config.request_count("subjectaccessreview");
    assert!(reviews >= 2, "the API server was asked: {reviews}");

    // Proven, of the namespace, no RBAC: neither as a router nor as a sidecar; the CA is public.
    for kind in ["router", "sidecar"] {
        let names = ["kubernetes://shop-cert", "kubernetes://shop-cert-cacert"];
        let got = served(&mesh.mp, ("web", kind, "primary"), &[], &names).await;
        assert_eq!(got, ["kubernetes://shop-cert-cacert"], "{kind}");
    }
    // Reviews are cached: asking again does not ask the API server again.
    let before = mesh.config.request_count("subjectaccessreview");
    served(&mesh.mp, ("web", "router", "primary"), &[], &key_names).await;
    served(&mesh.mp, ("gateway", "router", "primary"), &[], &key_names).await;
    assert_eq!(mesh.config.request_count("subjectaccessreview"), before);

    // Naming another cluster does not skip the review: it is asked there.
    let east_key = ["kubernetes://east-cert"];
    let got = wait_for("the remote's key served to its reader", BOUND, || async {
        let got = served(&mesh.mp, ("edge", "router", "east"), &[], &east_key).await;
        (!got.is_empty()).then_some(got)
    })
    .await;
    assert_eq!(got, east_key);
    let got = served(&mesh.mp, ("gateway", "router", "east"), &[], &east_key).await;
    assert!(
        got.is_empty(),
        "gateway may list shop's Secrets on primary only: {got:?}"
    );
    assert!(mesh.east.request_count("subjectaccessreview") >= 2);
}

const GATEWAY_API: &str = "
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {name: web-gw, namespace: shop}
spec:
  gatewayClassName: istio
  listeners:
  - name: https
    port: 8443
    protocol: HTTPS
    hostname: shop.example.com
    tls: {mode: Terminate, certificateRefs: [{name: shop-cert}]}
";

#[tokio::test]
async fn a_gateway_api_listener_s_secret_goes_to_its_gateway_s_proxies_only() {
    let mesh = primary_with_remote(&[]).await;
    let (ca, chain, key) = issue("shop.example.com");
    mesh.config.apply_yaml(SHOP_RBAC);
    mesh.config
        .apply_yaml(&tls_secret_with_ca("shop", "shop-cert", &chain, &key, &ca));
    mesh.config.apply_yaml(GATEWAY_API);
    let name = "kubernetes-gateway://shop/shop-cert";
    let labels = [("gateway.networking.k8s.io/gateway-name", "web-gw")];

    // The listener names the Secret as istiod does.
    let listeners: Vec<Listener> = wait_for("the Gateway's listener", BOUND, || async {
        let node = labelled_node(
            "router~10.40.0.9~web-gw-1.shop~shop.svc.cluster.local",
            &[("CLUSTER_ID", "primary")],
            &labels,
        );
        let got: Vec<Listener> = ads::fetch(mesh.mp.xds_addr, node, LISTENER, &[]).await;
        (!got.is_empty()).then_some(got)
    })
    .await;
    let sds_names: Vec<String> = listeners
        .iter()
        .flat_map(|l| &l.filter_chains)
        .filter_map(|c| c.transport_socket.as_ref())
        .filter_map(|t| match &t.config_type {
            Some(
                envoy_types::pb::envoy::config::core::v3::transport_socket::ConfigType::TypedConfig(
                    any,
                ),
            ) => DownstreamTlsContext::decode(&any.value[..]).ok(),
            None => None,
        })
        .flat_map(|tls| {
            tls.common_tls_context
                .unwrap_or_default()
                .tls_certificate_sds_secret_configs
        })
        .map(|sds| sds.name)
        .collect();
    assert_eq!(sds_names, [name]);

    // The Gateway's proxy gets it without any RBAC of its own; another proxy of the namespace
    // asking for the same name does not.
    let got = served(&mesh.mp, ("web", "router", "primary"), &labels, &[name]).await;
    assert_eq!(got, [name]);
    let got = served(&mesh.mp, ("web", "router", "primary"), &[], &[name]).await;
    assert!(got.is_empty(), "{got:?}");
    let got = served(&mesh.mp, ("gateway", "sidecar", "primary"), &[], &[name]).await;
    assert!(got.is_empty(), "{got:?}");
}
