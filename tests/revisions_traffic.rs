//! Real traffic across two control-plane revisions sharing one root (a plug-in root, as `cacerts`
//! gives every revision): a client sidecar fed by the default revision and a server sidecar fed by
//! `canary` talk mutual TLS, and the server's namespace moving to `canary` (its sidecar restarted
//! on the other revision) keeps serving, before and after the client moves too. Needs root.

mod common;

use common::pair::Workloads;
use common::*;
use meshpilot::security::ca::CaBundle;

/// The client's identity as the server's sidecar saw it.
fn client_identity(response: &serde_json::Value) -> bool {
    let xfcc = response["headers"]["x-forwarded-client-cert"]
        .as_str()
        .unwrap_or_default();
    xfcc.contains("URI=spiffe://cluster.local/ns/default/sa/client")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sidecars_of_two_revisions_talk_mutual_tls_while_a_namespace_moves() {
    let root = tempfile::tempdir().unwrap();
    let bundle =
        CaBundle::self_signed_root("cluster.local", std::time::Duration::from_secs(86400)).unwrap();
    bundle.write_dir(root.path()).unwrap();
    let ca = root.path().to_str().unwrap();
    let pair = Workloads::start("rv", 245, &["--ca-dir", ca], "").await;
    let dir = pair.config_dir().to_path_buf();
    let state = tempfile::tempdir().unwrap();
    let canary_flags = [
        "--xds-addr",
        "0.0.0.0:0",
        "--revision",
        "canary",
        "--ca-dir",
        ca,
        "--state-dir",
        state.path().to_str().unwrap(),
    ];
    let canary = start_meshpilot(&dir, &canary_flags).await;
    assert_eq!(
        canary.ca.current().root_pem(),
        pair.mp.ca.current().root_pem(),
        "one root"
    );

    // Both on the default revision.
    let client = pair
        .client_sidecar(workload_certs(&pair.mp, "default", "client"))
        .await;
    let server = pair
        .server_sidecar(workload_certs(&pair.mp, "default", "server"))
        .await;
    assert!(client_identity(&pair.call().await));

    // The server's pod moves: its new sidecar is fed (and its certificate signed) by canary.
    drop(server);
    let server = pair
        .server_sidecar_fed_by(&canary, workload_certs(&canary, "default", "server"))
        .await;
    let response = pair.call().await;
    assert!(client_identity(&response), "{response}");
    assert!(
        server.counter("listener.0.0.0.0_15006.ssl.handshake").await >= 1,
        "the call across revisions was not mutual TLS"
    );

    // And the client's: the namespace has moved, and still serves.
    drop(client);
    let client = pair
        .client_sidecar_fed_by(&canary, workload_certs(&canary, "default", "client"))
        .await;
    assert!(client_identity(&pair.call().await));
    assert_eq!(
        client.rejected_updates().await + server.rejected_updates().await,
        0
    );
}
