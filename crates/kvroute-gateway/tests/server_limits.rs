//! Slow and idle clients cannot hold the router: headers and bodies must arrive within
//! their timeouts, idle keep-alive connections are closed, and shutdown ends within the
//! drain deadline even with such a client connected. Raw TCP clients on 127.0.0.1; every
//! wait is a bounded poll behind a hang guard (a failure, never a timing assertion).

use kvroute_engine_sim::{self as engine_sim, EngineSimConfig};
use kvroute_gateway::GatewayConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

mod common;
use common::guard;

fn cfg(urls: &[&str]) -> GatewayConfig {
    GatewayConfig { header_read_timeout_secs: 0.3, body_read_timeout_secs: 0.3, ..common::config(urls, "round_robin") }
}

/// Reads until the server closes the connection; returns what it sent.
async fn read_to_close(s: &mut TcpStream) -> String {
    let mut out = Vec::new();
    let _ = guard(s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

fn addr(url: &str) -> String {
    url.trim_start_matches("http://").to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_headers_slow_bodies_and_idle_keep_alive_connections_are_closed() {
    let stop = CancellationToken::new();
    let (w, _) = engine_sim::spawn_local(EngineSimConfig::default(), stop.clone()).await.expect("worker");
    let (r, _task) = common::start_router(cfg(&[&w]), stop.clone()).await;
    // Headers that never finish: the connection is closed.
    let mut slow = TcpStream::connect(addr(&r)).await.expect("connect");
    slow.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n").await.expect("write");
    read_to_close(&mut slow).await;
    // A body that never finishes: 408 naming the timeout, as JSON.
    let mut body = TcpStream::connect(addr(&r)).await.expect("connect");
    body.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"mo",
    )
    .await
    .expect("write");
    let answer = read_to_close(&mut body).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("did not arrive within"), "{answer}");
    // A keep-alive connection left idle after a full exchange is closed too.
    let mut idle = TcpStream::connect(addr(&r)).await.expect("connect");
    idle.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").await.expect("write");
    let answer = read_to_close(&mut idle).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_within_the_drain_deadline_with_a_stuck_client_connected() {
    let stop = CancellationToken::new();
    let (w, _) = engine_sim::spawn_local(EngineSimConfig::default(), stop.clone()).await.expect("worker");
    let mut config = cfg(&[&w]);
    // Long header timeout: only the drain deadline can end the stuck connection.
    config.header_read_timeout_secs = 600.0;
    config.drain_timeout_secs = 0.5;
    let shutdown = CancellationToken::new();
    let (r, task) = common::start_router(config, shutdown.clone()).await;
    let mut stuck = TcpStream::connect(addr(&r)).await.expect("connect");
    stuck.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ").await.expect("write");
    // Let the server pick the connection up before shutting down.
    let c = reqwest::Client::new();
    assert_eq!(guard(c.get(format!("{r}/health")).send()).await.expect("health").status(), 200);
    shutdown.cancel();
    let ended = guard(task).await.expect("join");
    assert!(ended.is_ok(), "{ended:?}");
    read_to_close(&mut stuck).await;
    stop.cancel();
}
