//! Who manages each Gateway of Istio's classes on the config cluster, by the rule meshpilot's
//! leader follows (`sources::gateway_owners`): the one running istiod that claims it, else the
//! meshpilot revision that claims it. Each line says why, and which revision rendered the
//! Gateway's Deployment (its pod template's `istio.io/rev`, as istiod's kube-gateway.yaml and
//! meshpilot write it).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, SystemTime};

use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Pod, Service};
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, ListParams};
use kube::{Api, Client, ResourceExt};

use super::report::Check;
use crate::istio::gateway_api::{
    BUILT_IN_CLASS, CONTROLLER, GATEWAY_NAME_LABEL, GROUP, MANAGED_LABEL,
};
use crate::istio::revision::{REVISION_LABEL, TAG_LABEL};
use crate::leader::{GATEWAY_DEPLOYMENT, LEASE_NAME};
use crate::sources::gateway_owners::{Inputs, Owner, Selected};
use crate::sources::revision_tags::{DEFAULT_TAG_WEBHOOK, DEFAULT_VALIDATOR, ISTIOD_PODS};

const NAME: &str = "gateway owners";

/// One Gateway as read: where it is, its labels, and who rendered its Deployment.
#[derive(Clone, Debug, Default)]
pub struct Gateway {
    pub namespace: String,
    pub name: String,
    pub labels: BTreeMap<String, String>,
    /// The Deployment's name and the revision its pod template names (None: unnamed).
    pub deployment: Option<(String, Option<String>)>,
}

/// Reads what decides ownership and the Gateways; one line per Gateway, or why none.
pub async fn check(client: &Client, namespace: &str) -> Vec<Check> {
    match read(client, namespace).await {
        Ok((inputs, gateways)) => gateways.iter().map(|g| verdict(&inputs, g)).collect(),
        Err(e) => vec![Check::warn(NAME, format!("{e}; owners not checked"))],
    }
}

async fn read(client: &Client, ns: &str) -> Result<(Inputs, Vec<Gateway>), String> {
    let failed = |what: &str| {
        let what = what.to_string();
        move |e: kube::Error| format!("list {what}: {}", crate::kube_error::Readable(&e))
    };
    let all = ListParams::default();
    let (by_revision, by_tag, istiod_pods, managed) = (
        ListParams::default().labels(REVISION_LABEL),
        ListParams::default().labels(TAG_LABEL),
        ListParams::default().labels(ISTIOD_PODS),
        ListParams::default().labels(MANAGED_LABEL),
    );
    let resource = |kind: &str| ApiResource::from_gvk(&GroupVersionKind::gvk(GROUP, "v1", kind));
    let gateways: Api<DynamicObject> = Api::all_with(client.clone(), &resource("Gateway"));
    let classes: Api<DynamicObject> = Api::all_with(client.clone(), &resource("GatewayClass"));
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let webhooks: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let validators: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    let services: Api<Service> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    let deployments: Api<Deployment> = Api::all(client.clone());
    let (gateways, classes, namespaces, webhooks, validator) = tokio::join!(
        gateways.list(&all),
        classes.list(&all),
        namespaces.list(&by_revision),
        webhooks.list(&by_tag),
        validators.get_opt(DEFAULT_VALIDATOR),
    );
    let (services, pods, leases, deployments) = tokio::join!(
        services.list(&by_tag),
        pods.list(&istiod_pods),
        leases.list(&all),
        deployments.list(&managed),
    );
    let gateways = match gateways {
        Ok(list) => list.items,
        // The Gateway API is not installed: nothing to own.
        Err(kube::Error::Api(e)) if e.code == 404 => return Ok((Inputs::default(), Vec::new())),
        Err(e) => return Err(failed("Gateways")(e)),
    };
    // Istio's classes: the built-in one and those naming its controller.
    let mut istio_classes = BTreeSet::from([BUILT_IN_CLASS.to_string()]);
    for class in classes.map_err(failed("GatewayClasses"))?.items {
        let controller = class.data["spec"]["controllerName"].as_str().unwrap_or("");
        if controller == CONTROLLER || controller.starts_with("istio.io/") {
            istio_classes.insert(class.name_any());
        }
    }
    let revision_of =
        |labels: &BTreeMap<String, String>| labels.get(REVISION_LABEL).cloned().unwrap_or_default();
    let tag = |labels: &BTreeMap<String, String>| {
        let revision = labels.get(REVISION_LABEL).filter(|r| !r.is_empty())?;
        Some((labels.get(TAG_LABEL)?.clone(), revision.clone()))
    };
    let webhooks = webhooks
        .map_err(failed("MutatingWebhookConfigurations"))?
        .items;
    let services = services.map_err(failed("Services"))?.items;
    let mut inputs = Inputs {
        tags: (webhooks.iter().filter_map(|w| tag(w.labels())))
            .chain(services.iter().filter_map(|s| tag(s.labels())))
            .collect(),
        default_tag: (webhooks.iter())
            .find(|w| w.name_any() == DEFAULT_TAG_WEBHOOK)
            .map(|w| revision_of(w.labels())),
        default_validator: (validator.map_err(failed("ValidatingWebhookConfigurations"))?)
            .map(|v| revision_of(v.labels())),
        namespaces: (namespaces.map_err(failed("Namespaces"))?.items.iter())
            .map(|n| (n.name_any(), revision_of(n.labels())))
            .collect(),
        ..Default::default()
    };
    let pods = pods.map_err(failed("Pods"))?.items;
    let leases = leases.map_err(failed("Leases"))?.items;
    running(&mut inputs, &pods, &leases, SystemTime::now());
    // Without permission to list Deployments, lines just do not say who rendered them.
    let deployments = deployments.map(|l| l.items).unwrap_or_default();
    let gateways = (gateways.iter())
        .filter(|g| {
            let class = g.data["spec"]["gatewayClassName"].as_str().unwrap_or("");
            istio_classes.contains(class)
        })
        .map(|g| {
            let namespace = g.namespace().unwrap_or_default();
            let name = g.name_any();
            let deployment = (deployments.iter())
                .find(|d| {
                    d.namespace().as_deref() == Some(namespace.as_str())
                        && d.labels().get(GATEWAY_NAME_LABEL) == Some(&name)
                })
                .map(|d| (d.name_any(), rendered_by(d)));
            Gateway {
                labels: g.labels().clone(),
                namespace,
                name,
                deployment,
            }
        })
        .collect();
    Ok((inputs, gateways))
}

/// Which control planes run: meshpilot revisions holding their leader Lease; istiod revisions
/// with a pod, or holding `istio-gateway-deployment-<revision>`. doctor looks once, so a Lease is
/// held while its renewal is younger than its duration (by this machine's clock: see the clock
/// check).
fn running(inputs: &mut Inputs, pods: &[Pod], leases: &[Lease], now: SystemTime) {
    let mut istiods: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for pod in pods {
        let phase = (pod.status.as_ref()).and_then(|s| s.phase.as_deref());
        if !matches!(phase, Some("Succeeded" | "Failed")) {
            let revision = pod.labels().get(REVISION_LABEL).cloned();
            let revision = revision.unwrap_or_else(|| crate::istio::revision::DEFAULT.into());
            (istiods.entry(revision).or_default()).push(format!("pod {}", pod.name_any()));
        }
    }
    for lease in leases {
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.unwrap_or_default();
        let duration = Duration::from_secs(
            (spec.lease_duration_seconds)
                .and_then(|s| u64::try_from(s).ok())
                .unwrap_or(30),
        );
        let renewed = spec.renew_time.map(|t| SystemTime::from(t.0));
        let live = !holder.is_empty() && renewed.is_some_and(|at| at + duration > now);
        if !live {
            continue;
        }
        let name = lease.name_any();
        if name == LEASE_NAME {
            inputs
                .meshpilots
                .insert(crate::istio::revision::DEFAULT.into());
        } else if let Some(revision) = name.strip_prefix(&format!("{LEASE_NAME}-")) {
            inputs.meshpilots.insert(revision.into());
        } else if let Some(revision) = name.strip_prefix(&format!("{GATEWAY_DEPLOYMENT}-")) {
            let why = format!("Lease {name} held by {holder}");
            istiods.entry(revision.into()).or_default().push(why);
        }
    }
    inputs.istiods = (istiods.into_iter())
        .filter(|(rev, _)| !inputs.meshpilots.contains(rev))
        .map(|(rev, why)| (rev, why.join(", ")))
        .collect();
}

fn rendered_by(deployment: &Deployment) -> Option<String> {
    let template = deployment.spec.template.metadata.as_ref()?;
    template.annotations.as_ref()?.get(REVISION_LABEL).cloned()
}

/// One Gateway's line (pure, so it is tested without a cluster).
pub fn verdict(inputs: &Inputs, gateway: &Gateway) -> Check {
    let at = format!("{}/{}", gateway.namespace, gateway.name);
    let selected = inputs.selected(&gateway.labels, &gateway.namespace);
    let why = match selected {
        Selected::Object("") => "labelled istio.io/rev with no value".to_string(),
        Selected::Object(rev) => format!("labelled istio.io/rev={rev}"),
        Selected::Namespace(ns, "") => format!("no istio.io/rev on it or its namespace {ns}"),
        Selected::Namespace(ns, rev) => format!("namespace {ns} is labelled istio.io/rev={rev}"),
        Selected::Everyone => "cluster-scoped".to_string(),
    };
    let owner = inputs.owner(&gateway.labels, &gateway.namespace);
    let managed_by = match &owner {
        Owner::Istiod(rev) => {
            let waiting: Vec<&str> = (inputs.meshpilots.iter())
                .filter(|m| inputs.meshpilot_claims(m, selected))
                .map(String::as_str)
                .collect();
            let waits = match waiting.as_slice() {
                [] => String::new(),
                names => format!(
                    "; meshpilot {} takes it once istiod {rev} is gone",
                    names.join(", ")
                ),
            };
            let shown = inputs.istiods.get(rev).map_or("", String::as_str);
            format!("istiod {rev} manages it — {why}, which istiod {rev} claims while it runs ({shown}){waits}")
        }
        Owner::Meshpilot(rev) => format!("meshpilot {rev} manages it — {why}"),
        Owner::Istiods(revs) => {
            let message = format!(
                "claimed by the running istiods {} — {why}: they fight over it (istio/istio issue 54280), and its pods flip between them; label it istio.io/rev=<one of them>",
                revs.join(" and ")
            );
            return Check::fail(NAME, format!("{at}: {message}"));
        }
        Owner::Nobody => {
            let message = format!(
                "no running control plane manages it — {why}: its Deployment and status are not kept"
            );
            return Check::warn(NAME, format!("{at}: {message}"));
        }
    };
    let revision = match &owner {
        Owner::Istiod(rev) | Owner::Meshpilot(rev) => rev.as_str(),
        _ => "",
    };
    match &gateway.deployment {
        Some((name, Some(by))) if by != revision => Check::warn(
            NAME,
            format!("{at}: {managed_by}; but Deployment {name} was rendered by {by}: the handover is pending"),
        ),
        Some((name, by)) => Check::ok(
            NAME,
            format!(
                "{at}: {managed_by}. Deployment {name} rendered by {}",
                by.as_deref().unwrap_or("an unnamed revision")
            ),
        ),
        None => Check::ok(NAME, format!("{at}: {managed_by}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::report::Status;

    fn gateway(namespace: &str, name: &str, rev: Option<&str>, by: Option<&str>) -> Gateway {
        Gateway {
            namespace: namespace.into(),
            name: name.into(),
            labels: (rev.into_iter())
                .map(|r| (REVISION_LABEL.to_string(), r.to_string()))
                .collect(),
            deployment: Some((format!("{name}-istio"), by.map(str::to_string))),
        }
    }

    fn lease(name: &str, holder: &str, renewed: SystemTime) -> Lease {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": 30,
                     "renewTime": humantime::format_rfc3339_micros(renewed).to_string()},
        }))
        .unwrap()
    }

    #[test]
    fn each_gateway_is_given_its_owner_and_why() {
        let now = SystemTime::now();
        let mut inputs = Inputs {
            tags: [("default".to_string(), "canary".to_string())].into(),
            default_tag: Some("canary".into()),
            default_validator: Some("canary".into()),
            namespaces: [("shop".to_string(), "canary".to_string())].into(),
            ..Default::default()
        };
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "istiod-1", "labels": {"app": "istiod", "istio.io/rev": "default"}},
        }))
        .unwrap();
        let leases = [
            lease("meshpilot-leader-canary", "mp-1", now),
            lease("istio-gateway-deployment-canary", "mp-1", now),
            lease(
                "istio-gateway-deployment-1-20",
                "gone",
                now - Duration::from_secs(60),
            ),
        ];
        running(&mut inputs, &[pod], &leases, now);
        assert_eq!(inputs.istiods.keys().collect::<Vec<_>>(), ["default"]);
        let line = |inputs: &Inputs, g: &Gateway| {
            let check = verdict(inputs, g);
            (check.status, check.message)
        };
        let (status, text) = line(&inputs, &gateway("plain", "front", None, Some("default")));
        assert_eq!(status, Status::Ok, "{text}");
        assert!(text.starts_with("plain/front: istiod default manages it — no istio.io/rev on it or its namespace plain, which istiod default claims while it runs (pod istiod-1); meshpilot canary takes it once istiod default is gone. Deployment front-istio rendered by default"), "{text}");
        let (status, text) = line(&inputs, &gateway("shop", "web", None, Some("default")));
        assert_eq!(status, Status::Warn, "{text}");
        assert!(text.contains("shop/web: meshpilot canary manages it — namespace shop is labelled istio.io/rev=canary; but Deployment web-istio was rendered by default"), "{text}");
        let (status, text) = line(&inputs, &gateway("plain", "old", Some("1-20"), None));
        assert_eq!(status, Status::Warn, "{text}");
        assert!(
            text.contains("no running control plane manages it — labelled istio.io/rev=1-20"),
            "{text}"
        );
        inputs
            .istiods
            .insert("canary".into(), "pod istiod-canary-1".into());
        let (status, text) = line(&inputs, &gateway("plain", "front", None, None));
        assert_eq!(status, Status::Fail, "{text}");
        assert!(
            text.contains("claimed by the running istiods canary and default"),
            "{text}"
        );
    }
}
