//! Whether a pod gets a sidecar, by istiod's rules for an injector whose policy is `enabled` (the
//! namespace opt-in is the webhook configuration's selectors): never with host networking or in
//! Kubernetes' own namespaces; the pod label `sidecar.istio.io/inject` (or, without it, the
//! annotation) opts in with y/yes/true/on and out with anything else.

use k8s_openapi::api::core::v1::PodSpec;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::annotations::INJECT;
use crate::istio::KUBE_SYSTEM_NAMESPACES;

pub fn injection_required(meta: &ObjectMeta, spec: &PodSpec, namespace: &str) -> bool {
    if spec.host_network == Some(true) || KUBE_SYSTEM_NAMESPACES.contains(&namespace) {
        return false;
    }
    let label = meta.labels.as_ref().and_then(|l| l.get(INJECT));
    let annotation = meta.annotations.as_ref().and_then(|a| a.get(INJECT));
    match label.or(annotation).map(|v| v.to_ascii_lowercase()) {
        None => true,
        Some(v) if v.is_empty() => true,
        Some(v) => matches!(v.as_str(), "y" | "yes" | "true" | "on"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn meta(labels: &[(&str, &str)], annotations: &[(&str, &str)]) -> ObjectMeta {
        let map = |kv: &[(&str, &str)]| {
            Some(
                kv.iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect::<BTreeMap<_, _>>(),
            )
        };
        ObjectMeta {
            labels: map(labels),
            annotations: map(annotations),
            ..Default::default()
        }
    }

    #[test]
    fn opt_in_and_out_follow_istio() {
        let spec = PodSpec::default();
        assert!(injection_required(&meta(&[], &[]), &spec, "shop"));
        assert!(!injection_required(
            &meta(&[(INJECT, "false")], &[]),
            &spec,
            "shop"
        ));
        assert!(!injection_required(
            &meta(&[], &[(INJECT, "no")]),
            &spec,
            "shop"
        ));
        // The label wins over the annotation.
        assert!(injection_required(
            &meta(&[(INJECT, "true")], &[(INJECT, "false")]),
            &spec,
            "shop"
        ));
        assert!(!injection_required(&meta(&[], &[]), &spec, "kube-system"));
        let host = PodSpec {
            host_network: Some(true),
            ..Default::default()
        };
        assert!(!injection_required(
            &meta(&[(INJECT, "true")], &[]),
            &host,
            "shop"
        ));
    }
}
