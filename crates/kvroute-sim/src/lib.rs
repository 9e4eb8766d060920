//! # kvroute-sim
//!
//! The engine model and the trace-replay simulator of kvroute.
//!
//! - [`engine`]: a pure discrete-event model of one inference engine (paged KV cache with
//!   prefix caching, continuous batching, chunked prefill, step-time profiles).
//! - [`trace`]: trace readers (Mooncake JSONL, Azure CSV, session JSONL) with
//!   file/line/field errors, and transforms (rate scaling, spreading, sampling, capping).
//! - [`replay`]: replays a trace through a routing policy onto N engines on a logical clock.
//! - [`kv_move`]: the KV mover of a replay (llama.cpp slot files saved and restored by the
//!   router), the router side of `kvroute serve`'s `[kv_migration]`.
//! - [`pd`]: prefill/decode disaggregation: the KV transfer model shared with
//!   `kvroute engine-sim`, and the replay of a trace onto P prefill and D decode engines.
//! - [`types`]: the vocabulary both replays share (settings, outcomes, the transfer model,
//!   what the router sees of an engine), so that [`replay`] and [`pd`] import it and not
//!   each other.
//! - [`report`]: per-policy results, tables, JSON/CSV and plots.
//! - [`latency`]: the one latency summary (TTFT, TPOT, E2E) and SLO shared with `kvroute bench`.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod engine;
pub mod kv_move;
pub mod latency;
pub mod pd;
pub mod replay;
pub mod report;
pub mod trace;
pub mod types;
