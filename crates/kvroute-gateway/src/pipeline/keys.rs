//! Stage 2, the routing key: token ids from the local tokenizer when one is configured, the
//! engine's own token ids when workers publish KV events, else the routing text.

use crate::app::AppState;
use kvroute_core::types::{RequestView, Role, estimate_tokens};
use kvroute_protocol::openai::{Api, RoutingInfo};
use std::sync::Arc;

/// Bodies up to this size are tokenized on the request's task; longer ones on the blocking
/// pool (a long prompt takes milliseconds).
const INLINE_TOKENIZE_BYTES: usize = 16 << 10;

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

/// Fills `info.token_ids` from the local tokenizer when one is configured and the request
/// carries none, and resolves the engine's token ids for precise matching. Counts the
/// outcomes (`kvroute_local_tokenize`). A request that cannot be reproduced exactly keeps
/// its text key.
pub async fn resolve(s: &Arc<AppState>, api: Api, bytes: &[u8], info: &mut RoutingInfo) -> Precise {
    local_tokens(s, api, bytes, info).await;
    if s.cfg.kv_events.is_empty() {
        return Precise::Off;
    }
    match crate::kv_tokens::request_tokens(s.token_sources(), bytes, info).await {
        Ok(t) => Precise::Tokens(t),
        Err(reason) => Precise::Unavailable(reason),
    }
}

async fn local_tokens(s: &Arc<AppState>, api: Api, bytes: &[u8], info: &mut RoutingInfo) {
    let Some(tk) = s.tokenizer.as_ref().filter(|_| info.token_ids.is_none()) else { return };
    // The chat template needs the whole request (roles, tools, parts): only this path
    // builds a JSON value of the body; the body already parsed, so this cannot fail.
    let Ok(body) = kvroute_protocol::openai::parse_value(bytes) else { return };
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
    crate::metrics::count_outcome(&s.metrics.local_tokenize, outcome);
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
