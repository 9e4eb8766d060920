//! Model cascade (Cognitora cgn-router's `cascade.rs`): a request for a model that starts a
//! `[[cascade.chain]]` runs on the chain's smallest model first; when the mean
//! log-probability of the tokens it emitted is below the chain's `confidence_threshold`,
//! the request runs again on the next model. The last model's answer is always accepted.
//!
//! Each step walks the whole pipeline ([`super::route_and_send`]) for its own model — its
//! own admission, decision, retries and commit — so a step goes to the best worker serving
//! that model. A step whose workers fail after their retries ends the request with that
//! error: a failure is not a low-confidence answer and does not escalate by itself.
//!
//! The router asks each step's worker for log-probabilities (chat `logprobs: true`,
//! completions `logprobs: 1`, SGLang `/generate` `return_logprob: true`), removes them from
//! the answer unless the client asked for them, and sums `usage` over the steps. The answer
//! carries `x-kvroute-cascade: small:-1.84>large:-0.31` (each step's model and mean
//! log-probability, `none` when the worker returned none, `failed` for a failed step).
//!
//! **Streaming.** Only non-streamed requests are cascaded: a streamed request for a chain's
//! entry model runs on the chain's last (largest) model, and says so with
//! `x-kvroute-cascade: large:stream`. Cascading a stream would mean holding every step but
//! the last and replaying a held answer as a stream — the client's first token would wait
//! for the whole small-model answer, which defeats streaming.

use super::dispatch::MAX_RESPONSE_BYTES;
use crate::app::AppState;
use crate::metrics::CascadeLabels;
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderValue};
use axum::response::Response;
use kvroute_core::cascade::{Cascade, CascadeOutcome, mean_logprob};
use kvroute_protocol::api_error::ApiError;
use kvroute_protocol::openai::{Api, RoutingInfo, parse_limited};
use serde_json::{Map, Value};
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Instant;

/// The cascade that a request for `info.model` starts, if any.
pub fn start(s: &AppState, info: &RoutingInfo) -> Option<Cascade> {
    let cfg = s.cascade.load();
    Cascade::start(&cfg, &info.model)
}

/// Runs `bytes` along `cascade`: one pipeline pass per step, until a step is confident or
/// the chain ends. Answers the accepted step's response, or the first failed step's error.
///
/// # Errors
/// Never as `Err` past the first step: a failed step's error becomes the response, with
/// the cascade header. The first step's errors before any dispatch (bad model rewrite)
/// are 400s naming the field.
pub async fn run(
    s: &Arc<AppState>,
    api: Api,
    headers: &HeaderMap,
    bytes: &Bytes,
    info: &RoutingInfo,
    mut cascade: Cascade,
    t0: Instant,
) -> Result<Response, (ApiError, &'static str)> {
    let mut body: Map<String, Value> = serde_json::from_slice(bytes)
        .map_err(|e| (ApiError::bad_field("body", format!("not a JSON object: {e}")), ""))?;
    let asked = client_asked_logprobs(api, &body);
    if info.stream {
        // Not cascaded (see the module doc): the chain's last model, streamed.
        let last = cascade.last_model().to_string();
        body.insert("model".into(), Value::String(last.clone()));
        let (step_bytes, step_info) = reparse(s, api, &body, info)?;
        let mut resp = super::route_and_send(s, api, headers, &step_bytes, step_info, t0).await?;
        set_header(&mut resp, &format!("{last}:stream"));
        return Ok(resp);
    }
    let mut trail = String::new();
    let mut usage = Usage::default();
    loop {
        let model = cascade.model().to_string();
        let step_body = step_request(api, &body, &model, cascade.max_tokens(), asked);
        let (step_bytes, step_info) = reparse(s, api, &step_body, info)?;
        if !trail.is_empty() {
            trail.push('>');
        }
        let resp = match super::route_and_send(s, api, headers, &step_bytes, step_info, t0).await {
            Ok(r) => r,
            Err((e, branch)) => {
                step_count(s, &model, "failed");
                let _ = write!(trail, "{model}:failed");
                let mut resp = super::error_response(s, e, branch);
                set_header(&mut resp, &trail);
                return Ok(resp);
            }
        };
        if !resp.status().is_success() {
            // A 4xx from the worker (a bad request): the client's to fix, not a reason to
            // escalate.
            step_count(s, &model, "failed");
            let _ = write!(trail, "{model}:failed");
            let mut resp = resp;
            set_header(&mut resp, &trail);
            return Ok(resp);
        }
        let (parts, answer) = resp.into_parts();
        let answer = axum::body::to_bytes(answer, MAX_RESPONSE_BYTES).await.map_err(|e| {
            (ApiError::new(axum::http::StatusCode::BAD_GATEWAY, format!("reading the step's answer failed: {e}")), "")
        })?;
        let mut doc: Value = serde_json::from_slice(&answer).unwrap_or(Value::Null);
        let mean = mean_logprob(&token_logprobs(api, &doc));
        let step_usage = Usage::of(api, &doc);
        usage.add(step_usage);
        tokens_count(s, &model, step_usage);
        match mean {
            Some(m) => {
                let _ = write!(trail, "{model}:{m:.2}");
            }
            None => {
                let _ = write!(trail, "{model}:none");
            }
        }
        match cascade.on_response(mean) {
            CascadeOutcome::Escalate(next) => {
                step_count(s, &model, "escalated");
                tracing::debug!(target: "kvroute::decision", from = model, to = next, mean = ?mean,
                    threshold = cascade.threshold(), "cascade: escalated");
            }
            CascadeOutcome::Accept => {
                step_count(s, &model, "accepted");
                let out = if doc.is_object() {
                    if !asked {
                        strip_logprobs(api, &mut doc);
                    }
                    usage.write(api, &mut doc);
                    Bytes::from(serde_json::to_vec(&doc).unwrap_or_else(|_| answer.to_vec()))
                } else {
                    answer
                };
                let mut resp = Response::from_parts(parts, Body::from(out));
                resp.headers_mut().remove(axum::http::header::CONTENT_LENGTH);
                set_header(&mut resp, &trail);
                return Ok(resp);
            }
        }
    }
}

fn set_header(resp: &mut Response, trail: &str) {
    if let Ok(v) = HeaderValue::from_str(trail) {
        resp.headers_mut().insert("x-kvroute-cascade", v);
    }
}

fn step_count(s: &AppState, model: &str, outcome: &str) {
    s.metrics.cascade_steps.get_or_create(&CascadeLabels { model: model.into(), outcome: outcome.into() }).inc();
}

fn tokens_count(s: &AppState, model: &str, u: Usage) {
    for (kind, n) in [("prompt", u.prompt), ("completion", u.completion)] {
        if n > 0 {
            s.metrics
                .cascade_tokens
                .get_or_create(&CascadeLabels { model: model.into(), outcome: kind.into() })
                .inc_by(n);
        }
    }
}

/// The step's body serialised and parsed again (the routing info of the step's model).
fn reparse(
    s: &AppState,
    api: Api,
    body: &Map<String, Value>,
    info: &RoutingInfo,
) -> Result<(Bytes, RoutingInfo), (ApiError, &'static str)> {
    let bytes = Bytes::from(serde_json::to_vec(body).map_err(|e| (ApiError::bad_field("body", e.to_string()), ""))?);
    let step = parse_limited(api, &bytes, info.session.as_deref(), s.cfg.max_prompt_tokens).map_err(|e| (e, ""))?;
    Ok((bytes, step))
}

/// Whether the client asked for log-probabilities itself (then they stay in the answer).
pub fn client_asked_logprobs(api: Api, body: &Map<String, Value>) -> bool {
    match api {
        Api::Chat => body.get("logprobs").and_then(Value::as_bool).unwrap_or(false),
        Api::Completions => body.get("logprobs").is_some_and(|v| !v.is_null()),
        Api::Generate => body.get("return_logprob").and_then(Value::as_bool).unwrap_or(false),
    }
}

/// One step's request: the client's body for `model`, asking for log-probabilities, not
/// streamed, its output capped at the step's `max_tokens` when the chain sets one.
pub fn step_request(
    api: Api,
    body: &Map<String, Value>,
    model: &str,
    cap: Option<u32>,
    asked: bool,
) -> Map<String, Value> {
    let mut b = body.clone();
    b.insert("model".into(), Value::String(model.to_string()));
    b.insert("stream".into(), Value::Bool(false));
    b.remove("stream_options");
    if !asked {
        match api {
            Api::Chat => {
                b.insert("logprobs".into(), Value::Bool(true));
            }
            Api::Completions => {
                b.insert("logprobs".into(), Value::from(1));
            }
            Api::Generate => {
                b.insert("return_logprob".into(), Value::Bool(true));
            }
        }
    }
    if let Some(cap) = cap {
        let capped = |v: Option<&Value>| v.and_then(Value::as_u64).map_or(u64::from(cap), |n| n.min(u64::from(cap)));
        match api {
            Api::Generate => {
                let sp = b.entry("sampling_params").or_insert_with(|| Value::Object(Map::new()));
                if let Some(sp) = sp.as_object_mut() {
                    let n = capped(sp.get("max_new_tokens"));
                    sp.insert("max_new_tokens".into(), Value::from(n));
                }
            }
            _ => {
                let key = if b.contains_key("max_completion_tokens") { "max_completion_tokens" } else { "max_tokens" };
                let n = capped(b.get(key));
                b.insert(key.into(), Value::from(n));
            }
        }
    }
    b
}

/// The log-probabilities of the emitted tokens in an answer, every choice's: chat
/// `choices[].logprobs.content[].logprob`, completions `choices[].logprobs.token_logprobs[]`,
/// SGLang `meta_info.output_token_logprobs[][0]`. Empty when the worker returned none.
pub fn token_logprobs(api: Api, doc: &Value) -> Vec<f64> {
    let mut out = Vec::new();
    let mut push = |v: Option<&Value>| {
        if let Some(x) = v.and_then(Value::as_f64).filter(|x| x.is_finite()) {
            out.push(x);
        }
    };
    match api {
        Api::Chat | Api::Completions => {
            for c in doc.get("choices").and_then(Value::as_array).into_iter().flatten() {
                let lp = c.get("logprobs");
                if api == Api::Chat {
                    for t in lp.and_then(|l| l.get("content")).and_then(Value::as_array).into_iter().flatten() {
                        push(t.get("logprob"));
                    }
                } else {
                    for t in lp.and_then(|l| l.get("token_logprobs")).and_then(Value::as_array).into_iter().flatten() {
                        push(Some(t));
                    }
                }
            }
        }
        Api::Generate => {
            let items = doc.get("meta_info").and_then(|m| m.get("output_token_logprobs")).and_then(Value::as_array);
            for t in items.into_iter().flatten() {
                push(t.as_array().and_then(|a| a.first()));
            }
        }
    }
    out
}

/// Removes the log-probabilities the router asked for from an answer.
fn strip_logprobs(api: Api, doc: &mut Value) {
    match api {
        Api::Chat | Api::Completions => {
            for c in doc.get_mut("choices").and_then(Value::as_array_mut).into_iter().flatten() {
                if let Some(o) = c.as_object_mut()
                    && o.contains_key("logprobs")
                {
                    o.insert("logprobs".into(), Value::Null);
                }
            }
        }
        Api::Generate => {
            if let Some(m) = doc.get_mut("meta_info").and_then(Value::as_object_mut) {
                for k in [
                    "output_token_logprobs",
                    "input_token_logprobs",
                    "output_top_logprobs",
                    "input_top_logprobs",
                    "normalized_prompt_logprob",
                ] {
                    m.remove(k);
                }
            }
        }
    }
}

/// Token counts of one answer (`usage`, or SGLang's `meta_info`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt: u64,
    /// Generated tokens.
    pub completion: u64,
}

impl Usage {
    /// The counts an answer reports (0 for what it does not).
    pub fn of(api: Api, doc: &Value) -> Usage {
        let (u, p, c) = match api {
            Api::Generate => (doc.get("meta_info"), "prompt_tokens", "completion_tokens"),
            _ => (doc.get("usage"), "prompt_tokens", "completion_tokens"),
        };
        let n = |k: &str| u.and_then(|u| u.get(k)).and_then(Value::as_u64).unwrap_or(0);
        Usage { prompt: n(p), completion: n(c) }
    }

    fn add(&mut self, o: Usage) {
        self.prompt = self.prompt.saturating_add(o.prompt);
        self.completion = self.completion.saturating_add(o.completion);
    }

    /// Writes the summed counts into the accepted answer (where it reports usage).
    fn write(self, api: Api, doc: &mut Value) {
        let target = match api {
            Api::Generate => doc.get_mut("meta_info"),
            _ => doc.get_mut("usage"),
        };
        if let Some(u) = target.and_then(Value::as_object_mut) {
            u.insert("prompt_tokens".into(), Value::from(self.prompt));
            u.insert("completion_tokens".into(), Value::from(self.completion));
            if api != Api::Generate {
                u.insert("total_tokens".into(), Value::from(self.prompt + self.completion));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().cloned().expect("object")
    }

    #[test]
    fn a_step_asks_for_logprobs_unstreamed_and_capped() {
        let b = obj(json!({"model": "auto", "messages": [], "stream": true, "max_tokens": 500}));
        let s = step_request(Api::Chat, &b, "small", Some(64), false);
        assert_eq!(s["model"], "small");
        assert_eq!(s["stream"], false);
        assert_eq!(s["logprobs"], true);
        assert_eq!(s["max_tokens"], 64);
        let s = step_request(Api::Chat, &obj(json!({"model": "a", "max_tokens": 10})), "m", Some(64), false);
        assert_eq!(s["max_tokens"], 10, "the client's smaller cap stays");
        let s = step_request(Api::Completions, &obj(json!({"model": "a", "prompt": "x"})), "m", None, false);
        assert_eq!(s["logprobs"], 1);
        assert!(s.get("max_tokens").is_none());
        let s = step_request(Api::Generate, &obj(json!({"text": "x"})), "m", Some(8), false);
        assert_eq!(s["return_logprob"], true);
        assert_eq!(s["sampling_params"]["max_new_tokens"], 8);
        let s = step_request(Api::Completions, &obj(json!({"model": "a", "logprobs": 5})), "m", None, true);
        assert_eq!(s["logprobs"], 5, "the client's own request is kept");
    }

    #[test]
    fn logprobs_are_read_in_each_engine_shape() {
        let chat = json!({"choices": [{"logprobs": {"content": [{"logprob": -1.0}, {"logprob": -3.0}]}}]});
        assert_eq!(mean_logprob(&token_logprobs(Api::Chat, &chat)), Some(-2.0));
        let cmpl = json!({"choices": [{"logprobs": {"token_logprobs": [-0.5, null, -1.5]}}]});
        assert_eq!(mean_logprob(&token_logprobs(Api::Completions, &cmpl)), Some(-1.0));
        let sg = json!({"meta_info": {"output_token_logprobs": [[-0.25, 7, null], [-0.75, 9, null]]}});
        assert_eq!(mean_logprob(&token_logprobs(Api::Generate, &sg)), Some(-0.5));
        assert!(token_logprobs(Api::Chat, &json!({"choices": [{"logprobs": null}]})).is_empty());
    }

    #[test]
    fn usage_is_summed_and_logprobs_removed() {
        let mut doc = json!({"choices": [{"logprobs": {"content": []}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}});
        let mut u = Usage::of(Api::Chat, &doc);
        u.add(Usage { prompt: 10, completion: 7 });
        u.write(Api::Chat, &mut doc);
        strip_logprobs(Api::Chat, &mut doc);
        assert_eq!(doc["usage"]["prompt_tokens"], 20);
        assert_eq!(doc["usage"]["completion_tokens"], 12);
        assert_eq!(doc["usage"]["total_tokens"], 32);
        assert!(doc["choices"][0]["logprobs"].is_null());
        let mut g = json!({"meta_info": {"output_token_logprobs": [], "prompt_tokens": 3, "completion_tokens": 2}});
        strip_logprobs(Api::Generate, &mut g);
        assert!(g["meta_info"].get("output_token_logprobs").is_none());
        assert_eq!(Usage::of(Api::Generate, &g), Usage { prompt: 3, completion: 2 });
    }
}
