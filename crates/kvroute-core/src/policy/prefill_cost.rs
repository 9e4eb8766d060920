//! `prefill_cost`: kvroute's own policy — route to the worker with the least *predicted
//! prefill work*: the work already queued there plus the request's own uncached suffix,
//! weighted by who pays for it. No thresholds.
//!
//! ```text
//! cost(w) = pending_prefill_tokens(w)
//!         + uncached_tokens(req, w) × (miss_weight + stall(w))
//!         + decode_weight × load(w) × (1 + load(w) / decode_queue_scale)
//! stall(w) = min(stall_weight × (1 + mean_waiting / stall_queue_scale) × load(w), stall_cap)
//! ```
//!
//! - `pending_prefill_tokens(w)`: prompt tokens dispatched to `w` without a first token yet,
//!   minus their estimated cached part (the router's ledger): the queue the request waits
//!   behind, in the unit that decides TTFT.
//! - `uncached_tokens = input − cached(w)`: `cached(w)` is the longest leading run of the
//!   request's full blocks in a per-worker LRU block set sized like the engine's KV cache
//!   (`Capacity::kv_tokens`, else `cache_tokens`), so the estimate forgets what the engine
//!   evicts; with KV events, the engine's own count ([`WorkerView::cached_tokens`]).
//! - `miss_weight` > 1: a miss is paid by the request, by every request queued behind it
//!   and by the fleet's capacity; with 1, prompts leave their caches as queues grow. It
//!   alone keeps a conversation where its context is (`session_affinity`, B3's gate, is off).
//! - `stall(w)`: with chunked prefill an uncached prompt runs in the same steps as every
//!   request on the worker, stalling them (Sarathi-Serve's "generation stalls"), more so
//!   under queueing; capped at `stall_cap` so long prompts are not all piled onto the
//!   emptiest workers. It separates long and short prefills, as size-interval task
//!   assignment does.
//! - The decode term: each running request costs the batch time per step, and past the
//!   batch size requests queue without prefill work, hence the quadratic part; linear, it
//!   let agents pile onto the worker holding their shared prefix.
//!
//! Ties go to the worker holding more of the prefix, then rotate. Knobs: [`PrefillCostConfig`]
//! (`kvroute policies`). Measurements: docs/lab/2026-11-26-policy-module-history.md.

use crate::fleet_digest::FleetDigest;
use crate::hash::{HashAlgo, request_blocks};
use crate::lru_blocks::{Hits, WorkerBlockSets};
use crate::policy::util::{
    Rotation, SessionTable, bits_count, bits_has, bits_nth, bits_set, mean_load, mean_waiting, rotate,
};
use crate::policy::{
    Branch, Decision, KnobError, MatchUnit, PickCtx, Policy, RequestKey, RouteError, patch_knobs, routable_view_of,
};
use crate::types::{Nanos, RequestView, WorkerId, WorkerView};
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

/// Knobs of `prefill_cost`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PrefillCostConfig {
    /// Tokens per hashed block (for token ids and text; trace blocks keep their size).
    pub block_tokens: u32,
    /// KV cache assumed by the router's block set of a worker that does not report its own
    /// (`Capacity::kv_tokens`), in tokens.
    pub cache_tokens: u64,
    /// Prefill tokens charged per request already on the worker.
    pub decode_weight: u64,
    /// Multiplier on the request's own uncached tokens: the extra prefill a miss adds is
    /// paid again by every request queued behind it on that worker.
    pub miss_weight: f64,
    /// Keep a session on its last worker while that worker holds more than half of the
    /// prompt and its load is at most `overload_factor` × the mean (B3 `cache_aware_proxy.py`'s gate).
    pub session_affinity: bool,
    /// Affinity gate: overloaded above this × the mean load.
    pub overload_factor: f64,
    /// Session bindings kept (LRU beyond).
    pub max_sessions: usize,
    /// Queue-depth multiplier: the additive cost is multiplied by `1 + batch_factor ×
    /// load(w)` (0: purely additive).
    pub batch_factor: f64,
    /// Prefill tokens charged per uncached token of the request per request already on
    /// the worker: a prefill stalls the steps of every request it shares the worker with.
    pub stall_weight: f64,
    /// Mean waiting requests per worker (router's ledger) at which `stall_weight` doubles;
    /// it grows linearly with the fleet's queue. 0 keeps `stall_weight` fixed.
    pub stall_queue_scale: f64,
    /// Upper bound of the stall charge per uncached token (`stall(w)` is at most this).
    pub stall_cap: f64,
    /// Requests on a worker at which the decode charge per request doubles: the charge is
    /// `decode_weight × load × (1 + load / decode_queue_scale)`, so piling requests onto
    /// one worker costs more and more (a batch past the engine's size queues). 0: linear.
    pub decode_queue_scale: f64,
}

impl Default for PrefillCostConfig {
    fn default() -> Self {
        PrefillCostConfig {
            block_tokens: 16,
            cache_tokens: 1_000_000,
            decode_weight: 64,
            miss_weight: 8.0,
            session_affinity: false,
            overload_factor: 1.5,
            max_sessions: 1 << 20,
            batch_factor: 0.0,
            stall_weight: 0.05,
            stall_queue_scale: 10.0,
            stall_cap: 8.0,
            decode_queue_scale: 16.0,
        }
    }
}

fn validate(c: &PrefillCostConfig) -> Result<(), String> {
    if c.block_tokens == 0 {
        return Err("block_tokens must be at least 1".into());
    }
    if !(c.miss_weight.is_finite() && c.miss_weight >= 0.0) {
        return Err(format!("miss_weight must be a finite number >= 0, got {}", c.miss_weight));
    }
    if !(c.overload_factor.is_finite() && c.overload_factor > 0.0) {
        return Err(format!("overload_factor must be > 0, got {}", c.overload_factor));
    }
    if !(c.batch_factor.is_finite() && c.batch_factor >= 0.0) {
        return Err(format!("batch_factor must be a finite number >= 0, got {}", c.batch_factor));
    }
    if !(c.stall_weight.is_finite() && c.stall_weight >= 0.0) {
        return Err(format!("stall_weight must be a finite number >= 0, got {}", c.stall_weight));
    }
    if !(c.stall_queue_scale.is_finite() && c.stall_queue_scale >= 0.0) {
        return Err(format!("stall_queue_scale must be a finite number >= 0, got {}", c.stall_queue_scale));
    }
    if !(c.stall_cap.is_finite() && c.stall_cap >= 0.0) {
        return Err(format!("stall_cap must be a finite number >= 0, got {}", c.stall_cap));
    }
    if !(c.decode_queue_scale.is_finite() && c.decode_queue_scale >= 0.0) {
        return Err(format!("decode_queue_scale must be a finite number >= 0, got {}", c.decode_queue_scale));
    }
    if c.max_sessions == 0 {
        return Err("max_sessions must be at least 1".into());
    }
    if c.cache_tokens < c.block_tokens as u64 {
        return Err("cache_tokens must hold at least one block".into());
    }
    Ok(())
}

/// (matched, key length, unit) of a decision.
pub(crate) type Match = (u64, u64, MatchUnit);

/// The `prefill_cost` policy. See the module docs.
#[derive(Debug, Clone)]
pub struct PrefillCost {
    pub(crate) cfg: PrefillCostConfig,
    pub(crate) sets: WorkerBlockSets,
    pub(crate) rotation: Rotation,
    pub(crate) sessions: SessionTable,
}

impl PrefillCost {
    /// A policy with `cfg` (validated by the registry).
    pub fn new(cfg: PrefillCostConfig) -> Self {
        let sessions = SessionTable::new(cfg.max_sessions);
        PrefillCost { cfg, sets: WorkerBlockSets::default(), rotation: Rotation::default(), sessions }
    }

    /// Cached prompt tokens of the request on `w`, and the match to report: the engine's
    /// precise count (in tokens) when the worker publishes KV events, else this policy's
    /// own LRU estimate (in blocks).
    pub(crate) fn cached(&self, w: &WorkerView, key: &RequestKey, input: u64) -> (u64, Match) {
        let hit = self.sets.hit_of(w, &key.blocks);
        Self::cached_of(w, key, input, hit)
    }

    /// [`PrefillCost::cached`] with the estimate's leading blocks held, `hit`, already known
    /// (from [`WorkerBlockSets::hits`] for the whole fleet); `hit` is ignored when the worker
    /// reports its cached tokens.
    pub(crate) fn cached_of(w: &WorkerView, key: &RequestKey, input: u64, hit: u64) -> (u64, Match) {
        if let Some(t) = w.cached_tokens {
            let t = t.min(input);
            return (t, (t, input, MatchUnit::Tokens));
        }
        let unit = if key.blocks.is_empty() { MatchUnit::None } else { MatchUnit::Blocks };
        ((hit * key.block_tokens).min(input), (hit, key.blocks.len() as u64, unit))
    }

    /// `stall_weight × (1 + mean waiting / stall_queue_scale)` over the routable workers.
    pub(crate) fn stall_weight(&self, c: &[WorkerView]) -> f64 {
        self.stall_weight_of(mean_waiting(c))
    }

    /// The least cost over the routable workers of `c` (`None` when there is none) and the
    /// workers reaching it with the most cached tokens, in candidate order, each with its
    /// match. `stall` is [`PrefillCost::stall_weight`] of `c`.
    pub(crate) fn best_of(
        &self,
        c: &[WorkerView],
        key: &RequestKey,
        input: u64,
        stall: f64,
        scan: Scan,
    ) -> (Option<u64>, SmallVec<[(WorkerId, Match); 8]>) {
        let mut hits = if scan == Scan::Fast { self.sets.hits(&key.blocks) } else { Hits::default() };
        self.scan_views(c, key, input, stall, scan, &mut hits)
    }

    /// [`PrefillCost::best_of`] with the request's [`WorkerBlockSets::hits`] already known
    /// (read with [`Scan::Fast`], from its lowest id).
    fn scan_views(
        &self,
        c: &[WorkerView],
        key: &RequestKey,
        input: u64,
        stall: f64,
        scan: Scan,
        hits: &mut Hits,
    ) -> (Option<u64>, SmallVec<[(WorkerId, Match); 8]>) {
        let mut least = LeastCost::default();
        for w in c.iter().filter(|w| w.is_routable()) {
            let hit = match scan {
                Scan::Fast => hits.get(w.id),
                Scan::Full => self.sets.hit(w.id, &key.blocks) as u64,
            };
            // A lower bound of the cost: the queued prefill and decode charge alone (the
            // request's own prefill is non-negative, and the same conversions round
            // monotonically). A worker already dearer than the best loses whatever it
            // holds, so its match is not looked up.
            let load = f64::from(w.load());
            let terms = self.load_terms(load);
            let pending = w.pending_prefill_tokens;
            if scan == Scan::Fast && least.best.is_some_and(|(b, _)| self.cost_with(terms, load, pending, 0.0, 0) > b) {
                continue;
            }
            let (cached, hit) = Self::cached_of(w, key, input, hit);
            least.offer((self.cost_with(terms, load, pending, stall, input - cached), u64::MAX - cached), w.id, hit);
        }
        least.done()
    }

    /// A worker's cost key for the request — `(cost, u64::MAX − cached tokens)`, the least
    /// wins — and its match, with the estimate's leading blocks it holds, `hit`, known.
    fn cost_of(&self, w: &WorkerView, key: &RequestKey, input: u64, stall: f64, hit: u64) -> ((u64, u64), Match) {
        let (cached, hit) = Self::cached_of(w, key, input, hit);
        let cost = self.cost_floor(w.load(), w.pending_prefill_tokens, stall, input - cached);
        ((cost, u64::MAX - cached), hit)
    }

    /// The cost of a worker with `load` requests and `pending` prefill tokens queued for a
    /// request leaving `own` tokens uncached: `(pending + own × (miss_weight + stall(w)) +
    /// D(load)) × (1 + batch_factor × load)`, each product truncated to whole tokens. With
    /// `own` at most the worker's own uncached tokens (0, or the prompt's tokens beyond
    /// the most any worker holds) a lower bound of its cost: every operation is monotone in
    /// `own` and in `pending`.
    fn cost_floor(&self, load: u32, pending: u64, stall: f64, own: u64) -> u64 {
        let load = f64::from(load);
        self.cost_with(self.load_terms(load), load, pending, stall, own)
    }

    /// What a worker's `load` adds to its cost whatever the request: its decode charge
    /// truncated to whole tokens, and `1 + batch_factor × load`.
    #[inline]
    fn load_terms(&self, load: f64) -> (u64, f64) {
        (self.decode_charge(load) as u64, 1.0 + self.cfg.batch_factor * load)
    }

    /// [`PrefillCost::cost_floor`] with its [`PrefillCost::load_terms`] known.
    #[inline]
    fn cost_with(&self, (decode, factor): (u64, f64), load: f64, pending: u64, stall: f64, own: u64) -> u64 {
        let miss =
            if own == 0 { 0 } else { (own as f64 * (self.cfg.miss_weight + self.stall_charge(stall, load))) as u64 };
        ((pending + miss + decode) as f64 * factor) as u64
    }

    /// [`PrefillCost::best_of`] with the fleet read from its `fleet` digest (which must fit
    /// `c`, [`FleetDigest::usable_for`]): the workers whose [`PrefillCost::cost_floor`]
    /// (with the prompt's tokens beyond the most any worker holds) is at most the cost of
    /// the worker with the least floor, or of the cheapest of the workers holding the most
    /// leading blocks, found from the digest's buckets (each read in increasing queued
    /// prefill and left at the first floor past that), and scored in candidate order. A
    /// worker left out costs more than the least cost, so it is neither the best nor tied
    /// with it: the same result as the scan of every worker. With more than
    /// [`FleetDigest::contenders_cap`] such workers, the scan of every worker.
    pub(crate) fn best_kept(&self, k: KeptAsk<'_>) -> (Option<u64>, SmallVec<[(WorkerId, Match); 8]>) {
        let KeptAsk { c, key, input, stall, fleet } = k;
        let mut hits = self.sets.hits(&key.blocks);
        let deepest = hits.deepest();
        let own = input - deepest.saturating_mul(key.block_tokens).min(input);
        let low = fleet
            .buckets()
            .filter_map(|(load, _, set)| {
                set.first().map(|&(pending, pos)| (self.cost_floor(load, pending, stall, own), pos))
            })
            .min();
        let deep = self.deepest_cost(k, &hits);
        let ceiling = low
            .map(|(_, pos)| {
                let w = &c[pos as usize];
                self.cost_of(w, key, input, stall, hits.get(w.id)).0.0
            })
            .into_iter()
            .chain(deep)
            .min();
        hits.rewind();
        let Some(ceiling) = ceiling else { return (None, SmallVec::new()) };
        let mut contenders: SmallVec<[u32; 32]> = SmallVec::new();
        let most = fleet.contenders_cap();
        for (load, _, set) in fleet.buckets() {
            for &(_, pos) in set.iter().take_while(|p| self.cost_floor(load, p.0, stall, own) <= ceiling) {
                if contenders.len() == most {
                    // Most of the fleet can win: read the views in order instead.
                    return self.scan_views(c, key, input, stall, Scan::Fast, &mut hits);
                }
                contenders.push(pos);
            }
        }
        contenders.sort_unstable();
        let mut least = LeastCost::default();
        for pos in contenders {
            let w = &c[pos as usize];
            let (k, hit) = self.cost_of(w, key, input, stall, hits.get(w.id));
            least.offer(k, w.id, hit);
        }
        least.done()
    }

    /// The least cost and the workers reaching it (as bits by position) on a fleet whose
    /// digest `fleet` fits `c` and has many idle workers: the idle workers holding nothing
    /// of the prompt all cost the same (load 0, nothing queued, nothing cached), which bounds
    /// the least cost; the others that can reach it are the idle holders and the workers of
    /// the digest's buckets whose [`PrefillCost::cost_floor`] is within it, each scored. A
    /// worker left out costs more than the least, so the tied set is the scan's, kept as
    /// bits however many idle workers tie: O(workers / 64 + holders + contenders). `None`
    /// (decide otherwise) when no worker is idle, or more than
    /// [`FleetDigest::contenders_cap`] busy workers are within the bound.
    fn tied_idle(&self, k: KeptAsk<'_>) -> Option<(u64, Vec<u64>)> {
        let KeptAsk { c, key, input, stall, fleet } = k;
        let mut hits = self.sets.hits(&key.blocks);
        let idle = fleet.idle_at();
        // The idle holders, scored one by one: each keys below the idle workers holding
        // nothing (it costs no more, with more cached), so if one is the least the bits of
        // those are cleared below, and the holders need not be taken out of them.
        let mut contenders: SmallVec<[u32; 32]> = SmallVec::new();
        for (id, _) in hits.entries() {
            if let Some(p) = fleet.position(id).filter(|&p| bits_has(idle, p)) {
                contenders.push(p as u32);
            }
        }
        let mut class = idle.to_vec();
        let first = bits_nth(&class, 0)?;
        let class_key = self.cost_of(&c[first], key, input, stall, 0).0;
        // The least cost is at most theirs, and at most the cheapest deepest holder's.
        let ceiling = self.deepest_cost(k, &hits).map_or(class_key.0, |d| d.min(class_key.0));
        let own = input - hits.deepest().saturating_mul(key.block_tokens).min(input);
        let most = fleet.contenders_cap();
        for (load, _, set) in fleet.buckets() {
            // The idle workers (load 0, nothing queued) are the class and its holders.
            let from = if load == 0 { (1, 0) } else { (0, 0) };
            for &(_, pos) in set.range(from..).take_while(|p| self.cost_floor(load, p.0, stall, own) <= ceiling) {
                if contenders.len() == most {
                    return None;
                }
                contenders.push(pos);
            }
        }
        contenders.sort_unstable();
        let scored: SmallVec<[(u32, (u64, u64)); 32]> = contenders
            .iter()
            .map(|&pos| {
                let w = &c[pos as usize];
                (pos, self.cost_of(w, key, input, stall, hits.get(w.id)).0)
            })
            .collect();
        let best = scored.iter().map(|s| s.1).fold(class_key, std::cmp::min);
        if best != class_key {
            class.iter_mut().for_each(|w| *w = 0);
        }
        for &(pos, _) in scored.iter().filter(|s| s.1 == best) {
            bits_set(&mut class, pos as usize, true);
        }
        Some((best.0, class))
    }

    /// The least cost among the routable workers holding the most leading blocks of the
    /// request (`hits`, read through `fleet`); `None` when none holds any.
    fn deepest_cost(&self, k: KeptAsk<'_>, hits: &Hits) -> Option<u64> {
        let KeptAsk { c, key, input, stall, fleet } = k;
        let deepest = hits.deepest();
        hits.entries()
            .filter(|&(_, n)| deepest > 0 && u64::from(n) == deepest)
            .filter_map(|(id, n)| fleet.position(id).filter(|&p| fleet.routable(p)).map(|p| (p, n)))
            .map(|(p, n)| self.cost_of(&c[p], key, input, stall, u64::from(n)).0.0)
            .min()
    }

    /// [`PrefillCost::stall_weight`] with the mean waiting requests already known.
    pub(crate) fn stall_weight_of(&self, mean_waiting: f64) -> f64 {
        if self.cfg.stall_weight == 0.0 || self.cfg.stall_queue_scale == 0.0 {
            return self.cfg.stall_weight;
        }
        self.cfg.stall_weight * (1.0 + mean_waiting / self.cfg.stall_queue_scale)
    }

    /// `stall(w)`: the stall charge per uncached token on a worker with `load` requests,
    /// `min(stall × load, stall_cap)` (`stall` from [`PrefillCost::stall_weight`]).
    pub(crate) fn stall_charge(&self, stall: f64, load: f64) -> f64 {
        (stall * load).min(self.cfg.stall_cap)
    }

    /// The decode charge of a worker with `load` requests, in prefill tokens:
    /// `decode_weight × load × (1 + load / decode_queue_scale)` (linear when the scale is 0).
    pub(crate) fn decode_charge(&self, load: f64) -> f64 {
        let crowding = if self.cfg.decode_queue_scale > 0.0 { 1.0 + load / self.cfg.decode_queue_scale } else { 1.0 };
        self.cfg.decode_weight as f64 * load * crowding
    }

    /// Blocks of `block_tokens` the estimate of a worker holds: its reported KV capacity
    /// (`worker_kv_tokens`) when known, else `cache_tokens`.
    fn capacity_blocks(&self, worker_kv_tokens: Option<u64>, block_tokens: u64) -> usize {
        (worker_kv_tokens.unwrap_or(self.cfg.cache_tokens) / block_tokens.max(1)).max(1) as usize
    }
}

/// The least cost key offered so far — `(cost, u64::MAX − cached tokens)` — and the
/// workers offered with it, in the order offered ([`PrefillCost::best_of`]'s result).
#[derive(Default)]
struct LeastCost {
    best: Option<(u64, u64)>,
    tied: SmallVec<[(WorkerId, Match); 8]>,
}

impl LeastCost {
    fn offer(&mut self, key: (u64, u64), id: WorkerId, hit: Match) {
        match self.best {
            Some(b) if key > b => {}
            Some(b) if key == b => self.tied.push((id, hit)),
            _ => {
                self.best = Some(key);
                self.tied.clear();
                self.tied.push((id, hit));
            }
        }
    }

    /// The least cost (`None` when nothing was offered) and the workers reaching it.
    fn done(self) -> (Option<u64>, SmallVec<[(WorkerId, Match); 8]>) {
        (self.best.map(|(cost, _)| cost), self.tied)
    }
}

/// What a decision read through the fleet's digest scores with
/// ([`PrefillCost::best_kept`]): the candidates, the request's key and prompt tokens, the
/// decision's stall weight ([`PrefillCost::stall_weight_of`]) and a digest fitting the
/// candidates ([`FleetDigest::usable_for`]).
#[derive(Clone, Copy)]
pub(crate) struct KeptAsk<'a> {
    pub(crate) c: &'a [WorkerView],
    pub(crate) key: &'a RequestKey,
    pub(crate) input: u64,
    pub(crate) stall: f64,
    pub(crate) fleet: &'a FleetDigest,
}

/// How a scoring policy reads the fleet when it looks for its best workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scan {
    /// The request's leading blocks on every worker at once
    /// ([`WorkerBlockSets::hits`]), and workers that cannot win (their queue alone costs
    /// more than the best so far) left unscored: what decisions use.
    Fast,
    /// Every worker scored, each asking its own block set: the reference the fast scan
    /// must agree with (a property test compares them).
    #[cfg_attr(not(test), allow(dead_code))]
    Full,
}

/// How many of `key`'s leading blocks an engine will keep once the request has run: every
/// block but a partial tail. Precomputed block hashes (a Mooncake trace's `hash_ids`, one per
/// 512-token block, "the last one partial") end with a block of `input mod block_tokens`
/// tokens, which no paged engine caches (vLLM and the simulator cache full blocks only, and
/// the next turn's prompt fills that block with other tokens, so it gets another hash);
/// blocks hashed here from text or token ids are full ones already. Counting the tail would
/// fill the estimate with blocks that never match and weigh a whole block each: on agentic
/// traffic (a partial tail per call, two new full blocks) the estimate then forgot a
/// session's history about a fifth sooner than the engine did.
fn cacheable_blocks(req: &RequestView<'_>, key: &RequestKey) -> usize {
    match req.blocks {
        Some(_) => key.blocks.len().min(req.input_tokens as usize / key.block_tokens.max(1) as usize),
        None => key.blocks.len(),
    }
}

impl Policy for PrefillCost {
    fn name(&self) -> &'static str {
        "prefill_cost"
    }

    fn key(&self, req: &RequestView<'_>) -> RequestKey {
        let mut blocks = Vec::new();
        request_blocks(req, self.cfg.block_tokens as usize, 1 << 12, HashAlgo::Xxh3, &mut blocks);
        RequestKey {
            blocks,
            block_tokens: req.blocks.map_or(self.cfg.block_tokens, |b| b.block_tokens.max(1)) as u64,
            worker_kv_tokens: None,
        }
    }

    fn pick(
        &self,
        req: &RequestView<'_>,
        key: &RequestKey,
        c: &[WorkerView],
        ctx: &mut PickCtx<'_>,
    ) -> Result<Decision, RouteError> {
        let input = req.input_tokens as u64;
        // The caller's digest of the fleet, when it keeps one: no pass over the views.
        let fleet = ctx.fleet.filter(|f| f.usable_for(c));
        if self.cfg.session_affinity
            && let Some(sid) = req.session_id
            && let Some(bound) = self.sessions.get(sid)
            && let Some(a) = routable_view_of(c, fleet, bound)
        {
            let mean = fleet.map_or_else(|| mean_load(c), |f| f.means().load).unwrap_or(0.0).max(1.0);
            let (cached, m) = self.cached(a, key, input);
            if cached * 2 > input && a.load() as f64 <= mean * self.cfg.overload_factor {
                let cost = a.pending_prefill_tokens + (input - cached);
                return Ok(Decision::new(a.id, Branch::Sticky).with_match(m.0, m.1, m.2).with_score(cost as f64));
            }
        }
        if let Some(f) = fleet.filter(|f| f.mostly_idle()) {
            let stall = self.stall_weight_of(f.means().waiting);
            if let Some((cost, tied)) = self.tied_idle(KeptAsk { c, key, input, stall, fleet: f }) {
                // The rotation's pick among the tied in candidate order: the k-th least position.
                let (at, branch) = match bits_count(&tied) {
                    0 => (None, Branch::Score),
                    1 => (bits_nth(&tied, 0), Branch::Score),
                    n => (bits_nth(&tied, (self.rotation.next() % n as u64) as usize), Branch::TieBreak),
                };
                let w = &c[at.ok_or(RouteError::NoWorker)?];
                let m = self.cached(w, key, input).1;
                return Ok(Decision::new(w.id, branch).with_match(m.0, m.1, m.2).with_score(cost as f64));
            }
        }
        let (best, tied) = match fleet.filter(|f| !f.mostly_idle()) {
            Some(f) => {
                self.best_kept(KeptAsk { c, key, input, stall: self.stall_weight_of(f.means().waiting), fleet: f })
            }
            None => self.best_of(c, key, input, self.stall_weight(c), Scan::Fast),
        };
        let cost = best.ok_or(RouteError::NoWorker)?;
        let ids: SmallVec<[WorkerId; 8]> = tied.iter().map(|t| t.0).collect();
        let w = rotate(&ids, &self.rotation).ok_or(RouteError::NoWorker)?;
        let m = tied.iter().find(|t| t.0 == w).map_or((0, 0, MatchUnit::None), |t| t.1);
        let branch = if ids.len() > 1 { Branch::TieBreak } else { Branch::Score };
        Ok(Decision::new(w, branch).with_match(m.0, m.1, m.2).with_score(cost as f64))
    }

    fn fleet_digest(&self) -> Option<FleetDigest> {
        Some(FleetDigest::default())
    }

    fn on_routed(&mut self, req: &RequestView<'_>, key: &RequestKey, worker: WorkerId, _now: Nanos) {
        let cap = self.capacity_blocks(key.worker_kv_tokens, key.block_tokens);
        // A worker that reports its capacity (again, or differently after a restart) gets
        // its estimate resized; a key without it keeps what the set has.
        let resize = key.worker_kv_tokens.is_some();
        self.sets.insert(worker, &key.blocks[..cacheable_blocks(req, key)], cap, resize);
        if let Some(sid) = req.session_id {
            self.sessions.bind(sid, worker);
        }
    }

    fn on_worker_removed(&mut self, worker: WorkerId) {
        self.sets.remove_worker(worker);
        self.sessions.forget_worker(worker);
    }

    fn knobs(&self) -> serde_json::Value {
        serde_json::to_value(&self.cfg).unwrap_or_default()
    }

    fn set_knobs(&mut self, patch: &serde_json::Value) -> Result<(), KnobError> {
        let next = patch_knobs("prefill_cost", &self.cfg, patch, validate)?;
        if next.cache_tokens != self.cfg.cache_tokens || next.block_tokens != self.cfg.block_tokens {
            self.sets.clear();
        }
        if next.max_sessions != self.cfg.max_sessions {
            self.sessions.resize(next.max_sessions);
        }
        self.cfg = next;
        Ok(())
    }

    fn index_size(&self) -> u64 {
        self.sets.total()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::types::BlockSeq;
    use rand_core::SeedableRng;

    use crate::types::BlockHash;

    /// A request of `blocks` 512-token trace blocks (also `least_ttft`'s tests').
    pub(crate) fn req(blocks: &[BlockHash]) -> RequestView<'_> {
        RequestView {
            model: "m",
            text: None,
            token_ids: None,
            blocks: Some(BlockSeq { block_tokens: 512, hashes: blocks }),
            input_tokens: blocks.len() as u32 * 512,
            output_tokens: None,
            session_id: None,
            role: crate::types::Role::Both,
        }
    }

    /// Routes `r`, checking first that the decision read through a [`FleetDigest`] of `c`
    /// is the same.
    fn go(p: &mut PrefillCost, r: &RequestView<'_>, c: &[WorkerView]) -> Decision {
        let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(0);
        let rotation = p.rotation.peek();
        let digest = FleetDigest::new(c);
        let mut ctx = PickCtx { now: Nanos::ZERO, rng: &mut rng, fleet: Some(&digest) };
        let kept = crate::policy::decide(p, r, c, &mut ctx).expect("decide").0;
        p.rotation.set(rotation);
        let d = crate::policy::route(p, r, c, &mut PickCtx { fleet: None, ..ctx }).expect("route");
        assert_eq!(kept, d, "read through a digest");
        d
    }

    /// A worker of a large random fleet: (idle, in_flight, waiting, pending prefill
    /// tokens in 512s, healthy).
    pub(crate) type BigSpec = (bool, u32, u32, u64, bool);

    /// A fleet of `specs`, ids by position (or reversed).
    pub(crate) fn big_fleet(specs: &[BigSpec], reversed: bool) -> Vec<WorkerView> {
        let mut c: Vec<WorkerView> = specs
            .iter()
            .enumerate()
            .map(|(i, &(idle, in_flight, waiting, pending, healthy))| {
                let mut w = WorkerView::idle(WorkerId(i as u32));
                if !idle {
                    w.in_flight = in_flight;
                    w.waiting = waiting.min(in_flight);
                    w.pending_prefill_tokens = pending * 512;
                }
                if !healthy {
                    w.health = crate::types::Health::Unhealthy;
                }
                w
            })
            .collect();
        if reversed {
            c.reverse();
        }
        c
    }

    /// A large fleet's worker: mostly idle (so most fleets are past the digest's cap).
    pub(crate) fn big_spec() -> impl Strategy<Value = BigSpec> {
        (proptest::bool::weighted(0.85), 0u32..4, 0u32..3, 0u64..3, proptest::bool::weighted(0.95))
    }

    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..Default::default() })]

        /// On large fleets, most of them mostly idle, with prompts held here and there and
        /// knobs that let busy workers cost what idle ones do (no decode or batch charge),
        /// the decision read through the digest — the idle workers' tied set as bits — is
        /// the one read from every view, from any point of the tie rotation.
        #[test]
        fn a_mostly_idle_fleet_decides_through_the_digest_as_from_every_view(
            specs in proptest::collection::vec(big_spec(), 60..300),
            history in proptest::collection::vec((proptest::collection::vec(0u64..4, 1..5), 0usize..300), 0..30),
            probe in proptest::collection::vec(0u64..4, 1..5),
            plain in proptest::bool::ANY,
            reversed in proptest::bool::ANY,
            rotation in 0u64..1000,
        ) {
            let cfg = if plain {
                PrefillCostConfig { decode_weight: 0, batch_factor: 0.0, stall_weight: 0.0, ..PrefillCostConfig::default() }
            } else {
                PrefillCostConfig::default()
            };
            let mut p = PrefillCost::new(cfg);
            let c = big_fleet(&specs, reversed);
            for (prompt, w) in &history {
                let blocks: Vec<BlockHash> = prompt.iter().map(|&h| BlockHash(h)).collect();
                crate::policy::record_routed(&mut p, &req(&blocks), c[w % c.len()].id, Nanos::ZERO);
            }
            p.rotation.set(rotation);
            let blocks: Vec<BlockHash> = probe.iter().map(|&h| BlockHash(h)).collect();
            if c.iter().any(WorkerView::is_routable) {
                go(&mut p, &req(&blocks), &c);
            }
        }
    }

    /// 600 workers with `busy` requests each and nothing queued, but every 50th with 2
    /// requests and 3,000 tokens queued: mostly idle when `busy` is 0.
    pub(crate) fn alike(busy: u32) -> Vec<WorkerView> {
        let mut c: Vec<WorkerView> = (0..600).map(|i| WorkerView::idle(WorkerId(i))).collect();
        for (i, w) in c.iter_mut().enumerate() {
            w.in_flight = if i % 50 == 0 { 2 } else { busy };
            w.pending_prefill_tokens = if i % 50 == 0 { 3000 } else { 0 };
        }
        assert_eq!(FleetDigest::new(&c).mostly_idle(), busy == 0);
        c
    }

    #[test]
    fn a_fleet_where_most_workers_tie_is_read_in_order_and_decided_the_same() {
        // 600 workers, all alike but a few: more can win than a digest's decision collects
        // (64 + 600 / 8): idle, they are taken as one class (the digest's idle bits); busy
        // alike, the views are read after collecting that many; `go` checks each decision.
        for busy in [0, 1] {
            let mut p = PrefillCost::new(PrefillCostConfig::default());
            let c = alike(busy);
            let h: Vec<BlockHash> = (0..4).map(BlockHash).collect();
            let first = go(&mut p, &req(&h), &c);
            assert_eq!(first.branch, Branch::TieBreak);
            // The second turn goes where the first went: it holds the prefix.
            let mut next = h.clone();
            next.push(BlockHash(9));
            assert_eq!(go(&mut p, &req(&next), &c).worker, first.worker);
        }
    }

    #[test]
    fn a_hit_is_worth_exactly_the_prefill_it_saves() {
        let mut p = PrefillCost::new(PrefillCostConfig { decode_weight: 0, miss_weight: 1.0, ..Default::default() });
        let h: Vec<BlockHash> = (0..8).map(BlockHash).collect();
        let mut c = vec![WorkerView::idle(WorkerId(0)), WorkerView::idle(WorkerId(1))];
        crate::policy::record_routed(&mut p, &req(&h), WorkerId(0), Nanos::ZERO);
        // Worker 0 holds all 4,096 tokens but has 4,000 pending: 4,000 + 0 < 0 + 4,096.
        c[0].pending_prefill_tokens = 4000;
        assert_eq!(go(&mut p, &req(&h), &c).worker, WorkerId(0));
        // 4,200 pending: the cold idle worker finishes the prefill sooner.
        c[0].pending_prefill_tokens = 4200;
        assert_eq!(go(&mut p, &req(&h), &c).worker, WorkerId(1));
    }

    /// Default `prefill_cost`, one worker reporting a KV cache of 4 trace blocks (2,048
    /// tokens), and three distinct prompts of 2 blocks each.
    fn one_worker_of_4_blocks_and_3_prompts() -> (PrefillCost, Vec<WorkerView>, Vec<Vec<BlockHash>>) {
        let mut c = vec![WorkerView::idle(WorkerId(0))];
        c[0].capacity.kv_tokens = Some(2048);
        let prompts = (0..3u64).map(|i| vec![BlockHash(10 * i + 1), BlockHash(10 * i + 2)]).collect();
        (PrefillCost::new(PrefillCostConfig::default()), c, prompts)
    }

    #[test]
    fn the_estimate_of_a_worker_holds_what_its_reported_kv_cache_holds() {
        // Three cold 2-block prompts routed to worker 0, which reports a KV cache of 4
        // blocks (2,048 tokens): the first prompt has been evicted from the estimate (the
        // engine had to evict it too), the last two are still predicted cached.
        let (mut p, mut c, prompts) = one_worker_of_4_blocks_and_3_prompts();
        for h in &prompts {
            assert_eq!(go(&mut p, &req(h), &c).worker, WorkerId(0));
        }
        let key = p.key(&req(&prompts[0]));
        assert_eq!(p.cached(&c[0], &key, 1024).0, 0, "evicted: the worker holds 4 blocks");
        for h in &prompts[1..] {
            assert_eq!(p.cached(&c[0], &p.key(&req(h)), 1024).0, 1024);
        }
        // Without a reported capacity the estimate holds `cache_tokens` (1 M tokens).
        let mut q = PrefillCost::new(PrefillCostConfig::default());
        c[0].capacity.kv_tokens = None;
        for h in &prompts {
            go(&mut q, &req(h), &c);
        }
        assert_eq!(q.cached(&c[0], &q.key(&req(&prompts[0])), 1024).0, 1024);
        // A worker that now reports a smaller cache: its estimate shrinks at the next commit.
        c[0].capacity.kv_tokens = Some(1024);
        go(&mut q, &req(&prompts[2]), &c);
        assert_eq!(q.cached(&c[0], &q.key(&req(&prompts[1])), 1024).0, 0);
        assert_eq!(q.cached(&c[0], &q.key(&req(&prompts[2])), 1024).0, 1024);
    }

    #[test]
    fn the_estimate_keeps_no_partial_tail_block() {
        // Worker 0 reports a KV cache of 4 trace blocks (2,048 tokens). Three prompts of
        // 1.5 blocks (768 tokens: one full block, one partial tail) are routed there. The
        // engine keeps only their full blocks (3 × 512 tokens), so all three are still
        // cached; an estimate that counted the tails (6 blocks) would have evicted the first.
        let (mut p, c, prompts) = one_worker_of_4_blocks_and_3_prompts();
        fn partial(h: &[BlockHash]) -> RequestView<'_> {
            RequestView { input_tokens: 768, ..req(h) }
        }
        for h in &prompts {
            assert_eq!(go(&mut p, &partial(h), &c).worker, WorkerId(0));
        }
        for h in &prompts {
            let key = p.key(&partial(h));
            assert_eq!(p.cached(&c[0], &key, 768).0, 512, "the full block is cached, the tail is not");
        }
        // A whole-block prompt keeps every block.
        let full: Vec<BlockHash> = vec![BlockHash(100), BlockHash(101)];
        go(&mut p, &req(&full), &c);
        assert_eq!(p.cached(&c[0], &p.key(&req(&full)), 1024).0, 1024);
    }

    #[test]
    fn batch_factor_multiplies_the_cost_by_queue_depth() {
        let h: Vec<BlockHash> = (0..8).map(BlockHash).collect();
        let mut c = vec![WorkerView::idle(WorkerId(0)), WorkerView::idle(WorkerId(1))];
        // Worker 0 holds the prompt and runs 3 requests: additive cost 0 + 3 × 64 = 192 <
        // worker 1's 8 × 4,096 = 32,768 of misses, so it wins; × (1 + 10 × 3) = 5,952 still wins; with
        // 2,000 pending, 2,192 × 31 = 67,952 > 32,768: the multiplier moves the request.
        c[0].in_flight = 3;
        for (bf, pending, want) in [(0.0, 2000, 0), (10.0, 0, 0), (10.0, 2000, 1)] {
            let mut p = PrefillCost::new(PrefillCostConfig { batch_factor: bf, ..Default::default() });
            crate::policy::record_routed(&mut p, &req(&h), WorkerId(0), Nanos::ZERO);
            c[0].pending_prefill_tokens = pending;
            assert_eq!(go(&mut p, &req(&h), &c).worker, WorkerId(want), "batch_factor {bf}, pending {pending}");
        }
        let bad = crate::registry::build("prefill_cost", &serde_json::json!({"batch_factor": -1.0}));
        assert!(bad.is_err());
    }

    #[test]
    fn a_long_prefill_goes_where_it_stalls_fewer_requests() {
        // A cold 4,096-token prompt. Worker 0 runs 10 requests and has no prefill queued;
        // worker 1 is empty with 1,000 tokens queued. Defaults (miss 8, stall 0.05, decode 64,
        // the decode charge kept linear here, `decode_queue_scale` 0, to isolate the stall):
        //   worker 0: 0 + 4,096 × (8 + 0.05 × 10) + 64 × 10 = 35,456
        //   worker 1: 1,000 + 4,096 × 8 = 33,768 → worker 1.
        // Without the stall term worker 0 costs 32,768 + 640 = 33,408 and wins.
        let h: Vec<BlockHash> = (0..8).map(BlockHash).collect();
        let mut c = vec![WorkerView::idle(WorkerId(0)), WorkerView::idle(WorkerId(1))];
        c[0].in_flight = 10;
        c[1].pending_prefill_tokens = 1000;
        // With `stall_cap` 0.05 the charge per token is min(0.5, 0.05): worker 0 costs
        // 4,096 × 8.05 + 640 = 33,612 (rounded down) < 33,768 and wins again.
        for (stall, cap, want) in [(0.05, 8.0, 1), (0.0, 8.0, 0), (0.05, 0.05, 0)] {
            let mut p = PrefillCost::new(PrefillCostConfig {
                stall_weight: stall,
                stall_cap: cap,
                decode_queue_scale: 0.0,
                ..Default::default()
            });
            let d = go(&mut p, &req(&h), &c);
            assert_eq!(d.worker, WorkerId(want), "stall_weight {stall}, stall_cap {cap}");
        }
        for bad in [serde_json::json!({"stall_queue_scale": -1.0}), serde_json::json!({"stall_cap": -1.0})] {
            assert!(crate::registry::build("prefill_cost", &bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_stall_weight_grows_with_the_fleets_queue() {
        // Worker 0 runs 10 requests, all still waiting for their first token: mean waiting
        // 10 / 2 = 5, so the stall weight is 0.05 × (1 + 5 / 10) = 0.075 and worker 0 costs
        // 4,096 × (8 + 0.75) + 640 = 36,480 against worker 1's 3,000 + 32,768 = 35,768.
        // With a fixed stall weight (scale 0) worker 0 costs 35,456 and wins. (Linear decode
        // charge, `decode_queue_scale` 0, to isolate the stall.)
        let h: Vec<BlockHash> = (0..8).map(BlockHash).collect();
        let mut c = vec![WorkerView::idle(WorkerId(0)), WorkerView::idle(WorkerId(1))];
        c[0].in_flight = 10;
        c[0].waiting = 10;
        c[1].pending_prefill_tokens = 3000;
        let p = PrefillCost::new(PrefillCostConfig::default());
        assert!((p.stall_weight(&c) - 0.075).abs() < 1e-12);
        for (scale, want) in [(10.0, 1), (0.0, 0)] {
            let mut p = PrefillCost::new(PrefillCostConfig {
                stall_queue_scale: scale,
                decode_queue_scale: 0.0,
                ..Default::default()
            });
            assert_eq!(go(&mut p, &req(&h), &c).worker, WorkerId(want), "stall_queue_scale {scale}");
        }
    }

    #[test]
    fn a_crowded_worker_holding_the_prefix_loses_to_an_idle_one() {
        // An agent's 4,096-token shared prefix is on worker 0, which runs 64 requests with no
        // prefill queued; worker 1 is idle and cold. Linear: worker 0 costs 64 × 64 = 4,096,
        // worker 1 costs 4,096 × 8 = 32,768, so every such request piles onto worker 0.
        // Quadratic (scale 16): worker 0 costs 4,096 × (1 + 64 / 16) = 20,480, still cheaper;
        // at 128 requests it costs 8,192 × 9 = 73,728 > 32,768 and the prefix spreads.
        let h: Vec<BlockHash> = (0..8).map(BlockHash).collect();
        let mut c = vec![WorkerView::idle(WorkerId(0)), WorkerView::idle(WorkerId(1))];
        for (load, scale, want) in [(64, 16.0, 0), (128, 16.0, 1), (128, 0.0, 0)] {
            c[0].in_flight = load;
            let mut p = PrefillCost::new(PrefillCostConfig { decode_queue_scale: scale, ..Default::default() });
            p.on_routed(&req(&h), &p.key(&req(&h)), WorkerId(0), Nanos::ZERO);
            assert_eq!(go(&mut p, &req(&h), &c).worker, WorkerId(want), "load {load}, decode_queue_scale {scale}");
        }
        assert!(crate::registry::build("prefill_cost", &serde_json::json!({"decode_queue_scale": -1.0})).is_err());
    }

    #[test]
    fn cold_ties_rotate() {
        let mut p = PrefillCost::new(PrefillCostConfig::default());
        let c: Vec<WorkerView> = (0..3).map(|i| WorkerView::idle(WorkerId(i))).collect();
        let mut seen = std::collections::HashSet::new();
        for i in 0..3u64 {
            let h = [BlockHash(1000 + i)];
            seen.insert(go(&mut p, &req(&h), &c).worker);
        }
        assert_eq!(seen.len(), 3);
    }

    #[test]
    fn session_gate_sticks_while_warm_and_not_overloaded() {
        let mut p = PrefillCost::new(PrefillCostConfig { session_affinity: true, ..Default::default() });
        let h: Vec<BlockHash> = (0..4).map(BlockHash).collect();
        let mut r = req(&h);
        r.session_id = Some("conv-1");
        let mut c: Vec<WorkerView> = (0..3).map(|i| WorkerView::idle(WorkerId(i))).collect();
        let first = go(&mut p, &r, &c).worker;
        // The bound worker has queued prefill work, so the cost alone would move the turn;
        // it is warm (all 4 blocks) and at 1 ≤ 1.5 × mean(1) load: the gate keeps it.
        c[first.index()].pending_prefill_tokens = 50_000;
        c[first.index()].in_flight = 1;
        let d = go(&mut p, &r, &c);
        assert_eq!((d.worker, d.branch), (first, Branch::Sticky));
        // Overloaded (6 > 1.5 × mean 2): the cost decides and the turn moves.
        c[first.index()].in_flight = 6;
        let d = go(&mut p, &r, &c);
        assert_ne!(d.worker, first);
        assert_ne!(d.branch, Branch::Sticky);
    }
}
