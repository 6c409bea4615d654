//! What two control planes send one proxy, compared for what traffic does. Resources are matched
//! by name; inside them, lists whose order carries no meaning are matched by what identifies an
//! item (a filter chain by its match, a filter by its name, a virtual host by its domains, an
//! endpoint by its address, a locality by locality and priority), routes by position. Before
//! comparing, both sides lose what only labels or reports (`NORMALISED`); the rest is reported.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::{Map, Value};

use super::equivalent;
use super::source::{State, TYPES};
use crate::text::clip;

/// What is left out before comparing, and why it cannot change where traffic goes.
pub const NORMALISED: &[(&str, &str)] = &[
    (
        "stat_prefix, shadow_rules_stat_prefix, alt_stat_name, observability_name",
        "names in statistics",
    ),
    (
        "name of filter chains (the default one too), virtual hosts and routes",
        "labels; chains are matched by their match",
    ),
    (
        "decorator, tracing, access_log, request_id_extension",
        "reporting",
    ),
    (
        "metadata.filter_metadata.istio",
        "Istio's telemetry labels (TLS metadata stays)",
    ),
    (
        "istio.stats, istio.metadata_exchange, grpc_stats, Istio's WASM metadata exchange filters",
        "telemetry filters",
    ),
    (
        "fault and CORS filters without config",
        "they act only through a route's per-filter config",
    ),
    (
        "InboundPassthroughClusterIpv4/Ipv6 read as InboundPassthroughCluster",
        "one cluster since istiod 1.23",
    ),
    (
        "integers written as strings",
        "protobuf JSON writes 64-bit integers so",
    ),
];

/// Keys dropped wherever they appear.
const DROPPED_KEYS: &[&str] = &[
    "stat_prefix",
    "shadow_rules_stat_prefix",
    "alt_stat_name",
    "observability_name",
    "decorator",
    "tracing",
    "access_log",
    "request_id_extension",
    "version_info",
];

/// Filters (network, HTTP, cluster) dropped by name.
const TELEMETRY_FILTERS: &[&str] = &[
    "istio.stats",
    "istio.metadata_exchange",
    "envoy.filters.http.grpc_stats",
    "envoy.filters.network.metadata_exchange",
    "envoy.wasm.metadata_exchange",
    "istio.peer_metadata",
];

/// One difference: where, and each side's value (None: absent there).
#[derive(Debug, Serialize, PartialEq)]
pub struct Difference {
    #[serde(rename = "type")]
    pub type_name: &'static str,
    pub resource: String,
    /// What kind of resource it is (`kind_of`): what accept lines name.
    pub kind: &'static str,
    pub path: String,
    /// The field: the path with list items matched by their content or position written `[*]`
    /// (filters keep their name).
    pub field: String,
    pub left: Option<Value>,
    pub right: Option<Value>,
    /// The proxy it was found for, where several are compared.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub proxy: Option<String>,
}

/// Every difference between the two states of one proxy (a router when `router`).
pub fn compare(left: &State, right: &State, router: bool) -> Vec<Difference> {
    let mut out = Vec::new();
    for (i, type_name) in TYPES.iter().enumerate() {
        let (l, r) = match *type_name {
            "lds" => (
                normalised(&equivalent::listeners(&left[i])),
                normalised(&equivalent::listeners(&right[i])),
            ),
            _ => (normalised(&left[i]), normalised(&right[i])),
        };
        let names: std::collections::BTreeSet<&String> = l.keys().chain(r.keys()).collect();
        for name in names {
            let (lv, rv) = (l.get(name), r.get(name));
            let kind = kind_of(type_name, name, router, [lv, rv]);
            let mut found = Vec::new();
            walk(lv, rv, (String::new(), String::new()), &mut found);
            out.extend(
                found
                    .into_iter()
                    .map(|((path, field), left, right)| Difference {
                        type_name,
                        resource: name.clone(),
                        kind,
                        path,
                        field,
                        left,
                        right,
                        proxy: None,
                    }),
            );
        }
    }
    out
}

/// The kinds of resource accept lines name, by type.
pub const KINDS: &[(&str, &[&str])] = &[
    (
        "cds",
        &[
            "outbound",
            "inbound",
            "sni",
            "PassthroughCluster",
            "InboundPassthroughCluster",
            "BlackHoleCluster",
            "gateway-outbound",
            "gateway-sni",
            "gateway-BlackHoleCluster",
        ],
    ),
    (
        "eds",
        &["outbound", "sni", "gateway-outbound", "gateway-sni"],
    ),
    (
        "lds",
        &[
            "virtualOutbound",
            "virtualInbound",
            "sidecar-port",
            "sidecar-tls-port",
            "gateway",
        ],
    ),
    ("rds", &["sidecar-port", "inbound", "gateway"]),
];

/// What kind of resource `name` is: clusters and assignments by their Istio name (a router's
/// `gateway-…`); a sidecar's outbound port listener is `sidecar-tls-port` where a chain (on either
/// side) matches TLS by SNI or transport; a router's listeners and routes are `gateway`.
fn kind_of(type_name: &str, name: &str, router: bool, sides: [Option<&Value>; 2]) -> &'static str {
    let cluster = |name: &str| match (router, name) {
        (false, n) if n.starts_with("outbound|") => "outbound",
        (false, n) if n.starts_with("inbound|") => "inbound",
        (false, n) if n.starts_with("outbound_.") => "sni",
        (false, "PassthroughCluster") => "PassthroughCluster",
        (false, "InboundPassthroughCluster") => "InboundPassthroughCluster",
        (false, "BlackHoleCluster") => "BlackHoleCluster",
        (true, n) if n.starts_with("outbound|") => "gateway-outbound",
        (true, n) if n.starts_with("outbound_.") => "gateway-sni",
        (true, "BlackHoleCluster") => "gateway-BlackHoleCluster",
        _ => "other",
    };
    match type_name {
        "cds" | "eds" => cluster(name),
        "lds" if router => "gateway",
        "lds" => match name {
            "virtualOutbound" => "virtualOutbound",
            "virtualInbound" => "virtualInbound",
            _ if sides.iter().flatten().any(|l| matches_tls(l)) => "sidecar-tls-port",
            _ => "sidecar-port",
        },
        "rds" if router => "gateway",
        "rds" if is_port(name) || name.rsplit_once(':').is_some_and(|(_, p)| is_port(p)) => {
            "sidecar-port"
        }
        "rds" if name.starts_with("inbound|") || name == "InboundPassthroughCluster" => "inbound",
        _ => "other",
    }
}

/// A sidecar's outbound route is named by its port, or `<host>:<port>` for one sniffed service.
fn is_port(name: &str) -> bool {
    !name.is_empty() && name.bytes().all(|b| b.is_ascii_digit())
}

/// Whether a listener has a chain matching TLS: by server name or transport protocol.
fn matches_tls(listener: &Value) -> bool {
    let chains = listener["filter_chains"].as_array().into_iter().flatten();
    chains.into_iter().any(|c| {
        let m = &c["filter_chain_match"];
        m.get("server_names").is_some() || m["transport_protocol"] == "tls"
    })
}

fn normalised(resources: &BTreeMap<String, Value>) -> BTreeMap<String, Value> {
    resources
        .iter()
        .map(|(name, v)| (renamed(name), normalise(&equivalent::encodings(v), "")))
        .collect()
}

fn renamed(name: &str) -> String {
    match name {
        "InboundPassthroughClusterIpv4" | "InboundPassthroughClusterIpv6" => {
            "InboundPassthroughCluster".to_string()
        }
        other => other.to_string(),
    }
}

/// A value as it is compared: what only labels or reports left out, numbers as strings.
pub fn normalise_value(v: &Value) -> Value {
    normalise(v, "")
}

fn normalise(v: &Value, key: &str) -> Value {
    match v {
        Value::Object(map) => {
            let mut out = Map::new();
            for (k, v) in map {
                if DROPPED_KEYS.contains(&k.as_str()) {
                    continue;
                }
                let labelled = matches!(
                    key,
                    "filter_chains" | "default_filter_chain" | "virtual_hosts" | "routes"
                );
                if k == "name" && labelled {
                    continue;
                }
                if key == "filter_metadata" && k == "istio" {
                    continue;
                }
                let normal = normalise(v, k);
                // Emptied by normalisation (only telemetry was there): as if never set.
                if is_empty(&normal) && !is_empty(v) {
                    continue;
                }
                out.insert(k.clone(), normal);
            }
            Value::Object(out)
        }
        Value::Array(items) => Value::Array(
            items
                .iter()
                .filter(|i| !is_telemetry_filter(i))
                .map(|i| normalise(i, key))
                .collect(),
        ),
        Value::String(s) => Value::String(renamed(s)),
        Value::Number(n) => Value::String(n.to_string()),
        other => other.clone(),
    }
}

fn is_empty(v: &Value) -> bool {
    match v {
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        _ => false,
    }
}

fn is_telemetry_filter(item: &Value) -> bool {
    let name = item.get("name").and_then(Value::as_str).unwrap_or_default();
    TELEMETRY_FILTERS.contains(&name) || is_idle_route_filter(name, item)
}

/// Fault injection and CORS with no config of their own: they act only where a route's
/// per-filter config asks them to.
fn is_idle_route_filter(name: &str, item: &Value) -> bool {
    let idle = item["typed_config"]
        .as_object()
        .is_some_and(|c| c.len() == 1);
    idle && matches!(name, "envoy.filters.http.fault" | "envoy.filters.http.cors")
}

/// What identifies an item of the list under `key`; None: compared by position.
fn identity(key: &str, item: &Value) -> Option<String> {
    let field = |name: &str| item.get(name).map(Value::to_string);
    match key {
        "filter_chains" => Some(field("filter_chain_match").unwrap_or_else(|| "{}".to_string())),
        "filters" | "http_filters" | "listener_filters" | "transport_socket_matches" => {
            field("name")
        }
        "virtual_hosts" => {
            let mut domains: Vec<String> = item
                .get("domains")?
                .as_array()?
                .iter()
                .map(Value::to_string)
                .collect();
            domains.sort();
            Some(domains.join(","))
        }
        "lb_endpoints" => Some(
            item.pointer("/endpoint/address/socket_address")
                .map(Value::to_string)
                .unwrap_or_else(|| item.to_string()),
        ),
        "endpoints" => Some(format!(
            "{} priority {}",
            field("locality").unwrap_or_default(),
            field("priority").unwrap_or_else(|| "0".to_string())
        )),
        // Sets: the order of these never matters.
        "domains"
        | "server_names"
        | "application_protocols"
        | "prefix_ranges"
        | "source_prefix_ranges"
        | "match_subject_alt_names"
        | "match_typed_subject_alt_names" => Some(item.to_string()),
        _ => None,
    }
}

/// Differences found: (path, field), each side's value.
type Found = Vec<((String, String), Option<Value>, Option<Value>)>;

/// Lists whose items are identified by their name, which their field keeps.
const NAMED_ITEMS: &[&str] = &[
    "filters",
    "http_filters",
    "listener_filters",
    "transport_socket_matches",
];

fn walk(left: Option<&Value>, right: Option<&Value>, at: (String, String), out: &mut Found) {
    let (path, field) = at;
    // A field (not a whole resource, not an item of a list) one side sets and the other not:
    // each of its own fields is told apart, so a difference names the field it is in.
    let a_field = !path.is_empty() && !path.ends_with(']');
    match (left, right) {
        (Some(Value::Object(l)), Some(Value::Object(r))) => {
            let keys: std::collections::BTreeSet<&String> = l.keys().chain(r.keys()).collect();
            for k in keys {
                walk(
                    l.get(k),
                    r.get(k),
                    (join(&path, k), field_of(&field, k)),
                    out,
                );
            }
        }
        (Some(Value::Object(l)), None) if a_field && !l.is_empty() => {
            for (k, v) in l {
                walk(Some(v), None, (join(&path, k), field_of(&field, k)), out);
            }
        }
        (None, Some(Value::Object(r))) if a_field && !r.is_empty() => {
            for (k, v) in r {
                walk(None, Some(v), (join(&path, k), field_of(&field, k)), out);
            }
        }
        (Some(Value::Array(l)), Some(Value::Array(r))) => {
            let key = path.rsplit('.').next().unwrap_or_default();
            let key = key.split('[').next().unwrap_or_default();
            let item = |id: &str| match NAMED_ITEMS.contains(&key) {
                true => format!("{field}[{id}]"),
                false => format!("{field}[*]"),
            };
            match (keyed(key, l), keyed(key, r)) {
                (Some(lk), Some(rk)) if lk.len() == l.len() && rk.len() == r.len() => {
                    let ids: std::collections::BTreeSet<&String> =
                        lk.keys().chain(rk.keys()).collect();
                    for id in ids {
                        let at = (format!("{path}[{}]", clip(id)), item(id));
                        walk(lk.get(id).copied(), rk.get(id).copied(), at, out);
                    }
                }
                _ => {
                    for i in 0..l.len().max(r.len()) {
                        let at = (format!("{path}[{i}]"), format!("{field}[*]"));
                        walk(l.get(i), r.get(i), at, out);
                    }
                }
            }
        }
        (l, r) if l == r => {}
        (l, r) => out.push(((path, field), l.cloned(), r.cloned())),
    }
}

/// The items of a list by identity; None when some item has none.
fn keyed<'v>(key: &str, items: &'v [Value]) -> Option<BTreeMap<String, &'v Value>> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    items
        .iter()
        .map(|i| {
            let id = identity(key, i)?;
            // Two filters of one name (DENY and ALLOW RBAC) are told apart by their order.
            let n = seen.entry(id.clone()).or_default();
            *n += 1;
            Some(match *n {
                1 => (id, i),
                n => (format!("{id}#{n}"), i),
            })
        })
        .collect()
}

/// A key's field: a folded listener's own field (`<field>@<address>`) for any address.
fn field_of(field: &str, key: &str) -> String {
    match key.split_once('@') {
        Some((name, _)) => join(field, &format!("{name}@[*]")),
        None => join(field, key),
    }
}

fn join(path: &str, key: &str) -> String {
    match path.is_empty() {
        true => key.to_string(),
        false => format!("{path}.{key}"),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn state(cds: Value) -> State {
        let mut s = State::default();
        for c in cds.as_array().unwrap() {
            s[0].insert(c["name"].as_str().unwrap().to_string(), c.clone());
        }
        s
    }

    #[test]
    fn order_labels_and_telemetry_do_not_count_and_policy_does() {
        let left = state(json!([{
            "name": "c", "lb_policy": "LEAST_REQUEST", "connect_timeout": "10s",
            "filters": [{"name": "istio.metadata_exchange"}],
            "metadata": {"filter_metadata": {"istio": {"services": []}}},
            "transport_socket_matches": [{"name": "tlsMode-istio"}, {"name": "tlsMode-disabled"}],
        }]));
        let same = state(json!([{
            "name": "c", "lb_policy": "LEAST_REQUEST", "connect_timeout": "10s",
            "transport_socket_matches": [{"name": "tlsMode-disabled"}, {"name": "tlsMode-istio"}],
        }]));
        assert_eq!(compare(&left, &same, false), []);
        let other = state(json!([{"name": "c", "connect_timeout": "10s"}]));
        let found = compare(&left, &other, false);
        let paths: Vec<&str> = found.iter().map(|d| d.path.as_str()).collect();
        assert!(paths.contains(&"lb_policy"), "{found:?}");
    }
}
