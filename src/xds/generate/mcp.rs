//! Istio config served over MCP, as istiod's `api` generator (pilot/pkg/networking/apigen): every
//! accepted object of the kind asked for, each an `istio.mcp.v1alpha1.Resource` named
//! `<namespace>/<name>`, so another control plane can take this one as its config source.

use std::sync::Arc;

use prost::Message;
use tracing::warn;

use super::generation::Generation;
use crate::istio::mcp::{from_object, RESOURCE_TYPE_URL};
use crate::istio::{ConfigKey, ConfigKind, ConfigObject};
use crate::xds::wire::{Listing, Resource};

/// Every accepted object of `kind`.
pub(super) fn all(g: &Generation<'_>, kind: ConfigKind) -> Listing {
    let resources = g
        .mesh
        .config
        .of_kind(kind)
        .filter_map(|o| encode(o))
        .collect();
    Listing::own(resources)
}

/// The object `<namespace>/<name>` of `kind`, when a client names it.
pub(super) fn named(g: &Generation<'_>, kind: ConfigKind, name: &str) -> Option<Arc<Resource>> {
    let (namespace, name) = name.split_once('/')?;
    let key = ConfigKey {
        kind,
        namespace: namespace.into(),
        name: name.into(),
    };
    encode(g.mesh.config.get(&key)?)
}

fn encode(object: &ConfigObject) -> Option<Arc<Resource>> {
    match from_object(object) {
        Ok(resource) => {
            let name = resource
                .metadata
                .as_ref()
                .map(|m| m.name.clone())
                .unwrap_or_default();
            let bytes = resource.encode_to_vec();
            Some(Arc::new(Resource::from_encoded(
                name,
                RESOURCE_TYPE_URL,
                bytes,
            )))
        }
        Err(error) => {
            warn!(config = %object.key, %error, "not served over MCP");
            None
        }
    }
}
