//! The request pipeline: one request walks through named stages, each a small module.
//!
//! ```text
//! loop     a request already carrying this replica's `Via` → 508    crate::hops
//! tenant   with API keys the key is checked and its request bucket  authenticate,
//!          taken (401/429); the tenant's place in the router, held  tenant_in_flight (here)
//!          to the answer's last byte (`max_in_flight_per_tenant`, 429)
//! read     body within the size limit                              read_body (here)
//! parse    body → routing info (model, text or token ids, session) kvroute_protocol::openai::parse
//!          (with API keys, the key's token bucket is taken after the parse, 429)
//!          → one `ctx::RequestCtx` the later stages share       run (here)
//! load     a catalogue LoRA adapter no worker has: one loads it     lora::ensure_loaded
//! key      local tokenizer / engine tokens, tenant salt, model     steps::key, keys::resolve
//! admit    per-model permit; full → 503, nothing recorded          route::admit_as
//! decide   pure: the model's router picks, changes nothing         route::decide_in
//! dispatch send, retry; `commit` each attempt (ledger, index, sync) dispatch::send
//! respond  relay (streamed or whole); settle ticket, permit, count respond::respond
//!          (with `record`, each dispatched request is a trace line)      crate::record
//! ```
//!
//! `steps::route_and_send` runs load … respond; with `[pd]` a long prompt is split over a
//! prefill and a decode worker instead ([`pd`]). A request for the entry model of a
//! `[[cascade.chain]]` walks load … respond once per cascade step, each for that step's
//! model ([`cascade`]).

pub mod cascade;
pub mod ctx;
pub mod dispatch;
pub mod keys;
pub mod lora;
pub mod pd;
pub mod pick;
pub mod respond;
pub mod route;
pub mod steps;

use crate::api_keys::KeyEntry;
use crate::app::AppState;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::Response;
use ctx::{ATTEMPT, noted};
pub use ctx::{RequestCtx, error_response, note_worker};
use kvroute_protocol::api_error::ApiError;
use kvroute_protocol::openai::{Api, parse_limited};
use std::sync::Arc;
use std::time::Instant;

/// `POST /v1/chat/completions`.
pub async fn chat_completions(State(s): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    handle(s, Api::Chat, headers, body).await
}

/// `POST /v1/completions`.
pub async fn completions(State(s): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    handle(s, Api::Completions, headers, body).await
}

/// SGLang `POST /generate`.
pub async fn generate(State(s): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    handle(s, Api::Generate, headers, body).await
}

async fn handle(s: Arc<AppState>, api: Api, headers: HeaderMap, body: Body) -> Response {
    ATTEMPT
        .scope(std::cell::RefCell::default(), async move {
            // A client that goes away before its answer began drops this future: counted
            // `cancelled` on the way out, with the worker it was waiting on.
            let gone = GoneClient(&s);
            let sees_decisions = s.tenancy.may_see_decisions(&headers);
            let mut r = match run(&s, api, &headers, body).await {
                Ok(r) => r,
                Err((mut e, branch)) => {
                    // A failed dispatch names the workers it tried: in the log, and to a
                    // client only with decision details.
                    crate::tenant::shown_to_client(&mut e, sees_decisions);
                    error_response(&s, e, branch)
                }
            };
            std::mem::forget(gone);
            if !sees_decisions {
                crate::tenant::hide_decisions(r.headers_mut());
            }
            r
        })
        .await
}

/// Counts a request whose client went away before its answer began (its future dropped
/// at any stage: reading the body, waiting for admission, a LoRA load or a worker's first
/// byte): outcome `cancelled`, with the worker it waited on. A stream that began counts
/// its own end (`respond`).
struct GoneClient<'a>(&'a AppState);

impl Drop for GoneClient<'_> {
    fn drop(&mut self) {
        let (worker, branch) = noted();
        ctx::count(self.0, worker.as_deref().unwrap_or(""), branch, "cancelled");
    }
}

/// The stages in order. An error carries the decision's branch once there is one.
async fn run(
    s: &Arc<AppState>,
    api: Api,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, (ApiError, &'static str)> {
    let t0 = Instant::now();
    let admitted = crate::hops::check_arrival(headers, &s.via_name).and_then(|()| {
        let key = authenticate(s, headers)?;
        let share = s.tenancy.share(key.as_deref(), headers);
        // The tenant's place, held until the answer's last byte (or its error).
        Ok((tenant_in_flight(s, key.as_deref(), share)?, key, share))
    });
    let (in_flight, key, share) = match admitted {
        Ok(a) => a,
        Err(e) => {
            drain_unread(s, body);
            return Err((e, ""));
        }
    };
    let r = answer(s, api, headers, body, t0, key.as_deref(), share).await?;
    Ok(match in_flight {
        Some(hold) => r.map(|inner| Body::new(HeldBody { inner, _hold: hold })),
        None => r,
    })
}

/// A request refused before its body was read: the body is read and dropped in the
/// background — at most `max_body_bytes` of it, within `body_read_timeout_secs`, nothing
/// kept — so that a client still sending it reads the refusal instead of a broken pipe
/// (nginx's lingering close). The connection is held that long at most.
fn drain_unread(s: &AppState, body: Body) {
    use http_body_util::BodyExt;
    let timeout = std::time::Duration::from_secs_f64(s.cfg.body_read_timeout_secs);
    let mut body = http_body_util::Limited::new(body, s.cfg.max_body_bytes);
    tokio::spawn(async move {
        let _ = tokio::time::timeout(timeout, async { while let Some(Ok(_)) = body.frame().await {} }).await;
    });
}

/// A response body that holds its tenant's place until it is dropped (sent, or the client
/// gone); its frames, end and size hint are the inner body's, so a whole answer keeps its
/// `Content-Length`.
struct HeldBody {
    inner: Body,
    _hold: crate::model::shares::ShareHold,
}

impl axum::body::HttpBody for HeldBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, axum::Error>>> {
        std::pin::Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// One of the tenant's places in the router (`max_in_flight_per_tenant`; `None`: no
/// tenant, or no bound).
///
/// # Errors
/// 429 with `Retry-After: 1` when the tenant has as many requests in the router as it may
/// (counted `over_in_flight` for an API key's tenant).
pub fn tenant_in_flight(
    s: &AppState,
    key: Option<&KeyEntry>,
    share: Option<usize>,
) -> Result<Option<crate::model::shares::ShareHold>, ApiError> {
    let (Some(shares), Some(i)) = (&s.tenant_in_flight, share) else { return Ok(None) };
    shares.hold_one(i).map(Some).ok_or_else(|| {
        if let Some(key) = key {
            tenant_outcome(s, key, "over_in_flight");
        }
        ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            format!(
                "this tenant has {} requests in the router, as many as it may (max_in_flight_per_tenant); \
                 retry when one ends",
                shares.cap()
            ),
        )
        .retry_after(1)
    })
}

/// The stages after the tenant is known: read, parse, then cascade or route and send.
async fn answer(
    s: &Arc<AppState>,
    api: Api,
    headers: &HeaderMap,
    body: Body,
    t0: Instant,
    key: Option<&KeyEntry>,
    share: Option<usize>,
) -> Result<Response, (ApiError, &'static str)> {
    // The body's share of the budget is given back when this request is answered
    // (`answer` returns: the response began, or an error).
    let (bytes, _held) = read_body(s, headers, body, share).await.map_err(|e| (over_share(s, key, e), ""))?;
    let mut ctx = prepare(s, api, headers, t0, key, bytes).map_err(|e| (e, ""))?;
    if let Some(c) = cascade::start(s, &ctx.info) {
        return cascade::run(&ctx, c).await;
    }
    steps::route_and_send(&mut ctx).await
}

/// The parse stage on a read body: its routing info, the key's token bucket (`key`: the
/// client's API key, checked already), the tenant's salt, and the body salted for the
/// engine (`engine_cache_salt`). Shared by `serve` and the endpoint picker.
///
/// # Errors
/// 400 for a body that is not a valid request (naming the field), 429 over the key's
/// tokens per minute.
pub fn prepare<'a>(
    s: &'a Arc<AppState>,
    api: Api,
    headers: &'a HeaderMap,
    t0: Instant,
    key: Option<&KeyEntry>,
    bytes: Bytes,
) -> Result<RequestCtx<'a>, ApiError> {
    let session = headers.get("x-session-id").and_then(|v| v.to_str().ok());
    let info = parse_limited(api, &bytes, session, s.cfg.max_prompt_tokens)?;
    if let Some(key) = key {
        admit_tokens(s, key, &info)?;
    }
    // The tenant from the key just checked (no second lookup), else `tenant_header`.
    let salt = s.tenancy.salt_for(key, headers);
    let mut ctx = RequestCtx::new(s, api, headers, t0, salt, bytes, info);
    // The engine isolates the tenant's KV cache by the same salt (vLLM `cache_salt`).
    if let Some(salt) = ctx.salt.filter(|_| s.cfg.engine_cache_salt && api != Api::Generate) {
        let salted = crate::tenant::with_cache_salt(&ctx.bytes, salt);
        ctx.set_bytes(salted);
    }
    Ok(ctx)
}

/// The client's API key, with one request taken from its bucket; `None` when the router
/// has no API keys (every client is served).
///
/// # Errors
/// 401 for a missing or unknown key, 429 with `Retry-After` over its requests per minute.
pub fn authenticate(s: &AppState, headers: &HeaderMap) -> Result<Option<Arc<KeyEntry>>, ApiError> {
    let Some(keys) = &s.api_keys else { return Ok(None) };
    let key = keys.keys().authenticate(headers)?;
    if let Err(e) = key.admit_request() {
        tenant_outcome(s, &key, "rate_limited_requests");
        return Err(e);
    }
    share_spend(s, &key, 1, 0);
    Ok(Some(key))
}

/// Takes the request's tokens — its prompt (ids counted, text estimated) plus `max_tokens`
/// when given — from the key's token bucket.
fn admit_tokens(s: &AppState, key: &KeyEntry, info: &kvroute_protocol::openai::RoutingInfo) -> Result<(), ApiError> {
    let prompt = info
        .token_ids
        .as_ref()
        .map_or_else(|| u64::from(kvroute_core::types::estimate_tokens(&info.text)), |t| t.len() as u64);
    let tokens = prompt + u64::from(info.max_tokens.unwrap_or(0));
    match key.admit_tokens(tokens) {
        Ok(()) => {
            share_spend(s, key, 0, tokens);
            tenant_outcome(s, key, "admitted");
            Ok(())
        }
        Err(e) => {
            tenant_outcome(s, key, "rate_limited_tokens");
            Err(e)
        }
    }
}

/// With the cluster sync, counts what `key`'s buckets just gave for the other replicas to
/// take from theirs ([`crate::cluster::sync::ReplicaSync::spent`]); nothing for a key
/// without limits or a router without the sync.
fn share_spend(s: &AppState, key: &KeyEntry, requests: u64, tokens: u64) {
    if let (Some(sync), Some(spend)) = (&s.sync, &key.spend) {
        sync.spent(spend, requests, tokens);
    }
}

/// `e` as it was, counted `over_body_share` for the key's tenant when it is the tenant's
/// share of the body budget that refused the body (429 from [`read_body`]).
pub fn over_share(s: &AppState, key: Option<&KeyEntry>, e: ApiError) -> ApiError {
    if let Some(key) = key
        && e.status == StatusCode::TOO_MANY_REQUESTS
    {
        tenant_outcome(s, key, "over_body_share");
    }
    e
}

fn tenant_outcome(s: &AppState, key: &KeyEntry, outcome: &str) {
    s.metrics
        .tenant_requests
        .get_or_create(&crate::metrics::TenantLabels { tenant: key.tenant.clone(), outcome: outcome.into() })
        .inc();
}

/// nginx's 499 "client closed request": a request whose client left before it could be
/// answered (never seen by that client; counted `cancelled`).
pub const CLIENT_CLOSED_REQUEST: StatusCode = match StatusCode::from_u16(499) {
    Ok(s) => s,
    Err(_) => StatusCode::BAD_REQUEST,
};

/// Reads the body within the configured limit (413 beyond), its bytes taken from the
/// router's body budget as they arrive ([`crate::body_budget`]) and from the tenant's
/// `share` of it ([`crate::tenant::Tenancy::share`]; `None`: no tenant, as for the
/// admin endpoints); the returned hold gives them back when dropped, so the caller keeps it
/// until the request is answered.
///
/// # Errors
/// 415 for a `Content-Encoding` other than `identity` (bodies are read uncompressed), 413
/// when the body is larger than `max_body_bytes`, 429 when the tenant's share
/// (`max_buffered_body_bytes_per_tenant`) cannot hold it, 503 when the body budget
/// (`max_buffered_body_bytes`) cannot hold it, 408 when it does not arrive within
/// `body_read_timeout_secs`, 499 ([`CLIENT_CLOSED_REQUEST`]) when the client closed the
/// connection before its end, 400 when it cannot be read otherwise.
pub async fn read_body(
    s: &AppState,
    headers: &HeaderMap,
    body: Body,
    share: Option<usize>,
) -> Result<(Bytes, crate::body_budget::BodyHold), ApiError> {
    // Bodies are read as they come: a compressed one would only fail later as "not UTF-8".
    if let Some(enc) = headers.get(header::CONTENT_ENCODING)
        && !enc.to_str().is_ok_and(|e| e.trim().eq_ignore_ascii_case("identity"))
    {
        let enc = String::from_utf8_lossy(enc.as_bytes());
        drain_unread(s, body);
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!("`Content-Encoding: {enc}` is not supported: send the request body uncompressed"),
        ));
    }
    let limit = s.cfg.max_body_bytes;
    let too_large = || {
        ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, format!("request body is larger than the limit of {limit} bytes"))
    };
    let announced =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if announced.is_some_and(|len| len > limit as u64) {
        return Err(too_large());
    }
    let mut hold = s.body_budget.hold(share);
    // An announced length is taken whole before a byte is read: a body the budget cannot
    // hold is refused before the client sends it.
    if let Err(e) = hold.cover(announced.unwrap_or(0)) {
        drain_unread(s, body);
        return Err(e);
    }
    let timeout = std::time::Duration::from_secs_f64(s.cfg.body_read_timeout_secs);
    let Ok(read) = tokio::time::timeout(timeout, collect_within(body, limit, &mut hold)).await else {
        return Err(ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            format!("the request body did not arrive within {} s", s.cfg.body_read_timeout_secs),
        ));
    };
    let e = match read {
        Ok(bytes) => return Ok((bytes, hold)),
        Err(Unread::Budget(e, rest)) => {
            drain_unread(s, Body::new(rest));
            return Err(e);
        }
        Err(Unread::Body(e)) => e,
    };
    let mut src: Option<&(dyn std::error::Error + 'static)> = Some(&*e);
    while let Some(x) = src {
        if x.is::<http_body_util::LengthLimitError>() {
            return Err(too_large());
        }
        // The connection ended before the body did: the client is gone. Answered (to no
        // one) 499, nginx's "client closed request", and counted `cancelled`.
        if x.downcast_ref::<hyper::Error>().is_some_and(hyper::Error::is_incomplete_message)
            || x.downcast_ref::<std::io::Error>().is_some_and(|io| {
                use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset, UnexpectedEof};
                matches!(io.kind(), UnexpectedEof | ConnectionReset | ConnectionAborted | BrokenPipe)
            })
        {
            return Err(ApiError::new(CLIENT_CLOSED_REQUEST, "the client closed the connection before its body ended"));
        }
        src = x.source();
    }
    Err(ApiError::bad_field("body", format!("could not read the request body: {e}")))
}

/// Why [`collect_within`] stopped short of the body's end.
enum Unread {
    /// The body budget could not hold the bytes read so far (503, or 429 past the tenant's
    /// share), with the rest of the body, unread.
    Budget(ApiError, http_body_util::Limited<Body>),
    /// Reading failed: over `limit`, the client gone, or another transport error.
    Body(axum::BoxError),
}

/// The body's bytes, at most `limit` of them, each chunk covered by `hold` before it is
/// kept.
async fn collect_within(body: Body, limit: usize, hold: &mut crate::body_budget::BodyHold) -> Result<Bytes, Unread> {
    use http_body_util::BodyExt;
    let mut body = http_body_util::Limited::new(body, limit);
    // One chunk (most bodies) is kept as it came; more are copied together.
    let mut single: Option<Bytes> = None;
    let mut joined = bytes::BytesMut::new();
    while let Some(frame) = body.frame().await {
        let Ok(chunk) = frame.map_err(Unread::Body)?.into_data() else { continue };
        let read = single.as_ref().map_or(0, Bytes::len) + joined.len() + chunk.len();
        if let Err(e) = hold.cover(read as u64) {
            return Err(Unread::Budget(e, body));
        }
        if single.is_none() && joined.is_empty() {
            single = Some(chunk);
        } else {
            if let Some(f) = single.take() {
                joined.reserve(read);
                joined.extend_from_slice(&f);
            }
            joined.extend_from_slice(&chunk);
        }
    }
    Ok(single.unwrap_or_else(|| joined.freeze()))
}
