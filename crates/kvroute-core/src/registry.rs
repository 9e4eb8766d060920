//! Build a policy by name; list every policy with its knobs, defaults and source.
//!
//! Knobs are passed as a JSON object (the gateway converts its TOML config and flags to
//! JSON); unknown knobs are rejected with an error naming them.

use crate::policy::b3::{B3, B3Config, B3Mode};
use crate::policy::basic::{ConsistentHash, LeastLoad, PowerOfTwo, Random, RoundRobin};
use crate::policy::cache_aware::{CacheAware, CacheAwareConfig};
use crate::policy::kv_score::{KvScore, KvScoreConfig};
use crate::policy::least_ttft::{LeastTtft, LeastTtftConfig};
use crate::policy::prefill_cost::{PrefillCost, PrefillCostConfig};
use crate::policy::prefix_affinity::{PrefixAffinity, PrefixAffinityConfig};
use crate::policy::{KnobError, Policy};
use serde::Serialize;

/// One policy knob, for `kvroute policies` and the configuration reference.
#[derive(Debug, Clone, Serialize)]
pub struct KnobInfo {
    /// Knob name as used in config, flags and `PUT /policy`.
    pub name: &'static str,
    /// Default value.
    pub default: serde_json::Value,
    /// Unit or range, e.g. "requests", "0.0-1.0", "seconds".
    pub unit: &'static str,
    /// What it does.
    pub doc: &'static str,
}

/// One registered policy.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyInfo {
    /// Registry name.
    pub name: &'static str,
    /// Where the behaviour comes from (the system or paper, by its public name).
    pub source: &'static str,
    /// One-line summary.
    pub summary: &'static str,
    /// Knobs with defaults.
    pub knobs: Vec<KnobInfo>,
    /// Whether the policy reads prefix state (its own index, or the engine's cached tokens
    /// from KV events); prefix-blind policies route the same with either.
    pub prefix_aware: bool,
    /// Whether this is the policy `kvroute serve` runs when no `--policy` is given
    /// ([`DEFAULT_POLICY`]).
    pub default: bool,
}

/// The policy `kvroute serve` (and `kvroute replay`) runs when none is named.
pub const DEFAULT_POLICY: &str = "least_ttft";

/// Why a policy could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BuildError {
    /// No policy of that name.
    #[error("unknown policy `{name}`; known policies: {known}")]
    Unknown {
        /// The name asked for.
        name: String,
        /// Comma-separated registered names.
        known: String,
    },
    /// Bad knobs.
    #[error(transparent)]
    Knobs(#[from] KnobError),
}

/// Names of every registered policy, in listing order.
pub fn names() -> Vec<&'static str> {
    list().into_iter().map(|p| p.name).collect()
}

type Knob = (&'static str, &'static str, &'static str);

const CACHE_AWARE_KNOBS: &[Knob] = &[
    ("cache_threshold", "match rate 0.0-1.0", "route to the longest-match worker when the match rate is above this"),
    ("balance_abs_threshold", "requests", "imbalanced only if max_load - min_load exceeds this ..."),
    ("balance_rel_threshold", "ratio >= 1", "... and max_load exceeds this x min_load"),
    ("eviction_interval_secs", "seconds", "time between LRU eviction passes"),
    ("max_tree_size", "symbols", "tree budget for the whole model (not per worker)"),
];
const PREFIX_AFFINITY_KNOBS: &[Knob] = &[
    ("imbalanced_threshold", "requests", "queue-length spread above which prefix matching is skipped (P2C)"),
    ("match_rate_threshold", "match rate 0.0-1.0", "minimum match rate to route to a matched worker"),
    ("do_eviction", "bool", "evict tree entries by LRU"),
    ("eviction_threshold_chars", "chars", "tree size that triggers eviction"),
    ("eviction_target_chars", "chars", "tree size eviction cuts back to"),
    ("eviction_interval_secs", "seconds", "time between eviction checks"),
];
const KV_SCORE_KNOBS: &[Knob] = &[
    ("w_kv", "weight >= 0", "weight of the prefix overlap (fraction of leading blocks held)"),
    ("w_load", "weight >= 0", "weight of 1 - util (util: see load_signal)"),
    ("w_pwr", "weight >= 0", "weight of 1 - watts/fleet max watts"),
    ("w_cap", "weight >= 0", "weight of static capacity (TP x VRAM / dtype, normalised by fleet max)"),
    ("epsilon", "score", "scores within this of the best are tied; a stable hash breaks the tie"),
    (
        "prefix_tokens",
        "tokens",
        "leading prompt tokens hashed for the overlap (Cognitora cgn-router's ~64; 1048576 for the whole prompt)",
    ),
    ("block_tokens", "tokens", "tokens per hashed block"),
    ("hash", "blake3 | xxh3", "block hash function (Cognitora cgn-router: a BLAKE3 chain)"),
    ("ttl_secs", "seconds", "index entry lifetime after last use"),
    ("max_entries", "entries", "block index budget in (block, worker) entries"),
    (
        "load_signal",
        "seed | queue",
        "util: max(in_flight/max_concurrent, sm_util) (seed, Cognitora cgn-router's); queued prefill tokens + 1,000 per request, over the fleet's most loaded (queue)",
    ),
];
const PREFILL_COST_KNOBS: &[Knob] = &[
    ("block_tokens", "tokens", "tokens per hashed block (trace blocks keep their own size)"),
    ("cache_tokens", "tokens", "KV cache per worker assumed by the router's LRU block sets"),
    ("decode_weight", "tokens per request", "prefill tokens charged per request already on the worker"),
    (
        "miss_weight",
        "multiplier >= 0",
        "weight of the request's own uncached tokens (a miss slows everyone queued behind it)",
    ),
    (
        "session_affinity",
        "bool",
        "keep a session on its last worker while it holds > half the prompt and is not overloaded",
    ),
    ("overload_factor", "x mean load", "affinity gate: the session's worker is overloaded above this x mean load"),
    ("max_sessions", "sessions", "session bindings kept (LRU beyond)"),
    ("batch_factor", "x per request", "queue-depth multiplier: cost x (1 + batch_factor x load); 0 = additive"),
    (
        "decode_queue_scale",
        "requests",
        "requests on a worker at which the decode charge per request doubles (0 = linear)",
    ),
    (
        "stall_weight",
        "tokens per uncached token per request",
        "a prefill stalls every request on its worker: uncached x stall_weight x load is added (scaled by the queue, capped)",
    ),
    ("stall_queue_scale", "waiting requests", "mean waiting per worker at which stall_weight doubles; 0 = fixed"),
    ("stall_cap", "tokens per uncached token", "upper bound of the stall charge per uncached token"),
];
const LEAST_TTFT_KNOBS: &[Knob] = &[
    (
        "prefill_tokens_per_sec",
        "tokens/s > 0",
        "prior prefill throughput per worker (turns work into seconds before calibration)",
    ),
    (
        "calibration_rate",
        "0.0-1.0",
        "weight of a new observation in a worker's learned profile (TTFT scale, hit ratio); 0 = no calibration",
    ),
    ("calibrate_hits", "bool", "discount a worker's predicted hits by the share its engine reports really cached"),
    ("max_scale", "ratio >= 1", "bound of a worker's learned TTFT scale, both ways"),
    (
        "miss_queue_scale",
        "waiting requests",
        "mean waiting per worker at which a miss is charged its full miss_weight (from 1 at an empty queue); 0 = always full",
    ),
    (
        "waiting_delay_weight",
        "share >= 0",
        "per request waiting on the worker, the share of each uncached token charged again (it lengthens their prefill steps); 0 = off",
    ),
    (
        "waiting_delay_cap",
        "waiting requests",
        "the most waiting requests waiting_delay_weight counts on a worker (a prefill step holds a bounded number of prompts)",
    ),
    (
        "context_weight",
        "prompt tokens per attended token, 0.0-1.0",
        "extra prefill work per uncached token per token it attends to: own x (1 + w x (cached + own/2)); 0 = flat per token",
    ),
    (
        "session_balance_rel",
        "x mean load, 0 or >= 1",
        "a request opening a new session goes only to workers whose load with it is <= max(rel x mean, mean + abs); 0 = off",
    ),
    (
        "session_balance_abs",
        "requests",
        "the session balance gate's allowance above the mean load (see session_balance_rel)",
    ),
    (
        "session_balance_min_hit",
        "share of prompt tokens 0.0-1.0",
        "the gate applies only while the engines report at least this share of prompt tokens cached (last ~128 reports); 0 = always",
    ),
    (
        "decode_occupancy_free",
        "batch occupancy 0.0-1.0",
        "load / max_concurrent up to which running requests add no decode charge (waiting ones always do)",
    ),
    (
        "decode_occupancy_full",
        "batch occupancy, 0 or > free",
        "load / max_concurrent from which running requests add the whole decode charge, linear from free; 0 = always whole",
    ),
];
const B3_KNOBS: &[Knob] = &[
    ("block_tokens", "tokens", "tokens per block of the LRU block sets (Mooncake hash_ids are 512)"),
    ("cache_blocks", "blocks", "capacity of each worker's LRU block set"),
    ("overload_factor", "x mean load", "unified: bound worker overloaded above this x mean num_requests"),
    ("hit_ratio_threshold", "ratio 0.0-1.0", "unified: stick only when the hit ratio is strictly above this"),
    ("max_sessions", "sessions", "session bindings kept (LRU beyond)"),
    ("max_turns", "turns", "capped: turns routed per session; later ones are refused (B3 MAX_TURNS)"),
];

fn knobs_of(defaults: serde_json::Value, table: &[Knob]) -> Vec<KnobInfo> {
    table
        .iter()
        .map(|&(name, unit, doc)| KnobInfo {
            name,
            default: defaults.get(name).cloned().unwrap_or_default(),
            unit,
            doc,
        })
        .collect()
}

fn b3_info(mode: B3Mode, summary: &'static str, prefix_aware: bool) -> PolicyInfo {
    // Only the knobs this picker reads (unified reads all of them).
    let table: Vec<Knob> = B3_KNOBS.iter().copied().filter(|(k, _, _)| mode.knob_names().contains(k)).collect();
    PolicyInfo {
        prefix_aware,
        name: mode.name(),
        source: "B3 cache_aware_proxy.py",
        summary,
        knobs: knobs_of(serde_json::to_value(B3Config::default()).unwrap_or_default(), &table),
        default: false,
    }
}

/// Every registered policy with its knobs and defaults.
pub fn list() -> Vec<PolicyInfo> {
    let plain = |name, source, summary| PolicyInfo {
        name,
        source,
        summary,
        knobs: Vec::new(),
        prefix_aware: false,
        default: false,
    };
    vec![
        plain("round_robin", "classic baseline", "rotation over healthy workers"),
        plain("random", "classic baseline", "uniform random worker (seeded)"),
        plain("least_load", "classic baseline", "fewest in-flight requests, rotation among ties"),
        plain("power_of_two", "Mitzenmacher 2001; Ray Serve default", "less loaded of two random workers"),
        plain(
            "consistent_hash",
            "rendezvous hashing",
            "session id (or prompt head) keeps its worker, the same one on every replica (workers named by URL)",
        ),
        PolicyInfo {
            prefix_aware: true,
            name: "cache_aware",
            source: "SGLang router cache_aware",
            summary: "radix-tree longest match above cache_threshold, else smallest tree; least load when imbalanced",
            knobs: knobs_of(serde_json::to_value(CacheAwareConfig::default()).unwrap_or_default(), CACHE_AWARE_KNOBS),
            default: false,
        },
        PolicyInfo {
            prefix_aware: true,
            name: "prefix_affinity",
            source: "Ray Serve PrefixCacheAffinityRouter",
            summary: "P2C when imbalanced; else matched workers above match_rate_threshold, else smallest tenants, then P2C",
            knobs: knobs_of(
                serde_json::to_value(PrefixAffinityConfig::default()).unwrap_or_default(),
                PREFIX_AFFINITY_KNOBS,
            ),
            default: false,
        },
        PolicyInfo {
            prefix_aware: true,
            name: "kv_score",
            source: "Cognitora cgn-router linear KV score",
            summary: "w_kv*overlap + w_load*(1-util) + w_pwr*(1-watts) + w_cap*capacity; stable-hash tie-break",
            knobs: knobs_of(serde_json::to_value(KvScoreConfig::default()).unwrap_or_default(), KV_SCORE_KNOBS),
            default: false,
        },
        b3_info(B3Mode::LMetric, "min (pending_prefill + uncached prompt) x num_requests", true),
        b3_info(B3Mode::LoadOnly, "min num_requests, first worker on ties (B3 control)", false),
        b3_info(B3Mode::Sticky, "session bound to its first worker forever (B3 control)", false),
        b3_info(
            B3Mode::Unified,
            "stick if hit ratio > 0.5 and load <= 2x mean, else LMetric with 4-key tie-break",
            true,
        ),
        b3_info(
            B3Mode::Capped,
            "LMetric; a session's turns past max_turns (8) are refused (B3's capped workload)",
            true,
        ),
        PolicyInfo {
            prefix_aware: true,
            name: "prefill_cost",
            source: "kvroute (docs/replay.md)",
            summary: "least pending prefill + uncached x (miss_weight + min(stall_weight x load, stall_cap)) + decode_weight x load",
            knobs: knobs_of(serde_json::to_value(PrefillCostConfig::default()).unwrap_or_default(), PREFILL_COST_KNOBS),
            default: false,
        },
        PolicyInfo {
            prefix_aware: true,
            name: "least_ttft",
            source: "kvroute (docs/replay.md)",
            summary: "least predicted TTFT (queued prefill + own uncached + decode, over the worker's throughput) plus the delay its miss adds; worker profiles calibrated online from measured TTFT and engine-reported cached tokens",
            knobs: {
                let mut defaults = serde_json::to_value(PrefillCostConfig::default()).unwrap_or_default();
                if let (Some(all), Ok(serde_json::Value::Object(own))) =
                    (defaults.as_object_mut(), serde_json::to_value(LeastTtftConfig::default()))
                {
                    all.extend(own);
                }
                let table: Vec<Knob> = LEAST_TTFT_KNOBS.iter().chain(PREFILL_COST_KNOBS).copied().collect();
                knobs_of(defaults, &table)
            },
            default: true,
        },
    ]
}

fn unknown(name: &str) -> BuildError {
    BuildError::Unknown { name: name.to_string(), known: names().join(", ") }
}

/// Builds policy `name` with `knobs` (a JSON object; `null` or `{}` for the defaults).
///
/// # Errors
/// [`BuildError::Unknown`] for an unknown name, [`BuildError::Knobs`] for an unknown knob
/// or an out-of-range value.
pub fn build(name: &str, knobs: &serde_json::Value) -> Result<Box<dyn Policy>, BuildError> {
    let empty = serde_json::json!({});
    let knobs = if knobs.is_null() { &empty } else { knobs };
    let mut p: Box<dyn Policy> = match name {
        "round_robin" => Box::new(RoundRobin::default()),
        "random" => Box::new(Random),
        "least_load" => Box::new(LeastLoad::default()),
        "power_of_two" => Box::new(PowerOfTwo),
        "consistent_hash" => Box::new(ConsistentHash),
        "cache_aware" => Box::new(CacheAware::new(CacheAwareConfig::default())),
        "prefix_affinity" => Box::new(PrefixAffinity::new(PrefixAffinityConfig::default())),
        "kv_score" => Box::new(KvScore::new(KvScoreConfig::default())),
        "lmetric" => Box::new(B3::new(B3Mode::LMetric, B3Config::default())),
        "load_only" => Box::new(B3::new(B3Mode::LoadOnly, B3Config::default())),
        "sticky" => Box::new(B3::new(B3Mode::Sticky, B3Config::default())),
        "unified" => Box::new(B3::new(B3Mode::Unified, B3Config::default())),
        "capped" => Box::new(B3::new(B3Mode::Capped, B3Config::default())),
        "prefill_cost" => Box::new(PrefillCost::new(PrefillCostConfig::default())),
        "least_ttft" => Box::new(LeastTtft::new(LeastTtftConfig::default(), PrefillCostConfig::default())),
        other => return Err(unknown(other)),
    };
    p.set_knobs(knobs)?;
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eviction_intervals_that_round_to_nothing_are_refused_naming_the_knob() {
        // 1e-10 s rounded to 0 ns and hung a replay; 1e-9 s cost a pass per simulated ns.
        for (policy, extra) in
            [("cache_aware", serde_json::json!({})), ("prefix_affinity", serde_json::json!({"do_eviction": true}))]
        {
            for bad in [1e-10, 1e-9, 0.0009, 1e8, -1.0] {
                let mut knobs = extra.clone();
                knobs["eviction_interval_secs"] = serde_json::json!(bad);
                let e = build(policy, &knobs).expect_err("refused").to_string();
                assert!(e.contains("eviction_interval_secs must be in [0.001, 1e7]"), "{policy} {bad}: {e}");
            }
            let mut knobs = extra.clone();
            knobs["eviction_interval_secs"] = serde_json::json!(0.001);
            assert!(build(policy, &knobs).is_ok(), "{policy}");
        }
    }

    #[test]
    fn every_listed_policy_builds_with_defaults_and_names_match() {
        let infos = list();
        assert_eq!(infos.len(), 15);
        let defaults: Vec<&str> = infos.iter().filter(|i| i.default).map(|i| i.name).collect();
        assert_eq!(defaults, [DEFAULT_POLICY], "exactly one policy is marked the default");
        for info in infos {
            let p = build(info.name, &serde_json::Value::Null).expect("builds");
            assert_eq!(p.name(), info.name);
            let knobs = p.knobs();
            for k in &info.knobs {
                assert_eq!(knobs.get(k.name), Some(&k.default), "{}.{}", info.name, k.name);
            }
            assert_eq!(knobs.as_object().map_or(0, |o| o.len()), info.knobs.len(), "{} knob table complete", info.name);
        }
    }

    #[test]
    fn b3_pickers_list_and_accept_only_the_knobs_they_read() {
        let infos = list();
        let knobs_of = |name: &str| -> Vec<&str> {
            infos.iter().find(|i| i.name == name).expect("listed").knobs.iter().map(|k| k.name).collect()
        };
        for name in ["lmetric", "load_only", "sticky"] {
            let listed = knobs_of(name);
            assert!(
                !listed.contains(&"overload_factor") && !listed.contains(&"hit_ratio_threshold"),
                "{name}: {listed:?}"
            );
            let e = build(name, &serde_json::json!({"overload_factor": 3.0})).expect_err("ignored knob");
            assert!(e.to_string().contains("overload_factor"), "{e}");
        }
        assert!(!knobs_of("lmetric").contains(&"max_sessions"));
        assert!(knobs_of("sticky").contains(&"max_sessions"));
        assert_eq!(knobs_of("unified").len(), 5);
        build("unified", &serde_json::json!({"overload_factor": 3.0, "hit_ratio_threshold": 0.7}))
            .expect("unified reads both");
    }

    #[test]
    fn unknown_names_and_knobs_are_clear_errors() {
        let e = build("nope", &serde_json::Value::Null).expect_err("unknown");
        assert!(e.to_string().contains("cache_aware"), "{e}");
        let e = build("cache_aware", &serde_json::json!({"cache_treshold": 0.3})).expect_err("typo");
        assert!(e.to_string().contains("cache_treshold"), "{e}");
        let e = build("cache_aware", &serde_json::json!({"cache_threshold": 3.0})).expect_err("range");
        assert!(e.to_string().contains("cache_threshold"), "{e}");
        let p = build("cache_aware", &serde_json::json!({"cache_threshold": 0.3})).expect("ok");
        assert_eq!(p.knobs()["cache_threshold"], serde_json::json!(0.3));
    }
}
