//! `least_ttft`: kvroute's default policy — route to the worker where the request's
//! predicted TTFT, plus the delay its own uncached prefill adds for the requests queued
//! behind it, is least; each worker is calibrated online from what its requests met.
//!
//! ```text
//! uncached(req, w) = own + context_weight × context(req, w),  context(req, w) = own × (attended + own / 2),
//!                    own = input − attended, attended = hit_factor(w) × cached(req, w)
//! work(w)          = pending_prefill_tokens(w) + uncached(req, w) + decode(w)
//! decode(w)        = D(waiting(w)) + share(w) × [D(load(w)) − D(waiting(w))],  D(n) = decode_weight × n × (1 + n / decode_queue_scale)
//! share(w)         = clamp((load(w) / max_concurrent(w) − decode_occupancy_free) / (decode_occupancy_full − decode_occupancy_free), 0, 1)
//! miss(w)          = (miss_weight − 1) × min(1, mean_waiting / miss_queue_scale) + stall(w)
//! shared(w)        = waiting_delay_weight × min(waiting(w), waiting_delay_cap)
//! score(w)         = [work(w) + uncached(req, w) × (miss(w) + shared(w))] / prefill_tokens_per_sec      (seconds)
//! predicted TTFT   = overhead(w) + [scale(w) × work(w) + ctx(w) × context(req, w)] / prefill_tokens_per_sec
//! ```
//!
//! - `work(w)`: on a continuous-batching engine TTFT is the prefill queued ahead, the
//!   request's own uncached prefill and the running requests' decode steps, over the
//!   prefill throughput. `cached` is the engine's count with KV events
//!   ([`WorkerView::cached_tokens`]), else `prefill_cost`'s LRU estimate.
//! - `miss(w)`: a miss also costs others — it stalls the running requests (`stall(w)`,
//!   [`crate::policy::prefill_cost`]) and, only when the fleet has a queue, every request
//!   behind it (full from `miss_queue_scale` waiting per worker, or the workers' mean
//!   `max_concurrent` if smaller); `shared(w)`: chunked prefill runs the worker's waiting
//!   prompts in the same steps, so a long miss goes where fewer wait. `decode(w)`: waiting
//!   requests count in full, running ones only as the batch fills.
//! - **Session balance gate**: a request opening a session goes only to workers whose load
//!   stays within `max(session_balance_rel × mean, mean + session_balance_abs)` (branch
//!   `new_binding`), since its first placement decides where its history is cached; off
//!   when the bound exceeds the mean `max_concurrent` (the score already prices queues),
//!   and while the engines report under `session_balance_min_hit` of the prompt tokens
//!   cached (a history the cache does not keep holds no session to its worker).
//! - `hit_factor(w)` discounts a worker whose engine reports under half the hits its peers
//!   do; the TTFT fit (`overhead`, `scale`, `ctx`: [`TtftFit`]) is exported, not ranked
//!   on; `ctx` learns what attention adds per token attended, as an engine's prefill
//!   pays it (docs/profiles.md), and is 0 where it does not help the fit. The measurements
//!   behind each term: docs/lab/2026-11-26-policy-module-history.md.

use crate::fleet_digest::FleetDigest;
use crate::lru_blocks::Hits;
use crate::policy::prefill_cost::{Match, PrefillCost, PrefillCostConfig};
use crate::policy::util::{
    FleetMeans, MeanSums, bits_count_in, bits_has, bits_next, bits_nth, bits_nth_from, bits_set, rotate,
};
use crate::policy::{
    Branch, Decision, KnobError, Observation, PickCtx, Policy, RequestKey, RouteError, TtftPrediction, patch_knobs,
    routable_view_of, view_of,
};
use crate::types::{Nanos, RequestView, WorkerId, WorkerView};
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;
use std::collections::{BTreeMap, HashMap};

/// The knobs `least_ttft` adds to `prefill_cost`'s.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LeastTtftConfig {
    /// Prior prefill throughput of a worker, tokens/s: the unit that turns work into
    /// seconds before calibration.
    pub prefill_tokens_per_sec: f64,
    /// Weight of a new observation in a worker's profile, in [0, 1]; 0 turns calibration off.
    pub calibration_rate: f64,
    /// Learn each worker's `hit_ratio` from engine-reported cached tokens.
    pub calibrate_hits: bool,
    /// Bound of the learned TTFT scale, both ways (≥ 1).
    pub max_scale: f64,
    /// Mean waiting requests per worker (the router's ledger) at which a miss is charged
    /// its full `miss_weight`; below, the charge beyond the request's own prefill grows
    /// linearly from 0 (a light fleet has no queue for a miss to delay). 0: always full
    /// (`prefill_cost`'s charge).
    pub miss_queue_scale: f64,
    /// Session balance gate, relative part (× the routable workers' mean load; 0 turns the
    /// gate off): a request opening a session the router has not seen goes only to a
    /// worker whose load with it stays at most `max(session_balance_rel × mean,
    /// mean + session_balance_abs)`, while at least one worker does.
    pub session_balance_rel: f64,
    /// Session balance gate, absolute part, in requests above the mean load (see
    /// `session_balance_rel`).
    pub session_balance_abs: f64,
    /// Session balance gate, the least share of prompt tokens the engines report cached
    /// (over about the last [`FLEET_HIT_WINDOW`] requests with a reported count) at which
    /// the gate applies, 0.0–1.0: a session sticks to its worker only while that worker
    /// keeps its history, so where the caches serve little (a KV-bound fleet) the gate
    /// only moves new sessions off the workers the score prefers. 0 = the gate applies
    /// whatever the hits; until `FLEET_HIT_WINDOW` reports the gate applies.
    pub session_balance_min_hit: f64,
    /// Batch occupancy (`load / max_concurrent`) up to which the running requests' decode
    /// charge is waived (see `decode_occupancy_full`).
    pub decode_occupancy_free: f64,
    /// Batch occupancy from which the running requests' decode charge is whole; between
    /// `decode_occupancy_free` and this it grows linearly. 0 turns the waiver off: the
    /// whole charge at any occupancy (`prefill_cost`'s).
    pub decode_occupancy_full: f64,
    /// Per request waiting for its first token on the worker, the share of each of the
    /// request's uncached tokens charged again (they lengthen the prefill steps the
    /// waiting requests finish in); 0 turns the charge off.
    pub waiting_delay_weight: f64,
    /// The most waiting requests `waiting_delay_weight` counts on a worker: only the
    /// requests that share a prefill step with the new one are delayed by it, and a step
    /// holds a bounded number of prompts.
    pub waiting_delay_cap: f64,
    /// Extra prefill work per uncached token per token it attends to (the cached prefix and
    /// the prompt's own earlier tokens), in prompt tokens: the request's own prefill costs
    /// `own × (1 + context_weight × (cached + own / 2))`. An engine's attention makes a
    /// suffix on a long cached context dearer per token (docs/profiles.md: the H100 grid
    /// gives `prefill_attention_s / prefill_per_token_s` ≈ 1.2e-4 over the cached prefix). 0 = a flat cost per token.
    pub context_weight: f64,
}

impl Default for LeastTtftConfig {
    fn default() -> Self {
        LeastTtftConfig {
            prefill_tokens_per_sec: 20_000.0,
            calibration_rate: 0.05,
            calibrate_hits: true,
            max_scale: 1000.0,
            miss_queue_scale: 32.0,
            session_balance_rel: 1.25,
            session_balance_abs: 2.0,
            session_balance_min_hit: 0.3,
            decode_occupancy_free: 0.4,
            decode_occupancy_full: 0.8,
            waiting_delay_weight: 0.2,
            waiting_delay_cap: 16.0,
            context_weight: 0.0,
        }
    }
}

/// Names of `least_ttft`'s own knobs (the others are `prefill_cost`'s).
const OWN_KNOBS: [&str; 13] = [
    "prefill_tokens_per_sec",
    "calibration_rate",
    "calibrate_hits",
    "max_scale",
    "miss_queue_scale",
    "session_balance_rel",
    "session_balance_abs",
    "session_balance_min_hit",
    "decode_occupancy_free",
    "decode_occupancy_full",
    "waiting_delay_weight",
    "waiting_delay_cap",
    "context_weight",
];

fn validate(c: &LeastTtftConfig) -> Result<(), String> {
    if !(c.prefill_tokens_per_sec.is_finite() && c.prefill_tokens_per_sec > 0.0) {
        return Err(format!("prefill_tokens_per_sec must be a finite number > 0, got {}", c.prefill_tokens_per_sec));
    }
    if !(0.0..=1.0).contains(&c.calibration_rate) {
        return Err(format!("calibration_rate must be in [0, 1], got {}", c.calibration_rate));
    }
    if !(c.miss_queue_scale.is_finite() && c.miss_queue_scale >= 0.0) {
        return Err(format!("miss_queue_scale must be a finite number >= 0, got {}", c.miss_queue_scale));
    }
    if !(c.session_balance_rel == 0.0 || (c.session_balance_rel.is_finite() && c.session_balance_rel >= 1.0)) {
        return Err(format!(
            "session_balance_rel must be 0 (off) or a finite number >= 1, got {}",
            c.session_balance_rel
        ));
    }
    if !(c.session_balance_abs.is_finite() && c.session_balance_abs >= 0.0) {
        return Err(format!("session_balance_abs must be a finite number >= 0, got {}", c.session_balance_abs));
    }
    if !(0.0..=1.0).contains(&c.session_balance_min_hit) {
        return Err(format!("session_balance_min_hit must be in [0, 1], got {}", c.session_balance_min_hit));
    }
    let (free, full) = (c.decode_occupancy_free, c.decode_occupancy_full);
    if !(full == 0.0 || (free.is_finite() && full.is_finite() && 0.0 <= free && free < full)) {
        return Err(format!(
            "decode_occupancy_full must be 0 (off) or a finite number > decode_occupancy_free >= 0, got {full} and {free}"
        ));
    }
    if !(c.waiting_delay_weight.is_finite() && c.waiting_delay_weight >= 0.0) {
        return Err(format!("waiting_delay_weight must be a finite number >= 0, got {}", c.waiting_delay_weight));
    }
    if !(c.context_weight.is_finite() && (0.0..=1.0).contains(&c.context_weight)) {
        return Err(format!("context_weight must be a number in [0, 1], got {}", c.context_weight));
    }
    if !(c.waiting_delay_cap.is_finite() && c.waiting_delay_cap >= 0.0) {
        return Err(format!("waiting_delay_cap must be a finite number >= 0, got {}", c.waiting_delay_cap));
    }
    if !(c.max_scale.is_finite() && c.max_scale >= 1.0) {
        return Err(format!("max_scale must be a finite number >= 1, got {}", c.max_scale));
    }
    Ok(())
}

/// A worker's predicted hits are discounted only when it delivers less than this share of
/// the hits the best worker of the fleet delivers (`hit_factor = min(1, relative /
/// HIT_SHORTFALL)`): smaller differences between workers are the noise of the router's
/// estimate, and discounting them moved requests off their caches.
const HIT_SHORTFALL: f64 = 0.5;

/// TTFT observations a worker needs before its own fit is used (until then it takes the
/// fleet's).
const MIN_FIT_SAMPLES: u64 = 8;

/// The share of the straight-line fit's residual variance the fit with the context term must
/// stay under to be used: a context term that explains little is the noise of queues
/// (on an engine whose prefill cost is flat per token it fitted one, and the predictions
/// got worse: docs/lab/2026-11-27-ttft-prediction.md).
const CONTEXT_FIT_GAIN: f64 = 0.8;

/// What `least_ttft` has learned about one worker: a linear fit of its measured TTFT against
/// the uncalibrated prediction and the request's own attention term, `measured ≈ overhead +
/// scale × predicted + context × context_secs` ([`TtftFit`]), from exponentially weighted
/// sums (each observation's weight decays by `1 − calibration_rate` per later one), and the
/// share of predicted hits its engine reported.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct WorkerProfile {
    /// Weighted count, and weighted sums of x (predicted s), z (context term, token·s),
    /// y (measured s), x², x·z, z², x·y, z·y, y².
    sums: [f64; 10],
    /// TTFT observations received.
    pub ttft_samples: u64,
    /// Share of predicted cached tokens the engine reported cached, in [0, 1] (1 before any).
    pub hit_ratio: f64,
    /// Observations that calibrated `hit_ratio`.
    pub hit_samples: u64,
}

impl Default for WorkerProfile {
    /// Nothing observed: no fit, every predicted hit believed.
    fn default() -> Self {
        WorkerProfile { sums: [0.0; 10], ttft_samples: 0, hit_ratio: 1.0, hit_samples: 0 }
    }
}

/// A worker's TTFT fit: `measured ≈ overhead_secs + scale × uncalibrated_secs + context ×
/// context_secs` ([`TtftPrediction`]). The context term is what a prefill's attention adds
/// per new token per token it attends to (the engine model's `prefill_attention_s`, as a
/// share of the prior per-token cost); it is fitted only once the observations separate it
/// from the linear term, else 0.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TtftFit {
    /// Multiplier of the uncalibrated prediction, in `[1/max_scale, max_scale]`.
    pub scale: f64,
    /// Multiplier of [`TtftPrediction::context_secs`], per token, ≥ 0.
    pub context: f64,
    /// Fixed part, seconds, ≥ 0.
    pub overhead_secs: f64,
}

impl TtftFit {
    /// No calibration: the prior.
    pub const PRIOR: TtftFit = TtftFit { scale: 1.0, context: 0.0, overhead_secs: 0.0 };

    /// The calibrated TTFT of `p`, seconds.
    pub fn secs(&self, p: &TtftPrediction) -> f64 {
        self.overhead_secs + self.scale * p.uncalibrated_secs + self.context * p.context_secs
    }
}

impl WorkerProfile {
    /// The fit ([`TtftFit`]); `None` before `MIN_FIT_SAMPLES` (8) observations or while the
    /// predictions seen do not spread enough to fit a slope. The context term is fitted
    /// with the scale when the context terms seen spread and are not a multiple of the
    /// predictions (then a least-squares fit of both, kept when both are positive), else
    /// it is 0 and the scale is the straight-line fit's.
    pub fn fit(&self, max_scale: f64) -> Option<TtftFit> {
        let [n, sx, sz, sy, sxx, sxz, szz, sxy, szy, syy] = self.sums;
        if self.ttft_samples < MIN_FIT_SAMPLES || n <= 0.0 {
            return None;
        }
        let (mx, mz, my) = (sx / n, sz / n, sy / n);
        let (vxx, vxz, vzz) = (sxx / n - mx * mx, sxz / n - mx * mz, szz / n - mz * mz);
        let (vxy, vzy, vyy) = (sxy / n - mx * my, szy / n - mz * my, syy / n - my * my);
        if !(vxx > (0.05 * mx).powi(2) && vxx > 1e-12) {
            return None;
        }
        let clamp = |scale: f64| scale.clamp(1.0 / max_scale, max_scale);
        // Both terms, when z varies apart from x (their correlation below 0.99) and the two
        // leave at most CONTEXT_FIT_GAIN of the straight line's residual variance.
        let det = vxx * vzz - vxz * vxz;
        let line_residual = vyy - vxy * vxy / vxx;
        let both = (vzz > (0.05 * mz).powi(2) && vzz > 1e-12 && det > 0.0199 * vxx * vzz)
            .then(|| ((vxy * vzz - vzy * vxz) / det, (vzy * vxx - vxy * vxz) / det))
            .filter(|&(scale, context)| {
                let residual = vyy - scale * vxy - context * vzy;
                scale > 0.0 && context > 0.0 && residual <= CONTEXT_FIT_GAIN * line_residual
            });
        let (scale, context) = match both {
            Some((scale, context)) => (clamp(scale), context),
            None => (clamp(vxy / vxx), 0.0),
        };
        let overhead_secs = (my - scale * mx - context * mz).max(0.0);
        let fit = TtftFit { scale, context, overhead_secs };
        (scale.is_finite() && context.is_finite() && overhead_secs.is_finite()).then_some(fit)
    }
}

/// The `least_ttft` policy. See the module docs.
#[derive(Debug, Clone)]
pub struct LeastTtft {
    cfg: LeastTtftConfig,
    /// `prefill_cost`'s state and cost terms: the LRU block sets, sessions and rotation.
    cost: PrefillCost,
    profiles: HashMap<WorkerId, WorkerProfile, foldhash::fast::FixedState>,
    /// The `hit_ratio`s of the profiles with hit observations, as a multiset (bits of a
    /// non-negative f64, which order as the numbers do → count): its last key is
    /// [`LeastTtft::best_hit_ratio`], read by every decision without a pass over the fleet.
    hit_ratios: BTreeMap<u64, u32>,
    /// What the engines report cached, fleet-wide ([`LeastTtft::fleet_hit_share`]).
    fleet_hits: FleetHits,
}

/// Requests over which [`LeastTtft::fleet_hit_share`] averages (each report weighs
/// `1 / FLEET_HIT_WINDOW`, older ones decay).
pub const FLEET_HIT_WINDOW: f64 = 128.0;

/// Prompt tokens the engines reported cached and prompt tokens of those requests, each a
/// sum decayed by `1 − 1 / FLEET_HIT_WINDOW` a report, and the reports so far.
#[derive(Debug, Clone, Copy, Default)]
struct FleetHits {
    cached: f64,
    input: f64,
    reports: u64,
}

impl FleetHits {
    /// Folds in one report: `cached` of a request's `input` prompt tokens (a report past
    /// its prompt is clamped, so the share stays a share).
    fn record(&mut self, cached: u64, input: u32) {
        let keep = 1.0 - 1.0 / FLEET_HIT_WINDOW;
        let input = f64::from(input);
        self.cached = self.cached * keep + (cached as f64).min(input);
        self.input = self.input * keep + input;
        self.reports = self.reports.saturating_add(1);
    }

    /// `cached / input`, 0.0–1.0; `None` until [`FLEET_HIT_WINDOW`] reports.
    fn share(&self) -> Option<f64> {
        (self.reports as f64 >= FLEET_HIT_WINDOW && self.input > 0.0)
            .then(|| (self.cached / self.input).clamp(0.0, 1.0))
    }
}

/// One candidate's terms.
struct Candidate {
    id: WorkerId,
    cached: u64,
    hit: Match,
    score: f64,
    prediction: TtftPrediction,
}

impl LeastTtft {
    /// A policy with `cfg` and `prefill_cost`'s knobs `cost` (validated by the registry).
    pub fn new(cfg: LeastTtftConfig, cost: PrefillCostConfig) -> Self {
        LeastTtft {
            cfg,
            cost: PrefillCost::new(cost),
            profiles: HashMap::default(),
            hit_ratios: BTreeMap::new(),
            fleet_hits: FleetHits::default(),
        }
    }

    /// The share of prompt tokens the engines reported cached over about the last
    /// [`FLEET_HIT_WINDOW`] requests with a report, 0.0–1.0; `None` until that many
    /// reports (a cold fleet's first requests miss whatever their later hits).
    pub fn fleet_hit_share(&self) -> Option<f64> {
        self.fleet_hits.share()
    }

    /// The learned profile of `worker` (`None` before its first observation).
    pub fn profile(&self, worker: WorkerId) -> Option<WorkerProfile> {
        self.profiles.get(&worker).copied()
    }

    /// Takes `p`'s `hit_ratio` out of [`LeastTtft::hit_ratios`] (when it has hit samples).
    fn forget_hit_ratio(&mut self, p: &WorkerProfile) {
        if p.hit_samples == 0 {
            return;
        }
        let key = hit_ratio_key(p.hit_ratio);
        if let Some(n) = self.hit_ratios.get_mut(&key) {
            *n -= 1;
            if *n == 0 {
                self.hit_ratios.remove(&key);
            }
        }
    }

    /// The fleet's fit: geometric mean of the fitted workers' scales, mean of their context
    /// terms and overheads ([`TtftFit::PRIOR`] when none is fitted): used for a worker not
    /// fitted yet, so a new worker in a fleet of slow ones does not look fast.
    fn fleet_fit(&self) -> TtftFit {
        let (n, ln, ctx, over) = self
            .profiles
            .values()
            .filter_map(|p| p.fit(self.cfg.max_scale))
            .fold((0u32, 0.0, 0.0, 0.0), |(n, l, c, o), f| {
                (n + 1, l + f.scale.ln(), c + f.context, o + f.overhead_secs)
            });
        if n == 0 {
            return TtftFit::PRIOR;
        }
        let n = f64::from(n);
        TtftFit { scale: (ln / n).exp(), context: ctx / n, overhead_secs: over / n }
    }

    /// The best `hit_ratio` of the workers with hit observations (1 when none has any).
    fn best_hit_ratio(&self) -> f64 {
        self.hit_ratios.last_key_value().map_or(1.0, |(bits, _)| f64::from_bits(*bits))
    }

    /// The share of `miss_weight − 1` charged now: `min(1, mean waiting / scale)` over the
    /// routable workers, `scale` being `miss_queue_scale` or, when smaller, the workers'
    /// mean `max_concurrent` — a queue is full when it holds what a worker runs at once (a
    /// llama.cpp worker with 2 slots: 2) — and 1 when `miss_queue_scale` is 0.
    fn miss_share(&self, means: &FleetMeans) -> f64 {
        if self.cfg.miss_queue_scale == 0.0 {
            return 1.0;
        }
        let scale = means.max_concurrent.map_or(self.cfg.miss_queue_scale, |b| self.cfg.miss_queue_scale.min(b));
        (means.waiting / scale).min(1.0)
    }

    /// The session balance gate's load bound for `req` when the gate excludes a worker, or
    /// `None` when it does not: it is off (`session_balance_rel` 0), the request carries no
    /// session id, the router has already bound its session, the engines report under
    /// `session_balance_min_hit` of the prompt tokens cached, the bound exceeds the routable
    /// workers' mean `max_concurrent` (past the batch, extra requests queue, and the score
    /// prices the queue), or every routable worker is within the bound, or none is (then
    /// every worker is a candidate). A worker is within when its load with the request
    /// (`load + 1`) is at most `max(session_balance_rel × mean load, mean load +
    /// session_balance_abs)`, the mean over the routable workers.
    fn session_cap(
        &self,
        req: &RequestView<'_>,
        c: &[WorkerView],
        fleet: Option<&FleetDigest>,
        means: &FleetMeans,
    ) -> Option<f64> {
        let rel = self.cfg.session_balance_rel;
        let sid = req.session_id?;
        if rel == 0.0 || self.cost.sessions.get(sid).is_some() {
            return None;
        }
        if self.fleet_hit_share().is_some_and(|share| share < self.cfg.session_balance_min_hit) {
            return None;
        }
        let mean = means.load?;
        let cap = (rel * mean).max(mean + self.cfg.session_balance_abs);
        if cap > means.max_concurrent? {
            return None;
        }
        let (inside, outside) = match fleet {
            Some(f) => f
                .loads()
                .fold((0u32, 0u32), |(i, o), (load, n)| if load_within(load, cap) { (i + n, o) } else { (i, o + n) }),
            None => c
                .iter()
                .filter(|w| w.is_routable())
                .fold((0u32, 0u32), |(i, o), w| if within(w, cap) { (i + 1, o) } else { (i, o + 1) }),
        };
        (inside > 0 && outside > 0).then_some(cap)
    }

    /// The decode charge of `w` with `load` requests, in prefill tokens: `prefill_cost`'s
    /// charge for its waiting requests (no first token yet: they are ahead in the prefill
    /// queue), plus the running requests' increment × `occupancy_share(w)`.
    fn decode_charge(&self, w: &WorkerView, load: f64) -> f64 {
        let whole = self.cost.decode_charge(load);
        if self.cfg.decode_occupancy_full == 0.0 {
            return whole;
        }
        let waiting = self.cost.decode_charge(waiting(w, load));
        waiting
            + occupancy_share(w, load, self.cfg.decode_occupancy_free, self.cfg.decode_occupancy_full)
                * (whole - waiting)
    }

    /// One worker's charge and TTFT prediction for the request `a` describes.
    fn terms(&self, w: &WorkerView, a: &Ask<'_>) -> Candidate {
        let hit = self.cost.sets.hit_of(w, &a.key.blocks);
        let charge = self.charge(w, a, hit, &self.queue(w));
        // The fleet's fit (a pass over the profiles) only for a worker without its own.
        let fit = self.profiles.get(&w.id).and_then(|p| p.fit(self.cfg.max_scale)).unwrap_or_else(|| self.fleet_fit());
        let rate = self.cfg.prefill_tokens_per_sec;
        let mut prediction = TtftPrediction {
            secs: 0.0,
            uncalibrated_secs: charge.uncharged / rate,
            context_secs: charge.context / rate,
        };
        prediction.secs = fit.secs(&prediction);
        Candidate { id: w.id, cached: charge.cached, hit: charge.hit, score: charge.score, prediction }
    }

    /// What `w` has queued ([`Queue`]).
    fn queue(&self, w: &WorkerView) -> Queue {
        let load = f64::from(w.load());
        let decode = self.decode_charge(w, load);
        let factor = 1.0 + self.cost.cfg.batch_factor * load;
        let bound = (w.pending_prefill_tokens as f64 + decode) * factor;
        Queue { load, decode, factor, bound }
    }

    /// The score part of [`LeastTtft::terms`] (what ranks the workers; the prediction is
    /// computed for the chosen worker only), with the leading blocks of the request `w`'s
    /// estimate holds, `hit`, already known (from the fleet-wide
    /// [`crate::lru_blocks::WorkerBlockSets::hits`]).
    fn charge(&self, w: &WorkerView, a: &Ask<'_>, hit: u64, queue: &Queue) -> Charge {
        let Ask { key, input, stall, miss_share, best_hit, .. } = *a;
        let (cached, hit) = PrefillCost::cached_of(w, key, input, hit);
        // What the worker's engine really serves of what it holds (its profile is read only
        // when it holds something: nothing cached attends nothing).
        let hit_factor = match (self.cfg.calibrate_hits && cached > 0 && best_hit > 0.0)
            .then(|| self.profiles.get(&w.id).filter(|p| p.hit_samples > 0))
            .flatten()
        {
            Some(p) => (p.hit_ratio / best_hit / HIT_SHORTFALL).min(1.0),
            None => 1.0,
        };
        let attended = cached as f64 * hit_factor;
        let own = input as f64 - attended;
        // The own prefill's attention pairs: what it attends to, per new token, times them.
        let context = own * (attended + own / 2.0);
        // Charged at `context_weight` (0 by default: the prediction's fit learns its own).
        let own = own + self.cfg.context_weight * context;
        let Queue { load, decode, factor, .. } = *queue;
        let pending = w.pending_prefill_tokens as f64;
        let miss_weight = self.miss_weight(miss_share);
        let shared = self.cfg.waiting_delay_weight * waiting(w, load).min(self.cfg.waiting_delay_cap);
        let per_token = miss_weight + self.cost.stall_charge(stall, load) + shared;
        let charged = (pending + own * per_token + decode) * factor;
        Charge {
            id: w.id,
            cached,
            hit,
            charged,
            score: charged / self.cfg.prefill_tokens_per_sec,
            uncharged: pending + own + decode,
            context,
        }
    }
}

/// What a worker has queued before a request, the terms of its score the request does not
/// change ([`LeastTtft::queue`]).
#[derive(Clone, Copy)]
struct Queue {
    /// [`WorkerView::load`].
    load: f64,
    /// [`LeastTtft::decode_charge`] at `load`, prefill tokens.
    decode: f64,
    /// `1 + batch_factor × load`.
    factor: f64,
    /// `(pending + decode) × factor`: a lower bound of the charged tokens
    /// ([`Charge::charged`]).
    bound: f64,
}

impl Queue {
    /// Whether the worker would lose to a worker that charged `best` tokens (and not tie
    /// with it) whatever the request, judged from [`Queue::bound`]: its queued prefill and
    /// decode charge alone. The request's own prefill, the term left out, is non-negative,
    /// as every term of [`LeastTtft::charge`] is (the knobs are validated so), and the
    /// charge is computed with the same floating-point operations on operands at least as
    /// large, which round monotonically, so the bound never exceeds it. Scores are the
    /// charges over one positive constant: a bound past the best by more than twice the
    /// tie tolerance ([`tied`]) is a score the full scan would have passed over, so
    /// skipping the worker changes no decision.
    fn loses_to(&self, best: f64) -> bool {
        beyond(self.bound, best)
    }
}

/// Whether a worker whose charge is at least `bound` tokens loses to one charged `best`
/// and cannot tie with it: `bound` past `best` by more than twice the tie tolerance
/// ([`tied`]; scores are charges over one positive constant).
fn beyond(bound: f64, best: f64) -> bool {
    bound > best && bound - best > 2e-9 * bound
}

/// How [`LeastTtft::best_of`] reads the fleet ([`crate::policy::prefill_cost::Scan`], with
/// what the fast scan needs).
enum Pass<'a> {
    /// The request's leading blocks on every worker from the block index
    /// ([`crate::lru_blocks::WorkerBlockSets::hits`]), and workers that cannot win left
    /// unscored: those whose [`LeastTtft::floor`] is [`beyond`] the
    /// [`LeastTtft::ceiling`], and those whose queue alone is beyond the best so far; idle
    /// workers holding nothing of the prompt ([`is_idle_miss`]) are charged once.
    Fast(&'a mut Hits, &'a mut Survey),
    /// As [`Pass::Fast`], the fleet read from the caller's digest instead of a survey of
    /// the views: the workers whose floor is not [`beyond`] the ceiling are found from the
    /// digest's buckets, each read in increasing floor and left at the first floor past
    /// it, and scored in candidate order ([`LeastTtft::kept_contenders`]). The `f64` is
    /// [`Survey::own`].
    Kept(&'a mut Hits, &'a FleetDigest, f64),
    /// Every worker scored, each asking its own block set: the reference (a property test
    /// compares them).
    #[cfg_attr(not(test), allow(dead_code))]
    Full,
}

/// What [`LeastTtft::survey`]'s pass over the fleet finds before a decision.
struct Survey {
    /// The means over the routable workers.
    means: FleetMeans,
    /// The most prompt tokens any worker leaves uncached: the prompt's tokens beyond the
    /// most any worker counts cached ([`LeastTtft::floor`]'s `own`).
    own: f64,
    /// The routable workers, in candidate order (in the thread's reused buffer, [`SLOTS`]).
    slots: Vec<Slot>,
    /// Indices into `slots` of the workers holding the most leading blocks.
    deep: Vec<u32>,
}

/// A routable worker as [`LeastTtft::floor`] reads it: the passes after the survey read 32
/// bytes a worker (32 KiB for 1,024 workers), not its 168-byte view.
#[derive(Clone, Copy)]
struct Slot {
    /// `pending_prefill_tokens`.
    pending: u64,
    /// `D(waiting)`: [`PrefillCost::decode_charge`] of its waiting requests.
    decode: f64,
    /// Its [`LeastTtft::floor`] for the decision ([`LeastTtft::ceiling`] writes it;
    /// infinite outside the session gate's cap).
    floor: f64,
    /// [`WorkerView::load`].
    load: u32,
    /// Its position in the candidates.
    pos: u32,
}

thread_local! {
    /// Each thread's buffer for [`Survey::slots`], reused from decision to decision: a fresh
    /// one over 10,000 workers (320 KiB) was faulted in from the kernel on every decision
    /// of the replay. A scratch buffer, not state: it is cleared before each use, holds
    /// nothing a decision reads from an earlier one, and grows to the largest fleet the
    /// thread decided over.
    static SLOTS: std::cell::Cell<Vec<Slot>> = const { std::cell::Cell::new(Vec::new()) };
}

/// A worker's score for one request ([`LeastTtft::charge`]).
#[derive(Clone, Copy)]
struct Charge {
    id: WorkerId,
    cached: u64,
    hit: Match,
    /// Prefill tokens charged: the queue's, the request's own at its per-token charge, and
    /// the decode charge, times `1 + batch_factor × load`.
    charged: f64,
    /// `charged` over `prefill_tokens_per_sec`: what the decision minimises.
    score: f64,
    /// The same prefill tokens without the charges (what the prediction is built on).
    uncharged: f64,
    /// The request's own attention pairs, `own × (attended + own / 2)`, tokens² (the
    /// prediction's context term).
    context: f64,
}

/// What a decision read through the fleet's digest ([`Pass::Kept`]) scores with: the
/// candidates, what it asks, the session gate's cap, a digest fitting the candidates and
/// [`Survey::own`].
#[derive(Clone, Copy)]
struct KeptScan<'a, 'k> {
    c: &'a [WorkerView],
    ask: &'a Ask<'k>,
    cap: Option<f64>,
    fleet: &'a FleetDigest,
    own: f64,
}

/// What one decision knows of the request and the fleet before it scores a worker.
#[derive(Clone, Copy)]
struct Ask<'a> {
    /// The request's routing key.
    key: &'a RequestKey,
    /// Its prompt tokens.
    input: u64,
    /// The stall charge's weight over the fleet's mean waiting queue (`PrefillCost::stall_weight`).
    stall: f64,
    /// The share of `miss_weight − 1` charged now ([`LeastTtft::miss_share`]).
    miss_share: f64,
    /// The best `hit_ratio` of the workers with hit observations.
    best_hit: f64,
}

/// The share of the running requests' decode charge `w` pays at `load` requests: 0 up to a
/// batch occupancy (`load / max_concurrent`) of `free`, 1 from `full`, linear between.
fn occupancy_share(w: &WorkerView, load: f64, free: f64, full: f64) -> f64 {
    let occupancy = load / f64::from(w.capacity.max_concurrent.max(1));
    ((occupancy - free) / (full - free)).clamp(0.0, 1.0)
}

/// The requests on `w` still waiting for their first token (the router's ledger), at most
/// its `load`.
fn waiting(w: &WorkerView, load: f64) -> f64 {
    f64::from(w.waiting).min(load)
}

/// Whether `w`'s load with one more request stays within the session balance gate's `cap`.
fn within(w: &WorkerView, cap: f64) -> bool {
    load_within(w.load(), cap)
}

/// Whether a worker with `load` requests stays within the session balance gate's `cap`
/// with one more.
fn load_within(load: u32, cap: f64) -> bool {
    f64::from(load) + 1.0 <= cap
}

/// The key of `hit_ratio` (in [0, 1]) in [`LeastTtft::hit_ratios`]: its bits, `+0.0`'s for
/// `-0.0`, so keys order as the ratios do.
fn hit_ratio_key(hit_ratio: f64) -> u64 {
    (hit_ratio + 0.0).max(0.0).to_bits()
}

/// Of the slots `ks`, the one with the least finite [`Slot::floor`] (the first of equals),
/// `None` when there is none.
#[inline]
fn least_floor(ks: impl Iterator<Item = usize>, slots: &[Slot]) -> Option<usize> {
    let mut low: Option<(f64, usize)> = None;
    for k in ks {
        let f = slots[k].floor;
        if f < low.map_or(f64::INFINITY, |l| l.0) {
            low = Some((f, k));
        }
    }
    low.map(|l| l.1)
}

/// Whether `w` is idle (no request, no queued prefill) and counts nothing of the prompt
/// cached (`hit` 0 leading blocks, no engine-reported count): [`LeastTtft::charge`] of
/// such a worker reads nothing else of its view — its load is 0, so its decode charge,
/// stall, waiting share and batch factor are those of load 0, and with nothing cached its
/// profile is not read — so every such worker is charged the same.
fn is_idle_miss(w: &WorkerView, hit: u64) -> bool {
    hit == 0 && w.cached_tokens.is_none() && w.load() == 0 && w.pending_prefill_tokens == 0
}

/// `a` and `b` equal within a relative 1e-9 (scores of identical workers).
fn tied(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1e-12)
}

impl LeastTtft {
    /// The per-token weight of the request's own uncached prefill before the stall and
    /// waiting charges: `miss_weight`, or when it is above 1, `1 + (miss_weight − 1) ×
    /// miss_share` ([`LeastTtft::miss_share`]).
    fn miss_weight(&self, miss_share: f64) -> f64 {
        let mw = self.cost.cfg.miss_weight;
        if mw > 1.0 { 1.0 + (mw - 1.0) * miss_share } else { mw }
    }

    /// A lower bound of the charged tokens ([`Charge::charged`]) of the worker `s` packs,
    /// for a request of which no worker has more than `own` tokens uncached, with the
    /// decision's `miss_weight` ([`LeastTtft::miss_weight`]) and `stall`
    /// ([`PrefillCost::stall_weight_of`]): `(pending + own × (miss_weight + stall(w)) +
    /// D(waiting)) × (1 + batch_factor × load)`. Every operand is at most its counterpart in
    /// [`LeastTtft::charge`] — the request's own prefill there is at least `own` (the
    /// context charge is non-negative), its per-token charge adds the waiting requests'
    /// share (non-negative) to the same sum, and the waiting requests' decode charge is at
    /// most the whole decode charge (`D` grows with its argument and the running requests'
    /// share is in [0, 1]) — and the same floating-point operations on operands at most as
    /// large round to at most as much. Cheaper than the charge: no block match, no profile,
    /// no division, and read from a packed [`Slot`] rather than the worker's view.
    #[inline]
    fn floor(&self, s: &Slot, own: f64, miss_weight: f64, stall: f64) -> f64 {
        let load = f64::from(s.load);
        let per_token = miss_weight + self.cost.stall_charge(stall, load);
        let factor = 1.0 + self.cost.cfg.batch_factor * load;
        // Through i64, one instruction (a u64 takes several); never above `pending as f64`.
        let pending = s.pending.min(i64::MAX as u64) as i64 as f64;
        (pending + own * per_token + s.decode) * factor
    }

    /// [`LeastTtft::floor`] of a worker with `load` requests, `waiting` of them waiting
    /// (counted up to `load`) and `pending` prefill tokens queued, its slot packed as the
    /// survey packs it (`D(0)` is 0).
    fn floor_at(&self, load: u32, waiting: u32, pending: u64, own: f64, miss_weight: f64, stall: f64) -> f64 {
        let decode = if waiting == 0 { 0.0 } else { self.cost.decode_charge(f64::from(waiting)) };
        self.floor(&Slot { pending, decode, floor: 0.0, load, pos: 0 }, own, miss_weight, stall)
    }

    /// The fleet's means and, in the same pass, what the fast scan needs ([`Survey`]), its
    /// slots written into `slots` (emptied first). `hits` is the request's
    /// [`crate::lru_blocks::WorkerBlockSets::hits`].
    #[inline(never)]
    fn survey(&self, c: &[WorkerView], key: &RequestKey, input: u64, hits: &mut Hits, mut slots: Vec<Slot>) -> Survey {
        let deepest = hits.deepest();
        let mut sums = MeanSums::default();
        let mut precise = 0u64;
        slots.clear();
        slots.reserve(c.len());
        let mut deep = Vec::new();
        for (i, w) in c.iter().enumerate() {
            if !w.is_routable() {
                continue;
            }
            sums.add(w);
            if let Some(t) = w.cached_tokens {
                precise = precise.max(t);
            }
            if deepest > 0 && hits.get(w.id) == deepest {
                deep.push(slots.len() as u32);
            }
            let load = w.load();
            // D(0) is 0: no division for a worker nobody waits on.
            let decode = if w.waiting == 0 { 0.0 } else { self.cost.decode_charge(waiting(w, f64::from(load))) };
            let pos = i.min(u32::MAX as usize) as u32;
            slots.push(Slot { pending: w.pending_prefill_tokens, decode, floor: 0.0, load, pos });
        }
        hits.rewind();
        // The most tokens any worker counts cached (PrefillCost::cached_of): its leading
        // blocks, or what its engine reports.
        let cached = deepest.saturating_mul(key.block_tokens).max(precise).min(input);
        Survey { means: sums.means(), own: (input - cached) as f64, slots, deep }
    }

    /// Writes every slot's [`LeastTtft::floor`] (infinite outside `cap`, so never the least)
    /// and returns an upper bound of the least charge over the `survey`'s workers within
    /// `cap`: the charge of the one with the least floor, or of the one with the least floor
    /// among those holding the most leading blocks, whichever is less; `None` when no worker
    /// is within `cap`.
    fn ceiling(
        &self,
        c: &[WorkerView],
        ask: &Ask<'_>,
        cap: Option<f64>,
        survey: &mut Survey,
        hits: &mut Hits,
    ) -> Option<f64> {
        let (own, miss_weight) = (survey.own, self.miss_weight(ask.miss_share));
        for s in survey.slots.iter_mut() {
            s.floor = match cap {
                Some(cap) if !load_within(s.load, cap) => f64::INFINITY,
                _ => self.floor(s, own, miss_weight, ask.stall),
            };
        }
        let slots = &survey.slots;
        let low = least_floor(0..slots.len(), slots);
        let deep = least_floor(survey.deep.iter().map(|&k| k as usize), slots);
        let ceiling = low
            .into_iter()
            .chain(deep)
            .map(|k| {
                let w = &c[slots[k].pos as usize];
                self.charge(w, ask, hits.get(w.id), &self.queue(w)).charged
            })
            .reduce(f64::min);
        hits.rewind();
        ceiling
    }

    /// [`Policy::pick`] with the fleet read as `scan` reads it: surveyed from the views
    /// ([`Pass::Fast`]) or from the caller's digest ([`Pass::Kept`], which also finds ids).
    fn pick_with(
        &self,
        req: &RequestView<'_>,
        key: &RequestKey,
        c: &[WorkerView],
        scan: Pass<'_>,
    ) -> Result<Decision, RouteError> {
        let (means, fleet) = match &scan {
            Pass::Fast(_, survey) => (survey.means, None),
            Pass::Kept(_, fleet, _) => (fleet.means(), Some(*fleet)),
            Pass::Full => (FleetMeans::of(c), None),
        };
        let input = u64::from(req.input_tokens);
        let stall = self.cost.stall_weight_of(means.waiting);
        let miss_share = self.miss_share(&means);
        let best_hit = self.best_hit_ratio();
        let ask = Ask { key, input, stall, miss_share, best_hit };
        let cc = &self.cost.cfg;
        if cc.session_affinity
            && let Some(sid) = req.session_id
            && let Some(bound) = self.cost.sessions.get(sid)
            && let Some(a) = routable_view_of(c, fleet, bound)
        {
            let mean = means.load.unwrap_or(0.0).max(1.0);
            let t = self.terms(a, &ask);
            if t.cached * 2 > input && f64::from(a.load()) <= mean * cc.overload_factor {
                let mut d =
                    Decision::new(a.id, Branch::Sticky).with_match(t.hit.0, t.hit.1, t.hit.2).with_score(t.score);
                d.predicted_ttft = Some(t.prediction);
                return Ok(d);
            }
        }
        let cap = self.session_cap(req, c, fleet, &means);
        let ties = self.best_of(c, &ask, cap, scan);
        let branch = match (cap.is_some(), ties.len() == 1) {
            (true, _) => Branch::NewBinding,
            (false, true) => Branch::Score,
            (false, false) => Branch::TieBreak,
        };
        let w = ties.pick(&self.cost.rotation).ok_or(RouteError::NoWorker)?;
        // The chosen worker's terms with its prediction (the same inputs, the same score).
        let v = view_of(c, fleet, w).ok_or(RouteError::NoWorker)?;
        let t = self.terms(v, &ask);
        let mut d = Decision::new(t.id, branch).with_match(t.hit.0, t.hit.1, t.hit.2).with_score(t.score);
        d.predicted_ttft = Some(t.prediction);
        Ok(d)
    }

    /// The ids of the routable workers (within the session gate's `cap`) with the least
    /// score, the most cached tokens among equal scores, in candidate order; empty when
    /// there is none. On an idle fleet every worker ties, so ties keep 4-byte ids; the
    /// chosen worker's terms are computed again (the same inputs, the same terms).
    fn best_of(&self, c: &[WorkerView], ask: &Ask<'_>, cap: Option<f64>, scan: Pass<'_>) -> Ties {
        let scan = match scan {
            Pass::Kept(hits, fleet, own) if fleet.mostly_idle() => {
                match self.idle_ties(KeptScan { c, ask, cap, fleet, own }, hits) {
                    Some(t) => return t,
                    None => Pass::Kept(hits, fleet, own),
                }
            }
            other => other,
        };
        let mut best: Option<Charge> = None;
        let mut ties: SmallVec<[WorkerId; 8]> = SmallVec::new();
        // The charge of an idle worker holding nothing of the prompt, computed once (fast
        // scan): such workers' charges are equal whatever else their views hold.
        let mut idle: Option<Charge> = None;
        let mut consider = |w: &WorkerView, hit: u64, fast: bool| {
            let t = if fast && is_idle_miss(w, hit) {
                Charge { id: w.id, ..*idle.get_or_insert_with(|| self.charge(w, ask, hit, &self.queue(w))) }
            } else {
                let queue = self.queue(w);
                if fast && best.as_ref().is_some_and(|b| queue.loses_to(b.charged)) {
                    return;
                }
                self.charge(w, ask, hit, &queue)
            };
            keep_tie(&mut ties, offer(&mut best, t), t.id);
        };
        match scan {
            Pass::Fast(hits, survey) => {
                let ceiling = self.ceiling(c, ask, cap, survey, hits);
                for s in &survey.slots {
                    // Outside the gate, or sure to lose.
                    if cap.is_some_and(|cap| !load_within(s.load, cap)) || ceiling.is_some_and(|t| beyond(s.floor, t)) {
                        continue;
                    }
                    let w = &c[s.pos as usize];
                    consider(w, hits.get(w.id), true);
                }
            }
            Pass::Kept(hits, fleet, own) => match self.kept_contenders(KeptScan { c, ask, cap, fleet, own }, hits) {
                Some(contenders) => {
                    for pos in contenders {
                        let w = &c[pos as usize];
                        consider(w, hits.get(w.id), true);
                    }
                }
                // Most of the fleet can win: every routable worker within the gate, in
                // order (the full scan, its hopeless workers unscored).
                None => {
                    for w in c.iter().filter(|w| w.is_routable() && cap.is_none_or(|cap| within(w, cap))) {
                        consider(w, hits.get(w.id), true);
                    }
                }
            },
            Pass::Full => {
                for w in c.iter().filter(|w| w.is_routable() && cap.is_none_or(|cap| within(w, cap))) {
                    consider(w, self.cost.sets.hit(w.id, &ask.key.blocks) as u64, false);
                }
            }
        }
        Ties::Listed(ties)
    }

    /// [`LeastTtft::best_of`] on a mostly idle fleet read from its digest `fleet`: the idle
    /// workers holding nothing of the prompt ([`is_idle_miss`]: the digest's idle bits, the
    /// holders' cleared) are all charged alike, so the scan's outcome over them is decided
    /// by the first of each run of them between two other contenders — the whole run ties,
    /// leads or loses with it. The other contenders are the idle holders and the workers of
    /// the digest's buckets whose floor is not [`beyond`] that charge (the scan would pass
    /// over every other, as [`LeastTtft::kept_contenders`] argues), scored in candidate
    /// order between the runs. The tie is kept as runs and positions, and the rotation's
    /// pick found among them: O(workers / 64 + holders + contenders) however many idle
    /// workers tie. `None` (read the views) when no idle worker holds nothing, load 0 is
    /// outside `cap`, or more than [`FleetDigest::contenders_cap`] others contend.
    fn idle_ties(&self, k: KeptScan<'_, '_>, hits: &mut Hits) -> Option<Ties> {
        let KeptScan { c, ask, cap, fleet, own } = k;
        if cap.is_some_and(|cap| !load_within(0, cap)) {
            return None;
        }
        let idle = fleet.idle_at();
        let mut class = idle.to_vec();
        let mut contenders: SmallVec<[u32; 32]> = SmallVec::new();
        for (id, _) in hits.entries() {
            if let Some(p) = fleet.position(id).filter(|&p| bits_has(idle, p)) {
                bits_set(&mut class, p, false);
                contenders.push(p as u32);
            }
        }
        let first = &c[bits_nth(&class, 0)?];
        let alike = self.charge(first, ask, 0, &self.queue(first));
        let miss_weight = self.miss_weight(ask.miss_share);
        // The idle workers (load 0, nothing queued) are the runs and the holders above.
        let floor_of =
            |load: u32, waiting: u32, pending: u64| self.floor_at(load, waiting, pending, own, miss_weight, ask.stall);
        walk_buckets(fleet, cap, alike.charged, true, floor_of, &mut contenders)?;
        contenders.sort_unstable();
        hits.rewind();
        // The scan in candidate order: ties as `(from, to, run)` — a run of class positions
        // in `from..to`, or the contender at `from`.
        let mut best: Option<Charge> = None;
        let mut ties: SmallVec<[(usize, usize, bool); 8]> = SmallVec::new();
        let mut next = 0;
        for at in contenders.iter().map(|&p| p as usize).chain(std::iter::once(c.len())) {
            if let Some(head) = bits_next(&class, next).filter(|&h| h < at) {
                keep_tie(&mut ties, offer(&mut best, Charge { id: c[head].id, ..alike }), (next, at, true));
            }
            if let Some(w) = c.get(at) {
                let t = self.charge(w, ask, hits.get(w.id), &self.queue(w));
                keep_tie(&mut ties, offer(&mut best, t), (at, at + 1, false));
            }
            next = at + 1;
        }
        let size = |&(from, to, run): &(usize, usize, bool)| if run { bits_count_in(&class, from, to) } else { 1 };
        let n: usize = ties.iter().map(size).sum();
        // The rotation moves only on a real tie, as `rotate` over a list does.
        let mut k = if n > 1 { (self.cost.rotation.next() % n as u64) as usize } else { 0 };
        for t in &ties {
            let len = size(t);
            if k < len {
                let pos = if t.2 { bits_nth_from(&class, t.0, k)? } else { t.0 };
                return Some(Ties::Picked(c[pos].id, n));
            }
            k -= len;
        }
        Some(Ties::Listed(SmallVec::new()))
    }
}

/// What offering a worker's charge to the least so far does, by the scan's rule: equal
/// scores (within [`tied`]) with as many cached tokens tie; a greater score, or an equal
/// one with fewer cached, loses; anything else leads (and becomes the least so far).
enum Offer {
    Ties,
    Loses,
    Leads,
}

/// Offers `t` to `best` ([`Offer`]).
fn offer(best: &mut Option<Charge>, t: Charge) -> Offer {
    match best {
        Some(b) if tied(t.score, b.score) && t.cached == b.cached => Offer::Ties,
        Some(b) if t.score > b.score || (tied(t.score, b.score) && t.cached < b.cached) => Offer::Loses,
        _ => {
            *best = Some(t);
            Offer::Leads
        }
    }
}

/// Keeps `item` among `ties` as the offer's outcome says: added to a tie, in place of
/// everything before when it leads, left out when it loses.
fn keep_tie<T>(ties: &mut SmallVec<[T; 8]>, o: Offer, item: T) {
    match o {
        Offer::Ties => ties.push(item),
        Offer::Loses => {}
        Offer::Leads => {
            ties.clear();
            ties.push(item);
        }
    }
}

/// The workers tied on the least charge ([`LeastTtft::best_of`]): listed in candidate
/// order, or — a mostly idle fleet's tie, read as runs of the digest's idle bits — already
/// picked by the tie rotation from that many.
#[derive(Debug)]
enum Ties {
    Listed(SmallVec<[WorkerId; 8]>),
    Picked(WorkerId, usize),
}

impl Ties {
    /// How many tie.
    fn len(&self) -> usize {
        match self {
            Ties::Listed(v) => v.len(),
            Ties::Picked(_, n) => *n,
        }
    }

    /// The rotation's pick ([`rotate`]; already made for [`Ties::Picked`]).
    fn pick(&self, rotation: &crate::policy::util::Rotation) -> Option<WorkerId> {
        match self {
            Ties::Listed(v) => rotate(v, rotation),
            Ties::Picked(id, _) => Some(*id),
        }
    }
}

impl LeastTtft {
    /// The positions, in increasing order, of the workers within `cap` whose
    /// [`LeastTtft::floor`] is not [`beyond`] the ceiling — the charge of the worker with
    /// the least floor, or of the one with the least floor among those holding the most
    /// leading blocks, whichever is less, each the first in candidate order among equal
    /// floors (what [`LeastTtft::ceiling`] finds from a survey) — read from `fleet`: a
    /// bucket's floors grow with its queued prefill (the floor's operations are monotone in
    /// it), so each bucket is read from its head and left at its first floor past
    /// `ceiling × (1 + 10⁻⁶)`, which is beyond the ceiling and bounds every floor after it.
    /// The same set the survey's pass keeps, so the same decision. `own` is
    /// [`Survey::own`]; `hits` is rewound before it returns. `None` when there are more
    /// than [`FleetDigest::contenders_cap`]: then the views are read in order instead.
    fn kept_contenders(&self, k: KeptScan<'_, '_>, hits: &mut Hits) -> Option<SmallVec<[u32; 32]>> {
        let KeptScan { c, ask, cap, fleet, own } = k;
        let miss_weight = self.miss_weight(ask.miss_share);
        let floor_of =
            |load: u32, waiting: u32, pending: u64| self.floor_at(load, waiting, pending, own, miss_weight, ask.stall);
        let in_cap = |load: u32| cap.is_none_or(|cap| load_within(load, cap));
        // The least of `(floor, position)`: the first in candidate order among equal floors.
        let lower = |low: &mut Option<(f64, u32)>, f: f64, pos: u32| {
            if low.is_none_or(|(lf, lp)| f < lf || (f == lf && pos < lp)) {
                *low = Some((f, pos));
            }
        };
        let mut low = None;
        for (load, waiting, set) in fleet.buckets().filter(|b| in_cap(b.0)) {
            let mut head = None;
            for &(pending, pos) in set {
                let f = floor_of(load, waiting, pending);
                // Equal floors at larger queued prefill (rounding) may come earlier in order.
                if head.is_some_and(|h| f != h) {
                    break;
                }
                head = Some(f);
                lower(&mut low, f, pos);
            }
        }
        let mut deep = None;
        let deepest = hits.deepest();
        if deepest > 0 {
            for (id, _) in hits.entries().filter(|&(_, n)| u64::from(n) == deepest) {
                let Some(pos) = fleet.position(id).filter(|&p| fleet.routable(p)) else { continue };
                let w = &c[pos];
                if in_cap(w.load()) {
                    let load = w.load();
                    lower(&mut deep, floor_of(load, w.waiting.min(load), w.pending_prefill_tokens), pos as u32);
                }
            }
        }
        let ceiling = low
            .into_iter()
            .chain(deep)
            .map(|(_, pos)| {
                let w = &c[pos as usize];
                self.charge(w, ask, hits.get(w.id), &self.queue(w)).charged
            })
            .reduce(f64::min);
        hits.rewind();
        let mut out = SmallVec::new();
        let Some(ceiling) = ceiling else { return Some(out) };
        walk_buckets(fleet, cap, ceiling, false, floor_of, &mut out)?;
        out.sort_unstable();
        Some(out)
    }
}

/// Pushes onto `out` the positions of the digest's workers within `cap` whose floor
/// (`floor_of(load, waiting, pending)`, [`LeastTtft::floor`]) is not [`beyond`] `ceiling`:
/// a bucket's floors grow with its queued prefill, so each is read from its head and left
/// at its first floor past `ceiling × (1 + 10⁻⁶)`, beyond the ceiling and a bound of every
/// floor after it. With `skip_idle` the idle workers (load 0, nothing queued) are passed
/// over. `None` when more than [`FleetDigest::contenders_cap`] would be pushed.
fn walk_buckets(
    fleet: &FleetDigest,
    cap: Option<f64>,
    ceiling: f64,
    skip_idle: bool,
    floor_of: impl Fn(u32, u32, u64) -> f64,
    out: &mut SmallVec<[u32; 32]>,
) -> Option<()> {
    let past = ceiling * (1.0 + 1e-6);
    let most = fleet.contenders_cap();
    for (load, waiting, set) in fleet.buckets().filter(|b| cap.is_none_or(|cap| load_within(b.0, cap))) {
        let from = if skip_idle && load == 0 { (1, 0) } else { (0, 0) };
        for &(pending, pos) in set.range(from..) {
            let f = floor_of(load, waiting, pending);
            if f > past {
                break;
            }
            if !beyond(f, ceiling) {
                if out.len() == most {
                    return None;
                }
                out.push(pos);
            }
        }
    }
    Some(())
}

impl Policy for LeastTtft {
    fn name(&self) -> &'static str {
        "least_ttft"
    }

    fn key(&self, req: &RequestView<'_>) -> RequestKey {
        self.cost.key(req)
    }

    fn pick(
        &self,
        req: &RequestView<'_>,
        key: &RequestKey,
        c: &[WorkerView],
        ctx: &mut PickCtx<'_>,
    ) -> Result<Decision, RouteError> {
        let mut hits = self.cost.sets.hits(&key.blocks);
        if let Some(fleet) = ctx.fleet.filter(|f| f.usable_for(c)) {
            // The fleet's means and queues kept by the caller: no pass over the views.
            let input = u64::from(req.input_tokens);
            let own = (input - hits.deepest().saturating_mul(key.block_tokens).min(input)) as f64;
            return self.pick_with(req, key, c, Pass::Kept(&mut hits, fleet, own));
        }
        let mut survey = self.survey(c, key, u64::from(req.input_tokens), &mut hits, SLOTS.take());
        let d = self.pick_with(req, key, c, Pass::Fast(&mut hits, &mut survey));
        SLOTS.set(survey.slots);
        d
    }

    fn on_routed(&mut self, req: &RequestView<'_>, key: &RequestKey, worker: WorkerId, now: Nanos) {
        self.cost.on_routed(req, key, worker, now);
    }

    fn fleet_digest(&self) -> Option<FleetDigest> {
        Some(FleetDigest::default())
    }

    fn on_worker_removed(&mut self, worker: WorkerId) {
        self.cost.on_worker_removed(worker);
        if let Some(p) = self.profiles.remove(&worker) {
            self.forget_hit_ratio(&p);
        }
    }

    fn observe(&mut self, worker: WorkerId, obs: &Observation) {
        if let Some(cached) = obs.cached_tokens {
            self.fleet_hits.record(cached, obs.input_tokens);
        }
        let rate = self.cfg.calibration_rate;
        if rate == 0.0 {
            return;
        }
        let calibrate_hits = self.cfg.calibrate_hits;
        if let Some(p) = self.profiles.get(&worker).copied() {
            self.forget_hit_ratio(&p);
        }
        let p = self.profiles.entry(worker).or_default();
        if let (Some(pred), Some(t)) = (obs.predicted, obs.ttft_secs)
            && pred.uncalibrated_secs.is_finite()
            && pred.uncalibrated_secs >= 0.0
            && t.is_finite()
            && t > 0.0
        {
            let (x, y) = (pred.uncalibrated_secs, t);
            let z = if pred.context_secs.is_finite() { pred.context_secs.max(0.0) } else { 0.0 };
            let keep = 1.0 - rate;
            for (sum, v) in p.sums.iter_mut().zip([1.0, x, z, y, x * x, x * z, z * z, x * y, z * y, y * y]) {
                *sum = *sum * keep + v;
            }
            p.ttft_samples += 1;
        }
        if calibrate_hits
            && obs.predicted_cached_tokens > 0
            && let Some(reported) = obs.cached_tokens
        {
            let target = (reported as f64 / obs.predicted_cached_tokens as f64).min(1.0);
            p.hit_samples += 1;
            let a = rate.max(1.0 / p.hit_samples as f64);
            p.hit_ratio += a * (target - p.hit_ratio);
        }
        if p.hit_samples > 0 {
            *self.hit_ratios.entry(hit_ratio_key(p.hit_ratio)).or_default() += 1;
        }
    }

    fn calibration(&self) -> serde_json::Value {
        let mut workers: Vec<(u32, serde_json::Value)> = self
            .profiles
            .iter()
            .map(|(id, p)| {
                let fit = p.fit(self.cfg.max_scale);
                let v = serde_json::json!({
                    "worker": id.0,
                    "ttft_scale": fit.map(|f| f.scale),
                    "ttft_context": fit.map(|f| f.context),
                    "ttft_overhead_secs": fit.map(|f| f.overhead_secs),
                    "ttft_samples": p.ttft_samples,
                    "hit_ratio": p.hit_ratio,
                    "hit_samples": p.hit_samples,
                });
                (id.0, v)
            })
            .collect();
        workers.sort_by_key(|w| w.0);
        serde_json::json!({
            "prefill_tokens_per_sec": self.cfg.prefill_tokens_per_sec,
            "fleet_hit_share": self.fleet_hit_share(),
            "workers": workers.into_iter().map(|w| w.1).collect::<Vec<_>>(),
        })
    }

    fn knobs(&self) -> serde_json::Value {
        let mut v = self.cost.knobs();
        if let (Some(all), Ok(serde_json::Value::Object(own))) = (v.as_object_mut(), serde_json::to_value(&self.cfg)) {
            all.extend(own);
        }
        v
    }

    fn set_knobs(&mut self, patch: &serde_json::Value) -> Result<(), KnobError> {
        let Some(p) = patch.as_object() else {
            return Err(KnobError { policy: "least_ttft", message: "knobs must be a JSON object".into() });
        };
        let (own, cost): (serde_json::Map<_, _>, serde_json::Map<_, _>) =
            p.iter().map(|(k, v)| (k.clone(), v.clone())).partition(|(k, _)| OWN_KNOBS.contains(&k.as_str()));
        let next = patch_knobs("least_ttft", &self.cfg, &serde_json::Value::Object(own), validate)?;
        // prefill_cost's own check names the knob; only the policy name changes.
        self.cost
            .set_knobs(&serde_json::Value::Object(cost))
            .map_err(|e| KnobError { policy: "least_ttft", message: e.message })?;
        self.cfg = next;
        Ok(())
    }

    fn index_size(&self) -> u64 {
        self.cost.index_size()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether two passes' ties agree: the same list, or a pick among as many as the other
    /// lists, one of them.
    fn same_ties(a: &Ties, b: &Ties) -> bool {
        match (a, b) {
            (Ties::Listed(x), Ties::Listed(y)) => x == y,
            (Ties::Picked(id, n), Ties::Listed(y)) => *n == y.len() && y.contains(id),
            _ => false,
        }
    }
    use crate::policy::prefill_cost::Scan;
    use crate::policy::prefill_cost::tests::req;
    use crate::types::BlockHash;
    use rand_core::SeedableRng;

    fn go(p: &mut dyn Policy, r: &RequestView<'_>, c: &[WorkerView]) -> Decision {
        let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(0);
        let mut ctx = PickCtx { now: Nanos::ZERO, rng: &mut rng, fleet: None };
        crate::policy::route(p, r, c, &mut ctx).expect("route")
    }

    /// A decision without its commit, checked against the same decision read through a
    /// [`FleetDigest`] of `c`.
    fn peek(p: &LeastTtft, r: &RequestView<'_>, c: &[WorkerView]) -> Decision {
        let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(0);
        // Both from the same point of the tie rotation.
        let rotation = p.cost.rotation.peek();
        let digest = FleetDigest::new(c);
        let mut ctx = PickCtx { now: Nanos::ZERO, rng: &mut rng, fleet: Some(&digest) };
        let kept = crate::policy::decide(p, r, c, &mut ctx).expect("decide").0;
        p.cost.rotation.set(rotation);
        let d = crate::policy::decide(p, r, c, &mut PickCtx { fleet: None, ..ctx }).expect("decide").0;
        assert_eq!(kept, d, "read through a digest");
        d
    }

    fn fresh() -> LeastTtft {
        LeastTtft::new(LeastTtftConfig::default(), PrefillCostConfig::default())
    }

    fn seen(worker: u32, predicted: TtftPrediction, ttft: f64) -> (WorkerId, Observation) {
        let obs =
            Observation { input_tokens: 4096, predicted: Some(predicted), ttft_secs: Some(ttft), ..Default::default() };
        (WorkerId(worker), obs)
    }

    /// One worker of a random fleet: (in_flight, waiting, pending prefill tokens,
    /// max_concurrent, reported cached tokens, reported KV capacity in blocks, healthy).
    type Spec = (u32, u32, u64, u32, Option<u64>, Option<u64>, bool);

    fn fleet_of(specs: &[Spec], order: u64) -> Vec<WorkerView> {
        let mut c: Vec<WorkerView> = specs
            .iter()
            .enumerate()
            .map(|(i, &(in_flight, waiting, pending, conc, cached, kv_blocks, healthy))| {
                let mut w = WorkerView::idle(WorkerId(i as u32 * 3));
                w.in_flight = in_flight;
                w.waiting = waiting.min(in_flight);
                w.pending_prefill_tokens = pending;
                w.capacity.max_concurrent = conc;
                w.cached_tokens = cached;
                w.capacity.kv_tokens = kv_blocks.map(|b| b * 512);
                if !healthy {
                    w.health = crate::types::Health::Unhealthy;
                }
                w
            })
            .collect();
        // Candidates in id order mostly, and sometimes not (a fleet's list after changes).
        if order == 0 {
            c.reverse();
        } else if order == 1 && c.len() > 2 {
            let mid = c.len() / 2;
            c.swap(0, mid);
        }
        c
    }

    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..Default::default() })]

        /// The fast scan (every worker's match from the block index's holders, hopeless
        /// workers unscored) picks the same tied set as scoring every worker on its own.
        #[test]
        fn the_fast_scan_ties_the_same_workers_as_the_full_scan(
            specs in proptest::collection::vec(
                (0u32..8, 0u32..4, (0u64..6).prop_map(|k| k * 700), 1u32..6,
                 proptest::option::weighted(0.2, 0u64..5000), proptest::option::weighted(0.3, 1u64..6),
                 proptest::bool::weighted(0.9)),
                1..40),
            history in proptest::collection::vec((proptest::collection::vec(0u64..5, 1..6), 0usize..40), 0..60),
            observed in proptest::collection::vec((0usize..40, 0u64..3000, 1u64..3000, 0.01f64..2.0), 0..30),
            removed in proptest::option::of(0usize..40),
            probe in proptest::collection::vec(0u64..5, 1..7),
            order in 0u64..3,
            knobs in (0usize..3, 0.0f64..2.0),
        ) {
            let cost = PrefillCostConfig { cache_tokens: 2048, batch_factor: knobs.1, ..Default::default() };
            let cfg = match knobs.0 {
                0 => LeastTtftConfig { session_balance_min_hit: 0.0, ..Default::default() },
                1 => LeastTtftConfig { context_weight: 0.001, waiting_delay_weight: 0.5, ..Default::default() },
                _ => LeastTtftConfig { decode_occupancy_full: 0.0, miss_queue_scale: 0.0, ..Default::default() },
            };
            let mut p = LeastTtft::new(cfg, cost);
            let c = fleet_of(&specs, order);
            for (i, (prompt, w)) in history.iter().enumerate() {
                let blocks: Vec<BlockHash> = prompt.iter().map(|&h| BlockHash(h)).collect();
                // Some turns of a session, bound where they went.
                let r = RequestView { session_id: (i % 4 == 0).then_some("s0"), ..req(&blocks) };
                let mut key = p.key(&r);
                let w = &c[w % c.len()];
                key.worker_kv_tokens = w.capacity.kv_tokens;
                p.on_routed(&r, &key, w.id, Nanos::ZERO);
            }
            for &(w, predicted, reported, ttft) in &observed {
                let w = c[w % c.len()].id;
                let obs = Observation {
                    input_tokens: 4096,
                    predicted: Some(TtftPrediction { secs: ttft, uncalibrated_secs: ttft / 2.0, context_secs: 0.0 }),
                    predicted_cached_tokens: predicted,
                    ttft_secs: Some(ttft),
                    cached_tokens: Some(reported),
                };
                p.observe(w, &obs);
            }
            if let Some(r) = removed {
                p.on_worker_removed(c[r % c.len()].id);
            }
            // The best hit ratio kept as a multiset is the maximum over the profiles.
            let want = p.profiles.values().filter(|q| q.hit_samples > 0).map(|q| q.hit_ratio).reduce(f64::max);
            prop_assert_eq!(p.best_hit_ratio(), want.unwrap_or(1.0));
            let blocks: Vec<BlockHash> = probe.iter().map(|&h| BlockHash(h)).collect();
            let r = req(&blocks);
            let key = p.key(&r);
            let mut hits = p.cost.sets.hits(&key.blocks);
            let mut survey = p.survey(&c, &key, u64::from(r.input_tokens), &mut hits, Vec::new());
            let means = FleetMeans::of(&c);
            prop_assert_eq!(survey.means, means);
            let ask = Ask {
                key: &key,
                input: u64::from(r.input_tokens),
                stall: p.cost.stall_weight_of(means.waiting),
                miss_share: p.miss_share(&means),
                best_hit: p.best_hit_ratio(),
            };
            for cap in [None, Some(3.0)] {
                let fast = p.best_of(&c, &ask, cap, Pass::Fast(&mut hits, &mut survey));
                let full = p.best_of(&c, &ask, cap, Pass::Full);
                prop_assert!(same_ties(&fast, &full), "{fast:?} against {full:?}");
            }
            // The fleet read from a digest kept view by view (built for the fleet with its
            // engine-reported counts, then brought to the fleet without them).
            let plain: Vec<WorkerView> = c.iter().map(|w| WorkerView { cached_tokens: None, ..*w }).collect();
            let mut digest = FleetDigest::new(&c);
            prop_assert!(!digest.usable_for(&c) || c.iter().all(|w| !w.is_routable() || w.cached_tokens.is_none()));
            for (i, w) in plain.iter().enumerate() {
                digest.update(i, w);
            }
            prop_assert!(digest.usable_for(&plain));
            prop_assert_eq!(digest.means(), means);
            let deepest = hits.deepest();
            let own = (ask.input - deepest.saturating_mul(key.block_tokens).min(ask.input)) as f64;
            let mut plain_survey = p.survey(&plain, &key, ask.input, &mut hits, Vec::new());
            for cap in [None, Some(3.0), Some(1.5)] {
                let kept = p.best_of(&plain, &ask, cap, Pass::Kept(&mut hits, &digest, own));
                let fast = p.best_of(&plain, &ask, cap, Pass::Fast(&mut hits, &mut plain_survey));
                let full = p.best_of(&plain, &ask, cap, Pass::Full);
                prop_assert!(same_ties(&kept, &full), "{kept:?} against {full:?}");
                prop_assert!(same_ties(&fast, &full), "{fast:?} against {full:?}");
            }
            // Whole decisions, with and without the digest, with and without a session id
            // (the session gate and a bound session read the fleet through the digest).
            for sid in [None, Some("s0"), Some("s1")] {
                let r = RequestView { session_id: sid, ..req(&blocks) };
                let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(0);
                // Each from the same point of the tie rotation.
                let rotation = p.cost.rotation.peek();
                let mut ctx = PickCtx { now: Nanos::ZERO, rng: &mut rng, fleet: Some(&digest) };
                let kept = crate::policy::decide(&p, &r, &plain, &mut ctx).map(|d| d.0);
                p.cost.rotation.set(rotation);
                let read = crate::policy::decide(&p, &r, &plain, &mut PickCtx { fleet: None, ..ctx }).map(|d| d.0);
                prop_assert_eq!(kept, read);
            }
            // prefill_cost's scans, on the same block sets; from the digest without the
            // engine-reported counts.
            let kept = p.cost.best_kept(crate::policy::prefill_cost::KeptAsk { c: &plain, key: &key, input: ask.input, stall: ask.stall, fleet: &digest });
            let full = p.cost.best_of(&plain, &key, ask.input, ask.stall, Scan::Full);
            prop_assert_eq!((kept.0, kept.1.to_vec()), (full.0, full.1.to_vec()));
            let fast = p.cost.best_of(&c, &key, ask.input, ask.stall, Scan::Fast);
            let full = p.cost.best_of(&c, &key, ask.input, ask.stall, Scan::Full);
            prop_assert_eq!((fast.0, fast.1.to_vec()), (full.0, full.1.to_vec()));
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        /// On large fleets, most of them mostly idle (their idle workers' tie read as runs
        /// of the digest's idle bits), with prompts held here and there and knobs that let
        /// busy workers charge what idle ones do (no decode, batch, stall or waiting
        /// charge), the decision read through the digest is the one read from every view,
        /// from any point of the tie rotation.
        #[test]
        fn a_mostly_idle_fleet_decides_through_the_digest_as_from_every_view(
            specs in proptest::collection::vec(crate::policy::prefill_cost::tests::big_spec(), 60..300),
            history in proptest::collection::vec((proptest::collection::vec(0u64..4, 1..5), 0usize..300), 0..30),
            probe in proptest::collection::vec(0u64..4, 1..5),
            plain in proptest::bool::ANY,
            reversed in proptest::bool::ANY,
            rotation in 0u64..1000,
        ) {
            let mut p = if plain {
                let own = LeastTtftConfig { waiting_delay_weight: 0.0, ..LeastTtftConfig::default() };
                let cost =
                    PrefillCostConfig { decode_weight: 0, batch_factor: 0.0, stall_weight: 0.0, ..PrefillCostConfig::default() };
                LeastTtft::new(own, cost)
            } else {
                fresh()
            };
            let c = crate::policy::prefill_cost::tests::big_fleet(&specs, reversed);
            for (prompt, w) in &history {
                let blocks: Vec<BlockHash> = prompt.iter().map(|&h| BlockHash(h)).collect();
                crate::policy::record_routed(&mut p, &req(&blocks), c[w % c.len()].id, Nanos::ZERO);
            }
            p.cost.rotation.set(rotation);
            let blocks: Vec<BlockHash> = probe.iter().map(|&h| BlockHash(h)).collect();
            if c.iter().any(WorkerView::is_routable) {
                peek(&p, &req(&blocks), &c);
            }
        }
    }

    #[test]
    fn a_fleet_where_most_workers_tie_is_read_in_order_and_decided_the_same() {
        // 600 workers, all alike but a few: more can win than a digest's decision collects
        // (64 + 600 / 8): idle, they are taken as one class (the digest's idle bits); busy
        // alike, the views are read after collecting that many; `peek` checks each decision.
        for busy in [0, 1] {
            let mut p = fresh();
            let mut c = crate::policy::prefill_cost::tests::alike(busy);
            let h: Vec<BlockHash> = (0..4).map(BlockHash).collect();
            let first = go(&mut p, &req(&h), &c);
            assert_eq!(first.branch, Branch::TieBreak);
            let d = peek(&p, &req(&h), &c);
            assert_eq!((d.worker, d.branch), (first.worker, Branch::Score), "it holds the prompt now");
            // With that worker busy, the prompt goes to another.
            c[first.worker.index()].in_flight = 8;
            c[first.worker.index()].pending_prefill_tokens = 50_000;
            assert_ne!(peek(&p, &req(&h), &c).worker, first.worker);
        }
    }

    #[test]
    fn with_the_full_miss_and_decode_charges_and_no_observation_it_ranks_exactly_as_prefill_cost() {
        // Random fleets and requests: the same worker, whenever prefill_cost's choice is not
        // a tie (ties rotate, and the two rotations need not agree).
        let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(7);
        use rand_core::Rng;
        let own = LeastTtftConfig {
            miss_queue_scale: 0.0,
            decode_occupancy_full: 0.0,
            waiting_delay_weight: 0.0,
            ..LeastTtftConfig::default()
        };
        let mut a = LeastTtft::new(own, PrefillCostConfig::default());
        let mut b = PrefillCost::new(PrefillCostConfig::default());
        for round in 0..400u64 {
            let n = 2 + (rng.next_u32() % 6);
            let c: Vec<WorkerView> = (0..n)
                .map(|i| {
                    let mut v = WorkerView::idle(WorkerId(i));
                    v.in_flight = rng.next_u32() % 40;
                    v.waiting = v.in_flight.min(rng.next_u32() % 8);
                    v.pending_prefill_tokens = u64::from(rng.next_u32() % 50_000);
                    v
                })
                .collect();
            let h: Vec<BlockHash> = (0..1 + rng.next_u64() % 12).map(|k| BlockHash(k + (round % 5) * 100)).collect();
            let r = req(&h);
            let db = go(&mut b, &r, &c);
            let da = go(&mut a, &r, &c);
            if db.branch == Branch::Score {
                assert_eq!(da.worker, db.worker, "round {round}");
                assert!(da.predicted_ttft.is_some());
            }
            // Keep the two block sets the same whoever won.
            crate::policy::record_routed(&mut a, &r, db.worker, Nanos::ZERO);
            crate::policy::record_routed(&mut b, &r, da.worker, Nanos::ZERO);
        }
    }

    /// Observations of worker `w` whose measured TTFT is `overhead + scale × predicted`,
    /// over predictions spread from 0.05 to 1 s.
    fn teach(p: &mut LeastTtft, w: u32, scale: f64, overhead: f64, n: u32) {
        for i in 0..n {
            let x = 0.05 + f64::from(i % 20) * 0.05;
            let (w, o) =
                seen(w, TtftPrediction { secs: x, uncalibrated_secs: x, context_secs: 0.0 }, overhead + scale * x);
            p.observe(w, &o);
        }
    }

    #[test]
    fn the_ttft_fit_recovers_a_worker_s_scale_and_overhead() {
        let mut p = fresh();
        teach(&mut p, 0, 4.0, 0.03, 7);
        assert_eq!(p.profile(WorkerId(0)).expect("profile").fit(1000.0), None, "too few observations to fit");
        teach(&mut p, 0, 4.0, 0.03, 100);
        teach(&mut p, 1, 1.0, 0.0, 100);
        let TtftFit { scale, context, overhead_secs } =
            p.profile(WorkerId(0)).expect("profile").fit(1000.0).expect("fitted");
        assert!((scale - 4.0).abs() < 1e-6 && (overhead_secs - 0.03).abs() < 1e-6, "{scale} {overhead_secs}");
        assert_eq!(context, 0.0, "no context term seen, none fitted");
        // The predictions: worker 0 four times slower plus its overhead; the ranking is
        // unchanged (both idle, same queue: a tie, broken by rotation).
        let h: Vec<BlockHash> = (0..8).map(BlockHash).collect();
        let c = vec![WorkerView::idle(WorkerId(0)), WorkerView::idle(WorkerId(1))];
        let mut seen_workers = [false; 2];
        for _ in 0..2 {
            let d = peek(&p, &req(&h), &c);
            let pred = d.predicted_ttft.expect("a prediction");
            let raw = 4096.0 / 20_000.0;
            assert!((pred.uncalibrated_secs - raw).abs() < 1e-12);
            let want = if d.worker == WorkerId(0) { 0.03 + 4.0 * raw } else { raw };
            assert!((pred.secs - want).abs() < 1e-6, "{:?}: {pred:?}", d.worker);
            assert_eq!(d.branch, Branch::TieBreak);
            seen_workers[d.worker.index()] = true;
        }
        assert_eq!(seen_workers, [true, true], "the fit does not move the ranking");
    }

    #[test]
    fn an_unfitted_worker_is_predicted_with_the_fleet_s_fit() {
        let mut p = fresh();
        teach(&mut p, 0, 100.0, 0.0, 40);
        teach(&mut p, 1, 100.0, 0.0, 40);
        let c = vec![WorkerView::idle(WorkerId(2))];
        let h: Vec<BlockHash> = (0..2).map(BlockHash).collect();
        let d = peek(&p, &req(&h), &c);
        let secs = d.predicted_ttft.expect("prediction").secs;
        assert!((secs - 100.0 * 1024.0 / 20_000.0).abs() < 1e-6, "{secs}");
    }

    #[test]
    fn the_ttft_fit_learns_the_context_term_a_worker_s_engine_pays() {
        // An engine whose prefill costs 2 × the prior per token plus 5e-5 per token per token
        // attended (the measured H100 grid gives ~1.2e-4), behind a 20 ms overhead: the
        // fit recovers all three from requests of different lengths and cached shares.
        let mut p = fresh();
        let rate = 20_000.0;
        for i in 0..200u32 {
            let own = f64::from(256 + (i * 977) % 8000);
            let cached = f64::from((i * 7919) % 30_000);
            let pred = TtftPrediction {
                secs: 0.0,
                uncalibrated_secs: own / rate,
                context_secs: own * (cached + own / 2.0) / rate,
            };
            let (w, o) = seen(0, pred, 0.02 + 2.0 * pred.uncalibrated_secs + 5e-5 * pred.context_secs);
            p.observe(w, &o);
        }
        let f = p.profile(WorkerId(0)).expect("profile").fit(1000.0).expect("fitted");
        assert!((f.scale - 2.0).abs() < 1e-6 && (f.context - 5e-5).abs() < 1e-10, "{f:?}");
        assert!((f.overhead_secs - 0.02).abs() < 1e-6, "{f:?}");
        // The prediction of a 4,096-token miss on an idle worker carries the term.
        let h: Vec<BlockHash> = (0..8).map(BlockHash).collect();
        let d = peek(&p, &req(&h), &[WorkerView::idle(WorkerId(0))]);
        let pred = d.predicted_ttft.expect("prediction");
        assert!((pred.context_secs - 4096.0 * 2048.0 / rate).abs() < 1e-9, "{pred:?}");
        assert!((pred.secs - (0.02 + 2.0 * 4096.0 / rate + 5e-5 * pred.context_secs)).abs() < 1e-9, "{pred:?}");
        // A context term that only ever moves with the prediction is not told apart: no
        // context fitted, the straight line as before.
        let mut q = fresh();
        for i in 0..100u32 {
            let x = 0.05 + f64::from(i % 20) * 0.05;
            let pred = TtftPrediction { secs: x, uncalibrated_secs: x, context_secs: 3.0 * x };
            let (w, o) = seen(0, pred, 0.01 + 2.0 * x);
            q.observe(w, &o);
        }
        let f = q.profile(WorkerId(0)).expect("profile").fit(1000.0).expect("fitted");
        assert_eq!(f.context, 0.0, "{f:?}");
        assert!((f.scale - 2.0).abs() < 1e-6, "{f:?}");
    }

    #[test]
    fn a_miss_costs_the_others_only_when_there_is_a_queue() {
        let mut p = fresh();
        let h: Vec<BlockHash> = (0..8).map(BlockHash).collect();
        crate::policy::record_routed(&mut p, &req(&h), WorkerId(0), Nanos::ZERO);
        // Worker 0 holds the 4,096-token prompt behind 5,000 queued tokens; worker 1 is cold.
        let mut c = vec![WorkerView::idle(WorkerId(0)), WorkerView::idle(WorkerId(1))];
        c[0].pending_prefill_tokens = 5000;
        c[0].in_flight = 1;
        c[0].waiting = 1;
        // Half a request waits per worker: the request's own TTFT nearly alone decides
        // (4,096 × (1 + 7 × 0.5 / 32) ≈ 4,544 < 5,000 + 68 of decode).
        assert_eq!(peek(&p, &req(&h), &c).worker, WorkerId(1));
        // 40 requests wait on each worker: the miss is charged its full weight, 8 × 4,096.
        for w in c.iter_mut() {
            w.in_flight += 40;
            w.waiting += 40;
        }
        assert_eq!(peek(&p, &req(&h), &c).worker, WorkerId(0));
        // With miss_queue_scale 0 the full charge applies at once (prefill_cost's).
        for w in c.iter_mut() {
            w.in_flight -= 40;
            w.waiting -= 40;
        }
        p.set_knobs(&serde_json::json!({"miss_queue_scale": 0.0})).expect("knob");
        assert_eq!(peek(&p, &req(&h), &c).worker, WorkerId(0));
    }

    #[test]
    fn a_long_miss_goes_where_fewer_requests_wait_to_share_its_prefill() {
        let p = fresh();
        // A 4,096-token prompt neither worker holds. Worker 0 has less work ahead (3,000
        // tokens) but 3 requests waiting for their first token; worker 1 has 4,000 tokens
        // in one waiting request. Without the charge worker 0 wins: 3,000 + 228 (decode) +
        // 4,096 × 0.18 (stall) ≈ 3,965 against 4,068 + 246 ≈ 4,314 (the miss weight is the
        // same on both). The charge adds 4,096 × 0.2 × 3 ≈ 2,458 to worker 0 and 819 to 1.
        let h: Vec<BlockHash> = (0..8).map(BlockHash).collect();
        let mut c = vec![WorkerView::idle(WorkerId(0)), WorkerView::idle(WorkerId(1))];
        (c[0].in_flight, c[0].waiting, c[0].pending_prefill_tokens) = (3, 3, 3000);
        (c[1].in_flight, c[1].waiting, c[1].pending_prefill_tokens) = (1, 1, 4000);
        let d = peek(&p, &req(&h), &c);
        assert_eq!(d.worker, WorkerId(1));
        // The prediction is the request's own TTFT: the charge is for the others.
        let secs = d.predicted_ttft.expect("prediction").uncalibrated_secs;
        assert!((secs - (4000.0 + p.decode_charge(&c[1], 1.0) + 4096.0) / 20_000.0).abs() < 1e-9, "{secs}");
        let mut off = fresh();
        off.set_knobs(&serde_json::json!({"waiting_delay_weight": 0.0})).expect("knob");
        assert_eq!(peek(&off, &req(&h), &c).worker, WorkerId(0));
        // Counting at most one waiting request: worker 0 is charged 819 too and wins again.
        let mut one = fresh();
        one.set_knobs(&serde_json::json!({"waiting_delay_cap": 1.0})).expect("knob");
        assert_eq!(peek(&one, &req(&h), &c).worker, WorkerId(0));
        let e = off.set_knobs(&serde_json::json!({"waiting_delay_weight": -1.0})).expect_err("negative");
        assert!(e.message.contains("waiting_delay_weight"), "{}", e.message);
    }

    #[test]
    fn the_context_weight_charges_the_own_prefill_for_what_it_attends_to() {
        // The same 4,096-token miss on an idle worker: with context_weight w its own work is
        // 4,096 × (1 + w × 2,048), so the prediction grows by that factor.
        let h: Vec<BlockHash> = (0..8).map(BlockHash).collect();
        let c = vec![WorkerView::idle(WorkerId(0))];
        let flat = peek(&fresh(), &req(&h), &c).predicted_ttft.expect("prediction").uncalibrated_secs;
        let mut p = fresh();
        p.set_knobs(&serde_json::json!({"context_weight": 1e-4})).expect("knob");
        let with = peek(&p, &req(&h), &c).predicted_ttft.expect("prediction").uncalibrated_secs;
        let own = 4096.0;
        assert!((with - flat - own * 1e-4 * own / 2.0 / 20_000.0).abs() < 1e-9, "{flat} -> {with}");
        for bad in [-1e-4, 2.0] {
            let e = p.set_knobs(&serde_json::json!({"context_weight": bad})).expect_err("refused");
            assert!(e.message.contains("context_weight"), "{}", e.message);
        }
    }

    /// A 4,096-token shared prefix (a tool prompt) that worker 0 of `p` holds; worker 0 runs
    /// 6 requests, workers 1 and 2 run 1 each: mean 8/3, the session balance bound
    /// max(1.25 × 8/3, 8/3 + 2) = 4.67. Returns the fleet and a prompt of the prefix and one
    /// block more.
    fn gated_fleet(p: &mut LeastTtft) -> (Vec<WorkerView>, Vec<BlockHash>) {
        let shared: Vec<BlockHash> = (0..8).map(BlockHash).collect();
        crate::policy::record_routed(p, &req(&shared), WorkerId(0), Nanos::ZERO);
        let mut c: Vec<WorkerView> = (0..3).map(|i| WorkerView::idle(WorkerId(i))).collect();
        c[0].in_flight = 6;
        c[1].in_flight = 1;
        c[2].in_flight = 1;
        let mut h = shared;
        h.push(BlockHash(100));
        (c, h)
    }

    #[test]
    fn a_new_session_is_kept_off_a_worker_loaded_past_the_balance_bound() {
        let mut p = fresh();
        let (mut c, h) = gated_fleet(&mut p);
        // Without a session id the cache decides: 512 uncached tokens beat 4,608.
        let anonymous = req(&h);
        assert_eq!(peek(&p, &anonymous, &c).worker, WorkerId(0));
        // So does a new session with the gate off.
        p.set_knobs(&serde_json::json!({"session_balance_rel": 0.0})).expect("knob");
        assert_eq!(peek(&p, &RequestView { session_id: Some("b"), ..req(&h) }, &c).worker, WorkerId(0));
        p.set_knobs(&serde_json::json!({"session_balance_rel": 1.25})).expect("knob");
        // Workers that run 2 requests at once (llama.cpp slots): the bound, 4.67, is past
        // their batch, the extra requests queue there and the score prices the queue; no gate.
        let mut slots = c.clone();
        for w in slots.iter_mut() {
            w.capacity.max_concurrent = 2;
        }
        let d = peek(&p, &RequestView { session_id: Some("s"), ..req(&h) }, &slots);
        assert_eq!((d.worker, d.branch), (WorkerId(0), Branch::Score));
        // A request opening session "a" must go where the load stays within the bound.
        let opening = RequestView { session_id: Some("a"), ..req(&h) };
        let d = go(&mut p, &opening, &c);
        assert_ne!(d.worker, WorkerId(0));
        assert_eq!(d.branch, Branch::NewBinding);
        // Its next call follows its cache, wherever the load is: the gate is for new sessions.
        let bound = d.worker;
        c[bound.0 as usize].in_flight = 9;
        let mut next = h.clone();
        next.push(BlockHash(101));
        let d = peek(&p, &RequestView { session_id: Some("a"), ..req(&next) }, &c);
        assert_eq!(d.worker, bound);
        assert_ne!(d.branch, Branch::NewBinding);
        // No worker within the bound (no allowance, an idle fleet: the bound is 0): the
        // gate steps aside rather than refuse, and the cache decides (the whole prompt is
        // on the session's worker now).
        p.set_knobs(&serde_json::json!({"session_balance_abs": 0.0})).expect("knob");
        for w in c.iter_mut() {
            w.in_flight = 0;
        }
        let d = peek(&p, &RequestView { session_id: Some("c"), ..req(&h) }, &c);
        assert_eq!((d.worker, d.branch), (bound, Branch::Score));
    }

    #[test]
    fn the_session_gate_steps_aside_while_the_engines_report_few_hits() {
        let mut p = fresh();
        // Worker 0 holds the shared prefix and runs 6 requests, past the bound.
        let (c, h) = gated_fleet(&mut p);
        let opening = RequestView { session_id: Some("a"), ..req(&h) };
        let report = |p: &mut LeastTtft, cached: u64, n: usize| {
            let obs = Observation { input_tokens: 1000, cached_tokens: Some(cached), ..Default::default() };
            for _ in 0..n {
                p.observe(WorkerId(1), &obs);
            }
        };
        // Fewer reports than the window: no share yet, the gate applies whatever they say.
        report(&mut p, 100, FLEET_HIT_WINDOW as usize - 1);
        assert_eq!(p.fleet_hit_share(), None);
        assert_eq!(peek(&p, &opening, &c).branch, Branch::NewBinding);
        // 10 % cached over the window, under the 0.3 default: the cache decides.
        report(&mut p, 100, 1);
        let share = p.fleet_hit_share().expect("a share");
        assert!((share - 0.1).abs() < 1e-9, "{share}");
        let d = peek(&p, &opening, &c);
        assert_eq!((d.worker, d.branch), (WorkerId(0), Branch::Score));
        // With the knob at 0 the gate applies whatever the hits.
        p.set_knobs(&serde_json::json!({"session_balance_min_hit": 0.0})).expect("knob");
        assert_eq!(peek(&p, &opening, &c).branch, Branch::NewBinding);
        p.set_knobs(&serde_json::json!({"session_balance_min_hit": 0.3})).expect("knob");
        // Hits recover (reports past the prompt count as the whole prompt): the gate is back.
        report(&mut p, 5000, 4 * FLEET_HIT_WINDOW as usize);
        assert!(p.fleet_hit_share().expect("a share") > 0.95);
        assert_eq!(peek(&p, &opening, &c).branch, Branch::NewBinding);
        for bad in [-0.1, 1.5] {
            let e = p.set_knobs(&serde_json::json!({"session_balance_min_hit": bad})).expect_err("refused");
            assert!(e.message.contains("session_balance_min_hit"), "{}", e.message);
        }
    }

    #[test]
    fn hits_the_engine_never_reports_stop_attracting_requests() {
        let mut p = fresh();
        let h: Vec<BlockHash> = (0..8).map(BlockHash).collect();
        crate::policy::record_routed(&mut p, &req(&h), WorkerId(0), Nanos::ZERO);
        let mut c = vec![WorkerView::idle(WorkerId(0)), WorkerView::idle(WorkerId(1))];
        c[0].pending_prefill_tokens = 3000;
        // The router believes worker 0 holds all 4,096 tokens: 3,000 < 8 × 4,096.
        let d = go(&mut p, &req(&h), &c);
        assert_eq!(d.worker, WorkerId(0));
        let predicted_cached = d.cached_tokens_estimate(4096);
        assert_eq!(predicted_cached, 4096);
        let report = |p: &mut LeastTtft, w: u32, cached: u64| {
            let obs = Observation {
                input_tokens: 4096,
                predicted_cached_tokens: predicted_cached,
                cached_tokens: Some(cached),
                ..Default::default()
            };
            p.observe(WorkerId(w), &obs);
        };
        // Both engines report half of what the router predicted (a fleet-wide shortfall: the
        // router's unit, its eviction guess): the ranking is unchanged.
        for _ in 0..40 {
            report(&mut p, 0, 2048);
            report(&mut p, 1, 2048);
        }
        assert_eq!(peek(&p, &req(&h), &c).worker, WorkerId(0));
        // Worker 0's engine now reports nothing cached, again and again (its slots swapped
        // the prompt out), while worker 1's keeps delivering: worker 0's hits stop counting.
        for _ in 0..120 {
            report(&mut p, 0, 0);
            report(&mut p, 1, 2048);
        }
        assert!(p.profile(WorkerId(0)).expect("profile").hit_ratio < 0.01);
        assert_eq!(peek(&p, &req(&h), &c).worker, WorkerId(1));
        // With calibrate_hits off the belief is taken as it is.
        p.set_knobs(&serde_json::json!({"calibrate_hits": false})).expect("knob");
        assert_eq!(peek(&p, &req(&h), &c).worker, WorkerId(0));
    }

    #[test]
    fn garbage_observations_change_nothing() {
        let mut p = fresh();
        let pred = TtftPrediction { secs: 0.5, uncalibrated_secs: 0.5, context_secs: 0.0 };
        for t in [f64::NAN, 0.0, -1.0, f64::INFINITY] {
            let (w, o) = seen(0, pred, t);
            p.observe(w, &o);
        }
        let bad = TtftPrediction { secs: f64::NAN, uncalibrated_secs: f64::NAN, context_secs: 0.0 };
        let (w, o) = seen(0, bad, 3.0);
        p.observe(w, &o);
        assert_eq!(p.profile(WorkerId(0)).expect("profile").ttft_samples, 0);
        // An absurd slope is bounded by max_scale.
        teach(&mut p, 1, 1e9, 0.0, 40);
        let s = p.profile(WorkerId(1)).expect("profile").fit(1000.0).expect("fitted").scale;
        assert!((s - 1000.0).abs() < 1e-6, "{s}");
        // Every prediction the same: no slope to fit.
        for _ in 0..40 {
            let (w, o) = seen(3, pred, 0.7);
            p.observe(w, &o);
        }
        assert_eq!(p.profile(WorkerId(3)).expect("profile").fit(1000.0), None);
        // Calibration off: nothing is learned.
        p.set_knobs(&serde_json::json!({"calibration_rate": 0.0})).expect("knob");
        let (w, o) = seen(2, pred, 5.0);
        p.observe(w, &o);
        assert!(p.profile(WorkerId(2)).is_none());
    }

    #[test]
    fn knobs_merge_both_sets_and_errors_name_the_knob() {
        let mut p = fresh();
        let k = p.knobs();
        assert_eq!(k["miss_weight"], 8.0);
        assert_eq!(k["prefill_tokens_per_sec"], 20_000.0);
        p.set_knobs(&serde_json::json!({"miss_weight": 4.0, "prefill_tokens_per_sec": 70.0})).expect("both sets");
        assert_eq!(p.knobs()["miss_weight"], 4.0);
        assert_eq!(p.knobs()["prefill_tokens_per_sec"], 70.0);
        for (bad, names) in [
            (serde_json::json!({"nope": 1}), "nope"),
            (serde_json::json!({"prefill_tokens_per_sec": 0.0}), "prefill_tokens_per_sec"),
            (serde_json::json!({"calibration_rate": 2.0}), "calibration_rate"),
            (serde_json::json!({"miss_weight": -1.0}), "miss_weight"),
            (serde_json::json!({"session_balance_rel": 0.5}), "session_balance_rel"),
            (serde_json::json!({"session_balance_abs": -1.0}), "session_balance_abs"),
            (serde_json::json!({"decode_occupancy_free": 0.9}), "decode_occupancy_full"),
            (serde_json::json!({"decode_occupancy_free": -0.1}), "decode_occupancy_free"),
            (serde_json::json!({"decode_occupancy_full": -1.0}), "decode_occupancy_full"),
        ] {
            let e = p.set_knobs(&bad).expect_err("refused");
            assert!(e.message.contains(names), "{e}");
            assert_eq!(e.policy, "least_ttft");
        }
        assert_eq!(p.knobs()["miss_weight"], 4.0, "a refused patch changes nothing");
    }

    #[test]
    fn knobs_of_the_wrong_kind_are_named_with_what_they_must_be() {
        // serde said only `invalid number` (or `invalid type: …`), naming no knob.
        let mut p = fresh();
        for (bad, want) in [
            (
                serde_json::json!({"decode_weight": -5}),
                "decode_weight must be a whole number from 0 to 18446744073709551615, got -5",
            ),
            (
                serde_json::json!({"decode_weight": 1.5}),
                "decode_weight must be a whole number from 0 to 18446744073709551615, got 1.5",
            ),
            (
                serde_json::json!({"block_tokens": 1e9}),
                "block_tokens must be a whole number from 0 to 4294967295, got 1000000000.0",
            ),
            (serde_json::json!({"calibration_rate": "x"}), "calibration_rate must be a number, got \"x\""),
            (serde_json::json!({"calibrate_hits": 3}), "calibrate_hits must be true or false, got 3"),
        ] {
            let e = p.set_knobs(&bad).expect_err("refused");
            assert_eq!(e.message, want);
            assert_eq!(e.policy, "least_ttft");
        }
        let e = p.set_knobs(&serde_json::json!({"nope": 1})).expect_err("unknown");
        assert!(e.message.contains("unknown field `nope`"), "{e}");
    }

    #[test]
    fn running_requests_are_charged_only_as_the_batch_fills_and_waiting_ones_always() {
        let p = fresh();
        let whole = |load: u32| p.cost.decode_charge(f64::from(load));
        let charge = |in_flight: u32, waiting: u32, max_concurrent: u32| {
            let mut w = WorkerView::idle(WorkerId(0));
            (w.in_flight, w.waiting, w.capacity.max_concurrent) = (in_flight, waiting, max_concurrent);
            p.decode_charge(&w, f64::from(w.load()))
        };
        // 30 running requests in a batch of 256 (occupancy 0.12, below 0.4): no charge; a
        // new request's prefill step hardly slows for them.
        assert_eq!(charge(30, 0, 256), 0.0);
        // In a batch of 50 (0.6, halfway from 0.4 to 0.8): half the charge; of 32 (0.94): all.
        assert!((charge(30, 0, 50) - whole(30) / 2.0).abs() < 1e-9);
        assert_eq!(charge(30, 0, 32), whole(30));
        // 10 of the 30 still wait for their first token: they are ahead in the prefill queue
        // and are charged whatever the occupancy.
        assert_eq!(charge(30, 10, 256), whole(10));
        assert!(charge(30, 10, 256) > 0.0);
        // With the waiver off, prefill_cost's charge.
        let mut off = fresh();
        off.set_knobs(&serde_json::json!({"decode_occupancy_full": 0.0})).expect("knob");
        let mut w = WorkerView::idle(WorkerId(0));
        w.in_flight = 30;
        assert_eq!(off.decode_charge(&w, 30.0), whole(30));
    }

    #[test]
    fn a_removed_worker_forgets_its_profile() {
        let mut p = fresh();
        let pred = TtftPrediction { secs: 0.5, uncalibrated_secs: 0.5, context_secs: 0.0 };
        let (w, o) = seen(3, pred, 1.0);
        p.observe(w, &o);
        assert!(p.profile(WorkerId(3)).is_some());
        p.on_worker_removed(WorkerId(3));
        assert!(p.profile(WorkerId(3)).is_none());
        assert_eq!(p.calibration()["workers"].as_array().map(Vec::len), Some(0));
    }
}
