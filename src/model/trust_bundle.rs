//! The workload trust bundle: every root a proxy's agent adds to the mesh's own, sent over PCDS
//! when the installation distributes extra roots (`--multiroot-mesh`). Its parts are istiod's
//! sources (pilot/pkg/trustbundle/trustbundle.go): the CA's roots, the mesh config's
//! `caCertificates` PEMs, and the roots fetched from their SPIFFE bundle endpoints.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TrustBundle {
    /// The CA's roots, a PEM block each (during a root rotation, the old one too).
    pub ca: Vec<String>,
    /// The mesh config's `caCertificates[].pem`, a PEM block each.
    pub mesh: Vec<String>,
    /// Each SPIFFE bundle endpoint of the mesh config, by URL.
    pub spiffe: BTreeMap<String, SpiffeBundle>,
}

/// What is known of one SPIFFE bundle endpoint.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SpiffeBundle {
    /// The mesh trust domain's X.509 roots of the last good fetch, a PEM block each; kept while
    /// refreshes fail.
    pub roots: Vec<String>,
    /// RFC 3339, of the last good fetch.
    pub fetched_at: Option<String>,
    /// Why the last fetch failed, if it did.
    pub error: Option<String>,
}

impl TrustBundle {
    /// Every root once, sorted: what proxies are sent (istiod's `mergeInternal`).
    pub fn roots(&self) -> Vec<String> {
        let spiffe = self.spiffe.values().flat_map(|b| &b.roots);
        let all: BTreeSet<&String> = self.ca.iter().chain(&self.mesh).chain(spiffe).collect();
        all.into_iter().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roots_are_merged_once_and_sorted() {
        let bundle = TrustBundle {
            ca: vec!["c".into(), "a".into()],
            mesh: vec!["b".into(), "a".into()],
            spiffe: BTreeMap::from([(
                "https://bundle.example".into(),
                SpiffeBundle {
                    roots: vec!["d".into(), "b".into()],
                    ..Default::default()
                },
            )]),
        };
        assert_eq!(bundle.roots(), ["a", "b", "c", "d"]);
    }
}
