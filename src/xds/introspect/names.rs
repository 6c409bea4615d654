//! `/debug/ndsz?proxyID=<id>`: the name table a connected proxy is sent, as istiod prints it
//! (protobuf JSON of `NameTable`: fields in camelCase, empty ones left out).

use serde_json::{json, Map, Value};

use super::config_dump::find_proxy;
use super::{DebugError, Viewer};
use crate::xds::generate::Generation;
use crate::xds::server::XdsServer;

pub fn ndsz(xds: &XdsServer, proxy_id: &str, viewer: &Viewer) -> Result<Value, DebugError> {
    let conn = find_proxy(xds, proxy_id, viewer)?;
    let snapshot = xds.mesh().snapshot();
    let table = Generation::new(&snapshot, xds.cache(), &conn.proxy).name_table();
    let entries: Map<String, Value> = table
        .table
        .into_iter()
        .map(|(host, info)| {
            let mut fields = Map::new();
            fields.insert("ips".into(), json!(info.ips));
            fields.insert("registry".into(), json!(info.registry));
            for (key, value) in [("shortname", info.shortname), ("namespace", info.namespace)] {
                if !value.is_empty() {
                    fields.insert(key.into(), json!(value));
                }
            }
            (host, Value::Object(fields))
        })
        .collect();
    Ok(json!({ "table": entries }))
}
