//! Routing-key extraction and validation of OpenAI and SGLang request bodies.
//!
//! The body is forwarded unchanged; only what routing needs is read: the model, the
//! routing text (chat message contents in order — string content and `text` parts —
//! completion prompts, `/generate` text), token ids when present, the session (`user`
//! field or `x-session-id` header), `stream` and `max_tokens`.

use crate::api_error::ApiError;
use serde::Deserialize;
use serde_json::value::RawValue;
use std::borrow::Cow;

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

/// The fields routing reads, each kept as its raw JSON text (borrowed from the body):
/// every other field (tools, sampling settings, images…) is skipped without being built,
/// and each routing field is then typed on its own so an error can name it.
#[derive(Deserialize)]
struct Wire<'a> {
    #[serde(borrow, default)]
    model: Option<&'a RawValue>,
    #[serde(borrow, default)]
    stream: Option<&'a RawValue>,
    #[serde(borrow, default)]
    max_tokens: Option<&'a RawValue>,
    #[serde(borrow, default)]
    max_completion_tokens: Option<&'a RawValue>,
    #[serde(borrow, default)]
    user: Option<&'a RawValue>,
    #[serde(borrow, default)]
    messages: Option<&'a RawValue>,
    #[serde(borrow, default)]
    prompt: Option<&'a RawValue>,
    #[serde(borrow, default)]
    text: Option<&'a RawValue>,
    #[serde(borrow, default)]
    input_ids: Option<&'a RawValue>,
    #[serde(borrow, default)]
    sampling_params: Option<&'a RawValue>,
}

/// One chat message: its role and content, raw.
#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow, default)]
    role: Option<&'a RawValue>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
}

/// One content part (`{"type": "text", "text": …}`; other parts carry no routing text).
#[derive(Deserialize)]
struct Part<'a> {
    #[serde(borrow, default)]
    text: Option<&'a RawValue>,
}

/// `{"max_new_tokens": n}` of SGLang's `sampling_params`.
#[derive(Deserialize)]
struct Sampling<'a> {
    #[serde(borrow, default)]
    max_new_tokens: Option<&'a RawValue>,
}

/// A raw field that is JSON `null` counts as absent.
fn present(v: Option<&RawValue>) -> Option<&RawValue> {
    v.filter(|r| r.get() != "null")
}

/// Whether `body` has a `\uD800`–`\uDFFF` escape (half of a UTF-16 surrogate pair, or a
/// whole pair's first half), any case.
fn has_surrogate_escape(body: &[u8]) -> bool {
    body.windows(4).any(|w| {
        w[0] == b'\\'
            && w[1] == b'u'
            && (w[2] == b'd' || w[2] == b'D')
            && matches!(w[3], b'8'..=b'9' | b'a'..=b'f' | b'A'..=b'F')
    })
}

/// `raw` as a string: borrowed from the body when it has no escapes, else unescaped.
fn string(raw: &RawValue) -> Option<Cow<'_, str>> {
    typed::<&str>(raw).map(Cow::Borrowed).or_else(|| typed::<String>(raw).map(Cow::Owned))
}

/// `raw` as a `T`, or `None` when it is another JSON type.
fn typed<'a, T: Deserialize<'a>>(raw: &'a RawValue) -> Option<T> {
    serde_json::from_str(raw.get()).ok()
}

/// Default most token ids a prompt may carry ([`parse_limited`]).
pub const DEFAULT_MAX_PROMPT_TOKENS: usize = 1 << 20;

/// Why an array of token ids was refused.
enum IdsError {
    NotAnArray,
    NotAnId(usize),
    TooMany,
}

/// Reads a JSON array of token ids straight into `out`, one element at a time: no value per
/// element is built (a 28 MB array of 15 M ids used to cost ~1 GB), and reading stops at the
/// first id past `max`.
struct IdSeq<'o> {
    out: &'o mut Vec<u32>,
    max: usize,
    why: &'o mut Option<IdsError>,
}

impl<'de> serde::de::Visitor<'de> for IdSeq<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("an array of token ids")
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        use serde::de::Error;
        loop {
            let i = self.out.len();
            if i == self.max {
                if seq.next_element::<serde::de::IgnoredAny>()?.is_some() {
                    *self.why = Some(IdsError::TooMany);
                    return Err(A::Error::custom("too many token ids"));
                }
                return Ok(());
            }
            match seq.next_element::<u32>() {
                Ok(Some(t)) => self.out.push(t),
                Ok(None) => return Ok(()),
                Err(e) => {
                    *self.why = Some(IdsError::NotAnId(i));
                    return Err(e);
                }
            }
        }
    }
}

fn token_ids(raw: &RawValue, field: &str, max: usize) -> Result<Vec<u32>, ApiError> {
    use serde::Deserializer as _;
    let mut out = Vec::new();
    let mut why = None;
    let mut de = serde_json::Deserializer::from_str(raw.get());
    let read = de.deserialize_seq(IdSeq { out: &mut out, max, why: &mut why });
    match (read, why.unwrap_or(IdsError::NotAnArray)) {
        (Ok(()), _) if out.is_empty() => Err(ApiError::bad_field(field, format!("`{field}` must not be empty"))),
        (Ok(()), _) => Ok(out),
        (Err(_), IdsError::TooMany) => Err(ApiError::bad_field(
            field,
            format!("`{field}` has more than {max} token ids (the router's `max_prompt_tokens`)"),
        )),
        (Err(_), IdsError::NotAnId(i)) => Err(ApiError::bad_field(field, format!("`{field}[{i}]` is not a token id"))),
        (Err(_), IdsError::NotAnArray) => {
            Err(ApiError::bad_field(field, format!("`{field}` must be an array of token ids")))
        }
    }
}

/// Whether a raw JSON array's first element is a number (token ids rather than strings).
fn starts_with_number(raw: &RawValue) -> bool {
    raw.get()
        .trim_start()
        .strip_prefix('[')
        .and_then(|r| r.trim_start().chars().next())
        .is_some_and(|c| c == '-' || c.is_ascii_digit())
}

/// The body as a JSON value, for the rare consumer that needs all of it (the local chat
/// template, the engine simulator's options).
///
/// # Errors
/// 400 naming `body` when it is not UTF-8 JSON.
pub fn parse_value(body: &[u8]) -> Result<serde_json::Value, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_field("body", format!("request body is not valid JSON: {e}")))
}

/// [`parse_limited`] with [`DEFAULT_MAX_PROMPT_TOKENS`].
///
/// # Errors
/// As [`parse_limited`].
pub fn parse(api: Api, body: &[u8], session_header: Option<&str>) -> Result<RoutingInfo, ApiError> {
    parse_limited(api, body, session_header, DEFAULT_MAX_PROMPT_TOKENS)
}

/// Parses and validates `body` for `api`: one pass over the bytes into borrowed raw fields
/// (only the ones routing reads), then each typed with an error naming it. The body itself
/// is forwarded untouched by the caller. A prompt of token ids (`prompt`, `input_ids`) may
/// hold at most `max_prompt_tokens` ids; they are read one by one and refused at the first
/// id past the limit, so memory stays proportional to the limit, not to the body.
///
/// # Errors
/// 400 naming the field for invalid UTF-8, malformed JSON, missing/mistyped fields, or a
/// token-id prompt over `max_prompt_tokens`.
pub fn parse_limited(
    api: Api,
    body: &[u8],
    session_header: Option<&str>,
    max_prompt_tokens: usize,
) -> Result<RoutingInfo, ApiError> {
    parse_fields(api, body, session_header, max_prompt_tokens).map_err(|e| {
        // A string holding half a UTF-16 surrogate pair (`"\ud800"`) is JSON but not text,
        // and a field holding one was refused as "not a string": named for what it is.
        // Looked for only on this error path, so a valid body is not read twice.
        if e.status == http::StatusCode::BAD_REQUEST
            && has_surrogate_escape(body)
            && let Err(why) = serde_json::from_slice::<serde_json::Value>(body)
        {
            let message = format!("a string in the request is not text (an unpaired UTF-16 surrogate escape): {why}");
            return ApiError { message, ..e };
        }
        e
    })
}

/// [`parse_limited`] before a refusal is explained.
fn parse_fields(
    api: Api,
    body: &[u8],
    session_header: Option<&str>,
    max_prompt_tokens: usize,
) -> Result<RoutingInfo, ApiError> {
    let text = std::str::from_utf8(body)
        .map_err(|e| ApiError::bad_field("body", format!("request body is not valid UTF-8: {e}")))?;
    if !text.trim_start().starts_with('{') {
        // Checked first so that an array or a scalar gets this message, not serde's.
        if serde_json::from_str::<serde::de::IgnoredAny>(text).is_err() {
            return Err(parse_value(body)
                .err()
                .unwrap_or_else(|| ApiError::bad_field("body", "request body is not valid JSON")));
        }
        return Err(ApiError::bad_field("body", "request body must be a JSON object"));
    }
    let w: Wire<'_> = serde_json::from_str(text)
        .map_err(|e| ApiError::bad_field("body", format!("request body is not valid JSON: {e}")))?;

    let mut info = RoutingInfo::default();
    match w.model.map(|m| (m, string(m))) {
        Some((_, Some(m))) if !m.is_empty() => info.model = m.into_owned(),
        Some((_, Some(_))) | None if api == Api::Generate => {}
        None => return Err(ApiError::bad_field("model", "missing required field `model`")),
        Some(_) => return Err(ApiError::bad_field("model", "`model` must be a non-empty string")),
    }
    if let Some(raw) = present(w.stream) {
        info.stream = typed::<bool>(raw).ok_or_else(|| ApiError::bad_field("stream", "`stream` must be a boolean"))?;
    }
    for (key, raw) in [("max_tokens", w.max_tokens), ("max_completion_tokens", w.max_completion_tokens)] {
        if let Some(raw) = present(raw) {
            let n = typed::<u64>(raw)
                .ok_or_else(|| ApiError::bad_field(key, format!("`{key}` must be a non-negative integer")))?;
            info.max_tokens = Some(n.min(u32::MAX as u64) as u32);
        }
    }
    if let Some(raw) = present(w.user) {
        let u = string(raw).ok_or_else(|| ApiError::bad_field("user", "`user` must be a string"))?;
        info.session = Some(u.into_owned());
    }
    if let Some(h) = session_header.filter(|h| !h.is_empty()) {
        info.session = Some(h.to_string());
    }
    match api {
        Api::Chat => {
            let raw = w.messages.ok_or_else(|| ApiError::bad_field("messages", "missing required field `messages`"))?;
            let msgs: Vec<&RawValue> =
                typed(raw).ok_or_else(|| ApiError::bad_field("messages", "`messages` must be an array"))?;
            if msgs.is_empty() {
                return Err(ApiError::bad_field("messages", "`messages` must not be empty"));
            }
            // Some message must carry content (a non-empty string or at least one part): an
            // empty conversation has nothing to prompt with, and engines refuse an empty
            // prompt after routing (vLLM: "the decoder prompt cannot be empty").
            let mut any_content = false;
            for (i, m) in msgs.iter().enumerate() {
                let m: Message<'_> = typed(m)
                    .ok_or_else(|| ApiError::bad_field("messages", format!("`messages[{i}]` must be an object")))?;
                if m.role.and_then(string).is_none() {
                    return Err(ApiError::bad_field("messages", format!("`messages[{i}].role` must be a string")));
                }
                let Some(content) = present(m.content) else { continue };
                if let Some(s) = string(content) {
                    any_content |= !s.is_empty();
                    push_text(&mut info.text, &s);
                } else if let Some(parts) = typed::<Vec<&RawValue>>(content) {
                    any_content |= !parts.is_empty();
                    for p in parts {
                        if let Some(t) = typed::<Part<'_>>(p).and_then(|p| p.text).and_then(string) {
                            push_text(&mut info.text, &t);
                        }
                    }
                } else {
                    return Err(ApiError::bad_field(
                        "messages",
                        format!("`messages[{i}].content` must be a string or an array of parts"),
                    ));
                }
            }
            if !any_content {
                return Err(ApiError::bad_field("messages", "every message's `content` is empty: there is no prompt"));
            }
        }
        Api::Completions => {
            let p = w.prompt.ok_or_else(|| ApiError::bad_field("prompt", "missing required field `prompt`"))?;
            let bad = || {
                ApiError::bad_field("prompt", "`prompt` must be a string, an array of strings or an array of token ids")
            };
            let empty = || ApiError::bad_field("prompt", "`prompt` must not be empty");
            if let Some(s) = string(p) {
                if s.is_empty() {
                    return Err(empty());
                }
                push_text(&mut info.text, &s);
            } else if starts_with_number(p) {
                info.token_ids = Some(token_ids(p, "prompt", max_prompt_tokens)?);
            } else {
                let items: Vec<&RawValue> = typed(p).ok_or_else(bad)?;
                let strings: Option<Vec<Cow<'_, str>>> = items.iter().map(|x| string(x)).collect();
                match strings {
                    Some(ss) if ss.iter().any(|s| s.is_empty()) => {
                        let i = ss.iter().position(|s| s.is_empty()).unwrap_or(0);
                        return Err(ApiError::bad_field("prompt", format!("`prompt[{i}]` must not be empty")));
                    }
                    Some(ss) if !ss.is_empty() => ss.iter().for_each(|s| push_text(&mut info.text, s)),
                    _ => return Err(bad()),
                }
            }
        }
        Api::Generate => {
            // SGLang runs `input_ids` when a request carries both (its TokenizerManager
            // tokenizes `text` only without ids), so the prompt routed on is the ids.
            if let Some(ids) = present(w.input_ids) {
                info.token_ids = Some(token_ids(ids, "input_ids", max_prompt_tokens)?);
            } else if let Some(raw) = present(w.text) {
                let t = string(raw).ok_or_else(|| ApiError::bad_field("text", "`text` must be a string"))?;
                push_text(&mut info.text, &t);
            }
            if info.text.is_empty() && info.token_ids.is_none() {
                return Err(ApiError::bad_field("text", "`/generate` needs `text` or `input_ids`"));
            }
            if let Some(raw) = present(w.sampling_params) {
                let sp = Some(raw)
                    .filter(|r| r.get().starts_with('{'))
                    .and_then(typed::<Sampling<'_>>)
                    .ok_or_else(|| ApiError::bad_field("sampling_params", "`sampling_params` must be an object"))?;
                if let Some(raw) = present(sp.max_new_tokens) {
                    let n = typed::<u64>(raw).ok_or_else(|| {
                        ApiError::bad_field(
                            "sampling_params.max_new_tokens",
                            "`sampling_params.max_new_tokens` must be a non-negative integer",
                        )
                    })?;
                    info.max_tokens = Some(n.min(u32::MAX as u64) as u32);
                }
            }
        }
    }
    Ok(info)
}

/// What a whole answer reports of its tokens.
#[derive(Debug, Default, PartialEq)]
pub struct AnswerUsage {
    /// `usage.completion_tokens` (OpenAI) or `meta_info.completion_tokens` (SGLang
    /// `/generate`).
    pub completion_tokens: Option<u32>,
    /// Prompt tokens the engine reported cached: `usage.prompt_tokens_details.cached_tokens`
    /// (OpenAI; vLLM with `--enable-prompt-tokens-details`), `meta_info.cached_tokens`
    /// (SGLang), `timings.cache_n` (llama.cpp).
    pub cached_tokens: Option<u64>,
    /// The prefill the engine reported: prompt tokens computed and milliseconds taken
    /// (llama.cpp `timings.prompt_n`, `timings.prompt_ms`).
    pub prefill: Option<(u64, f64)>,
}

/// Reads [`AnswerUsage`] from a whole (non-streamed) answer's JSON body; all `None` when it
/// is not JSON or states neither.
pub fn answer_usage(body: &[u8]) -> AnswerUsage {
    #[derive(serde::Deserialize)]
    struct Details {
        cached_tokens: Option<u64>,
    }
    #[derive(serde::Deserialize)]
    struct Counted {
        completion_tokens: Option<u64>,
        cached_tokens: Option<u64>,
        prompt_tokens_details: Option<Details>,
    }
    #[derive(serde::Deserialize)]
    struct Timings {
        cache_n: Option<u64>,
        prompt_n: Option<u64>,
        prompt_ms: Option<f64>,
    }
    #[derive(serde::Deserialize)]
    struct Answer {
        usage: Option<Counted>,
        meta_info: Option<Counted>,
        timings: Option<Timings>,
    }
    let Ok(a) = serde_json::from_slice::<Answer>(body) else { return AnswerUsage::default() };
    let completion = a
        .usage
        .as_ref()
        .and_then(|u| u.completion_tokens)
        .or_else(|| a.meta_info.as_ref().and_then(|m| m.completion_tokens));
    let cached = a
        .usage
        .as_ref()
        .and_then(|u| u.prompt_tokens_details.as_ref().and_then(|d| d.cached_tokens))
        .or_else(|| a.meta_info.as_ref().and_then(|m| m.cached_tokens))
        .or_else(|| a.timings.as_ref().and_then(|t| t.cache_n));
    let prefill = a.timings.as_ref().and_then(|t| Some((t.prompt_n?, t.prompt_ms?)));
    AnswerUsage {
        completion_tokens: completion.map(|n| n.min(u64::from(u32::MAX)) as u32),
        cached_tokens: cached,
        prefill,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Half a surrogate pair in a string is refused as what it is, in the field that was
    /// refused; a whole pair (an emoji) and an escaped backslash before `ud800` are text.
    #[test]
    fn an_unpaired_surrogate_is_named_as_such() {
        let m = 1 << 20;
        for (api, body, param) in [
            (Api::Chat, r#"{"model":"m","messages":[{"role":"user","content":"hi \ud800"}]}"#, "messages"),
            (Api::Completions, r#"{"model":"m","prompt":"\uDC00 x"}"#, "prompt"),
            (Api::Generate, r#"{"text":"\ud83d"}"#, "text"),
            (Api::Chat, r#"{"model":"\ud800","messages":[{"role":"user","content":"x"}]}"#, "model"),
        ] {
            let e = parse_limited(api, body.as_bytes(), None, m).expect_err(body);
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
            assert!(e.message.contains("unpaired UTF-16 surrogate"), "{body}: {}", e.message);
        }
        let pair = r#"{"model":"m","messages":[{"role":"user","content":"\ud83d\ude00 \\ud800"}]}"#;
        let info = parse_limited(Api::Chat, pair.as_bytes(), None, m).expect("a pair is text");
        assert!(info.text.contains('\u{1F600}') && info.text.contains("\\ud800"), "{}", info.text);
        // Another mistake in a body with a surrogate keeps its own message.
        let e = parse_limited(Api::Chat, br#"{"model":"m","messages":"\ud83d\ude00"}"#, None, m).expect_err("type");
        assert!(e.message.contains("must be an array"), "{}", e.message);
    }

    /// A `/generate` request with both `text` and `input_ids` is routed on the ids, the
    /// prompt SGLang runs (its TokenizerManager tokenizes `text` only when there are no ids).
    #[test]
    fn generate_with_text_and_input_ids_routes_on_the_ids() {
        let i = parse(Api::Generate, br#"{"text":"other words","input_ids":[5,6,7]}"#, None).expect("ok");
        assert_eq!(i.token_ids.as_deref(), Some(&[5u32, 6, 7][..]));
        assert!(i.text.is_empty(), "{}", i.text);
        let i = parse(Api::Generate, br#"{"text":"words"}"#, None).expect("ok");
        assert_eq!((i.text.as_str(), i.token_ids.is_none()), ("words", true));
    }

    #[test]
    fn chat_text_is_contents_in_order() {
        let body = br#"{"model":"m","messages":[{"role":"system","content":"A"},{"role":"user","content":[{"type":"text","text":"B"},{"type":"image_url","image_url":{}}]}],"user":"s1"}"#;
        let i = parse(Api::Chat, body, None).expect("ok");
        assert_eq!((i.model.as_str(), i.text.as_str(), i.session.as_deref()), ("m", "AB", Some("s1")));
    }

    #[test]
    fn bad_inputs_name_the_field() {
        let cases: [(Api, &[u8], &str); 21] = [
            (Api::Chat, b"{", "body"),
            (Api::Chat, b"[1]", "body"),
            (Api::Chat, br#"{"model":"m","messages":[{"content":"x"}]}"#, "messages"),
            (Api::Chat, br#"{"model":"m","messages":[{"role":"user"}],"max_tokens":-1}"#, "max_tokens"),
            (Api::Chat, b"\xff\xfe", "body"),
            (Api::Chat, br#"{"messages":[]}"#, "model"),
            (Api::Chat, br#"{"model":"m"}"#, "messages"),
            (Api::Chat, br#"{"model":"m","messages":[{"role":"user","content":5}]}"#, "messages"),
            (Api::Completions, br#"{"model":"m","prompt":{"a":1}}"#, "prompt"),
            (Api::Completions, br#"{"model":"m","prompt":"x","stream":"yes"}"#, "stream"),
            (Api::Generate, br#"{"input_ids":[1,-2]}"#, "input_ids"),
            (Api::Generate, br#"{"text":"x","sampling_params":[5]}"#, "sampling_params"),
            (Api::Generate, br#"{"input_ids":[]}"#, "input_ids"),
            // An empty prompt is refused naming its field, whatever its shape.
            (Api::Completions, br#"{"model":"m","prompt":""}"#, "prompt"),
            (Api::Completions, br#"{"model":"m","prompt":["a",""]}"#, "prompt"),
            (Api::Chat, br#"{"model":"m","messages":[{"role":"user","content":""}]}"#, "messages"),
            (
                Api::Chat,
                br#"{"model":"m","messages":[{"role":"system","content":""},{"role":"user","content":[]}]}"#,
                "messages",
            ),
            (Api::Chat, br#"{"model":"m","messages":[{"role":"user","content":null}]}"#, "messages"),
            (Api::Generate, br#"{"text":""}"#, "text"),
            (
                Api::Generate,
                br#"{"text":"x","sampling_params":{"max_new_tokens":-1}}"#,
                "sampling_params.max_new_tokens",
            ),
            (
                Api::Generate,
                br#"{"text":"x","sampling_params":{"max_new_tokens":"9"}}"#,
                "sampling_params.max_new_tokens",
            ),
        ];
        for (api, body, field) in cases {
            let e = parse(api, body, None).expect_err("bad");
            assert_eq!(e.param.as_deref(), Some(field), "{}", e.message);
            assert_eq!(e.status.as_u16(), 400);
        }
    }

    #[test]
    fn token_prompts_and_generate() {
        let i = parse(Api::Completions, br#"{"model":"m","prompt":[1,2,3]}"#, Some("h")).expect("ok");
        assert_eq!((i.token_ids, i.session.as_deref()), (Some(vec![1, 2, 3]), Some("h")));
        let i = parse(Api::Generate, br#"{"text":"hi","sampling_params":{"max_new_tokens":9}}"#, None).expect("ok");
        assert_eq!((i.text.as_str(), i.max_tokens), ("hi", Some(9)));
    }

    #[test]
    fn token_id_prompts_are_bounded_and_every_id_is_checked() {
        let ids = |n: usize| (0..n).map(|i| i.to_string()).collect::<Vec<_>>().join(",");
        for (api, field) in [(Api::Completions, "prompt"), (Api::Generate, "input_ids")] {
            let body = |n: usize| format!(r#"{{"model":"m","{field}":[{}]}}"#, ids(n)).into_bytes();
            let i = parse_limited(api, &body(100), None, 100).expect("exactly at the limit");
            assert_eq!(i.token_ids.map(|t| t.len()), Some(100));
            let e = parse_limited(api, &body(101), None, 100).expect_err("over the limit");
            assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some(field)));
            assert!(e.message.contains("more than 100 token ids"), "{}", e.message);
            for (bad, at) in [("[1, 2.5]", 1), ("[4294967296]", 0), ("[1,-1]", 1), ("[0, \"x\"]", 1)] {
                let b = format!(r#"{{"model":"m","{field}":{bad}}}"#);
                let e = parse(api, b.as_bytes(), None).expect_err(bad);
                assert!(e.message.contains(&format!("`{field}[{at}]` is not a token id")), "{bad}: {}", e.message);
            }
        }
        let e = parse(Api::Generate, br#"{"input_ids":{"a":1}}"#, None).expect_err("not an array");
        assert!(e.message.contains("must be an array of token ids"), "{}", e.message);
        let i = parse(Api::Completions, br#"{"model":"m","prompt":[" x","y"]}"#, None).expect("strings");
        assert_eq!(i.text, " xy");
    }

    #[test]
    fn only_routing_fields_are_read_escapes_are_undone_and_null_is_absent() {
        let body = br#"{"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}],
            "model":"m","stream":null,"user":null,"max_tokens":null,"logprobs":true,
            "messages":[{"role":"user","content":"a\"b\u00e9"},{"role":"assistant","content":null}]}"#;
        let i = parse(Api::Chat, body, None).expect("ok");
        assert_eq!((i.text.as_str(), i.stream, i.session, i.max_tokens), ("a\"bé", false, None, None));
        let i = parse(Api::Completions, br#"{"model":"m","prompt":["x","y"],"max_completion_tokens":7}"#, None)
            .expect("ok");
        assert_eq!((i.text.as_str(), i.max_tokens), ("xy", Some(7)));
        assert!(parse_value(br#"{"a":1}"#).is_ok() && parse_value(b"{").is_err());
    }
}
