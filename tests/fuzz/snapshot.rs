//! Remote-cluster snapshots read back from the state directory after a restart.

use std::time::{Duration, SystemTime};

use meshpilot::registry::objects::{NodeObj, PodObj, ServiceObj, SliceEndpoint, SliceObj};
use meshpilot::registry::SavedObjects;
use meshpilot::sources::snapshots::{self, Snapshot, SnapshotStore};

use crate::mutate::mutated_bytes;
use crate::{bounded, clear_refusal, fuzz};

/// A saved file of one service with an endpoint, its pod and node, as meshpilot writes it.
fn saved_file() -> Vec<u8> {
    let ip = "10.1.0.5".parse().expect("an address");
    let objects = SavedObjects {
        services: vec![ServiceObj {
            name: "reviews".into(),
            namespace: "shop".into(),
            labels: [("app".to_string(), "reviews".to_string())].into(),
            cluster_ips: vec!["10.0.0.9".parse().expect("an address")],
            headless: false,
            external_name: None,
            ports: Vec::new(),
            external_addresses: Vec::new(),
            export_to: vec!["*".into()],
        }],
        slices: vec![SliceObj {
            name: "reviews-1".into(),
            namespace: "shop".into(),
            service: "reviews".into(),
            ports: vec![("http".into(), 9080)],
            endpoints: vec![SliceEndpoint {
                addresses: vec![ip],
                ready: Some(true),
                serving: None,
                terminating: Some(false),
                pod: Some("reviews-v1".into()),
                hostname: None,
            }],
        }],
        pods: vec![PodObj {
            name: "reviews-v1".into(),
            namespace: "shop".into(),
            workload: "reviews-v1".into(),
            labels: Default::default(),
            service_account: "bookinfo-reviews".into(),
            node: Some("n1".into()),
            ips: vec![ip],
            ready: true,
            captured: false,
            host_network: false,
            terminal: false,
            uid: None,
        }],
        nodes: vec![NodeObj {
            name: "n1".into(),
            locality: meshpilot::model::Locality::parse("eu/eu-1/a").into(),
        }],
        ..Default::default()
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SnapshotStore::new(dir.path().to_path_buf());
    store
        .save(&Snapshot {
            cluster: "east".into(),
            server: "https://192.0.2.1:6443".into(),
            ca: Some("0123456789abcdef".into()),
            saved_at: SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000),
            objects,
        })
        .expect("saved");
    std::fs::read(dir.path().join("cluster-east.snap")).expect("read back")
}

#[test]
fn remote_snapshots() {
    let seed = saved_file();
    assert!(snapshots::decode(&seed, "seed").is_ok());
    fuzz("remote snapshots", mutated_bytes(vec![seed], 16), |bytes| {
        let path = "/state/remotes/cluster-east.snap";
        if let Err(e) = bounded(bytes.len(), || snapshots::decode(&bytes, path))? {
            clear_refusal(&e, &[path])?;
        }
        Ok(())
    });
}
