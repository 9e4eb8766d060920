//! Shutdown the way Kubernetes expects: after the signal `/readiness` answers 503 for
//! `drain_delay_secs` while new connections and requests are still served, then new
//! connections are refused and the rest drains; a stream still open at the drain deadline
//! ends with an SSE error event, and the server returns. Real sockets on 127.0.0.1; every
//! wait is a bounded poll behind a hang guard (never a timing assertion).

use kvroute_engine_sim::{self as engine_sim, EngineSimConfig};
use kvroute_gateway::GatewayConfig;
use tokio_util::sync::CancellationToken;

mod common;
use common::{eventually, guard};

fn chat(stream: bool) -> serde_json::Value {
    serde_json::json!({"model": "sim-llama-3-8b", "messages": [{"role": "user", "content": "drain me"}],
        "max_tokens": 3, "stream": stream})
}

/// A client that opens a new connection for every request (none kept alive).
fn fresh() -> reqwest::Client {
    reqwest::Client::builder().pool_max_idle_per_host(0).build().expect("client")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_is_503_during_the_drain_delay_while_requests_are_still_served_then_connections_are_refused() {
    let stop = CancellationToken::new();
    let (w, _) = engine_sim::spawn_local(EngineSimConfig::default(), stop.clone()).await.expect("worker");
    // A delay far longer than the few requests below take, so they fall inside it.
    let config =
        GatewayConfig { drain_delay_secs: 10.0, drain_timeout_secs: 20.0, ..common::config(&[&w], "round_robin") };
    let shutdown = CancellationToken::new();
    let (r, task) = common::start_router(config, shutdown.clone()).await;
    let c = fresh();
    eventually("ready before the signal", async || {
        c.get(format!("{r}/readiness")).send().await.is_ok_and(|x| x.status() == 200)
    })
    .await;
    shutdown.cancel();
    eventually("/readiness answers 503 once the signal arrived", async || {
        c.get(format!("{r}/readiness")).send().await.is_ok_and(|x| x.status() == 503)
    })
    .await;
    let body: serde_json::Value =
        guard(guard(c.get(format!("{r}/readiness")).send()).await.expect("readiness").json()).await.expect("json");
    assert_eq!(body["draining"], true, "{body}");
    // Still within the delay: a new connection's request is served, health still passes.
    let resp = guard(c.post(format!("{r}/v1/chat/completions")).json(&chat(false)).send()).await.expect("served");
    assert_eq!(resp.status(), 200, "a request during the drain delay is served");
    assert_eq!(guard(c.get(format!("{r}/health")).send()).await.expect("health").status(), 200);
    // After the delay the listener is closed: new connections are refused.
    let addr = r.trim_start_matches("http://").to_string();
    eventually("new connections refused after drain_delay_secs", async || {
        tokio::net::TcpStream::connect(&addr).await.is_err()
    })
    .await;
    let ended = guard(task).await.expect("join");
    assert!(ended.is_ok(), "{ended:?}");
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_open_at_the_drain_deadline_ends_with_an_sse_error_event() {
    let stop = CancellationToken::new();
    // A worker that sends one chunk and then nothing: only the drain deadline ends it.
    let (stalling, stop_s) = common::stalling_worker(std::sync::Arc::default()).await;
    let config = GatewayConfig {
        drain_timeout_secs: 2.0,
        stream_idle_timeout_secs: 600.0,
        ..common::config(&[&stalling], "round_robin")
    };
    let shutdown = CancellationToken::new();
    let (r, task) = common::start_router(config, shutdown.clone()).await;
    let c = reqwest::Client::new();
    let mut resp = guard(c.post(format!("{r}/v1/chat/completions")).json(&chat(true)).send()).await.expect("stream");
    assert_eq!(resp.status(), 200);
    let first = guard(resp.chunk()).await.expect("first chunk").expect("a chunk");
    assert!(first.starts_with(b"data: {\"choices\":[]}"), "{first:?}");
    shutdown.cancel();
    let rest = guard(resp.text()).await.expect("the stream ends cleanly");
    let event =
        rest.lines().find(|l| l.starts_with("data: {\"error\"")).unwrap_or_else(|| panic!("no error event: {rest}"));
    let v: serde_json::Value = serde_json::from_str(&event["data: ".len()..]).expect("the event is JSON");
    assert_eq!(v["error"]["code"], 503, "{v}");
    assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("drain_timeout_secs")), "{v}");
    let ended = guard(task).await.expect("join");
    assert!(ended.is_ok(), "{ended:?}");
    stop_s.cancel();
    stop.cancel();
}
