//! Prefill/decode disaggregation of a simulated worker: the roles of SGLang's
//! `--disaggregation-mode prefill|decode` and of vLLM's NIXL connector, over both wire
//! protocols, with the KV copy modelled by [`kvroute_sim::pd::TransferModel`].
//!
//! ## Bootstrap server
//! A worker of role prefill or decode serves `GET /kv/{key}` on its bootstrap port (SGLang's
//! `--disaggregation-bootstrap-port`, vLLM's NIXL side channel). The prefill worker records a
//! key when a prompt's prefill ends, ready at that instant plus the transfer delay of the
//! prompt's tokens (simulated seconds / `time_scale`); the decode worker long-polls the key
//! on the prefill worker's bootstrap server:
//! - 200 `{"tokens": N, "bytes": B}` once the KV is there (N prompt tokens, B bytes);
//! - 410 `{"error": …}` at once when the prefill for that key failed;
//! - 404 `{"error": …}` when the key is still unknown after the server's
//!   `bootstrap_timeout_secs`.
//!
//! Keys: SGLang's `bootstrap_room` in decimal; vLLM's `vllm/{remote_engine_id}/{first
//! remote block id}`. They are kept [`KEY_TTL_MIN`] or twice `bootstrap_timeout_secs`
//! (whichever is longer) and at most [`MAX_KEYS`] (the oldest dropped first); a fetch does
//! not consume a key.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::{Json, Router};
use kvroute_core::types::Role;
use kvroute_protocol::api_error::ApiError;
use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde_json::Value;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// SGLang's default bootstrap port (`--disaggregation-bootstrap-port`), used by the decode
/// side when a request's `bootstrap_port` is null or absent, and by `kvroute engine-sim
/// --role prefill` when no `--bootstrap-port` is given.
pub const SGLANG_DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

/// Keys kept by a bootstrap server at most; beyond, the oldest are dropped.
pub const MAX_KEYS: usize = 65_536;

/// Shortest lifetime of a bootstrap key (wall clock); longer when `bootstrap_timeout_secs`
/// is (twice the timeout).
pub const KEY_TTL_MIN: Duration = Duration::from_secs(60);

/// The PD counters of a simulated worker ([`crate::EngineSim::pd_counters`]), the values of
/// its `kvroute_sim_pd_*` metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PdCounters {
    /// Decode requests whose KV arrived from a prefill worker (`kvroute_sim_pd_transfers`).
    pub transfers: u64,
    /// KV bytes those transfers carried (`kvroute_sim_pd_transfer_bytes`).
    pub transfer_bytes: u64,
    /// Decode requests whose KV never arrived: prefill failed, timed out, or bootstrap
    /// server unreachable (`kvroute_sim_pd_transfer_failures`).
    pub transfer_failures: u64,
    /// Requests a decode worker prefilled itself, without PD fields
    /// (`kvroute_sim_pd_local_prefills`).
    pub local_prefills: u64,
    /// Prefills whose KV a prefill worker published for a decode worker (SGLang room or
    /// vLLM `do_remote_decode`) (`kvroute_sim_pd_kv_published`).
    pub kv_published: u64,
    /// Decode requests waiting for their KV now (`kvroute_sim_pd_waiting_for_kv`).
    pub waiting_for_kv: u64,
}

/// The state of one KV key on a bootstrap server.
#[derive(Debug, Clone)]
enum KvState {
    /// The KV is (or will be at `at`) ready to copy.
    Ready { at: Instant, tokens: u64, bytes: u64 },
    /// The prefill failed.
    Failed(String),
}

#[derive(Default)]
struct StoreInner {
    /// key → (insertion number, inserted at, state).
    map: HashMap<String, (u64, Instant, KvState)>,
    /// Insertion order, for the TTL and the cap.
    order: VecDeque<(u64, String)>,
    seq: u64,
}

/// The keys a bootstrap server knows: bounded by a TTL and [`MAX_KEYS`].
pub(crate) struct KvStore {
    inner: Mutex<StoreInner>,
    changed: tokio::sync::Notify,
    ttl: Duration,
}

impl KvStore {
    fn new(ttl: Duration) -> Self {
        KvStore { inner: Mutex::default(), changed: tokio::sync::Notify::new(), ttl }
    }

    fn put(&self, key: String, state: KvState) {
        let now = Instant::now();
        {
            let mut g = self.inner.lock();
            let g = &mut *g;
            g.seq += 1;
            let seq = g.seq;
            g.map.insert(key.clone(), (seq, now, state));
            g.order.push_back((seq, key));
            while let Some((s, k)) = g.order.front() {
                let current = g.map.get(k).map(|e| (e.0, e.1));
                let stale = match current {
                    // Superseded by a later insertion of the same key.
                    Some((cs, _)) if cs != *s => true,
                    None => true,
                    Some((_, at)) => now.duration_since(at) > self.ttl || g.map.len() > MAX_KEYS,
                };
                if !stale {
                    break;
                }
                if current.is_some_and(|(cs, _)| cs == *s) {
                    g.map.remove(k);
                }
                g.order.pop_front();
            }
        }
        self.changed.notify_waiters();
    }

    fn get(&self, key: &str) -> Option<KvState> {
        let g = self.inner.lock();
        g.map.get(key).filter(|e| e.1.elapsed() <= self.ttl).map(|e| e.2.clone())
    }

    /// The key's state, waiting for it to appear until `deadline`.
    async fn wait(&self, key: &str, deadline: tokio::time::Instant) -> Option<KvState> {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(s) = self.get(key) {
                return Some(s);
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return None;
            }
        }
    }
}

/// Metrics and counters of the PD role.
struct PdMetrics {
    transfers: Counter,
    transfer_bytes: Counter,
    transfer_failures: Counter,
    local_prefills: Counter,
    kv_published: Counter,
    waiting: Gauge,
}

/// The PD state of one simulated worker.
pub(crate) struct Pd {
    pub(crate) role: Role,
    store: Arc<KvStore>,
    metrics: PdMetrics,
    /// The bound bootstrap port (prefill and decode roles).
    pub(crate) bootstrap_port: Option<u16>,
    /// The host advertised as vLLM's `remote_host`.
    advertised_host: String,
    /// vLLM's `remote_engine_id` of this worker.
    pub(crate) engine_id: String,
    next_block: AtomicU64,
    pub(crate) shutdown: CancellationToken,
}

/// Binds the bootstrap listener of `cfg` when its role needs one.
///
/// # Errors
/// The bind error, naming the address.
pub(crate) fn bind(cfg: &crate::EngineSimConfig) -> std::io::Result<Option<std::net::TcpListener>> {
    if cfg.role == Role::Both {
        return Ok(None);
    }
    let port = cfg.bootstrap_port.unwrap_or(0);
    let l = std::net::TcpListener::bind((cfg.bootstrap_host.as_str(), port)).map_err(|e| {
        std::io::Error::new(e.kind(), format!("cannot bind the bootstrap port {}:{port}: {e}", cfg.bootstrap_host))
    })?;
    l.set_nonblocking(true)?;
    Ok(Some(l))
}

impl PdMetrics {
    /// The PD counters, registered in `registry`, and the `kvroute_sim_role` gauge set to
    /// `role`.
    fn register(registry: &mut Registry, role: Role) -> PdMetrics {
        let transfers = Counter::default();
        registry.register(
            "kvroute_sim_pd_transfers",
            "Decode requests whose KV arrived from a prefill worker",
            transfers.clone(),
        );
        let transfer_bytes = Counter::default();
        registry.register(
            "kvroute_sim_pd_transfer_bytes",
            "KV bytes received from prefill workers",
            transfer_bytes.clone(),
        );
        let transfer_failures = Counter::default();
        registry.register(
            "kvroute_sim_pd_transfer_failures",
            "Decode requests whose KV never arrived (prefill failed, timed out, bootstrap server unreachable)",
            transfer_failures.clone(),
        );
        let local_prefills = Counter::default();
        registry.register(
            "kvroute_sim_pd_local_prefills",
            "Requests a decode worker prefilled itself (no PD fields)",
            local_prefills.clone(),
        );
        let kv_published = Counter::default();
        registry.register(
            "kvroute_sim_pd_kv_published",
            "Prefills whose KV this prefill worker published for a decode worker",
            kv_published.clone(),
        );
        let waiting = Gauge::default();
        registry.register("kvroute_sim_pd_waiting_for_kv", "Decode requests waiting for their KV", waiting.clone());
        let role_gauge = Family::<Vec<(String, String)>, Gauge>::default();
        registry.register("kvroute_sim_role", "Disaggregation role of this worker (1 on its role)", role_gauge.clone());
        role_gauge.get_or_create(&vec![("role".to_string(), role.as_str().to_string())]).set(1);
        PdMetrics { transfers, transfer_bytes, transfer_failures, local_prefills, kv_published, waiting }
    }
}

/// Starts the bootstrap server on `l` (until `shutdown`); its port, or `None` (logged)
/// when the listener cannot be used.
fn start_bootstrap(
    l: std::net::TcpListener,
    store: &Arc<KvStore>,
    timeout_secs: f64,
    shutdown: &CancellationToken,
) -> Option<u16> {
    match l.local_addr().and_then(|a| tokio::net::TcpListener::from_std(l).map(|l| (a, l))) {
        Ok((addr, l)) => {
            let app = bootstrap_app(Arc::clone(store), timeout_secs);
            let stop = shutdown.clone();
            tokio::spawn(async move {
                let _ = axum::serve(l, app).with_graceful_shutdown(async move { stop.cancelled().await }).await;
            });
            Some(addr.port())
        }
        Err(e) => {
            tracing::error!("engine-sim: bootstrap server not started: {e}");
            None
        }
    }
}

/// This worker's engine id for vLLM's `kv_transfer_params`: a hash of the time, the
/// process id and the bootstrap port.
fn engine_id(bootstrap_port: Option<u16>) -> String {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let id = kvroute_core::hash::stable_hash(
        &[
            t.as_nanos().to_le_bytes().as_slice(),
            &std::process::id().to_le_bytes(),
            &bootstrap_port.unwrap_or(0).to_le_bytes(),
        ]
        .concat(),
    );
    format!("kvsim-{id:016x}")
}

impl Pd {
    /// The PD state of `cfg`, its metrics registered in `registry`, its bootstrap server
    /// started on `listener` (must run inside a tokio runtime).
    pub(crate) fn new(
        cfg: &crate::EngineSimConfig,
        registry: &mut Registry,
        listener: Option<std::net::TcpListener>,
    ) -> Self {
        let metrics = PdMetrics::register(registry, cfg.role);
        let ttl = KEY_TTL_MIN.max(wall_secs(2.0 * cfg.bootstrap_timeout_secs));
        let store = Arc::new(KvStore::new(ttl));
        let shutdown = CancellationToken::new();
        let bootstrap_port = listener.and_then(|l| start_bootstrap(l, &store, cfg.bootstrap_timeout_secs, &shutdown));
        let advertised_host = match cfg.bootstrap_host.parse::<std::net::IpAddr>() {
            Ok(ip) if ip.is_unspecified() => "127.0.0.1".to_string(),
            _ => cfg.bootstrap_host.clone(),
        };
        Pd {
            role: cfg.role,
            store,
            metrics,
            bootstrap_port,
            advertised_host,
            engine_id: engine_id(bootstrap_port),
            next_block: AtomicU64::new(0),
            shutdown,
        }
    }

    pub(crate) fn counters(&self) -> PdCounters {
        PdCounters {
            transfers: self.metrics.transfers.get(),
            transfer_bytes: self.metrics.transfer_bytes.get(),
            transfer_failures: self.metrics.transfer_failures.get(),
            local_prefills: self.metrics.local_prefills.get(),
            kv_published: self.metrics.kv_published.get(),
            waiting_for_kv: u64::try_from(self.metrics.waiting.get()).unwrap_or(0),
        }
    }

    pub(crate) fn count_local_prefill(&self) {
        self.metrics.local_prefills.inc();
    }

    /// Records `key` as failed (its decode side gets 410).
    pub(crate) fn fail(&self, key: &str, why: &str) {
        self.store.put(key.to_string(), KvState::Failed(why.to_string()));
    }

    /// Records `key` as ready after `delay` (wall) with `tokens` tokens of `bytes` bytes.
    pub(crate) fn publish(&self, key: &str, tokens: u64, bytes: u64, delay: Duration) {
        self.metrics.kv_published.inc();
        self.store.put(key.to_string(), KvState::Ready { at: Instant::now() + delay, tokens, bytes });
    }

    /// A new vLLM transfer of `tokens` prompt tokens: its block ids (one per 16 tokens, the
    /// first unique on this worker) and its bootstrap key.
    pub(crate) fn vllm_transfer(&self, tokens: u64) -> (Vec<u64>, String) {
        let n = tokens.div_ceil(u64::from(crate::BLOCK_TOKENS)).max(1);
        let first = self.next_block.fetch_add(n, Ordering::Relaxed);
        ((first..first + n).collect(), format!("vllm/{}/{first}", self.engine_id))
    }

    /// vLLM's `kv_transfer_params` of a prefill answer (NIXL connector shape).
    pub(crate) fn vllm_params(&self, blocks: &[u64]) -> Value {
        serde_json::json!({"do_remote_prefill": true, "do_remote_decode": false,
            "remote_engine_id": self.engine_id, "remote_block_ids": blocks,
            "remote_host": self.advertised_host, "remote_port": self.bootstrap_port, "tp_size": 1})
    }

    /// Waits for the KV of `src` (a decode request), counting the transfer or its failure.
    ///
    /// # Errors
    /// The 500 to answer: the prefill failed, the transfer timed out, or the bootstrap
    /// server is unreachable.
    pub(crate) async fn receive(&self, src: &KvSource, timeout: Duration) -> Result<(u64, u64), ApiError> {
        struct Waiting<'a>(&'a Gauge);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.dec();
            }
        }
        self.metrics.waiting.inc();
        let w = Waiting(&self.metrics.waiting);
        let r = fetch(src, timeout).await;
        drop(w);
        match r {
            Ok((tokens, bytes)) => {
                self.metrics.transfers.inc();
                self.metrics.transfer_bytes.inc_by(bytes);
                Ok((tokens, bytes))
            }
            Err(e) => {
                self.metrics.transfer_failures.inc();
                Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e))
            }
        }
    }
}

/// The bootstrap key of an SGLang prefill under way: published when the prefill ends, or
/// marked failed — explicitly, or when dropped unpublished (the handler gave up or the
/// client went away), so the decode side learns at once (410) instead of timing out.
pub(crate) struct Handoff<'a> {
    pd: &'a Pd,
    key: Option<String>,
}

impl<'a> Handoff<'a> {
    /// The handoff of `key` on `pd`.
    pub(crate) fn new(pd: &'a Pd, key: &str) -> Self {
        Handoff { pd, key: Some(key.to_string()) }
    }

    /// The KV is ready after `delay`.
    pub(crate) fn publish(mut self, tokens: u64, bytes: u64, delay: Duration) {
        if let Some(k) = self.key.take() {
            self.pd.publish(&k, tokens, bytes, delay);
        }
    }

    /// The prefill failed.
    pub(crate) fn fail(mut self, why: &str) {
        if let Some(k) = self.key.take() {
            self.pd.fail(&k, why);
        }
    }
}

impl Drop for Handoff<'_> {
    fn drop(&mut self) {
        if let Some(k) = self.key.take() {
            self.pd.fail(&k, "prefill abandoned");
        }
    }
}

/// Where a decode request's KV comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct KvSource {
    /// Bootstrap host.
    pub host: String,
    /// Bootstrap port.
    pub port: u16,
    /// Key on that server (room, or `vllm/{engine}/{block}`).
    pub key: String,
}

/// How a request is served, from the worker's role and the request's PD fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Colocated (role both, or no PD fields on a prefill worker).
    Colocated,
    /// A decode worker's request without PD fields: prefilled here (vLLM kv_both).
    LocalPrefill,
    /// SGLang prefill of `bootstrap_room` (the key).
    SglangPrefill(String),
    /// vLLM prefill for a remote decode (`do_remote_decode`).
    VllmPrefill,
    /// Decode with the KV from elsewhere.
    Decode(KvSource),
}

impl Mode {
    /// Whether this request only prefills (one output token, KV published).
    pub(crate) fn is_prefill(&self) -> bool {
        matches!(self, Mode::SglangPrefill(_) | Mode::VllmPrefill)
    }
}

/// The PD fields of a request body (absent and null are the same).
#[derive(serde::Deserialize, Default)]
pub(crate) struct Fields {
    #[serde(default)]
    bootstrap_host: Option<Value>,
    #[serde(default)]
    bootstrap_port: Option<Value>,
    #[serde(default)]
    bootstrap_room: Option<Value>,
    #[serde(default)]
    kv_transfer_params: Option<Value>,
}

/// The mode of a request with `f` on a worker of role `role`.
///
/// # Errors
/// 400 naming the missing or mistyped field (`bootstrap_room`, `bootstrap_host`,
/// `bootstrap_port`, `kv_transfer_params[.field]`).
pub(crate) fn mode(role: Role, f: &Fields) -> Result<Mode, ApiError> {
    if role == Role::Both {
        return Ok(Mode::Colocated);
    }
    let sglang = f.bootstrap_host.is_some() || f.bootstrap_port.is_some() || f.bootstrap_room.is_some();
    if let Some(p) = &f.kv_transfer_params {
        let Some(p) = p.as_object() else {
            return Err(ApiError::bad_field("kv_transfer_params", "`kv_transfer_params` must be an object"));
        };
        let flag = |k: &str| p.get(k).and_then(Value::as_bool).unwrap_or(false);
        return match role {
            Role::Prefill if flag("do_remote_decode") => Ok(Mode::VllmPrefill),
            Role::Prefill => Ok(Mode::Colocated),
            _ if flag("do_remote_prefill") => vllm_source(p).map(Mode::Decode),
            _ => Ok(Mode::LocalPrefill),
        };
    }
    if !sglang {
        return Ok(if role == Role::Decode { Mode::LocalPrefill } else { Mode::Colocated });
    }
    if role == Role::Decode {
        let host = match f.bootstrap_host.as_ref().map(|h| h.as_str().filter(|h| !h.is_empty())) {
            Some(Some(h)) => h.to_string(),
            Some(None) => return Err(ApiError::bad_field("bootstrap_host", "`bootstrap_host` must be a host name")),
            None => {
                return Err(ApiError::bad_field("bootstrap_host", "`bootstrap_host` is required on a decode worker"));
            }
        };
        let room = room(f)?;
        let port = match &f.bootstrap_port {
            None => SGLANG_DEFAULT_BOOTSTRAP_PORT,
            Some(v) => match v.as_u64().and_then(|p| u16::try_from(p).ok()).filter(|p| *p > 0) {
                Some(p) => p,
                None => return Err(ApiError::bad_field("bootstrap_port", "`bootstrap_port` must be a port number")),
            },
        };
        return Ok(Mode::Decode(KvSource { host, port, key: room.to_string() }));
    }
    Ok(Mode::SglangPrefill(room(f)?.to_string()))
}

/// `bootstrap_room`: an integer in [0, 2^63).
fn room(f: &Fields) -> Result<u64, ApiError> {
    match &f.bootstrap_room {
        None => {
            Err(ApiError::bad_field("bootstrap_room", "`bootstrap_room` is required on a prefill or decode worker"))
        }
        Some(v) => v
            .as_u64()
            .filter(|r| *r < 1 << 63)
            .ok_or_else(|| ApiError::bad_field("bootstrap_room", "`bootstrap_room` must be an integer in [0, 2^63)")),
    }
}

/// The KV source of a vLLM decode request's `kv_transfer_params`.
fn vllm_source(p: &serde_json::Map<String, Value>) -> Result<KvSource, ApiError> {
    let bad = |k: &str, what: &str| {
        ApiError::bad_field(&format!("kv_transfer_params.{k}"), format!("`kv_transfer_params.{k}` must be {what}"))
    };
    let host = p.get("remote_host").and_then(Value::as_str).filter(|h| !h.is_empty());
    let host = host.ok_or_else(|| bad("remote_host", "a host name"))?;
    let port = p.get("remote_port").and_then(Value::as_u64).and_then(|v| u16::try_from(v).ok()).filter(|v| *v > 0);
    let port = port.ok_or_else(|| bad("remote_port", "a port number"))?;
    let engine = p.get("remote_engine_id").and_then(Value::as_str).filter(|e| !e.is_empty());
    let engine = engine.ok_or_else(|| bad("remote_engine_id", "a non-empty string"))?;
    let blocks = p.get("remote_block_ids").and_then(Value::as_array).filter(|b| !b.is_empty());
    let first =
        blocks.and_then(|b| b.iter().map(Value::as_u64).collect::<Option<Vec<u64>>>()).and_then(|b| b.first().copied());
    let first = first.ok_or_else(|| bad("remote_block_ids", "a non-empty array of block ids"))?;
    Ok(KvSource { host: host.to_string(), port, key: format!("vllm/{engine}/{first}") })
}

/// `secs` seconds as a duration, NaN and negatives as zero, capped at 10^9 s (so an
/// unvalidated setting never panics).
pub(crate) fn wall_secs(secs: f64) -> Duration {
    Duration::from_secs_f64(if secs.is_nan() { 0.0 } else { secs.clamp(0.0, 1e9) })
}

/// Percent-encodes the bytes of `key` outside `[A-Za-z0-9._~/-]` for a URL path.
fn encode_path(key: &str) -> String {
    let mut s = String::with_capacity(key.len());
    for b in key.bytes() {
        if b.is_ascii_alphanumeric() || b"._~/-".contains(&b) {
            s.push(char::from(b));
        } else {
            s.push_str(&format!("%{b:02X}"));
        }
    }
    s
}

/// `GET http://{host}:{port}/kv/{key}` within `timeout`: the KV's (tokens, bytes), or the
/// error message to answer.
async fn fetch(src: &KvSource, timeout: Duration) -> Result<(u64, u64), String> {
    use http_body_util::BodyExt;
    let KvSource { host, port, key } = src;
    let timed_out = || format!("KV transfer for bootstrap room {key} timed out");
    let unreachable = |e: &dyn std::fmt::Display| format!("cannot reach the bootstrap server {host}:{port}: {e}");
    let deadline = tokio::time::Instant::now() + timeout;
    let connect = tokio::time::timeout_at(deadline, tokio::net::TcpStream::connect((host.as_str(), *port)));
    let stream = match connect.await {
        Err(_) => return Err(timed_out()),
        Ok(Err(e)) => return Err(unreachable(&e)),
        Ok(Ok(s)) => s,
    };
    let exchange = async {
        let (mut send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| unreachable(&e))?;
        tokio::spawn(conn);
        let req = axum::http::Request::get(format!("/kv/{}", encode_path(key)))
            .header(axum::http::header::HOST, format!("{host}:{port}"))
            .body(http_body_util::Empty::<axum::body::Bytes>::new())
            .map_err(|e| unreachable(&e))?;
        let resp = send.send_request(req).await.map_err(|e| unreachable(&e))?;
        let status = resp.status();
        let body = resp.into_body().collect().await.map_err(|e| unreachable(&e))?.to_bytes();
        let v: Value = serde_json::from_slice(&body).unwrap_or_default();
        match status {
            StatusCode::OK => match (v["tokens"].as_u64(), v["bytes"].as_u64()) {
                (Some(t), Some(b)) => Ok((t, b)),
                _ => Err(format!("bad answer from the bootstrap server {host}:{port} for room {key}")),
            },
            StatusCode::GONE => Err(format!("prefill failed for bootstrap room {key}")),
            StatusCode::NOT_FOUND => Err(timed_out()),
            s => Err(format!("bad answer from the bootstrap server {host}:{port} for room {key}: HTTP {s}")),
        }
    };
    tokio::time::timeout_at(deadline, exchange).await.unwrap_or_else(|_| Err(timed_out()))
}

/// The bootstrap server's app: `GET /kv/{key}` (see the module docs).
fn bootstrap_app(store: Arc<KvStore>, timeout_secs: f64) -> Router {
    let timeout = wall_secs(timeout_secs);
    Router::new()
        .route(
            "/kv/{*key}",
            axum::routing::get(move |State(store): State<Arc<KvStore>>, Path(key): Path<String>| async move {
                let deadline = tokio::time::Instant::now() + timeout;
                match store.wait(&key, deadline).await {
                    Some(KvState::Ready { at, tokens, bytes }) => {
                        tokio::time::sleep_until(at.into()).await;
                        Json(serde_json::json!({"tokens": tokens, "bytes": bytes})).into_response()
                    }
                    Some(KvState::Failed(why)) => (
                        StatusCode::GONE,
                        Json(serde_json::json!({"error": format!("prefill failed for {key}: {why}")})),
                    )
                        .into_response(),
                    None => (
                        StatusCode::NOT_FOUND,
                        Json(serde_json::json!({"error": format!("unknown key {key} after {timeout_secs} s")})),
                    )
                        .into_response(),
                }
            }),
        )
        .with_state(store)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(v: Value) -> Fields {
        serde_json::from_value(v).expect("fields")
    }

    #[test]
    fn modes_follow_the_role_and_the_fields() {
        let sg = fields(serde_json::json!({"bootstrap_host": "10.0.0.1", "bootstrap_port": null, "bootstrap_room": 7}));
        assert_eq!(mode(Role::Both, &sg).ok(), Some(Mode::Colocated));
        assert_eq!(mode(Role::Prefill, &sg).ok(), Some(Mode::SglangPrefill("7".into())));
        assert_eq!(
            mode(Role::Decode, &sg).ok(),
            Some(Mode::Decode(KvSource { host: "10.0.0.1".into(), port: 8998, key: "7".into() }))
        );
        let plain = Fields::default();
        assert_eq!(mode(Role::Prefill, &plain).ok(), Some(Mode::Colocated));
        assert_eq!(mode(Role::Decode, &plain).ok(), Some(Mode::LocalPrefill));
        let no_room = fields(serde_json::json!({"bootstrap_host": "h", "bootstrap_port": 1}));
        for role in [Role::Prefill, Role::Decode] {
            assert_eq!(mode(role, &no_room).err().and_then(|e| e.param), Some("bootstrap_room".into()));
        }
        let no_host = fields(serde_json::json!({"bootstrap_room": 1}));
        assert_eq!(mode(Role::Decode, &no_host).err().and_then(|e| e.param), Some("bootstrap_host".into()));
        let big = fields(serde_json::json!({"bootstrap_room": 1u64 << 63}));
        assert_eq!(mode(Role::Prefill, &big).err().and_then(|e| e.param), Some("bootstrap_room".into()));
        let vp = fields(serde_json::json!({"kv_transfer_params": {"do_remote_decode": true}}));
        assert_eq!(mode(Role::Prefill, &vp).ok(), Some(Mode::VllmPrefill));
        let vd = fields(serde_json::json!({"kv_transfer_params": {"do_remote_prefill": true, "remote_host": "h",
            "remote_port": 5, "remote_engine_id": "e", "remote_block_ids": [3, 4]}}));
        assert_eq!(
            mode(Role::Decode, &vd).ok(),
            Some(Mode::Decode(KvSource { host: "h".into(), port: 5, key: "vllm/e/3".into() }))
        );
        for (k, bad) in [
            ("remote_host", serde_json::json!(5)),
            ("remote_port", serde_json::json!("x")),
            ("remote_engine_id", serde_json::json!(null)),
            ("remote_block_ids", serde_json::json!([])),
        ] {
            let mut v = serde_json::json!({"kv_transfer_params": {"do_remote_prefill": true, "remote_host": "h",
                "remote_port": 5, "remote_engine_id": "e", "remote_block_ids": [3]}});
            v["kv_transfer_params"][k] = bad;
            let e = mode(Role::Decode, &fields(v)).err().and_then(|e| e.param);
            assert_eq!(e, Some(format!("kv_transfer_params.{k}")));
        }
    }

    #[test]
    fn the_store_is_bounded_and_drops_the_oldest() {
        let s = KvStore::new(Duration::from_secs(60));
        for i in 0..MAX_KEYS + 10 {
            s.put(i.to_string(), KvState::Failed("x".into()));
        }
        assert!(s.get("0").is_none() && s.get("9").is_none());
        assert!(s.get("10").is_some() && s.get(&(MAX_KEYS + 9).to_string()).is_some());
        assert_eq!(s.inner.lock().map.len(), MAX_KEYS);
    }

    #[test]
    fn paths_are_encoded() {
        assert_eq!(encode_path("vllm/kvsim-1/3"), "vllm/kvsim-1/3");
        assert_eq!(encode_path("a b?"), "a%20b%3F");
    }
}
