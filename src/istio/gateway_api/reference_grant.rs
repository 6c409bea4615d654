//! ReferenceGrant: which kinds of which namespaces may refer to objects of the grant's namespace.

use serde::{Deserialize, Serialize};

use super::super::validate::{ensure, Result};
use super::each;

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ReferenceGrant {
    pub from: Vec<GrantFrom>,
    pub to: Vec<GrantTo>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct GrantFrom {
    pub group: String,
    pub kind: String,
    pub namespace: String,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct GrantTo {
    pub group: String,
    pub kind: String,
    /// One object; all of the kind when unset.
    pub name: Option<String>,
}

impl ReferenceGrant {
    pub fn validate(&self) -> Result {
        ensure(!self.from.is_empty(), "from", "at least one entry")?;
        ensure(!self.to.is_empty(), "to", "at least one entry")?;
        each("from", &self.from, |f| {
            ensure(!f.kind.is_empty(), "kind", "must be set")?;
            ensure(!f.namespace.is_empty(), "namespace", "must be set")
        })?;
        each("to", &self.to, |t| {
            ensure(!t.kind.is_empty(), "kind", "must be set")
        })
    }

    /// Whether an object of `from_kind` (`from_group`) in `from_ns` may refer to the object of
    /// `to_kind` (`to_group`) named `to_name` in the grant's namespace.
    pub fn allows(
        &self,
        (from_group, from_kind, from_ns): (&str, &str, &str),
        (to_group, to_kind, to_name): (&str, &str, &str),
    ) -> bool {
        self.from
            .iter()
            .any(|f| f.group == from_group && f.kind == from_kind && f.namespace == from_ns)
            && self.to.iter().any(|t| {
                t.group == to_group
                    && t.kind == to_kind
                    && t.name.as_deref().is_none_or(|n| n == to_name)
            })
    }
}
