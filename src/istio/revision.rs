//! Istio's control-plane revisions (`istio.io/rev`): the name a control plane is installed under,
//! the objects named after it, and which labelled objects it reads. `""` and `default` name the
//! same revision (istio/istio pilot/pkg/bootstrap/mesh.go, pkg/config/model.go).

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use thiserror::Error;

/// The label naming the revision an object belongs to.
pub const REVISION_LABEL: &str = "istio.io/rev";
/// The label naming the tag a tag's webhook configuration (or Service) stands for.
pub const TAG_LABEL: &str = "istio.io/tag";
/// The name of the revision installed without one.
pub const DEFAULT: &str = "default";

#[derive(Debug, Error, PartialEq, Eq)]
#[error("revision {}: must be a DNS-1123 label of at most 50 characters (lowercase letters, digits, '-')", crate::text::Quoted(.0))]
pub struct RevisionError(String);

/// A revision name, `default` when none was given.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Revision(Arc<str>);

impl Default for Revision {
    fn default() -> Self {
        Self(DEFAULT.into())
    }
}

impl FromStr for Revision {
    type Err = RevisionError;

    /// Object names get `-<revision>` appended (`istio-validator-<rev>-<ns>` must stay a valid
    /// name), hence the shorter bound than a label's 63.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if text.is_empty() {
            return Ok(Self::default());
        }
        let label = text.len() <= 50
            && text
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !text.starts_with('-')
            && !text.ends_with('-');
        match label {
            true => Ok(Self(text.into())),
            false => Err(RevisionError(text.to_string())),
        }
    }
}

impl fmt::Display for Revision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Revision {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn is_default(&self) -> bool {
        &*self.0 == DEFAULT
    }

    /// `base` for the default revision, `base-<revision>` for another: the names of a revision's
    /// Deployment and Service (`istiod-canary`), mesh ConfigMap (`istio-canary`), injector.
    pub fn suffixed(&self, base: &str) -> String {
        match self.is_default() {
            true => base.to_string(),
            false => format!("{base}-{}", self.0),
        }
    }

    /// The Service proxies of this revision reach the control plane by, in `namespace`.
    pub fn service_host(&self, namespace: &str) -> String {
        format!("{}.{namespace}.svc", self.suffixed("istiod"))
    }

    /// Whether this revision reads an object with these labels (istiod's `LabelsInRevision`): an
    /// object without `istio.io/rev` is global; one with it belongs to that revision only. Tags
    /// are not revisions here, as in istiod.
    pub fn reads(&self, labels: Option<&BTreeMap<String, String>>) -> bool {
        labels
            .and_then(|l| l.get(REVISION_LABEL))
            .is_none_or(|rev| rev == self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(rev: Option<&str>) -> BTreeMap<String, String> {
        rev.map(|r| (REVISION_LABEL.to_string(), r.to_string()))
            .into_iter()
            .collect()
    }

    #[test]
    fn names_follow_istio() {
        let default: Revision = "".parse().unwrap();
        assert!(default.is_default());
        assert_eq!(default, "default".parse().unwrap());
        assert_eq!(default.suffixed("istio"), "istio");
        let canary: Revision = "1-27-canary".parse().unwrap();
        assert_eq!(canary.suffixed("istiod"), "istiod-1-27-canary");
        assert_eq!(
            canary.service_host("istio-system"),
            "istiod-1-27-canary.istio-system.svc"
        );
        for bad in ["Canary", "a_b", "-a", "x".repeat(51).as_str(), "a.b"] {
            let e = bad.parse::<Revision>().unwrap_err().to_string();
            assert!(e.contains("DNS-1123 label"), "{e}");
        }
    }

    #[test]
    fn unlabelled_config_is_global_and_labelled_config_belongs_to_one_revision() {
        let default = Revision::default();
        let canary: Revision = "canary".parse().unwrap();
        assert!(default.reads(None) && canary.reads(None));
        assert!(default.reads(Some(&labels(None))) && canary.reads(Some(&labels(None))));
        assert!(canary.reads(Some(&labels(Some("canary")))));
        assert!(!default.reads(Some(&labels(Some("canary")))));
        assert!(default.reads(Some(&labels(Some("default")))));
        assert!(!canary.reads(Some(&labels(Some("default")))));
        assert!(
            !canary.reads(Some(&labels(Some("")))),
            "an empty label names no revision we are"
        );
    }
}
