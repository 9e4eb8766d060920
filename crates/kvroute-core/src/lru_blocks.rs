//! The per-worker LRU set of block hashes of B3 `cache_aware_proxy.py` (`inst.cached_blocks`).
//!
//! Each worker keeps the hashes of the blocks the router believes it has cached, with a
//! capacity in blocks and least-recently-used eviction. [`LruBlockSet::estimate_cache_hit`]
//! returns the longest *leading* run of a request's blocks present in the set — the part of
//! the prompt the engine's prefix cache could serve — without touching recency (B3 updates
//! the set when a request starts, not inside the picker).

use crate::types::{BlockHash, WorkerId, WorkerView};
use smallvec::SmallVec;
use std::collections::HashMap;
use std::num::NonZeroUsize;

/// Default capacity in blocks: 2,048 blocks of 512 tokens ≈ 1 M tokens of KV cache, about
/// what one 80 GB accelerator holds for an 8B model in fp16.
pub const DEFAULT_CAPACITY_BLOCKS: usize = 2048;

/// An LRU set of block hashes with a fixed capacity.
///
/// Memory follows the hashes held, not the capacity: the set grows as requests are routed
/// to its worker and evicts past `capacity` itself (a bounded `lru::LruCache` reserves its
/// whole capacity up front: 2,048 blocks × 10,000 workers was 0.8 GiB for sets mostly empty).
#[derive(Debug, Clone)]
pub struct LruBlockSet {
    lru: lru::LruCache<BlockHash, (), foldhash::fast::RandomState>,
    capacity: NonZeroUsize,
}

impl LruBlockSet {
    /// A set holding at most `capacity_blocks` hashes (at least 1).
    pub fn new(capacity_blocks: usize) -> Self {
        LruBlockSet {
            lru: lru::LruCache::unbounded_with_hasher(foldhash::fast::RandomState::default()),
            capacity: NonZeroUsize::new(capacity_blocks.max(1)).unwrap_or(NonZeroUsize::MIN),
        }
    }

    /// Evicts the least recently used hashes beyond the capacity, telling `evicted` each.
    fn trim(&mut self, evicted: &mut impl FnMut(BlockHash)) {
        while self.lru.len() > self.capacity.get() {
            if let Some((h, ())) = self.lru.pop_lru() {
                evicted(h);
            }
        }
    }

    /// Number of leading blocks of `hashes` present, in blocks. O(matched + 1).
    pub fn estimate_cache_hit(&self, hashes: &[BlockHash]) -> usize {
        hashes.iter().take_while(|h| self.lru.contains(h)).count()
    }

    /// Marks all `hashes` as used now (in reverse order, so the first block is the most recent
    /// of them and the prompt's tail goes first on eviction), evicting the least recently
    /// used hashes beyond capacity.
    pub fn insert(&mut self, hashes: &[BlockHash]) {
        self.insert_with(hashes, |_, _| {});
    }

    /// [`LruBlockSet::insert`], telling `change` of every hash that joins the set (`true`)
    /// or leaves it (`false`), in order: a hash may join and leave within one call (a
    /// prompt longer than the capacity).
    fn insert_with(&mut self, hashes: &[BlockHash], mut change: impl FnMut(BlockHash, bool)) {
        for h in hashes.iter().rev() {
            if self.lru.put(*h, ()).is_none() {
                change(*h, true);
            }
            // Within the loop, as a bounded cache would: a prompt longer than the capacity
            // keeps its first blocks.
            self.trim(&mut |e| change(e, false));
        }
    }

    /// Hashes held.
    pub fn len(&self) -> usize {
        self.lru.len()
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.lru.is_empty()
    }

    /// Capacity in blocks.
    pub fn capacity(&self) -> usize {
        self.capacity.get()
    }

    /// Changes the capacity to `capacity_blocks` (at least 1), evicting the least recently
    /// used hashes beyond it.
    pub fn resize(&mut self, capacity_blocks: usize) {
        self.resize_with(capacity_blocks, |_| {});
    }

    /// [`LruBlockSet::resize`], telling `evicted` of every hash it evicts.
    fn resize_with(&mut self, capacity_blocks: usize, mut evicted: impl FnMut(BlockHash)) {
        self.capacity = NonZeroUsize::new(capacity_blocks.max(1)).unwrap_or(NonZeroUsize::MIN);
        self.trim(&mut evicted);
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        self.lru.clear();
    }
}

/// Holders of one block hash: worker ids, sorted, without repeats.
type Holders = SmallVec<[WorkerId; 4]>;

/// The per-worker [`LruBlockSet`]s of a policy, with the reverse index a decision reads:
/// for each block hash, the workers whose set holds it (sorted by id).
///
/// A decision over N workers asks every worker how many of the request's leading blocks it
/// holds. Asking each worker's set is one hash lookup per worker (a cache miss each at
/// 1,024 workers: most of a decision's time); [`WorkerBlockSets::hits`] answers for the
/// whole fleet at once from the reverse index, in O(Σ holders of the matched blocks), and
/// returns only the workers that hold the first block. Both give the same answers
/// ([`WorkerBlockSets::hit`] is the one-worker form; a property test compares them).
///
/// Memory: each (worker, block) pair is kept twice, in the worker's LRU set and as 4
/// bytes in the block's holder list, and each distinct block has one holder list.
#[derive(Debug, Clone, Default)]
pub struct WorkerBlockSets {
    sets: HashMap<WorkerId, LruBlockSet, foldhash::fast::FixedState>,
    holders: HashMap<BlockHash, Holders, foldhash::fast::FixedState>,
}

/// Adds `worker` to (`joined`) or removes it from the holders of `h`.
fn update_holders(
    holders: &mut HashMap<BlockHash, Holders, foldhash::fast::FixedState>,
    worker: WorkerId,
    h: BlockHash,
    joined: bool,
) {
    if joined {
        let list = holders.entry(h).or_default();
        if let Err(i) = list.binary_search(&worker) {
            list.insert(i, worker);
        }
    } else if let Some(list) = holders.get_mut(&h) {
        if let Ok(i) = list.binary_search(&worker) {
            list.remove(i);
        }
        if list.is_empty() {
            holders.remove(&h);
        }
    }
}

impl WorkerBlockSets {
    /// Marks `hashes` as used now on `worker` ([`LruBlockSet::insert`]), creating its set
    /// with `capacity_blocks` if it has none; with `resize`, an existing set takes that
    /// capacity first (evicting past it).
    pub fn insert(&mut self, worker: WorkerId, hashes: &[BlockHash], capacity_blocks: usize, resize: bool) {
        let Self { sets, holders } = self;
        let set = sets.entry(worker).or_insert_with(|| LruBlockSet::new(capacity_blocks));
        if resize && set.capacity() != capacity_blocks.max(1) {
            set.resize_with(capacity_blocks, |h| update_holders(holders, worker, h, false));
        }
        set.insert_with(hashes, |h, joined| update_holders(holders, worker, h, joined));
    }

    /// Forgets `worker`'s set.
    pub fn remove_worker(&mut self, worker: WorkerId) {
        if let Some(set) = self.sets.remove(&worker) {
            for (h, ()) in set.lru.iter() {
                update_holders(&mut self.holders, worker, *h, false);
            }
        }
    }

    /// Forgets every set.
    pub fn clear(&mut self) {
        self.sets.clear();
        self.holders.clear();
    }

    /// Blocks held by `worker`.
    pub fn len_of(&self, worker: WorkerId) -> usize {
        self.sets.get(&worker).map_or(0, LruBlockSet::len)
    }

    /// Distinct blocks held by at least one worker (the reverse index's entries).
    pub fn distinct_blocks(&self) -> usize {
        self.holders.len()
    }

    /// Blocks held, summed over the workers.
    pub fn total(&self) -> u64 {
        self.sets.values().map(|s| s.len() as u64).sum()
    }

    /// The leading blocks of `hashes` `worker` holds ([`LruBlockSet::estimate_cache_hit`];
    /// 0 for a worker without a set).
    pub fn hit(&self, worker: WorkerId, hashes: &[BlockHash]) -> usize {
        self.sets.get(&worker).map_or(0, |s| s.estimate_cache_hit(hashes))
    }

    /// The estimate's leading blocks of `hashes` for the worker of view `w`: 0 when the
    /// worker reports its own cached tokens (engine KV events), which are read instead.
    pub fn hit_of(&self, w: &WorkerView, hashes: &[BlockHash]) -> u64 {
        if w.cached_tokens.is_some() { 0 } else { self.hit(w.id, hashes) as u64 }
    }

    /// [`WorkerBlockSets::hit`] for every worker at once: the workers holding at least the
    /// first block of `hashes`, each with its count of leading blocks held. Every other
    /// worker holds none.
    pub fn hits(&self, hashes: &[BlockHash]) -> Hits {
        let Some(first) = hashes.first().and_then(|h| self.holders.get(h)) else { return Hits::default() };
        let mut entries: Vec<(WorkerId, u32)> = first.iter().map(|&w| (w, 1)).collect();
        // Indices into `entries` of the workers holding every block so far (sorted by id).
        let mut alive: Vec<u32> = (0..entries.len() as u32).collect();
        for (depth, h) in hashes.iter().enumerate().skip(1) {
            let Some(hs) = self.holders.get(h) else { break };
            let depth = (depth + 1).min(u32::MAX as usize) as u32;
            let mut rest: &[WorkerId] = hs;
            alive.retain(|&i| {
                let e = &mut entries[i as usize];
                // Both sorted by id: skip the holders below this worker (a binary search,
                // as the holders of a shared block may be many more than those alive).
                rest = &rest[rest.partition_point(|&w| w < e.0)..];
                let held = rest.first() == Some(&e.0);
                if held {
                    e.1 = depth;
                }
                held
            });
            if alive.is_empty() {
                break;
            }
        }
        Hits { entries, cursor: 0 }
    }
}

/// Leading blocks held per worker, for one request ([`WorkerBlockSets::hits`]): the workers
/// holding at least one, sorted by id.
#[derive(Debug, Clone, Default)]
pub struct Hits {
    entries: Vec<(WorkerId, u32)>,
    cursor: usize,
}

impl Hits {
    /// Leading blocks `worker` holds (0 when none). O(1) amortised when asked in increasing
    /// id order (as a fleet's views usually are), O(log n) otherwise.
    pub fn get(&mut self, worker: WorkerId) -> u64 {
        crate::select::find_sorted(&self.entries, &mut self.cursor, worker).map_or(0, u64::from)
    }

    /// The most leading blocks any worker holds (0 when none holds the first).
    pub fn deepest(&self) -> u64 {
        self.entries.iter().map(|e| u64::from(e.1)).max().unwrap_or(0)
    }

    /// Each worker holding at least one leading block, with how many, in increasing id
    /// order.
    pub fn entries(&self) -> impl Iterator<Item = (WorkerId, u32)> + '_ {
        self.entries.iter().copied()
    }

    /// Starts [`Hits::get`]'s cursor again at the lowest id, for a second pass over the
    /// fleet in id order.
    pub fn rewind(&mut self) {
        self.cursor = 0;
    }

    /// Workers holding at least one leading block.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no worker holds the first block.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(v: &[u64]) -> Vec<BlockHash> {
        v.iter().map(|&x| BlockHash(x)).collect()
    }

    #[test]
    fn leading_run_only() {
        let mut s = LruBlockSet::new(10);
        s.insert(&h(&[1, 2, 3]));
        assert_eq!(s.estimate_cache_hit(&h(&[1, 2, 3, 4])), 3);
        assert_eq!(s.estimate_cache_hit(&h(&[1, 9, 3])), 1);
        assert_eq!(s.estimate_cache_hit(&h(&[2, 3])), 2);
        assert_eq!(s.estimate_cache_hit(&h(&[])), 0);
    }

    #[test]
    fn evicts_least_recent_tail_first() {
        let mut s = LruBlockSet::new(3);
        s.insert(&h(&[1, 2, 3]));
        s.insert(&h(&[1, 4])); // 1 and 4 fresh; 3 was the least recent (tail of first prompt)
        assert_eq!(s.len(), 3);
        assert_eq!(s.estimate_cache_hit(&h(&[1, 2])), 2);
        assert_eq!(s.estimate_cache_hit(&h(&[1, 2, 3])), 2);
    }

    #[test]
    fn a_prompt_longer_than_the_capacity_keeps_its_first_blocks_and_resize_evicts() {
        let mut s = LruBlockSet::new(2);
        s.insert(&h(&[1, 2, 3, 4]));
        assert_eq!((s.len(), s.estimate_cache_hit(&h(&[1, 2, 3]))), (2, 2));
        s.resize(1);
        assert_eq!((s.len(), s.capacity(), s.estimate_cache_hit(&h(&[1, 2]))), (1, 1, 1));
    }
}
