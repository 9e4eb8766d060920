//! Active health checks, model discovery, engine `/metrics` scraping and policy maintenance.

use crate::fleet::WorkerEntry;
use crate::metrics::WorkerLabel;
use crate::state::AppState;
use kvroute_core::types::Health;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

/// Largest `/metrics` or `/v1/models` body read from a worker.
const MAX_SCRAPE_BYTES: usize = 4 << 20;

async fn get_text(client: &reqwest::Client, url: &str, timeout_secs: f64) -> Option<(u16, String)> {
    let resp = client.get(url).timeout(Duration::from_secs_f64(timeout_secs)).send().await.ok()?;
    let status = resp.status().as_u16();
    if resp.content_length().is_some_and(|n| n > MAX_SCRAPE_BYTES as u64) {
        return Some((status, String::new()));
    }
    let body = resp.bytes().await.ok()?;
    if body.len() > MAX_SCRAPE_BYTES {
        return Some((status, String::new()));
    }
    Some((status, String::from_utf8_lossy(&body).into_owned()))
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

/// Sum of every sample of metric `name` (any labels) in a Prometheus text body.
pub fn metric_sum(body: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in body.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some(rest) = line.strip_prefix(name) else { continue };
        let rest = match rest.as_bytes().first() {
            Some(b'{') => rest.split_once('}').map_or("", |(_, r)| r),
            Some(b' ') => rest,
            _ => continue,
        };
        if let Some(v) = rest.split_whitespace().next().and_then(|v| v.parse::<f64>().ok())
            && v.is_finite()
        {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

/// Engine load signals from a `/metrics` body: (queue, running, KV usage in [0, 1]) for
/// vLLM (`vllm:`), SGLang (`sglang:`) or llama.cpp (`llamacpp:`) names.
pub fn engine_signals(body: &str) -> (Option<u32>, Option<u32>, Option<f64>) {
    let queue = metric_sum(body, "vllm:num_requests_waiting")
        .or_else(|| metric_sum(body, "sglang:num_queue_reqs"))
        .or_else(|| metric_sum(body, "llamacpp:requests_deferred"));
    let running = metric_sum(body, "vllm:num_requests_running")
        .or_else(|| metric_sum(body, "sglang:num_running_reqs"))
        .or_else(|| metric_sum(body, "llamacpp:requests_processing"));
    let usage = metric_sum(body, "vllm:kv_cache_usage_perc")
        .or_else(|| metric_sum(body, "vllm:gpu_cache_usage_perc"))
        .or_else(|| metric_sum(body, "sglang:token_usage"))
        .or_else(|| metric_sum(body, "llamacpp:kv_cache_usage_ratio"));
    (queue.map(|v| v.max(0.0) as u32), running.map(|v| v.max(0.0) as u32), usage.map(|v| v.clamp(0.0, 1.0)))
}

/// Engine-reported prefix-cache hit ratio of prompt tokens in [0, 1] from a `/metrics`
/// body: llama.cpp `prompt_tokens_cached_total / (cached + prompt_tokens_total)` (its
/// `prompt_tokens_total` counts only the tokens it processed), vLLM
/// `prefix_cache_hits_total / prefix_cache_queries_total`, SGLang `cache_hit_rate`.
/// `None` before any prompt token or when the engine exports none of them.
pub fn engine_hit_ratio(body: &str) -> Option<f64> {
    let ratio = |num: f64, den: f64| (den > 0.0).then(|| (num / den).clamp(0.0, 1.0));
    if let (Some(c), Some(p)) =
        (metric_sum(body, "llamacpp:prompt_tokens_cached_total"), metric_sum(body, "llamacpp:prompt_tokens_total"))
    {
        return ratio(c, c + p);
    }
    if let (Some(h), Some(q)) =
        (metric_sum(body, "vllm:prefix_cache_hits_total"), metric_sum(body, "vllm:prefix_cache_queries_total"))
    {
        return ratio(h, q);
    }
    metric_sum(body, "sglang:cache_hit_rate").map(|v| v.clamp(0.0, 1.0))
}

/// (slots, busy slots) from a llama.cpp `GET /slots` body (an array of slots with
/// `is_processing`); `None` when it is not one.
pub fn slot_counts(body: &str) -> Option<(u32, u32)> {
    let v: serde_json::Value = serde_json::from_str(body).ok()?;
    let slots = v.as_array().filter(|a| !a.is_empty())?;
    let busy =
        slots.iter().filter(|s| s.get("is_processing").and_then(serde_json::Value::as_bool) == Some(true)).count();
    Some((slots.len().min(u32::MAX as usize) as u32, busy.min(u32::MAX as usize) as u32))
}

/// Compute utilisation in [0, 1] from a `/metrics` body: NVIDIA DCGM's SM activity
/// (`DCGM_FI_PROF_SM_ACTIVE`, a ratio) or GPU utilisation (`DCGM_FI_DEV_GPU_UTIL`, percent),
/// averaged over the GPUs listed. Cognitora cgn-router's `sm_pct` term of kv_score. `None` when absent.
pub fn sm_utilisation(body: &str) -> Option<f64> {
    let avg = |name: &str| {
        let n = body.lines().filter(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{'])).count();
        metric_sum(body, name).map(|v| v / n.max(1) as f64)
    };
    avg("DCGM_FI_PROF_SM_ACTIVE").or_else(|| avg("DCGM_FI_DEV_GPU_UTIL").map(|p| p / 100.0)).map(|v| v.clamp(0.0, 1.0))
}

async fn check_one(s: Arc<AppState>, w: Arc<WorkerEntry>) {
    let h = &s.cfg.health;
    let url = w.url.to_string();
    let ok = matches!(get_text(&s.client, &format!("{url}{}", h.path), h.timeout_secs).await, Some((200, _)));
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
        if n >= h.failure_threshold && w.health() == Health::Healthy {
            w.set_health(Health::Unhealthy);
            healthy_now = Some(false);
        }
    }
    if let Some(hn) = healthy_now {
        s.metrics.worker_healthy.get_or_create(&WorkerLabel { worker: url.clone() }).set(i64::from(hn));
        if hn && s.tokenizer.is_some() {
            tokio::spawn(tokenizer_parity(Arc::clone(&s), url.clone()));
        }
        if !hn {
            tracing::warn!(worker = %url, "health checks failing: out of routing");
            s.routers.worker_removed(w.id);
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
    if refresh_models && let Some(models) = fetch_models(&s.client, &url, h.timeout_secs).await {
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
    sig.power_watts.set(s.cfg.power_metric.as_deref().and_then(|name| metric_sum(body, name)));
    sig.sm_util.set(sm_utilisation(body));
    sig.slots.set(slots);
    sig.hit_ratio.set(hit);
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
    let local = tk.request_tokens(crate::request::Api::Chat, &probe);
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
                let routers = s.routers.all();
                let now = s.now();
                let _ = tokio::task::spawn_blocking(move || routers.iter().for_each(|r| r.maintain_if_due(now))).await;
                let size = s.routers.index_size();
                s.metrics.index_size.set(size.min(i64::MAX as u64) as i64);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_hit_ratio_from_each_engine() {
        // llama.cpp: 150 cached of 200 prompt tokens (50 processed).
        let llama = "llamacpp:prompt_tokens_total 50\nllamacpp:prompt_tokens_cached_total 150\n";
        assert_eq!(engine_hit_ratio(llama), Some(0.75));
        assert_eq!(engine_hit_ratio("llamacpp:prompt_tokens_total 0\nllamacpp:prompt_tokens_cached_total 0\n"), None);
        let vllm =
            "vllm:prefix_cache_queries_total{engine=\"0\"} 400\nvllm:prefix_cache_hits_total{engine=\"0\"} 100\n";
        assert_eq!(engine_hit_ratio(vllm), Some(0.25));
        assert_eq!(engine_hit_ratio("sglang:cache_hit_rate 0.5\n"), Some(0.5));
        assert_eq!(engine_hit_ratio("other 1\n"), None);
    }

    #[test]
    fn slot_counts_from_llama_slots() {
        let body = r#"[{"id":0,"n_ctx":4096,"is_processing":true},{"id":1,"n_ctx":4096,"is_processing":false}]"#;
        assert_eq!(slot_counts(body), Some((2, 1)));
        assert_eq!(slot_counts("[]"), None);
        assert_eq!(slot_counts("{\"error\": 1}"), None);
        assert_eq!(slot_counts("not json"), None);
    }

    #[test]
    fn parses_sm_utilisation_from_dcgm() {
        assert_eq!(sm_utilisation("DCGM_FI_PROF_SM_ACTIVE 0.5\n"), Some(0.5));
        // Two GPUs: averaged, not summed.
        let two = "DCGM_FI_PROF_SM_ACTIVE{gpu=\"0\"} 0.2\nDCGM_FI_PROF_SM_ACTIVE{gpu=\"1\"} 0.6\n";
        assert!(sm_utilisation(two).is_some_and(|u| (u - 0.4).abs() < 1e-9));
        assert_eq!(sm_utilisation("DCGM_FI_DEV_GPU_UTIL{gpu=\"0\"} 75\n"), Some(0.75));
        assert_eq!(sm_utilisation("vllm:num_requests_running 3\n"), None);
    }

    #[test]
    fn parses_engine_gauges() {
        let body = "# HELP x\nvllm:num_requests_waiting{model_name=\"m\"} 3.0\nvllm:num_requests_running{model_name=\"m\"} 5\nvllm:kv_cache_usage_perc{model_name=\"m\"} 0.25\nvllm:num_requests_waiting_total 9\n";
        assert_eq!(engine_signals(body), (Some(3), Some(5), Some(0.25)));
        assert_eq!(engine_signals("sglang:num_queue_reqs 2\nsglang:token_usage 0.5\n"), (Some(2), None, Some(0.5)));
        assert_eq!(
            metric_sum(
                "DCGM_FI_DEV_POWER_USAGE{gpu=\"0\"} 100\nDCGM_FI_DEV_POWER_USAGE{gpu=\"1\"} 50\n",
                "DCGM_FI_DEV_POWER_USAGE"
            ),
            Some(150.0)
        );
    }
}
