//! Active health checks, model discovery, engine `/metrics` scraping and policy maintenance.

use crate::fleet::WorkerEntry;
use crate::metrics::WorkerLabel;
use crate::state::AppState;
use kvroute_core::types::Health;
use kvroute_protocol::engine_metrics::{engine_hit_ratio, engine_signals, metric_sum, slot_counts, sm_utilisation};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

/// Largest `/metrics` or `/v1/models` body read from a worker.
const MAX_SCRAPE_BYTES: usize = 4 << 20;

async fn get_text(client: &reqwest::Client, url: &str, timeout_secs: f64) -> Option<(u16, String)> {
    try_get_text(client, url, timeout_secs).await.ok()
}

/// A `GET` that got no answer: the error with its causes (a refused connection, an
/// untrusted certificate, a timeout).
#[derive(Debug, thiserror::Error)]
#[error("GET {url}: {causes}")]
struct GetError {
    url: String,
    causes: String,
}

/// `GET url`: the status and body (empty when over [`MAX_SCRAPE_BYTES`]), or [`GetError`].
async fn try_get_text(client: &reqwest::Client, url: &str, timeout_secs: f64) -> Result<(u16, String), GetError> {
    let fail = |e: reqwest::Error| GetError { url: url.to_string(), causes: causes(&e) };
    let resp = client.get(url).timeout(Duration::from_secs_f64(timeout_secs)).send().await.map_err(fail)?;
    let status = resp.status().as_u16();
    if resp.content_length().is_some_and(|n| n > MAX_SCRAPE_BYTES as u64) {
        return Ok((status, String::new()));
    }
    let body = resp.bytes().await.map_err(fail)?;
    if body.len() > MAX_SCRAPE_BYTES {
        return Ok((status, String::new()));
    }
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// An error and its sources, `a: b: c` (reqwest's own message alone says only "error
/// sending request").
fn causes(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cur = c.source();
    }
    out
}

/// The models a worker serves from its `GET /v1/models`; `Some(vec![])` (any model) when it
/// has no such endpoint but answers `/health`; `None` when it is unreachable.
pub async fn fetch_models(client: &reqwest::Client, base: &str, timeout_secs: f64) -> Option<Vec<String>> {
    match get_text(client, &format!("{base}/v1/models"), timeout_secs).await {
        Some((200, body)) => {
            let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            let ids = v
                .get("data")
                .and_then(serde_json::Value::as_array)
                .map(|a| a.iter().filter_map(|m| m.get("id")?.as_str().map(str::to_string)).take(256).collect())
                .unwrap_or_default();
            Some(ids)
        }
        Some(_) => match get_text(client, &format!("{base}/health"), timeout_secs).await {
            Some((200, _)) => Some(Vec::new()),
            _ => None,
        },
        None => None,
    }
}

/// What a worker reports about its capacity, best effort (an endpoint it lacks or an
/// unknown value leaves the field unset):
/// - SGLang `GET /server_info`: `tp_size`, `dtype` (unless `auto`), `max_running_requests`
///   → `max_concurrent`, `context_length` → `max_model_len`, `max_total_num_tokens` →
///   `kv_tokens`, with LoRA on `max_loras_per_batch` → `max_loras`; kvroute engine-sim
///   adds `vram_gb`;
/// - llama.cpp `GET /props`: `total_slots` → `max_concurrent` and `llama_slots`,
///   `default_generation_settings.n_ctx` (a slot's context) → `max_model_len`, and times
///   `total_slots` → `kv_tokens`;
/// - vLLM `GET /v1/models`: the first model's `max_model_len`; `GET /metrics`:
///   `vllm:cache_config_info`'s `num_gpu_blocks` × `block_size` labels → `kv_tokens`.
///
/// Also returns the SGLang bootstrap port `/server_info` reports
/// (`disaggregation_bootstrap_port`), for a prefill worker given none.
pub async fn probe_capacity(
    client: &reqwest::Client,
    base: &str,
    timeout_secs: f64,
) -> (crate::cluster::Capacity, Option<u16>) {
    let json = |path: &'static str| async move {
        match get_text(client, &format!("{base}{path}"), timeout_secs).await {
            Some((200, body)) => serde_json::from_str::<serde_json::Value>(&body).ok(),
            _ => None,
        }
    };
    let metrics = async {
        match get_text(client, &format!("{base}/metrics"), timeout_secs).await {
            Some((200, body)) => kvroute_protocol::engine_metrics::vllm_kv_tokens(&body),
            _ => None,
        }
    };
    let (info, props, models, vllm_kv) =
        tokio::join!(json("/server_info"), json("/props"), json("/v1/models"), metrics);
    let port = info
        .as_ref()
        .and_then(|i| i.get("disaggregation_bootstrap_port"))
        .and_then(serde_json::Value::as_u64)
        .and_then(|p| u16::try_from(p).ok());
    let mut c = capacity_from(info.as_ref(), props.as_ref(), models.as_ref());
    c.kv_tokens = c.kv_tokens.or(vllm_kv);
    (c, port)
}

/// [`probe_capacity`]'s reading of the three answers.
pub fn capacity_from(
    info: Option<&serde_json::Value>,
    props: Option<&serde_json::Value>,
    models: Option<&serde_json::Value>,
) -> crate::cluster::Capacity {
    use serde_json::Value;
    let u32_of = |v: Option<&Value>| v.and_then(Value::as_u64).and_then(|n| u32::try_from(n).ok()).filter(|&n| n > 0);
    let mut c = crate::cluster::Capacity::default();
    if let Some(i) = info {
        c.tp_size = u32_of(i.get("tp_size"));
        c.dtype = i
            .get("dtype")
            .and_then(Value::as_str)
            .filter(|d| crate::cluster::dtype_bytes(d).is_some())
            .map(str::to_string);
        c.max_concurrent = u32_of(i.get("max_running_requests"));
        c.max_model_len = u32_of(i.get("context_length"));
        c.kv_tokens = i.get("max_total_num_tokens").and_then(Value::as_u64).filter(|&n| n > 0);
        c.vram_gb = i.get("vram_gb").and_then(Value::as_f64).filter(|v| v.is_finite() && *v > 0.0);
        let lora = i.get("enable_lora").and_then(Value::as_bool).unwrap_or(false)
            || i.get("lora_paths").is_some_and(|p| p.as_array().is_some_and(|a| !a.is_empty()) || p.is_object());
        if lora {
            c.max_loras = u32_of(i.get("max_loras_per_batch"));
        }
    }
    if let Some(p) = props {
        c.max_concurrent = c.max_concurrent.or(u32_of(p.get("total_slots")));
        c.llama_slots = u32_of(p.get("total_slots")).map(|n| n.min(kvroute_core::slots::MAX_SLOTS as u32));
        let n_ctx = u32_of(p.get("default_generation_settings").and_then(|d| d.get("n_ctx")));
        c.max_model_len = c.max_model_len.or(n_ctx);
        if let (Some(slots), Some(n)) = (u32_of(p.get("total_slots")), n_ctx) {
            c.kv_tokens = c.kv_tokens.or(Some(u64::from(slots) * u64::from(n)));
        }
    }
    if let Some(m) = models {
        let first = m.get("data").and_then(Value::as_array).and_then(|a| a.first());
        c.max_model_len = c.max_model_len.or(u32_of(first.and_then(|f| f.get("max_model_len"))));
    }
    c
}

async fn check_one(s: Arc<AppState>, w: Arc<WorkerEntry>) {
    let h = &s.cfg.health;
    let url = w.url.to_string();
    let checked = try_get_text(&s.client, &format!("{url}{}", h.path), h.timeout_secs).await;
    let ok = matches!(checked, Ok((200, _)));
    let mut refresh_models = false;
    let mut healthy_now = None;
    if ok {
        w.check_failures.store(0, Relaxed);
        if w.health() != Health::Healthy {
            let n = w.check_successes.fetch_add(1, Relaxed) + 1;
            if n >= h.success_threshold {
                w.set_health(Health::Healthy);
                w.check_successes.store(0, Relaxed);
                healthy_now = Some(true);
                refresh_models = w.models.load().is_empty();
            }
        }
    } else {
        w.check_successes.store(0, Relaxed);
        let n = w.check_failures.fetch_add(1, Relaxed) + 1;
        if n == h.failure_threshold {
            // Once per run of failures: why (a worker that never passed logs nothing else).
            let why = match &checked {
                Ok((status, _)) => format!("status {status}"),
                Err(e) => e.causes.clone(),
            };
            tracing::warn!(worker = %url, reason = %why, failures = n, "health check failing");
        }
        if n >= h.failure_threshold && w.health() == Health::Healthy {
            // Requests waiting on it for a first byte fail over now (dispatch).
            w.mark_down();
            healthy_now = Some(false);
        }
    }
    if let Some(hn) = healthy_now {
        s.metrics.worker_healthy.get_or_create(&WorkerLabel { worker: url.clone() }).set(i64::from(hn));
        if hn {
            // A worker back from an outage may have been restarted with other settings.
            let probed = probe_capacity(&s.client, &url, h.timeout_secs).await;
            w.set_capacity(crate::fleet::CapacitySource::Probed, Some(probed.0));
        }
        if hn && s.tokenizer.is_some() {
            tokio::spawn(tokenizer_parity(Arc::clone(&s), url.clone()));
        }
        if !hn {
            tracing::warn!(worker = %url, "health checks failing: out of routing");
            s.forget_worker(w.id);
        }
    }
    // A worker ejected by failed requests answers `/health` but may fail every request:
    // only a real inference request readmits it, probed with capped exponential backoff.
    if ok && w.probe_due(s.now()) {
        let passed = inference_probe(&s, &w).await;
        w.probe_result(passed, s.now());
        if passed {
            tracing::info!(worker = %url, "inference probe passed: back in routing");
            s.metrics.worker_healthy.get_or_create(&WorkerLabel { worker: url.clone() }).set(1);
        } else {
            tracing::warn!(worker = %url, "inference probe failed: stays out of routing");
        }
    }
    // Loaded models and LoRA adapters change at run time (vLLM and SGLang load adapters on
    // request): read them again every `models_refresh_secs`.
    let now = s.now().0;
    let every = (h.models_refresh_secs * 1e9) as u64;
    let last = w.models_read_at.load(Relaxed);
    refresh_models |= ok && every > 0 && now.saturating_sub(last) >= every;
    if refresh_models
        && let Some(models) = fetch_models(&s.client, &url, h.timeout_secs).await
        // A worker that listed models and now lists none (its `/v1/models` failing for a
        // moment) keeps its list rather than becoming a worker that serves any name.
        && (!models.is_empty() || w.models.load().is_empty())
    {
        w.models_read_at.store(now, Relaxed);
        {
            let mut adm = s.admission.write();
            for m in &models {
                adm.ensure_model(m);
            }
        }
        w.models.store(Arc::new(models));
    }
    if ok
        && s.cfg.scrape_metrics
        && let Some((200, body)) = get_text(&s.client, &format!("{url}/metrics"), h.timeout_secs).await
    {
        scrape(&s, &w, &body).await;
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
}

/// Most power readings kept per worker (a 30 s window at the fastest health interval).
pub const POWER_SAMPLES: usize = 1024;

/// A worker's recent power readings: their mean over the window (Cognitora cgn-router's
/// rolling average), so one scrape's spike moves routing by its share of the window only.
#[derive(Debug, Default)]
pub struct PowerWindow {
    samples: std::collections::VecDeque<(Instant, f64)>,
}

impl PowerWindow {
    /// Adds `reading` (watts; `None` when the scrape had none) taken at `now`, forgets
    /// readings older than `window`, and returns the mean of those left (`None` without
    /// any). A zero window keeps only the last reading.
    pub fn observe(&mut self, now: Instant, reading: Option<f64>, window: Duration) -> Option<f64> {
        if let Some(x) = reading.filter(|x| x.is_finite() && *x >= 0.0) {
            if self.samples.len() >= POWER_SAMPLES {
                self.samples.pop_front();
            }
            self.samples.push_back((now, x));
        }
        while let Some(&(t, _)) = self.samples.front() {
            let keep = if window.is_zero() { self.samples.len() == 1 } else { now.duration_since(t) <= window };
            if keep {
                break;
            }
            self.samples.pop_front();
        }
        (!self.samples.is_empty()).then(|| self.samples.iter().map(|(_, x)| x).sum::<f64>() / self.samples.len() as f64)
    }
}

/// One real inference request (a one-token completion of the worker's first model): what
/// readmits a worker that failed requests, since its `/health` may pass while inference fails.
async fn inference_probe(s: &AppState, w: &WorkerEntry) -> bool {
    let model = w.models.load().first().cloned().unwrap_or_default();
    let body = serde_json::json!({"model": model, "prompt": "ping", "max_tokens": 1, "stream": false});
    let timeout = Duration::from_secs_f64(s.cfg.health.timeout_secs.max(1.0) * 5.0);
    let r = s.client.post(format!("{}/v1/completions", w.url)).timeout(timeout).json(&body).send().await;
    matches!(r, Ok(r) if r.status().is_success())
}

/// The probe chat of [`tokenizer_parity`]: digits, punctuation, contractions, non-ASCII text,
/// blank lines and a system message, the places where tokenizers differ.
fn parity_probe() -> serde_json::Value {
    serde_json::json!({"model": "", "messages": [
        {"role": "system", "content": "You route requests.  Answer in 3 words; don't explain.\n\n"},
        {"role": "user", "content": "Prix: 1234,56 € — naïve café? It's 10:45pm!\tOK\n  indented\n\nEnd."}
    ]})
}

/// The worker's own token ids of a chat body: vLLM/SGLang `POST /tokenize` with the
/// messages, else llama.cpp `POST /apply-template` then `POST /tokenize` of the prompt
/// (special tokens added and parsed, as its chat endpoint does). `None` when it has neither.
async fn worker_chat_tokens(
    client: &reqwest::Client,
    url: &str,
    body: &serde_json::Value,
    timeout: Duration,
) -> Option<Vec<u32>> {
    #[derive(serde::Deserialize)]
    struct Tokens {
        tokens: Vec<u32>,
    }
    let post = |path: &str, v: serde_json::Value| client.post(format!("{url}{path}")).timeout(timeout).json(&v).send();
    if let Ok(r) = post("/tokenize", body.clone()).await
        && r.status().is_success()
        && let Ok(t) = r.json::<Tokens>().await
        && !t.tokens.is_empty()
    {
        return Some(t.tokens);
    }
    let msgs = serde_json::json!({"messages": body.get("messages")?});
    let r = post("/apply-template", msgs).await.ok()?.error_for_status().ok()?;
    let prompt = r.json::<serde_json::Value>().await.ok()?.get("prompt")?.as_str()?.to_string();
    let r = post("/tokenize", serde_json::json!({"content": prompt, "add_special": true, "parse_special": true}))
        .await
        .ok()?
        .error_for_status()
        .ok()?;
    r.json::<Tokens>().await.ok().map(|t| t.tokens).filter(|t| !t.is_empty())
}

/// Startup tokenizer parity of one worker (run when it first becomes healthy): the local
/// tokenizer's ids of a probe chat must equal the worker's own. Sets
/// `kvroute_tokenizer_parity{worker}` to 1 (equal), 0 (different: logged as an error with
/// the first differing position; the routing keys of this fleet are then approximate) or
/// −1 (the worker exposes no tokenize endpoint, or the local tokenizer cannot render it).
pub async fn tokenizer_parity(s: Arc<AppState>, url: String) {
    let Some(tk) = s.tokenizer.clone() else { return };
    let mut probe = parity_probe();
    let model = s.fleet.by_url(&url).and_then(|w| w.models.load().first().cloned());
    probe["model"] = serde_json::Value::String(model.unwrap_or_default());
    let local = tk.request_tokens(kvroute_protocol::openai::Api::Chat, &probe);
    let remote =
        worker_chat_tokens(&s.client, &url, &probe, Duration::from_secs_f64(s.cfg.health.timeout_secs.max(5.0))).await;
    let v = match (local, remote) {
        (Ok(l), Some(r)) if l == r => {
            tracing::info!(worker = %url, tokens = l.len(), "local tokenizer matches the worker's");
            1
        }
        (Ok(l), Some(r)) => {
            let at = l.iter().zip(&r).position(|(a, b)| a != b).unwrap_or(l.len().min(r.len()));
            tracing::error!(
                worker = %url, local = l.len(), worker_tokens = r.len(), first_difference = at,
                "the local tokenizer ({}) does not give the worker's tokens: check --tokenizer", tk.source()
            );
            0
        }
        (local, remote) => {
            tracing::warn!(worker = %url, local_ok = local.is_ok(), worker_ok = remote.is_some(), "tokenizer parity inconclusive");
            -1
        }
    };
    s.metrics.tokenizer_parity.get_or_create(&WorkerLabel { worker: url }).set(v);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kv_cache_size_is_read_from_each_engine_s_own_report() {
        // SGLang `/server_info`.
        let info = serde_json::json!({"max_total_num_tokens": 420_000, "max_running_requests": 256});
        assert_eq!(capacity_from(Some(&info), None, None).kv_tokens, Some(420_000));
        // llama.cpp `/props`: 2 slots of 8,192 tokens each.
        let props = serde_json::json!({"total_slots": 2, "default_generation_settings": {"n_ctx": 8192}});
        let c = capacity_from(None, Some(&props), None);
        assert_eq!((c.kv_tokens, c.max_model_len, c.llama_slots), (Some(16_384), Some(8192), Some(2)));
        // vLLM's comes from `/metrics` (`kvroute_protocol::engine_metrics::vllm_kv_tokens`).
        // Zero: unknown.
        let none = serde_json::json!({"max_total_num_tokens": 0});
        assert_eq!(capacity_from(Some(&none), None, None).kv_tokens, None);
    }

    #[test]
    fn the_power_window_smooths_a_one_scrape_spike_and_forgets_old_readings() {
        let mut w = PowerWindow::default();
        let t0 = Instant::now();
        let win = Duration::from_secs(30);
        let mut last = None;
        for i in 0..10u64 {
            // One reading every 3 s; the fifth is a spike to 700 W over a 100 W baseline.
            let x = if i == 4 { 700.0 } else { 100.0 };
            last = w.observe(t0 + Duration::from_secs(3 * i), Some(x), win);
        }
        let mean = last.expect("a mean");
        assert!((mean - 160.0).abs() < 1e-9, "10 readings in the window, one of 700: {mean}");
        // 40 s later only fresh readings count; a scrape without the gauge adds nothing.
        assert_eq!(w.observe(t0 + Duration::from_secs(70), Some(300.0), win), Some(300.0));
        assert_eq!(w.observe(t0 + Duration::from_secs(71), None, win), Some(300.0));
        assert_eq!(w.observe(t0 + Duration::from_secs(200), None, win), None);
        // A zero window is the last reading.
        assert_eq!(w.observe(t0 + Duration::from_secs(201), Some(50.0), Duration::ZERO), Some(50.0));
        assert_eq!(w.observe(t0 + Duration::from_secs(202), Some(70.0), Duration::ZERO), Some(70.0));
    }
}
