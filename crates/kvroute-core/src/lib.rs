//! # kvroute-core
//!
//! The routing core of kvroute, a KV-cache-aware request router for LLM inference fleets.
//! Pure Rust with no I/O, no clock, no async runtime and no global state: time
//! ([`types::Nanos`]) and randomness (a [`rand_core::Rng`]) are arguments, so the gateway,
//! the replay simulator and the engine simulator all run the same policy code.
//!
//! ## Layout
//! - [`types`]: request and worker views, ids, roles, time.
//! - [`hash`]: chained block hashing (xxh3-64 default, BLAKE3 option).
//! - [`radix`]: approximate multi-tenant radix tree (SGLang / Ray Serve semantics).
//! - [`block_index`]: block hash → workers index with TTL and a block budget.
//! - [`lru_blocks`]: B3 `cache_aware_proxy.py`'s per-worker LRU set of block hashes.
//! - [`fleet_digest`]: what a scoring decision reads from every worker, kept between decisions.
//! - [`ledger`]: per-worker load counters with explicit request transitions.
//! - [`view_changes`]: which workers' views changed since a reader of kept views last looked.
//! - [`admission`]: per-(model, role) admission with RAII permits (Cognitora cgn-router).
//! - [`policy`]: the [`policy::Policy`] trait and every policy.
//! - [`registry`]: build a policy by name; list policies with knobs and defaults.
//! - [`slots`]: what a llama.cpp worker's slots hold and which slot a request takes.
//! - [`kv_migration`]: saved prompt prefixes, and when restoring one beats recomputing it.
//! - [`select`]: the few smallest items of a fleet-sized sequence, without sorting it.
//! - [`cascade`], [`disagg`]: Cognitora cgn-router's cascade state machine and prefill/decode plan.
//! - [`tenant`]: per-tenant salts on routing keys (tenant isolation of prefix state).
//! - [`trace`]: trace transforms shared by the simulator and the load generator.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod admission;
pub mod block_index;
pub mod cascade;
pub mod decision_bench;
pub mod disagg;
pub mod fleet_digest;
pub mod hash;
pub mod kv_migration;
pub mod ledger;
pub mod lru_blocks;
pub mod policy;
pub mod precise;
pub mod radix;
pub mod registry;
pub mod select;
pub mod slots;
pub mod tenant;
pub mod trace;
pub mod types;
pub mod view_changes;

pub use policy::{Branch, Decision, PickCtx, Policy, RouteError};
pub use types::{BlockHash, Nanos, RequestView, Role, WorkerId, WorkerView};
