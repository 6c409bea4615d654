//! A remote cluster's own discovery selectors, beyond istiod: the annotation
//! `meshpilot.io/discovery-selectors` on its Secret (a YAML list of LabelSelectors) replaces the
//! mesh config's `discoverySelectors` for the clusters that Secret onboards; without it they
//! follow the mesh config's.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Secret;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::istio::label_selector::LabelSelector;
use crate::registry::ClusterRegistry;
use crate::text::clip;

pub const ANNOTATION: &str = "meshpilot.io/discovery-selectors";

/// The Secret's own selectors, if it names some; why they cannot be read, if they cannot.
pub fn annotated(secret: &Secret) -> Result<Option<Vec<LabelSelector>>, String> {
    let Some(text) = secret
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANNOTATION))
    else {
        return Ok(None);
    };
    let invalid = |e: String| format!("annotation {ANNOTATION}: {}", clip(&e));
    crate::yaml::check_aliases(text).map_err(|e| invalid(e.to_string()))?;
    let selectors: Vec<LabelSelector> =
        serde_yaml_ng::from_str(text).map_err(|e| invalid(e.to_string()))?;
    for (i, selector) in selectors.iter().enumerate() {
        selector
            .validate()
            .map_err(|e| invalid(e.under(&format!("[{i}]")).to_string()))?;
    }
    Ok(Some(selectors))
}

/// The selectors one remote cluster's watches follow: its own, else the mesh config's.
pub struct ClusterSelectors {
    own: watch::Sender<Option<Vec<LabelSelector>>>,
    /// What its watches read.
    pub effective: watch::Receiver<Vec<LabelSelector>>,
    task: JoinHandle<()>,
}

impl ClusterSelectors {
    pub fn start(
        mut mesh: watch::Receiver<Vec<LabelSelector>>,
        own: Option<Vec<LabelSelector>>,
        registry: Arc<ClusterRegistry>,
    ) -> Self {
        let (own, mut own_rx) = watch::channel(own);
        let initial = own_rx
            .borrow()
            .clone()
            .unwrap_or_else(|| mesh.borrow().clone());
        let (effective_tx, effective) = watch::channel(initial);
        let task = tokio::spawn(async move {
            loop {
                let own = own_rx.borrow_and_update().clone();
                let from = match own.is_some() {
                    true => format!("remote secret annotation {ANNOTATION}"),
                    false => "mesh config".to_string(),
                };
                registry.update_discovery(|d| d.from = from);
                let selectors = own.unwrap_or_else(|| mesh.borrow_and_update().clone());
                effective_tx.send_if_modified(|current| {
                    let changed = *current != selectors;
                    *current = selectors;
                    changed
                });
                tokio::select! {
                    changed = mesh.changed() => if changed.is_err() { return },
                    changed = own_rx.changed() => if changed.is_err() { return },
                }
            }
        });
        Self {
            own,
            effective,
            task,
        }
    }

    /// The Secret's own selectors changed (None: it names none now).
    pub fn set_own(&self, own: Option<Vec<LabelSelector>>) {
        self.own.send_if_modified(|current| {
            let changed = *current != own;
            *current = own;
            changed
        });
    }
}

impl Drop for ClusterSelectors {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(annotation: Option<&str>) -> Secret {
        let mut secret = Secret::default();
        if let Some(text) = annotation {
            secret.metadata.annotations = Some([(ANNOTATION.to_string(), text.to_string())].into());
        }
        secret
    }

    #[test]
    fn absent_valid_and_refused_annotations() {
        assert_eq!(annotated(&secret(None)), Ok(None));
        let own = annotated(&secret(Some("- matchLabels: {team: b}")))
            .unwrap()
            .unwrap();
        assert_eq!(own.len(), 1);
        assert_eq!(own[0].match_labels["team"], "b");
        let error = annotated(&secret(Some("[{matchLabels: [x]}]"))).unwrap_err();
        assert!(
            error.starts_with("annotation meshpilot.io/discovery-selectors: "),
            "{error}"
        );
        let error = annotated(&secret(Some(
            "[{matchExpressions: [{key: a, operator: Near}]}]",
        )))
        .unwrap_err();
        assert!(error.contains("[0]") && error.contains("Near"), "{error}");
    }
}
