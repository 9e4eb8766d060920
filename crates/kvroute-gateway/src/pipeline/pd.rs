//! Prefill/decode disaggregation, the request stage ([`crate::pd`] has the configuration).
//!
//! A request longer than `colocate_below_tokens` whose model has a routable prefill and a
//! routable decode worker is split ([`kvroute_core::disagg::plan`]). Admission takes a
//! permit in each role's pool; each pool's router decides (pure), and each worker really
//! sent to is committed to its pool's router and gets a load ticket.
//!
//! - **SGLang**: the body gets `bootstrap_host` (the prefill worker's host),
//!   `bootstrap_port` (its bootstrap port, or null) and a random `bootstrap_room` (< 2^63),
//!   and goes to both workers at once. The decode worker's answer — streamed or not — is
//!   the client's; the prefill answer is drained in the background.
//! - **vLLM** (NIXL connector): the prefill worker gets the body with
//!   `kv_transfer_params: {"do_remote_decode": true, …}`, `max_tokens: 1`,
//!   `stream: false`; its answer's `kv_transfer_params` go into the original body, sent to
//!   the decode worker.
//!
//! Failures (nothing has reached the client before the decode worker's first byte):
//! a prefill worker that fails (connection error, 5xx, no answer within
//! `handshake_timeout_secs`, vLLM: no `kv_transfer_params`) is charged and the pair is
//! tried again with the next prefill worker; a decode worker that fails before its first
//! byte is charged and the pair is tried again with the next decode worker (and a new
//! room, so the prefill runs again — cheaply, its prefix is cached there now). Attempts of
//! one request are bounded by `max_total_retries`. After the first byte a failure ends the
//! stream with an SSE error event, as for any stream.

use super::ctx::RequestCtx;
use super::dispatch::{self, Blame, Dispatch, DispatchError, Failure, Hop, Sent};
use super::route::{self, Routed};
use crate::app::AppState;
use crate::cluster::sync::Pool;
use crate::fleet::WorkerEntry;
use crate::metrics::count_outcome;
use crate::pd::{PdProtocol, PdRouters};
use crate::routers::Routers;
use axum::body::Bytes;
use axum::http::StatusCode;
use axum::response::Response;
use kvroute_core::disagg::{DisaggConfig, DisaggPlan, plan};
use kvroute_core::types::{Role, estimate_tokens};
use kvroute_protocol::api_error::ApiError;
use kvroute_protocol::openai::{Api, RoutingInfo};
use serde_json::{Map, Value};
use std::sync::Arc;
use std::time::Duration;

/// Where a request runs in a disaggregated fleet.
#[derive(Debug)]
pub enum Placement<'a> {
    /// On one worker: the routers and roles of its pool, and the role it is admitted as.
    Colocated {
        /// The pool's routers.
        routers: &'a Routers,
        /// The pool's roles.
        roles: &'static [Role],
        /// The admission role.
        role: Role,
    },
    /// A prefill worker, then a decode worker.
    Split,
}

/// The placement of a request for `model` (see the module doc).
pub fn placement<'a>(s: &'a AppState, pd: &'a PdRouters, info: &RoutingInfo, model: &str) -> Placement<'a> {
    let lookup = if info.model.is_empty() && model != "*" { model } else { info.model.as_str() };
    let routable = |role: Role| s.fleet.load().iter().any(|w| w.role() == role && w.is_routable() && w.serves(lookup));
    let tokens = info.token_ids.as_ref().map_or_else(|| estimate_tokens(&info.text), |t| t.len() as u32);
    let cfg = DisaggConfig { enabled: true, colocate_below_tokens: pd.cfg.colocate_below_tokens };
    match plan(&cfg, tokens, routable(Role::Prefill), routable(Role::Decode)) {
        DisaggPlan::Split => Placement::Split,
        DisaggPlan::Colocated if routable(Role::Both) || !routable(Role::Decode) => {
            Placement::Colocated { routers: &s.routers, roles: &[Role::Both], role: Role::Both }
        }
        DisaggPlan::Colocated => {
            Placement::Colocated { routers: &pd.decode, roles: &[Role::Decode], role: Role::Decode }
        }
    }
}

/// Fields only the router may set on a disaggregated fleet's requests.
const HANDOVER_FIELDS: [&str; 4] = ["kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room"];

/// The body without a client's own hand-over fields (a `kv_transfer_params` naming a
/// remote host would make a vLLM decode worker fetch from it): untouched, and not parsed,
/// when it names none.
pub fn without_handover_fields(bytes: &Bytes) -> Bytes {
    let text = String::from_utf8_lossy(bytes);
    if !HANDOVER_FIELDS.iter().any(|f| text.contains(f)) {
        return bytes.clone();
    }
    match serde_json::from_slice::<Map<String, Value>>(bytes) {
        Ok(mut m) => {
            let before = m.len();
            for f in HANDOVER_FIELDS {
                m.remove(f);
            }
            if m.len() == before {
                return bytes.clone();
            }
            serde_json::to_vec(&m).map(Bytes::from).unwrap_or_else(|_| bytes.clone())
        }
        Err(_) => bytes.clone(),
    }
}

/// Serves a split request: admission in both pools, both decisions, the pair's dispatch
/// with its retries, then the decode worker's answer to the client.
///
/// # Errors
/// 503 when a pool is at its admission limit or has no routable worker; the dispatch's
/// error otherwise (502 every pair failed, 504 a timeout).
pub async fn split(ctx: &RequestCtx<'_>, pd: &PdRouters) -> Result<Response, (ApiError, &'static str)> {
    let s = ctx.s;
    let permit_p = route::admit_as(s, &ctx.model, Role::Prefill).map_err(|e| (e, ""))?;
    let permit_d = route::admit_as(s, &ctx.model, Role::Decode).map_err(|e| (e, ""))?;
    let rp = route::decide_in(ctx, &pd.prefill, Some(&[Role::Prefill])).map_err(|e| (e, ""))?;
    let rd = route::decide_in(ctx, &pd.decode, Some(&[Role::Decode])).map_err(|e| (e, ""))?;
    let branch = rd.decision.branch.as_str();
    count_outcome(&s.metrics.pd_requests, "split");
    let mut body =
        ctx.object().cloned().ok_or_else(|| (ApiError::bad_field("body", "not a JSON object".to_string()), ""))?;
    for f in HANDOVER_FIELDS {
        body.remove(f);
    }
    let record = super::steps::begin_record(ctx);
    let pair = Pair { ctx, pd, rp: &rp, rd: &rd, body: &body };
    let (sent, prefill_url) = pair.run(permit_p).await.map_err(|e| (ApiError::from(e), branch))?;
    let decision = format!(
        "pd=prefill:{},decode:{}; policy={}+{}; branch={}+{}; matched={}/{}",
        prefill_url,
        sent.worker.url,
        rp.router.policy_name,
        rd.router.policy_name,
        rp.decision.branch.as_str(),
        branch,
        rp.decision.matched,
        rp.decision.key_len
    );
    tracing::debug!(target: "kvroute::decision", decision = %decision, "routed (split)");
    let answer = super::respond::Answer { sent, permit: permit_d, decision: &decision, branch, record };
    super::respond::respond(ctx, answer).map_err(|e| (e, branch))
}

/// One split request's two decisions and its body, for the pair attempts.
struct Pair<'a> {
    ctx: &'a RequestCtx<'a>,
    pd: &'a PdRouters,
    rp: &'a Routed,
    rd: &'a Routed,
    body: &'a Map<String, Value>,
}

/// Why an SGLang prefill request failed (the decode half then waits for KV that never comes).
#[derive(Debug, thiserror::Error)]
enum PrefillError {
    /// The prefill worker answered with a non-success status.
    #[error("{url}: prefill answered {status}")]
    Status {
        /// The prefill worker.
        url: String,
        /// Its answer's status.
        status: reqwest::StatusCode,
    },
    /// The request failed on the way (connection, stream, an oversized answer): the
    /// dispatcher's message, naming the worker.
    #[error("{0}")]
    Transport(String),
    /// No complete answer within the handshake timeout.
    #[error("{url}: no prefill answer within the {handshake:?} handshake timeout")]
    Late {
        /// The prefill worker.
        url: String,
        /// The handshake timeout.
        handshake: Duration,
    },
}

/// How one pair attempt ended.
enum PairError {
    /// The prefill worker failed: try the next one.
    Prefill(String),
    /// The decode worker failed before its first byte: try the next one.
    Decode(String),
    /// Not retried (a timeout of the client's budget, a client error, an oversized answer).
    Final(DispatchError),
}

impl Pair<'_> {
    /// Tries pairs until one answers; returns the decode worker's answer and the prefill
    /// worker's URL.
    async fn run(&self, permit_p: kvroute_core::admission::Permit) -> Result<(Sent, String), DispatchError> {
        let s = self.ctx.s;
        let prefill: Vec<Arc<WorkerEntry>> =
            route::order(self.rp).filter_map(|id| self.rp.candidates.entry(id).cloned()).collect();
        let decode: Vec<Arc<WorkerEntry>> =
            route::order(self.rd).filter_map(|id| self.rd.candidates.entry(id).cloned()).collect();
        let req = self.ctx.view();
        let uncached =
            u64::from(req.input_tokens).saturating_sub(self.rp.decision.cached_tokens_estimate(req.input_tokens));
        let output = u64::from(self.ctx.info.max_tokens.unwrap_or(256));
        let total = s.cfg.max_total_retries.max(1);
        let permit_p = Arc::new(permit_p);
        let (mut pi, mut di, mut attempts) = (0usize, 0usize, 0u32);
        let mut committed: Vec<(bool, kvroute_core::types::WorkerId)> = Vec::new();
        let mut last = String::from("no routable worker was left to try");
        while pi < prefill.len() && di < decode.len() && attempts < total {
            let (pw, dw) = (&prefill[pi], &decode[di]);
            if attempts > 0 {
                s.metrics.retries.inc();
                if !pw.is_routable() {
                    pi += 1;
                    continue;
                }
                if !dw.is_routable() {
                    di += 1;
                    continue;
                }
            }
            attempts += 1;
            // A failure is counted on the decode worker, as the answer is (on the prefill
            // worker when its half failed).
            super::ctx::note_worker(&dw.url, self.rd.decision.branch.as_str());
            // Both halves are committed (the other replicas of the cluster see both pools'
            // prefix and load); only the prefill worker's cache gains the prompt, the decode
            // pool's router records it too (its policy is load-aware by default). The
            // prefill half is done when its answer is, the decode half with the response.
            let mut half = |pool: Pool, routed: &Routed, w: &WorkerEntry, uncached: u64, decode: u64| {
                let first = !committed.contains(&(pool == Pool::Prefill, w.id));
                if first {
                    committed.push((pool == Pool::Prefill, w.id));
                }
                let d = Dispatch { pool, routed, worker: w, uncached, decode, index: first, seen: None };
                dispatch::commit(self.ctx, &req, d)
            };
            let p_half = half(Pool::Prefill, self.rp, pw, uncached, 1)?;
            let d_half = half(Pool::Decode, self.rd, dw, 0, output)?;
            let result = match self.pd.cfg.protocol {
                PdProtocol::Sglang => self.sglang(pw, dw, p_half, Arc::clone(&permit_p)).await,
                PdProtocol::Vllm => self.vllm(pw, dw, p_half).await,
            };
            match result {
                Ok((resp, body, first_byte_by)) => {
                    return Ok((decode_answer(dw, d_half, (resp, body), first_byte_by), pw.url.to_string()));
                }
                Err(PairError::Prefill(e)) => {
                    tracing::warn!(worker = %pw.url, error = %e, "pd: prefill failed; trying the next prefill worker");
                    count_outcome(&s.metrics.pd_failures, "prefill");
                    // Should no pair serve it, the request failed on this worker.
                    super::ctx::note_worker(&pw.url, self.rp.decision.branch.as_str());
                    last = e;
                    pi += 1;
                }
                Err(PairError::Decode(e)) => {
                    tracing::warn!(worker = %dw.url, error = %e, "pd: decode failed before its first byte; trying the next decode worker");
                    count_outcome(&s.metrics.pd_failures, "decode");
                    last = e;
                    di += 1;
                }
                Err(PairError::Final(e)) => return Err(e),
            }
        }
        Err(DispatchError::exhausted(
            attempts,
            format!("every prefill/decode pair failed ({attempts} tried, {total} at most); last error: {last}"),
        ))
    }

    fn handshake(&self) -> Duration {
        Duration::from_secs_f64(self.pd.cfg.handshake_timeout_secs)
    }

    fn first_byte_by(&self) -> Option<tokio::time::Instant> {
        self.ctx.first_byte_by()
    }

    /// The decode attempt: the worker's answer (for a stream, its headers; else the whole
    /// body).
    async fn decode(
        &self,
        dw: &WorkerEntry,
        bytes: &Bytes,
        first_byte_by: Option<tokio::time::Instant>,
    ) -> Result<(reqwest::Response, Option<Bytes>), PairError> {
        let s = self.ctx.s;
        let timeout = Duration::from_secs_f64(s.cfg.request_timeout_secs);
        let answer = match dispatch::attempt(self.ctx.hop(), dw, bytes, timeout, first_byte_by).await {
            Ok(resp) if self.ctx.info.stream && resp.status().is_success() => Ok((resp, None)),
            Ok(resp) => dispatch::read_whole(resp).await,
            Err(f) => Err(f),
        };
        match answer {
            Ok(a) => Ok(a),
            // Charged by the caller, once it knows the prefill worker was not the cause.
            Err(Failure::Retry(e) | Failure::Closed(e)) => Err(PairError::Decode(e)),
            Err(Failure::Timeout { first_byte }) => {
                s.record_failure(dw);
                let what = if first_byte { "sent no response in time" } else { "did not answer in time" };
                Err(PairError::Final(DispatchError {
                    blame: Blame::Worker,
                    retryable: false,
                    bytes_sent: false,
                    status: StatusCode::GATEWAY_TIMEOUT,
                    message: format!("decode worker {} {what}", dw.url),
                }))
            }
            Err(Failure::TooLarge(e)) => Err(PairError::Final(DispatchError {
                blame: Blame::Worker,
                retryable: false,
                bytes_sent: false,
                status: StatusCode::BAD_GATEWAY,
                message: format!("{}: {e}", dw.url),
            })),
        }
    }

    /// SGLang: the same body, with the bootstrap fields, to both workers at once.
    async fn sglang(
        &self,
        pw: &Arc<WorkerEntry>,
        dw: &Arc<WorkerEntry>,
        p_half: dispatch::Committed,
        permit_p: Arc<kvroute_core::admission::Permit>,
    ) -> Result<(reqwest::Response, Option<Bytes>, Option<tokio::time::Instant>), PairError> {
        let s = self.ctx.s;
        let dispatch::Committed { ticket: p_ticket, shared: shared_p, .. } = p_half;
        let room = crate::model::random::os_random_u64() >> 1;
        let host = reqwest::Url::parse(&pw.url).ok().and_then(|u| u.host_str().map(str::to_string)).unwrap_or_default();
        let mut body = self.body.clone();
        body.insert("bootstrap_host".into(), Value::String(host));
        body.insert("bootstrap_port".into(), pw.bootstrap_port.get().map_or(Value::Null, Value::from));
        body.insert("bootstrap_room".into(), Value::from(room));
        let bytes = Bytes::from(serde_json::to_vec(&body).unwrap_or_default());
        // The prefill request runs on its own task: once the decode answer is the client's,
        // the prefill answer is drained there, bounded by the handshake timeout.
        let prefill = tokio::spawn(sglang_prefill(
            SglangPrefill {
                s: Arc::clone(s),
                pw: Arc::clone(pw),
                bytes: bytes.clone(),
                headers: self.ctx.headers.clone(),
                api: self.ctx.api,
                handshake: self.handshake(),
            },
            (permit_p, shared_p),
            p_ticket,
        ));
        let first_byte_by = self.first_byte_by();
        let decode = self.decode(dw, &bytes, first_byte_by);
        tokio::pin!(decode);
        let mut prefill = prefill;
        tokio::select! {
            biased;
            p = &mut prefill => match p {
                Ok(Ok(())) => match decode.await {
                    Ok((r, b)) => Ok((r, b, first_byte_by)),
                    Err(e) => {
                        if matches!(e, PairError::Decode(_)) {
                            s.record_failure(dw);
                        }
                        Err(e)
                    }
                },
                // The decode worker would wait for KV that never comes: drop it, retry.
                Ok(Err(e)) => Err(PairError::Prefill(e.to_string())),
                Err(e) => Err(PairError::Prefill(format!("prefill task: {e}"))),
            },
            d = &mut decode => match d {
                // A decode worker fails when its prefill worker did (the KV never came):
                // charge the prefill worker when its answer says so.
                Err(PairError::Decode(e)) => match tokio::time::timeout(Duration::from_secs(1), &mut prefill).await {
                    Ok(Ok(Err(pe))) => Err(PairError::Prefill(pe.to_string())),
                    _ => {
                        s.record_failure(dw);
                        Err(PairError::Decode(e))
                    }
                },
                other => other.map(|(r, b)| (r, b, first_byte_by)),
            },
        }
    }

    /// The vLLM prefill worker's body: the request with `do_remote_decode`, one token, not
    /// streamed.
    fn vllm_prefill_body(&self) -> Map<String, Value> {
        let mut pbody = self.body.clone();
        pbody.insert(
            "kv_transfer_params".into(),
            serde_json::json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
                "remote_block_ids": null, "remote_host": null, "remote_port": null}),
        );
        pbody.insert("stream".into(), Value::Bool(false));
        pbody.remove("stream_options");
        match self.ctx.api {
            Api::Generate => {
                let sp = pbody.entry("sampling_params").or_insert_with(|| Value::Object(Map::new()));
                if let Some(sp) = sp.as_object_mut() {
                    sp.insert("max_new_tokens".into(), Value::from(1));
                }
            }
            _ => {
                pbody.insert("max_tokens".into(), Value::from(1));
                if pbody.contains_key("max_completion_tokens") {
                    pbody.insert("max_completion_tokens".into(), Value::from(1));
                }
            }
        }
        pbody
    }

    /// vLLM: the prefill worker first (`do_remote_decode`, one token, not streamed), then
    /// the decode worker with the `kv_transfer_params` it returned.
    async fn vllm(
        &self,
        pw: &Arc<WorkerEntry>,
        dw: &Arc<WorkerEntry>,
        p_half: dispatch::Committed,
    ) -> Result<(reqwest::Response, Option<Bytes>, Option<tokio::time::Instant>), PairError> {
        let s = self.ctx.s;
        let dispatch::Committed { ticket: mut p_ticket, shared: shared_p, .. } = p_half;
        let pbody = self.vllm_prefill_body();
        let pbytes = Bytes::from(serde_json::to_vec(&pbody).unwrap_or_default());
        let handshake = self.handshake();
        let answer = tokio::time::timeout(handshake, async {
            match dispatch::attempt(self.ctx.hop(), pw, &pbytes, handshake, None).await {
                Ok(resp) => dispatch::read_whole(resp).await,
                Err(f) => Err(f),
            }
        })
        .await;
        p_ticket.first_token();
        p_ticket.close();
        drop(shared_p);
        let (resp, body) = match answer {
            Ok(Ok((resp, body))) => (resp, body.unwrap_or_default()),
            Ok(Err(Failure::Retry(e) | Failure::TooLarge(e) | Failure::Closed(e))) => {
                s.record_failure(pw);
                return Err(PairError::Prefill(e));
            }
            Ok(Err(Failure::Timeout { .. })) | Err(_) => {
                s.record_failure(pw);
                return Err(PairError::Prefill(format!(
                    "{}: no prefill answer within the {handshake:?} handshake timeout",
                    pw.url
                )));
            }
        };
        if resp.status().is_client_error() {
            // The request itself is at fault: the client gets the prefill worker's answer.
            let msg = String::from_utf8_lossy(&body[..body.len().min(2048)]).into_owned();
            return Err(PairError::Final(DispatchError {
                blame: Blame::Client,
                retryable: false,
                bytes_sent: false,
                status: resp.status(),
                message: format!("the prefill worker refused the request: {msg}"),
            }));
        }
        let params = serde_json::from_slice::<Value>(&body)
            .ok()
            .and_then(|v| v.get("kv_transfer_params").filter(|p| p.is_object()).cloned());
        let Some(params) = params else {
            s.record_failure(pw);
            return Err(PairError::Prefill(format!(
                "{}: the prefill answer carries no kv_transfer_params (is it a vLLM worker with a KV connector?)",
                pw.url
            )));
        };
        pw.record_success();
        let mut dbody = self.body.clone();
        dbody.insert("kv_transfer_params".into(), params);
        let dbytes = Bytes::from(serde_json::to_vec(&dbody).unwrap_or_default());
        let first_byte_by = self.first_byte_by();
        match self.decode(dw, &dbytes, first_byte_by).await {
            Ok((r, b)) => Ok((r, b, first_byte_by)),
            Err(e) => {
                if matches!(e, PairError::Decode(_)) {
                    s.record_failure(dw);
                }
                Err(e)
            }
        }
    }
}

/// The decode worker's answer as the respond stage takes it (its ticket and sync event from
/// the decode half's commit).
fn decode_answer(
    dw: &Arc<WorkerEntry>,
    d_half: dispatch::Committed,
    (resp, body): (reqwest::Response, Option<Bytes>),
    first_byte_by: Option<tokio::time::Instant>,
) -> Sent {
    Sent {
        resp,
        body,
        first: None,
        worker: Arc::clone(dw),
        ticket: d_half.ticket,
        shared: d_half.shared,
        predicted: None,
        first_byte_by,
        observe: None,
        slot: None,
    }
}

/// An SGLang prefill request, owned by its task.
struct SglangPrefill {
    s: Arc<AppState>,
    pw: Arc<WorkerEntry>,
    bytes: Bytes,
    headers: axum::http::HeaderMap,
    api: Api,
    handshake: Duration,
}

/// Sends the SGLang prefill request and drains its answer within the handshake timeout,
/// holding the prefill pool's permit and the sync's event until then; settles the prefill
/// ticket and charges or clears the worker.
async fn sglang_prefill(
    p: SglangPrefill,
    held: (Arc<kvroute_core::admission::Permit>, Option<crate::cluster::sync::SharedTicket>),
    mut p_ticket: kvroute_core::ledger::LoadTicket,
) -> Result<(), PrefillError> {
    let _held = held;
    let SglangPrefill { s, pw, bytes, headers, api, handshake } = p;
    let late = || PrefillError::Late { url: pw.url.to_string(), handshake };
    let drained = tokio::time::timeout(handshake, async {
        match dispatch::attempt(Hop { s: &s, api, headers: &headers }, &pw, &bytes, handshake, None).await {
            Ok(mut resp) if resp.status().is_success() => {
                while let Ok(Some(_)) = resp.chunk().await {}
                Ok(())
            }
            Ok(resp) => Err(PrefillError::Status { url: pw.url.to_string(), status: resp.status() }),
            Err(Failure::Retry(e) | Failure::TooLarge(e) | Failure::Closed(e)) => Err(PrefillError::Transport(e)),
            Err(Failure::Timeout { .. }) => Err(late()),
        }
    })
    .await
    .unwrap_or_else(|_| Err(late()));
    p_ticket.first_token();
    p_ticket.close();
    match &drained {
        Ok(()) => pw.record_success(),
        Err(_) => s.record_failure(&pw),
    }
    drained
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clients_own_handover_fields_are_removed_and_other_bodies_left_untouched() {
        let plain = Bytes::from_static(br#"{"model":"m","prompt":"kv cache"}"#);
        assert_eq!(without_handover_fields(&plain), plain, "no copy when nothing is to remove");
        let sneaky = Bytes::from_static(
            br#"{"model":"m","prompt":"x","bootstrap_room":7,"kv_transfer_params":{"do_remote_prefill":true,"remote_host":"10.0.0.9"}}"#,
        );
        let v: Value = serde_json::from_slice(&without_handover_fields(&sneaky)).expect("json");
        assert_eq!(v, serde_json::json!({"model": "m", "prompt": "x"}));
        let mention = Bytes::from_static(br#"{"model":"m","prompt":"what is kv_transfer_params?"}"#);
        assert_eq!(without_handover_fields(&mention), mention, "a prompt that names the field is kept");
    }
}
