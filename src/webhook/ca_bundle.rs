//! Leader work: the webhook configurations that call this control plane trust its root. In the
//! config cluster, every Mutating- and ValidatingWebhookConfiguration labelled with our revision
//! (`istio.io/rev=<revision>`: its own, and tags pointing at it) gets our root as `caBundle`
//! (injector entries: names ending in `sidecar-injector.istio.io`); another revision's are never
//! touched (istio/istio pkg/webhooks/webhookpatch.go). A validating configuration stays
//! `failurePolicy: Ignore` until a dry-run create of an invalid DestinationRule labelled with our
//! revision (so it reaches our validator, not another's) is refused, then becomes `Fail` —
//! istiod's rule, so a webhook that is not reachable yet never blocks config. Remote clusters that opted in to this control plane
//! (`topology.istio.io/controlPlaneClusters`) get their caBundles kept the same way.

use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::ByteString;
use kube::api::{ApiResource, DynamicObject, ListParams, PostParams};
use kube::core::GroupVersionKind;
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use crate::istio::revision::REVISION_LABEL;
use crate::istio::Revision;
use crate::kube_client::retried;
use crate::kube_client::RemoteClients;
use crate::model::ClusterId;

const INJECTOR_SUFFIX: &str = "sidecar-injector.istio.io";
/// Reconciled this often besides on every change, so a failed update is retried.
const RESYNC: Duration = Duration::from_secs(10);

/// Keeps the config cluster's webhook configurations (watched) and opted-in remote clusters'
/// (every [`RESYNC`]) current; stops when the tasks are aborted.
pub fn keep_current(
    client: Client,
    config_cluster: ClusterId,
    remotes: RemoteClients,
    (system_namespace, revision): (String, Revision),
    roots: watch::Receiver<String>,
) -> Vec<JoinHandle<()>> {
    let local_roots = roots.clone();
    let local_namespace = system_namespace.clone();
    let selector = format!("{REVISION_LABEL}={revision}");
    let remote_selector = selector.clone();
    let local = tokio::spawn(async move {
        let mut fail_closed = false;
        let config = watcher::Config::default().labels(&selector);
        let mutating: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
        let validating: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
        let changes = futures::stream::select(
            retried(watcher::watcher(mutating, config.clone()))
                .map(|_| ())
                .boxed(),
            retried(watcher::watcher(validating, config))
                .map(|_| ())
                .boxed(),
        );
        let ticks =
            tokio_stream::wrappers::IntervalStream::new(tokio::time::interval(RESYNC)).map(|_| ());
        let rotations =
            tokio_stream::wrappers::WatchStream::from_changes(local_roots.clone()).map(|_| ());
        let mut wake = futures::stream::select(changes, futures::stream::select(ticks, rotations));
        while wake.next().await.is_some() {
            if !fail_closed {
                fail_closed = rejects_invalid_config(&client, &local_namespace, &revision).await;
            }
            let policy = if fail_closed { "Fail" } else { "Ignore" };
            let root_pem = local_roots.borrow().clone();
            let scope = (selector.as_str(), "config cluster");
            reconcile(&client, &root_pem, Some(policy), scope).await;
        }
    });
    let remote = tokio::spawn(async move {
        loop {
            for (id, client) in remotes.all() {
                if crate::security::trust::opted_in(&client, &system_namespace, &config_cluster)
                    .await
                {
                    let root_pem = roots.borrow().clone();
                    let scope = (remote_selector.as_str(), id.as_str());
                    reconcile(&client, &root_pem, None, scope).await;
                }
            }
            tokio::time::sleep(RESYNC).await;
        }
    });
    vec![local, remote]
}

/// Sets the caBundle (and the validating failure policy, if given) of every labelled
/// configuration that differs.
async fn reconcile(
    client: &Client,
    root_pem: &str,
    policy: Option<&str>,
    (selector, cluster): (&str, &str),
) {
    let bundle = ByteString(root_pem.as_bytes().to_vec());
    let list = ListParams::default().labels(selector);
    let mutating: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    match mutating.list(&list).await {
        Ok(configs) => {
            for mut config in configs {
                let mut dirty = false;
                for hook in config.webhooks.iter_mut().flatten() {
                    if hook.name.ends_with(INJECTOR_SUFFIX)
                        && hook.client_config.ca_bundle.as_ref() != Some(&bundle)
                    {
                        hook.client_config.ca_bundle = Some(bundle.clone());
                        dirty = true;
                    }
                }
                if dirty {
                    update(&mutating, config, cluster).await;
                }
            }
        }
        Err(e) => warn!(cluster, error = %e, "cannot list MutatingWebhookConfigurations"),
    }
    let validating: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    match validating.list(&list).await {
        Ok(configs) => {
            for mut config in configs {
                let mut dirty = false;
                for hook in config.webhooks.iter_mut().flatten() {
                    if hook.client_config.ca_bundle.as_ref() != Some(&bundle) {
                        hook.client_config.ca_bundle = Some(bundle.clone());
                        dirty = true;
                    }
                    if let Some(policy) = policy {
                        if hook.failure_policy.as_deref() != Some(policy) {
                            hook.failure_policy = Some(policy.to_string());
                            dirty = true;
                        }
                    }
                }
                if dirty {
                    update(&validating, config, cluster).await;
                }
            }
        }
        Err(e) => warn!(cluster, error = %e, "cannot list ValidatingWebhookConfigurations"),
    }
}

/// Replaces the configuration at the version read; a conflict is retried on the next change.
async fn update<K>(api: &Api<K>, config: K, cluster: &str)
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + serde::Serialize
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let name = config.name_any();
    match api.replace(&name, &PostParams::default(), &config).await {
        Ok(_) => {
            info!(cluster, config = %name, kind = %K::kind(&()), "webhook configuration updated")
        }
        Err(e) => {
            warn!(cluster, config = %name, error = %e, "cannot update the webhook configuration")
        }
    }
}

/// Whether the validating webhook refuses invalid config: a dry-run create of a DestinationRule
/// without a host must be denied. A cluster without the CRD cannot be checked: taken as ready, as
/// istiod does.
async fn rejects_invalid_config(client: &Client, namespace: &str, revision: &Revision) -> bool {
    let gvk = GroupVersionKind::gvk("networking.istio.io", "v1", "DestinationRule");
    let resource = ApiResource::from_gvk(&gvk);
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), namespace, &resource);
    let mut invalid = DynamicObject::new("meshpilot-validation-check", &resource);
    invalid.metadata.labels = Some([(REVISION_LABEL.to_string(), revision.to_string())].into());
    invalid.data = json!({"spec": {}});
    let params = PostParams {
        dry_run: true,
        ..Default::default()
    };
    match api.create(&params, &invalid).await {
        Err(kube::Error::Api(status)) if status.message.contains("denied the request") => {
            info!("the validation webhook refuses invalid config: failing closed from now on");
            true
        }
        Err(kube::Error::Api(status))
            if status.code == 404
                && status
                    .message
                    .contains("could not find the requested resource") =>
        {
            info!("no DestinationRule CRD to check validation with: failing closed");
            true
        }
        Ok(_) => {
            debug!("an invalid DestinationRule was not refused yet; validation stays fail-open");
            false
        }
        Err(e) => {
            debug!(error = %e, "validation readiness check failed; validation stays fail-open");
            false
        }
    }
}
