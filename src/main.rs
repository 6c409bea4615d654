use std::io::IsTerminal;

use anyhow::Context;
use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

use meshpilot::compare::CompareArgs;
use meshpilot::config::DiscoveryArgs;
use meshpilot::doctor::{DoctorArgs, OutputFormat};
use meshpilot::inject::offline::InjectCmdArgs;
use meshpilot::install::ManifestArgs;
use meshpilot::remote_secret::RemoteSecretArgs;
use meshpilot::security::certs_cmd::CertsArgs;

/// jemalloc returns freed pages to the system as it goes; under churn glibc's heap kept growing
/// (docs/reliability.md, "Memory under churn").
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options (read once at start; `_RJEM_MALLOC_CONF` still overrides them). A background
/// thread returns freed pages after the decay time even while the process is idle: without it, the
/// pages a cluster's initial list was decoded in stay resident until the next burst of allocations.
#[export_name = "_rjem_malloc_conf"]
static MALLOC_CONF: &[u8; 23] = b"background_thread:true\0";

#[derive(Parser)]
#[command(
    name = "meshpilot",
    version,
    about = "Multicluster service-mesh control plane"
)]
struct Cli {
    /// Log filter, in tracing's EnvFilter syntax (e.g. `info,meshpilot=debug`).
    #[arg(long, env = "MESHPILOT_LOG", default_value = "info", global = true)]
    log: String,

    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the control plane.
    Discovery(Box<DiscoveryArgs>),
    /// Print the Secret that onboards a remote cluster (as istioctl create-remote-secret).
    RemoteSecret(RemoteSecretArgs),
    /// Generate a shared root, per-cluster intermediates and workload certificates.
    Certs(CertsArgs),
    /// Print the install manifests of a profile (primary, remote, multi-primary, eastwest-gateway).
    Manifest(ManifestArgs),
    /// Inject sidecars into a manifest's pods and pod templates, as the webhook would.
    Inject(Box<InjectCmdArgs>),
    /// Check a multicluster set-up: kubeconfigs, API servers, permissions, cluster ids, networks,
    /// gateways, roots of trust and clocks of the config cluster and every remote Secret.
    Doctor(Box<DoctorArgs>),
    /// Compare what two control planes (live, or dumps of their answers) send one proxy, for what
    /// changes traffic; exit 1 on a difference.
    Compare(CompareArgs),
}

/// An error's message followed by each cause whose text it does not already contain.
fn with_causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(e) = cause {
        let part = e.to_string();
        if !text.contains(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        cause = e.source();
    }
    text
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // A tool reports its own errors in one line; kube's request logs would repeat them raw.
    let mut filter = match (&cli.command, cli.log.contains("kube_client")) {
        (Command::Discovery(_), _) | (_, true) => cli.log.clone(),
        _ => format!("{},kube_client=off", cli.log),
    };
    // The file watcher notes at INFO that it could not drop the watch of a directory that was
    // removed (the kernel already had): nothing for an operator to act on.
    if !cli.log.contains("notify") {
        filter.push_str(",notify=warn");
    }
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_new(&filter).context("invalid --log filter")?)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    match cli.command {
        Command::Discovery(args) => {
            // Faults the tests inject (`FAILPOINTS`); nothing unless built with `failpoints`.
            let _faults = fail::FailScenario::setup();
            let stop = shutdown_signal()?;
            let running = match meshpilot::app::start(*args).await {
                Ok(running) => running,
                // One line: the message, and the causes it does not already say.
                Err(e) => {
                    eprintln!("error: {}", with_causes(&e));
                    std::process::exit(1);
                }
            };
            // A critical task that ended is an error: the process exits non-zero to be restarted.
            running.serve_until(stop).await?;
        }
        Command::Certs(args) => {
            meshpilot::security::install_crypto_provider();
            match meshpilot::security::certs_cmd::run(&args) {
                Ok(done) => eprintln!("{done}"),
                Err(e) => {
                    eprintln!("error: {e}");
                    std::process::exit(1);
                }
            }
        }
        Command::Manifest(args) => match meshpilot::install::generate(&args) {
            Ok(yaml) => out(&yaml),
            Err(e) => {
                eprintln!("error: {e}");
                std::process::exit(1);
            }
        },
        Command::Inject(args) => match meshpilot::inject::offline::run(&args) {
            Ok(yaml) => out(&yaml),
            Err(e) => {
                eprintln!("error: {e}");
                std::process::exit(1);
            }
        },
        Command::Compare(args) => match meshpilot::compare::run(&args).await {
            Ok(report) => {
                match args.output {
                    meshpilot::compare::OutputFormat::Table => out(&report.text()),
                    meshpilot::compare::OutputFormat::Json => {
                        out(&format!("{:#}\n", report.json()))
                    }
                }
                // As diff(1): 1 for a difference, 2 when the comparison could not be made; and 3
                // when there was nothing to compare, which is no pass.
                if report.nothing_compared.is_some() {
                    std::process::exit(3);
                }
                if !report.differences.is_empty() {
                    std::process::exit(1);
                }
            }
            Err(e) => {
                eprintln!("error: {e}");
                std::process::exit(2);
            }
        },
        Command::Doctor(args) => match meshpilot::doctor::run(&args).await {
            Ok(report) => {
                match args.output {
                    OutputFormat::Text => out(&report.text()),
                    OutputFormat::Json => out(&format!("{:#}\n", report.json())),
                }
                if report.failures() > 0 {
                    std::process::exit(1);
                }
            }
            Err(e) => {
                eprintln!("error: {e}");
                std::process::exit(1);
            }
        },
        Command::RemoteSecret(args) => {
            meshpilot::security::install_crypto_provider();
            match meshpilot::remote_secret::generate(&args).await {
                Ok(yaml) => out(&yaml),
                // One line naming cluster, object and verb; the causes' Debug dumps help nobody.
                Err(e) => {
                    eprintln!("error: {e}");
                    std::process::exit(1);
                }
            }
        }
    }
    Ok(())
}

/// Writes a command's output. A reader that stops early (`| head`) ends the writing quietly, as
/// Unix tools do, instead of a panic.
fn out(text: &str) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    if let Err(e) = stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            eprintln!("error: writing the output: {e}");
            std::process::exit(1);
        }
    }
}

/// Resolves at SIGTERM or Ctrl-C. The handlers are installed at once, so a signal that arrives
/// while starting is not lost.
fn shutdown_signal() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    Ok(async move {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    })
}
