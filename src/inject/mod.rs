//! Sidecar injection: Istio's contract for its proxyv2 image, so an injected pod is what istiod's
//! injector would make of it — the `istio-init` container running `istio-iptables`, the
//! `istio-proxy` container (`proxy sidecar`, its environment, token and root-certificate volumes),
//! the `sidecar.istio.io/status` annotation that makes re-injection idempotent. The webhook
//! (`webhook`) and `meshpilot inject` share it.

mod annotations;
pub mod offline;
mod pod;
mod policy;
mod prometheus;
mod sidecar;

use std::sync::Arc;

use clap::Args;
use thiserror::Error;

use crate::istio::{MeshConfig, Revision};
use crate::model::ProxyConfigs;
use crate::text::Quoted;

pub use crate::registry::workload::Workload;
pub use pod::{inject, Outcome};
pub use policy::injection_required;
pub use sidecar::gateway_pod_spec;

/// Istio's proxy image of the release meshpilot is compatible with.
pub const DEFAULT_PROXY_IMAGE: &str = "docker.io/istio/proxyv2:1.27.0";

/// Injection settings that come from the installation (flags of `meshpilot discovery` and
/// `meshpilot inject`).
#[derive(Debug, Clone, Args)]
pub struct InjectArgs {
    /// Image of the injected istio-proxy and istio-init containers (Istio's proxyv2).
    #[arg(long, env = "MESHPILOT_PROXY_IMAGE", default_value = DEFAULT_PROXY_IMAGE)]
    pub proxy_image: String,

    /// Network of this cluster's workloads: ISTIO_META_NETWORK and the pod label
    /// topology.istio.io/network of injected pods (empty: none).
    #[arg(long, env = "MESHPILOT_NETWORK", default_value = "")]
    pub network: String,

    /// Mesh id of injected proxies, ISTIO_META_MESH_ID (empty: the trust domain).
    #[arg(long, env = "MESHPILOT_MESH_ID", default_value = "")]
    pub mesh_id: String,

    /// The control-plane revision of this installation (Istio's `istio.io/rev`): the objects it
    /// is named by (`istiod-<revision>`), the config and webhooks it owns, where its injected
    /// proxies connect.
    #[arg(long, env = "MESHPILOT_REVISION", default_value = "default")]
    pub revision: Revision,
}

impl InjectArgs {
    /// The settings these flags give an installation of `cluster_id` with its system namespace,
    /// DNS suffix and mesh config.
    pub fn config(
        &self,
        cluster_id: &str,
        system_namespace: &str,
        domain_suffix: &str,
        mesh: Arc<MeshConfig>,
    ) -> InjectConfig {
        InjectConfig {
            proxy_image: self.proxy_image.clone(),
            cluster_id: cluster_id.to_string(),
            network: self.network.clone(),
            mesh_id: self.mesh_id.clone(),
            revision: self.revision.clone(),
            system_namespace: system_namespace.to_string(),
            domain_suffix: domain_suffix.to_string(),
            mesh,
            proxy_configs: ProxyConfigs::default(),
        }
    }
}

/// Everything injection needs besides the pod.
#[derive(Clone, Debug)]
pub struct InjectConfig {
    pub proxy_image: String,
    pub cluster_id: String,
    pub network: String,
    pub mesh_id: String,
    pub revision: Revision,
    pub system_namespace: String,
    pub domain_suffix: String,
    /// The mesh config in force: trust domain and the proxies' default config.
    pub mesh: Arc<MeshConfig>,
    /// The ProxyConfig objects in force (none offline, as `istioctl kube-inject`).
    pub proxy_configs: ProxyConfigs,
}

impl InjectConfig {
    /// The secure xDS and CA address of this control plane (its revision's Service), as proxies
    /// reach it.
    pub fn ca_address(&self) -> String {
        format!(
            "{}:15012",
            self.revision.service_host(&self.system_namespace)
        )
    }
}

/// Istio's mesh config defaults, for an installation without ConfigMap `istio`.
pub fn default_mesh(trust_domain: &str, system_namespace: &str) -> MeshConfig {
    MeshConfig {
        trust_domain: trust_domain.to_string(),
        root_namespace: system_namespace.to_string(),
        ..MeshConfig::default()
    }
}

/// Per request, from the webhook URL (`/inject/cluster/<id>/net/<network>`): the cluster and
/// network of the cluster that sent the pod, which for a remote cluster are not ours.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Overrides {
    pub cluster_id: Option<String>,
    pub network: Option<String>,
}

impl Overrides {
    /// Parses the path after `/inject`: key/value pairs (`cluster`, `net`), `--slash--` standing
    /// for `/` in values, as istiod reads them. Unknown keys are ignored.
    pub fn from_path(path: &str) -> Self {
        let rest = path.trim_start_matches('/').trim_end_matches('/');
        let parts: Vec<&str> = rest.split('/').filter(|p| !p.is_empty()).collect();
        let mut out = Self::default();
        for pair in parts.chunks_exact(2) {
            let value = pair[1].replace("--slash--", "/");
            match pair[0] {
                "cluster" => out.cluster_id = Some(value),
                "net" => out.network = Some(value),
                _ => {}
            }
        }
        out
    }
}

/// Why a pod cannot be injected; names the annotation (or object) and the value.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum InjectError {
    #[error("annotation {name}={}: {problem}", Quoted(.value))]
    Annotation {
        name: String,
        value: String,
        problem: String,
    },
    #[error("{0}")]
    Object(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_parameters_name_cluster_and_network() {
        assert_eq!(Overrides::from_path(""), Overrides::default());
        assert_eq!(
            Overrides::from_path("/cluster/west/net/net--slash--2/"),
            Overrides {
                cluster_id: Some("west".into()),
                network: Some("net/2".into()),
            }
        );
        assert_eq!(
            Overrides::from_path("/cluster/west/odd"),
            Overrides {
                cluster_id: Some("west".into()),
                network: None,
            }
        );
    }

    #[test]
    fn an_annotation_error_quotes_a_bounded_excerpt_of_the_value() {
        let error = InjectError::Annotation {
            name: "sidecar.istio.io/interceptionMode".into(),
            value: "x".repeat(10_000),
            problem: "must be REDIRECT, TPROXY or NONE".into(),
        };
        let message = error.to_string();
        assert!(message.len() < 500, "{} bytes", message.len());
        assert!(
            message.ends_with("must be REDIRECT, TPROXY or NONE"),
            "{message}"
        );
    }
}
