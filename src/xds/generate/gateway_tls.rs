//! The TLS a gateway server terminates: its certificate from a Secret (`credentialName`, fetched
//! from meshpilot over ADS as `kubernetes://<name>`, its CA as `kubernetes://<name>-cacert`) or
//! from files in the gateway's pod; ISTIO_MUTUAL with the workload certificate, as a sidecar's
//! inbound side. And the TLS a gateway originates with a DestinationRule's `credentialName`.

use envoy_types::pb::envoy::config::core::v3::TransportSocket;
use envoy_types::pb::envoy::config::core::v3::{data_source, transport_socket, DataSource};
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    common_tls_context::{CombinedCertificateValidationContext, ValidationContextType},
    tls_parameters::TlsProtocol,
    CertificateValidationContext, CommonTlsContext, DownstreamTlsContext, SdsSecretConfig,
    TlsCertificate, TlsParameters, UpstreamTlsContext,
};
use envoy_types::pb::google::protobuf::BoolValue;
use envoy_types::util::pack_any;

use super::common::ads;
use super::{sds, tls};
use crate::istio::destination_rule::{ClientTls, TlsMode as ClientTlsMode};
use crate::istio::gateway::{ServerTls, ServerTlsMode};
use crate::istio::mesh_traffic::{TlsConfig, TlsVersion};
use crate::istio::tls_names;
use tracing::warn;

/// Whether a server's TLS mode ends TLS at the gateway (the others pass it through).
pub fn terminates(mode: ServerTlsMode) -> bool {
    !matches!(
        mode,
        ServerTlsMode::Passthrough | ServerTlsMode::AutoPassthrough
    )
}

/// The transport socket of a server that terminates TLS, its parameters the mesh's
/// `tlsDefaults` under the server's own.
pub fn server_socket(
    settings: &ServerTls,
    alpn: &[&str],
    trust_domains: &[String],
    defaults: &TlsConfig,
) -> TransportSocket {
    if settings.mode == ServerTlsMode::IstioMutual {
        // `meshMTLS` is for workloads' inbound mTLS only (istiod's `BuildInboundTLS` callers).
        return tls::inbound_socket(trust_domains, tls::INBOUND_HTTP_ALPN, &TlsConfig::default());
    }
    let verify_clients = matches!(
        settings.mode,
        ServerTlsMode::Mutual | ServerTlsMode::OptionalMutual
    );
    let mut common = CommonTlsContext {
        alpn_protocols: alpn.iter().map(|a| a.to_string()).collect(),
        tls_params: tls_params(settings, defaults),
        ..Default::default()
    };
    let sans = tls::san_matchers(&settings.subject_alt_names);
    if settings.credential_name.is_empty() {
        common.tls_certificates = vec![TlsCertificate {
            certificate_chain: Some(file(&settings.server_certificate)),
            private_key: Some(file(&settings.private_key)),
            ..Default::default()
        }];
        if verify_clients {
            common.validation_context_type = Some(ValidationContextType::ValidationContext(
                CertificateValidationContext {
                    trusted_ca: Some(file(&settings.ca_certificates)),
                    match_typed_subject_alt_names: sans,
                    ..Default::default()
                },
            ));
        }
    } else {
        let name = &settings.credential_name;
        common.tls_certificate_sds_secret_configs = vec![over_ads(sds::resource_name(name, false))];
        if verify_clients {
            common.validation_context_type =
                Some(ValidationContextType::CombinedValidationContext(
                    CombinedCertificateValidationContext {
                        default_validation_context: Some(CertificateValidationContext {
                            match_typed_subject_alt_names: sans,
                            ..Default::default()
                        }),
                        validation_context_sds_secret_config: Some(over_ads(sds::resource_name(
                            name, true,
                        ))),
                        ..Default::default()
                    },
                ));
        }
    }
    let context = DownstreamTlsContext {
        common_tls_context: Some(common),
        require_client_certificate: Some(BoolValue {
            value: settings.mode == ServerTlsMode::Mutual,
        }),
        ..Default::default()
    };
    TransportSocket {
        name: "envoy.transport_sockets.tls".to_string(),
        config_type: Some(transport_socket::ConfigType::TypedConfig(pack_any(context))),
    }
}

/// The TLS a gateway originates to a destination whose DestinationRule names a `credentialName`
/// (istiod's `ApplyCustomSDSToClientCommonTLSContext`, pilot/pkg/security/model/authentication.go):
/// MUTUAL presents the Secret's certificate (`kubernetes://<name>`); both modes verify the server
/// against the Secret's CA (`kubernetes://<name>-cacert`: Secret `<name>-cacert`, else the Secret's
/// `ca.crt`) and the rule's subjectAltNames, unless `insecureSkipVerify`.
pub fn origination_socket(
    settings: &ClientTls,
    default_sni: &str,
    defaults: &TlsConfig,
) -> TransportSocket {
    let name = &settings.credential_name;
    let mut common = CommonTlsContext::default();
    if !defaults.ecdh_curves.is_empty() || !defaults.cipher_suites.is_empty() {
        common.tls_params = Some(tls::upstream_defaults(tls::upstream_tls_params(), defaults));
    }
    if settings.mode == ClientTlsMode::Mutual {
        common.tls_certificate_sds_secret_configs = vec![over_ads(sds::resource_name(name, false))];
    }
    if settings.insecure_skip_verify != Some(true) {
        common.validation_context_type = Some(ValidationContextType::CombinedValidationContext(
            CombinedCertificateValidationContext {
                default_validation_context: Some(CertificateValidationContext {
                    match_typed_subject_alt_names: tls::san_matchers(&settings.subject_alt_names),
                    ..Default::default()
                }),
                validation_context_sds_secret_config: Some(over_ads(sds::resource_name(
                    name, true,
                ))),
                ..Default::default()
            },
        ));
    }
    let context = UpstreamTlsContext {
        common_tls_context: Some(common),
        sni: match settings.sni.as_str() {
            "" => default_sni.to_string(),
            sni => sni.to_string(),
        },
        ..Default::default()
    };
    TransportSocket {
        name: "envoy.transport_sockets.tls".to_string(),
        config_type: Some(transport_socket::ConfigType::TypedConfig(pack_any(context))),
    }
}

/// An SDS secret the gateway fetches from meshpilot on its ADS stream (as istiod's gateways do).
fn over_ads(name: String) -> SdsSecretConfig {
    SdsSecretConfig {
        name,
        sds_config: Some(ads()),
    }
}

fn file(path: &str) -> DataSource {
    DataSource {
        specifier: Some(data_source::Specifier::Filename(path.to_string())),
        ..Default::default()
    }
}

/// The mesh's `tlsDefaults` first (curves, ciphers, a minimum version but TLS_AUTO), then each
/// parameter the server sets itself (istiod's `applyDownstreamTLSDefaults` and
/// `applyServerTLSSettings`, pilot/pkg/networking/core/listener.go `BuildListenerTLSContext`).
fn tls_params(settings: &ServerTls, defaults: &TlsConfig) -> Option<TlsParameters> {
    let version = |v: &str| match v {
        "TLSV1_0" => TlsProtocol::TlSv10,
        "TLSV1_1" => TlsProtocol::TlSv11,
        "TLSV1_2" => TlsProtocol::TlSv12,
        "TLSV1_3" => TlsProtocol::TlSv13,
        _ => TlsProtocol::TlsAuto,
    } as i32;
    let mut params = TlsParameters {
        ecdh_curves: defaults.ecdh_curves.clone(),
        cipher_suites: defaults.cipher_suites.clone(),
        tls_minimum_protocol_version: match defaults.min_protocol_version {
            TlsVersion::Auto => TlsProtocol::TlsAuto,
            TlsVersion::V1_2 => TlsProtocol::TlSv12,
            TlsVersion::V1_3 => TlsProtocol::TlSv13,
        } as i32,
        ..Default::default()
    };
    let auto = TlsProtocol::TlsAuto as i32;
    if version(&settings.min_protocol_version) != auto {
        params.tls_minimum_protocol_version = version(&settings.min_protocol_version);
    }
    params.tls_maximum_protocol_version = version(&settings.max_protocol_version);
    // Suites Envoy does not know are left out, as istiod's `FilterCipherSuites` does (gateway.go),
    // rather than have the proxy refuse the listener.
    let (suites, unknown) = tls_names::filter_cipher_suites(&settings.cipher_suites);
    if !unknown.is_empty() {
        warn!(
            ?unknown,
            "gateway server cipher suites Envoy does not know left out"
        );
    }
    if !suites.is_empty() {
        params.cipher_suites = suites;
    }
    (params != TlsParameters::default()).then_some(params)
}
