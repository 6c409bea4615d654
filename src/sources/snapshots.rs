//! Last-known-good snapshots of remote clusters: one file per cluster in the state directory, so a
//! restart while a remote's API server is unreachable still serves its endpoints (marked stale).
//!
//! A file is a magic tag, a format version and the snapshot, written beside and renamed in, so a
//! crash leaves the previous file or the new one, never half. The snapshot is JSON (format 2):
//! self-describing, so a field added later (with `serde(default)`) reads from older files and an
//! unknown one is skipped by older builds — a snapshot matters most right after an upgrade, while
//! a remote is down. Releases before issue 48 wrote postcard (format 1), which carries no field
//! names: it is still read, into the objects as they were then (today's; `tests/fixtures` holds
//! such a file, and a test fails the day the objects change without a frozen copy for it).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::model::ClusterId;
use crate::registry::SavedObjects;

/// The format written: JSON. Bumped only by a change older builds cannot skip (a renamed or
/// retyped field): they then refuse the file rather than misread it.
pub const FORMAT: u32 = 2;
/// postcard, written by releases before issue 48.
const POSTCARD_FORMAT: u32 = 1;
const MAGIC: &[u8; 8] = b"MPREMOTE";
/// Far above any real cluster's trimmed objects; a larger file is not read into memory.
const MAX_BYTES: u64 = 1 << 30;

#[derive(Debug, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    pub cluster: String,
    /// The API server the objects came from: a snapshot serves only a cluster reached there.
    pub server: String,
    /// A fingerprint of the CA that API server was trusted by: a snapshot serves only the cluster
    /// it was taken of, not a new one at the same address (older snapshots have none).
    #[serde(default)]
    pub ca: Option<String>,
    pub saved_at: SystemTime,
    pub objects: SavedObjects,
}

#[derive(Debug, Error)]
pub enum SnapshotError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: not a meshpilot remote-cluster snapshot")]
    Foreign { path: String },
    #[error("{path}: snapshot format {found}; this meshpilot reads formats {POSTCARD_FORMAT} and {FORMAT}")]
    Format { path: String, found: u32 },
    #[error("{path}: {size} bytes, more than a snapshot may have ({MAX_BYTES})")]
    TooLarge { path: String, size: u64 },
    #[error("{path}: corrupt snapshot: {detail}")]
    Corrupt { path: String, detail: String },
    #[error("snapshot of cluster {cluster} not encodable: {detail}")]
    Encode { cluster: String, detail: String },
}

/// The directory of snapshots.
#[derive(Clone, Debug)]
pub struct SnapshotStore {
    dir: PathBuf,
}

impl SnapshotStore {
    pub fn new(dir: PathBuf) -> Self {
        Self { dir }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `cluster-<id>.snap`, the id escaped to `[A-Za-z0-9._-]` so any id is one file name.
    fn path(&self, id: &ClusterId) -> PathBuf {
        let mut name = String::from("cluster-");
        for b in id.as_str().bytes() {
            match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'.' | b'_' | b'-' => {
                    name.push(b as char)
                }
                _ => name.push_str(&format!("%{b:02X}")),
            }
        }
        self.dir.join(name + ".snap")
    }

    /// Writes a snapshot over the previous one; returns the bytes written.
    pub fn save(&self, snapshot: &Snapshot) -> Result<usize, SnapshotError> {
        let path = self.path(&ClusterId::new(&snapshot.cluster));
        let io = |source| SnapshotError::Io {
            path: path.display().to_string(),
            source,
        };
        let body = serde_json::to_vec(snapshot).map_err(|e| SnapshotError::Encode {
            cluster: snapshot.cluster.clone(),
            detail: e.to_string(),
        })?;
        std::fs::create_dir_all(&self.dir).map_err(io)?;
        let staging = path.with_extension("snap.tmp");
        let mut file = std::fs::File::create(&staging).map_err(io)?;
        file.write_all(MAGIC).map_err(io)?;
        file.write_all(&FORMAT.to_le_bytes()).map_err(io)?;
        file.write_all(&body).map_err(io)?;
        file.sync_all().map_err(io)?;
        std::fs::rename(&staging, &path).map_err(io)?;
        Ok(MAGIC.len() + 4 + body.len())
    }

    /// The cluster's snapshot, None when there is none.
    pub fn load(&self, id: &ClusterId) -> Result<Option<Snapshot>, SnapshotError> {
        let path = self.path(id);
        let shown = || path.display().to_string();
        let size = match std::fs::metadata(&path) {
            Ok(meta) => meta.len(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(SnapshotError::Io {
                    path: shown(),
                    source,
                })
            }
        };
        if size > MAX_BYTES {
            return Err(SnapshotError::TooLarge {
                path: shown(),
                size,
            });
        }
        let bytes = std::fs::read(&path).map_err(|source| SnapshotError::Io {
            path: shown(),
            source,
        })?;
        decode(&bytes, &shown()).map(Some)
    }

    /// Deletes the cluster's snapshot (it left the mesh); a missing one is fine.
    pub fn remove(&self, id: &ClusterId) -> Result<(), SnapshotError> {
        let path = self.path(id);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(SnapshotError::Io {
                path: path.display().to_string(),
                source: e,
            }),
            _ => Ok(()),
        }
    }
}

/// A snapshot as format 1 laid it out (postcard: by position, so a field cannot be added).
#[derive(Deserialize)]
struct Format1 {
    cluster: String,
    server: String,
    saved_at: SystemTime,
    objects: SavedObjects,
}

impl From<Format1> for Snapshot {
    fn from(old: Format1) -> Self {
        Snapshot {
            cluster: old.cluster,
            server: old.server,
            ca: None,
            saved_at: old.saved_at,
            objects: old.objects,
        }
    }
}

/// A snapshot file's contents; `path` names it in errors.
pub fn decode(bytes: &[u8], path: &str) -> Result<Snapshot, SnapshotError> {
    let Some(rest) = bytes.strip_prefix(MAGIC.as_slice()) else {
        return Err(SnapshotError::Foreign { path: path.into() });
    };
    let Some((version, body)) = rest.split_first_chunk::<4>() else {
        return Err(SnapshotError::Foreign { path: path.into() });
    };
    let found = u32::from_le_bytes(*version);
    // A decoder's message may quote the input (an unknown field's name): bounded.
    let corrupt = |detail: String| SnapshotError::Corrupt {
        path: path.into(),
        detail: crate::text::clip(&detail),
    };
    match found {
        FORMAT => serde_json::from_slice(body).map_err(|e| corrupt(e.to_string())),
        POSTCARD_FORMAT => {
            let (snapshot, trailing) = postcard::take_from_bytes::<Format1>(body).map_err(|e| {
                corrupt(format!(
                    "{e} (format {POSTCARD_FORMAT} is read as the last release to write it wrote it)"
                ))
            })?;
            match trailing.len() {
                0 => Ok(snapshot.into()),
                n => Err(corrupt(format!("{n} bytes after the snapshot"))),
            }
        }
        _ => Err(SnapshotError::Format {
            path: path.into(),
            found,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use crate::model::UseWaypoint;
    use crate::registry::objects::{
        NamespaceObj, NodeObj, PodObj, ServiceObj, SliceEndpoint, SliceObj,
    };

    fn snapshot(cluster: &str) -> Snapshot {
        Snapshot {
            cluster: cluster.into(),
            server: "https://10.0.0.1:6443".into(),
            ca: None,
            saved_at: SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_800_000_000),
            objects: SavedObjects {
                services: vec![ServiceObj {
                    name: "reviews".into(),
                    namespace: "shop".into(),
                    labels: Default::default(),
                    cluster_ips: vec!["10.0.0.9".parse().unwrap()],
                    headless: false,
                    external_name: None,
                    ports: Vec::new(),
                    external_addresses: Vec::new(),
                    export_to: Vec::new(),
                }],
                nodes: vec![NodeObj {
                    name: "n1".into(),
                    locality: crate::model::Locality::parse("eu/eu-1").into(),
                }],
                ..Default::default()
            },
        }
    }

    /// The objects of the fixtures in tests/fixtures, one of each kind with most fields set.
    fn fixture() -> Snapshot {
        let pod = |name: &str, ip: &str, waypoint: bool| PodObj {
            name: name.into(),
            namespace: "shop".into(),
            workload: "reviews-v1".into(),
            labels: Arc::new(
                [
                    ("app".to_string(), "reviews".to_string()),
                    ("version".to_string(), "v1".to_string()),
                ]
                .into(),
            ),
            service_account: "bookinfo-reviews".into(),
            node: Some("node-a".into()),
            ips: vec![ip.parse().unwrap()],
            ready: true,
            captured: waypoint,
            host_network: false,
            terminal: false,
            uid: Some(format!("uid-{name}").into()),
        };
        Snapshot {
            cluster: "east".into(),
            server: "https://10.0.0.1:6443".into(),
            ca: None,
            saved_at: SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_800_000_000),
            objects: SavedObjects {
                namespaces: vec![
                    NamespaceObj {
                        name: "istio-system".into(),
                        network: Some("network-east".into()),
                        use_waypoint: None,
                    },
                    NamespaceObj {
                        name: "shop".into(),
                        network: None,
                        use_waypoint: Some(UseWaypoint::Named {
                            namespace: "shop".into(),
                            name: "waypoint".into(),
                        }),
                    },
                ],
                services: vec![ServiceObj {
                    name: "reviews".into(),
                    namespace: "shop".into(),
                    labels: [("app".to_string(), "reviews".to_string())].into(),
                    cluster_ips: vec!["10.96.0.9".parse().unwrap()],
                    headless: false,
                    external_name: None,
                    ports: vec![crate::model::ServicePort {
                        name: "http".into(),
                        port: 9080,
                        protocol: crate::model::Protocol::Http,
                        target_port: None,
                    }],
                    external_addresses: Vec::new(),
                    export_to: vec!["*".into()],
                }],
                slices: vec![SliceObj {
                    name: "reviews-abc".into(),
                    namespace: "shop".into(),
                    service: "reviews".into(),
                    ports: vec![("http".into(), 9080)],
                    endpoints: vec![
                        SliceEndpoint {
                            addresses: vec!["10.20.0.1".parse().unwrap()],
                            ready: Some(true),
                            serving: Some(true),
                            terminating: Some(false),
                            pod: Some("reviews-1".into()),
                            hostname: None,
                        },
                        SliceEndpoint {
                            addresses: vec!["10.20.0.2".parse().unwrap()],
                            ready: Some(false),
                            serving: None,
                            terminating: None,
                            pod: Some("reviews-2".into()),
                            hostname: Some("reviews-2".into()),
                        },
                    ],
                }],
                pods: vec![
                    pod("reviews-1", "10.20.0.1", false),
                    pod("reviews-2", "10.20.0.2", true),
                ],
                nodes: vec![NodeObj {
                    name: "node-a".into(),
                    locality: crate::model::Locality::parse("eu/eu-1/rack-1").into(),
                }],
            },
        }
    }

    #[test]
    fn files_of_every_format_read_so_far_still_read() {
        let postcard = include_bytes!("../../tests/fixtures/remote-snapshot-format1.snap");
        assert_eq!(decode(postcard, "format1").unwrap(), fixture());
        let json = include_bytes!("../../tests/fixtures/remote-snapshot-format2.snap");
        assert_eq!(decode(json, "format2").unwrap(), fixture());
    }

    #[test]
    fn fields_added_later_default_and_unknown_ones_are_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let store = SnapshotStore::new(dir.path().to_path_buf());
        store.save(&fixture()).unwrap();
        let bytes = std::fs::read(store.path(&ClusterId::new("east"))).unwrap();
        let (head, body) = bytes.split_at(12);
        let mut json: serde_json::Value = serde_json::from_slice(body).unwrap();
        // As an older build wrote it (no uid yet), and a newer one (a field unknown here).
        for pod in json["objects"]["pods"].as_array_mut().unwrap() {
            let pod = pod.as_object_mut().unwrap();
            pod.remove("uid");
            pod.insert("priority".into(), serde_json::json!(7));
        }
        let mut edited = head.to_vec();
        edited.extend(serde_json::to_vec(&json).unwrap());
        let read = decode(&edited, "p").unwrap();
        assert!(read.objects.pods.iter().all(|p| p.uid.is_none()));
        assert_eq!(read.objects.services, fixture().objects.services);
    }

    #[test]
    fn saved_snapshots_load_back_and_removed_ones_are_gone() {
        let dir = tempfile::tempdir().unwrap();
        let store = SnapshotStore::new(dir.path().join("remotes"));
        let id = ClusterId::new("west/1 ü");
        assert!(store.load(&id).unwrap().is_none());
        let written = store.save(&snapshot("west/1 ü")).unwrap();
        let path = store.path(&id);
        assert_eq!(path.file_name().unwrap(), "cluster-west%2F1%20%C3%BC.snap");
        assert_eq!(std::fs::metadata(&path).unwrap().len() as usize, written);
        assert_eq!(store.load(&id).unwrap(), Some(snapshot("west/1 ü")));
        store.remove(&id).unwrap();
        store.remove(&id).unwrap();
        assert!(store.load(&id).unwrap().is_none());
    }

    #[test]
    fn damaged_files_are_refused_with_what_is_wrong() {
        let good = {
            let dir = tempfile::tempdir().unwrap();
            let store = SnapshotStore::new(dir.path().to_path_buf());
            store.save(&snapshot("west")).unwrap();
            std::fs::read(store.path(&ClusterId::new("west"))).unwrap()
        };
        let error = |bytes: &[u8]| {
            decode(bytes, "/s/cluster-west.snap")
                .unwrap_err()
                .to_string()
        };
        assert_eq!(
            error(b"apiVersion: v1"),
            "/s/cluster-west.snap: not a meshpilot remote-cluster snapshot"
        );
        let mut newer = good.clone();
        newer[8..12].copy_from_slice(&7u32.to_le_bytes());
        assert_eq!(
            error(&newer),
            "/s/cluster-west.snap: snapshot format 7; this meshpilot reads formats 1 and 2"
        );
        assert!(
            error(&good[..good.len() - 3]).starts_with("/s/cluster-west.snap: corrupt snapshot: ")
        );
        let mut longer = good.clone();
        longer.push(b'x');
        assert!(error(&longer).starts_with("/s/cluster-west.snap: corrupt snapshot: trailing"));
        // Every truncation and single-byte change either decodes or is refused; none panics.
        for cut in 0..good.len() {
            let _ = decode(&good[..cut], "p");
        }
        for i in 0..good.len() {
            let mut flipped = good.clone();
            flipped[i] ^= 0xff;
            let _ = decode(&flipped, "p");
        }
    }
}
