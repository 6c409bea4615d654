//! DestinationRule lookup as istiod does it: indexed by namespace and host, looked up per proxy
//! (its namespace and labels) and service, rules for one host merged oldest first.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use super::derived::{oldest_first, Derived};
use super::ConfigStore;
use crate::istio::{ConfigKey, ConfigKind, ConfigObject, DestinationRule, Spec};

/// One namespace's DestinationRules by fully qualified host, each list oldest first (istiod's
/// order for merging): a lookup per cluster must not scan every rule of the mesh.
#[derive(Debug, Default)]
pub(super) struct NamespaceRules {
    exact: HashMap<String, Vec<Arc<ConfigObject>>>,
    /// Rules for `*` or `*.suffix`, with that host.
    wildcard: Vec<(String, Arc<ConfigObject>)>,
    /// Whether a rule here has a `workloadSelector` (which proxies of this namespace then get
    /// depends on their labels).
    selecting: bool,
}

/// DestinationRules by namespace, indexed by host, oldest first.
pub(super) fn index(store: &ConfigStore) -> BTreeMap<Arc<str>, NamespaceRules> {
    let mut rules: Vec<Arc<ConfigObject>> = store
        .of_kind(ConfigKind::DestinationRule)
        .cloned()
        .collect();
    rules.sort_by(oldest_first);
    let mut destination_rules: BTreeMap<Arc<str>, NamespaceRules> = BTreeMap::new();
    for object in rules {
        let Spec::DestinationRule(dr) = &object.spec else {
            continue;
        };
        let host = store.qualify(&dr.host, &object.key.namespace);
        let indexed = destination_rules
            .entry(object.key.namespace.clone())
            .or_default();
        indexed.selecting |= dr.workload_selector.is_some();
        match host.starts_with('*') {
            true => indexed.wildcard.push((host, object.clone())),
            false => indexed.exact.entry(host).or_default().push(object.clone()),
        }
    }
    destination_rules
}

impl ConfigStore {
    /// Whether any DestinationRule exists (cluster lists then depend on the proxy's namespace).
    pub fn has_destination_rules(&self) -> bool {
        !self.derived().destination_rules.is_empty()
    }

    /// Whether a DestinationRule of `namespace` selects workloads (its proxies' rules then depend
    /// on their labels).
    pub fn rules_select_in(&self, namespace: &str) -> bool {
        let rules = self.derived().destination_rules.get(namespace);
        rules.is_some_and(|r| r.selecting)
    }

    /// The DestinationRule a proxy in `proxy_ns` applies to `host` (of a service in `service_ns`),
    /// as istiod looks it up: the proxy's namespace first, then the service's, then the root
    /// namespace; only rules exported to the proxy's namespace; the most specific host wins within a
    /// namespace, and several rules for the same host merge (oldest first).
    /// `proxy_labels` are asked for only where a rule of its namespace selects workloads.
    pub fn destination_rule<'l>(
        &self,
        proxy_ns: &str,
        proxy_labels: impl FnOnce() -> &'l BTreeMap<String, String>,
        host: &str,
        service_ns: &str,
    ) -> Option<Arc<AppliedRule>> {
        let derived = self.derived();
        if let Some(selected) = self.selected_rule(derived, proxy_ns, proxy_labels, host) {
            return Some(selected);
        }
        let root = self.mesh.root_namespace.as_str();
        [proxy_ns, service_ns, root]
            .into_iter()
            .find_map(|ns| self.rule_in(derived, ns, proxy_ns, host))
    }

    /// As istiod's `SidecarScope.DestinationRule` (pilot/pkg/model/sidecar.go): a rule with a
    /// `workloadSelector` applies only to proxies of its own namespace whose labels it selects,
    /// and before any rule without one; the oldest such rule wins, alone.
    fn selected_rule<'l>(
        &self,
        derived: &Derived,
        proxy_ns: &str,
        proxy_labels: impl FnOnce() -> &'l BTreeMap<String, String>,
        host: &str,
    ) -> Option<Arc<AppliedRule>> {
        if !derived.destination_rules.get(proxy_ns)?.selecting {
            return None;
        }
        let proxy_labels = proxy_labels();
        let selects = |object: &ConfigObject| match &object.spec {
            Spec::DestinationRule(dr) => dr
                .workload_selector
                .as_ref()
                .is_some_and(|s| s.matches(proxy_labels)),
            _ => false,
        };
        let first = self
            .matching_rules(derived, proxy_ns, proxy_ns, host, selects)
            .into_iter()
            .next()?;
        Some(Arc::new(AppliedRule::of([first])))
    }

    /// The rules without a `workloadSelector` of `ns` for `host`, merged.
    fn rule_in(
        &self,
        derived: &Derived,
        ns: &str,
        proxy_ns: &str,
        host: &str,
    ) -> Option<Arc<AppliedRule>> {
        let unselective = |object: &ConfigObject| match &object.spec {
            Spec::DestinationRule(dr) => dr.workload_selector.is_none(),
            _ => false,
        };
        let matching = self.matching_rules(derived, ns, proxy_ns, host, unselective);
        (!matching.is_empty()).then(|| Arc::new(AppliedRule::of(matching)))
    }

    /// The rules of `ns` that `keep` keeps, exported to `proxy_ns`, for `host`: an exact host beats
    /// every wildcard; among wildcards the longest suffix wins. Oldest first.
    fn matching_rules<'d>(
        &self,
        derived: &'d Derived,
        ns: &str,
        proxy_ns: &str,
        host: &str,
        keep: impl Fn(&ConfigObject) -> bool,
    ) -> Vec<&'d Arc<ConfigObject>> {
        let Some(rules) = derived.destination_rules.get(ns) else {
            return Vec::new();
        };
        let wanted = |o: &&Arc<ConfigObject>| self.exported_to(o, proxy_ns) && keep(o);
        let exact: Vec<&Arc<ConfigObject>> = rules
            .exact
            .get(host)
            .into_iter()
            .flatten()
            .filter(wanted)
            .collect();
        if !exact.is_empty() {
            return exact;
        }
        let wildcards: Vec<(usize, &Arc<ConfigObject>)> = rules
            .wildcard
            .iter()
            .filter(|(_, o)| wanted(&o))
            .filter_map(|(rule_host, o)| Some((host_match(rule_host, host)?, o)))
            .collect();
        let Some(best) = wildcards.iter().map(|(m, _)| *m).max() else {
            return Vec::new();
        };
        wildcards
            .into_iter()
            .filter(|(m, _)| *m == best)
            .map(|(_, o)| o)
            .collect()
    }
}

/// The DestinationRule that applies, merged from one or more objects.
#[derive(Clone, Debug, PartialEq)]
pub struct AppliedRule {
    /// The objects it came from, oldest first.
    pub keys: Vec<ConfigKey>,
    pub rule: DestinationRule,
}

impl AppliedRule {
    /// `rules` merged, oldest first.
    fn of<'r>(rules: impl IntoIterator<Item = &'r Arc<ConfigObject>>) -> Self {
        let mut applied = AppliedRule {
            keys: Vec::new(),
            rule: DestinationRule::default(),
        };
        for object in rules {
            if let Spec::DestinationRule(dr) = &object.spec {
                applied.merge(&object.key, dr);
            }
        }
        applied
    }

    /// istiod's merge of rules for one host: the first traffic policy wins, subsets add up (the
    /// first of a name wins).
    fn merge(&mut self, key: &ConfigKey, dr: &DestinationRule) {
        if self.keys.is_empty() {
            self.rule = dr.clone();
        } else {
            if self.rule.traffic_policy.is_none() {
                self.rule.traffic_policy = dr.traffic_policy.clone();
            }
            for subset in &dr.subsets {
                if !self.rule.subsets.iter().any(|s| s.name == subset.name) {
                    self.rule.subsets.push(subset.clone());
                }
            }
        }
        self.keys.push(key.clone());
    }
}

/// How specifically a rule's host matches a service host: exact beats any wildcard, longer
/// wildcards beat shorter ones.
fn host_match(rule_host: &str, host: &str) -> Option<usize> {
    if rule_host == host {
        return Some(usize::MAX);
    }
    if rule_host == "*" {
        return Some(0);
    }
    let suffix = rule_host.strip_prefix('*')?;
    host.ends_with(suffix).then_some(suffix.len())
}
