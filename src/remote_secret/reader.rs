//! What the reader service account needs on the remote cluster, created when missing, as istioctl
//! create-remote-secret does: the system namespace, the account, a long-lived token Secret and the
//! read-only RBAC the manifests install (`install::rbac`). Every step is idempotent.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRoleBinding, Subject};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::PostParams;
use kube::{Api, Client, Resource};
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::RemoteSecretError;
use crate::install::rbac;

/// One remote cluster, as the tool reaches it.
pub struct Remote {
    pub client: Client,
    /// The cluster id and its API server, named in every error.
    pub cluster: String,
    pub server: String,
    pub namespace: String,
    pub account: String,
}

impl Remote {
    fn error(
        &self,
        verb: &'static str,
        object: String,
    ) -> impl FnOnce(kube::Error) -> RemoteSecretError {
        let (cluster, server) = (self.cluster.clone(), self.server.clone());
        move |source| RemoteSecretError::Api {
            cluster,
            server,
            verb,
            object,
            source: Box::new(source),
        }
    }

    /// Creates the namespace, account and RBAC where missing; says on stderr what it created.
    pub async fn provision(&self) -> Result<(), RemoteSecretError> {
        let namespace = Namespace {
            metadata: meta(&self.namespace, None),
            ..Default::default()
        };
        self.ensure(Api::all(self.client.clone()), namespace)
            .await?;
        let account = ServiceAccount {
            metadata: meta(&self.account, Some(&self.namespace)),
            ..Default::default()
        };
        self.ensure(
            Api::namespaced(self.client.clone(), &self.namespace),
            account,
        )
        .await?;
        // The objects of the manifests, so the tool and the manifests never drift apart.
        let role = rbac::reader_role();
        let binding = rbac::reader_binding(&self.namespace, &self.account);
        let role_name = role.metadata.name.clone().unwrap_or_default();
        self.ensure(Api::all(self.client.clone()), role).await?;
        self.ensure_binding(binding, &role_name).await
    }

    /// Fails unless the account exists (`--create-service-account=false`).
    pub async fn require_account(&self) -> Result<(), RemoteSecretError> {
        let accounts: Api<ServiceAccount> = Api::namespaced(self.client.clone(), &self.namespace);
        let object = format!("ServiceAccount {}/{}", self.namespace, self.account);
        match accounts.get_opt(&self.account).await {
            Ok(Some(_)) => Ok(()),
            Ok(None) => Err(RemoteSecretError::Missing {
                cluster: self.cluster.clone(),
                object,
            }),
            Err(e) => Err(self.error("get", object)(e)),
        }
    }

    /// Creates `object` unless it exists (a concurrent creator is fine too).
    async fn ensure<K>(&self, api: Api<K>, object: K) -> Result<(), RemoteSecretError>
    where
        K: Resource<DynamicType = ()> + Clone + Debug + Serialize + DeserializeOwned,
    {
        let name = object.meta().name.clone().unwrap_or_default();
        let label = describe::<K>(object.meta());
        if api
            .get_opt(&name)
            .await
            .map_err(self.error("get", label.clone()))?
            .is_some()
        {
            return Ok(());
        }
        match api.create(&PostParams::default(), &object).await {
            Ok(_) => {
                eprintln!("cluster {}: created {label}", self.cluster);
                Ok(())
            }
            Err(kube::Error::Api(status)) if status.is_already_exists() => Ok(()),
            Err(e) => Err(self.error("create", label)(e)),
        }
    }

    /// The binding exists and names our account among its subjects.
    async fn ensure_binding(
        &self,
        mut binding: ClusterRoleBinding,
        role: &str,
    ) -> Result<(), RemoteSecretError> {
        let subject = Subject {
            kind: "ServiceAccount".into(),
            name: self.account.clone(),
            namespace: Some(self.namespace.clone()),
            ..Default::default()
        };
        binding.role_ref.name = role.to_string();
        binding.subjects = Some(vec![subject.clone()]);
        let name = binding.metadata.name.clone().unwrap_or_default();
        let label = describe::<ClusterRoleBinding>(&binding.metadata);
        let api: Api<ClusterRoleBinding> = Api::all(self.client.clone());
        let Some(mut existing) = api
            .get_opt(&name)
            .await
            .map_err(self.error("get", label.clone()))?
        else {
            return self.ensure(api, binding).await;
        };
        let subjects = existing.subjects.get_or_insert_with(Vec::new);
        if subjects.iter().any(|s| {
            s.kind == subject.kind && s.name == subject.name && s.namespace == subject.namespace
        }) {
            return Ok(());
        }
        subjects.push(subject);
        api.replace(&name, &PostParams::default(), &existing)
            .await
            .map_err(self.error("update", label.clone()))?;
        eprintln!(
            "cluster {}: added ServiceAccount {}/{} to {label}",
            self.cluster, self.namespace, self.account
        );
        Ok(())
    }

    /// The token and CA of the account's long-lived token Secret (`<sa>-istio-remote-secret-token`,
    /// as istioctl names it on Kubernetes ≥ 1.24), created when missing.
    pub async fn token(&self) -> Result<(String, String), RemoteSecretError> {
        let secrets: Api<Secret> = Api::namespaced(self.client.clone(), &self.namespace);
        let name = format!("{}-istio-remote-secret-token", self.account);
        let secret = Secret {
            metadata: ObjectMeta {
                annotations: Some(BTreeMap::from([(
                    "kubernetes.io/service-account.name".to_string(),
                    self.account.clone(),
                )])),
                ..meta(&name, Some(&self.namespace))
            },
            type_: Some("kubernetes.io/service-account-token".to_string()),
            ..Default::default()
        };
        self.ensure(secrets.clone(), secret).await?;
        let label = format!("Secret {}/{name}", self.namespace);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let data = secrets
                .get(&name)
                .await
                .map_err(self.error("get", label.clone()))?
                .data
                .unwrap_or_default();
            let field = |k: &str| {
                data.get(k)
                    .map(|v| String::from_utf8_lossy(&v.0).to_string())
            };
            if let (Some(token), Some(ca)) = (field("token"), field("ca.crt")) {
                return Ok((token, ca));
            }
            if tokio::time::Instant::now() > deadline {
                return Err(RemoteSecretError::TokenTimeout {
                    cluster: self.cluster.clone(),
                    object: label,
                });
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

fn meta(name: &str, namespace: Option<&str>) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_string()),
        namespace: namespace.map(str::to_string),
        ..Default::default()
    }
}

/// `Kind namespace/name` or `Kind name`.
fn describe<K: Resource<DynamicType = ()>>(meta: &ObjectMeta) -> String {
    let name = meta.name.as_deref().unwrap_or_default();
    match &meta.namespace {
        Some(ns) => format!("{} {ns}/{name}", K::kind(&())),
        None => format!("{} {name}", K::kind(&())),
    }
}
