//! JSON Web Key Sets (RFC 7517) as Envoy's jwt_authn filter reads them: a structural check, used for
//! inline `jwks` and for the documents meshpilot fetches from `jwksUri`.

use crate::text::{clip, Quoted};

/// Why a document is not a usable key set.
pub fn check(text: &str) -> Result<(), String> {
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("not JSON: {}", clip(&e.to_string())))?;
    // A single key is accepted as well, as Istio's parser does.
    let keys: Vec<&serde_json::Value> = match value.get("keys") {
        Some(serde_json::Value::Array(keys)) => keys.iter().collect(),
        Some(_) => return Err("`keys` is not an array".into()),
        None if value.get("kty").is_some() => vec![&value],
        None => return Err("no `keys`".into()),
    };
    if keys.is_empty() {
        return Err("`keys` is empty".into());
    }
    for (i, key) in keys.iter().enumerate() {
        let has = |field: &str| key.get(field).and_then(|v| v.as_str()).is_some();
        let required: &[&str] = match key.get("kty").and_then(|v| v.as_str()) {
            Some("RSA") => &["n", "e"],
            Some("EC") => &["crv", "x", "y"],
            Some("oct") => &["k"],
            Some("OKP") => &["crv", "x"],
            Some(other) => return Err(format!("key {i}: unsupported kty {}", Quoted(other))),
            None => return Err(format!("key {i}: no kty")),
        };
        if let Some(missing) = required.iter().find(|f| !has(f)) {
            return Err(format!("key {i}: no {missing}"));
        }
    }
    Ok(())
}

/// A well-formed key set no token is signed with: what a provider gets while its keys are not
/// fetched, so its listener loads and every token it should check fails (as istiod does).
pub const UNUSABLE: &str = concat!(
    r#"{"keys":[{"kty":"RSA","alg":"RS256","kid":"meshpilot-no-keys-yet","e":"AQAB","n":""#,
    "pdapkYam-wdKjnrLflzZtgPdf0GsOjRpL7FUdzCm9J0KCq3YcyYjH-MdJn6Nx9Fk9WwJI1_k9zKYVzsp5gGmwtXt52M7fgoEt8lu",
    "HVTbu9io-Y3sFKlYZkDtI6UaZoFHtyx_8ntG4o80SwBzC4IyOqSzq5DLSoQD1ebSgB-qAJQnYZ6YzJXhYLGMYu3xpHAM0fxpkwfY",
    "pODk94UsjpmFt_KnA0ptgzRWZKUZUVnBXeZ4cpBN67Gq3cLjxxWR1W__k7DJMgREccvMl6EOk2QbZHisiKfEREA2KODtvVDvz6Ln",
    "aZy4uQaRsYX15COwNW4mK4mz9-_hRRrVbZgVK9ManQ",
    r#""}]}"#
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_sets_are_checked() {
        assert!(check(UNUSABLE).is_ok());
        assert!(check(r#"{"keys":[{"kty":"EC","crv":"P-256","x":"a","y":"b"}]}"#).is_ok());
        assert!(check(r#"{"kty":"oct","k":"c2VjcmV0"}"#).is_ok());
        assert!(check("nope").unwrap_err().starts_with("not JSON"));
        assert_eq!(check(r#"{"keys":[]}"#).unwrap_err(), "`keys` is empty");
        assert_eq!(
            check(r#"{"keys":[{"kty":"RSA","n":"x"}]}"#).unwrap_err(),
            "key 0: no e"
        );
    }
}
