//! Precise prefix state from engine KV-cache events (vLLM's `vllm/distributed/kv_events.py`,
//! github.com/vllm-project/vllm; SGLang publishes the same messages).
//!
//! Engines (vLLM, SGLang, `kvroute engine-sim`) publish `BlockStored` / `BlockRemoved` /
//! `AllBlocksCleared` events. Their block hashes cannot be reproduced outside the engine
//! (vLLM seeds SHA-256 per process), so, as llm-d and Dynamo do, this index computes its
//! **own** chained hash over the token ids each `BlockStored` carries — the same
//! [`hash_token_blocks`](crate::hash::hash_token_blocks) chain the router computes for a
//! tokenized request — and keeps, per worker, a map from engine hash to own hash only to
//! resolve `parent_block_hash` links and removals.
//!
//! Only the main full-attention group is indexed (the caller filters `group_idx`); blocks
//! on the `GPU` medium count fully, blocks on lower tiers (`CPU`, disk) count with
//! [`PreciseConfig::lower_tier_weight`].
//!
//! Pure: the caller passes time in and applies events in sequence order; nothing here
//! does I/O. Bounded: at most [`PreciseConfig::max_blocks_per_worker`] engine hashes per
//! worker (beyond it the worker's state is dropped and rebuilt from later events, counted
//! in [`PreciseStats::overflows`]) and the two block indexes' `max_entries`.

use crate::block_index::{BlockIndex, BlockIndexConfig};
use crate::hash::{HashAlgo, ROOT_SEED};
use crate::types::{BlockHash, Nanos, WorkerId};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// Storage tier of a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    /// Device memory (`medium` `"GPU"` or absent): a hit skips prefill outright.
    Gpu,
    /// Any lower tier (`"CPU"`, disk, connectors): a hit needs a load first.
    Lower,
}

impl Tier {
    /// The tier of an event's `medium` (absent = GPU, as engines without tiers omit it).
    pub fn of_medium(medium: Option<&str>) -> Tier {
        match medium {
            None => Tier::Gpu,
            Some(m) if m.eq_ignore_ascii_case("gpu") => Tier::Gpu,
            Some(_) => Tier::Lower,
        }
    }
}

/// Knobs of a [`PreciseIndex`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PreciseConfig {
    /// Weight of a block held only on a lower tier, in [0, 1] (default 0.5: loading it
    /// back is cheaper than recomputing it, not free).
    pub lower_tier_weight: f64,
    /// Most engine block hashes tracked per worker (default 1,048,576: 16M tokens at
    /// vLLM's 16-token blocks).
    pub max_blocks_per_worker: usize,
    /// Bound of each tier's block index, in (block, worker) entries (default 4,194,304).
    pub max_entries: usize,
    /// Predict-on-route window, seconds (default 2; 0 turns it off): after a request is
    /// routed to a worker, its blocks count as held by that worker for this long or until
    /// the engine's own events say otherwise, so siblings arriving before the engine's
    /// `BlockStored` (it is sent when the prefill ends) follow it. See [`PredictWindow`].
    pub predict_window_secs: f64,
}

impl Default for PreciseConfig {
    fn default() -> Self {
        PreciseConfig {
            lower_tier_weight: 0.5,
            max_blocks_per_worker: 1 << 20,
            max_entries: 1 << 22,
            predict_window_secs: 2.0,
        }
    }
}

/// Counters of what the index did (for metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PreciseStats {
    /// Blocks stored.
    pub stored: u64,
    /// Blocks removed.
    pub removed: u64,
    /// `BlockStored` events skipped because their parent was unknown (missed events).
    pub unknown_parent: u64,
    /// `BlockStored` events skipped because `token_ids` did not cover the blocks.
    pub malformed: u64,
    /// `BlockRemoved` hashes that were not known.
    pub unknown_removed: u64,
    /// Workers cleared (restart, `AllBlocksCleared`, overflow).
    pub clears: u64,
    /// Workers whose state outgrew `max_blocks_per_worker` and was dropped.
    pub overflows: u64,
}

/// One `BlockStored` event, borrowed.
#[derive(Debug, Clone, Copy)]
pub struct StoredBlocks<'a> {
    /// Engine hashes, one per block.
    pub engine_hashes: &'a [u64],
    /// Engine hash of the block before the first one (`None`: the chain starts at the root).
    pub parent: Option<u64>,
    /// Token ids of the blocks (`engine_hashes.len() × block_size`).
    pub token_ids: &'a [u32],
    /// Tokens per block.
    pub block_size: u32,
    /// Where the blocks live.
    pub tier: Tier,
}

#[derive(Debug, Default, Clone)]
struct WorkerState {
    /// engine hash → (own hash, on GPU, on a lower tier). The engine's hashes are not ours:
    /// a per-process random seed (foldhash), not SipHash, whose cost per lookup was 7 % of
    /// ingestion at 1,024 engines.
    blocks: HashMap<u64, (BlockHash, bool, bool), foldhash::fast::RandomState>,
    block_size: Option<u32>,
}

/// Engine-reported prefix state of every worker that publishes KV events.
#[derive(Debug, Clone)]
pub struct PreciseIndex {
    cfg: PreciseConfig,
    gpu: BlockIndex,
    lower: BlockIndex,
    /// Keyed by this router's own dense ids.
    workers: HashMap<WorkerId, WorkerState, foldhash::fast::FixedState>,
    stats: PreciseStats,
    predicted: PredictWindow,
    buf: Vec<u8>,
}

impl PreciseIndex {
    /// An empty index.
    pub fn new(cfg: PreciseConfig) -> Self {
        let icfg = BlockIndexConfig { ttl_secs: f64::INFINITY, max_entries: cfg.max_entries.max(1) };
        PreciseIndex {
            cfg,
            gpu: BlockIndex::new(icfg),
            lower: BlockIndex::new(icfg),
            workers: HashMap::default(),
            stats: PreciseStats::default(),
            predicted: PredictWindow::new(
                Nanos::from_secs_f64(cfg.predict_window_secs.max(0.0)),
                cfg.max_entries.max(1),
            ),
            buf: Vec::new(),
        }
    }

    /// Starts tracking `worker` (its events flow from now on): until it is tracked, a
    /// worker has no precise state and policies use their own estimate for it.
    pub fn track(&mut self, worker: WorkerId) {
        self.workers.entry(worker).or_default();
    }

    /// Stops tracking `worker` and drops its state (worker removed, subscription lost).
    pub fn untrack(&mut self, worker: WorkerId) {
        if self.workers.remove(&worker).is_some() {
            self.gpu.clear_worker(worker);
            self.lower.clear_worker(worker);
            self.predicted.clear_worker(worker);
        }
    }

    /// Whether `worker` is tracked.
    pub fn is_tracked(&self, worker: WorkerId) -> bool {
        self.workers.contains_key(&worker)
    }

    /// The block size `worker`'s engine reported (from its first `BlockStored`).
    pub fn block_size(&self, worker: WorkerId) -> Option<u32> {
        self.workers.get(&worker).and_then(|w| w.block_size)
    }

    /// What the index has done so far.
    pub fn stats(&self) -> PreciseStats {
        self.stats
    }

    /// Blocks (engine hashes) tracked for `worker`.
    pub fn blocks_of(&self, worker: WorkerId) -> usize {
        self.workers.get(&worker).map_or(0, |w| w.blocks.len())
    }

    /// Drops everything `worker` holds but keeps tracking it (`AllBlocksCleared`, or the
    /// publisher restarted: its sequence went back).
    pub fn clear(&mut self, worker: WorkerId) {
        if let Some(w) = self.workers.get_mut(&worker) {
            w.blocks.clear();
            self.gpu.clear_worker(worker);
            self.lower.clear_worker(worker);
            self.predicted.clear_worker(worker);
            self.stats.clears += 1;
        }
    }

    /// Records at `now` that `worker` is about to hold the blocks `hashes` (own hashes) of a
    /// request routed to it: they count as held (fully, like GPU blocks) until `until`, so a
    /// sibling routed before the engine's `BlockStored` arrives finds them. Callers predict
    /// at routing time until the request's deadline, then again at its first token until
    /// `first token + predict window` (the event's delivery time). Ignored for untracked
    /// workers and when the window is 0.
    pub fn predict(&mut self, worker: WorkerId, hashes: &[BlockHash], now: Nanos, until: Nanos) {
        if self.workers.contains_key(&worker) {
            self.predicted.predict(worker, hashes, now, until);
        }
    }

    /// The predict-on-route window ([`PreciseConfig::predict_window_secs`]).
    pub fn predict_window(&self) -> Nanos {
        self.predicted.window()
    }

    /// Applies a `BlockStored` event of `worker` (tracked implicitly). Our own hash of each
    /// block chains from the parent's own hash (the root seed when `parent` is `None`).
    /// Skipped, and counted, when the parent is unknown or the tokens do not cover the
    /// blocks.
    pub fn stored(&mut self, worker: WorkerId, ev: StoredBlocks<'_>, now: Nanos) {
        let bs = ev.block_size as usize;
        let n = ev.engine_hashes.len();
        if bs == 0 || ev.token_ids.len() < n * bs {
            self.stats.malformed += 1;
            return;
        }
        let w = self.workers.entry(worker).or_default();
        let mut parent = match ev.parent {
            None => ROOT_SEED,
            Some(p) => match w.blocks.get(&p) {
                Some((own, _, _)) => own.0,
                None => {
                    self.stats.unknown_parent += 1;
                    return;
                }
            },
        };
        if w.blocks.len() + n > self.cfg.max_blocks_per_worker {
            w.blocks.clear();
            self.gpu.clear_worker(worker);
            self.lower.clear_worker(worker);
            self.stats.overflows += 1;
            self.stats.clears += 1;
            if ev.parent.is_some() {
                return;
            }
        }
        w.block_size = Some(ev.block_size);
        let mut own = Vec::with_capacity(n);
        for (i, &eh) in ev.engine_hashes.iter().enumerate() {
            self.buf.clear();
            for t in &ev.token_ids[i * bs..(i + 1) * bs] {
                self.buf.extend_from_slice(&t.to_le_bytes());
            }
            parent = HashAlgo::Xxh3.chain(parent, &self.buf);
            let h = BlockHash(parent);
            let e = w.blocks.entry(eh).or_insert((h, false, false));
            e.0 = h;
            match ev.tier {
                Tier::Gpu => e.1 = true,
                Tier::Lower => e.2 = true,
            }
            own.push(h);
        }
        match ev.tier {
            Tier::Gpu => self.gpu.store(worker, &own, now),
            Tier::Lower => self.lower.store(worker, &own, now),
        }
        self.stats.stored += n as u64;
    }

    /// Applies a `BlockRemoved` event of `worker` for `tier`.
    pub fn removed(&mut self, worker: WorkerId, engine_hashes: &[u64], tier: Tier) {
        let Some(w) = self.workers.get_mut(&worker) else { return };
        let mut own = Vec::with_capacity(engine_hashes.len());
        for eh in engine_hashes {
            let Some(e) = w.blocks.get_mut(eh) else {
                self.stats.unknown_removed += 1;
                continue;
            };
            match tier {
                Tier::Gpu => e.1 = false,
                Tier::Lower => e.2 = false,
            }
            own.push(e.0);
            if !e.1 && !e.2 {
                w.blocks.remove(eh);
            }
        }
        match tier {
            Tier::Gpu => self.gpu.remove(worker, &own),
            Tier::Lower => self.lower.remove(worker, &own),
        }
        self.predicted.forget(worker, &own);
        self.stats.removed += own.len() as u64;
    }

    /// Prompt tokens of a request that `worker` holds, as a weighted token count: the
    /// leading run of `hashes` (own hashes at `block_size` tokens per block, from
    /// [`hash_token_blocks`](crate::hash::hash_token_blocks)) found on the GPU counts
    /// fully (as do blocks inside the predict window, [`PreciseIndex::predict`]); the run
    /// continued on a lower tier counts `lower_tier_weight` per token.
    /// `None` when the worker is not tracked. O(matched blocks).
    pub fn cached_tokens(&self, worker: WorkerId, hashes: &[BlockHash], block_size: u32, now: Nanos) -> Option<u64> {
        if !self.workers.contains_key(&worker) {
            return None;
        }
        let mut gpu_run = 0usize;
        let mut any_run = 0usize;
        let mut on_gpu = true;
        for h in hashes {
            let g = self.gpu.overlap(worker, std::slice::from_ref(h), now) > 0 || self.predicted.holds(worker, *h, now);
            let l = !g && self.lower.overlap(worker, std::slice::from_ref(h), now) > 0;
            if !(g || l) {
                break;
            }
            on_gpu &= g;
            if on_gpu {
                gpu_run += 1;
            }
            any_run += 1;
        }
        let bs = f64::from(block_size);
        let w = self.cfg.lower_tier_weight.clamp(0.0, 1.0);
        Some((gpu_run as f64 * bs + (any_run - gpu_run) as f64 * bs * w) as u64)
    }

    /// [`PreciseIndex::cached_tokens`] of every worker in `ids` (whose engines share
    /// `block_size`), into `out` (one entry per id, `None` for an untracked worker): the same
    /// answers, with one index lookup per block for all workers instead of one per worker
    /// and block — a router over 1,024 engines holding a shared system prompt of 64 blocks
    /// made 65,536 lookups a request, holding the index's read lock while the event
    /// subscribers waited. A block held by exactly the engines of the block before (every
    /// engine still matching having matched that one on the GPU) is compared, not merged:
    /// a prompt every engine holds whole costs one merge and a comparison of holder lists
    /// per block. O(workers × log workers + matched blocks × (workers still matching +
    /// holders of the block)).
    pub fn cached_tokens_many(
        &self,
        ids: &[WorkerId],
        hashes: &[BlockHash],
        block_size: u32,
        now: Nanos,
        out: &mut Vec<Option<u64>>,
    ) {
        /// One worker's leading run so far: blocks on the GPU, blocks on any tier, and
        /// whether the run is still all on the GPU.
        #[derive(Clone, Copy)]
        struct Run {
            gpu: usize,
            any: usize,
            on_gpu: bool,
        }
        let mut runs = vec![Run { gpu: 0, any: 0, on_gpu: true }; ids.len()];
        // The tracked workers in increasing id order, so each block's holders (kept in the
        // same order) are merged with them in one pass.
        let mut active: Vec<(WorkerId, usize)> =
            (0..ids.len()).filter(|i| self.workers.contains_key(&ids[*i])).map(|i| (ids[i], i)).collect();
        active.sort_unstable();
        let predicted = !self.predicted.is_empty();
        // The previous block's GPU holders, when every engine still matching held it on the
        // GPU (no lower tier, no prediction involved).
        let mut prev_gpu: Option<crate::block_index::BlockHolders<'_>> = None;
        // Blocks since the last merge that every engine still matching matched on the GPU
        // (credited to them together, before the next merge and at the end).
        let mut same = 0;
        let credit = |active: &[(WorkerId, usize)], runs: &mut [Run], n: usize| {
            for &(_, i) in active {
                let r = &mut runs[i];
                r.gpu += if r.on_gpu { n } else { 0 };
                r.any += n;
            }
        };
        for h in hashes {
            if active.is_empty() {
                break;
            }
            let gpu_holders = self.gpu.holders(*h, now);
            let lower_holders = self.lower.holders(*h, now);
            let plain = !predicted && lower_holders.is_none();
            if plain
                && let (Some(prev), Some(cur)) = (&prev_gpu, &gpu_holders)
                && cur.same_precise_holders(prev)
            {
                // Held by the same engines as the block before, where every engine still
                // matching matched on the GPU: each of them matches this one too.
                same += 1;
                continue;
            }
            credit(&active, &mut runs, same);
            same = 0;
            prev_gpu = if plain { gpu_holders } else { None };
            let mut gpu = gpu_holders.map(|x| x.cursor()).unwrap_or_default();
            let mut lower = lower_holders.map(|x| x.cursor()).unwrap_or_default();
            active.retain(|&(w, i)| {
                let on_gpu = gpu.holds(w);
                let g = on_gpu || (predicted && self.predicted.holds(w, *h, now));
                let l = !g && lower.holds(w);
                if !(g || l) {
                    return false;
                }
                let r = &mut runs[i];
                r.on_gpu &= g;
                if r.on_gpu {
                    r.gpu += 1;
                }
                r.any += 1;
                true
            });
        }
        credit(&active, &mut runs, same);
        let bs = f64::from(block_size);
        let lw = self.cfg.lower_tier_weight.clamp(0.0, 1.0);
        out.clear();
        out.extend(ids.iter().zip(&runs).map(|(id, r)| {
            self.workers.contains_key(id).then(|| (r.gpu as f64 * bs + (r.any - r.gpu) as f64 * bs * lw) as u64)
        }));
    }
}

/// Predict-on-route: blocks a worker is assumed to hold because a request carrying them was
/// just routed there, each until `window` after its last prediction. Engines publish
/// `BlockStored` only when a prefill ends (vLLM, SGLang), so without this a burst of
/// requests sharing a new prefix would all look like misses and scatter; llm-d's precise
/// scorer and Dynamo's router keep the same kind of short-lived speculative entries.
///
/// Pure and bounded: at most `max_entries` (worker, block) entries, the oldest predictions
/// dropped first (expired entries are ignored until then). O(1) amortised per block.
#[derive(Debug, Clone)]
pub struct PredictWindow {
    window: Nanos,
    max_entries: usize,
    until: HashMap<(WorkerId, BlockHash), Nanos, foldhash::fast::FixedState>,
    order: std::collections::VecDeque<(Nanos, WorkerId, BlockHash)>,
    /// Live-entry count at which expired entries are next swept out.
    sweep_at: usize,
}

impl PredictWindow {
    /// A window of `window` (zero: nothing is ever predicted) holding at most
    /// `max_entries` entries.
    pub fn new(window: Nanos, max_entries: usize) -> Self {
        PredictWindow {
            window,
            max_entries: max_entries.max(1),
            until: HashMap::default(),
            order: Default::default(),
            sweep_at: 1024,
        }
    }

    /// The window (zero: off).
    pub fn window(&self) -> Nanos {
        self.window
    }

    /// `worker` holds `hashes` until `until` (a later prediction of a block replaces an
    /// earlier one), predicted at `now`. Nothing happens when the window is zero.
    pub fn predict(&mut self, worker: WorkerId, hashes: &[BlockHash], now: Nanos, until: Nanos) {
        if self.window.0 == 0 {
            return;
        }
        if self.until.len() >= self.sweep_at {
            // Amortised O(1): sweep expired and stale entries when the map has doubled.
            self.until.retain(|_, t| *t > now);
            let live = &self.until;
            self.order.retain(|(t, w, h)| live.get(&(*w, *h)) == Some(t));
            self.sweep_at = (2 * self.until.len()).max(1024);
        }
        for &h in hashes {
            self.until.insert((worker, h), until);
            self.order.push_back((until, worker, h));
        }
        while self.until.len() > self.max_entries {
            let Some((t, w, h)) = self.order.pop_front() else { break };
            if self.until.get(&(w, h)) == Some(&t) {
                self.until.remove(&(w, h));
            }
        }
        // Stale queue entries (re-predicted blocks) are bounded by twice the live ones.
        if self.order.len() > 2 * self.max_entries {
            let live = &self.until;
            self.order.retain(|(t, w, h)| live.get(&(*w, *h)) == Some(t));
        }
    }

    /// Whether `worker` is predicted to hold `h` at `now`.
    pub fn holds(&self, worker: WorkerId, h: BlockHash, now: Nanos) -> bool {
        self.until.get(&(worker, h)).is_some_and(|t| *t > now)
    }

    /// Leading blocks of `hashes` that `worker` holds at `now` by prediction or by
    /// `cached(h)` (the engine's own state), block by block.
    pub fn run(
        &self,
        worker: WorkerId,
        hashes: &[BlockHash],
        now: Nanos,
        cached: impl Fn(&BlockHash) -> bool,
    ) -> usize {
        hashes.iter().take_while(|h| cached(h) || self.holds(worker, **h, now)).count()
    }

    /// Drops the predictions of `hashes` on `worker` (the engine evicted them).
    pub fn forget(&mut self, worker: WorkerId, hashes: &[BlockHash]) {
        for h in hashes {
            self.until.remove(&(worker, *h));
        }
    }

    /// Drops every prediction for `worker`.
    pub fn clear_worker(&mut self, worker: WorkerId) {
        self.until.retain(|(w, _), _| *w != worker);
    }

    /// Live entries (for tests and metrics).
    pub fn len(&self) -> usize {
        self.until.len()
    }

    /// Whether no prediction is held.
    pub fn is_empty(&self) -> bool {
        self.until.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::hash_token_blocks;

    fn own(tokens: &[u32], bs: usize) -> Vec<BlockHash> {
        let mut out = Vec::new();
        hash_token_blocks(tokens, bs, usize::MAX, HashAlgo::Xxh3, &mut out);
        out
    }

    const W: WorkerId = WorkerId(3);
    const NOW: Nanos = Nanos(0);

    fn stored<'a>(eh: &'a [u64], parent: Option<u64>, toks: &'a [u32], tier: Tier) -> StoredBlocks<'a> {
        StoredBlocks { engine_hashes: eh, parent, token_ids: toks, block_size: 4, tier }
    }

    #[test]
    fn own_hashes_match_the_request_side_chain_whatever_the_engine_hash() {
        let tokens: Vec<u32> = (0..16).collect();
        let mut ix = PreciseIndex::new(PreciseConfig::default());
        // Engine hashes are arbitrary (salted per process): two events, the second linked
        // to the first by the engine's parent hash.
        ix.stored(W, stored(&[0xaaa, 0xbbb], None, &tokens[..8], Tier::Gpu), NOW);
        ix.stored(W, stored(&[0xccc], Some(0xbbb), &tokens[8..12], Tier::Gpu), NOW);
        let req = own(&tokens, 4); // 4 blocks; the worker holds the first 3
        assert_eq!(ix.cached_tokens(W, &req, 4, NOW), Some(12));
        assert_eq!(ix.block_size(W), Some(4));
        // Another worker is untracked: no precise answer.
        assert_eq!(ix.cached_tokens(WorkerId(9), &req, 4, NOW), None);
        // A different prompt sharing only the first block.
        let mut other = tokens.clone();
        other[5] = 999;
        assert_eq!(ix.cached_tokens(W, &own(&other, 4), 4, NOW), Some(4));
    }

    #[test]
    fn removal_cuts_the_run_and_clear_empties_the_worker() {
        let tokens: Vec<u32> = (100..116).collect();
        let mut ix = PreciseIndex::new(PreciseConfig::default());
        ix.stored(W, stored(&[1, 2, 3, 4], None, &tokens, Tier::Gpu), NOW);
        ix.removed(W, &[3, 4], Tier::Gpu);
        assert_eq!(ix.cached_tokens(W, &own(&tokens, 4), 4, NOW), Some(8));
        assert_eq!(ix.blocks_of(W), 2);
        ix.removed(W, &[77], Tier::Gpu);
        assert_eq!(ix.stats().unknown_removed, 1);
        ix.clear(W);
        assert_eq!(ix.cached_tokens(W, &own(&tokens, 4), 4, NOW), Some(0));
        assert!(ix.is_tracked(W));
        ix.untrack(W);
        assert_eq!(ix.cached_tokens(W, &own(&tokens, 4), 4, NOW), None);
    }

    #[test]
    fn lower_tiers_count_with_their_weight() {
        let tokens: Vec<u32> = (0..12).collect();
        let mut ix = PreciseIndex::new(PreciseConfig { lower_tier_weight: 0.25, ..PreciseConfig::default() });
        ix.stored(W, stored(&[1, 2, 3], None, &tokens, Tier::Gpu), NOW);
        // Blocks 2 and 3 are offloaded to CPU, then dropped from the GPU.
        ix.stored(W, stored(&[2, 3], Some(1), &tokens[4..], Tier::Lower), NOW);
        ix.removed(W, &[2, 3], Tier::Gpu);
        // 1 GPU block (4 tokens) + 2 CPU blocks at 0.25 (2 tokens).
        assert_eq!(ix.cached_tokens(W, &own(&tokens, 4), 4, NOW), Some(6));
        assert_eq!(Tier::of_medium(Some("CPU")), Tier::Lower);
        assert_eq!(Tier::of_medium(Some("GPU")), Tier::Gpu);
        assert_eq!(Tier::of_medium(None), Tier::Gpu);
    }

    #[test]
    fn unknown_parents_and_short_tokens_are_skipped_and_counted() {
        let tokens: Vec<u32> = (0..8).collect();
        let mut ix = PreciseIndex::new(PreciseConfig::default());
        ix.stored(W, stored(&[5], Some(404), &tokens[..4], Tier::Gpu), NOW);
        ix.stored(W, stored(&[5, 6], None, &tokens[..5], Tier::Gpu), NOW);
        let s = ix.stats();
        assert_eq!((s.unknown_parent, s.malformed, s.stored), (1, 1, 0));
        assert_eq!(ix.cached_tokens(W, &own(&tokens, 4), 4, NOW), Some(0));
    }

    #[test]
    fn a_worker_past_its_bound_is_dropped_and_rebuilt() {
        let tokens: Vec<u32> = (0..12).collect();
        let mut ix = PreciseIndex::new(PreciseConfig { max_blocks_per_worker: 2, ..PreciseConfig::default() });
        ix.stored(W, stored(&[1, 2], None, &tokens[..8], Tier::Gpu), NOW);
        ix.stored(W, stored(&[3], Some(2), &tokens[8..], Tier::Gpu), NOW);
        assert_eq!(ix.stats().overflows, 1);
        assert!(ix.blocks_of(W) <= 2);
        ix.stored(W, stored(&[9], None, &tokens[..4], Tier::Gpu), NOW);
        assert_eq!(ix.cached_tokens(W, &own(&tokens, 4), 4, NOW), Some(4));
    }
}

#[cfg(test)]
mod predict_tests {
    use super::*;
    use crate::hash::hash_token_blocks;

    const W: WorkerId = WorkerId(1);

    fn own(tokens: &[u32]) -> Vec<BlockHash> {
        let mut out = Vec::new();
        hash_token_blocks(tokens, 4, usize::MAX, HashAlgo::Xxh3, &mut out);
        out
    }

    #[test]
    fn a_routed_prompt_counts_until_the_window_ends_or_the_engine_evicts_it() {
        let tokens: Vec<u32> = (0..16).collect();
        let req = own(&tokens);
        let mut ix = PreciseIndex::new(PreciseConfig::default());
        ix.track(W);
        assert_eq!(ix.cached_tokens(W, &req, 4, Nanos::from_secs(10)), Some(0));
        // Predicted until t = 12 s: a sibling at 11 s finds it, one at 12 s does not.
        ix.predict(W, &req[..3], Nanos::from_secs(10), Nanos::from_secs(12));
        assert_eq!(ix.cached_tokens(W, &req, 4, Nanos::from_secs(11)), Some(12));
        assert_eq!(ix.cached_tokens(W, &req, 4, Nanos::from_secs(12)), Some(0));
        // The engine's BlockStored makes it permanent; its BlockRemoved ends it and the prediction.
        ix.predict(W, &req, Nanos::from_secs(20), Nanos::from_secs(22));
        ix.stored(
            W,
            StoredBlocks {
                engine_hashes: &[7, 8],
                parent: None,
                token_ids: &tokens[..8],
                block_size: 4,
                tier: Tier::Gpu,
            },
            Nanos::from_secs(20),
        );
        ix.removed(W, &[8], Tier::Gpu);
        assert_eq!(ix.cached_tokens(W, &req, 4, Nanos::from_secs(21)), Some(4));
        assert_eq!(ix.cached_tokens(W, &req, 4, Nanos::from_secs(100)), Some(4));
        // Untracked workers get no predictions; a clear drops them.
        ix.predict(WorkerId(5), &req, Nanos::from_secs(30), Nanos::from_secs(40));
        assert_eq!(ix.cached_tokens(WorkerId(5), &req, 4, Nanos::from_secs(30)), None);
        ix.predict(W, &req, Nanos::from_secs(30), Nanos::from_secs(40));
        ix.clear(W);
        assert_eq!(ix.cached_tokens(W, &req, 4, Nanos::from_secs(30)), Some(0));
    }

    #[test]
    fn the_window_is_bounded_and_zero_turns_it_off() {
        let hs: Vec<BlockHash> = (0..100).map(BlockHash).collect();
        let mut p = PredictWindow::new(Nanos::from_secs(5), 10);
        for i in 0..100 {
            p.predict(W, &hs[i..i + 1], Nanos(i as u64), Nanos(i as u64 + 5_000_000_000));
        }
        assert_eq!(p.len(), 10);
        assert!(p.holds(W, hs[99], Nanos(100)) && !p.holds(W, hs[0], Nanos(100)));
        assert_eq!(p.run(W, &hs[90..], Nanos(100), |_| false), 10);
        assert_eq!(p.run(W, &hs[..], Nanos(100), |h| h.0 < 3), 3);
        // Expired entries are swept once the map has grown: a long run of short predictions
        // does not keep them all.
        let mut sweep = PredictWindow::new(Nanos(1), 1 << 20);
        for i in 0..10_000u64 {
            sweep.predict(W, &[BlockHash(i)], Nanos(i), Nanos(i + 1));
        }
        assert!(sweep.len() <= 1024, "{}", sweep.len());
        let mut off = PredictWindow::new(Nanos(0), 10);
        off.predict(W, &hs, Nanos(0), Nanos(10));
        assert!(off.is_empty());
    }
}
