//! `istio.v1.auth.IstioCertificateService`: signs a workload's CSR for the identity its caller proves.

use std::sync::Arc;
use std::time::Duration;

use tonic::{Request, Response, Status};
use tracing::{info, warn};

use super::authn::{Authenticator, Credentials};
use super::ca::CaError;
use super::node_auth::{NodeAuthorizer, IMPERSONATED_IDENTITY};
use super::pb::istio_certificate_service_server::{
    IstioCertificateService, IstioCertificateServiceServer,
};
use super::pb::{IstioCertificateRequest, IstioCertificateResponse};
use super::rotation::SharedCa;
use crate::metrics::CaMetrics;

pub struct CaService {
    ca: Arc<SharedCa>,
    authn: Arc<Authenticator>,
    nodes: NodeAuthorizer,
    metrics: CaMetrics,
}

impl CaService {
    pub fn server(
        ca: Arc<SharedCa>,
        authn: Arc<Authenticator>,
        nodes: NodeAuthorizer,
        metrics: CaMetrics,
    ) -> IstioCertificateServiceServer<Self> {
        metrics.set_root_expiry(ca.current().root_not_after());
        IstioCertificateServiceServer::new(Self {
            ca,
            authn,
            nodes,
            metrics,
        })
    }
}

/// The identity a request asks for in its metadata, if any (a node proxy's).
fn impersonated(request: &IstioCertificateRequest) -> Option<&str> {
    let value = request
        .metadata
        .as_ref()?
        .fields
        .get(IMPERSONATED_IDENTITY)?;
    match &value.kind {
        Some(prost_types::value::Kind::StringValue(id)) if !id.is_empty() => Some(id),
        _ => None,
    }
}

#[tonic::async_trait]
impl IstioCertificateService for CaService {
    async fn create_certificate(
        &self,
        request: Request<IstioCertificateRequest>,
    ) -> Result<Response<IstioCertificateResponse>, Status> {
        self.metrics.requested();
        let credentials = Credentials::from_request(&request);
        let caller = match self.authn.caller(&credentials).await {
            Ok(caller) => caller,
            Err(e) => {
                self.metrics.authentication_failed();
                warn!(cluster = credentials.cluster_id.as_deref().unwrap_or_default(), error = %e, "certificate request refused");
                return Err(e.into());
            }
        };
        let request = request.into_inner();
        let identity = match impersonated(&request) {
            None => caller.identity,
            Some(wanted) => self.nodes.authorize(&caller, wanted).map_err(|e| {
                self.metrics.authentication_failed();
                warn!(caller = %caller.identity, error = %e, "impersonation refused");
                Status::unauthenticated(format!("impersonation refused: {e}"))
            })?,
        };
        let requested = u64::try_from(request.validity_duration)
            .ok()
            .map(Duration::from_secs);
        let cert_chain = self
            .ca
            .current()
            .sign_csr(&request.csr, &identity, requested)
            .inspect_err(|_| self.metrics.sign_failed())
            .map_err(|e| match e {
                CaError::Csr(_) | CaError::TtlTooLong { .. } => {
                    Status::invalid_argument(e.to_string())
                }
                other => Status::internal(other.to_string()),
            })?;
        self.metrics.issued();
        info!(identity = %identity, "certificate signed");
        Ok(Response::new(IstioCertificateResponse { cert_chain }))
    }
}
