//! The per-worker LRU set of block hashes of B3 `cache_aware_proxy.py` (`inst.cached_blocks`).
//!
//! Each worker keeps the hashes of the blocks the router believes it has cached, with a
//! capacity in blocks and least-recently-used eviction. [`LruBlockSet::estimate_cache_hit`]
//! returns the longest *leading* run of a request's blocks present in the set — the part of
//! the prompt the engine's prefix cache could serve — without touching recency (B3 updates
//! the set when a request starts, not inside the picker).

use crate::types::BlockHash;
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

    /// Evicts the least recently used hashes beyond the capacity.
    fn trim(&mut self) {
        while self.lru.len() > self.capacity.get() {
            self.lru.pop_lru();
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
        for h in hashes.iter().rev() {
            self.lru.put(*h, ());
            // Within the loop, as a bounded cache would: a prompt longer than the capacity
            // keeps its first blocks.
            self.trim();
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
        self.capacity = NonZeroUsize::new(capacity_blocks.max(1)).unwrap_or(NonZeroUsize::MIN);
        self.trim();
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        self.lru.clear();
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
