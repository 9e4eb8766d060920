//! One router per model, each with its own policy state, so one model's traffic never
//! waits on another's (SGLang router keeps a tree per model the same way).
//!
//! **Decisions never wait for a commit.** Each router keeps its policy in two copies
//! ([`Twin`]; `policy_copies`, default 2): a writer (a commit, an observation, a
//! maintenance slice, a knob change) updates both in turn while a decision
//! ([`ModelRouter::decide`]) reads whichever no writer holds. With one copy, every decision
//! behind a writer the OS descheduled waited a time slice
//! (docs/lab/2026-11-26-decision-tail-under-eviction.md). What a decision may advance (the
//! tie-break rotation) and live knobs are shared by the two copies
//! ([`kvroute_core::policy::Twin`]). Eviction runs in slices of [`EVICTION_SLICE`]
//! entries, releasing the copies between slices.

use crate::twin::Twin;
use arc_swap::ArcSwap;
use kvroute_core::policy::{Decision, KnobError, Observation, PickCtx, Policy, RequestKey, RouteError, commit, decide};
use kvroute_core::types::{Nanos, RequestView, WorkerId, WorkerView};
use parking_lot::Mutex;
use rand_core::SeedableRng;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Entries (tree leaves, blocks) one maintenance slice evicts before releasing the lock.
pub const EVICTION_SLICE: usize = 1024;

/// Most distinct models the gateway keeps a router for; requests for further models share
/// the catch-all router (`*`).
pub const MAX_MODEL_ROUTERS: usize = 256;

/// The router of one model.
#[derive(Debug)]
pub struct ModelRouter {
    /// The registry name of the policy it runs (`kvroute policies`).
    pub policy_name: Arc<str>,
    /// Whether its policy records the request's own prefix ([`Policy::records_request_prefix`]):
    /// the cluster sync then carries the prompt's prefix, else only the key's block hashes.
    pub records_request_prefix: bool,
    /// Whether its policy's commits are idempotent ([`Policy::idempotent_commits`]): the
    /// cluster sync may then send a repeated request as load only.
    pub idempotent_commits: bool,
    /// Whether its policy learns from observations ([`Policy::calibration`] is not null):
    /// only then does [`ModelRouter::observe`] take the write lock.
    calibrates: bool,
    policy: Twin<Box<dyn Policy>>,
    /// When its next maintenance is due (gateway clock, ns; `u64::MAX` when never).
    next_maintain: AtomicU64,
    /// This router's number in the process (views kept for its policy name it).
    id: u64,
    /// An empty digest of its policy's kind ([`Policy::fleet_digest`]; the kind does not
    /// change with knobs), or a plain one for a policy that reads none (kept views still
    /// spare its decisions a read of every worker).
    digest: kvroute_core::fleet_digest::FleetDigest,
}

/// The next [`ModelRouter`]'s number.
static NEXT_ROUTER: AtomicU64 = AtomicU64::new(0);

impl ModelRouter {
    fn new(name: &str, policy: Box<dyn Policy>, copies: usize, now: Nanos) -> Self {
        let second = (copies >= 2).then(|| policy.twin());
        let next = policy.maintenance_interval().map_or(u64::MAX, |i| now.saturating_add(i).0);
        ModelRouter {
            policy_name: name.into(),
            records_request_prefix: policy.records_request_prefix(),
            idempotent_commits: policy.idempotent_commits(),
            calibrates: !policy.calibration().is_null(),
            id: NEXT_ROUTER.fetch_add(1, Relaxed),
            digest: policy.fleet_digest().unwrap_or_default(),
            policy: Twin::new(policy, second),
            next_maintain: AtomicU64::new(next),
        }
    }

    /// This router's number in the process and an empty digest of its policy's kind
    /// ([`Policy::fleet_digest`]; a plain one for a policy that reads none): what keeping
    /// views between its decisions needs ([`crate::fleet::Fleet::decide_kept`]).
    pub fn kept_digest(&self) -> (u64, &kvroute_core::fleet_digest::FleetDigest) {
        (self.id, &self.digest)
    }

    /// Decides (pure: no index, session table or counter changes).
    ///
    /// # Errors
    /// [`RouteError::NoWorker`] when no candidate is routable.
    pub fn decide(
        &self,
        req: &RequestView<'_>,
        candidates: &[WorkerView],
        ctx: &mut PickCtx<'_>,
    ) -> Result<(Decision, RequestKey), RouteError> {
        decide(self.policy.read().as_ref(), req, candidates, ctx)
    }

    /// [`ModelRouter::decide`], and how long it waited for a copy of the policy, seconds
    /// (with one copy, a commit, an observation or an eviction slice holding it; a holder
    /// the OS descheduled makes the wait long. With two, only a retry when a writer moved
    /// between the copies).
    ///
    /// # Errors
    /// As [`ModelRouter::decide`].
    pub fn decide_timed(
        &self,
        req: &RequestView<'_>,
        candidates: &[WorkerView],
        ctx: &mut PickCtx<'_>,
    ) -> (Result<(Decision, RequestKey), RouteError>, f64) {
        let t0 = std::time::Instant::now();
        let policy = self.policy.read();
        let waited = t0.elapsed().as_secs_f64();
        (decide(policy.as_ref(), req, candidates, ctx), waited)
    }

    /// Records that `req` was sent to `worker`.
    pub fn commit(&self, req: &RequestView<'_>, key: &RequestKey, worker: WorkerId, now: Nanos) {
        self.policy.write(|p| commit(p.as_mut(), req, key, worker, now));
    }

    /// [`ModelRouter::commit`] if no other writer is at work now; `false` (nothing
    /// recorded) else. For work that can wait, such as other replicas' routing events: it
    /// never queues behind this replica's own commits (with one copy, a writer queued for
    /// the lock would also hold up every decision arriving after it).
    pub fn try_commit(&self, req: &RequestView<'_>, key: &RequestKey, worker: WorkerId, now: Nanos) -> bool {
        self.policy.try_write(|p| commit(p.as_mut(), req, key, worker, now)).is_some()
    }

    /// Hands what a request routed to `worker` met back to the policy
    /// ([`Policy::observe`]), a writer for the length of one profile update; nothing for a
    /// policy that does not calibrate.
    pub fn observe(&self, worker: WorkerId, obs: &Observation) {
        if self.calibrates {
            self.policy.write(|p| p.observe(worker, obs));
        }
    }

    /// What the policy has learned of each worker ([`Policy::calibration`]; `null` for a
    /// policy that does not calibrate).
    pub fn calibration(&self) -> serde_json::Value {
        self.policy.read().calibration()
    }

    /// Size of the policy's prefix index.
    pub fn index_size(&self) -> u64 {
        self.policy.read().index_size()
    }

    /// Runs maintenance when it is due, in bounded slices. The interval is read from the
    /// policy each time, so a knob change (e.g. turning `do_eviction` on, or a new
    /// `eviction_interval_secs`) takes effect at the next tick.
    pub fn maintain_if_due(&self, now: Nanos) {
        if now.0 < self.next_maintain.load(Relaxed) {
            return;
        }
        while self.policy.write(|p| p.maintain(now, EVICTION_SLICE)) {
            std::thread::yield_now();
        }
        let next = self.policy.read().maintenance_interval().map_or(u64::MAX, |i| now.saturating_add(i).0);
        self.next_maintain.store(next, Relaxed);
    }

    /// Re-reads the maintenance interval after a knob change: due at `now` + the new
    /// interval (or never), replacing the old schedule.
    fn reschedule(&self, now: Nanos) {
        let next = self.policy.read().maintenance_interval().map_or(u64::MAX, |i| now.saturating_add(i).0);
        self.next_maintain.store(next, Relaxed);
    }
}

/// Every model's router, built on first sight of a model from the live policy setting.
#[derive(Debug)]
pub struct Routers {
    map: ArcSwap<HashMap<String, Arc<ModelRouter>>>,
    /// Serialises adding routers and changing the policy (never on the request path once a
    /// model's router exists).
    writer: Mutex<()>,
    /// The live policy: name and knobs every model's router runs.
    setting: ArcSwap<(String, serde_json::Value)>,
    seed: u64,
    /// Copies of each model's policy (1 or 2; see the module docs).
    copies: usize,
    decisions: AtomicU64,
}

impl Routers {
    /// Routers running `policy` with `knobs`, each model's policy kept in `copies` copies
    /// (2: decisions never wait for a commit; 1: half the memory; anything else counts as 2).
    ///
    /// # Errors
    /// An unknown policy or invalid knobs.
    pub fn new(policy: &str, knobs: serde_json::Value, seed: u64, copies: usize) -> anyhow::Result<Self> {
        kvroute_core::registry::build(policy, &knobs)?;
        Ok(Routers {
            map: ArcSwap::from_pointee(HashMap::new()),
            writer: Mutex::new(()),
            setting: ArcSwap::from_pointee((policy.to_string(), knobs)),
            seed,
            copies: if copies == 1 { 1 } else { 2 },
            decisions: AtomicU64::new(0),
        })
    }

    /// The live policy's name.
    pub fn policy_name(&self) -> String {
        self.setting.load().0.clone()
    }

    /// The router of `model` (created on first use; at most [`MAX_MODEL_ROUTERS`], then
    /// the catch-all `*`).
    pub fn get(&self, model: &str, now: Nanos) -> Arc<ModelRouter> {
        if let Some(r) = self.map.load().get(model) {
            return Arc::clone(r);
        }
        let _w = self.writer.lock();
        let cur = self.map.load_full();
        if let Some(r) = cur.get(model) {
            return Arc::clone(r);
        }
        let key = if cur.len() >= MAX_MODEL_ROUTERS { "*" } else { model };
        if let Some(r) = cur.get(key) {
            return Arc::clone(r);
        }
        let setting = self.setting.load();
        // The setting was validated when it was stored, so building cannot fail; a round
        // robin stands in should it ever do.
        let policy = kvroute_core::registry::build(&setting.0, &setting.1)
            .unwrap_or_else(|_| Box::new(kvroute_core::policy::basic::RoundRobin::default()));
        let r = Arc::new(ModelRouter::new(&setting.0, policy, self.copies, now));
        let mut next = cur.as_ref().clone();
        next.insert(key.to_string(), Arc::clone(&r));
        self.map.store(Arc::new(next));
        r
    }

    /// A seeded random source for one decision (the decision counter mixed into the
    /// configured seed: reproducible for a sequential run, independent across requests).
    pub fn rng(&self) -> rand_xoshiro::Xoshiro256PlusPlus {
        let n = self.decisions.fetch_add(1, Relaxed);
        rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(self.seed ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }

    /// Every model's router.
    pub fn all(&self) -> Vec<Arc<ModelRouter>> {
        self.map.load().values().cloned().collect()
    }

    /// Forgets `worker` in every model's router.
    pub fn worker_removed(&self, worker: WorkerId) {
        for r in self.all() {
            r.policy.write(|p| p.on_worker_removed(worker));
        }
    }

    /// What each model's policy has learned of its workers ([`ModelRouter::calibration`]),
    /// by model, for the models whose policy calibrates.
    pub fn calibration(&self) -> Vec<(String, serde_json::Value)> {
        let mut v: Vec<(String, serde_json::Value)> =
            self.map.load().iter().map(|(m, r)| (m.clone(), r.calibration())).filter(|(_, c)| !c.is_null()).collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// Summed index size over the models.
    pub fn index_size(&self) -> u64 {
        self.all().iter().map(|r| r.index_size()).sum()
    }

    /// The live policy's knobs.
    pub fn knobs(&self) -> serde_json::Value {
        let setting = self.setting.load();
        match self.all().first() {
            Some(r) => r.policy.read().knobs(),
            None => kvroute_core::registry::build(&setting.0, &setting.1).map(|p| p.knobs()).unwrap_or_default(),
        }
    }

    /// Patches the live policy's knobs in every model's router: knobs the policy swaps
    /// through a shared cell ([`Policy::set_live_knobs`], kv_score's weights) under each
    /// router's read lock, so no decision waits; others under each one's write lock in
    /// turn (the other models keep routing). Validated first against a fresh policy, so an
    /// invalid patch changes nothing anywhere.
    ///
    /// # Errors
    /// [`KnobError`] naming the bad knob.
    pub fn set_knobs(&self, patch: &serde_json::Value, now: Nanos) -> Result<serde_json::Value, KnobError> {
        let _w = self.writer.lock();
        let setting = self.setting.load_full();
        let mut probe = kvroute_core::registry::build(&setting.0, &setting.1)
            .map_err(|e| KnobError { policy: "?", message: e.to_string() })?;
        probe.set_knobs(patch)?;
        let knobs = probe.knobs();
        // Knobs the policy reads through a shared cell (kv_score's weights) change under the
        // read lock: decisions go on meanwhile. Others take each model's write lock in turn.
        let live = probe.set_live_knobs(patch).is_some();
        for r in self.all() {
            let shared = if live { r.policy.read().set_live_knobs(patch) } else { None };
            let res = match shared {
                Some(res) => res,
                None => r.policy.write(|p| p.set_knobs(patch)),
            };
            res?;
            r.reschedule(now);
        }
        self.setting.store(Arc::new((setting.0.clone(), knobs.clone())));
        Ok(knobs)
    }

    /// Switches every model to `policy` with `knobs` (validated first: an unknown policy
    /// or a bad knob changes nothing). Each model's router is replaced by a fresh one, so
    /// the new policy starts with an empty prefix index; requests already deciding finish
    /// on the old router. Switching to the running policy only patches its knobs
    /// ([`Routers::set_knobs`]) and keeps the index.
    ///
    /// # Errors
    /// The registry's message for an unknown policy or invalid knobs.
    pub fn set_policy(&self, policy: &str, knobs: &serde_json::Value, now: Nanos) -> anyhow::Result<serde_json::Value> {
        if policy == self.setting.load().0 {
            return Ok(self.set_knobs(knobs, now)?);
        }
        let _w = self.writer.lock();
        let probe = kvroute_core::registry::build(policy, knobs)?;
        let full = probe.knobs();
        let cur = self.map.load_full();
        let mut next = HashMap::with_capacity(cur.len());
        for model in cur.keys() {
            let p = kvroute_core::registry::build(policy, knobs)?;
            next.insert(model.clone(), Arc::new(ModelRouter::new(policy, p, self.copies, now)));
        }
        self.setting.store(Arc::new((policy.to_string(), full.clone())));
        self.map.store(Arc::new(next));
        Ok(full)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_score_weights_change_while_a_decision_holds_the_policy() {
        let routers = Routers::new("kv_score", serde_json::Value::Null, 1, 2).expect("routers");
        let r = routers.get("m", Nanos::ZERO);
        // A decision in flight holds the read lock; a weight change must not wait for it
        // (it would wait for ever here: the same thread holds the guard).
        let deciding = r.policy.read();
        let knobs = routers.set_knobs(&serde_json::json!({"w_kv": 0.7, "epsilon": 0.02}), Nanos::ZERO).expect("valid");
        assert_eq!((knobs["w_kv"].as_f64(), knobs["epsilon"].as_f64()), (Some(0.7), Some(0.02)));
        assert_eq!(deciding.knobs()["w_kv"].as_f64(), Some(0.7), "the router in use sees the new weights");
        drop(deciding);
        // Another knob takes the write lock (and works once no decision holds the policy).
        routers.set_knobs(&serde_json::json!({"ttl_secs": 30.0}), Nanos::ZERO).expect("valid");
        assert_eq!(r.policy.read().knobs()["ttl_secs"].as_f64(), Some(30.0));
        assert_eq!(r.policy.read().knobs()["w_kv"].as_f64(), Some(0.7), "the weights survive a full patch");
    }

    #[test]
    fn a_decision_reads_the_other_copy_while_a_writer_holds_one() {
        use kvroute_core::policy::PickCtx;
        let routers = Routers::new("cache_aware", serde_json::Value::Null, 1, 2).expect("routers");
        let r = routers.get("m", Nanos::ZERO);
        let fleet = [WorkerView::idle(WorkerId(0)), WorkerView::idle(WorkerId(1))];
        let req = RequestView::from_text("m", "a long shared system prompt, then the question");
        let mut rng = routers.rng();
        let (_, key) =
            r.decide(&req, &fleet, &mut PickCtx { now: Nanos::ZERO, rng: &mut rng, fleet: None }).expect("decides");
        r.commit(&req, &key, WorkerId(1), Nanos::ZERO);
        // A writer the OS descheduled while it holds one copy (either one): a decision on the
        // same thread would wait for ever with one copy; it reads the other, which has the
        // commit too.
        for held in 0..2 {
            let _writer = r.policy.hold(held);
            let (d, _) =
                r.decide(&req, &fleet, &mut PickCtx { now: Nanos::ZERO, rng: &mut rng, fleet: None }).expect("decides");
            assert_eq!(d.worker, WorkerId(1), "the committed prefix leads the decision (copy {held} held)");
            assert!(!r.try_commit(&req, &key, WorkerId(0), Nanos::ZERO), "another writer at work: nothing recorded");
        }
        // One copy: the same state, read from its only copy.
        let single = Routers::new("cache_aware", serde_json::Value::Null, 1, 1).expect("routers");
        let r1 = single.get("m", Nanos::ZERO);
        assert_eq!(r1.policy.copies(), 1);
        r1.commit(&req, &key, WorkerId(1), Nanos::ZERO);
        let (d, _) =
            r1.decide(&req, &fleet, &mut PickCtx { now: Nanos::ZERO, rng: &mut rng, fleet: None }).expect("decides");
        assert_eq!(d.worker, WorkerId(1));
    }
}
