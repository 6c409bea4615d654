//! What `meshpilot doctor` found: checks per cluster, rendered as text (one line per check) or
//! JSON.

use std::fmt::Write;

use serde_json::{json, Value};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Ok,
    Warn,
    Fail,
}

impl Status {
    fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Warn => "warn",
            Self::Fail => "fail",
        }
    }

    /// As the text report prints it: failures stand out.
    fn label(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Warn => "warn",
            Self::Fail => "FAIL",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Check {
    pub name: &'static str,
    pub status: Status,
    pub message: String,
}

impl Check {
    pub fn ok(name: &'static str, message: impl Into<String>) -> Self {
        Self::new(name, Status::Ok, message)
    }

    pub fn warn(name: &'static str, message: impl Into<String>) -> Self {
        Self::new(name, Status::Warn, message)
    }

    pub fn fail(name: &'static str, message: impl Into<String>) -> Self {
        Self::new(name, Status::Fail, message)
    }

    fn new(name: &'static str, status: Status, message: impl Into<String>) -> Self {
        Self {
            name,
            status,
            message: message.into(),
        }
    }
}

/// One cluster: the config cluster (no secret) or one key of a remote secret.
#[derive(Clone, Debug)]
pub struct ClusterReport {
    pub id: String,
    /// `namespace/name` of the Secret holding its kubeconfig; None for the config cluster.
    pub secret: Option<String>,
    pub checks: Vec<Check>,
}

impl ClusterReport {
    fn title(&self) -> String {
        match &self.secret {
            Some(secret) => format!("cluster {} (secret {secret})", self.id),
            None => format!("cluster {} (config cluster)", self.id),
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct Report {
    pub clusters: Vec<ClusterReport>,
}

impl Report {
    fn count(&self, status: Status) -> usize {
        self.clusters
            .iter()
            .flat_map(|c| &c.checks)
            .filter(|c| c.status == status)
            .count()
    }

    pub fn failures(&self) -> usize {
        self.count(Status::Fail)
    }

    pub fn text(&self) -> String {
        let mut out = String::new();
        for cluster in &self.clusters {
            let title = cluster.title();
            for check in &cluster.checks {
                let _ = writeln!(
                    out,
                    "{:<5} {title}: {}: {}",
                    check.status.label(),
                    check.name,
                    check.message
                );
            }
        }
        let plural = |n: usize, word: &str| format!("{n} {word}{}", if n == 1 { "" } else { "s" });
        let _ = writeln!(
            out,
            "summary: {} checked, {}, {}, {} ok",
            plural(self.clusters.len(), "cluster"),
            plural(self.failures(), "failure"),
            plural(self.count(Status::Warn), "warning"),
            self.count(Status::Ok)
        );
        out
    }

    pub fn json(&self) -> Value {
        let clusters: Vec<Value> = self
            .clusters
            .iter()
            .map(|c| {
                let checks: Vec<Value> = c
                    .checks
                    .iter()
                    .map(|k| json!({"name": k.name, "status": k.status.as_str(), "message": k.message}))
                    .collect();
                json!({"id": c.id, "secret": c.secret, "checks": checks})
            })
            .collect();
        json!({
            "clusters": clusters,
            "failures": self.failures(),
            "warnings": self.count(Status::Warn),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> Report {
        Report {
            clusters: vec![
                ClusterReport {
                    id: "primary".into(),
                    secret: None,
                    checks: vec![Check::ok("api server", "answered (v1.33.0)")],
                },
                ClusterReport {
                    id: "east".into(),
                    secret: Some("istio-system/remote-east".into()),
                    checks: vec![
                        Check::fail(
                            "access",
                            "reader cannot watch endpointslices.discovery.k8s.io (cluster-wide)",
                        ),
                        Check::warn("root", "no ConfigMap istio-system/istio-ca-root-cert"),
                    ],
                },
            ],
        }
    }

    #[test]
    fn text_has_one_line_per_check_naming_the_cluster_and_a_summary() {
        let text = report().text();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text}");
        assert_eq!(
            lines[0],
            "ok    cluster primary (config cluster): api server: answered (v1.33.0)"
        );
        assert_eq!(
            lines[1],
            "FAIL  cluster east (secret istio-system/remote-east): access: reader cannot watch endpointslices.discovery.k8s.io (cluster-wide)"
        );
        assert!(lines[2].starts_with("warn  cluster east"), "{text}");
        assert_eq!(
            lines[3],
            "summary: 2 clusters checked, 1 failure, 1 warning, 1 ok"
        );
    }

    #[test]
    fn json_names_clusters_secrets_checks_and_counts_failures() {
        let json = report().json();
        assert_eq!(json["failures"], 1);
        assert_eq!(json["clusters"][0]["secret"], Value::Null);
        assert_eq!(json["clusters"][1]["id"], "east");
        assert_eq!(json["clusters"][1]["secret"], "istio-system/remote-east");
        assert_eq!(json["clusters"][1]["checks"][0]["status"], "fail");
        assert_eq!(json["clusters"][1]["checks"][1]["status"], "warn");
        assert_eq!(json["clusters"][1]["checks"][0]["name"], "access");
    }
}
