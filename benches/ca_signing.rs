//! CA throughput: CreateCertificate's work (parse and verify the CSR, sign an ECDSA P-256 leaf for
//! the caller's identity, assemble the chain) on every core.
//!
//! cargo bench --bench ca_signing [-- SECONDS]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use meshpilot::security::ca::{CaBundle, CertificateAuthority, TtlPolicy};
use meshpilot::security::identity::Identity;

fn main() {
    meshpilot::security::install_crypto_provider();
    let seconds: u64 = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(3);
    let root = CaBundle::self_signed_root("cluster.local", meshpilot::security::ca::ROOT_LIFETIME)
        .expect("root");
    let intermediate = root
        .intermediate("cluster.local", "bench", Duration::from_secs(3600))
        .expect("intermediate");
    let ttl = TtlPolicy {
        default: Duration::from_secs(24 * 3600),
        max: Duration::from_secs(90 * 24 * 3600),
    };
    let ca = Arc::new(CertificateAuthority::new(&intermediate, ttl).expect("CA"));
    let key = rcgen::KeyPair::generate().expect("key");
    let csr = rcgen::CertificateParams::new(Vec::<String>::new())
        .expect("params")
        .serialize_request(&key)
        .expect("csr")
        .pem()
        .expect("pem");
    let identity = Identity::new("cluster.local", "bench", "workload");

    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (done, count) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicU64::new(0)),
    );
    let started = Instant::now();
    let workers: Vec<_> = (0..cores)
        .map(|_| {
            let (ca, csr, identity, done, count) = (
                ca.clone(),
                csr.clone(),
                identity.clone(),
                done.clone(),
                count.clone(),
            );
            std::thread::spawn(move || {
                while !done.load(Ordering::Relaxed) {
                    ca.sign_csr(&csr, &identity, None).expect("sign");
                    count.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs(seconds));
    done.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().expect("worker");
    }
    let elapsed = started.elapsed().as_secs_f64();
    let n = count.load(Ordering::Relaxed);
    println!(
        "ca_signing: {n} certificates in {elapsed:.2}s on {cores} threads = {:.0} signings/s ({:.1} µs CPU each)",
        n as f64 / elapsed,
        elapsed * cores as f64 * 1e6 / n as f64
    );
}
