//! Request token ids for precise (engine KV-event) matching: carried by the request, else
//! asked of a tracked worker's `/tokenize`, kept in a bounded LRU cache ([`TokenCache`],
//! [`TOKEN_CACHE_TOKENS`] tokens at most).

use crate::fleet::Fleet;
use kvroute_core::precise::PreciseIndex;
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::Duration;

/// Bound of the request-token cache, in tokens (4 bytes each).
pub const TOKEN_CACHE_TOKENS: usize = 16 << 20;
/// Time allowed for one `/tokenize` call.
pub const TOKENIZE_TIMEOUT: Duration = Duration::from_secs(5);
/// What [`request_tokens`] reads: the HTTP client, the cache, the fleet and the precise
/// index (which workers are tracked).
#[derive(Clone, Copy)]
pub struct TokenSources<'a> {
    /// HTTP client to the workers.
    pub client: &'a reqwest::Client,
    /// The token cache.
    pub cache: &'a Mutex<TokenCache>,
    /// The workers.
    pub fleet: &'a Fleet,
    /// The engine-reported prefix index.
    pub precise: &'a crate::twin::Twin<PreciseIndex>,
}

/// A bounded cache of request token ids, keyed by a hash of (model, prompt JSON).
#[derive(Debug)]
pub struct TokenCache {
    map: lru::LruCache<u64, Arc<[u32]>>,
    tokens: usize,
}

impl Default for TokenCache {
    fn default() -> Self {
        TokenCache { map: lru::LruCache::unbounded(), tokens: 0 }
    }
}

impl TokenCache {
    /// The cached tokens of `key`.
    pub fn get(&mut self, key: u64) -> Option<Arc<[u32]>> {
        self.map.get(&key).cloned()
    }

    /// Caches `tokens` under `key`, evicting the least recently used beyond
    /// [`TOKEN_CACHE_TOKENS`].
    pub fn put(&mut self, key: u64, tokens: Arc<[u32]>) {
        if tokens.len() > TOKEN_CACHE_TOKENS {
            return;
        }
        self.tokens += tokens.len();
        if let Some(old) = self.map.put(key, tokens) {
            self.tokens -= old.len();
        }
        while self.tokens > TOKEN_CACHE_TOKENS {
            match self.map.pop_lru() {
                Some((_, t)) => self.tokens -= t.len(),
                None => break,
            }
        }
    }
}

/// Why a request is routed without token ids.
pub type NotTokenized = &'static str;

/// The request's prompt token ids as the engine will see them: carried by the request
/// (`input_ids`, a token-list prompt), else from a worker's `/tokenize` (vLLM's: `model`
/// with `messages` or `prompt`; the engine applies its chat template), cached.
///
/// # Errors
/// `not_tokenized` when no worker could tokenize it.
pub async fn request_tokens(
    s: TokenSources<'_>,
    body: Option<&serde_json::Value>,
    info: &kvroute_protocol::openai::RoutingInfo,
) -> Result<Arc<[u32]>, NotTokenized> {
    if let Some(t) = &info.token_ids {
        return Ok(t.as_slice().into());
    }
    let v = body.ok_or("not_tokenized")?;
    let mut req = serde_json::Map::new();
    req.insert("model".into(), serde_json::Value::String(info.model.clone()));
    for k in ["messages", "prompt"] {
        if let Some(x) = v.get(k) {
            req.insert(k.into(), x.clone());
        }
    }
    let req = serde_json::Value::Object(req);
    let key = kvroute_core::hash::stable_hash(&serde_json::to_vec(&req).unwrap_or_default());
    if let Some(t) = s.cache.lock().get(key) {
        return Ok(t);
    }
    // Any tracked, healthy worker's tokenizer (they serve the same model).
    let urls: Vec<String> = {
        let ix = s.precise.read();
        s.fleet
            .load()
            .iter()
            .filter(|w| w.is_routable() && ix.is_tracked(w.id))
            .filter(|w| w.serves(&info.model))
            .map(|w| w.url.to_string())
            .collect()
    };
    for url in urls.iter().take(2) {
        let r = s.client.post(format!("{url}/tokenize")).timeout(TOKENIZE_TIMEOUT).json(&req).send().await;
        let Ok(r) = r else { continue };
        if !r.status().is_success() {
            continue;
        }
        #[derive(serde::Deserialize)]
        struct Tokenized {
            tokens: Vec<u32>,
        }
        if let Ok(t) = r.json::<Tokenized>().await {
            let t: Arc<[u32]> = t.tokens.into();
            s.cache.lock().put(key, Arc::clone(&t));
            return Ok(t);
        }
    }
    Err("not_tokenized")
}
