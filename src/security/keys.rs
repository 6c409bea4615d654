//! Where the CA's keys come from, as istiod decides: a plug-in bundle (directory or the `cacerts`
//! Secret), else a self-signed root kept in `istio-ca-secret` (or, without Kubernetes, a state
//! directory) so that a restart keeps the same root.

use std::collections::BTreeMap;
use std::path::PathBuf;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::ByteString;
use kube::api::PostParams;
use kube::{Api, Client};
use thiserror::Error;
use tracing::info;

use super::ca::{CaBundle, CaError};

pub const PLUGIN_SECRET: &str = "cacerts";
pub const SELF_SIGNED_SECRET: &str = "istio-ca-secret";

#[derive(Debug, Error)]
pub enum KeysError {
    #[error(transparent)]
    Ca(#[from] CaError),
    #[error("Secret {namespace}/{name}: {source}")]
    Secret {
        namespace: String,
        name: &'static str,
        source: kube::Error,
    },
}

/// Where to look for (or keep) the CA's keys.
pub enum KeySource {
    /// `--ca-dir`: a plug-in bundle in Istio's cacerts layout.
    Dir(PathBuf),
    /// The config cluster's system namespace (`cacerts`, else `istio-ca-secret`).
    Kubernetes { client: Client, namespace: String },
    /// No Kubernetes: a self-signed root kept in this directory.
    StateDir(PathBuf),
}

pub async fn load(source: KeySource, organization: &str) -> Result<CaBundle, KeysError> {
    match source {
        KeySource::Dir(dir) => {
            info!(dir = %dir.display(), "plug-in CA from directory");
            Ok(CaBundle::read_dir(&dir)?)
        }
        KeySource::StateDir(dir) => match CaBundle::read_dir(&dir) {
            Ok(bundle) => {
                info!(dir = %dir.display(), "self-signed CA loaded from state directory");
                Ok(bundle)
            }
            Err(CaError::Missing { .. }) if !dir.join(super::ca::CA_KEY).exists() => {
                let bundle = CaBundle::self_signed_root(organization)?;
                bundle.write_dir(&dir)?;
                info!(dir = %dir.display(), "new self-signed root CA, kept in the state directory");
                Ok(bundle)
            }
            Err(e) => Err(e.into()),
        },
        KeySource::Kubernetes { client, namespace } => {
            let secrets: Api<Secret> = Api::namespaced(client, &namespace);
            let get = |name: &'static str| {
                let secrets = secrets.clone();
                let namespace = namespace.clone();
                async move {
                    secrets
                        .get_opt(name)
                        .await
                        .map_err(|source| KeysError::Secret {
                            namespace,
                            name,
                            source,
                        })
                }
            };
            if let Some(secret) = get(PLUGIN_SECRET).await? {
                info!(namespace, "plug-in CA from Secret cacerts");
                return Ok(bundle_of(&secret)?);
            }
            if let Some(secret) = get(SELF_SIGNED_SECRET).await? {
                info!(
                    namespace,
                    "self-signed CA loaded from Secret istio-ca-secret"
                );
                return Ok(bundle_of(&secret)?);
            }
            let bundle = CaBundle::self_signed_root(organization)?;
            let data: BTreeMap<String, ByteString> = bundle
                .files()
                .iter()
                .map(|(file, text)| (file.to_string(), ByteString(text.as_bytes().to_vec())))
                .collect();
            let secret = Secret {
                metadata: ObjectMeta {
                    name: Some(SELF_SIGNED_SECRET.to_string()),
                    namespace: Some(namespace.clone()),
                    ..Default::default()
                },
                type_: Some("istio.io/ca-root".to_string()),
                data: Some(data),
                ..Default::default()
            };
            secrets
                .create(&PostParams::default(), &secret)
                .await
                .map_err(|source| KeysError::Secret {
                    namespace: namespace.clone(),
                    name: SELF_SIGNED_SECRET,
                    source,
                })?;
            info!(
                namespace,
                "new self-signed root CA, kept in Secret istio-ca-secret"
            );
            Ok(bundle)
        }
    }
}

fn bundle_of(secret: &Secret) -> Result<CaBundle, CaError> {
    let data = secret.data.clone().unwrap_or_default();
    CaBundle::from_files(|file| {
        data.get(file)
            .map(|v| String::from_utf8_lossy(&v.0).to_string())
    })
}
