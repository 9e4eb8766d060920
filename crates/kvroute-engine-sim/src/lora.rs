//! LoRA adapters loaded at runtime, as vLLM (`--enable-lora`, `POST /v1/load_lora_adapter`)
//! and SGLang (`--enable-lora`, `POST /load_lora_adapter`) do.
//!
//! At most `lora_slots` adapters are loaded; loading one more evicts the least recently used
//! (a use is a load or a request served with the adapter). A load takes `lora_load_secs`
//! simulated seconds; it runs in its own task, so it completes even when the client goes
//! away. A second load of a name whose load is under way waits for that load and then
//! answers as a load after it would (`already been loaded`, or the same failure). Requests
//! already running with an evicted adapter finish normally. The state is one
//! `parking_lot` mutex, never held across an await.
//!
//! An adapter's KV blocks are hashed on a chain seeded by its name, so they are never shared
//! with the base model or another adapter (vLLM keys prefix-cache blocks by LoRA id).

use crate::EngineSim;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use kvroute_core::hash::{HashAlgo, ROOT_SEED};
use kvroute_core::types::{BlockHash, CHARS_PER_TOKEN};
use kvroute_protocol::api_error::ApiError;
use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// Counters of a simulated worker's LoRA adapters ([`EngineSim::lora_counters`]), the same
/// values as its `kvroute_sim_lora_*` metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoraCounters {
    /// Adapters loaded (runtime loads that succeeded, plus those preloaded at start).
    pub loads: u64,
    /// Runtime loads that failed (one per load attempt; a duplicate that waited on a failing
    /// load is not counted again).
    pub load_failures: u64,
    /// Adapters evicted (least recently used) to make room for a load.
    pub evictions: u64,
    /// Requests served with an adapter.
    pub requests: u64,
    /// Adapters loaded now.
    pub loaded: u64,
}

/// Why a load or unload was refused.
#[derive(Debug)]
pub(crate) enum LoraError {
    /// The worker runs with no LoRA slots.
    Disabled,
    /// A request field is missing or is not a non-empty string.
    Field(&'static str, String),
    /// The name is the base model's.
    BaseName,
    /// The adapter is already loaded.
    AlreadyLoaded,
    /// The load failed (a `lora_fail` name).
    Failed,
    /// Unload of an adapter that is not loaded.
    NotFound,
}

impl LoraError {
    fn status(&self) -> StatusCode {
        match self {
            LoraError::NotFound => StatusCode::NOT_FOUND,
            _ => StatusCode::BAD_REQUEST,
        }
    }

    /// vLLM's messages where vLLM has one.
    fn message(&self, name: &str, path: &str) -> String {
        match self {
            LoraError::Disabled => {
                "LoRA is not enabled on this worker (start it with --lora-slots N; vLLM: --enable-lora)".into()
            }
            LoraError::Field(_, m) => m.clone(),
            LoraError::BaseName => format!("The lora adapter name '{name}' is the base model's name."),
            LoraError::AlreadyLoaded => format!("The lora adapter '{name}' has already been loaded."),
            LoraError::Failed => format!("Loading lora {name} failed: No adapter found for {path}"),
            LoraError::NotFound => format!("The lora adapter '{name}' cannot be found."),
        }
    }

    fn api_error(&self, name: &str, path: &str) -> ApiError {
        let e = ApiError::new(self.status(), self.message(name, path));
        match self {
            LoraError::Field(f, _) => e.with_param(f),
            _ => e,
        }
    }
}

struct Adapter {
    name: String,
    path: String,
    last_use: u64,
}

#[derive(Default)]
struct LoraState {
    /// Loaded adapters in load order.
    adapters: Vec<Adapter>,
    /// Loads under way: the outcome (`Some(true)` loaded) once known.
    loading: HashMap<String, watch::Receiver<Option<bool>>>,
    /// Use clock of the LRU.
    tick: u64,
}

/// The LoRA adapters of one simulated worker.
pub(crate) struct Lora {
    slots: usize,
    load_wait: Duration,
    fail: HashSet<String>,
    base: String,
    state: Mutex<LoraState>,
    loads: Counter,
    failures: Counter,
    evictions: Counter,
    requests: Counter,
    loaded: Gauge,
}

impl Lora {
    /// The adapter state of `cfg`, its metrics registered in `registry`, and `cfg.loras`
    /// preloaded in order (through the LRU: beyond the slots, earlier ones are evicted; with
    /// no slots they are ignored).
    pub(crate) fn new(cfg: &crate::EngineSimConfig, registry: &mut Registry) -> Self {
        let loads = Counter::default();
        registry.register("kvroute_sim_lora_loads", "LoRA adapters loaded (preloaded included)", loads.clone());
        let failures = Counter::default();
        registry.register("kvroute_sim_lora_load_failures", "LoRA adapter loads that failed", failures.clone());
        let evictions = Counter::default();
        registry.register(
            "kvroute_sim_lora_evictions",
            "LoRA adapters evicted (least recently used) to make room for a load",
            evictions.clone(),
        );
        let requests = Counter::default();
        registry.register("kvroute_sim_lora_requests", "Requests served with a LoRA adapter", requests.clone());
        let loaded = Gauge::default();
        registry.register("kvroute_sim_lora_loaded", "LoRA adapters loaded now", loaded.clone());
        let slots = Gauge::<i64>::default();
        registry.register("kvroute_sim_lora_slots", "LoRA adapter slots (0 = LoRA off)", slots.clone());
        slots.set(i64::try_from(cfg.lora_slots).unwrap_or(i64::MAX));
        let lora = Lora {
            slots: cfg.lora_slots,
            load_wait: Duration::from_secs_f64(
                (cfg.lora_load_secs / cfg.time_scale.max(1e-6)).clamp(0.0, 365.0 * 86_400.0),
            ),
            fail: cfg.lora_fail.iter().cloned().collect(),
            base: cfg.model.clone(),
            state: Mutex::default(),
            loads,
            failures,
            evictions,
            requests,
            loaded,
        };
        if lora.slots > 0 {
            let mut st = lora.state.lock();
            for (name, path) in &cfg.loras {
                if !st.adapters.iter().any(|a| &a.name == name) {
                    lora.insert(&mut st, name, path);
                }
            }
        }
        lora
    }

    /// Adds a loaded adapter, evicting the least recently used ones beyond the slots.
    fn insert(&self, st: &mut LoraState, name: &str, path: &str) {
        while st.adapters.len() >= self.slots && !st.adapters.is_empty() {
            let lru = st.adapters.iter().enumerate().min_by_key(|(_, a)| a.last_use).map_or(0, |(i, _)| i);
            st.adapters.remove(lru);
            self.evictions.inc();
        }
        st.tick += 1;
        st.adapters.push(Adapter { name: name.into(), path: path.into(), last_use: st.tick });
        self.loads.inc();
        self.loaded.set(st.adapters.len() as i64);
    }

    /// Ends a load under way: loaded (true) unless `name` is a `lora_fail` name.
    fn finish(&self, name: &str, path: &str) -> bool {
        let mut st = self.state.lock();
        st.loading.remove(name);
        if self.fail.contains(name) {
            self.failures.inc();
            return false;
        }
        self.insert(&mut st, name, path);
        true
    }

    /// Loads adapter `name` from `path` after the load delay.
    async fn load(self: &Arc<Self>, name: &str, path: &str) -> Result<(), LoraError> {
        if self.slots == 0 {
            return Err(LoraError::Disabled);
        }
        if name == self.base {
            return Err(LoraError::BaseName);
        }
        let started = {
            let mut st = self.state.lock();
            if st.adapters.iter().any(|a| a.name == name) {
                return Err(LoraError::AlreadyLoaded);
            }
            match st.loading.get(name) {
                Some(rx) => Err(rx.clone()),
                None => {
                    let (tx, rx) = watch::channel(None);
                    st.loading.insert(name.to_string(), rx);
                    Ok(tx)
                }
            }
        };
        match started {
            Ok(tx) => {
                let (me, name, path) = (Arc::clone(self), name.to_string(), path.to_string());
                let task = tokio::spawn(async move {
                    tokio::time::sleep(me.load_wait).await;
                    let ok = me.finish(&name, &path);
                    let _ = tx.send(Some(ok));
                    ok
                });
                match task.await {
                    Ok(true) => Ok(()),
                    _ => Err(LoraError::Failed),
                }
            }
            Err(mut rx) => {
                let ok = rx.wait_for(Option::is_some).await.ok().and_then(|v| *v).unwrap_or(false);
                Err(if ok { LoraError::AlreadyLoaded } else { LoraError::Failed })
            }
        }
    }

    /// Unloads adapter `name`.
    fn unload(&self, name: &str) -> Result<(), LoraError> {
        if self.slots == 0 {
            return Err(LoraError::Disabled);
        }
        let mut st = self.state.lock();
        let i = st.adapters.iter().position(|a| a.name == name).ok_or(LoraError::NotFound)?;
        st.adapters.remove(i);
        self.loaded.set(st.adapters.len() as i64);
        Ok(())
    }

    /// Whether the worker has LoRA slots.
    pub(crate) fn enabled(&self) -> bool {
        self.slots > 0
    }

    /// Marks adapter `name` used by a request; false when it is not loaded.
    pub(crate) fn touch(&self, name: &str) -> bool {
        if self.slots == 0 {
            return false;
        }
        let mut st = self.state.lock();
        st.tick += 1;
        let tick = st.tick;
        match st.adapters.iter_mut().find(|a| a.name == name) {
            Some(a) => {
                a.last_use = tick;
                true
            }
            None => false,
        }
    }

    /// Counts a request served with an adapter.
    pub(crate) fn count_request(&self) {
        self.requests.inc();
    }

    /// Loaded adapters `(name, path)` in load order.
    pub(crate) fn list(&self) -> Vec<(String, String)> {
        self.state.lock().adapters.iter().map(|a| (a.name.clone(), a.path.clone())).collect()
    }

    /// The counters.
    pub(crate) fn counters(&self) -> LoraCounters {
        LoraCounters {
            loads: self.loads.get(),
            load_failures: self.failures.get(),
            evictions: self.evictions.get(),
            requests: self.requests.get(),
            loaded: u64::try_from(self.loaded.get()).unwrap_or(0),
        }
    }

    /// SGLang's `loaded_adapters`: name → path.
    fn loaded_map(&self) -> serde_json::Value {
        self.list().into_iter().map(|(n, p)| (n, serde_json::Value::String(p))).collect()
    }
}

/// Seed of adapter `name`'s block-hash chain (in place of the base model's root seed).
pub(crate) fn adapter_seed(name: &str) -> u64 {
    HashAlgo::Xxh3.chain(ROOT_SEED, &[b"lora\0".as_slice(), name.as_bytes()].concat())
}

/// [`kvroute_core::hash::hash_text_blocks`] (xxh3, no block limit) on a chain rooted at
/// `seed` instead of `ROOT_SEED`.
pub(crate) fn text_blocks(text: &str, block_tokens: usize, seed: u64, out: &mut Vec<BlockHash>) {
    let mut parent = seed;
    for block in text.as_bytes().chunks_exact(block_tokens * CHARS_PER_TOKEN) {
        parent = HashAlgo::Xxh3.chain(parent, block);
        out.push(BlockHash(parent));
    }
}

/// [`kvroute_core::hash::hash_token_blocks`] (xxh3, no block limit) on a chain rooted at
/// `seed` instead of `ROOT_SEED`.
pub(crate) fn token_blocks(tokens: &[u32], block_tokens: usize, seed: u64, out: &mut Vec<BlockHash>) {
    let mut parent = seed;
    let mut buf = Vec::with_capacity(block_tokens * 4);
    for block in tokens.chunks_exact(block_tokens) {
        buf.clear();
        block.iter().for_each(|t| buf.extend_from_slice(&t.to_le_bytes()));
        parent = HashAlgo::Xxh3.chain(parent, &buf);
        out.push(BlockHash(parent));
    }
}

/// `lora_name` and `lora_path` of a load body (`need_path`) or `lora_name` of an unload.
fn read_body(body: &[u8], need_path: bool) -> Result<(String, String), LoraError> {
    let v: serde_json::Value = serde_json::from_slice(body)
        .map_err(|e| LoraError::Field("body", format!("request body is not valid JSON: {e}")))?;
    let field = |f: &'static str| -> Result<String, LoraError> {
        match v.get(f) {
            None | Some(serde_json::Value::Null) => Err(LoraError::Field(f, format!("missing required field `{f}`"))),
            Some(serde_json::Value::String(s)) if !s.is_empty() => Ok(s.clone()),
            Some(_) => Err(LoraError::Field(f, format!("`{f}` must be a non-empty string"))),
        }
    };
    let name = field("lora_name")?;
    let path = if need_path { field("lora_path")? } else { String::new() };
    Ok((name, path))
}

fn text(status: StatusCode, body: String) -> Response {
    (status, [(header::CONTENT_TYPE, "text/plain; charset=utf-8")], body).into_response()
}

/// vLLM `POST /v1/load_lora_adapter` `{"lora_name", "lora_path"}`: after the load delay 200
/// with the text `Success: LoRA adapter 'N' added successfully.`; otherwise an OpenAI-style
/// error: 400 LoRA off, missing field, base model's name, already loaded, or failed load.
pub(crate) async fn vllm_load(State(s): State<Arc<EngineSim>>, body: Bytes) -> Response {
    if !s.lora.enabled() {
        return LoraError::Disabled.api_error("", "").into_response();
    }
    let (name, path) = match read_body(&body, true) {
        Ok(x) => x,
        Err(e) => return e.api_error("", "").into_response(),
    };
    match s.lora.load(&name, &path).await {
        Ok(()) => text(StatusCode::OK, format!("Success: LoRA adapter '{name}' added successfully.")),
        Err(e) => e.api_error(&name, &path).into_response(),
    }
}

/// vLLM `POST /v1/unload_lora_adapter` `{"lora_name"}`: 200 with the text
/// `Success: LoRA adapter 'N' removed successfully.`, 404 when not loaded, 400 LoRA off.
pub(crate) async fn vllm_unload(State(s): State<Arc<EngineSim>>, body: Bytes) -> Response {
    if !s.lora.enabled() {
        return LoraError::Disabled.api_error("", "").into_response();
    }
    let name = match read_body(&body, false) {
        Ok((name, _)) => name,
        Err(e) => return e.api_error("", "").into_response(),
    };
    match s.lora.unload(&name) {
        Ok(()) => text(StatusCode::OK, format!("Success: LoRA adapter '{name}' removed successfully.")),
        Err(e) => e.api_error(&name, "").into_response(),
    }
}

/// SGLang's answer: `{"success", "error_message", "loaded_adapters": {name: path}}`; LoRA
/// off also carries an OpenAI-style `error` object.
fn sglang_answer(s: &EngineSim, r: Result<(), (LoraError, String, String)>) -> Response {
    let loaded = s.lora.loaded_map();
    match r {
        Ok(()) => axum::Json(serde_json::json!({"success": true, "error_message": "", "loaded_adapters": loaded}))
            .into_response(),
        Err((e, name, path)) => {
            let msg = e.message(&name, &path);
            let mut body = serde_json::json!({"success": false, "error_message": msg, "loaded_adapters": loaded});
            if matches!(e, LoraError::Disabled) {
                body["error"] = e.api_error(&name, &path).body()["error"].take();
            }
            (StatusCode::BAD_REQUEST, axum::Json(body)).into_response()
        }
    }
}

/// SGLang `POST /load_lora_adapter` `{"lora_name", "lora_path"}`: 200
/// `{"success": true, "error_message": "", "loaded_adapters": {...}}` after the load delay,
/// else 400 `{"success": false, "error_message": ..., "loaded_adapters": {...}}`.
pub(crate) async fn sglang_load(State(s): State<Arc<EngineSim>>, body: Bytes) -> Response {
    let r = match read_body(&body, true) {
        _ if !s.lora.enabled() => Err((LoraError::Disabled, String::new(), String::new())),
        Ok((name, path)) => s.lora.load(&name, &path).await.map_err(|e| (e, name, path)),
        Err(e) => Err((e, String::new(), String::new())),
    };
    sglang_answer(&s, r)
}

/// SGLang `POST /unload_lora_adapter` `{"lora_name"}`: 200 `{"success": true, ...}`, else
/// 400 `{"success": false, ...}` (not loaded, LoRA off, missing field).
pub(crate) async fn sglang_unload(State(s): State<Arc<EngineSim>>, body: Bytes) -> Response {
    let r = match read_body(&body, false) {
        _ if !s.lora.enabled() => Err((LoraError::Disabled, String::new(), String::new())),
        Ok((name, _)) => s.lora.unload(&name).map_err(|e| (e, name, String::new())),
        Err(e) => Err((e, String::new(), String::new())),
    };
    sglang_answer(&s, r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::hash::{hash_text_blocks, hash_token_blocks};

    #[test]
    fn root_seeded_chains_match_the_core_hashes() {
        let text = "x".repeat(64 * 3 + 10);
        let (mut a, mut b) = (Vec::new(), Vec::new());
        hash_text_blocks(&text, 16, usize::MAX, HashAlgo::Xxh3, &mut a);
        text_blocks(&text, 16, ROOT_SEED, &mut b);
        assert_eq!((a.len(), &a), (3, &b));
        let tokens: Vec<u32> = (0..40).collect();
        let (mut a, mut b) = (Vec::new(), Vec::new());
        hash_token_blocks(&tokens, 16, usize::MAX, HashAlgo::Xxh3, &mut a);
        token_blocks(&tokens, 16, ROOT_SEED, &mut b);
        assert_eq!((a.len(), &a), (2, &b));
        let mut c = Vec::new();
        token_blocks(&tokens, 16, adapter_seed("a"), &mut c);
        assert!(c.iter().zip(&a).all(|(x, y)| x != y), "an adapter's chain differs from the base's");
    }
}
