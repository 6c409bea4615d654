//! Security: the internal CA, workload identity, caller authentication, the certificate-signing
//! service, the mTLS server for xDS, and trust distribution.

pub mod authn;
pub mod ca;
pub mod ca_key;
pub mod certs_cmd;
pub mod identity;
pub mod keys;
pub mod node_auth;
pub mod rotation;
pub mod secret_access;
pub mod service;
pub mod tls;
pub mod trust;

/// Istio's CA API, generated from proto/ca.proto.
pub mod pb {
    #![allow(clippy::all)]
    tonic::include_proto!("istio.v1.auth");
}

/// Selects the process-wide rustls crypto provider (one, by Cargo feature).
pub fn install_crypto_provider() {
    #[cfg(feature = "tls-ring")]
    {
        // Fails only if a provider is already installed, which is what we want anyway.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}
