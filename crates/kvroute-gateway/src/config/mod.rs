//! Gateway configuration: one TOML file, flags and `KVROUTE_*` environment variables with
//! the same names (see `docs/configuration.md` and `kvroute.example.toml`).

pub mod kv_migration;
pub mod lora;
pub mod pd;

use crate::model::worker_url::{WorkerUrlError, check_worker_url};
use serde::{Deserialize, Serialize};
use smart_default::SmartDefault;

/// Active health checks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HealthConfig {
    /// Seconds between checks of each worker.
    pub interval_secs: f64,
    /// Timeout of one check, seconds.
    pub timeout_secs: f64,
    /// Consecutive failed checks before a worker is marked unhealthy.
    pub failure_threshold: u32,
    /// Consecutive passed checks before an unhealthy worker is routable again.
    pub success_threshold: u32,
    /// Path checked.
    pub path: String,
    /// Seconds between two reads of a healthy worker's `GET /v1/models` (the models and
    /// LoRA adapters it has loaded); 0 = only when it is added or recovers.
    pub models_refresh_secs: f64,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            interval_secs: 10.0,
            timeout_secs: 5.0,
            failure_threshold: 3,
            success_threshold: 2,
            path: "/health".into(),
            models_refresh_secs: 30.0,
        }
    }
}

/// Everything `kvroute serve` needs. Each key's default stands beside it (`#[default]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, SmartDefault)]
#[serde(deny_unknown_fields, default)]
pub struct GatewayConfig {
    /// Listen address.
    #[default = "127.0.0.1"]
    pub host: String,
    /// Listen port (0 = any free port).
    #[default = 30000]
    pub port: u16,
    /// Routing policy name (`kvroute policies`).
    #[default(kvroute_core::registry::DEFAULT_POLICY.into())]
    pub policy: String,
    /// Policy knobs (a table; unknown knobs are refused at startup).
    pub policy_knobs: toml::Table,
    /// Worker base URLs (http or https).
    pub worker_urls: Vec<String>,
    /// Largest accepted request body, bytes (413 beyond).
    #[default(32 << 20)]
    pub max_body_bytes: usize,
    /// Request bodies held at once, bytes, over every request of `serve` and the endpoint
    /// picker: a body takes its share as it arrives and gives it back when its answer
    /// begins; one the budget cannot hold is refused with 503 and `Retry-After`
    /// ([`crate::body_budget`]). At least `max_body_bytes`.
    #[default(256 << 20)]
    pub max_buffered_body_bytes: u64,
    /// Of `max_buffered_body_bytes`, what one tenant's request bodies may hold at once,
    /// bytes; beyond, that tenant's next body gets 429 and `Retry-After` while the other
    /// tenants are served, so one tenant sending large bodies slowly cannot take the whole
    /// budget from the rest. Acts only when the router knows tenants (`api_key_file`:
    /// each key's tenant, a key naming none being a tenant of its own; else
    /// `tenant_header`). A value below `max_body_bytes` is raised to it (a tenant can
    /// always send one body of the largest size); 0: no share per tenant.
    #[default(64 << 20)]
    pub max_buffered_body_bytes_per_tenant: u64,
    /// Most token ids a prompt may carry (`prompt` as ids, `input_ids`); beyond, 400 before
    /// the ids are held in memory.
    #[default(kvroute_protocol::openai::DEFAULT_MAX_PROMPT_TOKENS)]
    pub max_prompt_tokens: usize,
    /// A client request's headers must arrive within this long, seconds: for a new
    /// connection counted from its accept, so it covers the TLS handshake, the HTTP/1-or-2
    /// sniff and HTTP/2's preface too; on HTTP/1 keep-alive, from the previous response's
    /// end. Also closes a connection (HTTP/1 or HTTP/2) with no request open for this long.
    #[default = 30.0]
    pub header_read_timeout_secs: f64,
    /// A client request's body must arrive within this long of its headers, seconds (408).
    #[default = 30.0]
    pub body_read_timeout_secs: f64,
    /// Open client connections at most (further ones wait in the listen backlog), not
    /// counting the `probe_connections` reserve.
    #[default = 8192]
    pub max_connections: usize,
    /// Connections kept in reserve beyond `max_connections` for health probes: used only
    /// while the `max_connections` are all taken, they serve `GET /health` and
    /// `GET /readiness` (any other request gets 503), one request each, and must send it
    /// within `min(header_read_timeout_secs, 2)` seconds of their accept. 0: no reserve.
    #[default = 4]
    pub probe_connections: usize,
    /// Open connections from one client IP address at most (beyond, a new connection is
    /// closed at accept); 0: no per-client cap. Leave 0 behind a proxy, where every
    /// client has the proxy's address.
    #[default = 0]
    pub max_connections_per_client: usize,
    /// An HTTP/2 connection is sent a PING this often, seconds, and closed when the
    /// client does not answer one within as long again (a vanished peer); 0: no pings.
    #[default = 30.0]
    pub http2_keep_alive_secs: f64,
    /// On SIGTERM/Ctrl-C, the whole shutdown budget, seconds: `drain_delay_secs`, then
    /// in-flight requests drain; at the end streams still open get an SSE error event and
    /// everything left (connections, NATS, etcd, background tasks) is cut. A second signal
    /// exits at once.
    #[default = 30.0]
    pub drain_timeout_secs: f64,
    /// The first part of `drain_timeout_secs`, seconds: `/readiness` answers 503 while new
    /// connections and requests are still served, so load balancers and Kubernetes'
    /// endpoint updates take the replica out before it stops accepting. 0: stop accepting
    /// at once. A delay longer than `drain_timeout_secs` is cut to it (so a configuration
    /// with a short `drain_timeout_secs` from before this key still starts).
    #[default = 5.0]
    pub drain_delay_secs: f64,
    /// Timeout of the TCP (and TLS) connect of one upstream attempt, seconds. A worker that
    /// accepts the connection and then never answers is bounded by `request_timeout_secs`
    /// (and, for a stream, `stream_first_byte_timeout_secs`).
    #[default = 30.0]
    pub connect_timeout_secs: f64,
    /// Total timeout of one proxied request, a stream's whole body included, seconds (600:
    /// the OpenAI Python client's own default; SGLang's and vLLM's routers allow 1800 — see
    /// docs/operations.md, "Timeout defaults").
    #[default = 600.0]
    pub request_timeout_secs: f64,
    /// A streamed request's first bytes (response headers and first chunk) must come from
    /// the worker within this long of the request's arrival, seconds: queueing plus prefill
    /// (120: far above the prefill of a long prompt; a worker that health checks mark down
    /// is left at once, without waiting for it). The client's response starts with that
    /// first chunk, so beyond this it gets a 504 JSON error.
    #[default = 120.0]
    pub stream_first_byte_timeout_secs: f64,
    /// Longest silence between two chunks of a streamed response, seconds (nginx's
    /// `proxy_read_timeout` is 60 s); beyond, an SSE error event ends the stream and the
    /// attempt counts as a failure of the worker.
    #[default = 60.0]
    pub stream_idle_timeout_secs: f64,
    /// Consecutive failures after which a worker is taken out of routing, and the attempts
    /// one request makes on a worker before the next (SGLang router).
    #[default = 3]
    pub max_worker_retries: u32,
    /// Attempts per request across workers before the client gets an error (SGLang router);
    /// the last routable worker may use all that is left (a lone worker gets them all).
    #[default = 6]
    pub max_total_retries: u32,
    /// Largest share of the workers that failed requests may eject at once, in [0, 1]
    /// (rounded down: 0.5 of 3 workers is 1). Beyond it a failing worker stays in routing,
    /// so a fleet-wide problem degrades service instead of taking every worker out.
    #[default = 0.5]
    pub max_ejection_share: f64,
    /// In-flight requests admitted per (model, role); beyond, 503 at once (Cognitora cgn-router).
    #[default = 4096]
    pub max_in_flight_per_model: u32,
    /// Requests one tenant may have in the router at once, over every model (from its
    /// arrival to its answer's end, streams included); beyond, 429 with `Retry-After` to
    /// that tenant while the others are served, so one tenant's open streams cannot fill
    /// `max_in_flight_per_model` for everyone. Acts only when the router knows tenants
    /// (`api_key_file`, else `tenant_header`), as `max_buffered_body_bytes_per_tenant`;
    /// 0: no bound per tenant.
    #[default = 1024]
    pub max_in_flight_per_tenant: u32,
    /// Requests one worker may have in flight, this router's and (with `nats`) the other
    /// replicas' (Ray Serve's `max_ongoing_requests`): a worker at its cap is no candidate,
    /// and with every candidate at it the request is answered 503 with `Retry-After` (Ray
    /// with `max_queued_requests` 0; kvroute does not queue it). 0: no cap.
    #[default = 0]
    pub max_ongoing_requests: u32,
    /// How long `POST /add_worker` waits for a new worker to answer its health check
    /// (`health.path`) before refusing it, seconds (SGLang router's
    /// `worker_startup_timeout_secs`, 300). `wait=false` in the query adds it at once.
    #[default = 300.0]
    pub worker_startup_timeout_secs: f64,
    /// Seconds between two of those checks (SGLang router's `worker_startup_check_interval`, 10).
    #[default = 10.0]
    pub worker_startup_check_interval_secs: f64,
    /// Bearer token of the admin API (`Authorization: Bearer <admin_token>`). With one, the
    /// admin API is served on the main port (unless `admin_listen` is set) to any client
    /// presenting it. Without one, the main port serves no admin endpoint at all (404): a
    /// same-host reverse proxy makes every client look like loopback, so "the peer is
    /// loopback" cannot stand for "local" there. The admin API is then only on
    /// `admin_listen`.
    pub admin_token: Option<String>,
    /// A file holding the admin API's token instead (`admin_token` and this are exclusive):
    /// read at start (a file that cannot be read, or holds only whitespace, stops it) and
    /// again on every reload — SIGHUP, or a change seen by `reload_watch_secs` — so a token
    /// kept in a Kubernetes Secret rotates without a restart ([`crate::admin_token`]). At
    /// most 4 KiB; surrounding whitespace is dropped. Its path needs a restart.
    pub admin_token_file: Option<String>,
    /// A separate listener (`IP:PORT`) for the admin API; when set, the main port serves no
    /// admin endpoint (404), so the two can face different networks. Without `admin_token`
    /// it must be a loopback address, and it answers only loopback clients whose request
    /// names no proxy (`Forwarded`, `X-Forwarded-For`, `X-Real-IP`).
    pub admin_listen: Option<String>,
    /// Endpoint-picker mode: serve the Gateway API Inference Extension's endpoint-picker
    /// protocol (Envoy ext_proc v3 over gRPC, with the gRPC health service) on this
    /// `IP:PORT`, next to the HTTP port. A gateway then asks kvroute where each request goes
    /// and forwards it itself (docs/kubernetes.md). Not with `[pd]` or `[[cascade.chain]]`,
    /// which need kvroute to send the request.
    pub epp_listen: Option<String>,
    /// How the gateway's ext_proc filter sends bodies: `auto` (what Envoy's
    /// `protocol_config` says, else `full_duplex`), `buffered` (request body `BUFFERED`,
    /// response body `STREAMED`) or `full_duplex` (both `FULL_DUPLEX_STREAMED`, the body
    /// passed back through kvroute).
    #[default(EppBodyMode::Auto)]
    pub epp_body_mode: EppBodyMode,
    /// Serve `epp_listen` over TLS (ALPN `h2`): with `tls_cert`/`tls_key`, the main port's
    /// certificate (reloaded with it on SIGHUP); without, a self-signed certificate made at
    /// start, as the Gateway API Inference Extension's reference endpoint picker serves by
    /// default, for gateways that reach their picker over TLS without verifying it (NGINX
    /// Gateway Fabric's default; Istio with `insecureSkipVerify`). Off: plaintext h2c.
    pub epp_tls: bool,
    /// Client request headers forwarded to workers (case-insensitive names; at most 32).
    /// `Content-Type` is always set to JSON. Default: `authorization` only, as vLLM and
    /// SGLang servers started with `--api-key` expect.
    #[default(vec!["authorization".into()])]
    pub forward_headers: Vec<String>,
    /// Client API keys: a file of `KEY [TENANT] [rpm=N] [tpm=N]` lines
    /// ([`crate::api_keys`]). When set, inference and `/v1/models` need
    /// `Authorization: Bearer KEY` (401 otherwise) and each key is rate limited (429).
    pub api_key_file: Option<String>,
    /// Requests per minute per API key unless its line sets `rpm` (0 = unlimited).
    #[default = 0]
    pub api_key_rpm: u32,
    /// Tokens (prompt plus `max_tokens`) per minute per API key unless its line sets `tpm`
    /// (0 = unlimited).
    #[default = 0]
    pub api_key_tpm: u32,
    /// Hosts or CIDRs worker URLs may point at (`/add_worker` and the configuration);
    /// empty = any. Host names match by name, IP literals by network.
    pub worker_allow: Vec<String>,
    /// A request header naming the client's tenant, set by a trusted proxy in front of the
    /// router (which must overwrite what clients send). Used when there is no
    /// `api_key_file` (an API key's tenant wins). Unset: tenants come from API keys only.
    pub tenant_header: Option<String>,
    /// Key each tenant's prefix state apart (a per-tenant salt on every routing key,
    /// [`kvroute_core::tenant`]), so one tenant's prompts neither attract another's
    /// requests nor can be probed by them. Acts only when tenants are known (API keys or
    /// `tenant_header`). Default on; off shares one cache between all tenants.
    #[default = true]
    pub tenant_isolation: bool,
    /// Groups of tenants that trust each other and share one prefix cache (tenant names as
    /// in `api_key_file` or `tenant_header`), e.g. `[["team-a", "team-b"]]`.
    pub shared_prefix_tenants: Vec<Vec<String>>,
    /// With tenant isolation, add the tenant's salt to each OpenAI request body sent to a
    /// worker as `cache_salt` (vLLM isolates its KV cache by it; engines without the field
    /// ignore it). Replaces a `cache_salt` the client sent.
    #[default = true]
    pub engine_cache_salt: bool,
    /// Send `x-kvroute-worker` and `x-kvroute-decision` on every response. Unsafe with
    /// several tenants: the match count reveals other tenants' prompts. Off: only requests
    /// carrying the admin token get them.
    #[default = false]
    pub expose_decision_headers: bool,
    /// PEM certificate chain (leaf first) served to clients over HTTPS, on the main and the
    /// admin listener; with `tls_key`. Both files are read again on SIGHUP (a file that
    /// fails to load keeps the certificate in use). Unset: plain HTTP.
    pub tls_cert: Option<String>,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1) of `tls_cert`.
    pub tls_key: Option<String>,
    /// Every this many seconds, read the files a SIGHUP reads again — `tls_cert`, `tls_key`,
    /// `api_key_file`, `admin_token_file` and, with `kvroute serve --config`, the
    /// configuration — and reload what changed as a SIGHUP would: for deployments that
    /// cannot signal the process (a Kubernetes Secret or ConfigMap mounted into a container
    /// without a shell, a certificate renewed by cert-manager). 0: off, SIGHUP only. At
    /// least 1 s.
    #[default = 0.0]
    pub reload_watch_secs: f64,
    /// PEM bundle of CA certificates trusted for `https://` workers, besides the system's
    /// roots (a private CA of the inference fleet).
    pub worker_ca_file: Option<String>,
    /// etcd endpoints (`http://HOST:PORT`) of the cluster registry and live policy
    /// ([`crate::cluster`]); empty = no etcd.
    pub etcd: Vec<String>,
    /// Key prefix in etcd: workers under `PREFIX/workers/`, the policy at
    /// `PREFIX/routing/policy` unless `etcd_policy_key` says otherwise.
    #[default = "/kvroute"]
    pub etcd_prefix: String,
    /// The etcd key holding the live policy (`{"policy": NAME, "knobs": {...}}`, or
    /// Cognitora cgn-router's `{"w_kv":..,"w_load":..,"w_pwr":..,"w_cap":..}` at
    /// `/cognitora/routing/policy`); default `PREFIX/routing/policy`.
    pub etcd_policy_key: Option<String>,
    /// Directory for state this replica keeps across restarts (created if missing): the last
    /// known etcd worker registry, `etcd-registry.json`, rewritten (temporary file and
    /// rename) when etcd's list changes and read when the replica starts while etcd is
    /// unreachable, its workers then marked stale until etcd answers
    /// ([`crate::cluster::last_known`]). One directory per replica. Unset: nothing is
    /// written, and a replica started during an etcd outage has only its static workers.
    pub state_dir: Option<String>,
    /// With `state_dir`: the prefix state (the last routed requests) is saved there and
    /// restored at start when the file is at most this old, seconds (0: never restored).
    /// Older, the engines may have evicted what it says they hold.
    #[default = 600.0]
    pub prefix_state_max_age_secs: f64,
    /// NATS server (`nats://HOST:PORT`) over which the router replicas of `cluster` share
    /// their routing events and index snapshots ([`crate::cluster::sync`]); unset = this
    /// replica routes on its own state only.
    pub nats: Option<String>,
    /// Name of the replica group sharing state over NATS (a subject token: letters,
    /// digits, `-`, `_`; at most 64 bytes). Replicas of different clusters on one NATS
    /// server ignore each other.
    #[default = "default"]
    pub cluster: String,
    /// This replica's id in the cluster (default: a random id per start, so a restarted
    /// replica never reuses an old event sequence).
    pub replica_id: Option<String>,
    /// How long a starting replica waits for a peer's index snapshot before it reports
    /// ready on local state alone, seconds.
    #[default = 5.0]
    pub sync_snapshot_timeout_secs: f64,
    /// How often, at most, the replica sync sends in full a routed event the cluster has
    /// already applied — the same prompt, block hashes, token counts and session (or none)
    /// on the same worker under the same model and policy — seconds; in between such an
    /// event goes as load only and the other replicas skip its commit
    /// ([`crate::cluster::sync::RoutedEvent::repeat`]). 0 = every event in full. A policy
    /// whose commits are not idempotent (B3 capped) always sends in full.
    #[default = 10]
    pub sync_refresh_secs: u64,
    /// How long the replica sync gathers this replica's events after the first of a batch
    /// before it publishes them to NATS, milliseconds (1–1,000): longer sends fewer, larger
    /// messages — each one wakes the NATS server and every other replica, which on a busy
    /// machine costs more than the bytes — and lets the other replicas see this replica's
    /// requests that much later.
    #[default = 20]
    pub sync_batch_ms: u64,
    /// Record every dispatched request as a line of a privacy-safe trace in this file
    /// (session-JSONL Mooncake form: timestamp, token counts, salted block ids, session;
    /// no text) that `kvroute replay --trace` reads ([`crate::record`]); unset = off.
    pub record: Option<String>,
    /// Size at which the trace file rotates to `FILE.1`, bytes (at least 4,096).
    #[default(256 << 20)]
    pub record_max_bytes: u64,
    /// Trace files kept in all, the current one included (1 to 100).
    #[default = 4]
    pub record_files: u32,
    /// Tokens per block of the trace's `hash_ids` (1 to 65,536; vLLM's default block size
    /// is 16, Mooncake's trace uses 512).
    #[default = 16]
    pub record_block_tokens: u32,
    /// Scrape each worker's `/metrics` for engine load signals.
    #[default = false]
    pub scrape_metrics: bool,
    /// Prometheus gauge read as the worker's power draw in watts (kv_score's `w_pwr`), with
    /// `scrape_metrics`: default NVIDIA DCGM's `DCGM_FI_DEV_POWER_USAGE` (summed over a
    /// worker's GPUs); Cognitora cgn-router's `cgn_power_watts` works too; `None` or `""`
    /// reads none.
    #[default(Some("DCGM_FI_DEV_POWER_USAGE".into()))]
    pub power_metric: Option<String>,
    /// Where the power gauge is read: `None`, the worker's own `/metrics`; else a URL
    /// template whose `{host}` is replaced by the worker's host, e.g.
    /// `http://{host}:9400/metrics` for NVIDIA's DCGM exporter beside each worker.
    pub power_exporter: Option<String>,
    /// The power gauge is averaged over this many seconds of scrapes (Cognitora
    /// cgn-router's 30 s rolling average), so one reading does not swing routing.
    #[default = 30.0]
    pub power_window_secs: f64,
    /// Seed of the policy's random source.
    #[default = 0]
    pub seed: u64,
    /// Copies of each model's policy state the router keeps: 2 (decisions never wait for a
    /// commit or an eviction slice; twice the policy's memory) or 1 (half the memory; a
    /// decision waits while a writer holds the state). Restart to change.
    #[default = 2]
    pub policy_copies: u8,
    /// Active health checks.
    pub health: HealthConfig,
    /// Capacity facts per worker URL (`[capacity."http://gpu-1:8000"]` with `tp_size`,
    /// `dtype`, `vram_gb`, `free_model_slots`, `max_concurrent`), over what the worker's
    /// registration and its own `/server_info` or `/props` say. Live on reload.
    pub capacity: std::collections::BTreeMap<String, crate::model::capacity::Capacity>,
    /// Where this router runs and its workers' node and zone labels (`[locality]`): requests
    /// go to workers on the router's node when one can take them, else in its zone, else
    /// anywhere (Ray Serve's `LocalityMixin`). Restart to change.
    pub locality: crate::model::locality::LocalityConfig,
    /// Prefill/decode disaggregation (`[pd]`, `[[pd.prefill]]`; SGLang router's
    /// `--pd-disaggregation --prefill URL [PORT] --decode URL`).
    pub pd: crate::config::pd::PdConfig,
    /// Model multiplexing with runtime-loaded LoRA adapters (`[lora]`, `[[lora.adapters]]`).
    pub lora: crate::config::lora::LoraConfig,
    /// The KV mover for llama.cpp workers (`[kv_migration]`, [`crate::config::kv_migration`]).
    pub kv_migration: crate::config::kv_migration::KvMigrationConfig,
    /// Model cascades (Cognitora cgn-router): `[[cascade.chain]]` tables; none = off.
    /// Live: a SIGHUP reload or the etcd policy key's `cascade` field replaces them.
    pub cascade: kvroute_core::cascade::CascadeConfig,
    /// Engine KV-event sources, one per worker that publishes them (vLLM, SGLang,
    /// `kvroute engine-sim --kv-events`). Workers without one are routed on the policy's
    /// approximate index.
    pub kv_events: Vec<KvEventSource>,
    /// Weight of a block held only on a lower tier (CPU, disk) in the precise index, in [0, 1].
    #[default = 0.5]
    pub kv_lower_tier_weight: f64,
    /// Predict-on-route window of the precise index, seconds (0 turns it off): a request's
    /// blocks count as held by its worker this long or until the engine's events say
    /// otherwise, covering siblings that arrive before the engine's `BlockStored`.
    #[default = 2.0]
    pub kv_predict_window_secs: f64,
    /// Startup parity check per KV-event worker: a probe prompt whose `BlockStored` must
    /// match the router's own hashes (metric `kvroute_kv_parity`, error log on mismatch).
    #[default = true]
    pub kv_parity_check: bool,
    /// Threads of the KV-event subscribers and their applier, a runtime apart from the
    /// requests' (1 to 64): the most cores ingestion takes however fast engines publish.
    /// One thread ingested ~1.3 M block events/s through ZeroMQ on this project's 2-core VM.
    #[default = 1]
    pub kv_event_threads: u16,
    /// Local tokenizer for token-accurate routing keys without a round trip per request: a
    /// GGUF model file (llama.cpp workers; vocabulary and chat template from its metadata)
    /// or a Hugging Face `tokenizer.json` (with `tokenizer_config.json` beside it). Checked
    /// against each worker once at startup (metric `kvroute_tokenizer_parity`).
    pub tokenizer: Option<String>,
    /// llama.cpp slot routing ([`SlotRouting`]): for a worker that keeps a prompt only in
    /// the slot that ran it (`--cache-ram 0`), the router tracks what each slot of a worker
    /// with `llama_slots` (from `/props` `total_slots`, or `[capacity."URL"]`) holds,
    /// credits the worker with the prefix its chosen slot holds (instead of everything the
    /// prefix index saw sent there), and names the slot in the request (llama.cpp
    /// `id_slot`), so two prompts sharing a worker stop swapping slots
    /// ([`kvroute_core::slots`]). `auto` (default) turns it on per worker when a probe finds
    /// no host-memory prompt cache; `true` and `false` force it.
    #[default(SlotRouting::Auto)]
    pub llama_slot_routing: SlotRouting,
}

/// Where one worker publishes its KV events (vLLM's `--kv-events-config`; the format is
/// `vllm/distributed/kv_events.py` in github.com/vllm-project/vllm).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvEventSource {
    /// The worker's base URL, as in `worker_urls`.
    pub worker: String,
    /// The engine's PUB endpoint, `tcp://HOST:PORT` (the router connects a SUB socket).
    pub endpoint: String,
    /// The engine's replay (ROUTER) endpoint, for batches lost in a sequence gap.
    #[serde(default)]
    pub replay: Option<String>,
}

/// A malformed `kv_events` entry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvEventSourceError {
    /// The flag form lacks `=`.
    #[error("`{given}`: expected WORKER_URL=tcp://HOST:PORT[+tcp://HOST:PORT]")]
    Form {
        /// The entry as given.
        given: String,
    },
    /// The worker URL is refused.
    #[error(transparent)]
    Worker(#[from] WorkerUrlError),
    /// An endpoint is not `tcp://HOST:PORT` with a host to connect to.
    #[error("`{endpoint}`: expected tcp://HOST:PORT with a host to connect to and a port (only tcp:// is supported)")]
    Endpoint {
        /// The endpoint as given.
        endpoint: String,
    },
}

impl KvEventSource {
    /// Parses the flag form `WORKER_URL=tcp://HOST:PORT[+tcp://HOST:REPLAY_PORT]`.
    ///
    /// # Errors
    /// [`KvEventSourceError`] naming what is wrong.
    pub fn parse(s: &str) -> Result<KvEventSource, KvEventSourceError> {
        let (worker, rest) = s.split_once('=').ok_or_else(|| KvEventSourceError::Form { given: s.to_string() })?;
        let (endpoint, replay) = match rest.split_once('+') {
            Some((e, r)) => (e, Some(r.to_string())),
            None => (rest, None),
        };
        let src = KvEventSource { worker: worker.to_string(), endpoint: endpoint.to_string(), replay };
        src.check()?;
        Ok(src)
    }

    fn check(&self) -> Result<(), KvEventSourceError> {
        check_worker_url(&self.worker)?;
        for e in std::iter::once(&self.endpoint).chain(self.replay.iter()) {
            let ok = e
                .strip_prefix("tcp://")
                .and_then(|hp| hp.rsplit_once(':'))
                .is_some_and(|(host, port)| !host.is_empty() && host != "*" && port.parse::<u16>().is_ok());
            if !ok {
                return Err(KvEventSourceError::Endpoint { endpoint: e.clone() });
            }
        }
        Ok(())
    }
}

/// A configuration error naming the key.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration: `{key}`: {message}")]
pub struct ConfigError {
    /// Offending key.
    pub key: String,
    /// What is wrong.
    pub message: String,
}

fn err(key: &str, message: impl std::fmt::Display) -> ConfigError {
    ConfigError { key: key.into(), message: message.to_string() }
}

impl GatewayConfig {
    /// The etcd key of the live policy.
    pub fn policy_key(&self) -> String {
        self.etcd_policy_key.clone().unwrap_or_else(|| format!("{}/routing/policy", self.etcd_prefix))
    }

    /// The `capacity` table's entry for a worker URL (compared normalised).
    pub fn capacity_of(&self, url: &str) -> Option<crate::model::capacity::Capacity> {
        self.capacity.iter().find(|(k, _)| check_worker_url(k).is_ok_and(|k| k == url)).map(|(_, c)| c.clone())
    }

    /// Parses TOML text (unknown keys are errors naming the key).
    ///
    /// # Errors
    /// [`ConfigError`] naming the key.
    pub fn from_toml(text: &str) -> Result<GatewayConfig, ConfigError> {
        let cfg: GatewayConfig = toml::from_str(text).map_err(|e| {
            let msg = e.message().to_string();
            let key = msg.split('`').nth(1).unwrap_or("(file)").to_string();
            err(&key, e.to_string().trim().replace('\n', " "))
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Policy knobs as JSON.
    pub fn knobs_json(&self) -> serde_json::Value {
        serde_json::to_value(&self.policy_knobs).unwrap_or(serde_json::Value::Null)
    }

    /// Checks ranges, URLs, the policy name and its knobs, one section after the other.
    ///
    /// # Errors
    /// [`ConfigError`] naming the key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.check_workers()?;
        self.check_forward_headers()?;
        self.check_admin_listen()?;
        self.check_epp()?;
        self.check_cluster()?;
        self.check_power()?;
        self.check_record()?;
        self.check_tls()?;
        self.check_serving_modes()?;
        self.check_capacity()?;
        self.check_tenancy()?;
        self.check_admin_token()?;
        self.check_policy()?;
        self.check_limits()?;
        self.check_timeouts()?;
        self.check_retries()?;
        self.check_health()?;
        self.check_kv_events()?;
        Ok(())
    }

    /// Worker URLs: the `worker_allow` entries, then each of `worker_urls` and whether it is
    /// allowed.
    fn check_workers(&self) -> Result<(), ConfigError> {
        for a in &self.worker_allow {
            parse_allow(a).map_err(|m| err("worker_allow", m))?;
        }
        for u in &self.worker_urls {
            let u = check_worker_url(u).map_err(|m| err("worker_urls", m))?;
            self.check_worker_allowed(&u).map_err(|m| err("worker_urls", m))?;
        }
        Ok(())
    }

    /// `forward_headers`: how many, and that each is a header name.
    fn check_forward_headers(&self) -> Result<(), ConfigError> {
        if self.forward_headers.len() > MAX_FORWARD_HEADERS {
            return Err(err("forward_headers", format!("at most {MAX_FORWARD_HEADERS} names")));
        }
        for h in &self.forward_headers {
            http::HeaderName::from_bytes(h.as_bytes())
                .map_err(|_| err("forward_headers", format!("`{h}` is not a header name")))?;
        }
        Ok(())
    }

    /// `admin_listen`: an IP address, loopback unless `admin_token` is set.
    fn check_admin_listen(&self) -> Result<(), ConfigError> {
        if let Some(a) = &self.admin_listen {
            let addr = a
                .parse::<std::net::SocketAddr>()
                .map_err(|_| err("admin_listen", format!("`{a}`: expected HOST:PORT with an IP host")))?;
            if !self.has_admin_token() && !addr.ip().to_canonical().is_loopback() {
                return Err(err(
                    "admin_listen",
                    format!(
                        "`{a}` is not a loopback address: without `admin_token` the admin API listens on \
                         loopback only (127.0.0.1 or [::1]); set `admin_token` to serve it elsewhere"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// `epp_listen`: an IP address and port, and no serving mode that needs kvroute to send
    /// the request itself; `epp_tls` only with it.
    fn check_epp(&self) -> Result<(), ConfigError> {
        let Some(a) = &self.epp_listen else {
            return match self.epp_tls {
                true => Err(err("epp_tls", "needs epp_listen: it serves the endpoint picker's listener over TLS")),
                false => Ok(()),
            };
        };
        a.parse::<std::net::SocketAddr>()
            .map_err(|_| err("epp_listen", format!("`{a}`: expected HOST:PORT with an IP host")))?;
        if self.pd.enabled {
            return Err(err("epp_listen", "not with [pd]: a split request needs kvroute to send both halves"));
        }
        if !self.cascade.chain.is_empty() {
            return Err(err("epp_listen", "not with [[cascade.chain]]: a cascade needs kvroute to send each step"));
        }
        Ok(())
    }

    /// Cluster mode: the etcd endpoints and keys, `state_dir`, NATS, the cluster and replica
    /// names, the snapshot timeout.
    fn check_cluster(&self) -> Result<(), ConfigError> {
        for e in &self.etcd {
            let ok = url::Url::parse(e).is_ok_and(|u| matches!(u.scheme(), "http" | "https") && u.host().is_some());
            if !ok {
                return Err(err("etcd", format!("`{e}`: expected http://HOST:PORT")));
            }
        }
        if !self.etcd_prefix.starts_with('/') || self.etcd_prefix.ends_with('/') || self.etcd_prefix.len() > 256 {
            return Err(err("etcd_prefix", "expected a key prefix like `/kvroute` (leading `/`, no trailing `/`)"));
        }
        if self.etcd_policy_key.as_deref().is_some_and(|k| k.is_empty() || k.len() > 512) {
            return Err(err("etcd_policy_key", "expected a key of 1 to 512 bytes"));
        }
        if !(self.prefix_state_max_age_secs >= 0.0 && self.prefix_state_max_age_secs.is_finite()) {
            return Err(err("prefix_state_max_age_secs", "expected a number of seconds >= 0"));
        }
        if let Some(d) = &self.state_dir {
            if d.is_empty() || d.len() > 4096 {
                return Err(err("state_dir", "expected a directory path of 1 to 4096 bytes"));
            }
            if std::path::Path::new(d).exists() && !std::path::Path::new(d).is_dir() {
                return Err(err("state_dir", format!("`{d}` exists and is not a directory")));
            }
        }
        if let Some(n) = &self.nats {
            let ok = url::Url::parse(n).is_ok_and(|u| matches!(u.scheme(), "nats" | "tls") && u.host().is_some());
            if !ok {
                return Err(err("nats", format!("`{n}`: expected nats://HOST:PORT")));
            }
        }
        let token = |t: &str| {
            !t.is_empty() && t.len() <= 64 && t.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        };
        if !token(&self.cluster) {
            return Err(err("cluster", format!("`{}`: expected 1 to 64 letters, digits, `-` or `_`", self.cluster)));
        }
        if let Some(r) = self.replica_id.as_deref().filter(|r| !token(r)) {
            return Err(err("replica_id", format!("`{r}`: expected 1 to 64 letters, digits, `-` or `_`")));
        }
        if !(self.sync_snapshot_timeout_secs.is_finite() && (0.0..=600.0).contains(&self.sync_snapshot_timeout_secs)) {
            return Err(err("sync_snapshot_timeout_secs", "expected 0 to 600 seconds"));
        }
        if self.sync_refresh_secs > 600 {
            return Err(err("sync_refresh_secs", "expected 0 to 600 seconds"));
        }
        if !(1..=1000).contains(&self.sync_batch_ms) {
            return Err(err("sync_batch_ms", "expected 1 to 1000 milliseconds"));
        }
        Ok(())
    }

    /// Power readings: the exporter URL template and the averaging window.
    fn check_power(&self) -> Result<(), ConfigError> {
        if let Some(t) = &self.power_exporter {
            let probe = t.replace("{host}", "worker.example");
            if !url::Url::parse(&probe).is_ok_and(|u| matches!(u.scheme(), "http" | "https") && u.host().is_some()) {
                return Err(err(
                    "power_exporter",
                    format!("`{t}`: expected an http(s) URL, `{{host}}` for the worker's host"),
                ));
            }
        }
        if !(self.power_window_secs.is_finite() && (0.0..=3600.0).contains(&self.power_window_secs)) {
            return Err(err("power_window_secs", "expected 0 to 3600 seconds"));
        }
        Ok(())
    }

    /// The traffic recorder: its path, file size and count, block size.
    fn check_record(&self) -> Result<(), ConfigError> {
        if self.record.as_deref().is_some_and(str::is_empty) {
            return Err(err("record", "expected a file path"));
        }
        if self.record_max_bytes < 4096 {
            return Err(err("record_max_bytes", "expected at least 4096 bytes"));
        }
        if !(1..=2).contains(&self.policy_copies) {
            return Err(err("policy_copies", "expected 1 or 2 copies"));
        }
        if !(1..=64).contains(&self.kv_event_threads) {
            return Err(err("kv_event_threads", "expected 1 to 64 threads"));
        }
        if !(1..=100).contains(&self.record_files) {
            return Err(err("record_files", "expected 1 to 100 files"));
        }
        if !(1..=65_536).contains(&self.record_block_tokens) {
            return Err(err("record_block_tokens", "expected 1 to 65536 tokens"));
        }
        Ok(())
    }

    /// `tls_cert` and `tls_key`: both or neither.
    fn check_tls(&self) -> Result<(), ConfigError> {
        match (&self.tls_cert, &self.tls_key) {
            (Some(_), None) => return Err(err("tls_key", "`tls_cert` is set but `tls_key` is not")),
            (None, Some(_)) => return Err(err("tls_cert", "`tls_key` is set but `tls_cert` is not")),
            _ => {}
        }
        Ok(())
    }

    /// Cascades, the LoRA catalogue, the KV mover and disaggregation, with the P/D pools' worker URLs.
    fn check_serving_modes(&self) -> Result<(), ConfigError> {
        self.cascade.validate().map_err(|m| err("cascade", m))?;
        self.lora.validate().map_err(|m| err("lora", m))?;
        self.kv_migration.check().map_err(|(k, m)| err(&format!("kv_migration.{k}"), m))?;
        if self.kv_migration.enabled && self.llama_slot_routing == SlotRouting::Off {
            return Err(err(
                "kv_migration.enabled",
                "needs llama_slot_routing \"auto\" or \"true\": the mover saves and restores the slots requests are pinned to",
            ));
        }
        self.pd.validate().map_err(|(k, m)| err(&k, m))?;
        for u in self.pd.urls() {
            let u = check_worker_url(u).map_err(|m| err("pd", m))?;
            self.check_worker_allowed(&u).map_err(|m| err("pd", m))?;
        }
        Ok(())
    }

    /// The `capacity` table: how many workers, their URLs and fields.
    fn check_capacity(&self) -> Result<(), ConfigError> {
        if self.capacity.len() > crate::model::worker_url::MAX_WORKERS {
            return Err(err("capacity", format!("at most {} workers", crate::model::worker_url::MAX_WORKERS)));
        }
        for (url, c) in &self.capacity {
            check_worker_url(url).map_err(|m| err("capacity", m))?;
            if let Some(k) = c.unknown.keys().next() {
                return Err(err(
                    &format!("capacity.{k}"),
                    "unknown field (tp_size, dtype, vram_gb, free_model_slots, max_concurrent, max_loras, max_model_len)",
                ));
            }
            c.check().map_err(|m| err("capacity", format!("`{url}`: {m}")))?;
        }
        if self.locality.workers.len() > crate::model::worker_url::MAX_WORKERS {
            return Err(err("locality.workers", format!("at most {} workers", crate::model::worker_url::MAX_WORKERS)));
        }
        for url in self.locality.workers.keys() {
            check_worker_url(url).map_err(|m| err("locality.workers", m))?;
        }
        Ok(())
    }

    /// A worker's node and zone: `[locality.workers."URL"]` (compared normalised), else the
    /// labels of its registration.
    pub fn place_of(
        &self,
        url: &str,
        labels: Option<&std::collections::BTreeMap<String, String>>,
    ) -> crate::model::locality::WorkerPlace {
        self.locality
            .workers
            .iter()
            .find(|(k, _)| check_worker_url(k).is_ok_and(|k| k == url))
            .map(|(_, p)| p.clone())
            .or_else(|| labels.map(crate::model::locality::WorkerPlace::from_labels))
            .unwrap_or_default()
    }

    /// Tenancy: `tenant_header` and the `shared_prefix_tenants` groups.
    fn check_tenancy(&self) -> Result<(), ConfigError> {
        if let Some(h) = &self.tenant_header {
            http::HeaderName::from_bytes(h.as_bytes())
                .map_err(|_| err("tenant_header", format!("`{h}` is not a header name")))?;
        }
        if self.shared_prefix_tenants.len() > MAX_TENANT_GROUPS {
            return Err(err("shared_prefix_tenants", format!("at most {MAX_TENANT_GROUPS} groups")));
        }
        kvroute_core::tenant::Scopes::new(&self.shared_prefix_tenants).map_err(|m| err("shared_prefix_tenants", m))?;
        Ok(())
    }

    /// `admin_token`: not empty when set; `admin_token_file`: not with it, not an empty path.
    fn check_admin_token(&self) -> Result<(), ConfigError> {
        if self.admin_token.as_deref().is_some_and(str::is_empty) {
            return Err(err("admin_token", "must not be empty"));
        }
        match self.admin_token_file.as_deref() {
            Some("") => Err(err("admin_token_file", "must not be empty")),
            Some(_) if self.admin_token.is_some() => {
                Err(err("admin_token_file", "set `admin_token` or `admin_token_file`, not both"))
            }
            _ => Ok(()),
        }
    }

    /// Whether the admin API has a token (`admin_token` or `admin_token_file`).
    pub fn has_admin_token(&self) -> bool {
        self.admin_token.is_some() || self.admin_token_file.is_some()
    }

    /// `policy` and `policy_knobs`: the registry builds them.
    fn check_policy(&self) -> Result<(), ConfigError> {
        kvroute_core::registry::build(&self.policy, &self.knobs_json()).map_err(|e| match e {
            kvroute_core::registry::BuildError::Unknown { .. } => err("policy", e.to_string()),
            kvroute_core::registry::BuildError::Knobs(k) => err("policy_knobs", k.message),
        })?;
        Ok(())
    }

    /// Request and connection limits: prompt tokens, body bytes, connections.
    fn check_limits(&self) -> Result<(), ConfigError> {
        if self.max_prompt_tokens == 0 {
            return Err(err("max_prompt_tokens", "must be at least 1"));
        }
        if self.max_body_bytes == 0 {
            return Err(err("max_body_bytes", "must be at least 1"));
        }
        if self.max_buffered_body_bytes < self.max_body_bytes as u64 {
            return Err(err(
                "max_buffered_body_bytes",
                format!(
                    "must be at least max_body_bytes ({}), got {}",
                    self.max_body_bytes, self.max_buffered_body_bytes
                ),
            ));
        }
        if self.max_connections == 0 {
            return Err(err("max_connections", "must be at least 1"));
        }
        Ok(())
    }

    /// Timeouts, delays and intervals: positive (or 0 where 0 turns them off), at most
    /// [`MAX_TIMEOUT_SECS`].
    fn check_timeouts(&self) -> Result<(), ConfigError> {
        for (k, v) in [
            ("header_read_timeout_secs", self.header_read_timeout_secs),
            ("body_read_timeout_secs", self.body_read_timeout_secs),
            ("drain_timeout_secs", self.drain_timeout_secs),
            ("connect_timeout_secs", self.connect_timeout_secs),
            ("request_timeout_secs", self.request_timeout_secs),
            ("stream_first_byte_timeout_secs", self.stream_first_byte_timeout_secs),
            ("stream_idle_timeout_secs", self.stream_idle_timeout_secs),
            ("health.interval_secs", self.health.interval_secs),
            ("health.timeout_secs", self.health.timeout_secs),
            ("worker_startup_timeout_secs", self.worker_startup_timeout_secs),
            ("worker_startup_check_interval_secs", self.worker_startup_check_interval_secs),
        ] {
            // Bounded above too: `Duration::from_secs_f64` panics on absurd values.
            if !(v.is_finite() && v > 0.0 && v <= MAX_TIMEOUT_SECS) {
                return Err(err(k, format!("must be a positive number of seconds up to {MAX_TIMEOUT_SECS}, got {v}")));
            }
        }
        for (k, v) in
            [("drain_delay_secs", self.drain_delay_secs), ("http2_keep_alive_secs", self.http2_keep_alive_secs)]
        {
            if !(v.is_finite() && (0.0..=MAX_TIMEOUT_SECS).contains(&v)) {
                return Err(err(
                    k,
                    format!("must be 0 or a positive number of seconds up to {MAX_TIMEOUT_SECS}, got {v}"),
                ));
            }
        }
        let w = self.reload_watch_secs;
        if !(w.is_finite() && (w == 0.0 || (1.0..=MAX_TIMEOUT_SECS).contains(&w))) {
            return Err(err(
                "reload_watch_secs",
                format!("must be 0 (off) or 1 to {MAX_TIMEOUT_SECS} seconds, got {w}"),
            ));
        }
        let m = self.health.models_refresh_secs;
        if !(m.is_finite() && (0.0..=MAX_TIMEOUT_SECS).contains(&m)) {
            return Err(err(
                "health.models_refresh_secs",
                format!("expected 0 to {MAX_TIMEOUT_SECS} seconds, got {m}"),
            ));
        }
        Ok(())
    }

    /// Retries, ejection and the per-model in-flight cap.
    fn check_retries(&self) -> Result<(), ConfigError> {
        if self.max_total_retries == 0 {
            return Err(err("max_total_retries", "must be at least 1"));
        }
        if self.max_worker_retries == 0 {
            return Err(err("max_worker_retries", "must be at least 1"));
        }
        if !(0.0..=1.0).contains(&self.max_ejection_share) {
            return Err(err("max_ejection_share", format!("must be in [0, 1], got {}", self.max_ejection_share)));
        }
        if self.max_in_flight_per_model == 0 {
            return Err(err("max_in_flight_per_model", "must be at least 1"));
        }
        Ok(())
    }

    /// Health checks: their thresholds and path.
    fn check_health(&self) -> Result<(), ConfigError> {
        if self.health.failure_threshold == 0 || self.health.success_threshold == 0 {
            return Err(err("health", "failure_threshold and success_threshold must be at least 1"));
        }
        if !self.health.path.starts_with('/') {
            return Err(err("health.path", "must start with /"));
        }
        Ok(())
    }

    /// KV events: each source, the lower-tier weight and the prediction window.
    fn check_kv_events(&self) -> Result<(), ConfigError> {
        for k in &self.kv_events {
            k.check().map_err(|m| err("kv_events", m))?;
        }
        if !(0.0..=1.0).contains(&self.kv_lower_tier_weight) {
            return Err(err("kv_lower_tier_weight", format!("must be in [0, 1], got {}", self.kv_lower_tier_weight)));
        }
        if !(0.0..=3600.0).contains(&self.kv_predict_window_secs) {
            return Err(err(
                "kv_predict_window_secs",
                format!("must be in [0, 3600] seconds, got {}", self.kv_predict_window_secs),
            ));
        }
        Ok(())
    }
}

/// Longest accepted timeout or interval (one year), seconds.
pub const MAX_TIMEOUT_SECS: f64 = 31_536_000.0;

/// Most names in `forward_headers`.
pub const MAX_FORWARD_HEADERS: usize = 32;

/// Most groups in `shared_prefix_tenants`.
pub const MAX_TENANT_GROUPS: usize = 10_000;

/// One `worker_allow` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Allow {
    Net(ipnet::IpNet),
    Host(String),
}

fn parse_allow(a: &str) -> Result<Allow, WorkerUrlError> {
    let a = a.trim();
    if let Ok(n) = a.parse::<ipnet::IpNet>() {
        return Ok(Allow::Net(n));
    }
    if let Ok(ip) = a.trim_start_matches('[').trim_end_matches(']').parse::<std::net::IpAddr>() {
        return Ok(Allow::Net(ipnet::IpNet::from(ip)));
    }
    if a.is_empty() || a.contains(['/', ':', '@', ' ']) {
        return Err(WorkerUrlError::BadAllowEntry { entry: a.to_string() });
    }
    Ok(Allow::Host(a.to_ascii_lowercase()))
}

impl GatewayConfig {
    /// Whether the normalised worker URL `u` points at a host `worker_allow` permits.
    ///
    /// # Errors
    /// [`WorkerUrlError::NotAllowed`] naming the host (or `NotAUrl`).
    pub fn check_worker_allowed(&self, u: &str) -> Result<(), WorkerUrlError> {
        if self.worker_allow.is_empty() {
            return Ok(());
        }
        let parsed =
            url::Url::parse(u).map_err(|e| WorkerUrlError::NotAUrl { url: u.to_string(), reason: e.to_string() })?;
        let ip = match parsed.host() {
            Some(url::Host::Ipv4(a)) => Some(std::net::IpAddr::V4(a)),
            Some(url::Host::Ipv6(a)) => Some(std::net::IpAddr::V6(a)),
            _ => None,
        };
        let host = parsed.host_str().unwrap_or_default();
        let ok = self.worker_allow.iter().filter_map(|a| parse_allow(a).ok()).any(|a| match (&a, ip) {
            (Allow::Net(n), Some(ip)) => n.contains(&ip),
            (Allow::Host(h), None) => h == host,
            _ => false,
        });
        if ok { Ok(()) } else { Err(WorkerUrlError::NotAllowed { url: u.to_string(), host: host.to_string() }) }
    }
}

/// How a gateway's ext_proc filter exchanges bodies with the endpoint picker
/// (`epp_body_mode`; Envoy's `ProcessingMode.BodySendMode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EppBodyMode {
    /// What the gateway's `protocol_config` says (Envoy ≥ 1.33 sends it), else full duplex.
    #[default]
    Auto,
    /// Request body `BUFFERED` (one message), response body `STREAMED`.
    Buffered,
    /// Request and response bodies `FULL_DUPLEX_STREAMED`: kvroute passes every chunk back.
    FullDuplex,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_allow_matches_networks_and_host_names() {
        let cfg = GatewayConfig {
            worker_allow: vec!["10.0.0.0/8".into(), "::1".into(), "gpu-node-1".into()],
            ..GatewayConfig::default()
        };
        cfg.validate().expect("valid allow-list");
        assert!(cfg.check_worker_allowed("http://10.1.2.3:8000").is_ok());
        assert!(cfg.check_worker_allowed("http://[::1]:8000").is_ok());
        assert!(cfg.check_worker_allowed("http://gpu-node-1:8000").is_ok());
        assert!(cfg.check_worker_allowed("http://11.0.0.1:8000").unwrap_err().to_string().contains("11.0.0.1"));
        assert!(cfg.check_worker_allowed("http://evil.example:8000").is_err());
        let bad = GatewayConfig { worker_allow: vec!["10.0.0.0/99".into()], ..GatewayConfig::default() };
        assert_eq!(bad.validate().unwrap_err().key, "worker_allow");
        let bad = GatewayConfig { forward_headers: vec!["bad header".into()], ..GatewayConfig::default() };
        assert_eq!(bad.validate().unwrap_err().key, "forward_headers");
        let bad = GatewayConfig { admin_listen: Some("localhost".into()), ..GatewayConfig::default() };
        assert_eq!(bad.validate().unwrap_err().key, "admin_listen");
        let bad = GatewayConfig { epp_tls: true, ..GatewayConfig::default() };
        assert_eq!(bad.validate().unwrap_err().key, "epp_tls", "epp_tls without epp_listen");
        let epp = Some("127.0.0.1:9002".to_string());
        GatewayConfig { epp_tls: true, epp_listen: epp, ..GatewayConfig::default() }.validate().expect("epp_tls");
        // state_dir: a directory, or a path still to be created; not a file, not empty.
        let file = env!("CARGO_MANIFEST_DIR").to_string() + "/Cargo.toml";
        for d in [String::new(), file] {
            let bad = GatewayConfig { state_dir: Some(d), ..GatewayConfig::default() };
            assert_eq!(bad.validate().unwrap_err().key, "state_dir");
        }
        for d in [env!("CARGO_MANIFEST_DIR").to_string(), "/nonexistent/kvroute-state".into()] {
            GatewayConfig { state_dir: Some(d), ..GatewayConfig::default() }.validate().expect("a directory");
        }
    }

    #[test]
    fn the_sync_s_batch_window_is_1_to_1000_ms_and_read_from_toml() {
        for ms in [0, 1001] {
            let bad = GatewayConfig { sync_batch_ms: ms, ..GatewayConfig::default() };
            assert_eq!(bad.validate().unwrap_err().key, "sync_batch_ms", "{ms} ms");
        }
        for ms in [1, 1000] {
            GatewayConfig { sync_batch_ms: ms, ..GatewayConfig::default() }.validate().expect("in range");
        }
        let cfg: GatewayConfig = toml::from_str("sync_batch_ms = 50").expect("toml");
        assert_eq!((cfg.sync_batch_ms, GatewayConfig::default().sync_batch_ms), (50, 20));
    }

    #[test]
    fn the_kv_mover_needs_a_directory_and_slot_routing() {
        let on = |extra: &str| GatewayConfig::from_toml(&format!("[kv_migration]\nenabled = true\n{extra}"));
        assert_eq!(on("").unwrap_err().key, "kv_migration.slot_save_dir");
        let ok = on("slot_save_dir = \"/srv/slots\"").expect("a directory is enough");
        assert_eq!(ok.kv_migration.min_tokens, 1024);
        assert_eq!(on("slot_save_dir = \"/d\"\nmax_files = 0").unwrap_err().key, "kv_migration.max_files");
        assert_eq!(
            on("slot_save_dir = \"/d\"\nprefill_tokens_per_sec = -1.0").unwrap_err().key,
            "kv_migration.prefill_tokens_per_sec"
        );
        let off = GatewayConfig::from_toml(
            "llama_slot_routing = false\n[kv_migration]\nenabled = true\nslot_save_dir = \"/d\"",
        );
        assert_eq!(off.unwrap_err().key, "kv_migration.enabled");
        assert_eq!(GatewayConfig::from_toml("[kv_migration]\nenabld = true").unwrap_err().key, "enabld");
    }

    #[test]
    fn a_non_loopback_admin_listener_needs_a_token() {
        for public in ["0.0.0.0:30001", "[::]:30001", "192.0.2.1:30001"] {
            let bad = GatewayConfig { admin_listen: Some(public.into()), ..GatewayConfig::default() };
            let e = bad.validate().unwrap_err();
            assert_eq!(e.key, "admin_listen", "{public}");
            assert!(e.message.contains("admin_token"), "{e}");
            let ok = GatewayConfig { admin_token: Some("t".into()), ..bad.clone() };
            ok.validate().expect("with a token any address is allowed");
            let ok = GatewayConfig { admin_token_file: Some("/run/secrets/token".into()), ..bad };
            ok.validate().expect("a token from a file too");
        }
        let both = GatewayConfig {
            admin_token: Some("t".into()),
            admin_token_file: Some("/run/secrets/token".into()),
            ..GatewayConfig::default()
        };
        assert_eq!(both.validate().unwrap_err().key, "admin_token_file");
        let empty = GatewayConfig { admin_token_file: Some(String::new()), ..GatewayConfig::default() };
        assert_eq!(empty.validate().unwrap_err().key, "admin_token_file");
        for lo in ["127.0.0.1:30001", "[::1]:30001", "127.0.0.2:30001"] {
            let ok = GatewayConfig { admin_listen: Some(lo.into()), ..GatewayConfig::default() };
            ok.validate().expect(lo);
        }
    }

    #[test]
    fn the_drain_delay_is_part_of_the_drain_timeout_and_zero_turns_delays_and_pings_off() {
        let ok = GatewayConfig { drain_delay_secs: 0.0, http2_keep_alive_secs: 0.0, ..GatewayConfig::default() };
        ok.validate().expect("0 is allowed");
        // A delay longer than the budget is cut to it at shutdown, not refused.
        let long = GatewayConfig { drain_timeout_secs: 3.0, ..GatewayConfig::default() };
        long.validate().expect("a short drain_timeout_secs still starts");
        let neg = GatewayConfig { http2_keep_alive_secs: -1.0, ..GatewayConfig::default() };
        assert_eq!(neg.validate().unwrap_err().key, "http2_keep_alive_secs");
    }

    /// `reload_watch_secs`: 0 (off) or 1 s up to the timeouts' bound; anything else is
    /// refused naming the key (a look more often than once a second is not a reload).
    #[test]
    fn the_reload_watch_is_off_or_at_least_a_second() {
        for ok in [0.0, 1.0, 10.0, MAX_TIMEOUT_SECS] {
            GatewayConfig { reload_watch_secs: ok, ..GatewayConfig::default() }.validate().expect("valid");
        }
        for bad in [0.5, -1.0, f64::NAN, f64::INFINITY, MAX_TIMEOUT_SECS * 2.0] {
            let e = GatewayConfig { reload_watch_secs: bad, ..GatewayConfig::default() }.validate().unwrap_err();
            assert_eq!(e.key, "reload_watch_secs", "{bad}");
        }
    }

    #[test]
    fn worker_urls_are_normalised_and_hostless_or_credentialed_ones_refused() {
        assert_eq!(check_worker_url("HTTP://LocalHost:80/").unwrap(), "http://localhost");
        assert_eq!(check_worker_url(" http://127.0.0.1:8000// ").unwrap(), "http://127.0.0.1:8000");
        assert_eq!(check_worker_url("https://[::1]:443/v").unwrap(), "https://[::1]/v");
        assert!(check_worker_url("http:///x").unwrap_err().to_string().contains("no host"));
        assert!(check_worker_url("ftp://x").unwrap_err().to_string().contains("http and https"));
        let e = check_worker_url("http://user:secret@w1:8000").unwrap_err().to_string();
        assert!(e.contains("credentials") && !e.contains("secret") && e.contains("***@w1:8000"), "{e}");
    }

    #[test]
    fn unknown_keys_and_bad_values_name_the_key() {
        let e = GatewayConfig::from_toml("polcy = \"x\"").expect_err("unknown key");
        assert!(e.to_string().contains("polcy"), "{e}");
        let e = GatewayConfig::from_toml("policy = \"nope\"").expect_err("bad policy");
        assert_eq!(e.key, "policy");
        let e = GatewayConfig::from_toml("[policy_knobs]\ncache_threshold = 7.0").expect_err("bad knob");
        assert_eq!(e.key, "policy_knobs");
        let e = GatewayConfig::from_toml("worker_urls = [\"ftp://x\"]").expect_err("bad url");
        assert_eq!(e.key, "worker_urls");
        let e = GatewayConfig::from_toml("policy_copies = 3").expect_err("one or two copies");
        assert_eq!(e.key, "policy_copies");
        let e = GatewayConfig::from_toml("kv_event_threads = 0").expect_err("a thread at least");
        assert_eq!(e.key, "kv_event_threads");
        let e = GatewayConfig::from_toml("[health]\ninterval_secs = -1.0").expect_err("bad interval");
        assert_eq!(e.key, "health.interval_secs");
        let ok = GatewayConfig::from_toml("policy = \"lmetric\"\nworker_urls = [\"http://127.0.0.1:1/\"]").expect("ok");
        assert_eq!(ok.policy, "lmetric");
    }

    #[test]
    fn the_example_file_is_the_defaults() {
        let text = include_str!("../../../../kvroute.example.toml");
        let cfg = GatewayConfig::from_toml(text).expect("example parses");
        let def = GatewayConfig { worker_urls: cfg.worker_urls.clone(), ..GatewayConfig::default() };
        assert_eq!(cfg, def);
    }
}

/// `llama_slot_routing`: whether the router names llama.cpp slots ([`GatewayConfig::llama_slot_routing`]).
///
/// In TOML and on the command line: `auto`, `true` or `false` (a TOML boolean too).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(try_from = "SlotRoutingRaw", into = "SlotRoutingRaw")]
pub enum SlotRouting {
    /// Per worker, after a probe at join: on when the worker keeps no prompt outside its
    /// slots (llama.cpp `--cache-ram 0`), off when it restores one from a host-memory prompt
    /// cache (llama.cpp's default `--cache-ram 8192`) or the probe fails.
    #[default]
    Auto,
    /// On for every worker with slots.
    On,
    /// Off.
    Off,
}

/// [`SlotRouting`]'s serialised forms: a boolean or `"auto"`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
enum SlotRoutingRaw {
    Bool(bool),
    Text(String),
}

impl TryFrom<SlotRoutingRaw> for SlotRouting {
    type Error = String;
    fn try_from(r: SlotRoutingRaw) -> Result<Self, String> {
        match r {
            SlotRoutingRaw::Bool(b) => Ok(if b { SlotRouting::On } else { SlotRouting::Off }),
            SlotRoutingRaw::Text(t) => t.parse(),
        }
    }
}

impl From<SlotRouting> for SlotRoutingRaw {
    fn from(s: SlotRouting) -> Self {
        match s {
            SlotRouting::Auto => SlotRoutingRaw::Text("auto".into()),
            SlotRouting::On => SlotRoutingRaw::Bool(true),
            SlotRouting::Off => SlotRoutingRaw::Bool(false),
        }
    }
}

impl std::str::FromStr for SlotRouting {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(SlotRouting::Auto),
            "true" | "on" => Ok(SlotRouting::On),
            "false" | "off" => Ok(SlotRouting::Off),
            other => Err(format!("llama_slot_routing is auto, true or false, got `{other}`")),
        }
    }
}
