//! B3's `capped` through `kvroute serve --policy capped`: LMetric routing, and a session's
//! turns past `max_turns` answered 429 (B3 `cache_aware_proxy.py` ran lmetric on a trace whose
//! sessions were cut to their first 8 turns; live, the cut is a refusal).

mod common;

use common::client;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capped_serves_a_sessions_first_max_turns_and_refuses_the_rest() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (_engines, urls) = common::engine_sims(2, "20").await;
    let (_router, url) = common::serve(&[
        "--worker-urls",
        &urls.join(","),
        "--policy",
        "capped",
        "--policy-knobs",
        r#"{"max_turns": 2}"#,
    ])
    .await;
    let c = client();
    let ask = |session: Option<&'static str>| {
        let mut rb = c.post(format!("{url}/v1/chat/completions")).json(&serde_json::json!({"model": "sim-llama-3-8b",
            "messages": [{"role": "user", "content": "one more turn"}], "max_tokens": 1}));
        if let Some(s) = session {
            rb = rb.header("x-session-id", s);
        }
        rb.send()
    };
    for turn in 1..=2 {
        assert_eq!(ask(Some("conv-a")).await.expect("send").status(), 200, "turn {turn}");
    }
    let third = ask(Some("conv-a")).await.expect("send");
    assert_eq!(third.status(), 429);
    let v: serde_json::Value = third.json().await.expect("an OpenAI-style error");
    assert!(v["error"]["message"].as_str().expect("message").contains("max_turns"), "{v}");
    // Another session, and requests without one, are not capped.
    assert_eq!(ask(Some("conv-b")).await.expect("send").status(), 200);
    for _ in 0..3 {
        assert_eq!(ask(None).await.expect("send").status(), 200);
    }
    let p: serde_json::Value = c.get(format!("{url}/policy")).send().await.expect("p").json().await.expect("j");
    assert_eq!((p["policy"].as_str(), p["knobs"]["max_turns"].as_u64()), (Some("capped"), Some(2)), "{p}");
}
