//! Service accounts and RBAC: the control plane's own, the reader account other control planes
//! use to read a cluster (`meshpilot remote-secret` creates the same objects), and what a primary
//! writes in a remote cluster that opted in to it.

use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{
    ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding, RoleRef, Subject,
};

use super::meta;
use crate::istio::Revision;
use crate::security::trust::ROOT_CONFIGMAP;

const CONTROL_PLANE_ACCOUNT: &str = "meshpilot";
pub const READER_ACCOUNT: &str = "istio-reader-service-account";
pub const READER_ROLE: &str = "meshpilot-reader";
const REMOTE_WRITER_ROLE: &str = "meshpilot-remote-writer";
use crate::istio::GROUPS as CONFIG_GROUPS;

fn rule(groups: &[&str], resources: &[&str], verbs: &[&str]) -> PolicyRule {
    let strings = |s: &[&str]| Some(s.iter().map(|x| x.to_string()).collect());
    PolicyRule {
        api_groups: strings(groups),
        resources: strings(resources),
        verbs: verbs.iter().map(|x| x.to_string()).collect(),
        ..Default::default()
    }
}

const READ: &[&str] = &["get", "list", "watch"];

/// The control plane's service account: `meshpilot`, or Istio's `istiod-<revision>` for a named
/// revision, whose RBAC objects are named `meshpilot-<revision>` so removing one revision leaves
/// the other's in place.
pub fn control_plane_account(revision: &Revision) -> String {
    match revision.is_default() {
        true => CONTROL_PLANE_ACCOUNT.into(),
        false => revision.suffixed("istiod"),
    }
}

fn control_plane_role_name(revision: &Revision) -> String {
    revision.suffixed(CONTROL_PLANE_ACCOUNT)
}

pub fn service_account(name: &str, namespace: &str) -> ServiceAccount {
    ServiceAccount {
        metadata: meta(name, Some(namespace)),
        ..Default::default()
    }
}

fn subject(account: &str, namespace: &str) -> Subject {
    Subject {
        kind: "ServiceAccount".into(),
        name: account.into(),
        namespace: Some(namespace.into()),
        ..Default::default()
    }
}

fn cluster_binding(name: &str, role: &str, account: &str, namespace: &str) -> ClusterRoleBinding {
    ClusterRoleBinding {
        metadata: meta(name, None),
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "ClusterRole".into(),
            name: role.into(),
        },
        subjects: Some(vec![subject(account, namespace)]),
    }
}

/// What the control plane does in its own cluster: read services, endpoints, Istio config and
/// gateway credentials (Secrets), review tokens, publish root certificates, keep webhook
/// configurations current.
pub fn control_plane_role(revision: &Revision) -> ClusterRole {
    ClusterRole {
        metadata: meta(&control_plane_role_name(revision), None),
        rules: Some(vec![
            rule(
                &[""],
                &["pods", "services", "nodes", "namespaces", "secrets"],
                READ,
            ),
            rule(&["discovery.k8s.io"], &["endpointslices"], READ),
            rule(
                &[""],
                &["configmaps"],
                &["get", "list", "watch", "create", "update"],
            ),
            rule(&["authentication.k8s.io"], &["tokenreviews"], &["create"]),
            // Whether a gateway may read a credential it asks for (istiod's SDS authorization).
            rule(
                &["authorization.k8s.io"],
                &["subjectaccessreviews"],
                &["create"],
            ),
            rule(&CONFIG_GROUPS, &["*"], READ),
            // The leader records allocated addresses, as istiod 1.25+.
            rule(
                &["networking.istio.io"],
                &["serviceentries/status"],
                &["update", "patch"],
            ),
            // ... and deploys managed Gateways, as istiod's deployment controller.
            rule(&["apps"], &["deployments"], &["get", "create", "update"]),
            rule(
                &[""],
                &["services", "serviceaccounts"],
                &["get", "create", "update"],
            ),
            // ... and the Gateway API's status of the objects it implements.
            rule(
                &[crate::istio::gateway_api::GROUP],
                &[
                    "gatewayclasses/status",
                    "gateways/status",
                    "httproutes/status",
                    "grpcroutes/status",
                    "tcproutes/status",
                    "tlsroutes/status",
                ],
                &["update", "patch"],
            ),
            // Kubernetes Ingresses of Istio's class, served and their status written.
            rule(
                &["networking.k8s.io"],
                &["ingresses", "ingressclasses"],
                READ,
            ),
            rule(
                &["networking.k8s.io"],
                &["ingresses/status"],
                &["update", "patch"],
            ),
            // Dry-run only: proves the validation webhook refuses invalid config.
            rule(&["networking.istio.io"], &["destinationrules"], &["create"]),
            rule(
                &["admissionregistration.k8s.io"],
                &[
                    "mutatingwebhookconfigurations",
                    "validatingwebhookconfigurations",
                ],
                &["get", "list", "watch", "update"],
            ),
        ]),
        ..Default::default()
    }
}

pub fn control_plane_binding(namespace: &str, revision: &Revision) -> ClusterRoleBinding {
    let role = control_plane_role_name(revision);
    cluster_binding(&role, &role, &control_plane_account(revision), namespace)
}

/// In the system namespace only: remote-cluster kubeconfigs and CA keys (Secrets), the leader
/// Leases (all watched: a held `istio-gateway-deployment-<revision>` shows a running istiod).
pub fn control_plane_namespace_role(namespace: &str, revision: &Revision) -> Role {
    Role {
        metadata: meta(&control_plane_role_name(revision), Some(namespace)),
        rules: Some(vec![
            rule(
                &[""],
                &["secrets"],
                &["get", "list", "watch", "create", "update"],
            ),
            rule(
                &["coordination.k8s.io"],
                &["leases"],
                &["get", "list", "watch", "create", "update"],
            ),
        ]),
    }
}

pub fn control_plane_namespace_binding(namespace: &str, revision: &Revision) -> RoleBinding {
    let role = control_plane_role_name(revision);
    RoleBinding {
        metadata: meta(&role, Some(namespace)),
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "Role".into(),
            name: role.clone(),
        },
        subjects: Some(vec![subject(&control_plane_account(revision), namespace)]),
    }
}

/// What a control plane reading this cluster needs (Istio's reader role, for the kinds meshpilot
/// reads): services, endpoints, pods, nodes, gateway credentials, Istio config; TokenReviews for
/// its workloads and SubjectAccessReviews for its gateways' credentials; and the published mesh
/// root, which `doctor` compares.
pub fn reader_role() -> ClusterRole {
    ClusterRole {
        metadata: meta(READER_ROLE, None),
        rules: Some(vec![
            rule(
                &[""],
                &["pods", "services", "nodes", "namespaces", "secrets"],
                READ,
            ),
            rule(&["discovery.k8s.io"], &["endpointslices"], READ),
            // The root every namespace publishes, which `meshpilot doctor` checks.
            PolicyRule {
                resource_names: Some(vec![ROOT_CONFIGMAP.to_string()]),
                ..rule(&[""], &["configmaps"], &["get"])
            },
            rule(&CONFIG_GROUPS, &["*"], READ),
            rule(&["authentication.k8s.io"], &["tokenreviews"], &["create"]),
            // Whether a gateway may read a credential it asks for (istiod's SDS authorization).
            rule(
                &["authorization.k8s.io"],
                &["subjectaccessreviews"],
                &["create"],
            ),
        ]),
        ..Default::default()
    }
}

pub fn reader_binding(namespace: &str, account: &str) -> ClusterRoleBinding {
    cluster_binding(READER_ROLE, READER_ROLE, account, namespace)
}

/// What the primary writes in a remote cluster that opted in to it: root-certificate ConfigMaps
/// and the caBundle of the webhook configurations calling it.
pub fn remote_writer_role() -> ClusterRole {
    ClusterRole {
        metadata: meta(REMOTE_WRITER_ROLE, None),
        rules: Some(vec![
            rule(
                &[""],
                &["configmaps"],
                &["get", "list", "watch", "create", "update"],
            ),
            rule(
                &["admissionregistration.k8s.io"],
                &[
                    "mutatingwebhookconfigurations",
                    "validatingwebhookconfigurations",
                ],
                &["get", "list", "watch", "update"],
            ),
        ]),
        ..Default::default()
    }
}

pub fn remote_writer_binding(namespace: &str) -> ClusterRoleBinding {
    cluster_binding(
        REMOTE_WRITER_ROLE,
        REMOTE_WRITER_ROLE,
        READER_ACCOUNT,
        namespace,
    )
}
