//! Real traffic across networks: a client on network 1 calls a service whose only endpoint is on
//! network 2. The networks are joined only through network 2's east-west gateway address. The
//! client's sidecar originates mTLS with SNI `outbound_.<port>_._.<host>` to the gateway (a real
//! Envoy), which passes the TLS through by SNI without terminating it; the backend's own sidecar
//! terminates it with a meshpilot-issued certificate. The gateway is configured from Istio's
//! cross-network Gateway (AUTO_PASSTHROUGH) alone: its proxy does not carry the
//! `istio: eastwestgateway` label meshpilot otherwise falls back to. The same backend is also a
//! headless service's pod (`db-0`): the application resolves its own name through the agent's DNS
//! (the name table) and reaches it through the gateway too. A TLS client that is no mesh proxy,
//! naming the same SNI without Istio's mTLS ALPN, is closed by the gateway. Needs root (network
//! namespaces, iptables).

mod common;

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use common::nds::{NdsAgent, Protocol};
use common::netns::{link, Netns, ResolvConf};
use common::*;

const BOUND: Duration = Duration::from_secs(30);
const ECHO: &str = "echo.default.svc.cluster.local";
const APP_UID: &str = "1000";
const GATEWAY_IP: &str = "10.214.1.2";
const CLIENT: &str = "sidecar~10.214.1.1~client.default~default.svc.cluster.local";
const POD: &str = "db-0.db.default.svc.cluster.local";

/// Istio's cross-network Gateway (samples/multicluster/expose-services.yaml), selecting the gateway
/// by a label of its own.
const CROSS_NETWORK_GATEWAY: &str = "
apiVersion: networking.istio.io/v1
kind: Gateway
metadata: {name: cross-network-gateway, namespace: istio-system}
spec:
  selector: {app: cross-network-gateway}
  servers:
  - port: {number: 15443, name: tls, protocol: TLS}
    tls: {mode: AUTO_PASSTHROUGH}
    hosts: ['*.local']
";

const EAST: &str = "
apiVersion: v1
kind: Namespace
metadata: {name: istio-system, labels: {topology.istio.io/network: network1}}
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: default, labels: {app: client, security.istio.io/tlsMode: istio}}
spec: {serviceAccountName: client, containers: []}
status: {podIP: 10.214.1.1}
";

fn west() -> String {
    format!(
        "
apiVersion: v1
kind: Namespace
metadata: {{name: istio-system, labels: {{topology.istio.io/network: network2}}}}
---
apiVersion: v1
kind: Service
metadata: {{name: istio-eastwestgateway, namespace: istio-system, labels: {{istio: eastwestgateway, topology.istio.io/network: network2}}}}
spec: {{type: LoadBalancer, clusterIP: 10.96.0.99, ports: [{{name: tls, port: 15443}}]}}
status: {{loadBalancer: {{ingress: [{{ip: {GATEWAY_IP}}}]}}}}
---
apiVersion: v1
kind: Service
metadata: {{name: echo, namespace: default}}
spec: {{clusterIP: 10.96.88.88, ports: [{{name: http, port: 8080}}]}}
---
apiVersion: v1
kind: Pod
metadata: {{name: server, namespace: default, labels: {{app: echo, security.istio.io/tlsMode: istio}}}}
spec: {{serviceAccountName: server, containers: []}}
status: {{podIP: 10.214.2.2}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: echo-1, namespace: default, labels: {{kubernetes.io/service-name: echo}}}}
addressType: IPv4
ports: [{{name: http, port: 8080}}]
endpoints:
- addresses: [10.214.2.2]
  conditions: {{ready: true}}
  targetRef: {{kind: Pod, name: server, namespace: default}}
---
apiVersion: v1
kind: Service
metadata: {{name: db, namespace: default}}
spec: {{clusterIP: None, ports: [{{name: http, port: 8080}}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: db-1, namespace: default, labels: {{kubernetes.io/service-name: db}}}}
addressType: IPv4
ports: [{{name: http, port: 8080}}]
endpoints:
- addresses: [10.214.2.2]
  hostname: db-0
  conditions: {{ready: true}}
  targetRef: {{kind: Pod, name: server, namespace: default}}
"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_crosses_networks_through_the_east_west_gateway() {
    let tag = std::process::id() % 100_000;
    let client_ns = Netns::create(&format!("mnc{tag}"));
    let gateway_ns = Netns::create(&format!("mng{tag}"));
    let mut server_ns = Netns::create(&format!("mns{tag}"));
    link(
        None,
        &format!("mnc{tag}h"),
        "10.214.11.1/30",
        &client_ns,
        "ctl",
        "10.214.11.2/30",
    );
    link(
        None,
        &format!("mng{tag}h"),
        "10.214.12.1/30",
        &gateway_ns,
        "ctl",
        "10.214.12.2/30",
    );
    link(
        None,
        &format!("mns{tag}h"),
        "10.214.13.1/30",
        &server_ns,
        "ctl",
        "10.214.13.2/30",
    );
    // Network 1 reaches network 2 only at the gateway's address.
    link(
        Some(&client_ns),
        "data",
        "10.214.1.1/24",
        &gateway_ns,
        "net1",
        "10.214.1.2/24",
    );
    link(
        Some(&gateway_ns),
        "net2",
        "10.214.2.1/24",
        &server_ns,
        "data",
        "10.214.2.2/24",
    );
    for range in ["10.96.0.0/16", "240.240.0.0/16"] {
        client_ns.run("ip", &["route", "add", range, "dev", "data"]);
    }
    client_ns.capture_outbound(APP_UID);
    client_ns.capture_dns(APP_UID);
    let _resolv = ResolvConf::write(&client_ns.name, "10.96.0.10", "default");
    server_ns.capture_inbound("data");
    server_ns.serve_http_echo(8080);

    let dir = tempfile::tempdir().unwrap();
    for (cluster, manifests) in [("east", EAST.to_string()), ("west", west())] {
        let path = dir.path().join("clusters").join(cluster);
        std::fs::create_dir_all(&path).unwrap();
        std::fs::write(path.join("mesh.yaml"), manifests).unwrap();
    }
    std::fs::create_dir_all(dir.path().join("config")).unwrap();
    std::fs::write(
        dir.path().join("config/cross-network.yaml"),
        CROSS_NETWORK_GATEWAY,
    )
    .unwrap();
    let mp = start_meshpilot(dir.path(), &["--xds-addr", "0.0.0.0:0"]).await;

    let proxy = |ns: &Netns,
                 ctl: &str,
                 host: &str,
                 node_id: &'static str,
                 metadata: &'static [(&'static str, &'static str)],
                 labels: &'static [(&'static str, &'static str)],
                 account: &str| EnvoyOptions {
        xds: SocketAddr::new(host.parse().unwrap(), mp.xds_addr.port()),
        replicas: &[],
        node_id,
        metadata,
        labels,
        mode: AdsMode::Sotw,
        workload: workload_certs(&mp, "default", account),
        xds_tls: None,
        netns: Some(InNetns {
            name: ns.name.clone(),
            ip: ctl.parse::<IpAddr>().unwrap(),
            host_ip: host.parse().unwrap(),
        }),
    };
    let client = Envoy::start_with(proxy(
        &client_ns,
        "10.214.11.2",
        "10.214.11.1",
        CLIENT,
        &[
            ("CLUSTER_ID", "east"),
            ("NETWORK", "network1"),
            ("DNS_CAPTURE", "true"),
        ],
        &[],
        "client",
    ))
    .await;
    let gateway = Envoy::start_with(proxy(
        &gateway_ns,
        "10.214.12.2",
        "10.214.12.1",
        "router~10.214.1.2~istio-eastwestgateway-0.istio-system~istio-system.svc.cluster.local",
        &[("CLUSTER_ID", "west"), ("NETWORK", "network2")],
        &[("app", "cross-network-gateway")],
        "istio-eastwestgateway",
    ))
    .await;
    let server = Envoy::start_with(proxy(
        &server_ns,
        "10.214.13.2",
        "10.214.13.1",
        "sidecar~10.214.2.2~server.default~default.svc.cluster.local",
        &[("CLUSTER_ID", "west"), ("NETWORK", "network2")],
        &[],
        "server",
    ))
    .await;

    let outbound = format!("outbound|8080||{ECHO}");
    let sni = format!("outbound_.8080_._.{ECHO}");
    wait_for("client sees network 2 through its gateway", BOUND, || {
        let (client, outbound) = (&client, outbound.clone());
        async move {
            (client.endpoints(&outbound).await == [format!("{GATEWAY_IP}:15443")]).then_some(())
        }
    })
    .await;
    wait_for("gateway routes the SNI to the backend", BOUND, || {
        let (gateway, sni) = (&gateway, sni.clone());
        async move { (gateway.endpoints(&sni).await == ["10.214.2.2:8080"]).then_some(()) }
    })
    .await;
    wait_for("backend sidecar has its inbound listener", BOUND, || {
        let server = &server;
        async move {
            server
                .get("/listeners")
                .await
                .contains("virtualInbound")
                .then_some(())
        }
    })
    .await;

    let response = wait_for("a response across the networks", BOUND, || {
        let output = client_ns
            .command("setpriv")
            .args([
                "--reuid",
                APP_UID,
                "--regid",
                APP_UID,
                "--clear-groups",
                "curl",
                "-s",
                "-m",
                "3",
            ])
            .args([
                "-H",
                &format!("Host: {ECHO}:8080"),
                "http://10.96.88.88:8080/across",
            ])
            .output();
        async move {
            let body: serde_json::Value = serde_json::from_slice(&output.ok()?.stdout).ok()?;
            (body["path"] == "/across").then_some(body)
        }
    })
    .await;

    let xfcc = response["headers"]["x-forwarded-client-cert"]
        .as_str()
        .unwrap_or_default();
    assert!(
        xfcc.contains("URI=spiffe://cluster.local/ns/default/sa/client"),
        "the backend's sidecar did not terminate the client's mTLS: {response}"
    );
    assert!(
        gateway
            .counter(&format!("cluster.{sni}.upstream_cx_total"))
            .await
            >= 1,
        "the request did not pass through the gateway"
    );
    assert!(
        gateway
            .counter("listener.0.0.0.0_15443.downstream_cx_total")
            .await
            >= 1,
        "nothing arrived on the gateway's listener"
    );
    assert_eq!(
        gateway.stat("listener.0.0.0.0_15443.ssl.handshake").await,
        None,
        "the gateway's listener has a TLS context: it would terminate TLS instead of passing it through"
    );
    assert!(server.counter("listener.0.0.0.0_15006.ssl.handshake").await >= 1);

    // A TLS client that is no mesh proxy, reaching the gateway's public address and naming the
    // service's mesh SNI: without Istio's mTLS ALPN it matches no chain and is closed during its
    // handshake, never forwarded (istiod's AUTO_PASSTHROUGH chains match the ALPN too).
    let forwarded = format!("cluster.{sni}.upstream_cx_total");
    let before = gateway.counter(&forwarded).await;
    let outsider = |alpn: &str| {
        let gateway = format!("{GATEWAY_IP}:15443");
        client_ns
            .command("timeout")
            .args(["10", "openssl", "s_client", "-connect", &gateway])
            .args(["-servername", &sni, "-alpn", alpn])
            .stdin(std::process::Stdio::null())
            .output()
            .expect("openssl runs")
    };
    let refused = outsider("h2");
    assert!(
        !refused.status.success(),
        "a non-mesh TLS client completed its handshake: {}",
        String::from_utf8_lossy(&refused.stdout)
    );
    assert!(
        gateway
            .counter("listener.0.0.0.0_15443.no_filter_chain_match")
            .await
            >= 1,
        "the gateway matched a chain for a non-mesh client"
    );
    assert_eq!(
        gateway.counter(&forwarded).await,
        before,
        "the gateway forwarded a non-mesh client"
    );
    // Naming Istio's ALPN gets it forwarded: the backend's sidecar then refuses it, as it shows no
    // mesh certificate.
    outsider("istio");
    wait_for("forwarded to the backend, refused there", BOUND, || async {
        let forwarded = gateway.counter(&forwarded).await > before;
        let refused = server
            .stat("listener.0.0.0.0_15006.ssl.fail_verify_no_cert")
            .await
            .unwrap_or_default()
            >= 1;
        (forwarded && refused).then_some(())
    })
    .await;

    // The headless pod by its own name: the agent resolves it to an allocated address, which the
    // client's sidecar sends through the gateway to that one pod.
    let mut agent = NdsAgent::start(
        SocketAddr::new("10.214.11.1".parse().unwrap(), mp.xds_addr.port()),
        CLIENT,
        ("east", "network1"),
        Protocol::Sotw,
        Some((&client_ns.name, "127.0.0.1:15053")),
    );
    agent.dns_address(BOUND).await;
    agent
        .table_where("with the pod's name", BOUND, |t| {
            t[POD]["ips"][0]
                .as_str()
                .is_some_and(|ip| ip.starts_with("240.240."))
        })
        .await;
    let pod_sni = format!("outbound_.8080_._.{POD}");
    wait_for(
        "the pod's service at the client and the gateway",
        BOUND,
        || {
            let (client, gateway, pod_sni) = (&client, &gateway, pod_sni.clone());
            async move {
                let at_client = client.endpoints(&format!("outbound|8080||{POD}")).await;
                let at_gateway = gateway.endpoints(&pod_sni).await;
                (at_client == [format!("{GATEWAY_IP}:15443")] && at_gateway == ["10.214.2.2:8080"])
                    .then_some(())
            }
        },
    )
    .await;
    let url = format!("http://{POD}:8080/by-name");
    let by_name = wait_for("a response from the pod by its name", BOUND, || {
        let output = client_ns
            .command("setpriv")
            .args(["--reuid", APP_UID, "--regid", APP_UID, "--clear-groups"])
            .args(["curl", "-s", "-m", "3", &url])
            .output();
        async move {
            let body: serde_json::Value = serde_json::from_slice(&output.ok()?.stdout).ok()?;
            (body["path"] == "/by-name").then_some(body)
        }
    })
    .await;
    assert!(
        by_name["headers"]["x-forwarded-client-cert"]
            .as_str()
            .is_some_and(|x| x.contains("sa/client")),
        "{by_name}"
    );
    assert!(
        gateway
            .counter(&format!("cluster.{pod_sni}.upstream_cx_total"))
            .await
            >= 1,
        "the pod's request did not pass through the gateway"
    );
    assert_eq!(
        client.rejected_updates().await
            + gateway.rejected_updates().await
            + server.rejected_updates().await,
        0
    );
}
