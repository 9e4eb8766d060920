//! Who may change the router, and what reaches the workers: the admin API answers only
//! loopback clients when no token is set, moves to its own listener with `admin_listen`,
//! worker URLs are normalised and checked against `worker_allow`, and only the configured
//! client headers are forwarded. Every connection is to 127.0.0.1; a remote client is
//! simulated with axum's `MockConnectInfo`.

use axum::extract::connect_info::MockConnectInfo;
use axum::http::HeaderMap;
use kvroute_engine_sim::{self as engine_sim, EngineSimConfig};
use kvroute_gateway::GatewayConfig;
use kvroute_gateway::state::AppState;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

mod common;
use common::guard;

fn cfg(urls: &[&str]) -> GatewayConfig {
    common::config(urls, "round_robin")
}

/// Serves `kvroute_gateway::app` as if every client connected from `peer`.
async fn serve_as_from(state: Arc<AppState>, peer: SocketAddr, stop: CancellationToken) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let app = kvroute_gateway::app(state).layer(MockConnectInfo(peer));
    tokio::spawn(async move {
        axum::serve(listener, app).with_graceful_shutdown(async move { stop.cancelled().await }).await
    });
    url
}

fn chat() -> serde_json::Value {
    serde_json::json!({"model": "sim-llama-3-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_token_the_admin_api_answers_only_loopback_clients() {
    let stop = CancellationToken::new();
    let (w, _) = engine_sim::spawn_local(EngineSimConfig::default(), stop.clone()).await.expect("worker");
    let state = AppState::new(cfg(&[&w])).expect("state");
    state.add_initial_workers().await;
    let remote = serve_as_from(Arc::clone(&state), "10.1.2.3:40000".parse().expect("addr"), stop.clone()).await;
    let local = serve_as_from(Arc::clone(&state), "127.0.0.1:40000".parse().expect("addr"), stop.clone()).await;
    let c = reqwest::Client::new();
    let admin_calls = |base: &str| {
        vec![
            c.post(format!("{base}/add_worker?url=http://127.0.0.1:9")),
            c.post(format!("{base}/remove_worker?url=http://127.0.0.1:9")),
            c.get(format!("{base}/workers")),
            c.get(format!("{base}/list_workers")),
            c.get(format!("{base}/policy")),
            c.put(format!("{base}/policy")).json(&serde_json::json!({"knobs": {}})),
            c.post(format!("{base}/debug/route")).json(&chat()),
        ]
    };
    for rb in admin_calls(&remote) {
        let resp = guard(rb.send()).await.expect("send");
        assert_eq!(resp.status(), 403, "{}", resp.url());
        let v: serde_json::Value = guard(resp.json()).await.expect("json error");
        assert!(v["error"]["message"].as_str().expect("message").contains("loopback"), "{v}");
    }
    // The remote client still gets inference and the read-only public endpoints.
    let resp = guard(c.post(format!("{remote}/v1/chat/completions")).json(&chat()).send()).await.expect("send");
    assert_eq!(resp.status(), 200);
    for path in ["/v1/models", "/health", "/readiness", "/metrics"] {
        assert_eq!(guard(c.get(format!("{remote}{path}")).send()).await.expect("send").status(), 200, "{path}");
    }
    // A loopback client may use the admin API (here: every call but the unknown worker's removal).
    for rb in admin_calls(&local) {
        let resp = guard(rb.send()).await.expect("send");
        let path = resp.url().path().to_string();
        assert!(resp.status() == 200 || path == "/remove_worker", "{path}: {}", resp.status());
    }
    stop.cancel();
}

#[test]
fn a_token_is_required_from_everyone_once_configured() {
    use kvroute_gateway::admin::admin_access;
    let lo: SocketAddr = "127.0.0.1:1".parse().expect("addr");
    let v6_mapped: SocketAddr = "[::ffff:127.0.0.1]:1".parse().expect("addr");
    let remote: SocketAddr = "192.0.2.7:1".parse().expect("addr");
    let mut good = HeaderMap::new();
    good.insert("authorization", "Bearer s3cret".parse().expect("value"));
    let mut bad = HeaderMap::new();
    bad.insert("authorization", "Bearer s3cre".parse().expect("value"));
    let none = HeaderMap::new();
    assert!(admin_access(None, &none, Some(lo)).is_ok());
    assert!(admin_access(None, &none, Some(v6_mapped)).is_ok());
    assert_eq!(admin_access(None, &none, Some(remote)).unwrap_err().status.as_u16(), 403);
    assert_eq!(admin_access(None, &none, None).unwrap_err().status.as_u16(), 403, "unknown peer = remote");
    assert!(admin_access(Some("s3cret"), &good, Some(remote)).is_ok());
    assert_eq!(admin_access(Some("s3cret"), &bad, Some(lo)).unwrap_err().status.as_u16(), 401);
    assert_eq!(admin_access(Some("s3cret"), &none, Some(lo)).unwrap_err().status.as_u16(), 401);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_listen_moves_the_admin_api_off_the_main_port() {
    let stop = CancellationToken::new();
    let (w, _) = engine_sim::spawn_local(EngineSimConfig::default(), stop.clone()).await.expect("worker");
    let admin_port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let mut config = cfg(&[&w]);
    config.admin_listen = Some(format!("127.0.0.1:{admin_port}"));
    let (main, _task) = common::start_router(config, stop.clone()).await;
    let admin = format!("http://127.0.0.1:{admin_port}");
    let c = reqwest::Client::new();
    let resp = guard(c.get(format!("{main}/workers")).send()).await.expect("send");
    assert_eq!(resp.status(), 404, "the main port serves no admin endpoint");
    let resp = guard(c.post(format!("{main}/v1/chat/completions")).json(&chat()).send()).await.expect("send");
    assert_eq!(resp.status(), 200);
    let mut rows = 0;
    for _ in 0..200 {
        if let Ok(r) = c.get(format!("{admin}/workers")).send().await {
            let v: serde_json::Value = r.json().await.expect("json");
            rows = v["workers"].as_array().map_or(0, Vec::len);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(rows, 1, "the admin listener serves the worker table");
    let resp = guard(c.post(format!("{admin}/v1/chat/completions")).json(&chat()).send()).await.expect("send");
    assert_eq!(resp.status(), 404, "and no inference");
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_urls_are_normalised_and_the_allow_list_holds() {
    let stop = CancellationToken::new();
    let (w, _) = engine_sim::spawn_local(EngineSimConfig::default(), stop.clone()).await.expect("worker");
    let mut config = cfg(&[]);
    config.worker_allow = vec!["127.0.0.0/8".into()];
    let (r, _task) = common::start_router(config, stop.clone()).await;
    let c = reqwest::Client::new();
    let add = |u: String| c.post(format!("{r}/add_worker?url={u}")).send();
    let upper = w.replace("http://", "HTTP://") + "/";
    let v: serde_json::Value = guard(add(upper)).await.expect("send").json().await.expect("json");
    assert_eq!(v["url"], w.as_str(), "{v}");
    let v: serde_json::Value = guard(add(w.clone())).await.expect("send").json().await.expect("json");
    assert_eq!(v["id"], 0, "the same worker, not a second one");
    for (bad, needle) in [
        ("http:///x".to_string(), "no host"),
        ("http://user:pw@127.0.0.1:9".to_string(), "credentials"),
        ("http://10.0.0.1:8000".to_string(), "worker_allow"),
    ] {
        let resp = guard(add(bad.clone())).await.expect("send");
        assert_eq!(resp.status(), 400, "{bad}");
        let text = resp.text().await.expect("text");
        assert!(text.contains(needle) && !text.contains("pw@"), "{bad}: {text}");
    }
    let v: serde_json::Value =
        guard(c.get(format!("{r}/list_workers")).send()).await.expect("send").json().await.expect("json");
    assert_eq!(v["urls"], serde_json::json!([w]));
    stop.cancel();
}

/// A worker that answers every inference request with the request headers it received.
async fn echo_worker(stop: CancellationToken) -> String {
    use axum::routing::{get, post};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let app = axum::Router::new()
        .route("/v1/models", get(|| async { axum::Json(serde_json::json!({"data": [{"id": "sim-llama-3-8b"}]})) }))
        .route("/health", get(|| async { "ok" }))
        .route(
            "/v1/chat/completions",
            post(|h: HeaderMap| async move {
                let names: Vec<String> = h.keys().map(|k| k.as_str().to_string()).collect();
                axum::Json(serde_json::json!({"headers": names}))
            }),
        );
    tokio::spawn(async move {
        axum::serve(listener, app).with_graceful_shutdown(async move { stop.cancelled().await }).await
    });
    url
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_configured_client_headers_reach_the_workers() {
    let stop = CancellationToken::new();
    let w = echo_worker(stop.clone()).await;
    let base = cfg(&[&w]);
    let c = reqwest::Client::new();
    let received = |r: String| {
        let c = c.clone();
        async move {
            let resp = c
                .post(format!("{r}/v1/chat/completions"))
                .header("authorization", "Bearer client-key")
                .header("x-team", "search")
                .header("cookie", "session=1")
                .json(&chat())
                .send();
            let v: serde_json::Value = guard(resp).await.expect("send").json().await.expect("json");
            v["headers"].as_array().expect("names").iter().map(|n| n.as_str().unwrap_or("").to_string()).collect()
        }
    };
    let (default_router, _t1) = common::start_router(base, stop.clone()).await;
    let names: Vec<String> = received(default_router).await;
    assert!(names.contains(&"authorization".to_string()), "{names:?}");
    assert!(!names.contains(&"x-team".to_string()) && !names.contains(&"cookie".to_string()), "{names:?}");
    let mut config = cfg(&[&w]);
    config.forward_headers = vec!["X-Team".into()];
    let (custom_router, _t2) = common::start_router(config, stop.clone()).await;
    let names: Vec<String> = received(custom_router).await;
    assert!(names.contains(&"x-team".to_string()), "{names:?}");
    assert!(!names.contains(&"authorization".to_string()), "{names:?}");
    stop.cancel();
}
