//! The simulated worker's quality knob (logprobs), LoRA adapters and capacity facts, over
//! real HTTP on 127.0.0.1.
//!
//! Every client call has a generous hang guard (a failure, not a timing assertion); the
//! simulated clock runs 1000× faster than the profile so the tests are quick.

use kvroute_engine_sim::{self as engine_sim, EngineSimConfig, LoraCounters, prompt_mean_logprob};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

const BASE: &str = "sim-llama-3-8b";

fn fast() -> EngineSimConfig {
    EngineSimConfig { time_scale: 1000.0, ..EngineSimConfig::default() }
}

mod common;
use common::{Sim, sim};

impl Sim {
    /// GET `path` as JSON.
    async fn get(&self, path: &str) -> Value {
        serde_json::from_str(&self.get_text(path).await).expect("JSON")
    }

    /// The `data:` events of a streamed POST (without `[DONE]`).
    async fn stream(&self, path: &str, body: &Value) -> Vec<Value> {
        let (status, text) = self.post_text(path, body).await;
        assert_eq!(status, 200, "{text}");
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        text.lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str(d).expect("event JSON"))
            .collect()
    }

    async fn model_ids(&self) -> Vec<String> {
        let v = self.get("/v1/models").await;
        v["data"].as_array().expect("data").iter().map(|m| m["id"].as_str().expect("id").to_string()).collect()
    }
}

fn mean(v: &[f64]) -> f64 {
    assert!(!v.is_empty(), "no logprobs");
    v.iter().sum::<f64>() / v.len() as f64
}

fn assert_mean(lps: &[f64], want: f64, what: &str) {
    assert!(lps.iter().all(|&x| x <= 0.0 && x.is_finite()), "{what}: {lps:?}");
    let m = mean(lps);
    assert!((m - want).abs() < 1e-9, "{what}: mean {m}, want {want}");
}

/// Logprob values of a chat `logprobs.content` array.
fn chat_lps(lp: &Value) -> Vec<f64> {
    lp["content"].as_array().expect("content").iter().map(|e| e["logprob"].as_f64().expect("logprob")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_come_in_each_engines_shape_with_the_prompt_mean() {
    let s = sim(EngineSimConfig { quality: -0.7, quality_spread: 0.5, ..fast() }).await;
    let prompt = "Explain prefix caching to a new engineer.";
    let want = prompt_mean_logprob(&s.cfg, prompt);
    assert!((-1.2..=-0.2).contains(&want), "{want}");

    // Chat (OpenAI/vLLM): choices[0].logprobs.content[{token, logprob, bytes, top_logprobs}].
    let (st, v) = s
        .post(
            "/v1/chat/completions",
            &json!({"model": BASE, "messages": [{"role": "user", "content": prompt}], "max_tokens": 9, "logprobs": true}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    let content = v["choices"][0]["logprobs"]["content"].as_array().expect("content");
    assert_eq!(content.len(), 9);
    let mut joined = String::new();
    for e in content {
        let tok = e["token"].as_str().expect("token");
        let bytes: Vec<u8> =
            e["bytes"].as_array().expect("bytes").iter().map(|b| b.as_u64().expect("byte") as u8).collect();
        assert_eq!(bytes, tok.as_bytes());
        assert_eq!(e["top_logprobs"], json!([]));
        joined.push_str(tok);
    }
    assert_eq!(joined, v["choices"][0]["message"]["content"].as_str().expect("text"));
    assert_mean(&chat_lps(&v["choices"][0]["logprobs"]), want, "chat");

    // Completions (OpenAI legacy): tokens, token_logprobs, top_logprobs, text_offset.
    let (st, v) =
        s.post("/v1/completions", &json!({"model": BASE, "prompt": prompt, "max_tokens": 7, "logprobs": 1})).await;
    assert_eq!(st, 200, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    assert!(lp.get("content").is_none(), "not the chat shape: {lp}");
    let text = v["choices"][0]["text"].as_str().expect("text");
    let tokens = lp["tokens"].as_array().expect("tokens");
    let offsets = lp["text_offset"].as_array().expect("text_offset");
    let tops = lp["top_logprobs"].as_array().expect("top_logprobs");
    let lps: Vec<f64> =
        lp["token_logprobs"].as_array().expect("token_logprobs").iter().filter_map(Value::as_f64).collect();
    assert_eq!((tokens.len(), offsets.len(), tops.len(), lps.len()), (7, 7, 7, 7));
    for ((t, o), (top, l)) in tokens.iter().zip(offsets).zip(tops.iter().zip(&lps)) {
        let (t, o) = (t.as_str().expect("token"), o.as_u64().expect("offset") as usize);
        assert!(text[o..].starts_with(t), "offset {o} of {t:?} in {text:?}");
        assert_eq!(top[t].as_f64(), Some(*l), "top_logprobs holds the token");
    }
    assert_mean(&lps, want, "completions");
    // `logprobs: 0` asks too (no alternatives: null per token).
    let (_, v) =
        s.post("/v1/completions", &json!({"model": BASE, "prompt": prompt, "max_tokens": 3, "logprobs": 0})).await;
    assert_eq!(v["choices"][0]["logprobs"]["top_logprobs"], json!([null, null, null]));

    // SGLang /generate: meta_info.output_token_logprobs [[logprob, token_id, null], ...].
    let (st, v) = s
        .post("/generate", &json!({"text": prompt, "sampling_params": {"max_new_tokens": 6}, "return_logprob": true}))
        .await;
    assert_eq!(st, 200, "{v}");
    let out = v["meta_info"]["output_token_logprobs"].as_array().expect("output_token_logprobs");
    assert_eq!(out.len() as u64, v["meta_info"]["completion_tokens"].as_u64().expect("completion_tokens"));
    for e in out {
        assert!(e[1].is_u64() && e[2].is_null() && e.as_array().map(Vec::len) == Some(3), "{e}");
    }
    assert_mean(&out.iter().map(|e| e[0].as_f64().expect("logprob")).collect::<Vec<_>>(), want, "generate");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_logprobs_come_per_chunk_with_the_same_mean() {
    let s = sim(EngineSimConfig { quality: -1.5, quality_spread: 1.0, ..fast() }).await;
    let prompt = "Stream me a short answer about KV caches.";
    let want = prompt_mean_logprob(&s.cfg, prompt);
    let events = s
        .stream(
            "/v1/chat/completions",
            &json!({"model": BASE, "messages": [{"role": "user", "content": prompt}], "max_tokens": 11,
                "logprobs": true, "stream": true}),
        )
        .await;
    let mut lps = Vec::new();
    for e in events.iter().filter(|e| e["choices"][0]["delta"]["content"].is_string()) {
        let entry = chat_lps(&e["choices"][0]["logprobs"]);
        assert_eq!(entry.len(), 1, "one entry per chunk: {e}");
        assert_eq!(
            e["choices"][0]["logprobs"]["content"][0]["token"], e["choices"][0]["delta"]["content"],
            "the entry is the chunk's token"
        );
        lps.extend(entry);
    }
    assert_eq!(lps.len(), 11);
    assert_mean(&lps, want, "streamed chat");

    let events = s
        .stream(
            "/v1/completions",
            &json!({"model": BASE, "prompt": prompt, "max_tokens": 5, "logprobs": 2, "stream": true}),
        )
        .await;
    let lps: Vec<f64> = events
        .iter()
        .filter_map(|e| e["choices"][0]["logprobs"]["token_logprobs"].as_array())
        .flat_map(|a| a.iter().filter_map(Value::as_f64))
        .collect();
    assert_eq!(lps.len(), 5);
    assert_mean(&lps, want, "streamed completions");

    let events = s
        .stream(
            "/generate",
            &json!({"text": prompt, "sampling_params": {"max_new_tokens": 4}, "return_logprob": true, "stream": true}),
        )
        .await;
    let lps: Vec<f64> = events
        .iter()
        .filter_map(|e| e["meta_info"]["output_token_logprobs"].as_array())
        .flat_map(|a| a.iter().map(|x| x[0].as_f64().expect("logprob")))
        .collect();
    assert_eq!(lps.len(), 4);
    assert_mean(&lps, want, "streamed generate");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_logprobs_unless_asked() {
    let s = sim(EngineSimConfig { quality: -2.0, ..fast() }).await;
    let msgs = json!([{"role": "user", "content": "hi"}]);
    for body in [
        json!({"model": BASE, "messages": msgs, "max_tokens": 3}),
        json!({"model": BASE, "messages": msgs, "max_tokens": 3, "logprobs": false}),
    ] {
        let (st, v) = s.post("/v1/chat/completions", &body).await;
        assert_eq!(st, 200);
        assert!(v["choices"][0]["logprobs"].is_null(), "{v}");
    }
    let (st, v) = s.post("/v1/completions", &json!({"model": BASE, "prompt": "hi", "max_tokens": 3})).await;
    assert_eq!(st, 200);
    assert!(v["choices"][0]["logprobs"].is_null(), "{v}");
    let (st, v) = s.post("/generate", &json!({"text": "hi", "sampling_params": {"max_new_tokens": 3}})).await;
    assert_eq!(st, 200);
    assert!(v["meta_info"].get("output_token_logprobs").is_none(), "{v}");
    let events = s
        .stream("/v1/chat/completions", &json!({"model": BASE, "messages": msgs, "max_tokens": 3, "stream": true}))
        .await;
    assert!(events.iter().all(|e| e["choices"][0]["logprobs"].is_null()), "{events:?}");
    // A malformed completions `logprobs` is refused, naming the field.
    let (st, v) = s.post("/v1/completions", &json!({"model": BASE, "prompt": "hi", "logprobs": "yes"})).await;
    assert_eq!((st, v["error"]["param"].as_str()), (400, Some("logprobs")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spread_zero_is_exactly_quality_and_a_spread_separates_prompts() {
    let flat = EngineSimConfig { quality: -0.35, ..fast() };
    for p in ["a", "b", "", "a much longer prompt"] {
        assert_eq!(prompt_mean_logprob(&flat, p), -0.35);
    }
    assert_eq!(prompt_mean_logprob(&EngineSimConfig::default(), "x"), -0.1, "the default is the old constant");
    let s = sim(flat).await;
    let (_, v) =
        s.post("/v1/completions", &json!({"model": BASE, "prompt": "a", "max_tokens": 4, "logprobs": 1})).await;
    let lps: Vec<f64> = v["choices"][0]["logprobs"]["token_logprobs"]
        .as_array()
        .expect("lps")
        .iter()
        .filter_map(Value::as_f64)
        .collect();
    assert_mean(&lps, -0.35, "spread 0 over HTTP");
    assert!(lps.iter().all(|&x| x == -0.35), "spread 0: every token is exactly quality: {lps:?}");
    drop(s);

    let (q, spread) = (-1.0, 0.6);
    let s = sim(EngineSimConfig { quality: q, quality_spread: spread, ..fast() }).await;
    let mut means = Vec::new();
    for p in ["What is a KV cache?", "Write a haiku about routers."] {
        let (st, v) = s
            .post(
                "/v1/chat/completions",
                &json!({"model": BASE, "messages": [{"role": "user", "content": p}], "max_tokens": 8, "logprobs": true}),
            )
            .await;
        assert_eq!(st, 200);
        let m = mean(&chat_lps(&v["choices"][0]["logprobs"]));
        assert!((q - spread..=q + spread).contains(&m), "{m} outside [{}, {}]", q - spread, q + spread);
        assert!((m - prompt_mean_logprob(&s.cfg, p)).abs() < 1e-9);
        means.push(m);
    }
    assert!((means[0] - means[1]).abs() > 1e-6, "different prompts, different means: {means:?}");
    // The mean is clamped to <= 0 even when quality + spread would be positive.
    let near_zero = EngineSimConfig { quality: -0.01, quality_spread: 5.0, ..fast() };
    assert!((0..50).all(|i| prompt_mean_logprob(&near_zero, &format!("p{i}")) <= 0.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_range_settings_are_refused_at_start() {
    for (cfg, field) in [
        (EngineSimConfig { quality: 0.5, ..fast() }, "quality"),
        (EngineSimConfig { quality: f64::NAN, ..fast() }, "quality"),
        (EngineSimConfig { quality_spread: -1.0, ..fast() }, "quality_spread"),
        (EngineSimConfig { dtype: "fp4".into(), ..fast() }, "dtype"),
        (EngineSimConfig { tp_size: 0, ..fast() }, "tp_size"),
        (EngineSimConfig { vram_gb: 0.0, ..fast() }, "vram_gb"),
        (EngineSimConfig { loras: vec![("a".into(), "/a".into())], ..fast() }, "--lora-slots"),
    ] {
        let e = cfg.validate().expect_err(field);
        assert!(e.0.contains(field), "{e}");
        let e = engine_sim::spawn_local(cfg, CancellationToken::new()).await.expect_err(field);
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
    }
    assert_eq!(EngineSimConfig::default().validate(), Ok(()));
}

fn load(name: &str) -> Value {
    json!({"lora_name": name, "lora_path": format!("/adapters/{name}")})
}

fn chat(model: &str) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lora_slots_evict_the_least_recently_used_adapter() {
    let s = sim(EngineSimConfig { lora_slots: 2, ..fast() }).await;
    for name in ["A", "B"] {
        let (st, body) = s.post_text("/v1/load_lora_adapter", &load(name)).await;
        assert_eq!((st, body.as_str()), (200, format!("Success: LoRA adapter '{name}' added successfully.").as_str()));
    }
    let (st, v) = s.post("/v1/chat/completions", &chat("A")).await;
    assert_eq!((st, v["model"].as_str()), (200, Some("A")), "{v}");
    let (st, _) = s.post_text("/v1/load_lora_adapter", &load("C")).await;
    assert_eq!(st, 200);
    assert_eq!(s.sim.loaded_adapters(), ["A", "C"], "B was the least recently used");
    assert_eq!(s.model_ids().await, [BASE, "A", "C"]);
    let models = s.get("/v1/models").await;
    assert_eq!(models["data"][0]["parent"], Value::Null);
    assert_eq!(models["data"][0]["root"], BASE);
    assert_eq!(models["data"][2]["parent"], BASE);
    assert_eq!(models["data"][2]["root"], "/adapters/C");
    assert_eq!(models["data"][2]["max_model_len"], 131072);

    let (st, v) = s.post("/v1/chat/completions", &chat("B")).await;
    assert_eq!(st, 404);
    assert_eq!(v["error"]["message"], "The model `B` does not exist.");
    assert_eq!(v["error"]["param"], "model");
    let (st, v) = s.post("/v1/completions", &json!({"model": "A", "prompt": "x", "max_tokens": 2})).await;
    assert_eq!((st, v["model"].as_str()), (200, Some("A")));
    let (st, v) = s.post("/v1/chat/completions", &chat(BASE)).await;
    assert_eq!((st, v["model"].as_str()), (200, Some(BASE)), "the base model is still served");

    assert_eq!(
        s.sim.lora_counters(),
        LoraCounters { loads: 3, load_failures: 0, evictions: 1, requests: 2, loaded: 2 }
    );
    let metrics = s.get_text("/metrics").await;
    for line in [
        "kvroute_sim_lora_loads_total 3",
        "kvroute_sim_lora_evictions_total 1",
        "kvroute_sim_lora_requests_total 2",
        "kvroute_sim_lora_load_failures_total 0",
        "kvroute_sim_lora_loaded 2",
        "kvroute_sim_lora_slots 2",
    ] {
        assert!(metrics.lines().any(|l| l == line), "missing {line:?} in\n{metrics}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_lora_endpoints_answer_vllms_errors() {
    let s = sim(EngineSimConfig { lora_slots: 2, lora_fail: vec!["broken".into()], ..fast() }).await;
    assert_eq!(s.post_text("/v1/load_lora_adapter", &load("A")).await.0, 200);
    let (st, v) = s.post("/v1/load_lora_adapter", &load("A")).await;
    assert_eq!((st, v["error"]["message"].as_str()), (400, Some("The lora adapter 'A' has already been loaded.")));

    let (st, v) = s.post("/v1/load_lora_adapter", &load("broken")).await;
    assert_eq!(st, 400);
    assert_eq!(v["error"]["message"], "Loading lora broken failed: No adapter found for /adapters/broken");
    assert_eq!(s.sim.lora_counters().load_failures, 1);
    assert_eq!(s.sim.loaded_adapters(), ["A"], "a failed load changes nothing");

    let (st, v) = s.post("/v1/load_lora_adapter", &json!({"lora_name": "x"})).await;
    assert_eq!((st, v["error"]["param"].as_str()), (400, Some("lora_path")), "{v}");
    let (st, v) = s.post("/v1/load_lora_adapter", &json!({"lora_path": "/x"})).await;
    assert_eq!((st, v["error"]["param"].as_str()), (400, Some("lora_name")), "{v}");

    let (st, v) = s.post("/v1/unload_lora_adapter", &json!({"lora_name": "nope"})).await;
    assert_eq!(st, 404, "{v}");
    let (st, body) = s.post_text("/v1/unload_lora_adapter", &json!({"lora_name": "A"})).await;
    assert_eq!((st, body.as_str()), (200, "Success: LoRA adapter 'A' removed successfully."));
    assert_eq!(s.post("/v1/chat/completions", &chat("A")).await.0, 404, "unloaded adapters are not served");
    assert!(s.sim.loaded_adapters().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_loads_of_one_adapter_load_it_once() {
    // 100 simulated seconds = 0.1 s of wall time: long enough for the two loads to overlap.
    let s = sim(EngineSimConfig { lora_slots: 1, lora_load_secs: 100.0, ..fast() }).await;
    let body = load("A");
    let (a, b) = tokio::join!(s.post_text("/v1/load_lora_adapter", &body), s.post_text("/v1/load_lora_adapter", &body));
    let mut statuses = [a.0, b.0];
    statuses.sort_unstable();
    assert_eq!(statuses, [200, 400], "{a:?} {b:?}");
    let refused = if a.0 == 400 { a.1 } else { b.1 };
    assert!(refused.contains("has already been loaded"), "{refused}");
    assert_eq!(s.sim.lora_counters().loads, 1);
    assert_eq!(s.sim.loaded_adapters(), ["A"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_lora_endpoints_and_generate_lora_path() {
    let s = sim(EngineSimConfig { lora_slots: 2, lora_fail: vec!["bad".into()], ..fast() }).await;
    let (st, v) = s.post("/load_lora_adapter", &load("x")).await;
    assert_eq!(st, 200);
    assert_eq!(v, json!({"success": true, "error_message": "", "loaded_adapters": {"x": "/adapters/x"}}));
    let (st, v) = s.post("/load_lora_adapter", &load("bad")).await;
    assert_eq!((st, v["success"].as_bool()), (400, Some(false)));
    assert!(v["error_message"].as_str().is_some_and(|m| m.contains("bad")), "{v}");
    assert_eq!(v["loaded_adapters"], json!({"x": "/adapters/x"}));

    let (st, v) =
        s.post("/generate", &json!({"text": "hi", "lora_path": "x", "sampling_params": {"max_new_tokens": 2}})).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(s.sim.lora_counters().requests, 1);
    let (st, v) = s.post("/generate", &json!({"text": "hi", "lora_path": "y"})).await;
    assert_eq!((st, v["error"]["param"].as_str()), (400, Some("lora_path")), "{v}");

    let (st, v) = s.post("/unload_lora_adapter", &json!({"lora_name": "x"})).await;
    assert_eq!((st, &v), (200, &json!({"success": true, "error_message": "", "loaded_adapters": {}})));
    let (st, v) = s.post("/unload_lora_adapter", &json!({"lora_name": "x"})).await;
    assert_eq!((st, v["success"].as_bool()), (400, Some(false)), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lora_off_refuses_loads() {
    let s = sim(fast()).await;
    let (st, v) = s.post("/v1/load_lora_adapter", &load("A")).await;
    assert_eq!(st, 400);
    assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("LoRA is not enabled")), "{v}");
    let (st, v) = s.post("/load_lora_adapter", &load("A")).await;
    assert_eq!((st, v["success"].as_bool()), (400, Some(false)), "{v}");
    assert!(v["error_message"].as_str().is_some_and(|m| m.contains("LoRA is not enabled")), "{v}");
    let (st, _) = s.post("/v1/unload_lora_adapter", &json!({"lora_name": "A"})).await;
    assert_eq!(st, 400);
    let (st, v) = s.post("/generate", &json!({"text": "hi", "lora_path": "A"})).await;
    assert_eq!((st, v["error"]["param"].as_str()), (400, Some("lora_path")));
    assert_eq!(s.model_ids().await, [BASE]);
    assert_eq!(s.sim.lora_counters(), LoraCounters::default());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapter_kv_blocks_are_not_shared_with_the_base_model() {
    let s = sim(EngineSimConfig { lora_slots: 1, loras: vec![("tuned".into(), "/a/tuned".into())], ..fast() }).await;
    assert_eq!(s.sim.loaded_adapters(), ["tuned"], "preloaded");
    let prompt = "A long shared system prompt about routing. ".repeat(20);
    let cached = |v: &Value| v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached_tokens");
    let mut hits = Vec::new();
    for model in [BASE, BASE, "tuned", "tuned"] {
        let (st, v) = s.post("/v1/completions", &json!({"model": model, "prompt": prompt, "max_tokens": 2})).await;
        assert_eq!((st, v["model"].as_str()), (200, Some(model)));
        hits.push(cached(&v));
    }
    assert_eq!(hits[0], 0, "cold: {hits:?}");
    assert!(hits[1] > 100, "the base model's repeat hits: {hits:?}");
    assert_eq!(hits[2], 0, "the adapter does not reuse the base model's blocks: {hits:?}");
    assert!(hits[3] > 100, "the adapter's repeat hits its own blocks: {hits:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_info_reports_capacity() {
    let cfg = EngineSimConfig { tp_size: 4, dtype: "fp8".into(), vram_gb: 141.0, lora_slots: 3, ..fast() };
    let s = sim(cfg).await;
    let v = s.get("/server_info").await;
    let p = &s.cfg.profile;
    assert_eq!(v["tp_size"], 4);
    assert_eq!(v["dtype"], "fp8");
    assert_eq!(v["vram_gb"], 141.0);
    assert_eq!(v["max_running_requests"], p.max_batch);
    assert_eq!(v["max_total_num_tokens"], p.kv_tokens);
    assert_eq!(v["max_loras_per_batch"], 3);
    assert_eq!(v["enable_lora"], true);
    assert_eq!(v["mem_fraction_static"], 0.9);
    assert_eq!((v["model_path"].as_str(), v["dp_size"].as_u64()), (Some(BASE), Some(1)), "older fields kept");
    let models = s.get("/v1/models").await;
    assert_eq!(models["data"][0]["max_model_len"], 131072);

    let d = sim(fast()).await.get("/server_info").await;
    assert_eq!(
        (d["tp_size"].as_u64(), d["dtype"].as_str(), d["vram_gb"].as_f64()),
        (Some(1), Some("bfloat16"), Some(80.0))
    );
    assert_eq!((d["enable_lora"].as_bool(), d["max_loras_per_batch"].as_u64()), (Some(false), Some(0)));
}

/// Bodies up to the router's default `max_body_bytes` are read (axum's 2 MiB default made
/// the worker answer 413 and hang up before reading a larger one), and a prompt is judged
/// by its length as vLLM judges it: over `max_model_len` with `max_tokens`, a 400 naming
/// both counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_prompts_are_read_and_refused_by_the_context_length() {
    let s = sim(fast()).await;
    // ~3 MiB of text: ~786k tokens at 4 characters a token.
    let long = "word ".repeat(600_000);
    let body = json!({"model": BASE, "messages": [{"role": "user", "content": long}], "max_tokens": 5});
    let (status, text) = s.post_text("/v1/chat/completions", &body).await;
    assert_eq!(status, 400, "{text}");
    let v: Value = serde_json::from_str(&text).expect("JSON");
    let m = v["error"]["message"].as_str().expect("message");
    assert!(m.starts_with("This model's maximum context length is 131072 tokens."), "{m}");
    assert!(m.contains("5 in the completion"), "{m}");
    assert_eq!(v["error"]["param"], "messages");
    // Within the context (100k tokens + 5): served.
    let fits = "word".repeat(100_000);
    let body = json!({"model": BASE, "messages": [{"role": "user", "content": fits}], "max_tokens": 5});
    let (status, text) = s.post_text("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{}", &text[..text.len().min(300)]);
}
