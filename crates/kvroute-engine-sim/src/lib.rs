//! # kvroute-engine-sim
//!
//! `kvroute engine-sim`: one simulated inference worker over HTTP, driven by the same
//! engine model as `kvroute replay` ([`kvroute_sim::engine`]) on a wall clock scaled by
//! `time_scale` (10 = ten times faster than the profile).
//!
//! The prompt is cut into 64-byte chunks (16 tokens at 4 characters per token) hashed as a
//! chain, so two prompts sharing a text prefix share KV blocks and the second one's prefill
//! is shorter, exactly as with vLLM's prefix caching. Output text is deterministic.
//! Endpoints: OpenAI `/v1/chat/completions`, `/v1/completions` (streaming or not, with
//! `usage` and optional `logprobs`), `/v1/models`, SGLang `/generate`, `/health`,
//! `/tokenize`, `/metrics` with vLLM names, and what peer routers probe (`/server_info`,
//! `/model_info`, `/get_load`, `/loads`, `/v1/loads`, `/version`, `*/render`).
//!
//! Prefill/decode disaggregation (off by default, `role` both): a worker of role prefill or
//! decode speaks SGLang's PD protocol (`bootstrap_host`/`bootstrap_port`/`bootstrap_room`)
//! and vLLM's NIXL one (`kv_transfer_params`), with a bootstrap server for the KV handoff
//! and the copy timed by [`kvroute_sim::pd::TransferModel`]; see [`EngineSimConfig::role`]
//! for the protocols, [`EngineSim::bootstrap_port`] and [`PdCounters`] for what a test reads.
//!
//! Also, each off by default: log-probabilities from a quality knob ([`prompt_mean_logprob`],
//! for model cascades), LoRA adapters loaded at runtime with vLLM's and SGLang's endpoints
//! and least-recently-used eviction (for model multiplexing), and capacity facts
//! (`tp_size`, `dtype`, slots, KV tokens, VRAM) on `/server_info`.

mod lora;
mod pd;
mod quality;

/// The worker roles of prefill/decode disaggregation (re-exported from `kvroute_core`).
pub use kvroute_core::types::Role;
/// The KV transfer model of a prefill worker (re-exported from `kvroute_sim::pd`).
pub use kvroute_sim::pd::TransferModel;
pub use lora::LoraCounters;
pub use pd::{KEY_TTL_MIN, MAX_KEYS, PdCounters, SGLANG_DEFAULT_BOOTSTRAP_PORT};
pub use quality::prompt_mean_logprob;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvroute_core::hash::{HashAlgo, hash_text_blocks, stable_hash};
use kvroute_core::types::{BlockHash, Nanos, estimate_tokens};
use kvroute_protocol::openai::{Api, RoutingInfo, parse};
/// The engine profile a simulated worker runs (re-exported from `kvroute_sim::engine`).
pub use kvroute_sim::engine::Profile;
use kvroute_sim::engine::{Engine, EngineEvent, EngineRequest};
use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Settings of one simulated worker.
#[derive(Debug, Clone)]
pub struct EngineSimConfig {
    /// Engine profile.
    pub profile: Profile,
    /// Speed-up of simulated time over wall time (1 = real time).
    pub time_scale: f64,
    /// Model name served; empty: any name is served and `/v1/models` answers 404, like an
    /// engine that does not list its models.
    pub model: String,
    /// Share of requests answered with a 500 (failure injection).
    pub error_rate: f64,
    /// Share of requests that never answer (failure injection).
    pub hang_rate: f64,
    /// Exit the process after this many requests (failure injection).
    pub crash_after: Option<u64>,
    /// Seed of the failure-injection rolls (`error_rate`, `hang_rate`): request n fails
    /// when hash(seed, n) falls under the rate. Workers given the same seed fail on the
    /// same request numbers, so fleets under test need distinct seeds.
    pub fault_seed: u64,
    /// `/health` answers 503 for this many seconds after start.
    pub slow_start_secs: f64,
    /// Waiting-queue bound of the engine.
    pub max_waiting: usize,
    /// ZeroMQ endpoint the KV-event PUB socket binds (`tcp://127.0.0.1:5557`); none = off.
    pub kv_events: Option<String>,
    /// ZeroMQ endpoint of the replay ROUTER socket; none = no replay.
    pub kv_replay: Option<String>,
    /// Event encoding: legacy positional arrays or current vLLM maps.
    pub kv_encoding: kvroute_protocol::kv_events::Encoding,
    /// Topic frame of published batches.
    pub kv_topic: String,
    /// XORed into every published block hash, like vLLM's per-process hash seed: a router
    /// must not rely on reproducing engine hashes (0 = publish the plain hashes).
    pub kv_hash_salt: u64,
    /// Answer every request at once with one token, bypassing the engine model (no prefill,
    /// no decode, no cache): an "instant worker" for measuring a router's own overhead.
    pub instant: bool,
    /// With a slotted profile, prompts kept in a host-memory prompt cache as llama.cpp's
    /// `--cache-ram` keeps them ([`Engine::with_host_prompt_cache`]); 0 (default) for none,
    /// as `--cache-ram 0`.
    pub host_prompt_cache: usize,
    /// Modelled power draw when idle, watts (`DCGM_FI_DEV_POWER_USAGE` =
    /// idle + SM activity × (TDP − idle)). Default 75 W: an assumed idle draw of an H100 SXM
    /// (NVIDIA publishes no idle figure; ~60–90 W is what operators report).
    pub power_idle_watts: f64,
    /// Modelled power draw at full SM activity, watts. Default 700 W: the H100 SXM's TDP
    /// (NVIDIA H100 datasheet).
    pub power_tdp_watts: f64,
    /// Mean log-probability per emitted token, nats (≤ 0, finite; default -0.1, the constant
    /// the simulator always reported). Returned only when a request asks (chat
    /// `"logprobs": true`, completions `"logprobs": N`, SGLang `"return_logprob": true`), in
    /// the shape of vLLM/OpenAI or SGLang; see [`prompt_mean_logprob`]. With
    /// `quality_spread` 0 every token gets exactly this value.
    pub quality: f64,
    /// Spread of the per-prompt mean around `quality`, nats (≥ 0, finite; default 0): a
    /// prompt's mean is `quality + quality_spread × u`, u in [-1, 1] from a stable hash of
    /// the prompt text, clamped to ≤ 0 ([`prompt_mean_logprob`]). With a spread, per-token
    /// values also vary around the prompt's mean (each ≤ 0, mean over the output exact).
    pub quality_spread: f64,
    /// LoRA adapter slots (vLLM `--max-loras`, SGLang `--max-loras-per-batch`); 0 (default)
    /// = LoRA off, like an engine started without `--enable-lora`: the load/unload
    /// endpoints answer 400. Loading into full slots evicts the least recently used adapter.
    pub lora_slots: usize,
    /// Simulated seconds one adapter load takes (default 0.5); the wall wait is
    /// `lora_load_secs / time_scale`. Finite, ≥ 0.
    pub lora_load_secs: f64,
    /// Adapters `(name, path)` loaded at start, in order, without delay (vLLM
    /// `--lora-modules name=path`, SGLang `--lora-paths`). They count against `lora_slots`
    /// ([`EngineSimConfig::validate`] refuses more than the slots, duplicate or empty names,
    /// and the base model's name).
    pub loras: Vec<(String, String)>,
    /// Adapter names whose loads always fail (failure injection): vLLM's 400 `Loading lora N
    /// failed: No adapter found for P`, counted in `kvroute_sim_lora_load_failures`.
    pub lora_fail: Vec<String>,
    /// Tensor-parallel size reported by `/server_info` (SGLang `tp_size`; default 1). Only
    /// reported: the engine profile alone sets the speed.
    pub tp_size: u32,
    /// Weight dtype reported by `/server_info` (SGLang `dtype`; default "bfloat16"): one of
    /// [`DTYPES`]. Only reported.
    pub dtype: String,
    /// GPU memory per device, GB, reported by `/server_info` as `vram_gb` (kvroute's own
    /// field, not SGLang's; default 80, the H100 SXM's memory). Finite, > 0. Only reported.
    pub vram_gb: f64,
    /// Prefill/decode disaggregation role (default [`Role::Both`]: an ordinary worker that
    /// ignores every PD field). [`Role::Prefill`] copies SGLang's `--disaggregation-mode
    /// prefill` and a vLLM NIXL `kv_producer`: a request carrying `bootstrap_room` (SGLang)
    /// or `kv_transfer_params.do_remote_decode: true` (vLLM) is prefilled with one output
    /// token and its KV published on the bootstrap server (vLLM: the answer carries
    /// `kv_transfer_params`); a request with neither is served normally. [`Role::Decode`]
    /// copies `--disaggregation-mode decode` and a NIXL `kv_consumer`: a request carrying
    /// `bootstrap_host`/`bootstrap_room` (SGLang) or `kv_transfer_params.do_remote_prefill:
    /// true` (vLLM) waits for its KV from the prefill worker's bootstrap server and then
    /// only decodes; a request with neither is prefilled here (a "local prefill"). Both
    /// roles run a bootstrap server on [`EngineSimConfig::bootstrap_port`].
    pub role: Role,
    /// Address the bootstrap server binds (default `127.0.0.1`; the CLI uses `--host`),
    /// also advertised as vLLM's `remote_host` (an unspecified address such as `0.0.0.0`
    /// is advertised as `127.0.0.1`).
    pub bootstrap_host: String,
    /// Bootstrap port of a prefill or decode worker (SGLang's
    /// `--disaggregation-bootstrap-port`); `None` or `Some(0)` = any free port (see
    /// [`EngineSim::bootstrap_port`]). Unused with role both.
    pub bootstrap_port: Option<u16>,
    /// Wall seconds a decode request waits for its KV, and a bootstrap server long-polls an
    /// unknown key, before giving up (default 300, SGLang's bootstrap timeout
    /// `SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`). Finite, > 0.
    pub bootstrap_timeout_secs: f64,
    /// How long the KV copy of a prefill takes (simulated seconds; wall = / `time_scale`):
    /// a prefill worker publishes a prompt's KV as ready that long after its prefill ends.
    pub kv_transfer: TransferModel,
}

/// Weight dtypes [`EngineSimConfig::dtype`] accepts.
pub const DTYPES: [&str; 6] = ["float32", "float16", "bfloat16", "fp8", "int8", "int4"];

/// A setting of [`EngineSimConfig`] out of range ([`EngineSimConfig::validate`]); the
/// message names the field and the `kvroute engine-sim` flag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(pub String);

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

impl EngineSimConfig {
    /// Checks the quality, LoRA, capacity and PD settings: `quality` finite and ≤ 0,
    /// `quality_spread` finite and ≥ 0, `lora_load_secs` finite and ≥ 0, `loras` at most
    /// `lora_slots` with distinct non-empty names other than the base model's and non-empty
    /// paths, `tp_size` ≥ 1, `dtype` one of [`DTYPES`], `vram_gb` finite and > 0,
    /// `bootstrap_timeout_secs` finite and > 0, a `bootstrap_host` for a prefill or decode
    /// role, and the transfer knobs ([`TransferModel::validate`]).
    /// [`serve`] and [`spawn_local`] call it; [`start`] does not.
    ///
    /// # Errors
    /// The first setting out of range, named.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError(m));
        self.profile.validate().map_err(|e| ConfigError(format!("profile: {e}")))?;
        if !(self.quality.is_finite() && self.quality <= 0.0) {
            return bad(format!("quality (--quality) must be a finite log-probability <= 0, got {}", self.quality));
        }
        if !(self.quality_spread.is_finite() && self.quality_spread >= 0.0) {
            return bad(format!(
                "quality_spread (--quality-spread) must be finite and >= 0, got {}",
                self.quality_spread
            ));
        }
        if !(self.lora_load_secs.is_finite() && self.lora_load_secs >= 0.0) {
            return bad(format!(
                "lora_load_secs (--lora-load-secs) must be finite and >= 0, got {}",
                self.lora_load_secs
            ));
        }
        if self.loras.len() > self.lora_slots {
            return bad(format!(
                "{} preloaded LoRA adapters (--lora) but only {} slots (--lora-slots)",
                self.loras.len(),
                self.lora_slots
            ));
        }
        let mut seen = std::collections::HashSet::new();
        for (name, path) in &self.loras {
            if name.is_empty() || path.is_empty() {
                return bad(format!("LoRA adapter (--lora NAME=PATH) needs a name and a path, got '{name}={path}'"));
            }
            if name == &self.model {
                return bad(format!("LoRA adapter name '{name}' (--lora) is the base model's name"));
            }
            if !seen.insert(name) {
                return bad(format!("LoRA adapter '{name}' (--lora) given twice"));
            }
        }
        if self.tp_size == 0 {
            return bad("tp_size (--tp-size) must be >= 1".into());
        }
        if !DTYPES.contains(&self.dtype.as_str()) {
            return bad(format!("dtype (--dtype) must be one of {}, got '{}'", DTYPES.join(", "), self.dtype));
        }
        if !(self.vram_gb.is_finite() && self.vram_gb > 0.0) {
            return bad(format!("vram_gb (--vram-gb) must be finite and > 0, got {}", self.vram_gb));
        }
        if !(self.bootstrap_timeout_secs.is_finite() && self.bootstrap_timeout_secs > 0.0) {
            return bad(format!(
                "bootstrap_timeout_secs (--bootstrap-timeout-secs) must be finite and > 0, got {}",
                self.bootstrap_timeout_secs
            ));
        }
        if self.role != Role::Both && self.bootstrap_host.is_empty() {
            return bad("bootstrap_host must be an address to bind (--host)".into());
        }
        self.kv_transfer.validate().map_err(|e| ConfigError(e.to_string()))?;
        Ok(())
    }
}

impl Default for EngineSimConfig {
    fn default() -> Self {
        EngineSimConfig {
            profile: Profile::h100_llama3_8b(),
            time_scale: 1.0,
            model: "sim-llama-3-8b".into(),
            error_rate: 0.0,
            hang_rate: 0.0,
            crash_after: None,
            fault_seed: 0,
            slow_start_secs: 0.0,
            max_waiting: 4096,
            kv_events: None,
            kv_replay: None,
            kv_encoding: kvroute_protocol::kv_events::Encoding::Map,
            kv_topic: "kv-events".into(),
            kv_hash_salt: 0,
            instant: false,
            host_prompt_cache: 0,
            power_idle_watts: 75.0,
            power_tdp_watts: 700.0,
            quality: -0.1,
            quality_spread: 0.0,
            lora_slots: 0,
            lora_load_secs: 0.5,
            loras: Vec::new(),
            lora_fail: Vec::new(),
            tp_size: 1,
            dtype: "bfloat16".into(),
            vram_gb: 80.0,
            role: Role::Both,
            bootstrap_host: "127.0.0.1".into(),
            bootstrap_port: None,
            bootstrap_timeout_secs: 300.0,
            kv_transfer: TransferModel::default(),
        }
    }
}

/// Tokens per KV block of the simulated worker's prefix hashing.
pub(crate) const BLOCK_TOKENS: u32 = 16;

enum Cmd {
    Submit { req: EngineRequest, reply: mpsc::Sender<EngineEvent> },
}

struct SimMetrics {
    registry: Registry,
    running: Gauge,
    waiting: Gauge,
    kv_usage: Gauge<f64, std::sync::atomic::AtomicU64>,
    sm_active: Gauge<f64, std::sync::atomic::AtomicU64>,
    power: Gauge<f64, std::sync::atomic::AtomicU64>,
    hits: Counter,
    queries: Counter,
    prompt_tokens: Counter,
    generation_tokens: Counter,
    requests: Counter,
    ttft: Histogram,
    e2e: Histogram,
}

impl SimMetrics {
    fn new() -> Self {
        let mut registry = Registry::default();
        let running = Gauge::default();
        registry.register("vllm:num_requests_running", "Requests in the running batch", running.clone());
        let waiting = Gauge::default();
        registry.register("vllm:num_requests_waiting", "Requests waiting", waiting.clone());
        let kv_usage = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register("vllm:kv_cache_usage_perc", "KV cache usage, 0-1", kv_usage.clone());
        let sm_active = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register(
            "DCGM_FI_PROF_SM_ACTIVE",
            "Simulated SM activity, 0-1: the engine's busy fraction over the last simulated second (named as NVIDIA DCGM exports it)",
            sm_active.clone(),
        );
        let power = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register(
            "DCGM_FI_DEV_POWER_USAGE",
            "Simulated power draw, watts: idle + SM activity x (TDP - idle) (named as NVIDIA DCGM exports it)",
            power.clone(),
        );
        let hits = Counter::default();
        registry.register("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache", hits.clone());
        let queries = Counter::default();
        registry.register("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", queries.clone());
        let prompt_tokens = Counter::default();
        registry.register("vllm:prompt_tokens", "Prompt tokens processed", prompt_tokens.clone());
        let generation_tokens = Counter::default();
        registry.register("vllm:generation_tokens", "Tokens generated", generation_tokens.clone());
        let requests = Counter::default();
        registry.register("vllm:request_success", "Requests finished", requests.clone());
        let ttft = Histogram::new(exponential_buckets(0.001, 2.0, 18));
        registry.register("vllm:time_to_first_token_seconds", "TTFT (wall clock)", ttft.clone());
        let e2e = Histogram::new(exponential_buckets(0.001, 2.0, 20));
        registry.register("vllm:e2e_request_latency_seconds", "End-to-end latency (wall clock)", e2e.clone());
        SimMetrics {
            registry,
            running,
            waiting,
            kv_usage,
            sm_active,
            power,
            hits,
            queries,
            prompt_tokens,
            generation_tokens,
            requests,
            ttft,
            e2e,
        }
    }
}

/// Shared state of one simulated worker.
pub struct EngineSim {
    cfg: EngineSimConfig,
    tx: mpsc::Sender<Cmd>,
    /// The engine's driver thread, unparked after each submission (`None` if it could
    /// not be started).
    driver: std::sync::OnceLock<std::thread::Thread>,
    metrics: SimMetrics,
    start: Instant,
    next_id: AtomicU64,
    served: AtomicU64,
    stats: Mutex<kvroute_sim::engine::EngineStats>,
    lora: Arc<lora::Lora>,
    pd: pd::Pd,
}

impl Drop for EngineSim {
    fn drop(&mut self) {
        // Stops the bootstrap server with the worker.
        self.pd.shutdown.cancel();
        // Wakes the driver thread, which then finds the worker gone and ends (otherwise it
        // would sleep out an idle wake-up: 1 simulated second, long at a small time scale).
        if let Some(t) = self.driver.get() {
            t.unpark();
        }
    }
}

impl std::fmt::Debug for EngineSim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineSim").field("model", &self.cfg.model).finish_non_exhaustive()
    }
}

impl EngineSim {
    fn sim_now(start: Instant, scale: f64) -> Nanos {
        Nanos((start.elapsed().as_nanos() as f64 * scale) as u64)
    }

    /// Counters of the engine (prefix hits, tokens, …).
    pub fn stats(&self) -> kvroute_sim::engine::EngineStats {
        *self.stats.lock()
    }

    /// Names of the LoRA adapters loaded now, in load order (empty with LoRA off).
    pub fn loaded_adapters(&self) -> Vec<String> {
        self.lora.list().into_iter().map(|(name, _)| name).collect()
    }

    /// LoRA counters (loads, failures, evictions, requests, loaded), the values of the
    /// `kvroute_sim_lora_*` metrics.
    pub fn lora_counters(&self) -> LoraCounters {
        self.lora.counters()
    }

    /// The port the bootstrap server is bound to (role prefill or decode; the configured
    /// [`EngineSimConfig::bootstrap_port`], or the one picked for 0/`None`), `None` with role
    /// both or when it could not be bound ([`start`] logs that; [`serve`] and
    /// [`spawn_local`] fail instead).
    pub fn bootstrap_port(&self) -> Option<u16> {
        self.pd.bootstrap_port
    }

    /// This worker's vLLM `remote_engine_id` (`kvsim-` and 16 hex digits, random per start),
    /// as its prefill answers carry it in `kv_transfer_params`.
    pub fn engine_id(&self) -> &str {
        &self.pd.engine_id
    }

    /// PD counters (transfers, bytes, failures, local prefills, published KV, requests
    /// waiting for KV), the values of the `kvroute_sim_pd_*` metrics.
    pub fn pd_counters(&self) -> PdCounters {
        self.pd.counters()
    }
}

/// Starts the engine's driver thread and returns the shared state. The driver stops when
/// the returned state (and every handler holding it) is dropped. `cfg` is not validated
/// ([`EngineSimConfig::validate`]); the preloaded `loras` are loaded at once. A prefill or
/// decode worker's bootstrap server is started too (stopped when the state is dropped); if
/// its port cannot be bound the error is logged and [`EngineSim::bootstrap_port`] is `None`.
/// Must run inside a tokio runtime.
pub fn start(cfg: EngineSimConfig) -> Arc<EngineSim> {
    let listener = pd::bind(&cfg).unwrap_or_else(|e| {
        tracing::error!("engine-sim: {e}");
        eprintln!("kvroute engine-sim: {e}");
        None
    });
    start_with(cfg, listener)
}

/// [`start`], failing when the bootstrap port cannot be bound.
fn try_start(cfg: EngineSimConfig) -> std::io::Result<Arc<EngineSim>> {
    let listener = pd::bind(&cfg)?;
    Ok(start_with(cfg, listener))
}

fn start_with(cfg: EngineSimConfig, bootstrap: Option<std::net::TcpListener>) -> Arc<EngineSim> {
    let (tx, rx) = mpsc::channel::<Cmd>(1024);
    let mut metrics = SimMetrics::new();
    let lora = Arc::new(lora::Lora::new(&cfg, &mut metrics.registry));
    let pd = pd::Pd::new(&cfg, &mut metrics.registry, bootstrap);
    let sim = Arc::new(EngineSim {
        tx,
        driver: std::sync::OnceLock::new(),
        metrics,
        lora,
        pd,
        start: Instant::now(),
        next_id: AtomicU64::new(0),
        served: AtomicU64::new(0),
        stats: Mutex::new(Default::default()),
        cfg,
    });
    sim.metrics.power.set(sim.cfg.power_idle_watts);
    let (weak, cfg, start, runtime) =
        (Arc::downgrade(&sim), sim.cfg.clone(), sim.start, tokio::runtime::Handle::current());
    match std::thread::Builder::new()
        .name("engine-sim-driver".into())
        .spawn(move || drive(weak, rx, cfg, start, runtime))
    {
        Ok(h) => {
            let _ = sim.driver.set(h.thread().clone());
        }
        Err(e) => {
            // Without a driver every request is answered 503 ("engine stopped").
            tracing::error!("engine-sim: cannot start the engine thread: {e}");
            eprintln!("kvroute engine-sim: cannot start the engine thread: {e}");
        }
    }
    sim
}

/// The engine's driver: runs on an OS thread of its own and sleeps with
/// `std::thread::park_timeout`, which wakes within tens of microseconds of the next engine
/// event. A tokio timer has a 1 ms tick: on a tokio task first tokens and completions came
/// out 1.1 ms of wall time late on average (measured), 11 simulated ms at `--time-scale
/// 10`, which lengthened every TTFT and kept the router's view of each worker's queue that
/// much behind the engine's. Submissions arrive on `rx`; their sender unparks the thread.
fn drive(
    sim: std::sync::Weak<EngineSim>,
    mut rx: mpsc::Receiver<Cmd>,
    cfg: EngineSimConfig,
    start: Instant,
    runtime: tokio::runtime::Handle,
) {
    let mut engine = Engine::new(cfg.profile.clone(), cfg.max_waiting).with_host_prompt_cache(cfg.host_prompt_cache);
    let kv_tx = cfg.kv_events.as_ref().map(|endpoint| {
        engine.record_cache_events(true);
        let (tx, rx) = mpsc::channel::<Vec<u8>>(KV_QUEUE);
        runtime.spawn(publish(endpoint.clone(), cfg.kv_replay.clone(), cfg.kv_topic.clone(), rx));
        tx
    });
    let mut cache_events = Vec::new();
    let mut waiters: HashMap<u64, mpsc::Sender<EngineEvent>> = HashMap::new();
    let mut events = Vec::new();
    let scale = cfg.time_scale.max(1e-6);
    let mut util = kvroute_sim::replay::BusyWindow::default();
    loop {
        // Submissions first, each at the instant it is taken.
        loop {
            match rx.try_recv() {
                Ok(Cmd::Submit { req, reply }) => {
                    let now = EngineSim::sim_now(start, scale);
                    engine.advance(now, &mut events);
                    waiters.insert(req.id, reply);
                    engine.submit(req, now, &mut events);
                }
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => return,
            }
        }
        let now = EngineSim::sim_now(start, scale);
        engine.advance(now, &mut events);
        if let Some(tx) = &kv_tx {
            flush_kv(&mut engine, &mut cache_events, tx, now, cfg.kv_encoding, cfg.kv_hash_salt);
        }
        for ev in events.drain(..) {
            let (id, done) = match ev {
                EngineEvent::FirstToken { id, .. } => (id, false),
                EngineEvent::Finished { id, .. } | EngineEvent::Rejected { id, .. } => (id, true),
                // This server takes no slot files (no `/slots` actions).
                EngineEvent::SlotRestored { .. } | EngineEvent::SlotSaved { .. } => continue,
            };
            if let Some(w) = waiters.get(&id) {
                let _ = w.try_send(ev);
            }
            if done {
                waiters.remove(&id);
            }
        }
        if let Some(s) = sim.upgrade() {
            s.metrics.running.set(i64::from(engine.num_running()));
            s.metrics.waiting.set(i64::from(engine.num_waiting()));
            s.metrics.kv_usage.set(engine.kv_usage());
            let active = util.observe(now, engine.stats().busy_ns, engine.next_event_time().is_some());
            s.metrics.sm_active.set(active);
            let (idle, tdp) = (s.cfg.power_idle_watts, s.cfg.power_tdp_watts.max(s.cfg.power_idle_watts));
            s.metrics.power.set(idle + active.clamp(0.0, 1.0) * (tdp - idle));
            *s.stats.lock() = engine.stats();
        } else {
            return;
        }
        let sleep = match engine.next_event_time() {
            Some(t) => {
                let now = EngineSim::sim_now(start, scale);
                Duration::from_nanos((t.0.saturating_sub(now.0) as f64 / scale) as u64)
            }
            // Idle: wake once per utilisation window so the SM gauge decays to 0.
            None => Duration::from_secs_f64(kvroute_sim::replay::UTIL_WINDOW.as_secs_f64() / scale),
        };
        // A submission's sender unparks the thread; one that came after the drain above
        // left the token set, so this returns at once.
        if !sleep.is_zero() {
            std::thread::park_timeout(sleep);
        }
    }
}

/// Bound of the queue between the engine and the KV-event publisher (batches); beyond it
/// batches are dropped (subscribers see a sequence gap and can replay).
const KV_QUEUE: usize = 4096;

/// Batches kept for replay (vLLM's `buffer_steps` default is 10,000).
const KV_REPLAY_BUFFER: usize = 10_000;

fn flush_kv(
    engine: &mut Engine,
    buf: &mut Vec<kvroute_sim::engine::CacheEvent>,
    tx: &mpsc::Sender<Vec<u8>>,
    now: Nanos,
    enc: kvroute_protocol::kv_events::Encoding,
    salt: u64,
) {
    use kvroute_protocol::kv_events::{EventBatch, KvEvent, encode};
    use kvroute_sim::engine::CacheEvent;
    engine.drain_cache_events(buf);
    if buf.is_empty() {
        return;
    }
    let events = buf
        .drain(..)
        .map(|e| match e {
            CacheEvent::Stored { hashes, parent, token_ids, block_size } => KvEvent::BlockStored {
                block_hashes: hashes.iter().map(|h| h.0 ^ salt).collect(),
                parent_block_hash: parent.map(|h| h.0 ^ salt),
                token_ids,
                block_size,
                medium: Some("GPU".into()),
                group_idx: 0,
            },
            CacheEvent::Removed { hashes } => KvEvent::BlockRemoved {
                block_hashes: hashes.iter().map(|h| h.0 ^ salt).collect(),
                medium: Some("GPU".into()),
                group_idx: 0,
            },
        })
        .collect();
    let batch = EventBatch { ts: now.as_secs_f64(), events, dp_rank: Some(0) };
    if tx.try_send(encode(&batch, enc)).is_err() {
        tracing::warn!("kv events: publisher queue full, batch dropped");
    }
}

fn zmq_endpoint(e: &str) -> String {
    e.replace("://*:", "://0.0.0.0:")
}

/// Publishes batches as `[topic, seq, payload]` on a PUB socket and serves replays on a
/// ROUTER socket (`[identity, "", start_seq]` → one `[identity, "", seq, payload]` per
/// buffered batch from `start_seq`, then `[identity, "", -1, ""]`).
async fn publish(endpoint: String, replay: Option<String>, topic: String, mut rx: mpsc::Receiver<Vec<u8>>) {
    use zeromq::{Socket, SocketSend};
    let mut sock = zeromq::PubSocket::new();
    if let Err(e) = sock.bind(&zmq_endpoint(&endpoint)).await {
        eprintln!("kvroute engine-sim: cannot bind KV events on {endpoint}: {e}");
        return;
    }
    let ring: Arc<Mutex<std::collections::VecDeque<(u64, Bytes)>>> = Arc::default();
    if let Some(r) = replay {
        tokio::spawn(replay_server(r, Arc::clone(&ring)));
    }
    let mut seq = 0u64;
    while let Some(payload) = rx.recv().await {
        let payload = Bytes::from(payload);
        {
            let mut g = ring.lock();
            g.push_back((seq, payload.clone()));
            while g.len() > KV_REPLAY_BUFFER {
                g.pop_front();
            }
        }
        if let Ok(msg) = zeromq::ZmqMessage::try_from(kvroute_protocol::kv_events::frames(&topic, seq, payload))
            && let Err(e) = sock.send(msg).await
        {
            tracing::warn!("kv events: send failed: {e}");
        }
        seq += 1;
    }
}

async fn replay_server(endpoint: String, ring: Arc<Mutex<std::collections::VecDeque<(u64, Bytes)>>>) {
    use zeromq::{Socket, SocketRecv, SocketSend};
    let mut sock = zeromq::RouterSocket::new();
    if let Err(e) = sock.bind(&zmq_endpoint(&endpoint)).await {
        eprintln!("kvroute engine-sim: cannot bind KV replay on {endpoint}: {e}");
        return;
    }
    loop {
        let Ok(msg) = sock.recv().await else { return };
        let frames = msg.into_vec();
        let (Some(id), Some(last)) = (frames.first().cloned(), frames.last()) else { continue };
        let Ok(start) = <[u8; 8]>::try_from(last.as_ref()).map(u64::from_be_bytes) else { continue };
        let batches: Vec<(u64, Bytes)> = ring.lock().iter().filter(|(s, _)| *s >= start).cloned().collect();
        for (seq, p) in batches {
            let parts = vec![id.clone(), Bytes::new(), Bytes::copy_from_slice(&seq.to_be_bytes()), p];
            if let Ok(m) = zeromq::ZmqMessage::try_from(parts)
                && sock.send(m).await.is_err()
            {
                break;
            }
        }
        let end =
            vec![id, Bytes::new(), Bytes::copy_from_slice(&kvroute_protocol::kv_events::REPLAY_END), Bytes::new()];
        if let Ok(m) = zeromq::ZmqMessage::try_from(end) {
            let _ = sock.send(m).await;
        }
    }
}

/// Largest request body a simulated worker reads, bytes: the router's default
/// `max_body_bytes`, so a body the router passes on is read, tokenized and judged by its
/// length as vLLM's and SGLang's servers judge it (they set no body limit), not refused by
/// axum's 2 MiB default with a 413 and a hang-up before it is read.
pub const MAX_BODY_BYTES: usize = 32 << 20;

/// The HTTP app of a simulated worker.
pub fn app(sim: Arc<EngineSim>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/generate", post(generate))
        .route("/v1/chat/completions/render", post(render))
        .route("/v1/completions/render", post(render))
        .route("/tokenize", post(tokenize))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/server_info", get(server_info))
        .route("/props", get(props))
        .route("/slots", get(slots))
        .route("/model_info", get(model_info))
        .route("/get_load", get(get_load))
        .route("/loads", get(get_load))
        .route("/v1/loads", get(get_load))
        .route("/version", get(version))
        .route("/v1/load_lora_adapter", post(lora::vllm_load))
        .route("/v1/unload_lora_adapter", post(lora::vllm_unload))
        .route("/load_lora_adapter", post(lora::sglang_load))
        .route("/unload_lora_adapter", post(lora::sglang_unload))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(sim)
}

/// Serves a simulated worker on `listener` until `shutdown`.
///
/// # Errors
/// Listener I/O errors; `InvalidInput` when `cfg` is out of range
/// ([`EngineSimConfig::validate`]).
pub async fn serve(
    listener: tokio::net::TcpListener,
    cfg: EngineSimConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    cfg.validate().map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let sim = try_start(cfg)?;
    axum::serve(listener, app(sim)).with_graceful_shutdown(shutdown).await
}

/// Starts a simulated worker on an ephemeral 127.0.0.1 port in the background, serving until
/// `stop` is cancelled. Returns its base URL and its shared state (for its counters).
///
/// # Errors
/// Binding the listener; `InvalidInput` when `cfg` is out of range
/// ([`EngineSimConfig::validate`]).
pub async fn spawn_local(
    cfg: EngineSimConfig,
    stop: tokio_util::sync::CancellationToken,
) -> std::io::Result<(String, Arc<EngineSim>)> {
    cfg.validate().map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let cfg = EngineSimConfig { bootstrap_host: "127.0.0.1".into(), ..cfg };
    let sim = try_start(cfg)?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let app = app(Arc::clone(&sim));
    let bootstrap_stop = sim.pd.shutdown.clone();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).with_graceful_shutdown(async move { stop.cancelled().await }).await;
        bootstrap_stop.cancel();
    });
    Ok((url, sim))
}

fn err(status: StatusCode, msg: &str) -> Response {
    kvroute_protocol::api_error::ApiError::new(status, msg).into_response()
}

async fn health(State(s): State<Arc<EngineSim>>) -> Response {
    if s.start.elapsed().as_secs_f64() < s.cfg.slow_start_secs {
        return err(StatusCode::SERVICE_UNAVAILABLE, "starting");
    }
    Json(serde_json::json!({"status": "ok"})).into_response()
}

async fn models(State(s): State<Arc<EngineSim>>) -> Response {
    if s.cfg.model.is_empty() {
        // An engine that does not list its models (a router then sends it any name).
        return (StatusCode::NOT_FOUND, Json(serde_json::json!({"error": "no model list"}))).into_response();
    }
    let base = &s.cfg.model;
    let mut data = vec![serde_json::json!({"id": base, "object": "model", "created": 0,
        "owned_by": "kvroute-engine-sim", "root": base, "parent": null, "max_model_len": MAX_MODEL_LEN})];
    data.extend(s.lora.list().into_iter().map(|(name, path)| {
        serde_json::json!({"id": name, "object": "model", "created": 0, "owned_by": "kvroute-engine-sim",
            "root": path, "parent": base, "max_model_len": MAX_MODEL_LEN})
    }));
    Json(serde_json::json!({"object": "list", "data": data})).into_response()
}

/// `max_model_len` reported by `/v1/models` and `/tokenize`, and enforced
/// ([`within_context`]).
const MAX_MODEL_LEN: u32 = 131_072;

/// vLLM's context-length check: a prompt of `input` tokens asking for `max_tokens` more
/// must fit in [`MAX_MODEL_LEN`]; without `max_tokens` (vLLM then generates up to the
/// context's end) the prompt alone must leave room for one token.
///
/// # Errors
/// 400 with vLLM's message ("This model's maximum context length is …"), param `messages`.
fn within_context(input: u32, max_tokens: Option<u32>) -> Result<(), kvroute_protocol::api_error::ApiError> {
    let asked = u64::from(input) + u64::from(max_tokens.unwrap_or(1));
    if asked <= u64::from(MAX_MODEL_LEN) {
        return Ok(());
    }
    let message = match max_tokens {
        Some(m) => format!(
            "This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested {asked} tokens \
             ({input} in the messages, {m} in the completion). Please reduce the length of the messages or completion."
        ),
        None => format!(
            "This model's maximum context length is {MAX_MODEL_LEN} tokens. However, your request has {input} input \
             tokens. Please reduce the length of the input messages."
        ),
    };
    Err(kvroute_protocol::api_error::ApiError::bad_field("messages", message))
}

async fn metrics(State(s): State<Arc<EngineSim>>) -> Response {
    let mut out = String::new();
    let _ = prometheus_client::encoding::text::encode(&mut out, &s.metrics.registry);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}

async fn server_info(State(s): State<Arc<EngineSim>>) -> Response {
    let c = &s.cfg;
    Json(serde_json::json!({"model_path": c.model, "served_model_name": c.model, "tp_size": c.tp_size, "dp_size": 1,
        "version": env!("CARGO_PKG_VERSION"), "engine": "kvroute-engine-sim", "profile": c.profile.name,
        "dtype": c.dtype, "max_running_requests": c.profile.max_batch, "max_total_num_tokens": c.profile.kv_tokens,
        "max_loras_per_batch": c.lora_slots, "enable_lora": c.lora_slots > 0, "mem_fraction_static": 0.9,
        "vram_gb": c.vram_gb,
        "disaggregation_mode": if c.role == Role::Both { "null" } else { c.role.as_str() },
        "disaggregation_bootstrap_port": s.pd.bootstrap_port}))
    .into_response()
}

/// llama.cpp `GET /props` (`total_slots`), for a profile with slots; 404 otherwise (vLLM and
/// SGLang have no such endpoint).
async fn props(State(s): State<Arc<EngineSim>>) -> Response {
    if s.cfg.profile.slots == 0 {
        return err(StatusCode::NOT_FOUND, "File Not Found");
    }
    Json(serde_json::json!({"total_slots": s.cfg.profile.slots, "model_path": s.cfg.model,
        "default_generation_settings": {"n_ctx": s.cfg.profile.kv_tokens / u64::from(s.cfg.profile.slots)},
        "build_info": concat!("kvroute-engine-sim ", env!("CARGO_PKG_VERSION"))}))
    .into_response()
}

/// llama.cpp `GET /slots` (`id`, `is_processing` per slot: the first `running` are busy), for
/// a profile with slots; 404 otherwise.
async fn slots(State(s): State<Arc<EngineSim>>) -> Response {
    let n = s.cfg.profile.slots;
    if n == 0 {
        return err(StatusCode::NOT_FOUND, "File Not Found");
    }
    let running = u32::try_from(s.metrics.running.get().max(0)).unwrap_or(0);
    let v: Vec<serde_json::Value> =
        (0..n).map(|id| serde_json::json!({"id": id, "is_processing": id < running})).collect();
    Json(v).into_response()
}

async fn model_info(State(s): State<Arc<EngineSim>>) -> Response {
    Json(serde_json::json!({"model_path": s.cfg.model, "tokenizer_path": null, "is_generation": true})).into_response()
}

async fn get_load(State(s): State<Arc<EngineSim>>) -> Response {
    let running = s.metrics.running.get();
    let waiting = s.metrics.waiting.get();
    Json(serde_json::json!({"num_reqs": running + waiting, "num_running_reqs": running, "num_waiting_reqs": waiting,
        "kv_cache_usage": s.metrics.kv_usage.get()}))
    .into_response()
}

async fn version() -> Response {
    Json(serde_json::json!({"version": env!("CARGO_PKG_VERSION")})).into_response()
}

/// Pseudo token ids of `text`: 4 bytes per token, little-endian (deterministic; matches the
/// 4-characters-per-token estimate used for routing).
pub fn pseudo_tokens(text: &str) -> Vec<u32> {
    text.as_bytes()
        .chunks(4)
        .map(|c| {
            let mut b = [0u8; 4];
            b[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(b)
        })
        .collect()
}

/// vLLM's `POST /tokenize`: `{"prompt": …}` or `{"messages": […]}` (the chat flattened as
/// the engine flattens it for generation), so a router gets the exact token ids the engine
/// will hash.
async fn tokenize(body: Bytes) -> Response {
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let tokens = if v.get("messages").is_some() || v.get("prompt").is_some_and(|p| !p.is_string()) {
        let api = if v.get("messages").is_some() { Api::Chat } else { Api::Completions };
        match parse(api, &body, None) {
            Ok(info) => info.token_ids.unwrap_or_else(|| pseudo_tokens(&info.text)),
            Err(e) => return e.into_response(),
        }
    } else {
        let text = v.get("prompt").or_else(|| v.get("text")).and_then(serde_json::Value::as_str).unwrap_or("");
        pseudo_tokens(text)
    };
    Json(serde_json::json!({"count": tokens.len(), "max_model_len": MAX_MODEL_LEN, "tokens": tokens})).into_response()
}

async fn render(body: Bytes) -> Response {
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let api = if v.get("messages").is_some() { Api::Chat } else { Api::Completions };
    match parse(api, &body, None) {
        Ok(info) => Json(serde_json::json!({"prompt": info.text, "prompt_token_ids": pseudo_tokens(&info.text)}))
            .into_response(),
        Err(e) => e.into_response(),
    }
}

async fn chat(State(s): State<Arc<EngineSim>>, body: Bytes) -> Response {
    complete(s, Api::Chat, body).await
}
async fn completions(State(s): State<Arc<EngineSim>>, body: Bytes) -> Response {
    complete(s, Api::Completions, body).await
}
async fn generate(State(s): State<Arc<EngineSim>>, body: Bytes) -> Response {
    complete(s, Api::Generate, body).await
}

/// The options of a request that routing does not read; only this simulator needs them.
#[derive(serde::Deserialize, Default)]
struct Options {
    /// Chat: `true` asks for logprobs; completions: `N` (OpenAI legacy) asks.
    #[serde(default)]
    logprobs: Option<serde_json::Value>,
    /// SGLang `/generate`: `true` asks for logprobs.
    #[serde(default)]
    return_logprob: Option<serde_json::Value>,
    /// SGLang `/generate`: the LoRA adapter's name.
    #[serde(default)]
    lora_path: Option<serde_json::Value>,
    /// llama.cpp: the slot to run in (-1 = the engine picks); used by profiles with slots.
    #[serde(default)]
    id_slot: Option<serde_json::Value>,
    /// vLLM `cache_salt`: prefix-cache blocks are shared only between requests with the
    /// same salt (vLLM mixes it into the first block's hash).
    #[serde(default)]
    cache_salt: Option<String>,
}

impl Options {
    /// The logprobs shape asked for, if any.
    ///
    /// # Errors
    /// 400 naming `logprobs` when a completions request's value is neither a non-negative
    /// integer nor a boolean.
    fn ask(&self, api: Api) -> Result<Option<quality::Ask>, kvroute_protocol::api_error::ApiError> {
        use serde_json::Value;
        Ok(match (api, &self.logprobs) {
            // As before: any value but `false` and null asks.
            (Api::Chat, Some(l)) => l.as_bool().unwrap_or(!l.is_null()).then_some(quality::Ask::Chat),
            (Api::Completions, Some(Value::Number(n))) => match n.as_u64() {
                Some(n) => Some(quality::Ask::Completions { top: n > 0 }),
                None => {
                    return Err(kvroute_protocol::api_error::ApiError::bad_field(
                        "logprobs",
                        "`logprobs` must be a non-negative integer",
                    ));
                }
            },
            (Api::Completions, Some(Value::Bool(b))) => b.then_some(quality::Ask::Completions { top: true }),
            (Api::Completions, Some(Value::Null) | None) => None,
            (Api::Completions, Some(_)) => {
                return Err(kvroute_protocol::api_error::ApiError::bad_field(
                    "logprobs",
                    "`logprobs` must be a non-negative integer",
                ));
            }
            (Api::Generate, _) => {
                self.return_logprob.as_ref().and_then(Value::as_bool).unwrap_or(false).then_some(quality::Ask::Generate)
            }
            (Api::Chat, None) => None,
        })
    }
}

/// The LoRA adapter a request is served with (`None`: the base model).
///
/// # Errors
/// 404 (vLLM's `The model \`X\` does not exist.`, param `model`) for a model that is neither
/// the base model nor a loaded adapter; 400 (param `lora_path`) for a `/generate`
/// `lora_path` that is not a loaded adapter's name.
fn resolve_model(
    s: &EngineSim,
    api: Api,
    model: &str,
    lora_path: Option<&serde_json::Value>,
) -> Result<Option<String>, kvroute_protocol::api_error::ApiError> {
    use kvroute_protocol::api_error::ApiError;
    if api == Api::Generate
        && let Some(v) = lora_path.filter(|v| !v.is_null())
    {
        let Some(name) = v.as_str() else {
            return Err(ApiError::bad_field("lora_path", "`lora_path` must be a string (a loaded adapter's name)"));
        };
        if !s.lora.enabled() {
            return Err(ApiError::bad_field("lora_path", "LoRA is not enabled on this worker (--lora-slots N)"));
        }
        if s.lora.touch(name) {
            return Ok(Some(name.to_string()));
        }
        return Err(ApiError::bad_field("lora_path", format!("LoRA adapter '{name}' is not loaded")));
    }
    if model.is_empty() || model == s.cfg.model {
        return Ok(None);
    }
    if s.lora.touch(model) {
        return Ok(Some(model.to_string()));
    }
    if s.cfg.model.is_empty() {
        return Ok(None);
    }
    Err(ApiError::new(StatusCode::NOT_FOUND, format!("The model `{model}` does not exist.")).with_param("model"))
}

/// Serves one completion (chat, completions or SGLang `/generate`): reads the request,
/// injects faults, waits for a decode's KV, runs it on the engine and answers, streamed or
/// whole.
async fn complete(s: Arc<EngineSim>, api: Api, body: Bytes) -> Response {
    let t0 = Instant::now();
    let req = match Incoming::read(&s, api, &body) {
        Ok(r) => r,
        Err(resp) => return *resp,
    };
    let mut handoff = match &req.mode {
        pd::Mode::SglangPrefill(room) => Some(pd::Handoff::new(&s.pd, room)),
        _ => None,
    };
    if let Some(resp) = inject_faults(&s, &mut handoff).await {
        return resp;
    }
    let transferred = match receive_kv(&s, &req.mode).await {
        Ok(t) => t,
        Err(resp) => return resp,
    };
    if req.adapter.is_some() {
        s.lora.count_request();
    }
    let prompt = prompt_blocks(&req.info, req.adapter.as_deref(), req.opts.cache_salt.as_deref());
    let input_tokens = prompt.input_tokens;
    if let Err(e) = within_context(input_tokens, req.info.max_tokens) {
        return e.into_response();
    }
    let (mut rx, id, output) = match enqueue(&s, &req, prompt, transferred.is_some()).await {
        Ok(x) => x,
        Err(resp) => return resp,
    };
    let first = match first_token(&mut rx, &mut handoff).await {
        Ok(f) => f,
        Err(resp) => return resp,
    };
    let kv_params = publish_kv(&s, handoff.take(), &req.mode, input_tokens);
    s.metrics.ttft.observe(t0.elapsed().as_secs_f64());
    let cached = count_prompt(&s, transferred, first, input_tokens);
    let answer = Answer::new(&s, api, &req, id, input_tokens, output, cached);
    // vLLM's prefill for a remote decode always answers in one piece (with its
    // `kv_transfer_params`).
    if req.info.stream && kv_params.is_none() {
        let s2 = Arc::clone(&s);
        let stream = async_stream(rx, output, decode_step(&s), answer, move || count_finished(&s2, output, t0));
        return Response::builder()
            .status(200)
            .header(header::CONTENT_TYPE, "text/event-stream")
            .header(header::CACHE_CONTROL, "no-cache")
            .body(Body::from_stream(stream))
            .unwrap_or_else(|_| err(StatusCode::INTERNAL_SERVER_ERROR, "response"));
    }
    full_response(&s, rx, &answer, kv_params, t0).await
}

/// A request as read from its body: what routing reads, the simulator's own options, and
/// how it is served (slot, logprobs, adapter, P/D mode).
struct Incoming {
    info: RoutingInfo,
    opts: Options,
    id_slot: Option<u32>,
    ask: Option<quality::Ask>,
    adapter: Option<String>,
    mode: pd::Mode,
}

impl Incoming {
    /// Reads `body`; the error answer (boxed: it is large) for a bad field, an unknown model
    /// or bad P/D fields.
    fn read(s: &EngineSim, api: Api, body: &[u8]) -> Result<Incoming, Box<Response>> {
        let info = parse(api, body, None).map_err(boxed)?;
        let opts = serde_json::from_slice::<Options>(body).unwrap_or_default();
        // llama.cpp reads `id_slot` as an integer; -1 (its default) lets the engine pick.
        let id_slot = match &opts.id_slot {
            None | Some(serde_json::Value::Null) => None,
            Some(v) => match v.as_i64() {
                Some(n) if n < 0 => None,
                Some(n) => Some(u32::try_from(n).unwrap_or(u32::MAX)),
                None => return Err(Box::new(err(StatusCode::BAD_REQUEST, "`id_slot` must be an integer"))),
            },
        };
        let ask = opts.ask(api).map_err(boxed)?;
        let adapter = resolve_model(s, api, &info.model, opts.lora_path.as_ref()).map_err(boxed)?;
        let mode =
            pd::mode(s.pd.role, &serde_json::from_slice::<pd::Fields>(body).unwrap_or_default()).map_err(boxed)?;
        Ok(Incoming { info, opts, id_slot, ask, adapter, mode })
    }
}

/// An error answer, boxed.
fn boxed(e: impl IntoResponse) -> Box<Response> {
    Box::new(e.into_response())
}

/// Failure injection: exits after `--crash-after` requests, answers 500 to a share
/// `--error-rate` of them (failing an SGLang prefill's handoff) and never answers a share
/// `--hang-rate`. `None`: serve the request.
async fn inject_faults(s: &EngineSim, handoff: &mut Option<pd::Handoff<'_>>) -> Option<Response> {
    let n = s.served.fetch_add(1, Ordering::Relaxed) + 1;
    if s.cfg.crash_after.is_some_and(|c| n > c) {
        tracing::error!("engine-sim: crash injected after {} requests", n - 1);
        std::process::exit(3);
    }
    let roll = (stable_hash(&[s.cfg.fault_seed.to_le_bytes(), n.to_le_bytes()].concat()) % 1_000_000) as f64 / 1e6;
    if roll < s.cfg.error_rate {
        if let Some(h) = handoff.take() {
            h.fail("injected failure");
        }
        return Some(err(StatusCode::INTERNAL_SERVER_ERROR, "injected failure"));
    }
    if roll < s.cfg.error_rate + s.cfg.hang_rate {
        std::future::pending::<()>().await;
    }
    None
}

/// A decode waits for its KV before anything is answered (a streamed request's error
/// comes before any byte): the transferred prompt tokens, or `None` for a request that
/// computes its own prompt.
async fn receive_kv(s: &EngineSim, mode: &pd::Mode) -> Result<Option<u64>, Response> {
    match mode {
        pd::Mode::Decode(src) => match s.pd.receive(src, pd::wall_secs(s.cfg.bootstrap_timeout_secs)).await {
            Ok((tokens, _bytes)) => Ok(Some(tokens)),
            Err(e) => Err(e.into_response()),
        },
        pd::Mode::LocalPrefill => {
            s.pd.count_local_prefill();
            Ok(None)
        }
        _ => Ok(None),
    }
}

/// A prompt as the engine sees it.
struct Prompt {
    /// Prompt tokens (given, or estimated from the text).
    input_tokens: u32,
    /// Its full blocks' hashes.
    blocks: Vec<BlockHash>,
    /// Its token ids (given, or pseudo-tokens of the text), for KV events.
    ids: Vec<u32>,
}

/// The prompt's blocks. An adapter's blocks hash on a chain seeded by its name: never
/// shared with the base model's or another adapter's (vLLM keys prefix-cache blocks by
/// LoRA id). A `cache_salt` roots the chain apart in the same way (vLLM's per-tenant
/// isolation).
fn prompt_blocks(info: &RoutingInfo, adapter: Option<&str>, cache_salt: Option<&str>) -> Prompt {
    let chain_seed = match (adapter.map(lora::adapter_seed), cache_salt) {
        (seed, None) => seed,
        (seed, Some(salt)) => Some(HashAlgo::Xxh3.chain(
            seed.unwrap_or(kvroute_core::hash::ROOT_SEED),
            &[b"cache_salt\0".as_slice(), salt.as_bytes()].concat(),
        )),
    };
    let mut blocks: Vec<BlockHash> = Vec::new();
    match &info.token_ids {
        Some(t) => {
            match chain_seed {
                None => {
                    kvroute_core::hash::hash_token_blocks(
                        t,
                        BLOCK_TOKENS as usize,
                        usize::MAX,
                        HashAlgo::Xxh3,
                        &mut blocks,
                    );
                }
                Some(seed) => lora::token_blocks(t, BLOCK_TOKENS as usize, seed, &mut blocks),
            }
            Prompt { input_tokens: t.len() as u32, blocks, ids: t.clone() }
        }
        None => {
            match chain_seed {
                None => {
                    hash_text_blocks(&info.text, BLOCK_TOKENS as usize, usize::MAX, HashAlgo::Xxh3, &mut blocks);
                }
                Some(seed) => lora::text_blocks(&info.text, BLOCK_TOKENS as usize, seed, &mut blocks),
            }
            Prompt { input_tokens: estimate_tokens(&info.text).max(1), blocks, ids: pseudo_tokens(&info.text) }
        }
    }
}

/// Hands the request to the engine (`--instant`: answers it at once, one token); its
/// events, its id and its output tokens (one for a prefill of a remote decode). 503 when
/// the engine has stopped.
async fn enqueue(
    s: &EngineSim,
    req: &Incoming,
    prompt: Prompt,
    kv_transferred: bool,
) -> Result<(mpsc::Receiver<EngineEvent>, u64, u32), Response> {
    let token_ids: Option<Arc<[u32]>> = s.cfg.kv_events.is_some().then(|| prompt.ids.into());
    let id = s.next_id.fetch_add(1, Ordering::Relaxed);
    let (tx, rx) = mpsc::channel(4);
    if s.cfg.instant {
        // No engine: the first token and the end are already there.
        let _ = tx.try_send(EngineEvent::FirstToken { id, at: Nanos(0), cached_tokens: 0 });
        let _ = tx.try_send(EngineEvent::Finished { id, at: Nanos(0) });
        return Ok((rx, id, 1));
    }
    // A prefill for a remote decode produces one token.
    let output = if req.mode.is_prefill() { 1 } else { req.info.max_tokens.unwrap_or(16).clamp(1, 8192) };
    let engine_req = EngineRequest {
        id,
        input_tokens: prompt.input_tokens,
        output_tokens: output,
        blocks: prompt.blocks,
        block_tokens: BLOCK_TOKENS,
        token_ids,
        kv_transferred,
        slot: req.id_slot,
        restore: None,
    };
    if s.tx.send(Cmd::Submit { req: engine_req, reply: tx }).await.is_err() {
        return Err(err(StatusCode::SERVICE_UNAVAILABLE, "engine stopped"));
    }
    if let Some(t) = s.driver.get() {
        t.unpark();
    }
    Ok((rx, id, output))
}

/// Waits for the first token: the prompt tokens the engine found in its cache. 503 (and a
/// failed handoff) when the engine rejected the request.
async fn first_token(
    rx: &mut mpsc::Receiver<EngineEvent>,
    handoff: &mut Option<pd::Handoff<'_>>,
) -> Result<u32, Response> {
    match rx.recv().await {
        Some(EngineEvent::FirstToken { cached_tokens, .. }) => Ok(cached_tokens),
        Some(EngineEvent::Rejected { .. }) | None => {
            if let Some(h) = handoff.take() {
                h.fail("request does not fit in the KV cache or the queue is full");
            }
            Err(err(StatusCode::SERVICE_UNAVAILABLE, "request does not fit in the KV cache or the queue is full"))
        }
        Some(EngineEvent::Finished { .. }) => Ok(0),
        // Never sent to a request (the driver keeps slot-file events).
        Some(EngineEvent::SlotRestored { .. } | EngineEvent::SlotSaved { .. }) => Ok(0),
    }
}

/// The prefill is over: its KV is ready on the bootstrap server after the copy time
/// (SGLang: through the handoff; vLLM: under a key returned as `kv_transfer_params`).
fn publish_kv(
    s: &EngineSim,
    handoff: Option<pd::Handoff<'_>>,
    mode: &pd::Mode,
    input_tokens: u32,
) -> Option<serde_json::Value> {
    let kv_delay = Duration::from_secs_f64(
        s.cfg.kv_transfer.delay(u64::from(input_tokens)).as_secs_f64() / s.cfg.time_scale.max(1e-6),
    );
    let kv_bytes = s.cfg.kv_transfer.bytes(u64::from(input_tokens));
    if let Some(h) = handoff {
        h.publish(u64::from(input_tokens), kv_bytes, kv_delay);
    }
    (*mode == pd::Mode::VllmPrefill).then(|| {
        let (block_ids, key) = s.pd.vllm_transfer(u64::from(input_tokens));
        s.pd.publish(&key, u64::from(input_tokens), kv_bytes, kv_delay);
        s.pd.vllm_params(&block_ids)
    })
}

/// Counts the prompt in the metrics; returns the tokens reported as cached. Transferred
/// KV is not a prefix-cache lookup; its tokens are reported as cached.
fn count_prompt(s: &EngineSim, transferred: Option<u64>, first: u32, input_tokens: u32) -> u32 {
    let cached = match transferred {
        Some(t) => u32::try_from(t).unwrap_or(u32::MAX),
        None => {
            s.metrics.hits.inc_by(u64::from(first));
            s.metrics.queries.inc_by(u64::from(input_tokens));
            first
        }
    };
    s.metrics.prompt_tokens.inc_by(u64::from(input_tokens));
    cached
}

/// Counts a finished request: its output tokens, the request and its end-to-end time.
fn count_finished(s: &EngineSim, output: u32, t0: Instant) {
    s.metrics.generation_tokens.inc_by(u64::from(output));
    s.metrics.requests.inc();
    s.metrics.e2e.observe(t0.elapsed().as_secs_f64());
}

/// Wall time of one decode step of the profile.
fn decode_step(s: &EngineSim) -> Duration {
    Duration::from_secs_f64(
        (s.cfg.profile.step_overhead_s + s.cfg.profile.decode_per_seq_s) / s.cfg.time_scale.max(1e-6),
    )
}

/// One answer: its id, model and tokens, and how each API writes it (stream chunks, the
/// last chunk with usage, or the whole body).
struct Answer {
    api: Api,
    rid: String,
    model: String,
    created: u64,
    toks: quality::Tokens,
    ask: Option<quality::Ask>,
    input_tokens: u32,
    output: u32,
    cached: u32,
}

impl Answer {
    /// The answer to `req`, engine request `id`.
    fn new(s: &EngineSim, api: Api, req: &Incoming, id: u64, input_tokens: u32, output: u32, cached: u32) -> Answer {
        let toks = quality::Tokens::new(
            stable_hash(req.info.text.as_bytes()),
            prompt_mean_logprob(&s.cfg, &req.info.text),
            output,
            s.cfg.quality_spread > 0.0,
            matches!(req.ask, Some(quality::Ask::Completions { .. })),
        );
        let model = match &req.adapter {
            Some(a) => a.clone(),
            None if s.cfg.model.is_empty() => req.info.model.clone(),
            None => s.cfg.model.clone(),
        };
        Answer {
            api,
            rid: format!("kvsim-{id}"),
            model,
            created: 1_700_000_000u64,
            toks,
            ask: req.ask,
            input_tokens,
            output,
            cached,
        }
    }

    /// OpenAI's `usage`.
    fn usage(&self) -> serde_json::Value {
        let (input_tokens, output) = (self.input_tokens, self.output);
        serde_json::json!({"prompt_tokens": input_tokens, "completion_tokens": output,
            "total_tokens": input_tokens + output, "prompt_tokens_details": {"cached_tokens": self.cached}})
    }

    /// The stream chunk of output token `i`.
    fn chunk(&self, i: u32) -> serde_json::Value {
        let (rid, model, created, toks) = (&self.rid, &self.model, self.created, &self.toks);
        let w = toks.text(i);
        let lp = self.ask.map(|a| quality::logprobs_json(a, toks, i..i + 1));
        match self.api {
            Api::Chat => {
                serde_json::json!({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": w}, "logprobs": lp, "finish_reason": null}]})
            }
            Api::Completions => {
                serde_json::json!({"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": w, "logprobs": lp, "finish_reason": null}]})
            }
            Api::Generate => {
                let mut c = serde_json::json!({"text": w, "meta_info": {"id": rid, "completion_tokens": i + 1}});
                if let Some(lp) = lp {
                    c["meta_info"]["output_token_logprobs"] = lp;
                }
                c
            }
        }
    }

    /// The stream's last chunk: the finish reason and the usage.
    fn last_chunk(&self) -> serde_json::Value {
        let (rid, model, created, usage) = (&self.rid, &self.model, self.created, self.usage());
        match self.api {
            Api::Chat => {
                serde_json::json!({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}], "usage": usage})
            }
            Api::Completions => {
                serde_json::json!({"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": usage})
            }
            Api::Generate => {
                serde_json::json!({"text": "", "meta_info": {"id": rid, "finish_reason": {"type": "length"}, "usage": usage}})
            }
        }
    }

    /// The whole answer of a request not streamed.
    fn body(&self) -> serde_json::Value {
        let (rid, model, created, usage) = (&self.rid, &self.model, self.created, self.usage());
        let text = self.toks.full_text();
        let lp = self.ask.map(|a| quality::logprobs_json(a, &self.toks, 0..self.output));
        match self.api {
            Api::Chat => serde_json::json!({"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp, "finish_reason": "length"}],
                "usage": usage}),
            Api::Completions => {
                serde_json::json!({"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": "length"}], "usage": usage})
            }
            Api::Generate => {
                let mut b = serde_json::json!({"text": text, "meta_info": {"id": rid, "prompt_tokens": self.input_tokens,
                    "completion_tokens": self.output, "cached_tokens": self.cached, "finish_reason": {"type": "length"}}});
                if let Some(lp) = lp {
                    b["meta_info"]["output_token_logprobs"] = lp;
                }
                b
            }
        }
    }
}

/// A request not streamed: answered whole once the engine has finished it (with vLLM's
/// `kv_transfer_params` for a prefill of a remote decode).
async fn full_response(
    s: &EngineSim,
    mut rx: mpsc::Receiver<EngineEvent>,
    answer: &Answer,
    kv_params: Option<serde_json::Value>,
    t0: Instant,
) -> Response {
    while let Some(ev) = rx.recv().await {
        if matches!(ev, EngineEvent::Finished { .. }) {
            break;
        }
    }
    count_finished(s, answer.output, t0);
    let mut body = answer.body();
    if let Some(p) = kv_params {
        body["kv_transfer_params"] = p;
    }
    Json(body).into_response()
}

/// The SSE stream: first token now, then one token per decode step until the engine says
/// the request finished (remaining tokens are flushed then), a final usage chunk and
/// `[DONE]`. `finish` runs once the engine has finished the request.
fn async_stream(
    rx: mpsc::Receiver<EngineEvent>,
    output: u32,
    step: Duration,
    answer: Answer,
    finish: impl FnOnce() + Send + 'static,
) -> impl futures_util::Stream<Item = Result<Bytes, std::io::Error>> + Send {
    struct St<F> {
        rx: mpsc::Receiver<EngineEvent>,
        i: u32,
        done: bool,
        finished_engine: bool,
        answer: Answer,
        finish: Option<F>,
        tail_sent: bool,
    }
    let st = St { rx, i: 0, done: false, finished_engine: false, answer, finish: Some(finish), tail_sent: false };
    futures_util::stream::unfold(st, move |mut st| async move {
        if st.done {
            return None;
        }
        if st.i < output {
            if st.i > 0 && !st.finished_engine {
                tokio::select! {
                    ev = st.rx.recv() => {
                        if matches!(ev, Some(EngineEvent::Finished { .. }) | None) { st.finished_engine = true; }
                    }
                    () = tokio::time::sleep(step) => {}
                }
            }
            let c = st.answer.chunk(st.i);
            st.i += 1;
            return Some((Ok(Bytes::from(format!("data: {c}\n\n"))), st));
        }
        if !st.tail_sent {
            while !st.finished_engine {
                match st.rx.recv().await {
                    Some(EngineEvent::Finished { .. }) | None => st.finished_engine = true,
                    _ => {}
                }
            }
            if let Some(f) = st.finish.take() {
                f();
            }
            st.tail_sent = true;
            let last = st.answer.last_chunk();
            return Some((Ok(Bytes::from(format!("data: {last}\n\ndata: [DONE]\n\n"))), st));
        }
        None
    })
}
