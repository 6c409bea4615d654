//! xDS resources as protobuf JSON in the corpus's form (`MessageToDict` with the .proto's field
//! names: defaults omitted, enums by name, `Any` unpacked beside its `@type`), so a live server's
//! answer and a saved dump compare alike. An `Any` of a type meshpilot has no descriptor for
//! (Istio's own filter configs) keeps its bytes, base64, under `value`.

use base64::Engine;
use prost_reflect::{DynamicMessage, Kind, MapKey, ReflectMessage, Value};
use serde_json::{json, Map, Value as Json};

use crate::envoy_api;

/// A message as JSON.
pub fn message(m: &DynamicMessage) -> Json {
    match m.descriptor().full_name() {
        envoy_api::ANY => any(m),
        "google.protobuf.Duration" => duration(m),
        "google.protobuf.Struct" => json_struct(m),
        "google.protobuf.Value" => json_value(m),
        "google.protobuf.ListValue" => list_value(m),
        name if is_wrapper(name) => m
            .get_field_by_name("value")
            .map(|v| value(&v, &Kind::Message(m.descriptor())))
            .unwrap_or(Json::Null),
        _ => {
            let mut out = Map::new();
            for (field, v) in m.fields() {
                out.insert(field.name().to_string(), value(v, &field.kind()));
            }
            Json::Object(out)
        }
    }
}

fn is_wrapper(name: &str) -> bool {
    matches!(
        name,
        "google.protobuf.BoolValue"
            | "google.protobuf.UInt32Value"
            | "google.protobuf.UInt64Value"
            | "google.protobuf.Int32Value"
            | "google.protobuf.Int64Value"
            | "google.protobuf.DoubleValue"
            | "google.protobuf.FloatValue"
            | "google.protobuf.StringValue"
            | "google.protobuf.BytesValue"
    )
}

fn value(v: &Value, kind: &Kind) -> Json {
    match v {
        Value::Bool(b) => json!(b),
        Value::I32(n) => json!(n),
        Value::U32(n) => json!(n),
        // As MessageToDict: 64-bit integers are strings.
        Value::I64(n) => json!(n.to_string()),
        Value::U64(n) => json!(n.to_string()),
        Value::F32(n) => json!(n),
        Value::F64(n) => json!(n),
        Value::String(s) => json!(s),
        Value::Bytes(b) => json!(base64::engine::general_purpose::STANDARD.encode(b)),
        Value::EnumNumber(n) => match kind {
            Kind::Enum(e) => e
                .get_value(*n)
                .map_or_else(|| json!(n), |v| json!(v.name())),
            _ => json!(n),
        },
        Value::Message(m) => message(m),
        Value::List(items) => Json::Array(items.iter().map(|i| value(i, kind)).collect()),
        Value::Map(entries) => {
            let value_kind = match kind {
                Kind::Message(entry) => entry.map_entry_value_field().kind(),
                other => other.clone(),
            };
            let mut out = Map::new();
            for (k, v) in entries {
                let key = match k {
                    MapKey::Bool(b) => b.to_string(),
                    MapKey::I32(n) => n.to_string(),
                    MapKey::I64(n) => n.to_string(),
                    MapKey::U32(n) => n.to_string(),
                    MapKey::U64(n) => n.to_string(),
                    MapKey::String(s) => s.clone(),
                };
                out.insert(key, value(v, &value_kind));
            }
            Json::Object(out)
        }
    }
}

fn any(m: &DynamicMessage) -> Json {
    let url = m
        .get_field_by_name("type_url")
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default();
    let bytes = m
        .get_field_by_name("value")
        .and_then(|v| v.as_bytes().cloned())
        .unwrap_or_default();
    let mut out = Map::new();
    out.insert("@type".to_string(), json!(url));
    match envoy_api::unpack(&url, &bytes) {
        Ok(inner) => match message(&inner) {
            Json::Object(fields) => out.extend(fields),
            other => {
                out.insert("value".to_string(), other);
            }
        },
        Err(_) => {
            let encoded = base64::engine::general_purpose::STANDARD.encode(&bytes);
            out.insert("value".to_string(), json!(encoded));
        }
    }
    Json::Object(out)
}

/// `1.500s`, as protobuf JSON writes a Duration (0, 3, 6 or 9 fractional digits).
fn duration(m: &DynamicMessage) -> Json {
    let int = |name: &str| {
        m.get_field_by_name(name)
            .and_then(|v| v.as_i64().or(v.as_i32().map(i64::from)))
            .unwrap_or(0)
    };
    let (seconds, nanos) = (int("seconds"), int("nanos"));
    let text = match nanos {
        0 => format!("{seconds}s"),
        n if n % 1_000_000 == 0 => format!("{seconds}.{:03}s", n / 1_000_000),
        n if n % 1_000 == 0 => format!("{seconds}.{:06}s", n / 1_000),
        n => format!("{seconds}.{n:09}s"),
    };
    json!(text)
}

fn json_struct(m: &DynamicMessage) -> Json {
    let Some(fields) = m.get_field_by_name("fields") else {
        return json!({});
    };
    let mut out = Map::new();
    if let Some(entries) = fields.as_map() {
        for (k, v) in entries {
            if let (MapKey::String(k), Some(v)) = (k, v.as_message()) {
                out.insert(k.clone(), json_value(v));
            }
        }
    }
    Json::Object(out)
}

/// A `google.protobuf.Value`: whichever of its kinds is set.
fn json_value(m: &DynamicMessage) -> Json {
    match m.fields().next() {
        Some((field, v)) => match (field.name(), v) {
            ("number_value", Value::F64(n)) => json!(n),
            ("string_value", Value::String(s)) => json!(s),
            ("bool_value", Value::Bool(b)) => json!(b),
            ("struct_value", Value::Message(s)) => json_struct(s),
            ("list_value", Value::Message(l)) => list_value(l),
            _ => Json::Null,
        },
        None => Json::Null,
    }
}

fn list_value(m: &DynamicMessage) -> Json {
    let items = m
        .get_field_by_name("values")
        .and_then(|v| v.as_list().map(<[Value]>::to_vec))
        .unwrap_or_default();
    Json::Array(
        items
            .iter()
            .filter_map(|v| v.as_message().map(json_value))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use envoy_types::pb::envoy::config::cluster::v3::Cluster;
    use envoy_types::pb::google::protobuf::Duration;

    use super::*;

    #[test]
    fn a_cluster_reads_as_the_corpus_writes_it() {
        let cluster = Cluster {
            name: "outbound|9080||reviews".to_string(),
            lb_policy: 1,
            connect_timeout: Some(Duration {
                seconds: 10,
                nanos: 0,
            }),
            per_connection_buffer_limit_bytes: Some(
                envoy_types::pb::google::protobuf::UInt32Value { value: 32768 },
            ),
            ..Default::default()
        };
        let json = message(&envoy_api::to_dynamic(&cluster).unwrap());
        assert_eq!(
            json,
            json!({
                "name": "outbound|9080||reviews",
                "lb_policy": "LEAST_REQUEST",
                "connect_timeout": "10s",
                "per_connection_buffer_limit_bytes": 32768,
            })
        );
    }
}
