//! One request's context: what every stage reads — the router, the request's API and
//! headers, its tenant's salt, its arrival time, the body and its routing info parsed once,
//! and (from the key stage on) its engine token ids and model. Also the request's last
//! worker for outcome labels ([`note_worker`]) and the one place an error becomes the
//! client's answer ([`error_response`]).

use crate::app::AppState;
use crate::metrics::RequestLabels;
use axum::body::Bytes;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use kvroute_core::tenant::TenantSalt;
use kvroute_core::types::{RequestView, Role, estimate_tokens};
use kvroute_protocol::api_error::ApiError;
use kvroute_protocol::openai::{Api, RoutingInfo};
use serde_json::Value;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// One request (or one cascade step of it) as the stages see it.
#[derive(Debug)]
pub struct RequestCtx<'a> {
    /// The router.
    pub s: &'a Arc<AppState>,
    /// The endpoint it came to.
    pub api: Api,
    /// The client's headers.
    pub headers: &'a HeaderMap,
    /// Its arrival (the recorded timestamp, the TTFT origin).
    pub t0: Instant,
    /// Its tenant's cache salt, read once (`None`: not salted).
    pub salt: Option<TenantSalt>,
    /// The body sent to the worker (with the tenant's `cache_salt` when configured).
    pub bytes: Bytes,
    /// The routing info parsed from it (the routing key salted once the key stage ran).
    pub info: RoutingInfo,
    /// The body as JSON, parsed on first use by the optional paths (local tokenizer,
    /// worker `/tokenize`, P/D, llama.cpp slots, cascade) and then shared.
    json: OnceLock<Option<Value>>,
    /// The engine's token ids for precise matching (the key stage's result).
    pub precise: Precise,
    /// The model the request is routed for (the key stage's result).
    pub model: String,
    /// The endpoints (`host:port`) a gateway allows for this request (the endpoint-picker
    /// protocol's subset hint): only workers among them are candidates. `None`: any.
    pub subset: Option<&'a [String]>,
}

impl<'a> RequestCtx<'a> {
    /// A parsed request of the tenant salted `salt` ([`crate::tenant::Tenancy`]), before its
    /// key stage.
    pub fn new(
        s: &'a Arc<AppState>,
        api: Api,
        headers: &'a HeaderMap,
        t0: Instant,
        salt: Option<TenantSalt>,
        bytes: Bytes,
        info: RoutingInfo,
    ) -> RequestCtx<'a> {
        RequestCtx {
            s,
            api,
            headers,
            t0,
            salt,
            bytes,
            info,
            json: OnceLock::new(),
            precise: Precise::Off,
            model: String::new(),
            subset: None,
        }
    }

    /// The same request with another body (a cascade step, the colocated P/D body): its
    /// salt, headers and arrival, the new body's routing info, no key stage yet.
    pub fn with_body(&self, bytes: Bytes, info: RoutingInfo) -> RequestCtx<'a> {
        RequestCtx { bytes, info, json: OnceLock::new(), precise: Precise::Off, model: String::new(), ..*self }
    }

    /// Replaces the body sent to the worker (its parsed JSON is read again on next use).
    pub fn set_bytes(&mut self, bytes: Bytes) {
        self.bytes = bytes;
        self.json = OnceLock::new();
    }

    /// The body as JSON (`None` when it is not JSON), parsed once.
    pub fn json(&self) -> Option<&Value> {
        parsed(&self.json, &self.bytes)
    }

    /// The body as a JSON object, parsed once.
    pub fn object(&self) -> Option<&serde_json::Map<String, Value>> {
        self.json().and_then(Value::as_object)
    }

    /// The routing view of the request (after the key stage: keyed on the engine's token
    /// ids when they are known).
    pub fn view(&self) -> RequestView<'_> {
        precise_view(&self.info, &self.model, &self.precise)
    }

    /// What a hop to a worker needs of the request.
    pub(crate) fn hop(&self) -> Hop<'_> {
        Hop { s: self.s, api: self.api, headers: self.headers }
    }

    /// When a stream's first bytes must have come, from now (`None` for a whole answer).
    pub fn first_byte_by(&self) -> Option<tokio::time::Instant> {
        self.info
            .stream
            .then(|| tokio::time::Instant::now() + Duration::from_secs_f64(self.s.cfg.stream_first_byte_timeout_secs))
    }
}

/// `cell`'s JSON of `bytes`, parsed on first use.
pub(crate) fn parsed<'c>(cell: &'c OnceLock<Option<Value>>, bytes: &Bytes) -> Option<&'c Value> {
    cell.get_or_init(|| kvroute_protocol::openai::parse_value(bytes).ok()).as_ref()
}

impl RequestCtx<'_> {
    /// The key stage's inputs borrowed apart: the parsed body and the routing info to fill.
    pub(crate) fn key_parts(&mut self) -> (Option<&Value>, &mut RoutingInfo) {
        (parsed(&self.json, &self.bytes), &mut self.info)
    }
}

/// The request side of precise (KV-event) matching.
#[derive(Debug)]
pub enum Precise {
    /// No worker publishes KV events.
    Off,
    /// The request's token ids as the engine sees them.
    Tokens(Arc<[u32]>),
    /// Events flow but the request could not be tokenized (the reason).
    Unavailable(&'static str),
}

/// The routing view of a request for `model`.
pub fn view<'a>(info: &'a RoutingInfo, model: &'a str) -> RequestView<'a> {
    // A tenant's salt marker in front of the key is no part of the prompt.
    let input_tokens = match &info.token_ids {
        Some(t) => kvroute_core::tenant::unsalted_tokens(t).len().min(u32::MAX as usize) as u32,
        None => estimate_tokens(kvroute_core::tenant::unsalted_text(&info.text)),
    };
    RequestView {
        model,
        text: (!info.text.is_empty()).then_some(info.text.as_str()),
        token_ids: info.token_ids.as_deref(),
        blocks: None,
        input_tokens,
        output_tokens: info.max_tokens,
        session_id: info.session.as_deref(),
        role: Role::Both,
    }
}

/// The routing view, keyed on the engine's token ids when they are known (exact
/// `input_tokens`), else as [`view`].
pub fn precise_view<'a>(info: &'a RoutingInfo, model: &'a str, precise: &'a Precise) -> RequestView<'a> {
    let mut req = view(info, model);
    if let Precise::Tokens(t) = precise {
        req.token_ids = Some(t);
        req.input_tokens = t.len().min(u32::MAX as usize) as u32;
    }
    req
}

/// What a hop to a worker needs of its request: the router, the endpoint and the client's
/// headers (`Via`, `forward_headers`); owned copies of them serve a task that outlives the
/// request's context (a P/D prefill drained after the answer began).
#[derive(Clone, Copy)]
pub(crate) struct Hop<'a> {
    /// The router.
    pub s: &'a AppState,
    /// The endpoint.
    pub api: Api,
    /// The client's headers.
    pub headers: &'a HeaderMap,
}

tokio::task_local! {
    /// The worker a request was last sent to and its decision's branch, for the labels of
    /// an outcome counted where the worker is not at hand (an error, a client gone).
    pub(crate) static ATTEMPT: std::cell::RefCell<(Option<Arc<str>>, &'static str)>;
}

/// Notes that the request is being sent to `worker` (called by dispatch for each attempt).
pub fn note_worker(worker: &Arc<str>, branch: &'static str) {
    let _ = ATTEMPT.try_with(|a| *a.borrow_mut() = (Some(Arc::clone(worker)), branch));
}

/// The worker and branch last noted for this request ([`note_worker`]).
pub(crate) fn noted() -> (Option<Arc<str>>, &'static str) {
    ATTEMPT.try_with(|a| a.borrow().clone()).unwrap_or((None, ""))
}

/// Counts one request outcome in `kvroute_requests_total`, under the policy that routes
/// it: with PD disaggregation every request is placed by the pools' policies, labelled
/// `PREFILL+DECODE` as the decision header names them (the main `policy` routes nothing).
pub fn count(s: &AppState, worker: &str, branch: &str, outcome: &str) {
    let policy = match &s.pd {
        Some(pd) => format!("{}+{}", pd.prefill.policy_name(), pd.decode.policy_name()),
        None => s.routers.policy_name(),
    };
    s.metrics.count_request(RequestLabels {
        worker: worker.to_string(),
        policy,
        branch: branch.to_string(),
        outcome: outcome.to_string(),
    });
}

/// The client's answer for a request that ended in `e` (after the decision's `branch`, if
/// there was one), counted once in `kvroute_requests_total` with the worker it was last
/// sent to: `rejected` (503 before any decision), `timeout` (504), `upstream_error`
/// (another 5xx), `cancelled` (499: the client left while its body was read) or
/// `client_error`.
pub fn error_response(s: &AppState, e: ApiError, branch: &'static str) -> Response {
    count_error(s, &e, branch);
    e.into_response()
}

/// Counts a request that ended in `e` as [`error_response`] does, without building the
/// answer (the endpoint picker answers it as an immediate response).
pub fn count_error(s: &AppState, e: &ApiError, branch: &'static str) {
    let outcome = match e.status.as_u16() {
        503 if branch.is_empty() => "rejected",
        504 => "timeout",
        499 => "cancelled",
        500..=599 => "upstream_error",
        _ => "client_error",
    };
    let (worker, _) = noted();
    count(s, worker.as_deref().unwrap_or(""), branch, outcome);
}
