//! meshpilot: a multicluster service-mesh control plane compatible with Istio's formats.
//!
//! Data flows sources → registries → model → (xDS) → proxies; see docs/architecture.md.

pub mod admin;
pub mod aggregate;
pub mod app;
pub mod compare;
pub mod config;
pub mod debug;
pub mod doctor;
pub mod envoy_api;
pub mod inject;
pub mod install;
pub mod istio;
pub mod kube_client;
pub mod kube_error;
pub mod leader;
pub mod listen;
pub mod metrics;
pub mod model;
pub mod registry;
pub mod remote_secret;
pub mod security;
pub mod sources;
pub mod supervise;
pub mod text;
pub mod webhook;
pub mod xds;
pub mod yaml;
