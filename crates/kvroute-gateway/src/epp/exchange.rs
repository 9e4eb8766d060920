//! One ext_proc stream, one HTTP request through the gateway: its headers and body in, the
//! pick out (or an immediate response), then its response observed to settle the dispatch.
//!
//! ```text
//! request headers   API key checked (401/429); in buffered mode answered "go on"
//! request body      collected (buffered: one message; full duplex: chunks) within max_body_bytes
//! pick              pipeline::prepare + pipeline::pick::pick — serve's parse, load, key, admit,
//!                   decide, commit — then the endpoints in x-gateway-destination-endpoint and
//!                   envoy.lb metadata (full duplex: the body passed back after them)
//! response headers  which endpoint served (x-gateway-destination-endpoint-served): a fallback
//!                   is committed instead of the chosen worker; the status settles 4xx/5xx
//! response body     first chunk = first token (TTFT, ticket), usage and cached tokens read;
//!                   the end completes the dispatch (ok), as a relayed stream in serve
//! stream closed     before the response ended: the client went away, counted cancelled
//! ```

use super::transit::StreamBudget;
use super::wire;
use crate::app::AppState;
use crate::config::EppBodyMode;
use crate::pipeline::pick::{Picked, pick};
use crate::pipeline::respond::StreamGuard;
use crate::pipeline::{RequestCtx, authenticate, ctx::count_error, over_share, prepare, tenant_in_flight};
use axum::body::Bytes;
use axum::http::StatusCode;
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpHeaders, ProcessingRequest, ProcessingResponse, processing_request::Request as Msg,
};
use kvroute_protocol::api_error::ApiError;
use kvroute_protocol::openai::Api;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tonic::{Status, Streaming};

/// Largest non-streamed answer read for its usage (completion and cached tokens), bytes;
/// a longer one passes untouched and is counted without them.
const MAX_USAGE_BODY: usize = 1 << 20;

/// How the gateway exchanges bodies on this stream.
#[derive(Debug, Clone, Copy)]
struct Modes {
    /// The request body arrives in chunks that must be passed back (FULL_DUPLEX_STREAMED);
    /// else it arrives as one message (BUFFERED).
    request_duplex: bool,
    /// The response body's chunks must be passed back (FULL_DUPLEX_STREAMED); else each is
    /// answered "unchanged" (STREAMED, BUFFERED).
    response_duplex: bool,
}

impl Modes {
    /// From `epp_body_mode` and what the gateway announced.
    ///
    /// # Errors
    /// 500 when the gateway sends request bodies in a mode the picker cannot route on.
    fn of(cfg: EppBodyMode, announced: Option<(BodySendMode, BodySendMode)>) -> Result<Modes, ApiError> {
        let duplex = Modes { request_duplex: true, response_duplex: true };
        match (cfg, announced) {
            (EppBodyMode::FullDuplex, _) | (EppBodyMode::Auto, None) => Ok(duplex),
            (EppBodyMode::Buffered, _) => Ok(Modes { request_duplex: false, response_duplex: false }),
            (EppBodyMode::Auto, Some((request, response))) => {
                let response_duplex = response == BodySendMode::FullDuplexStreamed;
                match request {
                    BodySendMode::FullDuplexStreamed => Ok(Modes { request_duplex: true, response_duplex }),
                    BodySendMode::Buffered | BodySendMode::BufferedPartial => {
                        Ok(Modes { request_duplex: false, response_duplex })
                    }
                    other => Err(ApiError::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        format!(
                            "the gateway's ext_proc filter sends request bodies as {}: kvroute's endpoint picker \
                             routes on the prompt and needs request_body_mode BUFFERED or FULL_DUPLEX_STREAMED",
                            other.as_str_name()
                        ),
                    )),
                }
            }
        }
    }
}

/// The stream's two directions.
struct Io {
    inbound: Streaming<ProcessingRequest>,
    tx: mpsc::Sender<Result<ProcessingResponse, Status>>,
    /// Longest wait for the gateway's next message (`request_timeout_secs`).
    idle: Duration,
    /// The stream's messages still arriving, covered by the body budget.
    transit: Option<Arc<StreamBudget>>,
}

impl Io {
    /// The gateway's next message; `None` when the stream ended, failed or stayed silent
    /// past `idle`.
    async fn next(&mut self) -> Option<ProcessingRequest> {
        self.next_or_error().await.ok().flatten()
    }

    /// [`Io::next`], with the status of a stream that failed (a silent one is `Ok(None)`).
    async fn next_or_error(&mut self) -> Result<Option<ProcessingRequest>, Status> {
        match tokio::time::timeout(self.idle, self.inbound.message()).await {
            Ok(Ok(m)) => Ok(m),
            Ok(Err(status)) => {
                tracing::debug!(code = ?status.code(), error = %status.message(), "ext_proc stream failed");
                Err(status)
            }
            Err(_) => Ok(None),
        }
    }

    /// Why the body budget failed the stream's request half, when it did.
    fn refusal(&self) -> Option<ApiError> {
        self.transit.as_ref().and_then(|t| t.refusal())
    }

    /// Sends `r`; false when the gateway is gone.
    async fn send(&self, r: ProcessingResponse) -> bool {
        self.tx.send(Ok(r)).await.is_ok()
    }

    async fn send_all(&self, rs: Vec<ProcessingResponse>) -> bool {
        for r in rs {
            if !self.send(r).await {
                return false;
            }
        }
        true
    }
}

/// The API of an inference path (`/v1/chat/completions`, `/v1/completions`, SGLang
/// `/generate`; the query ignored), else `None`.
fn api_of(path: &str) -> Option<Api> {
    match path.split('?').next().unwrap_or_default() {
        "/v1/chat/completions" => Some(Api::Chat),
        "/v1/completions" => Some(Api::Completions),
        "/generate" => Some(Api::Generate),
        _ => None,
    }
}

/// Runs one ext_proc stream to its end.
///
/// `transit` is the stream's share of the body budget for messages still arriving
/// ([`super::transit`]); `None` when the request did not come through the metered service
/// (in `serve` it always does).
pub(super) async fn run(
    s: Arc<AppState>,
    inbound: Streaming<ProcessingRequest>,
    transit: Option<Arc<StreamBudget>>,
    tx: mpsc::Sender<Result<ProcessingResponse, Status>>,
) {
    let mut io = Io { inbound, tx, idle: Duration::from_secs_f64(s.cfg.request_timeout_secs), transit };
    let Some(first) = first_message(&s, &mut io).await else { return };
    let Some(Msg::RequestHeaders(h)) = &first.request else { return };
    let t0 = Instant::now();
    let modes = match Modes::of(s.cfg.epp_body_mode, wire::announced_modes(&first)) {
        Ok(m) => m,
        Err(e) => return refuse(&s, &io, &e, "", false).await,
    };
    let (headers, path, _) = wire::headers_of(h);
    let decisions = s.tenancy.may_see_decisions(&headers);
    let subset = wire::subset_of(&first);
    let Some(api) = api_of(&path) else {
        return pass_through(&s, &mut io, modes, subset.as_deref()).await;
    };
    let key = match authenticate(&s, &headers) {
        Ok(k) => k,
        Err(e) => return refuse(&s, &io, &e, "", decisions).await,
    };
    let share = s.tenancy.share(key.as_deref(), &headers);
    io.transit.as_ref().inspect(|t| t.set_share(share));
    // The tenant's place, held until the exchange ends (the answer observed, or an error).
    let _in_flight = match tenant_in_flight(&s, key.as_deref(), share) {
        Ok(h) => h,
        Err(e) => return refuse(&s, &io, &e, "", decisions).await,
    };
    // The body's share of the router's body budget, given back once the pick is sent.
    let mut held = s.body_budget.hold(share);
    let body = if h.end_of_stream {
        // No body: refused below as `serve` refuses an empty one (400).
        Bytes::new()
    } else {
        if !modes.request_duplex && !io.send(wire::continue_request_headers()).await {
            return;
        }
        match collect_body(&s, &mut io, modes.request_duplex, &mut held).await {
            Some(Ok(b)) => b,
            Some(Err(e)) => return refuse(&s, &io, &over_share(&s, key.as_deref(), e), "", decisions).await,
            None => return,
        }
    };
    // The rest of the stream is the response the gateway relays.
    io.transit.as_ref().inspect(|t| t.request_read());
    let picked_at = Instant::now();
    let mut ctx = match prepare(&s, api, &headers, t0, key.as_deref(), body.clone()) {
        Ok(c) => c,
        Err(e) => return refuse(&s, &io, &e, "", decisions).await,
    };
    ctx.subset = subset.as_deref();
    let picked = match pick(&mut ctx, &body).await {
        Ok(p) => p,
        Err((e, branch)) => return refuse(&s, &io, &e, branch, decisions).await,
    };
    s.metrics.epp_pick_seconds.observe(picked_at.elapsed().as_secs_f64());
    crate::metrics::count_outcome(&s.metrics.epp_requests, "picked");
    let endpoints = picked.endpoints.join(",");
    let replies = if modes.request_duplex {
        let mut r = vec![wire::route_on_headers(&endpoints)];
        r.extend(wire::body_replies(true, true, picked.body.as_ref().unwrap_or(&body), true));
        r
    } else {
        vec![wire::route_on_body(&endpoints, picked.body.as_ref().map(|b| b.to_vec()))]
    };
    if !io.send_all(replies).await {
        drop(picked.into_guard(&s, t0));
        crate::metrics::count_outcome(&s.metrics.epp_observed, "closed_early");
        return;
    }
    // The response side reads nothing of the request body.
    ctx.set_bytes(Bytes::new());
    drop((body, held));
    observe(&ctx, picked, &mut io, modes, decisions).await;
}

/// The stream's first message, which must be the request headers; `None` when the stream
/// ended or failed first (a refusal of the body budget answered, [`super::transit`]), or
/// began with another message (the stream ended with `INVALID_ARGUMENT`).
async fn first_message(s: &AppState, io: &mut Io) -> Option<ProcessingRequest> {
    let first = match io.next_or_error().await {
        Ok(m) => m?,
        Err(_) => {
            // The request headers did not fit the body budget: no key is known yet.
            if let Some(e) = io.refusal() {
                refuse(s, io, &e, "", false).await;
            }
            return None;
        }
    };
    if matches!(first.request, Some(Msg::RequestHeaders(_))) {
        return Some(first);
    }
    let e = Status::invalid_argument("the first message of an ext_proc stream must be request headers");
    let _ = io.tx.send(Err(e)).await;
    None
}

/// Answers the request with `e` (an immediate response), counted as `serve` counts it;
/// shown as `serve` shows it (worker addresses only to a client that `may_see_decisions`).
async fn refuse(s: &AppState, io: &Io, e: &ApiError, branch: &'static str, may_see_decisions: bool) {
    count_error(s, e, branch);
    crate::metrics::count_outcome(&s.metrics.epp_requests, &format!("immediate_{}", e.status.as_u16()));
    let mut shown = e.clone();
    crate::tenant::shown_to_client(&mut shown, may_see_decisions);
    let _ = io.send(wire::immediate(&shown)).await;
}

/// The request body, within `max_body_bytes`: one message (buffered, `duplex` false) or
/// chunks up to the one that ends it (full duplex; request trailers end it too). `None`
/// when the stream ended first.
///
/// # Errors
/// 413 for a body over `max_body_bytes` (a buffered message over the gRPC message limit,
/// `max_body_bytes` + 64 KiB, included), and for a buffered body that does not end in its
/// message: BUFFERED_PARTIAL's first bytes of a body over the gateway's buffer, from which
/// no prompt can be read. 503 when the router's body budget (`max_buffered_body_bytes`)
/// cannot hold the body (`held` covers what was read) or a message of it while it arrives
/// ([`super::transit`]), 429 when the tenant's share cannot.
async fn collect_body(
    s: &AppState,
    io: &mut Io,
    duplex: bool,
    held: &mut crate::body_budget::BodyHold,
) -> Option<Result<Bytes, ApiError>> {
    let limit = s.cfg.max_body_bytes;
    let too_large = || {
        Some(Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("request body is larger than the limit of {limit} bytes"),
        )))
    };
    let mut body = Vec::new();
    loop {
        let m = match io.next_or_error().await {
            Ok(m) => m?,
            Err(status) if status.code() == tonic::Code::OutOfRange => return too_large(),
            // A message the body budget could not hold while it arrived.
            Err(_) => return io.refusal().map(Err),
        };
        match m.request {
            Some(Msg::RequestBody(b)) => {
                if body.len() + b.body.len() > limit {
                    return too_large();
                }
                if let Err(e) = held.cover((body.len() + b.body.len()) as u64) {
                    return Some(Err(e));
                }
                if !duplex && !b.end_of_stream {
                    return Some(Err(ApiError::new(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        format!(
                            "the gateway sent only the first {} bytes of the request body (ext_proc \
                             request_body_mode BUFFERED_PARTIAL, a body over its buffer limit): the endpoint \
                             picker routes on the whole prompt; raise the gateway's buffer limit or use \
                             FULL_DUPLEX_STREAMED",
                            b.body.len()
                        ),
                    )));
                }
                body.extend_from_slice(&b.body);
                if b.end_of_stream {
                    return Some(Ok(Bytes::from(body)));
                }
            }
            Some(Msg::RequestTrailers(_)) => return Some(Ok(Bytes::from(body))),
            _ => {
                return Some(Err(ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "the gateway sent another message before the request body ended",
                )));
            }
        }
    }
}

/// A request kvroute does not route on its prompt (not an inference path, or no body):
/// the least loaded routable worker (of the subset), nothing committed; then every later
/// message passed on.
async fn pass_through(s: &AppState, io: &mut Io, modes: Modes, subset: Option<&[String]>) {
    let fleet = s.fleet.load();
    let best = fleet
        .iter()
        .filter(|w| w.is_routable())
        .filter_map(|w| Some((w.authority()?.to_string(), w.load.get().in_flight)))
        .filter(|(a, _)| subset.is_none_or(|s| s.contains(a)))
        .min_by_key(|(_, n)| *n);
    let Some((endpoint, _)) = best else {
        let e = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "no healthy worker available").retry_after(1);
        return refuse(s, io, &e, "", false).await;
    };
    crate::metrics::count_outcome(&s.metrics.epp_requests, "passed_through");
    if io.send(wire::route_on_headers(&endpoint)).await {
        relay_rest(io, modes).await;
    }
}

/// Ends the stream with `INVALID_ARGUMENT`: request headers came again after the request's
/// own (one request a stream, as Envoy sends them). A broken peer, answered where no reply
/// left it waiting until the stream closed.
async fn headers_twice(io: &Io) {
    let e = Status::invalid_argument("request headers came twice on one ext_proc stream");
    let _ = io.tx.send(Err(e)).await;
}

/// Passes every remaining message on unchanged until the stream ends.
async fn relay_rest(io: &mut Io, modes: Modes) {
    while let Some(m) = io.next().await {
        let replies = match m.request {
            Some(Msg::RequestBody(b)) => wire::body_replies(true, modes.request_duplex, &b.body, b.end_of_stream),
            Some(Msg::ResponseBody(b)) => wire::body_replies(false, modes.response_duplex, &b.body, b.end_of_stream),
            Some(Msg::ResponseHeaders(_)) => vec![wire::response_headers(&[])],
            Some(Msg::RequestTrailers(_)) => vec![wire::trailers(true)],
            Some(Msg::ResponseTrailers(_)) => vec![wire::trailers(false)],
            Some(Msg::RequestHeaders(_)) => return headers_twice(io).await,
            None => vec![],
        };
        if !io.send_all(replies).await {
            return;
        }
    }
}

/// The response side of a picked request: settles its dispatch as the answer goes by.
async fn observe(ctx: &RequestCtx<'_>, picked: Picked, io: &mut Io, modes: Modes, decisions: bool) {
    let s = ctx.s;
    let mut picked = Some(picked);
    let mut answer: Option<Answer> = None;
    while let Some(m) = io.next().await {
        let replies = match &m.request {
            Some(Msg::ResponseHeaders(h)) => {
                crate::metrics::count_outcome(&s.metrics.epp_observed, "response_headers");
                match picked.take() {
                    Some(p) => {
                        let (a, reply) = Answer::start(ctx, p, &m, h, decisions);
                        answer = Some(a);
                        vec![reply]
                    }
                    None => vec![wire::response_headers(&[])],
                }
            }
            Some(Msg::ResponseBody(b)) => {
                crate::metrics::count_outcome(&s.metrics.epp_observed, "response_body");
                if let Some(a) = &mut answer {
                    a.body(&b.body, b.end_of_stream);
                }
                wire::body_replies(false, modes.response_duplex, &b.body, b.end_of_stream)
            }
            Some(Msg::ResponseTrailers(_)) => {
                crate::metrics::count_outcome(&s.metrics.epp_observed, "response_trailers");
                if let Some(a) = &mut answer {
                    a.end();
                }
                vec![wire::trailers(false)]
            }
            Some(Msg::RequestBody(b)) => wire::body_replies(true, modes.request_duplex, &b.body, b.end_of_stream),
            Some(Msg::RequestTrailers(_)) => vec![wire::trailers(true)],
            Some(Msg::RequestHeaders(_)) => {
                headers_twice(io).await;
                break;
            }
            None => vec![],
        };
        if !io.send_all(replies).await {
            break;
        }
    }
    // Ended before its response did: the client went away (or the gateway gave up). The
    // guard's drop settles the dispatch and counts the request `cancelled`.
    let open = answer.as_ref().is_none_or(|a| !a.ended);
    if open {
        crate::metrics::count_outcome(&s.metrics.epp_observed, "closed_early");
    }
    drop(picked.map(|p| p.into_guard(s, ctx.t0)));
}

/// The answer of a picked request as it goes by.
struct Answer {
    guard: StreamGuard,
    /// A non-streamed answer's body so far (for its usage), within [`MAX_USAGE_BODY`].
    whole: Option<Vec<u8>>,
    ended: bool,
}

impl Answer {
    /// Response headers: the dispatch moved to the endpoint that served when it is not the
    /// chosen one, an error status settled at once; the reply adds the decision headers
    /// for clients that may see them.
    fn start(
        ctx: &RequestCtx<'_>,
        mut p: Picked,
        m: &ProcessingRequest,
        h: &HttpHeaders,
        decisions: bool,
    ) -> (Answer, ProcessingResponse) {
        let s = ctx.s;
        let served = wire::served_of(m);
        let label = match served.as_deref() {
            None => "unreported",
            Some(ep) if p.worker.authority() == Some(ep) => "chosen",
            Some(ep) => {
                let other = p.routed.candidates.entries.iter().find(|w| w.authority() == Some(ep)).cloned();
                match other.map(|w| p.served_by(ctx, w)) {
                    Some(Ok(())) => "fallback",
                    _ => "unknown",
                }
            }
        };
        crate::metrics::count_outcome(&s.metrics.epp_served, label);
        let reply = if decisions {
            wire::response_headers(&[("x-kvroute-worker", &p.worker.url), ("x-kvroute-decision", &p.decision)])
        } else {
            wire::response_headers(&[])
        };
        let mut a = Answer { guard: p.into_guard(s, ctx.t0), whole: None, ended: false };
        match wire::status_of(h) {
            200..=299 => {
                if !wire::is_event_stream(h) {
                    a.whole = Some(Vec::new());
                }
                if h.end_of_stream {
                    a.end();
                }
            }
            429 | 500..=599 | 0 => {
                a.guard.fail("upstream_error");
                a.ended = true;
            }
            _ => {
                a.guard.client_error();
                a.ended = true;
            }
        }
        (a, reply)
    }

    /// A response body chunk (`end`: the last).
    fn body(&mut self, chunk: &[u8], end: bool) {
        if self.ended {
            return;
        }
        if !chunk.is_empty() {
            self.guard.on_bytes(chunk);
        }
        if let Some(w) = &mut self.whole {
            if w.len() + chunk.len() <= MAX_USAGE_BODY {
                w.extend_from_slice(chunk);
            } else {
                self.whole = None;
            }
        }
        if end {
            self.end();
        }
    }

    /// The answer ended (its last body chunk, or its trailers).
    fn end(&mut self) {
        if self.ended {
            return;
        }
        self.ended = true;
        match self.whole.take() {
            Some(w) => self.guard.complete_whole(&w),
            None => self.guard.complete(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_modes_follow_the_gateway_or_the_configuration() {
        let m = Modes::of(EppBodyMode::Auto, None).expect("auto");
        assert!(m.request_duplex && m.response_duplex);
        let m = Modes::of(EppBodyMode::Auto, Some((BodySendMode::Buffered, BodySendMode::Streamed))).expect("buffered");
        assert!(!m.request_duplex && !m.response_duplex);
        let m = Modes::of(EppBodyMode::Buffered, None).expect("configured");
        assert!(!m.request_duplex);
        let e = Modes::of(EppBodyMode::Auto, Some((BodySendMode::Streamed, BodySendMode::Streamed))).expect_err("no");
        assert!(e.message.contains("STREAMED"), "{}", e.message);
        assert_eq!(api_of("/v1/chat/completions?x=1"), Some(Api::Chat));
        assert_eq!(api_of("/v1/models"), None);
    }
}
