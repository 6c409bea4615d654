//! Endpoints (Istio's IstioEndpoint) with everything EDS, split horizon and mTLS need.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::ClusterId;

/// Labels, shared between every endpoint of one pod.
pub type Labels = Arc<BTreeMap<String, String>>;

#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Locality {
    pub region: Arc<str>,
    pub zone: Arc<str>,
    pub subzone: Arc<str>,
}

impl Locality {
    /// Parses Istio's `region/zone/subzone` form (missing parts are empty).
    pub fn parse(s: &str) -> Self {
        let mut parts = s.splitn(3, '/');
        let mut next = || Arc::from(parts.next().unwrap_or_default());
        Self {
            region: next(),
            zone: next(),
            subzone: next(),
        }
    }
}

/// `security.istio.io/tlsMode` of the workload.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TlsMode {
    /// The workload runs an Istio sidecar and accepts mutual TLS.
    Istio,
    #[default]
    Disabled,
}

/// Health from EndpointSlice conditions, as Istio derives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Health {
    Healthy,
    Unhealthy,
    /// Terminating but still serving.
    Draining,
    Terminating,
}

impl Health {
    /// `ready`, `serving` and `terminating` are the EndpointSlice conditions (absent = unknown).
    pub fn from_conditions(
        ready: Option<bool>,
        serving: Option<bool>,
        terminating: Option<bool>,
    ) -> Self {
        let terminating = terminating == Some(true);
        match (ready, serving) {
            (None | Some(true), _) if !terminating => Self::Healthy,
            (_, Some(true)) if terminating => Self::Draining,
            _ if terminating => Self::Terminating,
            _ => Self::Unhealthy,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Endpoint {
    pub address: IpAddr,
    /// The port the workload listens on.
    pub port: u16,
    /// Name of the service port this endpoint port serves.
    pub service_port_name: Arc<str>,
    pub labels: Labels,
    /// SPIFFE identity, `spiffe://<trust-domain>/ns/<ns>/sa/<sa>`; empty when the pod is unknown.
    pub service_account: Arc<str>,
    pub network: Arc<str>,
    /// Shared by the endpoints of a node (or of a locality label).
    pub locality: Arc<Locality>,
    pub cluster_id: ClusterId,
    pub tls_mode: TlsMode,
    pub health: Health,
    /// The pod (or WorkloadEntry) behind the endpoint, for debugging.
    pub workload: Arc<str>,
    /// Relative load-balancing weight (a WorkloadEntry's `weight`; 1 for pods).
    pub weight: u32,
    /// The endpoint's own DNS label under its headless service (the EndpointSlice endpoint's
    /// `hostname`, a StatefulSet pod's name): `<hostname>.<service>.<namespace>.svc.<domain>`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hostname: Option<Arc<str>>,
}

impl Endpoint {
    /// Identity of the endpoint within one service shard: Istio deduplicates on (IP, port name).
    pub fn key(&self) -> (IpAddr, &str) {
        (self.address, &self.service_port_name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_from_conditions() {
        assert_eq!(Health::from_conditions(None, None, None), Health::Healthy);
        assert_eq!(
            Health::from_conditions(Some(true), None, Some(false)),
            Health::Healthy
        );
        assert_eq!(
            Health::from_conditions(Some(false), Some(false), None),
            Health::Unhealthy
        );
        assert_eq!(
            Health::from_conditions(Some(false), Some(true), Some(true)),
            Health::Draining
        );
        assert_eq!(
            Health::from_conditions(Some(false), Some(false), Some(true)),
            Health::Terminating
        );
    }

    #[test]
    fn locality_parse() {
        let l = Locality::parse("us-east1/us-east1-b");
        assert_eq!(
            (&*l.region, &*l.zone, &*l.subzone),
            ("us-east1", "us-east1-b", "")
        );
    }
}
