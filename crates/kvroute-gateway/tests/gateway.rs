//! Gateway integration tests on 127.0.0.1 with in-process simulated workers.
//!
//! Every client call is wrapped in a generous hang guard (a failure, not a timing
//! assertion): the property tested is "answers at all", never "answers fast".

use futures_util::StreamExt;
use kvroute_engine_sim::Profile;
use kvroute_engine_sim::{self as engine_sim, EngineSimConfig};
use kvroute_gateway::GatewayConfig;
use kvroute_gateway::config::SlotRouting;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

mod common;
use common::{config as cfg, guard};

struct Worker {
    url: String,
    sim: Arc<engine_sim::EngineSim>,
    stop: CancellationToken,
}

async fn worker(cfg: EngineSimConfig) -> Worker {
    let stop = CancellationToken::new();
    let (url, sim) = engine_sim::spawn_local(cfg, stop.clone()).await.expect("start a simulated worker");
    Worker { url, sim, stop }
}

fn fast() -> EngineSimConfig {
    let mut profile = Profile::named("h100-llama3-8b").expect("profile");
    profile.prefill_per_token_s = 1e-4;
    EngineSimConfig { profile, time_scale: 50.0, ..EngineSimConfig::default() }
}

struct Router {
    url: String,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

async fn router(mut cfg: GatewayConfig) -> Router {
    cfg.port = 0;
    let stop = CancellationToken::new();
    let (url, task) = common::start_router(cfg, stop.clone()).await;
    Router { url, stop, task }
}

fn chat(content: &str, stream: bool) -> serde_json::Value {
    serde_json::json!({"model": "sim-llama-3-8b", "messages": [{"role": "user", "content": content}],
        "max_tokens": 5, "stream": stream})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxies_non_stream_and_stream_with_explain_headers() {
    let (w1, w2) = (worker(fast()).await, worker(fast()).await);
    let r = router(cfg(&[&w1.url, &w2.url], "cache_aware")).await;
    let c = common::client();
    let resp = guard(c.post(format!("{}/v1/chat/completions", r.url)).json(&chat("hello there", false)).send())
        .await
        .expect("send");
    assert_eq!(resp.status(), 200);
    let worker_hdr =
        resp.headers().get("x-kvroute-worker").expect("worker header").to_str().expect("ascii").to_string();
    assert!(worker_hdr == w1.url || worker_hdr == w2.url, "{worker_hdr}");
    let decision =
        resp.headers().get("x-kvroute-decision").expect("decision header").to_str().expect("ascii").to_string();
    assert!(decision.starts_with("policy=cache_aware; branch="), "{decision}");
    let body: serde_json::Value = resp.json().await.expect("json");
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["usage"]["completion_tokens"], 5);

    let resp = guard(c.post(format!("{}/v1/chat/completions", r.url)).json(&chat("hello there", true)).send())
        .await
        .expect("send");
    assert_eq!(resp.status(), 200);
    assert!(resp.headers().get("content-type").expect("ctype").to_str().expect("a").starts_with("text/event-stream"));
    let mut s = resp.bytes_stream();
    let mut text = String::new();
    while let Some(chunk) = guard(s.next()).await {
        text.push_str(&String::from_utf8_lossy(&chunk.expect("chunk")));
    }
    assert_eq!(text.matches("data: ").count(), 5 + 1 + 1, "5 tokens, usage chunk, [DONE]: {text}");
    assert!(text.ends_with("data: [DONE]\n\n"));

    // /v1/completions and /generate too.
    let resp = guard(
        c.post(format!("{}/v1/completions", r.url))
            .json(&serde_json::json!({"model": "sim-llama-3-8b", "prompt": ["a", "b"], "max_tokens": 2}))
            .send(),
    )
    .await
    .expect("send");
    assert_eq!(resp.status(), 200);
    let resp = guard(
        c.post(format!("{}/generate", r.url))
            .json(&serde_json::json!({"text": "hi", "sampling_params": {"max_new_tokens": 3}}))
            .send(),
    )
    .await
    .expect("send");
    assert_eq!(resp.status(), 200);
    let v: serde_json::Value = resp.json().await.expect("json");
    assert_eq!(v["meta_info"]["completion_tokens"], 3);
    r.stop.cancel();
    let _ = r.task.await;
    w1.stop.cancel();
    w2.stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_aware_keeps_a_long_prefix_on_one_worker_and_its_cache_hits() {
    let ws = [worker(fast()).await, worker(fast()).await, worker(fast()).await];
    let urls: Vec<&str> = ws.iter().map(|w| w.url.as_str()).collect();
    let r = router(cfg(&urls, "cache_aware")).await;
    let c = common::client();
    let doc = "The quick brown fox jumps over the lazy dog. ".repeat(100);
    let mut first = None;
    for turn in 0..4 {
        let body = chat(&format!("{doc} Question {turn}?"), false);
        let resp = guard(c.post(format!("{}/v1/chat/completions", r.url)).json(&body).send()).await.expect("send");
        assert_eq!(resp.status(), 200);
        let w = resp.headers()["x-kvroute-worker"].to_str().expect("a").to_string();
        let v: serde_json::Value = resp.json().await.expect("json");
        if turn > 0 {
            assert_eq!(Some(&w), first.as_ref(), "turn {turn} moved");
            let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached");
            let prompt = v["usage"]["prompt_tokens"].as_u64().expect("prompt");
            assert!(cached * 10 >= prompt * 9, "turn {turn}: {cached}/{prompt} cached");
        }
        first.get_or_insert(w);
    }
    // The engine's own metrics agree with what it reported per request.
    let holder = ws.iter().find(|w| Some(&w.url) == first.as_ref()).expect("holder");
    let text = guard(c.get(format!("{}/metrics", holder.url)).send()).await.expect("m").text().await.expect("t");
    let hits: f64 = kvroute_protocol::engine_metrics::metric_sum(&text, "vllm:prefix_cache_hits_total").expect("hits");
    assert_eq!(hits as u64, holder.sim.stats().prefix_hit_tokens);
    r.stop.cancel();
    for w in &ws {
        w.stop.cancel();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_worker_is_retried_around_and_taken_out() {
    let (w1, w2) = (worker(fast()).await, worker(fast()).await);
    let mut config = cfg(&[&w1.url, &w2.url], "round_robin");
    config.health.interval_secs = 3600.0; // passive detection only
    let r = router(config).await;
    let c = common::client();
    let send = |i: usize| {
        let c = c.clone();
        let url = format!("{}/v1/chat/completions", r.url);
        async move { guard(c.post(url).json(&chat(&format!("q{i}"), i.is_multiple_of(2))).send()).await.expect("send") }
    };
    let mut seen = std::collections::HashSet::new();
    for i in 0..4 {
        let resp = send(i).await;
        assert_eq!(resp.status(), 200);
        seen.insert(resp.headers()["x-kvroute-worker"].to_str().expect("a").to_string());
        let _ = guard(resp.bytes()).await;
    }
    assert_eq!(seen.len(), 2, "round robin used both workers");
    // Kill w2 mid-test: every request still succeeds on w1 (retried before any byte was sent).
    w2.stop.cancel();
    tokio::time::sleep(Duration::from_millis(300)).await;
    for i in 4..14 {
        let resp = send(i).await;
        assert_eq!(resp.status(), 200, "request {i}");
        assert_eq!(resp.headers()["x-kvroute-worker"].to_str().expect("a"), w1.url);
        let _ = guard(resp.bytes()).await;
    }
    // After max_worker_retries failures w2 is out of routing.
    let v: serde_json::Value =
        guard(c.get(format!("{}/workers", r.url)).send()).await.expect("w").json().await.expect("j");
    let w2row =
        v["workers"].as_array().expect("arr").iter().find(|w| w["url"] == w2.url.as_str()).cloned().expect("row");
    assert_eq!(w2row["health"], "unhealthy", "{v}");
    // Kill w1 too: requests fail cleanly with a JSON error, never hang.
    w1.stop.cancel();
    tokio::time::sleep(Duration::from_millis(300)).await;
    for i in 14..18 {
        let resp = send(i).await;
        assert!(matches!(resp.status().as_u16(), 502 | 503), "{}", resp.status());
        let v: serde_json::Value = guard(resp.json()).await.expect("json error body");
        assert!(v["error"]["message"].is_string());
    }
    r.stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_worker_requests_move_to_the_fallback() {
    let flaky = worker(EngineSimConfig { error_rate: 1.0, ..fast() }).await;
    let good = worker(fast()).await;
    let r = router(cfg(&[&flaky.url, &good.url], "round_robin")).await;
    let c = common::client();
    for i in 0..6 {
        let resp = guard(c.post(format!("{}/v1/chat/completions", r.url)).json(&chat(&format!("x{i}"), true)).send())
            .await
            .expect("send");
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()["x-kvroute-worker"].to_str().expect("a"), good.url);
        let _ = guard(resp.bytes()).await;
    }
    let m = guard(c.get(format!("{}/metrics", r.url)).send()).await.expect("m").text().await.expect("t");
    assert!(m.contains("kvroute_retries_total"), "{m}");
    for name in [
        "kvroute_requests_total",
        "kvroute_decision_seconds",
        "kvroute_decision_cpu_seconds_count 6",
        "kvroute_ttft_seconds",
        "kvroute_worker_healthy",
        "kvroute_index_size",
    ] {
        assert!(m.contains(name), "missing {name}");
    }
    r.stop.cancel();
}

/// A worker that behaves like llama-server's overflow HTTP threads: it answers the first
/// POST on a connection with a keep-alive response, then reads the next POST on that
/// connection and closes it without answering. GETs (health, models) answer and close.
async fn closing_worker() -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut posts = 0;
                let mut buf = Vec::new();
                loop {
                    // One request: headers, then Content-Length bytes of body.
                    let head_end = loop {
                        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            break i + 4;
                        }
                        let mut chunk = [0u8; 4096];
                        match sock.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    };
                    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
                    let len = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:").map(|v| v.trim().parse::<usize>().unwrap_or(0)))
                        .unwrap_or(0);
                    while buf.len() < head_end + len {
                        let mut chunk = [0u8; 4096];
                        match sock.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    buf.drain(..head_end + len);
                    if !head.starts_with("post") {
                        let body = r#"{"object":"list","data":[]}"#;
                        let resp = format!(
                            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                            body.len()
                        );
                        let _ = sock.write_all(resp.as_bytes()).await;
                        return;
                    }
                    posts += 1;
                    if posts > 1 {
                        return; // closed under the client, no answer
                    }
                    let body = r#"{"id":"x","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}"#;
                    let resp = format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    if sock.write_all(resp.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    url
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_closed_under_a_request_sends_it_again_to_the_same_worker() {
    let (a, b) = (closing_worker().await, closing_worker().await);
    let r = router(cfg(&[&a, &b], "round_robin")).await;
    let c = common::client();
    // Round robin: a, b, a, b — the third and fourth requests go out on pooled connections
    // that the workers close under them.
    let mut served = Vec::new();
    for i in 0..4 {
        let resp = guard(c.post(format!("{}/v1/chat/completions", r.url)).json(&chat(&format!("q{i}"), false)).send())
            .await
            .expect("send");
        assert_eq!(resp.status(), 200, "request {i}");
        served.push(resp.headers()["x-kvroute-worker"].to_str().expect("a").to_string());
        let _ = guard(resp.bytes()).await;
    }
    assert_eq!(served[0], served[2], "the third request stays on the first request's worker");
    assert_eq!(served[1], served[3]);
    assert_ne!(served[0], served[1]);
    let m = guard(c.get(format!("{}/metrics", r.url)).send()).await.expect("m").text().await.expect("t");
    let value = |name: &str| {
        m.lines().find(|l| l.starts_with(name)).and_then(|l| l.rsplit(' ').next()).and_then(|v| v.parse::<f64>().ok())
    };
    assert_eq!(value("kvroute_stale_connection_resends_total"), Some(2.0), "{m}");
    assert_eq!(value("kvroute_retries_total"), Some(0.0), "no request moved to another worker");
    r.stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_get_the_right_status_and_json() {
    let w = worker(fast()).await;
    let mut config = cfg(&[&w.url], "cache_aware");
    config.max_body_bytes = 1000;
    config.admin_token = Some("s3cret".into());
    let r = router(config).await;
    let c = common::client();
    let post = |path: &str, body: Vec<u8>| {
        c.post(format!("{}{path}", r.url)).header("content-type", "application/json").body(body).send()
    };
    let cases: Vec<(&str, Vec<u8>, u16, Option<&str>)> = vec![
        ("/v1/chat/completions", vec![b'x'; 5000], 413, None),
        ("/v1/chat/completions", b"{not json".to_vec(), 400, Some("body")),
        ("/v1/chat/completions", b"\xff\xfe".to_vec(), 400, Some("body")),
        ("/v1/chat/completions", br#"{"messages":[{"role":"user","content":"x"}]}"#.to_vec(), 400, Some("model")),
        ("/v1/chat/completions", br#"{"model":"sim-llama-3-8b","messages":"x"}"#.to_vec(), 400, Some("messages")),
        ("/v1/completions", br#"{"model":"sim-llama-3-8b","prompt":7}"#.to_vec(), 400, Some("prompt")),
        (
            "/v1/chat/completions",
            br#"{"model":"nope","messages":[{"role":"user","content":"x"}]}"#.to_vec(),
            404,
            Some("model"),
        ),
        (
            "/generate",
            br#"{"text":"x","sampling_params":{"max_new_tokens":-1}}"#.to_vec(),
            400,
            Some("sampling_params.max_new_tokens"),
        ),
        ("/generate", br#"{"input_ids":[]}"#.to_vec(), 400, Some("input_ids")),
        ("/nowhere", b"{}".to_vec(), 404, None),
    ];
    // A known path with the wrong method: 405 with a JSON body (it was empty).
    let resp = guard(c.get(format!("{}/v1/chat/completions", r.url)).send()).await.expect("send");
    assert_eq!(resp.status(), 405);
    let v: serde_json::Value = guard(resp.json()).await.expect("a JSON 405 body");
    assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("GET")), "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "a client's mistake: {v}");
    // A compressed body: 415 naming the encoding (it was a 400 "not valid UTF-8").
    let resp = guard(
        c.post(format!("{}/v1/chat/completions", r.url))
            .header("content-type", "application/json")
            .header("content-encoding", "gzip")
            .body(vec![0x1f, 0x8b, 8, 0])
            .send(),
    )
    .await
    .expect("send");
    assert_eq!(resp.status(), 415);
    let v: serde_json::Value = guard(resp.json()).await.expect("a JSON 415 body");
    assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("gzip")), "{v}");
    for (path, body, status, param) in cases {
        let resp = guard(post(path, body)).await.expect("send");
        assert_eq!(resp.status().as_u16(), status, "{path}");
        let v: serde_json::Value = guard(resp.json()).await.expect("json body");
        assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()));
        if let Some(p) = param {
            assert_eq!(v["error"]["param"], p, "{v}");
        }
    }
    // Admin needs the token; URLs must be http(s).
    let resp = guard(c.post(format!("{}/add_worker?url=http://127.0.0.1:1", r.url)).send()).await.expect("send");
    assert_eq!(resp.status(), 401);
    let auth = |rb: reqwest::RequestBuilder| rb.header("authorization", "Bearer s3cret");
    let resp = guard(auth(c.post(format!("{}/add_worker?url=file:///etc/passwd", r.url))).send()).await.expect("send");
    assert_eq!(resp.status(), 400);
    // Live knobs: a bad knob is refused naming it, a good one applies.
    let resp = guard(
        auth(c.put(format!("{}/policy", r.url))).json(&serde_json::json!({"knobs": {"cache_threshold": 9}})).send(),
    )
    .await
    .expect("s");
    assert_eq!(resp.status(), 400);
    assert!(resp.text().await.expect("t").contains("cache_threshold"));
    let resp =
        guard(auth(c.put(format!("{}/policy", r.url))).json(&serde_json::json!({"cache_threshold": 0.3})).send())
            .await
            .expect("s");
    assert_eq!(resp.status(), 200);
    let v: serde_json::Value =
        guard(auth(c.get(format!("{}/policy", r.url))).send()).await.expect("s").json().await.expect("j");
    assert_eq!(v["knobs"]["cache_threshold"], 0.3);
    // A request served by the worker labels series with its URL; removing the worker drops
    // them (a fleet whose workers come and go keeps a bounded label set).
    let resp = guard(post("/v1/chat/completions", serde_json::to_vec(&chat("x", false)).expect("j"))).await.expect("s");
    assert_eq!(resp.status(), 200);
    let series = format!("worker=\"{}\"", w.url);
    let metrics =
        || async { guard(c.get(format!("{}/metrics", r.url)).send()).await.expect("m").text().await.expect("t") };
    let m = metrics().await;
    assert!(m.lines().any(|l| l.starts_with("kvroute_requests_total{") && l.contains(&series)), "{m}");
    assert!(m.lines().any(|l| l.starts_with("kvroute_worker_healthy{") && l.contains(&series)), "{m}");
    // Remove the only worker: 503, and /v1/models is empty rather than an error.
    let resp = guard(auth(c.post(format!("{}/remove_worker?url={}", r.url, w.url))).send()).await.expect("s");
    assert_eq!(resp.status(), 200);
    let m = metrics().await;
    assert!(!m.lines().any(|l| l.contains(&series)), "a removed worker's series stay:\n{m}");
    let resp = guard(post("/v1/chat/completions", serde_json::to_vec(&chat("x", false)).expect("j"))).await.expect("s");
    assert_eq!(resp.status(), 503);
    let v: serde_json::Value =
        guard(c.get(format!("{}/v1/models", r.url)).send()).await.expect("s").json().await.expect("j");
    assert_eq!(v["data"].as_array().map(Vec::len), Some(0));
    let resp = guard(c.get(format!("{}/readiness", r.url)).send()).await.expect("s");
    assert_eq!(resp.status(), 503);
    // Add it back under load-free conditions and route again; /debug/route explains.
    let resp = guard(auth(c.post(format!("{}/add_worker?url={}", r.url, w.url))).send()).await.expect("s");
    assert_eq!(resp.status(), 200);
    let resp =
        guard(auth(c.post(format!("{}/debug/route", r.url))).json(&chat("hello", false)).send()).await.expect("s");
    let v: serde_json::Value = resp.json().await.expect("j");
    assert_eq!(v["worker"], w.url.as_str());
    assert!(v["branch"].is_string());
    r.stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_rejects_at_once_with_retry_after() {
    // A hanging worker holds the only admission slot.
    let w = worker(EngineSimConfig { hang_rate: 1.0, ..fast() }).await;
    let mut config = cfg(&[&w.url], "round_robin");
    config.max_in_flight_per_model = 1;
    config.request_timeout_secs = 30.0;
    let r = router(config).await;
    let c = common::client();
    let url = format!("{}/v1/chat/completions", r.url);
    let hold = tokio::spawn({
        let c = c.clone();
        let url = url.clone();
        async move { c.post(url).json(&chat("hold", false)).send().await }
    });
    // Wait until the first request holds the slot (the ledger shows it in flight).
    for _ in 0..500 {
        let v: serde_json::Value =
            guard(c.get(format!("{}/workers", r.url)).send()).await.expect("w").json().await.expect("j");
        if v["workers"][0]["in_flight"] == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let resp = guard(c.post(&url).json(&chat("second", false)).send()).await.expect("send");
    assert_eq!(resp.status(), 503, "the second request must be rejected while the first holds the slot");
    assert_eq!(resp.headers()["retry-after"], "1");
    hold.abort();
    r.stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs KVROUTE_PYTHON, a python with the `openai` package (.ci/run installs one)"]
async fn openai_python_sdk_as_client() {
    let python = std::env::var("KVROUTE_PYTHON")
        .expect("KVROUTE_PYTHON: a python with the `openai` package (this test was asked for, so it must run)");
    let w = worker(fast()).await;
    let r = router(cfg(&[&w.url], "cache_aware")).await;
    let script = format!(
        r#"
import openai, sys
c = openai.OpenAI(base_url="{}/v1", api_key="unused")
models = [m.id for m in c.models.list()]
assert models == ["sim-llama-3-8b"], models
r = c.chat.completions.create(model="sim-llama-3-8b", messages=[{{"role": "user", "content": "hi"}}], max_tokens=4)
assert r.usage.completion_tokens == 4, r
assert len(r.choices[0].message.content) > 0
parts = []
for ch in c.chat.completions.create(model="sim-llama-3-8b", messages=[{{"role": "user", "content": "hi"}}], max_tokens=4, stream=True):
    if ch.choices and ch.choices[0].delta.content:
        parts.append(ch.choices[0].delta.content)
assert len(parts) == 4, parts
r = c.completions.create(model="sim-llama-3-8b", prompt="hello", max_tokens=3)
assert r.usage.completion_tokens == 3
try:
    c.chat.completions.create(model="missing", messages=[{{"role": "user", "content": "hi"}}])
    sys.exit("expected NotFoundError")
except openai.NotFoundError as e:
    assert e.status_code == 404
print("ok")
"#,
        r.url
    );
    let out = tokio::task::spawn_blocking(move || std::process::Command::new(python).arg("-c").arg(script).output())
        .await
        .expect("join")
        .expect("run python");
    assert!(
        out.status.success(),
        "stdout: {}\nstderr: {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    r.stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_start_worker_is_unhealthy_until_ready() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let w = worker(EngineSimConfig { slow_start_secs: 3600.0, ..fast() }).await;
    let c = common::client();
    let r = guard(c.get(format!("{}/health", w.url)).send()).await.expect("send");
    assert_eq!(r.status(), 503);
    // Its /v1/models answers, so a router adds it as healthy; the first failed active
    // check (failure_threshold 1) takes it out of routing.
    let mut config = cfg(&[&w.url], "round_robin");
    config.health.interval_secs = 0.05;
    config.health.failure_threshold = 1;
    let r = router(config).await;
    let mut ready = true;
    for _ in 0..200 {
        ready = guard(c.get(format!("{}/readiness", r.url)).send()).await.expect("send").status().is_success();
        if !ready {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!ready, "a worker failing /health must be taken out of routing");
    r.stop.cancel();
    w.stop.cancel();
}

/// The sum of the samples of `series` (a name, or a name with the start of its labels) in
/// a Prometheus text exposition.
fn metric_sum(text: &str, series: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(series) && l[series.len()..].starts_with([' ', '{']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_policy_predicts_ttft_and_learns_from_what_engines_report() {
    let (w1, w2) = (worker(fast()).await, worker(fast()).await);
    let mut config = cfg(&[&w1.url, &w2.url], "least_ttft");
    config.policy = GatewayConfig::default().policy;
    assert_eq!(config.policy, "least_ttft", "least_ttft is the default");
    let r = router(config).await;
    let c = common::client();
    // Streamed (TTFT measured at the first byte; the engine's usage chunk reports cached
    // tokens) and whole answers (cached tokens only), with a shared 2,000-character prefix so
    // the router predicts hits.
    let prefix = "x".repeat(2000);
    for i in 0..24 {
        let body = chat(&format!("{prefix} question {i}"), i % 2 == 0);
        let body = if i % 2 == 0 {
            let mut b = body;
            b["stream_options"] = serde_json::json!({"include_usage": true});
            b
        } else {
            body
        };
        let resp = guard(c.post(format!("{}/v1/chat/completions", r.url)).json(&body).send()).await.expect("send");
        assert_eq!(resp.status(), 200);
        let decision = resp.headers()["x-kvroute-decision"].to_str().expect("ascii").to_string();
        assert!(decision.contains("policy=least_ttft"), "{decision}");
        guard(resp.bytes()).await.expect("body");
    }
    // What the policy learned, per worker URL, and the prediction errors it exports.
    let mut got = serde_json::Value::Null;
    common::eventually("24 observations in GET /policy", async || {
        got = c.get(format!("{}/policy", r.url)).send().await.expect("policy").json().await.expect("json");
        let workers = got["calibration"]["sim-llama-3-8b"]["workers"].as_array().cloned().unwrap_or_default();
        workers.iter().map(|w| w["ttft_samples"].as_u64().unwrap_or(0)).sum::<u64>() == 12
    })
    .await;
    let workers = got["calibration"]["sim-llama-3-8b"]["workers"].as_array().expect("workers").clone();
    for w in &workers {
        let url = w["worker"].as_str().expect("named by URL");
        assert!(url == w1.url || url == w2.url, "{url}");
        let h = w["hit_ratio"].as_f64().expect("hit ratio");
        assert!((0.0..=1.0).contains(&h), "{w}");
    }
    assert!(workers.iter().map(|w| w["hit_samples"].as_u64().unwrap_or(0)).sum::<u64>() > 0, "{got}");
    let text = c.get(format!("{}/metrics", r.url)).send().await.expect("metrics").text().await.expect("text");
    assert_eq!(metric_sum(&text, "kvroute_ttft_prediction_ratio_count"), 12.0, "one per streamed request");
    // A dry run shows the decision's TTFT prediction (seconds, finite and positive).
    let v: serde_json::Value = guard(c.post(format!("{}/debug/route", r.url)).json(&chat(&prefix, false)).send())
        .await
        .expect("dry run")
        .json()
        .await
        .expect("json");
    let secs = v["predicted_ttft_secs"].as_f64().expect("a predicted TTFT");
    assert!(secs.is_finite() && secs > 0.0, "{v}");
    let predicted = metric_sum(&text, "kvroute_cached_tokens_predicted_total");
    let reported = metric_sum(&text, "kvroute_cached_tokens_reported_total");
    assert!(predicted > 0.0 && reported > 0.0, "predicted {predicted}, reported {reported}");
    r.stop.cancel();
    let _ = r.task.await;
    w1.stop.cancel();
    w2.stop.cancel();
}

/// One llama.cpp-like worker (the engine simulator's `cpu-smollm2-135m` profile: 2 slots,
/// no host prompt cache) holding document A in one slot and B in the other; a long
/// streamed request on A is decoding when another request on A arrives, then one on B.
/// Returns the cached prompt tokens the engine reported for those two, and the router's
/// `kvroute_llama_slot_waits_total`.
async fn two_documents_one_llama_worker(slot_routing: SlotRouting) -> (u64, u64, f64) {
    let profile = Profile::named("cpu-smollm2-135m").expect("profile");
    assert_eq!(profile.slots, 2);
    let w = worker(EngineSimConfig { profile, time_scale: 20.0, ..EngineSimConfig::default() }).await;
    let mut config = cfg(&[&w.url], "least_ttft");
    config.llama_slot_routing = slot_routing;
    let r = router(config).await;
    let c = common::client();
    let routed = slot_routing != SlotRouting::Off;
    common::eventually("the worker's slots (and, in auto, the probe's verdict) in /workers", async || {
        let v: serde_json::Value =
            c.get(format!("{}/workers", r.url)).send().await.expect("workers").json().await.expect("json");
        v.to_string().contains("\"llama_slots\":2") && v["workers"][0]["slot_routing"] == routed
    })
    .await;
    let ask = |content: String, max_tokens: u32, stream: bool| {
        let c = c.clone();
        let url = format!("{}/v1/chat/completions", r.url);
        async move {
            let body = serde_json::json!({"model": "sim-llama-3-8b", "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens, "stream": stream});
            let resp = guard(c.post(url).json(&body).send()).await.expect("send");
            assert_eq!(resp.status(), 200);
            resp
        }
    };
    let cached = |v: serde_json::Value| v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached");
    let (doc_a, doc_b) = ("a".repeat(1600), "b".repeat(1600));
    guard(ask(format!("{doc_a} question 0"), 4, false).await.bytes()).await.expect("A");
    guard(ask(format!("{doc_b} question 1"), 4, false).await.bytes()).await.expect("B");
    // A long answer on A: its slot is busy until the stream ends.
    let long = ask(format!("{doc_a} question 2"), 120, true).await;
    let mut chunks = long.bytes_stream();
    guard(chunks.next()).await.expect("a first chunk").expect("chunk");
    let second = tokio::spawn(ask(format!("{doc_a} question 3"), 4, false));
    while guard(chunks.next()).await.is_some() {}
    let a = cached(guard(guard(second).await.expect("join").json()).await.expect("json"));
    let b = cached(guard(ask(format!("{doc_b} question 4"), 4, false).await.json()).await.expect("json"));
    let text = c.get(format!("{}/metrics", r.url)).send().await.expect("metrics").text().await.expect("text");
    r.stop.cancel();
    let _ = r.task.await;
    w.stop.cancel();
    (a, b, metric_sum(&text, "kvroute_llama_slot_waits_total"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llama_slot_routing_keeps_two_documents_in_their_slots() {
    // Unpinned, the second request on A takes B's idle slot and computes A there, and B's
    // next request finds neither slot holding B: llama.cpp's slot swap.
    let (a, b, waits) = two_documents_one_llama_worker(SlotRouting::Off).await;
    assert_eq!((a, b, waits), (0, 0, 0.0), "without slot routing");
    // Pinned (`id_slot`), it waits for A's slot and finds A there; B stays in its slot.
    // `auto` finds no host prompt cache on this worker and pins as `true` does.
    for mode in [SlotRouting::On, SlotRouting::Auto] {
        let (a, b, waits) = two_documents_one_llama_worker(mode).await;
        assert!(a >= 384 && b >= 384, "{mode:?}: A {a}, B {b} cached tokens of ~405");
        assert_eq!(waits, 1.0, "{mode:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llama_slot_routing_auto_stays_off_for_a_worker_with_a_host_prompt_cache() {
    // Two llama.cpp-like workers, one keeping prompts in host memory (llama.cpp's default
    // `--cache-ram`), one not (`--cache-ram 0`): `auto` names slots only on the second.
    let profile = Profile::named("cpu-smollm2-135m").expect("profile");
    let with_cache = EngineSimConfig {
        profile: profile.clone(),
        time_scale: 20.0,
        host_prompt_cache: 16,
        ..EngineSimConfig::default()
    };
    let w1 = worker(with_cache).await;
    let w2 = worker(EngineSimConfig { profile, time_scale: 20.0, ..EngineSimConfig::default() }).await;
    let r = router(cfg(&[&w1.url, &w2.url], "least_ttft")).await;
    let c = common::client();
    let flags = || async {
        let v: serde_json::Value =
            c.get(format!("{}/workers", r.url)).send().await.expect("workers").json().await.expect("json");
        v["workers"]
            .as_array()
            .expect("rows")
            .iter()
            .map(|w| (w["host_prompt_cache"].clone(), w["slot_routing"].clone()))
            .collect::<Vec<_>>()
    };
    common::eventually("both probes done", async || flags().await.iter().all(|(h, _)| !h.is_null())).await;
    assert_eq!(
        flags().await,
        [(serde_json::json!(true), serde_json::json!(false)), (serde_json::json!(false), serde_json::json!(true))]
    );
    r.stop.cancel();
    let _ = r.task.await;
    w1.stop.cancel();
    w2.stop.cancel();
}
