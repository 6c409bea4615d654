//! The pod annotations injection honours (Istio's names and defaults), validated: a bad value is an
//! error naming the annotation, as istiod refuses such a pod.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ResourceRequirements;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde_json::{Map, Value};

use super::{InjectConfig, InjectError};
use crate::istio::mesh::{self, port_field};
use crate::istio::ProxyConfig;
use crate::model::AppliedProxyConfigs;
use crate::text::{clip, Quoted};

pub const INJECT: &str = "sidecar.istio.io/inject";
pub const STATUS: &str = "sidecar.istio.io/status";
pub const PROXY_CONFIG: &str = "proxy.istio.io/config";
pub const PROXY_OVERRIDES: &str = "proxy.istio.io/overrides";
const INTERCEPTION_MODE: &str = "sidecar.istio.io/interceptionMode";
const PROXY_IMAGE: &str = "sidecar.istio.io/proxyImage";
const PROXY_IMAGE_TYPE: &str = "sidecar.istio.io/proxyImageType";
const LOG_LEVEL: &str = "sidecar.istio.io/logLevel";
const COMPONENT_LOG_LEVEL: &str = "sidecar.istio.io/componentLogLevel";
const AGENT_LOG_LEVEL: &str = "sidecar.istio.io/agentLogLevel";
const STATUS_PORT: &str = "status.sidecar.istio.io/port";
const READINESS_DELAY: &str = "readiness.status.sidecar.istio.io/initialDelaySeconds";
const READINESS_PERIOD: &str = "readiness.status.sidecar.istio.io/periodSeconds";
const READINESS_FAILURES: &str = "readiness.status.sidecar.istio.io/failureThreshold";
const INCLUDE_OUTBOUND_IP_RANGES: &str = "traffic.sidecar.istio.io/includeOutboundIPRanges";
const EXCLUDE_OUTBOUND_IP_RANGES: &str = "traffic.sidecar.istio.io/excludeOutboundIPRanges";
const INCLUDE_INBOUND_PORTS: &str = "traffic.sidecar.istio.io/includeInboundPorts";
const EXCLUDE_INBOUND_PORTS: &str = "traffic.sidecar.istio.io/excludeInboundPorts";
const INCLUDE_OUTBOUND_PORTS: &str = "traffic.sidecar.istio.io/includeOutboundPorts";
const EXCLUDE_OUTBOUND_PORTS: &str = "traffic.sidecar.istio.io/excludeOutboundPorts";
const KUBEVIRT_INTERFACES: &str = "traffic.sidecar.istio.io/kubevirtInterfaces";
const EXCLUDE_INTERFACES: &str = "traffic.sidecar.istio.io/excludeInterfaces";
const PROXY_CPU: &str = "sidecar.istio.io/proxyCPU";
const PROXY_MEMORY: &str = "sidecar.istio.io/proxyMemory";
const PROXY_CPU_LIMIT: &str = "sidecar.istio.io/proxyCPULimit";
const PROXY_MEMORY_LIMIT: &str = "sidecar.istio.io/proxyMemoryLimit";

/// What the annotations and the proxy config say about one pod's sidecar.
#[derive(Clone, Debug)]
pub struct Settings {
    pub interception_mode: String,
    pub include_outbound_ip_ranges: String,
    pub exclude_outbound_ip_ranges: String,
    pub include_inbound_ports: String,
    /// Ports `-d` excludes besides Envoy's own (15090, 15021): the user's and the status port.
    pub exclude_inbound_ports: String,
    pub include_outbound_ports: Option<String>,
    pub exclude_outbound_ports: Option<String>,
    pub kubevirt_interfaces: Option<String>,
    pub exclude_interfaces: Option<String>,
    /// 0: no readiness probe.
    pub status_port: u16,
    /// Where the agent serves health and merged metrics: the proxy config's `statusPort`.
    pub agent_status_port: u16,
    pub readiness_delay: i32,
    pub readiness_period: i32,
    pub readiness_failures: i32,
    pub proxy_image: String,
    pub log_level: String,
    pub component_log_level: String,
    pub agent_log_level: String,
    pub resources: ResourceRequirements,
    /// The mesh's default proxy config with `proxy.istio.io/config` merged over it.
    pub proxy_config: Map<String, Value>,
    pub hold_application: bool,
}

impl Settings {
    /// The settings of a pod of `namespace` with these annotations and labels.
    pub fn read(
        annotations: &BTreeMap<String, String>,
        config: &InjectConfig,
        namespace: &str,
        labels: &BTreeMap<String, String>,
    ) -> Result<Self, InjectError> {
        let get = |name: &str| lookup(annotations, name);
        let proxy_configs = config.proxy_configs.applied(namespace, labels);
        let proxy_config = proxy_config(get(PROXY_CONFIG), config, &proxy_configs)?;
        let image_type = get(PROXY_IMAGE_TYPE).map(str::to_string).or_else(|| {
            let image = proxy_config.get("image")?;
            image.get("imageType")?.as_str().map(str::to_string)
        });
        let mode_default = proxy_config
            .get("interceptionMode")
            .and_then(Value::as_str)
            .unwrap_or("REDIRECT");
        let interception_mode = get(INTERCEPTION_MODE).unwrap_or(mode_default).to_string();
        if !["REDIRECT", "TPROXY", "NONE"].contains(&interception_mode.as_str()) {
            return Err(invalid(
                INTERCEPTION_MODE,
                &interception_mode,
                "must be REDIRECT, TPROXY or NONE",
            ));
        }
        let agent_status_port = agent_status_port(&proxy_config, get(PROXY_CONFIG))?;
        // Istio's template defaults it to a Helm value meshpilot lacks: where the agent listens.
        let status_port = match get(STATUS_PORT) {
            Some(v) => v
                .trim()
                .parse::<u16>()
                .map_err(|_| invalid(STATUS_PORT, v, "must be a port number (0 disables)"))?,
            None => agent_status_port,
        };
        let seconds = |name: &str, default: i32| match get(name) {
            Some(v) => v
                .trim()
                .parse::<i32>()
                .ok()
                .filter(|n| *n >= 0)
                .ok_or_else(|| invalid(name, v, "must be a non-negative number of seconds")),
            None => Ok(default),
        };
        let ports = |name: &str, wildcard: bool| -> Result<Option<String>, InjectError> {
            get(name).map(|v| port_list(name, v, wildcard)).transpose()
        };
        let ranges = |name: &str| -> Result<Option<String>, InjectError> {
            get(name).map(|v| cidr_list(name, v)).transpose()
        };
        let user_excluded = ports(EXCLUDE_INBOUND_PORTS, false)?.unwrap_or_default();
        let hold_application = proxy_config
            .get("holdApplicationUntilProxyStarts")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        Ok(Self {
            interception_mode,
            include_outbound_ip_ranges: ranges(INCLUDE_OUTBOUND_IP_RANGES)?
                .unwrap_or_else(|| "*".into()),
            exclude_outbound_ip_ranges: ranges(EXCLUDE_OUTBOUND_IP_RANGES)?.unwrap_or_default(),
            include_inbound_ports: ports(INCLUDE_INBOUND_PORTS, true)?
                .unwrap_or_else(|| "*".into()),
            exclude_inbound_ports: with_port(&user_excluded, status_port),
            include_outbound_ports: ports(INCLUDE_OUTBOUND_PORTS, false)?,
            exclude_outbound_ports: ports(EXCLUDE_OUTBOUND_PORTS, false)?,
            kubevirt_interfaces: get(KUBEVIRT_INTERFACES).map(str::to_string),
            exclude_interfaces: get(EXCLUDE_INTERFACES).map(str::to_string),
            status_port,
            agent_status_port,
            readiness_delay: seconds(READINESS_DELAY, 0)?,
            readiness_period: seconds(READINESS_PERIOD, 15)?,
            readiness_failures: seconds(READINESS_FAILURES, 4)?,
            proxy_image: match get(PROXY_IMAGE).filter(|i| i.contains('/')) {
                Some(image) => image.to_string(),
                None => with_image_type(&config.proxy_image, image_type.as_deref()),
            },
            log_level: get(LOG_LEVEL).unwrap_or("warning").to_string(),
            component_log_level: get(COMPONENT_LOG_LEVEL).unwrap_or("misc:error").to_string(),
            agent_log_level: get(AGENT_LOG_LEVEL).unwrap_or("default:info").to_string(),
            resources: resources(annotations)?,
            proxy_config,
            hold_application,
        })
    }

    /// `proxyMetadata` of the proxy config: extra environment of both containers, sorted by name.
    pub fn proxy_metadata(&self) -> BTreeMap<String, String> {
        self.proxy_config
            .get("proxyMetadata")
            .and_then(Value::as_object)
            .into_iter()
            .flatten()
            .map(|(k, v)| {
                let v = v
                    .as_str()
                    .map(str::to_string)
                    .unwrap_or_else(|| v.to_string());
                (k.clone(), v)
            })
            .collect()
    }
}

fn lookup<'a>(annotations: &'a BTreeMap<String, String>, name: &str) -> Option<&'a str> {
    annotations.get(name).map(String::as_str)
}

fn invalid(name: &str, value: &str, problem: &str) -> InjectError {
    InjectError::Annotation {
        name: name.to_string(),
        value: value.to_string(),
        problem: problem.to_string(),
    }
}

/// The proxy image of a variant (`debug`, `distroless`, …) as Istio tags them: the tag's variant
/// suffix replaced (`default` and none mean the plain tag).
fn with_image_type(image: &str, image_type: Option<&str>) -> String {
    let Some(image_type) = image_type else {
        return image.to_string();
    };
    let (name, tag) = match image.rsplit_once(':').filter(|(_, t)| !t.contains('/')) {
        Some((name, tag)) => (name, tag),
        None => (image, ""),
    };
    let tag = tag
        .strip_suffix("-debug")
        .or_else(|| tag.strip_suffix("-distroless"))
        .unwrap_or(tag);
    match (tag, image_type) {
        ("", _) => image.to_string(),
        (tag, "default" | "") => format!("{name}:{tag}"),
        (tag, variant) => format!("{name}:{tag}-{variant}"),
    }
}

/// A ProxyConfig object's fields in the mesh config's proxy config form.
fn overlay_of(proxy_config: &ProxyConfig) -> Map<String, Value> {
    let mut out = Map::new();
    if let Some(concurrency) = proxy_config.concurrency {
        out.insert("concurrency".into(), Value::from(concurrency));
    }
    if !proxy_config.environment_variables.is_empty() {
        let env = proxy_config
            .environment_variables
            .iter()
            .map(|(k, v)| (k.clone(), Value::String(v.clone())))
            .collect();
        out.insert("proxyMetadata".into(), Value::Object(env));
    }
    if let Some(image) = &proxy_config.image {
        out.insert(
            "image".into(),
            serde_json::json!({"imageType": image.image_type}),
        );
    }
    out
}

/// The mesh's `defaultConfig` (discovery address defaulted to this control plane), then the root
/// namespace's and the pod namespace's ProxyConfig, the pod's `proxy.istio.io/config`, and the
/// workload's ProxyConfig, each merged over the last (objects field by field, as istiod's
/// `mergeWithPrecedence`: environment variables key by key).
fn proxy_config(
    annotation: Option<&str>,
    config: &InjectConfig,
    proxy_configs: &AppliedProxyConfigs<'_>,
) -> Result<Map<String, Value>, InjectError> {
    let mut merged = match serde_json::to_value(&config.mesh.default_config) {
        Ok(Value::Object(map)) => map,
        _ => Map::new(),
    };
    let address = merged.get("discoveryAddress").and_then(Value::as_str);
    if address.is_none_or(str::is_empty) {
        merged.insert(
            "discoveryAddress".into(),
            Value::String(config.ca_address()),
        );
    }
    for level in &proxy_configs.namespaces {
        merge(&mut merged, overlay_of(level));
    }
    if let Some(text) = annotation {
        crate::yaml::check_aliases(text)
            .map_err(|e| invalid(PROXY_CONFIG, text, &e.to_string()))?;
        let overlay: Value = serde_yaml_ng::from_str(text).map_err(|e| {
            invalid(
                PROXY_CONFIG,
                text,
                &format!("not YAML: {}", clip(&e.to_string())),
            )
        })?;
        let Value::Object(overlay) = overlay else {
            return Err(invalid(PROXY_CONFIG, text, "must be a ProxyConfig object"));
        };
        merge(&mut merged, overlay);
    }
    if let Some(workload) = proxy_configs.workload {
        merge(&mut merged, overlay_of(workload));
    }
    Ok(merged)
}

/// `statusPort` of the merged proxy config (the mesh's was checked on acceptance, so a bad one
/// is the pod's annotation's).
fn agent_status_port(
    proxy_config: &Map<String, Value>,
    annotation: Option<&str>,
) -> Result<u16, InjectError> {
    match proxy_config.get("statusPort") {
        None => Ok(mesh::STATUS_PORT),
        Some(_) => port_field(proxy_config, "statusPort").ok_or_else(|| {
            invalid(
                PROXY_CONFIG,
                annotation.unwrap_or_default(),
                "statusPort must be a port number (1-65535)",
            )
        }),
    }
}

fn merge(into: &mut Map<String, Value>, from: Map<String, Value>) {
    for (key, value) in from {
        match (into.get_mut(&key), value) {
            (Some(Value::Object(inner)), Value::Object(overlay)) => merge(inner, overlay),
            (_, value) => {
                into.insert(key, value);
            }
        }
    }
}

/// A comma-separated port list (or `*` where allowed), normalised without spaces.
fn port_list(name: &str, value: &str, wildcard: bool) -> Result<String, InjectError> {
    let value = value.trim();
    if wildcard && value == "*" {
        return Ok(value.to_string());
    }
    let ports: Vec<&str> = value
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect();
    for port in &ports {
        if port.parse::<u16>().map_or(true, |p| p == 0) {
            return Err(invalid(
                name,
                value,
                &format!("{} is not a port number (1-65535)", Quoted(port)),
            ));
        }
    }
    Ok(ports.join(","))
}

/// A comma-separated CIDR list, or `*`.
fn cidr_list(name: &str, value: &str) -> Result<String, InjectError> {
    let value = value.trim();
    if value == "*" {
        return Ok(value.to_string());
    }
    let ranges: Vec<&str> = value
        .split(',')
        .map(str::trim)
        .filter(|r| !r.is_empty())
        .collect();
    for range in &ranges {
        if range.parse::<ipnet::IpNet>().is_err() {
            return Err(invalid(
                name,
                value,
                &format!("{} is not a CIDR", Quoted(range)),
            ));
        }
    }
    Ok(ranges.join(","))
}

/// Adds the status port to the excluded inbound ports unless it is there (or 0).
fn with_port(excluded: &str, port: u16) -> String {
    let port = port.to_string();
    let mut ports: Vec<&str> = excluded.split(',').filter(|p| !p.is_empty()).collect();
    if port != "0" && !ports.contains(&port.as_str()) {
        ports.push(&port);
    }
    ports.join(",")
}

/// The proxy's requests and limits: the annotations when any is given, else Istio's defaults.
fn resources(annotations: &BTreeMap<String, String>) -> Result<ResourceRequirements, InjectError> {
    let quantity = |name: &str| -> Result<Option<Quantity>, InjectError> {
        lookup(annotations, name)
            .map(|v| {
                is_quantity(v)
                    .then(|| Quantity(v.trim().to_string()))
                    .ok_or_else(|| invalid(name, v, "not a Kubernetes quantity"))
            })
            .transpose()
    };
    let pair =
        |cpu: &str, memory: &str| -> Result<Option<BTreeMap<String, Quantity>>, InjectError> {
            let map: BTreeMap<String, Quantity> =
                [("cpu", quantity(cpu)?), ("memory", quantity(memory)?)]
                    .into_iter()
                    .filter_map(|(k, v)| Some((k.to_string(), v?)))
                    .collect();
            Ok((!map.is_empty()).then_some(map))
        };
    let requests = pair(PROXY_CPU, PROXY_MEMORY)?;
    let limits = pair(PROXY_CPU_LIMIT, PROXY_MEMORY_LIMIT)?;
    if requests.is_some() || limits.is_some() {
        return Ok(ResourceRequirements {
            requests,
            limits,
            ..Default::default()
        });
    }
    let map = |cpu: &str, memory: &str| {
        Some(BTreeMap::from([
            ("cpu".to_string(), Quantity(cpu.into())),
            ("memory".to_string(), Quantity(memory.into())),
        ]))
    };
    Ok(ResourceRequirements {
        requests: map("100m", "128Mi"),
        limits: map("2000m", "1024Mi"),
        ..Default::default()
    })
}

/// A decimal number with an optional binary, decimal or exponent suffix (`100m`, `1.5Gi`, `1e3`).
fn is_quantity(value: &str) -> bool {
    let value = value.trim();
    let digits = value
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(value.len());
    let (number, suffix) = value.split_at(digits);
    let suffixes = [
        "", "m", "k", "M", "G", "T", "P", "E", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei",
    ];
    let exponent = suffix
        .strip_prefix(['e', 'E'])
        .is_some_and(|e| e.trim_start_matches(['+', '-']).parse::<u32>().is_ok());
    number.parse::<f64>().is_ok() && (suffixes.contains(&suffix) || exponent)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities() {
        for ok in ["100m", "1", "1.5Gi", "512Mi", "1e3", "2000m"] {
            assert!(is_quantity(ok), "{ok}");
        }
        for bad in ["", "lots", "1x", "Mi", "1.2.3"] {
            assert!(!is_quantity(bad), "{bad}");
        }
    }

    #[test]
    fn lists_are_checked_and_normalised() {
        assert_eq!(port_list("p", " 80, 443 ", false).unwrap(), "80,443");
        assert_eq!(port_list("p", "*", true).unwrap(), "*");
        let e = port_list("p", "80,http", false).unwrap_err();
        assert!(e.to_string().contains("\"http\" is not a port"), "{e}");
        assert!(cidr_list("c", "10.0.0.0/8,zz").is_err());
        assert_eq!(with_port("", 15020), "15020");
        assert_eq!(with_port("9000,15020", 15020), "9000,15020");
        assert_eq!(with_port("9000", 0), "9000");
    }
}
