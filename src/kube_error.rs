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

/// Like [`Readable`], with the causes of a transport error ("client error (Connect)" alone does
/// not say that the connection was refused).
pub struct WithCauses<'a>(pub &'a kube::Error);

impl fmt::Display for WithCauses<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if matches!(self.0, kube::Error::Api(_)) {
            return Readable(self.0).fmt(f);
        }
        let mut text = self.0.to_string();
        let mut cause = std::error::Error::source(self.0);
        while let Some(e) = cause {
            let part = e.to_string();
            if !text.contains(&part) {
                text.push_str(": ");
                text.push_str(&part);
            }
            cause = e.source();
        }
        f.write_str(&clip(&text))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("client error (Connect)")]
    struct Connect(#[source] std::io::Error);

    #[test]
    fn transport_errors_name_their_causes() {
        let refused = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let error = kube::Error::Service(Box::new(Connect(refused)));
        assert_eq!(
            WithCauses(&error).to_string(),
            "ServiceError: client error (Connect): refused"
        );
    }
}
