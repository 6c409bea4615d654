//! The mesh model: services, endpoints and the endpoint index, in Istio's shapes.
//!
//! Everything a push reads lives here as immutable values behind `Arc`, so a push never holds a
//! lock while it builds or sends.

mod endpoint;
mod networks;
mod service;
mod services;
mod shards;

pub use endpoint::{Endpoint, Health, Labels, Locality, TlsMode};
pub use networks::{Gateway, Gateways, MeshNetworks, NetworksError, LABEL_NETWORK};
pub use service::{Hostname, Protocol, Resolution, Service, ServiceKey, ServicePort};
pub use services::ServiceTable;
pub use shards::{EndpointIndex, EndpointShards, Provider, PushNeed, ShardKey};

use std::collections::BTreeSet;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;

/// The served state every registry writes and every push reads.
#[derive(Debug, Default)]
pub struct Mesh {
    pub naming: MeshNaming,
    pub services: ServiceTable,
    pub endpoints: EndpointIndex,
    networks: RwLock<Arc<MeshNetworks>>,
    gateways: RwLock<Arc<Gateways>>,
    gateways_version: AtomicU64,
}

impl Mesh {
    pub fn new(naming: MeshNaming) -> Self {
        Self {
            naming,
            ..Default::default()
        }
    }

    pub fn mesh_networks(&self) -> Arc<MeshNetworks> {
        self.networks.read().clone()
    }

    /// Replaces the MeshNetworks config; returns whether it differs. Callers re-derive endpoints.
    pub fn set_mesh_networks(&self, networks: MeshNetworks) -> bool {
        let mut current = self.networks.write();
        if **current == networks {
            return false;
        }
        *current = Arc::new(networks);
        true
    }

    pub fn gateways(&self) -> Arc<Gateways> {
        self.gateways.read().clone()
    }

    /// Bumped whenever the gateway set changes; keys cached EDS.
    pub fn gateways_version(&self) -> u64 {
        self.gateways_version.load(Ordering::Acquire)
    }

    /// Rebuilds the gateway set from MeshNetworks and the Services labelled as gateways; returns
    /// whether it changed.
    pub fn refresh_gateways(&self) -> bool {
        let networks = self.mesh_networks();
        let registry_names: Vec<&str> = networks
            .networks
            .values()
            .flat_map(|n| {
                n.gateways
                    .iter()
                    .filter_map(|g| g.registry_service_name.as_deref())
            })
            .collect();
        let candidates = self.services.definitions(|s| {
            s.labels.contains_key(LABEL_NETWORK) || registry_names.contains(&&*s.hostname)
        });
        let next = Gateways::build(&networks, &candidates);
        let mut current = self.gateways.write();
        if **current == next {
            return false;
        }
        *current = Arc::new(next);
        self.gateways_version.fetch_add(1, Ordering::AcqRel);
        true
    }
}

/// A change to the mesh that proxies must hear about: the unit flowing from registries to the
/// push pipeline.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Change {
    /// Service definitions or identities changed: every resource type may be affected.
    pub full: bool,
    /// Services whose endpoints (and, when `full`, definitions) changed.
    pub services: BTreeSet<Hostname>,
}

impl Change {
    pub fn is_empty(&self) -> bool {
        !self.full && self.services.is_empty()
    }

    /// Folds another change into this one.
    pub fn merge(&mut self, other: Change) {
        self.full |= other.full;
        self.services.extend(other.services);
    }
}

/// Identifies one cluster (a Kubernetes cluster or a file-backed one). Cheap to clone.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(transparent)]
pub struct ClusterId(Arc<str>);

impl ClusterId {
    pub fn new(id: &str) -> Self {
        Self(Arc::from(id))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ClusterId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Mesh-wide naming settings every conversion needs.
#[derive(Clone, Debug)]
pub struct MeshNaming {
    /// Kubernetes DNS suffix, `cluster.local` by default.
    pub domain_suffix: String,
    /// SPIFFE trust domain of workload identities.
    pub trust_domain: String,
    /// Namespace of the control plane; its `topology.istio.io/network` label names a cluster's network.
    pub system_namespace: String,
}

impl Default for MeshNaming {
    fn default() -> Self {
        Self {
            domain_suffix: "cluster.local".into(),
            trust_domain: "cluster.local".into(),
            system_namespace: "istio-system".into(),
        }
    }
}

impl MeshNaming {
    pub fn hostname(&self, name: &str, namespace: &str) -> Hostname {
        Hostname::from(format!("{name}.{namespace}.svc.{}", self.domain_suffix).as_str())
    }

    pub fn spiffe_id(&self, namespace: &str, service_account: &str) -> String {
        format!(
            "spiffe://{}/ns/{namespace}/sa/{service_account}",
            self.trust_domain
        )
    }
}
