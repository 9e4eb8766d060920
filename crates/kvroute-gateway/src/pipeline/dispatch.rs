//! Stage 5, dispatch: send the request to the chosen worker and retry as SGLang's router
//! documents — a connection error or a 5xx (or 429) before any byte reached the client is
//! retried on the same worker up to `max_worker_retries` times, then on the next worker
//! (except 508 Loop Detected, passed on: a loop, [`crate::hops`]);
//! `max_total_retries` bounds the attempts of one request, and the last routable worker
//! may use all that is left of it (a lone worker gets `max_total_retries` attempts). A
//! request still waiting for a worker's first byte when health checks mark that worker
//! down stops waiting and goes to the next worker (a stream's headers wait for its first
//! chunk, so nothing has reached the client yet). Each worker the request is really
//! written to is committed to the model's router (prefix index, session binding) and gets
//! a load ticket.

pub(crate) use super::ctx::Hop;
use super::ctx::RequestCtx;
use super::route::{RetryOrder, Routed};
use crate::app::AppState;
use crate::fleet::WorkerEntry;
use crate::metrics::WorkerLabel;
use crate::routers::ModelRouter;
use axum::body::Bytes;
use axum::http::{StatusCode, header};
use kvroute_core::ledger::LoadTicket;
use kvroute_core::policy::Observation;
use kvroute_core::types::{BlockHash, Nanos, RequestView, WorkerId};
use kvroute_protocol::openai::Api;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Who a failed dispatch is to blame on (the shape of pingora's error type).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blame {
    /// The request itself (a worker answered 4xx).
    Client,
    /// The workers (connection errors, 5xx, timeouts).
    Worker,
    /// The router (no routable worker left to try).
    Router,
    /// Nothing was sent: another decision sent a request to the chosen worker after this
    /// one read its load (`send` with `seen`); the caller decides again.
    Raced,
}

/// Why a request could not be served.
#[derive(Debug, Clone)]
pub struct DispatchError {
    /// Who is to blame.
    pub blame: Blame,
    /// Whether the client may retry the request as it is.
    pub retryable: bool,
    /// Whether bytes of a response already reached the client (then no retry is possible).
    pub bytes_sent: bool,
    /// The status to answer.
    pub status: StatusCode,
    /// What happened.
    pub message: String,
}

impl DispatchError {
    /// The retries ran out: 503 (the router's) when no attempt could be made, else 502
    /// (the workers').
    pub fn exhausted(attempts: u32, message: String) -> DispatchError {
        let (blame, status) = if attempts == 0 {
            (Blame::Router, StatusCode::SERVICE_UNAVAILABLE)
        } else {
            (Blame::Worker, StatusCode::BAD_GATEWAY)
        };
        DispatchError { blame, retryable: blame == Blame::Router, bytes_sent: false, status, message }
    }
}

impl From<DispatchError> for kvroute_protocol::api_error::ApiError {
    fn from(e: DispatchError) -> Self {
        let err = kvroute_protocol::api_error::ApiError::new(e.status, e.message);
        if e.retryable { err.retry_after(1) } else { err }
    }
}

/// A worker's answer with a success or client-error status.
#[derive(Debug)]
pub struct Sent {
    /// The response (for a stream, its body still to come).
    pub resp: reqwest::Response,
    /// The whole body, read within the attempt (so a failure reading it can still be
    /// retried), for a non-streamed request or an error status; `None` for a stream.
    pub body: Option<Bytes>,
    /// A stream's first chunk, read within the attempt (so a worker that fails or is
    /// marked down before it can still be replaced); `None` for a whole body, an empty
    /// stream, or a stream whose first chunk is still to come (disaggregated decode).
    pub first: Option<Bytes>,
    /// The worker that answered.
    pub worker: Arc<WorkerEntry>,
    /// Its open load ticket (settles on drop).
    pub ticket: LoadTicket,
    /// The same dispatch as the other cluster replicas see it (NATS sync): `done` is
    /// announced when it drops.
    pub shared: Option<crate::cluster::sync::SharedTicket>,
    /// The request's engine blocks predicted on that worker (settled at the first token).
    pub predicted: Option<Predicted>,
    /// For a stream, when its first chunk must have come (`stream_first_byte_timeout_secs`
    /// after dispatch began).
    pub first_byte_by: Option<tokio::time::Instant>,
    /// The decision's predictions, to hand back to the policy with what the request met
    /// (`None` when a retry target answered instead of the chosen worker).
    pub observe: Option<Observe>,
    /// Its llama.cpp slot (`llama_slot_routing`), released in the record when it drops.
    pub slot: Option<SlotHold>,
}

/// A request's place on one llama.cpp slot of its worker, in the router's
/// [`kvroute_core::slots::SlotTable`]: taken when the attempt is sent, released when this
/// drops (answered, failed, or the client went away).
#[derive(Debug)]
pub struct SlotHold {
    worker: Arc<WorkerEntry>,
    /// The slot (llama.cpp `id_slot`).
    pub slot: u32,
    taken_at: Nanos,
    taken: Instant,
    /// Leading blocks of the prompt the slot held when it was chosen.
    cached_blocks: usize,
    /// The slot was busy when chosen: the request waits for it.
    waits: bool,
    /// With the KV mover: what saving the slot after the request needs.
    save: Option<crate::kv_move::SaveTicket>,
    /// With the KV mover: the saved prefix best matching the prompt when the slot was
    /// chosen (looked up once, for the choice and the restore).
    file: Option<kvroute_core::kv_migration::FileMatch>,
    /// The worker answered (the prompt is in the slot): the slot may be saved.
    prefilled: bool,
    /// A saved prefix the KV mover restored into the slot before the request was sent.
    pub restored: Option<crate::kv_move::Restored>,
}

impl SlotHold {
    /// Chooses `w`'s slot for the request `key` and commits it (one lock of that worker).
    /// `None` when `w` has no slots or slot routing is off for it.
    pub fn take(s: &AppState, w: &Arc<WorkerEntry>, key: &super::route::SlotKey, model: &str) -> Option<SlotHold> {
        if !w.slot_routing() {
            return None;
        }
        let now = s.now();
        // With the KV mover: an idle slot can be given the saved prefix (looked up before
        // the worker's lock is taken).
        let file = s.kv_mover.as_ref().and_then(|m| Some((m, m.best_file(model, &key.blocks)?)));
        let restorable = file.as_ref().map_or(0, |(m, f)| m.restorable_blocks(w, f, key.block_tokens));
        let choice = {
            let mut slots = w.slots.lock();
            let t = slots.as_mut()?;
            let c = t.choose_with_restore(&key.blocks, key.block_tokens, key.input_tokens, restorable);
            t.start(c.slot, &key.blocks, now);
            c
        };
        s.metrics.llama_slot_requests.inc();
        if choice.waits {
            s.metrics.llama_slot_waits.inc();
        }
        let save = s.kv_mover.as_ref().and_then(|m| m.ticket(model, &key.blocks, key.block_tokens, key.input_tokens));
        Some(SlotHold {
            worker: Arc::clone(w),
            slot: choice.slot,
            taken_at: now,
            taken: Instant::now(),
            cached_blocks: choice.cached_blocks,
            waits: choice.waits,
            save,
            file: file.map(|(_, f)| f),
            prefilled: false,
            restored: None,
        })
    }

    /// With the KV mover on: restores the saved prefix found when the slot was chosen into
    /// this slot before the request is sent, if that pays
    /// ([`crate::kv_move::KvMover::restore`]).
    pub async fn restore_before_send(&mut self, s: &AppState, key: &super::route::SlotKey) {
        let (Some(m), Some(f)) = (s.kv_mover.as_ref(), self.file.take()) else { return };
        let at = crate::kv_move::SlotPlace {
            worker: &self.worker,
            slot: self.slot,
            cached_blocks: self.cached_blocks,
            busy: self.waits,
        };
        self.restored = m.restore(at, &f, key.block_tokens).await;
    }

    /// The worker answered: its slot holds the prompt (and may be saved when the request
    /// ends).
    pub fn answered(&mut self) {
        self.prefilled = true;
    }
}

impl Drop for SlotHold {
    fn drop(&mut self) {
        let now = Nanos(self.taken_at.0.saturating_add(self.taken.elapsed().as_nanos().min(u64::MAX as u128) as u64));
        if let Some(t) = self.worker.slots.lock().as_mut() {
            t.finish(self.slot, now);
            if let Some(save) = self.save.take().filter(|_| self.prefilled) {
                crate::kv_move::KvMover::after_request(save, &self.worker, self.slot, t);
            }
        }
    }
}

/// `body` with llama.cpp's `"id_slot": slot` set (the OpenAI-compatible endpoints pass it
/// through to the slot scheduler); `None` when the body is not a JSON object.
pub fn with_id_slot(ctx: &RequestCtx<'_>, slot: u32) -> Option<Bytes> {
    let mut v = ctx.object()?.clone();
    v.insert("id_slot".into(), slot.into());
    serde_json::to_vec(&v).ok().map(Bytes::from)
}

/// What the decision expected of the request on its chosen worker — its TTFT (for a
/// predicting policy such as `least_ttft`) and its cached prompt tokens — completed with
/// what it met and handed back to the model's router ([`ModelRouter::observe`]) when the
/// answer ends; the prediction errors go to `kvroute_ttft_prediction_ratio` and
/// `kvroute_cached_tokens_{predicted,reported}_total`.
#[derive(Debug)]
pub struct Observe {
    router: Arc<ModelRouter>,
    worker: WorkerId,
    url: Arc<str>,
    /// The worker, for the KV mover's prefill calibration.
    entry: Arc<WorkerEntry>,
    obs: Observation,
    /// When the attempt that answered was sent.
    started: Instant,
}

impl Observe {
    /// The first token (byte) arrived now: the measured TTFT, from the attempt's send.
    pub fn first_token(&mut self) {
        if self.obs.ttft_secs.is_none() {
            self.obs.ttft_secs = Some(self.started.elapsed().as_secs_f64());
        }
    }

    /// The answer ended; `cached_tokens` is what its engine reported cached (`None` when
    /// the answer did not say), `prefill` the prompt tokens it computed and the
    /// milliseconds that took (llama.cpp `timings`). Exports the prediction errors, teaches
    /// the policy, and calibrates the KV mover's prefill cost for the worker.
    pub fn finish(mut self, s: &AppState, cached_tokens: Option<u64>, prefill: Option<(u64, f64)>) {
        self.obs.cached_tokens = cached_tokens;
        let label = WorkerLabel { worker: self.url.to_string() };
        if let (Some(p), Some(t)) = (self.obs.predicted, self.obs.ttft_secs)
            && p.secs > 0.0
        {
            s.metrics.ttft_prediction_ratio.get_or_create(&label).observe(t / p.secs);
        }
        if let Some(c) = cached_tokens {
            s.metrics.cached_tokens_predicted.get_or_create(&label).inc_by(self.obs.predicted_cached_tokens);
            s.metrics.cached_tokens_reported.get_or_create(&label).inc_by(c);
        }
        if let (Some(m), Some((n, ms))) = (s.kv_mover.as_ref(), prefill) {
            m.observe_prefill(&self.entry, n, ms / 1000.0);
        }
        if self.obs.ttft_secs.is_some() || cached_tokens.is_some() {
            self.router.observe(self.worker, &self.obs);
        }
    }
}

/// A request's own block hashes predicted on its worker until its deadline
/// ([`kvroute_core::precise::PreciseIndex::predict`]).
#[derive(Debug, Clone)]
pub struct Predicted {
    worker: WorkerId,
    hashes: Arc<[BlockHash]>,
}

impl Predicted {
    /// The prefill is over (first token) or the attempt ended: the engine's `BlockStored`
    /// is on its way, so the prediction now lasts only the predict window.
    pub fn settle(&self, s: &AppState) {
        let now = s.now();
        let until = now.saturating_add(s.precise.read().predict_window());
        s.precise.write(|ix| ix.predict(self.worker, &self.hashes, now, until));
    }
}

/// One dispatch of a decided request to a worker, for [`commit`].
pub(crate) struct Dispatch<'r> {
    /// The pool whose routers decided (the cluster sync's event says which).
    pub pool: crate::cluster::sync::Pool,
    /// The decision.
    pub routed: &'r Routed,
    /// The worker the request is sent to (the decision's, or a retry target).
    pub worker: &'r WorkerEntry,
    /// Prompt tokens it prefills.
    pub uncached: u64,
    /// Tokens it decodes.
    pub decode: u64,
    /// Whether the router's prefix index and session table record it (the first attempt
    /// on this worker; a retry on the same worker does not record it twice).
    pub index: bool,
    /// The worker's dispatch count when the decision read its load: the ticket opens only
    /// if no other request was sent there since ([`Blame::Raced`] otherwise).
    pub seen: Option<u64>,
}

/// What a committed dispatch holds until its answer ends.
pub(crate) struct Committed {
    /// The load ticket on the worker (settles on drop).
    pub ticket: LoadTicket,
    /// The request's engine blocks predicted on the worker.
    pub predicted: Option<Predicted>,
    /// The dispatch as the other cluster replicas see it.
    pub shared: Option<crate::cluster::sync::SharedTicket>,
}

/// Commits a dispatch — the one place every dispatch (one worker, each half of a P/D pair,
/// each cascade step) records itself: the load ledger's ticket, the router's prefix index
/// and session table, predict-on-route for a worker that publishes KV events, the cluster
/// sync's event and the prefix state journal (`state_dir`).
///
/// # Errors
/// [`Blame::Raced`] when `seen` no longer holds: nothing was committed.
pub(crate) fn commit(ctx: &RequestCtx<'_>, req: &RequestView<'_>, d: Dispatch<'_>) -> Result<Committed, DispatchError> {
    let w = d.worker;
    let ticket = match d.seen {
        Some(n) => w.load.dispatched_if(n, d.uncached, d.decode).ok_or_else(|| DispatchError {
            blame: Blame::Raced,
            retryable: true,
            bytes_sent: false,
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "another request was sent to the chosen worker meanwhile".into(),
        })?,
        None => w.load.dispatched(d.uncached, d.decode),
    };
    let predicted = if d.index { index(ctx.s, d.routed, req, w.id) } else { None };
    let announce = crate::cluster::sync::Announce {
        pool: d.pool,
        router: &d.routed.router,
        key: &d.routed.key,
        req,
        worker_url: &w.url,
        uncached: d.uncached,
        decode: d.decode,
    };
    if d.index
        && let Some(j) = &ctx.s.journal
    {
        j.record(&announce);
    }
    let shared = ctx.s.sync.as_ref().map(|sync| sync.routed(announce));
    Ok(Committed { ticket, predicted, shared })
}

/// The router's index and session table record the request on `worker`, and (for a worker
/// that publishes KV events) its blocks are predicted there until its deadline.
fn index(s: &AppState, routed: &Routed, req: &RequestView<'_>, worker: WorkerId) -> Option<Predicted> {
    let now = s.now();
    if worker == routed.decision.worker {
        routed.router.commit(req, &routed.key, worker, now);
    } else {
        // A retry target: the key carries the chosen worker's KV capacity; this one's.
        let mut key = routed.key.clone();
        key.worker_kv_tokens = routed.candidates.entry(worker).and_then(|w| w.core_capacity().kv_tokens);
        routed.router.commit(req, &key, worker, now);
    }
    if routed.engine_blocks.is_empty() {
        return None;
    }
    let bs = {
        let ix = s.precise.read();
        if ix.predict_window().0 == 0 {
            return None;
        }
        ix.block_size(worker)?
    };
    let hashes = routed.engine_blocks.iter().find(|(b, _)| *b == bs).map(|(_, h)| Arc::clone(h))?;
    let deadline = now.saturating_add(Nanos::from_secs_f64(s.cfg.request_timeout_secs));
    s.precise.write(|ix| ix.predict(worker, &hashes, now, deadline));
    Some(Predicted { worker, hashes })
}

/// The bounds of one request's dispatch, read once.
struct Plan {
    /// Prompt tokens the chosen worker prefills.
    uncached: u64,
    /// Tokens to decode.
    output: u64,
    /// Attempts on one worker while others are left.
    per_worker: u32,
    /// Attempts in all.
    total: u32,
    /// `request_timeout_secs`.
    timeout: Duration,
    /// A stream's first-byte deadline (from dispatch, whichever attempt serves it).
    first_byte_by: Option<tokio::time::Instant>,
}

/// How one attempt ended.
enum Attempt {
    /// A success or client-error answer: the client's.
    Answered(Box<Sent>),
    /// Not retried (the client's time budget is spent, an oversized answer).
    Final(DispatchError),
    /// The worker was marked down before it answered: the next worker.
    Down(String),
    /// Failed before the first byte: the next attempt may serve it.
    Retry(String),
    /// The worker hung up on the request and on its resend ([`Failure::Closed`]): the next
    /// worker may serve it (the same one when no other is left), up to
    /// [`MAX_CLOSED_ATTEMPTS`] such attempts.
    Closed(String),
}

/// Most attempts of one request that may end in `Failure::Closed` (each sent twice):
/// the second such hang-up ends the request with 502. Two, not one, because two pooled
/// connections to one worker can go stale together; a request that two workers (or one,
/// twice) hang up on while it is being sent is the likely cause itself — a body over the
/// workers' limit — and resending it to every worker in the retry budget uploaded it up to
/// `2 × max_total_retries` times.
pub const MAX_CLOSED_ATTEMPTS: u32 = 2;

/// Sends the request until a worker answers with a non-retryable status, within the
/// retry bounds. With `seen` (the decision's worker's dispatch count when its view was
/// read, [`crate::fleet::Candidates::dispatches_seen`]), the first attempt goes only if no
/// other request was dispatched there since.
///
/// # Errors
/// [`DispatchError`]: 504 when an attempt timed out (the client's time budget is spent),
/// 502 when every attempt failed, 503 when no routable worker was left to try;
/// [`Blame::Raced`] when `seen` no longer holds (nothing was sent or committed: decide
/// again).
pub async fn send(ctx: &RequestCtx<'_>, routed: &Routed, seen: Option<u64>) -> Result<Sent, DispatchError> {
    let s = ctx.s;
    let req = ctx.view();
    let d = &routed.decision;
    let plan = Plan {
        uncached: u64::from(req.input_tokens).saturating_sub(d.cached_tokens_estimate(req.input_tokens)),
        output: u64::from(ctx.info.max_tokens.unwrap_or(256)),
        per_worker: s.cfg.max_worker_retries.max(1),
        total: s.cfg.max_total_retries.max(1),
        timeout: Duration::from_secs_f64(s.cfg.request_timeout_secs),
        first_byte_by: ctx.first_byte_by(),
    };
    let mut attempts = 0u32;
    let mut closed = 0u32;
    let mut last_err = String::from("no routable worker was left to try");
    let mut order = RetryOrder::new(routed);
    let mut next = 0;
    'workers: while let Some(id) = order.get(next) {
        next += 1;
        let Some(w) = routed.candidates.entry(id) else { continue };
        for n in 0.. {
            // The last routable worker of the order may use what is left of the request's
            // budget: a lone worker gets `max_total_retries` attempts, not `max_worker_retries`
            // (with one or two workers, one of them ejected, that was the whole budget).
            if n == plan.per_worker && order.any_routable_from(next) {
                continue 'workers;
            }
            // A retry target must still be routable (it may have been taken out meanwhile).
            if attempts == plan.total || (attempts > 0 && !w.is_routable()) {
                continue 'workers;
            }
            attempts += 1;
            if attempts > 1 {
                s.metrics.retries.inc();
            }
            // The decision's own worker, first: only if no other decision sent a request
            // there since this one read its load (`seen`).
            let seen = seen.filter(|_| attempts == 1 && w.id == d.worker);
            let dispatch = Dispatch {
                pool: crate::cluster::sync::Pool::Main,
                routed,
                worker: w,
                uncached: plan.uncached,
                decode: plan.output,
                index: n == 0,
                seen,
            };
            let committed = commit(ctx, &req, dispatch)?;
            match attempt_on(ctx, routed, w, &plan, committed).await {
                Attempt::Answered(sent) => return Ok(*sent),
                Attempt::Final(e) => return Err(e),
                Attempt::Down(e) => {
                    last_err = e;
                    continue 'workers;
                }
                Attempt::Retry(e) => {
                    tracing::warn!(worker = %w.url, error = %e, attempt = attempts, "attempt failed");
                    last_err = e;
                }
                Attempt::Closed(e) => {
                    tracing::warn!(worker = %w.url, error = %e, attempt = attempts, "attempt failed");
                    closed += 1;
                    if closed == MAX_CLOSED_ATTEMPTS {
                        return Err(closed_out(attempts, &e));
                    }
                    last_err = e;
                    // It was sent to this worker twice already: the next worker, if any.
                    if order.any_routable_from(next) {
                        continue 'workers;
                    }
                }
            }
        }
    }
    Err(DispatchError::exhausted(
        attempts,
        format!("every attempt failed ({attempts} made, {} at most); last error: {last_err}", plan.total),
    ))
}

/// The 502 that ends a request after [`MAX_CLOSED_ATTEMPTS`] hang-ups, `e` the last.
fn closed_out(attempts: u32, e: &str) -> DispatchError {
    DispatchError::exhausted(
        attempts,
        format!(
            "workers closed the connection {MAX_CLOSED_ATTEMPTS} times while the request was sent, without \
             answering: the request itself (e.g. a body over the workers' limit) is the likely cause; last error: {e}"
        ),
    )
}

/// One committed attempt on `w`: sent (pinned to a llama.cpp slot when the decision chose
/// one), its first byte awaited while health checks keep `w` up, the outcome classified.
/// A failed attempt settles its prediction and is charged to the worker (not when health
/// checks took it out first).
async fn attempt_on(ctx: &RequestCtx<'_>, routed: &Routed, w: &Arc<WorkerEntry>, plan: &Plan, c: Committed) -> Attempt {
    let s = ctx.s;
    let d = &routed.decision;
    // llama.cpp (OpenAI-compatible endpoints only; it serves no `/generate`).
    let key = routed.slot_key.as_ref().filter(|_| ctx.api != Api::Generate);
    let mut slot = key.and_then(|k| SlotHold::take(s, w, k, &ctx.model));
    if let (Some(h), Some(k)) = (slot.as_mut(), key) {
        h.restore_before_send(s, k).await;
    }
    let pinned = slot.as_ref().and_then(|h| with_id_slot(ctx, h.slot));
    let started = Instant::now();
    super::ctx::note_worker(&w.url, d.branch.as_str());
    let answer = async {
        match attempt(ctx.hop(), w, pinned.as_ref().unwrap_or(&ctx.bytes), plan.timeout, plan.first_byte_by).await {
            Ok(resp) if ctx.info.stream && resp.status().is_success() => {
                first_chunk(resp, plan.first_byte_by).await.map(|(r, first)| (r, None, first))
            }
            // Non-streaming: the whole body is read before anything reaches the client.
            Ok(resp) => read_whole(resp).await.map(|(r, body)| (r, body, None)),
            Err(f) => Err(f),
        }
    };
    // Until its first byte (a stream's first chunk, a whole answer) the request waits on
    // the worker only while health checks keep it up: marked down, it fails over.
    let down = w.marked_down();
    let answer = if w.health() == kvroute_core::types::Health::Unhealthy {
        None
    } else {
        tokio::select! {
            a = answer => Some(a),
            () = down => None,
        }
    };
    let failed = |c: Committed| {
        if let Some(p) = c.predicted {
            p.settle(s);
        }
    };
    let (resp, body, first) = match answer {
        None => {
            // Not charged a failure: the health checks took it out already.
            tracing::warn!(worker = %w.url, "worker marked down while the request waited: failing over");
            failed(c);
            return Attempt::Down(format!("{} was marked down by health checks before it answered", w.url));
        }
        Some(Ok(a)) => a,
        Some(Err(f)) => {
            failed(c);
            return failure(s, w, f);
        }
    };
    if resp.status() == StatusCode::LOOP_DETECTED {
        // Counted against the worker, so a loop that persists takes it out.
        tracing::warn!(worker = %w.url, "routing loop: the worker sent the request back here (508)");
        s.record_failure(w);
    }
    let observe = (w.id == d.worker && resp.status().is_success()).then(|| observe_of(ctx, routed, w, started));
    if let Some(h) = slot.as_mut().filter(|_| resp.status().is_success()) {
        h.answered();
    }
    let Committed { ticket, predicted, shared } = c;
    let worker = Arc::clone(w);
    Attempt::Answered(Box::new(Sent {
        resp,
        body,
        first,
        worker,
        ticket,
        shared,
        predicted,
        first_byte_by: plan.first_byte_by,
        observe,
        slot,
    }))
}

/// The decision's predictions for the chosen worker, to hand back with what it met.
pub(crate) fn observe_of(ctx: &RequestCtx<'_>, routed: &Routed, w: &Arc<WorkerEntry>, started: Instant) -> Observe {
    let (req, d) = (ctx.view(), &routed.decision);
    Observe {
        router: Arc::clone(&routed.router),
        worker: w.id,
        url: Arc::clone(&w.url),
        entry: Arc::clone(w),
        obs: Observation {
            input_tokens: req.input_tokens,
            predicted: d.predicted_ttft,
            predicted_cached_tokens: d.cached_tokens_estimate(req.input_tokens),
            ttft_secs: None,
            cached_tokens: None,
        },
        started,
    }
}

/// A failed attempt's outcome: a timeout and an oversized answer end the request (504,
/// 502), another failure may be retried; timeouts and retryable failures are charged to
/// the worker.
fn failure(s: &AppState, w: &WorkerEntry, f: Failure) -> Attempt {
    match f {
        Failure::Timeout { first_byte } => {
            s.record_failure(w);
            let (what, secs) = if first_byte {
                ("sent no response", s.cfg.stream_first_byte_timeout_secs)
            } else {
                ("did not answer", s.cfg.request_timeout_secs)
            };
            Attempt::Final(DispatchError {
                blame: Blame::Worker,
                retryable: false,
                bytes_sent: false,
                status: StatusCode::GATEWAY_TIMEOUT,
                message: format!("{} {what} within {secs} s", w.url),
            })
        }
        Failure::TooLarge(e) => Attempt::Final(DispatchError {
            blame: Blame::Worker,
            retryable: false,
            bytes_sent: false,
            status: StatusCode::BAD_GATEWAY,
            message: format!("{}: {e}", w.url),
        }),
        // Not charged: the request, not the worker, is the likely cause.
        Failure::Closed(e) => Attempt::Closed(e),
        Failure::Retry(e) => {
            s.record_failure(w);
            Attempt::Retry(e)
        }
    }
}

pub(crate) enum Failure {
    /// `request_timeout_secs` passed, or (`first_byte`) a stream's first-byte deadline.
    Timeout { first_byte: bool },
    /// A non-streamed answer over [`MAX_RESPONSE_BYTES`] (not retried: it would be again).
    TooLarge(String),
    /// Failed before the first byte reached the client: the next attempt may serve it.
    Retry(String),
    /// The worker closed the connection before answering, on the attempt and on its resend:
    /// most likely because of the request itself (a body over the worker's limit, which a
    /// worker such as axum's answers with 413 and a hang-up before it has read the body; a
    /// request that crashes its handler). Retried like [`Failure::Retry`] (two pooled
    /// connections may have gone stale at once) but not charged to the worker: charged, a
    /// client sending such requests would take worker after worker out of routing.
    Closed(String),
}

/// A stream's first chunk, read before anything is sent to the client (so a worker that
/// fails, or is marked down, before its first token can still be replaced). `None` for a
/// stream that ended empty.
async fn first_chunk(
    mut resp: reqwest::Response,
    first_byte_by: Option<tokio::time::Instant>,
) -> Result<(reqwest::Response, Option<Bytes>), Failure> {
    let next = match first_byte_by {
        Some(by) => match tokio::time::timeout_at(by, resp.chunk()).await {
            Ok(r) => r,
            Err(_) => return Err(Failure::Timeout { first_byte: true }),
        },
        None => resp.chunk().await,
    };
    match next {
        Ok(first) => Ok((resp, first)),
        Err(e) if e.is_timeout() => Err(Failure::Timeout { first_byte: false }),
        Err(e) => Err(Failure::Retry(format!("the stream failed before its first chunk: {e}"))),
    }
}

/// Largest non-streamed answer the router holds before passing it on, bytes (a stream is
/// relayed chunk by chunk and not bounded). 256 MiB is far above any chat completion,
/// logprobs included.
pub const MAX_RESPONSE_BYTES: usize = 256 << 20;

/// Reads a whole body, at most [`MAX_RESPONSE_BYTES`]; the response keeps its status and
/// headers (its body is drained).
pub(crate) async fn read_whole(mut resp: reqwest::Response) -> Result<(reqwest::Response, Option<Bytes>), Failure> {
    let mut out = Vec::new();
    loop {
        match resp.chunk().await {
            Ok(Some(c)) if out.len() + c.len() > MAX_RESPONSE_BYTES => {
                return Err(Failure::TooLarge(format!("the answer is larger than {MAX_RESPONSE_BYTES} bytes")));
            }
            Ok(Some(c)) => out.extend_from_slice(&c),
            Ok(None) => return Ok((resp, Some(Bytes::from(out)))),
            Err(e) if e.is_timeout() => return Err(Failure::Timeout { first_byte: false }),
            Err(e) => return Err(Failure::Retry(format!("reading the response failed: {e}"))),
        }
    }
}

/// Whether `e` is a worker closing a connection it had taken before answering (not a
/// refused connection, not a timeout): a pooled connection gone stale, or the worker
/// hanging up on the request itself.
fn closed_early(e: &reqwest::Error) -> bool {
    !e.is_timeout() && !e.is_connect()
}

/// One attempt on `w`. A send error that is neither a timeout nor a failed connect means the
/// worker closed a pooled keep-alive connection under the request without answering (seen
/// with llama-server, docs/real-engines.md): it is sent once more to the same worker on a
/// fresh connection — at worst a duplicate generation there, where moving it costs a cold
/// prefill elsewhere and credits its prefix to the wrong worker. Closed again, the failure
/// is [`Failure::Closed`].
pub(crate) async fn attempt(
    hop: Hop<'_>,
    w: &WorkerEntry,
    bytes: &Bytes,
    timeout: Duration,
    first_byte_by: Option<tokio::time::Instant>,
) -> Result<reqwest::Response, Failure> {
    let Hop { s, api, headers } = hop;
    let url = w.endpoint(api).map_err(|e| Failure::Retry(e.to_string()))?;
    let mut rb = s.client.post(url).timeout(timeout).body(bytes.clone());
    rb = rb.header(header::CONTENT_TYPE, "application/json");
    // This hop, after the client's own `Via` entries: a request that comes back is refused.
    rb = rb.header(header::VIA, crate::hops::outgoing(headers, &s.via_name));
    for name in s.forward_headers.iter().filter(|n| **n != header::VIA) {
        for v in headers.get_all(name) {
            rb = rb.header(name, v.clone());
        }
    }
    let again = rb.try_clone();
    // Whether the worker took the connection and closed it before answering, twice.
    let mut closed_twice = false;
    let send = async {
        match (rb.send().await, again) {
            (Err(e), Some(again)) if closed_early(&e) => {
                tracing::debug!(worker = %w.url, error = ?e, "stale connection; sending again to the same worker");
                s.metrics.stale_connection_resends.inc();
                let r = again.send().await;
                closed_twice = r.as_ref().is_err_and(closed_early);
                r
            }
            (r, _) => r,
        }
    };
    let sent = match first_byte_by {
        Some(by) => match tokio::time::timeout_at(by, send).await {
            Ok(r) => r,
            Err(_) => return Err(Failure::Timeout { first_byte: true }),
        },
        None => send.await,
    };
    match sent {
        Err(e) if e.is_timeout() => Err(Failure::Timeout { first_byte: false }),
        Err(e) if closed_twice => Err(Failure::Closed(format!(
            "{}: closed the connection before answering, twice, while the request ({} bytes) was sent: {e}",
            w.url,
            bytes.len()
        ))),
        Err(e) => Err(Failure::Retry(format!("{}: {e}", w.url))),
        // A router downstream saw this request pass through it already (`crate::hops`): a
        // loop, which a retry elsewhere would only go round again. The answer is the
        // client's, as it is.
        Ok(r) if r.status() == StatusCode::LOOP_DETECTED => Ok(r),
        Ok(r) if r.status().is_server_error() || r.status() == StatusCode::TOO_MANY_REQUESTS => {
            Err(Failure::Retry(format!("{}: upstream answered {}", w.url, r.status())))
        }
        Ok(r) => Ok(r),
    }
}
