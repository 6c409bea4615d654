//! Envoy's API by reflection: the descriptors of every Envoy message (compiled in by build.rs),
//! protobuf JSON read into them, Istio's merge of one message into another, and a deterministic
//! encoding. Config dumps print through it, and EnvoyFilter patches (JSON written against Envoy's
//! API) are checked and applied with it.

mod canonical;
mod merge;

use std::sync::OnceLock;

use prost::Message;
use prost_reflect::{DescriptorPool, DeserializeOptions, DynamicMessage, MessageDescriptor};
use thiserror::Error;

pub use canonical::canonical_bytes;
pub use merge::{merge, ListMerge};

use crate::text::clip;

static ENVOY_DESCRIPTORS: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/envoy_descriptors.bin"));

pub const ANY: &str = "google.protobuf.Any";
pub const TYPE_URL_PREFIX: &str = "type.googleapis.com/";

/// Why a message cannot be read or written by reflection.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ApiError {
    #[error("the Envoy API descriptors do not load: {0}")]
    Descriptors(String),
    #[error("no message {0} in the Envoy API meshpilot builds against")]
    UnknownType(String),
    #[error("{}", clip(.0))]
    Json(String),
    #[error("{}", clip(.0))]
    Decode(String),
}

/// Every message of Envoy's API (and the configs meshpilot wraps in it), loaded on first use.
pub fn pool() -> Result<&'static DescriptorPool, ApiError> {
    static POOL: OnceLock<Result<DescriptorPool, String>> = OnceLock::new();
    POOL.get_or_init(|| DescriptorPool::decode(ENVOY_DESCRIPTORS).map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| ApiError::Descriptors(e.clone()))
}

/// The descriptor of a message by its full name (`envoy.config.listener.v3.Listener`).
pub fn descriptor(full_name: &str) -> Result<MessageDescriptor, ApiError> {
    pool()?
        .get_message_by_name(full_name)
        .ok_or_else(|| ApiError::UnknownType(full_name.to_string()))
}

/// The message a type URL (`type.googleapis.com/<full name>`) names.
pub fn descriptor_of_url(type_url: &str) -> Result<MessageDescriptor, ApiError> {
    let name = type_url.rsplit('/').next().unwrap_or(type_url);
    descriptor(name)
}

/// Reads protobuf JSON (field names as in the .proto or lowerCamelCase, `Any` with `@type`) into a
/// message of `full_name`; unknown fields and types are refused, the error naming where.
pub fn from_json(full_name: &str, json: &serde_json::Value) -> Result<DynamicMessage, ApiError> {
    let desc = descriptor(full_name)?;
    let options = DeserializeOptions::new().deny_unknown_fields(true);
    let mut track = serde_path_to_error::Track::new();
    let deserializer = serde_path_to_error::Deserializer::new(json, &mut track);
    DynamicMessage::deserialize_with_options(desc, deserializer, &options).map_err(|e| {
        let path = track.path().to_string();
        match path.as_str() {
            "." | "" => ApiError::Json(e.to_string()),
            _ => ApiError::Json(format!("{path}: {e}")),
        }
    })
}

/// A typed message as its dynamic counterpart (to merge into or walk).
pub fn to_dynamic<M: Message + prost::Name>(message: &M) -> Result<DynamicMessage, ApiError> {
    let desc = descriptor(&M::full_name())?;
    DynamicMessage::decode(desc, message.encode_to_vec().as_slice())
        .map_err(|e| ApiError::Decode(e.to_string()))
}

/// A dynamic message as its typed counterpart.
pub fn to_typed<M: Message + Default>(message: &DynamicMessage) -> Result<M, ApiError> {
    message
        .transcode_to()
        .map_err(|e| ApiError::Decode(e.to_string()))
}

/// Decodes an `Any`'s payload by its type URL.
pub fn unpack(type_url: &str, value: &[u8]) -> Result<DynamicMessage, ApiError> {
    DynamicMessage::decode(descriptor_of_url(type_url)?, value)
        .map_err(|e| ApiError::Decode(format!("{type_url}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_with_an_any_reads_both_spellings_and_names_an_unknown_field() {
        let filter = serde_json::json!({
            "name": "envoy.filters.http.lua",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
                "defaultSourceCode": {"inlineString": "function envoy_on_request(h) end"},
            }
        });
        let message = from_json(
            "envoy.extensions.filters.network.http_connection_manager.v3.HttpFilter",
            &filter,
        )
        .expect("reads");
        assert!(message.has_field_by_name("typed_config"));

        let typo = serde_json::json!({"name": "x", "typed_confg": {}});
        let error = from_json(
            "envoy.extensions.filters.network.http_connection_manager.v3.HttpFilter",
            &typo,
        )
        .unwrap_err();
        assert!(error.to_string().contains("typed_confg"), "{error}");

        let unknown =
            serde_json::json!({"typed_config": {"@type": "type.googleapis.com/envoy.Nope"}});
        let error = from_json(
            "envoy.extensions.filters.network.http_connection_manager.v3.HttpFilter",
            &unknown,
        )
        .unwrap_err();
        assert!(error.to_string().contains("typed_config"), "{error}");
    }
}
