//! Stage 2, the routing key: token ids from the local tokenizer when one is configured, the
//! engine's own token ids when workers publish KV events, else the routing text.

use super::ctx::RequestCtx;
pub use super::ctx::{Precise, precise_view, view};
use crate::app::AppState;
use kvroute_protocol::openai::{Api, RoutingInfo};
use std::sync::Arc;

/// Bodies up to this size are tokenized on the request's task; longer ones on the blocking
/// pool (a long prompt takes milliseconds).
const INLINE_TOKENIZE_BYTES: usize = 16 << 10;

/// Fills `info.token_ids` from the local tokenizer when one is configured and the request
/// carries none, and resolves the engine's token ids for precise matching. Counts the
/// outcomes (`kvroute_local_tokenize`). A request that cannot be reproduced exactly keeps
/// its text key.
pub async fn resolve(ctx: &mut RequestCtx<'_>) -> Precise {
    let (s, api) = (ctx.s, ctx.api);
    let (body, info) = ctx.key_parts();
    local_tokens(s, api, body, info).await;
    if s.cfg.kv_events.is_empty() {
        return Precise::Off;
    }
    match crate::kv_tokens::request_tokens(s.token_sources(), body, info).await {
        Ok(t) => Precise::Tokens(t),
        Err(reason) => Precise::Unavailable(reason),
    }
}

async fn local_tokens(s: &Arc<AppState>, api: Api, body: Option<&serde_json::Value>, info: &mut RoutingInfo) {
    let Some(tk) = s.tokenizer.as_ref().filter(|_| info.token_ids.is_none()) else { return };
    // The chat template needs the whole request (roles, tools, parts): the body's JSON,
    // parsed once for the request (it parsed before, so it is there).
    let Some(body) = body else { return };
    let r = if info.text.len() <= INLINE_TOKENIZE_BYTES {
        tk.request_tokens(api, body)
    } else {
        let tk = Arc::clone(tk);
        let body = body.clone();
        tokio::task::spawn_blocking(move || tk.request_tokens(api, &body)).await.unwrap_or(Err("tokenizer_error"))
    };
    let outcome = match r {
        Ok(t) => {
            info.token_ids = Some(t);
            "ok"
        }
        Err(reason) => reason,
    };
    crate::metrics::count_outcome(&s.metrics.local_tokenize, outcome);
}

/// Where the chosen worker's prefix state came from: `precise`, or `approximate` and why.
/// `slots` when it was the worker's llama.cpp slot record (`llama_slot_routing`).
pub fn prefix_source(p: &Precise, chosen_precise: bool, chosen_slots: bool) -> (&'static str, &'static str) {
    match p {
        _ if chosen_precise => ("precise", ""),
        _ if chosen_slots => ("slots", ""),
        Precise::Off => ("approximate", "no_events"),
        Precise::Unavailable(r) => ("approximate", r),
        Precise::Tokens(_) => ("approximate", "no_events"),
    }
}
