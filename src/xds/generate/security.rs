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
use super::wasm::Phased;
use crate::model::policies::MtlsSettings;
use crate::model::MeshSnapshot;

pub struct WorkloadSecurity {
    pub mtls: MtlsSettings,
    /// CUSTOM ext_authz, then authentication (JWT), then AUDIT, DENY and ALLOW: kept apart so
    /// WasmPlugins of a phase go between them.
    custom_http: Vec<HttpFilter>,
    authn_http: Vec<HttpFilter>,
    authz_http: Vec<HttpFilter>,
    custom_network: Vec<Filter>,
    authz_network: Vec<Filter>,
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
        Self {
            mtls: policies.mtls(namespace, labels),
            custom_http: authz.custom_http_filters(),
            authn_http: jwt.into_iter().collect(),
            authz_http: authz.http_filters(),
            custom_network: authz.custom_network_filters(),
            authz_network: authz.network_filters(),
        }
    }

    /// Filters to put before an HTTP connection manager's router, in istiod's order: CUSTOM,
    /// authentication, AUDIT/DENY/ALLOW — with WasmPlugins of the AUTHN phase before
    /// authentication, of AUTHZ before authorization, and the others after it.
    pub(super) fn http_filters(&self, wasm: Phased<HttpFilter>) -> Vec<HttpFilter> {
        let mut out = self.custom_http.clone();
        out.extend(wasm.authn);
        out.extend(self.authn_http.iter().cloned());
        out.extend(wasm.authz);
        out.extend(self.authz_http.iter().cloned());
        out.extend(wasm.rest);
        out
    }

    /// Filters to put before a TCP chain's proxy, WasmPlugins placed as in HTTP chains.
    pub(super) fn network_filters(&self, wasm: Phased<Filter>) -> Vec<Filter> {
        let mut out = self.custom_network.clone();
        out.extend(wasm.authn);
        out.extend(wasm.authz);
        out.extend(self.authz_network.iter().cloned());
        out.extend(wasm.rest);
        out
    }
}
