//! Prefill/decode (PD) disaggregation: the KV transfer model, shared by `kvroute replay
//! --pd` and `kvroute engine-sim --role prefill|decode`, and the replay of a trace onto P
//! prefill engines and D decode engines ([`replay_pd`]).
//!
//! In a disaggregated deployment (SGLang `--disaggregation-mode prefill|decode`, vLLM with
//! the NIXL connector) a long prompt's forward pass runs on a prefill engine; its KV cache
//! is then copied over the network (RDMA) to a decode engine, which generates the answer
//! without recomputing the prompt. Short prompts run colocated: the copy would cost more
//! than the prefill it saves.
//!
//! The transfer model and the settings live in [`crate::types`] (shared with the colocated
//! replay); they are re-exported here.

use crate::engine::{Engine, EngineEvent, EngineRequest, InvalidSetting};
use crate::trace::TraceRequest;
use crate::types::{
    BusyWindow, Maintenance, Outcome, PrefixState, ReplayConfig, ReplayError, ReplayResult, RouterView, request_view,
};
pub use crate::types::{
    DEFAULT_COLOCATE_BELOW_TOKENS, DEFAULT_KV_BYTES_PER_TOKEN, DEFAULT_LINK_GBYTES_PER_S, PdConfig, TransferModel,
};
use kvroute_core::disagg::{DisaggConfig, DisaggPlan, plan};
use kvroute_core::ledger::{LoadLedger, Ticket};
use kvroute_core::policy::{PickCtx, Policy, route};
use kvroute_core::precise::PredictWindow;
use kvroute_core::registry;
use kvroute_core::types::{Nanos, Role, WorkerId, WorkerView};
use rand_core::SeedableRng;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Replays `trace` onto `pd.prefill_engines` prefill engines and `pd.decode_engines` decode
/// engines (`cfg.engines` must be their sum; `cfg.policy` with `cfg.knobs` is the prefill
/// policy). `progress` is called as by [`crate::replay::replay`].
///
/// For each request, in arrival order, every engine and every KV transfer due is run up to
/// the arrival in time order (a discrete-event loop over the engines' next steps and the
/// transfers' completion times). Then, as the gateway plans it
/// ([`kvroute_core::disagg::plan`]):
/// - a prompt of more than `colocate_below_tokens` tokens is **split**: the prefill policy
///   picks a prefill engine (views of engines `0..P`, role prefill) and the decode policy a
///   decode engine (views of engines `P..P+D`, role decode), **both at routing time** — as
///   the gateway does (SGLang's router sends the request to both at once; vLLM's proxy
///   picks both before sending). The prefill engine runs the prompt with one output token;
///   when that token is produced the KV copy starts, and after
///   [`TransferModel::delay`] of the prompt's tokens the request is submitted to the decode
///   engine with [`EngineRequest::kv_transferred`] (no prefill work there). Its TTFT is the
///   decode engine's first token minus arrival, its TPOT the decode engine's; its
///   `cached_tokens` is the prefill engine's prefix hit.
/// - shorter prompts run **colocated** on a decode engine picked by the decode policy.
///
/// The router's ledger sees a split request as two tickets: the prefill engine's
/// (uncached prompt tokens, one output token) and the decode engine's (no prefill, the
/// output), both opened at routing time. With [`PrefixState::Precise`] the prediction
/// window is kept for the engine that computes the prompt (the prefill engine, or the
/// decode engine of a colocated request).
///
/// # Errors
/// [`ReplayError`] for an unknown policy, bad knobs, bad PD settings, or `cfg.engines`
/// other than P + D.
pub fn replay_pd(
    trace: &[TraceRequest],
    cfg: &ReplayConfig,
    pd: &PdConfig,
    progress: &mut dyn FnMut(usize),
) -> Result<ReplayResult, ReplayError> {
    check_config(cfg, pd)?;
    let mut routers = Routers::new(cfg, pd)?;
    let disagg = disagg_config(pd.colocate_below_tokens);
    let mut sim = Sim::new(trace, cfg, pd);
    let (p, n) = (pd.prefill_engines, cfg.engines);
    let mut events = Vec::new();
    let mut prefill_views: Vec<WorkerView> = Vec::with_capacity(p);
    let mut decode_views: Vec<WorkerView> = Vec::with_capacity(n - p);
    for (i, r) in trace.iter().enumerate() {
        let now = r.arrival;
        sim.run_until(now, &mut events);
        routers.prefill_maintenance.run(routers.prefill.as_mut(), now);
        routers.decode_maintenance.run(routers.decode.as_mut(), now);
        let split = plan(&disagg, r.input_tokens, true, true) == DisaggPlan::Split;
        sim.views(&mut prefill_views, 0..p, Role::Prefill, r, now);
        sim.views(&mut decode_views, p..n, Role::Decode, r, now);
        let placed = if split {
            sim.place_split(i, &mut routers, &prefill_views, &decode_views, &mut events)
        } else {
            sim.place_colocated(i, &mut routers, &decode_views, &mut events)
        };
        if !placed {
            sim.outcomes[i].rejected = true;
            continue;
        }
        if i % 256 == 255 {
            progress(i + 1);
        }
    }
    sim.run_until(Nanos(u64::MAX), &mut events);
    progress(trace.len());
    Ok(ReplayResult {
        policy: cfg.policy.clone(),
        busy_ns: sim.engines.iter().map(|e| e.stats().busy_ns).collect(),
        evictions: sim.engines.iter().map(|e| e.cache().evictions()).collect(),
        outcomes: sim.outcomes,
        pd: Some(pd.clone()),
        kv_migration: None,
        kv_pull: None,
    })
}

/// The settings a PD replay cannot run with: bad PD settings, `cfg.engines` other than
/// P + D, a bad profile.
fn check_config(cfg: &ReplayConfig, pd: &PdConfig) -> Result<(), ReplayError> {
    pd.validate().map_err(ReplayError::Config)?;
    let n = pd.prefill_engines + pd.decode_engines;
    if cfg.engines != n {
        return Err(ReplayError::Config(InvalidSetting::new(
            "engines",
            format!("{} engines given but --pd {}:{} needs {n}", cfg.engines, pd.prefill_engines, pd.decode_engines),
        )));
    }
    cfg.profile.validate().map_err(ReplayError::Config)
}

/// The two routers of a PD replay (prefill and decode policies, each with its maintenance
/// clock) and their shared random source.
struct Routers {
    prefill: Box<dyn Policy>,
    decode: Box<dyn Policy>,
    prefill_maintenance: Maintenance,
    decode_maintenance: Maintenance,
    rng: rand_xoshiro::Xoshiro256PlusPlus,
}

impl Routers {
    /// `cfg.policy` with its knobs for prefills, `pd.decode_policy` with default knobs for
    /// decodes.
    fn new(cfg: &ReplayConfig, pd: &PdConfig) -> Result<Routers, ReplayError> {
        let prefill: Box<dyn Policy> = registry::build(&cfg.policy, &cfg.knobs)?;
        let decode: Box<dyn Policy> = registry::build(&pd.decode_policy, &serde_json::Value::Null)?;
        Ok(Routers {
            prefill_maintenance: Maintenance::new(prefill.as_ref()),
            decode_maintenance: Maintenance::new(decode.as_ref()),
            prefill,
            decode,
            rng: rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(cfg.seed),
        })
    }
}

/// The gateway's disaggregation config, enabled with `colocate_below_tokens`, field by field
/// (so fields added to it keep their defaults).
#[allow(clippy::field_reassign_with_default)]
fn disagg_config(colocate_below_tokens: u32) -> DisaggConfig {
    let mut c = DisaggConfig::default();
    c.enabled = true;
    c.colocate_below_tokens = colocate_below_tokens;
    c
}

/// What an engine is asked to do with a request.
#[derive(Debug, Clone, Copy)]
enum Phase {
    /// Prefill only, for a decode engine elsewhere: one output token.
    Prefill,
    /// The whole request on one engine.
    Colocated,
    /// Decode, its KV copied from the prefill engine.
    Decode,
}

/// The state of one PD replay.
struct Sim<'t> {
    trace: &'t [TraceRequest],
    cfg: &'t ReplayConfig,
    /// What the router's SM-utilisation signal has seen of each engine.
    util: Vec<BusyWindow>,
    prefill_engines: usize,
    transfer: TransferModel,
    engines: Vec<Engine>,
    ledger: LoadLedger,
    prefill_tickets: Vec<Option<Ticket>>,
    decode_tickets: Vec<Option<Ticket>>,
    outcomes: Vec<Outcome>,
    /// KV transfers in flight: (completion time, request index), earliest first.
    transfers: BinaryHeap<Reverse<(Nanos, usize)>>,
    predicted: PredictWindow,
}

impl<'t> Sim<'t> {
    /// The state of a PD replay of `trace` before its first arrival.
    fn new(trace: &'t [TraceRequest], cfg: &'t ReplayConfig, pd: &PdConfig) -> Self {
        let n = cfg.engines;
        Sim {
            trace,
            cfg,
            util: (0..n).map(|_| BusyWindow::default()).collect(),
            prefill_engines: pd.prefill_engines,
            transfer: pd.transfer,
            engines: (0..n).map(|_| Engine::new(cfg.profile.clone(), cfg.max_waiting)).collect(),
            ledger: LoadLedger::new(),
            prefill_tickets: (0..trace.len()).map(|_| None).collect(),
            decode_tickets: (0..trace.len()).map(|_| None).collect(),
            outcomes: trace.iter().map(Outcome::pending).collect(),
            transfers: BinaryHeap::new(),
            predicted: match cfg.prefix_state {
                PrefixState::Precise { predict_window } => PredictWindow::new(predict_window, 1 << 22),
                PrefixState::Approximate => PredictWindow::new(Nanos(0), 1),
            },
        }
    }

    /// Fills `out` with the router's views of `engines` (global ids) for request `r`.
    fn views(
        &mut self,
        out: &mut Vec<WorkerView>,
        engines: std::ops::Range<usize>,
        role: Role,
        r: &TraceRequest,
        now: Nanos,
    ) {
        out.clear();
        let view = RouterView { ledger: &self.ledger, predicted: &self.predicted, cfg: self.cfg, now };
        for w in engines {
            out.push(view.of(w, role, &self.engines[w], &mut self.util[w], r));
        }
    }

    /// Routes request `i` split: a prefill engine and a decode engine, both at routing
    /// time; the prefill submitted (one output token). `false` when either router finds
    /// no engine.
    fn place_split(
        &mut self,
        i: usize,
        routers: &mut Routers,
        prefill_views: &[WorkerView],
        decode_views: &[WorkerView],
        events: &mut Vec<EngineEvent>,
    ) -> bool {
        let trace = self.trace;
        let (r, now) = (&trace[i], trace[i].arrival);
        let mut req = request_view(r, Role::Prefill);
        let mut ctx = PickCtx { now, rng: &mut routers.rng, fleet: None };
        let Ok(pre) = route(routers.prefill.as_mut(), &req, prefill_views, &mut ctx) else { return false };
        req.role = Role::Decode;
        let mut ctx = PickCtx { now, rng: &mut routers.rng, fleet: None };
        let Ok(dec) = route(routers.decode.as_mut(), &req, decode_views, &mut ctx) else { return false };
        self.predicted.predict(pre.worker, &r.blocks, now, Nanos(u64::MAX));
        let est = pre.cached_tokens_estimate(r.input_tokens);
        self.prefill_tickets[i] = Some(self.ledger.dispatched(pre.worker, u64::from(r.input_tokens) - est, 1));
        self.decode_tickets[i] = Some(self.ledger.dispatched(dec.worker, 0, u64::from(r.output_tokens)));
        let o = &mut self.outcomes[i];
        o.worker = Some(dec.worker.0);
        o.prefill_worker = Some(pre.worker.0);
        o.branch = pre.branch.as_str();
        self.submit(pre.worker.index(), i, now, Phase::Prefill, events);
        true
    }

    /// Routes request `i` colocated on a decode engine and submits it. `false` when the
    /// decode router finds no engine.
    fn place_colocated(
        &mut self,
        i: usize,
        routers: &mut Routers,
        decode_views: &[WorkerView],
        events: &mut Vec<EngineEvent>,
    ) -> bool {
        let trace = self.trace;
        let (r, now) = (&trace[i], trace[i].arrival);
        let req = request_view(r, Role::Both);
        let mut ctx = PickCtx { now, rng: &mut routers.rng, fleet: None };
        let Ok(d) = route(routers.decode.as_mut(), &req, decode_views, &mut ctx) else { return false };
        self.predicted.predict(d.worker, &r.blocks, now, Nanos(u64::MAX));
        let est = d.cached_tokens_estimate(r.input_tokens);
        self.decode_tickets[i] =
            Some(self.ledger.dispatched(d.worker, u64::from(r.input_tokens) - est, u64::from(r.output_tokens)));
        let o = &mut self.outcomes[i];
        o.worker = Some(d.worker.0);
        o.branch = d.branch.as_str();
        self.submit(d.worker.index(), i, now, Phase::Colocated, events);
        true
    }

    /// Submits request `i` to engine `k` at `now` for `phase` (the engine must have run up
    /// to `now`).
    fn submit(&mut self, k: usize, i: usize, now: Nanos, phase: Phase, events: &mut Vec<EngineEvent>) {
        let r = &self.trace[i];
        let (output_tokens, kv_transferred) = match phase {
            Phase::Prefill => (1, false),
            Phase::Colocated => (r.output_tokens, false),
            Phase::Decode => (r.output_tokens, true),
        };
        let req = EngineRequest {
            id: i as u64,
            input_tokens: r.input_tokens,
            output_tokens,
            blocks: r.blocks.clone(),
            block_tokens: r.block_tokens,
            token_ids: None,
            kv_transferred,
            slot: None,
            restore: None,
        };
        self.engines[k].submit(req, now, events);
        self.handle(k, events);
    }

    /// Runs every engine step and every KV transfer that completes at or before `target`,
    /// in time order (an engine's steps before a transfer due at the same instant).
    fn run_until(&mut self, target: Nanos, events: &mut Vec<EngineEvent>) {
        loop {
            let step = (0..self.engines.len())
                .filter_map(|k| self.engines[k].next_event_time().map(|t| (t, k)))
                .filter(|(t, _)| *t <= target)
                .min();
            let transfer = self.transfers.peek().map(|Reverse(x)| *x).filter(|(t, _)| *t <= target);
            let step = match (step, transfer) {
                (None, None) => break,
                (Some(s), Some((tt, _))) if s.0 <= tt => Some(s),
                (Some(s), None) => Some(s),
                (_, Some(_)) => None,
            };
            if let Some((t, k)) = step {
                self.engines[k].advance(t, events);
                self.handle(k, events);
            } else if let Some(Reverse((t, i))) = self.transfers.pop() {
                // The KV of request `i` has arrived at its decode engine.
                let Some(k) = self.outcomes[i].worker.map(|w| w as usize) else { continue };
                self.engines[k].advance(t, events);
                self.handle(k, events);
                self.submit(k, i, t, Phase::Decode, events);
            }
        }
    }

    /// Settles request `i`'s prediction on engine `k` once its prompt is computed (or never
    /// will be): it then lasts the predict window only.
    fn settle(&mut self, k: usize, i: usize, at: Nanos) {
        let until = at.saturating_add(self.predicted.window());
        self.predicted.predict(WorkerId(k as u32), &self.trace[i].blocks, at, until);
    }

    /// Applies the events of engine `k`.
    fn handle(&mut self, k: usize, events: &mut Vec<EngineEvent>) {
        let prefill = k < self.prefill_engines;
        for ev in events.drain(..) {
            match ev {
                EngineEvent::FirstToken { id, at, cached_tokens } => {
                    let i = id as usize;
                    let split = self.outcomes[i].prefill_worker.is_some();
                    if prefill {
                        // The prefill is over: the KV copy to the decode engine starts.
                        self.settle(k, i, at);
                        let tokens = u64::from(self.trace[i].input_tokens);
                        let o = &mut self.outcomes[i];
                        o.cached_tokens = cached_tokens;
                        o.transfer_bytes = self.transfer.bytes(tokens);
                        self.transfers.push(Reverse((at.saturating_add(self.transfer.delay(tokens)), i)));
                        if let Some(t) = self.prefill_tickets[i].as_mut() {
                            self.ledger.first_token(t);
                        }
                    } else {
                        if !split {
                            self.settle(k, i, at);
                            self.outcomes[i].cached_tokens = cached_tokens;
                        }
                        self.outcomes[i].first_token = Some(at);
                        if let Some(t) = self.decode_tickets[i].as_mut() {
                            self.ledger.first_token(t);
                        }
                    }
                }
                EngineEvent::Finished { id, at } => {
                    let i = id as usize;
                    if prefill {
                        if let Some(t) = self.prefill_tickets[i].take() {
                            self.ledger.completed(t);
                        }
                    } else {
                        self.outcomes[i].finished = Some(at);
                        if let Some(t) = self.decode_tickets[i].take() {
                            self.ledger.completed(t);
                        }
                    }
                }
                EngineEvent::Rejected { id, at } => {
                    let i = id as usize;
                    if prefill || self.outcomes[i].prefill_worker.is_none() {
                        self.settle(k, i, at);
                    }
                    self.outcomes[i].rejected = true;
                    for t in [self.prefill_tickets[i].take(), self.decode_tickets[i].take()].into_iter().flatten() {
                        self.ledger.failed(t);
                    }
                }
                // No slot files in a disaggregated replay.
                EngineEvent::SlotRestored { .. } | EngineEvent::SlotSaved { .. } => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transfer_delay_is_latency_plus_bytes_over_bandwidth() {
        let m = TransferModel::default();
        // 8192 tokens × 128 KiB = 1 GiB over 25 GB/s ≈ 42.9 ms.
        assert_eq!(m.bytes(8192), 1 << 30);
        assert_eq!(m.delay(8192), Nanos::from_secs_f64((1u64 << 30) as f64 / 25e9));
        let m = TransferModel { kv_bytes_per_token: 1000, link_gbytes_per_s: 1.0, latency_secs: 0.5 };
        assert_eq!(m.delay(1_000_000), Nanos::from_secs_f64(1.5));
        assert_eq!(m.delay(0), Nanos::from_secs_f64(0.5));
    }

    #[test]
    fn transfer_knobs_are_validated() {
        assert!(TransferModel::default().validate().is_ok());
        for (m, field) in [
            (TransferModel { kv_bytes_per_token: 0, ..Default::default() }, "kv_bytes_per_token"),
            (TransferModel { link_gbytes_per_s: 0.0, ..Default::default() }, "link_gbytes_per_s"),
            (TransferModel { link_gbytes_per_s: f64::NAN, ..Default::default() }, "link_gbytes_per_s"),
            (TransferModel { latency_secs: -1.0, ..Default::default() }, "latency_secs"),
            (TransferModel { latency_secs: f64::INFINITY, ..Default::default() }, "latency_secs"),
            // 2e10 s overflowed the clock and printed a mean TTFT of 6 ms.
            (TransferModel { latency_secs: 2e10, ..Default::default() }, "latency_secs"),
        ] {
            let e = m.validate().expect_err(field).to_string();
            assert!(e.contains(field), "{e}");
        }
        assert!(PdConfig::new(0, 3).validate().is_err());
        assert!(PdConfig::new(1, 0).validate().is_err());
    }
}
