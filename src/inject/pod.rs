//! Injecting a pod (or a pod template): strip what an earlier injection added (named by the
//! `sidecar.istio.io/status` annotation), build the sidecar, merge it in where istiod puts it, and
//! record what was added. Injecting an injected pod therefore gives the same pod.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, EnvVar, PodSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::annotations::{Settings, PROXY_OVERRIDES, STATUS};
use super::policy::injection_required;
use super::prometheus::{self, Merge, SCRAPE_ENV};
use super::sidecar::{build, Placement, INIT_CONTAINER, PROXY_CONTAINER};
use super::{InjectConfig, InjectError, Overrides, Workload};
use crate::istio::revision::REVISION_LABEL;
use crate::registry::workload::canonical_service;

const NETWORK_LABEL: &str = "topology.istio.io/network";

/// What injection did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Injected,
    /// The pod opted out (or runs on the host network, or in a Kubernetes namespace).
    Skipped,
}

/// The `sidecar.istio.io/status` annotation, in istiod's field order.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Status {
    #[serde(default)]
    init_containers: Option<Vec<String>>,
    #[serde(default)]
    containers: Option<Vec<String>>,
    #[serde(default)]
    volumes: Option<Vec<String>>,
    #[serde(default)]
    image_pull_secrets: Option<Vec<String>>,
    #[serde(default)]
    revision: String,
}

/// A user's own `istio-proxy` container, kept in `proxy.istio.io/overrides` so re-injection
/// applies it again.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ProxyOverrides {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    containers: Vec<Container>,
}

/// Injects the sidecar into a pod's metadata and spec, in place.
pub fn inject(
    meta: &mut ObjectMeta,
    spec: &mut PodSpec,
    namespace: &str,
    workload: &Workload,
    config: &InjectConfig,
    overrides: &Overrides,
) -> Result<Outcome, InjectError> {
    if !injection_required(meta, spec, namespace) {
        return Ok(Outcome::Skipped);
    }
    let scrape_env = proxy_env(spec, SCRAPE_ENV);
    let previously = strip(meta, spec)?;
    let user_proxy = spec
        .containers
        .iter()
        .find(|c| c.name == PROXY_CONTAINER)
        .cloned();
    if let (Some(user), false) = (&user_proxy, previously) {
        let kept = ProxyOverrides {
            containers: vec![user.clone()],
        };
        annotations(meta).insert(
            PROXY_OVERRIDES.into(),
            serde_json::to_string(&kept).unwrap_or_default(),
        );
    }
    let labels = meta.labels.clone().unwrap_or_default();
    let pod_annotations = meta.annotations.clone().unwrap_or_default();
    let settings = Settings::read(&pod_annotations, config, namespace, &labels)?;
    let network = labels
        .get(NETWORK_LABEL)
        .cloned()
        .or_else(|| overrides.network.clone())
        .unwrap_or_else(|| config.network.clone());
    let placement = Placement {
        cluster_id: overrides
            .cluster_id
            .clone()
            .unwrap_or_else(|| config.cluster_id.clone()),
        network,
    };
    let merge = prometheus::apply(annotations(meta), &config.mesh, settings.agent_status_port)?;
    let sidecar = build(&settings, config, &placement, spec, workload);
    let mut proxy = sidecar.proxy;
    if let Some(user) = &user_proxy {
        proxy = overlay(&proxy, user)?;
    }
    // istiod appends it after the template; a re-injected pod keeps the one it had, which
    // istiod's injector would drop, leaving the agent without the application's metrics.
    let scrape_env = match merge {
        Merge::Moved(env) => env,
        Merge::AlreadyMerged if previously => scrape_env,
        Merge::AlreadyMerged | Merge::Off => None,
    };
    if let Some(value) = scrape_env {
        proxy.env.get_or_insert_with(Vec::new).push(EnvVar {
            name: SCRAPE_ENV.into(),
            value: Some(value),
            value_from: None,
        });
    }

    spec.containers.retain(|c| c.name != PROXY_CONTAINER);
    match settings.hold_application {
        true => spec.containers.insert(0, proxy),
        false => spec.containers.push(proxy),
    }
    let init_names: Option<Vec<String>> = sidecar.init.as_ref().map(|c| vec![c.name.clone()]);
    if let Some(init) = sidecar.init {
        let inits = spec.init_containers.get_or_insert_with(Vec::new);
        inits.retain(|c| c.name != INIT_CONTAINER);
        // Last, so other init containers still reach the network before capture starts.
        inits.push(init);
    }
    let volume_names: Vec<String> = sidecar.volumes.iter().map(|v| v.name.clone()).collect();
    let volumes = spec.volumes.get_or_insert_with(Vec::new);
    volumes.retain(|v| !volume_names.contains(&v.name));
    volumes.extend(sidecar.volumes);

    let (canonical_name, canonical_revision) = canonical_service(&labels, &workload.name);
    let (canonical_name, canonical_revision) =
        (canonical_name.to_string(), canonical_revision.to_string());
    let pod_labels = meta.labels.get_or_insert_with(BTreeMap::new);
    pod_labels
        .entry("security.istio.io/tlsMode".into())
        .or_insert_with(|| "istio".into());
    pod_labels
        .entry("service.istio.io/canonical-name".into())
        .or_insert(canonical_name);
    pod_labels
        .entry("service.istio.io/canonical-revision".into())
        .or_insert(canonical_revision);
    if !placement.network.is_empty() {
        pod_labels.insert(NETWORK_LABEL.into(), placement.network.clone());
    }

    let first_app = spec
        .containers
        .iter()
        .find(|c| c.name != PROXY_CONTAINER)
        .map(|c| c.name.clone());
    let pod_annotations = annotations(meta);
    if let Some(first) = first_app {
        for key in [
            "kubectl.kubernetes.io/default-logs-container",
            "kubectl.kubernetes.io/default-container",
        ] {
            pod_annotations.entry(key.into()).or_insert(first.clone());
        }
    }
    let status = Status {
        init_containers: init_names,
        containers: Some(vec![PROXY_CONTAINER.into()]),
        volumes: Some(volume_names),
        image_pull_secrets: None,
        revision: config.revision.to_string(),
    };
    // Which control plane injected the pod, as istiod's template records it.
    pod_annotations.insert(REVISION_LABEL.into(), config.revision.to_string());
    pod_annotations.insert(
        STATUS.into(),
        serde_json::to_string(&status).unwrap_or_default(),
    );
    Ok(Outcome::Injected)
}

/// The value of a variable of the pod's istio-proxy container.
fn proxy_env(spec: &PodSpec, name: &str) -> Option<String> {
    let proxy = spec.containers.iter().find(|c| c.name == PROXY_CONTAINER)?;
    let var = proxy.env.iter().flatten().find(|e| e.name == name)?;
    var.value.clone()
}

fn annotations(meta: &mut ObjectMeta) -> &mut BTreeMap<String, String> {
    meta.annotations.get_or_insert_with(BTreeMap::new)
}

/// Removes what an earlier injection added and puts back the user's own proxy container, if one
/// was recorded. Returns whether the pod had been injected.
fn strip(meta: &mut ObjectMeta, spec: &mut PodSpec) -> Result<bool, InjectError> {
    let Some(text) = meta.annotations.as_mut().and_then(|a| a.remove(STATUS)) else {
        return Ok(false);
    };
    // As istiod: an unreadable status is treated as no earlier injection.
    let Ok(status) = serde_json::from_str::<Status>(&text) else {
        return Ok(false);
    };
    let containers = status.containers.unwrap_or_default();
    let inits = status.init_containers.unwrap_or_default();
    let volumes = status.volumes.unwrap_or_default();
    spec.containers.retain(|c| !containers.contains(&c.name));
    if let Some(list) = spec.init_containers.as_mut() {
        list.retain(|c| !inits.contains(&c.name));
    }
    if let Some(list) = spec.volumes.as_mut() {
        list.retain(|v| !volumes.contains(&v.name));
    }
    let recorded = meta
        .annotations
        .as_ref()
        .and_then(|a| a.get(PROXY_OVERRIDES))
        .cloned();
    if let Some(text) = recorded {
        let kept: ProxyOverrides =
            serde_json::from_str(&text).map_err(|e| InjectError::Annotation {
                name: PROXY_OVERRIDES.into(),
                value: text.clone(),
                problem: e.to_string(),
            })?;
        for container in kept.containers {
            if !spec.containers.iter().any(|c| c.name == container.name) {
                spec.containers.push(container);
            }
        }
    }
    Ok(true)
}

/// The user's istio-proxy fields over the template's: objects field by field, `env` by name and
/// `volumeMounts` by path, other lists replaced; image `auto` keeps the injected image.
fn overlay(template: &Container, user: &Container) -> Result<Container, InjectError> {
    let mut base =
        serde_json::to_value(template).map_err(|e| InjectError::Object(e.to_string()))?;
    let mut top = serde_json::to_value(user).map_err(|e| InjectError::Object(e.to_string()))?;
    if top["image"] == "auto" {
        if let Some(map) = top.as_object_mut() {
            map.remove("image");
        }
    }
    merge(&mut base, top, "");
    serde_json::from_value(base)
        .map_err(|e| InjectError::Object(format!("container {PROXY_CONTAINER} of the pod: {e}")))
}

fn merge(base: &mut Value, top: Value, field: &str) {
    let key = match field {
        "env" => Some("name"),
        "volumeMounts" => Some("mountPath"),
        _ => None,
    };
    match (base, top) {
        (Value::Object(base), Value::Object(top)) => {
            for (k, v) in top {
                match base.get_mut(&k) {
                    Some(existing) => merge(existing, v, &k),
                    None => {
                        base.insert(k, v);
                    }
                }
            }
        }
        (Value::Array(base), Value::Array(top)) => match key {
            Some(key) => {
                for item in top {
                    match base.iter_mut().find(|b| b[key] == item[key]) {
                        Some(existing) => *existing = item,
                        None => base.push(item),
                    }
                }
            }
            None => *base = top,
        },
        (base, top) => *base = top,
    }
}
