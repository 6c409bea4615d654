//! Istio's metrics merge (mesh `enablePrometheusMerge`; istiod's `applyPrometheusMerge`,
//! pkg/kube/inject/webhook.go): a pod's Prometheus scrape annotations are moved into the agent's
//! `ISTIO_PROMETHEUS_ANNOTATIONS` and replaced by ones naming the agent's status port, where
//! pilot-agent serves Envoy's metrics and the application's merged (`/stats/prometheus`).

use std::collections::BTreeMap;

use serde::Serialize;

use super::InjectError;
use crate::istio::MeshConfig;

/// The pod's own say, over the mesh's.
pub const MERGE_METRICS: &str = "prometheus.istio.io/merge-metrics";
/// What pilot-agent reads to scrape the application (pilot/cmd/pilot-agent/status/server.go).
pub const SCRAPE_ENV: &str = "ISTIO_PROMETHEUS_ANNOTATIONS";
const SCRAPE: &str = "prometheus.io/scrape";
const PATH: &str = "prometheus.io/path";
const PORT: &str = "prometheus.io/port";
/// Where the agent serves the merged metrics.
const MERGED_PATH: &str = "/stats/prometheus";

/// Ports the proxy or its agent listen on, which a scrape of the application must not name
/// (current istiod's `IstioReservedPortReason`; the capture ports are the mesh's).
const RESERVED: &[(u16, &str)] = &[
    (15000, "Envoy admin"),
    (15004, "pilot debug"),
    (15008, "HBONE tunnel"),
    (15020, "pilot-agent status / merged Prometheus"),
    (15021, "Envoy health"),
    (15053, "DNS proxy"),
    (15090, "Envoy Prometheus (already merged)"),
];

/// The application's scrape settings as the agent reads them: every key, in its order.
#[derive(Debug, Default, PartialEq, Eq, Serialize)]
struct Scrape {
    scrape: String,
    path: String,
    port: String,
}

/// What the merge did to a pod's annotations.
#[derive(Debug, PartialEq, Eq)]
pub enum Merge {
    /// Merge is off for the pod, or it is not scraped.
    Off,
    /// The port annotation already names the agent (a re-injected pod): left as it is.
    AlreadyMerged,
    /// Moved to the agent; the variable's value when the pod had scrape settings of its own.
    Moved(Option<String>),
}

/// Applies the merge to a pod's annotations for an agent serving on `status_port`.
pub fn apply(
    annotations: &mut BTreeMap<String, String>,
    mesh: &MeshConfig,
    status_port: u16,
) -> Result<Merge, InjectError> {
    if !scraped(annotations) || !enabled(annotations, mesh)? {
        return Ok(Merge::Off);
    }
    let target = status_port.to_string();
    if find(annotations, PORT) == Some(target.as_str()) {
        return Ok(Merge::AlreadyMerged);
    }
    let given = Scrape {
        scrape: find(annotations, SCRAPE).unwrap_or_default().to_string(),
        path: find(annotations, PATH).unwrap_or_default().to_string(),
        port: find(annotations, PORT).unwrap_or_default().to_string(),
    };
    if !given.port.is_empty() {
        check_port(&given.port, status_port, mesh)?;
    }
    let env =
        (given != Scrape::default()).then(|| serde_json::to_string(&given).unwrap_or_default());
    // Every spelling Prometheus reads as these goes, or it might pick the application's.
    let ours = [sanitized(SCRAPE), sanitized(PATH), sanitized(PORT)];
    annotations.retain(|k, _| !ours.contains(&sanitized(k)));
    annotations.insert(PORT.into(), target);
    annotations.insert(PATH.into(), MERGED_PATH.into());
    annotations.insert(SCRAPE.into(), "true".into());
    Ok(Merge::Moved(env))
}

/// The pod's annotation (refused unless a Go boolean), else the mesh's setting.
fn enabled(annotations: &BTreeMap<String, String>, mesh: &MeshConfig) -> Result<bool, InjectError> {
    match annotations.get(MERGE_METRICS) {
        Some(value) => parse_bool(value).ok_or_else(|| InjectError::Annotation {
            name: MERGE_METRICS.into(),
            value: value.clone(),
            problem: "must be true or false".into(),
        }),
        None => Ok(mesh.enable_prometheus_merge),
    }
}

/// A pod is scraped unless a scrape annotation (any spelling) says false.
fn scraped(annotations: &BTreeMap<String, String>) -> bool {
    let scrape = sanitized(SCRAPE);
    (annotations.iter())
        .filter(|(k, _)| sanitized(k) == scrape)
        .find_map(|(_, v)| parse_bool(v))
        .unwrap_or(true)
}

/// The value of annotation `name` as Prometheus reads it: that spelling, else the first other
/// that sanitises alike (`prometheus.io.port`, `prometheus-io/port`).
fn find<'a>(annotations: &'a BTreeMap<String, String>, name: &str) -> Option<&'a str> {
    let wanted = sanitized(name);
    annotations
        .get(name)
        .or_else(|| {
            (annotations.iter())
                .find(|(k, _)| sanitized(k) == wanted)
                .map(|(_, v)| v)
        })
        .map(String::as_str)
}

/// Prometheus' label name sanitising (util/strutil `SanitizeLabelName`).
fn sanitized(name: &str) -> String {
    name.chars()
        .map(|c| match c.is_ascii_alphanumeric() {
            true => c,
            false => '_',
        })
        .collect()
}

/// Go's `strconv.ParseBool`.
fn parse_bool(value: &str) -> Option<bool> {
    match value {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Some(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Some(false),
        _ => None,
    }
}

/// The application's port, refused where the agent could not scrape it (current istiod; the agent
/// itself refuses to start on its own port).
fn check_port(port: &str, status_port: u16, mesh: &MeshConfig) -> Result<(), InjectError> {
    let refuse = |problem: String| InjectError::Annotation {
        name: PORT.into(),
        value: port.to_string(),
        problem,
    };
    let number = port
        .parse::<i64>()
        .ok()
        .and_then(|p| u16::try_from(p).ok())
        .filter(|p| *p != 0)
        .ok_or_else(|| refuse("not a port number (1-65535)".into()))?;
    if number == status_port {
        return Err(refuse("is the agent's status port".into()));
    }
    let capture = [
        (mesh.proxy_listen_port, "outbound traffic capture"),
        (mesh.proxy_inbound_listen_port, "inbound traffic capture"),
    ];
    match (RESERVED.iter().chain(&capture)).find(|(p, _)| *p == number) {
        Some((_, what)) => Err(refuse(format!("is reserved for Istio ({what})"))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        (pairs.iter())
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn merged() -> BTreeMap<String, String> {
        pod(&[(PATH, MERGED_PATH), (PORT, "15020"), (SCRAPE, "true")])
    }

    #[test]
    fn the_application_s_settings_move_to_the_agent() {
        let mesh = MeshConfig::default();
        let mut annotations = pod(&[("prometheus.io/port", "9090"), ("prometheus-io/path", "/m")]);
        let merge = apply(&mut annotations, &mesh, 15020).unwrap();
        let env = r#"{"scrape":"","path":"/m","port":"9090"}"#;
        assert_eq!(merge, Merge::Moved(Some(env.into())));
        assert_eq!(annotations, merged());
        // Nothing to move: the agent's annotations alone.
        let mut annotations = pod(&[("app", "x")]);
        assert_eq!(
            apply(&mut annotations, &mesh, 15020).unwrap(),
            Merge::Moved(None)
        );
        assert_eq!(annotations.len(), 4);
    }

    #[test]
    fn the_pod_decides_over_the_mesh_and_a_false_scrape_opts_out() {
        let off = MeshConfig {
            enable_prometheus_merge: false,
            ..MeshConfig::default()
        };
        let mut annotations = pod(&[(PORT, "9090")]);
        assert_eq!(apply(&mut annotations, &off, 15020).unwrap(), Merge::Off);
        let mut annotations = pod(&[(PORT, "9090"), (MERGE_METRICS, "T")]);
        assert!(matches!(
            apply(&mut annotations, &off, 15020),
            Ok(Merge::Moved(_))
        ));
        let on = MeshConfig::default();
        let mut annotations = pod(&[(PORT, "9090"), (MERGE_METRICS, "0")]);
        assert_eq!(apply(&mut annotations, &on, 15020).unwrap(), Merge::Off);
        let mut annotations = pod(&[("prometheus.io.scrape", "false")]);
        assert_eq!(apply(&mut annotations, &on, 15020).unwrap(), Merge::Off);
        let mut annotations = pod(&[(MERGE_METRICS, "yes")]);
        let e = apply(&mut annotations, &on, 15020).unwrap_err();
        assert!(e.to_string().contains(MERGE_METRICS), "{e}");
    }

    #[test]
    fn a_merged_pod_is_left_alone_and_unscrapable_ports_refused() {
        let mesh = MeshConfig {
            proxy_listen_port: 16001,
            ..MeshConfig::default()
        };
        let mut annotations = merged();
        assert_eq!(
            apply(&mut annotations, &mesh, 15020).unwrap(),
            Merge::AlreadyMerged
        );
        assert_eq!(annotations, merged());
        // Another status port: the old annotations are the application's now.
        let mut annotations = merged();
        let e = apply(&mut annotations, &mesh, 15030).unwrap_err();
        assert!(e.to_string().contains("reserved for Istio"), "{e}");
        for port in ["http", "0", "70000", "015020", "15090", "16001"] {
            let mut annotations = pod(&[(PORT, port)]);
            let e = apply(&mut annotations, &mesh, 15020).unwrap_err();
            assert!(e.to_string().contains(PORT), "{port}: {e}");
        }
    }
}
