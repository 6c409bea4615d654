//! `meshpilot compare`: what two control planes send one proxy, compared for what traffic does
//! (docs/fidelity.md). Each side is a dump directory (the fidelity corpus's layout) or a live
//! server's plaintext xDS address; a live side is asked as the node `--node` names (else the
//! other side's `node.json`).

mod accept;
mod diff;
mod equivalent;
mod json;
mod source;

use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};
use envoy_types::pb::envoy::config::core::v3::Node;
use thiserror::Error;

pub use accept::{AcceptError, Accepted};
pub use diff::{compare, Difference, NORMALISED};
pub use equivalent::EQUIVALENCES;
pub use source::{fetch_live, read_dump, read_node, SourceError, State};

use crate::text::clip;

#[derive(Clone, Copy, Debug, Default, ValueEnum)]
pub enum OutputFormat {
    #[default]
    Table,
    Json,
}

#[derive(Args, Debug)]
pub struct CompareArgs {
    /// A dump directory (cds.json, eds.json, lds.json, rds.json, node.json) or a server's
    /// plaintext xDS address (host:port).
    pub left: String,
    /// The other side, in either form.
    pub right: String,
    /// The node a live side is asked as (protobuf JSON, as a dump's node.json).
    #[arg(long)]
    pub node: Option<PathBuf>,
    /// Also write what the left side sent as a dump directory here.
    #[arg(long)]
    pub save_left: Option<PathBuf>,
    /// Differences accepted, with their reasons: lines `<type> <resource> <path> — <why>` (`*`
    /// matches any text); in a Markdown file, those of its ```accepted blocks.
    #[arg(long)]
    pub accept: Option<PathBuf>,
    #[arg(short, long, value_enum, default_value_t)]
    pub output: OutputFormat,
}

#[derive(Debug, Error)]
pub enum CompareError {
    #[error(transparent)]
    Source(#[from] SourceError),
    #[error(
        "{0} is a live server: give --node, or a dump directory with node.json on the other side"
    )]
    NoNode(String),
    #[error("{path}: {error}")]
    Accept { path: String, error: String },
    #[error("--save-left needs a node: give --node, or a dump side with node.json")]
    SaveWithoutNode,
}

/// The comparison's outcome: the differences not accepted, and how many were.
pub struct Report {
    pub differences: Vec<Difference>,
    pub accepted: usize,
}

impl Report {
    pub fn text(&self) -> String {
        let mut out = String::new();
        for d in &self.differences {
            let side = |v: &Option<serde_json::Value>| match v {
                Some(v) => clip(&v.to_string()).to_string(),
                None => "<absent>".to_string(),
            };
            out.push_str(&format!(
                "{} {} {}\n  left:  {}\n  right: {}\n",
                d.type_name,
                d.resource,
                if d.path.is_empty() {
                    "(the resource)"
                } else {
                    &d.path
                },
                side(&d.left),
                side(&d.right)
            ));
        }
        out.push_str(&format!("{} difference(s)\n", self.differences.len()));
        if self.accepted > 0 {
            out.push_str(&format!("{} accepted\n", self.accepted));
        }
        out
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "differences": self.differences,
            "accepted": self.accepted,
            "normalised": NORMALISED.iter().chain(EQUIVALENCES).map(|(what, why)| serde_json::json!({"what": what, "why": why})).collect::<Vec<_>>(),
        })
    }
}

pub async fn run(args: &CompareArgs) -> Result<Report, CompareError> {
    let accepted = match &args.accept {
        Some(path) => {
            let failed = |error: String| CompareError::Accept {
                path: path.display().to_string(),
                error,
            };
            let text = std::fs::read_to_string(path).map_err(|e| failed(e.to_string()))?;
            Accepted::parse(&text).map_err(|e| failed(e.to_string()))?
        }
        None => Accepted::default(),
    };
    let node = node_for(args)?;
    let left = read(&args.left, node.as_ref()).await?;
    let right = read(&args.right, node.as_ref()).await?;
    if let Some(dir) = &args.save_left {
        let node = node.as_ref().ok_or(CompareError::SaveWithoutNode)?;
        source::write_dump(dir, &left, node)?;
    }
    let (accepted_ones, differences): (Vec<_>, Vec<_>) = diff::compare(&left, &right)
        .into_iter()
        .partition(|d| accepted.covers(d));
    Ok(Report {
        differences,
        accepted: accepted_ones.len(),
    })
}

fn is_dump(side: &str) -> bool {
    Path::new(side).is_dir()
}

/// `--node`, else the first dump side's `node.json`; None when both sides are dumps.
fn node_for(args: &CompareArgs) -> Result<Option<Node>, CompareError> {
    if let Some(path) = &args.node {
        return Ok(Some(source::read_node(path)?));
    }
    for side in [&args.left, &args.right] {
        let path = Path::new(side).join("node.json");
        if is_dump(side) && path.is_file() {
            return Ok(Some(source::read_node(&path)?));
        }
    }
    Ok(None)
}

async fn read(side: &str, node: Option<&Node>) -> Result<State, CompareError> {
    if is_dump(side) {
        return Ok(source::read_dump(Path::new(side))?);
    }
    let node = node.ok_or_else(|| CompareError::NoNode(side.to_string()))?;
    Ok(source::fetch_live(side, node).await?)
}
