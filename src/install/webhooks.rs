//! The webhook configurations, as istiod's chart writes them: the injector's four entries (the
//! namespace opt-in by `istio-injection=enabled` or `istio.io/rev=default`, the pod opt-in by
//! `sidecar.istio.io/inject=true` or `istio.io/rev=default`, `sidecar.istio.io/inject=false`
//! opting out), `failurePolicy: Fail`; the validator for Istio's config groups,
//! `failurePolicy: Ignore` until the leader has seen it refuse invalid config. No `caBundle`: the
//! leader sets it, and leaving it out lets `kubectl apply` of these manifests keep it.

use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhook, MutatingWebhookConfiguration, RuleWithOperations, ServiceReference,
    ValidatingWebhook, ValidatingWebhookConfiguration, WebhookClientConfig,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};

use super::{labels, meta_labelled};

/// How the API server reaches the webhook.
pub enum Endpoint<'a> {
    /// Service `istiod` in the namespace, port 443.
    Service { namespace: &'a str },
    /// A URL base (`https://<address>:15017`) for clusters without the control plane.
    Url(String),
}

impl Endpoint<'_> {
    fn client(&self, path: &str) -> WebhookClientConfig {
        match self {
            Endpoint::Service { namespace } => WebhookClientConfig {
                service: Some(ServiceReference {
                    name: "istiod".into(),
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

/// Name of the injector configuration in a namespace.
pub fn injector_name(namespace: &str) -> String {
    match namespace {
        "istio-system" => "istio-sidecar-injector".into(),
        ns => format!("istio-sidecar-injector-{ns}"),
    }
}

/// `path` is `/inject`, or for a remote cluster `/inject/cluster/<id>/net/<network>`.
pub fn injector(
    namespace: &str,
    endpoint: &Endpoint<'_>,
    path: &str,
) -> MutatingWebhookConfiguration {
    let not_opted_out = requirement("sidecar.istio.io/inject", "NotIn", &["false"]);
    let entries = [
        (
            "rev.namespace.sidecar-injector.istio.io",
            vec![
                requirement("istio.io/rev", "In", &["default"]),
                requirement("istio-injection", "DoesNotExist", &[]),
            ],
            vec![not_opted_out.clone()],
        ),
        (
            "rev.object.sidecar-injector.istio.io",
            vec![
                requirement("istio.io/rev", "DoesNotExist", &[]),
                requirement("istio-injection", "DoesNotExist", &[]),
            ],
            vec![
                not_opted_out.clone(),
                requirement("istio.io/rev", "In", &["default"]),
            ],
        ),
        (
            "namespace.sidecar-injector.istio.io",
            vec![requirement("istio-injection", "In", &["enabled"])],
            vec![not_opted_out],
        ),
        (
            "object.sidecar-injector.istio.io",
            vec![
                requirement("istio-injection", "DoesNotExist", &[]),
                requirement("istio.io/rev", "DoesNotExist", &[]),
            ],
            vec![
                requirement("sidecar.istio.io/inject", "In", &["true"]),
                requirement("istio.io/rev", "DoesNotExist", &[]),
            ],
        ),
    ];
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
            &injector_name(namespace),
            None,
            labels(&[("app", "sidecar-injector"), ("istio.io/rev", "default")]),
        ),
        webhooks: Some(webhooks),
    }
}

/// Validation of the Istio config groups meshpilot reads, for objects of the default revision.
pub fn validator(namespace: &str, endpoint: &Endpoint<'_>) -> ValidatingWebhookConfiguration {
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
    ValidatingWebhookConfiguration {
        metadata: meta_labelled(
            &format!("istio-validator-{namespace}"),
            None,
            labels(&[
                ("app", "istiod"),
                ("istio", "istiod"),
                ("istio.io/rev", "default"),
            ]),
        ),
        webhooks: Some(vec![
            entry(
                "rev.validation.istio.io",
                requirement("istio.io/rev", "In", &["default"]),
            ),
            entry(
                "validation.istio.io",
                requirement("istio.io/rev", "DoesNotExist", &[]),
            ),
        ]),
    }
}
