//! The webhook configurations, as istiod's chart writes them: the injector's four entries (the
//! namespace opt-in by `istio-injection=enabled` or `istio.io/rev=default`, the pod opt-in by
//! `sidecar.istio.io/inject=true` or `istio.io/rev=default`, `sidecar.istio.io/inject=false`
//! opting out), `failurePolicy: Fail`; the validator for Istio's config groups,
//! `failurePolicy: Ignore` until the leader has seen it refuse invalid config. No `caBundle`: the
//! leader sets it, and leaving it out lets `kubectl apply` of these manifests keep it.
//!
//! A named revision's configurations (Istio's chart, templates/mutatingwebhook.yaml and
//! validatingwebhookconfiguration.yaml) hold only the `rev.` entries for that revision, call the
//! Service `istiod-<revision>` and are named after it: `istioctl tag set` copies the injector.

use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhook, MutatingWebhookConfiguration, RuleWithOperations, ServiceReference,
    ValidatingWebhook, ValidatingWebhookConfiguration, WebhookClientConfig,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};

use super::{labels, meta_labelled};
use crate::istio::revision::REVISION_LABEL;
use crate::istio::Revision;

/// How the API server reaches the webhook.
pub enum Endpoint<'a> {
    /// The revision's Service (`istiod`, `istiod-<revision>`) in the namespace, port 443.
    Service {
        namespace: &'a str,
        revision: &'a Revision,
    },
    /// A URL base (`https://<address>:15017`) for clusters without the control plane.
    Url(String),
}

impl Endpoint<'_> {
    fn client(&self, path: &str) -> WebhookClientConfig {
        match self {
            Endpoint::Service {
                namespace,
                revision,
            } => WebhookClientConfig {
                service: Some(ServiceReference {
                    name: revision.suffixed("istiod"),
                    namespace: namespace.to_string(),
                    path: Some(path.into()),
                    port: Some(443),
                }),
                ..Default::default()
            },
            Endpoint::Url(base) => WebhookClientConfig {
                url: Some(format!("{base}{path}")),
                ..Default::default()
            },
        }
    }
}

fn requirement(key: &str, operator: &str, values: &[&str]) -> LabelSelectorRequirement {
    LabelSelectorRequirement {
        key: key.into(),
        operator: operator.into(),
        values: (!values.is_empty()).then(|| values.iter().map(|v| v.to_string()).collect()),
    }
}

fn selector(requirements: Vec<LabelSelectorRequirement>) -> Option<LabelSelector> {
    Some(LabelSelector {
        match_expressions: Some(requirements),
        match_labels: None,
    })
}

fn review_versions() -> Vec<String> {
    vec!["v1beta1".into(), "v1".into()]
}

/// Name of the injector configuration of a revision in a namespace (as Istio's chart names it).
pub fn injector_name(namespace: &str, revision: &Revision) -> String {
    let name = revision.suffixed("istio-sidecar-injector");
    match namespace {
        "istio-system" => name,
        ns => format!("{name}-{ns}"),
    }
}

/// `path` is `/inject`, or for a remote cluster `/inject/cluster/<id>/net/<network>`.
pub fn injector(
    namespace: &str,
    endpoint: &Endpoint<'_>,
    path: &str,
    revision: &Revision,
) -> MutatingWebhookConfiguration {
    let rev = revision.as_str();
    let not_opted_out = requirement("sidecar.istio.io/inject", "NotIn", &["false"]);
    let mut entries = vec![
        (
            "rev.namespace.sidecar-injector.istio.io",
            vec![
                requirement(REVISION_LABEL, "In", &[rev]),
                requirement("istio-injection", "DoesNotExist", &[]),
            ],
            vec![not_opted_out.clone()],
        ),
        (
            "rev.object.sidecar-injector.istio.io",
            vec![
                requirement(REVISION_LABEL, "DoesNotExist", &[]),
                requirement("istio-injection", "DoesNotExist", &[]),
            ],
            vec![
                not_opted_out.clone(),
                requirement(REVISION_LABEL, "In", &[rev]),
            ],
        ),
    ];
    // Only the unrevisioned install answers `istio-injection=enabled` and the pod opt-in.
    if revision.is_default() {
        entries.extend(default_injector_entries(not_opted_out));
    }
    let webhooks = entries
        .into_iter()
        .map(|(name, namespaces, objects)| MutatingWebhook {
            name: name.into(),
            client_config: endpoint.client(path),
            side_effects: "None".into(),
            rules: Some(vec![RuleWithOperations {
                operations: Some(vec!["CREATE".into()]),
                api_groups: Some(vec!["".into()]),
                api_versions: Some(vec!["v1".into()]),
                resources: Some(vec!["pods".into()]),
                scope: None,
            }]),
            failure_policy: Some("Fail".into()),
            reinvocation_policy: Some("Never".into()),
            admission_review_versions: review_versions(),
            namespace_selector: selector(namespaces),
            object_selector: selector(objects),
            ..Default::default()
        })
        .collect();
    MutatingWebhookConfiguration {
        metadata: meta_labelled(
            &injector_name(namespace, revision),
            None,
            labels(&[("app", "sidecar-injector"), (REVISION_LABEL, rev)]),
        ),
        webhooks: Some(webhooks),
    }
}

type Entry = (
    &'static str,
    Vec<LabelSelectorRequirement>,
    Vec<LabelSelectorRequirement>,
);

/// The namespace opt-in by `istio-injection=enabled` and the pod opt-in by
/// `sidecar.istio.io/inject=true`, where neither names a revision.
fn default_injector_entries(not_opted_out: LabelSelectorRequirement) -> [Entry; 2] {
    [
        (
            "namespace.sidecar-injector.istio.io",
            vec![requirement("istio-injection", "In", &["enabled"])],
            vec![not_opted_out],
        ),
        (
            "object.sidecar-injector.istio.io",
            vec![
                requirement("istio-injection", "DoesNotExist", &[]),
                requirement(REVISION_LABEL, "DoesNotExist", &[]),
            ],
            vec![
                requirement("sidecar.istio.io/inject", "In", &["true"]),
                requirement(REVISION_LABEL, "DoesNotExist", &[]),
            ],
        ),
    ]
}

/// Validation of the Istio config groups meshpilot reads, for objects of the revision (and, for
/// the default revision, unlabelled ones).
pub fn validator(
    namespace: &str,
    endpoint: &Endpoint<'_>,
    revision: &Revision,
) -> ValidatingWebhookConfiguration {
    let rev = revision.as_str();
    let rules = vec![RuleWithOperations {
        operations: Some(vec!["CREATE".into(), "UPDATE".into()]),
        api_groups: Some(
            crate::istio::ISTIO_GROUPS
                .iter()
                .map(|g| g.to_string())
                .collect(),
        ),
        api_versions: Some(vec!["*".into()]),
        resources: Some(vec!["*".into()]),
        scope: None,
    }];
    let entry = |name: &str, objects: LabelSelectorRequirement| ValidatingWebhook {
        name: name.into(),
        client_config: endpoint.client("/validate"),
        rules: Some(rules.clone()),
        failure_policy: Some("Ignore".into()),
        side_effects: "None".into(),
        admission_review_versions: review_versions(),
        object_selector: selector(vec![objects]),
        ..Default::default()
    };
    let mut entries = vec![entry(
        "rev.validation.istio.io",
        requirement(REVISION_LABEL, "In", &[rev]),
    )];
    if revision.is_default() {
        entries.push(entry(
            "validation.istio.io",
            requirement(REVISION_LABEL, "DoesNotExist", &[]),
        ));
    }
    ValidatingWebhookConfiguration {
        metadata: meta_labelled(
            &format!("{}-{namespace}", revision.suffixed("istio-validator")),
            None,
            labels(&[
                ("app", "istiod"),
                ("istio", "istiod"),
                (REVISION_LABEL, rev),
            ]),
        ),
        webhooks: Some(entries),
    }
}
