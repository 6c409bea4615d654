//! What the ingress watch holds: the config cluster's Ingresses, IngressClasses and Services as
//! last listed (a relist reconciled when it completes), and what was last applied from them.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Service;
use kube::api::DynamicObject;
use kube::runtime::watcher::{self, Event};
use kube::{Resource, ResourceExt};
use tokio::sync::watch;
use tracing::{debug, warn};

use super::api::{
    Address, Ingress, IngressClass, ServiceFacts, CONTROLLER, DEFAULT_CLASS_ANNOTATION,
};
use super::class::Settings;
use super::convert::{convert, Context};
use super::IngressScope;
use crate::aggregate::Aggregate;
use crate::istio::{ConfigKey, ConfigObject, MeshConfig, Origin};
use crate::model::{ConfigChange, ConfigSource, Refusal, Subject};

/// What the status writer reads.
#[derive(Debug, Default, PartialEq)]
pub struct Served {
    /// The served Ingresses, by namespace and name.
    pub ingresses: Vec<ServedIngress>,
    pub addresses: Addresses,
}

#[derive(Debug, PartialEq)]
pub struct ServedIngress {
    pub namespace: String,
    pub name: String,
    pub labels: BTreeMap<String, String>,
    /// `status.loadBalancer.ingress` as last read.
    pub status: Vec<Address>,
}

/// Where the addresses in Ingresses' status come from (istiod's `runningAddresses`).
#[derive(Debug, Default, PartialEq)]
pub enum Addresses {
    /// The ingress Service's (none when it is not found).
    Service(Vec<String>),
    /// The external addresses of the nodes of the running gateway pods of this namespace
    /// labelled `istio: <label>` (no ingress Service is set).
    Pods { namespace: String, label: String },
    /// Nothing is served.
    #[default]
    Nothing,
}

type Key = (String, String);

/// One kind's objects as last listed.
struct Listed<V> {
    kind: &'static str,
    items: BTreeMap<Key, V>,
    relist: Option<BTreeMap<Key, V>>,
    listed: bool,
}

impl<V: PartialEq> Listed<V> {
    fn new(kind: &'static str) -> Self {
        Self {
            kind,
            items: BTreeMap::new(),
            relist: None,
            listed: false,
        }
    }

    /// Applies one watch event (`read`: the object as held, None when it is not to be held);
    /// true when what is held changed, or the first list completed (or failed: an Ingress
    /// watch that cannot list, for want of RBAC say, must not keep meshpilot unready).
    fn on<K: Resource>(
        &mut self,
        event: watcher::Result<Event<K>>,
        read: impl Fn(&K) -> Option<V>,
    ) -> bool {
        let key = |o: &K| (o.namespace().unwrap_or_default(), o.name_any());
        match event {
            Err(e) => {
                warn!(kind = self.kind, error = %e, "Ingress watch error");
                !std::mem::replace(&mut self.listed, true)
            }
            Ok(Event::Init) => {
                self.relist = Some(BTreeMap::new());
                false
            }
            Ok(Event::InitApply(object)) => {
                if let (Some(relist), Some(value)) = (self.relist.as_mut(), read(&object)) {
                    relist.insert(key(&object), value);
                }
                false
            }
            Ok(Event::InitDone) => {
                let items = self.relist.take().unwrap_or_default();
                let changed = items != self.items;
                self.items = items;
                changed | !std::mem::replace(&mut self.listed, true)
            }
            Ok(Event::Apply(object)) => match read(&object) {
                Some(value) => {
                    let key = key(&object);
                    let changed = self.items.get(&key) != Some(&value);
                    self.items.insert(key, value);
                    changed
                }
                None => self.items.remove(&key(&object)).is_some(),
            },
            Ok(Event::Delete(object)) => self.items.remove(&key(&object)).is_some(),
        }
    }

    fn clear(&mut self) {
        self.items.clear();
        self.relist = None;
        self.listed = false;
    }
}

/// What was last applied to the config store.
#[derive(Default)]
struct Applied {
    objects: BTreeMap<ConfigKey, Arc<ConfigObject>>,
    refusals: BTreeMap<String, Vec<Refusal>>,
}

pub(super) struct Held {
    scope: IngressScope,
    aggregate: Arc<Aggregate>,
    settings: Option<Settings>,
    ingresses: Listed<Arc<Ingress>>,
    classes: Listed<IngressClass>,
    services: Listed<ServiceFacts>,
    applied: Applied,
    served: watch::Sender<Arc<Served>>,
}

impl Held {
    pub(super) fn new(
        scope: IngressScope,
        aggregate: Arc<Aggregate>,
        served: watch::Sender<Arc<Served>>,
    ) -> Self {
        Self {
            scope,
            aggregate,
            settings: None,
            ingresses: Listed::new("Ingress"),
            classes: Listed::new("IngressClass"),
            services: Listed::new("Service"),
            applied: Applied::default(),
            served,
        }
    }

    pub(super) fn settings_from(&self, mesh: &MeshConfig) -> Settings {
        Settings::new(mesh, &self.scope.namespace)
    }

    /// Starts over for new watches.
    pub(super) fn restart(&mut self, settings: Settings) {
        self.settings = Some(settings);
        self.ingresses.clear();
        self.classes.clear();
        self.services.clear();
    }

    /// True when they changed.
    pub(super) fn set_settings(&mut self, settings: Settings) -> bool {
        let changed = self.settings.as_ref() != Some(&settings);
        self.settings = Some(settings);
        changed
    }

    pub(super) fn listed(&self) -> bool {
        self.ingresses.listed && self.classes.listed && self.services.listed
    }

    pub(super) fn on_ingress(&mut self, event: watcher::Result<Event<DynamicObject>>) -> bool {
        let discovered = &self.scope.discovered;
        self.ingresses.on(event, |o| {
            let admitted = discovered.admits(&o.namespace().unwrap_or_default());
            admitted.then(|| Arc::new(Ingress::read(o)))
        })
    }

    pub(super) fn on_class(&mut self, event: watcher::Result<Event<DynamicObject>>) -> bool {
        self.classes.on(event, |o| Some(IngressClass::read(o)))
    }

    pub(super) fn on_service(&mut self, event: watcher::Result<Event<Service>>) -> bool {
        let (discovered, namespace) = (&self.scope.discovered, &self.scope.namespace);
        self.services.on(event, |o| {
            let ns = o.namespace().unwrap_or_default();
            discovered
                .admits(&ns)
                .then(|| ServiceFacts::read(o, ns == *namespace))
        })
    }

    /// Serves nothing: what was applied is withdrawn.
    pub(super) fn withdraw(&mut self) {
        self.settings = None;
        self.apply(Vec::new(), BTreeMap::new());
        self.served.send_if_modified(|s| {
            let changed = **s != Served::default();
            *s = Arc::default();
            changed
        });
    }

    /// Converts the served Ingresses and applies what changed.
    pub(super) fn publish(&mut self) {
        let Some(settings) = self.settings.clone() else {
            return;
        };
        let class_of = |ingress: &Ingress| {
            let name = ingress.spec.as_ref().ok()?.ingress_class_name.clone()?;
            self.classes.items.get(&(String::new(), name))
        };
        let served: Vec<&Ingress> = (self.ingresses.items.values())
            .filter(|i| settings.serves(i, class_of(i)))
            .map(|i| &**i)
            .collect();
        let services = &self.services.items;
        let named_port = |namespace: &str, service: &str, port: &str| {
            let facts = services.get(&(namespace.to_string(), service.to_string()))?;
            facts.ports.iter().find(|(n, _)| n == port).map(|(_, p)| *p)
        };
        let cluster = self.scope.cluster.to_string();
        let ctx = Context {
            settings: &settings,
            domain_suffix: &self.scope.domain_suffix,
            cluster: &cluster,
            named_port: &named_port,
        };
        let converted = convert(served.clone(), &ctx);
        let mut refusals = BTreeMap::new();
        for (id, problems) in converted.problems {
            let Some(ingress) = served.iter().find(|i| i.id() == id) else {
                continue;
            };
            let list = (problems.into_iter())
                .map(|(field, why)| ingress_refusal(&cluster, ingress, &field, &why))
                .collect();
            refusals.insert(format!("Ingress {id}"), list);
        }
        for class in self.classes.items.values() {
            let list = class_refusals(&cluster, class);
            if !list.is_empty() {
                refusals.insert(format!("IngressClass {}", class.name), list);
            }
        }
        let addresses = match settings.service.as_str() {
            "" => Addresses::Pods {
                namespace: settings.namespace.clone(),
                label: settings.gateway_label.clone(),
            },
            service => {
                let key = (settings.namespace.clone(), service.to_string());
                Addresses::Service(
                    services
                        .get(&key)
                        .map(|f| f.addresses.clone())
                        .unwrap_or_default(),
                )
            }
        };
        let now = Served {
            ingresses: (served.iter())
                .map(|i| ServedIngress {
                    namespace: i.namespace.clone(),
                    name: i.name.clone(),
                    labels: i.labels.clone(),
                    status: i.status.clone(),
                })
                .collect(),
            addresses,
        };
        self.apply(converted.objects, refusals);
        self.served.send_if_modified(|s| {
            let changed = **s != now;
            if changed {
                *s = Arc::new(now);
            }
            changed
        });
    }

    /// Applies the difference from what was applied last.
    fn apply(&mut self, objects: Vec<Arc<ConfigObject>>, refusals: BTreeMap<String, Vec<Refusal>>) {
        let objects: BTreeMap<ConfigKey, Arc<ConfigObject>> =
            objects.into_iter().map(|o| (o.key.clone(), o)).collect();
        let mut changes: Vec<ConfigChange> = (objects.iter())
            .filter(|(k, o)| self.applied.objects.get(*k) != Some(*o))
            .map(|(_, o)| ConfigChange::Upsert(o.clone()))
            .collect();
        changes.extend(
            (self.applied.objects.keys())
                .filter(|k| !objects.contains_key(*k))
                .map(|k| ConfigChange::Delete(k.clone())),
        );
        let mut refused: Vec<(String, Vec<Refusal>)> = Vec::new();
        for (unit, list) in &refusals {
            if self.applied.refusals.get(unit) != Some(list) {
                for refusal in list {
                    warn!(error = %refusal.error, "Kubernetes Ingress: not served");
                }
                refused.push((unit.clone(), list.clone()));
            }
        }
        refused.extend(
            (self.applied.refusals.keys())
                .filter(|u| !refusals.contains_key(*u))
                .map(|u| (u.clone(), Vec::new())),
        );
        if changes.is_empty() && refused.is_empty() {
            return;
        }
        debug!(
            changes = changes.len(),
            refusals = refused.len(),
            "Kubernetes Ingress config changed"
        );
        self.aggregate
            .apply_config(ConfigSource::Ingress, changes, refused);
        self.applied = Applied { objects, refusals };
    }
}

fn ingress_refusal(cluster: &str, ingress: &Ingress, field: &str, why: &str) -> Refusal {
    Refusal {
        key: None,
        kind: None,
        subject: Some(Subject {
            kind: "Ingress",
            namespace: ingress.namespace.clone(),
            name: ingress.name.clone(),
        }),
        origin: Origin::Ingress {
            cluster: cluster.to_string(),
            ingresses: vec![ingress.id()],
        },
        error: format!("Ingress {}: {field}: {why}", ingress.id()),
    }
}

/// What of an IngressClass of Istio's controller is not read, as istiod does not read it.
fn class_refusals(cluster: &str, class: &IngressClass) -> Vec<Refusal> {
    if class.controller != CONTROLLER {
        return Vec::new();
    }
    let parameters = (class.parameters).then_some((
        "spec.parameters",
        "IngressClass parameters are not supported (ignored, as by istiod)",
    ));
    let default_class = (class.default_class).then_some((
        DEFAULT_CLASS_ANNOTATION,
        "is not read (as by istiod): an Ingress naming no class is served only with \
         ingressControllerMode DEFAULT",
    ));
    (parameters.into_iter().chain(default_class))
        .map(|(field, why)| Refusal {
            key: None,
            kind: None,
            subject: Some(Subject {
                kind: "IngressClass",
                namespace: String::new(),
                name: class.name.clone(),
            }),
            origin: Origin::Kubernetes {
                cluster: cluster.to_string(),
                resource_version: String::new(),
            },
            error: format!("IngressClass {}: {field}: {why}", class.name),
        })
        .collect()
}
