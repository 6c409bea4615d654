//! Validation helpers shared by the kinds: errors that name the field, and Istio's rules for hosts,
//! labels, ports and exportTo.

use std::collections::BTreeMap;
use std::fmt;

use crate::text::Quoted;

/// A refused field: where (a path such as `trafficPolicy.tls.mode`) and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValidationError {
    pub field: String,
    pub message: String,
}

impl ValidationError {
    pub fn at(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }

    /// The same error under a parent field (`subsets[1]` + `labels` → `subsets[1].labels`).
    pub fn under(mut self, parent: &str) -> Self {
        self.field = match self.field.is_empty() {
            true => parent.to_string(),
            false if self.field.starts_with('[') => format!("{parent}{}", self.field),
            false => format!("{parent}.{}", self.field),
        };
        self
    }
}

impl fmt::Display for ValidationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

impl std::error::Error for ValidationError {}

pub type Result<T = ()> = std::result::Result<T, ValidationError>;

/// `cond` or an error at `field`.
pub fn ensure(cond: bool, field: &str, message: impl Into<String>) -> Result {
    match cond {
        true => Ok(()),
        false => Err(ValidationError::at(field, message)),
    }
}

/// A DNS-1123 label: lowercase letters, digits and '-', at most 63, not starting or ending with '-'.
pub fn is_dns1123_label(label: &str) -> bool {
    !label.is_empty()
        && label.len() <= 63
        && label
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !label.starts_with('-')
        && !label.ends_with('-')
}

/// A DNS name as istiod's `ValidateFQDN`: DNS-1123 labels (a trailing dot allowed), at most 255
/// characters.
pub fn is_fqdn(name: &str) -> bool {
    let labels = name.strip_suffix('.').unwrap_or(name);
    !labels.is_empty() && name.len() <= 255 && labels.split('.').all(is_dns1123_label)
}

/// Istio's host rule: a FQDN or a short name of DNS-1123 labels, optionally prefixed by a single `*`
/// (a wildcard: `*` alone, or `*.` followed by labels); at most 255 characters.
pub fn host(field: &str, host: &str) -> Result {
    ensure(!host.is_empty(), field, "a host is required")?;
    ensure(
        host.len() <= 255,
        field,
        format!("host {} is longer than 255 characters", Quoted(host)),
    )?;
    if host == "*" {
        return Ok(());
    }
    let labels = host.strip_prefix("*.").unwrap_or(host);
    let labels = labels.strip_suffix('.').unwrap_or(labels);
    let ok = labels
        .split('.')
        .all(|l| is_dns1123_label(&l.to_ascii_lowercase()) && !l.contains('*'));
    ensure(
        ok,
        field,
        format!(
            "{} is not a valid host: DNS labels, optionally starting with '*.'",
            Quoted(host)
        ),
    )
}

/// Label keys and values as Kubernetes allows them (prefix/name keys, values of up to 63 characters).
pub fn labels(field: &str, labels: &BTreeMap<String, String>) -> Result {
    for (key, value) in labels {
        let (prefix, name) = key.rsplit_once('/').unwrap_or(("", key));
        let name_ok = !name.is_empty()
            && name.len() <= 63
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
            && name.starts_with(|c: char| c.is_ascii_alphanumeric())
            && name.ends_with(|c: char| c.is_ascii_alphanumeric());
        let prefix_ok = prefix.is_empty() || prefix.split('.').all(is_dns1123_label);
        ensure(
            name_ok && prefix_ok,
            field,
            format!("invalid label key {}", Quoted(key)),
        )?;
        let value_ok = value.is_empty()
            || (value.len() <= 63
                && value
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
                && value.starts_with(|c: char| c.is_ascii_alphanumeric())
                && value.ends_with(|c: char| c.is_ascii_alphanumeric()));
        ensure(
            value_ok,
            field,
            format!("invalid value {} of label {}", Quoted(value), Quoted(key)),
        )?;
    }
    Ok(())
}

/// A port number: 1–65535.
pub fn port(field: &str, port: u32) -> Result {
    ensure(
        (1..=65535).contains(&port),
        field,
        format!("port {port} is not in 1-65535"),
    )
}

/// `exportTo`: `.` (this namespace), `*` (all), `~` (none, alone) or namespace names; no repeats.
pub fn export_to(field: &str, export_to: &[String]) -> Result {
    for (i, entry) in export_to.iter().enumerate() {
        let at = format!("{field}[{i}]");
        let ok = matches!(entry.as_str(), "." | "*" | "~") || is_dns1123_label(entry);
        ensure(
            ok,
            &at,
            format!("{} is not '.', '*', '~' or a namespace", Quoted(entry)),
        )?;
        ensure(
            !export_to[..i].contains(entry),
            &at,
            format!("{} is listed twice", Quoted(entry)),
        )?;
    }
    ensure(
        !(export_to.len() > 1 && export_to.iter().any(|e| e == "~")),
        field,
        "'~' (export to none) cannot be combined with other entries",
    )?;
    ensure(
        !(export_to.len() > 1 && export_to.iter().any(|e| e == "*")),
        field,
        "'*' (export to all) cannot be combined with other entries",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts() {
        for ok in [
            "reviews",
            "reviews.bookinfo.svc.cluster.local",
            "*.example.com",
            "*",
            "api.example.com.",
        ] {
            assert!(host("host", ok).is_ok(), "{ok}");
        }
        for bad in ["", "a..b", "*foo.com", "foo.*.com", "Bad_host", "-a.com"] {
            assert!(host("host", bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn export_to_rules() {
        let v = |items: &[&str]| items.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(export_to("exportTo", &v(&[".", "prod"])).is_ok());
        assert!(export_to("exportTo", &v(&["~", "prod"])).is_err());
        assert!(export_to("exportTo", &v(&["prod", "prod"])).is_err());
        assert_eq!(
            export_to("exportTo", &v(&["Bad"])).unwrap_err().field,
            "exportTo[0]"
        );
    }

    #[test]
    fn label_rules() {
        let l = |k: &str, v: &str| BTreeMap::from([(k.to_string(), v.to_string())]);
        assert!(labels("labels", &l("app.kubernetes.io/name", "web-1")).is_ok());
        assert!(labels("labels", &l("version", "")).is_ok());
        assert!(labels("labels", &l("bad key", "x")).is_err());
        assert!(labels("labels", &l("app", "-x")).is_err());
    }

    #[test]
    fn nested_fields() {
        let e = ValidationError::at("labels", "empty").under("subsets[2]");
        assert_eq!(e.to_string(), "subsets[2].labels: empty");
        let e = ValidationError::at("[1]", "dup").under("exportTo");
        assert_eq!(e.field, "exportTo[1]");
    }
}
