//! Differences a user has accepted, each with its reason: lines `<type> <resource> <path> — <why>`
//! where `*` in the resource or path stands for any text. In a Markdown file only the lines of
//! its ```` ```accepted ```` blocks count, so the document that explains each difference is the list.

use thiserror::Error;

use super::diff::Difference;

#[derive(Debug, Error)]
#[error("line {line}: {message}")]
pub struct AcceptError {
    line: usize,
    message: String,
}

struct Rule {
    type_name: String,
    resource: String,
    path: String,
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
            let failed = |message: &str| AcceptError {
                line: i + 1,
                message: message.to_string(),
            };
            let (rule, why) = trimmed
                .split_once(" — ")
                .ok_or_else(|| failed("no reason (`— why` after the rule)"))?;
            if why.trim().is_empty() {
                return Err(failed("an empty reason"));
            }
            let parts: Vec<&str> = rule.split_whitespace().collect();
            let [type_name, resource, path] = parts.as_slice() else {
                return Err(failed("expected `<type> <resource> <path> — <why>`"));
            };
            if !matches!(*type_name, "cds" | "eds" | "lds" | "rds") {
                return Err(failed("the type is one of cds, eds, lds, rds"));
            }
            rules.push(Rule {
                type_name: type_name.to_string(),
                resource: resource.to_string(),
                path: path.to_string(),
            });
        }
        Ok(Self { rules })
    }

    pub fn covers(&self, d: &Difference) -> bool {
        let path = if d.path.is_empty() { "." } else { &d.path };
        self.rules.iter().any(|r| {
            r.type_name == d.type_name && glob(&r.resource, &d.resource) && glob(&r.path, path)
        })
    }
}

/// Whether `text` matches `pattern`, where `*` matches any run of characters.
fn glob(pattern: &str, text: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or_default();
    let Some(mut rest) = text.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else {
        return rest.is_empty();
    };
    for part in middle {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.ends_with(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn difference(path: &str) -> Difference {
        Difference {
            type_name: "cds",
            resource: "outbound|80||a.example".to_string(),
            path: path.to_string(),
            left: None,
            right: None,
            proxy: None,
        }
    }

    #[test]
    fn rules_match_by_glob_and_need_a_reason() {
        let doc =
            "text\n```accepted\ncds outbound|* *.cleanup_interval — istiod 1.23\n```\ncds * x\n";
        let accepted = Accepted::parse(doc).unwrap();
        assert!(accepted.covers(&difference("a.cleanup_interval")));
        assert!(!accepted.covers(&difference("cleanup_interval.b")));
        assert!(Accepted::parse("cds * x").is_err());
        assert!(Accepted::parse("xds * x — why").is_err());
        assert!(glob("*", "") && glob("a*c", "abbc") && !glob("a*c", "abcd"));
    }
}
