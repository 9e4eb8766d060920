//! Replays a trace through a routing policy onto N simulated engines on a logical clock.
//!
//! For each request, in arrival order: every engine is advanced to the arrival time (its
//! first tokens and completions update the router's [`LoadLedger`]); the router builds
//! worker views from its ledger and from the engines' own counters (as the gateway does
//! from `/metrics`), asks [`kvroute_core::policy::route`], and submits the request to the
//! chosen engine. The policy code is exactly the gateway's. A view that cannot depend on
//! the request (approximate prefix state, no slot routing, no KV mover) is kept between
//! arrivals and rebuilt only for the engines that ran an event, took a request or changed
//! in the ledger since, and for all once a utilisation window has passed: on 10,000 engines
//! most are untouched between two arrivals.
//!
//! With [`PrefixState::Precise`] the views also carry each engine's real cache contents for
//! the request, as a router fed by KV events sees them.
//!
//! With [`ReplayConfig::kv_migration`] (llama.cpp slots and slot routing) the router also
//! saves long prompts' slots to files when their requests end and restores the best file
//! into the slot a request is sent to when that pays ([`crate::kv_move`]); the replay then
//! steps the engines event by event, so that a save starts at the instant its request ends.
//!
//! With [`ReplayConfig::kv_pull`] (paged engines, precise prefix state) a request whose
//! engine holds less of its prompt than another engine does may first have the longer
//! prefix's KV copied over ([`crate::types::KvPull`]): it reaches its engine when the copy
//! ends, and finds the prefix cached there.

use crate::engine::{CacheEvent, Engine, EngineEvent, EngineRequest, SlotRestore};
use crate::kv_move::{Mover, slot_blocks};
use crate::trace::TraceRequest;
pub use crate::types::{
    BusyWindow, KvOracle, KvPull, KvPullCounts, Outcome, PrefixState, ReplayConfig, ReplayError, ReplayResult,
    UTIL_WINDOW, request_view,
};
use crate::types::{Maintenance, RouterView};
use kvroute_core::fleet_digest::FleetDigest;
use kvroute_core::ledger::{LoadLedger, Ticket};
use kvroute_core::policy::{Decision, Observation, PickCtx, Policy, RouteError, route};
use kvroute_core::precise::PredictWindow;
use kvroute_core::registry;
use kvroute_core::slots::{SlotChoice, SlotTable};
use kvroute_core::types::{BlockHash, Nanos, Role, WorkerId, WorkerView};
use rand_core::SeedableRng;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// The router's record of each engine's llama.cpp slots with `slot_routing` (empty
/// otherwise), and the (engine, slot) each request was sent to.
struct SlotRouting {
    tables: Vec<SlotTable>,
    of: Vec<Option<(usize, u32)>>,
}

impl SlotRouting {
    fn new(cfg: &ReplayConfig, requests: usize) -> Self {
        if cfg.slot_routing && cfg.profile.slots > 0 {
            let tables = (0..cfg.engines).map(|_| SlotTable::new(cfg.profile.slots)).collect();
            SlotRouting { tables, of: vec![None; requests] }
        } else {
            SlotRouting { tables: Vec::new(), of: Vec::new() }
        }
    }

    /// The slot `r` would take on engine `w` (`None` without slot routing), an idle slot
    /// counting as holding the first `restorable` blocks (a saved prefix the KV mover would
    /// restore there; 0 without it).
    fn choose(&self, w: usize, r: &TraceRequest, restorable: usize) -> Option<SlotChoice> {
        Some(self.tables.get(w)?.choose_with_restore(slot_blocks(r), r.block_tokens, r.input_tokens, restorable))
    }

    /// Commits request `i` (`r`) to the slot `c` on engine `w` at `now`.
    fn start(&mut self, w: usize, i: usize, r: &TraceRequest, c: SlotChoice, now: Nanos) {
        if let Some(t) = self.tables.get_mut(w) {
            t.start(c.slot, slot_blocks(r), now);
            self.of[i] = Some((w, c.slot));
        }
    }

    /// Request `id` ended (finished or rejected) at `at`: its slot is free in the record.
    /// Returns the (engine, slot) it was on.
    fn finish(&mut self, id: u64, at: Nanos) -> Option<(usize, u32)> {
        let (w, k) = self.of.get_mut(id as usize).and_then(Option::take)?;
        self.tables[w].finish(k, at);
        Some((w, k))
    }
}

/// The engines' clock when they share a host's CPU cores ([`ReplayConfig::host_cores`],
/// [`ReplayConfig::host_slowdown`]).
///
/// Every busy engine runs at the same rate, `min(1, cores / busy engines)` or the inverse of
/// the measured slow-down at that many busy engines, so the engines
/// keep one *virtual* clock (work done at full speed) and their own timings are unchanged;
/// this maps it to the replay's real clock, piecewise linearly, with a new piece whenever
/// the number of busy engines changes. With `cores` 0 both clocks are the same.
#[derive(Debug, Clone)]
struct HostClock {
    cores: u32,
    /// [`ReplayConfig::host_slowdown`].
    slowdown: Vec<f64>,
    /// The last change: real time and virtual time then.
    real: Nanos,
    virt: Nanos,
    /// Virtual nanoseconds per real nanosecond since then, in (0, 1].
    rate: f64,
}

impl HostClock {
    fn new(cores: u32, slowdown: &[f64]) -> Self {
        HostClock { cores, slowdown: slowdown.to_vec(), real: Nanos(0), virt: Nanos(0), rate: 1.0 }
    }

    /// The engines share cores (`cores` > 0 or a measured slow-down).
    fn shared(&self) -> bool {
        self.cores > 0 || !self.slowdown.is_empty()
    }

    /// Each busy engine's speed, in (0, 1], while `busy` (≥ 1) engines are busy.
    fn rate_at(&self, busy: usize) -> f64 {
        let slow = match self.slowdown.last() {
            Some(&last) if busy > self.slowdown.len() => last * busy as f64 / self.slowdown.len() as f64,
            Some(_) => self.slowdown[busy - 1],
            None => busy as f64 / f64::from(self.cores),
        };
        (1.0 / slow).min(1.0)
    }

    /// Virtual time at real time `t` (not before the last change).
    fn virtual_at(&self, t: Nanos) -> Nanos {
        if !self.shared() {
            return t;
        }
        let d = t.0.saturating_sub(self.real.0);
        Nanos(self.virt.0.saturating_add(if self.rate >= 1.0 { d } else { (d as f64 * self.rate) as u64 }))
    }

    /// Real time at virtual time `v` (a time before the last change maps to it).
    fn real_at(&self, v: Nanos) -> Nanos {
        if !self.shared() {
            return v;
        }
        let d = v.0.saturating_sub(self.virt.0);
        Nanos(self.real.0.saturating_add(if self.rate >= 1.0 { d } else { (d as f64 / self.rate).ceil() as u64 }))
    }

    /// Makes the events' times real.
    fn make_real(&self, events: &mut [EngineEvent]) {
        for ev in events {
            let real = self.real_at(ev.at());
            *ev.at_mut() = real;
        }
    }

    /// A new piece from real time `t`, at the rate of the engines busy now.
    fn resync(&mut self, t: Nanos, engines: &[Engine]) {
        if !self.shared() {
            return;
        }
        self.virt = self.virtual_at(t);
        self.real = t;
        let busy = engines.iter().filter(|e| e.next_event_time().is_some()).count().max(1);
        self.rate = self.rate_at(busy);
    }

    /// Advances every engine through all its events up to real time `now` (events' times
    /// made real) and starts a piece there. Independent engines advance one by one, as
    /// before sharing was modelled; shared ones in the order of their events.
    /// Each engine with an event to run is marked in `moved`.
    fn advance(&mut self, engines: &mut [Engine], now: Nanos, events: &mut Vec<EngineEvent>, moved: &mut Moved) {
        if self.shared() {
            while self.step(engines, now, true, events) {}
            self.resync(now, engines);
            moved.all();
        } else {
            for (w, e) in engines.iter_mut().enumerate() {
                if e.next_event_time().is_some_and(|t| t <= now) {
                    moved.mark(w);
                }
                e.advance(now, events);
            }
        }
    }

    /// Advances every engine through the engines' next event, when it falls at or before
    /// real time `limit` (strictly before unless `inclusive`), with the events' times made
    /// real; `false` when there is no such event.
    fn step(&mut self, engines: &mut [Engine], limit: Nanos, inclusive: bool, events: &mut Vec<EngineEvent>) -> bool {
        let Some(v) = engines.iter().filter_map(Engine::next_event_time).min() else {
            return false;
        };
        let t = self.real_at(v);
        if t > limit || (t == limit && !inclusive) {
            return false;
        }
        let first = events.len();
        for e in engines.iter_mut() {
            e.advance(v, events);
        }
        self.make_real(&mut events[first..]);
        if self.shared() {
            self.real = t;
            self.virt = v;
            self.resync(t, engines);
        }
        true
    }
}

/// The replay's record of every request: the router's ledger and predictions, the outcomes,
/// and the arrivals still to come (with `closed_sessions`, a session's next turn is released
/// only when the turn before it ends).
struct Book<'a> {
    trace: &'a [TraceRequest],
    ledger: LoadLedger,
    tickets: Vec<Option<Ticket>>,
    outcomes: Vec<Outcome>,
    predicted: PredictWindow,
    /// Each routed request's predictions (TTFT, cached tokens), handed back to the policy
    /// with what the engine reports at its first token (`Policy::observe`), as the gateway
    /// does.
    expected: Vec<Option<Observation>>,
    slots: SlotRouting,
    /// The KV mover ([`ReplayConfig::kv_migration`]).
    mover: Option<Mover>,
    /// Slot saves the mover decided on while handling events, to ask the engines for:
    /// (engine, slot, request, when).
    saves: Vec<(usize, u32, usize, Nanos)>,
    /// Released arrivals, earliest first (ties in trace order).
    arrivals: BinaryHeap<Reverse<(Nanos, usize)>>,
    /// With `closed_sessions`: the next request of each request's session.
    next_turn: Vec<Option<usize>>,
    /// Sessions waiting for a place (`session_concurrency`): each one's first request.
    queued_sessions: std::collections::VecDeque<usize>,
    /// `session_concurrency` is set: a session's next turn follows its previous one at once.
    clients: bool,
    /// Some request waits for another's end (`closed_sessions` and a session of two turns,
    /// or a session queued by `session_concurrency`).
    gated: bool,
    /// The engines' shared CPU cores (`host_cores`, `host_slowdown`).
    host: HostClock,
    /// The engines whose state or ledger entry changed since the router last read them.
    moved: Moved,
    /// Requests waiting for a KV pull ([`ReplayConfig::kv_pull`]), earliest end first: (when
    /// the copy ends, request, engine, leading blocks pulled).
    pulls: BinaryHeap<Reverse<(Nanos, usize, usize, usize)>>,
    /// What the pulls did.
    pull_counts: KvPullCounts,
}

/// What the replay does next: route an arrival, or hand a request its pulled KV and submit
/// it.
enum Next {
    /// Request `.1` arrives at `.0`.
    Arrival(Nanos, usize),
    /// The pull of request `.1`'s prefix ends at `.0`: (when, request, engine, blocks).
    Pulled(Nanos, usize, usize, usize),
}

/// The engines a router's views of them may no longer match ([`Router::pick`] rebuilds only
/// theirs): marked when an engine runs an event, takes a request, or its ledger entry
/// changes; or all of them.
#[derive(Debug)]
struct Moved {
    list: Vec<u32>,
    marked: Vec<bool>,
    all: bool,
}

impl Moved {
    /// Nothing moved yet among `engines`, except that no view exists: all are due.
    fn new(engines: usize) -> Moved {
        Moved { list: Vec::new(), marked: vec![false; engines], all: true }
    }

    /// Engine `w` moved.
    fn mark(&mut self, w: usize) {
        if !self.all && !std::mem::replace(&mut self.marked[w], true) {
            self.list.push(w as u32);
        }
    }

    /// Every engine may have moved.
    fn all(&mut self) {
        self.all = true;
    }

    /// Puts the engines marked into `out` and forgets them; `true` when every engine may
    /// have moved (then `out` need not list them).
    fn take(&mut self, out: &mut Vec<u32>) -> bool {
        out.clear();
        let all = std::mem::take(&mut self.all);
        for w in self.list.drain(..) {
            self.marked[w as usize] = false;
            out.push(w);
        }
        all
    }
}

impl<'a> Book<'a> {
    fn new(trace: &'a [TraceRequest], cfg: &ReplayConfig) -> Self {
        let predicted = match cfg.prefix_state {
            PrefixState::Precise { predict_window } => PredictWindow::new(predict_window, 1 << 22),
            PrefixState::Approximate => PredictWindow::new(Nanos(0), 1),
        };
        let mut next_turn = vec![None; trace.len()];
        let mut gated = vec![false; trace.len()];
        if cfg.closed_sessions || cfg.session_concurrency > 0 {
            let mut last: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
            for (i, r) in trace.iter().enumerate() {
                if let Some(s) = r.session.as_deref()
                    && let Some(prev) = last.insert(s, i)
                {
                    next_turn[prev] = Some(i);
                    gated[i] = true;
                }
            }
        }
        let mut firsts = (0..trace.len()).filter(|i| !gated[*i]);
        let cap = if cfg.session_concurrency > 0 { cfg.session_concurrency } else { usize::MAX };
        let arrivals = firsts.by_ref().take(cap).map(|i| Reverse((trace[i].arrival, i))).collect();
        let queued_sessions: std::collections::VecDeque<usize> = firsts.collect();
        Book {
            trace,
            ledger: LoadLedger::new(),
            tickets: (0..trace.len()).map(|_| None).collect(),
            outcomes: trace.iter().map(Outcome::pending).collect(),
            predicted,
            expected: (0..trace.len()).map(|_| None).collect(),
            slots: SlotRouting::new(cfg, trace.len()),
            mover: cfg
                .kv_migration
                .filter(|_| cfg.slot_routing && cfg.profile.slots > 0)
                .map(|k| Mover::new(k, &cfg.profile, cfg.engines)),
            saves: Vec::new(),
            arrivals,
            gated: gated.iter().any(|g| *g) || !queued_sessions.is_empty(),
            queued_sessions,
            clients: cfg.session_concurrency > 0,
            next_turn,
            host: HostClock::new(cfg.host_cores, &cfg.host_slowdown),
            moved: Moved::new(cfg.engines),
            pulls: BinaryHeap::new(),
            pull_counts: KvPullCounts::default(),
        }
    }

    /// The next arrival or pulled request, engines advanced through every event before it
    /// (an ending turn can release an earlier arrival than the earliest known one). A pull
    /// ending at an arrival's instant goes first.
    fn next(&mut self, engines: &mut [Engine], events: &mut Vec<EngineEvent>, policy: &mut dyn Policy) -> Option<Next> {
        // Event by event when an event may release an arrival, or the KV mover acts on an
        // event at its instant (a save starts when its request ends).
        if self.gated || self.mover.is_some() {
            loop {
                let arrival = self.arrivals.peek().map_or(Nanos(u64::MAX), |Reverse((t, _))| *t);
                let pulled = self.pulls.peek().map_or(Nanos(u64::MAX), |Reverse((t, ..))| *t);
                if !self.host.step(engines, arrival.min(pulled), false, events) {
                    break;
                }
                self.moved.all();
                self.handle(events, engines, policy);
            }
        }
        let arrival = self.arrivals.peek().map(|Reverse((t, _))| *t);
        if let Some(&Reverse((t, i, w, n))) = self.pulls.peek()
            && arrival.is_none_or(|a| t <= a)
        {
            self.pulls.pop();
            return Some(Next::Pulled(t, i, w, n));
        }
        self.arrivals.pop().map(|Reverse((t, i))| {
            self.outcomes[i].arrival = t;
            Next::Arrival(t, i)
        })
    }

    /// Request `i` ended (finished or rejected) at `at`: with `closed_sessions`, its
    /// session's next turn arrives as late after its recorded time as this one arrived
    /// after its own, and never before `at`; with `session_concurrency` (a load
    /// generator's clients), the next turn arrives at `at`, and the end of a session's last
    /// request starts the next queued session at `at`.
    fn ended(&mut self, i: usize, at: Nanos) {
        if let Some(j) = self.next_turn[i] {
            // A load generator's client sends the next turn once the answer is in; otherwise
            // the recorded gap (a person's think time) is kept.
            let late = self.outcomes[i].arrival.saturating_sub(self.trace[i].arrival);
            let when = if self.clients { at } else { self.trace[j].arrival.saturating_add(late).max(at) };
            self.arrivals.push(Reverse((when, j)));
        } else if let Some(j) = self.queued_sessions.pop_front() {
            // Its session is over: the next queued session starts now (`session_concurrency`).
            self.arrivals.push(Reverse((at, j)));
        }
    }

    /// Settles a request's prediction once its prefill is over (its blocks are in the
    /// engine's cache now, or never will be): it then lasts the predict window only.
    fn settle(&mut self, id: usize, at: Nanos) {
        if let Some(w) = self.outcomes[id].worker {
            let until = at.saturating_add(self.predicted.window());
            self.predicted.predict(WorkerId(w), &self.trace[id].blocks, at, until);
        }
    }

    /// Applies the engines' events: first tokens and completions to the ledger, the policy's
    /// observations, the slot record and the outcomes; slot-file events to the KV mover,
    /// whose saves are then asked of the engines (`engines` are at the events' instant).
    fn handle(&mut self, events: &mut Vec<EngineEvent>, engines: &mut [Engine], policy: &mut dyn Policy) {
        for ev in events.drain(..) {
            match ev {
                EngineEvent::FirstToken { id, at, cached_tokens } => {
                    self.first_token(id as usize, at, cached_tokens, policy)
                }
                EngineEvent::Finished { id, at } => {
                    let id = id as usize;
                    let place = self.slots.finish(id as u64, at);
                    self.outcomes[id].finished = Some(at);
                    if let Some(t) = self.tickets[id].take() {
                        self.moved.mark(t.worker().index());
                        self.ledger.completed(t);
                    }
                    if let Some(place) = place {
                        self.after_request(id, place, at);
                    }
                    self.ended(id, at);
                }
                EngineEvent::Rejected { id, at } => {
                    let id = id as usize;
                    self.slots.finish(id as u64, at);
                    self.settle(id, at);
                    self.outcomes[id].rejected = true;
                    if let Some(t) = self.tickets[id].take() {
                        self.moved.mark(t.worker().index());
                        self.ledger.failed(t);
                    }
                    self.ended(id, at);
                }
                EngineEvent::SlotRestored { id, tokens, took, .. } => {
                    if let (Some(m), Some(w)) = (self.mover.as_mut(), self.outcomes[id as usize].worker) {
                        m.restored(w as usize, tokens, took);
                    }
                }
                EngineEvent::SlotSaved { id, at, tokens, took } => {
                    let r = &self.trace[id as usize];
                    if let Some((w, k)) = self.mover.as_mut().and_then(|m| m.saved(id as usize, r, tokens, took, at)) {
                        self.slots.tables[w].finish(k, at);
                    }
                }
            }
        }
        for (w, k, i, at) in std::mem::take(&mut self.saves) {
            self.moved.mark(w);
            if !engines[w].save_slot(k, i as u64, self.host.virtual_at(at)) {
                self.slots.tables[w].finish(k, at);
                if let Some(m) = self.mover.as_mut() {
                    m.not_saved(i);
                }
            }
        }
    }

    /// Request `id`'s first token at `at`, `cached_tokens` of its prompt cached: its
    /// prediction settled, the policy taught, the ledger told.
    fn first_token(&mut self, id: usize, at: Nanos, cached_tokens: u32, policy: &mut dyn Policy) {
        self.settle(id, at);
        let o = &mut self.outcomes[id];
        o.first_token = Some(at);
        o.cached_tokens = cached_tokens;
        if let (Some(mut obs), Some(w)) = (self.expected[id].take(), o.worker) {
            obs.ttft_secs = Some(at.saturating_sub(o.arrival).as_secs_f64());
            obs.cached_tokens = Some(u64::from(cached_tokens));
            policy.observe(WorkerId(w), &obs);
        }
        if let Some(t) = self.tickets[id].as_mut() {
            self.moved.mark(t.worker().index());
            self.ledger.first_token(t);
        }
    }

    /// Request `id` ended at `at` on slot `place` (engine, slot), now idle in the record:
    /// with the KV mover, its slot is saved when that is worth it and nothing is on the slot
    /// (held in the record until the save ends; asked of the engine after the events).
    fn after_request(&mut self, id: usize, (w, k): (usize, u32), at: Nanos) {
        let Some(m) = self.mover.as_mut() else { return };
        if m.wants_save(&self.trace[id]) && self.slots.tables[w].hold_if_idle(k, at) {
            m.saving(id, w, k);
            self.saves.push((w, k, id, at));
        }
    }
}

/// Largest value of a [`ReplayConfig::host_slowdown`] list (1,000× slower than alone): a
/// larger one overflowed the simulated nanosecond clock.
pub const MAX_HOST_SLOWDOWN: f64 = 1000.0;

/// The first value of a [`ReplayConfig::host_slowdown`] list that is not a slow-down
/// (positive, finite, at most [`MAX_HOST_SLOWDOWN`]), if any.
pub fn not_a_slowdown(list: &[f64]) -> Option<f64> {
    list.iter().copied().find(|x| !(x.is_finite() && *x > 0.0 && *x <= MAX_HOST_SLOWDOWN))
}

/// Replays `trace` under `cfg`. `progress` is called with the number of requests routed so
/// far (every 256 requests and at the end).
///
/// # Errors
/// [`ReplayError`] for an unknown policy, bad knobs, zero engines, a `host_slowdown`
/// value that is not positive and finite, or `kv_migration` without slots and slot routing.
pub fn replay(
    trace: &[TraceRequest],
    cfg: &ReplayConfig,
    progress: &mut dyn FnMut(usize),
) -> Result<ReplayResult, ReplayError> {
    check_config(cfg)?;
    let mut run = Replay::new(trace, cfg)?;
    let mut routed = 0usize;
    while let Some(next) = run.next() {
        if run.go(next) {
            routed += 1;
            if routed.is_multiple_of(256) {
                progress(routed);
            }
        }
    }
    let result = run.finish();
    progress(trace.len());
    Ok(result)
}

/// The settings a replay cannot run with: no engines, a bad profile, a `host_slowdown`
/// value that is not a slow-down.
fn check_config(cfg: &ReplayConfig) -> Result<(), ReplayError> {
    if cfg.engines == 0 {
        return Err(ReplayError::Config(crate::engine::InvalidSetting::new(
            "engines",
            "at least one engine is needed",
        )));
    }
    cfg.profile.validate().map_err(ReplayError::Config)?;
    if cfg.kv_migration.is_some() && !(cfg.slot_routing && cfg.profile.slots > 0) {
        return Err(ReplayError::Config(crate::engine::InvalidSetting::new(
            "kv_migration",
            "needs a profile with llama.cpp slots and slot routing (the mover saves and restores the slots the router names)",
        )));
    }
    if let Some(pull) = cfg.kv_pull {
        let bad = |why: &str| Err(ReplayError::Config(crate::engine::InvalidSetting::new("kv_pull", why)));
        if cfg.profile.slots > 0 || cfg.kv_oracle != KvOracle::Off {
            return bad("needs a paged KV cache (a profile without llama.cpp slots) and no KV oracle");
        }
        if !matches!(cfg.prefix_state, PrefixState::Precise { .. }) {
            return bad("needs the precise prefix state: the router must know which engine holds a prefix");
        }
        pull.transfer.validate().map_err(ReplayError::Config)?;
    }
    if let Some(bad) = not_a_slowdown(&cfg.host_slowdown) {
        return Err(ReplayError::Config(crate::engine::InvalidSetting::new(
            "host_slowdown",
            format!("{bad} is not a positive finite slow-down"),
        )));
    }
    Ok(())
}

/// The router of a colocated replay: its policy with its random source and maintenance
/// clock, and what it sees of each engine.
struct Router {
    policy: Box<dyn Policy>,
    rng: rand_xoshiro::Xoshiro256PlusPlus,
    maintenance: Maintenance,
    views: Vec<WorkerView>,
    util: Vec<BusyWindow>,
    /// Whether a view depends only on its engine, its ledger entry and the utilisation
    /// window, not on the request (no precise prefix state, slot routing or KV mover): then
    /// only the views of the engines that moved are rebuilt ([`Moved`]).
    reuse_views: bool,
    /// The views' digest, kept beside them when the policy reads one
    /// ([`Policy::fleet_digest`]) and the views are kept ([`Router::reuse_views`]):
    /// updated for the engines that moved, refreshed when every view is rebuilt.
    digest: Option<FleetDigest>,
    /// The engines to rebuild the views of (scratch).
    moved: Vec<u32>,
    /// With KV pulls: the leading blocks of the request last routed that the engine holding
    /// most of it holds (set when its views were built, read when it is dispatched: the
    /// engines do not move between the two).
    pull_best: usize,
    /// Tests: check every view kept against one built afresh.
    #[cfg(test)]
    check_views: bool,
}

impl Router {
    /// The router of `cfg`.
    fn new(cfg: &ReplayConfig) -> Result<Router, ReplayError> {
        let policy: Box<dyn Policy> = registry::build(&cfg.policy, &cfg.knobs)?;
        let reuse_views = matches!(cfg.prefix_state, PrefixState::Approximate)
            && !cfg.slot_routing
            && cfg.kv_migration.is_none()
            && cfg.kv_pull.is_none();
        Ok(Router {
            digest: policy.fleet_digest().filter(|_| reuse_views),
            rng: rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(cfg.seed),
            maintenance: Maintenance::new(policy.as_ref()),
            policy,
            views: Vec::with_capacity(cfg.engines),
            util: (0..cfg.engines).map(|_| BusyWindow::default()).collect(),
            reuse_views,
            moved: Vec::new(),
            pull_best: 0,
            #[cfg(test)]
            check_views: false,
        })
    }

    /// Routes `r` at `now` over views of every engine (with the slot a llama.cpp engine
    /// would serve it from, under slot routing, and what the KV mover would restore into it).
    fn pick(
        &mut self,
        book: &mut Book<'_>,
        engines: &[Engine],
        cfg: &ReplayConfig,
        r: &TraceRequest,
        now: Nanos,
    ) -> Result<Decision, RouteError> {
        // Every utilisation window is observed at every pick, so they all refresh together.
        let util_due = cfg.engine_signals && self.util.first().is_some_and(|u| u.due(now));
        let all = book.moved.take(&mut self.moved);
        if self.reuse_views && !all && !util_due && self.views.len() == engines.len() {
            let view = RouterView { ledger: &book.ledger, predicted: &book.predicted, cfg, now };
            for &w in &self.moved {
                let w = w as usize;
                self.views[w] = view.of(w, Role::Both, &engines[w], &mut self.util[w], r);
                if let Some(d) = self.digest.as_mut() {
                    d.update(w, &self.views[w]);
                }
            }
            #[cfg(test)]
            if self.check_views {
                // Not due: building every view afresh changes no utilisation window.
                let kept = std::mem::take(&mut self.views);
                self.fill_views(book, engines, cfg, r, now);
                assert_eq!(kept, self.views, "the views kept at {now:?}");
                if let Some(d) = &self.digest {
                    assert!(d.describes(&self.views), "the digest kept at {now:?}");
                }
            }
        } else {
            self.fill_views(book, engines, cfg, r, now);
            if let Some(d) = self.digest.as_mut() {
                d.refresh(&self.views);
            }
        }
        let req = request_view(r, Role::Both);
        let mut ctx = PickCtx { now, rng: &mut self.rng, fleet: self.digest.as_ref() };
        route(self.policy.as_mut(), &req, &self.views, &mut ctx)
    }

    /// Builds the view of every engine for `r` at `now`.
    fn fill_views(&mut self, book: &Book<'_>, engines: &[Engine], cfg: &ReplayConfig, r: &TraceRequest, now: Nanos) {
        self.views.clear();
        // With KV pulls: the most of the prompt any engine's cache holds, tokens.
        let pullable = cfg.kv_pull.map(|pull| {
            self.pull_best = engines.iter().map(|e| e.cache().lookup(&r.blocks)).max().unwrap_or(0);
            (pull, (self.pull_best as u64 * u64::from(r.block_tokens)).min(u64::from(r.input_tokens)))
        });
        // The best saved file, looked up once per request.
        let mut file = None;
        for (w, e) in engines.iter().enumerate() {
            let view = RouterView { ledger: &book.ledger, predicted: &book.predicted, cfg, now };
            let mut v = view.of(w, Role::Both, e, &mut self.util[w], r);
            let restorable = book.mover.as_ref().map_or(0, |m| {
                let f = file.get_or_insert_with(|| m.best(r));
                f.as_ref().map_or(0, |f| m.restorable_blocks(w, f, r.block_tokens))
            });
            if let Some(c) = book.slots.choose(w, r, restorable) {
                let held = if c.waits { c.cached_blocks } else { c.cached_blocks.max(restorable) };
                let tokens = held as u64 * u64::from(r.block_tokens);
                v.cached_tokens = Some(tokens.min(u64::from(r.input_tokens)));
            }
            self.views.push(v);
        }
        if let Some((pull, best)) = pullable {
            credit_pulls(&mut self.views, &pull, &cfg.profile, best);
        }
    }
}

/// Credits the views of the engines a KV pull would serve ([`KvPull`], "The policy's
/// view") with the tokens of the `best` (the most any engine's cache holds of the
/// request's prompt, tokens) a pull would bring, net of its cost ([`KvPull::credit`]):
/// only an engine both less loaded and with less prefill queued than every holder of
/// `best` gains by one — a holder with no more queued starts the request as soon, without
/// the copy's wait.
fn credit_pulls(views: &mut [WorkerView], pull: &KvPull, profile: &crate::engine::Profile, best: u64) {
    let (holder_load, holder_queue) = views
        .iter()
        .filter(|v| v.cached_tokens.is_some_and(|c| c >= best))
        .fold((u32::MAX, u64::MAX), |(l, q), v| (l.min(v.load()), q.min(v.pending_prefill_tokens)));
    for v in views.iter_mut() {
        if let Some(own) = v.cached_tokens
            && best > own
            && v.load() < holder_load
            && v.pending_prefill_tokens < holder_queue
        {
            v.cached_tokens = Some(own + pull.credit(profile, own, best - own));
        }
    }
}

/// The KV oracle of a replay ([`KvOracle`]): what prefix of a request it hands its engine.
struct Oracle {
    kind: KvOracle,
    /// Every block computed so far, for `KvOracle::Store` (fed by the engines' cache events).
    store: std::collections::HashSet<BlockHash>,
    cache_events: Vec<CacheEvent>,
}

impl Oracle {
    /// The oracle `kind`; `Store` has the engines record their cache events.
    fn new(kind: KvOracle, engines: &mut [Engine]) -> Oracle {
        if kind == KvOracle::Store {
            engines.iter_mut().for_each(|e| e.record_cache_events(true));
        }
        Oracle { kind, store: Default::default(), cache_events: Vec::new() }
    }

    /// How many leading blocks of `blocks` the oracle's source holds now (0 when off).
    fn found(&mut self, engines: &mut [Engine], blocks: &[BlockHash]) -> usize {
        match self.kind {
            KvOracle::Off => 0,
            KvOracle::Fleet => engines.iter().map(|e| e.cache().lookup(blocks)).max().unwrap_or(0),
            KvOracle::Store => {
                for e in engines.iter_mut() {
                    e.drain_cache_events(&mut self.cache_events);
                }
                for ev in self.cache_events.drain(..) {
                    if let CacheEvent::Stored { hashes, .. } = ev {
                        self.store.extend(hashes);
                    }
                }
                blocks.iter().take_while(|h| self.store.contains(h)).count()
            }
        }
    }
}

/// One colocated replay under way: the engines, the record of every request, the router
/// and the oracle.
struct Replay<'a> {
    cfg: &'a ReplayConfig,
    engines: Vec<Engine>,
    events: Vec<EngineEvent>,
    book: Book<'a>,
    router: Router,
    oracle: Oracle,
}

impl<'a> Replay<'a> {
    /// A replay of `trace` under `cfg` (checked), before its first arrival.
    fn new(trace: &'a [TraceRequest], cfg: &'a ReplayConfig) -> Result<Replay<'a>, ReplayError> {
        let router = Router::new(cfg)?;
        let mut engines: Vec<Engine> =
            (0..cfg.engines).map(|_| Engine::new(cfg.profile.clone(), cfg.max_waiting)).collect();
        let book = Book::new(trace, cfg);
        let oracle = Oracle::new(cfg.kv_oracle, &mut engines);
        Ok(Replay { cfg, engines, events: Vec::new(), book, router, oracle })
    }

    /// What happens next ([`Book::next`]).
    fn next(&mut self) -> Option<Next> {
        self.book.next(&mut self.engines, &mut self.events, self.router.policy.as_mut())
    }

    /// Does `next`; `true` when it routed an arrival.
    fn go(&mut self, next: Next) -> bool {
        match next {
            Next::Arrival(now, i) => {
                self.arrive(i, now);
                true
            }
            Next::Pulled(now, i, w, blocks) => {
                self.pulled(i, w, blocks, now);
                false
            }
        }
    }

    /// Request `i`'s pull of its first `blocks` blocks onto engine `w` ended at `now`: the
    /// blocks enter the engine's cache and the request is submitted.
    fn pulled(&mut self, i: usize, w: usize, blocks: usize, now: Nanos) {
        let book = &mut self.book;
        book.host.advance(&mut self.engines, now, &mut self.events, &mut book.moved);
        self.book.handle(&mut self.events, &mut self.engines, self.router.policy.as_mut());
        let r = &self.book.trace[i];
        self.engines[w].import_prefix(&r.blocks[..blocks], r.block_tokens);
        self.book.moved.mark(w);
        self.submit(i, w, None, None, now);
    }

    /// Request `i` arrives at `now`: the engines are brought up to it, the policy
    /// maintained, and the request routed and submitted (or rejected).
    fn arrive(&mut self, i: usize, now: Nanos) {
        let trace = self.book.trace;
        let r = &trace[i];
        let book = &mut self.book;
        book.host.advance(&mut self.engines, now, &mut self.events, &mut book.moved);
        self.book.handle(&mut self.events, &mut self.engines, self.router.policy.as_mut());
        self.router.maintenance.run(self.router.policy.as_mut(), now);
        if let Some(m) = self.book.mover.as_mut() {
            m.expire(now);
        }
        match self.router.pick(&mut self.book, &self.engines, self.cfg, r, now) {
            Ok(d) => self.dispatch(i, &d, now),
            Err(_) => {
                self.book.outcomes[i].rejected = true;
                self.book.ended(i, now);
            }
        }
    }

    /// Request `i`, routed by `d` at `now`: recorded (prediction, outcome, ledger ticket,
    /// expected observation), handed the oracle's prefix, and submitted to its engine.
    fn dispatch(&mut self, i: usize, d: &Decision, now: Nanos) {
        let trace = self.book.trace;
        let r = &trace[i];
        let book = &mut self.book;
        let w = d.worker.index();
        book.moved.mark(w);
        // Predicted until its prefill is over (settled at its first token).
        book.predicted.predict(d.worker, &r.blocks, now, Nanos(u64::MAX));
        let o = &mut book.outcomes[i];
        o.worker = Some(d.worker.0);
        o.branch = d.branch.as_str();
        o.predicted_ttft_s = d.predicted_ttft.map(|p| p.secs);
        let est = d.cached_tokens_estimate(r.input_tokens);
        book.tickets[i] = Some(book.ledger.dispatched(d.worker, r.input_tokens as u64 - est, r.output_tokens as u64));
        book.expected[i] = Some(Observation {
            input_tokens: r.input_tokens,
            predicted: d.predicted_ttft,
            predicted_cached_tokens: est,
            ttft_secs: None,
            cached_tokens: None,
        });
        // The best saved file, looked up once for the slot choice and the restore.
        let file = book.mover.as_ref().and_then(|m| m.best(r));
        let restorable = match (book.mover.as_ref(), &file) {
            (Some(m), Some(f)) => m.restorable_blocks(w, f, r.block_tokens),
            _ => 0,
        };
        let choice = book.slots.choose(w, r, restorable);
        let restore = match (book.mover.as_mut(), choice, file) {
            (Some(m), Some(c), Some(f)) => m.restore(w, c, r, &f, now),
            _ => None,
        };
        if let Some(c) = choice {
            book.slots.start(w, i, r, c, now);
        }
        let slot = choice.map(|c| c.slot);
        let found = self.oracle.found(&mut self.engines, &r.blocks);
        if found > 0 {
            self.engines[w].import_prefix(&r.blocks[..found], r.block_tokens);
        }
        if let Some((blocks, secs)) = self.pull_of(r, w) {
            let c = &mut self.book.pull_counts;
            c.kv_pulls += 1;
            c.kv_pulled_tokens += (blocks as u64 * u64::from(r.block_tokens)).min(u64::from(r.input_tokens));
            c.kv_pull_secs += secs;
            let at = now.saturating_add(Nanos::from_secs_f64(secs));
            self.book.pulls.push(Reverse((at, i, w, blocks)));
            return;
        }
        self.submit(i, w, slot, restore, now);
    }

    /// The pull request `r` sent to engine `w` waits for ([`ReplayConfig::kv_pull`]):
    /// `(leading blocks the best other engine holds, seconds)` when it pays.
    fn pull_of(&self, r: &TraceRequest, w: usize) -> Option<(usize, f64)> {
        let pull = self.cfg.kv_pull?;
        let own = self.engines[w].cache().lookup(&r.blocks);
        // Found when the request's views were built (`Router::fill_views`).
        let best = self.router.pull_best;
        let tokens = |b: usize| (b as u64 * u64::from(r.block_tokens)).min(u64::from(r.input_tokens));
        let (own_t, best_t) = (tokens(own), tokens(best));
        (best_t > own_t && pull.pays(&self.cfg.profile, own_t, best_t - own_t))
            .then(|| (best, pull.secs(best_t - own_t)))
    }

    /// Submits request `i` to engine `w` at `now` (on `slot`, with a slot file to
    /// `restore`), and applies what the engine reports at once.
    fn submit(&mut self, i: usize, w: usize, slot: Option<u32>, restore: Option<SlotRestore>, now: Nanos) {
        let r = &self.book.trace[i];
        let at = self.book.host.virtual_at(now);
        let first = self.events.len();
        self.engines[w].submit(
            EngineRequest {
                id: i as u64,
                input_tokens: r.input_tokens,
                output_tokens: r.output_tokens,
                blocks: r.blocks.clone(),
                block_tokens: r.block_tokens,
                token_ids: None,
                kv_transferred: false,
                slot,
                restore,
            },
            at,
            &mut self.events,
        );
        self.book.host.make_real(&mut self.events[first..]);
        self.book.host.resync(now, &self.engines);
        self.book.handle(&mut self.events, &mut self.engines, self.router.policy.as_mut());
    }

    /// Runs the engines to the end and returns the result.
    fn finish(mut self) -> ReplayResult {
        let end = Nanos(u64::MAX);
        while let Some(Reverse((at, i, w, blocks))) = self.book.pulls.pop() {
            self.pulled(i, w, blocks, at);
        }
        if self.book.mover.is_some() {
            // Event by event: the saves of the last requests start when they end.
            while self.book.host.step(&mut self.engines, end, true, &mut self.events) {
                self.book.moved.all();
                self.book.handle(&mut self.events, &mut self.engines, self.router.policy.as_mut());
            }
        }
        let book = &mut self.book;
        book.host.advance(&mut self.engines, end, &mut self.events, &mut book.moved);
        self.book.handle(&mut self.events, &mut self.engines, self.router.policy.as_mut());
        ReplayResult {
            policy: self.cfg.policy.clone(),
            outcomes: self.book.outcomes,
            busy_ns: self.engines.iter().map(|e| e.stats().busy_ns).collect(),
            evictions: self.engines.iter().map(|e| e.cache().evictions()).collect(),
            pd: None,
            kv_migration: self.book.mover.as_ref().map(Mover::counts),
            kv_pull: self.cfg.kv_pull.map(|_| self.book.pull_counts),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::types::BlockHash;

    /// `trace` replayed under `cfg` with the views rebuilt only for the engines that moved
    /// (`reuse`) or for every engine at every arrival.
    fn replay_with(trace: &[TraceRequest], cfg: &ReplayConfig, reuse: bool) -> ReplayResult {
        let mut run = Replay::new(trace, cfg).expect("replay");
        run.router.reuse_views &= reuse;
        run.router.check_views = reuse;
        while let Some(next) = run.next() {
            run.go(next);
        }
        run.finish()
    }

    /// Bursts of requests on 24 engines over ~14 s (the utilisation windows refresh a dozen
    /// times), some on shared prefixes, some longer than an engine takes at once.
    fn bursty() -> Vec<TraceRequest> {
        (0..600u64)
            .map(|i| {
                let group = (i * 13) % 9;
                let mut blocks: Vec<BlockHash> = (0..1 + group % 5).map(|k| BlockHash(100 * (group + 1) + k)).collect();
                blocks.extend((0..1 + i % 7).map(|k| BlockHash(1_000_000 + 16 * i + k)));
                TraceRequest {
                    tenant: None,
                    arrival: Nanos::from_millis((i / 20) * 450 + (i % 20) * 3),
                    input_tokens: blocks.len() as u32 * 512,
                    output_tokens: 16 + (i % 11) as u32 * 40,
                    block_tokens: 512,
                    blocks,
                    session: Some(format!("s{}", i % 50)),
                    turn: 0,
                }
            })
            .collect()
    }

    #[test]
    fn views_rebuilt_for_the_engines_that_moved_give_the_same_replay_as_views_rebuilt_for_all() {
        let trace = bursty();
        for policy in ["least_ttft", "prefill_cost", "least_load", "power_of_two", "cache_aware", "kv_score", "lmetric"]
        {
            for engine_signals in [true, false] {
                let profile = crate::engine::Profile::named("h100-llama3-8b").expect("profile");
                let cfg =
                    ReplayConfig { seed: 3, max_waiting: 8, engine_signals, ..ReplayConfig::new(policy, 24, profile) };
                let full = replay_with(&trace, &cfg, false);
                let reused = replay_with(&trace, &cfg, true);
                assert_eq!(
                    format!("{:?}", full.outcomes),
                    format!("{:?}", reused.outcomes),
                    "{policy} {engine_signals}"
                );
                assert_eq!(full.busy_ns, reused.busy_ns, "{policy}");
                if policy == "least_load" {
                    // Not a trivial replay: the requests spread over the fleet and queue.
                    let sent: std::collections::HashSet<_> = full.outcomes.iter().filter_map(|o| o.worker).collect();
                    assert_eq!(sent.len(), 24);
                    let ttft = |o: &Outcome| o.first_token.map(|t| t.0 - o.arrival.0);
                    assert!(full.outcomes.iter().filter_map(ttft).max() > Some(Nanos::from_millis(100).0));
                }
            }
        }
    }

    /// A pull is credited only to an engine both less loaded and with less prefill queued
    /// than every holder: a holder that is busier but has nothing queued (its requests
    /// decoding) starts the request as soon as any other engine would, without the copy.
    #[test]
    fn a_pull_is_credited_only_past_a_holder_with_more_queued() {
        let profile = crate::engine::Profile::named("h100-llama3-8b").expect("profile");
        let pull = KvPull::default();
        let view = |id: u32, in_flight: u32, pending: u64, cached: u64| WorkerView {
            in_flight,
            pending_prefill_tokens: pending,
            cached_tokens: Some(cached),
            ..WorkerView::idle(WorkerId(id))
        };
        let credited = |views: &[WorkerView]| -> Vec<u64> {
            let mut v = views.to_vec();
            credit_pulls(&mut v, &pull, &profile, 4096);
            v.iter().map(|w| w.cached_tokens.unwrap_or(0)).collect()
        };
        let gain = 512 + pull.credit(&profile, 512, 4096 - 512);
        assert!(gain > 512 && gain < 4096, "{gain}");
        // The holder runs two requests that are decoding: nothing queued, no credit.
        assert_eq!(credited(&[view(0, 2, 0, 4096), view(1, 0, 0, 512)]), vec![4096, 512]);
        // The holder has a prompt's prefill queued: the idle engine is credited.
        assert_eq!(credited(&[view(0, 2, 3000, 4096), view(1, 0, 0, 512)]), vec![4096, gain]);
        // An engine with as much queued as the holder, or as loaded, is not.
        assert_eq!(credited(&[view(0, 2, 3000, 4096), view(1, 0, 3000, 512)]), vec![4096, 512]);
        assert_eq!(credited(&[view(0, 2, 3000, 4096), view(1, 2, 0, 512)]), vec![4096, 512]);
        // Two holders: the least queued of them is the bar.
        assert_eq!(
            credited(&[view(0, 3, 3000, 4096), view(2, 3, 100, 4096), view(1, 0, 200, 512)]),
            vec![4096, 4096, 512]
        );
    }
}
