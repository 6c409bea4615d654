//! Typed configuration of `meshpilot discovery`: every flag also settable by environment variable.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Args;

use crate::inject::InjectArgs;
use crate::kube_client::kubeconfig::InsecureOptions;
use crate::model::MeshNaming;
use crate::security::rotation::RotationPolicy;
use crate::xds::server::XdsOptions;

#[derive(Debug, Clone, Args)]
pub struct DiscoveryArgs {
    /// Directory holding `clusters/<cluster-id>/*.yaml` (file-backed clusters).
    #[arg(long, env = "MESHPILOT_CONFIG_DIR")]
    pub config_dir: Option<PathBuf>,

    /// Mesh config YAML (the `mesh` key of Istio's `istio` ConfigMap); watched.
    #[arg(long, env = "MESHPILOT_MESH_CONFIG")]
    pub mesh_config: Option<PathBuf>,

    /// Istio MeshNetworks YAML (networks, their endpoints and gateways); watched.
    #[arg(long, env = "MESHPILOT_MESH_NETWORKS")]
    pub mesh_networks: Option<PathBuf>,

    /// Kubeconfig of the config (primary) cluster.
    #[arg(long, env = "MESHPILOT_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

    /// Use the pod's service account to reach the config cluster.
    #[arg(long, env = "MESHPILOT_IN_CLUSTER", conflicts_with = "kubeconfig")]
    pub in_cluster: bool,

    /// Cluster id of the config cluster (Istio's CLUSTER_ID).
    #[arg(long, env = "MESHPILOT_CLUSTER_ID", default_value = "Kubernetes")]
    pub cluster_id: String,

    /// How long readiness waits for a remote cluster to sync (`0s`: forever).
    #[arg(long, env = "MESHPILOT_REMOTE_CLUSTER_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub remote_cluster_timeout: Duration,

    /// Kubeconfig options remote-cluster Secrets may use although they run programs or read local
    /// files: comma-separated among exec, authProvider, tokenFile, clientCertificate, clientKey,
    /// certificateAuthority.
    #[arg(
        long,
        env = "MESHPILOT_INSECURE_KUBECONFIG_OPTIONS",
        default_value = ""
    )]
    pub insecure_kubeconfig_options: InsecureOptions,

    /// Plug-in CA bundle in Istio's cacerts layout (ca-cert.pem, ca-key.pem, cert-chain.pem, root-cert.pem).
    #[arg(long, env = "MESHPILOT_CA_DIR")]
    pub ca_dir: Option<PathBuf>,

    /// Where state is kept across restarts: remote clusters' last-known-good snapshots (`remotes/`),
    /// allocated ServiceEntry addresses and, without Kubernetes or --ca-dir, the self-signed root
    /// (`ca/`); one per mesh [default: $XDG_STATE_HOME/meshpilot (else ~/.local/state/meshpilot),
    /// in a subdirectory named after the config dir when there is one, else after the config
    /// cluster (its API server and CA); never inside the config dir unless no home is known].
    #[arg(long, env = "MESHPILOT_STATE_DIR")]
    pub state_dir: Option<PathBuf>,

    /// Where the self-signed root is kept, if not `<state-dir>/ca`.
    #[arg(long, env = "MESHPILOT_CA_STATE_DIR")]
    pub ca_state_dir: Option<PathBuf>,

    /// How old a remote cluster's last-known-good snapshot may be and still be served (marked
    /// stale) after a restart while its API server is unreachable; `0s` keeps no snapshots.
    #[arg(long, env = "MESHPILOT_STALE_REMOTE_MAX_AGE", default_value = "1h", value_parser = humantime::parse_duration)]
    pub stale_remote_max_age: Duration,

    /// Lifetime of a self-signed root, made or renewed (istiod's CITADEL_SELF_SIGNED_CA_CERT_TTL).
    #[arg(long, env = "MESHPILOT_SELF_SIGNED_ROOT_TTL", default_value = "3650days", value_parser = humantime::parse_duration)]
    pub self_signed_root_ttl: Duration,

    /// How often the self-signed root's remaining lifetime is checked.
    #[arg(long, env = "MESHPILOT_SELF_SIGNED_ROOT_CHECK_INTERVAL", default_value = "1h", value_parser = humantime::parse_duration)]
    pub self_signed_root_check_interval: Duration,

    /// The self-signed root is renewed once less than this share (percent) of its lifetime is left.
    #[arg(long, env = "MESHPILOT_SELF_SIGNED_ROOT_GRACE_PERCENT", default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..100))]
    pub self_signed_root_grace_percent: u32,

    /// Lifetime of workload certificates when the request names none.
    #[arg(long, env = "MESHPILOT_WORKLOAD_CERT_TTL", default_value = "24h", value_parser = humantime::parse_duration)]
    pub workload_cert_ttl: Duration,

    /// Longest workload certificate lifetime a request may ask for.
    #[arg(long, env = "MESHPILOT_MAX_WORKLOAD_CERT_TTL", default_value = "90days", value_parser = humantime::parse_duration)]
    pub max_workload_cert_ttl: Duration,

    /// Node proxies (ztunnel) that may ask for the certificates of pods on their node, as
    /// `namespace/serviceaccount` entries separated by commas (istiod's CA_TRUSTED_NODE_ACCOUNTS;
    /// Istio's ambient install sets `istio-system/ztunnel`). None by default.
    #[arg(long, env = "MESHPILOT_CA_TRUSTED_NODE_ACCOUNTS", default_value = "", value_parser = trusted_node_accounts)]
    pub ca_trusted_node_accounts: TrustedNodeAccounts,

    /// Lifetime of the secure xDS server's own certificate; it is renewed at half of it.
    #[arg(long, env = "MESHPILOT_SERVING_CERT_TTL", default_value = "24h", value_parser = humantime::parse_duration)]
    pub serving_cert_ttl: Duration,

    /// Extra DNS names of the secure xDS server's certificate (besides istiod.<system-namespace>.svc).
    #[arg(long, env = "MESHPILOT_XDS_DNS_NAMES", value_delimiter = ',')]
    pub xds_dns_names: Vec<String>,

    /// Admin HTTP server: /ready, /healthz, /metrics, /debug/*.
    #[arg(long, env = "MESHPILOT_HTTP_ADDR", default_value = "127.0.0.1:15014")]
    pub http_addr: SocketAddr,

    /// Besides the system namespace, namespaces whose service accounts may read the admin
    /// server's /debug/* from another host (with a bearer token the config cluster reviews).
    #[arg(long, env = "MESHPILOT_DEBUG_NAMESPACES", value_delimiter = ',')]
    pub debug_namespaces: Vec<String>,

    /// Built xDS resources kept for reuse at most; past it the least recently used go (they are
    /// rebuilt when asked for again). Bounds what proxies' self-declared traits can make it hold.
    #[arg(long, env = "MESHPILOT_XDS_CACHE_MAX_ENTRIES", default_value_t = crate::xds::generate::DEFAULT_CACHE_ENTRIES)]
    pub xds_cache_max_entries: usize,

    /// At shutdown (SIGTERM), the time over which connected proxies' streams are closed so they
    /// reconnect to another replica, not all at once. Keep it well inside the pod's grace period.
    #[arg(long, env = "MESHPILOT_DRAIN_DURATION", default_value = "10s", value_parser = humantime::parse_duration)]
    pub drain_duration: Duration,

    /// Serves /debug/* and istioctl's debug xDS types to any caller, authenticated or not. For a
    /// lab only: they show every proxy's configuration.
    #[arg(long, env = "MESHPILOT_INSECURE_OPEN_DEBUG")]
    pub insecure_open_debug: bool,

    /// Serves the accepted Istio config over xDS (MCP, for another control plane) to any caller,
    /// on the plaintext port too. Without it only clients proven in the root namespace on the
    /// secure port read it.
    #[arg(long, env = "MESHPILOT_INSECURE_OPEN_CONFIG")]
    pub insecure_open_config: bool,

    /// Plaintext xDS (ADS) server.
    #[arg(long, env = "MESHPILOT_XDS_ADDR", default_value = "127.0.0.1:15010")]
    pub xds_addr: SocketAddr,

    /// mTLS xDS and certificate-signing server.
    #[arg(
        long,
        env = "MESHPILOT_SECURE_XDS_ADDR",
        default_value = "127.0.0.1:15012"
    )]
    pub secure_xds_addr: SocketAddr,

    /// Kubernetes DNS domain suffix of service hostnames.
    #[arg(long, env = "MESHPILOT_DOMAIN_SUFFIX", default_value = "cluster.local")]
    pub domain_suffix: String,

    /// SPIFFE trust domain of workload identities.
    #[arg(long, env = "MESHPILOT_TRUST_DOMAIN", default_value = "cluster.local")]
    pub trust_domain: String,

    /// Namespace of the control plane in every cluster.
    #[arg(
        long,
        env = "MESHPILOT_SYSTEM_NAMESPACE",
        default_value = "istio-system"
    )]
    pub system_namespace: String,

    /// Namespace of the Gateways made from Kubernetes Ingresses, of the gateways serving them and
    /// of the ingress Service whose addresses their status reports (istiod's K8S_INGRESS_NS).
    #[arg(
        long,
        env = "MESHPILOT_INGRESS_NAMESPACE",
        default_value = "istio-system"
    )]
    pub ingress_namespace: String,

    /// Quiet period before a push (e.g. `100ms`); `0s` pushes every change at once.
    #[arg(long, env = "MESHPILOT_DEBOUNCE_AFTER", default_value = "100ms", value_parser = humantime::parse_duration)]
    pub debounce_after: Duration,

    /// Longest a change waits for the quiet period (e.g. `10s`).
    #[arg(long, env = "MESHPILOT_DEBOUNCE_MAX", default_value = "10s", value_parser = humantime::parse_duration)]
    pub debounce_max: Duration,

    /// Proxies pushed to at once.
    #[arg(long, env = "MESHPILOT_PUSH_CONCURRENCY", default_value_t = 64)]
    pub push_concurrency: usize,

    /// A proxy that reads none of a response for this long loses its stream (it reconnects).
    #[arg(long, env = "MESHPILOT_XDS_SEND_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub xds_send_timeout: Duration,

    /// How long an auto-registered WorkloadEntry outlives its proxy's stream (it may reconnect).
    #[arg(long, env = "MESHPILOT_WORKLOAD_ENTRY_GRACE_PERIOD", default_value = "10s", value_parser = humantime::parse_duration)]
    pub workload_entry_grace_period: Duration,

    /// How often JWT keys of RequestAuthentications (`jwksUri`, OpenID discovery) are fetched again.
    #[arg(long, env = "MESHPILOT_JWKS_REFRESH_INTERVAL", default_value = "20m", value_parser = humantime::parse_duration)]
    pub jwks_refresh_interval: Duration,

    /// Sends proxies the mesh's trust bundle over PCDS: the CA's roots, the mesh config's
    /// `caCertificates` and their SPIFFE bundles' (istiod's `ISTIO_MULTIROOT_MESH`); Istio's agent
    /// asks for it when started with `PROXY_CONFIG_XDS_AGENT=true`.
    #[arg(long, env = "MESHPILOT_MULTIROOT_MESH")]
    pub multiroot_mesh: bool,

    /// How often the mesh config's SPIFFE bundle endpoints are fetched again (istiod: 30 minutes).
    #[arg(long, env = "MESHPILOT_SPIFFE_BUNDLE_REFRESH_INTERVAL", default_value = "30m", value_parser = humantime::parse_duration, requires = "multiroot_mesh")]
    pub spiffe_bundle_refresh_interval: Duration,

    /// How long one SPIFFE bundle fetch may take (istiod: 10 seconds).
    #[arg(long, env = "MESHPILOT_SPIFFE_BUNDLE_FETCH_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration, requires = "multiroot_mesh")]
    pub spiffe_bundle_fetch_timeout: Duration,

    /// How long one JWT key fetch may take.
    #[arg(long, env = "MESHPILOT_JWKS_FETCH_TIMEOUT", default_value = "5s", value_parser = humantime::parse_duration)]
    pub jwks_fetch_timeout: Duration,

    /// An xDS stream that sends no request for this long after opening is closed.
    #[arg(long, env = "MESHPILOT_XDS_FIRST_REQUEST_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub xds_first_request_timeout: Duration,

    /// An xDS stream older than this (±10 % jitter) is ended so proxies rebalance over replicas;
    /// `0s` keeps streams open.
    #[arg(long, env = "MESHPILOT_XDS_MAX_CONNECTION_AGE", default_value = "30m", value_parser = humantime::parse_duration)]
    pub xds_max_connection_age: Duration,

    /// Admission webhook server (sidecar injection, config validation), over TLS. Default:
    /// 127.0.0.1:15017 with a config cluster, none otherwise (no API server calls it).
    #[arg(long, env = "MESHPILOT_WEBHOOK_ADDR")]
    pub webhook_addr: Option<SocketAddr>,

    /// How long the leader's Lease lasts unrenewed before another replica takes over (≥ 1s).
    #[arg(long, env = "MESHPILOT_LEADER_ELECTION_LEASE_DURATION", default_value = "30s", value_parser = at_least_a_second)]
    pub leader_election_lease_duration: Duration,

    /// How long no other control plane may have claimed a Gateway API object before this revision
    /// deploys it or writes its status (≥ 1s): the one letting it go must have stopped first.
    #[arg(long, env = "MESHPILOT_GATEWAY_HANDOVER_DELAY", default_value = "30s", value_parser = at_least_a_second)]
    pub gateway_handover_delay: Duration,

    /// This replica's identity in leader election (the pod name in a Deployment)
    /// [default: host name and process id].
    #[arg(long, env = "MESHPILOT_LEADER_IDENTITY")]
    pub leader_identity: Option<String>,

    #[command(flatten)]
    pub inject: InjectArgs,
}

fn at_least_a_second(text: &str) -> Result<Duration, String> {
    let duration = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    match duration >= Duration::from_secs(1) {
        true => Ok(duration),
        false => Err(format!("{text} is shorter than 1s")),
    }
}

impl DiscoveryArgs {
    /// DNS names of the secure xDS server's certificate, as istiod's (istio/istio
    /// pilot/pkg/bootstrap/server.go getDNSNames): a named revision's Service besides.
    pub fn serving_names(&self) -> Vec<String> {
        let ns = &self.system_namespace;
        let mut names: Vec<String> = ["istiod", "istiod-remote", "istio-pilot"]
            .iter()
            .map(|svc| format!("{svc}.{ns}.svc"))
            .collect();
        let revision = &self.inject.revision;
        if !revision.is_default() {
            names.push(revision.service_host(ns));
        }
        names.extend(self.xds_dns_names.iter().filter(|n| !n.is_empty()).cloned());
        names
    }

    pub fn xds_options(&self) -> XdsOptions {
        XdsOptions {
            push_concurrency: self.push_concurrency,
            send_timeout: self.xds_send_timeout,
            first_request_timeout: self.xds_first_request_timeout,
            max_connection_age: self.xds_max_connection_age,
            open_debug: self.insecure_open_debug,
            open_config: self.insecure_open_config,
            cache_entries: self.xds_cache_max_entries,
        }
    }

    /// Where the admission webhook listens: `--webhook-addr`, else 127.0.0.1:15017 where an API
    /// server can call it (a config cluster); None in file mode, so meshpilots side by side on one
    /// machine do not contend for the port.
    pub fn webhook_addr(&self) -> Option<SocketAddr> {
        let config_cluster = self.kubeconfig.is_some() || self.in_cluster;
        self.webhook_addr
            .or_else(|| config_cluster.then(|| SocketAddr::from(([127, 0, 0, 1], 15017))))
    }

    /// Where state is kept: `--state-dir`, else a place that does not depend on the working
    /// directory (so every run of one installation finds the same state).
    pub fn state_dir(&self) -> Option<PathBuf> {
        self.state_dir.clone().or_else(|| {
            let base = default_state_dir(
                self.config_dir.as_deref(),
                std::env::var_os("XDG_STATE_HOME"),
                std::env::var_os("HOME"),
            )?;
            // Without a config dir, the config cluster tells one mesh's state from another's.
            match self.config_dir {
                Some(_) => Some(base),
                None => match self.config_cluster_identity() {
                    Some(identity) => Some(base.join(format!("cluster-{identity:016x}"))),
                    None => Some(base),
                },
            }
        })
    }

    /// Who the config cluster is, offline: its API server and the CA it is trusted by (a new
    /// cluster at an old address has another CA).
    fn config_cluster_identity(&self) -> Option<u64> {
        let (server, ca) = match (&self.kubeconfig, self.in_cluster) {
            (Some(path), _) => kubeconfig_server_and_ca(path)?,
            (None, true) => {
                let host = std::env::var("KUBERNETES_SERVICE_HOST").ok()?;
                let port = std::env::var("KUBERNETES_SERVICE_PORT").ok()?;
                let ca = std::fs::read(IN_CLUSTER_CA).ok()?;
                (format!("https://{host}:{port}"), ca)
            }
            (None, false) => return None,
        };
        let text = format!("{server}\n{}", String::from_utf8_lossy(&ca));
        Some(crate::text::stable_hash(&text))
    }

    /// Where the self-signed root is kept: `--ca-state-dir`, else `<state-dir>/ca`.
    pub fn ca_state_dir(&self) -> Option<PathBuf> {
        (self.ca_state_dir.clone()).or_else(|| Some(self.state_dir()?.join("ca")))
    }

    pub fn root_rotation(&self) -> RotationPolicy {
        RotationPolicy {
            check_interval: self.self_signed_root_check_interval,
            grace_percent: self.self_signed_root_grace_percent,
            root_ttl: self.self_signed_root_ttl,
        }
    }

    pub fn naming(&self) -> MeshNaming {
        MeshNaming {
            domain_suffix: self.domain_suffix.clone(),
            trust_domain: self.trust_domain.clone(),
            system_namespace: self.system_namespace.clone(),
            cluster_id: crate::model::ClusterId::new(&self.cluster_id),
            multiroot_mesh: self.multiroot_mesh,
        }
    }
}

/// Where a pod's service account CA is mounted.
const IN_CLUSTER_CA: &str = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt";

/// The server and CA bundle of a kubeconfig's current context's cluster.
fn kubeconfig_server_and_ca(path: &Path) -> Option<(String, Vec<u8>)> {
    use base64::Engine;
    let config = kube::config::Kubeconfig::read_from(path).ok()?;
    let context_name = config.current_context.as_deref()?;
    let context = config.contexts.iter().find(|c| c.name == context_name)?;
    let cluster_name = &context.context.as_ref()?.cluster;
    let cluster = config.clusters.iter().find(|c| c.name == *cluster_name)?;
    let cluster = cluster.cluster.as_ref()?;
    let server = cluster.server.clone()?;
    let ca = match (
        &cluster.certificate_authority_data,
        &cluster.certificate_authority,
    ) {
        (Some(data), _) => base64::engine::general_purpose::STANDARD
            .decode(data)
            .unwrap_or_else(|_| data.as_bytes().to_vec()),
        (None, Some(file)) => std::fs::read(file).unwrap_or_default(),
        (None, None) => Vec::new(),
    };
    Some((server, ca))
}

/// The XDG state directory (`$XDG_STATE_HOME`, by default `~/.local/state`) + `meshpilot`, and
/// with a config dir a subdirectory of its own (`<dir name>-<hash of its canonical path>`), so
/// meshes served from different config dirs keep apart and keys stay out of config trees (which
/// are often repositories). Relative values of the variables are ignored, as the XDG spec says;
/// with no home at all, or where earlier releases already keep state, `<config-dir>/.meshpilot`.
fn default_state_dir(
    config_dir: Option<&Path>,
    xdg_state_home: Option<OsString>,
    home: Option<OsString>,
) -> Option<PathBuf> {
    let absolute = |v: OsString| Some(PathBuf::from(v)).filter(|p| p.is_absolute());
    let base = xdg_state_home
        .and_then(absolute)
        .or_else(|| Some(absolute(home?)?.join(".local").join("state")))
        .map(|state| state.join("meshpilot"));
    let Some(dir) = config_dir else {
        return base;
    };
    // Where earlier releases kept state: an installation that has it keeps its root and snapshots.
    let legacy = dir.join(".meshpilot");
    let Some(base) = base.filter(|_| !legacy.is_dir()) else {
        return Some(legacy);
    };
    // One directory, however its path is spelled (`mesh`, `./mesh/`, a symlink to it).
    let dir = dir
        .canonicalize()
        .or_else(|_| std::path::absolute(dir))
        .unwrap_or_else(|_| dir.to_path_buf());
    let name = dir
        .file_name()
        .map(|n| {
            n.to_string_lossy().replace(
                |c: char| !c.is_ascii_alphanumeric() && c != '-' && c != '_',
                "_",
            )
        })
        .unwrap_or_default();
    let hash = crate::text::stable_hash(&dir.to_string_lossy());
    Some(base.join(format!("{name}-{:08x}", hash as u32)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_dir_does_not_follow_the_working_directory() {
        let home = || Some(OsString::from("/home/u"));
        let mesh = default_state_dir(Some(Path::new("/etc/mesh")), None, home()).unwrap();
        assert!(
            mesh.starts_with("/home/u/.local/state/meshpilot"),
            "{mesh:?}"
        );
        assert!(mesh
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("mesh-"));
        let other = default_state_dir(Some(Path::new("/srv/mesh")), None, home()).unwrap();
        assert_ne!(mesh, other, "two config dirs, two state dirs");
        assert_eq!(
            default_state_dir(Some(Path::new("/etc/mesh")), None, None),
            Some(PathBuf::from("/etc/mesh/.meshpilot")),
            "no home: beside the config"
        );
        assert_eq!(
            default_state_dir(None, Some("/var/state".into()), home()),
            Some(PathBuf::from("/var/state/meshpilot"))
        );
        assert_eq!(
            default_state_dir(None, Some("relative".into()), home()),
            Some(PathBuf::from("/home/u/.local/state/meshpilot"))
        );
        assert_eq!(default_state_dir(None, None, None), None);
    }

    #[test]
    fn spiffe_bundle_settings_are_refused_without_multiroot_mesh() {
        use clap::Parser;
        #[derive(Parser)]
        struct Flags {
            #[command(flatten)]
            args: DiscoveryArgs,
        }
        let parse = |flags: &[&str]| Flags::try_parse_from([&["meshpilot"], flags].concat());
        let alone = parse(&["--spiffe-bundle-refresh-interval", "1m"]);
        let error = alone.err().expect("refused").to_string();
        assert!(error.contains("--multiroot-mesh"), "{error}");
        assert!(parse(&["--spiffe-bundle-fetch-timeout", "1s"]).is_err());
        let with = parse(&["--multiroot-mesh", "--spiffe-bundle-fetch-timeout", "1s"]);
        assert_eq!(
            with.ok().unwrap().args.spiffe_bundle_fetch_timeout,
            Duration::from_secs(1)
        );
        assert!(parse(&[]).is_ok(), "the defaults alone need no flag");
    }
}

#[cfg(test)]
mod cluster_state_tests {
    use super::*;
    use clap::Parser;

    fn kubeconfig(dir: &Path, name: &str, server: &str, ca: &str) -> PathBuf {
        use base64::Engine;
        let ca = base64::engine::general_purpose::STANDARD.encode(ca);
        let path = dir.join(name);
        let text = format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: c\nclusters:\n- name: k\n  cluster: {{server: '{server}', certificate-authority-data: {ca}}}\ncontexts:\n- name: c\n  context: {{cluster: k, user: u}}\nusers:\n- name: u\n  user: {{token: t}}\n"
        );
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn each_config_cluster_keeps_its_own_state() {
        let dir = tempfile::tempdir().unwrap();
        #[derive(Parser)]
        struct Flags {
            #[command(flatten)]
            args: DiscoveryArgs,
        }
        let state_of = |path: &Path| {
            let flags = Flags::parse_from(["meshpilot", "--kubeconfig", path.to_str().unwrap()]);
            flags.args.state_dir()
        };
        let first = kubeconfig(dir.path(), "a", "https://127.0.0.1:6443", "CA one");
        let same = kubeconfig(dir.path(), "b", "https://127.0.0.1:6443", "CA one");
        let reborn = kubeconfig(dir.path(), "c", "https://127.0.0.1:6443", "CA two");
        let (first, same, reborn) = (state_of(&first), state_of(&same), state_of(&reborn));
        if first.is_none() {
            return; // No home to keep state in on this machine.
        }
        assert_eq!(first, same, "one cluster, one state directory");
        assert_ne!(first, reborn, "a new cluster at the old address");
        let name = first.unwrap();
        assert!(name.to_string_lossy().contains("cluster-"), "{name:?}");
    }
}

/// Service accounts trusted to ask for other identities (`--ca-trusted-node-accounts`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TrustedNodeAccounts(pub std::collections::BTreeSet<(String, String)>);

fn trusted_node_accounts(text: &str) -> Result<TrustedNodeAccounts, String> {
    crate::security::node_auth::parse_trusted_accounts(text).map(TrustedNodeAccounts)
}
