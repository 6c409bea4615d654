//! The ServiceEntry registry: services from ServiceEntries; endpoints from their inline endpoints
//! and the WorkloadEntries they select, under the `External` provider with one shard per config
//! source. It is re-derived from the config store whenever ServiceEntries or WorkloadEntries change
//! (there are few; pods selected by a `workloadSelector` come from the cluster registries instead).
//!
//! A Kubernetes Service and a ServiceEntry with the same hostname: the Kubernetes definition is
//! served (registries rank before config, as in istiod's aggregate), and the endpoints of both add up.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use tracing::warn;

use crate::istio::service_entry::{Location, Resolution as SeResolution, WorkloadEntry};
use crate::istio::{ConfigKind, ConfigObject, Origin, ServiceEntry, Spec};
use crate::model::allocation::{slot_of, Owner};
use crate::model::{
    canonical, Change, ClusterId, DnsTarget, Endpoint, Health, Hostname, Locality, MeshNaming,
    MeshSnapshot, Protocol, Provider, PushNeed, Registry, Resolution, Service, ServicePort,
    ShardKey, TlsMode, UseWaypoint,
};

/// The pseudo-cluster of config read from files (ServiceEntries there belong to no cluster).
pub const FILES_CLUSTER: &str = "config-files";
/// The pseudo-cluster of ServiceEntries from MCP config sources.
pub const MCP_CLUSTER: &str = "config-mcp";

/// Where ServiceEntry services are defined in the service table: after every real cluster (ids of
/// real clusters cannot start with '~').
const DEFINITIONS: &str = "~serviceentries";

/// The label of a workload with an Istio sidecar.
const LABEL_TLS_MODE: &str = "security.istio.io/tlsMode";

/// A ServiceEntry labelled `"false"` here gets no allocated addresses (Istio's opt-out).
const LABEL_AUTO_ALLOCATE: &str = "networking.istio.io/enable-autoallocate-ip";

/// Which pseudo-cluster (and shard) an object's services go under: its config source.
pub(super) fn source_cluster(object: &ConfigObject) -> ClusterId {
    match &object.meta.origin {
        Origin::File { .. } | Origin::AutoRegistered { .. } => ClusterId::new(FILES_CLUSTER),
        Origin::Kubernetes { cluster, .. } | Origin::Ingress { cluster, .. } => {
            ClusterId::new(cluster)
        }
        Origin::Mcp { .. } => ClusterId::new(MCP_CLUSTER),
    }
}

fn shard(cluster: &ClusterId) -> ShardKey {
    ShardKey {
        provider: Provider::External,
        cluster: cluster.clone(),
    }
}

/// What the ServiceEntries define: each host's service and, per config source, its endpoints.
type Desired = BTreeMap<Hostname, (Service, BTreeMap<ClusterId, Vec<Endpoint>>)>;

/// Hosts that get allocated addresses, with the address their entry's status records.
type Wanting = BTreeMap<Hostname, Option<IpAddr>>;

/// Brings the services and shards of every ServiceEntry in line with the config store, and gives
/// addresses to the hosts that declare none.
pub fn sync(mesh: &mut MeshSnapshot, naming: &MeshNaming, change: &mut Change) {
    let (mut desired, wanting) = desired(mesh, naming);
    for (host, recorded) in &wanting {
        let Some(address) = *recorded else { continue };
        let claimed = slot_of(address).is_some_and(|slot| mesh.allocations.claim(host, slot));
        if !claimed {
            warn!(host = %host, %address, "the address a ServiceEntry's status records is outside 240.240.0.0/16 or another host's; allocating anew");
        }
    }
    let wanting: BTreeSet<Hostname> = wanting.into_keys().collect();
    mesh.allocations.define(Owner::Entries, &wanting);
    for host in &wanting {
        if let (Some((service, _)), Some(addresses)) =
            (desired.get_mut(host), mesh.allocations.addresses(host))
        {
            service.auto_addresses = addresses.to_vec();
        }
    }
    let definitions = ClusterId::new(DEFINITIONS);
    let mut touched = |host: Hostname, full: bool| {
        change.full |= full;
        change.services.insert(host);
    };
    for host in mesh.services.hosts_of(&definitions) {
        if !desired.contains_key(&host) && mesh.services.remove(&definitions, &host) {
            touched(host, true);
        }
    }
    for shard in mesh.endpoints.shards_of(Provider::External) {
        for key in mesh.endpoints.keys_in(&shard) {
            let wanted = desired.get(&key.hostname).is_some_and(|(s, eps)| {
                s.namespace == key.namespace && eps.contains_key(&shard.cluster)
            });
            if !wanted && mesh.endpoints.delete_service_shard(&key, &shard) != PushNeed::None {
                touched(key.hostname, true);
            }
        }
    }
    for (host, (service, by_source)) in desired {
        let key = service.key();
        if mesh.services.upsert(&definitions, service) {
            touched(host.clone(), true);
        }
        for (source, endpoints) in by_source {
            match mesh
                .endpoints
                .update(&key, &shard(&source), canonical(endpoints))
            {
                PushNeed::None => {}
                need => touched(host.clone(), need == PushNeed::Full),
            }
        }
    }
}

/// Every ServiceEntry's services with their inline and WorkloadEntry endpoints, and the hosts to
/// allocate addresses to (with the IPv4 address their entry's status records, if any). When two
/// entries define one host, the oldest wins (the others are logged).
fn desired(mesh: &MeshSnapshot, naming: &MeshNaming) -> (Desired, Wanting) {
    let config = &mesh.config;
    let mut entries: Vec<(&Arc<ConfigObject>, &ServiceEntry)> = config
        .of_kind(ConfigKind::ServiceEntry)
        .filter_map(|o| match &o.spec {
            Spec::ServiceEntry(se) => Some((o, se)),
            _ => None,
        })
        .collect();
    entries.sort_by(|(a, _), (b, _)| {
        (a.meta.creation_timestamp.as_deref(), &a.key)
            .cmp(&(b.meta.creation_timestamp.as_deref(), &b.key))
    });
    let workload_entries: Vec<(&Arc<ConfigObject>, &WorkloadEntry)> = config
        .of_kind(ConfigKind::WorkloadEntry)
        .filter_map(|o| match &o.spec {
            Spec::WorkloadEntry(we) => Some((o, we)),
            _ => None,
        })
        .collect();
    let mut desired = Desired::new();
    let mut wanting = Wanting::new();
    let mut taken: BTreeMap<Hostname, &ConfigObject> = BTreeMap::new();
    for (object, entry) in entries {
        let cluster = source_cluster(object);
        let namespace = &object.key.namespace;
        // Workloads the entry stands for: its inline endpoints, or the WorkloadEntries it selects.
        let workloads: Vec<(Option<&str>, &WorkloadEntry)> = match &entry.workload_selector {
            Some(selector) => workload_entries
                .iter()
                .filter(|(o, we)| {
                    o.key.namespace == *namespace
                        && selector
                            .labels
                            .iter()
                            .all(|(k, v)| we.labels.get(k) == Some(v))
                })
                .map(|(o, we)| (Some(&*o.key.name), *we))
                .collect(),
            None => entry.endpoints.iter().map(|we| (None, we)).collect(),
        };
        for host in &entry.hosts {
            let hostname: Hostname = config.qualify(host, namespace).into();
            if let Some(first) = taken.get(&hostname) {
                warn!(host = %hostname, kept = %first.key, ignored = %object.key, "two ServiceEntries define one host; the oldest is served");
                continue;
            }
            taken.insert(hostname.clone(), object);
            if wants_addresses(object, entry, &hostname) {
                let recorded = entry
                    .status_addresses
                    .iter()
                    .find(|a| a.value.is_ipv4() && config.qualify(&a.host, namespace) == *hostname)
                    .map(|a| a.value);
                wanting.insert(hostname.clone(), recorded);
            }
            let service = service(object, entry, &hostname, &workloads);
            let endpoints = match entry.resolution {
                SeResolution::Static => {
                    endpoints(naming, object, entry, &hostname, &cluster, &workloads)
                }
                _ => Vec::new(),
            };
            desired.insert(
                hostname,
                (service, BTreeMap::from([(cluster.clone(), endpoints)])),
            );
        }
    }
    (desired, wanting)
}

fn service(
    object: &ConfigObject,
    entry: &ServiceEntry,
    hostname: &Hostname,
    workloads: &[(Option<&str>, &WorkloadEntry)],
) -> Service {
    let resolution = match entry.resolution {
        SeResolution::None => Resolution::Passthrough,
        SeResolution::Static => Resolution::ClientSideLb,
        SeResolution::Dns => Resolution::Dns { round_robin: false },
        SeResolution::DnsRoundRobin => Resolution::Dns { round_robin: true },
    };
    let dns_targets = match resolution {
        Resolution::Dns { .. } if !workloads.is_empty() => workloads
            .iter()
            .map(|(_, we)| DnsTarget {
                host: we.address.clone(),
                ports: ports_of(we),
                weight: we.weight.max(1),
                locality: (!we.locality.is_empty()).then(|| we.locality.clone()),
            })
            .collect(),
        // Without endpoints the host itself is resolved (not for wildcards: nothing to resolve).
        Resolution::Dns { .. } if !hostname.starts_with('*') => vec![DnsTarget {
            host: hostname.to_string(),
            ports: BTreeMap::new(),
            weight: 1,
            locality: None,
        }],
        _ => Vec::new(),
    };
    let vips: Vec<IpAddr> = entry
        .addresses
        .iter()
        .filter_map(|a| a.parse().ok())
        .collect();
    Service {
        hostname: hostname.clone(),
        name: hostname.to_string(),
        namespace: object.key.namespace.clone(),
        registry: Registry::External,
        ports: entry
            .ports
            .iter()
            .filter_map(|p| {
                Some(ServicePort {
                    name: p.name.clone(),
                    port: u16::try_from(p.number).ok()?,
                    protocol: Protocol::from_name(&p.protocol),
                    target_port: p.target_port.and_then(|t| u16::try_from(t).ok()),
                })
            })
            .collect(),
        cluster_vips: BTreeMap::from([(ClusterId::new(DEFINITIONS), vips)]),
        labels: object.meta.labels.clone(),
        resolution,
        dns_targets,
        external_addresses: Vec::new(),
        mesh_external: entry.location == Location::MeshExternal,
        export_to: entry.export_to.clone(),
        subject_alt_names: entry.subject_alt_names.clone(),
        auto_addresses: Vec::new(),
        use_waypoint: UseWaypoint::from_labels(&object.meta.labels, &object.key.namespace),
    }
}

/// Istio's rule for allocation: a host that is no wildcard, of an entry without `addresses` whose
/// resolution can honour an address (not NONE), unless the entry opts out.
pub fn wants_addresses(object: &ConfigObject, entry: &ServiceEntry, host: &str) -> bool {
    let opted_out = object
        .meta
        .labels
        .get(LABEL_AUTO_ALLOCATE)
        .is_some_and(|v| v.eq_ignore_ascii_case("false"));
    entry.addresses.is_empty()
        && !opted_out
        && !host.starts_with('*')
        && entry.resolution != SeResolution::None
}

fn ports_of(we: &WorkloadEntry) -> BTreeMap<String, u16> {
    we.ports
        .iter()
        .filter_map(|(name, port)| Some((name.clone(), u16::try_from(*port).ok()?)))
        .collect()
}

/// Endpoints of a STATIC entry: every workload with an IP, on every port of the entry.
fn endpoints(
    naming: &MeshNaming,
    object: &ConfigObject,
    entry: &ServiceEntry,
    hostname: &Hostname,
    cluster: &ClusterId,
    workloads: &[(Option<&str>, &WorkloadEntry)],
) -> Vec<Endpoint> {
    let mut out = Vec::new();
    for (name, we) in workloads {
        let Ok(address) = we.address.parse::<IpAddr>() else {
            continue;
        };
        let labels: Arc<BTreeMap<String, String>> = Arc::new(we.labels.clone());
        let service_account: Arc<str> = match we.service_account.as_str() {
            "" => "".into(),
            sa => naming.spiffe_id(&object.key.namespace, sa).into(),
        };
        // istiod's `getTLSModeFromWorkloadEntry` (pilot/pkg/serviceregistry/serviceentry/
        // conversion.go): the label, else a service account means a sidecar. Clusters of
        // MESH_EXTERNAL services never originate mTLS, whatever their endpoints say.
        let tls_mode = match we.labels.get(LABEL_TLS_MODE).map(String::as_str) {
            Some("istio") => TlsMode::Istio,
            Some(_) => TlsMode::Disabled,
            None if !we.service_account.is_empty() => TlsMode::Istio,
            None => TlsMode::Disabled,
        };
        let workload: Arc<str> = name.unwrap_or_default().into();
        for port in &entry.ports {
            let target = we
                .ports
                .get(&port.name)
                .copied()
                .or(port.target_port)
                .unwrap_or(port.number);
            let Ok(target) = u16::try_from(target) else {
                continue;
            };
            out.push(Endpoint {
                address,
                port: target,
                service_port_name: port.name.as_str().into(),
                labels: labels.clone(),
                service_account: service_account.clone(),
                network: we.network.as_str().into(),
                locality: Locality::parse(&we.locality).into(),
                cluster_id: cluster.clone(),
                tls_mode,
                health: Health::Healthy,
                workload: workload.clone(),
                weight: we.weight.max(1),
                hostname: None,
            });
        }
    }
    if out.is_empty() && entry.workload_selector.is_none() && !entry.endpoints.is_empty() {
        warn!(host = %hostname, entry = %object.key, "ServiceEntry endpoints without IP addresses");
    }
    out
}
