//! Addresses for ServiceEntry hosts that declare none (Istio's auto-allocation): one slot per host
//! gives an IPv4 address in 240.240.0.0/16 and an IPv6 address in 2001:2::/48, Istio's ranges.
//!
//! A host's first choice of slot is a hash of its name, so replicas and restarts agree without
//! talking to each other; collisions probe to the next free slot. A slot once given stays with its
//! host — also while the host is gone, so a ServiceEntry deleted and applied again gets its address
//! back (istiod never frees one either) — until the range is full, when the slots of hosts no
//! longer defined are given to new ones.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::Hostname;

/// Slots 1..=65534: 240.240.0.0 and 240.240.255.255 are never given.
const SLOTS: u32 = 65534;

/// The addresses of one slot.
pub fn slot_addresses(slot: u16) -> [IpAddr; 2] {
    let [high, low] = slot.to_be_bytes();
    [
        IpAddr::V4(Ipv4Addr::new(240, 240, high, low)),
        IpAddr::V6(Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, slot)),
    ]
}

/// The slot an address of either range names, if it is one of ours.
pub fn slot_of(address: IpAddr) -> Option<u16> {
    let slot = match address {
        IpAddr::V4(v4) => match v4.octets() {
            [240, 240, high, low] => u16::from_be_bytes([high, low]),
            _ => return None,
        },
        IpAddr::V6(v6) => match v6.segments() {
            [0x2001, 2, 0, 0, 0, 0, 0, slot] => slot,
            _ => return None,
        },
    };
    (1..=SLOTS).contains(&u32::from(slot)).then_some(slot)
}

/// Who asks for addresses: each defines its own set of hosts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Owner {
    /// ServiceEntry hosts that declare none.
    Entries,
    /// Pods of headless services on a network, named on their own (`registry/pod_services`).
    Pods,
}

/// Which host holds which slot; part of the mesh snapshot.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Allocations {
    by_host: imbl::OrdMap<Hostname, u16>,
    taken: imbl::OrdSet<u16>,
    /// Hosts defined now, per owner; the others hold their slot until the range is full.
    wanted: [imbl::OrdSet<Hostname>; 2],
    /// Bumped when a slot is given or taken back: what is saved changed.
    version: u64,
}

impl Allocations {
    /// Slots given before (saved, or read from ServiceEntries' status); a slot claimed twice keeps
    /// its first holder.
    pub fn restore(entries: impl IntoIterator<Item = (Hostname, u16)>) -> Self {
        let mut out = Self::default();
        for (host, slot) in entries {
            if (1..=SLOTS).contains(&u32::from(slot))
                && !out.taken.contains(&slot)
                && !out.by_host.contains_key(&host)
            {
                out.by_host.insert(host, slot);
                out.taken.insert(slot);
            }
        }
        out
    }

    /// The addresses of a host now defined, if it has a slot.
    pub fn addresses(&self, host: &str) -> Option<[IpAddr; 2]> {
        self.wanted(host)
            .then(|| self.by_host.get(host))
            .flatten()
            .map(|slot| slot_addresses(*slot))
    }

    fn wanted(&self, host: &str) -> bool {
        self.wanted.iter().any(|set| set.contains(host))
    }

    /// Every slot given, to be saved.
    pub fn entries(&self) -> impl Iterator<Item = (&Hostname, u16)> {
        self.by_host.iter().map(|(h, s)| (h, *s))
    }

    /// Whether `owner` defines any host now.
    pub fn defines_any(&self, owner: Owner) -> bool {
        !self.wanted[owner as usize].is_empty()
    }

    pub fn is_empty(&self) -> bool {
        self.by_host.is_empty()
    }

    pub fn version(&self) -> u64 {
        self.version
    }

    /// Gives `host` the slot recorded for it elsewhere (a ServiceEntry's status), unless a host
    /// defined now holds that slot (one no longer defined gives it up: the record is the leader's
    /// word); returns whether the host holds it now.
    pub fn claim(&mut self, host: &Hostname, slot: u16) -> bool {
        if !(1..=SLOTS).contains(&u32::from(slot)) {
            return false;
        }
        if self.by_host.get(host) == Some(&slot) {
            return true;
        }
        if self.taken.contains(&slot) {
            let holder = self.by_host.iter().find(|(_, s)| **s == slot);
            let Some(holder) = holder.map(|(h, _)| h.clone()) else {
                return false;
            };
            if self.wanted(&holder) {
                return false;
            }
            self.by_host.remove(&holder);
            self.taken.remove(&slot);
        }
        if let Some(held) = self.by_host.get(host) {
            self.taken.remove(held);
        }
        self.by_host.insert(host.clone(), slot);
        self.taken.insert(slot);
        self.version += 1;
        true
    }

    /// Makes `wanted` the hosts `owner` defines now, giving a slot to each that has none. Hosts are
    /// served in name order, so two replicas starting from the same state agree.
    pub fn define(&mut self, owner: Owner, wanted: &BTreeSet<Hostname>) {
        let held = &self.wanted[owner as usize];
        if held.len() != wanted.len() || !held.iter().eq(wanted.iter()) {
            self.wanted[owner as usize] = wanted.iter().cloned().collect();
        }
        for host in wanted {
            if self.by_host.contains_key(host) {
                continue;
            }
            let Some(slot) = self.free_slot(host).or_else(|| self.reclaim()) else {
                // 65,534 hosts defined at once: the rest go without (Istio's allocator fails too).
                continue;
            };
            self.by_host.insert(host.clone(), slot);
            self.taken.insert(slot);
            self.version += 1;
        }
    }

    /// The host's preferred slot, or the next free one after it.
    fn free_slot(&self, host: &str) -> Option<u16> {
        let start = (crate::text::stable_hash(host) % u64::from(SLOTS)) as u32;
        (0..SLOTS)
            .map(|i| ((start + i) % SLOTS + 1) as u16)
            .find(|slot| !self.taken.contains(slot))
    }

    /// Takes back the slot of a host no longer defined (the first by name).
    fn reclaim(&mut self) -> Option<u16> {
        let host = self.by_host.keys().find(|h| !self.wanted(h))?.clone();
        let slot = self.by_host.remove(&host)?;
        self.taken.remove(&slot);
        Some(slot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(names: &[&str]) -> BTreeSet<Hostname> {
        names.iter().map(|n| Hostname::from(*n)).collect()
    }

    #[test]
    fn a_slot_names_one_address_of_each_range() {
        let [v4, v6] = slot_addresses(0x0102);
        assert_eq!(v4.to_string(), "240.240.1.2");
        assert_eq!(v6.to_string(), "2001:2::102");
        assert_eq!(slot_of(v4), Some(0x0102));
        assert_eq!(slot_of(v6), Some(0x0102));
        assert_eq!(slot_of("240.240.0.0".parse().unwrap()), None);
        assert_eq!(slot_of("240.241.0.1".parse().unwrap()), None);
        assert_eq!(slot_of("10.0.0.1".parse().unwrap()), None);
    }

    #[test]
    fn the_same_hosts_get_the_same_addresses_whatever_came_before() {
        let mut a = Allocations::default();
        a.define(
            Owner::Entries,
            &hosts(&["api.example.com", "db.example.com"]),
        );
        let mut b = Allocations::default();
        b.define(Owner::Entries, &hosts(&["db.example.com"]));
        b.define(
            Owner::Entries,
            &hosts(&["api.example.com", "db.example.com"]),
        );
        for host in ["api.example.com", "db.example.com"] {
            assert_eq!(a.addresses(host), b.addresses(host), "{host}");
        }
        assert_ne!(
            a.addresses("api.example.com"),
            a.addresses("db.example.com")
        );
    }

    #[test]
    fn a_host_removed_and_defined_again_gets_its_address_back() {
        let mut a = Allocations::default();
        a.define(Owner::Entries, &hosts(&["api.example.com"]));
        let first = a.addresses("api.example.com");
        a.define(Owner::Entries, &hosts(&[]));
        assert_eq!(
            a.addresses("api.example.com"),
            None,
            "not served while gone"
        );
        a.define(Owner::Entries, &hosts(&["api.example.com"]));
        assert_eq!(a.addresses("api.example.com"), first);
    }

    #[test]
    fn restored_slots_are_kept_and_collisions_probe_past_them() {
        let mut fresh = Allocations::default();
        fresh.define(Owner::Entries, &hosts(&["a.example.com"]));
        let [v4, _] = fresh.addresses("a.example.com").unwrap();
        let preferred = slot_of(v4).unwrap();
        // Another host saved in a's preferred slot keeps it; a probes on.
        let mut a = Allocations::restore([(Hostname::from("z.example.com"), preferred)]);
        a.define(Owner::Entries, &hosts(&["a.example.com", "z.example.com"]));
        assert_eq!(
            a.addresses("z.example.com"),
            Some(slot_addresses(preferred))
        );
        let got = slot_of(a.addresses("a.example.com").unwrap()[0]).unwrap();
        assert_eq!(u32::from(got), u32::from(preferred) % SLOTS + 1);
        assert!(a.version() > 0);
    }

    #[test]
    fn a_recorded_slot_is_claimed_unless_another_host_holds_it() {
        let mut a = Allocations::default();
        let (x, y) = (
            Hostname::from("x.example.com"),
            Hostname::from("y.example.com"),
        );
        assert!(a.claim(&x, 0x0909));
        assert!(a.claim(&x, 0x0909), "again: still held");
        a.define(Owner::Entries, &hosts(&["x.example.com"]));
        assert!(!a.claim(&y, 0x0909), "held by x, defined now");
        assert!(a.claim(&x, 0x0a0a), "moved");
        assert!(a.claim(&y, 0x0909), "free again");
        a.define(Owner::Entries, &hosts(&["y.example.com"]));
        assert!(
            a.claim(&Hostname::from("z.example.com"), 0x0a0a),
            "x is gone: z takes its slot"
        );
        assert!(a.claim(&x, 0x0a0b));
        a.define(Owner::Entries, &hosts(&["x.example.com", "y.example.com"]));
        assert_eq!(a.addresses("x.example.com"), Some(slot_addresses(0x0a0b)));
        assert_eq!(a.addresses("y.example.com"), Some(slot_addresses(0x0909)));
    }

    #[test]
    fn a_full_range_reuses_the_slots_of_hosts_gone() {
        let entries = (1..=SLOTS as u16).map(|s| (Hostname::from(format!("h{s}.gone")), s));
        let mut a = Allocations::restore(entries);
        a.define(Owner::Entries, &hosts(&["new.example.com"]));
        assert!(a.addresses("new.example.com").is_some());
    }
}
