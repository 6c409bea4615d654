//! The naive anchor's gRPC codec. Requests are decoded with prost; a response is written as its
//! small envelope around resources already encoded as `google.protobuf.Any` (bytes shared by every
//! stream), so no resource is decoded or encoded again per stream. tonic copies what the encoder
//! writes into the stream's frame: one memory copy per resource sent.

use std::marker::PhantomData;
use std::sync::Arc;

use bytes::{BufMut, Bytes};
use prost::encoding::{encode_key, encode_varint, encoded_len_varint, key_len, WireType};
use tonic::codec::{Codec, EncodeBuf, Encoder};
use tonic::Status;

/// A response to write: its envelope's fields and its resources' shared `Any` bytes.
pub enum Envelope {
    /// A `DiscoveryResponse`.
    Sotw {
        version_info: String,
        resources: Vec<Bytes>,
        type_url: String,
        nonce: String,
    },
    /// A `DeltaDiscoveryResponse`.
    Delta {
        resources: Vec<DeltaResource>,
        type_url: String,
        nonce: String,
    },
}

/// A Delta `Resource`: the name and version wrapped around the shared `Any`.
pub struct DeltaResource {
    pub name: Arc<str>,
    pub version: String,
    pub any: Bytes,
}

// Field numbers, from envoy/service/discovery/v3/discovery.proto.
const SOTW_VERSION_INFO: u32 = 1;
const SOTW_RESOURCES: u32 = 2;
const DELTA_RESOURCES: u32 = 2;
const TYPE_URL: u32 = 4;
const NONCE: u32 = 5;
const RESOURCE_VERSION: u32 = 1;
const RESOURCE_ANY: u32 = 2;
const RESOURCE_NAME: u32 = 3;

impl DeltaResource {
    fn encoded_len(&self) -> usize {
        string_len(RESOURCE_VERSION, &self.version)
            + message_len(RESOURCE_ANY, self.any.len())
            + string_len(RESOURCE_NAME, &self.name)
    }
}

impl Envelope {
    fn encoded_len(&self) -> usize {
        match self {
            Envelope::Sotw {
                version_info,
                resources,
                type_url,
                nonce,
            } => {
                string_len(SOTW_VERSION_INFO, version_info)
                    + resources
                        .iter()
                        .map(|any| message_len(SOTW_RESOURCES, any.len()))
                        .sum::<usize>()
                    + string_len(TYPE_URL, type_url)
                    + string_len(NONCE, nonce)
            }
            Envelope::Delta {
                resources,
                type_url,
                nonce,
            } => {
                resources
                    .iter()
                    .map(|r| message_len(DELTA_RESOURCES, r.encoded_len()))
                    .sum::<usize>()
                    + string_len(TYPE_URL, type_url)
                    + string_len(NONCE, nonce)
            }
        }
    }

    /// Writes the message as prost would: fields in number order, empty strings left out.
    fn encode(&self, buf: &mut impl BufMut) {
        match self {
            Envelope::Sotw {
                version_info,
                resources,
                type_url,
                nonce,
            } => {
                put_string(buf, SOTW_VERSION_INFO, version_info);
                for any in resources {
                    put_message(buf, SOTW_RESOURCES, any.len());
                    buf.put_slice(any);
                }
                put_string(buf, TYPE_URL, type_url);
                put_string(buf, NONCE, nonce);
            }
            Envelope::Delta {
                resources,
                type_url,
                nonce,
            } => {
                for r in resources {
                    put_message(buf, DELTA_RESOURCES, r.encoded_len());
                    put_string(buf, RESOURCE_VERSION, &r.version);
                    put_message(buf, RESOURCE_ANY, r.any.len());
                    buf.put_slice(&r.any);
                    put_string(buf, RESOURCE_NAME, &r.name);
                }
                put_string(buf, TYPE_URL, type_url);
                put_string(buf, NONCE, nonce);
            }
        }
    }
}

/// A string field's length on the wire (none when empty).
fn string_len(tag: u32, s: &str) -> usize {
    match s.len() {
        0 => 0,
        len => message_len(tag, len),
    }
}

/// A length-delimited field's length on the wire, written even when empty (an embedded message).
fn message_len(tag: u32, len: usize) -> usize {
    key_len(tag) + encoded_len_varint(len as u64) + len
}

fn put_string(buf: &mut impl BufMut, tag: u32, s: &str) {
    if !s.is_empty() {
        put_message(buf, tag, s.len());
        buf.put_slice(s.as_bytes());
    }
}

/// The key and length of a length-delimited field; its body follows.
fn put_message(buf: &mut impl BufMut, tag: u32, len: usize) {
    encode_key(tag, WireType::LengthDelimited, buf);
    encode_varint(len as u64, buf);
}

/// ADS requests of type `Req` in, envelopes out.
pub struct AdsCodec<Req>(PhantomData<fn() -> Req>);

impl<Req> Default for AdsCodec<Req> {
    fn default() -> Self {
        AdsCodec(PhantomData)
    }
}

impl<Req: prost::Message + Default + Send + 'static> Codec for AdsCodec<Req> {
    type Encode = Envelope;
    type Decode = Req;
    type Encoder = EnvelopeEncoder;
    type Decoder = tonic_prost::ProstDecoder<Req>;

    fn encoder(&mut self) -> EnvelopeEncoder {
        EnvelopeEncoder
    }

    fn decoder(&mut self) -> Self::Decoder {
        tonic_prost::ProstDecoder::default()
    }
}

pub struct EnvelopeEncoder;

impl Encoder for EnvelopeEncoder {
    type Item = Envelope;
    type Error = Status;

    fn encode(&mut self, item: Envelope, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        // One reservation for the whole message rather than growing as the resources are copied.
        dst.reserve(item.encoded_len());
        item.encode(dst);
        Ok(())
    }
}
