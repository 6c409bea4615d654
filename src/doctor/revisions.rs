//! A revision install, checked on the config cluster: the control-plane revisions installed (their
//! canonical injectors), where the tags point, which namespaces each serves, namespaces naming a
//! revision nobody serves, and whether every injector trusts the mesh's root (two roots in one
//! mesh break mTLS between pods of different revisions).

use std::collections::BTreeMap;

use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::ListParams;
use kube::{Api, Client, ResourceExt};

use super::report::Check;
use crate::istio::revision::{DEFAULT, REVISION_LABEL, TAG_LABEL};

const NAME: &str = "revisions";

/// One injector configuration: its revision, the tag it stands for, the roots it trusts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Injector {
    pub name: String,
    pub revision: String,
    pub tag: Option<String>,
    pub ca_bundles: Vec<String>,
}

/// Reads the injectors and namespaces' injection labels; the checks, or why they could not run.
pub async fn check(client: &Client, mesh_root: Option<&str>) -> Vec<Check> {
    let webhooks: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let (labelled, all) = (
        ListParams::default().labels(REVISION_LABEL),
        ListParams::default(),
    );
    let (webhooks, namespaces) = tokio::join!(webhooks.list(&labelled), namespaces.list(&all));
    let (webhooks, namespaces) = match (webhooks, namespaces) {
        (Ok(w), Ok(n)) => (w.items, n.items),
        (Err(e), _) | (_, Err(e)) => {
            let error = crate::kube_error::Readable(&e);
            return vec![Check::warn(NAME, format!("{error}; revisions not checked"))];
        }
    };
    let injectors: Vec<Injector> = webhooks.iter().map(injector).collect();
    let labels: Vec<(String, BTreeMap<String, String>)> = namespaces
        .iter()
        .map(|ns| (ns.name_any(), ns.labels().clone()))
        .collect();
    verdicts(&injectors, &labels, mesh_root)
}

fn injector(config: &MutatingWebhookConfiguration) -> Injector {
    let label = |key: &str| config.labels().get(key).cloned();
    let bundles = (config.webhooks.iter().flatten())
        .filter_map(|h| h.client_config.ca_bundle.as_ref())
        .map(|b| String::from_utf8_lossy(&b.0).trim().to_string())
        .collect();
    Injector {
        name: config.name_any(),
        revision: label(REVISION_LABEL).unwrap_or_default(),
        tag: label(TAG_LABEL),
        ca_bundles: bundles,
    }
}

/// The checks over what was read (pure, so it is tested without a cluster).
pub fn verdicts(
    injectors: &[Injector],
    namespaces: &[(String, BTreeMap<String, String>)],
    mesh_root: Option<&str>,
) -> Vec<Check> {
    let tags: BTreeMap<&str, &str> = (injectors.iter())
        .filter_map(|i| Some((i.tag.as_deref()?, i.revision.as_str())))
        .collect();
    let revisions: BTreeMap<&str, &Injector> = (injectors.iter())
        .filter(|i| i.tag.is_none())
        .map(|i| (i.revision.as_str(), i))
        .collect();
    let mut served: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    let mut checks = Vec::new();
    for (namespace, labels) in namespaces {
        let named = match (labels.get("istio-injection"), labels.get(REVISION_LABEL)) {
            (Some(enabled), _) if enabled == "enabled" => DEFAULT,
            (Some(_), _) | (None, None) => continue,
            (None, Some(rev)) => rev.as_str(),
        };
        let revision = tags.get(named).copied().unwrap_or(named);
        match revisions.contains_key(revision) {
            true => served.entry(revision).or_default().push(namespace),
            false => checks.push(Check::fail(
                NAME,
                format!("namespace {namespace} asks for revision {named}, which no injector serves: its new pods get no sidecar"),
            )),
        }
    }
    for (revision, injector) in &revisions {
        let namespaces = served.get(revision).map(|n| n.join(", "));
        let tagged: Vec<&str> = (tags.iter())
            .filter(|(_, target)| *target == revision)
            .map(|(tag, _)| *tag)
            .collect();
        checks.push(Check::ok(
            NAME,
            format!(
                "revision {revision} (injector {}{}): serves {}",
                injector.name,
                match tagged.is_empty() {
                    true => String::new(),
                    false => format!("; tags {}", tagged.join(", ")),
                },
                namespaces.as_deref().unwrap_or("no namespace")
            ),
        ));
    }
    if let Some(root) = mesh_root.map(str::trim).filter(|r| !r.is_empty()) {
        for injector in injectors {
            if injector.ca_bundles.iter().any(|b| !b.contains(root)) {
                checks.push(Check::fail(
                    NAME,
                    format!("{} (revision {}) trusts a root other than the mesh's: the two control planes must share one root", injector.name, injector.revision),
                ));
            }
        }
    }
    checks
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::report::Status;

    fn injector(name: &str, revision: &str, tag: Option<&str>, bundle: &str) -> Injector {
        Injector {
            name: name.into(),
            revision: revision.into(),
            tag: tag.map(str::to_string),
            ca_bundles: vec![bundle.into()],
        }
    }

    fn ns(name: &str, labels: &[(&str, &str)]) -> (String, BTreeMap<String, String>) {
        let labels = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        (name.into(), labels)
    }

    #[test]
    fn each_revision_is_named_with_its_namespaces_and_strays_fail() {
        let injectors = [
            injector("istio-sidecar-injector", "default", None, "ROOT"),
            injector("istio-sidecar-injector-canary", "canary", None, "ROOT"),
            injector(
                "istio-revision-tag-default",
                "canary",
                Some("default"),
                "OTHER",
            ),
        ];
        let namespaces = [
            ns("legacy", &[("istio-injection", "enabled")]),
            ns("shop", &[("istio.io/rev", "canary")]),
            ns("lost", &[("istio.io/rev", "1-20")]),
            ns(
                "off",
                &[("istio-injection", "disabled"), ("istio.io/rev", "canary")],
            ),
            ns("plain", &[]),
        ];
        let checks = verdicts(&injectors, &namespaces, Some("ROOT\n"));
        let text: Vec<String> = checks.iter().map(|c| format!("{c:?}")).collect();
        let all = text.join("\n");
        assert!(all.contains("revision canary (injector istio-sidecar-injector-canary; tags default): serves legacy, shop"), "{all}");
        assert!(
            all.contains("revision default (injector istio-sidecar-injector): serves no namespace"),
            "{all}"
        );
        assert!(
            all.contains("namespace lost asks for revision 1-20, which no injector serves"),
            "{all}"
        );
        assert!(
            all.contains(
                "istio-revision-tag-default (revision canary) trusts a root other than the mesh's"
            ),
            "{all}"
        );
        let failures = checks.iter().filter(|c| c.status == Status::Fail).count();
        assert_eq!(failures, 2, "{all}");
    }
}
