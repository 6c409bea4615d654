//! EDS: a ClusterLoadAssignment per outbound cluster — the endpoints of every cluster grouped by
//! locality, not-ready ones left out — as the proxy should see it:
//! - split horizon: endpoints on the proxy's network as they are; mTLS endpoints of another network
//!   that has gateways replaced by those gateways, weighted by how many endpoints each stands for;
//!   other endpoints of such a network dropped (they cannot be reached);
//! - locality priorities relative to the proxy (same zone first, then region, then the rest);
//! - for east-west gateways (`outbound_.<port>_.<subset>_.<host>`), only their own network's mTLS
//!   endpoints;
//! - for a subset (`outbound|<port>|<subset>|<host>`), only endpoints with the subset's labels, as
//!   the DestinationRule that applies to the proxy defines them.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;
use std::net::IpAddr;
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::{HealthStatus, Locality, Metadata};
use envoy_types::pb::envoy::config::endpoint::v3::{
    lb_endpoint, ClusterLoadAssignment, Endpoint as EnvoyEndpoint, LbEndpoint, LocalityLbEndpoints,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, UInt32Value, Value};

use super::common::socket;
use super::generation::Generation;
use super::locality::{self, LocalityPolicy};
use super::names::{parse_outbound, parse_sni_cluster};
use super::policy::Effective;
use super::tls::TLS_MODE_KEY;
use super::traits::Traits;
use crate::istio::destination_rule::{DestinationRule, TlsMode as ClientTlsMode, TrafficPolicy};
use crate::model::policies::SecurityPolicies;
use crate::model::{
    ClusterId, Endpoint, EndpointShards, Gateways, Health, Locality as ModelLocality, Provider,
    Resolution, Service, ShardKey, TlsMode, PODS_CLUSTER as PODS,
};
use crate::registry::workload::{canonical_service, DEFAULT_REVISION};
use crate::xds::protocol::ResourceType;
use crate::xds::wire::Resource;

/// What of the proxy shapes its assignments.
#[derive(Hash)]
struct View {
    network: Arc<str>,
    requested_networks: Vec<String>,
    /// Where the proxy is and the rule's locality load balancing.
    locality: LocalityPolicy,
    /// An east-west gateway's SNI cluster: its own network's mTLS endpoints only.
    gateway: bool,
    /// A subset's labels: only endpoints carrying all of them.
    subset: Option<BTreeMap<String, String>>,
    /// The TLS mode the rule sets for the cluster's subset and port, if it sets one: it decides
    /// alone whether clients speak mTLS to an endpoint.
    rule_tls: Option<ClientTlsMode>,
    /// For a cluster-local service, the only cluster whose endpoints the proxy gets (its own; a
    /// proxy naming none gets none, as in istiod). Other services' assignments stay shared
    /// across clusters.
    only_cluster: Option<ClusterId>,
}

pub fn build(g: &Generation<'_>, name: &str) -> Option<Arc<Resource>> {
    let (parsed, gateway) = match parse_outbound(name) {
        Some(parsed) => (parsed, false),
        None => (parse_sni_cluster(name)?, true),
    };
    let target = g.target(&parsed)?;
    let service = target.service;
    // A gateway's SNI cluster of a service without a resolution is by EDS too (istiod's
    // `convertResolution` for routers).
    let by_eds = match service.resolution {
        Resolution::ClientSideLb => true,
        Resolution::Passthrough => gateway,
        Resolution::Dns { .. } => false,
    };
    if !by_eds {
        return None;
    }
    let shards = g.mesh.endpoints.get(&service.key()).cloned();
    // The rule's policy for this (subset, port): its locality setting (else the mesh's), and
    // whether it detects outliers, without which istiod ranks no locality above another.
    let policy = target.rule.as_ref().map(|r| {
        let subset = target.subset.as_ref().map(|s| s.name.as_str());
        Effective::of(&r.rule, subset, target.port)
    });
    let failover = policy
        .as_ref()
        .is_some_and(|p| p.outlier_detection.is_some());
    let setting = policy
        .and_then(|p| p.load_balancer)
        .and_then(|lb| lb.locality_lb_setting)
        .or_else(|| g.mesh_config().locality_lb_setting.clone());
    let proxy_locality = g.proxy_locality();
    let proxy_labels = match setting
        .as_ref()
        .is_some_and(|s| !s.failover_priority.is_empty())
    {
        // Its labels hold its topology.
        true => g.labels().clone(),
        false => BTreeMap::new(),
    };
    let view = View {
        network: g.network().clone(),
        requested_networks: g.requested_networks().to_vec(),
        locality: LocalityPolicy {
            proxy: proxy_locality,
            setting,
            failover,
            proxy_labels,
        },
        gateway,
        only_cluster: g
            .mesh
            .config
            .cluster_local_hosts()
            .is_cluster_local(&service.hostname)
            .then(|| g.cluster().cloned().unwrap_or_else(|| ClusterId::new(""))),
        rule_tls: target.rule.as_ref().and_then(|r| {
            rule_tls_mode(
                &r.rule,
                target.subset.as_ref().map(|s| s.name.as_str()),
                target.port,
            )
        }),
        subset: target.subset.map(|s| s.labels),
    };
    let stamp = [
        g.services_version(),
        shards.as_ref().map_or(0, |s| s.version),
        g.mesh.gateways_version,
        g.mesh.config.endpoint_tls_version(),
    ];
    let gateways = g.mesh.gateways.clone();
    let port = target.port;
    let security = g.mesh.config.security();
    let local = g.mesh.credentials.local().clone();
    // Everything the assignment reads of the proxy is in its view, which keys it.
    g.keyed(
        ResourceType::Endpoint,
        name,
        (Traits::NONE, &view),
        stamp,
        || {
            let sources = Sources {
                shards: shards.as_deref(),
                gateways: &gateways,
                security,
                local: &local,
            };
            Some(Resource::encode(
                name,
                &assignment(name, &service, port, sources, &view),
            ))
        },
    )
}

/// The TLS mode clients see for an endpoint, as istiod's `checkMtlsEnabled` and
/// `buildEnvoyLbEndpoint` (pilot/pkg/xds/endpoints/): its sidecar's label, cleared where a TLS
/// mode the rule sets for the cluster is not ISTIO_MUTUAL, or (where the rule sets none) its
/// workload's PeerAuthentication disables mTLS on its port.
fn endpoint_tls(
    rule: Option<ClientTlsMode>,
    security: &SecurityPolicies,
    namespace: &str,
    ep: &Endpoint,
) -> TlsMode {
    match rule {
        Some(ClientTlsMode::IstioMutual) => ep.tls_mode,
        Some(_) => TlsMode::Disabled,
        None => security.endpoint_tls(namespace, ep),
    }
}

/// The TLS mode a rule sets for a subset's cluster on a port (istiod's
/// `tlsModeForDestinationRule`): the subset's policy for the port, else its policy, else the
/// rule's for the port, else the rule's; a port's setting counts only where it sets TLS.
fn rule_tls_mode(rule: &DestinationRule, subset: Option<&str>, port: u16) -> Option<ClientTlsMode> {
    let of_policy = |policy: Option<&TrafficPolicy>| {
        let policy = policy?;
        let for_port = policy
            .port_level_settings
            .iter()
            .find(|p| p.port.as_ref().map(|p| p.number) == Some(u32::from(port)))
            .and_then(|p| p.tls.as_ref());
        for_port.or(policy.tls.as_ref()).map(|t| t.mode)
    };
    let subset = subset.and_then(|n| rule.subsets.iter().find(|s| s.name == n));
    subset
        .and_then(|s| of_policy(s.traffic_policy.as_ref()))
        .or_else(|| of_policy(rule.traffic_policy.as_ref()))
}

/// Whether a shard's endpoints are of `cluster`: a Kubernetes or file cluster's shard by its key;
/// ServiceEntries' endpoints are the cluster meshpilot runs in (`local`), as istiod gives them its
/// own cluster's id.
fn shard_of_cluster(shard: &ShardKey, cluster: &ClusterId, local: &ClusterId) -> bool {
    match shard.provider {
        Provider::External => local == cluster,
        Provider::Kubernetes | Provider::File => {
            shard.cluster == *cluster || shard.cluster.as_str() == PODS
        }
    }
}

/// What an assignment is made of beyond the service.
struct Sources<'a> {
    shards: Option<&'a EndpointShards>,
    gateways: &'a Gateways,
    /// PeerAuthentication DISABLE turns a workload's endpoints to plaintext for clients.
    security: &'a SecurityPolicies,
    /// The cluster meshpilot runs in, which ServiceEntries' endpoints are of.
    local: &'a ClusterId,
}

/// One endpoint as sent, before grouping.
struct Sent {
    address: IpAddr,
    port: u16,
    /// Wide, so sums cannot overflow; fitted into Envoy's u32 by [`fit_weights`].
    weight: u64,
    metadata: Metadata,
    /// An east-west gateway's address carries no health (UNKNOWN, which Envoy balances to as a
    /// healthy host), as istiod's `EndpointsByNetworkFilter` builds it
    /// (pilot/pkg/xds/ep_filters.go).
    gateway: bool,
}

fn assignment(
    name: &str,
    service: &Service,
    port: u16,
    sources: Sources<'_>,
    view: &View,
) -> ClusterLoadAssignment {
    let Sources {
        shards,
        gateways,
        security,
        local,
    } = sources;
    let port_name = service
        .port(port)
        .map(|p| p.name.as_str())
        .unwrap_or_default();
    // Groups are (priority level, locality): failoverPriority labels can split a locality.
    let mut direct: BTreeMap<(u32, &ModelLocality), Vec<&Endpoint>> = BTreeMap::new();
    // (level, locality, network) → endpoints reached through that network's gateways.
    let mut remote: BTreeMap<(u32, &ModelLocality, &str), u64> = BTreeMap::new();
    let level = |ep: &Endpoint| -> u32 { view.locality.level(|k| ep.label(k), &ep.locality) };
    let mtls = |ep: &Endpoint| endpoint_tls(view.rule_tls, security, &service.namespace, ep);
    let endpoints = shards.into_iter().flat_map(|s| &s.shards);
    let endpoints = endpoints
        .filter(|(shard, _)| {
            view.only_cluster
                .as_ref()
                .is_none_or(|c| shard_of_cluster(shard, c, local))
        })
        .flat_map(|(shard, eps)| {
            // Pods served on their own come from every cluster: told apart one by one.
            let each = view
                .only_cluster
                .as_ref()
                .filter(|_| shard.cluster.as_str() == PODS);
            eps.iter()
                .filter(move |ep| each.is_none_or(|c| ep.cluster_id == *c))
        });
    for ep in endpoints {
        if ep.health != Health::Healthy || *ep.service_port_name != *port_name {
            continue;
        }
        let in_subset = view
            .subset
            .as_ref()
            .is_none_or(|labels| ep.has_labels(labels));
        if !in_subset {
            continue;
        }
        let requested = view.requested_networks.is_empty()
            || ep.network.is_empty()
            || view.requested_networks.iter().any(|n| **n == *ep.network);
        if !requested {
            continue;
        }
        let local = view.network.is_empty() || ep.network.is_empty() || ep.network == view.network;
        if view.gateway {
            // The gateway forwards mTLS only, and only into its own network.
            if local && mtls(ep) == TlsMode::Istio {
                direct
                    .entry((level(ep), &ep.locality))
                    .or_default()
                    .push(ep);
            }
        } else if local || gateways.of(&ep.network).is_empty() {
            direct
                .entry((level(ep), &ep.locality))
                .or_default()
                .push(ep);
        } else if mtls(ep) == TlsMode::Istio {
            *remote
                .entry((level(ep), &ep.locality, &ep.network))
                .or_default() += u64::from(ep.weight.max(1));
        }
    }

    // Integer weights: every endpoint counts `scale`; a network's endpoints are shared out evenly over
    // its gateways, so `scale` is the least common multiple of the gateway counts involved.
    // (Should the multiple not fit, shares are rounded instead.)
    let scale = remote
        .keys()
        .map(|(_, _, net)| gateways.of(net).len() as u64)
        .try_fold(1, lcm)
        .unwrap_or(1);
    let mut groups: BTreeMap<(u32, &ModelLocality), Vec<Sent>> = BTreeMap::new();
    for (group, eps) in direct {
        groups
            .entry(group)
            .or_default()
            .extend(eps.into_iter().map(|ep| Sent {
                address: ep.address,
                port: ep.port,
                weight: scale.saturating_mul(u64::from(ep.weight.max(1))),
                metadata: endpoint_metadata(mtls(ep), &telemetry_workload(ep, &service.namespace)),
                gateway: false,
            }));
    }
    for ((level, locality, network), count) in remote {
        let gws = gateways.of(network);
        let share = (count * scale / gws.len() as u64).max(1);
        let group = groups.entry((level, locality)).or_default();
        for gw in gws {
            match group
                .iter_mut()
                .find(|s| s.address == gw.address && s.port == gw.port)
            {
                Some(existing) => existing.weight += share,
                None => group.push(Sent {
                    address: gw.address,
                    port: gw.port,
                    weight: share,
                    // A gateway stands for no one workload: only its cluster is known.
                    metadata: endpoint_metadata(
                        TlsMode::Istio,
                        &format!(";;;;{}", gw.cluster.as_ref().map_or("", |c| c.as_str())),
                    ),
                    gateway: true,
                }),
            }
        }
    }

    fit_weights(groups.values_mut().flatten());
    let groups: Vec<((u32, &ModelLocality), Vec<Sent>)> = groups.into_iter().collect();
    // `distribute` replaces priorities with locality weights (and drops localities it names not).
    let weights: Vec<Option<u64>> = match view.locality.distribute() {
        Some(rule) => {
            let totals: Vec<(&ModelLocality, u64)> = groups
                .iter()
                .map(|((_, l), sent)| (*l, sent.iter().map(|s| s.weight).sum()))
                .collect();
            locality::distribute(rule, &totals)
        }
        None => groups
            .iter()
            .map(|(_, sent)| Some(sent.iter().map(|s| s.weight).sum()))
            .collect(),
    };
    let priorities = compact_priorities(groups.iter().map(|((level, _), _)| *level));
    ClusterLoadAssignment {
        cluster_name: name.to_string(),
        endpoints: groups
            .into_iter()
            .zip(weights)
            .filter_map(|(((level, locality), sent), weight)| {
                Some(LocalityLbEndpoints {
                    locality: Some(Locality {
                        region: locality.region.to_string(),
                        zone: locality.zone.to_string(),
                        sub_zone: locality.subzone.to_string(),
                    }),
                    load_balancing_weight: Some(UInt32Value {
                        value: clamp_u32(weight?),
                    }),
                    priority: priorities[&level],
                    lb_endpoints: sent.into_iter().map(lb_endpoint).collect(),
                    ..Default::default()
                })
            })
            .collect(),
        ..Default::default()
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// None when the multiple does not fit.
fn lcm(a: u64, b: u64) -> Option<u64> {
    (a / gcd(a, b)).checked_mul(b)
}

/// Envoy refuses an assignment whose weights add up past u32::MAX: scale every weight down by one
/// factor (keeping each at least 1) so the total of all of them fits.
fn fit_weights<'s>(sent: impl Iterator<Item = &'s mut Sent>) {
    let mut sent: Vec<&mut Sent> = sent.collect();
    let total: u64 = sent.iter().map(|s| s.weight).fold(0, u64::saturating_add);
    let limit = u64::from(u32::MAX);
    if total <= limit {
        return;
    }
    // Rounding each weight up to 1 adds at most one per endpoint, so leave room for it.
    let budget = limit.saturating_sub(sent.len() as u64).max(1);
    let divisor = total.div_ceil(budget);
    for s in sent.iter_mut() {
        s.weight = (s.weight / divisor).max(1);
    }
}

fn clamp_u32(weight: u64) -> u32 {
    u32::try_from(weight).unwrap_or(u32::MAX)
}

/// Envoy wants priorities contiguous from 0: map the levels present onto 0, 1, 2, ….
fn compact_priorities(levels: impl Iterator<Item = u32>) -> HashMap<u32, u32> {
    let mut present: Vec<u32> = levels.collect();
    present.sort_unstable();
    present.dedup();
    present
        .into_iter()
        .enumerate()
        .map(|(i, p)| (p, i as u32))
        .collect()
}

fn lb_endpoint(sent: Sent) -> LbEndpoint {
    LbEndpoint {
        host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(EnvoyEndpoint {
            address: Some(socket(&sent.address.to_string(), sent.port)),
            ..Default::default()
        })),
        health_status: match sent.gateway {
            true => HealthStatus::Unknown as i32,
            false => HealthStatus::Healthy as i32,
        },
        metadata: Some(sent.metadata),
        load_balancing_weight: Some(UInt32Value {
            value: clamp_u32(sent.weight),
        }),
    }
}

/// The endpoint's workload as Istio's stats read it when the peer sent no metadata of its own (no
/// sidecar, or the request failed before the exchange): `name;namespace;canonical service;
/// canonical revision;cluster`, the revision left empty when it is the default `latest`
/// (istiod's `AppendLbEndpointMetadata`, pilot/pkg/networking/util/util.go).
fn telemetry_workload(ep: &Endpoint, namespace: &str) -> String {
    let (name, revision) = canonical_service(&ep.labels, &ep.workload);
    let revision = if revision == DEFAULT_REVISION {
        ""
    } else {
        revision
    };
    format!(
        "{};{namespace};{name};{revision};{}",
        ep.workload, ep.cluster_id
    )
}

fn endpoint_metadata(tls: TlsMode, workload: &str) -> Metadata {
    let mut filter_metadata = std::collections::HashMap::new();
    if tls == TlsMode::Istio {
        // Selects the ISTIO_MUTUAL transport socket of the cluster's transport-socket matches.
        filter_metadata.insert(
            "envoy.transport_socket_match".to_string(),
            strings(&[(TLS_MODE_KEY, "istio")]),
        );
    }
    filter_metadata.insert("istio".to_string(), strings(&[("workload", workload)]));
    Metadata {
        filter_metadata,
        ..Default::default()
    }
}

/// A metadata struct of string values.
pub(super) fn strings(pairs: &[(&str, &str)]) -> Struct {
    Struct {
        fields: pairs
            .iter()
            .map(|(k, v)| {
                let value = Value {
                    kind: Some(Kind::StringValue(v.to_string())),
                };
                (k.to_string(), value)
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn priorities_are_compacted() {
        let compact = compact_priorities([3, 0, 3, 2].into_iter());
        assert_eq!((compact[&0], compact[&2], compact[&3]), (0, 1, 2));
    }

    #[test]
    fn lcm_of_gateway_counts() {
        assert_eq!([2, 3, 4].into_iter().try_fold(1, lcm), Some(12));
        assert_eq!(lcm(u64::MAX - 1, u64::MAX - 2), None);
    }

    fn sent(weight: u64) -> Sent {
        Sent {
            address: [10, 0, 0, 1].into(),
            port: 80,
            weight,
            metadata: Metadata::default(),
            gateway: false,
        }
    }

    #[test]
    fn weights_past_u32_are_scaled_to_fit() {
        let mut group = [
            sent(u64::from(u32::MAX)),
            sent(u64::from(u32::MAX)),
            sent(1),
        ];
        fit_weights(group.iter_mut());
        let total: u64 = group.iter().map(|s| s.weight).sum();
        assert!(total <= u64::from(u32::MAX), "total {total}");
        assert!(group.iter().all(|s| s.weight >= 1));
        assert!(group[0].weight > 1000 * group[2].weight, "proportions kept");
        let mut small = [sent(3), sent(5)];
        fit_weights(small.iter_mut());
        assert_eq!(
            (small[0].weight, small[1].weight),
            (3, 5),
            "small weights untouched"
        );
    }
}
