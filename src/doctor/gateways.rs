//! East-west gateways: with more than one network, each network's endpoints are reached by the
//! others only through its gateways, so each needs one that accepts connections. Gateways are
//! found where meshpilot finds them (`model::networks::Gateways::build`): MeshNetworks `address`
//! and `registryServiceName` entries (the Service searched in the network's `fromRegistry`
//! clusters), and Services labelled `topology.istio.io/network`.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use futures::future::join_all;
use k8s_openapi::api::core::v1::Service;
use kube::ResourceExt;

use super::report::Check;
use crate::model::{MeshNetworks, DEFAULT_GATEWAY_PORT, LABEL_GATEWAY_PORT, LABEL_NETWORK};
use crate::text::clip;

const NAME: &str = "gateways";
/// Items named in one message; the rest are counted.
const SHOWN: usize = 3;

/// The parts of a Service that make it a gateway.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GatewayService {
    pub namespace: String,
    pub name: String,
    pub network: Option<String>,
    pub port: u16,
    /// LoadBalancer ingress IPs, else externalIPs (as `registry::objects` takes them).
    pub addresses: Vec<IpAddr>,
    /// LoadBalancer ingress hostnames, which meshpilot does not use.
    pub hostnames: Vec<String>,
}

impl GatewayService {
    pub fn of(svc: &Service) -> Self {
        let ingress = svc
            .status
            .as_ref()
            .and_then(|s| s.load_balancer.as_ref())
            .and_then(|lb| lb.ingress.as_ref());
        let ingress_ips: Vec<IpAddr> = ingress
            .into_iter()
            .flatten()
            .filter_map(|i| i.ip.as_deref()?.parse().ok())
            .collect();
        let addresses = if ingress_ips.is_empty() {
            let external = svc.spec.as_ref().and_then(|s| s.external_ips.as_ref());
            external
                .into_iter()
                .flatten()
                .filter_map(|a| a.parse().ok())
                .collect()
        } else {
            ingress_ips
        };
        let hostnames = ingress
            .into_iter()
            .flatten()
            .filter_map(|i| i.hostname.clone())
            .collect();
        let labels = svc.labels();
        Self {
            namespace: svc.namespace().unwrap_or_default(),
            name: svc.name_any(),
            network: labels.get(LABEL_NETWORK).cloned(),
            port: labels
                .get(LABEL_GATEWAY_PORT)
                .and_then(|p| p.parse().ok())
                .unwrap_or(DEFAULT_GATEWAY_PORT),
            addresses,
            hostnames,
        }
    }
}

/// `name.namespace.svc…` → (namespace, name).
fn service_of_host(host: &str) -> Option<(String, String)> {
    let mut labels = host.split('.');
    let (name, namespace) = (labels.next()?, labels.next()?);
    (labels.next() == Some("svc") && !name.is_empty() && !namespace.is_empty())
        .then(|| (namespace.to_string(), name.to_string()))
}

/// The Services MeshNetworks names as gateways, as (namespace, name): each cluster is asked for them.
pub fn named_services(networks: Option<&MeshNetworks>) -> Vec<(String, String)> {
    let mut named: Vec<(String, String)> = networks
        .iter()
        .flat_map(|n| n.networks.values())
        .flat_map(|spec| &spec.gateways)
        .filter_map(|gw| service_of_host(gw.registry_service_name.as_deref()?))
        .collect();
    named.sort();
    named.dedup();
    named
}

/// Where traffic for a network may enter it, and where that came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub addr: SocketAddr,
    pub from: String,
}

/// A network's gateways, and what was named as one but is unusable.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NetworkGateways {
    pub candidates: Vec<Candidate>,
    pub problems: Vec<String>,
}

/// A cluster's gateway Services; None when they could not be read.
pub struct ClusterServices<'a> {
    pub id: &'a str,
    pub services: Option<&'a [GatewayService]>,
}

/// Every network's gateways, by network.
pub fn collect(
    networks: Option<&MeshNetworks>,
    clusters: &[ClusterServices<'_>],
) -> BTreeMap<String, NetworkGateways> {
    let mut out: BTreeMap<String, NetworkGateways> = BTreeMap::new();
    for (network, spec) in networks.iter().flat_map(|n| &n.networks) {
        let entry = out.entry(network.clone()).or_default();
        let registries: Vec<&str> = spec
            .endpoints
            .iter()
            .filter_map(|e| e.from_registry.as_deref())
            .collect();
        for gw in &spec.gateways {
            if let Some(ip) = gw.address.as_ref().and_then(|a| a.parse::<IpAddr>().ok()) {
                entry.candidates.push(Candidate {
                    addr: SocketAddr::new(ip, gw.port),
                    from: "meshNetworks address".into(),
                });
            }
            if let Some(host) = &gw.registry_service_name {
                registry_service(entry, host, gw.port, &registries, clusters);
            }
        }
    }
    for cluster in clusters {
        for svc in cluster.services.into_iter().flatten() {
            let Some(network) = &svc.network else {
                continue;
            };
            let entry = out.entry(network.clone()).or_default();
            let from = format!(
                "Service {}/{} in cluster {}",
                svc.namespace, svc.name, cluster.id
            );
            if svc.addresses.is_empty() {
                entry.problems.push(no_address(&from, svc));
            }
            for ip in &svc.addresses {
                entry.candidates.push(Candidate {
                    addr: SocketAddr::new(*ip, svc.port),
                    from: from.clone(),
                });
            }
        }
    }
    for gateways in out.values_mut() {
        // One address reached two ways is one gateway (as meshpilot dedups them).
        let mut seen = std::collections::HashSet::new();
        gateways.candidates.retain(|c| seen.insert(c.addr));
    }
    out
}

fn no_address(from: &str, svc: &GatewayService) -> String {
    if svc.hostnames.is_empty() {
        format!("{from} has no LoadBalancer ingress IP or externalIPs")
    } else {
        format!(
            "{from} has only hostname ingress ({}): meshpilot routes to ingress IPs and externalIPs only",
            clip(&svc.hostnames.join(", "))
        )
    }
}

/// A `registryServiceName` gateway: the Service in the network's registries, at the entry's port.
fn registry_service(
    entry: &mut NetworkGateways,
    host: &str,
    port: u16,
    registries: &[&str],
    clusters: &[ClusterServices<'_>],
) {
    let host_shown = clip(host);
    let Some((namespace, name)) = service_of_host(host) else {
        entry.problems.push(format!(
            "registryServiceName {host_shown} is not a Service hostname (name.namespace.svc.<domain>)"
        ));
        return;
    };
    if registries.is_empty() {
        entry.problems.push(format!(
            "registryServiceName {host_shown}: the network has no fromRegistry entry, so no cluster is searched"
        ));
        return;
    }
    let mut searched = Vec::new();
    let mut unread = Vec::new();
    let mut found = false;
    for cluster in clusters.iter().filter(|c| registries.contains(&c.id)) {
        let Some(services) = cluster.services else {
            unread.push(cluster.id);
            continue;
        };
        searched.push(cluster.id);
        for svc in services
            .iter()
            .filter(|s| s.namespace == namespace && s.name == name)
        {
            found = true;
            let from = format!("{host_shown} in cluster {}", cluster.id);
            if svc.addresses.is_empty() {
                entry.problems.push(no_address(&from, svc));
            }
            for ip in &svc.addresses {
                entry.candidates.push(Candidate {
                    addr: SocketAddr::new(*ip, port),
                    from: from.clone(),
                });
            }
        }
    }
    if !found {
        let mut problem = format!("registryServiceName {host_shown}: no such Service");
        if !searched.is_empty() {
            problem.push_str(&format!(" in cluster {}", shown(&searched)));
        }
        if !unread.is_empty() {
            problem.push_str(&format!(" ({} not readable)", shown(&unread)));
        }
        entry.problems.push(problem);
    }
}

/// At most [`SHOWN`] items, the rest counted.
fn shown<T: AsRef<str>>(items: &[T]) -> String {
    let mut out: Vec<&str> = items.iter().take(SHOWN).map(AsRef::as_ref).collect();
    let more = items.len().saturating_sub(SHOWN);
    let more_text = format!("and {more} more");
    if more > 0 {
        out.push(&more_text);
    }
    out.join(", ")
}

/// Tries a TCP connection to each candidate, all at once, each within `timeout`.
pub async fn reach(candidates: &[Candidate], timeout: Duration) -> Vec<Result<(), String>> {
    join_all(candidates.iter().map(|c| async move {
        match tokio::time::timeout(timeout, tokio::net::TcpStream::connect(c.addr)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!(
                "no connection within {}",
                humantime::format_duration(timeout)
            )),
        }
    }))
    .await
}

/// The verdict on one network's gateways, given which of them accepted a connection.
pub fn verdict(
    network: &str,
    gateways: &NetworkGateways,
    reached: &[Result<(), String>],
    others: &[String],
) -> Check {
    let problems = if gateways.problems.is_empty() {
        String::new()
    } else {
        format!(" ({})", shown(&gateways.problems))
    };
    if gateways.candidates.is_empty() {
        return Check::fail(
            NAME,
            format!(
                "network {network} has no gateway (none in meshNetworks, no Service labelled {LABEL_NETWORK}={network}) while other networks exist ({}): its endpoints are unreachable from them{problems}",
                shown(others)
            ),
        );
    }
    let (up, down): (Vec<_>, Vec<_>) = gateways
        .candidates
        .iter()
        .zip(reached)
        .partition(|(_, r)| r.is_ok());
    let describe = |list: &[(&Candidate, &Result<(), String>)]| -> Vec<String> {
        list.iter()
            .map(|(c, r)| match r {
                Ok(()) => format!("{} ({})", c.addr, c.from),
                Err(e) => format!("{} ({}): {}", c.addr, c.from, clip(e)),
            })
            .collect()
    };
    if up.is_empty() {
        Check::fail(
            NAME,
            format!(
                "network {network}: no gateway accepts connections: {}{problems}",
                shown(&describe(&down))
            ),
        )
    } else if !down.is_empty() || !problems.is_empty() {
        let mut message = format!(
            "network {network}: {} of {} gateways accept connections",
            up.len(),
            gateways.candidates.len()
        );
        if !down.is_empty() {
            message.push_str(&format!("; not {}", shown(&describe(&down))));
        }
        message.push_str(&problems);
        Check::warn(NAME, message)
    } else {
        Check::ok(
            NAME,
            format!(
                "network {network}: gateway {} accepts connections",
                shown(&describe(&up))
            ),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::report::Status;

    const NETWORKS: &str = "
networks:
  net1:
    endpoints: [{fromRegistry: east}]
    gateways: [{address: 192.0.2.1, port: 15443}]
  net2:
    endpoints: [{fromRegistry: west}]
    gateways: [{registryServiceName: eastwest.istio-system.svc.cluster.local, port: 15443}]
  net3:
    endpoints: [{fromRegistry: north}]
    gateways: [{registryServiceName: missing.istio-system.svc.cluster.local, port: 15443}]
";

    fn svc(name: &str, network: Option<&str>, addresses: &[&str]) -> GatewayService {
        GatewayService {
            namespace: "istio-system".into(),
            name: name.into(),
            network: network.map(str::to_string),
            port: 15443,
            addresses: addresses.iter().map(|a| a.parse().unwrap()).collect(),
            hostnames: Vec::new(),
        }
    }

    #[test]
    fn gateways_come_from_addresses_registry_services_and_labels() {
        let n = MeshNetworks::parse(NETWORKS).unwrap();
        let west = [svc("eastwest", None, &["198.51.100.2"])];
        let south = [
            svc("gw", Some("net4"), &["198.51.100.4"]),
            svc("web", None, &[]),
        ];
        let clusters = [
            ClusterServices {
                id: "west",
                services: Some(&west),
            },
            ClusterServices {
                id: "north",
                services: None,
            },
            ClusterServices {
                id: "south",
                services: Some(&south),
            },
        ];
        let all = collect(Some(&n), &clusters);
        assert_eq!(
            all["net1"].candidates[0].addr.to_string(),
            "192.0.2.1:15443"
        );
        assert_eq!(
            all["net2"].candidates[0].addr.to_string(),
            "198.51.100.2:15443"
        );
        assert!(all["net2"].problems.is_empty());
        assert!(all["net3"].candidates.is_empty());
        assert_eq!(
            all["net3"].problems,
            ["registryServiceName missing.istio-system.svc.cluster.local: no such Service (north not readable)"]
        );
        assert_eq!(
            all["net4"].candidates[0].from,
            "Service istio-system/gw in cluster south"
        );
        assert_eq!(
            named_services(Some(&n)),
            [
                ("istio-system".to_string(), "eastwest".to_string()),
                ("istio-system".to_string(), "missing".to_string())
            ]
        );
    }

    #[test]
    fn verdict_needs_one_gateway_that_answers() {
        let gw = |addr: &str| Candidate {
            addr: addr.parse().unwrap(),
            from: "meshNetworks address".into(),
        };
        let others = ["net2".to_string()];
        let none = verdict("net1", &NetworkGateways::default(), &[], &others);
        assert_eq!(none.status, Status::Fail);
        assert!(
            none.message.contains("network net1 has no gateway"),
            "{}",
            none.message
        );
        let two = NetworkGateways {
            candidates: vec![gw("192.0.2.1:15443"), gw("192.0.2.2:15443")],
            problems: Vec::new(),
        };
        let refused = || Err("connection refused".to_string());
        assert_eq!(
            verdict("net1", &two, &[refused(), refused()], &others).status,
            Status::Fail
        );
        let half = verdict("net1", &two, &[Ok(()), refused()], &others);
        assert_eq!(half.status, Status::Warn);
        assert!(half.message.contains("192.0.2.2:15443"), "{}", half.message);
        assert_eq!(
            verdict("net1", &two, &[Ok(()), Ok(())], &others).status,
            Status::Ok
        );
    }

    #[test]
    fn hostname_ingress_is_named_as_unusable() {
        let mut s = svc("gw", Some("net9"), &[]);
        s.hostnames = vec!["lb.example.com".into()];
        let services = [s];
        let all = collect(
            None,
            &[ClusterServices {
                id: "c",
                services: Some(&services),
            }],
        );
        assert!(all["net9"].candidates.is_empty());
        assert!(all["net9"].problems[0].contains("only hostname ingress (lb.example.com)"));
        assert_eq!(
            service_of_host("a.b.svc.cluster.local"),
            Some(("b".into(), "a".into()))
        );
        assert_eq!(service_of_host("a.b.example.com"), None);
    }
}
