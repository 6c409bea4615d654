//! Mesh config: the `mesh` key of Istio's `istio` ConfigMap (istio.io/api mesh/v1alpha1), for the
//! fields meshpilot uses; Istio's defaults where a field is absent.

use serde::{Deserialize, Serialize};

use super::destination_rule::{
    ClientTls, H2UpgradePolicy, LocalityLbSetting, TcpKeepalive, TlsMode,
};
use super::duration::Duration;
use super::extension_provider::{self, ExtensionProvider};
use super::label_selector::LabelSelector;
use super::mesh_fields::{self, FieldNote};
use super::mesh_traffic::{CertificateData, InboundTrafficPolicy, PathNormalization, TlsConfig};
use super::service_settings::ServiceSettings;
use super::validate::{self, ensure, Result, ValidationError};
use super::virtual_service::HttpRetry;

/// The ConfigMap in the system namespace that carries the mesh config, and its key.
pub const MESH_CONFIGMAP: &str = "istio";
pub const MESH_KEY: &str = "mesh";
/// The mesh ConfigMap's key holding MeshNetworks (istio/istio pkg/config/mesh/kubemesh).
pub const MESH_NETWORKS_KEY: &str = "meshNetworks";
/// Istio's defaults of `proxyListenPort`, `proxyInboundListenPort` and `defaultConfig.statusPort`
/// (pkg/config/mesh/mesh.go `DefaultMeshConfig`, `DefaultProxyConfig`).
pub const OUTBOUND_CAPTURE_PORT: u16 = 15001;
pub const INBOUND_CAPTURE_PORT: u16 = 15006;
pub const STATUS_PORT: u16 = 15020;

#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct MeshConfig {
    /// Where iptables sends a sidecar's outbound connections: `virtualOutbound`'s port.
    pub proxy_listen_port: u16,
    /// Where iptables sends a sidecar's inbound connections: `virtualInbound`'s port.
    pub proxy_inbound_listen_port: u16,
    pub trust_domain: String,
    pub trust_domain_aliases: Vec<String>,
    /// Where mesh-wide config lives (DestinationRule fallbacks, mesh-wide policies).
    pub root_namespace: String,
    pub enable_auto_mtls: bool,
    pub outbound_traffic_policy: OutboundTrafficPolicy,
    pub default_config: ProxyConfig,
    pub connect_timeout: Duration,
    /// How often DNS clusters resolve their hosts again (at most: a record's TTL may cut it).
    pub dns_refresh_rate: Duration,
    pub locality_lb_setting: Option<LocalityLbSetting>,
    pub default_service_export_to: Vec<String>,
    pub default_virtual_service_export_to: Vec<String>,
    pub default_destination_rule_export_to: Vec<String>,
    /// ext_authz providers of CUSTOM AuthorizationPolicies and access log providers of
    /// Telemetries (others kept as given).
    pub extension_providers: Vec<ExtensionProvider>,
    /// Providers in effect where no Telemetry names one.
    pub default_providers: DefaultProviders,
    /// Where the proxies' access log goes when no Telemetry decides (empty: none, Istio's default
    /// profile; the demo profile's is /dev/stdout).
    pub access_log_file: String,
    pub access_log_encoding: AccessLogEncoding,
    /// A custom format: a text template, or for JSON a JSON object of command operators.
    pub access_log_format: String,
    /// Leaves out the log of connections no filter chain matched (the listeners' own).
    pub disable_envoy_listener_log: bool,
    /// Istio's proxies trace through the tracer their agent configures when no Telemetry or
    /// default provider decides (Istio's default: on).
    pub enable_tracing: bool,
    /// Where Istio config comes from (`xds://`, `fs://`, `k8s://`), read at start as istiod reads
    /// it; none: the config directory's files and the config cluster.
    pub config_sources: Vec<ConfigSourceSpec>,
    /// The namespaces of every Kubernetes cluster meshpilot discovers (any selector matching its
    /// labels); none: every namespace.
    pub discovery_selectors: Vec<LabelSelector>,
    /// Hosts whose endpoints reach only their own cluster's proxies (`clusterLocal`), beyond
    /// istiod's defaults, or taken back from them.
    pub service_settings: Vec<ServiceSettings>,
    /// How request paths are normalised on every connection manager.
    pub path_normalization: PathNormalization,
    /// Keepalive on every upstream connection (a DestinationRule's own fields win).
    pub tcp_keepalive: Option<TcpKeepalive>,
    /// How long a sniffing listener waits for the client's first bytes (0: until they come).
    pub protocol_detection_timeout: Duration,
    /// `UPGRADE`: HTTP/1.1 to HTTP ports' upstreams goes as HTTP/2 unless a rule says not to.
    pub h2_upgrade_policy: H2UpgradePolicy,
    /// Retries of routes that name none (Istio's default policy when absent).
    pub default_http_retry_policy: Option<HttpRetry>,
    /// Inbound mTLS parameters.
    #[serde(rename = "meshMTLS")]
    pub mesh_mtls: TlsConfig,
    /// Roots beyond the mesh's own; their trust domains are accepted from peers.
    pub ca_certificates: Vec<CertificateData>,
    /// Where sidecars deliver inbound traffic: the pod's address, or localhost.
    pub inbound_traffic_policy: InboundTrafficPolicy,
    /// TLS parameters of gateways' servers and of TLS DestinationRules originate, under their own.
    pub tls_defaults: TlsConfig,
    /// Patterns of the clusters' stat names (empty: the cluster's name).
    pub inbound_cluster_stat_name: String,
    pub outbound_cluster_stat_name: String,
    /// Injection moves a pod's Prometheus scrape annotations to the agent, which serves the
    /// application's metrics merged with Envoy's (a pod annotation decides first).
    pub enable_prometheus_merge: bool,
    /// What of the mesh config as given meshpilot does not apply, by field.
    #[serde(skip)]
    pub not_applied: Vec<FieldNote>,
    /// The installation's `--multiroot-mesh` (istiod's `ISTIO_MULTIROOT_MESH`): whether
    /// `caCertificates`' roots are sent to proxies (PCDS). Not a field of Istio's MeshConfig.
    #[serde(skip)]
    pub multiroot_mesh: bool,
    /// Kubernetes Ingress: the `kubernetes.io/ingress.class` annotation value served.
    pub ingress_class: String,
    /// Which Ingresses are served: those of the class (STRICT), those naming no class too
    /// (DEFAULT), none (OFF).
    pub ingress_controller_mode: IngressControllerMode,
    /// The `istio` label of the gateway proxies serving Ingresses.
    pub ingress_selector: String,
    /// The Service of the system's ingress gateway, whose addresses Ingresses' status reports.
    pub ingress_service: String,
}

/// `ingressControllerMode` (istio.io/api mesh/v1alpha1 config.proto `IngressControllerMode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum IngressControllerMode {
    Unspecified,
    Off,
    Default,
    #[default]
    Strict,
}

/// One of `configSources`: an address and, for `xds://`, how to reach it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ConfigSourceSpec {
    pub address: String,
    pub tls_settings: Option<ClientTls>,
    /// `SERVICE_REGISTRY`: only the registry's kinds (ServiceEntry, WorkloadEntry) from this source.
    pub subscribed_resources: Vec<String>,
}

/// Where a config source's objects come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SourceAddress<'a> {
    /// An MCP server, `host:port`.
    Xds(&'a str),
    /// A directory of YAML.
    Files(&'a str),
    /// The config cluster's Istio objects.
    ConfigCluster,
}

impl ConfigSourceSpec {
    /// What the address names, or why it names nothing meshpilot reads.
    pub fn target(&self) -> std::result::Result<SourceAddress<'_>, String> {
        let address = self.address.as_str();
        if let Some(host_port) = address.strip_prefix("xds://") {
            let host_port = host_port.trim_end_matches('/');
            let port = host_port.rsplit_once(':').map(|(_, p)| p.parse::<u16>());
            return match port {
                Some(Ok(port)) if port > 0 => Ok(SourceAddress::Xds(host_port)),
                _ => Err(format!("{address:?}: xds:// names <host>:<port>")),
            };
        }
        if let Some(path) = address.strip_prefix("fs://") {
            return match path.starts_with('/') {
                true => Ok(SourceAddress::Files(path)),
                false => Err(format!("{address:?}: fs:// names an absolute directory")),
            };
        }
        match address {
            "k8s://" | "k8s:///" => Ok(SourceAddress::ConfigCluster),
            _ => Err(format!(
                "{address:?}: a config source is xds://<host>:<port>, fs:///<directory> or k8s://"
            )),
        }
    }

    /// The `host:port` of an `xds://` source.
    pub fn host_port(&self) -> String {
        match self.target() {
            Ok(SourceAddress::Xds(host_port)) => host_port.to_string(),
            _ => String::new(),
        }
    }

    /// The kinds to subscribe to: every one MCP carries, or the registry's alone.
    pub fn kinds(&self) -> Vec<super::ConfigKind> {
        let registry = [
            super::ConfigKind::ServiceEntry,
            super::ConfigKind::WorkloadEntry,
        ];
        super::mcp::kinds()
            .filter(|k| self.subscribed_resources.is_empty() || registry.contains(k))
            .collect()
    }

    fn validate(&self) -> Result {
        let target = self
            .target()
            .map_err(|e| ValidationError::at("address", e))?;
        for resource in &self.subscribed_resources {
            ensure(
                resource == "SERVICE_REGISTRY",
                "subscribedResources",
                format!("{resource:?} is not a resource Istio defines (SERVICE_REGISTRY)"),
            )?;
        }
        let Some(tls) = &self.tls_settings else {
            return Ok(());
        };
        ensure(
            matches!(target, SourceAddress::Xds(_)),
            "tlsSettings",
            "only xds:// sources are reached over the network",
        )?;
        source_tls(tls).map_err(|e| e.under("tlsSettings"))
    }
}

/// Whether a config source's TLS settings encrypt at all.
pub fn encrypts(tls: &ClientTls) -> bool {
    matches!(tls.mode, TlsMode::Simple | TlsMode::Mutual)
}

/// What of Istio's ClientTLSSettings a config source's connection implements.
fn source_tls(tls: &ClientTls) -> Result {
    ensure(
        tls.mode != TlsMode::IstioMutual,
        "mode",
        "meshpilot reaches a config source with DISABLE, SIMPLE or MUTUAL (ISTIO_MUTUAL is not implemented; give MUTUAL its files)",
    )?;
    ensure(
        tls.credential_name.is_empty(),
        "credentialName",
        "is not implemented for config sources: name the CA file (caCertificates)",
    )?;
    ensure(
        tls.insecure_skip_verify.is_none(),
        "insecureSkipVerify",
        "is not implemented for config sources",
    )?;
    ensure(
        !encrypts(tls) || !tls.ca_certificates.is_empty(),
        "caCertificates",
        "SIMPLE and MUTUAL need the CA file that signed the source's certificate",
    )?;
    ensure(
        tls.mode != TlsMode::Mutual
            || (!tls.client_certificate.is_empty() && !tls.private_key.is_empty()),
        "clientCertificate",
        "MUTUAL needs clientCertificate and privateKey",
    )
}

#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct DefaultProviders {
    pub access_logging: Vec<String>,
    /// Only the first is used, as istiod.
    pub tracing: Vec<String>,
    /// Istio's default mesh config names `prometheus`: Istio's proxies report Istio's metrics.
    pub metrics: Vec<String>,
}

impl Default for DefaultProviders {
    fn default() -> Self {
        Self {
            access_logging: Vec::new(),
            tracing: Vec::new(),
            metrics: vec![extension_provider::BUILT_IN_PROMETHEUS.into()],
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum AccessLogEncoding {
    #[default]
    Text,
    Json,
}

impl Default for MeshConfig {
    fn default() -> Self {
        Self {
            proxy_listen_port: OUTBOUND_CAPTURE_PORT,
            proxy_inbound_listen_port: INBOUND_CAPTURE_PORT,
            trust_domain: "cluster.local".into(),
            trust_domain_aliases: Vec::new(),
            root_namespace: "istio-system".into(),
            enable_auto_mtls: true,
            outbound_traffic_policy: OutboundTrafficPolicy::default(),
            default_config: ProxyConfig::default(),
            connect_timeout: Duration(std::time::Duration::from_secs(10)),
            dns_refresh_rate: Duration(std::time::Duration::from_secs(60)),
            locality_lb_setting: None,
            default_service_export_to: vec!["*".into()],
            default_virtual_service_export_to: vec!["*".into()],
            default_destination_rule_export_to: vec!["*".into()],
            extension_providers: Vec::new(),
            default_providers: DefaultProviders::default(),
            access_log_file: String::new(),
            access_log_encoding: AccessLogEncoding::Text,
            access_log_format: String::new(),
            disable_envoy_listener_log: false,
            enable_tracing: true,
            config_sources: Vec::new(),
            discovery_selectors: Vec::new(),
            service_settings: Vec::new(),
            path_normalization: PathNormalization::default(),
            tcp_keepalive: None,
            protocol_detection_timeout: Duration(std::time::Duration::ZERO),
            h2_upgrade_policy: H2UpgradePolicy::Default,
            default_http_retry_policy: None,
            mesh_mtls: TlsConfig::default(),
            tls_defaults: TlsConfig::default(),
            inbound_traffic_policy: InboundTrafficPolicy::default(),
            ca_certificates: Vec::new(),
            inbound_cluster_stat_name: String::new(),
            outbound_cluster_stat_name: String::new(),
            enable_prometheus_merge: true,
            not_applied: Vec::new(),
            multiroot_mesh: false,
            ingress_class: "istio".into(),
            ingress_controller_mode: IngressControllerMode::Strict,
            ingress_selector: String::new(),
            ingress_service: "istio-ingressgateway".into(),
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default)]
pub struct OutboundTrafficPolicy {
    pub mode: OutboundMode,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum OutboundMode {
    /// Unknown destinations are reached directly (PassthroughCluster).
    #[default]
    AllowAny,
    /// Only registered services are reachable (unknown ones go to BlackHoleCluster).
    RegistryOnly,
}

/// `defaultConfig`: the proxies' own settings; meshpilot reads the discovery address and keeps the
/// rest for injection.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ProxyConfig {
    pub discovery_address: String,
    #[serde(flatten)]
    pub rest: serde_json::Map<String, serde_json::Value>,
}

impl ProxyConfig {
    /// `statusPort`: where the agent serves health checks and the merged Prometheus metrics.
    /// Validated on acceptance; Istio's default when absent.
    pub fn status_port(&self) -> u16 {
        port_field(&self.rest, "statusPort").unwrap_or(STATUS_PORT)
    }

    /// `tracing.sampling` of the proxies' defaults: a percentage, 0 (or absent) meaning unset.
    pub fn trace_sampling(&self) -> Option<f64> {
        let sampling = self.rest.get("tracing")?.get("sampling")?.as_f64()?;
        (sampling != 0.0).then_some(sampling)
    }

    /// `tracing.maxPathTagLength`, when set.
    pub fn max_path_tag_length(&self) -> Option<u32> {
        let length = self
            .rest
            .get("tracing")?
            .get("maxPathTagLength")?
            .as_u64()?;
        u32::try_from(length).ok().filter(|l| *l != 0)
    }
}

/// A port field of a proxy config in its JSON form: None when absent or not a port.
pub fn port_field(config: &serde_json::Map<String, serde_json::Value>, name: &str) -> Option<u16> {
    let port = config.get(name)?.as_u64()?;
    u16::try_from(port).ok().filter(|p| *p != 0)
}

impl MeshConfig {
    /// Istio's defaults, with the installation's trust domain and root namespace.
    pub fn defaults_for(trust_domain: &str, root_namespace: &str) -> Self {
        Self {
            trust_domain: trust_domain.to_string(),
            root_namespace: root_namespace.to_string(),
            ..Self::default()
        }
    }

    /// Parses the YAML of the `mesh` key; absent fields take Istio's defaults, but the root
    /// namespace and trust domain those of `defaults` (the installation's flags).
    pub fn parse(yaml: &str, defaults: &MeshConfig) -> std::result::Result<Self, ValidationError> {
        let value: serde_json::Value = match yaml.trim() {
            "" => serde_json::Value::Object(Default::default()),
            text => {
                crate::yaml::check_aliases(text)
                    .map_err(|e| ValidationError::at("mesh", e.to_string()))?;
                serde_yaml_ng::from_str(text)
                    .map_err(|e| ValidationError::at("mesh", crate::text::clip(&e.to_string())))?
            }
        };
        let given = |field: &str| value.get(field).is_some();
        let (root_given, trust_given) = (given("rootNamespace"), given("trustDomain"));
        let mut unread = Vec::new();
        let mut note = |path: serde_ignored::Path| unread.push(super::steps(&path));
        let ignoring = serde_ignored::Deserializer::new(value.clone(), &mut note);
        let mut mesh: Self = serde_path_to_error::deserialize(ignoring).map_err(|e| {
            let path = e.path().to_string();
            ValidationError::at(
                crate::text::clip(&path),
                crate::text::clip(&e.into_inner().to_string()),
            )
        })?;
        mesh.not_applied = mesh_fields::notes(&value, &unread);
        mesh.multiroot_mesh = defaults.multiroot_mesh;
        for (i, entry) in mesh.ca_certificates.iter().enumerate() {
            mesh.not_applied
                .extend(entry.unapplied_parts(mesh.multiroot_mesh).into_iter().map(
                    |(part, why)| FieldNote {
                        field: format!("caCertificates[{i}].{part}"),
                        why: why.to_string(),
                    },
                ));
        }
        if !root_given {
            mesh.root_namespace = defaults.root_namespace.clone();
        }
        if !trust_given {
            mesh.trust_domain = defaults.trust_domain.clone();
        }
        mesh.validate()?;
        Ok(mesh)
    }

    pub fn validate(&self) -> Result {
        ensure(
            !self.trust_domain.is_empty(),
            "trustDomain",
            "must not be empty",
        )?;
        ensure(
            !self.root_namespace.is_empty(),
            "rootNamespace",
            "must not be empty",
        )?;
        ensure(
            self.connect_timeout.as_std() >= std::time::Duration::from_millis(1),
            "connectTimeout",
            "must be at least 1ms",
        )?;
        // Envoy refuses a DNS refresh rate under a millisecond.
        ensure(
            self.dns_refresh_rate.as_std() >= std::time::Duration::from_millis(1),
            "dnsRefreshRate",
            "must be at least 1ms",
        )?;
        self.validate_ports()?;
        validate::export_to("defaultServiceExportTo", &self.default_service_export_to)?;
        validate::export_to(
            "defaultVirtualServiceExportTo",
            &self.default_virtual_service_export_to,
        )?;
        validate::export_to(
            "defaultDestinationRuleExportTo",
            &self.default_destination_rule_export_to,
        )?;
        if self.access_log_encoding == AccessLogEncoding::Json && !self.access_log_format.is_empty()
        {
            // istiod logs this and falls back to its default; refusing keeps the last good config.
            let parsed = serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(
                &self.access_log_format,
            );
            ensure(
                parsed.is_ok(),
                "accessLogFormat",
                "with accessLogEncoding JSON it must be a JSON object of command operators",
            )?;
        }
        self.mesh_mtls
            .validate_mesh_mtls()
            .map_err(|e| e.under("meshMTLS"))?;
        self.tls_defaults
            .validate_names()
            .map_err(|e| e.under("tlsDefaults"))?;
        for (i, selector) in self.discovery_selectors.iter().enumerate() {
            selector
                .validate()
                .map_err(|e| e.under(&format!("discoverySelectors[{i}]")))?;
        }
        for (i, source) in self.config_sources.iter().enumerate() {
            source
                .validate()
                .map_err(|e| e.under(&format!("configSources[{i}]")))?;
        }
        for (i, entry) in self.service_settings.iter().enumerate() {
            entry
                .validate()
                .map_err(|e| e.under(&format!("serviceSettings[{i}]")))?;
        }
        for (i, entry) in self.ca_certificates.iter().enumerate() {
            entry
                .validate()
                .map_err(|e| e.under(&format!("caCertificates[{i}]")))?;
        }
        let directories = self
            .config_sources
            .iter()
            .filter(|s| matches!(s.target(), Ok(SourceAddress::Files(_))))
            .count();
        ensure(
            directories <= 1,
            "configSources",
            "at most one fs:// directory",
        )?;
        extension_provider::validate(&self.extension_providers)
    }

    /// The capture ports and the agent's status port (istiod's `ValidateMeshConfig` refuses a
    /// `proxyListenPort` or `statusPort` outside 1..65535). Stricter than istiod: the inbound
    /// port too, and the capture ports apart from each other and from the ports Envoy and the
    /// agent listen on, which a listener bound to them would collide with.
    fn validate_ports(&self) -> Result {
        let proxy = &self.default_config.rest;
        for name in ["statusPort", "proxyAdminPort"] {
            if let Some(given) = proxy.get(name) {
                ensure(
                    port_field(proxy, name).is_some(),
                    &format!("defaultConfig.{name}"),
                    format!("port number {given} must be in the range 1..65535"),
                )?;
            }
        }
        let status = self.default_config.status_port();
        let admin = port_field(proxy, "proxyAdminPort").unwrap_or(15000);
        let taken = [
            (admin, "Envoy's admin port (defaultConfig.proxyAdminPort)"),
            (15021, "Envoy's health port"),
            (15090, "Envoy's Prometheus port"),
            (status, "the agent's status port (defaultConfig.statusPort)"),
        ];
        let capture = [
            ("proxyListenPort", self.proxy_listen_port),
            ("proxyInboundListenPort", self.proxy_inbound_listen_port),
        ];
        for (field, port) in capture {
            ensure(
                port != 0,
                field,
                "port number 0 must be in the range 1..65535",
            )?;
            if let Some((_, what)) = taken.iter().find(|(p, _)| *p == port) {
                return Err(ValidationError::at(field, format!("{port} is {what}")));
            }
        }
        ensure(
            self.proxy_listen_port != self.proxy_inbound_listen_port,
            "proxyInboundListenPort",
            "must differ from proxyListenPort: both listeners bind it",
        )
    }

    /// An extension provider by name, matched without regard to case as istiod does, with Istio's
    /// built-in `envoy` (a file access log to /dev/stdout) and `prometheus` where the mesh config
    /// does not define them.
    pub fn provider(&self, name: &str) -> Option<std::borrow::Cow<'_, ExtensionProvider>> {
        let defined = self
            .extension_providers
            .iter()
            .find(|p| p.name.eq_ignore_ascii_case(name));
        match defined {
            Some(p) => Some(std::borrow::Cow::Borrowed(p)),
            None => ExtensionProvider::built_in(name).map(std::borrow::Cow::Owned),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn defaults(root: &str) -> MeshConfig {
        MeshConfig {
            root_namespace: root.into(),
            ..MeshConfig::default()
        }
    }

    #[test]
    fn a_refusal_quotes_a_bounded_excerpt_of_the_field() {
        let long = "k".repeat(10_000);
        // An explicit key is as long as it likes, and the field path quotes it.
        let yaml = format!(
            "localityLbSetting:\n  distribute:\n  - from: a\n    to:\n      ? {long}\n      : many\n"
        );
        let error = MeshConfig::parse(&yaml, &defaults("istio-system")).unwrap_err();
        assert!(error.field.starts_with("localityLbSetting"), "{error}");
        assert!(
            error.to_string().len() < 1000,
            "{} bytes",
            error.to_string().len()
        );
    }

    #[test]
    fn defaults_follow_istio() {
        let mesh = MeshConfig::parse("", &defaults("mesh-system")).unwrap();
        assert_eq!(mesh.trust_domain, "cluster.local");
        assert_eq!(mesh.root_namespace, "mesh-system");
        assert!(mesh.enable_auto_mtls);
        assert_eq!(mesh.outbound_traffic_policy.mode, OutboundMode::AllowAny);
        assert_eq!(mesh.connect_timeout.as_std().as_secs(), 10);
        // pkg/config/mesh/mesh.go DefaultMeshConfig.
        assert_eq!(mesh.ingress_class, "istio");
        assert_eq!(mesh.ingress_controller_mode, IngressControllerMode::Strict);
        assert_eq!(
            (
                mesh.ingress_selector.as_str(),
                mesh.ingress_service.as_str()
            ),
            ("", "istio-ingressgateway")
        );
        let mesh = MeshConfig::parse("ingressControllerMode: DEFAULT", &defaults("x")).unwrap();
        assert_eq!(mesh.ingress_controller_mode, IngressControllerMode::Default);
    }

    #[test]
    fn istio_configmap_mesh_parses() {
        let mesh = MeshConfig::parse(
            "
accessLogFile: /dev/stdout
defaultConfig:
  discoveryAddress: istiod.istio-system.svc:15012
  proxyMetadata: {ISTIO_META_DNS_CAPTURE: \"true\"}
enablePrometheusMerge: true
rootNamespace: istio-system
trustDomain: example.org
outboundTrafficPolicy: {mode: REGISTRY_ONLY}
connectTimeout: 5s
",
            &defaults("istio-system"),
        )
        .unwrap();
        assert_eq!(mesh.trust_domain, "example.org");
        assert_eq!(
            mesh.outbound_traffic_policy.mode,
            OutboundMode::RegistryOnly
        );
        assert_eq!(
            mesh.default_config.discovery_address,
            "istiod.istio-system.svc:15012"
        );
        assert!(mesh.default_config.rest.contains_key("proxyMetadata"));
    }

    #[test]
    fn errors_name_the_field() {
        let e = MeshConfig::parse("outboundTrafficPolicy: {mode: SOMETIMES}", &defaults("x"))
            .unwrap_err();
        assert!(e.field.starts_with("outboundTrafficPolicy"), "{e}");
        let e = MeshConfig::parse("connectTimeout: 0s", &defaults("x")).unwrap_err();
        assert_eq!(e.field, "connectTimeout");
    }

    #[test]
    fn a_config_source_s_tls_settings_are_istio_s_and_what_is_not_implemented_is_refused() {
        let source = |tls: &str| {
            MeshConfig::parse(
                &format!(
                    "configSources: [{{address: 'xds://registry:15010', tlsSettings: {tls}}}]"
                ),
                &defaults("x"),
            )
        };
        let simple = source("{mode: SIMPLE, caCertificates: /ca.pem, sni: registry}").unwrap();
        let tls = simple.config_sources[0].tls_settings.as_ref().unwrap();
        assert!(encrypts(tls) && tls.sni == "registry");
        let e = source("{mode: ISTIO_MUTUAL}").unwrap_err();
        assert_eq!(e.field, "configSources[0].tlsSettings.mode", "{e}");
        let e = source("{mode: SOMETIMES}").unwrap_err();
        assert!(e.field.starts_with("configSources"), "{e}");
        let e = source("{mode: SIMPLE, caCertificates: /ca.pem, insecureSkipVerify: true}");
        assert_eq!(
            e.unwrap_err().field,
            "configSources[0].tlsSettings.insecureSkipVerify"
        );
    }

    #[test]
    fn capture_and_status_ports_default_to_istio_s_and_are_refused_by_field() {
        let mesh = MeshConfig::parse("", &defaults("x")).unwrap();
        assert_eq!(
            (mesh.proxy_listen_port, mesh.proxy_inbound_listen_port),
            (15001, 15006)
        );
        assert_eq!(mesh.default_config.status_port(), 15020);
        assert!(mesh.enable_prometheus_merge);
        let mesh = MeshConfig::parse(
            "proxyListenPort: 16001\nproxyInboundListenPort: 16006\ndefaultConfig: {statusPort: 16020}",
            &defaults("x"),
        )
        .unwrap();
        assert_eq!(
            (mesh.proxy_listen_port, mesh.proxy_inbound_listen_port),
            (16001, 16006)
        );
        assert_eq!(mesh.default_config.status_port(), 16020);
        for (yaml, field) in [
            ("proxyListenPort: 0", "proxyListenPort"),
            ("proxyListenPort: 70000", "proxyListenPort"),
            ("proxyListenPort: -1", "proxyListenPort"),
            ("proxyInboundListenPort: 0", "proxyInboundListenPort"),
            ("proxyInboundListenPort: 15001", "proxyInboundListenPort"),
            ("proxyListenPort: 15021", "proxyListenPort"),
            (
                "proxyInboundListenPort: 16020\ndefaultConfig: {statusPort: 16020}",
                "proxyInboundListenPort",
            ),
            ("defaultConfig: {statusPort: 0}", "defaultConfig.statusPort"),
            ("defaultConfig: {statusPort: x}", "defaultConfig.statusPort"),
            (
                "defaultConfig: {proxyAdminPort: 65536}",
                "defaultConfig.proxyAdminPort",
            ),
        ] {
            let e = MeshConfig::parse(yaml, &defaults("x")).unwrap_err();
            assert!(e.field.starts_with(field), "{yaml}: {e}");
        }
    }
}
