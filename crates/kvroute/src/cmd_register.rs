//! `kvroute register`: the sidecar that keeps a worker registered in the cluster registry
//! (etcd) while its health endpoint passes ([`kvroute_gateway::cluster::register`]).

use anyhow::bail;
use kvroute_gateway::cluster::register::{RegisterConfig, run as register};
use kvroute_gateway::cluster::{Capacity, Role, WorkerRecord};
use std::time::Duration;

/// Flags of `kvroute register`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// etcd endpoints (`http://HOST:PORT`, comma separated).
    #[arg(long, env = "KVROUTE_ETCD", required = true, value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// Key prefix (the routers' `--etcd-prefix`).
    #[arg(long, env = "KVROUTE_ETCD_PREFIX", default_value = "/kvroute")]
    pub etcd_prefix: String,
    /// The worker's base URL.
    #[arg(long)]
    pub url: String,
    /// The registration's id (the key is PREFIX/workers/ID); default: the URL's host and port.
    #[arg(long)]
    pub id: Option<String>,
    /// Models served (repeat); none = routers discover them from /v1/models.
    #[arg(long = "model")]
    pub models: Vec<String>,
    /// prefill, decode or both.
    #[arg(long, default_value = "both")]
    pub role: String,
    /// The worker's bootstrap server port (SGLang prefill workers in a disaggregated fleet).
    #[arg(long)]
    pub bootstrap_port: Option<u16>,
    /// Lease TTL, seconds: an unhealthy or vanished worker leaves routing within this long.
    #[arg(long, default_value_t = 10)]
    pub ttl_secs: i64,
    /// Seconds between health checks and lease renewals (default: a third of the TTL).
    #[arg(long)]
    pub check_interval_secs: Option<f64>,
    /// The worker's health path.
    #[arg(long, default_value = "/health")]
    pub health_path: String,
    /// Tensor-parallel size.
    #[arg(long)]
    pub tp_size: Option<u32>,
    /// Weight data type (fp32, fp16, bf16, fp8, int8, int4).
    #[arg(long)]
    pub dtype: Option<String>,
    /// Accelerator memory, GiB.
    #[arg(long)]
    pub vram_gb: Option<f64>,
    /// Most concurrent requests the worker accepts.
    #[arg(long)]
    pub max_concurrent: Option<u32>,
    /// Tokens the worker's KV cache holds (vLLM `num_gpu_blocks × block_size`, SGLang
    /// `max_total_num_tokens`); routers size their estimate of its cache to it.
    #[arg(long)]
    pub kv_tokens: Option<u64>,
    /// A label `KEY=VALUE` (repeat).
    #[arg(long = "label")]
    pub labels: Vec<String>,
}

/// The sidecar's configuration from the flags.
///
/// # Errors
/// A message naming the flag at fault.
pub fn build(a: &Args) -> anyhow::Result<RegisterConfig> {
    let role: Role = serde_json::from_value(serde_json::Value::String(a.role.clone()))
        .map_err(|_| anyhow::anyhow!("--role `{}`: expected prefill, decode or both", a.role))?;
    let mut labels = std::collections::BTreeMap::new();
    for l in &a.labels {
        let Some((k, v)) = l.split_once('=') else { bail!("--label `{l}`: expected KEY=VALUE") };
        labels.insert(k.to_string(), v.to_string());
    }
    let record = WorkerRecord {
        url: a.url.clone(),
        models: a.models.clone(),
        role,
        capacity: Capacity {
            tp_size: a.tp_size,
            dtype: a.dtype.clone(),
            vram_gb: a.vram_gb,
            max_concurrent: a.max_concurrent,
            kv_tokens: a.kv_tokens,
            ..Capacity::default()
        },
        labels,
        bootstrap_port: a.bootstrap_port,
    };
    // The same checks a router applies when it reads the record.
    let record = WorkerRecord::parse(serde_json::to_string(&record)?.as_bytes())
        .map_err(|e| anyhow::anyhow!("the worker record: {e}"))?;
    if !(2..=3600).contains(&a.ttl_secs) {
        bail!("--ttl-secs {}: expected 2 to 3600", a.ttl_secs);
    }
    let interval = a.check_interval_secs.unwrap_or(a.ttl_secs as f64 / 3.0);
    if !(interval > 0.0 && interval < a.ttl_secs as f64) {
        bail!("--check-interval-secs {interval}: expected more than 0 and less than --ttl-secs");
    }
    if !a.etcd_prefix.starts_with('/') || a.etcd_prefix.ends_with('/') {
        bail!("--etcd-prefix `{}`: expected a leading `/` and no trailing `/`", a.etcd_prefix);
    }
    let id = match &a.id {
        Some(id) if !id.is_empty() && !id.contains('/') => id.clone(),
        Some(id) => bail!("--id `{id}`: expected a non-empty name without `/`"),
        None => {
            let u = url::Url::parse(&record.url)?;
            format!("{}_{}", u.host_str().unwrap_or("worker"), u.port_or_known_default().unwrap_or(0))
        }
    };
    if !a.health_path.starts_with('/') {
        bail!("--health-path `{}`: expected a path starting with `/`", a.health_path);
    }
    Ok(RegisterConfig {
        etcd: a.etcd.clone(),
        key: format!("{}/workers/{id}", a.etcd_prefix),
        record,
        ttl_secs: a.ttl_secs,
        check_interval: Duration::from_secs_f64(interval),
        health_path: a.health_path.clone(),
    })
}

/// Runs `kvroute register` until SIGTERM or Ctrl-C, then revokes the lease.
pub fn run(a: Args) -> anyhow::Result<()> {
    let cfg = build(&a)?;
    let _ = rustls::crypto::ring::default_provider().install_default();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    eprintln!("kvroute: registering {} at {} in {:?}", cfg.record.url, cfg.key, cfg.etcd);
    rt.block_on(register(cfg, crate::cmd_serve::next_signal()))
}
