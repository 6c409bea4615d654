//! What of a proxy a cached resource is built from. A cached build names the traits it may read;
//! its cache key holds the proxy's value of each of them and nothing else of the proxy, so a
//! resource can only be shared by proxies that agree on everything it read. Generators read the
//! proxy only through `Generation`'s accessors, each of which names its trait: reading one a build
//! did not name is a bug, caught in debug builds (every test) by a panic naming the trait.

use std::fmt;

/// One thing about the proxy a resource can depend on. Most are read off its node; the derived
/// ones are keyed by what they come to for the proxy, so proxies that differ in a node field but
/// agree on what follows from it share.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum Trait {
    /// Its node type (sidecar, router, waypoint, ztunnel) and generator (Envoy, gRPC).
    Kind,
    Namespace,
    Labels,
    /// CLUSTER_ID.
    Cluster,
    /// NETWORK and REQUESTED_NETWORK_VIEW.
    Network,
    /// Its own addresses.
    Addresses,
    /// The IP families of its addresses.
    Families,
    /// Where it runs: its node's locality, else its own endpoint's.
    Locality,
    /// ISTIO_VERSION: whether it is Istio's proxy, and which.
    Version,
    /// What it sees: services (exportTo), its Sidecar's imports and outbound policy.
    Scope,
    /// Which DestinationRules apply to it.
    Rules,
    /// Which VirtualServices are exported to it (its namespace, where exports vary).
    Routes,
    /// Its labels, where some VirtualService matches `sourceLabels`.
    SourceLabels,
    /// Its Telemetries (access logs, Istio's metrics).
    Telemetry,
    /// What its spans carry.
    Tracing,
    /// Its WasmPlugins.
    Plugins,
    /// Which allocated ServiceEntry addresses it uses (DNS capture, IP families).
    Allocated,
    /// Its own address when it is a pod of a service whose listeners match pods by address.
    PodOfHeadless,
    /// The Gateways selecting it (a router).
    Gateways,
    /// The network of a node proxy (ztunnel), as it says or as its pod is.
    NodeNetwork,
    /// The identity it proved on the secure port.
    Identity,
}

impl Trait {
    pub(super) const EVERY: [Trait; 21] = [
        Trait::Kind,
        Trait::Namespace,
        Trait::Labels,
        Trait::Cluster,
        Trait::Network,
        Trait::Addresses,
        Trait::Families,
        Trait::Locality,
        Trait::Version,
        Trait::Scope,
        Trait::Rules,
        Trait::Routes,
        Trait::SourceLabels,
        Trait::Telemetry,
        Trait::Tracing,
        Trait::Plugins,
        Trait::Allocated,
        Trait::PodOfHeadless,
        Trait::Gateways,
        Trait::NodeNetwork,
        Trait::Identity,
    ];

    const fn bit(self) -> u32 {
        1 << self as u8
    }
}

/// A set of traits: what a cached build may read, and its key holds.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) struct Traits(u32);

impl Traits {
    pub(super) const NONE: Traits = Traits(0);
    /// Outside any cached build: what is built for one proxy alone may read anything.
    pub(super) const ALL: Traits = Traits(u32::MAX);

    pub(super) const fn of(traits: &[Trait]) -> Traits {
        let mut bits = 0;
        let mut i = 0;
        while i < traits.len() {
            bits |= traits[i].bit();
            i += 1;
        }
        Traits(bits)
    }

    pub(super) const fn with(self, other: Traits) -> Traits {
        Traits(self.0 | other.0)
    }

    pub(super) const fn contains(self, t: Trait) -> bool {
        self.0 & t.bit() != 0
    }

    pub(super) fn iter(self) -> impl Iterator<Item = Trait> {
        Trait::EVERY.into_iter().filter(move |t| self.contains(*t))
    }

    pub(super) const fn bits(self) -> u32 {
        self.0
    }

    pub(super) const fn from_bits(bits: u32) -> Traits {
        Traits(bits)
    }
}

impl fmt::Debug for Traits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self == Traits::ALL {
            true => f.write_str("ALL"),
            false => f.debug_set().entries(self.iter()).finish(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_trait_has_its_own_bit() {
        let all = Traits::of(&Trait::EVERY);
        assert_eq!(all.iter().count(), Trait::EVERY.len());
        let some = Traits::of(&[Trait::Kind, Trait::Scope]);
        assert!(some.contains(Trait::Scope) && !some.contains(Trait::Labels));
        assert_eq!(
            some.with(Traits::of(&[Trait::Labels])).iter().count(),
            3,
            "{some:?}"
        );
    }
}
