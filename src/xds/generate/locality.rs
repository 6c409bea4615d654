//! Locality load balancing as istiod applies a `localityLbSetting` (a DestinationRule's, else the
//! mesh config's): failover priorities relative to the proxy (region/zone/subzone, then `failover`
//! regions), `failoverPriority` labels ahead of locality, or `distribute` weights instead of
//! priorities; `enabled: false` turns it all off.

use std::collections::BTreeMap;

use crate::istio::destination_rule::{LoadBalancer, LocalityDistribute, LocalityLbSetting};
use crate::model::Locality;

/// The proxy's side of locality load balancing.
#[derive(Clone, Debug, Hash)]
pub struct LocalityPolicy {
    pub proxy: Option<Locality>,
    pub setting: Option<LocalityLbSetting>,
    /// Failover ranks endpoints (by locality, or `failoverPriority` labels): only where outlier
    /// detection can move traffic on when the preferred ones fail, as istiod
    /// (`getOutlierDetectionAndLoadBalancerSettings`, pilot/pkg/xds/endpoints).
    pub failover: bool,
    /// The proxy's labels, its topology labels among them (for failoverPriority).
    pub proxy_labels: BTreeMap<String, String>,
}

impl LocalityPolicy {
    fn enabled(&self) -> bool {
        self.setting.as_ref().and_then(|s| s.enabled) != Some(false)
    }

    /// The `distribute` entry for the proxy's locality, when one applies.
    pub fn distribute(&self) -> Option<&LocalityDistribute> {
        let proxy = self.proxy.as_ref()?;
        let setting = self.setting.as_ref().filter(|_| self.enabled())?;
        setting
            .distribute
            .iter()
            .find(|d| locality_match(proxy, &d.from))
    }

    /// The priority level of endpoints with these (topology) labels in this locality: label levels
    /// first (`failoverPriority`: how many of the listed labels, counted from the end, the endpoint
    /// does not share with the proxy), then the locality level. Lower is preferred; levels are
    /// compacted by the caller.
    pub fn level<'l>(&self, label: impl Fn(&str) -> Option<&'l str>, locality: &Locality) -> u32 {
        if !self.failover || !self.enabled() || self.distribute().is_some() {
            return 0;
        }
        let setting = self.setting.as_ref();
        let listed = setting.map_or(&[][..], |s| s.failover_priority.as_slice());
        let label_level = match listed {
            [] => 0,
            keys => {
                let shared = keys
                    .iter()
                    .take_while(|key| {
                        let (key, wanted) = match key.split_once('=') {
                            Some((k, v)) => (k, Some(v)),
                            None => (
                                key.as_str(),
                                self.proxy_labels.get(*key).map(String::as_str),
                            ),
                        };
                        wanted.is_some() && label(key) == wanted
                    })
                    .count();
                (keys.len() - shared) as u32
            }
        };
        label_level * 8 + self.locality_level(locality)
    }

    /// Istio's order relative to the proxy: same subzone 0, same zone 1, same region 2, a
    /// `failover` region of the proxy's 3, elsewhere 4. Without a proxy locality, 0.
    fn locality_level(&self, locality: &Locality) -> u32 {
        let Some(proxy) = &self.proxy else { return 0 };
        if proxy.region != locality.region {
            let failover = self
                .setting
                .as_ref()
                .map_or(&[][..], |s| s.failover.as_slice());
            let listed = failover
                .iter()
                .any(|f| *f.from == *proxy.region && *f.to == *locality.region);
            return if listed { 3 } else { 4 };
        }
        if proxy.zone != locality.zone {
            2
        } else if proxy.subzone != locality.subzone {
            1
        } else {
            0
        }
    }
}

/// The locality setting in force: the rule's, else the mesh config's; None when turned off.
pub fn setting<'a>(
    lb: Option<&'a LoadBalancer>,
    mesh: Option<&'a LocalityLbSetting>,
) -> Option<&'a LocalityLbSetting> {
    lb.and_then(|lb| lb.locality_lb_setting.as_ref())
        .or(mesh)
        .filter(|s| s.enabled != Some(false))
}

/// Whether a cluster weighs its localities (`locality_weighted_lb_config`): where `distribute`
/// gives them weights, or failover ranks them (which needs outlier detection), as istiod since
/// 1.24 (`LocalityLBSettings.ApplyToCluster`, pilot/pkg/networking/core/loadbalancer).
pub fn weights_localities(setting: Option<&LocalityLbSetting>, outlier_detection: bool) -> bool {
    setting.is_some_and(|s| {
        !s.distribute.is_empty()
            || (outlier_detection && (!s.failover.is_empty() || !s.failover_priority.is_empty()))
    })
}

/// Istio's locality pattern: `region[/zone[/subzone]]`, `*` for any, missing parts match anything.
pub fn locality_match(locality: &Locality, pattern: &str) -> bool {
    let mut parts = pattern.splitn(3, '/');
    let mut part = |actual: &str, required: bool| match parts.next() {
        None | Some("") => !required,
        Some("*") => true,
        Some(p) => p == actual,
    };
    part(&locality.region, true) && part(&locality.zone, false) && part(&locality.subzone, false)
}

/// `distribute` weights for locality groups (in order): per `to` pattern, its percentage shared
/// among the groups it matches by their own weight (first pattern first); groups no pattern
/// matches get None (they are dropped).
pub fn distribute(rule: &LocalityDistribute, groups: &[(&Locality, u64)]) -> Vec<Option<u64>> {
    let mut weights: Vec<Option<u64>> = vec![None; groups.len()];
    for (pattern, percent) in &rule.to {
        let matched: Vec<usize> = (0..groups.len())
            .filter(|i| weights[*i].is_none() && locality_match(groups[*i].0, pattern))
            .collect();
        let total: u64 = matched.iter().map(|i| groups[*i].1.max(1)).sum();
        for i in matched {
            let share = (groups[i].1.max(1) * u64::from(*percent)).div_ceil(total.max(1));
            weights[i] = Some(share.max(1));
        }
    }
    weights
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::istio::destination_rule::LocalityFailover;

    fn policy(proxy: &str, setting: Option<LocalityLbSetting>) -> LocalityPolicy {
        LocalityPolicy {
            proxy: Some(Locality::parse(proxy)),
            setting,
            failover: true,
            proxy_labels: BTreeMap::from([("topology.istio.io/network".into(), "n1".into())]),
        }
    }

    /// Lookups of a label map, as endpoints answer them.
    fn of<'l>(labels: &'l BTreeMap<String, String>) -> impl Fn(&str) -> Option<&'l str> {
        move |k: &str| labels.get(k).map(String::as_str)
    }

    fn level(p: &LocalityPolicy, locality: &str) -> u32 {
        p.level(|_| None, &Locality::parse(locality))
    }

    #[test]
    fn failover_regions_come_before_the_rest() {
        let setting = LocalityLbSetting {
            failover: vec![LocalityFailover {
                from: "us-east".into(),
                to: "eu-west".into(),
            }],
            ..Default::default()
        };
        let p = policy("us-east/a/1", Some(setting));
        assert_eq!(level(&p, "us-east/a/1"), 0);
        assert_eq!(level(&p, "us-east/a/2"), 1);
        assert_eq!(level(&p, "us-east/b"), 2);
        assert_eq!(level(&p, "eu-west/x"), 3);
        assert_eq!(level(&p, "ap-south/x"), 4);
        let off = policy(
            "us-east/a/1",
            Some(LocalityLbSetting {
                enabled: Some(false),
                ..Default::default()
            }),
        );
        assert_eq!(level(&off, "ap-south/x"), 0);
    }

    #[test]
    fn failover_priority_labels_rank_before_locality() {
        let setting = LocalityLbSetting {
            failover_priority: vec!["topology.istio.io/network".into(), "version=v2".into()],
            ..Default::default()
        };
        let p = policy("us-east/a", Some(setting));
        let labels = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let here = Locality::parse("us-east/a");
        let both = labels(&[("topology.istio.io/network", "n1"), ("version", "v2")]);
        let network_only = labels(&[("topology.istio.io/network", "n1")]);
        let neither = labels(&[("topology.istio.io/network", "n2"), ("version", "v2")]);
        assert!(p.level(of(&both), &here) < p.level(of(&network_only), &here));
        assert!(p.level(of(&network_only), &here) < p.level(of(&neither), &here));
        assert!(
            p.level(of(&network_only), &Locality::parse("eu/x")) < p.level(of(&neither), &here),
            "labels before locality"
        );
    }

    #[test]
    fn distribute_shares_each_percentage_among_matching_groups() {
        let rule = LocalityDistribute {
            from: "us-east/*".into(),
            to: BTreeMap::from([("us-east/a/*".into(), 80), ("us-west/*".into(), 20)]),
        };
        let (a, w1, w2, eu) = (
            Locality::parse("us-east/a/1"),
            Locality::parse("us-west/x"),
            Locality::parse("us-west/y"),
            Locality::parse("eu/z"),
        );
        let weights = distribute(&rule, &[(&a, 3), (&w1, 1), (&w2, 1), (&eu, 5)]);
        assert_eq!(weights, [Some(80), Some(10), Some(10), None]);
        assert!(locality_match(&a, "us-east"));
        assert!(!locality_match(&a, "us-east/b"));
    }
}
