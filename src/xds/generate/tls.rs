//! Istio's auto mTLS between sidecars: transport sockets that reference the SDS secrets `default`
//! (the workload's certificate) and `ROOTCA` (the mesh root), served by the proxy's agent over the
//! `sds-grpc` cluster, as istio-proxy expects.

use envoy_types::pb::envoy::config::cluster::v3::cluster::TransportSocketMatch;
use envoy_types::pb::envoy::config::core::v3::{
    api_config_source, config_source, grpc_service, transport_socket, ApiConfigSource, ApiVersion,
    ConfigSource, GrpcService, TransportSocket,
};
use envoy_types::pb::envoy::config::core::v3::{data_source, DataSource};
use envoy_types::pb::envoy::extensions::transport_sockets::raw_buffer::v3::RawBuffer;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    common_tls_context::{CombinedCertificateValidationContext, ValidationContextType},
    subject_alt_name_matcher::SanType,
    tls_parameters, CertificateValidationContext, CommonTlsContext, DownstreamTlsContext,
    SdsSecretConfig, SubjectAltNameMatcher, TlsCertificate, TlsParameters, UpstreamTlsContext,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{string_matcher::MatchPattern, StringMatcher};
use envoy_types::pb::google::protobuf::{value::Kind, BoolValue, Duration, Struct, Value};
use envoy_types::util::pack_any;

use crate::istio::destination_rule::{ClientTls, TlsMode as ClientTlsMode};
use crate::istio::mesh_traffic::{TlsConfig, TlsVersion};

/// SDS secret names and cluster of istio-proxy's agent.
pub const WORKLOAD_SECRET: &str = "default";
pub const ROOT_SECRET: &str = "ROOTCA";
pub const SDS_CLUSTER: &str = "sds-grpc";
/// Endpoint metadata key selecting the mTLS transport socket.
pub const TLS_MODE_KEY: &str = "tlsMode";

fn sds(name: &str) -> SdsSecretConfig {
    SdsSecretConfig {
        name: name.to_string(),
        sds_config: Some(ConfigSource {
            config_source_specifier: Some(config_source::ConfigSourceSpecifier::ApiConfigSource(
                ApiConfigSource {
                    api_type: api_config_source::ApiType::Grpc as i32,
                    transport_api_version: ApiVersion::V3 as i32,
                    grpc_services: vec![GrpcService {
                        target_specifier: Some(grpc_service::TargetSpecifier::EnvoyGrpc(
                            grpc_service::EnvoyGrpc {
                                cluster_name: SDS_CLUSTER.to_string(),
                                ..Default::default()
                            },
                        )),
                        ..Default::default()
                    }],
                    set_node_on_first_message_only: true,
                    ..Default::default()
                },
            )),
            resource_api_version: ApiVersion::V3 as i32,
            // Wait for the agent however long it takes, as Istio does.
            initial_fetch_timeout: Some(Duration {
                seconds: 0,
                nanos: 0,
            }),
            ..Default::default()
        }),
    }
}

pub(super) fn san_matchers(sans: &[String]) -> Vec<SubjectAltNameMatcher> {
    sans.iter()
        .map(|san| SubjectAltNameMatcher {
            san_type: if san.contains("://") {
                SanType::Uri
            } else {
                SanType::Dns
            } as i32,
            matcher: Some(StringMatcher {
                match_pattern: Some(MatchPattern::Exact(san.clone())),
                ..Default::default()
            }),
            ..Default::default()
        })
        .collect()
}

fn common(sans: &[String], alpn: &[&str]) -> CommonTlsContext {
    let matchers = san_matchers(sans);
    CommonTlsContext {
        tls_certificate_sds_secret_configs: vec![sds(WORKLOAD_SECRET)],
        validation_context_type: Some(ValidationContextType::CombinedValidationContext(
            CombinedCertificateValidationContext {
                default_validation_context: Some(CertificateValidationContext {
                    match_typed_subject_alt_names: matchers,
                    ..Default::default()
                }),
                validation_context_sds_secret_config: Some(sds(ROOT_SECRET)),
                ..Default::default()
            },
        )),
        alpn_protocols: alpn.iter().map(|a| a.to_string()).collect(),
        ..Default::default()
    }
}

/// ISTIO_MUTUAL to every endpoint: the workload's certificate, the mesh root, a SAN check.
/// TLS 1.2 to 1.3 upstream (Envoy's client default stops at 1.2), as istiod's
/// `defaultUpstreamCommonTLSContext` (pilot/pkg/networking/core/cluster_tls.go).
/// The mesh's `tlsDefaults` on TLS a DestinationRule originates: its curves and ciphers, each
/// where given; its minimum version is not applied upstream (istiod's `applyTLSDefaults`,
/// pilot/pkg/networking/core/cluster_tls.go).
pub(super) fn upstream_defaults(mut params: TlsParameters, defaults: &TlsConfig) -> TlsParameters {
    if !defaults.ecdh_curves.is_empty() {
        params.ecdh_curves = defaults.ecdh_curves.clone();
    }
    if !defaults.cipher_suites.is_empty() {
        params.cipher_suites = defaults.cipher_suites.clone();
    }
    params
}

pub(super) fn upstream_tls_params() -> TlsParameters {
    TlsParameters {
        tls_minimum_protocol_version: tls_parameters::TlsProtocol::TlSv12 as i32,
        tls_maximum_protocol_version: tls_parameters::TlsProtocol::TlSv13 as i32,
        ..Default::default()
    }
}

/// The ciphers istiod allows workloads' mTLS servers (`BuildInboundTLS`,
/// pilot/pkg/security/authn/utils/utils.go).
const INBOUND_CIPHERS: [&str; 6] = [
    "ECDHE-ECDSA-AES256-GCM-SHA384",
    "ECDHE-RSA-AES256-GCM-SHA384",
    "ECDHE-ECDSA-AES128-GCM-SHA256",
    "ECDHE-RSA-AES128-GCM-SHA256",
    "AES256-GCM-SHA384",
    "AES128-GCM-SHA256",
];

/// Certificates issued in one of these trust domains.
fn trust_domain_matchers(trust_domains: &[String]) -> Vec<SubjectAltNameMatcher> {
    trust_domains
        .iter()
        .map(|td| SubjectAltNameMatcher {
            san_type: SanType::Uri as i32,
            matcher: Some(StringMatcher {
                match_pattern: Some(MatchPattern::Prefix(format!("spiffe://{td}/"))),
                ..Default::default()
            }),
            ..Default::default()
        })
        .collect()
}

/// The ALPN Istio's clients offer over mTLS, `h2` too for an HTTP/2 upstream (istiod's
/// `ALPNInMeshH2WithMxc`, pilot/pkg/networking/core/cluster_tls.go).
fn mesh_alpn(http2: bool) -> &'static [&'static str] {
    match http2 {
        true => &["istio-peer-exchange", "istio", "h2"],
        false => &["istio-peer-exchange", "istio"],
    }
}

pub fn upstream_istio(sni: String, sans: &[String], http2: bool) -> TransportSocket {
    let tls = UpstreamTlsContext {
        common_tls_context: Some(CommonTlsContext {
            tls_params: Some(upstream_tls_params()),
            ..common(sans, mesh_alpn(http2))
        }),
        sni,
        ..Default::default()
    };
    socket("envoy.transport_sockets.tls", pack_any(tls))
}

/// SIMPLE or MUTUAL TLS to a destination with its own certificates (DestinationRule files).
pub fn upstream_files(tls: &ClientTls, default_sni: &str, defaults: &TlsConfig) -> TransportSocket {
    let file = |path: &str| DataSource {
        specifier: Some(data_source::Specifier::Filename(path.to_string())),
        ..Default::default()
    };
    let mut context = CommonTlsContext {
        tls_params: Some(upstream_defaults(upstream_tls_params(), defaults)),
        ..Default::default()
    };
    if tls.mode == ClientTlsMode::Mutual && !tls.client_certificate.is_empty() {
        context.tls_certificates = vec![TlsCertificate {
            certificate_chain: Some(file(&tls.client_certificate)),
            private_key: Some(file(&tls.private_key)),
            ..Default::default()
        }];
    }
    if tls.insecure_skip_verify != Some(true) {
        let trusted = match tls.ca_certificates.as_str() {
            "" => SYSTEM_CA_BUNDLE,
            path => path,
        };
        context.validation_context_type = Some(ValidationContextType::ValidationContext(
            CertificateValidationContext {
                trusted_ca: Some(file(trusted)),
                match_typed_subject_alt_names: san_matchers(&tls.subject_alt_names),
                ..Default::default()
            },
        ));
    }
    let upstream = UpstreamTlsContext {
        common_tls_context: Some(context),
        sni: match tls.sni.as_str() {
            "" => default_sni.to_string(),
            sni => sni.to_string(),
        },
        ..Default::default()
    };
    socket("envoy.transport_sockets.tls", pack_any(upstream))
}

/// Where a destination's CA is looked for when a DestinationRule names none (Debian's, as in
/// Istio's proxy image).
const SYSTEM_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// Endpoints labelled `tlsMode: istio` get ISTIO_MUTUAL TLS (SNI and a SAN check against the
/// destination's identities); the others plaintext.
pub fn upstream_matches(sni: String, sans: &[String], http2: bool) -> Vec<TransportSocketMatch> {
    let tls = UpstreamTlsContext {
        common_tls_context: Some(CommonTlsContext {
            tls_params: Some(upstream_tls_params()),
            ..common(sans, mesh_alpn(http2))
        }),
        sni,
        ..Default::default()
    };
    let istio_only = Struct {
        fields: [(
            TLS_MODE_KEY.to_string(),
            Value {
                kind: Some(Kind::StringValue("istio".to_string())),
            },
        )]
        .into(),
    };
    vec![
        TransportSocketMatch {
            name: "tlsMode-istio".to_string(),
            r#match: Some(istio_only),
            transport_socket: Some(socket("envoy.transport_sockets.tls", pack_any(tls))),
        },
        TransportSocketMatch {
            name: "tlsMode-disabled".to_string(),
            r#match: Some(Struct::default()),
            transport_socket: Some(plaintext()),
        },
    ]
}

/// No TLS: the bytes as they are.
pub fn plaintext() -> TransportSocket {
    socket(
        "envoy.transport_sockets.raw_buffer",
        pack_any(RawBuffer::default()),
    )
}

/// HBONE's TLS as ztunnel speaks it: the workload's certificate, TLS 1.3 only, ALPN h2, peers
/// of the mesh's trust domain (`spiffe://<trust domain>/` prefixes).
fn hbone_common(trust_domains: &[String]) -> CommonTlsContext {
    let mut context = common(&[], &["h2"]);
    accept_trust_domains(&mut context, trust_domains);
    context.tls_params = Some(TlsParameters {
        tls_minimum_protocol_version: tls_parameters::TlsProtocol::TlSv13 as i32,
        tls_maximum_protocol_version: tls_parameters::TlsProtocol::TlSv13 as i32,
        ..Default::default()
    });
    context
}

/// Where HBONE tunnels end (a waypoint's `connect_terminate`): a client certificate required.
pub fn hbone_downstream(trust_domains: &[String]) -> TransportSocket {
    let tls = DownstreamTlsContext {
        common_tls_context: Some(hbone_common(trust_domains)),
        require_client_certificate: Some(BoolValue { value: true }),
        ..Default::default()
    };
    socket("envoy.transport_sockets.tls", pack_any(tls))
}

/// Where HBONE tunnels start (a waypoint's `connect_originate`, to the destination's ztunnel).
pub fn hbone_upstream(trust_domains: &[String]) -> TransportSocket {
    let tls = UpstreamTlsContext {
        common_tls_context: Some(hbone_common(trust_domains)),
        ..Default::default()
    };
    socket("envoy.transport_sockets.tls", pack_any(tls))
}

/// Inbound mTLS: a client certificate from the mesh root is required on the TLS filter chains.
/// Accepts client certificates of these trust domains only (a root may be shared with others).
fn accept_trust_domains(context: &mut CommonTlsContext, trust_domains: &[String]) {
    if let Some(ValidationContextType::CombinedValidationContext(combined)) =
        &mut context.validation_context_type
    {
        if let Some(default) = &mut combined.default_validation_context {
            default.match_typed_subject_alt_names = trust_domain_matchers(trust_domains);
        }
    }
}

/// The ALPN a workload's mTLS server offers for HTTP, and for TCP (where the peer metadata
/// exchange is negotiated too).
pub const INBOUND_HTTP_ALPN: &[&str] = &["h2", "http/1.1"];
pub const INBOUND_TCP_ALPN: &[&str] = &["istio-peer-exchange", "h2", "http/1.1"];

/// A workload's mTLS server, as istiod's `BuildInboundTLS` (pilot/pkg/security/authn/utils):
/// the workload certificate, a client certificate required from one of the mesh's trust domains,
/// TLS 1.2 (1.3 where the mesh's `meshMTLS` says) to 1.3, with istiod's ciphers unless `meshMTLS`
/// names its own.
pub fn inbound_socket(
    trust_domains: &[String],
    alpn: &[&str],
    mesh_mtls: &TlsConfig,
) -> TransportSocket {
    let mut context = common(&[], alpn);
    accept_trust_domains(&mut context, trust_domains);
    let ciphers = match mesh_mtls.cipher_suites.is_empty() {
        true => INBOUND_CIPHERS.iter().map(|c| c.to_string()).collect(),
        false => mesh_mtls.cipher_suites.clone(),
    };
    let mut params = upstream_tls_params();
    if mesh_mtls.min_protocol_version == TlsVersion::V1_3 {
        params.tls_minimum_protocol_version = tls_parameters::TlsProtocol::TlSv13 as i32;
    }
    context.tls_params = Some(TlsParameters {
        cipher_suites: ciphers,
        ..params
    });
    let tls = DownstreamTlsContext {
        common_tls_context: Some(context),
        require_client_certificate: Some(BoolValue { value: true }),
        ..Default::default()
    };
    socket("envoy.transport_sockets.tls", pack_any(tls))
}

fn socket(name: &str, config: envoy_types::pb::google::protobuf::Any) -> TransportSocket {
    TransportSocket {
        name: name.to_string(),
        config_type: Some(transport_socket::ConfigType::TypedConfig(config)),
    }
}
