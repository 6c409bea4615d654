//! Which filter chains serve a port of the workload, by the port's protocol and its mutual-TLS
//! mode: istiod's match table (pilot/pkg/networking/core/filterchain_options.go). Under
//! PERMISSIVE a port takes Istio's mTLS (told by its ALPN), plaintext, and — for TCP — TLS the
//! application speaks itself; under STRICT only mTLS; under DISABLE only plaintext. Ports no
//! Service declares are sniffed ("auto"): HTTP in either transport gets an HTTP connection
//! manager, anything else is proxied as TCP.

use envoy_types::pb::envoy::config::core::v3::TransportSocket;
use envoy_types::pb::envoy::config::listener::v3::FilterChainMatch;
use envoy_types::pb::google::protobuf::UInt32Value;

use crate::istio::mesh_traffic::TlsConfig;
use crate::istio::security::peer::MtlsMode;
use crate::model::Protocol;
use crate::xds::generate::inspectors::{ALL_MTLS_ALPN, PLAINTEXT_HTTP_ALPN};
use crate::xds::generate::tls;

/// What Istio's clients offer over mTLS for HTTP (the `istio.alpn` filter's).
const MTLS_HTTP_ALPN: &[&str] = &["istio-http/1.0", "istio-http/1.1", "istio-h2"];
/// What Istio's clients offer over mTLS for TCP.
const MTLS_TCP_ALPN: &[&str] = &["istio-peer-exchange", "istio"];

const TLS: &str = "tls";
const RAW: &str = "raw_buffer";

/// How a port's traffic is told apart.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Class {
    Http,
    Tcp,
    /// Not declared, or declared without a protocol: sniffed.
    Auto,
}

impl Class {
    pub(super) fn of(protocol: Protocol) -> Self {
        match protocol {
            p if p.is_http() => Self::Http,
            Protocol::Unsupported => Self::Auto,
            _ => Self::Tcp,
        }
    }
}

/// One chain: what it matches and whether it serves HTTP and terminates mTLS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct ChainOption {
    alpn: &'static [&'static str],
    transport: &'static str,
    pub(super) http: bool,
    mtls: bool,
}

const fn option(
    alpn: &'static [&'static str],
    transport: &'static str,
    http: bool,
    mtls: bool,
) -> ChainOption {
    ChainOption {
        alpn,
        transport,
        http,
        mtls,
    }
}

/// The chains of a port of `class` under `mode`, in istiod's order.
pub(super) fn options(class: Class, mode: MtlsMode) -> &'static [ChainOption] {
    const HTTP_STRICT: &[ChainOption] = &[option(&[], TLS, true, true)];
    const HTTP_PERMISSIVE: &[ChainOption] = &[
        option(ALL_MTLS_ALPN, TLS, true, true),
        option(&[], RAW, true, false),
    ];
    const HTTP_PLAINTEXT: &[ChainOption] = &[option(&[], RAW, true, false)];
    const TCP_STRICT: &[ChainOption] = &[option(&[], TLS, false, true)];
    const TCP_PERMISSIVE: &[ChainOption] = &[
        option(ALL_MTLS_ALPN, TLS, false, true),
        option(&[], TLS, false, false),
        option(&[], RAW, false, false),
    ];
    const TCP_PLAINTEXT: &[ChainOption] = &[option(&[], RAW, false, false)];
    const AUTO_STRICT: &[ChainOption] = &[
        option(MTLS_HTTP_ALPN, TLS, true, true),
        option(&[], TLS, false, true),
    ];
    const AUTO_PERMISSIVE: &[ChainOption] = &[
        option(MTLS_HTTP_ALPN, TLS, true, true),
        option(PLAINTEXT_HTTP_ALPN, RAW, true, false),
        option(MTLS_TCP_ALPN, TLS, false, true),
        option(&[], RAW, false, false),
        option(&[], TLS, false, false),
    ];
    const AUTO_PLAINTEXT: &[ChainOption] = &[
        option(PLAINTEXT_HTTP_ALPN, RAW, true, false),
        option(&[], RAW, false, false),
    ];
    match (class, mode) {
        (Class::Http, MtlsMode::Strict) => HTTP_STRICT,
        (Class::Http, MtlsMode::Permissive | MtlsMode::Unset) => HTTP_PERMISSIVE,
        (Class::Http, MtlsMode::Disable) => HTTP_PLAINTEXT,
        (Class::Tcp, MtlsMode::Strict) => TCP_STRICT,
        (Class::Tcp, MtlsMode::Permissive | MtlsMode::Unset) => TCP_PERMISSIVE,
        (Class::Tcp, MtlsMode::Disable) => TCP_PLAINTEXT,
        (Class::Auto, MtlsMode::Strict) => AUTO_STRICT,
        (Class::Auto, MtlsMode::Permissive | MtlsMode::Unset) => AUTO_PERMISSIVE,
        (Class::Auto, MtlsMode::Disable) => AUTO_PLAINTEXT,
    }
}

impl ChainOption {
    /// The match, on `port` (None: any port).
    pub(super) fn matching(&self, port: Option<u16>) -> FilterChainMatch {
        FilterChainMatch {
            destination_port: port.map(|p| UInt32Value {
                value: u32::from(p),
            }),
            transport_protocol: self.transport.to_string(),
            application_protocols: self.alpn.iter().map(|a| a.to_string()).collect(),
            ..Default::default()
        }
    }

    /// The workload's mTLS server, where the chain terminates it.
    pub(super) fn socket(
        &self,
        trust_domains: &[String],
        mesh_mtls: &TlsConfig,
    ) -> Option<TransportSocket> {
        self.mtls.then(|| {
            let alpn = match self.http {
                true => tls::INBOUND_HTTP_ALPN,
                false => tls::INBOUND_TCP_ALPN,
            };
            tls::inbound_socket(trust_domains, alpn, mesh_mtls)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permissive_passthrough_has_istiods_five_chains() {
        let chains = options(Class::Auto, MtlsMode::Permissive);
        assert_eq!(chains.len(), 5);
        // Every transport and ALPN combination reaches exactly one chain: mTLS is terminated
        // whether the client speaks HTTP or TCP, and TLS without Istio's ALPN passes through.
        assert_eq!(chains.iter().filter(|c| c.mtls).count(), 2);
        assert!(chains
            .iter()
            .any(|c| c.transport == TLS && c.alpn.is_empty() && !c.mtls));
    }

    #[test]
    fn strict_never_accepts_plaintext() {
        for class in [Class::Http, Class::Tcp, Class::Auto] {
            assert!(options(class, MtlsMode::Strict)
                .iter()
                .all(|c| c.transport == TLS && c.mtls));
        }
    }

    #[test]
    fn disable_never_terminates_tls() {
        for class in [Class::Http, Class::Tcp, Class::Auto] {
            assert!(options(class, MtlsMode::Disable)
                .iter()
                .all(|c| c.transport == RAW && !c.mtls));
        }
    }
}
