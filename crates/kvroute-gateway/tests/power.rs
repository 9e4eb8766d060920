//! Power in routing (Cognitora cgn-router's `w_pwr` term of kv_score): the gateway scrapes
//! each worker's power gauge (engine-sim exports DCGM's `DCGM_FI_DEV_POWER_USAGE`, modelled
//! from its SM activity), averages it over `power_window_secs`, and with equal cache and
//! load the lower-power worker wins; a configured exporter URL template is read instead of
//! the worker's own `/metrics`.

use kvroute_engine_sim::{self as engine_sim, EngineSimConfig};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

mod common;
use common::guard;

async fn worker(idle_watts: f64, stop: &CancellationToken) -> String {
    let cfg = EngineSimConfig { time_scale: 50.0, power_idle_watts: idle_watts, ..EngineSimConfig::default() };
    engine_sim::spawn_local(cfg, stop.clone()).await.expect("worker").0
}

/// A gateway running kv_score on power alone, scraping every 0.2 s.
fn power_only(urls: &[&str]) -> kvroute_gateway::GatewayConfig {
    let mut cfg = common::config(urls, "kv_score");
    cfg.scrape_metrics = true;
    cfg.health.interval_secs = 0.2;
    cfg.policy_knobs = toml::from_str("w_kv = 0.0\nw_load = 0.0\nw_pwr = 1.0\nw_cap = 0.0").expect("knobs");
    cfg
}

/// Each worker's averaged power in the router's worker table, once every worker has one.
async fn powers(c: &reqwest::Client, router: &str, n: usize) -> Vec<(String, f64)> {
    for _ in 0..300 {
        let v: serde_json::Value =
            guard(c.get(format!("{router}/workers")).send()).await.expect("workers").json().await.expect("json");
        let rows: Vec<(String, f64)> = v["workers"]
            .as_array()
            .expect("rows")
            .iter()
            .filter_map(|w| Some((w["url"].as_str()?.to_string(), w["power_watts"].as_f64()?)))
            .collect();
        if rows.len() == n {
            return rows;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the router did not read every worker's power within 30 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_equal_cache_and_load_the_lower_power_worker_wins() {
    let stop = CancellationToken::new();
    let low = worker(100.0, &stop).await;
    let high = worker(400.0, &stop).await;
    let (router, _) = common::start_router(power_only(&[&low, &high]), stop.clone()).await;
    let c = common::client();
    let p = powers(&c, &router, 2).await;
    let of = |u: &str| p.iter().find(|(w, _)| w == u).map(|(_, x)| *x).expect("power");
    assert!((of(&low) - 100.0).abs() < 1.0 && (of(&high) - 400.0).abs() < 1.0, "idle readings: {p:?}");
    for i in 0..10 {
        let body = serde_json::json!({"model": "sim-llama-3-8b", "max_tokens": 1,
            "messages": [{"role": "user", "content": format!("distinct prompt {i}")}]});
        let r = guard(c.post(format!("{router}/v1/chat/completions")).json(&body).send()).await.expect("send");
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-kvroute-worker"], low.as_str(), "request {i}");
    }
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_power_gauge_is_read_from_the_exporter_template() {
    let stop = CancellationToken::new();
    let w = worker(100.0, &stop).await;
    // The "exporter" is another engine-sim on the same host, drawing 250 W idle.
    let exporter = worker(250.0, &stop).await;
    let port = exporter.rsplit(':').next().expect("port");
    let mut cfg = power_only(&[&w]);
    cfg.power_exporter = Some(format!("http://{{host}}:{port}/metrics"));
    let (router, _) = common::start_router(cfg, stop.clone()).await;
    let c = common::client();
    let p = powers(&c, &router, 1).await;
    assert!((p[0].1 - 250.0).abs() < 1.0, "read from the exporter, not the worker: {p:?}");
    stop.cancel();
}
