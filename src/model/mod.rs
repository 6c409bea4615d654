//! The mesh model: services, endpoints and the endpoint index, in Istio's shapes.
//!
//! Everything a push reads is one immutable [`MeshSnapshot`], published per applied batch, so a push
//! never holds a lock while it builds or sends and never mixes two versions of the mesh.

pub mod allocation;
mod config;
pub mod credentials;
mod endpoint;
mod envoy_filters;
mod jwks;
mod networks;
pub mod policies;
mod proxy_configs;
mod routing;
mod service;
mod services;
mod shards;
mod sidecar_scope;
mod telemetry;
pub mod topology;
mod trust_bundle;
mod wasm_plugins;
pub mod waypoints;
mod workloads;

pub use allocation::Allocations;
pub use config::gateway_api;
pub use config::{
    AppliedRule, ConfigChange, ConfigDelta, ConfigSource, ConfigStore, Refusal, Subject,
};
pub use credentials::{
    CredentialError, CredentialKey, Credentials, SecretMaterial, CA_SUFFIX as CREDENTIAL_CA_SUFFIX,
};
pub use endpoint::{Endpoint, Health, Labels, Locality, TlsMode};
pub use envoy_filters::envoy_filter;
pub use jwks::{JwksEntry, JwksTable};
pub use networks::{
    Gateway, GatewayNames, Gateways, MeshNetworks, NetworksError, DEFAULT_GATEWAY_PORT,
    LABEL_GATEWAY_PORT, LABEL_NETWORK,
};
pub use proxy_configs::{AppliedProxyConfigs, ProxyConfigs};
pub use routing::{host_match, BoundGateway, HostRoutes};
pub use service::{
    DnsTarget, Hostname, Protocol, Registry, Resolution, Service, ServiceKey, ServicePort,
};
pub use services::ServiceTable;
pub use shards::{
    canonical, EndpointIndex, EndpointShards, Provider, PushNeed, ShardKey, PODS_CLUSTER,
};
pub use sidecar_scope::{hosts_overlap, EgressScope, IngressPort, SidecarScope};
pub use telemetry::{
    ActiveLog, AppliedTelemetry, LogDecision, MetricOverride, MetricsPlan, TraceDecision, TraceSpec,
};
pub use trust_bundle::{SpiffeBundle, TrustBundle};
pub use wasm_plugins::wasm_plugin;
pub use waypoints::{UseWaypoint, Waypoint};
pub use workloads::{entry_uid, pod_uid, Workload, WorkloadTable};

use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;

use arc_swap::ArcSwap;
use parking_lot::Mutex;

use crate::istio::{ConfigKey, MeshConfig};

/// The served state: registries write it in batches, every push reads one published snapshot.
pub struct Mesh {
    pub naming: MeshNaming,
    /// Serializes writers: each batch is applied to a copy of the published snapshot and published
    /// whole, so readers never see half a batch.
    writer: Mutex<()>,
    published: ArcSwap<MeshSnapshot>,
}

impl Default for Mesh {
    fn default() -> Self {
        Self::new(MeshNaming::default())
    }
}

impl fmt::Debug for Mesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Mesh")
            .field("version", &self.snapshot().version)
            .finish_non_exhaustive()
    }
}

impl Mesh {
    pub fn new(naming: MeshNaming) -> Self {
        let mesh_config = naming.mesh_defaults();
        let snapshot = MeshSnapshot {
            config: ConfigStore::new(&naming.domain_suffix, mesh_config),
            credentials: Credentials::new(naming.cluster_id.clone()),
            ..MeshSnapshot::default()
        };
        Self {
            naming,
            writer: Mutex::new(()),
            published: ArcSwap::from_pointee(snapshot),
        }
    }

    /// The current snapshot: consistent, immutable, cheap to hold.
    pub fn snapshot(&self) -> Arc<MeshSnapshot> {
        self.published.load_full()
    }

    /// Applies one batch of writes to a copy of the current snapshot and publishes the result. Keep
    /// `apply` cheap (conversion and sorting belong before it): writers wait for each other here.
    pub fn write<R>(&self, apply: impl FnOnce(&mut MeshSnapshot) -> R) -> R {
        let _writer = self.writer.lock();
        let mut next = MeshSnapshot::clone(&self.published.load());
        let out = apply(&mut next);
        next.version += 1;
        next.version_text = next.version.to_string().into();
        self.published.store(Arc::new(next));
        out
    }
}

/// One consistent view of the mesh, as istiod's PushContext: every response of a push is built from
/// one snapshot, and caches are keyed by its versions. Copies share structure (persistent maps).
#[derive(Clone, Debug)]
pub struct MeshSnapshot {
    /// Bumped on every published batch; sent as the xDS version.
    pub version: u64,
    pub version_text: Arc<str>,
    pub services: ServiceTable,
    pub endpoints: EndpointIndex,
    pub networks: Arc<MeshNetworks>,
    /// What the DNS names among MeshNetworks' gateway addresses resolved to.
    pub gateway_names: Arc<GatewayNames>,
    pub gateways: Arc<Gateways>,
    /// Bumped whenever the gateway set changes; keys cached EDS.
    pub gateways_version: u64,
    /// Bumped whenever a service whose pods listeners match (`Service::listens_per_endpoint`)
    /// changes endpoints, or a headless service's ports change TLS modes (whether its
    /// ORIGINAL_DST cluster originates mTLS); stamps cached listeners and cluster lists.
    pub pods_version: u64,
    /// Istio configuration and the mesh config.
    pub config: ConfigStore,
    /// Keys fetched for RequestAuthentications.
    pub jwks: JwksTable,
    /// TLS Secrets of every cluster, for gateways' `credentialName`.
    pub credentials: Credentials,
    /// Addresses of ServiceEntry hosts that declare none.
    pub allocations: Allocations,
    /// Every cluster's pods, for ambient mode's workload discovery.
    pub workloads: WorkloadTable,
    /// The roots proxies are sent over PCDS; none unless the installation distributes them
    /// (`--multiroot-mesh`).
    pub trust_bundle: Option<Arc<TrustBundle>>,
    /// Bumped whenever the trust bundle changes; stamps the PCDS resource.
    pub trust_bundle_version: u64,
}

impl Default for MeshSnapshot {
    fn default() -> Self {
        Self {
            version: 0,
            version_text: "0".into(),
            services: ServiceTable::default(),
            endpoints: EndpointIndex::default(),
            networks: Arc::default(),
            gateway_names: Arc::default(),
            gateways: Arc::default(),
            gateways_version: 0,
            pods_version: 0,
            config: ConfigStore::default(),
            jwks: JwksTable::default(),
            credentials: Credentials::default(),
            allocations: Allocations::default(),
            workloads: WorkloadTable::default(),
            trust_bundle: None,
            trust_bundle_version: 0,
        }
    }
}

impl MeshSnapshot {
    /// Replaces the MeshNetworks config; returns whether it differs. Callers re-derive endpoints.
    pub fn set_mesh_networks(&mut self, networks: MeshNetworks) -> bool {
        if *self.networks == networks {
            return false;
        }
        self.networks = Arc::new(networks);
        true
    }

    /// Replaces what gateways' DNS names resolve to; returns whether it differs. Callers re-derive
    /// the gateways.
    pub fn set_gateway_names(&mut self, names: GatewayNames) -> bool {
        if *self.gateway_names == names {
            return false;
        }
        self.gateway_names = Arc::new(names);
        true
    }

    /// Rebuilds the gateway set from MeshNetworks and the Services labelled as gateways; returns
    /// whether it changed.
    pub fn refresh_gateways(&mut self) -> bool {
        let registry_names: Vec<&str> = self
            .networks
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
        let next = Gateways::build(&self.networks, &self.gateway_names, &candidates);
        if *self.gateways == next {
            return false;
        }
        self.gateways = Arc::new(next);
        self.gateways_version += 1;
        true
    }
}

/// A change to the mesh that proxies must hear about: the unit flowing from registries and config
/// sources to the push pipeline.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Change {
    /// Service definitions, identities or config changed: every resource type may be affected.
    pub full: bool,
    /// Services whose endpoints (and, when `full`, definitions) changed.
    pub services: BTreeSet<Hostname>,
    /// Config objects behind the change, for the push log.
    pub configs: BTreeSet<ConfigKey>,
    /// Which proxies the full part concerns.
    pub audience: Audience,
    /// Secrets that changed: proxies holding them over SDS get them again.
    pub credentials: BTreeSet<CredentialKey>,
    /// The full part cannot move any name table (NDS): config of kinds that name no host, fetched
    /// keys. Unset is the safe side: merged changes keep it only when every full one had it.
    pub names_kept: bool,
    /// Workloads (uids) whose Address ambient mode sends may have changed: pods that came, changed
    /// or went, and those whose endpoints did.
    pub workloads: BTreeSet<Arc<str>>,
    /// A change merged into this one touched every endpoint assignment (see
    /// `touches_all_endpoints`), which the merged services and configs no longer tell.
    pub(crate) all_endpoints: bool,
    /// The trust bundle changed: the proxies that watch it (PCDS) get it again, and nothing else.
    pub trust_bundle: bool,
}

/// The proxies a full push is for.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Audience {
    #[default]
    Everyone,
    /// Proxies of these namespaces (a config object visible there alone).
    Namespaces(BTreeSet<Arc<str>>),
}

impl Audience {
    pub fn admits(&self, namespace: &str) -> bool {
        match self {
            Audience::Everyone => true,
            Audience::Namespaces(set) => set.contains(namespace),
        }
    }

    fn union(self, other: Audience) -> Audience {
        match (self, other) {
            (Audience::Namespaces(mut a), Audience::Namespaces(b)) => {
                a.extend(b);
                Audience::Namespaces(a)
            }
            _ => Audience::Everyone,
        }
    }
}

impl Change {
    /// A full push for everyone.
    pub fn full() -> Self {
        Self {
            full: true,
            ..Default::default()
        }
    }

    /// Endpoints of these services changed.
    pub fn endpoints(services: BTreeSet<Hostname>) -> Self {
        Self {
            services,
            ..Default::default()
        }
    }

    pub fn is_empty(&self) -> bool {
        !self.full
            && self.services.is_empty()
            && self.credentials.is_empty()
            && self.configs.is_empty()
            && self.workloads.is_empty()
            && !self.trust_bundle
    }

    /// Whether every endpoint assignment may have changed: config or a mesh-wide setting did. A
    /// full change naming services and no config (their definitions or identities) leaves the
    /// assignments of other services as they were.
    pub fn touches_all_endpoints(&self) -> bool {
        self.all_endpoints || (self.full && (!self.configs.is_empty() || self.services.is_empty()))
    }

    /// Why this change pushes, as istiod names its push triggers.
    pub fn trigger(&self) -> &'static str {
        if !self.configs.is_empty() {
            "config"
        } else if !self.credentials.is_empty() {
            "secret"
        } else if self.trust_bundle && !self.full && self.services.is_empty() {
            // istiod's trust bundle update is a global one.
            "global"
        } else if !self.full {
            "endpoint"
        } else if !self.services.is_empty() {
            "service"
        } else {
            "global"
        }
    }

    /// Folds another change into this one.
    pub fn merge(&mut self, other: Change) {
        // Derived from what is merged (a mesh-wide change names no service), so settled first.
        self.all_endpoints = self.touches_all_endpoints() || other.touches_all_endpoints();
        self.names_kept = match (self.full, other.full) {
            (true, true) => self.names_kept && other.names_kept,
            (false, true) => other.names_kept,
            (_, false) => self.names_kept,
        };
        self.audience = match (self.full, other.full) {
            (true, true) => std::mem::take(&mut self.audience).union(other.audience),
            (false, true) => other.audience,
            (_, false) => std::mem::take(&mut self.audience),
        };
        self.full |= other.full;
        self.trust_bundle |= other.trust_bundle;
        self.workloads.extend(other.workloads);
        self.services.extend(other.services);
        self.configs.extend(other.configs);
        self.credentials.extend(other.credentials);
    }
}

/// Identifies one cluster (a Kubernetes cluster or a file-backed one). Cheap to clone.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
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
    /// The cluster meshpilot runs in: where gateway credentials are looked up after the gateway's own.
    pub cluster_id: ClusterId,
    /// `--multiroot-mesh`: the mesh config's extra roots are sent to proxies (PCDS).
    pub multiroot_mesh: bool,
}

impl Default for MeshNaming {
    fn default() -> Self {
        Self {
            domain_suffix: "cluster.local".into(),
            trust_domain: "cluster.local".into(),
            system_namespace: "istio-system".into(),
            cluster_id: ClusterId::new("Kubernetes"),
            multiroot_mesh: false,
        }
    }
}

impl MeshNaming {
    pub fn hostname(&self, name: &str, namespace: &str) -> Hostname {
        Hostname::from(format!("{name}.{namespace}.svc.{}", self.domain_suffix).as_str())
    }

    /// Istio's mesh config defaults for this installation (its trust domain and root namespace),
    /// and whether it distributes extra roots.
    pub fn mesh_defaults(&self) -> MeshConfig {
        MeshConfig {
            multiroot_mesh: self.multiroot_mesh,
            ..MeshConfig::defaults_for(&self.trust_domain, &self.system_namespace)
        }
    }

    /// The (name, namespace) of a Kubernetes Service's hostname; None for any other host.
    pub fn split_service_host<'h>(&self, host: &'h str) -> Option<(&'h str, &'h str)> {
        let rest = host
            .strip_suffix(self.domain_suffix.as_str())?
            .strip_suffix(".svc.")?;
        let (name, namespace) = rest.split_once('.')?;
        (!name.is_empty() && !namespace.is_empty() && !namespace.contains('.'))
            .then_some((name, namespace))
    }

    pub fn spiffe_id(&self, namespace: &str, service_account: &str) -> String {
        format!(
            "spiffe://{}/ns/{namespace}/sa/{service_account}",
            self.trust_domain
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_service_hostname_splits_into_name_and_namespace() {
        let naming = MeshNaming::default();
        let host = naming.hostname("web", "shop");
        assert_eq!(naming.split_service_host(&host), Some(("web", "shop")));
        for other in [
            "web.shop.global",
            "web.svc.cluster.local",
            "a.b.c.svc.cluster.local",
            ".shop.svc.cluster.local",
            "web.shop.svc.example.org",
        ] {
            assert_eq!(naming.split_service_host(other), None, "{other}");
        }
    }

    #[test]
    fn a_mesh_wide_change_merged_with_others_still_touches_every_assignment() {
        let endpoints = || Change::endpoints(["a.shop.svc.cluster.local".into()].into());
        let redefined = || Change {
            services: ["b.shop.svc.cluster.local".into()].into(),
            ..Change::full()
        };
        assert!(!endpoints().touches_all_endpoints());
        assert!(!redefined().touches_all_endpoints());
        for (first, second) in [
            (Change::full(), endpoints()),
            (endpoints(), Change::full()),
            (Change::full(), redefined()),
            (redefined(), Change::full()),
        ] {
            let mut merged = first;
            merged.merge(second);
            assert!(merged.touches_all_endpoints(), "{merged:?}");
            merged.merge(endpoints());
            assert!(merged.touches_all_endpoints(), "and after more: {merged:?}");
        }
        let mut merged = redefined();
        merged.merge(endpoints());
        assert!(!merged.touches_all_endpoints(), "{merged:?}");
    }
}
