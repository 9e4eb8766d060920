//! Sends a workload over HTTP and records what happened to every request.

use crate::workload::BenchRequest;
use futures_util::StreamExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Which OpenAI endpoint to call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    /// `POST /v1/chat/completions`, the prompt as one user message.
    Chat,
    /// `POST /v1/completions`, the prompt as `prompt`.
    Completions,
}

/// How requests are released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Each request at its `at` (open loop); at most `max_concurrency` in flight, later ones
    /// wait for a slot and their lateness is recorded as send lag.
    Open,
    /// `max_concurrency` clients, each sending its next request as soon as the previous one
    /// finished; `at` is ignored. With a duration, the workload is cycled until it ends.
    Closed,
}

/// Settings of one run.
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// Base URL of the router or worker, e.g. `http://127.0.0.1:30000`; several, separated
    /// by commas, are a client-side round robin: request `i` goes to the `(i mod n)`-th (the
    /// replicas of a router cluster behind no load balancer).
    pub url: String,
    /// `model` of every request.
    pub model: String,
    /// Endpoint.
    pub api: Api,
    /// Ask for a streamed (SSE) answer; TTFT and ITL are measured only when streaming.
    pub stream: bool,
    /// Open or closed loop.
    pub mode: Mode,
    /// In-flight bound (open loop) or number of clients (closed loop); ≥ 1.
    pub max_concurrency: usize,
    /// Stop releasing requests after this long (none: the whole workload).
    pub duration: Option<Duration>,
    /// Timeout of one request, from send to the end of its body.
    pub timeout: Duration,
}

/// What became of one request.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "detail")]
pub enum Outcome {
    /// A 2xx answer whose body (or stream) ended properly.
    Ok,
    /// Refused for load: 429, 503 or 529 (with the status).
    Rejected(u16),
    /// Any other failure: another status, a transport error, a timeout, a broken stream.
    Error(String),
}

/// The record of one request.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RequestResult {
    /// Index in the workload.
    pub index: usize,
    /// Intended send time from the run start, seconds.
    pub scheduled_s: f64,
    /// Actual send time from the run start, seconds (later than scheduled when the
    /// in-flight bound or the client was the bottleneck).
    pub sent_s: f64,
    /// Outcome.
    pub outcome: Outcome,
    /// HTTP status, when an answer came.
    pub status: Option<u16>,
    /// Time to the first content token, seconds (streaming only).
    pub ttft_s: Option<f64>,
    /// Send to end of body, seconds.
    pub e2e_s: f64,
    /// Gaps between consecutive content chunks, seconds (streaming only).
    #[serde(skip)]
    pub itl_s: Vec<f64>,
    /// Output tokens: `usage.completion_tokens` when reported, else content chunks seen.
    pub output_tokens: u32,
    /// `usage.prompt_tokens`, when reported.
    pub prompt_tokens: Option<u32>,
    /// `usage.prompt_tokens_details.cached_tokens`, when reported.
    pub cached_tokens: Option<u32>,
    /// Worker that served it, from the `x-kvroute-worker` header, when the router says.
    pub worker: Option<String>,
    /// The generated text, kept only by [`run_conversations`] (the next turn carries it; at
    /// most [`MAX_ANSWER_BYTES`]); empty otherwise.
    #[serde(skip)]
    pub answer: String,
}

/// Longest answer text kept per request.
pub const MAX_ANSWER_BYTES: usize = 64 << 10;

/// Header in which kvroute names the worker that served a request.
pub const WORKER_HEADER: &str = "x-kvroute-worker";

/// Sends `requests` per `cfg` and returns one record per request released, in workload
/// order (closed loop with a duration: in completion order, indices cycling). `progress` is
/// advanced once per finished request.
///
/// # Errors
/// Only building the HTTP client; every per-request failure is an [`Outcome`].
pub async fn run(
    cfg: &RunConfig,
    requests: &[BenchRequest],
    progress: Option<&indicatif::ProgressBar>,
) -> Result<Vec<RequestResult>, reqwest::Error> {
    let conc = cfg.max_concurrency.max(1);
    let results = match cfg.mode {
        Mode::Open => {
            // Bodies are serialised just in time: a long trace's prompts are held once.
            let shared = Arc::new(Shared::new(cfg, cfg.api, Vec::new(), false)?);
            open_loop(&shared, cfg, requests, conc, progress).await
        }
        Mode::Closed => {
            // Cycled many times: serialise each body once.
            let bodies = requests.iter().map(|r| body(cfg, r)).collect();
            let shared = Arc::new(Shared::new(cfg, cfg.api, bodies, false)?);
            closed_loop(&shared, requests, conc, cfg.duration, progress).await
        }
    };
    Ok(results)
}

struct Shared {
    client: reqwest::Client,
    /// The endpoint under each base URL; request `i` goes to `endpoints[i % len]`.
    endpoints: Vec<String>,
    timeout: Duration,
    /// Closed loop: every request's body, serialised once.
    bodies: Vec<bytes::Bytes>,
    t0: Instant,
    /// Keep each answer's text (conversations only: a long trace would hold every answer).
    keep_answers: bool,
}

impl Shared {
    /// The HTTP client (pooled for `cfg.max_concurrency`), `api`'s endpoint under `cfg.url`
    /// and the run's clock, started now.
    fn new(cfg: &RunConfig, api: Api, bodies: Vec<bytes::Bytes>, keep_answers: bool) -> Result<Shared, reqwest::Error> {
        // reqwest is built without a default TLS provider; https URLs need one (idempotent).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(cfg.max_concurrency.max(1))
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_secs(10))
            .build()?;
        let path = match api {
            Api::Chat => "/v1/chat/completions",
            Api::Completions => "/v1/completions",
        };
        let endpoints = base_urls(&cfg.url).map(|u| format!("{u}{path}")).collect();
        Ok(Shared { client, endpoints, timeout: cfg.timeout, bodies, t0: Instant::now(), keep_answers })
    }
}

fn body(cfg: &RunConfig, r: &BenchRequest) -> bytes::Bytes {
    let mut v = match cfg.api {
        Api::Chat => serde_json::json!({
            "model": cfg.model,
            "messages": [{"role": "user", "content": &*r.prompt}],
            "max_tokens": r.max_tokens,
        }),
        Api::Completions => serde_json::json!({"model": cfg.model, "prompt": &*r.prompt, "max_tokens": r.max_tokens}),
    };
    if cfg.stream {
        v["stream"] = true.into();
        v["stream_options"] = serde_json::json!({"include_usage": true});
    }
    if let Some(s) = &r.session {
        v["user"] = s.as_str().into();
    }
    bytes::Bytes::from(v.to_string())
}

async fn open_loop(
    sh: &Arc<Shared>,
    cfg: &RunConfig,
    requests: &[BenchRequest],
    conc: usize,
    progress: Option<&indicatif::ProgressBar>,
) -> Vec<RequestResult> {
    let duration = cfg.duration;
    let sem = Arc::new(tokio::sync::Semaphore::new(conc));
    let mut tasks = Vec::with_capacity(requests.len());
    for (i, r) in requests.iter().enumerate() {
        if duration.is_some_and(|d| r.at > d) {
            break;
        }
        if let Some(wait) = r.at.checked_sub(sh.t0.elapsed()) {
            tokio::time::sleep(wait).await;
        }
        let Ok(permit) = Arc::clone(&sem).acquire_owned().await else { break };
        let (sh, bar, at, b) = (Arc::clone(sh), progress.cloned(), r.at, body(cfg, r));
        tasks.push(tokio::spawn(async move {
            let res = one(&sh, i, at, b).await;
            drop(permit);
            if let Some(b) = bar {
                b.inc(1);
            }
            res
        }));
    }
    let mut out = Vec::with_capacity(tasks.len());
    for (i, t) in tasks.into_iter().enumerate() {
        out.push(t.await.unwrap_or_else(|e| failed(i, format!("task failed: {e}"))));
    }
    out
}

async fn closed_loop(
    sh: &Arc<Shared>,
    requests: &[BenchRequest],
    conc: usize,
    duration: Option<Duration>,
    progress: Option<&indicatif::ProgressBar>,
) -> Vec<RequestResult> {
    if requests.is_empty() {
        return Vec::new();
    }
    let next = Arc::new(AtomicUsize::new(0));
    let n = requests.len();
    let mut tasks = Vec::with_capacity(conc);
    for _ in 0..conc {
        let (sh, next, bar) = (Arc::clone(sh), Arc::clone(&next), progress.cloned());
        tasks.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            loop {
                let k = next.fetch_add(1, Ordering::Relaxed);
                let done = match duration {
                    Some(d) => sh.t0.elapsed() >= d,
                    None => k >= n,
                };
                if done {
                    break;
                }
                let sent = sh.t0.elapsed();
                let mut r = one(&sh, k % n, sent, sh.bodies[k % n].clone()).await;
                r.index = k;
                mine.push(r);
                if let Some(b) = &bar {
                    b.inc(1);
                }
            }
            mine
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.extend(t.await.unwrap_or_default());
    }
    out.sort_by_key(|r| r.index);
    out
}

fn failed(index: usize, why: String) -> RequestResult {
    RequestResult {
        index,
        scheduled_s: 0.0,
        sent_s: 0.0,
        outcome: Outcome::Error(why),
        status: None,
        ttft_s: None,
        e2e_s: 0.0,
        itl_s: Vec::new(),
        output_tokens: 0,
        prompt_tokens: None,
        cached_tokens: None,
        worker: None,
        answer: String::new(),
    }
}

/// The base URLs of a comma-separated list (`RunConfig::url`), without trailing slashes;
/// at least one (an empty string gives one empty base).
pub fn base_urls(list: &str) -> impl Iterator<Item = &str> {
    list.split(',').map(|u| u.trim().trim_end_matches('/')).filter(|u| !u.is_empty()).chain(
        // An empty list still yields one (empty) base so a run has an endpoint to fail on.
        list.split(',').all(|u| u.trim().is_empty()).then_some(""),
    )
}

/// Sends request `i` now and follows its answer to the end.
async fn one(sh: &Shared, i: usize, scheduled: Duration, body: bytes::Bytes) -> RequestResult {
    let sent = sh.t0.elapsed();
    let start = Instant::now();
    let mut r = failed(i, String::new());
    r.scheduled_s = scheduled.as_secs_f64();
    r.sent_s = sent.as_secs_f64();
    let endpoint = &sh.endpoints[i % sh.endpoints.len().max(1)];
    let fut = exchange(sh, endpoint, body, start, &mut r);
    r.outcome = match tokio::time::timeout(sh.timeout, fut).await {
        Ok(o) => o,
        Err(_) => Outcome::Error("timeout".into()),
    };
    r.e2e_s = start.elapsed().as_secs_f64();
    r
}

async fn exchange(sh: &Shared, endpoint: &str, body: bytes::Bytes, start: Instant, r: &mut RequestResult) -> Outcome {
    let resp = match sh.client.post(endpoint).header("content-type", "application/json").body(body).send().await {
        Ok(x) => x,
        Err(e) => return Outcome::Error(if e.is_connect() { "connect".into() } else { "send".into() }),
    };
    let status = resp.status().as_u16();
    r.status = Some(status);
    r.worker = resp.headers().get(WORKER_HEADER).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let is_sse = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    if !resp.status().is_success() {
        let _ = resp.bytes().await;
        return match status {
            429 | 503 | 529 => Outcome::Rejected(status),
            s => Outcome::Error(format!("http {s}")),
        };
    }
    if !is_sse {
        let Ok(b) = resp.bytes().await else { return Outcome::Error("body".into()) };
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(&b) else { return Outcome::Error("bad json".into()) };
        read_usage(&v, r);
        let text = content(&v).unwrap_or_default();
        if sh.keep_answers {
            keep_answer(&mut r.answer, text);
        }
        if r.output_tokens == 0 {
            r.output_tokens = u32::from(!text.is_empty());
        }
        return Outcome::Ok;
    }
    let mut stream = resp.bytes_stream();
    let mut tap = SseTap::default();
    let mut events = Vec::new();
    let mut last: Option<Instant> = None;
    let mut chunks = 0u32;
    let mut done = false;
    while let Some(piece) = stream.next().await {
        let Ok(piece) = piece else { return Outcome::Error("stream broken".into()) };
        let now = Instant::now();
        if let Err(e) = tap.feed(&piece, &mut events) {
            return Outcome::Error(e.into());
        }
        for ev in events.drain(..) {
            let v = match ev {
                SseEvent::Done => {
                    done = true;
                    continue;
                }
                SseEvent::Data(v) => v,
            };
            if v.get("error").is_some_and(|e| !e.is_null()) {
                return Outcome::Error("error in stream".into());
            }
            read_usage(&v, r);
            if let Some(c) = content(&v).filter(|c| !c.is_empty()) {
                if sh.keep_answers {
                    keep_answer(&mut r.answer, c);
                }
                chunks += 1;
                match last {
                    None => r.ttft_s = Some(now.duration_since(start).as_secs_f64()),
                    Some(prev) => r.itl_s.push(now.duration_since(prev).as_secs_f64()),
                }
                last = Some(now);
            }
        }
    }
    if r.output_tokens == 0 {
        r.output_tokens = chunks;
    }
    if !done {
        return Outcome::Error("stream ended without [DONE]".into());
    }
    Outcome::Ok
}

/// One event of an OpenAI-compatible stream ([`SseTap`]).
#[derive(Debug, Clone, PartialEq)]
pub enum SseEvent {
    /// `data: [DONE]`: the stream's end marker.
    Done,
    /// `data: {...}`: one chunk (or an `{"error": ...}` event).
    Data(serde_json::Value),
}

/// Longest line [`SseTap`] holds while waiting for its end, bytes.
pub const MAX_SSE_LINE_BYTES: usize = 1 << 20;

/// Splits a streamed response (server-sent events, as vLLM, SGLang and llama.cpp send
/// them) into its `data:` events as the bytes arrive, in pieces cut anywhere. Lines that
/// are not `data:` (comments, `event:`, blank separators) are skipped.
#[derive(Debug, Default)]
pub struct SseTap {
    buf: Vec<u8>,
}

impl SseTap {
    /// Feeds the next `piece` of the body and appends every event it completes to `out`.
    ///
    /// # Errors
    /// `"bad sse json"` for a `data:` line that is neither `[DONE]` nor JSON;
    /// `"sse line over 1 MiB"` when a line grows past [`MAX_SSE_LINE_BYTES`] unfinished.
    pub fn feed(&mut self, piece: &[u8], out: &mut Vec<SseEvent>) -> Result<(), &'static str> {
        self.buf.extend_from_slice(piece);
        let mut start = 0;
        while let Some(nl) = self.buf[start..].iter().position(|&b| b == b'\n') {
            let line = self.buf[start..start + nl].trim_ascii();
            start += nl + 1;
            let Some(data) = line.strip_prefix(b"data:") else { continue };
            let data = data.trim_ascii();
            if data == b"[DONE]" {
                out.push(SseEvent::Done);
                continue;
            }
            match serde_json::from_slice::<serde_json::Value>(data) {
                Ok(v) => out.push(SseEvent::Data(v)),
                Err(_) => return Err("bad sse json"),
            }
        }
        self.buf.drain(..start);
        if self.buf.len() > MAX_SSE_LINE_BYTES {
            return Err("sse line over 1 MiB");
        }
        Ok(())
    }
}

/// Appends `piece` to `answer` up to [`MAX_ANSWER_BYTES`] (cut at a character boundary).
fn keep_answer(answer: &mut String, piece: &str) {
    let room = MAX_ANSWER_BYTES.saturating_sub(answer.len());
    let mut end = piece.len().min(room);
    while !piece.is_char_boundary(end) {
        end -= 1;
    }
    answer.push_str(&piece[..end]);
}

/// Sends each conversation's turns in order from its `at` (turn k+1 as soon as turn k's
/// answer is complete, carrying that answer), at most `cfg.max_concurrency` conversations at
/// once. Records are indexed conversation-major (conversation c's turn k is
/// `c × max_turns + k`, `max_turns` the most turns of any conversation) and returned in
/// that order; a failed turn ends its conversation. Chat API only: `cfg.api` is ignored.
///
/// # Errors
/// Only building the HTTP client.
pub async fn run_conversations(
    cfg: &RunConfig,
    convs: &[crate::workload::Conversation],
    progress: Option<&indicatif::ProgressBar>,
) -> Result<Vec<RequestResult>, reqwest::Error> {
    let conc = cfg.max_concurrency.max(1);
    let sh = Arc::new(Shared::new(cfg, Api::Chat, Vec::new(), true)?);
    let max_turns = convs.iter().map(|c| c.turns.len()).max().unwrap_or(0);
    let sem = Arc::new(tokio::sync::Semaphore::new(conc));
    let mut tasks = Vec::with_capacity(convs.len());
    for (ci, c) in convs.iter().enumerate() {
        if cfg.duration.is_some_and(|d| c.at > d) {
            break;
        }
        if let Some(wait) = c.at.checked_sub(sh.t0.elapsed()) {
            tokio::time::sleep(wait).await;
        }
        let Ok(permit) = Arc::clone(&sem).acquire_owned().await else { break };
        let (sh, bar, c, cfg) = (Arc::clone(&sh), progress.cloned(), c.clone(), cfg.clone());
        tasks.push(tokio::spawn(async move {
            let mut messages = Vec::new();
            if let Some(sys) = &c.system {
                messages.push(serde_json::json!({"role": "system", "content": &**sys}));
            }
            let mut out = Vec::with_capacity(c.turns.len());
            for (k, turn) in c.turns.iter().enumerate() {
                messages.push(serde_json::json!({"role": "user", "content": &**turn}));
                let mut v = serde_json::json!({"model": cfg.model, "messages": messages, "max_tokens": c.max_tokens,
                    "user": format!("conversation-{ci}")});
                if cfg.stream {
                    v["stream"] = true.into();
                    v["stream_options"] = serde_json::json!({"include_usage": true});
                }
                let scheduled = sh.t0.elapsed();
                let r = one(&sh, ci * max_turns + k, scheduled, bytes::Bytes::from(v.to_string())).await;
                if let Some(b) = &bar {
                    b.inc(1);
                }
                let ok = r.outcome == Outcome::Ok;
                messages.push(serde_json::json!({"role": "assistant", "content": r.answer}));
                out.push(r);
                if !ok {
                    break;
                }
            }
            drop(permit);
            out
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.extend(t.await.unwrap_or_default());
    }
    out.sort_by_key(|r| r.index);
    Ok(out)
}

/// The generated text of a chunk or answer: chat delta/message content or completion text.
fn content(v: &serde_json::Value) -> Option<&str> {
    let c = v.get("choices")?.get(0)?;
    c.get("delta")
        .and_then(|d| d.get("content"))
        .or_else(|| c.get("message").and_then(|m| m.get("content")))
        .or_else(|| c.get("text"))
        .and_then(|t| t.as_str())
}

fn read_usage(v: &serde_json::Value, r: &mut RequestResult) {
    let Some(u) = v.get("usage").filter(|u| u.is_object()) else { return };
    let n = |x: Option<&serde_json::Value>| {
        x.and_then(serde_json::Value::as_u64).map(|x| x.min(u64::from(u32::MAX)) as u32)
    };
    if let Some(c) = n(u.get("completion_tokens")) {
        r.output_tokens = c;
    }
    r.prompt_tokens = n(u.get("prompt_tokens")).or(r.prompt_tokens);
    r.cached_tokens = n(u.get("prompt_tokens_details").and_then(|d| d.get("cached_tokens"))).or(r.cached_tokens);
}
