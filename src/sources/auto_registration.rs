//! WorkloadGroup auto-registration, as istiod: a proxy that connects with `AUTO_REGISTER_GROUP`
//! (a VM's istio-agent sets it) gets a WorkloadEntry `<group>-<ip>` made from the group's template
//! and what the proxy says of itself, so ServiceEntries selecting the group's labels reach it. The
//! entry goes when the proxy has been gone for the grace period (it may just be reconnecting).
//! Entries live in meshpilot's config store, not in the API server.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tracing::{info, warn};

use crate::aggregate::Aggregate;
use crate::istio::{ConfigKey, ConfigKind, ConfigMeta, ConfigObject, Origin, Spec, WorkloadEntry};
use crate::model::{ConfigChange, ConfigSource};
use crate::xds::proxy::Proxy;
use crate::xds::server::ProxyRegistrar;

pub struct AutoRegistration {
    aggregate: Arc<Aggregate>,
    grace: Duration,
    /// Open streams per registered entry: it stays while any is open.
    streams: Mutex<HashMap<ConfigKey, usize>>,
}

impl AutoRegistration {
    pub fn new(aggregate: Arc<Aggregate>, grace: Duration) -> Arc<Self> {
        Arc::new(Self {
            aggregate,
            grace,
            streams: Mutex::default(),
        })
    }
}

impl ProxyRegistrar for AutoRegistration {
    /// Registers the proxy if it asks to be; returns the entry to release when its stream ends.
    fn connected(&self, proxy: &Proxy) -> Option<ConfigKey> {
        let group_name = proxy.auto_register_group.as_deref()?;
        let snapshot = self.aggregate.mesh().snapshot();
        let group_key = ConfigKey {
            kind: ConfigKind::WorkloadGroup,
            namespace: proxy.namespace.clone(),
            name: group_name.into(),
        };
        let Some(Spec::WorkloadGroup(group)) = snapshot.config.get(&group_key).map(|o| &o.spec)
        else {
            warn!(proxy = %proxy.id, group = %group_key, "auto-registration into a WorkloadGroup that does not exist");
            return None;
        };
        let template_account = &group.template.service_account;
        if !template_account.is_empty()
            && proxy.service_account.as_deref() != Some(template_account.as_str())
        {
            warn!(proxy = %proxy.id, group = %group_key, "auto-registration refused: the proxy does not run as the group's service account");
            return None;
        }
        let ip = proxy.ips.first()?;
        let name = match proxy.network.is_empty() {
            true => format!("{group_name}-{ip}"),
            false => format!("{group_name}-{ip}-{}", proxy.network),
        };
        let key = ConfigKey {
            kind: ConfigKind::WorkloadEntry,
            namespace: proxy.namespace.clone(),
            name: name.replace([':', '.'], "-").into(),
        };
        let mut labels: BTreeMap<String, String> = group.metadata.labels.clone();
        labels.extend(group.template.labels.clone());
        labels.extend(proxy.labels.clone());
        let locality = &proxy.locality;
        let entry = WorkloadEntry {
            address: ip.to_string(),
            labels: labels.clone(),
            network: proxy.network.to_string(),
            locality: match locality.region.is_empty() {
                true => group.template.locality.clone(),
                false => format!("{}/{}/{}", locality.region, locality.zone, locality.subzone)
                    .trim_end_matches('/')
                    .to_string(),
            },
            service_account: proxy
                .service_account
                .clone()
                .unwrap_or_else(|| group.template.service_account.clone()),
            ..group.template.clone()
        };
        let object = ConfigObject {
            key: key.clone(),
            meta: ConfigMeta {
                labels,
                annotations: group.metadata.annotations.clone(),
                creation_timestamp: None,
                uid: None,
                origin: Origin::AutoRegistered {
                    proxy: proxy.id.clone(),
                },
            },
            spec: Spec::WorkloadEntry(entry),
        };
        *self.streams.lock().entry(key.clone()).or_default() += 1;
        info!(proxy = %proxy.id, entry = %key, "auto-registered");
        self.aggregate.apply_config(
            ConfigSource::AutoRegistration,
            vec![ConfigChange::Upsert(Arc::new(object))],
            Vec::new(),
        );
        Some(key)
    }

    /// The stream of a registered proxy ended: the entry goes after the grace period unless the
    /// proxy is back by then.
    fn disconnected(self: Arc<Self>, key: ConfigKey) {
        let this = self;
        let release = async move {
            tokio::time::sleep(this.grace).await;
            let gone = {
                let mut streams = this.streams.lock();
                let count = streams.entry(key.clone()).or_default();
                *count = count.saturating_sub(1);
                let gone = *count == 0;
                if gone {
                    streams.remove(&key);
                }
                gone
            };
            if gone {
                info!(entry = %key, "auto-registered entry removed: its proxy is gone");
                this.aggregate.apply_config(
                    ConfigSource::AutoRegistration,
                    vec![ConfigChange::Delete(key)],
                    Vec::new(),
                );
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(release);
            }
            Err(_) => warn!("auto-registered entry left behind: no runtime to remove it"),
        }
    }
}
