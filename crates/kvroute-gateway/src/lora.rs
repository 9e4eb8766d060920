//! Model multiplexing with LoRA adapters (Ray Serve's model multiplexing; vLLM and SGLang
//! runtime LoRA loading).
//!
//! Each worker's loaded models and adapters come from its `GET /v1/models` (vLLM and SGLang
//! list every loaded adapter there, vLLM with its `parent` base model), read when the worker
//! is added, every `health.models_refresh_secs`, and after each load. A request for model
//! M goes to the workers that list M — prefix-aware among them, through the normal
//! decision — so an adapter already loaded somewhere is used where it is.
//!
//! When no routable worker lists M and M is an adapter of the `[[lora.adapters]]`
//! catalogue, and `lora.load` is on, the router picks a worker to load it: among the
//! routable workers serving the adapter's `base` model, one with a free adapter slot first
//! (its `max_loras` less the adapters it lists), then the least loaded relative to its
//! `max_concurrent`, then the lowest id. It asks that worker to load M (vLLM
//! `POST /v1/load_lora_adapter`, SGLang `POST /load_lora_adapter`, per `lora.api`), reads
//! its `/v1/models` again, and routes the request. A failed load is counted and the next
//! worker in that order is asked, at most [`MAX_LOAD_ATTEMPTS`] workers per request. Only
//! catalogue adapters are ever loaded — a client cannot make a worker load a path of its
//! choosing — and concurrent requests for the same adapter wait for one load.
//!
//! Limits: a worker whose slots are all used evicts its own least recently used adapter
//! (vLLM and SGLang do); the router learns that from the `/v1/models` it reads after the
//! load. An adapter evicted out of band stays in the router's list until the next refresh,
//! and a request sent there meanwhile gets the worker's 404.

pub use crate::config::lora::{LoraAdapter, LoraApi, LoraConfig, LoraConfigError, MAX_ADAPTERS};
use crate::fleet::WorkerEntry;
use std::collections::HashMap;
use std::time::Duration;

/// Workers asked to load one adapter for one request before it fails.
pub const MAX_LOAD_ATTEMPTS: usize = 3;

/// Why a worker did not load an adapter.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LoadError {
    /// The request failed (connection, timeout).
    #[error("{worker}: {reason}")]
    Request { worker: String, reason: String },
    /// The worker answered with an error.
    #[error("{worker} answered {status}: {snippet}")]
    Refused { worker: String, status: reqwest::StatusCode, snippet: String },
}

/// The multiplexer: the catalogue, and one lock per adapter so concurrent requests for it
/// wait for a single load.
#[derive(Debug)]
pub struct Multiplexer {
    /// The `[lora]` section it was built from.
    pub(crate) cfg: LoraConfig,
    /// Catalogue index of each adapter name.
    pub(crate) by_name: HashMap<String, usize>,
    /// One lock per catalogue adapter: concurrent requests for it wait for a single load.
    pub(crate) loading: Vec<tokio::sync::Mutex<()>>,
}

impl Multiplexer {
    /// A multiplexer for `cfg`; `None` without a catalogue.
    pub fn new(cfg: &LoraConfig) -> Option<Multiplexer> {
        if cfg.adapters.is_empty() {
            return None;
        }
        let by_name = cfg.adapters.iter().enumerate().map(|(i, a)| (a.name.clone(), i)).collect();
        let loading = cfg.adapters.iter().map(|_| tokio::sync::Mutex::new(())).collect();
        Some(Multiplexer { cfg: cfg.clone(), by_name, loading })
    }

    /// Whether `model` is a catalogue adapter.
    pub fn is_adapter(&self, model: &str) -> bool {
        self.by_name.contains_key(model)
    }

    /// A worker's adapter slots and how many of them catalogue adapters use.
    pub(crate) fn adapter_slots(&self, w: &WorkerEntry) -> (usize, usize) {
        let slots = w.capacity().max_loras.unwrap_or(self.cfg.default_max_loras) as usize;
        let used = w.models().iter().filter(|m| self.by_name.contains_key(*m)).count();
        (slots, used)
    }
}

/// Asks `w` to load `adapter`; an "already loaded" answer counts as loaded.
pub(crate) async fn load_on(
    client: &reqwest::Client,
    cfg: &LoraConfig,
    w: &WorkerEntry,
    adapter: &LoraAdapter,
) -> Result<(), LoadError> {
    let path = match cfg.api {
        LoraApi::Vllm => "/v1/load_lora_adapter",
        LoraApi::Sglang => "/load_lora_adapter",
    };
    let body = serde_json::json!({"lora_name": adapter.name, "lora_path": adapter.path});
    let r = client
        .post(format!("{}{path}", w.url))
        .timeout(Duration::from_secs_f64(cfg.load_timeout_secs))
        .json(&body)
        .send()
        .await
        .map_err(|e| LoadError::Request { worker: w.url.to_string(), reason: e.to_string() })?;
    let status = r.status();
    let text = r.text().await.unwrap_or_default();
    let already = text.contains("already been loaded") || text.contains("already loaded");
    let sglang_failed = cfg.api == LoraApi::Sglang
        && serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| v.get("success").and_then(serde_json::Value::as_bool))
            == Some(false);
    if (status.is_success() && !sglang_failed) || already {
        Ok(())
    } else {
        let snippet: String = text.chars().take(300).collect();
        Err(LoadError::Refused { worker: w.url.to_string(), status, snippet })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_multiplexer_knows_its_catalogue() {
        let a = |name: &str| LoraAdapter { name: name.into(), path: "/a".into(), base: String::new() };
        let ok = LoraConfig { adapters: vec![a("x"), a("y")], ..LoraConfig::default() };
        assert!(Multiplexer::new(&LoraConfig::default()).is_none());
        assert!(Multiplexer::new(&ok).is_some_and(|m| m.is_adapter("y") && !m.is_adapter("z")));
    }
}
