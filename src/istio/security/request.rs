//! RequestAuthentication: the JWTs a workload accepts (a token that is present must be valid).

use serde::{Deserialize, Serialize};

use super::{jwks, non_empty_values, Attachment, PolicyTargetRef, WorkloadSelector};
use crate::istio::duration::Duration;
use crate::istio::validate::{ensure, Result, ValidationError};
use crate::text::Quoted;

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct RequestAuthentication {
    pub selector: Option<WorkloadSelector>,
    /// Gateway API attachment: the targeted Gateway's proxies, never sidecars.
    pub target_ref: Option<PolicyTargetRef>,
    pub target_refs: Vec<PolicyTargetRef>,
    pub jwt_rules: Vec<JwtRule>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct JwtRule {
    pub issuer: String,
    pub audiences: Vec<String>,
    /// Where the keys are; meshpilot fetches them (OpenID discovery from the issuer when empty).
    /// Istio's schema spells it both ways (the proto field and its JSON name).
    #[serde(alias = "jwks_uri")]
    pub jwks_uri: String,
    /// Inline keys; win over `jwksUri`.
    pub jwks: String,
    pub from_headers: Vec<JwtHeader>,
    pub from_params: Vec<String>,
    pub from_cookies: Vec<String>,
    pub output_payload_to_header: String,
    pub output_claim_to_headers: Vec<ClaimToHeader>,
    pub forward_original_token: bool,
    pub timeout: Option<Duration>,
    pub space_delimited_claims: Vec<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(default)]
pub struct JwtHeader {
    pub name: String,
    pub prefix: String,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(default)]
pub struct ClaimToHeader {
    pub header: String,
    pub claim: String,
}

impl RequestAuthentication {
    /// How it attaches: by selector (or namespace) or by Gateway API target.
    pub fn attachment(&self) -> Attachment<'_> {
        Attachment {
            selector: &self.selector,
            target_ref: &self.target_ref,
            target_refs: &self.target_refs,
        }
    }

    pub fn validate(&self) -> Result {
        self.attachment().validate()?;
        for (i, rule) in self.jwt_rules.iter().enumerate() {
            rule.validate()
                .map_err(|e| e.under(&format!("jwtRules[{i}]")))?;
        }
        Ok(())
    }
}

impl JwtRule {
    fn validate(&self) -> Result {
        non_empty_values("audiences", &self.audiences)?;
        ensure(
            !(self.issuer.is_empty() && self.jwks_uri.is_empty()),
            "issuer",
            "issuer or jwksUri must be non-empty string",
        )?;
        if !self.jwks_uri.is_empty() {
            check_uri(&self.jwks_uri).map_err(|e| ValidationError::at("jwksUri", e))?;
        }
        if !self.jwks.is_empty() {
            jwks::check(&self.jwks)
                .map_err(|e| ValidationError::at("jwks", format!("jwks parse error: {e}")))?;
        }
        for (i, header) in self.from_headers.iter().enumerate() {
            ensure(
                !header.name.is_empty(),
                &format!("fromHeaders[{i}].name"),
                "location header name must be non-empty string",
            )?;
        }
        non_empty_values("fromParams", &self.from_params)?;
        non_empty_values("fromCookies", &self.from_cookies)?;
        for (i, pair) in self.output_claim_to_headers.iter().enumerate() {
            let at = format!("outputClaimToHeaders[{i}]");
            ensure(
                !pair.claim.is_empty() && !pair.header.is_empty(),
                &at,
                "header and claim value must be non-empty string",
            )?;
            ensure(
                is_header_name(&pair.header),
                &format!("{at}.header"),
                format!("{} is not a valid header name", Quoted(&pair.header)),
            )?;
        }
        if !self.output_payload_to_header.is_empty() {
            ensure(
                is_header_name(&self.output_payload_to_header),
                "outputPayloadToHeader",
                "not a valid header name",
            )?;
        }
        if let Some(timeout) = self.timeout {
            ensure(
                timeout.as_std() >= std::time::Duration::from_millis(1),
                "timeout",
                "must be at least 1ms",
            )?;
        }
        Ok(())
    }
}

/// `http://` or `https://` with a host (and, optionally, a numeric port).
fn check_uri(uri: &str) -> std::result::Result<(), String> {
    let parsed: http::Uri = uri.parse().map_err(|e| format!("{}: {e}", Quoted(uri)))?;
    match parsed.scheme_str() {
        Some("http" | "https") => {}
        other => {
            return Err(format!(
                "URI scheme {} is not supported",
                Quoted(other.unwrap_or_default())
            ))
        }
    }
    match parsed.host() {
        Some(host) if !host.is_empty() => Ok(()),
        _ => Err(format!("{} has no host", Quoted(uri))),
    }
}

/// A header name of RFC 7230 token characters, lowercase as Envoy wants them.
fn is_header_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "!#$%&'*+-.^_`|~".contains(c))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error(yaml: &str) -> ValidationError {
        let value: serde_json::Value = serde_yaml_ng::from_str(yaml).unwrap();
        let ra: RequestAuthentication = serde_json::from_value(value).unwrap();
        ra.validate().unwrap_err()
    }

    #[test]
    fn rules_are_checked_field_by_field() {
        assert_eq!(
            error("jwtRules: [{audiences: [a]}]").field,
            "jwtRules[0].issuer"
        );
        assert_eq!(
            error("jwtRules: [{issuer: i, jwksUri: 'ftp://x/keys'}]").field,
            "jwtRules[0].jwksUri"
        );
        assert_eq!(
            error("jwtRules: [{issuer: i, jwks: '{\"keys\": 3}'}]").field,
            "jwtRules[0].jwks"
        );
        assert_eq!(
            error("jwtRules: [{issuer: i, fromHeaders: [{prefix: 'Bearer '}]}]").field,
            "jwtRules[0].fromHeaders[0].name"
        );
        assert_eq!(
            error("jwtRules: [{issuer: i, outputClaimToHeaders: [{header: 'X Y', claim: sub}]}]")
                .field,
            "jwtRules[0].outputClaimToHeaders[0].header"
        );
        assert!(check_uri("https://issuer.example.com:8443/keys.json").is_ok());
    }
}
