//! `prefix_affinity`: Ray Serve's PrefixCacheAffinityRouter (Ray Serve LLM,
//! "PrefixCacheAffinityRouter for LLM inference optimization").
//!
//! 1. **Load balance check**: if the highest minus the lowest queue length
//!    ([`WorkerView::load`]) exceeds `imbalanced_threshold`, load wins: Power of Two
//!    Choices over all candidates. Branch `imbalanced`.
//! 2. **Prefix matching** (balanced): match the prompt in the multi-tenant prefix tree;
//!    match rate = matched chars / prompt chars.
//!    - rate `≥ match_rate_threshold`: the candidate set narrows to the replicas holding the
//!      highest match. Branch `high_match`;
//!    - rate `< match_rate_threshold`: it narrows to the replicas with the smallest prefix
//!      state (smallest tenants: least KV-cache utilisation), to increase utilisation.
//!      Branch `low_match`;
//!    - no prefix data (no key): Power of Two Choices over all. Branch `no_prefix`.
//!
//!    A replica that publishes KV events ([`WorkerView::cached_tokens`] set) is matched by
//!    the engine's cached tokens / prompt tokens instead of the tree ([`BestMatch`]).
//! 3. Power of Two Choices then picks within the narrowed set (Ray's router extends
//!    `PowerOfTwoChoicesRequestRouter` and falls back to it).
//!
//! The prompt is inserted for the chosen replica (Ray's `on_request_routed`); a dead
//! replica's tenant is removed (`on_replica_actor_died`). With `do_eviction`, every
//! `eviction_interval_secs` the tree is cut back to `eviction_target_chars` once it
//! exceeds `eviction_threshold_chars` (LRU leaves first).
//!
//! | knob | default | unit |
//! |---|---|---|
//! | `imbalanced_threshold` | 10 | requests (queue length difference) |
//! | `match_rate_threshold` | 0.1 | match rate, 0.0–1.0 |
//! | `do_eviction` | false | — |
//! | `eviction_threshold_chars` | 400,000 | chars (symbols) |
//! | `eviction_target_chars` | 360,000 | chars (symbols) |
//! | `eviction_interval_secs` | 10 | seconds, 0.001–10^7 |

use crate::fleet_digest::FleetDigest;
use crate::policy::util::{
    BestMatch, FleetScan, PrefixKey, PrefixTrees, fewest_symbols, power_of_two, power_of_two_all, power_of_two_at,
    power_of_two_routable,
};
use crate::policy::{Branch, Decision, KnobError, PickCtx, Policy, RequestKey, RouteError, patch_knobs};
use crate::types::{Nanos, RequestView, WorkerId, WorkerView};
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

/// Knobs of `prefix_affinity` (defaults from Ray Serve PrefixCacheAffinityRouter).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PrefixAffinityConfig {
    /// Queue-length difference above which load is imbalanced.
    pub imbalanced_threshold: u32,
    /// Minimum match rate to route by prefix.
    pub match_rate_threshold: f64,
    /// Whether to evict old tree entries.
    pub do_eviction: bool,
    /// Tree size (chars) that triggers eviction.
    pub eviction_threshold_chars: usize,
    /// Tree size (chars) eviction cuts back to.
    pub eviction_target_chars: usize,
    /// Seconds between eviction checks.
    pub eviction_interval_secs: f64,
}

impl Default for PrefixAffinityConfig {
    fn default() -> Self {
        PrefixAffinityConfig {
            imbalanced_threshold: 10,
            match_rate_threshold: 0.1,
            do_eviction: false,
            eviction_threshold_chars: 400_000,
            eviction_target_chars: 360_000,
            eviction_interval_secs: 10.0,
        }
    }
}

impl PrefixAffinityConfig {
    /// Checks ranges.
    ///
    /// # Errors
    /// A message naming the knob out of range.
    pub fn validate(&self) -> Result<(), String> {
        if !(0.0..=1.0).contains(&self.match_rate_threshold) {
            return Err(format!("match_rate_threshold must be in [0, 1], got {}", self.match_rate_threshold));
        }
        if self.eviction_target_chars > self.eviction_threshold_chars {
            return Err("eviction_target_chars must not exceed eviction_threshold_chars".into());
        }
        crate::policy::util::check_eviction_interval(self.eviction_interval_secs)?;
        Ok(())
    }
}

/// The workers a decision draws its two from (Power of Two Choices).
enum Draw {
    /// Every routable candidate.
    Routable,
    /// These, by id.
    Ids(SmallVec<[WorkerId; 16]>),
    /// The candidates at these positions.
    At(SmallVec<[u32; 8]>),
}

/// The `prefix_affinity` policy.
#[derive(Debug, Default, Clone)]
pub struct PrefixAffinity {
    cfg: PrefixAffinityConfig,
    trees: PrefixTrees,
    /// An eviction pass is under way (over the threshold, not yet down to the target).
    evicting: bool,
}

impl PrefixAffinity {
    /// A policy with `cfg` (validate it first).
    pub fn new(cfg: PrefixAffinityConfig) -> Self {
        PrefixAffinity { cfg, trees: PrefixTrees::default(), evicting: false }
    }
}

impl Policy for PrefixAffinity {
    fn name(&self) -> &'static str {
        "prefix_affinity"
    }

    fn pick(
        &self,
        req: &RequestView<'_>,
        _: &RequestKey,
        c: &[WorkerView],
        ctx: &mut PickCtx<'_>,
    ) -> Result<Decision, RouteError> {
        // With the fleet's digest the scan (load range, routable set) is read from it, and
        // an imbalanced fleet whose workers are all routable is drawn from by position.
        let fleet = ctx.fleet.filter(|f| f.usable_for(c));
        let scan = FleetScan::of_kept(fleet, c, req);
        let (lowest, highest) = scan.load_range.ok_or(RouteError::NoWorker)?;
        let key = PrefixKey::of(req);
        let (draw, branch, matched) = if highest - lowest > self.cfg.imbalanced_threshold {
            (Draw::Routable, Branch::Imbalanced, None)
        } else if let Some(key) = key {
            let m = BestMatch::with_scan(&self.trees, key, req, c, &scan);
            if m.rate < self.cfg.match_rate_threshold {
                // The smallest trees, from the trees' kept size order.
                (Draw::At(fewest_symbols(&self.trees, c, &scan)), Branch::LowMatch, None)
            } else if m.holders.is_empty() {
                (Draw::Routable, Branch::NoPrefix, None)
            } else {
                (Draw::Ids(m.holders.iter().copied().collect()), Branch::HighMatch, Some(m))
            }
        } else {
            (Draw::Routable, Branch::NoPrefix, None)
        };
        let w = match &draw {
            Draw::Routable if fleet.is_some_and(|f| f.routable_count() == c.len()) => power_of_two_all(c, ctx.rng),
            Draw::Routable => power_of_two_routable(c, ctx.rng),
            Draw::Ids(set) => power_of_two(set, c, ctx.rng),
            Draw::At(at) => power_of_two_at(c, at, ctx.rng),
        }
        .ok_or(RouteError::NoWorker)?;
        let d = Decision::new(w, branch);
        Ok(match (key, matched) {
            (Some(k), Some(m)) => {
                let (matched, total, unit) = m.matched_on(w, k, req, c);
                d.with_match(matched, total, unit)
            }
            (Some(k), None) => d.with_match(0, k.len() as u64, k.unit()),
            (None, _) => d,
        })
    }

    fn records_request_prefix(&self) -> bool {
        true
    }

    fn on_routed(&mut self, req: &RequestView<'_>, _: &RequestKey, worker: WorkerId, now: Nanos) {
        if let Some(key) = PrefixKey::of(req) {
            self.trees.insert(key, worker, now);
        }
    }

    fn on_worker_removed(&mut self, worker: WorkerId) {
        self.trees.remove_tenant(worker);
    }

    fn maintain(&mut self, _now: Nanos, max_evictions: usize) -> bool {
        // Ray Serve evicts down to the target once the tree exceeds the threshold; a pass
        // cut short by `max_evictions` goes on at the next slice until the target is met.
        if self.cfg.do_eviction && self.trees.total_size() > self.cfg.eviction_threshold_chars {
            self.evicting = true;
        }
        if self.evicting {
            self.evicting = self.trees.evict_to(self.cfg.eviction_target_chars, max_evictions);
        }
        self.evicting
    }

    fn maintenance_interval(&self) -> Option<Nanos> {
        self.cfg.do_eviction.then(|| Nanos::from_secs_f64(self.cfg.eviction_interval_secs))
    }

    fn knobs(&self) -> serde_json::Value {
        serde_json::to_value(&self.cfg).unwrap_or_default()
    }

    fn set_knobs(&mut self, patch: &serde_json::Value) -> Result<(), KnobError> {
        self.cfg = patch_knobs("prefix_affinity", &self.cfg, patch, PrefixAffinityConfig::validate)?;
        Ok(())
    }

    /// A plain digest: the fleet scan (load range, routable set) comes from it, and an
    /// imbalanced fleet whose workers are all routable is drawn from by position.
    fn fleet_digest(&self) -> Option<FleetDigest> {
        Some(FleetDigest::default())
    }

    fn index_size(&self) -> u64 {
        self.trees.total_size() as u64
    }
}
