//! Active health checks, model discovery, engine `/metrics` scraping and policy maintenance.

use crate::app::AppState;
use crate::config::HealthConfig;
use crate::fleet::WorkerEntry;
use crate::membership::{slot_routing_probe, tokenizer_parity};
use crate::metrics::WorkerLabel;
use crate::upstream::{GetError, fetch_models, get_text, probe_capacity, try_get_text};
use kvroute_core::types::Health;
use kvroute_protocol::engine_metrics::{engine_hit_ratio, engine_signals, metric_sum, slot_counts, sm_utilisation};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

/// One round of a worker's checks: `/health` against the thresholds (in or out of
/// routing), the inference probe of an ejected worker, its model list when due, and its
/// engine `/metrics` (`scrape_metrics`).
async fn check_one(s: Arc<AppState>, w: Arc<WorkerEntry>) {
    let h = &s.cfg.health;
    let url = w.url.to_string();
    let checked = try_get_text(&s.client, &format!("{url}{}", h.path), h.timeout_secs).await;
    let ok = matches!(checked, Ok((200, _)));
    let mut refresh_models = false;
    if ok {
        if count_success(h, &w) {
            refresh_models = w.models().is_empty();
            came_up(&s, &url, &w).await;
        }
    } else if count_failure(h, &w, &url, &checked) {
        went_down(&s, &url, &w);
    }
    // A worker ejected by failed requests answers `/health` but may fail every request:
    // only a real inference request readmits it, probed with capped exponential backoff.
    if ok && w.probe_due(s.now()) {
        probe_ejected(&s, &url, &w).await;
    }
    // Loaded models and LoRA adapters change at run time (vLLM and SGLang load adapters on
    // request): read them again every `models_refresh_secs`.
    let now = s.now().0;
    let every = (h.models_refresh_secs * 1e9) as u64;
    let last = w.models_read_at.load(Relaxed);
    refresh_models |= ok && every > 0 && now.saturating_sub(last) >= every;
    if refresh_models {
        read_models(&s, &url, &w, now).await;
    }
    if ok
        && s.cfg.scrape_metrics
        && let Some((200, body)) = get_text(&s.client, &format!("{url}/metrics"), h.timeout_secs).await
    {
        scrape(&s, &w, &body).await;
    }
}

/// Counts a passed `/health` check; `true` when the worker has just reached
/// `success_threshold` and is healthy again.
fn count_success(h: &HealthConfig, w: &WorkerEntry) -> bool {
    w.check_failures.store(0, Relaxed);
    if w.health() != Health::Healthy {
        let n = w.check_successes.fetch_add(1, Relaxed) + 1;
        if n >= h.success_threshold {
            w.set_health(Health::Healthy);
            w.check_successes.store(0, Relaxed);
            return true;
        }
    }
    false
}

/// Counts a failed `/health` check (logging why once per run of failures); `true` when a
/// healthy worker has just reached `failure_threshold` and is marked down.
fn count_failure(h: &HealthConfig, w: &WorkerEntry, url: &str, checked: &Result<(u16, String), GetError>) -> bool {
    w.check_successes.store(0, Relaxed);
    let n = w.check_failures.fetch_add(1, Relaxed) + 1;
    if n == h.failure_threshold {
        // Once per run of failures: why (a worker that never passed logs nothing else).
        let why = match checked {
            Ok((status, _)) => format!("status {status}"),
            Err(e) => e.causes.clone(),
        };
        tracing::warn!(worker = %url, reason = %why, failures = n, "health check failing");
    }
    if n >= h.failure_threshold && w.health() == Health::Healthy {
        // Requests waiting on it for a first byte fail over now (dispatch).
        w.mark_down();
        return true;
    }
    false
}

/// A worker back in routing: its gauge, its capacity probed again, and its tokenizer
/// parity checked when there is a local tokenizer.
async fn came_up(s: &Arc<AppState>, url: &str, w: &WorkerEntry) {
    s.metrics.worker_healthy.get_or_create(&WorkerLabel { worker: url.to_string() }).set(1);
    // A worker back from an outage may have been restarted with other settings.
    let probed = probe_capacity(&s.client, url, s.cfg.health.timeout_secs).await;
    w.set_capacity(crate::fleet::CapacitySource::Probed, Some(probed.0));
    if let Some(entry) = s.fleet.by_url(url) {
        tokio::spawn(slot_routing_probe(Arc::clone(s), entry));
    }
    if s.tokenizer.is_some() {
        tokio::spawn(tokenizer_parity(Arc::clone(s), url.to_string()));
    }
}

/// A worker out of routing: its gauge, and the state kept for it dropped.
fn went_down(s: &AppState, url: &str, w: &WorkerEntry) {
    s.metrics.worker_healthy.get_or_create(&WorkerLabel { worker: url.to_string() }).set(0);
    tracing::warn!(worker = %url, "health checks failing: out of routing");
    s.forget_worker(w.id);
}

/// Sends an ejected worker its due inference probe; it is back in routing when it passes.
async fn probe_ejected(s: &AppState, url: &str, w: &WorkerEntry) {
    let passed = inference_probe(s, w).await;
    w.probe_result(passed, s.now());
    if passed {
        tracing::info!(worker = %url, "inference probe passed: back in routing");
        s.metrics.worker_healthy.get_or_create(&WorkerLabel { worker: url.to_string() }).set(1);
    } else {
        tracing::warn!(worker = %url, "inference probe failed: stays out of routing");
    }
}

/// Reads a worker's models (`/v1/models`) and makes sure admission knows each; read at
/// `now`.
async fn read_models(s: &AppState, url: &str, w: &WorkerEntry, now: u64) {
    if let Some(models) = fetch_models(&s.client, url, s.cfg.health.timeout_secs).await
        // A worker that listed models and now lists none (its `/v1/models` failing for a
        // moment) keeps its list rather than becoming a worker that serves any name.
        && (!models.is_empty() || w.models().is_empty())
    {
        w.models_read_at.store(now, Relaxed);
        {
            let mut adm = s.admission.write();
            for m in &models {
                adm.ensure_model(m);
            }
        }
        w.set_models(models);
    }
}

/// Stores a worker's engine signals from its `/metrics` body (and llama.cpp's `/slots`).
async fn scrape(s: &AppState, w: &WorkerEntry, body: &str) {
    let url = &*w.url;
    let (q, mut r, u) = engine_signals(body);
    // llama.cpp: its slots bound what it runs at once; the busy ones are running.
    let mut slots = None;
    if body.contains("llamacpp:")
        && let Some((200, text)) = get_text(&s.client, &format!("{url}/slots"), s.cfg.health.timeout_secs).await
        && let Some((n, busy)) = slot_counts(&text)
    {
        slots = Some(n);
        r = Some(busy);
        s.metrics.worker_slots.get_or_create(&WorkerLabel { worker: url.to_string() }).set(i64::from(n));
    }
    let hit = engine_hit_ratio(body);
    if let Some(x) = hit {
        s.metrics.engine_prefix_hit_ratio.get_or_create(&WorkerLabel { worker: url.to_string() }).set(x);
    }
    let sig = &w.signals;
    sig.queue.set(q);
    sig.running.set(r);
    sig.kv_cache_usage.set(u);
    let watts = match (s.cfg.power_metric.as_deref().filter(|m| !m.is_empty()), &s.cfg.power_exporter) {
        (None, _) => None,
        (Some(name), None) => metric_sum(body, name),
        (Some(name), Some(template)) => {
            let host = url::Url::parse(url).ok().and_then(|u| u.host_str().map(str::to_string)).unwrap_or_default();
            let exporter = template.replace("{host}", &host);
            match get_text(&s.client, &exporter, s.cfg.health.timeout_secs).await {
                Some((200, text)) => metric_sum(&text, name),
                _ => None,
            }
        }
    };
    let window = Duration::from_secs_f64(s.cfg.power_window_secs);
    sig.power_watts.set(w.power.lock().observe(Instant::now(), watts, window));
    sig.sm_util.set(sm_utilisation(body));
    sig.slots.set(slots);
    sig.hit_ratio.set(hit);
    w.signals_stored();
}

/// One real inference request (a one-token completion of the worker's first model): what
/// readmits a worker that failed requests, since its `/health` may pass while inference fails.
async fn inference_probe(s: &AppState, w: &WorkerEntry) -> bool {
    let model = w.models().first().cloned().unwrap_or_default();
    let body = serde_json::json!({"model": model, "prompt": "ping", "max_tokens": 1, "stream": false});
    let timeout = Duration::from_secs_f64(s.cfg.health.timeout_secs.max(1.0) * 5.0);
    let r = s.client.post(format!("{}/v1/completions", w.url)).timeout(timeout).json(&body).send().await;
    matches!(r, Ok(r) if r.status().is_success())
}

/// Background loop: active health checks every `health.interval_secs` and policy
/// maintenance on the policy's own interval, until `cancel`.
pub async fn run_background(s: Arc<AppState>, cancel: tokio_util::sync::CancellationToken) {
    let mut checks = tokio::time::interval(Duration::from_secs_f64(s.cfg.health.interval_secs));
    checks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = cancel.cancelled() => break,
            _ = checks.tick() => {
                let list: Vec<Arc<WorkerEntry>> = s.fleet.load().iter().cloned().collect();
                let jobs = list.into_iter().map(|w| check_one(Arc::clone(&s), w));
                tokio::select! {
                    () = cancel.cancelled() => break,
                    _ = futures_util::future::join_all(jobs) => {}
                }
            }
            _ = tick.tick() => {
                // Each model's router evicts in bounded slices on the blocking pool, so no
                // decision waits behind a whole pass and the runtime's threads stay free.
                let routers: Vec<_> = s.all_routers().iter().flat_map(|r| r.all()).collect();
                let now = s.now();
                let _ = tokio::task::spawn_blocking(move || routers.iter().for_each(|r| r.maintain_if_due(now))).await;
                let size: u64 = s.all_routers().iter().map(|r| r.index_size()).sum();
                s.metrics.index_size.set(size.min(i64::MAX as u64) as i64);
            }
        }
    }
}
