//! What the bench harnesses share: meshpilot as a child process on test API servers (`plane`),
//! simulated proxies' ADS streams (`ads`), the naive fan-out server every figure is set beside
//! (`naive`, with its codec `naive_codec`), and rounds of one change timed at every client
//! (`rounds`).

pub mod ads;
pub mod naive;
pub mod naive_codec;
pub mod plane;
pub mod rounds;

/// Whether the bench binary was started as the naive anchor's child process: then it has served as
/// the anchor until its stdin closed.
pub fn ran_as_naive_anchor() -> bool {
    if std::env::args().nth(1).as_deref() != Some(naive::SUBCOMMAND) {
        return false;
    }
    let path = std::env::args().nth(2).expect("resources file");
    naive::serve(&path);
    true
}

/// One row of a meshpilot/naive table: the figure, both values and their ratio (none when the
/// naive value is below what can be measured).
pub fn print_row(figure: &str, (meshpilot, naive): (f64, f64), unit: &str) {
    let ratio = match naive > 1e-6 {
        true => format!("{:.2}", meshpilot / naive),
        false => "–".to_string(),
    };
    println!("| {figure} | {meshpilot:.3} {unit} | {naive:.3} {unit} | {ratio} |");
}

/// Runs a harness's scenarios: prints the machine's cores (every figure is read against them),
/// then drives `scenarios` on a multi-threaded runtime with rustls' ring provider installed.
pub fn run(scenarios: impl std::future::Future<Output = ()>) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    println!(
        "machine: {} cores",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    runtime.block_on(async {
        let _ = rustls::crypto::ring::default_provider().install_default();
        scenarios.await
    });
}
