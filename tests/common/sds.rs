//! A small SDS source for test Envoys, standing in for istio-proxy's agent: serves the secrets
//! `default` (workload certificate and key) and `ROOTCA` (the mesh root) from PEM it is given.

use std::net::SocketAddr;
use std::pin::Pin;

use envoy_types::pb::envoy::config::core::v3::{data_source::Specifier, DataSource};
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    secret, CertificateValidationContext, Secret, TlsCertificate,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::envoy::service::secret::v3::secret_discovery_service_server::{
    SecretDiscoveryService, SecretDiscoveryServiceServer,
};
use envoy_types::util::pack_any;
use futures::Stream;
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status, Streaming};

/// PEM material of one workload.
#[derive(Clone)]
pub struct WorkloadCerts {
    pub chain: String,
    pub key: String,
    pub root: String,
}

impl WorkloadCerts {
    /// Self-signed material: enough for Envoy to load the mesh's clusters where no traffic is sent
    /// (no control plane's CA at hand).
    pub fn placeholder() -> Self {
        let cert = rcgen::generate_simple_self_signed(vec!["placeholder".into()])
            .expect("self-signed certificate");
        let pem = cert.cert.pem();
        WorkloadCerts {
            chain: pem.clone(),
            key: cert.signing_key.serialize_pem(),
            root: pem,
        }
    }
}

pub struct SdsServer {
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for SdsServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl SdsServer {
    pub async fn start(certs: WorkloadCerts, bind: std::net::IpAddr) -> SdsServer {
        let listener = tokio::net::TcpListener::bind((bind, 0))
            .await
            .expect("bind SDS");
        let addr = listener.local_addr().unwrap();
        let service = SecretDiscoveryServiceServer::new(Sds { certs });
        let task = tokio::spawn(async move {
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
            let _ = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(incoming)
                .await;
        });
        SdsServer { addr, task }
    }
}

struct Sds {
    certs: WorkloadCerts,
}

fn inline(text: &str) -> Option<DataSource> {
    Some(DataSource {
        specifier: Some(Specifier::InlineString(text.to_string())),
        ..Default::default()
    })
}

impl Sds {
    fn secret(&self, name: &str) -> Option<Secret> {
        let kind = match name {
            "default" => secret::Type::TlsCertificate(TlsCertificate {
                certificate_chain: inline(&self.certs.chain),
                private_key: inline(&self.certs.key),
                ..Default::default()
            }),
            "ROOTCA" => secret::Type::ValidationContext(CertificateValidationContext {
                trusted_ca: inline(&self.certs.root),
                ..Default::default()
            }),
            _ => return None,
        };
        Some(Secret {
            name: name.to_string(),
            r#type: Some(kind),
        })
    }
}

type ResponseStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl SecretDiscoveryService for Sds {
    type DeltaSecretsStream = ResponseStream<DeltaDiscoveryResponse>;
    type StreamSecretsStream = ResponseStream<DiscoveryResponse>;

    async fn delta_secrets(
        &self,
        _: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaSecretsStream>, Status> {
        Err(Status::unimplemented("SotW only"))
    }

    async fn stream_secrets(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamSecretsStream>, Status> {
        let secrets = Sds {
            certs: self.certs.clone(),
        };
        // Answer each new subscription once; ACKs (a nonce we sent) need nothing.
        let responses = request.into_inner().filter_map(move |req| {
            let req = req.ok()?;
            if !req.response_nonce.is_empty() {
                return None;
            }
            let resources = req
                .resource_names
                .iter()
                .filter_map(|n| secrets.secret(n))
                .map(pack_any)
                .collect();
            Some(Ok(DiscoveryResponse {
                version_info: "1".into(),
                resources,
                type_url: req.type_url,
                nonce: "1".into(),
                ..Default::default()
            }))
        });
        Ok(Response::new(Box::pin(responses)))
    }

    async fn fetch_secrets(
        &self,
        _: Request<DiscoveryRequest>,
    ) -> Result<Response<DiscoveryResponse>, Status> {
        Err(Status::unimplemented("streams only"))
    }
}
