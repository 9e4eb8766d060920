//! Cognitora cgn-router's model cascade as a pure state machine (`cgn-router/src/cascade.rs`).
//!
//! A request for a model that has a chain configured first runs on the chain's first
//! (smallest) model. When that step's answer comes back, the mean log-probability of its
//! emitted tokens is compared with the chain's `confidence_threshold`; below it, the request
//! escalates to the next model. The last model's answer is always accepted. Routing runs
//! once per step, so each step goes to the best worker for that step's model. The front end
//! owns the I/O (the gateway's `pipeline::cascade`); this type only decides.
//!
//! Configuration (`[[cascade.chain]]`, one table per entry model):
//!
//! | knob | default | unit |
//! |---|---|---|
//! | `model` | the last of `models` | the model name clients ask for |
//! | `models` | (required, 1 to [`MAX_CHAIN`]) | models to try, smallest first |
//! | `confidence_threshold` | -1.0 | mean log-probability per emitted token (nats, ≤ 0) |
//! | `max_tokens` | [] (the client's) | per-step cap on generated tokens; 0 = the client's |

use serde::{Deserialize, Serialize};

/// Most models in one chain.
pub const MAX_CHAIN: usize = 8;
/// Most chains in one configuration.
pub const MAX_CHAINS: usize = 64;

/// Cascade configuration: the chains, one per entry model (none = cascading off).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CascadeConfig {
    /// The chains.
    pub chain: Vec<CascadeChain>,
}

/// One cascade chain.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CascadeChain {
    /// The model name a client asks for to be cascaded (it need not be served by any worker,
    /// e.g. `auto`); empty = the last of `models`.
    #[serde(default)]
    pub model: String,
    /// Models to try, smallest first.
    pub models: Vec<String>,
    /// Escalate when the mean token log-probability is strictly below this (nats, ≤ 0).
    #[serde(default = "default_threshold")]
    pub confidence_threshold: f64,
    /// Per-step cap on generated tokens, aligned with `models` (missing or 0 = the
    /// client's `max_tokens`).
    #[serde(default)]
    pub max_tokens: Vec<u32>,
}

fn default_threshold() -> f64 {
    -1.0
}

impl CascadeChain {
    /// The model name that starts this chain.
    pub fn entry(&self) -> &str {
        if self.model.is_empty() { self.models.last().map_or("", String::as_str) } else { &self.model }
    }
}

impl CascadeConfig {
    /// Checks every chain: 1 to [`MAX_CHAIN`] non-empty model names, a finite threshold
    /// ≤ 0, at most one `max_tokens` per model, no entry model twice.
    ///
    /// # Errors
    /// A message naming the chain (by its entry model) and the field.
    pub fn validate(&self) -> Result<(), String> {
        if self.chain.len() > MAX_CHAINS {
            return Err(format!("chain: at most {MAX_CHAINS} chains"));
        }
        let mut seen = std::collections::HashSet::new();
        for (i, c) in self.chain.iter().enumerate() {
            let name = if c.entry().is_empty() { format!("#{i}") } else { format!("`{}`", c.entry()) };
            if c.models.is_empty() || c.models.len() > MAX_CHAIN {
                return Err(format!("chain {name}: models: expected 1 to {MAX_CHAIN} model names"));
            }
            if c.models.iter().any(|m| m.trim().is_empty() || m.len() > 256) {
                return Err(format!("chain {name}: models: a model name is empty or longer than 256 bytes"));
            }
            if c.model.len() > 256 {
                return Err(format!("chain {name}: model: longer than 256 bytes"));
            }
            if !(c.confidence_threshold.is_finite() && c.confidence_threshold <= 0.0) {
                return Err(format!(
                    "chain {name}: confidence_threshold: expected a mean log-probability <= 0, got {}",
                    c.confidence_threshold
                ));
            }
            if c.max_tokens.len() > c.models.len() {
                return Err(format!(
                    "chain {name}: max_tokens: {} values for {} models",
                    c.max_tokens.len(),
                    c.models.len()
                ));
            }
            if !seen.insert(c.entry()) {
                return Err(format!("chain {name}: model: two chains start at the same model"));
            }
        }
        Ok(())
    }

    /// The chain started by a request for `model`.
    pub fn chain_for(&self, model: &str) -> Option<&CascadeChain> {
        if model.is_empty() {
            return None;
        }
        self.chain.iter().find(|c| c.entry() == model && !c.models.is_empty())
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
    max_tokens: Vec<u32>,
    step: usize,
    threshold: f64,
}

impl Cascade {
    /// Starts a cascade for a request naming `model`, or `None` when no chain starts there.
    pub fn start(cfg: &CascadeConfig, model: &str) -> Option<Cascade> {
        let c = cfg.chain_for(model)?;
        Some(Cascade {
            chain: c.models.clone(),
            max_tokens: c.max_tokens.clone(),
            step: 0,
            threshold: c.confidence_threshold,
        })
    }

    /// The model the current step runs on.
    pub fn model(&self) -> &str {
        &self.chain[self.step]
    }

    /// The last model of the chain (what a request that is not cascaded runs on).
    pub fn last_model(&self) -> &str {
        self.chain.last().map_or("", String::as_str)
    }

    /// Whether the current step is the chain's last (its answer is always accepted).
    pub fn is_last(&self) -> bool {
        self.step + 1 >= self.chain.len()
    }

    /// The current step's cap on generated tokens, when it has one.
    pub fn max_tokens(&self) -> Option<u32> {
        self.max_tokens.get(self.step).copied().filter(|&n| n > 0)
    }

    /// Zero-based step index.
    pub fn step(&self) -> usize {
        self.step
    }

    /// The escalation threshold (nats per token).
    pub fn threshold(&self) -> f64 {
        self.threshold
    }

    /// Records the current step's response, given the mean log-probability of its emitted
    /// tokens (`None` when the engine returned none: treated as not confident). Advances to
    /// the next model on escalation.
    pub fn on_response(&mut self, mean_logprob: Option<f64>) -> CascadeOutcome {
        let confident = mean_logprob.is_some_and(|lp| lp.is_finite() && lp >= self.threshold);
        if confident || self.is_last() {
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
        CascadeConfig {
            chain: vec![CascadeChain {
                model: String::new(),
                models: vec!["small".into(), "mid".into(), "big".into()],
                confidence_threshold: -0.5,
                max_tokens: vec![32],
            }],
        }
    }

    #[test]
    fn escalates_until_confident_or_exhausted() {
        let c = cfg();
        let mut k = Cascade::start(&c, "big").expect("chain");
        assert_eq!(k.model(), "small");
        assert_eq!(k.max_tokens(), Some(32));
        assert_eq!(k.on_response(Some(-0.9)), CascadeOutcome::Escalate("mid".into()));
        assert_eq!(k.max_tokens(), None, "no cap given for the second step");
        assert_eq!(k.on_response(Some(-0.2)), CascadeOutcome::Accept);
        let mut k = Cascade::start(&c, "big").expect("chain");
        k.on_response(None);
        k.on_response(Some(-3.0));
        assert_eq!(k.model(), "big");
        assert!(k.is_last());
        assert_eq!(k.on_response(Some(-3.0)), CascadeOutcome::Accept, "last model always accepted");
        assert_eq!(
            Cascade::start(&c, "big").expect("chain").on_response(Some(-0.5)),
            CascadeOutcome::Accept,
            "at the threshold is confident"
        );
    }

    #[test]
    fn unchained_models_do_not_cascade_and_bad_chains_are_refused() {
        assert!(Cascade::start(&CascadeConfig::default(), "big").is_none());
        assert!(Cascade::start(&cfg(), "other").is_none());
        assert!(Cascade::start(&cfg(), "").is_none());
        assert_eq!(mean_logprob(&[-1.0, -3.0]), Some(-2.0));
        assert_eq!(mean_logprob(&[]), None);
        assert!(cfg().validate().is_ok());
        let mut bad = cfg();
        bad.chain[0].confidence_threshold = 0.5;
        assert!(bad.validate().expect_err("positive").contains("confidence_threshold"));
        let mut bad = cfg();
        bad.chain[0].max_tokens = vec![1, 2, 3, 4];
        assert!(bad.validate().expect_err("too many").contains("max_tokens"));
        let mut bad = cfg();
        bad.chain.push(bad.chain[0].clone());
        assert!(bad.validate().expect_err("twice").contains("same model"));
        let mut bad = cfg();
        bad.chain[0].models.clear();
        assert!(bad.validate().expect_err("empty").contains("models"));
    }
}
