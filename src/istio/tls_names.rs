//! The TLS names Envoy's BoringSSL knows, as istiod lists them (pkg/config/security/security.go
//! `ValidCipherSuites`, `ValidECDHCurves`, `IsValidCipherSuite`): a name outside them has Envoy
//! refuse the listener or cluster that carries it.

const CIPHER_SUITES: &[&str] = &[
    "ECDHE-ECDSA-AES128-GCM-SHA256",
    "ECDHE-RSA-AES128-GCM-SHA256",
    "ECDHE-ECDSA-AES256-GCM-SHA384",
    "ECDHE-RSA-AES256-GCM-SHA384",
    "ECDHE-ECDSA-CHACHA20-POLY1305",
    "ECDHE-RSA-CHACHA20-POLY1305",
    "ECDHE-ECDSA-AES128-SHA",
    "ECDHE-RSA-AES128-SHA",
    "ECDHE-ECDSA-AES256-SHA",
    "ECDHE-RSA-AES256-SHA",
    "AES128-GCM-SHA256",
    "AES256-GCM-SHA384",
    "AES128-SHA",
    "AES256-SHA",
    "DES-CBC3-SHA",
];
const ECDH_CURVES: &[&str] = &[
    "P-224",
    "P-256",
    "P-521",
    "P-384",
    "X25519",
    "X25519Kyber768Draft00",
    "X25519MLKEM768",
];

/// A cipher suite Envoy takes: a known one, `ALL`, or an expression of BoringSSL's that starts
/// with an operator (`-`, `+`, `!`, `[`), which istiod passes unparsed too.
pub fn known_cipher_suite(suite: &str) -> bool {
    let expression = suite.chars().next().is_some_and(|c| !c.is_alphanumeric());
    suite == "ALL" || expression || CIPHER_SUITES.contains(&suite)
}

pub fn known_ecdh_curve(curve: &str) -> bool {
    ECDH_CURVES.contains(&curve)
}

/// The known suites of `suites`, each once, in order (istiod's `FilterCipherSuites`), and those
/// left out.
pub fn filter_cipher_suites(suites: &[String]) -> (Vec<String>, Vec<String>) {
    let mut kept: Vec<String> = Vec::new();
    let mut dropped = Vec::new();
    for suite in suites {
        match known_cipher_suite(suite) {
            true if !kept.contains(suite) => kept.push(suite.clone()),
            true => {}
            false => dropped.push(suite.clone()),
        }
    }
    (kept, dropped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_suites_are_left_out_and_named() {
        let given: Vec<String> = [
            "AES128-SHA",
            "RC4-MD5",
            "AES128-SHA",
            "[AES256-SHA|AES128-SHA]",
        ]
        .map(String::from)
        .to_vec();
        let (kept, dropped) = filter_cipher_suites(&given);
        assert_eq!(kept, ["AES128-SHA", "[AES256-SHA|AES128-SHA]"]);
        assert_eq!(dropped, ["RC4-MD5"]);
        assert!(known_ecdh_curve("X25519") && !known_ecdh_curve("P-999"));
    }
}
