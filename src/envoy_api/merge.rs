//! One message merged into another as istiod's EnvoyFilter MERGE does (pkg/proto/merge, a copy of
//! Go's `proto.Merge`): the fields the patch sets overwrite (a scalar it leaves at its zero value
//! cannot, as proto3 cannot tell it was set), lists append (or, for MERGE_AND_REPLACE_LIST, a list
//! the patch sets replaces the whole list), map entries replace those of the same key, messages
//! merge field by field — but a `Duration` is replaced whole, and an `Any` is replaced too, as its
//! payload is bytes to a reflective merge.

use prost_reflect::{DynamicMessage, Kind, Value};

/// What a list the patch sets does to the list it lands on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ListMerge {
    Append,
    Replace,
}

const DURATION: &str = "google.protobuf.Duration";

/// Merges `patch` into `target` (messages of one type).
pub fn merge(target: &mut DynamicMessage, patch: &DynamicMessage, lists: ListMerge) {
    for (field, value) in patch.fields() {
        match value {
            Value::List(items) => match (lists, target.get_field_mut(&field)) {
                (ListMerge::Append, Value::List(existing)) => {
                    existing.extend(items.iter().cloned())
                }
                (_, slot) => *slot = value.clone(),
            },
            Value::Map(entries) => match target.get_field_mut(&field) {
                Value::Map(existing) => {
                    existing.extend(entries.iter().map(|(k, v)| (k.clone(), v.clone())))
                }
                slot => *slot = value.clone(),
            },
            Value::Message(inner) => {
                let whole = matches!(field.kind(), Kind::Message(d) if d.full_name() == DURATION);
                if whole || !target.has_field(&field) {
                    target.set_field(&field, value.clone());
                } else if let Value::Message(existing) = target.get_field_mut(&field) {
                    merge(existing, inner, lists);
                }
            }
            scalar => target.set_field(&field, scalar.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::from_json;
    use super::*;

    const CLUSTER: &str = "envoy.config.cluster.v3.Cluster";

    fn cluster(json: serde_json::Value) -> DynamicMessage {
        from_json(CLUSTER, &json).expect("a cluster")
    }

    #[test]
    fn set_fields_overwrite_lists_append_durations_and_oneofs_replace() {
        let mut target = cluster(serde_json::json!({
            "name": "outbound|80||a",
            "connect_timeout": "10s",
            "circuit_breakers": {"thresholds": [{"max_connections": 5}]},
            "per_connection_buffer_limit_bytes": 1024,
            "type": "EDS",
        }));
        let patch = cluster(serde_json::json!({
            "connect_timeout": "0.5s",
            "circuit_breakers": {"thresholds": [{"max_requests": 7}]},
            "per_connection_buffer_limit_bytes": 32768,
            "cluster_type": {"name": "envoy.clusters.aggregate"},
        }));
        merge(&mut target, &patch, ListMerge::Append);
        let json = serde_json::to_value(&target).unwrap();
        assert_eq!(json["name"], "outbound|80||a");
        assert_eq!(json["connectTimeout"], "0.500s");
        assert_eq!(json["perConnectionBufferLimitBytes"], 32768);
        assert_eq!(
            json["circuitBreakers"]["thresholds"]
                .as_array()
                .unwrap()
                .len(),
            2
        );
        // The patch's cluster_type takes the oneof the target's type held.
        assert!(json.get("type").is_none(), "{json}");
        assert_eq!(json["clusterType"]["name"], "envoy.clusters.aggregate");

        let mut replaced = cluster(serde_json::json!({
            "circuit_breakers": {"thresholds": [{"max_connections": 5}]}
        }));
        merge(&mut replaced, &patch, ListMerge::Replace);
        let json = serde_json::to_value(&replaced).unwrap();
        let thresholds = json["circuitBreakers"]["thresholds"].as_array().unwrap();
        assert_eq!(thresholds.len(), 1);
        assert_eq!(thresholds[0]["maxRequests"], 7);
    }
}
