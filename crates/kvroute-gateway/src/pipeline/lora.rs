//! The load stage: a catalogue LoRA adapter that no routable worker has is loaded on one
//! (`crate::lora` for the policy and its limits).

use crate::app::AppState;
use crate::fleet::WorkerEntry;
use crate::lora::MAX_LOAD_ATTEMPTS;
use crate::metrics::count_outcome;
use axum::http::StatusCode;
use kvroute_protocol::api_error::ApiError;
use std::sync::Arc;

fn routable_with(s: &AppState, model: &str) -> bool {
    s.fleet.load().iter().any(|w| w.is_routable() && w.models().iter().any(|m| m == model))
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
        .filter(|w| adapter.base.is_empty() || w.models().contains(&adapter.base))
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
        match crate::lora::load_on(&s.client, &mux.cfg, &w, adapter).await {
            Ok(()) => {
                count_outcome(&s.metrics.lora_loads, "ok");
                tracing::info!(worker = %w.url, adapter = model, "LoRA adapter loaded");
                let listed = crate::upstream::fetch_models(&s.client, &w.url, s.cfg.health.timeout_secs).await;
                // An empty or failed listing keeps what the router knew (plus the adapter).
                let mut models = listed.filter(|m| !m.is_empty()).unwrap_or_else(|| w.models().as_ref().clone());
                if !models.iter().any(|m| m == model) {
                    // An engine that does not list adapters: trust its answer.
                    models.push(model.to_string());
                }
                s.admission.write().ensure_model(model);
                w.set_models(models);
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
