//! Every field of Istio's MeshConfig and of its `defaultConfig` (ProxyConfig), at Istio 1.14 and
//! today (istio.io/api `mesh/v1alpha1/config.proto`, `proxy.proto`), and what meshpilot does with
//! each. A mesh config is never refused for a field some Istio knows: what meshpilot does not
//! apply is reported by name (the log, `/debug/mesh` `notApplied`), and a name no Istio has gets
//! the one it most likely misspells. (istiod drops unknown fields silently:
//! pkg/config/mesh/mesh.go `ApplyMeshConfig` retries with unknown fields allowed.)

use serde::Serialize;
use serde_json::Value;

use super::fields::{self, Step};

/// What meshpilot does with a field.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Treatment {
    /// Applied as istiod applies it.
    Applied,
    /// istiod applies it; meshpilot does not, for the reason given.
    NotApplied(&'static str),
    /// Declared, but current istiod does not read it either.
    Unread(&'static str),
    /// Taken out of Istio's API; nothing reads it.
    Removed,
}

use Treatment::{Applied, NotApplied, Removed, Unread};

/// MeshConfig's fields, 1.14 and current, in the proto's order; then the removed ones.
pub const MESH_FIELDS: &[(&str, Treatment)] = &[
    ("proxyListenPort", Applied),
    ("proxyInboundListenPort", Applied),
    ("proxyHttpPort", NotApplied("no HTTP proxy listener is built for sidecars")),
    ("connectTimeout", Applied),
    ("hboneIdleTimeout", NotApplied("HBONE connection pools keep Envoy's idle timeout")),
    ("protocolDetectionTimeout", Applied),
    ("tcpKeepalive", Applied),
    ("ingressClass", Applied),
    ("ingressService", Applied),
    ("ingressControllerMode", Applied),
    ("ingressSelector", Applied),
    ("enableTracing", Applied),
    ("accessLogFile", Applied),
    ("accessLogFormat", Applied),
    ("accessLogEncoding", Applied),
    ("enableEnvoyAccessLogService", NotApplied("the bootstrap's envoyAccessLogService is not added to listeners; name an envoyHttpAls or envoyTcpAls provider instead")),
    ("disableEnvoyListenerLog", Applied),
    ("defaultConfig", Applied),
    ("outboundTrafficPolicy", Applied),
    ("inboundTrafficPolicy", Applied),
    ("configSources", Applied),
    ("enableAutoMtls", Applied),
    ("trustDomain", Applied),
    ("trustDomainAliases", Applied),
    ("caCertificates", Applied),
    ("defaultServiceExportTo", Applied),
    ("defaultVirtualServiceExportTo", Applied),
    ("defaultDestinationRuleExportTo", Applied),
    ("rootNamespace", Applied),
    ("localityLbSetting", Applied),
    ("zoneAwareLbSetting", NotApplied("zone-aware load balancing is not configured")),
    ("dnsRefreshRate", Applied),
    ("h2UpgradePolicy", Applied),
    ("inboundClusterStatName", Applied),
    ("outboundClusterStatName", Applied),
    ("certificates", Unread("DNS certificates in Secrets (istiod 1.14's Chiron) are not issued; deprecated")),
    ("thriftConfig", Removed),
    ("serviceSettings", Applied),
    ("serviceScopeConfigs", NotApplied("ambient mode's service scopes are not implemented")),
    ("enablePrometheusMerge", Applied),
    ("verifyCertificateAtClient", Unread("deprecated; proxies verify servers' certificates as DestinationRules say")),
    ("ca", Unread("no Istio component reads it")),
    ("extensionProviders", Applied),
    ("defaultProviders", Applied),
    ("discoverySelectors", Applied),
    ("pathNormalization", Applied),
    ("defaultHttpRetryPolicy", Applied),
    ("defaultInboundHttpRetryPolicy", NotApplied("inbound routes keep Istio's default retries")),
    ("meshMTLS", Applied),
    ("tlsDefaults", Applied),
    ("defaultTrafficPolicy", NotApplied("clusters take a DestinationRule's traffic policy only")),
    ("serviceEntryVisibility", NotApplied("ServiceEntry visibility policies are not implemented")),
    ("mixerCheckServer", Removed),
    ("mixerReportServer", Removed),
    ("disablePolicyChecks", Removed),
    ("disableMixerHttpReports", Removed),
    ("policyCheckFailOpen", Removed),
    ("sidecarToTelemetrySessionAffinity", Removed),
    ("authPolicy", Removed),
    ("rdsRefreshDelay", Removed),
    ("mixerAddress", Removed),
    ("enableClientSidePolicyCheck", Removed),
    ("sdsUdsPath", Removed),
    ("sdsRefreshDelay", Removed),
    ("enableSdsTokenMount", Removed),
    ("sdsUseK8sSaJwt", Removed),
    ("terminationDrainDuration", Removed),
    ("disableReportBatch", Removed),
    ("reportBatchMaxEntries", Removed),
    ("reportBatchMaxTime", Removed),
    ("fileFlushInterval", Removed),
    ("fileFlushMinSize", Removed),
];

/// The agent's own settings reach it through injection (the `PROXY_CONFIG` variable): applied.
/// Those istiod reads when it builds a proxy's xDS are named where meshpilot does not.
pub const PROXY_FIELDS: &[(&str, Treatment)] = &[
    ("configPath", Applied),
    ("binaryPath", Applied),
    ("serviceCluster", Applied),
    ("tracingServiceName", Applied),
    ("drainDuration", Applied),
    ("parentShutdownDuration", Applied),
    ("discoveryAddress", Applied),
    ("discoveryRefreshDelay", Applied),
    ("zipkinAddress", Applied),
    ("statsdUdpAddress", Applied),
    ("envoyMetricsServiceAddress", Applied),
    ("proxyAdminPort", Applied),
    ("availabilityZone", Applied),
    ("controlPlaneAuthPolicy", Applied),
    ("customConfigFile", Applied),
    ("statNameLength", Applied),
    ("concurrency", Applied),
    ("proxyBootstrapTemplatePath", Applied),
    ("interceptionMode", Applied),
    ("tracing", Applied),
    ("sds", Applied),
    ("envoyAccessLogService", Applied),
    ("envoyMetricsService", Applied),
    ("proxyMetadata", Applied),
    ("runtimeValues", Applied),
    ("statusPort", Applied),
    ("extraStatTags", Applied),
    ("gatewayTopology", NotApplied("gateways' listeners keep Envoy's defaults for trusted hops and client certificate details")),
    ("terminationDrainDuration", Applied),
    ("meshId", Applied),
    ("readinessProbe", NotApplied("WorkloadEntries' health is not probed")),
    ("proxyStatsMatcher", Applied),
    ("holdApplicationUntilProxyStarts", Applied),
    ("caCertificatesPem", NotApplied("set by the control plane, not read from config (istiod neither): the trust bundle PCDS sends under --multiroot-mesh, from caCertificates")),
    ("image", Applied),
    ("privateKeyProvider", NotApplied("SDS sends keys without a private key provider")),
    ("proxyHeaders", NotApplied("listeners set Istio's default headers")),
    ("fileFlushInterval", Applied),
    ("fileFlushMinSizeKb", Applied),
    ("statsCompression", Applied),
    ("connectionSettings", NotApplied("HTTP connection managers keep Istio's defaults")),
];

/// Provider kinds of `extensionProviders` meshpilot builds, and the others Istio has.
const PROVIDERS_BUILT: &[&str] = &[
    "envoyExtAuthzHttp",
    "envoyExtAuthzGrpc",
    "envoyFileAccessLog",
    "zipkin",
    "opentelemetry",
    "datadog",
    "skywalking",
    "envoyOtelAls",
    "envoyHttpAls",
    "envoyTcpAls",
    "prometheus",
];
const PROVIDERS_NOT_BUILT: &[&str] = &["lightstep", "stackdriver", "opencensus", "sds"];

/// A field of the mesh config as given that meshpilot does not apply, and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FieldNote {
    pub field: String,
    pub why: String,
}

/// What meshpilot does not apply of `given` (the mesh config as written): `unread` holds the
/// paths its typed config did not read.
pub(super) fn notes(given: &Value, unread: &[Vec<Step>]) -> Vec<FieldNote> {
    let mut out = Vec::new();
    for steps in unread {
        let field = fields::display(steps);
        match steps.as_slice() {
            [Step::Key(name)] => out.extend(note(&field, name, MESH_FIELDS)),
            _ => out.push(FieldNote {
                field,
                why: "not applied: meshpilot does not read this field".into(),
            }),
        }
    }
    let proxy = given.get("defaultConfig").and_then(Value::as_object);
    for name in proxy.into_iter().flat_map(|p| p.keys()) {
        out.extend(note(&format!("defaultConfig.{name}"), name, PROXY_FIELDS));
    }
    let tags = given.pointer("/defaultConfig/tracing/customTags");
    if tags.is_some_and(|t| !t.is_null()) {
        out.push(FieldNote {
            field: "defaultConfig.tracing.customTags".into(),
            why: "not applied: spans carry a Telemetry's custom tags only".into(),
        });
    }
    let providers = given.get("extensionProviders").and_then(Value::as_array);
    for (i, provider) in providers.into_iter().flatten().enumerate() {
        let kinds = provider.as_object().into_iter().flat_map(|p| p.keys());
        for kind in kinds.filter(|k| *k != "name" && !PROVIDERS_BUILT.contains(&k.as_str())) {
            let field = format!("extensionProviders[{i}].{kind}");
            let why = match PROVIDERS_NOT_BUILT.contains(&kind.as_str()) {
                true => format!("not applied: {kind} providers are not built"),
                false => unknown(kind, &[PROVIDERS_BUILT, PROVIDERS_NOT_BUILT].concat()),
            };
            out.push(FieldNote { field, why });
        }
    }
    out
}

/// The note for field `name` (shown as `field`) of a message whose fields are `table`.
fn note(field: &str, name: &str, table: &[(&str, Treatment)]) -> Option<FieldNote> {
    let why = match table.iter().find(|(known, _)| *known == name) {
        Some((_, Applied)) => return None,
        Some((_, NotApplied(why))) => format!("not applied: {why}"),
        Some((_, Unread(why))) => format!("not applied, nor read by istiod: {why}"),
        Some((_, Removed)) => "removed from Istio's API; nothing reads it".into(),
        None => {
            let names: Vec<&str> = table.iter().map(|(known, _)| *known).collect();
            unknown(name, &names)
        }
    };
    let field = field.to_string();
    Some(FieldNote { field, why })
}

fn unknown(name: &str, known: &[&str]) -> String {
    match fields::closest(name, known) {
        Some(meant) => format!("unknown field: did you mean {meant}?"),
        None => "unknown field".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::istio::MeshConfig;

    fn notes_of(yaml: &str) -> Vec<(String, String)> {
        let mesh = MeshConfig::parse(yaml, &MeshConfig::default()).unwrap();
        (mesh.not_applied.into_iter())
            .map(|n| (n.field, n.why))
            .collect()
    }

    #[test]
    fn a_misspelt_field_names_the_one_it_means() {
        let notes = notes_of("trustDomian: example.org\ndefaultConfig: {discoveryAdress: x:1}\n");
        assert_eq!(
            notes,
            [
                (
                    "trustDomian".to_string(),
                    "unknown field: did you mean trustDomain?".to_string()
                ),
                (
                    "defaultConfig.discoveryAdress".to_string(),
                    "unknown field: did you mean discoveryAddress?".to_string()
                ),
            ]
        );
    }

    #[test]
    fn known_fields_not_applied_say_why_and_applied_ones_say_nothing() {
        let notes = notes_of(
            "defaultInboundHttpRetryPolicy: {attempts: 1}\nmixerAddress: x\nca: {address: y}\nconnectTimeout: 3s\ndefaultConfig: {gatewayTopology: {numTrustedProxies: 1}, drainDuration: 5s}\n",
        );
        let fields: Vec<&str> = notes.iter().map(|(f, _)| f.as_str()).collect();
        assert_eq!(
            fields,
            [
                "ca",
                "defaultInboundHttpRetryPolicy",
                "mixerAddress",
                "defaultConfig.gatewayTopology"
            ]
        );
        assert!(notes[0].1.contains("nor read by istiod"), "{notes:?}");
        assert!(notes[1].1.starts_with("not applied: "), "{notes:?}");
        assert!(notes[2].1.starts_with("removed"), "{notes:?}");
    }

    #[test]
    fn newer_provider_fields_and_kinds_are_reported_not_refused() {
        let notes = notes_of(
            "extensionProviders:\n- name: otel\n  opentelemetry: {service: otel.obs.svc.cluster.local, port: 4317, http: {path: /v1/traces}}\n- name: ls\n  lightstep: {address: x:1}\n- name: typo\n  zipkni: {service: z}\n",
        );
        let fields: Vec<&str> = notes.iter().map(|(f, _)| f.as_str()).collect();
        assert_eq!(
            fields,
            [
                "extensionProviders[0].opentelemetry.http",
                "extensionProviders[1].lightstep",
                "extensionProviders[2].zipkni"
            ]
        );
        assert!(notes[2].1.contains("did you mean zipkin?"), "{notes:?}");
    }

    #[test]
    fn every_applied_field_is_one_meshpilot_reads() {
        let read = serde_json::to_value(MeshConfig::default()).unwrap();
        let read: Vec<&String> = read.as_object().unwrap().keys().collect();
        for (name, treatment) in MESH_FIELDS {
            let applied = *treatment == Applied;
            assert_eq!(
                applied,
                read.iter().any(|r| r == name),
                "{name}: {treatment:?}"
            );
        }
        for name in read {
            assert!(MESH_FIELDS.iter().any(|(f, _)| f == name), "{name}");
        }
    }
}
