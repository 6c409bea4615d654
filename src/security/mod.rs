//! Security: the internal CA, workload identity, caller authentication, the certificate-signing
//! service, the mTLS server for xDS, and trust distribution.

pub mod authn;
pub mod ca;
pub mod ca_key;
pub mod certs_cmd;
pub mod identity;
pub mod keys;
pub mod rotation;
pub mod service;
pub mod tls;
pub mod trust;

/// Istio's CA API, generated from proto/ca.proto.
pub mod pb {
    #![allow(clippy::all)]
    tonic::include_proto!("istio.v1.auth");
}
