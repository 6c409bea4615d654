//! The xDS server: proxy identity, generators, the per-stream protocol, and the push pipeline.

mod debug;
pub mod generate;
mod grpc;
pub mod introspect;
pub mod istio_protos;
pub mod name_table;
pub mod protocol;
pub mod proxy;
pub mod push;
mod resource_type;
pub mod server;
mod session;
mod stream;
pub mod wire;
