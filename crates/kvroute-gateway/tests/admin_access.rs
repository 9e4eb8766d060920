//! Who may change the router, and what reaches the workers: without a token the main port
//! serves no admin API and the admin API is only on a loopback `admin_listen`, where a
//! request relayed by a proxy is never local — also through a real same-host reverse proxy
//! (one written here that adds `X-Forwarded-For` as nginx's `proxy_set_header` does, and
//! nginx itself when installed); worker URLs are normalised and checked against
//! `worker_allow`, and only the configured client headers (and `Via`) are forwarded. Every
//! connection is to 127.0.0.1; a remote client is simulated with axum's `MockConnectInfo`.

use axum::extract::connect_info::MockConnectInfo;
use axum::http::HeaderMap;
use axum::response::IntoResponse;
use kvroute_engine_sim::{self as engine_sim, EngineSimConfig};
use kvroute_gateway::GatewayConfig;
use kvroute_gateway::app::AppState;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

mod common;
use common::guard;

/// A configuration without an admin token (the model under test), on an ephemeral port.
fn cfg(urls: &[&str]) -> GatewayConfig {
    GatewayConfig { admin_token: None, ..common::config(urls, "round_robin") }
}

use common::free_port;

/// Serves `app` as if every client connected from `peer`.
async fn serve_as_from(app: axum::Router, peer: SocketAddr, stop: CancellationToken) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let app = app.layer(MockConnectInfo(peer));
    tokio::spawn(async move {
        axum::serve(listener, app).with_graceful_shutdown(async move { stop.cancelled().await }).await
    });
    url
}

fn chat() -> serde_json::Value {
    serde_json::json!({"model": "sim-llama-3-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
}

/// One request of each admin endpoint against `base`.
fn admin_calls(c: &reqwest::Client, base: &str) -> Vec<reqwest::RequestBuilder> {
    vec![
        c.post(format!("{base}/add_worker?url=http://127.0.0.1:9&wait=false")),
        c.post(format!("{base}/remove_worker?url=http://127.0.0.1:9")),
        c.get(format!("{base}/workers")),
        c.get(format!("{base}/list_workers")),
        c.get(format!("{base}/policy")),
        c.put(format!("{base}/policy")).json(&serde_json::json!({"knobs": {}})),
        c.post(format!("{base}/debug/route")).json(&chat()),
    ]
}

/// Waits (bounded) until `url` answers `/workers` or `/health` at all.
async fn wait_up(url: &str, path: &str) {
    let c = reqwest::Client::new();
    common::eventually(&format!("{url}{path} answers"), async || c.get(format!("{url}{path}")).send().await.is_ok())
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_token_the_main_port_serves_no_admin_api_even_to_loopback() {
    let stop = CancellationToken::new();
    let (w, _) = engine_sim::spawn_local(EngineSimConfig::default(), stop.clone()).await.expect("worker");
    let (main, _task) = common::start_router(cfg(&[&w]), stop.clone()).await;
    let c = reqwest::Client::new();
    for rb in admin_calls(&c, &main) {
        let resp = guard(rb.send()).await.expect("send");
        let path = resp.url().path().to_string();
        assert_eq!(resp.status(), 404, "{path} from a loopback client on the main port");
        let v: serde_json::Value = guard(resp.json()).await.expect("json error");
        assert!(v["error"]["message"].as_str().expect("message").contains("admin_listen"), "{path}: {v}");
    }
    assert_eq!(guard(c.get(format!("{main}/list_workers")).send()).await.expect("send").status(), 404);
    // Inference and the read-only public endpoints are served as before.
    let resp = guard(c.post(format!("{main}/v1/chat/completions")).json(&chat()).send()).await.expect("send");
    assert_eq!(resp.status(), 200);
    for path in ["/v1/models", "/health", "/readiness", "/metrics"] {
        assert_eq!(guard(c.get(format!("{main}{path}")).send()).await.expect("send").status(), 200, "{path}");
    }
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tokenless_admin_listener_answers_only_loopback_clients_that_name_no_proxy() {
    let stop = CancellationToken::new();
    let (w, _) = engine_sim::spawn_local(EngineSimConfig::default(), stop.clone()).await.expect("worker");
    let state = AppState::new(cfg(&[&w])).expect("state");
    state.add_initial_workers().await;
    let admin = kvroute_gateway::admin_app(Arc::clone(&state));
    let remote = serve_as_from(admin.clone(), "10.1.2.3:40000".parse().expect("addr"), stop.clone()).await;
    let local = serve_as_from(admin, "127.0.0.1:40000".parse().expect("addr"), stop.clone()).await;
    let c = reqwest::Client::new();
    for rb in admin_calls(&c, &remote) {
        let resp = guard(rb.send()).await.expect("send");
        assert_eq!(resp.status(), 403, "{}", resp.url());
        let v: serde_json::Value = guard(resp.json()).await.expect("json error");
        assert!(v["error"]["message"].as_str().expect("message").contains("loopback"), "{v}");
    }
    // A loopback client naming a proxy it came through is not local, whatever the value.
    for (name, value) in [
        ("x-forwarded-for", "203.0.113.9"),
        ("x-forwarded-for", "127.0.0.1"),
        ("forwarded", "for=127.0.0.1;proto=http"),
        ("x-real-ip", "127.0.0.1"),
        ("X-Forwarded-For", ""),
    ] {
        for rb in admin_calls(&c, &local) {
            let resp = guard(rb.header(name, value).send()).await.expect("send");
            assert_eq!(resp.status(), 403, "{name}: {value} on {}", resp.url());
            let v: serde_json::Value = guard(resp.json()).await.expect("json error");
            assert!(v["error"]["message"].as_str().expect("message").contains("proxy"), "{v}");
        }
    }
    // A loopback client may use the admin API (here: every call but the unknown worker's removal).
    for rb in admin_calls(&c, &local) {
        let resp = guard(rb.send()).await.expect("send");
        let path = resp.url().path().to_string();
        assert!(resp.status() == 200 || path == "/remove_worker", "{path}: {}", resp.status());
    }
    // The admin listener serves no inference.
    let resp = guard(c.post(format!("{local}/v1/chat/completions")).json(&chat()).send()).await.expect("send");
    assert_eq!(resp.status(), 404);
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
    let mut proxied = HeaderMap::new();
    proxied.insert("x-forwarded-for", "127.0.0.1".parse().expect("value"));
    let mut proxied_good = good.clone();
    proxied_good.insert("forwarded", "for=198.51.100.1".parse().expect("value"));
    assert!(admin_access(None, &none, Some(lo)).is_ok());
    assert!(admin_access(None, &none, Some(v6_mapped)).is_ok());
    assert_eq!(admin_access(None, &proxied, Some(lo)).unwrap_err().status.as_u16(), 403, "relayed = not local");
    assert_eq!(admin_access(None, &none, Some(remote)).unwrap_err().status.as_u16(), 403);
    assert_eq!(admin_access(None, &none, None).unwrap_err().status.as_u16(), 403, "unknown peer = remote");
    assert!(admin_access(Some("s3cret"), &good, Some(remote)).is_ok());
    assert!(admin_access(Some("s3cret"), &proxied_good, Some(lo)).is_ok(), "a token holder may come through a proxy");
    assert_eq!(admin_access(Some("s3cret"), &bad, Some(lo)).unwrap_err().status.as_u16(), 401);
    assert_eq!(admin_access(Some("s3cret"), &none, Some(lo)).unwrap_err().status.as_u16(), 401);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_listen_moves_the_admin_api_off_the_main_port() {
    let stop = CancellationToken::new();
    let (w, _) = engine_sim::spawn_local(EngineSimConfig::default(), stop.clone()).await.expect("worker");
    let admin_port = free_port();
    for token in [None, Some(common::ADMIN_TOKEN)] {
        let mut config = cfg(&[&w]);
        config.admin_listen = Some(format!("127.0.0.1:{admin_port}"));
        config.admin_token = token.map(str::to_string);
        let run = CancellationToken::new();
        let (main, task) = common::start_router(config, run.clone()).await;
        let admin = format!("http://127.0.0.1:{admin_port}");
        let c = common::client();
        let resp = guard(c.get(format!("{main}/workers")).send()).await.expect("send");
        assert_eq!(resp.status(), 404, "the main port serves no admin endpoint, token or not ({token:?})");
        let resp = guard(c.post(format!("{main}/v1/chat/completions")).json(&chat()).send()).await.expect("send");
        assert_eq!(resp.status(), 200);
        wait_up(&admin, "/workers").await;
        let v: serde_json::Value =
            guard(c.get(format!("{admin}/workers")).send()).await.expect("send").json().await.expect("json");
        assert_eq!(v["workers"].as_array().map_or(0, Vec::len), 1, "the admin listener serves the worker table");
        let resp = guard(c.post(format!("{admin}/v1/chat/completions")).json(&chat()).send()).await.expect("send");
        assert_eq!(resp.status(), 404, "and no inference");
        run.cancel();
        guard(task).await.expect("join").expect("served");
    }
    // Without a token, a non-loopback admin listener is refused before anything is bound.
    let mut config = cfg(&[&w]);
    config.admin_listen = Some(format!("0.0.0.0:{admin_port}"));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let e = guard(kvroute_gateway::serve(listener, config, async {})).await.expect_err("refused");
    assert!(e.to_string().contains("admin_listen") && e.to_string().contains("loopback"), "{e}");
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_urls_are_normalised_and_the_allow_list_holds() {
    let stop = CancellationToken::new();
    let (w, _) = engine_sim::spawn_local(EngineSimConfig::default(), stop.clone()).await.expect("worker");
    let mut config = common::config(&[], "round_robin");
    config.worker_allow = vec!["127.0.0.0/8".into()];
    let (r, _task) = common::start_router(config, stop.clone()).await;
    let c = common::client();
    let add = |u: String| c.post(format!("{r}/add_worker?url={u}")).header("accept", "application/json").send();
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
    // A query that is not UTF-8 once decoded, or has no `url`, gets JSON naming `url`.
    for query in ["url=%FF%FE", "nothing=1", ""] {
        let resp = guard(c.post(format!("{r}/add_worker?{query}")).send()).await.expect("send");
        assert_eq!(resp.status(), 400, "{query}");
        let v: serde_json::Value = resp.json().await.expect("a JSON error body");
        assert_eq!(v["error"]["param"], "url", "{query}: {v}");
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
    assert!(names.contains(&"via".to_string()), "every hop adds its `Via`: {names:?}");
    let mut config = cfg(&[&w]);
    config.forward_headers = vec!["X-Team".into()];
    let (custom_router, _t2) = common::start_router(config, stop.clone()).await;
    let names: Vec<String> = received(custom_router).await;
    assert!(names.contains(&"x-team".to_string()), "{names:?}");
    assert!(!names.contains(&"authorization".to_string()), "{names:?}");
    stop.cancel();
}

#[path = "common/nginx.rs"]
mod nginx;

/// A reverse proxy written here, as a same-host nginx or Envoy is set up: every request to
/// `upstream` (`127.0.0.1:PORT`) with the client's headers, plus `X-Forwarded-For` (the
/// client's address appended, nginx's `$proxy_add_x_forwarded_for`) and `X-Real-IP`.
async fn header_adding_proxy(upstream: String, stop: CancellationToken) -> String {
    use axum::extract::{ConnectInfo, Request};
    let client = reqwest::Client::new();
    let app = axum::Router::new().fallback(move |ConnectInfo(peer): ConnectInfo<SocketAddr>, req: Request| {
        let client = client.clone();
        let upstream = upstream.clone();
        async move {
            let (parts, body) = req.into_parts();
            let body = axum::body::to_bytes(body, 1 << 20).await.unwrap_or_default();
            let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
            let mut rb = client.request(parts.method.clone(), format!("http://{upstream}{path}")).body(body);
            let mut xff = None;
            for (k, v) in &parts.headers {
                match k.as_str() {
                    "host" | "content-length" | "connection" => {}
                    "x-forwarded-for" => xff = v.to_str().ok().map(str::to_string),
                    _ => rb = rb.header(k, v),
                }
            }
            let ip = peer.ip().to_string();
            rb = rb.header("x-forwarded-for", xff.map_or_else(|| ip.clone(), |x| format!("{x}, {ip}")));
            rb = rb.header("x-real-ip", ip);
            match rb.send().await {
                Ok(r) => {
                    let status = r.status();
                    let ctype = r.headers().get("content-type").cloned();
                    let bytes = r.bytes().await.unwrap_or_default();
                    let mut resp = axum::response::Response::new(axum::body::Body::from(bytes));
                    *resp.status_mut() = status;
                    if let Some(c) = ctype {
                        resp.headers_mut().insert("content-type", c);
                    }
                    resp
                }
                Err(e) => (axum::http::StatusCode::BAD_GATEWAY, e.to_string()).into_response(),
            }
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move {
        axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>())
            .with_graceful_shutdown(async move { stop.cancelled().await })
            .await
    });
    url
}

/// Which same-host reverse proxy stands in front of the router.
#[derive(Clone, Copy, Debug)]
enum Proxy {
    WrittenHere,
    Nginx,
}

/// Starts `kind` in front of `upstream` (`http://127.0.0.1:PORT`); its URL, and nginx's
/// handle (kept alive by the caller).
async fn start_proxy(kind: Proxy, upstream: &str, stop: CancellationToken) -> (String, Option<nginx::Nginx>) {
    let hostport = upstream.trim_start_matches("http://").to_string();
    match kind {
        Proxy::WrittenHere => (header_adding_proxy(hostport, stop).await, None),
        Proxy::Nginx => {
            let n = nginx::Nginx::start(&hostport).await;
            (n.url.clone(), Some(n))
        }
    }
}

/// The probe's reproduction: an attacker's `add_worker` through a same-host reverse proxy.
/// Without a token it never reaches the admin API — not on the main port (404) nor on a
/// proxied admin listener (403) — and with one it needs the token (401 without, added with).
async fn add_worker_through_a_same_host_proxy(kind: Proxy) {
    let stop = CancellationToken::new();
    let (w, _) = engine_sim::spawn_local(EngineSimConfig::default(), stop.clone()).await.expect("worker");
    let (evil, _) = engine_sim::spawn_local(EngineSimConfig::default(), stop.clone()).await.expect("attacker's worker");
    let tokenless = cfg(&[&w]); // (installs rustls's provider, which the clients need)
    let c = reqwest::Client::new();
    let is_listed = |m: &str| m.contains(&format!("worker=\"{evil}\""));

    // No token, the proxy in front of the main port.
    let (main, _t1) = common::start_router(tokenless, stop.clone()).await;
    let (proxy, _n1) = start_proxy(kind, &main, stop.clone()).await;
    let resp = guard(c.post(format!("{proxy}/v1/chat/completions")).json(&chat()).send()).await.expect("send");
    assert_eq!(resp.status(), 200, "inference passes the proxy");
    let resp = guard(c.post(format!("{proxy}/add_worker?url={evil}")).send()).await.expect("send");
    assert_eq!(resp.status(), 404, "{kind:?}");
    let v: serde_json::Value = guard(resp.json()).await.expect("a JSON error");
    assert!(v["error"]["message"].is_string(), "{v}");
    for rb in admin_calls(&c, &proxy) {
        assert_eq!(guard(rb.send()).await.expect("send").status(), 404, "{kind:?}");
    }
    let m = guard(c.get(format!("{main}/metrics")).send()).await.expect("send").text().await.expect("text");
    assert!(!is_listed(&m), "the attacker's worker was added:\n{m}");

    // No token, a proxy (mis)pointed at the loopback admin listener: relayed, so refused.
    let admin_port = free_port();
    let mut config = cfg(&[&w]);
    config.admin_listen = Some(format!("127.0.0.1:{admin_port}"));
    let (main2, _t2) = common::start_router(config, stop.clone()).await;
    let admin = format!("http://127.0.0.1:{admin_port}");
    wait_up(&admin, "/list_workers").await;
    let (proxy2, _n2) = start_proxy(kind, &admin, stop.clone()).await;
    let resp = guard(c.post(format!("{proxy2}/add_worker?url={evil}")).send()).await.expect("send");
    assert_eq!(resp.status(), 403, "{kind:?}");
    let v: serde_json::Value = guard(resp.json()).await.expect("a JSON error");
    assert!(v["error"]["message"].as_str().expect("message").contains("proxy"), "{v}");
    let v: serde_json::Value =
        guard(c.get(format!("{admin}/list_workers")).send()).await.expect("send").json().await.expect("json");
    assert_eq!(v["urls"], serde_json::json!([w]), "only the configured worker, read on the listener itself");
    let m = guard(c.get(format!("{main2}/metrics")).send()).await.expect("send").text().await.expect("text");
    assert!(!is_listed(&m), "{m}");

    // With a token, through the proxy: refused without it, served with it.
    let (main3, _t3) = common::start_router(common::config(&[&w], "round_robin"), stop.clone()).await;
    let (proxy3, _n3) = start_proxy(kind, &main3, stop.clone()).await;
    let resp = guard(c.post(format!("{proxy3}/add_worker?url={evil}")).send()).await.expect("send");
    assert_eq!(resp.status(), 401, "{kind:?}");
    let resp = guard(common::client().post(format!("{proxy3}/add_worker?url={evil}")).send()).await.expect("send");
    assert_eq!(resp.status(), 200, "{kind:?}: {}", resp.text().await.unwrap_or_default());
    let v: serde_json::Value = guard(common::client().get(format!("{proxy3}/list_workers")).send())
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    assert_eq!(v["urls"], serde_json::json!([w, evil]));
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn add_worker_through_a_same_host_proxy_written_here_needs_the_token() {
    add_worker_through_a_same_host_proxy(Proxy::WrittenHere).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs nginx: KVROUTE_NGINX_BIN (Debian nginx-light); scripts/test.sh runs it"]
async fn add_worker_through_nginx_on_the_same_host_needs_the_token() {
    add_worker_through_a_same_host_proxy(Proxy::Nginx).await;
}

/// SGLang router's `add_worker`: waits for a starting worker's health check, answers its
/// text, and refuses a worker that never becomes ready; `wait=false` adds it at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn add_worker_waits_for_a_starting_worker_and_refuses_one_that_never_starts() {
    use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
    let stop = CancellationToken::new();
    // A worker whose health check fails three times (loading its model), then passes.
    let checks = Arc::new(AtomicU32::new(0));
    let seen = Arc::clone(&checks);
    let app =
        axum::Router::new()
            .route(
                "/health",
                axum::routing::get(move || {
                    let n = seen.fetch_add(1, SeqCst);
                    async move {
                        if n < 3 { axum::http::StatusCode::SERVICE_UNAVAILABLE } else { axum::http::StatusCode::OK }
                    }
                }),
            )
            .route(
                "/v1/models",
                axum::routing::get(|| async { axum::Json(serde_json::json!({"data": [{"id": "m"}]})) }),
            );
    let starting = serve_as_from(app, "127.0.0.1:9".parse().expect("addr"), stop.clone()).await;
    let mut config = common::config(&[], "round_robin");
    config.worker_startup_check_interval_secs = 0.05;
    config.health.interval_secs = 3600.0;
    let (r, _task) = common::start_router(config, stop.clone()).await;
    let c = common::client();

    let resp = guard(c.post(format!("{r}/add_worker?url={starting}")).send()).await.expect("send");
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"].to_str().expect("ascii").starts_with("text/plain"));
    assert_eq!(resp.text().await.expect("text"), format!("Successfully added worker: {starting}"));
    assert!(checks.load(SeqCst) >= 4, "added before its health check passed");

    // Nothing listens here: refused after the timeout, and not added.
    let dead = format!("http://127.0.0.1:{}", free_port());
    let resp = guard(c.post(format!("{r}/add_worker?url={dead}&timeout_secs=0.2")).send()).await.expect("send");
    assert_eq!(resp.status(), 400);
    let v: serde_json::Value = resp.json().await.expect("a JSON error");
    assert_eq!(v["error"]["param"], "url", "{v}");
    assert!(v["error"]["message"].as_str().expect("message").contains("did not become ready"), "{v}");
    let list = || async {
        guard(c.get(format!("{r}/list_workers")).send())
            .await
            .expect("send")
            .json::<serde_json::Value>()
            .await
            .expect("json")
    };
    assert_eq!(list().await["urls"], serde_json::json!([starting]));

    // A bad `wait` or `timeout_secs` names itself.
    for (query, param) in
        [("wait=maybe", "wait"), ("timeout_secs=-1", "timeout_secs"), ("timeout_secs=x", "timeout_secs")]
    {
        let resp = guard(c.post(format!("{r}/add_worker?url={dead}&{query}")).send()).await.expect("send");
        assert_eq!(resp.status(), 400, "{query}");
        let v: serde_json::Value = resp.json().await.expect("json");
        assert_eq!(v["error"]["param"], param, "{query}: {v}");
    }

    // wait=false adds it now (the health checker admits it when it answers).
    let resp = guard(c.post(format!("{r}/add_worker?url={dead}&wait=false")).send()).await.expect("send");
    assert_eq!(resp.status(), 200);
    assert_eq!(list().await["urls"], serde_json::json!([starting, dead]));
    let resp = guard(c.post(format!("{r}/remove_worker?url={dead}")).send()).await.expect("send");
    assert_eq!(resp.text().await.expect("text"), format!("Successfully removed worker: {dead}"));
    let resp = guard(c.post(format!("{r}/remove_worker?url={dead}")).header("accept", "application/json").send())
        .await
        .expect("send");
    assert_eq!(resp.status(), 404);
    stop.cancel();
}
