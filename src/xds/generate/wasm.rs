//! WasmPlugins as istiod serves them (pilot/pkg/model/extensions.go, pilot/pkg/xds/ecds.go,
//! pilot/pkg/networking/core/extension/wasmplugin.go): each plugin that applies to a listener is a
//! filter whose config is discovered over ECDS by the name
//! `extensions.istio.io/wasmplugin/<namespace>.<name>`, placed by phase among Istio's own filters;
//! the ECDS resource is the Wasm filter with the module's source, which Istio's agent fetches
//! (`oci://`, `http(s)://`) and rewrites to a local file before Envoy sees it.
//!
//! A proxy without Istio's agent (no `ISTIO_VERSION`) cannot fetch a module: it is given only
//! plugins whose module is a local file (`file://`), and the others are reported once.

use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::{
    async_data_source, data_source, http_uri, AsyncDataSource, DataSource, ExtensionConfigSource,
    HttpUri, RemoteDataSource, TypedExtensionConfig,
};
use envoy_types::pb::envoy::config::listener::v3::{filter, Filter};
use envoy_types::pb::envoy::extensions::filters::http::wasm::v3::Wasm as HttpWasm;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_filter, HttpFilter,
};
use envoy_types::pb::envoy::extensions::filters::network::wasm::v3::Wasm as NetworkWasm;
use envoy_types::pb::envoy::extensions::wasm::v3::{
    plugin_config, EnvironmentVariables, FailurePolicy, PluginConfig, VmConfig,
};
use envoy_types::pb::google::protobuf::{Any, Duration, StringValue};
use envoy_types::util::pack_any;

use super::common::ads_awaited;
use super::providers::report_unbuilt;
use crate::istio::telemetry::WorkloadMode;
use crate::istio::wasm_plugin::{EnvValueSource, FailStrategy, PluginPhase, PullPolicy};
use crate::istio::{ConfigObject, WasmPlugin};
use crate::model::{wasm_plugin, ClusterId, ConfigStore, MeshSnapshot};
use crate::xds::proxy::{Generator, Proxy};
use crate::xds::wire::Resource;

/// The ECDS names of WasmPlugins.
pub(super) const RESOURCE_PREFIX: &str = "extensions.istio.io/wasmplugin/";
const HTTP_WASM: &str = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm";
const HTTP_RBAC: &str = "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC";
const NETWORK_WASM: &str = "type.googleapis.com/envoy.extensions.filters.network.wasm.v3.Wasm";
const NETWORK_RBAC: &str = "type.googleapis.com/envoy.extensions.filters.network.rbac.v3.RBAC";
const RUNTIME: &str = "envoy.wasm.runtime.v8";
/// The environment Istio's agent reads (and removes) to fetch a module.
const PULL_SECRET_ENV: &str = "ISTIO_META_WASM_IMAGE_PULL_SECRET";
const PULL_POLICY_ENV: &str = "ISTIO_META_WASM_IMAGE_PULL_POLICY";
const RESOURCE_VERSION_ENV: &str = "ISTIO_META_WASM_PLUGIN_RESOURCE_VERSION";

/// Which side of the proxy a listener serves, as `match.mode` sees it (a gateway is a client).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum ListenerClass {
    Inbound,
    Outbound,
    Gateway,
}

/// Filters of one kind placed by phase: authentication's, authorization's, then the others
/// (STATS, then those of no phase).
pub(super) struct Phased<F> {
    pub(super) authn: Vec<F>,
    pub(super) authz: Vec<F>,
    pub(super) rest: Vec<F>,
}

impl<F> Default for Phased<F> {
    fn default() -> Self {
        Self {
            authn: Vec::new(),
            authz: Vec::new(),
            rest: Vec::new(),
        }
    }
}

impl<F> Phased<F> {
    /// Every filter in placement order, where no other filter goes between the phases.
    pub(super) fn all(self) -> Vec<F> {
        let mut out = self.authn;
        out.extend(self.authz);
        out.extend(self.rest);
        out
    }
}

/// The WasmPlugins that apply to one proxy, in placement order.
#[derive(Default)]
pub(super) struct ProxyPlugins {
    plugins: Vec<Arc<ConfigObject>>,
}

/// By the plugins: proxies with the same ones get the same listeners.
impl std::hash::Hash for ProxyPlugins {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        for object in &self.plugins {
            object.key.hash(state);
        }
    }
}

impl ProxyPlugins {
    /// `labels`: the proxy's, its topology among them.
    pub(super) fn for_proxy(
        config: &ConfigStore,
        proxy: &Proxy,
        labels: &std::collections::BTreeMap<String, String>,
    ) -> Self {
        if proxy.generator != Generator::Envoy {
            return Self::default();
        }
        let mut plugins = config.wasm_plugins_for(&proxy.namespace, labels);
        if proxy.istio_version.is_empty() {
            plugins.retain(|o| {
                let local = wasm_plugin(o).is_some_and(|p| p.url.starts_with("file://"));
                if !local {
                    report_unbuilt(
                        "a WasmPlugin for proxies without Istio's agent",
                        &o.key.to_string(),
                        "only Istio's agent fetches remote modules; such proxies get file:// modules only",
                    );
                }
                local
            });
        }
        Self { plugins }
    }

    fn matching(
        &self,
        class: ListenerClass,
        port: u16,
        network: bool,
    ) -> impl Iterator<Item = (&ConfigObject, &WasmPlugin)> {
        self.plugins.iter().filter_map(move |o| {
            let plugin = wasm_plugin(o)?;
            (plugin.is_network() == network && matches_listener(plugin, class, port))
                .then_some((&**o, plugin))
        })
    }

    /// The HTTP filters of the plugins that apply to an HTTP listener of `class` on `port`.
    pub(super) fn http(&self, class: ListenerClass, port: u16) -> Phased<HttpFilter> {
        phased(self.matching(class, port, false), |name| HttpFilter {
            name,
            config_type: Some(http_filter::ConfigType::ConfigDiscovery(discovery(&[
                HTTP_WASM, HTTP_RBAC,
            ]))),
            ..Default::default()
        })
    }

    /// The network filters of the plugins that apply to a listener of `class` on `port`.
    pub(super) fn network(&self, class: ListenerClass, port: u16) -> Phased<Filter> {
        phased(self.matching(class, port, true), |name| Filter {
            name,
            config_type: Some(filter::ConfigType::ConfigDiscovery(discovery(&[
                NETWORK_WASM,
                NETWORK_RBAC,
            ]))),
        })
    }
}

fn phased<'a, F>(
    plugins: impl Iterator<Item = (&'a ConfigObject, &'a WasmPlugin)>,
    filter: impl Fn(String) -> F,
) -> Phased<F> {
    let mut out = Phased::default();
    let mut unspecified = Vec::new();
    for (object, plugin) in plugins {
        let f = filter(resource_name(object));
        match plugin.phase {
            PluginPhase::Authn => out.authn.push(f),
            PluginPhase::Authz => out.authz.push(f),
            PluginPhase::Stats => out.rest.push(f),
            PluginPhase::UnspecifiedPhase => unspecified.push(f),
        }
    }
    out.rest.extend(unspecified);
    out
}

/// `match`: none, or one selector whose mode and ports fit the listener.
fn matches_listener(plugin: &WasmPlugin, class: ListenerClass, port: u16) -> bool {
    let mode = match class {
        ListenerClass::Inbound => WorkloadMode::Server,
        ListenerClass::Outbound | ListenerClass::Gateway => WorkloadMode::Client,
    };
    plugin.matches.is_empty()
        || plugin.matches.iter().any(|m| {
            (m.mode == WorkloadMode::ClientAndServer || m.mode == mode)
                && (m.ports.is_empty() || m.ports.iter().any(|p| p.number == u32::from(port)))
        })
}

/// Discovered over ADS; the listener waits for it (no default: an authentication plugin must not
/// be skipped while its config is on the way).
fn discovery(type_urls: &[&str]) -> ExtensionConfigSource {
    ExtensionConfigSource {
        config_source: Some(ads_awaited()),
        type_urls: type_urls.iter().map(|u| u.to_string()).collect(),
        ..Default::default()
    }
}

fn resource_name(object: &ConfigObject) -> String {
    format!(
        "{RESOURCE_PREFIX}{}.{}",
        object.key.namespace, object.key.name
    )
}

/// What serving a plugin by name reads of the proxy asking.
pub(super) struct Asker<'a> {
    pub(super) namespace: &'a str,
    pub(super) istio_version: &'a str,
    /// It proved its identity on the secure port.
    pub(super) verified: bool,
    pub(super) cluster: Option<&'a ClusterId>,
    /// The plugins that apply to it.
    pub(super) plugins: &'a ProxyPlugins,
}

/// The ECDS resource `name`: a WasmPlugin of the proxy's namespace or the root namespace (the only
/// ones istiod serves by name).
pub(super) fn build(mesh: &MeshSnapshot, asker: &Asker<'_>, name: &str) -> Option<Resource> {
    let (namespace, plugin) = name.strip_prefix(RESOURCE_PREFIX)?.split_once('.')?;
    let root = mesh.config.mesh().root_namespace.as_str();
    if namespace != asker.namespace && namespace != root {
        return None;
    }
    let object = mesh.config.wasm_plugin(namespace, plugin)?;
    let spec = wasm_plugin(object)?;
    let config = plugin_config((mesh, asker), object, spec);
    let typed_config = match spec.is_network() {
        true => pack_any(NetworkWasm {
            config: Some(config),
        }),
        false => pack_any(HttpWasm {
            config: Some(config),
        }),
    };
    let resource = TypedExtensionConfig {
        name: name.to_string(),
        typed_config: Some(typed_config),
    };
    Some(Resource::encode(name, &resource))
}

fn plugin_config(
    (mesh, asker): (&MeshSnapshot, &Asker<'_>),
    object: &ConfigObject,
    spec: &WasmPlugin,
) -> PluginConfig {
    let mut env = EnvironmentVariables::default();
    for var in spec.vm_config.iter().flat_map(|v| &v.env) {
        match var.value_from {
            EnvValueSource::Inline => {
                env.key_values.insert(var.name.clone(), var.value.clone());
            }
            EnvValueSource::Host => env.host_env_keys.push(var.name.clone()),
        }
    }
    if !spec.image_pull_secret.is_empty() {
        env.key_values.insert(
            PULL_SECRET_ENV.into(),
            pull_secret((mesh, asker), object, spec),
        );
    }
    let policy = match spec.image_pull_policy {
        PullPolicy::Unspecified => None,
        PullPolicy::IfNotPresent => Some("IfNotPresent"),
        PullPolicy::Always => Some("Always"),
    };
    if let Some(policy) = policy {
        env.key_values.insert(PULL_POLICY_ENV.into(), policy.into());
    }
    env.key_values
        .insert(RESOURCE_VERSION_ENV.into(), resource_version(object));
    let configuration = match &spec.plugin_config {
        Some(config) if !config.is_empty() => pack_any(StringValue {
            value: serde_json::Value::Object(config.clone()).to_string(),
        }),
        _ => Any::default(),
    };
    // Istio's proxies before 1.25 read the older boolean.
    let legacy = version_before(asker.istio_version, (1, 25));
    let failure_policy = match spec.fail_strategy {
        FailStrategy::FailOpen => FailurePolicy::FailOpen,
        FailStrategy::FailClose => FailurePolicy::FailClosed,
        FailStrategy::FailReload => FailurePolicy::FailReload,
    };
    PluginConfig {
        name: format!("{}.{}", object.key.namespace, object.key.name),
        root_id: spec.plugin_name.clone(),
        configuration: Some(configuration),
        #[allow(deprecated)]
        fail_open: legacy && spec.fail_strategy == FailStrategy::FailOpen,
        failure_policy: match legacy {
            true => 0,
            false => failure_policy as i32,
        },
        vm: Some(plugin_config::Vm::VmConfig(VmConfig {
            runtime: RUNTIME.into(),
            code: Some(code(spec)),
            environment_variables: Some(env),
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// The module: a local file as it is; anything else (`oci://` when it names no scheme) for the
/// agent to fetch, by the dummy cluster istiod names.
fn code(spec: &WasmPlugin) -> AsyncDataSource {
    let specifier = match spec.url.strip_prefix("file://") {
        Some(path) => async_data_source::Specifier::Local(DataSource {
            specifier: Some(data_source::Specifier::Filename(path.to_string())),
            ..Default::default()
        }),
        None => {
            let uri = match spec.url.contains("://") {
                true => spec.url.clone(),
                false => format!("oci://{}", spec.url),
            };
            async_data_source::Specifier::Remote(RemoteDataSource {
                http_uri: Some(HttpUri {
                    uri,
                    timeout: Some(Duration {
                        seconds: 30,
                        nanos: 0,
                    }),
                    http_upstream_type: Some(http_uri::HttpUpstreamType::Cluster("_".into())),
                }),
                sha256: spec.sha256.clone(),
                ..Default::default()
            })
        }
    };
    AsyncDataSource {
        specifier: Some(specifier),
    }
}

/// The docker config of the plugin's pull secret (its namespace's), sent only to proxies that
/// proved their identity and that the plugin applies to (istiod's `referencedSecrets`,
/// pilot/pkg/xds/ecds.go: any proxy of the namespace may name the plugin, but only those it
/// selects pull its module); empty otherwise or when it is missing, which the agent reports.
fn pull_secret(
    (mesh, asker): (&MeshSnapshot, &Asker<'_>),
    object: &ConfigObject,
    spec: &WasmPlugin,
) -> String {
    let applies = || {
        let applied = asker.plugins;
        applied.plugins.iter().any(|o| o.key == object.key)
    };
    if !asker.verified || !applies() {
        return String::new();
    }
    let clusters = mesh.credentials.search_order(asker.cluster);
    mesh.credentials
        .docker_config(&clusters, &object.key.namespace, &spec.image_pull_secret)
        .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
        .unwrap_or_default()
}

/// What tells the agent a module's tag may point elsewhere now: the object's resource version in
/// a config cluster, else a hash of its spec.
fn resource_version(object: &ConfigObject) -> String {
    match &object.meta.origin {
        crate::istio::Origin::Kubernetes {
            resource_version, ..
        } => resource_version.clone(),
        _ => {
            let text = serde_json::to_string(&object.spec).unwrap_or_default();
            let mut h = std::collections::hash_map::DefaultHasher::new();
            std::hash::Hash::hash(&text, &mut h);
            format!("{:x}", std::hash::Hasher::finish(&h))
        }
    }
}

/// Whether an Istio version (`1.24.3`, `1.26-dev`) is before `major.minor`; an unknown one is not.
fn version_before(version: &str, (major, minor): (u32, u32)) -> bool {
    let mut parts = version.split(['.', '-']);
    let number = |p: Option<&str>| p.and_then(|p| p.parse::<u32>().ok());
    match (number(parts.next()), number(parts.next())) {
        (Some(a), Some(b)) => (a, b) < (major, minor),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_before_a_release() {
        assert!(version_before("1.24.3", (1, 25)));
        assert!(!version_before("1.25.0", (1, 25)));
        assert!(!version_before("1.30-dev", (1, 25)));
        assert!(!version_before("", (1, 25)));
    }
}
