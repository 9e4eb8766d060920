//! Failing over from hung and dead workers, and what failures look like to clients and in
//! the metrics, end to end on 127.0.0.1 with real workers (small axum servers in the test,
//! each scripted request by request):
//! - a request waiting for a first byte from a worker that health checks mark down goes to
//!   another worker (non-streamed, and streamed before its first chunk), or gets a 502 JSON
//!   error when none is left;
//! - a lone flaky worker gets `max_total_retries` attempts, not `max_worker_retries`;
//! - every error is OpenAI-shaped JSON naming the field; a worker's plain-text error is
//!   wrapped with its status;
//! - `kvroute_requests_total` counts timeouts as `timeout`, failures and disconnects before
//!   the first byte with the worker they happened on.
//!
//! Waits are bounded polls behind a hang guard (a failure, never a timing assertion).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use tokio_util::sync::CancellationToken;

mod common;
use common::{config as cfg, eventually, guard};

/// What a scripted worker does with one inference request.
#[derive(Clone, Copy, Debug)]
enum Act {
    /// A whole answer (or a two-event stream) whose text names the worker.
    Answer,
    /// Never answers (a stream: headers, then nothing); with `down`, its `/health` fails
    /// from then on.
    Hang { down: bool },
    /// An error: status, content type, body.
    Fail(u16, &'static str, &'static str),
    /// A stream of one event every 50 ms that never ends (a long generation).
    Drip,
}

type Script = Arc<dyn Fn(usize) -> Act + Send + Sync>;

/// A worker on 127.0.0.1 serving `/health` (200 until a `Hang { down: true }`, then 503),
/// `/v1/models` (model `m`) and `/v1/chat/completions` as `script` says for its n-th
/// request (from 0). Returns its URL, its request counter and its stop token.
async fn worker(name: &'static str, script: Script) -> (String, Arc<AtomicUsize>, CancellationToken) {
    use axum::routing::{get, post};
    let requests = Arc::new(AtomicUsize::new(0));
    let healthy = Arc::new(AtomicBool::new(true));
    let (n, h) = (Arc::clone(&requests), Arc::clone(&healthy));
    let app = axum::Router::new()
        .route(
            "/health",
            get(move || {
                let ok = h.load(SeqCst);
                async move { if ok { axum::http::StatusCode::OK } else { axum::http::StatusCode::SERVICE_UNAVAILABLE } }
            }),
        )
        .route("/v1/models", get(|| async { axum::Json(serde_json::json!({"data": [{"id": "m"}]})) }))
        .route(
            "/v1/chat/completions",
            post(move |body: axum::Json<serde_json::Value>| {
                let act = script(n.fetch_add(1, SeqCst));
                let stream = body.get("stream").and_then(serde_json::Value::as_bool).unwrap_or(false);
                let healthy = Arc::clone(&healthy);
                async move { act_out(name, act, stream, &healthy).await }
            }),
        );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", l.local_addr().expect("addr"));
    let stop = CancellationToken::new();
    let s = stop.clone();
    tokio::spawn(async move { axum::serve(l, app).with_graceful_shutdown(async move { s.cancelled().await }).await });
    (url, requests, stop)
}

async fn act_out(name: &str, act: Act, stream: bool, healthy: &AtomicBool) -> axum::response::Response {
    use axum::body::{Body, Bytes};
    let sse = |body: Body| {
        axum::response::Response::builder().header("content-type", "text/event-stream").body(body).expect("response")
    };
    match act {
        Act::Answer if stream => {
            let ev = serde_json::json!({"choices": [{"index": 0, "delta": {"content": format!("from {name}")}}]});
            sse(Body::from(format!("data: {ev}\n\ndata: [DONE]\n\n")))
        }
        Act::Answer => axum::Json(serde_json::json!({
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": format!("from {name}")},
                "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}))
        .into_response_(),
        Act::Hang { down } => {
            if down {
                healthy.store(false, SeqCst);
            }
            if stream {
                // Headers at once, then no chunk: an engine stuck before its first token.
                sse(Body::from_stream(futures_util::stream::pending::<Result<Bytes, std::io::Error>>()))
            } else {
                std::future::pending().await
            }
        }
        Act::Drip => {
            let ev = serde_json::json!({"choices": [{"index": 0, "delta": {"content": "x"}}]});
            let chunk = Bytes::from(format!("data: {ev}\n\n"));
            sse(Body::from_stream(futures_util::stream::unfold(chunk, |chunk| async move {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                Some((Ok::<_, std::io::Error>(chunk.clone()), chunk))
            })))
        }
        Act::Fail(status, content_type, body) => axum::response::Response::builder()
            .status(status)
            .header("content-type", content_type)
            .body(Body::from(body))
            .expect("response"),
    }
}

/// `axum::response::IntoResponse::into_response` under a name that does not clash with
/// the match arms above.
trait IntoResponse_ {
    fn into_response_(self) -> axum::response::Response;
}
impl<T: axum::response::IntoResponse> IntoResponse_ for T {
    fn into_response_(self) -> axum::response::Response {
        self.into_response()
    }
}

/// A client presenting the tests' admin token (these tests read `/workers`), ring installed
/// as rustls's provider first (reqwest is built without one).
fn client() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    common::client()
}

fn chat(stream: bool) -> serde_json::Value {
    serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5,
        "stream": stream})
}

/// Health checks every 0.1 s, one failure marks a worker down.
fn quick_health(urls: &[&str]) -> kvroute_gateway::GatewayConfig {
    let mut config = cfg(urls, "round_robin");
    config.health.interval_secs = 0.1;
    config.health.timeout_secs = 1.0;
    config.health.failure_threshold = 1;
    config
}

/// The `kvroute_requests_total` sample with `worker` and `outcome` (0 when absent).
async fn requests_total(c: &reqwest::Client, router: &str, worker: &str, outcome: &str) -> f64 {
    let text = guard(c.get(format!("{router}/metrics")).send()).await.expect("metrics").text().await.expect("text");
    let (w, o) = (format!("worker=\"{worker}\""), format!("outcome=\"{outcome}\""));
    text.lines()
        .filter(|l| l.starts_with("kvroute_requests_total{") && l.contains(&w) && l.contains(&o))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waiting_on_a_worker_marked_down_completes_on_another_worker() {
    let c = client();
    for stream in [false, true] {
        // Whichever worker gets the first request hangs and fails its health checks from
        // then on; the other answers.
        let first = Arc::new(AtomicBool::new(false));
        let script = |first: Arc<AtomicBool>| -> Script {
            Arc::new(move |_| if first.swap(true, SeqCst) { Act::Answer } else { Act::Hang { down: true } })
        };
        let (a, na, stop_a) = worker("a", script(Arc::clone(&first))).await;
        let (b, nb, stop_b) = worker("b", script(Arc::clone(&first))).await;
        let stop = CancellationToken::new();
        let (r, _task) = common::start_router(quick_health(&[&a, &b]), stop.clone()).await;
        // Before: the request waited for the hung worker until request_timeout_secs (600 s)
        // or, streamed, stream_first_byte_timeout_secs (300 s).
        let resp = guard(c.post(format!("{r}/v1/chat/completions")).json(&chat(stream)).send()).await.expect("send");
        assert_eq!(resp.status(), 200, "stream {stream}");
        let text = guard(resp.text()).await.expect("body");
        assert_eq!((na.load(SeqCst), nb.load(SeqCst)), (1, 1), "stream {stream}: one request on each worker");
        let (served, hung) = match (text.contains("from a"), text.contains("from b")) {
            (true, false) => (&a, &b),
            (false, true) => (&b, &a),
            _ => panic!("stream {stream}: one worker's answer: {text}"),
        };
        assert!(!text.contains("error"), "stream {stream}: no error event: {text}");
        let v: serde_json::Value =
            guard(c.get(format!("{r}/workers")).send()).await.expect("workers").json().await.expect("json");
        let health = |url: &str| {
            v["workers"].as_array().expect("rows").iter().find(|w| w["url"] == url).map(|w| w["health"].clone())
        };
        assert_eq!(health(hung), Some("unhealthy".into()), "the worker that hung is down: {v}");
        assert_eq!(health(served), Some("healthy".into()), "{v}");
        // Moving on is not a failure of the request: it is counted once, `ok`, on the worker
        // that served it.
        eventually("the request is counted", async || requests_total(&c, &r, served, "ok").await == 1.0).await;
        assert_eq!(requests_total(&c, &r, hung, "upstream_error").await, 0.0);
        stop.cancel();
        stop_a.cancel();
        stop_b.cancel();
    }

    // A lone worker marked down: nothing is left to try, the waiting client gets a 502 JSON
    // error saying why instead of waiting, counted on that worker.
    for stream in [false, true] {
        let (a, _na, stop_a) = worker("a", Arc::new(|_| Act::Hang { down: true })).await;
        let stop = CancellationToken::new();
        let (r, _task) = common::start_router(quick_health(&[&a]), stop.clone()).await;
        let resp = guard(c.post(format!("{r}/v1/chat/completions")).json(&chat(stream)).send()).await.expect("send");
        assert_eq!(resp.status(), 502, "stream {stream}");
        let v: serde_json::Value = guard(resp.json()).await.expect("json");
        assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("marked down")), "{v}");
        assert_eq!(requests_total(&c, &r, &a, "upstream_error").await, 1.0, "stream {stream}");
        stop.cancel();
        stop_a.cancel();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_flaky_worker_gets_max_total_retries_attempts() {
    let c = client();
    // Fails its first five requests, answers the sixth: within max_total_retries (6), not
    // within max_worker_retries (3). Before, a lone worker got 3 attempts: a fleet of one or
    // two workers failing half their requests served 85–89 % of them.
    let (a, na, stop_a) =
        worker("a", Arc::new(|n| if n < 5 { Act::Fail(500, "text/plain", "busy") } else { Act::Answer })).await;
    let mut config = cfg(&[&a], "round_robin");
    config.health.interval_secs = 3600.0;
    config.max_worker_retries = 3;
    config.max_total_retries = 6;
    let stop = CancellationToken::new();
    let (r, _task) = common::start_router(config, stop.clone()).await;
    let resp = guard(c.post(format!("{r}/v1/chat/completions")).json(&chat(false)).send()).await.expect("send");
    assert_eq!(resp.status(), 200);
    assert!(guard(resp.text()).await.expect("body").contains("from a"));
    assert_eq!(na.load(SeqCst), 6, "six attempts on the lone worker");
    // And no more than that: always failing, it is tried max_total_retries times, then 502
    // (counted on it).
    let (b, nb, stop_b) = worker("b", Arc::new(|_| Act::Fail(503, "text/plain", "down"))).await;
    let mut config = cfg(&[&b], "round_robin");
    config.health.interval_secs = 3600.0;
    config.expose_decision_headers = false;
    let stop2 = CancellationToken::new();
    let (r2, _task2) = common::start_router(config, stop2.clone()).await;
    // A client without the admin token is not told the worker's address; the operator is.
    let anyone = reqwest::Client::new();
    let resp = guard(anyone.post(format!("{r2}/v1/chat/completions")).json(&chat(true)).send()).await.expect("send");
    assert_eq!(resp.status(), 502);
    let v: serde_json::Value = guard(resp.json()).await.expect("json");
    let m = v["error"]["message"].as_str().unwrap_or_default();
    assert!(m.contains("6 made, 6 at most") && m.contains("a worker: upstream answered 503"), "{v}");
    assert!(!m.contains(b.trim_start_matches("http://")), "the worker's address reached a client: {m}");
    assert_eq!(nb.load(SeqCst), 6);
    assert_eq!(requests_total(&c, &r2, &b, "upstream_error").await, 1.0, "the 502 names its worker");
    let resp = guard(c.post(format!("{r2}/v1/chat/completions")).json(&chat(false)).send()).await.expect("send");
    let v: serde_json::Value = guard(resp.json()).await.expect("json");
    assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains(&format!("{b}: upstream answered"))), "{v}");
    for s in [stop, stop2, stop_a, stop_b] {
        s.cancel();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_are_openai_json_naming_the_field_and_a_worker_s_plain_text_error_is_wrapped() {
    let c = client();
    let (a, _na, stop_a) =
        worker("a", Arc::new(|_| Act::Fail(400, "text/plain; charset=utf-8", "Bad Request: context too long"))).await;
    let stop = CancellationToken::new();
    let (r, _task) = common::start_router(cfg(&[&a], "round_robin"), stop.clone()).await;
    // A worker's plain-text error reaches the client as JSON, with the worker's status.
    for stream in [false, true] {
        let resp = guard(c.post(format!("{r}/v1/chat/completions")).json(&chat(stream)).send()).await.expect("send");
        assert_eq!(resp.status(), 400, "stream {stream}");
        assert_eq!(resp.headers()["content-type"], "application/json");
        let v: serde_json::Value = guard(resp.json()).await.expect("json");
        assert_eq!(v["error"]["message"], "Bad Request: context too long", "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        assert_eq!(v["error"]["code"], 400, "{v}");
    }
    assert_eq!(requests_total(&c, &r, &a, "client_error").await, 2.0);
    // An empty prompt is refused before routing, naming its field (before: accepted and
    // sent on, for the engine to refuse).
    for (path, body, field) in [
        ("/v1/completions", serde_json::json!({"model": "m", "prompt": ""}), "prompt"),
        ("/v1/completions", serde_json::json!({"model": "m", "prompt": ["x", ""]}), "prompt"),
        (
            "/v1/chat/completions",
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": ""}]}),
            "messages",
        ),
        ("/generate", serde_json::json!({"text": ""}), "text"),
        ("/v1/chat/completions", serde_json::json!({"messages": []}), "model"),
    ] {
        let resp = guard(c.post(format!("{r}{path}")).json(&body).send()).await.expect("send");
        assert_eq!(resp.status(), 400, "{path} {body}");
        let v: serde_json::Value = guard(resp.json()).await.expect("json");
        assert_eq!(v["error"]["param"], field, "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    }
    stop.cancel();
    stop_a.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_and_disconnects_before_the_first_byte_are_counted_with_their_worker() {
    let c = client();
    let (a, na, stop_a) = worker("a", Arc::new(|_| Act::Hang { down: false })).await;
    let mut config = cfg(&[&a], "round_robin");
    config.stream_first_byte_timeout_secs = 0.3;
    let stop = CancellationToken::new();
    let (r, _task) = common::start_router(config, stop.clone()).await;
    // No first chunk within the deadline: 504 JSON, outcome `timeout` on the worker (was
    // `upstream_error` with `worker=""`).
    let resp = guard(c.post(format!("{r}/v1/chat/completions")).json(&chat(true)).send()).await.expect("send");
    assert_eq!(resp.status(), 504);
    let v: serde_json::Value = guard(resp.json()).await.expect("json");
    assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("sent no response")), "{v}");
    assert_eq!(requests_total(&c, &r, &a, "timeout").await, 1.0);
    assert_eq!(requests_total(&c, &r, "", "upstream_error").await, 0.0);
    // A client that goes away while the worker has not answered: `cancelled`, on the worker
    // (before, nothing was counted).
    let before = na.load(SeqCst);
    let gone = tokio::spawn({
        let (c, r) = (c.clone(), r.clone());
        async move { c.post(format!("{r}/v1/chat/completions")).json(&chat(false)).send().await }
    });
    eventually("the worker has the request", async || na.load(SeqCst) > before).await;
    gone.abort();
    eventually("the disconnect is counted", async || requests_total(&c, &r, &a, "cancelled").await == 1.0).await;
    // … and so is one that goes away while its body is still being read (no worker yet).
    let mut raw = tokio::net::TcpStream::connect(r.trim_start_matches("http://")).await.expect("connect");
    let head = concat!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n",
        "content-length: 100\r\n\r\n{\"model\":"
    );
    tokio::io::AsyncWriteExt::write_all(&mut raw, head.as_bytes()).await.expect("write");
    let pending = requests_total(&c, &r, "", "cancelled").await;
    assert_eq!(pending, 0.0);
    // The router reads the partial body; then the client leaves.
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    drop(raw);
    eventually("the early disconnect is counted", async || requests_total(&c, &r, "", "cancelled").await == 1.0).await;
    stop.cancel();
    stop_a.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleets_of_one_and_two_workers_failing_half_their_requests_serve_nearly_all() {
    use kvroute_engine_sim::{self as engine_sim, EngineSimConfig, Profile};
    let c = client();
    let mut profile = Profile::named("h100-llama3-8b").expect("profile");
    profile.prefill_per_token_s = 1e-4;
    for n in [1u64, 2] {
        let mut stops = Vec::new();
        let mut urls = Vec::new();
        for seed in 0..n {
            let stop = CancellationToken::new();
            let sim = EngineSimConfig {
                profile: profile.clone(),
                time_scale: 50.0,
                error_rate: 0.5,
                fault_seed: seed,
                ..EngineSimConfig::default()
            };
            let (url, _sim) = engine_sim::spawn_local(sim, stop.clone()).await.expect("start a simulated worker");
            urls.push(url);
            stops.push(stop);
        }
        let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
        let stop = CancellationToken::new();
        let (r, _task) = common::start_router(cfg(&urls, "round_robin"), stop.clone()).await;
        let mut ok = 0;
        for i in 0..200 {
            let body = serde_json::json!({"model": "sim-llama-3-8b", "max_tokens": 5,
                "messages": [{"role": "user", "content": format!("half {i}")}]});
            let resp = guard(c.post(format!("{r}/v1/chat/completions")).json(&body).send()).await.expect("send");
            if resp.status() == 200 {
                ok += 1;
            }
        }
        // Six attempts each, every one failing with probability 0.5: 1 in 64 requests fails
        // on average (≈ 3 of 200). Before, the lone routable worker (the only one, or the
        // one left when the other was ejected) got 3 attempts: 85–89 % succeeded.
        assert!(ok >= 190, "{n} worker(s): {ok} of 200 requests succeeded");
        stop.cancel();
        for s in stops {
            s.cancel();
        }
    }
}

/// A worker that answers every GET with 200 and `{"data": []}` (healthy, listing no model:
/// it serves any) and hangs up on every POST as soon as it has its head, before reading
/// the body — as a worker with a body limit under the request's size does. Returns its URL
/// and how many POSTs it hung up on.
async fn hanging_up_worker(stop: CancellationToken) -> (String, Arc<AtomicUsize>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let posts = Arc::new(AtomicUsize::new(0));
    let n = Arc::clone(&posts);
    tokio::spawn(async move {
        loop {
            let (mut sock, _) = tokio::select! {
                a = listener.accept() => match a { Ok(a) => a, Err(_) => return },
                () = stop.cancelled() => return,
            };
            let n = Arc::clone(&n);
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 64 * 1024 {
                    match sock.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(k) => head.extend_from_slice(&buf[..k]),
                    }
                }
                if head.starts_with(b"POST") {
                    n.fetch_add(1, SeqCst);
                    return; // dropped: the connection closes under the request
                }
                let body = br#"{"data": []}"#;
                let resp = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                    body.len()
                );
                let _ = sock.write_all(resp.as_bytes()).await;
                let _ = sock.write_all(body).await;
            });
        }
    });
    (url, posts)
}

/// A request a worker hangs up on twice (the attempt and its resend) is not charged to the
/// worker: before, each such request counted as failed attempts, and a client sending
/// bodies over a worker's limit took healthy workers out of routing (found by a black-box
/// probe: 30 MiB bodies against axum-based workers); and the second such hang-up ends the
/// request, which otherwise uploaded its body once or twice for every attempt in the budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_its_worker_hangs_up_on_ejects_no_worker() {
    let c = client();
    let stop = CancellationToken::new();
    let (a, posts) = hanging_up_worker(stop.clone()).await;
    let mut config = cfg(&[&a], "round_robin");
    config.health.interval_secs = 3600.0;
    config.max_worker_retries = 3;
    config.max_total_retries = 6;
    let (r, _task) = common::start_router(config, stop.clone()).await;
    for _ in 0..2 {
        let resp = guard(c.post(format!("{r}/v1/chat/completions")).json(&chat(false)).send()).await.expect("send");
        assert_eq!(resp.status(), 502);
        let v: serde_json::Value = guard(resp.json()).await.expect("json");
        let m = v["error"]["message"].as_str().unwrap_or_default();
        assert!(m.contains("closed the connection before answering, twice"), "{v}");
        assert!(m.contains("the request itself"), "{v}");
    }
    // Each request: two attempts (`MAX_CLOSED_ATTEMPTS`, not the six of the retry budget),
    // each sent twice, and the worker still routable.
    assert_eq!(posts.load(SeqCst), 2 * 2 * 2, "attempts");
    let v: serde_json::Value = guard(c.get(format!("{r}/workers")).send()).await.expect("w").json().await.expect("j");
    let row = v["workers"].as_array().expect("rows").iter().find(|w| w["url"] == a.as_str()).cloned().expect("row");
    assert_eq!(row["ejected"], false, "{v}");
    assert_eq!(row["consecutive_failures"], 0, "{v}");
    stop.cancel();
}

/// A worker hanging up on a request does not end it while another worker may still serve
/// it: the first hang-up moves it to the next worker (two pooled connections to one worker
/// can go stale together), and every request gets its answer there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_one_worker_hangs_up_on_is_served_by_another() {
    let c = client();
    let stop = CancellationToken::new();
    let (a, posts) = hanging_up_worker(stop.clone()).await;
    let (b, answered, b_stop) = worker("b", Arc::new(|_| Act::Answer)).await;
    let mut config = cfg(&[&a, &b], "round_robin");
    config.health.interval_secs = 3600.0;
    let (r, _task) = common::start_router(config, stop.clone()).await;
    for _ in 0..4 {
        let resp = guard(c.post(format!("{r}/v1/chat/completions")).json(&chat(false)).send()).await.expect("send");
        assert_eq!(resp.status(), 200);
        let v: serde_json::Value = guard(resp.json()).await.expect("json");
        assert_eq!(v["choices"][0]["message"]["content"], "from b", "{v}");
    }
    assert_eq!(answered.load(SeqCst), 4, "every request answered by b");
    // Round robin sends half of them to the worker that hangs up, each sent twice there.
    assert_eq!(posts.load(SeqCst), 2 * 2, "hang-ups");
    stop.cancel();
    b_stop.cancel();
}

/// A stream still flowing when `request_timeout_secs` runs out ends with a 504 event naming
/// that limit, counted `timeout` and not charged to the worker: before, it was a 502
/// "error decoding response body" counted `upstream_error`, and long generations (or
/// clients that stopped reading) took healthy workers out of routing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_past_the_request_timeout_ends_with_a_504_not_charged_to_its_worker() {
    let c = client();
    let (a, _, stop_a) = worker("a", Arc::new(|_| Act::Drip)).await;
    let mut config = cfg(&[&a], "round_robin");
    config.health.interval_secs = 3600.0;
    config.request_timeout_secs = 0.5;
    config.max_worker_retries = 1;
    let stop = CancellationToken::new();
    let (r, _task) = common::start_router(config, stop.clone()).await;
    for _ in 0..2 {
        let resp = guard(c.post(format!("{r}/v1/chat/completions")).json(&chat(true)).send()).await.expect("send");
        assert_eq!(resp.status(), 200);
        let text = guard(resp.text()).await.expect("text");
        let last = text.lines().rfind(|l| l.starts_with("data: ")).expect("an event");
        let v: serde_json::Value = serde_json::from_str(&last["data: ".len()..]).expect("json");
        assert_eq!(v["error"]["code"], 504, "{v}");
        assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("request_timeout_secs")), "{v}");
    }
    assert_eq!(requests_total(&c, &r, &a, "timeout").await, 2.0);
    assert_eq!(requests_total(&c, &r, &a, "upstream_error").await, 0.0);
    let v: serde_json::Value = guard(c.get(format!("{r}/workers")).send()).await.expect("w").json().await.expect("j");
    let row = v["workers"].as_array().expect("rows").iter().find(|w| w["url"] == a.as_str()).cloned().expect("row");
    assert_eq!((row["ejected"].as_bool(), row["consecutive_failures"].as_u64()), (Some(false), Some(0)), "{v}");
    stop.cancel();
    stop_a.cancel();
}
