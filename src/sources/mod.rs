//! Where clusters and config come from: directories of manifests, Kubernetes API servers, and the
//! snapshots that stand in for an unreachable remote after a restart.

pub mod allocated;
pub mod allocation_status;
pub mod auto_registration;
pub mod config_files;
pub mod discovery;
pub mod file;
pub mod gateway_names;
pub mod gateway_owners;
pub mod gateway_status;
mod holders;
pub mod ingress;
pub mod jwks;
pub mod kube;
pub mod kube_config;
pub mod manifest;
pub mod mcp;
pub mod mesh_config;
pub mod networks;
pub mod remote;
pub mod revision_tags;
pub mod snapshots;
pub mod trust_bundle;
pub mod watch;
mod web_fetch;
