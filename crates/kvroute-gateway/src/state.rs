//! Shared gateway state: the worker table, the policy, the ledger, admission and metrics.

use crate::config::GatewayConfig;
use crate::metrics::{Metrics, WorkerLabel};
use kvroute_core::admission::Admission;
use kvroute_core::ledger::LoadLedger;
use kvroute_core::policy::Policy;
use kvroute_core::types::{Health, Nanos, WorkerId, WorkerView};
use parking_lot::{Mutex, RwLock};
use rand_core::SeedableRng;
use serde::Serialize;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Most workers the gateway accepts (bounded table).
pub const MAX_WORKERS: usize = 4096;

/// One worker as the gateway knows it.
#[derive(Debug, Clone, Serialize)]
pub struct Worker {
    /// Dense id used on the hot path.
    pub id: u32,
    /// Base URL.
    pub url: String,
    /// Models served (empty = unknown: serves any model).
    pub models: Vec<String>,
    /// Routability.
    pub health: Health,
    /// Consecutive failed requests (passive) — seed 003's max_worker_retries.
    pub consecutive_failures: u32,
    /// Consecutive failed active checks.
    pub check_failures: u32,
    /// Consecutive passed active checks while unhealthy.
    pub check_successes: u32,
    /// Engine queue length from `/metrics`.
    pub engine_queue: Option<u32>,
    /// Engine running requests from `/metrics`.
    pub engine_running: Option<u32>,
    /// Engine KV cache usage in [0, 1] from `/metrics`.
    pub kv_cache_usage: Option<f64>,
    /// Scraped compute utilisation in [0, 1] (DCGM SM activity), when exported.
    pub sm_util: Option<f64>,
    /// Power draw, watts.
    pub power_watts: Option<f64>,
    /// Decode slots (llama.cpp `/slots`): requests it runs at once; the view's
    /// `capacity.max_concurrent`.
    pub slots: Option<u32>,
    /// Engine-reported prefix-cache hit ratio of prompt tokens since the worker started.
    pub engine_hit_ratio: Option<f64>,
}

impl Worker {
    /// Whether the worker serves `model`.
    pub fn serves(&self, model: &str) -> bool {
        self.models.is_empty() || self.models.iter().any(|m| m == model)
    }
}

/// The policy and its random source, behind one lock.
#[derive(Debug)]
pub struct PolicyState {
    /// The policy.
    pub policy: Box<dyn Policy>,
    /// Its seeded random source.
    pub rng: rand_xoshiro::Xoshiro256PlusPlus,
}

/// Everything the handlers share.
#[derive(Debug)]
pub struct AppState {
    /// Configuration (immutable after start).
    pub cfg: GatewayConfig,
    /// Worker table.
    pub workers: RwLock<Vec<Worker>>,
    /// Policy state.
    pub policy: Mutex<PolicyState>,
    /// Router-side load ledger.
    pub ledger: Mutex<LoadLedger>,
    /// Admission counters per (model, role).
    pub admission: RwLock<Admission>,
    /// HTTP client to the workers.
    pub client: reqwest::Client,
    /// Metrics.
    pub metrics: Metrics,
    /// Monotonic origin of [`AppState::now`].
    pub start: Instant,
    /// Engine-reported prefix state of the workers that publish KV events.
    pub precise: Mutex<kvroute_core::precise::PreciseIndex>,
    /// Request token ids from `/tokenize`, for precise matching.
    pub tokens: Mutex<crate::kv_subscriber::TokenCache>,
    /// The local tokenizer (`tokenizer`), when configured.
    pub tokenizer: Option<Arc<crate::tokenizer::LocalTokenizer>>,
    next_id: AtomicU32,
}

impl AppState {
    /// Builds the state (policy from the registry; no workers yet).
    ///
    /// # Errors
    /// Bad policy or knobs; HTTP client construction failure.
    pub fn new(cfg: GatewayConfig) -> anyhow::Result<Arc<AppState>> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let policy = kvroute_core::registry::build(&cfg.policy, &cfg.knobs_json())?;
        let precise_cfg = kvroute_core::precise::PreciseConfig {
            lower_tier_weight: cfg.kv_lower_tier_weight,
            predict_window_secs: cfg.kv_predict_window_secs,
            ..Default::default()
        };
        let tokenizer = match &cfg.tokenizer {
            Some(p) => {
                let t = crate::tokenizer::LocalTokenizer::load(std::path::Path::new(p))?;
                tracing::info!(source = t.source(), "local tokenizer loaded");
                Some(Arc::new(t))
            }
            None => None,
        };
        // Idle pooled connections are dropped after 4 s: llama-server (cpp-httplib) and
        // uvicorn (vLLM, SGLang) close keep-alive connections idle for 5 s, and a request
        // written to one as the worker closes it fails (a request to llama-server after
        // 5.02 s idle did, in a scratch test). The proxy also sends a request whose pooled
        // connection closed under it once more to the same worker (`proxy`).
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs_f64(cfg.connect_timeout_secs))
            .pool_max_idle_per_host(256)
            .pool_idle_timeout(Duration::from_secs(4))
            .build()?;
        Ok(Arc::new(AppState {
            admission: RwLock::new(Admission::new(cfg.max_in_flight_per_model)),
            policy: Mutex::new(PolicyState { policy, rng: rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(cfg.seed) }),
            cfg,
            workers: RwLock::new(Vec::new()),
            ledger: Mutex::new(LoadLedger::new()),
            client,
            metrics: Metrics::new(),
            start: Instant::now(),
            precise: Mutex::new(kvroute_core::precise::PreciseIndex::new(precise_cfg)),
            tokens: Mutex::new(Default::default()),
            tokenizer,
            next_id: AtomicU32::new(0),
        }))
    }

    /// Time since start, as the routing core's clock.
    pub fn now(&self) -> Nanos {
        Nanos(self.start.elapsed().as_nanos().min(u64::MAX as u128) as u64)
    }

    /// Adds the configured workers (discovering their models; unreachable ones are added
    /// and left to the health checker).
    pub async fn add_initial_workers(self: &Arc<Self>) {
        for u in self.cfg.worker_urls.clone() {
            let _ = self.add_worker(&u).await;
        }
    }

    /// Adds a worker by URL, or returns the existing one's id.
    ///
    /// # Errors
    /// A message for a bad URL or a full table.
    pub async fn add_worker(self: &Arc<Self>, url: &str) -> Result<u32, String> {
        let url = crate::config::check_worker_url(url)?;
        if let Some(w) = self.workers.read().iter().find(|w| w.url == url) {
            return Ok(w.id);
        }
        let models = crate::health::fetch_models(&self.client, &url, self.cfg.health.timeout_secs).await;
        let healthy = models.is_some();
        let models = models.unwrap_or_default();
        {
            let mut adm = self.admission.write();
            for m in &models {
                adm.ensure_model(m);
            }
        }
        let mut ws = self.workers.write();
        if let Some(w) = ws.iter().find(|w| w.url == url) {
            return Ok(w.id);
        }
        if ws.len() >= MAX_WORKERS {
            return Err(format!("the gateway already has {MAX_WORKERS} workers"));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        ws.push(Worker {
            id,
            url: url.clone(),
            models,
            health: if healthy { Health::Healthy } else { Health::Unhealthy },
            consecutive_failures: 0,
            check_failures: 0,
            check_successes: 0,
            engine_queue: None,
            engine_running: None,
            kv_cache_usage: None,
            sm_util: None,
            power_watts: None,
            slots: None,
            engine_hit_ratio: None,
        });
        drop(ws);
        self.metrics.worker_healthy.get_or_create(&WorkerLabel { worker: url.clone() }).set(i64::from(healthy));
        if healthy && self.tokenizer.is_some() {
            // Later recoveries are checked by the health checker.
            tokio::spawn(crate::health::tokenizer_parity(Arc::clone(self), url));
        }
        Ok(id)
    }

    /// Removes a worker by URL and forgets it in the policy's index. Returns whether it
    /// existed.
    pub fn remove_worker(&self, url: &str) -> bool {
        let url = url.trim_end_matches('/');
        let removed = {
            let mut ws = self.workers.write();
            let before = ws.len();
            let mut gone = None;
            ws.retain(|w| {
                if w.url == url {
                    gone = Some(w.id);
                    false
                } else {
                    true
                }
            });
            (before != ws.len()).then_some(gone).flatten()
        };
        if let Some(id) = removed {
            self.policy.lock().policy.on_worker_removed(WorkerId(id));
            self.precise.lock().untrack(WorkerId(id));
            self.metrics.worker_healthy.get_or_create(&WorkerLabel { worker: url.to_string() }).set(0);
            true
        } else {
            false
        }
    }

    /// Views of the workers serving `model`, with ledger and engine signals, plus their URLs.
    pub fn candidates(&self, model: &str) -> (Vec<WorkerView>, Vec<(u32, String)>) {
        let ws = self.workers.read();
        let ledger = self.ledger.lock();
        let mut views = Vec::with_capacity(ws.len());
        let mut urls = Vec::with_capacity(ws.len());
        for w in ws.iter().filter(|w| model.is_empty() || w.serves(model)) {
            let mut v = WorkerView::idle(WorkerId(w.id));
            v.health = w.health;
            ledger.fill(&mut v);
            v.engine_queue = w.engine_queue;
            v.engine_running = w.engine_running;
            v.kv_cache_usage = w.kv_cache_usage;
            v.sm_util = w.sm_util;
            v.power_watts = w.power_watts;
            if let Some(n) = w.slots {
                v.capacity.max_concurrent = n.max(1);
            }
            views.push(v);
            urls.push((w.id, w.url.clone()));
        }
        (views, urls)
    }

    /// Records a failed attempt on `worker`; after `max_worker_retries` consecutive
    /// failures the worker is marked unhealthy and dropped from the policy's index.
    pub fn record_failure(&self, worker: u32) {
        let mut evicted = None;
        {
            let mut ws = self.workers.write();
            if let Some(w) = ws.iter_mut().find(|w| w.id == worker) {
                w.consecutive_failures += 1;
                if w.consecutive_failures >= self.cfg.max_worker_retries && w.health == Health::Healthy {
                    w.health = Health::Unhealthy;
                    w.check_successes = 0;
                    evicted = Some(w.url.clone());
                }
            }
        }
        if let Some(url) = evicted {
            tracing::warn!(worker = %url, "worker failed {} times in a row: out of routing", self.cfg.max_worker_retries);
            self.policy.lock().policy.on_worker_removed(WorkerId(worker));
            self.metrics.worker_healthy.get_or_create(&WorkerLabel { worker: url }).set(0);
        }
    }

    /// Records a successful attempt on `worker`.
    pub fn record_success(&self, worker: u32) {
        let needs = self.workers.read().iter().any(|w| w.id == worker && w.consecutive_failures > 0);
        if needs && let Some(w) = self.workers.write().iter_mut().find(|w| w.id == worker) {
            w.consecutive_failures = 0;
        }
    }

    /// Models served by healthy workers, sorted and deduplicated.
    pub fn models(&self) -> Vec<String> {
        let ws = self.workers.read();
        let mut m: Vec<String> =
            ws.iter().filter(|w| w.health == Health::Healthy).flat_map(|w| w.models.iter().cloned()).collect();
        m.sort();
        m.dedup();
        m
    }
}
