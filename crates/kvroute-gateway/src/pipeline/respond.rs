//! Stage 6, respond and account: the worker's answer goes back to the client (a stream
//! byte for byte); the load ticket, the admission permit and the prediction settle when
//! the body ends, fails, or the client goes away (the guard's drop), and the outcome is
//! counted once.

use super::dispatch::{Observe, Predicted, Sent};
use crate::app::AppState;
use crate::fleet::WorkerEntry;
use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use futures_util::StreamExt;
use kvroute_core::admission::Permit;
use kvroute_core::ledger::LoadTicket;
use kvroute_protocol::api_error::ApiError;
use kvroute_protocol::openai::answer_usage;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::ctx::RequestCtx;
pub use super::ctx::count;

/// A worker's answer and what the respond stage settles with it.
pub struct Answer<'a> {
    /// The answer.
    pub sent: Sent,
    /// The request's admission permit (released when the answer ends).
    pub permit: Permit,
    /// The `x-kvroute-decision` value.
    pub decision: &'a str,
    /// The decision's branch (the outcome label).
    pub branch: &'static str,
    /// The recorder's line, written when the answer ends.
    pub record: Option<crate::record::Pending>,
}

/// Builds the client's response from the worker's answer.
///
/// # Errors
/// 500 when the response cannot be built (a header the client cannot receive).
pub fn respond(ctx: &RequestCtx<'_>, a: Answer<'_>) -> Result<Response, ApiError> {
    let (s, t0) = (ctx.s, ctx.t0);
    let Answer { sent, permit, decision, branch, record } = a;
    let Sent { resp, body, first, worker, mut ticket, shared, predicted, first_byte_by, observe, slot } = sent;
    let status = resp.status();
    // A worker's error that is not OpenAI-shaped JSON (plain text, FastAPI's `detail`)
    // reaches the client as one, with the worker's status.
    let body =
        body.map(|b| if status.is_client_error() || status.is_server_error() { openai_error(status, b) } else { b });
    let wrapped = body.as_ref().is_some_and(|_| status.is_client_error() || status.is_server_error());
    let mut builder = Response::builder().status(status.as_u16());
    if wrapped {
        builder = builder.header(header::CONTENT_TYPE, "application/json");
    } else if let Some(c) = resp.headers().get(header::CONTENT_TYPE) {
        builder = builder.header(header::CONTENT_TYPE, c.clone());
    }
    builder = builder
        .header("x-kvroute-worker", HeaderValue::from_str(&worker.url).unwrap_or(HeaderValue::from_static("?")))
        .header("x-kvroute-decision", HeaderValue::from_str(decision).unwrap_or(HeaderValue::from_static("?")));
    let internal = |e: axum::http::Error| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string());
    let Some(body) = body else {
        let guard = StreamGuard {
            state: Arc::clone(s),
            worker,
            ticket,
            shared,
            predicted,
            t0,
            first: false,
            branch,
            tap: (record.is_some() || observe.is_some()).then(StreamTokens::default),
            record,
            observe,
            _slot: slot,
            _permit: permit,
        };
        let limits = Silence {
            first_byte_by: first_byte_by.unwrap_or_else(|| {
                tokio::time::Instant::now() + Duration::from_secs_f64(s.cfg.stream_first_byte_timeout_secs)
            }),
            first_byte_secs: s.cfg.stream_first_byte_timeout_secs,
            idle: Duration::from_secs_f64(s.cfg.stream_idle_timeout_secs),
        };
        return builder.body(Body::from_stream(relay(resp, first, guard, limits))).map_err(internal);
    };
    if let Some(p) = predicted {
        p.settle(s);
    }
    if record.is_some() || observe.is_some() {
        let usage = answer_usage(&body);
        if let Some(r) = record {
            match usage.completion_tokens {
                Some(n) => r.finish(n),
                None => drop(r),
            }
        }
        if let Some(o) = observe {
            o.finish(s, usage.cached_tokens, usage.prefill);
        }
    }
    ticket.first_token();
    ticket.close();
    drop(slot);
    drop(shared);
    worker.record_success();
    let secs = t0.elapsed().as_secs_f64();
    s.metrics.ttft_seconds.observe(secs);
    s.metrics.e2e_seconds.observe(secs);
    count(s, &worker.url, branch, if status.is_success() { "ok" } else { "client_error" });
    drop(permit);
    builder.body(Body::from(body)).map_err(internal)
}

/// Longest message kept from a worker's error body that is wrapped ([`openai_error`]), bytes.
const MAX_WRAPPED_MESSAGE: usize = 4096;

/// A worker's error body as an OpenAI-style error: kept when it is one already (a JSON
/// object with an `error` object); else wrapped, with `status`, its message being a
/// FastAPI `detail` string or the body's text (at most [`MAX_WRAPPED_MESSAGE`] bytes).
fn openai_error(status: StatusCode, body: Bytes) -> Bytes {
    let json = serde_json::from_slice::<serde_json::Value>(&body).ok();
    if json.as_ref().is_some_and(|v| v.get("error").is_some_and(serde_json::Value::is_object)) {
        return body;
    }
    let mut message = match json.as_ref().and_then(|v| v.get("detail")) {
        Some(serde_json::Value::String(d)) => d.clone(),
        _ => String::from_utf8_lossy(&body).trim().to_string(),
    };
    if message.len() > MAX_WRAPPED_MESSAGE {
        let mut end = MAX_WRAPPED_MESSAGE;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
    }
    if message.is_empty() {
        message = format!("the worker answered {status} with an empty body");
    }
    Bytes::from(ApiError::new(status, message).body().to_string())
}

/// How long a stream may stay silent: until its first chunk, then between two chunks.
#[derive(Debug, Clone, Copy)]
struct Silence {
    first_byte_by: tokio::time::Instant,
    first_byte_secs: f64,
    idle: Duration,
}

/// The worker's stream relayed chunk by chunk, starting with its `first` chunk when
/// dispatch read it already; an upstream failure after the first byte, or a worker silent
/// past [`Silence`], ends the stream with an SSE error event (a stream is never retried
/// once bytes left).
fn relay(
    resp: reqwest::Response,
    first: Option<Bytes>,
    guard: StreamGuard,
    limits: Silence,
) -> impl futures_util::Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static {
    let up = Box::pin(futures_util::stream::iter(first.map(Ok)).chain(resp.bytes_stream()));
    futures_util::stream::unfold(Some((up, guard)), move |st| async move {
        let (mut up, mut guard) = st?;
        let state = Arc::clone(&guard.state);
        let by = if guard.first { tokio::time::Instant::now() + limits.idle } else { limits.first_byte_by };
        let error = |guard: &mut StreamGuard, message: String, code: u16| {
            guard.fail(if code == 504 { "timeout" } else { "upstream_error" });
            Some((Ok(sse_error(&message, "server_error", code)), None))
        };
        let next = tokio::select! {
            biased;
            () = state.cut_streams.cancelled() => {
                // Shutdown's last moment, not the worker's fault: the guard's drop counts
                // the request cancelled.
                let message = "the router is shutting down and drain_timeout_secs has run out: stream ended";
                return Some((Ok(sse_error(message, "service_unavailable", 503)), None));
            }
            n = tokio::time::timeout_at(by, up.next()) => n,
        };
        match next {
            Ok(Some(Ok(b))) => {
                guard.on_bytes(&b);
                Some((Ok(b), Some((up, guard))))
            }
            // The request's whole time (`request_timeout_secs`, on the worker's request) ran
            // out while the worker was still streaming, or while a client that stopped
            // reading held it back: a timeout, not the worker's failure (a worker that stops
            // sending meets the silence limits below, and is charged).
            Ok(Some(Err(e))) if e.is_timeout() => {
                let secs = guard.state.cfg.request_timeout_secs;
                tracing::warn!(worker = %guard.worker.url, "stream ended: request_timeout_secs ({secs} s) ran out");
                guard.end("timeout", false);
                let message = format!("the request ran past request_timeout_secs ({secs} s): stream ended");
                Some((Ok(sse_error(&message, "server_error", 504)), None))
            }
            Ok(Some(Err(e))) => {
                // reqwest names the worker's URL; the log keeps it, the client's event does not.
                tracing::warn!(worker = %guard.worker.url, error = %e, "upstream stream failed");
                error(&mut guard, format!("upstream stream failed: {}", e.without_url()), 502)
            }
            Ok(None) => {
                guard.complete();
                None
            }
            Err(_) if guard.first => error(
                &mut guard,
                format!("the worker sent nothing for {} s (stream_idle_timeout_secs)", limits.idle.as_secs_f64()),
                504,
            ),
            Err(_) => error(
                &mut guard,
                format!(
                    "the worker sent no token within {} s (stream_first_byte_timeout_secs)",
                    limits.first_byte_secs
                ),
                504,
            ),
        }
    })
}

/// The SSE event that ends a relayed stream early: an OpenAI-style error object.
fn sse_error(message: &str, kind: &str, code: u16) -> Bytes {
    let ev = serde_json::json!({"error": {"message": message, "type": kind, "param": null, "code": code}});
    Bytes::from(format!("data: {ev}\n\n"))
}

/// Accounting of one streamed response: the first byte, completion, failure or the
/// client's disconnect (drop) each settle the ticket exactly once. Also the accounting of
/// an answer the endpoint picker's gateway relays ([`StreamGuard::observed`]).
pub(crate) struct StreamGuard {
    state: Arc<AppState>,
    worker: Arc<WorkerEntry>,
    ticket: LoadTicket,
    shared: Option<crate::cluster::sync::SharedTicket>,
    predicted: Option<Predicted>,
    t0: Instant,
    first: bool,
    branch: &'static str,
    /// The request being recorded (`record`).
    record: Option<crate::record::Pending>,
    /// What the stream reported so far (output tokens, cached prompt tokens), read when
    /// the request is recorded or observed.
    tap: Option<StreamTokens>,
    /// The decision's predictions, handed back with what the request met.
    observe: Option<Observe>,
    /// Its llama.cpp slot, released in the router's record when the stream ends.
    _slot: Option<super::dispatch::SlotHold>,
    _permit: Permit,
}

/// Output tokens of a relayed stream, for the recorder: the last `completion_tokens` a
/// usage chunk reported, else one per SSE data event (engines send a token a chunk); and
/// the prompt tokens the engine reported cached (the last `cached_tokens` — OpenAI
/// `usage.prompt_tokens_details`, SGLang `meta_info` — or llama.cpp `timings.cache_n`),
/// for the policy's calibration. Read line by line, keeping a line cut between two chunks until its end arrives, so the count
/// is the same wherever the body is cut; a line longer than [`MAX_TAP_LINE`] is skipped.
#[derive(Debug, Default)]
struct StreamTokens {
    events: u32,
    usage: Option<u32>,
    cached: Option<u64>,
    /// llama.cpp's `timings.prompt_n` and `timings.prompt_ms` (whole milliseconds), last seen.
    prompt_n: Option<u64>,
    prompt_ms: Option<u64>,
    /// The unfinished last line of the chunks so far.
    partial: Vec<u8>,
    /// The current line passed [`MAX_TAP_LINE`]: skip it up to its end.
    skipping: bool,
}

/// Longest SSE line the recorder's tap keeps while waiting for its end, bytes.
const MAX_TAP_LINE: usize = 1 << 20;

impl StreamTokens {
    fn scan(&mut self, mut b: &[u8]) {
        while let Some(nl) = b.iter().position(|&c| c == b'\n') {
            if self.skipping {
                self.skipping = false;
            } else if self.partial.is_empty() {
                self.line(&b[..nl]);
            } else {
                let mut line = std::mem::take(&mut self.partial);
                line.extend_from_slice(&b[..nl]);
                self.line(&line);
            }
            b = &b[nl + 1..];
        }
        if !self.skipping {
            self.partial.extend_from_slice(b);
            if self.partial.len() > MAX_TAP_LINE {
                self.partial = Vec::new();
                self.skipping = true;
            }
        }
    }

    fn line(&mut self, line: &[u8]) {
        let Some(data) = line.trim_ascii().strip_prefix(b"data:") else { return };
        if data.trim_ascii_start().starts_with(b"[DONE]") {
            return;
        }
        self.events = self.events.saturating_add(1);
        if let Some(n) = number_after(data, b"\"completion_tokens\":") {
            self.usage = Some(n.min(u64::from(u32::MAX)) as u32);
        }
        if let Some(n) = number_after(data, b"\"cached_tokens\":").or_else(|| number_after(data, b"\"cache_n\":")) {
            self.cached = Some(n);
        }
        if let Some(n) = number_after(data, b"\"prompt_n\":") {
            self.prompt_n = Some(n);
        }
        if let Some(ms) = number_after(data, b"\"prompt_ms\":") {
            self.prompt_ms = Some(ms);
        }
    }

    /// The prefill llama.cpp reported (prompt tokens, milliseconds), for the KV mover.
    fn prefill(&self) -> Option<(u64, f64)> {
        Some((self.prompt_n?, self.prompt_ms? as f64))
    }

    fn tokens(&self) -> u32 {
        self.usage.unwrap_or(self.events)
    }
}

/// The unsigned integer right after the last `key` in `data` (whitespace allowed before
/// it); `None` when `key` is absent or not followed by digits (`null`).
fn number_after(data: &[u8], key: &[u8]) -> Option<u64> {
    let k = data.windows(key.len()).rposition(|w| w == key)?;
    let digits = data[k + key.len()..].trim_ascii_start();
    let end = digits.iter().position(|c| !c.is_ascii_digit()).unwrap_or(digits.len());
    std::str::from_utf8(&digits[..end]).ok()?.parse().ok()
}

/// What a request holds until its answer ends, besides its committed dispatch.
pub(crate) struct Held {
    /// The admission permit.
    pub permit: Permit,
    /// The decision's branch (the outcome label).
    pub branch: &'static str,
    /// The recorder's line.
    pub record: Option<crate::record::Pending>,
    /// The decision's predictions, handed back with what the request met.
    pub observe: Option<Observe>,
    /// Its llama.cpp slot.
    pub slot: Option<super::dispatch::SlotHold>,
}

impl StreamGuard {
    /// The accounting of an answer relayed by someone else (the endpoint picker's gateway)
    /// from `worker`, the request having arrived at `t0`: fed with [`StreamGuard::on_bytes`],
    /// ended by [`StreamGuard::complete`], [`StreamGuard::complete_whole`],
    /// [`StreamGuard::fail`] or [`StreamGuard::client_error`]; dropped before, counted
    /// `cancelled`.
    pub(crate) fn observed(
        s: &Arc<AppState>,
        t0: Instant,
        worker: Arc<WorkerEntry>,
        c: super::dispatch::Committed,
        h: Held,
    ) -> StreamGuard {
        StreamGuard {
            state: Arc::clone(s),
            worker,
            ticket: c.ticket,
            shared: c.shared,
            predicted: c.predicted,
            t0,
            first: false,
            branch: h.branch,
            tap: (h.record.is_some() || h.observe.is_some()).then(StreamTokens::default),
            record: h.record,
            observe: h.observe,
            _slot: h.slot,
            _permit: h.permit,
        }
    }

    /// A whole (non-streamed) answer ended with `body`: its usage read as [`respond`] reads
    /// it, then [`StreamGuard::complete`].
    pub(crate) fn complete_whole(&mut self, body: &[u8]) {
        if let Some(t) = &mut self.tap {
            let u = answer_usage(body);
            t.usage = u.completion_tokens;
            t.cached = u.cached_tokens;
        }
        self.complete();
    }

    /// The worker answered a 4xx (not 429): the request's fault, not the worker's; nothing
    /// recorded or observed, counted `client_error`.
    pub(crate) fn client_error(&mut self) {
        drop(self.record.take());
        drop(self.observe.take());
        if self.ticket.is_open() {
            self.ticket.close();
            self.shared = None;
            self.worker.record_success();
            count(&self.state, &self.worker.url, self.branch, "client_error");
        }
    }

    /// The request's recorded line, with the tokens its stream carried; and the policy's
    /// observation, with the cached tokens it reported (only once the stream ended whole:
    /// `complete`; a failed or cancelled stream still gives its TTFT).
    fn finish_record(&mut self, whole: bool) {
        if let Some(r) = self.record.take() {
            r.finish(self.tap.as_ref().map_or(0, StreamTokens::tokens));
        }
        if let Some(o) = self.observe.take() {
            let tap = self.tap.as_ref().filter(|_| whole);
            o.finish(&self.state, tap.and_then(|t| t.cached), tap.and_then(StreamTokens::prefill));
        }
    }

    pub(crate) fn on_bytes(&mut self, b: &[u8]) {
        if let Some(t) = &mut self.tap {
            t.scan(b);
        }
        if !self.first {
            self.first = true;
            if let Some(o) = &mut self.observe {
                o.first_token();
            }
            if let Some(p) = self.predicted.take() {
                p.settle(&self.state);
            }
            self.state.metrics.ttft_seconds.observe(self.t0.elapsed().as_secs_f64());
            self.ticket.first_token();
            if let Some(t) = &mut self.shared {
                t.first_token();
            }
        }
    }
    pub(crate) fn complete(&mut self) {
        self.finish_record(true);
        if self.ticket.is_open() {
            self.ticket.close();
            self.shared = None;
            self.worker.record_success();
            self.state.metrics.e2e_seconds.observe(self.t0.elapsed().as_secs_f64());
            count(&self.state, &self.worker.url, self.branch, "ok");
        }
    }
    /// The stream failed (`outcome`: `upstream_error`, or `timeout` for a silent worker),
    /// charged to the worker.
    pub(crate) fn fail(&mut self, outcome: &str) {
        self.end(outcome, true);
    }
    /// The stream ended before its end, counted as `outcome`, charged to the worker when
    /// `charge` (a failed or silent worker; not a request that ran out of time while the
    /// worker streamed).
    pub(crate) fn end(&mut self, outcome: &str, charge: bool) {
        self.finish_record(false);
        if self.ticket.is_open() {
            self.ticket.close();
            self.shared = None;
            if charge {
                self.state.record_failure(&self.worker);
            }
            count(&self.state, &self.worker.url, self.branch, outcome);
        }
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.finish_record(false);
        if let Some(p) = self.predicted.take() {
            p.settle(&self.state);
        }
        if self.ticket.is_open() {
            self.ticket.close();
            count(&self.state, &self.worker.url, self.branch, "cancelled");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_tokens_are_counted_the_same_wherever_the_body_is_cut() {
        let plain =
            b"data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"choices\":[{\"text\":\"b\"}]}\n\ndata: [DONE]\n\n";
        let usage = b"data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":17}}\n\ndata: [DONE]\n\n";
        for (body, want) in [(&plain[..], 2), (&usage[..], 17)] {
            for cut in 0..=body.len() {
                let mut t = StreamTokens::default();
                t.scan(&body[..cut]);
                t.scan(&body[cut..]);
                assert_eq!(t.tokens(), want, "cut at {cut}");
            }
            let mut t = StreamTokens::default();
            for b in body.chunks(1) {
                t.scan(b);
            }
            assert_eq!(t.tokens(), want, "byte by byte");
        }
    }

    #[test]
    fn cached_prompt_tokens_are_read_from_each_engine_s_answer() {
        use kvroute_protocol::openai::AnswerUsage;
        let whole = |b: &str| answer_usage(b.as_bytes());
        let openai = r#"{"choices":[],"usage":{"prompt_tokens":900,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":768}}}"#;
        assert_eq!(whole(openai), AnswerUsage { completion_tokens: Some(5), cached_tokens: Some(768), prefill: None });
        let sglang = r#"{"text":"x","meta_info":{"prompt_tokens":900,"completion_tokens":3,"cached_tokens":512}}"#;
        assert_eq!(whole(sglang), AnswerUsage { completion_tokens: Some(3), cached_tokens: Some(512), prefill: None });
        let llama = r#"{"choices":[],"usage":{"completion_tokens":2},"timings":{"cache_n":640,"prompt_n":260,"prompt_ms":2671.5}}"#;
        assert_eq!(
            whole(llama),
            AnswerUsage { completion_tokens: Some(2), cached_tokens: Some(640), prefill: Some((260, 2671.5)) }
        );
        let silent = r#"{"choices":[],"usage":{"completion_tokens":2,"prompt_tokens_details":null}}"#;
        assert_eq!(whole(silent), AnswerUsage { completion_tokens: Some(2), cached_tokens: None, prefill: None });
        assert_eq!(whole("not json"), AnswerUsage::default());
        // Streams: the last report wins, wherever the chunks are cut; `null` is no report.
        let stream = br#"data: {"choices":[{"text":"a"}]}

data: {"choices":[],"usage":{"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":null}}}

data: {"choices":[],"timings":{"cache_n":96,"prompt_n":300,"prompt_ms":3012.25}}

data: [DONE]

"#;
        for cut in 0..=stream.len() {
            let mut t = StreamTokens::default();
            t.scan(&stream[..cut]);
            t.scan(&stream[cut..]);
            assert_eq!(t.cached, Some(96), "cut at {cut}");
            assert_eq!(t.prefill(), Some((300, 3012.0)), "cut at {cut}");
        }
    }

    #[test]
    fn a_worker_error_that_is_not_openai_json_is_wrapped_with_its_status() {
        let wrap = |status: u16, body: &str| {
            let b = openai_error(StatusCode::from_u16(status).expect("status"), Bytes::from(body.to_string()));
            serde_json::from_slice::<serde_json::Value>(&b).expect("json")
        };
        let v = wrap(400, "Bad Request: prompt too long\n");
        assert_eq!(v["error"]["message"], "Bad Request: prompt too long");
        assert_eq!(v["error"]["code"], 400);
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(wrap(404, r#"{"detail":"Not Found"}"#)["error"]["message"], "Not Found");
        assert_eq!(
            wrap(422, r#"{"detail":[{"loc":["body"]}]}"#)["error"]["message"],
            r#"{"detail":[{"loc":["body"]}]}"#
        );
        assert!(wrap(400, "")["error"]["message"].as_str().expect("message").contains("empty body"));
        let long = "é".repeat(MAX_WRAPPED_MESSAGE);
        assert!(wrap(400, &long)["error"]["message"].as_str().expect("message").len() <= MAX_WRAPPED_MESSAGE);
        // OpenAI-shaped errors pass as they are.
        let openai = r#"{"error":{"message":"m","type":"BadRequestError","param":null,"code":400}}"#;
        let kept = openai_error(StatusCode::BAD_REQUEST, Bytes::from_static(openai.as_bytes()));
        assert_eq!(&kept[..], openai.as_bytes());
    }

    #[test]
    fn an_overlong_stream_line_is_skipped_without_holding_it() {
        let mut t = StreamTokens::default();
        t.scan(b"data: {\"x\":\"");
        t.scan(&vec![b'y'; MAX_TAP_LINE + 10]);
        assert!(t.partial.is_empty() && t.skipping);
        t.scan(b"\"}\n\ndata: {\"choices\":[]}\n\n");
        assert_eq!(t.tokens(), 1, "only the line after the overlong one counts");
    }
}
