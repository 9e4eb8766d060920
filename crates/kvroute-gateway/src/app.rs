//! The application state: the gateway's components composed once at start (fleet, routers,
//! admission, metrics, HTTP client, optional recorder, API keys, LoRA multiplexer, P/D
//! routers, replica sync). Composition only: what the gateway does with them lives in the
//! floors above (`membership`, `policy_control`, `pipeline`, the background tasks).

use crate::config::GatewayConfig;
use crate::fleet::Fleet;
use crate::metrics::Metrics;
use crate::routers::Routers;
use kvroute_core::admission::Admission;
use kvroute_core::types::Nanos;
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
    pub precise: crate::twin::Twin<kvroute_core::precise::PreciseIndex>,
    /// Request token ids from `/tokenize`, for precise matching.
    pub tokens: Mutex<crate::kv_tokens::TokenCache>,
    /// The local tokenizer (`tokenizer`), when configured.
    pub tokenizer: Option<Arc<crate::tokenizer::LocalTokenizer>>,
    /// Client headers forwarded to workers (`forward_headers`, parsed once).
    pub forward_headers: Vec<http::HeaderName>,
    /// Shutdown has begun: `/readiness` answers 503 while in-flight requests drain.
    pub draining: std::sync::atomic::AtomicBool,
    /// Cancelled just before the drain deadline: streams still open end with an SSE
    /// error event before their connection is dropped.
    pub cut_streams: tokio_util::sync::CancellationToken,
    /// Client API keys (`api_key_file`, read again on SIGHUP); `None`: every client is
    /// served.
    pub api_keys: Option<crate::api_keys::KeyFile>,
    /// The traffic recorder (`record`), when configured.
    pub recorder: Option<crate::record::Recorder>,
    /// The cluster sync over NATS (`nats`), when configured.
    pub sync: Option<Arc<crate::cluster::sync::ReplicaSync>>,
    /// The prefix state journal, with `state_dir` ([`crate::cluster::journal`]).
    pub journal: Option<Arc<crate::cluster::journal::PrefixJournal>>,
    /// The static workers: `worker_urls` of the configuration in effect, normalised
    /// ([`crate::model::worker_url::static_set`]) — the startup list, then each reload's. A reload
    /// removes only these; etcd never removes them. Swapped whole by a reload.
    pub static_workers: arc_swap::ArcSwap<Vec<String>>,
    /// The model cascades in effect (`cascade`), swapped whole by a reload or the etcd
    /// policy key; read once per request without a lock.
    pub cascade: arc_swap::ArcSwap<kvroute_core::cascade::CascadeConfig>,
    /// The LoRA multiplexer (`[[lora.adapters]]`), when there is a catalogue.
    pub lora: Option<crate::lora::Multiplexer>,
    /// The KV mover for llama.cpp workers (`[kv_migration]`), when it is on.
    pub kv_mover: Option<Arc<crate::kv_move::KvMover>>,
    /// The prefill and decode pools' routers, when disaggregation is on (`[pd]`).
    pub pd: Option<crate::pd::PdRouters>,
    /// Who a request's tenant is, its cache salt, who sees decision details
    /// ([`crate::tenant`]).
    pub tenancy: crate::tenant::Tenancy,
    /// The request bodies held at once (`max_buffered_body_bytes`), shared by `serve` and
    /// the endpoint picker.
    pub body_budget: crate::body_budget::BodyBudget,
    /// Each tenant's requests in the router (`max_in_flight_per_tenant`), when the router
    /// knows tenants and bounds them.
    pub tenant_in_flight: Option<Arc<crate::model::shares::Shares>>,
    /// This replica's id: `replica_id`, or a random one per start (also its id in the
    /// NATS cluster sync).
    pub replica_id: String,
    /// This replica's name in `Via` (`kvroute-<replica_id>`, [`crate::hops`]).
    pub via_name: String,
    /// Whether the workers registered in etcd are in the fleet: etcd's first list was
    /// applied, or etcd did not answer the first session and the registry saved in
    /// `state_dir` was tried. True from the start without etcd. Restoring saved prefix
    /// state and a peer's snapshot wait for it ([`AppState::registry_settled`]): their
    /// events name workers by URL, and one not in the fleet yet is dropped.
    pub registry: tokio::sync::watch::Sender<bool>,
    /// The addresses this router's listeners are bound to (set by the server before any
    /// worker is added; empty for an embedder that serves no listener): a worker URL
    /// pointing at one of them is refused.
    pub listen_addrs: RwLock<Vec<std::net::SocketAddr>>,
}

/// Longest wait for etcd's first list of workers before saved prefix state or a peer's
/// snapshot is applied ([`AppState::registry_settled`]): more than an etcd session's connect
/// (2 s) and request (5 s) timeouts.
pub const REGISTRY_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

impl AppState {
    /// Builds the state (policy from the registry; no workers yet).
    ///
    /// # Errors
    /// Bad policy or knobs; HTTP client construction failure.
    pub fn new(cfg: GatewayConfig) -> anyhow::Result<Arc<AppState>> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let copies = usize::from(cfg.policy_copies);
        let routers = Routers::new(&cfg.policy, cfg.knobs_json(), cfg.seed, copies)?;
        let precise_cfg = kvroute_core::precise::PreciseConfig {
            lower_tier_weight: cfg.kv_lower_tier_weight,
            predict_window_secs: cfg.kv_predict_window_secs,
            ..Default::default()
        };
        let tokenizer = load_tokenizer(&cfg)?;
        let client = worker_client(&cfg)?;
        let forward_headers = forward_headers(&cfg)?;
        let api_keys = match &cfg.api_key_file {
            Some(p) => Some(crate::api_keys::KeyFile::load(p, cfg.api_key_rpm, cfg.api_key_tpm)?),
            None => None,
        };
        let tenancy = crate::tenant::Tenancy::new(&cfg)?;
        let metrics = Metrics::new();
        let recorder = start_recorder(&cfg, &metrics)?;
        let replica_id =
            cfg.replica_id.clone().unwrap_or_else(|| format!("r{:016x}", crate::model::random::os_random_u64()));
        let fleet = Fleet::default();
        // Other replicas' in-flight requests count in the views only with the sync.
        if cfg.nats.is_some() {
            fleet.count_remote_load();
        }
        let sync = cfg.nats.as_ref().map(|_| {
            crate::cluster::sync::ReplicaSync::new(
                &cfg.cluster,
                Some(&replica_id),
                cfg.sync_refresh_secs,
                Duration::from_millis(cfg.sync_batch_ms),
                &metrics,
            )
        });
        let journal = cfg.state_dir.as_ref().map(|_| Arc::new(crate::cluster::journal::PrefixJournal::new(&metrics)));
        let kv_mover = crate::kv_move::KvMover::new(&cfg.kv_migration, &replica_id, client.clone(), &metrics);
        let body_budget = body_budget(&cfg, api_keys.as_ref(), &metrics);
        let tenant_in_flight = tenant_shares(&cfg, api_keys.as_ref())
            .filter(|_| cfg.max_in_flight_per_tenant > 0)
            .map(|n| Arc::new(crate::model::shares::Shares::new(n, u64::from(cfg.max_in_flight_per_tenant))));
        Ok(Arc::new(AppState {
            via_name: crate::hops::via_name(&replica_id),
            kv_mover,
            replica_id,
            listen_addrs: RwLock::new(Vec::new()),
            registry: tokio::sync::watch::Sender::new(cfg.etcd.is_empty()),
            recorder,
            tenancy,
            body_budget,
            tenant_in_flight,
            static_workers: arc_swap::ArcSwap::from_pointee(crate::model::worker_url::static_set(&cfg.worker_urls)),
            cascade: arc_swap::ArcSwap::from_pointee(cfg.cascade.clone()),
            lora: crate::lora::Multiplexer::new(&cfg.lora),
            pd: crate::pd::PdRouters::new(&cfg.pd, cfg.seed, copies)?,
            sync,
            journal,
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
            fleet,
            client,
            metrics,
            start: Instant::now(),
            precise: crate::twin::Twin::of(kvroute_core::precise::PreciseIndex::new(precise_cfg), copies),
            tokens: Mutex::new(Default::default()),
            tokenizer,
        }))
    }

    /// The handles [`crate::kv_tokens::request_tokens`] reads.
    pub fn token_sources(&self) -> crate::kv_tokens::TokenSources<'_> {
        crate::kv_tokens::TokenSources {
            client: &self.client,
            cache: &self.tokens,
            fleet: &self.fleet,
            precise: &self.precise,
        }
    }

    /// Time since start, as the routing core's clock.
    pub fn now(&self) -> Nanos {
        Nanos(self.start.elapsed().as_nanos().min(u64::MAX as u128) as u64)
    }

    /// Waits until the workers registered in etcd are in the fleet ([`AppState::registry`]),
    /// at most `max`; false when they were not by then (etcd slower than its own connect
    /// and request timeouts).
    pub async fn registry_settled(&self, max: std::time::Duration) -> bool {
        let mut rx = self.registry.subscribe();
        matches!(tokio::time::timeout(max, rx.wait_for(|settled| *settled)).await, Ok(Ok(_)))
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
}

/// How many tenant shares the router keeps ([`crate::model::shares::Shares`]): one per
/// tenant a key file may name ([`crate::api_keys::MAX_TENANT_SHARES`]: a reload may add
/// tenants), else [`crate::model::shares::HEADER_TENANT_SHARES`] with
/// `tenant_header`; `None` when it knows no tenants.
fn tenant_shares(cfg: &GatewayConfig, keys: Option<&crate::api_keys::KeyFile>) -> Option<usize> {
    match keys {
        Some(_) => Some(crate::api_keys::MAX_TENANT_SHARES),
        None => cfg.tenant_header.as_ref().map(|_| crate::model::shares::HEADER_TENANT_SHARES),
    }
}

/// The body budget (`max_buffered_body_bytes`), with a share per tenant
/// (`max_buffered_body_bytes_per_tenant`, at least `max_body_bytes`) when the router knows
/// tenants: one per key-file tenant, else [`crate::model::shares::HEADER_TENANT_SHARES`]
/// hashed over with `tenant_header`.
fn body_budget(
    cfg: &GatewayConfig,
    keys: Option<&crate::api_keys::KeyFile>,
    metrics: &Metrics,
) -> crate::body_budget::BodyBudget {
    let per_tenant = cfg.max_buffered_body_bytes_per_tenant;
    let shares =
        tenant_shares(cfg, keys).filter(|_| per_tenant > 0).map(|n| (n, per_tenant.max(cfg.max_body_bytes as u64)));
    crate::body_budget::BodyBudget::new(cfg.max_buffered_body_bytes, shares, metrics.buffered_body_bytes.clone())
}

/// The local tokenizer of `tokenizer`, when configured.
fn load_tokenizer(cfg: &GatewayConfig) -> anyhow::Result<Option<Arc<crate::tokenizer::LocalTokenizer>>> {
    Ok(match &cfg.tokenizer {
        Some(p) => {
            let t = crate::tokenizer::LocalTokenizer::load(std::path::Path::new(p))?;
            tracing::info!(source = t.source(), "local tokenizer loaded");
            Some(Arc::new(t))
        }
        None => None,
    })
}

/// The HTTP client to the workers: connect timeout, idle pool, and the CAs of
/// `worker_ca_file`.
fn worker_client(cfg: &GatewayConfig) -> anyhow::Result<reqwest::Client> {
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
    Ok(client.build()?)
}

/// `forward_headers`, parsed once.
fn forward_headers(cfg: &GatewayConfig) -> anyhow::Result<Vec<http::HeaderName>> {
    cfg.forward_headers
        .iter()
        .map(|h| http::HeaderName::from_bytes(h.as_bytes()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| anyhow::anyhow!("forward_headers: {e}"))
}

/// The traffic recorder of `record`, started, when configured.
fn start_recorder(cfg: &GatewayConfig, metrics: &Metrics) -> anyhow::Result<Option<crate::record::Recorder>> {
    Ok(match &cfg.record {
        Some(path) => Some(crate::record::Recorder::start(
            &crate::record::RecordConfig {
                path: path.into(),
                max_bytes: cfg.record_max_bytes,
                files: cfg.record_files,
                block_tokens: cfg.record_block_tokens,
            },
            metrics,
        )?),
        None => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::types::Health;

    /// With `nats`, the views a request decides on count the other replicas' requests in
    /// flight (the fleet reads them only when told to); without it they are left out.
    #[test]
    fn with_the_sync_the_views_count_the_other_replicas_load() {
        for (nats, in_flight) in [(None, 0), (Some("nats://127.0.0.1:1".to_string()), 1)] {
            let s = AppState::new(GatewayConfig { nats: nats.clone(), ..GatewayConfig::default() }).expect("state");
            let (w, _) = s.fleet.add("http://127.0.0.1:9", vec!["m".into()], Health::Healthy).expect("add");
            let _remote = w.remote_load.dispatched(10, 1);
            assert_eq!(s.fleet.candidates("m").views[0].in_flight, in_flight, "nats {nats:?}");
        }
    }
}
