//! A deterministic encoding. Maps encode in the order of their hash maps (prost's and
//! prost-reflect's alike), so one config could be sent as different bytes by two replicas or two
//! pushes — and Envoy drains a listener's connections when its bytes change. Rewriting an encoded
//! message with every map's entries sorted (inside nested messages and `Any` payloads too) gives
//! one encoding per content.

use prost::bytes::Buf;
use prost::encoding::{decode_key, decode_varint, encode_key, encode_varint, WireType};
use prost_reflect::{Kind, MessageDescriptor};

use super::{descriptor_of_url, ANY};

/// `bytes`, a message of `desc`, with every map's entries in sorted order. Input that does not
/// parse as `desc` is returned unchanged: the encoding it came from stays the source of truth.
pub fn canonical_bytes(desc: &MessageDescriptor, bytes: &[u8]) -> Vec<u8> {
    rewrite(desc, bytes).unwrap_or_else(|| bytes.to_vec())
}

/// One field as it appears on the wire.
struct Field<'a> {
    number: u32,
    wire_type: WireType,
    /// The whole field (key included) as read.
    raw: &'a [u8],
    /// A length-delimited field's payload.
    payload: Option<&'a [u8]>,
}

fn fields(mut bytes: &[u8]) -> Option<Vec<Field<'_>>> {
    let mut out = Vec::new();
    while !bytes.is_empty() {
        let start = bytes;
        let (number, wire_type) = decode_key(&mut bytes).ok()?;
        let mut payload = None;
        match wire_type {
            WireType::Varint => {
                decode_varint(&mut bytes).ok()?;
            }
            WireType::SixtyFourBit => skip(&mut bytes, 8)?,
            WireType::ThirtyTwoBit => skip(&mut bytes, 4)?,
            WireType::LengthDelimited => {
                let len = usize::try_from(decode_varint(&mut bytes).ok()?).ok()?;
                payload = Some(bytes.get(..len)?);
                skip(&mut bytes, len)?;
            }
            WireType::StartGroup | WireType::EndGroup => return None,
        }
        let used = start.len() - bytes.len();
        out.push(Field {
            number,
            wire_type,
            raw: &start[..used],
            payload,
        });
    }
    Some(out)
}

fn skip(bytes: &mut &[u8], len: usize) -> Option<()> {
    (bytes.remaining() >= len).then(|| bytes.advance(len))
}

fn rewrite(desc: &MessageDescriptor, bytes: &[u8]) -> Option<Vec<u8>> {
    let fields = fields(bytes)?;
    if desc.full_name() == ANY {
        return Some(rewrite_any(&fields).unwrap_or_else(|| bytes.to_vec()));
    }
    let mut out = Vec::with_capacity(bytes.len());
    // A map's entries, canonical each, written together where its first entry was.
    let mut maps: Vec<(u32, Vec<Vec<u8>>)> = Vec::new();
    let mut order: Vec<Result<usize, u32>> = Vec::new();
    let mut written: Vec<Vec<u8>> = Vec::new();
    for field in &fields {
        let Some(fd) = desc.get_field(field.number) else {
            order.push(Ok(written.len()));
            written.push(field.raw.to_vec());
            continue;
        };
        let (Kind::Message(inner), WireType::LengthDelimited, Some(payload)) =
            (fd.kind(), field.wire_type, field.payload)
        else {
            order.push(Ok(written.len()));
            written.push(field.raw.to_vec());
            continue;
        };
        let body = rewrite(&inner, payload)?;
        let mut encoded = Vec::with_capacity(body.len() + 8);
        encode_key(field.number, WireType::LengthDelimited, &mut encoded);
        encode_varint(body.len() as u64, &mut encoded);
        encoded.extend_from_slice(&body);
        if fd.is_map() {
            match maps.iter_mut().find(|(n, _)| *n == field.number) {
                Some((_, entries)) => entries.push(encoded),
                None => {
                    order.push(Err(field.number));
                    maps.push((field.number, vec![encoded]));
                }
            }
        } else {
            order.push(Ok(written.len()));
            written.push(encoded);
        }
    }
    for slot in order {
        match slot {
            Ok(i) => out.extend_from_slice(&written[i]),
            Err(number) => {
                let (_, entries) = maps.iter_mut().find(|(n, _)| *n == number)?;
                entries.sort();
                entries.iter().for_each(|e| out.extend_from_slice(e));
            }
        }
    }
    Some(out)
}

/// An `Any` with its payload canonical, when its type is one of Envoy's.
fn rewrite_any(fields: &[Field<'_>]) -> Option<Vec<u8>> {
    let type_url = fields.iter().find(|f| f.number == 1)?.payload?;
    let value = fields
        .iter()
        .find(|f| f.number == 2)
        .and_then(|f| f.payload);
    let desc = descriptor_of_url(std::str::from_utf8(type_url).ok()?).ok()?;
    let body = rewrite(&desc, value.unwrap_or_default())?;
    let mut out = Vec::new();
    for (number, bytes) in [(1, type_url), (2, &body[..])] {
        if bytes.is_empty() {
            continue;
        }
        encode_key(number, WireType::LengthDelimited, &mut out);
        encode_varint(bytes.len() as u64, &mut out);
        out.extend_from_slice(bytes);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::super::{descriptor, from_json};
    use super::*;

    #[test]
    fn maps_encode_in_one_order_however_they_were_built() {
        let route = serde_json::json!({
            "name": "r",
            "match": {"prefix": "/"},
            "typed_per_filter_config": {
                "b": {"@type": "type.googleapis.com/google.protobuf.Struct", "value": {"z": 1, "a": 2, "m": 3}},
                "a": {"@type": "type.googleapis.com/google.protobuf.Struct", "value": {"y": 1, "c": 2}},
                "c": {"@type": "type.googleapis.com/google.protobuf.Struct", "value": {}},
            },
        });
        let desc = descriptor("envoy.config.route.v3.Route").unwrap();
        let encodings: std::collections::BTreeSet<Vec<u8>> = (0..16)
            .map(|_| {
                let message = from_json("envoy.config.route.v3.Route", &route).unwrap();
                canonical_bytes(&desc, &message.encode_to_vec())
            })
            .collect();
        assert_eq!(encodings.len(), 1);
        let back =
            prost_reflect::DynamicMessage::decode(desc, &encodings.first().unwrap()[..]).unwrap();
        let json = serde_json::to_value(&back).unwrap();
        assert_eq!(
            json["typedPerFilterConfig"]["b"]["value"]["m"], 3.0,
            "{json}"
        );
        assert_eq!(
            json["typedPerFilterConfig"]["a"]["value"]["c"], 2.0,
            "{json}"
        );
    }
}
