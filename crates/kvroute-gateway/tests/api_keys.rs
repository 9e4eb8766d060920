//! Client API keys (`api_key_file`): inference and `/v1/models` need a known key, and each
//! key's requests and tokens per minute are limited (429 with `Retry-After`), counted per
//! tenant. Every connection is to 127.0.0.1 with a simulated worker.

use kvroute_engine_sim::{self as engine_sim, EngineSimConfig};
use kvroute_gateway::GatewayConfig;
use tokio_util::sync::CancellationToken;

mod common;
use common::guard;

fn chat(max_tokens: u32) -> serde_json::Value {
    serde_json::json!({"model": "sim-llama-3-8b", "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": max_tokens})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_are_required_and_each_key_is_held_to_its_requests_and_tokens_per_minute() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let stop_w = CancellationToken::new();
    let sim = EngineSimConfig { instant: true, ..EngineSimConfig::default() };
    let (w, _sim) = engine_sim::spawn_local(sim, stop_w.clone()).await.expect("worker");
    let file = std::env::temp_dir().join(format!("kvroute-keys-{}.txt", std::process::id()));
    std::fs::write(&file, "# test keys\nsk-req team-a rpm=3\nsk-tok team-b tpm=50\nsk-free\n").expect("write keys");
    let config = GatewayConfig {
        policy: "round_robin".into(),
        worker_urls: vec![w],
        port: 0,
        api_key_file: Some(file.display().to_string()),
        ..GatewayConfig::default()
    };
    let stop = CancellationToken::new();
    let (r, _task) = common::start_router(config, stop.clone()).await;
    let c = reqwest::Client::new();
    let send = |key: Option<&str>, body: serde_json::Value| {
        let mut rb = c.post(format!("{r}/v1/chat/completions")).json(&body);
        if let Some(k) = key {
            rb = rb.bearer_auth(k);
        }
        guard(rb.send())
    };
    // No key, an unknown key: 401 JSON. /v1/models too; /health and /metrics stay open.
    for key in [None, Some("sk-unknown")] {
        let resp = send(key, chat(5)).await.expect("send");
        assert_eq!(resp.status(), 401);
        let v: serde_json::Value = resp.json().await.expect("json");
        assert_eq!(v["error"]["type"], "authentication_error", "{v}");
    }
    assert_eq!(guard(c.get(format!("{r}/v1/models")).send()).await.expect("s").status(), 401);
    let models = guard(c.get(format!("{r}/v1/models")).bearer_auth("sk-free").send()).await.expect("s");
    assert_eq!(models.status(), 200);
    assert_eq!(guard(c.get(format!("{r}/health")).send()).await.expect("s").status(), 200);
    // Requests per minute: 3, then 429 with Retry-After.
    for i in 0..3 {
        assert_eq!(send(Some("sk-req"), chat(5)).await.expect("send").status(), 200, "request {i}");
    }
    let resp = send(Some("sk-req"), chat(5)).await.expect("send");
    assert_eq!(resp.status(), 429);
    let wait: u64 = resp.headers()["retry-after"].to_str().expect("ascii").parse().expect("seconds");
    assert!((1..=60).contains(&wait), "Retry-After {wait}");
    // OpenAI's error type for a rate limit, which clients branch on.
    let v: serde_json::Value = guard(resp.json()).await.expect("json");
    assert_eq!(v["error"]["type"], "rate_limit_exceeded", "{v}");
    assert_eq!(v["error"]["code"], 429, "{v}");
    // Tokens per minute: prompt (~3 tokens) + max_tokens 30 fits in 50 once, not twice; a
    // request larger than a minute's worth is refused without Retry-After.
    assert_eq!(send(Some("sk-tok"), chat(30)).await.expect("send").status(), 200);
    let resp = send(Some("sk-tok"), chat(30)).await.expect("send");
    assert_eq!(resp.status(), 429);
    assert!(resp.headers().contains_key("retry-after"));
    let resp = send(Some("sk-tok"), chat(1000)).await.expect("send");
    assert_eq!(resp.status(), 429);
    assert!(!resp.headers().contains_key("retry-after"));
    // Another key is unaffected (no limits).
    for _ in 0..5 {
        assert_eq!(send(Some("sk-free"), chat(5)).await.expect("send").status(), 200);
    }
    let text = guard(c.get(format!("{r}/metrics")).send()).await.expect("metrics").text().await.expect("text");
    for line in [
        r#"kvroute_tenant_requests_total{tenant="team-a",outcome="admitted"} 3"#,
        r#"kvroute_tenant_requests_total{tenant="team-a",outcome="rate_limited_requests"} 1"#,
        r#"kvroute_tenant_requests_total{tenant="team-b",outcome="admitted"} 1"#,
        r#"kvroute_tenant_requests_total{tenant="team-b",outcome="rate_limited_tokens"} 2"#,
        r#"kvroute_tenant_requests_total{tenant="-",outcome="admitted"} 5"#,
    ] {
        assert!(text.contains(line), "missing `{line}` in\n{text}");
    }
    assert!(!text.contains("sk-"), "a key appeared in the metrics");
    stop.cancel();
    stop_w.cancel();
    let _ = std::fs::remove_file(&file);
}

#[tokio::test]
async fn a_bad_key_file_stops_the_router_naming_the_line() {
    let file = std::env::temp_dir().join(format!("kvroute-badkeys-{}.txt", std::process::id()));
    std::fs::write(&file, "sk-a\nsk-b rpm=fast\n").expect("write");
    let config = GatewayConfig { api_key_file: Some(file.display().to_string()), ..GatewayConfig::default() };
    let err = kvroute_gateway::app::AppState::new(config).expect_err("refused");
    let msg = format!("{err:#}");
    assert!(msg.contains("line 2") && msg.contains("rpm"), "{msg}");
    let _ = std::fs::remove_file(&file);
}
