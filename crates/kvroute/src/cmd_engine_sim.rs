//! `kvroute engine-sim`: one simulated inference worker over HTTP (vLLM-like).

use anyhow::Context;
use kvroute_engine_sim::{EngineSimConfig, Role, SGLANG_DEFAULT_BOOTSTRAP_PORT, TransferModel, serve};

/// Flags of `kvroute engine-sim`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Listen port (0 = any).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Listen address.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// The engine profile (`--profile`, `--profile-file`, `--profile-set`), as replay's.
    #[command(flatten)]
    pub profile: crate::sim_args::ProfileArgs,
    /// Simulated seconds per wall second (10 = ten times faster than the profile).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Model name served.
    #[arg(long, default_value = "sim-llama-3-8b")]
    pub model: String,
    /// Share of requests answered with HTTP 500 (failure injection).
    #[arg(long, default_value_t = 0.0)]
    pub error_rate: f64,
    /// Share of requests that never answer (failure injection).
    #[arg(long, default_value_t = 0.0)]
    pub hang_rate: f64,
    /// Exit after this many requests (failure injection).
    #[arg(long)]
    pub crash_after: Option<u64>,
    /// Seed of the --error-rate/--hang-rate rolls (default: the listening port, or the process id
    /// with `--port 0`: workers fail independently, and a rerun on the same port the same way).
    #[arg(long)]
    pub fault_seed: Option<u64>,
    /// /health answers 503 for this many seconds after start.
    #[arg(long, default_value_t = 0.0)]
    pub slow_start_secs: f64,
    /// Publish KV-cache events (vLLM wire format) on a ZeroMQ PUB socket bound here,
    /// e.g. tcp://127.0.0.1:5557 (`*` binds every interface).
    #[arg(long)]
    pub kv_events: Option<String>,
    /// Serve replays of the last 10,000 batches on a ZeroMQ ROUTER socket bound here.
    #[arg(long, requires = "kv_events")]
    pub kv_replay: Option<String>,
    /// Event encoding: `map` (current vLLM) or `legacy` (positional arrays, older vLLM and SGLang).
    #[arg(long, default_value = "map", value_parser = ["map", "legacy"])]
    pub kv_encoding: String,
    /// Topic frame of published batches.
    #[arg(long, default_value = "kv-events")]
    pub kv_topic: String,
    /// XORed into published block hashes (default: random per process, as vLLM's hash seed
    /// without PYTHONHASHSEED); 0 publishes the plain hashes.
    #[arg(long)]
    pub kv_hash_salt: Option<u64>,
    /// Answer every request at once with one token (no engine model): an instant worker for
    /// measuring router overhead.
    #[arg(long)]
    pub instant: bool,
    /// With a slotted profile (`cpu-smollm2-135m`), keep up to N prompts in a host-memory
    /// prompt cache as llama.cpp's `--cache-ram` does (its default); 0: none, as `--cache-ram 0`.
    #[arg(long, default_value_t = 0)]
    pub host_prompt_cache: usize,
    /// Modelled idle power draw, watts (the DCGM_FI_DEV_POWER_USAGE gauge: idle + SM
    /// activity × (TDP − idle); 75 W, an assumed H100 SXM idle draw).
    #[arg(long, default_value_t = 75.0)]
    pub power_idle_watts: f64,
    /// Modelled power draw at full SM activity, watts (700 W, the H100 SXM's TDP).
    #[arg(long, default_value_t = 700.0)]
    pub power_tdp_watts: f64,
    /// Mean log-probability per output token, nats (<= 0): returned when a request asks for
    /// logprobs (chat `logprobs: true`, completions `logprobs: N`, SGLang `return_logprob`).
    #[arg(long, default_value_t = -0.1, allow_hyphen_values = true, value_name = "Q")]
    pub quality: f64,
    /// Per-prompt spread of the mean log-probability, nats (>= 0): a prompt's mean is
    /// quality + spread × u, u in [-1, 1] from a hash of the prompt text (clamped to <= 0).
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true, value_name = "S")]
    pub quality_spread: f64,
    /// LoRA adapter slots (0 = LoRA off, like vLLM without --enable-lora); loading into full
    /// slots evicts the least recently used adapter.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub lora_slots: usize,
    /// Simulated seconds one LoRA adapter load takes (wall: divided by --time-scale).
    #[arg(long, default_value_t = 0.5, allow_hyphen_values = true, value_name = "S")]
    pub lora_load_secs: f64,
    /// A LoRA adapter loaded at start (repeatable; counts against --lora-slots).
    #[arg(long = "lora", value_name = "NAME=PATH", value_parser = parse_lora)]
    pub lora: Vec<(String, String)>,
    /// An adapter name whose loads always fail with vLLM's 400 (repeatable; failure injection).
    #[arg(long = "lora-fail", value_name = "NAME")]
    pub lora_fail: Vec<String>,
    /// Tensor-parallel size reported by /server_info (the profile alone sets the speed).
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub tp_size: u32,
    /// Weight dtype reported by /server_info.
    #[arg(long, default_value = "bfloat16", value_parser = kvroute_engine_sim::DTYPES)]
    pub dtype: String,
    /// GPU memory per device, GB, reported by /server_info as `vram_gb` (80, the H100 SXM's).
    #[arg(long, default_value_t = 80.0, allow_hyphen_values = true, value_name = "GB")]
    pub vram_gb: f64,
    /// Prefill/decode disaggregation role (SGLang --disaggregation-mode; vLLM NIXL
    /// kv_producer/kv_consumer): `prefill` publishes a prompt's KV on its bootstrap port,
    /// `decode` fetches it from the prefill worker's and only decodes, `both` is an ordinary worker.
    #[arg(long, default_value = "both", value_parser = ["prefill", "decode", "both"])]
    pub role: String,
    /// Bootstrap port of a prefill or decode worker, on --host (SGLang
    /// --disaggregation-bootstrap-port; default 8998 for prefill like SGLang, any free port for decode).
    #[arg(long, value_name = "P")]
    pub bootstrap_port: Option<u16>,
    /// Wall seconds a decode request waits for its KV before failing (SGLang's bootstrap timeout).
    #[arg(long, default_value_t = 300.0, allow_hyphen_values = true, value_name = "S")]
    pub bootstrap_timeout_secs: f64,
    /// KV cache bytes per prompt token copied from prefill to decode (131072 = 128 KiB,
    /// Llama-3-8B fp16: 32 layers x 8 KV heads x 128 dims x 2 x 2 bytes).
    #[arg(long, default_value_t = kvroute_sim::pd::DEFAULT_KV_BYTES_PER_TOKEN, value_name = "N")]
    pub kv_bytes_per_token: u64,
    /// Prefill-to-decode link bandwidth, GB/s (25, a 200 Gb/s RDMA NIC).
    #[arg(long, default_value_t = kvroute_sim::pd::DEFAULT_LINK_GBYTES_PER_S, allow_hyphen_values = true, value_name = "X")]
    pub kv_link_gbytes_per_s: f64,
    /// Fixed cost of one KV transfer, simulated seconds.
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true, value_name = "S")]
    pub kv_transfer_latency_secs: f64,
}

/// `NAME=PATH` of `--lora`.
fn parse_lora(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((name, path)) if !name.is_empty() && !path.is_empty() => Ok((name.to_string(), path.to_string())),
        _ => Err(format!("expected NAME=PATH, got '{s}'")),
    }
}

/// Runs `kvroute engine-sim`: checks the flags, builds the worker's configuration and
/// serves it until Ctrl-C or SIGTERM.
pub fn run(a: Args) -> anyhow::Result<()> {
    check_args(&a)?;
    let (host, port) = (a.host.clone(), a.port);
    let cfg = config(a)?;
    cfg.validate().map_err(|e| anyhow::anyhow!("kvroute engine-sim: {e}"))?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind((host.as_str(), port))
            .await
            .with_context(|| format!("cannot listen on {host}:{port}"))?;
        eprintln!("kvroute engine-sim: model {} on http://{}", cfg.model, listener.local_addr()?);
        if cfg.role != Role::Both {
            // The bound port is reported by /server_info (disaggregation_bootstrap_port).
            eprintln!(
                "kvroute engine-sim: role {}, bootstrap server on {}:{}",
                cfg.role.as_str(),
                cfg.bootstrap_host,
                cfg.bootstrap_port
                    .filter(|p| *p != 0)
                    .map_or("any free port (see /server_info)".to_string(), |p| p.to_string())
            );
        }
        serve(listener, cfg, crate::cmd_serve::shutdown_signal()).await?;
        Ok(())
    })
}

/// The checks clap cannot make: rates in [0, 1], a positive time scale, power idle ≤ TDP,
/// LoRA adapters within the slots.
fn check_args(a: &Args) -> anyhow::Result<()> {
    for (k, v) in [("--error-rate", a.error_rate), ("--hang-rate", a.hang_rate)] {
        if !(0.0..=1.0).contains(&v) {
            anyhow::bail!("{k} must be in [0, 1], got {v}");
        }
    }
    if !(a.time_scale.is_finite() && a.time_scale > 0.0) {
        anyhow::bail!("--time-scale must be > 0, got {}", a.time_scale);
    }
    if !(a.power_idle_watts.is_finite()
        && a.power_tdp_watts.is_finite()
        && 0.0 <= a.power_idle_watts
        && a.power_idle_watts <= a.power_tdp_watts)
    {
        anyhow::bail!("--power-idle-watts and --power-tdp-watts: expected 0 <= idle <= TDP");
    }
    if !a.lora.is_empty() && a.lora_slots == 0 {
        anyhow::bail!("--lora needs --lora-slots N (LoRA is off with 0 slots)");
    }
    if a.lora.len() > a.lora_slots {
        anyhow::bail!("{} adapters given with --lora but --lora-slots is {}", a.lora.len(), a.lora_slots);
    }
    Ok(())
}

/// `--role`, and the bootstrap port it implies (SGLang's 8998 for a prefill worker).
fn role_and_bootstrap_port(a: &Args) -> anyhow::Result<(Role, Option<u16>)> {
    let role = match a.role.as_str() {
        "prefill" => Role::Prefill,
        "decode" => Role::Decode,
        _ => Role::Both,
    };
    if role == Role::Both && a.bootstrap_port.is_some() {
        anyhow::bail!("--bootstrap-port needs --role prefill or decode");
    }
    let bootstrap_port = match (role, a.bootstrap_port) {
        (_, Some(p)) => Some(p),
        (Role::Prefill, None) => Some(SGLANG_DEFAULT_BOOTSTRAP_PORT),
        _ => None,
    };
    Ok((role, bootstrap_port))
}

/// The worker's configuration from the flags (unvalidated).
fn config(a: Args) -> anyhow::Result<EngineSimConfig> {
    let profile = a.profile.load()?;
    let (role, bootstrap_port) = role_and_bootstrap_port(&a)?;
    Ok(EngineSimConfig {
        profile,
        time_scale: a.time_scale,
        error_rate: a.error_rate,
        hang_rate: a.hang_rate,
        crash_after: a.crash_after,
        fault_seed: a.fault_seed.unwrap_or(if a.port != 0 { u64::from(a.port) } else { u64::from(std::process::id()) }),
        slow_start_secs: a.slow_start_secs,
        max_waiting: 4096,
        kv_encoding: if a.kv_encoding == "legacy" {
            kvroute_protocol::kv_events::Encoding::Legacy
        } else {
            kvroute_protocol::kv_events::Encoding::Map
        },
        kv_hash_salt: a.kv_hash_salt.unwrap_or_else(random_hash_salt),
        instant: a.instant,
        host_prompt_cache: a.host_prompt_cache,
        power_idle_watts: a.power_idle_watts,
        power_tdp_watts: a.power_tdp_watts,
        quality: a.quality,
        quality_spread: a.quality_spread,
        lora_slots: a.lora_slots,
        lora_load_secs: a.lora_load_secs,
        tp_size: a.tp_size,
        vram_gb: a.vram_gb,
        role,
        bootstrap_host: a.host.clone(),
        bootstrap_port,
        bootstrap_timeout_secs: a.bootstrap_timeout_secs,
        kv_transfer: TransferModel {
            kv_bytes_per_token: a.kv_bytes_per_token,
            link_gbytes_per_s: a.kv_link_gbytes_per_s,
            latency_secs: a.kv_transfer_latency_secs,
        },
        model: a.model,
        kv_events: a.kv_events,
        kv_replay: a.kv_replay,
        kv_topic: a.kv_topic,
        loras: a.lora,
        lora_fail: a.lora_fail,
        dtype: a.dtype,
    })
}

/// A hash salt of this process (time and pid), as vLLM's hash seed without PYTHONHASHSEED.
fn random_hash_salt() -> u64 {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    kvroute_core::hash::stable_hash(
        &[t.as_nanos().to_le_bytes().as_slice(), &std::process::id().to_le_bytes()].concat(),
    )
}
