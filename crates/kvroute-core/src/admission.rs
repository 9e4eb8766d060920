//! Admission control (Cognitora cgn-router): a bounded in-flight counter per (model, role) that hands
//! out RAII [`Permit`]s. When a counter is full the request is rejected at once — the
//! gateway answers 503 with `Retry-After` — and never queued: "queueing inflates TTFT and
//! the client's deadline budget is more useful at the source". The limit is a hard cap on
//! concurrency, not a buffer.
//!
//! Counters are atomics shared through `Arc`, so a permit can be moved into a response
//! stream and released when the stream ends or is dropped, on any thread, without a lock.

use crate::types::Role;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

/// Default `max_queue` when none is configured for a (model, role).
pub const DEFAULT_MAX_QUEUE: u32 = 1024;

#[derive(Debug)]
struct Counter {
    in_use: AtomicU32,
    max: u32,
}

/// Per-(model, role) admission counters.
///
/// Built once from config; new (model, role) pairs get `default_max`. Lookups are by
/// borrowed strings; the table only grows when a new model is first seen (bounded by the
/// number of models the registry serves, which the front end validates).
#[derive(Debug, Clone)]
pub struct Admission {
    /// Default limit per role, indexed by [`role_slot`].
    default_max: [u32; 3],
    /// model -> counters indexed by [`role_slot`]; looked up by `&str` without allocating.
    table: HashMap<String, [Arc<Counter>; 3]>,
}

fn role_slot(role: Role) -> usize {
    match role {
        Role::Prefill => 0,
        Role::Decode => 1,
        Role::Both => 2,
    }
}

fn counter(max: u32) -> Arc<Counter> {
    Arc::new(Counter { in_use: AtomicU32::new(0), max })
}

/// The request was not admitted: (model, role) already has `max` requests in flight.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("admission limit reached for model `{model}` role {role}: {max} requests in flight")]
pub struct Rejected {
    /// Model name.
    pub model: String,
    /// Role name.
    pub role: &'static str,
    /// The limit.
    pub max: u32,
}

/// Held for the lifetime of an admitted request; releases its slot on drop.
#[derive(Debug)]
pub struct Permit {
    counter: Arc<Counter>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.counter.in_use.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Admission {
    /// Admission with `default_max` in-flight requests per (model, role).
    pub fn new(default_max: u32) -> Self {
        Admission { default_max: [default_max; 3], table: HashMap::new() }
    }

    /// Admission with its own default limit per role (prefill/decode disaggregation admits
    /// each phase of a split request against its role's counter).
    pub fn with_role_limits(both: u32, prefill: u32, decode: u32) -> Self {
        Admission { default_max: [prefill, decode, both], table: HashMap::new() }
    }

    /// Sets the limit of one (model, role). Call before traffic: permits already handed
    /// out keep counting against the old counter.
    pub fn set_limit(&mut self, model: &str, role: Role, max: u32) {
        self.ensure_model(model);
        if let Some(slots) = self.table.get_mut(model) {
            slots[role_slot(role)] = counter(max);
        }
    }

    /// Registers `model` with each role's default limit if it is new.
    pub fn ensure_model(&mut self, model: &str) {
        if !self.table.contains_key(model) {
            let [p, d, b] = self.default_max;
            self.table.insert(model.to_owned(), [counter(p), counter(d), counter(b)]);
        }
    }

    /// Tries to admit a request. Lock-free; O(1).
    ///
    /// # Errors
    /// [`Rejected`] when the (model, role) counter is at its limit. A model never
    /// registered with [`Admission::ensure_model`]/[`Admission::set_limit`] is admitted
    /// against a fresh counter of the default limit only after registration; here it is
    /// rejected with `max = 0`, so callers must register models first.
    pub fn try_admit(&self, model: &str, role: Role) -> Result<Permit, Rejected> {
        let Some(counter) = self.table.get(model).map(|s| &s[role_slot(role)]) else {
            return Err(Rejected { model: model.to_owned(), role: role.as_str(), max: 0 });
        };
        let mut cur = counter.in_use.load(Ordering::Acquire);
        loop {
            if cur >= counter.max {
                return Err(Rejected { model: model.to_owned(), role: role.as_str(), max: counter.max });
            }
            match counter.in_use.compare_exchange_weak(cur, cur + 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Ok(Permit { counter: Arc::clone(counter) }),
                Err(actual) => cur = actual,
            }
        }
    }

    /// Requests currently admitted for (model, role).
    pub fn in_use(&self, model: &str, role: Role) -> u32 {
        self.table.get(model).map_or(0, |s| s[role_slot(role)].in_use.load(Ordering::Acquire))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_counter_rejects_at_once_and_drop_releases() {
        let mut a = Admission::new(2);
        a.ensure_model("m");
        let p1 = a.try_admit("m", Role::Both).unwrap();
        let _p2 = a.try_admit("m", Role::Both).unwrap();
        let err = a.try_admit("m", Role::Both).unwrap_err();
        assert_eq!(err.max, 2);
        // other roles are independent
        let _pd = a.try_admit("m", Role::Decode).unwrap();
        drop(p1);
        assert_eq!(a.in_use("m", Role::Both), 1);
        assert!(a.try_admit("m", Role::Both).is_ok());
        let mut r = Admission::with_role_limits(3, 1, 2);
        r.ensure_model("m");
        let _p = r.try_admit("m", Role::Prefill).unwrap();
        assert_eq!(r.try_admit("m", Role::Prefill).unwrap_err().max, 1, "prefill has its own limit");
        let _d = (r.try_admit("m", Role::Decode).unwrap(), r.try_admit("m", Role::Decode).unwrap());
        assert_eq!(r.try_admit("m", Role::Decode).unwrap_err().max, 2);
    }

    #[test]
    fn unknown_model_is_rejected() {
        let a = Admission::new(2);
        assert!(a.try_admit("nope", Role::Both).is_err());
    }
}
