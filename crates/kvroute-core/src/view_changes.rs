//! Which workers' views changed since a reader last looked: what lets a caller keep the
//! views (and their [`crate::fleet_digest::FleetDigest`]) between decisions and re-read
//! only the workers whose counters, health or signals moved, instead of every worker of
//! the fleet on every request.
//!
//! Whatever changes a worker's view calls [`ViewChanges::mark`] after the change (an
//! [`crate::ledger::AtomicLoad`] given [`crate::ledger::AtomicLoad::watch`] does it on each
//! of its transitions). Each reader ([`ViewChanges::reader`]; at most [`MAX_READERS`] at
//! once) has its own set of marks, one bit per worker id modulo [`ViewChanges::capacity`],
//! and [`ChangeReader::drain`] hands it the bits set since its last drain and clears them.
//! A mark costs one atomic OR per reader; a drain reads `capacity / 64` words.
//!
//! Ordering: a mark is a release and a drain an acquire, so a reader that drains a worker's
//! bit and then reads its view sees every change made before the mark. A change made while
//! the reader reads leaves its bit set, and the next drain re-reads it: a kept view is
//! never older than the last drain that did not name it.

use crate::types::WorkerId;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Most readers a [`ViewChanges`] serves at once (each keeps its own marks: a mark costs
/// one atomic OR per reader).
pub const MAX_READERS: usize = 8;

/// The marks of every reader of one fleet's views (see the module docs). Shared as an
/// `Arc` by whatever marks and whatever reads.
#[derive(Debug)]
pub struct ViewChanges {
    /// Bit `i` of `in_use`: reader slot `i` is taken.
    in_use: AtomicU64,
    /// Each reader slot's marks: bit `id % capacity`.
    marks: Box<[Box<[AtomicU64]>]>,
    /// Bits per reader (a multiple of 64).
    capacity: usize,
}

impl ViewChanges {
    /// Marks for worker ids modulo `capacity` (rounded up to a multiple of 64, at least
    /// 64): a fleet whose live ids are all distinct modulo `capacity` gives each worker its
    /// own bit; ids that share a bit are re-read together.
    pub fn new(capacity: usize) -> ViewChanges {
        let words = capacity.div_ceil(64).max(1);
        let marks = (0..MAX_READERS).map(|_| (0..words).map(|_| AtomicU64::new(0)).collect()).collect();
        ViewChanges { in_use: AtomicU64::new(0), marks, capacity: words * 64 }
    }

    /// Bits per reader: worker `id`'s bit is `id % capacity` ([`ViewChanges::bit`]).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Worker `id`'s bit.
    pub fn bit(&self, id: WorkerId) -> usize {
        id.0 as usize % self.capacity
    }

    /// Worker `id`'s view changed (call after the change is stored).
    #[inline]
    pub fn mark(&self, id: WorkerId) {
        let mut readers = self.in_use.load(Ordering::Acquire);
        if readers == 0 {
            return;
        }
        let bit = self.bit(id);
        let (word, mask) = (bit / 64, 1u64 << (bit % 64));
        while readers != 0 {
            let slot = readers.trailing_zeros() as usize;
            readers &= readers - 1;
            self.marks[slot][word].fetch_or(mask, Ordering::Release);
        }
    }

    /// A new reader, every bit of its marks set (a reader starts by reading every view, and
    /// a change made while it does so is marked after it); `None` when [`MAX_READERS`] are
    /// taken.
    pub fn reader(self: &Arc<Self>) -> Option<ChangeReader> {
        let mut cur = self.in_use.load(Ordering::Relaxed);
        loop {
            let free = (!cur).trailing_zeros() as usize;
            if free >= MAX_READERS {
                return None;
            }
            for w in self.marks[free].iter() {
                w.store(u64::MAX, Ordering::Relaxed);
            }
            match self.in_use.compare_exchange(cur, cur | 1 << free, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return Some(ChangeReader { changes: Arc::clone(self), slot: free }),
                Err(now) => cur = now,
            }
        }
    }

    /// Readers now taken.
    pub fn readers(&self) -> usize {
        self.in_use.load(Ordering::Relaxed).count_ones() as usize
    }
}

/// One reader's marks ([`ViewChanges::reader`]); its slot is freed when it is dropped.
#[derive(Debug)]
pub struct ChangeReader {
    changes: Arc<ViewChanges>,
    slot: usize,
}

impl ChangeReader {
    /// The marks this reader drains.
    pub fn changes(&self) -> &Arc<ViewChanges> {
        &self.changes
    }

    /// Calls `f` with each bit marked since the last drain (increasing), clearing them.
    pub fn drain(&mut self, mut f: impl FnMut(usize)) {
        for (i, w) in self.changes.marks[self.slot].iter().enumerate() {
            if w.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let mut bits = w.swap(0, Ordering::Acquire);
            while bits != 0 {
                f(i * 64 + bits.trailing_zeros() as usize);
                bits &= bits - 1;
            }
        }
    }
}

impl Drop for ChangeReader {
    fn drop(&mut self) {
        self.changes.in_use.fetch_and(!(1u64 << self.slot), Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drained(r: &mut ChangeReader) -> Vec<usize> {
        let mut v = Vec::new();
        r.drain(|b| v.push(b));
        v
    }

    #[test]
    fn each_reader_drains_the_marks_made_since_its_last_drain() {
        let c = Arc::new(ViewChanges::new(100));
        assert_eq!(c.capacity(), 128);
        // Nobody reads: a mark is dropped.
        c.mark(WorkerId(3));
        let mut a = c.reader().expect("a slot");
        // A new reader starts with every bit set.
        assert_eq!(drained(&mut a).len(), 128);
        assert!(drained(&mut a).is_empty());
        let mut b = c.reader().expect("a slot");
        drained(&mut b);
        c.mark(WorkerId(3));
        c.mark(WorkerId(130));
        c.mark(WorkerId(70));
        assert_eq!(drained(&mut a), vec![2, 3, 70]);
        assert!(drained(&mut a).is_empty());
        c.mark(WorkerId(5));
        assert_eq!(drained(&mut b), vec![2, 3, 5, 70]);
        assert_eq!(drained(&mut a), vec![5]);
    }

    #[test]
    fn slots_are_bounded_and_freed_on_drop() {
        let c = Arc::new(ViewChanges::new(64));
        let readers: Vec<ChangeReader> = (0..MAX_READERS).map(|_| c.reader().expect("a slot")).collect();
        assert_eq!(c.readers(), MAX_READERS);
        assert!(c.reader().is_none());
        drop(readers);
        assert_eq!(c.readers(), 0);
        let mut r = c.reader().expect("a slot after the others left");
        drained(&mut r);
        c.mark(WorkerId(63));
        assert_eq!(drained(&mut r), vec![63]);
    }
}
