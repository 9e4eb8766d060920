//! Ray Serve's `max_ongoing_requests` through `kvroute serve`: a worker with its cap in
//! flight takes no more, and with every worker at its cap the answer is 503.

mod common;

use common::client;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_at_max_ongoing_requests_takes_no_more() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    // Real time: a 300-token answer takes seconds, long enough to hold a place.
    let (_engines, urls) = common::engine_sims(1, "1").await;
    let (_router, url) = common::serve(&["--worker-urls", &urls[0], "--max-ongoing-requests", "1"]).await;
    let chat = |n: u32, stream: bool| {
        serde_json::json!({"model": "sim-llama-3-8b", "messages": [{"role": "user", "content": "tell me"}],
            "max_tokens": n, "stream": stream})
    };
    let c = client();
    let held = c.post(format!("{url}/v1/chat/completions")).json(&chat(300, true)).send().await.expect("send");
    assert_eq!(held.status(), 200);
    let r = c.post(format!("{url}/v1/chat/completions")).json(&chat(1, false)).send().await.expect("send");
    assert_eq!(r.status(), 503);
    assert!(r.headers().contains_key("retry-after"));
    let body: serde_json::Value = r.json().await.expect("json");
    assert!(body["error"]["message"].as_str().expect("message").contains("max_ongoing_requests"), "{body}");
    // The held answer ends: the worker takes requests again.
    let _ = held.bytes().await.expect("the held stream ends");
    common::ledger_drains(&c, &url).await;
    let r = c.post(format!("{url}/v1/chat/completions")).json(&chat(1, false)).send().await.expect("send");
    assert_eq!(r.status(), 200);
}
