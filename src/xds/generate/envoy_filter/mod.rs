//! EnvoyFilter patches, applied to the listeners, route configurations and clusters a proxy is sent
//! after they are generated and before they are cached (istiod's
//! pilot/pkg/networking/core/envoyfilter): which patches apply to a proxy is decided once per
//! generation (its namespace, labels, Istio version and metadata), and resources built with
//! patches are cached under a variant of their own, so proxies without EnvoyFilters share
//! everything as before.
//!
//! Stages run as istiod's: a listener's own patches, then its listener filters, filter chains,
//! network filters and the HTTP filters of its connection managers; a route configuration's, then
//! its virtual hosts and their routes. A patch that cannot apply to what was generated (a MERGE of
//! another type into a filter's config, say) is skipped and reported (`failures`); the others
//! still apply.

mod cluster;
mod failures;
mod listener;
mod ops;
mod route;

use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::net::IpAddr;
use std::sync::Arc;

use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::core::v3::TypedExtensionConfig;
use envoy_types::pb::envoy::config::listener::v3::Listener;
use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
use prost::{Message, Name};
use prost_reflect::DynamicMessage;

pub use failures::{failures, PatchFailure};

use super::names::{INBOUND_PASSTHROUGH, VIRTUAL_INBOUND};
use crate::envoy_api;
use crate::istio::envoy_filter::{api_name, ApplyTo, ConfigPatch, Operation, PatchContext};
use crate::istio::ConfigObject;
use crate::model::{envoy_filter, MeshSnapshot};
use crate::xds::protocol::ResourceType;
use crate::xds::proxy::{Generator, Proxy, ProxyType};
use crate::xds::wire::Resource;

/// What patching reads of the proxy: its kind (which side a resource serves), and, for a patch
/// matching an inbound cluster by service, its own addresses (read only then).
pub(super) struct Patched<'a> {
    pub(super) kind: ProxyType,
    pub(super) mesh: &'a MeshSnapshot,
    pub(super) own_addresses: Box<dyn Fn() -> Vec<IpAddr> + 'a>,
}

/// The EnvoyFilter patches that apply to one proxy, in application order.
#[derive(Default)]
pub(super) struct ProxyPatches {
    filters: Vec<Arc<ConfigObject>>,
    /// (target, filter, patch) positions.
    applied: Vec<(ApplyTo, usize, usize)>,
    /// Identifies the applied set: a cache variant for what it patches.
    id: u64,
}

/// One patch, with the EnvoyFilter it belongs to (for reports).
#[derive(Clone, Copy)]
pub(super) struct PatchRef<'a> {
    pub(super) owner: &'a Arc<ConfigObject>,
    pub(super) index: usize,
    pub(super) patch: &'a ConfigPatch,
}

impl ProxyPatches {
    /// `labels`: the proxy's, its topology among them.
    pub(super) fn for_proxy(
        mesh: &MeshSnapshot,
        proxy: &Proxy,
        labels: &BTreeMap<String, String>,
    ) -> Self {
        // Proxyless gRPC clients read no Envoy listeners; istiod patches Envoy's only.
        if proxy.generator != Generator::Envoy {
            return Self::default();
        }
        let filters = mesh.config.envoy_filters_for(&proxy.namespace, labels);
        let mut applied = Vec::new();
        for (i, object) in filters.iter().enumerate() {
            let Some(filter) = envoy_filter(object) else {
                continue;
            };
            for (j, patch) in filter.config_patches.iter().enumerate() {
                if proxy_matches(patch, proxy) {
                    applied.push((patch.apply_to, i, j));
                }
            }
        }
        let id = match applied.is_empty() {
            true => 0,
            false => {
                let mut h = std::collections::hash_map::DefaultHasher::new();
                for (_, i, j) in &applied {
                    (&filters[*i].key, j).hash(&mut h);
                }
                h.finish().max(1)
            }
        };
        Self {
            filters,
            applied,
            id,
        }
    }

    /// The patches of one target, in order.
    pub(super) fn of(&self, target: ApplyTo) -> impl Iterator<Item = PatchRef<'_>> + Clone {
        self.applied
            .iter()
            .filter(move |(t, _, _)| *t == target)
            .filter_map(|(_, i, j)| {
                let owner = &self.filters[*i];
                let patch = envoy_filter(owner)?.config_patches.get(*j)?;
                Some(PatchRef {
                    owner,
                    index: *j,
                    patch,
                })
            })
    }

    /// Whether any patch can change resources of `ty`.
    pub(super) fn touches(&self, ty: ResourceType) -> bool {
        let targets: &[ApplyTo] = match ty {
            ResourceType::Listener => &[
                ApplyTo::Listener,
                ApplyTo::ListenerFilter,
                ApplyTo::FilterChain,
                ApplyTo::NetworkFilter,
                ApplyTo::HttpFilter,
                // Inline route configurations (inbound) live in listeners.
                ApplyTo::RouteConfiguration,
                ApplyTo::VirtualHost,
                ApplyTo::HttpRoute,
            ],
            ResourceType::Route => &[
                ApplyTo::RouteConfiguration,
                ApplyTo::VirtualHost,
                ApplyTo::HttpRoute,
            ],
            ResourceType::Cluster => &[ApplyTo::Cluster],
            _ => &[],
        };
        self.applied.iter().any(|(t, _, _)| targets.contains(t))
    }
}

/// `match.proxy`: the proxy's Istio version against the regex (a proxy naming none matches no
/// version constraint), its string metadata against the values given.
fn proxy_matches(patch: &ConfigPatch, proxy: &Proxy) -> bool {
    let Some(wanted) = patch.matches.as_ref().and_then(|m| m.proxy.as_ref()) else {
        return true;
    };
    let version = wanted.version.as_ref().is_none_or(|regex| {
        !proxy.istio_version.is_empty() && regex.0.is_match(&proxy.istio_version)
    });
    version
        && wanted
            .metadata
            .iter()
            .all(|(k, v)| proxy.metadata.get(k) == Some(v))
}

impl PatchRef<'_> {
    pub(super) fn operation(&self) -> Operation {
        self.patch.effective_operation()
    }

    pub(super) fn value(&self) -> Option<&DynamicMessage> {
        self.patch.value().map(|v| &**v)
    }

    /// The value as a typed message (what ADD, INSERT and REPLACE put in place).
    pub(super) fn typed<M: Message + Default>(&self) -> Option<M> {
        let value = self.value()?;
        match envoy_api::to_typed(value) {
            Ok(typed) => Some(typed),
            Err(e) => {
                self.fail("", &e.to_string());
                None
            }
        }
    }

    /// Whether its context admits a resource generated for `context`.
    pub(super) fn in_context(&self, context: PatchContext) -> bool {
        matches!(self.patch.context(), PatchContext::Any) || self.patch.context() == context
    }

    /// Reports that the patch could not apply to `resource`.
    pub(super) fn fail(&self, resource: &str, error: &str) {
        failures::record(self, resource, error);
    }

    pub(super) fn target_name(&self) -> String {
        api_name(&self.patch.apply_to)
    }
}

/// Which side of the proxy a resource serves, as the EnvoyFilter contexts name them.
fn context_of(kind: ProxyType, ty: ResourceType, name: &str) -> PatchContext {
    match kind {
        ProxyType::Router => return PatchContext::Gateway,
        // Everything a waypoint builds serves traffic to its services (istiod builds it as
        // inbound, buildWaypointInbound).
        ProxyType::Waypoint => return PatchContext::SidecarInbound,
        ProxyType::Sidecar | ProxyType::Ztunnel => {}
    }
    let inbound = match ty {
        ResourceType::Listener => name == VIRTUAL_INBOUND,
        ResourceType::Cluster => name.starts_with("inbound|") || name == INBOUND_PASSTHROUGH,
        _ => name.starts_with("inbound|"),
    };
    match inbound {
        true => PatchContext::SidecarInbound,
        false => PatchContext::SidecarOutbound,
    }
}

impl ProxyPatches {
    /// A cache variant of resources of `ty`: its own where the patches change them.
    pub(super) fn variant(&self, ty: ResourceType, variant: u64) -> u64 {
        match self.touches(ty) {
            true => variant ^ self.id.rotate_left(17),
            false => variant,
        }
    }

    /// `resource`, generated for the proxy `target` describes, with the patches applied; None
    /// when a patch removes it.
    pub(super) fn apply(
        &self,
        ty: ResourceType,
        resource: Resource,
        target: &Patched<'_>,
    ) -> Option<Resource> {
        if !self.touches(ty) {
            return Some(resource);
        }
        let context = context_of(target.kind, ty, &resource.name);
        let name = resource.name.clone();
        match ty {
            ResourceType::Listener => {
                let mut listener: Listener = decode(&resource)?;
                listener::patch(self, context, &mut listener).then_some(())?;
                Some(encode(name, &listener))
            }
            ResourceType::Route => {
                let mut config: RouteConfiguration = decode(&resource)?;
                route::patch(self, context, &mut config, &route::Names::of(&name)).then_some(())?;
                Some(encode(name, &config))
            }
            ResourceType::Cluster => {
                let mut cluster: Cluster = decode(&resource)?;
                cluster::patch(target, self, context, &mut cluster).then_some(())?;
                Some(encode(name, &cluster))
            }
            _ => Some(resource),
        }
    }

    /// The listeners or clusters the patches ADD for a proxy of `kind`.
    pub(super) fn added(&self, ty: ResourceType, kind: ProxyType) -> Vec<Arc<Resource>> {
        let target = match ty {
            ResourceType::Listener => ApplyTo::Listener,
            ResourceType::Cluster => ApplyTo::Cluster,
            _ => return Vec::new(),
        };
        let sides: &[PatchContext] = match kind {
            ProxyType::Router => &[PatchContext::Gateway],
            ProxyType::Sidecar => &[PatchContext::SidecarOutbound, PatchContext::SidecarInbound],
            ProxyType::Waypoint => &[PatchContext::SidecarInbound],
            ProxyType::Ztunnel => return Vec::new(),
        };
        let mut by_name: BTreeMap<String, Resource> = BTreeMap::new();
        for p in self.of(target).filter(|p| p.operation() == Operation::Add) {
            // An ADD for ANY context is added once, as an outbound (or gateway) one in istiod.
            let context = p.patch.context();
            if context != PatchContext::Any && !sides.contains(&context) {
                continue;
            }
            let added = match ty {
                ResourceType::Listener => p.typed::<Listener>().and_then(|l| {
                    let name = l.name.clone();
                    (!name.is_empty()).then(|| encode(name, &l))
                }),
                _ => p.typed::<Cluster>().and_then(|c| {
                    let name = c.name.clone();
                    (!name.is_empty()).then(|| encode(name, &c))
                }),
            };
            match added {
                Some(resource) => {
                    by_name.insert(resource.name.to_string(), resource);
                }
                None => p.fail("", &format!("an added {} needs a name", p.target_name())),
            }
        }
        by_name.into_values().map(Arc::new).collect()
    }

    /// An extension config an EXTENSION_CONFIG patch ADDs by this name (such patches apply to
    /// every proxy they select, whatever their context).
    pub(super) fn added_extension(&self, name: &str) -> Option<Arc<Resource>> {
        self.of(ApplyTo::ExtensionConfig)
            .filter(|p| p.operation() == Operation::Add)
            .filter_map(|p| p.typed::<TypedExtensionConfig>())
            .find(|c| c.name == name)
            .map(|c| Arc::new(encode(name.to_string(), &c)))
    }
}

/// A resource's message.
fn decode<M: Message + Default>(resource: &Resource) -> Option<M> {
    let any = envoy_types::pb::google::protobuf::Any::decode(resource.any.clone()).ok()?;
    M::decode(any.value.as_slice()).ok()
}

/// A patched resource, encoded deterministically (patch values carry maps).
fn encode<M: Message + Name>(name: impl Into<Arc<str>>, message: &M) -> Resource {
    let bytes = message.encode_to_vec();
    let bytes = match envoy_api::descriptor(&M::full_name()) {
        Ok(desc) => envoy_api::canonical_bytes(&desc, &bytes),
        Err(_) => bytes,
    };
    Resource::from_encoded(name, &M::type_url(), bytes)
}
