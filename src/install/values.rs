//! The settings a manifest is rendered with (`--set key=value`), each checked where it is given:
//! an unknown key, a bad value or a setting a profile needs is an error naming it.

use std::collections::BTreeMap;
use std::net::IpAddr;

use thiserror::Error;

use super::Profile;
use crate::inject::DEFAULT_PROXY_IMAGE;
use crate::istio::{MeshConfig, Revision};

/// Every key `--set` knows, with what it means (shown when a key is unknown).
pub const KEYS: &[(&str, &str)] = &[
    ("namespace", "namespace of the control plane [istio-system]"),
    ("image", "meshpilot's image [meshpilot:<version>]"),
    (
        "proxyImage",
        "Istio's proxyv2 image for sidecars and gateways",
    ),
    ("replicas", "control-plane replicas [2]"),
    ("clusterId", "this cluster's id [Kubernetes]"),
    ("network", "this cluster's network (multi-network meshes)"),
    ("meshId", "mesh id of proxies [the trust domain]"),
    ("trustDomain", "SPIFFE trust domain [cluster.local]"),
    (
        "remotePilotAddress",
        "where remote clusters reach the control plane (IP or DNS name)",
    ),
    (
        "exposeControlPlane",
        "primary: a LoadBalancer Service for 15012 and 15017 [false]",
    ),
    (
        "controlPlaneClusters",
        "remote: the cluster ids allowed to manage it [*]",
    ),
    (
        "meshConfig.accessLogFile",
        "where proxies write access logs (Istio's demo profile: /dev/stdout) [none]",
    ),
    ("meshConfig.accessLogEncoding", "TEXT or JSON [TEXT]"),
    (
        "meshConfig.accessLogFormat",
        "a custom access log format [Istio's]",
    ),
];

/// The mesh config fields `--set meshConfig.<field>=…` sets, as Istio's Helm values name them.
const MESH_FIELDS: [&str; 3] = ["accessLogFile", "accessLogEncoding", "accessLogFormat"];

#[derive(Debug, Error, PartialEq, Eq)]
pub enum ValuesError {
    #[error("--set {entry:?}: expected key=value")]
    Syntax { entry: String },
    #[error("--set {key}: unknown key; known keys: {known}")]
    UnknownKey { key: String, known: String },
    #[error("--set {key}={value:?}: {problem}")]
    Invalid {
        key: String,
        value: String,
        problem: String,
    },
    #[error("profile {profile} needs {needed}")]
    Missing {
        profile: &'static str,
        /// Every missing `--set key=<what>`, in one line.
        needed: String,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Values {
    pub namespace: String,
    pub image: String,
    pub proxy_image: String,
    pub replicas: i32,
    pub cluster_id: String,
    pub network: String,
    pub mesh_id: String,
    pub trust_domain: String,
    pub remote_pilot_address: String,
    pub expose_control_plane: bool,
    pub control_plane_clusters: String,
    /// The control-plane revision (`--revision`).
    pub revision: Revision,
    /// Mesh config fields given with `meshConfig.<field>`, checked as the mesh config.
    pub mesh: BTreeMap<String, String>,
}

impl Default for Values {
    fn default() -> Self {
        Self {
            namespace: "istio-system".into(),
            image: format!("meshpilot:{}", env!("CARGO_PKG_VERSION")),
            proxy_image: DEFAULT_PROXY_IMAGE.into(),
            replicas: 2,
            cluster_id: "Kubernetes".into(),
            network: String::new(),
            mesh_id: String::new(),
            trust_domain: "cluster.local".into(),
            remote_pilot_address: String::new(),
            expose_control_plane: false,
            control_plane_clusters: "*".into(),
            revision: Revision::default(),
            mesh: BTreeMap::new(),
        }
    }
}

impl Values {
    /// Applies one `key=value`.
    pub fn set(&mut self, entry: &str) -> Result<(), ValuesError> {
        let (key, value) = entry.split_once('=').ok_or_else(|| ValuesError::Syntax {
            entry: entry.to_string(),
        })?;
        let invalid = |problem: &str| ValuesError::Invalid {
            key: key.to_string(),
            value: value.to_string(),
            problem: problem.to_string(),
        };
        let label = |v: &str| -> Result<String, ValuesError> {
            is_dns_label(v)
                .then(|| v.to_string())
                .ok_or_else(|| invalid("must be a DNS-1123 label (lowercase letters, digits, '-')"))
        };
        let text = |v: &str| -> Result<String, ValuesError> {
            (!v.is_empty() && !v.contains(char::is_whitespace))
                .then(|| v.to_string())
                .ok_or_else(|| invalid("must be non-empty, without spaces"))
        };
        match key {
            "namespace" => self.namespace = label(value)?,
            "image" => self.image = text(value)?,
            "proxyImage" => self.proxy_image = text(value)?,
            "replicas" => {
                self.replicas = value
                    .parse()
                    .ok()
                    .filter(|n| *n >= 1)
                    .ok_or_else(|| invalid("must be a whole number ≥ 1"))?
            }
            "clusterId" => self.cluster_id = text(value)?,
            "network" => self.network = text(value)?,
            "meshId" => self.mesh_id = text(value)?,
            "trustDomain" => self.trust_domain = text(value)?,
            "remotePilotAddress" => {
                if value.parse::<IpAddr>().is_err() && !is_dns_name(value) {
                    return Err(invalid("must be an IP address or a DNS name"));
                }
                self.remote_pilot_address = value.to_string();
            }
            "exposeControlPlane" => {
                self.expose_control_plane = value
                    .parse()
                    .map_err(|_| invalid("must be true or false"))?
            }
            "controlPlaneClusters" => self.control_plane_clusters = text(value)?,
            _ if key
                .strip_prefix("meshConfig.")
                .is_some_and(|field| MESH_FIELDS.contains(&field)) =>
            {
                let field = &key["meshConfig.".len()..];
                let mut mesh = self.mesh.clone();
                mesh.insert(field.to_string(), value.to_string());
                let yaml = serde_yaml_ng::to_string(&mesh).map_err(|e| invalid(&e.to_string()))?;
                MeshConfig::parse(&yaml, &MeshConfig::default())
                    .map_err(|e| invalid(&e.to_string()))?;
                self.mesh = mesh;
            }
            _ => {
                return Err(ValuesError::UnknownKey {
                    key: key.to_string(),
                    known: KEYS.iter().map(|(k, _)| *k).collect::<Vec<_>>().join(", "),
                })
            }
        }
        Ok(())
    }

    /// The keys a profile cannot do without: (key, what it names).
    fn required(profile: Profile) -> &'static [(&'static str, &'static str)] {
        match profile {
            Profile::Primary => &[],
            Profile::MultiPrimary => &[("clusterId", "id")],
            Profile::Remote => &[
                ("remotePilotAddress", "the primary's address"),
                ("clusterId", "id"),
            ],
            Profile::EastwestGateway => &[("network", "network"), ("clusterId", "id")],
        }
    }

    /// What a profile cannot do without, every missing key named at once.
    pub fn check(&self, profile: Profile) -> Result<(), ValuesError> {
        let defaults = Values::default();
        let given = |key: &str| match key {
            "clusterId" => self.cluster_id != defaults.cluster_id,
            "remotePilotAddress" => !self.remote_pilot_address.is_empty(),
            "network" => !self.network.is_empty(),
            _ => true,
        };
        let needed: Vec<String> = Self::required(profile)
            .iter()
            .filter(|(key, _)| !given(key))
            .map(|(key, what)| format!("--set {key}=<{what}>"))
            .collect();
        match needed.is_empty() {
            true => Ok(()),
            false => Err(ValuesError::Missing {
                profile: profile.name(),
                needed: needed.join(" "),
            }),
        }
    }

    /// The revision's secure address inside the cluster, as proxies reach it.
    pub fn discovery_address(&self) -> String {
        format!("{}:15012", self.revision.service_host(&self.namespace))
    }
}

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

fn is_dns_name(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(|l| is_dns_label(&l.to_ascii_lowercase()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_checked_where_given() {
        let mut values = Values::default();
        values.set("replicas=3").unwrap();
        values.set("remotePilotAddress=192.0.2.10").unwrap();
        assert_eq!(
            (values.replicas, values.remote_pilot_address.as_str()),
            (3, "192.0.2.10")
        );
        let e = values.set("replica=3").unwrap_err().to_string();
        assert!(
            e.starts_with("--set replica: unknown key; known keys: namespace"),
            "{e}"
        );
        assert!(values.set("replicas=0").is_err());
        assert!(values.set("namespace=Istio").is_err());
        assert!(values.set("remotePilotAddress=not an address").is_err());
        assert_eq!(
            values.set("replicas").unwrap_err(),
            ValuesError::Syntax {
                entry: "replicas".into()
            }
        );
    }

    #[test]
    fn mesh_settings_are_checked_as_the_mesh_config() {
        let mut values = Values::default();
        values.set("meshConfig.accessLogFile=/dev/stdout").unwrap();
        values.set("meshConfig.accessLogEncoding=JSON").unwrap();
        assert_eq!(values.mesh["accessLogEncoding"], "JSON");
        let e = values.set("meshConfig.accessLogEncoding=XML").unwrap_err();
        assert!(e.to_string().contains("accessLogEncoding"), "{e}");
        let e = values
            .set("meshConfig.accessLogFormat={not json")
            .unwrap_err();
        assert!(e.to_string().contains("JSON object"), "{e}");
        assert!(values.set("meshConfig.enableTracing=true").is_err());
        assert_eq!(values.mesh.len(), 2);
    }

    #[test]
    fn profiles_name_what_they_need() {
        let e = Values::default().check(Profile::Remote).unwrap_err();
        assert_eq!(
            e.to_string(),
            "profile remote needs --set remotePilotAddress=<the primary's address> --set clusterId=<id>"
        );
        let e = Values::default().check(Profile::MultiPrimary).unwrap_err();
        assert_eq!(
            e.to_string(),
            "profile multi-primary needs --set clusterId=<id>"
        );
    }
}
