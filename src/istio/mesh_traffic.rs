//! The mesh config's settings for what every proxy is sent (istio.io/api mesh/v1alpha1
//! `MeshConfig`): path normalization, inbound mTLS parameters and the cluster stat name patterns.

use serde::{Deserialize, Serialize};

use super::tls_names;
use super::validate::{ensure, Result, ValidationError};

/// `pathNormalization`: how request paths are normalised before routes and policies see them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct PathNormalization {
    pub normalization: Normalization,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Normalization {
    /// BASE, as istiod reads it.
    #[default]
    Default,
    None,
    Base,
    MergeSlashes,
    DecodeAndMergeSlashes,
}

/// `inboundTrafficPolicy`: where a sidecar delivers inbound traffic.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct InboundTrafficPolicy {
    pub mode: InboundMode,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum InboundMode {
    /// To the address the connection was for (the pod's own).
    #[default]
    Passthrough,
    /// To the workload on localhost.
    Localhost,
}

/// One of `caCertificates`: a root beyond the mesh's own, and the trust domains it vouches for.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct CertificateData {
    pub pem: String,
    pub spiffe_bundle_url: String,
    pub cert_signers: Vec<String>,
    pub trust_domains: Vec<String>,
}

impl CertificateData {
    /// What of the entry is not applied. istiod distributes extra roots to proxies only when run
    /// with `ISTIO_MULTIROOT_MESH=true`, off by default (pilot/pkg/bootstrap/server.go
    /// `initWorkloadTrustBundle`): meshpilot with `--multiroot-mesh`. `certSigners` is read only
    /// for a Kubernetes CSR signer.
    pub fn unapplied_parts(&self, roots_distributed: bool) -> Vec<(&'static str, &'static str)> {
        let mut out = Vec::new();
        if !roots_distributed && (!self.pem.is_empty() || !self.spiffe_bundle_url.is_empty()) {
            out.push((
                "root",
                "not applied: extra roots reach proxies only with --multiroot-mesh (istiod: ISTIO_MULTIROOT_MESH=true, off by default); its trustDomains are accepted",
            ));
        }
        if !self.cert_signers.is_empty() {
            out.push((
                "certSigners",
                "not applied: meshpilot signs with its own CA, not a Kubernetes CSR signer",
            ));
        }
        out
    }

    /// `pem` and `spiffeBundleUrl` are one of (istio.io/api `CertificateData.certificate_data`);
    /// a PEM holds CA certificates only; a URL is an https:// one (istiod adds the scheme when
    /// none is written: pkg/spiffe/spiffe.go `RetrieveSpiffeBundleRootCerts`).
    pub fn validate(&self) -> Result {
        ensure(
            self.pem.is_empty() || self.spiffe_bundle_url.is_empty(),
            "pem",
            "pem and spiffeBundleUrl are one of: give either",
        )?;
        if !self.pem.is_empty() {
            super::trust_anchor::ca_certificates(&self.pem)
                .map_err(|e| ValidationError::at("pem", crate::text::clip(&e)))?;
        }
        if !self.spiffe_bundle_url.is_empty() {
            let url = self.bundle_url();
            let parsed = url.parse::<http::Uri>();
            ensure(
                parsed.is_ok_and(|u| u.host().is_some_and(|h| !h.is_empty())),
                "spiffeBundleUrl",
                format!("{}: not an https URL", crate::text::clip(&url)),
            )?;
        }
        Ok(())
    }

    /// The SPIFFE bundle endpoint, https:// added when no scheme is written, as istiod does.
    pub fn bundle_url(&self) -> String {
        match self.spiffe_bundle_url.starts_with("https://") {
            true => self.spiffe_bundle_url.clone(),
            false => format!("https://{}", self.spiffe_bundle_url),
        }
    }
}

/// `meshMTLS` (and `tlsDefaults`): Istio's `MeshConfig.TLSConfig`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct TlsConfig {
    pub min_protocol_version: TlsVersion,
    pub ecdh_curves: Vec<String>,
    pub cipher_suites: Vec<String>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
pub enum TlsVersion {
    #[default]
    #[serde(rename = "TLS_AUTO")]
    Auto,
    #[serde(rename = "TLSV1_2")]
    V1_2,
    #[serde(rename = "TLSV1_3")]
    V1_3,
}

impl TlsConfig {
    /// As istiod's validation of `meshMTLS` (pkg/config/validation): curves are not configurable
    /// for mesh mTLS.
    pub fn validate_mesh_mtls(&self) -> Result {
        ensure(
            self.ecdh_curves.is_empty(),
            "ecdhCurves",
            "is not configurable for mesh mTLS",
        )?;
        self.validate_names()
    }

    /// A cipher suite or curve Envoy does not know would have every listener or cluster it lands
    /// on refused by the proxies: istiod drops them (`FilterCipherSuites`) or warns; refusing
    /// names them instead, the last good mesh config kept. An expression starting with an
    /// operator (`-`, `+`, `!`, `[`) is BoringSSL's and passes, as in istiod.
    pub fn validate_names(&self) -> Result {
        for (i, suite) in self.cipher_suites.iter().enumerate() {
            ensure(
                tls_names::known_cipher_suite(suite),
                &format!("cipherSuites[{i}]"),
                format!(
                    "{:?} is not a cipher suite Envoy knows",
                    crate::text::clip(suite)
                ),
            )?;
        }
        for (i, curve) in self.ecdh_curves.iter().enumerate() {
            ensure(
                tls_names::known_ecdh_curve(curve),
                &format!("ecdhCurves[{i}]"),
                format!(
                    "{:?} is not an ECDH curve Envoy knows",
                    crate::text::clip(curve)
                ),
            )?;
        }
        Ok(())
    }
}

/// A service as the stat name patterns read it (istiod's `telemetry.BuildStatPrefix`,
/// pilot/pkg/networking/telemetry/telemetry.go).
pub struct StatNameParts<'a> {
    pub hostname: &'a str,
    /// A Kubernetes Service's name and namespace; None for other registries.
    pub kubernetes: Option<(&'a str, &'a str)>,
    pub subset: &'a str,
    pub port: u16,
    pub port_name: &'a str,
    /// The inbound cluster's port; 0 outbound.
    pub target_port: u16,
}

/// `inboundClusterStatName` / `outboundClusterStatName` with their variables replaced, in
/// istiod's order.
pub fn stat_name(pattern: &str, parts: &StatNameParts<'_>) -> String {
    let (service, name) = match parts.kubernetes {
        Some((name, namespace)) => (format!("{name}.{namespace}"), name.to_string()),
        None => (parts.hostname.to_string(), parts.hostname.to_string()),
    };
    pattern
        .replace("%SERVICE%", &service)
        .replace("%SERVICE_NAME%", &name)
        .replace("%SERVICE_FQDN%", parts.hostname)
        .replace("%SUBSET_NAME%", parts.subset)
        .replace("%TARGET_PORT%", &parts.target_port.to_string())
        .replace("%SERVICE_PORT%", &parts.port.to_string())
        .replace("%SERVICE_PORT_NAME%", parts.port_name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_names_as_istiod_builds_them() {
        let parts = StatNameParts {
            hostname: "web.shop.svc.cluster.local",
            kubernetes: Some(("web", "shop")),
            subset: "v1",
            port: 80,
            port_name: "http",
            target_port: 0,
        };
        assert_eq!(
            stat_name("%SERVICE%_%SERVICE_PORT_NAME%_%SERVICE_PORT%", &parts),
            "web.shop_http_80"
        );
        assert_eq!(
            stat_name("%SERVICE_FQDN%|%SUBSET_NAME%|%SERVICE_NAME%", &parts),
            "web.shop.svc.cluster.local|v1|web"
        );
        let entry = StatNameParts {
            kubernetes: None,
            hostname: "api.example.com",
            ..parts
        };
        assert_eq!(stat_name("%SERVICE%", &entry), "api.example.com");
    }

    #[test]
    fn mesh_tls_reads_istios_names() {
        let tls: TlsConfig =
            serde_yaml_ng::from_str("{minProtocolVersion: TLSV1_3, cipherSuites: [AES128-SHA]}")
                .unwrap();
        assert_eq!(tls.min_protocol_version, TlsVersion::V1_3);
        assert!(tls.validate_mesh_mtls().is_ok());
        let curves: TlsConfig = serde_yaml_ng::from_str("{ecdhCurves: [P-256]}").unwrap();
        assert!(curves.validate_mesh_mtls().is_err());
        assert!(curves.validate_names().is_ok());
        let unknown: TlsConfig =
            serde_yaml_ng::from_str("{cipherSuites: [AES128-SHA, RC4-MD5], ecdhCurves: [P-999]}")
                .unwrap();
        let error = unknown.validate_names().unwrap_err().to_string();
        assert!(
            error.contains("cipherSuites[1]") && error.contains("RC4-MD5"),
            "{error}"
        );
        let expression: TlsConfig =
            serde_yaml_ng::from_str("{cipherSuites: ['[AES128-SHA|AES256-SHA]', ALL]}").unwrap();
        assert!(expression.validate_names().is_ok());
    }

    #[test]
    fn extra_roots_are_not_applied_without_multiroot_their_trust_domains_always() {
        let entry: CertificateData =
            serde_yaml_ng::from_str("{pem: abc, trustDomains: [partner.example]}").unwrap();
        let parts: Vec<&str> = entry.unapplied_parts(false).iter().map(|p| p.0).collect();
        assert_eq!(parts, ["root"]);
        assert!(entry.unapplied_parts(true).is_empty());
        let domains_only: CertificateData =
            serde_yaml_ng::from_str("{trustDomains: [partner.example]}").unwrap();
        assert!(domains_only.unapplied_parts(false).is_empty());
    }

    #[test]
    fn a_root_is_a_ca_pem_or_a_bundle_url_not_both() {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let root = params
            .self_signed(&rcgen::KeyPair::generate().unwrap())
            .unwrap()
            .pem();
        let entry = |pem: &str, url: &str| CertificateData {
            pem: pem.into(),
            spiffe_bundle_url: url.into(),
            ..Default::default()
        };
        assert!(entry(&root, "").validate().is_ok());
        assert!(entry("", "bundle.example:8443/bundle").validate().is_ok());
        assert_eq!(
            entry("", "bundle.example/b").bundle_url(),
            "https://bundle.example/b"
        );
        let both = entry(&root, "bundle.example").validate().unwrap_err();
        assert!(both.to_string().contains("one of"), "{both}");
        let junk = entry("abc", "").validate().unwrap_err().to_string();
        assert!(
            junk.contains("pem") && junk.contains("no PEM certificate"),
            "{junk}"
        );
        assert!(entry("", "https:// bad").validate().is_err());
    }
}
