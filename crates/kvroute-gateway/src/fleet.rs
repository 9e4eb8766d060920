//! The fleet: every worker the gateway knows, as an immutable list swapped whole.
//!
//! The request path reads [`Fleet::load`] (one atomic load, no lock) and each worker's
//! health, engine signals and load counters from atomics inside its [`WorkerEntry`]. The
//! tasks that learn about workers — health checks, `/metrics` scrapes, the admin API, KV-event
//! subscribers — store into those atomics; only a change of membership builds a new list
//! (pingora's `Backends` works the same way).
//!
//! A request need not read every worker: each model's roster keeps copies of its workers'
//! views and their [`FleetDigest`] between requests ([`Fleet::decide_kept`]), and every
//! store into what a view reads marks the worker changed ([`ViewChanges`]), so a decision
//! re-reads only the marked workers before its policy reads the digest.

use arc_swap::ArcSwap;
use kvroute_core::fleet_digest::FleetDigest;
use kvroute_core::ledger::AtomicLoad;
use kvroute_core::types::{Health, Nanos, Role, WorkerId, WorkerView};
use kvroute_core::view_changes::{ChangeReader, ViewChanges};
use kvroute_protocol::openai::Api;
use parking_lot::Mutex;
use serde::Serialize;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64};
use std::time::{Duration, Instant};

pub use crate::model::worker_url::MAX_WORKERS;

/// An optional `u32` in one 4-byte atomic (`u32::MAX` is `None`; a value of `u32::MAX` is
/// stored as `u32::MAX − 1`, far beyond any queue length, slot count or port it holds).
#[derive(Debug)]
pub struct OptU32(AtomicU32);

impl Default for OptU32 {
    fn default() -> Self {
        OptU32(AtomicU32::new(u32::MAX))
    }
}

impl OptU32 {
    /// The value.
    #[inline]
    pub fn get(&self) -> Option<u32> {
        let v = self.0.load(Relaxed);
        (v != u32::MAX).then_some(v)
    }
    /// Sets the value.
    pub fn set(&self, v: Option<u32>) {
        self.0.store(v.map_or(u32::MAX, |v| v.min(u32::MAX - 1)), Relaxed);
    }
}

/// An optional `f64` in one atomic (NaN's bit pattern `u64::MAX` is `None`).
#[derive(Debug)]
pub struct OptF64(AtomicU64);

impl Default for OptF64 {
    fn default() -> Self {
        OptF64(AtomicU64::new(u64::MAX))
    }
}

impl OptF64 {
    /// The value.
    pub fn get(&self) -> Option<f64> {
        let v = self.0.load(Relaxed);
        (v != u64::MAX).then(|| f64::from_bits(v))
    }
    /// Sets the value (a NaN is stored as `None`).
    pub fn set(&self, v: Option<f64>) {
        self.0.store(v.filter(|x| !x.is_nan()).map_or(u64::MAX, f64::to_bits), Relaxed);
    }
}

/// What a worker's engine reports on `/metrics` (and llama.cpp on `/slots`), each `None`
/// until scraped. The fields a routing view reads come first (48 bytes with `hit_ratio`,
/// which it does not read; see [`WorkerEntry`]'s layout).
#[derive(Debug, Default)]
#[repr(C)]
pub struct EngineSignals {
    /// Requests waiting in the engine's queue.
    pub queue: OptU32,
    /// Requests the engine runs.
    pub running: OptU32,
    /// Decode slots (llama.cpp `/slots`): requests it runs at once.
    pub slots: OptU32,
    /// KV cache usage in [0, 1].
    pub kv_cache_usage: OptF64,
    /// Compute utilisation in [0, 1] (DCGM SM activity), when exported.
    pub sm_util: OptF64,
    /// Power draw, watts.
    pub power_watts: OptF64,
    /// Engine-reported prefix-cache hit ratio of prompt tokens since the worker started.
    pub hit_ratio: OptF64,
}

/// One worker: fixed identity, and atomics for everything that changes.
///
/// Laid out in declaration order (`repr(C)`) from a cache-line boundary: what a request's
/// candidate read loads for every worker of the model ([`Fleet::candidates_in`]: id,
/// health, ejection, the two load counters' addresses, the engine signals a view holds)
/// fills the first 64-byte line, so a fleet of thousands costs one line a worker here
/// (and one for each load counter) instead of several.
#[derive(Debug)]
#[repr(C, align(64))]
pub struct WorkerEntry {
    /// Dense id used on the hot path and by the routing core.
    pub id: WorkerId,
    /// Health as the active checks set it ([`health_code`]).
    health: AtomicU8,
    /// Taken out of routing by failed requests: routable again only after an inference
    /// probe passes (a `/health` 200 is not enough).
    ejected: AtomicBool,
    /// The router's own load counters for this worker.
    pub load: Arc<AtomicLoad>,
    /// Requests other router replicas of the cluster have in flight on this worker, as
    /// their routing events over NATS report them ([`crate::cluster::sync`]); zero without
    /// `nats`. The routing view adds them to [`WorkerEntry::load`].
    pub remote_load: Arc<AtomicLoad>,
    /// Engine signals. Whoever stores them calls [`WorkerEntry::signals_stored`] after.
    pub signals: EngineSignals,
    /// A stable hash of `url`: the worker's name in every replica's tie-breaks
    /// ([`kvroute_core::types::WorkerView::tie_key`]).
    pub tie_key: u64,
    /// Base URL (normalised, no trailing slash).
    pub url: Arc<str>,
    /// `url`'s `host:port`, parsed once ([`WorkerEntry::authority`]).
    authority: Option<String>,
    /// The worker's inference endpoints, parsed once (chat, completions, generate): the
    /// request path clones one instead of formatting and parsing a URL per attempt.
    endpoints: Option<[reqwest::Url; 3]>,
    /// Models served (empty = unknown: serves any model); replaced when rediscovered
    /// ([`WorkerEntry::set_models`], which also invalidates the fleet's rosters).
    models: ArcSwap<Vec<String>>,
    /// Woken when health checks mark the worker down ([`WorkerEntry::mark_down`]): the
    /// requests still waiting for its first byte stop waiting and fail over
    /// ([`WorkerEntry::marked_down`]).
    down: tokio::sync::Notify,
    /// Consecutive failed requests (passive), SGLang router's `max_worker_retries` rule.
    pub consecutive_failures: AtomicU32,
    /// Consecutive failed active checks.
    pub check_failures: AtomicU32,
    /// Consecutive passed active checks while unhealthy.
    pub check_successes: AtomicU32,
    /// Ejections in a row without a request succeeding in between (the probe backoff's
    /// exponent).
    ejections: AtomicU32,
    /// Whether requests to it name a llama.cpp slot (`llama_slot_routing`: forced, or
    /// set by the join probe in `auto`).
    slot_routing: AtomicBool,
    /// What the join probe found of a host-memory prompt cache: 0 not probed (or failed),
    /// 1 none, 2 present.
    host_prompt_cache: std::sync::atomic::AtomicU8,
    /// Where it runs relative to this router ([`crate::model::locality::Locality`] as `u8`).
    locality: std::sync::atomic::AtomicU8,
    /// When the next inference probe of an ejected worker is due (gateway clock, ns).
    probe_at: AtomicU64,
    /// The last failed request (gateway clock, ns; 0 = never): with every worker out, the
    /// least recently failed one is still tried.
    last_failure_at: AtomicU64,
    /// Its registration in the cluster registry (role, capacity, labels), when it came
    /// from etcd.
    pub registration: arc_swap::ArcSwapOption<crate::model::registration::WorkerRecord>,
    /// Its registration comes from the last known registry on disk (`state_dir`), read
    /// because etcd was unreachable when this replica started; cleared once etcd answers
    /// ([`crate::cluster::etcd`]).
    pub registration_stale: AtomicBool,
    /// Recent power readings (`power_metric`), averaged into `signals.power_watts`; only
    /// the health task touches it.
    pub power: parking_lot::Mutex<PowerWindow>,
    /// Role (prefill, decode or both), as [`role_code`] encodes it.
    role: AtomicU8,
    /// Its bootstrap server's port (SGLang prefill workers).
    pub bootstrap_port: OptU32,
    /// The fleet's view changes, marked whenever what its view reads changes (set when it
    /// joins a fleet: [`Fleet::add_with`]).
    changes: std::sync::OnceLock<Arc<ViewChanges>>,
    /// When its `/v1/models` was last read (gateway clock, ns).
    pub models_read_at: AtomicU64,
    /// Capacity facts by source ([`CapacitySource`]); written rarely (a worker added,
    /// registered, probed or a reload), each write resolving [`WorkerEntry::capacity`].
    capacity_sources: Mutex<[Option<crate::model::capacity::Capacity>; 3]>,
    /// What its llama.cpp slots hold, for a worker with a `llama_slots` capacity (`None`
    /// otherwise); used with `llama_slot_routing`: read when routing, written when a
    /// request is sent to a slot and when it ends. One lock per worker, held for a scan of
    /// its slots.
    pub slots: parking_lot::Mutex<Option<kvroute_core::slots::SlotTable>>,
    /// Its KV mover costs (restore, prefill), calibrated online (`crate::kv_move`); `None`
    /// until the mover first needs them.
    pub kv_costs: parking_lot::Mutex<Option<kvroute_core::kv_migration::WorkerCosts>>,
    /// The resolved capacity facts: configuration over registration over the worker's
    /// own report ([`crate::model::capacity::Capacity`]).
    capacity: ArcSwap<(crate::model::capacity::Capacity, kvroute_core::types::Capacity)>,
}

// The view's fields of a worker fill its first cache line (the layout note on WorkerEntry).
const _: () =
    assert!(std::mem::offset_of!(WorkerEntry, signals) + std::mem::offset_of!(EngineSignals, hit_ratio) <= 64);

/// Where a worker's capacity facts come from, highest precedence first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CapacitySource {
    /// The configuration file's `[capacity."URL"]`.
    Config = 0,
    /// The worker's etcd registration.
    Registry = 1,
    /// The worker itself (SGLang `/server_info`, llama.cpp `/props`, vLLM `/v1/models`).
    Probed = 2,
}

fn role_code(r: Role) -> u8 {
    match r {
        Role::Both => 0,
        Role::Prefill => 1,
        Role::Decode => 2,
    }
}

fn role_of(c: u8) -> Role {
    match c {
        1 => Role::Prefill,
        2 => Role::Decode,
        _ => Role::Both,
    }
}

fn health_code(h: Health) -> u8 {
    match h {
        Health::Healthy => 0,
        Health::Draining => 1,
        Health::Unhealthy => 2,
    }
}

fn health_of(c: u8) -> Health {
    match c {
        0 => Health::Healthy,
        1 => Health::Draining,
        _ => Health::Unhealthy,
    }
}

/// `url` as the fleet stores it ([`crate::model::worker_url::check_worker_url`]'s form), or trimmed
/// of trailing slashes when it is not a valid worker URL (then it matches nothing).
fn normalised(url: &str) -> String {
    crate::model::worker_url::check_worker_url(url).unwrap_or_else(|_| url.trim().trim_end_matches('/').to_string())
}

/// First probe of an ejected worker after this long; doubling per failed probe up to
/// [`PROBE_BACKOFF_MAX`].
pub const PROBE_BACKOFF_START: Nanos = Nanos::from_secs(1);
/// Longest wait between two inference probes of an ejected worker.
pub const PROBE_BACKOFF_MAX: Nanos = Nanos::from_secs(60);

impl WorkerEntry {
    fn new(id: WorkerId, url: &str, models: Vec<String>, health: Health) -> Self {
        let parse = |api: Api| reqwest::Url::parse(&format!("{url}{}", api.path())).ok();
        let endpoints = match (parse(Api::Chat), parse(Api::Completions), parse(Api::Generate)) {
            (Some(c), Some(p), Some(g)) => Some([c, p, g]),
            _ => None,
        };
        WorkerEntry {
            id,
            url: Arc::from(url),
            tie_key: kvroute_core::hash::stable_hash(url.as_bytes()),
            authority: url::Url::parse(url)
                .ok()
                .and_then(|u| Some(format!("{}:{}", u.host_str()?, u.port_or_known_default()?))),
            endpoints,
            models: ArcSwap::from_pointee(models),
            health: AtomicU8::new(health_code(health)),
            down: tokio::sync::Notify::new(),
            ejected: AtomicBool::new(false),
            consecutive_failures: AtomicU32::new(0),
            check_failures: AtomicU32::new(0),
            check_successes: AtomicU32::new(0),
            ejections: AtomicU32::new(0),
            locality: std::sync::atomic::AtomicU8::new(crate::model::locality::Locality::Other as u8),
            slot_routing: AtomicBool::new(false),
            host_prompt_cache: std::sync::atomic::AtomicU8::new(0),
            probe_at: AtomicU64::new(0),
            last_failure_at: AtomicU64::new(0),
            signals: EngineSignals::default(),
            load: Arc::default(),
            remote_load: Arc::default(),
            registration: arc_swap::ArcSwapOption::empty(),
            registration_stale: AtomicBool::new(false),
            power: parking_lot::Mutex::default(),
            capacity_sources: Mutex::default(),
            slots: parking_lot::Mutex::new(None),
            kv_costs: parking_lot::Mutex::new(None),
            models_read_at: AtomicU64::new(0),
            role: AtomicU8::new(role_code(Role::Both)),
            bootstrap_port: OptU32::default(),
            changes: std::sync::OnceLock::new(),
            capacity: ArcSwap::from_pointee((
                crate::model::capacity::Capacity::default(),
                kvroute_core::types::Capacity::default(),
            )),
        }
    }

    /// Sets (or clears) the capacity facts of one source and resolves the worker's
    /// capacity: each field from the first source that states it, else the default.
    pub fn set_capacity(&self, source: CapacitySource, c: Option<crate::model::capacity::Capacity>) {
        let mut sources = self.capacity_sources.lock();
        sources[source as usize] = c;
        let merged =
            sources.iter().rev().flatten().fold(crate::model::capacity::Capacity::default(), |base, c| c.over(&base));
        // A new slot count (a restarted llama-server) starts a fresh record.
        let mut slots = self.slots.lock();
        match merged.llama_slots {
            Some(n) if slots.as_ref().is_none_or(|t| t.len() != n as usize) => {
                *slots = Some(kvroute_core::slots::SlotTable::new(n));
            }
            None => *slots = None,
            Some(_) => {}
        }
        drop(slots);
        let core = merged.core();
        if self.capacity.load().0 != merged {
            self.capacity.store(Arc::new((merged, core)));
            roster_changed();
        }
    }

    /// The resolved capacity facts as stated (unset fields are the defaults).
    pub fn capacity(&self) -> crate::model::capacity::Capacity {
        self.capacity.load().0.clone()
    }

    /// The resolved capacity as the routing core sees it (the view's
    /// [`WorkerView::capacity`](kvroute_core::types::WorkerView::capacity)).
    pub fn core_capacity(&self) -> kvroute_core::types::Capacity {
        self.capacity.load().1
    }

    /// The URL of `api`'s endpoint on this worker.
    ///
    /// # Errors
    /// The base URL does not parse (admission of the worker validates it, so only a URL
    /// that `reqwest` rejects gets here); the message names it.
    pub fn endpoint(&self, api: Api) -> Result<reqwest::Url, BadWorkerUrl> {
        let i = match api {
            Api::Chat => 0,
            Api::Completions => 1,
            Api::Generate => 2,
        };
        self.endpoints.as_ref().map(|e| e[i].clone()).ok_or_else(|| BadWorkerUrl { url: self.url.to_string() })
    }

    /// Its `host:port` (`[v6]:port` for an IPv6 host; the scheme's port when the URL names
    /// none): how a gateway names it in the endpoint-picker protocol. `None` for a URL
    /// without a host.
    pub fn authority(&self) -> Option<&str> {
        self.authority.as_deref()
    }

    /// The models it serves (empty: unknown, it serves any model).
    pub fn models(&self) -> arc_swap::Guard<Arc<Vec<String>>> {
        self.models.load()
    }

    /// Replaces the models it serves (rediscovery, a loaded adapter, a registration).
    /// Rosters are rebuilt only when the list differs from the one held.
    pub fn set_models(&self, models: Vec<String>) {
        if **self.models.load() == models {
            return;
        }
        self.models.store(Arc::new(models));
        roster_changed();
    }

    /// Its role.
    pub fn role(&self) -> Role {
        role_of(self.role.load(Relaxed))
    }

    /// Sets its role.
    pub fn set_role(&self, r: Role) {
        if self.role.swap(role_code(r), Relaxed) != role_code(r) {
            roster_changed();
        }
    }

    /// Health as the active checks see it.
    pub fn health(&self) -> Health {
        health_of(self.health.load(Relaxed))
    }

    /// Sets the health; returns the previous value.
    pub fn set_health(&self, h: Health) -> Health {
        let was = health_of(self.health.swap(health_code(h), Relaxed));
        if was != h {
            self.view_changed();
        }
        was
    }

    /// Marks this worker's view changed for the kept views ([`Fleet::decide_kept`]): every
    /// write of what [`WorkerEntry::view`] reads calls it after the write — health and
    /// ejection here, the load counters through [`AtomicLoad::watch`], and whoever stores
    /// [`WorkerEntry::signals`] ([`WorkerEntry::signals_stored`]). Capacity, role and
    /// models rebuild the rosters instead.
    #[inline]
    fn view_changed(&self) {
        if let Some(c) = self.changes.get() {
            c.mark(self.id);
        }
    }

    /// The engine signals ([`WorkerEntry::signals`]) were stored: call after storing them,
    /// so views kept between requests re-read them.
    pub fn signals_stored(&self) {
        self.view_changed();
    }

    /// Health checks found the worker down: sets it unhealthy and wakes every request
    /// waiting on it ([`WorkerEntry::marked_down`]). Returns the previous health.
    pub fn mark_down(&self) -> Health {
        let was = self.set_health(Health::Unhealthy);
        self.down.notify_waiters();
        was
    }

    /// Completes at the next [`WorkerEntry::mark_down`] after this call (created before
    /// the worker's health is read, it misses none: tokio's `Notify::notify_waiters`
    /// wakes every such future, polled yet or not).
    pub fn marked_down(&self) -> tokio::sync::futures::Notified<'_> {
        self.down.notified()
    }

    /// Whether requests to this worker name a llama.cpp slot.
    pub fn slot_routing(&self) -> bool {
        self.slot_routing.load(Relaxed)
    }

    /// Sets whether requests to this worker name a llama.cpp slot.
    pub fn set_slot_routing(&self, on: bool) {
        self.slot_routing.store(on, Relaxed);
    }

    /// What the join probe found: `Some(true)` a host-memory prompt cache, `Some(false)`
    /// none, `None` not probed or inconclusive.
    pub fn host_prompt_cache(&self) -> Option<bool> {
        match self.host_prompt_cache.load(Relaxed) {
            1 => Some(false),
            2 => Some(true),
            _ => None,
        }
    }

    /// Records what the join probe found ([`WorkerEntry::host_prompt_cache`]).
    pub fn set_host_prompt_cache(&self, found: Option<bool>) {
        self.host_prompt_cache.store(
            match found {
                None => 0,
                Some(false) => 1,
                Some(true) => 2,
            },
            Relaxed,
        );
    }

    /// Where the worker runs relative to this router.
    pub fn locality(&self) -> crate::model::locality::Locality {
        crate::model::locality::Locality::from_u8(self.locality.load(Relaxed))
    }

    /// Sets where the worker runs relative to this router.
    pub fn set_locality(&self, l: crate::model::locality::Locality) {
        self.locality.store(l as u8, Relaxed);
    }

    /// Whether failed requests took the worker out (until an inference probe passes).
    pub fn is_ejected(&self) -> bool {
        self.ejected.load(Relaxed)
    }

    /// Routable: healthy and not ejected.
    pub fn is_routable(&self) -> bool {
        self.health() == Health::Healthy && !self.is_ejected()
    }

    /// Whether the worker serves `model` (an empty name or unknown models serve any).
    pub fn serves(&self, model: &str) -> bool {
        let models = self.models();
        model.is_empty() || models.is_empty() || models.iter().any(|m| m == model)
    }

    /// A failed request on this worker. Returns `true` when it has now failed
    /// `max_in_a_row` requests in a row and is not already ejected: the caller decides
    /// whether to eject it ([`Fleet::try_eject`], which caps how many may be out).
    pub fn record_failure(&self, max_in_a_row: u32, now: Nanos) -> bool {
        self.last_failure_at.store(now.0.max(1), Relaxed);
        let n = self.consecutive_failures.fetch_add(1, Relaxed) + 1;
        n >= max_in_a_row.max(1) && !self.is_ejected()
    }

    /// Takes the worker out of routing; its first inference probe is due after the
    /// backoff, which doubles with each ejection in a row. `false` if it already was out.
    fn eject(&self, now: Nanos) -> bool {
        if self.ejected.swap(true, Relaxed) {
            return false;
        }
        self.view_changed();
        let k = self.ejections.fetch_add(1, Relaxed).min(16);
        let wait = PROBE_BACKOFF_START.0.saturating_mul(1 << k).min(PROBE_BACKOFF_MAX.0);
        self.probe_at.store(now.0.saturating_add(wait), Relaxed);
        true
    }

    /// A request succeeded on this worker. An ejected worker that served a request (one
    /// sent before its ejection, or the last-resort try when every worker is out) is back
    /// in routing: a real answer is the evidence the inference probe looks for.
    pub fn record_success(&self) {
        if self.consecutive_failures.load(Relaxed) != 0 {
            self.consecutive_failures.store(0, Relaxed);
        }
        if self.is_ejected() {
            self.ejected.store(false, Relaxed);
            self.view_changed();
        } else if self.ejections.load(Relaxed) != 0 {
            self.ejections.store(0, Relaxed);
        }
    }

    /// Whether an inference probe of this ejected worker is due at `now`.
    pub fn probe_due(&self, now: Nanos) -> bool {
        self.is_ejected() && now.0 >= self.probe_at.load(Relaxed)
    }

    /// The outcome of an inference probe: a pass readmits the worker; a failure schedules
    /// the next probe after a doubled wait (capped at [`PROBE_BACKOFF_MAX`]).
    pub fn probe_result(&self, passed: bool, now: Nanos) {
        if passed {
            self.consecutive_failures.store(0, Relaxed);
            if self.ejected.swap(false, Relaxed) {
                self.view_changed();
            }
        } else {
            let k = self.ejections.fetch_add(1, Relaxed).min(16);
            let wait = PROBE_BACKOFF_START.0.saturating_mul(1 << k).min(PROBE_BACKOFF_MAX.0);
            self.probe_at.store(now.0.saturating_add(wait), Relaxed);
        }
    }

    /// The routing core's view of this worker now.
    pub fn view(&self) -> WorkerView {
        self.view_in_fleet(true)
    }

    /// [`WorkerEntry::view`], adding the other replicas' load only when `remote`.
    fn view_in_fleet(&self, remote: bool) -> WorkerView {
        let mut v = WorkerView::idle(self.id);
        self.fill_view(&mut v, self.core_capacity(), self.role(), remote);
        v
    }

    /// Writes this worker's view into `v` (whose `id` must be this worker's), with its
    /// `capacity` and `role` as the caller read them (a roster keeps both, so a request's
    /// candidate read does not load them per worker), and the other replicas' load when
    /// `remote` ([`Fleet::count_remote_load`]). Every other field is read now.
    #[inline]
    fn fill_view(&self, v: &mut WorkerView, capacity: kvroute_core::types::Capacity, role: Role, remote: bool) {
        v.health = if self.is_ejected() { Health::Unhealthy } else { self.health() };
        self.load.fill(v);
        if remote {
            let remote = self.remote_load.get();
            v.in_flight = v.in_flight.saturating_add(remote.in_flight);
            v.waiting = v.waiting.saturating_add(remote.waiting);
            v.pending_prefill_tokens = v.pending_prefill_tokens.saturating_add(remote.pending_prefill_tokens);
            v.decode_tokens = v.decode_tokens.saturating_add(remote.decode_tokens);
        }
        v.capacity = capacity;
        v.role = role;
        v.tie_key = Some(self.tie_key);
        let s = &self.signals;
        v.engine_queue = s.queue.get();
        v.engine_running = s.running.get();
        v.kv_cache_usage = s.kv_cache_usage.get();
        v.sm_util = s.sm_util.get();
        v.power_watts = s.power_watts.get();
        if let Some(n) = s.slots.get() {
            v.capacity.max_concurrent = n.max(1);
        }
    }

    /// A serialisable copy for the admin API.
    pub fn snapshot(&self) -> WorkerInfo {
        let s = &self.signals;
        WorkerInfo {
            id: self.id.0,
            url: self.url.to_string(),
            models: self.models().as_ref().clone(),
            health: if self.is_ejected() { Health::Unhealthy } else { self.health() },
            ejected: self.is_ejected(),
            locality: self.locality(),
            slot_routing: self.slot_routing(),
            host_prompt_cache: self.host_prompt_cache(),
            consecutive_failures: self.consecutive_failures.load(Relaxed),
            check_failures: self.check_failures.load(Relaxed),
            check_successes: self.check_successes.load(Relaxed),
            engine_queue: s.queue.get(),
            engine_running: s.running.get(),
            kv_cache_usage: s.kv_cache_usage.get(),
            sm_util: s.sm_util.get(),
            power_watts: s.power_watts.get(),
            slots: s.slots.get(),
            engine_hit_ratio: s.hit_ratio.get(),
            in_flight: self.load.get().in_flight,
            remote_in_flight: self.remote_load.get().in_flight,
            registration: self.registration.load_full().map(|r| r.as_ref().clone()),
            registration_stale: self.registration_stale.load(Relaxed),
            capacity: self.capacity(),
            role: self.role(),
            bootstrap_port: self.bootstrap_port.get(),
        }
    }
}

/// One worker as the admin API shows it (`GET /workers`).
#[derive(Debug, Clone, Serialize)]
pub struct WorkerInfo {
    /// Dense id.
    pub id: u32,
    /// Base URL.
    pub url: String,
    /// Models served (empty = unknown: serves any model).
    pub models: Vec<String>,
    /// Routability.
    pub health: Health,
    /// Out of routing after failed requests, until an inference probe passes.
    pub ejected: bool,
    /// Where it runs relative to this router (`[locality]`): `node`, `zone` or `other`.
    pub locality: crate::model::locality::Locality,
    /// Whether requests to it name a llama.cpp slot (`llama_slot_routing`).
    pub slot_routing: bool,
    /// What the `auto` probe found of a host-memory prompt cache (llama.cpp `--cache-ram`):
    /// true, false, or null when not probed or inconclusive.
    pub host_prompt_cache: Option<bool>,
    /// Consecutive failed requests.
    pub consecutive_failures: u32,
    /// Consecutive failed active checks.
    pub check_failures: u32,
    /// Consecutive passed active checks while unhealthy.
    pub check_successes: u32,
    /// Engine queue length from `/metrics`.
    pub engine_queue: Option<u32>,
    /// Engine running requests from `/metrics`.
    pub engine_running: Option<u32>,
    /// Engine KV cache usage in [0, 1] from `/metrics`.
    pub kv_cache_usage: Option<f64>,
    /// Compute utilisation in [0, 1], when exported.
    pub sm_util: Option<f64>,
    /// Power draw, watts.
    pub power_watts: Option<f64>,
    /// Decode slots (llama.cpp).
    pub slots: Option<u32>,
    /// Engine-reported prefix-cache hit ratio.
    pub engine_hit_ratio: Option<f64>,
    /// Requests this router replica has in flight on this worker.
    pub in_flight: u32,
    /// Requests the other replicas of the cluster report in flight on it (NATS sync).
    pub remote_in_flight: u32,
    /// Its cluster registration (etcd), when it has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub registration: Option<crate::model::registration::WorkerRecord>,
    /// Whether `registration` is the last known one read from `state_dir` because etcd
    /// has not answered since this replica started (the worker may have left meanwhile);
    /// false once etcd's own list replaced it.
    pub registration_stale: bool,
    /// Resolved capacity facts (configuration over registration over the worker's own
    /// report); fields no source states are absent and take their defaults.
    pub capacity: crate::model::capacity::Capacity,
    /// Role: prefill, decode or both.
    pub role: Role,
    /// Bootstrap server port (SGLang prefill workers), when known.
    pub bootstrap_port: Option<u32>,
}

/// The candidates of one request: the workers serving its model, with their views.
#[derive(Debug)]
pub struct Candidates {
    /// Views in the order of `entries`.
    pub views: Vec<WorkerView>,
    /// The workers: the fleet's roster of the model, shared between requests (no
    /// per-worker reference count is touched on a request's way), until
    /// [`Candidates::retain`] narrows it.
    pub entries: Arc<[Arc<WorkerEntry>]>,
    /// Each worker's dispatch count ([`kvroute_core::ledger::AtomicLoad::dispatches`]) when
    /// its view was read, in the order of `entries`.
    pub dispatches: Vec<u64>,
    /// Set when the decision read the model's kept views ([`Fleet::decide_kept`]): then
    /// `views` and `dispatches` are empty, and only the chosen worker's position and
    /// dispatch count are held; [`Candidates::decided_views`] reads the views again.
    kept: Option<KeptPick>,
}

/// What a decision made on kept views leaves of them: the chosen worker's id, position
/// among the candidates and dispatch count when its kept view was read.
#[derive(Debug, Clone, Copy)]
struct KeptPick {
    chosen: Option<(WorkerId, usize, u64)>,
    /// Whether the views add other replicas' load ([`Fleet::count_remote_load`]).
    remote: bool,
}

impl Candidates {
    /// Worker `id`'s dispatch count when its view was read (`None` if it is not a
    /// candidate, or, after a decision on kept views, not the chosen worker): the decision
    /// made on that view holds only while the count is unchanged
    /// ([`kvroute_core::ledger::AtomicLoad::dispatched_if`]).
    pub fn dispatches_seen(&self, id: WorkerId) -> Option<u64> {
        if let Some(k) = self.kept {
            return k.chosen.filter(|c| c.0 == id).map(|c| c.2);
        }
        self.entries.iter().zip(&self.dispatches).find(|(e, _)| e.id == id).map(|(_, n)| *n)
    }

    /// The worker with id `id` among the candidates.
    pub fn entry(&self, id: WorkerId) -> Option<&Arc<WorkerEntry>> {
        if let Some((_, pos, _)) = self.kept.and_then(|k| k.chosen).filter(|c| c.0 == id) {
            return self.entries.get(pos);
        }
        self.entries.iter().find(|e| e.id == id)
    }

    /// The views the decision read, for what orders the other candidates after it (the
    /// retry order, `/debug/route`'s fallbacks). After a decision on kept views
    /// ([`Fleet::decide_kept`]) they are read again now: O(candidates), paid only by a
    /// request that asks for more than its chosen worker.
    pub fn decided_views(&self) -> std::borrow::Cow<'_, [WorkerView]> {
        match self.kept {
            Some(k) if self.views.is_empty() => {
                std::borrow::Cow::Owned(self.entries.iter().map(|w| w.view_in_fleet(k.remote)).collect())
            }
            _ => std::borrow::Cow::Borrowed(&self.views),
        }
    }

    /// Keeps the candidates whose entry satisfies `keep` (views and dispatch counts with
    /// them).
    pub fn retain(&mut self, mut keep: impl FnMut(&WorkerEntry) -> bool) {
        if self.kept.is_some() {
            // Decided on kept views: read them now, as a candidate read would have.
            self.dispatches = self.entries.iter().map(|w| w.load.dispatches()).collect();
            self.views = self.decided_views().into_owned();
            self.kept = None;
        }
        let kept: Vec<bool> = self.entries.iter().map(|e| keep(e)).collect();
        if kept.iter().all(|k| *k) {
            return;
        }
        let mut k = kept.iter();
        self.views.retain(|_| *k.next().unwrap_or(&false));
        self.entries = self.entries.iter().zip(&kept).filter(|(_, k)| **k).map(|(e, _)| Arc::clone(e)).collect();
        let mut k = kept.iter();
        self.dispatches.retain(|_| *k.next().unwrap_or(&false));
    }
}

/// Most (model, roles) rosters a fleet keeps; past it the cache starts afresh (a client
/// naming many models, each served by a worker that lists none, cannot grow it).
const MAX_ROSTERS: usize = 64;

/// Bumped after every change of what a roster holds: the worker list, a worker's models,
/// role or capacity. One counter for the process (a change in one fleet makes the others
/// rebuild theirs once; changes are rare next to requests).
static ROSTER_EPOCH: AtomicU64 = AtomicU64::new(0);

/// Invalidates every fleet's rosters (call after the change is stored).
fn roster_changed() {
    ROSTER_EPOCH.fetch_add(1, std::sync::atomic::Ordering::Release);
}

/// The workers of one model and set of roles, in list order, with the facts of each that
/// change only with an epoch (capacity, role): what a request's candidate read starts from
/// instead of the whole worker list.
#[derive(Debug)]
struct Roster {
    entries: Arc<[Arc<WorkerEntry>]>,
    facts: Vec<(kvroute_core::types::Capacity, Role)>,
    /// The views kept between requests ([`Fleet::decide_kept`]): one per deciding thread
    /// at most ([`kept_copies`]), each behind its own lock that a decision only tries.
    kept: Box<[Mutex<Option<Kept>>]>,
}

impl Roster {
    /// Reads the view of the worker at `pos` into `v`, its idle view
    /// ([`WorkerView::idle`]) — its capacity and role as the roster keeps them (so they are
    /// not loaded per worker), every other field now, the other replicas' load when
    /// `remote` ([`Fleet::count_remote_load`]) — and returns its dispatch count, read just
    /// before the view.
    #[inline]
    fn read_into(&self, pos: usize, remote: bool, v: &mut WorkerView) -> u64 {
        let (w, &(capacity, role)) = (&self.entries[pos], &self.facts[pos]);
        let dispatches = w.load.dispatches();
        w.fill_view(v, capacity, role, remote);
        dispatches
    }

    /// Every worker's view and dispatch count ([`Roster::read_into`]), in roster order.
    fn read_all(&self, remote: bool) -> (Vec<WorkerView>, Vec<u64>) {
        let n = self.entries.len();
        let (mut views, mut dispatches) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for (pos, w) in self.entries.iter().enumerate() {
            views.push(WorkerView::idle(w.id));
            if let Some(v) = views.last_mut() {
                dispatches.push(self.read_into(pos, remote, v));
            }
        }
        (views, dispatches)
    }
}

/// How many kept copies of a roster's views decisions may use at once: the threads that
/// can decide at the same time (at most [`kvroute_core::view_changes::MAX_READERS`] / 2,
/// so two rosters in use at once can each have their copies). A decision that finds every
/// copy taken reads the candidates as without kept views.
fn kept_copies() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| {
        std::thread::available_parallelism()
            .map_or(2, std::num::NonZeroUsize::get)
            .clamp(1, kvroute_core::view_changes::MAX_READERS / 2)
    })
}

/// One kept copy of a roster's views, and their digest: brought up to date at each
/// decision by re-reading the workers whose views changed since ([`ViewChanges`]).
#[derive(Debug)]
struct Kept {
    /// The router whose policy's digest this is ([`Fleet::decide_kept`]'s `owner`).
    owner: u64,
    /// Whether the views add other replicas' load.
    remote: bool,
    reader: ChangeReader,
    views: Vec<WorkerView>,
    /// Each worker's dispatch count when its view was read.
    dispatches: Vec<u64>,
    digest: FleetDigest,
    /// The positions of the workers marked by bit `b` of the reader's marks:
    /// `by_bit[starts[b]..starts[b + 1]]` (compressed rows; a bit names several workers
    /// only when their ids are equal modulo the marks' capacity).
    starts: Vec<u32>,
    by_bit: Vec<u32>,
}

impl Kept {
    /// Reads every view of `roster` for a reader of `changes` (`None` when every reader
    /// slot is taken).
    fn new(
        roster: &Roster,
        changes: &Arc<ViewChanges>,
        owner: u64,
        remote: bool,
        digest: &FleetDigest,
    ) -> Option<Kept> {
        let mut reader = changes.reader()?;
        // Drained before the views are read: a change from now on is marked again.
        reader.drain(|_| {});
        let (views, dispatches) = roster.read_all(remote);
        let n = views.len();
        let mut digest = digest.clone();
        digest.refresh(&views);
        let cap = changes.capacity();
        let mut starts = vec![0u32; cap + 1];
        for w in roster.entries.iter() {
            starts[changes.bit(w.id) + 1] += 1;
        }
        for b in 0..cap {
            starts[b + 1] += starts[b];
        }
        let mut by_bit = vec![0u32; n];
        let mut next = starts.clone();
        for (pos, w) in roster.entries.iter().enumerate() {
            let b = changes.bit(w.id);
            by_bit[next[b] as usize] = pos as u32;
            next[b] += 1;
        }
        Some(Kept { owner, remote, reader, views, dispatches, digest, starts, by_bit })
    }

    /// Re-reads the views of the workers marked since the last call, and updates the
    /// digest with each.
    fn catch_up(&mut self, roster: &Roster) {
        let Kept { reader, views, dispatches, digest, starts, by_bit, remote, .. } = self;
        reader.drain(|b| {
            for &pos in &by_bit[starts[b] as usize..starts[b + 1] as usize] {
                let pos = pos as usize;
                views[pos] = WorkerView::idle(roster.entries[pos].id);
                dispatches[pos] = roster.read_into(pos, *remote, &mut views[pos]);
                digest.update(pos, &views[pos]);
            }
        });
    }
}

/// The rosters built at one epoch, by model and then by role mask ([`role_mask`]).
#[derive(Debug, Default)]
struct Rosters {
    epoch: u64,
    by_model: std::collections::HashMap<Box<str>, [Option<Arc<Roster>>; 8]>,
}

/// `roles` as a bit set (bit `role_code(r)`); `None` is every role.
fn role_mask(roles: Option<&[Role]>) -> usize {
    roles.map_or(0b111, |rs| rs.iter().fold(0, |m, r| m | 1 << role_code(*r)))
}

/// The worker list as one membership change left it: the workers in the order they
/// joined (so by ascending [`WorkerId`]), and an index by URL. Reads as the list
/// (`Deref` to `Vec<Arc<WorkerEntry>>`).
#[derive(Debug, Default)]
pub struct Listing {
    workers: Vec<Arc<WorkerEntry>>,
    /// Each worker's position in `workers`, by its URL as the table spells it.
    by_url: std::collections::HashMap<Arc<str>, usize, foldhash::fast::FixedState>,
}

impl Listing {
    fn new(workers: Vec<Arc<WorkerEntry>>) -> Self {
        let by_url = workers.iter().enumerate().map(|(i, w)| (Arc::clone(&w.url), i)).collect();
        Listing { workers, by_url }
    }

    /// The worker whose URL is spelled `url` (no normalisation).
    pub fn by_url(&self, url: &str) -> Option<&Arc<WorkerEntry>> {
        self.by_url.get(url).map(|&i| &self.workers[i])
    }

    /// The worker with `id` (a binary search: the list is in ascending id order).
    pub fn by_id(&self, id: WorkerId) -> Option<&Arc<WorkerEntry>> {
        self.workers.binary_search_by_key(&id, |w| w.id).ok().map(|i| &self.workers[i])
    }
}

impl std::ops::Deref for Listing {
    type Target = Vec<Arc<WorkerEntry>>;

    fn deref(&self) -> &Self::Target {
        &self.workers
    }
}

/// The worker list, swapped whole on membership changes.
#[derive(Debug, Default)]
pub struct Fleet {
    list: ArcSwap<Listing>,
    /// Serialises membership changes and ejections (never taken on a request's way to a
    /// worker; only when a worker reaches its failure threshold).
    writer: Mutex<()>,
    next_id: AtomicU32,
    /// The workers of each model a request named, kept until the next roster change.
    rosters: ArcSwap<Rosters>,
    /// Whether views add the load other replicas report ([`WorkerEntry::remote_load`]):
    /// set with the cluster sync ([`Fleet::count_remote_load`]). Without it that load is
    /// always zero, and a request's candidate read skips the cache line it sits on.
    remote_load: AtomicBool,
    /// Marked by each worker whose view changes, read by the kept views.
    changes: FleetChanges,
}

/// A fleet's [`ViewChanges`], one bit per worker id modulo [`MAX_WORKERS`].
#[derive(Debug)]
struct FleetChanges(Arc<ViewChanges>);

impl Default for FleetChanges {
    fn default() -> Self {
        FleetChanges(Arc::new(ViewChanges::new(MAX_WORKERS)))
    }
}

/// A worker URL `reqwest` cannot build a request URL from.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{url}: not a valid URL")]
pub struct BadWorkerUrl {
    /// The worker's URL.
    pub url: String,
}

/// The worker table is full: a gateway serves at most [`MAX_WORKERS`] workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the gateway already has {max} workers")]
pub struct FleetFull {
    /// [`MAX_WORKERS`].
    pub max: usize,
}

impl Fleet {
    /// The current list (one atomic load).
    pub fn load(&self) -> arc_swap::Guard<Arc<Listing>> {
        self.list.load()
    }

    /// The worker with `url` (a hash look-up).
    pub fn by_url(&self, url: &str) -> Option<Arc<WorkerEntry>> {
        let list = self.list.load();
        // Most callers pass a URL as the table spells it (a peer's event, a worker's own
        // KV-event endpoint): no parse then.
        if let Some(w) = list.by_url(url) {
            return Some(Arc::clone(w));
        }
        list.by_url(&normalised(url)).cloned()
    }

    /// The worker with `id`.
    pub fn by_id(&self, id: WorkerId) -> Option<Arc<WorkerEntry>> {
        self.list.load().by_id(id).cloned()
    }

    /// Adds a worker unless one with `url` exists; returns it and whether it is new.
    ///
    /// # Errors
    /// The table is full ([`MAX_WORKERS`]).
    pub fn add(&self, url: &str, models: Vec<String>, health: Health) -> Result<(Arc<WorkerEntry>, bool), FleetFull> {
        self.add_with(url, models, health, |_| {})
    }

    /// [`Fleet::add`], with `setup` run on a new entry before it joins the list (so no
    /// request sees it half set up).
    ///
    /// # Errors
    /// As [`Fleet::add`].
    pub fn add_with(
        &self,
        url: &str,
        models: Vec<String>,
        health: Health,
        setup: impl FnOnce(&WorkerEntry),
    ) -> Result<(Arc<WorkerEntry>, bool), FleetFull> {
        let _w = self.writer.lock();
        let cur = self.list.load_full();
        if let Some(w) = cur.by_url(url) {
            return Ok((Arc::clone(w), false));
        }
        if cur.len() >= MAX_WORKERS {
            return Err(FleetFull { max: MAX_WORKERS });
        }
        let id = WorkerId(self.next_id.fetch_add(1, Relaxed));
        let entry = WorkerEntry::new(id, url, models, health);
        let changes = &self.changes.0;
        let _ = entry.changes.set(Arc::clone(changes));
        entry.load.watch(Arc::clone(changes), id);
        entry.remote_load.watch(Arc::clone(changes), id);
        setup(&entry);
        let entry = Arc::new(entry);
        let mut next = Vec::with_capacity(cur.len() + 1);
        next.extend(cur.iter().cloned());
        next.push(Arc::clone(&entry));
        self.list.store(Arc::new(Listing::new(next)));
        roster_changed();
        Ok((entry, true))
    }

    /// Removes the worker with `url`; returns it when it existed.
    pub fn remove(&self, url: &str) -> Option<Arc<WorkerEntry>> {
        let _w = self.writer.lock();
        let cur = self.list.load_full();
        let url = normalised(url);
        let gone = cur.by_url(&url).cloned()?;
        let next: Vec<Arc<WorkerEntry>> = cur.iter().filter(|w| w.id != gone.id).cloned().collect();
        self.list.store(Arc::new(Listing::new(next)));
        roster_changed();
        // The stale rosters would keep the removed worker alive until the next rebuild.
        self.rosters.store(Arc::default());
        Some(gone)
    }

    /// Ejects `w` unless that would put more than `max_share` of the fleet's workers out
    /// (rounded down; Envoy's outlier detection caps ejections the same way,
    /// `max_ejection_percent`). Returns whether `w` was ejected.
    pub fn try_eject(&self, w: &WorkerEntry, max_share: f64, now: Nanos) -> bool {
        let _w = self.writer.lock();
        let list = self.list.load();
        let out = list.iter().filter(|x| x.is_ejected()).count();
        let cap = (max_share.clamp(0.0, 1.0) * list.len() as f64 + 1e-9).floor() as usize;
        out < cap && w.eject(now)
    }

    /// The workers serving `model` and their views. When none of them is routable but some
    /// were only ejected (their health checks pass), the least recently failed of those is
    /// offered as routable: the router keeps trying one worker instead of answering 503 to
    /// everyone, and a success there brings it back.
    pub fn candidates(&self, model: &str) -> Candidates {
        self.candidates_in(model, None)
    }

    /// Makes every view from now on add the load other replicas report on each worker
    /// ([`WorkerEntry::remote_load`]): called once at start with the cluster sync, before
    /// any request. Without it views leave that load out (it is zero without the sync).
    pub fn count_remote_load(&self) {
        self.remote_load.store(true, Relaxed);
    }

    /// [`Fleet::candidates`] among the workers of one of `roles` (`None`: any role).
    ///
    /// The workers come from the model's roster (kept between requests, rebuilt after the
    /// list or a worker's models, role or capacity change); each one's view is read now.
    /// O(workers of the model), a few atomic loads each.
    pub fn candidates_in(&self, model: &str, roles: Option<&[Role]>) -> Candidates {
        let roster = self.roster(model, roles);
        let (mut views, dispatches) = roster.read_all(self.remote_load.load(Relaxed));
        let entries = Arc::clone(&roster.entries);
        // The views just read (an ejected worker's says unhealthy): the same snapshot the
        // policy decides on, not the entries' atomics read a second time.
        if !views.iter().any(WorkerView::is_routable) {
            let last_resort = entries
                .iter()
                .enumerate()
                .filter(|(_, w)| w.is_ejected() && w.health() == Health::Healthy)
                .min_by_key(|(_, w)| w.last_failure_at.load(Relaxed))
                .map(|(i, _)| i);
            if let Some(i) = last_resort {
                views[i].health = Health::Healthy;
            }
        }
        Candidates { views, entries, dispatches, kept: None }
    }

    /// Decides on the views of `model`'s workers (every role) kept between requests, with
    /// their digest: `decide` is given the views and the digest and returns its result and
    /// the worker it chose. Before it runs, only the workers whose views changed since this
    /// copy's last decision are read again ([`ViewChanges`]), so a decision costs what the
    /// policy reads of the digest plus the changed workers, not a read of every worker.
    ///
    /// `owner` names the policy the digest is for (one kept copy serves one router);
    /// `digest` is an empty digest of that policy's kind ([`kvroute_core::Policy::fleet_digest`]),
    /// cloned and filled when a copy is first built (O(workers log workers), once per
    /// roster change).
    ///
    /// `None` — decide on [`Fleet::candidates`] instead — when the model has no worker, no
    /// worker is routable (that read offers the last resort), or every kept copy is in use
    /// by other decisions or was built for another owner and every change-reader slot is
    /// taken. Never waits for a lock.
    pub fn decide_kept<R>(
        &self,
        model: &str,
        owner: u64,
        digest: &FleetDigest,
        decide: impl FnOnce(&[WorkerView], &FleetDigest) -> (R, Option<WorkerId>),
    ) -> Option<(R, Candidates)> {
        let roster = self.roster(model, None);
        if roster.entries.is_empty() {
            return None;
        }
        let remote = self.remote_load.load(Relaxed);
        let fits = |k: &Option<Kept>| k.as_ref().is_some_and(|k| k.owner == owner && k.remote == remote);
        // A free copy built for this owner; else a free empty one; else any free one.
        let mut spare = None;
        let mut found = None;
        for m in roster.kept.iter() {
            let Some(g) = m.try_lock() else { continue };
            if fits(&g) {
                found = Some(g);
                break;
            }
            if spare.as_ref().is_none_or(|s: &parking_lot::MutexGuard<'_, Option<Kept>>| s.is_some() && g.is_none()) {
                spare = Some(g);
            }
        }
        let mut slot = match found {
            Some(g) => g,
            None => {
                let mut g = spare?;
                // Built for one owner: the old copy's reader slot is freed first.
                *g = None;
                *g = Some(Kept::new(&roster, &self.changes.0, owner, remote, digest)?);
                g
            }
        };
        let kept = slot.as_mut()?;
        kept.catch_up(&roster);
        if kept.digest.routable_count() == 0 {
            return None;
        }
        let (r, chosen) = decide(&kept.views, &kept.digest);
        let chosen = chosen.and_then(|id| {
            let pos = kept.digest.position(id)?;
            Some((id, pos, kept.dispatches[pos]))
        });
        let candidates = Candidates {
            views: Vec::new(),
            entries: Arc::clone(&roster.entries),
            dispatches: Vec::new(),
            kept: Some(KeptPick { chosen, remote }),
        };
        Some((r, candidates))
    }

    /// The roster of `model` and `roles`: the cached one when no change happened since it
    /// was built, else built from the list now (and kept, when it has a worker).
    fn roster(&self, model: &str, roles: Option<&[Role]>) -> Arc<Roster> {
        let mask = role_mask(roles);
        // Read before the list: a change after this read bumps the epoch past it, so a
        // roster built from older state is never taken for a newer one.
        let epoch = ROSTER_EPOCH.load(std::sync::atomic::Ordering::Acquire);
        let cached = self.rosters.load();
        if cached.epoch == epoch
            && let Some(r) = cached.by_model.get(model).and_then(|by_role| by_role[mask].as_ref())
        {
            return Arc::clone(r);
        }
        let list = self.list.load();
        let entries: Arc<[Arc<WorkerEntry>]> =
            list.iter().filter(|w| w.serves(model) && roles.is_none_or(|r| r.contains(&w.role()))).cloned().collect();
        let facts = entries.iter().map(|w| (w.core_capacity(), w.role())).collect();
        let kept = (0..kept_copies()).map(|_| Mutex::new(None)).collect();
        let roster = Arc::new(Roster { entries, facts, kept });
        if !roster.entries.is_empty() {
            self.rosters.rcu(|cur| {
                let mut by_model = if cur.epoch == epoch && cur.by_model.len() < MAX_ROSTERS {
                    cur.by_model.clone()
                } else if cur.epoch > epoch {
                    // Another request built at a newer epoch: leave its rosters.
                    return Arc::clone(cur);
                } else {
                    std::collections::HashMap::new()
                };
                by_model.entry(model.into()).or_default()[mask] = Some(Arc::clone(&roster));
                Arc::new(Rosters { epoch, by_model })
            });
        }
        roster
    }

    /// Models served by routable workers, sorted and deduplicated.
    pub fn models(&self) -> Vec<String> {
        let mut m: Vec<String> =
            self.list.load().iter().filter(|w| w.is_routable()).flat_map(|w| w.models().as_ref().clone()).collect();
        m.sort();
        m.dedup();
        m
    }
}

/// Most power readings kept per worker (a 30 s window at the fastest health interval).
pub const POWER_SAMPLES: usize = 1024;

/// A worker's recent power readings: their mean over the window (Cognitora cgn-router's
/// rolling average), so one scrape's spike moves routing by its share of the window only.
#[derive(Debug, Default)]
pub struct PowerWindow {
    samples: std::collections::VecDeque<(Instant, f64)>,
}

impl PowerWindow {
    /// Adds `reading` (watts; `None` when the scrape had none) taken at `now`, forgets
    /// readings older than `window`, and returns the mean of those left (`None` without
    /// any). A zero window keeps only the last reading.
    pub fn observe(&mut self, now: Instant, reading: Option<f64>, window: Duration) -> Option<f64> {
        if let Some(x) = reading.filter(|x| x.is_finite() && *x >= 0.0) {
            if self.samples.len() >= POWER_SAMPLES {
                self.samples.pop_front();
            }
            self.samples.push_back((now, x));
        }
        while let Some(&(t, _)) = self.samples.front() {
            let keep = if window.is_zero() { self.samples.len() == 1 } else { now.duration_since(t) <= window };
            if keep {
                break;
            }
            self.samples.pop_front();
        }
        (!self.samples.is_empty()).then(|| self.samples.iter().map(|(_, x)| x).sum::<f64>() / self.samples.len() as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kept views of `model` (read through [`Fleet::decide_kept`] for `owner`) and
    /// whether their digest describes them; `None` when no kept copy decided.
    fn kept_views(f: &Fleet, model: &str, owner: u64, digest: &FleetDigest) -> Option<(Vec<WorkerView>, bool)> {
        f.decide_kept(model, owner, digest, |views, d| ((views.to_vec(), d.describes(views)), None)).map(|(r, _)| r)
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(128))]

        /// Whatever changes the workers' health, ejection, load (this replica's and the
        /// others'), signals, capacity or membership between decisions, the views kept
        /// between them are what a fresh read of every worker gives, and their digest
        /// describes them — for two routers sharing the kept copies in turn.
        #[test]
        fn kept_views_are_what_a_fresh_read_gives(
            remote in proptest::prelude::any::<bool>(),
            ops in proptest::collection::vec((0u8..23, 0u16..64, 0u16..4096), 1..160),
        ) {
            let f = Fleet::default();
            if remote {
                f.count_remote_load();
            }
            let mut workers: Vec<Arc<WorkerEntry>> = (0..6)
                .map(|i| f.add(&format!("http://w{i}:8000"), vec![], Health::Healthy).expect("room").0)
                .collect();
            let mut tickets: Vec<kvroute_core::ledger::LoadTicket> = Vec::new();
            let digests = [FleetDigest::default(), FleetDigest::with_terms(&kvroute_core::policy::kv_score::KV_SCORE_TERMS)];
            let mut added = 6;
            for (step, (op, a, b)) in ops.into_iter().enumerate() {
                let w = Arc::clone(&workers[usize::from(a) % workers.len()]);
                let now = Nanos::from_secs(u64::from(b));
                // Changes of membership and capacity (which rebuild the kept copies) are
                // rarer than the others, so most decisions catch up on marked changes.
                let op = if op < 20 { op % 10 } else { op - 10 };
                match op {
                    0 | 1 => tickets.push(w.load.dispatched(u64::from(b), u64::from(a))),
                    2 => tickets.push(w.remote_load.dispatched(u64::from(b), 1)),
                    3 => {
                        let n = tickets.len().max(1);
                        if let Some(t) = tickets.get_mut(usize::from(b) % n) { t.first_token() }
                    }
                    4 if !tickets.is_empty() => { tickets.swap_remove(usize::from(b) % tickets.len()); }
                    5 => { w.set_health(if b % 2 == 0 { Health::Unhealthy } else { Health::Healthy }); }
                    6 => { f.try_eject(&w, 0.5, now); }
                    7 => w.record_success(),
                    8 => w.probe_result(b % 2 == 0, now),
                    9 => {
                        w.signals.queue.set(Some(u32::from(b)));
                        w.signals.kv_cache_usage.set(Some(f64::from(b) / 4096.0));
                        w.signals.slots.set((b % 3 == 0).then_some(u32::from(a) + 1));
                        w.signals_stored();
                    }
                    10 => {
                        let c = crate::model::capacity::Capacity { max_concurrent: Some(u32::from(a) + 1), ..Default::default() };
                        w.set_capacity(CapacitySource::Config, Some(c));
                    }
                    11 if workers.len() < 12 => {
                        workers.push(f.add(&format!("http://w{added}:8000"), vec![], Health::Healthy).expect("room").0);
                        added += 1;
                    }
                    12 if workers.len() > 1 => {
                        f.remove(&w.url);
                        workers.retain(|x| x.id != w.id);
                    }
                    _ => {}
                }
                // Decide now and then (not after every change), alternating two owners.
                if step % 3 == 0 {
                    let owner = (step / 60 % 2) as u64;
                    let fresh = f.candidates("m");
                    match kept_views(&f, "m", owner, &digests[owner as usize]) {
                        Some((views, described)) => {
                            proptest::prop_assert_eq!(&views, &fresh.views);
                            proptest::prop_assert!(described);
                        }
                        // Only when no worker is routable (the fresh read offers the last resort).
                        None => proptest::prop_assert!(!fresh.entries.iter().any(|w| w.is_routable())),
                    }
                }
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(32))]

        /// After any sequence of adds and removals the look-ups by URL (as the table spells
        /// it, or with a trailing slash) and by id find what a scan of the list finds.
        #[test]
        fn look_ups_by_url_and_id_find_what_a_scan_finds(ops in proptest::collection::vec((proptest::prelude::any::<bool>(), 0u8..24), 1..80)) {
            let f = Fleet::default();
            let url = |i: u8| format!("http://127.0.0.1:{}", 9000 + u16::from(i));
            let mut max_id = 0;
            for (add, i) in ops {
                if add {
                    let (w, _) = f.add(&url(i), vec![], Health::Healthy).expect("room");
                    max_id = max_id.max(w.id.0);
                } else {
                    f.remove(&format!("{}/", url(i)));
                }
                let list = f.load();
                for j in 0..24 {
                    let scan = list.iter().find(|w| *w.url == *url(j)).map(|w| w.id);
                    proptest::prop_assert_eq!(f.by_url(&url(j)).map(|w| w.id), scan);
                    proptest::prop_assert_eq!(f.by_url(&format!("{}/", url(j))).map(|w| w.id), scan);
                }
                for id in 0..=max_id + 1 {
                    let scan = list.iter().find(|w| w.id.0 == id).map(|w| w.url.clone());
                    proptest::prop_assert_eq!(f.by_id(WorkerId(id)).map(|w| w.url.clone()), scan);
                }
            }
        }
    }

    #[test]
    fn a_decision_on_kept_views_holds_the_chosen_workers_dispatch_count() {
        let f = Fleet::default();
        let ws: Vec<_> =
            (0..3).map(|i| f.add(&format!("http://k{i}:8000"), vec![], Health::Healthy).expect("room").0).collect();
        let _open = ws[1].load.dispatched(10, 1);
        let d = FleetDigest::default();
        let (chosen, c) = f.decide_kept("m", 7, &d, |_, _| (ws[2].id, Some(ws[2].id))).expect("kept");
        assert_eq!(chosen, ws[2].id);
        assert_eq!(c.dispatches_seen(ws[2].id), Some(0));
        assert_eq!(c.dispatches_seen(ws[1].id), None, "only the chosen worker's count is held");
        assert_eq!(c.entry(ws[2].id).map(|w| w.id), Some(ws[2].id));
        assert_eq!(c.entry(ws[1].id).map(|w| w.id), Some(ws[1].id));
        // The retry order reads the views again: this replica's open request shows.
        assert_eq!(c.decided_views()[1].in_flight, 1);
        // A dispatch since is marked: the next decision re-reads that worker.
        let _t = ws[2].load.dispatched(5, 1);
        let (_, c) = f.decide_kept("m", 7, &d, |_, _| ((), Some(ws[2].id))).expect("kept");
        assert_eq!(c.dispatches_seen(ws[2].id), Some(1));
    }

    #[test]
    fn ejection_needs_failures_in_a_row_and_a_passing_probe_with_backoff() {
        let f = Fleet::default();
        let (w, _) = f.add("http://a", vec![], Health::Healthy).expect("add");
        let t = |s: u64| Nanos::from_secs(s);
        assert!(!w.record_failure(3, t(0)));
        w.record_success();
        assert!(!w.record_failure(3, t(0)));
        assert!(!w.record_failure(3, t(0)));
        assert!(w.record_failure(3, t(0)), "the third failure in a row reaches the threshold");
        assert!(f.try_eject(&w, 1.0, t(0)), "and ejects");
        assert!(!w.record_failure(3, t(0)), "an ejected worker is not ejected twice");
        assert!(!w.is_routable());
        assert!(!w.probe_due(t(0)));
        assert!(w.probe_due(t(1)), "first probe after 1 s");
        w.probe_result(false, t(1));
        assert!(!w.probe_due(t(2)));
        assert!(w.probe_due(t(5)), "then after 4 s (doubling per failed probe)");
        for i in 0..20 {
            w.probe_result(false, t(100 * i));
        }
        assert!(w.probe_due(t(1900 + 60)), "the wait is capped at 60 s");
        w.probe_result(true, t(2000));
        assert!(w.is_routable());
        assert_eq!(w.health(), Health::Healthy);
    }

    /// Fails `w` `n` times at second `at` and tries to eject it with the default share.
    fn fail(f: &Fleet, w: &WorkerEntry, n: u32, at: u64) -> bool {
        let mut ejected = false;
        for _ in 0..n {
            if w.record_failure(3, Nanos::from_secs(at)) {
                ejected |= f.try_eject(w, 0.5, Nanos::from_secs(at));
            }
        }
        ejected
    }

    #[test]
    fn candidates_follow_every_change_a_roster_keeps() {
        let f = Fleet::default();
        let ids = |f: &Fleet, model: &str, roles: Option<&[Role]>| -> Vec<u32> {
            let c = f.candidates_in(model, roles);
            assert_eq!((c.views.len(), c.dispatches.len()), (c.entries.len(), c.entries.len()));
            assert!(c.views.iter().zip(c.entries.iter()).all(|(v, e)| v.id == e.id));
            c.entries.iter().map(|e| e.id.0).collect()
        };
        let (a, _) = f.add("http://a", vec!["m".into()], Health::Healthy).expect("add");
        let (b, _) = f.add("http://b", vec!["n".into()], Health::Healthy).expect("add");
        assert_eq!((ids(&f, "m", None), ids(&f, "n", None)), (vec![0], vec![1]));
        // Read twice: the second read is the same roster. A change to what it holds, and
        // only that, makes a new one.
        let first = f.candidates("m").entries;
        assert!(Arc::ptr_eq(&first, &f.candidates("m").entries), "kept between requests");
        a.set_models(vec!["m".into()]);
        a.set_role(Role::Both);
        assert!(Arc::ptr_eq(&first, &f.candidates("m").entries), "setting what it holds already");
        b.set_models(vec!["m".into(), "n".into()]);
        assert_eq!(ids(&f, "m", None), vec![0, 1], "a worker's models");
        let (c, _) = f.add("http://c", vec![], Health::Healthy).expect("add");
        assert_eq!(ids(&f, "m", None), vec![0, 1, 2], "a worker listing no models serves any");
        f.remove("http://a");
        assert_eq!(ids(&f, "m", None), vec![1, 2], "a removal");
        assert_eq!(ids(&f, "m", Some(&[Role::Prefill])), Vec::<u32>::new());
        c.set_role(Role::Prefill);
        assert_eq!(ids(&f, "m", Some(&[Role::Prefill])), vec![2], "a role");
        assert_eq!(ids(&f, "m", Some(&[Role::Decode, Role::Both])), vec![1]);
        let cap = crate::model::capacity::Capacity { max_concurrent: Some(7), ..Default::default() };
        c.set_capacity(CapacitySource::Config, Some(cap));
        let v = f.candidates_in("m", None).views;
        assert_eq!(v.iter().find(|v| v.id == c.id).map(|v| v.capacity.max_concurrent), Some(7), "a capacity");
        // Load and health are read per request, not kept.
        let _open = b.load.dispatched(100, 10);
        c.set_health(Health::Unhealthy);
        let v = f.candidates("m").views;
        assert_eq!((v[0].in_flight, v[0].pending_prefill_tokens, v[1].is_routable()), (1, 100, false));
        drop(a);
    }

    #[test]
    fn views_add_the_other_replicas_load_once_the_fleet_counts_it() {
        let f = Fleet::default();
        let (w, _) = f.add("http://a", vec!["m".into()], Health::Healthy).expect("add");
        let _own = w.load.dispatched(100, 10);
        let _remote = w.remote_load.dispatched(50, 5);
        let v = |f: &Fleet| f.candidates("m").views[0];
        assert_eq!((v(&f).in_flight, v(&f).pending_prefill_tokens), (1, 100), "without the sync");
        f.count_remote_load();
        assert_eq!((v(&f).in_flight, v(&f).pending_prefill_tokens), (2, 150), "with it");
        assert_eq!(w.view().in_flight, 2, "a worker's own view always adds it");
    }

    #[test]
    fn at_most_the_configured_share_of_workers_is_ejected() {
        let f = Fleet::default();
        let ws: Vec<_> =
            (0..4).map(|i| f.add(&format!("http://w{i}"), vec![], Health::Healthy).expect("add").0).collect();
        assert!(fail(&f, &ws[0], 3, 1));
        assert!(fail(&f, &ws[1], 3, 2));
        assert!(!fail(&f, &ws[2], 10, 3), "a third ejection of four workers exceeds 0.5");
        assert!(!fail(&f, &ws[3], 10, 4));
        assert!(ws[2].is_routable() && ws[3].is_routable());
        assert_eq!(f.candidates("m").views.iter().filter(|v| v.is_routable()).count(), 2);
        // One comes back: the next worker over the threshold may take its place.
        ws[0].probe_result(true, Nanos::from_secs(5));
        assert!(fail(&f, &ws[2], 1, 6), "already over the threshold, ejected at its next failure");
        // One worker alone is never ejected by the default share (0.5 of 1 rounds to 0).
        let solo = Fleet::default();
        let (w, _) = solo.add("http://solo", vec![], Health::Healthy).expect("add");
        assert!(!fail(&solo, &w, 10, 1));
    }

    #[test]
    fn with_every_worker_out_the_least_recently_failed_is_still_offered() {
        let f = Fleet::default();
        let ws: Vec<_> =
            (0..3).map(|i| f.add(&format!("http://w{i}"), vec![], Health::Healthy).expect("add").0).collect();
        for (i, w) in ws.iter().enumerate() {
            for _ in 0..3 {
                if w.record_failure(3, Nanos::from_secs(10 + i as u64)) {
                    assert!(f.try_eject(w, 1.0, Nanos::from_secs(10 + i as u64)));
                }
            }
        }
        assert!(ws.iter().all(|w| w.is_ejected()));
        let routable = |f: &Fleet| -> Vec<u32> {
            f.candidates("m").views.iter().filter(|v| v.is_routable()).map(|v| v.id.0).collect()
        };
        assert_eq!(routable(&f), vec![ws[0].id.0], "w0 failed longest ago");
        // It fails again: now w1 is the least recently failed.
        ws[0].record_failure(3, Nanos::from_secs(20));
        assert_eq!(routable(&f), vec![ws[1].id.0]);
        // A worker whose health checks fail is not offered.
        ws[1].set_health(Health::Unhealthy);
        assert_eq!(routable(&f), vec![ws[2].id.0]);
        // A success readmits the worker it reached.
        ws[2].record_success();
        assert!(ws[2].is_routable() && !ws[2].is_ejected());
        assert_eq!(routable(&f), vec![ws[2].id.0]);
    }

    #[test]
    fn the_power_window_smooths_a_one_scrape_spike_and_forgets_old_readings() {
        let mut w = PowerWindow::default();
        let t0 = Instant::now();
        let win = Duration::from_secs(30);
        let mut last = None;
        for i in 0..10u64 {
            // One reading every 3 s; the fifth is a spike to 700 W over a 100 W baseline.
            let x = if i == 4 { 700.0 } else { 100.0 };
            last = w.observe(t0 + Duration::from_secs(3 * i), Some(x), win);
        }
        let mean = last.expect("a mean");
        assert!((mean - 160.0).abs() < 1e-9, "10 readings in the window, one of 700: {mean}");
        // 40 s later only fresh readings count; a scrape without the gauge adds nothing.
        assert_eq!(w.observe(t0 + Duration::from_secs(70), Some(300.0), win), Some(300.0));
        assert_eq!(w.observe(t0 + Duration::from_secs(71), None, win), Some(300.0));
        assert_eq!(w.observe(t0 + Duration::from_secs(200), None, win), None);
        // A zero window is the last reading.
        assert_eq!(w.observe(t0 + Duration::from_secs(201), Some(50.0), Duration::ZERO), Some(50.0));
        assert_eq!(w.observe(t0 + Duration::from_secs(202), Some(70.0), Duration::ZERO), Some(70.0));
    }
}
