//! istiod's side of a migration, stood in: what istiod of one revision does about Gateways, by
//! istiod's own rule, not meshpilot's. Read from istio/istio (1.28):
//! - It runs in a Pod of the system namespace labelled `app=istiod`, `istio.io/rev=<revision>`
//!   (manifests/charts/istio-control/istio-discovery/templates/deployment.yaml), under the
//!   service account `istiod` (a named revision: `istiod-<revision>`).
//! - Its deployment controller runs only while it holds the per-revision Lease
//!   `istio-gateway-deployment-<revision>` (pilot/pkg/bootstrap/configcontroller.go,
//!   pilot/pkg/leaderelection/leaderelection.go), holder = its pod name; on SIGTERM it stops and
//!   releases it (`ReleaseOnCancel`).
//! - It deploys each Gateway of class `istio` its `IsMine` claims (pkg/revisions/tag_watcher.go,
//!   ported below as written there), stamping the pod template `istio.io/rev: <revision>`
//!   (kube-gateway.yaml), over any object carrying `gateway.istio.io/managed` (`canManage`), and
//!   re-reconciles on every change to that Deployment (pilot/pkg/config/kube/gatewaycommon/
//!   deploymentcontroller.go `parentHandler`): whatever another writes is reverted at once. Here a
//!   pass every 100 ms does what its informers' events do.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use kube::api::{ApiResource, DynamicObject, GroupVersionKind, ListParams, PostParams};
use kube::{Api, Client, ResourceExt};
use meshpilot::leader::{Leader, LeaderConfig, LockKind};
use serde_json::{json, Value};
use test_apiserver::{TestApiServer, User};
use tokio::task::JoinHandle;

const NAMESPACE: &str = "istio-system";
const REVISION: &str = "istio.io/rev";
const TAG: &str = "istio.io/tag";
const MANAGED: &str = "gateway.istio.io/managed";
const GATEWAY_NAME: &str = "gateway.networking.k8s.io/gateway-name";
/// How often a pass runs: istiod's informers deliver events within this.
const PASS_EVERY: Duration = Duration::from_millis(100);
/// The most one pass may take.
const PASS_DEADLINE: Duration = Duration::from_secs(5);

/// The user istiod of `revision` writes as.
pub fn istiod_user(revision: &str) -> String {
    format!("system:serviceaccount:{NAMESPACE}:{}", account(revision))
}

fn account(revision: &str) -> String {
    match revision {
        "default" => "istiod".into(),
        named => format!("istiod-{named}"),
    }
}

/// A kube client of the test API server authenticating as `user`.
pub async fn client_as(api: &TestApiServer, token: &str, user: User) -> Client {
    api.add_token(token, user);
    let kubeconfig = kube::config::Kubeconfig::from_yaml(&api.kubeconfig(token)).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    meshpilot::kube_client::build(config).unwrap()
}

/// One istiod process and its Gateway deployment controller.
pub struct IstiodGateways {
    pod: Option<String>,
    election: Leader,
    controller: JoinHandle<()>,
}

impl IstiodGateways {
    /// The Pod istiod's Deployment creates, before its process runs (what the scheduler and the
    /// kubelet do first).
    pub fn schedule(api: &TestApiServer, revision: &str, pod: &str) {
        api.apply(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod, "namespace": NAMESPACE,
                         "labels": {"app": "istiod", "istio.io/rev": revision, "istio": "pilot"}},
            "spec": {"serviceAccountName": account(revision),
                     "containers": [{"name": "discovery", "image": "istio/pilot:1.28.0"}]},
            "status": {"phase": "Running"},
        }));
    }

    /// istiod running in a pod of this cluster (scheduled here if it is not yet): it takes its
    /// Lease, then keeps every Gateway it claims deployed.
    pub async fn start(api: &TestApiServer, revision: &str, pod: &str) -> Self {
        Self::schedule(api, revision, pod);
        let mut istiod = Self::start_remote(api, revision, pod).await;
        istiod.pod = Some(pod.to_string());
        istiod
    }

    /// istiod running elsewhere (an external control plane, istio/istio issue 58350): no pod
    /// here, only its Lease and its writes.
    pub async fn start_remote(api: &TestApiServer, revision: &str, pod: &str) -> Self {
        let user = User::service_account(NAMESPACE, &account(revision));
        let client = client_as(api, &format!("token-{pod}"), user).await;
        let election = Leader::start(
            client.clone(),
            LeaderConfig {
                namespace: NAMESPACE.into(),
                name: format!("istio-gateway-deployment-{revision}"),
                identity: pod.into(),
                lease_duration: Duration::from_secs(30),
                lock: LockKind::Lease,
            },
        );
        let mut leading = election.leading();
        tokio::time::timeout(Duration::from_secs(10), leading.wait_for(|l| *l))
            .await
            .expect("istiod takes its Lease")
            .unwrap();
        let revision = revision.to_string();
        let controller = tokio::spawn(async move {
            loop {
                // A failed pass (a conflict, a slow answer) is retried, as istiod's queue does.
                let _ = tokio::time::timeout(PASS_DEADLINE, reconcile(&client, &revision)).await;
                tokio::time::sleep(PASS_EVERY).await;
            }
        });
        Self {
            pod: None,
            election,
            controller,
        }
    }

    /// SIGTERM: the controller stops, the Lease is released, then the pod object goes.
    pub async fn stop(self, api: &TestApiServer) {
        self.controller.abort();
        let _ = self.controller.await;
        self.election.release().await;
        if let Some(pod) = &self.pod {
            api.delete("Pod", NAMESPACE, pod);
        }
    }
}

/// What `IsMine` reads: the tag watcher's informers.
struct Tags {
    namespaces: BTreeMap<String, BTreeMap<String, String>>,
    webhooks: Vec<(String, BTreeMap<String, String>)>,
    services: Vec<BTreeMap<String, String>>,
    validator: Option<BTreeMap<String, String>>,
}

impl Tags {
    async fn list(client: &Client) -> Result<Self, kube::Error> {
        let tagged = ListParams::default().labels(TAG);
        let namespaces = api(client, "", "v1", "Namespace", None)
            .list(&ListParams::default())
            .await?;
        let webhooks = api(
            client,
            "admissionregistration.k8s.io",
            "v1",
            "MutatingWebhookConfiguration",
            None,
        )
        .list(&tagged)
        .await?;
        let services = api(client, "", "v1", "Service", Some(NAMESPACE))
            .list(&tagged)
            .await?;
        let validator = api(
            client,
            "admissionregistration.k8s.io",
            "v1",
            "ValidatingWebhookConfiguration",
            None,
        )
        .get_opt("istiod-default-validator")
        .await?;
        Ok(Self {
            namespaces: (namespaces.iter())
                .map(|n| (n.name_any(), n.labels().clone()))
                .collect(),
            webhooks: (webhooks.iter())
                .map(|w| (w.name_any(), w.labels().clone()))
                .collect(),
            services: services.iter().map(|s| s.labels().clone()).collect(),
            validator: validator.map(|v| v.labels().clone()),
        })
    }

    /// `GetMyTags`: the revision and the tags of webhooks and Services indexed under it.
    fn my_tags(&self, revision: &str) -> BTreeSet<String> {
        let labelled = (self.webhooks.iter().map(|(_, l)| l)).chain(&self.services);
        let mut tags: BTreeSet<String> = labelled
            .filter(|l| l.get(REVISION).is_some_and(|r| r == revision))
            .filter_map(|l| l.get(TAG).cloned())
            .collect();
        tags.insert(revision.to_string());
        tags
    }

    /// `IsMine`, as tag_watcher.go has it.
    fn is_mine(&self, revision: &str, labels: &BTreeMap<String, String>, namespace: &str) -> bool {
        let selected = match labels.get(REVISION) {
            Some(tag) => tag.clone(),
            None => match self.namespaces.get(namespace) {
                None => return true,
                Some(ns) => ns.get(REVISION).cloned().unwrap_or_default(),
            },
        };
        let my_tags = self.my_tags(revision);
        let other_default_tag_exists = !my_tags.contains("default")
            && (self.webhooks.iter()).any(|(name, _)| name == "istio-revision-tag-default");
        let we_are_default_revision = (self.validator.as_ref())
            .is_some_and(|l| l.get(REVISION).is_some_and(|r| r == revision));
        my_tags.contains(&selected)
            || selected.is_empty()
                && (my_tags.contains("default")
                    || we_are_default_revision && !other_default_tag_exists)
    }
}

fn api(
    client: &Client,
    group: &str,
    version: &str,
    kind: &str,
    namespace: Option<&str>,
) -> Api<DynamicObject> {
    let resource = ApiResource::from_gvk(&GroupVersionKind::gvk(group, version, kind));
    match namespace {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &resource),
        None => Api::all_with(client.clone(), &resource),
    }
}

/// One pass of the deployment controller over every Gateway.
async fn reconcile(client: &Client, revision: &str) -> Result<(), kube::Error> {
    let tags = Tags::list(client).await?;
    let gateways = api(client, "gateway.networking.k8s.io", "v1", "Gateway", None)
        .list(&ListParams::default())
        .await?;
    for gateway in gateways {
        let spec = &gateway.data["spec"];
        let managed = spec["gatewayClassName"] == "istio"
            && spec["addresses"].as_array().is_none_or(Vec::is_empty);
        let namespace = gateway.namespace().unwrap_or_default();
        if managed && tags.is_mine(revision, gateway.labels(), &namespace) {
            apply(client, revision, &gateway).await?;
        }
    }
    Ok(())
}

/// The Gateway's Deployment as istiod renders it: created, or replaced when it differs.
async fn apply(
    client: &Client,
    revision: &str,
    gateway: &DynamicObject,
) -> Result<(), kube::Error> {
    let (namespace, name) = (gateway.namespace().unwrap_or_default(), gateway.name_any());
    let deployments = api(client, "apps", "v1", "Deployment", Some(&namespace));
    let wanted = deployment(revision, gateway);
    let object: DynamicObject = serde_json::from_value(wanted.clone()).unwrap();
    let deployment_name = format!("{name}-istio");
    match deployments.get_opt(&deployment_name).await? {
        None => {
            deployments.create(&PostParams::default(), &object).await?;
        }
        // `canManage`: only what a gateway controller made.
        Some(current) if !current.labels().contains_key(MANAGED) => {}
        Some(current) if current.data["spec"] == wanted["spec"] => {}
        Some(current) => {
            let mut object = object;
            object.metadata.resource_version = current.resource_version();
            deployments
                .replace(&deployment_name, &PostParams::default(), &object)
                .await?;
        }
    }
    Ok(())
}

fn deployment(revision: &str, gateway: &DynamicObject) -> Value {
    let name = gateway.name_any();
    let discovery = match revision {
        "default" => "istiod.istio-system.svc:15012".to_string(),
        named => format!("istiod-{named}.istio-system.svc:15012"),
    };
    json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {
            "name": format!("{name}-istio"),
            "namespace": gateway.namespace(),
            "labels": {GATEWAY_NAME: name, MANAGED: "istio.io-gateway-controller"},
            "ownerReferences": [{"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
                                 "name": name, "uid": gateway.uid()}],
        },
        "spec": {
            "selector": {"matchLabels": {GATEWAY_NAME: name}},
            "template": {
                "metadata": {
                    "annotations": {"istio.io/rev": revision},
                    "labels": {GATEWAY_NAME: name, "sidecar.istio.io/inject": "false"},
                },
                "spec": {"containers": [{
                    "name": "istio-proxy", "image": "docker.io/istio/proxyv2:1.28.0",
                    "args": ["proxy", "router"],
                    "env": [{"name": "PROXY_CONFIG",
                             "value": json!({"discoveryAddress": discovery}).to_string()}],
                }]},
            },
        },
    })
}
