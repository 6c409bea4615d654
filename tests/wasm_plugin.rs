//! WasmPlugins as proxies receive them, decoded from raw ADS responses: the listener's filter
//! discovering its config over ECDS, placed by phase; the ECDS resource in istiod's form (the
//! module for Istio's agent to fetch, the plugin's config as JSON, the failure policy by proxy
//! version, the pull secret only to a proxy proven on the secure port); file modules only for
//! proxies without Istio's agent; an EnvoyFilter's EXTENSION_CONFIG served by name.

mod common;

use std::time::Duration;

use common::config_source::{ConfigFixture, Source};
use common::*;
use envoy_types::pb::envoy::config::core::v3::{
    async_data_source, config_source, data_source, http_uri, TypedExtensionConfig,
};
use envoy_types::pb::envoy::config::listener::v3::{filter, Listener};
use envoy_types::pb::envoy::extensions::filters::http::wasm::v3::Wasm;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_filter, HttpConnectionManager,
};
use envoy_types::pb::envoy::extensions::wasm::v3::{plugin_config, FailurePolicy};
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use envoy_types::pb::google::protobuf::StringValue;
use prost::Message;

const BOUND: Duration = Duration::from_secs(10);
const LDS: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
const ECDS: &str = "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig";
const REVIEWS_ID: &str = "sidecar~10.1.1.11~reviews-v1-7f9c8d.bookinfo~bookinfo.svc.cluster.local";
const AUTH: &str = "extensions.istio.io/wasmplugin/bookinfo.basic-auth";
const LOCAL: &str = "extensions.istio.io/wasmplugin/istio-system.local-headers";

const PLUGINS: &str = "
apiVersion: extensions.istio.io/v1alpha1
kind: WasmPlugin
metadata: {name: basic-auth, namespace: bookinfo}
spec:
  selector: {matchLabels: {app: reviews}}
  url: oci://ghcr.io/istio-ecosystem/wasm-extensions/basic_auth:1.12.0
  sha256: 0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef
  imagePullPolicy: Always
  imagePullSecret: registry
  phase: AUTHN
  failStrategy: FAIL_OPEN
  pluginConfig:
    basic_auth_rules: [{prefix: /api, request_methods: [GET], credentials: ['ok:test']}]
  vmConfig:
    env: [{name: TRACE, value: 'on'}, {name: HOSTNAME, valueFrom: HOST}]
  match: [{mode: SERVER, ports: [{number: 9080}]}]
---
apiVersion: extensions.istio.io/v1alpha1
kind: WasmPlugin
metadata: {name: local-headers, namespace: istio-system}
spec:
  url: file:///var/lib/wasm/headers.wasm
  pluginName: headers
";

/// An EnvoyFilter serving an extension config by name, as users wire their own ECDS filters.
const EXTENSION: &str = "
apiVersion: networking.istio.io/v1alpha3
kind: EnvoyFilter
metadata: {name: ecds, namespace: bookinfo}
spec:
  configPatches:
  - applyTo: EXTENSION_CONFIG
    patch:
      operation: ADD
      value:
        name: bookinfo-buffer
        typed_config:
          '@type': type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer
          max_request_bytes: 4096
";

const PULL_SECRET: &str = r#"
apiVersion: v1
kind: Secret
metadata: {name: registry, namespace: bookinfo}
type: kubernetes.io/dockerconfigjson
stringData:
  .dockerconfigjson: '{"auths":{"ghcr.io":{"auth":"dXNlcjpwYXNz"}}}'
"#;

fn node(version: &str) -> envoy_types::pb::envoy::config::core::v3::Node {
    let mut meta = vec![("CLUSTER_ID", "cluster1")];
    if !version.is_empty() {
        meta.push(("ISTIO_VERSION", version));
    }
    labelled_node(REVIEWS_ID, &meta, &[("app", "reviews")])
}

/// The HTTP filters (name, whether its config is discovered) of every connection manager of a
/// proxy's listener.
async fn http_filters(
    f: &ConfigFixture,
    version: &str,
    listener: &str,
    port: Option<u32>,
) -> Vec<Vec<String>> {
    let listeners: Vec<Listener> = common::ads::fetch(f.mp.xds_addr, node(version), LDS, &[]).await;
    let listener = listeners
        .iter()
        .find(|l| l.name == listener)
        .expect("the listener");
    let chains = listener
        .filter_chains
        .iter()
        .chain(listener.default_filter_chain.iter())
        .filter(|c| {
            port.is_none_or(|p| {
                let m = c.filter_chain_match.as_ref();
                m.and_then(|m| m.destination_port).map(|d| d.value) == Some(p)
            })
        });
    chains
        .flat_map(|c| &c.filters)
        .filter_map(|f| match &f.config_type {
            Some(filter::ConfigType::TypedConfig(any))
                if f.name == "envoy.filters.network.http_connection_manager" =>
            {
                let hcm = HttpConnectionManager::decode(&any.value[..]).unwrap();
                Some(hcm.http_filters.iter().map(|f| f.name.clone()).collect())
            }
            _ => None,
        })
        .collect()
}

/// One extension config as a new stream over `client` asks for it by name (the node is read from
/// a stream's first request only).
async fn extension(mut client: AdsClient, id: &str, version: &str, name: &str) -> Option<Wasm> {
    let mut request = DiscoveryRequest {
        node: Some(node(version)),
        type_url: ECDS.into(),
        resource_names: vec![name.to_string()],
        ..Default::default()
    };
    request.node.as_mut().unwrap().id = id.to_string();
    client.request(request);
    let response = client.response(BOUND).await;
    let config = TypedExtensionConfig::decode(&response.resources.first()?.value[..]).unwrap();
    assert_eq!(config.name, name);
    let any = config.typed_config.expect("a config");
    Some(Wasm::decode(&any.value[..]).expect("a Wasm filter"))
}

#[tokio::test]
async fn wasm_plugins_reach_listeners_and_ecds_as_istiod_sends_them() {
    let f = ConfigFixture::start(
        Source::Files,
        &[("plugins.yaml", PLUGINS), ("ecds.yaml", EXTENSION)],
        &["--debounce-after", "0s"],
    )
    .await;
    write_atomic(
        &f.dir.path().join("clusters/cluster1/pull.yaml"),
        PULL_SECRET,
    );

    // Inbound on 9080: the AUTHN plugin before the router; both plugins for Istio's proxy.
    let inbound = http_filters(&f, "1.26.0", "virtualInbound", Some(9080)).await;
    assert!(!inbound.is_empty());
    for names in &inbound {
        let at = names.iter().position(|n| n == AUTH).expect("the plugin");
        let local = names.iter().position(|n| n == LOCAL).expect("the root's");
        assert!(at < local, "AUTHN before unspecified: {names:?}");
        assert_eq!(names.last().unwrap(), "envoy.filters.http.router");
    }
    // Outbound: not a SERVER listener; the root's plugin (no match) is.
    for names in http_filters(&f, "1.26.0", "0.0.0.0_9080", None).await {
        assert!(!names.contains(&AUTH.to_string()), "{names:?}");
        assert!(names.contains(&LOCAL.to_string()), "{names:?}");
    }
    // A proxy without Istio's agent cannot fetch the OCI module: only the local one.
    for names in http_filters(&f, "", "virtualInbound", None).await {
        assert!(!names.contains(&AUTH.to_string()), "{names:?}");
        assert!(names.contains(&LOCAL.to_string()), "{names:?}");
    }

    // The reference: discovered over ADS, waiting for it, Wasm or the agent's RBAC stand-in.
    let listeners: Vec<Listener> =
        common::ads::fetch(f.mp.xds_addr, node("1.26.0"), LDS, &[]).await;
    let inbound = listeners
        .iter()
        .find(|l| l.name == "virtualInbound")
        .unwrap();
    let hcm = inbound.filter_chains.iter().find_map(|c| {
        c.filters.iter().find_map(|f| match &f.config_type {
            Some(filter::ConfigType::TypedConfig(any))
                if f.name == "envoy.filters.network.http_connection_manager" =>
            {
                Some(HttpConnectionManager::decode(&any.value[..]).unwrap())
            }
            _ => None,
        })
    });
    let reference = hcm
        .unwrap()
        .http_filters
        .into_iter()
        .find(|f| f.name == AUTH)
        .unwrap();
    let Some(http_filter::ConfigType::ConfigDiscovery(source)) = reference.config_type else {
        panic!("{reference:?}")
    };
    assert_eq!(
        source.type_urls,
        [
            "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC"
        ]
    );
    let config_source = source.config_source.unwrap();
    assert!(matches!(
        config_source.config_source_specifier,
        Some(config_source::ConfigSourceSpecifier::Ads(_))
    ));
    assert_eq!(
        config_source
            .initial_fetch_timeout
            .unwrap_or_default()
            .seconds,
        0
    );
    assert!(source.default_config.is_none());

    // The ECDS resource, over plaintext (no proven identity: no pull secret).
    let plain = || async { AdsClient::connect(f.mp.xds_addr).await.unwrap() };
    let wasm = extension(plain().await, REVIEWS_ID, "1.26.0", AUTH)
        .await
        .expect("the plugin");
    let config = wasm.config.unwrap();
    assert_eq!(config.name, "bookinfo.basic-auth");
    assert_eq!(config.failure_policy, FailurePolicy::FailOpen as i32);
    let configuration = config.configuration.unwrap();
    assert_eq!(
        configuration.type_url,
        "type.googleapis.com/google.protobuf.StringValue"
    );
    let json: serde_json::Value =
        serde_json::from_str(&StringValue::decode(&configuration.value[..]).unwrap().value)
            .unwrap();
    assert_eq!(json["basic_auth_rules"][0]["prefix"], "/api");
    let Some(plugin_config::Vm::VmConfig(vm)) = config.vm else {
        panic!("a VM config")
    };
    assert_eq!(vm.runtime, "envoy.wasm.runtime.v8");
    let Some(async_data_source::Specifier::Remote(remote)) = vm.code.unwrap().specifier else {
        panic!("a remote module")
    };
    let uri = remote.http_uri.unwrap();
    assert_eq!(
        uri.uri,
        "oci://ghcr.io/istio-ecosystem/wasm-extensions/basic_auth:1.12.0"
    );
    assert_eq!(
        uri.http_upstream_type,
        Some(http_uri::HttpUpstreamType::Cluster("_".into()))
    );
    assert_eq!(uri.timeout.unwrap().seconds, 30);
    assert_eq!(remote.sha256.len(), 64);
    let env = vm.environment_variables.unwrap();
    assert_eq!(env.key_values["TRACE"], "on");
    assert_eq!(env.host_env_keys, ["HOSTNAME"]);
    assert_eq!(
        env.key_values["ISTIO_META_WASM_IMAGE_PULL_POLICY"],
        "Always"
    );
    assert_eq!(env.key_values["ISTIO_META_WASM_IMAGE_PULL_SECRET"], "");
    assert!(env
        .key_values
        .contains_key("ISTIO_META_WASM_PLUGIN_RESOURCE_VERSION"));

    // Istio's proxies before 1.25 read the older fail_open.
    let older = extension(plain().await, REVIEWS_ID, "1.24.2", AUTH)
        .await
        .unwrap()
        .config
        .unwrap();
    #[allow(deprecated)]
    let fail_open = older.fail_open;
    assert!(fail_open);
    assert_eq!(older.failure_policy, 0);

    // A local module is a file; a plugin of another namespace is not served to this proxy.
    let local = extension(plain().await, REVIEWS_ID, "1.26.0", LOCAL)
        .await
        .unwrap()
        .config
        .unwrap();
    let Some(plugin_config::Vm::VmConfig(vm)) = local.vm else {
        panic!()
    };
    let Some(async_data_source::Specifier::Local(file)) = vm.code.unwrap().specifier else {
        panic!("a local module")
    };
    assert_eq!(
        file.specifier,
        Some(data_source::Specifier::Filename(
            "/var/lib/wasm/headers.wasm".into()
        ))
    );
    let stranger = "sidecar~10.5.0.5~client.other~other.svc.cluster.local";
    assert!(extension(plain().await, stranger, "1.26.0", AUTH)
        .await
        .is_none());

    // The EnvoyFilter's extension config, by name.
    let mut request = DiscoveryRequest {
        node: Some(node("1.26.0")),
        type_url: ECDS.into(),
        resource_names: vec!["bookinfo-buffer".into()],
        ..Default::default()
    };
    request.node.as_mut().unwrap().id = REVIEWS_ID.into();
    let mut other = AdsClient::connect(f.mp.xds_addr).await.unwrap();
    other.request(request);
    let response = other.response(BOUND).await;
    let buffer = TypedExtensionConfig::decode(&response.resources[0].value[..]).unwrap();
    assert_eq!(
        buffer.typed_config.unwrap().type_url,
        "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer"
    );

    // Proven on the secure port, the proxy is sent the registry credentials.
    let secret = wait_for("the pull secret in the plugin", BOUND, || {
        let f = &f;
        async move {
            let certs = workload_certs(&f.mp, "bookinfo", "bookinfo-reviews");
            let channel = tls_channel(
                f.mp.secure_xds_addr,
                &certs.root,
                Some((&certs.chain, &certs.key)),
            )
            .await
            .ok()?;
            let secure = AdsClient::over(channel).await.ok()?;
            let wasm = extension(secure, REVIEWS_ID, "1.26.0", AUTH).await?;
            let Some(plugin_config::Vm::VmConfig(vm)) = wasm.config?.vm else {
                return None;
            };
            let secret =
                vm.environment_variables?.key_values["ISTIO_META_WASM_IMAGE_PULL_SECRET"].clone();
            (!secret.is_empty()).then_some(secret)
        }
    })
    .await;
    assert_eq!(secret, r#"{"auths":{"ghcr.io":{"auth":"dXNlcjpwYXNz"}}}"#);

    // A proven proxy of the namespace that the plugin does not select may read the plugin by its
    // ECDS name (as istiod serves it), but not its registry credentials.
    let certs = workload_certs(&f.mp, "bookinfo", "bookinfo-ratings");
    let channel = tls_channel(
        f.mp.secure_xds_addr,
        &certs.root,
        Some((&certs.chain, &certs.key)),
    )
    .await
    .unwrap();
    let mut ratings = AdsClient::over(channel).await.unwrap();
    ratings.request(DiscoveryRequest {
        node: Some(labelled_node(
            "sidecar~10.1.1.12~ratings-v1-5d9f7.bookinfo~bookinfo.svc.cluster.local",
            &[("CLUSTER_ID", "cluster1"), ("ISTIO_VERSION", "1.26.0")],
            &[("app", "ratings")],
        )),
        type_url: ECDS.into(),
        resource_names: vec![AUTH.into()],
        ..Default::default()
    });
    let response = ratings.response(BOUND).await;
    let config = TypedExtensionConfig::decode(&response.resources[0].value[..]).unwrap();
    let wasm = Wasm::decode(&config.typed_config.unwrap().value[..]).unwrap();
    let Some(plugin_config::Vm::VmConfig(vm)) = wasm.config.unwrap().vm else {
        panic!("a VM config");
    };
    let env = vm.environment_variables.unwrap();
    assert_eq!(env.key_values["ISTIO_META_WASM_IMAGE_PULL_SECRET"], "");
}
