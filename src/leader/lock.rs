//! The object an election is held in: a coordination.k8s.io Lease, or (for istiod's cluster-wide
//! elections) a ConfigMap whose `control-plane.alpha.kubernetes.io/leader` annotation holds the
//! record as JSON, with the holder's revision as its key (istio/istio
//! pilot/pkg/leaderelection/k8sleaderelection/k8sresourcelock/configmaplock.go). Both are written
//! at the `resourceVersion` read, so two replicas racing cannot both win.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::PostParams;
use kube::Api;
use serde::{Deserialize, Serialize};

/// Where istiod's ConfigMap locks keep their record.
pub const RECORD_ANNOTATION: &str = "control-plane.alpha.kubernetes.io/leader";

/// One election's record, whichever object holds it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Record {
    pub holder: String,
    /// The holder's priority key (its revision) in a ConfigMap lock; empty in a Lease.
    pub key: String,
    pub duration: Option<Duration>,
    /// When the holder last renewed, as written (compared, never parsed: clocks differ).
    pub renewed: String,
    pub transitions: i32,
}

/// The record's JSON in a ConfigMap lock (client-go's `LeaderElectionRecord` with Istio's key).
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ConfigMapRecord {
    #[serde(default)]
    holder_identity: String,
    #[serde(default)]
    holder_key: String,
    #[serde(default)]
    lease_duration_seconds: i64,
    acquire_time: Option<Time>,
    renew_time: Option<Time>,
    #[serde(default)]
    leader_transitions: i32,
}

/// The lock object as read, to be written back at its version.
pub enum Held {
    Lease(Lease),
    ConfigMap(ConfigMap),
}

impl Held {
    pub fn version(&self) -> Option<String> {
        match self {
            Self::Lease(lease) => lease.metadata.resource_version.clone(),
            Self::ConfigMap(map) => map.metadata.resource_version.clone(),
        }
    }
}

/// Reads and writes one kind of lock object.
#[derive(Clone)]
pub enum LockApi {
    Lease(Api<Lease>),
    ConfigMap(Api<ConfigMap>),
}

impl LockApi {
    pub fn plural(&self) -> &'static str {
        match self {
            Self::Lease(_) => "Lease",
            Self::ConfigMap(_) => "ConfigMap",
        }
    }

    pub async fn get(&self, name: &str) -> Result<Option<(Record, Held)>, kube::Error> {
        Ok(match self {
            Self::Lease(api) => api.get_opt(name).await?.map(|lease| {
                let spec = lease.spec.clone().unwrap_or_default();
                let record = Record {
                    holder: spec.holder_identity.unwrap_or_default(),
                    key: String::new(),
                    duration: seconds(spec.lease_duration_seconds.map(i64::from)),
                    renewed: (spec.renew_time.map(|t| t.0.to_string())).unwrap_or_default(),
                    transitions: spec.lease_transitions.unwrap_or(0),
                };
                (record, Held::Lease(lease))
            }),
            Self::ConfigMap(api) => api.get_opt(name).await?.map(|map| {
                let stored = (map.metadata.annotations.as_ref())
                    .and_then(|a| a.get(RECORD_ANNOTATION))
                    .and_then(|text| serde_json::from_str::<ConfigMapRecord>(text).ok())
                    .unwrap_or_default();
                let record = Record {
                    holder: stored.holder_identity,
                    key: stored.holder_key,
                    duration: seconds(Some(stored.lease_duration_seconds)),
                    renewed: (stored.renew_time.map(|t| t.0.to_string())).unwrap_or_default(),
                    transitions: stored.leader_transitions,
                };
                (record, Held::ConfigMap(map))
            }),
        })
    }

    /// Creates the lock object holding `record`; false when another replica created it first.
    pub async fn create(
        &self,
        name: &str,
        namespace: &str,
        record: &Record,
    ) -> Result<bool, kube::Error> {
        let metadata = ObjectMeta {
            name: Some(name.to_string()),
            namespace: Some(namespace.to_string()),
            ..Default::default()
        };
        let result = match self {
            Self::Lease(api) => {
                let lease = Lease {
                    metadata,
                    spec: Some(lease_spec(LeaseSpec::default(), record, true)),
                };
                api.create(&PostParams::default(), &lease).await.map(drop)
            }
            Self::ConfigMap(api) => {
                let mut map = ConfigMap {
                    metadata,
                    ..Default::default()
                };
                annotate(&mut map, record, None);
                api.create(&PostParams::default(), &map).await.map(drop)
            }
        };
        match result {
            Ok(()) => Ok(true),
            Err(kube::Error::Api(status)) if status.is_already_exists() => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Writes `record` over what was read; false on a conflict (someone wrote in between).
    /// `acquired` says whether the holder changes (the acquire time is set anew).
    pub async fn update(
        &self,
        name: &str,
        held: Held,
        record: &Record,
        acquired: bool,
    ) -> Result<bool, kube::Error> {
        let params = PostParams::default();
        let result = match (self, held) {
            (Self::Lease(api), Held::Lease(mut lease)) => {
                let spec = lease.spec.take().unwrap_or_default();
                lease.spec = Some(lease_spec(spec, record, acquired));
                api.replace(name, &params, &lease).await.map(drop)
            }
            (Self::ConfigMap(api), Held::ConfigMap(mut map)) => {
                let previous = (map.metadata.annotations.as_ref())
                    .and_then(|a| a.get(RECORD_ANNOTATION))
                    .and_then(|text| serde_json::from_str::<ConfigMapRecord>(text).ok());
                let acquire_time = match acquired {
                    true => None,
                    false => previous.and_then(|p| p.acquire_time),
                };
                annotate(&mut map, record, acquire_time);
                api.replace(name, &params, &map).await.map(drop)
            }
            // The object read came from this same API.
            _ => return Ok(false),
        };
        match result {
            Ok(()) => Ok(true),
            Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
            Err(e) => Err(e),
        }
    }
}

fn seconds(value: Option<i64>) -> Option<Duration> {
    value
        .and_then(|s| u64::try_from(s).ok())
        .filter(|s| *s > 0)
        .map(Duration::from_secs)
}

fn duration_seconds(record: &Record) -> i64 {
    record.duration.map_or(1, |d| d.as_secs().max(1)) as i64
}

fn lease_spec(mut spec: LeaseSpec, record: &Record, acquired: bool) -> LeaseSpec {
    let now = MicroTime(Timestamp::now());
    if acquired {
        spec.acquire_time = Some(now.clone());
    }
    spec.holder_identity = Some(record.holder.clone()).filter(|h| !h.is_empty());
    spec.lease_duration_seconds = Some(i32::try_from(duration_seconds(record)).unwrap_or(i32::MAX));
    spec.renew_time = Some(now);
    spec.lease_transitions = Some(record.transitions);
    spec
}

/// Writes the record into the ConfigMap's annotation; `acquire_time` None means now.
fn annotate(map: &mut ConfigMap, record: &Record, acquire_time: Option<Time>) {
    let now = Time(Timestamp::now());
    let stored = ConfigMapRecord {
        holder_identity: record.holder.clone(),
        holder_key: record.key.clone(),
        lease_duration_seconds: duration_seconds(record),
        acquire_time: Some(acquire_time.unwrap_or_else(|| now.clone())),
        renew_time: Some(now),
        leader_transitions: record.transitions,
    };
    let text = serde_json::to_string(&stored).unwrap_or_default();
    map.metadata
        .annotations
        .get_or_insert_with(BTreeMap::new)
        .insert(RECORD_ANNOTATION.to_string(), text);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_configmap_record_reads_as_istiod_writes_it() {
        let text = r#"{"holderIdentity":"istiod-5d9-x","holderKey":"default","leaseDurationSeconds":30,"acquireTime":"2026-11-28T01:00:00Z","renewTime":"2026-11-28T01:05:00Z","leaderTransitions":3}"#;
        let stored: ConfigMapRecord = serde_json::from_str(text).unwrap();
        assert_eq!(
            (stored.holder_identity.as_str(), stored.holder_key.as_str()),
            ("istiod-5d9-x", "default")
        );
        let mut map = ConfigMap::default();
        let record = Record {
            holder: "meshpilot-a".into(),
            key: "canary".into(),
            duration: Some(Duration::from_secs(30)),
            renewed: String::new(),
            transitions: 4,
        };
        annotate(&mut map, &record, stored.acquire_time);
        let written: serde_json::Value =
            serde_json::from_str(&map.metadata.annotations.unwrap()[RECORD_ANNOTATION]).unwrap();
        assert_eq!(written["holderKey"], "canary");
        assert_eq!(written["leaseDurationSeconds"], 30);
        assert_eq!(written["acquireTime"], "2026-11-28T01:00:00Z");
        assert_eq!(written["leaderTransitions"], 4);
    }
}
