//! Cluster mode: a worker registry and a live policy shared by every router replica
//! through etcd ([`etcd`]).
//!
//! Layout under the key prefix (default `/kvroute`, `etcd_prefix`):
//! - `PREFIX/workers/<id>`: one worker, a [`WorkerRecord`] as JSON, normally attached to a
//!   lease that `kvroute register` keeps alive while the worker's `/health` passes. A put
//!   adds or updates the worker in every router; a delete, or the lease expiring, removes it
//!   and its entries from every prefix index.
//! - `PREFIX/routing/policy` (or `etcd_policy_key`): the live policy,
//!   `{"policy": NAME, "knobs": {...}}`, or Cognitora cgn-router's
//!   `{"w_kv":..,"w_load":..,"w_pwr":..,"w_cap":..}` (kv_score's weights), applied through
//!   [`crate::policy_control::apply`].
//!
//! The registry follows Cognitora cgn-router's etcd node registry (`cluster/registry.rs`,
//! `cluster/watcher.rs`) and its live weights at `/cognitora/routing/policy`.

pub mod chunks;
pub mod etcd;
pub mod journal;
pub mod journal_task;
pub mod last_known;
pub mod register;
pub mod sync;
pub mod sync_task;

// The registry's vocabulary lives in `crate::model` (it imports nothing of the gateway);
// these names stay here for callers that know them from this module.
pub use crate::model::capacity::{Capacity, CapacityError, dtype_bytes};
pub use crate::model::registration::{MAX_LABELS, MAX_VALUE_BYTES, RecordError, Role, WorkerRecord};
