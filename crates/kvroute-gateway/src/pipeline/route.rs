//! Stages 3 and 4: admission, then the decision. Admission runs first and a decision
//! changes nothing, so a request answered 503 — or a `POST /debug/route` dry run — leaves
//! every prefix index, session table and load counter as it was.

use super::ctx::RequestCtx;
use super::keys::Precise;
use crate::app::AppState;
use crate::fleet::Candidates;
use crate::routers::ModelRouter;
use axum::http::StatusCode;
use kvroute_core::admission::Permit;
use kvroute_core::hash::{HashAlgo, hash_token_blocks};
use kvroute_core::policy::{Decision, Fallbacks, MatchUnit, PickCtx, RequestKey, fallbacks};
use kvroute_core::types::{BlockHash, Role, WorkerId};
use kvroute_protocol::api_error::ApiError;
use kvroute_protocol::openai::RoutingInfo;
use std::sync::Arc;
use std::time::Instant;

/// The model a request is admitted and routed under (the key of its admission limit, its
/// router and their metric series): the model it names when a worker lists that model;
/// `*` when only workers that list no models (they serve any name) can take it; for a
/// request that names none (SGLang `/generate`), the one model the fleet serves, else `*`.
/// So a client cannot open a fresh admission limit, router and metric series per made-up
/// model name, and a request that no worker can serve is refused before any of them is
/// touched.
///
/// # Errors
/// 404 naming `model` when no worker serves the named model; 400 naming `model` when the
/// request names none and the fleet serves several.
pub fn model_of(s: &AppState, info: &RoutingInfo) -> Result<String, ApiError> {
    if !info.model.is_empty() {
        let workers = s.fleet.load();
        if workers.iter().any(|w| w.models().contains(&info.model)) {
            return Ok(info.model.clone());
        }
        if workers.is_empty() || workers.iter().any(|w| w.models().is_empty()) {
            return Ok("*".into());
        }
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("model `{}` is not served by any worker", info.model),
        )
        .with_param("model"));
    }
    let models = s.fleet.models();
    match models.as_slice() {
        [] => Ok("*".into()),
        [one] => Ok(one.clone()),
        _ => Err(ApiError::bad_field(
            "model",
            format!("this router serves several models ({}); name one in `model`", models.join(", ")),
        )),
    }
}

/// A permit for `model`, or 503 with `Retry-After` when its in-flight limit is reached.
///
/// # Errors
/// 503 when the model is at its limit.
pub fn admit(s: &AppState, model: &str) -> Result<Permit, ApiError> {
    admit_as(s, model, Role::Both)
}

/// A permit for `model` in `role`'s pool (disaggregation admits each phase of a split
/// request against its own limit), or 503 with `Retry-After`.
///
/// # Errors
/// 503 when (model, role) is at its limit.
pub fn admit_as(s: &AppState, model: &str, role: Role) -> Result<Permit, ApiError> {
    let permit = {
        let adm = s.admission.read();
        match adm.try_admit(model, role) {
            Err(rej) if rej.max == 0 => {
                drop(adm);
                s.admission.write().ensure_model(model);
                s.admission.read().try_admit(model, role)
            }
            other => other,
        }
    };
    permit.map_err(|rej| {
        s.metrics.admission_rejections.get_or_create(&crate::metrics::ModelLabel { model: model.to_string() }).inc();
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            if role == Role::Both {
                format!("too many requests in flight for model `{model}` (limit {}); retry later", rej.max)
            } else {
                format!(
                    "too many {} requests in flight for model `{model}` (limit {}); retry later",
                    role.as_str(),
                    rej.max
                )
            },
        )
        .retry_after(1)
    })
}

/// A decision with everything later stages need to commit it.
#[derive(Debug)]
pub struct Routed {
    /// The policy's decision.
    pub decision: Decision,
    /// The request's key for the policy (block hashes computed once).
    pub key: RequestKey,
    /// The model's router (commits go to it).
    pub router: Arc<ModelRouter>,
    /// The candidate workers.
    pub candidates: Candidates,
    /// Whether the chosen worker's prefix state was precise (KV events).
    pub chosen_precise: bool,
    /// Whether the chosen worker's prefix state was its llama.cpp slots' record
    /// (`llama_slot_routing`).
    pub chosen_slots: bool,
    /// The request's engine block hashes per engine block size (precise workers only), for
    /// predict-on-route at commit.
    pub engine_blocks: Vec<(u32, Arc<[BlockHash]>)>,
    /// The request's prompt as llama.cpp slots hold it (`llama_slot_routing` with a
    /// candidate that has slots), for the slot choice at dispatch.
    pub slot_key: Option<SlotKey>,
}

/// A request's prompt for [`kvroute_core::slots::SlotTable`]: chained hashes of its
/// `block_tokens`-token blocks (engine tokens when known, else text chunks), at most
/// [`kvroute_core::slots::MAX_SLOT_BLOCKS`].
#[derive(Debug, Clone)]
pub struct SlotKey {
    /// Block hashes.
    pub blocks: Vec<BlockHash>,
    /// Tokens per block.
    pub block_tokens: u32,
    /// Prompt tokens (exact or estimated).
    pub input_tokens: u32,
}

/// Block size of [`SlotKey`], tokens.
pub const SLOT_BLOCK_TOKENS: u32 = 16;

/// With `llama_slot_routing`, sets each slotted worker's `cached_tokens` (unless its KV
/// events set it) to what the slot the request would take there holds of it, and returns
/// the request's slot key; `None` when no candidate has slots. With the KV mover, a worker
/// whose chosen slot is idle is credited with the saved prefix of `model` the mover would
/// restore there ([`crate::kv_move::KvMover::restorable_blocks`]): the policy sees every
/// idle slot as able to hold a saved prefix, and spreads a hot one past its busy holder.
fn slot_cached_tokens(
    s: &AppState,
    req: &kvroute_core::RequestView<'_>,
    model: &str,
    c: &mut Candidates,
) -> Option<SlotKey> {
    if s.cfg.llama_slot_routing == crate::config::SlotRouting::Off {
        return None;
    }
    let mut key: Option<SlotKey> = None;
    let mut file: Option<Option<kvroute_core::kv_migration::FileMatch>> = None;
    for (v, e) in c.views.iter_mut().zip(c.entries.iter()) {
        if !e.slot_routing() {
            continue;
        }
        let slots = e.slots.lock();
        let Some(t) = slots.as_ref() else { continue };
        // Hashed once, at the first candidate with slots.
        let k = key.get_or_insert_with(|| {
            let mut blocks = Vec::new();
            kvroute_core::hash::request_blocks(
                req,
                SLOT_BLOCK_TOKENS as usize,
                kvroute_core::slots::MAX_SLOT_BLOCKS,
                HashAlgo::Xxh3,
                &mut blocks,
            );
            let block_tokens = req.blocks.map_or(SLOT_BLOCK_TOKENS, |b| b.block_tokens);
            SlotKey { blocks, block_tokens, input_tokens: req.input_tokens }
        });
        if v.cached_tokens.is_none() {
            // With the KV mover: the saved prefix it would restore into an idle slot here
            // (the file looked up once per request).
            let restorable = s.kv_mover.as_ref().map_or(0, |m| {
                let f = file.get_or_insert_with(|| m.best_file(model, &k.blocks));
                f.as_ref().map_or(0, |f| m.restorable_blocks(e, f, k.block_tokens))
            });
            let choice = t.choose_with_restore(&k.blocks, k.block_tokens, k.input_tokens, restorable);
            let held = if choice.waits { choice.cached_blocks } else { choice.cached_blocks.max(restorable) };
            let tokens = held as u64 * u64::from(k.block_tokens);
            v.cached_tokens = Some(tokens.min(u64::from(k.input_tokens)));
        }
    }
    key
}

/// CPU time the calling thread has used, seconds (`CLOCK_THREAD_CPUTIME_ID`). The difference
/// of two readings on one thread is its work between them, without the time it was
/// descheduled: a decision is synchronous, so both readings are on the deciding thread.
fn thread_cpu_seconds() -> f64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// Decides for the request (no side effect): candidates from the fleet snapshot, the
/// engine-reported cached tokens of precise workers, then the model's router.
///
/// # Errors
/// 404 for a model no worker serves, 503 when no worker is routable, 429 when `capped`
/// refuses a session past its `max_turns`.
pub fn decide(ctx: &RequestCtx<'_>) -> Result<Routed, ApiError> {
    decide_in(ctx, &ctx.s.routers, None)
}

/// [`decide`] with `routers` over the workers of `roles` (`None`: every role): one pool of
/// a disaggregated fleet.
///
/// # Errors
/// As [`decide`].
pub fn decide_in(
    ctx: &RequestCtx<'_>,
    routers: &crate::routers::Routers,
    roles: Option<&[Role]>,
) -> Result<Routed, ApiError> {
    let (s, model, precise) = (&**ctx.s, ctx.model.as_str(), &ctx.precise);
    if let Some(routed) = decide_kept(ctx, routers, roles) {
        return routed;
    }
    let mut candidates = candidates_for(ctx, roles)?;
    let engine_blocks = precise_cached_tokens(s, precise, &mut candidates);
    let req = ctx.view();
    let from_events: Vec<WorkerId> =
        candidates.views.iter().filter(|v| v.cached_tokens.is_some()).map(|v| v.id).collect();
    let slot_key = slot_cached_tokens(s, &req, &ctx.model, &mut candidates);
    let router = routers.get(model, s.now());
    let mut rng = routers.rng();
    let mut ctx = PickCtx { now: s.now(), rng: &mut rng, fleet: None };
    let (decision, key) = decide_observed(s, &router, &req, &candidates.views, &mut ctx).map_err(route_error)?;
    let chosen_precise = from_events.contains(&decision.worker);
    let chosen_slots =
        !chosen_precise && candidates.views.iter().any(|v| v.id == decision.worker && v.cached_tokens.is_some());
    Ok(Routed { decision, key, router, candidates, chosen_precise, chosen_slots, engine_blocks, slot_key })
}

/// [`decide_in`] on the views the model's workers keep between requests
/// ([`crate::fleet::Fleet::decide_kept`]) and their digest (read by the policies that read
/// one, [`kvroute_core::Policy::fleet_digest`]), when nothing narrows or rewrites the
/// candidates' views for this request — every role, no subset hint, no
/// `max_ongoing_requests` cap, no locality preference, no llama.cpp slot routing, no KV
/// events — so the decision is the one a read of every view would give.
/// `None`: decide on a fresh read of the candidates instead (also when no worker is
/// routable, or every kept copy is busy).
fn decide_kept(
    ctx: &RequestCtx<'_>,
    routers: &crate::routers::Routers,
    roles: Option<&[Role]>,
) -> Option<Result<Routed, ApiError>> {
    let (s, model) = (&**ctx.s, ctx.model.as_str());
    let plain = roles.is_none()
        && ctx.subset.is_none()
        && s.cfg.max_ongoing_requests == 0
        && !s.cfg.locality.active()
        && s.cfg.llama_slot_routing == crate::config::SlotRouting::Off
        && !matches!(ctx.precise, Precise::Tokens(_));
    if !plain {
        return None;
    }
    let router = routers.get(model, s.now());
    let (owner, digest) = router.kept_digest();
    let req = ctx.view();
    let lookup = lookup_model(ctx);
    let mut rng = routers.rng();
    let now = s.now();
    let (decided, candidates) = s.fleet.decide_kept(lookup, owner, digest, |views, digest| {
        let mut pick = PickCtx { now, rng: &mut rng, fleet: Some(digest) };
        let decided = decide_observed(s, &router, &req, views, &mut pick);
        let chosen = decided.as_ref().ok().map(|(d, _)| d.worker);
        (decided, chosen)
    })?;
    Some(decided.map_err(route_error).map(|(decision, key)| Routed {
        decision,
        key,
        router: Arc::clone(&router),
        candidates,
        chosen_precise: false,
        chosen_slots: false,
        engine_blocks: Vec::new(),
        slot_key: None,
    }))
}

/// `router`'s decision on `views`, timed into the decision histograms — wall clock
/// (`kvroute_decision_seconds`), the deciding thread's CPU time (`_cpu_seconds`) and the
/// wait for a copy of the policy (`_lock_wait_seconds`) — and its match rate observed when
/// it decides on a key.
fn decide_observed(
    s: &AppState,
    router: &ModelRouter,
    req: &kvroute_core::RequestView<'_>,
    views: &[kvroute_core::WorkerView],
    ctx: &mut PickCtx<'_>,
) -> Result<(Decision, RequestKey), kvroute_core::policy::RouteError> {
    // The CPU clock is a system call (~0.5 µs here): read outside the wall-clock span, so
    // the wall time is the decision's alone and the CPU time carries the clock's own cost.
    let cpu0 = thread_cpu_seconds();
    let t0 = Instant::now();
    let (decided, lock_wait) = router.decide_timed(req, views, ctx);
    let wall = t0.elapsed().as_secs_f64();
    s.metrics.decision_lock_wait_seconds.observe(lock_wait);
    s.metrics.decision_cpu_seconds.observe((thread_cpu_seconds() - cpu0).max(0.0));
    s.metrics.decision_seconds.observe(wall);
    if let Ok((d, _)) = &decided
        && d.key_len > 0
    {
        s.metrics.match_rate.observe(d.match_rate());
    }
    decided
}

/// The policy's refusal as the client sees it.
fn route_error(e: kvroute_core::policy::RouteError) -> ApiError {
    match e {
        kvroute_core::policy::RouteError::NoWorker => {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "no healthy worker available").retry_after(1)
        }
        // B3's capped workload, live: the session is over; retrying will not help.
        capped @ kvroute_core::policy::RouteError::SessionCapped { .. } => {
            ApiError::new(StatusCode::TOO_MANY_REQUESTS, capped.to_string())
        }
    }
}

/// The model name the request's candidates are looked up by: the one it names (workers
/// listing no models serve any), none for the catch-all `*`, else its routing model.
fn lookup_model<'a>(ctx: &'a RequestCtx<'_>) -> &'a str {
    if !ctx.info.model.is_empty() {
        ctx.info.model.as_str()
    } else if ctx.model == "*" {
        ""
    } else {
        ctx.model.as_str()
    }
}

/// The request's candidates: the workers of `roles` serving its model, within the
/// gateway's subset hint (endpoint picker) and under `max_ongoing_requests`.
///
/// # Errors
/// 404 for a model no worker serves; 503 when none is left (no worker registered, none of
/// the subset, every one at its cap).
fn candidates_for(ctx: &RequestCtx<'_>, roles: Option<&[Role]>) -> Result<Candidates, ApiError> {
    let (s, info) = (&**ctx.s, &ctx.info);
    let lookup = lookup_model(ctx);
    let mut candidates = s.fleet.candidates_in(lookup, roles);
    if let Some(subset) = ctx.subset {
        // The gateway's subset hint (endpoint-picker protocol): none of it eligible is 503.
        candidates.retain(|w| w.authority().is_some_and(|a| subset.iter().any(|s| s == a)));
        if candidates.entries.is_empty() {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "no worker serving model `{}` is among the gateway's {} allowed endpoints \
                     (x-gateway-destination-endpoint-subset)",
                    info.model,
                    subset.len()
                ),
            )
            .retry_after(1));
        }
    }
    if s.cfg.max_ongoing_requests > 0 && !candidates.entries.is_empty() {
        // Ray Serve's max_ongoing_requests: a worker at its cap takes no more.
        let cap = s.cfg.max_ongoing_requests;
        candidates.retain(|w| w.load.get().in_flight.saturating_add(w.remote_load.get().in_flight) < cap);
        if candidates.entries.is_empty() {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("every worker serving model `{}` has max_ongoing_requests ({cap}) in flight", info.model),
            )
            .retry_after(1));
        }
    }
    if s.cfg.locality.active() {
        prefer_local(&mut candidates);
    }
    if candidates.entries.is_empty() {
        if let Some(r) = roles {
            let names: Vec<&str> = r.iter().map(|r| r.as_str()).collect();
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("no {} worker serves model `{}`", names.join(" or "), info.model),
            )
            .retry_after(1));
        }
        return Err(if !s.fleet.load().is_empty() && !info.model.is_empty() {
            ApiError::new(StatusCode::NOT_FOUND, format!("model `{}` is not served by any worker", info.model))
                .with_param("model")
        } else {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "no worker is registered")
        });
    }
    Ok(candidates)
}

/// Ray Serve's `LocalityMixin`: the candidates on this router's node when one of them is
/// routable, else those in its zone when one is, else all of them. A worker at its
/// `max_ongoing_requests` cap was taken out before, so a full node passes the request on
/// to the zone as Ray's next attempt does.
fn prefer_local(c: &mut Candidates) {
    use crate::model::locality::Locality;
    let best = c
        .entries
        .iter()
        .zip(&c.views)
        .filter(|(_, v)| v.is_routable())
        .map(|(e, _)| e.locality())
        .min()
        .unwrap_or(Locality::Other);
    if best < Locality::Other {
        c.retain(|e| e.locality() <= best);
    }
}

/// Sets each precise worker's `cached_tokens` in its view from the KV-event index and
/// returns the request's engine block hashes per block size (hashed once per size, outside
/// the index lock so a long prompt does not hold up the event subscribers).
fn precise_cached_tokens(s: &AppState, precise: &Precise, c: &mut Candidates) -> Vec<(u32, Arc<[BlockHash]>)> {
    let Precise::Tokens(tokens) = precise else { return Vec::new() };
    let sizes: Vec<(Option<u32>, bool)> = {
        let ix = s.precise.read();
        c.views.iter().map(|v| (ix.block_size(v.id), ix.is_tracked(v.id))).collect()
    };
    let mut by_size: Vec<(u32, Arc<[BlockHash]>)> = Vec::new();
    for bs in sizes.iter().filter_map(|x| x.0) {
        if !by_size.iter().any(|(b, _)| *b == bs) {
            let mut h = Vec::new();
            hash_token_blocks(tokens, bs as usize, usize::MAX, HashAlgo::Xxh3, &mut h);
            by_size.push((bs, h.into()));
        }
    }
    for (v, (bs, tracked)) in c.views.iter_mut().zip(&sizes) {
        // Tracked but no BlockStored yet: the cache is empty as far as we know.
        v.cached_tokens = (bs.is_none() && *tracked).then_some(0);
    }
    // Each block size's workers in one pass over the request's blocks (one index lookup a
    // block for all of them, not one per worker and block).
    let ix = s.precise.read();
    let now = s.now();
    let mut cached = Vec::new();
    for (bs, hashes) in &by_size {
        let at: Vec<usize> = sizes.iter().enumerate().filter(|(_, x)| x.0 == Some(*bs)).map(|(i, _)| i).collect();
        let ids: Vec<WorkerId> = at.iter().map(|&i| c.views[i].id).collect();
        ix.cached_tokens_many(&ids, hashes, *bs, now, &mut cached);
        for (&i, t) in at.iter().zip(&cached) {
            c.views[i].cached_tokens = *t;
        }
    }
    by_size
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

/// The worker ids to try, in order: the chosen worker, then the fallbacks
/// ([`kvroute_core::policy::fallbacks`] over the views the decision read).
pub fn order(routed: &Routed) -> impl Iterator<Item = WorkerId> + '_ {
    let d = &routed.decision;
    std::iter::once(d.worker).chain(fallbacks(d, &routed.candidates.decided_views()))
}

/// [`order`], taken lazily: the fallbacks are worked out (a pass over the candidates
/// unless the policy ordered its own) only when something past the chosen worker is asked
/// for, so a request its chosen worker serves pays nothing for them.
pub struct RetryOrder<'a> {
    routed: &'a Routed,
    rest: Option<Fallbacks>,
}

impl<'a> RetryOrder<'a> {
    /// The order of `routed`'s decision, nothing worked out yet.
    pub fn new(routed: &'a Routed) -> Self {
        RetryOrder { routed, rest: None }
    }

    /// The fallbacks (positions 1 and on), worked out on first use.
    fn rest(&mut self) -> &[WorkerId] {
        let routed = self.routed;
        self.rest.get_or_insert_with(|| fallbacks(&routed.decision, &routed.candidates.decided_views()))
    }

    /// The worker at position `i` (0: the chosen one), `None` past the end.
    pub fn get(&mut self, i: usize) -> Option<WorkerId> {
        match i {
            0 => Some(self.routed.decision.worker),
            _ => self.rest().get(i - 1).copied(),
        }
    }

    /// The workers from position `i` on (`i` ≥ 1).
    pub fn from(&mut self, i: usize) -> &[WorkerId] {
        let rest = self.rest();
        &rest[i.saturating_sub(1).min(rest.len())..]
    }

    /// Whether a worker from the `i`-th on is still routable.
    pub fn any_routable_from(&mut self, i: usize) -> bool {
        let candidates = &self.routed.candidates;
        self.from(i).iter().any(|o| candidates.entry(*o).is_some_and(|x| x.is_routable()))
    }
}
