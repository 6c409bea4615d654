//! Istio's own messages, generated from proto/: the stats filter's `stats.PluginConfig` and
//! `udpa.type.v1.TypedStruct`, in which istiod wraps the configs whose protos upstream Envoy does
//! not carry (peer metadata exchange); MCP's resource; ztunnel's workloads and authorizations; the
//! trust bundle PCDS sends (`istio.mesh.v1alpha1.ProxyConfig`).

#![allow(clippy::all)]

pub mod stats {
    tonic::include_proto!("stats");
}

pub mod mcp {
    tonic::include_proto!("istio.mcp.v1alpha1");
}

pub mod udpa {
    tonic::include_proto!("udpa.r#type.v1");
}

pub mod workload {
    tonic::include_proto!("istio.workload");
}

pub mod authorization {
    tonic::include_proto!("istio.security");
}

pub mod mesh {
    tonic::include_proto!("istio.mesh.v1alpha1");
}
