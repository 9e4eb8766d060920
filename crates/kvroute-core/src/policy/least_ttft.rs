//! `least_ttft`: kvroute's default policy — route to the worker where the request's
//! **predicted time to first token** is least, counting also the delay its own uncached
//! prefill adds for the requests queued behind it, with each worker's profile **calibrated
//! online** from what its requests really met.
//!
//! ```text
//! work(w)      = pending_prefill_tokens(w) + uncached(req, w) + decode_weight × load(w) × (1 + load(w) / decode_queue_scale)
//! ttft(w)      = scale(w) × work(w) / prefill_tokens_per_sec                      (seconds)
//! score(w)     = ttft(w) + scale(w) × uncached(req, w) × (miss_weight − 1 + stall(w)) / prefill_tokens_per_sec
//! uncached(req, w) = input − hit_ratio(w) × cached(req, w)
//! ```
//!
//! - **The prediction.** TTFT on a continuous-batching engine is the prefill work queued
//!   ahead of the request, plus its own uncached prefill, plus the time the running
//!   requests' decode steps take from both, over the worker's prefill throughput. The
//!   queued work and the running requests come from the router's ledger
//!   ([`WorkerView::pending_prefill_tokens`], [`WorkerView::load`]); `cached(req, w)` is
//!   the engine's own count when the worker publishes KV events
//!   ([`WorkerView::cached_tokens`]), else the router's LRU block set sized like the
//!   engine's cache (the same estimate as `prefill_cost`).
//! - **The ranking** adds to the request's own TTFT what its miss costs the others: a
//!   prefill that finds nothing cached is paid again by every request that queues behind it
//!   and, with chunked prefill, stalls the steps of the requests already running (see
//!   [`crate::policy::prefill_cost`] for `miss_weight` and `stall(w)`, and why a greedy
//!   own-TTFT choice spreads prompts away from their caches exactly when capacity is
//!   scarce). Before any calibration, with `scale = hit_ratio = 1` on every worker, the
//!   ranking is `prefill_cost`'s exactly (the same cost divided by one throughput).
//! - **Calibration (closed loop).** Each worker has a profile: `scale(w)`, the ratio of its
//!   measured TTFT to the uncalibrated prediction (a geometric moving average of
//!   `measured / predicted`, so a worker twice as slow as the prior converges to 2), and
//!   `hit_ratio(w)`, the share of the cached tokens the router predicted that the engine
//!   reported really cached (`usage.prompt_tokens_details.cached_tokens`, llama.cpp
//!   `timings.cache_n`, SGLang `meta_info.cached_tokens`), in `[0, 1]`. The front end
//!   hands each request's prediction back with what it measured ([`Policy::observe`]) and
//!   exports the prediction errors per worker; the policy works on the ledger alone (no
//!   observations: the prior) and better with engine signals. A worker not yet observed
//!   takes the mean scale of the observed ones, so a new worker in a fleet of slow ones
//!   does not look fast. The first observations are averaged (weight `1/n`), later ones
//!   weigh `calibration_rate`.
//!
//! Heterogeneous fleets are where calibration decides: a worker half as fast (an A100
//! among H100s, a llama.cpp worker with fewer threads) gets `scale` ≈ 2 and half the
//! prefill; a worker whose cache keeps less than the router believes (an engine with a
//! smaller KV cache, llama.cpp slots that swap prompts) gets `hit_ratio` < 1 and its
//! predicted hits discounted. docs/replay.md's scoreboard measures it against the seed
//! policies on six workload families.
//!
//! | knob | default | unit |
//! |---|---|---|
//! | every `prefill_cost` knob | as there | — |
//! | `prefill_tokens_per_sec` | 20,000 | prior prefill throughput per worker (Llama-3.1-8B on an H100, the simulator's `h100-llama3-8b`) |
//! | `calibration_rate` | 0.05 | weight of a new observation in a worker's profile once it has `1 / calibration_rate` of them (0: no calibration) |
//! | `calibrate_hits` | true | learn `hit_ratio(w)` from engine-reported cached tokens |
//! | `max_scale` | 1,000 | bound of `scale(w)`, both ways (`[1/max_scale, max_scale]`) |

use crate::policy::prefill_cost::{Match, PrefillCost, PrefillCostConfig};
use crate::policy::util::{mean_load, rotate};
use crate::policy::{
    Branch, Decision, KnobError, Observation, PickCtx, Policy, RequestKey, RouteError, TtftPrediction,
    patch_knobs,
};
use crate::types::{Nanos, RequestView, WorkerId, WorkerView};
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;
use std::collections::HashMap;

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
}

impl Default for LeastTtftConfig {
    fn default() -> Self {
        LeastTtftConfig { prefill_tokens_per_sec: 20_000.0, calibration_rate: 0.05, calibrate_hits: true, max_scale: 1000.0 }
    }
}

/// Names of `least_ttft`'s own knobs (the others are `prefill_cost`'s).
const OWN_KNOBS: [&str; 4] = ["prefill_tokens_per_sec", "calibration_rate", "calibrate_hits", "max_scale"];

fn validate(c: &LeastTtftConfig) -> Result<(), String> {
    if !(c.prefill_tokens_per_sec.is_finite() && c.prefill_tokens_per_sec > 0.0) {
        return Err(format!("prefill_tokens_per_sec must be a finite number > 0, got {}", c.prefill_tokens_per_sec));
    }
    if !(0.0..=1.0).contains(&c.calibration_rate) {
        return Err(format!("calibration_rate must be in [0, 1], got {}", c.calibration_rate));
    }
    if !(c.max_scale.is_finite() && c.max_scale >= 1.0) {
        return Err(format!("max_scale must be a finite number >= 1, got {}", c.max_scale));
    }
    Ok(())
}

/// Predictions shorter than this (seconds, uncalibrated) do not calibrate the TTFT scale:
/// their measured TTFT is mostly fixed costs (a decode step, the network) the model leaves
/// out, and their ratio would say nothing about the worker's throughput.
const MIN_CALIBRATION_SECS: f64 = 1e-3;

/// What `least_ttft` has learned about one worker.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct WorkerProfile {
    /// Natural log of the TTFT scale (measured / uncalibrated prediction).
    pub ln_scale: f64,
    /// TTFT observations that calibrated `ln_scale`.
    pub ttft_samples: u64,
    /// Share of predicted cached tokens the engine reported cached, in [0, 1].
    pub hit_ratio: f64,
    /// Observations that calibrated `hit_ratio`.
    pub hit_samples: u64,
}

impl Default for WorkerProfile {
    fn default() -> Self {
        WorkerProfile { ln_scale: 0.0, ttft_samples: 0, hit_ratio: 1.0, hit_samples: 0 }
    }
}

/// The `least_ttft` policy. See the module docs.
#[derive(Debug)]
pub struct LeastTtft {
    cfg: LeastTtftConfig,
    /// `prefill_cost`'s state and cost terms: the LRU block sets, sessions and rotation.
    cost: PrefillCost,
    profiles: HashMap<WorkerId, WorkerProfile>,
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
        LeastTtft { cfg, cost: PrefillCost::new(cost), profiles: HashMap::new() }
    }

    /// The learned profile of `worker` (`None` before its first observation).
    pub fn profile(&self, worker: WorkerId) -> Option<WorkerProfile> {
        self.profiles.get(&worker).copied()
    }

    /// Mean `ln_scale` of the workers with TTFT observations (0 when none has any): the
    /// prior of a worker not observed yet.
    fn fleet_ln_scale(&self) -> f64 {
        let (n, sum) = self
            .profiles
            .values()
            .filter(|p| p.ttft_samples > 0)
            .fold((0u32, 0.0), |(n, s), p| (n + 1, s + p.ln_scale));
        if n == 0 { 0.0 } else { sum / f64::from(n) }
    }

    fn terms(&self, w: &WorkerView, key: &RequestKey, input: u64, stall: f64, fleet_ln: f64) -> Candidate {
        let c = &self.cost.cfg;
        let (cached, hit) = self.cost.cached(w, key, input);
        let profile = self.profiles.get(&w.id);
        let ln_scale = profile.filter(|p| p.ttft_samples > 0).map_or(fleet_ln, |p| p.ln_scale);
        let hit_ratio =
            if self.cfg.calibrate_hits { profile.filter(|p| p.hit_samples > 0).map_or(1.0, |p| p.hit_ratio) } else { 1.0 };
        let own = input as f64 - cached as f64 * hit_ratio;
        let load = f64::from(w.load());
        let crowding = if c.decode_queue_scale > 0.0 { 1.0 + load / c.decode_queue_scale } else { 1.0 };
        let decode = c.decode_weight as f64 * load * crowding;
        let pending = w.pending_prefill_tokens as f64;
        let per_token = c.miss_weight + (stall * load).min(c.stall_cap);
        let charged = (pending + own * per_token + decode) * (1.0 + c.batch_factor * load);
        let tps = self.cfg.prefill_tokens_per_sec;
        let scale = ln_scale.exp();
        let uncalibrated_secs = (pending + own + decode) / tps;
        Candidate {
            id: w.id,
            cached,
            hit,
            score: scale * charged / tps,
            prediction: TtftPrediction { secs: scale * uncalibrated_secs, uncalibrated_secs },
        }
    }
}

/// `a` and `b` equal within a relative 1e-9 (scores of identical workers).
fn tied(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1e-12)
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
        _: &mut PickCtx<'_>,
    ) -> Result<Decision, RouteError> {
        let input = u64::from(req.input_tokens);
        let stall = self.cost.stall_weight(c);
        let fleet_ln = self.fleet_ln_scale();
        let cc = &self.cost.cfg;
        if cc.session_affinity
            && let Some(sid) = req.session_id
            && let Some(bound) = self.cost.sessions.get(sid)
            && let Some(a) = c.iter().find(|w| w.id == bound && w.is_routable())
        {
            let mean = mean_load(c).unwrap_or(0.0).max(1.0);
            let t = self.terms(a, key, input, stall, fleet_ln);
            if t.cached * 2 > input && f64::from(a.load()) <= mean * cc.overload_factor {
                let mut d = Decision::new(a.id, Branch::Sticky).with_match(t.hit.0, t.hit.1, t.hit.2).with_score(t.score);
                d.predicted_ttft = Some(t.prediction);
                return Ok(d);
            }
        }
        let mut best: Option<Candidate> = None;
        let mut ties: SmallVec<[Candidate; 8]> = SmallVec::new();
        for w in c.iter().filter(|w| w.is_routable()) {
            let t = self.terms(w, key, input, stall, fleet_ln);
            match &best {
                Some(b) if tied(t.score, b.score) && t.cached == b.cached => ties.push(t),
                Some(b) if t.score > b.score || (tied(t.score, b.score) && t.cached < b.cached) => {}
                _ => {
                    ties.clear();
                    best = Some(t);
                }
            }
        }
        let best = best.ok_or(RouteError::NoWorker)?;
        let branch = if ties.is_empty() { Branch::Score } else { Branch::TieBreak };
        ties.insert(0, best);
        let ids: SmallVec<[WorkerId; 8]> = ties.iter().map(|t| t.id).collect();
        let w = rotate(&ids, &self.cost.rotation).ok_or(RouteError::NoWorker)?;
        let t = ties.iter().find(|t| t.id == w).unwrap_or(&ties[0]);
        let mut d = Decision::new(t.id, branch).with_match(t.hit.0, t.hit.1, t.hit.2).with_score(t.score);
        d.predicted_ttft = Some(t.prediction);
        Ok(d)
    }

    fn on_routed(&mut self, req: &RequestView<'_>, key: &RequestKey, worker: WorkerId, now: Nanos) {
        self.cost.on_routed(req, key, worker, now);
    }

    fn on_worker_removed(&mut self, worker: WorkerId) {
        self.cost.on_worker_removed(worker);
        self.profiles.remove(&worker);
    }

    fn observe(&mut self, worker: WorkerId, obs: &Observation) {
        let rate = self.cfg.calibration_rate;
        if rate == 0.0 {
            return;
        }
        let fleet_ln = self.fleet_ln_scale();
        let bound = self.cfg.max_scale.ln();
        let calibrate_hits = self.cfg.calibrate_hits;
        let p = self.profiles.entry(worker).or_insert(WorkerProfile { ln_scale: fleet_ln, ..WorkerProfile::default() });
        if let (Some(pred), Some(t)) = (obs.predicted, obs.ttft_secs)
            && pred.uncalibrated_secs.is_finite()
            && pred.uncalibrated_secs >= MIN_CALIBRATION_SECS
            && t.is_finite()
            && t > 0.0
        {
            let target = (t / pred.uncalibrated_secs).ln().clamp(-bound, bound);
            p.ttft_samples += 1;
            let a = rate.max(1.0 / p.ttft_samples as f64);
            p.ln_scale += a * (target - p.ln_scale);
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
    }

    fn calibration(&self) -> serde_json::Value {
        let mut workers: Vec<(u32, serde_json::Value)> = self
            .profiles
            .iter()
            .map(|(id, p)| {
                let v = serde_json::json!({
                    "worker": id.0,
                    "ttft_scale": p.ln_scale.exp(),
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
    use crate::types::{BlockHash, BlockSeq};
    use rand_core::SeedableRng;

    fn req(blocks: &[BlockHash]) -> RequestView<'_> {
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

    fn go(p: &mut dyn Policy, r: &RequestView<'_>, c: &[WorkerView]) -> Decision {
        let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(0);
        let mut ctx = PickCtx { now: Nanos::ZERO, rng: &mut rng };
        crate::policy::route(p, r, c, &mut ctx).expect("route")
    }

    /// A decision without its commit.
    fn peek(p: &dyn Policy, r: &RequestView<'_>, c: &[WorkerView]) -> Decision {
        let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(0);
        let mut ctx = PickCtx { now: Nanos::ZERO, rng: &mut rng };
        crate::policy::decide(p, r, c, &mut ctx).expect("decide").0
    }

    fn fresh() -> LeastTtft {
        LeastTtft::new(LeastTtftConfig::default(), PrefillCostConfig::default())
    }

    fn seen(worker: u32, predicted: TtftPrediction, ttft: f64) -> (WorkerId, Observation) {
        let obs = Observation { input_tokens: 4096, predicted: Some(predicted), ttft_secs: Some(ttft), ..Default::default() };
        (WorkerId(worker), obs)
    }

    #[test]
    fn before_any_observation_it_ranks_exactly_as_prefill_cost() {
        // Random fleets and requests: the same worker, whenever prefill_cost's choice is not
        // a tie (ties rotate, and the two rotations need not agree).
        let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(7);
        use rand_core::Rng;
        let mut a = fresh();
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

    #[test]
    fn a_worker_measured_slower_gets_a_larger_scale_and_less_work() {
        let mut p = fresh();
        let h: Vec<BlockHash> = (0..8).map(BlockHash).collect();
        let mut c = vec![WorkerView::idle(WorkerId(0)), WorkerView::idle(WorkerId(1))];
        c[0].pending_prefill_tokens = 1000;
        // Before calibration worker 1 (2,000 tokens queued) loses to worker 0 (1,000).
        c[1].pending_prefill_tokens = 2000;
        let d = go(&mut p, &req(&h), &c);
        assert_eq!(d.worker, WorkerId(0));
        let pred = d.predicted_ttft.expect("a prediction");
        // (1,000 pending + 4,096 uncached) / 20,000 tokens/s.
        assert!((pred.secs - 5096.0 / 20_000.0).abs() < 1e-12, "{pred:?}");
        // Worker 0 is measured 4× slower than predicted, worker 1 as predicted.
        for _ in 0..50 {
            let (w, o) = seen(0, pred, 4.0 * pred.uncalibrated_secs);
            p.observe(w, &o);
            let (w, o) = seen(1, pred, pred.uncalibrated_secs);
            p.observe(w, &o);
        }
        let scale = p.profile(WorkerId(0)).expect("profile").ln_scale.exp();
        assert!((scale - 4.0).abs() < 1e-9, "scale {scale}");
        let h2: Vec<BlockHash> = (100..108).map(BlockHash).collect();
        let d = go(&mut p, &req(&h2), &c);
        assert_eq!(d.worker, WorkerId(1), "the slow worker's 1,000 queued tokens now cost 4,000");
        let pred = d.predicted_ttft.expect("a prediction");
        assert!((pred.secs - pred.uncalibrated_secs).abs() < 1e-12);
    }

    #[test]
    fn an_unobserved_worker_takes_the_fleet_scale() {
        let mut p = fresh();
        let pred = TtftPrediction { secs: 0.1, uncalibrated_secs: 0.1 };
        let (w, o) = seen(0, pred, 10.0);
        p.observe(w, &o);
        let (w, o) = seen(1, pred, 10.0);
        p.observe(w, &o);
        // Worker 2 is new, idle, with 1,000 tokens queued; the observed two (100× slower than
        // the prior) are idle with 1,500 queued. Scaled alike, the queue decides: worker 2.
        let mut c: Vec<WorkerView> = (0..3).map(|i| WorkerView::idle(WorkerId(i))).collect();
        c[0].pending_prefill_tokens = 1500;
        c[1].pending_prefill_tokens = 1500;
        c[2].pending_prefill_tokens = 1000;
        let h: Vec<BlockHash> = (0..2).map(BlockHash).collect();
        let d = go(&mut p, &req(&h), &c);
        assert_eq!(d.worker, WorkerId(2));
        let secs = d.predicted_ttft.expect("prediction").secs;
        assert!((secs - 100.0 * (1000.0 + 1024.0) / 20_000.0).abs() < 1e-9, "{secs}");
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
        // The engine reports nothing cached, again and again (its slots swapped the prompt out).
        for _ in 0..40 {
            let obs = Observation { input_tokens: 4096, predicted_cached_tokens: predicted_cached, cached_tokens: Some(0), ..Default::default() };
            p.observe(WorkerId(0), &obs);
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
        let pred = TtftPrediction { secs: 0.5, uncalibrated_secs: 0.5 };
        for t in [f64::NAN, 0.0, -1.0, f64::INFINITY] {
            let (w, o) = seen(0, pred, t);
            p.observe(w, &o);
        }
        // A prediction too short to say anything about throughput.
        let tiny = TtftPrediction { secs: 1e-5, uncalibrated_secs: 1e-5 };
        let (w, o) = seen(0, tiny, 3.0);
        p.observe(w, &o);
        assert_eq!(p.profile(WorkerId(0)).expect("profile").ttft_samples, 0);
        // An absurd ratio is bounded by max_scale.
        let (w, o) = seen(1, pred, 1e9);
        p.observe(w, &o);
        let s = p.profile(WorkerId(1)).expect("profile").ln_scale.exp();
        assert!((s - 1000.0).abs() < 1e-6, "{s}");
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
        ] {
            let e = p.set_knobs(&bad).expect_err("refused");
            assert!(e.message.contains(names), "{e}");
            assert_eq!(e.policy, "least_ttft");
        }
        assert_eq!(p.knobs()["miss_weight"], 4.0, "a refused patch changes nothing");
    }

    #[test]
    fn a_removed_worker_forgets_its_profile() {
        let mut p = fresh();
        let pred = TtftPrediction { secs: 0.5, uncalibrated_secs: 0.5 };
        let (w, o) = seen(3, pred, 1.0);
        p.observe(w, &o);
        assert!(p.profile(WorkerId(3)).is_some());
        p.on_worker_removed(WorkerId(3));
        assert!(p.profile(WorkerId(3)).is_none());
        assert_eq!(p.calibration()["workers"].as_array().map(Vec::len), Some(0));
    }
}
