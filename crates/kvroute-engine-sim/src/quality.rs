//! Simulated output tokens and their log-probabilities.
//!
//! The output of a request is a deterministic sequence of words drawn from the prompt's
//! hash. Its quality is one knob: the mean log-probability per emitted token
//! ([`prompt_mean_logprob`]), so a model cascade that escalates on low confidence can be
//! tested against workers of known quality. With `quality_spread` 0 every token gets the
//! mean (the default: a constant -0.1, as the simulator always answered); with a spread,
//! per-token values vary around the mean in pairs (`mean + d`, `mean − d` with
//! `0 ≤ d ≤ |mean| / 2`; an unpaired last token gets the mean). Either way every value is
//! ≤ 0 and the mean over all emitted tokens is the prompt's mean.
//!
//! The shapes returned follow the engines: OpenAI/vLLM chat (`logprobs.content`), OpenAI
//! legacy completions (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) and
//! SGLang `/generate` (`meta_info.output_token_logprobs` as `[logprob, token_id, null]`).

use crate::EngineSimConfig;
use kvroute_core::hash::{HashAlgo, ROOT_SEED, stable_hash};
use std::ops::Range;

/// Seed of the per-prompt quality offset (kept apart from the output words' seed).
const QUALITY_SEED: u64 = 0x7175_616c_6974_7931; // "quality1"

/// First token id of the output words (`/generate` token ids are this + the word's index).
const WORD_TOKEN_BASE: u32 = 1000;

/// The words of simulated outputs.
const WORDS: [&str; 16] = [
    "the", "cache", "router", "sends", "each", "request", "to", "a", "worker", "that", "already", "holds", "its",
    "prefix", "and", "answers",
];

/// `h` mapped to [0, 1] (53 bits).
fn unit01(h: u64) -> f64 {
    (h >> 11) as f64 / ((1u64 << 53) - 1) as f64
}

/// The mean log-probability per emitted token (natural log, nats, ≤ 0) of the output the
/// simulated worker produces for `prompt_text`: `quality + quality_spread × u`, clamped to
/// ≤ 0, where `u` in [-1, 1] is a stable hash of the prompt text (same prompt, same mean, on
/// every worker and run; different prompts spread uniformly over
/// [quality − spread, quality + spread]). With `quality_spread` 0 it is exactly `quality`.
///
/// `prompt_text` is the routing text of the request
/// ([`kvroute_protocol::openai::RoutingInfo::text`]): the chat messages' text contents
/// concatenated in order, the completion prompt (strings concatenated), or the `/generate`
/// `text`; a prompt given only as token ids has the empty text.
///
/// No real engine has this knob: it stands for model quality (a small model answers with
/// lower log-probabilities than a large one), which vLLM and SGLang report per token.
pub fn prompt_mean_logprob(cfg: &EngineSimConfig, prompt_text: &str) -> f64 {
    let u = 2.0 * unit01(HashAlgo::Xxh3.chain(QUALITY_SEED, prompt_text.as_bytes())) - 1.0;
    (cfg.quality + cfg.quality_spread * u).min(0.0)
}

/// Index into [`WORDS`] of output token `i` for a prompt seed.
fn word_index(seed: u64, i: u32) -> usize {
    let h = stable_hash(&[seed.to_le_bytes(), u64::from(i).to_le_bytes()].concat());
    (h % WORDS.len() as u64) as usize
}

/// The output tokens of one request: text, log-probability and token id of token `i`.
#[derive(Debug, Clone)]
pub(crate) struct Tokens {
    seed: u64,
    mean: f64,
    n: u32,
    /// Whether per-token values vary around the mean (else all are the mean).
    vary: bool,
    /// Byte offset of each token in the output text (only for completions logprobs).
    offsets: Vec<usize>,
}

impl Tokens {
    /// `n` tokens for a prompt seed (hash of the prompt text) with mean log-probability
    /// `mean`, varying around it when `vary`; `with_offsets` precomputes the text offsets of
    /// legacy completions.
    pub(crate) fn new(seed: u64, mean: f64, n: u32, vary: bool, with_offsets: bool) -> Self {
        let mut t = Tokens { seed, mean, n, vary, offsets: Vec::new() };
        if with_offsets {
            let mut at = 0;
            t.offsets = (0..n)
                .map(|i| {
                    let o = at;
                    at += t.text(i).len();
                    o
                })
                .collect();
        }
        t
    }

    /// Text of token `i`: its word, after a space except for the first.
    pub(crate) fn text(&self, i: u32) -> String {
        let w = WORDS[word_index(self.seed, i)];
        if i == 0 { w.to_string() } else { format!(" {w}") }
    }

    /// The whole output text.
    pub(crate) fn full_text(&self) -> String {
        (0..self.n).map(|i| self.text(i)).collect()
    }

    /// Token id of token `i` (deterministic; not a real vocabulary).
    fn id(&self, i: u32) -> u32 {
        WORD_TOKEN_BASE + word_index(self.seed, i) as u32
    }

    /// Log-probability of token `i` (≤ 0; the pair `2k, 2k+1` averages to the mean).
    pub(crate) fn logprob(&self, i: u32) -> f64 {
        if !self.vary || (i.is_multiple_of(2) && i + 1 >= self.n) {
            return self.mean;
        }
        let k = u64::from(i / 2);
        let f = 0.5 * unit01(HashAlgo::Xxh3.chain(ROOT_SEED ^ self.seed, &k.to_le_bytes()));
        let d = -self.mean * f;
        if i.is_multiple_of(2) { self.mean + d } else { self.mean - d }
    }
}

/// Which logprobs shape a request asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ask {
    /// Chat `"logprobs": true`.
    Chat,
    /// Completions `"logprobs": N`; `top` when N ≥ 1 (then `top_logprobs` holds the token).
    Completions {
        /// Whether `top_logprobs` entries are objects (N ≥ 1) rather than null (N = 0).
        top: bool,
    },
    /// `/generate` `"return_logprob": true`.
    Generate,
}

/// The logprobs of tokens `range` in the shape `ask` wants: chat `{"content": [...]}`,
/// completions `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, or the
/// `/generate` `output_token_logprobs` array.
pub(crate) fn logprobs_json(ask: Ask, toks: &Tokens, range: Range<u32>) -> serde_json::Value {
    use serde_json::json;
    match ask {
        Ask::Chat => json!({"content": range.map(|i| {
            let t = toks.text(i);
            json!({"token": t, "logprob": toks.logprob(i), "bytes": t.as_bytes(), "top_logprobs": []})
        }).collect::<Vec<_>>()}),
        Ask::Completions { top } => {
            let texts: Vec<String> = range.clone().map(|i| toks.text(i)).collect();
            let lps: Vec<f64> = range.clone().map(|i| toks.logprob(i)).collect();
            let tops: Vec<serde_json::Value> = texts
                .iter()
                .zip(&lps)
                .map(|(t, lp)| if top { json!({ t.as_str(): lp }) } else { serde_json::Value::Null })
                .collect();
            let offsets: Vec<usize> = range.map(|i| toks.offsets.get(i as usize).copied().unwrap_or(0)).collect();
            json!({"tokens": texts, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
        }
        Ask::Generate => json!(range.map(|i| json!([toks.logprob(i), toks.id(i), null])).collect::<Vec<_>>()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_logprobs_average_to_the_mean_and_stay_non_positive() {
        for mean in [0.0, -0.1, -2.5, -40.0] {
            for n in [1, 2, 3, 16, 17, 1000] {
                let t = Tokens::new(42, mean, n, true, false);
                let lps: Vec<f64> = (0..n).map(|i| t.logprob(i)).collect();
                assert!(lps.iter().all(|&x| x <= 0.0), "{lps:?}");
                let m = lps.iter().sum::<f64>() / f64::from(n);
                assert!((m - mean).abs() < 1e-9, "mean {m} vs {mean} (n {n})");
            }
        }
        let t = Tokens::new(42, -1.0, 4, true, false);
        assert_ne!(t.logprob(0), t.logprob(1), "values vary around the mean");
        let t = Tokens::new(42, -0.1, 5, false, false);
        assert!((0..5).all(|i| t.logprob(i) == -0.1), "no spread: every token is the mean");
    }

    #[test]
    fn offsets_follow_the_text() {
        let t = Tokens::new(7, -0.5, 5, true, true);
        let text = t.full_text();
        for i in 0..5 {
            assert!(text[t.offsets[i as usize]..].starts_with(&t.text(i)));
        }
    }
}
