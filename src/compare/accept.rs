//! Differences a user has accepted, each with its reason: lines
//! `<type> <kind> <field> <left> -> <right> — <why>`. A line names a kind of resource
//! (`diff::KINDS`: `outbound` clusters, a sidecar's `virtualInbound`, a `gateway`'s listeners…) or
//! one resource by its exact name; the exact field, where `[*]` stands for an item of a list
//! matched by content (filters are named by their name, as the differences show them); and the
//! values each side has there: the left (istiod) as JSON, `absent` or `present` (any value), the
//! right (meshpilot) as JSON or `absent`. So a line accepts what its reason explains and nothing
//! more: not another kind of resource, not a neighbouring field, not other values. In a
//! Markdown file only the lines of its ```` ```accepted ```` blocks count, so the document that
//! explains each difference is the list.

use serde_json::Value;
use thiserror::Error;

use super::diff::{normalise_value, Difference, KINDS};

#[derive(Debug, Error)]
#[error("line {line}: {message}")]
pub struct AcceptError {
    line: usize,
    message: String,
}

/// What a line says of the left side's value.
enum Left {
    Absent,
    Present,
    Is(Value),
}

/// Which resources a line covers.
enum Resources {
    Kind(String),
    Named(String),
}

struct Rule {
    /// Where it is written (1-based), and as written: reported when it matches nothing.
    line: usize,
    text: String,
    type_name: String,
    resources: Resources,
    field: String,
    left: Left,
    /// The right side's value there (None: absent).
    right: Option<Value>,
}

#[derive(Default)]
pub struct Accepted {
    rules: Vec<Rule>,
}

impl Accepted {
    pub fn parse(text: &str) -> Result<Self, AcceptError> {
        let fenced = text.lines().any(|l| l.trim() == "```accepted");
        let mut inside = !fenced;
        let mut rules = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let trimmed = line.trim();
            if fenced && trimmed.starts_with("```") {
                inside = trimmed == "```accepted";
                continue;
            }
            if !inside || trimmed.is_empty() || trimmed.starts_with('#') {
                continue;
            }
            rules.push(rule(i + 1, trimmed).map_err(|message| AcceptError {
                line: i + 1,
                message,
            })?);
        }
        Ok(Self { rules })
    }

    /// The line (its index among the rules) that accepts `d`, if one does.
    pub fn covering(&self, d: &Difference) -> Option<usize> {
        self.rules.iter().position(|r| r.covers(d))
    }

    pub fn covers(&self, d: &Difference) -> bool {
        self.covering(d).is_some()
    }

    /// Each rule's line number and text, by index.
    pub fn lines(&self) -> impl Iterator<Item = (usize, &str)> {
        self.rules.iter().map(|r| (r.line, r.text.as_str()))
    }
}

impl Rule {
    fn covers(&self, d: &Difference) -> bool {
        let resource = match &self.resources {
            Resources::Kind(kind) => kind == d.kind,
            Resources::Named(name) => *name == d.resource,
        };
        let field = if d.field.is_empty() { "." } else { &d.field };
        let left = match (&self.left, &d.left) {
            (Left::Absent, None) | (Left::Present, Some(_)) => true,
            (Left::Is(wanted), Some(v)) => *wanted == normalise_value(v),
            _ => false,
        };
        let right = d.right.as_ref().map(normalise_value);
        self.type_name == d.type_name
            && resource
            && self.field == field
            && left
            && self.right == right
    }
}

fn rule(line: usize, text: &str) -> Result<Rule, String> {
    let (rule, why) = text
        .split_once(" — ")
        .ok_or("no reason (`— why` after the rule)")?;
    if why.trim().is_empty() {
        return Err("an empty reason".into());
    }
    let (place, right) = rule
        .split_once(" -> ")
        .ok_or("no values (`<left> -> <right>`: what each side sends)")?;
    let parts: Vec<&str> = place.splitn(4, char::is_whitespace).collect();
    let [type_name, resource, field, left] = parts.as_slice() else {
        return Err("expected `<type> <kind> <field> <left> -> <right> — <why>`".into());
    };
    let kinds = KINDS
        .iter()
        .find(|(t, _)| t == type_name)
        .map(|(_, kinds)| *kinds)
        .ok_or("the type is one of cds, eds, lds, rds")?;
    let resources = match kinds.contains(resource) {
        true => Resources::Kind(resource.to_string()),
        false if resource.contains('*') => {
            return Err(format!(
                "`{resource}`: name a kind ({}) or one resource, without `*`",
                kinds.join(", ")
            ))
        }
        false => Resources::Named(resource.to_string()),
    };
    if field.replace("[*]", "").contains('*') {
        return Err(format!(
            "`{field}`: name the exact field (`[*]` only for a list's items)"
        ));
    }
    let json = |text: &str, side: &str| {
        serde_json::from_str(text)
            .map(|v| normalise_value(&v))
            .map_err(|e| format!("the {side} value: {e}"))
    };
    let left = match left.trim() {
        "absent" => Left::Absent,
        "present" => Left::Present,
        text => Left::Is(json(text, "left")?),
    };
    let right = match right.trim() {
        "absent" => None,
        text => Some(json(text, "right")?),
    };
    Ok(Rule {
        line,
        text: text.to_string(),
        type_name: type_name.to_string(),
        resources,
        field: field.to_string(),
        left,
        right,
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn difference(resource: &str, kind: &'static str, field: &str, right: Value) -> Difference {
        Difference {
            type_name: "cds",
            resource: resource.to_string(),
            kind,
            path: field.to_string(),
            field: field.to_string(),
            left: Some(json!("60s")),
            right: Some(right),
            proxy: None,
        }
    }

    #[test]
    fn a_line_covers_its_kind_field_and_value_only() {
        let doc = "text\n```accepted\ncds outbound cleanup_interval \"60s\" -> \"5s\" — istiod 1.23\n```\ncds * x\n";
        let accepted = Accepted::parse(doc).unwrap();
        let outbound = |field: &str, value| {
            accepted.covers(&difference("outbound|80||a", "outbound", field, value))
        };
        assert!(outbound("cleanup_interval", json!("5s")));
        assert!(!outbound("cleanup_interval", json!("1s")), "another value");
        assert!(
            !outbound("a.cleanup_interval", json!("5s")),
            "another field"
        );
        let inbound = difference("inbound|80||", "inbound", "cleanup_interval", json!("5s"));
        assert!(!accepted.covers(&inbound), "another kind");
        let mut other_left = difference(
            "outbound|80||a",
            "outbound",
            "cleanup_interval",
            json!("5s"),
        );
        other_left.left = Some(json!("1s"));
        assert!(!accepted.covers(&other_left), "another left value");
        assert_eq!(accepted.lines().next().map(|l| l.0), Some(3));
    }

    #[test]
    fn lines_name_kinds_fields_and_values() {
        let refused = [
            "cds * x present -> absent — any resource",
            "cds outbound|* x present -> absent — a glob over names",
            "cds outbound *.x present -> absent — a suffix wildcard",
            "cds outbound x — no value",
            "cds outbound x -> absent — no left value",
            "cds outbound x present -> {nope — bad JSON",
            "xds outbound x present -> absent — why",
            "cds outbound x present -> absent",
        ];
        for line in refused {
            assert!(Accepted::parse(line).is_err(), "{line}");
        }
        let named = "cds BlackHoleCluster . present -> absent — a fixed cluster by name";
        assert!(Accepted::parse(named).is_ok());
        let items = "lds virtualInbound filter_chains[*].filters[\"x\"] present -> absent — items";
        assert!(Accepted::parse(items).is_ok());
    }
}
