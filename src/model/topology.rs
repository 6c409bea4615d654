//! Istio's topology labels, as istiod adds them to every endpoint's labels and to each proxy's own
//! (pilot/pkg/serviceregistry/util/label/label.go `AugmentLabels`, used by the Kubernetes
//! controller, ServiceEntry conversion and pilot/pkg/xds/ads.go): a DestinationRule subset, a
//! VirtualService's `sourceLabels`, `failoverPriority` and workload selectors see a workload's
//! cluster, region, zone, subzone, node and network as labels. Region, zone, subzone, cluster and
//! node replace a label of the same key; the network only fills an absent or empty one (istiod
//! since 1.23).

use std::collections::BTreeMap;

use super::{Endpoint, Locality, LABEL_NETWORK};

pub const LABEL_CLUSTER: &str = "topology.istio.io/cluster";
pub const LABEL_REGION: &str = "topology.kubernetes.io/region";
pub const LABEL_ZONE: &str = "topology.kubernetes.io/zone";
pub const LABEL_SUBZONE: &str = "topology.istio.io/subzone";
pub const LABEL_HOSTNAME: &str = "kubernetes.io/hostname";

/// Where a workload runs, as its topology labels say it.
pub struct Topology<'a> {
    pub cluster: &'a str,
    pub locality: &'a Locality,
    /// Its node's name (empty where unknown).
    pub node: &'a str,
    pub network: &'a str,
}

/// A workload's labels with its topology labels.
pub fn augment(labels: &BTreeMap<String, String>, at: &Topology<'_>) -> BTreeMap<String, String> {
    let mut out = labels.clone();
    let mut set = |key: &str, value: &str| {
        if !value.is_empty() {
            out.insert(key.to_string(), value.to_string());
        }
    };
    set(LABEL_REGION, &at.locality.region);
    set(LABEL_ZONE, &at.locality.zone);
    set(LABEL_SUBZONE, &at.locality.subzone);
    set(LABEL_CLUSTER, at.cluster);
    set(LABEL_HOSTNAME, at.node);
    if out.get(LABEL_NETWORK).is_none_or(String::is_empty) && !at.network.is_empty() {
        out.insert(LABEL_NETWORK.to_string(), at.network.to_string());
    }
    out
}

impl Endpoint {
    /// One of its labels as istiod sees them (its topology labels added), without building a map
    /// per endpoint. Its node's name is not kept, so `kubernetes.io/hostname` is its pod's own
    /// label if any.
    pub fn label(&self, key: &str) -> Option<&str> {
        let own = || self.labels.get(key).map(String::as_str);
        let topology = match key {
            LABEL_REGION => &*self.locality.region,
            LABEL_ZONE => &*self.locality.zone,
            LABEL_SUBZONE => &*self.locality.subzone,
            LABEL_CLUSTER => self.cluster_id.as_str(),
            LABEL_NETWORK => return own().filter(|n| !n.is_empty()).or(Some(&self.network)),
            _ => return own(),
        };
        match topology.is_empty() {
            true => own(),
            false => Some(topology),
        }
    }

    /// Whether it carries every one of these labels (a subset's, a selector's).
    pub fn has_labels(&self, wanted: &BTreeMap<String, String>) -> bool {
        wanted
            .iter()
            .all(|(k, v)| self.label(k) == Some(v.as_str()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{ClusterId, Health, TlsMode};
    use std::sync::Arc;

    fn endpoint(labels: &[(&str, &str)], network: &str) -> Endpoint {
        Endpoint {
            address: "10.0.0.1".parse().unwrap(),
            port: 80,
            service_port_name: "http".into(),
            labels: Arc::new(
                labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            service_account: "".into(),
            network: network.into(),
            locality: Arc::new(Locality::parse("us-east1/us-east1-b/rack-1")),
            cluster_id: ClusterId::new("c2"),
            tls_mode: TlsMode::Istio,
            health: Health::Healthy,
            workload: "".into(),
            weight: 1,
            hostname: None,
        }
    }

    #[test]
    fn endpoints_carry_their_topology() {
        let ep = endpoint(&[("app", "a"), (LABEL_CLUSTER, "fake")], "network2");
        assert_eq!(ep.label(LABEL_CLUSTER), Some("c2"), "the cluster replaces");
        assert_eq!(ep.label(LABEL_ZONE), Some("us-east1-b"));
        assert_eq!(ep.label(LABEL_NETWORK), Some("network2"));
        assert_eq!(ep.label("app"), Some("a"));
        let labelled = endpoint(&[(LABEL_NETWORK, "own")], "network2");
        assert_eq!(
            labelled.label(LABEL_NETWORK),
            Some("own"),
            "a pod's network stays"
        );
        let subset = BTreeMap::from([(LABEL_CLUSTER.to_string(), "c2".to_string())]);
        assert!(ep.has_labels(&subset));
    }

    #[test]
    fn proxies_carry_theirs() {
        let labels = BTreeMap::from([(LABEL_NETWORK.to_string(), String::new())]);
        let locality = Locality::parse("eu/eu-1");
        let at = Topology {
            cluster: "c1",
            locality: &locality,
            node: "node-a",
            network: "network1",
        };
        let out = augment(&labels, &at);
        assert_eq!(out[LABEL_CLUSTER], "c1");
        assert_eq!(out[LABEL_REGION], "eu");
        assert_eq!(out[LABEL_HOSTNAME], "node-a");
        assert_eq!(
            out[LABEL_NETWORK], "network1",
            "an empty network label is filled"
        );
        assert!(!out.contains_key(LABEL_SUBZONE));
    }
}
