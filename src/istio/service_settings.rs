//! Mesh config `serviceSettings`, and the cluster-local hosts they make with istiod's defaults
//! (pilot/pkg/model/cluster_local.go): a cluster-local service's endpoints reach only the proxies
//! of their own cluster. By default `*.kube-system.svc.<domain>`, `kubernetes.default.svc.<domain>`
//! and the control plane's own host are; a `clusterLocal: false` entry takes a default back
//! (the host itself, or any host a default wildcard covers); the most specific entry decides
//! (an exact host before the longest wildcard), as istiod since 1.15.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::validate::{ensure, Result};

/// One entry of `serviceSettings`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ServiceSettings {
    pub settings: Settings,
    pub hosts: Vec<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Settings {
    pub cluster_local: bool,
}

impl ServiceSettings {
    /// Each host a domain name or one with a leading `*.` (or `*` alone), as istiod's
    /// `validateServiceSettings`.
    pub fn validate(&self) -> Result {
        for (i, host) in self.hosts.iter().enumerate() {
            ensure(
                wildcard_domain(host),
                &format!("hosts[{i}]"),
                format!("{host:?} is not a host name (a domain, `*.` before one, or `*`)"),
            )?;
        }
        Ok(())
    }
}

fn wildcard_domain(host: &str) -> bool {
    let name = match host.strip_prefix("*.") {
        Some(rest) => rest,
        None if host == "*" => return true,
        None => host,
    };
    let label = |l: &str| {
        (1..=63).contains(&l.len())
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    !name.is_empty() && name.len() <= 253 && name.split('.').all(label)
}

/// The cluster-local hosts in force: exact hosts and wildcards (`*.…`), each local or not.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClusterLocalHosts {
    specific: BTreeMap<String, bool>,
    /// By what a wildcard requires of a host's end (`.kube-system.svc.cluster.local`; `*` is "").
    wildcards: BTreeMap<String, bool>,
}

impl ClusterLocalHosts {
    /// istiod's defaults for `domain` and the control plane's `discovery_host` (`host:port`
    /// of the mesh's `discoveryAddress`), as `settings` amend them.
    pub fn new(settings: &[ServiceSettings], domain: &str, discovery_address: &str) -> Self {
        let mut defaults = vec![
            format!("*.kube-system.svc.{domain}"),
            format!("kubernetes.default.svc.{domain}"),
        ];
        // istiod drops this default when the address has no numeric port.
        let discovery = discovery_address
            .rsplit_once(':')
            .filter(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
        if let Some((host, _)) = discovery {
            match host.ends_with(domain) {
                true => defaults.push(host.to_string()),
                false => defaults.push(format!("{host}.{domain}")),
            }
        }
        let mut hosts = Self::default();
        for entry in settings {
            let local = entry.settings.cluster_local;
            if !local {
                defaults.retain(|default| {
                    !entry.hosts.iter().any(|h| {
                        h == default
                            || default
                                .strip_prefix('*')
                                .is_some_and(|suffix| h.ends_with(suffix))
                    })
                });
            }
            for host in &entry.hosts {
                hosts.set(host, local);
            }
        }
        for default in &defaults {
            hosts.set(default, true);
        }
        hosts
    }

    fn set(&mut self, host: &str, local: bool) {
        match host.strip_prefix('*') {
            Some(suffix) => self.wildcards.insert(suffix.to_string(), local),
            None => self.specific.insert(host.to_string(), local),
        };
    }

    /// Whether a service's endpoints reach only the proxies of their own cluster.
    pub fn is_cluster_local(&self, host: &str) -> bool {
        if let Some(local) = self.specific.get(host) {
            return *local;
        }
        let needle = host.strip_prefix('*').unwrap_or(host);
        self.wildcards
            .iter()
            .filter(|(suffix, _)| needle.ends_with(suffix.as_str()))
            .max_by_key(|(suffix, _)| suffix.len())
            .is_some_and(|(_, local)| *local)
    }

    /// Every host with its setting, for `/debug/mesh`.
    pub fn hosts(&self) -> BTreeMap<String, bool> {
        let wildcards = self.wildcards.iter().map(|(s, l)| (format!("*{s}"), *l));
        self.specific
            .iter()
            .map(|(h, l)| (h.clone(), *l))
            .chain(wildcards)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(local: bool, hosts: &[&str]) -> ServiceSettings {
        ServiceSettings {
            settings: Settings {
                cluster_local: local,
            },
            hosts: hosts.iter().map(|h| h.to_string()).collect(),
        }
    }

    const DISCOVERY: &str = "istiod.istio-system.svc:15012";

    #[test]
    fn istiod_s_defaults() {
        let hosts = ClusterLocalHosts::new(&[], "cluster.local", DISCOVERY);
        for local in [
            "kube-dns.kube-system.svc.cluster.local",
            "kubernetes.default.svc.cluster.local",
            "istiod.istio-system.svc.cluster.local",
        ] {
            assert!(hosts.is_cluster_local(local), "{local}");
        }
        assert!(!hosts.is_cluster_local("reviews.default.svc.cluster.local"));
        let no_port = ClusterLocalHosts::new(&[], "cluster.local", "istiod.istio-system.svc");
        assert!(!no_port.is_cluster_local("istiod.istio-system.svc.cluster.local"));
    }

    #[test]
    fn settings_add_hosts_and_take_defaults_back() {
        let settings = [
            entry(true, &["*.sample.svc.cluster.local"]),
            entry(false, &["helloworld.sample.svc.cluster.local"]),
            entry(false, &["kube-dns.kube-system.svc.cluster.local"]),
        ];
        let hosts = ClusterLocalHosts::new(&settings, "cluster.local", DISCOVERY);
        assert!(hosts.is_cluster_local("sleep.sample.svc.cluster.local"));
        // The most specific entry decides (istiod since 1.15).
        assert!(!hosts.is_cluster_local("helloworld.sample.svc.cluster.local"));
        // A host a default wildcard covers takes the whole default back.
        assert!(!hosts.is_cluster_local("metrics-server.kube-system.svc.cluster.local"));
        assert!(hosts.is_cluster_local("kubernetes.default.svc.cluster.local"));
        let everything = ClusterLocalHosts::new(&[entry(true, &["*"])], "cluster.local", "");
        assert!(everything.is_cluster_local("anything.example.com"));
    }

    #[test]
    fn hosts_are_domains_or_wildcards() {
        assert!(entry(true, &["*", "*.a.b", "a-1.b"]).validate().is_ok());
        for bad in ["bad_host!", "a.*.b", "", "-a.b"] {
            assert!(entry(true, &[bad]).validate().is_err(), "{bad}");
        }
    }
}
