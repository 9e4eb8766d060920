//! `kvroute serve`: the router gateway in front of inference workers.
//!
//! Settings come from `--config FILE` (TOML), then `KVROUTE_*` environment variables, then
//! flags (each flag has the environment variable of the same name; a flag wins). SIGHUP
//! reads the file again, with the same environment and flags on top
//! ([`kvroute_gateway::reload`]).

use anyhow::{Context, bail};
use kvroute_gateway::GatewayConfig;
use kvroute_gateway::config::EppBodyMode;
use std::path::PathBuf;
use std::time::Duration;

/// Flags of `kvroute serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// TOML configuration file (see kvroute.example.toml); read again on SIGHUP.
    #[arg(long, env = "KVROUTE_CONFIG")]
    pub config: Option<PathBuf>,
    /// Listen address.
    #[arg(long, env = "KVROUTE_HOST")]
    pub host: Option<String>,
    /// Listen port (0 = any free port).
    #[arg(long, env = "KVROUTE_PORT")]
    pub port: Option<u16>,
    /// Routing policy (`kvroute policies`).
    #[arg(long, env = "KVROUTE_POLICY")]
    pub policy: Option<String>,
    /// Policy knobs as a JSON object.
    #[arg(long, env = "KVROUTE_POLICY_KNOBS")]
    pub policy_knobs: Option<String>,
    /// SGLang router's cache_aware flags, by their SGLang names (`cache_aware`'s knobs).
    #[command(flatten)]
    pub sglang: SglangCacheAware,
    /// Worker base URLs.
    #[arg(long, env = "KVROUTE_WORKER_URLS", num_args = 1.., value_delimiter = ',')]
    pub worker_urls: Vec<String>,
    /// Most token ids a prompt may carry.
    #[arg(long, env = "KVROUTE_MAX_PROMPT_TOKENS")]
    pub max_prompt_tokens: Option<usize>,
    /// Largest request body, bytes.
    #[arg(long, env = "KVROUTE_MAX_BODY_BYTES")]
    pub max_body_bytes: Option<usize>,
    /// Request bodies held at once, bytes (503 beyond).
    #[arg(long, env = "KVROUTE_MAX_BUFFERED_BODY_BYTES")]
    pub max_buffered_body_bytes: Option<u64>,
    /// Of those, what one tenant's bodies may hold at once, bytes (429 beyond; 0: no share).
    #[arg(long, env = "KVROUTE_MAX_BUFFERED_BODY_BYTES_PER_TENANT")]
    pub max_buffered_body_bytes_per_tenant: Option<u64>,
    /// Requests one tenant may have in the router at once (429 beyond; 0: no bound).
    #[arg(long, env = "KVROUTE_MAX_IN_FLIGHT_PER_TENANT")]
    pub max_in_flight_per_tenant: Option<u32>,
    /// Seconds a client has to send a request's headers, from the connection's accept for
    /// the first (TLS handshake included); also the idle limit of a connection.
    #[arg(long, env = "KVROUTE_HEADER_READ_TIMEOUT_SECS")]
    pub header_read_timeout_secs: Option<f64>,
    /// Seconds a client has to send a request's body.
    #[arg(long, env = "KVROUTE_BODY_READ_TIMEOUT_SECS")]
    pub body_read_timeout_secs: Option<f64>,
    /// Open client connections at most.
    #[arg(long, env = "KVROUTE_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// Connections beyond --max-connections reserved for `/health` and `/readiness` probes.
    #[arg(long, env = "KVROUTE_PROBE_CONNECTIONS")]
    pub probe_connections: Option<usize>,
    /// Open connections from one client IP at most (0: no cap; leave 0 behind a proxy).
    #[arg(long, env = "KVROUTE_MAX_CONNECTIONS_PER_CLIENT")]
    pub max_connections_per_client: Option<usize>,
    /// Seconds between HTTP/2 PINGs to a client (0: none); unanswered as long, the connection closes.
    #[arg(long, env = "KVROUTE_HTTP2_KEEP_ALIVE_SECS")]
    pub http2_keep_alive_secs: Option<f64>,
    /// Whole shutdown budget after SIGTERM/Ctrl-C, seconds (a second signal exits at once).
    #[arg(long, env = "KVROUTE_DRAIN_TIMEOUT_SECS")]
    pub drain_timeout_secs: Option<f64>,
    /// Seconds after SIGTERM during which `/readiness` is 503 but requests are still served.
    #[arg(long, env = "KVROUTE_DRAIN_DELAY_SECS")]
    pub drain_delay_secs: Option<f64>,
    /// Per-attempt connect timeout, seconds.
    #[arg(long, env = "KVROUTE_CONNECT_TIMEOUT_SECS")]
    pub connect_timeout_secs: Option<f64>,
    /// Whole-request timeout, seconds.
    #[arg(long, env = "KVROUTE_REQUEST_TIMEOUT_SECS")]
    pub request_timeout_secs: Option<f64>,
    /// Seconds a streamed request's first bytes may take to come from the worker.
    #[arg(long, env = "KVROUTE_STREAM_FIRST_BYTE_TIMEOUT_SECS")]
    pub stream_first_byte_timeout_secs: Option<f64>,
    /// Longest silence between two chunks of a streamed response, seconds.
    #[arg(long, env = "KVROUTE_STREAM_IDLE_TIMEOUT_SECS")]
    pub stream_idle_timeout_secs: Option<f64>,
    /// Consecutive failures before a worker leaves routing.
    #[arg(long, env = "KVROUTE_MAX_WORKER_RETRIES")]
    pub max_worker_retries: Option<u32>,
    /// Attempts per request across workers.
    #[arg(long, env = "KVROUTE_MAX_TOTAL_RETRIES")]
    pub max_total_retries: Option<u32>,
    /// Largest share of the workers failed requests may eject at once, in [0, 1].
    #[arg(long, env = "KVROUTE_MAX_EJECTION_SHARE")]
    pub max_ejection_share: Option<f64>,
    /// Admission limit per (model, role).
    #[arg(long, env = "KVROUTE_MAX_IN_FLIGHT_PER_MODEL")]
    pub max_in_flight_per_model: Option<u32>,
    /// Requests one worker may have in flight (Ray Serve's `max_ongoing_requests`); a worker
    /// at its cap is no candidate, and with every worker at it the answer is 503. 0: no cap.
    #[arg(long, env = "KVROUTE_MAX_ONGOING_REQUESTS")]
    pub max_ongoing_requests: Option<u32>,
    /// Seconds `POST /add_worker` waits for a new worker's health check to pass before it
    /// refuses the worker (SGLang router's flag; default 300).
    #[arg(long, env = "KVROUTE_WORKER_STARTUP_TIMEOUT_SECS")]
    pub worker_startup_timeout_secs: Option<f64>,
    /// Seconds between those checks (SGLang router's `--worker-startup-check-interval`;
    /// default 10).
    #[arg(long = "worker-startup-check-interval", env = "KVROUTE_WORKER_STARTUP_CHECK_INTERVAL")]
    pub worker_startup_check_interval_secs: Option<f64>,
    /// Bearer token for the admin API (without one the main port serves no admin API; it is
    /// then only on a loopback --admin-listen).
    #[arg(long, env = "KVROUTE_ADMIN_TOKEN")]
    pub admin_token: Option<String>,
    /// A file holding the admin API's token instead of --admin-token: read again on every
    /// reload (SIGHUP, or --reload-watch-secs), so the token rotates without a restart.
    #[arg(long, env = "KVROUTE_ADMIN_TOKEN_FILE", conflicts_with = "admin_token")]
    pub admin_token_file: Option<String>,
    /// Serve the admin API on this separate IP:PORT (the main port then has none); without
    /// --admin-token it must be loopback and refuses requests relayed by a proxy.
    #[arg(long, env = "KVROUTE_ADMIN_LISTEN")]
    pub admin_listen: Option<String>,
    /// Endpoint-picker mode: serve the Gateway API Inference Extension's endpoint-picker
    /// protocol (Envoy ext_proc gRPC, with gRPC health) on this IP:PORT (docs/kubernetes.md).
    #[arg(long, env = "KVROUTE_EPP_LISTEN")]
    pub epp_listen: Option<String>,
    /// How the gateway's ext_proc filter sends bodies: auto (its protocol_config, else
    /// full_duplex), buffered, full_duplex.
    #[arg(long, env = "KVROUTE_EPP_BODY_MODE", value_parser = ["auto", "buffered", "full_duplex"])]
    pub epp_body_mode: Option<String>,
    /// Serve --epp-listen over TLS: the --tls-cert/--tls-key certificate, else a self-signed one
    /// made at start (gateways that reach their picker without verifying it).
    #[arg(long, env = "KVROUTE_EPP_TLS")]
    pub epp_tls: bool,
    /// File of client API keys, one `KEY [TENANT] [rpm=N] [tpm=N]` per line.
    #[arg(long, env = "KVROUTE_API_KEY_FILE")]
    pub api_key_file: Option<String>,
    /// Requests per minute per API key (0 = unlimited; a key's `rpm=` overrides).
    #[arg(long, env = "KVROUTE_API_KEY_RPM")]
    pub api_key_rpm: Option<u32>,
    /// Tokens (prompt plus max_tokens) per minute per API key (0 = unlimited; `tpm=` overrides).
    #[arg(long, env = "KVROUTE_API_KEY_TPM")]
    pub api_key_tpm: Option<u32>,
    /// Request header naming the tenant, set by a trusted proxy (used without API keys).
    #[arg(long, env = "KVROUTE_TENANT_HEADER")]
    pub tenant_header: Option<String>,
    /// Key each tenant's prefix state apart (true/false; default true).
    #[arg(long, env = "KVROUTE_TENANT_ISOLATION")]
    pub tenant_isolation: Option<bool>,
    /// Tenants that share one prefix cache: `a,b` per group (repeat for more groups).
    #[arg(long, action = clap::ArgAction::Append, value_name = "TENANT,TENANT,...")]
    pub shared_prefix_tenants: Vec<String>,
    /// With tenant isolation, send the tenant's salt to workers as `cache_salt` (vLLM)
    /// (true/false; default true).
    #[arg(long, env = "KVROUTE_ENGINE_CACHE_SALT")]
    pub engine_cache_salt: Option<bool>,
    /// Send `x-kvroute-worker` / `x-kvroute-decision` to every client (true/false; default
    /// false: only to requests with the admin token). Unsafe with several tenants.
    #[arg(long, env = "KVROUTE_EXPOSE_DECISION_HEADERS")]
    pub expose_decision_headers: Option<bool>,
    /// Client headers forwarded to workers (default: authorization; `""` for none).
    #[arg(long, env = "KVROUTE_FORWARD_HEADERS", num_args = 0.., value_delimiter = ',')]
    pub forward_headers: Option<Vec<String>>,
    /// Hosts or CIDRs worker URLs may point at (default: any).
    #[arg(long, env = "KVROUTE_WORKER_ALLOW", num_args = 1.., value_delimiter = ',')]
    pub worker_allow: Vec<String>,
    /// etcd endpoints of the cluster registry and live policy (comma separated).
    #[arg(long, env = "KVROUTE_ETCD", num_args = 1.., value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// Key prefix in etcd (workers under PREFIX/workers/, policy at PREFIX/routing/policy).
    #[arg(long, env = "KVROUTE_ETCD_PREFIX")]
    pub etcd_prefix: Option<String>,
    /// The etcd key of the live policy (e.g. Cognitora's /cognitora/routing/policy).
    #[arg(long, env = "KVROUTE_ETCD_POLICY_KEY")]
    pub etcd_policy_key: Option<String>,
    /// Directory for state kept across restarts: the last known etcd registry, used when
    /// the replica starts while etcd is unreachable (its workers marked stale).
    #[arg(long, env = "KVROUTE_STATE_DIR", value_name = "DIR")]
    pub state_dir: Option<String>,
    /// Record every dispatched request as a privacy-safe trace line in FILE (no text: token
    /// counts, salted block ids, session; `kvroute replay --trace FILE` reads it).
    #[arg(long, env = "KVROUTE_RECORD", value_name = "FILE")]
    pub record: Option<String>,
    /// Size at which the --record file rotates to FILE.1, bytes (default 256 MiB).
    #[arg(long)]
    pub record_max_bytes: Option<u64>,
    /// --record files kept in all, the current one included (default 4).
    #[arg(long)]
    pub record_files: Option<u32>,
    /// Tokens per block of the recorded hash ids (default 16).
    #[arg(long)]
    pub record_block_tokens: Option<u32>,
    /// NATS server over which the router replicas of --cluster share routing state.
    #[arg(long, env = "KVROUTE_NATS")]
    pub nats: Option<String>,
    /// Name of the replica group sharing state over NATS (default `default`).
    #[arg(long, env = "KVROUTE_CLUSTER")]
    pub cluster: Option<String>,
    /// This replica's id in the cluster (default: random per start).
    #[arg(long, env = "KVROUTE_REPLICA_ID")]
    pub replica_id: Option<String>,
    /// PEM certificate chain served to clients over HTTPS (with --tls-key; reread on SIGHUP).
    #[arg(long, env = "KVROUTE_TLS_CERT")]
    pub tls_cert: Option<String>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "KVROUTE_TLS_KEY")]
    pub tls_key: Option<String>,
    /// Every this many seconds, reload what changed in the files SIGHUP reads (TLS files,
    /// --api-key-file, --admin-token-file, --config); 0: SIGHUP only.
    #[arg(long, env = "KVROUTE_RELOAD_WATCH_SECS")]
    pub reload_watch_secs: Option<f64>,
    /// PEM bundle of CA certificates trusted for https:// workers (besides the system roots).
    #[arg(long, env = "KVROUTE_WORKER_CA_FILE")]
    pub worker_ca_file: Option<String>,
    /// Scrape each worker's /metrics for engine load signals.
    #[arg(long, env = "KVROUTE_SCRAPE_METRICS")]
    pub scrape_metrics: Option<bool>,
    /// Prometheus gauge read as watts for kv_score.
    #[arg(long, env = "KVROUTE_POWER_METRIC")]
    pub power_metric: Option<String>,
    /// Seed of the policy's random source.
    #[arg(long, env = "KVROUTE_SEED")]
    pub seed: Option<u64>,
    /// Copies of each model's policy state: 2 (decisions never wait for a commit) or 1 (half the memory).
    #[arg(long, env = "KVROUTE_POLICY_COPIES")]
    pub policy_copies: Option<u8>,
    /// Seconds between active health checks.
    #[arg(long, env = "KVROUTE_HEALTH_INTERVAL_SECS")]
    pub health_interval_secs: Option<f64>,
    /// KV-event source of a worker: `WORKER_URL=tcp://HOST:PORT[+tcp://HOST:REPLAY_PORT]`
    /// (repeat, or separate with commas).
    #[arg(long, env = "KVROUTE_KV_EVENTS", num_args = 1.., value_delimiter = ',')]
    pub kv_events: Vec<String>,
    /// Predict-on-route window of the precise index, seconds (0 turns it off).
    #[arg(long, env = "KVROUTE_KV_PREDICT_WINDOW_SECS")]
    pub kv_predict_window_secs: Option<f64>,
    /// Startup parity check of each KV-event worker (true/false; default true).
    #[arg(long, env = "KVROUTE_KV_PARITY_CHECK")]
    pub kv_parity_check: Option<bool>,
    /// Threads of the KV-event subscribers, apart from the requests' (1 to 64; default 1).
    #[arg(long, env = "KVROUTE_KV_EVENT_THREADS")]
    pub kv_event_threads: Option<u16>,
    /// Track what each llama.cpp slot holds and name each request's slot (`id_slot`):
    /// `auto` (default: per worker, on when a probe at join finds no host-memory prompt
    /// cache, i.e. `--cache-ram 0`), `true` or `false`.
    #[arg(long, env = "KVROUTE_LLAMA_SLOT_ROUTING")]
    pub llama_slot_routing: Option<kvroute_gateway::config::SlotRouting>,
    /// Turn the KV mover on (`[kv_migration]`) with this directory: the llama.cpp workers'
    /// `--slot-save-path`, as this router sees it. A long prompt's slot is saved there when
    /// it ends, and restored into the slot of another worker a request on it is sent to.
    #[arg(long, env = "KVROUTE_KV_MIGRATION_DIR")]
    pub kv_migration_dir: Option<std::path::PathBuf>,
    /// The KV mover's smallest prefix, tokens (`kv_migration.min_tokens`, default 1024).
    #[arg(long, env = "KVROUTE_KV_MIGRATION_MIN_TOKENS")]
    pub kv_migration_min_tokens: Option<u32>,
    /// Local tokenizer for token-accurate routing keys: a GGUF model file (llama.cpp
    /// workers) or a Hugging Face tokenizer.json (tokenizer_config.json beside it).
    #[arg(long, env = "KVROUTE_TOKENIZER")]
    pub tokenizer: Option<String>,
    /// Prefill/decode disaggregation (SGLang router's flag): split prompts longer than
    /// --colocate-below-tokens between a --prefill and a --decode worker.
    #[arg(long, env = "KVROUTE_PD_DISAGGREGATION")]
    pub pd_disaggregation: bool,
    /// A prefill worker and, optionally, its bootstrap port (`none` for none), as SGLang's
    /// router takes it: `--prefill http://p1:8000 8998` (repeat per worker).
    #[arg(long, num_args = 1..=2, action = clap::ArgAction::Append, value_names = ["URL", "BOOTSTRAP_PORT"])]
    pub prefill: Vec<String>,
    /// A decode worker (repeat per worker).
    #[arg(long, action = clap::ArgAction::Append)]
    pub decode: Vec<String>,
    /// The hand-over protocol: `sglang` (bootstrap room) or `vllm` (kv_transfer_params).
    #[arg(long, env = "KVROUTE_PD_PROTOCOL", value_parser = ["sglang", "vllm"])]
    pub pd_protocol: Option<String>,
    /// Policy of the prefill pool (default cache_aware).
    #[arg(long, env = "KVROUTE_PREFILL_POLICY")]
    pub prefill_policy: Option<String>,
    /// Policy of the decode pool (default least_load).
    #[arg(long, env = "KVROUTE_DECODE_POLICY")]
    pub decode_policy: Option<String>,
    /// Prompts of at most this many tokens run on one worker (default 2048).
    #[arg(long, env = "KVROUTE_COLOCATE_BELOW_TOKENS")]
    pub colocate_below_tokens: Option<u32>,
    /// Start N worker processes with --worker-cmd and route to them (SGLang router co-launch).
    #[arg(long, env = "KVROUTE_LAUNCH_WORKERS", default_value_t = 0)]
    pub launch_workers: usize,
    /// SGLang router's name for the number of workers to launch, one per data-parallel rank
    /// (the same as --launch-workers).
    #[arg(long)]
    pub dp_size: Option<usize>,
    /// SGLang router's `--model-path`: the model the launched workers serve. Without
    /// --worker-cmd they are SGLang servers (`python3 -m sglang.launch_server --model-path M
    /// --host 127.0.0.1 --port {port}`); a --worker-cmd may name it as `{model_path}`.
    #[arg(long)]
    pub model_path: Option<String>,
    /// Worker command for --launch-workers; `{port}` is replaced by a free port, `{rank}`
    /// and `{gpu}` by the worker's data-parallel rank (0, 1, …), `{model_path}` by
    /// --model-path. Each runs with CUDA_VISIBLE_DEVICES set to its rank.
    #[arg(long, env = "KVROUTE_WORKER_CMD")]
    pub worker_cmd: Option<String>,
    /// Seconds to wait for launched workers to become healthy.
    #[arg(long, default_value_t = 120.0)]
    pub launch_timeout_secs: f64,
}

/// Builds the configuration from file, environment and flags.
///
/// # Errors
/// Unreadable file, invalid TOML, or an invalid value naming its key.
pub fn build_config(a: &Args) -> anyhow::Result<GatewayConfig> {
    let mut cfg = read_config_file(a)?;
    scalar_flags(a, &mut cfg);
    cluster_flags(a, &mut cfg);
    security_flags(a, &mut cfg);
    worker_flags(a, &mut cfg)?;
    sglang_flags(a, &mut cfg)?;
    pd_flags(a, &mut cfg)?;
    cfg.validate()?;
    Ok(cfg)
}

/// `--config FILE`, or the defaults.
fn read_config_file(a: &Args) -> anyhow::Result<GatewayConfig> {
    Ok(match &a.config {
        Some(p) => {
            let text = std::fs::read_to_string(p).with_context(|| format!("--config {}", p.display()))?;
            GatewayConfig::from_toml(&text).with_context(|| format!("--config {}", p.display()))?
        }
        None => GatewayConfig::default(),
    })
}

/// The flags that set one top-level field of the same name, when given.
fn scalar_flags(a: &Args, cfg: &mut GatewayConfig) {
    macro_rules! set {
        ($($f:ident),*) => { $( if let Some(v) = a.$f.clone() { cfg.$f = v; } )* };
    }
    set!(
        host,
        port,
        policy,
        max_body_bytes,
        max_buffered_body_bytes,
        max_buffered_body_bytes_per_tenant,
        max_in_flight_per_tenant,
        max_prompt_tokens,
        header_read_timeout_secs,
        body_read_timeout_secs,
        max_connections,
        probe_connections,
        max_connections_per_client,
        http2_keep_alive_secs,
        drain_timeout_secs,
        drain_delay_secs,
        reload_watch_secs,
        connect_timeout_secs,
        request_timeout_secs,
        stream_first_byte_timeout_secs,
        stream_idle_timeout_secs,
        max_worker_retries,
        max_total_retries,
        max_ejection_share,
        max_in_flight_per_model,
        max_ongoing_requests,
        worker_startup_timeout_secs,
        worker_startup_check_interval_secs,
        scrape_metrics,
        seed,
        policy_copies,
        kv_predict_window_secs,
        kv_parity_check,
        kv_event_threads,
        llama_slot_routing,
        tenant_isolation,
        engine_cache_salt,
        expose_decision_headers,
        api_key_rpm,
        api_key_tpm,
        record_max_bytes,
        record_files,
        record_block_tokens
    );
}

/// Cluster mode, the state directory and recording: etcd, NATS, replica id, `--record`.
fn cluster_flags(a: &Args, cfg: &mut GatewayConfig) {
    if !a.etcd.is_empty() {
        cfg.etcd = a.etcd.clone();
    }
    for (flag, field) in [
        (&a.etcd_policy_key, &mut cfg.etcd_policy_key),
        (&a.state_dir, &mut cfg.state_dir),
        (&a.nats, &mut cfg.nats),
        (&a.replica_id, &mut cfg.replica_id),
        (&a.record, &mut cfg.record),
    ] {
        if flag.is_some() {
            field.clone_from(flag);
        }
    }
    if let Some(p) = &a.etcd_prefix {
        cfg.etcd_prefix.clone_from(p);
    }
    if let Some(c) = &a.cluster {
        cfg.cluster.clone_from(c);
    }
}

/// Keys, tenants, the admin listener, TLS, forwarded headers and the worker allow-list.
fn security_flags(a: &Args, cfg: &mut GatewayConfig) {
    if a.api_key_file.is_some() {
        cfg.api_key_file = a.api_key_file.clone();
    }
    // A token set here replaces the file's, in either form.
    if a.admin_token.is_some() {
        cfg.admin_token = a.admin_token.clone();
        cfg.admin_token_file = None;
    }
    if a.admin_token_file.is_some() {
        cfg.admin_token_file = a.admin_token_file.clone();
        cfg.admin_token = None;
    }
    if a.tenant_header.is_some() {
        cfg.tenant_header = a.tenant_header.clone();
    }
    if !a.shared_prefix_tenants.is_empty() {
        cfg.shared_prefix_tenants = a
            .shared_prefix_tenants
            .iter()
            .map(|g| g.split(',').map(str::trim).filter(|t| !t.is_empty()).map(String::from).collect())
            .collect();
    }
    if a.admin_listen.is_some() {
        cfg.admin_listen = a.admin_listen.clone();
    }
    if a.epp_listen.is_some() {
        cfg.epp_listen = a.epp_listen.clone();
    }
    cfg.epp_tls |= a.epp_tls;
    cfg.epp_body_mode = match a.epp_body_mode.as_deref() {
        Some("buffered") => EppBodyMode::Buffered,
        Some("full_duplex") => EppBodyMode::FullDuplex,
        Some(_) => EppBodyMode::Auto,
        None => cfg.epp_body_mode,
    };
    for (flag, field) in
        [(&a.tls_cert, &mut cfg.tls_cert), (&a.tls_key, &mut cfg.tls_key), (&a.worker_ca_file, &mut cfg.worker_ca_file)]
    {
        if flag.is_some() {
            field.clone_from(flag);
        }
    }
    if let Some(h) = &a.forward_headers {
        cfg.forward_headers = h.iter().filter(|n| !n.trim().is_empty()).map(|n| n.trim().to_string()).collect();
    }
    if !a.worker_allow.is_empty() {
        cfg.worker_allow = a.worker_allow.clone();
    }
}

/// The workers and what the router reads from them: URLs, tokenizer, power metric,
/// health interval, KV-event sources and the policy's knobs.
fn worker_flags(a: &Args, cfg: &mut GatewayConfig) -> anyhow::Result<()> {
    if let Some(d) = &a.kv_migration_dir {
        cfg.kv_migration.enabled = true;
        cfg.kv_migration.slot_save_dir = Some(d.clone());
    }
    if let Some(n) = a.kv_migration_min_tokens {
        cfg.kv_migration.min_tokens = n;
    }
    if a.tokenizer.is_some() {
        cfg.tokenizer = a.tokenizer.clone();
    }
    if a.power_metric.is_some() {
        cfg.power_metric = a.power_metric.clone();
    }
    if let Some(i) = a.health_interval_secs {
        cfg.health.interval_secs = i;
    }
    if !a.worker_urls.is_empty() {
        cfg.worker_urls = a.worker_urls.clone();
    }
    for k in &a.kv_events {
        let src = kvroute_gateway::config::KvEventSource::parse(k).map_err(|m| anyhow::anyhow!("--kv-events: {m}"))?;
        cfg.kv_events.push(src);
    }
    if let Some(k) = &a.policy_knobs {
        cfg.policy_knobs = knobs_from_json(k).context("--policy-knobs")?;
    }
    Ok(())
}

/// SGLang router's `cache_aware` flags, accepted by their SGLang names so a launch command
/// moves over unchanged; each sets the `cache_aware` knob named beside it (docs/configuration.md,
/// "SGLang router's flags").
#[derive(Debug, Clone, Default, clap::Args)]
pub struct SglangCacheAware {
    /// SGLang `--cache-threshold` (match rate 0.0–1.0): knob `cache_threshold`.
    #[arg(long)]
    pub cache_threshold: Option<f64>,
    /// SGLang `--balance-abs-threshold` (requests): knob `balance_abs_threshold`.
    #[arg(long)]
    pub balance_abs_threshold: Option<u64>,
    /// SGLang `--balance-rel-threshold` (ratio): knob `balance_rel_threshold`.
    #[arg(long)]
    pub balance_rel_threshold: Option<f64>,
    /// SGLang `--eviction-interval` (seconds; `--eviction-interval-secs` in later
    /// sgl-router releases, taken too): knob `eviction_interval_secs`.
    #[arg(long, alias = "eviction-interval-secs")]
    pub eviction_interval: Option<f64>,
    /// SGLang `--max-tree-size` (characters per worker there): knob `max_tree_size`, symbols
    /// over one tree per model — UTF-8 bytes of text, tokens or blocks when the request
    /// carries them (docs/configuration.md, "SGLang router's flags").
    #[arg(long)]
    pub max_tree_size: Option<u64>,
}

impl SglangCacheAware {
    /// The flags given, each with the knob it sets: (SGLang flag, kvroute knob, value).
    fn knobs(&self) -> Vec<(&'static str, &'static str, toml::Value)> {
        let int = |x: u64| toml::Value::Integer(x.min(i64::MAX as u64) as i64);
        [
            ("--cache-threshold", "cache_threshold", self.cache_threshold.map(toml::Value::Float)),
            ("--balance-abs-threshold", "balance_abs_threshold", self.balance_abs_threshold.map(int)),
            ("--balance-rel-threshold", "balance_rel_threshold", self.balance_rel_threshold.map(toml::Value::Float)),
            ("--eviction-interval", "eviction_interval_secs", self.eviction_interval.map(toml::Value::Float)),
            ("--max-tree-size", "max_tree_size", self.max_tree_size.map(int)),
        ]
        .into_iter()
        .filter_map(|(flag, knob, v)| v.map(|v| (flag, knob, v)))
        .collect()
    }
}

/// SGLang's `cache_aware` flags over the knobs: refused with another policy (they would
/// change nothing) and when `--policy-knobs` names the same knob.
fn sglang_flags(a: &Args, cfg: &mut GatewayConfig) -> anyhow::Result<()> {
    let knobs = a.sglang.knobs();
    if knobs.is_empty() {
        return Ok(());
    }
    if cfg.policy != "cache_aware" {
        anyhow::bail!(
            "{}: an SGLang cache_aware flag, but the policy is `{}` (add --policy cache_aware)",
            knobs[0].0,
            cfg.policy
        );
    }
    for (_, k, v) in knobs {
        if a.policy_knobs.is_some() && cfg.policy_knobs.contains_key(k) {
            anyhow::bail!("--policy-knobs and an SGLang flag both set `{k}`: give it once");
        }
        cfg.policy_knobs.insert(k.to_string(), v);
    }
    Ok(())
}

/// The disaggregation flags over the file's `[pd]`.
fn pd_flags(a: &Args, cfg: &mut GatewayConfig) -> anyhow::Result<()> {
    if a.pd_disaggregation {
        cfg.pd.enabled = true;
    }
    if !a.prefill.is_empty() {
        // The values of every --prefill in order: a URL, optionally followed by its port.
        cfg.pd.prefill.clear();
        for v in &a.prefill {
            let is_port = v == "none" || v.parse::<u16>().is_ok();
            match cfg.pd.prefill.last_mut() {
                Some(last) if is_port && last.bootstrap_port.is_none() && !v.contains(':') => {
                    last.bootstrap_port = if v == "none" { None } else { v.parse().ok() };
                }
                _ if is_port => bail!("--prefill {v}: expected a worker URL before its bootstrap port"),
                _ => {
                    if v.chars().all(|c| c.is_ascii_digit()) {
                        bail!("--prefill {v}: expected a bootstrap port (1-65535) or `none`");
                    }
                    cfg.pd.prefill.push(kvroute_gateway::pd::PrefillWorker { url: v.clone(), bootstrap_port: None });
                }
            }
        }
    }
    if !a.decode.is_empty() {
        cfg.pd.decode.clone_from(&a.decode);
    }
    if let Some(p) = &a.pd_protocol {
        cfg.pd.protocol =
            if p == "vllm" { kvroute_gateway::pd::PdProtocol::Vllm } else { kvroute_gateway::pd::PdProtocol::Sglang };
    }
    if let Some(p) = &a.prefill_policy {
        cfg.pd.prefill_policy.clone_from(p);
        cfg.pd.prefill_policy_knobs = toml::Table::new();
    }
    if let Some(p) = &a.decode_policy {
        cfg.pd.decode_policy.clone_from(p);
        cfg.pd.decode_policy_knobs = toml::Table::new();
    }
    if let Some(n) = a.colocate_below_tokens {
        cfg.pd.colocate_below_tokens = n;
    }
    if cfg.pd.enabled && (cfg.pd.prefill.is_empty() || cfg.pd.decode.is_empty()) && cfg.etcd.is_empty() {
        bail!(
            "--pd-disaggregation needs at least one --prefill and one --decode worker (or an etcd registry with roles)"
        );
    }
    Ok(())
}

/// Worker processes started by --launch-workers; killed on drop.
struct Launched(Vec<tokio::process::Child>);

impl Drop for Launched {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.start_kill();
        }
    }
}

/// `--policy-knobs` (a JSON object) as the TOML table the configuration file would hold.
///
/// Converted value by value rather than by `serde_json::from_str::<toml::Table>`: serde_json's
/// `arbitrary_precision` feature (switched on for the whole build by the `gguf-rs` crate)
/// hands a float to a foreign `deserialize_any` as a map, so `{"eviction_interval_secs": 1.0}`
/// was refused with "invalid type: map, expected f64".
///
/// # Errors
/// Not JSON, not an object, or a `null` value (TOML has no null).
fn knobs_from_json(s: &str) -> anyhow::Result<toml::Table> {
    fn conv(key: &str, v: serde_json::Value) -> anyhow::Result<toml::Value> {
        use serde_json::Value as J;
        Ok(match v {
            J::Null => bail!("`{key}`: null is not a knob value"),
            J::Bool(b) => toml::Value::Boolean(b),
            J::Number(n) => match (n.as_i64(), n.as_f64()) {
                (Some(i), _) => toml::Value::Integer(i),
                (None, Some(f)) => toml::Value::Float(f),
                (None, None) => bail!("`{key}`: {n} is not a representable number"),
            },
            J::String(s) => toml::Value::String(s),
            J::Array(a) => toml::Value::Array(a.into_iter().map(|x| conv(key, x)).collect::<Result<_, _>>()?),
            J::Object(o) => toml::Value::Table(
                o.into_iter().map(|(k, x)| Ok((k.clone(), conv(&k, x)?))).collect::<anyhow::Result<_>>()?,
            ),
        })
    }
    match serde_json::from_str::<serde_json::Value>(s).context("expected a JSON object")? {
        serde_json::Value::Object(o) => o.into_iter().map(|(k, v)| Ok((k.clone(), conv(&k, v)?))).collect(),
        other => bail!("expected a JSON object, got {other}"),
    }
}

/// Starts one launched worker (`sh -c "exec LINE"`, under `setpriv --pdeathsig KILL` when
/// there is one) with CUDA_VISIBLE_DEVICES set to its rank.
fn spawn_worker(setpriv: Option<&std::path::Path>, line: &str, rank: usize) -> anyhow::Result<tokio::process::Child> {
    let mut c = match setpriv {
        Some(p) => {
            let mut c = tokio::process::Command::new(p);
            c.args(["--pdeathsig", "KILL", "--", "sh", "-c"]);
            c
        }
        None => {
            let mut c = tokio::process::Command::new("sh");
            c.arg("-c");
            c
        }
    };
    c.arg(format!("exec {line}"))
        .env("CUDA_VISIBLE_DEVICES", rank.to_string())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("--worker-cmd: cannot start `{line}`"))
}

/// `name`'s path on PATH, if it is there.
fn which(name: &str) -> Option<std::path::PathBuf> {
    std::env::var_os("PATH")?.to_str()?.split(':').map(|d| std::path::Path::new(d).join(name)).find(|p| p.is_file())
}

fn free_port() -> anyhow::Result<u16> {
    Ok(kvroute_bench::free_port()?)
}

async fn launch(a: &Args, cfg: &mut GatewayConfig) -> anyhow::Result<Launched> {
    let mut children = Launched(Vec::new());
    let n = match (a.launch_workers, a.dp_size) {
        (0, None) => return Ok(children),
        (n, None) | (0, Some(n)) => n,
        (n, Some(d)) if n == d => n,
        (n, Some(d)) => bail!("--launch-workers {n} and --dp-size {d}: give one of them"),
    };
    let cmd = match (&a.worker_cmd, &a.model_path) {
        (Some(c), _) => c.clone(),
        (None, Some(_)) => {
            "python3 -m sglang.launch_server --model-path {model_path} --host 127.0.0.1 --port {port}".into()
        }
        (None, None) => bail!("--launch-workers/--dp-size needs --worker-cmd '... {{port}} ...' or --model-path"),
    };
    if !cmd.contains("{port}") {
        bail!("--worker-cmd must contain {{port}}");
    }
    if cmd.contains("{model_path}") && a.model_path.is_none() {
        bail!("--worker-cmd names {{model_path}}: give --model-path");
    }
    if n > 256 {
        bail!("--launch-workers: at most 256");
    }
    // A launched worker dies with the router even when the router is killed (SIGKILL):
    // util-linux's setpriv sets the kernel's parent-death signal before the worker starts.
    let setpriv = which("setpriv");
    if setpriv.is_none() {
        eprintln!("kvroute: setpriv (util-linux) not found: launched workers outlive a router killed with SIGKILL");
    }
    let mut urls = Vec::new();
    for rank in 0..n {
        let port = free_port()?;
        let line = cmd
            .replace("{port}", &port.to_string())
            .replace("{rank}", &rank.to_string())
            .replace("{gpu}", &rank.to_string())
            .replace("{model_path}", a.model_path.as_deref().unwrap_or_default());
        children.0.push(spawn_worker(setpriv.as_deref(), &line, rank)?);
        urls.push(format!("http://127.0.0.1:{port}"));
    }
    let client = reqwest::Client::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs_f64(a.launch_timeout_secs);
    for u in &urls {
        loop {
            let ok = client
                .get(format!("{u}/health"))
                .timeout(Duration::from_secs(2))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ok {
                break;
            }
            for c in &mut children.0 {
                if let Ok(Some(st)) = c.try_wait() {
                    bail!("a launched worker exited with {st} before becoming healthy");
                }
            }
            if tokio::time::Instant::now() > deadline {
                bail!("launched worker {u} not healthy after {} s", a.launch_timeout_secs);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        eprintln!("kvroute: launched worker {u} is healthy");
    }
    cfg.worker_urls.extend(urls);
    Ok(children)
}

/// Runs the gateway until Ctrl-C / SIGTERM.
pub async fn serve_until_signal(a: Args) -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut cfg = build_config(&a)?;
    let started = cfg.worker_urls.len();
    let _children = launch(&a, &mut cfg).await?;
    let reload = reload_source(&a, cfg.worker_urls[started..].to_vec());
    let listener = tokio::net::TcpListener::bind((cfg.host.as_str(), cfg.port))
        .await
        .with_context(|| format!("cannot listen on {}:{}", cfg.host, cfg.port))?;
    let addr = listener.local_addr()?;
    // Announced once the gateway has read every file it needs: a missing key file prints
    // its error, not "serving on" first.
    let announce = move |cfg: &kvroute_gateway::GatewayConfig| {
        eprintln!(
            "kvroute: serving on {}://{addr} with policy {} and {} worker(s)",
            if cfg.tls_cert.is_some() { "https" } else { "http" },
            cfg.policy,
            cfg.worker_urls.len()
        );
    };
    kvroute_gateway::serve_when_ready(listener, cfg, reload, shutdown_signal(), announce).await
}

/// With `--config`, what SIGHUP reads again: the file, then the environment and flags, as
/// at startup ([`build_config`]), plus the co-launched workers' URLs (`launched`), which
/// no file lists. Without a file nothing could change (the process's environment and
/// flags are fixed), so SIGHUP reloads only the TLS certificate.
fn reload_source(a: &Args, launched: Vec<String>) -> Option<kvroute_gateway::ConfigSource> {
    a.config.as_ref()?;
    let a = a.clone();
    Some(std::sync::Arc::new(move || {
        let mut cfg = build_config(&a)?;
        cfg.worker_urls.extend(launched.iter().cloned());
        Ok(cfg)
    }))
}

/// Resolves on the next Ctrl-C or SIGTERM.
pub async fn next_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}

/// Resolves on Ctrl-C or SIGTERM; from then on a second signal exits the process at once
/// (status 130) instead of waiting for the drain.
pub async fn shutdown_signal() {
    next_signal().await;
    eprintln!("kvroute: shutting down, draining in-flight requests (a second signal exits at once)");
    tokio::spawn(async {
        next_signal().await;
        eprintln!("kvroute: second signal, exiting without draining");
        std::process::exit(130);
    });
}

/// Runs `kvroute serve`.
pub fn run(a: Args) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let r = rt.block_on(serve_until_signal(a));
    // Dropping a runtime waits for its blocking tasks (a DNS lookup, a file read): the
    // drain deadline has passed already, so do not wait for them.
    rt.shutdown_timeout(Duration::from_millis(500));
    r
}

#[cfg(test)]
mod tests {
    use super::knobs_from_json;

    #[test]
    fn policy_knobs_from_json_keep_floats_integers_and_strings() {
        let t = knobs_from_json(
            r#"{"eviction_interval_secs": 1.0, "max_tree_size": 2000000, "cache_threshold": 0.25, "x": "y"}"#,
        )
        .expect("valid knobs");
        assert_eq!(t["eviction_interval_secs"], toml::Value::Float(1.0));
        assert_eq!(t["max_tree_size"], toml::Value::Integer(2_000_000));
        assert_eq!(t["cache_threshold"], toml::Value::Float(0.25));
        assert_eq!(t["x"], toml::Value::String("y".into()));
    }

    #[test]
    fn policy_knobs_that_are_not_an_object_or_hold_null_are_refused() {
        assert!(format!("{:#}", knobs_from_json("[1]").unwrap_err()).contains("expected a JSON object"));
        assert!(format!("{:#}", knobs_from_json("{").unwrap_err()).contains("expected a JSON object"));
        assert!(format!("{:#}", knobs_from_json(r#"{"a": null}"#).unwrap_err()).contains("`a`"));
    }

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        a: super::Args,
    }

    fn parse(args: &[&str]) -> anyhow::Result<kvroute_gateway::GatewayConfig> {
        use clap::Parser;
        let cli = Cli::try_parse_from(std::iter::once("serve").chain(args.iter().copied()))?;
        super::build_config(&cli.a)
    }

    #[test]
    fn sglang_router_cache_aware_flags_set_the_knobs_and_are_refused_where_they_would_do_nothing() {
        let cfg = parse(&[
            "--policy",
            "cache_aware",
            "--cache-threshold",
            "0.3",
            "--balance-abs-threshold",
            "16",
            "--balance-rel-threshold",
            "1.5",
            "--eviction-interval",
            "30",
            "--max-tree-size",
            "1000000",
        ])
        .expect("valid flags");
        let k = &cfg.policy_knobs;
        assert_eq!(k["cache_threshold"], toml::Value::Float(0.3));
        assert_eq!(k["balance_abs_threshold"], toml::Value::Integer(16));
        assert_eq!(k["balance_rel_threshold"], toml::Value::Float(1.5));
        assert_eq!(k["eviction_interval_secs"], toml::Value::Float(30.0));
        assert_eq!(k["max_tree_size"], toml::Value::Integer(1_000_000));
        // The knobs are the policy's own: a bad value is refused by its check, naming it.
        let bad = parse(&["--policy", "cache_aware", "--cache-threshold", "1.5"]).expect_err("out of range");
        assert!(format!("{bad:#}").contains("cache_threshold"), "{bad:#}");
        let later = parse(&["--policy", "cache_aware", "--eviction-interval-secs", "45"]).expect("later SGLang's name");
        assert_eq!(later.policy_knobs["eviction_interval_secs"], toml::Value::Float(45.0));
        let other = parse(&["--policy", "round_robin", "--eviction-interval", "30"]).expect_err("wrong policy");
        assert!(format!("{other:#}").contains("--eviction-interval") && format!("{other:#}").contains("round_robin"));
        let twice = parse(&[
            "--policy",
            "cache_aware",
            "--policy-knobs",
            r#"{"cache_threshold": 0.2}"#,
            "--cache-threshold",
            "0.3",
        ]);
        assert!(format!("{:#}", twice.expect_err("twice")).contains("cache_threshold"));
    }

    #[test]
    fn sglang_router_style_pd_flags_give_each_prefill_worker_its_bootstrap_port() {
        let cfg = parse(&[
            "--pd-disaggregation",
            "--prefill",
            "http://p1:8000",
            "8998",
            "--prefill",
            "http://p2:8000",
            "--prefill",
            "http://p3:8000",
            "none",
            "--decode",
            "http://d1:8000",
            "--pd-protocol",
            "vllm",
            "--colocate-below-tokens",
            "512",
        ])
        .expect("valid flags");
        let p: Vec<(String, Option<u16>)> = cfg.pd.prefill.iter().map(|p| (p.url.clone(), p.bootstrap_port)).collect();
        assert_eq!(
            p,
            vec![
                ("http://p1:8000".into(), Some(8998)),
                ("http://p2:8000".into(), None),
                ("http://p3:8000".into(), None)
            ]
        );
        assert_eq!(cfg.pd.decode, vec!["http://d1:8000".to_string()]);
        assert!(cfg.pd.enabled);
        assert_eq!(cfg.pd.protocol, kvroute_gateway::pd::PdProtocol::Vllm);
        assert_eq!(cfg.pd.colocate_below_tokens, 512);
        let e = parse(&["--pd-disaggregation", "--prefill", "http://p1:8000", "99999", "--decode", "http://d1:8000"])
            .expect_err("bad port");
        assert!(e.to_string().contains("bootstrap port"), "{e}");
        let e = parse(&["--pd-disaggregation", "--prefill", "http://p1:8000"]).expect_err("no decode worker");
        assert!(e.to_string().contains("--decode"), "{e}");
    }
}
