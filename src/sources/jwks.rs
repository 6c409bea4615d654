//! JWT keys for RequestAuthentications: meshpilot fetches what `jwksUri` points at (or, without one,
//! what the issuer's OpenID discovery document names) and inlines the keys into the snapshot, as
//! istiod does, so proxies never fetch them themselves. Keys are refreshed; a failed fetch keeps the
//! last good keys (a source never fetched gets keys no token verifies against) and is retried with
//! backoff; its error shows on /debug/jwksz. Proxies whose policies use changed keys are pushed.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{info, warn};

use super::web_fetch::{get, http_client, retry_after, sleep_until, HttpClient};
use crate::aggregate::Aggregate;
use crate::istio::security::jwks;
use crate::model::policies::JwksSource;
use crate::model::{Audience, JwksEntry, JwksTable};

#[derive(Clone, Copy, Debug)]
pub struct JwksOptions {
    /// How often keys are fetched again (istiod: 20 minutes).
    pub refresh: Duration,
    /// How long one request may take.
    pub timeout: Duration,
}

/// The running resolver: wake it when RequestAuthentications change.
pub struct JwksResolver {
    wake: Notify,
}

impl JwksResolver {
    pub fn start(aggregate: Arc<Aggregate>, options: JwksOptions) -> (Arc<Self>, JoinHandle<()>) {
        let resolver = Arc::new(Self {
            wake: Notify::new(),
        });
        let task = tokio::spawn(run(aggregate, options, resolver.clone()));
        (resolver, task)
    }

    /// The policies changed: look for sources to fetch or drop now.
    pub fn wake(&self) {
        self.wake.notify_one();
    }
}

/// When each source is due again, and how many fetches in a row failed.
#[derive(Default)]
struct Schedule {
    due: BTreeMap<JwksSource, Instant>,
    failures: BTreeMap<JwksSource, u32>,
}

async fn run(aggregate: Arc<Aggregate>, options: JwksOptions, resolver: Arc<JwksResolver>) {
    let client = http_client();
    let mut schedule = Schedule::default();
    loop {
        let snapshot = aggregate.mesh().snapshot();
        let wanted = snapshot.config.security().jwks_sources();
        let mut table: JwksTable = snapshot.jwks.clone();
        table.retain(|s| wanted.contains_key(s));
        schedule.due.retain(|s, _| wanted.contains_key(s));
        schedule.failures.retain(|s, _| wanted.contains_key(s));
        let now = Instant::now();
        let due: Vec<JwksSource> = wanted
            .keys()
            .filter(|s| schedule.due.get(*s).is_none_or(|at| *at <= now))
            .cloned()
            .collect();
        let fetched =
            futures::future::join_all(due.iter().map(|s| fetch(&client, s, options.timeout))).await;
        let mut audience = Audience::Namespaces(Default::default());
        for (source, result) in due.into_iter().zip(fetched) {
            let last = table
                .get(&source)
                .map(|e| JwksEntry::clone(e))
                .unwrap_or_default();
            let entry = match result {
                Ok((uri, keys)) => {
                    schedule.failures.remove(&source);
                    schedule.due.insert(source.clone(), now + options.refresh);
                    if last.keys.as_deref() != Some(keys.as_str()) {
                        info!(source = ?source, %uri, "JWT keys fetched");
                    }
                    JwksEntry {
                        keys: Some(keys.into()),
                        uri: Some(uri),
                        fetched_at: Some(
                            humantime::format_rfc3339_seconds(std::time::SystemTime::now())
                                .to_string(),
                        ),
                        error: None,
                    }
                }
                Err(error) => {
                    let failures = schedule.failures.entry(source.clone()).or_default();
                    *failures = failures.saturating_add(1);
                    let backoff = retry_after(*failures, options.refresh);
                    schedule.due.insert(source.clone(), now + backoff);
                    warn!(source = ?source, %error, retry_in = ?backoff, "JWT keys not fetched; keeping the last good ones");
                    JwksEntry {
                        error: Some(error),
                        ..last.clone()
                    }
                }
            };
            if entry.keys != last.keys {
                if let Some(used) = wanted.get(&source) {
                    audience = union(audience, used.audience.clone());
                }
            }
            table.insert(source, entry);
        }
        if table != snapshot.jwks {
            aggregate.set_jwks(table, audience);
        }
        let next = schedule.due.values().min().copied();
        tokio::select! {
            _ = resolver.wake.notified() => {}
            _ = sleep_until(next) => {}
        }
    }
}

fn union(a: Audience, b: Audience) -> Audience {
    match (a, b) {
        (Audience::Namespaces(mut a), Audience::Namespaces(b)) => {
            a.extend(b);
            Audience::Namespaces(a)
        }
        _ => Audience::Everyone,
    }
}

/// The source's key set (checked) and the URI it came from.
async fn fetch(
    client: &HttpClient,
    source: &JwksSource,
    timeout: Duration,
) -> Result<(String, String), String> {
    let uri = match source {
        JwksSource::Uri(uri) => uri.clone(),
        JwksSource::Issuer(issuer) => {
            let discovery = format!(
                "{}/.well-known/openid-configuration",
                issuer.trim_end_matches('/')
            );
            let document = get(client, &discovery, timeout).await?;
            let value: serde_json::Value = serde_json::from_str(&document)
                .map_err(|e| format!("{discovery}: not JSON: {e}"))?;
            value["jwks_uri"]
                .as_str()
                .ok_or_else(|| format!("{discovery}: no jwks_uri"))?
                .to_string()
        }
    };
    let keys = get(client, &uri, timeout).await?;
    jwks::check(&keys).map_err(|e| format!("{uri}: not a key set: {e}"))?;
    Ok((uri, keys))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Serves an OpenID discovery document naming `/keys`, and a key set there.
    async fn issuer() -> (String, tokio::task::JoinHandle<()>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let keys_uri = format!("{base}/keys");
        let app = axum::Router::new()
            .route(
                "/.well-known/openid-configuration",
                axum::routing::get(move || async move {
                    serde_json::json!({ "jwks_uri": keys_uri }).to_string()
                }),
            )
            .route(
                "/keys",
                axum::routing::get(|| async { jwks::UNUSABLE.to_string() }),
            )
            .route("/broken", axum::routing::get(|| async { "{\"keys\": 1}" }));
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        (base, task)
    }

    #[tokio::test]
    async fn keys_come_from_the_uri_or_the_issuers_discovery() {
        crate::security::install_crypto_provider();
        let (base, task) = issuer().await;
        let client = http_client();
        let timeout = Duration::from_secs(5);
        let (uri, keys) = fetch(&client, &JwksSource::Issuer(format!("{base}/")), timeout)
            .await
            .unwrap();
        assert_eq!(uri, format!("{base}/keys"));
        assert_eq!(keys, jwks::UNUSABLE);
        let broken = fetch(&client, &JwksSource::Uri(format!("{base}/broken")), timeout)
            .await
            .unwrap_err();
        assert!(broken.contains("not a key set"), "{broken}");
        let missing = fetch(
            &client,
            &JwksSource::Uri(format!("{base}/nothing")),
            timeout,
        )
        .await
        .unwrap_err();
        assert!(missing.contains("404"), "{missing}");
        task.abort();
        let closed = "http://127.0.0.1:1/keys".to_string();
        let refused = fetch(&client, &JwksSource::Uri(closed), timeout)
            .await
            .unwrap_err();
        assert!(refused.contains("Connection refused"), "{refused}");
    }
}
