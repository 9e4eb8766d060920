//! Engine load and cache signals parsed from what inference engines export: Prometheus
//! text from `/metrics` (vLLM `vllm:*`, SGLang `sglang:*`, llama.cpp `llamacpp:*`, NVIDIA
//! DCGM `DCGM_FI_*`) and llama.cpp's `GET /slots` JSON. Pure functions over the body text;
//! the gateway scrapes, the engine simulator exports the same names.

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

/// vLLM's KV cache size from its Prometheus text: the `vllm:cache_config_info` info
/// metric's `num_gpu_blocks` × `block_size` labels (vLLM ≥ 0.4 exports it); `None` when
/// the metric or a label is missing or not a positive integer.
pub fn vllm_kv_tokens(metrics: &str) -> Option<u64> {
    let line = metrics.lines().find(|l| l.starts_with("vllm:cache_config_info{"))?;
    let labels = &line[line.find('{')? + 1..line.rfind('}')?];
    let label = |name: &str| -> Option<u64> {
        labels.split(',').find_map(|kv| {
            let (k, v) = kv.split_once('=')?;
            (k.trim() == name).then(|| v.trim().trim_matches('"').parse::<u64>().ok()).flatten()
        })
    };
    label("num_gpu_blocks")?.checked_mul(label("block_size")?).filter(|&n| n > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_kv_cache_size_from_its_cache_config_info() {
        // vLLM's Prometheus info metric (vLLM 0.6 prints the labels in this order).
        let metrics = "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
            # TYPE vllm:cache_config_info gauge\n\
            vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",\
            gpu_memory_utilization=\"0.9\",num_cpu_blocks=\"2048\",num_gpu_blocks=\"27024\",\
            num_gpu_blocks_override=\"None\",sliding_window=\"None\",swap_space_bytes=\"4294967296\"} 1.0\n";
        assert_eq!(vllm_kv_tokens(metrics), Some(27_024 * 16));
        // Missing, unparsable or zero: unknown.
        assert_eq!(vllm_kv_tokens("vllm:num_requests_running 0\n"), None);
        assert_eq!(vllm_kv_tokens("vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"None\"} 1.0\n"), None);
        assert_eq!(vllm_kv_tokens("vllm:cache_config_info{block_size=\"0\",num_gpu_blocks=\"8\"} 1.0\n"), None);
    }

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
