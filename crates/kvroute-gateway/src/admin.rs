//! Read-only endpoints and the admin API (SGLang router's `/add_worker`, `/remove_worker`,
//! `/list_workers`), live policy knobs and `/debug/route`.

use crate::app::AppState;
use crate::metrics::WorkerLabel;
use crate::pipeline::RequestCtx;
use crate::pipeline::read_body;
use crate::pipeline::route::{decide, decision_header};
use axum::Json;
use axum::body::Body;
use axum::extract::{ConnectInfo, RawQuery, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use kvroute_core::types::WorkerId;
use kvroute_protocol::api_error::ApiError;
use kvroute_protocol::openai::{Api, parse_limited};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// Who may use the admin API: with `admin_token` set, a client presenting
/// `Authorization: Bearer <admin_token>` (compared in constant time), from anywhere; without
/// one, loopback clients whose request names no proxy. `peer` is the client's address
/// (`None` when the server was not built with connect info: treated as remote).
///
/// A request carrying `Forwarded` (RFC 7239), `X-Forwarded-For` or `X-Real-IP` came
/// through a proxy, and a proxy on the same host connects from loopback whoever its client
/// is, so such a request is never local. Without a token the admin API is served only on a
/// loopback `admin_listen` (never on the main port, [`crate::app()`]); this check is the
/// second line, for a proxy pointed at that listener.
///
/// # Errors
/// 401 for a missing or wrong token; 403, when no token is configured, for a remote client
/// or a request relayed by a proxy.
pub fn admin_access(token: Option<&str>, headers: &HeaderMap, peer: Option<SocketAddr>) -> Result<(), ApiError> {
    match token {
        Some(token) => {
            let given = crate::api_keys::bearer(headers).unwrap_or_default();
            if crate::api_keys::same_secret(given, token) {
                Ok(())
            } else {
                Err(ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "the admin API needs `Authorization: Bearer <admin_token>`",
                ))
            }
        }
        None if relayed_by_proxy(headers) => Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "the admin API does not answer a request relayed by a proxy (`Forwarded`, `X-Forwarded-For` or \
             `X-Real-IP`) when no `admin_token` is configured",
        )),
        None if peer.is_some_and(|p| p.ip().to_canonical().is_loopback()) => Ok(()),
        None => Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "the admin API answers only loopback clients when no `admin_token` is configured",
        )),
    }
}

/// The headers by which a proxy names the client it relays (RFC 7239's `Forwarded`, and the
/// de-facto `X-Forwarded-For` and `X-Real-IP` that nginx, Envoy and HAProxy set).
pub const PROXY_HEADERS: [&str; 3] = ["forwarded", "x-forwarded-for", "x-real-ip"];

/// Whether the request carries any of [`PROXY_HEADERS`] (with any value, even empty).
pub fn relayed_by_proxy(headers: &HeaderMap) -> bool {
    PROXY_HEADERS.iter().any(|h| headers.contains_key(*h))
}

/// Middleware in front of every admin endpoint ([`admin_access`]).
pub async fn require_admin(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    // `MockConnectInfo` is how tests (and embedders without a TCP listener) name the peer.
    let ext = req.extensions();
    let peer = ext
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0)
        .or_else(|| ext.get::<axum::extract::connect_info::MockConnectInfo<SocketAddr>>().map(|m| m.0));
    let token = s.tenancy.admin_token.current();
    match admin_access(token.as_deref().map(String::as_str), req.headers(), peer) {
        Ok(()) => next.run(req).await,
        Err(e) => e.into_response(),
    }
}

/// `GET /v1/models`: models of the healthy workers (never fails because one is down), and
/// the entry model of each `[[cascade.chain]]`.
pub async fn models(State(s): State<Arc<AppState>>, headers: axum::http::HeaderMap) -> Response {
    if let Some(keys) = &s.api_keys
        && let Err(e) = keys.keys().authenticate(&headers)
    {
        return e.into_response();
    }
    // The workers' models, then each cascade's entry model (a name clients send, served by
    // the chain's models) unless a worker serves a model of that name itself.
    let mut ids = s.fleet.models();
    for c in &s.cascade.load().chain {
        if !ids.contains(&c.model) {
            ids.push(c.model.clone());
        }
    }
    let data: Vec<serde_json::Value> = ids
        .into_iter()
        .map(|m| serde_json::json!({"id": m, "object": "model", "created": 0, "owned_by": "kvroute"}))
        .collect();
    Json(serde_json::json!({"object": "list", "data": data})).into_response()
}

/// `GET /health`: the gateway process is up.
pub async fn health() -> Response {
    Json(serde_json::json!({"status": "ok"})).into_response()
}

/// `GET /readiness`: 200 when at least one worker is routable and the router is not
/// shutting down, else 503.
pub async fn readiness(State(s): State<Arc<AppState>>) -> Response {
    let healthy = s.fleet.load().iter().filter(|w| w.is_routable()).count();
    let draining = s.draining.load(std::sync::atomic::Ordering::Relaxed);
    // With cluster sync, ready once the start-up snapshot is in (or its wait ended).
    let synced = s.sync.as_ref().is_none_or(|x| x.is_ready());
    // With `state_dir`, ready once the saved prefix state is restored (or there was none).
    let restored = s.journal.as_ref().is_none_or(|j| j.is_restored());
    let ready = healthy > 0 && !draining && synced && restored;
    let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    let mut body = serde_json::json!({"ready": ready, "healthy_workers": healthy, "draining": draining});
    if s.sync.is_some() {
        body["cluster_synced"] = synced.into();
    }
    (status, Json(body)).into_response()
}

/// `GET /metrics`: Prometheus text.
pub async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    {
        for w in s.fleet.load().iter() {
            let n = w.load.get().in_flight;
            s.metrics.worker_in_flight.get_or_create(&WorkerLabel { worker: w.url.to_string() }).set(i64::from(n));
        }
    }
    let size = s.routers.index_size();
    s.metrics.index_size.set(size.min(i64::MAX as u64) as i64);
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], s.metrics.render())
        .into_response()
}

/// An admin path asked on a listener that does not serve the admin API (the main port
/// without `admin_token`, or with `admin_listen` set): 404 JSON saying where it is.
pub async fn admin_not_here() -> Response {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "the admin API is not served on this listener: it is on `admin_listen`, or on the main port \
         only when `admin_token` is set",
    )
    .into_response()
}

/// Unknown path: 404 JSON.
pub async fn not_found() -> Response {
    ApiError::new(StatusCode::NOT_FOUND, "no such endpoint").into_response()
}

/// 405 for a known path asked with a method it does not take.
pub async fn method_not_allowed(method: axum::http::Method) -> Response {
    ApiError::new(StatusCode::METHOD_NOT_ALLOWED, format!("this endpoint does not accept {method}")).into_response()
}

/// The query string's parameters (percent-decoding invalid UTF-8 lossily, so a bad query
/// is answered by the handler's own JSON error, not axum's plain-text rejection).
fn params(q: Option<String>) -> HashMap<String, String> {
    url::form_urlencoded::parse(q.unwrap_or_default().as_bytes()).into_owned().collect()
}

fn url_param(q: &HashMap<String, String>) -> Result<String, ApiError> {
    q.get("url").cloned().ok_or_else(|| ApiError::bad_field("url", "missing query parameter `url`"))
}

/// Whether the client asked for JSON (`Accept: application/json`); SGLang router's admin
/// answers are plain text otherwise.
fn wants_json(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.split(',').any(|t| t.trim().starts_with("application/json")))
}

/// `add_worker`'s wait: `None` for `wait=false`, else `timeout_secs` (positive, at most
/// [`crate::config::MAX_TIMEOUT_SECS`]) or `worker_startup_timeout_secs`.
fn startup_wait(s: &AppState, q: &HashMap<String, String>) -> Result<Option<Duration>, ApiError> {
    match q.get("wait").map(|w| w.to_ascii_lowercase()) {
        None => {}
        Some(w) if ["true", "1", "yes", ""].contains(&w.as_str()) => {}
        Some(w) if ["false", "0", "no"].contains(&w.as_str()) => return Ok(None),
        Some(w) => return Err(ApiError::bad_field("wait", format!("`wait` is true or false, got `{w}`"))),
    }
    let secs = match q.get("timeout_secs") {
        None => s.cfg.worker_startup_timeout_secs,
        Some(t) => t
            .parse::<f64>()
            .ok()
            .filter(|v| v.is_finite() && *v > 0.0 && *v <= crate::config::MAX_TIMEOUT_SECS)
            .ok_or_else(|| {
                ApiError::bad_field(
                    "timeout_secs",
                    format!(
                        "`timeout_secs` is a positive number of seconds up to {}, got `{t}`",
                        crate::config::MAX_TIMEOUT_SECS
                    ),
                )
            })?,
    };
    Ok(Some(Duration::from_secs_f64(secs)))
}

/// `POST /add_worker?url=[&wait=false][&timeout_secs=S]` (SGLang router): waits for the
/// worker's health check to pass (at most `timeout_secs`, default
/// `worker_startup_timeout_secs`) and adds it; a worker that never becomes ready is
/// refused (400, nothing added). `wait=false` adds it at once, healthy or not. Answers
/// SGLang's text (`Successfully added worker: URL`), or `{"status": "added", "url", "id"}`
/// to `Accept: application/json`; errors are JSON.
pub async fn add_worker(State(s): State<Arc<AppState>>, headers: HeaderMap, RawQuery(q): RawQuery) -> Response {
    let q = params(q);
    let r = async {
        let url = url_param(&q)?;
        let added = match startup_wait(&s, &q)? {
            Some(timeout) => s.add_worker_when_ready(&url, timeout).await,
            None => s.add_worker(&url).await,
        };
        let id = added.map_err(|m| ApiError::bad_field("url", m.to_string()))?;
        let url = s.fleet.by_id(WorkerId(id)).map_or(url, |w| w.url.to_string());
        Ok::<_, ApiError>(if wants_json(&headers) {
            Json(serde_json::json!({"status": "added", "url": url, "id": id})).into_response()
        } else {
            format!("Successfully added worker: {url}").into_response()
        })
    }
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

/// `POST /remove_worker?url=` (SGLang router): SGLang's text (`Successfully removed
/// worker: URL`), or `{"status": "removed", "url"}` to `Accept: application/json`; 404
/// JSON for a URL not in the fleet.
pub async fn remove_worker(State(s): State<Arc<AppState>>, headers: HeaderMap, RawQuery(q): RawQuery) -> Response {
    let q = params(q);
    let r = (|| {
        let url = url_param(&q)?;
        if !s.remove_worker(&url) {
            return Err(ApiError::new(StatusCode::NOT_FOUND, format!("no worker `{url}`")).with_param("url"));
        }
        Ok(if wants_json(&headers) {
            Json(serde_json::json!({"status": "removed", "url": url})).into_response()
        } else {
            format!("Successfully removed worker: {url}").into_response()
        })
    })();
    r.unwrap_or_else(IntoResponse::into_response)
}

/// `GET /list_workers` (SGLang router): `urls`, the workers requests may go to — SGLang
/// drops a worker that failed `max_worker_retries` times, so an ejected one is not among
/// them — and `ejected`, the workers failed requests took out of routing (kvroute keeps
/// probing them and brings them back; `GET /workers` has the details).
pub async fn list_workers(State(s): State<Arc<AppState>>) -> Response {
    let fleet = s.fleet.load();
    let (ejected, routable): (Vec<_>, Vec<_>) = fleet.iter().partition(|w| w.is_ejected());
    let urls = |ws: Vec<&Arc<crate::fleet::WorkerEntry>>| ws.iter().map(|w| w.url.to_string()).collect::<Vec<_>>();
    Json(serde_json::json!({"urls": urls(routable), "ejected": urls(ejected)})).into_response()
}

/// `GET /workers`: the worker table with health, models, load and engine signals.
pub async fn workers(State(s): State<Arc<AppState>>) -> Response {
    let rows: Vec<serde_json::Value> = s
        .fleet
        .load()
        .iter()
        .map(|w| {
            let l = w.load.get();
            let mut v = serde_json::to_value(w.snapshot()).unwrap_or_default();
            if let Some(o) = v.as_object_mut() {
                o.insert("in_flight".into(), l.in_flight.into());
                o.insert("waiting".into(), l.waiting.into());
                o.insert("pending_prefill_tokens".into(), l.pending_prefill_tokens.into());
            }
            v
        })
        .collect();
    let mut body = serde_json::json!({"workers": rows});
    if let Some(j) = &s.journal {
        body["prefix_state"] = j.status();
    }
    Json(body).into_response()
}

/// `GET /policy`: name and knobs, the cascade, and what a calibrating policy
/// (`least_ttft`) has learned of each worker, by model (`calibration`: each worker's
/// `ttft_scale`, `hit_ratio` and sample counts, the worker named by its URL).
pub async fn get_policy(State(s): State<Arc<AppState>>) -> Response {
    let mut calibration = serde_json::Map::new();
    for (model, mut c) in s.routers.calibration() {
        if let Some(workers) = c.get_mut("workers").and_then(serde_json::Value::as_array_mut) {
            for w in workers {
                let url = w
                    .get("worker")
                    .and_then(serde_json::Value::as_u64)
                    .and_then(|id| s.fleet.by_id(WorkerId(id as u32)))
                    .map(|e| e.url.to_string());
                w["worker"] = url.map_or(serde_json::Value::Null, serde_json::Value::String);
            }
        }
        calibration.insert(model, c);
    }
    let mut v = serde_json::json!({"policy": s.routers.policy_name(), "knobs": s.routers.knobs(),
        "cascade": *s.cascade.load_full(), "calibration": calibration});
    if let Some(pd) = &s.pd {
        for (field, routers) in [("prefill", &pd.prefill), ("decode", &pd.decode)] {
            v[field] = serde_json::json!({"policy": routers.policy_name(), "knobs": routers.knobs()});
        }
    }
    Json(v).into_response()
}

/// `PUT /policy`: `{"knobs": {...}}` (or the knobs object itself) patches knobs live;
/// `{"policy": NAME, "knobs": {...}}` switches policy ([`crate::policy_control::apply`]).
pub async fn put_policy(State(s): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    let r = async {
        let (bytes, _held) = read_body(&s, &headers, body, None).await?;
        let v: serde_json::Value =
            serde_json::from_slice(&bytes).map_err(|e| ApiError::bad_field("body", format!("not valid JSON: {e}")))?;
        let knobs = crate::policy_control::apply(&s, &v, crate::policy_control::Form::Plain)
            .map_err(|(field, e)| ApiError::bad_field(field, e))?;
        Ok::<_, ApiError>(Json(
            serde_json::json!({"policy": s.routers.policy_name(), "knobs": knobs, "cascade": *s.cascade.load_full()}),
        ))
    }
    .await;
    r.map_or_else(IntoResponse::into_response, IntoResponse::into_response)
}

/// `POST /debug/route`: a chat or completion body (or `/generate` with `?api=generate`);
/// answers which worker would be chosen and why, without sending anything: the same
/// decision stage real traffic takes (with the precise prefix state when workers publish
/// KV events), and like every decision it records nothing.
pub async fn debug_route(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
    body: Body,
) -> Response {
    let q = params(q);
    let r = async {
        let (bytes, _held) = read_body(&s, &headers, body, None).await?;
        let api = match q.get("api").map(String::as_str) {
            Some("generate") => Api::Generate,
            Some("completions") => Api::Completions,
            Some("chat") | None => {
                if bytes.windows(10).any(|w| w == b"\"messages\"") {
                    Api::Chat
                } else {
                    Api::Completions
                }
            }
            Some(other) => return Err(ApiError::bad_field("api", format!("unknown api `{other}`"))),
        };
        let session = headers.get("x-session-id").and_then(|v| v.to_str().ok());
        let info = parse_limited(api, &bytes, session, s.cfg.max_prompt_tokens)?;
        // Keyed as the tenant's own request would be: `?tenant=NAME`, else the tenant the
        // request's headers name (`tenant_header`).
        let salt = match q.get("tenant") {
            Some(t) => s.tenancy.salt_of_name(t),
            None => {
                let keys = s.api_keys.as_ref().map(crate::api_keys::KeyFile::keys);
                s.tenancy.salt_of(keys.as_deref().map(|k| &**k), &headers)
            }
        };
        let mut ctx = RequestCtx::new(&s, api, &headers, std::time::Instant::now(), salt, bytes, info);
        crate::pipeline::steps::key(&mut ctx).await?;
        let (info, model) = (&ctx.info, &ctx.model);
        let explain = |routed: &crate::pipeline::route::Routed| {
            let d = &routed.decision;
            let url = |id: WorkerId| routed.candidates.entry(id).map(|w| w.url.to_string());
            serde_json::json!({
                "worker": url(d.worker),
                "fallbacks": kvroute_core::policy::fallbacks(d, &routed.candidates.decided_views()).iter().filter_map(|w| url(*w)).collect::<Vec<_>>(),
                "policy": &*routed.router.policy_name,
                "branch": d.branch.as_str(),
                "matched": d.matched,
                "key_len": d.key_len,
                "unit": d.unit,
                "score": d.score,
                "predicted_ttft_secs": d.predicted_ttft.map(|p| p.secs),
                "decision": decision_header(&routed.router.policy_name, d),
            })
        };
        // A disaggregated fleet: the placement, and each pool's decision for a split.
        if let Some(pd) = &s.pd {
            use crate::pipeline::pd::{Placement, placement};
            use crate::pipeline::route::decide_in;
            use kvroute_core::types::Role;
            return Ok(Json(match placement(&s, pd, info, model) {
                Placement::Split => serde_json::json!({
                    "placement": "split",
                    "prefill": explain(&decide_in(&ctx, &pd.prefill, Some(&[Role::Prefill]))?),
                    "decode": explain(&decide_in(&ctx, &pd.decode, Some(&[Role::Decode]))?),
                }),
                Placement::Colocated { routers, roles, .. } => {
                    let mut v = explain(&decide_in(&ctx, routers, Some(roles))?);
                    v["placement"] = "colocated".into();
                    v
                }
            }));
        }
        let routed = decide(&ctx)?;
        Ok::<_, ApiError>(Json(explain(&routed)))
    }
    .await;
    r.map_or_else(IntoResponse::into_response, IntoResponse::into_response)
}
