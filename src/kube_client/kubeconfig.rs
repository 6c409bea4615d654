//! Kubeconfigs from remote-cluster Secrets are untrusted input: anything that would make meshpilot
//! run a program or read a local file is refused unless explicitly allowed, as istiod does.

use std::collections::BTreeSet;
use std::str::FromStr;

use kube::config::{KubeConfigOptions, Kubeconfig};
use thiserror::Error;

use crate::text::{clip, Quoted};

#[derive(Debug, Error)]
pub enum KubeconfigError {
    #[error("kubeconfig is not UTF-8")]
    NotUtf8,
    #[error("kubeconfig does not parse: {0}")]
    Parse(String),
    #[error("kubeconfig user {} uses {option}, which is not allowed (allow with --insecure-kubeconfig-options {flag})", Quoted(.user))]
    Forbidden {
        user: String,
        option: &'static str,
        flag: &'static str,
    },
    #[error("kubeconfig cluster {} reads its CA from a file, which is not allowed (allow with --insecure-kubeconfig-options certificateAuthority)", Quoted(.cluster))]
    CaFile { cluster: String },
    #[error("kubeconfig is unusable: {0}")]
    Config(String),
    #[error("cannot build a client from the kubeconfig: {0}")]
    Client(String),
}

/// Options a kubeconfig may use only when listed in `--insecure-kubeconfig-options`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InsecureOptions(BTreeSet<String>);

const KNOWN: [&str; 6] = [
    "exec",
    "authProvider",
    "tokenFile",
    "clientCertificate",
    "clientKey",
    "certificateAuthority",
];

impl FromStr for InsecureOptions {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let mut set = BTreeSet::new();
        for option in s.split(',').map(str::trim).filter(|o| !o.is_empty()) {
            if !KNOWN.contains(&option) {
                return Err(format!(
                    "unknown kubeconfig option {option:?} (known: {})",
                    KNOWN.join(", ")
                ));
            }
            set.insert(option.to_string());
        }
        Ok(Self(set))
    }
}

impl InsecureOptions {
    fn allows(&self, option: &str) -> bool {
        self.0.contains(option)
    }
}

/// Parses and vets an untrusted kubeconfig.
pub fn parse_untrusted(
    bytes: &[u8],
    allowed: &InsecureOptions,
) -> Result<Kubeconfig, KubeconfigError> {
    let text = std::str::from_utf8(bytes).map_err(|_| KubeconfigError::NotUtf8)?;
    crate::yaml::check_aliases(text).map_err(|e| KubeconfigError::Parse(e.to_string()))?;
    let config =
        Kubeconfig::from_yaml(text).map_err(|e| KubeconfigError::Parse(clip(&e.to_string())))?;
    for named in &config.auth_infos {
        let Some(user) = &named.auth_info else {
            continue;
        };
        let checks: [(bool, &'static str, &'static str); 5] = [
            (user.exec.is_some(), "an exec plugin", "exec"),
            (
                user.auth_provider.is_some(),
                "an auth-provider plugin",
                "authProvider",
            ),
            (user.token_file.is_some(), "a token file", "tokenFile"),
            (
                user.client_certificate.is_some(),
                "a client certificate file",
                "clientCertificate",
            ),
            (user.client_key.is_some(), "a client key file", "clientKey"),
        ];
        for (present, option, flag) in checks {
            if present && !allowed.allows(flag) {
                return Err(KubeconfigError::Forbidden {
                    user: named.name.clone(),
                    option,
                    flag,
                });
            }
        }
    }
    for named in &config.clusters {
        let file_ca = named
            .cluster
            .as_ref()
            .is_some_and(|c| c.certificate_authority.is_some());
        if file_ca && !allowed.allows("certificateAuthority") {
            return Err(KubeconfigError::CaFile {
                cluster: named.name.clone(),
            });
        }
    }
    Ok(config)
}

/// A client for a vetted kubeconfig's current context.
pub async fn client(config: Kubeconfig) -> Result<kube::Client, KubeconfigError> {
    client_for(client_config(config).await?)
}

/// The client configuration of a vetted kubeconfig's current context (its server, timeouts).
pub async fn client_config(config: Kubeconfig) -> Result<kube::Config, KubeconfigError> {
    kube::Config::from_custom_kubeconfig(config, &KubeConfigOptions::default())
        .await
        .map_err(|e| KubeconfigError::Config(clip(&e.to_string())))
}

/// A client for a configuration `client_config` made (and its caller perhaps bounded).
pub fn client_for(config: kube::Config) -> Result<kube::Client, KubeconfigError> {
    super::build(config).map_err(|e| KubeconfigError::Client(clip(&e.to_string())))
}

/// Why kube could not read or use a kubeconfig, in one line: a file that cannot be read is named
/// by the caller, so only the I/O cause is kept (kube's own message repeats the path, quoted twice).
pub fn reason(error: &kube::config::KubeconfigError) -> String {
    match error {
        kube::config::KubeconfigError::ReadConfig(io, _) => io.to_string(),
        other => clip(&other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: 'https://127.0.0.1:6443'}}]
contexts: [{name: c, context: {cluster: c, user: u}}]
current-context: c
users: [{name: u, user: USER}]
";

    fn with_user_text(user: &str) -> String {
        BASE.replace("USER", user)
    }

    fn with_user(user: &str) -> Vec<u8> {
        with_user_text(user).into_bytes()
    }

    #[test]
    fn token_kubeconfig_is_accepted() {
        assert!(parse_untrusted(&with_user("{token: abc}"), &InsecureOptions::default()).is_ok());
    }

    #[test]
    fn plugins_and_file_paths_are_refused_unless_allowed() {
        let exec =
            with_user("{exec: {command: /bin/sh, apiVersion: client.authentication.k8s.io/v1}}");
        let err = parse_untrusted(&exec, &InsecureOptions::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("exec plugin") && err.contains("user \"u\""),
            "{err}"
        );
        assert!(parse_untrusted(&exec, &"exec".parse().unwrap()).is_ok());
        let token_file = with_user("{tokenFile: /var/run/secrets/token}");
        assert!(parse_untrusted(&token_file, &InsecureOptions::default())
            .unwrap_err()
            .to_string()
            .contains("token file"));
        let cert = with_user("{client-certificate: /etc/cert.pem, client-key: /etc/key.pem}");
        assert!(parse_untrusted(&cert, &InsecureOptions::default()).is_err());
        let ca_file = BASE
            .replace(
                "server: 'https://127.0.0.1:6443'",
                "server: 'https://x', certificate-authority: /etc/ca.pem",
            )
            .replace("USER", "{token: a}");
        assert!(matches!(
            parse_untrusted(ca_file.as_bytes(), &InsecureOptions::default()),
            Err(KubeconfigError::CaFile { .. })
        ));
    }

    #[test]
    fn a_kubeconfig_whose_aliases_multiply_is_refused() {
        let mut bomb = format!("{}l0: &l0 [x, x, x, x]\n", with_user_text("{token: a}"));
        for level in 1..12 {
            let aliases = vec![format!("*l{}", level - 1); 4].join(", ");
            bomb.push_str(&format!("l{level}: &l{level} [{aliases}]\n"));
        }
        let err = parse_untrusted(bomb.as_bytes(), &InsecureOptions::default()).unwrap_err();
        assert!(matches!(err, KubeconfigError::Parse(_)), "{err}");
        assert!(err.to_string().contains("aliases"), "{err}");
    }

    #[test]
    fn malformed_kubeconfig_is_a_parse_error() {
        assert!(matches!(
            parse_untrusted(b"clusters: [", &InsecureOptions::default()),
            Err(KubeconfigError::Parse(_))
        ));
        assert!(matches!(
            parse_untrusted(&[0xff, 0xfe], &InsecureOptions::default()),
            Err(KubeconfigError::NotUtf8)
        ));
        assert!("exec,bogus".parse::<InsecureOptions>().is_err());
    }
}
