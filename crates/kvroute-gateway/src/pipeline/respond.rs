//! Stage 6, respond and account: the worker's answer goes back to the client (a stream
//! byte for byte); the load ticket, the admission permit and the prediction settle when
//! the body ends, fails, or the client goes away (the guard's drop), and the outcome is
//! counted once.

use super::dispatch::{Predicted, Sent};
use crate::fleet::WorkerEntry;
use crate::metrics::RequestLabels;
use crate::state::AppState;
use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use futures_util::StreamExt;
use kvroute_core::admission::Permit;
use kvroute_core::ledger::LoadTicket;
use kvroute_protocol::api_error::ApiError;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Counts one request outcome in `kvroute_requests_total`.
pub fn count(s: &AppState, worker: &str, branch: &str, outcome: &str) {
    s.metrics
        .requests
        .get_or_create(&RequestLabels {
            worker: worker.to_string(),
            policy: s.routers.policy_name(),
            branch: branch.to_string(),
            outcome: outcome.to_string(),
        })
        .inc();
}

/// Builds the client's response from the worker's answer.
///
/// # Errors
/// 500 when the response cannot be built (a header the client cannot receive).
pub fn respond(
    s: &Arc<AppState>,
    sent: Sent,
    permit: Permit,
    decision: &str,
    branch: &'static str,
    t0: Instant,
    record: Option<crate::record::Pending>,
) -> Result<Response, ApiError> {
    let Sent { resp, body, worker, mut ticket, shared, predicted, first_byte_by } = sent;
    let status = resp.status();
    let mut builder = Response::builder().status(status.as_u16());
    if let Some(c) = resp.headers().get(header::CONTENT_TYPE) {
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
            record: record.map(|r| (r, StreamTokens::default())),
            _permit: permit,
        };
        let limits = Silence {
            first_byte_by: first_byte_by.unwrap_or_else(|| {
                tokio::time::Instant::now() + Duration::from_secs_f64(s.cfg.stream_first_byte_timeout_secs)
            }),
            first_byte_secs: s.cfg.stream_first_byte_timeout_secs,
            idle: Duration::from_secs_f64(s.cfg.stream_idle_timeout_secs),
        };
        return builder.body(Body::from_stream(relay(resp, guard, limits))).map_err(internal);
    };
    if let Some(p) = predicted {
        p.settle(s);
    }
    if let Some(r) = record {
        match completion_tokens(&body) {
            Some(n) => r.finish(n),
            None => drop(r),
        }
    }
    ticket.first_token();
    ticket.close();
    drop(shared);
    worker.record_success();
    let secs = t0.elapsed().as_secs_f64();
    s.metrics.ttft_seconds.observe(secs);
    s.metrics.e2e_seconds.observe(secs);
    count(s, &worker.url, branch, if status.is_success() { "ok" } else { "client_error" });
    drop(permit);
    builder.body(Body::from(body)).map_err(internal)
}

/// How long a stream may stay silent: until its first chunk, then between two chunks.
#[derive(Debug, Clone, Copy)]
struct Silence {
    first_byte_by: tokio::time::Instant,
    first_byte_secs: f64,
    idle: Duration,
}

/// The worker's stream relayed chunk by chunk; an upstream failure after the first byte,
/// or a worker silent past [`Silence`], ends the stream with an SSE error event (a stream
/// is never retried once bytes left).
fn relay(
    resp: reqwest::Response,
    guard: StreamGuard,
    limits: Silence,
) -> impl futures_util::Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static {
    let up = Box::pin(resp.bytes_stream());
    futures_util::stream::unfold(Some((up, guard)), move |st| async move {
        let (mut up, mut guard) = st?;
        let by = if guard.first { tokio::time::Instant::now() + limits.idle } else { limits.first_byte_by };
        let error = |guard: &mut StreamGuard, message: String, code: u16| {
            guard.fail();
            let ev = serde_json::json!({"error": {
                "message": message, "type": "server_error", "param": null, "code": code}});
            Some((Ok(Bytes::from(format!("data: {ev}\n\n"))), None))
        };
        match tokio::time::timeout_at(by, up.next()).await {
            Ok(Some(Ok(b))) => {
                guard.on_bytes(&b);
                Some((Ok(b), Some((up, guard))))
            }
            Ok(Some(Err(e))) => error(&mut guard, format!("upstream stream failed: {e}"), 502),
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

/// Accounting of one streamed response: the first byte, completion, failure or the
/// client's disconnect (drop) each settle the ticket exactly once.
struct StreamGuard {
    state: Arc<AppState>,
    worker: Arc<WorkerEntry>,
    ticket: LoadTicket,
    shared: Option<crate::cluster::sync::SharedTicket>,
    predicted: Option<Predicted>,
    t0: Instant,
    first: bool,
    branch: &'static str,
    /// The request being recorded (`record`) and what its stream reported so far.
    record: Option<(crate::record::Pending, StreamTokens)>,
    _permit: Permit,
}

/// Output tokens of a relayed stream, for the recorder: the last `completion_tokens` a
/// usage chunk reported, else one per SSE data event (engines send a token a chunk). Read
/// line by line, keeping a line cut between two chunks until its end arrives, so the count
/// is the same wherever the body is cut; a line longer than [`MAX_TAP_LINE`] is skipped.
#[derive(Debug, Default)]
struct StreamTokens {
    events: u32,
    usage: Option<u32>,
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
        const USAGE: &[u8] = b"\"completion_tokens\":";
        let Some(data) = line.trim_ascii().strip_prefix(b"data:") else { return };
        if data.trim_ascii_start().starts_with(b"[DONE]") {
            return;
        }
        self.events = self.events.saturating_add(1);
        if let Some(k) = data.windows(USAGE.len()).rposition(|w| w == USAGE) {
            let digits = data[k + USAGE.len()..].trim_ascii_start();
            let end = digits.iter().position(|c| !c.is_ascii_digit()).unwrap_or(digits.len());
            if let Some(n) = std::str::from_utf8(&digits[..end]).ok().and_then(|d| d.parse().ok()) {
                self.usage = Some(n);
            }
        }
    }

    fn tokens(&self) -> u32 {
        self.usage.unwrap_or(self.events)
    }
}

/// `usage.completion_tokens` (OpenAI) or `meta_info.completion_tokens` (SGLang
/// `/generate`) of a whole answer.
fn completion_tokens(body: &[u8]) -> Option<u32> {
    #[derive(serde::Deserialize)]
    struct Counted {
        completion_tokens: Option<u64>,
    }
    #[derive(serde::Deserialize)]
    struct Answer {
        usage: Option<Counted>,
        meta_info: Option<Counted>,
    }
    let a: Answer = serde_json::from_slice(body).ok()?;
    let n = a.usage.and_then(|u| u.completion_tokens).or_else(|| a.meta_info.and_then(|m| m.completion_tokens))?;
    Some(n.min(u64::from(u32::MAX)) as u32)
}

impl StreamGuard {
    /// The request's recorded line, with the tokens its stream carried.
    fn finish_record(&mut self) {
        if let Some((r, t)) = self.record.take() {
            r.finish(t.tokens());
        }
    }

    fn on_bytes(&mut self, b: &[u8]) {
        if let Some((_, t)) = &mut self.record {
            t.scan(b);
        }
        if !self.first {
            self.first = true;
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
    fn complete(&mut self) {
        self.finish_record();
        if self.ticket.is_open() {
            self.ticket.close();
            self.shared = None;
            self.worker.record_success();
            self.state.metrics.e2e_seconds.observe(self.t0.elapsed().as_secs_f64());
            count(&self.state, &self.worker.url, self.branch, "ok");
        }
    }
    fn fail(&mut self) {
        self.finish_record();
        if self.ticket.is_open() {
            self.ticket.close();
            self.shared = None;
            self.state.record_failure(&self.worker);
            count(&self.state, &self.worker.url, self.branch, "upstream_error");
        }
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.finish_record();
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
    fn an_overlong_stream_line_is_skipped_without_holding_it() {
        let mut t = StreamTokens::default();
        t.scan(b"data: {\"x\":\"");
        t.scan(&vec![b'y'; MAX_TAP_LINE + 10]);
        assert!(t.partial.is_empty() && t.skipping);
        t.scan(b"\"}\n\ndata: {\"choices\":[]}\n\n");
        assert_eq!(t.tokens(), 1, "only the line after the overlong one counts");
    }
}
