//! Block-hash index: chained block hash → the workers holding that block, with last-use
//! time, TTL expiry and a global block budget.
//!
//! Fed two ways:
//! - *approximate*: the router's own decisions ([`BlockIndex::record`]); entries expire
//!   after the TTL, because the router cannot see the engine's evictions;
//! - *precise*: engine KV events ([`BlockIndex::store`], [`BlockIndex::remove`],
//!   [`BlockIndex::clear_worker`]), see vLLM's `vllm/distributed/kv_events.py`; these never expire by
//!   TTL (the engine says when they go).
//!
//! A worker's *overlap* with a request is the number of leading request blocks it holds:
//! because hashes are chained, a block is usable only if all blocks before it are.

use crate::types::{BlockHash, Nanos, WorkerId};
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;
use std::collections::HashMap;

/// Configuration of a [`BlockIndex`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlockIndexConfig {
    /// Time after which an approximate entry is forgotten, in seconds (default 120 s, as
    /// llm-d's approximate prefix scorer).
    pub ttl_secs: f64,
    /// Maximum (block, worker) entries; the least recently used go first (default
    /// 4,194,304).
    pub max_entries: usize,
}

impl Default for BlockIndexConfig {
    fn default() -> Self {
        BlockIndexConfig { ttl_secs: 120.0, max_entries: 1 << 22 }
    }
}

/// Where an entry came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// The router's own routing decision (expires after the TTL).
    Approximate,
    /// An engine KV event (expires only when the engine says so).
    Precise,
}

/// One holder of a block: 8 bytes. The worker id's top bit marks a precise (engine
/// event) entry; `last_use_s` is whole seconds of [`Nanos`] (TTL resolution is a second).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Holder {
    worker_and_flag: u32,
    last_use_s: u32,
}

const PRECISE_BIT: u32 = 1 << 31;

impl Holder {
    fn worker(self) -> WorkerId {
        WorkerId(self.worker_and_flag & !PRECISE_BIT)
    }
    fn precise(self) -> bool {
        self.worker_and_flag & PRECISE_BIT != 0
    }
}

fn secs(now: Nanos) -> u32 {
    (now.0 / 1_000_000_000).min(u32::MAX as u64) as u32
}

/// The holders of one block ([`BlockIndex::holders`]).
#[derive(Debug, Clone, Copy)]
pub struct BlockHolders<'a> {
    index: &'a BlockIndex,
    list: &'a [Holder],
    now_s: u32,
}

impl<'a> BlockHolders<'a> {
    /// The workers holding the block (entries not expired), in increasing id order.
    pub fn workers(self) -> impl Iterator<Item = WorkerId> + 'a {
        let (index, now_s) = (self.index, self.now_s);
        self.list.iter().filter(move |x| index.alive(**x, now_s)).map(|x| x.worker())
    }

    /// Whether `other` is held by exactly the same workers as this block, every entry of
    /// both an engine's (precise: they do not expire). One pass over the two lists, a few
    /// instructions an entry: a request on a prompt every engine holds whole compares
    /// each block's holders with the previous block's instead of merging them.
    pub fn same_precise_holders(&self, other: &BlockHolders<'_>) -> bool {
        self.list.len() == other.list.len()
            && self.list.iter().zip(other.list).all(|(a, b)| a.precise() && a.worker_and_flag == b.worker_and_flag)
    }

    /// A cursor answering "does `w` hold the block?" for workers asked in increasing id
    /// order: one merge step over the holder list per call, no iterator chain.
    pub fn cursor(self) -> HolderCursor<'a> {
        HolderCursor { holders: Some(self), at: 0 }
    }
}

/// Merges a block's holders with workers asked in increasing id order
/// ([`BlockHolders::cursor`]); the cursor of a block nobody holds is
/// [`HolderCursor::default`]. O(holders + asks) over all calls.
#[derive(Debug, Clone, Copy, Default)]
pub struct HolderCursor<'a> {
    holders: Option<BlockHolders<'a>>,
    at: usize,
}

impl HolderCursor<'_> {
    /// Whether `w` holds the block (its entry not expired). `w` must not be below the
    /// worker of the previous call (a smaller one is answered `false`).
    #[inline]
    pub fn holds(&mut self, w: WorkerId) -> bool {
        let Some(h) = self.holders else { return false };
        let list = h.list;
        while let Some(x) = list.get(self.at)
            && x.worker() < w
        {
            self.at += 1;
        }
        list.get(self.at).is_some_and(|x| x.worker() == w && h.index.alive(*x, h.now_s))
    }
}

/// The block-hash index.
///
/// Layout: a `HashMap<u64, SmallVec<[Holder; 2]>>` keyed by block hash (already uniformly
/// distributed, hashed again cheaply with foldhash), each list sorted by worker id so a
/// worker is found by binary search in a block the whole fleet holds. A block held by one
/// or two workers costs one map slot (8-byte key + 24-byte inline holder list + 1 control
/// byte) and no heap allocation of its own; see `docs/lab/2026-11-26-benchmark-runs.md`
/// ("Index memory") for the measured bytes per entry.
///
/// Worker ids must be below 2³¹ (the top bit tags precise entries).
#[derive(Debug, Clone)]
pub struct BlockIndex {
    cfg: BlockIndexConfig,
    map: HashMap<u64, SmallVec<[Holder; 2]>, foldhash::fast::FixedState>,
    entries: usize,
}

impl BlockIndex {
    /// An empty index.
    pub fn new(cfg: BlockIndexConfig) -> Self {
        BlockIndex { cfg, map: HashMap::default(), entries: 0 }
    }

    /// Configuration in force.
    pub fn config(&self) -> &BlockIndexConfig {
        &self.cfg
    }

    fn ttl_s(&self) -> u32 {
        self.cfg.ttl_secs.clamp(0.0, u32::MAX as f64) as u32
    }

    fn alive(&self, h: Holder, now_s: u32) -> bool {
        h.precise() || now_s.saturating_sub(h.last_use_s) <= self.ttl_s()
    }

    fn upsert(&mut self, worker: WorkerId, hashes: &[BlockHash], now: Nanos, precise: bool) {
        let now_s = secs(now);
        let id = worker.0 & !PRECISE_BIT;
        for h in hashes {
            let holders = self.map.entry(h.0).or_default();
            match holders.binary_search_by_key(&id, |x| x.worker().0) {
                Ok(p) => {
                    let x = &mut holders[p];
                    x.last_use_s = x.last_use_s.max(now_s);
                    if precise {
                        x.worker_and_flag |= PRECISE_BIT;
                    }
                }
                Err(p) => {
                    holders.insert(
                        p,
                        Holder { worker_and_flag: id | if precise { PRECISE_BIT } else { 0 }, last_use_s: now_s },
                    );
                    self.entries += 1;
                }
            }
        }
        // Bounded between maintenance calls: past 1/8 over budget, evict now.
        if self.entries > self.cfg.max_entries.saturating_add(self.cfg.max_entries / 8) {
            self.evict(now);
        }
    }

    /// Records that `worker` was sent a request with these leading blocks at `now`
    /// (approximate; expires after the TTL). O(len).
    pub fn record(&mut self, worker: WorkerId, hashes: &[BlockHash], now: Nanos) {
        self.upsert(worker, hashes, now, false);
    }

    /// An engine stored these blocks on `worker` (precise). O(len).
    pub fn store(&mut self, worker: WorkerId, hashes: &[BlockHash], now: Nanos) {
        self.upsert(worker, hashes, now, true);
    }

    /// An engine removed these blocks from `worker`. O(len).
    pub fn remove(&mut self, worker: WorkerId, hashes: &[BlockHash]) {
        for h in hashes {
            if let Some(holders) = self.map.get_mut(&h.0) {
                if let Ok(p) = holders.binary_search_by_key(&worker, |x| x.worker()) {
                    holders.remove(p);
                    self.entries -= 1;
                }
                if holders.is_empty() {
                    self.map.remove(&h.0);
                }
            }
        }
    }

    /// Drops every entry of `worker` (worker removed, engine restarted, AllBlocksCleared).
    /// O(blocks): a full scan, chosen over per-worker block lists (which would double the
    /// memory per entry) because it happens only on rare membership events.
    pub fn clear_worker(&mut self, worker: WorkerId) {
        let mut removed = 0;
        self.map.retain(|_, holders| {
            let before = holders.len();
            holders.retain(|x| x.worker() != worker);
            removed += before - holders.len();
            !holders.is_empty()
        });
        self.entries -= removed;
    }

    /// The entry of `worker` among a block's holders (sorted by worker id).
    fn holder(holders: &[Holder], worker: WorkerId) -> Option<Holder> {
        holders.binary_search_by_key(&worker, |x| x.worker()).ok().map(|p| holders[p])
    }

    /// The holders of block `h` at `now`, for merging with many workers at once
    /// ([`BlockHolders::workers`]) after one map lookup; `None` when nobody holds it.
    pub fn holders(&self, h: BlockHash, now: Nanos) -> Option<BlockHolders<'_>> {
        self.map.get(&h.0).map(|list| BlockHolders { index: self, list, now_s: secs(now) })
    }

    /// Leading blocks of `hashes` held (and not expired at `now`) by `worker`.
    /// O(matched × log holders): a block the whole fleet holds (a system prompt) is found by
    /// a binary search, so asking it of every worker stays O(workers × log workers).
    pub fn overlap(&self, worker: WorkerId, hashes: &[BlockHash], now: Nanos) -> usize {
        let now_s = secs(now);
        hashes
            .iter()
            .take_while(|h| {
                self.map.get(&h.0).and_then(|hs| Self::holder(hs, worker)).is_some_and(|x| self.alive(x, now_s))
            })
            .count()
    }

    /// For every worker holding at least the first block: its leading-block overlap.
    /// Appends `(worker, blocks)` pairs to `out` in worker-id order. O(holders of the first
    /// block + len × active × log holders).
    pub fn overlaps(&self, hashes: &[BlockHash], now: Nanos, out: &mut Vec<(WorkerId, usize)>) {
        let now_s = secs(now);
        let start = out.len();
        let Some(first) = hashes.first().and_then(|h| self.map.get(&h.0)) else { return };
        // Holders are sorted by worker id, so `out` is too.
        out.extend(first.iter().filter(|x| self.alive(**x, now_s)).map(|x| (x.worker(), 1)));
        let mut active: SmallVec<[usize; 16]> = (start..out.len()).collect();
        for h in &hashes[1..] {
            let Some(holders) = self.map.get(&h.0) else { break };
            active.retain(|i| {
                let held = Self::holder(holders, out[*i].0).is_some_and(|x| self.alive(x, now_s));
                if held {
                    out[*i].1 += 1;
                }
                held
            });
            if active.is_empty() {
                break;
            }
        }
    }

    /// Removes expired approximate entries and enforces `max_entries` by dropping the least
    /// recently used entries. Returns the number of entries removed. O(entries).
    pub fn evict(&mut self, now: Nanos) -> usize {
        let now_s = secs(now);
        let ttl = self.ttl_s();
        let before = self.entries;
        let mut kept = 0;
        self.map.retain(|_, holders| {
            holders.retain(|x| x.precise() || now_s.saturating_sub(x.last_use_s) <= ttl);
            kept += holders.len();
            !holders.is_empty()
        });
        self.entries = kept;
        if self.entries > self.cfg.max_entries {
            // Find the last-use cutoff that keeps at most max_entries (ties at the cutoff
            // second are dropped too, so the bound holds).
            let mut times: Vec<u32> = self.map.values().flat_map(|hs| hs.iter().map(|x| x.last_use_s)).collect();
            let excess = self.entries - self.cfg.max_entries;
            let (_, cutoff, _) = times.select_nth_unstable(excess - 1);
            let cutoff = *cutoff;
            let mut kept = 0;
            self.map.retain(|_, holders| {
                holders.retain(|x| x.last_use_s > cutoff);
                kept += holders.len();
                !holders.is_empty()
            });
            self.entries = kept;
        }
        before - self.entries
    }

    /// Distinct blocks held by at least one worker. O(1).
    pub fn blocks(&self) -> usize {
        self.map.len()
    }

    /// (block, worker) entries. O(1).
    pub fn entries(&self) -> usize {
        self.entries
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(v: &[u64]) -> Vec<BlockHash> {
        v.iter().map(|&x| BlockHash(x)).collect()
    }
    const A: WorkerId = WorkerId(0);
    const B: WorkerId = WorkerId(1);

    #[test]
    fn leading_overlap_per_worker() {
        let mut ix = BlockIndex::new(BlockIndexConfig::default());
        ix.record(A, &h(&[1, 2, 3]), Nanos::from_secs(1));
        ix.record(B, &h(&[1, 2, 9]), Nanos::from_secs(1));
        ix.store(B, &h(&[3]), Nanos::from_secs(1)); // precise, and B already holds 1 and 2
        let mut out = Vec::new();
        ix.overlaps(&h(&[1, 2, 3, 4]), Nanos::from_secs(2), &mut out);
        assert_eq!(out, vec![(A, 3), (B, 3)]);
        assert_eq!(ix.overlap(A, &h(&[1, 2, 9]), Nanos::from_secs(2)), 2);
        assert_eq!(ix.overlap(B, &h(&[2, 3]), Nanos::from_secs(2)), 2);
        assert_eq!(ix.overlap(A, &h(&[9]), Nanos::from_secs(2)), 0);
        assert_eq!((ix.blocks(), ix.entries()), (4, 7));
    }

    #[test]
    fn ttl_expires_approximate_but_not_precise() {
        let cfg = BlockIndexConfig { ttl_secs: 10.0, max_entries: 100 };
        let mut ix = BlockIndex::new(cfg);
        ix.record(A, &h(&[1, 2]), Nanos::from_secs(0));
        ix.store(B, &h(&[1, 2]), Nanos::from_secs(0));
        assert_eq!(ix.overlap(A, &h(&[1, 2]), Nanos::from_secs(10)), 2);
        assert_eq!(ix.overlap(A, &h(&[1, 2]), Nanos::from_secs(11)), 0);
        assert_eq!(ix.overlap(B, &h(&[1, 2]), Nanos::from_secs(1000)), 2);
        assert_eq!(ix.evict(Nanos::from_secs(11)), 2);
        assert_eq!(ix.entries(), 2);
    }

    #[test]
    fn remove_clear_and_budget() {
        let cfg = BlockIndexConfig { ttl_secs: 1e9, max_entries: 4 };
        let mut ix = BlockIndex::new(cfg);
        ix.record(A, &h(&[1, 2, 3]), Nanos::from_secs(1));
        ix.record(B, &h(&[1, 2, 3]), Nanos::from_secs(5));
        ix.remove(B, &h(&[3]));
        assert_eq!(ix.overlap(B, &h(&[1, 2, 3]), Nanos::from_secs(5)), 2);
        // 5 entries > 4: the oldest (A's, at t=1) go.
        ix.evict(Nanos::from_secs(6));
        assert!(ix.entries() <= 4);
        assert_eq!(ix.overlap(A, &h(&[1]), Nanos::from_secs(6)), 0);
        assert_eq!(ix.overlap(B, &h(&[1, 2]), Nanos::from_secs(6)), 2);
        ix.clear_worker(B);
        assert_eq!((ix.entries(), ix.blocks()), (0, 0));
    }
}
