//! Cognitora cgn-router's model cascade as a pure state machine (`cgn-router/src/cascade.rs`).
//!
//! When `[router.cascade].enabled` is true and the request's model has a chain configured,
//! the request first runs on the chain's first (smallest) model. When the response comes
//! back, the mean log-probability of its emitted tokens is compared with
//! `confidence_threshold`; below it, the request escalates to the next model. The last
//! model's answer is always accepted. Routing runs once per step, so each step goes to the
//! best worker for that step's model. The front end owns the I/O; this type only decides.
//!
//! | knob | default | unit |
//! |---|---|---|
//! | `enabled` | false | |
//! | `confidence_threshold` | -1.0 | mean log-probability per token (nats) |
//! | `chains` | {} | model → ordered list of models, smallest first |

use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// Cascade configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CascadeConfig {
    /// Whether cascading is on.
    pub enabled: bool,
    /// Escalate when the mean token log-probability is strictly below this (nats, ≤ 0).
    pub confidence_threshold: f64,
    /// Requested model → the chain of models to try, smallest first. The requested model
    /// need not be in its own chain.
    pub chains: HashMap<String, Vec<String>>,
}

impl Default for CascadeConfig {
    fn default() -> Self {
        CascadeConfig { enabled: false, confidence_threshold: -1.0, chains: HashMap::new() }
    }
}

/// What to do after a cascade step's response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CascadeOutcome {
    /// The response is confident enough (or the chain is exhausted): return it.
    Accept,
    /// Run the request again on this model.
    Escalate(String),
}

/// One request's walk along a cascade chain.
#[derive(Debug, Clone)]
pub struct Cascade {
    chain: Vec<String>,
    step: usize,
    threshold: f64,
}

impl Cascade {
    /// Starts a cascade for `model`, or `None` when cascading is off or the model has no
    /// (non-empty) chain.
    pub fn start(cfg: &CascadeConfig, model: &str) -> Option<Cascade> {
        if !cfg.enabled {
            return None;
        }
        let chain = cfg.chains.get(model).filter(|c| !c.is_empty())?.clone();
        Some(Cascade { chain, step: 0, threshold: cfg.confidence_threshold })
    }

    /// The model the current step runs on.
    pub fn model(&self) -> &str {
        &self.chain[self.step]
    }

    /// Zero-based step index.
    pub fn step(&self) -> usize {
        self.step
    }

    /// Records the current step's response, given the mean log-probability of its emitted
    /// tokens (`None` when the engine returned no log-probabilities: treated as not
    /// confident). Advances to the next model on escalation.
    pub fn on_response(&mut self, mean_logprob: Option<f64>) -> CascadeOutcome {
        let confident = mean_logprob.is_some_and(|lp| lp.is_finite() && lp >= self.threshold);
        if confident || self.step + 1 >= self.chain.len() {
            CascadeOutcome::Accept
        } else {
            self.step += 1;
            CascadeOutcome::Escalate(self.chain[self.step].clone())
        }
    }
}

/// Mean of token log-probabilities, `None` for an empty slice.
pub fn mean_logprob(logprobs: &[f64]) -> Option<f64> {
    (!logprobs.is_empty()).then(|| logprobs.iter().sum::<f64>() / logprobs.len() as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> CascadeConfig {
        let mut chains = HashMap::new();
        chains.insert("big".to_string(), vec!["small".to_string(), "mid".to_string(), "big".to_string()]);
        CascadeConfig { enabled: true, confidence_threshold: -0.5, chains }
    }

    #[test]
    fn escalates_until_confident_or_exhausted() {
        let c = cfg();
        let mut k = Cascade::start(&c, "big").expect("chain");
        assert_eq!(k.model(), "small");
        assert_eq!(k.on_response(Some(-0.9)), CascadeOutcome::Escalate("mid".into()));
        assert_eq!(k.on_response(Some(-0.2)), CascadeOutcome::Accept);
        let mut k = Cascade::start(&c, "big").expect("chain");
        k.on_response(None);
        k.on_response(Some(-3.0));
        assert_eq!(k.model(), "big");
        assert_eq!(k.on_response(Some(-3.0)), CascadeOutcome::Accept, "last model always accepted");
    }

    #[test]
    fn off_or_unchained_models_do_not_cascade() {
        assert!(Cascade::start(&CascadeConfig::default(), "big").is_none());
        assert!(Cascade::start(&cfg(), "other").is_none());
        assert_eq!(mean_logprob(&[-1.0, -3.0]), Some(-2.0));
        assert_eq!(mean_logprob(&[]), None);
    }
}
