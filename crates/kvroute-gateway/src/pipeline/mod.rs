//! The request pipeline: one request walks through named stages, each a small module.
//!
//! ```text
//! loop     a request already carrying this replica's `Via` → 508    crate::hops
//! read     body within the size limit                              read_body (here)
//! parse    body → routing info (model, text or token ids, session) kvroute_protocol::openai::parse
//!          (with API keys: the key is checked and its request bucket taken before the body
//!          is read, its token bucket after the parse — `authenticate`, 401/429)
//! load     a catalogue LoRA adapter no worker has: one loads it     crate::lora
//! key      local tokenizer / engine tokens for precise matching    keys::resolve
//! admit    per-model permit; full → 503, nothing recorded          route::admit
//! decide   pure: the model's router picks, changes nothing         route::decide
//! dispatch send, retry; commit each worker really written to       dispatch::send
//! respond  relay (streamed or whole); settle ticket, permit, count respond::respond
//!          (with `record`, each dispatched request is a trace line)      crate::record
//! ```
//!
//! A request for the entry model of a `[[cascade.chain]]` walks key … respond once per
//! cascade step, each for that step's model ([`cascade`]).

pub mod cascade;
pub mod dispatch;
pub mod keys;
pub mod lora;
pub mod pd;
pub mod respond;
pub mod route;

use crate::api_keys::KeyEntry;
use crate::app::AppState;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
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
            let mut r = match run(&s, api, &headers, body).await {
                Ok(r) => r,
                Err((e, branch)) => error_response(&s, e, branch),
            };
            std::mem::forget(gone);
            if !s.tenancy.may_see_decisions(&headers) {
                crate::tenant::hide_decisions(r.headers_mut());
            }
            r
        })
        .await
}

tokio::task_local! {
    /// The worker a request was last sent to and its decision's branch, for the labels of
    /// an outcome counted where the worker is not at hand (an error, a client gone).
    static ATTEMPT: std::cell::RefCell<(Option<Arc<str>>, &'static str)>;
}

/// Notes that the request is being sent to `worker` (called by dispatch for each attempt).
pub fn note_worker(worker: &Arc<str>, branch: &'static str) {
    let _ = ATTEMPT.try_with(|a| *a.borrow_mut() = (Some(Arc::clone(worker)), branch));
}

/// The worker and branch last noted for this request ([`note_worker`]).
fn noted() -> (Option<Arc<str>>, &'static str) {
    ATTEMPT.try_with(|a| a.borrow().clone()).unwrap_or((None, ""))
}

/// Counts a request whose client went away before its answer began (its future dropped
/// at any stage: reading the body, waiting for admission, a LoRA load or a worker's first
/// byte): outcome `cancelled`, with the worker it waited on. A stream that began counts
/// its own end (`respond`).
struct GoneClient<'a>(&'a AppState);

impl Drop for GoneClient<'_> {
    fn drop(&mut self) {
        let (worker, branch) = noted();
        respond::count(self.0, worker.as_deref().unwrap_or(""), branch, "cancelled");
    }
}

/// The client's answer for a request that ended in `e` (after the decision's `branch`, if
/// there was one), counted once in `kvroute_requests_total` with the worker it was last
/// sent to: `rejected` (503 before any decision), `timeout` (504), `upstream_error`
/// (another 5xx), `cancelled` (499: the client left while its body was read) or
/// `client_error`.
pub fn error_response(s: &AppState, e: ApiError, branch: &'static str) -> Response {
    let outcome = match e.status.as_u16() {
        503 if branch.is_empty() => "rejected",
        504 => "timeout",
        499 => "cancelled",
        500..=599 => "upstream_error",
        _ => "client_error",
    };
    let (worker, _) = noted();
    respond::count(s, worker.as_deref().unwrap_or(""), branch, outcome);
    e.into_response()
}

/// The stages in order. An error carries the decision's branch once there is one.
async fn run(
    s: &Arc<AppState>,
    api: Api,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, (ApiError, &'static str)> {
    let t0 = Instant::now();
    crate::hops::check_arrival(headers, &s.via_name).map_err(|e| (e, ""))?;
    let key = authenticate(s, headers).map_err(|e| (e, ""))?;
    let bytes = read_body(s, headers, body).await.map_err(|e| (e, ""))?;
    let session = headers.get("x-session-id").and_then(|v| v.to_str().ok());
    let info = parse_limited(api, &bytes, session, s.cfg.max_prompt_tokens).map_err(|e| (e, ""))?;
    if let Some(key) = &key {
        admit_tokens(s, key, &info).map_err(|e| (e, ""))?;
    }
    // The engine isolates the tenant's KV cache by the same salt (vLLM `cache_salt`).
    let bytes = match s.tenancy.salt_of(s.api_keys.as_ref(), headers) {
        Some(salt) if s.cfg.engine_cache_salt && api != Api::Generate => crate::tenant::with_cache_salt(&bytes, salt),
        _ => bytes,
    };
    if let Some(c) = cascade::start(s, &info) {
        return cascade::run(s, api, headers, &bytes, &info, c, t0).await;
    }
    route_and_send(s, api, headers, &bytes, info, t0).await
}

/// The stages from key to respond for one parsed request (once per cascade step).
///
/// # Errors
/// The stage's error, with the decision's branch once there is one.
pub async fn route_and_send(
    s: &Arc<AppState>,
    api: Api,
    headers: &HeaderMap,
    bytes: &Bytes,
    mut info: kvroute_protocol::openai::RoutingInfo,
    t0: Instant,
) -> Result<Response, (ApiError, &'static str)> {
    lora::ensure_loaded(s, &info.model).await.map_err(|e| (e, ""))?;
    let precise = keys::resolve(s, api, bytes, &mut info).await;
    if let Some(salt) = s.tenancy.salt_of(s.api_keys.as_ref(), headers) {
        crate::tenant::salt_routing_key(&mut info, salt);
    }
    let model = route::model_of(s, &info).map_err(|e| (e, ""))?;
    if let Some(pd) = &s.pd {
        return match pd::placement(s, pd, &info, &model) {
            pd::Placement::Split => pd::split(s, pd, api, headers, bytes, &info, &precise, &model, t0).await,
            pd::Placement::Colocated { routers, roles, role } => {
                crate::metrics::count_outcome(&s.metrics.pd_requests, "colocated");
                let pool = Pool { routers, roles: Some(roles), role, header: "pd=colocated; " };
                let bytes = pd::without_handover_fields(bytes);
                one_worker(s, api, headers, &bytes, &info, &precise, &model, t0, pool).await
            }
        };
    }
    let pool = Pool { routers: &s.routers, roles: None, role: kvroute_core::types::Role::Both, header: "" };
    one_worker(s, api, headers, bytes, &info, &precise, &model, t0, pool).await
}

/// Where a request served by one worker is routed: a pool's routers and roles, the
/// admission role, and what the decision header starts with.
struct Pool<'a> {
    routers: &'a crate::routers::Routers,
    roles: Option<&'a [kvroute_core::types::Role]>,
    role: kvroute_core::types::Role,
    header: &'static str,
}

/// Times a decision is made again when a request was dispatched to its worker while it
/// was being made (the last one stands, raced or not): a burst of requests arriving
/// together, decided in parallel on the same loads, would otherwise pile onto the least
/// loaded worker.
pub const MAX_REDECISIONS: usize = 2;

/// Admit, decide, dispatch, respond: a request served by one worker.
#[allow(clippy::too_many_arguments)]
async fn one_worker(
    s: &Arc<AppState>,
    api: Api,
    headers: &HeaderMap,
    bytes: &Bytes,
    info: &kvroute_protocol::openai::RoutingInfo,
    precise: &keys::Precise,
    model: &str,
    t0: Instant,
    pool: Pool<'_>,
) -> Result<Response, (ApiError, &'static str)> {
    let permit = route::admit_as(s, model, pool.role).map_err(|e| (e, ""))?;
    // Decisions run in parallel without a lock. One that raced another to the same worker
    // (a request was sent there after its view was read) sends nothing and is made again
    // on fresh views, at most MAX_REDECISIONS times; the last one stands.
    let mut redone = 0;
    let (routed, sent) = loop {
        let routed = route::decide_in(s, info, model, precise, pool.routers, pool.roles).map_err(|e| (e, ""))?;
        let seen =
            (redone < MAX_REDECISIONS).then(|| routed.candidates.dispatches_seen(routed.decision.worker)).flatten();
        match dispatch::send(s, api, &routed, info, precise, model, bytes, headers, seen).await {
            Err(e) if e.blame == dispatch::Blame::Raced => {
                redone += 1;
                s.metrics.decisions_redone.inc();
            }
            sent => break (routed, sent),
        }
    };
    let branch = routed.decision.branch.as_str();
    let (source, reason) = keys::prefix_source(precise, routed.chosen_precise, routed.chosen_slots);
    s.metrics
        .prefix_source
        .get_or_create(&crate::metrics::SourceLabels { source: source.into(), reason: reason.into() })
        .inc();
    let mut decision = String::from(pool.header);
    decision.push_str(&route::decision_header(&routed.router.policy_name, &routed.decision));
    decision.push_str("; prefix=");
    decision.push_str(source);
    if !reason.is_empty() {
        decision.push_str(&format!("({reason})"));
    }
    log_decision(&routed, info, &decision);
    // Recorded from here on: every request dispatched, whatever its outcome (one refused
    // before any decision stood — unknown model, no routable worker — was not: it returned
    // above). Its timestamp is its arrival, `t0`.
    let record = s
        .recorder
        .as_ref()
        .map(|r| r.begin(t0, &info.text, info.token_ids.as_deref(), info.session.as_deref(), info.max_tokens));
    let sent = sent.map_err(|e| (ApiError::from(e), branch))?;
    respond::respond(s, sent, permit, &decision, branch, t0, record).map_err(|e| (e, branch))
}

/// The client's API key, with one request taken from its bucket; `None` when the router
/// has no API keys (every client is served).
///
/// # Errors
/// 401 for a missing or unknown key, 429 with `Retry-After` over its requests per minute.
pub fn authenticate(s: &AppState, headers: &HeaderMap) -> Result<Option<Arc<KeyEntry>>, ApiError> {
    let Some(keys) = &s.api_keys else { return Ok(None) };
    let key = keys.authenticate(headers)?;
    if let Err(e) = key.admit_request() {
        tenant_outcome(s, &key, "rate_limited_requests");
        return Err(e);
    }
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
            tenant_outcome(s, key, "admitted");
            Ok(())
        }
        Err(e) => {
            tenant_outcome(s, key, "rate_limited_tokens");
            Err(e)
        }
    }
}

fn tenant_outcome(s: &AppState, key: &KeyEntry, outcome: &str) {
    s.metrics
        .tenant_requests
        .get_or_create(&crate::metrics::TenantLabels { tenant: key.tenant.clone(), outcome: outcome.into() })
        .inc();
}

/// The per-request decision log (`KVROUTE_LOG=kvroute::decision=debug`): enough to line up
/// one router's choices with another's or with the engines' logs.
fn log_decision(routed: &route::Routed, info: &kvroute_protocol::openai::RoutingInfo, decision: &str) {
    tracing::debug!(
        target: "kvroute::decision",
        worker = routed.candidates.entry(routed.decision.worker).map_or("?", |w| &*w.url),
        session = info.session.as_deref().unwrap_or("-"),
        input_tokens = info.token_ids.as_ref().map_or(0, Vec::len),
        decision = %decision,
        "routed"
    );
}

/// nginx's 499 "client closed request": a request whose client left before it could be
/// answered (never seen by that client; counted `cancelled`).
pub const CLIENT_CLOSED_REQUEST: StatusCode = match StatusCode::from_u16(499) {
    Ok(s) => s,
    Err(_) => StatusCode::BAD_REQUEST,
};

/// Reads the body within the configured limit (413 beyond).
///
/// # Errors
/// 413 when the body is larger than `max_body_bytes`, 408 when it does not arrive within
/// `body_read_timeout_secs`, 499 ([`CLIENT_CLOSED_REQUEST`]) when the client closed the
/// connection before its end, 400 when it cannot be read otherwise.
pub async fn read_body(s: &AppState, headers: &HeaderMap, body: Body) -> Result<Bytes, ApiError> {
    let limit = s.cfg.max_body_bytes;
    let too_large = || {
        ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, format!("request body is larger than the limit of {limit} bytes"))
    };
    if let Some(len) =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok())
        && len > limit as u64
    {
        return Err(too_large());
    }
    let timeout = std::time::Duration::from_secs_f64(s.cfg.body_read_timeout_secs);
    let Ok(read) = tokio::time::timeout(timeout, axum::body::to_bytes(body, limit)).await else {
        return Err(ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            format!("the request body did not arrive within {} s", s.cfg.body_read_timeout_secs),
        ));
    };
    read.map_err(|e| {
        let mut src: Option<&(dyn std::error::Error + 'static)> = Some(&e);
        while let Some(x) = src {
            if x.is::<http_body_util::LengthLimitError>() {
                return too_large();
            }
            // The connection ended before the body did: the client is gone. Answered (to no
            // one) 499, nginx's "client closed request", and counted `cancelled`.
            if x.downcast_ref::<hyper::Error>().is_some_and(hyper::Error::is_incomplete_message)
                || x.downcast_ref::<std::io::Error>().is_some_and(|io| {
                    use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset, UnexpectedEof};
                    matches!(io.kind(), UnexpectedEof | ConnectionReset | ConnectionAborted | BrokenPipe)
                })
            {
                return ApiError::new(CLIENT_CLOSED_REQUEST, "the client closed the connection before its body ended");
            }
            src = x.source();
        }
        ApiError::bad_field("body", format!("could not read the request body: {e}"))
    })
}
