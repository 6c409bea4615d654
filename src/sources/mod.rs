//! Where clusters come from: directories of manifests, (later) Kubernetes API servers.

pub mod file;
pub mod kube;
pub mod kubeconfig;
pub mod manifest;
pub mod networks;
pub mod remote;
