//! Model multiplexing with LoRA adapters (Ray Serve's multiplexed models; vLLM's runtime
//! `POST /v1/load_lora_adapter`): engine-sim workers hold a few adapters each with
//! least-recently-used eviction; the gateway routes a request for an adapter to a worker
//! that has it loaded, asks one with a free slot to load it when none has, and falls back
//! to another worker when a load fails.

use kvroute_engine_sim::{self as engine_sim, EngineSim, EngineSimConfig};
use kvroute_gateway::lora::{LoraAdapter, LoraConfig};
use serde_json::{Value, json};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

mod common;
use common::guard;

async fn worker(slots: usize, preload: &[&str], fail: &[&str], stop: &CancellationToken) -> (String, Arc<EngineSim>) {
    let cfg = EngineSimConfig {
        time_scale: 100.0,
        model: "base".into(),
        lora_slots: slots,
        lora_load_secs: 1.0,
        loras: preload.iter().map(|n| (n.to_string(), format!("/adapters/{n}"))).collect(),
        lora_fail: fail.iter().map(|n| n.to_string()).collect(),
        ..EngineSimConfig::default()
    };
    engine_sim::spawn_local(cfg, stop.clone()).await.expect("worker")
}

fn catalogue(names: &[&str]) -> LoraConfig {
    LoraConfig {
        adapters: names
            .iter()
            .map(|n| LoraAdapter { name: n.to_string(), path: format!("/adapters/{n}"), base: "base".into() })
            .collect(),
        default_max_loras: 2,
        ..LoraConfig::default()
    }
}

async fn ask(c: &reqwest::Client, router: &str, model: &str, i: usize) -> (u16, String, Value) {
    let body = json!({"model": model, "max_tokens": 2,
        "messages": [{"role": "user", "content": format!("request {i} for {model}")}]});
    let r = guard(c.post(format!("{router}/v1/chat/completions")).json(&body).send()).await.expect("send");
    let status = r.status().as_u16();
    let worker = r.headers().get("x-kvroute-worker").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    (status, worker, r.json().await.unwrap_or(Value::Null))
}

async fn counter(c: &reqwest::Client, router: &str, series: &str) -> f64 {
    let text = guard(c.get(format!("{router}/metrics")).send()).await.expect("metrics").text().await.expect("text");
    text.lines().find_map(|l| l.strip_prefix(series)?.trim().parse().ok()).unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn six_adapters_over_three_workers_with_two_slots_mostly_hit_loaded_adapters() {
    let stop = CancellationToken::new();
    let mut urls = Vec::new();
    let mut sims = Vec::new();
    for _ in 0..3 {
        let (u, sim) = worker(2, &[], &[], &stop).await;
        urls.push(u);
        sims.push(sim);
    }
    let names = ["a1", "a2", "a3", "a4", "a5", "a6"];
    let mut cfg = common::config(&urls.iter().map(String::as_str).collect::<Vec<_>>(), "cache_aware");
    cfg.lora = catalogue(&names);
    let (router, _) = common::start_router(cfg, stop.clone()).await;
    let c = reqwest::Client::new();

    // 60 requests over the six adapters in a scrambled order.
    let n = 60;
    for i in 0..n {
        let model = names[(i * 7 + i / 6) % names.len()];
        let (status, worker, v) = ask(&c, &router, model, i).await;
        assert_eq!(status, 200, "request {i} for {model}: {v}");
        assert_eq!(v["model"], model, "served by the adapter");
        let sim = &sims[urls.iter().position(|u| *u == worker).expect("a known worker")];
        assert!(sim.loaded_adapters().iter().any(|a| a == model), "{worker} holds {model}");
    }
    let loaded = counter(&c, &router, "kvroute_lora_requests_total{outcome=\"loaded\"}").await;
    let loads = counter(&c, &router, "kvroute_lora_requests_total{outcome=\"load\"}").await;
    assert_eq!(loaded + loads, n as f64);
    assert!(loaded / n as f64 >= 0.8, "mostly hit loaded adapters: {loaded} of {n} ({loads} loads)");
    assert_eq!(loads, 6.0, "six slots for six adapters: each loaded once, none evicted");
    for sim in &sims {
        assert_eq!(sim.loaded_adapters().len(), 2, "each worker filled its two slots");
    }

    // Concurrent requests for an adapter nobody has wait for one load.
    let (u4, sim4) = worker(2, &[], &[], &stop).await;
    let mut cfg = common::config(&[&u4], "cache_aware");
    cfg.lora = catalogue(&["fresh"]);
    let (router2, _) = common::start_router(cfg, stop.clone()).await;
    let jobs = (0..6).map(|i| {
        let (c, r) = (c.clone(), router2.clone());
        async move { ask(&c, &r, "fresh", i).await.0 }
    });
    assert!(futures_util::future::join_all(jobs).await.iter().all(|s| *s == 200));
    assert_eq!(counter(&c, &router2, "kvroute_lora_loads_total{outcome=\"ok\"}").await, 1.0, "one load for six");
    assert_eq!(sim4.loaded_adapters(), vec!["fresh".to_string()]);
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_load_falls_back_to_another_worker() {
    let stop = CancellationToken::new();
    // The first worker has two free slots (asked first) but cannot load `x`; the second
    // has one slot used, one free.
    let (failing, _) = worker(2, &[], &["x"], &stop).await;
    let (good, good_sim) = worker(2, &["y"], &[], &stop).await;
    let mut cfg = common::config(&[&failing, &good], "cache_aware");
    cfg.lora = catalogue(&["x", "y"]);
    let (router, _) = common::start_router(cfg, stop.clone()).await;
    let c = reqwest::Client::new();
    let (status, worker, v) = ask(&c, &router, "x", 0).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(worker, good, "the load failed on the first worker and was asked of the second");
    assert_eq!(counter(&c, &router, "kvroute_lora_loads_total{outcome=\"failed\"}").await, 1.0);
    assert_eq!(counter(&c, &router, "kvroute_lora_loads_total{outcome=\"ok\"}").await, 1.0);
    let mut held = good_sim.loaded_adapters();
    held.sort();
    assert_eq!(held, vec!["x".to_string(), "y".to_string()]);

    // An adapter already loaded is routed without a load; a name outside the catalogue
    // that no worker serves is a 404 as before.
    assert_eq!(ask(&c, &router, "y", 1).await.1, good);
    assert_eq!(counter(&c, &router, "kvroute_lora_requests_total{outcome=\"loaded\"}").await, 1.0);
    assert_eq!(ask(&c, &router, "not-an-adapter", 2).await.0, 404);

    // With loading off, an adapter nobody holds is a 503 naming it.
    let mut cfg = common::config(&[&failing], "cache_aware");
    cfg.lora = LoraConfig { load: false, ..catalogue(&["z"]) };
    let (router2, _) = common::start_router(cfg, stop.clone()).await;
    let (status, _, v) = ask(&c, &router2, "z", 3).await;
    assert_eq!(status, 503, "{v}");
    assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("`z`")), "{v}");
    stop.cancel();
}
