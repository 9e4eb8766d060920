//! `kvroute engine-sim`: one simulated inference worker over HTTP (vLLM-like).

use anyhow::Context;
use kvroute_engine_sim::{EngineSimConfig, serve};

/// Flags of `kvroute engine-sim`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Listen port (0 = any).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Listen address.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Engine profile (h100-llama3-8b, a100-llama3-8b, cpu-smollm2-135m).
    #[arg(long, default_value = "h100-llama3-8b")]
    pub profile: String,
    /// Overrides of profile constants as JSON, e.g. '{"kv_tokens": 100000}'.
    #[arg(long)]
    pub profile_set: Option<String>,
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
    /// Modelled idle power draw, watts (the DCGM_FI_DEV_POWER_USAGE gauge: idle + SM
    /// activity × (TDP − idle); 75 W, an assumed H100 SXM idle draw).
    #[arg(long, default_value_t = 75.0)]
    pub power_idle_watts: f64,
    /// Modelled power draw at full SM activity, watts (700 W, the H100 SXM's TDP).
    #[arg(long, default_value_t = 700.0)]
    pub power_tdp_watts: f64,
}

/// Runs `kvroute engine-sim`.
pub fn run(a: Args) -> anyhow::Result<()> {
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
    let profile = crate::cmd_replay::load_profile(&a.profile, a.profile_set.as_deref())?;
    let cfg = EngineSimConfig {
        profile,
        time_scale: a.time_scale,
        model: a.model,
        error_rate: a.error_rate,
        hang_rate: a.hang_rate,
        crash_after: a.crash_after,
        fault_seed: a.fault_seed.unwrap_or(if a.port != 0 { u64::from(a.port) } else { u64::from(std::process::id()) }),
        slow_start_secs: a.slow_start_secs,
        max_waiting: 4096,
        kv_events: a.kv_events,
        kv_replay: a.kv_replay,
        kv_encoding: if a.kv_encoding == "legacy" {
            kvroute_protocol::kv_events::Encoding::Legacy
        } else {
            kvroute_protocol::kv_events::Encoding::Map
        },
        kv_topic: a.kv_topic,
        kv_hash_salt: a.kv_hash_salt.unwrap_or_else(|| {
            let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            kvroute_core::hash::stable_hash(
                &[t.as_nanos().to_le_bytes().as_slice(), &std::process::id().to_le_bytes()].concat(),
            )
        }),
        instant: a.instant,
        power_idle_watts: a.power_idle_watts,
        power_tdp_watts: a.power_tdp_watts,
    };
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind((a.host.as_str(), a.port))
            .await
            .with_context(|| format!("cannot listen on {}:{}", a.host, a.port))?;
        eprintln!("kvroute engine-sim: model {} on http://{}", cfg.model, listener.local_addr()?);
        serve(listener, cfg, crate::cmd_serve::shutdown_signal()).await?;
        Ok(())
    })
}
