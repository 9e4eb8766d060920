//! Classic load-balancing baselines, with no prefix awareness:
//!
//! - `round_robin`: rotation over the routable candidates;
//! - `random`: uniform choice from the injected random source;
//! - `least_load`: the candidate with the lowest [`WorkerView::load`] (rotation among ties);
//! - `power_of_two`: Power of Two Choices (Mitzenmacher 2001; tower's `p2c`, Ray Serve's
//!   default router): two distinct random candidates, the less loaded wins;
//! - `consistent_hash`: rendezvous (highest-random-weight) hashing of the session id, or of
//!   the prompt's first 256 bytes / first block when there is no session, so a key keeps
//!   its worker and removing a worker moves only that worker's keys. The hash is
//!   [`crate::hash::stable_hash`], identical across processes and versions.
//!
//! None has knobs.

use crate::hash::stable_hash;
use crate::policy::kv_score::tie_hash_key;
use crate::policy::util::{Rotation, argmin_by, power_of_two_routable, rotate, routable_ids};
use crate::policy::{Branch, Decision, KnobError, PickCtx, Policy, RequestKey, RouteError};
use crate::types::{RequestView, WorkerView};

fn no_knobs(policy: &'static str, patch: &serde_json::Value) -> Result<(), KnobError> {
    match patch.as_object() {
        Some(o) if o.is_empty() => Ok(()),
        None if patch.is_null() => Ok(()),
        Some(o) => Err(KnobError {
            policy,
            message: format!("this policy has no knobs (got `{}`)", o.keys().next().map_or("", |k| k.as_str())),
        }),
        None => Err(KnobError { policy, message: "knobs must be a JSON object".into() }),
    }
}

macro_rules! no_knob_impls {
    ($name:literal) => {
        fn name(&self) -> &'static str {
            $name
        }
        fn knobs(&self) -> serde_json::Value {
            serde_json::json!({})
        }
        fn set_knobs(&mut self, patch: &serde_json::Value) -> Result<(), KnobError> {
            no_knobs($name, patch)
        }
    };
}

/// `round_robin`: rotation over routable candidates.
#[derive(Debug, Default, Clone)]
pub struct RoundRobin {
    next: Rotation,
}

impl Policy for RoundRobin {
    no_knob_impls!("round_robin");
    fn pick(
        &self,
        _: &RequestView<'_>,
        _: &RequestKey,
        c: &[WorkerView],
        _: &mut PickCtx<'_>,
    ) -> Result<Decision, RouteError> {
        // The k-th routable worker, found in two passes without collecting the fleet.
        let n = c.iter().filter(|w| w.is_routable()).count();
        if n == 0 {
            return Err(RouteError::NoWorker);
        }
        let k = (self.next.next() % n as u64) as usize;
        let w = c.iter().filter(|w| w.is_routable()).nth(k).ok_or(RouteError::NoWorker)?;
        Ok(Decision::new(w.id, Branch::RoundRobin))
    }
}

/// `random`: uniform choice (seeded by the caller).
#[derive(Debug, Default, Clone)]
pub struct Random;

impl Policy for Random {
    no_knob_impls!("random");
    fn pick(
        &self,
        _: &RequestView<'_>,
        _: &RequestKey,
        c: &[WorkerView],
        ctx: &mut PickCtx<'_>,
    ) -> Result<Decision, RouteError> {
        let ids = routable_ids(c);
        if ids.is_empty() {
            return Err(RouteError::NoWorker);
        }
        let w = ids[(ctx.rng.next_u64() % ids.len() as u64) as usize];
        Ok(Decision::new(w, Branch::Random))
    }
}

/// `least_load`: lowest `load()`, rotation among ties.
#[derive(Debug, Default, Clone)]
pub struct LeastLoad {
    rotation: Rotation,
}

impl Policy for LeastLoad {
    no_knob_impls!("least_load");
    fn pick(
        &self,
        _: &RequestView<'_>,
        _: &RequestKey,
        c: &[WorkerView],
        _: &mut PickCtx<'_>,
    ) -> Result<Decision, RouteError> {
        let tied = argmin_by(c, |_| true, WorkerView::load);
        let w = rotate(&tied, &self.rotation).ok_or(RouteError::NoWorker)?;
        Ok(Decision::new(w, Branch::LeastLoad))
    }
}

/// `power_of_two`: Power of Two Choices.
#[derive(Debug, Default, Clone)]
pub struct PowerOfTwo;

impl Policy for PowerOfTwo {
    no_knob_impls!("power_of_two");
    fn pick(
        &self,
        _: &RequestView<'_>,
        _: &RequestKey,
        c: &[WorkerView],
        ctx: &mut PickCtx<'_>,
    ) -> Result<Decision, RouteError> {
        let w = power_of_two_routable(c, ctx.rng).ok_or(RouteError::NoWorker)?;
        Ok(Decision::new(w, Branch::PowerOfTwo))
    }
}

/// `consistent_hash`: rendezvous hashing of the session (or prefix) key — each routable
/// worker's weight is a hash of (key, worker), the heaviest wins — so a key stays on its
/// worker while that worker is routable and moves only when it is not. A worker is named
/// by its [`WorkerView::tie_key`] when it has one (the gateway: a hash of its URL), so
/// replicas that list the same workers in another order, or under other ids, send a key to
/// the same worker; else by its id (the replay, where ids are the engines' numbers).
#[derive(Debug, Default, Clone)]
pub struct ConsistentHash;

/// The rendezvous weight of worker `w` for `key` ([`ConsistentHash`]): for a named worker
/// the hash kv_score breaks its ties with ([`tie_hash_key`]).
fn rendezvous_weight(key: u64, w: &WorkerView) -> u64 {
    match w.tie_key {
        Some(name) => tie_hash_key(name, key),
        // The key's 8 bytes, then the id's 4.
        None => crate::hash::stable_hash_12(key, 8, u64::from(w.id.0)),
    }
}

/// The routing key of `consistent_hash`: the session id, else the first 256 bytes of the
/// routing text, else the first 64 token ids, else the first block hash, else 0.
pub fn session_or_prefix_key(req: &RequestView<'_>) -> u64 {
    if let Some(s) = req.session_id {
        return stable_hash(s.as_bytes());
    }
    if let Some(t) = req.text {
        let mut end = t.len().min(256);
        while !t.is_char_boundary(end) {
            end -= 1;
        }
        return stable_hash(&t.as_bytes()[..end]);
    }
    if let Some(toks) = req.token_ids {
        let bytes: Vec<u8> = toks.iter().take(64).flat_map(|t| t.to_le_bytes()).collect();
        return stable_hash(&bytes);
    }
    req.blocks.and_then(|b| b.hashes.first()).map_or(0, |h| h.0)
}

impl Policy for ConsistentHash {
    no_knob_impls!("consistent_hash");
    fn pick(
        &self,
        req: &RequestView<'_>,
        _: &RequestKey,
        c: &[WorkerView],
        _: &mut PickCtx<'_>,
    ) -> Result<Decision, RouteError> {
        let key = session_or_prefix_key(req);
        // The heaviest routable worker, the last of equals (as `max_by_key`), kept in three
        // scalars: a fold's accumulator went through the stack on every worker, a store and
        // a load the next comparison waited on (~3× the time at 1,024 workers).
        let (mut best_weight, mut best_name, mut best) = (0u64, 0u64, usize::MAX);
        for (i, w) in c.iter().enumerate() {
            if !w.is_routable() {
                continue;
            }
            let (weight, name) = (rendezvous_weight(key, w), w.tie_key.unwrap_or(u64::from(w.id.0)));
            if best == usize::MAX || (weight, name) >= (best_weight, best_name) {
                (best_weight, best_name, best) = (weight, name, i);
            }
        }
        let w = c.get(best).ok_or(RouteError::NoWorker)?;
        Ok(Decision::new(w.id, Branch::ConsistentHash))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::WorkerId;

    /// An unnamed worker's weight hashes the key's 8 little-endian bytes then the id's 4, so
    /// a replay's consistent_hash routes as it did in earlier versions.
    #[test]
    fn an_unnamed_worker_s_weight_hashes_the_key_then_the_id() {
        for (key, id) in [(0u64, 0u32), (1, 7), (0x0123_4567_89ab_cdef, 1023), (u64::MAX, u32::MAX)] {
            let bytes: Vec<u8> = key.to_le_bytes().into_iter().chain(id.to_le_bytes()).collect();
            let w = WorkerView::idle(WorkerId(id));
            assert_eq!(rendezvous_weight(key, &w), stable_hash(&bytes), "key {key:#x}, worker {id}");
        }
    }

    /// The heaviest routable worker wins, and of two equal ones (the same name twice) the
    /// later, as `Iterator::max_by_key` chose before the loop kept the best in scalars.
    #[test]
    fn the_heaviest_routable_worker_wins_and_the_later_of_equals() {
        let req = RequestView::from_text("m", "a prompt");
        let key = session_or_prefix_key(&req);
        let named = |id: u32, name: u64| WorkerView { tie_key: Some(name), ..WorkerView::idle(WorkerId(id)) };
        let mut c: Vec<WorkerView> = (0..40).map(|i| named(i, 1000 + u64::from(i))).collect();
        let heaviest = c.iter().max_by_key(|w| rendezvous_weight(key, w)).map(|w| w.id).expect("workers");
        let pick = |c: &[WorkerView]| {
            let mut rng = <rand_xoshiro::Xoshiro256PlusPlus as rand_core::SeedableRng>::seed_from_u64(0);
            let mut ctx = PickCtx { now: crate::types::Nanos::ZERO, rng: &mut rng, fleet: None };
            ConsistentHash.pick(&req, &RequestKey::default(), c, &mut ctx).map(|d| d.worker)
        };
        assert_eq!(pick(&c), Ok(heaviest));
        // Unroutable, it is passed over; a second worker under its name (equal weight and
        // name) placed after it wins over it.
        let at = c.iter().position(|w| w.id == heaviest).expect("there");
        c[at].health = crate::types::Health::Unhealthy;
        assert_ne!(pick(&c), Ok(heaviest));
        c[at].health = crate::types::Health::Healthy;
        let twin = named(99, c[at].tie_key.expect("named"));
        c.push(twin);
        assert_eq!(pick(&c), Ok(WorkerId(99)));
        assert_eq!(pick(&[]), Err(RouteError::NoWorker));
    }

    /// A named worker's weight (the gateway names every worker) hashes its name's 8
    /// little-endian bytes then the key's 8, as it did before the hash was inlined: replicas
    /// of different versions agree, and kv_score's tie-break is the same hash.
    #[test]
    fn a_named_worker_s_weight_hashes_the_name_then_the_key() {
        for (key, name) in [(0u64, 0u64), (1, 7), (0x0123_4567_89ab_cdef, 0xfedc_ba98_7654_3210), (u64::MAX, u64::MAX)]
        {
            let bytes: Vec<u8> = name.to_le_bytes().into_iter().chain(key.to_le_bytes()).collect();
            let mut w = WorkerView::idle(WorkerId(3));
            w.tie_key = Some(name);
            assert_eq!(rendezvous_weight(key, &w), stable_hash(&bytes), "key {key:#x}, name {name:#x}");
            assert_eq!(crate::policy::kv_score::tie_hash_key(name, key), stable_hash(&bytes));
        }
    }
}
