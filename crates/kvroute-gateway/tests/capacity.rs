//! Capacity in routing (Cognitora cgn-router's `w_cap` term of kv_score): the gateway reads
//! each worker's capacity from its own report (SGLang `/server_info`: `tp_size`, `dtype`,
//! `max_running_requests`), from its registration, or from the configuration file, the
//! file winning; with equal cache and load the worker with more capacity wins.

use kvroute_engine_sim::{self as engine_sim, EngineSimConfig};
use serde_json::json;
use tokio_util::sync::CancellationToken;

mod common;
use common::guard;

async fn worker(tp_size: u32, stop: &CancellationToken) -> String {
    let cfg = EngineSimConfig { time_scale: 100.0, tp_size, ..EngineSimConfig::default() };
    engine_sim::spawn_local(cfg, stop.clone()).await.expect("worker").0
}

async fn chosen(c: &reqwest::Client, router: &str, n: usize) -> Vec<String> {
    let mut out = Vec::new();
    for i in 0..n {
        let body = json!({"model": "sim-llama-3-8b", "max_tokens": 1,
            "messages": [{"role": "user", "content": format!("a distinct prompt number {i}")}]});
        let r = guard(c.post(format!("{router}/v1/chat/completions")).json(&body).send()).await.expect("send");
        assert_eq!(r.status(), 200);
        out.push(r.headers()["x-kvroute-worker"].to_str().expect("header").to_string());
    }
    out
}

async fn capacity_of(c: &reqwest::Client, router: &str, url: &str) -> serde_json::Value {
    let v: serde_json::Value =
        guard(c.get(format!("{router}/workers")).send()).await.expect("workers").json().await.expect("json");
    v["workers"].as_array().expect("rows").iter().find(|w| w["url"] == url).expect("row")["capacity"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_breaks_a_tie_between_otherwise_equal_workers() {
    let stop = CancellationToken::new();
    let big = worker(2, &stop).await;
    let small = worker(1, &stop).await;

    // Probed: the worker's /server_info says TP 2; kv_score's defaults weigh capacity 0.10.
    let (router, _) = common::start_router(common::config(&[&small, &big], "kv_score"), stop.clone()).await;
    let c = common::client();
    let cap = capacity_of(&c, &router, &big).await;
    assert_eq!(cap["tp_size"], 2, "{cap}");
    assert_eq!(cap["dtype"], "bfloat16", "{cap}");
    assert!(cap["max_concurrent"].as_u64().is_some_and(|n| n > 0), "max_running_requests read: {cap}");
    // The KV cache size, from `max_total_num_tokens` (the engine-sim's profile's).
    let kv = EngineSimConfig::default().profile.kv_tokens;
    assert_eq!(cap["kv_tokens"].as_u64(), Some(kv), "{cap}");
    assert!(chosen(&c, &router, 8).await.iter().all(|w| *w == big), "the TP-2 worker wins every tie");

    // The configuration file wins over the worker's own report.
    let mut cfg = common::config(&[&small, &big], "kv_score");
    cfg.capacity =
        toml::from_str(&format!("\"{small}\" = {{ tp_size = 4, dtype = \"fp8\", kv_tokens = 50000 }}")).expect("table");
    let (router2, _) = common::start_router(cfg, stop.clone()).await;
    let cap = capacity_of(&c, &router2, &small).await;
    assert_eq!((cap["tp_size"].as_u64(), cap["dtype"].as_str()), (Some(4), Some("fp8")), "{cap}");
    assert_eq!(cap["kv_tokens"].as_u64(), Some(50_000), "the file's KV size wins: {cap}");
    assert!(chosen(&c, &router2, 8).await.iter().all(|w| *w == small), "4 x 80 / 1 beats 2 x 80 / 2");
    stop.cancel();
}

#[test]
fn unknown_or_bad_capacity_keys_are_refused_naming_the_key() {
    let e =
        kvroute_gateway::GatewayConfig::from_toml("[capacity.\"http://127.0.0.1:1\"]\ntp_sise = 2").expect_err("typo");
    assert_eq!(e.key, "capacity.tp_sise", "{e}");
    let e = kvroute_gateway::GatewayConfig::from_toml("[capacity.\"http://127.0.0.1:1\"]\ndtype = \"fp6\"")
        .expect_err("dtype");
    assert!(e.to_string().contains("dtype"), "{e}");
    let e = kvroute_gateway::GatewayConfig::from_toml("[capacity.\"http://127.0.0.1:1\"]\nkv_tokens = 0")
        .expect_err("kv_tokens");
    assert!(e.to_string().contains("kv_tokens"), "{e}");
    let e = kvroute_gateway::GatewayConfig::from_toml("[capacity.\"ftp://x\"]\ntp_size = 2").expect_err("url");
    assert_eq!(e.key, "capacity");
}
