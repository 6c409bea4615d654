//! Inputs as a fuzzer makes them: a seed from a realistic corpus, changed by a few mutations
//! (byte flips, cuts, splices with other seeds, syntax tokens, huge numbers, deep nesting, long
//! strings, unicode); proptest generates and shrinks the mutation lists.

use proptest::prelude::*;
use proptest::sample::Index;

/// Syntax and values that break parsers: YAML and JSON structure, anchors and aliases, tags,
/// numbers beyond every integer type, control characters and multi-byte unicode.
const TOKENS: &[&str] = &[
    "{",
    "}",
    "[",
    "]",
    ":",
    ": ",
    ",",
    "- ",
    "\n",
    "\n  ",
    "\n- ",
    "---\n",
    "...\n",
    "&a ",
    "*a",
    "&b [*a, *a, *a, *a]",
    "<<: *a\n",
    "? ",
    "!!binary ",
    "!!str ",
    "!!int ",
    "!tag ",
    "!!map ",
    "'",
    "\"",
    "\\",
    "\\u0000",
    "#",
    "|\n",
    ">-\n",
    "%YAML 1.2\n",
    "null",
    "~",
    "true",
    "-",
    "0",
    "-1",
    "1e999",
    "-9223372036854775809",
    "18446744073709551616",
    "0x7fffffff",
    ".nan",
    ".inf",
    "4294967296",
    "65536",
    "99999999999999999999999999999999",
    "1.5",
    "\t",
    "\r\n",
    "\u{0}",
    "\u{7f}",
    "\u{feff}",
    "é",
    "\u{10ffff}",
    "💥",
    "\u{202e}",
    "~",
    "/",
    "..",
    "*",
    "a.b.c",
    "::1",
    "10.0.0.1",
    "0.0.0.0/0",
    "300.1.1.1",
    "spiffe://",
    "=",
    "%",
    "$",
    "@",
    "-----BEGIN CERTIFICATE-----\n",
    "-----END CERTIFICATE-----\n",
    "-----BEGIN PRIVATE KEY-----\n",
    "-----END PRIVATE KEY-----\n",
    "-----BEGIN CERTIFICATE REQUEST-----\n",
    "-----END CERTIFICATE REQUEST-----\n",
    "====",
    "MIIB",
    "AAAA",
    "kind: List\nitems:\n",
    "apiVersion: v1\n",
    "metadata: {}\n",
    "spec: {}\n",
    "\"metadata\":{}",
    "\"spec\":null",
    "\"object\":",
    "\"request\":{}",
    "[[[[[[[[",
];

#[derive(Clone, Debug)]
pub enum Mutation {
    /// XOR one byte.
    Flip(Index, u8),
    /// Remove a range.
    Delete(Index, usize),
    /// Insert a token.
    Token(Index, usize),
    /// Keep only a prefix.
    Truncate(Index),
    /// Insert a piece of another seed.
    Splice(Index, usize, Index, usize),
    /// Repeat a piece many times.
    Repeat(Index, usize, usize),
    /// Insert `n` opening brackets (and as many closing ones later, sometimes).
    Nest(Index, usize, bool),
    /// Insert one very long scalar.
    Long(Index, usize, u8),
}

fn mutation(seeds: usize) -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<Index>(), 1..=255u8).prop_map(|(at, x)| Mutation::Flip(at, x)),
        2 => (any::<Index>(), 1..64usize).prop_map(|(at, n)| Mutation::Delete(at, n)),
        4 => (any::<Index>(), 0..TOKENS.len()).prop_map(|(at, t)| Mutation::Token(at, t)),
        1 => any::<Index>().prop_map(Mutation::Truncate),
        2 => (any::<Index>(), 0..seeds, any::<Index>(), 1..512usize)
            .prop_map(|(at, seed, from, n)| Mutation::Splice(at, seed, from, n)),
        1 => (any::<Index>(), 1..32usize, 2..200usize)
            .prop_map(|(at, n, times)| Mutation::Repeat(at, n, times)),
        1 => (any::<Index>(), 1..400usize, any::<bool>())
            .prop_map(|(at, depth, close)| Mutation::Nest(at, depth, close)),
        1 => (any::<Index>(), 1..100_000usize, b'a'..=b'z')
            .prop_map(|(at, n, c)| Mutation::Long(at, n, c)),
    ]
}

/// Applies one mutation; `seeds` feed splices.
fn apply(input: &mut Vec<u8>, m: &Mutation, seeds: &[Vec<u8>]) {
    let at = |i: &Index, len: usize| i.index(len + 1);
    match m {
        Mutation::Flip(i, x) if !input.is_empty() => {
            let p = i.index(input.len());
            input[p] ^= x;
        }
        Mutation::Flip(..) => {}
        Mutation::Delete(i, n) => {
            let p = at(i, input.len());
            let end = (p + n).min(input.len());
            input.drain(p..end);
        }
        Mutation::Token(i, t) => {
            let p = at(i, input.len());
            input.splice(p..p, TOKENS[*t].bytes());
        }
        Mutation::Truncate(i) => input.truncate(at(i, input.len())),
        Mutation::Splice(i, seed, from, n) => {
            let other = &seeds[*seed];
            let start = at(from, other.len());
            let piece = other[start..(start + n).min(other.len())].to_vec();
            let p = at(i, input.len());
            input.splice(p..p, piece);
        }
        Mutation::Repeat(i, n, times) => {
            let p = at(i, input.len());
            let piece = input[p..(p + n).min(input.len())].to_vec();
            let copies = piece.repeat(*times);
            input.splice(p..p, copies);
        }
        Mutation::Nest(i, depth, close) => {
            let p = at(i, input.len());
            let (open, shut) = match depth % 2 {
                0 => (b'[', b']'),
                _ => (b'{', b'}'),
            };
            let mut piece = vec![open; *depth];
            if *close {
                piece.extend(std::iter::repeat_n(shut, *depth));
            }
            input.splice(p..p, piece);
        }
        Mutation::Long(i, n, c) => {
            let p = at(i, input.len());
            input.splice(p..p, std::iter::repeat_n(*c, *n));
        }
    }
}

/// A seed with up to `max` mutations applied, as bytes.
pub fn mutated_bytes(seeds: Vec<Vec<u8>>, max: usize) -> impl Strategy<Value = Vec<u8>> {
    assert!(!seeds.is_empty(), "a corpus needs seeds");
    let count = seeds.len();
    (
        0..count,
        proptest::collection::vec(mutation(count), 0..=max),
    )
        .prop_map(move |(seed, mutations)| {
            let mut input = seeds[seed].clone();
            for m in &mutations {
                apply(&mut input, m, &seeds);
            }
            input
        })
}

/// As [`mutated_bytes`], for APIs that take text (invalid UTF-8 replaced, as a reader would).
pub fn mutated_text(seeds: &[&str], max: usize) -> impl Strategy<Value = String> {
    let seeds = seeds.iter().map(|s| s.as_bytes().to_vec()).collect();
    mutated_bytes(seeds, max).prop_map(|b| String::from_utf8_lossy(&b).into_owned())
}

/// Text from scratch: tokens and short runs of printable characters, with no seed at all.
pub fn generated_text() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        (0..TOKENS.len()).prop_map(|t| TOKENS[t].to_string()),
        "[ -~]{1,12}",
        "\\PC{1,4}",
    ];
    proptest::collection::vec(piece, 0..64).prop_map(|pieces| pieces.concat())
}

/// Any JSON value, nested a little: what a structure-aware mutation puts in place of another.
pub fn json_value() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::Value;
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        "\\PC{0,16}".prop_map(Value::String),
        (0..TOKENS.len()).prop_map(|t| Value::String(TOKENS[t].to_string())),
        (1..100_000usize).prop_map(|n| Value::String("x".repeat(n))),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            proptest::collection::btree_map("[a-zA-Z]{0,8}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// The JSON pointers of every node of `value`, the root first.
fn pointers(value: &serde_json::Value, at: String, out: &mut Vec<String>) {
    match value {
        serde_json::Value::Object(map) => {
            out.push(at.clone());
            for (key, child) in map {
                let key = key.replace('~', "~0").replace('/', "~1");
                pointers(child, format!("{at}/{key}"), out);
            }
        }
        serde_json::Value::Array(items) => {
            out.push(at.clone());
            for (i, child) in items.iter().enumerate() {
                pointers(child, format!("{at}/{i}"), out);
            }
        }
        _ => out.push(at),
    }
}

/// A seed document with up to `max` of its nodes replaced by generated values: deeper than byte
/// mutations, which mostly stop at the syntax.
pub fn mutated_json(
    seeds: Vec<serde_json::Value>,
    max: usize,
) -> impl Strategy<Value = serde_json::Value> {
    let count = seeds.len();
    let edit = (any::<Index>(), json_value());
    (0..count, proptest::collection::vec(edit, 1..=max)).prop_map(move |(seed, edits)| {
        let mut doc = seeds[seed].clone();
        for (at, replacement) in edits {
            let mut all = Vec::new();
            pointers(&doc, String::new(), &mut all);
            let pointer = &all[at.index(all.len())];
            if let Some(node) = doc.pointer_mut(pointer) {
                *node = replacement;
            }
        }
        doc
    })
}
