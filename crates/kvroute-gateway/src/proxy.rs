//! Forwarding: decide, admit, send, retry on fallbacks, stream back, account.

use crate::error::ApiError;
use crate::metrics::RequestLabels;
use crate::request::{Api, RoutingInfo, parse};
use crate::state::AppState;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use kvroute_core::ledger::Ticket;
use kvroute_core::policy::{Decision, MatchUnit, PickCtx, route};
use kvroute_core::types::{RequestView, Role, WorkerId, estimate_tokens};
use std::sync::Arc;
use std::time::{Duration, Instant};

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

/// Reads the body within the configured limit (413 beyond).
///
/// # Errors
/// 413 when the body is larger than `max_body_bytes`, 400 when it cannot be read.
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
    axum::body::to_bytes(body, limit).await.map_err(|e| {
        let mut src: Option<&(dyn std::error::Error + 'static)> = Some(&e);
        while let Some(x) = src {
            if x.is::<http_body_util::LengthLimitError>() {
                return too_large();
            }
            src = x.source();
        }
        ApiError::bad_field("body", format!("could not read the request body: {e}"))
    })
}

/// The routing view of a request.
pub fn view<'a>(info: &'a RoutingInfo, model: &'a str) -> RequestView<'a> {
    let input_tokens = match &info.token_ids {
        Some(t) => t.len().min(u32::MAX as usize) as u32,
        None => estimate_tokens(&info.text),
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

/// Prompt tokens a decision expects to find cached: the matched share of the routing key
/// applied to the prompt's tokens, whatever the key's unit (chars, tokens, or blocks of any
/// size), so the ledger's pending-prefill estimate does not depend on the policy's block size.
pub fn estimated_cached_tokens(d: &Decision, input_tokens: u32) -> u64 {
    if d.key_len == 0 || d.unit == MatchUnit::None {
        return 0;
    }
    let share = (d.matched as f64 / d.key_len as f64).clamp(0.0, 1.0);
    ((share * f64::from(input_tokens)) as u64).min(u64::from(input_tokens))
}

/// Decides for `info` (no I/O): `Ok((decision, urls by id))` or the error to answer.
///
/// # Errors
/// 404 for a model no worker serves, 503 when no worker is routable.
pub fn decide(s: &AppState, info: &RoutingInfo) -> Result<(Decision, Vec<(u32, String)>), ApiError> {
    decide_with(s, info, &Precise::Off).map(|r| (r.decision, r.urls))
}

/// Candidate worker URLs by dense id.
pub type WorkerUrls = Vec<(u32, String)>;

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

/// The routing view of a request, keyed on the engine's token ids when they are known
/// (exact `input_tokens`), else as [`view`].
pub fn precise_view<'a>(info: &'a RoutingInfo, precise: &'a Precise) -> RequestView<'a> {
    let mut req = view(info, &info.model);
    if let Precise::Tokens(t) = precise {
        req.token_ids = Some(t);
        req.input_tokens = t.len().min(u32::MAX as usize) as u32;
    }
    req
}

/// Where the chosen worker's prefix state came from: `precise`, or `approximate` and why.
pub fn prefix_source(p: &Precise, chosen_precise: bool) -> (&'static str, &'static str) {
    match p {
        _ if chosen_precise => ("precise", ""),
        Precise::Off => ("approximate", "no_events"),
        Precise::Unavailable(r) => ("approximate", r),
        Precise::Tokens(_) => ("approximate", "no_events"),
    }
}

/// A routing decision with its prefix-state bookkeeping.
#[derive(Debug)]
pub struct Routed {
    /// The policy's decision.
    pub decision: Decision,
    /// Candidate URLs by dense id.
    pub urls: WorkerUrls,
    /// Whether the chosen worker's prefix state was precise (KV events).
    pub chosen_precise: bool,
    /// The request's blocks predicted on the chosen worker (predict-on-route), to be
    /// settled at the first token.
    pub predicted: Option<Predicted>,
}

/// A request's own block hashes predicted on its worker until the request's deadline
/// ([`kvroute_core::precise::PreciseIndex::predict`]).
#[derive(Debug, Clone)]
pub struct Predicted {
    worker: WorkerId,
    hashes: Arc<[kvroute_core::types::BlockHash]>,
}

impl Predicted {
    /// The prefill is over (first token) or the attempt ended: the engine's `BlockStored`
    /// is on its way, so the prediction now lasts only the predict window.
    pub fn settle(&self, s: &AppState) {
        let mut ix = s.precise.lock();
        let now = s.now();
        let until = now.saturating_add(ix.predict_window());
        ix.predict(self.worker, &self.hashes, now, until);
    }
}

/// [`decide`] with the precise prefix state: each worker that publishes KV events gets the
/// engine-reported cached tokens of this request in its view, and the request's blocks are
/// predicted on the chosen worker until the request's deadline (settle them with
/// [`Predicted::settle`] at the first token).
///
/// # Errors
/// As [`decide`].
pub fn decide_with(s: &AppState, info: &RoutingInfo, precise: &Precise) -> Result<Routed, ApiError> {
    let (mut views, urls) = s.candidates(&info.model);
    // Own hashes of the request per engine block size (one size in practice), computed
    // outside the index lock so a long prompt does not hold up the event subscribers.
    let mut by_size: Vec<(u32, Vec<kvroute_core::types::BlockHash>)> = Vec::new();
    if let Precise::Tokens(tokens) = precise {
        let sizes: Vec<(usize, Option<u32>, bool)> = {
            let ix = s.precise.lock();
            views.iter().enumerate().map(|(i, v)| (i, ix.block_size(v.id), ix.is_tracked(v.id))).collect()
        };
        for &(_, bs, _) in &sizes {
            if let Some(bs) = bs
                && !by_size.iter().any(|(b, _)| *b == bs)
            {
                let mut h = Vec::new();
                kvroute_core::hash::hash_token_blocks(
                    tokens,
                    bs as usize,
                    usize::MAX,
                    kvroute_core::hash::HashAlgo::Xxh3,
                    &mut h,
                );
                by_size.push((bs, h));
            }
        }
        let ix = s.precise.lock();
        let now = s.now();
        for (i, bs, tracked) in sizes {
            let v = &mut views[i];
            v.cached_tokens = match bs {
                Some(bs) => {
                    let hashes = by_size.iter().find(|(b, _)| *b == bs).map(|(_, h)| h.as_slice()).unwrap_or_default();
                    ix.cached_tokens(v.id, hashes, bs, now)
                }
                // Tracked but no BlockStored yet: the cache is empty as far as we know.
                None if tracked => Some(0),
                None => None,
            };
        }
    }
    if views.is_empty() {
        let any = !s.workers.read().is_empty();
        return Err(if any && !info.model.is_empty() {
            ApiError::new(StatusCode::NOT_FOUND, format!("model `{}` is not served by any worker", info.model))
                .with_param("model")
        } else {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "no worker is registered")
        });
    }
    let req = precise_view(info, precise);
    let t0 = Instant::now();
    let d = {
        let mut p = s.policy.lock();
        let now = s.now();
        let ps = &mut *p;
        let mut ctx = PickCtx { now, rng: &mut ps.rng };
        route(ps.policy.as_mut(), &req, &views, &mut ctx)
    };
    s.metrics.decision_seconds.observe(t0.elapsed().as_secs_f64());
    let d =
        d.map_err(|_| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "no healthy worker available").retry_after(1))?;
    if d.key_len > 0 {
        s.metrics.match_rate.observe(d.match_rate());
    }
    let chosen_precise = views.iter().any(|v| v.id == d.worker && v.cached_tokens.is_some());
    let mut predicted = None;
    if chosen_precise {
        // Predict-on-route: siblings arriving before the engine's BlockStored follow this one.
        let mut ix = s.precise.lock();
        if ix.predict_window().0 > 0
            && let Some(bs) = ix.block_size(d.worker)
            && let Some((_, hashes)) = by_size.into_iter().find(|(b, _)| *b == bs)
        {
            let now = s.now();
            let deadline = now.saturating_add(kvroute_core::types::Nanos::from_secs_f64(s.cfg.request_timeout_secs));
            ix.predict(d.worker, &hashes, now, deadline);
            predicted = Some(Predicted { worker: d.worker, hashes: hashes.into() });
        }
    }
    Ok(Routed { decision: d, urls, chosen_precise, predicted })
}

/// The `x-kvroute-decision` header value.
pub fn decision_header(policy: &str, d: &Decision) -> String {
    let unit = match d.unit {
        MatchUnit::Chars => " chars",
        MatchUnit::Tokens => " tokens",
        MatchUnit::Blocks => " blocks",
        MatchUnit::None => "",
    };
    format!("policy={policy}; branch={}; matched={}/{}{unit}", d.branch.as_str(), d.matched, d.key_len)
}

impl ApiError {
    /// Names the request field.
    pub fn with_param(mut self, p: &str) -> Self {
        self.param = Some(p.into());
        self
    }
}

fn count(s: &AppState, worker: &str, branch: &str, outcome: &str) {
    s.metrics
        .requests
        .get_or_create(&RequestLabels {
            worker: worker.to_string(),
            policy: s.cfg.policy.clone(),
            branch: branch.to_string(),
            outcome: outcome.to_string(),
        })
        .inc();
}

async fn handle(s: Arc<AppState>, api: Api, headers: HeaderMap, body: Body) -> Response {
    match handle_inner(&s, api, &headers, body).await {
        Ok(r) => r,
        Err(e) => {
            let outcome = match e.status.as_u16() {
                503 => "rejected",
                500..=599 => "upstream_error",
                _ => "client_error",
            };
            count(&s, "", "", outcome);
            e.into_response()
        }
    }
}

/// Bodies up to this size are tokenized on the request's task; longer ones on the blocking
/// pool (a long prompt takes milliseconds).
const INLINE_TOKENIZE_BYTES: usize = 16 << 10;

/// Fills `info.token_ids` from the local tokenizer when one is configured and the request
/// carries none; counts the outcome (`kvroute_local_tokenize`). A request that cannot be
/// reproduced exactly keeps its text key.
async fn local_tokens(s: &Arc<AppState>, api: Api, body: serde_json::Value, info: &mut RoutingInfo) {
    let Some(tk) = s.tokenizer.as_ref().filter(|_| info.token_ids.is_none()) else { return };
    let r = if info.text.len() <= INLINE_TOKENIZE_BYTES {
        tk.request_tokens(api, &body)
    } else {
        let tk = Arc::clone(tk);
        tokio::task::spawn_blocking(move || tk.request_tokens(api, &body)).await.unwrap_or(Err("tokenizer_error"))
    };
    let outcome = match r {
        Ok(t) => {
            info.token_ids = Some(t);
            "ok"
        }
        Err(reason) => reason,
    };
    s.metrics.local_tokenize.get_or_create(&crate::metrics::OutcomeLabel { outcome: outcome.into() }).inc();
}

async fn handle_inner(s: &Arc<AppState>, api: Api, headers: &HeaderMap, body: Body) -> Result<Response, ApiError> {
    let t0 = Instant::now();
    let bytes = read_body(s, headers, body).await?;
    let session = headers.get("x-session-id").and_then(|v| v.to_str().ok());
    let (body, mut info) = parse(api, &bytes, session)?;
    local_tokens(s, api, body, &mut info).await;
    let precise = if s.cfg.kv_events.is_empty() {
        Precise::Off
    } else {
        match crate::kv_subscriber::request_tokens(s, &bytes, &info).await {
            Ok(t) => Precise::Tokens(t),
            Err(reason) => Precise::Unavailable(reason),
        }
    };
    let Routed { decision: d, urls, chosen_precise, predicted } = decide_with(s, &info, &precise)?;
    // Settles the prediction when this handler returns without a stream (error or a whole
    // body); a stream's guard takes it over and settles it at the first bytes.
    let mut settle = SettleOnDrop(Arc::clone(s), predicted);
    let (source, reason) = prefix_source(&precise, chosen_precise);
    s.metrics
        .prefix_source
        .get_or_create(&crate::metrics::SourceLabels { source: source.into(), reason: reason.into() })
        .inc();
    let model_key = if info.model.is_empty() { "*" } else { info.model.as_str() };
    let permit = {
        let adm = s.admission.read();
        let r = adm.try_admit(model_key, Role::Both);
        match r {
            Err(rej) if rej.max == 0 => {
                drop(adm);
                s.admission.write().ensure_model(model_key);
                s.admission.read().try_admit(model_key, Role::Both)
            }
            other => other,
        }
    };
    let permit = permit.map_err(|rej| {
        s.metrics
            .admission_rejections
            .get_or_create(&crate::metrics::ModelLabel { model: model_key.to_string() })
            .inc();
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("too many requests in flight for model `{model_key}` (limit {}); retry later", rej.max),
        )
        .retry_after(1)
    })?;
    let mut decision = decision_header(&s.cfg.policy, &d);
    decision.push_str(&if reason.is_empty() {
        format!("; prefix={source}")
    } else {
        format!("; prefix={source}({reason})")
    });
    let req = precise_view(&info, &precise);
    // The per-request decision log (`KVROUTE_LOG=kvroute::decision=debug`): enough to line up
    // one router's choices with another's or with the engines' logs.
    tracing::debug!(
        target: "kvroute::decision",
        worker = urls.iter().find(|(id, _)| *id == d.worker.0).map_or("?", |(_, u)| u.as_str()),
        session = info.session.as_deref().unwrap_or("-"),
        input_tokens = req.input_tokens,
        decision = %decision,
        "routed"
    );
    let cached = estimated_cached_tokens(&d, req.input_tokens);
    let uncached = (req.input_tokens as u64).saturating_sub(cached);
    let output = info.max_tokens.unwrap_or(256) as u64;
    let order: Vec<WorkerId> = std::iter::once(d.worker).chain(d.fallbacks.iter().copied()).collect();
    let attempts = (s.cfg.max_total_retries as usize).max(1);
    let mut last_err = String::from("no attempt made");
    let timeout = Duration::from_secs_f64(s.cfg.request_timeout_secs);
    // `order` is never empty (the chosen worker comes first), so this is `attempts` tries,
    // cycling through the fallbacks when there are fewer of them.
    for (n, w) in order.iter().cycle().take(attempts).enumerate() {
        let Some(url) = urls.iter().find(|(id, _)| *id == w.0).map(|(_, u)| u.clone()) else { continue };
        // A retry target must still be routable (it may have been taken out meanwhile).
        if n > 0 {
            let healthy =
                s.workers.read().iter().any(|x| x.id == w.0 && x.health == kvroute_core::types::Health::Healthy);
            if !healthy {
                continue;
            }
            s.metrics.retries.inc();
            let now = s.now();
            kvroute_core::policy::record_routed(s.policy.lock().policy.as_mut(), &req, *w, now);
        }
        let ticket = s.ledger.lock().dispatched(*w, uncached, output);
        let mut rb = s.client.post(format!("{url}{}", api.path())).timeout(timeout).body(bytes.clone());
        rb = rb.header(header::CONTENT_TYPE, "application/json");
        if let Some(a) = headers.get(header::AUTHORIZATION) {
            rb = rb.header(header::AUTHORIZATION, a.clone());
        }
        let again = rb.try_clone();
        let sent = match (rb.send().await, again) {
            // A send error that is neither a timeout nor a failed connect: the worker closed
            // a pooled keep-alive connection under the request without answering (seen with
            // llama-server, docs/real-engines.md). Send it once more to the same worker on a
            // fresh connection: at worst a duplicate generation there, where moving it costs
            // a cold prefill elsewhere and credits its prefix to the wrong worker.
            (Err(e), Some(again)) if !e.is_timeout() && !e.is_connect() => {
                tracing::debug!(worker = %url, error = ?e, "stale connection; sending again to the same worker");
                s.metrics.stale_connection_resends.inc();
                again.send().await
            }
            (r, _) => r,
        };
        let resp = match sent {
            Ok(r) => r,
            Err(e) => {
                s.ledger.lock().failed(ticket);
                s.record_failure(w.0);
                if e.is_timeout() {
                    // A timed-out attempt has already spent the client's budget: no retry.
                    count(s, &url, d.branch.as_str(), "upstream_error");
                    return Err(ApiError::new(
                        StatusCode::GATEWAY_TIMEOUT,
                        format!("{url} did not answer within {} s", s.cfg.request_timeout_secs),
                    ));
                }
                last_err = format!("{url}: {e}");
                tracing::warn!(worker = %url, error = ?e, attempt = n + 1, "attempt failed; trying the next worker");
                continue;
            }
        };
        let status = resp.status();
        if status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS {
            s.ledger.lock().failed(ticket);
            s.record_failure(w.0);
            last_err = format!("{url}: upstream answered {status}");
            tracing::warn!(worker = %url, %status, attempt = n + 1, "attempt failed; trying the next worker");
            continue;
        }
        let ctype = resp.headers().get(header::CONTENT_TYPE).cloned();
        let mut builder = Response::builder().status(status.as_u16());
        if let Some(c) = ctype {
            builder = builder.header(header::CONTENT_TYPE, c);
        }
        builder = builder
            .header("x-kvroute-worker", HeaderValue::from_str(&url).unwrap_or(HeaderValue::from_static("?")))
            .header("x-kvroute-decision", HeaderValue::from_str(&decision).unwrap_or(HeaderValue::from_static("?")));
        let branch = d.branch.as_str();
        if info.stream && status.is_success() {
            let guard = StreamGuard {
                predicted: settle.1.take(),
                state: Arc::clone(s),
                ticket: Some(ticket),
                t0,
                first: false,
                worker_id: w.0,
                worker: url.clone(),
                branch,
                _permit: permit,
            };
            let up = Box::pin(resp.bytes_stream());
            let stream = futures_util::stream::unfold(Some((up, guard)), |st| async move {
                let (mut up, mut guard) = st?;
                match up.next().await {
                    Some(Ok(b)) => {
                        guard.on_bytes();
                        Some((Ok::<Bytes, std::io::Error>(b), Some((up, guard))))
                    }
                    Some(Err(e)) => {
                        guard.fail();
                        let ev = serde_json::json!({"error": {
                            "message": format!("upstream stream failed: {e}"),
                            "type": "server_error", "param": null, "code": 502}});
                        Some((Ok(Bytes::from(format!("data: {ev}\n\n"))), None))
                    }
                    None => {
                        guard.complete();
                        None
                    }
                }
            });
            return builder
                .body(Body::from_stream(stream))
                .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()));
        }
        // Non-streaming: the whole body is read before anything reaches the client, so a
        // failure here can still be retried.
        let mut ticket = ticket;
        match resp.bytes().await {
            Ok(b) => {
                {
                    let mut l = s.ledger.lock();
                    l.first_token(&mut ticket);
                    l.completed(ticket);
                }
                s.record_success(w.0);
                let secs = t0.elapsed().as_secs_f64();
                s.metrics.ttft_seconds.observe(secs);
                s.metrics.e2e_seconds.observe(secs);
                count(s, &url, branch, if status.is_success() { "ok" } else { "client_error" });
                drop(permit);
                return builder
                    .body(Body::from(b))
                    .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()));
            }
            Err(e) => {
                s.ledger.lock().failed(ticket);
                s.record_failure(w.0);
                last_err = format!("{url}: reading the response failed: {e}");
            }
        }
    }
    count(s, "", d.branch.as_str(), "upstream_error");
    Err(ApiError::new(
        StatusCode::BAD_GATEWAY,
        format!("every attempt failed ({attempts} at most); last error: {last_err}"),
    ))
}

/// Accounting of one streamed response: first byte, completion, failure or client
/// disconnect (drop) each close the ledger ticket exactly once.
struct StreamGuard {
    predicted: Option<Predicted>,
    state: Arc<AppState>,
    ticket: Option<Ticket>,
    t0: Instant,
    first: bool,
    worker_id: u32,
    worker: String,
    branch: &'static str,
    _permit: kvroute_core::admission::Permit,
}

impl StreamGuard {
    fn on_bytes(&mut self) {
        if !self.first {
            self.first = true;
            if let Some(p) = self.predicted.take() {
                p.settle(&self.state);
            }
            self.state.metrics.ttft_seconds.observe(self.t0.elapsed().as_secs_f64());
            if let Some(t) = self.ticket.as_mut() {
                self.state.ledger.lock().first_token(t);
            }
        }
    }
    fn complete(&mut self) {
        if let Some(t) = self.ticket.take() {
            self.state.ledger.lock().completed(t);
            self.state.record_success(self.worker_id);
            self.state.metrics.e2e_seconds.observe(self.t0.elapsed().as_secs_f64());
            count(&self.state, &self.worker, self.branch, "ok");
        }
    }
    fn fail(&mut self) {
        if let Some(t) = self.ticket.take() {
            self.state.ledger.lock().failed(t);
            self.state.record_failure(self.worker_id);
            count(&self.state, &self.worker, self.branch, "upstream_error");
        }
    }
}

/// Settles a prediction when dropped (see [`Predicted::settle`]).
struct SettleOnDrop(Arc<AppState>, Option<Predicted>);

impl Drop for SettleOnDrop {
    fn drop(&mut self) {
        if let Some(p) = self.1.take() {
            p.settle(&self.0);
        }
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        if let Some(p) = self.predicted.take() {
            p.settle(&self.state);
        }
        if let Some(t) = self.ticket.take() {
            self.state.ledger.lock().cancelled(t);
            count(&self.state, &self.worker, self.branch, "cancelled");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::policy::Branch;

    #[test]
    fn cached_estimate_is_unit_agnostic() {
        let d = |m, k, u| Decision::new(WorkerId(0), Branch::HighMatch).with_match(m, k, u);
        assert_eq!(estimated_cached_tokens(&d(2, 4, MatchUnit::Blocks), 4096), 2048);
        assert_eq!(estimated_cached_tokens(&d(100, 400, MatchUnit::Chars), 100), 25);
        assert_eq!(estimated_cached_tokens(&d(9, 9, MatchUnit::Tokens), 9), 9);
        assert_eq!(estimated_cached_tokens(&d(0, 0, MatchUnit::None), 50), 0);
        assert_eq!(
            decision_header("p", &d(3, 8, MatchUnit::Blocks)),
            "policy=p; branch=high_match; matched=3/8 blocks"
        );
    }
}
