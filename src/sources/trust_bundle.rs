//! The trust bundle kept current from its sources, as istiod's pilot/pkg/trustbundle does under
//! `ISTIO_MULTIROOT_MESH`: the CA's roots as they rotate, the mesh config's `caCertificates` as it
//! changes, and the roots its SPIFFE bundle endpoints serve for the mesh's trust domain, fetched
//! when the mesh config names them and every refresh interval after (pkg/spiffe/spiffe.go
//! `RetrieveSpiffeBundleRootCerts`: the `x509-svid` keys, one certificate each). Where istiod drops
//! an endpoint's roots when a fetch fails until its next poll, meshpilot keeps the last good ones
//! and retries with backoff; the error shows on /debug/mesh.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use serde::Deserialize;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{info, warn};

use super::web_fetch::{get, http_client, retry_after, sleep_until, HttpClient};
use crate::aggregate::Aggregate;
use crate::istio::{trust_anchor, MeshConfig};
use crate::model::{SpiffeBundle, TrustBundle};

#[derive(Clone, Copy, Debug)]
pub struct TrustBundleOptions {
    /// How often SPIFFE bundles are fetched again (istiod: 30 minutes).
    pub refresh: Duration,
    /// How long one fetch may take (istiod: 10 seconds).
    pub timeout: Duration,
}

/// Keeps the snapshot's trust bundle current until the process ends.
pub fn start(
    aggregate: Arc<Aggregate>,
    ca_roots: watch::Receiver<String>,
    options: TrustBundleOptions,
) -> JoinHandle<()> {
    tokio::spawn(run(aggregate, ca_roots, options))
}

/// When each endpoint is due again, and how many fetches in a row failed.
#[derive(Default)]
struct Schedule {
    due: BTreeMap<String, Instant>,
    failures: BTreeMap<String, u32>,
}

async fn run(
    aggregate: Arc<Aggregate>,
    mut ca_roots: watch::Receiver<String>,
    options: TrustBundleOptions,
) {
    let client = http_client();
    let mut mesh_config = aggregate.mesh_config();
    let mut schedule = Schedule::default();
    let mut bundles: BTreeMap<String, SpiffeBundle> = BTreeMap::new();
    loop {
        let mesh = mesh_config.borrow_and_update().clone();
        let urls = bundle_urls(&mesh);
        bundles.retain(|url, _| urls.contains(url));
        schedule.due.retain(|url, _| urls.contains(url));
        schedule.failures.retain(|url, _| urls.contains(url));
        let now = Instant::now();
        let due: Vec<&String> = urls
            .iter()
            .filter(|url| schedule.due.get(*url).is_none_or(|at| *at <= now))
            .collect();
        let fetched = futures::future::join_all(
            due.iter()
                .map(|url| fetch(&client, url, &mesh.trust_domain, options.timeout)),
        )
        .await;
        for (url, result) in due.into_iter().zip(fetched) {
            let bundle = bundles.entry(url.clone()).or_default();
            match result {
                Ok(roots) => {
                    schedule.failures.remove(url);
                    schedule.due.insert(url.clone(), now + options.refresh);
                    if bundle.roots != roots {
                        info!(%url, roots = roots.len(), "SPIFFE bundle fetched");
                    }
                    *bundle = SpiffeBundle {
                        roots,
                        fetched_at: Some(
                            humantime::format_rfc3339_seconds(std::time::SystemTime::now())
                                .to_string(),
                        ),
                        error: None,
                    };
                }
                Err(error) => {
                    let failures = schedule.failures.entry(url.clone()).or_default();
                    *failures = failures.saturating_add(1);
                    let backoff = retry_after(*failures, options.refresh);
                    schedule.due.insert(url.clone(), now + backoff);
                    warn!(%url, %error, retry_in = ?backoff, "SPIFFE bundle not fetched; keeping its last good roots");
                    bundle.error = Some(error);
                }
            }
        }
        let bundle = TrustBundle {
            ca: split(&ca_roots.borrow_and_update()),
            mesh: mesh
                .ca_certificates
                .iter()
                .flat_map(|entry| split(&entry.pem))
                .collect(),
            spiffe: bundles.clone(),
        };
        if aggregate.set_trust_bundle(bundle) {
            info!("trust bundle changed; pushing every proxy");
        }
        let next = schedule.due.values().min().copied();
        tokio::select! {
            changed = mesh_config.changed() => if changed.is_err() { return },
            changed = ca_roots.changed() => if changed.is_err() { return },
            _ = sleep_until(next) => {}
        }
    }
}

/// The mesh config's SPIFFE bundle endpoints (an entry names a PEM or an endpoint, not both).
fn bundle_urls(mesh: &MeshConfig) -> BTreeSet<String> {
    mesh.ca_certificates
        .iter()
        .filter(|entry| !entry.spiffe_bundle_url.is_empty())
        .map(|entry| entry.bundle_url())
        .collect()
}

/// A PEM's CA certificates, one block each. The mesh config's were checked when it was accepted,
/// the CA's are its own: anything else is left out.
fn split(pem: &str) -> Vec<String> {
    if pem.is_empty() {
        return Vec::new();
    }
    trust_anchor::ca_certificates(pem).unwrap_or_default()
}

/// A SPIFFE bundle (RFC 7517 key set): the `x509-svid` keys, a certificate each.
#[derive(Deserialize)]
struct BundleDocument {
    #[serde(default)]
    keys: Vec<BundleKey>,
}

#[derive(Deserialize)]
struct BundleKey {
    #[serde(default, rename = "use")]
    key_use: String,
    #[serde(default)]
    x5c: Vec<String>,
}

/// The roots `url` serves for `trust_domain`, each a CA certificate, as PEM.
async fn fetch(
    client: &HttpClient,
    url: &str,
    trust_domain: &str,
    timeout: Duration,
) -> Result<Vec<String>, String> {
    let document = get(client, url, timeout).await?;
    roots_of(&document).map_err(|e| format!("{url} (trust domain {trust_domain}): {e}"))
}

fn roots_of(document: &str) -> Result<Vec<String>, String> {
    let document: BundleDocument = serde_json::from_str(document)
        .map_err(|e| format!("not a SPIFFE bundle: {}", crate::text::clip(&e.to_string())))?;
    let mut roots = Vec::new();
    for (i, key) in document.keys.iter().enumerate() {
        if key.key_use != "x509-svid" {
            continue;
        }
        let [certificate] = key.x5c.as_slice() else {
            return Err(format!(
                "keys[{i}]: an x509-svid key holds one certificate, not {}",
                key.x5c.len()
            ));
        };
        let der = base64::engine::general_purpose::STANDARD
            .decode(certificate)
            .map_err(|e| format!("keys[{i}].x5c[0]: {e}"))?;
        roots.push(trust_anchor::ca_certificate(&der).map_err(|e| format!("keys[{i}]: {e}"))?);
    }
    if roots.is_empty() {
        return Err("no x509-svid key".into());
    }
    Ok(roots)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn certificate(ca: bool) -> rcgen::Certificate {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        if ca {
            params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        }
        params
            .self_signed(&rcgen::KeyPair::generate().unwrap())
            .unwrap()
    }

    fn x5c(cert: &rcgen::Certificate) -> String {
        base64::engine::general_purpose::STANDARD.encode(cert.der())
    }

    #[test]
    fn a_bundle_gives_its_x509_svid_roots() {
        let root = certificate(true);
        let document = serde_json::json!({
            "spiffe_sequence": 1,
            "keys": [
                {"use": "jwt-svid", "kty": "EC", "kid": "k"},
                {"use": "x509-svid", "kty": "EC", "x5c": [x5c(&root)]},
            ],
        });
        let roots = roots_of(&document.to_string()).unwrap();
        assert_eq!(roots, [trust_anchor::pem_certificate(root.der())]);
    }

    #[test]
    fn a_bundle_without_roots_or_with_a_leaf_is_an_error() {
        let none = roots_of(r#"{"keys": [{"use": "jwt-svid"}]}"#).unwrap_err();
        assert_eq!(none, "no x509-svid key");
        let two = serde_json::json!({"keys": [{"use": "x509-svid", "x5c": ["a", "b"]}]});
        assert!(roots_of(&two.to_string()).unwrap_err().contains("not 2"));
        let leaf =
            serde_json::json!({"keys": [{"use": "x509-svid", "x5c": [x5c(&certificate(false))]}]});
        let error = roots_of(&leaf.to_string()).unwrap_err();
        assert!(error.contains("not a CA certificate"), "{error}");
        assert!(roots_of("1")
            .unwrap_err()
            .starts_with("not a SPIFFE bundle"));
    }
}
