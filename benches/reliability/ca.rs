//! The CA root as a workload sees it: trusted from the `istio-ca-root-cert` ConfigMap the leader
//! publishes, then confirmed by a certificate signed over the secure port (CSR with a service-account
//! token, as istio-agent asks), whose chain ends in the root.

use std::time::Duration;

use meshpilot::security::pb::istio_certificate_service_client::IstioCertificateServiceClient;
use meshpilot::security::pb::IstioCertificateRequest;
use test_apiserver::{TestApiServer, User};

use crate::common;
use crate::harness::plane::{Plane, NS};

const TOKEN: &str = "workload-token";

/// The root the leader published on the config cluster.
pub async fn published_root(config: &TestApiServer) -> String {
    common::wait_for("the root ConfigMap", Duration::from_secs(60), || async {
        config
            .get("ConfigMap", "istio-system", "istio-ca-root-cert")?
            .get("data")?
            .get("root-cert.pem")?
            .as_str()
            .map(str::to_string)
    })
    .await
}

/// The root ending the chain of a certificate meshpilot signs, over TLS trusting only `trusted`: a
/// server certificate from another root fails the handshake.
pub async fn signing_root(plane: &Plane, trusted: &str) -> Result<String, String> {
    plane.servers[0].add_token(TOKEN, User::service_account(NS, "sa-0"));
    let channel = common::tls_channel(plane.secure, trusted, None)
        .await
        .map_err(|e| format!("TLS to the secure port trusting the earlier root: {e:?}"))?;
    let key = rcgen::KeyPair::generate().unwrap();
    let csr = rcgen::CertificateParams::new(vec!["ignored.example".to_string()])
        .unwrap()
        .serialize_request(&key)
        .unwrap()
        .pem()
        .unwrap();
    let mut request = tonic::Request::new(IstioCertificateRequest {
        csr,
        validity_duration: 3600,
        metadata: None,
    });
    let metadata = request.metadata_mut();
    metadata.insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
    metadata.insert("clusterid", "c0".parse().unwrap());
    let chain = IstioCertificateServiceClient::new(channel)
        .create_certificate(request)
        .await
        .map_err(|s| format!("CreateCertificate: {s}"))?
        .into_inner()
        .cert_chain;
    chain.last().cloned().ok_or_else(|| "an empty chain".into())
}
