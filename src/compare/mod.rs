//! `meshpilot compare`: what two control planes send one proxy, compared for what traffic does
//! (docs/fidelity.md). Each side is a dump directory (the fidelity corpus's layout) or a live
//! server's plaintext xDS address; a live side is asked as the node `--node` names (else the
//! other side's `node.json`).

mod accept;
mod diff;
mod equivalent;
mod istiod;
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
    /// plaintext xDS address (host:port); with --istiod, meshpilot's plaintext xDS address.
    pub left: String,
    /// The other side, in either form (none with --istiod).
    pub right: Option<String>,
    /// A running istiod's secure xDS address (host:port): every proxy of --namespace connected to
    /// it is compared with what meshpilot (the one side given) sends the same node.
    #[arg(long, requires = "namespace", conflicts_with_all = ["node", "save_left"])]
    pub istiod: Option<String>,
    /// With --istiod: the namespace whose proxies are compared.
    #[arg(long, requires = "istiod")]
    pub namespace: Option<String>,
    /// With --istiod: the control plane's namespace, where our service account and the mesh root
    /// are.
    #[arg(long, requires = "istiod", default_value = "istio-system")]
    pub system_namespace: String,
    /// With --istiod: the service account istiod sees us as (meshpilot's own; `istiod-<revision>`
    /// for a revision install).
    #[arg(long, requires = "istiod", default_value = "meshpilot")]
    pub service_account: String,
    /// With --istiod: the kubeconfig of the config cluster (for the token); else the usual
    /// places (KUBECONFIG, ~/.kube/config, in-cluster).
    #[arg(long, requires = "istiod")]
    pub kubeconfig: Option<PathBuf>,
    /// With --istiod: the PEM its certificate is checked against [the mesh root ConfigMap].
    #[arg(long, requires = "istiod")]
    pub istiod_root: Option<PathBuf>,
    /// With --istiod: the name its certificate must carry [istiod.<system-namespace>.svc].
    #[arg(long, requires = "istiod")]
    pub istiod_name: Option<String>,
    /// The node a live side is asked as (protobuf JSON, as a dump's node.json).
    #[arg(long)]
    pub node: Option<PathBuf>,
    /// Also write what the left side sent as a dump directory here.
    #[arg(long)]
    pub save_left: Option<PathBuf>,
    /// Differences accepted, with their reasons: lines `<type> <kind> <field> -> <value> — <why>`
    /// (docs/fidelity.md); in a Markdown file, those of its ```accepted blocks.
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
    #[error("istiod: {0}")]
    Istiod(String),
    #[error("{0}: no such dump directory (nor a server's host:port)")]
    NoDump(String),
    #[error("{0}")]
    Usage(&'static str),
}

/// The comparison's outcome: the differences not accepted, how many were, (with --istiod) the
/// proxies compared, and why nothing was compared, if nothing was.
pub struct Report {
    pub differences: Vec<Difference>,
    pub accepted: usize,
    pub proxies: Vec<String>,
    pub nothing_compared: Option<String>,
}

impl Report {
    pub fn text(&self) -> String {
        let mut out = String::new();
        for d in &self.differences {
            let side = |v: &Option<serde_json::Value>| match v {
                Some(v) => clip(&v.to_string()).to_string(),
                None => "<absent>".to_string(),
            };
            if let Some(proxy) = &d.proxy {
                out.push_str(&format!("{proxy}: "));
            }
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
        if !self.proxies.is_empty() {
            out.push_str(&format!("{} proxies compared\n", self.proxies.len()));
        }
        if let Some(why) = &self.nothing_compared {
            out.push_str(&format!("nothing compared: {why}\n"));
            return out;
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
            "proxies": self.proxies,
            "nothing_compared": self.nothing_compared,
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
    if let Some(address) = &args.istiod {
        if args.right.is_some() {
            return Err(CompareError::Usage(
                "with --istiod, give only meshpilot's address",
            ));
        }
        let side = istiod::IstiodSide {
            address: address.clone(),
            namespace: args.namespace.clone().unwrap_or_default(),
            system_namespace: args.system_namespace.clone(),
            service_account: args.service_account.clone(),
            kubeconfig: args.kubeconfig.clone(),
            root: args.istiod_root.clone(),
            server_name: args.istiod_name.clone(),
        };
        return istiod::compare_namespace(&side, &args.left, &accepted).await;
    }
    let right_side = (args.right.as_deref()).ok_or(CompareError::Usage(
        "two sides are compared: give the right one (or --istiod)",
    ))?;
    let node = node_for(args)?;
    let left = read(&args.left, node.as_ref()).await?;
    let right = read(right_side, node.as_ref()).await?;
    if let Some(dir) = &args.save_left {
        let node = node.as_ref().ok_or(CompareError::SaveWithoutNode)?;
        source::write_dump(dir, &left, node)?;
    }
    let router = node.as_ref().is_some_and(is_router);
    let (accepted_ones, differences): (Vec<_>, Vec<_>) = diff::compare(&left, &right, router)
        .into_iter()
        .partition(|d| accepted.covers(d));
    let empty = |state: &State| state.iter().all(|resources| resources.is_empty());
    let nothing_compared = (empty(&left) && empty(&right))
        .then(|| "neither side sent any cluster, listener, route or assignment".to_string());
    Ok(Report {
        differences,
        accepted: accepted_ones.len(),
        proxies: Vec::new(),
        nothing_compared,
    })
}

/// Whether the node is a gateway's (its id says `router`).
pub fn is_router(node: &Node) -> bool {
    node.id.starts_with("router~")
}

fn is_dump(side: &str) -> bool {
    Path::new(side).is_dir()
}

/// A side that is no dump directory must be a server's `host:port`; a path is named as missing.
fn live_address(side: &str) -> Result<&str, CompareError> {
    let path_like = side.contains('/') || side.starts_with('.') || !side.contains(':');
    match path_like {
        true => Err(CompareError::NoDump(side.to_string())),
        false => Ok(side),
    }
}

/// `--node`, else the first dump side's `node.json`; None when both sides are dumps.
fn node_for(args: &CompareArgs) -> Result<Option<Node>, CompareError> {
    if let Some(path) = &args.node {
        return Ok(Some(source::read_node(path)?));
    }
    for side in std::iter::once(&args.left).chain(&args.right) {
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
    let side = live_address(side)?;
    let node = node.ok_or_else(|| CompareError::NoNode(side.to_string()))?;
    Ok(source::fetch_live(side, node).await?)
}
