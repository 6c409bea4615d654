//! A workload's inbound security from its policies: the mutual-TLS mode per port
//! (PeerAuthentication) and the filters that authenticate and authorize what arrives
//! (RequestAuthentication, AuthorizationPolicy). Any listener serving a workload — the sidecar's
//! inbound side, a gateway's servers — puts the HTTP filters before its router and the network
//! filters before its TCP proxy.

use std::collections::BTreeMap;

use envoy_types::pb::envoy::config::listener::v3::Filter;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::HttpFilter;

use super::authn;
use super::authz::Authorization;
use crate::model::policies::MtlsSettings;
use crate::model::MeshSnapshot;

pub struct WorkloadSecurity {
    pub mtls: MtlsSettings,
    http: Vec<HttpFilter>,
    network: Vec<Filter>,
}

impl WorkloadSecurity {
    pub fn for_workload(
        mesh: &MeshSnapshot,
        namespace: &str,
        labels: &BTreeMap<String, String>,
    ) -> Self {
        let policies = mesh.config.security();
        let authz = Authorization::for_workload(mesh, namespace, labels);
        let jwt = authn::jwt_filter(&policies.jwt_rules(namespace, labels), &mesh.jwks);
        // istiod's order: CUSTOM, authentication, then AUDIT, DENY, ALLOW.
        let mut http = authz.custom_http_filters();
        http.extend(jwt);
        http.extend(authz.http_filters());
        let mut network = authz.custom_network_filters();
        network.extend(authz.network_filters());
        Self {
            mtls: policies.mtls(namespace, labels),
            http,
            network,
        }
    }

    /// Filters to put before an HTTP connection manager's router.
    pub fn http_filters(&self) -> &[HttpFilter] {
        &self.http
    }

    /// Filters to put before a TCP chain's proxy.
    pub fn network_filters(&self) -> &[Filter] {
        &self.network
    }
}
