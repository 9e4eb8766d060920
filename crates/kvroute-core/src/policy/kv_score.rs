//! `kv_score`: cgn-router's four-term linear KV-aware score (Cognitora cgn-router,
//! "Routing — KV-aware scoring deep dive").
//!
//! ```text
//! score(n) = w_kv · overlap(prefix, n) + w_load · (1 − util(n))
//!          + w_pwr · (1 − norm_watts(n)) + w_cap · capacity(n)
//! ```
//!
//! each term in [0, 1], highest score wins. The defaults are cgn-router's; kvroute's
//! alternatives are knobs (docs/configuration.md, "Where each policy differs from its
//! source", and docs/replay.md, "Choosing a policy", for why they exist):
//! - `overlap`: the prompt's first `prefix_tokens` tokens (default 64, cgn-router's "~64";
//!   `1048576` hashes the whole prompt) are cut into `block_tokens` (16) blocks and hashed
//!   as a chain (`hash`: BLAKE3 as cgn-router, or `xxh3`); overlap = leading blocks the
//!   worker holds / blocks hashed, from a [`BlockIndex`] fed by this policy's own decisions
//!   (expiring after `ttl_secs`). Precomputed block hashes (traces) count as many blocks as
//!   cover `prefix_tokens` at their own block size (at least one); text without tokens is
//!   cut into `block_tokens × 4`-byte chunks. With KV events (`WorkerView::cached_tokens`
//!   set), the engine-reported cached share of the first `prefix_tokens` tokens.
//! - `util` ([`LoadSignal`]): cgn-router's `max(in_flight / max_concurrent, sm_util)`
//!   (`seed`, the default), or the worker's queued work over the fleet's most loaded
//!   (`queue`).
//! - `norm_watts = watts / max watts over the candidates` (0 when unknown).
//! - `capacity`: `tp_size × vram_gib / dtype_bytes` normalised by the candidates' maximum;
//!   0 for a worker with no free model slot.
//!
//! **Tie-break**: workers within `epsilon` (0.01) of the best score are ordered by a hash
//! of (worker, prefix hash) ([`tie_hash_key`]), so a prefix-bound request keeps the same
//! worker across retries and replicas. The worker is named by its
//! [`WorkerView::tie_key`] (the gateway: a hash of its URL), so replicas that list the same
//! workers in another order agree; without one, by its id ([`tie_hash`]). A prompt shorter
//! than one block is keyed by a hash of its whole text (or tokens), so short prompts
//! spread over the tied workers instead of all landing on one. Branch `tie_break`, else
//! `score`.
//!
//! **Live weights**: the four weights and `epsilon` sit in an `ArcSwap` swapped whole, as
//! cgn-router's do: [`Policy::set_live_knobs`] changes them without `&mut self`, so the
//! gateway applies `PUT /policy` and the etcd policy key under its read lock and no decision
//! waits. Other knobs go through [`Policy::set_knobs`].

use crate::block_index::{BlockIndex, BlockIndexConfig};
use crate::hash::{HashAlgo, prefix_key, request_blocks, stable_hash};
use crate::policy::{
    Branch, Decision, KnobError, MAX_FALLBACKS, MatchUnit, PickCtx, Policy, RequestKey, RouteError, patch_knobs,
};
use crate::types::{BlockHash, Nanos, RequestView, WorkerId, WorkerView};
use serde::{Deserialize, Serialize};

/// The four score weights (Cognitora cgn-router defaults 0.55 / 0.25 / 0.10 / 0.10).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct KvWeights {
    /// Weight of the KV prefix overlap.
    pub w_kv: f64,
    /// Weight of `1 − util`.
    pub w_load: f64,
    /// Weight of `1 − norm_watts`.
    pub w_pwr: f64,
    /// Weight of the static capacity.
    pub w_cap: f64,
}

impl Default for KvWeights {
    fn default() -> Self {
        KvWeights { w_kv: 0.55, w_load: 0.25, w_pwr: 0.10, w_cap: 0.10 }
    }
}

/// Knobs of `kv_score`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvScoreConfig {
    /// Weight of the KV prefix overlap.
    pub w_kv: f64,
    /// Weight of `1 − util`.
    pub w_load: f64,
    /// Weight of `1 − norm_watts`.
    pub w_pwr: f64,
    /// Weight of the static capacity.
    pub w_cap: f64,
    /// Scores within this distance of the best are ties.
    pub epsilon: f64,
    /// Leading prompt tokens hashed for the overlap.
    pub prefix_tokens: u32,
    /// Tokens per hashed block.
    pub block_tokens: u32,
    /// Block hash function.
    pub hash: HashAlgo,
    /// Lifetime of an index entry after its last use, seconds.
    pub ttl_secs: f64,
    /// Maximum (block, worker) entries in the index.
    pub max_entries: usize,
    /// What `util` in the load term measures ([`LoadSignal`]).
    pub load_signal: LoadSignal,
}

/// What the load term `w_load × (1 − util)` of kv_score measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadSignal {
    /// Cognitora cgn-router's (the default): `util = max(in_flight / max_concurrent,
    /// sm_util)`, at most one, `sm_util` from the engine's or DCGM's metrics when the
    /// gateway scrapes them. It saturates on any busy engine, so with a common system
    /// prompt the overlap term wins every time and one worker gets everything.
    #[default]
    Seed,
    /// The worker's queued work relative to the fleet's most loaded: `util = q / max q`
    /// with `q` = the prefill tokens it has not started (`pending_prefill_tokens`) plus
    /// 1,000 tokens per request it runs or queues, so a worker's score falls as its queue
    /// grows, whatever the engine's size.
    Queue,
}

/// Tokens a running or waiting request counts for in [`LoadSignal::Queue`] (a decode
/// slot and its share of the batch, in prefill-token terms).
const QUEUE_TOKENS_PER_REQUEST: f64 = 1000.0;

impl Default for KvScoreConfig {
    fn default() -> Self {
        let w = KvWeights::default();
        KvScoreConfig {
            w_kv: w.w_kv,
            w_load: w.w_load,
            w_pwr: w.w_pwr,
            w_cap: w.w_cap,
            epsilon: 0.01,
            prefix_tokens: 64,
            block_tokens: 16,
            hash: HashAlgo::Blake3,
            ttl_secs: 120.0,
            max_entries: 1 << 22,
            load_signal: LoadSignal::Seed,
        }
    }
}

impl KvScoreConfig {
    /// The weights part.
    pub fn weights(&self) -> KvWeights {
        KvWeights { w_kv: self.w_kv, w_load: self.w_load, w_pwr: self.w_pwr, w_cap: self.w_cap }
    }

    /// Checks ranges.
    ///
    /// # Errors
    /// A message naming the knob out of range.
    pub fn validate(&self) -> Result<(), String> {
        for (name, v) in [("w_kv", self.w_kv), ("w_load", self.w_load), ("w_pwr", self.w_pwr), ("w_cap", self.w_cap)] {
            if !(v >= 0.0 && v.is_finite()) {
                return Err(format!("{name} must be a finite weight >= 0, got {v}"));
            }
        }
        if !(self.epsilon >= 0.0 && self.epsilon.is_finite()) {
            return Err(format!("epsilon must be >= 0, got {}", self.epsilon));
        }
        if self.block_tokens == 0 || self.prefix_tokens < self.block_tokens {
            return Err("block_tokens must be >= 1 and prefix_tokens >= block_tokens".into());
        }
        if self.ttl_secs.is_nan() || self.ttl_secs <= 0.0 {
            return Err(format!("ttl_secs must be > 0, got {}", self.ttl_secs));
        }
        Ok(())
    }
}

/// The knobs `kv_score` reads through a shared cell ([`Policy::set_live_knobs`]): the four
/// weights and `epsilon`, swapped together as cgn-router swaps its weights (`ArcSwap`).
const LIVE_KNOBS: [&str; 5] = ["w_kv", "w_load", "w_pwr", "w_cap", "epsilon"];

/// The live part of the configuration: weights and tie band.
#[derive(Debug, Clone, Copy)]
struct Live {
    weights: KvWeights,
    epsilon: f64,
}

impl Live {
    fn of(cfg: &KvScoreConfig) -> Self {
        Live { weights: cfg.weights(), epsilon: cfg.epsilon }
    }
}

/// The `kv_score` policy.
#[derive(Debug, Clone)]
pub struct KvScore {
    /// Every knob; its weights and `epsilon` are those of the last [`Policy::set_knobs`]
    /// (the live ones are in `live`).
    cfg: KvScoreConfig,
    /// Shared with the policy's twin ([`Policy::twin`]), so a live change reaches both.
    live: std::sync::Arc<arc_swap::ArcSwap<Live>>,
    index: BlockIndex,
}

impl KvScore {
    /// A policy with `cfg` (validate it first).
    pub fn new(cfg: KvScoreConfig) -> Self {
        let index = BlockIndex::new(BlockIndexConfig { ttl_secs: cfg.ttl_secs, max_entries: cfg.max_entries });
        KvScore { live: std::sync::Arc::new(arc_swap::ArcSwap::from_pointee(Live::of(&cfg))), cfg, index }
    }

    /// The configuration with the live weights and `epsilon`.
    fn current(&self) -> KvScoreConfig {
        let live = self.live.load();
        let w = live.weights;
        KvScoreConfig {
            w_kv: w.w_kv,
            w_load: w.w_load,
            w_pwr: w.w_pwr,
            w_cap: w.w_cap,
            epsilon: live.epsilon,
            ..self.cfg.clone()
        }
    }

    fn hash_request(&self, req: &RequestView<'_>) -> Vec<BlockHash> {
        // Cognitora cgn-router hashes the first `prefix_tokens` tokens. Precomputed blocks
        // (traces, KV events) have their own block size, so take as many of them as cover
        // that many tokens (at least one): the whole prompt by default; with cgn-router's
        // 64 tokens and Mooncake's 512-token blocks, one block.
        let block_tokens = req.blocks.map_or(self.cfg.block_tokens, |seq| seq.block_tokens.max(1));
        let max_blocks = self.cfg.prefix_tokens.div_ceil(block_tokens).max(1) as usize;
        let mut blocks = Vec::new();
        request_blocks(req, self.cfg.block_tokens as usize, max_blocks, self.cfg.hash, &mut blocks);
        blocks
    }
}

fn capacity_raw(w: &WorkerView) -> f64 {
    let c = &w.capacity;
    if c.free_model_slots == 0 {
        return 0.0;
    }
    f64::from(c.tp_size) * c.vram_gib.max(0.0) / f64::from(c.dtype_bytes.max(1))
}

/// The tie-break hash of (worker id, prefix hash). The hash function is the same in every
/// process; the worker id is this router's, so replicas agree only when they handed out
/// the same ids (the same workers added in the same order).
pub fn tie_hash(worker: WorkerId, prefix_hash: u64) -> u64 {
    // The id's 4 bytes, then the prefix hash's 8.
    crate::hash::stable_hash_12(u64::from(worker.0), 4, prefix_hash)
}

/// The tie-break hash of (worker key, prefix hash), for a worker named by its
/// [`WorkerView::tie_key`]: the same in every process and on every replica.
pub fn tie_hash_key(worker_key: u64, prefix_hash: u64) -> u64 {
    // The key's 8 bytes, then the prefix hash's 8.
    crate::hash::stable_hash_16(worker_key, prefix_hash)
}

/// The prefix hash of a request: its last block hash, or for a prompt shorter than one
/// block a hash of the whole prompt.
fn request_prefix(req: &RequestView<'_>, blocks: &[crate::types::BlockHash]) -> u64 {
    if !blocks.is_empty() {
        return prefix_key(blocks);
    }
    if let Some(t) = req.token_ids.filter(|t| !t.is_empty()) {
        let bytes: Vec<u8> = t.iter().flat_map(|x| x.to_le_bytes()).collect();
        return stable_hash(&bytes);
    }
    req.text.map_or_else(|| prefix_key(blocks), |t| stable_hash(t.as_bytes()))
}

impl Policy for KvScore {
    fn name(&self) -> &'static str {
        "kv_score"
    }

    fn key(&self, req: &RequestView<'_>) -> RequestKey {
        let block_tokens = req.blocks.map_or(self.cfg.block_tokens, |seq| seq.block_tokens.max(1));
        RequestKey { blocks: self.hash_request(req), block_tokens: u64::from(block_tokens), worker_kv_tokens: None }
    }

    fn pick(
        &self,
        req: &RequestView<'_>,
        key: &RequestKey,
        c: &[WorkerView],
        ctx: &mut PickCtx<'_>,
    ) -> Result<Decision, RouteError> {
        let blocks = &key.blocks;
        let mut overlaps = Vec::new();
        self.index.overlaps(blocks, ctx.now, &mut overlaps);
        let live = **self.live.load();
        let w = live.weights;
        let routable = || c.iter().filter(|w| w.is_routable());
        let queued = |v: &WorkerView| {
            v.pending_prefill_tokens as f64
                + QUEUE_TOKENS_PER_REQUEST * f64::from(v.in_flight.saturating_add(v.waiting))
        };
        // The fleet's maxima the terms are normalised by, in one pass.
        let (max_watts, max_cap, max_queued) = routable().fold((0.0_f64, 0.0_f64, 0.0_f64), |(wt, cp, q), v| {
            (v.power_watts.map_or(wt, |x| wt.max(x)), cp.max(capacity_raw(v)), q.max(queued(v)))
        });
        let n_blocks = blocks.len();
        let mut scored: Vec<(f64, WorkerId, Option<u64>)> = Vec::with_capacity(c.len());
        let mut next = 0; // `overlaps` is sorted by worker id, as candidates usually are.
        for v in routable() {
            let held = crate::select::find_sorted(&overlaps, &mut next, v.id).unwrap_or(0);
            let overlap = match v.cached_tokens {
                // Precise (engine KV events): the cached share of the first prefix_tokens.
                Some(t) => {
                    let p = u64::from(req.input_tokens.min(self.cfg.prefix_tokens));
                    if p == 0 { 0.0 } else { t.min(p) as f64 / p as f64 }
                }
                None if n_blocks == 0 => 0.0,
                None => held as f64 / n_blocks as f64,
            };
            let util = match self.cfg.load_signal {
                LoadSignal::Seed => (f64::from(v.in_flight) / f64::from(v.capacity.max_concurrent.max(1)))
                    .max(v.sm_util.unwrap_or(0.0))
                    .clamp(0.0, 1.0),
                LoadSignal::Queue if max_queued > 0.0 => (queued(v) / max_queued).clamp(0.0, 1.0),
                LoadSignal::Queue => 0.0,
            };
            let norm_watts =
                if max_watts > 0.0 { (v.power_watts.unwrap_or(0.0) / max_watts).clamp(0.0, 1.0) } else { 0.0 };
            let capacity = if max_cap > 0.0 { capacity_raw(v) / max_cap } else { 0.0 };
            let score = w.w_kv * overlap + w.w_load * (1.0 - util) + w.w_pwr * (1.0 - norm_watts) + w.w_cap * capacity;
            scored.push((score, v.id, v.tie_key));
        }
        if scored.is_empty() {
            return Err(RouteError::NoWorker);
        }
        let best = scored.iter().map(|(s, _, _)| *s).fold(f64::NEG_INFINITY, f64::max);
        let eps = live.epsilon;
        let prefix = request_prefix(req, blocks);
        let tied = scored.iter().filter(|(s, _, _)| *s >= best - eps).count();
        // Order: by score descending, and within the tie band by the stable hash. One sort
        // key per worker (tie band first, by descending stable hash; then by descending
        // score), the hash computed only for workers in the band; only the winner and its
        // fallbacks are needed, so the 1 + MAX_FALLBACKS smallest keys are kept in one pass
        // instead of sorting the fleet (keys are distinct: they end with the worker id).
        let desc = |x: f64| {
            let b = x.to_bits();
            !(if b >> 63 == 1 { !b } else { b | (1 << 63) })
        };
        let sort_key = |&(sc, id, key): &(f64, WorkerId, Option<u64>)| {
            if sc >= best - eps {
                let tie = match key {
                    Some(k) => tie_hash_key(k, prefix),
                    None => tie_hash(id, prefix),
                };
                (0u8, !tie, id)
            } else {
                (1u8, desc(sc), id)
            }
        };
        let head =
            crate::select::smallest_k(scored.iter().enumerate().map(|(i, w)| (sort_key(w), i)), 1 + MAX_FALLBACKS);
        let scored: Vec<(f64, WorkerId, Option<u64>)> = head.iter().map(|&(_, i)| scored[i]).collect();
        let (score, winner, _) = scored[0];
        let held = overlaps.binary_search_by_key(&winner, |(id, _)| *id).map_or(0, |i| overlaps[i].1);
        let mut d = Decision::new(winner, if tied > 1 { Branch::TieBreak } else { Branch::Score })
            .with_match(held as u64, n_blocks as u64, if n_blocks == 0 { MatchUnit::None } else { MatchUnit::Blocks })
            .with_score(score);
        d.fallbacks = scored[1..].iter().take(MAX_FALLBACKS).map(|(_, id, _)| *id).collect();
        Ok(d)
    }

    fn on_routed(&mut self, _req: &RequestView<'_>, key: &RequestKey, worker: WorkerId, now: Nanos) {
        self.index.record(worker, &key.blocks, now);
    }

    fn on_worker_removed(&mut self, worker: WorkerId) {
        self.index.clear_worker(worker);
    }

    fn maintain(&mut self, now: Nanos, _max_evictions: usize) -> bool {
        // One pass over the block map (TTL expiry, then the entry budget); not sliced.
        self.index.evict(now);
        false
    }

    fn maintenance_interval(&self) -> Option<Nanos> {
        Some(Nanos::from_secs(10))
    }

    fn knobs(&self) -> serde_json::Value {
        serde_json::to_value(self.current()).unwrap_or_default()
    }

    fn set_live_knobs(&self, patch: &serde_json::Value) -> Option<Result<(), KnobError>> {
        let only_live = patch.as_object()?.keys().all(|k| LIVE_KNOBS.contains(&k.as_str()));
        if !only_live {
            return None;
        }
        Some(
            patch_knobs("kv_score", &self.current(), patch, KvScoreConfig::validate)
                .map(|next| self.live.store(std::sync::Arc::new(Live::of(&next)))),
        )
    }

    fn set_knobs(&mut self, patch: &serde_json::Value) -> Result<(), KnobError> {
        let next = patch_knobs("kv_score", &self.current(), patch, KvScoreConfig::validate)?;
        if next.ttl_secs != self.cfg.ttl_secs || next.max_entries != self.cfg.max_entries {
            // Index limits changed: rebuild (the approximate state is soft and relearned).
            self.index = BlockIndex::new(BlockIndexConfig { ttl_secs: next.ttl_secs, max_entries: next.max_entries });
        }
        self.live.store(std::sync::Arc::new(Live::of(&next)));
        self.cfg = next;
        Ok(())
    }

    fn index_size(&self) -> u64 {
        self.index.entries() as u64
    }
}
