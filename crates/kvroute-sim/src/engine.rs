//! A pure, discrete-event model of one inference engine (vLLM-style): a paged KV cache
//! with prefix caching, continuous batching with chunked prefill, and a step-time model.
//!
//! The same model drives `kvroute replay` (logical clock) and `kvroute engine-sim` (wall
//! clock scaled by `--time-scale`). It does no I/O and reads no clock: the caller passes
//! `now` and asks for [`Engine::next_event_time`].
//!
//! - **KV cache** ([`KvCache`]): `kv_blocks` blocks of `block_tokens` tokens named by
//!   chained block hashes, so a block is reusable only with its whole prefix and a request's
//!   hit is the longest *leading* run of its blocks present. Running requests' blocks are
//!   pinned; finished ones stay cached and are evicted least-recently-used first, a
//!   prompt's tail before its head (vLLM's free-block queue). Output tokens take anonymous
//!   blocks freed at completion.
//! - **One step** (vLLM's scheduler with chunked prefill): every decoding request gets one
//!   token; the rest of the `max_batched_tokens` budget goes to prefill chunks, running
//!   requests first, then waiting ones admitted FIFO while the batch has fewer than
//!   `max_batch` requests and the cache can hold their blocks. A request whose blocks
//!   exceed the whole cache is rejected.
//! - **Transferred KV** ([`EngineRequest::kv_transferred`], the decode half of a P/D split,
//!   [`crate::pd`]): admitted like any other, its blocks written whole, no prefill work; its
//!   first token comes from its first decode step (SGLang's decode workers, vLLM's NIXL
//!   connector with `do_remote_prefill`).
//! - **Slots**: a profile with `slots` > 0 models `llama-server --parallel N --cache-ram 0`
//!   instead of the paged cache (the rules are on `SlotState`).
//! - **Slot files** (llama.cpp `--slot-save-path`, `POST /slots/{id}?action=save|restore`): a
//!   request may carry a saved prefix to restore into its slot before its prompt is matched
//!   ([`EngineRequest::restore`]), and [`Engine::save_slot`] writes an idle slot out. Each
//!   takes [`Profile::slot_restore_secs`] / [`Profile::slot_save_secs`] of the engine's time
//!   between two steps, during which no slot computes: llama.cpp's server runs slot save and
//!   restore tasks in its one main loop (tools/server, `process_single_task`, calling
//!   `llama_state_seq_save_file` / `llama_state_seq_load_file`), not beside the batch. A
//!   restore is charged when its request takes the slot, before the request's first prefill
//!   chunk; a save keeps its slot busy until it ends (a request naming that slot waits for
//!   it). Both report their end ([`EngineEvent::SlotRestored`], [`EngineEvent::SlotSaved`]).
//!
//! ```text
//! step = step_overhead + [prefill_step_overhead if the step prefills and decodes nothing]
//!      + prefill_tokens × prefill_per_token + prefill_prefix_pairs × prefill_attention
//!      + prefill_self_pairs × prefill_self_attention
//!      + prefill_context × prefill_context_per_token
//!      + decode_seqs × decode_per_seq + context_tokens × context_per_token
//! ```
//! A prefill chunk of n new tokens after c tokens already in its KV cache contributes n
//! prefill tokens, `n × c` prefix pairs, `n (n + 1) / 2` self pairs and `c + n` context
//! tokens: so a short
//! suffix on a long cached context (a conversation's next turn) costs more per new token
//! than a fresh prompt, as measured on an H100 (`Profile::h100_llama3_8b_grid`).
//! A linear roofline: prefill is compute bound (per token, and per pair of a computed token
//! and a token it attends to, 0 on the GPU profiles), decode memory bound (weights once per
//! step, KV per context token). Runs of identical decode-only steps are coalesced into one
//! event at their mean context, which keeps replaying an hour of traffic to seconds.

use kvroute_core::slots::common_prefix;
use kvroute_core::types::{BlockHash, Nanos};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};

/// Constants of the engine model. See [`Profile::named`] for the built-in profiles and
/// their sources; every field can be overridden.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// Profile name.
    pub name: String,
    /// Tokens per KV block (for the cache's capacity; trace blocks may be larger).
    pub block_tokens: u32,
    /// KV cache capacity in tokens.
    pub kv_tokens: u64,
    /// Maximum requests in the running batch (vLLM `max_num_seqs`).
    pub max_batch: u32,
    /// Token budget per step (vLLM `max_num_batched_tokens`).
    pub max_batched_tokens: u32,
    /// Fixed cost of one step, seconds.
    pub step_overhead_s: f64,
    /// Prefill cost per uncached prompt token, seconds.
    pub prefill_per_token_s: f64,
    /// Decode cost per running sequence per step, seconds.
    pub decode_per_seq_s: f64,
    /// Attention/KV read cost per context token in the batch per step, seconds.
    pub context_per_token_s: f64,
    /// Prefill attention cost per pair of a prompt token computed in the step and a token it
    /// attends to (the cached prefix and the prompt's tokens before it), seconds: a chunk of
    /// n tokens after c tokens already in the KV cache costs `n × c + n (n + 1) / 2` pairs.
    /// It makes a short prefill that continues a long cached context (a conversation's next
    /// turn) dearer per token than a fresh one. 0 (the default, and the built-in profiles)
    /// folds attention into `prefill_per_token_s`, right on a GPU, where prefill attention
    /// is compute bound and small against the linear layers at these lengths. On llama.cpp
    /// on this CPU `scripts/llama-calibrate.py` fits it: 1.7–4.9 µs over 12 calibrations
    /// (one worker alone took 179–228 ms for 25 tokens after 300 cached, 141–154 ms for 25
    /// fresh ones, 2026-11-26).
    #[serde(default)]
    pub prefill_attention_s: f64,
    /// Prefill attention cost per pair of two tokens of the same chunk (a chunk of n new
    /// tokens has `n (n + 1) / 2` such causal pairs), seconds, when it differs from
    /// [`Profile::prefill_attention_s`], which then prices only the pairs over the cached
    /// prefix (`n × c`). Absent (the default) = `prefill_attention_s` for every pair. The
    /// measured H100 grid prices the two apart (`h100-llama3-8b`: 2.15 ns over the prefix,
    /// 3.61 ns within the chunk; docs/profiles.md): one cost for both cannot come within
    /// 15 % of every grid point.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_self_attention_s: Option<f64>,
    /// llama.cpp slots without a host prompt cache (`llama-server --parallel N --cache-ram
    /// 0`): the engine runs at most this many requests, each in a slot, and a prompt's KV is
    /// kept only in the slot that ran it (see the module docs, "Slots"). 0 (the default) =
    /// the paged prefix cache of vLLM and SGLang.
    #[serde(default)]
    pub slots: u32,
    /// Extra fixed cost of a step that prefills and decodes nothing, seconds: a prefill
    /// pass's own launch overhead over a decode step's, what a grid of lone prefill passes
    /// measures. A step whose chunks join decoding sequences does not pay it: vLLM's and
    /// SGLang's chunked prefill run one forward pass a step, whose fixed cost is
    /// `step_overhead_s`, and a chunk piggybacked on a decode batch costs its tokens, not a
    /// second pass (Sarathi-Serve, Agrawal et al., OSDI 2024, arXiv:2403.02310). 0 by
    /// default.
    #[serde(default)]
    pub prefill_step_overhead_s: f64,
    /// Cost per context token of each prefill chunk in a step (its cached tokens and its own,
    /// `c + n`), seconds: reading (and, in an eager engine, copying) the KV the chunk attends
    /// to, paid once per pass whatever the chunk's length. 0 by default.
    #[serde(default)]
    pub prefill_context_per_token_s: f64,
    /// Reading a saved slot file back into a slot (llama.cpp `POST /slots/{id}?action=restore`,
    /// `llama_state_seq_load_file`), seconds per token the file holds. Built-in figures:
    /// `cpu-smollm2-135m` 5.5 µs (llama.cpp tools/server on this machine, SmolLM2-135M, one
    /// thread: 1,202 tokens restored in 6.6 ms); the Llama-3-8B GPU profiles 44 µs, from
    /// bytes and disk rather than a measurement: 128 KiB of bf16 KV per token read from a
    /// local NVMe drive at ~3 GB/s (131,072 B / 3e9 B/s = 43.7 µs) — slower than their
    /// prefill, so the KV mover never restores there. 0 (the default) = free.
    #[serde(default)]
    pub kv_restore_secs_per_token: f64,
    /// Writing a slot to a file (llama.cpp `POST /slots/{id}?action=save`,
    /// `llama_state_seq_save_file`), seconds per token it holds: `cpu-smollm2-135m` 9 µs
    /// (1,202 tokens saved in 11 ms, 27.7 MB, measured as above); the GPU profiles 44 µs
    /// (the same 128 KiB per token written at ~3 GB/s). 0 (the default) = free.
    #[serde(default)]
    pub kv_save_secs_per_token: f64,
    /// Fixed cost of one slot save or restore, seconds: the HTTP call and opening the file.
    /// 5 ms in the built-in profiles — an allowance, not measured apart from the per-token
    /// times above. 0 by default.
    #[serde(default)]
    pub kv_transfer_overhead_secs: f64,
    /// Bytes of KV per token: slot files' size in reports, and what a KV pull between
    /// engines moves (`kvroute replay --kv-pull`): `cpu-smollm2-135m` 23,040 (30 layers
    /// × 3 KV heads × 64 dims × K and V × 2 bytes of f16; the measured file was 27.7 MB for
    /// 1,202 tokens, 23,045 per token), the Llama-3-8B profiles 131,072 (32 layers × 8 KV
    /// heads × 128 dims × 2 × 2 bytes of bf16). 0 by default.
    #[serde(default)]
    pub kv_file_bytes_per_token: u64,
}

/// Slot-file costs of the Llama-3-8B GPU profiles (see [`Profile::kv_restore_secs_per_token`]):
/// 128 KiB of KV per token over a ~3 GB/s local NVMe drive, both ways, plus a 5 ms call.
const GPU_SLOT_FILES: SlotFileCosts =
    SlotFileCosts { restore: 131_072.0 / 3e9, save: 131_072.0 / 3e9, overhead: 0.005, bytes: 131_072 };

/// The four slot-file constants of a built-in profile.
struct SlotFileCosts {
    restore: f64,
    save: f64,
    overhead: f64,
    bytes: u64,
}

/// What one engine step computes, for [`Profile::step_time`]. [`StepWork::chunk`] is one
/// prefill chunk's part; steps add their chunks' parts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepWork {
    /// Prompt tokens computed (every chunk's new tokens).
    pub prefill_tokens: u64,
    /// Pairs of a computed prompt token and a cached token it attends to (`n × c` a chunk).
    pub prefill_prefix_pairs: u64,
    /// Pairs of a computed prompt token and a token of its own chunk it attends to, itself
    /// included (`n (n + 1) / 2` a chunk).
    pub prefill_self_pairs: u64,
    /// Context tokens of the prefill chunks (`c + n` each).
    pub prefill_context: u64,
    /// Sequences decoding one token.
    pub decode_seqs: u64,
    /// Context tokens of every sequence in the batch.
    pub context_tokens: u64,
}

impl StepWork {
    /// A prefill chunk of `new` tokens after `before` tokens already in its KV cache: `new`
    /// tokens computed, `new × before` prefix pairs, `new (new + 1) / 2` self pairs,
    /// `before + new` context tokens read.
    pub fn chunk(new: u64, before: u64) -> StepWork {
        StepWork {
            prefill_tokens: new,
            prefill_prefix_pairs: new * before,
            prefill_self_pairs: new * (new + 1) / 2,
            prefill_context: before + new,
            ..StepWork::default()
        }
    }
}

/// Largest per-step or per-sequence time constant of a [`Profile`], seconds (1 h): a
/// larger one overflowed the simulated nanosecond clock and printed better-looking results.
pub const MAX_STEP_CONSTANT_S: f64 = 3600.0;

/// Largest per-token time constant of a [`Profile`], seconds (1 s; measured ones are
/// 10^-9 to 10^-3 s).
pub const MAX_TOKEN_CONSTANT_S: f64 = 1.0;

impl Profile {
    /// Names of the built-in profiles.
    pub const NAMES: [&'static str; 4] =
        ["h100-llama3-8b", "h100-llama3-8b-roofline", "a100-llama3-8b", "cpu-smollm2-135m"];

    /// A built-in profile by name, or `None`.
    ///
    /// - `h100-llama3-8b` (the default): Llama-3.1-8B, bf16, one H100 80GB. Its prefill is
    ///   fitted to a measured forward pass (data/gpu/README.md: an 8B-shaped decoder, random
    ///   bf16 weights, PyTorch SDPA, eager mode, batch 1; 30 grid points of N new tokens on
    ///   C cached, N 64…8192, C 0…32768) by `scripts/fit-profile.py`, minimising the largest
    ///   relative error over the points with N ≥ 256:
    ///   `t = 6 ms + 9.29 ms + 18.4 µs·N + 2.15 ns·N·C + 3.61 ns·N(N+1)/2 + 0.67 µs·(C + N)
    ///   + 0.04 µs·C` (the 6 ms and 0.04 µs·C are the decode step's overhead and KV read,
    ///   kept from the roofline below). Worst error 13.3 % over those 24 points (the least
    ///   any constants of this form reach: `scripts/profile-minimax.py`), 49 % at N = 64 where eager
    ///   mode's ~20 ms launch floor dominates; the grid itself is not monotone in C in places
    ///   (±10 % noise). Caveat: HF eager attention, not vLLM's or SGLang's kernels, which
    ///   are faster per token, especially at long context; the shape (a cache hit on a long
    ///   context is worth ~20×, not 88×) matters more than the constants. Decode, KV
    ///   capacity and batch limits as `h100-llama3-8b-roofline`.
    /// - `h100-llama3-8b-roofline` (the default until 2026-11-26): the same GPU from its data
    ///   sheet (989 TFLOP/s dense bf16, 3.35 TB/s HBM). Weights 16 GB; KV 128 KiB/token (32
    ///   layers × 8 KV heads × 128 dims × 2 × 2 bytes), 55 GB free for KV → 420k tokens.
    ///   Prefill 2 × 8e9 FLOP/token at ≈30% MFU → 50 µs/token flat, whatever is cached.
    ///   Decode step: weights read once, 16 GB / 3.35 TB/s ≈ 4.8 ms, plus ≈1 ms
    ///   scheduler/launch overhead → 6 ms; KV read 128 KiB / 3.35 TB/s ≈ 0.04 µs per context
    ///   token; 30 µs per sequence for sampling and bookkeeping. vLLM defaults
    ///   `max_num_seqs` 256 and `max_num_batched_tokens` 8192. Against the measured grid it
    ///   is 0.28–1.69× the measured time (`kvroute profile show h100-llama3-8b-roofline
    ///   --grid data/gpu/h100-llama3-8b-prefill-grid.jsonl`).
    /// - `a100-llama3-8b`: same model on an A100 80GB (312 TFLOP/s, 2.0 TB/s): prefill ≈
    ///   3.2× slower per token (160 µs), decode step 9 ms, 0.065 µs per context token.
    /// - `cpu-smollm2-135m`: the llama.cpp worker measured on this 2-core machine
    ///   (`scripts/llama-workers.sh`; cold/warm prefix probe in
    ///   docs/lab/2026-11-26-llama-cpp-prefix-probe.md): ≈70 prompt
    ///   tokens/s (14 ms/token), ≈30 ms per decode step, 2 slots, 8192-token context per
    ///   slot, started with `--cache-ram 0` as `scripts/llama-workers.sh` does: `slots` 2.
    pub fn named(name: &str) -> Option<Profile> {
        let p = match name {
            "h100-llama3-8b" => Profile::h100_llama3_8b(),
            "h100-llama3-8b-roofline" => Profile {
                name: name.into(),
                prefill_step_overhead_s: 0.0,
                prefill_per_token_s: 50e-6,
                prefill_attention_s: 0.0,
                prefill_self_attention_s: None,
                prefill_context_per_token_s: 0.0,
                ..Profile::h100_llama3_8b()
            },
            "a100-llama3-8b" => Profile {
                name: name.into(),
                block_tokens: 16,
                kv_tokens: 420_000,
                max_batch: 256,
                max_batched_tokens: 8192,
                step_overhead_s: 0.009,
                prefill_per_token_s: 160e-6,
                decode_per_seq_s: 40e-6,
                context_per_token_s: 0.065e-6,
                prefill_attention_s: 0.0,
                prefill_self_attention_s: None,
                slots: 0,
                prefill_step_overhead_s: 0.0,
                prefill_context_per_token_s: 0.0,
                kv_restore_secs_per_token: GPU_SLOT_FILES.restore,
                kv_save_secs_per_token: GPU_SLOT_FILES.save,
                kv_transfer_overhead_secs: GPU_SLOT_FILES.overhead,
                kv_file_bytes_per_token: GPU_SLOT_FILES.bytes,
            },
            "cpu-smollm2-135m" => Profile {
                name: name.into(),
                block_tokens: 16,
                kv_tokens: 16_384,
                max_batch: 2,
                max_batched_tokens: 2048,
                step_overhead_s: 0.030,
                prefill_per_token_s: 14e-3,
                decode_per_seq_s: 1e-3,
                context_per_token_s: 0.0,
                prefill_attention_s: 0.0,
                prefill_self_attention_s: None,
                slots: 2,
                prefill_step_overhead_s: 0.0,
                prefill_context_per_token_s: 0.0,
                kv_restore_secs_per_token: 5.5e-6,
                kv_save_secs_per_token: 9e-6,
                kv_transfer_overhead_secs: 0.005,
                kv_file_bytes_per_token: 23_040,
            },
            _ => return None,
        };
        Some(p)
    }

    /// The default profile, `h100-llama3-8b` (see [`Profile::named`] for its sources and
    /// its fit to the measured H100 grid).
    pub fn h100_llama3_8b() -> Profile {
        Profile {
            name: "h100-llama3-8b".into(),
            block_tokens: 16,
            kv_tokens: 420_000,
            max_batch: 256,
            max_batched_tokens: 8192,
            step_overhead_s: 0.006,
            prefill_step_overhead_s: 0.009285,
            prefill_per_token_s: 18.44e-6,
            prefill_attention_s: 2.150e-9,
            prefill_self_attention_s: Some(3.605e-9),
            prefill_context_per_token_s: 0.6651e-6,
            decode_per_seq_s: 30e-6,
            context_per_token_s: 0.04e-6,
            slots: 0,
            kv_restore_secs_per_token: GPU_SLOT_FILES.restore,
            kv_save_secs_per_token: GPU_SLOT_FILES.save,
            kv_transfer_overhead_secs: GPU_SLOT_FILES.overhead,
            kv_file_bytes_per_token: GPU_SLOT_FILES.bytes,
        }
    }

    /// Checks the constants.
    ///
    /// # Errors
    /// [`InvalidSetting`] naming the bad field and its value.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        for (k, v) in [
            ("block_tokens", u64::from(self.block_tokens)),
            ("kv_tokens", self.kv_tokens),
            ("max_batch", self.max_batch as u64),
            ("max_batched_tokens", u64::from(self.max_batched_tokens)),
        ] {
            if v == 0 {
                return Err(InvalidSetting::new(k, "must be at least 1, got 0"));
            }
        }
        for (k, v, max) in [
            ("step_overhead_s", self.step_overhead_s, MAX_STEP_CONSTANT_S),
            ("prefill_per_token_s", self.prefill_per_token_s, MAX_TOKEN_CONSTANT_S),
            ("decode_per_seq_s", self.decode_per_seq_s, MAX_STEP_CONSTANT_S),
            ("context_per_token_s", self.context_per_token_s, MAX_TOKEN_CONSTANT_S),
            ("prefill_attention_s", self.prefill_attention_s, MAX_TOKEN_CONSTANT_S),
            ("prefill_step_overhead_s", self.prefill_step_overhead_s, MAX_STEP_CONSTANT_S),
            ("prefill_self_attention_s", self.prefill_self_attention(), MAX_TOKEN_CONSTANT_S),
            ("prefill_context_per_token_s", self.prefill_context_per_token_s, MAX_TOKEN_CONSTANT_S),
            ("kv_restore_secs_per_token", self.kv_restore_secs_per_token, MAX_TOKEN_CONSTANT_S),
            ("kv_save_secs_per_token", self.kv_save_secs_per_token, MAX_TOKEN_CONSTANT_S),
            ("kv_transfer_overhead_secs", self.kv_transfer_overhead_secs, MAX_STEP_CONSTANT_S),
        ] {
            if !(v.is_finite() && (0.0..=max).contains(&v)) {
                return Err(InvalidSetting::new(k, format!("must be a finite number from 0 to {max} s, got {v:e}")));
            }
        }
        if self.step_overhead_s + self.prefill_per_token_s + self.decode_per_seq_s <= 0.0 {
            return Err(InvalidSetting::new(
                "step_overhead_s",
                "a step must take time: step_overhead_s, prefill_per_token_s or decode_per_seq_s > 0",
            ));
        }
        if self.slots as usize > kvroute_core::slots::MAX_SLOTS {
            return Err(InvalidSetting::new(
                "slots",
                format!("must be at most {}, got {}", kvroute_core::slots::MAX_SLOTS, self.slots),
            ));
        }
        Ok(())
    }

    /// Duration of one step doing `w` (the module docs' formula).
    pub fn step_time(&self, w: StepWork) -> Nanos {
        Nanos::from_secs_f64(self.step_secs(w))
    }

    /// [`Profile::step_time`] in seconds.
    pub fn step_secs(&self, w: StepWork) -> f64 {
        // A prefill pass's own fixed cost only when the step is that pass alone: a chunk
        // that joins decoding sequences rides their forward pass (vLLM's chunked prefill
        // runs one pass a step), whose fixed cost `step_overhead_s` already is.
        let prefill_overhead =
            if w.prefill_tokens > 0 && w.decode_seqs == 0 { self.prefill_step_overhead_s } else { 0.0 };
        self.step_overhead_s
            + prefill_overhead
            + w.prefill_tokens as f64 * self.prefill_per_token_s
            + w.prefill_prefix_pairs as f64 * self.prefill_attention_s
            + w.prefill_self_pairs as f64 * self.prefill_self_attention()
            + w.prefill_context as f64 * self.prefill_context_per_token_s
            + w.decode_seqs as f64 * self.decode_per_seq_s
            + w.context_tokens as f64 * self.context_per_token_s
    }

    /// Seconds of one step that prefills `new` tokens on `cached` tokens already in the KV
    /// cache, alone (no decode): what `kvroute profile show --prefill CACHED,NEW` prints and
    /// what a measured grid is fitted to.
    pub fn prefill_secs(&self, cached: u64, new: u64) -> f64 {
        // As `Engine` counts a step's batch context: the tokens in the KV cache before it.
        self.step_secs(StepWork { context_tokens: cached, ..StepWork::chunk(new, cached) })
    }

    /// Seconds per pair of two tokens of one prefill chunk:
    /// [`Profile::prefill_self_attention_s`], else [`Profile::prefill_attention_s`].
    pub fn prefill_self_attention(&self) -> f64 {
        self.prefill_self_attention_s.unwrap_or(self.prefill_attention_s)
    }

    /// Seconds to restore a slot file of `tokens` tokens: `kv_transfer_overhead_secs +
    /// tokens × kv_restore_secs_per_token`.
    pub fn slot_restore_secs(&self, tokens: u64) -> f64 {
        self.kv_transfer_overhead_secs + tokens as f64 * self.kv_restore_secs_per_token
    }

    /// Seconds to save a slot of `tokens` tokens to a file: `kv_transfer_overhead_secs +
    /// tokens × kv_save_secs_per_token`.
    pub fn slot_save_secs(&self, tokens: u64) -> f64 {
        self.kv_transfer_overhead_secs + tokens as f64 * self.kv_save_secs_per_token
    }
}

/// A paged KV cache with prefix caching: pinned blocks (in use) and an LRU of evictable
/// cached blocks, identified by chained block hashes, plus anonymous (output and partial)
/// blocks. Capacity is in engine blocks; a cached entry may weigh several engine blocks
/// (a 512-token trace block is 32 engine blocks of 16 tokens).
#[derive(Debug)]
pub struct KvCache {
    capacity: u64,
    pinned: HashMap<BlockHash, (u32, u64)>,
    pinned_weight: u64,
    free_lru: lru::LruCache<BlockHash, u64>,
    free_weight: u64,
    anonymous: u64,
    reserved: u64,
    evictions: u64,
    log: Option<Vec<CacheEvent>>,
}

/// A change of the cache's contents, in the shape of vLLM's KV events (`BlockStored`,
/// `BlockRemoved`); recorded only when enabled with [`Engine::record_cache_events`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheEvent {
    /// Consecutive blocks of one chain became cached.
    Stored {
        /// Their hashes, in chain order.
        hashes: Vec<BlockHash>,
        /// The block before the first one (`None` at the root).
        parent: Option<BlockHash>,
        /// Their token ids, `block_size` per block (empty when the request carried none).
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
    },
    /// Blocks were evicted.
    Removed {
        /// Their hashes.
        hashes: Vec<BlockHash>,
    },
}

impl KvCache {
    /// A cache of `capacity` engine blocks.
    pub fn new(capacity: u64) -> Self {
        KvCache {
            capacity,
            pinned: HashMap::new(),
            pinned_weight: 0,
            free_lru: lru::LruCache::unbounded(),
            free_weight: 0,
            anonymous: 0,
            reserved: 0,
            evictions: 0,
            log: None,
        }
    }

    /// Engine blocks in use or cached.
    pub fn used(&self) -> u64 {
        self.active() + self.free_weight
    }

    /// Engine blocks pinned or reserved by running requests (not evictable).
    pub fn active(&self) -> u64 {
        self.pinned_weight + self.anonymous + self.reserved
    }

    /// Capacity in engine blocks.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Cached entries evicted so far.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Whether block `h` is cached (pinned or evictable). Does not touch recency.
    pub fn contains(&self, h: &BlockHash) -> bool {
        self.pinned.contains_key(h) || self.free_lru.contains(h)
    }

    /// Leading blocks of `hashes` cached (pinned or evictable). Does not touch recency.
    pub fn lookup(&self, hashes: &[BlockHash]) -> usize {
        hashes.iter().take_while(|h| self.pinned.contains_key(h) || self.free_lru.contains(h)).count()
    }

    /// Stores the blocks of `hashes` that are not cached yet as evictable blocks of `weight`
    /// engine blocks each (the first the most recent), evicting LRU blocks as needed; cached
    /// ones are left where they are. Returns how many were stored. A KV transfer at no cost:
    /// only oracle replays ([`crate::replay::KvOracle`]) use it.
    pub fn import(&mut self, hashes: &[BlockHash], weight: u64) -> usize {
        let mut stored = 0;
        for h in hashes.iter().rev() {
            if self.contains(h) {
                continue;
            }
            self.free_lru.put(*h, weight);
            self.free_weight += weight;
            stored += 1;
        }
        self.evict_to_capacity();
        stored
    }

    /// Pins the `hit` leading blocks of `hashes` (each weighing `weight` engine blocks) and
    /// reserves `extra` engine blocks, evicting LRU blocks as needed. Returns false (and
    /// changes nothing) when they cannot fit.
    pub fn admit(&mut self, hashes: &[BlockHash], hit: usize, weight: u64, extra: u64) -> bool {
        let unpinned_hits: u64 = hashes[..hit].iter().filter(|h| !self.pinned.contains_key(h)).map(|_| weight).sum();
        if self.active() + unpinned_hits + extra > self.capacity {
            return false;
        }
        for h in &hashes[..hit] {
            let _ = self.pin(*h, weight);
        }
        self.reserved += extra;
        self.evict_to_capacity();
        true
    }

    /// Pins `h`; returns true when it was not cached before (newly stored).
    fn pin(&mut self, h: BlockHash, weight: u64) -> bool {
        if let Some(w) = self.free_lru.pop(&h) {
            self.free_weight -= w;
            self.pinned.insert(h, (1, w));
            self.pinned_weight += w;
            false
        } else if let Some(e) = self.pinned.get_mut(&h) {
            e.0 += 1;
            false
        } else {
            self.pinned.insert(h, (1, weight));
            self.pinned_weight += weight;
            true
        }
    }

    fn evict_to_capacity(&mut self) {
        while self.used() > self.capacity {
            let Some((h, w)) = self.free_lru.pop_lru() else { break };
            self.free_weight -= w;
            self.evictions += 1;
            if let Some(log) = &mut self.log {
                match log.last_mut() {
                    Some(CacheEvent::Removed { hashes }) => hashes.push(h),
                    _ => log.push(CacheEvent::Removed { hashes: vec![h] }),
                }
            }
        }
    }

    /// Prefill done: releases `reserved` engine blocks, pins the computed prompt blocks
    /// (already-cached ones just gain a reference) and adds `anon` anonymous blocks.
    pub fn commit(&mut self, computed: Computed<'_>, reserved: u64, anon: u64) {
        let Computed { new, parent, tokens, block_size, weight } = computed;
        self.reserved -= reserved.min(self.reserved);
        let bs = block_size as usize;
        let mut run: Option<(usize, usize)> = None; // [start, end) of newly stored blocks
        let mut runs = Vec::new();
        for (i, h) in new.iter().enumerate() {
            if self.pin(*h, weight) {
                run = Some(run.map_or((i, i + 1), |(s, _)| (s, i + 1)));
            } else if let Some(r) = run.take() {
                runs.push(r);
            }
        }
        runs.extend(run);
        if let Some(log) = &mut self.log {
            for (s, e) in runs {
                let token_ids = tokens.get(s * bs..e * bs).map(<[u32]>::to_vec).unwrap_or_default();
                let parent = if s == 0 { parent } else { Some(new[s - 1]) };
                log.push(CacheEvent::Stored { hashes: new[s..e].to_vec(), parent, token_ids, block_size });
            }
        }
        self.anonymous += anon;
        self.evict_to_capacity();
    }

    /// A request finished: unpins its prompt blocks (they become evictable, the head most
    /// recent) and frees `anon` anonymous and `reserved` reserved blocks.
    pub fn release(&mut self, pinned: &[BlockHash], anon: u64, reserved: u64) {
        for h in pinned.iter().rev() {
            if let Some(e) = self.pinned.get_mut(h) {
                e.0 -= 1;
                if e.0 == 0 {
                    let w = e.1;
                    self.pinned.remove(h);
                    self.pinned_weight -= w;
                    self.free_lru.put(*h, w);
                    self.free_weight += w;
                }
            }
        }
        self.anonymous -= anon.min(self.anonymous);
        self.reserved -= reserved.min(self.reserved);
    }
}

/// The prompt blocks a prefill computed, as [`KvCache::commit`] stores them.
#[derive(Debug, Clone, Copy)]
pub struct Computed<'a> {
    /// The computed blocks' hashes.
    pub new: &'a [BlockHash],
    /// The block before `new[0]` (for the event log).
    pub parent: Option<BlockHash>,
    /// The token ids of `new` (for the event log; may be empty).
    pub tokens: &'a [u32],
    /// Tokens per block of `new`.
    pub block_size: u32,
    /// Engine blocks each of `new` takes.
    pub weight: u64,
}

/// A request submitted to an [`Engine`].
#[derive(Debug, Clone)]
pub struct EngineRequest {
    /// Caller's id, echoed in events.
    pub id: u64,
    /// Prompt tokens.
    pub input_tokens: u32,
    /// Tokens to generate (at least 1).
    pub output_tokens: u32,
    /// Chained hashes of the prompt's blocks.
    pub blocks: Vec<BlockHash>,
    /// Tokens per block of `blocks`.
    pub block_tokens: u32,
    /// Prompt token ids, when known (for `BlockStored` events).
    pub token_ids: Option<std::sync::Arc<[u32]>>,
    /// The prompt's KV was computed elsewhere and transferred here (the decode side of
    /// prefill/decode disaggregation, as SGLang's decode workers and vLLM's NIXL
    /// `do_remote_prefill` requests are served): on admission the whole prompt's blocks are
    /// written into the cache (they count as `cached_tokens` = `input_tokens`, and in
    /// [`EngineStats::transferred_tokens`], not in the prefix-cache counters), no prefill
    /// work is done, and the first token comes from the request's first decode step.
    /// `false` (every colocated request) = today's behaviour.
    pub kv_transferred: bool,
    /// The slot the request asks for (llama.cpp `id_slot`, taken modulo the slots), for a
    /// profile with `slots`; ignored otherwise. `None`: the engine picks.
    pub slot: Option<u32>,
    /// A saved slot file to restore into the request's slot first (profiles with `slots`;
    /// ignored otherwise): when the request takes its slot, the slot holds the file's prompt
    /// and context instead of its own, then the prompt is matched against it. The restore
    /// takes [`Profile::slot_restore_secs`] of the file's tokens before the request's
    /// prefill (module docs, "Slot files"). `None`: no restore.
    pub restore: Option<SlotRestore>,
}

/// A saved slot file restored into a request's slot ([`EngineRequest::restore`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotRestore {
    /// Full blocks of the prompt the file was saved from (chained hashes).
    pub blocks: Vec<BlockHash>,
    /// Tokens the file holds: that prompt and the tokens generated after it (llama.cpp
    /// `n_restored`).
    pub tokens: u32,
}

/// Something that happened inside an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineEvent {
    /// The request's prefill finished and its first token was produced.
    FirstToken {
        /// Request id.
        id: u64,
        /// When.
        at: Nanos,
        /// Prompt tokens served from the prefix cache.
        cached_tokens: u32,
    },
    /// The request finished.
    Finished {
        /// Request id.
        id: u64,
        /// When.
        at: Nanos,
    },
    /// The request can never fit in this engine's KV cache.
    Rejected {
        /// Request id.
        id: u64,
        /// When.
        at: Nanos,
    },
    /// The slot file of request `id` ([`EngineRequest::restore`]) is in its slot.
    SlotRestored {
        /// Request id.
        id: u64,
        /// When the restore ended.
        at: Nanos,
        /// Tokens read (llama.cpp `n_restored`).
        tokens: u32,
        /// How long it took ([`Profile::slot_restore_secs`]).
        took: Nanos,
    },
    /// A save asked for with [`Engine::save_slot`] ended; its slot is idle again.
    SlotSaved {
        /// The caller's tag given to [`Engine::save_slot`].
        id: u64,
        /// When the save ended.
        at: Nanos,
        /// Tokens written (llama.cpp `n_saved`: the slot's prompt and generated tokens).
        tokens: u32,
        /// How long it took ([`Profile::slot_save_secs`]).
        took: Nanos,
    },
}

impl EngineEvent {
    /// When it happened.
    pub fn at(&self) -> Nanos {
        match *self {
            EngineEvent::FirstToken { at, .. }
            | EngineEvent::Finished { at, .. }
            | EngineEvent::Rejected { at, .. }
            | EngineEvent::SlotRestored { at, .. }
            | EngineEvent::SlotSaved { at, .. } => at,
        }
    }

    /// Its time, to set (a shared host's clock makes engine times real).
    pub fn at_mut(&mut self) -> &mut Nanos {
        match self {
            EngineEvent::FirstToken { at, .. }
            | EngineEvent::Finished { at, .. }
            | EngineEvent::Rejected { at, .. }
            | EngineEvent::SlotRestored { at, .. }
            | EngineEvent::SlotSaved { at, .. } => at,
        }
    }
}

/// A slot-file operation waiting for, or holding, the engine's main loop (module docs,
/// "Slot files").
#[derive(Debug, Clone, Copy)]
enum SlotIo {
    /// Request `id`'s file, `tokens` long, is read into its slot.
    Restore { id: u64, tokens: u32 },
    /// Slot `slot`, holding `tokens`, is written out (tag `id`).
    Save { id: u64, slot: usize, tokens: u32 },
}

#[derive(Debug)]
struct Running {
    req: EngineRequest,
    cached_tokens: u32,
    hit_blocks: usize,
    prefill_left: u32,
    decoded: u32,
    reserved_blocks: u64,
    anon_blocks: u64,
    committed: bool,
    /// Its slot (profiles with `slots`): no paged-cache pins to release.
    slot: Option<usize>,
}

/// One llama.cpp slot of a profile with `slots` (`llama-server --parallel N --cache-ram 0`).
///
/// A profile with `slots` > 0 models `llama-server --parallel N --cache-ram 0` instead of the
/// paged cache: at most N requests run, each in a slot, and a slot keeps the context of the
/// last request it ran (its prompt, then the tokens it generated), nothing else. A request's
/// hit is the longest common leading run of its blocks with the slot's prompt's; a prompt
/// that holds all of them and is longer than the slot's context is taken for the next turn
/// of that conversation and finds the whole context, generated tokens included (llama.cpp
/// matches tokens; the model has no hashes for generated ones). Its slot is the one it names ([`EngineRequest::slot`],
/// llama.cpp's `id_slot`; it waits while that slot is busy, and requests behind it that
/// can run elsewhere go first), else, among idle slots, the one sharing the largest
/// fraction of the prompt above llama.cpp's `--slot-prompt-similarity` default (0.1), else
/// the least recently used (llama.cpp `get_available_slot`). Slots publish no KV events
/// (llama.cpp has none).
#[derive(Debug, Clone, Default)]
struct SlotState {
    /// Full blocks of the last prompt it ran.
    blocks: Vec<BlockHash>,
    /// Tokens of its context: the last prompt, and once that request finished, the tokens
    /// it generated (all but the last sampled one, which llama.cpp never evaluates).
    context_tokens: u32,
    busy: bool,
    last_used: Nanos,
}

impl SlotState {
    /// `(hit blocks, hit tokens)` of a prompt of `input_tokens` whose full blocks are
    /// `blocks` (of `block_tokens`) in this slot. The hit is the common leading run of
    /// blocks; when the prompt holds every block of the slot's last prompt and is longer
    /// than the slot's whole context, it is taken to continue that context (the next turn
    /// of the conversation, whose prompt repeats the answer the slot generated), and the
    /// hit is the whole context — llama.cpp compares tokens, not blocks. The model cannot
    /// check that the prompt repeats the answer (generated tokens have no block hashes);
    /// a sibling prompt of the same length class sharing every full block of a short
    /// prompt would be credited too.
    fn hit(&self, blocks: &[BlockHash], block_tokens: u32, input_tokens: u32) -> (usize, u32) {
        let hit_blocks = common_prefix(&self.blocks, blocks);
        let by_blocks = (hit_blocks as u64 * block_tokens as u64).min(input_tokens as u64) as u32;
        let continues = hit_blocks > 0 && hit_blocks == self.blocks.len() && input_tokens > self.context_tokens;
        (hit_blocks, if continues { by_blocks.max(self.context_tokens) } else { by_blocks })
    }
}

/// llama.cpp's `--slot-prompt-similarity` default.
const SLOT_PROMPT_SIMILARITY: f64 = 0.1;

/// Full (complete) prompt blocks of `req`: the partial tail block is never cached.
fn full_blocks(req: &EngineRequest) -> usize {
    ((req.input_tokens as u64 / req.block_tokens.max(1) as u64) as usize).min(req.blocks.len())
}

/// The step in progress.
#[derive(Debug, Clone, Copy)]
struct Step {
    start: Nanos,
    dt: Nanos,
    /// Identical steps in this span (decode-only spans may have many).
    count: u64,
}

/// Counters of one engine, for metrics and reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct EngineStats {
    /// Requests submitted.
    pub submitted: u64,
    /// Requests finished.
    pub finished: u64,
    /// Requests rejected (too large for the KV cache).
    pub rejected: u64,
    /// Prompt tokens looked up in the prefix cache (vLLM `prefix_cache_queries`).
    pub prefix_queries_tokens: u64,
    /// Prompt tokens served from the prefix cache (vLLM `prefix_cache_hits`).
    pub prefix_hit_tokens: u64,
    /// Prompt tokens computed.
    pub prefill_tokens: u64,
    /// Output tokens generated.
    pub decode_tokens: u64,
    /// Time spent executing steps, nanoseconds.
    pub busy_ns: u64,
    /// Steps executed.
    pub steps: u64,
    /// Prompt tokens of requests admitted with their KV transferred in
    /// ([`EngineRequest::kv_transferred`]): present without prefill work.
    pub transferred_tokens: u64,
    /// Prompt tokens copied in by [`Engine::import_prefix`] (oracle replays only).
    pub imported_tokens: u64,
    /// Slot files restored ([`EngineRequest::restore`]).
    pub slot_restores: u64,
    /// Tokens those restores read.
    pub restored_tokens: u64,
    /// Slots saved to files ([`Engine::save_slot`]).
    pub slot_saves: u64,
    /// Tokens those saves wrote.
    pub saved_tokens: u64,
    /// Time the engine spent on slot files (no step runs meanwhile), nanoseconds; not in
    /// `busy_ns`, which counts steps.
    pub slot_io_ns: u64,
}

/// One simulated engine. See the module docs.
#[derive(Debug)]
pub struct Engine {
    profile: Profile,
    cache: KvCache,
    waiting: VecDeque<EngineRequest>,
    running: Vec<Running>,
    step: Option<Step>,
    /// Chunk sizes of the current prefill step, by running index.
    chunks: Vec<(usize, u32)>,
    stats: EngineStats,
    max_waiting: usize,
    /// An idle engine's pending planning time after a submit.
    wake: Option<Nanos>,
    /// Slots of a profile with `slots` (empty otherwise).
    slots: Vec<SlotState>,
    /// The host-memory prompt cache of a slotted engine ([`Engine::with_host_prompt_cache`]),
    /// most recently saved last; at most `host_cache_max` prompts. Off (`host_cache_max`
    /// 0) unless asked for.
    host_cache: Vec<SlotState>,
    host_cache_max: usize,
    /// Slot-file operations waiting for the main loop, oldest first.
    io: VecDeque<SlotIo>,
    /// The one running now (the current step is it), with its duration.
    io_running: Option<(SlotIo, Nanos)>,
}

impl Engine {
    /// An idle engine with `profile` (assumed valid) and a bounded waiting queue of
    /// `max_waiting` requests (beyond it, requests are rejected).
    pub fn new(profile: Profile, max_waiting: usize) -> Self {
        let blocks = profile.kv_tokens.div_ceil(profile.block_tokens as u64);
        let slots = vec![SlotState::default(); profile.slots as usize];
        Engine {
            cache: KvCache::new(blocks),
            profile,
            waiting: VecDeque::new(),
            running: Vec::new(),
            step: None,
            chunks: Vec::new(),
            stats: EngineStats::default(),
            max_waiting: max_waiting.max(1),
            wake: None,
            slots,
            host_cache: Vec::new(),
            host_cache_max: 0,
            io: VecDeque::new(),
            io_running: None,
        }
    }

    /// Gives a slotted engine llama.cpp's host-memory prompt cache (`llama-server
    /// --cache-ram N`, on by default there) holding up to `prompts` prompts: a slot's prompt
    /// is saved there when a request that shares less than half of it takes the slot, and
    /// such a request starts from the saved prompt that holds the most of it (kept at least
    /// a quarter), as llama.cpp's `server_prompt_cache::load` does. 0 turns it off (`--cache-ram 0`).
    pub fn with_host_prompt_cache(mut self, prompts: usize) -> Self {
        self.host_cache_max = prompts;
        self
    }

    /// With a host prompt cache: saves slot `k`'s prompt when the request (its full
    /// `blocks`) keeps less than half of it, and loads the saved prompt holding the most of
    /// the request when that beats what the slot holds.
    fn swap_with_host_cache(&mut self, k: usize, blocks: &[BlockHash], block_tokens: u32, input_tokens: u32) {
        if self.host_cache_max == 0 {
            return;
        }
        let s = &self.slots[k];
        let (kept, hit) = s.hit(blocks, block_tokens, input_tokens);
        if !s.blocks.is_empty() && kept * 2 < s.blocks.len() {
            let saved = SlotState { busy: false, ..s.clone() };
            self.host_cache.retain(|c| c.blocks != saved.blocks);
            if self.host_cache.len() >= self.host_cache_max {
                self.host_cache.remove(0);
            }
            self.host_cache.push(saved);
        }
        let best = self
            .host_cache
            .iter()
            .enumerate()
            .map(|(i, c)| (i, c.hit(blocks, block_tokens, input_tokens)))
            .filter(|(i, (b, _))| *b * 4 >= self.host_cache[*i].blocks.len() && *b > 0)
            .max_by_key(|(_, (_, t))| *t);
        if let Some((i, (_, t))) = best
            && t > hit
        {
            let restored = self.host_cache[i].clone();
            let slot = &mut self.slots[k];
            slot.blocks = restored.blocks;
            slot.context_tokens = restored.context_tokens;
        }
    }

    /// The profile.
    pub fn profile(&self) -> &Profile {
        &self.profile
    }

    /// Counters so far.
    pub fn stats(&self) -> EngineStats {
        self.stats
    }

    /// Requests waiting (not yet admitted to the batch).
    pub fn num_waiting(&self) -> u32 {
        self.waiting.len() as u32
    }

    /// Requests in the running batch.
    pub fn num_running(&self) -> u32 {
        self.running.len() as u32
    }

    /// KV cache usage in [0, 1] counting only blocks in use (vLLM `kv_cache_usage_perc`).
    pub fn kv_usage(&self) -> f64 {
        self.cache.active() as f64 / self.cache.capacity().max(1) as f64
    }

    /// Starts (or stops) recording [`CacheEvent`]s.
    pub fn record_cache_events(&mut self, on: bool) {
        self.cache.log = on.then(Vec::new);
    }

    /// Moves the recorded cache events into `out`.
    pub fn drain_cache_events(&mut self, out: &mut Vec<CacheEvent>) {
        if let Some(log) = &mut self.cache.log {
            out.append(log);
        }
    }

    /// The KV cache.
    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    /// Prompt tokens a request with `blocks` (of `block_tokens`) would find cached now.
    /// With `slots`, the longest run any slot holds.
    pub fn cached_prefix_tokens(&self, blocks: &[BlockHash], block_tokens: u32, input_tokens: u32) -> u32 {
        if !self.slots.is_empty() {
            return self.slots.iter().map(|s| s.hit(blocks, block_tokens, input_tokens).1).max().unwrap_or(0);
        }
        let hit = self.cache.lookup(blocks);
        ((hit as u64 * block_tokens as u64).min(input_tokens as u64)) as u32
    }

    /// Copies the leading `blocks` (trace blocks of `block_tokens` tokens) into this engine's
    /// prefix cache as if transferred from a peer at no cost, and counts their tokens in
    /// [`EngineStats::imported_tokens`]. For oracle replays ([`crate::replay::KvOracle`]),
    /// which bound what any placement could gain from the fleet's caches; a profile with
    /// `slots` has no paged cache and ignores it.
    pub fn import_prefix(&mut self, blocks: &[BlockHash], block_tokens: u32) {
        if !self.slots.is_empty() {
            return;
        }
        let weight = (block_tokens as u64).div_ceil(self.profile.block_tokens as u64);
        let stored = self.cache.import(blocks, weight);
        self.stats.imported_tokens += stored as u64 * block_tokens as u64;
    }

    /// Slots (profiles with `slots`): `(slots, busy slots)`; `None` for a paged-cache engine.
    pub fn slot_counts(&self) -> Option<(u32, u32)> {
        (!self.slots.is_empty()).then(|| (self.slots.len() as u32, self.slots.iter().filter(|s| s.busy).count() as u32))
    }

    /// Saves slot `slot` (taken modulo the slots) to a file, as llama.cpp's `POST
    /// /slots/{id}?action=save` does: the slot is busy from `now` until the save has run in
    /// the engine's main loop (after the step under way, and any slot-file operation queued
    /// before it), [`Profile::slot_save_secs`] of what the slot holds; then
    /// [`EngineEvent::SlotSaved`] reports it with the tag `id`. `false` (nothing done) for a
    /// profile without slots, a busy slot or an empty one. Events due before `now` must have
    /// been collected with [`Engine::advance`] first.
    pub fn save_slot(&mut self, slot: u32, id: u64, now: Nanos) -> bool {
        let n = self.slots.len();
        if n == 0 {
            return false;
        }
        let k = slot as usize % n;
        let s = &mut self.slots[k];
        if s.busy || s.blocks.is_empty() {
            return false;
        }
        s.busy = true;
        self.io.push_back(SlotIo::Save { id, slot: k, tokens: s.context_tokens });
        self.plan_soon(now);
        true
    }

    /// Submits a request at `now`. It joins the batch at the next step boundary. Events
    /// already due before `now` must have been collected with [`Engine::advance`] first.
    pub fn submit(&mut self, mut req: EngineRequest, now: Nanos, events: &mut Vec<EngineEvent>) {
        self.stats.submitted += 1;
        if req.kv_transferred {
            // Its first token comes from a decode step: at least one to generate.
            req.output_tokens = req.output_tokens.max(1);
        }
        let need =
            (req.input_tokens as u64 + req.output_tokens.max(1) as u64).div_ceil(self.profile.block_tokens as u64);
        // A slot's context is the cache split evenly between the slots (llama.cpp `-c` / `-np`).
        let room = self.cache.capacity() / self.slots.len().max(1) as u64;
        if need > room || self.waiting.len() >= self.max_waiting {
            self.stats.rejected += 1;
            events.push(EngineEvent::Rejected { id: req.id, at: now });
            return;
        }
        self.waiting.push_back(req);
        self.plan_soon(now);
    }

    /// Something new at `now` (a request, a save): a coalesced decode span is cut at its
    /// next step boundary so that it is planned for then, and an idle engine plans at `now`
    /// (after every same-instant call).
    fn plan_soon(&mut self, now: Nanos) {
        if let Some(s) = &mut self.step
            && s.count > 1
        {
            let elapsed = now.0.saturating_sub(s.start.0);
            let done = elapsed.div_ceil(s.dt.0.max(1)).max(1);
            s.count = s.count.min(done);
        }
        if self.step.is_none() && self.wake.is_none() {
            self.wake = Some(now);
        }
    }

    /// When the current step (span) ends, or `None` when idle.
    pub fn next_event_time(&self) -> Option<Nanos> {
        self.step.map(|s| Nanos(s.start.0 + s.dt.0 * s.count)).or(self.wake)
    }

    /// Runs every step that ends at or before `now`, appending events.
    pub fn advance(&mut self, now: Nanos, events: &mut Vec<EngineEvent>) {
        while let Some(end) = self.next_event_time() {
            if end > now {
                break;
            }
            if self.step.is_none() {
                self.wake = None;
            } else {
                self.finish_step(end, events);
            }
            self.plan(end);
        }
    }

    /// Decode progress of the current span counted up to `now` (for views between events).
    fn finish_step(&mut self, end: Nanos, events: &mut Vec<EngineEvent>) {
        let Some(step) = self.step.take() else { return };
        if let Some((io, took)) = self.io_running.take() {
            self.finish_io(io, took, end, events);
            return;
        }
        self.stats.busy_ns += step.dt.0 * step.count;
        self.stats.steps += step.count;
        // Decode: every running request already past prefill gets `count` tokens.
        let chunks = std::mem::take(&mut self.chunks);
        let mut in_prefill = vec![false; self.running.len()];
        for &(i, _) in &chunks {
            in_prefill[i] = true;
        }
        for (i, r) in self.running.iter_mut().enumerate() {
            if r.prefill_left == 0 && !in_prefill[i] {
                let n = step.count.min((r.req.output_tokens - r.decoded) as u64) as u32;
                // Only a request whose KV was transferred in decodes from zero tokens: its
                // first decode step samples its first token.
                let first = r.decoded == 0 && n > 0;
                r.decoded += n;
                self.stats.decode_tokens += n as u64;
                if first {
                    let at = Nanos(step.start.0 + step.dt.0);
                    events.push(EngineEvent::FirstToken { id: r.req.id, at, cached_tokens: r.cached_tokens });
                }
            }
        }
        // Prefill chunks.
        for &(i, n) in &chunks {
            let r = &mut self.running[i];
            r.prefill_left -= n;
            self.stats.prefill_tokens += n as u64;
            if r.prefill_left == 0 {
                // The step that ends prefill also samples the first token.
                r.decoded = 1;
                self.stats.decode_tokens += 1;
                events.push(EngineEvent::FirstToken { id: r.req.id, at: end, cached_tokens: r.cached_tokens });
            }
        }
        // Commit computed prompt blocks to the cache: full trace blocks become cached
        // entries; the partial tail and the output stay anonymous until completion.
        let bt = self.profile.block_tokens as u64;
        for r in self.running.iter_mut().filter(|r| r.prefill_left == 0 && !r.committed) {
            r.committed = true;
            let full = full_blocks(&r.req);
            let new = &r.req.blocks[r.hit_blocks.min(full)..full];
            let weight = (r.req.block_tokens as u64).div_ceil(bt);
            let anon = r.reserved_blocks.saturating_sub(new.len() as u64 * weight);
            let start = r.hit_blocks.min(full);
            let parent = start.checked_sub(1).map(|i| r.req.blocks[i]);
            let bs = r.req.block_tokens as usize;
            let toks: &[u32] = r.req.token_ids.as_deref().and_then(|t| t.get(start * bs..full * bs)).unwrap_or(&[]);
            let computed = Computed { new, parent, tokens: toks, block_size: r.req.block_tokens, weight };
            self.cache.commit(computed, r.reserved_blocks, anon);
            r.anon_blocks = anon;
            r.reserved_blocks = 0;
        }
        // Completions.
        let mut i = 0;
        while i < self.running.len() {
            let r = &self.running[i];
            if r.prefill_left == 0 && r.decoded >= r.req.output_tokens {
                let r = self.running.swap_remove(i);
                if let Some(slot) = r.slot.and_then(|k| self.slots.get_mut(k)) {
                    slot.busy = false;
                    slot.last_used = end;
                    slot.context_tokens = r.req.input_tokens.saturating_add(r.decoded.saturating_sub(1));
                } else {
                    let pinned_upto = if r.committed { full_blocks(&r.req).max(r.hit_blocks) } else { r.hit_blocks };
                    self.cache.release(&r.req.blocks[..pinned_upto], r.anon_blocks, r.reserved_blocks);
                }
                self.stats.finished += 1;
                events.push(EngineEvent::Finished { id: r.req.id, at: end });
            } else {
                i += 1;
            }
        }
    }

    /// Admits waiting requests and plans the next step (or span) starting at `now`.
    fn plan(&mut self, now: Nanos) {
        let p = &self.profile;
        let mut budget = p.max_batched_tokens as u64;
        let mut decode_seqs = self.running.iter().filter(|r| r.prefill_left == 0).count() as u64;
        budget = budget.saturating_sub(decode_seqs);
        let mut chunks: Vec<(usize, u32)> = Vec::new();
        for (i, r) in self.running.iter().enumerate() {
            if r.prefill_left > 0 && budget > 0 {
                let n = (r.prefill_left as u64).min(budget) as u32;
                budget -= n as u64;
                chunks.push((i, n));
            }
        }
        if self.slots.is_empty() {
            self.admit_fifo(&mut budget, &mut decode_seqs, &mut chunks);
        } else {
            self.admit_to_slots(now, &mut budget, &mut decode_seqs, &mut chunks);
        }
        // A slot file first: the planned chunks wait for it (they are planned again after).
        if let Some(io) = self.io.pop_front() {
            self.start_io(now, io);
            return;
        }
        if self.running.is_empty() {
            self.step = None;
            return;
        }
        self.schedule_step(now, chunks, decode_seqs);
    }

    /// Admits waiting requests FIFO (a profile without slots) while the step's token
    /// budget, the batch and the KV cache allow: each joins with its first prefill chunk,
    /// or in decode when its KV was transferred.
    fn admit_fifo(&mut self, budget: &mut u64, decode_seqs: &mut u64, chunks: &mut Vec<(usize, u32)>) {
        let p = &self.profile;
        while *budget > 0 && (self.running.len() as u32) < p.max_batch {
            let Some(req) = self.waiting.front() else { break };
            let hit_blocks = self.cache.lookup(&req.blocks);
            let hit_tokens = (hit_blocks as u64 * req.block_tokens as u64).min(req.input_tokens as u64);
            // vLLM always recomputes at least the last prompt token.
            let hit_tokens = hit_tokens.min((req.input_tokens as u64).saturating_sub(1));
            let total = req.input_tokens as u64 + req.output_tokens.max(1) as u64;
            let weight = (req.block_tokens as u64).div_ceil(p.block_tokens as u64);
            let need = (total.div_ceil(p.block_tokens as u64)).saturating_sub(hit_blocks as u64 * weight).max(1);
            if !self.cache.admit(&req.blocks, hit_blocks, weight, need) {
                break;
            }
            let Some(req) = self.waiting.pop_front() else { break };
            if req.kv_transferred {
                // The prompt's KV arrived whole: it joins the batch in decode, one token of
                // the step's budget, no prefill chunk.
                self.stats.transferred_tokens += req.input_tokens as u64;
                *budget -= 1;
                *decode_seqs += 1;
                self.running.push(Running {
                    cached_tokens: req.input_tokens,
                    hit_blocks,
                    prefill_left: 0,
                    decoded: 0,
                    reserved_blocks: need,
                    anon_blocks: 0,
                    committed: false,
                    slot: None,
                    req,
                });
                continue;
            }
            self.stats.prefix_queries_tokens += req.input_tokens as u64;
            self.stats.prefix_hit_tokens += hit_tokens;
            let prefill = (req.input_tokens as u64 - hit_tokens).max(1) as u32;
            let n = (prefill as u64).min(*budget) as u32;
            *budget -= n as u64;
            let idx = self.running.len();
            self.running.push(Running {
                cached_tokens: hit_tokens as u32,
                hit_blocks,
                prefill_left: prefill,
                decoded: 0,
                reserved_blocks: need,
                anon_blocks: 0,
                committed: false,
                slot: None,
                req,
            });
            chunks.push((idx, n));
        }
    }

    /// The next step from `now`: with prefill `chunks`, one step timed by its prefill
    /// tokens and attention pairs; decode-only, a span of identical steps up to the first
    /// completion.
    fn schedule_step(&mut self, now: Nanos, chunks: Vec<(usize, u32)>, decode_seqs: u64) {
        let p = &self.profile;
        let context: u64 =
            self.running.iter().map(|r| (r.req.input_tokens - r.prefill_left) as u64 + r.decoded as u64).sum();
        if chunks.is_empty() {
            // Decode-only: coalesce identical steps until the first completion. A new
            // arrival cuts the span (see `submit`).
            let mut count =
                self.running.iter().map(|r| (r.req.output_tokens - r.decoded) as u64).min().unwrap_or(1).max(1);
            if self.running.iter().any(|r| r.prefill_left == 0 && r.decoded == 0) {
                // A transferred request's first token ends the first step: no span over it.
                count = 1;
            }
            let mean_context = context + decode_seqs * (count - 1) / 2;
            let dt = p.step_time(StepWork { decode_seqs, context_tokens: mean_context, ..StepWork::default() });
            self.step = Some(Step { start: now, dt, count });
        } else {
            // Each chunk's tokens attend to what is before them: the request's tokens already
            // in the KV cache (cached or prefilled in earlier steps) and the chunk's own.
            let mut work = StepWork { decode_seqs, context_tokens: context, ..StepWork::default() };
            for &(i, n) in &chunks {
                let r = &self.running[i];
                let c = StepWork::chunk(n as u64, r.req.input_tokens.saturating_sub(r.prefill_left) as u64);
                work.prefill_tokens += c.prefill_tokens;
                work.prefill_prefix_pairs += c.prefill_prefix_pairs;
                work.prefill_self_pairs += c.prefill_self_pairs;
                work.prefill_context += c.prefill_context;
            }
            let dt = p.step_time(work);
            self.step = Some(Step { start: now, dt, count: 1 });
            self.chunks = chunks;
        }
    }
}

/// Where a waiting request goes in [`Engine::admit_to_slots`].
enum SlotPick {
    /// Into this idle slot.
    Take(usize),
    /// Nowhere yet: the slot it names is busy (later requests may go first).
    Wait,
    /// Nowhere: no slot is idle.
    Full,
}

impl Engine {
    /// The slot for `req` now (module docs, "Slots"): the one it names if idle, else
    /// (naming none) the idle slot sharing the largest fraction of its prompt above
    /// llama.cpp's `--slot-prompt-similarity`, else the least recently used idle one.
    fn pick_slot(&self, req: &EngineRequest) -> SlotPick {
        let n = self.slots.len();
        if let Some(k) = req.slot {
            let k = k as usize % n;
            return if self.slots[k].busy { SlotPick::Wait } else { SlotPick::Take(k) };
        }
        let full = full_blocks(req);
        let mut pick: Option<(f64, usize)> = None;
        for (k, s) in self.slots.iter().enumerate().filter(|(_, s)| !s.busy && !s.blocks.is_empty()) {
            let lcp = s.hit(&req.blocks[..full], req.block_tokens, req.input_tokens).1;
            let sim = f64::from(lcp) / f64::from(req.input_tokens.max(1));
            if sim > SLOT_PROMPT_SIMILARITY && pick.is_none_or(|(best, _)| sim > best) {
                pick = Some((sim, k));
            }
        }
        if let Some((_, k)) = pick {
            return SlotPick::Take(k);
        }
        match self.slots.iter().enumerate().filter(|(_, s)| !s.busy).min_by_key(|(_, s)| s.last_used) {
            Some((k, _)) => SlotPick::Take(k),
            None => SlotPick::Full,
        }
    }

    /// Admission of a profile with `slots` (module docs, "Slots"): waiting requests in
    /// order, each into its named slot when that is idle (else it keeps waiting while later
    /// ones go), or into the idle slot llama.cpp would pick. A request carrying a slot file
    /// has it restored into the slot first (module docs, "Slot files").
    fn admit_to_slots(&mut self, now: Nanos, budget: &mut u64, decode_seqs: &mut u64, chunks: &mut Vec<(usize, u32)>) {
        let n = self.slots.len();
        let mut i = 0;
        while *budget > 0 && i < self.waiting.len() && self.running.len() < n {
            let slot = match self.pick_slot(&self.waiting[i]) {
                SlotPick::Take(k) => k,
                SlotPick::Wait => {
                    i += 1;
                    continue;
                }
                SlotPick::Full => break,
            };
            let Some(req) = self.waiting.remove(i) else { break };
            let full = full_blocks(&req);
            if let Some(file) = &req.restore {
                let s = &mut self.slots[slot];
                s.blocks.clone_from(&file.blocks);
                s.context_tokens = file.tokens;
                self.io.push_back(SlotIo::Restore { id: req.id, tokens: file.tokens });
            }
            self.swap_with_host_cache(slot, &req.blocks[..full], req.block_tokens, req.input_tokens);
            let s = &mut self.slots[slot];
            let (hit_blocks, hit_tokens) = s.hit(&req.blocks[..full], req.block_tokens, req.input_tokens);
            s.blocks.clear();
            s.blocks.extend_from_slice(&req.blocks[..full]);
            s.context_tokens = req.input_tokens;
            s.busy = true;
            s.last_used = now;
            let (cached_tokens, prefill_left) = if req.kv_transferred {
                // The prompt's KV arrived whole: it joins the batch in decode.
                self.stats.transferred_tokens += req.input_tokens as u64;
                *budget -= 1;
                *decode_seqs += 1;
                (req.input_tokens, 0)
            } else {
                let hit_tokens = u64::from(hit_tokens).min(u64::from(req.input_tokens).saturating_sub(1));
                self.stats.prefix_queries_tokens += req.input_tokens as u64;
                self.stats.prefix_hit_tokens += hit_tokens;
                let prefill = (req.input_tokens as u64 - hit_tokens).max(1) as u32;
                let take = (prefill as u64).min(*budget) as u32;
                *budget -= take as u64;
                chunks.push((self.running.len(), take));
                (hit_tokens as u32, prefill)
            };
            self.running.push(Running {
                cached_tokens,
                hit_blocks,
                prefill_left,
                decoded: 0,
                reserved_blocks: 0,
                anon_blocks: 0,
                committed: true,
                slot: Some(slot),
                req,
            });
        }
    }

    /// Runs `io` from `now`: the engine's next step is it (no slot computes meanwhile).
    fn start_io(&mut self, now: Nanos, io: SlotIo) {
        let secs = match io {
            SlotIo::Restore { tokens, .. } => self.profile.slot_restore_secs(u64::from(tokens)),
            SlotIo::Save { tokens, .. } => self.profile.slot_save_secs(u64::from(tokens)),
        };
        let took = Nanos::from_secs_f64(secs);
        self.chunks.clear();
        self.io_running = Some((io, took));
        self.step = Some(Step { start: now, dt: took, count: 1 });
    }

    /// `io` ended at `end` after `took`: counted and reported; a saved slot is idle again.
    fn finish_io(&mut self, io: SlotIo, took: Nanos, end: Nanos, events: &mut Vec<EngineEvent>) {
        self.stats.slot_io_ns += took.0;
        match io {
            SlotIo::Restore { id, tokens } => {
                self.stats.slot_restores += 1;
                self.stats.restored_tokens += u64::from(tokens);
                events.push(EngineEvent::SlotRestored { id, at: end, tokens, took });
            }
            SlotIo::Save { id, slot, tokens } => {
                self.stats.slot_saves += 1;
                self.stats.saved_tokens += u64::from(tokens);
                if let Some(s) = self.slots.get_mut(slot) {
                    s.busy = false;
                    s.last_used = end;
                }
                events.push(EngineEvent::SlotSaved { id, at: end, tokens, took });
            }
        }
    }
}

/// A simulator setting out of range: which one, and what is wrong with its value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{setting}: {message}")]
pub struct InvalidSetting {
    /// The setting (a profile field, a `--kv-*` or `--pd` flag, `engines`, …).
    pub setting: String,
    /// What is wrong, with the value given.
    pub message: String,
}

impl InvalidSetting {
    /// `setting` is refused because of `message`.
    pub fn new(setting: impl Into<String>, message: impl Into<String>) -> Self {
        InvalidSetting { setting: setting.into(), message: message.into() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_constants_that_overflow_the_clock_are_refused_naming_them() {
        // step_overhead_s = 1e308 printed a TTFT p50 of 0 and tok/s 0.
        let p = Profile { step_overhead_s: 1e308, ..Profile::h100_llama3_8b() };
        let e = p.validate().expect_err("refused").to_string();
        assert!(e.contains("step_overhead_s") && e.contains("3600"), "{e}");
        let p = Profile { prefill_per_token_s: 2.0, ..Profile::h100_llama3_8b() };
        assert!(p.validate().expect_err("refused").to_string().contains("prefill_per_token_s"));
        let p = Profile { step_overhead_s: 3600.0, ..Profile::h100_llama3_8b() };
        assert!(p.validate().is_ok());
        for name in ["h100-llama3-8b", "a100-llama3-8b", "cpu-smollm2-135m"] {
            assert!(Profile::named(name).expect(name).validate().is_ok(), "{name}");
        }
    }

    fn profile() -> Profile {
        Profile {
            name: "test".into(),
            block_tokens: 16,
            kv_tokens: 16 * 100,
            max_batch: 4,
            max_batched_tokens: 1000,
            step_overhead_s: 0.001,
            prefill_per_token_s: 0.001,
            decode_per_seq_s: 0.0,
            context_per_token_s: 0.0,
            prefill_attention_s: 0.0,
            prefill_self_attention_s: None,
            slots: 0,
            prefill_step_overhead_s: 0.0,
            prefill_context_per_token_s: 0.0,
            kv_restore_secs_per_token: 0.0,
            kv_save_secs_per_token: 0.0,
            kv_transfer_overhead_secs: 0.0,
            kv_file_bytes_per_token: 0,
        }
    }

    fn req(id: u64, blocks: &[u64], input: u32, output: u32) -> EngineRequest {
        EngineRequest {
            id,
            input_tokens: input,
            output_tokens: output,
            blocks: blocks.iter().map(|b| BlockHash(*b)).collect(),
            block_tokens: 16,
            token_ids: None,
            kv_transferred: false,
            slot: None,
            restore: None,
        }
    }

    fn run(e: &mut Engine) -> Vec<EngineEvent> {
        let mut ev = Vec::new();
        e.advance(Nanos(u64::MAX), &mut ev);
        ev
    }

    /// Two documents of 4 blocks (A: 1..=4, B: 10..=13) on a 2-slot llama.cpp engine, each
    /// run once; then two requests on A arrive together, then one on B. Returns the cached
    /// tokens of the last three, with `pin` = the slot A's requests name.
    fn two_documents_on_two_slots(pin: Option<u32>) -> Vec<u32> {
        let mut e = Engine::new(Profile { slots: 2, ..profile() }, 16);
        let mut ev = Vec::new();
        e.submit(req(1, &[1, 2, 3, 4], 64, 1), Nanos::ZERO, &mut ev);
        e.submit(req(2, &[10, 11, 12, 13], 64, 1), Nanos::ZERO, &mut ev);
        run(&mut e);
        assert_eq!(e.slot_counts(), Some((2, 0)));
        let t = Nanos::from_secs(1);
        let a = |id, tail| EngineRequest { slot: pin, ..req(id, &[1, 2, 3, 4, tail], 80, 4) };
        e.submit(a(3, 5), t, &mut ev);
        e.submit(a(4, 6), t, &mut ev);
        let mut first: Vec<(u64, u32)> = run(&mut e)
            .into_iter()
            .filter_map(|x| match x {
                EngineEvent::FirstToken { id, cached_tokens, .. } => Some((id, cached_tokens)),
                _ => None,
            })
            .collect();
        e.submit(req(5, &[10, 11, 12, 13, 14], 80, 1), Nanos::from_secs(2), &mut ev);
        for x in run(&mut e) {
            if let EngineEvent::FirstToken { id, cached_tokens, .. } = x {
                first.push((id, cached_tokens));
            }
        }
        first.sort();
        first.into_iter().map(|(_, c)| c).collect()
    }

    #[test]
    fn unpinned_requests_sharing_a_busy_slot_take_and_evict_the_other_slot() {
        // Request 4 finds A's slot busy, takes B's and computes A again there (0 cached);
        // B is gone, so request 5 misses too: llama.cpp's slot swap.
        assert_eq!(two_documents_on_two_slots(None), vec![64, 0, 0]);
    }

    /// The cached tokens of a request of `input` tokens over `blocks`, sent to a 1-slot
    /// engine after a 64-token prompt over blocks 1..=4 that generated 10 tokens.
    fn after_a_turn(blocks: &[u64], input: u32) -> u32 {
        let mut e = Engine::new(Profile { slots: 1, ..profile() }, 16);
        let mut ev = Vec::new();
        e.submit(req(1, &[1, 2, 3, 4], 64, 10), Nanos::ZERO, &mut ev);
        run(&mut e);
        e.submit(req(2, blocks, input, 1), Nanos::from_secs(1), &mut ev);
        let cached = run(&mut e).into_iter().find_map(|x| match x {
            EngineEvent::FirstToken { id: 2, cached_tokens, .. } => Some(cached_tokens),
            _ => None,
        });
        cached.expect("request 2 ran")
    }

    /// TTFT of a 16-token request over blocks `tail` on a 1-slot engine with prefill
    /// attention `attn`, after a 64-token prompt over blocks 1..=4.
    fn second_ttft(tail: &[u64], attn: f64) -> u64 {
        second_ttft_split(tail, attn, None)
    }

    /// [`second_ttft`] with `self_attn` as the profile's `prefill_self_attention_s`.
    fn second_ttft_split(tail: &[u64], attn: f64, self_attn: Option<f64>) -> u64 {
        let p = Profile { slots: 1, prefill_attention_s: attn, prefill_self_attention_s: self_attn, ..profile() };
        let mut e = Engine::new(p, 16);
        e.submit(req(1, &[1, 2, 3, 4], 64, 1), Nanos::ZERO, &mut Vec::new());
        run(&mut e);
        ttft_at_one_second(&mut e, req(2, tail, 16 * tail.len() as u32, 1))
    }

    /// The TTFT of `r` (id 2) submitted to `e` at 1 s, `e` run to the end.
    fn ttft_at_one_second(e: &mut Engine, r: EngineRequest) -> u64 {
        let t = Nanos::from_secs(1);
        e.submit(r, t, &mut Vec::new());
        let first = run(e).into_iter().find_map(|x| match x {
            EngineEvent::FirstToken { id: 2, at, .. } => Some(at.0 - t.0),
            _ => None,
        });
        first.expect("request 2 ran")
    }

    #[test]
    fn prefill_attention_makes_a_continued_prefill_dearer_than_a_fresh_one() {
        let us = 1_000;
        // Without it, 16 tokens cost the same after 64 cached ones as fresh: 1 ms step + 16 ms.
        assert_eq!(second_ttft(&[1, 2, 3, 4, 5], 0.0), 17_000 * us);
        assert_eq!(second_ttft(&[9], 0.0), 17_000 * us);
        // With 1 µs per pair: 16 × 64 + 16 × 17 / 2 = 1,160 pairs after the cached 64, 136
        // fresh; the 64 cached tokens are not computed again.
        assert_eq!(second_ttft(&[1, 2, 3, 4, 5], 1e-6), 17_000 * us + 1_160 * us);
        assert_eq!(second_ttft(&[9], 1e-6), 17_000 * us + 136 * us);
    }

    /// TTFT of a 16-token request arriving at 1 s, on an engine whose first request (a
    /// 1,000-token answer when `beside_decode`) is then decoding or has ended.
    fn ttft_with_prefill_overhead(beside_decode: bool) -> u64 {
        let p = Profile { prefill_step_overhead_s: 0.010, ..profile() };
        let mut e = Engine::new(p, 16);
        let mut ev = Vec::new();
        e.submit(req(1, &[1], 16, if beside_decode { 1000 } else { 1 }), Nanos::ZERO, &mut ev);
        e.advance(Nanos::from_secs(1), &mut ev);
        ttft_at_one_second(&mut e, req(2, &[9], 16, 1))
    }

    #[test]
    fn a_prefill_chunk_riding_a_decode_step_pays_no_second_pass_overhead() {
        let ms = 1_000_000;
        // Alone: the step overhead (1 ms), the prefill pass's own (10 ms), 16 tokens (16 ms).
        assert_eq!(ttft_with_prefill_overhead(false), 27 * ms);
        // Beside a decoding request: the decode step under way at 1 s ends at a whole
        // millisecond (1 ms steps from 27 ms), then one step of 1 ms + 16 ms carries the chunk.
        assert_eq!(ttft_with_prefill_overhead(true), 17 * ms);
        let p = Profile { prefill_step_overhead_s: 0.010, ..profile() };
        let chunk = StepWork::chunk(16, 0);
        assert_eq!(p.step_secs(chunk), 0.001 + 0.010 + 0.016);
        assert_eq!(p.step_secs(StepWork { decode_seqs: 1, ..chunk }), 0.001 + 0.016);
    }

    #[test]
    fn pairs_over_the_cached_prefix_and_within_the_chunk_are_priced_apart() {
        let us = 1_000;
        // 1 µs a pair over the 64 cached tokens (16 × 64 = 1,024 pairs), 3 µs a pair within
        // the 16-token chunk (16 × 17 / 2 = 136 pairs).
        assert_eq!(second_ttft_split(&[1, 2, 3, 4, 5], 1e-6, Some(3e-6)), 17_000 * us + 1_024 * us + 408 * us);
        assert_eq!(second_ttft_split(&[9], 1e-6, Some(3e-6)), 17_000 * us + 408 * us);
        // A profile file that names one cost prices every pair with it, as before the split.
        let one: Profile = serde_json::from_value(serde_json::json!({
            "name": "x", "block_tokens": 16, "kv_tokens": 1600, "max_batch": 4, "max_batched_tokens": 1000,
            "step_overhead_s": 0.001, "prefill_per_token_s": 0.001, "decode_per_seq_s": 0.0,
            "context_per_token_s": 0.0, "prefill_attention_s": 1e-6,
        }))
        .expect("profile");
        assert_eq!(one.prefill_self_attention(), 1e-6);
        let base = one.prefill_secs(64, 16) - Profile { prefill_attention_s: 0.0, ..one.clone() }.prefill_secs(64, 16);
        assert!((base - 1_160e-6).abs() < 1e-12, "{base}");
    }

    #[test]
    fn a_slot_keeps_the_generated_tokens_for_the_next_turn() {
        // The next turn repeats the prompt and the answer: 64 + 9 generated tokens evaluated
        // (the last sampled one never is).
        assert_eq!(after_a_turn(&[1, 2, 3, 4, 7, 8], 96), 73);
        // A prompt no longer than that context is not its continuation: blocks only.
        assert_eq!(after_a_turn(&[1, 2, 3, 4, 9], 72), 64);
        // A prompt leaving the slot's blocks early keeps the common run only.
        assert_eq!(after_a_turn(&[1, 2, 5, 6, 7, 8], 96), 32);
    }

    #[test]
    fn a_request_naming_its_slot_waits_for_it_and_the_other_document_stays() {
        // Slot 0 got A first (both empty: the least recently used, the first).
        assert_eq!(two_documents_on_two_slots(Some(0)), vec![64, 64, 64]);
    }

    /// A 1-slot engine whose slot files cost 2 ms + 0.1 ms per token restored, 2 ms + 0.2 ms
    /// per token saved.
    fn slot_file_engine() -> Engine {
        let p = Profile {
            slots: 1,
            kv_restore_secs_per_token: 1e-4,
            kv_save_secs_per_token: 2e-4,
            kv_transfer_overhead_secs: 0.002,
            ..profile()
        };
        Engine::new(p, 16)
    }

    #[test]
    fn a_restored_file_is_in_the_slot_before_the_prompt_is_matched_and_costs_its_read_first() {
        let mut e = slot_file_engine();
        let mut ev = Vec::new();
        let file = SlotRestore { blocks: [1, 2, 3, 4].map(BlockHash).to_vec(), tokens: 64 };
        let r = EngineRequest { slot: Some(0), restore: Some(file), ..req(1, &[1, 2, 3, 4, 5], 80, 1) };
        e.submit(r, Nanos::ZERO, &mut ev);
        let ev = run(&mut e);
        // The read: 2 ms + 64 × 0.1 ms; then 16 new tokens: 1 ms + 16 ms.
        let read = Nanos(8_400_000);
        assert_eq!(ev[0], EngineEvent::SlotRestored { id: 1, at: read, tokens: 64, took: read });
        assert_eq!(ev[1], EngineEvent::FirstToken { id: 1, at: Nanos(read.0 + 17_000_000), cached_tokens: 64 });
        let s = e.stats();
        assert_eq!((s.slot_restores, s.restored_tokens, s.slot_io_ns), (1, 64, read.0));
        assert_eq!(s.busy_ns, 17_000_000, "the read is not a step");
    }

    #[test]
    fn a_save_holds_its_slot_and_the_engine_and_a_request_on_that_slot_waits_for_it() {
        let mut e = slot_file_engine();
        let mut ev = Vec::new();
        let t = Nanos::from_secs(1);
        e.submit(req(1, &[1, 2, 3, 4], 64, 10), Nanos::ZERO, &mut ev);
        run(&mut e);
        // 64 prompt tokens and 9 generated ones evaluated: 73 written, 2 ms + 14.6 ms.
        assert!(e.save_slot(0, 7, t));
        assert_eq!(e.slot_counts(), Some((1, 1)));
        assert!(!e.save_slot(0, 8, t), "a busy slot is not saved");
        e.submit(EngineRequest { slot: Some(0), ..req(2, &[1, 2, 3, 4, 5], 96, 1) }, t, &mut ev);
        let ev = run(&mut e);
        let saved = Nanos(t.0 + 16_600_000);
        assert_eq!(ev[0], EngineEvent::SlotSaved { id: 7, at: saved, tokens: 73, took: Nanos(16_600_000) });
        // Then the request: 73 cached (the slot kept the whole turn), 23 new: 1 ms + 23 ms.
        assert_eq!(ev[1], EngineEvent::FirstToken { id: 2, at: Nanos(saved.0 + 24_000_000), cached_tokens: 73 });
        assert_eq!((e.stats().slot_saves, e.stats().saved_tokens), (1, 73));
        let mut empty = slot_file_engine();
        assert!(!empty.save_slot(0, 1, t), "an empty slot has nothing to save");
        assert!(!Engine::new(profile(), 16).save_slot(0, 1, t), "no slots");
    }

    #[test]
    fn cold_prefill_time_is_linear_in_uncached_tokens() {
        let mut e = Engine::new(profile(), 16);
        let mut ev = Vec::new();
        e.submit(req(1, &[1, 2, 3, 4], 64, 1), Nanos::ZERO, &mut ev);
        let ev = run(&mut e);
        // One step: 1 ms overhead + 64 × 1 ms.
        assert_eq!(ev[0], EngineEvent::FirstToken { id: 1, at: Nanos::from_millis(65), cached_tokens: 0 });
        assert_eq!(ev[1], EngineEvent::Finished { id: 1, at: Nanos::from_millis(65) });
    }

    #[test]
    fn fully_cached_prompt_costs_no_prefill_but_the_last_token() {
        let mut e = Engine::new(profile(), 16);
        let mut ev = Vec::new();
        e.submit(req(1, &[1, 2, 3, 4], 64, 1), Nanos::ZERO, &mut ev);
        run(&mut e);
        let t0 = Nanos::from_secs(1);
        e.submit(req(2, &[1, 2, 3, 4], 64, 1), t0, &mut ev);
        let ev = run(&mut e);
        // 63 tokens cached (the last is always recomputed): 1 ms + 1 × 1 ms.
        assert_eq!(ev[0], EngineEvent::FirstToken { id: 2, at: Nanos(t0.0 + 2_000_000), cached_tokens: 63 });
        assert_eq!(e.stats().prefix_hit_tokens, 63);
        assert_eq!(e.stats().prefix_queries_tokens, 128);
    }

    #[test]
    fn only_the_leading_run_of_the_chain_is_a_hit() {
        let mut e = Engine::new(profile(), 16);
        let mut ev = Vec::new();
        e.submit(req(1, &[1, 2, 3, 4], 64, 1), Nanos::ZERO, &mut ev);
        run(&mut e);
        // Block 1 differs: nothing after it is usable even though 2..4 are cached.
        assert_eq!(e.cached_prefix_tokens(&[BlockHash(9), BlockHash(2), BlockHash(3)], 16, 48), 0);
        assert_eq!(e.cached_prefix_tokens(&[BlockHash(1), BlockHash(2), BlockHash(7)], 16, 48), 32);
    }

    #[test]
    fn eviction_is_lru_tail_first() {
        let mut p = profile();
        p.kv_tokens = 16 * 10; // 10 blocks
        let mut e = Engine::new(p, 16);
        let mut ev = Vec::new();
        e.submit(req(1, &[1, 2, 3, 4], 64, 1), Nanos::ZERO, &mut ev);
        run(&mut e);
        e.submit(req(2, &[5, 6, 7, 8], 64, 1), Nanos::from_secs(1), &mut ev);
        run(&mut e);
        // 8 cached; a 4-block request (+1 output block) needs 5 → evicts 3 of the oldest
        // request's blocks, tail first: 1 survives.
        e.submit(req(3, &[9, 10, 11, 12], 64, 1), Nanos::from_secs(2), &mut ev);
        run(&mut e);
        assert_eq!(e.cached_prefix_tokens(&[BlockHash(1)], 16, 16), 16);
        assert_eq!(e.cached_prefix_tokens(&[BlockHash(1), BlockHash(2)], 16, 32), 16);
        assert_eq!(e.cached_prefix_tokens(&[BlockHash(5), BlockHash(6), BlockHash(7), BlockHash(8)], 16, 64), 64);
        assert!(e.cache().evictions() >= 3);
    }

    #[test]
    fn batching_shares_steps_and_respects_max_batch() {
        let mut p = profile();
        p.max_batch = 2;
        let mut e = Engine::new(p, 16);
        let mut ev = Vec::new();
        for id in 0..3 {
            e.submit(req(id, &[100 + id], 16, 3), Nanos::ZERO, &mut ev);
        }
        assert_eq!((e.num_running(), e.num_waiting()), (0, 3));
        let mut ev = Vec::new();
        e.advance(Nanos::ZERO, &mut ev);
        assert_eq!((e.num_running(), e.num_waiting()), (2, 1));
        let ev = run(&mut e);
        let first = |id| {
            ev.iter()
                .find_map(|x| match x {
                    EngineEvent::FirstToken { id: i, at, .. } if *i == id => Some(*at),
                    _ => None,
                })
                .expect("first token")
        };
        // 0 and 1 prefill together in one step (1 + 32 ms); 2 waits for a free slot.
        assert_eq!(first(0), Nanos::from_millis(33));
        assert_eq!(first(1), Nanos::from_millis(33));
        assert!(first(2) > Nanos::from_millis(33));
        assert_eq!(e.stats().finished, 3);
        assert_eq!(e.cache().active(), 0, "all blocks released");
    }

    #[test]
    fn transferred_kv_costs_no_prefill_and_the_first_decode_step_samples_the_first_token() {
        let mut e = Engine::new(profile(), 16);
        let mut ev = Vec::new();
        let mut r = req(1, &[1, 2, 3, 4], 64, 3);
        r.kv_transferred = true;
        e.submit(r, Nanos::ZERO, &mut ev);
        let ev = run(&mut e);
        // Decode steps of 1 ms each (no prefill chunk): first token after one, done after three.
        assert_eq!(ev[0], EngineEvent::FirstToken { id: 1, at: Nanos::from_millis(1), cached_tokens: 64 });
        assert_eq!(ev[1], EngineEvent::Finished { id: 1, at: Nanos::from_millis(3) });
        let s = e.stats();
        assert_eq!((s.prefill_tokens, s.transferred_tokens, s.decode_tokens), (0, 64, 3));
        assert_eq!((s.prefix_queries_tokens, s.prefix_hit_tokens), (0, 0), "a transfer is not a prefix lookup");
        // The transferred blocks stay cached: a colocated request on the same prompt hits them.
        assert_eq!(e.cached_prefix_tokens(&[BlockHash(1), BlockHash(2), BlockHash(3), BlockHash(4)], 16, 64), 64);
        assert_eq!(e.cache().active(), 0, "all blocks released");
    }

    #[test]
    fn a_transferred_request_joins_a_running_decode_batch_at_a_step_boundary() {
        let mut e = Engine::new(profile(), 16);
        let mut ev = Vec::new();
        e.submit(req(1, &[1], 16, 100), Nanos::ZERO, &mut ev);
        e.advance(Nanos::from_millis(17), &mut ev); // prefill done at 17 ms, decode span follows
        let mut r = req(2, &[2, 3], 32, 2);
        r.kv_transferred = true;
        e.submit(r, Nanos(20_500_000), &mut ev);
        let ev = run(&mut e);
        // Joins at the 21 ms boundary; its first decode step ends at 22 ms.
        assert!(ev.contains(&EngineEvent::FirstToken { id: 2, at: Nanos::from_millis(22), cached_tokens: 32 }));
        assert!(ev.contains(&EngineEvent::Finished { id: 2, at: Nanos::from_millis(23) }));
        assert_eq!(e.stats().prefill_tokens, 16, "only the colocated request's prompt was computed");
    }

    #[test]
    fn oversized_requests_are_rejected_not_stuck() {
        let mut e = Engine::new(profile(), 16);
        let mut ev = Vec::new();
        e.submit(req(1, &[1], 100_000, 1), Nanos::ZERO, &mut ev);
        assert_eq!(ev, vec![EngineEvent::Rejected { id: 1, at: Nanos::ZERO }]);
        assert!(e.next_event_time().is_none());
    }

    #[test]
    fn decode_span_is_cut_by_a_new_arrival() {
        let mut e = Engine::new(profile(), 16);
        let mut ev = Vec::new();
        e.submit(req(1, &[1], 16, 100), Nanos::ZERO, &mut ev);
        e.advance(Nanos::from_millis(17), &mut ev); // prefill done at 17 ms
        assert_eq!(ev.len(), 1);
        // Decode span of 99 steps of 1 ms; an arrival at 20.5 ms joins at 21 ms.
        e.advance(Nanos(20_500_000), &mut ev);
        e.submit(req(2, &[2], 16, 1), Nanos(20_500_000), &mut ev);
        assert_eq!(e.next_event_time(), Some(Nanos::from_millis(21)));
        let ev = run(&mut e);
        assert!(ev.contains(&EngineEvent::FirstToken { id: 2, at: Nanos::from_millis(21 + 17), cached_tokens: 0 }));
    }

    #[test]
    fn cache_events_report_stored_chains_and_evictions() {
        let mut p = profile();
        p.kv_tokens = 16 * 6; // 6 blocks
        let mut e = Engine::new(p, 16);
        e.record_cache_events(true);
        let mut ev = Vec::new();
        let mut r = req(1, &[1, 2, 3], 48, 1);
        r.token_ids = Some((0..48).collect::<Vec<u32>>().into());
        e.submit(r, Nanos::ZERO, &mut ev);
        run(&mut e);
        let mut log = Vec::new();
        e.drain_cache_events(&mut log);
        assert_eq!(
            log,
            vec![CacheEvent::Stored {
                hashes: vec![BlockHash(1), BlockHash(2), BlockHash(3)],
                parent: None,
                token_ids: (0..48).collect(),
                block_size: 16
            }]
        );
        // Sharing the first block: only the new tail is stored, with its parent.
        e.submit(req(2, &[1, 9], 32, 1), Nanos::from_secs(1), &mut ev);
        run(&mut e);
        log.clear();
        e.drain_cache_events(&mut log);
        assert_eq!(
            log,
            vec![CacheEvent::Stored {
                hashes: vec![BlockHash(9)],
                parent: Some(BlockHash(1)),
                token_ids: vec![],
                block_size: 16
            }]
        );
        // A 4-block request (+1 output block) in a 6-block cache evicts LRU blocks.
        e.submit(req(3, &[20, 21, 22, 23], 64, 1), Nanos::from_secs(2), &mut ev);
        run(&mut e);
        log.clear();
        e.drain_cache_events(&mut log);
        let removed: Vec<BlockHash> = log
            .iter()
            .filter_map(|x| match x {
                CacheEvent::Removed { hashes } => Some(hashes.clone()),
                _ => None,
            })
            .flatten()
            .collect();
        assert!(!removed.is_empty());
        assert_eq!(removed.len() as u64, e.cache().evictions());
    }
}
