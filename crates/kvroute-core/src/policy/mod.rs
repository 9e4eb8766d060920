//! The [`Policy`] trait, routing [`Decision`]s and the policies themselves, one module each.
//!
//! A policy is a deterministic state machine: given a request view, the candidate worker
//! views, the time and a random source, it picks a worker and explains why. It owns its
//! own prefix state (trees, block sets, affinity tables) and updates it in
//! [`Policy::on_routed`]. It performs no I/O and reads no clock, so the same code runs in
//! the gateway (wall clock) and in the replay simulator (logical clock).
//!
//! | name | source | module |
//! |---|---|---|
//! | `round_robin`, `random`, `least_load`, `power_of_two`, `consistent_hash` | classic baselines | [`basic`] |
//! | `cache_aware` | seed 003, SGLang router | [`cache_aware`] |
//! | `prefix_affinity` | seed 000, Ray Serve PrefixCacheAffinityRouter | [`prefix_affinity`] |
//! | `kv_score` | seed 001, cgn-router linear score | [`kv_score`] |
//! | `lmetric`, `load_only`, `sticky`, `unified` | seed 002, B3 cache_aware_proxy | [`b3`] |
//! | `prefill_cost` | kvroute's own: least predicted prefill work ahead | [`prefill_cost`] |

pub mod b3;
pub mod basic;
pub mod cache_aware;
pub mod kv_score;
pub mod prefill_cost;
pub mod prefix_affinity;
pub mod util;

use crate::types::{Nanos, RequestView, WorkerId, WorkerView};
use serde::Serialize;
use smallvec::SmallVec;

/// Why a policy chose its worker: one label per decision branch, used in metrics and in
/// the `x-kvroute-decision` response header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Branch {
    /// Rotation over the candidates.
    RoundRobin,
    /// Uniform random choice.
    Random,
    /// Least-loaded candidate.
    LeastLoad,
    /// Power of Two Choices: the less loaded of two random candidates.
    PowerOfTwo,
    /// Consistent hashing of the session (or prefix) key.
    ConsistentHash,
    /// Load was imbalanced: the prefix was ignored and load decided.
    Imbalanced,
    /// Match rate at or above the threshold: the worker holding the longest prefix.
    HighMatch,
    /// Match rate below the threshold: the worker with the smallest prefix state.
    LowMatch,
    /// The request had no routing key, or the index knew nothing of it.
    NoPrefix,
    /// The best scores were tied (within epsilon): a stable tie-break decided.
    TieBreak,
    /// The best score won outright.
    Score,
    /// A session binding was kept.
    Sticky,
    /// A new session binding was made.
    NewBinding,
    /// A session binding was broken (cold cache or overloaded worker) and scoring decided.
    AffinityBroken,
}

impl Branch {
    /// snake_case label.
    pub const fn as_str(self) -> &'static str {
        match self {
            Branch::RoundRobin => "round_robin",
            Branch::Random => "random",
            Branch::LeastLoad => "least_load",
            Branch::PowerOfTwo => "power_of_two",
            Branch::ConsistentHash => "consistent_hash",
            Branch::Imbalanced => "imbalanced",
            Branch::HighMatch => "high_match",
            Branch::LowMatch => "low_match",
            Branch::NoPrefix => "no_prefix",
            Branch::TieBreak => "tie_break",
            Branch::Score => "score",
            Branch::Sticky => "sticky",
            Branch::NewBinding => "new_binding",
            Branch::AffinityBroken => "affinity_broken",
        }
    }
}

/// Unit of [`Decision::matched`] and [`Decision::key_len`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum MatchUnit {
    /// No prefix key was used.
    #[default]
    None,
    /// UTF-8 bytes of routing text (equal to characters for ASCII).
    Chars,
    /// Token ids.
    Tokens,
    /// Blocks (chained block hashes).
    Blocks,
}

/// Maximum number of fallbacks a decision carries (bounded retries).
pub const MAX_FALLBACKS: usize = 8;

/// A routing decision: the chosen worker, ordered fallbacks for retries, and the reason.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Decision {
    /// The chosen worker.
    pub worker: WorkerId,
    /// Other routable candidates in order of preference, at most [`MAX_FALLBACKS`].
    pub fallbacks: SmallVec<[WorkerId; MAX_FALLBACKS]>,
    /// The branch that decided.
    pub branch: Branch,
    /// Length of the prefix matched on `worker`, in `unit`s (0 when none).
    pub matched: u64,
    /// Length of the request's routing key, in `unit`s.
    pub key_len: u64,
    /// Unit of `matched` and `key_len`.
    pub unit: MatchUnit,
    /// The winning score, for scoring policies.
    pub score: Option<f64>,
}

impl Decision {
    /// A decision with no prefix information and no fallbacks yet.
    pub fn new(worker: WorkerId, branch: Branch) -> Self {
        Decision {
            worker,
            fallbacks: SmallVec::new(),
            branch,
            matched: 0,
            key_len: 0,
            unit: MatchUnit::None,
            score: None,
        }
    }

    /// Sets the matched and key lengths.
    pub fn with_match(mut self, matched: u64, key_len: u64, unit: MatchUnit) -> Self {
        self.matched = matched;
        self.key_len = key_len;
        self.unit = unit;
        self
    }

    /// Sets the score.
    pub fn with_score(mut self, score: f64) -> Self {
        self.score = Some(score);
        self
    }

    /// `matched / key_len` in [0, 1] (0 when the key is empty).
    pub fn match_rate(&self) -> f64 {
        if self.key_len == 0 { 0.0 } else { self.matched as f64 / self.key_len as f64 }
    }
}

/// Why no worker could be picked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// No candidate worker is routable (all unhealthy, draining, or none serve the model).
    #[error("no healthy worker available")]
    NoWorker,
}

/// A random source passed into policies (seeded in tests and in the simulator).
pub type Rng<'a> = &'a mut dyn rand_core::Rng;

/// Per-call context: the time and the random source. Nothing else is ambient.
pub struct PickCtx<'a> {
    /// Current time (wall or logical).
    pub now: Nanos,
    /// Random source.
    pub rng: Rng<'a>,
}

impl std::fmt::Debug for PickCtx<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PickCtx").field("now", &self.now).finish_non_exhaustive()
    }
}

/// An error setting a policy's knobs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid knobs for policy `{policy}`: {message}")]
pub struct KnobError {
    /// Policy name.
    pub policy: &'static str,
    /// What was wrong, naming the knob.
    pub message: String,
}

/// A routing policy. See the module docs for the contract.
///
/// `candidates` passed to [`Policy::pick`] are the workers serving the request's model and
/// role; the caller guarantees at least one of them is routable, and a policy must never
/// return a worker whose [`WorkerView::is_routable`] is false.
pub trait Policy: Send + Sync + std::fmt::Debug {
    /// Registry name (also the metric label).
    fn name(&self) -> &'static str;

    /// Picks a worker. Must not mutate prefix state (that is [`Policy::on_routed`]'s job)
    /// except bookkeeping such as rotation counters and session bindings.
    ///
    /// # Errors
    /// [`RouteError::NoWorker`] when no candidate is routable.
    fn pick(
        &mut self,
        req: &RequestView<'_>,
        candidates: &[WorkerView],
        ctx: &mut PickCtx<'_>,
    ) -> Result<Decision, RouteError>;

    /// Records that `req` was sent to `worker` at `now` (inserts its prefix into the
    /// policy's index). Called for the chosen worker and again for each retry target.
    fn on_routed(&mut self, _req: &RequestView<'_>, _worker: WorkerId, _now: Nanos) {}

    /// A worker left the fleet (removed, or dead after retries): forget all its state
    /// (seed 000's `on_replica_actor_died`, seed 003's "removed from the tree").
    fn on_worker_removed(&mut self, _worker: WorkerId) {}

    /// Periodic maintenance (eviction). The front end calls it at least every
    /// [`Policy::maintenance_interval`].
    fn maintain(&mut self, _now: Nanos) {}

    /// How often [`Policy::maintain`] should run; `None` when it need not.
    fn maintenance_interval(&self) -> Option<Nanos> {
        None
    }

    /// Current knob values as JSON (an object).
    fn knobs(&self) -> serde_json::Value;

    /// Replaces some knob values live. Unknown knobs and out-of-range values are errors and
    /// leave the policy unchanged.
    ///
    /// # Errors
    /// [`KnobError`] naming the offending knob.
    fn set_knobs(&mut self, patch: &serde_json::Value) -> Result<(), KnobError>;

    /// Size of the policy's prefix index in its own units (chars, blocks), for metrics.
    fn index_size(&self) -> u64 {
        0
    }
}

/// Routable candidates ordered by (load, id): the default fallback order.
pub fn fallbacks_by_load(candidates: &[WorkerView], exclude: WorkerId) -> SmallVec<[WorkerId; MAX_FALLBACKS]> {
    let mut v: SmallVec<[(u32, WorkerId); 16]> =
        candidates.iter().filter(|w| w.is_routable() && w.id != exclude).map(|w| (w.load(), w.id)).collect();
    v.sort_unstable();
    v.into_iter().take(MAX_FALLBACKS).map(|(_, id)| id).collect()
}

/// Applies a JSON patch of knobs onto a serde config struct, field by field, rejecting
/// unknown fields (`deny_unknown_fields` on `T`) and running `validate` on the result.
///
/// # Errors
/// [`KnobError`] naming the bad field or the failed validation.
pub fn patch_knobs<T>(
    policy: &'static str,
    current: &T,
    patch: &serde_json::Value,
    validate: impl Fn(&T) -> Result<(), String>,
) -> Result<T, KnobError>
where
    T: Serialize + serde::de::DeserializeOwned,
{
    let err = |message: String| KnobError { policy, message };
    let mut merged = serde_json::to_value(current).map_err(|e| err(e.to_string()))?;
    let (Some(obj), Some(p)) = (merged.as_object_mut(), patch.as_object()) else {
        return Err(err("knobs must be a JSON object".into()));
    };
    for (k, v) in p {
        obj.insert(k.clone(), v.clone());
    }
    let next: T = serde_json::from_value(merged).map_err(|e| err(e.to_string()))?;
    validate(&next).map_err(err)?;
    Ok(next)
}

/// The one routing entry point every front end uses: checks that a routable candidate
/// exists, asks the policy, guarantees the decision names a routable worker and carries
/// load-ordered fallbacks, and records the decision in the policy's index
/// ([`Policy::on_routed`]).
///
/// # Errors
/// [`RouteError::NoWorker`] when no candidate is routable.
pub fn route(
    policy: &mut dyn Policy,
    req: &RequestView<'_>,
    candidates: &[WorkerView],
    ctx: &mut PickCtx<'_>,
) -> Result<Decision, RouteError> {
    if !candidates.iter().any(WorkerView::is_routable) {
        return Err(RouteError::NoWorker);
    }
    let mut d = policy.pick(req, candidates, ctx)?;
    let chosen_ok = candidates.iter().any(|w| w.id == d.worker && w.is_routable());
    if !chosen_ok {
        // A policy bug must not send traffic to a dead worker: fall back to least load.
        let fb = fallbacks_by_load(candidates, WorkerId(u32::MAX));
        d = Decision::new(fb[0], Branch::LeastLoad);
    }
    if d.fallbacks.is_empty() {
        d.fallbacks = fallbacks_by_load(candidates, d.worker);
    }
    policy.on_routed(req, d.worker, ctx.now);
    Ok(d)
}
