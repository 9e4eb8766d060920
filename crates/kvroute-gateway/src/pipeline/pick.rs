//! The stages of a request whose answer someone else relays — the endpoint picker's gateway
//! (Gateway API Inference Extension, `crate::epp`): load, key, admit, decide and commit
//! exactly as [`super::steps`] runs them for `serve`, and then, instead of sending, the
//! endpoints to try in order. The committed dispatch (ledger ticket, prefix index, session,
//! predict-on-route, cluster sync) is held in a [`Picked`] until the gateway reports the
//! answer, then settled by the same `StreamGuard` that settles a relayed stream in `serve`.

use super::ctx::RequestCtx;
use super::dispatch::{self, Blame, Committed, Dispatch, DispatchError, SlotHold};
use super::respond::{Held, StreamGuard};
use super::route::{self, Routed, order};
use super::steps::{self, MAX_REDECISIONS};
use crate::fleet::WorkerEntry;
use axum::body::Bytes;
use kvroute_core::admission::Permit;
use kvroute_core::types::Role;
use kvroute_protocol::api_error::ApiError;
use kvroute_protocol::openai::Api;
use std::sync::Arc;
use std::time::Instant;

/// Most endpoints handed to the gateway for one request (the chosen one, then fallbacks
/// the gateway's retries walk in order).
pub const MAX_ENDPOINTS: usize = 4;

/// A decided and committed request, waiting for its answer.
pub struct Picked {
    /// The decision.
    pub routed: Routed,
    /// The worker the dispatch is committed to (the decision's, until the gateway reports
    /// that another of the endpoints served).
    pub worker: Arc<WorkerEntry>,
    /// The committed dispatch (ticket, prediction, sync).
    committed: Committed,
    /// The admission permit.
    permit: Permit,
    /// The `x-kvroute-decision` value.
    pub decision: String,
    /// The decision's branch.
    pub branch: &'static str,
    record: Option<crate::record::Pending>,
    observe: Option<dispatch::Observe>,
    slot: Option<SlotHold>,
    /// The body to forward instead of the client's (the tenant's `cache_salt`, a llama.cpp
    /// `id_slot`); `None`: the client's as it is.
    pub body: Option<Bytes>,
    /// `host:port` of the endpoints to try in order: the chosen worker, then the decision's
    /// routable fallbacks (at most [`MAX_ENDPOINTS`]).
    pub endpoints: Vec<String>,
    uncached: u64,
    decode: u64,
}

impl std::fmt::Debug for Picked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Picked").field("worker", &self.worker.url).field("endpoints", &self.endpoints).finish()
    }
}

/// Load, key, admit, decide, commit: everything `serve` does for a request up to the send,
/// deciding again (at most [`MAX_REDECISIONS`] times) when another request was committed
/// to the chosen worker meanwhile. `original` is the body as the client sent it.
///
/// # Errors
/// As `serve` answers them: 404 for an unknown model, 503 when admission is full or no
/// worker (of the subset) is routable, with the decision's branch once there is one.
pub async fn pick(ctx: &mut RequestCtx<'_>, original: &Bytes) -> Result<Picked, (ApiError, &'static str)> {
    let s = ctx.s;
    super::lora::ensure_loaded(s, &ctx.info.model).await.map_err(|e| (e, ""))?;
    steps::key(ctx).await.map_err(|e| (e, ""))?;
    let permit = route::admit_as(s, &ctx.model, Role::Both).map_err(|e| (e, ""))?;
    let mut redone = 0;
    let (routed, worker, committed, uncached, decode) = loop {
        let routed = route::decide_in(ctx, &s.routers, None).map_err(|e| (e, ""))?;
        let d = &routed.decision;
        let branch = d.branch.as_str();
        let Some(worker) = routed.candidates.entry(d.worker).cloned() else {
            return Err((ApiError::from(DispatchError::exhausted(0, "the chosen worker left".into())), branch));
        };
        let req = ctx.view();
        let uncached = u64::from(req.input_tokens).saturating_sub(d.cached_tokens_estimate(req.input_tokens));
        let decode = u64::from(ctx.info.max_tokens.unwrap_or(256));
        let seen = (redone < MAX_REDECISIONS).then(|| routed.candidates.dispatches_seen(d.worker)).flatten();
        let dispatch = Dispatch {
            pool: crate::cluster::sync::Pool::Main,
            routed: &routed,
            worker: &worker,
            uncached,
            decode,
            index: true,
            seen,
        };
        match dispatch::commit(ctx, &req, dispatch) {
            Err(e) if e.blame == Blame::Raced => {
                redone += 1;
                s.metrics.decisions_redone.inc();
            }
            Err(e) => return Err((e.into(), branch)),
            Ok(c) => break (routed, worker, c, uncached, decode),
        }
    };
    let branch = routed.decision.branch.as_str();
    let mut decision = route::decision_header(&routed.router.policy_name, &routed.decision);
    decision.push_str("; epp=1");
    let slot = routed
        .slot_key
        .as_ref()
        .filter(|_| ctx.api != Api::Generate)
        .and_then(|k| SlotHold::take(s, &worker, k, &ctx.model));
    let body = match &slot {
        Some(h) => dispatch::with_id_slot(ctx, h.slot),
        None => (ctx.bytes != *original).then(|| ctx.bytes.clone()),
    };
    let endpoints: Vec<String> = order(&routed)
        .filter_map(|id| routed.candidates.entry(id))
        .filter(|w| w.id == worker.id || w.is_routable())
        .filter_map(|w| w.authority().map(str::to_string))
        .take(MAX_ENDPOINTS)
        .collect();
    super::ctx::note_worker(&worker.url, branch);
    let observe = Some(dispatch::observe_of(ctx, &routed, &worker, Instant::now()));
    Ok(Picked {
        record: steps::begin_record(ctx),
        routed,
        worker,
        committed,
        permit,
        decision,
        branch,
        observe,
        slot,
        body,
        endpoints,
        uncached,
        decode,
    })
}

impl Picked {
    /// The gateway reports that `served` answered, not the worker this dispatch was
    /// committed to: it retried down the endpoint list, so the chosen worker failed for it.
    /// The chosen worker's dispatch is settled and charged a failure, and the dispatch is
    /// committed again to `served` (its ticket, prefix index and session) — as `serve`
    /// commits a retry target. The decision's predictions are not observed (they were for
    /// the chosen worker).
    ///
    /// # Errors
    /// Never in practice ([`Blame::Raced`] needs a dispatch count to check; none is given).
    pub fn served_by(&mut self, ctx: &RequestCtx<'_>, served: Arc<WorkerEntry>) -> Result<(), DispatchError> {
        let s = ctx.s;
        if let Some(p) = self.committed.predicted.take() {
            p.settle(s);
        }
        s.record_failure(&self.worker);
        s.metrics.retries.inc();
        let dispatch = Dispatch {
            pool: crate::cluster::sync::Pool::Main,
            routed: &self.routed,
            worker: &served,
            uncached: self.uncached,
            decode: self.decode,
            index: true,
            seen: None,
        };
        self.committed = dispatch::commit(ctx, &ctx.view(), dispatch)?;
        self.observe = None;
        self.slot = None;
        self.worker = served;
        super::ctx::note_worker(&self.worker.url, self.branch);
        Ok(())
    }

    /// The accounting of the answer, from the request's arrival `t0`.
    pub(crate) fn into_guard(self, s: &Arc<crate::app::AppState>, t0: Instant) -> StreamGuard {
        let Picked { worker, committed, permit, branch, record, observe, slot, .. } = self;
        StreamGuard::observed(s, t0, worker, committed, Held { permit, branch, record, observe, slot })
    }
}
