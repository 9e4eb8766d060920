//! Request and worker views: the only inputs a policy sees.
//!
//! Views are borrowed, plain data. Front ends (gateway, replay simulator, engine simulator)
//! build them from their own state; the routing core never performs I/O to obtain them.

use serde::{Deserialize, Serialize};

/// Logical or wall time in nanoseconds since an arbitrary epoch chosen by the front end
/// (the gateway uses its start instant, the simulator its logical clock).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
pub struct Nanos(pub u64);

impl Nanos {
    /// Zero time.
    pub const ZERO: Nanos = Nanos(0);
    /// Builds a time from seconds (saturating).
    pub fn from_secs_f64(secs: f64) -> Nanos {
        Nanos((secs.max(0.0) * 1e9) as u64)
    }
    /// Builds a time from whole milliseconds.
    pub const fn from_millis(ms: u64) -> Nanos {
        Nanos(ms.saturating_mul(1_000_000))
    }
    /// Builds a time from whole seconds.
    pub const fn from_secs(s: u64) -> Nanos {
        Nanos(s.saturating_mul(1_000_000_000))
    }
    /// This time in seconds.
    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 / 1e9
    }
    /// `self - earlier`, or zero when `earlier` is later.
    pub const fn saturating_sub(self, earlier: Nanos) -> Nanos {
        Nanos(self.0.saturating_sub(earlier.0))
    }
    /// `self + d`, saturating.
    pub const fn saturating_add(self, d: Nanos) -> Nanos {
        Nanos(self.0.saturating_add(d.0))
    }
}

/// Dense identity of a worker (one inference server endpoint) inside one router.
///
/// Ids are small integers handed out by the front end's worker registry and are never
/// reused while the router runs, so per-worker state can live in `Vec`s indexed by id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct WorkerId(pub u32);

impl WorkerId {
    /// The id as a `Vec` index.
    pub const fn index(self) -> usize {
        self.0 as usize
    }
}

impl std::fmt::Display for WorkerId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "w{}", self.0)
    }
}

/// What part of inference a worker serves (prefill/decode disaggregation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Prefill only: runs the prompt's forward pass and hands KV blocks on.
    Prefill,
    /// Decode only: receives KV blocks and generates tokens.
    Decode,
    /// Both phases (an ordinary, colocated worker).
    #[default]
    Both,
}

impl Role {
    /// Lower-case name used in metrics and config.
    pub const fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Both => "both",
        }
    }
    /// Whether a worker of role `self` can serve a request asking for `wanted`.
    pub fn serves(self, wanted: Role) -> bool {
        self == Role::Both || wanted == Role::Both || self == wanted
    }
}

/// A chained block hash: covers its block's tokens *and* its parent block's hash, so equal
/// hashes at the same position mean equal prefixes. See [`crate::hash`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct BlockHash(pub u64);

/// Precomputed chained block hashes of a prompt (for example a Mooncake trace's `hash_ids`).
#[derive(Debug, Clone, Copy)]
pub struct BlockSeq<'a> {
    /// Tokens per block (512 for Mooncake traces, 16 for vLLM by default).
    pub block_tokens: u32,
    /// One chained hash per block, in prompt order.
    pub hashes: &'a [BlockHash],
}

/// Everything a policy may know about one request. Borrowed; build one per routing call.
///
/// At least one of `text`, `token_ids` or `blocks` should be set for prefix-aware policies;
/// when none is, they fall back to their load-only branch (`no_prefix`).
#[derive(Debug, Clone, Copy)]
pub struct RequestView<'a> {
    /// Requested model name (already resolved; workers not serving it are not candidates).
    pub model: &'a str,
    /// Routing text: the prompt as text (chat messages flattened in order), when known.
    pub text: Option<&'a str>,
    /// Prompt token ids with the engine's tokenizer and chat template, when known.
    pub token_ids: Option<&'a [u32]>,
    /// Precomputed chained block hashes, when the front end has them (traces, KV-event mode).
    pub blocks: Option<BlockSeq<'a>>,
    /// Prompt length in tokens (exact when `token_ids` is set, else an estimate).
    pub input_tokens: u32,
    /// Expected output tokens, when known (traces; `max_tokens` in live traffic).
    pub output_tokens: Option<u32>,
    /// Session (conversation) id for session-aware policies, when known.
    pub session_id: Option<&'a str>,
    /// Which phase this routing call is for.
    pub role: Role,
}

impl<'a> RequestView<'a> {
    /// A view with only a model and a text prompt; the input length is estimated at
    /// [`CHARS_PER_TOKEN`] characters per token.
    pub fn from_text(model: &'a str, text: &'a str) -> Self {
        RequestView {
            model,
            text: Some(text),
            token_ids: None,
            blocks: None,
            input_tokens: estimate_tokens(text),
            output_tokens: None,
            session_id: None,
            role: Role::Both,
        }
    }
}

/// Characters per token assumed when only text is known (a common English average for
/// BPE tokenizers; used for estimates and for text-chunk blocks, never for accounting).
pub const CHARS_PER_TOKEN: usize = 4;

/// Estimated token count of `text` at [`CHARS_PER_TOKEN`] (rounded up, at least 1 for
/// non-empty text).
pub fn estimate_tokens(text: &str) -> u32 {
    text.len().div_ceil(CHARS_PER_TOKEN).min(u32::MAX as usize) as u32
}

/// Health of a worker as the front end sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Health {
    /// Passing health checks: routable.
    #[default]
    Healthy,
    /// Being removed: finishes in-flight work, receives no new requests.
    Draining,
    /// Failing health checks or circuit open: never routed to.
    Unhealthy,
}

/// Static capacity facts of a worker (Cognitora cgn-router's `capacity(n)` inputs).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Capacity {
    /// Tensor-parallel size (GPUs per worker).
    pub tp_size: u32,
    /// Bytes per weight element (2 for fp16/bf16, 1 for fp8/int8).
    pub dtype_bytes: u32,
    /// Accelerator memory in GiB.
    pub vram_gib: f64,
    /// Free model slots (for multi-model hosts).
    pub free_model_slots: u32,
    /// Maximum concurrent requests the worker accepts (`max_concurrent`).
    pub max_concurrent: u32,
    /// Tokens the worker's KV cache holds (SGLang `/server_info` `max_total_num_tokens`,
    /// vLLM `num_gpu_blocks × block_size` from its `vllm:cache_config_info` metric,
    /// llama.cpp `total_slots` × a slot's `n_ctx`, or `[capacity."URL"] kv_tokens`); `None`
    /// when unknown. A policy that estimates what a worker caches from what it routed there
    /// (`prefill_cost`, `least_ttft`) sizes that estimate to it, so the estimate forgets
    /// what the engine must have evicted.
    #[serde(default)]
    pub kv_tokens: Option<u64>,
}

impl Default for Capacity {
    fn default() -> Self {
        Capacity {
            tp_size: 1,
            dtype_bytes: 2,
            vram_gib: 80.0,
            free_model_slots: 1,
            max_concurrent: 256,
            kv_tokens: None,
        }
    }
}

/// Everything a policy may know about one worker at routing time. Plain data, cheap to copy.
///
/// Counters marked *router* come from the front end's [`crate::ledger::LoadLedger`];
/// fields marked *engine* come from the worker's own metrics (scraped, or simulated) and are
/// `None` when unknown.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorkerView {
    /// Dense id.
    pub id: WorkerId,
    /// Health; only [`Health::Healthy`] workers are ever chosen.
    pub health: Health,
    /// Role served.
    pub role: Role,
    /// *router*: requests dispatched and not yet finished (B3 `num_requests`).
    pub in_flight: u32,
    /// *router*: in-flight requests that have not produced their first token yet.
    pub waiting: u32,
    /// *router*: prompt tokens dispatched whose prefill has not finished, minus the
    /// estimated cached part (B3 `pending_prefill_tokens`).
    pub pending_prefill_tokens: u64,
    /// *router*: tokens of requests in their decode phase (B3 `ongoing_decode_tokens`).
    pub decode_tokens: u64,
    /// *engine*: queue length (requests waiting inside the engine), e.g.
    /// `vllm:num_requests_waiting`.
    pub engine_queue: Option<u32>,
    /// *engine*: running requests, e.g. `vllm:num_requests_running`.
    pub engine_running: Option<u32>,
    /// *engine*: KV cache usage in [0, 1], e.g. `vllm:kv_cache_usage_perc`.
    pub kv_cache_usage: Option<f64>,
    /// *engine*: compute utilisation in [0, 1] (SM busy fraction).
    pub sm_util: Option<f64>,
    /// *engine*: power draw in watts (rolling average).
    pub power_watts: Option<f64>,
    /// *engine, precise*: prompt tokens of **this request** that the worker's KV cache
    /// holds according to its KV events ([`crate::precise::PreciseIndex::cached_tokens`]),
    /// set per request by the caller. `None` when the worker publishes no events: prefix
    /// policies then use their own approximate index for this worker.
    pub cached_tokens: Option<u64>,
    /// The worker's name in every router, for tie-breaks replicas must agree on whatever
    /// order they list their workers in (the gateway: a stable hash of its URL). `None`:
    /// its `id`, which is this router's own.
    pub tie_key: Option<u64>,
    /// Static capacity.
    pub capacity: Capacity,
}

impl WorkerView {
    /// A healthy, idle worker with default capacity.
    pub fn idle(id: WorkerId) -> Self {
        WorkerView {
            id,
            health: Health::Healthy,
            role: Role::Both,
            in_flight: 0,
            waiting: 0,
            pending_prefill_tokens: 0,
            decode_tokens: 0,
            engine_queue: None,
            engine_running: None,
            kv_cache_usage: None,
            sm_util: None,
            power_watts: None,
            cached_tokens: None,
            tie_key: None,
            capacity: Capacity::default(),
        }
    }

    /// The queue length used by load-gated policies: the larger of the router's in-flight
    /// count and the engine's own waiting + running count (the engine sees requests that
    /// bypassed this router; the router sees requests the engine has not received yet).
    pub fn load(&self) -> u32 {
        let engine = self.engine_queue.unwrap_or(0).saturating_add(self.engine_running.unwrap_or(0));
        self.in_flight.max(engine)
    }

    /// Whether the worker may receive new requests.
    pub fn is_routable(&self) -> bool {
        self.health == Health::Healthy
    }
}
