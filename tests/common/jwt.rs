//! JWTs for tests: ES256 keys (ring), their JWKS, signed tokens, and a small HTTP server serving a
//! key set that tests can change (rotation) or start late (an unreachable `jwksUri`).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use ring::rand::SystemRandom;
use ring::signature::{EcdsaKeyPair, KeyPair, ECDSA_P256_SHA256_FIXED_SIGNING};

/// A P-256 signing key with its key id.
pub struct SigningKey {
    kid: String,
    pair: EcdsaKeyPair,
    rng: SystemRandom,
}

impl SigningKey {
    pub fn generate(kid: &str) -> SigningKey {
        let rng = SystemRandom::new();
        let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &rng)
            .expect("generate P-256 key");
        let pair = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8.as_ref(), &rng)
            .expect("load P-256 key");
        SigningKey {
            kid: kid.to_string(),
            pair,
            rng,
        }
    }

    /// The public key as a JWK.
    pub fn jwk(&self) -> serde_json::Value {
        // Uncompressed point: 0x04 || x || y.
        let point = self.pair.public_key().as_ref();
        serde_json::json!({
            "kty": "EC", "crv": "P-256", "alg": "ES256", "use": "sig", "kid": self.kid,
            "x": URL_SAFE_NO_PAD.encode(&point[1..33]),
            "y": URL_SAFE_NO_PAD.encode(&point[33..65]),
        })
    }

    /// A token for `sub` from `iss`, valid for an hour.
    pub fn token(&self, iss: &str, sub: &str) -> String {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock after 1970")
            .as_secs();
        let header = serde_json::json!({"alg": "ES256", "typ": "JWT", "kid": self.kid});
        let claims = serde_json::json!({"iss": iss, "sub": sub, "iat": now, "exp": now + 3600});
        let input = format!(
            "{}.{}",
            URL_SAFE_NO_PAD.encode(header.to_string()),
            URL_SAFE_NO_PAD.encode(claims.to_string())
        );
        let signature = self
            .pair
            .sign(&self.rng, input.as_bytes())
            .expect("sign token");
        format!("{input}.{}", URL_SAFE_NO_PAD.encode(signature.as_ref()))
    }
}

/// A key set of these keys.
pub fn jwks(keys: &[&SigningKey]) -> String {
    let keys: Vec<serde_json::Value> = keys.iter().map(|k| k.jwk()).collect();
    serde_json::json!({ "keys": keys }).to_string()
}

/// Serves `/keys.json` (the current body) until dropped; counts the requests.
pub struct JwksServer {
    pub addr: SocketAddr,
    body: Arc<Mutex<String>>,
    hits: Arc<std::sync::atomic::AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl JwksServer {
    pub async fn start(addr: SocketAddr, body: String) -> JwksServer {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .expect("bind JWKS server");
        let addr = listener.local_addr().expect("bound address");
        let body = Arc::new(Mutex::new(body));
        let hits = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let (served, counted) = (body.clone(), hits.clone());
        let app = axum::Router::new().route(
            "/keys.json",
            axum::routing::get(move || {
                let body = served.lock().expect("body lock").clone();
                counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                async move { body }
            }),
        );
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        JwksServer {
            addr,
            body,
            hits,
            task,
        }
    }

    pub fn uri(&self) -> String {
        format!("http://{}/keys.json", self.addr)
    }

    pub fn set(&self, body: String) {
        *self.body.lock().expect("body lock") = body;
    }

    pub fn hits(&self) -> u64 {
        self.hits.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Drop for JwksServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}
