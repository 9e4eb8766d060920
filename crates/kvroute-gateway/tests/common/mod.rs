//! Helpers shared by the gateway's integration tests.

use std::time::Duration;

/// Starts the gateway with `cfg` on an ephemeral port until `stop`; returns its URL once it
/// answers `/health` (or after 4 s of trying) and the serving task.
#[allow(dead_code)] // not every test binary starts the gateway this way
pub async fn start_router(
    cfg: kvroute_gateway::GatewayConfig,
    stop: tokio_util::sync::CancellationToken,
) -> (String, tokio::task::JoinHandle<anyhow::Result<()>>) {
    start_router_with_reload(cfg, None, stop).await
}

/// [`start_router`], with `reload` read again on each SIGHUP
/// (`kvroute_gateway::serve_with_reload`).
pub async fn start_router_with_reload(
    cfg: kvroute_gateway::GatewayConfig,
    reload: Option<kvroute_gateway::ConfigSource>,
    stop: tokio_util::sync::CancellationToken,
) -> (String, tokio::task::JoinHandle<anyhow::Result<()>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let router = format!("http://{}", listener.local_addr().expect("addr"));
    let task =
        tokio::spawn(kvroute_gateway::serve_with_reload(listener, cfg, reload, async move { stop.cancelled().await }));
    let c = reqwest::Client::new();
    for _ in 0..200 {
        if c.get(format!("{router}/health")).send().await.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (router, task)
}

/// `f`, or a failure after 60 s: the hang guard of every wait in these tests (a failure
/// message, never a timing assertion).
#[allow(dead_code)] // not every test binary waits
pub async fn guard<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(60), f).await.expect("hang guard: no answer within 60 s")
}

/// The admin token of [`config`]'s gateways: without a token the main port serves no admin
/// API, and these tests read `/workers`, `/policy` and `/debug/route` from it.
#[allow(dead_code)]
pub const ADMIN_TOKEN: &str = "test-admin-token";

/// A gateway configuration for `urls` running `policy`, on an ephemeral port, with
/// [`ADMIN_TOKEN`] as its admin token, no drain delay, decision headers on
/// (`expose_decision_headers`: these tests read where requests went), and ring installed as
/// rustls's provider (reqwest is built without a default one).
#[allow(dead_code)] // not every test binary configures a gateway this way
pub fn config(urls: &[&str], policy: &str) -> kvroute_gateway::GatewayConfig {
    let _ = rustls::crypto::ring::default_provider().install_default();
    kvroute_gateway::GatewayConfig {
        policy: policy.into(),
        worker_urls: urls.iter().map(|u| u.to_string()).collect(),
        port: 0,
        expose_decision_headers: true,
        admin_token: Some(ADMIN_TOKEN.into()),
        // Tests that shut a router down do not wait for load balancers (the drain tests
        // set it).
        drain_delay_secs: 0.0,
        ..kvroute_gateway::GatewayConfig::default()
    }
}

/// A client presenting [`ADMIN_TOKEN`] (`Authorization: Bearer …`) unless a request sets
/// its own `Authorization`.
#[allow(dead_code)] // not every test binary uses the admin API
pub fn client() -> reqwest::Client {
    admin_client_builder().build().expect("client")
}

/// [`client`]'s builder, for a test that adds to it (trust roots).
#[allow(dead_code)]
pub fn admin_client_builder() -> reqwest::ClientBuilder {
    let mut h = reqwest::header::HeaderMap::new();
    h.insert(
        reqwest::header::AUTHORIZATION,
        reqwest::header::HeaderValue::from_str(&format!("Bearer {ADMIN_TOKEN}")).expect("value"),
    );
    reqwest::Client::builder().default_headers(h)
}

/// Polls `cond` every 50 ms until it holds; fails with `what` after 30 s (a hang guard,
/// not a timing assertion).
#[allow(dead_code)] // not every test binary polls
pub async fn eventually<F: AsyncFnMut() -> bool>(what: &str, mut cond: F) {
    for _ in 0..600 {
        if cond().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("not within 30 s: {what}");
}

/// A worker that answers `/health`, lists no models and, for a chat request, counts it,
/// sends the stream's headers and one chunk (`data: {"choices":[]}`) and then nothing more
/// (a stalled decode). Serves until the returned token is cancelled.
#[allow(dead_code)] // not every test binary needs it
pub async fn stalling_worker(
    requests: std::sync::Arc<std::sync::atomic::AtomicUsize>,
) -> (String, tokio_util::sync::CancellationToken) {
    use axum::routing::{get, post};
    let app = axum::Router::new().route("/health", get(|| async { "ok" })).route(
        "/v1/chat/completions",
        post(move || async move {
            requests.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let first = futures_util::stream::once(async {
                Ok::<_, std::io::Error>(axum::body::Bytes::from_static(b"data: {\"choices\":[]}\n\n"))
            });
            let body =
                axum::body::Body::from_stream(futures_util::StreamExt::chain(first, futures_util::stream::pending()));
            axum::response::Response::builder()
                .header("content-type", "text/event-stream")
                .body(body)
                .expect("response")
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", l.local_addr().expect("addr"));
    let stop = tokio_util::sync::CancellationToken::new();
    let s = stop.clone();
    tokio::spawn(async move { axum::serve(l, app).with_graceful_shutdown(async move { s.cancelled().await }).await });
    (url, stop)
}

/// An ephemeral loopback port, released for another socket or a child process to bind (a
/// tiny window in which another process could take it; acceptable on loopback). Never one
/// this process was given before: the kernel can hand the same port to two binds in a
/// row once the first is released, and two sockets of a test (a ZeroMQ PUB and its replay
/// ROUTER) then got one port between them.
#[allow(dead_code)] // not every test binary binds its own ports
pub fn free_port() -> u16 {
    static GIVEN: parking_lot::Mutex<Vec<u16>> = parking_lot::Mutex::new(Vec::new());
    loop {
        let port =
            std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("port");
        let mut given = GIVEN.lock();
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}
