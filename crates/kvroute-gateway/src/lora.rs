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

use crate::fleet::WorkerEntry;
use crate::metrics::count_outcome;
use crate::state::AppState;
use axum::http::StatusCode;
use kvroute_protocol::api_error::ApiError;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// Workers asked to load one adapter for one request before it fails.
pub const MAX_LOAD_ATTEMPTS: usize = 3;
/// Most adapters in the catalogue.
pub const MAX_ADAPTERS: usize = 4096;

/// The runtime-loading endpoint workers speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LoraApi {
    /// vLLM: `POST /v1/load_lora_adapter` `{"lora_name", "lora_path"}` (needs
    /// `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` on the worker).
    #[default]
    Vllm,
    /// SGLang: `POST /load_lora_adapter` `{"lora_name", "lora_path"}`.
    Sglang,
}

/// One adapter the router may ask workers to load.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraAdapter {
    /// The model name clients ask for (`lora_name`).
    pub name: String,
    /// Where the worker finds it (`lora_path`: a directory or a Hugging Face repository).
    pub path: String,
    /// The base model it applies to: only workers listing this model load it (empty: any
    /// worker).
    #[serde(default)]
    pub base: String,
}

/// `[lora]`: model multiplexing with runtime-loaded LoRA adapters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoraConfig {
    /// Ask a worker to load a catalogue adapter that no routable worker has loaded.
    pub load: bool,
    /// The workers' loading endpoint.
    pub api: LoraApi,
    /// Timeout of one load request, seconds.
    pub load_timeout_secs: f64,
    /// Adapters a worker holds when neither the configuration (`capacity.max_loras`), its
    /// registration nor its report (SGLang `max_loras_per_batch`) says (vLLM's
    /// `--max-loras` default is 1).
    pub default_max_loras: u32,
    /// The catalogue.
    pub adapters: Vec<LoraAdapter>,
}

impl Default for LoraConfig {
    fn default() -> Self {
        LoraConfig {
            load: true,
            api: LoraApi::Vllm,
            load_timeout_secs: 120.0,
            default_max_loras: 1,
            adapters: Vec::new(),
        }
    }
}

impl LoraConfig {
    /// Checks the catalogue and limits.
    ///
    /// # Errors
    /// [`LoraConfigError`] naming the field (and the adapter).
    pub fn validate(&self) -> Result<(), LoraConfigError> {
        if !(self.load_timeout_secs.is_finite() && self.load_timeout_secs > 0.0 && self.load_timeout_secs <= 3600.0) {
            return Err(LoraConfigError::LoadTimeout);
        }
        if self.adapters.len() > MAX_ADAPTERS {
            return Err(LoraConfigError::TooMany);
        }
        let mut seen = std::collections::HashSet::new();
        for a in &self.adapters {
            if a.name.trim().is_empty() || a.name.len() > 256 {
                return Err(LoraConfigError::Name);
            }
            if a.path.trim().is_empty() || a.path.len() > 4096 {
                return Err(LoraConfigError::Path { adapter: a.name.clone() });
            }
            if !seen.insert(a.name.as_str()) {
                return Err(LoraConfigError::Twice { adapter: a.name.clone() });
            }
        }
        Ok(())
    }
}

/// A LoRA catalogue refused by [`LoraConfig::validate`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoraConfigError {
    /// `load_timeout_secs` out of range.
    #[error("load_timeout_secs: expected 0 to 3600 seconds")]
    LoadTimeout,
    /// More than [`MAX_ADAPTERS`] adapters.
    #[error("adapters: at most {MAX_ADAPTERS}")]
    TooMany,
    /// An adapter name empty or over 256 bytes.
    #[error("adapters: a name is empty or longer than 256 bytes")]
    Name,
    /// An adapter path empty or over 4096 bytes.
    #[error("adapters: `{adapter}`: path is empty or longer than 4096 bytes")]
    Path {
        /// The adapter.
        adapter: String,
    },
    /// An adapter listed twice.
    #[error("adapters: `{adapter}` is listed twice")]
    Twice {
        /// The adapter.
        adapter: String,
    },
}

/// Why a worker did not load an adapter.
#[derive(Debug, thiserror::Error)]
enum LoadError {
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
    cfg: LoraConfig,
    by_name: HashMap<String, usize>,
    loading: Vec<tokio::sync::Mutex<()>>,
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

    fn adapter_slots(&self, w: &WorkerEntry) -> (usize, usize) {
        let slots = w.capacity().max_loras.unwrap_or(self.cfg.default_max_loras) as usize;
        let used = w.models.load().iter().filter(|m| self.by_name.contains_key(*m)).count();
        (slots, used)
    }
}

fn routable_with(s: &AppState, model: &str) -> bool {
    s.fleet.load().iter().any(|w| w.is_routable() && w.models.load().iter().any(|m| m == model))
}

/// Makes sure a routable worker has `model` loaded when it is a catalogue adapter: at once
/// when one has, else by asking workers to load it (see the module doc). Models outside
/// the catalogue pass through untouched.
///
/// # Errors
/// 503 naming the adapter when no worker could load it (none serves its base model, every
/// attempt failed, or `lora.load` is off).
pub async fn ensure_loaded(s: &Arc<AppState>, model: &str) -> Result<(), ApiError> {
    let Some(mux) = s.lora.as_ref() else { return Ok(()) };
    let Some(&i) = mux.by_name.get(model) else { return Ok(()) };
    if routable_with(s, model) {
        count_outcome(&s.metrics.lora_requests, "loaded");
        return Ok(());
    }
    let unavailable = |why: String| {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, format!("LoRA adapter `{model}`: {why}")).retry_after(1)
    };
    if !mux.cfg.load {
        count_outcome(&s.metrics.lora_requests, "unavailable");
        return Err(unavailable("no worker has it loaded and loading is off (`lora.load`)".into()));
    }
    let _one_load = mux.loading[i].lock().await;
    if routable_with(s, model) {
        // Loaded by the request this one waited for.
        count_outcome(&s.metrics.lora_requests, "loaded");
        return Ok(());
    }
    count_outcome(&s.metrics.lora_requests, "load");
    let adapter = &mux.cfg.adapters[i];
    let mut order: Vec<(bool, f64, u32, Arc<WorkerEntry>)> = s
        .fleet
        .load()
        .iter()
        .filter(|w| w.is_routable())
        .filter(|w| adapter.base.is_empty() || w.models.load().contains(&adapter.base))
        .map(|w| {
            let (slots, used) = mux.adapter_slots(w);
            let v = w.view();
            let util = f64::from(v.load()) / f64::from(v.capacity.max_concurrent.max(1));
            (used >= slots, util, w.id.0, Arc::clone(w))
        })
        .collect();
    order.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)).then(a.2.cmp(&b.2)));
    if order.is_empty() {
        let base = if adapter.base.is_empty() { "any model".to_string() } else { format!("`{}`", adapter.base) };
        return Err(unavailable(format!("no routable worker serves {base} to load it on")));
    }
    let mut last = String::new();
    for (_, _, _, w) in order.into_iter().take(MAX_LOAD_ATTEMPTS) {
        match load_on(s, &mux.cfg, &w, adapter).await {
            Ok(()) => {
                count_outcome(&s.metrics.lora_loads, "ok");
                tracing::info!(worker = %w.url, adapter = model, "LoRA adapter loaded");
                let listed = crate::health::fetch_models(&s.client, &w.url, s.cfg.health.timeout_secs).await;
                // An empty or failed listing keeps what the router knew (plus the adapter).
                let mut models = listed.filter(|m| !m.is_empty()).unwrap_or_else(|| w.models.load().as_ref().clone());
                if !models.iter().any(|m| m == model) {
                    // An engine that does not list adapters: trust its answer.
                    models.push(model.to_string());
                }
                s.admission.write().ensure_model(model);
                w.models.store(Arc::new(models));
                return Ok(());
            }
            Err(e) => {
                count_outcome(&s.metrics.lora_loads, "failed");
                tracing::warn!(worker = %w.url, adapter = model, error = %e, "LoRA adapter load failed; trying the next worker");
                last = e.to_string();
            }
        }
    }
    Err(unavailable(format!("no worker could load it; last error: {last}")))
}

/// Asks `w` to load `adapter`; an "already loaded" answer counts as loaded.
async fn load_on(s: &AppState, cfg: &LoraConfig, w: &WorkerEntry, adapter: &LoraAdapter) -> Result<(), LoadError> {
    let path = match cfg.api {
        LoraApi::Vllm => "/v1/load_lora_adapter",
        LoraApi::Sglang => "/load_lora_adapter",
    };
    let body = serde_json::json!({"lora_name": adapter.name, "lora_path": adapter.path});
    let r = s
        .client
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
    fn the_catalogue_is_checked() {
        let a = |name: &str| LoraAdapter { name: name.into(), path: "/a".into(), base: String::new() };
        let ok = LoraConfig { adapters: vec![a("x"), a("y")], ..LoraConfig::default() };
        assert!(ok.validate().is_ok());
        let twice = LoraConfig { adapters: vec![a("x"), a("x")], ..LoraConfig::default() };
        assert!(twice.validate().expect_err("twice").to_string().contains("twice"));
        let no_path =
            LoraConfig { adapters: vec![LoraAdapter { path: String::new(), ..a("x") }], ..LoraConfig::default() };
        assert!(no_path.validate().expect_err("path").to_string().contains("path"));
        assert!(Multiplexer::new(&LoraConfig::default()).is_none());
        assert!(Multiplexer::new(&ok).is_some_and(|m| m.is_adapter("y") && !m.is_adapter("z")));
    }
}
