//! Encode once, send many: resources are encoded a single time and responses are assembled from
//! their bytes, so a push to K proxies costs K memory copies, not K protobuf encodings. A list many
//! proxies share (a wildcard CDS or LDS) is encoded once as a block that every SotW response
//! carrying it references: such a response is sent as segments, and the block is never copied.
//!
//! The decoder here reads requests with prost.

use std::hash::{Hash, Hasher};
use std::marker::PhantomData;
use std::sync::{Arc, OnceLock};

use bytes::{BufMut, Bytes, BytesMut};
use prost::encoding::{encode_key, encode_varint, encoded_len_varint, key_len, WireType};
use prost::{Message, Name};
use tonic::codec::{DecodeBuf, Decoder};
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
        Self::from_encoded(name, &M::type_url(), message.encode_to_vec())
    }

    /// A resource of `type_url` whose message is already encoded as `value`.
    pub fn from_encoded(name: impl Into<Arc<str>>, type_url: &str, value: Vec<u8>) -> Self {
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

/// The length of a length-delimited field as written even when empty.
fn field_len(tag: u32, len: usize) -> usize {
    key_len(tag) + encoded_len_varint(len as u64) + len
}

/// The length of a bytes field as `put_bytes` writes it: nothing when empty.
fn bytes_field_len(tag: u32, len: usize) -> usize {
    match len {
        0 => 0,
        len => field_len(tag, len),
    }
}

/// Resources many proxies receive together, with their SotW encoding (the `resources` fields of a
/// `DiscoveryResponse`) built on first use and then shared by every response that carries them.
#[derive(Debug, Default)]
pub struct SharedList {
    pub resources: Vec<Arc<Resource>>,
    sotw: OnceLock<Bytes>,
}

impl SharedList {
    pub fn new(resources: Vec<Arc<Resource>>) -> Self {
        Self {
            resources,
            sotw: OnceLock::new(),
        }
    }

    fn sotw_block(&self) -> &Bytes {
        self.sotw.get_or_init(|| {
            let mut buf = BytesMut::with_capacity(resource_fields_len(&self.resources));
            put_resource_fields(&mut buf, &self.resources);
            buf.freeze()
        })
    }
}

/// The resources of one response: a shared list, whole, then resources built for this proxy.
#[derive(Debug, Default)]
pub struct Listing {
    pub shared: Option<Arc<SharedList>>,
    pub own: Vec<Arc<Resource>>,
}

impl Listing {
    pub fn own(own: Vec<Arc<Resource>>) -> Self {
        Self { shared: None, own }
    }

    pub fn shared(shared: Arc<SharedList>) -> Self {
        Self {
            shared: Some(shared),
            own: Vec::new(),
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arc<Resource>> {
        let shared = self.shared.as_deref().map_or(&[][..], |s| &s.resources);
        shared.iter().chain(&self.own)
    }

    pub fn len(&self) -> usize {
        self.shared.as_ref().map_or(0, |s| s.resources.len()) + self.own.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// An encoded response as the segments it is written in: a shared block is referenced, not copied.
#[derive(Debug, Clone, Default)]
pub struct Encoded(Vec<Bytes>);

impl Encoded {
    pub fn len(&self) -> usize {
        self.0.iter().map(Bytes::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn segments(self) -> Vec<Bytes> {
        self.0
    }

    /// The message in one piece (tests and debugging).
    pub fn to_bytes(&self) -> Bytes {
        match &self.0[..] {
            [one] => one.clone(),
            parts => parts.concat().into(),
        }
    }
}

impl From<Vec<Bytes>> for Encoded {
    fn from(segments: Vec<Bytes>) -> Self {
        Self(segments)
    }
}

impl From<Bytes> for Encoded {
    fn from(bytes: Bytes) -> Self {
        Self(vec![bytes])
    }
}

fn resource_fields_len(resources: &[Arc<Resource>]) -> usize {
    resources.iter().map(|r| field_len(2, r.any.len())).sum()
}

fn put_resource_fields(buf: &mut BytesMut, resources: &[Arc<Resource>]) {
    for r in resources {
        encode_key(2, WireType::LengthDelimited, buf);
        encode_varint(r.any.len() as u64, buf);
        buf.put_slice(&r.any);
    }
}

/// An encoded `DiscoveryResponse`: the version, the shared block by reference, then the proxy's own
/// resources, the type and the nonce (fields may come in any order; resources keep theirs).
pub fn sotw_response(type_url: &str, version: &str, nonce: &str, listing: &Listing) -> Encoded {
    let mut head = BytesMut::with_capacity(field_len(1, version.len()));
    put_bytes(&mut head, 1, version.as_bytes());
    let mut segments = vec![head.freeze()];
    if let Some(shared) = listing.shared.as_ref().filter(|s| !s.resources.is_empty()) {
        segments.push(shared.sotw_block().clone());
    }
    let mut tail = BytesMut::with_capacity(
        resource_fields_len(&listing.own)
            + field_len(4, type_url.len())
            + field_len(5, nonce.len()),
    );
    put_resource_fields(&mut tail, &listing.own);
    put_bytes(&mut tail, 4, type_url.as_bytes());
    put_bytes(&mut tail, 5, nonce.as_bytes());
    segments.push(tail.freeze());
    Encoded(segments)
}

/// An encoded `DeltaDiscoveryResponse`.
pub fn delta_response(
    type_url: &str,
    system_version: &str,
    nonce: &str,
    resources: &[Arc<Resource>],
    removed: &[String],
) -> Bytes {
    // The Any is written even when empty; the name is empty for an unnamed resource (NDS).
    let entry_len = |r: &Resource| {
        bytes_field_len(3, r.name.len())
            + bytes_field_len(1, r.version.len())
            + field_len(2, r.any.len())
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

/// Decodes ADS requests with prost.
pub struct ProstDecoder<T>(PhantomData<T>);

impl<T> Default for ProstDecoder<T> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

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
        let listing = Listing {
            shared: Some(Arc::new(SharedList::new(vec![cla("a")]))),
            own: vec![cla("b")],
        };
        let encoded = sotw_response(&type_url, "v1", "n1", &listing);
        let decoded = DiscoveryResponse::decode(encoded.to_bytes()).unwrap();
        assert_eq!(
            (decoded.version_info.as_str(), decoded.nonce.as_str()),
            ("v1", "n1")
        );
        assert_eq!(decoded.type_url, type_url);
        assert_eq!(decoded.resources.len(), 2);
        let first = ClusterLoadAssignment::decode(&decoded.resources[0].value[..]).unwrap();
        assert_eq!(first.cluster_name, "a");
        assert_eq!(decoded.resources[0].type_url, type_url);
        let second = ClusterLoadAssignment::decode(&decoded.resources[1].value[..]).unwrap();
        assert_eq!(
            second.cluster_name, "b",
            "shared resources first, then the proxy's own"
        );
    }

    #[test]
    fn responses_reference_the_shared_block_instead_of_copying_it() {
        let type_url = ClusterLoadAssignment::type_url();
        let shared = Arc::new(SharedList::new(vec![cla("a"), cla("b")]));
        let listing = |shared: &Arc<SharedList>| Listing {
            shared: Some(shared.clone()),
            own: Vec::new(),
        };
        let one = sotw_response(&type_url, "v1", "n1", &listing(&shared)).segments();
        let two = sotw_response(&type_url, "v1", "n2", &listing(&shared)).segments();
        assert_eq!(
            one[1].as_ptr(),
            two[1].as_ptr(),
            "one block, referenced twice"
        );
    }

    #[test]
    fn an_unnamed_resource_is_framed_to_its_length() {
        // NDS sends one resource without a name: the entry's length must not count the name.
        let unnamed = Arc::new(Resource::encode("", &ClusterLoadAssignment::default()));
        let bytes = delta_response("t", "s1", "n1", &[unnamed.clone(), cla("b")], &[]);
        let decoded = DeltaDiscoveryResponse::decode(bytes).unwrap();
        let names: Vec<&str> = decoded.resources.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["", "b"]);
        assert_eq!(decoded.type_url, "t");
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
