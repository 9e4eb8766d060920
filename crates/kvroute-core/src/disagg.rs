//! Cognitora cgn-router's prefill/decode disaggregation plan (`cgn-router/src/disagg.rs`).
//!
//! When `[router.disagg].enabled` is true and the prompt exceeds `colocate_below_tokens`,
//! the router asks for two workers: a prefill worker ([`Role::Prefill`]) that runs the
//! first forward pass and a decode worker ([`Role::Decode`]) that takes over the KV blocks
//! and streams tokens. Shorter prompts run colocated on one worker ([`Role::Both`]). Each
//! phase is routed by the configured policy over the workers of that role, so the prefill
//! pick is cache-aware and the decode pick is load-aware.
//!
//! | knob | default | unit |
//! |---|---|---|
//! | `enabled` | false | |
//! | `colocate_below_tokens` | 2048 | prompt tokens |

use crate::types::Role;
use serde::{Deserialize, Serialize};

/// Disaggregation configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DisaggConfig {
    /// Whether prefill and decode may run on different workers.
    pub enabled: bool,
    /// Prompts of at most this many tokens run colocated.
    pub colocate_below_tokens: u32,
}

impl Default for DisaggConfig {
    fn default() -> Self {
        DisaggConfig { enabled: false, colocate_below_tokens: 2048 }
    }
}

/// How one request is served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DisaggPlan {
    /// One worker does prefill and decode.
    Colocated,
    /// A prefill worker, then a decode worker.
    Split,
}

impl DisaggPlan {
    /// The roles to route, in order.
    pub fn roles(self) -> &'static [Role] {
        match self {
            DisaggPlan::Colocated => &[Role::Both],
            DisaggPlan::Split => &[Role::Prefill, Role::Decode],
        }
    }
}

/// The plan for a prompt of `input_tokens` tokens; `Split` only when enabled, the prompt is
/// longer than `colocate_below_tokens` and both roles have a routable worker
/// (`have_prefill`, `have_decode`), so a fleet without split workers degrades to colocated.
pub fn plan(cfg: &DisaggConfig, input_tokens: u32, have_prefill: bool, have_decode: bool) -> DisaggPlan {
    if cfg.enabled && input_tokens > cfg.colocate_below_tokens && have_prefill && have_decode {
        DisaggPlan::Split
    } else {
        DisaggPlan::Colocated
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_only_long_prompts_when_enabled_and_staffed() {
        let on = DisaggConfig { enabled: true, colocate_below_tokens: 100 };
        assert_eq!(plan(&on, 101, true, true), DisaggPlan::Split);
        assert_eq!(plan(&on, 100, true, true), DisaggPlan::Colocated);
        assert_eq!(plan(&on, 5000, false, true), DisaggPlan::Colocated);
        assert_eq!(plan(&DisaggConfig::default(), 5000, true, true), DisaggPlan::Colocated);
        assert_eq!(DisaggPlan::Split.roles(), &[Role::Prefill, Role::Decode]);
    }
}
