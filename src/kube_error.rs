//! A Kubernetes API error as one readable line. kube's own Display appends a Debug dump of the
//! API's Status; operators need its message, code and reason only.

use std::fmt;

use crate::text::clip;

/// Displays a `kube::Error` as `<message> (<code> <reason>)`, bounded.
pub struct Readable<'a>(pub &'a kube::Error);

impl fmt::Display for Readable<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            kube::Error::Api(status) => write!(
                f,
                "{} ({} {})",
                clip(&status.message),
                status.code,
                status.reason
            ),
            other => f.write_str(&clip(&other.to_string())),
        }
    }
}
