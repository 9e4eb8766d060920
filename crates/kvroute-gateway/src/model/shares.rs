//! Bounds per tenant on what the router holds for it (the request bodies' KiB, requests in
//! flight): one atomic count per share, taken and given back without a lock.

/// Shares a tenant's name is hashed over when tenants come from `tenant_header` (an open
/// set): two tenants whose names land on one share hold it together, which can only make
/// their bound tighter, never looser.
pub const HEADER_TENANT_SHARES: usize = 4096;

/// A bound per tenant on something the router holds for it (bodies' KiB, requests in
/// flight): one atomic count per share, a share being a key-file tenant's own
/// ([`crate::api_keys::KeyEntry::share`]) or, for `tenant_header` tenants, one of
/// [`HEADER_TENANT_SHARES`] that the tenant's name hashes to
/// ([`crate::tenant::Tenancy::share`]). Taken and given back without a lock.
#[derive(Debug)]
pub struct Shares {
    held: Box<[std::sync::atomic::AtomicU64]>,
    cap: u64,
}

impl Shares {
    /// `count` shares (at least 1) of at most `cap` units each.
    pub fn new(count: usize, cap: u64) -> Shares {
        Shares { held: (0..count.max(1)).map(|_| std::sync::atomic::AtomicU64::new(0)).collect(), cap }
    }

    /// Takes `units` of share `i`, or nothing (`false`) when that would pass the bound.
    pub fn take(&self, i: usize, units: u64) -> bool {
        use std::sync::atomic::Ordering;
        let slot = &self.held[i % self.held.len()];
        let before = slot.fetch_add(units, Ordering::AcqRel);
        if before.saturating_add(units) > self.cap {
            slot.fetch_sub(units, Ordering::AcqRel);
            return false;
        }
        true
    }

    /// Gives `units` of share `i` back (taken before with [`Shares::take`]).
    pub fn give(&self, i: usize, units: u64) {
        self.held[i % self.held.len()].fetch_sub(units, std::sync::atomic::Ordering::AcqRel);
    }

    /// Units share `i` holds now.
    pub fn held(&self, i: usize) -> u64 {
        self.held[i % self.held.len()].load(std::sync::atomic::Ordering::Acquire)
    }

    /// A share's bound, units.
    pub fn cap(&self) -> u64 {
        self.cap
    }

    /// One unit of share `i`, given back when the hold is dropped; `None` at the bound.
    pub fn hold_one(self: &std::sync::Arc<Self>, i: usize) -> Option<ShareHold> {
        self.take(i, 1).then(|| ShareHold { shares: std::sync::Arc::clone(self), share: i })
    }
}

/// One unit of a tenant's share ([`Shares::hold_one`]), given back when dropped.
#[derive(Debug)]
pub struct ShareHold {
    shares: std::sync::Arc<Shares>,
    share: usize,
}

impl Drop for ShareHold {
    fn drop(&mut self) {
        self.shares.give(self.share, 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_share_holds_up_to_its_bound_and_a_dropped_hold_gives_its_place_back() {
        let shares = std::sync::Arc::new(Shares::new(2, 2));
        let a = shares.hold_one(0).expect("first of 2");
        let b = shares.hold_one(0).expect("second of 2");
        assert!(shares.hold_one(0).is_none(), "a third passes the bound");
        assert_eq!(shares.held(0), 2, "a refused hold takes nothing");
        let other = shares.hold_one(1).expect("share 1 is its own");
        drop(a);
        let c = shares.hold_one(0).expect("a's place is back");
        drop((b, c, other));
        assert_eq!((shares.held(0), shares.held(1)), (0, 0));
        // A share index past the count wraps onto a share, never out of bounds.
        assert!(shares.hold_one(5).is_some());
    }
}
