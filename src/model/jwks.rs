//! Keys fetched for RequestAuthentications (from `jwksUri`, or by OpenID discovery from the issuer):
//! part of the snapshot, so a listener is built from the keys that go with its policies.

use std::sync::Arc;

use serde::Serialize;

use super::policies::JwksSource;
use crate::istio::security::jwks;
use crate::istio::security::request::JwtRule;

#[derive(Clone, Debug, Default, PartialEq)]
pub struct JwksTable {
    entries: imbl::OrdMap<JwksSource, Arc<JwksEntry>>,
}

/// What is known of one key source.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct JwksEntry {
    /// The last key set fetched; kept while refreshes fail.
    pub keys: Option<Arc<str>>,
    /// Where the keys were fetched from (the discovered URI, for an issuer).
    pub uri: Option<String>,
    /// RFC 3339, of the last successful fetch.
    pub fetched_at: Option<String>,
    /// Why the last fetch failed, if it did.
    pub error: Option<String>,
}

impl JwksTable {
    pub fn get(&self, source: &JwksSource) -> Option<&Arc<JwksEntry>> {
        self.entries.get(source)
    }

    pub fn insert(&mut self, source: JwksSource, entry: JwksEntry) {
        self.entries.insert(source, Arc::new(entry));
    }

    pub fn retain(&mut self, keep: impl Fn(&JwksSource) -> bool) {
        let gone: Vec<JwksSource> = self.entries.keys().filter(|s| !keep(s)).cloned().collect();
        for source in gone {
            self.entries.remove(&source);
        }
    }

    /// The key set Envoy gets for a rule: its inline keys, else the fetched ones, else a set no
    /// token verifies against (the listener loads; tokens fail until the keys arrive).
    pub fn keys_for<'a>(&'a self, rule: &'a JwtRule) -> &'a str {
        match JwksSource::of(rule) {
            None => &rule.jwks,
            Some(source) => self
                .get(&source)
                .and_then(|e| e.keys.as_deref())
                .unwrap_or(jwks::UNUSABLE),
        }
    }
}
