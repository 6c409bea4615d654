//! Fuzzing every input meshpilot reads from outside: Kubernetes manifests, Istio config, mesh
//! config, meshNetworks, kubeconfigs, Envoy nodes, CSRs, CA bundles and keys, AdmissionReviews,
//! remote-cluster snapshots.
//! Each target feeds its parser mutated realistic inputs and generated ones, and checks that it
//! never panics, never holds more memory than a bound proportional to the input, and refuses with
//! a clear error: non-empty, bounded in length, saying where.
//!
//! `MESHPILOT_FUZZ_CASES` sets the inputs per target (a smoke run by default); see docs/fuzzing.md.

mod admission;
mod alloc;
mod envoy_node;
mod mutate;
mod pki;
mod snapshot;
mod yaml;

use std::cell::Cell;
use std::fmt::Display;
use std::time::Instant;

use proptest::strategy::Strategy;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

#[global_allocator]
static ALLOCATOR: alloc::Counting = alloc::Counting;

/// Inputs per target when `MESHPILOT_FUZZ_CASES` is not set: a smoke run within CI's time.
const SMOKE_CASES: u32 = 400;

/// Longest acceptable error message: enough to say what and where, too short to echo an input.
const MAX_MESSAGE: usize = 2048;

/// Memory an input may make a parser hold at once: a multiple of its size plus a constant, and
/// never more than an absolute cap.
const BYTES_PER_INPUT_BYTE: usize = 512;
const BASE_BYTES: usize = 8 << 20;
const MAX_BYTES: usize = 64 << 20;

thread_local! {
    // What the target running on this thread has seen so far, for its summary line.
    static REFUSED: Cell<u64> = const { Cell::new(0) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

fn cases() -> u32 {
    match std::env::var("MESHPILOT_FUZZ_CASES") {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("MESHPILOT_FUZZ_CASES={v:?} is not a count")),
        Err(_) => SMOKE_CASES,
    }
}

/// Runs `check` on `cases()` inputs of `strategy`; a failure is shrunk to a minimal input and
/// reported with it. Prints the count and time, which the long run records.
pub fn fuzz<S: Strategy>(
    target: &str,
    strategy: S,
    check: impl Fn(S::Value) -> Result<(), TestCaseError>,
) {
    let cases = cases();
    let config = Config {
        cases,
        // Regressions are kept as unit tests beside the code, not as files written here.
        failure_persistence: None,
        max_shrink_iters: 2048,
        ..Config::default()
    };
    REFUSED.set(0);
    PEAK.set(0);
    let started = Instant::now();
    let result = TestRunner::new(config).run(&strategy, check);
    if let Err(e) = result {
        panic!("fuzz target {target}: {e}");
    }
    eprintln!(
        "fuzz target {target}: {cases} inputs, no failure, {:.1} s; {} refusals; peak {} KiB",
        started.elapsed().as_secs_f64(),
        REFUSED.get(),
        PEAK.get() >> 10,
    );
}

/// Runs one parse of an `input_len`-byte input and checks its memory; returns its result.
pub fn bounded<T>(input_len: usize, parse: impl FnOnce() -> T) -> Result<T, TestCaseError> {
    let (out, peak) = alloc::peak_of(parse);
    PEAK.set(PEAK.get().max(peak));
    let limit = (input_len.saturating_mul(BYTES_PER_INPUT_BYTE) + BASE_BYTES).min(MAX_BYTES);
    if peak > limit {
        return Err(TestCaseError::fail(format!(
            "held {peak} bytes at once for a {input_len}-byte input (limit {limit})"
        )));
    }
    Ok(out)
}

/// A refusal must be clear: non-empty, bounded, and starting as this input kind's errors do
/// (naming what was refused and where).
pub fn clear_refusal(error: &impl Display, prefixes: &[&str]) -> Result<(), TestCaseError> {
    REFUSED.set(REFUSED.get() + 1);
    let message = error.to_string();
    if message.trim().is_empty() {
        return Err(TestCaseError::fail("an empty error message"));
    }
    if message.len() > MAX_MESSAGE {
        return Err(TestCaseError::fail(format!(
            "a {}-byte error message: {}…",
            message.len(),
            excerpt(&message)
        )));
    }
    if !prefixes.is_empty() && !prefixes.iter().any(|p| message.starts_with(p)) {
        return Err(TestCaseError::fail(format!(
            "error does not say what it refuses ({prefixes:?}): {message}"
        )));
    }
    Ok(())
}

/// The start of a long message, cut at a character boundary.
fn excerpt(message: &str) -> &str {
    let mut end = message.len().min(300);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    &message[..end]
}
