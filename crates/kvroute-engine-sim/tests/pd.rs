//! Prefill/decode disaggregation of the simulated worker, over real HTTP on 127.0.0.1: a
//! prefill and a decode worker speaking SGLang's protocol (`bootstrap_*` fields, the same
//! body sent to both at once) and vLLM's (`kv_transfer_params`, prefill first), and every
//! way the KV handoff fails.
//!
//! Every client call has a generous hang guard (a failure, not a timing assertion); the
//! simulated clock runs 1000× faster than the profile so the tests are quick.

use kvroute_engine_sim::{EngineSimConfig, PdCounters, Role};
use serde_json::{Value, json};

const MODEL: &str = "sim-llama-3-8b";

fn cfg(role: Role) -> EngineSimConfig {
    EngineSimConfig { time_scale: 1000.0, role, ..EngineSimConfig::default() }
}

mod common;
use common::{Sim, sim};

impl Sim {
    /// GET `path` as text.
    async fn get(&self, path: &str) -> String {
        self.get_text(path).await
    }

    fn pd(&self) -> PdCounters {
        self.sim.pd_counters()
    }

    fn bootstrap_port(&self) -> u16 {
        self.sim.bootstrap_port().expect("a prefill or decode worker has a bootstrap port")
    }
}

/// A prompt of about `tokens` tokens (4 characters each) starting with `head`.
fn prompt(head: &str, tokens: usize) -> String {
    let mut s = head.to_string();
    while s.len() < tokens * 4 {
        s.push_str(" the quick brown fox jumps over the lazy dog");
    }
    s.truncate(tokens * 4);
    s
}

/// What SGLang's router sends to both workers: the client's body plus the bootstrap fields.
fn sglang_body(mut client: Value, prefill: &Sim, room: u64) -> Value {
    client["bootstrap_host"] = json!("127.0.0.1");
    client["bootstrap_port"] = json!(prefill.bootstrap_port());
    client["bootstrap_room"] = json!(room);
    client
}

fn error_message(v: &Value) -> String {
    v["error"]["message"].as_str().unwrap_or_default().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_pair_serves_a_non_streamed_request_with_the_kv_from_the_prefill_worker() {
    let (p, d) = (sim(cfg(Role::Prefill)).await, sim(cfg(Role::Decode)).await);
    let body = sglang_body(json!({"model": MODEL, "prompt": prompt("sglang pair", 3000), "max_tokens": 12}), &p, 42);
    let ((ps, pv), (ds, dv)) = tokio::join!(p.post("/v1/completions", &body), d.post("/v1/completions", &body));
    assert_eq!(ps, 200, "{pv}");
    assert_eq!(ds, 200, "{dv}");
    // The prefill answers one token; the decode answers the client's max_tokens.
    assert_eq!(pv["usage"]["completion_tokens"], 1, "{pv}");
    assert_eq!(dv["usage"]["completion_tokens"], 12, "{dv}");
    let prompt_tokens = dv["usage"]["prompt_tokens"].as_u64().expect("prompt tokens");
    assert_eq!(dv["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(), Some(prompt_tokens), "{dv}");
    // The decode worker received the KV and computed no prompt token.
    let dc = d.pd();
    assert_eq!((dc.transfers, dc.transfer_bytes, dc.transfer_failures), (1, prompt_tokens * 131_072, 0));
    assert_eq!(dc.waiting_for_kv, 0);
    assert_eq!(d.sim.stats().prefill_tokens, 0);
    assert_eq!(d.sim.stats().transferred_tokens, prompt_tokens);
    assert_eq!(p.pd().kv_published, 1);
    assert_eq!(p.sim.stats().prefill_tokens, prompt_tokens);
    // Both report their role on /metrics and /server_info.
    let m = d.get("/metrics").await;
    assert!(m.contains("kvroute_sim_pd_transfers_total 1"), "{m}");
    assert!(m.contains(&format!("kvroute_sim_pd_transfer_bytes_total {}", prompt_tokens * 131_072)), "{m}");
    assert!(m.contains("kvroute_sim_role{role=\"decode\"} 1"), "{m}");
    assert!(m.contains("kvroute_sim_pd_waiting_for_kv 0"), "{m}");
    let info: Value = serde_json::from_str(&p.get("/server_info").await).expect("json");
    assert_eq!(info["disaggregation_mode"], "prefill");
    assert_eq!(info["disaggregation_bootstrap_port"], p.bootstrap_port());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_pair_streams_the_decode_answer() {
    let (p, d) = (sim(cfg(Role::Prefill)).await, sim(cfg(Role::Decode)).await);
    let client = json!({"model": MODEL, "messages": [{"role": "user", "content": prompt("streamed", 2500)}],
        "max_tokens": 9, "stream": true, "stream_options": {"include_usage": true}});
    let body = sglang_body(client, &p, 7);
    let ((ps, pt), (ds, dt)) =
        tokio::join!(p.post_text("/v1/chat/completions", &body), d.post_text("/v1/chat/completions", &body));
    assert_eq!((ps, ds), (200, 200), "{pt}\n{dt}");
    let chunks = |t: &str| -> Vec<Value> {
        t.lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|l| *l != "[DONE]")
            .map(|l| serde_json::from_str(l).expect("chunk"))
            .collect()
    };
    let content = |c: &[Value]| c.iter().filter(|c| c["choices"][0]["delta"]["content"].is_string()).count();
    let (pc, dc) = (chunks(&pt), chunks(&dt));
    assert_eq!(content(&pc), 1, "the prefill streams its one token");
    assert_eq!(content(&dc), 9, "the decode streams max_tokens tokens");
    assert!(dt.trim_end().ends_with("data: [DONE]"));
    let usage = &dc.last().expect("usage chunk")["usage"];
    assert_eq!(usage["completion_tokens"], 9);
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]);
    assert_eq!(d.pd().transfers, 1);
    assert_eq!(d.sim.stats().prefill_tokens, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_pair_hands_the_kv_over_with_kv_transfer_params() {
    let (p, d) = (sim(cfg(Role::Prefill)).await, sim(cfg(Role::Decode)).await);
    let client = json!({"model": MODEL, "prompt": prompt("vllm nixl", 2200), "max_tokens": 10, "stream": false});
    // 1. The prefill: one token, not streamed, asking for a remote decode.
    let mut pre = client.clone();
    pre["kv_transfer_params"] = json!({"do_remote_decode": true});
    pre["max_tokens"] = json!(1);
    let (ps, pv) = p.post("/v1/completions", &pre).await;
    assert_eq!(ps, 200, "{pv}");
    let params = pv["kv_transfer_params"].clone();
    assert_eq!(params["do_remote_prefill"], true, "{pv}");
    assert_eq!(params["do_remote_decode"], false);
    assert_eq!(params["remote_engine_id"], p.sim.engine_id());
    assert_eq!(params["remote_host"], "127.0.0.1");
    assert_eq!(params["remote_port"], p.bootstrap_port());
    assert_eq!(params["tp_size"], 1);
    let blocks = params["remote_block_ids"].as_array().expect("block ids");
    assert!(!blocks.is_empty() && blocks.iter().all(Value::is_u64), "{params}");
    // 2. The decode: the original request plus those params.
    let mut dec = client.clone();
    dec["kv_transfer_params"] = params;
    let (ds, dv) = d.post("/v1/completions", &dec).await;
    assert_eq!(ds, 200, "{dv}");
    assert_eq!(dv["usage"]["completion_tokens"], 10);
    assert_eq!(dv["usage"]["prompt_tokens_details"]["cached_tokens"], dv["usage"]["prompt_tokens"]);
    assert!(dv.get("kv_transfer_params").is_none(), "only a prefill answer carries params");
    assert_eq!((d.pd().transfers, d.pd().local_prefills), (1, 0));
    assert_eq!(d.sim.stats().prefill_tokens, 0);
    // A second transfer gets its own block ids.
    let (_, pv2) = p.post("/v1/completions", &pre).await;
    assert_ne!(pv2["kv_transfer_params"]["remote_block_ids"][0], pv["kv_transfer_params"]["remote_block_ids"][0]);
    // Without params both serve normally (vLLM instances are kv_both); the decode counts
    // a local prefill.
    let (s1, v1) = p.post("/v1/completions", &client).await;
    let (s2, v2) = d.post("/v1/completions", &client).await;
    assert_eq!((s1, s2), (200, 200));
    assert_eq!(
        (v1["usage"]["completion_tokens"].as_u64(), v2["usage"]["completion_tokens"].as_u64()),
        (Some(10), Some(10))
    );
    assert_eq!(d.pd().local_prefills, 1);
    assert!(d.sim.stats().prefill_tokens > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_whose_room_never_comes_times_out_with_a_500_even_when_streamed() {
    let short = |role| EngineSimConfig { bootstrap_timeout_secs: 0.3, ..cfg(role) };
    let (p, d) = (sim(short(Role::Prefill)).await, sim(short(Role::Decode)).await);
    let body = sglang_body(json!({"model": MODEL, "prompt": "hello", "max_tokens": 4}), &p, 999);
    let (s, v) = d.post("/v1/completions", &body).await;
    assert_eq!(s, 500, "{v}");
    assert!(error_message(&v).contains("KV transfer for bootstrap room 999 timed out"), "{v}");
    // Streamed: the error is the status, before any SSE byte.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (s, t) = d.post_text("/v1/completions", &streamed).await;
    assert_eq!(s, 500, "{t}");
    assert!(!t.contains("data:"), "{t}");
    assert_eq!((d.pd().transfer_failures, d.pd().transfers, d.pd().waiting_for_kv), (2, 0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_or_mistyped_pd_fields_are_400s_naming_the_field() {
    let (p, d) = (sim(cfg(Role::Prefill)).await, sim(cfg(Role::Decode)).await);
    let base = json!({"model": MODEL, "prompt": "hello", "max_tokens": 4});
    let mut no_room = base.clone();
    no_room["bootstrap_host"] = json!("127.0.0.1");
    no_room["bootstrap_port"] = json!(p.bootstrap_port());
    let mut no_host = base.clone();
    no_host["bootstrap_room"] = json!(5);
    let mut bad_room = no_room.clone();
    bad_room["bootstrap_room"] = json!("five");
    let mut vllm = base.clone();
    vllm["kv_transfer_params"] = json!({"do_remote_prefill": true, "remote_host": "127.0.0.1",
        "remote_port": p.bootstrap_port(), "remote_engine_id": "e"});
    for (who, body, param) in [
        (&d, &no_room, "bootstrap_room"),
        (&p, &no_room, "bootstrap_room"),
        (&d, &no_host, "bootstrap_host"),
        (&d, &bad_room, "bootstrap_room"),
        (&d, &vllm, "kv_transfer_params.remote_block_ids"),
    ] {
        let (s, v) = who.post("/v1/completions", body).await;
        assert_eq!(s, 400, "{param}: {v}");
        assert_eq!(v["error"]["param"], param, "{v}");
    }
    // A worker of role both ignores them all.
    let b = sim(cfg(Role::Both)).await;
    let (s, v) = b.post("/v1/completions", &no_room).await;
    assert_eq!(s, 200, "{v}");
    assert!(b.sim.bootstrap_port().is_none());
    let info: Value = serde_json::from_str(&b.get("/server_info").await).expect("json");
    assert_eq!(info["disaggregation_mode"], "null");
    assert!(info["disaggregation_bootstrap_port"].is_null());
    assert!(b.get("/metrics").await.contains("kvroute_sim_role{role=\"both\"} 1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_prefill_fails_its_decode_at_once() {
    let failing = EngineSimConfig { error_rate: 1.0, ..cfg(Role::Prefill) };
    let (p, d) = (sim(failing).await, sim(cfg(Role::Decode)).await);
    let body = sglang_body(json!({"model": MODEL, "prompt": prompt("doomed", 3000), "max_tokens": 4}), &p, 31337);
    let ((ps, pv), (ds, dv)) = tokio::join!(p.post("/v1/completions", &body), d.post("/v1/completions", &body));
    assert_eq!(ps, 500, "{pv}");
    assert_eq!(ds, 500, "{dv}");
    assert!(error_message(&dv).contains("prefill failed for bootstrap room 31337"), "{dv}");
    assert_eq!((d.pd().transfer_failures, d.pd().transfers), (1, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_bootstrap_server_is_a_500_naming_it() {
    let d = sim(cfg(Role::Decode)).await;
    // A port nobody listens on any more.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let body = json!({"model": MODEL, "prompt": "hello", "max_tokens": 4,
        "bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 1});
    let (s, v) = d.post("/v1/completions", &body).await;
    assert_eq!(s, 500, "{v}");
    assert!(error_message(&v).contains(&format!("cannot reach the bootstrap server 127.0.0.1:{port}")), "{v}");
    let mut vllm = json!({"model": MODEL, "prompt": "hello", "max_tokens": 4});
    vllm["kv_transfer_params"] = json!({"do_remote_prefill": true, "remote_host": "127.0.0.1", "remote_port": port,
        "remote_engine_id": "gone", "remote_block_ids": [1, 2]});
    let (s, v) = d.post("/v1/completions", &vllm).await;
    assert_eq!(s, 500, "{v}");
    assert!(error_message(&v).contains("cannot reach the bootstrap server"), "{v}");
    assert_eq!(d.pd().transfer_failures, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prefill_worker_reuses_a_shared_prefix() {
    let p = sim(cfg(Role::Prefill)).await;
    let shared = prompt("a long shared system prompt", 4000);
    let hits = |m: &str| -> u64 {
        m.lines()
            .find_map(|l| l.strip_prefix("vllm:prefix_cache_hits_total "))
            .and_then(|v| v.trim().parse().ok())
            .expect("prefix hits metric")
    };
    let body = |room: u64, tail: &str| {
        json!({"model": MODEL, "prompt": format!("{shared} {tail}"), "max_tokens": 50,
            "bootstrap_host": "127.0.0.1", "bootstrap_port": p.bootstrap_port(), "bootstrap_room": room})
    };
    let (s, v) = p.post("/v1/completions", &body(1, "first question")).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 1, "a prefill worker answers one token");
    let before = (p.sim.stats().prefix_hit_tokens, hits(&p.get("/metrics").await));
    let (s, v) = p.post("/v1/completions", &body(2, "second question")).await;
    assert_eq!(s, 200, "{v}");
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached");
    assert!(cached >= 3900, "the shared 4000-token prefix is cached: {v}");
    let after = (p.sim.stats().prefix_hit_tokens, hits(&p.get("/metrics").await));
    assert_eq!(after.0 - before.0, cached);
    assert_eq!(after.1 - before.1, cached);
    assert_eq!(p.pd().kv_published, 2);
}
