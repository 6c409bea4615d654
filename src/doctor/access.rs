//! What meshpilot's identity in a cluster must be allowed, asked of the cluster itself with
//! SelfSubjectAccessReviews: the list and watch of every kind meshpilot's watchers read, the
//! TokenReviews that authenticate the cluster's workloads and the SubjectAccessReviews that
//! authorize their gateways' credentials.

use std::fmt;

use futures::{stream, StreamExt};
use k8s_openapi::api::authentication::v1::TokenReview;
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec, SubjectAccessReview,
};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Node, Pod, Secret, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::PostParams;
use kube::{Api, Client};

use super::report::Check;
use crate::istio::ConfigKind;
use crate::kube_error::WithCauses;
use crate::text::clip;

const NAME: &str = "access";
/// Reviews in flight at once: a few connections to the API server, not one per question.
const IN_FLIGHT: usize = 8;

/// One permission: a verb on a resource, cluster-wide or in one namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Access {
    pub verb: &'static str,
    pub group: &'static str,
    pub resource: &'static str,
    pub namespace: Option<String>,
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.verb, self.resource)?;
        if !self.group.is_empty() {
            write!(f, ".{}", self.group)?;
        }
        match &self.namespace {
            Some(ns) => write!(f, " (in namespace {ns})"),
            None => f.write_str(" (cluster-wide)"),
        }
    }
}

fn of<K: k8s_openapi::Resource>(verb: &'static str, namespace: Option<&str>) -> Access {
    Access {
        verb,
        group: K::GROUP,
        resource: K::URL_PATH_SEGMENT,
        namespace: namespace.map(str::to_string),
    }
}

fn list_and_watch<K: k8s_openapi::Resource>(namespace: Option<&str>) -> [Access; 2] {
    [of::<K>("list", namespace), of::<K>("watch", namespace)]
}

/// Every permission meshpilot uses in a cluster: what `sources::kube::watch_cluster` watches
/// (everywhere), TokenReviews (`security::authn`), SubjectAccessReviews (`security::secret_access`),
/// and in the config cluster the Istio kinds
/// (`sources::kube_config`), the `istio` mesh ConfigMap of the system namespace, and its Leases
/// (which control planes run: `sources::revision_tags`).
pub fn needed(config_cluster: bool, system_namespace: &str) -> Vec<Access> {
    let mut needed: Vec<Access> = [
        list_and_watch::<Namespace>(None),
        list_and_watch::<Node>(None),
        list_and_watch::<Pod>(None),
        list_and_watch::<Service>(None),
        list_and_watch::<EndpointSlice>(None),
        list_and_watch::<Secret>(None),
    ]
    .into_iter()
    .flatten()
    .collect();
    needed.push(of::<TokenReview>("create", None));
    needed.push(of::<SubjectAccessReview>("create", None));
    if config_cluster {
        for kind in ConfigKind::ALL {
            for verb in ["list", "watch"] {
                needed.push(Access {
                    verb,
                    group: kind.group(),
                    resource: kind.plural(),
                    namespace: None,
                });
            }
        }
        needed.extend(list_and_watch::<ConfigMap>(Some(system_namespace)));
        needed.extend(list_and_watch::<Lease>(Some(system_namespace)));
    }
    needed
}

/// Asks the cluster about every permission; one failing check per permission refused (or
/// not answered), one passing check when all are allowed. `who` names the identity in messages.
pub async fn review(client: &Client, needed: &[Access], who: &str) -> Vec<Check> {
    let api: Api<SelfSubjectAccessReview> = Api::all(client.clone());
    let answers: Vec<_> = stream::iter(needed.iter().map(|access| ask(&api, access)))
        .buffered(IN_FLIGHT)
        .collect()
        .await;
    let failures: Vec<Check> = needed
        .iter()
        .zip(answers)
        .filter_map(|(access, answer)| match answer {
            Ok(None) => None,
            Ok(Some(reason)) => Some(Check::fail(NAME, format!("{who} cannot {access}{reason}"))),
            Err(e) => Some(Check::fail(
                NAME,
                format!("cannot ask whether {who} may {access}: {}", WithCauses(&e)),
            )),
        })
        .collect();
    if failures.is_empty() {
        vec![Check::ok(
            NAME,
            format!(
                "{who} may do all {} things meshpilot does here",
                needed.len()
            ),
        )]
    } else {
        failures
    }
}

/// None when allowed, else the API server's reason (as `: reason`, possibly empty).
async fn ask(
    api: &Api<SelfSubjectAccessReview>,
    access: &Access,
) -> Result<Option<String>, kube::Error> {
    let review = SelfSubjectAccessReview {
        spec: SelfSubjectAccessReviewSpec {
            resource_attributes: Some(ResourceAttributes {
                verb: Some(access.verb.to_string()),
                group: Some(access.group.to_string()),
                resource: Some(access.resource.to_string()),
                namespace: access.namespace.clone(),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let answered = api.create(&PostParams::default(), &review).await?;
    let status = answered.status.unwrap_or_default();
    if status.allowed {
        return Ok(None);
    }
    let reason = status
        .reason
        .filter(|r| !r.is_empty())
        .map(|r| format!(": {}", clip(&r)))
        .unwrap_or_default();
    Ok(Some(reason))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_clusters_need_the_registry_kinds_and_the_config_cluster_more() {
        let remote = needed(false, "istio-system");
        let names: Vec<String> = remote.iter().map(ToString::to_string).collect();
        assert!(names.contains(&"watch endpointslices.discovery.k8s.io (cluster-wide)".to_string()));
        assert!(names.contains(&"list pods (cluster-wide)".to_string()));
        assert!(
            names.contains(&"create tokenreviews.authentication.k8s.io (cluster-wide)".to_string())
        );
        assert!(!names.iter().any(|n| n.contains("istio.io")));
        let config: Vec<String> = needed(true, "istio-system")
            .iter()
            .map(ToString::to_string)
            .collect();
        assert!(config
            .contains(&"watch authorizationpolicies.security.istio.io (cluster-wide)".to_string()));
        assert!(config.contains(&"list configmaps (in namespace istio-system)".to_string()));
        assert!(config
            .contains(&"watch leases.coordination.k8s.io (in namespace istio-system)".to_string()));
        assert_eq!(config.len(), remote.len() + 2 * ConfigKind::ALL.len() + 4);
    }
}
