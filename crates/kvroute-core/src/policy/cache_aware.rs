//! `cache_aware`: SGLang router's cache-aware load balancing (sgl-router
//! `policies/cache_aware.rs`, documented in SGLang's "Router for Data Parallelism").
//!
//! The router keeps an approximate radix tree of the prompts it sent to each worker
//! (tenant = worker) and switches between two strategies:
//!
//! 1. **Imbalanced** — only when *both* hold: `max_load − min_load > balance_abs_threshold`
//!    and `max_load > balance_rel_threshold × min_load` (load = [`WorkerView::load`]):
//!    the least-loaded worker (shortest queue). Branch `imbalanced`.
//! 2. **Balanced** — match the prompt in the tree. Match rate = matched / prompt length
//!    (text bytes, or token ids, or blocks — whichever key the request carries):
//!    - rate `> cache_threshold`: among *all* workers holding the deepest match, the least
//!      loaded (rotation among ties). Branch `high_match`;
//!    - otherwise: the worker with the smallest tree (most free cache), ties broken by load
//!      and then by rotation, so a miss does not always land on the first worker. Branch
//!      `low_match`. The trees keep their tenants ordered by size, so this reads the
//!      smallest few instead of every worker ([`crate::policy::util::fewest_by_order`]);
//!    - a request with no key: least load. Branch `no_prefix`.
//!
//!    A worker that publishes KV events ([`WorkerView::cached_tokens`] set) is matched by
//!    the engine's cached tokens / prompt tokens instead of the tree (precise prefix state,
//!    as SMG's event-driven mode does); the others by the tree ([`BestMatch`]).
//!
//! The prompt is inserted for the chosen worker ([`Policy::on_routed`]). Every
//! `eviction_interval_secs` ([`Policy::maintain`]) least-recently-used leaves are evicted
//! until the tree holds at most `max_tree_size` symbols — one budget for the whole model,
//! not per worker. A removed worker's tenant is dropped from the tree.
//!
//! | knob | default | unit |
//! |---|---|---|
//! | `cache_threshold` | 0.5 | match rate, 0.0–1.0 |
//! | `balance_abs_threshold` | 32 | requests |
//! | `balance_rel_threshold` | 1.0001 | ratio ≥ 1 |
//! | `eviction_interval_secs` | 60 | seconds, 0.001–10^7 (SGLang's `eviction_interval`) |
//! | `max_tree_size` | 16,777,216 | symbols (UTF-8 bytes of text, tokens or blocks; SGLang counts characters per worker) |

use crate::fleet_digest::FleetDigest;
use crate::policy::util::{
    BestMatch, FleetScan, PrefixKey, PrefixTrees, Rotation, argmin_by, fewest_by_order, least_loaded_at, rotate,
    rotate_at,
};
use crate::policy::{Branch, Decision, KnobError, PickCtx, Policy, RequestKey, RouteError, patch_knobs};
use crate::types::{Nanos, RequestView, WorkerId, WorkerView};
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

/// Most (tenant, leaf) pairs one insert evicts when the tree is over `max_tree_size`; the
/// periodic pass finishes what is left.
pub const INSERT_EVICTION_SLICE: usize = 64;

/// Knobs of `cache_aware` (defaults from SGLang router).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CacheAwareConfig {
    /// Minimum match rate (exclusive) to route to the longest-match worker.
    pub cache_threshold: f64,
    /// Absolute load difference above which the fleet may be imbalanced.
    pub balance_abs_threshold: u32,
    /// Relative load ratio above which the fleet may be imbalanced.
    pub balance_rel_threshold: f64,
    /// Seconds between eviction passes.
    pub eviction_interval_secs: f64,
    /// Tree budget in symbols (global per model).
    pub max_tree_size: usize,
}

impl Default for CacheAwareConfig {
    fn default() -> Self {
        CacheAwareConfig {
            cache_threshold: 0.5,
            balance_abs_threshold: 32,
            balance_rel_threshold: 1.0001,
            eviction_interval_secs: 60.0,
            max_tree_size: 16_777_216,
        }
    }
}

impl CacheAwareConfig {
    /// Checks ranges.
    ///
    /// # Errors
    /// A message naming the knob out of range.
    pub fn validate(&self) -> Result<(), String> {
        if !(0.0..=1.0).contains(&self.cache_threshold) {
            return Err(format!("cache_threshold must be in [0, 1], got {}", self.cache_threshold));
        }
        if !(self.balance_rel_threshold >= 1.0 && self.balance_rel_threshold.is_finite()) {
            return Err(format!("balance_rel_threshold must be >= 1, got {}", self.balance_rel_threshold));
        }
        crate::policy::util::check_eviction_interval(self.eviction_interval_secs)?;
        Ok(())
    }
}

/// The `cache_aware` policy.
#[derive(Debug, Default, Clone)]
pub struct CacheAware {
    cfg: CacheAwareConfig,
    trees: PrefixTrees,
    rotation: Rotation,
}

impl CacheAware {
    /// A policy with `cfg` (validate it first).
    pub fn new(cfg: CacheAwareConfig) -> Self {
        CacheAware { cfg, trees: PrefixTrees::default(), rotation: Rotation::default() }
    }

    fn least_loaded(&self, c: &[WorkerView], keep: impl Fn(&WorkerView) -> bool) -> Option<WorkerId> {
        let tied = argmin_by(c, keep, WorkerView::load);
        rotate(&tied, &self.rotation)
    }
}

impl Policy for CacheAware {
    fn name(&self) -> &'static str {
        "cache_aware"
    }

    fn pick(
        &self,
        req: &RequestView<'_>,
        _: &RequestKey,
        c: &[WorkerView],
        ctx: &mut PickCtx<'_>,
    ) -> Result<Decision, RouteError> {
        // With the fleet's digest the scan (load range, routable set) and the least loaded
        // are read from it: no pass over the views.
        let fleet = ctx.fleet.filter(|f| f.usable_for(c));
        let scan = FleetScan::of_kept(fleet, c, req);
        let (min, max) = scan.load_range.ok_or(RouteError::NoWorker)?;
        let imbalanced = max - min > self.cfg.balance_abs_threshold
            && f64::from(max) > self.cfg.balance_rel_threshold * f64::from(min);
        let key = PrefixKey::of(req);
        if imbalanced || key.is_none() {
            let w = match fleet {
                Some(f) => rotate_at(c, &mut f.least_loaded().collect::<SmallVec<[u32; 16]>>(), &self.rotation),
                None => self.least_loaded(c, |_| true),
            }
            .ok_or(RouteError::NoWorker)?;
            let branch = if imbalanced { Branch::Imbalanced } else { Branch::NoPrefix };
            return Ok(Decision::new(w, branch));
        }
        let Some(key) = key else { return Err(RouteError::NoWorker) };
        let m = BestMatch::with_scan(&self.trees, key, req, c, &scan);
        let (w, branch) = if m.rate > self.cfg.cache_threshold && !m.holders.is_empty() {
            (rotate(&m.least_loaded_holders(c), &self.rotation), Branch::HighMatch)
        } else {
            // The least (tree size, load): the smallest trees from their kept order and the
            // least loaded of those, or, where the order does not answer (thousands tied,
            // say), one pass over both.
            let trees = &self.trees;
            let tied = match fewest_by_order(trees, c, &scan) {
                Some(at) => least_loaded_at(c, &at),
                None => argmin_by(c, |_| true, |w| (trees.tenant_size(w.id), w.load())),
            };
            (rotate(&tied, &self.rotation), Branch::LowMatch)
        };
        let w = w.ok_or(RouteError::NoWorker)?;
        let (matched, total, unit) = m.matched_on(w, key, req, c);
        Ok(Decision::new(w, branch).with_match(matched, total, unit))
    }

    fn records_request_prefix(&self) -> bool {
        true
    }

    fn on_routed(&mut self, req: &RequestView<'_>, _: &RequestKey, worker: WorkerId, now: Nanos) {
        if let Some(key) = PrefixKey::of(req) {
            self.trees.insert(key, worker, now);
            // The budget holds on insert, not only at the periodic pass (SGLang router
            // trims every `eviction_interval_secs`; 20 s of distinct prompts grew its tree
            // to 21x the budget in between): a bounded slice of least recently used
            // leaves goes now, in the order the pass would take them.
            if self.trees.total_size() > self.cfg.max_tree_size {
                self.trees.evict_to(self.cfg.max_tree_size, INSERT_EVICTION_SLICE);
            }
        }
    }

    fn on_worker_removed(&mut self, worker: WorkerId) {
        self.trees.remove_tenant(worker);
    }

    fn maintain(&mut self, _now: Nanos, max_evictions: usize) -> bool {
        self.trees.evict_to(self.cfg.max_tree_size, max_evictions)
    }

    fn maintenance_interval(&self) -> Option<Nanos> {
        Some(Nanos::from_secs_f64(self.cfg.eviction_interval_secs))
    }

    fn knobs(&self) -> serde_json::Value {
        serde_json::to_value(&self.cfg).unwrap_or_default()
    }

    fn set_knobs(&mut self, patch: &serde_json::Value) -> Result<(), KnobError> {
        self.cfg = patch_knobs("cache_aware", &self.cfg, patch, CacheAwareConfig::validate)?;
        Ok(())
    }

    fn index_size(&self) -> u64 {
        self.trees.total_size() as u64
    }

    /// A plain digest: the fleet scan (load range, routable set) comes from it, and on an
    /// imbalanced fleet the least loaded.
    fn fleet_digest(&self) -> Option<FleetDigest> {
        Some(FleetDigest::default())
    }
}
