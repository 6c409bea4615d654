//! The DNS half of Istio's agent (tests/peers/nds_agent.py, grpcio): asks for the name table as
//! istio-agent does, and can answer DNS from it.

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::peer_python;

pub struct NdsAgent {
    _child: Child,
    lines: UnboundedReceiver<Value>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Sotw,
    Delta,
}

impl NdsAgent {
    /// An agent for the proxy `node_id` in cluster `cluster` and `network` (may be empty); with
    /// `dns` (network namespace, address), also a DNS server on that address in that namespace
    /// (its bound address in the first line).
    pub fn start(
        xds: SocketAddr,
        node_id: &str,
        (cluster, network): (&str, &str),
        protocol: Protocol,
        dns: Option<(&str, &str)>,
    ) -> Self {
        let namespace = super::node_namespace(node_id);
        let mut command = match dns {
            Some((netns, _)) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", netns]).arg(peer_python());
                c
            }
            None => Command::new(peer_python()),
        };
        command
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/tests/peers/nds_agent.py"
            ))
            .args([&xds.to_string(), node_id, &namespace, cluster, network]);
        if protocol == Protocol::Delta {
            command.arg("--delta");
        }
        if let Some((_, address)) = dns {
            command.args(["--dns", address]);
        }
        let mut child = command
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start nds_agent.py (run ./scripts/test to install grpcio)");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = unbounded_channel();
        tokio::spawn(async move {
            let mut reader = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = reader.next_line().await {
                let value = serde_json::from_str(&line)
                    .unwrap_or_else(|e| panic!("agent printed {line:?}: {e}"));
                if tx.send(value).is_err() {
                    return;
                }
            }
        });
        Self {
            _child: child,
            lines,
        }
    }

    async fn line(&mut self, bound: Duration) -> Option<Value> {
        let line = tokio::time::timeout(bound, self.lines.recv()).await.ok()?;
        let line = line.expect("the agent exited");
        assert!(line.get("code").is_none(), "the NDS stream failed: {line}");
        Some(line)
    }

    /// The address its DNS server listens on.
    pub async fn dns_address(&mut self, bound: Duration) -> SocketAddr {
        let line = self.line(bound).await.expect("the agent's DNS server");
        line["listening"]
            .as_str()
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("expected the listening line, got {line}"))
    }

    /// The next table received.
    pub async fn next_table(&mut self, bound: Duration) -> Value {
        let line = self
            .line(bound)
            .await
            .expect("a name table within the bound");
        line["table"].clone()
    }

    /// Waits for a table `check` accepts; returns it.
    pub async fn table_where(
        &mut self,
        what: &str,
        bound: Duration,
        check: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = tokio::time::Instant::now() + bound;
        let mut last = Value::Null;
        while let Some(line) = self.line(deadline - tokio::time::Instant::now()).await {
            last = line["table"].clone();
            if check(&last) {
                return last;
            }
        }
        panic!("no name table {what} within {bound:?}; last: {last}")
    }

    /// Asserts that no table arrives within `quiet`.
    pub async fn silent(&mut self, quiet: Duration, why: &str) {
        if let Some(line) = self.line(quiet).await {
            panic!("a name table arrived {why}: {line}");
        }
    }
}

/// The addresses of `host` in a table, sorted.
pub fn ips(table: &Value, host: &str) -> Vec<String> {
    let mut ips: Vec<String> = table[host]["ips"]
        .as_array()
        .unwrap_or_else(|| panic!("{host} not in {table}"))
        .iter()
        .map(|ip| ip.as_str().unwrap_or_default().to_string())
        .collect();
    ips.sort();
    ips
}
