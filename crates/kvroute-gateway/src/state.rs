//! Shared gateway state: the fleet, the per-model routers, admission and metrics.

use crate::config::GatewayConfig;
use crate::fleet::Fleet;
use crate::metrics::{Metrics, WorkerLabel};
use crate::routers::Routers;
use kvroute_core::admission::Admission;
use kvroute_core::types::{Health, Nanos};
use parking_lot::{Mutex, RwLock};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Everything the handlers share.
#[derive(Debug)]
pub struct AppState {
    /// Configuration (immutable after start).
    pub cfg: GatewayConfig,
    /// The workers (read without a lock).
    pub fleet: Fleet,
    /// One router per model, running the live policy.
    pub routers: Routers,
    /// Admission counters per (model, role).
    pub admission: RwLock<Admission>,
    /// HTTP client to the workers.
    pub client: reqwest::Client,
    /// Metrics.
    pub metrics: Metrics,
    /// Monotonic origin of [`AppState::now`].
    pub start: Instant,
    /// Engine-reported prefix state of the workers that publish KV events.
    pub precise: RwLock<kvroute_core::precise::PreciseIndex>,
    /// Request token ids from `/tokenize`, for precise matching.
    pub tokens: Mutex<crate::kv_subscriber::TokenCache>,
    /// The local tokenizer (`tokenizer`), when configured.
    pub tokenizer: Option<Arc<crate::tokenizer::LocalTokenizer>>,
    /// Client headers forwarded to workers (`forward_headers`, parsed once).
    pub forward_headers: Vec<http::HeaderName>,
    /// Shutdown has begun: `/readiness` answers 503 while in-flight requests drain.
    pub draining: std::sync::atomic::AtomicBool,
    /// Cancelled just before the drain deadline: streams still open end with an SSE
    /// error event before their connection is dropped.
    pub cut_streams: tokio_util::sync::CancellationToken,
    /// Client API keys (`api_key_file`); `None`: every client is served.
    pub api_keys: Option<crate::api_keys::ApiKeys>,
    /// The traffic recorder (`record`), when configured.
    pub recorder: Option<crate::record::Recorder>,
    /// The cluster sync over NATS (`nats`), when configured.
    pub sync: Option<Arc<crate::cluster::sync::ReplicaSync>>,
    /// The static workers: `worker_urls` of the configuration in effect, normalised
    /// ([`crate::reload::static_set`]) — the startup list, then each reload's. A reload
    /// removes only these; etcd never removes them. Swapped whole by a reload.
    pub static_workers: arc_swap::ArcSwap<Vec<String>>,
    /// The model cascades in effect (`cascade`), swapped whole by a reload or the etcd
    /// policy key; read once per request without a lock.
    pub cascade: arc_swap::ArcSwap<kvroute_core::cascade::CascadeConfig>,
    /// The LoRA multiplexer (`[[lora.adapters]]`), when there is a catalogue.
    pub lora: Option<crate::lora::Multiplexer>,
    /// The prefill and decode pools' routers, when disaggregation is on (`[pd]`).
    pub pd: Option<crate::pd::PdRouters>,
    /// Each tenant's cache scope (`shared_prefix_tenants`), for [`crate::tenant`].
    pub tenant_scopes: kvroute_core::tenant::Scopes,
    /// `tenant_header`, parsed once.
    pub tenant_header: Option<http::HeaderName>,
    /// This replica's id: `replica_id`, or a random one per start (also its id in the
    /// NATS cluster sync).
    pub replica_id: String,
    /// This replica's name in `Via` (`kvroute-<replica_id>`, [`crate::hops`]).
    pub via_name: String,
    /// The addresses this router's listeners are bound to (set by the server before any
    /// worker is added; empty for an embedder that serves no listener): a worker URL
    /// pointing at one of them is refused.
    pub listen_addrs: RwLock<Vec<std::net::SocketAddr>>,
}

impl AppState {
    /// Builds the state (policy from the registry; no workers yet).
    ///
    /// # Errors
    /// Bad policy or knobs; HTTP client construction failure.
    pub fn new(cfg: GatewayConfig) -> anyhow::Result<Arc<AppState>> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let routers = Routers::new(&cfg.policy, cfg.knobs_json(), cfg.seed)?;
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
        let mut client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs_f64(cfg.connect_timeout_secs))
            .pool_max_idle_per_host(256)
            .pool_idle_timeout(Duration::from_secs(4));
        if let Some(ca) = &cfg.worker_ca_file {
            client = client.tls_certs_merge(crate::tls::worker_roots(std::path::Path::new(ca))?);
        }
        let client = client.build()?;
        let forward_headers = cfg
            .forward_headers
            .iter()
            .map(|h| http::HeaderName::from_bytes(h.as_bytes()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| anyhow::anyhow!("forward_headers: {e}"))?;
        let api_keys = match &cfg.api_key_file {
            Some(p) => Some(crate::api_keys::ApiKeys::load(p, cfg.api_key_rpm, cfg.api_key_tpm)?),
            None => None,
        };
        let tenant_scopes = kvroute_core::tenant::Scopes::new(&cfg.shared_prefix_tenants)
            .map_err(|m| anyhow::anyhow!("shared_prefix_tenants: {m}"))?;
        let tenant_header = match &cfg.tenant_header {
            Some(h) => {
                Some(http::HeaderName::from_bytes(h.as_bytes()).map_err(|e| anyhow::anyhow!("tenant_header: {e}"))?)
            }
            None => None,
        };
        let metrics = Metrics::new();
        let recorder = match &cfg.record {
            Some(path) => Some(crate::record::Recorder::start(
                &crate::record::RecordConfig {
                    path: path.into(),
                    max_bytes: cfg.record_max_bytes,
                    files: cfg.record_files,
                    block_tokens: cfg.record_block_tokens,
                },
                &metrics,
            )?),
            None => None,
        };
        let replica_id = cfg.replica_id.clone().unwrap_or_else(|| format!("r{:016x}", os_random_u64()));
        let sync = cfg
            .nats
            .as_ref()
            .map(|_| crate::cluster::sync::ReplicaSync::new(&cfg.cluster, Some(&replica_id), &metrics));
        Ok(Arc::new(AppState {
            via_name: crate::hops::via_name(&replica_id),
            replica_id,
            listen_addrs: RwLock::new(Vec::new()),
            recorder,
            tenant_scopes,
            tenant_header,
            static_workers: arc_swap::ArcSwap::from_pointee(crate::reload::static_set(&cfg.worker_urls)),
            cascade: arc_swap::ArcSwap::from_pointee(cfg.cascade.clone()),
            lora: crate::lora::Multiplexer::new(&cfg.lora),
            pd: crate::pd::PdRouters::new(&cfg.pd, cfg.seed)?,
            sync,
            api_keys,
            forward_headers,
            draining: std::sync::atomic::AtomicBool::new(false),
            cut_streams: tokio_util::sync::CancellationToken::new(),
            admission: RwLock::new(Admission::with_role_limits(
                cfg.max_in_flight_per_model,
                cfg.pd.max_in_flight_prefill,
                cfg.pd.max_in_flight_decode,
            )),
            routers,
            cfg,
            fleet: Fleet::default(),
            client,
            metrics,
            start: Instant::now(),
            precise: RwLock::new(kvroute_core::precise::PreciseIndex::new(precise_cfg)),
            tokens: Mutex::new(Default::default()),
            tokenizer,
        }))
    }

    /// Time since start, as the routing core's clock.
    pub fn now(&self) -> Nanos {
        Nanos(self.start.elapsed().as_nanos().min(u64::MAX as u128) as u64)
    }

    /// Adds the configured workers (discovering their models; unreachable ones are added
    /// and left to the health checker).
    pub async fn add_initial_workers(self: &Arc<Self>) {
        for u in self.static_workers.load_full().iter() {
            let _ = self.add_worker(u).await;
        }
        for u in self.cfg.pd.urls() {
            let _ = self.add_worker(u).await;
        }
    }

    /// Forgets `worker` in every router (the main one and, with disaggregation, both
    /// pools').
    pub fn forget_worker(&self, worker: kvroute_core::types::WorkerId) {
        self.routers.worker_removed(worker);
        if let Some(pd) = &self.pd {
            pd.worker_removed(worker);
        }
    }

    /// Every router set: the main one and, with disaggregation, both pools'.
    pub fn all_routers(&self) -> Vec<&crate::routers::Routers> {
        let mut v = vec![&self.routers];
        if let Some(pd) = &self.pd {
            v.push(&pd.prefill);
            v.push(&pd.decode);
        }
        v
    }

    /// Adds a worker by URL, or returns the existing one's id.
    ///
    /// # Errors
    /// [`AddWorkerError`]: a refused URL, this router's own listener, a full table.
    pub async fn add_worker(self: &Arc<Self>, url: &str) -> Result<u32, AddWorkerError> {
        self.add_worker_with(url, None).await
    }

    /// Adds a worker, its facts — configured role and capacity, what the worker reports,
    /// and its registration when it comes from etcd — set before it joins the fleet, so no
    /// request sees it without them.
    async fn add_worker_with(
        self: &Arc<Self>,
        url: &str,
        record: Option<&crate::cluster::WorkerRecord>,
    ) -> Result<u32, AddWorkerError> {
        let url = crate::config::check_worker_url(url)?;
        self.cfg.check_worker_allowed(&url)?;
        self.check_not_own(&url).await?;
        if let Some(w) = self.fleet.by_url(&url) {
            return Ok(w.id.0);
        }
        let timeout = self.cfg.health.timeout_secs;
        let models = crate::health::fetch_models(&self.client, &url, timeout).await;
        let healthy = models.is_some();
        let mut models = models.unwrap_or_default();
        if let Some(r) = record.filter(|r| !r.models.is_empty()) {
            models.clone_from(&r.models);
        }
        let probed =
            if healthy { Some(crate::health::probe_capacity(&self.client, &url, timeout).await) } else { None };
        {
            let mut adm = self.admission.write();
            for m in &models {
                adm.ensure_model(m);
            }
        }
        let health = if healthy { Health::Healthy } else { Health::Unhealthy };
        let now = self.now();
        let (w, new) = self.fleet.add_with(&url, models, health, |w| {
            w.models_read_at.store(now.0, std::sync::atomic::Ordering::Relaxed);
            w.set_capacity(crate::fleet::CapacitySource::Config, self.cfg.capacity_of(&url));
            if let Some((capacity, port)) = &probed {
                w.set_capacity(crate::fleet::CapacitySource::Probed, Some(capacity.clone()));
                w.bootstrap_port.set(port.map(u32::from));
            }
            if let Some(r) = record {
                self.apply_record(w, r);
            }
            if let Some((role, port)) = self.cfg.pd.role_of(&url) {
                w.set_role(role);
                if port.is_some() {
                    w.bootstrap_port.set(port.map(u32::from));
                }
            }
        })?;
        if new {
            self.metrics.worker_healthy.get_or_create(&WorkerLabel { worker: url.clone() }).set(i64::from(healthy));
            if healthy && self.tokenizer.is_some() {
                // Later recoveries are checked by the health checker.
                tokio::spawn(crate::health::tokenizer_parity(Arc::clone(self), url));
            }
        }
        Ok(w.id.0)
    }

    /// Refuses a normalised worker URL that points at one of this router's own listeners
    /// ([`AppState::listen_addrs`], [`crate::hops::own_listener`]): a router listed as
    /// its own worker would send each request back to itself.
    ///
    /// # Errors
    /// [`AddWorkerError::OwnListener`] naming the URL and the listener.
    pub async fn check_not_own(&self, url: &str) -> Result<(), AddWorkerError> {
        let bound = self.listen_addrs.read().clone();
        let timeout = Duration::from_secs_f64(self.cfg.health.timeout_secs);
        match crate::hops::own_listener(url, &bound, timeout).await {
            Some(listener) => Err(AddWorkerError::OwnListener { url: url.to_string(), listener }),
            None => Ok(()),
        }
    }

    /// A registration's role, bootstrap port, capacity and record on `w` (the
    /// configuration's `[pd]` lists win over the registered role).
    fn apply_record(&self, w: &crate::fleet::WorkerEntry, record: &crate::cluster::WorkerRecord) {
        w.set_capacity(crate::fleet::CapacitySource::Registry, Some(record.capacity.clone()));
        if self.cfg.pd.role_of(&w.url).is_none() {
            w.set_role(record.role);
            if record.bootstrap_port.is_some() {
                w.bootstrap_port.set(record.bootstrap_port.map(u32::from));
            }
        }
        w.registration.store(Some(Arc::new(record.clone())));
    }

    /// Adds (or updates) a worker from its cluster registration: the record's models, when
    /// it names some, replace discovery; its role, capacity and labels are kept with it.
    ///
    /// # Errors
    /// As [`AppState::add_worker`].
    pub async fn add_registered_worker(
        self: &Arc<Self>,
        record: crate::cluster::WorkerRecord,
    ) -> Result<(), AddWorkerError> {
        self.add_worker_with(&record.url, Some(&record)).await?;
        let w = self.fleet.by_url(&record.url).ok_or_else(|| AddWorkerError::Removed { url: record.url.clone() })?;
        if !record.models.is_empty() {
            {
                let mut adm = self.admission.write();
                for m in &record.models {
                    adm.ensure_model(m);
                }
            }
            w.models.store(Arc::new(record.models.clone()));
        }
        self.apply_record(&w, &record);
        Ok(())
    }

    /// Removes a worker by URL and forgets it in every router's index. Returns whether it
    /// existed.
    pub fn remove_worker(&self, url: &str) -> bool {
        let Some(w) = self.fleet.remove(url) else { return false };
        let url = w.url.to_string();
        self.forget_worker(w.id);
        self.precise.write().untrack(w.id);
        self.metrics.forget_worker(&url);
        true
    }

    /// Records a failed attempt on `worker`; the `max_worker_retries`-th failure in a row
    /// ejects it (out of routing until an inference probe passes) and drops it from every
    /// router's index — unless `max_ejection_share` of the fleet is out already, then it
    /// stays in routing (and is tried again at its next failure).
    pub fn record_failure(&self, worker: &crate::fleet::WorkerEntry) {
        let now = self.now();
        if !worker.record_failure(self.cfg.max_worker_retries, now) {
            return;
        }
        if self.fleet.try_eject(worker, self.cfg.max_ejection_share, now) {
            tracing::warn!(
                worker = %worker.url,
                "worker failed {} requests in a row: out of routing until an inference probe passes",
                self.cfg.max_worker_retries
            );
            crate::metrics::count_outcome(&self.metrics.ejections, "ejected");
            self.forget_worker(worker.id);
            self.metrics.worker_healthy.get_or_create(&WorkerLabel { worker: worker.url.to_string() }).set(0);
        } else {
            tracing::debug!(worker = %worker.url, "not ejected: max_ejection_share of the workers are out already");
            crate::metrics::count_outcome(&self.metrics.ejections, "capped");
        }
    }
}

/// Why a worker was not added.
#[derive(Debug, thiserror::Error)]
pub enum AddWorkerError {
    /// The URL is refused (malformed, credentials, not in `worker_allow`).
    #[error(transparent)]
    Url(#[from] crate::config::WorkerUrlError),
    /// The URL points at one of this router's own listeners (it would loop).
    #[error("`{url}` is this router's own listener ({listener}): a router cannot be its own worker")]
    OwnListener {
        /// The normalised URL.
        url: String,
        /// The listener it reaches.
        listener: std::net::SocketAddr,
    },
    /// The worker table is full.
    #[error(transparent)]
    Full(#[from] crate::fleet::FleetFull),
    /// Removed (by another task) while it was being added.
    #[error("`{url}` was removed meanwhile")]
    Removed {
        /// The URL.
        url: String,
    },
}

/// 64 bits from the operating system's randomness (the standard library's `RandomState`
/// keys are drawn from it): replica ids and the recorder's salt, which must differ between
/// processes and starts and must not be guessable.
pub fn os_random_u64() -> u64 {
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new().hash_one(0x6b76_726f_7574_6552_u64)
}
