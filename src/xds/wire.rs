//! Encode once, send many: resources are encoded a single time and responses are assembled from
//! their bytes, so a push to K proxies costs K memory copies, not K protobuf encodings.
//!
//! The tonic codec here writes such pre-assembled responses as they are and decodes requests with
//! prost.

use std::hash::{Hash, Hasher};
use std::marker::PhantomData;
use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};
use prost::encoding::{encode_key, encode_varint, encoded_len_varint, key_len, WireType};
use prost::{Message, Name};
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::Status;

/// One resource, encoded as a `google.protobuf.Any`.
#[derive(Debug, PartialEq, Eq)]
pub struct Resource {
    pub name: Arc<str>,
    pub any: Bytes,
    /// Content hash, used as the Delta resource version.
    pub version: Arc<str>,
}

impl Resource {
    pub fn encode<M: Message + Name>(name: impl Into<Arc<str>>, message: &M) -> Self {
        let value = message.encode_to_vec();
        let type_url = M::type_url();
        let mut any = BytesMut::with_capacity(value.len() + type_url.len() + 16);
        put_bytes(&mut any, 1, type_url.as_bytes());
        put_bytes(&mut any, 2, &value);
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        value.hash(&mut hasher);
        Self {
            name: name.into(),
            any: any.freeze(),
            version: format!("{:016x}", hasher.finish()).into(),
        }
    }
}

fn put_bytes(buf: &mut BytesMut, tag: u32, bytes: &[u8]) {
    if bytes.is_empty() {
        return;
    }
    encode_key(tag, WireType::LengthDelimited, buf);
    encode_varint(bytes.len() as u64, buf);
    buf.put_slice(bytes);
}

fn field_len(tag: u32, len: usize) -> usize {
    key_len(tag) + encoded_len_varint(len as u64) + len
}

/// An encoded `DiscoveryResponse`.
pub fn sotw_response(
    type_url: &str,
    version: &str,
    nonce: &str,
    resources: &[Arc<Resource>],
) -> Bytes {
    let size: usize = resources
        .iter()
        .map(|r| field_len(2, r.any.len()))
        .sum::<usize>()
        + field_len(1, version.len())
        + field_len(4, type_url.len())
        + field_len(5, nonce.len());
    let mut buf = BytesMut::with_capacity(size);
    put_bytes(&mut buf, 1, version.as_bytes());
    for r in resources {
        encode_key(2, WireType::LengthDelimited, &mut buf);
        encode_varint(r.any.len() as u64, &mut buf);
        buf.put_slice(&r.any);
    }
    put_bytes(&mut buf, 4, type_url.as_bytes());
    put_bytes(&mut buf, 5, nonce.as_bytes());
    buf.freeze()
}

/// An encoded `DeltaDiscoveryResponse`.
pub fn delta_response(
    type_url: &str,
    system_version: &str,
    nonce: &str,
    resources: &[Arc<Resource>],
    removed: &[String],
) -> Bytes {
    let entry_len = |r: &Resource| {
        field_len(3, r.name.len()) + field_len(1, r.version.len()) + field_len(2, r.any.len())
    };
    let size: usize = resources
        .iter()
        .map(|r| field_len(2, entry_len(r)))
        .sum::<usize>()
        + removed.iter().map(|n| field_len(6, n.len())).sum::<usize>()
        + field_len(1, system_version.len())
        + field_len(4, type_url.len())
        + field_len(5, nonce.len());
    let mut buf = BytesMut::with_capacity(size);
    put_bytes(&mut buf, 1, system_version.as_bytes());
    for r in resources {
        encode_key(2, WireType::LengthDelimited, &mut buf);
        encode_varint(entry_len(r) as u64, &mut buf);
        put_bytes(&mut buf, 1, r.version.as_bytes());
        // An empty Any still has to be present: a resource without one means "removed".
        encode_key(2, WireType::LengthDelimited, &mut buf);
        encode_varint(r.any.len() as u64, &mut buf);
        buf.put_slice(&r.any);
        put_bytes(&mut buf, 3, r.name.as_bytes());
    }
    put_bytes(&mut buf, 4, type_url.as_bytes());
    put_bytes(&mut buf, 5, nonce.as_bytes());
    for name in removed {
        put_bytes(&mut buf, 6, name.as_bytes());
    }
    buf.freeze()
}

/// Codec for ADS: requests decoded by prost, responses written as pre-encoded bytes.
pub struct AdsCodec<Req>(PhantomData<Req>);

impl<Req> Default for AdsCodec<Req> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<Req: Message + Default + Send + 'static> Codec for AdsCodec<Req> {
    type Encode = Bytes;
    type Decode = Req;
    type Encoder = BytesEncoder;
    type Decoder = ProstDecoder<Req>;

    fn encoder(&mut self) -> Self::Encoder {
        BytesEncoder
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstDecoder(PhantomData)
    }
}

pub struct BytesEncoder;

impl Encoder for BytesEncoder {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

pub struct ProstDecoder<T>(PhantomData<T>);

impl<T: Message + Default> Decoder for ProstDecoder<T> {
    type Item = T;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<T>, Status> {
        T::decode(src)
            .map(Some)
            .map_err(|e| Status::invalid_argument(format!("malformed request: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
    use envoy_types::pb::envoy::service::discovery::v3::{
        DeltaDiscoveryResponse, DiscoveryResponse,
    };

    fn cla(name: &str) -> Arc<Resource> {
        let cla = ClusterLoadAssignment {
            cluster_name: name.into(),
            ..Default::default()
        };
        Arc::new(Resource::encode(name, &cla))
    }

    #[test]
    fn sotw_bytes_decode_as_a_discovery_response() {
        let type_url = ClusterLoadAssignment::type_url();
        let bytes = sotw_response(&type_url, "v1", "n1", &[cla("a"), cla("b")]);
        let decoded = DiscoveryResponse::decode(bytes).unwrap();
        assert_eq!(
            (decoded.version_info.as_str(), decoded.nonce.as_str()),
            ("v1", "n1")
        );
        assert_eq!(decoded.type_url, type_url);
        assert_eq!(decoded.resources.len(), 2);
        let first = ClusterLoadAssignment::decode(&decoded.resources[0].value[..]).unwrap();
        assert_eq!(first.cluster_name, "a");
        assert_eq!(decoded.resources[0].type_url, type_url);
    }

    #[test]
    fn delta_bytes_decode_as_a_delta_response() {
        let type_url = ClusterLoadAssignment::type_url();
        let a = cla("a");
        let bytes = delta_response(
            &type_url,
            "s1",
            "n2",
            std::slice::from_ref(&a),
            &["gone".to_string()],
        );
        let decoded = DeltaDiscoveryResponse::decode(bytes).unwrap();
        assert_eq!(decoded.nonce, "n2");
        assert_eq!(decoded.removed_resources, vec!["gone".to_string()]);
        let r = &decoded.resources[0];
        assert_eq!((r.name.as_str(), r.version.as_str()), ("a", &*a.version));
        assert_eq!(r.resource.as_ref().unwrap().type_url, type_url);
    }

    #[test]
    fn version_follows_content() {
        assert_eq!(cla("a").version, cla("a").version);
        assert_ne!(cla("a").version, cla("b").version);
    }
}
