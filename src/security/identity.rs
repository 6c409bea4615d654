//! Workload identities: `spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>`.

use std::fmt;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Identity {
    pub trust_domain: String,
    pub namespace: String,
    pub service_account: String,
}

impl Identity {
    pub fn new(trust_domain: &str, namespace: &str, service_account: &str) -> Self {
        Self {
            trust_domain: trust_domain.to_string(),
            namespace: namespace.to_string(),
            service_account: service_account.to_string(),
        }
    }

    /// Parses a SPIFFE URI of Istio's form; anything else is None.
    pub fn parse(uri: &str) -> Option<Self> {
        let rest = uri.strip_prefix("spiffe://")?;
        let parts: Vec<&str> = rest.split('/').collect();
        match parts[..] {
            [td, "ns", ns, "sa", sa] if !td.is_empty() && !ns.is_empty() && !sa.is_empty() => {
                Some(Self::new(td, ns, sa))
            }
            _ => None,
        }
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "spiffe://{}/ns/{}/sa/{}",
            self.trust_domain, self.namespace, self.service_account
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let id = Identity::new("cluster.local", "shop", "web");
        assert_eq!(id.to_string(), "spiffe://cluster.local/ns/shop/sa/web");
        assert_eq!(Identity::parse(&id.to_string()), Some(id));
        assert_eq!(Identity::parse("spiffe://td/ns/x"), None);
        assert_eq!(Identity::parse("https://td/ns/x/sa/y"), None);
    }
}
