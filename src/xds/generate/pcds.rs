//! PCDS: the mesh's trust bundle as one unnamed `istio.mesh.v1alpha1.ProxyConfig` carrying only
//! `caCertificatesPem`, as istiod's pilot/pkg/xds/pcds.go sends it; Istio's agent (with
//! `PROXY_CONFIG_XDS_AGENT=true`) adds these roots to the ones its workload trusts. Nothing is sent
//! unless the installation distributes extra roots (`--multiroot-mesh`).

use std::sync::Arc;

use prost::Message;

use super::generation::Generation;
use super::traits::Traits;
use crate::xds::istio_protos::mesh::ProxyConfig;
use crate::xds::protocol::{ResourceType, PROXY_CONFIG_TYPE};
use crate::xds::wire::Resource;

/// The same bytes for every proxy, built once per trust bundle.
pub(super) fn trust_bundle(g: &Generation<'_>) -> Option<Arc<Resource>> {
    let bundle = g.mesh.trust_bundle.as_ref()?;
    g.keyed(
        ResourceType::ProxyConfig,
        "",
        (Traits::NONE, &()),
        [g.mesh.trust_bundle_version, 0, 0, 0],
        || {
            let config = ProxyConfig {
                ca_certificates_pem: bundle.roots(),
            };
            Some(Resource::from_encoded(
                "",
                PROXY_CONFIG_TYPE,
                config.encode_to_vec(),
            ))
        },
    )
}
