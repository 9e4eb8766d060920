//! Active health checks, model discovery, engine `/metrics` scraping and policy maintenance.

use crate::metrics::WorkerLabel;
use crate::state::AppState;
use kvroute_core::types::{Health, WorkerId};
use std::sync::Arc;
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

/// Compute utilisation in [0, 1] from a `/metrics` body: NVIDIA DCGM's SM activity
/// (`DCGM_FI_PROF_SM_ACTIVE`, a ratio) or GPU utilisation (`DCGM_FI_DEV_GPU_UTIL`, percent),
/// averaged over the GPUs listed. Seed 001's `sm_pct` term of kv_score. `None` when absent.
pub fn sm_utilisation(body: &str) -> Option<f64> {
    let avg = |name: &str| {
        let n = body.lines().filter(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{'])).count();
        metric_sum(body, name).map(|v| v / n.max(1) as f64)
    };
    avg("DCGM_FI_PROF_SM_ACTIVE").or_else(|| avg("DCGM_FI_DEV_GPU_UTIL").map(|p| p / 100.0)).map(|v| v.clamp(0.0, 1.0))
}

async fn check_one(s: Arc<AppState>, id: u32, url: String) {
    let h = &s.cfg.health;
    let ok = matches!(get_text(&s.client, &format!("{url}{}", h.path), h.timeout_secs).await, Some((200, _)));
    let mut refresh_models = false;
    let mut removed = false;
    let mut healthy_now = None;
    {
        let mut ws = s.workers.write();
        let Some(w) = ws.iter_mut().find(|w| w.id == id) else { return };
        if ok {
            w.check_failures = 0;
            if w.health != Health::Healthy {
                w.check_successes += 1;
                if w.check_successes >= h.success_threshold {
                    w.health = Health::Healthy;
                    w.consecutive_failures = 0;
                    w.check_successes = 0;
                    healthy_now = Some(true);
                    refresh_models = w.models.is_empty();
                }
            }
        } else {
            w.check_successes = 0;
            w.check_failures += 1;
            if w.check_failures >= h.failure_threshold && w.health == Health::Healthy {
                w.health = Health::Unhealthy;
                removed = true;
                healthy_now = Some(false);
            }
        }
    }
    if let Some(hn) = healthy_now {
        s.metrics.worker_healthy.get_or_create(&WorkerLabel { worker: url.clone() }).set(i64::from(hn));
    }
    if removed {
        tracing::warn!(worker = %url, "health checks failing: out of routing");
        s.policy.lock().policy.on_worker_removed(WorkerId(id));
    }
    if refresh_models && let Some(models) = fetch_models(&s.client, &url, h.timeout_secs).await {
        {
            let mut adm = s.admission.write();
            for m in &models {
                adm.ensure_model(m);
            }
        }
        if let Some(w) = s.workers.write().iter_mut().find(|w| w.id == id) {
            w.models = models;
        }
    }
    if ok
        && s.cfg.scrape_metrics
        && let Some((200, body)) = get_text(&s.client, &format!("{url}/metrics"), h.timeout_secs).await
    {
        let (q, r, u) = engine_signals(&body);
        let p = s.cfg.power_metric.as_deref().and_then(|name| metric_sum(&body, name));
        let sm = sm_utilisation(&body);
        if let Some(w) = s.workers.write().iter_mut().find(|w| w.id == id) {
            (w.engine_queue, w.engine_running, w.kv_cache_usage, w.power_watts, w.sm_util) = (q, r, u, p, sm);
        }
    }
}

/// Background loop: active health checks every `health.interval_secs` and policy
/// maintenance on the policy's own interval, until `cancel`.
pub async fn run_background(s: Arc<AppState>, cancel: tokio_util::sync::CancellationToken) {
    let mut checks = tokio::time::interval(Duration::from_secs_f64(s.cfg.health.interval_secs));
    checks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut next_maintain = s.policy.lock().policy.maintenance_interval().map(|i| s.now().saturating_add(i));
    loop {
        tokio::select! {
            () = cancel.cancelled() => break,
            _ = checks.tick() => {
                let list: Vec<(u32, String)> = s.workers.read().iter().map(|w| (w.id, w.url.clone())).collect();
                let jobs = list.into_iter().map(|(id, url)| check_one(Arc::clone(&s), id, url));
                tokio::select! {
                    () = cancel.cancelled() => break,
                    _ = futures_util::future::join_all(jobs) => {}
                }
            }
            _ = tick.tick() => {
                let now = s.now();
                if let Some(t) = next_maintain && now >= t {
                    let mut p = s.policy.lock();
                    p.policy.maintain(now);
                    next_maintain = p.policy.maintenance_interval().map(|i| now.saturating_add(i));
                }
                let size = s.policy.lock().policy.index_size();
                s.metrics.index_size.set(size.min(i64::MAX as u64) as i64);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
