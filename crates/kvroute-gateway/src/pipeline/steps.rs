//! The stages from load to respond for one parsed request ([`route_and_send`]; once per
//! cascade step): load a LoRA adapter, the routing key, then either a prefill/decode split
//! ([`super::pd`]) or one worker: admit, decide, dispatch (deciding again when it raced
//! another request to the same worker), respond.

use super::ctx::RequestCtx;
use super::{dispatch, keys, lora, pd, respond, route};
use axum::response::Response;
use kvroute_core::types::Role;
use kvroute_protocol::api_error::ApiError;

/// Times a decision is made again when a request was dispatched to its worker while it
/// was being made (the last one stands, raced or not): a burst of requests arriving
/// together, decided in parallel on the same loads, would otherwise pile onto the least
/// loaded worker.
pub const MAX_REDECISIONS: usize = 2;

/// The stages from load to respond for one parsed request (once per cascade step).
///
/// # Errors
/// The stage's error, with the decision's branch once there is one.
pub async fn route_and_send(ctx: &mut RequestCtx<'_>) -> Result<Response, (ApiError, &'static str)> {
    let s = ctx.s;
    lora::ensure_loaded(s, &ctx.info.model).await.map_err(|e| (e, ""))?;
    key(ctx).await.map_err(|e| (e, ""))?;
    if let Some(p) = &s.pd {
        return match pd::placement(s, p, &ctx.info, &ctx.model) {
            pd::Placement::Split => pd::split(ctx, p).await,
            pd::Placement::Colocated { routers, roles, role } => {
                crate::metrics::count_outcome(&s.metrics.pd_requests, "colocated");
                let pool = Pool { routers, roles: Some(roles), role, header: "pd=colocated; " };
                let bytes = pd::without_handover_fields(&ctx.bytes);
                ctx.set_bytes(bytes);
                one_worker(ctx, pool).await
            }
        };
    }
    let pool = Pool { routers: &s.routers, roles: None, role: Role::Both, header: "" };
    one_worker(ctx, pool).await
}

/// The key stage: the engine's token ids (local tokenizer, worker `/tokenize`), the routing
/// key salted for the tenant, and the model the request is routed for.
///
/// # Errors
/// 404 for a model no worker serves.
pub async fn key(ctx: &mut RequestCtx<'_>) -> Result<(), ApiError> {
    ctx.precise = keys::resolve(ctx).await;
    if let Some(salt) = ctx.salt {
        crate::tenant::salt_routing_key(&mut ctx.info, salt);
    }
    ctx.model = route::model_of(ctx.s, &ctx.info)?;
    Ok(())
}

/// Where a request served by one worker is routed: a pool's routers and roles, the
/// admission role, and what the decision header starts with.
pub struct Pool<'a> {
    /// The pool's routers.
    pub routers: &'a crate::routers::Routers,
    /// The roles a worker may have to be a candidate (`None`: any).
    pub roles: Option<&'a [Role]>,
    /// The role admission counts the request under.
    pub role: Role,
    /// What the decision header starts with.
    pub header: &'static str,
}

/// Admit, decide, dispatch, respond: a request served by one worker.
async fn one_worker(ctx: &RequestCtx<'_>, pool: Pool<'_>) -> Result<Response, (ApiError, &'static str)> {
    let s = ctx.s;
    let permit = route::admit_as(s, &ctx.model, pool.role).map_err(|e| (e, ""))?;
    // Decisions run in parallel without a lock. One that raced another to the same worker
    // (a request was sent there after its view was read) sends nothing and is made again
    // on fresh views, at most MAX_REDECISIONS times; the last one stands.
    let mut redone = 0;
    let (routed, sent) = loop {
        let routed = route::decide_in(ctx, pool.routers, pool.roles).map_err(|e| (e, ""))?;
        let seen =
            (redone < MAX_REDECISIONS).then(|| routed.candidates.dispatches_seen(routed.decision.worker)).flatten();
        match dispatch::send(ctx, &routed, seen).await {
            Err(e) if e.blame == dispatch::Blame::Raced => {
                redone += 1;
                s.metrics.decisions_redone.inc();
            }
            sent => break (routed, sent),
        }
    };
    let branch = routed.decision.branch.as_str();
    let mut decision = decision_header(ctx, &routed, pool.header);
    if let Some(r) = sent.as_ref().ok().and_then(|x| x.slot.as_ref()).and_then(|h| h.restored) {
        // The KV mover read the prefix into the slot instead of recomputing it.
        decision.push_str(&format!("; kv_restore={}tok(gain={:.3}s)", r.gained_tokens, r.predicted_gain_secs));
    }
    log_decision(&routed, ctx, &decision);
    // Recorded from here on: every request dispatched, whatever its outcome (one refused
    // before any decision stood — unknown model, no routable worker — was not: it returned
    // above). Its timestamp is its arrival, `t0`.
    let record = begin_record(ctx);
    let sent = sent.map_err(|e| (ApiError::from(e), branch))?;
    respond::respond(ctx, respond::Answer { sent, permit, decision: &decision, branch, record })
        .map_err(|e| (e, branch))
}

/// The `x-kvroute-decision` value of a one-worker request (and its prefix source counted).
fn decision_header(ctx: &RequestCtx<'_>, routed: &route::Routed, prefix: &str) -> String {
    let (source, reason) = keys::prefix_source(&ctx.precise, routed.chosen_precise, routed.chosen_slots);
    ctx.s.metrics.prefix_source.get_or_create(&crate::metrics::SourceLabels { source, reason }).inc();
    let mut decision = String::from(prefix);
    decision.push_str(&route::decision_header(&routed.router.policy_name, &routed.decision));
    decision.push_str("; prefix=");
    decision.push_str(source);
    if !reason.is_empty() {
        decision.push_str(&format!("({reason})"));
    }
    decision
}

/// The recorder's line for this request, begun at its arrival (`record`).
pub(crate) fn begin_record(ctx: &RequestCtx<'_>) -> Option<crate::record::Pending> {
    let info = &ctx.info;
    ctx.s
        .recorder
        .as_ref()
        .map(|r| r.begin(ctx.t0, &info.text, info.token_ids.as_deref(), info.session.as_deref(), info.max_tokens))
}

/// The per-request decision log (`KVROUTE_LOG=kvroute::decision=debug`): enough to line up
/// one router's choices with another's or with the engines' logs.
fn log_decision(routed: &route::Routed, ctx: &RequestCtx<'_>, decision: &str) {
    tracing::debug!(
        target: "kvroute::decision",
        worker = routed.candidates.entry(routed.decision.worker).map_or("?", |w| &*w.url),
        session = ctx.info.session.as_deref().unwrap_or("-"),
        input_tokens = ctx.info.token_ids.as_ref().map_or(0, Vec::len),
        decision = %decision,
        "routed"
    );
}
