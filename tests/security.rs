//! End to end: the CA, secure xDS and workload identity — real Envoy, grpcio and rustls peers
//! against meshpilot's secure port, test API servers reviewing tokens.

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use meshpilot::security::ca::{spiffe_identities, CaBundle, CertificateAuthority, TtlPolicy};
use meshpilot::security::identity::Identity;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use test_apiserver::{TestApiServer, User};

const BOUND: Duration = Duration::from_secs(20);
const SIDECAR: &str = "sidecar~10.1.1.11~reviews-v1-7f9c8d.bookinfo~bookinfo.svc.cluster.local";
const REVIEWS_CLUSTER: &str = "outbound|9080||reviews.bookinfo.svc.cluster.local";
const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";

fn chain_ders(pems: &[String]) -> Vec<CertificateDer<'static>> {
    pems.iter()
        .flat_map(|p| CertificateDer::pem_slice_iter(p.as_bytes()).map(|c| c.unwrap()))
        .collect()
}

#[tokio::test]
async fn envoy_with_a_meshpilot_certificate_gets_config_on_the_secure_port() {
    let _ports = sidecar_ports().await;
    let dir = copy_tree(Path::new(EXAMPLE));
    let mp = start_meshpilot(dir.path(), &[]).await;
    let certs = workload_certs(&mp, "bookinfo", "bookinfo-reviews");
    let envoy = Envoy::start_with(EnvoyOptions {
        xds: mp.secure_xds_addr,
        replicas: &[],
        node_id: SIDECAR,
        metadata: &[("CLUSTER_ID", "cluster1")],
        labels: &[],
        mode: AdsMode::Sotw,
        workload: certs.clone(),
        xds_tls: Some(XdsTls {
            client: Some((certs.chain.clone(), certs.key.clone())),
            root: certs.root.clone(),
            sni: "istiod.istio-system.svc".into(),
        }),
        netns: None,
    })
    .await;
    wait_for("config over mTLS xDS", BOUND, || {
        let envoy = &envoy;
        async move {
            (envoy.endpoints(REVIEWS_CLUSTER).await == ["10.1.1.11:9080", "10.2.3.13:9080"])
                .then_some(())
        }
    })
    .await;
    assert_eq!(envoy.rejected_updates().await, 0);
}

#[tokio::test]
async fn foreign_roots_and_borrowed_identities_are_refused() {
    let dir = copy_tree(Path::new(EXAMPLE));
    let mp = start_meshpilot(dir.path(), &[]).await;
    let root = mp.ca.current().root_pem().to_string();

    // A certificate from another root: the handshake fails.
    let other = CertificateAuthority::new(
        &CaBundle::self_signed_root("cluster.local", meshpilot::security::ca::ROOT_LIFETIME)
            .unwrap(),
        TtlPolicy {
            default: Duration::from_secs(3600),
            max: Duration::from_secs(3600),
        },
    )
    .unwrap();
    let (chain, key) = other
        .issue_workload(
            &Identity::new("cluster.local", "bookinfo", "x"),
            Duration::from_secs(600),
        )
        .unwrap();
    // Refused means an error — at the handshake, the call or on the stream; an answer, silence or
    // a stream that just ends would all be wrong (silence proves nothing).
    match tls_channel(mp.secure_xds_addr, &root, Some((&chain.concat(), &key))).await {
        Err(_) => {}
        Ok(channel) => match AdsClient::over(channel).await {
            Err(_) => {}
            Ok(mut ads) => {
                ads.request(DiscoveryRequest {
                    node: Some(node(SIDECAR, &[])),
                    type_url: CDS.into(),
                    ..Default::default()
                });
                match ads.receive(BOUND).await {
                    Received::Error(_) => {}
                    other => {
                        panic!("a client certificate from another root was not refused: {other:?}")
                    }
                }
            }
        },
    }

    // A certificate of namespace `other` claiming to be a proxy of namespace `bookinfo`.
    let status = secure_cds(&mp, Some(("other", "x")), &[])
        .await
        .expect_err("refused");
    assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
    assert!(
        status.message().contains("ns/other"),
        "{}",
        status.message()
    );

    // The right namespace but a service account the node does not have.
    let reviews = [("SERVICE_ACCOUNT", "bookinfo-reviews")];
    let status = secure_cds(&mp, Some(("bookinfo", "x")), &reviews)
        .await
        .expect_err("refused");
    assert_eq!(status.code(), tonic::Code::PermissionDenied);

    // No credentials at all on the secure port: unauthenticated.
    let status = secure_cds(&mp, None, &[]).await.expect_err("refused");
    assert_eq!(status.code(), tonic::Code::Unauthenticated);

    // The matching identity is served.
    assert!(
        secure_cds(&mp, Some(("bookinfo", "bookinfo-reviews")), &reviews)
            .await
            .is_ok()
    );
}

/// Asks the secure port for CDS as the sidecar, with a meshpilot-issued certificate of
/// (namespace, service account), or none; returns the first answer.
async fn secure_cds(
    mp: &meshpilot::app::Running,
    identity: Option<(&str, &str)>,
    metadata: &[(&str, &str)],
) -> Result<envoy_types::pb::envoy::service::discovery::v3::DiscoveryResponse, tonic::Status> {
    let certs = identity.map(|(ns, sa)| {
        let (chain, key) = mp
            .ca
            .current()
            .issue_workload(
                &Identity::new("cluster.local", ns, sa),
                Duration::from_secs(600),
            )
            .unwrap();
        (chain.concat(), key)
    });
    let client = certs.as_ref().map(|(c, k)| (c.as_str(), k.as_str()));
    let channel = tls_channel(mp.secure_xds_addr, mp.ca.current().root_pem(), client)
        .await
        .unwrap();
    let mut ads = AdsClient::over(channel).await.unwrap();
    ads.request(DiscoveryRequest {
        node: Some(node(SIDECAR, metadata)),
        type_url: CDS.into(),
        ..Default::default()
    });
    ads.next(BOUND).await.expect("an answer")
}

#[tokio::test]
async fn grpcio_gets_a_certificate_with_a_remote_clusters_token() {
    let primary::Primary {
        config, east, mp, ..
    } = primary::primary_with_remote(&[]).await;
    let admin = mp.http_addr;
    wait_for("east synced", BOUND, || async move {
        (cluster_view(admin, "east").await?["state"] == "synced").then_some(())
    })
    .await;
    east.add_token("web-token", User::service_account("shop", "web"));
    let dir = tempfile::tempdir().unwrap();

    let reply = primary::grpcio_create_certificate(&mp, dir.path(), "web-token", "east").await;
    let chain: Vec<String> =
        serde_json::from_value(reply["chain"].clone()).unwrap_or_else(|_| panic!("{reply}"));
    assert_eq!(
        chain.last().map(String::as_str),
        Some(mp.ca.current().root_pem()),
        "root last"
    );
    let ders = chain_ders(&chain);
    assert_eq!(
        spiffe_identities(&ders[0]),
        vec![Identity::new("cluster.local", "shop", "web")]
    );
    verify_leaf(&ders, mp.ca.current().root_pem());
    assert!(
        east.request_count("tokenreview") >= 1,
        "the remote cluster reviewed its own token"
    );

    // The same token presented as the config cluster's: that cluster does not know it.
    let refused = primary::grpcio_create_certificate(&mp, dir.path(), "web-token", "primary").await;
    assert_eq!(refused["code"], "UNAUTHENTICATED", "{refused}");
    let unknown = primary::grpcio_create_certificate(&mp, dir.path(), "web-token", "nowhere").await;
    assert_eq!(unknown["code"], "UNAUTHENTICATED");
    assert!(
        unknown["details"].as_str().unwrap().contains("nowhere"),
        "{unknown}"
    );
    let forged = primary::grpcio_create_certificate(&mp, dir.path(), "forged", "east").await;
    assert_eq!(forged["code"], "UNAUTHENTICATED");
    // A token that is not a service account's.
    east.add_token(
        "human",
        User {
            username: "alice".into(),
            uid: "1".into(),
            groups: vec!["system:authenticated".into()],
            audiences: vec![],
            extra: Default::default(),
        },
    );
    let human = primary::grpcio_create_certificate(&mp, dir.path(), "human", "east").await;
    assert_eq!(human["code"], "UNAUTHENTICATED");
    drop(config);
}

#[tokio::test]
async fn a_trusted_node_proxy_gets_certificates_for_pods_on_its_node_only() {
    let primary::Primary {
        config, east, mp, ..
    } = primary::primary_with_remote(&["--ca-trusted-node-accounts", "istio-system/ztunnel"]).await;
    // The API server gives each pod its uid, which a token bound to the pod carries.
    let pod = |ns: &str, name: &str, sa: &str, node: &str| {
        let pod = east.apply(serde_json::json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"serviceAccountName": sa, "nodeName": node, "containers": []},
            "status": {"podIP": "10.0.0.1"}}));
        pod["metadata"]["uid"].as_str().unwrap().to_string()
    };
    let ztunnel_uid = pod("istio-system", "ztunnel-n1", "ztunnel", "n1");
    let web_uid = pod("shop", "web-1", "web", "n1");
    pod("shop", "db-1", "db", "n2");
    east.add_token(
        "ztunnel",
        User::service_account("istio-system", "ztunnel").of_pod("ztunnel-n1", &ztunnel_uid),
    );
    east.add_token(
        "ztunnel-before",
        User::service_account("istio-system", "ztunnel").of_pod("ztunnel-n1", "u-old"),
    );
    east.add_token(
        "web",
        User::service_account("shop", "web").of_pod("web-1", &web_uid),
    );
    let dir = tempfile::tempdir().unwrap();
    let ask = |token: &'static str, identity: &'static str| {
        let (mp, dir) = (&mp, dir.path());
        async move { primary::grpcio_certificate_for(mp, dir, (token, "east"), Some(identity)).await }
    };
    let web = "spiffe://cluster.local/ns/shop/sa/web";

    // Once east's pods are known, the node's ztunnel gets web's certificate.
    let reply = wait_for("the ztunnel's pod known", BOUND, || async {
        let reply = ask("ztunnel", web).await;
        reply.get("chain").is_some().then_some(reply)
    })
    .await;
    let chain: Vec<String> = serde_json::from_value(reply["chain"].clone()).unwrap();
    let ders = chain_ders(&chain);
    assert_eq!(
        spiffe_identities(&ders[0]),
        vec![Identity::new("cluster.local", "shop", "web")]
    );
    verify_leaf(&ders, mp.ca.current().root_pem());

    let refused = |reply: serde_json::Value, why: &str| {
        assert_eq!(reply["code"], "UNAUTHENTICATED", "{reply}");
        let details = reply["details"].as_str().unwrap_or_default();
        assert!(details.contains(why), "{why}: {reply}");
    };
    // db runs on another node; a foreign trust domain is not the mesh's.
    refused(
        ask("ztunnel", "spiffe://cluster.local/ns/shop/sa/db").await,
        "no pod of shop/db is on node \"n1\"",
    );
    refused(
        ask("ztunnel", "spiffe://other.example/ns/shop/sa/web").await,
        "trust domain",
    );
    // A workload may not ask for another identity, nor for its own this way.
    refused(
        ask("web", "spiffe://cluster.local/ns/shop/sa/web").await,
        "shop/web is not a trusted node account",
    );
    // A token of a pod that has since been replaced under the same name.
    refused(
        ask("ztunnel-before", web).await,
        "not the one its token was issued to",
    );
    // Without impersonation the node proxy gets its own identity, as any workload.
    let own = primary::grpcio_create_certificate(&mp, dir.path(), "ztunnel", "east").await;
    let own: Vec<String> = serde_json::from_value(own["chain"].clone()).unwrap();
    assert_eq!(
        spiffe_identities(&chain_ders(&own)[0]),
        vec![Identity::new("cluster.local", "istio-system", "ztunnel")]
    );
    drop(config);
}

/// Verifies a leaf chain against a root with webpki, as a TLS peer would.
fn verify_leaf(chain: &[CertificateDer<'static>], root_pem: &str) {
    let mut roots = rustls::RootCertStore::empty();
    for der in CertificateDer::pem_slice_iter(root_pem.as_bytes()) {
        roots.add(der.unwrap()).unwrap();
    }
    let verifier = rustls::server::WebPkiClientVerifier::builder(Arc::new(roots))
        .build()
        .unwrap();
    verifier
        .verify_client_cert(&chain[0], &chain[1..], rustls::pki_types::UnixTime::now())
        .expect("chain verifies to the root");
}

#[tokio::test]
async fn a_restart_keeps_the_root() {
    // File mode: the state directory.
    let dir = copy_tree(Path::new(EXAMPLE));
    let state = tempfile::tempdir().unwrap();
    let flags = ["--ca-state-dir", state.path().to_str().unwrap()];
    let first = start_meshpilot(dir.path(), &flags)
        .await
        .ca
        .current()
        .root_pem()
        .to_string();
    // The key is the owner's only.
    use std::os::unix::fs::PermissionsExt;
    let key = std::fs::metadata(state.path().join("ca-key.pem")).unwrap();
    assert_eq!(key.permissions().mode() & 0o777, 0o600);
    let second = start_meshpilot(dir.path(), &flags)
        .await
        .ca
        .current()
        .root_pem()
        .to_string();
    assert_eq!(first, second);

    // Kubernetes: the Secret istio-ca-secret.
    let config = TestApiServer::start().await;
    config.apply_yaml("apiVersion: v1\nkind: Namespace\nmetadata: {name: istio-system}\n");
    let kubeconfig = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(kubeconfig.path(), config.kubeconfig(config.admin_token())).unwrap();
    let flags = [
        "--kubeconfig",
        kubeconfig.path().to_str().unwrap(),
        "--cluster-id",
        "primary",
    ];
    let first = start_meshpilot_with(&flags)
        .await
        .ca
        .current()
        .root_pem()
        .to_string();
    assert!(config
        .get("Secret", "istio-system", "istio-ca-secret")
        .is_some());
    let second = start_meshpilot_with(&flags)
        .await
        .ca
        .current()
        .root_pem()
        .to_string();
    assert_eq!(first, second);
}

#[tokio::test]
async fn replicas_starting_together_share_one_root() {
    let config = TestApiServer::start().await;
    config.apply_yaml("apiVersion: v1\nkind: Namespace\nmetadata: {name: istio-system}\n");
    let kubeconfig = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(kubeconfig.path(), config.kubeconfig(config.admin_token())).unwrap();
    let flags = [
        "--kubeconfig",
        kubeconfig.path().to_str().unwrap(),
        "--cluster-id",
        "primary",
    ];
    // Both look for istio-ca-secret, find none, and create one: the loser of the race (409
    // AlreadyExists) takes the winner's.
    let (a, b) = tokio::join!(start_meshpilot_with(&flags), start_meshpilot_with(&flags));
    assert_eq!(a.ca.current().root_pem(), b.ca.current().root_pem());
    let secret = config
        .get("Secret", "istio-system", "istio-ca-secret")
        .unwrap();
    let stored = secret["data"]["root-cert.pem"].as_str().unwrap();
    use base64::Engine;
    let stored = base64::engine::general_purpose::STANDARD
        .decode(stored)
        .unwrap();
    assert_eq!(
        chain_ders(&[String::from_utf8(stored).unwrap()]),
        chain_ders(&[a.ca.current().root_pem().to_string()])
    );
}

#[tokio::test]
async fn clusters_with_intermediates_of_one_root_trust_each_other() {
    let out = tempfile::tempdir().unwrap();
    let certs = |args: &[&str]| {
        let status = Command::new(env!("CARGO_BIN_EXE_meshpilot"))
            .arg("certs")
            .args(args)
            .status()
            .unwrap();
        assert!(status.success(), "meshpilot certs {args:?}");
    };
    let path = |p: &str| out.path().join(p).to_str().unwrap().to_string();
    certs(&["root", "--out", &path("root")]);
    certs(&[
        "intermediate",
        "--root",
        &path("root"),
        "--name",
        "east",
        "--out",
        &path("east"),
    ]);
    certs(&[
        "intermediate",
        "--root",
        &path("root"),
        "--name",
        "west",
        "--out",
        &path("west"),
    ]);

    let dir = copy_tree(Path::new(EXAMPLE));
    let east = start_meshpilot(dir.path(), &["--ca-dir", &path("east")]).await;
    let west = start_meshpilot(dir.path(), &["--ca-dir", &path("west")]).await;
    assert_eq!(east.ca.current().root_pem(), west.ca.current().root_pem());
    let (east_chain, east_key) = east
        .ca
        .current()
        .issue_workload(
            &Identity::new("cluster.local", "shop", "web"),
            Duration::from_secs(600),
        )
        .unwrap();
    let (west_chain, west_key) = west
        .ca
        .current()
        .issue_workload(
            &Identity::new("cluster.local", "shop", "db"),
            Duration::from_secs(600),
        )
        .unwrap();

    // A real mutual-TLS handshake: east's workload serves, west's is the client, each verifying the
    // other against the shared root.
    let root = east.ca.current().root_pem().to_string();
    let (east_der, west_der) = (chain_ders(&east_chain), chain_ders(&west_chain));
    let key = |pem: &str| PrivateKeyDer::from_pem_slice(pem.as_bytes()).unwrap();
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(root.as_bytes()).unwrap())
        .unwrap();
    let roots = Arc::new(roots);
    let server_config = rustls::ServerConfig::builder()
        .with_client_cert_verifier(
            rustls::server::WebPkiClientVerifier::builder(roots.clone())
                .build()
                .unwrap(),
        )
        .with_single_cert(east_der.clone(), key(&east_key))
        .unwrap();
    let client_config = rustls::ClientConfig::builder()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(hbone::SpiffeVerifier(roots)))
        .with_client_auth_cert(west_der, key(&west_key))
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        let tls = tokio_rustls::TlsAcceptor::from(Arc::new(server_config))
            .accept(tcp)
            .await
            .unwrap();
        let peer = tls.get_ref().1.peer_certificates().unwrap()[0].clone();
        spiffe_identities(&peer)
    });
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("web.shop.svc").unwrap();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(client_config))
        .connect(name, tcp)
        .await
        .unwrap();
    let server_identity = spiffe_identities(&tls.get_ref().1.peer_certificates().unwrap()[0]);
    assert_eq!(
        server_identity,
        vec![Identity::new("cluster.local", "shop", "web")]
    );
    assert_eq!(
        server.await.unwrap(),
        vec![Identity::new("cluster.local", "shop", "db")]
    );
}

#[tokio::test]
async fn serving_certificate_renews_without_dropping_streams() {
    let dir = copy_tree(Path::new(EXAMPLE));
    let mp = start_meshpilot(
        dir.path(),
        &["--serving-cert-ttl", "2s", "--debounce-after", "0s"],
    )
    .await;
    let root = mp.ca.current().root_pem().to_string();
    let (chain, key) = mp
        .ca
        .current()
        .issue_workload(
            &Identity::new("cluster.local", "bookinfo", "x"),
            Duration::from_secs(600),
        )
        .unwrap();
    let channel = tls_channel(mp.secure_xds_addr, &root, Some((&chain.concat(), &key)))
        .await
        .unwrap();
    let mut ads = AdsClient::over(channel).await.unwrap();
    ads.request(DiscoveryRequest {
        node: Some(node(SIDECAR, &[])),
        type_url: "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment".into(),
        resource_names: vec![REVIEWS_CLUSTER.into()],
        ..Default::default()
    });
    let first = ads.next(BOUND).await.unwrap().unwrap();
    ads.request(DiscoveryRequest {
        type_url: first.type_url.clone(),
        resource_names: vec![REVIEWS_CLUSTER.into()],
        version_info: first.version_info.clone(),
        response_nonce: first.nonce.clone(),
        ..Default::default()
    });
    let serial = |der: &CertificateDer<'_>| {
        use x509_parser::prelude::FromDer;
        x509_parser::certificate::X509Certificate::from_der(der)
            .unwrap()
            .1
            .raw_serial()
            .to_vec()
    };
    let before = serial(&server_cert(mp.secure_xds_addr, &root).await);
    let addr = mp.secure_xds_addr;
    let root2 = root.clone();
    wait_for("a renewed serving certificate", BOUND, || {
        let (root, before) = (root2.clone(), before.clone());
        async move { (serial(&server_cert(addr, &root).await) != before).then_some(()) }
    })
    .await;
    // The stream opened under the old certificate still carries pushes.
    std::fs::write(
        dir.path().join("clusters/cluster2/reviews.yaml"),
        std::fs::read_to_string(dir.path().join("clusters/cluster2/reviews.yaml"))
            .unwrap()
            .replace("10.2.3.13", "10.2.3.77"),
    )
    .unwrap();
    let push = ads
        .next(BOUND)
        .await
        .expect("a push after renewal")
        .unwrap();
    assert_eq!(push.resources.len(), 1);
}

/// The certificate the secure port presents to a new handshake.
async fn server_cert(addr: std::net::SocketAddr, root: &str) -> CertificateDer<'static> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(root.as_bytes()).unwrap())
        .unwrap();
    let config = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("istiod.istio-system.svc").unwrap();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .unwrap();
    tls.get_ref().1.peer_certificates().unwrap()[0]
        .clone()
        .into_owned()
}

#[tokio::test]
async fn root_certificate_is_published_in_every_namespace() {
    let config = TestApiServer::start().await;
    config.apply_yaml("apiVersion: v1\nkind: Namespace\nmetadata: {name: istio-system}\n---\napiVersion: v1\nkind: Namespace\nmetadata: {name: shop}\n");
    let remote = TestApiServer::start().await;
    remote.add_token(
        "reader",
        User::service_account("istio-system", "istio-reader-service-account"),
    );
    // The remote opts in to trust distribution from this control plane, as Istio's annotation says.
    remote.apply_yaml(
        "apiVersion: v1\nkind: Namespace\nmetadata: {name: istio-system, annotations: {topology.istio.io/controlPlaneClusters: primary}}\n---\napiVersion: v1\nkind: Namespace\nmetadata: {name: payments}\n",
    );
    let opted_out = TestApiServer::start().await;
    opted_out.add_token(
        "reader",
        User::service_account("istio-system", "istio-reader-service-account"),
    );
    opted_out.apply_yaml("apiVersion: v1\nkind: Namespace\nmetadata: {name: istio-system}\n");
    config.apply(serde_json::json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "istio-remote-secret", "namespace": "istio-system", "labels": {"istio/multiCluster": "true"}},
        "stringData": {"east": remote.kubeconfig("reader"), "west": opted_out.kubeconfig("reader")}
    }));
    let kubeconfig = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(kubeconfig.path(), config.kubeconfig(config.admin_token())).unwrap();
    let mp = start_meshpilot_with(&[
        "--kubeconfig",
        kubeconfig.path().to_str().unwrap(),
        "--cluster-id",
        "primary",
    ])
    .await;
    let root = mp.ca.current().root_pem().to_string();
    let published = |api: &TestApiServer, ns: &str| {
        api.get("ConfigMap", ns, "istio-ca-root-cert")
            .and_then(|cm| cm["data"]["root-cert.pem"].as_str().map(str::to_string))
    };
    let (config_ref, remote_ref, root_ref) = (&config, &remote, &root);
    wait_for("root ConfigMaps published", BOUND, || async move {
        let all = ["istio-system", "shop"]
            .iter()
            .all(|ns| published(config_ref, ns).as_deref() == Some(root_ref.as_str()))
            && published(remote_ref, "payments").as_deref() == Some(root_ref.as_str());
        all.then_some(())
    })
    .await;
    // A namespace created later gets it too; a cluster that did not opt in gets nothing.
    config.apply_yaml("apiVersion: v1\nkind: Namespace\nmetadata: {name: late}\n");
    wait_for("published in a new namespace", BOUND, || async move {
        (published(config_ref, "late").as_deref() == Some(root_ref.as_str())).then_some(())
    })
    .await;
    assert!(published(&opted_out, "istio-system").is_none());
}

/// The data of a Secret or ConfigMap key, as text.
fn stored_text(object: &serde_json::Value, key: &str) -> Option<String> {
    use base64::Engine;
    if let Some(text) = object["data"][key]
        .as_str()
        .filter(|_| object["kind"] == "ConfigMap")
    {
        return Some(text.to_string());
    }
    let encoded = object["data"][key].as_str()?;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .ok()?;
    String::from_utf8(bytes).ok()
}

#[tokio::test]
async fn the_leader_renews_the_root_and_every_replica_and_namespace_trusts_both() {
    let config = TestApiServer::start().await;
    config.apply_yaml("apiVersion: v1\nkind: Namespace\nmetadata: {name: istio-system}\n---\napiVersion: v1\nkind: Namespace\nmetadata: {name: shop}\n");
    config.add_token("shop-web", User::service_account("shop", "web"));
    let kubeconfig = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(kubeconfig.path(), config.kubeconfig(config.admin_token())).unwrap();
    // A 10 s root renewed with half its life left: first renewed ~5 s after start.
    let flags = [
        "--kubeconfig",
        kubeconfig.path().to_str().unwrap(),
        "--cluster-id",
        "primary",
        "--self-signed-root-ttl",
        "10s",
        "--self-signed-root-grace-percent",
        "50",
        "--self-signed-root-check-interval",
        "200ms",
    ];
    let (a, b) = tokio::join!(start_meshpilot_with(&flags), start_meshpilot_with(&flags));
    let first = a.ca.current().root_pem().to_string();
    let (config_ref, a_ref, b_ref) = (&config, &a, &b);
    // The leader writes the renewed root beside the old into istio-ca-secret; the other replica
    // loads it, and the root ConfigMaps carry both.
    let bundle = wait_for("the renewed root everywhere", BOUND, || async move {
        let secret = config_ref.get("Secret", "istio-system", "istio-ca-secret")?;
        let stored = stored_text(&secret, "root-cert.pem")?;
        let roots = chain_ders(std::slice::from_ref(&stored));
        let published = stored_text(
            &config_ref.get("ConfigMap", "shop", "istio-ca-root-cert")?,
            "root-cert.pem",
        )?;
        let everywhere = roots.len() == 2
            && chain_ders(&[published]) == roots
            && chain_ders(&[a_ref.ca.current().root_pem().to_string()]) == roots
            && chain_ders(&[b_ref.ca.current().root_pem().to_string()]) == roots;
        everywhere.then_some(stored)
    })
    .await;
    let roots = chain_ders(std::slice::from_ref(&bundle));
    assert_eq!(
        roots[1],
        chain_ders(&[first])[0],
        "the old root stays trusted"
    );

    // A workload's CSR through Istio's CA API (grpcio) is answered with both roots last.
    let dir = tempfile::tempdir().unwrap();
    let reply =
        common::primary::grpcio_create_certificate(&b, dir.path(), "shop-web", "primary").await;
    let chain: Vec<String> = serde_json::from_value(reply["chain"].clone()).expect("a chain");
    let last = chain.last().cloned().unwrap_or_default();
    assert_eq!(chain_ders(&[last]), roots, "{reply}");
    verify_leaf(&chain_ders(&chain[..1]), &bundle);
}
