//! Input quoted into messages, bounded: an error about a 10 KB node id must not be 10 KB itself
//! (gRPC clients refuse trailers over 8 KB and would report RESOURCE_EXHAUSTED instead).

use std::fmt;

/// Longest quoted excerpt, in bytes of the escaped text.
pub const MAX_QUOTE: usize = 200;

/// Displays its input Debug-quoted, cut after [`MAX_QUOTE`] bytes with the full length noted.
pub struct Quoted<'a>(pub &'a str);

/// `Quoted` as a String, for error fields.
pub fn quote(s: &str) -> String {
    Quoted(s).to_string()
}

/// A message from elsewhere (a parser's error, say) that may carry input: cut after [`MAX_QUOTE`]
/// bytes, at a character boundary.
pub fn clip(s: &str) -> String {
    if s.len() <= MAX_QUOTE {
        return s.to_string();
    }
    let mut end = MAX_QUOTE;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes)", &s[..end], s.len())
}

impl fmt::Display for Quoted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = String::from("\"");
        for c in self.0.chars() {
            let escaped: String = c.escape_debug().collect();
            if out.len() + escaped.len() > MAX_QUOTE {
                return write!(f, "{out}\"… ({} bytes)", self.0.len());
            }
            out.push_str(&escaped);
        }
        write!(f, "{out}\"")
    }
}

/// FNV-1a of a string: a hash that is the same in every build and on every machine (std's is
/// neither), for names and choices that must agree across restarts and replicas.
pub fn stable_hash(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_input_is_quoted_whole() {
        assert_eq!(quote("a\"b"), "\"a\\\"b\"");
    }

    #[test]
    fn long_input_is_cut_and_its_length_named() {
        let long = "é".repeat(10_000);
        let q = quote(&long);
        assert!(q.len() <= MAX_QUOTE + 40, "{}", q.len());
        assert!(q.ends_with("… (20000 bytes)"), "{q}");
        let control = "\u{1}".repeat(10_000);
        assert!(quote(&control).len() <= MAX_QUOTE + 40);
        assert!(clip(&long).len() <= MAX_QUOTE + 40);
        assert_eq!(clip("short"), "short");
    }
}
