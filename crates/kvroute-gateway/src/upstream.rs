//! The gateway's plain HTTP calls to a worker, outside the request path: its models, its
//! capacity facts, its own token ids. Best effort and bounded ([`MAX_SCRAPE_BYTES`], a timeout
//! per call); they take an HTTP client and a URL, nothing of the app.

use std::time::Duration;

/// Largest `/metrics` or `/v1/models` body read from a worker.
pub const MAX_SCRAPE_BYTES: usize = 4 << 20;

pub(crate) async fn get_text(client: &reqwest::Client, url: &str, timeout_secs: f64) -> Option<(u16, String)> {
    try_get_text(client, url, timeout_secs).await.ok()
}

/// A `GET` that got no answer: the error with its causes (a refused connection, an
/// untrusted certificate, a timeout).
#[derive(Debug, thiserror::Error)]
#[error("GET {url}: {causes}")]
pub(crate) struct GetError {
    /// The URL asked.
    pub(crate) url: String,
    /// The error and its sources.
    pub(crate) causes: String,
}

/// `GET url`: the status and body (empty when over [`MAX_SCRAPE_BYTES`]), or [`GetError`].
pub(crate) async fn try_get_text(
    client: &reqwest::Client,
    url: &str,
    timeout_secs: f64,
) -> Result<(u16, String), GetError> {
    let fail = |e: reqwest::Error| GetError { url: url.to_string(), causes: causes(&e) };
    let resp = client.get(url).timeout(Duration::from_secs_f64(timeout_secs)).send().await.map_err(fail)?;
    let status = resp.status().as_u16();
    let body = read_capped(resp, MAX_SCRAPE_BYTES).await.map_err(fail)?.unwrap_or_default();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// The body of `resp` when it is at most `max` bytes, `None` when it is longer: refused at
/// once on its `Content-Length`, else read chunk by chunk and given up past `max` (a
/// chunked answer is never read whole).
///
/// # Errors
/// The transport failed while reading.
pub(crate) async fn read_capped(mut resp: reqwest::Response, max: usize) -> Result<Option<Vec<u8>>, reqwest::Error> {
    if resp.content_length().is_some_and(|n| n > max as u64) {
        return Ok(None);
    }
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await? {
        if body.len() + chunk.len() > max {
            return Ok(None);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(Some(body))
}

/// An error and its sources, `a: b: c` (reqwest's own message alone says only "error
/// sending request").
pub(crate) fn causes(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cur = c.source();
    }
    out
}

/// The models a worker serves from its `GET /v1/models`; `Some(vec![])` (any model) when it
/// has no such endpoint but answers `/health`; `None` when it is unreachable.
pub async fn fetch_models(client: &reqwest::Client, base: &str, timeout_secs: f64) -> Option<Vec<String>> {
    match get_text(client, &format!("{base}/v1/models"), timeout_secs).await {
        Some((200, body)) => {
            let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            let ids = v
                .get("data")
                .and_then(serde_json::Value::as_array)
                .map(|a| a.iter().filter_map(|m| m.get("id")?.as_str().map(str::to_string)).take(256).collect())
                .unwrap_or_default();
            Some(ids)
        }
        Some(_) => match get_text(client, &format!("{base}/health"), timeout_secs).await {
            Some((200, _)) => Some(Vec::new()),
            _ => None,
        },
        None => None,
    }
}

/// What a worker reports about its capacity, best effort (an endpoint it lacks or an
/// unknown value leaves the field unset):
/// - SGLang `GET /server_info`: `tp_size`, `dtype` (unless `auto`), `max_running_requests`
///   → `max_concurrent`, `context_length` → `max_model_len`, `max_total_num_tokens` →
///   `kv_tokens`, with LoRA on `max_loras_per_batch` → `max_loras`; kvroute engine-sim
///   adds `vram_gb`;
/// - llama.cpp `GET /props`: `total_slots` → `max_concurrent` and `llama_slots`,
///   `default_generation_settings.n_ctx` (a slot's context) → `max_model_len`, and times
///   `total_slots` → `kv_tokens`;
/// - vLLM `GET /v1/models`: the first model's `max_model_len`; `GET /metrics`:
///   `vllm:cache_config_info`'s `num_gpu_blocks` × `block_size` labels → `kv_tokens`.
///
/// Also returns the SGLang bootstrap port `/server_info` reports
/// (`disaggregation_bootstrap_port`), for a prefill worker given none.
pub async fn probe_capacity(
    client: &reqwest::Client,
    base: &str,
    timeout_secs: f64,
) -> (crate::model::capacity::Capacity, Option<u16>) {
    let json = |path: &'static str| async move {
        match get_text(client, &format!("{base}{path}"), timeout_secs).await {
            Some((200, body)) => serde_json::from_str::<serde_json::Value>(&body).ok(),
            _ => None,
        }
    };
    let metrics = async {
        match get_text(client, &format!("{base}/metrics"), timeout_secs).await {
            Some((200, body)) => kvroute_protocol::engine_metrics::vllm_kv_tokens(&body),
            _ => None,
        }
    };
    let (info, props, models, vllm_kv) =
        tokio::join!(json("/server_info"), json("/props"), json("/v1/models"), metrics);
    let port = info
        .as_ref()
        .and_then(|i| i.get("disaggregation_bootstrap_port"))
        .and_then(serde_json::Value::as_u64)
        .and_then(|p| u16::try_from(p).ok());
    let mut c = capacity_from(info.as_ref(), props.as_ref(), models.as_ref());
    c.kv_tokens = c.kv_tokens.or(vllm_kv);
    (c, port)
}

/// [`probe_capacity`]'s reading of the three answers.
pub fn capacity_from(
    info: Option<&serde_json::Value>,
    props: Option<&serde_json::Value>,
    models: Option<&serde_json::Value>,
) -> crate::model::capacity::Capacity {
    use serde_json::Value;
    let u32_of = |v: Option<&Value>| v.and_then(Value::as_u64).and_then(|n| u32::try_from(n).ok()).filter(|&n| n > 0);
    let mut c = crate::model::capacity::Capacity::default();
    if let Some(i) = info {
        c.tp_size = u32_of(i.get("tp_size"));
        c.dtype = i
            .get("dtype")
            .and_then(Value::as_str)
            .filter(|d| crate::model::capacity::dtype_bytes(d).is_some())
            .map(str::to_string);
        c.max_concurrent = u32_of(i.get("max_running_requests"));
        c.max_model_len = u32_of(i.get("context_length"));
        c.kv_tokens = i.get("max_total_num_tokens").and_then(Value::as_u64).filter(|&n| n > 0);
        c.vram_gb = i.get("vram_gb").and_then(Value::as_f64).filter(|v| v.is_finite() && *v > 0.0);
        let lora = i.get("enable_lora").and_then(Value::as_bool).unwrap_or(false)
            || i.get("lora_paths").is_some_and(|p| p.as_array().is_some_and(|a| !a.is_empty()) || p.is_object());
        if lora {
            c.max_loras = u32_of(i.get("max_loras_per_batch"));
        }
    }
    if let Some(p) = props {
        c.max_concurrent = c.max_concurrent.or(u32_of(p.get("total_slots")));
        c.llama_slots = u32_of(p.get("total_slots")).map(|n| n.min(kvroute_core::slots::MAX_SLOTS as u32));
        let n_ctx = u32_of(p.get("default_generation_settings").and_then(|d| d.get("n_ctx")));
        c.max_model_len = c.max_model_len.or(n_ctx);
        if let (Some(slots), Some(n)) = (u32_of(p.get("total_slots")), n_ctx) {
            c.kv_tokens = c.kv_tokens.or(Some(u64::from(slots) * u64::from(n)));
        }
    }
    if let Some(m) = models {
        let first = m.get("data").and_then(Value::as_array).and_then(|a| a.first());
        c.max_model_len = c.max_model_len.or(u32_of(first.and_then(|f| f.get("max_model_len"))));
    }
    c
}

/// The probe chat of [`tokenizer_parity`]: digits, punctuation, contractions, non-ASCII text,
/// blank lines and a system message, the places where tokenizers differ.
pub(crate) fn parity_probe() -> serde_json::Value {
    serde_json::json!({"model": "", "messages": [
        {"role": "system", "content": "You route requests.  Answer in 3 words; don't explain.\n\n"},
        {"role": "user", "content": "Prix: 1234,56 € — naïve café? It's 10:45pm!\tOK\n  indented\n\nEnd."}
    ]})
}

/// The worker's own token ids of a chat body: vLLM/SGLang `POST /tokenize` with the
/// messages, else llama.cpp `POST /apply-template` then `POST /tokenize` of the prompt
/// (special tokens added and parsed, as its chat endpoint does). `None` when it has neither.
pub(crate) async fn worker_chat_tokens(
    client: &reqwest::Client,
    url: &str,
    body: &serde_json::Value,
    timeout: Duration,
) -> Option<Vec<u32>> {
    #[derive(serde::Deserialize)]
    struct Tokens {
        tokens: Vec<u32>,
    }
    let post = |path: &str, v: serde_json::Value| client.post(format!("{url}{path}")).timeout(timeout).json(&v).send();
    if let Ok(r) = post("/tokenize", body.clone()).await
        && r.status().is_success()
        && let Ok(t) = r.json::<Tokens>().await
        && !t.tokens.is_empty()
    {
        return Some(t.tokens);
    }
    let msgs = serde_json::json!({"messages": body.get("messages")?});
    let r = post("/apply-template", msgs).await.ok()?.error_for_status().ok()?;
    let prompt = r.json::<serde_json::Value>().await.ok()?.get("prompt")?.as_str()?.to_string();
    let r = post("/tokenize", serde_json::json!({"content": prompt, "add_special": true, "parse_special": true}))
        .await
        .ok()?
        .error_for_status()
        .ok()?;
    r.json::<Tokens>().await.ok().map(|t| t.tokens).filter(|t| !t.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kv_cache_size_is_read_from_each_engine_s_own_report() {
        // SGLang `/server_info`.
        let info = serde_json::json!({"max_total_num_tokens": 420_000, "max_running_requests": 256});
        assert_eq!(capacity_from(Some(&info), None, None).kv_tokens, Some(420_000));
        // llama.cpp `/props`: 2 slots of 8,192 tokens each.
        let props = serde_json::json!({"total_slots": 2, "default_generation_settings": {"n_ctx": 8192}});
        let c = capacity_from(None, Some(&props), None);
        assert_eq!((c.kv_tokens, c.max_model_len, c.llama_slots), (Some(16_384), Some(8192), Some(2)));
        // vLLM's comes from `/metrics` (`kvroute_protocol::engine_metrics::vllm_kv_tokens`).
        // Zero: unknown.
        let none = serde_json::json!({"max_total_num_tokens": 0});
        assert_eq!(capacity_from(Some(&none), None, None).kv_tokens, None);
    }

    /// A one-shot HTTP server on 127.0.0.1 answering `raw` to the first request.
    async fn answer_once(raw: Vec<u8>) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr");
        tokio::spawn(async move {
            let Ok((mut c, _)) = l.accept().await else { return };
            let mut buf = [0u8; 4096];
            let _ = c.read(&mut buf).await;
            let _ = c.write_all(&raw).await;
        });
        format!("http://{addr}/")
    }

    #[tokio::test]
    async fn a_body_over_the_cap_is_refused_whether_it_states_its_length_or_is_chunked() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = reqwest::Client::new();
        let get = |url: String| {
            let client = client.clone();
            async move { read_capped(client.get(url).send().await.expect("answer"), 10).await.expect("read") }
        };
        let fixed = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nconnection: close\r\n\r\nhello".to_vec();
        assert_eq!(get(answer_once(fixed).await).await, Some(b"hello".to_vec()));
        let long = b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\nconnection: close\r\n\r\nhello world".to_vec();
        assert_eq!(get(answer_once(long).await).await, None);
        // Chunked, no length: 6 + 6 bytes, given up at the second chunk.
        let chunked =
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n6\r\nhello \r\n6\r\nworld!\r\n0\r\n\r\n"
                .to_vec();
        assert_eq!(get(answer_once(chunked).await).await, None);
    }
}
