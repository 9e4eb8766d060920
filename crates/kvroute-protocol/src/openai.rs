//! Routing-key extraction and validation of OpenAI and SGLang request bodies.
//!
//! The body is forwarded unchanged; only what routing needs is read: the model, the
//! routing text (chat message contents in order — string content and `text` parts —
//! completion prompts, `/generate` text), token ids when present, the session (`user`
//! field or `x-session-id` header), `stream` and `max_tokens`.

use crate::api_error::ApiError;

/// Which API the request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/completions`.
    Completions,
    /// SGLang `POST /generate`.
    Generate,
}

impl Api {
    /// Upstream path.
    pub fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Completions => "/v1/completions",
            Api::Generate => "/generate",
        }
    }
}

/// What routing needs from a request.
#[derive(Debug, Clone, Default)]
pub struct RoutingInfo {
    /// Requested model ("" for `/generate` without one).
    pub model: String,
    /// Routing text.
    pub text: String,
    /// Token ids, when the request carries them.
    pub token_ids: Option<Vec<u32>>,
    /// Session id.
    pub session: Option<String>,
    /// Whether the client asked for a stream.
    pub stream: bool,
    /// `max_tokens` (or `max_new_tokens`), when given.
    pub max_tokens: Option<u32>,
}

/// Largest routing text kept (bytes); longer prompts are routed on their first 1 MiB.
pub const MAX_ROUTING_TEXT: usize = 1 << 20;

fn push_text(out: &mut String, s: &str) {
    if out.len() < MAX_ROUTING_TEXT {
        let room = MAX_ROUTING_TEXT - out.len();
        let mut end = s.len().min(room);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        out.push_str(&s[..end]);
    }
}

fn token_ids(v: &serde_json::Value, field: &str) -> Result<Vec<u32>, ApiError> {
    let arr =
        v.as_array().ok_or_else(|| ApiError::bad_field(field, format!("`{field}` must be an array of token ids")))?;
    arr.iter()
        .enumerate()
        .map(|(i, x)| {
            x.as_u64()
                .filter(|t| *t <= u32::MAX as u64)
                .map(|t| t as u32)
                .ok_or_else(|| ApiError::bad_field(field, format!("`{field}[{i}]` is not a token id")))
        })
        .collect()
}

/// Parses and validates `body` for `api`.
///
/// # Errors
/// 400 naming the field for invalid UTF-8, malformed JSON, or missing/mistyped fields.
pub fn parse(
    api: Api,
    body: &[u8],
    session_header: Option<&str>,
) -> Result<(serde_json::Value, RoutingInfo), ApiError> {
    let text = std::str::from_utf8(body)
        .map_err(|e| ApiError::bad_field("body", format!("request body is not valid UTF-8: {e}")))?;
    let v: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| ApiError::bad_field("body", format!("request body is not valid JSON: {e}")))?;
    let obj = v.as_object().ok_or_else(|| ApiError::bad_field("body", "request body must be a JSON object"))?;
    let mut info = RoutingInfo::default();
    match obj.get("model") {
        Some(serde_json::Value::String(m)) if !m.is_empty() => info.model = m.clone(),
        Some(serde_json::Value::String(_)) | None if api == Api::Generate => {}
        None => return Err(ApiError::bad_field("model", "missing required field `model`")),
        Some(_) => return Err(ApiError::bad_field("model", "`model` must be a non-empty string")),
    }
    match obj.get("stream") {
        None | Some(serde_json::Value::Null) => {}
        Some(serde_json::Value::Bool(b)) => info.stream = *b,
        Some(_) => return Err(ApiError::bad_field("stream", "`stream` must be a boolean")),
    }
    for key in ["max_tokens", "max_completion_tokens"] {
        match obj.get(key) {
            None | Some(serde_json::Value::Null) => {}
            Some(x) => {
                let n = x
                    .as_u64()
                    .ok_or_else(|| ApiError::bad_field(key, format!("`{key}` must be a non-negative integer")))?;
                info.max_tokens = Some(n.min(u32::MAX as u64) as u32);
            }
        }
    }
    match obj.get("user") {
        None | Some(serde_json::Value::Null) => {}
        Some(serde_json::Value::String(s)) => info.session = Some(s.clone()),
        Some(_) => return Err(ApiError::bad_field("user", "`user` must be a string")),
    }
    if let Some(h) = session_header.filter(|h| !h.is_empty()) {
        info.session = Some(h.to_string());
    }
    match api {
        Api::Chat => {
            let msgs = obj
                .get("messages")
                .ok_or_else(|| ApiError::bad_field("messages", "missing required field `messages`"))?
                .as_array()
                .ok_or_else(|| ApiError::bad_field("messages", "`messages` must be an array"))?;
            if msgs.is_empty() {
                return Err(ApiError::bad_field("messages", "`messages` must not be empty"));
            }
            for (i, m) in msgs.iter().enumerate() {
                let mo = m
                    .as_object()
                    .ok_or_else(|| ApiError::bad_field("messages", format!("`messages[{i}]` must be an object")))?;
                if !mo.get("role").is_some_and(serde_json::Value::is_string) {
                    return Err(ApiError::bad_field("messages", format!("`messages[{i}].role` must be a string")));
                }
                match mo.get("content") {
                    None | Some(serde_json::Value::Null) => {}
                    Some(serde_json::Value::String(s)) => push_text(&mut info.text, s),
                    Some(serde_json::Value::Array(parts)) => {
                        for p in parts {
                            if let Some(t) = p.get("text").and_then(serde_json::Value::as_str) {
                                push_text(&mut info.text, t);
                            }
                        }
                    }
                    Some(_) => {
                        return Err(ApiError::bad_field(
                            "messages",
                            format!("`messages[{i}].content` must be a string or an array of parts"),
                        ));
                    }
                }
            }
        }
        Api::Completions => {
            let p =
                obj.get("prompt").ok_or_else(|| ApiError::bad_field("prompt", "missing required field `prompt`"))?;
            match p {
                serde_json::Value::String(s) => push_text(&mut info.text, s),
                serde_json::Value::Array(a) if a.iter().all(serde_json::Value::is_string) && !a.is_empty() => {
                    for s in a.iter().filter_map(serde_json::Value::as_str) {
                        push_text(&mut info.text, s);
                    }
                }
                serde_json::Value::Array(a) if a.iter().all(serde_json::Value::is_number) => {
                    info.token_ids = Some(token_ids(p, "prompt")?);
                }
                _ => {
                    return Err(ApiError::bad_field(
                        "prompt",
                        "`prompt` must be a string, an array of strings or an array of token ids",
                    ));
                }
            }
        }
        Api::Generate => {
            match obj.get("text") {
                None | Some(serde_json::Value::Null) => {}
                Some(serde_json::Value::String(s)) => push_text(&mut info.text, s),
                Some(_) => return Err(ApiError::bad_field("text", "`text` must be a string")),
            }
            if let Some(ids) = obj.get("input_ids").filter(|x| !x.is_null()) {
                info.token_ids = Some(token_ids(ids, "input_ids")?);
            }
            if info.text.is_empty() && info.token_ids.is_none() {
                return Err(ApiError::bad_field("text", "`/generate` needs `text` or `input_ids`"));
            }
            if let Some(n) =
                obj.get("sampling_params").and_then(|s| s.get("max_new_tokens")).and_then(serde_json::Value::as_u64)
            {
                info.max_tokens = Some(n.min(u32::MAX as u64) as u32);
            }
        }
    }
    Ok((v, info))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_text_is_contents_in_order() {
        let body = br#"{"model":"m","messages":[{"role":"system","content":"A"},{"role":"user","content":[{"type":"text","text":"B"},{"type":"image_url","image_url":{}}]}],"user":"s1"}"#;
        let (_, i) = parse(Api::Chat, body, None).expect("ok");
        assert_eq!((i.model.as_str(), i.text.as_str(), i.session.as_deref()), ("m", "AB", Some("s1")));
    }

    #[test]
    fn bad_inputs_name_the_field() {
        let cases: [(Api, &[u8], &str); 8] = [
            (Api::Chat, b"{", "body"),
            (Api::Chat, b"\xff\xfe", "body"),
            (Api::Chat, br#"{"messages":[]}"#, "model"),
            (Api::Chat, br#"{"model":"m"}"#, "messages"),
            (Api::Chat, br#"{"model":"m","messages":[{"role":"user","content":5}]}"#, "messages"),
            (Api::Completions, br#"{"model":"m","prompt":{"a":1}}"#, "prompt"),
            (Api::Completions, br#"{"model":"m","prompt":"x","stream":"yes"}"#, "stream"),
            (Api::Generate, br#"{"input_ids":[1,-2]}"#, "input_ids"),
        ];
        for (api, body, field) in cases {
            let e = parse(api, body, None).expect_err("bad");
            assert_eq!(e.param.as_deref(), Some(field), "{}", e.message);
            assert_eq!(e.status.as_u16(), 400);
        }
    }

    #[test]
    fn token_prompts_and_generate() {
        let (_, i) = parse(Api::Completions, br#"{"model":"m","prompt":[1,2,3]}"#, Some("h")).expect("ok");
        assert_eq!((i.token_ids, i.session.as_deref()), (Some(vec![1, 2, 3]), Some("h")));
        let (_, i) =
            parse(Api::Generate, br#"{"text":"hi","sampling_params":{"max_new_tokens":9}}"#, None).expect("ok");
        assert_eq!((i.text.as_str(), i.max_tokens), ("hi", Some(9)));
    }
}
