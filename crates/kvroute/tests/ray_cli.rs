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

/// Ray Serve's `LocalityMixin` through `kvroute serve`: requests go to the worker on the
/// router's node; with it at its `max_ongoing_requests` cap, to the one in its zone; with
/// both full, anywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_prefer_the_routers_node_then_its_zone_then_anywhere() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (_engines, urls) = common::engine_sims(3, "1").await;
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = dir.path().join("kvroute.toml");
    // Worker 0 elsewhere, worker 1 on the router's node, worker 2 in its zone.
    let text = format!(
        "worker_urls = [\"{0}\", \"{1}\", \"{2}\"]\nmax_ongoing_requests = 1\npolicy = \"round_robin\"\n\
         [locality]\nnode = \"n1\"\nzone = \"z1\"\n\
         [locality.workers.\"{0}\"]\nnode = \"n9\"\nzone = \"z9\"\n\
         [locality.workers.\"{1}\"]\nnode = \"n1\"\nzone = \"z1\"\n\
         [locality.workers.\"{2}\"]\nnode = \"n2\"\nzone = \"z1\"\n",
        urls[0], urls[1], urls[2]
    );
    std::fs::write(&cfg, text).expect("write");
    let (_router, url) = common::serve(&["--config", cfg.to_str().expect("utf8")]).await;
    let c = client();
    let chat = |n: u32, stream: bool| {
        serde_json::json!({"model": "sim-llama-3-8b", "messages": [{"role": "user", "content": "where"}],
            "max_tokens": n, "stream": stream})
    };
    let served_by = |r: &reqwest::Response| r.headers()["x-kvroute-worker"].to_str().expect("ascii").to_string();
    // Round robin would rotate over all three; locality keeps every one on the node.
    for _ in 0..4 {
        let r = c.post(format!("{url}/v1/chat/completions")).json(&chat(1, false)).send().await.expect("send");
        assert_eq!((r.status().as_u16(), served_by(&r)), (200, urls[1].clone()));
    }
    let v: serde_json::Value = c.get(format!("{url}/workers")).send().await.expect("w").json().await.expect("j");
    let places: Vec<&str> =
        v["workers"].as_array().expect("rows").iter().map(|w| w["locality"].as_str().expect("s")).collect();
    assert_eq!(places, ["other", "node", "zone"]);
    // The node's worker is full: the zone's takes the next request, then, both full, the rest.
    let held_node = c.post(format!("{url}/v1/chat/completions")).json(&chat(300, true)).send().await.expect("send");
    assert_eq!(served_by(&held_node), urls[1]);
    let held_zone = c.post(format!("{url}/v1/chat/completions")).json(&chat(300, true)).send().await.expect("send");
    assert_eq!(served_by(&held_zone), urls[2]);
    let r = c.post(format!("{url}/v1/chat/completions")).json(&chat(1, false)).send().await.expect("send");
    assert_eq!((r.status().as_u16(), served_by(&r)), (200, urls[0].clone()));
    drop((held_node, held_zone));
}
