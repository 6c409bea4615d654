//! Where the CA's keys come from, as istiod decides: a plug-in bundle (directory or the `cacerts`
//! Secret), else a self-signed root kept in `istio-ca-secret` (or, without Kubernetes, a state
//! directory) so that a restart keeps the same root. With leader election only the leader creates
//! `istio-ca-secret`; the other replicas wait for it and load it.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::ByteString;
use kube::api::PostParams;
use kube::{Api, Client};
use thiserror::Error;
use tokio::sync::watch;
use tracing::info;

use super::ca::{CaBundle, CaError};
use super::rotation::RootStore;
use crate::kube_error::Readable;

pub const PLUGIN_SECRET: &str = "cacerts";
pub const SELF_SIGNED_SECRET: &str = "istio-ca-secret";

#[derive(Debug, Error)]
pub enum KeysError {
    #[error("{origin}: {source}")]
    Ca { origin: String, source: CaError },
    #[error("Secret {namespace}/{name}: {verb} failed: {}", Readable(.source))]
    Secret {
        namespace: String,
        name: &'static str,
        verb: &'static str,
        source: kube::Error,
    },
}

/// Where to look for (or keep) the CA's keys.
pub enum KeySource {
    /// `--ca-dir`: a plug-in bundle in Istio's cacerts layout.
    Dir(PathBuf),
    /// The config cluster's system namespace (`cacerts`, else `istio-ca-secret`); `leading` says
    /// whether this replica may create `istio-ca-secret` (None: no election, it may).
    Kubernetes {
        client: Client,
        namespace: String,
        leading: Option<watch::Receiver<bool>>,
    },
    /// No Kubernetes: a self-signed root kept in this directory.
    StateDir(PathBuf),
}

/// A bundle and where it came from (named in errors about it).
pub struct LoadedBundle {
    pub bundle: CaBundle,
    pub origin: String,
    /// Where a self-signed root is kept, for its rotation; None for plug-in bundles.
    pub self_signed: Option<RootStore>,
}

/// Loads the CA's keys; a self-signed root made here lives `root_lifetime`.
pub async fn load(
    source: KeySource,
    organization: &str,
    root_lifetime: Duration,
) -> Result<LoadedBundle, KeysError> {
    match source {
        KeySource::Dir(dir) => {
            let origin = format!("CA directory {}", dir.display());
            info!(dir = %dir.display(), "plug-in CA from directory");
            let bundle = CaBundle::read_dir(&dir).map_err(in_origin(&origin))?;
            Ok(LoadedBundle {
                bundle,
                origin,
                self_signed: None,
            })
        }
        KeySource::StateDir(dir) => {
            let origin = format!("CA state directory {}", dir.display());
            let bundle = match CaBundle::read_dir(&dir) {
                Ok(bundle) => {
                    info!(dir = %dir.display(), "self-signed CA loaded from state directory");
                    bundle
                }
                Err(CaError::Missing { .. }) if !dir.join(super::ca::CA_KEY).exists() => {
                    let bundle = CaBundle::self_signed_root(organization, root_lifetime)
                        .map_err(in_origin(&origin))?;
                    bundle.write_dir(&dir).map_err(in_origin(&origin))?;
                    info!(dir = %dir.display(), "new self-signed root CA, kept in the state directory");
                    bundle
                }
                Err(e) => return Err(in_origin(&origin)(e)),
            };
            Ok(LoadedBundle {
                bundle,
                origin,
                self_signed: Some(RootStore::StateDir(dir)),
            })
        }
        KeySource::Kubernetes {
            client,
            namespace,
            leading,
        } => {
            from_secrets(
                Api::namespaced(client, &namespace),
                &namespace,
                organization,
                root_lifetime,
                leading,
            )
            .await
        }
    }
}

fn in_origin(origin: &str) -> impl Fn(CaError) -> KeysError + '_ {
    move |source| KeysError::Ca {
        origin: origin.to_string(),
        source,
    }
}

/// How often a replica that is not the leader looks for the Secret the leader creates.
const SECRET_POLL: Duration = Duration::from_secs(1);

async fn from_secrets(
    secrets: Api<Secret>,
    namespace: &str,
    organization: &str,
    root_lifetime: Duration,
    mut leading: Option<watch::Receiver<bool>>,
) -> Result<LoadedBundle, KeysError> {
    let secret_error = |name: &'static str, verb: &'static str| {
        move |source| KeysError::Secret {
            namespace: namespace.to_string(),
            name,
            verb,
            source,
        }
    };
    let origin = |name: &str| format!("Secret {namespace}/{name}");
    let self_signed = RootStore::Secret {
        secrets: Box::new(secrets.clone()),
        leading: leading.clone(),
    };
    let loaded = |secret: &Secret, name: &str| -> Result<LoadedBundle, KeysError> {
        let origin = origin(name);
        let bundle = bundle_of(secret).map_err(in_origin(&origin))?;
        Ok(LoadedBundle {
            bundle,
            origin,
            self_signed: (name == SELF_SIGNED_SECRET).then(|| self_signed.clone()),
        })
    };
    let get = |name: &'static str| {
        let secrets = secrets.clone();
        async move {
            secrets
                .get_opt(name)
                .await
                .map_err(secret_error(name, "get"))
        }
    };
    let mut waiting = false;
    loop {
        if let Some(secret) = get(PLUGIN_SECRET).await? {
            info!(namespace, "plug-in CA from Secret cacerts");
            return loaded(&secret, PLUGIN_SECRET);
        }
        if let Some(secret) = get(SELF_SIGNED_SECRET).await? {
            info!(
                namespace,
                "self-signed CA loaded from Secret istio-ca-secret"
            );
            return loaded(&secret, SELF_SIGNED_SECRET);
        }
        let Some(leader) = leading.as_mut().filter(|l| !*l.borrow()) else {
            break;
        };
        if !waiting {
            info!(
                namespace,
                "waiting for the leader to create Secret istio-ca-secret"
            );
            waiting = true;
        }
        // Leadership may come to us meanwhile; then we create it ourselves.
        let _ = tokio::time::timeout(SECRET_POLL, leader.changed()).await;
    }
    let bundle = CaBundle::self_signed_root(organization, root_lifetime)
        .map_err(in_origin(&origin(SELF_SIGNED_SECRET)))?;
    let data: BTreeMap<String, ByteString> = bundle
        .files()
        .iter()
        .map(|(file, text)| (file.to_string(), ByteString(text.as_bytes().to_vec())))
        .collect();
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(SELF_SIGNED_SECRET.to_string()),
            namespace: Some(namespace.to_string()),
            ..Default::default()
        },
        type_: Some("istio.io/ca-root".to_string()),
        data: Some(data),
        ..Default::default()
    };
    match secrets.create(&PostParams::default(), &secret).await {
        Ok(_) => {
            info!(
                namespace,
                "new self-signed root CA, kept in Secret istio-ca-secret"
            );
            Ok(LoadedBundle {
                bundle,
                origin: origin(SELF_SIGNED_SECRET),
                self_signed: Some(self_signed),
            })
        }
        // Another replica created it between our get and create: every replica must sign with
        // the same root, so theirs wins.
        Err(kube::Error::Api(status)) if status.is_already_exists() => {
            info!(
                namespace,
                "another replica created Secret istio-ca-secret first; using its root"
            );
            let secret = get(SELF_SIGNED_SECRET)
                .await?
                .ok_or_else(|| secret_error(SELF_SIGNED_SECRET, "get")(kube::Error::Api(status)))?;
            loaded(&secret, SELF_SIGNED_SECRET)
        }
        Err(e) => Err(secret_error(SELF_SIGNED_SECRET, "create")(e)),
    }
}

pub(crate) fn bundle_of(secret: &Secret) -> Result<CaBundle, CaError> {
    let data = secret.data.clone().unwrap_or_default();
    CaBundle::from_files(|file| {
        data.get(file)
            .map(|v| String::from_utf8_lossy(&v.0).to_string())
    })
}
