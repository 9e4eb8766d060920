//! # kvroute-engine-sim
//!
//! `kvroute engine-sim`: one simulated inference worker over HTTP, driven by the same
//! engine model as `kvroute replay` ([`kvroute_sim::engine`]) on a wall clock scaled by
//! `time_scale` (10 = ten times faster than the profile).
//!
//! The prompt is cut into 64-byte chunks (16 tokens at 4 characters per token) hashed as a
//! chain, so two prompts sharing a text prefix share KV blocks and the second one's prefill
//! is shorter, exactly as with vLLM's prefix caching. Output text is deterministic.
//! Endpoints: OpenAI `/v1/chat/completions`, `/v1/completions` (streaming or not, with
//! `usage` and optional `logprobs`), `/v1/models`, SGLang `/generate`, `/health`,
//! `/tokenize`, `/metrics` with vLLM names, and what peer routers probe (`/server_info`,
//! `/model_info`, `/get_load`, `/loads`, `/v1/loads`, `/version`, `*/render`).

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvroute_core::hash::{HashAlgo, hash_text_blocks, stable_hash};
use kvroute_core::types::{BlockHash, Nanos, estimate_tokens};
use kvroute_protocol::openai::{Api, parse};
/// The engine profile a simulated worker runs (re-exported from `kvroute_sim::engine`).
pub use kvroute_sim::engine::Profile;
use kvroute_sim::engine::{Engine, EngineEvent, EngineRequest};
use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Settings of one simulated worker.
#[derive(Debug, Clone)]
pub struct EngineSimConfig {
    /// Engine profile.
    pub profile: Profile,
    /// Speed-up of simulated time over wall time (1 = real time).
    pub time_scale: f64,
    /// Model name served; empty: any name is served and `/v1/models` answers 404, like an
    /// engine that does not list its models.
    pub model: String,
    /// Share of requests answered with a 500 (failure injection).
    pub error_rate: f64,
    /// Share of requests that never answer (failure injection).
    pub hang_rate: f64,
    /// Exit the process after this many requests (failure injection).
    pub crash_after: Option<u64>,
    /// Seed of the failure-injection rolls (`error_rate`, `hang_rate`): request n fails
    /// when hash(seed, n) falls under the rate. Workers given the same seed fail on the
    /// same request numbers, so fleets under test need distinct seeds.
    pub fault_seed: u64,
    /// `/health` answers 503 for this many seconds after start.
    pub slow_start_secs: f64,
    /// Waiting-queue bound of the engine.
    pub max_waiting: usize,
    /// ZeroMQ endpoint the KV-event PUB socket binds (`tcp://127.0.0.1:5557`); none = off.
    pub kv_events: Option<String>,
    /// ZeroMQ endpoint of the replay ROUTER socket; none = no replay.
    pub kv_replay: Option<String>,
    /// Event encoding: legacy positional arrays or current vLLM maps.
    pub kv_encoding: kvroute_protocol::kv_events::Encoding,
    /// Topic frame of published batches.
    pub kv_topic: String,
    /// XORed into every published block hash, like vLLM's per-process hash seed: a router
    /// must not rely on reproducing engine hashes (0 = publish the plain hashes).
    pub kv_hash_salt: u64,
    /// Answer every request at once with one token, bypassing the engine model (no prefill,
    /// no decode, no cache): an "instant worker" for measuring a router's own overhead.
    pub instant: bool,
    /// Modelled power draw when idle, watts (`DCGM_FI_DEV_POWER_USAGE` =
    /// idle + SM activity × (TDP − idle)). Default 75 W: an assumed idle draw of an H100 SXM
    /// (NVIDIA publishes no idle figure; ~60–90 W is what operators report).
    pub power_idle_watts: f64,
    /// Modelled power draw at full SM activity, watts. Default 700 W: the H100 SXM's TDP
    /// (NVIDIA H100 datasheet).
    pub power_tdp_watts: f64,
}

impl Default for EngineSimConfig {
    fn default() -> Self {
        EngineSimConfig {
            profile: Profile::h100_llama3_8b(),
            time_scale: 1.0,
            model: "sim-llama-3-8b".into(),
            error_rate: 0.0,
            hang_rate: 0.0,
            crash_after: None,
            fault_seed: 0,
            slow_start_secs: 0.0,
            max_waiting: 4096,
            kv_events: None,
            kv_replay: None,
            kv_encoding: kvroute_protocol::kv_events::Encoding::Map,
            kv_topic: "kv-events".into(),
            kv_hash_salt: 0,
            instant: false,
            power_idle_watts: 75.0,
            power_tdp_watts: 700.0,
        }
    }
}

/// Tokens per KV block of the simulated worker's prefix hashing.
const BLOCK_TOKENS: u32 = 16;

enum Cmd {
    Submit { req: EngineRequest, reply: mpsc::Sender<EngineEvent> },
}

struct SimMetrics {
    registry: Registry,
    running: Gauge,
    waiting: Gauge,
    kv_usage: Gauge<f64, std::sync::atomic::AtomicU64>,
    sm_active: Gauge<f64, std::sync::atomic::AtomicU64>,
    power: Gauge<f64, std::sync::atomic::AtomicU64>,
    hits: Counter,
    queries: Counter,
    prompt_tokens: Counter,
    generation_tokens: Counter,
    requests: Counter,
    ttft: Histogram,
    e2e: Histogram,
}

impl SimMetrics {
    fn new() -> Self {
        let mut registry = Registry::default();
        let running = Gauge::default();
        registry.register("vllm:num_requests_running", "Requests in the running batch", running.clone());
        let waiting = Gauge::default();
        registry.register("vllm:num_requests_waiting", "Requests waiting", waiting.clone());
        let kv_usage = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register("vllm:kv_cache_usage_perc", "KV cache usage, 0-1", kv_usage.clone());
        let sm_active = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register(
            "DCGM_FI_PROF_SM_ACTIVE",
            "Simulated SM activity, 0-1: the engine's busy fraction over the last simulated second (named as NVIDIA DCGM exports it)",
            sm_active.clone(),
        );
        let power = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register(
            "DCGM_FI_DEV_POWER_USAGE",
            "Simulated power draw, watts: idle + SM activity x (TDP - idle) (named as NVIDIA DCGM exports it)",
            power.clone(),
        );
        let hits = Counter::default();
        registry.register("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache", hits.clone());
        let queries = Counter::default();
        registry.register("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", queries.clone());
        let prompt_tokens = Counter::default();
        registry.register("vllm:prompt_tokens", "Prompt tokens processed", prompt_tokens.clone());
        let generation_tokens = Counter::default();
        registry.register("vllm:generation_tokens", "Tokens generated", generation_tokens.clone());
        let requests = Counter::default();
        registry.register("vllm:request_success", "Requests finished", requests.clone());
        let ttft = Histogram::new(exponential_buckets(0.001, 2.0, 18));
        registry.register("vllm:time_to_first_token_seconds", "TTFT (wall clock)", ttft.clone());
        let e2e = Histogram::new(exponential_buckets(0.001, 2.0, 20));
        registry.register("vllm:e2e_request_latency_seconds", "End-to-end latency (wall clock)", e2e.clone());
        SimMetrics {
            registry,
            running,
            waiting,
            kv_usage,
            sm_active,
            power,
            hits,
            queries,
            prompt_tokens,
            generation_tokens,
            requests,
            ttft,
            e2e,
        }
    }
}

/// Shared state of one simulated worker.
pub struct EngineSim {
    cfg: EngineSimConfig,
    tx: mpsc::Sender<Cmd>,
    metrics: SimMetrics,
    start: Instant,
    next_id: AtomicU64,
    served: AtomicU64,
    stats: Mutex<kvroute_sim::engine::EngineStats>,
}

impl std::fmt::Debug for EngineSim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineSim").field("model", &self.cfg.model).finish_non_exhaustive()
    }
}

impl EngineSim {
    fn sim_now(start: Instant, scale: f64) -> Nanos {
        Nanos((start.elapsed().as_nanos() as f64 * scale) as u64)
    }

    /// Counters of the engine (prefix hits, tokens, …).
    pub fn stats(&self) -> kvroute_sim::engine::EngineStats {
        *self.stats.lock()
    }
}

/// Starts the engine driver task and returns the shared state. The driver stops when the
/// returned state (and every handler holding it) is dropped.
pub fn start(cfg: EngineSimConfig) -> Arc<EngineSim> {
    let (tx, rx) = mpsc::channel::<Cmd>(1024);
    let sim = Arc::new(EngineSim {
        tx,
        metrics: SimMetrics::new(),
        start: Instant::now(),
        next_id: AtomicU64::new(0),
        served: AtomicU64::new(0),
        stats: Mutex::new(Default::default()),
        cfg,
    });
    sim.metrics.power.set(sim.cfg.power_idle_watts);
    tokio::spawn(drive(Arc::downgrade(&sim), rx, sim.cfg.clone(), sim.start));
    sim
}

async fn drive(sim: std::sync::Weak<EngineSim>, mut rx: mpsc::Receiver<Cmd>, cfg: EngineSimConfig, start: Instant) {
    let mut engine = Engine::new(cfg.profile.clone(), cfg.max_waiting);
    let kv_tx = cfg.kv_events.as_ref().map(|endpoint| {
        engine.record_cache_events(true);
        let (tx, rx) = mpsc::channel::<Vec<u8>>(KV_QUEUE);
        tokio::spawn(publish(endpoint.clone(), cfg.kv_replay.clone(), cfg.kv_topic.clone(), rx));
        tx
    });
    let mut cache_events = Vec::new();
    let mut waiters: HashMap<u64, mpsc::Sender<EngineEvent>> = HashMap::new();
    let mut events = Vec::new();
    let scale = cfg.time_scale.max(1e-6);
    let mut util = kvroute_sim::replay::BusyWindow::default();
    loop {
        let now = EngineSim::sim_now(start, scale);
        engine.advance(now, &mut events);
        if let Some(tx) = &kv_tx {
            flush_kv(&mut engine, &mut cache_events, tx, now, cfg.kv_encoding, cfg.kv_hash_salt);
        }
        for ev in events.drain(..) {
            let (id, done) = match ev {
                EngineEvent::FirstToken { id, .. } => (id, false),
                EngineEvent::Finished { id, .. } | EngineEvent::Rejected { id, .. } => (id, true),
            };
            if let Some(w) = waiters.get(&id) {
                let _ = w.try_send(ev);
            }
            if done {
                waiters.remove(&id);
            }
        }
        if let Some(s) = sim.upgrade() {
            s.metrics.running.set(i64::from(engine.num_running()));
            s.metrics.waiting.set(i64::from(engine.num_waiting()));
            s.metrics.kv_usage.set(engine.kv_usage());
            let active = util.observe(now, engine.stats().busy_ns, engine.next_event_time().is_some());
            s.metrics.sm_active.set(active);
            let (idle, tdp) = (s.cfg.power_idle_watts, s.cfg.power_tdp_watts.max(s.cfg.power_idle_watts));
            s.metrics.power.set(idle + active.clamp(0.0, 1.0) * (tdp - idle));
            *s.stats.lock() = engine.stats();
        } else {
            return;
        }
        let sleep = match engine.next_event_time() {
            Some(t) => {
                let now = EngineSim::sim_now(start, scale);
                Duration::from_nanos((t.0.saturating_sub(now.0) as f64 / scale) as u64)
            }
            // Idle: wake once per utilisation window so the SM gauge decays to 0.
            None => Duration::from_secs_f64(kvroute_sim::replay::UTIL_WINDOW.as_secs_f64() / scale),
        };
        tokio::select! {
            cmd = rx.recv() => match cmd {
                Some(Cmd::Submit { req, reply }) => {
                    let now = EngineSim::sim_now(start, scale);
                    engine.advance(now, &mut events);
                    let id = req.id;
                    waiters.insert(id, reply);
                    engine.submit(req, now, &mut events);
                    if let Some(tx) = &kv_tx {
                        flush_kv(&mut engine, &mut cache_events, tx, now, cfg.kv_encoding, cfg.kv_hash_salt);
                    }
                }
                None => return,
            },
            () = tokio::time::sleep(sleep) => {}
        }
    }
}

/// Bound of the queue between the engine and the KV-event publisher (batches); beyond it
/// batches are dropped (subscribers see a sequence gap and can replay).
const KV_QUEUE: usize = 4096;

/// Batches kept for replay (vLLM's `buffer_steps` default is 10,000).
const KV_REPLAY_BUFFER: usize = 10_000;

fn flush_kv(
    engine: &mut Engine,
    buf: &mut Vec<kvroute_sim::engine::CacheEvent>,
    tx: &mpsc::Sender<Vec<u8>>,
    now: Nanos,
    enc: kvroute_protocol::kv_events::Encoding,
    salt: u64,
) {
    use kvroute_protocol::kv_events::{EventBatch, KvEvent, encode};
    use kvroute_sim::engine::CacheEvent;
    engine.drain_cache_events(buf);
    if buf.is_empty() {
        return;
    }
    let events = buf
        .drain(..)
        .map(|e| match e {
            CacheEvent::Stored { hashes, parent, token_ids, block_size } => KvEvent::BlockStored {
                block_hashes: hashes.iter().map(|h| h.0 ^ salt).collect(),
                parent_block_hash: parent.map(|h| h.0 ^ salt),
                token_ids,
                block_size,
                medium: Some("GPU".into()),
                group_idx: 0,
            },
            CacheEvent::Removed { hashes } => KvEvent::BlockRemoved {
                block_hashes: hashes.iter().map(|h| h.0 ^ salt).collect(),
                medium: Some("GPU".into()),
                group_idx: 0,
            },
        })
        .collect();
    let batch = EventBatch { ts: now.as_secs_f64(), events, dp_rank: Some(0) };
    if tx.try_send(encode(&batch, enc)).is_err() {
        tracing::warn!("kv events: publisher queue full, batch dropped");
    }
}

fn zmq_endpoint(e: &str) -> String {
    e.replace("://*:", "://0.0.0.0:")
}

/// Publishes batches as `[topic, seq, payload]` on a PUB socket and serves replays on a
/// ROUTER socket (`[identity, "", start_seq]` → one `[identity, "", seq, payload]` per
/// buffered batch from `start_seq`, then `[identity, "", -1, ""]`).
async fn publish(endpoint: String, replay: Option<String>, topic: String, mut rx: mpsc::Receiver<Vec<u8>>) {
    use zeromq::{Socket, SocketSend};
    let mut sock = zeromq::PubSocket::new();
    if let Err(e) = sock.bind(&zmq_endpoint(&endpoint)).await {
        eprintln!("kvroute engine-sim: cannot bind KV events on {endpoint}: {e}");
        return;
    }
    let ring: Arc<Mutex<std::collections::VecDeque<(u64, Bytes)>>> = Arc::default();
    if let Some(r) = replay {
        tokio::spawn(replay_server(r, Arc::clone(&ring)));
    }
    let mut seq = 0u64;
    while let Some(payload) = rx.recv().await {
        let payload = Bytes::from(payload);
        {
            let mut g = ring.lock();
            g.push_back((seq, payload.clone()));
            while g.len() > KV_REPLAY_BUFFER {
                g.pop_front();
            }
        }
        if let Ok(msg) = zeromq::ZmqMessage::try_from(kvroute_protocol::kv_events::frames(&topic, seq, payload))
            && let Err(e) = sock.send(msg).await
        {
            tracing::warn!("kv events: send failed: {e}");
        }
        seq += 1;
    }
}

async fn replay_server(endpoint: String, ring: Arc<Mutex<std::collections::VecDeque<(u64, Bytes)>>>) {
    use zeromq::{Socket, SocketRecv, SocketSend};
    let mut sock = zeromq::RouterSocket::new();
    if let Err(e) = sock.bind(&zmq_endpoint(&endpoint)).await {
        eprintln!("kvroute engine-sim: cannot bind KV replay on {endpoint}: {e}");
        return;
    }
    loop {
        let Ok(msg) = sock.recv().await else { return };
        let frames = msg.into_vec();
        let (Some(id), Some(last)) = (frames.first().cloned(), frames.last()) else { continue };
        let Ok(start) = <[u8; 8]>::try_from(last.as_ref()).map(u64::from_be_bytes) else { continue };
        let batches: Vec<(u64, Bytes)> = ring.lock().iter().filter(|(s, _)| *s >= start).cloned().collect();
        for (seq, p) in batches {
            let parts = vec![id.clone(), Bytes::new(), Bytes::copy_from_slice(&seq.to_be_bytes()), p];
            if let Ok(m) = zeromq::ZmqMessage::try_from(parts)
                && sock.send(m).await.is_err()
            {
                break;
            }
        }
        let end =
            vec![id, Bytes::new(), Bytes::copy_from_slice(&kvroute_protocol::kv_events::REPLAY_END), Bytes::new()];
        if let Ok(m) = zeromq::ZmqMessage::try_from(end) {
            let _ = sock.send(m).await;
        }
    }
}

/// The HTTP app of a simulated worker.
pub fn app(sim: Arc<EngineSim>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/generate", post(generate))
        .route("/v1/chat/completions/render", post(render))
        .route("/v1/completions/render", post(render))
        .route("/tokenize", post(tokenize))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/server_info", get(server_info))
        .route("/model_info", get(model_info))
        .route("/get_load", get(get_load))
        .route("/loads", get(get_load))
        .route("/v1/loads", get(get_load))
        .route("/version", get(version))
        .with_state(sim)
}

/// Serves a simulated worker on `listener` until `shutdown`.
///
/// # Errors
/// Listener I/O errors.
pub async fn serve(
    listener: tokio::net::TcpListener,
    cfg: EngineSimConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let sim = start(cfg);
    axum::serve(listener, app(sim)).with_graceful_shutdown(shutdown).await
}

/// Starts a simulated worker on an ephemeral 127.0.0.1 port in the background, serving until
/// `stop` is cancelled. Returns its base URL and its shared state (for its counters).
///
/// # Errors
/// Binding the listener.
pub async fn spawn_local(
    cfg: EngineSimConfig,
    stop: tokio_util::sync::CancellationToken,
) -> std::io::Result<(String, Arc<EngineSim>)> {
    let sim = start(cfg);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let app = app(Arc::clone(&sim));
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).with_graceful_shutdown(async move { stop.cancelled().await }).await;
    });
    Ok((url, sim))
}

fn err(status: StatusCode, msg: &str) -> Response {
    kvroute_protocol::api_error::ApiError::new(status, msg).into_response()
}

async fn health(State(s): State<Arc<EngineSim>>) -> Response {
    if s.start.elapsed().as_secs_f64() < s.cfg.slow_start_secs {
        return err(StatusCode::SERVICE_UNAVAILABLE, "starting");
    }
    Json(serde_json::json!({"status": "ok"})).into_response()
}

async fn models(State(s): State<Arc<EngineSim>>) -> Response {
    if s.cfg.model.is_empty() {
        // An engine that does not list its models (a router then sends it any name).
        return (StatusCode::NOT_FOUND, Json(serde_json::json!({"error": "no model list"}))).into_response();
    }
    Json(serde_json::json!({"object": "list", "data": [{"id": s.cfg.model, "object": "model", "created": 0, "owned_by": "kvroute-engine-sim", "max_model_len": 131072}]}))
        .into_response()
}

async fn metrics(State(s): State<Arc<EngineSim>>) -> Response {
    let mut out = String::new();
    let _ = prometheus_client::encoding::text::encode(&mut out, &s.metrics.registry);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}

async fn server_info(State(s): State<Arc<EngineSim>>) -> Response {
    Json(serde_json::json!({"model_path": s.cfg.model, "served_model_name": s.cfg.model, "tp_size": 1, "dp_size": 1,
        "version": env!("CARGO_PKG_VERSION"), "engine": "kvroute-engine-sim", "profile": s.cfg.profile.name}))
    .into_response()
}

async fn model_info(State(s): State<Arc<EngineSim>>) -> Response {
    Json(serde_json::json!({"model_path": s.cfg.model, "tokenizer_path": null, "is_generation": true})).into_response()
}

async fn get_load(State(s): State<Arc<EngineSim>>) -> Response {
    let running = s.metrics.running.get();
    let waiting = s.metrics.waiting.get();
    Json(serde_json::json!({"num_reqs": running + waiting, "num_running_reqs": running, "num_waiting_reqs": waiting,
        "kv_cache_usage": s.metrics.kv_usage.get()}))
    .into_response()
}

async fn version() -> Response {
    Json(serde_json::json!({"version": env!("CARGO_PKG_VERSION")})).into_response()
}

/// Pseudo token ids of `text`: 4 bytes per token, little-endian (deterministic; matches the
/// 4-characters-per-token estimate used for routing).
pub fn pseudo_tokens(text: &str) -> Vec<u32> {
    text.as_bytes()
        .chunks(4)
        .map(|c| {
            let mut b = [0u8; 4];
            b[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(b)
        })
        .collect()
}

/// vLLM's `POST /tokenize`: `{"prompt": …}` or `{"messages": […]}` (the chat flattened as
/// the engine flattens it for generation), so a router gets the exact token ids the engine
/// will hash.
async fn tokenize(body: Bytes) -> Response {
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let tokens = if v.get("messages").is_some() || v.get("prompt").is_some_and(|p| !p.is_string()) {
        let api = if v.get("messages").is_some() { Api::Chat } else { Api::Completions };
        match parse(api, &body, None) {
            Ok(info) => info.token_ids.unwrap_or_else(|| pseudo_tokens(&info.text)),
            Err(e) => return e.into_response(),
        }
    } else {
        let text = v.get("prompt").or_else(|| v.get("text")).and_then(serde_json::Value::as_str).unwrap_or("");
        pseudo_tokens(text)
    };
    Json(serde_json::json!({"count": tokens.len(), "max_model_len": 131072, "tokens": tokens})).into_response()
}

async fn render(body: Bytes) -> Response {
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let api = if v.get("messages").is_some() { Api::Chat } else { Api::Completions };
    match parse(api, &body, None) {
        Ok(info) => Json(serde_json::json!({"prompt": info.text, "prompt_token_ids": pseudo_tokens(&info.text)}))
            .into_response(),
        Err(e) => e.into_response(),
    }
}

const WORDS: [&str; 16] = [
    "the", "cache", "router", "sends", "each", "request", "to", "a", "worker", "that", "already", "holds", "its",
    "prefix", "and", "answers",
];

/// Deterministic output token `i` for a prompt hash.
fn word(seed: u64, i: u32) -> &'static str {
    let h = stable_hash(&[seed.to_le_bytes(), u64::from(i).to_le_bytes()].concat());
    WORDS[(h % WORDS.len() as u64) as usize]
}

async fn chat(State(s): State<Arc<EngineSim>>, body: Bytes) -> Response {
    complete(s, Api::Chat, body).await
}
async fn completions(State(s): State<Arc<EngineSim>>, body: Bytes) -> Response {
    complete(s, Api::Completions, body).await
}
async fn generate(State(s): State<Arc<EngineSim>>, body: Bytes) -> Response {
    complete(s, Api::Generate, body).await
}

async fn complete(s: Arc<EngineSim>, api: Api, body: Bytes) -> Response {
    let t0 = Instant::now();
    let info = match parse(api, &body, None) {
        Ok(x) => x,
        Err(e) => return e.into_response(),
    };
    if !s.cfg.model.is_empty() && !info.model.is_empty() && info.model != s.cfg.model {
        return kvroute_protocol::api_error::ApiError::new(
            StatusCode::NOT_FOUND,
            format!("model `{}` does not exist", info.model),
        )
        .with_param("model")
        .into_response();
    }
    let n = s.served.fetch_add(1, Ordering::Relaxed) + 1;
    if s.cfg.crash_after.is_some_and(|c| n > c) {
        tracing::error!("engine-sim: crash injected after {} requests", n - 1);
        std::process::exit(3);
    }
    let roll = (stable_hash(&[s.cfg.fault_seed.to_le_bytes(), n.to_le_bytes()].concat()) % 1_000_000) as f64 / 1e6;
    if roll < s.cfg.error_rate {
        return err(StatusCode::INTERNAL_SERVER_ERROR, "injected failure");
    }
    if roll < s.cfg.error_rate + s.cfg.hang_rate {
        std::future::pending::<()>().await;
    }
    let (input_tokens, blocks, ids) = match &info.token_ids {
        Some(t) => {
            let mut b = Vec::new();
            kvroute_core::hash::hash_token_blocks(t, BLOCK_TOKENS as usize, usize::MAX, HashAlgo::Xxh3, &mut b);
            (t.len() as u32, b, t.clone())
        }
        None => {
            let mut b: Vec<BlockHash> = Vec::new();
            hash_text_blocks(&info.text, BLOCK_TOKENS as usize, usize::MAX, HashAlgo::Xxh3, &mut b);
            (estimate_tokens(&info.text).max(1), b, pseudo_tokens(&info.text))
        }
    };
    let token_ids: Option<Arc<[u32]>> = s.cfg.kv_events.is_some().then(|| ids.into());
    let id = s.next_id.fetch_add(1, Ordering::Relaxed);
    let (tx, mut rx) = mpsc::channel(4);
    let output = if s.cfg.instant {
        // No engine: the first token and the end are already there.
        let _ = tx.try_send(EngineEvent::FirstToken { id, at: Nanos(0), cached_tokens: 0 });
        let _ = tx.try_send(EngineEvent::Finished { id, at: Nanos(0) });
        1
    } else {
        let output = info.max_tokens.unwrap_or(16).clamp(1, 8192);
        let req =
            EngineRequest { id, input_tokens, output_tokens: output, blocks, block_tokens: BLOCK_TOKENS, token_ids };
        if s.tx.send(Cmd::Submit { req, reply: tx }).await.is_err() {
            return err(StatusCode::SERVICE_UNAVAILABLE, "engine stopped");
        }
        output
    };
    let seed = stable_hash(info.text.as_bytes());
    // The one option routing does not read; only this simulator needs the whole body.
    #[derive(serde::Deserialize)]
    struct Options {
        #[serde(default)]
        logprobs: Option<serde_json::Value>,
    }
    let logprobs = serde_json::from_slice::<Options>(&body)
        .ok()
        .and_then(|o| o.logprobs)
        .is_some_and(|l| l.as_bool().unwrap_or(!l.is_null()));
    let created = 1_700_000_000u64;
    let rid = format!("kvsim-{id}");
    let model = if s.cfg.model.is_empty() { info.model.clone() } else { s.cfg.model.clone() };
    let step = Duration::from_secs_f64(
        (s.cfg.profile.step_overhead_s + s.cfg.profile.decode_per_seq_s) / s.cfg.time_scale.max(1e-6),
    );
    // Wait for the first token.
    let first = match rx.recv().await {
        Some(EngineEvent::FirstToken { cached_tokens, .. }) => cached_tokens,
        Some(EngineEvent::Rejected { .. }) | None => {
            return err(StatusCode::SERVICE_UNAVAILABLE, "request does not fit in the KV cache or the queue is full");
        }
        Some(EngineEvent::Finished { .. }) => 0,
    };
    s.metrics.ttft.observe(t0.elapsed().as_secs_f64());
    s.metrics.hits.inc_by(u64::from(first));
    s.metrics.queries.inc_by(u64::from(input_tokens));
    s.metrics.prompt_tokens.inc_by(u64::from(input_tokens));
    let usage = serde_json::json!({"prompt_tokens": input_tokens, "completion_tokens": output,
        "total_tokens": input_tokens + output, "prompt_tokens_details": {"cached_tokens": first}});
    let s2 = Arc::clone(&s);
    let finish = move |rx: &mut mpsc::Receiver<EngineEvent>| {
        let _ = rx;
        s2.metrics.generation_tokens.inc_by(u64::from(output));
        s2.metrics.requests.inc();
        s2.metrics.e2e.observe(t0.elapsed().as_secs_f64());
    };
    let (rid_c, model_c) = (rid.clone(), model.clone());
    let chunk = move |i: u32| -> serde_json::Value {
        let (rid, model) = (&rid_c, &model_c);
        let w = format!("{}{}", if i == 0 { "" } else { " " }, word(seed, i));
        let lp = logprobs.then(|| serde_json::json!({"content": [{"token": w, "logprob": -0.1, "top_logprobs": []}]}));
        match api {
            Api::Chat => {
                serde_json::json!({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": w}, "logprobs": lp, "finish_reason": null}]})
            }
            Api::Completions => {
                serde_json::json!({"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": w, "logprobs": lp, "finish_reason": null}]})
            }
            Api::Generate => serde_json::json!({"text": w, "meta_info": {"id": rid, "completion_tokens": i + 1}}),
        }
    };
    if info.stream {
        let stream =
            async_stream(rx, output, step, chunk, finish, usage.clone(), api, rid.clone(), model.clone(), created);
        return Response::builder()
            .status(200)
            .header(header::CONTENT_TYPE, "text/event-stream")
            .header(header::CACHE_CONTROL, "no-cache")
            .body(Body::from_stream(stream))
            .unwrap_or_else(|_| err(StatusCode::INTERNAL_SERVER_ERROR, "response"));
    }
    // Non-streaming: wait for completion.
    let mut rx = rx;
    while let Some(ev) = rx.recv().await {
        if matches!(ev, EngineEvent::Finished { .. }) {
            break;
        }
    }
    finish(&mut rx);
    let text: Vec<&str> = (0..output).map(|i| word(seed, i)).collect();
    let text = text.join(" ");
    let lp = logprobs.then(|| serde_json::json!({"content": (0..output).map(|i| serde_json::json!({"token": word(seed, i), "logprob": -0.1, "top_logprobs": []})).collect::<Vec<_>>()}));
    let body = match api {
        Api::Chat => serde_json::json!({"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp, "finish_reason": "length"}],
            "usage": usage}),
        Api::Completions => {
            serde_json::json!({"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": "length"}], "usage": usage})
        }
        Api::Generate => serde_json::json!({"text": text, "meta_info": {"id": rid, "prompt_tokens": input_tokens,
            "completion_tokens": output, "cached_tokens": first, "finish_reason": {"type": "length"}}}),
    };
    Json(body).into_response()
}

/// The SSE stream: first token now, then one token per decode step until the engine says
/// the request finished (remaining tokens are flushed then), a final usage chunk and
/// `[DONE]`.
#[allow(clippy::too_many_arguments)]
fn async_stream(
    rx: mpsc::Receiver<EngineEvent>,
    output: u32,
    step: Duration,
    chunk: impl Fn(u32) -> serde_json::Value + Send + 'static,
    finish: impl FnOnce(&mut mpsc::Receiver<EngineEvent>) + Send + 'static,
    usage: serde_json::Value,
    api: Api,
    rid: String,
    model: String,
    created: u64,
) -> impl futures_util::Stream<Item = Result<Bytes, std::io::Error>> + Send {
    struct St<C, F> {
        rx: mpsc::Receiver<EngineEvent>,
        i: u32,
        done: bool,
        finished_engine: bool,
        chunk: C,
        finish: Option<F>,
        tail_sent: bool,
    }
    let st = St { rx, i: 0, done: false, finished_engine: false, chunk, finish: Some(finish), tail_sent: false };
    futures_util::stream::unfold(st, move |mut st| {
        let usage = usage.clone();
        let rid = rid.clone();
        let model = model.clone();
        async move {
            if st.done {
                return None;
            }
            if st.i < output {
                if st.i > 0 && !st.finished_engine {
                    tokio::select! {
                        ev = st.rx.recv() => {
                            if matches!(ev, Some(EngineEvent::Finished { .. }) | None) { st.finished_engine = true; }
                        }
                        () = tokio::time::sleep(step) => {}
                    }
                }
                let c = (st.chunk)(st.i);
                st.i += 1;
                return Some((Ok(Bytes::from(format!("data: {c}\n\n"))), st));
            }
            if !st.tail_sent {
                while !st.finished_engine {
                    match st.rx.recv().await {
                        Some(EngineEvent::Finished { .. }) | None => st.finished_engine = true,
                        _ => {}
                    }
                }
                if let Some(f) = st.finish.take() {
                    f(&mut st.rx);
                }
                st.tail_sent = true;
                let last = match api {
                    Api::Chat => {
                        serde_json::json!({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}], "usage": usage})
                    }
                    Api::Completions => {
                        serde_json::json!({"id": rid, "object": "text_completion", "created": created, "model": model,
                        "choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": usage})
                    }
                    Api::Generate => {
                        serde_json::json!({"text": "", "meta_info": {"id": rid, "finish_reason": {"type": "length"}, "usage": usage}})
                    }
                };
                return Some((Ok(Bytes::from(format!("data: {last}\n\ndata: [DONE]\n\n"))), st));
            }
            None
        }
    })
}
