//! What the bench harnesses share: meshpilot as a child process on test API servers (`plane`), and
//! simulated proxies' ADS streams (`ads`).

pub mod ads;
pub mod plane;
