//! The workload a pod belongs to (ISTIO_META_WORKLOAD_NAME, ISTIO_META_OWNER, the endpoint's
//! `istio.workload` metadata), found from its controller as istiod does: a ReplicaSet named after
//! the pod's `pod-template-hash` stands for its Deployment. And its canonical service, as Istio's
//! `kubelabels.CanonicalService` derives it from the labels.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

const CANONICAL_NAME_LABELS: [&str; 3] = [
    "service.istio.io/canonical-name",
    "app.kubernetes.io/name",
    "app",
];
const CANONICAL_REVISION_LABELS: [&str; 3] = [
    "service.istio.io/canonical-revision",
    "app.kubernetes.io/version",
    "version",
];
/// The revision of a workload whose labels name none.
pub const DEFAULT_REVISION: &str = "latest";

/// A workload's canonical service name and revision: the first label of each list that is set,
/// else the workload's name and `latest`.
pub fn canonical_service<'a>(
    labels: &'a BTreeMap<String, String>,
    workload: &'a str,
) -> (&'a str, &'a str) {
    let first = |keys: &[&str]| {
        keys.iter()
            .find_map(|k| labels.get(*k).filter(|v| !v.is_empty()))
            .map(String::as_str)
    };
    (
        first(&CANONICAL_NAME_LABELS).unwrap_or(workload),
        first(&CANONICAL_REVISION_LABELS).unwrap_or(DEFAULT_REVISION),
    )
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Workload {
    pub name: String,
    pub namespace: String,
    pub kind: String,
    pub api_version: String,
}

impl Workload {
    /// The workload of a pod, from its controller reference; the pod itself without one.
    pub fn of_pod(meta: &ObjectMeta, namespace: &str) -> Self {
        let pod = Self {
            name: meta.name.clone().unwrap_or_default(),
            namespace: namespace.to_string(),
            kind: "Pod".into(),
            api_version: "v1".into(),
        };
        let controller = meta
            .owner_references
            .iter()
            .flatten()
            .find(|r| r.controller == Some(true));
        let Some(owner) = controller else {
            return pod;
        };
        let hash = meta
            .labels
            .as_ref()
            .and_then(|l| l.get("pod-template-hash"))
            .filter(|h| !h.is_empty());
        if let Some(hash) = hash.filter(|_| owner.kind == "ReplicaSet") {
            if let Some(deployment) = owner.name.strip_suffix(&format!("-{hash}")) {
                return Self {
                    name: deployment.to_string(),
                    kind: "Deployment".into(),
                    api_version: "apps/v1".into(),
                    ..pod
                };
            }
        }
        Self {
            name: owner.name.clone(),
            kind: owner.kind.clone(),
            api_version: owner.api_version.clone(),
            ..pod
        }
    }

    /// `kubernetes://apis/<apiVersion>/namespaces/<ns>/<kinds>/<name>`, as ISTIO_META_OWNER.
    pub fn owner(&self) -> String {
        format!(
            "kubernetes://apis/{}/namespaces/{}/{}s/{}",
            self.api_version,
            self.namespace,
            self.kind.to_ascii_lowercase(),
            self.name
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
    use std::collections::BTreeMap;

    #[test]
    fn a_replica_set_pod_belongs_to_its_deployment() {
        let meta = ObjectMeta {
            name: Some("reviews-v1-7f9c8d-abcde".into()),
            labels: Some(BTreeMap::from([(
                "pod-template-hash".to_string(),
                "7f9c8d".to_string(),
            )])),
            owner_references: Some(vec![OwnerReference {
                api_version: "apps/v1".into(),
                kind: "ReplicaSet".into(),
                name: "reviews-v1-7f9c8d".into(),
                controller: Some(true),
                ..Default::default()
            }]),
            ..Default::default()
        };
        let workload = Workload::of_pod(&meta, "shop");
        assert_eq!(workload.name, "reviews-v1");
        assert_eq!(
            workload.owner(),
            "kubernetes://apis/apps/v1/namespaces/shop/deployments/reviews-v1"
        );
        let bare = Workload::of_pod(
            &ObjectMeta {
                name: Some("p".into()),
                ..Default::default()
            },
            "shop",
        );
        assert_eq!(bare.owner(), "kubernetes://apis/v1/namespaces/shop/pods/p");
    }

    #[test]
    fn canonical_service_from_the_first_label_set() {
        let labels = BTreeMap::from([
            ("app".to_string(), "reviews".to_string()),
            ("app.kubernetes.io/version".to_string(), "v2".to_string()),
            ("version".to_string(), "v1".to_string()),
        ]);
        assert_eq!(canonical_service(&labels, "w"), ("reviews", "v2"));
        assert_eq!(canonical_service(&BTreeMap::new(), "w"), ("w", "latest"));
    }
}
