//! The vocabulary of a replay, shared by the colocated replay ([`crate::replay`]) and the
//! disaggregated one ([`crate::pd`]): its settings ([`ReplayConfig`], [`PrefixState`],
//! [`KvOracle`], [`PdConfig`] with its [`TransferModel`]), its results ([`Outcome`],
//! [`ReplayResult`], [`ReplayError`]), and what the router sees of an engine (`RouterView`,
//! [`BusyWindow`]). Both replays import it; it imports neither, so the imports go one way.
//!
//! ## Transfer model
//! [`TransferModel::delay`]: `latency_secs + kv_bytes_per_token × tokens /
//! (link_gbytes_per_s × 1e9)` simulated seconds, where `tokens` is the prompt's token count
//! (the whole prompt's KV is copied; the one output token of the prefill is not). Each
//! transfer is modelled alone: no link contention between concurrent transfers, no
//! pipelining of the copy with the prefill (the copy starts when the prefill ends).

use crate::engine::{Engine, InvalidSetting, Profile};
use crate::trace::TraceRequest;
use kvroute_core::ledger::LoadLedger;
use kvroute_core::precise::PredictWindow;
use kvroute_core::registry;
use kvroute_core::types::{BlockSeq, Nanos, RequestView, Role, WorkerId, WorkerView};
use serde::{Deserialize, Serialize};

/// Default KV bytes per token: 131,072 (128 KiB), Llama-3-8B in fp16/bf16 — 32 layers × 8
/// KV heads × 128 dims × 2 (K and V) × 2 bytes.
pub const DEFAULT_KV_BYTES_PER_TOKEN: u64 = 131_072;

/// Default link bandwidth, GB/s (10^9 bytes per second): 25 GB/s, a 200 Gb/s RDMA NIC
/// (ConnectX-6/7 class), the link SGLang's Mooncake and vLLM's NIXL transfers run over.
pub const DEFAULT_LINK_GBYTES_PER_S: f64 = 25.0;

/// Default prompt length at or below which a request runs colocated, tokens (the
/// gateway's `[router.disagg] colocate_below_tokens` default, [`kvroute_core::disagg::DisaggConfig`]).
pub const DEFAULT_COLOCATE_BELOW_TOKENS: u32 = 2048;

/// How long copying a prompt's KV cache from a prefill to a decode engine takes.
/// See the module docs for the formula and what it leaves out.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TransferModel {
    /// KV cache bytes per prompt token (all layers, K and V), ≥ 1. Default
    /// [`DEFAULT_KV_BYTES_PER_TOKEN`] (Llama-3-8B fp16).
    pub kv_bytes_per_token: u64,
    /// Link bandwidth, GB/s (10^9 bytes/s), finite and > 0. Default
    /// [`DEFAULT_LINK_GBYTES_PER_S`].
    pub link_gbytes_per_s: f64,
    /// Fixed cost of one transfer (handshake, completion notification), seconds, 0 to
    /// [`MAX_TRANSFER_LATENCY_SECS`]. Default 0.
    pub latency_secs: f64,
}

/// Largest `latency_secs` of a [`TransferModel`], seconds (1 day): a larger one overflowed
/// the simulated nanosecond clock (2e10 s printed a mean TTFT of 6 ms).
pub const MAX_TRANSFER_LATENCY_SECS: f64 = 86_400.0;

impl Default for TransferModel {
    fn default() -> Self {
        TransferModel {
            kv_bytes_per_token: DEFAULT_KV_BYTES_PER_TOKEN,
            link_gbytes_per_s: DEFAULT_LINK_GBYTES_PER_S,
            latency_secs: 0.0,
        }
    }
}

impl TransferModel {
    /// Checks the knobs: `kv_bytes_per_token` ≥ 1, `link_gbytes_per_s` finite and > 0,
    /// `latency_secs` from 0 to [`MAX_TRANSFER_LATENCY_SECS`].
    ///
    /// # Errors
    /// [`InvalidSetting`] naming the field and its `--kv-*` flag.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        if self.kv_bytes_per_token == 0 {
            return Err(InvalidSetting::new("kv_bytes_per_token (--kv-bytes-per-token)", "must be at least 1, got 0"));
        }
        if !(self.link_gbytes_per_s.is_finite() && self.link_gbytes_per_s > 0.0) {
            return Err(InvalidSetting::new(
                "link_gbytes_per_s (--kv-link-gbytes-per-s)",
                format!("must be finite and > 0, got {}", self.link_gbytes_per_s),
            ));
        }
        if !(self.latency_secs.is_finite() && (0.0..=MAX_TRANSFER_LATENCY_SECS).contains(&self.latency_secs)) {
            return Err(InvalidSetting::new(
                "latency_secs (--kv-transfer-latency-secs)",
                format!("must be from 0 to {MAX_TRANSFER_LATENCY_SECS} s (1 day), got {:e}", self.latency_secs),
            ));
        }
        Ok(())
    }

    /// Bytes copied for a prompt of `tokens` tokens (saturating at `u64::MAX`).
    pub fn bytes(&self, tokens: u64) -> u64 {
        tokens.saturating_mul(self.kv_bytes_per_token)
    }

    /// Simulated time to copy a prompt of `tokens` tokens: `latency_secs + bytes /
    /// (link_gbytes_per_s × 1e9)` (assumes valid knobs).
    pub fn delay(&self, tokens: u64) -> Nanos {
        Nanos::from_secs_f64(self.latency_secs + self.bytes(tokens) as f64 / (self.link_gbytes_per_s * 1e9))
    }
}

/// Disaggregation settings of a replay ([`crate::pd::replay_pd`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PdConfig {
    /// Prefill engines (P ≥ 1): engines `0..P` of the replay.
    pub prefill_engines: usize,
    /// Decode engines (D ≥ 1): engines `P..P+D`.
    pub decode_engines: usize,
    /// Prompts of at most this many tokens run colocated on a decode engine; longer ones
    /// are split (as [`kvroute_core::disagg::plan`] decides for the gateway).
    pub colocate_below_tokens: u32,
    /// Policy routing decode phases and colocated requests over the D decode engines
    /// (default knobs). The prefill policy is [`ReplayConfig::policy`], with its knobs.
    pub decode_policy: String,
    /// KV transfer cost.
    pub transfer: TransferModel,
}

impl PdConfig {
    /// P prefill and D decode engines with the defaults: colocated at ≤ 2048 prompt
    /// tokens, `least_load` for decode, the default [`TransferModel`].
    pub fn new(prefill_engines: usize, decode_engines: usize) -> Self {
        PdConfig {
            prefill_engines,
            decode_engines,
            colocate_below_tokens: DEFAULT_COLOCATE_BELOW_TOKENS,
            decode_policy: "least_load".into(),
            transfer: TransferModel::default(),
        }
    }

    /// Checks P ≥ 1, D ≥ 1 and the transfer knobs.
    ///
    /// # Errors
    /// [`InvalidSetting`] naming the bad setting.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        if self.prefill_engines == 0 || self.decode_engines == 0 {
            return Err(InvalidSetting::new(
                "--pd",
                format!(
                    "{}:{}: at least one prefill and one decode engine are needed",
                    self.prefill_engines, self.decode_engines
                ),
            ));
        }
        self.transfer.validate()
    }
}
/// Settings of one replay.
#[derive(Debug, Clone)]
pub struct ReplayConfig {
    /// Number of engines.
    pub engines: usize,
    /// Engine profile.
    pub profile: Profile,
    /// Policy name (see `kvroute policies`).
    pub policy: String,
    /// Policy knobs (JSON object or null).
    pub knobs: serde_json::Value,
    /// Seed of the policy's random source.
    pub seed: u64,
    /// Waiting-queue bound per engine; beyond it a request is rejected.
    pub max_waiting: usize,
    /// Whether the router sees the engines' own queue/running/KV-usage counters (as when
    /// scraping `/metrics`); otherwise only its own ledger.
    pub engine_signals: bool,
    /// Where the router's prefix state comes from.
    pub prefix_state: PrefixState,
    /// With a profile with llama.cpp `slots`: the router keeps a
    /// [`kvroute_core::slots::SlotTable`] per engine, as `kvroute serve` does with
    /// `llama_slot_routing` — each view's `cached_tokens` is what the chosen slot holds of
    /// the request, and the request names that slot (llama.cpp `id_slot`). Off, or a
    /// paged-cache profile: requests name no slot and the engine picks.
    pub slot_routing: bool,
    /// Closed-loop sessions, for traces of closed-loop traffic (a chat client sends a turn
    /// when the previous one has answered; `kvroute serve --record` traces of such clients):
    /// a request with a session arrives no earlier than the end of its session's previous
    /// request, and as much later than its recorded time as that request arrived late.
    /// Off (the default), every request arrives at its trace time.
    pub closed_sessions: bool,
    /// A load generator's closed-loop clients: at most this many sessions at once, each
    /// sending its next request the instant the previous one has ended, as `kvroute bench
    /// --conversation-concurrency N` (and AIPerf `--concurrency` with sessions) sends them.
    /// Implies `closed_sessions`, without its recorded gaps between turns: in a recording of
    /// such clients those gaps are the recorded run's own service times. The first N
    /// sessions (in order of their first request; a request without a session is a session
    /// of one) start at their trace times; each later one starts when a session ends (its
    /// last request finishes or is rejected), at that instant, whatever its trace time. 0
    /// (the default) = no limit.
    pub session_concurrency: usize,
    /// The engines share this many CPU cores, one thread each (llama.cpp workers started with
    /// `-t 1` on one host, as `scripts/llama-workers.sh` does): while `n` engines are busy
    /// each runs at `min(1, cores / n)` of its profile's speed (processor sharing; an idle
    /// engine takes no CPU). The profile's times are then those of an engine alone on a
    /// core. Engine-side counters (`ReplayResult::busy_ns`, the `sm_util` signal) count
    /// work at full speed. 0 (the default) = every engine has its own hardware.
    pub host_cores: u32,
    /// The measured slow-down of each busy engine while k = 1, 2, … engines are busy on the
    /// shared host (`scripts/llama-calibrate.py --levels 1,2,3,4` writes it as
    /// `host_slowdown`): element k − 1 is the time a step takes with k busy engines over its
    /// time alone, so while k engines are busy each runs at `1 / host_slowdown[k − 1]` of
    /// its profile's speed (a value below 1 counts as 1). Past the list's end, its last
    /// value grows in proportion: `last × k / len`. It replaces `host_cores`' processor
    /// sharing, which leaves out what engines on one host slow each other down by besides
    /// the cores (caches, memory bandwidth): 1.06 at 2 busy workers on this 2-core virtual
    /// machine one evening, 0.94–1.12 the next day. Empty (the default) = `host_cores`
    /// alone decides.
    pub host_slowdown: Vec<f64>,
    /// An oracle that gives each request more of its prefix than any router could: a bound
    /// on what placement can gain from caching, not a routing policy. Off by default.
    pub kv_oracle: KvOracle,
    /// The KV mover of `kvroute serve`'s `[kv_migration]` (llama.cpp slot files, see
    /// [`crate::kv_move`]): needs a profile with `slots` and `slot_routing`. `None` (the
    /// default): off.
    pub kv_migration: Option<KvMigration>,
    /// Pulling a prefix's KV from the engine that holds it to the engine a request is sent
    /// to, over the network between GPUs (vLLM's NixlConnector, SGLang's transfer engine):
    /// see [`KvPull`]. Needs a paged KV cache (no `slots`) and the precise prefix state.
    /// `None` (the default): off.
    pub kv_pull: Option<KvPull>,
}

/// The replay's KV pull ([`ReplayConfig::kv_pull`]): a router that knows each engine's cache
/// (KV events) and, when the engine it sends a request to holds less of the prompt than
/// another engine does, has the KV of the longer prefix copied from that engine first, as
/// vLLM's `kv_transfer_params` (`do_remote_prefill` with the holder's `remote_block_ids`)
/// or SGLang's PD bootstrap do between a prefill and a decode instance.
///
/// - **When**: the other engine holds at least `min_tokens` more of the prompt, and the
///   transfer ([`KvPull::secs`]) takes less than the engine would spend prefilling those
///   tokens ([`KvPull::pays`], from the profile).
/// - **Cost**: the request reaches its engine `secs` later (it waits for its KV as vLLM's
///   `WAITING_FOR_REMOTE_KVS` requests do); neither engine computes meanwhile (the copy
///   is RDMA reading the holder's GPU memory). The blocks then enter the engine's prefix
///   cache as if computed there.
/// - **The policy's view**: an engine less loaded than every holder of the longest prefix,
///   and with less prefill queued (`pending_prefill_tokens`) than every one of them, is
///   credited with the tokens a pull there would bring, net of its cost
///   ([`KvPull::credit`], in its `cached_tokens`), so the policy weighs load against the
///   prefix at the transfer's price. An engine as loaded as a holder is not: the holder
///   runs the request without a pull; nor is one with as much queued as a holder: the
///   holder starts the request as soon, without the copy's wait. (Crediting on load alone
///   sent MT-bench's requests on 16 engines, where holders have no queue, to idle engines
///   through copies, 1.06× the fleet-oracle bound's mean TTFT against 1.03× now:
///   docs/lab/2026-11-29-pull-credit.md.)
///
/// Not modelled: the holder evicting the blocks while they are read (vLLM pins them until
/// the read ends), the network shared by concurrent pulls.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct KvPull {
    /// The copy, as the prefill/decode hand-over's ([`TransferModel`]): default Llama-3-8B's
    /// 128 KiB a token over 50 GB/s (400 Gb/s RDMA; NVLink is faster), plus 2 ms a copy
    /// (NIXL's metadata exchange and the request's extra hop).
    pub transfer: TransferModel,
    /// Fewest tokens a pull adds, tokens (256).
    pub min_tokens: u32,
}

impl Default for KvPull {
    fn default() -> Self {
        let transfer = TransferModel { link_gbytes_per_s: 50.0, latency_secs: 0.002, ..TransferModel::default() };
        KvPull { transfer, min_tokens: 256 }
    }
}

impl KvPull {
    /// Pulls of `profile`'s KV (its `kv_file_bytes_per_token` a token) over a link of
    /// `link_gbytes_per_s`, with the default latency and `min_tokens`; `None` when the
    /// profile does not say what a token's KV weighs (0).
    pub fn over(profile: &Profile, link_gbytes_per_s: f64) -> Option<KvPull> {
        let d = KvPull::default();
        let kv_bytes_per_token = profile.kv_file_bytes_per_token;
        let transfer = TransferModel { kv_bytes_per_token, link_gbytes_per_s, ..d.transfer };
        (kv_bytes_per_token > 0).then_some(KvPull { transfer, ..d })
    }

    /// Seconds to pull `tokens` tokens ([`TransferModel::delay`]).
    pub fn secs(&self, tokens: u64) -> f64 {
        self.transfer.delay(tokens).as_secs_f64()
    }

    /// Whether pulling `gain` more tokens onto an engine of `profile` that holds `own` of
    /// the prompt beats prefilling them there: `gain ≥ min_tokens` and [`KvPull::secs`] <
    /// the profile's prefill of `gain` tokens after `own` (beyond a pass over `own` alone).
    pub fn pays(&self, profile: &crate::engine::Profile, own: u64, gain: u64) -> bool {
        self.credit(profile, own, gain) > 0
    }

    /// The tokens of `gain` a pull is worth on an engine of `profile` that holds `own`:
    /// `gain × (1 − pull seconds / prefill seconds)`, what the engine saves net of the
    /// transfer, in tokens of its prefill; 0 when the pull does not pay ([`KvPull::pays`]).
    pub fn credit(&self, profile: &crate::engine::Profile, own: u64, gain: u64) -> u64 {
        if gain < u64::from(self.min_tokens) {
            return 0;
        }
        let recompute = profile.prefill_secs(own, gain) - profile.prefill_secs(own, 0);
        let pull = self.secs(gain);
        if pull < recompute { (gain as f64 * (1.0 - pull / recompute)) as u64 } else { 0 }
    }
}

/// What the replay's KV pulls did ([`ReplayConfig::kv_pull`]).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct KvPullCounts {
    /// Requests that waited for a pull.
    pub kv_pulls: u64,
    /// Prompt tokens pulled.
    pub kv_pulled_tokens: u64,
    /// Seconds the requests waited for their pulls, summed.
    pub kv_pull_secs: f64,
}

impl ReplayConfig {
    /// `policy` (default knobs, seed 0) on `engines` engines of `profile`, with the plain
    /// settings: 4,096 waiting requests per engine, the engines' own signals in the views,
    /// the approximate prefix state, open arrivals, engines on their own hardware, no
    /// oracle, no KV mover.
    pub fn new(policy: &str, engines: usize, profile: Profile) -> ReplayConfig {
        ReplayConfig {
            engines,
            profile,
            policy: policy.into(),
            knobs: serde_json::Value::Null,
            seed: 0,
            max_waiting: 4096,
            engine_signals: true,
            prefix_state: PrefixState::Approximate,
            slot_routing: false,
            closed_sessions: false,
            session_concurrency: 0,
            host_cores: 0,
            host_slowdown: Vec::new(),
            kv_oracle: KvOracle::Off,
            kv_migration: None,
            kv_pull: None,
        }
    }
}

/// Settings of the replay's KV mover ([`ReplayConfig::kv_migration`]); the defaults are
/// `kvroute serve`'s `[kv_migration]` defaults but for the byte bound.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct KvMigration {
    /// A prompt shorter than this is not saved, and a restore adding fewer tokens to the
    /// slot's hit is not tried, tokens (1,024).
    pub min_tokens: u32,
    /// Most files kept (256).
    pub max_files: usize,
    /// Most bytes kept, all files together (1 TiB: in effect unbounded; the profile's
    /// `kv_file_bytes_per_token` sizes the files).
    pub max_bytes: u64,
    /// A file not saved or restored for this long is removed (900 s).
    pub ttl: Nanos,
    /// Saves under way at once, fleet-wide; a request ending while this many run is not
    /// saved (2).
    pub max_concurrent_saves: usize,
}

impl Default for KvMigration {
    fn default() -> Self {
        KvMigration {
            min_tokens: 1024,
            max_files: 256,
            max_bytes: 1 << 40,
            ttl: Nanos::from_secs(900),
            max_concurrent_saves: 2,
        }
    }
}

/// What the KV mover did in one replay ([`ReplayConfig::kv_migration`]), summed over the
/// engines; serialised flat into the report (`kv_restores`, …).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct KvMigrationCounts {
    /// Slot files restored into the slot a request was sent to.
    pub kv_restores: u64,
    /// Tokens those restores read.
    pub kv_restored_tokens: u64,
    /// Simulated time the restores took, seconds.
    pub kv_restore_secs: f64,
    /// Prompt tokens the restores added to their slots' hits, as planned.
    pub kv_restore_gained_tokens: u64,
    /// Restores that would have added at least `min_tokens` but were predicted slower than
    /// recomputing.
    pub kv_restores_not_worth: u64,
    /// Slots saved to files.
    pub kv_saves: u64,
    /// Tokens those saves wrote.
    pub kv_saved_tokens: u64,
    /// Bytes they wrote (the profile's `kv_file_bytes_per_token`).
    pub kv_saved_bytes: u64,
    /// Simulated time the saves took, seconds.
    pub kv_save_secs: f64,
    /// Saves not started because `max_concurrent_saves` were running.
    pub kv_saves_skipped: u64,
    /// Files removed to keep the limits (count, bytes) or gone cold (age).
    pub kv_files_removed: u64,
    /// Files held at the end.
    pub kv_files_held: u64,
}

/// A free KV transfer before each request's prefill, for bounds: the request finds cached,
/// wherever it is sent, the longest prefix of it that the oracle's source holds, as if the
/// blocks had been copied to its engine at no cost (they are stored there as evictable
/// blocks and can be evicted again before it is admitted, like any other). Routed with a
/// load-only policy (`least_load`, `round_robin`), such a replay shows the TTFT that
/// perfect placement of every cached prefix would allow with balance for free. Profiles
/// with llama.cpp `slots` have no paged cache and ignore it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvOracle {
    /// No oracle: each engine has only what it computed itself.
    #[default]
    Off,
    /// The longest prefix that any engine of the fleet holds at the request's arrival
    /// (within the fleet's own KV capacity, as a perfect KV-transfer fabric between the
    /// engines would give it).
    Fleet,
    /// The longest prefix of it that any engine has ever computed, without bound (a shared
    /// KV store of unlimited size, as LMCache or Mooncake Store with unlimited host memory:
    /// the infinite-cache hit, minus prefixes still being computed).
    Store,
}

impl KvOracle {
    /// `off`, `fleet` or `store`.
    pub fn as_str(&self) -> &'static str {
        match self {
            KvOracle::Off => "off",
            KvOracle::Fleet => "fleet",
            KvOracle::Store => "store",
        }
    }
}

/// Where the router's prefix state comes from in a replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefixState {
    /// Approximate: each policy's own index of what it routed (no engine feedback).
    #[default]
    Approximate,
    /// Precise: every worker view carries the tokens of the request that the engine's KV
    /// cache really holds at routing time ([`WorkerView::cached_tokens`]) — what the router
    /// knows from loss-free, zero-delay KV events (`BlockStored` is sent when a prefill
    /// ends, as in vLLM and SGLang) — plus the predict-on-route window
    /// ([`kvroute_core::precise::PredictWindow`]; zero turns it off).
    Precise {
        /// Predict-on-route window.
        predict_window: Nanos,
    },
}

impl PrefixState {
    /// `approximate` or `precise`.
    pub fn as_str(&self) -> &'static str {
        match self {
            PrefixState::Approximate => "approximate",
            PrefixState::Precise { .. } => "precise",
        }
    }
}

/// What happened to one request.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Outcome {
    /// Engine it was sent to (`None` when no worker was routable).
    pub worker: Option<u32>,
    /// Arrival.
    pub arrival: Nanos,
    /// First token, when produced.
    pub first_token: Option<Nanos>,
    /// Completion, when finished.
    pub finished: Option<Nanos>,
    /// Prompt tokens.
    pub input_tokens: u32,
    /// Output tokens.
    pub output_tokens: u32,
    /// Prompt tokens served from the engine's prefix cache.
    pub cached_tokens: u32,
    /// Rejected (engine queue full, too large, or no routable worker).
    pub rejected: bool,
    /// Decision branch label.
    pub branch: &'static str,
    /// Prefill engine of a split request ([`crate::pd::replay_pd`]; `worker` is then its
    /// decode engine and `cached_tokens` the prefill engine's prefix hit); `None` when the
    /// request ran colocated on one engine.
    pub prefill_worker: Option<u32>,
    /// KV bytes copied from the prefill to the decode engine (0 unless split and its
    /// prefill finished).
    pub transfer_bytes: u64,
    /// The policy's predicted TTFT at routing, seconds ([`kvroute_core::policy::Decision::predicted_ttft`]);
    /// `None` for a policy that predicts none.
    pub predicted_ttft_s: Option<f64>,
}

impl Outcome {
    /// A request of the trace before it is routed.
    pub fn pending(r: &TraceRequest) -> Outcome {
        Outcome {
            worker: None,
            arrival: r.arrival,
            first_token: None,
            finished: None,
            input_tokens: r.input_tokens,
            output_tokens: r.output_tokens,
            cached_tokens: 0,
            rejected: false,
            branch: "",
            prefill_worker: None,
            transfer_bytes: 0,
            predicted_ttft_s: None,
        }
    }
}

/// Raw results of one replay, summarised by [`crate::report`].
#[derive(Debug, Clone)]
pub struct ReplayResult {
    /// Policy name.
    pub policy: String,
    /// Per-request outcomes, in trace order.
    pub outcomes: Vec<Outcome>,
    /// Busy time per engine, nanoseconds.
    pub busy_ns: Vec<u64>,
    /// Blocks evicted per engine.
    pub evictions: Vec<u64>,
    /// The disaggregation settings of a [`crate::pd::replay_pd`] run (engines
    /// `0..prefill_engines` prefill, the rest decode); `None` for a colocated replay.
    pub pd: Option<PdConfig>,
    /// What the KV mover did; `None` without [`ReplayConfig::kv_migration`].
    pub kv_migration: Option<KvMigrationCounts>,
    /// The KV pulls' counts ([`ReplayConfig::kv_pull`]); `None` when off.
    pub kv_pull: Option<KvPullCounts>,
}

/// Why a replay could not run.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// Bad policy name or knobs.
    #[error(transparent)]
    Policy(#[from] registry::BuildError),
    /// Bad settings.
    #[error(transparent)]
    Config(#[from] crate::engine::InvalidSetting),
}

/// Compute utilisation as an engine exporter reports it (DCGM's SM activity is an average
/// over its sampling period): the busy fraction of the engine over the last
/// [`UTIL_WINDOW`], refreshed once per window.
#[derive(Debug, Default, Clone, Copy)]
pub struct BusyWindow {
    since: Nanos,
    busy_at_since: u64,
    value: f64,
}

/// Averaging period of the simulated SM utilisation.
pub const UTIL_WINDOW: Nanos = Nanos::from_secs(1);

impl BusyWindow {
    /// Whether [`BusyWindow::observe`] at `now` would refresh the value (a window has passed
    /// since the last refresh).
    pub fn due(&self, now: Nanos) -> bool {
        now.0.saturating_sub(self.since.0) >= UTIL_WINDOW.0
    }

    /// The utilisation in [0, 1] at `now`, given the engine's cumulative busy time
    /// `busy_ns` and whether a step is running; recomputed once a window has passed since
    /// the last refresh, else the last value.
    pub fn observe(&mut self, now: Nanos, busy_ns: u64, stepping: bool) -> f64 {
        let dt = now.0.saturating_sub(self.since.0);
        if dt >= UTIL_WINDOW.0 {
            let busy = busy_ns.saturating_sub(self.busy_at_since) as f64;
            self.value = (busy / dt as f64).clamp(0.0, 1.0);
            // A step still running counts as busy (its time is added when it ends).
            if stepping && self.value == 0.0 {
                self.value = 1.0;
            }
            self.since = now;
            self.busy_at_since = busy_ns;
        }
        self.value
    }
}

/// What a policy sees of a trace request routed as `role`: its block hashes (when the trace
/// has them), its token counts and its session.
pub fn request_view(r: &TraceRequest, role: Role) -> RequestView<'_> {
    RequestView {
        model: "trace",
        text: None,
        token_ids: None,
        blocks: (!r.blocks.is_empty()).then_some(BlockSeq { block_tokens: r.block_tokens, hashes: &r.blocks }),
        input_tokens: r.input_tokens,
        output_tokens: Some(r.output_tokens),
        session_id: r.session.as_deref(),
        role,
    }
}

/// What the router sees of the engines at one instant: its ledger, its predictions of the
/// engines' caches (precise prefix state), the replay's settings and the time.
pub(crate) struct RouterView<'a> {
    pub(crate) ledger: &'a LoadLedger,
    pub(crate) predicted: &'a PredictWindow,
    pub(crate) cfg: &'a ReplayConfig,
    pub(crate) now: Nanos,
}

impl RouterView<'_> {
    /// The router's view of engine `e` (global id `w`, serving `role`) for request `r`: the
    /// ledger's load, the engine's own signals (`engine_signals`), and with precise prefix
    /// state the request's cached tokens there (cache or prediction).
    pub(crate) fn of(&self, w: usize, role: Role, e: &Engine, util: &mut BusyWindow, r: &TraceRequest) -> WorkerView {
        let mut v = WorkerView::idle(WorkerId(w as u32));
        v.role = role;
        // What the gateway's capacity probe reads: SGLang `max_running_requests`, llama.cpp
        // `total_slots`; the KV cache size (SGLang `max_total_num_tokens`, vLLM's
        // `num_gpu_blocks × block_size`, llama.cpp slots × `n_ctx`).
        let p = &self.cfg.profile;
        v.capacity.max_concurrent = if p.slots > 0 { p.slots } else { p.max_batch };
        v.capacity.kv_tokens = Some(p.kv_tokens);
        self.ledger.fill(&mut v);
        if self.cfg.engine_signals {
            v.engine_queue = Some(e.num_waiting());
            v.engine_running = Some(e.num_running());
            v.kv_cache_usage = Some(e.kv_usage());
            v.sm_util = Some(util.observe(self.now, e.stats().busy_ns, e.next_event_time().is_some()));
        }
        if matches!(self.cfg.prefix_state, PrefixState::Precise { .. }) && !r.blocks.is_empty() {
            let run = self.predicted.run(v.id, &r.blocks, self.now, |h| e.cache().contains(h)) as u64;
            v.cached_tokens = Some((run * u64::from(r.block_tokens)).min(u64::from(r.input_tokens)));
        }
        v
    }
}

/// When a policy is next maintained: its interval (at least 1 ns), and the next instant
/// due (`None`: never, for a policy without maintenance or once the clock's end is reached).
pub(crate) struct Maintenance {
    interval: Nanos,
    next: Option<Nanos>,
}

impl Maintenance {
    /// The maintenance clock of `policy`, first due one interval after time 0.
    pub(crate) fn new(policy: &dyn kvroute_core::policy::Policy) -> Maintenance {
        Maintenance::every(policy.maintenance_interval())
    }

    /// A maintenance clock of `interval` (`None`: never), first due one interval after 0.
    fn every(interval: Option<Nanos>) -> Maintenance {
        // A 0 ns interval (a knob rounded to 0) would never move the clock on.
        let interval = Nanos(interval.map_or(u64::MAX, |i| i.0.max(1)));
        Maintenance { interval, next: (interval.0 != u64::MAX).then_some(interval) }
    }

    /// Runs the maintenance due at or before `now`: the first due instant, then, when more
    /// were due, only the last of them. With no routing in between, an unbounded pass
    /// (`usize::MAX` evictions) leaves nothing for the passes skipped in the middle (the
    /// tree or index is already within budget, and a TTL pass at the last instant expires
    /// all they would). At most two passes per call, whatever the gap or the interval.
    pub(crate) fn run(&mut self, policy: &mut dyn kvroute_core::policy::Policy, now: Nanos) {
        let Some(first) = self.next.filter(|&n| n <= now) else { return };
        policy.maintain(first, usize::MAX);
        let skipped = (now.0 - first.0) / self.interval.0;
        if skipped > 0 {
            let last = Nanos(first.0 + skipped * self.interval.0);
            policy.maintain(last, usize::MAX);
            self.next = last.0.checked_add(self.interval.0).map(Nanos);
        } else {
            self.next = first.0.checked_add(self.interval.0).map(Nanos);
        }
    }
}

#[cfg(test)]
mod maintenance_tests {
    use super::*;
    use kvroute_core::policy::{Decision, PickCtx, Policy, RequestKey, RouteError};

    /// Records the instants it was maintained at.
    #[derive(Debug, Default, Clone)]
    struct Recorder(Vec<u64>);

    impl Policy for Recorder {
        fn name(&self) -> &'static str {
            "recorder"
        }
        fn pick(
            &self,
            _req: &RequestView<'_>,
            _key: &RequestKey,
            _candidates: &[WorkerView],
            _ctx: &mut PickCtx<'_>,
        ) -> Result<Decision, RouteError> {
            Err(RouteError::NoWorker)
        }
        fn maintain(&mut self, now: Nanos, _max_evictions: usize) -> bool {
            self.0.push(now.0);
            false
        }
        fn knobs(&self) -> serde_json::Value {
            serde_json::Value::Null
        }
        fn set_knobs(&mut self, _patch: &serde_json::Value) -> Result<(), kvroute_core::policy::KnobError> {
            Ok(())
        }
    }

    #[test]
    fn due_passes_run_and_a_gap_costs_at_most_two() {
        let mut p = Recorder::default();
        let mut m = Maintenance::every(Some(Nanos(10)));
        m.run(&mut p, Nanos(9));
        m.run(&mut p, Nanos(10));
        m.run(&mut p, Nanos(25));
        m.run(&mut p, Nanos(1_000_005));
        m.run(&mut p, Nanos(1_000_010));
        assert_eq!(p.0, vec![10, 20, 30, 1_000_000, 1_000_010]);
    }

    #[test]
    fn the_end_of_the_clock_and_a_zero_interval_terminate() {
        // An arrival saturated at u64::MAX ns used to spin forever here.
        let mut p = Recorder::default();
        let mut m = Maintenance::every(Some(Nanos(10)));
        m.run(&mut p, Nanos(u64::MAX));
        m.run(&mut p, Nanos(u64::MAX));
        assert_eq!(p.0.len(), 2);
        // An interval that rounded to 0 ns (1e-10 s) counts as 1 ns.
        let mut p = Recorder::default();
        let mut m = Maintenance::every(Some(Nanos(0)));
        m.run(&mut p, Nanos(u64::MAX));
        m.run(&mut p, Nanos(u64::MAX));
        assert_eq!(p.0, vec![1, u64::MAX]);
        // No maintenance: never called.
        let mut p = Recorder::default();
        Maintenance::every(None).run(&mut p, Nanos(u64::MAX));
        assert!(p.0.is_empty());
    }
}
