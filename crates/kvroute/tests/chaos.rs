//! Chaos under load, with real processes on 127.0.0.1 (`kvroute serve` in front of
//! `kvroute engine-sim` workers): workers killed with SIGKILL and restarted under mixed
//! streamed and non-streamed load; workers failing half their requests, and a worker that
//! never answers, under concurrency; clients that disconnect or half-close. Each ends with the
//! router's ledger back to zero. Bounded in count, every wait has a hang guard, and no
//! assertion is on time.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

mod common;
use common::{Proc, free_port, ledger_drains, spawn_kvroute, wait_ok};

/// How one request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// 200 with the whole answer (`[DONE]` for a stream).
    Ok,
    /// A JSON error with a 5xx status before the response began.
    ServerError(u16),
    /// A stream that began and then ended with an SSE error event or a clean close.
    StreamCut,
    /// Anything else (a reset connection, a body that is not the right shape): a bug.
    Broken,
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// Starts an engine-sim worker on `port` with `extra` flags and waits for its `/health`.
async fn worker(port: u16, extra: &[&str]) -> Proc {
    let mut a = args(&["engine-sim", "--port", &port.to_string(), "--time-scale", "50"]);
    a.extend(args(extra));
    let p = spawn_kvroute(&a);
    wait_ok(&format!("http://127.0.0.1:{port}"), "/health").await;
    p
}

/// Starts `kvroute serve` in front of `workers` with `extra` flags; returns it and its URL
/// once `/readiness` passes.
async fn router(workers: &[String], extra: &[&str]) -> (Proc, String) {
    let port = free_port();
    let mut a = args(&["serve", "--port", &port.to_string(), "--health-interval-secs", "0.5"]);
    a.push("--worker-urls".into());
    a.push(workers.join(","));
    a.extend(args(extra));
    let p = spawn_kvroute(&a);
    let url = format!("http://127.0.0.1:{port}");
    wait_ok(&url, "/readiness").await;
    (p, url)
}

/// Sends request `i` (streamed or not) and classifies how it ended; 60 s hang guard.
async fn send(c: &reqwest::Client, router: &str, i: usize, stream: bool) -> Outcome {
    let body = serde_json::json!({"model": "sim-llama-3-8b", "max_tokens": 8, "stream": stream,
        "messages": [{"role": "user", "content": format!("document {} says hello; question {i}", i % 7)}]});
    let r = tokio::time::timeout(Duration::from_secs(60), async {
        let resp = match c.post(format!("{router}/v1/chat/completions")).json(&body).send().await {
            Ok(r) => r,
            Err(_) => return Outcome::Broken,
        };
        let status = resp.status().as_u16();
        let Ok(bytes) = resp.bytes().await else { return Outcome::Broken };
        let text = String::from_utf8_lossy(&bytes);
        match (status, stream) {
            (200, false) => match serde_json::from_slice::<serde_json::Value>(&bytes) {
                Ok(v) if v["choices"][0]["message"]["content"].is_string() => Outcome::Ok,
                _ => Outcome::Broken,
            },
            (200, true) if text.contains("data: [DONE]") => Outcome::Ok,
            (200, true) => Outcome::StreamCut,
            (500..=599, _) => match serde_json::from_slice::<serde_json::Value>(&bytes) {
                Ok(v) if v["error"]["message"].is_string() => Outcome::ServerError(status),
                _ => Outcome::Broken,
            },
            _ => Outcome::Broken,
        }
    })
    .await;
    r.expect("hang guard: a request got no answer within 60 s")
}

/// Runs `total` requests from `concurrency` clients (odd ones streamed); `done` counts the
/// answered ones as they finish. Returns each request's (streamed, outcome).
async fn load(router: &str, total: usize, concurrency: usize, done: Arc<AtomicUsize>) -> Vec<(bool, Outcome)> {
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (router, next, done) = (router.to_string(), Arc::clone(&next), Arc::clone(&done));
        tasks.push(tokio::spawn(async move {
            let c = common::client();
            let mut out = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= total {
                    return out;
                }
                let stream = i % 2 == 1;
                out.push((stream, send(&c, &router, i, stream).await));
                done.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("load task"));
    }
    all
}

/// Prints how the requests ended (shown with `--no-capture`, for the notes).
fn report(test: &str, outcomes: &[(bool, Outcome)]) {
    let n = |f: &dyn Fn(&Outcome) -> bool| outcomes.iter().filter(|(_, o)| f(o)).count();
    eprintln!(
        "{test}: {} requests, ok {}, stream cut {}, 5xx {}, broken {}",
        outcomes.len(),
        n(&|o| *o == Outcome::Ok),
        n(&|o| *o == Outcome::StreamCut),
        n(&|o| matches!(o, Outcome::ServerError(_))),
        n(&|o| *o == Outcome::Broken)
    );
}

/// Waits until `done` reaches `n`; fails after 120 s.
async fn reached(done: &AtomicUsize, n: usize) {
    for _ in 0..2400 {
        if done.load(Ordering::Relaxed) >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the load did not reach {n} answered requests within 120 s");
}

/// The router's `kvroute_requests_total{worker=URL,outcome="ok"}`.
async fn ok_count(c: &reqwest::Client, router: &str, worker: &str) -> f64 {
    let text = c.get(format!("{router}/metrics")).send().await.expect("metrics").text().await.expect("text");
    text.lines()
        .filter(|l| {
            l.starts_with("kvroute_requests_total{")
                && l.contains(&format!("worker=\"{worker}\""))
                && l.contains("outcome=\"ok\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_killed_and_restarted_under_mixed_load() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let ports = [free_port(), free_port(), free_port()];
    let mut workers = Vec::new();
    for p in ports {
        workers.push(worker(p, &[]).await);
    }
    let urls: Vec<String> = ports.iter().map(|p| format!("http://127.0.0.1:{p}")).collect();
    let (_router, r) = router(&urls, &["--policy", "round_robin", "--request-timeout-secs", "30"]).await;

    let (total, concurrency) = (400, 16);
    let done = Arc::new(AtomicUsize::new(0));
    let run = tokio::spawn({
        let (r, done) = (r.clone(), Arc::clone(&done));
        async move { load(&r, total, concurrency, done).await }
    });
    // SIGKILL worker 0 a quarter of the way in; start it again on its port at 60 %.
    reached(&done, total / 4).await;
    drop(workers.remove(0));
    reached(&done, total * 6 / 10).await;
    workers.insert(0, worker(ports[0], &[]).await);
    let outcomes = run.await.expect("load");
    report("kill and restart", &outcomes);
    assert_eq!(outcomes.len(), total);

    let broken = outcomes.iter().filter(|(_, o)| *o == Outcome::Broken).count();
    assert_eq!(broken, 0, "requests ended in a reset or a malformed answer: {outcomes:?}");
    // A non-streamed request is retried on another worker when its worker dies, so every
    // one of them succeeds.
    let failed_plain: Vec<_> = outcomes.iter().filter(|(s, o)| !s && *o != Outcome::Ok).collect();
    assert!(failed_plain.is_empty(), "non-streamed requests failed: {failed_plain:?}");
    // A stream already answering cannot be moved: at most the streams in flight on the
    // killed worker (at most `concurrency`) fail, with an SSE error event or a close.
    let failed = outcomes.iter().filter(|(_, o)| *o != Outcome::Ok).count();
    assert!(failed <= concurrency, "{failed} of {total} requests failed: {outcomes:?}");
    let ok_share = (total - failed) as f64 / total as f64;
    assert!(ok_share >= 0.95, "success share {ok_share}");

    // The restarted worker is back in rotation (after its health check, and an inference
    // probe when it was ejected): it answers requests again.
    let c = common::client();
    let before = ok_count(&c, &r, &urls[0]).await;
    let mut back = false;
    for i in 0..600 {
        assert_eq!(send(&c, &r, 10_000 + i, false).await, Outcome::Ok);
        if ok_count(&c, &r, &urls[0]).await > before {
            back = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(back, "the restarted worker never received a request again");
    ledger_drains(&c, &r).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_failing_half_their_requests_under_concurrency() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut workers = Vec::new();
    let mut urls = Vec::new();
    for seed in 1..=4 {
        let p = free_port();
        workers.push(worker(p, &["--error-rate", "0.5", "--fault-seed", &seed.to_string()]).await);
        urls.push(format!("http://127.0.0.1:{p}"));
    }
    let (_router, r) = router(&urls, &["--policy", "cache_aware"]).await;
    let total = 240;
    let outcomes = load(&r, total, 8, Arc::new(AtomicUsize::new(0))).await;
    report("half failing", &outcomes);
    assert_eq!(outcomes.len(), total);
    assert!(!outcomes.iter().any(|(_, o)| *o == Outcome::Broken), "{outcomes:?}");
    // Retries hide the failures: an attempt fails with probability 0.5 and a request has up
    // to 6 (1 in 64 fails on average); the ejection cap keeps half the workers in routing.
    // The bar is 95 %.
    let ok = outcomes.iter().filter(|(_, o)| *o == Outcome::Ok).count();
    assert!(ok * 100 >= total * 95, "{ok} of {total} succeeded: {outcomes:?}");
    ledger_drains(&common::client(), &r).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_never_answers_costs_a_few_504s_then_is_taken_out() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut workers = Vec::new();
    let mut urls = Vec::new();
    for hang in ["0", "0", "1.0"] {
        let p = free_port();
        workers.push(worker(p, &["--hang-rate", hang]).await);
        urls.push(format!("http://127.0.0.1:{p}"));
    }
    // A request on the hung worker ends with a 504 at its timeout (it is not retried: the
    // client's time budget is spent); the third timeout in a row takes the worker out.
    let (_router, r) = router(
        &urls,
        &["--policy", "round_robin", "--request-timeout-secs", "3", "--stream-first-byte-timeout-secs", "3"],
    )
    .await;
    let (total, concurrency) = (120, 8);
    let outcomes = load(&r, total, concurrency, Arc::new(AtomicUsize::new(0))).await;
    report("hung worker", &outcomes);
    assert_eq!(outcomes.len(), total, "every request was answered");
    let unexpected: Vec<_> =
        outcomes.iter().filter(|(_, o)| !matches!(o, Outcome::Ok | Outcome::ServerError(504))).collect();
    assert!(unexpected.is_empty(), "only 504s may fail: {unexpected:?}");
    // Only requests sent to the hung worker before its third timeout fail: at most
    // `concurrency` wait on it at once, for at most two waves.
    let timeouts = outcomes.iter().filter(|(_, o)| *o == Outcome::ServerError(504)).count();
    assert!(timeouts <= 2 * concurrency, "{timeouts} requests timed out: {outcomes:?}");
    ledger_drains(&common::client(), &r).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnecting_and_half_closing_clients_leave_no_load() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (p1, p2) = (free_port(), free_port());
    // Slow enough (real-time engine model) that clients leave while requests are in flight.
    let _w1 = spawn_kvroute(&args(&["engine-sim", "--port", &p1.to_string(), "--time-scale", "2"]));
    let _w2 = spawn_kvroute(&args(&["engine-sim", "--port", &p2.to_string(), "--time-scale", "2"]));
    let urls = [format!("http://127.0.0.1:{p1}"), format!("http://127.0.0.1:{p2}")];
    for u in &urls {
        wait_ok(u, "/health").await;
    }
    let (_router, r) = router(&urls, &[]).await;
    let addr = r.trim_start_matches("http://").to_string();
    let raw = |i: usize, stream: bool| {
        let body = serde_json::json!({"model": "sim-llama-3-8b", "max_tokens": 64, "stream": stream,
            "messages": [{"role": "user", "content": format!("{} question {i}", "long context ".repeat(200))}]})
        .to_string();
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    let mut tasks = Vec::new();
    for i in 0..36 {
        let req = raw(i, i % 2 == 0);
        let addr = addr.clone();
        tasks.push(tokio::spawn(async move {
            let mut s = tokio::net::TcpStream::connect(&addr).await.expect("connect");
            s.write_all(req.as_bytes()).await.expect("write");
            match i % 3 {
                // Gone at once, before any answer.
                0 => drop(s),
                // Gone after the first bytes of the answer (mid-stream for a stream).
                1 => {
                    let mut b = [0u8; 64];
                    let _ = tokio::time::timeout(Duration::from_secs(60), s.read(&mut b)).await;
                    drop(s);
                }
                // Half-closed: the write side shut after the request, then read until the
                // router closes (an answer, or a close: kvroute treats it as gone).
                _ => {
                    s.shutdown().await.expect("shutdown write");
                    let mut rest = Vec::new();
                    let _ = tokio::time::timeout(Duration::from_secs(60), s.read_to_end(&mut rest))
                        .await
                        .expect("hang guard: a half-closed client was never answered nor closed");
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("client");
    }
    let c = common::client();
    ledger_drains(&c, &r).await;
    // And the router still serves.
    assert_eq!(send(&c, &r, 1, false).await, Outcome::Ok);
    assert_eq!(send(&c, &r, 2, true).await, Outcome::Ok);
    ledger_drains(&c, &r).await;
}
