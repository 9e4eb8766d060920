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

/// A chat body of exactly `len` bytes (at least 80).
fn chat_body(len: usize) -> String {
    let head = r#"{"model":"sim-llama-3-8b","max_tokens":1,"messages":[{"role":"user","content":""#;
    let tail = r#""}]}"#;
    format!("{head}{}{tail}", "a".repeat(len - head.len() - tail.len()))
}

/// Polls the router's `kvroute_buffered_body_bytes` until `ok` holds for it.
async fn held_until(c: &reqwest::Client, r: &str, ok: impl Fn(f64) -> bool) -> f64 {
    guard(async {
        loop {
            let text = c.get(format!("{r}/metrics")).send().await.expect("metrics").text().await.expect("text");
            let held = text
                .lines()
                .find_map(|l| l.strip_prefix("kvroute_buffered_body_bytes "))
                .and_then(|v| v.trim().parse::<f64>().ok())
                .expect("kvroute_buffered_body_bytes in /metrics");
            if ok(held) {
                return held;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await
}

/// The bodies the router holds at once share `max_buffered_body_bytes`: while a client
/// holds most of it with a body it has not finished sending (announced by
/// `Content-Length`, or chunked), a body that does not fit is refused with 503 and
/// `Retry-After`, one that fits is served, and the share comes back when the held body's
/// request is answered. Without the budget every body up to `max_body_bytes` was held,
/// however many (8,192 connections × 32 MiB by default).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_bodies_held_at_once_are_bounded_by_the_body_budget() {
    let stop = CancellationToken::new();
    let (w, _) = engine_sim::spawn_local(EngineSimConfig::default(), stop.clone()).await.expect("worker");
    let config = GatewayConfig {
        max_body_bytes: 48 << 10,
        max_buffered_body_bytes: 64 << 10,
        ..common::config(&[&w], "round_robin")
    };
    let (r, _task) = common::start_router(config, stop.clone()).await;
    let c = reqwest::Client::new();
    let big = chat_body(40_000);
    let refused = |what: &str, a: &reqwest::Response| {
        assert_eq!(a.status(), 503, "{what}");
        assert_eq!(a.headers().get("retry-after").and_then(|v| v.to_str().ok()), Some("1"), "{what}");
    };
    for chunked in [false, true] {
        // A client sends a body's first 1,000 bytes and stops.
        let mut slow = TcpStream::connect(addr(&r)).await.expect("connect");
        let head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n";
        let (start, rest) = big.split_at(1000);
        if chunked {
            let sent = &big[..30_000];
            let first = format!("{head}Transfer-Encoding: chunked\r\n\r\n{:x}\r\n{sent}\r\n", sent.len());
            slow.write_all(first.as_bytes()).await.expect("write");
        } else {
            let first = format!("{head}Content-Length: {}\r\n\r\n{start}", big.len());
            slow.write_all(first.as_bytes()).await.expect("write");
        }
        // Its share: the announced 40,000 bytes, or the 30,000 read so far.
        let held = held_until(&c, &r, |b| b >= if chunked { 30_000.0 } else { 40_000.0 }).await;
        assert!(held <= f64::from(64 << 10), "{held}");
        // Another body that does not fit beside it is refused, naming the limit.
        let other = c.post(format!("{r}/v1/chat/completions")).header("content-type", "application/json");
        let a = guard(other.try_clone().expect("clone").body(big.clone()).send()).await.expect("send");
        refused("a body past the budget", &a);
        let text = a.text().await.expect("text");
        assert!(text.contains("max_buffered_body_bytes"), "{text}");
        // A small one fits and is served.
        let a = guard(other.body(chat_body(200)).send()).await.expect("send");
        assert_eq!(a.status(), 200, "{}", a.text().await.unwrap_or_default());
        // The slow body ends: its request is served and its share given back.
        if chunked {
            let end = &big[30_000..];
            slow.write_all(format!("{:x}\r\n{end}\r\n0\r\n\r\n", end.len()).as_bytes()).await.expect("write");
        } else {
            slow.write_all(rest.as_bytes()).await.expect("write");
        }
        let mut answer = vec![0u8; 12];
        guard(slow.read_exact(&mut answer)).await.expect("read");
        assert_eq!(&answer, b"HTTP/1.1 200", "{}", String::from_utf8_lossy(&answer));
        held_until(&c, &r, |b| b == 0.0).await;
    }
    // The refused body is served once there is room.
    let a =
        guard(c.post(format!("{r}/v1/chat/completions")).header("content-type", "application/json").body(big).send())
            .await
            .expect("send");
    assert_eq!(a.status(), 200);
    stop.cancel();
}

/// One tenant's bodies hold at most `max_buffered_body_bytes_per_tenant` of the budget:
/// while a client of tenant A holds a body it has not finished sending, A's next large
/// body is refused with 429 and `Retry-After` (counted `over_body_share` for A's API key
/// tenant) and tenant B's is served, with API-key tenants and with `tenant_header` ones.
/// Without the share, A's bodies could take the whole budget and B's would get 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenant_holds_at_most_its_share_of_the_body_budget() {
    let (stop, w, keys) = worker_and_keys("share", "sk-a team-a\nsk-a2 team-a\nsk-b team-b\n").await;
    let _ = rustls::crypto::ring::default_provider().install_default();
    let c = reqwest::Client::new();
    let big = chat_body(40_000);
    for with_keys in [true, false] {
        let config = GatewayConfig {
            max_body_bytes: 48 << 10,
            max_buffered_body_bytes: 256 << 10,
            max_buffered_body_bytes_per_tenant: 48 << 10,
            api_key_file: with_keys.then(|| keys.path().display().to_string()),
            tenant_header: (!with_keys).then(|| "x-tenant".to_string()),
            ..common::config(&[&w], "round_robin")
        };
        let (r, _task) = common::start_router(config, stop.clone()).await;
        // Tenant A's credentials: a second key of the same tenant, or the same header.
        let (a_head, a_other, b) = if with_keys {
            ("Authorization: Bearer sk-a", ("authorization", "Bearer sk-a2"), ("authorization", "Bearer sk-b"))
        } else {
            ("x-tenant: a", ("x-tenant", "a"), ("x-tenant", "b"))
        };
        // A client of tenant A announces a 40,000-byte body, sends 1,000 bytes and stops.
        let mut slow = TcpStream::connect(addr(&r)).await.expect("connect");
        let (start, rest) = big.split_at(1000);
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{a_head}\r\n\
             Content-Length: {}\r\n\r\n{start}",
            big.len()
        );
        slow.write_all(head.as_bytes()).await.expect("write");
        held_until(&c, &r, |b| b >= 40_000.0).await;
        let post = |(name, value): (&str, &str)| {
            c.post(format!("{r}/v1/chat/completions")).header("content-type", "application/json").header(name, value)
        };
        // Tenant A's next large body passes A's share: 429, naming the share, not the budget.
        let a = guard(post(a_other).body(big.clone()).send()).await.expect("send");
        assert_eq!(a.status(), 429, "with_keys {with_keys}");
        assert_eq!(a.headers().get("retry-after").and_then(|v| v.to_str().ok()), Some("1"));
        let text = a.text().await.expect("text");
        assert!(text.contains("max_buffered_body_bytes_per_tenant"), "{text}");
        // Tenant B's is served: the budget has room, and B's share is its own.
        let a = guard(post(b).body(big.clone()).send()).await.expect("send");
        assert_eq!(a.status(), 200, "{}", a.text().await.unwrap_or_default());
        if with_keys {
            let m = c.get(format!("{r}/metrics")).send().await.expect("metrics").text().await.expect("text");
            let line = r#"kvroute_tenant_requests_total{tenant="team-a",outcome="over_body_share"} 1"#;
            assert!(m.lines().any(|l| l == line), "{m}");
        }
        // The slow body ends and is served; A's share is back, and A's large body served.
        slow.write_all(rest.as_bytes()).await.expect("write");
        let mut answer = vec![0u8; 12];
        guard(slow.read_exact(&mut answer)).await.expect("read");
        assert_eq!(&answer, b"HTTP/1.1 200", "{}", String::from_utf8_lossy(&answer));
        held_until(&c, &r, |b| b == 0.0).await;
        let a = guard(post(a_other).body(big.clone()).send()).await.expect("send");
        assert_eq!(a.status(), 200, "{}", a.text().await.unwrap_or_default());
    }
    stop.cancel();
}

/// One tenant has at most `max_in_flight_per_tenant` requests in the router: with two of
/// tenant A's streams open, A's third request is refused with 429 and `Retry-After`
/// (counted `over_in_flight`) while tenant B is served; once A's streams end, A is served
/// again. Without the bound, A's streams could fill `max_in_flight_per_model` for everyone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenant_has_at_most_its_share_of_requests_in_flight() {
    let (stop, w, keys) = worker_and_keys("inflight", "sk-a team-a\nsk-b team-b\n").await;
    let config = GatewayConfig {
        max_in_flight_per_tenant: 2,
        api_key_file: Some(keys.path().display().to_string()),
        ..common::config(&[&w], "round_robin")
    };
    let (r, _task) = common::start_router(config, stop.clone()).await;
    let c = reqwest::Client::new();
    let send = |key: &str, stream: bool| {
        let body = serde_json::json!({
            "model": "sim-llama-3-8b", "max_tokens": if stream { 4000 } else { 1 }, "stream": stream,
            "messages": [{"role": "user", "content": "hello"}],
        });
        guard(c.post(format!("{r}/v1/chat/completions")).bearer_auth(key).json(&body).send())
    };
    // Two long streams of tenant A, each past its first chunk: both in flight.
    let mut open = Vec::new();
    for _ in 0..2 {
        let mut s = send("sk-a", true).await.expect("send");
        assert_eq!(s.status(), 200);
        guard(s.chunk()).await.expect("first chunk").expect("a chunk");
        open.push(s);
    }
    let a = send("sk-a", false).await.expect("send");
    assert_eq!(a.status(), 429);
    assert_eq!(a.headers().get("retry-after").and_then(|v| v.to_str().ok()), Some("1"));
    let text = a.text().await.expect("text");
    assert!(text.contains("max_in_flight_per_tenant"), "{text}");
    assert_eq!(send("sk-b", false).await.expect("send").status(), 200, "tenant B is served");
    let m = c.get(format!("{r}/metrics")).send().await.expect("metrics").text().await.expect("text");
    let line = r#"kvroute_tenant_requests_total{tenant="team-a",outcome="over_in_flight"} 1"#;
    assert!(m.lines().any(|l| l == line), "{m}");
    // A's streams end (the client goes): A's places come back.
    drop(open);
    guard(async {
        while send("sk-a", false).await.expect("send").status() != 200 {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await;
    stop.cancel();
}

/// A request refused before its body is read (here 401: no API key) has its body read and
/// dropped after the refusal is sent, so a client still sending a large body finishes
/// writing it instead of hitting a broken pipe (the router closed the connection under it
/// before: its refusal was lost). The client reads the refusal first, then writes 4 MiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_refused_before_it_is_read_is_drained_not_cut() {
    let (stop, w, keys) = worker_and_keys("drain", "sk-a team-a\n").await;
    let config = GatewayConfig {
        max_body_bytes: 8 << 20,
        api_key_file: Some(keys.path().display().to_string()),
        ..common::config(&[&w], "round_robin")
    };
    let (r, _task) = common::start_router(config, stop.clone()).await;
    let body = chat_body(4 << 20);
    let mut s = TcpStream::connect(addr(&r)).await.expect("connect");
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.expect("write head");
    let mut status = vec![0u8; 12];
    guard(s.read_exact(&mut status)).await.expect("read");
    assert_eq!(&status, b"HTTP/1.1 401", "{}", String::from_utf8_lossy(&status));
    guard(async { s.write_all(body.as_bytes()).await.expect("the body is read, not cut off") }).await;
    stop.cancel();
}

/// A simulated worker and an API key file of `keys` (named by `tag`), with the token that
/// stops the worker.
async fn worker_and_keys(tag: &str, keys: &str) -> (CancellationToken, String, tempfile::NamedTempFile) {
    let stop = CancellationToken::new();
    let (w, _) = engine_sim::spawn_local(EngineSimConfig::default(), stop.clone()).await.expect("worker");
    let file =
        tempfile::Builder::new().prefix(&format!("kvroute-{tag}-keys-")).suffix(".txt").tempfile().expect("temp file");
    std::fs::write(file.path(), keys).expect("write keys");
    (stop, w, file)
}
