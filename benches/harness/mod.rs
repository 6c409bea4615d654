//! What the bench harnesses share: meshpilot as a child process on test API servers (`plane`),
//! simulated proxies' ADS streams (`ads`), the naive fan-out server every figure is set beside
//! (`naive`), and rounds of one change timed at every client (`rounds`).

pub mod ads;
pub mod naive;
pub mod plane;
pub mod rounds;

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
