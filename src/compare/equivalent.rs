//! Configurations that make Envoy do the same, rewritten to one form on both sides before
//! comparing (`EQUIVALENCES` says which and why).

use std::collections::BTreeMap;

use serde_json::{json, Map, Value};

/// What is read as the same, and why Envoy treats it so.
pub const EQUIVALENCES: &[(&str, &str)] = &[
    (
        "outbound listeners `<address>_<port>` read as chains of `0.0.0.0_<port>` matching that address, their default chain as a chain matching the address alone (and the address and each transport protocol that its other chains narrow further, by ALPN or server name); a folded listener's own listener fields (filters, limits, options) that differ from the port listener's are kept as `<field>@<address>` and compared",
        "the original-destination hand-off picks the exact address's listener first, as a chain's address match is picked before the port's others; Envoy narrows a connection level by level and never goes back, so the address listener's default catches what its chains narrowed to and then missed",
    ),
    (
        "`match_subject_alt_names` read as `match_typed_subject_alt_names` (URI for `scheme://` values, DNS otherwise)",
        "the deprecated field, with its one kind of SAN",
    ),
    (
        "an empty `filter_chain_match`, and `prefix_ranges` of only 0.0.0.0/0 or ::/0, as no match",
        "both match every connection",
    ),
    (
        "a chain matching everything, as the listener's `default_filter_chain` (and, for a port with only address listeners, `virtualOutbound`'s catch-all)",
        "Envoy uses either for a connection no other chain matches",
    ),
    (
        "`transport_protocol: tls` beside `server_names`",
        "only TLS carries a server name",
    ),
    (
        "a locality group without endpoints, as none (a list of only such, as no list)",
        "it receives nothing",
    ),
    (
        "a header matcher's `exact_match`, `prefix_match`, `suffix_match`, `contains_match` read as `string_match`",
        "the deprecated fields, with the same match",
    ),
];

/// A header matcher's deprecated fields and their `string_match` counterparts.
const HEADER_MATCHES: [(&str, &str); 4] = [
    ("exact_match", "exact"),
    ("prefix_match", "prefix"),
    ("suffix_match", "suffix"),
    ("contains_match", "contains"),
];

/// Rewrites listeners (by name) to one layout: each outbound listener bound to an address merged
/// into the port's `0.0.0.0_<port>`, its chains matching that address.
pub fn listeners(listeners: &BTreeMap<String, Value>) -> BTreeMap<String, Value> {
    let catch_all = listeners
        .get("virtualOutbound")
        .and_then(|l| l["filter_chains"].as_array())
        .and_then(|chains| chains.iter().find(|c| is_match_all(c)))
        .cloned();
    let mut out: BTreeMap<String, Value> = BTreeMap::new();
    let mut by_address: Vec<(String, u64, &Value)> = Vec::new();
    for (name, listener) in listeners {
        match address_bound(listener) {
            Some((ip, port)) => by_address.push((ip, port, listener)),
            None => {
                out.insert(name.clone(), listener.clone());
            }
        }
    }
    for (ip, port, listener) in by_address {
        let name = format!("0.0.0.0_{port}");
        let joins = out.contains_key(&name);
        let merged = out.entry(name.clone()).or_insert_with(|| {
            let mut base = listener.clone();
            if let Some(fields) = base.as_object_mut() {
                fields.insert("name".to_string(), json!(name));
                fields.insert(
                    "address".to_string(),
                    json!({"socket_address": {"address": "0.0.0.0", "port_value": port}}),
                );
                fields.insert("filter_chains".to_string(), json!([]));
                match &catch_all {
                    Some(chain) => fields.insert("default_filter_chain".to_string(), chain.clone()),
                    None => fields.remove("default_filter_chain"),
                };
            }
            base
        });
        let prefix =
            json!([{"address_prefix": ip, "prefix_len": if ip.contains(':') { 128 } else { 32 }}]);
        let chains: Vec<Value> = listener["filter_chains"]
            .as_array()
            .into_iter()
            .flatten()
            .cloned()
            .chain(default_as_chains(listener))
            .map(|chain| {
                let mut chain = chain.clone();
                if let Some(fields) = chain.as_object_mut() {
                    let m = fields
                        .entry("filter_chain_match")
                        .or_insert_with(|| json!({}));
                    if let Some(m) = m.as_object_mut() {
                        m.entry("prefix_ranges").or_insert_with(|| prefix.clone());
                    }
                }
                chain
            })
            .collect();
        if let Some(Value::Array(existing)) = merged.get_mut("filter_chains") {
            existing.extend(chains);
        }
        if joins {
            keep_own_listener_fields(merged, listener, &ip);
        }
    }
    for listener in out.values_mut() {
        default_chain(listener);
    }
    out
}

/// An address listener's default chain, as the chains that take its connections once folded into
/// the port's listener: one matching nothing more than the address (added to by the fold), and one
/// per transport protocol that the listener's chains narrow further.
fn default_as_chains(listener: &Value) -> Vec<Value> {
    let Some(default) = listener
        .get("default_filter_chain")
        .filter(|d| !d.is_null())
    else {
        return Vec::new();
    };
    let matches: Vec<&Map<String, Value>> = listener["filter_chains"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["filter_chain_match"].as_object())
        .collect();
    let mut transports: Vec<&Value> = matches
        .iter()
        .filter(|m| m.len() > 1)
        .filter_map(|m| m.get("transport_protocol"))
        .collect();
    transports.dedup();
    let alone = |t: &Value| {
        matches
            .iter()
            .any(|m| m.len() == 1 && m.get("transport_protocol") == Some(t))
    };
    let with_match = |m: Value| {
        let mut chain = default.clone();
        if let Some(fields) = chain.as_object_mut() {
            fields.insert("filter_chain_match".to_string(), m);
        }
        chain
    };
    std::iter::once(with_match(json!({})))
        .chain(
            transports
                .into_iter()
                .filter(|t| !alone(t))
                .map(|t| with_match(json!({"transport_protocol": t}))),
        )
        .collect()
}

/// What a listener holds beyond its name, address and chains: its listener filters, buffer limits,
/// socket options…, which apply to every connection it takes.
fn listener_fields(listener: &Value) -> Map<String, Value> {
    let mut fields = listener.as_object().cloned().unwrap_or_default();
    for chains in ["name", "address", "filter_chains", "default_filter_chain"] {
        fields.remove(chains);
    }
    fields
}

/// An address listener folded into a port's listener whose own listener fields differ from
/// those the port's listener has: each such field is kept as `<field>@<address>` (null where it
/// has none), so that it is compared too rather than lost in the fold.
fn keep_own_listener_fields(merged: &mut Value, listener: &Value, ip: &str) {
    let (theirs, ours) = (listener_fields(merged), listener_fields(listener));
    let keys: std::collections::BTreeSet<&String> = theirs.keys().chain(ours.keys()).collect();
    let differing: Vec<(String, Value)> = keys
        .into_iter()
        .filter(|k| !k.contains('@') && theirs.get(*k) != ours.get(*k))
        .map(|k| {
            (
                format!("{k}@{ip}"),
                ours.get(k).cloned().unwrap_or(Value::Null),
            )
        })
        .collect();
    if let Some(fields) = merged.as_object_mut() {
        fields.extend(differing);
    }
}

/// A chain in `filter_chains` that matches everything becomes the default chain.
fn default_chain(listener: &mut Value) {
    let Some(fields) = listener.as_object_mut() else {
        return;
    };
    if fields.contains_key("default_filter_chain") {
        return;
    }
    let Some(Value::Array(chains)) = fields.get_mut("filter_chains") else {
        return;
    };
    if let Some(at) = chains.iter().position(is_match_all) {
        let chain = chains.remove(at);
        fields.insert("default_filter_chain".to_string(), chain);
    }
}

fn is_match_all(chain: &Value) -> bool {
    match chain.get("filter_chain_match").map(encodings) {
        None => true,
        Some(m) => m.as_object().is_none_or(|m| m.is_empty()),
    }
}

/// An outbound listener not bound to a port, on an address other than 0.0.0.0: (address, port).
fn address_bound(listener: &Value) -> Option<(String, u64)> {
    let socket = listener.pointer("/address/socket_address")?;
    let ip = socket["address"].as_str()?;
    let port = socket["port_value"]
        .as_u64()
        .or_else(|| socket["port_value"].as_str()?.parse().ok())?;
    let outbound = listener["traffic_direction"] == "OUTBOUND";
    let unbound = listener["bind_to_port"] == json!(false);
    (outbound && unbound && ip != "0.0.0.0" && ip != "::").then(|| (ip.to_string(), port))
}

/// Rewrites equivalent encodings inside a resource.
pub fn encodings(v: &Value) -> Value {
    match v {
        Value::Object(map) => {
            let mut out = Map::new();
            for (k, v) in map {
                match k.as_str() {
                    "match_subject_alt_names" => {
                        let typed = v.as_array().into_iter().flatten().map(typed_san).collect();
                        let entry = out
                            .entry("match_typed_subject_alt_names".to_string())
                            .or_insert_with(|| json!([]));
                        if let Value::Array(items) = entry {
                            items.extend::<Vec<Value>>(typed);
                        }
                    }
                    "filter_chain_match" => {
                        let mut m = encodings(v);
                        if let Some(fields) = m.as_object_mut() {
                            let tls = fields.get("transport_protocol") == Some(&json!("tls"));
                            if tls && fields.contains_key("server_names") {
                                fields.remove("transport_protocol");
                            }
                        }
                        if m.as_object().is_some_and(|m| !m.is_empty()) {
                            out.insert(k.clone(), m);
                        }
                    }
                    "prefix_ranges" if matches_everything(v) => {}
                    old if map.contains_key("name")
                        && HEADER_MATCHES.iter().any(|(o, _)| *o == old) =>
                    {
                        let new = HEADER_MATCHES
                            .iter()
                            .find(|(o, _)| *o == old)
                            .map(|(_, n)| *n);
                        out.insert("string_match".to_string(), json!({ new.unwrap_or(old): v }));
                    }
                    _ => {
                        let encoded = encodings(v);
                        // A list whose every item read as none is no list.
                        let emptied = v.as_array().is_some_and(|a| !a.is_empty())
                            && encoded.as_array().is_some_and(Vec::is_empty);
                        if !emptied {
                            out.insert(k.clone(), encoded);
                        }
                    }
                }
            }
            Value::Object(out)
        }
        Value::Array(items) => Value::Array(
            items
                .iter()
                .filter(|i| !is_empty_locality(i))
                .map(encodings)
                .collect(),
        ),
        other => other.clone(),
    }
}

fn is_empty_locality(item: &Value) -> bool {
    item.get("locality").is_some() && item.get("lb_endpoints").is_none()
}

fn typed_san(matcher: &Value) -> Value {
    let text = matcher
        .as_object()
        .and_then(|m| m.values().find_map(Value::as_str))
        .unwrap_or_default();
    let san_type = if text.contains("://") { "URI" } else { "DNS" };
    json!({"san_type": san_type, "matcher": matcher})
}

fn matches_everything(ranges: &Value) -> bool {
    ranges.as_array().is_some_and(|r| {
        r.iter().all(|range| {
            let len = range
                .get("prefix_len")
                .map(|l| l.to_string().trim_matches('"').to_string());
            let all = matches!(len.as_deref(), None | Some("0"));
            all && matches!(range["address_prefix"].as_str(), Some("0.0.0.0" | "::"))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listener_per_address_reads_as_chains_of_the_ports_listener() {
        let vip = json!({
            "name": "10.96.0.1_443", "traffic_direction": "OUTBOUND", "bind_to_port": false,
            "address": {"socket_address": {"address": "10.96.0.1", "port_value": 443}},
            "filter_chains": [{"filters": [{"name": "tcp"}]}],
        });
        let wildcard = json!({
            "name": "0.0.0.0_443", "traffic_direction": "OUTBOUND", "bind_to_port": false,
            "address": {"socket_address": {"address": "0.0.0.0", "port_value": 443}},
            "filter_chains": [{"filter_chain_match": {"server_names": ["a.example"]}}],
        });
        let both = BTreeMap::from([
            ("10.96.0.1_443".to_string(), vip),
            ("0.0.0.0_443".to_string(), wildcard),
        ]);
        let merged = listeners(&both);
        assert_eq!(merged.len(), 1);
        let chains = merged["0.0.0.0_443"]["filter_chains"].as_array().unwrap();
        assert_eq!(chains.len(), 2);
        assert_eq!(
            chains[1]["filter_chain_match"]["prefix_ranges"][0]["address_prefix"],
            "10.96.0.1"
        );
    }

    #[test]
    fn deprecated_sans_and_match_all_ranges_read_as_their_plain_forms() {
        let old = json!({"match_subject_alt_names": [{"exact": "spiffe://td/ns/a/sa/b"}],
            "filter_chain_match": {"prefix_ranges": [{"address_prefix": "0.0.0.0", "prefix_len": 0}]}});
        let new = json!({"match_typed_subject_alt_names": [{"san_type": "URI", "matcher": {"exact": "spiffe://td/ns/a/sa/b"}}]});
        assert_eq!(encodings(&old), encodings(&new));
    }

    #[test]
    fn an_address_listeners_default_chain_takes_what_its_chains_narrowed_to() {
        let vip = json!({
            "name": "10.96.0.40_15021", "traffic_direction": "OUTBOUND", "bind_to_port": false,
            "address": {"socket_address": {"address": "10.96.0.40", "port_value": 15021}},
            "filter_chains": [{"filter_chain_match": {
                "transport_protocol": "raw_buffer", "application_protocols": ["http/1.1"]},
                "filters": [{"name": "hcm"}]}],
            "default_filter_chain": {"filters": [{"name": "tcp"}]},
        });
        let merged = listeners(&BTreeMap::from([("10.96.0.40_15021".to_string(), vip)]));
        let chains = merged["0.0.0.0_15021"]["filter_chains"].as_array().unwrap();
        let read: Vec<(Value, &str)> = chains
            .iter()
            .map(|c| {
                let mut m = c["filter_chain_match"].clone();
                m.as_object_mut().unwrap().remove("prefix_ranges");
                (m, c["filters"][0]["name"].as_str().unwrap())
            })
            .collect();
        assert_eq!(
            read,
            [
                (
                    json!({"transport_protocol": "raw_buffer", "application_protocols": ["http/1.1"]}),
                    "hcm"
                ),
                (json!({}), "tcp"),
                (json!({"transport_protocol": "raw_buffer"}), "tcp"),
            ]
        );
    }

    #[test]
    fn a_list_of_empty_localities_is_no_list() {
        let istiod = json!({"cluster_name": "a", "endpoints": [{"locality": {"zone": "z"}}]});
        assert_eq!(encodings(&istiod), json!({"cluster_name": "a"}));
    }
}
