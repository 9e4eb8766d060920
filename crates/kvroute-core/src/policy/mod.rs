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
//! | `cache_aware` | SGLang router cache_aware | [`cache_aware`] |
//! | `prefix_affinity` | Ray Serve PrefixCacheAffinityRouter | [`prefix_affinity`] |
//! | `kv_score` | Cognitora cgn-router linear KV score | [`kv_score`] |
//! | `lmetric`, `load_only`, `sticky`, `unified` | B3 `cache_aware_proxy.py` | [`b3`] (one file per picker) |
//! | `prefill_cost` | kvroute's own: least predicted prefill work ahead | [`prefill_cost`] |
//! | `least_ttft` (the default) | kvroute's own: least predicted TTFT, calibrated online per worker | [`least_ttft`] |

pub mod b3;
pub mod basic;
pub mod cache_aware;
pub mod kv_score;
pub mod least_ttft;
pub mod prefill_cost;
pub mod prefix_affinity;
pub mod util;

use crate::fleet_digest::FleetDigest;
use crate::types::{BlockHash, Nanos, RequestView, WorkerId, WorkerView};
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

/// A retry order: at most [`MAX_FALLBACKS`] worker ids, inline.
pub type Fallbacks = SmallVec<[WorkerId; MAX_FALLBACKS]>;

/// A routing decision: the chosen worker, the policy's own retry order when it has one,
/// and the reason.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Decision {
    /// The chosen worker.
    pub worker: WorkerId,
    /// Other routable candidates in the policy's order of preference, at most
    /// [`MAX_FALLBACKS`], when the policy listed them; empty otherwise. No built-in policy
    /// lists them: a retry takes the routable candidates by load, or the order of
    /// `own_order`, which [`fallbacks`] works out when a retry needs it — not on every
    /// decision, where that pass over the fleet cost as much as a round-robin decision
    /// itself.
    pub fallbacks: Fallbacks,
    /// The policy's own retry order, kept to be worked out over the decision's views when a
    /// retry asks ([`fallbacks`]); `None` for a policy without one (retries by load).
    #[serde(skip)]
    pub own_order: Option<OwnOrder>,
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
    /// Tokens per block when `unit` is [`MatchUnit::Blocks`] (set by [`decide`] from the
    /// request's key); 0 otherwise.
    pub block_tokens: u32,
    /// The request's predicted TTFT on `worker`, for policies that predict one
    /// (`least_ttft`); the front end hands it back in an [`Observation`] with what it
    /// measured, and exports the prediction error.
    pub predicted_ttft: Option<TtftPrediction>,
}

/// A policy's own retry order for one decision (kv_score's: the tie band by its stable
/// hash, then the rest by descending score, as Cognitora cgn-router orders them), kept
/// unworked until a retry asks ([`fallbacks`]).
pub trait RetryOrder: std::fmt::Debug + Send + Sync + std::any::Any {
    /// At most [`MAX_FALLBACKS`] routable workers of `candidates` (the views the decision
    /// read), never `chosen`, in the policy's order.
    fn fallbacks(&self, candidates: &[WorkerView], chosen: WorkerId) -> Fallbacks;

    /// Whether `other` orders from the same facts (what makes two decisions equal: two
    /// copies of a policy deciding alike keep equal orders).
    fn same_as(&self, other: &dyn RetryOrder) -> bool;
}

/// A decision's [`RetryOrder`], shared by the decision's clones; equal when the orders
/// are ([`RetryOrder::same_as`]).
#[derive(Debug, Clone)]
pub struct OwnOrder(pub std::sync::Arc<dyn RetryOrder>);

impl PartialEq for OwnOrder {
    fn eq(&self, other: &Self) -> bool {
        self.0.same_as(other.0.as_ref())
    }
}

/// A policy's prediction of a request's time to first token on the chosen worker.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TtftPrediction {
    /// Predicted TTFT, seconds, with the worker's calibration applied.
    pub secs: f64,
    /// The same prediction before calibration (the policy's prior worker profile), seconds.
    pub uncalibrated_secs: f64,
    /// The request's own attention term before calibration: its uncached tokens times the
    /// tokens each attends to on average (`own × (cached + own / 2)`), over the prior
    /// throughput, token·seconds; the calibration learns its weight per token (0 when the
    /// policy has none).
    pub context_secs: f64,
}

/// What a front end learned about one request on one worker, handed to
/// [`Policy::observe`] once it knows it (at the first token, or when the answer ends).
/// Each field is `None` when the front end did not see it: a non-streamed answer has no
/// TTFT, an engine that reports no cached tokens has no `cached_tokens`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Observation {
    /// Prompt tokens.
    pub input_tokens: u32,
    /// The decision's prediction ([`Decision::predicted_ttft`]).
    pub predicted: Option<TtftPrediction>,
    /// Prompt tokens the decision expected cached ([`Decision::cached_tokens_estimate`]).
    pub predicted_cached_tokens: u64,
    /// Measured time from dispatch to the first token, seconds.
    pub ttft_secs: Option<f64>,
    /// Prompt tokens the engine reported cached (OpenAI
    /// `usage.prompt_tokens_details.cached_tokens`, SGLang `meta_info.cached_tokens`,
    /// llama.cpp `timings.cache_n`, or the simulator's engine).
    pub cached_tokens: Option<u64>,
}

impl Decision {
    /// A decision with no prefix information and no fallbacks yet.
    pub fn new(worker: WorkerId, branch: Branch) -> Self {
        Decision {
            worker,
            fallbacks: SmallVec::new(),
            own_order: None,
            branch,
            matched: 0,
            key_len: 0,
            unit: MatchUnit::None,
            score: None,
            block_tokens: 0,
            predicted_ttft: None,
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

    /// Prompt tokens this decision expects to find cached on [`Decision::worker`], in
    /// `[0, input_tokens]` — the one estimate every front end charges the ledger with:
    /// - tokens: `matched`;
    /// - blocks: `matched × block_tokens` (engines cache whole blocks; a key that covers
    ///   only the prompt's first blocks, as `kv_score`'s does, counts only those);
    /// - chars: the matched share of the routing text applied to `input_tokens` (the
    ///   prompt's real token count when known, rather than a chars-per-token guess).
    pub fn cached_tokens_estimate(&self, input_tokens: u32) -> u64 {
        let input = u64::from(input_tokens);
        let t = match self.unit {
            MatchUnit::None => 0,
            MatchUnit::Tokens => self.matched,
            MatchUnit::Blocks => self.matched.saturating_mul(u64::from(self.block_tokens)),
            MatchUnit::Chars if self.key_len == 0 => 0,
            MatchUnit::Chars => {
                let share = (self.matched as f64 / self.key_len as f64).clamp(0.0, 1.0);
                (share * input as f64) as u64
            }
        };
        t.min(input)
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
    /// `capped`: the request's session already sent its `max_turns` turns (B3
    /// `cache_aware_proxy.py`'s turn-capped workload, run live).
    #[error("this session has had its {max_turns} turns (policy `capped`, knob `max_turns`)")]
    SessionCapped {
        /// The cap.
        max_turns: u32,
    },
}

/// A random source passed into policies (seeded in tests and in the simulator).
pub type Rng<'a> = &'a mut dyn rand_core::Rng;

/// Per-call context: the time, the random source and, when the caller keeps one, the
/// candidates' digest. Nothing else is ambient.
pub struct PickCtx<'a> {
    /// Current time (wall or logical).
    pub now: Nanos,
    /// Random source.
    pub rng: Rng<'a>,
    /// The candidates' [`FleetDigest`], when the caller keeps one beside its views (the
    /// replay does, and the gateway on a request it decides on its kept views): a policy that reads it ([`Policy::fleet_digest`]: least_ttft,
    /// prefill_cost, kv_score, lmetric, capped, unified, cache_aware, prefix_affinity) then reads only the workers that can win, and decides as it
    /// would without it. It must describe the
    /// candidates passed with it ([`FleetDigest::describes`]); one that does not fit them
    /// ([`FleetDigest::usable_for`]) is not read. `None`: every policy reads the views.
    pub fleet: Option<&'a FleetDigest>,
}

impl std::fmt::Debug for PickCtx<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PickCtx")
            .field("now", &self.now)
            .field("fleet", &self.fleet.map(FleetDigest::len))
            .finish_non_exhaustive()
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

/// What a policy derives from a request before deciding — its block hashes at the
/// policy's own block size — computed once per request by [`Policy::key`] and passed to
/// both [`Policy::pick`] and [`Policy::on_routed`] (and to every retry target's commit),
/// so a request is hashed once however many stages read it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestKey {
    /// Chained block hashes of the request's prompt (empty for policies that need none).
    pub blocks: Vec<BlockHash>,
    /// Tokens per block of `blocks` (a trace's own block size when the request carries
    /// precomputed blocks); 0 when `blocks` is empty.
    pub block_tokens: u64,
    /// KV cache capacity, tokens, of the worker this key is committed to
    /// ([`Capacity::kv_tokens`](crate::types::Capacity::kv_tokens) of its view): set by
    /// [`decide`] for the chosen worker; a caller committing the key to another worker (a
    /// retry target) sets that worker's. `None` when the worker does not report it.
    pub worker_kv_tokens: Option<u64>,
}

/// A second copy of a policy, for a router that keeps two so that decisions never wait for
/// a commit (the gateway's `ModelRouter`: a commit updates one copy while decisions read
/// the other, then the other). Implemented for every [`Clone`] policy: the copy has the same
/// state, and shares what a decision may advance (the tie-break [`Rotation`](util::Rotation))
/// and knobs changed through a shared cell ([`Policy::set_live_knobs`]); after that, each
/// copy changes only through the calls the router makes on both.
pub trait Twin {
    /// The copy.
    fn twin(&self) -> Box<dyn Policy>;
}

impl<T: Policy + Clone + 'static> Twin for T {
    fn twin(&self) -> Box<dyn Policy> {
        Box::new(self.clone())
    }
}

/// A routing policy. See the module docs for the contract.
///
/// `candidates` passed to [`Policy::pick`] are the workers serving the request's model and
/// role; the caller guarantees at least one of them is routable, and a policy must never
/// return a worker whose [`WorkerView::is_routable`] is false.
///
/// **Decide, then commit.** [`Policy::pick`] takes `&self`: a decision reads the policy's
/// prefix index and session table and changes neither, so a request refused by admission,
/// a dry run (`POST /debug/route`) or a decision never sent leaves no trace. The only state
/// a pick may advance is a tie-break rotation counter (an atomic), which spreads ties and
/// records nothing about the request. Everything a request teaches the policy happens in
/// [`Policy::on_routed`], called when the request is really sent to a worker.
pub trait Policy: Send + Sync + std::fmt::Debug + Twin {
    /// Registry name (also the metric label).
    fn name(&self) -> &'static str;

    /// The request's key for this policy (block hashes at its block size); called once per
    /// request. The default is an empty key, for policies that match on text or not at all.
    fn key(&self, _req: &RequestView<'_>) -> RequestKey {
        RequestKey::default()
    }

    /// Picks a worker for `req` (whose [`Policy::key`] is `key`). Changes no routing state.
    ///
    /// # Errors
    /// [`RouteError::NoWorker`] when no candidate is routable.
    fn pick(
        &self,
        req: &RequestView<'_>,
        key: &RequestKey,
        candidates: &[WorkerView],
        ctx: &mut PickCtx<'_>,
    ) -> Result<Decision, RouteError>;

    /// Records that `req` was sent to `worker` at `now`: inserts its prefix into the
    /// policy's index and binds its session. Called for the chosen worker and again for
    /// each retry target.
    fn on_routed(&mut self, _req: &RequestView<'_>, _key: &RequestKey, _worker: WorkerId, _now: Nanos) {}

    /// Whether [`Policy::on_routed`] reads the request's own prefix (its text, token ids or
    /// engine blocks, [`util::PrefixKey`]) rather than only [`RequestKey`] and the request's
    /// scalar fields. A router that shares what it routed with other replicas must then
    /// send the prefix itself (cluster sync), not just the key's block hashes.
    fn records_request_prefix(&self) -> bool {
        false
    }

    /// Whether committing a request ([`Policy::on_routed`]) just after the same request was
    /// committed to the same worker records nothing new beyond recency (an LRU position, a
    /// TTL, a session's binding refreshed). The cluster sync then sends such a repeat to
    /// the other replicas as load only, its full event at most every `sync_refresh_secs`.
    /// B3 capped counts every turn of a session: not idempotent.
    fn idempotent_commits(&self) -> bool {
        true
    }

    /// The digest [`Policy::pick`] reads from [`PickCtx::fleet`] when given one, empty:
    /// a caller keeps it beside its views ([`FleetDigest::refresh`],
    /// [`FleetDigest::update`]) only for a policy that returns one. least_ttft and
    /// prefill_cost read the plain digest, kv_score one that also keeps its terms
    /// ([`FleetDigest::with_terms`]); `None` (the default) for a policy that reads none.
    fn fleet_digest(&self) -> Option<FleetDigest> {
        None
    }

    /// A worker left the fleet (removed, or dead after retries): forget all its state
    /// (Ray Serve PrefixCacheAffinityRouter's `on_replica_actor_died`; SGLang router
    /// removes the worker's tenant from its tree).
    fn on_worker_removed(&mut self, _worker: WorkerId) {}

    /// Periodic maintenance (eviction), in a bounded slice: evicts at most `max_evictions`
    /// entries (leaves, blocks) and returns whether more remain over budget, so a front end
    /// can release its lock between slices and no decision waits behind a whole pass. The
    /// front end calls it at least every [`Policy::maintenance_interval`].
    fn maintain(&mut self, _now: Nanos, _max_evictions: usize) -> bool {
        false
    }

    /// How often [`Policy::maintain`] should run; `None` when it need not. Read again
    /// after every knob change (a front end must not cache it).
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

    /// Applies `patch` without `&mut self` when every knob in it is one the policy reads
    /// through a shared cell (an [`arc_swap::ArcSwap`] swapped whole, so a decision sees
    /// the old set or the new one, never a mix): a front end holding the policy behind a
    /// lock then changes them under its read lock, and no decision waits. `None` when the
    /// policy has no such knobs or the patch names another (use [`Policy::set_knobs`]).
    ///
    /// # Errors
    /// `Some(Err(_))`: [`KnobError`] naming the offending knob; nothing changed.
    fn set_live_knobs(&self, _patch: &serde_json::Value) -> Option<Result<(), KnobError>> {
        None
    }

    /// Size of the policy's prefix index in its own units (chars, blocks), for metrics.
    fn index_size(&self) -> u64 {
        0
    }

    /// Learns from what a request routed to `worker` really met (its measured TTFT, the
    /// cached tokens its engine reported): calibrating policies (`least_ttft`) correct
    /// their worker profiles here. Called at most once per dispatched request, after
    /// [`Policy::on_routed`]; the others ignore it.
    fn observe(&mut self, _worker: WorkerId, _obs: &Observation) {}

    /// The worker profiles a calibrating policy has learned, as JSON (for `GET /policy`
    /// and `/debug/route`); `null` for the others.
    fn calibration(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
}

/// The workers a request decided by `d` over `candidates` (the views it was decided on)
/// moves to when its chosen worker fails, in order, at most [`MAX_FALLBACKS`]: the
/// decision's listed fallbacks when its policy listed them, else its policy's own order
/// ([`Decision::own_order`], worked out now over `candidates`), else
/// [`fallbacks_by_load`]. Never the chosen worker; only candidates routable in their views.
pub fn fallbacks(d: &Decision, candidates: &[WorkerView]) -> Fallbacks {
    match &d.own_order {
        _ if !d.fallbacks.is_empty() => d.fallbacks.clone(),
        Some(OwnOrder(order)) => order.fallbacks(candidates, d.worker),
        None => fallbacks_by_load(candidates, d.worker),
    }
}

/// Routable candidates ordered by (load, id): the default fallback order.
pub fn fallbacks_by_load(candidates: &[WorkerView], exclude: WorkerId) -> SmallVec<[WorkerId; MAX_FALLBACKS]> {
    // The MAX_FALLBACKS smallest (load, id) pairs in one pass, without sorting the whole
    // fleet. (load, id) pairs are distinct, so this is exactly the head of the sorted list.
    let routable = candidates.iter().filter(|w| w.is_routable() && w.id != exclude).map(|w| (w.load(), w.id));
    crate::select::smallest_k(routable, MAX_FALLBACKS).into_iter().map(|(_, id)| id).collect()
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
    let base = serde_json::to_value(current).map_err(|e| err(e.to_string()))?;
    let mut merged = base.clone();
    let (Some(obj), Some(p)) = (merged.as_object_mut(), patch.as_object()) else {
        return Err(err("knobs must be a JSON object".into()));
    };
    for (k, v) in p {
        obj.insert(k.clone(), v.clone());
    }
    let next: T = serde_json::from_value(merged).map_err(|e| {
        // serde's message does not name the field (`invalid number` for -5 or 1.5 where a
        // whole number goes): find the knob and say what it must be.
        err(bad_patch_key::<T>(&base, p).map_or_else(|| e.to_string(), |b| format!("{} {}", b.key, b.message)))
    })?;
    validate(&next).map_err(err)?;
    Ok(next)
}

/// A key of a JSON patch whose value does not fit the field it sets ([`bad_patch_key`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadKey {
    /// The key, as given.
    pub key: String,
    /// What its value must be and what it is, starting with a verb: `must be a whole number
    /// from 0 to 4294967295, got 1e9`.
    pub message: String,
}

/// The first key of `patch` (in its order) whose value, set alone on `base` (a `T`
/// serialised as a JSON object), fails to deserialize as a `T`, and what that value must
/// be: a whole number with its range (probed on `T`: 0 to `u8`, `u16`, `u32` or `u64`'s
/// maximum), a number, or `true` or `false` (judged by the key's value in `base`), else
/// serde's own message (a string may be an enum's name or more: its message lists them). serde's message alone names no field: `invalid number` for
/// `-5` or `1.5` where a whole number goes (with `serde_json`'s `arbitrary_precision`,
/// which a dependency of the `kvroute` binary turns on), `invalid type: string "x",
/// expected f64`.
///
/// `None` when `base` is not an object, a key is unknown (serde's `unknown field` message
/// names it already), or every key fits alone.
pub fn bad_patch_key<T: serde::de::DeserializeOwned>(
    base: &serde_json::Value,
    patch: &serde_json::Map<String, serde_json::Value>,
) -> Option<BadKey> {
    let with = |k: &str, v: serde_json::Value| -> Result<T, serde_json::Error> {
        let mut m = base.clone();
        m.as_object_mut().map(|o| o.insert(k.to_owned(), v));
        serde_json::from_value(m)
    };
    base.as_object()?;
    for (k, v) in patch {
        let Err(e) = with(k, v.clone()) else { continue };
        let e = e.to_string();
        if e.starts_with("unknown field") {
            return None;
        }
        let message = match base.get(k) {
            Some(serde_json::Value::Number(n)) if n.is_u64() => {
                let max = [u64::MAX, u32::MAX.into(), u16::MAX.into(), u8::MAX.into()]
                    .into_iter()
                    .find(|&m| with(k, m.into()).is_ok());
                match max {
                    Some(max) => format!("must be a whole number from 0 to {max}, got {v}"),
                    None => format!("must be a whole number, got {v}"),
                }
            }
            Some(serde_json::Value::Number(n)) if n.is_i64() => format!("must be a whole number, got {v}"),
            Some(serde_json::Value::Number(_)) => format!("must be a number, got {v}"),
            Some(serde_json::Value::Bool(_)) => format!("must be true or false, got {v}"),
            _ => format!("is not valid: {e}"),
        };
        return Some(BadKey { key: k.clone(), message });
    }
    None
}

/// Decides for `req` without changing any state ([`Policy::pick`] behind the checks every
/// front end needs): a routable candidate exists and the decision names a routable worker.
/// Returns the decision and the request's key, to be passed to [`commit`] for each worker
/// the request is really sent to; [`fallbacks`] gives the retry order.
///
/// # Errors
/// [`RouteError::NoWorker`] when no candidate is routable.
pub fn decide(
    policy: &dyn Policy,
    req: &RequestView<'_>,
    candidates: &[WorkerView],
    ctx: &mut PickCtx<'_>,
) -> Result<(Decision, RequestKey), RouteError> {
    if !candidates.iter().any(WorkerView::is_routable) {
        return Err(RouteError::NoWorker);
    }
    let mut key = policy.key(req);
    let mut d = policy.pick(req, &key, candidates, ctx)?;
    let mut chosen = routable_view_of(candidates, ctx.fleet, d.worker);
    if chosen.is_none() {
        // A policy bug must not send traffic to a dead worker: fall back to least load.
        let fb = fallbacks_by_load(candidates, WorkerId(u32::MAX));
        d = Decision::new(fb[0], Branch::LeastLoad);
        chosen = candidates.iter().find(|w| w.id == d.worker);
    }
    if d.unit == MatchUnit::Blocks {
        let bt =
            if key.block_tokens > 0 { key.block_tokens } else { req.blocks.map_or(0, |b| u64::from(b.block_tokens)) };
        d.block_tokens = bt.min(u64::from(u32::MAX)) as u32;
    }
    key.worker_kv_tokens = chosen.and_then(|w| w.capacity.kv_tokens);
    Ok((d, key))
}

/// The view of `id` among `candidates` (the first, when ids repeat), found through
/// `fleet`'s positions when it fits them ([`FleetDigest::usable_for`]), else by a pass.
pub(crate) fn view_of<'c>(
    candidates: &'c [WorkerView],
    fleet: Option<&FleetDigest>,
    id: WorkerId,
) -> Option<&'c WorkerView> {
    match fleet.filter(|f| f.usable_for(candidates)) {
        Some(f) => f.position(id).and_then(|p| candidates.get(p)).filter(|w| w.id == id),
        None => candidates.iter().find(|w| w.id == id),
    }
}

/// The first routable view of `id` among `candidates`, found as [`view_of`] finds it (ids
/// are unique when the digest fits, so its position of the id is the first).
pub(crate) fn routable_view_of<'c>(
    candidates: &'c [WorkerView],
    fleet: Option<&FleetDigest>,
    id: WorkerId,
) -> Option<&'c WorkerView> {
    match fleet.filter(|f| f.usable_for(candidates)) {
        Some(f) => f.position(id).and_then(|p| candidates.get(p)).filter(|w| w.id == id && w.is_routable()),
        None => candidates.iter().find(|w| w.id == id && w.is_routable()),
    }
}

/// Commits a decision: records that `req` (with the `key` [`decide`] returned) was sent to
/// `worker` at `now`. Call it when the request is written to a worker — the chosen one, and
/// again for each retry target.
pub fn commit(policy: &mut dyn Policy, req: &RequestView<'_>, key: &RequestKey, worker: WorkerId, now: Nanos) {
    policy.on_routed(req, key, worker, now);
}

/// Records that `req` was sent to `worker` without a decision (its key computed here): for
/// tests and for state carried over from elsewhere.
pub fn record_routed(policy: &mut dyn Policy, req: &RequestView<'_>, worker: WorkerId, now: Nanos) {
    let key = policy.key(req);
    policy.on_routed(req, &key, worker, now);
}

/// [`decide`] then [`commit`] to the chosen worker at `ctx.now`: for front ends that send
/// every decision at once (the replay simulator, tests).
///
/// # Errors
/// [`RouteError::NoWorker`] when no candidate is routable.
pub fn route(
    policy: &mut dyn Policy,
    req: &RequestView<'_>,
    candidates: &[WorkerView],
    ctx: &mut PickCtx<'_>,
) -> Result<Decision, RouteError> {
    let (d, key) = decide(policy, req, candidates, ctx)?;
    commit(policy, req, &key, d.worker, ctx.now);
    Ok(d)
}
