//! Added latency and throughput of the gateway against a direct call to an instant worker.
//!
//! `cargo run --release -p kvroute-gateway --example overhead -- [requests] [concurrency] [policy]`
//! (defaults 20000, 32, cache_aware). Prints p50/p99 latency and requests/s for the direct
//! path and through kvroute; the difference of p50s is the added latency.
//!
//! `… --example overhead -- serve [policy]` only starts the instant worker and the gateway,
//! prints their URLs and waits, so an external load generator (wrk) can drive both.

use std::sync::Arc;
use std::time::{Duration, Instant};

const BODY: &str = r#"{"id":"x","object":"chat.completion","created":0,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":10,"completion_tokens":1,"total_tokens":11}}"#;

async fn instant_worker() -> String {
    use axum::routing::{get, post};
    let app = axum::Router::new()
        .route("/v1/chat/completions", post(|| async { ([("content-type", "application/json")], BODY) }))
        .route(
            "/v1/models",
            get(|| async { axum::Json(serde_json::json!({"object":"list","data":[{"id":"m","object":"model"}]})) }),
        )
        .route("/health", get(|| async { "ok" }));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", l.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(l, app).await });
    url
}

async fn load(url: String, n: usize, conc: usize) -> (hdrhistogram::Histogram<u64>, f64) {
    let client = reqwest::Client::builder().pool_max_idle_per_host(conc * 2).build().expect("client");
    let body = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "You are a helpful assistant. What is the capital of France?"}], "max_tokens": 1});
    let body = Arc::new(serde_json::to_vec(&body).expect("json"));
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..conc {
        let (client, url, body, next) = (client.clone(), url.clone(), Arc::clone(&body), Arc::clone(&next));
        tasks.push(tokio::spawn(async move {
            let mut h = hdrhistogram::Histogram::<u64>::new(3).expect("hist");
            while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < n {
                let t = Instant::now();
                let r = client
                    .post(format!("{url}/v1/chat/completions"))
                    .header("content-type", "application/json")
                    .body((*body).clone())
                    .send()
                    .await
                    .expect("send");
                let _ = r.bytes().await.expect("body");
                let _ = h.record(t.elapsed().as_nanos() as u64);
            }
            h
        }));
    }
    let mut all = hdrhistogram::Histogram::<u64>::new(3).expect("hist");
    for t in tasks {
        all.add(t.await.expect("join")).expect("add");
    }
    let secs = t0.elapsed().as_secs_f64();
    (all, n as f64 / secs)
}

/// Starts the instant worker and a gateway in front of it; returns their URLs.
async fn start_pair(policy: &str) -> (String, String) {
    let worker = instant_worker().await;
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let gw = format!("http://{}", l.local_addr().expect("addr"));
    let cfg = kvroute_gateway::GatewayConfig {
        policy: policy.to_string(),
        worker_urls: vec![worker.clone()],
        ..Default::default()
    };
    tokio::spawn(kvroute_gateway::serve(l, cfg, std::future::pending()));
    tokio::time::sleep(Duration::from_millis(300)).await;
    (worker, gw)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("rt");
    if args.get(1).map(String::as_str) == Some("serve") {
        let policy = args.get(2).cloned().unwrap_or_else(|| "cache_aware".into());
        rt.block_on(async {
            let (worker, gw) = start_pair(&policy).await;
            println!("worker {worker}\nrouter {gw}");
            std::future::pending::<()>().await;
        });
        return;
    }
    let n: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(20_000);
    let conc: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(32);
    let policy = args.get(3).cloned().unwrap_or_else(|| "cache_aware".into());
    rt.block_on(async {
        let (worker, gw) = start_pair(&policy).await;
        // Warm both paths.
        let _ = load(worker.clone(), 2000, conc).await;
        let _ = load(gw.clone(), 2000, conc).await;
        let (d, d_rps) = load(worker, n, conc).await;
        let (g, g_rps) = load(gw, n, conc).await;
        let us = |h: &hdrhistogram::Histogram<u64>, q: f64| h.value_at_quantile(q) as f64 / 1000.0;
        println!("{n} requests, concurrency {conc}, policy {policy}");
        println!("path      p50_us  p99_us  req/s");
        println!("direct  {:>8.1} {:>7.1} {:>6.0}", us(&d, 0.5), us(&d, 0.99), d_rps);
        println!("kvroute {:>8.1} {:>7.1} {:>6.0}", us(&g, 0.5), us(&g, 0.99), g_rps);
        println!("added p50: {:.1} us", us(&g, 0.5) - us(&d, 0.5));
    });
}
