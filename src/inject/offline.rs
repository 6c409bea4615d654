//! `meshpilot inject -f <file>`: the webhook's injection applied to a manifest offline (as
//! `istioctl kube-inject`): Pods and the pod templates of workloads; other documents pass through.

use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;
use k8s_openapi::api::core::v1::PodSpec;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Deserialize;
use serde_json::Value;
use thiserror::Error;

use super::{inject, InjectArgs, InjectConfig, InjectError, Overrides, Workload};
use crate::istio::MeshConfig;
use crate::text::clip;

#[derive(Debug, Clone, Args)]
pub struct InjectCmdArgs {
    /// Manifest to inject (`-` reads standard input).
    #[arg(short = 'f', long = "filename")]
    pub file: PathBuf,

    /// Mesh config YAML (the `mesh` key of ConfigMap istio); Istio's defaults without it.
    #[arg(long)]
    pub mesh_config: Option<PathBuf>,

    /// Cluster id of the workloads' cluster (ISTIO_META_CLUSTER_ID).
    #[arg(long, env = "MESHPILOT_CLUSTER_ID", default_value = "Kubernetes")]
    pub cluster_id: String,

    /// Trust domain, when no mesh config names one.
    #[arg(long, env = "MESHPILOT_TRUST_DOMAIN", default_value = "cluster.local")]
    pub trust_domain: String,

    /// Namespace of the control plane.
    #[arg(
        long,
        env = "MESHPILOT_SYSTEM_NAMESPACE",
        default_value = "istio-system"
    )]
    pub system_namespace: String,

    /// Kubernetes DNS domain suffix.
    #[arg(long, env = "MESHPILOT_DOMAIN_SUFFIX", default_value = "cluster.local")]
    pub domain_suffix: String,

    #[command(flatten)]
    pub inject: InjectArgs,
}

#[derive(Debug, Error)]
pub enum OfflineError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: mesh config: {message}")]
    Mesh { path: String, message: String },
    #[error("{path}, document {document}: {message}")]
    Document {
        path: String,
        document: usize,
        message: String,
    },
    #[error("{path}, document {document} ({object}): {source}")]
    Inject {
        path: String,
        document: usize,
        object: String,
        source: Box<InjectError>,
    },
}

/// The manifest with every pod and pod template injected, as YAML documents.
pub fn run(args: &InjectCmdArgs) -> Result<String, OfflineError> {
    let path = args.file.display().to_string();
    let read = |file: &PathBuf| {
        let result = match file.to_str() {
            Some("-") => std::io::read_to_string(std::io::stdin()),
            _ => std::fs::read_to_string(file),
        };
        result.map_err(|source| OfflineError::Read {
            path: file.display().to_string(),
            source,
        })
    };
    let defaults = super::default_mesh(&args.trust_domain, &args.system_namespace);
    let mesh = match &args.mesh_config {
        Some(file) => {
            MeshConfig::parse(&read(file)?, &defaults).map_err(|e| OfflineError::Mesh {
                path: file.display().to_string(),
                message: e.to_string(),
            })?
        }
        None => defaults,
    };
    let config = args.inject.config(
        &args.cluster_id,
        &args.system_namespace,
        &args.domain_suffix,
        Arc::new(mesh),
    );
    let text = read(&args.file)?;
    crate::yaml::check_aliases(&text).map_err(|e| OfflineError::Document {
        path: path.clone(),
        document: e.document,
        message: e.to_string(),
    })?;
    let mut out = Vec::new();
    for (index, document) in serde_yaml_ng::Deserializer::from_str(&text).enumerate() {
        let document_error = |message: String| OfflineError::Document {
            path: path.clone(),
            document: index + 1,
            message,
        };
        let mut value =
            Value::deserialize(document).map_err(|e| document_error(clip(&e.to_string())))?;
        if value.is_null() {
            continue;
        }
        inject_document(&mut value, &config).map_err(|(object, source)| match source {
            Some(source) => OfflineError::Inject {
                path: path.clone(),
                document: index + 1,
                object,
                source: Box::new(source),
            },
            None => document_error(object),
        })?;
        out.push(serde_yaml_ng::to_string(&value).map_err(|e| document_error(e.to_string()))?);
    }
    Ok(out.join("---\n"))
}

/// Where a kind keeps its pod template.
fn template_path(kind: &str) -> Option<&'static str> {
    match kind {
        "Pod" => Some(""),
        "Deployment"
        | "StatefulSet"
        | "DaemonSet"
        | "ReplicaSet"
        | "Job"
        | "ReplicationController" => Some("/spec/template"),
        "CronJob" => Some("/spec/jobTemplate/spec/template"),
        _ => None,
    }
}

/// Injects one document in place; an error names the object (and the injection error, if that
/// is what failed).
fn inject_document(
    document: &mut Value,
    config: &InjectConfig,
) -> Result<(), (String, Option<InjectError>)> {
    let text = |v: &Value| v.as_str().unwrap_or_default().to_string();
    let kind = text(&document["kind"]);
    let Some(path) = template_path(&kind) else {
        return Ok(());
    };
    let name = text(&document["metadata"]["name"]);
    let object = format!("{kind} {name}");
    let namespace = match text(&document["metadata"]["namespace"]) {
        ns if ns.is_empty() => "default".to_string(),
        ns => ns,
    };
    let api_version = text(&document["apiVersion"]);
    let Some(template) = document.pointer_mut(path) else {
        return Err((format!("{object}: no pod template at {path}"), None));
    };
    let mut meta: ObjectMeta = serde_json::from_value(template["metadata"].clone())
        .map_err(|e| (format!("{object}: metadata: {e}"), None))?;
    let mut spec: PodSpec = serde_json::from_value(template["spec"].clone())
        .map_err(|e| (format!("{object}: spec: {e}"), None))?;
    let workload = match kind.as_str() {
        "Pod" => Workload::of_pod(&meta, &namespace),
        _ => Workload {
            name,
            namespace: namespace.clone(),
            kind: kind.clone(),
            api_version,
        },
    };
    inject(
        &mut meta,
        &mut spec,
        &namespace,
        &workload,
        config,
        &Overrides::default(),
    )
    .map_err(|e| (object.clone(), Some(e)))?;
    let encode = |e: serde_json::Error| (object.clone(), Some(InjectError::Object(e.to_string())));
    template["metadata"] = serde_json::to_value(&meta).map_err(encode)?;
    template["spec"] = serde_json::to_value(&spec).map_err(encode)?;
    Ok(())
}
