//! MCP config sources: `xds://<host:port>` entries of the mesh config's `configSources`, read as
//! istiod's MCP client does (pilot/pkg/bootstrap/configcontroller.go, pkg/adsc/adsc.go): SotW
//! subscriptions per Istio kind (type URL `<group>/<version>/<Kind>`) over ADS, node metadata
//! `GENERATOR=api`; each response is the kind's whole set at that version, so what it no longer
//! holds goes.
//!
//! Which versions a server answers depends on its age: istiod before 1.22 and Nacos serve
//! `v1alpha3` only (and answer `v1` empty), later istiod every version. So every version of a kind
//! is subscribed to, and the kind's set is their union by name, the newest version's copy first.
//!
//! Every object is validated as a file's or an API server's is: a refused one is named (on
//! `/debug/configz`) and its last good version, if any, stays. A lost connection keeps every
//! object and retries with jittered backoff (500 ms to 60 s); the next responses resync.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use envoy_types::pb::google::protobuf::{value::Kind as ValueKind, Struct, Value};
use parking_lot::Mutex;
use prost::Message;
use serde::Serialize;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tracing::{info, warn};

use crate::aggregate::Aggregate;
use crate::istio::destination_rule::ClientTls;
use crate::istio::mcp::{self, Resource};
use crate::istio::mesh::{self, ConfigSourceSpec};
use crate::istio::{ConfigKey, ConfigKind, ConfigObject, Origin};
use crate::model::{ConfigChange, ConfigSource, Refusal};
use crate::text::clip;

/// How long a connection may take to open.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest response read (a registry's whole set of ServiceEntries comes in one).
const MAX_RESPONSE_BYTES: usize = 256 << 20;
const BACKOFF_MIN: Duration = Duration::from_millis(500);
const BACKOFF_MAX: Duration = Duration::from_secs(60);

/// One source's state, for `/debug/configz`, `/metrics` and readiness.
#[derive(Clone, Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SourceStatus {
    pub address: String,
    pub connected: bool,
    /// Every kind it serves has answered once.
    pub synced: bool,
    pub objects: usize,
    pub last_error: Option<String>,
}

/// The MCP sources' states, in `configSources` order.
pub type SourceStatuses = Arc<Mutex<Vec<SourceStatus>>>;

/// The objects every MCP source holds, merged into the one MCP layer of the config store: where
/// two sources hold one object, the earlier source in `configSources` wins.
#[derive(Default)]
struct Layer {
    /// Per source (by position): its objects.
    held: BTreeMap<usize, BTreeMap<ConfigKey, Arc<ConfigObject>>>,
}

impl Layer {
    /// Replaces what `source` holds of `kind` with `objects` (a kind's whole set); the changes to
    /// the merged layer.
    fn replace(
        &mut self,
        source: usize,
        kind: ConfigKind,
        objects: BTreeMap<ConfigKey, Arc<ConfigObject>>,
    ) -> Vec<ConfigChange> {
        let held = self.held.entry(source).or_default();
        let gone: Vec<ConfigKey> = held
            .keys()
            .filter(|k| k.kind == kind && !objects.contains_key(k))
            .cloned()
            .collect();
        let touched: BTreeSet<ConfigKey> = gone.iter().chain(objects.keys()).cloned().collect();
        for key in &gone {
            held.remove(key);
        }
        held.extend(objects);
        touched
            .into_iter()
            .map(|key| match self.winner(&key) {
                Some(object) => ConfigChange::Upsert(object),
                None => ConfigChange::Delete(key),
            })
            .collect()
    }

    fn winner(&self, key: &ConfigKey) -> Option<Arc<ConfigObject>> {
        self.held.values().find_map(|held| held.get(key).cloned())
    }
}

/// A client per source, each a task that runs until the process ends (the caller supervises
/// them), and where their states are kept.
pub fn clients(
    sources: &[ConfigSourceSpec],
    aggregate: Arc<Aggregate>,
    node: NodeIdentity,
) -> (
    SourceStatuses,
    Vec<impl std::future::Future<Output = ()> + Send + 'static>,
) {
    let statuses: SourceStatuses = Arc::new(Mutex::new(
        sources
            .iter()
            .map(|s| SourceStatus {
                address: s.address.clone(),
                ..Default::default()
            })
            .collect(),
    ));
    let layer = Arc::new(Mutex::new(Layer::default()));
    let tasks = sources
        .iter()
        .enumerate()
        .map(|(position, spec)| {
            let client = Client {
                position,
                spec: spec.clone(),
                aggregate: aggregate.clone(),
                layer: layer.clone(),
                statuses: statuses.clone(),
                node: node.clone(),
                answers: Mutex::default(),
            };
            client.run()
        })
        .collect();
    (statuses, tasks)
}

/// Who the client says it is: meshpilot's pod and namespace.
#[derive(Clone, Debug)]
pub struct NodeIdentity {
    pub pod: String,
    pub namespace: String,
    pub ip: String,
}

struct Client {
    position: usize,
    spec: ConfigSourceSpec,
    aggregate: Arc<Aggregate>,
    layer: Arc<Mutex<Layer>>,
    statuses: SourceStatuses,
    node: NodeIdentity,
    /// The last set each (kind, version index) was answered with.
    answers: Mutex<BTreeMap<(ConfigKind, usize), Answer>>,
}

/// What one version of a kind was answered with.
#[derive(Default)]
struct Answer {
    objects: BTreeMap<ConfigKey, Arc<ConfigObject>>,
}

impl Client {
    async fn run(self) {
        let mut delay = BACKOFF_MIN;
        loop {
            match self.session().await {
                // The stream ended after answering: start over soon.
                Ok(()) => delay = BACKOFF_MIN,
                Err(error) => {
                    warn!(source = %self.spec.address, %error, "config source unavailable; retrying");
                    self.status(|s| {
                        s.connected = false;
                        s.last_error = Some(clip(&error));
                    });
                }
            }
            let jittered = delay.mul_f64(0.5 + fastrand::f64());
            tokio::time::sleep(jittered).await;
            delay = (delay * 2).min(BACKOFF_MAX);
        }
    }

    fn status(&self, edit: impl FnOnce(&mut SourceStatus)) {
        if let Some(status) = self.statuses.lock().get_mut(self.position) {
            edit(status);
        }
    }

    /// One connection: subscribe to every kind, apply responses until the stream ends.
    async fn session(&self) -> Result<(), String> {
        let channel = connect(&self.spec).await?;
        // The subscriptions go first: a server may answer the call only once it has a request.
        let (requests, outgoing) = mpsc::unbounded_channel();
        let kinds = self.spec.kinds();
        let subscriptions = kinds
            .iter()
            .flat_map(|kind| kind.versions().iter().map(|v| mcp::type_url(*kind, v)));
        for (i, type_url) in subscriptions.enumerate() {
            let _ = requests.send(DiscoveryRequest {
                node: (i == 0).then(|| self.node()),
                type_url,
                ..Default::default()
            });
        }
        let mut client = AggregatedDiscoveryServiceClient::new(channel)
            .max_decoding_message_size(MAX_RESPONSE_BYTES);
        let call = client.stream_aggregated_resources(UnboundedReceiverStream::new(outgoing));
        let mut responses = tokio::time::timeout(CONNECT_TIMEOUT, call)
            .await
            .map_err(|_| format!("no answer within {CONNECT_TIMEOUT:?}"))?
            .map_err(|e| format!("{}: {}", e.code(), e.message()))?
            .into_inner();
        self.status(|s| s.connected = true);
        info!(source = %self.spec.address, "config source connected");
        let mut answered = BTreeSet::new();
        loop {
            let response = match responses.message().await {
                Ok(Some(response)) => response,
                Ok(None) => return Ok(()),
                Err(status) => return Err(format!("{}: {}", status.code(), status.message())),
            };
            let Some((kind, version)) = mcp::parse_type_url(&response.type_url) else {
                continue;
            };
            let found = self.apply(kind, version, &response);
            answered.insert((kind, version, found));
            let synced = kinds.iter().all(|k| kind_synced(*k, &answered));
            self.status(|s| {
                s.synced |= synced;
                s.last_error = None;
            });
            let _ = requests.send(DiscoveryRequest {
                type_url: response.type_url.clone(),
                version_info: response.version_info.clone(),
                response_nonce: response.nonce.clone(),
                ..Default::default()
            });
        }
    }

    /// A kind's whole set at one version: accepted objects replace what that version held, and
    /// the kind's set becomes the union of its versions'; a refused object keeps its last good
    /// version. Whether the response held any object.
    fn apply(&self, kind: ConfigKind, version: usize, response: &DiscoveryResponse) -> bool {
        let source = &self.spec.address;
        let mut objects = BTreeMap::new();
        let mut refusals = Vec::new();
        for any in &response.resources {
            let resource = match Resource::decode(any.value.as_slice()) {
                Ok(r) => r,
                Err(e) => {
                    refusals.push(refusal(
                        source,
                        kind,
                        None,
                        format!("not an MCP resource: {e}"),
                    ));
                    continue;
                }
            };
            let resource_version = resource
                .metadata
                .as_ref()
                .map(|m| m.version.clone())
                .unwrap_or_default();
            let origin = Origin::Mcp {
                source: source.clone(),
                resource_version,
            };
            match mcp::read(kind, &resource, origin) {
                Ok(object) => {
                    objects.insert(object.key.clone(), Arc::new(object));
                }
                Err(error) => {
                    let key = key_of(kind, &resource);
                    if let Some(key) = &key {
                        let answers = self.answers.lock();
                        let kept = answers
                            .get(&(kind, version))
                            .and_then(|a| a.objects.get(key).cloned());
                        if let Some(kept) = kept {
                            objects.insert(key.clone(), kept);
                        }
                    }
                    refusals.push(refusal(source, kind, key, error));
                }
            }
        }
        let found = !response.resources.is_empty();
        let union = {
            let mut answers = self.answers.lock();
            answers.insert((kind, version), Answer { objects });
            union_of(&answers, kind)
        };
        let changes = self.layer.lock().replace(self.position, kind, union);
        let held = self
            .layer
            .lock()
            .held
            .get(&self.position)
            .map_or(0, |h| h.len());
        self.status(|s| s.objects = held);
        let unit = format!("{source} {}", response.type_url);
        self.aggregate
            .apply_config(ConfigSource::Mcp, changes, vec![(unit, refusals)]);
        found
    }

    fn node(&self) -> Node {
        let id = format!(
            "sidecar~{}~{}.{}~{}.svc.cluster.local",
            self.node.ip, self.node.pod, self.node.namespace, self.node.namespace
        );
        let string = |s: &str| Value {
            kind: Some(ValueKind::StringValue(s.to_string())),
        };
        let fields = [
            ("GENERATOR", "api"),
            ("NAMESPACE", self.node.namespace.as_str()),
            ("ISTIO_VERSION", env!("CARGO_PKG_VERSION")),
        ];
        Node {
            id,
            metadata: Some(Struct {
                fields: fields
                    .iter()
                    .map(|(k, v)| (k.to_string(), string(v)))
                    .collect(),
            }),
            ..Default::default()
        }
    }
}

/// A kind's set: every version's answer, an object named at several taken from the newest.
fn union_of(
    answers: &BTreeMap<(ConfigKind, usize), Answer>,
    kind: ConfigKind,
) -> BTreeMap<ConfigKey, Arc<ConfigObject>> {
    let mut union = BTreeMap::new();
    // Version indexes run newest first: the first copy of a name stays.
    for answer in answers
        .range((kind, 0)..=(kind, usize::MAX))
        .map(|(_, a)| a)
    {
        for (key, object) in &answer.objects {
            union.entry(key.clone()).or_insert_with(|| object.clone());
        }
    }
    union
}

/// Whether a kind's set is known: every version answered, or one answered with objects (a server
/// that serves the kind at one version only may leave the others unanswered).
fn kind_synced(kind: ConfigKind, answered: &BTreeSet<(ConfigKind, usize, bool)>) -> bool {
    let versions = kind.versions().len();
    let mut of_kind = answered.iter().filter(|(k, _, _)| *k == kind);
    let seen: BTreeSet<usize> = of_kind.clone().map(|(_, v, _)| *v).collect();
    seen.len() == versions || of_kind.any(|(_, _, found)| *found)
}

fn refusal(source: &str, kind: ConfigKind, key: Option<ConfigKey>, error: String) -> Refusal {
    Refusal {
        key,
        kind: Some(kind),
        subject: None,
        origin: Origin::Mcp {
            source: source.to_string(),
            resource_version: String::new(),
        },
        error: clip(&error),
    }
}

/// The key a resource names, when its name is `<namespace>/<name>`.
fn key_of(kind: ConfigKind, resource: &Resource) -> Option<ConfigKey> {
    let name = &resource.metadata.as_ref()?.name;
    let (namespace, name) = name.split_once('/')?;
    Some(ConfigKey {
        kind,
        namespace: namespace.into(),
        name: name.into(),
    })
}

/// A channel to the source, plaintext or TLS as its `tlsSettings` say, within the connect timeout.
async fn connect(spec: &ConfigSourceSpec) -> Result<tonic::transport::Channel, String> {
    use tonic::transport::Endpoint;
    let address = spec.host_port();
    let tls = spec.tls_settings.as_ref().filter(|t| mesh::encrypts(t));
    let scheme = match tls {
        Some(_) => "https",
        None => "http",
    };
    let mut endpoint = Endpoint::from_shared(format!("{scheme}://{address}"))
        .map_err(|e| format!("{address}: {e}"))?
        .connect_timeout(CONNECT_TIMEOUT)
        .http2_keep_alive_interval(Duration::from_secs(30))
        .keep_alive_timeout(Duration::from_secs(10));
    if let Some(tls) = tls {
        endpoint = endpoint
            .tls_config(client_tls(tls, &address)?)
            .map_err(|e| format!("{address}: {e}"))?;
    }
    tokio::time::timeout(CONNECT_TIMEOUT, endpoint.connect())
        .await
        .map_err(|_| format!("{address}: no connection within {CONNECT_TIMEOUT:?}"))?
        .map_err(|e| format!("{address}: {}", error_chain(&e)))
}

fn client_tls(tls: &ClientTls, address: &str) -> Result<tonic::transport::ClientTlsConfig, String> {
    use tonic::transport::{Certificate, ClientTlsConfig, Identity};
    let read = |path: &str| {
        std::fs::read_to_string(path).map_err(|e| format!("tlsSettings: cannot read {path}: {e}"))
    };
    let host = address.rsplit_once(':').map_or(address, |(h, _)| h);
    // The name the server's certificate is checked against: `sni`, else the first of
    // `subjectAltNames`, else the address's host.
    let name = std::iter::once(&tls.sni)
        .chain(&tls.subject_alt_names)
        .find(|n| !n.is_empty())
        .map_or(host, String::as_str);
    let mut config = ClientTlsConfig::new().domain_name(name);
    config = config.ca_certificate(Certificate::from_pem(read(&tls.ca_certificates)?));
    if !tls.client_certificate.is_empty() {
        let identity = Identity::from_pem(read(&tls.client_certificate)?, read(&tls.private_key)?);
        config = config.identity(identity);
    }
    Ok(config)
}

/// An error with its causes (a transport error's message alone says little).
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    clip(&text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object(name: &str, host: &str) -> (ConfigKey, Arc<ConfigObject>) {
        let value = serde_json::json!({
            "apiVersion": "networking.istio.io/v1", "kind": "ServiceEntry",
            "metadata": {"name": name, "namespace": "ns"},
            "spec": {"hosts": [host], "ports": [{"number": 80, "name": "http", "protocol": "HTTP"}]},
        });
        let origin = Origin::Mcp {
            source: "xds://a:1".into(),
            resource_version: String::new(),
        };
        let object = ConfigObject::from_value(&value, origin).unwrap().unwrap();
        (object.key.clone(), Arc::new(object))
    }

    #[test]
    fn the_earlier_source_wins_and_a_kinds_set_replaces_the_last() {
        let mut layer = Layer::default();
        let (a, first) = object("a", "a.example.com");
        let (_, second) = object("a", "other.example.com");
        let (b, only) = object("b", "b.example.com");
        let changes = layer.replace(
            1,
            ConfigKind::ServiceEntry,
            BTreeMap::from([(a.clone(), second.clone())]),
        );
        assert!(matches!(&changes[..], [ConfigChange::Upsert(o)] if Arc::ptr_eq(o, &second)));
        let changes = layer.replace(
            0,
            ConfigKind::ServiceEntry,
            BTreeMap::from([(a.clone(), first.clone()), (b.clone(), only)]),
        );
        assert_eq!(changes.len(), 2);
        assert!(matches!(&changes[0], ConfigChange::Upsert(o) if Arc::ptr_eq(o, &first)));
        // Source 0 drops `a`: source 1's version takes over; then source 1 drops it too.
        let changes = layer.replace(0, ConfigKind::ServiceEntry, BTreeMap::new());
        assert!(changes
            .iter()
            .any(|c| matches!(c, ConfigChange::Upsert(o) if Arc::ptr_eq(o, &second))));
        assert!(changes
            .iter()
            .any(|c| matches!(c, ConfigChange::Delete(k) if *k == b)));
        let changes = layer.replace(1, ConfigKind::ServiceEntry, BTreeMap::new());
        assert!(matches!(&changes[..], [ConfigChange::Delete(k)] if *k == a));
    }
}
