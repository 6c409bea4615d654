//! The name table (NDS) Istio's agent answers the workload's DNS from, when it captures DNS: every
//! host the proxy sees, across clusters, with the addresses its listeners match (istiod's
//! `pkg/dns/server/name_table.go`; where meshpilot differs, docs/dns.md says why).
//!
//! - A service with addresses resolves to those the proxy knows it by (`service_addresses`): its own
//!   cluster's VIPs, else those of the clusters that have the service — so a service that exists
//!   only in another cluster resolves, and the proxy's listeners take the connection.
//! - A ServiceEntry host without addresses resolves to its allocated ones (240.240.0.0/16,
//!   2001:2::/48); without capture the agent never asks, so nothing is lost.
//! - A headless service resolves to its ready endpoints on the proxy's network, in every cluster;
//!   each endpoint with a DNS hostname (a StatefulSet pod) also gets
//!   `<hostname>.<service>.<namespace>.svc.<domain>`, the proxy's own cluster first. A pod on a
//!   network with a gateway is also a service of its own (`registry/pod_services`), so its name
//!   resolves, elsewhere, to that service's allocated address, reached through the gateway.
//! - Kubernetes services carry `shortname` and `namespace`, from which the agent answers the
//!   search-path forms (`name`, `name.namespace`, …); a Kubernetes service wins over a
//!   ServiceEntry of the same host; wildcard hosts are left out.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use super::generation::Generation;
use super::traits::{Trait, Traits};
use crate::model::{Health, Registry, Resolution, Service};
use crate::xds::protocol::ResourceType;
use crate::xds::wire::Resource;

use crate::xds::name_table::name_table::NameInfo;
use crate::xds::name_table::NameTable;

/// Multi-cluster Services' domain: such hosts get no search-path forms (istiod's rule, so they do
/// not shadow the `cluster.local` service of the same name).
const CLUSTERSET_SUFFIX: &str = ".clusterset.local";

/// The proxy's table, one unnamed resource as istiod sends it; built once per snapshot for every
/// proxy that sees the same (cluster, network, scope, allocated addresses).
pub(super) fn table(g: &Generation<'_>) -> Option<Arc<Resource>> {
    let stamp = [
        g.services_version(),
        g.mesh.endpoints.version(),
        0,
        g.config_version(),
    ];
    g.keyed(
        ResourceType::NameTable,
        "",
        (TABLE_READS, &()),
        stamp,
        || Some(Resource::encode("", &build(g))),
    )
}

/// What the table reads of the proxy: its cluster (which VIPs), network (which pods), the
/// services it sees, the allocated addresses it uses.
const TABLE_READS: Traits = Traits::of(&[
    Trait::Cluster,
    Trait::Network,
    Trait::Scope,
    Trait::Allocated,
]);

/// The table for one proxy. The service table holds one service per host (a Kubernetes service
/// already wins over a ServiceEntry of its host there); the names of headless pods on the
/// proxy's network come last and win over a pod's own service (`registry/pod_services`), whose
/// allocated address is for proxies elsewhere.
pub(super) fn build(g: &Generation<'_>) -> NameTable {
    let mut table = BTreeMap::new();
    let mut pods = BTreeMap::new();
    for service in g.routable_services() {
        if service.hostname.starts_with('*') {
            continue;
        }
        let addresses = match service.resolution {
            Resolution::Passthrough => headless(g, &service, &mut pods),
            _ => g.service_addresses(&service),
        };
        if !addresses.is_empty() {
            table.insert(service.hostname.to_string(), info(&service, addresses));
        }
    }
    table.extend(pods.into_iter().map(|(name, (_, info))| (name, info)));
    NameTable {
        table,
        name_info: None,
    }
}

fn info(service: &Service, addresses: Vec<IpAddr>) -> NameInfo {
    let search_forms =
        service.registry == Registry::Kubernetes && !service.hostname.ends_with(CLUSTERSET_SUFFIX);
    let (shortname, namespace) = match search_forms {
        true => (service.name.clone(), service.namespace.to_string()),
        false => Default::default(),
    };
    NameInfo {
        ips: addresses.iter().map(IpAddr::to_string).collect(),
        registry: service.registry.as_str().to_string(),
        shortname,
        namespace,
        ..NameInfo::default()
    }
}

/// A headless service's ready endpoints on the proxy's network (the name's addresses), after
/// entering each one's own name in `pods` (with whether it is of the proxy's own cluster, which
/// wins when two clusters have one name).
fn headless(
    g: &Generation<'_>,
    service: &Service,
    pods: &mut BTreeMap<String, (bool, NameInfo)>,
) -> Vec<IpAddr> {
    let Some(shards) = g.mesh.endpoints.get(&service.key()) else {
        return Vec::new();
    };
    // "<name>.<namespace>.svc.<domain>" → ".<namespace>.svc.<domain>" after a pod's label.
    let Some(domain) = service.hostname.find('.').map(|i| &service.hostname[i..]) else {
        return Vec::new();
    };
    let network = g.network();
    let mut addresses = Vec::new();
    for ep in shards.endpoints() {
        let local = network.is_empty() || ep.network.is_empty() || ep.network == *network;
        if ep.health != Health::Healthy || !local || !g.reaches(service, ep) {
            continue;
        }
        addresses.push(ep.address);
        let Some(label) = ep.hostname.as_deref().filter(|h| is_dns_label(h)) else {
            continue;
        };
        let own_cluster = ep.cluster_id.as_str() == g.cluster_id();
        let name = format!("{label}.{}{domain}", service.name);
        if pods.get(&name).is_some_and(|(own, _)| *own || !own_cluster) {
            continue;
        }
        let mut info = info(service, vec![ep.address]);
        if !info.shortname.is_empty() {
            info.shortname = format!("{label}.{}", service.name);
        }
        pods.insert(name, (own_cluster, info));
    }
    addresses.sort();
    addresses.dedup();
    addresses
}

/// A name Kubernetes would give a pod (RFC 1123 label): anything else from a file cluster is left
/// out rather than served as a name no client can ask for.
fn is_dns_label(s: &str) -> bool {
    (1..=63).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}
