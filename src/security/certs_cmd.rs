//! `meshpilot certs`: a shared root and per-cluster intermediates in Istio's cacerts layout, so
//! several clusters' control planes issue certificates that verify each other (as Istio's
//! tools/certs), and workload certificates from such a bundle for tests and bootstrapping.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Subcommand};

use super::ca::{
    write_private, CaBundle, CaError, CertificateAuthority, TtlPolicy, CA_KEY, ROOT_CERT,
};
use super::identity::Identity;

const ROOT_KEY: &str = "root-key.pem";
const WORKLOAD_KEY: &str = "key.pem";

#[derive(Debug, Clone, Args)]
pub struct CertsArgs {
    #[command(subcommand)]
    pub command: CertsCommand,
    /// Replace key files that exist already (their certificates stop verifying what they signed).
    #[arg(long, global = true)]
    pub force: bool,
}

#[derive(Debug, Clone, Subcommand)]
pub enum CertsCommand {
    /// A new root CA: root-cert.pem and root-key.pem.
    Root {
        #[arg(long)]
        out: PathBuf,
        /// Organization of the root (the trust domain, by convention).
        #[arg(long, default_value = "cluster.local")]
        organization: String,
    },
    /// An intermediate CA for one cluster, in the cacerts layout meshpilot's --ca-dir (and istiod) read.
    Intermediate {
        /// Directory of the root (from `certs root`).
        #[arg(long)]
        root: PathBuf,
        /// Cluster the intermediate is for.
        #[arg(long)]
        name: String,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value = "cluster.local")]
        organization: String,
        #[arg(long, default_value = "3650days", value_parser = humantime::parse_duration)]
        lifetime: Duration,
    },
    /// A workload certificate and key: cert-chain.pem, key.pem, root-cert.pem.
    Workload {
        /// A cacerts directory (from `certs intermediate`).
        #[arg(long)]
        ca_dir: PathBuf,
        #[arg(long)]
        namespace: String,
        #[arg(long)]
        service_account: String,
        #[arg(long, default_value = "cluster.local")]
        trust_domain: String,
        #[arg(long, default_value = "24h", value_parser = humantime::parse_duration)]
        ttl: Duration,
        #[arg(long)]
        out: PathBuf,
    },
}

pub fn run(args: &CertsArgs) -> Result<String, CaError> {
    // The key each command writes.
    let key = match &args.command {
        CertsCommand::Root { out, .. } => out.join(ROOT_KEY),
        CertsCommand::Intermediate { out, .. } => out.join(CA_KEY),
        CertsCommand::Workload { out, .. } => out.join(WORKLOAD_KEY),
    };
    if !args.force && key.exists() {
        return Err(CaError::KeyExists {
            path: key.display().to_string(),
        });
    }
    match &args.command {
        CertsCommand::Root { out, organization } => {
            let bundle = CaBundle::self_signed_root(organization, super::ca::ROOT_LIFETIME)?;
            write(
                out,
                &[(ROOT_CERT, &bundle.root_cert), (ROOT_KEY, &bundle.ca_key)],
            )?;
            Ok(format!("root CA written to {}", out.display()))
        }
        CertsCommand::Intermediate {
            root,
            name,
            out,
            organization,
            lifetime,
        } => {
            let read = |file: &str| {
                std::fs::read_to_string(root.join(file)).map_err(|source| CaError::Read {
                    file: root.join(file).display().to_string(),
                    source,
                })
            };
            let root_cert = read(ROOT_CERT)?;
            let root_bundle = CaBundle {
                ca_cert: root_cert.clone(),
                ca_key: read(ROOT_KEY)?,
                cert_chain: root_cert.clone(),
                root_cert,
            };
            let intermediate = root_bundle.intermediate(organization, name, *lifetime)?;
            // Refuse to write a bundle meshpilot would refuse to load.
            CertificateAuthority::new(&intermediate, policy(*lifetime))?;
            intermediate.write_dir(out)?;
            Ok(format!(
                "intermediate CA for {name} written to {}",
                out.display()
            ))
        }
        CertsCommand::Workload {
            ca_dir,
            namespace,
            service_account,
            trust_domain,
            ttl,
            out,
        } => {
            let ca = CertificateAuthority::new(&CaBundle::read_dir(ca_dir)?, policy(*ttl))?;
            let identity = Identity::new(trust_domain, namespace, service_account);
            let (chain, key) = ca.issue_workload(&identity, *ttl)?;
            write(
                out,
                &[
                    ("cert-chain.pem", &chain.concat()),
                    (WORKLOAD_KEY, &key),
                    (ROOT_CERT, ca.root_pem()),
                ],
            )?;
            Ok(format!(
                "certificate for {identity} written to {}",
                out.display()
            ))
        }
    }
}

fn policy(ttl: Duration) -> TtlPolicy {
    TtlPolicy {
        default: ttl,
        max: ttl,
    }
}

fn write(dir: &std::path::Path, files: &[(&str, &str)]) -> Result<(), CaError> {
    let error = |source| CaError::Write {
        dir: dir.display().to_string(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(error)?;
    for (name, text) in files {
        let path = dir.join(name);
        if [ROOT_KEY, CA_KEY, WORKLOAD_KEY].contains(name) {
            write_private(&path, text)
        } else {
            std::fs::write(path, text)
        }
        .map_err(error)?;
    }
    Ok(())
}
