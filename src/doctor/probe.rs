//! What one cluster's API server says, every request bounded by the timeout: its version and
//! clock, the identity's permissions, the system namespace's network label, the root ConfigMap,
//! gateway Services and (config cluster) the CA's Secrets.

use std::future::Future;
use std::time::{Duration, Instant, SystemTime};

use http_body_util::{BodyExt, Limited};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Secret, Service};
use kube::api::ListParams;
use kube::{Api, Client};

use super::access::{self, Access};
use super::gateways::GatewayService;
use super::networks::SystemNamespace;
use super::report::Check;
use super::roots::Published;
use crate::kube_error::WithCauses;
use crate::model::LABEL_NETWORK;
use crate::security::ca::{CA_CERT, ROOT_CERT};
use crate::security::keys::{PLUGIN_SECRET, SELF_SIGNED_SECRET};
use crate::security::trust::{ROOT_CONFIGMAP, ROOT_KEY};
use crate::text::clip;

/// Largest `/version` answer read.
const VERSION_LIMIT: usize = 64 * 1024;

/// How the API server answered `GET /version`.
pub struct ServerInfo {
    pub version: String,
    pub took: Duration,
    /// Its `Date` header, and when it arrived by our clock.
    pub date: Option<String>,
    pub received: SystemTime,
}

/// Everything read from a cluster that answered.
pub struct Details {
    pub access: Vec<Check>,
    pub system: Result<SystemNamespace, String>,
    pub root: Published,
    /// Gateway Services (labelled, or named by MeshNetworks).
    pub services: Result<Vec<GatewayService>, String>,
    /// The CA root kept in the system namespace (config cluster only): where from, and the PEM.
    pub ca_root: Option<(String, String)>,
    /// The revisions installed and the namespaces each serves (config cluster only).
    pub revisions: Vec<Check>,
    /// Who manages each Gateway (config cluster only).
    pub gateway_owners: Vec<Check>,
}

/// What to ask a cluster.
pub struct Ask<'a> {
    pub namespace: &'a str,
    pub timeout: Duration,
    pub needed: &'a [Access],
    /// Who the identity is, in messages (`reader`, `control plane`).
    pub who: &'a str,
    pub named_services: &'a [(String, String)],
    pub config_cluster: bool,
}

async fn bounded<T, F>(timeout: Duration, what: &str, call: F) -> Result<T, String>
where
    F: Future<Output = Result<T, kube::Error>>,
{
    match tokio::time::timeout(timeout, call).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(format!("{what}: {}", WithCauses(&e))),
        Err(_) => Err(format!(
            "{what}: no answer within {}",
            humantime::format_duration(timeout)
        )),
    }
}

/// `GET /version`: does the API server answer, and accept these credentials?
pub async fn version(client: &Client, timeout: Duration) -> Result<ServerInfo, String> {
    let started = Instant::now();
    let call = async {
        let request = http::Request::get("/version")
            .body(Vec::new())
            .map_err(|e| e.to_string())?;
        let response = client
            .send(request.map(kube::client::Body::from))
            .await
            .map_err(|e| WithCauses(&e).to_string())?;
        let received = SystemTime::now();
        let status = response.status();
        let date = response
            .headers()
            .get(http::header::DATE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let body = Limited::new(response.into_body(), VERSION_LIMIT)
            .collect()
            .await
            .map_err(|e| format!("reading the answer: {e}"))?
            .to_bytes();
        if !status.is_success() {
            return Err(format!(
                "answered {status}: {}",
                clip(&String::from_utf8_lossy(&body))
            ));
        }
        let version = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v["gitVersion"].as_str().map(clip))
            .unwrap_or_else(|| "version unknown".into());
        Ok(ServerInfo {
            version,
            took: started.elapsed(),
            date,
            received,
        })
    };
    match tokio::time::timeout(timeout, call).await {
        Ok(answer) => answer,
        Err(_) => Err(format!(
            "no answer within {}",
            humantime::format_duration(timeout)
        )),
    }
}

/// Everything else, all at once.
pub async fn details(client: &Client, ask: &Ask<'_>) -> Details {
    let t = ask.timeout;
    let access = async {
        match tokio::time::timeout(t, access::review(client, ask.needed, ask.who)).await {
            Ok(checks) => checks,
            Err(_) => vec![Check::fail(
                "access",
                format!(
                    "SelfSubjectAccessReviews not answered within {}",
                    humantime::format_duration(t)
                ),
            )],
        }
    };
    let ca_root = async {
        if ask.config_cluster {
            ca_root(client, ask.namespace, t).await
        } else {
            None
        }
    };
    let (access, system, root, services, ca_root) = tokio::join!(
        access,
        system_namespace(client, ask.namespace, t),
        root(client, ask.namespace, t),
        gateway_services(client, ask.named_services, t),
        ca_root,
    );
    let revisions = match ask.config_cluster {
        true => {
            let mesh_root = ca_root.as_ref().map(|(_, pem)| pem.as_str());
            let check = super::revisions::check(client, mesh_root);
            (tokio::time::timeout(t, check).await).unwrap_or_else(|_| {
                let wait = humantime::format_duration(t);
                vec![Check::warn(
                    "revisions",
                    format!("webhook configurations not listed within {wait}"),
                )]
            })
        }
        false => Vec::new(),
    };
    let gateway_owners = match ask.config_cluster {
        true => {
            let check = super::gateway_owners::check(client, ask.namespace);
            (tokio::time::timeout(t, check).await).unwrap_or_else(|_| {
                let wait = humantime::format_duration(t);
                vec![Check::warn(
                    "gateway owners",
                    format!("Gateways and control planes not listed within {wait}"),
                )]
            })
        }
        false => Vec::new(),
    };
    Details {
        access,
        system,
        root,
        services,
        ca_root,
        revisions,
        gateway_owners,
    }
}

async fn system_namespace(
    client: &Client,
    namespace: &str,
    t: Duration,
) -> Result<SystemNamespace, String> {
    let api: Api<Namespace> = Api::all(client.clone());
    let what = format!("get Namespace {namespace}");
    Ok(match bounded(t, &what, api.get_opt(namespace)).await? {
        None => SystemNamespace::Missing,
        Some(ns) => SystemNamespace::Present {
            network: ns.metadata.labels.and_then(|mut l| l.remove(LABEL_NETWORK)),
        },
    })
}

async fn root(client: &Client, namespace: &str, t: Duration) -> Published {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let what = format!("get ConfigMap {namespace}/{ROOT_CONFIGMAP}");
    let Some(map) = bounded(t, &what, api.get_opt(ROOT_CONFIGMAP)).await? else {
        return Ok(None);
    };
    // A ConfigMap without the key holds no root: reported as such, not as missing.
    Ok(Some(
        map.data
            .and_then(|mut d| d.remove(ROOT_KEY))
            .unwrap_or_default(),
    ))
}

/// Services labelled with a network, and those MeshNetworks names, each once.
async fn gateway_services(
    client: &Client,
    named: &[(String, String)],
    t: Duration,
) -> Result<Vec<GatewayService>, String> {
    let all: Api<Service> = Api::all(client.clone());
    let with_network = ListParams::default().labels(LABEL_NETWORK);
    let labelled = bounded(
        t,
        "list Services labelled topology.istio.io/network",
        all.list(&with_network),
    );
    let lookups = futures::future::join_all(named.iter().map(|(ns, name)| {
        let api: Api<Service> = Api::namespaced(client.clone(), ns);
        async move {
            let what = format!("get Service {ns}/{name}");
            bounded(t, &what, api.get_opt(name)).await
        }
    }));
    let (labelled, named) = tokio::join!(labelled, lookups);
    let mut services: Vec<GatewayService> =
        labelled?.items.iter().map(GatewayService::of).collect();
    for found in named {
        if let Some(svc) = found? {
            let svc = GatewayService::of(&svc);
            if !services
                .iter()
                .any(|s| s.namespace == svc.namespace && s.name == svc.name)
            {
                services.push(svc);
            }
        }
    }
    Ok(services)
}

/// The root meshpilot's CA serves, when its Secret is readable: the plug-in `cacerts`, else the
/// self-signed `istio-ca-secret` (`security::keys` looks in that order).
async fn ca_root(client: &Client, namespace: &str, t: Duration) -> Option<(String, String)> {
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    for name in [PLUGIN_SECRET, SELF_SIGNED_SECRET] {
        let Ok(Some(secret)) = bounded(t, name, api.get_opt(name)).await else {
            continue;
        };
        let data = secret.data.unwrap_or_default();
        let pem = [ROOT_CERT, CA_CERT]
            .iter()
            .filter_map(|key| data.get(*key))
            .map(|v| String::from_utf8_lossy(&v.0).to_string())
            .find(|pem| !pem.trim().is_empty());
        if let Some(pem) = pem {
            return Some((format!("Secret {namespace}/{name}"), pem));
        }
    }
    None
}
