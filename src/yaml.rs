//! YAML from outside, with its aliases bounded. The YAML parser replays an anchored node for every
//! alias of it and limits only the number of aliases, so a few kilobytes of nested aliases expand
//! to millions of nodes (a "billion laughs"): text of n bytes could make meshpilot build O(n²) of
//! them. [`check_aliases`] counts the nodes a stream expands to, stopping at the budget, before
//! any parser builds anything from it.

use std::cell::Cell;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, EnumAccess, MapAccess, SeqAccess, Visitor};
use thiserror::Error;

/// Nodes a stream may expand to beyond one per byte of its text (which no text without aliases
/// exceeds): room for the anchors and merge keys people write, not for a multiplication.
const ALLOWANCE: usize = 10_000;

#[derive(Debug, Error, PartialEq, Eq)]
#[error("its aliases expand it to more than {limit} nodes")]
pub struct AliasBomb {
    /// The document (from 1) where the budget ran out.
    pub document: usize,
    pub limit: usize,
}

/// Refuses a YAML stream whose aliases expand it beyond its size in nodes plus an allowance.
/// Any other problem is left to the parser that reads the stream next, which reports it.
pub fn check_aliases(text: &str) -> Result<(), AliasBomb> {
    let limit = text.len().saturating_add(ALLOWANCE);
    let counter = Counter {
        nodes: Cell::new(0),
        limit,
        exceeded: Cell::new(false),
    };
    for (i, document) in serde_yaml_ng::Deserializer::from_str(text).enumerate() {
        if Count(&counter).deserialize(document).is_err() {
            return match counter.exceeded.get() {
                true => Err(AliasBomb {
                    document: i + 1,
                    limit,
                }),
                false => Ok(()),
            };
        }
    }
    Ok(())
}

struct Counter {
    nodes: Cell<usize>,
    limit: usize,
    exceeded: Cell<bool>,
}

/// Visits every node of a document (aliases replayed), counting, and builds nothing.
#[derive(Clone, Copy)]
struct Count<'a>(&'a Counter);

impl Count<'_> {
    fn node<E: de::Error>(self) -> Result<(), E> {
        let counter = self.0;
        counter.nodes.set(counter.nodes.get() + 1);
        if counter.nodes.get() > counter.limit {
            counter.exceeded.set(true);
            return Err(E::custom("too many nodes"));
        }
        Ok(())
    }
}

impl<'de> DeserializeSeed<'de> for Count<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Count<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any YAML node")
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        self.node()
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        self.node()
    }

    fn visit_i128<E: de::Error>(self, _: i128) -> Result<(), E> {
        self.node()
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        self.node()
    }

    fn visit_u128<E: de::Error>(self, _: u128) -> Result<(), E> {
        self.node()
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        self.node()
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        self.node()
    }

    fn visit_bytes<E: de::Error>(self, _: &[u8]) -> Result<(), E> {
        self.node()
    }

    fn visit_none<E: de::Error>(self) -> Result<(), E> {
        self.node()
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        self.node()
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        self.deserialize(deserializer)
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        self.deserialize(deserializer)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        self.node()?;
        while seq.next_element_seed(self)?.is_some() {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        self.node()?;
        while map.next_key_seed(self)?.is_some() {
            map.next_value_seed(self)?;
        }
        Ok(())
    }

    /// A tagged node (`!tag value`).
    fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<(), A::Error> {
        self.node()?;
        let ((), variant) = data.variant_seed(self)?;
        de::VariantAccess::newtype_variant_seed(variant, self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `levels` anchors, each a list of ten aliases of the one before.
    fn laughs(levels: usize) -> String {
        let mut text = "l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n".to_string();
        for level in 1..levels {
            let aliases = vec![format!("*l{}", level - 1); 10].join(", ");
            text.push_str(&format!("l{level}: &l{level} [{aliases}]\n"));
        }
        text
    }

    #[test]
    fn nested_aliases_that_multiply_are_refused_naming_the_document() {
        let text = format!("a: 1\n---\n{}", laughs(9));
        let refused = check_aliases(&text).unwrap_err();
        assert_eq!(refused.document, 2);
        assert!(refused.to_string().contains("aliases"), "{refused}");
        // Stopped at the budget: the count never reached the billion.
        assert_eq!(refused.limit, text.len() + ALLOWANCE);
    }

    #[test]
    fn ordinary_anchors_and_other_problems_pass() {
        assert_eq!(check_aliases(&laughs(3)), Ok(()));
        let merge = "base: &base {a: 1, b: 2}\nx: {<<: *base, c: 3}\ny: !tag {<<: *base}\n";
        assert_eq!(check_aliases(merge), Ok(()));
        // Syntax errors are the parser's to report.
        assert_eq!(check_aliases("a: [unclosed\n"), Ok(()));
        assert_eq!(check_aliases(""), Ok(()));
    }
}
