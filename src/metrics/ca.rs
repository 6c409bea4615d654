//! The CA's metrics under istiod's `citadel_server_*` names.

use prometheus::{IntCounter, IntGauge, Registry};

use super::{opts, registered};

#[derive(Clone)]
pub struct CaMetrics {
    csrs: IntCounter,
    issued: IntCounter,
    authentication_failures: IntCounter,
    sign_errors: IntCounter,
    root_expiry: IntGauge,
}

impl Default for CaMetrics {
    /// Metrics registered nowhere (for tests).
    fn default() -> Self {
        Self::new(&Registry::new())
    }
}

impl CaMetrics {
    pub(super) fn new(registry: &Registry) -> Self {
        let counter = |name: &str, help: &str| {
            registered(
                registry,
                IntCounter::with_opts(opts(name, help)).expect("valid counter"),
            )
        };
        Self {
            csrs: counter(
                "citadel_server_csr_count",
                "Certificate signing requests received",
            ),
            issued: counter(
                "citadel_server_success_cert_issuance_count",
                "Certificates issued",
            ),
            authentication_failures: counter(
                "citadel_server_authentication_failure_count",
                "Certificate requests whose caller could not be authenticated",
            ),
            sign_errors: counter(
                "citadel_server_csr_sign_err_count",
                "Certificate requests refused after authentication (bad CSR, TTL, signing)",
            ),
            root_expiry: registered(
                registry,
                IntGauge::with_opts(opts(
                    "citadel_server_root_cert_expiry_timestamp",
                    "Unix time (seconds) when the CA root certificate expires",
                ))
                .expect("valid gauge"),
            ),
        }
    }

    pub fn requested(&self) {
        self.csrs.inc();
    }

    pub fn issued(&self) {
        self.issued.inc();
    }

    pub fn authentication_failed(&self) {
        self.authentication_failures.inc();
    }

    pub fn sign_failed(&self) {
        self.sign_errors.inc();
    }

    pub fn set_root_expiry(&self, unix_seconds: i64) {
        self.root_expiry.set(unix_seconds);
    }
}
