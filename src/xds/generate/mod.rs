//! Resource generators, with Istio's names, and the cache that builds each distinct resource once.
//!
//! Each kind of proxy has its generator (`sidecar`, `router`, `grpc`, `waypoint`, and `ambient`
//! for ztunnel's types), dispatched to once here;
//! they share the building blocks below them (clusters, routes, filters, TLS, security, endpoints,
//! secrets) and import no other generator. A resource depends on the mesh snapshot and on a few
//! proxy traits (`generation`); the cache keys entries by (type, name, traits) and stamps them with
//! the versions of the snapshot they were built from; every proxy with the same traits gets the
//! same encoded bytes.

mod access_log;
mod ambient;
mod authn;
pub mod authz;
mod cache;
mod clusters;
mod common;
mod dns;
mod eds;
mod envoy_filter;
mod filters;
mod gateway_tls;
mod generation;
mod grpc;
mod inspectors;
mod istio_stats;
mod locality;
mod mcp;
pub mod names;
mod pcds;
mod policy;
mod providers;
mod router;
mod routes;
mod sds;
pub mod security;
mod sidecar;
mod stat_names;
pub mod tls;
mod tracer;
mod traits;
mod wasm;
mod waypoint;

use std::sync::Arc;

pub use ambient::address_scope;
pub use cache::{ResourceCache, DEFAULT_CACHE_ENTRIES};
pub use envoy_filter::{failures as envoy_filter_failures, PatchFailure};
pub use generation::Generation;
pub use names::{cluster_host, eds_names_for};

use super::protocol::ResourceType;
use super::wire::{Listing, Resource};
use generation::ProxyKind;

impl Generation<'_> {
    /// Every resource of a wildcard subscription: the list shared by proxies with the same traits,
    /// then the proxy's own.
    pub fn all(&self, ty: ResourceType) -> Listing {
        if ty == ResourceType::NameTable {
            let table = self.kind().and_then(|_| dns::table(self));
            return Listing::own(table.into_iter().collect());
        }
        if ty == ResourceType::ProxyConfig {
            return Listing::own(pcds::trust_bundle(self).into_iter().collect());
        }
        if let ResourceType::Config(kind, _) = ty {
            return mcp::all(self, kind);
        }
        if matches!(ty, ResourceType::Address | ResourceType::Authorization) {
            return ambient::all(self, ty);
        }
        let mut listing = match self.kind() {
            Some(ProxyKind::Sidecar) => sidecar::all(self, ty),
            Some(ProxyKind::Router) => router::all(self, ty),
            Some(ProxyKind::ProxylessGrpc) => grpc::all(self, ty),
            Some(ProxyKind::Waypoint) => waypoint::all(self, ty),
            None => Listing::default(),
        };
        let kind = self.proxy_type();
        listing.own.extend(self.envoy_filters().added(ty, kind));
        listing
    }

    /// The named resources that exist, in the order given.
    pub fn named<'n>(
        &self,
        ty: ResourceType,
        names: impl IntoIterator<Item = &'n String>,
    ) -> Vec<Arc<Resource>> {
        if matches!(ty, ResourceType::Address | ResourceType::Authorization) {
            return ambient::named(self, ty, names);
        }
        names
            .into_iter()
            .filter_map(|n| self.build(ty, n))
            .collect()
    }

    /// The resources of a wildcard subscription among these names (those a change touched).
    pub fn changed<'n>(
        &self,
        ty: ResourceType,
        names: impl IntoIterator<Item = &'n String>,
    ) -> Vec<Arc<Resource>> {
        match ty {
            ResourceType::Address => ambient::changed(self, names),
            _ => self.named(ty, names),
        }
    }

    /// The name table this proxy is sent (for `/debug/ndsz`).
    pub fn name_table(&self) -> crate::xds::name_table::NameTable {
        dns::build(self)
    }

    fn build(&self, ty: ResourceType, name: &str) -> Option<Arc<Resource>> {
        match ty {
            ResourceType::Endpoint
                if self.kind() == Some(ProxyKind::Waypoint)
                    && names::parse_inbound_vip(name).is_some() =>
            {
                return waypoint::endpoints(self, name)
            }
            ResourceType::Endpoint => return eds::build(self, name),
            ResourceType::Secret => return sds::build(self, name),
            // One unnamed table or bundle: a name asks for nothing that exists.
            ResourceType::NameTable | ResourceType::ProxyConfig => return None,
            ResourceType::Config(kind, _) => return mcp::named(self, kind, name),
            ResourceType::Address | ResourceType::Authorization => return None,
            ResourceType::ExtensionConfig => {
                let asker = wasm::Asker {
                    namespace: self.namespace(),
                    istio_version: self.istio_version(),
                    verified: self.verified_account().is_some(),
                    cluster: self.cluster(),
                    plugins: self.wasm_plugins(),
                };
                let plugin = wasm::build(self.mesh, &asker, name);
                return match plugin {
                    Some(resource) => self.finish(ty, resource),
                    None => self.envoy_filters().added_extension(name),
                };
            }
            ResourceType::Cluster | ResourceType::Listener | ResourceType::Route => {}
        }
        let built = match self.kind()? {
            ProxyKind::Sidecar => sidecar::build(self, ty, name),
            ProxyKind::Router => router::build(self, ty, name),
            ProxyKind::ProxylessGrpc => grpc::build(self, ty, name),
            ProxyKind::Waypoint => waypoint::build(self, ty, name),
        };
        built.or_else(|| {
            let added = self.envoy_filters().added(ty, self.proxy_type());
            added.into_iter().find(|r| *r.name == *name)
        })
    }
}
