//! Who manages a Gateway API object (deploys a Gateway, writes its status) while istiod and
//! meshpilot revisions run side by side. A running istiod acts on whatever its `IsMine` claims
//! (istio/istio pkg/revisions/tag_watcher.go), and revision `default` (an unrevisioned istiod: the
//! chart's `REVISION` defaults to it, manifests/charts/istio-control/istio-discovery/templates/
//! deployment.yaml) claims every object naming no revision whatever the `default` tag says. istiod
//! yields to no one, so meshpilot yields whatever a running istiod claims; among its own revisions
//! it keeps one owner: the revision the object names, else its namespace's, else the `default`
//! tag's target, else the default revision.
//!
//! Pure: meshpilot's leader, `doctor` and the tests decide from the same plain inputs.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use tokio::time::Instant;

use crate::istio::revision::{DEFAULT, REVISION_LABEL};
use crate::istio::ConfigKey;
use crate::model::ClusterId;

/// Everything the decision reads, as listed on the config cluster.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Inputs {
    /// (tag, revision) of every MutatingWebhookConfiguration, and every Service of the system
    /// namespace, labelled `istio.io/tag` and `istio.io/rev`.
    pub tags: BTreeSet<(String, String)>,
    /// `istio-revision-tag-default`'s `istio.io/rev`, when it exists ("" when unlabelled).
    pub default_tag: Option<String>,
    /// `istiod-default-validator`'s `istio.io/rev`, when it exists ("" when unlabelled).
    pub default_validator: Option<String>,
    /// Namespaces' `istio.io/rev` labels.
    pub namespaces: BTreeMap<String, String>,
    /// The istiod revisions running, each with what shows it (a pod, a held Lease).
    pub istiods: BTreeMap<String, String>,
    /// The meshpilot revisions running (holding their leader Lease).
    pub meshpilots: BTreeSet<String>,
}

/// The revision an object asks for, and where it says so.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Selected<'a> {
    /// Its own `istio.io/rev` label.
    Object(&'a str),
    /// Its namespace's label ("" for none).
    Namespace(&'a str, &'a str),
    /// A cluster-scoped object naming none: every control plane's, as in istiod (no namespace to
    /// ask).
    Everyone,
}

impl Selected<'_> {
    fn revision(&self) -> Option<&str> {
        match self {
            Self::Object(rev) | Self::Namespace(_, rev) => Some(rev),
            Self::Everyone => None,
        }
    }
}

/// Who manages an object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Owner {
    Istiod(String),
    Meshpilot(String),
    /// Two running istiods both claim it (istio/istio issue 54280): they fight, and meshpilot
    /// stays out.
    Istiods(Vec<String>),
    Nobody,
}

/// An object from one meshpilot revision's point of view.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Claim {
    Mine,
    /// Another running control plane manages it (or two fight over it).
    Other,
    Nobody,
}

impl Inputs {
    /// The revision an object asks for: its `istio.io/rev` label (even empty), else its
    /// namespace's.
    pub fn selected<'a>(
        &'a self,
        labels: &'a BTreeMap<String, String>,
        namespace: &'a str,
    ) -> Selected<'a> {
        match labels.get(REVISION_LABEL) {
            Some(rev) => Selected::Object(rev),
            None if namespace.is_empty() => Selected::Everyone,
            // A namespace not listed carries no label: istiod would find it, unlabelled.
            None => Selected::Namespace(
                namespace,
                self.namespaces.get(namespace).map_or("", String::as_str),
            ),
        }
    }

    /// A revision's name and every tag pointing at it (istiod's `GetMyTags`).
    pub fn tags_of<'a>(&'a self, revision: &'a str) -> BTreeSet<&'a str> {
        let tags = self.tags.iter().filter(|(_, rev)| rev == revision);
        let mut mine: BTreeSet<&str> = tags.map(|(tag, _)| tag.as_str()).collect();
        mine.insert(revision);
        mine
    }

    /// Whether istiod of `revision` claims the object: its `IsMine`, as in
    /// pkg/revisions/tag_watcher.go (istio 1.28).
    pub fn istiod_claims(&self, revision: &str, selected: Selected<'_>) -> bool {
        let Some(selected) = selected.revision() else {
            return true;
        };
        let mine = self.tags_of(revision);
        let other_default_tag = !mine.contains(DEFAULT) && self.default_tag.is_some();
        let default_revision = self.default_validator.as_deref() == Some(revision);
        mine.contains(selected)
            || selected.is_empty()
                && (mine.contains(DEFAULT) || default_revision && !other_default_tag)
    }

    /// Whether meshpilot of `revision` claims the object among meshpilot revisions: one owner
    /// for an object naming none (or `default`), where istiod lets both the unrevisioned istiod and
    /// the tag's target claim it.
    pub fn meshpilot_claims(&self, revision: &str, selected: Selected<'_>) -> bool {
        let Some(selected) = selected.revision() else {
            return true;
        };
        if !(selected.is_empty() || selected == DEFAULT) {
            return self.tags_of(revision).contains(selected);
        }
        match (self.default_tag.as_deref()).filter(|t| !t.is_empty()) {
            Some(target) => target == revision,
            // meshpilot's own installs render no validator: then `default` is the default.
            None => match &self.default_validator {
                Some(validator) => validator == revision,
                None => revision == DEFAULT,
            },
        }
    }

    /// The running istiods that claim the object.
    pub fn claiming_istiods(&self, selected: Selected<'_>) -> Vec<String> {
        (self.istiods.keys())
            .filter(|rev| self.istiod_claims(rev, selected))
            .cloned()
            .collect()
    }

    /// Who manages the object: the one running istiod claiming it, else the running meshpilot
    /// revision claiming it.
    pub fn owner(&self, labels: &BTreeMap<String, String>, namespace: &str) -> Owner {
        let selected = self.selected(labels, namespace);
        let mut istiods = self.claiming_istiods(selected);
        match istiods.len() {
            0 => (self.meshpilots.iter())
                .find(|rev| self.meshpilot_claims(rev, selected))
                .map_or(Owner::Nobody, |rev| Owner::Meshpilot(rev.clone())),
            1 => Owner::Istiod(istiods.remove(0)),
            _ => Owner::Istiods(istiods),
        }
    }

    /// The object from meshpilot `revision`'s point of view (it must be among `meshpilots`).
    pub fn claim(
        &self,
        revision: &str,
        labels: &BTreeMap<String, String>,
        namespace: &str,
    ) -> Claim {
        match self.owner(labels, namespace) {
            Owner::Meshpilot(rev) if rev == revision => Claim::Mine,
            Owner::Nobody => Claim::Nobody,
            _ => Claim::Other,
        }
    }

    /// A digest of everything the decision reads: work done per owned object is redone when it
    /// changes (a tag moved, a namespace relabelled, a control plane started or stopped).
    pub fn digest(&self) -> u64 {
        crate::text::stable_hash(&format!("{self:?}"))
    }
}

/// Whose objects a pass over the owned Gateway objects writes (their status, their deployments).
pub struct Scope<'a> {
    pub cluster: &'a ClusterId,
    pub owners: &'a Inputs,
    pub revision: &'a str,
}

/// How such a pass ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ended {
    Done,
    /// Every write went through, but some object waits for its handover.
    Waiting,
    Failed,
}

impl Ended {
    pub fn of(all_written: bool, waiting: bool) -> Self {
        match (all_written, waiting) {
            (false, _) => Ended::Failed,
            (true, true) => Ended::Waiting,
            (true, false) => Ended::Done,
        }
    }
}

/// What to do with an object this pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Turn {
    Write,
    /// Ours, but another control plane claimed it within the handover delay.
    Wait,
    /// Not ours: leave it, and forget what was written (the next owner may overwrite it).
    Leave,
}

/// Orders a handover: the control plane letting an object go reacts to the same change (a
/// namespace relabelled, istiod gone) on its own clock, so an object another one claimed is
/// written only once it has been ours for the delay. Letting go is immediate.
pub struct Handover {
    delay: Duration,
    /// Objects another control plane claimed, and since when they are ours again if they are.
    claimed: HashMap<ConfigKey, Option<Instant>>,
}

impl Handover {
    pub fn new(delay: Duration) -> Self {
        Self {
            delay,
            claimed: HashMap::new(),
        }
    }

    /// Forgets objects that are gone.
    pub fn retain(&mut self, present: impl Fn(&ConfigKey) -> bool) {
        self.claimed.retain(|key, _| present(key));
    }

    pub fn turn(&mut self, key: &ConfigKey, claim: Claim) -> Turn {
        match claim {
            Claim::Other => {
                self.claimed.insert(key.clone(), None);
                Turn::Leave
            }
            Claim::Nobody => Turn::Leave,
            Claim::Mine => match self.claimed.get_mut(key) {
                None => Turn::Write,
                Some(since) => {
                    let since = *since.get_or_insert_with(Instant::now);
                    if since.elapsed() < self.delay {
                        return Turn::Wait;
                    }
                    self.claimed.remove(key);
                    Turn::Write
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::istio::ConfigKind;

    fn inputs(tags: &[(&str, &str)], default_tag: Option<&str>, validator: Option<&str>) -> Inputs {
        Inputs {
            tags: (tags.iter())
                .map(|(t, r)| (t.to_string(), r.to_string()))
                .collect(),
            default_tag: default_tag.map(str::to_string),
            default_validator: validator.map(str::to_string),
            namespaces: BTreeMap::from([
                ("shop".to_string(), "canary".to_string()),
                ("pinned".to_string(), "default".to_string()),
            ]),
            ..Default::default()
        }
    }

    fn labels(rev: Option<&str>) -> BTreeMap<String, String> {
        rev.map(|r| (REVISION_LABEL.to_string(), r.to_string()))
            .into_iter()
            .collect()
    }

    #[test]
    fn istiod_default_claims_every_unlabelled_object_wherever_the_tag_points() {
        let tag_to_canary = inputs(&[("default", "canary")], Some("canary"), Some("canary"));
        let no_tag = inputs(&[], None, Some("default"));
        let tag_to_default = inputs(&[("default", "default")], Some("default"), Some("default"));
        let none = BTreeMap::new();
        for cluster in [&tag_to_canary, &no_tag, &tag_to_default] {
            let plain = cluster.selected(&none, "plain");
            let pinned = cluster.selected(&none, "pinned");
            assert!(cluster.istiod_claims("default", plain), "{cluster:?}");
            assert!(cluster.istiod_claims("default", pinned), "{cluster:?}");
            let shop = cluster.selected(&none, "shop");
            assert!(!cluster.istiod_claims("default", shop), "{cluster:?}");
        }
        // The object's label beats its namespace's, even when empty.
        let empty = labels(Some(""));
        let own = tag_to_canary.selected(&empty, "shop");
        assert_eq!(own, Selected::Object(""));
        assert!(tag_to_canary.istiod_claims("default", own));
        assert!(tag_to_canary.istiod_claims("default", Selected::Everyone));
    }

    #[test]
    fn a_named_istiod_claims_unlabelled_objects_through_the_tag_or_the_validator() {
        let plain = Selected::Namespace("plain", "");
        // The default tag points at it.
        let tagged = inputs(&[("default", "1-27")], Some("1-27"), None);
        assert!(tagged.istiod_claims("1-27", plain));
        assert!(tagged.istiod_claims("1-27", Selected::Object("default")));
        // The default tag points elsewhere: the validator no longer counts.
        let elsewhere = inputs(&[("default", "canary")], Some("canary"), Some("1-27"));
        assert!(!elsewhere.istiod_claims("1-27", plain));
        // No tag: the validator names the default revision.
        let validator = inputs(&[], None, Some("1-27"));
        assert!(validator.istiod_claims("1-27", plain));
        assert!(!validator.istiod_claims("1-27", Selected::Object("default")));
        // A tag of its own, from a webhook or a Service.
        let own_tag = inputs(&[("prod", "1-27")], None, None);
        assert!(own_tag.istiod_claims("1-27", Selected::Object("prod")));
        assert!(!own_tag.istiod_claims("1-27", plain));
    }

    #[test]
    fn a_running_istiod_owns_what_it_claims_and_meshpilot_the_rest() {
        let mut cluster = inputs(&[("default", "canary")], Some("canary"), Some("canary"));
        cluster.meshpilots.insert("canary".into());
        cluster
            .istiods
            .insert("default".into(), "pod istiod-1".into());
        let owner = |c: &Inputs, rev: Option<&str>, ns: &str| c.owner(&labels(rev), ns);
        assert_eq!(
            owner(&cluster, None, "plain"),
            Owner::Istiod("default".into())
        );
        assert_eq!(
            owner(&cluster, None, "pinned"),
            Owner::Istiod("default".into())
        );
        assert_eq!(
            owner(&cluster, None, "shop"),
            Owner::Meshpilot("canary".into())
        );
        assert_eq!(
            owner(&cluster, Some("canary"), "plain"),
            Owner::Meshpilot("canary".into())
        );
        assert_eq!(
            cluster.claim("canary", &labels(None), "plain"),
            Claim::Other
        );
        // istiod gone: the tag's target takes them.
        cluster.istiods.clear();
        assert_eq!(
            owner(&cluster, None, "plain"),
            Owner::Meshpilot("canary".into())
        );
        assert_eq!(
            owner(&cluster, None, "pinned"),
            Owner::Meshpilot("canary".into())
        );
        // Two istiods claiming one object: nobody of meshpilot's.
        cluster.istiods.insert("default".into(), "pod a".into());
        cluster.istiods.insert("canary".into(), "pod b".into());
        assert_eq!(
            owner(&cluster, None, "plain"),
            Owner::Istiods(vec!["canary".into(), "default".into()])
        );
        // A revision nobody runs.
        assert_eq!(owner(&cluster, Some("1-20"), "plain"), Owner::Nobody);
    }

    #[test]
    fn among_meshpilots_one_owns_an_unlabelled_object() {
        let mut no_validator = inputs(&[], None, None);
        no_validator.meshpilots = ["canary".to_string(), "default".to_string()].into();
        let none = BTreeMap::new();
        let plain = no_validator.selected(&none, "plain");
        assert!(no_validator.meshpilot_claims("default", plain));
        assert!(!no_validator.meshpilot_claims("canary", plain));
        let mut tagged = no_validator.clone();
        tagged.default_tag = Some("canary".into());
        assert!(tagged.meshpilot_claims("canary", plain));
        assert!(!tagged.meshpilot_claims("default", plain));
        assert_eq!(
            tagged.owner(&BTreeMap::new(), "plain"),
            Owner::Meshpilot("canary".into())
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_object_another_claimed_is_written_once_ours_for_the_delay() {
        let key = ConfigKey {
            kind: ConfigKind::KubernetesGateway,
            namespace: "plain".into(),
            name: "front".into(),
        };
        let delay = Duration::from_secs(30);
        let mut handover = Handover::new(delay);
        assert_eq!(handover.turn(&key, Claim::Mine), Turn::Write);
        assert_eq!(handover.turn(&key, Claim::Other), Turn::Leave);
        // Claimed by the other for long: the delay counts from when it let go.
        tokio::time::advance(delay * 2).await;
        assert_eq!(handover.turn(&key, Claim::Mine), Turn::Wait);
        tokio::time::advance(delay / 2).await;
        assert_eq!(handover.turn(&key, Claim::Mine), Turn::Wait);
        tokio::time::advance(delay / 2).await;
        assert_eq!(handover.turn(&key, Claim::Mine), Turn::Write);
        assert_eq!(handover.turn(&key, Claim::Mine), Turn::Write);
        assert_eq!(handover.turn(&key, Claim::Nobody), Turn::Leave);
        handover.turn(&key, Claim::Other);
        handover.retain(|_| false);
        assert!(handover.claimed.is_empty());
    }
}
