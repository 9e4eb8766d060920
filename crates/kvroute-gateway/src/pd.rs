//! Prefill/decode disaggregation: its configuration and the two pools' routers
//! (Cognitora cgn-router's `disagg.rs`; the command line of SGLang's router,
//! `--pd-disaggregation --prefill URL [BOOTSTRAP_PORT] --decode URL`).
//!
//! Workers have a role: `prefill`, `decode` or `both` — from `[[pd.prefill]]` and
//! `pd.decode` (or the flags), from a worker's etcd registration (`"role"`), else `both`.
//! A request whose prompt is longer than `colocate_below_tokens` is split: the prefill
//! pool's router (a prefix-aware policy by default) picks the prefill worker, the decode
//! pool's router (a load-aware one) picks the decode worker, each admitted against its own
//! (model, role) limit. Shorter prompts run on one worker: a `both` worker if one is
//! routable, else a decode worker alone (Dynamo 1.5's conditional disaggregation). The
//! request stage is [`crate::pipeline::pd`].

use crate::config::pd::json;
pub use crate::config::pd::{PdConfig, PdProtocol, PrefillWorker};
use crate::routers::Routers;
use kvroute_core::types::WorkerId;

/// The two pools' routers (each model gets its own router in each pool, as in the main
/// [`Routers`]).
#[derive(Debug)]
pub struct PdRouters {
    /// The configuration in effect.
    pub cfg: PdConfig,
    /// Routers of the prefill pool.
    pub prefill: Routers,
    /// Routers of the decode pool (split requests' decode phase, and short prompts on
    /// decode workers when no `both` worker is routable).
    pub decode: Routers,
}

impl PdRouters {
    /// The pools' routers, when disaggregation is on, each model's policy in `copies`
    /// copies ([`Routers::new`]).
    ///
    /// # Errors
    /// An unknown policy or invalid knobs.
    pub fn new(cfg: &PdConfig, seed: u64, copies: usize) -> anyhow::Result<Option<PdRouters>> {
        if !cfg.enabled {
            return Ok(None);
        }
        Ok(Some(PdRouters {
            cfg: cfg.clone(),
            prefill: Routers::new(&cfg.prefill_policy, json(&cfg.prefill_policy_knobs), seed, copies)?,
            decode: Routers::new(&cfg.decode_policy, json(&cfg.decode_policy_knobs), seed ^ 0x5044, copies)?,
        }))
    }

    /// Forgets `worker` in both pools.
    pub fn worker_removed(&self, worker: WorkerId) {
        self.prefill.worker_removed(worker);
        self.decode.worker_removed(worker);
    }
}
