//! The names of resources, as Istio gives them and proxies ask for them: clusters
//! (`outbound|<port>|<subset>|<host>`, SNI clusters, `inbound|<port>||`, Istio's fixed ones),
//! listeners (`virtualOutbound`, `virtualInbound`, `0.0.0.0_<port>`) and routes (`<port>`,
//! `<host>:<port>`). Parsing reads canonical forms only, so a made-up spelling is no name.

use std::collections::BTreeSet;

use crate::model::Hostname;

/// Istio's fixed clusters.
pub const BLACKHOLE: &str = "BlackHoleCluster";
pub const PASSTHROUGH: &str = "PassthroughCluster";
pub const INBOUND_PASSTHROUGH: &str = "InboundPassthroughCluster";

/// A sidecar's two captured listeners.
pub const VIRTUAL_OUTBOUND: &str = "virtualOutbound";
pub const VIRTUAL_INBOUND: &str = "virtualInbound";

/// `outbound|<port>||<hostname>`
pub fn outbound_cluster(port: u16, host: &str) -> String {
    subset_cluster(port, "", host)
}

/// `outbound|<port>|<subset>|<hostname>`
pub fn subset_cluster(port: u16, subset: &str, host: &str) -> String {
    format!("outbound|{port}|{subset}|{host}")
}

/// A cluster name's parts: `outbound|<port>|<subset>|<host>`, or an east-west gateway's SNI
/// cluster `outbound_.<port>_.<subset>_.<host>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClusterName<'a> {
    pub port: u16,
    pub subset: &'a str,
    pub host: &'a str,
}

/// A port as it appears in a resource name: canonical decimal only, so that `080` and `+80` are not
/// further names for port 80 (each would be built and cached again).
pub fn parse_port(text: &str) -> Option<u16> {
    let port: u16 = text.parse().ok()?;
    (text.len() == 1 || !text.starts_with(['0', '+'])).then_some(port)
}

pub fn parse_outbound(name: &str) -> Option<ClusterName<'_>> {
    let mut parts = name.splitn(4, '|');
    let (dir, port, subset, host) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    (dir == "outbound" && !host.is_empty()).then_some(())?;
    Some(ClusterName {
        port: parse_port(port)?,
        subset,
        host,
    })
}

/// `outbound_.<port>_.<subset>_.<hostname>`: an east-west gateway's cluster, named by the SNI it
/// serves.
pub fn parse_sni_cluster(name: &str) -> Option<ClusterName<'_>> {
    let rest = name.strip_prefix("outbound_.")?;
    let (port, rest) = rest.split_once("_.")?;
    let (subset, host) = rest.split_once("_.")?;
    (!host.is_empty()).then_some(())?;
    Some(ClusterName {
        port: parse_port(port)?,
        subset,
        host,
    })
}

/// A waypoint's cluster for a port of a service it serves: `inbound-vip|<port>|<tcp|http>|<host>`
/// (istiod's `BuildSubsetKey` with direction `inbound-vip` and the protocol as subset).
pub fn inbound_vip_cluster(port: u16, protocol: &str, host: &str) -> String {
    format!("inbound-vip|{port}|{protocol}|{host}")
}

/// An `inbound-vip|<port>|<tcp|http>|<host>` name's parts, the protocol as `subset`.
pub fn parse_inbound_vip(name: &str) -> Option<ClusterName<'_>> {
    let rest = name.strip_prefix("inbound-vip|")?;
    let (port, rest) = rest.split_once('|')?;
    let (protocol, host) = rest.split_once('|')?;
    (matches!(protocol, "tcp" | "http") && !host.is_empty()).then_some(())?;
    Some(ClusterName {
        port: parse_port(port)?,
        subset: protocol,
        host,
    })
}

/// The service host an EDS cluster name is for, in any naming (`outbound|…`, SNI, `inbound-vip|…`).
pub fn cluster_host(name: &str) -> Option<&str> {
    parse_outbound(name)
        .or_else(|| parse_sni_cluster(name))
        .or_else(|| parse_inbound_vip(name))
        .map(|c| c.host)
}

/// Changed hosts few enough to be told apart by a name's tail before it is parsed.
const FEW_HOSTS: usize = 4;

/// Hostnames a change touched → the outbound cluster names (EDS resources) they back.
pub fn eds_names_for<'n>(
    hosts: &BTreeSet<Hostname>,
    subscribed: impl Iterator<Item = &'n str>,
) -> BTreeSet<String> {
    // Every naming ends with the host: most names are passed over on their last bytes.
    let few = hosts.len() <= FEW_HOSTS;
    subscribed
        .filter(|name| !few || hosts.iter().any(|h| name.ends_with(&**h)))
        .filter(|name| cluster_host(name).is_some_and(|host| hosts.contains(host)))
        .map(str::to_string)
        .collect()
}

/// `outbound_.<port>_.<subset>_.<hostname>` (`outbound_.<port>_._.<hostname>` without a subset):
/// the SNI of mesh mTLS, which an east-west gateway routes by.
pub fn outbound_sni(port: u16, subset: &str, host: &str) -> String {
    format!("outbound_.{port}_.{subset}_.{host}")
}

/// The cluster of a workload's own port: `inbound|<port>||`.
pub fn inbound_cluster(port: u16) -> String {
    format!("inbound|{port}||")
}

/// A sidecar's (or gateway's) listener for a port: `0.0.0.0_<port>`.
pub fn port_listener_name(port: u16) -> String {
    format!("0.0.0.0_{port}")
}

/// A proxyless gRPC client's listener and route for a service port: `<hostname>:<port>`.
pub fn grpc_route_name(host: &str, port: u16) -> String {
    format!("{host}:{port}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_in_names_are_canonical() {
        assert_eq!(parse_port("80"), Some(80));
        assert_eq!(parse_port("0"), Some(0));
        for other in ["080", "+80", "00", "", "65536", "8o"] {
            assert_eq!(parse_port(other), None, "{other}");
        }
        assert_eq!(
            parse_outbound("outbound|080||web.shop.svc.cluster.local"),
            None
        );
    }

    #[test]
    fn cluster_names_round_trip() {
        let host = "reviews.bookinfo.svc.cluster.local";
        let name = outbound_cluster(9080, host);
        assert_eq!(name, "outbound|9080||reviews.bookinfo.svc.cluster.local");
        let parsed = |port, subset| Some(ClusterName { port, subset, host });
        assert_eq!(parse_outbound(&name), parsed(9080, ""));
        assert_eq!(
            parse_outbound(&subset_cluster(80, "v1", host)),
            parsed(80, "v1")
        );
        assert_eq!(parse_outbound("inbound|9080||"), None);
        assert_eq!(parse_outbound("outbound|x||h"), None);
        assert_eq!(
            outbound_sni(80, "", host),
            "outbound_.80_._.reviews.bookinfo.svc.cluster.local"
        );
        assert_eq!(
            parse_sni_cluster(&outbound_sni(80, "", host)),
            parsed(80, "")
        );
        assert_eq!(
            parse_sni_cluster(&outbound_sni(80, "v2", host)),
            parsed(80, "v2")
        );
    }

    #[test]
    fn eds_names_are_those_of_the_changed_hosts_in_any_naming() {
        let subscribed = [
            "outbound|80||a.ns.svc.cluster.local",
            "outbound|80|v1|a.ns.svc.cluster.local",
            "outbound|80||xa.ns.svc.cluster.local",
            "outbound_.80_._.a.ns.svc.cluster.local",
            "inbound-vip|80|http|a.ns.svc.cluster.local",
            "outbound|80||b.ns.svc.cluster.local",
            "inbound|80||",
        ];
        let expected: BTreeSet<String> = [0, 1, 3, 4].map(|i| subscribed[i].to_string()).into();
        let hosts = |extra: usize| -> BTreeSet<Hostname> {
            let others = (0..extra).map(|i| format!("other-{i}.ns.svc.cluster.local"));
            let all = std::iter::once("a.ns.svc.cluster.local".to_string()).chain(others);
            all.map(Hostname::from).collect()
        };
        // A few hosts are matched by their tails first, many by parsing alone: the same names.
        for extra in [0, FEW_HOSTS + 1] {
            let names = eds_names_for(&hosts(extra), subscribed.into_iter());
            assert_eq!(names, expected, "{extra} other hosts");
        }
    }
}
