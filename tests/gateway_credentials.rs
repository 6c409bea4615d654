//! Who gets a gateway credential's private key over SDS on a cluster with RBAC, as istiod decides
//! (pilot/pkg/xds/sds.go): a `kubernetes://` Secret of the proxy's namespace only when the API
//! server the Secret is read from says the proxy's service account may list Secrets there (the
//! test API server answers SubjectAccessReviews from the Roles and bindings stored, as Kubernetes'
//! RBAC authorizer does); its CA bundle to any proven proxy of the namespace; a Gateway API
//! listener's `kubernetes-gateway://` Secret only to the proxies of the Gateway naming it; and
//! another namespace's Secret to no tenant's Gateway without a ReferenceGrant. What is served is
//! checked by content: a CA name carries the CA alone, a key name the Secret's own key.

mod common;

use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::data_source::Specifier;
use envoy_types::pb::envoy::config::core::v3::transport_socket::ConfigType;
use envoy_types::pb::envoy::config::core::v3::DataSource;
use envoy_types::pb::envoy::config::listener::v3::Listener;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    secret, DownstreamTlsContext, Secret,
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

/// A proxy proven on the secure port as `<namespace>/<account>` (by a client certificate of
/// meshpilot's CA), of this node kind, CLUSTER_ID and labels.
struct Asker<'a> {
    namespace: &'a str,
    account: &'a str,
    kind: &'a str,
    cluster: &'a str,
    labels: &'a [(&'a str, &'a str)],
}

impl Asker<'_> {
    fn shop<'a>(account: &'a str, kind: &'a str, cluster: &'a str) -> Asker<'a> {
        Asker {
            namespace: "shop",
            account,
            kind,
            cluster,
            labels: &[],
        }
    }
}

/// The Secrets served to `asker` for `names`, sorted by name.
async fn secrets(mp: &meshpilot::app::Running, asker: &Asker<'_>, names: &[&str]) -> Vec<Secret> {
    let certs = workload_certs(mp, asker.namespace, asker.account);
    let channel = tls_channel(
        mp.secure_xds_addr,
        &certs.root,
        Some((&certs.chain, &certs.key)),
    )
    .await
    .expect("secure channel");
    let mut ads = AdsClient::over(channel).await.expect("ADS stream");
    let ns = asker.namespace;
    let id = format!(
        "{}~10.40.0.7~{}-1.{ns}~{ns}.svc.cluster.local",
        asker.kind, asker.account
    );
    ads.request(DiscoveryRequest {
        node: Some(labelled_node(
            &id,
            &[("CLUSTER_ID", asker.cluster)],
            asker.labels,
        )),
        type_url: SECRET.into(),
        resource_names: names.iter().map(|n| n.to_string()).collect(),
        ..Default::default()
    });
    let response = ads.response(BOUND).await;
    let mut secrets: Vec<Secret> = response
        .resources
        .iter()
        .map(|a| Secret::decode(&a.value[..]).expect("a Secret"))
        .collect();
    secrets.sort_by(|a, b| a.name.cmp(&b.name));
    secrets
}

/// The names of the Secrets served to `asker` for `names`, each checked to hold what its name
/// promises of `material` (CA, chain, key): a `-cacert` name only the CA as a validation
/// context, any other the chain and that very key.
async fn served(
    mp: &meshpilot::app::Running,
    asker: &Asker<'_>,
    names: &[&str],
    material: &(String, String, String),
) -> Vec<String> {
    let got = secrets(mp, asker, names).await;
    for secret in &got {
        assert_holds(secret, material);
    }
    got.into_iter().map(|s| s.name).collect()
}

fn inline(source: &Option<DataSource>) -> String {
    match source.as_ref().and_then(|d| d.specifier.as_ref()) {
        Some(Specifier::InlineBytes(b)) => String::from_utf8_lossy(b).into_owned(),
        other => panic!("not inline bytes: {other:?}"),
    }
}

fn assert_holds(secret: &Secret, (ca, chain, key): &(String, String, String)) {
    let trimmed = |pem: &str| pem.trim().to_string();
    match &secret.r#type {
        Some(secret::Type::ValidationContext(v)) => {
            assert!(secret.name.ends_with("-cacert"), "{}: a CA", secret.name);
            assert_eq!(
                trimmed(&inline(&v.trusted_ca)),
                trimmed(ca),
                "{}",
                secret.name
            );
        }
        Some(secret::Type::TlsCertificate(t)) => {
            assert!(!secret.name.ends_with("-cacert"), "{}: a key", secret.name);
            assert_eq!(trimmed(&inline(&t.certificate_chain)), trimmed(chain));
            assert_eq!(trimmed(&inline(&t.private_key)), trimmed(key));
        }
        other => panic!("{}: unexpected {other:?}", secret.name),
    }
}

/// What a refusal must look like: no private key anywhere in the response.
fn assert_no_key(secrets: &[Secret], what: &str) {
    let keys: Vec<&str> = (secrets.iter())
        .filter(|s| matches!(s.r#type, Some(secret::Type::TlsCertificate(_))))
        .map(|s| s.name.as_str())
        .collect();
    assert!(keys.is_empty(), "{what}: keys served {keys:?}");
}

#[tokio::test]
async fn a_gateway_key_needs_the_right_to_list_secrets_in_the_proxy_s_cluster() {
    let mesh = primary_with_remote(&[]).await;
    let material = issue("shop.example.com");
    let (ca, chain, key) = &material;
    mesh.config.apply_yaml(SHOP_RBAC);
    mesh.config
        .apply_yaml(&tls_secret_with_ca("shop", "shop-cert", chain, key, ca));
    // On the remote only `edge` may list shop's Secrets; a Secret only the remote holds.
    mesh.east.apply_yaml(&SHOP_RBAC.replace(
        "subjects: [{kind: ServiceAccount, name: gateway, namespace: shop}]",
        "subjects: []",
    ));
    mesh.east
        .apply_yaml(&tls_secret_with_ca("shop", "east-cert", chain, key, ca));

    let key_names = ["kubernetes://shop-cert"];
    for account in ["gateway", "edge"] {
        let asker = Asker::shop(account, "router", "primary");
        let got = wait_for("the key served to a reader", BOUND, || async {
            let got = served(&mesh.mp, &asker, &key_names, &material).await;
            (!got.is_empty()).then_some(got)
        })
        .await;
        assert_eq!(got, key_names, "{account}");
    }
    let reviews = mesh.config.request_count("subjectaccessreview");
    assert!(reviews >= 2, "the API server was asked: {reviews}");

    // Proven, of the namespace, no RBAC: neither as a router nor as a sidecar; the CA is public
    // and is the CA alone.
    for kind in ["router", "sidecar"] {
        let names = ["kubernetes://shop-cert", "kubernetes://shop-cert-cacert"];
        let got = served(
            &mesh.mp,
            &Asker::shop("web", kind, "primary"),
            &names,
            &material,
        )
        .await;
        assert_eq!(got, ["kubernetes://shop-cert-cacert"], "{kind}");
    }
    // Reviews are cached: asking again does not ask the API server again.
    let before = mesh.config.request_count("subjectaccessreview");
    let web = Asker::shop("web", "router", "primary");
    served(&mesh.mp, &web, &key_names, &material).await;
    let gateway = Asker::shop("gateway", "router", "primary");
    served(&mesh.mp, &gateway, &key_names, &material).await;
    assert_eq!(mesh.config.request_count("subjectaccessreview"), before);

    // A proxy of the remote is reviewed by the remote's API server, wherever the Secret is read
    // from (istiod: "Authorization will always use the proxy cluster"): `edge` gets both the
    // remote's Secret and the config cluster's, `gateway` neither, though the config cluster
    // would let it.
    let east_edge = Asker::shop("edge", "router", "east");
    for name in ["kubernetes://east-cert", "kubernetes://shop-cert"] {
        let got = wait_for("a key served to the remote's reader", BOUND, || async {
            let got = served(&mesh.mp, &east_edge, &[name], &material).await;
            (!got.is_empty()).then_some(got)
        })
        .await;
        assert_eq!(got, [name]);
    }
    let east_gateway = Asker::shop("gateway", "router", "east");
    let names = ["kubernetes://east-cert", "kubernetes://shop-cert"];
    let got = secrets(&mesh.mp, &east_gateway, &names).await;
    assert_no_key(&got, "gateway may list shop's Secrets on primary only");
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
    let material = issue("shop.example.com");
    let (ca, chain, key) = &material;
    mesh.config.apply_yaml(SHOP_RBAC);
    mesh.config
        .apply_yaml(&tls_secret_with_ca("shop", "shop-cert", chain, key, ca));
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
    assert_eq!(sds_names(&listeners), [name]);

    // The Gateway's proxy gets it without any RBAC of its own; another proxy of the namespace
    // asking for the same name does not, nor does a sidecar carrying the Gateway's label.
    let mut gateway_proxy = Asker::shop("web", "router", "primary");
    gateway_proxy.labels = &labels;
    let got = served(&mesh.mp, &gateway_proxy, &[name], &material).await;
    assert_eq!(got, [name]);
    let got = secrets(&mesh.mp, &Asker::shop("web", "router", "primary"), &[name]).await;
    assert!(got.is_empty(), "{got:?}");
    let mut sidecar = Asker::shop("gateway", "sidecar", "primary");
    sidecar.labels = &labels;
    let got = secrets(&mesh.mp, &sidecar, &[name]).await;
    assert!(got.is_empty(), "{got:?}");
}

/// The SDS names a gateway's listeners give their certificates.
fn sds_names(listeners: &[Listener]) -> Vec<String> {
    listeners
        .iter()
        .flat_map(|l| &l.filter_chains)
        .filter_map(|c| c.transport_socket.as_ref())
        .filter_map(|t| match &t.config_type {
            Some(ConfigType::TypedConfig(any)) => DownstreamTlsContext::decode(&any.value[..]).ok(),
            None => None,
        })
        .flat_map(|tls| {
            tls.common_tls_context
                .unwrap_or_default()
                .tls_certificate_sds_secret_configs
        })
        .map(|sds| sds.name)
        .collect()
}

/// The ingress gateway's certificate in istio-system, readable there by its service account; a
/// tenant namespace whose service account has no RBAC at all.
const INGRESS_AND_TENANT: &str = "
apiVersion: v1
kind: Namespace
metadata: {name: tenant}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: ingress-reads-secrets, namespace: istio-system}
rules: [{apiGroups: [''], resources: [secrets], verbs: [get, watch, list]}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: ingress-reads-secrets, namespace: istio-system}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: ingress-reads-secrets}
subjects: [{kind: ServiceAccount, name: istio-ingressgateway-service-account, namespace: istio-system}]
---
apiVersion: networking.istio.io/v1beta1
kind: Gateway
metadata: {name: ingress, namespace: istio-system}
spec:
  selector: {istio: ingressgateway}
  servers:
  - port: {number: 443, name: https, protocol: HTTPS}
    hosts: ['*.example.com']
    tls: {mode: SIMPLE, credentialName: ingress-cert}
";

/// A tenant's own Gateway, selecting its own pod, naming istio-system's Secret every way a
/// `credentialName` can, MUTUAL so that the CA names count too.
const TENANT_GATEWAY: &str = "
apiVersion: networking.istio.io/v1beta1
kind: Gateway
metadata: {name: steal, namespace: tenant}
spec:
  selector: {app: tenant-gw}
  servers:
  - port: {number: 8443, name: https-1, protocol: HTTPS}
    hosts: ['a.tenant.example']
    tls: {mode: MUTUAL, credentialName: 'kubernetes-gateway://istio-system/ingress-cert'}
  - port: {number: 8444, name: https-2, protocol: HTTPS}
    hosts: ['b.tenant.example']
    tls: {mode: MUTUAL, credentialName: 'kubernetes://istio-system/ingress-cert'}
  - port: {number: 8445, name: https-3, protocol: HTTPS}
    hosts: ['c.tenant.example']
    tls: {mode: MUTUAL, credentialName: 'istio-system/ingress-cert'}
";

/// Every SDS name of istio-system's Secret a proxy can ask for.
const STOLEN_NAMES: [&str; 4] = [
    "kubernetes-gateway://istio-system/ingress-cert",
    "kubernetes-gateway://istio-system/ingress-cert-cacert",
    "kubernetes://istio-system/ingress-cert",
    "kubernetes://istio-system/ingress-cert-cacert",
];

#[tokio::test]
async fn a_tenant_s_gateway_cannot_open_another_namespace_s_secret() {
    let mesh = primary_with_remote(&[]).await;
    let material = issue("ingress.example.com");
    let (ca, chain, key) = &material;
    mesh.config.apply_yaml(INGRESS_AND_TENANT);
    mesh.config.apply_yaml(&tls_secret_with_ca(
        "istio-system",
        "ingress-cert",
        chain,
        key,
        ca,
    ));
    mesh.config.apply_yaml(TENANT_GATEWAY);

    // The ingress gateway gets its own credential.
    let ingress = Asker {
        namespace: "istio-system",
        account: "istio-ingressgateway-service-account",
        kind: "router",
        cluster: "primary",
        labels: &[("istio", "ingressgateway")],
    };
    let got = wait_for("the ingress gateway's key", BOUND, || async {
        let got = served(
            &mesh.mp,
            &ingress,
            &["kubernetes://ingress-cert"],
            &material,
        )
        .await;
        (!got.is_empty()).then_some(got)
    })
    .await;
    assert_eq!(got, ["kubernetes://ingress-cert"]);

    // The tenant's pod, selected by its own Gateway, as a router and as a sidecar: nothing of
    // istio-system's Secret, by any name.
    let tenant = |kind| Asker {
        namespace: "tenant",
        account: "tenant-gw",
        kind,
        cluster: "primary",
        labels: &[("app", "tenant-gw")],
    };
    let router = tenant("router");
    wait_for("the tenant's Gateway applied", BOUND, || async {
        let node = labelled_node(
            "router~10.40.0.7~tenant-gw-1.tenant~tenant.svc.cluster.local",
            &[("CLUSTER_ID", "primary")],
            &[("app", "tenant-gw")],
        );
        let got: Vec<Listener> = ads::fetch(mesh.mp.xds_addr, node, LISTENER, &[]).await;
        (!sds_names(&got).is_empty()).then_some(())
    })
    .await;
    for kind in ["router", "sidecar"] {
        let got = secrets(&mesh.mp, &tenant(kind), &STOLEN_NAMES).await;
        assert_no_key(&got, kind);
        assert!(got.is_empty(), "{kind}: {got:?}");
    }

    // A ReferenceGrant in istio-system opening the Secret to tenant's Gateways: istiod then
    // verifies the Gateway's `kubernetes-gateway://` reference, and only that one, for the
    // Gateway's router only; `kubernetes://` never leaves the proxy's namespace.
    mesh.config.apply_yaml(
        "
apiVersion: gateway.networking.k8s.io/v1beta1
kind: ReferenceGrant
metadata: {name: tenant-may-use-ingress-cert, namespace: istio-system}
spec:
  from: [{group: gateway.networking.k8s.io, kind: Gateway, namespace: tenant}]
  to: [{group: '', kind: Secret, name: ingress-cert}]
",
    );
    let granted = [
        "kubernetes-gateway://istio-system/ingress-cert",
        "kubernetes-gateway://istio-system/ingress-cert-cacert",
    ];
    let got = wait_for("the granted Secret", BOUND, || async {
        let got = served(&mesh.mp, &router, &STOLEN_NAMES, &material).await;
        (!got.is_empty()).then_some(got)
    })
    .await;
    assert_eq!(got, granted);
    let got = secrets(&mesh.mp, &tenant("sidecar"), &STOLEN_NAMES).await;
    assert!(got.is_empty(), "sidecar: {got:?}");
    // Another tenant's pod, its own labels matching the Gateway, is not of the Gateway's
    // namespace: the grant is not for it.
    mesh.config
        .apply_yaml("apiVersion: v1\nkind: Namespace\nmetadata: {name: other}\n");
    let other = Asker {
        namespace: "other",
        account: "tenant-gw",
        kind: "router",
        cluster: "primary",
        labels: &[("app", "tenant-gw")],
    };
    let got = secrets(&mesh.mp, &other, &STOLEN_NAMES).await;
    assert!(got.is_empty(), "another namespace: {got:?}");
}
