//! Where clusters come from: directories of manifests, (later) Kubernetes API servers.

pub mod config_files;
pub mod file;
mod holders;
pub mod jwks;
pub mod kube;
pub mod kube_config;
pub mod kubeconfig;
pub mod manifest;
pub mod mesh_config;
pub mod networks;
pub mod remote;
pub mod watch;
