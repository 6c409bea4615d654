//! Multi-document Kubernetes YAML → trimmed objects.

use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_yaml_ng::Value;
use thiserror::Error;
use tracing::debug;

use crate::registry::objects::{self, Object, TrimError};
use crate::text::clip;

#[derive(Debug, Error)]
pub enum ManifestError {
    #[error("line {line}, column {column}: {message}")]
    Syntax {
        line: usize,
        column: usize,
        message: String,
    },
    #[error("document {doc}: {message}")]
    Document { doc: usize, message: String },
    #[error("document {doc}: {}", clip(&.source.to_string()))]
    Object { doc: usize, source: TrimError },
}

/// Parses every document of a manifest. Kinds other than Namespace, Service, EndpointSlice
/// (discovery.k8s.io/v1), Pod, Node and Secret are skipped; `kind: List` is unpacked.
/// Any malformed document fails the whole manifest, so a half-read file is never applied.
pub fn parse(text: &str) -> Result<Vec<Object>, ManifestError> {
    crate::yaml::check_aliases(text).map_err(|e| ManifestError::Document {
        doc: e.document,
        message: e.to_string(),
    })?;
    let mut out = Vec::new();
    for (i, document) in serde_yaml_ng::Deserializer::from_str(text).enumerate() {
        let doc = i + 1;
        let value = Value::deserialize(document).map_err(|e| syntax(doc, e))?;
        collect(value, doc, &mut out)?;
    }
    Ok(out)
}

fn syntax(doc: usize, e: serde_yaml_ng::Error) -> ManifestError {
    match e.location() {
        Some(loc) => ManifestError::Syntax {
            line: loc.line(),
            column: loc.column(),
            message: clip(&e.to_string()),
        },
        None => ManifestError::Document {
            doc,
            message: clip(&e.to_string()),
        },
    }
}

fn collect(value: Value, doc: usize, out: &mut Vec<Object>) -> Result<(), ManifestError> {
    if value.is_null() {
        return Ok(());
    }
    let field = |name: &str| {
        value
            .get(name)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string()
    };
    let (kind, api_version) = (field("kind"), field("apiVersion"));
    let object = |e: TrimError| ManifestError::Object { doc, source: e };
    let parsed = match (kind.as_str(), api_version.as_str()) {
        ("", _) => {
            return Err(ManifestError::Document {
                doc,
                message: "not a Kubernetes object: no `kind`".into(),
            })
        }
        ("List", _) => {
            let items = value
                .get("items")
                .and_then(Value::as_sequence)
                .cloned()
                .unwrap_or_default();
            for item in items {
                collect(item, doc, out)?;
            }
            return Ok(());
        }
        ("Namespace", "v1") => objects::namespace(&typed(value, doc, &kind)?).map_err(object)?,
        ("Service", "v1") => objects::service(&typed(value, doc, &kind)?).map_err(object)?,
        ("Pod", "v1") => objects::pod(&typed(value, doc, &kind)?).map_err(object)?,
        ("Node", "v1") => objects::node(&typed(value, doc, &kind)?).map_err(object)?,
        ("Secret", "v1") => objects::secret(&typed(value, doc, &kind)?).map_err(object)?,
        ("EndpointSlice", "discovery.k8s.io/v1") => {
            match objects::endpoint_slice(&typed(value, doc, &kind)?).map_err(object)? {
                Some(o) => o,
                None => return Ok(()),
            }
        }
        (kind, api_version) => {
            debug!(
                kind,
                api_version, doc, "skipping object of a kind meshpilot does not read"
            );
            return Ok(());
        }
    };
    out.push(parsed);
    Ok(())
}

fn typed<T: DeserializeOwned>(value: Value, doc: usize, kind: &str) -> Result<T, ManifestError> {
    let name = value
        .get("metadata")
        .and_then(|m| m.get("name"))
        .and_then(Value::as_str)
        .map_or_else(|| "<unnamed>".to_string(), clip);
    serde_yaml_ng::from_value(value).map_err(|e| ManifestError::Document {
        doc,
        message: format!("{kind} {name}: {}", clip(&e.to_string())),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::objects::Kind;

    #[test]
    fn reads_every_supported_kind_and_skips_the_rest() {
        let text = r#"
apiVersion: v1
kind: Namespace
metadata: {name: shop, labels: {topology.istio.io/network: net1}}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: web, namespace: shop}
---
apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Service
  metadata: {name: web, namespace: shop}
  spec: {clusterIP: 10.0.0.1, ports: [{name: http, port: 80}]}
- apiVersion: v1
  kind: Node
  metadata: {name: n1}
---
"#;
        let objs = parse(text).unwrap();
        let kinds: Vec<Kind> = objs.iter().map(|o| o.key().kind).collect();
        assert_eq!(kinds, vec![Kind::Namespace, Kind::Service, Kind::Node]);
    }

    #[test]
    fn syntax_error_names_the_line() {
        let text = "apiVersion: v1\nkind: Service\nmetadata: {name: web\n";
        let err = parse(text).unwrap_err().to_string();
        assert!(err.starts_with("line "), "{err}");
    }

    #[test]
    fn type_error_names_document_and_object() {
        let text = "apiVersion: v1\nkind: Pod\nmetadata: {name: a, namespace: x}\n---\napiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: shop}\nspec: {ports: [{port: eighty}]}\n";
        let err = parse(text).unwrap_err().to_string();
        assert!(
            err.contains("document 2") && err.contains("Service web"),
            "{err}"
        );
    }

    #[test]
    fn errors_quote_at_most_a_bounded_excerpt() {
        let huge = "x".repeat(10_000);
        let text = format!("apiVersion: v1\nkind: Service\nmetadata: {{name: {huge}, namespace: shop}}\nspec: {{ports: [{{port: {huge}}}]}}\n");
        let err = parse(&text).unwrap_err().to_string();
        assert!(err.len() < 1000, "{} bytes: {err}", err.len());
    }

    #[test]
    fn aliases_that_multiply_are_refused_before_anything_is_built() {
        let mut text =
            "apiVersion: v1\nkind: Namespace\nmetadata: {name: a}\nl0: &l0 [x, x, x, x]\n"
                .to_string();
        for level in 1..12 {
            let aliases = vec![format!("*l{}", level - 1); 4].join(", ");
            text.push_str(&format!("l{level}: &l{level} [{aliases}]\n"));
        }
        let err = parse(&text).unwrap_err().to_string();
        assert!(
            err.starts_with("document 1: its aliases expand it"),
            "{err}"
        );
    }

    #[test]
    fn object_without_namespace_is_in_default() {
        let objects = parse("apiVersion: v1\nkind: Service\nmetadata: {name: web}\n").unwrap();
        assert_eq!(objects[0].key().namespace, "default");
    }
}
