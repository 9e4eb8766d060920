//! Prometheus metrics of the gateway (prometheus-client), named in the field's terms.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::collections::{HashMap, HashSet};

/// Labels of `kvroute_requests_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// URL of the worker the request was last sent to (empty when it was sent to none).
    pub worker: String,
    /// Policy name.
    pub policy: String,
    /// Decision branch.
    pub branch: String,
    /// ok, client_error, rejected, timeout, upstream_error, cancelled.
    pub outcome: String,
}

/// Labels with only a worker.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerLabel {
    /// Worker URL.
    pub worker: String,
}

/// Labels with only a model.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabel {
    /// Model name.
    pub model: String,
}

/// Labels of `kvroute_tenant_requests_total` (tenants come from the API key file only).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantLabels {
    /// The key's tenant (`-` for a key without one).
    pub tenant: String,
    /// `admitted`, `rate_limited_requests`, `rate_limited_tokens`, `over_body_share` or
    /// `over_in_flight` ([`TENANT_OUTCOMES`]).
    pub outcome: String,
}

/// Every `outcome` of `kvroute_tenant_requests_total` (a tenant gone from the key file has
/// its series removed: these are the ones it may have).
pub const TENANT_OUTCOMES: [&str; 5] =
    ["admitted", "rate_limited_requests", "rate_limited_tokens", "over_body_share", "over_in_flight"];

/// Labels of `kvroute_kv_migrations_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KvMoveLabels {
    /// `save`, `restore` or `remove` (a file the router deleted).
    pub op: String,
    /// `save`: `saved`, `failed`, `skipped` (saves at `max_concurrent_saves`). `restore`:
    /// `restored`, `failed`, `not_worth` (a file matched but recomputing was predicted
    /// cheaper). `remove`: `evicted` (limits), `expired` (`file_ttl_secs`), `failed`.
    pub outcome: String,
}

/// Label of the KV mover's per-operation byte counter and time histogram.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KvOpLabel {
    /// `save` or `restore`.
    pub op: String,
}

/// Buckets of `kvroute_kv_migration_seconds`, seconds (1 ms to ~65 s).
fn kv_move_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

/// Labels of `kvroute_prefix_source`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabels {
    /// `precise` (engine KV events), `slots` (a llama.cpp worker's slot record) or
    /// `approximate` (the policy's own index). Static: counted on every request without
    /// allocating.
    pub source: &'static str,
    /// Why approximate: `no_events` (the chosen worker publishes none), `not_tokenized`
    /// (the request could not be tokenized), `no_block_size` (no BlockStored seen yet);
    /// empty for precise.
    pub reason: &'static str,
}

/// Labels of `kvroute_local_tokenize` and `kvroute_worker_ejections` (a fixed set of values).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    /// `kvroute_local_tokenize`: `ok`, or why the request was routed on its text instead
    /// (`unsupported_request`, `template_error`, `no_chat_template`, `tokenizer_error`).
    /// `kvroute_worker_ejections`: `ejected`, or `capped` (`max_ejection_share` of the
    /// workers were out already).
    pub outcome: String,
}

/// Counts one `outcome` in a counter family labelled by [`OutcomeLabel`].
pub fn count_outcome(family: &Family<OutcomeLabel, Counter>, outcome: &str) {
    family.get_or_create(&OutcomeLabel { outcome: outcome.into() }).inc();
}

/// Labels of `kvroute_policy_updates`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PolicyUpdateLabels {
    /// Where the setting came from: `etcd`.
    pub source: String,
    /// `applied`, or `rejected` (invalid JSON, unknown policy or bad knob: the last good
    /// policy stays).
    pub outcome: String,
}

/// Labels of `kvroute_cascade_steps` and `kvroute_cascade_tokens`: a step's model (one of
/// the configured chains' models, a bounded set) and what happened.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CascadeLabels {
    /// The step's model.
    pub model: String,
    /// Steps: `accepted` (confident, or the chain's last model), `escalated` (below the
    /// threshold), `failed` (the step's workers failed after their retries; the request
    /// ends there). Tokens: `prompt` or `completion`.
    pub outcome: String,
}

/// An `f64` gauge.
pub type FloatGauge = Gauge<f64, std::sync::atomic::AtomicU64>;

/// Every gateway metric.
#[derive(Debug)]
pub struct Metrics {
    /// The registry rendered at `/metrics`.
    pub registry: Registry,
    /// Requests by worker, policy, branch and outcome.
    pub requests: Family<RequestLabels, Counter>,
    /// The label sets of `requests` per worker, so a removed worker's series can be
    /// dropped ([`Metrics::forget_worker`]); written only when a label set is new.
    request_series: parking_lot::Mutex<HashMap<String, HashSet<RequestLabels>>>,
    /// Requests per API-key tenant and outcome.
    pub tenant_requests: Family<TenantLabels, Counter>,
    /// Time to decide, seconds (wall clock: includes any time the thread was descheduled).
    pub decision_seconds: Histogram,
    /// CPU time of the deciding thread during the decision, seconds: the decision's own
    /// work, without the time the OS gave the core to another thread.
    pub decision_cpu_seconds: Histogram,
    /// The part of the decision spent waiting for the model router's read lock, seconds.
    pub decision_lock_wait_seconds: Histogram,
    /// Matched prefix / routing key per decision.
    pub match_rate: Histogram,
    /// Time to first byte of the response at the router, seconds.
    pub ttft_seconds: Histogram,
    /// Time to the last byte, seconds.
    pub e2e_seconds: Histogram,
    /// Size of the policy's prefix index (its units).
    pub index_size: Gauge,
    /// Bytes of request bodies the router holds now, from its body budget
    /// (`max_buffered_body_bytes`; whole KiB per body).
    pub buffered_body_bytes: Gauge,
    /// Admission rejections by model.
    pub admission_rejections: Family<ModelLabel, Counter>,
    /// Decisions made again because a request was dispatched to the chosen worker while
    /// they were being made (`pipeline::MAX_REDECISIONS`).
    pub decisions_redone: Counter,
    /// Attempts retried on another worker.
    pub retries: Counter,
    /// Requests sent again to the same worker after its keep-alive connection closed under
    /// them.
    pub stale_connection_resends: Counter,
    /// Requests sent to a named llama.cpp slot (`llama_slot_routing`).
    pub llama_slot_requests: Counter,
    /// Of those, requests whose slot was busy: they wait for it rather than recompute
    /// their prefix in another slot.
    pub llama_slot_waits: Counter,
    /// The KV mover's operations by op and outcome (`[kv_migration]`).
    pub kv_migrations: Family<KvMoveLabels, Counter>,
    /// Bytes the KV mover's saves wrote and restores read.
    pub kv_migration_bytes: Family<KvOpLabel, Counter>,
    /// Wall time of the KV mover's saves and restores, seconds.
    pub kv_migration_seconds: Family<KvOpLabel, Histogram, fn() -> Histogram>,
    /// TTFT a restore was predicted to save (recompute minus restore), seconds.
    pub kv_migration_predicted_gain_seconds: Histogram,
    /// Files the KV mover keeps in `slot_save_dir`, and their bytes.
    pub kv_migration_files: Gauge,
    /// Bytes of those files.
    pub kv_migration_file_bytes: Gauge,
    /// 1 when the worker is routable.
    pub worker_healthy: Family<WorkerLabel, Gauge>,
    /// Requests in flight per worker (router's ledger).
    pub worker_in_flight: Family<WorkerLabel, Gauge>,
    /// KV-event batches applied per worker.
    pub kv_batches: Family<WorkerLabel, Counter>,
    /// Sequence gaps seen per worker.
    pub kv_gaps: Family<WorkerLabel, Counter>,
    /// Batches recovered through the replay socket per worker.
    pub kv_replayed: Family<WorkerLabel, Counter>,
    /// Publisher restarts (sequence went back) per worker.
    pub kv_restarts: Family<WorkerLabel, Counter>,
    /// Malformed messages per worker.
    pub kv_errors: Family<WorkerLabel, Counter>,
    /// Events and fields skipped per worker (unknown types or fields, other KV groups).
    pub kv_skipped: Family<WorkerLabel, Counter>,
    /// Startup parity check per worker: 1 ok, 0 mismatch, −1 inconclusive.
    pub kv_parity: Family<WorkerLabel, Gauge>,
    /// Decisions by where the chosen worker's prefix state came from.
    pub prefix_source: Family<SourceLabels, Counter>,
    /// Requests tokenized by the local tokenizer, by outcome.
    pub local_tokenize: Family<OutcomeLabel, Counter>,
    /// Workers reaching `max_worker_retries` failures in a row: ejected, or kept in
    /// routing because `max_ejection_share` of the fleet was out.
    pub ejections: Family<OutcomeLabel, Counter>,
    /// Startup tokenizer parity per worker: 1 the local tokenizer gives the worker's
    /// tokens, 0 mismatch, −1 inconclusive.
    pub tokenizer_parity: Family<WorkerLabel, Gauge>,
    /// Engine-reported prefix-cache hit ratio of a worker's prompt tokens since it started
    /// (llama.cpp `prompt_tokens_cached_total` over cached + processed; vLLM
    /// `prefix_cache_hits_total` over `prefix_cache_queries_total`).
    pub engine_prefix_hit_ratio: Family<WorkerLabel, FloatGauge>,
    /// Decode slots of a worker (llama.cpp `/slots`: parallel sequences).
    pub worker_slots: Family<WorkerLabel, Gauge>,
    /// Measured TTFT over the policy's prediction, per worker (streamed requests routed by a
    /// predicting policy, `least_ttft`): 1 is exact; the policy's calibration drives it to 1.
    pub ttft_prediction_ratio: Family<WorkerLabel, Histogram, fn() -> Histogram>,
    /// Prompt tokens the decision expected cached, per worker, counted for requests whose
    /// engine reported its cached tokens (the pair with `cached_tokens_reported`).
    pub cached_tokens_predicted: Family<WorkerLabel, Counter>,
    /// Prompt tokens the engine reported cached (`usage.prompt_tokens_details.cached_tokens`,
    /// SGLang `meta_info.cached_tokens`, llama.cpp `timings.cache_n`), per worker.
    pub cached_tokens_reported: Family<WorkerLabel, Counter>,
    /// 1 while the cluster registry's etcd connection (watches included) is up, else 0.
    pub etcd_connected: Gauge,
    /// Workers currently registered through etcd.
    pub etcd_workers: Gauge,
    /// etcd sessions established (connect, list, watch) since the start: the first one,
    /// then one per reconnect, each with a full re-list of the registry. A steady
    /// connection keeps it at 1; a rising count is a flapping connection.
    pub etcd_connects: Counter,
    /// 1 while the etcd registry in use is the last known list read from `state_dir`
    /// (the replica started while etcd was unreachable), 0 once etcd answered and its list
    /// replaced it (or when none was loaded).
    pub etcd_registry_stale: Gauge,
    /// Live policy settings received, by source and outcome.
    pub policy_updates: Family<PolicyUpdateLabels, Counter>,
    /// Requests for catalogue LoRA adapters, by outcome: `loaded` (a worker had it),
    /// `load` (one was asked to load it), `unavailable` (loading is off).
    pub lora_requests: Family<OutcomeLabel, Counter>,
    /// LoRA adapter loads the router asked for, by outcome: `ok`, `failed`.
    pub lora_loads: Family<OutcomeLabel, Counter>,
    /// Requests of a disaggregated fleet, by placement: `split`, `colocated`.
    pub pd_requests: Family<OutcomeLabel, Counter>,
    /// Failed halves of split requests (each retried with the next worker of that pool):
    /// `prefill`, `decode`.
    pub pd_failures: Family<OutcomeLabel, Counter>,
    /// Cascade steps by model and outcome.
    pub cascade_steps: Family<CascadeLabels, Counter>,
    /// Tokens of cascade steps by model and kind (the workers' `usage`).
    pub cascade_tokens: Family<CascadeLabels, Counter>,
    /// 1 while this replica's NATS connection (cluster sync) is up, else 0.
    pub nats_connected: Gauge,
    /// Routing events of the cluster sync, by outcome: `published`, `dropped` (the queue
    /// was full or NATS refused them), `applied` (another replica's), `unknown_worker`,
    /// `policy_mismatch` (applied to the load view only), `snapshot` (applied from a
    /// peer's snapshot at start).
    pub sync_events: Family<OutcomeLabel, Counter>,
    /// Event batches of other replicas that never arrived (sequence gaps).
    pub sync_gaps: Counter,
    /// Time from a batch's publication by another replica to its application here, seconds.
    pub sync_lag_seconds: Histogram,
    /// Requests other replicas report in flight (their open load tickets held here).
    pub sync_remote_in_flight: Gauge,
    /// Other replicas heard from in the last 10 s.
    pub sync_peers: Gauge,
    /// Other replicas gone from this one's view, by outcome: `goodbye` (it said it was
    /// stopping: its in-flight load released at once), `silent` (nothing heard for 10 s: a
    /// crash, a partition).
    pub sync_peers_left: Family<OutcomeLabel, Counter>,
    /// Configuration reloads on SIGHUP, by outcome (`applied`, `unchanged`, `invalid`).
    pub config_reloads: Family<OutcomeLabel, Counter>,
    /// `api_key_file` reads on SIGHUP, by outcome (`applied`, `unchanged`, `invalid`).
    pub api_key_reloads: Family<OutcomeLabel, Counter>,
    /// `admin_token_file` reads on reloads, by outcome (`applied`: another token in effect,
    /// `unchanged`, `invalid`: the token in effect stays).
    pub admin_token_reloads: Family<OutcomeLabel, Counter>,
    /// Trace lines of the traffic recorder (`record`), by outcome: `written`, `dropped`
    /// (its queue was full), `error` (the write failed).
    pub record_lines: Family<OutcomeLabel, Counter>,
    /// The prefix state journal (`state_dir`), by outcome: `recorded`, `dropped` (its queue
    /// was full), `restored` and `skipped` (at start, from the saved file).
    pub prefix_state_events: Family<OutcomeLabel, Counter>,
    /// Endpoint-picker mode (`epp_listen`): requests picked, by outcome — `picked`, or
    /// `immediate_<status>` for one answered by kvroute itself (an immediate response).
    pub epp_requests: Family<OutcomeLabel, Counter>,
    /// Endpoint-picker mode: which endpoint the gateway reports served a picked request
    /// (`x-gateway-destination-endpoint-served`) — `chosen`, `fallback` (the gateway
    /// retried down the list) or `unreported`.
    pub epp_served: Family<OutcomeLabel, Counter>,
    /// Endpoint-picker mode: response-side messages observed, by kind (`response_headers`,
    /// `response_body`, `response_trailers`) and `closed_early` (the gateway closed the
    /// stream before the response ended: the client went away).
    pub epp_observed: Family<OutcomeLabel, Counter>,
    /// Endpoint-picker mode: time from the request's last message to the pick, seconds.
    pub epp_pick_seconds: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers every metric, family by family, in the order `/metrics` lists them.
    pub fn new() -> Self {
        let mut m = Self::unregistered();
        m.register_requests();
        m.register_dispatch();
        m.register_workers();
        m.register_kv_events();
        m.register_worker_signals();
        m.register_etcd();
        m.register_serving_modes();
        m.register_sync();
        m.register_operations();
        m
    }

    /// Every metric at zero, none registered yet; each histogram's buckets are chosen here.
    fn unregistered() -> Self {
        Metrics {
            registry: Registry::default(),
            requests: Family::default(),
            request_series: parking_lot::Mutex::default(),
            tenant_requests: Family::default(),
            decision_seconds: Histogram::new(exponential_buckets(1e-7, 2.0, 20)),
            decision_cpu_seconds: Histogram::new(exponential_buckets(1e-7, 2.0, 20)),
            decision_lock_wait_seconds: Histogram::new(exponential_buckets(1e-7, 2.0, 20)),
            match_rate: Histogram::new([0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0]),
            ttft_seconds: Histogram::new(exponential_buckets(0.001, 2.0, 18)),
            e2e_seconds: Histogram::new(exponential_buckets(0.001, 2.0, 20)),
            index_size: Gauge::default(),
            buffered_body_bytes: Gauge::default(),
            admission_rejections: Family::default(),
            decisions_redone: Counter::default(),
            retries: Counter::default(),
            stale_connection_resends: Counter::default(),
            llama_slot_requests: Counter::default(),
            llama_slot_waits: Counter::default(),
            kv_migrations: Family::default(),
            kv_migration_bytes: Family::default(),
            kv_migration_seconds: Family::new_with_constructor(kv_move_histogram),
            kv_migration_predicted_gain_seconds: Histogram::new(exponential_buckets(0.001, 2.0, 17)),
            kv_migration_files: Gauge::default(),
            kv_migration_file_bytes: Gauge::default(),
            worker_healthy: Family::default(),
            worker_in_flight: Family::default(),
            kv_batches: Family::default(),
            kv_gaps: Family::default(),
            kv_replayed: Family::default(),
            kv_restarts: Family::default(),
            kv_errors: Family::default(),
            kv_skipped: Family::default(),
            kv_parity: Family::default(),
            prefix_source: Family::default(),
            local_tokenize: Family::default(),
            ejections: Family::default(),
            tokenizer_parity: Family::default(),
            engine_prefix_hit_ratio: Family::default(),
            worker_slots: Family::default(),
            ttft_prediction_ratio: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.125, std::f64::consts::SQRT_2, 13))
            }),
            cached_tokens_predicted: Family::default(),
            cached_tokens_reported: Family::default(),
            etcd_connected: Gauge::default(),
            etcd_workers: Gauge::default(),
            etcd_connects: Counter::default(),
            etcd_registry_stale: Gauge::default(),
            policy_updates: Family::default(),
            lora_requests: Family::default(),
            lora_loads: Family::default(),
            pd_requests: Family::default(),
            pd_failures: Family::default(),
            cascade_steps: Family::default(),
            cascade_tokens: Family::default(),
            nats_connected: Gauge::default(),
            sync_events: Family::default(),
            sync_gaps: Counter::default(),
            sync_lag_seconds: Histogram::new(exponential_buckets(1e-4, 2.0, 18)),
            sync_remote_in_flight: Gauge::default(),
            sync_peers: Gauge::default(),
            sync_peers_left: Family::default(),
            config_reloads: Family::default(),
            api_key_reloads: Family::default(),
            admin_token_reloads: Family::default(),
            record_lines: Family::default(),
            prefix_state_events: Family::default(),
            epp_requests: Family::default(),
            epp_served: Family::default(),
            epp_observed: Family::default(),
            epp_pick_seconds: Histogram::new(exponential_buckets(1e-6, 2.0, 24)),
        }
    }

    /// Requests and their decisions: counts by outcome and tenant, decision time, match
    /// rate, latency, the policy's index size.
    fn register_requests(&mut self) {
        let r = &mut self.registry;
        r.register(
            "kvroute_requests",
            "Requests by worker, policy, decision branch and outcome",
            self.requests.clone(),
        );
        r.register(
            "kvroute_tenant_requests",
            "Requests by API-key tenant and outcome (admitted, rate_limited_requests, rate_limited_tokens, over_body_share, over_in_flight)",
            self.tenant_requests.clone(),
        );
        r.register("kvroute_decision_seconds", "Routing decision time", self.decision_seconds.clone());
        r.register(
            "kvroute_decision_cpu_seconds",
            "CPU time of the deciding thread during a routing decision (its own work, without preemption)",
            self.decision_cpu_seconds.clone(),
        );
        r.register(
            "kvroute_decision_lock_wait_seconds",
            "Part of a routing decision spent waiting for the model router's lock (held by a commit, observation or eviction slice)",
            self.decision_lock_wait_seconds.clone(),
        );
        r.register("kvroute_match_rate", "Matched prefix over routing key length", self.match_rate.clone());
        r.register("kvroute_ttft_seconds", "Time to first response byte at the router", self.ttft_seconds.clone());
        r.register("kvroute_e2e_seconds", "Time to the last response byte at the router", self.e2e_seconds.clone());
        r.register(
            "kvroute_index_size",
            "Size of the policy's prefix index (chars, tokens or blocks)",
            self.index_size.clone(),
        );
        r.register(
            "kvroute_buffered_body_bytes",
            "Bytes of request bodies held now (and of endpoint-picker messages still arriving), of max_buffered_body_bytes (whole KiB per body)",
            self.buffered_body_bytes.clone(),
        );
    }

    /// Admission and dispatch: rejections, redone decisions, retries, resends, llama.cpp slots.
    fn register_dispatch(&mut self) {
        let r = &mut self.registry;
        r.register(
            "kvroute_admission_rejections",
            "Requests rejected by admission (503)",
            self.admission_rejections.clone(),
        );
        r.register("kvroute_retries", "Attempts retried (on the same worker or the next)", self.retries.clone());
        r.register(
            "kvroute_decisions_redone",
            "Decisions made again because a request was sent to the chosen worker meanwhile",
            self.decisions_redone.clone(),
        );
        r.register(
            "kvroute_stale_connection_resends",
            "Requests sent again to the same worker after its keep-alive connection closed under them",
            self.stale_connection_resends.clone(),
        );
        r.register(
            "kvroute_llama_slot_requests",
            "Requests sent to a named llama.cpp slot (llama_slot_routing)",
            self.llama_slot_requests.clone(),
        );
        r.register(
            "kvroute_llama_slot_waits",
            "Requests sent to a busy llama.cpp slot that holds their prefix (they wait for it)",
            self.llama_slot_waits.clone(),
        );
        r.register(
            "kvroute_kv_migrations",
            "KV mover operations by op (save, restore, remove) and outcome",
            self.kv_migrations.clone(),
        );
        r.register(
            "kvroute_kv_migration_bytes",
            "Bytes the KV mover's saves wrote and restores read",
            self.kv_migration_bytes.clone(),
        );
        r.register(
            "kvroute_kv_migration_seconds",
            "Wall time of the KV mover's saves and restores",
            self.kv_migration_seconds.clone(),
        );
        r.register(
            "kvroute_kv_migration_predicted_gain_seconds",
            "TTFT a restore was predicted to save (recomputing minus restoring)",
            self.kv_migration_predicted_gain_seconds.clone(),
        );
        r.register(
            "kvroute_kv_migration_files",
            "Files the KV mover keeps in slot_save_dir",
            self.kv_migration_files.clone(),
        );
        r.register(
            "kvroute_kv_migration_file_bytes",
            "Bytes of the files the KV mover keeps in slot_save_dir",
            self.kv_migration_file_bytes.clone(),
        );
    }

    /// Each worker's health and load.
    fn register_workers(&mut self) {
        let r = &mut self.registry;
        r.register("kvroute_worker_healthy", "1 when the worker is routable", self.worker_healthy.clone());
        r.register("kvroute_worker_in_flight", "Requests in flight per worker", self.worker_in_flight.clone());
    }

    /// The engines' KV events per worker, and where each decision's prefix state came from.
    fn register_kv_events(&mut self) {
        let r = &mut self.registry;
        r.register("kvroute_kv_event_batches", "KV-event batches applied", self.kv_batches.clone());
        r.register("kvroute_kv_event_gaps", "KV-event sequence gaps", self.kv_gaps.clone());
        r.register("kvroute_kv_event_replayed", "KV-event batches recovered by replay", self.kv_replayed.clone());
        r.register(
            "kvroute_kv_event_restarts",
            "KV-event publisher restarts (sequence went back; worker state cleared)",
            self.kv_restarts.clone(),
        );
        r.register("kvroute_kv_event_errors", "Malformed KV-event messages", self.kv_errors.clone());
        r.register(
            "kvroute_kv_event_skipped",
            "KV events or fields skipped (unknown, or not the main attention group)",
            self.kv_skipped.clone(),
        );
        r.register(
            "kvroute_kv_parity",
            "Startup KV-event parity check: 1 router and engine hash the same tokens, 0 mismatch, -1 inconclusive",
            self.kv_parity.clone(),
        );
        r.register(
            "kvroute_prefix_source",
            "Decisions by the source of the chosen worker's prefix state",
            self.prefix_source.clone(),
        );
    }

    /// What the router learns of the workers: ejections, local tokenization and its parity,
    /// the engines' own cache and slot figures, the accuracy of its predictions.
    fn register_worker_signals(&mut self) {
        let r = &mut self.registry;
        r.register(
            "kvroute_worker_ejections",
            "Workers reaching max_worker_retries failures in a row: ejected, or capped by max_ejection_share",
            self.ejections.clone(),
        );
        // Both outcomes are exposed from the start at 0: a series born at 1 shows no
        // increase()/rate() in Prometheus, so a router's first ejection would not show.
        for outcome in ["ejected", "capped"] {
            drop(self.ejections.get_or_create(&OutcomeLabel { outcome: outcome.into() }));
        }
        r.register(
            "kvroute_local_tokenize",
            "Requests tokenized locally for routing keys, by outcome",
            self.local_tokenize.clone(),
        );
        r.register(
            "kvroute_tokenizer_parity",
            "Startup tokenizer parity: 1 local tokens equal the worker's, 0 mismatch, -1 inconclusive",
            self.tokenizer_parity.clone(),
        );
        r.register(
            "kvroute_engine_prefix_hit_ratio",
            "Engine-reported prefix-cache hit ratio of prompt tokens since the worker started",
            self.engine_prefix_hit_ratio.clone(),
        );
        r.register("kvroute_worker_slots", "Decode slots of a worker (llama.cpp /slots)", self.worker_slots.clone());
        r.register(
            "kvroute_ttft_prediction_ratio",
            "Measured TTFT over the routing policy's predicted TTFT, per worker (1 = exact)",
            self.ttft_prediction_ratio.clone(),
        );
        r.register(
            "kvroute_cached_tokens_predicted",
            "Prompt tokens the router expected cached, for requests whose engine reported its cached tokens",
            self.cached_tokens_predicted.clone(),
        );
        r.register(
            "kvroute_cached_tokens_reported",
            "Prompt tokens the engine reported cached (usage.prompt_tokens_details.cached_tokens, timings.cache_n)",
            self.cached_tokens_reported.clone(),
        );
    }

    /// The etcd registry and live policy.
    fn register_etcd(&mut self) {
        let r = &mut self.registry;
        r.register(
            "kvroute_etcd_connected",
            "1 while the etcd connection of the cluster registry and live policy is up",
            self.etcd_connected.clone(),
        );
        r.register("kvroute_etcd_workers", "Workers currently registered through etcd", self.etcd_workers.clone());
        r.register(
            "kvroute_etcd_connects",
            "etcd sessions established (connect, list, watch); each after the first is a reconnect and a full re-list",
            self.etcd_connects.clone(),
        );
        r.register(
            "kvroute_etcd_registry_stale",
            "1 while the registry in use is the last known list from state_dir (etcd not reached since the start)",
            self.etcd_registry_stale.clone(),
        );
        r.register(
            "kvroute_policy_updates",
            "Live policy settings received, by source and outcome (rejected: the last good policy stays)",
            self.policy_updates.clone(),
        );
    }

    /// LoRA adapters, prefill/decode disaggregation and model cascades.
    fn register_serving_modes(&mut self) {
        let r = &mut self.registry;
        r.register(
            "kvroute_lora_requests",
            "Requests for catalogue LoRA adapters, by outcome (loaded, load, unavailable)",
            self.lora_requests.clone(),
        );
        r.register("kvroute_lora_loads", "LoRA adapter loads asked of workers, by outcome", self.lora_loads.clone());
        r.register(
            "kvroute_pd_requests",
            "Requests of a disaggregated fleet, by placement (split, colocated)",
            self.pd_requests.clone(),
        );
        r.register(
            "kvroute_pd_failures",
            "Failed halves of split requests, by phase (prefill, decode); each is retried with the next worker",
            self.pd_failures.clone(),
        );
        r.register(
            "kvroute_cascade_steps",
            "Model cascade steps, by model and outcome (accepted, escalated, failed)",
            self.cascade_steps.clone(),
        );
        r.register(
            "kvroute_cascade_tokens",
            "Tokens of model cascade steps, by model and kind (prompt, completion)",
            self.cascade_tokens.clone(),
        );
    }

    /// The cluster sync over NATS.
    fn register_sync(&mut self) {
        let r = &mut self.registry;
        r.register(
            "kvroute_nats_connected",
            "1 while the cluster sync's NATS connection is up, else 0",
            self.nats_connected.clone(),
        );
        r.register("kvroute_sync_events", "Cluster sync routing events, by outcome", self.sync_events.clone());
        r.register("kvroute_sync_gaps", "Event batches of other replicas that never arrived", self.sync_gaps.clone());
        r.register(
            "kvroute_sync_lag_seconds",
            "Time from another replica publishing an event batch to its application here",
            self.sync_lag_seconds.clone(),
        );
        r.register(
            "kvroute_sync_remote_in_flight",
            "Requests other replicas report in flight",
            self.sync_remote_in_flight.clone(),
        );
        r.register("kvroute_sync_peers", "Other replicas heard from in the last 10 s", self.sync_peers.clone());
        r.register(
            "kvroute_sync_peers_left",
            "Other replicas gone from this one's view: goodbye (stopping) or silent for 10 s",
            self.sync_peers_left.clone(),
        );
    }

    /// Configuration reloads and the traffic recorder.
    fn register_operations(&mut self) {
        let r = &mut self.registry;
        r.register(
            "kvroute_config_reloads",
            "Configuration reloads on SIGHUP, by outcome",
            self.config_reloads.clone(),
        );
        r.register(
            "kvroute_api_key_reloads",
            "api_key_file read again on SIGHUP, by outcome",
            self.api_key_reloads.clone(),
        );
        r.register(
            "kvroute_admin_token_reloads",
            "admin_token_file read again on a reload, by outcome",
            self.admin_token_reloads.clone(),
        );
        r.register(
            "kvroute_record_lines",
            "Trace lines of the traffic recorder (record), by outcome",
            self.record_lines.clone(),
        );
        r.register(
            "kvroute_prefix_state_events",
            "Routed events of the prefix state journal (state_dir), by outcome",
            self.prefix_state_events.clone(),
        );
        r.register(
            "kvroute_epp_requests",
            "Endpoint-picker mode: requests picked or answered with an immediate response",
            self.epp_requests.clone(),
        );
        r.register(
            "kvroute_epp_served",
            "Endpoint-picker mode: the endpoint the gateway reports served a picked request",
            self.epp_served.clone(),
        );
        r.register(
            "kvroute_epp_observed",
            "Endpoint-picker mode: response-side messages observed, and streams closed early",
            self.epp_observed.clone(),
        );
        r.register(
            "kvroute_epp_pick_seconds",
            "Endpoint-picker mode: time from the request's last message to the pick",
            self.epp_pick_seconds.clone(),
        );
    }

    /// Counts one request in `kvroute_requests_total`. A label set seen for the first time
    /// is also noted under its worker (one short lock, never taken again for that set), so
    /// [`Metrics::forget_worker`] can drop it.
    pub fn count_request(&self, labels: RequestLabels) {
        if !labels.worker.is_empty() && self.requests.get(&labels).is_none() {
            self.request_series.lock().entry(labels.worker.clone()).or_default().insert(labels.clone());
        }
        self.requests.get_or_create(&labels).inc();
    }

    /// Drops every series labelled with worker `url` (its request counts, health, in-flight
    /// gauge, KV-event counters, slots, prediction errors …): a fleet whose workers come and
    /// go (etcd registrations, the admin API, config reloads) keeps a bounded label set.
    /// Prometheus keeps what it scraped before.
    pub fn forget_worker(&self, url: &str) {
        let w = WorkerLabel { worker: url.to_string() };
        for f in
            [&self.worker_healthy, &self.worker_in_flight, &self.kv_parity, &self.tokenizer_parity, &self.worker_slots]
        {
            f.remove(&w);
        }
        for f in [
            &self.kv_batches,
            &self.kv_gaps,
            &self.kv_replayed,
            &self.kv_restarts,
            &self.kv_errors,
            &self.kv_skipped,
            &self.cached_tokens_predicted,
            &self.cached_tokens_reported,
        ] {
            f.remove(&w);
        }
        self.engine_prefix_hit_ratio.remove(&w);
        self.ttft_prediction_ratio.remove(&w);
        if let Some(sets) = self.request_series.lock().remove(url) {
            for labels in sets {
                self.requests.remove(&labels);
            }
        }
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut s, &self.registry);
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefix_source_is_rendered_with_both_labels() {
        let m = Metrics::new();
        m.prefix_source.get_or_create(&SourceLabels { source: "approximate", reason: "no_events" }).inc();
        m.prefix_source.get_or_create(&SourceLabels { source: "precise", reason: "" }).inc();
        let text = m.render();
        // The name apart: tests/prometheus.rs reads every string literal of this file that
        // starts with kvroute_ as a family name.
        let family = "kvroute_prefix_source";
        assert!(text.contains(&format!(r#"{family}_total{{source="approximate",reason="no_events"}} 1"#)), "{text}");
        assert!(text.contains(&format!(r#"{family}_total{{source="precise",reason=""}} 1"#)), "{text}");
    }
}
