//! Block-hash index: chained block hash → the workers holding that block, with last-use
//! time, TTL expiry and a global block budget.
//!
//! Fed two ways:
//! - *approximate*: the router's own decisions ([`BlockIndex::record`]); entries expire
//!   after the TTL, because the router cannot see the engine's evictions;
//! - *precise*: engine KV events ([`BlockIndex::store`], [`BlockIndex::remove`],
//!   [`BlockIndex::clear_worker`]), see `shared/specs/kv-events.md`; these never expire by
//!   TTL (the engine says when they go).
//!
//! A worker's *overlap* with a request is the number of leading request blocks it holds:
//! because hashes are chained, a block is usable only if all blocks before it are.

use crate::types::{BlockHash, Nanos, WorkerId};
use serde::{Deserialize, Serialize};

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

/// The block-hash index.
#[derive(Debug)]
pub struct BlockIndex {
    cfg: BlockIndexConfig,
}

impl BlockIndex {
    /// An empty index.
    pub fn new(cfg: BlockIndexConfig) -> Self {
        BlockIndex { cfg }
    }

    /// Configuration in force.
    pub fn config(&self) -> &BlockIndexConfig {
        &self.cfg
    }

    /// Records that `worker` was sent a request with these leading blocks at `now`
    /// (approximate; expires after the TTL). O(len).
    pub fn record(&mut self, worker: WorkerId, hashes: &[BlockHash], now: Nanos) {
        let _ = (worker, hashes, now);
        todo!()
    }

    /// An engine stored these blocks on `worker` (precise). O(len).
    pub fn store(&mut self, worker: WorkerId, hashes: &[BlockHash], now: Nanos) {
        let _ = (worker, hashes, now);
        todo!()
    }

    /// An engine removed these blocks from `worker`.
    pub fn remove(&mut self, worker: WorkerId, hashes: &[BlockHash]) {
        let _ = (worker, hashes);
        todo!()
    }

    /// Drops every entry of `worker` (worker removed, engine restarted, AllBlocksCleared).
    pub fn clear_worker(&mut self, worker: WorkerId) {
        let _ = worker;
        todo!()
    }

    /// Leading blocks of `hashes` held (and not expired at `now`) by `worker`.
    pub fn overlap(&self, worker: WorkerId, hashes: &[BlockHash], now: Nanos) -> usize {
        let _ = (worker, hashes, now);
        todo!()
    }

    /// For every worker holding at least the first block: its leading-block overlap.
    /// Appends `(worker, blocks)` pairs to `out` in worker-id order. O(len · holders).
    pub fn overlaps(&self, hashes: &[BlockHash], now: Nanos, out: &mut Vec<(WorkerId, usize)>) {
        let _ = (hashes, now, out);
        todo!()
    }

    /// Removes expired approximate entries and enforces `max_entries` (LRU). Returns the
    /// number of entries removed.
    pub fn evict(&mut self, now: Nanos) -> usize {
        let _ = now;
        todo!()
    }

    /// Distinct blocks held by at least one worker.
    pub fn blocks(&self) -> usize {
        todo!()
    }

    /// (block, worker) entries.
    pub fn entries(&self) -> usize {
        todo!()
    }
}
