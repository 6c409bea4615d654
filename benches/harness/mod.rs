//! What the bench harnesses share: meshpilot as a child process on test API servers (`plane`),
//! simulated proxies' ADS streams (`ads`), and the naive fan-out server every figure is set beside
//! (`naive`).

pub mod ads;
pub mod naive;
pub mod plane;
