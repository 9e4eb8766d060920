//! The B3 study's routing policies (`scripts/cache_aware_proxy.py`, its `pick_instance_*` functions):
//! `lmetric`, `load_only`, `sticky`, `unified` and `capped`, sharing one per-worker state machine. Each
//! picker lives in the file of its name (`lmetric`, `load_only`, `sticky`, `unified`).
//!
//! Shared state, per worker: an LRU set of 512-token block hashes
//! ([`crate::lru_blocks::LruBlockSet`], `inst.cached_blocks`) updated when a request is dispatched
//! ([`Policy::on_routed`]); `estimate_cache_hit` is the longest leading run of the request's
//! blocks in that set, converted to tokens — or, for a worker that publishes KV events
//! ([`WorkerView::cached_tokens`] set), the engine's own count. Load comes from the worker view:
//! `num_requests` = [`WorkerView::load`] (waiting + running), `pending_prefill_tokens` =
//! [`WorkerView::pending_prefill_tokens`].
//!
//! - **`lmetric`** (`pick_lmetric`): `score = (pending_prefill_tokens + max(0, input − cache_hit)) ×
//!   num_requests`; the first worker with the strictly smallest score wins (Python's
//!   `<`). Branch `score`.
//! - **`load_only`** (`pick_load_only`): the first worker with the fewest `num_requests` (Python's `min`
//!   returns the first seen, so ties pin worker 0 at low load — kept on purpose: the study
//!   reports it as part of its result). Branch `least_load`.
//! - **`sticky`** (`pick_sticky`): a bound session always returns to its worker, whatever
//!   its load, until that worker is unhealthy or gone; an unbound one is bound to the
//!   least-loaded worker; no session id: `load_only`. Branches `sticky`, `new_binding`,
//!   `least_load`.
//! - **`unified`** (`pick_unified`): sticks to the session's worker only when its hit ratio
//!   `cache_hit / max(input, 1) > hit_ratio_threshold` (0.5) *and* its `num_requests ≤
//!   max(mean num_requests, 1) × overload_factor` (2.0); otherwise LMetric with the 4-key
//!   tie-break (score, new prefill, num_requests, then a global round-robin counter among
//!   workers tied on the first three). The session is (re)bound to the worker chosen.
//!   Branches `sticky`, `affinity_broken` (bound but the gate failed), `tie_break`, `score`.
//!
//! - **`capped`**: B3's `capped` is `lmetric` on a trace whose sessions are cut to their
//!   first `MAX_TURNS` (8) turns (`build_capped_trace`; in replay, [`crate::trace::cap_turns`]).
//!   Live, the policy does the same to the traffic: `lmetric`, and a request whose session
//!   (`x-session-id` or OpenAI `user`) already had `max_turns` turns routed is refused
//!   ([`RouteError::SessionCapped`]); requests without a session are never capped. Turns
//!   are counted when a request is committed, so concurrent turns of one session may pass
//!   the cap by how many run at once. Branch `score`.
//!
//! Given the fleet's digest ([`crate::fleet_digest::FleetDigest`]), `lmetric`, `capped`
//! and `unified`'s fallback read the views of the workers holding the prompt's first
//! block and, of the others, only the load buckets that can win or tie; with a worker of
//! no request routable (it scores 0, the least there is) only the digest's zero-load bits
//! and the holders that also score 0. They decide as the pass over every view does.
//!
//! Session bindings and turn counts live in bounded LRU maps (`max_sessions`; an evicted
//! one is a new session). Knobs: [`B3Config`] (`block_tokens` 512, Mooncake's `hash_ids` blocks).

use crate::fleet_digest::FleetDigest;
use crate::hash::{HashAlgo, request_blocks};
use crate::lru_blocks::{DEFAULT_CAPACITY_BLOCKS, Hits, WorkerBlockSets};
use crate::policy::util::{Rotation, SessionTable, SessionTurns, bits_has};
use crate::policy::{Branch, Decision, KnobError, MatchUnit, PickCtx, Policy, RequestKey, RouteError, patch_knobs};
use crate::types::{BlockHash, Nanos, RequestView, WorkerId, WorkerView};
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

mod lmetric;
mod load_only;
mod sticky;
mod unified;

/// Which of B3 `cache_aware_proxy.py`'s pickers a [`B3`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum B3Mode {
    /// `pick_lmetric`.
    LMetric,
    /// `pick_load_only`.
    LoadOnly,
    /// `pick_sticky`.
    Sticky,
    /// `pick_unified`.
    Unified,
    /// `pick_lmetric` on B3's turn-capped workload: sessions past `max_turns` are refused.
    Capped,
}

impl B3Mode {
    /// The knobs this picker reads, a subset of [`B3Config`]'s fields. `lmetric` and
    /// `load_only` never look at sessions or the overload gate; `sticky` binds sessions but
    /// has no gate; only `unified` reads all five. (`load_only` picks on load alone; its
    /// block knobs size the LRU sets behind the cached-token estimate it reports.)
    pub const fn knob_names(self) -> &'static [&'static str] {
        match self {
            B3Mode::LMetric | B3Mode::LoadOnly => &["block_tokens", "cache_blocks"],
            B3Mode::Sticky => &["block_tokens", "cache_blocks", "max_sessions"],
            B3Mode::Unified => {
                &["block_tokens", "cache_blocks", "overload_factor", "hit_ratio_threshold", "max_sessions"]
            }
            B3Mode::Capped => &["block_tokens", "cache_blocks", "max_turns", "max_sessions"],
        }
    }

    /// Registry name.
    pub const fn name(self) -> &'static str {
        match self {
            B3Mode::LMetric => "lmetric",
            B3Mode::LoadOnly => "load_only",
            B3Mode::Sticky => "sticky",
            B3Mode::Unified => "unified",
            B3Mode::Capped => "capped",
        }
    }
}

/// Knobs of the B3 policies (defaults from B3 `cache_aware_proxy.py`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct B3Config {
    /// Tokens per block (B3 `BLOCK_SIZE`).
    pub block_tokens: u32,
    /// Capacity of each worker's LRU block set, in blocks.
    pub cache_blocks: usize,
    /// `unified`: the bound worker is overloaded above this × mean `num_requests`.
    pub overload_factor: f64,
    /// `unified`: the bound worker's hit ratio must be strictly above this to stick.
    pub hit_ratio_threshold: f64,
    /// Session bindings (and, for `capped`, turn counts) kept (LRU beyond).
    pub max_sessions: usize,
    /// `capped`: turns routed per session before its later ones are refused (B3 `MAX_TURNS`).
    pub max_turns: u32,
}

impl Default for B3Config {
    fn default() -> Self {
        B3Config {
            block_tokens: 512,
            cache_blocks: DEFAULT_CAPACITY_BLOCKS,
            overload_factor: 2.0,
            hit_ratio_threshold: 0.5,
            max_sessions: 1 << 20,
            max_turns: 8,
        }
    }
}

fn validate(c: &B3Config) -> Result<(), String> {
    if c.block_tokens == 0 {
        return Err("block_tokens must be at least 1".into());
    }
    if c.cache_blocks == 0 {
        return Err("cache_blocks must be at least 1".into());
    }
    if !(c.overload_factor.is_finite() && c.overload_factor > 0.0) {
        return Err(format!("overload_factor must be a positive number, got {}", c.overload_factor));
    }
    if !(0.0..=1.0).contains(&c.hit_ratio_threshold) {
        return Err(format!("hit_ratio_threshold must be in [0, 1], got {}", c.hit_ratio_threshold));
    }
    if c.max_sessions == 0 {
        return Err("max_sessions must be at least 1".into());
    }
    if c.max_turns == 0 {
        return Err("max_turns must be at least 1".into());
    }
    Ok(())
}

/// Upper bound on blocks hashed per request (512 × 512 = 262,144 tokens).
const MAX_BLOCKS: usize = 512;

/// One of B3 `cache_aware_proxy.py`'s pickers with its shared per-worker state. See the module docs.
#[derive(Debug, Clone)]
pub struct B3 {
    mode: B3Mode,
    cfg: B3Config,
    cached: WorkerBlockSets,
    affinity: SessionTable,
    turns: SessionTurns,
    rr_counter: Rotation,
}

/// The most buckets of a fleet digest `lmetric`, `capped` and `unified` walk for the least
/// score among the workers holding nothing of a prompt before they read every view
/// instead (a fleet with no idle worker and queued prefill far above the prompt's).
const MAX_BUCKETS_WALKED: usize = 64;

/// The routable workers holding a prompt's first block, by position in the candidates, with
/// their terms ([`B3::holders_kept`]).
type Holders = SmallVec<[(u32, Terms); 16]>;

/// Whether the worker at position `pos` is one of `holders` (sorted by position).
fn holds(holders: &Holders, pos: u32) -> bool {
    holders.binary_search_by_key(&pos, |h| h.0).is_ok()
}

/// What a decision reads through the fleet's digest: the request, its block hashes, the
/// candidates, a digest describing them (no view with an engine-reported count) and the
/// workers holding the prompt's first block.
#[derive(Clone, Copy)]
struct Kept<'a, 'r> {
    req: &'a RequestView<'r>,
    blocks: &'a [BlockHash],
    c: &'a [WorkerView],
    f: &'a FleetDigest,
    hits: &'a Hits,
}

/// Per-worker LMetric terms of one request.
#[derive(Debug, Clone, Copy)]
struct Terms {
    id: WorkerId,
    /// What the worker holds of the request: `(matched, total, unit)`.
    hit: (u64, u64, MatchUnit),
    /// Cached prompt tokens (`cache_hit`).
    cache_hit: u64,
    new_prefill: u64,
    bs: u64,
    score: u128,
}

impl B3 {
    /// A B3 picker in `mode` with `cfg` (assumed valid; use [`B3::try_new`] to check).
    pub fn new(mode: B3Mode, cfg: B3Config) -> Self {
        let affinity = SessionTable::new(cfg.max_sessions);
        let turns = SessionTurns::new(if mode == B3Mode::Capped { cfg.max_sessions } else { 1 });
        B3 { mode, cfg, cached: WorkerBlockSets::default(), affinity, turns, rr_counter: Rotation::default() }
    }

    /// Builds after validating `cfg`.
    ///
    /// # Errors
    /// [`KnobError`] naming the bad knob.
    pub fn try_new(mode: B3Mode, cfg: B3Config) -> Result<Self, KnobError> {
        validate(&cfg).map_err(|message| KnobError { policy: mode.name(), message })?;
        Ok(B3::new(mode, cfg))
    }

    /// Tokens per block of `req`'s key (a trace's own block size when it carries blocks).
    fn block_size_of(&self, req: &RequestView<'_>) -> u64 {
        req.blocks.map_or(self.cfg.block_tokens, |b| b.block_tokens.max(1)) as u64
    }

    /// One worker's terms, its estimate read from its own set.
    fn terms(&self, w: &WorkerView, req: &RequestView<'_>, blocks: &[BlockHash]) -> Terms {
        let hit = self.cached.hit_of(w, blocks);
        self.terms_of(w, req, blocks, hit)
    }

    /// One worker's terms, `hit` being the leading blocks of `blocks` its set holds (from
    /// [`crate::lru_blocks::WorkerBlockSets::hits`] for the whole fleet; ignored when the worker reports its
    /// cached tokens).
    fn terms_of(&self, w: &WorkerView, req: &RequestView<'_>, blocks: &[BlockHash], hit: u64) -> Terms {
        let input = req.input_tokens as u64;
        let (cache_hit, hit) = match w.cached_tokens {
            // Precise: the engine's own count from its KV events.
            Some(t) => (t.min(input), (t.min(input), input, MatchUnit::Tokens)),
            None => ((hit * self.block_size_of(req)).min(input), (hit, blocks.len() as u64, MatchUnit::Blocks)),
        };
        let new_prefill = input - cache_hit;
        let bs = w.load() as u64;
        let p_tokens = w.pending_prefill_tokens.saturating_add(new_prefill);
        Terms { id: w.id, hit, cache_hit, new_prefill, bs, score: p_tokens as u128 * bs as u128 }
    }

    /// The routable holders of the prompt's first block (`hits`) that score 0, LMetric's
    /// least, read through `f` (a digest describing `c`, no view with an engine-reported
    /// count): those with no request (load 0: the digest's zero-load bits; their terms
    /// need no view, as nothing times 0 is 0) and those with nothing queued and the whole
    /// prompt cached (their views read). With their terms, in no particular order;
    /// O(holders), one position lookup each.
    fn zero_score_holders(&self, k: Kept<'_, '_>) -> Holders {
        let Kept { req, blocks, c, f, hits } = k;
        let (input, block) = (u64::from(req.input_tokens), self.block_size_of(req));
        let zero = f.zero_load();
        let mut out = Holders::new();
        for (id, held) in hits.entries() {
            let Some(i) = f.position(id) else { continue };
            if bits_has(zero, i) {
                let cache_hit = (u64::from(held) * block).min(input);
                let hit = (u64::from(held), blocks.len() as u64, MatchUnit::Blocks);
                out.push((i as u32, Terms { id, hit, cache_hit, new_prefill: input - cache_hit, bs: 0, score: 0 }));
            } else if u64::from(held).saturating_mul(block) >= input
                && let Some(w) = c.get(i).filter(|w| w.id == id && w.is_routable())
            {
                let t = self.terms_of(w, req, blocks, u64::from(held));
                if t.score == 0 {
                    out.push((i as u32, t));
                }
            }
        }
        out
    }

    /// The routable workers of `c` holding the prompt's first block (`hits`), by position
    /// from `f` (a digest describing `c`), each with its terms, sorted by position; `None`
    /// when the prompt has no tokens (every worker's new prefill is then 0 and the digest's
    /// walk has nothing to order by: the views are read).
    fn holders_kept(&self, k: Kept<'_, '_>) -> Option<Holders> {
        let Kept { req, blocks, c, f, hits } = k;
        if req.input_tokens == 0 {
            return None;
        }
        let mut holders = Holders::new();
        for (id, held) in hits.entries() {
            if let Some(i) = f.position(id).filter(|&i| c.get(i).is_some_and(|w| w.id == id && w.is_routable())) {
                holders.push((i as u32, self.terms_of(&c[i], req, blocks, u64::from(held))));
            }
        }
        holders.sort_unstable_by_key(|h| h.0);
        Some(holders)
    }

    fn decision(&self, t: &Terms, branch: Branch) -> Decision {
        Decision::new(t.id, branch).with_match(t.hit.0, t.hit.1, t.hit.2).with_score(t.score as f64)
    }

    /// Session bindings currently held.
    pub fn sessions(&self) -> usize {
        self.affinity.len()
    }

    /// Blocks the router believes `worker` holds.
    pub fn cached_blocks(&self, worker: WorkerId) -> usize {
        self.cached.len_of(worker)
    }
}

impl Policy for B3 {
    fn name(&self) -> &'static str {
        self.mode.name()
    }

    fn key(&self, req: &RequestView<'_>) -> RequestKey {
        let mut blocks = Vec::new();
        request_blocks(req, self.cfg.block_tokens as usize, MAX_BLOCKS, HashAlgo::Xxh3, &mut blocks);
        RequestKey { blocks, block_tokens: self.block_size_of(req), worker_kv_tokens: None }
    }

    fn pick(
        &self,
        req: &RequestView<'_>,
        key: &RequestKey,
        candidates: &[WorkerView],
        ctx: &mut PickCtx<'_>,
    ) -> Result<Decision, RouteError> {
        let blocks = &key.blocks;
        let d = match self.mode {
            B3Mode::LMetric => self.pick_lmetric(req, blocks, candidates, ctx.fleet),
            B3Mode::LoadOnly => self.pick_load_only(req, blocks, candidates),
            B3Mode::Sticky => self.pick_sticky(req, blocks, candidates),
            B3Mode::Unified => self.pick_unified(req, blocks, candidates, ctx.fleet),
            B3Mode::Capped => {
                if req.session_id.is_some_and(|sid| self.turns.get(sid).unwrap_or(0) >= self.cfg.max_turns) {
                    return Err(RouteError::SessionCapped { max_turns: self.cfg.max_turns });
                }
                self.pick_lmetric(req, blocks, candidates, ctx.fleet)
            }
        };
        d.ok_or(RouteError::NoWorker)
    }

    fn idempotent_commits(&self) -> bool {
        // Capped counts each committed turn of a session.
        self.mode != B3Mode::Capped
    }

    fn on_routed(&mut self, req: &RequestView<'_>, key: &RequestKey, worker: WorkerId, _now: Nanos) {
        let cap = self.cfg.cache_blocks;
        self.cached.insert(worker, &key.blocks, cap, false);
        // B3 sticky and unified bind the session to the worker that serves it (a new
        // binding, a kept one refreshed, or a broken one moved).
        if matches!(self.mode, B3Mode::Sticky | B3Mode::Unified)
            && let Some(sid) = req.session_id
        {
            self.affinity.bind(sid, worker);
        }
        if self.mode == B3Mode::Capped
            && let Some(sid) = req.session_id
        {
            self.turns.record(sid);
        }
    }

    fn on_worker_removed(&mut self, worker: WorkerId) {
        self.cached.remove_worker(worker);
        self.affinity.forget_worker(worker);
    }

    fn knobs(&self) -> serde_json::Value {
        let mut all = serde_json::to_value(&self.cfg).unwrap_or_default();
        if let Some(o) = all.as_object_mut() {
            o.retain(|k, _| self.mode.knob_names().contains(&k.as_str()));
        }
        all
    }

    fn set_knobs(&mut self, patch: &serde_json::Value) -> Result<(), KnobError> {
        // A knob this picker never reads is an error naming it, not a silent no-op.
        if let Some(k) =
            patch.as_object().and_then(|p| p.keys().find(|k| !self.mode.knob_names().contains(&k.as_str())))
        {
            return Err(KnobError {
                policy: self.mode.name(),
                message: format!(
                    "{} does not use knob `{k}`; its knobs: {}",
                    self.mode.name(),
                    self.mode.knob_names().join(", ")
                ),
            });
        }
        let next = patch_knobs(self.mode.name(), &self.cfg, patch, validate)?;
        if next.cache_blocks != self.cfg.cache_blocks || next.block_tokens != self.cfg.block_tokens {
            // Block sets are sized and keyed by these: start afresh.
            self.cached.clear();
        }
        if next.max_sessions != self.cfg.max_sessions {
            self.affinity.resize(next.max_sessions);
            if self.mode == B3Mode::Capped {
                self.turns.resize(next.max_sessions);
            }
        }
        self.cfg = next;
        Ok(())
    }

    fn index_size(&self) -> u64 {
        self.cached.total()
    }

    /// `lmetric`, `capped` and `unified` (its LMetric fallback) read a plain digest;
    /// `load_only` and `sticky` read every view.
    fn fleet_digest(&self) -> Option<FleetDigest> {
        matches!(self.mode, B3Mode::LMetric | B3Mode::Capped | B3Mode::Unified).then(FleetDigest::default)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::BlockSeq;
    use rand_core::SeedableRng;

    fn req<'a>(blocks: &'a [BlockHash], session: Option<&'a str>) -> RequestView<'a> {
        RequestView {
            model: "m",
            text: None,
            token_ids: None,
            blocks: Some(BlockSeq { block_tokens: 512, hashes: blocks }),
            input_tokens: blocks.len() as u32 * 512,
            output_tokens: None,
            session_id: session,
            role: crate::types::Role::Both,
        }
    }

    fn fleet(loads: &[u32]) -> Vec<WorkerView> {
        loads
            .iter()
            .enumerate()
            .map(|(i, &l)| {
                let mut w = WorkerView::idle(WorkerId(i as u32));
                w.in_flight = l;
                w
            })
            .collect()
    }

    fn pick(p: &mut B3, r: &RequestView<'_>, c: &[WorkerView]) -> Decision {
        let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(1);
        let mut ctx = PickCtx { now: Nanos::ZERO, rng: &mut rng, fleet: None };
        crate::policy::route(p, r, c, &mut ctx).expect("routable")
    }

    fn hashes(n: u64, base: u64) -> Vec<BlockHash> {
        (0..n).map(|i| BlockHash(base + i)).collect()
    }

    #[test]
    fn capped_refuses_a_sessions_turns_past_max_turns_once_they_are_committed() {
        let mut p = B3::try_new(B3Mode::Capped, B3Config { max_turns: 2, ..B3Config::default() }).expect("valid");
        let blocks = [BlockHash(1), BlockHash(2)];
        let c = fleet(&[0, 0]);
        let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(1);
        let mut ctx = PickCtx { now: Nanos::ZERO, rng: &mut rng, fleet: None };
        // Decisions alone count nothing: a decision changes nothing until it is committed.
        for _ in 0..3 {
            assert!(p.pick(&req(&blocks, Some("s")), &p.key(&req(&blocks, Some("s"))), &c, &mut ctx).is_ok());
        }
        pick(&mut p, &req(&blocks, Some("s")), &c);
        pick(&mut p, &req(&blocks, Some("s")), &c);
        let third = crate::policy::route(&mut p, &req(&blocks, Some("s")), &c, &mut ctx);
        assert_eq!(third.expect_err("capped"), RouteError::SessionCapped { max_turns: 2 });
        // Another session, and requests without one, are not.
        pick(&mut p, &req(&blocks, Some("t")), &c);
        for _ in 0..4 {
            pick(&mut p, &req(&blocks, None), &c);
        }
        assert!(p.knobs().get("max_turns").is_some() && p.knobs().get("overload_factor").is_none());
        assert!(B3::try_new(B3Mode::Capped, B3Config { max_turns: 0, ..B3Config::default() }).is_err());
    }

    #[test]
    fn lmetric_prefers_cache_warm_worker_at_equal_load() {
        let mut p = B3::new(B3Mode::LMetric, B3Config::default());
        let h = hashes(4, 100);
        crate::policy::record_routed(&mut p, &req(&h, None), WorkerId(2), Nanos::ZERO);
        let d = pick(&mut p, &req(&h, None), &fleet(&[1, 1, 1]));
        assert_eq!(d.worker, WorkerId(2));
        assert_eq!(d.matched, 4);
        assert_eq!(d.score, Some(0.0));
    }

    #[test]
    fn lmetric_score_is_prefill_times_batch() {
        let mut p = B3::new(B3Mode::LMetric, B3Config::default());
        let h = hashes(4, 100);
        let mut c = fleet(&[2, 1]);
        c[1].pending_prefill_tokens = 4000; // (4000 + 2048) × 1 = 6048 > 2048 × 2 = 4096
        let d = pick(&mut p, &req(&h, None), &c);
        assert_eq!(d.worker, WorkerId(0));
        assert_eq!(d.score, Some(4096.0));
    }

    #[test]
    fn load_only_ties_pin_the_first_worker() {
        let mut p = B3::new(B3Mode::LoadOnly, B3Config::default());
        let h = hashes(2, 7);
        for _ in 0..5 {
            assert_eq!(pick(&mut p, &req(&h, None), &fleet(&[0, 0, 0])).worker, WorkerId(0));
        }
        assert_eq!(pick(&mut p, &req(&h, None), &fleet(&[3, 1, 1])).worker, WorkerId(1));
    }

    #[test]
    fn sticky_never_breaks_a_binding_under_load() {
        let mut p = B3::new(B3Mode::Sticky, B3Config::default());
        let h = hashes(2, 7);
        let d = pick(&mut p, &req(&h, Some("s1")), &fleet(&[5, 0, 3]));
        assert_eq!((d.worker, d.branch), (WorkerId(1), Branch::NewBinding));
        for load in [10, 100, 10_000] {
            let d = pick(&mut p, &req(&h, Some("s1")), &fleet(&[0, load, 0]));
            assert_eq!((d.worker, d.branch), (WorkerId(1), Branch::Sticky));
        }
        // Only an unhealthy worker releases the binding.
        let mut c = fleet(&[0, 0, 0]);
        c[1].health = crate::types::Health::Unhealthy;
        assert_ne!(pick(&mut p, &req(&h, Some("s1")), &c).worker, WorkerId(1));
    }

    #[test]
    fn unified_sticks_only_when_warm_and_not_overloaded() {
        let mut p = B3::new(B3Mode::Unified, B3Config::default());
        let h = hashes(4, 100);
        // First turn: no binding, tie on all keys → round-robin counter decides.
        let d = pick(&mut p, &req(&h, Some("s")), &fleet(&[0, 0, 0]));
        assert_eq!(d.branch, Branch::TieBreak);
        let bound = d.worker;
        // Warm (ratio 1.0 > 0.5) and load 2 ≤ 2 × mean(max(1, 4/3)) → stick.
        let mut loads = [1, 1, 1];
        loads[bound.index()] = 2;
        let d = pick(&mut p, &req(&h, Some("s")), &fleet(&loads));
        assert_eq!((d.worker, d.branch), (bound, Branch::Sticky));
        // Overloaded: 9 > 2 × mean(11/3) = 7.33 → the gate fails and LMetric decides. With
        // 10,000 pending prefill tokens the bound worker scores 10,000 × 9 against
        // 2,048 × 1 elsewhere, so the request moves.
        let mut loads = [1, 1, 1];
        loads[bound.index()] = 9;
        let mut c = fleet(&loads);
        c[bound.index()].pending_prefill_tokens = 10_000;
        let d = pick(&mut p, &req(&h, Some("s")), &c);
        assert_eq!(d.branch, Branch::AffinityBroken);
        assert_ne!(d.worker, bound);
    }

    #[test]
    fn unified_hit_ratio_must_exceed_half() {
        let mut p = B3::new(B3Mode::Unified, B3Config::default());
        let h = hashes(4, 100);
        let d = pick(&mut p, &req(&h, Some("s")), &fleet(&[0, 0]));
        let bound = d.worker;
        // Same session, a new prompt sharing exactly 2 of 4 blocks: ratio 0.5, not > 0.5.
        let mut h2 = h[..2].to_vec();
        h2.extend(hashes(2, 900));
        let mut loads = [5, 5];
        loads[bound.index()] = 0;
        let d = pick(&mut p, &req(&h2, Some("s")), &fleet(&loads));
        assert_eq!(d.branch, Branch::AffinityBroken, "ratio 0.5 must not stick");
        // 3 of 4 blocks: ratio 0.75 → sticks.
        let mut h3 = h[..3].to_vec();
        h3.push(BlockHash(5000));
        let d = pick(&mut p, &req(&h3, Some("s")), &fleet(&[1, 1]));
        assert_eq!(d.branch, Branch::Sticky);
    }

    #[test]
    fn unified_round_robins_among_full_ties() {
        let mut p = B3::new(B3Mode::Unified, B3Config::default());
        let mut seen = std::collections::HashSet::new();
        for i in 0..3u64 {
            let h = hashes(1, 10_000 * (i + 1));
            seen.insert(pick(&mut p, &req(&h, None), &fleet(&[0, 0, 0])).worker);
        }
        assert_eq!(seen.len(), 3, "fresh traffic must not pin worker 0");
    }

    #[test]
    fn session_bindings_are_bounded() {
        let cfg = B3Config { max_sessions: 4, ..B3Config::default() };
        let mut p = B3::new(B3Mode::Sticky, cfg);
        let h = hashes(1, 1);
        for i in 0..100 {
            let s = format!("s{i}");
            pick(&mut p, &req(&h, Some(&s)), &fleet(&[0, 0]));
        }
        assert_eq!(p.sessions(), 4);
    }
}
