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
//! **Deciding without scoring every worker**: a worker holding none of the prefix scores at
//! most the score of the fleet's least util and power and most capacity with no overlap,
//! so when that bound lies below the best holder's score minus `epsilon`, the holders
//! alone make the tie band and are all that is scored and hashed (one pass gathers the
//! norms, those extremes and the holders). Given a digest that keeps the fleet's norms
//! and extremes as the views change ([`KV_SCORE_TERMS`], [`PickCtx::fleet`]; the replay
//! and `kvroute bench decision` keep one, `kvroute serve` does not) the pass is skipped:
//! the holders are found by position and theirs are the only views read. With nothing of
//! the prompt cached, such a digest can also show that every routable worker is within
//! `epsilon` of the best (the best possible score minus `epsilon` is at most the worst
//! possible one, as on a lightly loaded fleet of one kind of engine): the winner is then
//! the largest tie-break hash over the fleet, found in one pass that scores no worker.
//! When only part of the fleet ties but every worker reports the same power and capacity
//! (one kind of engine, busier), every score falls as util grows: the band is read from
//! the digest's util order until a score falls below the floor. Otherwise every worker is
//! scored. The same decision either way (property tests compare them with a full scan).
//! The retry order is not worked out with the decision: it keeps what ranks the workers
//! ([`Ranking`], a [`crate::policy::RetryOrder`]) and [`crate::policy::fallbacks`] ranks
//! the decision's views with it when a retry asks.
//!
//! **Live weights**: the four weights and `epsilon` sit in an `ArcSwap` swapped whole, as
//! cgn-router's do: [`Policy::set_live_knobs`] changes them without `&mut self`, so the
//! gateway applies `PUT /policy` and the etcd policy key under its read lock and no decision
//! waits. Other knobs go through [`Policy::set_knobs`].

use crate::block_index::{BlockIndex, BlockIndexConfig};
use crate::fleet_digest::{Figure, FleetDigest, ViewTerms};
use crate::hash::{HashAlgo, prefix_key, request_blocks, stable_hash};
use crate::policy::{
    Branch, Decision, KnobError, MAX_FALLBACKS, MatchUnit, PickCtx, Policy, RequestKey, RouteError, patch_knobs,
};
use crate::types::{BlockHash, Nanos, RequestView, WorkerId, WorkerView};
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

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
#[derive(Debug, Clone, Copy, PartialEq)]
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

impl KvScore {
    /// What ranks the workers for `req` (its key `key`): the live weights, the overlaps the
    /// index holds for its blocks at `now`, its tie-break prefix.
    fn ranking(&self, req: &RequestView<'_>, key: &RequestKey, now: Nanos) -> Ranking {
        let mut overlaps = Vec::new();
        self.index.overlaps(&key.blocks, now, &mut overlaps);
        Ranking {
            live: **self.live.load(),
            load_signal: self.cfg.load_signal,
            prefix_tokens: self.cfg.prefix_tokens,
            input_tokens: req.input_tokens,
            n_blocks: key.blocks.len(),
            prefix: request_prefix(req, &key.blocks),
            overlaps,
        }
    }
}

/// The score of a worker from its four terms, each in [0, 1] (the module's formula). With
/// weights ≥ 0 it never decreases as `overlap` or `capacity` grow nor increases as `util` or
/// `norm_watts` do, in floating point too (each operation is monotone): what lets a bound
/// computed from the fleet's extremes rule workers out.
#[inline]
fn score(w: KvWeights, overlap: f64, util: f64, norm_watts: f64, capacity: f64) -> f64 {
    w.w_kv * overlap + w.w_load * (1.0 - util) + w.w_pwr * (1.0 - norm_watts) + w.w_cap * capacity
}

/// The fleet's maxima the terms are normalised by (over the routable candidates).
#[derive(Debug, Clone, Copy, Default)]
struct Norms {
    max_watts: f64,
    max_cap: f64,
    max_queued: f64,
}

/// A worker's queued work for [`LoadSignal::Queue`], prefill tokens.
#[inline]
fn queued(v: &WorkerView) -> f64 {
    v.pending_prefill_tokens as f64 + QUEUE_TOKENS_PER_REQUEST * f64::from(v.in_flight.saturating_add(v.waiting))
}

/// Everything that ranks the candidates for one request but the views: the live weights
/// and tie band, what the policy's index holds of the request's blocks, and its tie-break
/// prefix. A decision keeps it ([`crate::policy::OwnOrder`]) so that the retry
/// order — the tie band by stable hash, then the rest by descending score — is worked out
/// only when a retry asks ([`crate::policy::fallbacks`]).
#[derive(Debug, PartialEq)]
pub struct Ranking {
    live: Live,
    load_signal: LoadSignal,
    prefix_tokens: u32,
    input_tokens: u32,
    /// Blocks hashed for the overlap.
    n_blocks: usize,
    /// The request's prefix hash ([`request_prefix`]).
    prefix: u64,
    /// (worker, leading blocks held), sorted by worker id.
    overlaps: Vec<(WorkerId, usize)>,
}

/// A ranked worker: its score, id and tie key.
type Scored = (f64, WorkerId, Option<u64>);

impl Ranking {
    /// The overlap term of `v`, which holds `held` of the request's leading blocks in the
    /// index: with KV events the engine-reported cached share of the first
    /// `prefix_tokens`, else the held share of the hashed blocks.
    #[inline]
    fn overlap(&self, v: &WorkerView, held: usize) -> f64 {
        match v.cached_tokens {
            Some(t) => {
                let p = u64::from(self.input_tokens.min(self.prefix_tokens));
                if p == 0 { 0.0 } else { t.min(p) as f64 / p as f64 }
            }
            None if self.n_blocks == 0 => 0.0,
            None => held as f64 / self.n_blocks as f64,
        }
    }

    /// Whether `v`'s overlap term is above zero ([`Ranking::overlap`] without its division).
    #[inline]
    fn holds(&self, v: &WorkerView, held: usize) -> bool {
        match v.cached_tokens {
            Some(t) => t > 0 && self.input_tokens.min(self.prefix_tokens) > 0,
            None => self.n_blocks > 0 && held > 0,
        }
    }

    /// The load term's `util` of `v`.
    #[inline]
    fn util(&self, v: &WorkerView, n: &Norms) -> f64 {
        match self.load_signal {
            LoadSignal::Seed => seed_util(v),
            LoadSignal::Queue => queue_util(queued(v), n),
        }
    }

    /// The score of `v`, which holds `held` leading blocks.
    #[inline]
    fn score_of(&self, v: &WorkerView, held: usize, n: &Norms) -> f64 {
        let norm_watts = norm_watts(v.power_watts.unwrap_or(0.0), n);
        score(self.live.weights, self.overlap(v, held), self.util(v, n), norm_watts, cap_share(capacity_raw(v), n))
    }

    /// The tie-break hash of a worker in the band: its tie key's, else its id's.
    #[inline]
    fn tie(&self, id: WorkerId, key: Option<u64>) -> u64 {
        match key {
            Some(k) => tie_hash_key(k, self.prefix),
            None => tie_hash(id, self.prefix),
        }
    }

    /// The sort key of the policy's order (smallest first): workers in the tie band
    /// (score ≥ `floor`) by descending stable hash, then the rest by descending score; the
    /// id last, so keys are distinct.
    #[inline]
    fn order_key(&self, &(sc, id, key): &Scored, floor: f64) -> (u8, u64, WorkerId) {
        if sc >= floor {
            let (tie, id) = self.tie_order(id, key);
            (0, tie, id)
        } else {
            (1, !crate::select::total_order_key(sc), id)
        }
    }

    /// The order within the tie band, smallest first: by descending stable hash, then id.
    #[inline]
    fn tie_order(&self, id: WorkerId, key: Option<u64>) -> (u64, WorkerId) {
        (!self.tie(id, key), id)
    }

    /// Every routable candidate's (score, id, tie key) given the fleet's norms `n`, in
    /// candidate order, and the best score (−∞ when none is routable or a number).
    fn scored(&self, c: &[WorkerView], n: &Norms) -> (Vec<Scored>, f64) {
        let mut scored = Vec::with_capacity(c.len());
        let mut best = f64::NEG_INFINITY;
        let mut next = 0; // `overlaps` is sorted by worker id, as candidates usually are.
        for v in c.iter().filter(|v| v.is_routable()) {
            let held = crate::select::find_sorted(&self.overlaps, &mut next, v.id).unwrap_or(0);
            let s = self.score_of(v, held, n);
            best = best.max(s);
            scored.push((s, v.id, v.tie_key));
        }
        (scored, best)
    }

    /// The first `k` workers of the policy's order over `c`, with how many share the tie
    /// band; `None` when no candidate is routable. Reads every view: the order of a full
    /// scan, which [`Ranking::holders_win`] reproduces without one when it can.
    fn ranked(&self, c: &[WorkerView], k: usize) -> Option<(SmallVec<[Scored; 16]>, usize)> {
        let (scored, best) = self.scored(c, &norms(c.iter().filter(|v| v.is_routable()), self.load_signal));
        if scored.is_empty() {
            return None;
        }
        let floor = best - self.live.epsilon;
        let tied = scored.iter().filter(|(s, _, _)| *s >= floor).count();
        // Only the head is needed: the k smallest keys in one pass, the hash computed only
        // for workers in the band.
        let head = crate::select::smallest_k(scored.iter().enumerate().map(|(i, w)| (self.order_key(w, floor), i)), k);
        Some((head.into_iter().map(|(_, i)| scored[i]).collect(), tied))
    }

    /// The decision by a full scan, in the order's own terms (what the policy's faster
    /// paths are checked against).
    #[cfg(test)]
    fn decide_by_scan(self, c: &[WorkerView]) -> Result<Decision, RouteError> {
        let (head, tied) = self.ranked(c, 1).ok_or(RouteError::NoWorker)?;
        let (score, worker, _) = head[0];
        Ok(self.decision(Winner { worker, score, tied }))
    }

    /// The winner when the workers holding part of the prefix (overlap > 0) are the only
    /// ones that can reach the tie band: one pass over the views that keeps the fleet's
    /// norms and, for the others, the extremes of each term (least util and power, most
    /// capacity) — no score, no hash — then the holders scored. `Err` with the fleet's
    /// norms when no worker holds any of the prefix or the others' best possible score
    /// reaches the band: the caller scans ([`Ranking::scan_winner`]). The same winner,
    /// score and band as the scan (a property test compares them): the others' scores are
    /// at most the bound, which lies below the band's floor.
    fn holders_win(&self, c: &[WorkerView]) -> Result<Winner, Norms> {
        let mut n = Norms::default();
        let mut rest = Extremes::default();
        let mut holders: SmallVec<[(usize, usize); 16]> = SmallVec::new();
        let mut next = 0;
        let mut caps = CapacityMemo::default();
        let queue = self.load_signal == LoadSignal::Queue;
        for (i, v) in c.iter().enumerate().filter(|(_, v)| v.is_routable()) {
            let held = crate::select::find_sorted(&self.overlaps, &mut next, v.id).unwrap_or(0);
            let raw_cap = caps.raw(v);
            let q = if queue { queued(v) } else { 0.0 };
            if let Some(x) = v.power_watts {
                n.max_watts = larger(n.max_watts, x);
            }
            n.max_cap = larger(n.max_cap, raw_cap);
            n.max_queued = larger(n.max_queued, q);
            if self.holds(v, held) {
                holders.push((i, held));
            } else {
                rest.add(v, raw_cap, q, self.load_signal);
            }
        }
        if holders.is_empty() {
            return Err(n);
        }
        self.holders_decide(c, &holders, n, &rest)
    }

    /// [`Ranking::holders_win`] with the fleet's norms and extremes read from a digest that
    /// keeps kv_score's terms ([`KV_SCORE_TERMS`]) and describes `c`: the holders are found
    /// from the index's overlaps by position, no other view is read. The extremes are
    /// over every routable worker, holders too: a bound at least the others', so the
    /// holders decide alone less often than after the pass, and always as a scan would.
    fn holders_win_kept(&self, c: &[WorkerView], f: &FleetDigest) -> Result<Winner, Norms> {
        let n = kept_norms(f, self.load_signal);
        let mut holders: SmallVec<[(usize, usize); 16]> = SmallVec::new();
        for &(id, held) in &self.overlaps {
            let Some(i) = f.position(id) else { continue };
            if c.get(i).is_some_and(|v| v.is_routable() && self.holds(v, held)) {
                holders.push((i, held));
            }
        }
        if holders.is_empty() {
            return Err(n);
        }
        let rest = Extremes {
            any: f.routable_count() > holders.len(),
            // The least seed util is kept divided (`util`); the fraction is left at 1.
            frac: (1, 1),
            util: f.term_min(TERM_UTIL).unwrap_or(f64::INFINITY),
            queued: f.term_min(TERM_QUEUED).unwrap_or(f64::INFINITY),
            watts: f.term_min(TERM_WATTS).unwrap_or(f64::INFINITY),
            cap: n.max_cap,
        };
        self.holders_decide(c, &holders, n, &rest)
    }

    /// The holders' winner (`holders`: positions in `c` and leading blocks held) when the
    /// others (their extremes `rest`) cannot reach the band; else `Err(n)`.
    fn holders_decide(
        &self,
        c: &[WorkerView],
        holders: &[(usize, usize)],
        n: Norms,
        rest: &Extremes,
    ) -> Result<Winner, Norms> {
        let scored: SmallVec<[Scored; 16]> =
            holders.iter().map(|&(i, held)| (self.score_of(&c[i], held, &n), c[i].id, c[i].tie_key)).collect();
        let best = scored.iter().map(|(s, _, _)| *s).fold(f64::NEG_INFINITY, f64::max);
        let floor = best - self.live.epsilon;
        // The others cannot reach the band (a NaN bound counts as reaching it).
        let others_out = !rest.any || rest.bound(self.live.weights, &n, self.load_signal) < floor;
        if !floor.is_finite() || !others_out {
            return Err(n);
        }
        let tied = scored.iter().filter(|(s, _, _)| *s >= floor).count();
        let (_, &(score, worker, _)) =
            scored.iter().map(|w| (self.order_key(w, floor), w)).min_by_key(|(k, _)| *k).ok_or(n)?;
        Ok(Winner { worker, score, tied })
    }

    /// The winner by scoring every routable worker, given the fleet's norms `n`: one pass
    /// for the scores and the best, one over the scores for the tie band's largest stable hash
    /// (what [`Ranking::ranked`] gives first, without keeping an order). `None` when no
    /// candidate is routable.
    fn scan_winner(&self, c: &[WorkerView], n: &Norms) -> Option<Winner> {
        // The band's pass reads the kept (score, id, tie key), 24 bytes a worker, not the
        // views again (at 4,096 workers the views outgrow the caches; the list does not).
        let (scored, best) = self.scored(c, n);
        let floor = best - self.live.epsilon;
        let mut tied = 0;
        let mut win: Option<((u64, WorkerId), usize)> = None;
        for (i, &(s, id, key)) in scored.iter().enumerate() {
            if s >= floor {
                tied += 1;
                let k = self.tie_order(id, key);
                if win.is_none_or(|(w, _)| k < w) {
                    win = Some((k, i));
                }
            }
        }
        match win {
            Some((_, i)) => Some(Winner { worker: scored[i].1, score: scored[i].0, tied }),
            // No score reached the floor (none is a number): the order's head.
            None => self.ranked(c, 1).map(|(head, tied)| Winner { worker: head[0].1, score: head[0].0, tied }),
        }
    }

    /// The winner when nothing of the prompt is cached and a digest keeping kv_score's
    /// terms shows that every routable worker is in the tie band: the score of the least
    /// util and power and most capacity (at least the best score) minus `epsilon` is at
    /// most the score of the most util and power and least capacity (at most any worker's),
    /// as on a lightly loaded fleet of one kind of engine. cgn-router's tie-break then takes
    /// the largest hash of (worker, prefix) over every routable worker — one pass over the
    /// views that scores none of them. The same winner, score and band as
    /// [`Ranking::scan_winner`] (every operation of the score is monotone, so each worker's
    /// score lies between the two). `None` when that is not shown: the caller scans.
    fn all_tie_winner(&self, c: &[WorkerView], f: &FleetDigest, n: &Norms) -> Option<Winner> {
        let terms = [TERM_WATTS, TERM_CAP, TERM_UTIL, TERM_QUEUED];
        if !self.overlaps.is_empty() || terms.iter().any(|&t| f.term_has_nan(t)) {
            return None;
        }
        let (least_util, most_util) = match self.load_signal {
            LoadSignal::Seed => (f.term_min(TERM_UTIL)?, f.term_max(TERM_UTIL)?),
            LoadSignal::Queue => (queue_util(f.term_min(TERM_QUEUED)?, n), queue_util(f.term_max(TERM_QUEUED)?, n)),
        };
        let w = self.live.weights;
        let (watts, cap) =
            ((f.term_min(TERM_WATTS)?, f.term_max(TERM_WATTS)?), (f.term_min(TERM_CAP)?, f.term_max(TERM_CAP)?));
        let upper = score(w, 0.0, least_util, norm_watts(watts.0, n), cap_share(cap.1, n));
        let lower = score(w, 0.0, most_util, norm_watts(watts.1, n), cap_share(cap.0, n));
        if !(upper.is_finite() && lower.is_finite() && lower >= upper - self.live.epsilon) {
            return None;
        }
        let mut tied = 0;
        let mut win: Option<((u64, WorkerId), &WorkerView)> = None;
        for v in c.iter().filter(|v| v.is_routable()) {
            tied += 1;
            let k = self.tie_order(v.id, v.tie_key);
            if win.is_none_or(|(w, _)| k < w) {
                win = Some((k, v));
            }
        }
        let ((_, worker), v) = win?;
        Some(Winner { worker, score: self.score_of(v, 0, n), tied })
    }

    /// The winner when nothing of the prompt is in the index, read from a digest keeping
    /// kv_score's terms in order, on a fleet whose routable workers all report the same
    /// power and capacity and no engine counts (one kind of engine, as a fleet usually
    /// is): every score is then one function of util that never rises as util does, so
    /// the tie band is the least loaded workers. They are read in increasing util (the
    /// queued work for [`LoadSignal::Queue`]) until a score falls below the floor, and
    /// hashed; no other view is read. The same winner, score and band as
    /// [`Ranking::scan_winner`]. `None` when the fleet is not of that kind, or the best
    /// score is not a finite number: the caller scans.
    fn uniform_winner(&self, c: &[WorkerView], f: &FleetDigest, n: &Norms) -> Option<Winner> {
        if !self.overlaps.is_empty() || !f.term_uniform(TERM_WATTS) || !f.term_uniform(TERM_CAP) {
            // Power or capacity differ between workers (or some figure is not a number).
            return None;
        }
        let term = match self.load_signal {
            LoadSignal::Seed => TERM_UTIL,
            LoadSignal::Queue => TERM_QUEUED,
        };
        let mut floor = f64::NAN;
        let mut tied = 0;
        let mut win: Option<((u64, WorkerId), f64)> = None;
        for pos in f.term_order(term)? {
            let v = c.get(pos)?;
            let s = self.score_of(v, 0, n);
            if tied == 0 {
                if !s.is_finite() {
                    return None;
                }
                floor = s - self.live.epsilon;
            }
            if s.is_nan() || s < floor {
                break;
            }
            tied += 1;
            let k = self.tie_order(v.id, v.tie_key);
            if win.is_none_or(|(w, _)| k < w) {
                win = Some((k, s));
            }
        }
        win.map(|((_, worker), score)| Winner { worker, score, tied })
    }

    /// The decision naming `w`, keeping this ranking for a retry's order.
    fn decision(self, w: Winner) -> Decision {
        let held = self.overlaps.binary_search_by_key(&w.worker, |(id, _)| *id).map_or(0, |i| self.overlaps[i].1);
        let n_blocks = self.n_blocks as u64;
        let mut d = Decision::new(w.worker, if w.tied > 1 { Branch::TieBreak } else { Branch::Score })
            .with_match(held as u64, n_blocks, if n_blocks == 0 { MatchUnit::None } else { MatchUnit::Blocks })
            .with_score(w.score);
        d.own_order = Some(crate::policy::OwnOrder(std::sync::Arc::new(self)));
        d
    }
}

impl crate::policy::RetryOrder for Ranking {
    /// The tie band by stable hash, then the rest by descending score, over the views the
    /// decision read.
    fn fallbacks(&self, c: &[WorkerView], chosen: WorkerId) -> crate::policy::Fallbacks {
        self.ranked(c, 1 + MAX_FALLBACKS)
            .map(|(head, _)| head.iter().map(|(_, id, _)| *id).filter(|id| *id != chosen).take(MAX_FALLBACKS).collect())
            .unwrap_or_default()
    }

    fn same_as(&self, other: &dyn crate::policy::RetryOrder) -> bool {
        (other as &dyn std::any::Any).downcast_ref::<Ranking>().is_some_and(|o| o == self)
    }
}

/// The chosen worker, its score and the size of the tie band.
#[derive(Debug, Clone, Copy)]
struct Winner {
    worker: WorkerId,
    score: f64,
    tied: usize,
}

/// `x` when it is above `m`, else `m`: [`f64::max`] for an `m` that is a number, which
/// leaves out a `NaN` `x` as it does, in one comparison.
#[inline]
fn larger(m: f64, x: f64) -> f64 {
    if x > m { x } else { m }
}

/// `x` when it is below `m`, else `m` ([`larger`]'s counterpart).
#[inline]
fn smaller(m: f64, x: f64) -> f64 {
    if x < m { x } else { m }
}

/// [`capacity_raw`] of a fleet's workers read in turn, divided again only when a worker's
/// capacity facts differ from the one before (a fleet of one kind of engine divides once).
#[derive(Debug, Default)]
struct CapacityMemo {
    last: Option<((u32, u64, u32, bool), f64)>,
}

impl CapacityMemo {
    #[inline]
    fn raw(&mut self, v: &WorkerView) -> f64 {
        let c = &v.capacity;
        let facts = (c.tp_size, c.vram_gib.to_bits(), c.dtype_bytes, c.free_model_slots == 0);
        match self.last {
            Some((f, raw)) if f == facts => raw,
            _ => {
                let raw = capacity_raw(v);
                self.last = Some((facts, raw));
                raw
            }
        }
    }
}

/// cgn-router's `util`: `max(in_flight / max_concurrent, sm_util)`, in [0, 1].
#[inline]
fn seed_util(v: &WorkerView) -> f64 {
    (f64::from(v.in_flight) / f64::from(v.capacity.max_concurrent.max(1))).max(v.sm_util.unwrap_or(0.0)).clamp(0.0, 1.0)
}

/// [`LoadSignal::Queue`]'s `util` of a worker with `q` queued tokens.
#[inline]
fn queue_util(q: f64, n: &Norms) -> f64 {
    if n.max_queued > 0.0 { (q / n.max_queued).clamp(0.0, 1.0) } else { 0.0 }
}

/// `watts` over the fleet's most, in [0, 1] (0 when no worker reports power).
#[inline]
fn norm_watts(watts: f64, n: &Norms) -> f64 {
    if n.max_watts > 0.0 { (watts / n.max_watts).clamp(0.0, 1.0) } else { 0.0 }
}

/// A raw capacity ([`capacity_raw`]) over the fleet's most, the capacity term (0 when no
/// worker has any).
#[inline]
fn cap_share(raw: f64, n: &Norms) -> f64 {
    if n.max_cap > 0.0 { raw / n.max_cap } else { 0.0 }
}

/// The maxima the terms are normalised by, over `routable` (the most queued work only for
/// [`LoadSignal::Queue`], which alone reads it).
fn norms<'a>(routable: impl Iterator<Item = &'a WorkerView>, signal: LoadSignal) -> Norms {
    let queue = signal == LoadSignal::Queue;
    routable.fold(Norms::default(), |n, v| Norms {
        max_watts: v.power_watts.map_or(n.max_watts, |x| larger(n.max_watts, x)),
        max_cap: larger(n.max_cap, capacity_raw(v)),
        max_queued: if queue { larger(n.max_queued, queued(v)) } else { 0.0 },
    })
}

/// The figures of a worker's view kv_score reads across the fleet, kept by a digest made
/// with [`FleetDigest::with_terms`]`(&KV_SCORE_TERMS)` (the replay and `kvroute bench
/// decision` keep one, [`Policy::fleet_digest`]): its power draw (0 when unknown), raw
/// capacity, cgn-router's util and its queued work.
pub static KV_SCORE_TERMS: ViewTerms = ViewTerms {
    name: "kv_score",
    figures: &[watts_or_zero as Figure, capacity_raw, seed_util, queued],
    ordered: &[TERM_UTIL, TERM_QUEUED],
};

const TERM_WATTS: usize = 0;
const TERM_CAP: usize = 1;
const TERM_UTIL: usize = 2;
const TERM_QUEUED: usize = 3;

/// A worker's power draw, 0 when unknown (as the power term reads it).
fn watts_or_zero(v: &WorkerView) -> f64 {
    v.power_watts.unwrap_or(0.0)
}

/// [`norms`] of the routable workers a digest keeping [`KV_SCORE_TERMS`] describes: the
/// same maxima (each starts at 0 and a `NaN` is left out in both; unknown power counts as
/// 0 here, which a maximum from 0 does not notice).
fn kept_norms(f: &FleetDigest, signal: LoadSignal) -> Norms {
    let most = |i| larger(0.0, f.term_max(i).unwrap_or(0.0));
    Norms {
        max_watts: most(TERM_WATTS),
        max_cap: most(TERM_CAP),
        max_queued: if signal == LoadSignal::Queue { most(TERM_QUEUED) } else { 0.0 },
    }
}

/// The extremes of each term over workers holding none of the prefix: the best score any
/// of them can have is [`score`] of them ([`Extremes::bound`]).
#[derive(Debug, Clone, Copy)]
struct Extremes {
    any: bool,
    /// Least `in_flight / max_concurrent` of those without `sm_util`, as a fraction (kept
    /// exact: the division is done once, for the least).
    frac: (u32, u32),
    /// Least [`seed_util`] of those with `sm_util`.
    util: f64,
    queued: f64,
    watts: f64,
    cap: f64,
}

impl Default for Extremes {
    fn default() -> Self {
        Extremes {
            any: false,
            frac: (1, 1),
            util: f64::INFINITY,
            queued: f64::INFINITY,
            watts: f64::INFINITY,
            cap: 0.0,
        }
    }
}

impl Extremes {
    #[inline]
    fn add(&mut self, v: &WorkerView, raw_cap: f64, q: f64, signal: LoadSignal) {
        self.any = true;
        match signal {
            LoadSignal::Seed if v.sm_util.is_none() => {
                let (num, den) = (v.in_flight, v.capacity.max_concurrent.max(1));
                // num / den < a / b, exactly.
                if u64::from(num) * u64::from(self.frac.1) < u64::from(self.frac.0) * u64::from(den) {
                    self.frac = (num, den);
                }
            }
            LoadSignal::Seed => self.util = smaller(self.util, seed_util(v)),
            LoadSignal::Queue => self.queued = smaller(self.queued, q),
        }
        self.watts = smaller(self.watts, v.power_watts.unwrap_or(0.0));
        self.cap = larger(self.cap, raw_cap);
    }

    /// The best score a worker of these can have: [`score`] with no overlap, the least util
    /// and power and the most capacity. Division and rounding are monotone, so each term
    /// of each worker is at most the bound's.
    fn bound(&self, w: KvWeights, n: &Norms, signal: LoadSignal) -> f64 {
        let util = match signal {
            LoadSignal::Seed => {
                let (num, den) = self.frac;
                (f64::from(num) / f64::from(den)).clamp(0.0, 1.0).min(self.util)
            }
            LoadSignal::Queue => queue_util(self.queued, n),
        };
        score(w, 0.0, util, norm_watts(self.watts, n), cap_share(self.cap, n))
    }
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
        let ranking = self.ranking(req, key, ctx.now);
        // A digest keeping this policy's terms, describing these views.
        let kept = ctx.fleet.filter(|f| f.terms().is_some_and(|t| t.name == KV_SCORE_TERMS.name) && f.usable_for(c));
        // With nothing of the prefix in the index, holders could come only from engine
        // reports: scan (no pass spent looking for them).
        let won = match (ranking.overlaps.is_empty(), kept) {
            (true, Some(f)) => {
                let n = kept_norms(f, ranking.load_signal);
                ranking
                    .all_tie_winner(c, f, &n)
                    .or_else(|| ranking.uniform_winner(c, f, &n))
                    .or_else(|| ranking.scan_winner(c, &n))
            }
            (true, None) => ranking.scan_winner(c, &norms(c.iter().filter(|v| v.is_routable()), ranking.load_signal)),
            (false, kept) => match kept.map_or_else(|| ranking.holders_win(c), |f| ranking.holders_win_kept(c, f)) {
                Ok(w) => Some(w),
                Err(n) => ranking.scan_winner(c, &n),
            },
        };
        Ok(ranking.decision(won.ok_or(RouteError::NoWorker)?))
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

    fn fleet_digest(&self) -> Option<FleetDigest> {
        Some(FleetDigest::with_terms(&KV_SCORE_TERMS))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{BlockSeq, Health};
    use proptest::prelude::*;
    use rand_core::SeedableRng;

    /// A request of `blocks` (16 tokens each).
    fn req(blocks: &[BlockHash]) -> RequestView<'_> {
        RequestView {
            blocks: Some(BlockSeq { block_tokens: 16, hashes: blocks }),
            input_tokens: 16 * blocks.len() as u32,
            ..RequestView::from_text("m", "")
        }
    }

    /// One worker's facts: in flight, max concurrent, sm_util, watts, (tp, vram GiB, dtype
    /// bytes, free slots), healthy, engine-reported cached tokens, named.
    type Spec = (u32, u32, Option<f64>, Option<f64>, (u32, f64, u32, u32), bool, Option<u64>, bool);

    fn fleet_of(specs: &[Spec]) -> Vec<WorkerView> {
        specs
            .iter()
            .enumerate()
            .map(|(i, &(in_flight, max_c, sm, watts, (tp, vram, dtype, slots), healthy, cached, named))| {
                let mut w = WorkerView::idle(WorkerId(i as u32));
                w.in_flight = in_flight;
                w.pending_prefill_tokens = u64::from(in_flight) * 300;
                w.capacity.max_concurrent = max_c;
                w.sm_util = sm;
                w.power_watts = watts;
                w.capacity.tp_size = tp;
                w.capacity.vram_gib = vram;
                w.capacity.dtype_bytes = dtype;
                w.capacity.free_model_slots = slots;
                w.health = if healthy { Health::Healthy } else { Health::Unhealthy };
                w.cached_tokens = cached;
                w.tie_key = named.then_some(1000 + i as u64);
                w
            })
            .collect()
    }

    fn spec() -> impl Strategy<Value = Spec> {
        (
            0u32..6,
            prop_oneof![Just(0u32), 1u32..8, Just(64)],
            proptest::option::weighted(0.2, 0.0f64..1.0),
            proptest::option::weighted(0.3, prop_oneof![Just(0.0f64), 100.0f64..400.0]),
            (1u32..3, prop_oneof![Just(80.0f64), 0.0f64..80.0], 1u32..3, prop_oneof![Just(1u32), Just(0u32)]),
            proptest::bool::weighted(0.9),
            proptest::option::weighted(0.1, 0u64..80),
            proptest::bool::weighted(0.8),
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..Default::default() })]

        /// Where the prefix holders decide alone, they pick the winner, score and tie band
        /// a scan of every worker picks; and the policy's decision is the scan's.
        #[test]
        fn the_holders_decide_as_a_scan_of_every_worker(
            specs in proptest::collection::vec(spec(), 1..40),
            history in proptest::collection::vec((proptest::collection::vec(0u64..4, 1..6), 0usize..40), 0..40),
            probe in proptest::collection::vec(0u64..4, 1..6),
            knobs in (proptest::bool::ANY, proptest::bool::ANY, prop_oneof![Just(0.0f64), Just(0.01), 0.0f64..0.3],
                      prop_oneof![Just(None), Just(Some((0.9, 0.05, 0.0, 0.05))), Just(Some((0.0, 0.5, 0.3, 0.2)))]),
        ) {
            let (queue, whole, epsilon, weights) = knobs;
            let mut cfg = KvScoreConfig {
                epsilon,
                load_signal: if queue { LoadSignal::Queue } else { LoadSignal::Seed },
                prefix_tokens: if whole { 1 << 20 } else { 64 },
                ..Default::default()
            };
            if let Some((kv, load, pwr, cap)) = weights {
                (cfg.w_kv, cfg.w_load, cfg.w_pwr, cfg.w_cap) = (kv, load, pwr, cap);
            }
            let mut p = KvScore::new(cfg);
            let c = fleet_of(&specs);
            for (prompt, w) in &history {
                let blocks: Vec<BlockHash> = prompt.iter().map(|&h| BlockHash(h)).collect();
                let r = req(&blocks);
                let key = p.key(&r);
                p.on_routed(&r, &key, c[w % c.len()].id, Nanos::ZERO);
            }
            let blocks: Vec<BlockHash> = probe.iter().map(|&h| BlockHash(h)).collect();
            let r = req(&blocks);
            let key = p.key(&r);
            // The fleet as generated, and without engine-reported counts (which a digest
            // does not describe).
            let plain: Vec<WorkerView> = c.iter().map(|v| WorkerView { cached_tokens: None, ..*v }).collect();
            for c in [c.clone(), plain] {
                let ranking = p.ranking(&r, &key, Nanos::from_secs(1));
                let scan = ranking.ranked(&c, 1);
                let by_scan = |w: &Winner| {
                    let (head, tied) = scan.clone().expect("a routable worker");
                    (w.worker, w.score.to_bits(), w.tied) == (head[0].1, head[0].0.to_bits(), tied)
                };
                match ranking.holders_win(&c) {
                    Ok(w) => prop_assert!(by_scan(&w), "holders: {:?}, scan: {:?}", w, scan),
                    Err(n) => {
                        prop_assert_eq!(format!("{n:?}"), format!("{:?}", norms(c.iter().filter(|v| v.is_routable()), ranking.load_signal)));
                        match ranking.scan_winner(&c, &n) {
                            Some(w) => prop_assert!(by_scan(&w), "scan_winner: {:?}, scan: {:?}", w, scan),
                            None => prop_assert!(scan.is_none()),
                        }
                    }
                }
                // The same from a digest keeping the policy's terms, brought to this fleet view
                // by view from another one (where it is usable: no engine-reported counts).
                let mut digest = p.fleet_digest().expect("kv_score reads a digest");
                digest.refresh(&fleet_of(&specs.iter().rev().copied().collect::<Vec<_>>()));
                digest.refresh(&c);
                prop_assert!(digest.describes(&c));
                if digest.usable_for(&c) {
                    match ranking.holders_win_kept(&c, &digest) {
                        Ok(w) => prop_assert!(by_scan(&w), "holders (digest): {:?}, scan: {:?}", w, scan),
                        Err(n) => {
                            prop_assert_eq!(format!("{n:?}"), format!("{:?}", norms(c.iter().filter(|v| v.is_routable()), ranking.load_signal)));
                            prop_assert_eq!(format!("{n:?}"), format!("{:?}", kept_norms(&digest, ranking.load_signal)));
                        }
                    }
                }
                let scanned = ranking.decide_by_scan(&c);
                for fleet in [None, Some(&digest)] {
                    let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(0);
                    let mut ctx = PickCtx { now: Nanos::from_secs(1), rng: &mut rng, fleet };
                    let picked = p.pick(&r, &key, &c, &mut ctx);
                    prop_assert_eq!(picked.is_ok(), scanned.is_ok());
                    if let (Ok(a), Ok(b)) = (picked, &scanned) {
                        // The same retry order too, then the rest of the decision.
                        prop_assert_eq!(crate::policy::fallbacks(&a, &c), crate::policy::fallbacks(b, &c));
                        prop_assert_eq!(&a, b);
                    }
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..Default::default() })]

        /// With nothing of the prompt in the index and a digest, a fleet whose every worker
        /// is shown to be in the tie band is decided by hashes alone, and a fleet of one
        /// kind of engine by its band walked in util order, as the scan decides it; and the
        /// policy's decision with the digest is the scan's either way.
        #[test]
        fn a_cold_fleet_s_band_found_from_the_digest_is_the_scan_s(
            specs in proptest::collection::vec(spec(), 1..40),
            (light, same_kind, nan_watts) in (proptest::bool::weighted(0.7), proptest::bool::weighted(0.7), proptest::bool::weighted(0.1)),
            queue in proptest::bool::ANY,
            epsilon in prop_oneof![Just(0.0f64), Just(0.01), 0.0f64..0.3],
            short in proptest::bool::ANY,
        ) {
            let mut specs = specs;
            let (watts, cap) = (specs[0].3, specs[0].4);
            for s in specs.iter_mut() {
                s.6 = None;
                if light {
                    // A lightly loaded fleet: 0–5 requests of 256.
                    s.1 = 256;
                }
                if same_kind {
                    (s.3, s.4) = (watts, cap);
                }
            }
            if nan_watts {
                specs[0].3 = Some(f64::NAN);
            }
            let c = fleet_of(&specs);
            let cfg = KvScoreConfig {
                epsilon,
                load_signal: if queue { LoadSignal::Queue } else { LoadSignal::Seed },
                ..Default::default()
            };
            let p = KvScore::new(cfg);
            // A prompt of blocks, or one shorter than a block (keyed by its text).
            let blocks = [BlockHash(1), BlockHash(2)];
            let r = if short { RequestView::from_text("m", "hi") } else { req(&blocks) };
            let key = p.key(&r);
            let mut digest = p.fleet_digest().expect("kv_score reads a digest");
            digest.refresh(&c);
            let ranking = p.ranking(&r, &key, Nanos::from_secs(1));
            let scan = ranking.ranked(&c, 1);
            let n = kept_norms(&digest, ranking.load_signal);
            let by_scan = |w: &Winner| {
                let (head, tied) = scan.clone().expect("a routable worker");
                (w.worker, w.score.to_bits(), w.tied) == (head[0].1, head[0].0.to_bits(), tied)
            };
            if let Some(w) = ranking.all_tie_winner(&c, &digest, &n) {
                prop_assert!(by_scan(&w), "all tie: {:?}, scan: {:?}", w, scan);
                prop_assert_eq!(w.tied, c.iter().filter(|v| v.is_routable()).count());
            }
            // The band walked in util order: on a fleet of one kind of engine (no power
            // that is not a number), whenever a worker is routable.
            match ranking.uniform_winner(&c, &digest, &n) {
                Some(w) => prop_assert!(by_scan(&w), "util order: {:?}, scan: {:?}", w, scan),
                None => prop_assert!(scan.is_none() || !same_kind || nan_watts, "not walked: {:?}", scan),
            }
            let scanned = ranking.decide_by_scan(&c);
            let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(0);
            let mut ctx = PickCtx { now: Nanos::from_secs(1), rng: &mut rng, fleet: Some(&digest) };
            let picked = p.pick(&r, &key, &c, &mut ctx);
            prop_assert_eq!(picked.is_ok(), scanned.is_ok());
            if let (Ok(a), Ok(b)) = (picked, scanned) {
                prop_assert_eq!(crate::policy::fallbacks(&a, &c), crate::policy::fallbacks(&b, &c));
                prop_assert_eq!(a, b);
            }
        }
    }

    /// The bench's fleet (0–6 requests of 256 on each worker, one kind of engine) is one tie
    /// band when nothing is cached: decided by hashes alone, from the digest.
    #[test]
    fn the_bench_fleet_cold_is_one_tie_band() {
        let c = crate::decision_bench::fleet(64);
        let p = KvScore::new(KvScoreConfig::default());
        let blocks = [BlockHash(1), BlockHash(2)];
        let r = req(&blocks);
        let key = p.key(&r);
        let mut digest = p.fleet_digest().expect("kv_score reads a digest");
        digest.refresh(&c);
        let ranking = p.ranking(&r, &key, Nanos::from_secs(1));
        let n = kept_norms(&digest, ranking.load_signal);
        let w = ranking.all_tie_winner(&c, &digest, &n).expect("every worker ties");
        assert_eq!(w.tied, 64);
        assert_eq!(w.worker, ranking.decide_by_scan(&c).expect("routable").worker);
    }

    /// A busy fleet where two workers hold the prompt's prefix: they decide without a scan,
    /// and a retry takes the other holder first, then the rest by score.
    #[test]
    fn a_prefix_held_by_few_is_decided_by_its_holders_and_retried_in_the_scan_s_order() {
        let specs: Vec<Spec> = (0..64).map(|i| (i % 4, 64, None, None, (1, 80.0, 2, 1), true, None, true)).collect();
        let c = fleet_of(&specs);
        let mut p = KvScore::new(KvScoreConfig::default());
        let blocks = [BlockHash(7), BlockHash(8), BlockHash(9), BlockHash(10)];
        let r = req(&blocks);
        let key = p.key(&r);
        p.on_routed(&r, &key, WorkerId(5), Nanos::ZERO);
        p.on_routed(&r, &key, WorkerId(9), Nanos::ZERO);
        let ranking = p.ranking(&r, &key, Nanos::from_secs(1));
        let w = ranking.holders_win(&c).expect("the holders decide");
        let (head, _) = ranking.ranked(&c, 1 + MAX_FALLBACKS).expect("routable");
        assert_eq!(w.worker, head[0].1);
        assert!([WorkerId(5), WorkerId(9)].contains(&w.worker));
        let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(0);
        let mut ctx = PickCtx { now: Nanos::from_secs(1), rng: &mut rng, fleet: None };
        let d = p.pick(&r, &key, &c, &mut ctx).expect("routable");
        let order = crate::policy::fallbacks(&d, &c);
        let want: Vec<WorkerId> = head[1..].iter().map(|s| s.1).collect();
        assert_eq!(order.to_vec(), want);
        assert_eq!(order[0], if w.worker == WorkerId(5) { WorkerId(9) } else { WorkerId(5) });
        assert!(order[1..].iter().all(|w| c[w.0 as usize].in_flight == 0), "then the idle workers");
    }
}
